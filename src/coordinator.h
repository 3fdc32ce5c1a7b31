// The coordinator core: a set of named jobs, the limits that bound them, and
// the timer work (leases, deadlines). No gRPC: server/ translates RPCs into
// calls on this class.
//
// Thread-safety: all methods are thread-safe.
#ifndef LOCALSGD_SRC_COORDINATOR_H_
#define LOCALSGD_SRC_COORDINATOR_H_

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/checkpoint.h"
#include "src/checkpointer.h"
#include "src/clock.h"
#include "src/job.h"
#include "src/observer.h"
#include "src/replicator.h"
#include "src/settings.h"
#include "src/tick_alarm.h"
#include "src/types.h"
#include "src/upstream.h"

namespace localsgd {

// Most chunks one layout may be cut into.
inline constexpr uint64_t kMaxChunks = uint64_t{1} << 24;

struct CoordinatorOptions {
  // Not owned; must outlive the coordinator. Null: the real clock.
  Clock* clock = nullptr;
  JobPolicy policy;
  // Settings a job gets where its first member asks for none.
  JobSettings default_settings{/*local_sgd_steps=*/0,
                               /*chunk_elements=*/128 * 1024,
                               /*wire_dtype=*/DType::kFloat32,
                               /*mode=*/AveragingMode::kMean,
                               /*rendezvous_members=*/0,
                               /*nonfinite_policy=*/NonFinitePolicy::kReject,
                               /*contribution=*/Contribution::kParameters,
                               /*outer_lr=*/0.7f,
                               /*outer_momentum=*/0.9f,
                               /*deadline_mode=*/DeadlineMode::kFixed,
                               /*outlier_ratio=*/10.0f,
                               /*mean_encoding=*/MeanEncoding::kFloat32,
                               /*max_staleness=*/kMaxStalenessOff,
                               /*step_budget=*/StepBudget::kFixed,
                               /*min_local_steps=*/0,
                               /*max_local_steps=*/0,
                               /*sparse_keep=*/64,
                               /*sparse_result_keep=*/256};
  // The chunks this coordinator owns when several replicas share the jobs
  // (chunk i of a layout goes to replica i mod shard.count). A job's state
  // here holds only those chunks, back to back.
  ShardSpec shard;
  uint32_t max_jobs = 64;
  // A job with no member for this long is removed (Tick), and its checkpoint
  // with it unless keep_checkpoints. Zero: jobs stay until a restart.
  absl::Duration job_idle_ttl = absl::ZeroDuration();
  bool keep_checkpoints = false;
  // Largest model per job, in elements (8 GiB of fp32 by default).
  uint64_t max_model_elements = uint64_t{2} << 30;
  // Tensors a layout may have (each costs its name, at most
  // kMaxTensorNameBytes, and shape: a job's layout is at most about
  // max_tensors x 1.2 KiB).
  uint32_t max_tensors = 65536;
  // Largest chunk, in elements; chunks must also fit in a gRPC message.
  uint32_t max_chunk_elements = 4u << 20;
  // Join calls per (job, member name): a token bucket refilled at
  // max_join_rate per second (of `clock`) holding at most join_burst; a Join
  // that finds it empty is RESOURCE_EXHAUSTED. 0: no limit.
  double max_join_rate = 10;
  uint32_t join_burst = 20;
  // Not owned. If set, Create restores the jobs checkpointed there (unless
  // defer_restore), and every new global state (seed, closed round) is
  // written there in the background.
  CheckpointStore* checkpoint_store = nullptr;
  // A standby coordinator (--ha_etcd) restores the checkpoints when it wins
  // its shard's election (RestoreCheckpoints), not at Create.
  bool defer_restore = false;
  // Not owned; must outlive the coordinator. If set, told of round closures,
  // lease expiries and late contributions (e.g. for metrics).
  CoordinatorObserver* observer = nullptr;
  // A primary's replicator (src/replicator.h; may be null), given to every
  // job; must outlive the coordinator.
  Replicator* replicator = nullptr;
  // Asked for a Tick at each open round's deadline (src/tick_alarm.h; may
  // be null: deadlines close rounds at the periodic Tick); must outlive the
  // coordinator.
  TickAlarm* alarm = nullptr;
  // A regional coordinator's (src/upstream.h; may be null; must outlive the
  // coordinator): every job is a member of the job of its name upstream,
  // through the Upstream this makes for it. Its jobs average
  // pseudo-gradients with MEAN over float32 (RegionalSettingsError); not
  // with shards or a replicator (standbys).
  UpstreamFactory* upstream = nullptr;

  // INVALID_ARGUMENT naming the bad field.
  absl::Status Validate() const;
  // The limits on a job's settings these options imply.
  SettingsLimits settings_limits() const;
};

class Coordinator {
 public:
  // Validates options and restores checkpointed jobs (a checkpoint that no
  // longer fits the limits, or is corrupt, is skipped with an error log).
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(
      CoordinatorOptions options);
  ~Coordinator();

