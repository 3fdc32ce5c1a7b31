// The pure parts of a round (src/round.h, src/averaging.h) and the settings
// rules (src/settings.h), without a job around them.
#include "src/round.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/averaging.h"
#include "src/codec.h"
#include "src/settings.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kOpened = absl::FromUnixSeconds(1000);

// A participant named `name` of a 2-chunk layout that has delivered
// `received` chunks; `gone` if it left.
Participant P(std::string name, uint32_t received, bool gone = false) {
  Participant p;
  p.name = std::move(name);
  p.got.assign(2, false);
  for (uint32_t i = 0; i < received; ++i) p.got[i] = true;
  p.received = received;
  p.gone = gone;
  return p;
}

Participants Of(std::vector<Participant> list) {
  Participants out;
  int i = 0;
  for (Participant& p : list) {
    out.emplace(MemberId(absl::StrCat(std::string(31, '0'), i++)),
                std::move(p));
  }
  return out;
}

struct CloseCase {
  std::string name;
  std::vector<Participant> participants;
  Gathering gathering;
  CloseRules rules;
  absl::Duration since_open;
  bool close;
  CloseReason reason;
  std::vector<std::string> waiting_for;
  std::string why;  // a substring of why_open when it stays open
};

class DecideCloseTest : public ::testing::TestWithParam<CloseCase> {};

TEST_P(DecideCloseTest, DecidesAsDocumented) {
  const CloseCase& c = GetParam();
  const CloseDecision d = DecideClose(Of(c.participants), kOpened, c.gathering,
                                      c.rules, kOpened + c.since_open);
  EXPECT_EQ(d.close, c.close);
  if (c.close) {
    EXPECT_EQ(d.reason, c.reason) << CloseReasonName(d.reason);
    EXPECT_THAT(d.why_open, IsEmpty());
  } else {
    EXPECT_THAT(d.why_open, HasSubstr(c.why));
  }
  EXPECT_EQ(d.waiting_for, c.waiting_for);
}

CloseRules Deadline(absl::Duration d, uint32_t quorum) {
  return CloseRules{d, quorum};
}

Gathering Rendezvous(uint32_t n) {
  Gathering g;
  g.rendezvous_pending = true;
  g.rendezvous_members = n;
  return g;
}

Gathering Regather(absl::Duration d) {
  Gathering g;
  g.regather_until = kOpened + d;
  return g;
}

