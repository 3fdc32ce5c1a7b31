// The gRPC face of the coordinator: a callback service that translates
// localsgd.v1.Coordinator calls into calls on the core (src/coordinator.h) and
// back. No averaging arithmetic lives here. Handlers never block: a Sync that
// waits for its round is a stored completion in the core, finished when the
// round closes.
#ifndef LOCALSGD_SERVER_SERVICE_H_
#define LOCALSGD_SERVER_SERVICE_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "server/metrics.h"
#include "src/coordinator.h"

namespace localsgd {

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `coordinator` and `metrics` (may be null) must outlive the service.
  // `metrics` counts payload bytes per job and calls that end with a non-OK
  // status. `max_message_bytes` is the server's message limit, reported to
  // members on Join.
  CoordinatorService(Coordinator* coordinator, int max_message_bytes,
                     Metrics* metrics = nullptr)
      : coordinator_(coordinator),
        max_message_bytes_(max_message_bytes),
        metrics_(metrics) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerBidiReactor<v1::SyncRequest, v1::SyncResponse>* Sync(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::FetchStateResponse>* FetchState(
      grpc::CallbackServerContext* context,
      const v1::FetchStateRequest* request) override;
  grpc::ServerUnaryReactor* GetJobStatus(
      grpc::CallbackServerContext* context,
      const v1::GetJobStatusRequest* request,
      v1::GetJobStatusResponse* response) override;

  // Blocks until no Sync or FetchState stream is in progress, or until
  // `deadline`; returns whether none is. For shutdown: once the core is
  // stopped, the streams left are results being sent, and the server can be
  // stopped at once after them (grpc::Server::Shutdown would otherwise wait
  // for idle client connections until its deadline).
  bool AwaitNoStreams(absl::Time deadline);

  // Called by the stream reactors.
  void StreamStarted();
  void StreamDone();

 private:
  Coordinator* const coordinator_;
  const int max_message_bytes_;
  Metrics* const metrics_;

  absl::Mutex mu_;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVICE_H_
