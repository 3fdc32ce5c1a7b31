#include "server/streams.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/convert.h"
#include "server/protocol.h"

namespace localsgd {
namespace {

StreamAction Read() {
  StreamAction a;
  a.kind = StreamAction::Kind::kRead;
  return a;
}

StreamAction WriteMessage(const google::protobuf::MessageLite& message) {
  StreamAction a;
  a.kind = StreamAction::Kind::kWriteMessage;
  a.message = message.SerializeAsString();
  return a;
}

StreamAction WriteChunk(std::shared_ptr<const StateWire> wire, uint32_t index) {
  StreamAction a;
  a.kind = StreamAction::Kind::kWriteChunk;
  a.index = index;
  a.chunk = wire->Get(index);
  a.wire = std::move(wire);
  return a;
}

// Delivers kFinish with `status` through a copy of `sink`: the sink may
// destroy the machine that holds the original.
void DeliverFinish(const StreamSink& sink, absl::Status status) {
  StreamSink call = sink;
  StreamAction a;
  a.kind = StreamAction::Kind::kFinish;
  a.status = std::move(status);
  call(std::move(a));
}

// Admission of a stream, if any.
absl::StatusOr<std::shared_ptr<void>> Admit(const StreamAdmission& admit,
                                            const std::string& job_id,
                                            const std::string& member_hex) {
  if (!admit) return std::shared_ptr<void>();
  return admit(job_id, member_hex);
}

}  // namespace

// ---------------------------------------------------------------------------
// Sync

SyncServerStream::SyncServerStream(Coordinator* coordinator, WireCache* wires,
                                   StreamAdmission admit, StreamSink sink)
    : coordinator_(coordinator),
      wires_(wires),
      admit_(std::move(admit)),
      sink_(std::move(sink)) {}

void SyncServerStream::Start() {
  absl::MutexLock lock(&mu_);
  ReadLocked();
}

void SyncServerStream::OnMessage(const v1::SyncRequest& message) {
  if (message.has_header()) {
    OnHeader(message.header());
  } else if (message.has_chunk()) {
    OnChunk(PiecesOf(message.chunk()));
  } else {
    OnUnreadable(absl::InvalidArgumentError(
        "Sync message has neither header nor chunk"));
  }
}

void SyncServerStream::OnUnreadable(absl::Status status) {
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    if (!error_.ok() ||
        (phase_ != Phase::kAwaitHeader && phase_ != Phase::kReceiving)) {
      return;  // no read was asked for
    }
    FailLocked(std::move(status));
    finish = AdvanceLocked();
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnHeader(const v1::SyncHeader& header) {
  {
    bool open = false;
    std::optional<Finish> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!error_.ok()) return;
      if (phase_ == Phase::kAwaitHeader) {
        phase_ = Phase::kOpening;
        open = true;
      } else if (phase_ == Phase::kReceiving) {
        FailLocked(absl::InvalidArgumentError(
            "Sync stream has a second header; one stream carries one round"));
        finish = AdvanceLocked();
      }
    }
    if (!open) {
      Deliver(std::move(finish));
      return;
    }
  }
  // Outside mu_: admission takes the security layer's locks, and the core
  // may run the callback before BeginSync returns (a late member's result
  // is ready at once).
  std::shared_ptr<void> admission;
  std::shared_ptr<Job> job;
  MemberId member;
  absl::Status status = [&]() -> absl::Status {
    // --- security: credentials, member binding, stream limit (auth.h).
    absl::StatusOr<std::shared_ptr<void>> admitted =
        Admit(admit_, header.job_id(), header.member_id());
    if (!admitted.ok()) return admitted.status();
    admission = *std::move(admitted);
    if (absl::Status s = ResolveMember(*coordinator_, header.job_id(),
                                       header.member_id(), &job, &member);
        !s.ok()) {
      return s;
    }
    return CheckFingerprint(
        *job, header.layout_fingerprint(),
        absl::StrCat("Sync header for round ", header.round()));
  }();
  std::optional<Finish> finish;
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    admission_ = std::move(admission);
    FailLocked(std::move(status));
    finish = FinishLocked(error_);
  } else {
    // Full duplex: result chunks as they become final.
    FinalChunksCallback on_final;
    if (header.early_results() && header.round() != 0 &&
        job->settings().contribution == Contribution::kPseudoGradients) {
      auto link = std::make_shared<FinalLink>();
      {
        absl::MutexLock lock(&link->mu);
        link->stream = this;
      }
      on_final = [link](std::vector<uint32_t> indices,
                        std::shared_ptr<const StateSnapshot> next) {
        absl::MutexLock lock(&link->mu);
        if (link->stream != nullptr) {
          link->stream->OnFinalChunks(std::move(indices), std::move(next));
        }
      };
      absl::MutexLock lock(&mu_);
      link_ = std::move(link);
    }
    {
      absl::MutexLock lock(&mu_);
      admission_ = std::move(admission);
      job_ = job;
      callback_pending_ = true;
    }
    absl::StatusOr<std::unique_ptr<SyncSession>> session = job->BeginSync(
        member, header.round(),
        [this](absl::StatusOr<SyncResult> result) {
          OnResult(std::move(result));
        },
        SeedOrigin{header.seed_round(), header.seed_contributors(),
                   header.seed_state_id()},
        header.anchor_state_id(), std::move(on_final),
        SyncWork{header.has_local_steps()
                     ? static_cast<int64_t>(header.local_steps())
                     : -1,
                 header.has_weight() ? std::optional<double>(header.weight())
                                     : std::nullopt});
    absl::MutexLock lock(&mu_);
    if (!session.ok()) {
      callback_pending_ = false;
      FailLocked(session.status());
      finish = FinishLocked(error_);
    } else {
      session_ = *std::move(session);
      phase_ = Phase::kReceiving;
      if (!error_.ok()) {
        // Cancelled while opening: withdraw the callback now.
        FailLocked(error_);
      } else if (session_->complete()) {
        phase_ = Phase::kAwaitResult;
      } else {
        ReadLocked();
      }
      finish = AdvanceLocked();
    }
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnChunk(const ChunkPieces& chunk) {
  SyncSession* session = nullptr;
  {
    std::optional<Finish> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!error_.ok()) return;
      if (phase_ == Phase::kReceiving) {
        session = session_.get();
      } else if (phase_ == Phase::kAwaitHeader) {
        FailLocked(absl::InvalidArgumentError(
            "Sync stream sent a chunk before its header"));
        finish = AdvanceLocked();
      }
    }
    if (session == nullptr) {
      Deliver(std::move(finish));
      return;
    }
  }
  // Outside mu_: the chunk may complete the round, whose close runs this
  // stream's callback. Only the read path touches the session's chunks.
  absl::Status status =
      CheckChunkCrc(chunk, absl::StrCat("Sync round ", session->round()));
  if (status.ok()) status = session->AddChunk(chunk.index, chunk.pieces);
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    if (!status.ok()) {
      FailLocked(std::move(status));
    } else if (session_->complete()) {
      if (phase_ == Phase::kReceiving) phase_ = Phase::kAwaitResult;
    } else if (error_.ok()) {
      ReadLocked();
    }
    finish = AdvanceLocked();
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnReadsDone() {
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) {
      if (phase_ == Phase::kAwaitHeader) {
        FailLocked(
            absl::InvalidArgumentError("Sync stream ended before its header"));
      } else if (phase_ == Phase::kReceiving) {
        FailLocked(absl::InvalidArgumentError(absl::StrCat(
            "Sync stream for round ", session_->round(), " ended after ",
            session_->received(), " of ", session_->num_chunks(), " chunks")));
      }
      // Later, the client merely half-closed after its last chunk.
    }
    finish = AdvanceLocked();
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnWriteDone(bool ok) {
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    if (!writing_) return;
    writing_ = false;
    if (phase_ == Phase::kSending) {
      while (next_chunk_ < wire_->num_chunks() && sent_[next_chunk_]) {
        ++next_chunk_;
      }
      if (!ok) {
        finish = FinishLocked(absl::CancelledError(
            "the client went away while receiving the result"));
      } else if (cancelled_) {
        finish =
            FinishLocked(absl::CancelledError("Sync cancelled by the client"));
      } else if (next_chunk_ >= wire_->num_chunks()) {
        finish = FinishLocked(absl::OkStatus());
      } else {
        WriteChunkLocked();
      }
    } else {
      // An early result chunk went out (full duplex).
      if (!ok) {
        FailLocked(absl::CancelledError(
            "the client went away while receiving the result"));
      } else if (error_.ok() && !result_ready()) {
        WriteEarlyLocked();
      }
      finish = AdvanceLocked();
    }
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnFinalChunks(
    std::vector<uint32_t> indices, std::shared_ptr<const StateSnapshot> next) {
  absl::MutexLock lock(&mu_);
  if (!error_.ok() || job_ == nullptr ||
      (phase_ != Phase::kOpening && phase_ != Phase::kReceiving &&
       phase_ != Phase::kAwaitResult)) {
    return;  // the stream fails, or its result header is out
  }
  if (wire_ == nullptr) {
    wire_ = wires_->For(*job_, std::move(next), /*delta=*/true);
    sent_.assign(wire_->num_chunks(), false);
  } else if (wire_->state() != next) {
    return;  // not this round's (the core sends only its own)
  }
  final_queue_.insert(final_queue_.end(), indices.begin(), indices.end());
  if (!writing_ && !result_ready()) WriteEarlyLocked();
}

void SyncServerStream::WriteEarlyLocked() {
  while (!final_queue_.empty()) {
    const uint32_t index = final_queue_.front();
    final_queue_.pop_front();
    if (index >= sent_.size() || sent_[index]) continue;
    sent_[index] = true;
    writing_ = true;
    sink_(WriteChunk(wire_, index));
    return;
  }
}

void SyncServerStream::SendRestEarlyLocked() {
  // Early chunks went out, and the round closed before the member's upload
  // ended (its deadline, a member gone, or a member that is not one of its
  // participants): the core tells no more chunks final, but a member may
  // write chunk c only once results up to about c came back (a paced
  // upload, ClientOptions::max_lead_chunks). Every chunk of the result is
  // final now; they go out early, in order, each once, while the member
  // still writes, and the header after its last chunk as always.
  if (rest_queued_ || wire_ == nullptr) return;  // or nothing went early
  if (!EarlyWireFitsLocked()) {
    FailLocked(EarlyMismatchLocked());
    return;
  }
  rest_queued_ = true;
  final_queue_.clear();
  for (uint32_t c = 0; c < sent_.size(); ++c) {
    if (!sent_[c]) final_queue_.push_back(c);
  }
  if (!writing_) WriteEarlyLocked();
}

bool SyncServerStream::EarlyWireFitsLocked() const {
  return wire_->state() == (*result_)->state && (*result_)->delta;
}

absl::Status SyncServerStream::EarlyMismatchLocked() const {
  // Early chunks went out of another state than the result's: a bug of the
  // core; the member must not apply them.
  LOG(DFATAL) << "Sync of job " << job_->id()
              << ": early result chunks of another state than the result";
  return absl::InternalError(
      "the coordinator sent early result chunks of another state than its "
      "result; retry");
}

void SyncServerStream::OnCancel() {
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    FailLocked(absl::CancelledError("Sync cancelled by the client"));
    finish = AdvanceLocked();
  }
  Deliver(std::move(finish));
}

