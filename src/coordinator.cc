#include "src/coordinator.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace localsgd {

absl::Status CheckTensorCount(uint64_t tensors, uint32_t max_tensors) {
  if (tensors <= max_tensors) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("layout has ", tensors, " tensors, more than ", max_tensors,
                   " (--max_tensors)"));
}

absl::Status CoordinatorOptions::Validate() const {
  if (job_idle_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("job_idle_ttl must be >= 0 (0: never)");
  }
  if (policy.lease_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease_ttl must be positive");
  }
  if (policy.round_deadline < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("round_deadline must be >= 0");
  }
  if (policy.min_quorum < 1) {
    return absl::InvalidArgumentError("min_quorum must be >= 1");
  }
  if (policy.max_members < 1 || max_jobs < 1) {
    return absl::InvalidArgumentError("max_members and max_jobs must be >= 1");
  }
  if (policy.max_recent_rounds < 1) {
    return absl::InvalidArgumentError("max_recent_rounds must be >= 1");
  }
  if (max_chunk_elements < 1 || max_model_elements < 1 || max_tensors < 1) {
    return absl::InvalidArgumentError(
        "max_chunk_elements, max_model_elements and max_tensors must be >= 1");
  }
  if (!(max_join_rate >= 0) || std::isinf(max_join_rate) || join_burst < 1) {
    return absl::InvalidArgumentError(
        "max_join_rate must be finite and >= 0, join_burst >= 1");
  }
  if (upstream != nullptr &&
      (shard.count > 1 || replicator != nullptr || defer_restore)) {
    return absl::InvalidArgumentError(
        "a regional coordinator (an upstream) runs without shards and "
        "without standbys");
  }
  if (shard.count < 1 || shard.index >= shard.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard index ", shard.index, " of ", shard.count,
                     " is invalid: need count >= 1 and index < count"));
  }
  return ValidateComplete(default_settings, settings_limits(), "default ");
}

SettingsLimits CoordinatorOptions::settings_limits() const {
  SettingsLimits limits;
  limits.max_chunk_elements = max_chunk_elements;
  limits.max_members = policy.max_members;
  return limits;
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(
    CoordinatorOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto coordinator =
      std::unique_ptr<Coordinator>(new Coordinator(std::move(options)));
  if (!coordinator->options_.defer_restore) {
    if (absl::Status s = coordinator->Restore(); !s.ok()) return s;
  }
  return coordinator;
}

void Coordinator::RaiseEpoch(uint64_t epoch) {
  uint64_t seen = epoch_.load(std::memory_order_acquire);
  while (seen < epoch && !epoch_.compare_exchange_weak(
                             seen, epoch, std::memory_order_acq_rel)) {
  }
}

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()) {
  if (options_.checkpoint_store != nullptr) {
    checkpointer_ = std::make_unique<Checkpointer>(
        options_.checkpoint_store, options_.shard, [this] { return epoch(); });
  }
}

namespace {

// A state that an older build let become non-finite is never served: the
// job is not restored, and its members, joining again, re-seed it from the
// state they hold.
absl::Status CheckFinite(const JobCheckpoint& c) {
  for (const auto& [what, values] :
       {std::pair<const char*, const std::vector<float>*>{"parameter",
                                                          &c.values},
        {"outer momentum", &c.momentum},
        {"quantization residual", &c.residual},
        {"mean residual", &c.mean_residual}}) {
    for (size_t i = 0; i < values->size(); ++i) {
      if (!std::isfinite((*values)[i])) {
        return absl::DataLossError(absl::StrCat(
            "its state of round ", c.round, " holds a non-finite ", what,
            " value at element ", i,
            " (written by a build without the finite-state guard); its "
            "members re-seed it from the state they hold"));
      }
    }
  }
  return absl::OkStatus();
}

// A regional coordinator's job averages its members' deltas as they are
// (MEAN over float32): the outer rule and its wire are the upstream job's.
absl::Status RegionalSettingsError(const JobSettings& settings,
                                   absl::string_view target) {
  if (settings.contribution == Contribution::kPseudoGradients &&
      settings.mode == AveragingMode::kMean &&
      settings.wire_dtype == DType::kFloat32) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "this coordinator is regional (a member of the job of the same name at ",
      target,
      "): its jobs average pseudo-gradients with MEAN over float32, and the "
      "upstream job applies the outer rule and its own wire; the settings "
      "ask for ",
      settings.contribution == Contribution::kPseudoGradients ? ""
                                                              : "parameters, ",
      "mode ", AveragingModeName(settings.mode), ", wire ",
      DTypeName(settings.wire_dtype)));
}

}  // namespace

