// A job's rounds, apart from the job: the open round (RoundState: one
// generation, its participants, the sums of their contributions and which
// chunks of its result are final) and what paces rounds across generations
// (RoundPacing: the rendezvous, the regather after a restore or a re-seed,
// the deadline learned from recent rounds, and with them the close decision
// of src/round.h).
//
// Per-chunk finality (pseudo-gradient jobs, Job's "Per-chunk finality"): a
// chunk is *given* once every participant that is not gone gave it and at
// least one did; nothing changes its sums after that unless the job still
// gathers members into the round (a joiner becomes a participant and may
// give it). A given chunk is *ready* when no gathering is on; the job then
// computes it (StateCommit::FinalizeChunk) and marks it final. A chunk that
// is given while a gathering is on is *held* until the gathering ends.
//
// No clock, no I/O: time is passed in. Not thread-safe: Job owns one
// RoundPacing and at most one RoundState under its mutex (`Job::mu_`) and
// calls them only with it held.
#ifndef LOCALSGD_SRC_ROUND_STATE_H_
#define LOCALSGD_SRC_ROUND_STATE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/round.h"
#include "src/types.h"

namespace localsgd {

// What a round's close tells the rest of the job.
struct RoundClosure {
  // Names sorted; contributor ids and weight filled.
  RoundRecord record;
  // Participants dropped for a non-finite value (not late: they were on
  // time, and refused).
  absl::flat_hash_set<MemberId> refused;
  // Participants that contributed every chunk, and those that timed out
  // (still members, incomplete), to count their missed rounds.
  std::vector<MemberId> contributed;
  std::vector<MemberId> timed_out;
  // Adaptive deadlines only: each contributor's completion lag (its last
  // chunk since the round opened), in participant order.
  std::vector<std::pair<std::string, absl::Duration>> lags;
  // Adaptive deadlines only: each fresh contributor's begin lag (its Sync
  // began since the round's clock).
  std::vector<absl::Duration> arrivals;
  // Stale contributions that gave the round a chunk: the member, its
  // anchor, and whether the round counted it (complete).
  struct Stale {
    MemberId member;
    uint64_t anchor = 0;
    bool counted = false;
  };
  std::vector<Stale> stale;
  // Fresh complete contributions that said their steps: for step budgets.
  struct Work {
    MemberId member;
    uint64_t steps = 0;
    absl::Time began;
    absl::Time completed;
  };
  std::vector<Work> work;
};

class RoundState {
 public:
  // Round `id`, opened at `opened`, of a layout of `geometry`; `buffer` is
  // memory for the sums (recycled, any size). `per_chunk_finality`: count
  // who gave each chunk and track finality (pseudo-gradient jobs);
  // `adaptive`: participants that missed kStragglerMisses rounds count as
  // persistent stragglers.
  RoundState(RoundId id, absl::Time opened, const ChunkGeometry& geometry,
             std::vector<float> buffer, bool per_chunk_finality, bool adaptive);

  RoundId id() const { return id_; }
  absl::Time opened() const { return opened_; }
  // What its deadline and its contributors' lags count from: when it
  // opened, or, for a round a stale contribution opened (HoldClock), the
  // first fresh contribution's start (StartClock); InfiniteFuture until
  // then (no deadline closes it: it waits for the members that are in
  // step, so that a stale member falls in step with them instead of
  // imposing its own phase on the round).
  absl::Time clock() const { return clock_; }
  void HoldClock() { clock_ = absl::InfiniteFuture(); }
  void StartClock(absl::Time now) {
    if (clock_ == absl::InfiniteFuture()) clock_ = now;
  }
  const Participants& participants() const { return participants_; }
  RoundAccumulator& sums() { return sums_; }

  // Adds `member` as a participant. Call FitScale after adding. Never once
  // a chunk is final from the sums (its result must not change;
  // CHECK-fails); prefinal chunks do not count.
  void AddParticipant(const MemberInfo& member);
  // `member`, a participant that has not begun, was handed a result: when
  // its Sync is expected to begin (Participant::expected) from its
  // MemberInfo's result_at, budget and step rate.
  void Expect(const MemberInfo& member);
  // Fits the sums' scale to the participants' total weight.
  void FitScale();

  // Chunk `index` of `member`'s contribution (validated: size, finite
  // values), in `code`, arrived at `now`. Ignored (kIgnored) unless the
  // member is a participant that is not gone and has not given that chunk.
  enum class Added { kIgnored, kAdded, kCompleted };
  Added Add(const MemberId& member, uint32_t index,
            absl::Span<const absl::string_view> pieces, WireCode code,
            absl::Time now);

  const Participant* Find(const MemberId& member) const;
  // A Sync of participant `member` begins: it holds `steps` local steps
  // (-1: not said). A stale one (`staleness` > 0: its delta is against a
  // state that many rounds older than the round's previous one, `anchor`)
  // counts with its weight divided by (1 + staleness). Returns false (and
  // changes nothing) unless `member` is a participant that is not gone and
  // has given nothing yet, or has given chunks against that same anchor.
  // Its weight is also multiplied by `weight_factor` (step budgets: its
  // steps / K; the sums' scale refit if it grew), or, if `weight` > 0 (the
  // Sync said one), is `weight` instead of the member's weight times
  // `weight_factor`. `now`: when it began.
  bool BeginContribution(const MemberId& member, int64_t steps, uint64_t anchor,
                         uint32_t staleness, double weight_factor,
                         absl::Time now, double weight = 0);
  // Banks `member`'s stale contribution, complete: its sums stay in the
  // round and count at the close with its weight (as a stale contribution
  // that was counted), and its participant slot is fresh again (as
  // AddParticipant made it), so that the member, answered at once with the
  // job's current state, contributes from that state to this same round
  // instead of waiting for it to close. Returns false (and changes
  // nothing) unless `member` is a participant whose complete contribution
  // is stale, no chunk is final from the sums, and nothing of it is banked
  // yet. Refits the scale.
  bool Bank(const MemberInfo& member);
  // Whether `member`'s contribution against `anchor` is banked here.
  bool Banked(const MemberId& member, uint64_t anchor) const;
  size_t num_banked() const { return banked_.size(); }

