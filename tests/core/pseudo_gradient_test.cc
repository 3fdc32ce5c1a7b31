// Pseudo-gradient jobs in the core: members contribute deltas against the
// state they hold (its id), the rule turns the mean delta into a step, the
// step is encoded for the wire with the coordinator's error feedback, and the
// state is exactly the previous one plus what the encoded delta decodes to.
// Driven through Job with a fake clock; every expectation is computed
// independently in the test.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/coordinator.h"
#include "src/job.h"
#include "src/upstream.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::MakeFloatLayout;
using testing_util::SyncCapture;

constexpr uint32_t kChunk = 4;
constexpr uint64_t kElements = 10;  // chunks of 4, 4, 2

JobSettings DeltaSettings(DType wire, AveragingMode mode = AveragingMode::kMean,
                          float lr = 0.7f, float mu = 0.9f) {
  JobSettings s;
  s.chunk_elements = kChunk;
  s.wire_dtype = wire;
  s.mode = mode;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.contribution = Contribution::kPseudoGradients;
  s.outer_lr = lr;
  s.outer_momentum = mu;
  return s;
}

class PseudoGradientTest : public ::testing::Test {
 protected:
  void MakeJob(JobSettings settings, JobPolicy policy = JobPolicy()) {
    settings_ = settings;
    job_ = std::make_shared<Job>("pg", MakeFloatLayout({{"w", {10}}}),
                                 kElements, settings, policy, &clock_);
  }

  MemberId Join(const std::string& name, double weight = 1) {
    JoinRequestParams p;
    p.member_name = name;
    p.layout = job_->layout();
    p.incarnation = 1;
    p.weight = weight;
    absl::StatusOr<JoinResult> r = job_->Join(p);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->member_id : MemberId();
  }

  // Sends every chunk of `values` in `dtype` (encoded without feedback).
  SyncCapture Send(const MemberId& m, RoundId round,
                   const std::vector<float>& values, DType dtype,
                   uint64_t anchor) {
    SyncCapture capture;
    absl::StatusOr<std::unique_ptr<SyncSession>> session =
        job_->BeginSync(m, round, capture.Callback(), {}, anchor);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return capture;
    const ChunkGeometry& g = job_->geometry();
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      const std::string wire = testing_util::EncodeChunk(values, g, c, dtype);
      const absl::Status s = (*session)->AddChunk(c, wire);
      EXPECT_TRUE(s.ok()) << s;
    }
    sessions_.push_back(*std::move(session));
    return capture;
  }

  // Seeds with `values` (float32 whatever the wire dtype); returns the
  // seed's state id.
  uint64_t Seed(const MemberId& m, const std::vector<float>& values) {
    SyncCapture seed = Send(m, 0, values, DType::kFloat32, 0);
    EXPECT_TRUE(seed.result().ok()) << seed.result().status();
    EXPECT_NE(seed.result()->state_id, 0u);
    EXPECT_FALSE(seed.result()->delta);
    return seed.result()->state_id;
  }

  // What a member holding `anchor` computes from a result: anchor +
  // decode(delta), element by element.
  std::vector<float> Apply(const std::vector<float>& anchor,
                           const SyncResult& result) {
    EXPECT_TRUE(result.delta);
    const ChunkGeometry& g = job_->geometry();
    const DType wire = settings_.wire_dtype;
    std::vector<float> out(anchor.size());
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      const absl::string_view data(
          result.state->delta.data() + WireBytes(wire, kChunk) * c,
          WireBytes(wire, g.Size(c)));
      std::vector<float> d(g.Size(c));
      EXPECT_TRUE(DecodeValues(data, wire, absl::MakeSpan(d)).ok());
      for (uint32_t k = 0; k < d.size(); ++k) {
        out[g.Offset(c) + k] = anchor[g.Offset(c) + k] + d[k];
      }
    }
    return out;
  }

  FakeClock clock_;
  JobSettings settings_;
  std::shared_ptr<Job> job_;
  std::vector<std::unique_ptr<SyncSession>> sessions_;
};

std::vector<float> Ramp(float base, float step) {
  std::vector<float> v(kElements);
  for (size_t i = 0; i < v.size(); ++i) v[i] = base + step * i;
  return v;
}

// MEAN with float32 deltas: the state is the anchor plus the weighted mean
// of the deltas, and a member that applies the round's delta to its anchor
// holds the coordinator's state bit for bit.
TEST_F(PseudoGradientTest, Mean_Float32_IsAnchorPlusWeightedMeanDelta) {
  MakeJob(DeltaSettings(DType::kFloat32));
  const MemberId a = Join("a", 1), b = Join("b", 3);
  const std::vector<float> theta0 = Ramp(1.0f, 0.25f);
  uint64_t anchor = Seed(a, theta0);
  std::vector<float> state = theta0;
  for (RoundId r = 1; r <= 3; ++r) {
    const std::vector<float> da = Ramp(0.01f * r, 0.001f);
    const std::vector<float> db = Ramp(-0.02f, 0.003f * r);
    SyncCapture ca = Send(a, r, da, DType::kFloat32, anchor);
    SyncCapture cb = Send(b, r, db, DType::kFloat32, anchor);
    ASSERT_TRUE(ca.result().ok()) << ca.result().status();
    ASSERT_TRUE(cb.result().ok());
    const absl::StatusOr<SyncResult> got = ca.result();  // a copy: held
    const SyncResult& res = *got;
    EXPECT_TRUE(res.contributed);
    EXPECT_EQ(res.round, r);
    EXPECT_NE(res.state_id, anchor);
    EXPECT_EQ(res.state->previous_id, anchor);
    for (size_t i = 0; i < kElements; ++i) {
      const double want = state[i] + (1.0 * da[i] + 3.0 * db[i]) / 4.0;
      EXPECT_NEAR(res.state->values[i], want, 1e-6) << "round " << r;
    }
    EXPECT_EQ(Apply(state, res), res.state->values);
    EXPECT_TRUE(res.state->residual.empty());  // float32 loses nothing
    state = res.state->values;
    anchor = res.state_id;
  }
}