absl::Status Coordinator::Restore() {
  if (options_.checkpoint_store == nullptr) return absl::OkStatus();
  std::vector<std::string> errors;
  absl::StatusOr<std::vector<JobCheckpoint>> loaded =
      options_.checkpoint_store->LoadAll(&errors);
  if (!loaded.ok()) return loaded.status();
  absl::MutexLock lock(&mu_);
  for (JobCheckpoint& c : *loaded) {
    // The limits may have changed since the checkpoint was written.
    absl::StatusOr<uint64_t> n =
        ValidateLayout(c.layout, options_.max_model_elements);
    absl::Status s = n.status();
    if (s.ok() && c.settings.chunk_elements > options_.max_chunk_elements) {
      s = absl::ResourceExhaustedError(
          absl::StrCat("chunk_elements ", c.settings.chunk_elements,
                       " exceeds --max_message_bytes"));
    }
    if (s.ok() && !(c.shard == options_.shard)) {
      s = absl::FailedPreconditionError(
          absl::StrCat("it holds shard ", c.shard.index, " of ", c.shard.count,
                       " but this coordinator is shard ", options_.shard.index,
                       " of ", options_.shard.count,
                       " (--shard_index/--shard_count); give each "
                       "replica its own state directory"));
    }
    if (s.ok()) s = CheckFinite(c);
    if (s.ok() && options_.upstream != nullptr) {
      s = RegionalSettingsError(c.settings, options_.upstream->target());
    }
    if (s.ok() && jobs_.size() >= options_.max_jobs) {
      s = absl::ResourceExhaustedError(
          "more checkpointed jobs than --max_jobs");
    }
    if (!s.ok()) {
      LOG(ERROR) << "not restoring job " << c.job_id << " from "
                 << options_.checkpoint_store->dir() << ": " << s;
      continue;
    }
    const uint64_t shard_elements =
        ShardElements(*n, c.settings.chunk_elements, options_.shard);
    auto job = std::make_shared<Job>(c.job_id, c.layout, shard_elements,
                                     c.settings, options_.policy, clock_,
                                     checkpointer_.get(), options_.observer,
                                     options_.replicator, options_.alarm);
    if (options_.upstream != nullptr) {
      job->SetUpstream(
          options_.upstream->ForJob(c.job_id, c.layout, shard_elements));
    }
    job->RestoreState(c.round, std::move(c.values), c.state_id,
                      std::move(c.momentum), std::move(c.residual),
                      std::move(c.mean_residual), std::move(c.ancestors),
                      c.participants);
    LOG(INFO) << "restored job " << c.job_id << " at round " << c.round << " ("
              << *n << " elements) from " << options_.checkpoint_store->dir()
              << (c.participants > 0
                      ? absl::StrCat("; its next round waits for ",
                                     c.participants, " members or one lease")
                      : std::string("; its next round waits one lease"));
    jobs_.emplace(c.job_id, std::move(job));
  }
  return absl::OkStatus();
}

void Coordinator::FlushCheckpoints() {
  if (checkpointer_ != nullptr) checkpointer_->Flush();
}

Coordinator::~Coordinator() { Stop(); }

absl::StatusOr<JoinResult> Coordinator::Join(const std::string& job_id,
                                             JoinRequestParams params) {
  if (params.weight == 0) params.weight = 1;
  absl::StatusOr<uint64_t> num_elements = CheckJoin(job_id, params);
  if (!num_elements.ok()) return num_elements.status();
  absl::StatusOr<std::shared_ptr<Job>> job =
      FindOrCreateJob(job_id, params, *num_elements);
  if (!job.ok()) return job.status();
  return (*job)->Join(params);
}