INSTANTIATE_TEST_SUITE_P(
    Table, DecideCloseTest,
    ::testing::Values(CloseCase{"AllComplete_Closes",
                                {P("a", 2), P("b", 2)},
                                {},
                                {},
                                absl::ZeroDuration(),
                                true,
                                CloseReason::kComplete,
                                {},
                                ""},
                      CloseCase{"OneMissing_StaysOpenNamingIt",
                                {P("a", 2), P("b", 1)},
                                {},
                                {},
                                absl::Hours(1),
                                false,
                                {},
                                {"b"},
                                "waiting for 1 of 2 participants (b)"},
                      CloseCase{"MissingOneGone_ClosesMembersGone",
                                {P("a", 2), P("b", 1, /*gone=*/true)},
                                {},
                                {},
                                absl::ZeroDuration(),
                                true,
                                CloseReason::kMembersGone,
                                {},
                                ""},
                      CloseCase{"EveryoneGone_ClosesMembersGone",
                                {P("a", 0, true), P("b", 1, true)},
                                {},
                                {},
                                absl::ZeroDuration(),
                                true,
                                CloseReason::kMembersGone,
                                {},
                                ""},
                      CloseCase{"DeadlinePassedWithQuorum_ClosesDeadline",
                                {P("a", 2), P("b", 0), P("c", 1)},
                                {},
                                Deadline(absl::Seconds(10), 1),
                                absl::Seconds(10),
                                true,
                                CloseReason::kDeadline,
                                {"b", "c"},
                                ""},
                      CloseCase{"DeadlineNotYet_StaysOpenSayingUntil",
                                {P("a", 2), P("b", 0)},
                                {},
                                Deadline(absl::Seconds(10), 1),
                                absl::Seconds(9),
                                false,
                                {},
                                {"b"},
                                "deadline 1970-01-01T00:16:50+00:00"},
                      CloseCase{"DeadlinePassedWithoutQuorum_StaysOpen",
                                {P("a", 2), P("b", 0), P("c", 1)},
                                {},
                                Deadline(absl::Seconds(10), 2),
                                absl::Seconds(11),
                                false,
                                {},
                                {"b", "c"},
                                "deadline passed with 1 of 2 complete"},
                      CloseCase{"RendezvousShort_StaysOpenThoughComplete",
                                {P("a", 2), P("b", 2)},
                                Rendezvous(3),
                                {},
                                absl::Hours(1),
                                false,
                                {},
                                {},
                                "gathering: 2 of 3 rendezvous members"},
                      CloseCase{"RendezvousReached_Closes",
                                {P("a", 2), P("b", 2), P("c", 2)},
                                Rendezvous(3),
                                {},
                                absl::ZeroDuration(),
                                true,
                                CloseReason::kComplete,
                                {},
                                ""},
                      CloseCase{
                          "RendezvousShortAtDeadlineWithQuorum_ClosesDeadline",
                          {P("a", 2)},
                          Rendezvous(3),
                          Deadline(absl::Seconds(5), 1),
                          absl::Seconds(5),
                          true,
                          CloseReason::kDeadline,
                          {},
                          ""},
                      CloseCase{"Regathering_StaysOpenUntilTheTtl",
                                {P("a", 2)},
                                Regather(absl::Seconds(30)),
                                {},
                                absl::Seconds(29),
                                false,
                                {},
                                {},
                                "regathering members after a restart"},
                      CloseCase{"RegatherOver_Closes",
                                {P("a", 2)},
                                Regather(absl::Seconds(30)),
                                {},
                                absl::Seconds(30),
                                true,
                                CloseReason::kComplete,
                                {},
                                ""}),
    [](const ::testing::TestParamInfo<CloseCase>& info) {
      return info.param.name;
    });

TEST(GatheringTest, Active_RendezvousOnlyWhilePendingAndShort) {
  const absl::Time now = kOpened;
  EXPECT_FALSE(Gathering().Active(0, now));
  EXPECT_TRUE(Rendezvous(2).Active(1, now));
  EXPECT_FALSE(Rendezvous(2).Active(2, now));
  Gathering done = Rendezvous(2);
  done.rendezvous_pending = false;
  EXPECT_FALSE(done.Active(1, now));
  EXPECT_TRUE(Regather(absl::Seconds(1)).Active(5, now));
  EXPECT_FALSE(Regather(absl::Seconds(1)).Active(5, now + absl::Seconds(1)));
}

// A re-seed's regather (regather_members > 0) ends early once that many are
// back, and at regather_until at the latest.
TEST(GatheringTest, Active_ReseedRegatherEndsWhenTheMembersAreBack) {
  Gathering g = Regather(absl::Seconds(1));
  g.regather_members = 3;
  EXPECT_TRUE(g.Active(1, kOpened));
  EXPECT_TRUE(g.Active(2, kOpened));
  EXPECT_FALSE(g.Active(3, kOpened));
  EXPECT_FALSE(g.Active(1, kOpened + absl::Seconds(1)));
}