// OUTER_NESTEROV against torch.optim.SGD(nesterov=True) written out in
// double: theta_t = theta_{t-1} - lr (g_t + mu b_t), b_t = mu b_{t-1} + g_t,
// g_t = -mean delta_t; over rounds in which a member joins and one leaves
// (the mean changes its members, the momentum carries on).
TEST_F(PseudoGradientTest, OuterNesterov_MatchesTorchSgdWithJoinsAndLeaves) {
  const float lr = 0.7f, mu = 0.9f;
  MakeJob(
      DeltaSettings(DType::kFloat32, AveragingMode::kOuterNesterov, lr, mu));
  const MemberId a = Join("a"), b = Join("b");
  std::vector<float> held = Ramp(0.5f, -0.1f);
  uint64_t anchor = Seed(a, held);
  std::vector<double> theta(held.begin(), held.end()), buf(kElements, 0.0);
  MemberId c;
  for (RoundId r = 1; r <= 6; ++r) {
    if (r == 3) c = Join("c");  // takes part from round 3
    std::vector<std::pair<MemberId, std::vector<float>>> sends = {
        {a, Ramp(0.01f, 0.002f * r)}};
    if (r <= 4) sends.push_back({b, Ramp(-0.03f * r, 0.001f)});
    if (r >= 3) sends.push_back({c, Ramp(0.02f, -0.004f)});
    if (r == 5) {
      ASSERT_TRUE(job_->Leave(b).ok());
    }
    std::vector<SyncCapture> captures;
    for (const auto& [m, d] : sends) {
      captures.push_back(Send(m, r, d, DType::kFloat32, anchor));
    }
    ASSERT_TRUE(captures[0].result().ok()) << captures[0].result().status();
    const absl::StatusOr<SyncResult> got = captures[0].result();  // held
    const SyncResult& res = *got;
    ASSERT_EQ(res.contributors, sends.size()) << "round " << r;
    for (size_t i = 0; i < kElements; ++i) {
      double mean = 0;
      for (const auto& [m, d] : sends) mean += d[i];
      mean /= sends.size();
      const double g = -mean;
      buf[i] = mu * buf[i] + g;
      theta[i] -= lr * (g + mu * buf[i]);
      EXPECT_NEAR(res.state->values[i], theta[i], 2e-6) << "round " << r;
      EXPECT_NEAR(res.state->momentum[i], buf[i], 2e-6) << "round " << r;
    }
    EXPECT_EQ(Apply(held, res), res.state->values);
    held = res.state->values;
    anchor = res.state_id;
  }
}

// A delta against another state than the job's is never averaged: the
// member adopts the job's state (in full, not as a delta).
TEST_F(PseudoGradientTest, DeltaAgainstAnotherAnchor_AdoptsAndIsNotAveraged) {
  MakeJob(DeltaSettings(DType::kFloat32));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(1, 0));
  SyncCapture stale = Send(b, 1, Ramp(100, 0), DType::kFloat32, anchor ^ 1);
  ASSERT_TRUE(stale.result().ok()) << stale.result().status();
  EXPECT_FALSE(stale.result()->contributed);
  EXPECT_TRUE(stale.result()->late);
  EXPECT_FALSE(stale.result()->delta);
  EXPECT_EQ(stale.result()->round, 0u);
  // The round has not opened for it: a's round closes without b.
  SyncCapture ca = Send(a, 1, Ramp(0.5f, 0), DType::kFloat32, anchor);
  ASSERT_FALSE(ca.fired());
  ASSERT_TRUE(job_->Leave(b).ok());
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->state->values, Ramp(1.5f, 0));
}

TEST_F(PseudoGradientTest, NoAnchor_IsInvalidArgument) {
  MakeJob(DeltaSettings(DType::kFloat32));
  const MemberId a = Join("a");
  Seed(a, Ramp(1, 0));
  SyncCapture capture;
  absl::StatusOr<std::unique_ptr<SyncSession>> s =
      job_->BeginSync(a, 1, capture.Callback(), {}, /*anchor=*/0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("anchor_state_id"));
}

// A retry of the round that closed, from the state before it, gets the
// round's delta again; a member further behind gets the state.
TEST_F(PseudoGradientTest, RetryOfTheLastRound_GetsTheDeltaAgain) {
  MakeJob(DeltaSettings(DType::kInt8Block));
  const MemberId a = Join("a");
  const uint64_t anchor = Seed(a, Ramp(1, 0.5f));
  SyncCapture first = Send(a, 1, Ramp(0.1f, 0.01f), DType::kInt8Block, anchor);
  ASSERT_TRUE(first.result().ok());
  SyncCapture retry = Send(a, 1, Ramp(0.1f, 0.01f), DType::kInt8Block, anchor);
  ASSERT_TRUE(retry.result().ok());
  EXPECT_TRUE(retry.result()->delta);
  EXPECT_TRUE(retry.result()->contributed);
  EXPECT_EQ(retry.result()->state, first.result()->state);
  SyncCapture older = Send(a, 1, Ramp(0.1f, 0.01f), DType::kInt8Block, 12345);
  ASSERT_TRUE(older.result().ok());
  EXPECT_FALSE(older.result()->delta);
}

// Every encoding: a member that contributes a delta of 1e-3 |theta| for 20
// rounds moves every parameter by the intended amount, within the
// encoding's error: each end's residual carries what a round's encoding
// dropped into the next round (the member's here as the client keeps it).
TEST_F(PseudoGradientTest, SmallRelativeUpdates_MoveEveryParameter) {
  for (DType wire : {DType::kFloat32, DType::kBFloat16, DType::kInt8Block,
                     DType::kInt4Block}) {
    SCOPED_TRACE(DTypeName(wire));
    MakeJob(DeltaSettings(wire));
    const MemberId a = Join("a");
    std::vector<float> theta(kElements);
    for (size_t i = 0; i < kElements; ++i) theta[i] = 1.0f + 0.37f * i;
    const std::vector<float> theta0 = theta;
    uint64_t anchor = Seed(a, theta);
    // The member's own error feedback, as the client keeps it: per chunk.
    std::vector<float> residual(kElements, 0.0f);
    for (RoundId r = 1; r <= 20; ++r) {
      std::vector<float> delta(kElements);
      for (size_t i = 0; i < kElements; ++i) delta[i] = 1e-3f * theta0[i];
      SyncCapture c;
      absl::StatusOr<std::unique_ptr<SyncSession>> session =
          job_->BeginSync(a, r, c.Callback(), {}, anchor);
      ASSERT_TRUE(session.ok()) << session.status();
      const ChunkGeometry& g = job_->geometry();
      for (uint32_t k = 0; k < g.num_chunks(); ++k) {
        std::string wire_bytes(WireBytes(wire, g.Size(k)), '\0');
        std::vector<float> decoded(g.Size(k));
        EncodeWithFeedback(
            absl::MakeConstSpan(delta).subspan(g.Offset(k), g.Size(k)),
            wire == DType::kFloat32
                ? absl::Span<float>()
                : absl::MakeSpan(residual).subspan(g.Offset(k), g.Size(k)),
            wire, wire_bytes.data(), absl::MakeSpan(decoded));
        ASSERT_TRUE((*session)->AddChunk(k, wire_bytes).ok());
      }
      ASSERT_TRUE(c.result().ok()) << c.result().status();
      theta = c.result()->state->values;
      anchor = c.result()->state_id;
    }
    for (size_t i = 0; i < kElements; ++i) {
      const double moved = theta[i] - theta0[i];
      const double want = 20 * 1e-3 * theta0[i];
      // Within one round's worth of quantization error of the largest
      // delta of the chunk (the residual holds at most that).
      EXPECT_NEAR(moved, want, 0.07 * 1e-3 * theta0.back() + 1e-6)
          << "element " << i;
    }
  }
}

// The finite-state guard: finite deltas that would make the next state
// overflow (each case a rule, a wire and a size that did before the guard)
// are refused, the round closes without them (named as rejected), and the
// state, momentum and residual equal bit for bit those of a twin job that
// never had the offending member, in that round and the next honest one.
struct OverflowCase {
  const char* name;
  JobSettings settings;
  float anchor;   // every parameter of the seed
  float hostile;  // every element of the offending member's delta
};

