// A running coordinator: the core, its gRPC server (coordinator service,
// grpc.health.v1, reflection), its Prometheus metrics endpoint and the thread
// that drives leases and deadlines. Used by main() and by in-process tests.
//
// Health (grpc.health.v1), as Kubernetes probes read it:
//   ""  and "localsgd.v1.Coordinator"  readiness: SERVING from Start (which
//       returns only after the checkpoints are restored) until Drain or
//       Shutdown begins, NOT_SERVING from then on.
//   "liveness"  SERVING until the gRPC server stops, draining included, so
//       that a liveness probe does not kill a coordinator while it drains.
#ifndef LOCALSGD_SERVER_SERVER_H_
#define LOCALSGD_SERVER_SERVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/auth.h"
#include "server/http_status.h"
#include "server/metrics.h"
#include "server/replication.h"
#include "server/service.h"
#include "server/serving_gate.h"
#include "src/coordinator.h"

namespace localsgd {

struct ServerOptions {
  // host:port; port 0 picks a free port (see CoordinatorServer::port()).
  std::string listen_address = "0.0.0.0:50051";
  CoordinatorOptions coordinator;
  // Largest gRPC message received or sent. Must hold a chunk:
  // chunk_elements * 4 bytes plus a few bytes of framing.
  int max_message_bytes = 17 << 20;
  // HTTP/2 flow-control window per stream. > 0: fixed, which bounds what
  // each worker can have in flight to the coordinator (memory flat in the
  // number of workers). 0: gRPC's window, grown by bandwidth probing,
  // without bound where the coordinator falls behind its links
  // (docs/design.md "Memory").
  int stream_window_bytes = 8 << 20;
  // If set, jobs are checkpointed here (every new global state, in the
  // background) and restored from here on start, before serving.
  std::string state_dir;
  // How often leases (and deadlines) are checked; a round's deadline also
  // wakes the ticker when it passes (TickAlarm).
  absl::Duration tick_interval = absl::Milliseconds(100);
  // host:port to serve Prometheus metrics on (GET /metrics); port 0 picks a
  // free port (see CoordinatorServer::metrics_port()). Empty: no endpoint
  // (the counters are kept all the same).
  std::string metrics_listen_address;
  // host:port to serve the status page, /api/v1/status and /metrics on
  // (server/http_status.h); port 0 picks a free port (see http_port()).
  // Empty: none.
  std::string http_listen_address;

  // Transport security (docs/security.md). PEM files, read once at Start.
  // Both empty: plaintext, with a WARNING in the log. The metrics endpoint
  // stays plaintext either way.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Mutual TLS: only clients whose certificate this CA bundle signed get in.
  // Requires tls_cert_file.
  std::string tls_client_ca_file;
  // With a gate and TLS: the CA bundle that signed the other coordinators'
  // certificates, which a standby checks the primary's against on the
  // replication stream (presenting tls_cert_file as its own: mutual TLS
  // where the primary asks for it). Empty: tls_client_ca_file; one of the
  // two is required then.
  std::string ha_tls_ca_file;
  // Per-job bearer tokens (format: server/auth.h). Empty: none; any caller
  // may act on any job.
  std::string token_file;
  // Most Sync + FetchState streams one member may have open at once
  // (RESOURCE_EXHAUSTED beyond). 0: no limit.
  uint32_t max_streams_per_member = 4;

  // High availability (--ha_etcd; not owned, must outlive the server):
  // every call is admitted only while the gate is open (the elected
  // primary), readiness is NOT_SERVING until Promote, and the checkpoints
  // are restored by Promote instead of Start. Null: serves from Start.
  const ServingGate* gate = nullptr;
  // With a gate: the shard's replication (server/replication.h): as the
  // primary it streams to its standbys, as a standby it follows the primary
  // (Follow).
  ReplicationOptions replication;

  absl::Status Validate() const;
};

// The health service name that stays SERVING while the coordinator drains.
inline constexpr char kLivenessService[] = "liveness";

class CoordinatorServer {
 public:
  // Builds the core (restoring checkpoints), binds and starts serving.
  // UNAVAILABLE if an address cannot be bound; INVALID_ARGUMENT for bad
  // options.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      ServerOptions options);
  // Shutdown(absl::ZeroDuration()) if not done yet.
  ~CoordinatorServer();

