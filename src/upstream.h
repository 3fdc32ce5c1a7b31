// A regional coordinator's way up (docs/design.md "Regional coordinators"):
// each job of a coordinator started with --upstream is itself one member of
// the job of the same name at the upstream coordinator. Its rounds average
// its own members' deltas (MEAN, float32) and, instead of applying that
// mean, hand it up as one contribution whose weight is what its
// contributors weighed together; the upstream round's result comes back
// down, and the regional job commits it as its round's result, so that its
// state is the upstream state bit for bit and its members get it as any
// round's result. A regional job's seed goes up the same way: the upstream
// job takes it if it has no state, and the regional job commits whatever
// state the upstream job holds.
//
// Job (src/job.h) calls an Upstream; the implementation that talks gRPC
// (server/upstream_link.h, the client library's Client) lives outside the
// core. No gRPC here.
#ifndef LOCALSGD_SRC_UPSTREAM_H_
#define LOCALSGD_SRC_UPSTREAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

class Job;

// What a regional job asks of its upstream.
struct UpstreamRequest {
  enum class Kind {
    // `values` is a complete seed: the upstream job's state is wanted (this
    // seed if it has none).
    kSeed,
    // `values` is the round's weighted mean delta against `base` (zeros in
    // chunks no one gave), to contribute with `weight`.
    kRound,
  };
  Kind kind = Kind::kRound;
  // Names the request in the job's answer (Job::CompleteUpstream).
  uint64_t serial = 0;
  // The regional round (0 for a seed).
  RoundId round = 0;
  // kRound: the regional state the round's deltas are against.
  std::shared_ptr<const StateSnapshot> base;
  std::vector<float> values;
  // kRound: the round's contributors' weight together (0: no one
  // contributed a whole delta; nothing goes up) and their local steps
  // together (-1: none said).
  double weight = 0;
  int64_t local_steps = -1;
};

// The upstream's answer.
struct UpstreamAnswer {
  // Not OK: the request failed (the upstream unreachable past the client's
  // retries, or refused it); the regional round's members retry it.
  absl::Status status;
  // OK: with `delta`, `values` is the step to add to the request's base
  // (the upstream round's result); otherwise the upstream state whole (a
  // seed's answer; a round whose base was not the upstream's state, or
  // whose step does not add back to the upstream state bit for bit).
  bool delta = false;
  std::vector<float> values;
  // With `delta`: whether the round's contribution counted upstream. False:
  // the upstream round took the step without it (it came late there); the
  // regional round's members' steps are thrown away, as a late member's.
  bool counted = true;
  // The upstream state's round, for logs and status.
  RoundId upstream_round = 0;
};

// Besides the answer, an Upstream may hand the job a round's step chunk by
// chunk as it arrives, before the answer (Job::UpstreamChunk: from any
// thread, without the job's lock, for the request being answered; the
// answer must then agree with it).
class Upstream {
 public:
  virtual ~Upstream() = default;
  // Takes `request` and answers it later, on another thread, with
  // Job::CompleteUpstream(request.serial, ...) on `job` if it still exists.
  // Called without the job's lock; must not block or call into the job.
  // At most one request is outstanding per job.
  virtual void Submit(std::weak_ptr<Job> job, UpstreamRequest request) = 0;
  // No answer after this returns (one being delivered finishes first).
  // Called without the job's lock. Idempotent.
  virtual void Stop() = 0;
  virtual UpstreamStatus Status() const = 0;
};

// Makes each job's Upstream (CoordinatorOptions::upstream).
class UpstreamFactory {
 public:
  virtual ~UpstreamFactory() = default;
  // For job `job_id` of `layout` (num_elements elements).
  virtual std::unique_ptr<Upstream> ForJob(const std::string& job_id,
                                           const Layout& layout,
                                           uint64_t num_elements) = 0;
  // The upstream's address, for logs and messages.
  virtual std::string target() const = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_UPSTREAM_H_