class FiniteStateGuardTest
    : public PseudoGradientTest,
      public ::testing::WithParamInterface<OverflowCase> {
 protected:
  struct Run {
    std::shared_ptr<const StateSnapshot> first, second;
    JobStatusSnapshot status;
    absl::StatusOr<SyncResult> hostile = absl::UnknownError("not sent");
  };

  // Three honest members (and, with `with_hostile`, the offending one) for
  // two rounds; the offending member leaves after the first.
  Run Train(bool with_hostile) {
    const OverflowCase& c = GetParam();
    MakeJob(c.settings);
    const DType wire = c.settings.wire_dtype;
    std::vector<MemberId> honest;
    for (const char* name : {"h0", "h1", "h2"}) honest.push_back(Join(name));
    const MemberId x = with_hostile ? Join("x") : MemberId();
    uint64_t anchor = Seed(honest[0], std::vector<float>(kElements, c.anchor));
    Run run;
    for (RoundId r = 1; r <= 2; ++r) {
      std::vector<SyncCapture> captures;
      for (size_t i = 0; i < honest.size(); ++i) {
        // Dyadic deltas: their sum is exact in any order.
        captures.push_back(Send(honest[i], r,
                                std::vector<float>(kElements, 0.25f * (i + 1)),
                                wire, anchor));
      }
      if (with_hostile && r == 1) {
        SyncCapture bad =
            Send(x, r, std::vector<float>(kElements, c.hostile), wire, anchor);
        run.hostile = bad.result();
        EXPECT_TRUE(job_->Leave(x).ok());
      }
      for (SyncCapture& capture : captures) {
        const absl::StatusOr<SyncResult> got = capture.result();
        EXPECT_TRUE(got.ok()) << got.status();
        if (!got.ok()) return run;
        EXPECT_TRUE(got->contributed);
        EXPECT_EQ(got->round, r);
      }
      const absl::StatusOr<SyncResult> got = captures[0].result();
      (r == 1 ? run.first : run.second) = got->state;
      anchor = got->state_id;
    }
    run.status = job_->Status(8);
    return run;
  }
};

bool AllFinite(const std::vector<float>& v) {
  for (float f : v) {
    if (!std::isfinite(f)) return false;
  }
  return true;
}

TEST_P(FiniteStateGuardTest, OffendingDeltaRefused_StateAsWithoutIt) {
  const Run attacked = Train(/*with_hostile=*/true);
  const Run twin = Train(/*with_hostile=*/false);
  ASSERT_NE(attacked.first, nullptr);
  ASSERT_NE(attacked.second, nullptr);
  ASSERT_NE(twin.second, nullptr);
  // The offending member got the round's result, not counted, not late.
  ASSERT_TRUE(attacked.hostile.ok()) << attacked.hostile.status();
  EXPECT_FALSE(attacked.hostile->contributed);
  EXPECT_FALSE(attacked.hostile->late);
  EXPECT_EQ(attacked.hostile->round, 1u);
  for (const auto& [a, b] : {std::pair{attacked.first, twin.first},
                             std::pair{attacked.second, twin.second}}) {
    EXPECT_TRUE(AllFinite(a->values));
    EXPECT_TRUE(AllFinite(a->momentum));
    EXPECT_TRUE(AllFinite(a->residual));
    EXPECT_EQ(a->values, b->values) << "round " << a->round;
    EXPECT_EQ(a->momentum, b->momentum) << "round " << a->round;
    EXPECT_EQ(a->residual, b->residual) << "round " << a->round;
    // What members decode: every block scale of the result finite.
    EXPECT_EQ(FirstNonFinite(a->delta, settings_.wire_dtype), -1);
    EXPECT_EQ(a->delta, b->delta) << "round " << a->round;
  }
  // Named in the round's record, with the reason.
  ASSERT_EQ(attacked.status.recent_rounds.size(), 3u);  // 2, 1, the seed
  const RoundRecord& first = attacked.status.recent_rounds[1];
  EXPECT_EQ(first.round, 1u);
  EXPECT_THAT(first.contributors, ElementsAre("h0", "h1", "h2"));
  ASSERT_EQ(first.rejected.size(), 1u);
  EXPECT_THAT(first.rejected[0], HasSubstr("x: a delta of magnitude up to"));
  EXPECT_THAT(first.rejected[0], HasSubstr("would overflow"));
  EXPECT_TRUE(attacked.status.recent_rounds[0].rejected.empty());
}

// Near float32's limit the guard refuses what could push the state over
// it. It bounds magnitudes (|state| + |step| at most float32's largest),
// not signs: a delta toward zero larger than the headroom is refused too.
TEST_F(PseudoGradientTest, FiniteStateGuard_NearTheLimitTakesWhatFits) {
  MakeJob(DeltaSettings(DType::kFloat32));
  const MemberId a = Join("a");
  // 3.3e38 + 2e37 is beyond float32's largest, 3.4e38.
  uint64_t anchor = Seed(a, std::vector<float>(kElements, 3e38f));
  SyncCapture fits =
      Send(a, 1, std::vector<float>(kElements, 3e37f), DType::kFloat32, anchor);
  ASSERT_TRUE(fits.result().ok()) << fits.result().status();
  EXPECT_TRUE(fits.result()->contributed);
  EXPECT_EQ(fits.result()->state->values,
            std::vector<float>(kElements, 3e38f + 3e37f));
  anchor = fits.result()->state_id;
  for (float delta : {2e37f, -2e37f}) {
    SyncCapture over = Send(a, 2, std::vector<float>(kElements, delta),
                            DType::kFloat32, anchor);
    ASSERT_TRUE(over.result().ok()) << over.result().status();
    EXPECT_FALSE(over.result()->contributed) << delta;
    EXPECT_EQ(over.result()->round, 2u);
    anchor = over.result()->state_id;
    EXPECT_EQ(over.result()->state->values,
              std::vector<float>(kElements, 3e38f + 3e37f));
  }
}

JobSettings Case(DType wire, AveragingMode mode, float lr = 0.7f,
                 float mu = 0.9f) {
  return DeltaSettings(wire, mode, lr, mu);
}

INSTANTIATE_TEST_SUITE_P(
    Overflows, FiniteStateGuardTest,
    ::testing::Values(
        // MEAN: an anchor of 3e38 plus a delta of 3e38.
        OverflowCase{"Mean_Float32",
                     Case(DType::kFloat32, AveragingMode::kMean), 3e38f, 3e38f},
        // OUTER_NESTEROV (lr 0.7, momentum 0.9): a step of 1.33 g.
        OverflowCase{"OuterNesterov_Float32",
                     Case(DType::kFloat32, AveragingMode::kOuterNesterov), 1.0f,
                     -3e38f},
        // OUTER_SGD with outer_lr 100 (allowed): deltas of -1e37.
        OverflowCase{"OuterSgdLr100_BFloat16",
                     Case(DType::kBFloat16, AveragingMode::kOuterSgd, 100.0f),
                     1.0f, -1e37f},
        // The int8 wire: before the guard, a NaN block scale in the result.
        OverflowCase{"Mean_Int8", Case(DType::kInt8Block, AveragingMode::kMean),
                     3e38f, 3e38f},
        // int4 carries at most 7 x kMaxBlockScale (1.9e37): lr 100 again.
        OverflowCase{"OuterSgdLr100_Int4",
                     Case(DType::kInt4Block, AveragingMode::kOuterSgd, 100.0f),
                     1.0f, -1e37f}),
    [](const ::testing::TestParamInfo<OverflowCase>& info) {
      return std::string(info.param.name);
    });

