// Membership (src/membership.h) on its own: joins, retries, replacement,
// credentials, leases and missed rounds, driven by a fake clock. No sleeps.
#include "src/membership.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/round.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr absl::Duration kTtl = absl::Seconds(30);

JoinRequestParams Params(std::string name, uint64_t incarnation = 1,
                         double weight = 1, std::string principal = "") {
  JoinRequestParams p;
  p.member_name = std::move(name);
  p.incarnation = incarnation;
  p.weight = weight;
  p.principal = std::move(principal);
  return p;
}

class MembershipTest : public ::testing::Test {
 protected:
  // Adds `name` taking part from round 1; its id.
  MemberId Add(const std::string& name, uint64_t incarnation = 1,
               double weight = 1) {
    absl::StatusOr<const MemberInfo*> m =
        members_.Add(Params(name, incarnation, weight), 1, clock_.Now());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? (*m)->id : MemberId();
  }

  FakeClock clock_;
  Membership members_{"job-1", kTtl, /*max_members=*/3, clock_.Now()};
};

TEST_F(MembershipTest, Add_FillsTheMemberAndAFreshId) {
  absl::StatusOr<const MemberInfo*> m =
      members_.Add(Params("a", 7, 2.5, "alice"), 4, clock_.Now());
  ASSERT_TRUE(m.ok()) << m.status();
  const MemberInfo& info = **m;
  EXPECT_EQ(info.name, "a");
  EXPECT_EQ(info.incarnation, 7u);
  EXPECT_EQ(info.weight, 2.5);
  EXPECT_EQ(info.principal, "alice");
  EXPECT_EQ(info.first_round, 4u);
  EXPECT_EQ(info.joined_at, clock_.Now());
  EXPECT_EQ(info.last_seen, clock_.Now());
  EXPECT_EQ(info.missed_rounds, 0u);
  EXPECT_TRUE(MemberId::IsWellFormed(info.id.str()));  // 128 random bits in hex
  // `info` points into the table: the next Add may move it.
  const MemberId first = info.id;
  EXPECT_NE(Add("b"), first);
  EXPECT_EQ(members_.size(), 2u);
}

TEST_F(MembershipTest, Add_EmptyName_NamedByReferenceNotById) {
  absl::StatusOr<const MemberInfo*> m =
      members_.Add(Params(""), 1, clock_.Now());
  ASSERT_TRUE(m.ok());
  EXPECT_THAT((*m)->name, HasSubstr("member-"));
  EXPECT_THAT((*m)->name, ::testing::Not(HasSubstr((*m)->id.str())));
}

TEST_F(MembershipTest, Add_AtMaxMembers_ReturnsResourceExhausted) {
  Add("a");
  Add("b");
  Add("c");
  absl::StatusOr<const MemberInfo*> m =
      members_.Add(Params("d"), 1, clock_.Now());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(m.status().message(), HasSubstr("has 3 members"));
  EXPECT_EQ(members_.size(), 3u);
}

TEST_F(MembershipTest, FindJoined_SameNameAndIncarnation_IsARetryThatRenews) {
  const MemberId a = Add("a");
  clock_.Advance(absl::Seconds(20));
  absl::StatusOr<Membership::Found> found =
      members_.FindJoined(Params("a"), clock_.Now());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->retried, a);
  EXPECT_TRUE(found->replaced.empty());
  EXPECT_EQ(members_.Get(a)->last_seen, clock_.Now());
}

TEST_F(MembershipTest, FindJoined_NewIncarnation_NamesTheMemberToReplace) {
  const MemberId a = Add("a", 1);
  absl::StatusOr<Membership::Found> found =
      members_.FindJoined(Params("a", 2), clock_.Now());
  ASSERT_TRUE(found.ok());
  EXPECT_TRUE(found->retried.empty());
  EXPECT_EQ(found->replaced, a);
  EXPECT_EQ(members_.size(), 1u);  // the caller removes it
}

TEST_F(MembershipTest, FindJoined_UnknownOrEmptyName_FindsNothing) {
  Add("a");
  for (const char* name : {"b", ""}) {
    absl::StatusOr<Membership::Found> found =
        members_.FindJoined(Params(name), clock_.Now());
    ASSERT_TRUE(found.ok());
    EXPECT_TRUE(found->retried.empty());
    EXPECT_TRUE(found->replaced.empty());
  }
}

