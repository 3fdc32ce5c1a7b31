// Stale contributions and step accounting in the core: with max_staleness S,
// a delta against a state s <= S rounds old is merged into the open round
// with weight w / (1 + s); beyond S (or against a state the job never
// issued) the member adopts, as without it. Every expectation is computed
// independently in the test from the deltas sent (closed forms for MEAN and
// OUTER_SGD at staleness 0, 1, S and S + 1), with a fake clock driving the
// deadlines that leave a member behind.
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/checkpoint.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/job.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testing_util::MakeFloatLayout;
using testing_util::SyncCapture;

constexpr uint32_t kChunk = 4;
constexpr uint64_t kElements = 10;  // chunks of 4, 4, 2
constexpr absl::Duration kDeadline = absl::Seconds(3);

JobSettings StaleSettings(int32_t max_staleness,
                          AveragingMode mode = AveragingMode::kMean,
                          float lr = 0.5f) {
  JobSettings s;
  s.chunk_elements = kChunk;
  s.wire_dtype = DType::kFloat32;
  s.mode = mode;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.contribution = Contribution::kPseudoGradients;
  s.outer_lr = lr;
  s.outer_momentum = 0.9f;
  s.deadline_mode = DeadlineMode::kFixed;
  s.outlier_ratio = kOutlierGuardOff;
  s.mean_encoding = MeanEncoding::kFloat32;
  s.max_staleness = max_staleness;
  return s;
}

std::vector<float> Filled(float base) {
  std::vector<float> v(kElements);
  for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.25f * i;
  return v;
}

std::vector<float> Values(const SyncResult& r) {
  return std::vector<float>(r.state->values.begin(), r.state->values.end());
}

class StaleContributionTest : public ::testing::Test {
 protected:
  void MakeJob(JobSettings settings) {
    JobPolicy policy;
    policy.round_deadline = kDeadline;
    policy.min_quorum = 1;
    job_ = std::make_shared<Job>("stale", MakeFloatLayout({{"w", {10}}}),
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

  absl::StatusOr<std::unique_ptr<SyncSession>> Begin(
      const MemberId& m, RoundId round, uint64_t anchor, SyncCapture& capture,
      int64_t steps = -1, std::optional<double> weight = std::nullopt) {
    return job_->BeginSync(m, round, capture.Callback(), {}, anchor, nullptr,
                           SyncWork{steps, weight});
  }

  // A whole contribution of `values` (float32) for `round` against `anchor`.
  SyncCapture Send(const MemberId& m, RoundId round,
                   const std::vector<float>& values, uint64_t anchor,
                   int64_t steps = -1,
                   std::optional<double> weight = std::nullopt) {
    SyncCapture capture;
    absl::StatusOr<std::unique_ptr<SyncSession>> session =
        Begin(m, round, anchor, capture, steps, weight);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return capture;
    const ChunkGeometry& g = job_->geometry();
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      const std::string wire =
          testing_util::EncodeChunk(values, g, c, DType::kFloat32);
      const absl::Status s = (*session)->AddChunk(c, wire);
      EXPECT_TRUE(s.ok()) << s;
    }
    sessions_.push_back(*std::move(session));
    return capture;
  }

  uint64_t Seed(const MemberId& m, const std::vector<float>& values) {
    SyncCapture seed = Send(m, 0, values, 0);
    EXPECT_TRUE(seed.result().ok()) << seed.result().status();
    return seed.result().ok() ? seed.result()->state_id : 0;
  }

  // Closes the open round at its deadline (the others time out).
  void PassDeadline() {
    clock_.Advance(kDeadline + absl::Milliseconds(500));
    job_->Tick();
  }

  // `a` alone makes round `round` (the others time out): returns the
  // result it got.
  SyncResult Alone(const MemberId& a, RoundId round,
                   const std::vector<float>& delta, uint64_t anchor) {
    SyncCapture c = Send(a, round, delta, anchor, 16);
    PassDeadline();
    EXPECT_TRUE(c.result().ok()) << c.result().status();
    EXPECT_TRUE(c.result()->contributed);
    return *c.result();
  }

  FakeClock clock_;
  std::shared_ptr<Job> job_;
  std::vector<std::unique_ptr<SyncSession>> sessions_;
};

// Staleness 1 under MEAN: b's delta against the seed goes into round 2 with
// weight 1/2. It is banked: b is answered at once with the job's current
// state (round 1's, whole), and contributes again to round 2 from it, next
// to a's fresh delta; every member ends with the same state: a and b by
// applying the round's delta to their anchor.
TEST_F(StaleContributionTest, Mean_Staleness1_CountsWithHalfWeight) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const std::vector<float> theta0 = Filled(1.0f);
  const uint64_t s0 = Seed(a, theta0);
  const std::vector<float> da1 = Filled(0.5f);
  const SyncResult r1 = Alone(a, 1, da1, s0);
  EXPECT_EQ(r1.round, 1u);

