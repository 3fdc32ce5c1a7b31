#include "src/work.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace localsgd {

void WorkHistory::Add(uint64_t steps, absl::Duration compute,
                      absl::Duration upload) {
  if (steps == 0 || compute <= absl::ZeroDuration()) return;
  const double rate =
      static_cast<double>(steps) / absl::ToDoubleSeconds(compute);
  const double up = std::max(0.0, absl::ToDoubleSeconds(upload));
  if (rates_.size() < kMaxSamples) {
    rates_.push_back(rate);
    uploads_.push_back(up);
  } else {
    rates_[next_] = rate;
    uploads_[next_] = up;
  }
  next_ = (next_ + 1) % kMaxSamples;
}

double WorkHistory::steps_per_second() const { return Median(rates_); }

absl::Duration WorkHistory::upload() const {
  return absl::Seconds(Median(uploads_));
}

StepBounds BudgetBounds(const JobSettings& settings) {
  const uint32_t k = std::max<uint32_t>(settings.local_sgd_steps, 1);
  StepBounds b;
  b.min = settings.min_local_steps != 0 ? settings.min_local_steps
                                        : std::max<uint32_t>(1, k / 4);
  b.max = settings.max_local_steps != 0
              ? settings.max_local_steps
              : static_cast<uint32_t>(
                    std::min<uint64_t>(uint64_t{4} * k, kMaxLocalSteps));
  b.min = std::max<uint32_t>(b.min, 1);
  b.max = std::max(b.max, b.min);
  return b;
}

uint32_t StepBudgetFor(double rate, absl::Duration upload, double median_rate,
                       absl::Duration median_upload, uint32_t k,
                       StepBounds bounds, absl::Duration behind) {
  if (!(rate > 0) || !(median_rate > 0)) {
    return std::clamp(k, bounds.min, bounds.max);
  }
  const double window = k / median_rate + absl::ToDoubleSeconds(median_upload) -
                        absl::ToDoubleSeconds(upload) -
                        absl::ToDoubleSeconds(behind);
  const double steps = std::round(rate * std::max(0.0, window));
  if (!(steps >= bounds.min)) return bounds.min;
  if (steps >= bounds.max) return bounds.max;
  return static_cast<uint32_t>(steps);
}

uint32_t PhaseBudgetFor(double rate, uint32_t k, absl::Duration behind) {
  if (!(rate > 0) || behind <= absl::ZeroDuration() || k == 0) return k;
  const double made = std::round(rate * absl::ToDoubleSeconds(behind));
  if (!(made < k)) return 1;
  return std::max<uint32_t>(1, k - static_cast<uint32_t>(made));
}

double StepWeight(int64_t steps, const JobSettings& settings) {
  if (settings.step_budget != StepBudget::kAdaptive ||
      settings.local_sgd_steps == 0 || steps < 0) {
    return 1.0;
  }
  const uint64_t capped = std::min<uint64_t>(static_cast<uint64_t>(steps),
                                             BudgetBounds(settings).max);
  return static_cast<double>(capped) / settings.local_sgd_steps;
}

}  // namespace localsgd
