#include "server/service.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "proto/chunk_wire.h"
#include "server/convert.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {
namespace {

// Looks up the job and member named by a request.
absl::Status Resolve(Coordinator* coordinator, const std::string& job_id,
                     const std::string& member_hex, std::shared_ptr<Job>* job,
                     MemberId* member) {
  absl::StatusOr<std::shared_ptr<Job>> j = coordinator->FindJob(job_id);
  if (!j.ok()) return j.status();
  absl::StatusOr<MemberId> m = ParseMemberId(member_hex);
  if (!m.ok()) return m.status();
  *job = *std::move(j);
  *member = *std::move(m);
  return absl::OkStatus();
}

// Counts a call that ended with a non-OK status.
void CountRejected(Metrics* metrics, absl::string_view method,
                   const grpc::Status& status) {
  if (metrics != nullptr && !status.ok()) {
    metrics->RequestRejected(
        method, static_cast<absl::StatusCode>(status.error_code()));
  }
}

// Payload counters of a job, or none.
struct ByteCounters {
  prometheus::Counter* received = nullptr;
  prometheus::Counter* sent = nullptr;
  void Received(size_t n) const {
    if (received != nullptr) received->Increment(static_cast<double>(n));
  }
  void Sent(size_t n) const {
    if (sent != nullptr) sent->Increment(static_cast<double>(n));
  }
};

ByteCounters CountersFor(Metrics* metrics, const Job& job) {
  if (metrics == nullptr) return {};
  const Metrics::JobCounters c = metrics->ForJob(job.id());
  return {c.bytes_received, c.bytes_sent};
}

// Chunk `index` of `state` in the wire dtype, as a serialized chunk message
// (the field is the same in SyncResponse and FetchStateResponse) whose
// payload is not copied: fp32 on the wire is the state's own bytes, another
// wire dtype is encoded once per state for every member
// (StateSnapshot::WireChunk); the message keeps the state alive until gRPC
// has sent it. Sets `*payload_bytes` to the payload's size.
grpc::ByteBuffer StateChunkMessage(
    const std::shared_ptr<const StateSnapshot>& state,
    const ChunkGeometry& geometry, DType wire_dtype, uint32_t index,
    size_t* payload_bytes) {
  const auto values =
      absl::MakeConstSpan(state->values)
          .subspan(geometry.Offset(index), geometry.Size(index));
  const size_t bytes = WireBytes(wire_dtype, values.size());
  absl::string_view data;
  if (wire_dtype == DType::kFloat32) {  // EncodeValuesTo would memcpy
    data =
        absl::string_view(reinterpret_cast<const char*>(values.data()), bytes);
  } else {
    data = state->WireChunk(index, bytes, [&](char* out) {
      EncodeValuesTo(values, wire_dtype, out);
    });
  }
  // Every member receives the same bytes: their checksum is computed once.
  const uint32_t crc = state->WireCrc(index, [&] { return Crc32c(0, data); });
  *payload_bytes = data.size();
  return ChunkMessage(index, crc, data, state);
}

// The layout fingerprint a Sync header or FetchState request names must be
// the job's: a member whose model changed under it must not mix it in.
absl::Status CheckFingerprint(const Job& job, uint64_t fingerprint,
                              absl::string_view what) {
  if (fingerprint == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " has no layout_fingerprint; send the fingerprint of the "
                     "layout the member joined with"));
  }
  if (fingerprint != job.layout().fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " names layout fingerprint ",
                     absl::Hex(fingerprint, absl::kZeroPad16), " but job '",
                     job.id(), "' averages layout ",
                     absl::Hex(job.layout().fingerprint, absl::kZeroPad16),
                     "; the member's model is not the job's (did it change?)"));
  }
  return absl::OkStatus();
}

