#include "server/server.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "src/failpoint.h"

namespace localsgd {

absl::Status ServerOptions::Validate() const {
  if (absl::Status s = coordinator.Validate(); !s.ok()) return s;
  if (stream_window_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream_window_bytes must be >= 0; got ", stream_window_bytes));
  }
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
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together: give both (TLS) or neither "
        "(plaintext)");
  }
  if (!tls_client_ca_file.empty() && tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key");
  }
  if (!ha_tls_ca_file.empty() && (gate == nullptr || tls_cert_file.empty())) {
    return absl::InvalidArgumentError(
        "--ha_tls_ca is the CA of the replication stream between the "
        "coordinators of a shard over TLS: it needs --ha_etcd and "
        "--tls_cert/--tls_key");
  }
  if (gate != nullptr && !tls_cert_file.empty() && ha_tls_ca_file.empty() &&
      tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--ha_etcd with --tls_cert: a standby follows its primary over TLS "
        "and checks the primary's certificate against a CA; give the CA "
        "bundle that signed the coordinators' certificates as --ha_tls_ca "
        "(or --tls_client_ca, which it defaults to)");
  }
  return absl::OkStatus();
}

namespace {

// The listening port's credentials: TLS (mutual with a client CA) from the
// PEM files, read and checked now so that a bad file stops the start with a
// message naming it; else plaintext.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options) {
  if (options.tls_cert_file.empty()) {
    LOG(WARNING) << "plaintext gRPC: no transport security (no --tls_cert / "
                    "--tls_key); anyone on the network can read and alter "
                    "the traffic. Fine on loopback or a trusted network "
                    "only; see docs/security.md";
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert =
      ReadPemFile(options.tls_cert_file, "--tls_cert", PemKind::kCertificates);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key =
      ReadPemFile(options.tls_key_file, "--tls_key", PemKind::kPrivateKey);
  if (!key.ok()) return key.status();
  if (absl::Status s =
          CheckKeyMatchesCertificate(*cert, *key, "--tls_cert", "--tls_key");
      !s.ok()) {
    return s;
  }
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(
        options.tls_client_ca_file, "--tls_client_ca", PemKind::kCertificates);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    LOG(INFO) << "mutual TLS: clients need a certificate signed by "
              << options.tls_client_ca_file;
  } else {
    ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
    LOG(INFO) << "TLS with " << options.tls_cert_file
              << "; clients are not asked for certificates";
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::Status CoordinatorServer::ReloadCredentials() {
  absl::Status s = authenticator_->Reload();
  if (!s.ok()) LOG(ERROR) << "reloading the token file failed: " << s;
  return s;
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    ServerOptions options) {
  // Chunks of any job must fit in a message with room for framing.
  options.coordinator.max_chunk_elements = std::min<uint32_t>(
      options.coordinator.max_chunk_elements,
      static_cast<uint32_t>((options.max_message_bytes - 1024) / 4));
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->metrics_ = std::make_unique<Metrics>();
  options.coordinator.observer = server->metrics_.get();
  options.coordinator.alarm = &server->alarm_;
  if (!options.state_dir.empty()) {
    absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
        CheckpointStore::Open(options.state_dir);
    if (!store.ok()) return store.status();
    server->store_ = *std::move(store);
    options.coordinator.checkpoint_store = server->store_.get();
  }
  options.coordinator.defer_restore = options.gate != nullptr;
  CoordinatorServer* raw = server.get();
  if (options.gate != nullptr && !options.tls_cert_file.empty()) {
    // The replication stream goes over the same TLS as everything else.
    const bool own_ca = !options.ha_tls_ca_file.empty();
    absl::StatusOr<std::string> ca = ReadPemFile(
        own_ca ? options.ha_tls_ca_file : options.tls_client_ca_file,
        own_ca ? "--ha_tls_ca" : "--tls_client_ca", PemKind::kCertificates);
    if (!ca.ok()) return ca.status();
    absl::StatusOr<std::string> cert = ReadPemFile(
        options.tls_cert_file, "--tls_cert", PemKind::kCertificates);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key =
        ReadPemFile(options.tls_key_file, "--tls_key", PemKind::kPrivateKey);
    if (!key.ok()) return key.status();
    options.replication.tls_ca_pem = *std::move(ca);
    options.replication.tls_cert_pem = *std::move(cert);
    options.replication.tls_key_pem = *std::move(key);
  }
  if (options.gate != nullptr) {
    server->hub_ = std::make_unique<ReplicationHub>(
        options.replication, [raw] { return raw->coordinator_->epoch(); },
        [raw] { return raw->promoted_.load(std::memory_order_acquire); });
    options.coordinator.replicator = server->hub_.get();
    if (options.replication.token.empty()) {
      LOG(WARNING) << "replication without a token (--ha_token): anyone who "
                      "reaches this port can follow this shard's state";
    }
  }
  server->options_ = options;
  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator =
      Coordinator::Create(options.coordinator);
  if (!coordinator.ok()) return coordinator.status();
  server->coordinator_ = *std::move(coordinator);
  if (server->hub_ != nullptr) {
    server->hub_->set_coordinator(server->coordinator_.get());
    server->follower_ = std::make_unique<ReplicaFollower>(
        options.replication, server->coordinator_.get());
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options);
  if (!credentials.ok()) return credentials.status();
  absl::StatusOr<std::unique_ptr<Authenticator>> authenticator =
      Authenticator::Create(options.token_file);
  if (!authenticator.ok()) return authenticator.status();
  server->authenticator_ = *std::move(authenticator);
  server->service_ = std::make_unique<CoordinatorService>(
      server->coordinator_.get(), options.max_message_bytes,
      server->metrics_.get(), server->authenticator_.get(),
      options.max_streams_per_member, options.gate);
  if (!options.metrics_listen_address.empty()) {
    if (absl::Status s = server->metrics_->Serve(options.metrics_listen_address,
                                                 server->coordinator_.get());
        !s.ok()) {
      return s;
    }
  }
  if (!options.http_listen_address.empty()) {
    absl::StatusOr<std::unique_ptr<StatusHttpServer>> http =
        StatusHttpServer::Start(
            options.http_listen_address, server->coordinator_.get(),
            server->metrics_.get(), server->authenticator_.get(),
            /*client_certificates_required=*/
            !options.tls_client_ca_file.empty());
    if (!http.ok()) return http.status();
    server->http_ = *std::move(http);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, *credentials,
                           &server->port_);
  builder.RegisterService(server->service_.get());
  if (server->hub_ != nullptr) builder.RegisterService(server->hub_.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.stream_window_bytes > 0) {
    // A fixed window, no bandwidth-delay probe: the probe grows the window
    // with the link's bandwidth, not with how fast the coordinator reads,
    // so where its CPU is the bottleneck every worker parks 25-40 MiB in
    // it (25M fp32); a fixed window keeps memory flat in the workers
    // (docs/design.md "Memory"), hence the default 8 MiB.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                               options.stream_window_bytes);
  }
  if (options.gate != nullptr) {
    // Members of a shard with standbys ping every second to find a hung
    // primary (client/client.cc); without this gRPC would answer pings
    // that frequent with GOAWAY (too_many_pings).
    builder.AddChannelArgument(
        GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address,
                     " (address in use, or not an address of this host?)"));
  }
  // The checkpoints are restored (Coordinator::Create) before the port is
  // even bound, so SERVING here means ready. A standby is not ready: it
  // becomes so in Promote.
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  const bool ready = options.gate == nullptr;
  health->SetServingStatus("", ready);
  health->SetServingStatus(v1::Coordinator::service_full_name(), ready);
  health->SetServingStatus(kLivenessService, true);
  server->ticker_ = std::thread([s = server.get()] { s->TickLoop(); });
  LOG(INFO) << "coordinator listening on " << options.listen_address
            << " (port " << server->port_ << "); "
            << (options.tls_cert_file.empty()        ? "plaintext"
                : options.tls_client_ca_file.empty() ? "TLS"
                                                     : "mutual TLS")
            << (server->authenticator_->tokens_enabled()
                    ? ", per-job tokens required"
                    : ", no per-job tokens")
            << (options.metrics_listen_address.empty() &&
                        options.http_listen_address.empty()
                    ? ""
                    : "; the metrics endpoint and the status page are "
                      "plaintext HTTP");
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::ZeroDuration()); }

