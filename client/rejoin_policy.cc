#include "client/rejoin_policy.h"

namespace localsgd {

bool SyncNeedsRejoin(const absl::Status& sync_status) {
  return absl::IsNotFound(sync_status) ||
         absl::IsFailedPrecondition(sync_status);
}

RejoinDecision DecideRejoin(bool has_state, RoundId job_round,
                            RoundId trained_from) {
  if (!has_state) return {RejoinAction::kReseedThenContribute, 0};
  if (job_round <= trained_from) {
    return {RejoinAction::kContribute, job_round + 1};
  }
  return {RejoinAction::kAdopt, 0};
}

}  // namespace localsgd