// A chunk's checksum, checked before its data goes anywhere.
absl::Status CheckChunkCrc(const ChunkView& chunk, absl::string_view what) {
  if (!chunk.has_crc32c) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " chunk ", chunk.index, " has no crc32c"));
  }
  const uint32_t crc = chunk.ComputeCrc32c();
  if (crc != chunk.crc32c) {
    return absl::DataLossError(absl::StrCat(
        what, " chunk ", chunk.index, " is corrupt: its data has CRC32C ",
        absl::Hex(crc, absl::kZeroPad8), ", the chunk says ",
        absl::Hex(chunk.crc32c, absl::kZeroPad8),
        "; nothing of it was counted, resend it"));
  }
  return absl::OkStatus();
}

// One Sync stream. Reads the header and the chunks, feeding them to the
// core's SyncSession; once every chunk is in and the round's result has come
// (in either order), writes the result header and chunks, then finishes.
//
// Lifetime: gRPC deletes the reactor in OnDone, which may run on another
// thread as soon as Finish is called. So Finish is decided under mu_ (once)
// but called after mu_ is released, as the last use of `this`; and it is
// called only when no core callback can still arrive (it has run, or
// SyncSession::Cancel said it never will).
class SyncReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  SyncReactor(CoordinatorService* service, Coordinator* coordinator,
              Metrics* metrics, CallerCredentials caller)
      : service_(service),
        coordinator_(coordinator),
        metrics_(metrics),
        caller_(std::move(caller)) {
    service_->StreamStarted();
    StartRead(&raw_request_);
  }

  void OnReadDone(bool ok) override {
    std::optional<grpc::Status> finish;
    if (!ok) {
      // The client half-closed or the call broke.
      absl::MutexLock lock(&mu_);
      if (session_ == nullptr) {
        FailLocked(
            absl::InvalidArgumentError("Sync stream ended before its header"));
      } else if (!session_->complete()) {
        FailLocked(absl::InvalidArgumentError(absl::StrCat(
            "Sync stream for round ", session_->round(), " ended after ",
            session_->received(), " of ", session_->num_chunks(), " chunks")));
      }
      finish = AdvanceLocked();
    } else {
      // A plain chunk is read in place from gRPC's slices; anything else
      // (the header, an unusual encoding) is parsed by protobuf.
      absl::Status status;
      if (ParseChunkMessage(raw_request_, &chunk_) == ChunkParse::kChunk) {
        status = OnChunk(chunk_);
      } else {
        status = ParseMessage(raw_request_, &request_, "Sync message");
        if (status.ok()) {
          status = request_.has_header() ? OnHeader(request_.header())
                   : request_.has_chunk()
                       ? OnChunk(ViewOf(request_.chunk()))
                       : absl::InvalidArgumentError(
                             "Sync message has neither header nor chunk");
        }
      }
      chunk_ = ChunkView();  // let go of the slices
      absl::MutexLock lock(&mu_);
      if (!status.ok()) {
        FailLocked(status);
      } else if (session_->complete()) {
        reads_done_ = true;
      } else if (!finished_) {
        StartRead(&raw_request_);
      }
      finish = AdvanceLocked();
    }
    if (finish) Done(*finish);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (ok) counters_.Sent(response_payload_bytes_);
      if (!ok) {
        finish = FinishLocked(
            grpc::Status(grpc::StatusCode::CANCELLED,
                         "client went away while receiving the result"));
      } else {
        finish = WriteNextLocked();
      }
    }
    if (finish) Done(*finish);
  }

  void OnCancel() override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      FailLocked(absl::CancelledError("Sync cancelled by the client"));
      finish = AdvanceLocked();
    }
    if (finish) Done(*finish);
  }

  void OnDone() override {
    service_->StreamDone();
    delete this;
  }

 private:
  // Finishes the call; the last use of `this` (see the class comment).
  void Done(const grpc::Status& status) {
    CountRejected(metrics_, "Sync", status);
    // The member's stream is over once it sees the status: free its slot
    // before, or its next stream could find the slot still taken.
    CoordinatorService::StreamSlot slot;
    {
      absl::MutexLock lock(&mu_);
      slot = std::move(stream_slot_);
    }
    slot = CoordinatorService::StreamSlot();
    Finish(status);
  }

  absl::Status OnHeader(const v1::SyncHeader& header) {
    {
      absl::MutexLock lock(&mu_);
      if (header_seen_) {
        return absl::InvalidArgumentError(
            "Sync stream has a second header; one stream carries one round");
      }
      header_seen_ = true;
    }
    // --- security: credentials, member binding, stream limit (auth.h).
    CoordinatorService::StreamSlot slot;
    if (absl::Status s = service_->AdmitStream(caller_, header.job_id(),
                                               header.member_id(), &slot);
        !s.ok()) {
      return s;
    }
    {
      // A cancel may have finished the call meanwhile; then the slot goes
      // back at once (its destructor).
      absl::MutexLock lock(&mu_);
      if (!finished_) stream_slot_ = std::move(slot);
    }
    MemberId member;
    std::shared_ptr<Job> job;
    if (absl::Status s = Resolve(coordinator_, header.job_id(),
                                 header.member_id(), &job, &member);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckFingerprint(
            *job, header.layout_fingerprint(),
            absl::StrCat("Sync header for round ", header.round()));
        !s.ok()) {
      return s;
    }
    const ByteCounters counters = CountersFor(metrics_, *job);
    {
      absl::MutexLock lock(&mu_);
      callback_pending_ = true;
      job_ = job;
      counters_ = counters;
    }
    // The callback may run before BeginSync returns (a late member's result
    // is ready at once), so mu_ is not held across the call.
    absl::StatusOr<std::unique_ptr<SyncSession>> session = job->BeginSync(
        member, header.round(), [this](absl::StatusOr<SyncResult> result) {
          std::optional<grpc::Status> finish;
          {
            absl::MutexLock lock(&mu_);
            callback_pending_ = false;
            result_ = std::move(result);
            finish = AdvanceLocked();
          }
          if (finish) Done(*finish);
        });
    absl::MutexLock lock(&mu_);
    if (!session.ok()) {
      callback_pending_ = false;
      return session.status();
    }
    session_ = *std::move(session);
    return absl::OkStatus();
  }

  absl::Status OnChunk(const ChunkView& chunk) {
    SyncSession* session;
    {
      absl::MutexLock lock(&mu_);
      session = session_.get();
      if (session != nullptr) counters_.Received(chunk.size);
    }
    if (session == nullptr) {
      return absl::InvalidArgumentError(
          "Sync stream sent a chunk before its header");
    }
    if (absl::Status s =
            CheckChunkCrc(chunk, absl::StrCat("Sync round ", session->round()));
        !s.ok()) {
      return s;
    }
    // Only this reactor's read path touches the session's chunk state, and
    // reads are sequential.
    return session->AddChunk(chunk.index, chunk.pieces);
  }

  // Records the first error; the stream finishes with it once no core
  // callback is pending.
  void FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (error_.ok()) error_ = std::move(status);
    if (session_ != nullptr && callback_pending_ && session_->Cancel()) {
      callback_pending_ = false;
    }
  }

  // Decides the next step; returns the status to Finish with, if it is time.
  std::optional<grpc::Status> AdvanceLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return std::nullopt;
    if (!error_.ok()) {
      if (callback_pending_) return std::nullopt;
      return FinishLocked(ToGrpcStatus(error_));
    }
    if (!reads_done_ || !result_.has_value()) return std::nullopt;
    if (!result_->ok()) return FinishLocked(ToGrpcStatus(result_->status()));
    writing_ = true;
    v1::SyncResponse response;
    RoundOutcomeToProto(**result_, response.mutable_result());
    response_ = SerializeMessage(response);
    response_payload_bytes_ = 0;
    next_chunk_ = 0;
    StartWrite(&response_);
    return std::nullopt;
  }

  std::optional<grpc::Status> WriteNextLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const ChunkGeometry& geometry = job_->geometry();
    if (cancelled_) return FinishLocked(grpc::Status::CANCELLED);
    if (next_chunk_ >= geometry.num_chunks()) {
      return FinishLocked(grpc::Status::OK);
    }
    response_ = StateChunkMessage((*result_)->state, geometry,
                                  job_->settings().wire_dtype, next_chunk_++,
                                  &response_payload_bytes_);
    StartWrite(&response_);
    return std::nullopt;
  }

  std::optional<grpc::Status> FinishLocked(grpc::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return std::nullopt;
    finished_ = true;
    return status;
  }

  CoordinatorService* const service_;
  Coordinator* const coordinator_;
  Metrics* const metrics_;  // may be null
  // Read path only: the message read, and it parsed.
  grpc::ByteBuffer raw_request_;
  ChunkView chunk_;
  v1::SyncRequest request_;
  // --- security: the call's credentials.
  const CallerCredentials caller_;

  absl::Mutex mu_;
  // Taken in OnHeader, given back in Done (before Finish).
  CoordinatorService::StreamSlot stream_slot_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Job> job_ ABSL_GUARDED_BY(mu_);
  ByteCounters counters_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SyncSession> session_ ABSL_GUARDED_BY(mu_);
  bool header_seen_ ABSL_GUARDED_BY(mu_) = false;
  bool callback_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::StatusOr<SyncResult>> result_ ABSL_GUARDED_BY(mu_);
  // The message being written (serialized) and its chunk payload's size.
  grpc::ByteBuffer response_ ABSL_GUARDED_BY(mu_);
  size_t response_payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t next_chunk_ ABSL_GUARDED_BY(mu_) = 0;
};