absl::Status CoordinatorServer::Promote(uint64_t epoch) {
  const bool in_sync = follower_ != nullptr && follower_->Stop();
  if (in_sync) {
    // Every state a member may hold is here, bit for bit.
    LOG(INFO) << "promoted with the replicas of " << coordinator_->Jobs().size()
              << " jobs (in sync with the former primary)";
    coordinator_->PromoteReplicas();
  } else {
    // Not in sync (never caught up, or dropped): what replicas there are
    // may be older than the checkpoints; the checkpoints it is.
    coordinator_->BeginFollowing();  // drops the replicas
    coordinator_->PromoteReplicas();
    if (absl::Status s = coordinator_->RestoreCheckpoints(); !s.ok()) return s;
  }
  coordinator_->RaiseEpoch(epoch);
  // The list of the last primary names its standbys, not this one's: a new
  // one (empty) before anything is served.
  if (hub_ != nullptr) {
    if (absl::Status s =
            hub_->PublishInitial(epoch, absl::Now() + absl::Seconds(5));
        !s.ok()) {
      return s;
    }
  }
  promoted_.store(true, std::memory_order_release);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the coordinator is stopping");
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(v1::Coordinator::service_full_name(), true);
  LOG(INFO) << "serving as the primary of shard "
            << options_.coordinator.shard.index << " at epoch " << epoch;
  return absl::OkStatus();
}

