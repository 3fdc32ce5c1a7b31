// The status records (src/job_status.h) on their own: the round history,
// what a member is told of a closed round, the status snapshot's parts and
// the log line of a commit. Times come from a fake clock.
#include "src/job_status.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/observer.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

MemberId Id(int i) { return MemberId(absl::StrCat(std::string(31, '0'), i)); }

RoundRecord Record(RoundId round, std::vector<int> contributors = {},
                   CloseReason reason = CloseReason::kComplete) {
  RoundRecord r;
  r.round = round;
  r.reason = reason;
  for (int i : contributors) {
    r.contributors.push_back(absl::StrCat("m", i));
    r.contributor_ids.insert(Id(i));
    r.contributor_weight += i;
  }
  return r;
}

std::shared_ptr<const StateSnapshot> State(RoundId round, uint64_t id,
                                           uint64_t previous_id = 0) {
  auto s = std::make_shared<StateSnapshot>();
  s->round = round;
  s->id = id;
  s->previous_id = previous_id;
  return s;
}

std::vector<RoundId> Rounds(const std::vector<RoundRecord>& records) {
  std::vector<RoundId> out;
  for (const RoundRecord& r : records) out.push_back(r.round);
  return out;
}

TEST(RoundHistoryTest, KeepsTheMostRecentFirstUpToItsLimit) {
  RoundHistory history(3);
  for (RoundId r = 1; r <= 5; ++r) history.Add(Record(r));
  EXPECT_THAT(Rounds(history.Recent(10)), ElementsAre(5, 4, 3));
  EXPECT_THAT(Rounds(history.Recent(2)), ElementsAre(5, 4));
  EXPECT_EQ(history.Find(2), nullptr);
  ASSERT_NE(history.Find(3), nullptr);
  EXPECT_EQ(history.Find(3)->round, 3u);
}

TEST(RoundHistoryTest, MarkLate_OnceAndSorted) {
  RoundHistory history(10);
  history.Add(Record(1));
  history.MarkLate(1, "c");
  history.MarkLate(1, "a");
  history.MarkLate(1, "c");
  history.MarkLate(9, "x");  // not kept: nothing
  EXPECT_THAT(history.Find(1)->late, ElementsAre("a", "c"));
}

TEST(CommittedResultTest, ContributorNotLate_OthersLateUnlessRefusedOrSeed) {
  const RoundRecord round = Record(4, {1, 2});
  std::shared_ptr<const StateSnapshot> state = State(4, 99, /*previous=*/98);
  const SyncResult a = CommittedResult(round, state, Id(1), false);
  EXPECT_EQ(a.round, 4u);
  EXPECT_TRUE(a.contributed);
  EXPECT_FALSE(a.late);
  EXPECT_EQ(a.contributors, 2u);
  EXPECT_EQ(a.contributor_weight, 3.0);
  EXPECT_EQ(a.state_id, 99u);
  EXPECT_EQ(a.state, state);
  EXPECT_TRUE(a.delta);  // the state has a delta
  EXPECT_TRUE(CommittedResult(round, state, Id(3), false).late);
  EXPECT_FALSE(CommittedResult(round, state, Id(3), /*refused=*/true).late);
  const RoundRecord seed = Record(0, {1}, CloseReason::kSeed);
  const SyncResult adopt = CommittedResult(seed, State(0, 5), Id(3), false);
  EXPECT_FALSE(adopt.late);
  EXPECT_FALSE(adopt.delta);
}

TEST(LatestResultTest, DeltaOnlyForARetryOfTheLastRoundFromItsAnchor) {
  RoundHistory history(10);
  history.Add(Record(6, {1}));
  std::shared_ptr<const StateSnapshot> state = State(6, 60, /*previous=*/50);
  const SyncResult retry = LatestResult(history, state, Id(1), 6, 50);
  EXPECT_TRUE(retry.delta);
  EXPECT_TRUE(retry.contributed);
  EXPECT_FALSE(retry.late);
  EXPECT_EQ(retry.contributors, 1u);
  EXPECT_EQ(retry.round, 6u);
  EXPECT_EQ(retry.state_id, 60u);
  EXPECT_FALSE(LatestResult(history, state, Id(1), 6, 49).delta);
  EXPECT_FALSE(LatestResult(history, state, Id(1), 5, 50).delta);
  // Someone else is late; asking for the seed is not late.
  const SyncResult other = LatestResult(history, state, Id(2), 5, 40);
  EXPECT_FALSE(other.contributed);
  EXPECT_TRUE(other.late);
  EXPECT_FALSE(LatestResult(history, state, Id(2), 0, 0).late);
}