  // b trained from the seed; a from round 1.
  const std::vector<float> db = Filled(3.0f);
  const std::vector<float> da2 = Filled(-1.0f);
  SyncCapture from_b = Send(b, 1, db, s0, 16);
  ASSERT_TRUE(from_b.result().ok()) << "a stale delta is answered at once";
  const SyncResult rb = *from_b.result();
  EXPECT_EQ(rb.round, 1u);
  EXPECT_TRUE(rb.contributed);
  EXPECT_FALSE(rb.late);
  EXPECT_FALSE(rb.delta) << "b holds the seed: it gets the state whole";
  EXPECT_EQ(rb.staleness, 1u);
  EXPECT_EQ(rb.state_id, r1.state_id);
  EXPECT_EQ(Values(rb), std::vector<float>(r1.state->values));
  ASSERT_TRUE(job_->Status(10).round_open);
  // b again, from round 1's state, into the same round 2.
  const std::vector<float> db2 = Filled(-0.75f);
  SyncCapture again_b = Send(b, 2, db2, r1.state_id, 16);
  EXPECT_FALSE(again_b.fired()) << "round 2 waits for a";
  SyncCapture from_a = Send(a, 2, da2, r1.state_id, 16);
  ASSERT_TRUE(from_a.result().ok()) << from_a.result().status();
  ASSERT_TRUE(again_b.result().ok()) << again_b.result().status();

  std::vector<float> expected(kElements);
  for (size_t i = 0; i < kElements; ++i) {
    const float state1 = theta0[i] + da1[i];
    const float mean = (1.0f * da2[i] + 0.5f * db[i] + 1.0f * db2[i]) / 2.5f;
    expected[i] = state1 + mean;
  }
  const SyncResult ra = *from_a.result();
  EXPECT_EQ(ra.round, 2u);
  EXPECT_TRUE(ra.contributed);
  EXPECT_TRUE(ra.delta);
  EXPECT_EQ(ra.staleness, 0u);
  EXPECT_EQ(ra.contributors, 2u) << "b is one contributor";
  EXPECT_DOUBLE_EQ(ra.contributor_weight, 2.5);
  EXPECT_EQ(again_b.result()->state_id, ra.state_id);
  EXPECT_EQ(again_b.result()->staleness, 0u);
  EXPECT_EQ(Values(*again_b.result()), Values(ra));
  const std::vector<float> state = Values(ra);
  for (size_t i = 0; i < kElements; ++i) {
    EXPECT_FLOAT_EQ(state[i], expected[i]) << i;
  }
  // a's anchor plus the round's delta is the state, bit for bit.
  const ChunkGeometry& g = job_->geometry();
  for (uint32_t c = 0; c < g.num_chunks(); ++c) {
    std::vector<float> d(g.Size(c));
    ASSERT_TRUE(DecodeValues(absl::string_view(ra.state->delta)
                                 .substr(WireBytes(DType::kFloat32, kChunk) * c,
                                         WireBytes(DType::kFloat32, g.Size(c))),
                             DType::kFloat32, absl::MakeSpan(d))
                    .ok());
    for (uint32_t k = 0; k < d.size(); ++k) {
      const size_t i = g.Offset(c) + k;
      EXPECT_EQ(r1.state->values[i] + d[k], state[i]) << i;
    }
  }

  const JobStatusSnapshot status = job_->Status(10);
  EXPECT_EQ(status.recent_rounds[0].steps.merged, 48u);
  EXPECT_EQ(status.recent_rounds[0].steps.merged_stale, 16u);
  // Round 1 timed b out before it began: its steps came with round 2.
  EXPECT_EQ(status.steps.merged, 16u + 48u);
  EXPECT_EQ(status.steps.discarded(), 0u);
  EXPECT_DOUBLE_EQ(status.steps.goodput(), 1.0);
}

