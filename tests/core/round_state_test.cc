// RoundState and RoundPacing (src/round_state.h) on their own: who takes
// part, per-chunk finality, the record of a close, the rendezvous, the
// regather and the learned deadline, driven by a fake clock. No sleeps.
#include "src/round_state.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

const ChunkGeometry kGeometry(10, 4);  // chunks of 4, 4, 2 elements

MemberInfo Member(int i, double weight = 1, uint32_t missed = 0) {
  MemberInfo m;
  m.id = MemberId(absl::StrCat(std::string(31, '0'), i));
  m.name = absl::StrCat("m", i);
  m.weight = weight;
  m.missed_rounds = missed;
  return m;
}

// Chunk `c` of kGeometry filled with `value`, as float32 wire bytes.
std::string Chunk(uint32_t c, float value) {
  std::string wire;
  EncodeValues(std::vector<float>(kGeometry.Size(c), value), DType::kFloat32,
               &wire);
  return wire;
}

class RoundStateTest : public ::testing::Test {
 protected:
  // Round 3 opened now with members 0..n-1 (weight i+1).
  RoundState Open(int n, bool finality = true, bool adaptive = false) {
    RoundState round(3, clock_.Now(), kGeometry, {}, finality, adaptive);
    for (int i = 0; i < n; ++i) round.AddParticipant(Member(i, i + 1));
    round.FitScale();
    return round;
  }
  RoundState::Added Give(RoundState& round, int i, uint32_t c,
                         float value = 1) {
    const std::string wire = Chunk(c, value);
    const absl::string_view piece(wire);
    return round.Add(Member(i).id, c, absl::MakeConstSpan(&piece, 1),
                     DType::kFloat32, clock_.Now());
  }

  FakeClock clock_;
};

TEST_F(RoundStateTest, Add_CountsEachChunkOnceAndCompletesOnTheLast) {
  RoundState round = Open(2);
  EXPECT_EQ(Give(round, 0, 0), RoundState::Added::kAdded);
  EXPECT_EQ(Give(round, 0, 0), RoundState::Added::kIgnored);  // again
  EXPECT_EQ(Give(round, 7, 0), RoundState::Added::kIgnored);  // not in it
  EXPECT_EQ(Give(round, 0, 1), RoundState::Added::kAdded);
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(Give(round, 0, 2), RoundState::Added::kCompleted);
  const Participant* p = round.Find(Member(0).id);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->complete());
  EXPECT_EQ(p->completed, clock_.Now());
  // The sums are the weighted values: member 0 has weight 1 of 3 in all.
  EXPECT_EQ(round.sums().chunk_weight(0), 1.0);
}

TEST_F(RoundStateTest, MarkGone_OnlyAnIncompleteParticipant) {
  RoundState round = Open(3);
  for (uint32_t c = 0; c < 3; ++c) Give(round, 0, c);
  EXPECT_FALSE(round.MarkGone(Member(0).id));  // complete
  EXPECT_FALSE(round.MarkGone(Member(9).id));  // not in it
  EXPECT_TRUE(round.MarkGone(Member(1).id, "a non-finite value"));
  EXPECT_TRUE(round.MarkGone(Member(1).id));  // gone already
  EXPECT_TRUE(round.Find(Member(1).id)->gone);
  EXPECT_TRUE(round.Find(Member(1).id)->nonfinite);  // stays refused
  // A gone participant gives nothing more.
  EXPECT_EQ(Give(round, 1, 0), RoundState::Added::kIgnored);
}

TEST_F(RoundStateTest, ChunkGiven_OnceEveryParticipantNotGoneGaveIt) {
  RoundState round = Open(3);
  Give(round, 0, 0);
  Give(round, 1, 0);
  EXPECT_FALSE(round.ChunkGiven(0));
  Give(round, 2, 0);
  EXPECT_TRUE(round.ChunkGiven(0));
  // Chunk 1: given by 0 only; once 1 and 2 are gone it is given.
  Give(round, 0, 1);
  round.MarkGone(Member(1).id);
  EXPECT_FALSE(round.ChunkGiven(1));
  round.MarkGone(Member(2).id);
  EXPECT_TRUE(round.ChunkGiven(1));
  // Chunk 2: no one gave it; never given by the departures alone.
  EXPECT_FALSE(round.ChunkGiven(2));
}

