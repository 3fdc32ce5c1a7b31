// A job's status records: the records of its closed rounds (RoundHistory),
// what a member is told of a closed round (its SyncResult), the parts of a
// JobStatusSnapshot that the job's parts describe, and the log line and
// the observer's event of a new state.
//
// Pure functions and one plain container: no locks, no clock, no I/O. Not
// thread-safe: Job owns one RoundHistory under its mutex (`Job::mu_`) and
// calls it only with that held.
#ifndef LOCALSGD_SRC_JOB_STATUS_H_
#define LOCALSGD_SRC_JOB_STATUS_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "src/job_types.h"
#include "src/observer.h"
#include "src/outlier_guard.h"
#include "src/round.h"
#include "src/round_state.h"
#include "src/types.h"

namespace localsgd {

// The records of a job's most recent closed rounds (and seeds), most recent
// first, at most `max_rounds` of them: for status, and to answer a member
// that asks after its round closed.
class RoundHistory {
 public:
  explicit RoundHistory(uint32_t max_rounds) : max_rounds_(max_rounds) {}

  // Keeps `record` as the most recent; drops the oldest beyond max_rounds.
  void Add(RoundRecord record);
  // The most recent record of `round`; null if none is kept.
  const RoundRecord* Find(RoundId round) const;
  // Notes that member `name` came late for `round` (once; names sorted)
  // with a delta of `steps` local steps (added to the record's late steps).
  // Nothing if no record of `round` is kept.
  void MarkLate(RoundId round, const std::string& name, uint64_t steps = 0);
  // The most recent `max` records, most recent first.
  std::vector<RoundRecord> Recent(uint32_t max) const;

 private:
  const uint32_t max_rounds_;
  std::deque<RoundRecord> records_;
};

// What a waiter of the round (or seed) of `record` is told when it commits
// `state`: whether it contributed; late if it did not, unless `refused`
// (dropped for a non-finite value: on time, refused) or the record is a
// seed's (there was nothing to be late for); the round's delta when the
// state has one (every waiter of a round held its previous state).
SyncResult CommittedResult(const RoundRecord& record,
                           std::shared_ptr<const StateSnapshot> state,
                           const MemberId& member, bool refused);

// What `member` is told when it asks for `asked_round`, holding the state
// `anchor`, after that round closed: the current `state` (required), with
// the latest round's delta only for a retry of that round from the state
// before it; contributed as `history` recorded it, and only if
// `asked_round` is the latest round (or 0, the seed); late unless it asked
// for the seed.
// `member_name`: the member's, for a record that came from a primary
// (RoundRecord::replicated).
SyncResult LatestResult(const RoundHistory& history,
                        std::shared_ptr<const StateSnapshot> state,
                        const MemberId& member, RoundId asked_round,
                        uint64_t anchor, absl::string_view member_name = {});

// JobStatusSnapshot parts:
// the open round: its id, participants and those that contributed every
// chunk (sorted), and `decision` (DecideClose as of the status call). With
// `guard`, a participant whose every chunk is given or held by the outlier
// guard (its cold start: OutlierGuard::Holds) has contributed too, and the
// decision no longer says it waits for it but that the guard holds it;
void DescribeOpenRound(const RoundState& round, CloseDecision decision,
                       JobStatusSnapshot& status,
                       const OutlierGuard* guard = nullptr);
// the members (sorted by name) that count as persistent stragglers.
std::vector<std::string> Stragglers(const std::vector<MemberInfo>& members);

// The log line of a new state: "seeded by a" (" at round r" for a re-seed)
// or "round r closed (reason) in d; contributors [..]", with "; dropped
// [..]" and "; timed out [..]" when there were any.
std::string DescribeCommit(const RoundRecord& record);
// The observer's event of a new state of job `job_id`.
RoundClosedEvent ClosedEvent(absl::string_view job_id,
                             const RoundRecord& record);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_JOB_STATUS_H_