// Streams a snapshot of the job's state: a header, then every chunk.
class FetchStateReactor final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchStateReactor(CoordinatorService* service, Coordinator* coordinator,
                    Metrics* metrics, const grpc::ByteBuffer& raw_request,
                    const CallerCredentials& caller)
      : service_(service), metrics_(metrics) {
    service_->StreamStarted();
    v1::FetchStateRequest request;
    if (absl::Status p =
            ParseMessage(raw_request, &request, "FetchState request");
        !p.ok()) {
      Done(ToGrpcStatus(p));
      return;
    }
    MemberId member;
    // --- security: credentials, member binding, stream limit (auth.h).
    if (absl::Status a = service_->AdmitStream(
            caller, request.job_id(), request.member_id(), &stream_slot_);
        !a.ok()) {
      Done(ToGrpcStatus(a));
      return;
    }
    absl::Status s = Resolve(coordinator, request.job_id(), request.member_id(),
                             &job_, &member);
    if (s.ok()) {
      s = CheckFingerprint(*job_, request.layout_fingerprint(),
                           "FetchState request");
    }
    if (s.ok()) {
      counters_ = CountersFor(metrics_, *job_);
      absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
          job_->GetState(member);
      if (state.ok()) {
        state_ = *std::move(state);
      } else {
        s = state.status();
      }
    }
    if (!s.ok()) {
      Done(ToGrpcStatus(s));
      return;
    }
    v1::FetchStateResponse response;
    v1::StateHeader* header = response.mutable_header();
    header->set_round(state_->round);
    header->set_num_chunks(job_->geometry().num_chunks());
    response_ = SerializeMessage(response);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED,
                        "client went away while fetching state"));
      return;
    }
    counters_.Sent(response_payload_bytes_);
    const ChunkGeometry& geometry = job_->geometry();
    if (next_chunk_ >= geometry.num_chunks()) {
      Done(grpc::Status::OK);
      return;
    }
    response_ = StateChunkMessage(state_, geometry, job_->settings().wire_dtype,
                                  next_chunk_++, &response_payload_bytes_);
    StartWrite(&response_);
  }

  void OnDone() override {
    service_->StreamDone();
    delete this;
  }

 private:
  void Done(const grpc::Status& status) {
    CountRejected(metrics_, "FetchState", status);
    // Free the member's slot before it sees the status (writes are
    // sequential: nothing else touches it now).
    stream_slot_ = CoordinatorService::StreamSlot();
    Finish(status);
  }

  CoordinatorService* const service_;
  Metrics* const metrics_;  // may be null
  ByteCounters counters_;
  CoordinatorService::StreamSlot stream_slot_;  // --- security
  std::shared_ptr<Job> job_;
  std::shared_ptr<const StateSnapshot> state_;
  // The message being written (serialized) and its chunk payload's size.
  grpc::ByteBuffer response_;
  size_t response_payload_bytes_ = 0;
  uint32_t next_chunk_ = 0;
};

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      Metrics* metrics,
                                      absl::string_view method,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const grpc::Status grpc_status = ToGrpcStatus(status);
  CountRejected(metrics, method, grpc_status);
  reactor->Finish(grpc_status);
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::Join(
    grpc::CallbackServerContext* context, const v1::JoinRequest* request,
    v1::JoinResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    // --- security: the job's token; the member is bound to the caller.
    absl::StatusOr<Principal> principal =
        AuthorizeCall(CallerFromContext(*context), request->job_id());
    if (!principal.ok()) return principal.status();
    absl::StatusOr<JoinRequestParams> params =
        JoinParamsFromProto(*request, principal->BindingKey());
    if (!params.ok()) return params.status();
    absl::StatusOr<JoinResult> result =
        coordinator_->Join(request->job_id(), *std::move(params));
    if (!result.ok()) return result.status();
    const CoordinatorOptions& options = coordinator_->options();
    JoinInfo info;
    info.member_id = result->member_id;
    info.settings = result->settings;
    info.lease_ttl = options.policy.lease_ttl;
    info.round_deadline = options.policy.round_deadline;
    info.min_quorum = options.policy.min_quorum;
    info.max_message_bytes = static_cast<uint64_t>(max_message_bytes_);
    info.has_state = result->has_state;
    info.state_round = result->state_round;
    info.num_chunks = result->geometry.num_chunks();
    info.num_elements = result->geometry.num_elements();
    info.shard = options.shard;
    JoinInfoToProto(info, response);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    LOG(WARNING) << "Join of '" << request->member_name() << "' to job '"
                 << request->job_id() << "' from " << context->peer()
                 << " refused: " << status;
  }
  return FinishUnary(context, metrics_, "Join", status);
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(
    grpc::CallbackServerContext* context, const v1::LeaveRequest* request,
    v1::LeaveResponse* response) {
  // --- security: the job's token and the member's binding.
  if (absl::Status s = AuthorizeMemberCall(
          CallerFromContext(*context), request->job_id(), request->member_id());
      !s.ok()) {
    return FinishUnary(context, metrics_, "Leave", s);
  }
  std::shared_ptr<Job> job;
  MemberId member;
  absl::Status status = Resolve(coordinator_, request->job_id(),
                                request->member_id(), &job, &member);
  if (status.ok()) status = job->Leave(member);
  return FinishUnary(context, metrics_, "Leave", status);
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  // --- security: the job's token and the member's binding.
  if (absl::Status s = AuthorizeMemberCall(
          CallerFromContext(*context), request->job_id(), request->member_id());
      !s.ok()) {
    return FinishUnary(context, metrics_, "Heartbeat", s);
  }
  std::shared_ptr<Job> job;
  MemberId member;
  absl::Status status = Resolve(coordinator_, request->job_id(),
                                request->member_id(), &job, &member);
  if (status.ok()) {
    absl::StatusOr<RoundId> round = job->Heartbeat(member);
    if (round.ok()) {
      response->set_state_round(*round);
    } else {
      status = round.status();
    }
  }
  return FinishUnary(context, metrics_, "Heartbeat", status);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
CoordinatorService::Sync(grpc::CallbackServerContext* context) {
  return new SyncReactor(this, coordinator_, metrics_,
                         CallerFromContext(*context));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* CoordinatorService::FetchState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new FetchStateReactor(this, coordinator_, metrics_, *request,
                               CallerFromContext(*context));
}

void CoordinatorService::StreamStarted() {
  absl::MutexLock lock(&mu_);
  ++streams_;
}

void CoordinatorService::StreamDone() {
  absl::MutexLock lock(&mu_);
  --streams_;
}

// --- Security and per-member limits.

absl::StatusOr<Principal> CoordinatorService::AuthorizeCall(
    const CallerCredentials& caller, const std::string& job_id) const {
  if (authenticator_ == nullptr) return Principal{"", caller.peer};
  return authenticator_->Authorize(caller, job_id);
}

absl::Status CoordinatorService::AuthorizeMemberCall(
    const CallerCredentials& caller, const std::string& job_id,
    const std::string& member_hex) const {
  absl::StatusOr<Principal> principal = AuthorizeCall(caller, job_id);
  if (!principal.ok()) return principal.status();
  // The binding lives with the member in the core (MemberInfo::principal),
  // so it goes when the member leaves or loses its lease. An empty key means
  // neither tokens nor client certificates are in use: every member's key
  // is empty then, and there is nothing to look up.
  const std::string key = principal->BindingKey();
  if (key.empty()) return absl::OkStatus();
  std::shared_ptr<Job> job;
  MemberId member;
  if (!Resolve(coordinator_, job_id, member_hex, &job, &member).ok()) {
    return absl::OkStatus();  // the call reports it
  }
  return job->CheckPrincipal(member, key);
}

absl::Status CoordinatorService::AdmitStream(const CallerCredentials& caller,
                                             const std::string& job_id,
                                             const std::string& member_hex,
                                             StreamSlot* slot) {
  if (absl::Status s = AuthorizeMemberCall(caller, job_id, member_hex);
      !s.ok()) {
    return s;
  }
  if (max_streams_per_member_ == 0) return absl::OkStatus();
  slot->Release();  // before mu_: it takes mu_ itself
  absl::MutexLock lock(&mu_);
  std::pair<std::string, std::string> key(job_id, member_hex);
  uint32_t& open = member_streams_[key];
  if (open >= max_streams_per_member_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this member of job '", job_id, "' has ", open,
        " Sync/FetchState streams open, the limit (--max_streams_per_member=",
        max_streams_per_member_, "); finish or cancel one first"));
  }
  ++open;
  slot->service_ = this;
  slot->key_ = std::move(key);
  return absl::OkStatus();
}