// A Sync that says its weight (SyncHeader.weight: a member that stands for
// several, a regional coordinator) counts with it instead of its member's:
// fresh, and stale (divided by 1 + s as any weight).
TEST_F(StaleContributionTest, Mean_SyncSaysItsWeight_CountsWithIt) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a", 2), b = Join("b", 1), c = Join("c", 1);
  const std::vector<float> theta0 = Filled(1.0f);
  const uint64_t s0 = Seed(a, theta0);
  // Round 1: a says 3 (its member's weight is 2), b says 0.5; c trains on.
  const std::vector<float> da = Filled(0.5f), db = Filled(-2.0f);
  SyncCapture ra = Send(a, 1, da, s0, 16, 3.0);
  SyncCapture rb = Send(b, 1, db, s0, -1, 0.5);
  PassDeadline();
  ASSERT_TRUE(ra.result().ok()) << ra.result().status();
  EXPECT_DOUBLE_EQ(ra.result()->contributor_weight, 3.5);
  const std::vector<float> state1 = Values(*ra.result());
  for (size_t i = 0; i < kElements; ++i) {
    EXPECT_FLOAT_EQ(state1[i], theta0[i] + (3.0f * da[i] + 0.5f * db[i]) / 3.5f)
        << i;
  }
  EXPECT_EQ(Values(*rb.result()), state1);

  // Round 2: a from round 1's state saying 1, c from the seed (one round
  // stale) saying 3, which counts 3 / 2.
  const uint64_t s1 = ra.result()->state_id;
  const std::vector<float> da2 = Filled(1.0f), dc = Filled(-1.0f);
  SyncCapture rc = Send(c, 1, dc, s0, 16, 3.0);
  ASSERT_TRUE(rc.result().ok()) << "banked: answered at once";
  EXPECT_EQ(rc.result()->staleness, 1u);
  SyncCapture ra2 = Send(a, 2, da2, s1, 16, 1.0);
  PassDeadline();
  ASSERT_TRUE(ra2.result().ok()) << ra2.result().status();
  EXPECT_DOUBLE_EQ(ra2.result()->contributor_weight, 2.5);
  const std::vector<float> state2 = Values(*ra2.result());
  for (size_t i = 0; i < kElements; ++i) {
    EXPECT_FLOAT_EQ(state2[i],
                    state1[i] + (1.0f * da2[i] + 1.5f * dc[i]) / 2.5f)
        << i;
  }
}

// A weight a Sync says outside [1e-6, 1e6], not finite, or on a seed:
// INVALID_ARGUMENT naming it; the round goes on without it.
TEST_F(StaleContributionTest, SyncSaysABadWeight_InvalidArgument) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  for (double w : {0.0, -1.0, 2e6, std::nan("")}) {
    SyncCapture capture;
    auto session = Begin(a, 1, s0, capture, -1, w);
    ASSERT_FALSE(session.ok()) << w;
    EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(session.status().message(),
                HasSubstr("a weight is finite and in [1e-6, 1e6]"));
  }
  SyncCapture seed;
  auto reseed = Begin(b, 0, 0, seed, -1, 2.0);
  ASSERT_FALSE(reseed.ok());
  EXPECT_THAT(reseed.status().message(),
              HasSubstr("only a pseudo-gradient contribution (round >= 1)"));
  EXPECT_FALSE(job_->Status(10).round_open) << "no round opened";
}

