// StateCommit (src/state_commit.h) on its own: the parameter mean, the
// pseudo-gradient step chunk by chunk (rule, momentum, wire encoding with
// error feedback), states' ids and the recycling of their buffers. Values
// are chosen so that every result has an exact closed form.
#include "src/state_commit.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/codec.h"

namespace localsgd {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

const ChunkGeometry kGeometry(6, 4);  // chunks of 4 and 2 elements

JobSettings Settings(Contribution contribution, DType wire,
                     AveragingMode mode = AveragingMode::kMean, float lr = 0,
                     float mu = 0) {
  JobSettings s;
  s.chunk_elements = 4;
  s.contribution = contribution;
  s.wire_dtype = wire;
  s.mode = mode;
  s.outer_lr = lr;
  s.outer_momentum = mu;
  return s;
}

// Sums of one round: members with `weights` each send `values[i]` for
// every element of chunk 0 (chunk 1: no one).
RoundAccumulator SumsOf(const std::vector<float>& weights,
                        const std::vector<float>& values,
                        std::vector<float> buffer = {}) {
  RoundAccumulator sums(std::move(buffer), kGeometry);
  double total = 0;
  for (float w : weights) total += w;
  sums.FitScale(total);
  for (size_t i = 0; i < weights.size(); ++i) {
    std::string wire;
    EncodeValues(std::vector<float>(4, values[i]), DType::kFloat32, &wire);
    const absl::string_view piece(wire);
    sums.Add(0, absl::MakeConstSpan(&piece, 1), DType::kFloat32, weights[i]);
  }
  return sums;
}

std::vector<float> DeltaOf(const StateSnapshot& next, uint32_t c, DType wire) {
  std::vector<float> out(kGeometry.Size(c));
  const size_t at = WireBytes(wire, kGeometry.chunk_elements()) * c;
  const absl::string_view bytes(next.delta.data() + at,
                                WireBytes(wire, out.size()));
  EXPECT_TRUE(DecodeValues(bytes, wire, absl::MakeSpan(out)).ok());
  return out;
}

TEST(StateCommitTest, NoStateUntilRestoredOrCommitted) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  EXPECT_EQ(commit.state(), nullptr);
  commit.Restore(4, std::vector<float>(6, 1.0f), /*id=*/0, {}, {});
  ASSERT_NE(commit.state(), nullptr);
  EXPECT_EQ(commit.state()->round, 4u);
  EXPECT_NE(commit.state()->id, 0u);  // a new one
  commit.Restore(5, std::vector<float>(6, 1.0f), /*id=*/77, {}, {});
  EXPECT_EQ(commit.state()->id, 77u);
}

// Weights 1 and 3 sending 2 and 6: the mean is (2 + 18) / 4 = 5; chunk 1
// keeps the previous values.
TEST(StateCommitTest, Mean_IsTheWeightedMeanAndKeepsChunksNoOneGave) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  commit.Restore(1, std::vector<float>(6, -1.0f), 0, {}, {});
  std::shared_ptr<StateSnapshot> next = commit.Mean(SumsOf({1, 3}, {2, 6}));
  EXPECT_THAT(next->values, ElementsAre(5, 5, 5, 5, -1, -1));
  EXPECT_TRUE(next->delta.empty());
  EXPECT_EQ(next->previous_id, 0u);
}

// bfloat16 keeps 8 significant bits: 1 + 2^-10 rounds to 1.
TEST(StateCommitTest, Mean_IsRoundedAsTheWireCarriesIt) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kBFloat16),
                     kGeometry);
  commit.Restore(1, std::vector<float>(6, 0.0f), 0, {}, {});
  const float v = 1.0f + std::ldexp(1.0f, -10);
  std::shared_ptr<StateSnapshot> next = commit.Mean(SumsOf({1}, {v}));
  EXPECT_THAT(next->values, ElementsAre(1, 1, 1, 1, 0, 0));
}

