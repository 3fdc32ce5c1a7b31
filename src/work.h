// What the coordinator learns of its members' work, for step budgets
// (JobSettings::step_budget, StepBudget::kAdaptive): each member's step
// rate and upload time from its recent contributions, and from them the
// local steps each is to make so that contributions arrive together.
//
// Pure: no clock, no locks, no I/O; Job keeps one WorkHistory per member
// (MemberInfo::work) under its mutex.
#ifndef LOCALSGD_SRC_WORK_H_
#define LOCALSGD_SRC_WORK_H_

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "src/median.h"
#include "src/types.h"

namespace localsgd {

// One member's recent contributions: steps per second and upload time.
class WorkHistory {
 public:
  // Samples kept (the most recent).
  static constexpr size_t kMaxSamples = 5;

  // A contribution of `steps` local steps, made in `compute` (from the
  // member's previous result to this Sync's start) and uploaded in
  // `upload` (from that start to its last chunk). Ignored unless steps > 0
  // and compute > 0.
  void Add(uint64_t steps, absl::Duration compute, absl::Duration upload);
  bool known() const { return !rates_.empty(); }
  // Medians of the samples kept; 0 without any.
  double steps_per_second() const;
  absl::Duration upload() const;

 private:
  std::vector<double> rates_;    // a ring of kMaxSamples
  std::vector<double> uploads_;  // seconds, same ring
  size_t next_ = 0;
};

// The bounds of an adaptive budget: the settings', or max(1, K / 4) and
// 4 K for 0; `min` raised to 1 and `max` to `min`.
struct StepBounds {
  uint32_t min = 1;
  uint32_t max = 1;
};
StepBounds BudgetBounds(const JobSettings& settings);

// The local steps a member of rate `rate` (steps/s) and upload time
// `upload` makes so that its contribution arrives with one of median rate
// `median_rate` making K steps and uploading in `median_upload`, handed its
// result `behind` later than that one (a member that adopted late, or whose
// stale contribution was banked): round(rate * (K / median_rate +
// median_upload - upload - behind)), within `bounds`. K when either rate
// is not positive.
uint32_t StepBudgetFor(double rate, absl::Duration upload, double median_rate,
                       absl::Duration median_upload, uint32_t k,
                       StepBounds bounds,
                       absl::Duration behind = absl::ZeroDuration());

// A fixed budget's phase correction: a member of rate `rate` handed its
// result `behind` later than the others makes K less the steps it would
// have made meanwhile, at least 1, so that its next contribution arrives
// with theirs; K when either is not positive (or it would be K).
uint32_t PhaseBudgetFor(double rate, uint32_t k, absl::Duration behind);

// The factor a contribution of `steps` local steps (-1: not said) weighs
// in a job with adaptive budgets: steps / K, the steps capped at the
// bounds' max (a member cannot outweigh the others by what it says); 1
// without adaptive budgets, without K, or when the steps are not said.
double StepWeight(int64_t steps, const JobSettings& settings);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_WORK_H_
