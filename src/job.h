// One training job: its layout, members and their leases, the global state,
// and the round state machine that averages contributions into it.
//
// Rounds. The state after round r is the average of the contributions to r.
// Round 0 is the seed: the first member to send it makes its parameters the
// state (of round 0, or of the seed round the seeding member names: a re-seed
// of a job its coordinator lost; see BeginSync). Round L+1 (L = round of the
// current state) opens at the first contribution for it; its participants are
// the members active then whose first round is <= L+1. It closes when
//   (COMPLETE)      every participant has contributed every chunk, or
//   (MEMBERS_GONE)  every participant has either contributed every chunk or
//                   left / lost its lease, or
//   (DEADLINE)      round_deadline has passed since it opened and at least
//                   min_quorum participants have contributed every chunk.
// Each chunk of the result is the weighted mean of the complete contributions
// to that chunk, or the previous state's chunk if it has none. A member that
// joins while a round is open takes part from the next one; a Sync for it (or
// for a round that has closed) adopts the result without contributing.
//
// Per-chunk finality (pseudo-gradient jobs): a chunk of the open round's
// result is final once every participant has contributed that chunk and the
// round no longer gathers members (nothing can change it then: a member
// that goes away keeps its chunks counted, and no participant is added).
// Its result is computed then (the rule's step, its encoding with error
// feedback, the new values) and offered to the round's waiters that asked
// (BeginSync's `on_final`); the round's close computes the chunks that are
// not final yet. The result is the same as if every chunk had waited for the
// close.
//
// Rendezvous: with settings.rendezvous_members = N > 1, until some round has
// had N participants, an open round admits members that join (the state has
// not changed, so they start where the others did) and closes only once it has
// N participants (or at its deadline, with quorum).
//
// Memory: one fp32 accumulator and one weight per chunk for the open round,
// the state, and whatever older states Sync/FetchState streams still read;
// independent of the number of members.
//
// Parts. Job is the facade the coordinator and the server call: it holds
// the mutex, the lifecycle (draining, stopped, retired), the Syncs waiting
// for the open round or the seed, and the calls to the sink and the
// observer, and it delegates the rest to parts that it keeps under its
// mutex (none has a lock of its own; each is annotated ABSL_GUARDED_BY(mu_)
// below, so clang checks that every call holds it):
//   Membership    src/membership.h    members, leases, missed rounds
//   RoundState    src/round_state.h   the open round: participants, sums,
//                                     per-chunk finality, its close record
//   RoundPacing   src/round_state.h   rendezvous, regather, learned
//                                     deadline: the close decision
//   StateCommit   src/state_commit.h  the state; a round's sums to the next
//                                     state (rule, encoding, residual)
//   SeedState     src/seed.h          a seed in progress
//   RoundHistory  src/job_status.h    closed rounds' records; what a Sync
//                                     and status are told
//   SyncSession   src/sync_session.h  one member's Sync stream, its checks
// The value types (JobPolicy, StateSnapshot, SyncResult, MemberInfo,
// RoundRecord, JobStatusSnapshot, ...) are in src/job_types.h.
//
// Thread-safety: all methods are thread-safe. Callbacks run without the job's
// lock held, possibly on the calling thread before the call returns.
#ifndef LOCALSGD_SRC_JOB_H_
#define LOCALSGD_SRC_JOB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/job_status.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/membership.h"
#include "src/outlier_guard.h"
#include "src/replicator.h"
#include "src/round.h"
#include "src/round_state.h"
#include "src/seed.h"
#include "src/state_commit.h"
#include "src/sync_session.h"
#include "src/tick_alarm.h"
#include "src/types.h"
#include "src/upstream.h"
#include "src/work.h"