// Blockwise payloads: a zero or negative scale is malformed (INVALID_
// ARGUMENT, nothing counted); a NaN scale is a non-finite value.
TEST_F(PseudoGradientTest, BlockScales_ZeroNegativeAreInvalid_NanIsNonFinite) {
  MakeJob(DeltaSettings(DType::kInt8Block));
  const MemberId a = Join("a");
  const uint64_t anchor = Seed(a, Ramp(1, 0));
  SyncCapture capture;
  absl::StatusOr<std::unique_ptr<SyncSession>> session =
      job_->BeginSync(a, 1, capture.Callback(), {}, anchor);
  ASSERT_TRUE(session.ok());
  std::string chunk = testing_util::EncodeChunk(Ramp(1, 0), job_->geometry(), 0,
                                                DType::kInt8Block);
  for (float bad : {0.0f, -1.0f}) {
    std::string spoiled = chunk;
    std::memcpy(spoiled.data(), &bad, 4);
    const absl::Status s = (*session)->AddChunk(0, spoiled);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("scales must be positive"));
  }
  std::string nan = chunk;
  const float q = std::nanf("");
  std::memcpy(nan.data(), &q, 4);
  const absl::Status s = (*session)->AddChunk(0, nan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("non-finite value at element 0"));
  EXPECT_EQ((*session)->received(), 0u);
  std::string short_chunk = chunk.substr(1);
  EXPECT_THAT((*session)->AddChunk(0, short_chunk).message(),
              HasSubstr("values in 1 blocks"));
}

// The seed of a pseudo-gradient job is float32 whatever the wire dtype.
TEST_F(PseudoGradientTest, Seed_IsFloat32WhateverTheWire) {
  MakeJob(DeltaSettings(DType::kInt4Block));
  const MemberId a = Join("a");
  const std::vector<float> theta = Ramp(3.14159f, 1e-7f);
  Seed(a, theta);
  absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
      job_->GetState(a);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, theta);
}

// Per-chunk finality: which chunks a waiter was told are final, in order.
struct FinalLog {
  std::vector<uint32_t> told;
  std::shared_ptr<const StateSnapshot> next;
  FinalChunksCallback Callback() {
    return [this](std::vector<uint32_t> indices,
                  std::shared_ptr<const StateSnapshot> state) {
      told.insert(told.end(), indices.begin(), indices.end());
      next = std::move(state);
    };
  }
};

// A chunk is final once every participant gave it: the waiters that asked
// are told at once, with the state the round then commits; the delta's
// final chunks are what the round's result carries.
TEST_F(PseudoGradientTest, Finality_ChunkFinalWhenEveryParticipantGaveIt) {
  MakeJob(DeltaSettings(DType::kInt8Block, AveragingMode::kOuterNesterov));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(1.0f, 0.5f));
  FinalLog fa, fb;
  SyncCapture ca, cb;
  auto sa = *job_->BeginSync(a, 1, ca.Callback(), {}, anchor, fa.Callback());
  auto sb = *job_->BeginSync(b, 1, cb.Callback(), {}, anchor, fb.Callback());
  const ChunkGeometry& g = job_->geometry();
  const std::vector<float> da = Ramp(0.1f, 0.01f), db = Ramp(-0.2f, 0.02f);
  auto add = [&](SyncSession& s, const std::vector<float>& d, uint32_t c) {
    ASSERT_TRUE(
        s.AddChunk(c, testing_util::EncodeChunk(d, g, c, DType::kInt8Block))
            .ok());
  };
  add(*sa, da, 2);
  add(*sa, da, 0);
  EXPECT_TRUE(fa.told.empty());
  add(*sb, db, 0);
  EXPECT_EQ(fa.told, std::vector<uint32_t>{0});
  EXPECT_EQ(fb.told, std::vector<uint32_t>{0});
  const std::string early(
      fa.next->delta.substr(0, WireBytes(DType::kInt8Block, 4)));
  add(*sb, db, 2);
  EXPECT_EQ(fa.told, (std::vector<uint32_t>{0, 2}));
  // A Sync that starts now (another stream of b: a retry) hears of both.
  FinalLog fretry;
  SyncCapture cretry;
  auto sretry =
      *job_->BeginSync(b, 1, cretry.Callback(), {}, anchor, fretry.Callback());
  EXPECT_EQ(fretry.told, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(fretry.next, fa.next);
  add(*sa, da, 1);
  EXPECT_FALSE(ca.fired());
  add(*sb, db, 1);
  ASSERT_TRUE(ca.fired());
  // Chunk 1 became final with the close: told or not, it is in the result.
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->state, fa.next);
  EXPECT_EQ(
      ca.result()->state->delta.substr(0, WireBytes(DType::kInt8Block, 4)),
      early);
  EXPECT_EQ(ca.result()->contributors, 2u);
}

// A participant that goes away gives nothing more: a chunk every other
// participant gave is final at once (told while the round is still open),
// and one the others give later is final when they do, not only at the
// close. Members pacing their upload on the results (ClientOptions::
// max_lead_chunks) would otherwise wait for a close that waits for them.
TEST_F(PseudoGradientTest, Finality_ParticipantGone_ChunksTheOthersGaveFinal) {
  MakeJob(DeltaSettings(DType::kFloat32));
  const MemberId a = Join("a"), b = Join("b"), c = Join("c");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  FinalLog fa;
  SyncCapture ca, cb, cc;
  auto sa = *job_->BeginSync(a, 1, ca.Callback(), {}, anchor, fa.Callback());
  auto sb = *job_->BeginSync(b, 1, cb.Callback(), {}, anchor);
  auto sc = *job_->BeginSync(c, 1, cc.Callback(), {}, anchor);
  const ChunkGeometry& g = job_->geometry();
  ASSERT_EQ(g.num_chunks(), 3u);
  const std::vector<float> da(g.num_elements(), 1.0f),
      db(g.num_elements(), 2.0f), dc(g.num_elements(), 6.0f);
  auto add = [&](SyncSession& s, const std::vector<float>& d, uint32_t k) {
    ASSERT_TRUE(
        s.AddChunk(k, testing_util::EncodeChunk(d, g, k, DType::kFloat32))
            .ok());
  };
  for (uint32_t k : {0u, 2u}) {
    add(*sa, da, k);
    add(*sb, db, k);
  }
  add(*sc, dc, 0);
  EXPECT_EQ(fa.told, std::vector<uint32_t>{0});
  ASSERT_TRUE(job_->Leave(c).ok());
  EXPECT_EQ(fa.told, (std::vector<uint32_t>{0, 2}));
  EXPECT_FALSE(ca.fired());
  add(*sa, da, 1);
  EXPECT_EQ(fa.told, (std::vector<uint32_t>{0, 2}));
  add(*sb, db, 1);
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->contributors, 2u);
  // Chunk 0: the mean of three deltas, 3; chunks 1 and 2: of two, 1.5.
  auto state = job_->GetState(a);
  ASSERT_TRUE(state.ok());
  const std::vector<float> seed = Ramp(0.0f, 1.0f);
  for (uint32_t k = 0; k < g.num_chunks(); ++k) {
    for (uint64_t i = g.Offset(k); i < g.Offset(k) + g.Size(k); ++i) {
      ASSERT_EQ((*state)->values[i], seed[i] + (k == 0 ? 3.0f : 1.5f))
          << "element " << i;
    }
  }
}