// The adaptive deadline's statistics: nothing before kMinLags lags; then
// median + 3 MAD, the MAD floored at 5% of the median; patient twice that;
// the window keeps the last kMaxLags.
TEST(LagHistoryTest, Learn_MedianPlusThreeMadWithFloor_AfterFourLags) {
  ASSERT_EQ(LagHistory::kMinLags, 4u);
  LagHistory h;
  for (int i = 0; i < 3; ++i) h.Add(absl::Seconds(1));
  EXPECT_FALSE(h.Learn().learned());
  h.Add(absl::Seconds(3));  // one slow contribution: the median ignores it
  LearnedDeadline l = h.Learn();
  ASSERT_TRUE(l.learned());
  EXPECT_EQ(l.usual, absl::Milliseconds(1150));  // MAD 0 -> floor 50 ms
  EXPECT_EQ(l.patient, absl::Milliseconds(2300));
  // Spread: 1.0, 1.2, 1.4, 1.6, 1.8, 2.0 s: median (1.4 + 1.6) / 2 = 1.5,
  // deviations 0.5 0.3 0.1 0.1 0.3 0.5 -> MAD 0.3: usual 2.4 s.
  LagHistory spread;
  for (int i = 0; i < 6; ++i) spread.Add(absl::Milliseconds(1000 + 200 * i));
  EXPECT_EQ(spread.Learn().usual, absl::Milliseconds(2400));
  // Old lags leave the window.
  for (size_t i = 0; i < LagHistory::kMaxLags; ++i) {
    spread.Add(absl::Milliseconds(100));
  }
  EXPECT_EQ(spread.size(), LagHistory::kMaxLags);
  EXPECT_EQ(spread.Learn().usual, absl::Milliseconds(115));
}

// With a learned deadline: a round that waits only for persistent
// stragglers closes at `usual`; one that waits for a member usually on time
// at `patient`; never without the quorum, nor while gathering.
TEST(DecideCloseTest, LearnedDeadline_UsualForStragglersPatientOtherwise) {
  LearnedDeadline learned;
  learned.usual = absl::Seconds(1);
  learned.patient = absl::Seconds(2);
  CloseRules rules;
  Participant straggler = P("s", 1);
  straggler.straggler = true;
  const Participants one_straggler = Of({P("a", 2), straggler});
  CloseDecision d = DecideClose(one_straggler, kOpened, Gathering(), rules,
                                kOpened + absl::Milliseconds(999), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Seconds(1));
  EXPECT_THAT(d.why_open, HasSubstr("learned deadline (stragglers)"));
  d = DecideClose(one_straggler, kOpened, Gathering(), rules,
                  kOpened + absl::Seconds(1), learned);
  EXPECT_TRUE(d.close);
  EXPECT_EQ(d.reason, CloseReason::kDeadline);
  // b is usually on time: waited for until `patient`.
  const Participants usual = Of({P("a", 2), P("b", 1), straggler});
  d = DecideClose(usual, kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(1999), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Seconds(2));
  EXPECT_THAT(d.why_open, HasSubstr("learned deadline"));
  EXPECT_TRUE(DecideClose(usual, kOpened, Gathering(), rules,
                          kOpened + absl::Seconds(2), learned)
                  .close);
  // No quorum: open however late.
  rules.min_quorum = 2;
  EXPECT_FALSE(DecideClose(one_straggler, kOpened, Gathering(), rules,
                           kOpened + absl::Hours(1), learned)
                   .close);
  rules.min_quorum = 1;
  // Gathering: open.
  EXPECT_FALSE(DecideClose(one_straggler, kOpened, Rendezvous(3), rules,
                           kOpened + absl::Hours(1), learned)
                   .close);
  // A fixed deadline earlier than the learned one closes first.
  rules.round_deadline = absl::Milliseconds(500);
  d = DecideClose(usual, kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(500), learned);
  EXPECT_TRUE(d.close);
}