TEST(StateCommitTest, NewNext_HasTheBuffersTheRuleAndWireNeed) {
  for (DType wire : {DType::kFloat32, DType::kBFloat16}) {
    for (AveragingMode mode :
         {AveragingMode::kMean, AveragingMode::kOuterNesterov}) {
      StateCommit commit(
          Settings(Contribution::kPseudoGradients, wire, mode, 0.5f, 0.5f),
          kGeometry);
      commit.Restore(2, std::vector<float>(6, 0.0f), 41, {}, {});
      std::shared_ptr<StateSnapshot> next = commit.NewNext();
      EXPECT_EQ(next->previous_id, 41u);
      EXPECT_EQ(next->delta.size(), WireBytes(wire, 4) + WireBytes(wire, 2));
      EXPECT_EQ(next->momentum.size(),
                mode == AveragingMode::kOuterNesterov ? 6u : 0u);
      EXPECT_EQ(next->residual.size(), wire == DType::kFloat32 ? 0u : 6u);
      EXPECT_TRUE(next->values.empty());
    }
  }
}

// MEAN over float32: the step is the mean delta (1 * 2 + 3 * 6) / 4 = 5;
// the new values are the old ones plus it; chunk 1 (no one) keeps its
// values and has a zero delta.
TEST(StateCommitTest, FinishNext_Mean_AddsTheMeanDelta) {
  StateCommit commit(Settings(Contribution::kPseudoGradients, DType::kFloat32),
                     kGeometry);
  commit.Restore(2, {1, 2, 3, 4, 5, 6}, 9, {}, {});
  std::shared_ptr<StateSnapshot> next = commit.NewNext();
  next = commit.FinishNext(SumsOf({1, 3}, {2, 6}), {0, 1}, std::move(next));
  EXPECT_THAT(next->values, ElementsAre(6, 7, 8, 9, 5, 6));
  EXPECT_THAT(DeltaOf(*next, 0, DType::kFloat32), Each(5.0f));
  EXPECT_THAT(DeltaOf(*next, 1, DType::kFloat32), Each(0.0f));
}

// OUTER_NESTEROV, first step (momentum zeros): g = -mean, b = g, step =
// -lr (g + mu b) = lr (1 + mu) mean; with lr = 0.5, mu = 0.5, mean = 4:
// step 3, momentum -4. Chunk 1 keeps the old momentum.
TEST(StateCommitTest, FinalizeChunk_OuterNesterov_StepsAndCarriesMomentum) {
  StateCommit commit(Settings(Contribution::kPseudoGradients, DType::kFloat32,
                              AveragingMode::kOuterNesterov, 0.5f, 0.5f),
                     kGeometry);
  commit.Restore(2, std::vector<float>(6, 10.0f), 9, /*momentum=*/{},
                 /*residual=*/{});
  std::shared_ptr<StateSnapshot> next = commit.NewNext();
  RoundAccumulator sums = SumsOf({2}, {4});
  commit.FinalizeChunk(sums, 0, *next);
  EXPECT_THAT(sums.scaled_sums(0), Each(13.0f));  // the new values
  EXPECT_THAT(DeltaOf(*next, 0, DType::kFloat32), Each(3.0f));
  EXPECT_THAT(absl::MakeConstSpan(next->momentum).subspan(0, 4), Each(-4.0f));
  // A second round from that state: b = mu b + g = -2 - 4 = -6, step =
  // -lr (g + mu b) = 0.5 (4 + 3) = 3.5.
  commit.FinalizeChunk(sums, 1, *next);
  next->values = sums.TakeBuffer();
  commit.Commit(std::move(next), 3);
  std::shared_ptr<StateSnapshot> second = commit.NewNext();
  RoundAccumulator more = SumsOf({1}, {4});
  commit.FinalizeChunk(more, 0, *second);
  commit.FinalizeChunk(more, 1, *second);
  EXPECT_THAT(DeltaOf(*second, 0, DType::kFloat32), Each(3.5f));
  EXPECT_THAT(absl::MakeConstSpan(second->momentum).subspan(0, 4), Each(-6.0f));
  EXPECT_THAT(absl::MakeConstSpan(second->momentum).subspan(4, 2),
              Each(0.0f));  // chunk 1: never stepped
}

