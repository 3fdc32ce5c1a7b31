// OutlierGuard alone (src/outlier_guard.h): its verdicts, its cold start,
// what it keeps and forgets. The guard in a job: pseudo_gradient_test.cc
// (OutlierGuardJobTest).
#include "src/outlier_guard.h"

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

MemberId Id(char c) { return MemberId(std::string(32, c)); }

void HoldOne(OutlierGuard& g, uint32_t c, char member, double norm) {
  const absl::string_view bytes = "abcd";
  g.Hold(c, Id(member), absl::MakeConstSpan(&bytes, 1), norm);
}

TEST(OutlierGuardTest, Off_AcceptsEverythingKeepsNothing) {
  OutlierGuard g(2, kOutlierGuardOff);
  EXPECT_FALSE(g.enabled());
  std::string why;
  EXPECT_EQ(g.Judge(0, 1e30, &why), OutlierGuard::Verdict::kAccept);
  EXPECT_EQ(g.Center(0), 0);
}

TEST(OutlierGuardTest, ColdStart_HoldsThenJudgesTheFirstThreeTogether) {
  OutlierGuard g(2, 10);
  std::string why;
  EXPECT_EQ(g.Judge(1, 1e6, &why), OutlierGuard::Verdict::kHold);
  HoldOne(g, 1, 'a', 1e6);
  EXPECT_FALSE(g.Due(1));
  HoldOne(g, 1, 'b', 1.0);
  EXPECT_FALSE(g.Due(1));
  EXPECT_TRUE(g.Holds(1, Id('a')));
  EXPECT_FALSE(g.Holds(0, Id('a')));
  HoldOne(g, 1, 'c', 2.0);
  EXPECT_TRUE(g.Due(1));
  EXPECT_EQ(g.held_bytes(), 12u);
  const std::vector<OutlierGuard::Judged> judged = g.Release(1);
  ASSERT_EQ(judged.size(), 3u);
  EXPECT_EQ(judged[0].member, Id('a'));
  EXPECT_FALSE(judged[0].accepted);
  EXPECT_THAT(judged[0].why, HasSubstr("chunk 1 has an L2 norm of 1e+06"));
  EXPECT_THAT(judged[0].why, HasSubstr("the median 2 of 3"));
  EXPECT_TRUE(judged[1].accepted);
  EXPECT_TRUE(judged[2].accepted);
  EXPECT_EQ(judged[1].bytes, "abcd");
  EXPECT_FALSE(g.any_held());
  EXPECT_EQ(g.held_bytes(), 0u);
  // Only the accepted norms are kept: the center is theirs (1 and 2).
  EXPECT_EQ(g.known(1), 2u);
  EXPECT_EQ(g.Center(1), 1.5);
  // Still cold (two known): the next one is held.
  EXPECT_EQ(g.Judge(1, 1.0, &why), OutlierGuard::Verdict::kHold);
  EXPECT_EQ(g.known(0), 0u);
}

TEST(OutlierGuardTest, Warm_JudgesAgainstTheMedianOfRecentAccepted) {
  OutlierGuard g(1, 4);
  for (double n : {1.0, 2.0, 3.0}) g.Accept(0, n);
  std::string why;
  EXPECT_EQ(g.Judge(0, 8.0, &why), OutlierGuard::Verdict::kAccept);
  EXPECT_EQ(g.Judge(0, 8.5, &why), OutlierGuard::Verdict::kReject);
  EXPECT_THAT(why, HasSubstr("4.25 times the median 2 of 3 recent"));
  EXPECT_THAT(why, HasSubstr("refuses more than 4 times"));
  // A zero norm: accepted, not kept.
  EXPECT_EQ(g.Judge(0, 0.0, &why), OutlierGuard::Verdict::kAccept);
  g.Accept(0, 0.0);
  EXPECT_EQ(g.known(0), 3u);
  // The ring keeps the last kHistory: old small norms roll out.
  for (size_t i = 0; i < OutlierGuard::kHistory; ++i) g.Accept(0, 100.0);
  EXPECT_EQ(g.known(0), OutlierGuard::kHistory);
  EXPECT_EQ(g.Center(0), 100.0);
}

TEST(OutlierGuardTest, Forget_DropsOnlyThatMembersHeld) {
  OutlierGuard g(3, 10);
  HoldOne(g, 0, 'a', 1);
  HoldOne(g, 2, 'a', 1);
  HoldOne(g, 2, 'b', 1);
  g.Forget(Id('a'));
  EXPECT_EQ(g.HeldChunks(), std::vector<uint32_t>{2});
  EXPECT_TRUE(g.Holds(2, Id('b')));
  EXPECT_EQ(g.held_bytes(), 4u);
}

TEST(OutlierGuardTest, DropHeld_KeepsTheNorms) {
  OutlierGuard g(2, 10);
  g.Accept(1, 2.0);
  HoldOne(g, 0, 'a', 1);
  HoldOne(g, 1, 'b', 1);
  g.DropHeld();
  EXPECT_FALSE(g.any_held());
  EXPECT_EQ(g.held_bytes(), 0u);
  EXPECT_EQ(g.known(1), 1u);
}

TEST(OutlierGuardTest, RoundClosed_ForgetsOnlyWhenMostWereRefused) {
  OutlierGuard g(1, 10);
  for (double n : {1.0, 1.0, 1.0}) g.Accept(0, n);
  HoldOne(g, 0, 'a', 1);
  EXPECT_FALSE(g.RoundClosed(/*refused=*/1, /*counted=*/1));
  EXPECT_FALSE(g.any_held());
  EXPECT_EQ(g.known(0), 3u);
  EXPECT_TRUE(g.RoundClosed(/*refused=*/2, /*counted=*/1));
  EXPECT_EQ(g.known(0), 0u);
}

}  // namespace
}  // namespace localsgd