void CoordinatorServer::Follow(std::string primary, uint64_t epoch) {
  if (follower_ != nullptr && !promoted_.load(std::memory_order_acquire)) {
    follower_->Follow(std::move(primary), epoch);
  }
}

void CoordinatorServer::StartSyncPublisher(
    ReplicationHub::SyncPublisher publish) {
  if (hub_ != nullptr) hub_->StartSyncPublisher(std::move(publish));
}

void CoordinatorServer::SetAdvertise(const std::string& address) {
  if (hub_ != nullptr) hub_->set_advertise(address);
  if (follower_ != nullptr) follower_->set_advertise(address);
}

void CoordinatorServer::StopSyncPublisher() {
  if (hub_ != nullptr) hub_->StopSyncPublisher();
}

bool CoordinatorServer::InSync() {
  return follower_ != nullptr && follower_->in_sync();
}

void CoordinatorServer::TickLoop() {
  // A test's failpoints (src/failpoint.h), re-read every tick.
  const bool failpoints = FailpointsEnabled();
  if (failpoints) ReloadFailpoints();
  // Every tick_interval, and at each round's deadline (the jobs ask the
  // alarm); at once on Shutdown.
  absl::Time next = absl::Now() + options_.tick_interval;
  while (alarm_.WaitUntil(next)) {
    if (failpoints) ReloadFailpoints();
    coordinator_->Tick();
    const absl::Time now = absl::Now();
    if (now < next) continue;  // a deadline's tick
    if (hub_ != nullptr) hub_->Tick(now);
    next = now + options_.tick_interval;
  }
}

bool CoordinatorServer::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return false;
  shut_down_ = true;
  return true;
}

bool CoordinatorServer::Drain(absl::Duration grace) {
  if (!BeginShutdown()) return true;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + grace;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", false);
  health->SetServingStatus(v1::Coordinator::service_full_name(), false);
  LOG(INFO) << "draining: NOT_SERVING; no new rounds; open rounds have "
            << absl::FormatDuration(grace) << " to close";
  // The tick thread keeps running: leases and deadlines close rounds too.
  const bool closed = coordinator_->Drain(deadline);
  if (closed) {
    LOG(INFO) << "draining: no round open after "
              << absl::FormatDuration(absl::Now() - start);
  } else {
    LOG(WARNING) << "draining: rounds still open after "
                 << absl::FormatDuration(grace)
                 << "; their members are told UNAVAILABLE and retry";
  }
  FinishShutdown(std::max(deadline, absl::Now() + kMinFinishTime));
  return closed;
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  if (!BeginShutdown()) return;
  FinishShutdown(absl::Now() + grace);
}

void CoordinatorServer::FinishShutdown(absl::Time calls_deadline) {
  // Start may have failed half-way: every part is optional here.
  if (server_ != nullptr) {
    LOG(INFO) << "coordinator shutting down";
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  // A standby stops following (its thread calls into the coordinator).
  if (follower_ != nullptr) follower_->Stop();
  // Fails what still waits, then writes the checkpoints still queued.
  if (coordinator_ != nullptr) coordinator_->Stop();
  if (server_ != nullptr) {
    // The streams left send results of rounds that closed; let them finish
    // (until the deadline). Then stop soon, not at the deadline:
    // grpc::Server::Shutdown waits for client connections to close, and an
    // idle client only notices at its next call (a heartbeat, lease/3 away).
    // Not at once either: calls that arrive now fail fast with UNAVAILABLE
    // (the core is stopped), which clients retry; cancelled by a forced
    // shutdown, they would see CANCELLED, which they do not retry.
    if (!service_->AwaitNoStreams(calls_deadline)) {
      LOG(WARNING) << "streams still sending results at the deadline are "
                      "cancelled";
    }
    // The standbys' streams end (they are in sync: a clean stop).
    if (hub_ != nullptr) hub_->Shutdown();
    const absl::Time now = absl::Now();
    server_->Shutdown(absl::ToChronoTime(now + std::clamp(calls_deadline - now,
                                                          absl::ZeroDuration(),
                                                          kSettleTime)));
    server_->Wait();
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  alarm_.Stop();
  if (ticker_.joinable()) ticker_.join();
  if (http_ != nullptr) http_->Stop();
  if (metrics_ != nullptr) metrics_->StopServing();
  if (server_ != nullptr) LOG(INFO) << "coordinator stopped";
}

}  // namespace localsgd
