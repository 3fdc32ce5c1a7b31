#include "src/state_commit.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "src/codec.h"

namespace localsgd {
namespace {

// to = from[offset, offset + to.size()), or zeros if `from` is empty.
void CopyOrZero(const std::vector<float>& from, size_t offset,
                absl::Span<float> to) {
  if (from.empty()) {
    std::fill(to.begin(), to.end(), 0.0f);
  } else {
    std::copy_n(from.begin() + offset, to.size(), to.begin());
  }
}

// The averaging rule of a pseudo-gradient job (parameter jobs average
// parameters: MeanOfParameters). The settings are validated before a job
// exists (Coordinator::Join, checkpoint restore): a mode without a rule here
// is a bug, not bad input.
std::unique_ptr<AveragingRule> RuleFor(const JobSettings& settings) {
  if (settings.contribution != Contribution::kPseudoGradients) return nullptr;
  absl::StatusOr<std::unique_ptr<AveragingRule>> rule =
      MakeAveragingRule(settings);
  CHECK(rule.ok()) << rule.status();
  return *std::move(rule);
}

// Float32 values as the bytes of a float32 payload, for the codec's
// vectorized scans (FirstNonFinite, MaxAbs).
absl::string_view BytesOf(absl::Span<const float> values) {
  return absl::string_view(reinterpret_cast<const char*>(values.data()),
                           values.size() * sizeof(float));
}

bool AllFinite(absl::Span<const float> values) {
  return FirstNonFinite(BytesOf(values), DType::kFloat32) < 0;
}

float MaxAbsOf(absl::Span<const float> values) {
  return MaxAbs(BytesOf(values), DType::kFloat32);
}

float MaxAbsOf(const std::vector<float>& from, size_t offset, size_t len) {
  if (from.empty()) return 0.0f;
  return MaxAbsOf(absl::MakeConstSpan(from).subspan(offset, len));
}

}  // namespace

StateCommit::StateCommit(const JobSettings& settings,
                         const ChunkGeometry& geometry)
    : settings_(settings),
      geometry_(geometry),
      rule_(RuleFor(settings)),
      encodes_mean_(rule_ != nullptr &&
                    settings.mean_encoding == MeanEncoding::kWire &&
                    settings.wire_dtype != DType::kFloat32),
      encodes_step_(rule_ != nullptr &&
                    settings.wire_dtype != DType::kFloat32 &&
                    !(encodes_mean_ && rule_->steps_by_mean())) {}

uint64_t StateCommit::NewStateId() {
  uint64_t id = 0;
  while (id == 0) id = absl::Uniform<uint64_t>(bitgen_);
  return id;
}

void StateCommit::Restore(RoundId round, std::vector<float> values, uint64_t id,
                          std::vector<float> momentum,
                          std::vector<float> residual,
                          std::vector<float> mean_residual,
                          std::vector<uint64_t> ancestors) {
  auto state = std::make_shared<StateSnapshot>();
  state->round = round;
  state->values = std::move(values);
  state->id = id != 0 ? id : NewStateId();
  state->momentum = std::move(momentum);
  state->residual = std::move(residual);
  state->mean_residual = std::move(mean_residual);
  state->ancestors = std::move(ancestors);
  if (state->ancestors.size() > MaxAncestors()) {
    state->ancestors.resize(MaxAncestors());
  }
  state_ = std::move(state);
  magnitudes_.clear();
}

size_t StateCommit::MaxAncestors() const {
  return settings_.contribution == Contribution::kPseudoGradients &&
                 settings_.max_staleness > 0
             ? static_cast<size_t>(settings_.max_staleness)
             : 0;
}

int StateCommit::Staleness(uint64_t id) const {
  if (state_ == nullptr || id == 0) return -1;
  if (id == state_->id) return 0;
  for (size_t i = 0; i < state_->ancestors.size(); ++i) {
    if (state_->ancestors[i] == id) return static_cast<int>(i + 1);
  }
  return -1;
}

std::vector<float> StateCommit::TakeBuffer() {
  HarvestRetired();
  return Recycled(spare_, geometry_.num_elements());
}

void StateCommit::GiveBack(std::vector<float> buffer) {
  if (spare_.empty()) spare_ = std::move(buffer);
}

std::vector<float> StateCommit::Recycled(std::vector<float>& spare, size_t n) {
  std::vector<float> buffer = std::move(spare);
  spare.clear();
  buffer.resize(n);
  return buffer;
}

std::shared_ptr<StateSnapshot> StateCommit::Mean(RoundAccumulator sums) const {
  auto state = std::make_shared<StateSnapshot>();
  state->values = MeanOfParameters(std::move(sums), state_->values);
  // Store exactly what members receive, so that a late joiner's fetched
  // state equals what the others hold.
  RoundTripInPlace(absl::MakeSpan(state->values), settings_.wire_dtype);
  return state;
}

std::shared_ptr<StateSnapshot> StateCommit::NewNext() {
  HarvestRetired();
  const WireCode wire = ResultCodeOf(settings_);
  const size_t n = geometry_.num_elements();
  auto next = std::make_shared<StateSnapshot>();
  next->previous_id = state_->id;
  next->delta = std::move(spare_delta_);
  spare_delta_.clear();
  next->delta.resize(
      WireBytes(wire, geometry_.chunk_elements()) *
          (geometry_.num_chunks() - 1) +
      WireBytes(wire, geometry_.Size(geometry_.num_chunks() - 1)));
  if (rule_->has_momentum()) next->momentum = Recycled(spare_momentum_, n);
  if (encodes_step_) next->residual = Recycled(spare_residual_, n);
  if (encodes_mean_) {
    next->mean_residual = Recycled(spare_mean_residual_, n);
  }
  return next;
}

bool StateCommit::FinalizeChunk(RoundAccumulator& sums, uint32_t c,
                                StateSnapshot& next) const {
  const bool contributed = sums.chunk_weight(c) > 0;
  const absl::Span<float> chunk = sums.scaled_sums(c);
  if (contributed) DivideInPlace(chunk, sums.scaled_weight(c));
  std::string encoded;
  if (contributed && encodes_mean_) EncodeMean(chunk, c, next, &encoded);
  return FinalizeMean(chunk, contributed, c, next, encoded);
}

void StateCommit::EncodeMean(absl::Span<float> chunk, uint32_t c,
                             StateSnapshot& next,
                             std::string* encoded_mean) const {
  const WireCode wire = ResultCodeOf(settings_);
  const size_t offset = geometry_.Offset(c);
  const absl::Span<float> residual =
      absl::MakeSpan(next.mean_residual).subspan(offset, chunk.size());
  CopyOrZero(state_->mean_residual, offset, residual);
  encoded_mean->resize(WireBytes(wire, chunk.size()));
  EncodeWithFeedback(chunk, residual, wire, encoded_mean->data(), chunk);
}

absl::Status StateCommit::DecodeMean(absl::string_view encoded_mean, uint32_t c,
                                     StateSnapshot& next,
                                     absl::Span<float> chunk,
                                     absl::string_view what) const {
  const WireCode wire = ResultCodeOf(settings_);
  const size_t bytes = WireBytes(wire, chunk.size());
  if (encoded_mean.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": an encoded mean of ", encoded_mean.size(), " bytes; chunk ", c,
        " takes ", bytes, " in ", DTypeName(wire.dtype)));
  }
  const absl::Span<const absl::string_view> pieces =
      absl::MakeConstSpan(&encoded_mean, 1);
  if (absl::Status s = CheckPayloadPieces(pieces, wire, chunk.size());
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "'s encoded mean: ", s.message()));
  }
  if (const int64_t at = FirstNonFinitePieces(pieces, wire, chunk.size());
      at >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "'s encoded mean is not finite at element ", at));
  }
  if (absl::Status s = DecodeValues(encoded_mean, wire, chunk); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  const absl::Span<float> residual =
      absl::MakeSpan(next.mean_residual)
          .subspan(geometry_.Offset(c), chunk.size());
  std::fill(residual.begin(), residual.end(), 0.0f);
  return absl::OkStatus();
}

