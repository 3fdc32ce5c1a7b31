// The client's rejoin policy (client/rejoin_policy.h) as a table: what the
// coordinator said, what the member holds, what it does.
#include "client/rejoin_policy.h"

#include <string>

#include "gtest/gtest.h"

namespace localsgd {
namespace {

TEST(SyncNeedsRejoinTest, OnlyWhatJoiningAgainMends) {
  struct Row {
    absl::Status status;
    bool rejoin;
  };
  const Row rows[] = {
      {absl::NotFoundError("member is not in job"), true},
      {absl::FailedPreconditionError("job has no global state"), true},
      {absl::FailedPreconditionError("job is at round 3"), true},
      {absl::OkStatus(), false},
      {absl::UnavailableError("draining"), false},
      {absl::InvalidArgumentError("bad chunk"), false},
      {absl::PermissionDeniedError("other credentials"), false},
      {absl::ResourceExhaustedError("too many streams"), false},
      {absl::DataLossError("corrupt chunk"), false},
      {absl::InternalError("malformed response"), false},
  };
  for (const Row& row : rows) {
    EXPECT_EQ(SyncNeedsRejoin(row.status), row.rejoin) << row.status;
  }
}

TEST(DecideRejoinTest, Table) {
  struct Row {
    std::string what;
    bool has_state;
    RoundId job_round;
    RoundId trained_from;
    bool pseudo_gradients;
    RejoinAction action;
    RoundId round;
  };
  const Row rows[] = {
      {"coordinator restarted without state: re-seed", false, 0, 7, false,
       RejoinAction::kReseedThenContribute, 0},
      {"job lost before the first round", false, 0, 0, false,
       RejoinAction::kReseedThenContribute, 0},
      {"lease lost, job where the member left it: contribute", true, 7, 7,
       false, RejoinAction::kContribute, 8},
      {"parameters, restored from an older checkpoint: contribute to its "
       "next round",
       true, 5, 7, false, RejoinAction::kContribute, 6},
      {"parameters, restored at the seed", true, 0, 7, false,
       RejoinAction::kContribute, 1},
      {"the round it was syncing closed (a failover after the close): ask "
       "for it again",
       true, 8, 7, false, RejoinAction::kContribute, 8},
      {"missed two rounds: adopt", true, 9, 7, false, RejoinAction::kAdopt, 0},
      {"missed many rounds: adopt", true, 100, 7, false, RejoinAction::kAdopt,
       0},
      {"deltas, lease lost: contribute", true, 7, 7, true,
       RejoinAction::kContribute, 8},
      {"deltas, job behind the anchor: offer the anchor as a newer re-seed",
       true, 6, 7, true, RejoinAction::kReseedThenContribute, 0},
      {"deltas, the round it was syncing closed: ask for it again", true, 8, 7,
       true, RejoinAction::kContribute, 8},
      {"deltas, missed two rounds: adopt", true, 9, 7, true,
       RejoinAction::kAdopt, 0},
  };
  for (const Row& row : rows) {
    const RejoinDecision d = DecideRejoin(
        row.has_state, row.job_round, row.trained_from, row.pseudo_gradients);
    EXPECT_EQ(d.action, row.action) << row.what;
    EXPECT_EQ(d.round, row.round) << row.what;
  }
}

}  // namespace
}  // namespace localsgd
