#include "server/service.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "proto/chunk_wire.h"
#include "proto/grpc_status.h"
#include "server/protocol.h"
#include "server/streams.h"
#include "src/failpoint.h"

namespace localsgd {
namespace {

// `value` for a log line: control characters and non-ASCII bytes escaped
// (\n, \x1b ...), at most 256 bytes of it.
std::string LogSafe(absl::string_view value) {
  std::string out = absl::CHexEscape(value.substr(0, 256));
  if (value.size() > 256) absl::StrAppend(&out, "...");
  return out;
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

// The write side of a stream reactor: a machine's write action as gRPC
// bytes (a serialized message, or a chunk message whose payload is the
// StateWire's own bytes, proto/chunk_wire.h, kept alive by the buffer until
// gRPC has sent it), and the job's sent-bytes counter. Writes are
// sequential: Next, then Done once the write completed.
class StreamWrites {
 public:
  explicit StreamWrites(Metrics* metrics) : metrics_(metrics) {}

  // The buffer to StartWrite for a machine's kWriteMessage / kWriteChunk.
  const grpc::ByteBuffer* Next(StreamAction action) {
    chunk_ = action.kind == StreamAction::Kind::kWriteChunk;
    if (chunk_) {
      payload_bytes_ = action.chunk.data.size();
      buffer_ = ChunkMessage(action.index, action.chunk.crc32c,
                             action.chunk.data, std::move(action.wire));
    } else {
      payload_bytes_ = 0;
      grpc::Slice slice(action.message);
      buffer_ = grpc::ByteBuffer(&slice, 1);
    }
    return &buffer_;
  }

  // Whether the last write was a chunk (a result's, or a state's).
  bool last_was_chunk() const { return chunk_; }

  // The last write went out: count its payload for `job`'s metrics.
  void Done(const std::shared_ptr<Job>& job) {
    if (sent_.sent == nullptr && metrics_ != nullptr && job != nullptr) {
      sent_ = CountersFor(metrics_, *job);
    }
    sent_.Sent(payload_bytes_);
  }

 private:
  Metrics* const metrics_;  // may be null
  grpc::ByteBuffer buffer_;
  size_t payload_bytes_ = 0;
  bool chunk_ = false;
  ByteCounters sent_;
};

// The status a reactor finishes with, counted if it is not OK.
grpc::Status FinishStatus(Metrics* metrics, absl::string_view method,
                          const absl::Status& status) {
  const grpc::Status grpc_status = ToGrpcStatus(status);
  CountRejected(metrics, method, grpc_status);
  return grpc_status;
}

// What both stream reactors do with their machine's actions
// (server/streams.h has the contract): start a read (Sync only: StartNextRead),
// start a write, finish. `Reactor` is the gRPC reactor base class.
template <typename Reactor>
class MachineReactor : public Reactor {
 protected:
  MachineReactor(Metrics* metrics, absl::string_view method)
      : metrics_(metrics), method_(method), writes_(metrics) {}

  virtual void StartNextRead() {}

  void Act(StreamAction action) {
    switch (action.kind) {
      case StreamAction::Kind::kRead:
        StartNextRead();
        return;
      case StreamAction::Kind::kWriteMessage:
      case StreamAction::Kind::kWriteChunk:
        this->StartWrite(writes_.Next(std::move(action)));
        return;
      case StreamAction::Kind::kFinish:
        // The last use of `this`.
        this->Finish(FinishStatus(metrics_, method_, action.status));
        return;
    }
  }

  Metrics* const metrics_;  // may be null
  const absl::string_view method_;
  StreamWrites writes_;  // write path
};

// The stream admission of the security layer: the service's AdmitStream,
// whose stream slot the machine holds until just before it finishes.
StreamAdmission AdmissionFor(CoordinatorService* service,
                             CallerCredentials caller) {
  return [service, caller = std::move(caller)](const std::string& job_id,
                                               const std::string& member_hex)
             -> absl::StatusOr<std::shared_ptr<void>> {
    auto slot = std::make_shared<CoordinatorService::StreamSlot>();
    if (absl::Status s =
            service->AdmitStream(caller, job_id, member_hex, slot.get());
        !s.ok()) {
      return s;
    }
    return std::shared_ptr<void>(std::move(slot));
  };
}

// One Sync stream: moves bytes between gRPC and its SyncServerStream
// (server/streams.h), and counts them.
//
// Lifetime: gRPC deletes the reactor in OnDone, which may run on another
// thread as soon as Finish is called. The machine delivers kFinish once, as
// its last act, so every reaction ends with its call into the machine.
class SyncReactor final
    : public MachineReactor<
          grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
 public:
  SyncReactor(CoordinatorService* service, Coordinator* coordinator,
              WireCache* wires, Metrics* metrics, CallerCredentials caller)
      : MachineReactor(metrics, "Sync"),
        service_(service),
        machine_(coordinator, wires, AdmissionFor(service, std::move(caller)),
                 [this](StreamAction action) { Act(std::move(action)); }) {
    service_->StreamStarted();
    machine_.Start();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or the call broke
      machine_.OnReadsDone();
      return;
    }
    // A plain chunk is read in place from gRPC's slices; anything else
    // (the header, an unusual encoding) is parsed by protobuf.
    ChunkView chunk;
    if (ParseChunkMessage(raw_request_, &chunk) == ChunkParse::kChunk) {
      raw_request_.Clear();  // `chunk` holds the slices
      if (received_.received == nullptr && metrics_ != nullptr) {
        if (std::shared_ptr<Job> job = machine_.job(); job != nullptr) {
          received_ = CountersFor(metrics_, *job);
        }
      }
      received_.Received(chunk.size);
      machine_.OnChunk(chunk);
      HitFailpoint(Failpoint::kContributionChunk);
      return;
    }
    if (absl::Status s = ParseMessage(raw_request_, &request_, "Sync message");
        !s.ok()) {
      machine_.OnUnreadable(std::move(s));
      return;
    }
    raw_request_.Clear();
    const bool has_chunk = request_.has_chunk();
    if (has_chunk) received_.Received(request_.chunk().data().size());
    machine_.OnMessage(request_);
    if (has_chunk) HitFailpoint(Failpoint::kContributionChunk);
  }