bool StateCommit::FinalizeMean(absl::Span<float> chunk, bool contributed,
                               uint32_t c, StateSnapshot& next,
                               absl::string_view encoded_mean) const {
  const WireCode wire = ResultCodeOf(settings_);
  const StateSnapshot& old = *state_;
  const size_t offset = geometry_.Offset(c);
  const size_t len = chunk.size();
  // Carried over from the old state (zeros after a seed or a restore
  // without them), then updated in place.
  absl::Span<float> momentum;
  if (rule_->has_momentum()) {
    momentum = absl::MakeSpan(next.momentum).subspan(offset, len);
    CopyOrZero(old.momentum, offset, momentum);
  }
  absl::Span<float> residual;
  if (encodes_step_) {
    residual = absl::MakeSpan(next.residual).subspan(offset, len);
    CopyOrZero(old.residual, offset, residual);
  }
  // Written by EncodeMean or DecodeMean for a chunk someone gave.
  absl::Span<float> mean_residual;
  if (encodes_mean_) {
    mean_residual = absl::MakeSpan(next.mean_residual).subspan(offset, len);
    if (!contributed) CopyOrZero(old.mean_residual, offset, mean_residual);
  }
  char* out =
      next.delta.data() + WireBytes(wire, geometry_.chunk_elements()) * c;
  if (contributed) {
    // mean delta (or what its encoding decodes to) -> the rule's step ->
    // encoded with the residual -> what the encoding decodes to (in
    // place), as every member decodes it.
    rule_->Step(chunk, momentum, momentum);
    if (encodes_mean_ && !encodes_step_) {
      // The step is the encoded mean: members get its bytes and add what
      // they decode to, which `chunk` holds.
      CHECK_EQ(encoded_mean.size(), WireBytes(wire, len));
      std::copy(encoded_mean.begin(), encoded_mean.end(), out);
    } else if (encodes_step_) {
      EncodeWithFeedback(chunk, residual, wire, out, chunk);
    } else {
      // float32 decodes to itself: the step is what members add.
      EncodeValuesTo(chunk, wire, out);
    }
  } else {
    // No one contributed: the chunk keeps its state, momentum and
    // residuals; its delta is zeros.
    std::fill(chunk.begin(), chunk.end(), 0.0f);
    EncodeValuesTo(chunk, wire, out);
  }
  const auto previous = absl::MakeConstSpan(old.values).subspan(offset, len);
  AddInPlace(chunk, previous);
  if (!contributed || (AllFinite(chunk) && AllFinite(momentum) &&
                       AllFinite(residual) && AllFinite(mean_residual))) {
    return true;
  }
  // The guard (CheckHeadroom) admits no contribution that gets here; were
  // one to, the chunk keeps its state rather than commit a non-finite one.
  std::copy(previous.begin(), previous.end(), chunk.begin());
  if (!momentum.empty()) CopyOrZero(old.momentum, offset, momentum);
  if (!residual.empty()) CopyOrZero(old.residual, offset, residual);
  if (!mean_residual.empty()) {
    CopyOrZero(old.mean_residual, offset, mean_residual);
  }
  std::fill(chunk.begin(), chunk.end(), 0.0f);
  EncodeValuesTo(chunk, wire, out);
  std::copy(previous.begin(), previous.end(), chunk.begin());
  return false;
}

