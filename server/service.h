// The gRPC face of the coordinator: a callback service that translates
// localsgd.v1.Coordinator calls into calls on the core (src/coordinator.h) and
// back. No averaging arithmetic lives here. Handlers never block: a Sync that
// waits for its round is a stored completion in the core, finished when the
// round closes.
#ifndef LOCALSGD_SERVER_SERVICE_H_
#define LOCALSGD_SERVER_SERVICE_H_

#include <memory>

#include "localsgd/v1/coordinator.grpc.pb.h"
#include "src/coordinator.h"

namespace localsgd {

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `coordinator` must outlive the service.
  explicit CoordinatorService(Coordinator* coordinator)
      : coordinator_(coordinator) {}

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

 private:
  Coordinator* const coordinator_;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVICE_H_