// A job that merges stale contributions waits for a participant that has
// not begun only `arrival` (what it misses is merged later, not lost); one
// that has begun (uploading) as before; without stale merging, as before.
// A participant expected later than the round's clock (banked, late) is
// waited for that much longer, by at most `usual`.
TEST(DecideCloseTest, StaleMerged_NotBegunWaitedForOnlyArrival) {
  LearnedDeadline learned;
  learned.usual = absl::Milliseconds(100);
  learned.patient = absl::Milliseconds(200);
  learned.arrival = absl::Milliseconds(30);
  CloseRules rules;
  rules.stale_merged = true;
  Participant idle = P("idle", 0);
  const Participants absent = Of({P("a", 2), idle});
  CloseDecision d = DecideClose(absent, kOpened, Gathering(), rules,
                                kOpened + absl::Milliseconds(29), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Milliseconds(30));
  EXPECT_THAT(d.why_open, HasSubstr("none began"));
  d = DecideClose(absent, kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(30), learned);
  EXPECT_TRUE(d.close);
  EXPECT_EQ(d.reason, CloseReason::kDeadline);
  // Begun: patient.
  Participant uploading = P("up", 0);
  uploading.began_at = kOpened + absl::Milliseconds(5);
  d = DecideClose(Of({P("a", 2), uploading}), kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(199), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Milliseconds(200));
  // The longest wait among those it waits for.
  d = DecideClose(Of({P("a", 2), idle, uploading}), kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(31), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Milliseconds(200));
  // Expected 20 ms after the clock: 20 ms longer; 500 ms after: `usual`
  // longer at most.
  Participant due = P("due", 0);
  due.expected = kOpened + absl::Milliseconds(20);
  EXPECT_EQ(DecideClose(Of({P("a", 2), due}), kOpened, Gathering(), rules,
                        kOpened, learned)
                .deadline,
            kOpened + absl::Milliseconds(50));
  due.expected = kOpened + absl::Milliseconds(500);
  EXPECT_EQ(DecideClose(Of({P("a", 2), due}), kOpened, Gathering(), rules,
                        kOpened, learned)
                .deadline,
            kOpened + absl::Milliseconds(130));
  // An expectation that passed changes nothing.
  due.expected = kOpened - absl::Seconds(5);
  EXPECT_EQ(DecideClose(Of({P("a", 2), due}), kOpened, Gathering(), rules,
                        kOpened, learned)
                .deadline,
            kOpened + absl::Milliseconds(30));
  // Without stale merging: patient for the one that did not begin.
  rules.stale_merged = false;
  d = DecideClose(absent, kOpened, Gathering(), rules,
                  kOpened + absl::Milliseconds(199), learned);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.deadline, kOpened + absl::Milliseconds(200));
}

// The accumulator and the mean rule against an independent computation:
// members i = 0..N-1 with weight i+1 send value i+1 + e/8 for element e; a
// chunk no one contributed to keeps the previous state.
TEST(MeanOfParametersTest, IsWeightedMeanAndKeepsUntouchedChunks) {
  const ChunkGeometry geometry(10, 4);  // chunks of 4, 4, 2
  const std::vector<float> previous(10, -7.0f);
  RoundAccumulator sums(std::vector<float>(3, 99.0f), geometry);
  const int n = 3;
  double total = 0;
  for (int i = 0; i < n; ++i) total += i + 1;
  sums.FitScale(total);
  double want_num[10] = {0};
  for (int i = 0; i < n; ++i) {
    for (uint32_t c = 0; c < 2; ++c) {  // chunk 2: no one
      std::vector<float> values(geometry.Size(c));
      for (uint32_t k = 0; k < values.size(); ++k) {
        const uint64_t e = geometry.Offset(c) + k;
        values[k] = static_cast<float>(i + 1 + e / 8.0);
        want_num[e] += (i + 1) * values[k];
      }
      std::string wire;
      EncodeValues(values, DType::kFloat32, &wire);
      const absl::string_view piece(wire);
      sums.Add(c, absl::MakeConstSpan(&piece, 1), DType::kFloat32,
               static_cast<float>(i + 1));
    }
  }
  EXPECT_EQ(sums.chunk_weight(0), total);
  EXPECT_EQ(sums.chunk_weight(2), 0);
  const std::vector<float> next = MeanOfParameters(std::move(sums), previous);
  ASSERT_EQ(next.size(), 10u);
  for (int e = 0; e < 8; ++e) {
    EXPECT_NEAR(next[e], want_num[e] / total, 1e-6) << "element " << e;
  }
  EXPECT_EQ(next[8], -7.0f);
  EXPECT_EQ(next[9], -7.0f);
}