namespace localsgd {

class Job;
class CoordinatorObserver;

// Told of every new global state (seed or closed round), e.g. to checkpoint
// it. Called without the job's lock held; must not block.
class StateSink {
 public:
  virtual ~StateSink() = default;
  virtual void StateChanged(std::shared_ptr<const Job> job,
                            std::shared_ptr<const StateSnapshot> state) = 0;
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  // `settings` must be complete and valid; `layout` validated with
  // `num_elements` elements. `clock`, `sink` and `observer` (both may be
  // null) must outlive the job.
  // `replicator` (may be null): a primary's, told of every new state's
  // making; results are released to members once it says so (see
  // src/replicator.h). `alarm` (may be null; must outlive the job): asked
  // for a Tick at the open round's deadline, so that a deadline closes its
  // round when it passes rather than at the next periodic tick.
  Job(std::string job_id, Layout layout, uint64_t num_elements,
      JobSettings settings, JobPolicy policy, Clock* clock,
      StateSink* sink = nullptr, CoordinatorObserver* observer = nullptr,
      Replicator* replicator = nullptr, TickAlarm* alarm = nullptr);
  ~Job();

  // Restores a checkpointed state (round, values of num_elements) into a job
  // that has no members and no state yet: members join again and fetch it.
  // A restored round > 0 counts as past the rendezvous. For one lease TTL
  // after the restore the job regathers: an open round admits members that
  // join and does not close before the TTL has passed, so that members that
  // return a little later than the first still take part.
  void RestoreState(RoundId round, std::vector<float> values)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same with the state's id and a pseudo-gradient job's momentum,
  // residual and mean residual (each empty or of num_elements; id 0: a new
  // one), the ids of the states before it (newest first; see
  // StateSnapshot::ancestors), and how many took part in its round
  // (StateSnapshot::participants): if > 0, the regather ends once the open
  // round has that many participants, and at the latest when that round
  // closes (as a re-seed's); members that come back after it take part
  // from the next round, which does not wait for them.
  void RestoreState(RoundId round, std::vector<float> values, uint64_t id,
                    std::vector<float> momentum, std::vector<float> residual,
                    std::vector<float> mean_residual = {},
                    std::vector<uint64_t> ancestors = {},
                    uint32_t participants = 0) ABSL_LOCKS_EXCLUDED(mu_);

  // A standby's job follows its primary's (src/replicator.h): applies the
  // updates in the primary's order. Errors (the job unchanged):
  // FAILED_PRECONDITION for an update that does not follow from the job's
  // state (another round, another previous state, a chunk final twice, a
  // commit before every chunk is final), INVALID_ARGUMENT for a malformed
  // one (chunk index, size, a non-finite value).
  absl::Status ApplyReplicated(const ReplicatedChunk& update)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ApplyReplicated(const ReplicatedCommit& update)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The standby's job is now its primary's: the replicated members go on
  // under their ids, their leases starting now (one that joined after the
  // last commit joins again); the next round waits for as many as took
  // part in the last, or one lease, as after a re-seed; a round whose final
  // chunks it
  // holds (some members may have them) opens with those chunks fixed, and
  // the rest is averaged from the contributions sent again. A member that
  // holds a newer state (a standby out of sync) re-seeds it, as after a
  // re-seed (BeginSync).
  void Promote() ABSL_LOCKS_EXCLUDED(mu_);
  // A primary's job as a standby starts following it (the catch-up; see
  // JobReplica), and the standby's side: a job that has no state yet takes
  // it. Import: INVALID_ARGUMENT for a replica of another geometry.
  JobReplica ExportReplica() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ImportReplica(const JobReplica& replica)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A regional coordinator's job (src/upstream.h): its seed and rounds
  // take their results from `upstream`. A round that closes (by the usual
  // rules) is sealed: its record is taken, its weighted mean delta goes up
  // as one contribution, and a Sync for it waits (adopting) until the
  // answer commits it: the step the upstream round took, added to the
  // state (members get it as the round's delta), or the upstream state
  // whole (members get it as a state; their contributions did not count).
  // An answer that is an error fails the round's Syncs with UNAVAILABLE
  // (the members retry the round; the close's effects on the members'
  // records, the step counts and the pacing wait for a commit). No
  // per-chunk finality in the region: a chunk is final with the upstream
  // round's step for it (UpstreamChunk). Call once, before the job is
  // shared; the job stops `upstream` when it stops.
  void SetUpstream(std::unique_ptr<Upstream> upstream);
  // The answer to the request `serial` (UpstreamRequest); ignored if the job
  // no longer waits for it (stopped, its seed abandoned).
  void CompleteUpstream(uint64_t serial, UpstreamAnswer answer)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Before the answer to the round request `serial`: the upstream round's
  // step for the elements from `offset` on, as soon as the upstream sent
  // it. If that is one of this job's chunks, not final yet, and finite,
  // the chunk is final at once and goes to the round's members as their
  // early result chunks (full duplex), as a flat round's chunks do: the
  // region's download overlaps the upstream's. Ignored otherwise (and were
  // a standby to follow the job, which a regional coordinator refuses at
  // start: its chunks would need the standby's acknowledgement first). The
  // whole answer must then hold the same step for every chunk sent early;
  // one that does not (the link retried into another upstream round, or
  // answers with the upstream state whole) fails the round for its
  // members, who retry it, as an answer that is an error does.
  void UpstreamChunk(uint64_t serial, uint64_t offset,
                     absl::Span<const float> step) ABSL_LOCKS_EXCLUDED(mu_);
  // Null unless a regional job.
  const Upstream* upstream() const { return upstream_.get(); }