// While the round gathers members (a rendezvous), no chunk is final: a
// member that joins may still give it. Once the last one joins, its chunks
// make them final one by one.
TEST_F(PseudoGradientTest, Finality_NoneWhileGathering) {
  JobSettings settings = DeltaSettings(DType::kFloat32);
  settings.rendezvous_members = 3;
  MakeJob(settings);
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  FinalLog fa;
  SyncCapture ca = SyncCapture();
  auto sa = *job_->BeginSync(a, 1, ca.Callback(), {}, anchor, fa.Callback());
  const ChunkGeometry& g = job_->geometry();
  const std::vector<float> d = Ramp(1.0f, 0.0f);
  for (uint32_t c = 0; c < g.num_chunks(); ++c) {
    ASSERT_TRUE(
        sa->AddChunk(c, testing_util::EncodeChunk(d, g, c, DType::kFloat32))
            .ok());
  }
  SyncCapture cb = Send(b, 1, d, DType::kFloat32, anchor);
  EXPECT_TRUE(fa.told.empty()) << "final while gathering";
  const MemberId c = Join("c");
  SyncCapture cc;
  auto sc = *job_->BeginSync(c, 1, cc.Callback(), {}, anchor);
  ASSERT_TRUE(sc->AddChunk(1, testing_util::EncodeChunk(Ramp(4.0f, 0.0f), g, 1,
                                                        DType::kFloat32))
                  .ok());
  EXPECT_EQ(fa.told, std::vector<uint32_t>{1});
  for (uint32_t k : {0u, 2u}) {
    ASSERT_TRUE(sc->AddChunk(k, testing_util::EncodeChunk(Ramp(4.0f, 0.0f), g,
                                                          k, DType::kFloat32))
                    .ok());
  }
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->contributors, 3u);
  // (1 + 1 + 4) / 3 = 2 on every element.
  auto state = job_->GetState(a);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, Ramp(2.0f, 1.0f));
}

// After a restore the job regathers for one lease TTL: chunks every
// participant gave are held, and the first Tick after the TTL makes them
// final without closing the round.
TEST_F(PseudoGradientTest, Finality_HeldWhileRegathering_FinalAtTheTickAfter) {
  MakeJob(DeltaSettings(DType::kFloat32));
  job_->RestoreState(4, Ramp(0.0f, 1.0f), /*id=*/77, {}, {});
  const MemberId a = Join("a"), b = Join("b");
  FinalLog fa;
  SyncCapture ca;
  auto sa = *job_->BeginSync(a, 5, ca.Callback(), {}, 77, fa.Callback());
  SyncCapture cb;
  auto sb = *job_->BeginSync(b, 5, cb.Callback(), {}, 77);
  const ChunkGeometry& g = job_->geometry();
  const std::vector<float> d = Ramp(1.0f, 0.0f);
  for (auto* s : {sa.get(), sb.get()}) {
    ASSERT_TRUE(
        s->AddChunk(0, testing_util::EncodeChunk(d, g, 0, DType::kFloat32))
            .ok());
  }
  job_->Tick();
  EXPECT_TRUE(fa.told.empty()) << "final while regathering";
  // Past the TTL, with the members' leases renewed on the way.
  for (int half = 0; half < 2; ++half) {
    clock_.Advance(JobPolicy().lease_ttl / 2 + absl::Seconds(1));
    for (const MemberId& m : {a, b}) ASSERT_TRUE(job_->Heartbeat(m).ok());
  }
  job_->Tick();
  EXPECT_EQ(fa.told, std::vector<uint32_t>{0});
  EXPECT_FALSE(ca.fired());
}

// DeadlineMode::kAdaptive, driven on the fake clock in 50 ms ticks: every
// round opens with all three Syncs; a member gives its chunks `after` the
// round opened (never if it is not in `after`). Returns the round's record.
RoundRecord RunRound(
    PseudoGradientTest* t, Job& job, FakeClock& clock, uint64_t* anchor,
    RoundId round,
    const std::vector<std::pair<MemberId, absl::Duration>>& after) {
  std::vector<SyncCapture> captures(after.size());
  std::vector<std::unique_ptr<SyncSession>> sessions;
  for (size_t i = 0; i < after.size(); ++i) {
    sessions.push_back(*job.BeginSync(after[i].first, round,
                                      captures[i].Callback(), {}, *anchor));
  }
  const absl::Time opened = clock.Now();
  std::vector<bool> sent(after.size(), false);
  const ChunkGeometry& g = job.geometry();
  for (int tick = 0; tick < 200 && !captures[0].fired(); ++tick) {
    for (size_t i = 0; i < after.size(); ++i) {
      if (sent[i] || clock.Now() - opened < after[i].second) continue;
      sent[i] = true;
      for (uint32_t c = 0; c < g.num_chunks(); ++c) {
        EXPECT_TRUE(
            sessions[i]
                ->AddChunk(c, testing_util::EncodeChunk(Ramp(0.5f, 0.0f), g, c,
                                                        DType::kFloat32))
                .ok());
      }
    }
    job.Tick();
    if (!captures[0].fired()) clock.Advance(absl::Milliseconds(50));
  }
  EXPECT_TRUE(captures[0].fired()) << "round " << round << " never closed";
  if (captures[0].fired()) *anchor = captures[0].result()->state_id;
  const JobStatusSnapshot status = job.Status(1);
  return status.recent_rounds.empty() ? RoundRecord() : status.recent_rounds[0];
}

