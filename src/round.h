// The parts of a round that do not need a job around them: who takes part
// and how far each has come, the pure decision whether the round closes now
// (and why not, if it stays open), and the accumulator of the contributions.
//
// No locks, no clock, no I/O: Job (src/job.h) owns one OpenRound under its
// lock, feeds it chunks and asks DecideClose after every change and tick.
#ifndef LOCALSGD_SRC_ROUND_H_
#define LOCALSGD_SRC_ROUND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

enum class CloseReason { kComplete, kDeadline, kMembersGone, kSeed };
absl::string_view CloseReasonName(CloseReason reason);

// One participant of a round: how many of its chunks arrived, and whether it
// went away (left, lost its lease, dropped for a non-finite value) first.
struct Participant {
  std::string name;
  float weight = 1;
  std::vector<bool> got;
  uint32_t received = 0;
  bool gone = false;
  // Its contribution refused mid-stream: a non-finite value
  // (NonFinitePolicy::kDrop) or one that would overflow the state (the
  // finite-state guard); also gone. `rejected` says why.
  bool nonfinite = false;
  std::string rejected;
  // When its last chunk arrived (complete()).
  absl::Time completed = absl::InfiniteFuture();
  // A persistent straggler (JobSettings.deadline_mode adaptive): its misses
  // reached kStragglerMisses (MemberInfo::missed_rounds); a learned
  // deadline does not wait long for it.
  bool straggler = false;
  // Its Sync so far: when it began (InfinitePast: not yet; the fields
  // below are then what it said), the local steps it holds (-1: not
  // said), and for a stale contribution (JobSettings::max_staleness) its
  // anchor and how many rounds older than the round's previous state that
  // is.
  absl::Time began_at = absl::InfinitePast();
  // When its Sync is expected to begin (step budgets: when it was handed
  // its last result plus its budget at its step rate); InfinitePast when
  // not known.
  absl::Time expected = absl::InfinitePast();
  // How long one of its local steps takes (step budgets; zero when not
  // known): it cannot be timed closer than that (budgets are whole steps).
  absl::Duration step_time;
  int64_t steps = -1;
  uint64_t anchor = 0;
  uint32_t staleness = 0;
  bool began() const { return began_at != absl::InfinitePast(); }
  bool complete() const { return received == got.size(); }
};
using Participants = absl::flat_hash_map<MemberId, Participant>;

// The coordinator's rules for closing a round before everyone is in.
struct CloseRules {
  // Zero: no deadline.
  absl::Duration round_deadline = absl::ZeroDuration();
  // Complete contributions a round needs to close at its deadline.
  uint32_t min_quorum = 1;
  // The job merges stale contributions (JobSettings::max_staleness): a
  // participant that misses the round loses nothing (its delta goes into
  // a later round, discounted), so a learned deadline waits for one that
  // has not begun its Sync only as long as contributors usually take to
  // begin (LearnedDeadline::arrival).
  bool stale_merged = false;
};

// Whether the job still gathers members into its open round: then the round
// admits members that join, and closes only at its deadline.
struct Gathering {
  // Until some round has had this many participants (rendezvous_pending),
  // the open round gathers.
  bool rendezvous_pending = false;
  uint32_t rendezvous_members = 0;
  // After a restore or a re-seed, until this time (see Job::RestoreState,
  // Job::BeginSync), or (if > 0) until the round has regather_members
  // participants.
  absl::Time regather_until = absl::InfinitePast();
  uint32_t regather_members = 0;

  bool Regathering(size_t participants, absl::Time now) const {
    return now < regather_until &&
           (regather_members == 0 || participants < regather_members);
  }
  // Whether a round with `participants` participants gathers at `now`.
  bool Active(size_t participants, absl::Time now) const {
    return Regathering(participants, now) ||
           (rendezvous_pending && participants < rendezvous_members);
  }
};

// The deadline a job of JobSettings.adaptive_deadline learns from its
// recent rounds (LagHistory). Zero durations: nothing learned yet.
struct LearnedDeadline {
  // How long its rounds usually take for the members that contribute: of
  // the completion lags (a contributor's last chunk since its round
  // opened) of recent rounds, median + 3 MAD, the MAD at least 5% of the
  // median and at least 1 ms (one-off jitter does not shrink it to nothing).
  absl::Duration usual;
  // How long a round waits for a participant that is not a persistent
  // straggler: 2 x usual (a one-off delay within it still counts; a member
  // slower than that misses rounds and becomes a persistent straggler).
  absl::Duration patient;
  // How long after the round's clock its contributors usually begin their
  // Syncs: of the begin lags of recent rounds, median + 3 MAD (the same
  // floors). A job that merges stale contributions waits no longer for a
  // participant that has not begun (see DecideClose).
  absl::Duration arrival;
  bool learned() const { return usual > absl::ZeroDuration(); }
};