  const Layout& layout() const { return layout_; }

  const std::string& id() const { return id_; }
  const JobSettings& settings() const { return settings_; }
  const ChunkGeometry& geometry() const { return geometry_; }

  // Adds a member (or returns the same member for a repeated Join of the same
  // name and incarnation; replaces a member of that name with another
  // incarnation). FAILED_PRECONDITION: layout or settings differ (the message
  // names the first difference). RESOURCE_EXHAUSTED: max_members reached.
  // UNAVAILABLE: draining or stopped.
  absl::StatusOr<JoinResult> Join(const JoinRequestParams& params)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes the member at once; an open round stops waiting for it. OK if it
  // is not (or no longer) a member.
  absl::Status Leave(const MemberId& member) ABSL_LOCKS_EXCLUDED(mu_);

  // PERMISSION_DENIED if `member` is a member bound to credentials other
  // than `principal` (see JoinRequestParams::principal); changes nothing.
  // OK otherwise, also for an unknown member (the call that follows then
  // reports it).
  absl::Status CheckPrincipal(const MemberId& member,
                              absl::string_view principal)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Renews the lease. NOT_FOUND if the member is unknown or its lease ran out.
  // Returns the round of the current state.
  absl::StatusOr<RoundId> Heartbeat(const MemberId& member)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Starts a Sync of `member` for `round`. `done` runs exactly once unless
  // SyncSession::Cancel returns true: with the round's result when it closes
  // (at once if the round has closed already), or with ABORTED (the seed was
  // abandoned) or UNAVAILABLE (the job stops). Errors: NOT_FOUND (member),
  // FAILED_PRECONDITION (no state yet for round >= 1; round ahead of the
  // open round), UNAVAILABLE (stopping; or draining and the Sync would open
  // a new round or start a seed), INVALID_ARGUMENT (an `origin` with a
  // round other than 0, contributors without a round, or a round above
  // kMaxSeedRound, or a state id without a round).
  //
  // Pseudo-gradient jobs: `anchor` is the id of the state the member's
  // delta was taken against (INVALID_ARGUMENT if 0 for a round >= 1). A
  // member whose anchor is not the job's current state is late: it adopts
  // the current state, and its delta is never averaged, unless the job
  // takes stale contributions ("Stale contributions" below). A seed's
  // chunks are float32 whatever the wire dtype.
  //
  // Stale contributions (settings.max_staleness = S >= 1): a Sync for the
  // round after its anchor, whose anchor is the state s rounds before the
  // job's current one (1 <= s <= S; the job keeps the ids of the last S
  // states), is a contribution to the open round (opened for it if none
  // is; the job's next round): its member must be a participant of it that
  // has not contributed yet, and counts with weight w / (1 + s). Its
  // result carries the round's new state whole (delta false) with
  // contributed true and its staleness. A retry of a stale contribution
  // that was counted gets the current state, contributed; one that gave a
  // round chunks without being counted whole adopts (never merged twice).
  // Any other delta against another state adopts as late.
  //
  // `work`: what the Sync says of its contribution (its local steps,
  // counted by fate in the round's record and the job's totals;
  // INVALID_ARGUMENT above kMaxLocalSteps; and its weight, which replaces
  // the member's weight times its step weight: INVALID_ARGUMENT unless a
  // pseudo-gradient contribution's, finite and in [1e-6, 1e6]).
  //
  // `origin` (round 0 only): what the seed continues. A re-seed
  // (origin.round > 0) makes the state round origin.round, so that numbering
  // goes on in step with the other shards, the job counts as past its
  // rendezvous, and its next round regathers as after RestoreState, until it
  // has origin.contributors participants (if > 0) or one lease TTL has
  // passed. Whoever owns the seed names its origin; members adopting it get
  // its round. A re-seed newer than the job's state (origin.round above its
  // round) while that state is itself a re-seed and no round has closed
  // since supersedes it: the open round fails with ABORTED (its members
  // retry and adopt the newer state) and the newer seed is taken as if the
  // job had no state. So when the coordinator lost a round that some
  // members got the result of and others did not, the members holding the
  // newest state decide, whichever came back first.
  //
  // `on_final` (pseudo-gradient jobs; may be null): with a Sync of the open
  // round (a participant's or an adopting member's), told of the chunks of
  // the round's result as they become final (see "Per-chunk finality"),
  // those final already at once; never after `done` was called, nor after
  // SyncSession::Cancel returned true, except calls already under way on
  // other threads (which the caller must tolerate). Each chunk is told
  // once; the chunks not told before `done` are final when it runs.
  absl::StatusOr<std::unique_ptr<SyncSession>> BeginSync(
      const MemberId& member, RoundId round, SyncCallback done,
      SeedOrigin origin = {}, uint64_t anchor = 0,
      FinalChunksCallback on_final = nullptr, SyncWork work = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  // The current state. NOT_FOUND (member), FAILED_PRECONDITION (no state).
  absl::StatusOr<std::shared_ptr<const StateSnapshot>> GetState(
      const MemberId& member) ABSL_LOCKS_EXCLUDED(mu_);

  // Expires leases and closes rounds whose deadline has passed, as of the
  // clock's now. Call periodically.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // Starts draining: from now on no round opens and no seed starts (such a
  // Sync, and a Join, fail with UNAVAILABLE so that clients retry, later or
  // against a restarted coordinator); the open round and a seed in progress
  // go on and close by the usual rules. Idempotent.
  void BeginDrain() ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until no round is open, no seed is in progress and the last new
  // state has reached the StateSink; or the job is stopped; or `deadline`
  // (real time, whatever the job's clock) has passed. Returns whether the
  // job is then idle (no round open, no seed, nothing for the sink).
  bool AwaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails every pending callback with UNAVAILABLE and refuses new Syncs.
  // Returns once every new state so far has reached the StateSink (so that
  // stopping the sink next loses none). Idempotent. Not to be called from
  // a StateSink or observer callback.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  JobStatusSnapshot Status(uint32_t max_rounds) ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_members() ABSL_LOCKS_EXCLUDED(mu_);
  // DeadlineMode::kAdaptive: what the job has learned (nothing otherwise).
  LearnedDeadline learned_deadline() ABSL_LOCKS_EXCLUDED(mu_);

  // Retires the job if it has had no member for at least `ttl` by `now`
  // (since its last member went, or since it was created or restored if
  // none ever came); returns whether it did. A retired job takes no Join
  // (UNAVAILABLE: retry, which creates the job anew); the coordinator drops
  // it. Not to be called from a StateSink or observer callback.
  bool RetireIfEmptyFor(absl::Time now, absl::Duration ttl)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class SyncSession;

  struct Waiter {
    MemberId member;
    SyncCallback done;
    bool participant = false;
    FinalChunksCallback on_final;  // may be null
    // A stale contribution's (its anchor that many rounds old): it gets
    // the new state whole.
    uint32_t staleness = 0;
  };
  using Waiters = absl::flat_hash_map<uint64_t, Waiter>;
  // The open round: its participants, sums and finality (RoundState), the
  // Syncs waiting for it, and (pseudo-gradient jobs) the state it commits,
  // built chunk by chunk as chunks become final (FinalizeChunkLocked), the
  // rest at the close.
  struct OpenRound {
    explicit OpenRound(RoundState r) : round(std::move(r)) {}
    RoundState round;
    Waiters waiters;
    std::shared_ptr<StateSnapshot> next;
    // The chunks told to members (final, and acknowledged by the standbys
    // in sync), and the ticket of the last chunk shipped.
    std::vector<bool> released;
    uint64_t chunk_ticket = 0;
    // Which opening of the job's rounds this is (a round superseded by a
    // re-seed and opened again has the same number).
    uint64_t serial = 0;
    // Prefinal chunks' new values (RoundState::MarkPrefinal), put into the
    // result at the close; empty if none.
    std::vector<float> prefinal_values;
    // Participants the outlier guard refused.
    uint32_t outlier_refused = 0;
    // A regional job's round sealed at its close (SetUpstream): the request
    // that answers it and the round's record.
    uint64_t upstream_serial = 0;
    RoundClosure closure;
  };
  // A standby's round in progress: the chunks of its result the primary
  // finalized so far (values and next state), until its commit.
  struct Mirror {
    RoundId round = 0;
    std::shared_ptr<StateSnapshot> next;
    std::vector<float> values;
    std::vector<bool> final;
    uint32_t num_final = 0;
  };
  // The seed in progress and the Syncs waiting for it.
  struct Seed {
    explicit Seed(SeedState s) : state(std::move(s)) {}
    SeedState state;
    Waiters waiters;
    // A regional job's complete seed gone up (SetUpstream): the request
    // that answers it; 0 before.
    uint64_t upstream_serial = 0;
  };
  using Deferred = std::vector<std::function<void()>>;

  // Join, in steps: the checks that refuse it; the member a repeated Join
  // names, or a new member (after replacing an old incarnation).
  absl::Status CheckJoinLocked(const JoinRequestParams& params) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<MemberId> JoinLocked(const JoinRequestParams& params,
                                      absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // BeginSync, one function per kind: round 0 (seed or adopt the seed), a
  // round that has closed (adopt), the open or next round.
  std::unique_ptr<SyncSession> BeginSeedLocked(const MemberInfo& member,
                                               const SeedOrigin& origin,
                                               SyncCallback done,
                                               Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `steps`: the local steps the late delta held (-1: not said).
  std::unique_ptr<SyncSession> BeginLateLocked(const MemberInfo& member,
                                               RoundId round, uint64_t anchor,
                                               int64_t steps, SyncCallback done,
                                               Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::unique_ptr<SyncSession> BeginRoundLocked(
      const MemberInfo& member, RoundId round, SyncCallback done,
      FinalChunksCallback on_final, const SyncWork& work, absl::Time now,
      Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A stale contribution (see BeginSync): merged into the open round
  // (opened if none is) if its member can still give it; null otherwise
  // (the caller answers it as late). `staleness` >= 1.
  std::unique_ptr<SyncSession> BeginStaleLocked(
      const MemberInfo& member, uint64_t anchor, uint32_t staleness,
      const SyncWork& work, SyncCallback& done, absl::Time now,
      Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The answer to a retry of a stale contribution that was counted: the
  // current state, whole, contributed.
  std::unique_ptr<SyncSession> AnswerCountedStaleLocked(
      const MemberInfo& member, RoundId round, SyncCallback done,
      Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands `member` the job's current state whole as the answer to a
  // contribution that counted (a retry, or a banked stale one of
  // `staleness`), with its next budget.
  void ReleaseCountedStateLocked(const MemberInfo& member, uint32_t staleness,
                                 SyncCallback done, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::unique_ptr<SyncSession> NewSession(const MemberId& member, RoundId round,
                                          SyncSession::Role role,
                                          uint64_t waiter_id);

  // A chunk of `session` that SyncSession::AddChunk checked (CheckChunk),
  // applied under the lock (ApplyChunkLocked) unless a guard refuses or
  // holds it. `magnitude`: a pseudo-gradient contribution's chunk's
  // (MagnitudePieces), for the finite-state guard and the outlier guard.
  absl::Status AddChunk(SyncSession& session, uint32_t index,
                        absl::Span<const absl::string_view> pieces,
                        ChunkMagnitude magnitude) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ApplyChunkLocked(const SyncSession& session, uint32_t index,
                                absl::Span<const absl::string_view> pieces,
                                absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chunk `index` of `member`'s contribution to round `round` into the open
  // round's sums (if that round is open and the member a participant that
  // has not given it), finalizing the chunk and closing the round if that
  // decides them.
  void ApplyContributionLocked(const MemberId& member, RoundId round,
                               uint32_t index,
                               absl::Span<const absl::string_view> pieces,
                               WireCode code, absl::Time now,
                               Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks the alarm (if any) for a tick at `decision`'s deadline, if the
  // round stays open with one: a deadline closes its round (or has the
  // outlier guard judge what it holds) when it passes.
  void ArmAlarmLocked(const CloseDecision& decision, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After `member`'s contribution completed: if it is stale and other
  // participants are still to come, banks it (RoundState::Bank) and
  // answers its Sync at once with the job's current state (counted, as at
  // a close), so that the member goes on from that state instead of
  // waiting for the round. Returns whether it did.
  bool BankStaleLocked(const MemberId& member, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The outlier guard on a contribution chunk of `member` (a participant
  // of the open round `round` that has not given it): accepted (applied),
  // refused (RejectLocked) or held (OutlierGuard's cold start).
  void GuardContributionLocked(const MemberId& member, RoundId round,
                               uint32_t index,
                               absl::Span<const absl::string_view> pieces,
                               double norm, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The outlier guard's held chunks judged and applied or refused: chunk
  // `c`'s; every held chunk that is due (OutlierGuard::Due, or no
  // participant that has not given it is left); every held chunk.
  void JudgeHeldLocked(uint32_t c, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JudgeDueHeldLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JudgeAllHeldLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether every participant of the open round that is not gone gave
  // chunk `c` or has it held.
  bool NoneOweLocked(uint32_t c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CancelWaiter(const SyncSession& session) ABSL_LOCKS_EXCLUDED(mu_);
  // NonFinitePolicy::kDrop: drops the session's member from its round for a
  // non-finite value at element `bad` of chunk `index`.
  void DropNonFinite(SyncSession& session, uint32_t index, int64_t bad)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses the contribution of `session` (a participant of the open round
  // that has not given every chunk; otherwise returns false) at chunk
  // `index` for `why`: dropped from the round as if it had left, named in
  // the round's record as rejected.
  bool RejectLocked(const MemberId& member, RoundId round, uint32_t index,
                    absl::string_view why, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Marks `member` gone: removed from members_, dropped from the open round,
  // seed aborted if it owned it. `why` goes to the log.
  void RemoveMemberLocked(const MemberId& member, absl::string_view why,
                          Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `member` gone from the open round if it had not given every chunk
  // (RoundState::MarkGone; `rejected`: why its contribution was refused),
  // then closes the round if that decides it, or
  // finalizes the chunks that only it had not given.
  void DropFromRoundLocked(const MemberId& member, absl::string_view rejected,
                           absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Rounds: opening one (its participants: the members taking part), closing
  // it when the close decision (RoundPacing::Decide as of `now`) says so.
  void OpenRoundLocked(RoundId round, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeCloseRoundLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseRoundLocked(CloseReason reason, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A round's close without its state: its record, and what it tells the
  // members' bookkeeping, the outlier guard, the step rates and the pacing.
  RoundClosure AccountCloseLocked(OpenRound& round, CloseReason reason,
                                  absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The close's side of that (AccountCloseLocked without RoundState::Close).
  void ApplyClosureLocked(OpenRound& round, const RoundClosure& closure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A regional job (SetUpstream): the round closes into sealed_, its mean
  // goes up; and the answer commits it.
  void SealRoundLocked(CloseReason reason, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CommitSealedLocked(UpstreamAnswer answer, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A Sync for the sealed round: it waits for its result, adopting.
  std::unique_ptr<SyncSession> WaitSealedLocked(const MemberInfo& member,
                                                RoundId round,
                                                SyncCallback done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortSeedLocked(absl::string_view why, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteSeedLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a re-seeded state that a newer re-seed (`origin`, by `member`)
  // supersedes, and the round open on it (ABORTED). See BeginSync.
  void SupersedeReseedLocked(const MemberInfo& member, const SeedOrigin& origin,
                             Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Seed completion and round closure, one path: makes `state` the state
  // of `record.round` (StateCommit::Commit), tells the sink and the observer,
  // answers `waiters` (a waiter in `refused` was dropped for non-finite values:
  // not counted, and not late) and keeps the record.
  void CommitLocked(RoundRecord record, std::shared_ptr<StateSnapshot> state,
                    Waiters waiters,
                    const absl::flat_hash_set<MemberId>& refused,
                    Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `member` is handed a result at `now` (its compute starts): the local
  // steps it is to make before its next contribution with adaptive step
  // budgets (src/work.h; 0: K, or nothing learned yet), kept for status.
  // `medians`: WorkMediansLocked, the members' median step rate and upload.
  struct WorkMedians {
    double steps_per_second = 0;
    absl::Duration upload;
  };
  WorkMedians WorkMediansLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint32_t HandResultLocked(const MemberId& member, absl::Time now,
                            const WorkMedians& medians)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool adaptive_budgets() const {
    return settings_.step_budget == StepBudget::kAdaptive &&
           settings_.local_sgd_steps > 0;
  }
  // The log line and the observer's event of a commit.
  void ReportCommitLocked(const RoundRecord& record, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifySinkLocked(std::shared_ptr<const StateSnapshot> state,
                        Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pseudo-gradient jobs, per-chunk finality: chunk `c` of the open round's
  // result computed into its next state (StateCommit::FinalizeChunk) and
  // marked final; chunk `c` finalized and told to the waiters if it is
  // ready (RoundState::ChunkReady); every chunk that is ready after a
  // gathering ended.
  void FinalizeChunkLocked(OpenRound& round, uint32_t c)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinalizeChunkLocked(uint32_t c, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinalizeHeldChunksLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every chunk that is given (RoundState::ChunkGiven) finalized, or held
  // while the round gathers (a participant went away).
  void FinalizeGivenChunksLocked(absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the open round's waiters that asked that `indices` are final.
  void TellFinalLocked(const std::vector<uint32_t>& indices, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `release` once the replicator has every update up to `ticket`
  // acknowledged (deferred; at once without a replicator or ticket 0).
  void ReleaseLocked(uint64_t ticket, std::function<void()> release,
                     Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chunks `indices` of the open round of serial `serial`, acknowledged:
  // told to its waiters (nothing if that round is gone).
  void ReleaseFinal(uint64_t serial, std::vector<uint32_t> indices)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The open round's released chunks, in order.
  std::vector<uint32_t> ReleasedChunksLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chunk `c` of the open round's result, shipped to the replicator (the
  // mean delta; parameter jobs: the new values) and computed.
  void FinalizeAndShipLocked(OpenRound& round, uint32_t c)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The dtype of the chunks a session sends: float32 for a pseudo-gradient
  // job's seed, else the wire dtype.
  WireCode ChunkCode(const SyncSession& session) const;
  bool pseudo_gradients() const {
    return settings_.contribution == Contribution::kPseudoGradients;
  }
  static void RunDeferred(Deferred& deferred);
  // Every waiter's `done` with `status`, deferred; `waiters` emptied.
  static void FailAll(Waiters& waiters, const absl::Status& status,
                      Deferred& deferred);

  const std::string id_;
  const Layout layout_;
  const JobSettings settings_;
  const JobPolicy policy_;
  const ChunkGeometry geometry_;
  Clock* const clock_;
  StateSink* const sink_;                // may be null
  CoordinatorObserver* const observer_;  // may be null
  Replicator* const replicator_;         // may be null
  TickAlarm* const alarm_;               // may be null
  // A regional job's (SetUpstream, before the job is shared; null
  // otherwise).
  std::unique_ptr<Upstream> upstream_;
  // When the job's state was last committed (its members answered).
  absl::Time state_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
  // Sink calls queued (under mu_) but not yet returned.
  int sink_calls_pending_ ABSL_GUARDED_BY(mu_) = 0;
  // The members and their leases (also when the job last became empty:
  // RetireIfEmptyFor).
  Membership members_ ABSL_GUARDED_BY(mu_);
  // The global state (null until seeded), how rounds become states, and
  // the buffers recycled between them.
  StateCommit commit_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<OpenRound> open_ ABSL_GUARDED_BY(mu_);
  // The rendezvous, the regather and the learned deadline; the close
  // decision.
  RoundPacing pacing_ ABSL_GUARDED_BY(mu_);
  // The outlier guard (off unless a pseudo-gradient job's outlier_ratio
  // sets it): the norms it learned, the chunks it holds.
  OutlierGuard guard_ ABSL_GUARDED_BY(mu_);
  // Depth of the guard's judging of held chunks (JudgeHeldLocked): no
  // round closes within it.
  int judging_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Seed> seed_ ABSL_GUARDED_BY(mu_);
  // The state is a re-seed (SeedOrigin::round > 0) and no round has closed
  // since: a newer re-seed supersedes it.
  bool reseeded_ ABSL_GUARDED_BY(mu_) = false;
  // The records of the recent closed rounds, for status and late arrivals.
  RoundHistory history_ ABSL_GUARDED_BY(mu_);
  // The local steps of every contribution so far, by fate.
  StepCounts steps_ ABSL_GUARDED_BY(mu_);
  uint64_t next_waiter_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t round_serial_ ABSL_GUARDED_BY(mu_) = 0;
  // With a replicator: the ticket of the update that made the current
  // state, and the newest state released (acknowledged) for GetState.
  uint64_t state_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const StateSnapshot> released_state_ ABSL_GUARDED_BY(mu_);
  uint64_t released_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  // A standby's round in progress; after Promote, the round that opens
  // with its final chunks fixed.
  std::unique_ptr<Mirror> mirror_ ABSL_GUARDED_BY(mu_);
  // A regional job's round closed and waiting for its upstream answer
  // (open_ is null meanwhile: no round opens before it commits), and the
  // serial of the last request to the upstream.
  std::unique_ptr<OpenRound> sealed_ ABSL_GUARDED_BY(mu_);
  // A regional job's result chunks told to members (their streams that
  // take early results) before their round's whole upstream answer
  // (UpstreamChunk), since the job began; whether UpstreamChunk logged
  // that the upstream's chunks are not this job's.
  uint64_t upstream_early_chunks_ ABSL_GUARDED_BY(mu_) = 0;
  bool upstream_geometry_warned_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t upstream_serial_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_JOB_H_