// bfloat16 with error feedback: a step of 1 + 2^-10 goes out as 1 and
// leaves 2^-10 behind; the next round adds it back: 1 + 2^-10 + 2^-10 =
// 1 + 2^-9 is still sent as 1, leaving 2^-9; the values take what was sent.
TEST(StateCommitTest, FinalizeChunk_LossyWire_KeepsTheResidual) {
  StateCommit commit(Settings(Contribution::kPseudoGradients, DType::kBFloat16),
                     kGeometry);
  commit.Restore(2, std::vector<float>(6, 0.0f), 9, {}, {});
  const float step = 1.0f + std::ldexp(1.0f, -10);
  for (int round = 1; round <= 2; ++round) {
    std::shared_ptr<StateSnapshot> next = commit.NewNext();
    next = commit.FinishNext(SumsOf({1}, {step}), {0, 1}, std::move(next));
    EXPECT_THAT(DeltaOf(*next, 0, DType::kBFloat16), Each(1.0f));
    EXPECT_THAT(absl::MakeConstSpan(next->values).subspan(0, 4),
                Each(static_cast<float>(round)));
    EXPECT_THAT(absl::MakeConstSpan(next->residual).subspan(0, 4),
                Each(std::ldexp(1.0f, -10) * round));
    EXPECT_THAT(absl::MakeConstSpan(next->residual).subspan(4, 2), Each(0.0f));
    commit.Commit(std::move(next), 2 + round);
  }
}

TEST(StateCommitTest, Commit_NamesTheStateAndMakesItCurrent) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  auto state = std::make_shared<StateSnapshot>();
  state->values.assign(6, 1.0f);
  std::shared_ptr<const StateSnapshot> committed =
      commit.Commit(std::move(state), 7);
  EXPECT_EQ(committed.get(), commit.state());
  EXPECT_EQ(committed->round, 7u);
  EXPECT_NE(committed->id, 0u);
  auto named = std::make_shared<StateSnapshot>();
  named->id = 5;
  EXPECT_EQ(commit.Commit(std::move(named), 8)->id, 5u);
}

TEST(StateCommitTest, Commit_RecyclesTheOldBuffersOnlyWhenNoOneReadsThem) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  commit.Restore(1, std::vector<float>(6, 1.0f), 0, {}, {});
  const float* first = commit.state()->values.data();
  {
    // Someone still reads the state: its memory is not taken.
    std::shared_ptr<const StateSnapshot> reader = commit.shared_state();
    auto state = std::make_shared<StateSnapshot>();
    state->values.assign(6, 2.0f);
    commit.Commit(std::move(state), 2);
    EXPECT_NE(commit.TakeBuffer().data(), first);
    EXPECT_THAT(reader->values, Each(1.0f));
  }
  const float* second = commit.state()->values.data();
  auto state = std::make_shared<StateSnapshot>();
  state->values.assign(6, 3.0f);
  commit.Commit(std::move(state), 3);
  std::vector<float> buffer = commit.TakeBuffer();
  EXPECT_EQ(buffer.data(), second);
  EXPECT_EQ(buffer.size(), 6u);
  // A buffer handed back is the next one taken, unless one is spare.
  commit.GiveBack(std::move(buffer));
  EXPECT_EQ(commit.TakeBuffer().data(), second);
}

// A state still read when it is replaced (a member's result, the released
// state) is recycled once its last reader lets go, not left to be freed:
// the next buffer taken is its own.
TEST(StateCommitTest, Commit_RecyclesAStateOnceItsReadersLetGo) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  commit.Restore(1, std::vector<float>(6, 1.0f), 0, {}, {});
  std::shared_ptr<const StateSnapshot> reader = commit.shared_state();
  const float* first = reader->values.data();
  auto state = std::make_shared<StateSnapshot>();
  state->values.assign(6, 2.0f);
  commit.Commit(std::move(state), 2);
  std::vector<float> taken = commit.TakeBuffer();  // read still: a new one
  EXPECT_NE(taken.data(), first);
  EXPECT_THAT(reader->values, Each(1.0f));
  reader.reset();
  EXPECT_EQ(commit.TakeBuffer().data(), first);
}