absl::StatusOr<uint64_t> Coordinator::CheckJoin(
    const std::string& job_id, const JoinRequestParams& params) {
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  if (!std::isfinite(params.weight) || params.weight < 1e-6 ||
      params.weight > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight must be finite and in [1e-6, 1e6]; got ", params.weight));
  }
  if (params.incarnation == 0) {
    return absl::InvalidArgumentError(
        "incarnation must be a non-zero random number per process start");
  }
  if (params.member_name.empty()) {
    // The name and incarnation make a retried Join find its member: without
    // a name every retry would add another member for rounds to wait for.
    return absl::InvalidArgumentError(
        "member_name is empty; name the member (e.g. host and rank): a "
        "retried Join finds its member by name and incarnation");
  }
  if (params.member_name.size() > 256) {
    return absl::InvalidArgumentError("member_name is longer than 256 bytes");
  }
  if (absl::Status s =
          CheckNoControlCharacters(params.member_name, "member_name");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckTensorCount(params.layout.tensors.size(), options_.max_tensors);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = TakeJoinToken(job_id, params.member_name); !s.ok()) {
    return s;
  }
  absl::StatusOr<uint64_t> num_elements =
      ValidateLayout(params.layout, options_.max_model_elements);
  if (!num_elements.ok()) return num_elements.status();
  const JobSettings& want = params.settings;
  {
    // The chunk count must fit the protocol's uint32 index and keep the
    // per-chunk bookkeeping (8 bytes each) small next to the model.
    const uint64_t chunk = want.chunk_elements != 0
                               ? want.chunk_elements
                               : options_.default_settings.chunk_elements;
    const uint64_t chunks = (*num_elements + chunk - 1) / chunk;
    if (chunks > kMaxChunks) {
      return absl::InvalidArgumentError(
          absl::StrCat("a layout of ", *num_elements, " elements in chunks of ",
                       chunk, " makes ", chunks, " chunks, more than ",
                       kMaxChunks, "; ask for larger chunk_elements"));
    }
  }
  if (absl::Status s = ValidateSetFields(want, options_.settings_limits());
      !s.ok()) {
    return s;
  }
  return *num_elements;
}

absl::StatusOr<std::shared_ptr<Job>> Coordinator::FindOrCreateJob(
    const std::string& job_id, const JoinRequestParams& params,
    uint64_t num_elements) {
  const JobSettings& want = params.settings;
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      return absl::UnavailableError(
          "coordinator is shutting down; retry later or against another "
          "replica");
    }
    if (draining_) {
      return absl::UnavailableError(
          "coordinator is draining (shutting down) and takes no new members; "
          "retry, it or its replacement will take it");
    }
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
      job = it->second;
    } else {
      if (jobs_.size() >= options_.max_jobs) {
        return absl::ResourceExhaustedError(
            absl::StrCat("coordinator holds ", jobs_.size(),
                         " jobs, the limit (--max_jobs)"));
      }
      const JobSettings settings =
          WithDefaults(want, options_.default_settings);
      // What the member asks for combined with the defaults (a code of a
      // few bits needs pseudo-gradients, ...).
      if (absl::Status s =
              ValidateComplete(settings, options_.settings_limits(), "");
          !s.ok()) {
        return s;
      }
      if (options_.upstream != nullptr) {
        if (absl::Status s =
                RegionalSettingsError(settings, options_.upstream->target());
            !s.ok()) {
          return s;
        }
      }
      const uint64_t shard_elements =
          ShardElements(num_elements, settings.chunk_elements, options_.shard);
      if (shard_elements == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("a layout of ", num_elements,
                         " elements in chunks of ", settings.chunk_elements,
                         " has fewer chunks than the ", options_.shard.count,
                         " coordinator replicas, and this replica (shard ",
                         options_.shard.index,
                         ") would own none; ask for smaller "
                         "chunk_elements"));
      }
      job = std::make_shared<Job>(job_id, params.layout, shard_elements,
                                  settings, options_.policy, clock_,
                                  checkpointer_.get(), options_.observer,
                                  options_.replicator, options_.alarm);
      if (options_.upstream != nullptr) {
        job->SetUpstream(
            options_.upstream->ForJob(job_id, params.layout, shard_elements));
      }
      jobs_.emplace(job_id, job);
      LOG(INFO) << "job " << job_id
                << " created: " << params.layout.tensors.size() << " tensors, "
                << num_elements << " elements, " << job->geometry().num_chunks()
                << " chunks of " << settings.chunk_elements
                << (options_.shard.count > 1
                        ? absl::StrCat(" (shard ", options_.shard.index, " of ",
                                       options_.shard.count, ")")
                        : std::string())
                << ", wire " << DTypeName(settings.wire_dtype)
                << ", K=" << settings.local_sgd_steps;
    }
  }
  return job;
}