  void OnWriteDone(bool ok) override {
    if (ok) writes_.Done(machine_.job());
    if (ok && writes_.last_was_chunk()) {
      HitFailpoint(Failpoint::kResultChunkSent);
    }
    machine_.OnWriteDone(ok);
  }

  void OnCancel() override { machine_.OnCancel(); }

  void OnDone() override {
    service_->StreamDone();
    delete this;
  }

 private:
  void StartNextRead() override { StartRead(&raw_request_); }

  CoordinatorService* const service_;
  // Read path: the message read, it parsed, and the received-bytes counter.
  grpc::ByteBuffer raw_request_;
  v1::SyncRequest request_;
  ByteCounters received_;
  SyncServerStream machine_;
};

// One FetchState stream: moves the bytes of its FetchStateServerStream.
class FetchStateReactor final
    : public MachineReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  FetchStateReactor(CoordinatorService* service, Coordinator* coordinator,
                    WireCache* wires, Metrics* metrics,
                    const grpc::ByteBuffer& raw_request,
                    const CallerCredentials& caller)
      : MachineReactor(metrics, "FetchState"),
        service_(service),
        machine_(coordinator, wires, AdmissionFor(service, caller),
                 [this](StreamAction action) { Act(std::move(action)); }) {
    service_->StreamStarted();
    v1::FetchStateRequest request;
    if (absl::Status s =
            ParseMessage(raw_request, &request, "FetchState request");
        !s.ok()) {
      machine_.OnUnreadable(std::move(s));
      return;
    }
    machine_.Start(request);
  }

  void OnWriteDone(bool ok) override {
    if (ok) writes_.Done(machine_.job());
    machine_.OnWriteDone(ok);
  }

  void OnDone() override {
    service_->StreamDone();
    delete this;
  }

 private:
  CoordinatorService* const service_;
  FetchStateServerStream machine_;
};

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      Metrics* metrics,
                                      absl::string_view method,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(FinishStatus(metrics, method, status));
  return reactor;
}