// Small updates in a block of large ones, both ends' error feedback (the
// members' encoder as MemberState::EncodeDelta runs it, the coordinator's
// here): a value of ratio x to its block's largest (q = 127 int8, 7 int4)
// does not move at all for about 1/(2 x q) rounds, until its residual
// reaches half a code step; after that its movement is never more than
// 1/((2q - 1) x) rounds of its own update behind the intended one (half a
// step of the member's residual, the step at most max / (q - 1/2); the
// members agree, so the mean is on their grid and the coordinator's
// residual holds nothing). Bounded with a round of slack for fp32 rounding.
// bench/small_updates measures the same over N(0, 1) weights.
TEST(StateCommitTest, SmallUpdates_LagByTheirRatioInTheBlock) {
  const ChunkGeometry geometry(4 * kQuantBlock, 2 * kQuantBlock);
  constexpr int kMembers = 2;
  for (DType wire : {DType::kInt8Block, DType::kInt4Block}) {
    SCOPED_TRACE(DTypeName(wire));
    const int q = wire == DType::kInt8Block ? 127 : 7;
    JobSettings settings = Settings(Contribution::kPseudoGradients, wire);
    settings.chunk_elements = geometry.chunk_elements();
    StateCommit commit(settings, geometry);
    // Block b: its largest at element 7b, the others at ratios 2^(-11 k /
    // 63) (1 down to 1/2048), magnitudes 2^b, alternating signs; each
    // round every member adds 1e-3 theta0.
    const size_t n = geometry.num_elements();
    std::vector<double> x(n);
    std::vector<float> theta0(n), u(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t b = i / kQuantBlock;
      const size_t k = (i % kQuantBlock + kQuantBlock - 7 * b) % kQuantBlock;
      x[i] = std::exp2(-11.0 * static_cast<double>(k) / (kQuantBlock - 1));
      theta0[i] = static_cast<float>((i % 2 ? -1 : 1) * std::ldexp(x[i], b));
      u[i] = 1e-3f * theta0[i];
    }
    commit.Restore(0, theta0, 0, {}, {});
    std::vector<float> anchor = theta0;
    std::vector<std::vector<float>> residual(kMembers,
                                             std::vector<float>(n, 0.0f));
    const int rounds = static_cast<int>(2048.0 / (2 * q - 1)) * 2 + 4;
    for (int r = 1; r <= rounds; ++r) {
      RoundAccumulator sums(commit.TakeBuffer(), geometry);
      sums.FitScale(kMembers);
      std::shared_ptr<StateSnapshot> next = commit.NewNext();
      for (int m = 0; m < kMembers; ++m) {
        for (uint32_t c = 0; c < geometry.num_chunks(); ++c) {
          // The member's delta: (anchor + u) - anchor, in fp32.
          std::vector<float> delta(geometry.Size(c)), decoded(delta.size());
          for (size_t k = 0; k < delta.size(); ++k) {
            const size_t i = geometry.Offset(c) + k;
            delta[k] = (anchor[i] + u[i]) - anchor[i];
          }
          std::string bytes(WireBytes(wire, delta.size()), '\0');
          EncodeWithFeedback(delta,
                             absl::MakeSpan(residual[m])
                                 .subspan(geometry.Offset(c), delta.size()),
                             wire, bytes.data(), absl::MakeSpan(decoded));
          const absl::string_view piece(bytes);
          sums.Add(c, absl::MakeConstSpan(&piece, 1), wire, 1.0f);
        }
      }
      next = commit.FinishNext(std::move(sums), {0, 1}, std::move(next));
      // Every member applies the delta onto its anchor.
      for (uint32_t c = 0; c < geometry.num_chunks(); ++c) {
        const auto slice = absl::MakeSpan(anchor).subspan(geometry.Offset(c),
                                                          geometry.Size(c));
        ASSERT_TRUE(
            DecodeOnto(absl::string_view(
                           next->delta.data() +
                               WireBytes(wire, geometry.chunk_elements()) * c,
                           WireBytes(wire, geometry.Size(c))),
                       wire, slice, slice)
                .ok());
      }
      ASSERT_EQ(anchor, next->values) << "round " << r;
      commit.Commit(std::move(next), r);
      for (size_t i = 0; i < n; ++i) {
        const double step = std::fabs(static_cast<double>(u[i]));
        const double moved =
            (static_cast<double>(anchor[i]) - theta0[i]) * (u[i] > 0 ? 1 : -1);
        const double first_code = 1.0 / (2 * x[i] * q);
        if (r <= std::ceil(first_code) - 2) {
          ASSERT_EQ(moved, 0)
              << "element " << i << " (x " << x[i] << ") moved in round " << r;
        }
        const double bound = std::ceil(1.0 / ((2 * q - 1) * x[i])) + 1;
        ASSERT_GE(moved, (r - bound) * step)
            << "element " << i << " (x " << x[i] << ") after round " << r
            << ": " << r - moved / step << " rounds behind";
      }
    }
  }
}

