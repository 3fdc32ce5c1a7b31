// A running coordinator: the core, its gRPC server (coordinator service,
// grpc.health.v1, reflection) and the thread that drives leases and
// deadlines. Used by main() and by in-process tests.
#ifndef LOCALSGD_SERVER_SERVER_H_
#define LOCALSGD_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/service.h"
#include "src/coordinator.h"

namespace localsgd {

struct ServerOptions {
  // host:port; port 0 picks a free port (see CoordinatorServer::port()).
  std::string listen_address = "0.0.0.0:50051";
  CoordinatorOptions coordinator;
  // Largest gRPC message received or sent. Must hold a chunk:
  // chunk_elements * 4 bytes plus a few bytes of framing.
  int max_message_bytes = 17 << 20;
  // If set, jobs are checkpointed here (every new global state, in the
  // background) and restored from here on start, before serving.
  std::string state_dir;
  // How often leases and round deadlines are checked.
  absl::Duration tick_interval = absl::Milliseconds(100);

  absl::Status Validate() const;
};

class CoordinatorServer {
 public:
  // Builds the core, binds and starts serving. UNAVAILABLE if the address
  // cannot be bound; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      ServerOptions options);
  // Shutdown(absl::ZeroDuration()) if not done yet.
  ~CoordinatorServer();

  // The bound port.
  int port() const { return port_; }
  Coordinator* coordinator() { return coordinator_.get(); }

  // Health NOT_SERVING, pending Syncs fail with UNAVAILABLE, the gRPC server
  // stops (in-flight calls get until `grace`), the tick thread is joined.
  // Idempotent; blocks until done.
  void Shutdown(absl::Duration grace);

 private:
  CoordinatorServer() = default;
  void TickLoop();

  ServerOptions options_;
  std::unique_ptr<CheckpointStore> store_;  // outlives coordinator_
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread ticker_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVER_H_
