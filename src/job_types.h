// The value types of a job, apart from the job itself: its policy, its
// global state, what a Sync resolves to, a member, a closed round's record,
// the status snapshot, and a Join's request and answer. Plain structs, no
// behaviour: what the coordinator's status, checkpoints, metrics and the
// server's conversions need without including src/job.h.
//
// Thread-compatible: values, copied or shared as const.
#ifndef LOCALSGD_SRC_JOB_TYPES_H_
#define LOCALSGD_SRC_JOB_TYPES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/layout.h"
#include "src/round.h"
#include "src/types.h"
#include "src/work.h"

namespace localsgd {

// Coordinator-wide policies a job follows.
struct JobPolicy {
  absl::Duration lease_ttl = absl::Seconds(30);
  // Zero: no deadline.
  absl::Duration round_deadline = absl::ZeroDuration();
  uint32_t min_quorum = 1;
  uint32_t max_members = 1024;
  // Closed rounds kept for status and late arrivals.
  uint32_t max_recent_rounds = 100;
};

// The global state: parameters after round `round` (0: the seed).
struct StateSnapshot {
  RoundId round = 0;
  std::vector<float> values;
  // Random and non-zero: names this state (a member's anchor) in
  // pseudo-gradient jobs, where two states of one round can differ (a job
  // re-seeded after its coordinator lost it).
  uint64_t id = 0;
  // Pseudo-gradient jobs, a closed round's state: `delta` is the round's
  // global delta in the job's wire dtype, chunk by chunk (chunk c at
  // WireBytes(wire dtype, c * chunk_elements)), and values = the state
  // `previous_id` + decode(delta), element by element, exactly as a member
  // that holds that state computes it. Empty (previous_id 0) for a seed, a
  // restored state and in parameter jobs.
  std::string delta;
  uint64_t previous_id = 0;
  // Pseudo-gradient jobs: the rule's momentum after this round (empty: the
  // rule has none) and what the coordinator's encoding of the deltas has
  // lost so far (error feedback; empty for float32), one float per element.
  // Checkpointed with the values.
  std::vector<float> momentum;
  std::vector<float> residual;
  // Mean encoding wire: what the coordinator's encodings of the rounds'
  // mean deltas have lost so far (one float per element; empty otherwise).
  // A primary's own: a standby does not get it and holds zeros, so a
  // failover drops it. Checkpointed with the values.
  std::vector<float> mean_residual;
  // Pseudo-gradient jobs: the ids of the states this one followed from,
  // newest first (the previous state's id first), as many as the job's
  // max_staleness; empty after a seed. How stale a delta is.
  std::vector<uint64_t> ancestors;
  // How many members took part in the round that made it (0: not known; a
  // seed). Checkpointed: a job restored from it regathers until as many
  // are back (Job::RestoreState).
  uint32_t participants = 0;
};

// What a Sync resolves to: how the round ended for the member, and the
// state it ended with.
struct SyncResult : RoundOutcome {
  std::shared_ptr<const StateSnapshot> state;
  // Pseudo-gradient jobs: the member holds state->previous_id and gets
  // state->delta to add to it; otherwise it gets state->values (in float32
  // in pseudo-gradient jobs, in the wire dtype in parameter jobs).
  bool delta = false;
};
using SyncCallback = std::function<void(absl::StatusOr<SyncResult>)>;

// Pseudo-gradient jobs: told that chunks `indices` of the open round's
// result are final in `next` (the state the round will commit; its delta's
// chunks `indices` are what the round's SyncResult will carry and never
// change again). `next`'s other chunks, round and id are not to be read
// until the round's SyncCallback hands it over.
using FinalChunksCallback = std::function<void(
    std::vector<uint32_t> indices, std::shared_ptr<const StateSnapshot> next)>;

struct MemberInfo {
  MemberId id;
  std::string name;
  double weight = 1;
  uint64_t incarnation = 0;
  absl::Time joined_at;
  absl::Time last_seen;
  RoundId first_round = 1;
  // Rounds it took part in and timed out of, net of those it contributed
  // to, at most kStragglerMisses (the adaptive deadline's persistent
  // stragglers, src/round.h).
  uint32_t missed_rounds = 0;
  // Step budgets (StepBudget::kAdaptive): its recent step rates and upload
  // times, when it was last handed a result (its compute starts then),
  // and the budget that result said (0: K).
  WorkHistory work;
  absl::Time result_at = absl::InfinitePast();
  uint32_t budget = 0;
  // The last round that counted its contribution (0: none yet).
  RoundId last_counted_round = 0;
  // Stale contributions: the anchor of its last stale contribution that
  // gave the open round a chunk, and whether that contribution counted (a
  // retry of it must not be merged again).
  uint64_t stale_anchor = 0;
  bool stale_counted = false;
  // The credentials the member joined with (JoinRequestParams::principal);
  // later calls naming the member must present the same. Not secret.
  std::string principal;
};

// A closed round, as status reports it. Names are sorted.
struct RoundRecord {
  RoundId round = 0;
  std::vector<std::string> participants;
  std::vector<std::string> contributors;
  // Participants that had left, lost their lease or been dropped for a
  // non-finite value before contributing every chunk.
  std::vector<std::string> dropped;
  // Participants still members when the round closed without their complete
  // contribution (its deadline passed, or the job stopped).
  std::vector<std::string> timed_out;
  std::vector<std::string> late;
  // Participants whose contribution was refused mid-stream (also in
  // `dropped`), each as "name: why" (a non-finite value, or a delta that
  // would overflow the state), sorted.
  std::vector<std::string> rejected;
  CloseReason reason = CloseReason::kComplete;
  absl::Time opened;
  absl::Time closed;
  double contributor_weight = 0;
  // Ids of the contributors, to answer a contributor whose result it is.
  absl::flat_hash_set<MemberId> contributor_ids;
  // The local steps of its participants' contributions by fate (those its
  // members reported; late: of Syncs for it that came after it closed).
  StepCounts steps;
  // Applied from a primary (Job::ApplyReplicated): its ids are the
  // primary's, and members that join the promoted standby get new ones; a
  // contributor is then known by its name.
  bool replicated = false;
};

// What status says of a job's upstream.
struct UpstreamStatus {
  std::string target;
  std::string member;  // the regional job's member name upstream
  RoundId upstream_round = 0;
  uint64_t rounds = 0;  // requests answered OK
  std::string last_error;
  // Result chunks told to the job's members before their round's whole
  // answer (Job::UpstreamChunk): the region's download pipelined on the
  // upstream's.
  uint64_t early_chunks = 0;
};

struct JobStatusSnapshot {
  std::string job_id;
  JobSettings settings;
  Layout layout;
  ChunkGeometry geometry;
  std::vector<MemberInfo> members;  // sorted by name
  bool has_state = false;
  RoundId state_round = 0;
  // A regional job's upstream (Job::SetUpstream).
  std::optional<UpstreamStatus> upstream;
  bool round_open = false;
  RoundId open_round = 0;
  std::vector<std::string> open_round_participants;
  std::vector<std::string> open_round_contributed;
  // Why the open round is still open, and whom it waits for until when
  // (DecideClose as of the status call).
  CloseDecision open_round_decision;
  std::vector<RoundRecord> recent_rounds;  // most recent first
  // DeadlineMode::kAdaptive: what was learned, and the members that count
  // as persistent stragglers (sorted).
  LearnedDeadline learned_deadline;
  std::vector<std::string> stragglers;
  // The local steps of every contribution this coordinator saw, by fate,
  // since it took the job (created, restored or promoted).
  StepCounts steps;
};

struct JoinRequestParams {
  std::string member_name;
  Layout layout;
  double weight = 1;
  uint64_t incarnation = 0;
  JobSettings settings;  // zero fields: no preference
  // Who joins (server/auth.h Principal::BindingKey; empty without
  // credentials). The member is bound to it; a Join of the same member name
  // with other credentials is PERMISSION_DENIED.
  std::string principal;
};

struct JoinResult {
  MemberId member_id;
  JobSettings settings;
  bool has_state = false;
  RoundId state_round = 0;
  uint64_t state_id = 0;
  ChunkGeometry geometry;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_JOB_TYPES_H_