void SyncServerStream::OnResult(absl::StatusOr<SyncResult> result) {
  std::optional<Finish> finish;
  {
    absl::MutexLock lock(&mu_);
    callback_pending_ = false;
    result_ = std::move(result);
    finish = AdvanceLocked();
  }
  Deliver(std::move(finish));
}

SyncServerStream::Phase SyncServerStream::phase() const {
  absl::MutexLock lock(&mu_);
  return phase_;
}

std::shared_ptr<Job> SyncServerStream::job() const {
  absl::MutexLock lock(&mu_);
  return job_;
}

RoundId SyncServerStream::round() const {
  absl::MutexLock lock(&mu_);
  return session_ == nullptr ? 0 : session_->round();
}

absl::Status SyncServerStream::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

void SyncServerStream::FailLocked(absl::Status status) {
  if (error_.ok()) error_ = std::move(status);
  if (session_ != nullptr && callback_pending_ && session_->Cancel()) {
    callback_pending_ = false;
  }
}

std::optional<SyncServerStream::Finish> SyncServerStream::AdvanceLocked() {
  switch (phase_) {
    case Phase::kOpening:  // OnHeader decides
    case Phase::kSending:  // the writes drive
    case Phase::kFinished:
      return std::nullopt;
    default:
      break;
  }
  if (error_.ok() && phase_ == Phase::kReceiving && result_.has_value()) {
    if (!result_->ok()) {
      // The round failed for this member (the job stops): its remaining
      // chunks cannot change that, and a member that paces its upload on
      // the results would wait for them.
      FailLocked(result_->status());
    } else {
      SendRestEarlyLocked();
    }
  }
  if (!error_.ok()) {
    if (callback_pending_ || writing_) {
      phase_ = Phase::kDraining;
      return std::nullopt;
    }
    return FinishLocked(error_);
  }
  if (phase_ != Phase::kAwaitResult || !result_.has_value()) {
    return std::nullopt;
  }
  // The result header waits for an early chunk's write in flight.
  if (writing_) return std::nullopt;
  if (!result_->ok()) return FinishLocked(result_->status());
  // Early chunks went out of wire_: the result's state in the delta form
  // (the cache may hold another state's by now: it keeps one per job).
  std::shared_ptr<const StateWire> wire =
      wire_ != nullptr && EarlyWireFitsLocked()
          ? wire_
          : wires_->For(*job_, (*result_)->state, (*result_)->delta);
  if (wire_ != nullptr && wire != wire_)
    return FinishLocked(EarlyMismatchLocked());
  phase_ = Phase::kSending;
  if (wire_ == nullptr) sent_.assign(wire->num_chunks(), false);
  wire_ = std::move(wire);
  final_queue_.clear();
  next_chunk_ = 0;
  v1::SyncResponse response;
  RoundOutcomeToProto(**result_, response.mutable_result());
  response.mutable_result()->set_epoch(coordinator_->epoch());
  if (job_->settings().contribution == Contribution::kPseudoGradients) {
    response.mutable_result()->set_payload(
        wire_->form() == StateWire::Form::kDelta ? v1::RESULT_PAYLOAD_DELTA
                                                 : v1::RESULT_PAYLOAD_STATE);
  }
  writing_ = true;
  sink_(WriteMessage(response));
  return std::nullopt;
}