// Staleness S (here 2) still merges, with weight 1/3 (banked: b is
// answered at once and the round closes at its deadline without b's next).
TEST_F(StaleContributionTest, Mean_StalenessS_MergesWithWeightOneThird) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const std::vector<float> theta0 = Filled(2.0f);
  const uint64_t s0 = Seed(a, theta0);
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  const SyncResult r2 = Alone(a, 2, Filled(0.25f), r1.state_id);
  const std::vector<float> db = Filled(-2.0f);
  const std::vector<float> da3 = Filled(1.0f);
  SyncCapture from_b = Send(b, 1, db, s0, 8);
  ASSERT_TRUE(from_b.result().ok()) << from_b.result().status();
  EXPECT_EQ(from_b.result()->staleness, 2u);
  EXPECT_TRUE(from_b.result()->contributed);
  EXPECT_EQ(from_b.result()->state_id, r2.state_id);
  SyncCapture from_a = Send(a, 3, da3, r2.state_id, 16);
  EXPECT_FALSE(from_a.fired()) << "b takes part in round 3 again";
  PassDeadline();
  ASSERT_TRUE(from_a.result().ok());
  const std::vector<float> state = Values(*from_a.result());
  for (size_t i = 0; i < kElements; ++i) {
    const float mean = (da3[i] + db[i] / 3.0f) / (1.0f + 1.0f / 3.0f);
    EXPECT_FLOAT_EQ(state[i], r2.state->values[i] + mean) << i;
  }
  EXPECT_NEAR(from_a.result()->contributor_weight, 1.0 + 1.0 / 3.0, 1e-6);
}

// Staleness S + 1: b adopts, as without stale contributions; its steps are
// counted late and no round opens for it.
TEST_F(StaleContributionTest, StalenessBeyondS_Adopts) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  SyncResult r = Alone(a, 1, Filled(0.5f), s0);
  r = Alone(a, 2, Filled(0.5f), r.state_id);
  r = Alone(a, 3, Filled(0.5f), r.state_id);
  SyncCapture from_b = Send(b, 1, Filled(9.0f), s0, 16);
  ASSERT_TRUE(from_b.result().ok());
  EXPECT_TRUE(from_b.result()->late);
  EXPECT_FALSE(from_b.result()->contributed);
  EXPECT_FALSE(from_b.result()->delta);
  EXPECT_EQ(from_b.result()->round, 3u);
  EXPECT_EQ(Values(*from_b.result()), std::vector<float>(r.state->values));
  const JobStatusSnapshot status = job_->Status(10);
  EXPECT_FALSE(status.round_open);
  EXPECT_EQ(status.steps.late, 16u);
  EXPECT_EQ(status.steps.merged, 3u * 16u);
  EXPECT_DOUBLE_EQ(status.steps.goodput(), 48.0 / 64.0);
}

// Off (the default): a delta one round stale adopts, as it always did.
TEST_F(StaleContributionTest, Off_StaleDeltaAdopts) {
  MakeJob(StaleSettings(kMaxStalenessOff));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  SyncCapture from_b = Send(b, 1, Filled(9.0f), s0, 4);
  ASSERT_TRUE(from_b.result().ok());
  EXPECT_TRUE(from_b.result()->late);
  EXPECT_FALSE(from_b.result()->contributed);
  EXPECT_EQ(from_b.result()->state_id, r1.state_id);
  EXPECT_FALSE(job_->Status(10).round_open);
}

// OUTER_SGD at staleness 1: the step is lr times the weighted mean. b's
// stale delta is the last the round waits for: not banked, the round closes
// with it and b gets the new state whole.
TEST_F(StaleContributionTest, OuterSgd_Staleness1_StepsOnWeightedMean) {
  MakeJob(StaleSettings(1, AveragingMode::kOuterSgd, 0.5f));
  const MemberId a = Join("a", 2), b = Join("b", 1);
  const std::vector<float> theta0 = Filled(1.0f);
  const uint64_t s0 = Seed(a, theta0);
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  const std::vector<float> db = Filled(4.0f);
  const std::vector<float> da = Filled(-0.5f);
  SyncCapture from_a = Send(a, 2, da, r1.state_id);
  EXPECT_FALSE(from_a.fired());
  SyncCapture from_b = Send(b, 1, db, s0);
  ASSERT_TRUE(from_a.result().ok());
  ASSERT_TRUE(from_b.result().ok());
  EXPECT_EQ(from_b.result()->round, 2u);
  EXPECT_EQ(from_b.result()->staleness, 1u);
  const std::vector<float> state = Values(*from_a.result());
  for (size_t i = 0; i < kElements; ++i) {
    const float mean = (2.0f * da[i] + 0.5f * db[i]) / 2.5f;
    EXPECT_FLOAT_EQ(state[i], r1.state->values[i] + 0.5f * mean) << i;
  }
  EXPECT_EQ(Values(*from_b.result()), state);
}

