// libFuzzer target: the standby's side of replication
// (server/replica_applier.h) against arbitrary updates, as from a primary
// that is broken or not one. The input is a ReplicaScript
// (tests/fuzz/fuzz_input.proto).
//
// Invariants (a violation aborts, which libFuzzer reports as a crash):
//  - an update the applier refuses gets a status it documents
//    (INVALID_ARGUMENT, FAILED_PRECONDITION, ABORTED) with a message, and
//    (unless it is the first of a stream, which begins a new catch-up)
//    changes no job: its state's round and id and its members stay;
//  - whatever it applied, every job the standby holds has a state of its
//    layout's size (or none), finite, with momentum and residual empty or
//    of the same size, and a mean residual empty or zeros (a standby has
//    none of its own); promoted, every job answers its status and still
//    does; its members are well formed (ids, names, weights, none twice).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "fuzz_input.pb.h"
#include "server/replica_applier.h"
#include "src/clock.h"
#include "src/coordinator.h"
#include "src/job.h"
#include "src/membership.h"
#include "tests/fuzz/harness.h"

namespace localsgd {
namespace fuzz {
namespace {

void Check(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "replica_fuzzer: invariant violated: %s\n",
               what.c_str());
  std::abort();
}

void CheckFinite(const std::vector<float>& v, const std::string& what) {
  for (size_t i = 0; i < v.size(); ++i) {
    Check(std::isfinite(v[i]), what + ": a non-finite value");
  }
}

void CheckJobs(Coordinator& coordinator) {
  for (const std::shared_ptr<Job>& job : coordinator.Jobs()) {
    const JobReplica replica = job->ExportReplica();
    const std::string what = "job '" + replica.job_id + "'";
    if (replica.state == nullptr) continue;
    const StateSnapshot& s = *replica.state;
    Check(s.values.size() == job->geometry().num_elements(),
          what + ": a state of another size than its layout");
    Check(s.momentum.empty() || s.momentum.size() == s.values.size(),
          what + ": momentum of another size");
    Check(s.residual.empty() || s.residual.size() == s.values.size(),
          what + ": residual of another size");
    // A standby keeps no mean residual of its own: zeros, if any.
    Check(s.mean_residual.empty() || s.mean_residual.size() == s.values.size(),
          what + ": mean residual of another size");
    for (float r : s.mean_residual) {
      Check(r == 0.0f, what + ": a standby's mean residual is not zero");
    }
    CheckFinite(s.values, what + " values");
    CheckFinite(s.momentum, what + " momentum");
    CheckFinite(s.residual, what + " residual");
    // The members it took are well formed (the job checked them).
    Check(Membership::CheckReplicated(replica.members, UINT32_MAX, what).ok(),
          what + ": members that are not well formed");
  }
}

// What a refused update must leave as it was: each job's state (round and
// id) and members.
std::map<std::string, std::tuple<bool, RoundId, uint64_t, size_t>> Snapshot(
    Coordinator& coordinator) {
  std::map<std::string, std::tuple<bool, RoundId, uint64_t, size_t>> out;
  for (const std::shared_ptr<Job>& job : coordinator.Jobs()) {
    const JobReplica r = job->ExportReplica();
    out[r.job_id] = {r.state != nullptr, r.state ? r.state->round : 0,
                     r.state ? r.state->id : 0, r.members.size()};
  }
  return out;
}

void Run(const ReplicaScript& script) {
  FakeClock clock;
  CoordinatorOptions options;
  options.clock = &clock;
  options.max_jobs = 4;
  options.max_model_elements = 1 << 16;
  absl::StatusOr<std::unique_ptr<Coordinator>> created =
      Coordinator::Create(options);
  Check(created.ok(), "Coordinator::Create");
  Coordinator& coordinator = **created;
  auto applier = std::make_unique<ReplicaApplier>(&coordinator, script.epoch());
  std::string assembling;  // the job whose replica is being assembled
  for (int i = 0; i < script.updates_size(); ++i) {
    v1::ReplicaUpdate update = script.updates(i);
    if (script.fix_epochs()) update.set_epoch(script.epoch());
    if (script.fix_sequences()) update.set_sequence(i + 1);
    // The first update of a stream begins a new catch-up (every job goes);
    // a refused one after that changes no job, but the replica it may
    // complete first (the one being assembled: adopted before this update
    // is looked at).
    const bool began = applier->began();
    auto before = Snapshot(coordinator);
    const absl::StatusOr<ReplicaApplier::Applied> applied =
        applier->Apply(update);
    if (!applied.ok() && began) {
      auto after = Snapshot(coordinator);
      before.erase(assembling);
      after.erase(assembling);
      Check(after == before,
            "a refused update changed a job: " + applied.status().ToString());
    }
    if (update.kind_case() == v1::ReplicaUpdate::kJob) {
      assembling = applied.ok() ? update.job().job_id() : "";
    } else if (update.kind_case() != v1::ReplicaUpdate::kStateChunk) {
      assembling.clear();
    }
    if (getenv("LOCALSGD_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr, "update %d (%d): %s\n", i,
                   static_cast<int>(update.kind_case()),
                   applied.ok() ? "ok" : applied.status().ToString().c_str());
    }
    if (!applied.ok()) {
      const absl::StatusCode code = applied.status().code();
      Check(code == absl::StatusCode::kInvalidArgument ||
                code == absl::StatusCode::kFailedPrecondition ||
                code == absl::StatusCode::kAborted,
            "an update refused with " + applied.status().ToString());
      Check(!applied.status().message().empty(), "an error without a message");
      // The follower's next stream: a new catch-up.
      applier = std::make_unique<ReplicaApplier>(&coordinator, script.epoch());
      assembling.clear();
    }
    CheckJobs(coordinator);
  }
  if (!script.promote()) return;
  coordinator.PromoteReplicas();
  for (const std::shared_ptr<Job>& job : coordinator.Jobs()) {
    const JobStatusSnapshot status = job->Status(4);
    Check(status.job_id == job->id(), "a promoted job's status");
  }
  CheckJobs(coordinator);
}

}  // namespace
}  // namespace fuzz
}  // namespace localsgd

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  localsgd::fuzz::InitFuzzing();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  localsgd::fuzz::ReplicaScript script;
  if (!script.ParseFromArray(data, static_cast<int>(size)) ||
      script.updates_size() > 256) {
    return -1;
  }
  localsgd::fuzz::Run(script);
  return 0;
}