TEST_F(RoundStateTest, ChunkReady_HeldWhileGathering) {
  RoundState round = Open(1);
  Give(round, 0, 0);
  EXPECT_FALSE(round.ChunkReady(0, /*gathering=*/true));
  EXPECT_TRUE(round.held());
  EXPECT_FALSE(round.ChunkReady(1, /*gathering=*/false));  // not given
  EXPECT_TRUE(round.ChunkReady(0, /*gathering=*/false));
  round.MarkFinal(0);
  EXPECT_FALSE(round.ChunkReady(0, false));  // final already
  EXPECT_EQ(round.num_final(), 1u);
}

TEST_F(RoundStateTest, ReadyChunks_AllGivenNotFinal_UnlessGathering) {
  RoundState round = Open(1);
  Give(round, 0, 0);
  Give(round, 0, 2);
  EXPECT_THAT(round.ReadyChunks(/*gathering=*/true), IsEmpty());
  EXPECT_TRUE(round.held());
  EXPECT_THAT(round.ReadyChunks(/*gathering=*/false), ElementsAre(0, 2));
  EXPECT_FALSE(round.held());
  round.MarkFinal(0);
  round.MarkFinal(2);
  EXPECT_THAT(round.ReadyChunks(false), IsEmpty());
  EXPECT_THAT(round.FinalChunks(), ElementsAre(0, 2));
  EXPECT_THAT(round.PendingChunks(), ElementsAre(1));
}

TEST_F(RoundStateTest, WithoutFinality_NoChunkIsEverReady) {
  RoundState round = Open(1, /*finality=*/false);
  for (uint32_t c = 0; c < 3; ++c) Give(round, 0, c);
  EXPECT_FALSE(round.ChunkGiven(0));
  EXPECT_FALSE(round.ChunkReady(0, false));
  EXPECT_THAT(round.ReadyChunks(false), IsEmpty());
  EXPECT_FALSE(round.held());
  EXPECT_THAT(round.FinalChunks(), IsEmpty());
}

TEST_F(RoundStateTest, Close_RecordsEveryParticipantOnceSorted) {
  // m0, m1 complete; m2 gone; m3 dropped for a non-finite value; m4 timed
  // out. Weights i+1: the contributors weigh 1 + 2.
  RoundState round = Open(5, true, /*adaptive=*/true);
  const absl::Time opened = clock_.Now();
  for (int i : {1, 0}) {
    clock_.Advance(absl::Seconds(i + 1));
    for (uint32_t c = 0; c < 3; ++c) Give(round, i, c);
  }
  round.MarkGone(Member(2).id);
  round.MarkGone(Member(3).id, "a non-finite value");
  Give(round, 4, 0);
  clock_.Advance(absl::Seconds(10));
  const RoundClosure closure =
      round.Close(CloseReason::kDeadline, clock_.Now());
  const RoundRecord& r = closure.record;
  EXPECT_EQ(r.round, 3u);
  EXPECT_EQ(r.reason, CloseReason::kDeadline);
  EXPECT_EQ(r.opened, opened);
  EXPECT_EQ(r.closed, opened + absl::Seconds(13));
  EXPECT_THAT(r.participants, ElementsAre("m0", "m1", "m2", "m3", "m4"));
  EXPECT_THAT(r.contributors, ElementsAre("m0", "m1"));
  EXPECT_THAT(r.dropped, ElementsAre("m2", "m3"));
  EXPECT_THAT(r.timed_out, ElementsAre("m4"));
  EXPECT_THAT(r.rejected, ElementsAre("m3: a non-finite value"));
  EXPECT_EQ(r.contributor_weight, 3.0);
  EXPECT_THAT(r.contributor_ids,
              UnorderedElementsAre(Member(0).id, Member(1).id));
  EXPECT_THAT(closure.contributed,
              UnorderedElementsAre(Member(0).id, Member(1).id));
  EXPECT_THAT(closure.timed_out, ElementsAre(Member(4).id));
  EXPECT_THAT(closure.refused, UnorderedElementsAre(Member(3).id));
  // m1 completed 2 s after the opening, m0 2 + 1 s.
  EXPECT_THAT(closure.lags, UnorderedElementsAre(Pair("m1", absl::Seconds(2)),
                                                 Pair("m0", absl::Seconds(3))));
}

