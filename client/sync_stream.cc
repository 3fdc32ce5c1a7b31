#include "client/sync_stream.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {

absl::Status StaleEpochError(absl::string_view address, uint64_t epoch,
                             uint64_t seen) {
  return absl::UnavailableError(absl::StrCat(
      "coordinator", address.empty() ? "" : " ", address,
      " answered for epoch ", epoch, ", older than epoch ", seen,
      " already seen for this shard: a deposed primary; nothing of its answer "
      "is applied"));
}

// --- ChunkReceiver ---

ChunkReceiver::ChunkReceiver(absl::string_view what, uint32_t num_chunks,
                             WireCode wire,
                             std::function<absl::Span<float>(uint32_t)> dest)
    : what_(what), wire_(wire), dest_(std::move(dest)), got_(num_chunks) {}

void ChunkReceiver::Expect(
    WireCode wire, std::function<absl::Span<const float>(uint32_t)> base) {
  wire_ = wire;
  base_ = std::move(base);
}

absl::Status ChunkReceiver::Add(const ChunkPieces& chunk) {
  const uint32_t i = chunk.index;
  if (i >= got_.size() || got_[i]) {
    return absl::InternalError(
        absl::StrCat(what_, " stream out of order at chunk ", i));
  }
  if (!chunk.has_crc32c) {
    return absl::InternalError(
        absl::StrCat(what_, " chunk ", i, " has no crc32c"));
  }
  const absl::Span<float> dest = dest_(i);
  if (chunk.size != WireBytes(wire_, dest.size())) {
    return absl::InternalError(
        absl::StrCat(what_, " chunk ", i, " has ", chunk.size,
                     " bytes; expected ", WireBytes(wire_, dest.size()), " (",
                     dest.size(), " ", DTypeName(wire_.dtype), " values)"));
  }
  if (chunk.ComputeCrc32c() != chunk.crc32c) {
    return absl::DataLossError(absl::StrCat(
        what_, " chunk ", i, " does not match its CRC32C; fetching again"));
  }
  if (base_ == nullptr && wire_.dtype == DType::kFloat32) {
    // The wire bytes are the values' bytes (EncodeValuesTo): straight from
    // the transport's pieces into place.
    chunk.CopyTo(reinterpret_cast<char*>(dest.data()));
  } else {
    // Decoded from the pieces in place (an element cut between two is
    // assembled apart; a blockwise payload in several pieces is made
    // contiguous first); a delta onto its base as it is read, in one pass,
    // as the coordinator computed its state.
    absl::Status s =
        base_ == nullptr
            ? DecodeValuesPieces(chunk.pieces, wire_, dest)
            : DecodeOntoPieces(chunk.pieces, wire_, base_(i), dest);
    if (!s.ok()) {
      return absl::InternalError(absl::StrCat(what_, ": ", s.message()));
    }
  }
  got_[i] = true;
  ++received_;
  bytes_ += chunk.size;
  return absl::OkStatus();
}

absl::Status ChunkReceiver::CheckComplete() const {
  if (received_ == got_.size()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what_, " ended after ", received_,
                                             " of ", got_.size(), " chunks"));
}

// --- StagingPool ---

std::shared_ptr<std::string> StagingPool::Get(size_t bytes) {
  for (std::shared_ptr<std::string>& buffer : buffers_) {
    if (buffer.use_count() == 1) {
      // The writer's last reference went with a release decrement: pair it,
      // so its reads of the old payload happen before the writes that
      // follow.
      std::atomic_thread_fence(std::memory_order_acquire);
      buffer->resize(bytes);
      return buffer;
    }
  }
  auto buffer = std::make_shared<std::string>(bytes, '\0');
  // All in flight: keep up to kMaxBuffers; beyond that a transient one.
  if (buffers_.size() < kMaxBuffers) buffers_.push_back(buffer);
  return buffer;
}

// --- SyncClientStream ---

SyncClientStream::SyncClientStream(MemberState* member, StagingPool* staging,
                                   Clock* clock, SyncStreamOptions options,
                                   ClientStreamSink sink)
    : member_(member),
      staging_(staging),
      clock_(clock),
      options_(std::move(options)),
      sink_(std::move(sink)),
      early_(member->SendsDelta() && options_.early_results),
      chunks_("Sync result", member->num_chunks(), member->result_code(),
              [member](uint32_t j) { return member->ResultSlice(j); }) {
  if (early_) {
    // Early chunks are the round's delta against the anchor.
    chunks_.Expect(member_->result_code(),
                   [member](uint32_t j) { return member->AnchorSlice(j); });
  }
}

