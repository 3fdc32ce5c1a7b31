#include "src/membership.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "src/member_ref.h"
#include "src/round.h"

namespace localsgd {
namespace {

std::string RandomMemberHex(absl::BitGen& gen) {
  const uint64_t hi = absl::Uniform<uint64_t>(gen);
  const uint64_t lo = absl::Uniform<uint64_t>(gen);
  return absl::StrFormat("%016x%016x", hi, lo);
}

}  // namespace

Membership::Membership(std::string job_id, absl::Duration lease_ttl,
                       uint32_t max_members, absl::Time now)
    : job_id_(std::move(job_id)),
      lease_ttl_(lease_ttl),
      max_members_(max_members),
      empty_since_(now) {}

absl::StatusOr<Membership::Found> Membership::FindJoined(
    const JoinRequestParams& params, absl::Time now) {
  Found found;
  if (params.member_name.empty()) return found;
  for (auto& [mid, m] : members_) {
    if (m.name != params.member_name) continue;
    // The name is the client's choice: a Join under another member's name
    // must not take over (or replace) that member unless it has the
    // member's credentials.
    if (m.principal != params.principal) {
      return absl::PermissionDeniedError(absl::StrCat(
          "member name '", params.member_name, "' of job '", job_id_,
          "' is bound to other credentials; join under another name, or "
          "wait for that member to leave or lose its lease"));
    }
    if (m.incarnation != params.incarnation) {
      found.replaced = mid;
      return found;
    }
    // A retried Join. The weight is fixed while the member is one: a
    // different one is refused, not silently ignored.
    if (m.weight != params.weight) {
      return absl::FailedPreconditionError(absl::StrCat(
          "member '", m.name, "' of job '", job_id_, "' joined with weight ",
          m.weight, "; this Join of the same name and incarnation asks for ",
          params.weight,
          ": a member's weight is fixed while it is a member (Leave and "
          "Join again, or restart with a new incarnation, to change it)"));
    }
    m.last_seen = now;
    found.retried = mid;
    return found;
  }
  return found;
}

absl::StatusOr<const MemberInfo*> Membership::Add(
    const JoinRequestParams& params, RoundId first_round, absl::Time now) {
  if (members_.size() >= max_members_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job_id_, "' has ", members_.size(),
                     " members, the limit (--max_members_per_job)"));
  }
  MemberId id;
  do {
    id = MemberId(RandomMemberHex(bitgen_));
  } while (members_.contains(id));
  MemberInfo info;
  info.id = id;
  // Coordinator::Join refuses an empty name; a job used directly names such
  // a member by its reference, never by its id (the member's credential).
  info.name = params.member_name.empty()
                  ? absl::StrCat("member-", MemberRef(id))
                  : params.member_name;
  info.weight = params.weight;
  info.incarnation = params.incarnation;
  info.principal = params.principal;
  info.joined_at = now;
  info.last_seen = now;
  info.first_round = first_round;
  LOG(INFO) << "job " << job_id_ << ": member " << info.name << " ("
            << MemberRef(id) << ", weight " << info.weight << ") joined; "
            << members_.size() + 1 << " members; takes part from round "
            << info.first_round;
  return &members_.emplace(id, std::move(info)).first->second;
}

MemberInfo* Membership::Renew(const MemberId& member, absl::Time now) {
  auto it = members_.find(member);
  if (it == members_.end()) return nullptr;
  // An expired lease is gone even before Expired() lets the job remove it.
  if (now - it->second.last_seen > lease_ttl_) return nullptr;
  it->second.last_seen = now;
  return &it->second;
}

