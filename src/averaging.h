// Averaging rules: how a closed round's accumulated contributions and the
// previous global state become the next global state. One implementation per
// rule (the job's settings name it); a rule that keeps state of its own
// across rounds (an outer optimizer's momentum) holds it in its instance,
// one per job.
//
// Pure math over spans: no locks, no I/O, no protobuf. Not thread-safe: the
// job calls its rule under its lock.
#ifndef LOCALSGD_SRC_AVERAGING_H_
#define LOCALSGD_SRC_AVERAGING_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/round.h"
#include "src/types.h"

namespace localsgd {

class AveragingRule {
 public:
  virtual ~AveragingRule() = default;

  // The rule's name, as status shows it ("mean").
  virtual absl::string_view name() const = 0;

  // The state after a round: from the round's sums and the state before it
  // (`previous`, the accumulator's geometry). Takes the accumulator's buffer
  // and returns it holding the new state. A chunk no one contributed to
  // keeps its previous values.
  virtual std::vector<float> NextState(RoundAccumulator sums,
                                       absl::Span<const float> previous) = 0;
};

// The weighted mean of the contributions (accelerate's LocalSGD): every
// chunk becomes sum_i w_i v_i / sum_i w_i over the members that contributed
// it.
class MeanRule final : public AveragingRule {
 public:
  absl::string_view name() const override { return "mean"; }
  std::vector<float> NextState(RoundAccumulator sums,
                               absl::Span<const float> previous) override;
};

// The rule for `mode`. INVALID_ARGUMENT for a mode without one.
absl::StatusOr<std::unique_ptr<AveragingRule>> MakeAveragingRule(
    AveragingMode mode);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_AVERAGING_H_
