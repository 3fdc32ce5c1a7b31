#include "client/member_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/codec.h"

namespace localsgd {

void MemberState::OnJoined(const JoinInfo& info, uint64_t total) {
  shard_ = info.shard;
  wire_ = WireCodeOf(info.settings);
  result_ = ResultCodeOf(info.settings);
  global_ = ChunkGeometry(total, info.settings.chunk_elements);
  local_ = ChunkGeometry(info.num_elements, info.settings.chunk_elements);
  state_round_ = info.state_round;
  pseudo_gradients_ =
      info.settings.contribution == Contribution::kPseudoGradients;
  if (pseudo_gradients_) {
    // resize keeps what the anchor and the residual held before a re-join.
    anchor_.resize(local_.num_elements());
    next_.resize(local_.num_elements());
    if (wire_.dtype != DType::kFloat32) {
      residual_.resize(local_.num_elements(), 0.0f);
      residual_next_.resize(local_.num_elements(), 0.0f);
    }
  }
  kept_chunk_.assign(local_.num_chunks(), false);
}

WireCode MemberState::StateCode() const {
  return pseudo_gradients_ ? WireCode(DType::kFloat32) : wire_;
}

absl::Span<float> MemberState::Slice(absl::Span<float> params,
                                     uint32_t j) const {
  const uint32_t g = j * shard_.count + shard_.index;
  return params.subspan(global_.Offset(g), global_.Size(g));
}

uint64_t MemberState::GlobalOffset(uint32_t j) const {
  return global_.Offset(j * shard_.count + shard_.index);
}

absl::Span<const float> MemberState::AnchorSlice(uint32_t j) const {
  return absl::MakeConstSpan(anchor_).subspan(local_.Offset(j), local_.Size(j));
}

absl::Span<float> MemberState::NextSlice(uint32_t j) {
  return absl::MakeSpan(next_).subspan(local_.Offset(j), local_.Size(j));
}

void MemberState::BeginSync(const SyncPlan& plan, absl::Span<float> params) {
  plan_ = plan;
  params_ = params;
  if (!pseudo_gradients_) kept_.resize(local_.num_elements());
  kept_chunk_.assign(local_.num_chunks(), false);
}

void MemberState::BeginAttempt() {
  RollBack();
  // Each chunk's error feedback starts from the committed residual when the
  // chunk is encoded (EncodeDelta), in the stream, rather than in one copy
  // of the whole residual here before it.
  residual_encoded_.assign(residual_.empty() ? 0 : local_.num_chunks(), false);
}

WireCode MemberState::SendCode() const {
  return pseudo_gradients_ && plan_.round == 0 ? WireCode(DType::kFloat32)
                                               : wire_;
}

size_t MemberState::SendBytes(uint32_t c) const {
  return WireBytes(SendCode(), local_.Size(c));
}

void MemberState::EncodeChunk(uint32_t c, char* out) {
  const absl::Span<const float> values =
      SendsAnchor() ? AnchorSlice(c)
      : kept_chunk_[c]
          ? absl::MakeConstSpan(kept_).subspan(local_.Offset(c), local_.Size(c))
          : Slice(params_, c);
  if (SendsDelta()) {
    EncodeDelta(c, values, out);
  } else {
    EncodeValuesTo(values, SendCode(), out);
  }
}

void MemberState::EncodeDelta(uint32_t c, absl::Span<const float> params,
                              char* out) {
  const absl::Span<const float> anchor = AnchorSlice(c);
  if (wire_.dtype == DType::kFloat32) {
    // Nothing to round and no residual: the difference straight into the
    // payload (one pass; a float32 payload is the values' bytes).
    SubtractTo(params, anchor, out);
    return;
  }
  absl::Span<float> residual;
  if (!residual_.empty()) {
    // This attempt's feedback for the chunk starts from the committed one
    // (a chunk encoded again in the attempt encodes the same bytes).
    residual =
        absl::MakeSpan(residual_next_).subspan(local_.Offset(c), params.size());
    if (error_reset_) {
      // The committed residual is in the parameters, hence in the delta.
      std::fill(residual.begin(), residual.end(), 0.0f);
    } else {
      const auto from = absl::MakeConstSpan(residual_).subspan(local_.Offset(c),
                                                               params.size());
      std::copy(from.begin(), from.end(), residual.begin());
    }
    if (residual_encoded_.size() != local_.num_chunks()) {
      residual_encoded_.assign(local_.num_chunks(), false);
    }
    residual_encoded_[c] = true;
  }
  if (IsCodeDType(wire_.dtype) && !residual.empty()) {
    // The delta and its encoding in one pass, nothing kept but the residual.
    EncodeDeltaWithFeedback(params, anchor, residual, wire_, out);
    return;
  }
  delta_.resize(params.size());
  SubtractTo(params, anchor, reinterpret_cast<char*>(delta_.data()));
  decoded_.resize(params.size());
  EncodeWithFeedback(delta_, residual, wire_, out, absl::MakeSpan(decoded_));
}

absl::Span<float> MemberState::ResultSlice(uint32_t j) {
  if (pseudo_gradients_) return NextSlice(j);
  const absl::Span<float> slice = Slice(params_, j);
  if (!kept_chunk_[j]) {
    std::copy(slice.begin(), slice.end(), kept_.begin() + local_.Offset(j));
    kept_chunk_[j] = true;
  }
  return slice;
}

void MemberState::CommitSync(const RoundOutcome& outcome) {
  state_round_ = outcome.round;
  if (plan_.round != 0) last_contributors_ = outcome.contributors;
  if (!pseudo_gradients_) return;
  anchor_.swap(next_);
  const bool counted = SendsDelta() && outcome.contributed;
  SetAnchorId(outcome.state_id, counted);
  if (error_reset_ && plan_.last && !residual_.empty()) {
    std::fill(residual_.begin(), residual_.end(), 0.0f);
  }
  if (!plan_.result_to_params) return;
  CopyAnchorTo(params_);
  if (error_reset_ && counted && !plan_.last && !residual_.empty()) {
    // The member trains on from the global state plus its unsent work.
    for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
      AddInPlace(Slice(params_, j), absl::MakeConstSpan(residual_).subspan(
                                        local_.Offset(j), local_.Size(j)));
    }
  }
}