// A member 3x slower than the others is waited for while the job learns
// (and twice more, patiently), then counts as a persistent straggler: its
// rounds close at the learned `usual` deadline without it. A member delayed
// once, within `patient`, still counts; the straggler counts again as soon
// as it is on time, and is waited for patiently once after that.
TEST_F(PseudoGradientTest, AdaptiveDeadline_StragglerAdoptsOneOffDelayCounts) {
  JobSettings settings = DeltaSettings(DType::kFloat32);
  settings.deadline_mode = DeadlineMode::kAdaptive;
  MakeJob(settings);
  const MemberId a = Join("a"), b = Join("b"), c = Join("c");
  uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  const absl::Duration on_time = absl::Seconds(1), slow = absl::Seconds(3);
  auto round = [&](RoundId r, absl::Duration b_after, absl::Duration c_after) {
    return RunRound(this, *job_, clock_, &anchor, r,
                    {{a, on_time}, {b, b_after}, {c, c_after}});
  };
  using Names = std::vector<std::string>;
  // Rounds 1, 2: nothing learned yet; everyone is waited for.
  for (RoundId r = 1; r <= 2; ++r) {
    const RoundRecord rec = round(r, on_time, slow);
    EXPECT_EQ(rec.contributors, (Names{"a", "b", "c"})) << "round " << r;
    EXPECT_EQ(rec.closed - rec.opened, slow);
  }
  // Six lags (1, 1, 3, 1, 1, 3 s): usual 1.15 s, patient 2.3 s.
  const LearnedDeadline learned = job_->learned_deadline();
  EXPECT_EQ(learned.usual, absl::Milliseconds(1150));
  EXPECT_EQ(learned.patient, absl::Milliseconds(2300));
  // Rounds 3, 4: c is not (yet) a straggler: waited for until patient.
  for (RoundId r = 3; r <= 4; ++r) {
    const RoundRecord rec = round(r, on_time, slow);
    EXPECT_EQ(rec.contributors, (Names{"a", "b"})) << "round " << r;
    EXPECT_EQ(rec.timed_out, Names{"c"});
    EXPECT_EQ(rec.reason, CloseReason::kDeadline);
    EXPECT_EQ(rec.closed - rec.opened, absl::Milliseconds(2300));
  }
  EXPECT_EQ(job_->Status(0).stragglers, Names{"c"});
  // Round 5: c is a persistent straggler: the round closes at usual.
  RoundRecord rec = round(5, on_time, slow);
  EXPECT_EQ(rec.contributors, (Names{"a", "b"}));
  EXPECT_EQ(rec.closed - rec.opened, absl::Milliseconds(1150));
  // Round 6: b is delayed once (2 s, within patient): it still counts.
  rec = round(6, absl::Seconds(2), slow);
  EXPECT_EQ(rec.contributors, (Names{"a", "b"}));
  EXPECT_EQ(rec.closed - rec.opened, absl::Seconds(2));
  // Round 7: c is on time again: it counts, and is no straggler any more.
  rec = round(7, on_time, on_time);
  EXPECT_EQ(rec.contributors, (Names{"a", "b", "c"}));
  EXPECT_EQ(rec.reason, CloseReason::kComplete);
  EXPECT_TRUE(job_->Status(0).stragglers.empty());
  // Round 8: c is slow again: waited for patiently, once; one contribution
  // took only one of its misses off, so it is a straggler again at once and
  // round 9 closes at usual.
  rec = round(8, on_time, slow);
  EXPECT_EQ(rec.timed_out, Names{"c"});
  EXPECT_EQ(rec.closed - rec.opened, absl::Milliseconds(2300));
  EXPECT_EQ(job_->Status(0).stragglers, Names{"c"});
  rec = round(9, on_time, slow);
  EXPECT_EQ(rec.timed_out, Names{"c"});
  EXPECT_EQ(rec.closed - rec.opened, absl::Milliseconds(1150));
}

// ---------------------------------------------------------------------------
// The outlier guard (JobSettings.outlier_ratio; src/outlier_guard.h).

JobSettings Guarded(DType wire, AveragingMode mode = AveragingMode::kMean,
                    float ratio = 10) {
  JobSettings s = DeltaSettings(wire, mode);
  s.outlier_ratio = ratio;
  return s;
}

class OutlierGuardJobTest : public PseudoGradientTest {
 protected:
  struct Run {
    std::vector<std::shared_ptr<const StateSnapshot>> states;
    std::vector<absl::StatusOr<SyncResult>> hostile;
    JobStatusSnapshot status;
  };

  // Three honest members (deltas of 0.25, 0.5 and 0.75 times `scale` in
  // round r, r = 1..rounds) and, with `hostile_factor` > 0, a fourth whose
  // delta is that many times the first's. `hostile_first`: the hostile
  // member sends before the honest ones (in a cold round its chunks are
  // held first), else after the first honest one.
  Run Train(JobSettings settings, int rounds, float hostile_factor,
            bool hostile_first) {
    MakeJob(settings);
    const DType wire = settings.wire_dtype;
    std::vector<MemberId> honest;
    for (const char* name : {"h0", "h1", "h2"}) honest.push_back(Join(name));
    const MemberId x = hostile_factor > 0 ? Join("x") : MemberId();
    uint64_t anchor = Seed(honest[0], Ramp(1.0f, 0.5f));
    Run run;
    for (RoundId r = 1; r <= static_cast<RoundId>(rounds); ++r) {
      const float scale = 1.0f / (1 << r);  // dyadic: sums are exact
      std::vector<SyncCapture> captures;
      auto send_hostile = [&] {
        SyncCapture bad = Send(
            x, r, std::vector<float>(kElements, hostile_factor * 0.25f * scale),
            wire, anchor);
        return bad;
      };
      std::vector<SyncCapture> bad;
      if (hostile_factor > 0 && hostile_first) bad.push_back(send_hostile());
      for (size_t i = 0; i < honest.size(); ++i) {
        captures.push_back(
            Send(honest[i], r,
                 std::vector<float>(kElements, 0.25f * (i + 1) * scale), wire,
                 anchor));
        if (hostile_factor > 0 && !hostile_first && i == 0) {
          bad.push_back(send_hostile());
        }
      }
      for (SyncCapture& capture : captures) {
        const absl::StatusOr<SyncResult> got = capture.result();
        EXPECT_TRUE(got.ok()) << got.status();
        if (!got.ok()) return run;
        EXPECT_TRUE(got->contributed) << "round " << r;
        EXPECT_EQ(got->round, r);
      }
      for (SyncCapture& b : bad) run.hostile.push_back(b.result());
      const absl::StatusOr<SyncResult> got = captures[0].result();
      run.states.push_back(got->state);
      anchor = got->state_id;
    }
    run.status = job_->Status(16);
    return run;
  }
};

// A member whose delta is a million times too large, among three honest
// ones: refused in every round, the first (the guard's cold start: judged
// against the median of the first three it holds) included, whether it
// sends first or among the others; every state is the one a job without it
// computes, bit for bit; the round records name it with the reason.
TEST_F(OutlierGuardJobTest, MillionTimesDelta_RefusedStateAsWithoutIt) {
  for (const DType wire : {DType::kFloat32, DType::kInt8Block}) {
    for (const bool first : {true, false}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(wire), first ? " first" : " later"));
      const JobSettings settings = Guarded(wire, AveragingMode::kOuterNesterov);
      const Run attacked = Train(settings, 4, 1e6f, first);
      const Run twin = Train(settings, 4, 0, false);
      ASSERT_EQ(attacked.states.size(), 4u);
      ASSERT_EQ(twin.states.size(), 4u);
      for (size_t i = 0; i < 4; ++i) {
        EXPECT_EQ(attacked.states[i]->values, twin.states[i]->values) << i;
        EXPECT_EQ(attacked.states[i]->momentum, twin.states[i]->momentum);
        EXPECT_EQ(attacked.states[i]->delta, twin.states[i]->delta);
      }
      ASSERT_EQ(attacked.hostile.size(), 4u);
      for (size_t i = 0; i < 4; ++i) {
        const absl::StatusOr<SyncResult>& h = attacked.hostile[i];
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_FALSE(h->contributed);
        EXPECT_FALSE(h->late);
        EXPECT_EQ(h->round, i + 1);
      }
      // Records: newest first, the seed last.
      ASSERT_EQ(attacked.status.recent_rounds.size(), 5u);
      for (size_t i = 0; i < 4; ++i) {
        const RoundRecord& record = attacked.status.recent_rounds[i];
        EXPECT_THAT(record.contributors, ElementsAre("h0", "h1", "h2"));
        ASSERT_EQ(record.rejected.size(), 1u) << record.round;
        EXPECT_THAT(record.rejected[0], HasSubstr("x: chunk 0 has an L2 norm"));
        EXPECT_THAT(record.rejected[0], HasSubstr("the outlier guard refuses "
                                                  "more than 10 times"));
      }
    }
  }
}