// Banking a stale contribution: its sums stay and count with its weight at
// the close, its slot is fresh (it may give every chunk again, and chunks
// wait for it), and only a complete stale contribution, once, before any
// chunk is final, is banked.
TEST_F(RoundStateTest, Bank_KeepsTheSumsAndFreesTheSlot) {
  RoundState round = Open(2);  // m0 weight 1, m1 weight 2
  const MemberInfo m1 = Member(1, 2);
  EXPECT_FALSE(round.Bank(m1)) << "nothing given";
  ASSERT_TRUE(round.BeginContribution(m1.id, 16, /*anchor=*/77,
                                      /*staleness=*/1, 1.0, clock_.Now()));
  Give(round, 1, 0, 4.0f);
  EXPECT_FALSE(round.Bank(m1)) << "incomplete";
  Give(round, 1, 1, 4.0f);
  EXPECT_EQ(Give(round, 1, 2, 4.0f), RoundState::Added::kCompleted);
  EXPECT_FALSE(round.Bank(Member(0, 1))) << "not stale";
  ASSERT_TRUE(round.Bank(m1));
  EXPECT_TRUE(round.Banked(m1.id, 77));
  EXPECT_FALSE(round.Banked(m1.id, 78));
  EXPECT_EQ(round.num_banked(), 1u);
  const Participant* fresh = round.Find(m1.id);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->received, 0u);
  EXPECT_FALSE(fresh->began());
  EXPECT_FLOAT_EQ(fresh->weight, 2.0f);
  EXPECT_FALSE(round.ChunkGiven(0)) << "m1's fresh slot has not given it";
  // m1 fresh (weight 2) and m0 (weight 1) give every chunk: the sums hold
  // 1 * 4 (banked, 2 / (1 + 1)) + 2 * 1 + 1 * 7.
  ASSERT_TRUE(round.BeginContribution(m1.id, 16, 0, 0, 1.0, clock_.Now()));
  for (uint32_t c = 0; c < 3; ++c) Give(round, 1, c, 1.0f);
  EXPECT_FALSE(round.ChunkGiven(0));
  for (uint32_t c = 0; c < 3; ++c) Give(round, 0, c, 7.0f);
  EXPECT_TRUE(round.ChunkGiven(0));
  EXPECT_DOUBLE_EQ(round.sums().chunk_weight(0), 4.0);
  const double scaled_weight = round.sums().scaled_weight(0);
  for (float v : round.sums().scaled_sums(0)) {
    EXPECT_NEAR(v / scaled_weight, (4.0 + 2.0 + 7.0) / 4.0, 1e-6);
  }
  const RoundClosure closure =
      round.Close(CloseReason::kComplete, clock_.Now());
  EXPECT_THAT(closure.record.contributors, ElementsAre("m0", "m1"));
  EXPECT_DOUBLE_EQ(closure.record.contributor_weight, 4.0);
  EXPECT_EQ(closure.record.steps.merged, 32u);
  EXPECT_EQ(closure.record.steps.merged_stale, 16u);
  ASSERT_EQ(closure.stale.size(), 1u);
  EXPECT_EQ(closure.stale[0].anchor, 77u);
  EXPECT_TRUE(closure.stale[0].counted);
}

