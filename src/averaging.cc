#include "src/averaging.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "src/codec.h"

namespace localsgd {

std::vector<float> MeanOfParameters(RoundAccumulator sums,
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

void MeanRule::Step(absl::Span<float>, absl::Span<const float>,
                    absl::Span<float>) const {}

void OuterSgdRule::Step(absl::Span<float> mean, absl::Span<const float>,
                        absl::Span<float>) const {
  // torch: p.add_(g, alpha=-lr) with g = -mean; the step is -lr * g, and
  // negating is exact.
  const float neg_lr = -lr_;
  for (float& v : mean) v = neg_lr * -v;
}

void OuterNesterovRule::Step(absl::Span<float> mean,
                             absl::Span<const float> momentum_in,
                             absl::Span<float> momentum_out) const {
  DCHECK_EQ(momentum_in.size(), mean.size());
  DCHECK_EQ(momentum_out.size(), mean.size());
  const float neg_lr = -lr_;
  const float mu = mu_;
  // Raw pointers: a Span's hardened operator[] keeps the loop scalar.
  float* m = mean.data();
  const float* in = momentum_in.data();
  float* out = momentum_out.data();
  for (size_t i = 0; i < mean.size(); ++i) {
    const float g = -m[i];
    // torch: buf.mul_(mu).add_(g); g = g.add(buf, alpha=mu);
    // p.add_(g, alpha=-lr).
    const float b = in[i] * mu + g;
    out[i] = b;
    m[i] = neg_lr * (g + mu * b);
  }
}

absl::StatusOr<std::unique_ptr<AveragingRule>> MakeAveragingRule(
    const JobSettings& settings) {
  switch (settings.mode) {
    case AveragingMode::kMean:
      return std::make_unique<MeanRule>();
    case AveragingMode::kOuterSgd:
      return std::make_unique<OuterSgdRule>(settings.outer_lr);
    case AveragingMode::kOuterNesterov:
      return std::make_unique<OuterNesterovRule>(settings.outer_lr,
                                                 settings.outer_momentum);
    case AveragingMode::kUnspecified:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("averaging mode ", static_cast<int>(settings.mode),
                   " has no averaging rule"));
}

}  // namespace localsgd
