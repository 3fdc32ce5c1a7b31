// Averaging rules: how a closed round's contributions and the state before
// it become the next global state. One implementation per rule; the job's
// settings name it.
//
// Parameter jobs (Contribution::kParameters) average parameters: the new
// state is their weighted mean (MeanOfParameters). Pseudo-gradient jobs
// average deltas (theta_local - anchor): a rule turns each chunk's weighted
// mean delta into the step the state takes; the job then encodes the step
// for the wire (with error feedback) and adds what the encoding decodes to,
// so that the coordinator and every member apply the same values.
//
// A rule is stateless: state it keeps across rounds (an outer optimizer's
// momentum) lives with the job's state (StateSnapshot::momentum), is read
// from the previous round's and written to the next round's buffer, and is
// checkpointed with it.
//
// Pure math over spans: no locks, no I/O, no protobuf. Thread-compatible.
#ifndef LOCALSGD_SRC_AVERAGING_H_
#define LOCALSGD_SRC_AVERAGING_H_

#include <cmath>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/round.h"
#include "src/types.h"

namespace localsgd {

// The state after a round of a parameter job: every chunk becomes sum_i w_i
// v_i / sum_i w_i over the members that contributed it (accelerate's
// LocalSGD), or keeps `previous` if none did. Takes the accumulator's buffer
// and returns it holding the new state.
std::vector<float> MeanOfParameters(RoundAccumulator sums,
                                    absl::Span<const float> previous);

class AveragingRule {
 public:
  virtual ~AveragingRule() = default;

  // The rule's name, as status shows it ("mean").
  virtual absl::string_view name() const = 0;

  // Whether the rule keeps a momentum buffer (one float per element).
  virtual bool has_momentum() const { return false; }

  // Whether the step is the mean itself (Step changes nothing).
  virtual bool steps_by_mean() const { return false; }

  // One chunk of a closed round: `mean` holds the weighted mean of the
  // round's pseudo-gradients on entry and the step the state takes on
  // return (new state = old state + step, before the wire's rounding).
  // With has_momentum(): `momentum_in` is the chunk's momentum after the
  // previous round (zeros before the first), `momentum_out` receives it
  // after this one (it may be `momentum_in`: updated in place); both empty
  // otherwise. All spans have one length.
  virtual void Step(absl::Span<float> mean, absl::Span<const float> momentum_in,
                    absl::Span<float> momentum_out) const = 0;

  // Bounds for the finite-state guard (StateCommit::CheckHeadroom): where
  // |mean| <= mean_bound and |momentum_in| <= momentum_bound element by
  // element, |step| <= StepBound and |momentum_out| <= MomentumBound, in
  // exact arithmetic (the guard leaves a margin for rounding).
  virtual double StepBound(double mean_bound, double momentum_bound) const = 0;
  virtual double MomentumBound(double mean_bound, double momentum_bound) const {
    return 0;
  }
};

// MEAN: the step is the mean delta (accelerate's result when every member
// started from the anchor).
class MeanRule final : public AveragingRule {
 public:
  absl::string_view name() const override { return "mean"; }
  bool steps_by_mean() const override { return true; }
  void Step(absl::Span<float> mean, absl::Span<const float> momentum_in,
            absl::Span<float> momentum_out) const override;
  double StepBound(double mean_bound, double) const override {
    return mean_bound;
  }
};

// OUTER_SGD: torch.optim.SGD(lr) on the outer gradient g = -mean:
// step = -lr * g.
class OuterSgdRule final : public AveragingRule {
 public:
  explicit OuterSgdRule(float lr) : lr_(lr) {}
  absl::string_view name() const override { return "outer_sgd"; }
  void Step(absl::Span<float> mean, absl::Span<const float> momentum_in,
            absl::Span<float> momentum_out) const override;
  double StepBound(double mean_bound, double) const override {
    return std::fabs(static_cast<double>(lr_)) * mean_bound;
  }

 private:
  const float lr_;
};

// OUTER_NESTEROV (DiLoCo): torch.optim.SGD(lr, momentum=mu, nesterov=True,
// dampening=0, weight_decay=0) on g = -mean:
//   b = mu * b + g      (b = g on the first step: b starts at zero)
//   step = -lr * (g + mu * b)
class OuterNesterovRule final : public AveragingRule {
 public:
  OuterNesterovRule(float lr, float momentum) : lr_(lr), mu_(momentum) {}
  absl::string_view name() const override { return "outer_nesterov"; }
  bool has_momentum() const override { return true; }
  void Step(absl::Span<float> mean, absl::Span<const float> momentum_in,
            absl::Span<float> momentum_out) const override;
  // |b| <= mu |b_in| + |g|; |step| <= lr (|g| + mu |b|).
  double MomentumBound(double mean_bound,
                       double momentum_bound) const override {
    return std::fabs(static_cast<double>(mu_)) * momentum_bound + mean_bound;
  }
  double StepBound(double mean_bound, double momentum_bound) const override {
    return std::fabs(static_cast<double>(lr_)) *
           (mean_bound + std::fabs(static_cast<double>(mu_)) *
                             MomentumBound(mean_bound, momentum_bound));
  }

 private:
  const float lr_;
  const float mu_;
};

// The rule of `settings` (mode, outer_lr, outer_momentum; complete
// settings). INVALID_ARGUMENT for a mode without one.
absl::StatusOr<std::unique_ptr<AveragingRule>> MakeAveragingRule(
    const JobSettings& settings);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_AVERAGING_H_