// Missed rounds (timed out) net of contributions that make a member a
// persistent straggler: each miss adds one, up to this; each contribution
// takes one off. Two misses in a row make one; a straggler that is on time
// once is waited for patiently in its next round, and is one again if it
// misses that.
inline constexpr uint32_t kStragglerMisses = 2;

// The recent completion lags of a job's contributors, and what they teach.
// Not thread-safe (its job serializes calls).
class LagHistory {
 public:
  // Lags kept (the most recent), and the fewest that teach a deadline.
  static constexpr size_t kMaxLags = 64;
  static constexpr size_t kMinLags = 4;

  void Add(absl::Duration lag);
  LearnedDeadline Learn() const;
  size_t size() const { return lags_.size(); }

 private:
  std::vector<absl::Duration> lags_;  // a ring of kMaxLags
  size_t next_ = 0;
};

// What DecideClose says of an open round.
struct CloseDecision {
  bool close = false;
  CloseReason reason = CloseReason::kComplete;  // when close
  // When it stays open: why, in words ("waiting for 2 of 4 participants
  // (a, b)", "gathering: 3 of 4 rendezvous members"), and the participants
  // it waits for (sorted), and the time at which its deadline would close
  // it if the quorum is in (InfiniteFuture without a deadline).
  std::string why_open;
  std::vector<std::string> waiting_for;
  absl::Time deadline = absl::InfiniteFuture();
};

// The close decision, a pure function of the round's state and `now`. The
// round closes
//   (kComplete)     when not gathering and every participant is complete;
//   (kMembersGone)  when not gathering and every participant is complete or
//                   gone, some gone;
//   (kDeadline)     when rules.round_deadline has passed since `opened` and
//                   at least rules.min_quorum participants are complete;
//                   or, with a `learned` deadline and not gathering, at
//                   least rules.min_quorum participants are complete and
//                   the learned deadline has passed since `opened`: the
//                   longest wait among the participants it waits for,
//                   learned.usual for a persistent straggler and
//                   learned.patient for any other, but with
//                   rules.stale_merged, for one that has not begun its
//                   Sync, at most learned.arrival; each counted from when
//                   the participant is expected to begin (Participant::
//                   expected) where that is later than `opened`, by at
//                   most learned.usual.
CloseDecision DecideClose(const Participants& participants, absl::Time opened,
                          const Gathering& gathering, const CloseRules& rules,
                          absl::Time now,
                          const LearnedDeadline& learned = LearnedDeadline());

// The weighted sums of one round, chunk by chunk, in fp32, O(model) memory
// whatever the number of members. Overflow: the sums are of
// weight * 2^-scale_exp * value, with scale_exp the least exponent for
// which the participants' weights times 2^-scale_exp sum to at most 1 (a
// power of two: exact), so every partial sum is bounded by the largest
// |value| and finite inputs never overflow.
//
// Not thread-safe: its owner (the job) serializes calls.
class RoundAccumulator {
 public:
  RoundAccumulator() = default;
  // Starts from `buffer` (recycled memory, resized and zeroed) for a
  // geometry of `geometry`.
  RoundAccumulator(std::vector<float> buffer, const ChunkGeometry& geometry);

  // Raises the scale (rescaling the sums exactly) so that participants of
  // `total_weight` in all stay bounded. Call whenever the participants
  // change.
  void FitScale(double total_weight);

  // Adds chunk `index` (elements at its offset), given as the pieces of its
  // wire form in `code`, with `weight`. The payload must have been
  // validated (size, finite values).
  void Add(uint32_t index, absl::Span<const absl::string_view> pieces,
           WireCode code, float weight);

  // Total weight that went into chunk `index` (0: none).
  double chunk_weight(uint32_t index) const { return chunk_weight_[index]; }
  // Chunk `index`'s sums as they are scaled: sum_i w_i * 2^-scale * v_i.
  absl::Span<float> scaled_sums(uint32_t index);
  // What chunk `index`'s scaled sums divide by to give its weighted mean:
  // chunk_weight * 2^-scale. Requires chunk_weight(index) > 0.
  double scaled_weight(uint32_t index) const;

  const ChunkGeometry& geometry() const { return geometry_; }
  // Hands the buffer over (the accumulator is empty afterwards).
  std::vector<float> TakeBuffer() { return std::move(sums_); }

 private:
  ChunkGeometry geometry_;
  std::vector<float> sums_;
  int scale_exp_ = 0;
  std::vector<double> chunk_weight_;  // unscaled
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_ROUND_H_