std::optional<SyncServerStream::Finish> SyncServerStream::FinishLocked(
    absl::Status status) {
  if (phase_ == Phase::kFinished) return std::nullopt;
  phase_ = Phase::kFinished;
  return Finish{std::move(status), std::move(admission_)};
}

void SyncServerStream::ReadLocked() { sink_(Read()); }

void SyncServerStream::WriteChunkLocked() {
  sent_[next_chunk_] = true;
  writing_ = true;
  sink_(WriteChunk(wire_, next_chunk_++));
}

void SyncServerStream::Deliver(std::optional<Finish> finish) {
  if (!finish.has_value()) return;
  // No call of the core's reaches the machine from now on (one under way
  // ends first).
  std::shared_ptr<FinalLink> link;
  {
    absl::MutexLock lock(&mu_);
    link = link_;
  }
  if (link != nullptr) {
    absl::MutexLock lock(&link->mu);
    link->stream = nullptr;
  }
  // The member's stream is over once it sees the status: its admission (a
  // stream slot) goes back first, or its next stream could find it taken.
  finish->admission.reset();
  DeliverFinish(sink_, std::move(finish->status));
}

// ---------------------------------------------------------------------------
// FetchState

FetchStateServerStream::FetchStateServerStream(Coordinator* coordinator,
                                               WireCache* wires,
                                               StreamAdmission admit,
                                               StreamSink sink)
    : coordinator_(coordinator),
      wires_(wires),
      admit_(std::move(admit)),
      sink_(std::move(sink)) {}

