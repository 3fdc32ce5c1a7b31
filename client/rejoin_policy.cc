#include "client/rejoin_policy.h"

namespace localsgd {

bool SyncNeedsRejoin(const absl::Status& sync_status) {
  return absl::IsNotFound(sync_status) ||
         absl::IsFailedPrecondition(sync_status);
}

RejoinDecision DecideRejoin(bool has_state, RoundId job_round,
                            RoundId trained_from, bool pseudo_gradients) {
  if (!has_state) return {RejoinAction::kReseedThenContribute, 0};
  // A delta against an anchor newer than the job's state would not be
  // averaged; the anchor itself is the newer state.
  if (pseudo_gradients && job_round < trained_from) {
    return {RejoinAction::kReseedThenContribute, 0};
  }
  if (job_round <= trained_from) {
    return {RejoinAction::kContribute, job_round + 1};
  }
  // The round it was syncing closed: ask for it again. The coordinator
  // answers with its result and whether it counted the member (a standby
  // that took over after the round closed at its primary knows), or, had
  // it not, the member adopts it as if late.
  if (job_round == trained_from + 1) {
    return {RejoinAction::kContribute, job_round};
  }
  return {RejoinAction::kAdopt, 0};
}

}  // namespace localsgd