// Weights whose sum exceeds 1 are scaled by a power of two, so that values
// near the fp32 limit do not overflow while they are summed.
TEST(MeanOfParametersTest, LargeValuesDoNotOverflow) {
  const ChunkGeometry geometry(2, 2);
  RoundAccumulator sums({}, geometry);
  sums.FitScale(3.0);
  const std::vector<float> values = {3e38f, -3e38f};
  std::string wire;
  EncodeValues(values, DType::kFloat32, &wire);
  const absl::string_view piece(wire);
  for (int i = 0; i < 3; ++i) {
    sums.Add(0, absl::MakeConstSpan(&piece, 1), DType::kFloat32, 1.0f);
  }
  const std::vector<float> next =
      MeanOfParameters(std::move(sums), std::vector<float>(2, 0.0f));
  EXPECT_FLOAT_EQ(next[0], 3e38f);
  EXPECT_FLOAT_EQ(next[1], -3e38f);
}

JobSettings RuleSettings(AveragingMode mode, float lr = 0, float mu = 0) {
  JobSettings s;
  s.mode = mode;
  s.outer_lr = lr;
  s.outer_momentum = mu;
  return s;
}

TEST(MakeAveragingRuleTest, EveryModeHasARule_Unspecified_IsInvalidArgument) {
  for (const auto& [mode, name] :
       std::vector<std::pair<AveragingMode, std::string>>{
           {AveragingMode::kMean, "mean"},
           {AveragingMode::kOuterNesterov, "outer_nesterov"},
           {AveragingMode::kOuterSgd, "outer_sgd"}}) {
    absl::StatusOr<std::unique_ptr<AveragingRule>> rule =
        MakeAveragingRule(RuleSettings(mode, 0.7f, 0.9f));
    ASSERT_TRUE(rule.ok()) << name;
    EXPECT_EQ((*rule)->name(), name);
    EXPECT_EQ(AveragingModeName(mode), name);
  }
  EXPECT_EQ(MakeAveragingRule(RuleSettings(AveragingMode::kUnspecified))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AveragingRuleTest, Mean_StepIsTheMeanDelta) {
  std::unique_ptr<AveragingRule> rule =
      *MakeAveragingRule(RuleSettings(AveragingMode::kMean));
  std::vector<float> mean = {1.5f, -2.0f, 0.0f};
  rule->Step(absl::MakeSpan(mean), {}, {});
  EXPECT_EQ(mean, (std::vector<float>{1.5f, -2.0f, 0.0f}));
  EXPECT_FALSE(rule->has_momentum());
}

// torch.optim.SGD(lr, momentum=mu, nesterov=True) on g = -mean, written
// out independently in double for several steps: b_1 = g_1, b_t = mu
// b_{t-1} + g_t, step_t = -lr (g_t + mu b_t).
TEST(AveragingRuleTest, OuterNesterov_MatchesTorchSgdNesterovOverRounds) {
  const float lr = 0.7f, mu = 0.9f;
  std::unique_ptr<AveragingRule> rule =
      *MakeAveragingRule(RuleSettings(AveragingMode::kOuterNesterov, lr, mu));
  ASSERT_TRUE(rule->has_momentum());
  const int n = 5;
  std::vector<float> momentum(n, 0.0f);
  std::vector<double> b(n, 0.0);
  for (int t = 1; t <= 6; ++t) {
    std::vector<float> mean(n);
    for (int i = 0; i < n; ++i) mean[i] = 0.01f * (i - 2) * t + 0.003f * t * t;
    std::vector<double> want(n);
    for (int i = 0; i < n; ++i) {
      const double g = -static_cast<double>(mean[i]);
      b[i] = t == 1 ? g : mu * b[i] + g;
      want[i] = -lr * (g + mu * b[i]);
    }
    rule->Step(absl::MakeSpan(mean), momentum, absl::MakeSpan(momentum));
    for (int i = 0; i < n; ++i) {
      EXPECT_NEAR(mean[i], want[i], 1e-6 * (1 + std::fabs(want[i])))
          << "round " << t << " element " << i;
      EXPECT_NEAR(momentum[i], b[i], 1e-6 * (1 + std::fabs(b[i])));
    }
  }
}

TEST(AveragingRuleTest, OuterSgd_StepIsLrTimesMean) {
  std::unique_ptr<AveragingRule> rule =
      *MakeAveragingRule(RuleSettings(AveragingMode::kOuterSgd, 0.5f));
  std::vector<float> mean = {2.0f, -1.0f};
  rule->Step(absl::MakeSpan(mean), {}, {});
  EXPECT_EQ(mean, (std::vector<float>{1.0f, -0.5f}));
}

JobSettings Complete() {
  JobSettings s;
  s.local_sgd_steps = 16;
  s.chunk_elements = 1024;
  s.wire_dtype = DType::kFloat32;
  s.mode = AveragingMode::kMean;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.contribution = Contribution::kParameters;
  s.deadline_mode = DeadlineMode::kFixed;
  s.mean_encoding = MeanEncoding::kFloat32;
  s.max_staleness = kMaxStalenessOff;
  s.step_budget = StepBudget::kFixed;
  return s;
}

// The combinations a job cannot run with, each named.
TEST(SettingsTest, ValidateComplete_PseudoGradientOnlySettings) {
  SettingsLimits limits;
  JobSettings s = Complete();
  s.wire_dtype = DType::kInt8Block;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("wire dtype int8 needs contribution pseudo_gradients"));
  s = Complete();
  s.mode = AveragingMode::kOuterNesterov;
  s.outer_lr = 0.7f;
  s.outer_momentum = 0.9f;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("outer_nesterov needs contribution pseudo_gradients"));
  s.contribution = Contribution::kPseudoGradients;
  s.wire_dtype = DType::kInt4Block;
  EXPECT_TRUE(ValidateComplete(s, limits, "").ok());
  s.outer_momentum = 0;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("needs an outer_momentum"));
  s.mode = AveragingMode::kOuterSgd;
  s.outer_lr = 0;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("outer_sgd needs an outer_lr"));
  s = Complete();
  s.mean_encoding = MeanEncoding::kWire;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("mean encoding wire needs contribution "
                        "pseudo_gradients"));
  s.contribution = Contribution::kPseudoGradients;
  EXPECT_TRUE(ValidateComplete(s, limits, "").ok());
  s.mean_encoding = MeanEncoding::kUnspecified;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("mean encoding must be float32 or wire"));
  s.mean_encoding = static_cast<MeanEncoding>(5);
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("mean encoding 5 is not supported"));
  s = Complete();
  s.contribution = Contribution::kUnspecified;
  EXPECT_THAT(ValidateComplete(s, limits, "").message(),
              HasSubstr("contribution must be"));
}