absl::StatusOr<std::shared_ptr<Job>> Coordinator::FindJob(
    absl::string_view job_id) {
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job '", job_id, "' does not exist; Join creates it"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Job>> Coordinator::Jobs() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  std::sort(jobs.begin(), jobs.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return jobs;
}

absl::Status Coordinator::TakeJoinToken(const std::string& job_id,
                                        const std::string& member_name) {
  if (options_.max_join_rate == 0) return absl::OkStatus();
  const absl::Time now = clock_->Now();
  const double burst = options_.join_burst;
  absl::MutexLock lock(&mu_);
  auto [it, added] = join_buckets_.try_emplace({job_id, member_name});
  JoinBucket& b = it->second;
  if (added) {
    b.tokens = burst;
  } else {
    b.tokens =
        std::min(burst, b.tokens + absl::ToDoubleSeconds(now - b.refilled) *
                                       options_.max_join_rate);
  }
  b.refilled = now;
  if (b.tokens < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("member '", member_name, "' of job '", job_id,
                     "' joins too often: the limit is ", options_.max_join_rate,
                     " Joins per second with bursts of ", options_.join_burst,
                     " (--max_join_rate, --join_burst); retry later"));
  }
  b.tokens -= 1;
  return absl::OkStatus();
}

void Coordinator::Tick() {
  bool following;
  {
    absl::MutexLock lock(&mu_);
    following = following_;
  }
  // A standby's jobs are its primary's: their members call the primary, so
  // no lease of theirs runs here (Promote starts them all again), and no
  // round of theirs has a deadline here.
  if (!following) {
    for (const auto& job : Jobs()) job->Tick();
  }
  if (options_.job_idle_ttl > absl::ZeroDuration() && !following) {
    ReclaimIdleJobs();
  }
  if (options_.max_join_rate > 0) {
    // Drop the buckets that have refilled: the same as having none.
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mu_);
    absl::erase_if(join_buckets_, [&](const auto& entry) {
      const JoinBucket& b = entry.second;
      return b.tokens + absl::ToDoubleSeconds(now - b.refilled) *
                            options_.max_join_rate >=
             options_.join_burst;
    });
  }
}

void Coordinator::BeginFollowing() {
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> old;
  {
    absl::MutexLock lock(&mu_);
    following_ = true;
    old.swap(jobs_);
  }
  for (auto& [id, job] : old) job->Stop();
}

absl::StatusOr<std::shared_ptr<Job>> Coordinator::MakeReplicaJob(
    const std::string& job_id, const Layout& layout,
    const JobSettings& settings) {
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  absl::StatusOr<uint64_t> n =
      ValidateLayout(layout, options_.max_model_elements);
  if (!n.ok()) return n.status();
  if (absl::Status s =
          ValidateComplete(settings, options_.settings_limits(), "");
      !s.ok()) {
    return s;
  }
  auto job = std::make_shared<Job>(
      job_id, layout,
      ShardElements(*n, settings.chunk_elements, options_.shard), settings,
      options_.policy, clock_, checkpointer_.get(), options_.observer,
      options_.replicator, options_.alarm);
  return job;
}

void Coordinator::InstallReplicaJob(std::shared_ptr<Job> job) {
  std::shared_ptr<Job> replaced;
  {
    absl::MutexLock lock(&mu_);
    auto [it, fresh] = jobs_.try_emplace(job->id(), job);
    if (!fresh) {
      replaced = std::move(it->second);
      it->second = std::move(job);
    }
  }
  if (replaced != nullptr) replaced->Stop();
}

