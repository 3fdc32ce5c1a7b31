#include "server/server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace localsgd {

absl::Status ServerOptions::Validate() const {
  if (absl::Status s = coordinator.Validate(); !s.ok()) return s;
  const int64_t chunk_bytes =
      int64_t{coordinator.default_settings.chunk_elements} * 4;
  if (max_message_bytes < chunk_bytes + 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes (", max_message_bytes,
        ") must exceed a chunk's payload (", chunk_bytes, " bytes) by 1 KiB"));
  }
  if (tick_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tick_interval must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    ServerOptions options) {
  // Chunks of any job must fit in a message with room for framing.
  options.coordinator.max_chunk_elements = std::min<uint32_t>(
      options.coordinator.max_chunk_elements,
      static_cast<uint32_t>((options.max_message_bytes - 1024) / 4));
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  if (!options.state_dir.empty()) {
    absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
        CheckpointStore::Open(options.state_dir);
    if (!store.ok()) return store.status();
    server->store_ = *std::move(store);
    options.coordinator.checkpoint_store = server->store_.get();
  }
  server->options_ = options;
  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator =
      Coordinator::Create(options.coordinator);
  if (!coordinator.ok()) return coordinator.status();
  server->coordinator_ = *std::move(coordinator);
  server->service_ =
      std::make_unique<CoordinatorService>(server->coordinator_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address,
                           grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address,
                     " (address in use, or not an address of this host?)"));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  server->ticker_ = std::thread([s = server.get()] { s->TickLoop(); });
  LOG(INFO) << "coordinator listening on " << options.listen_address
            << " (port " << server->port_
            << "); plaintext: no transport security";
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::ZeroDuration()); }

void CoordinatorServer::TickLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    // Wakes at once on Shutdown; otherwise every tick_interval.
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.tick_interval);
    if (stopping_) break;
    mu_.Unlock();
    coordinator_->Tick();
    mu_.Lock();
  }
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    stopping_ = true;
  }
  LOG(INFO) << "coordinator shutting down";
  server_->GetHealthCheckService()->SetServingStatus(false);
  coordinator_->Stop();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  if (ticker_.joinable()) ticker_.join();
  LOG(INFO) << "coordinator stopped";
}

}  // namespace localsgd
