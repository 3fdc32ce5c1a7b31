// When LocalSGD syncs: the decision each optimizer step makes, one table
// for the C++ LocalSGD (client/local_sgd.h) and the Python one (which calls
// it through the binding: localsgd._localsgd.decide_step). Pure: no clock,
// no I/O, no LibTorch.
//
// `due`: this step is a sync point: steps % local_sgd_steps == 0, counting
// this step; or, with a step budget from the coordinator (`budget` > 0,
// JobSettings.step_budget adaptive; not in node groups, whose ranks sync
// in lockstep), since_sync >= budget. `in_flight`: a background sync (overlap)
// has not been merged; `ready`: its result has arrived.
//
//   overlap  node group  due  in flight  ready  action
//   no       any         no   -          -      kNone
//   no       any         yes  -          -      kSync: blocking
//   yes      yes         no   -          -      kNone: a node merges in
//                                               lockstep, at sync points only
//   yes      yes         yes  -          -      kNodeSyncPoint
//   yes      no          no   no         -      kNone
//   yes      no          no   yes        no     kNone
//   yes      no          no   yes        yes    kMerge: as soon as it is back
//   yes      no          yes  no         -      kStart
//   yes      no          yes  yes        any    kMergeThenStart: the round in
//                                               flight first, at the latest
#ifndef LOCALSGD_CLIENT_SYNC_SCHEDULE_H_
#define LOCALSGD_CLIENT_SYNC_SCHEDULE_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace localsgd {

enum class StepAction {
  kNone,
  kSync,
  kNodeSyncPoint,
  kMerge,
  kStart,
  kMergeThenStart,
};

struct StepState {
  uint64_t steps = 0;            // optimizer steps so far, this one counted
  uint64_t local_sgd_steps = 1;  // K (>= 1)
  // Steps since the last contribution (this one counted), and the
  // coordinator's budget for the next (0: none, sync every K).
  uint64_t since_sync = 0;
  uint64_t budget = 0;
  bool overlap = false;
  bool node_group = false;
  bool in_flight = false;
  bool ready = false;
};

// The table above. Requires local_sgd_steps >= 1.
StepAction DecideStep(const StepState& state);

// "none", "sync", "node_sync_point", "merge", "start", "merge_then_start".
absl::string_view StepActionName(StepAction action);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_SYNC_SCHEDULE_H_