TEST_F(RoundStateTest, Bank_OnceAndNeverAfterAChunkIsFinal) {
  RoundState round = Open(3);
  for (int i : {1, 2}) {
    ASSERT_TRUE(
        round.BeginContribution(Member(i).id, 4, 50 + i, 1, 1.0, clock_.Now()));
  }
  for (uint32_t c = 0; c < 3; ++c) Give(round, 1, c);
  ASSERT_TRUE(round.Bank(Member(1, 2)));
  ASSERT_TRUE(
      round.BeginContribution(Member(1).id, 4, 60, 1, 1.0, clock_.Now()));
  for (uint32_t c = 0; c < 3; ++c) Give(round, 1, c);
  EXPECT_FALSE(round.Bank(Member(1, 2))) << "one banked per member";
  // Chunk 0 final from the sums: m2 can no longer be banked.
  Give(round, 0, 0);
  for (uint32_t c = 0; c < 3; ++c) Give(round, 2, c);
  ASSERT_TRUE(round.ChunkReady(0, false));
  round.MarkFinal(0);
  EXPECT_FALSE(round.Bank(Member(2, 3)));
}

TEST_F(RoundStateTest, Close_NotAdaptive_NoLags) {
  RoundState round = Open(1);
  for (uint32_t c = 0; c < 3; ++c) Give(round, 0, c);
  EXPECT_THAT(round.Close(CloseReason::kComplete, clock_.Now()).lags,
              IsEmpty());
}

TEST_F(RoundStateTest, AddParticipant_StragglerOnlyWhenAdaptive) {
  for (bool adaptive : {false, true}) {
    RoundState round(1, clock_.Now(), kGeometry, {}, false, adaptive);
    round.AddParticipant(Member(0, 1, kStragglerMisses));
    round.AddParticipant(Member(1, 1, kStragglerMisses - 1));
    EXPECT_EQ(round.Find(Member(0).id)->straggler, adaptive);
    EXPECT_FALSE(round.Find(Member(1).id)->straggler);
  }
}

// --- RoundPacing

RoundClosure ClosureOf(size_t participants,
                       std::vector<absl::Duration> lags = {}) {
  RoundClosure closure;
  for (size_t i = 0; i < participants; ++i) {
    closure.record.participants.push_back(absl::StrCat("m", i));
  }
  for (absl::Duration lag : lags) closure.lags.emplace_back("m", lag);
  return closure;
}

class RoundPacingTest : public RoundStateTest {};

TEST_F(RoundPacingTest, Rendezvous_GathersUntilARoundHadNParticipants) {
  RoundPacing pacing("job-1", /*rendezvous_members=*/3, false, CloseRules{});
  RoundState round = Open(2);
  EXPECT_TRUE(pacing.gathering().rendezvous_pending);
  EXPECT_TRUE(pacing.Gathers(round, clock_.Now()));
  pacing.Closed(ClosureOf(2));
  EXPECT_TRUE(pacing.gathering().rendezvous_pending);
  pacing.Closed(ClosureOf(3));
  EXPECT_FALSE(pacing.gathering().rendezvous_pending);
  EXPECT_FALSE(pacing.Gathers(round, clock_.Now()));
}

TEST_F(RoundPacingTest, NoRendezvous_ForOneMember) {
  RoundPacing pacing("job-1", 1, false, CloseRules{});
  EXPECT_FALSE(pacing.gathering().rendezvous_pending);
}

TEST_F(RoundPacingTest, Restored_RegathersForTheGivenTime) {
  RoundPacing pacing("job-1", 4, false, CloseRules{});
  const absl::Time until = clock_.Now() + absl::Seconds(30);
  pacing.Restored(/*round=*/7, until, /*members=*/0);
  EXPECT_FALSE(pacing.gathering().rendezvous_pending);  // round > 0
  RoundState round = Open(1);
  EXPECT_TRUE(pacing.Gathers(round, clock_.Now()));
  clock_.Advance(absl::Seconds(30));
  EXPECT_FALSE(pacing.Gathers(round, clock_.Now()));
  // A restore of the seed (round 0) leaves the rendezvous pending.
  RoundPacing seed("job-1", 4, false, CloseRules{});
  seed.Restored(0, until, 0);
  EXPECT_TRUE(seed.gathering().rendezvous_pending);
}

