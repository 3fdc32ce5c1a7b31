#include "src/averaging.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/codec.h"

namespace localsgd {

std::vector<float> MeanRule::NextState(RoundAccumulator sums,
                                       absl::Span<const float> previous) {
  const ChunkGeometry& geometry = sums.geometry();
  for (uint32_t c = 0; c < geometry.num_chunks(); ++c) {
    const absl::Span<float> chunk = sums.scaled_sums(c);
    if (sums.chunk_weight(c) > 0) {
      DivideInPlace(chunk, sums.scaled_weight(c));
    } else {
      const auto from = previous.subspan(geometry.Offset(c), chunk.size());
      std::copy(from.begin(), from.end(), chunk.begin());
    }
  }
  return sums.TakeBuffer();
}

absl::StatusOr<std::unique_ptr<AveragingRule>> MakeAveragingRule(
    AveragingMode mode) {
  switch (mode) {
    case AveragingMode::kMean:
      return std::make_unique<MeanRule>();
    case AveragingMode::kUnspecified:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "averaging mode ", static_cast<int>(mode), " has no averaging rule"));
}

}  // namespace localsgd
