#include "server/metrics.h"

#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "prometheus/client_metric.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace localsgd {
namespace {

// Local SGD rounds last from milliseconds (a small model on loopback) to
// minutes (stragglers, deadlines, large models).
const prometheus::Histogram::BucketBoundaries& RoundDurationBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
      2.5,   5,    10,    30,   60,  120,  300, 600};
  return *buckets;
}

}  // namespace

// Gauges that describe the core as it is now, read at scrape time rather
// than kept up to date by events: the observer's calls for one job may arrive
// out of order (they run after the job's lock is released), which a counter
// does not mind but a gauge would.
class Metrics::JobGauges final : public prometheus::Collectable {
 public:
  explicit JobGauges(Coordinator* coordinator) : coordinator_(coordinator) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const std::vector<std::shared_ptr<Job>> jobs = coordinator_->Jobs();
    prometheus::MetricFamily members;
    members.name = "localsgd_members";
    members.help = "Members of a job (joined and holding a lease)";
    members.type = prometheus::MetricType::Gauge;
    for (const auto& job : jobs) {
      prometheus::ClientMetric m;
      m.label.push_back({"job_id", job->id()});
      m.gauge.value = static_cast<double>(job->num_members());
      members.metric.push_back(std::move(m));
    }
    prometheus::MetricFamily learned;
    learned.name = "localsgd_learned_round_deadline_seconds";
    learned.help =
        "Jobs of deadline mode adaptive: how long their rounds usually take "
        "(median + 3 MAD of recent completion lags), after which a round "
        "waiting only for persistent stragglers closes (0: not learned yet)";
    learned.type = prometheus::MetricType::Gauge;
    for (const auto& job : jobs) {
      if (job->settings().deadline_mode != DeadlineMode::kAdaptive) continue;
      prometheus::ClientMetric m;
      m.label.push_back({"job_id", job->id()});
      m.gauge.value = absl::ToDoubleSeconds(job->learned_deadline().usual);
      learned.metric.push_back(std::move(m));
    }
    prometheus::MetricFamily count;
    count.name = "localsgd_jobs";
    count.help = "Jobs the coordinator holds";
    count.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric c;
    c.gauge.value = static_cast<double>(jobs.size());
    count.metric.push_back(std::move(c));
    std::vector<prometheus::MetricFamily> out = {
        std::move(members), std::move(count), std::move(learned)};
    if (Replicator* replicator = coordinator_->options().replicator) {
      // A primary's standbys (--ha_etcd); none listed on a standby.
      prometheus::MetricFamily in_sync;
      in_sync.name = "localsgd_ha_standby_in_sync";
      in_sync.help =
          "Standbys following this primary's state: 1 in sync (results wait "
          "for its acks), 0 catching up";
      in_sync.type = prometheus::MetricType::Gauge;
      prometheus::MetricFamily lag;
      lag.name = "localsgd_ha_replication_lag_updates";
      lag.help =
          "Replication updates (final chunks, commits) made and not yet "
          "acknowledged by the standby";
      lag.type = prometheus::MetricType::Gauge;
      for (const StandbyStatus& s : replicator->Standbys()) {
        prometheus::ClientMetric m;
        m.label.push_back({"standby", s.address});
        m.gauge.value = s.in_sync ? 1 : 0;
        in_sync.metric.push_back(m);
        m.gauge.value = static_cast<double>(s.lag);
        lag.metric.push_back(std::move(m));
      }
      out.push_back(std::move(in_sync));
      out.push_back(std::move(lag));
    }
    return out;
  }

 private:
  Coordinator* const coordinator_;
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      rounds_closed_(prometheus::BuildCounter()
                         .Name("localsgd_rounds_closed_total")
                         .Help("Rounds closed, by why they closed (round 0, "
                               "the seed, counts as reason=\"seed\")")
                         .Register(*registry_)),
      round_duration_(prometheus::BuildHistogram()
                          .Name("localsgd_round_duration_seconds")
                          .Help("Time from a round's first contribution to "
                                "its closing (averaging rounds, not seeds)")
                          .Register(*registry_)),
      contributions_(prometheus::BuildCounter()
                         .Name("localsgd_contributions_total")
                         .Help("Complete contributions counted in closed "
                               "averaging rounds")
                         .Register(*registry_)),
      dropped_(prometheus::BuildCounter()
                   .Name("localsgd_dropped_contributions_total")
                   .Help("Participants that a round closed without because "
                         "they left, lost their lease or were dropped for a "
                         "non-finite value")
                   .Register(*registry_)),
      timed_out_(prometheus::BuildCounter()
                     .Name("localsgd_timed_out_contributions_total")
                     .Help("Participants, still members, that a round closed "
                           "without (its deadline passed)")
                     .Register(*registry_)),
      jobs_removed_(prometheus::BuildCounter()
                        .Name("localsgd_jobs_removed_total")
                        .Help("Jobs removed; reason idle: no members for "
                              "--job_idle_ttl")
                        .Register(*registry_)),
      late_(prometheus::BuildCounter()
                .Name("localsgd_late_contributions_total")
                .Help("Syncs for a round that had closed already (the "
                      "member adopts the latest result)")
                .Register(*registry_)),
      local_steps_(prometheus::BuildCounter()
                       .Name("localsgd_local_steps_total")
                       .Help("Local steps of the contributions that said "
                             "them, by fate: merged (merged_stale of them "
                             "stale), or thrown away late, refused, gone or "
                             "timed_out")
                       .Register(*registry_)),
      refused_contributions_(
          prometheus::BuildCounter()
              .Name("localsgd_rejected_contributions_total")
              .Help("Contributions refused mid-stream: a non-finite "
                    "value (policy drop) or a delta that would "
                    "overflow the state")
              .Register(*registry_)),
      lease_expiries_(prometheus::BuildCounter()
                          .Name("localsgd_lease_expiries_total")
                          .Help("Members dropped because their lease ran out")
                          .Register(*registry_)),
      bytes_received_(prometheus::BuildCounter()
                          .Name("localsgd_bytes_received_total")
                          .Help("Chunk payload bytes received (Sync)")
                          .Register(*registry_)),
      bytes_sent_(prometheus::BuildCounter()
                      .Name("localsgd_bytes_sent_total")
                      .Help("Chunk payload bytes sent (Sync results and "
                            "FetchState)")
                      .Register(*registry_)),
      rejected_(prometheus::BuildCounter()
                    .Name("localsgd_requests_rejected_total")
                    .Help("Calls that ended with a non-OK gRPC status, by "
                          "method and status code")
                    .Register(*registry_)),
      ha_role_(prometheus::BuildGauge()
                   .Name("localsgd_ha_role")
                   .Help("With --ha_etcd: 1 for this coordinator's role in "
                         "its shard's election (primary, standby, "
                         "candidate), 0 for the others")
                   .Register(*registry_)),
      ha_epoch_(prometheus::BuildGauge()
                    .Name("localsgd_ha_epoch")
                    .Help("With --ha_etcd: the epoch (etcd revision of the "
                          "shard's election) this coordinator knows of")
                    .Register(*registry_)),
      ha_promotions_(prometheus::BuildCounter()
                         .Name("localsgd_ha_promotions_total")
                         .Help("With --ha_etcd: times this process became "
                               "its shard's primary")
                         .Register(*registry_)) {}