absl::Status Coordinator::AdoptReplica(const JobReplica& replica) {
  absl::StatusOr<std::shared_ptr<Job>> job =
      MakeReplicaJob(replica.job_id, replica.layout, replica.settings);
  if (!job.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica of job '", replica.job_id, "': ", job.status().message()));
  }
  // Installed only once it holds the replica: a malformed one changes no
  // job.
  if (absl::Status s = (*job)->ImportReplica(replica); !s.ok()) return s;
  InstallReplicaJob(*std::move(job));
  return absl::OkStatus();
}

absl::Status Coordinator::ApplyReplicated(const ReplicatedChunk& update) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(update.job_id);
  if (!job.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicated chunk of an unknown job: ", job.status().message()));
  }
  return (*job)->ApplyReplicated(update);
}

absl::Status Coordinator::ApplyReplicated(const ReplicatedCommit& update) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(update.job_id);
  const bool fresh = !job.ok() && update.seed != nullptr;
  if (fresh) {
    job = MakeReplicaJob(update.job_id, update.layout, update.settings);
  }
  if (!job.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicated commit of job '", update.job_id,
                     "': ", job.status().message()));
  }
  if (absl::Status s = (*job)->ApplyReplicated(update); !s.ok()) return s;
  // A job the seed makes: installed once it holds the seed.
  if (fresh) InstallReplicaJob(*std::move(job));
  return absl::OkStatus();
}

void Coordinator::PromoteReplicas() {
  {
    absl::MutexLock lock(&mu_);
    following_ = false;
  }
  for (const auto& job : Jobs()) job->Promote();
}

void Coordinator::ReclaimIdleJobs() {
  const absl::Time now = clock_->Now();
  std::vector<std::string> removed;
  {
    // Under mu_ (then each job's lock), so that no Join finds a job between
    // its retirement and its removal without being told to retry.
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->second->RetireIfEmptyFor(now, options_.job_idle_ttl)) {
        removed.push_back(it->first);
        jobs_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (const std::string& id : removed) {
    JobGone(id, "idle",
            absl::StrCat("reclaimed: no members for ",
                         absl::FormatDuration(options_.job_idle_ttl)),
            options_.keep_checkpoints);
  }
}

absl::StatusOr<RoundId> Coordinator::DeleteJob(const std::string& job_id) {
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  RoundId round = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      return absl::UnavailableError("coordinator is shutting down");
    }
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("job '", job_id, "' does not exist"));
    }
    Job& job = *it->second;
    if (!job.RetireIfEmptyFor(absl::InfiniteFuture(), absl::ZeroDuration())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job_id, "' has ", job.num_members(),
          " members; stop them first (or let their leases run out), then "
          "delete it"));
    }
    round = job.Status(0).state_round;
    jobs_.erase(it);
  }
  JobGone(job_id, "deleted", "deleted", /*keep_checkpoint=*/false);
  return round;
}

void Coordinator::JobGone(const std::string& job_id, absl::string_view reason,
                          absl::string_view why, bool keep_checkpoint) {
  LOG(INFO) << "job " << job_id << " " << why
            << (checkpointer_ == nullptr ? ""
                : keep_checkpoint
                    ? "; its checkpoint is kept (--keep_checkpoints)"
                    : "; its checkpoint is removed");
  if (checkpointer_ != nullptr && !keep_checkpoint) {
    checkpointer_->JobRemoved(job_id);
  }
  if (options_.observer != nullptr) {
    options_.observer->JobRemoved(job_id, reason);
  }
}

bool Coordinator::Drain(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    // Under mu_, so that no job is created after the loop below has run.
    draining_ = true;
  }
  const std::vector<std::shared_ptr<Job>> jobs = Jobs();
  for (const auto& job : jobs) job->BeginDrain();
  bool idle = true;
  // One deadline for all: the total wait is bounded by it, not by its
  // multiple.
  for (const auto& job : jobs) {
    if (!job->AwaitIdle(deadline)) {
      LOG(WARNING) << "job " << job->id()
                   << ": a round is still open at the drain deadline";
      idle = false;
    }
  }
  return idle;
}

void Coordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  for (const auto& job : Jobs()) job->Stop();
  if (checkpointer_ != nullptr) checkpointer_->Stop();
}

}  // namespace localsgd