TEST(SettingsTest, ValidateSetFields_OuterHyperParametersInRange) {
  SettingsLimits limits;
  for (float lr : {-1.0f, 101.0f, std::nanf("")}) {
    JobSettings s;
    s.outer_lr = lr;
    EXPECT_THAT(ValidateSetFields(s, limits).message(), HasSubstr("outer_lr"))
        << lr;
  }
  for (float mu : {-0.5f, 1.0f, std::nanf("")}) {
    JobSettings s;
    s.outer_momentum = mu;
    EXPECT_THAT(ValidateSetFields(s, limits).message(),
                HasSubstr("outer_momentum"))
        << mu;
  }
  JobSettings s;
  s.contribution = static_cast<Contribution>(7);
  EXPECT_EQ(ValidateSetFields(s, limits).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SettingsTest, WithDefaults_TakesOnlyTheFieldsTheRequestSets) {
  JobSettings asked;
  asked.chunk_elements = 7;
  asked.wire_dtype = DType::kBFloat16;
  const JobSettings s = WithDefaults(asked, Complete());
  EXPECT_EQ(s.local_sgd_steps, 16u);
  EXPECT_EQ(s.chunk_elements, 7u);
  EXPECT_EQ(s.wire_dtype, DType::kBFloat16);
  EXPECT_EQ(s.mode, AveragingMode::kMean);
  EXPECT_EQ(s.nonfinite_policy, NonFinitePolicy::kReject);
  EXPECT_EQ(s.rendezvous_members, 0u);
}

TEST(SettingsTest, FirstDifference_EmptyForNoPreferenceOrEqual) {
  EXPECT_EQ(FirstDifference(Complete(), JobSettings()), "");
  EXPECT_EQ(FirstDifference(Complete(), Complete()), "");
}

TEST(SettingsTest, FirstDifference_NamesEachFieldThatDiffers) {
  struct Case {
    void (*change)(JobSettings&);
    std::string says;
  };
  const Case cases[] = {
      {[](JobSettings& s) { s.local_sgd_steps = 8; },
       "syncs every 16 steps; member asks for 8"},
      {[](JobSettings& s) { s.chunk_elements = 9; },
       "uses chunks of 1024 elements; member asks for 9"},
      {[](JobSettings& s) { s.wire_dtype = DType::kBFloat16; },
       "uses wire dtype float32; member asks for bfloat16"},
      {[](JobSettings& s) { s.rendezvous_members = 3; },
       "starts with 0 members; member asks for 3"},
      {[](JobSettings& s) { s.nonfinite_policy = NonFinitePolicy::kDrop; },
       "treats non-finite values with policy 'reject'; member asks for "
       "'drop'"},
  };
  for (const Case& c : cases) {
    JobSettings asked;
    c.change(asked);
    EXPECT_EQ(FirstDifference(Complete(), asked), c.says);
  }
}

TEST(SettingsTest, ValidateSetFields_RefusesWhatTheLimitsDoNotAllow) {
  SettingsLimits limits;
  limits.max_chunk_elements = 100;
  limits.max_members = 4;
  EXPECT_TRUE(ValidateSetFields(JobSettings(), limits).ok());
  JobSettings s;
  s.chunk_elements = 101;
  EXPECT_THAT(ValidateSetFields(s, limits).message(),
              HasSubstr("chunk_elements 101 exceeds the coordinator's limit"));
  s = JobSettings();
  s.wire_dtype = DType::kFloat64;
  EXPECT_THAT(ValidateSetFields(s, limits).message(),
              HasSubstr("wire dtype float64 is not supported"));
  s = JobSettings();
  s.rendezvous_members = 5;
  EXPECT_THAT(ValidateSetFields(s, limits).message(),
              HasSubstr("rendezvous_members 5 exceeds"));
  s = JobSettings();
  s.mode = static_cast<AveragingMode>(9);
  EXPECT_EQ(ValidateSetFields(s, limits).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SettingsTest, ValidateComplete_NeedsEveryFieldWithoutADefaultMeaning) {
  SettingsLimits limits;
  EXPECT_TRUE(ValidateComplete(Complete(), limits, "").ok());
  JobSettings s = Complete();
  s.chunk_elements = 0;
  EXPECT_THAT(ValidateComplete(s, limits, "default ").message(),
              HasSubstr("default chunk_elements must be in [1, "));
  s = Complete();
  s.wire_dtype = DType::kUnspecified;
  EXPECT_EQ(ValidateComplete(s, limits, "").code(),
            absl::StatusCode::kInvalidArgument);
  s = Complete();
  s.nonfinite_policy = NonFinitePolicy::kUnspecified;
  EXPECT_EQ(ValidateComplete(s, limits, "").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace localsgd