// Mean encoding wire. Chunks of two blocks and one; one member of weight 1,
// so that the round's mean is its delta exactly; deltas of N(0, 1) scaled
// by 8^-b in block b.
const ChunkGeometry kBlocks(3 * kQuantBlock, 2 * kQuantBlock);

std::vector<float> DeltaOfRound(int round) {
  std::mt19937 gen(round);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> delta(kBlocks.num_elements());
  for (size_t i = 0; i < delta.size(); ++i) {
    delta[i] = std::ldexp(normal(gen), -3 * static_cast<int>(i / kQuantBlock));
  }
  return delta;
}

RoundAccumulator SumsOfOne(const std::vector<float>& delta,
                           std::vector<float> buffer) {
  RoundAccumulator sums(std::move(buffer), kBlocks);
  sums.FitScale(1);
  for (uint32_t c = 0; c < kBlocks.num_chunks(); ++c) {
    std::string wire;
    EncodeValues(
        absl::MakeConstSpan(delta).subspan(kBlocks.Offset(c), kBlocks.Size(c)),
        DType::kFloat32, &wire);
    const absl::string_view piece(wire);
    sums.Add(c, absl::MakeConstSpan(&piece, 1), DType::kFloat32, 1.0f);
  }
  return sums;
}

JobSettings WireMean(DType wire, AveragingMode mode) {
  JobSettings s =
      Settings(Contribution::kPseudoGradients, wire, mode, 0.7f, 0.9f);
  s.chunk_elements = kBlocks.chunk_elements();
  s.mean_encoding = MeanEncoding::kWire;
  return s;
}

absl::string_view DeltaBytes(const StateSnapshot& next, uint32_t c,
                             DType wire) {
  return absl::string_view(
      next.delta.data() + WireBytes(wire, kBlocks.chunk_elements()) * c,
      WireBytes(wire, kBlocks.Size(c)));
}

class EncodedMeanTest : public ::testing::TestWithParam<DType> {};

// OUTER_NESTEROV on the encoded mean, against the rule written out here:
// q = encode(mean + r_mean) (r_mean keeps what it lost), g = -decode(q),
// b = mu b + g, step = -lr (g + mu b), encoded with the step's residual;
// the values take what that decodes to. Six rounds, every buffer compared
// bit for bit.
TEST_P(EncodedMeanTest, OuterNesterov_StepsOnTheEncodedMean) {
  const DType wire = GetParam();
  StateCommit commit(WireMean(wire, AveragingMode::kOuterNesterov), kBlocks);
  ASSERT_TRUE(commit.encodes_mean());
  const size_t n = kBlocks.num_elements();
  std::vector<float> values(n, 1.0f), momentum(n, 0.0f), residual(n, 0.0f),
      mean_residual(n, 0.0f);
  commit.Restore(0, values, 5, {}, {});
  const float lr = 0.7f, mu = 0.9f;
  for (int round = 1; round <= 6; ++round) {
    SCOPED_TRACE(round);
    const std::vector<float> delta = DeltaOfRound(round);
    std::shared_ptr<StateSnapshot> next = commit.NewNext();
    ASSERT_EQ(next->mean_residual.size(), n);
    next = commit.FinishNext(SumsOfOne(delta, commit.TakeBuffer()), {0, 1},
                             std::move(next));
    for (uint32_t c = 0; c < kBlocks.num_chunks(); ++c) {
      const size_t at = kBlocks.Offset(c), len = kBlocks.Size(c);
      std::vector<float> mean(len);
      std::string encoded_mean(WireBytes(wire, len), '\0');
      EncodeWithFeedback(absl::MakeConstSpan(delta).subspan(at, len),
                         absl::MakeSpan(mean_residual).subspan(at, len), wire,
                         encoded_mean.data(), absl::MakeSpan(mean));
      std::vector<float> step(len), sent(len);
      for (size_t k = 0; k < len; ++k) {
        const float g = -mean[k];
        momentum[at + k] = momentum[at + k] * mu + g;
        step[k] = -lr * (g + mu * momentum[at + k]);
      }
      std::string encoded_step(WireBytes(wire, len), '\0');
      EncodeWithFeedback(step, absl::MakeSpan(residual).subspan(at, len), wire,
                         encoded_step.data(), absl::MakeSpan(sent));
      for (size_t k = 0; k < len; ++k) values[at + k] += sent[k];
      EXPECT_EQ(DeltaBytes(*next, c, wire), encoded_step) << "chunk " << c;
    }
    EXPECT_EQ(next->values, values);
    EXPECT_EQ(next->momentum, momentum);
    EXPECT_EQ(next->residual, residual);
    EXPECT_EQ(next->mean_residual, mean_residual);
    commit.Commit(std::move(next), round);
  }
}