// With the guard off (-1) the same member's delta is averaged in: the
// guard, not something else, made the difference above.
TEST_F(OutlierGuardJobTest, Off_MillionTimesDeltaIsAveraged) {
  const Run attacked =
      Train(Guarded(DType::kFloat32, AveragingMode::kMean, kOutlierGuardOff), 1,
            1e6f, true);
  ASSERT_EQ(attacked.hostile.size(), 1u);
  ASSERT_TRUE(attacked.hostile[0].ok());
  EXPECT_TRUE(attacked.hostile[0]->contributed);
  // anchor 1 + mean(0.125, 0.25, 0.375, 125000) / 1 at element 0.
  EXPECT_EQ(attacked.states[0]->values[0],
            1.0f + (0.125f + 0.25f + 0.375f + 125000.0f) / 4);
}

// Two members: nothing says which of two is the outlier; both count.
TEST_F(OutlierGuardJobTest, TwoMembers_ColdStartCountsBoth) {
  MakeJob(Guarded(DType::kFloat32));
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  SyncCapture ca =
      Send(a, 1, std::vector<float>(kElements, 1.0f), DType::kFloat32, anchor);
  EXPECT_FALSE(ca.fired());  // held: b may still give it
  SyncCapture cb = Send(b, 1, std::vector<float>(kElements, 1000.0f),
                        DType::kFloat32, anchor);
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->state->values[1], 1.0f + 500.5f);
}

// Every member moves by a hundred times more at once (a learning-rate
// schedule): the round refuses them all and keeps its state; the guard
// forgets what it learned, and the next round at the new scale counts.
TEST_F(OutlierGuardJobTest, ScaleChangeOfAll_OneRoundRefusedThenLearned) {
  MakeJob(Guarded(DType::kFloat32));
  std::vector<MemberId> m;
  for (const char* name : {"a", "b", "c"}) m.push_back(Join(name));
  uint64_t anchor = Seed(m[0], Ramp(0.0f, 1.0f));
  std::vector<float> values = Ramp(0.0f, 1.0f);
  for (RoundId r = 1; r <= 3; ++r) {
    const float delta = r == 1 ? 0.25f : 25.0f;
    std::vector<SyncCapture> captures;
    for (const MemberId& id : m) {
      captures.push_back(Send(id, r, std::vector<float>(kElements, delta),
                              DType::kFloat32, anchor));
    }
    for (SyncCapture& c : captures) {
      ASSERT_TRUE(c.result().ok()) << c.result().status();
      EXPECT_EQ(c.result()->contributed, r != 2) << "round " << r;
    }
    if (r != 2) {
      for (float& v : values) v += delta;
    }
    EXPECT_EQ(captures[0].result()->state->values, values) << "round " << r;
    anchor = captures[0].result()->state_id;
  }
}

// A job of one member: its first three rounds teach the guard (each
// judged alone: accepted), a delta a hundred times larger is refused, and
// that refusal (all of the round's participants) makes the guard learn the
// new scale: the next round counts.
TEST_F(OutlierGuardJobTest, OneMember_ScaleJumpCostsOneRound) {
  MakeJob(Guarded(DType::kFloat32));
  const MemberId a = Join("a");
  uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  std::vector<float> values = Ramp(0.0f, 1.0f);
  for (RoundId r = 1; r <= 6; ++r) {
    const float delta = r <= 3 ? 0.25f : 25.0f;
    SyncCapture c = Send(a, r, std::vector<float>(kElements, delta),
                         DType::kFloat32, anchor);
    ASSERT_TRUE(c.result().ok()) << c.result().status();
    EXPECT_EQ(c.result()->contributed, r != 4) << "round " << r;
    if (r != 4) {
      for (float& v : values) v += delta;
    }
    EXPECT_EQ(c.result()->state->values, values) << "round " << r;
    anchor = c.result()->state_id;
  }
}

// A held chunk (the cold start) is judged at the round's deadline: two
// members in, the third silent; the deadline closes the round with the
// two counted.
TEST_F(OutlierGuardJobTest, HeldChunks_JudgedAtTheDeadline) {
  JobPolicy policy;
  policy.round_deadline = absl::Seconds(5);
  MakeJob(Guarded(DType::kFloat32), policy);
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  Join("c");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  SyncCapture ca =
      Send(a, 1, std::vector<float>(kElements, 1.0f), DType::kFloat32, anchor);
  SyncCapture cb =
      Send(b, 1, std::vector<float>(kElements, 2.0f), DType::kFloat32, anchor);
  job_->Tick();
  EXPECT_FALSE(ca.fired());
  clock_.Advance(absl::Seconds(6));
  job_->Tick();
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->state->values[0], 1.5f);
}

// A member that leaves with chunks held: what it held is not judged, and
// the others' held chunks are judged once no one else owes them.
TEST_F(OutlierGuardJobTest, MemberLeavesWhileHeld_OthersJudged) {
  MakeJob(Guarded(DType::kFloat32));
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  const MemberId c = Join("c");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  SyncCapture ca =
      Send(a, 1, std::vector<float>(kElements, 1.0f), DType::kFloat32, anchor);
  SyncCapture cc =
      Send(c, 1, std::vector<float>(kElements, 5.0f), DType::kFloat32, anchor);
  EXPECT_FALSE(ca.fired());
  ASSERT_TRUE(job_->Leave(c).ok());
  EXPECT_FALSE(ca.fired());  // b may still give them
  SyncCapture cb =
      Send(b, 1, std::vector<float>(kElements, 2.0f), DType::kFloat32, anchor);
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->state->values[0], 1.5f);
}

// A zero delta (frozen parameters) is neither held nor judged; one that
// comes last ends the wait of the others' held chunks.
TEST_F(OutlierGuardJobTest, ZeroDeltaLast_JudgesTheHeldOnes) {
  MakeJob(Guarded(DType::kFloat32));
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  SyncCapture ca =
      Send(a, 1, std::vector<float>(kElements, -1.0f), DType::kFloat32, anchor);
  EXPECT_FALSE(ca.fired());  // held: b may still give it
  SyncCapture cb =
      Send(b, 1, std::vector<float>(kElements, 0.0f), DType::kFloat32, anchor);
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->state->values[0], -0.5f);
}