TEST_F(MembershipTest, FindJoined_OtherWeight_ReturnsFailedPrecondition) {
  Add("a", 1, 1.0);
  absl::StatusOr<Membership::Found> found =
      members_.FindJoined(Params("a", 1, 2.0), clock_.Now());
  EXPECT_EQ(found.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(found.status().message(), HasSubstr("weight is fixed"));
}

TEST_F(MembershipTest, FindJoined_OtherCredentials_ReturnsPermissionDenied) {
  ASSERT_TRUE(members_.Add(Params("a", 1, 1, "alice"), 1, clock_.Now()).ok());
  // Neither a retry nor a new incarnation may take the name over.
  for (uint64_t incarnation : {1, 2}) {
    absl::StatusOr<Membership::Found> found = members_.FindJoined(
        Params("a", incarnation, 1, "mallory"), clock_.Now());
    EXPECT_EQ(found.status().code(), absl::StatusCode::kPermissionDenied);
  }
}

TEST_F(MembershipTest, CheckPrincipal_OtherCredentialsOnly_AreDenied) {
  absl::StatusOr<const MemberInfo*> m =
      members_.Add(Params("a", 1, 1, "alice"), 1, clock_.Now());
  ASSERT_TRUE(m.ok());
  const MemberId a = (*m)->id;
  EXPECT_TRUE(members_.CheckPrincipal(a, "alice").ok());
  EXPECT_EQ(members_.CheckPrincipal(a, "mallory").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(members_.CheckPrincipal(MemberId("unknown"), "x").ok());
}

TEST_F(MembershipTest, Renew_WithinTheLease_MovesItsEnd) {
  const MemberId a = Add("a");
  // Renewed at 29 s, the lease runs to 59 s: alive at 58, gone at 60.
  clock_.Advance(absl::Seconds(29));
  ASSERT_NE(members_.Renew(a, clock_.Now()), nullptr);
  clock_.Advance(absl::Seconds(29));
  EXPECT_THAT(members_.Expired(clock_.Now()), IsEmpty());
  clock_.Advance(absl::Seconds(2));
  EXPECT_THAT(members_.Expired(clock_.Now()), ElementsAre(a));
  EXPECT_EQ(members_.Renew(a, clock_.Now()), nullptr);
  // Not removed until the caller says so.
  EXPECT_NE(members_.Get(a), nullptr);
}

TEST_F(MembershipTest, Expired_ExactlyAtTheTtl_StillHoldsTheLease) {
  const MemberId a = Add("a");
  clock_.Advance(kTtl);
  EXPECT_THAT(members_.Expired(clock_.Now()), IsEmpty());
  EXPECT_NE(members_.Renew(a, clock_.Now()), nullptr);
}

TEST_F(MembershipTest, Remove_LastMember_StartsTheEmptyPeriod) {
  const MemberId a = Add("a");
  const MemberId b = Add("b");
  EXPECT_FALSE(members_.EmptyFor(clock_.Now(), absl::ZeroDuration()));
  clock_.Advance(absl::Seconds(10));
  EXPECT_TRUE(members_.Remove(a, "left", clock_.Now()));
  EXPECT_FALSE(members_.Remove(a, "left", clock_.Now()));
  clock_.Advance(absl::Seconds(10));
  EXPECT_TRUE(members_.Remove(b, "left", clock_.Now()));
  const absl::Time empty = clock_.Now();
  clock_.Advance(absl::Seconds(5));
  EXPECT_TRUE(members_.EmptyFor(clock_.Now(), clock_.Now() - empty));
  EXPECT_FALSE(members_.EmptyFor(clock_.Now(),
                                 clock_.Now() - empty + absl::Nanoseconds(1)));
  EXPECT_EQ(members_.NotFound(a).code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, EmptyFor_NoMemberEver_CountsFromCreation) {
  const absl::Time created = clock_.Now();
  clock_.Advance(absl::Minutes(3));
  EXPECT_TRUE(members_.EmptyFor(clock_.Now(), absl::Minutes(3)));
  members_.ResetEmptySince(clock_.Now());
  EXPECT_FALSE(members_.EmptyFor(clock_.Now(), clock_.Now() - created));
}

TEST_F(MembershipTest, TakingPartIn_MembersWhoseFirstRoundHasCome) {
  ASSERT_TRUE(members_.Add(Params("a"), 1, clock_.Now()).ok());
  ASSERT_TRUE(members_.Add(Params("b"), 5, clock_.Now()).ok());
  auto names = [&](RoundId round) {
    std::vector<std::string> out;
    for (const MemberInfo* m : members_.TakingPartIn(round)) {
      out.push_back(m->name);
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  EXPECT_THAT(names(4), ElementsAre("a"));
  EXPECT_THAT(names(5), ElementsAre("a", "b"));
}

TEST_F(MembershipTest, CountRound_MissesSaturateAndContributionsPayBack) {
  const MemberId a = Add("a");
  // Misses count up to kStragglerMisses and no further.
  for (uint32_t i = 0; i < kStragglerMisses + 3; ++i) {
    members_.CountRound(a, /*contributed=*/false);
  }
  EXPECT_EQ(members_.Get(a)->missed_rounds, kStragglerMisses);
  // Each contribution takes one off, down to zero.
  members_.CountRound(a, /*contributed=*/true);
  EXPECT_EQ(members_.Get(a)->missed_rounds, kStragglerMisses - 1);
  for (uint32_t i = 0; i < kStragglerMisses + 3; ++i) {
    members_.CountRound(a, /*contributed=*/true);
  }
  EXPECT_EQ(members_.Get(a)->missed_rounds, 0u);
  members_.CountRound(MemberId("unknown"), false);  // skipped
}

TEST_F(MembershipTest, SortedByName_IsSorted) {
  Add("c");
  Add("a");
  Add("b");
  std::vector<std::string> names;
  for (const MemberInfo& m : members_.SortedByName()) names.push_back(m.name);
  EXPECT_THAT(names, ElementsAre("a", "b", "c"));
}

}  // namespace
}  // namespace localsgd