void FetchStateServerStream::Start(const v1::FetchStateRequest& request) {
  if (phase_ != Phase::kAwaitRequest) return;
  std::shared_ptr<const StateSnapshot> state;
  absl::Status status = [&]() -> absl::Status {
    // --- security: credentials, member binding, stream limit (auth.h).
    absl::StatusOr<std::shared_ptr<void>> admitted =
        Admit(admit_, request.job_id(), request.member_id());
    if (!admitted.ok()) return admitted.status();
    admission_ = *std::move(admitted);
    MemberId member;
    if (absl::Status s = ResolveMember(*coordinator_, request.job_id(),
                                       request.member_id(), &job_, &member);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckFingerprint(*job_, request.layout_fingerprint(),
                                          "FetchState request");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::shared_ptr<const StateSnapshot>> got =
        job_->GetState(member);
    if (!got.ok()) return got.status();
    state = *std::move(got);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    Finish(std::move(status));
    return;
  }
  wire_ = wires_->For(*job_, std::move(state));
  phase_ = Phase::kSending;
  v1::FetchStateResponse response;
  v1::StateHeader* header = response.mutable_header();
  header->set_round(wire_->round());
  header->set_num_chunks(wire_->num_chunks());
  header->set_epoch(coordinator_->epoch());
  if (job_->settings().contribution == Contribution::kPseudoGradients) {
    header->set_state_id(wire_->state()->id);
  }
  sink_(WriteMessage(response));
}

void FetchStateServerStream::OnUnreadable(absl::Status status) {
  if (phase_ != Phase::kAwaitRequest) return;
  Finish(std::move(status));
}

void FetchStateServerStream::OnWriteDone(bool ok) {
  if (phase_ != Phase::kSending) return;
  if (!ok) {
    Finish(absl::CancelledError("the client went away while fetching state"));
  } else if (next_chunk_ >= wire_->num_chunks()) {
    Finish(absl::OkStatus());
  } else {
    sink_(WriteChunk(wire_, next_chunk_++));
  }
}

void FetchStateServerStream::Finish(absl::Status status) {
  phase_ = Phase::kFinished;
  admission_.reset();  // before the member sees the status
  DeliverFinish(sink_, std::move(status));
}

}  // namespace localsgd
