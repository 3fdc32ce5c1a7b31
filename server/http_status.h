// The coordinator's HTTP view (--http_listen): a status page for people, the
// same data as JSON for programs, and the Prometheus text, on one port.
//
//   GET /                 a self-contained HTML page (no external assets; it
//                         works offline) that polls /api/v1/status every
//                         second: jobs, members, the open round and whom it
//                         waits for, recent rounds, a chart of round
//                         durations and contributors over time.
//   GET /api/v1/status    GetJobStatusResponse as JSON (protobuf's JSON
//                         mapping with proto field names and every field
//                         printed, as `localsgdctl status --json`), read
//                         through the same handler as the GetJobStatus RPC.
//                         Query: job=ID (one job; 404 if none), rounds=N
//                         (recent rounds per job, 1..100; default 10).
//   GET /metrics          the Prometheus text of the coordinator's metrics
//                         (what --metrics_listen serves).
//
// Access: with per-job tokens (--token_file), /api/v1/status shows a job only
// to a request carrying that job's token in `Authorization: Bearer <token>`,
// exactly as GetJobStatus does (401 without a token, 403 with another job's
// token for job=ID); the page asks for the token and sends it so. The page
// itself and /metrics hold no job data beyond what Prometheus shows and are
// served to anyone. With mutual TLS and no token file the JSON shows no job
// (403): HTTP carries no client certificate. Plaintext HTTP: bind it to
// loopback or put it behind a TLS proxy when tokens travel over it
// (docs/security.md).
//
// Errors are JSON {"code": "<gRPC code name>", "message": "..."} with the
// HTTP status of the code (400, 401, 403, 404, 405, 500). Every refused
// request is counted in localsgd_requests_rejected_total{method="HTTP
// <route>"} (the route: /, /api/v1/status, /metrics, or "other").
//
// Thread-safety: Start and Stop are for the owner; requests are served on
// civetweb's threads, which Stop joins.
#ifndef LOCALSGD_SERVER_HTTP_STATUS_H_
#define LOCALSGD_SERVER_HTTP_STATUS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "src/coordinator.h"

struct mg_connection;
struct mg_context;

namespace localsgd {

class StatusHttpServer {
 public:
  // Serves on `listen_address` (host:port; port 0 picks a free port, see
  // port()). `coordinator`, `metrics` and `authenticator` (null: no tokens)
  // must outlive the server. UNAVAILABLE if the address cannot be bound.
  // `client_certificates_required` (mutual TLS on the gRPC port): without
  // a token file /api/v1/status then shows nothing (403), since plain HTTP
  // carries no certificate to check.
  static absl::StatusOr<std::unique_ptr<StatusHttpServer>> Start(
      const std::string& listen_address, Coordinator* coordinator,
      Metrics* metrics, const Authenticator* authenticator,
      bool client_certificates_required = false);
  // Stop().
  ~StatusHttpServer();

  StatusHttpServer(const StatusHttpServer&) = delete;
  StatusHttpServer& operator=(const StatusHttpServer&) = delete;

  // Stops serving and joins civetweb's threads. Idempotent.
  void Stop();
  // The bound port.
  int port() const { return port_; }

 private:
  StatusHttpServer(Coordinator* coordinator, Metrics* metrics,
                   const Authenticator* authenticator,
                   bool client_certificates_required)
      : coordinator_(coordinator),
        metrics_(metrics),
        authenticator_(authenticator),
        client_certificates_required_(client_certificates_required) {}

  static int Dispatch(mg_connection* conn, void* self);
  int Handle(mg_connection* conn);

  Coordinator* const coordinator_;
  Metrics* const metrics_;
  const Authenticator* const authenticator_;
  const bool client_certificates_required_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

// The status page's HTML (server/dashboard_page.cc).
absl::string_view DashboardPage();

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_HTTP_STATUS_H_