void Metrics::SetHaRole(absl::string_view role, uint64_t epoch) {
  for (const char* r : {"primary", "standby", "candidate"}) {
    ha_role_.Add({{"role", r}}).Set(role == r ? 1 : 0);
  }
  ha_epoch_.Add({}).Set(static_cast<double>(epoch));
  prometheus::Counter& promotions = ha_promotions_.Add({});
  if (role == "primary") promotions.Increment();
}

Metrics::~Metrics() { StopServing(); }

absl::Status Metrics::Serve(const std::string& listen_address,
                            Coordinator* coordinator) {
  if (exposer_ != nullptr) {
    return absl::FailedPreconditionError("metrics are served already");
  }
  try {
    // One thread is plenty for a scrape every few seconds.
    exposer_ = std::make_unique<prometheus::Exposer>(listen_address,
                                                     /*num_threads=*/1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen_address, ": ", e.what(),
                     " (address in use, or not of this host?)"));
  }
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) {
    exposer_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen_address));
  }
  port_ = ports.front();
  gauges_ = std::make_shared<JobGauges>(coordinator);
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(gauges_);
  LOG(INFO) << "metrics on http://" << listen_address << "/metrics (port "
            << port_ << ")";
  return absl::OkStatus();
}

std::string Metrics::ScrapeText(Coordinator* coordinator) const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& f : JobGauges(coordinator).Collect()) {
    families.push_back(std::move(f));
  }
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::StopServing() {
  // The Exposer's destructor stops civetweb and joins its threads; only then
  // may the gauges (and the coordinator they read) go.
  exposer_.reset();
  gauges_.reset();
  port_ = 0;
}