  // The bound port.
  int port() const { return port_; }
  // The bound metrics port; 0 without a metrics endpoint.
  int metrics_port() const { return metrics_->port(); }
  // The bound status page port; 0 without one.
  int http_port() const { return http_ == nullptr ? 0 : http_->port(); }
  Coordinator* coordinator() { return coordinator_.get(); }
  const Authenticator* authenticator() const { return authenticator_.get(); }

  // With a gate (ServerOptions::gate), once this coordinator has won its
  // shard's election at `epoch`: restores the checkpoints, stamps `epoch`
  // on what it answers, and turns readiness SERVING. The gate opens the
  // calls (the caller opens it after this returns OK). Errors of the
  // restore. Call at most once.
  absl::Status Promote(uint64_t epoch);
  // With a gate, as a standby: follows `primary` (its address) of election
  // `epoch`; Promote stops following and, if this standby was in sync,
  // serves its replicas instead of the checkpoints.
  void Follow(std::string primary, uint64_t epoch);
  // Whether this standby is in sync with the primary it follows (or
  // followed last): it then holds every state a member may hold.
  bool InSync();
  // With a gate: publishes the standbys in sync through `publish` (etcd's
  // synchronous-standby list; ReplicationHub::StartSyncPublisher), and
  // Promote publishes its first, empty list before it serves. Start once,
  // before the election; Stop before `publish`'s target goes.
  void StartSyncPublisher(ReplicationHub::SyncPublisher publish);
  void StopSyncPublisher();
  // With a gate: this coordinator's address as the other coordinators
  // reach it (--ha_advertise, or its default once the port is bound),
  // which a standby gives its primary. Before the election starts.
  void SetAdvertise(const std::string& address);

  // Reads the token file again (what SIGHUP does). On error the tokens
  // loaded before stay in force and the error is returned (and logged).
  // OK without a token file. Thread-safe.
  absl::Status ReloadCredentials();
  Metrics* metrics() { return metrics_.get(); }

  // A graceful shutdown (SIGTERM). Readiness goes NOT_SERVING at once
  // (liveness stays SERVING); no round opens any more (a Sync that would
  // open one, and a Join, get UNAVAILABLE, which clients retry); rounds that
  // are open get until `grace` to close by the usual rules while leases and
  // deadlines keep ticking. Then Shutdown: what still waits fails with
  // UNAVAILABLE, queued checkpoints are written, streams still sending
  // results get until the grace deadline but at least kMinFinishTime, and
  // everything stops. Returns whether every open round
  // closed in time. Blocks until done; idempotent with Shutdown (only the
  // first of them acts).
  bool Drain(absl::Duration grace);

  // Health NOT_SERVING, pending Syncs fail with UNAVAILABLE, queued
  // checkpoints are written, streams still sending results get until
  // `grace`, then the gRPC server stops (cancelling what is left), the tick
  // thread is joined, the metrics endpoint stops. Idempotent; blocks until
  // done.
  void Shutdown(absl::Duration grace);

  // The least time Drain leaves in-flight calls to finish after the rounds'
  // deadline, so that results of rounds that closed at the last moment
  // still reach their members.
  static constexpr absl::Duration kMinFinishTime = absl::Seconds(2);
  // Once no stream is left, how long calls that are arriving get to fail
  // with UNAVAILABLE before the server stops (within the deadline).
  static constexpr absl::Duration kSettleTime = absl::Milliseconds(500);

 private:
  CoordinatorServer() = default;
  void TickLoop();
  // Whether this call is the first to shut down; then marks it.
  bool BeginShutdown();
  void FinishShutdown(absl::Time calls_deadline);

  ServerOptions options_;
  // Declared before coordinator_, so destroyed after it: jobs call it.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<CheckpointStore> store_;  // outlives coordinator_
  // With a gate: the jobs' replicator (outlives coordinator_) and the
  // standby's follower (stopped before coordinator_).
  std::unique_ptr<ReplicationHub> hub_;
  std::atomic<bool> promoted_{false};
  TickAlarm alarm_;  // outlives coordinator_
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<ReplicaFollower> follower_;
  std::unique_ptr<Authenticator> authenticator_;  // outlives service_
  std::unique_ptr<CoordinatorService> service_;
  // Reads coordinator_, metrics_ and authenticator_; stopped in Shutdown.
  std::unique_ptr<StatusHttpServer> http_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread ticker_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVER_H_