// A retry of a stale contribution that was counted is answered as counted
// and merged nowhere again, while its round is open (banked) and after it
// closed; one against an anchor the job never issued adopts.
TEST_F(StaleContributionTest, RetryOfCountedStale_IsNotMergedTwice) {
  MakeJob(StaleSettings(3));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  SyncCapture from_b = Send(b, 1, Filled(2.0f), s0, 16);
  ASSERT_TRUE(from_b.result().ok());
  ASSERT_TRUE(from_b.result()->contributed);
  EXPECT_EQ(from_b.result()->state_id, r1.state_id);
  SyncCapture banked = Send(b, 1, Filled(2.0f), s0, 16);
  ASSERT_TRUE(banked.result().ok());
  EXPECT_TRUE(banked.result()->contributed);
  EXPECT_EQ(banked.result()->state_id, r1.state_id);
  SyncCapture from_a = Send(a, 2, Filled(1.0f), r1.state_id, 16);
  PassDeadline();  // b's next never came
  ASSERT_TRUE(from_a.result().ok());
  EXPECT_EQ(from_a.result()->contributors, 2u);
  const uint64_t s2 = from_a.result()->state_id;

  SyncCapture again = Send(b, 1, Filled(2.0f), s0, 16);
  ASSERT_TRUE(again.result().ok());
  EXPECT_TRUE(again.result()->contributed);
  EXPECT_FALSE(again.result()->late);
  EXPECT_FALSE(again.result()->delta);
  EXPECT_EQ(again.result()->state_id, s2);
  EXPECT_FALSE(job_->Status(10).round_open) << "no round opened for it";

  SyncCapture never = Send(b, 3, Filled(2.0f), 0x1234567890abcdefull, 16);
  ASSERT_TRUE(never.result().ok());
  EXPECT_TRUE(never.result()->late);
  EXPECT_FALSE(never.result()->contributed);
  EXPECT_EQ(never.result()->state_id, s2);
  EXPECT_FALSE(job_->Status(10).round_open);
  // The retry's steps were counted when it was merged, the unknown
  // anchor's are late.
  EXPECT_EQ(job_->Status(10).steps.merged, 16u + 32u);
  EXPECT_EQ(job_->Status(10).steps.late, 16u);
}

// A normal contribution that was counted, retried rounds later against its
// old anchor, is not merged again as a stale one.
TEST_F(StaleContributionTest, RetryOfCountedFreshContribution_IsNotMerged) {
  MakeJob(StaleSettings(3));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  SyncCapture first_a = Send(a, 1, Filled(0.5f), s0);
  SyncCapture first_b = Send(b, 1, Filled(0.5f), s0);
  ASSERT_TRUE(first_b.result().ok());
  ASSERT_TRUE(first_b.result()->contributed);
  const SyncResult r2 = Alone(a, 2, Filled(0.5f), first_a.result()->state_id);
  SyncCapture retry = Send(b, 1, Filled(0.5f), s0);
  ASSERT_TRUE(retry.result().ok());
  EXPECT_TRUE(retry.result()->late);
  EXPECT_EQ(retry.result()->state_id, r2.state_id);
  EXPECT_FALSE(job_->Status(10).round_open);
}

// A member that joins while a stale contribution is in the open round takes
// part from the next one and adopts this one's state; every member then
// holds the same state.
TEST_F(StaleContributionTest, LateJoinerWithStaleInFlight_HoldsTheSameState) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  SyncCapture from_b = Send(b, 1, Filled(3.0f), s0);
  ASSERT_TRUE(from_b.result().ok());
  EXPECT_EQ(from_b.result()->state_id, r1.state_id);
  const MemberId c = Join("c");
  SyncCapture from_c = Send(c, 2, Filled(7.0f), r1.state_id);
  EXPECT_FALSE(from_c.fired());
  SyncCapture from_a = Send(a, 2, Filled(1.0f), r1.state_id);
  EXPECT_FALSE(from_a.fired());
  SyncCapture again_b = Send(b, 2, Filled(-2.0f), r1.state_id);
  ASSERT_TRUE(from_a.result().ok());
  ASSERT_TRUE(again_b.result().ok());
  ASSERT_TRUE(from_c.result().ok());
  EXPECT_EQ(from_a.result()->contributors, 2u);
  EXPECT_DOUBLE_EQ(from_a.result()->contributor_weight, 2.5);
  EXPECT_FALSE(from_c.result()->contributed);
  EXPECT_EQ(from_c.result()->state_id, from_a.result()->state_id);
  EXPECT_EQ(Values(*again_b.result()), Values(*from_a.result()));
  EXPECT_EQ(Values(*from_c.result()), Values(*from_a.result()));
}