  // If `member` is a participant that has not given every chunk, marks it
  // gone (it gives nothing more; its chunks so far stay counted; with a
  // `rejected` reason, its contribution was refused: a non-finite value or
  // one that would overflow) and returns true.
  bool MarkGone(const MemberId& member, absl::string_view rejected = {});

  // Per-chunk finality (false/empty without it).
  // Whether chunk `c` is given (see above).
  bool ChunkGiven(uint32_t c) const;
  // After a contribution to chunk `c`: whether it is ready now (given, not
  // final, not `gathering`); marks the round held if it is given but the
  // job is `gathering`.
  bool ChunkReady(uint32_t c, bool gathering);
  // Every chunk that is given and not final, in order, unless `gathering`
  // (then none, and the round is held). Clears held otherwise.
  std::vector<uint32_t> ReadyChunks(bool gathering);
  void MarkFinal(uint32_t c);
  // Chunk `c` is final before any contribution: its result was computed
  // by the primary this coordinator took over from (Job::Promote); what
  // participants give of it is not summed. Only before any chunk is final
  // by MarkFinal.
  void MarkPrefinal(uint32_t c);
  bool IsFinal(uint32_t c) const { return !final_.empty() && final_[c]; }
  bool IsPrefinal(uint32_t c) const {
    return !prefinal_.empty() && prefinal_[c];
  }
  uint32_t num_final() const { return num_final_; }
  uint32_t num_prefinal() const { return num_prefinal_; }
  // Whether a chunk's result is fixed by this round's own sums (participants
  // may no longer change).
  bool any_final_from_sums() const { return num_final_ > num_prefinal_; }
  // The chunks that are final, and those that are not yet, in order.
  std::vector<uint32_t> FinalChunks() const { return ChunksWhere(true); }
  std::vector<uint32_t> PendingChunks() const { return ChunksWhere(false); }
  // Whether a given chunk waits for a gathering to end.
  bool held() const { return held_; }

  // The round closes at `now` for `reason`: its record (names sorted) and
  // what the job learns from it.
  RoundClosure Close(CloseReason reason, absl::Time now) const;

 private:
  std::vector<uint32_t> ChunksWhere(bool final) const;

  const RoundId id_;
  const absl::Time opened_;
  absl::Time clock_;
  const uint32_t num_chunks_;
  const bool adaptive_;
  Participants participants_;
  // Banked stale contributions (Bank): in the sums, no longer participants.
  std::vector<std::pair<MemberId, Participant>> banked_;
  RoundAccumulator sums_;
  // Per-chunk finality: how many participants gave each chunk, which are
  // final, how many participants are gone.
  std::vector<uint32_t> chunk_contributions_;
  std::vector<bool> final_;
  std::vector<bool> prefinal_;
  uint32_t num_final_ = 0;
  uint32_t num_prefinal_ = 0;
  uint32_t num_gone_ = 0;
  bool held_ = false;
};

// What paces a job's rounds across generations: whether the job gathers
// members into its open round (the rendezvous of `rendezvous_members`, the
// regather after a restore or a re-seed), the deadline learned from recent
// rounds (DeadlineMode::kAdaptive), and with them the close decision.
class RoundPacing {
 public:
  // `job_id` names the job in the log; `rules` from the job's policy.
  RoundPacing(std::string job_id, uint32_t rendezvous_members, bool adaptive,
              CloseRules rules);

  Gathering gathering() const;
  // Whether the job gathers members into `round` at `now`.
  bool Gathers(const RoundState& round, absl::Time now) const {
    return gathering().Active(round.participants().size(), now);
  }
  // DecideClose over `round` as of `now`.
  CloseDecision Decide(const RoundState& round, absl::Time now) const;

  // A state of `round` was restored: past the rendezvous if round > 0; the
  // open round regathers until `until`, or (members > 0) until it has
  // `members` participants and at most until it closes (members 0: rounds
  // that close before `until` leave the next ones regathering too).
  void Restored(RoundId round, absl::Time until, uint32_t members);
  // A re-seed: past the rendezvous; the next round regathers until `until`
  // or (members > 0) until it has `members` participants, and at most
  // until it closes.
  void Reseeded(absl::Time until, uint32_t members);
  // A round closed: learns from its lags (adaptive), completes the
  // rendezvous if it had enough participants, ends a regather by members
  // (a re-seed's, or a restore's that knows its members).
  void Closed(const RoundClosure& closure);

  const LearnedDeadline& learned() const { return learned_; }

 private:
  const std::string job_id_;
  const uint32_t rendezvous_members_;
  const bool adaptive_;
  const CloseRules rules_;
  // Whether a round has had rendezvous_members participants.
  bool rendezvous_done_;
  // After a restore, a re-seed or a failover, until this time an open round
  // admits members that join (again) and does not close before it (see
  // Job::RestoreState).
  absl::Time regather_until_ = absl::InfinitePast();
  // After a re-seed, a failover or a restore from a checkpoint that says how
  // many took part: the regather also ends once the open round has this
  // many participants, and when that round closes (0: only at
  // regather_until_).
  uint32_t regather_members_ = 0;
  // The contributors' completion lags and begin lags of recent rounds, and
  // what they teach.
  LagHistory lags_;
  LagHistory arrivals_;
  LearnedDeadline learned_;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_ROUND_STATE_H_