  // Joins `job_id`, creating it with the member's layout and settings (zero
  // fields: defaults) if it does not exist. INVALID_ARGUMENT: bad job id,
  // weight, incarnation, layout or settings. FAILED_PRECONDITION: differs
  // from the job. RESOURCE_EXHAUSTED: max_jobs, max members, model size.
  // UNAVAILABLE: draining or stopping. RESOURCE_EXHAUSTED also when this
  // (job, member name) joins faster than max_join_rate allows.
  absl::StatusOr<JoinResult> Join(const std::string& job_id,
                                  JoinRequestParams params)
      ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND if the job does not exist; INVALID_ARGUMENT if job_id is
  // malformed.
  absl::StatusOr<std::shared_ptr<Job>> FindJob(absl::string_view job_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // All jobs, sorted by id.
  std::vector<std::shared_ptr<Job>> Jobs() ABSL_LOCKS_EXCLUDED(mu_);

  // Removes job `job_id` and its checkpoint (keep_checkpoints does not
  // apply: this is an explicit delete); returns the round of its state (0:
  // none). NOT_FOUND: no such job; FAILED_PRECONDITION: it has members;
  // INVALID_ARGUMENT: malformed id; UNAVAILABLE: stopping.
  absl::StatusOr<RoundId> DeleteJob(const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Expires leases and closes rounds past their deadline in every job; a
  // standby following its primary (BeginFollowing until PromoteReplicas)
  // does neither: its members' leases run at the primary.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // The first half of a graceful shutdown. Stops opening rounds in every
  // job: a Sync that would open a round or start a seed, and a Join, fail
  // with UNAVAILABLE (clients retry, later or against a restarted
  // coordinator that restores the checkpoints). Rounds already open go on and
  // close by the usual rules (contributions, leases, deadlines: keep calling
  // Tick). Then blocks until no round is open in any job, or until
  // `deadline` (real time, whatever options.clock says). Returns whether
  // every round closed. Idempotent; Stop() afterwards fails what is left.
  bool Drain(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails pending Syncs with UNAVAILABLE, refuses new calls, and writes the
  // checkpoints still queued. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until every global state so far is checkpointed (no-op without a
  // store).
  void FlushCheckpoints();

  const CoordinatorOptions& options() const { return options_; }

  // With defer_restore: restores the checkpointed jobs (as Create does
  // otherwise). Call once, before any call is served.
  absl::Status RestoreCheckpoints() { return Restore(); }

  // The epoch this coordinator serves under: the etcd revision at which it
  // won its shard's election (--ha_etcd), stamped on the responses members
  // act on; 0 without an election. It only grows: a lower value is ignored.
  // Thread-safe.
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  void RaiseEpoch(uint64_t epoch);

  // A standby's coordinator (--ha_etcd): its jobs follow the primary's
  // (src/replicator.h) and are not reclaimed for having no members.
  // BeginFollowing: a new catch-up; every job goes (the replicas that follow
  // bring them back). AdoptReplica: a job of the catch-up (created, or
  // replacing one of that id). ApplyReplicated: an update of a job (a
  // seed's creates the job). Errors: INVALID_ARGUMENT (a malformed replica
  // or update, an unknown job), FAILED_PRECONDITION (see
  // Job::ApplyReplicated). PromoteReplicas: the standby is the primary now
  // (Job::Promote for every job).
  void BeginFollowing() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AdoptReplica(const JobReplica& replica) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ApplyReplicated(const ReplicatedChunk& update)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ApplyReplicated(const ReplicatedCommit& update)
      ABSL_LOCKS_EXCLUDED(mu_);
  void PromoteReplicas() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit Coordinator(CoordinatorOptions options);
  absl::Status Restore();
  // A job of `layout` and `settings` (checked as a Join's are, against this
  // coordinator's limits), made for a replica; not in jobs_ yet.
  absl::StatusOr<std::shared_ptr<Job>> MakeReplicaJob(
      const std::string& job_id, const Layout& layout,
      const JobSettings& settings) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts a replica's job in jobs_, replacing (and stopping) any of its id.
  void InstallReplicaJob(std::shared_ptr<Job> job) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the jobs that have had no member for job_idle_ttl.
  void ReclaimIdleJobs() ABSL_LOCKS_EXCLUDED(mu_);
  // After a job left jobs_: its checkpoint (unless `keep_checkpoint`), the
  // observer, a log line saying `why`.
  void JobGone(const std::string& job_id, absl::string_view reason,
               absl::string_view why, bool keep_checkpoint);

  const CoordinatorOptions options_;
  Clock* const clock_;
  std::atomic<uint64_t> epoch_{0};
  std::unique_ptr<Checkpointer> checkpointer_;  // null without a store
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool following_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_
      ABSL_GUARDED_BY(mu_);
  // Join rate limit (max_join_rate): token buckets keyed by job id and
  // member name. A full bucket is dropped by Tick (it is the same as none), so
  // the map holds only names that joined within the last burst/rate seconds.
  struct JoinBucket {
    double tokens = 0;
    absl::Time refilled;
  };
  absl::Status TakeJoinToken(const std::string& job_id,
                             const std::string& member_name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Join's checks of the request (id, weight, incarnation, name, rate,
  // layout, settings); returns the layout's element count.
  absl::StatusOr<uint64_t> CheckJoin(const std::string& job_id,
                                     const JoinRequestParams& params)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The job `job_id`, created from `params` if it does not exist.
  absl::StatusOr<std::shared_ptr<Job>> FindOrCreateJob(
      const std::string& job_id, const JoinRequestParams& params,
      uint64_t num_elements) ABSL_LOCKS_EXCLUDED(mu_);
  absl::flat_hash_map<std::pair<std::string, std::string>, JoinBucket>
      join_buckets_ ABSL_GUARDED_BY(mu_);
};

// RESOURCE_EXHAUSTED if a layout of `tensors` tensors exceeds
// CoordinatorOptions::max_tensors.
absl::Status CheckTensorCount(uint64_t tensors, uint32_t max_tensors);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_COORDINATOR_H_