TEST(LatestResultTest, ContributorOfTheLatestRoundAskingAnother_IsLate) {
  RoundHistory history(10);
  history.Add(Record(6, {1}));
  std::shared_ptr<const StateSnapshot> state = State(6, 60, /*previous=*/50);
  // An older round, and the next round against another anchor: neither
  // contribution was averaged, whatever the member did in round 6.
  for (const RoundId asked : {RoundId{5}, RoundId{7}}) {
    const SyncResult r = LatestResult(history, state, Id(1), asked, 40);
    EXPECT_FALSE(r.contributed) << asked;
    EXPECT_TRUE(r.late) << asked;
    EXPECT_EQ(r.round, 6u) << asked;
    EXPECT_EQ(r.contributors, 1u) << asked;
  }
}

TEST(LatestResultTest, RoundNoLongerKept_CountsNothing) {
  RoundHistory history(10);
  const SyncResult r = LatestResult(history, State(6, 60), Id(1), 6, 0);
  EXPECT_FALSE(r.contributed);
  EXPECT_EQ(r.contributors, 0u);
  EXPECT_TRUE(r.late);
}

TEST(DescribeOpenRoundTest, NamesSortedAndTheDecision) {
  FakeClock clock;
  const ChunkGeometry geometry(4, 4);
  RoundState round(8, clock.Now(), geometry, {}, false, false);
  for (int i : {2, 0, 1}) {
    MemberInfo m;
    m.id = Id(i);
    m.name = absl::StrCat("m", i);
    round.AddParticipant(m);
  }
  round.FitScale();
  std::string wire;
  EncodeValues(std::vector<float>(4, 1.0f), DType::kFloat32, &wire);
  const absl::string_view piece(wire);
  for (int i : {2, 1}) {
    round.Add(Id(i), 0, absl::MakeConstSpan(&piece, 1), DType::kFloat32,
              clock.Now());
  }
  CloseDecision decision;
  decision.why_open = "waiting";
  JobStatusSnapshot s;
  DescribeOpenRound(round, decision, s);
  EXPECT_TRUE(s.round_open);
  EXPECT_EQ(s.open_round, 8u);
  EXPECT_THAT(s.open_round_participants, ElementsAre("m0", "m1", "m2"));
  EXPECT_THAT(s.open_round_contributed, ElementsAre("m1", "m2"));
  EXPECT_EQ(s.open_round_decision.why_open, "waiting");
}

TEST(StragglersTest, MembersAtTheMissLimit) {
  std::vector<MemberInfo> members(3);
  members[0].name = "a";
  members[0].missed_rounds = kStragglerMisses;
  members[1].name = "b";
  members[1].missed_rounds = kStragglerMisses - 1;
  members[2].name = "c";
  members[2].missed_rounds = kStragglerMisses;
  EXPECT_THAT(Stragglers(members), ElementsAre("a", "c"));
  EXPECT_THAT(Stragglers({}), IsEmpty());
}

TEST(DescribeCommitTest, SeedsAndRounds) {
  EXPECT_EQ(DescribeCommit(Record(0, {1}, CloseReason::kSeed)), "seeded by m1");
  EXPECT_EQ(DescribeCommit(Record(12, {1}, CloseReason::kSeed)),
            "seeded by m1 at round 12");
  RoundRecord r = Record(3, {1, 2}, CloseReason::kDeadline);
  FakeClock clock;
  r.opened = clock.Now();
  r.closed = r.opened + absl::Milliseconds(1500);
  EXPECT_EQ(DescribeCommit(r),
            "round 3 closed (deadline) in 1.5s; contributors [m1, m2]");
  r.dropped = {"m3"};
  r.timed_out = {"m4", "m5"};
  EXPECT_EQ(DescribeCommit(r),
            "round 3 closed (deadline) in 1.5s; contributors [m1, m2]; "
            "dropped [m3]; timed out [m4, m5]");
}

TEST(ClosedEventTest, CountsTheRecord) {
  RoundRecord r = Record(3, {1, 2}, CloseReason::kMembersGone);
  FakeClock clock;
  r.opened = clock.Now();
  r.closed = r.opened + absl::Seconds(4);
  r.participants = {"m1", "m2", "m3", "m4", "m5"};
  r.dropped = {"m3"};
  r.timed_out = {"m4", "m5"};
  const RoundClosedEvent e = ClosedEvent("job-1", r);
  EXPECT_EQ(e.job_id, "job-1");
  EXPECT_EQ(e.round, 3u);
  EXPECT_EQ(e.reason, CloseReason::kMembersGone);
  EXPECT_EQ(e.duration, absl::Seconds(4));
  EXPECT_EQ(e.participants, 5u);
  EXPECT_EQ(e.contributors, 2u);
  EXPECT_EQ(e.dropped, 1u);
  EXPECT_EQ(e.timed_out, 2u);
}

}  // namespace
}  // namespace localsgd