TEST_F(RoundPacingTest, Reseeded_RegathersUntilMembersBackOrItsRoundCloses) {
  RoundPacing pacing("job-1", 4, false, CloseRules{});
  pacing.Reseeded(clock_.Now() + absl::Minutes(1), /*members=*/2);
  EXPECT_FALSE(pacing.gathering().rendezvous_pending);
  EXPECT_TRUE(pacing.Gathers(Open(1), clock_.Now()));
  EXPECT_FALSE(pacing.Gathers(Open(2), clock_.Now()));  // both are back
  pacing.Closed(ClosureOf(1));
  EXPECT_EQ(pacing.gathering().regather_until, absl::InfinitePast());
  EXPECT_EQ(pacing.gathering().regather_members, 0u);
  EXPECT_FALSE(pacing.Gathers(Open(1), clock_.Now()));
}

TEST_F(RoundPacingTest, Closed_AfterARestore_KeepsTheRegather) {
  RoundPacing pacing("job-1", 1, false, CloseRules{});
  const absl::Time until = clock_.Now() + absl::Seconds(30);
  pacing.Restored(5, until, 0);
  pacing.Closed(ClosureOf(1));
  EXPECT_EQ(pacing.gathering().regather_until, until);
}

// A checkpoint that says how many took part in its round (3): the restored
// job regathers until that many are back, or until the lease passes.
TEST_F(RoundPacingTest, Restored_WithParticipants_RegathersUntilTheyAreBack) {
  RoundPacing pacing("job-1", 1, false, CloseRules{});
  const absl::Time until = clock_.Now() + absl::Seconds(30);
  pacing.Restored(5, until, /*members=*/3);
  EXPECT_TRUE(pacing.Gathers(Open(2), clock_.Now()));
  EXPECT_FALSE(pacing.Gathers(Open(3), clock_.Now()));
  clock_.Advance(absl::Seconds(30));
  EXPECT_FALSE(pacing.Gathers(Open(2), clock_.Now()));
  pacing.Closed(ClosureOf(2));
  EXPECT_EQ(pacing.gathering().regather_members, 0u);
  EXPECT_EQ(pacing.gathering().regather_until, absl::InfinitePast());
}

// Equal lags L teach median L, MAD floored at max(L/20, 1 ms): usual =
// L + 3 * max(L/20, 1 ms), patient twice that; from LagHistory::kMinLags on.
TEST_F(RoundPacingTest, Closed_Adaptive_LearnsFromTheLags) {
  RoundPacing pacing("job-1", 1, /*adaptive=*/true, CloseRules{});
  const absl::Duration lag = absl::Seconds(2);
  pacing.Closed(ClosureOf(3, {lag, lag, lag}));
  EXPECT_FALSE(pacing.learned().learned());
  pacing.Closed(ClosureOf(1, {lag}));
  ASSERT_TRUE(pacing.learned().learned());
  EXPECT_EQ(pacing.learned().usual, lag + 3 * (lag / 20));
  EXPECT_EQ(pacing.learned().patient, 2 * (lag + 3 * (lag / 20)));
}

TEST_F(RoundPacingTest, Closed_NotAdaptive_LearnsNothing) {
  RoundPacing pacing("job-1", 1, false, CloseRules{});
  const absl::Duration lag = absl::Seconds(2);
  pacing.Closed(ClosureOf(4, {lag, lag, lag, lag}));
  EXPECT_FALSE(pacing.learned().learned());
}

TEST_F(RoundPacingTest, Decide_IsDecideCloseWithTheJobsRules) {
  RoundPacing pacing("job-1", 1, false,
                     CloseRules{absl::Seconds(10), /*min_quorum=*/1});
  RoundState round = Open(2);
  for (uint32_t c = 0; c < 3; ++c) Give(round, 0, c);
  CloseDecision d = pacing.Decide(round, clock_.Now());
  EXPECT_FALSE(d.close);
  EXPECT_THAT(d.waiting_for, ElementsAre("m1"));
  EXPECT_EQ(d.deadline, round.opened() + absl::Seconds(10));
  EXPECT_THAT(d.why_open, HasSubstr("waiting for 1 of 2 participants (m1)"));
  clock_.Advance(absl::Seconds(10));
  d = pacing.Decide(round, clock_.Now());
  EXPECT_TRUE(d.close);
  EXPECT_EQ(d.reason, CloseReason::kDeadline);
}

}  // namespace
}  // namespace localsgd