std::shared_ptr<StateSnapshot> StateCommit::FinishNext(
    RoundAccumulator sums, const std::vector<uint32_t>& pending,
    std::shared_ptr<StateSnapshot> next) const {
  for (uint32_t c : pending) {
    if (!FinalizeChunk(sums, c, *next)) {
      LOG(ERROR) << "chunk " << c
                 << " of a round's result was not finite; it keeps its state";
    }
  }
  next->values = sums.TakeBuffer();
  return next;
}

absl::Status StateCommit::CheckHeadroom(uint32_t c, float max_abs) {
  const size_t offset = geometry_.Offset(c);
  const size_t len = geometry_.Size(c);
  if (magnitudes_.size() != geometry_.num_chunks()) {
    magnitudes_.assign(geometry_.num_chunks(), ChunkMagnitudes());
  }
  ChunkMagnitudes& m = magnitudes_[c];
  if (!m.known) {
    m.values = MaxAbsOf(state_->values, offset, len);
    m.momentum = MaxAbsOf(state_->momentum, offset, len);
    m.residual = MaxAbsOf(state_->residual, offset, len);
    m.mean_residual = MaxAbsOf(state_->mean_residual, offset, len);
    m.known = true;
  }
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  constexpr double kLimit = kFloatMax;
  // What float32 rounding can add to what the rule computes (a few
  // operations of relative error 2^-24 each), with room to spare. The sum
  // with the old values needs none: a sum at most kFloatMax in magnitude
  // rounds to at most kFloatMax.
  constexpr double kRounding = 1.01;
  // What the rule gets: the mean, or what its encoding with the mean
  // residual decodes to (no larger than what the encoder gets), and what
  // the new mean residual can reach.
  const double mean =
      encodes_mean_ ? kRounding * (max_abs + m.mean_residual) : max_abs;
  const double mean_residual = encodes_mean_ ? 2 * mean : 0.0;
  const double step = rule_->StepBound(mean, m.momentum);
  const double momentum = kRounding * rule_->MomentumBound(mean, m.momentum);
  // What the encoder gets (step + residual; what it decodes to is no
  // larger), what the new state and the new residual can reach.
  const double encoded =
      kRounding * (step + (encodes_step_ ? m.residual : 0.0));
  const double values = m.values + encoded;
  const double residual = encodes_step_ ? 2 * encoded : 0.0;
  const char* what = nullptr;
  double reach = 0;
  if (values > kLimit) {
    what = "the state's values";
    reach = values;
  } else if (momentum > kLimit) {
    what = "the outer momentum";
    reach = momentum;
  } else if (residual > kLimit) {
    what = "the coordinator's quantization residual";
    reach = residual;
  } else if (mean_residual > kLimit) {
    what = "the coordinator's mean residual";
    reach = mean_residual;
  }
  if (what == nullptr) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat(
      "a delta of magnitude up to ", max_abs, " in chunk ", c,
      " would overflow ", what, " (up to ", reach,
      " with the state's |values| ", m.values, ", |momentum| ", m.momentum,
      ", |residual| ", m.residual, ", |mean residual| ", m.mean_residual,
      "; float32 holds up to ", kFloatMax, ")"));
}

