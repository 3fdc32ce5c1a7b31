// Prometheus metrics of a coordinator: counts what the core reports through
// CoordinatorObserver and what the gRPC service sees (payload bytes, refused
// calls), and serves them as text on GET /metrics (prometheus-cpp's Exposer,
// a civetweb server with its own threads, owned and joined here).
//
// Metrics (all prefixed localsgd_; docs/deployment.md has the table). A
// job's label is job_id, not job: Prometheus attaches its own `job` label
// (the scrape job) to every series, and with the default honor_labels:
// false a `job` label of ours would be renamed exported_job.
//   members{job_id}                       gauge, read from the core at scrape
//   jobs                                  gauge, read from the core at scrape
//   learned_round_deadline_seconds{job_id} gauge (deadline mode adaptive),
//                                         read from the core at scrape
//   rounds_closed_total{job_id,reason}    counter; reason: complete, deadline,
//                                         members_gone, seed
//   round_duration_seconds{job_id}        histogram of averaging rounds (not
//                                         seeds), first contribution to close
//   contributions_total{job_id}           complete contributions counted
//   dropped_contributions_total{job_id}   participants a round closed without
//                                         (left, lease lost, non-finite drop)
//   timed_out_contributions_total{job_id} participants, still members, a
//                                         round closed without (deadline)
//   jobs_removed_total{reason}            jobs removed: idle (--job_idle_ttl)
//   late_contributions_total{job_id}      Syncs for rounds already closed
//   local_steps_total{job_id,fate}        local steps of contributions that
//                                         said them (SyncHeader.local_steps):
//                                         fate merged, merged_stale (also in
//                                         merged), late, refused, gone,
//                                         timed_out; goodput = merged / all
//                                         but merged_stale
//   rejected_contributions_total{job_id}  contributions refused mid-stream
//                                         (non-finite drop, would overflow)
//   lease_expiries_total{job_id}          members dropped for their lease
//   bytes_received_total{job_id}          chunk payload bytes received
//   bytes_sent_total{job_id}              chunk payload bytes sent
//   ha_standby_in_sync{standby}           a primary's standbys: 1 in sync,
//                                         0 catching up (--ha_etcd)
//   ha_replication_lag_updates{standby}   updates not yet acknowledged
//   requests_rejected_total{method,code}  calls that ended with a non-OK code
//                                         (method: the RPC, or "HTTP <path>")
//
// Thread-safety: Serve and StopServing are for the owner (not concurrently
// with each other); everything else is thread-safe.
#ifndef LOCALSGD_SERVER_METRICS_H_
#define LOCALSGD_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "src/coordinator.h"
#include "src/observer.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace localsgd {

class Metrics final : public CoordinatorObserver {
 public:
  // Counters of one job that the service bumps per chunk; the references
  // stay valid for the life of the Metrics object.
  struct JobCounters {
    prometheus::Counter* bytes_received;
    prometheus::Counter* bytes_sent;
  };

  Metrics();
  // StopServing().
  ~Metrics() override;

  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves GET /metrics on `listen_address` (host:port; port 0 picks a free
  // port, see port()). The gauges read `coordinator`, which must stay alive
  // until StopServing() returns. UNAVAILABLE if the address cannot be bound;
  // FAILED_PRECONDITION if already serving.
  absl::Status Serve(const std::string& listen_address,
                     Coordinator* coordinator);
  // Stops the HTTP server and joins its threads. Idempotent.
  void StopServing();
  // The bound port; 0 when not serving.
  int port() const { return port_; }
  // What GET /metrics returns, with the gauges read from `coordinator` now
  // (the status page's /metrics, server/http_status.h).
  std::string ScrapeText(Coordinator* coordinator) const;

  JobCounters ForJob(const std::string& job_id);
  // A call of `method` (e.g. "Sync") ended with `code` (not OK).
  void RequestRejected(absl::string_view method, absl::StatusCode code);

  // CoordinatorObserver.
  void RoundClosed(const RoundClosedEvent& event) override;
  void LeaseExpired(absl::string_view job_id,
                    absl::string_view member_name) override;
  void LateContribution(absl::string_view job_id, RoundId round) override;
  void LateSteps(absl::string_view job_id, uint64_t steps) override;
  void ContributionRejected(absl::string_view job_id) override;
  void JobRemoved(absl::string_view job_id, absl::string_view reason) override;

  // With an election (--ha_etcd): this coordinator's role in it ("primary",
  // "standby", "candidate": localsgd_ha_role{role} is 1 for it, 0 for the
  // others), the epoch it knows of, and one more failover each time it
  // becomes the primary after the first (localsgd_ha_promotions_total).
  void SetHaRole(absl::string_view role, uint64_t epoch);

 private:
  class JobGauges;
  // Creates every per-job series (at 0) the first time a job is seen, so
  // that rate() and absent() work from the start.
  void TouchJob(absl::string_view job_id);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rounds_closed_;
  prometheus::Family<prometheus::Histogram>& round_duration_;
  prometheus::Family<prometheus::Counter>& contributions_;
  prometheus::Family<prometheus::Counter>& dropped_;
  prometheus::Family<prometheus::Counter>& timed_out_;
  prometheus::Family<prometheus::Counter>& jobs_removed_;
  prometheus::Family<prometheus::Counter>& late_;
  prometheus::Family<prometheus::Counter>& local_steps_;
  prometheus::Family<prometheus::Counter>& refused_contributions_;
  prometheus::Family<prometheus::Counter>& lease_expiries_;
  prometheus::Family<prometheus::Counter>& bytes_received_;
  prometheus::Family<prometheus::Counter>& bytes_sent_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Family<prometheus::Gauge>& ha_role_;
  prometheus::Family<prometheus::Gauge>& ha_epoch_;
  prometheus::Family<prometheus::Counter>& ha_promotions_;

  absl::Mutex mu_;
  absl::flat_hash_set<std::string> jobs_seen_ ABSL_GUARDED_BY(mu_);

  // Set by Serve, reset by StopServing (owner only, see above).
  std::shared_ptr<JobGauges> gauges_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_METRICS_H_