// A unary method registered raw (grpc::ByteBuffer in and out): the request
// is parsed here, so that a body that does not parse answers
// INVALID_ARGUMENT saying so (gRPC's typed handlers refuse it with an empty
// UNIMPLEMENTED before any code of ours runs); `handle` gets the parsed
// request and fills the response, which is serialized here.
template <typename Request, typename Response, typename Handle>
grpc::ServerUnaryReactor* RawUnary(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer& raw_request,
                                   grpc::ByteBuffer* raw_response,
                                   Metrics* metrics, absl::string_view method,
                                   Handle handle) {
  Request request;
  Response response;
  absl::Status status =
      ParseMessage(raw_request, &request, absl::StrCat(method, " request"));
  if (status.ok()) status = handle(&request, &response);
  if (status.ok()) {
    bool own_buffer = false;
    const grpc::Status s = grpc::SerializationTraits<Response>::Serialize(
        response, raw_response, &own_buffer);
    if (!s.ok()) {
      status = absl::InternalError(absl::StrCat(
          method, " response does not serialize: ", s.error_message()));
    }
  }
  return FinishUnary(context, metrics, method, status);
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::Join(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::JoinRequest, v1::JoinResponse>(
      context, *raw_request, raw_response, metrics_, "Join",
      [&](const v1::JoinRequest* request,
          v1::JoinResponse* response) -> absl::Status {
        absl::Status status = [&]() -> absl::Status {
          // --- security: the job's token; the member is bound to the caller.
          absl::StatusOr<Principal> principal =
              AuthorizeCall(CallerFromContext(*context), request->job_id());
          if (!principal.ok()) return principal.status();
          return HandleJoin(*coordinator_, *request, principal->BindingKey(),
                            static_cast<uint64_t>(max_message_bytes_),
                            response);
        }();
        if (!status.ok()) {
          // The names as sent, escaped: a refused Join's may hold anything.
          LOG(WARNING) << "Join of '" << LogSafe(request->member_name())
                       << "' to job '" << LogSafe(request->job_id())
                       << "' from " << context->peer()
                       << " refused: " << status;
        }
        return status;
      });
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::LeaveRequest, v1::LeaveResponse>(
      context, *raw_request, raw_response, metrics_, "Leave",
      [&](const v1::LeaveRequest* request,
          v1::LeaveResponse* response) -> absl::Status {
        // --- security: the job's token and the member's binding.
        absl::Status status =
            AuthorizeMemberCall(CallerFromContext(*context), request->job_id(),
                                request->member_id());
        if (status.ok()) status = HandleLeave(*coordinator_, *request);
        return status;
      });
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::HeartbeatRequest, v1::HeartbeatResponse>(
      context, *raw_request, raw_response, metrics_, "Heartbeat",
      [&](const v1::HeartbeatRequest* request,
          v1::HeartbeatResponse* response) -> absl::Status {
        // --- security: the job's token and the member's binding.
        absl::Status status =
            AuthorizeMemberCall(CallerFromContext(*context), request->job_id(),
                                request->member_id());
        if (status.ok())
          status = HandleHeartbeat(*coordinator_, *request, response);
        return status;
      });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
CoordinatorService::Sync(grpc::CallbackServerContext* context) {
  return new SyncReactor(this, coordinator_, &wires_, metrics_,
                         CallerFromContext(*context));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* CoordinatorService::FetchState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new FetchStateReactor(this, coordinator_, &wires_, metrics_, *request,
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
  if (gate_ != nullptr) {
    if (absl::Status s = gate_->Check(); !s.ok()) return s;
  }
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
  if (!ResolveMember(*coordinator_, job_id, member_hex, &job, &member).ok()) {
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

grpc::ServerUnaryReactor* CoordinatorService::DeleteJob(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::DeleteJobRequest, v1::DeleteJobResponse>(
      context, *raw_request, raw_response, metrics_, "DeleteJob",
      [&](const v1::DeleteJobRequest* request,
          v1::DeleteJobResponse* response) -> absl::Status {
        // --- security: the job's token.
        absl::Status status =
            AuthorizeCall(CallerFromContext(*context), request->job_id())
                .status();
        if (status.ok())
          status = HandleDeleteJob(*coordinator_, *request, response);
        if (status.ok()) {
          LOG(INFO) << "job " << request->job_id() << " deleted by "
                    << context->peer();
        }
        return status;
      });
}

grpc::ServerUnaryReactor* CoordinatorService::GetJobStatus(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::GetJobStatusRequest, v1::GetJobStatusResponse>(
      context, *raw_request, raw_response, metrics_, "GetJobStatus",
      [&](const v1::GetJobStatusRequest* request,
          v1::GetJobStatusResponse* response) -> absl::Status {
        // --- security: with tokens, a job is visible only with its token.
        const CallerCredentials caller = CallerFromContext(*context);
        absl::Status status;
        if (!request->job_id().empty()) {
          status = AuthorizeCall(caller, request->job_id()).status();
        } else {
          // Every job (those the caller may see): the gate, then only who
          // the caller is.
          if (gate_ != nullptr) status = gate_->Check();
          if (status.ok() && authenticator_ != nullptr) {
            status = authenticator_->Authenticate(caller);
          }
        }
        if (status.ok()) {
          std::function<bool(const std::string&)> may_see;
          if (authenticator_ != nullptr) {
            may_see = [&](const std::string& job_id) {
              return authenticator_->MayAccess(caller, job_id);
            };
          }
          status = HandleGetJobStatus(*coordinator_, *request, absl::Now(),
                                      may_see, response);
        }
        return status;
      });
}

}  // namespace localsgd
