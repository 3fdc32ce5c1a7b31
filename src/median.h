// The median of a few doubles: the outlier guard's center of recent norms,
// the step budgets' median rate and upload (src/work.h).
#ifndef LOCALSGD_SRC_MEDIAN_H_
#define LOCALSGD_SRC_MEDIAN_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace localsgd {

// The median of `values` (the mean of the middle two for an even count);
// 0 for none.
inline double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  const double lower = *std::max_element(values.begin(), values.begin() + mid);
  return lower + (upper - lower) / 2;
}

}  // namespace localsgd

#endif  // LOCALSGD_SRC_MEDIAN_H_
