// The members of one job and their leases: who is a member, with which
// weight, incarnation and credentials, since when, and until when its lease
// runs (its last call plus the lease TTL), and how many rounds it missed.
//
// A member is a process: its name plus its incarnation. A Join of the same
// pair again is a retry (the same member, its lease renewed); a Join of the
// name with another incarnation is a restarted process, which replaces the
// old member; a new name adds a member. A name is bound to the credentials
// it first joined with.
//
// Membership decides nothing about rounds or seeds: the job removes a member
// from its open round and its seed when a member goes (Remove, Expired).
// Time is passed in (`now`, the job's clock): no clock, no sleeps.
//
// Not thread-safe. Job owns one under its mutex (`Job::mu_` guards it) and
// calls it only with that mutex held.
#ifndef LOCALSGD_SRC_MEMBERSHIP_H_
#define LOCALSGD_SRC_MEMBERSHIP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/job_types.h"
#include "src/types.h"

namespace localsgd {

class Membership {
 public:
  // `job_id` names the job in messages and logs. A member whose last call
  // is more than `lease_ttl` before `now` has lost its lease; at most
  // `max_members` members at once. The job counts as empty since `now`.
  Membership(std::string job_id, absl::Duration lease_ttl, uint32_t max_members,
             absl::Time now);

  // What a Join finds among the members: the member a retried Join (same
  // name and incarnation) names, its lease renewed; or the member of that
  // name with another incarnation, for the caller to Remove (with its round
  // and seed) before it adds the new one; or neither (both empty).
  struct Found {
    MemberId retried;
    MemberId replaced;
  };
  // PERMISSION_DENIED: the name is bound to other credentials.
  // FAILED_PRECONDITION: a retried Join asks for another weight (a member's
  // weight is fixed while it is one). Changes nothing then. An empty name
  // finds nothing.
  absl::StatusOr<Found> FindJoined(const JoinRequestParams& params,
                                   absl::Time now);

  // Adds a new member under a fresh random id, taking part from
  // `first_round`, its lease starting at `now`. RESOURCE_EXHAUSTED (nothing
  // added) at max_members. An empty name becomes "member-<ref>". The pointer
  // (as every MemberInfo* this class returns) is valid until the next Add or
  // Remove: the table may move its entries.
  absl::StatusOr<const MemberInfo*> Add(const JoinRequestParams& params,
                                        RoundId first_round, absl::Time now);

  // The member, its lease renewed to `now`; null if it is not a member or
  // its lease ran out (even before Expired removes it).
  MemberInfo* Renew(const MemberId& member, absl::Time now);
  // The member as it is, lease or not; null if it is not a member.
  const MemberInfo* Get(const MemberId& member) const;
  // The same, to change what the job learns of it (MemberInfo::work,
  // result_at, budget); null if unknown.
  MemberInfo* Mutable(const MemberId& member);

  // Removes `member` (`why` goes to the log); returns whether it was one.
  // The job is empty since `now` if it was the last.
  bool Remove(const MemberId& member, absl::string_view why, absl::Time now);

  // The members whose lease ran out by `now` (for the caller to Remove).
  std::vector<MemberId> Expired(absl::Time now) const;

  // Members that take part in `round` (first_round <= round).
  std::vector<const MemberInfo*> TakingPartIn(RoundId round) const;

  // A round closed: a participant that contributed missed one round fewer
  // (down to 0); one that timed out one more (up to kStragglerMisses).
  // Unknown members are skipped.
  // (`round`: the round, when it contributed; MemberInfo::last_counted_round)
  void CountRound(const MemberId& member, bool contributed, RoundId round = 0);
  // A stale contribution of `member` against `anchor` gave a round chunks
  // (`counted`: the round counted it whole); see MemberInfo::stale_anchor.
  void NoteStale(const MemberId& member, uint64_t anchor, bool counted);

  // PERMISSION_DENIED if `member` is bound to credentials other than
  // `principal`; OK otherwise (also for an unknown member).
  absl::Status CheckPrincipal(const MemberId& member,
                              absl::string_view principal) const;
  // NOT_FOUND naming the member by its reference (never its id) and why.
  absl::Status NotFound(const MemberId& member) const;

  // A primary's members as its standby gets them (replication): OK, or
  // INVALID_ARGUMENT naming the first that is not well formed (an id that
  // is not a member id, an empty name, a weight that is not finite and
  // positive, an id or a name twice) or more than `max_members` of them.
  // `what` starts the message.
  static absl::Status CheckReplicated(const std::vector<MemberInfo>& members,
                                      uint32_t max_members,
                                      absl::string_view what);
  // Replaces every member by `members` (checked by CheckReplicated), each
  // as given (id, name, incarnation, weight, credentials, first round,
  // missed rounds) with its lease starting at `now`: the standby's clock,
  // not the primary's.
  void Restore(const std::vector<MemberInfo>& members, absl::Time now);
  // Every member's lease starts again at `now` (a promoted standby: the
  // members had no coordinator to call while it took over).
  void RenewAll(absl::Time now);

  // Counts the job as empty since `now` (a restore into a job that has no
  // members).
  void ResetEmptySince(absl::Time now) { empty_since_ = now; }
  // Whether the job has had no member for at least `ttl` by `now`.
  bool EmptyFor(absl::Time now, absl::Duration ttl) const;

  // Every member, sorted by name.
  std::vector<MemberInfo> SortedByName() const;
  size_t size() const { return members_.size(); }

 private:
  const std::string job_id_;
  const absl::Duration lease_ttl_;
  const uint32_t max_members_;
  absl::flat_hash_map<MemberId, MemberInfo> members_;
  // When the job last became empty (or was created).
  absl::Time empty_since_;
  absl::BitGen bitgen_;  // member ids
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_MEMBERSHIP_H_
