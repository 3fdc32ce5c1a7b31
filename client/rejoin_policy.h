// What a member does when the coordinator no longer knows it, as a pure
// function of what the coordinator said and what the member holds: no RPCs,
// no clock. Client::Sync (client.cc) acts on it.
#ifndef LOCALSGD_CLIENT_REJOIN_POLICY_H_
#define LOCALSGD_CLIENT_REJOIN_POLICY_H_

#include "absl/status/status.h"
#include "src/types.h"

namespace localsgd {

// Whether joining again mends a failed Sync: NOT_FOUND (the coordinator
// forgot the member: its lease ran out, or the coordinator restarted, or it
// forgot the job) and FAILED_PRECONDITION (the job has no state, or is
// behind the member: restored from an older checkpoint, or none).
bool SyncNeedsRejoin(const absl::Status& sync_status);

enum class RejoinAction {
  // The job has no state: seed it with the member's parameters (or adopt
  // another member's re-seed), then contribute them to the job's next round
  // as the members that re-join after the seed do. Also a pseudo-gradient
  // job whose state is older than the member's anchor: the member offers
  // its anchor as a newer re-seed, which supersedes a re-seeded state no
  // round has closed on yet (Job::BeginSync); otherwise it adopts the job's.
  kReseedThenContribute,
  // The job's state is not newer than the one the parameters were trained
  // from: they are a valid contribution to its next round. Or the job's
  // state is that of the very round the member was syncing: it asks for
  // that round again (its result says whether it counted the member).
  kContribute,
  // The member missed rounds: adopt the job's state (FetchState).
  kAdopt,
};

struct RejoinDecision {
  RejoinAction action = RejoinAction::kAdopt;
  // kContribute: the round to contribute to (job_round + 1, or job_round
  // when that is the round the member was syncing).
  RoundId round = 0;
};

// After joining again: `has_state` and `job_round` as the Join said,
// `trained_from` the round of the state the member's parameters grew from,
// `pseudo_gradients` whether the job's members send deltas against an
// anchor (JobSettings::contribution).
RejoinDecision DecideRejoin(bool has_state, RoundId job_round,
                            RoundId trained_from, bool pseudo_gradients);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_REJOIN_POLICY_H_