std::shared_ptr<const StateSnapshot> StateCommit::Commit(
    std::shared_ptr<StateSnapshot> state, RoundId round) {
  state->round = round;
  if (state->id == 0) state->id = NewStateId();
  state->ancestors.clear();
  if (state_ != nullptr && state->previous_id != 0 &&
      state->previous_id == state_->id && MaxAncestors() > 0) {
    state->ancestors.push_back(state_->id);
    for (uint64_t id : state_->ancestors) {
      if (state->ancestors.size() >= MaxAncestors()) break;
      state->ancestors.push_back(id);
    }
  }
  std::shared_ptr<StateSnapshot> old = std::move(state_);
  state_ = state;
  magnitudes_.clear();
  // Recycle the old state's memory for the next accumulator, now or, if a
  // stream (or the checkpointer, or the job's released state) still reads
  // it, once it no longer does.
  if (old != nullptr) {
    if (old.use_count() == 1) {
      Harvest(*old);
    } else {
      retired_.push_back(std::move(old));
      if (retired_.size() > kRetired) retired_.erase(retired_.begin());
    }
  }
  return state;
}

void StateCommit::Harvest(StateSnapshot& old) {
  if (spare_.empty()) spare_ = std::move(old.values);
  if (spare_momentum_.empty()) spare_momentum_ = std::move(old.momentum);
  if (spare_residual_.empty()) spare_residual_ = std::move(old.residual);
  if (spare_mean_residual_.empty()) {
    spare_mean_residual_ = std::move(old.mean_residual);
  }
  if (spare_delta_.empty()) spare_delta_ = std::move(old.delta);
}

void StateCommit::HarvestRetired() {
  // A state only this holds: no one can read it again (states are handed
  // out as shared_ptr, never weak_ptr).
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->use_count() == 1) {
      Harvest(**it);
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace localsgd