// MEAN: the step is the encoded mean, so a job of mean encoding wire gets
// the same deltas and values as one of float32, its mean residual is the
// other's residual, and it keeps no second residual.
TEST_P(EncodedMeanTest, Mean_SameResultsAsFloat32) {
  const DType wire = GetParam();
  StateCommit encoded(WireMean(wire, AveragingMode::kMean), kBlocks);
  JobSettings float32_settings = WireMean(wire, AveragingMode::kMean);
  float32_settings.mean_encoding = MeanEncoding::kFloat32;
  StateCommit plain(float32_settings, kBlocks);
  ASSERT_FALSE(plain.encodes_mean());
  encoded.Restore(0, std::vector<float>(kBlocks.num_elements(), 1.0f), 5, {},
                  {});
  plain.Restore(0, std::vector<float>(kBlocks.num_elements(), 1.0f), 5, {}, {});
  for (int round = 1; round <= 6; ++round) {
    SCOPED_TRACE(round);
    const std::vector<float> delta = DeltaOfRound(round);
    std::shared_ptr<StateSnapshot> a = encoded.NewNext();
    std::shared_ptr<StateSnapshot> b = plain.NewNext();
    EXPECT_TRUE(a->residual.empty());
    a = encoded.FinishNext(SumsOfOne(delta, encoded.TakeBuffer()), {0, 1},
                           std::move(a));
    b = plain.FinishNext(SumsOfOne(delta, plain.TakeBuffer()), {0, 1},
                         std::move(b));
    EXPECT_EQ(a->delta, b->delta);
    EXPECT_EQ(a->values, b->values);
    EXPECT_EQ(a->mean_residual, b->residual);
    encoded.Commit(std::move(a), round);
    plain.Commit(std::move(b), round);
  }
}

// A standby given only the encoded means (DecodeMean) holds the primary's
// values, momentum, step residual and delta bit for bit; its mean residual
// is zeros (the primary's own). A chunk no one gave keeps everything.
TEST_P(EncodedMeanTest, AStandbyReproducesEverythingButTheMeanResidual) {
  const DType wire = GetParam();
  const JobSettings settings = WireMean(wire, AveragingMode::kOuterNesterov);
  StateCommit primary(settings, kBlocks), standby(settings, kBlocks);
  const std::vector<float> start(kBlocks.num_elements(), 1.0f);
  primary.Restore(0, start, 5, {}, {});
  standby.Restore(0, start, 5, {}, {});
  for (int round = 1; round <= 6; ++round) {
    SCOPED_TRACE(round);
    const std::vector<float> delta = DeltaOfRound(round);
    std::shared_ptr<StateSnapshot> p = primary.NewNext();
    std::shared_ptr<StateSnapshot> s = standby.NewNext();
    std::vector<float> p_values = primary.TakeBuffer();
    std::vector<float> s_values = standby.TakeBuffer();
    for (uint32_t c = 0; c < kBlocks.num_chunks(); ++c) {
      const size_t at = kBlocks.Offset(c), len = kBlocks.Size(c);
      // Round 3: no one gives chunk 1.
      const bool contributed = round != 3 || c != 1;
      const absl::Span<float> pc = absl::MakeSpan(p_values).subspan(at, len);
      const absl::Span<float> sc = absl::MakeSpan(s_values).subspan(at, len);
      std::copy_n(delta.begin() + at, len, pc.begin());
      std::string encoded_mean;
      if (contributed) {
        primary.EncodeMean(pc, c, *p, &encoded_mean);
        ASSERT_TRUE(standby.DecodeMean(encoded_mean, c, *s, sc, "chunk").ok());
      }
      ASSERT_TRUE(primary.FinalizeMean(pc, contributed, c, *p, encoded_mean));
      ASSERT_TRUE(standby.FinalizeMean(sc, contributed, c, *s, encoded_mean));
    }
    EXPECT_EQ(s_values, p_values);
    EXPECT_EQ(s->delta, p->delta);
    EXPECT_EQ(s->momentum, p->momentum);
    EXPECT_EQ(s->residual, p->residual);
    EXPECT_THAT(s->mean_residual, Each(0.0f));
    EXPECT_THAT(p->mean_residual, Not(Each(0.0f)));
    p->values = std::move(p_values);
    s->values = std::move(s_values);
    primary.Commit(std::move(p), round);
    standby.Commit(std::move(s), round);
  }
}