void MemberState::RollBack() {
  for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
    if (!kept_chunk_[j]) continue;
    const auto from =
        absl::MakeConstSpan(kept_).subspan(local_.Offset(j), local_.Size(j));
    std::copy(from.begin(), from.end(), Slice(params_, j).begin());
    kept_chunk_[j] = false;
  }
}

void MemberState::CopyAnchorTo(absl::Span<float> params) const {
  for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
    const absl::Span<const float> from = AnchorSlice(j);
    std::copy(from.begin(), from.end(), Slice(params, j).begin());
  }
}

void MemberState::SetAnchorId(uint64_t id, bool contributed) {
  anchor_id_ = id;
  if (residual_.empty()) return;
  if (contributed) {
    // A chunk this Sync did not encode keeps its residual.
    for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
      if (j < residual_encoded_.size() && residual_encoded_[j]) continue;
      const auto from = absl::MakeConstSpan(residual_).subspan(local_.Offset(j),
                                                               local_.Size(j));
      std::copy(from.begin(), from.end(),
                residual_next_.begin() + local_.Offset(j));
    }
    residual_.swap(residual_next_);
  } else {
    std::fill(residual_.begin(), residual_.end(), 0.0f);
  }
}

absl::Span<float> MemberState::FetchSlice(absl::Span<float> params,
                                          uint32_t j) {
  // A pseudo-gradient job's state goes into the next anchor and becomes the
  // anchor and the parameters once the fetch succeeded, so a fetch that
  // fails leaves them as they were; a parameter job's straight into
  // `params` (a failed fetch is retried whole).
  return pseudo_gradients_ ? NextSlice(j) : Slice(params, j);
}

absl::Status MemberState::CommitFetch(RoundId round, uint64_t state_id,
                                      absl::Span<float> params) {
  if (pseudo_gradients_) {
    if (state_id == 0) {
      return absl::InternalError(
          "FetchState of a pseudo-gradient job names no state id");
    }
    anchor_.swap(next_);
    SetAnchorId(state_id, /*contributed=*/false);
    CopyAnchorTo(params);
  }
  state_round_ = round;
  return absl::OkStatus();
}

}  // namespace localsgd
