// Step budgets' arithmetic (src/work.h): medians, a member's history, the
// budget formula and its bounds, and the weight of a contribution by its
// steps; each against numbers worked out by hand.
#include "src/work.h"

#include <cstdint>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "src/types.h"

namespace localsgd {
namespace {

TEST(WorkTest, Median_OddEvenAndEmpty) {
  EXPECT_EQ(Median({}), 0.0);
  EXPECT_EQ(Median({3.0}), 3.0);
  EXPECT_EQ(Median({5.0, 1.0, 3.0}), 3.0);
  EXPECT_EQ(Median({4.0, 1.0, 3.0, 10.0}), 3.5);
}

TEST(WorkTest, History_KeepsTheLastFiveAndIgnoresEmptyWork) {
  WorkHistory h;
  EXPECT_FALSE(h.known());
  h.Add(0, absl::Seconds(1), absl::ZeroDuration());
  h.Add(10, absl::ZeroDuration(), absl::ZeroDuration());
  EXPECT_FALSE(h.known()) << "no steps, or no time: nothing learned";
  for (int i = 1; i <= 7; ++i) {
    // Rates 10, 20, ..., 70 per second; uploads i * 100 ms.
    h.Add(10 * i, absl::Seconds(1), absl::Milliseconds(100 * i));
  }
  ASSERT_TRUE(h.known());
  // The last five: 30 .. 70, median 50; uploads 300 .. 700 ms.
  EXPECT_DOUBLE_EQ(h.steps_per_second(), 50.0);
  EXPECT_EQ(h.upload(), absl::Milliseconds(500));
}

TEST(WorkTest, Bounds_DefaultToAQuarterAndFourTimesK) {
  JobSettings s;
  s.local_sgd_steps = 16;
  StepBounds b = BudgetBounds(s);
  EXPECT_EQ(b.min, 4u);
  EXPECT_EQ(b.max, 64u);
  s.local_sgd_steps = 2;
  b = BudgetBounds(s);
  EXPECT_EQ(b.min, 1u);
  EXPECT_EQ(b.max, 8u);
  s.min_local_steps = 3;
  s.max_local_steps = 5;
  b = BudgetBounds(s);
  EXPECT_EQ(b.min, 3u);
  EXPECT_EQ(b.max, 5u);
}

TEST(WorkTest, Budget_MedianMakesKSlowerFewerSlowLinkFewer) {
  const StepBounds bounds{1, 1000};
  const absl::Duration none = absl::ZeroDuration();
  // Median 10 steps/s, K = 16: a 1.6 s window.
  EXPECT_EQ(StepBudgetFor(10, none, 10, none, 16, bounds), 16u);
  EXPECT_EQ(StepBudgetFor(10.0 / 3, none, 10, none, 16, bounds), 5u);
  EXPECT_EQ(StepBudgetFor(20, none, 10, none, 16, bounds), 32u);
  // An upload 0.4 s slower than the median's: 1.2 s of compute.
  EXPECT_EQ(StepBudgetFor(10, absl::Milliseconds(500), 10,
                          absl::Milliseconds(100), 16, bounds),
            12u);
  // Nothing known: K; beyond the bounds: the bound.
  EXPECT_EQ(StepBudgetFor(0, none, 10, none, 16, bounds), 16u);
  EXPECT_EQ(StepBudgetFor(10, none, 0, none, 16, bounds), 16u);
  EXPECT_EQ(StepBudgetFor(1000, none, 10, none, 16, StepBounds{4, 64}), 64u);
  EXPECT_EQ(StepBudgetFor(0.01, none, 10, none, 16, StepBounds{4, 64}), 4u);
  // A link so slow that no compute time is left: the lower bound.
  EXPECT_EQ(
      StepBudgetFor(10, absl::Seconds(5), 10, none, 16, StepBounds{2, 64}), 2u);
}

// Handed its result later than the others: fewer steps, so that it arrives
// with them; at least the bounds' min.
TEST(WorkTest, Budget_HandedBehind_FewerSteps) {
  const StepBounds bounds{4, 64};
  const absl::Duration none = absl::ZeroDuration();
  EXPECT_EQ(
      StepBudgetFor(10, none, 10, none, 16, bounds, absl::Milliseconds(500)),
      11u);
  EXPECT_EQ(StepBudgetFor(10, none, 10, none, 16, bounds, absl::Seconds(1.4)),
            4u);
  EXPECT_EQ(StepBudgetFor(10, none, 10, none, 16, bounds, absl::Seconds(30)),
            4u);
}

// A fixed budget's phase correction: K less the steps made meanwhile, at
// least 1; K with nothing to correct or no rate.
TEST(WorkTest, PhaseBudget_KLessTheStepsBehind) {
  EXPECT_EQ(PhaseBudgetFor(50, 16, absl::Milliseconds(100)), 11u);
  EXPECT_EQ(PhaseBudgetFor(50, 16, absl::Milliseconds(5)), 16u);
  EXPECT_EQ(PhaseBudgetFor(50, 16, absl::Seconds(10)), 1u);
  EXPECT_EQ(PhaseBudgetFor(0, 16, absl::Milliseconds(100)), 16u);
  EXPECT_EQ(PhaseBudgetFor(50, 16, absl::ZeroDuration()), 16u);
}

TEST(WorkTest, StepWeight_StepsOverKOnlyWithAdaptiveBudgets) {
  JobSettings s;
  s.local_sgd_steps = 16;
  s.step_budget = StepBudget::kFixed;
  EXPECT_EQ(StepWeight(8, s), 1.0);
  s.step_budget = StepBudget::kAdaptive;
  EXPECT_EQ(StepWeight(16, s), 1.0) << "equal steps: the plain mean";
  EXPECT_EQ(StepWeight(8, s), 0.5);
  EXPECT_EQ(StepWeight(0, s), 0.0);
  EXPECT_EQ(StepWeight(-1, s), 1.0) << "not said";
  EXPECT_EQ(StepWeight(int64_t{kMaxLocalSteps}, s), 4.0) << "capped at 4 K";
  s.local_sgd_steps = 0;
  EXPECT_EQ(StepWeight(8, s), 1.0) << "no K: no weighing";
}

}  // namespace
}  // namespace localsgd