absl::Status Membership::CheckReplicated(const std::vector<MemberInfo>& members,
                                         uint32_t max_members,
                                         absl::string_view what) {
  if (members.size() > max_members) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", members.size(), " members, more than the ",
                     max_members, " a job may have here"));
  }
  absl::flat_hash_set<absl::string_view> ids, names;
  for (size_t i = 0; i < members.size(); ++i) {
    const MemberInfo& m = members[i];
    const std::string which = absl::StrCat(what, ": member ", i);
    if (!MemberId::IsWellFormed(m.id.str())) {
      return absl::InvalidArgumentError(
          absl::StrCat(which, " has no well-formed member id"));
    }
    if (m.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(which, " has no name"));
    }
    if (!std::isfinite(m.weight) || m.weight <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(which, " ('", m.name, "') has weight ", m.weight,
                       "; a weight is finite and positive"));
    }
    if (!ids.insert(m.id.str()).second || !names.insert(m.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          which, " ('", m.name, "') repeats another's id or name"));
    }
  }
  return absl::OkStatus();
}

void Membership::Restore(const std::vector<MemberInfo>& members,
                         absl::Time now) {
  const bool was_empty = members_.empty();
  members_.clear();
  for (const MemberInfo& m : members) {
    MemberInfo info = m;
    info.last_seen = now;
    members_.emplace(info.id, std::move(info));
  }
  if (members_.empty() && !was_empty) empty_since_ = now;
}

void Membership::RenewAll(absl::Time now) {
  for (auto& [id, m] : members_) m.last_seen = now;
}

const MemberInfo* Membership::Get(const MemberId& member) const {
  auto it = members_.find(member);
  return it == members_.end() ? nullptr : &it->second;
}

MemberInfo* Membership::Mutable(const MemberId& member) {
  auto it = members_.find(member);
  return it == members_.end() ? nullptr : &it->second;
}

bool Membership::Remove(const MemberId& member, absl::string_view why,
                        absl::Time now) {
  auto it = members_.find(member);
  if (it == members_.end()) return false;
  LOG(INFO) << "job " << job_id_ << ": member " << it->second.name << " ("
            << MemberRef(member) << ") " << why << "; " << members_.size() - 1
            << " members left";
  members_.erase(it);
  if (members_.empty()) empty_since_ = now;
  return true;
}

std::vector<MemberId> Membership::Expired(absl::Time now) const {
  std::vector<MemberId> expired;
  for (const auto& [id, m] : members_) {
    if (now - m.last_seen > lease_ttl_) expired.push_back(id);
  }
  return expired;
}

std::vector<const MemberInfo*> Membership::TakingPartIn(RoundId round) const {
  std::vector<const MemberInfo*> out;
  for (const auto& [id, m] : members_) {
    if (m.first_round <= round) out.push_back(&m);
  }
  return out;
}

void Membership::CountRound(const MemberId& member, bool contributed,
                            RoundId round) {
  auto it = members_.find(member);
  if (it == members_.end()) return;
  if (contributed && round > it->second.last_counted_round) {
    it->second.last_counted_round = round;
  }
  uint32_t& missed = it->second.missed_rounds;
  if (contributed) {
    if (missed > 0) --missed;
  } else if (missed < kStragglerMisses) {
    ++missed;
  }
}

void Membership::NoteStale(const MemberId& member, uint64_t anchor,
                           bool counted) {
  auto it = members_.find(member);
  if (it == members_.end()) return;
  it->second.stale_anchor = anchor;
  it->second.stale_counted = counted;
}

absl::Status Membership::CheckPrincipal(const MemberId& member,
                                        absl::string_view principal) const {
  auto it = members_.find(member);
  if (it == members_.end() || it->second.principal == principal) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("member ", it->second.name, " of job '", job_id_,
                   "' is bound to other credentials than this call's"));
}

absl::Status Membership::NotFound(const MemberId& member) const {
  return absl::NotFoundError(absl::StrCat(
      "member ", MemberRef(member), " is not in job '", job_id_,
      "' (it never joined, left, or made no call for the lease of ",
      absl::FormatDuration(lease_ttl_), "); join again"));
}

bool Membership::EmptyFor(absl::Time now, absl::Duration ttl) const {
  return members_.empty() && now - empty_since_ >= ttl;
}

std::vector<MemberInfo> Membership::SortedByName() const {
  std::vector<MemberInfo> out;
  out.reserve(members_.size());
  for (const auto& [id, m] : members_) out.push_back(m);
  std::sort(
      out.begin(), out.end(),
      [](const MemberInfo& a, const MemberInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace localsgd