// What a standby refuses, changing nothing: the wrong size, a scale that is
// not finite, zero or negative, a bfloat16 infinity.
TEST_P(EncodedMeanTest, DecodeMean_RefusesAMalformedEncodedMean) {
  const DType wire = GetParam();
  StateCommit standby(WireMean(wire, AveragingMode::kOuterNesterov), kBlocks);
  standby.Restore(0, std::vector<float>(kBlocks.num_elements(), 1.0f), 5, {},
                  {});
  std::shared_ptr<StateSnapshot> next = standby.NewNext();
  std::fill(next->mean_residual.begin(), next->mean_residual.end(), 7.0f);
  const size_t len = kBlocks.Size(0);
  std::string good;
  EncodeValues(std::vector<float>(len, 0.5f), wire, &good);
  std::vector<std::pair<std::string, std::string>> bad = {
      {"bytes; chunk 0 takes", good.substr(1)},
      {"bytes; chunk 0 takes", good + "x"}};
  if (IsBlockDType(wire)) {
    for (float scale : {0.0f, -1.0f}) {
      std::string b = good;
      std::memcpy(b.data() + 4, &scale, 4);  // block 1's scale
      bad.push_back({"block 1 (elements from 64)", b});
    }
    for (float scale : {std::nanf(""), INFINITY}) {
      std::string b = good;
      std::memcpy(b.data() + 4, &scale, 4);
      bad.push_back({"not finite at element 64", b});
    }
  } else {
    std::string b;
    EncodeValues(std::vector<float>(len, INFINITY), wire, &b);
    bad.push_back({"not finite at element 0", b});
  }
  std::vector<float> chunk(len, 3.0f);
  for (const auto& [says, bytes] : bad) {
    const absl::Status s =
        standby.DecodeMean(bytes, 0, *next, absl::MakeSpan(chunk), "update");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(says));
    EXPECT_THAT(chunk, Each(3.0f));
    EXPECT_THAT(next->mean_residual, Each(7.0f));
  }
  ASSERT_TRUE(
      standby.DecodeMean(good, 0, *next, absl::MakeSpan(chunk), "update").ok());
  EXPECT_THAT(chunk, Each(0.5f));
}

INSTANTIATE_TEST_SUITE_P(LossyWires, EncodedMeanTest,
                         ::testing::Values(DType::kBFloat16, DType::kInt8Block,
                                           DType::kInt4Block),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// A float32 wire encodes nothing: mean encoding wire is float32's.
TEST(StateCommitTest, EncodedMean_Float32WireEncodesNothing) {
  JobSettings s = WireMean(DType::kFloat32, AveragingMode::kOuterNesterov);
  StateCommit commit(s, kBlocks);
  EXPECT_FALSE(commit.encodes_mean());
  commit.Restore(0, std::vector<float>(kBlocks.num_elements(), 1.0f), 5, {},
                 {});
  EXPECT_TRUE(commit.NewNext()->mean_residual.empty());
}

TEST(StateCommitTest, NewStateId_IsNeverZero) {
  StateCommit commit(Settings(Contribution::kParameters, DType::kFloat32),
                     kGeometry);
  for (int i = 0; i < 100; ++i) EXPECT_NE(commit.NewStateId(), 0u);
}

}  // namespace
}  // namespace localsgd
