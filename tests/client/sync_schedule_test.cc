// LocalSGD's schedule (client/sync_schedule.h) against its documented
// table, row by row; tests/python/test_schedule.py checks the Python
// binding against the same rows.
#include "client/sync_schedule.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace localsgd {
namespace {

struct Row {
  bool overlap, node_group, due, in_flight, ready;
  StepAction action;
};

// The table of sync_schedule.h, every combination spelled out.
std::vector<Row> Table() {
  using A = StepAction;
  std::vector<Row> rows;
  for (bool node_group : {false, true}) {
    for (bool in_flight : {false, true}) {
      for (bool ready : {false, true}) {
        rows.push_back({false, node_group, false, in_flight, ready, A::kNone});
        rows.push_back({false, node_group, true, in_flight, ready, A::kSync});
        rows.push_back({true, true, false, in_flight, ready, A::kNone});
        rows.push_back({true, true, true, in_flight, ready, A::kNodeSyncPoint});
      }
    }
  }
  rows.push_back({true, false, false, false, false, A::kNone});
  rows.push_back({true, false, false, false, true, A::kNone});
  rows.push_back({true, false, false, true, false, A::kNone});
  rows.push_back({true, false, false, true, true, A::kMerge});
  rows.push_back({true, false, true, false, false, A::kStart});
  rows.push_back({true, false, true, false, true, A::kStart});
  rows.push_back({true, false, true, true, false, A::kMergeThenStart});
  rows.push_back({true, false, true, true, true, A::kMergeThenStart});
  return rows;
}

TEST(SyncScheduleTest, DecideStep_FollowsTheTable) {
  for (uint64_t k : {1, 4, 16}) {
    for (const Row& row : Table()) {
      // A due step (a multiple of K) and, for K > 1, one that is not.
      if (!row.due && k == 1) continue;
      StepState state;
      state.local_sgd_steps = k;
      state.steps = row.due ? 3 * k : 3 * k + 1;
      state.overlap = row.overlap;
      state.node_group = row.node_group;
      state.in_flight = row.in_flight;
      state.ready = row.ready;
      EXPECT_EQ(DecideStep(state), row.action)
          << "k=" << k << " overlap=" << row.overlap
          << " node_group=" << row.node_group << " due=" << row.due
          << " in_flight=" << row.in_flight << " ready=" << row.ready;
    }
  }
}

TEST(SyncScheduleTest, EveryKthStepSyncs_ExactlySo) {
  StepState state;
  state.local_sgd_steps = 8;
  int syncs = 0;
  for (state.steps = 1; state.steps <= 64; ++state.steps) {
    if (DecideStep(state) == StepAction::kSync) {
      ++syncs;
      EXPECT_EQ(state.steps % 8, 0u);
    }
  }
  EXPECT_EQ(syncs, 8);
}

// With a budget from the coordinator a member syncs once it made that many
// steps since its last contribution, K or not; node groups keep K.
TEST(SyncScheduleTest, BudgetReplacesKOutsideNodeGroups) {
  StepState state;
  state.local_sgd_steps = 8;
  state.budget = 3;
  int syncs = 0;
  state.since_sync = 0;
  for (state.steps = 1; state.steps <= 24; ++state.steps) {
    ++state.since_sync;
    if (DecideStep(state) == StepAction::kSync) {
      ++syncs;
      EXPECT_EQ(state.since_sync, 3u);
      state.since_sync = 0;
    }
  }
  EXPECT_EQ(syncs, 8);
  state.overlap = true;
  state.node_group = true;
  state.steps = 3;
  state.since_sync = 3;
  EXPECT_EQ(DecideStep(state), StepAction::kNone);
  state.steps = 8;
  state.since_sync = 1;
  EXPECT_EQ(DecideStep(state), StepAction::kNodeSyncPoint);
}

TEST(SyncScheduleTest, ActionNames) {
  EXPECT_EQ(StepActionName(StepAction::kNone), "none");
  EXPECT_EQ(StepActionName(StepAction::kMergeThenStart), "merge_then_start");
  EXPECT_EQ(StepActionName(StepAction::kNodeSyncPoint), "node_sync_point");
}

}  // namespace
}  // namespace localsgd