CoordinatorService::StreamSlot& CoordinatorService::StreamSlot::operator=(
    StreamSlot&& other) noexcept {
  if (this != &other) {
    Release();
    service_ = std::exchange(other.service_, nullptr);
    key_ = std::move(other.key_);
  }
  return *this;
}

void CoordinatorService::StreamSlot::Release() {
  if (service_ == nullptr) return;
  absl::MutexLock lock(&service_->mu_);
  auto it = service_->member_streams_.find(key_);
  if (it != service_->member_streams_.end() && --it->second == 0) {
    service_->member_streams_.erase(it);
  }
  service_ = nullptr;
}

bool CoordinatorService::AwaitNoStreams(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](int* streams) { return *streams == 0; }, &streams_),
      deadline);
}

grpc::ServerUnaryReactor* CoordinatorService::GetJobStatus(
    grpc::CallbackServerContext* context,
    const v1::GetJobStatusRequest* request,
    v1::GetJobStatusResponse* response) {
  const uint32_t max_rounds =
      request->max_rounds() == 0 ? 10 : std::min(request->max_rounds(), 100u);
  const absl::Time now = absl::Now();
  // --- security: with tokens, a job is visible only with its token.
  const CallerCredentials caller = CallerFromContext(*context);
  if (absl::Status s = request->job_id().empty()
                           ? (authenticator_ == nullptr
                                  ? absl::OkStatus()
                                  : authenticator_->Authenticate(caller))
                           : AuthorizeCall(caller, request->job_id()).status();
      !s.ok()) {
    return FinishUnary(context, metrics_, "GetJobStatus", s);
  }
  if (!request->job_id().empty()) {
    absl::StatusOr<std::shared_ptr<Job>> job =
        coordinator_->FindJob(request->job_id());
    if (!job.ok()) {
      return FinishUnary(context, metrics_, "GetJobStatus", job.status());
    }
    JobStatusToProto((*job)->Status(max_rounds), now, response->add_jobs());
  } else {
    for (const auto& job : coordinator_->Jobs()) {
      if (authenticator_ != nullptr &&
          !authenticator_->MayAccess(caller, job->id())) {
        continue;  // --- security: not the caller's job
      }
      JobStatusToProto(job->Status(max_rounds), now, response->add_jobs());
    }
  }
  return FinishUnary(context, metrics_, "GetJobStatus", absl::OkStatus());
}

}  // namespace localsgd
