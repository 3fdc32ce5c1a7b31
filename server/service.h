// The gRPC face of the coordinator: a callback service that checks each
// call's credentials (server/auth.h) and hands it to the gRPC-free protocol
// layer (server/protocol.h for the unary calls, server/streams.h for the
// Sync and FetchState state machines), moving bytes between gRPC and it. No
// protocol logic or averaging arithmetic lives here. Handlers never block: a
// Sync that waits for its round is a stored completion in the core, finished
// when the round closes.
#ifndef LOCALSGD_SERVER_SERVICE_H_
#define LOCALSGD_SERVER_SERVICE_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/serving_gate.h"
#include "server/state_wire.h"
#include "src/coordinator.h"

namespace localsgd {

// Every method with the callback API, registered raw (grpc::ByteBuffer in
// and out): Sync and FetchState so that their chunk messages are written
// without protobuf copies of the payload (proto/chunk_wire.h); the unary
// methods so that a request that does not parse is answered
// INVALID_ARGUMENT by our code (server/service.cc RawUnary) rather than
// UNIMPLEMENTED by gRPC's. A method added to the proto must be added here
// (tests/integration's every-method test fails otherwise).
using CoordinatorServiceBase = v1::Coordinator::WithRawCallbackMethod_Join<
    v1::Coordinator::WithRawCallbackMethod_Leave<
        v1::Coordinator::WithRawCallbackMethod_Heartbeat<
            v1::Coordinator::WithRawCallbackMethod_Sync<
                v1::Coordinator::WithRawCallbackMethod_FetchState<
                    v1::Coordinator::WithRawCallbackMethod_GetJobStatus<
                        v1::Coordinator::WithRawCallbackMethod_DeleteJob<
                            v1::Coordinator::Service>>>>>>>;

class CoordinatorService final : public CoordinatorServiceBase {
 public:
  // `coordinator`, `metrics` and `authenticator` (both may be null) must
  // outlive the service. `metrics` counts payload bytes per job and calls
  // that end with a non-OK status. `max_message_bytes` is the server's
  // message limit, reported to members on Join. `authenticator` checks each
  // call's token and member binding (null: every call is allowed);
  // `max_streams_per_member` bounds the Sync and FetchState streams one
  // member has open at once (0: no limit). `gate` (may be null: always
  // open; must outlive the service) admits calls only while this
  // coordinator is its shard's serving primary (server/serving_gate.h).
  CoordinatorService(Coordinator* coordinator, int max_message_bytes,
                     Metrics* metrics = nullptr,
                     const Authenticator* authenticator = nullptr,
                     uint32_t max_streams_per_member = 0,
                     const ServingGate* gate = nullptr)
      : coordinator_(coordinator),
        max_message_bytes_(max_message_bytes),
        metrics_(metrics),
        authenticator_(authenticator),
        max_streams_per_member_(max_streams_per_member),
        gate_(gate) {}

  // The unary methods: a serialized request in, a serialized response out
  // (see CoordinatorServiceBase).
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* raw_request,
                                 grpc::ByteBuffer* raw_response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* raw_request,
                                  grpc::ByteBuffer* raw_response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* raw_request,
                                      grpc::ByteBuffer* raw_response) override;
  // localsgd.v1 SyncRequest in, SyncResponse out, serialized.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Sync(
      grpc::CallbackServerContext* context) override;
  // A serialized FetchStateRequest in, FetchStateResponses out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchState(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetJobStatus(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
      grpc::ByteBuffer* raw_response) override;
  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* raw_request,
                                      grpc::ByteBuffer* raw_response) override;

  // Blocks until no Sync or FetchState stream is in progress, or until
  // `deadline`; returns whether none is. For shutdown: once the core is
  // stopped, the streams left are results being sent, and the server can be
  // stopped at once after them (grpc::Server::Shutdown would otherwise wait
  // for idle client connections until its deadline).
  bool AwaitNoStreams(absl::Time deadline);

  // Called by the stream reactors.
  void StreamStarted();
  void StreamDone();

  // --- Security and per-member limits (server/auth.h, docs/security.md).

  // One open stream of one member, counted against max_streams_per_member
  // until destroyed. Movable; default: counts nothing.
  class StreamSlot {
   public:
    StreamSlot() = default;
    StreamSlot(StreamSlot&& other) noexcept { *this = std::move(other); }
    StreamSlot& operator=(StreamSlot&& other) noexcept;
    ~StreamSlot() { Release(); }

   private:
    friend class CoordinatorService;
    void Release();
    CoordinatorService* service_ = nullptr;
    std::pair<std::string, std::string> key_;  // job id, member id
  };

  // Admits a call for `job_id`: UNAVAILABLE while the serving gate is
  // closed (a standby), then the credentials (UNAUTHENTICATED /
  // PERMISSION_DENIED, see Authenticator::Authorize). Every method starts
  // here.
  absl::StatusOr<Principal> AuthorizeCall(const CallerCredentials& caller,
                                          const std::string& job_id) const;
  // AuthorizeCall, then PERMISSION_DENIED if `member_hex` names a member of
  // the job bound to other credentials (Job::CheckPrincipal). An unknown job
  // or member is left to the call to report.
  absl::Status AuthorizeMemberCall(const CallerCredentials& caller,
                                   const std::string& job_id,
                                   const std::string& member_hex) const;
  // AuthorizeMemberCall, then takes a stream slot of the member into `slot`:
  // RESOURCE_EXHAUSTED if it has max_streams_per_member open already.
  absl::Status AdmitStream(const CallerCredentials& caller,
                           const std::string& job_id,
                           const std::string& member_hex, StreamSlot* slot);

 private:
  Coordinator* const coordinator_;
  const int max_message_bytes_;
  Metrics* const metrics_;

  const Authenticator* const authenticator_;  // may be null
  const uint32_t max_streams_per_member_;     // 0: no limit
  const ServingGate* const gate_;             // may be null
  // The wire form of the states the streams are sending (per job).
  WireCache wires_;

  absl::Mutex mu_;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  // Open streams per (job id, member id), for max_streams_per_member.
  absl::flat_hash_map<std::pair<std::string, std::string>, uint32_t>
      member_streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVICE_H_