// Zero deltas alone: a member alone with the others silent still gets its
// chunk final.
TEST_F(OutlierGuardJobTest, ZeroDelta_NeverHeld) {
  MakeJob(Guarded(DType::kFloat32));
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  const uint64_t anchor = Seed(a, Ramp(0.0f, 1.0f));
  SyncCapture ca =
      Send(a, 1, std::vector<float>(kElements, 0.0f), DType::kFloat32, anchor);
  SyncCapture cb =
      Send(b, 1, std::vector<float>(kElements, 0.0f), DType::kFloat32, anchor);
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->state->values, Ramp(0.0f, 1.0f));
}

// An Upstream that keeps what a regional job asks of it; the test answers
// as the link would (Job::UpstreamChunk, Job::CompleteUpstream).
class RecordedUpstream : public Upstream {
 public:
  void Submit(std::weak_ptr<Job> job, UpstreamRequest request) override {
    absl::MutexLock lock(&mu_);
    requests_.push_back(std::move(request));
  }
  void Stop() override {}
  UpstreamStatus Status() const override { return UpstreamStatus(); }
  std::vector<UpstreamRequest> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(requests_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<UpstreamRequest> requests_ ABSL_GUARDED_BY(mu_);
};

// A regional job: a chunk of the upstream round's step that comes before
// the whole answer is final at once and told to the round's members
// (their early result chunks), once; requests it does not answer, spans
// that are not one of its chunks and non-finite steps are ignored. The
// whole answer then commits the state those chunks belong to (a step that
// did not count upstream too, the members' own steps thrown away); one
// whose step differs from a chunk sent early, or the upstream state whole,
// fails the round UNAVAILABLE and commits nothing (the members retry).
TEST_F(PseudoGradientTest, Regional_UpstreamChunkFinalAtOnce_AnswerMustAgree) {
  enum class Answer { kAgrees, kNotCounted, kDiffers, kWhole };
  for (Answer kind : {Answer::kAgrees, Answer::kNotCounted, Answer::kDiffers,
                      Answer::kWhole}) {
    SCOPED_TRACE(static_cast<int>(kind));
    MakeJob(DeltaSettings(DType::kFloat32));
    auto owned = std::make_unique<RecordedUpstream>();
    RecordedUpstream* const up = owned.get();
    job_->SetUpstream(std::move(owned));
    const MemberId a = Join("a");
    const std::vector<float> seed = Ramp(1.0f, 0.25f);
    SyncCapture seeded = Send(a, 0, seed, DType::kFloat32, 0);
    std::vector<UpstreamRequest> asked = up->Take();
    ASSERT_EQ(asked.size(), 1u);
    ASSERT_EQ(asked[0].kind, UpstreamRequest::Kind::kSeed);
    UpstreamAnswer whole;
    whole.values = seed;
    job_->CompleteUpstream(asked[0].serial, whole);
    ASSERT_TRUE(seeded.fired());
    ASSERT_TRUE(seeded.result().ok()) << seeded.result().status();
    const uint64_t anchor = seeded.result()->state_id;

    FinalLog fa;
    SyncCapture ca;
    auto sa = *job_->BeginSync(a, 1, ca.Callback(), {}, anchor, fa.Callback());
    const ChunkGeometry& g = job_->geometry();
    const std::vector<float> delta = Ramp(0.5f, -0.125f);
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      ASSERT_TRUE(sa->AddChunk(c, testing_util::EncodeChunk(delta, g, c,
                                                            DType::kFloat32))
                      .ok());
    }
    asked = up->Take();
    ASSERT_EQ(asked.size(), 1u);
    const UpstreamRequest round = std::move(asked[0]);
    ASSERT_EQ(round.kind, UpstreamRequest::Kind::kRound);
    EXPECT_EQ(round.values, delta) << "the mean of one member's delta";
    // The upstream round's step (other regions gave too).
    std::vector<float> step(kElements);
    for (uint64_t i = 0; i < kElements; ++i) step[i] = 0.5f * delta[i] - 0.25f;
    const absl::Span<const float> all(step);
    const auto chunk1 = all.subspan(g.Offset(1), g.Size(1));
    std::vector<float> nonfinite(chunk1.begin(), chunk1.end());
    nonfinite[2] = std::numeric_limits<float>::infinity();
    job_->UpstreamChunk(round.serial + 1, g.Offset(1), chunk1);
    job_->UpstreamChunk(round.serial, g.Offset(1) + 1,
                        all.subspan(g.Offset(1) + 1, g.Size(1)));
    job_->UpstreamChunk(round.serial, g.Offset(1), all.subspan(g.Offset(1), 2));
    job_->UpstreamChunk(round.serial, g.Offset(1), nonfinite);
    EXPECT_TRUE(fa.told.empty());
    job_->UpstreamChunk(round.serial, g.Offset(1), chunk1);
    job_->UpstreamChunk(round.serial, g.Offset(1), chunk1);
    EXPECT_EQ(fa.told, std::vector<uint32_t>{1}) << "told once";
    ASSERT_NE(fa.next, nullptr);
    EXPECT_EQ(std::memcmp(fa.next->delta.data() +
                              WireBytes(DType::kFloat32, kChunk) * 1,
                          chunk1.data(), chunk1.size() * sizeof(float)),
              0)
        << "the early chunk is the upstream's step";
    EXPECT_FALSE(ca.fired());
    EXPECT_EQ(job_->Status(1).upstream->early_chunks, 1u);

    UpstreamAnswer answer;
    answer.delta = true;
    answer.values = step;
    answer.upstream_round = 7;
    if (kind == Answer::kNotCounted) answer.counted = false;
    if (kind == Answer::kDiffers) answer.values[g.Offset(1) + 3] += 1.0f;
    if (kind == Answer::kWhole) {
      // The upstream state whole (the same values, as a state).
      answer.delta = false;
      for (uint64_t i = 0; i < kElements; ++i) {
        answer.values[i] = seed[i] + step[i];
      }
    }
    job_->CompleteUpstream(round.serial, answer);
    ASSERT_TRUE(ca.fired());
    absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
        job_->GetState(a);
    ASSERT_TRUE(state.ok()) << state.status();
    if (kind == Answer::kAgrees || kind == Answer::kNotCounted) {
      ASSERT_TRUE(ca.result().ok()) << ca.result().status();
      EXPECT_EQ(ca.result()->state, fa.next)
          << "the state the early chunk belongs to";
      EXPECT_TRUE(ca.result()->delta);
      // Not counted upstream: the step all the same, its own thrown away.
      EXPECT_EQ(ca.result()->contributed, kind == Answer::kAgrees);
      for (uint64_t i = 0; i < kElements; ++i) {
        ASSERT_EQ((*state)->values[i], seed[i] + step[i]) << "element " << i;
      }
    } else {
      EXPECT_EQ(ca.result().status().code(), absl::StatusCode::kUnavailable);
      EXPECT_THAT(ca.result().status().message(),
                  HasSubstr(kind == Answer::kDiffers
                                ? "differs at chunk 1 from the step its "
                                  "members got early"
                                : "is the upstream state whole, not the step "
                                  "its members got early"));
      EXPECT_EQ((*state)->values, seed) << "nothing committed";
    }
  }
}

}  // namespace
}  // namespace localsgd