void Metrics::TouchJob(absl::string_view job_id) {
  {
    absl::MutexLock lock(&mu_);
    if (!jobs_seen_.insert(std::string(job_id)).second) return;
  }
  const prometheus::Labels job = {{"job_id", std::string(job_id)}};
  for (absl::string_view reason : {CloseReasonName(CloseReason::kComplete),
                                   CloseReasonName(CloseReason::kDeadline),
                                   CloseReasonName(CloseReason::kMembersGone),
                                   CloseReasonName(CloseReason::kSeed)}) {
    rounds_closed_.Add(
        {{"job_id", std::string(job_id)}, {"reason", std::string(reason)}});
  }
  round_duration_.Add(job, RoundDurationBuckets());
  for (absl::string_view fate :
       {"merged", "merged_stale", "late", "refused", "gone", "timed_out"}) {
    local_steps_.Add(
        {{"job_id", std::string(job_id)}, {"fate", std::string(fate)}});
  }
  for (auto* family : {&contributions_, &dropped_, &timed_out_, &late_,
                       &refused_contributions_, &lease_expiries_,
                       &bytes_received_, &bytes_sent_}) {
    family->Add(job);
  }
}

Metrics::JobCounters Metrics::ForJob(const std::string& job_id) {
  TouchJob(job_id);
  return JobCounters{&bytes_received_.Add({{"job_id", job_id}}),
                     &bytes_sent_.Add({{"job_id", job_id}})};
}

void Metrics::RequestRejected(absl::string_view method, absl::StatusCode code) {
  rejected_
      .Add({{"method", std::string(method)},
            {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

void Metrics::RoundClosed(const RoundClosedEvent& event) {
  TouchJob(event.job_id);
  rounds_closed_
      .Add({{"job_id", event.job_id},
            {"reason", std::string(CloseReasonName(event.reason))}})
      .Increment();
  if (event.reason == CloseReason::kSeed) return;
  round_duration_.Add({{"job_id", event.job_id}}, RoundDurationBuckets())
      .Observe(absl::ToDoubleSeconds(event.duration));
  contributions_.Add({{"job_id", event.job_id}}).Increment(event.contributors);
  dropped_.Add({{"job_id", event.job_id}}).Increment(event.dropped);
  timed_out_.Add({{"job_id", event.job_id}}).Increment(event.timed_out);
  const StepCounts& steps = event.steps;
  for (const auto& [fate, n] :
       {std::pair<const char*, uint64_t>{"merged", steps.merged},
        {"merged_stale", steps.merged_stale},
        {"late", steps.late},
        {"refused", steps.refused},
        {"gone", steps.gone},
        {"timed_out", steps.timed_out}}) {
    if (n == 0) continue;
    local_steps_.Add({{"job_id", event.job_id}, {"fate", fate}})
        .Increment(static_cast<double>(n));
  }
}

void Metrics::LateSteps(absl::string_view job_id, uint64_t steps) {
  TouchJob(job_id);
  local_steps_.Add({{"job_id", std::string(job_id)}, {"fate", "late"}})
      .Increment(static_cast<double>(steps));
}

void Metrics::LeaseExpired(absl::string_view job_id,
                           absl::string_view member_name) {
  TouchJob(job_id);
  lease_expiries_.Add({{"job_id", std::string(job_id)}}).Increment();
}

void Metrics::JobRemoved(absl::string_view job_id, absl::string_view reason) {
  jobs_removed_.Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::LateContribution(absl::string_view job_id, RoundId round) {
  TouchJob(job_id);
  late_.Add({{"job_id", std::string(job_id)}}).Increment();
}

void Metrics::ContributionRejected(absl::string_view job_id) {
  TouchJob(job_id);
  refused_contributions_.Add({{"job_id", std::string(job_id)}}).Increment();
}

}  // namespace localsgd
