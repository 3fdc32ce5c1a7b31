#include "client/sync_schedule.h"

namespace localsgd {

StepAction DecideStep(const StepState& s) {
  const bool due = s.budget > 0 && !s.node_group
                       ? s.since_sync >= s.budget
                       : s.steps % s.local_sgd_steps == 0;
  if (!s.overlap) return due ? StepAction::kSync : StepAction::kNone;
  if (s.node_group) return due ? StepAction::kNodeSyncPoint : StepAction::kNone;
  if (due) {
    return s.in_flight ? StepAction::kMergeThenStart : StepAction::kStart;
  }
  return s.in_flight && s.ready ? StepAction::kMerge : StepAction::kNone;
}

absl::string_view StepActionName(StepAction action) {
  switch (action) {
    case StepAction::kNone:
      return "none";
    case StepAction::kSync:
      return "sync";
    case StepAction::kNodeSyncPoint:
      return "node_sync_point";
    case StepAction::kMerge:
      return "merge";
    case StepAction::kStart:
      return "start";
    case StepAction::kMergeThenStart:
      return "merge_then_start";
  }
  return "unknown";
}

}  // namespace localsgd