// A restart: the checkpoint keeps the ids of the states before its own, so
// a delta against one of them still merges after the restore.
TEST_F(StaleContributionTest, RestoreFromCheckpoint_KeepsTheAncestors) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b");
  const std::vector<float> theta0 = Filled(1.0f);
  const uint64_t s0 = Seed(a, theta0);
  const SyncResult r1 = Alone(a, 1, Filled(0.5f), s0);
  ASSERT_EQ(r1.state->ancestors, std::vector<uint64_t>{s0});

  JobCheckpoint checkpoint;
  checkpoint.job_id = "stale";
  checkpoint.layout = job_->layout();
  checkpoint.settings = job_->settings();
  checkpoint.round = r1.round;
  checkpoint.values = r1.state->values;
  checkpoint.state_id = r1.state_id;
  checkpoint.ancestors = r1.state->ancestors;
  absl::StatusOr<JobCheckpoint> read =
      DecodeCheckpoint(EncodeCheckpoint(checkpoint));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->ancestors, std::vector<uint64_t>{s0});
  EXPECT_EQ(read->settings.max_staleness, 2);

  JobPolicy policy;
  policy.round_deadline = kDeadline;
  job_ = std::make_shared<Job>("stale", read->layout, kElements, read->settings,
                               policy, &clock_);
  job_->RestoreState(read->round, read->values, read->state_id, {}, {}, {},
                     read->ancestors);
  // The restored job regathers for one lease: past it, rounds close as
  // usual.
  clock_.Advance(absl::Seconds(31));
  const MemberId a2 = Join("a"), b2 = Join("b");
  SyncCapture from_b = Send(b2, 1, Filled(2.0f), s0, 16);
  ASSERT_TRUE(from_b.result().ok()) << from_b.result().status();
  SyncCapture from_a = Send(a2, 2, Filled(-1.0f), r1.state_id, 16);
  PassDeadline();
  ASSERT_TRUE(from_a.result().ok());
  EXPECT_TRUE(from_b.result()->contributed);
  EXPECT_EQ(from_b.result()->staleness, 1u);
  EXPECT_EQ(from_a.result()->contributors, 2u);
}

// What a Sync says of its steps: zero is taken and counted as zero, more
// than kMaxLocalSteps is INVALID_ARGUMENT naming the member and the bound,
// and changes nothing.
TEST_F(StaleContributionTest, LocalSteps_ZeroCountsAbsurdIsRefused) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  SyncCapture absurd;
  absl::StatusOr<std::unique_ptr<SyncSession>> refused =
      Begin(a, 1, s0, absurd, int64_t{kMaxLocalSteps} + 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("local_steps"));
  EXPECT_THAT(refused.status().message(), HasSubstr("member a"));
  EXPECT_FALSE(job_->Status(10).round_open);

  SyncCapture zero = Send(a, 1, Filled(0.0f), s0, 0);
  ASSERT_TRUE(zero.result().ok());
  EXPECT_TRUE(zero.result()->contributed);
  EXPECT_EQ(job_->Status(10).steps.merged, 0u);
  EXPECT_DOUBLE_EQ(job_->Status(10).steps.goodput(), 1.0);
}

