// Events of the coordinator core that an operator wants to count (metrics),
// without the core knowing how they are exported. server/metrics.h implements
// this with Prometheus; the core only calls it.
#ifndef LOCALSGD_SRC_OBSERVER_H_
#define LOCALSGD_SRC_OBSERVER_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/round.h"
#include "src/types.h"

namespace localsgd {

// A round (or the seed, round 0) that closed.
struct RoundClosedEvent {
  std::string job_id;
  RoundId round = 0;
  CloseReason reason = CloseReason::kComplete;
  // From the round's first contribution to its closing (zero for a seed).
  absl::Duration duration;
  uint32_t participants = 0;
  // Participants whose complete contribution was counted.
  uint32_t contributors = 0;
  // Participants that left, lost their lease or were dropped for a
  // non-finite value before contributing every chunk.
  uint32_t dropped = 0;
  // Participants still members when the round closed without their
  // complete contribution (the deadline, or the job stopping).
  uint32_t timed_out = 0;
  // The local steps of its participants' contributions, by fate.
  StepCounts steps;
};

// Told of events as they happen. The core calls it after releasing its locks,
// from whichever thread caused the event (a gRPC handler, the tick thread),
// so calls for one job may arrive out of order relative to each other.
// Implementations must be thread-safe, must not block, and must not call back
// into the core. Every method has an empty default.
class CoordinatorObserver {
 public:
  virtual ~CoordinatorObserver() = default;

  // A round closed, or a job's seed completed (round 0, reason kSeed).
  virtual void RoundClosed(const RoundClosedEvent& event) {}

  // A member made no call for the lease TTL and was removed from its job.
  virtual void LeaseExpired(absl::string_view job_id,
                            absl::string_view member_name) {}

  // A member's Sync for `round` arrived after that round had closed (a
  // straggler): it adopts the latest result and its parameters are not
  // counted.
  virtual void LateContribution(absl::string_view job_id, RoundId round) {}
  // The local steps such a late Sync's delta held (thrown away; only when
  // it said them).
  virtual void LateSteps(absl::string_view job_id, uint64_t steps) {}
  // A contribution refused mid-stream (a non-finite value under the drop
  // policy, or a delta that would overflow the state).
  virtual void ContributionRejected(absl::string_view job_id) {}
  // Job `job_id` was removed: `reason` "idle" (no members for the job idle
  // TTL).
  virtual void JobRemoved(absl::string_view job_id, absl::string_view reason) {}
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_OBSERVER_H_