void SyncClientStream::Start() {
  start_ = clock_->Now();
  const SyncPlan& plan = member_->plan();
  v1::SyncRequest request;
  v1::SyncHeader* header = request.mutable_header();
  header->set_job_id(options_.job_id);
  header->set_member_id(options_.member_id.str());
  header->set_round(plan.round);
  header->set_seed_round(plan.origin.round);
  header->set_seed_contributors(plan.origin.contributors);
  header->set_layout_fingerprint(options_.layout_fingerprint);
  if (member_->SendsDelta()) header->set_anchor_state_id(member_->anchor_id());
  if (member_->SendsAnchor()) header->set_seed_state_id(plan.origin.state_id);
  header->set_early_results(early_);
  if (plan.round != 0 && plan.weight.has_value()) {
    header->set_weight(*plan.weight);
  }
  if (plan.round != 0 && plan.local_steps >= 0) {
    header->set_local_steps(static_cast<uint32_t>(plan.local_steps));
  }
  ClientStreamAction write;
  write.kind = ClientStreamAction::Kind::kWriteMessage;
  write.message = request.SerializeAsString();
  sink_(std::move(write));
  sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kRead));
}

bool SyncClientStream::MayWrite() const {
  const uint64_t lead = options_.max_lead_chunks;
  return lead == 0 || chunks_.received() == 0 ||
         next_ == member_->num_chunks() ||
         next_ < uint64_t{chunks_.received()} + lead;
}

void SyncClientStream::OnWriteDone(bool ok) {
  if (finished_) return;
  if (!ok) {
    // The call broke; the reads end with it.
    write_phase_ = WritePhase::kDone;
    return;
  }
  switch (write_phase_) {
    case WritePhase::kHeader:
    case WritePhase::kChunks:
      write_phase_ = WritePhase::kChunks;
      WriteNextOrWait();
      return;
    case WritePhase::kWritesDone:
      write_phase_ = WritePhase::kDone;
      outcome_.upload_time = clock_->Now() - start_;
      return;
    case WritePhase::kPaced:  // no write was in flight
    case WritePhase::kDone:
      return;
  }
}

void SyncClientStream::WriteNextOrWait() {
  if (MayWrite()) {
    WriteNext();
  } else {
    write_phase_ = WritePhase::kPaced;
    ++outcome_.paced_writes;
  }
}

void SyncClientStream::WriteNext() {
  write_phase_ = WritePhase::kChunks;
  if (next_ == member_->num_chunks()) {
    write_phase_ = WritePhase::kWritesDone;
    sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kWritesDone));
    return;
  }
  const uint32_t c = next_++;
  const size_t bytes = member_->SendBytes(c);
  ClientStreamAction write;
  write.kind = ClientStreamAction::Kind::kWriteChunk;
  write.index = c;
  write.payload = staging_->Get(bytes);
  member_->EncodeChunk(c, write.payload->data());
  write.crc32c = Crc32c(0, *write.payload);
  outcome_.bytes_sent += bytes;
  sink_(std::move(write));
}

void SyncClientStream::OnChunk(const ChunkPieces& chunk) {
  if (finished_) return;
  AfterRead(TakeChunk(chunk));
}

void SyncClientStream::OnMessage(const v1::SyncResponse& message) {
  if (finished_) return;
  if (message.has_chunk()) {
    AfterRead(TakeChunk(PiecesOf(message.chunk())));
    return;
  }
  AfterRead(TakeResult(message));
}

void SyncClientStream::OnUnreadable(const absl::Status& status) {
  if (finished_) return;
  Fail(absl::InternalError(status.message()));
}

absl::Status SyncClientStream::TakeChunk(const ChunkPieces& chunk) {
  if (read_phase_ == ReadPhase::kAwaitResult && !early_) {
    return absl::InternalError("Sync sent a chunk before its result");
  }
  if (chunks_.received() == 0) {
    outcome_.first_result_time = clock_->Now() - start_;
  }
  absl::Status added = chunks_.Add(chunk);
  if (added.ok() && read_phase_ == ReadPhase::kAwaitResult &&
      options_.on_early != nullptr) {
    options_.on_early(chunk.index, member_->ResultSlice(chunk.index));
  }
  return added;
}

absl::Status SyncClientStream::TakeResult(const v1::SyncResponse& message) {
  if (read_phase_ != ReadPhase::kAwaitResult) {
    return absl::InternalError("Sync sent a second result");
  }
  if (!message.has_result()) {
    return absl::InternalError(
        "Sync sent a message with neither result nor chunk");
  }
  if (message.result().epoch() < options_.min_epoch) {
    return StaleEpochError("", message.result().epoch(), options_.min_epoch);
  }
  read_phase_ = ReadPhase::kReceiving;
  have_result_ = true;
  static_cast<RoundOutcome&>(outcome_) =
      RoundOutcomeFromProto(message.result());
  if (chunks_.received() > 0 &&
      message.result().payload() != v1::RESULT_PAYLOAD_DELTA) {
    return absl::InternalError(
        "Sync sent early result chunks and then a result that is not a "
        "delta");
  }
  return ExpectResult(message.result());
}