// A stale contribution that opens a round does not start its deadline: the
// round waits for the members in step, and its deadline counts from the
// first fresh contribution (else the stale member would set the round's
// phase, and the others, arriving after its deadline, would all turn
// stale in turn).
TEST_F(StaleContributionTest, StaleOpensRound_DeadlineCountsFromFreshStart) {
  MakeJob(StaleSettings(2));
  const MemberId a = Join("a"), b = Join("b"), c = Join("c");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  SyncCapture a1 = Send(a, 1, Filled(0.5f), s0);
  PassDeadline();  // round 1: a alone
  ASSERT_TRUE(a1.result().ok());
  job_->Heartbeat(c);
  SyncCapture from_b = Send(b, 1, Filled(2.0f), s0);  // opens round 2
  ASSERT_TRUE(job_->Status(10).round_open);
  ASSERT_TRUE(from_b.result().ok()) << "banked: answered at once";
  EXPECT_TRUE(from_b.result()->contributed);
  EXPECT_EQ(from_b.result()->staleness, 1u);
  EXPECT_EQ(job_->Status(10).open_round_decision.deadline,
            absl::InfiniteFuture());
  PassDeadline();
  job_->Heartbeat(a);
  job_->Heartbeat(b);
  job_->Heartbeat(c);
  EXPECT_TRUE(job_->Status(10).round_open)
      << "no deadline before a fresh contribution";
  SyncCapture from_a = Send(a, 2, Filled(1.0f), a1.result()->state_id);
  EXPECT_FALSE(from_a.fired()) << "b and c are still awaited";
  EXPECT_NE(job_->Status(10).open_round_decision.deadline,
            absl::InfiniteFuture());
  PassDeadline();  // counted from a's start: b and c time out
  ASSERT_TRUE(from_a.result().ok());
  EXPECT_EQ(from_a.result()->contributors, 2u);
  EXPECT_DOUBLE_EQ(from_a.result()->contributor_weight, 1.5);
}

// Adaptive step budgets: the coordinator learns each member's rate from its
// steps and the time since its last result, hands each a budget so that
// both take as long as a member of median speed making K, and weighs each
// contribution by its steps / K.
TEST_F(StaleContributionTest, AdaptiveBudgets_LearnedFromRatesAndWeighed) {
  JobSettings settings = StaleSettings(kMaxStalenessOff);
  settings.local_sgd_steps = 16;
  settings.step_budget = StepBudget::kAdaptive;
  MakeJob(settings);
  const MemberId a = Join("a"), b = Join("b");
  const uint64_t s0 = Seed(a, Filled(1.0f));
  // b adopts the seed at the same time as a got it.
  SyncCapture adopt = Send(b, 0, Filled(0.0f), 0);
  ASSERT_TRUE(adopt.result().ok());
  // a makes 16 steps in 1 s, b 16 steps in 3 s (4 chunks... of a round).
  clock_.Advance(absl::Seconds(1));
  SyncCapture from_a = Send(a, 1, Filled(0.5f), s0, 16);
  clock_.Advance(absl::Seconds(2));
  SyncCapture from_b = Send(b, 1, Filled(0.5f), s0, 16);
  ASSERT_TRUE(from_a.result().ok());
  ASSERT_TRUE(from_b.result().ok());
  // Rates 16/s and 16/3 per s, median 32/3; the window is 16 / (32/3) =
  // 1.5 s: budgets 24 and 8.
  EXPECT_EQ(from_a.result()->local_steps_budget, 24u);
  EXPECT_EQ(from_b.result()->local_steps_budget, 8u);
  const JobStatusSnapshot status = job_->Status(10);
  ASSERT_EQ(status.members.size(), 2u);
  EXPECT_EQ(status.members[0].budget, 24u);
  EXPECT_DOUBLE_EQ(status.members[0].work.steps_per_second(), 16.0);
  EXPECT_EQ(status.members[1].budget, 8u);

  // Round 2 with those budgets: 24 steps weigh 1.5, 8 steps 0.5.
  const std::vector<float> da = Filled(2.0f);
  const std::vector<float> db = Filled(-4.0f);
  clock_.Advance(absl::Milliseconds(1500));
  SyncCapture a2 = Send(a, 2, da, from_a.result()->state_id, 24);
  SyncCapture b2 = Send(b, 2, db, from_b.result()->state_id, 8);
  ASSERT_TRUE(a2.result().ok());
  ASSERT_TRUE(b2.result().ok());
  EXPECT_DOUBLE_EQ(a2.result()->contributor_weight, 2.0);
  const std::vector<float> state = Values(*a2.result());
  const std::vector<float> before = Values(*from_a.result());
  for (size_t i = 0; i < kElements; ++i) {
    const float mean = (1.5f * da[i] + 0.5f * db[i]) / 2.0f;
    EXPECT_FLOAT_EQ(state[i], before[i] + mean) << i;
  }
  EXPECT_EQ(job_->Status(10).steps.merged, 32u + 32u);
}

}  // namespace
}  // namespace localsgd