absl::Status SyncClientStream::ExpectResult(const v1::SyncResult& result) {
  if (!member_->pseudo_gradients()) {
    if (result.payload() != v1::RESULT_PAYLOAD_UNSPECIFIED) {
      return absl::InternalError(
          "Sync result of a parameter job says it carries a delta or a "
          "float32 state");
    }
    return absl::OkStatus();
  }
  if (result.state_id() == 0) {
    return absl::InternalError(
        "Sync result of a pseudo-gradient job names no state id");
  }
  MemberState* const member = member_;
  switch (result.payload()) {
    case v1::RESULT_PAYLOAD_DELTA:
      chunks_.Expect(member->result_code(),
                     [member](uint32_t j) { return member->AnchorSlice(j); });
      return absl::OkStatus();
    case v1::RESULT_PAYLOAD_STATE:
      chunks_.Expect(DType::kFloat32, nullptr);
      return absl::OkStatus();
    default:
      return absl::InternalError(absl::StrCat(
          "Sync result of a pseudo-gradient job has payload ", result.payload(),
          "; is the coordinator a compatible version?"));
  }
}

void SyncClientStream::AfterRead(absl::Status taken) {
  if (!taken.ok()) {
    Fail(std::move(taken));
    return;
  }
  sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kRead));
  if (write_phase_ == WritePhase::kPaced && MayWrite()) WriteNext();
}

void SyncClientStream::OnReadsDone() {
  if (finished_) return;
  read_phase_ = ReadPhase::kEnded;
  Finish(absl::OkStatus());
}

void SyncClientStream::Fail(absl::Status error) {
  error_ = error;
  Finish(std::move(error));
}

void SyncClientStream::Finish(absl::Status status) {
  finished_ = true;
  outcome_.bytes_received = chunks_.bytes();
  outcome_.result_time = clock_->Now() - start_;
  sink_(ClientStreamAction::Finish(std::move(status)));
}

absl::Status SyncClientStream::Conclude(const absl::Status& call_status) {
  if (!error_.ok()) return error_;
  if (!call_status.ok()) return call_status;
  if (!have_result_) {
    return absl::UnavailableError("Sync ended without its result");
  }
  return chunks_.CheckComplete();
}

// --- FetchStateClientStream ---

FetchStateClientStream::FetchStateClientStream(MemberState* member,
                                               absl::Span<float> params,
                                               v1::FetchStateRequest request,
                                               ClientStreamSink sink,
                                               uint64_t min_epoch)
    : member_(member),
      request_(std::move(request)),
      sink_(std::move(sink)),
      chunks_("FetchState", member->num_chunks(), member->StateCode(),
              [member, params](uint32_t j) {
                return member->FetchSlice(params, j);
              }),
      min_epoch_(min_epoch) {}

void FetchStateClientStream::Start() {
  ClientStreamAction write;
  write.kind = ClientStreamAction::Kind::kWriteMessage;
  write.message = request_.SerializeAsString();
  sink_(std::move(write));
  sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kWritesDone));
  sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kRead));
}

void FetchStateClientStream::OnChunk(const ChunkPieces& chunk) {
  if (finished_) return;
  After(header_
            ? chunks_.Add(chunk)
            : absl::InternalError("FetchState sent a chunk before its header"));
}

void FetchStateClientStream::OnMessage(const v1::FetchStateResponse& message) {
  if (finished_) return;
  if (message.has_chunk()) {
    OnChunk(PiecesOf(message.chunk()));
    return;
  }
  if (!message.has_header()) {
    After(absl::InternalError(
        "FetchState sent a message with neither header nor chunk"));
    return;
  }
  if (header_) {
    After(absl::InternalError("FetchState sent a second header"));
    return;
  }
  if (message.header().epoch() < min_epoch_) {
    After(StaleEpochError("", message.header().epoch(), min_epoch_));
    return;
  }
  header_ = true;
  epoch_ = message.header().epoch();
  round_ = message.header().round();
  state_id_ = message.header().state_id();
  After(message.header().num_chunks() == member_->num_chunks()
            ? absl::OkStatus()
            : absl::InternalError(absl::StrCat(
                  "FetchState header says ", message.header().num_chunks(),
                  " chunks; this member's shard has ", member_->num_chunks())));
}

void FetchStateClientStream::OnUnreadable(const absl::Status& status) {
  if (finished_) return;
  After(absl::InternalError(status.message()));
}

void FetchStateClientStream::OnReadsDone() {
  if (finished_) return;
  finished_ = true;
  sink_(ClientStreamAction::Finish(absl::OkStatus()));
}

void FetchStateClientStream::After(absl::Status taken) {
  if (taken.ok()) {
    sink_(ClientStreamAction::Of(ClientStreamAction::Kind::kRead));
    return;
  }
  finished_ = true;
  error_ = taken;
  sink_(ClientStreamAction::Finish(std::move(taken)));
}

absl::Status FetchStateClientStream::Conclude(const absl::Status& call_status) {
  if (!error_.ok()) return error_;
  if (!call_status.ok()) return call_status;
  if (!header_) {
    return absl::UnavailableError("FetchState ended without its header");
  }
  return chunks_.CheckComplete();
}

}  // namespace localsgd
