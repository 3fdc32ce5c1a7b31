#include "src/job_status.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/observer.h"

namespace localsgd {

void RoundHistory::Add(RoundRecord record) {
  records_.push_front(std::move(record));
  while (records_.size() > max_rounds_) records_.pop_back();
}

const RoundRecord* RoundHistory::Find(RoundId round) const {
  for (const RoundRecord& record : records_) {
    if (record.round == round) return &record;
  }
  return nullptr;
}

void RoundHistory::MarkLate(RoundId round, const std::string& name,
                            uint64_t steps) {
  for (RoundRecord& record : records_) {
    if (record.round != round) continue;
    record.steps.late += steps;
    if (std::find(record.late.begin(), record.late.end(), name) ==
        record.late.end()) {
      record.late.push_back(name);
      std::sort(record.late.begin(), record.late.end());
    }
    return;
  }
}

std::vector<RoundRecord> RoundHistory::Recent(uint32_t max) const {
  std::vector<RoundRecord> out;
  for (const RoundRecord& record : records_) {
    if (out.size() >= max) break;
    out.push_back(record);
  }
  return out;
}

SyncResult CommittedResult(const RoundRecord& record,
                           std::shared_ptr<const StateSnapshot> state,
                           const MemberId& member, bool refused) {
  SyncResult result;
  result.round = record.round;
  result.contributed = record.contributor_ids.contains(member);
  result.late =
      !result.contributed && record.reason != CloseReason::kSeed && !refused;
  result.contributors = static_cast<uint32_t>(record.contributors.size());
  result.contributor_weight = record.contributor_weight;
  result.state_id = state->id;
  result.delta = state->previous_id != 0;
  result.state = std::move(state);
  return result;
}

SyncResult LatestResult(const RoundHistory& history,
                        std::shared_ptr<const StateSnapshot> state,
                        const MemberId& member, RoundId asked_round,
                        uint64_t anchor, absl::string_view member_name) {
  SyncResult result;
  result.round = state->round;
  result.state_id = state->id;
  // A retry of the round that closed last, from the state before it: the
  // round's delta applies.
  result.delta = state->previous_id != 0 && asked_round == state->round &&
                 anchor == state->previous_id;
  if (const RoundRecord* record = history.Find(state->round)) {
    // Counted only if this Sync was for that round (a retry) or a seed's
    // retry: a member that contributed to the latest round and now asks for
    // another (an older round, or the next one against another anchor) sent
    // a contribution that was not averaged, and adopts.
    const bool counted =
        record->replicated
            ? !member_name.empty() &&
                  std::binary_search(record->contributors.begin(),
                                     record->contributors.end(), member_name)
            : record->contributor_ids.contains(member);
    result.contributed =
        (asked_round == state->round || asked_round == 0) && counted;
    result.contributors = static_cast<uint32_t>(record->contributors.size());
    result.contributor_weight = record->contributor_weight;
  }
  result.late = asked_round != 0 && !result.contributed;
  result.state = std::move(state);
  return result;
}

void DescribeOpenRound(const RoundState& round, CloseDecision decision,
                       JobStatusSnapshot& status, const OutlierGuard* guard) {
  status.round_open = true;
  status.open_round = round.id();
  status.open_round_participants.clear();
  status.open_round_contributed.clear();
  std::vector<std::string> held;
  for (const auto& [id, p] : round.participants()) {
    status.open_round_participants.push_back(p.name);
    bool delivered = p.complete();
    if (!delivered && !p.gone && guard != nullptr && guard->any_held()) {
      delivered = true;
      for (uint32_t c = 0; c < p.got.size() && delivered; ++c) {
        delivered = p.got[c] || guard->Holds(c, id);
      }
      if (delivered) held.push_back(p.name);
    }
    if (delivered) status.open_round_contributed.push_back(p.name);
  }
  if (!held.empty()) {
    std::sort(held.begin(), held.end());
    std::vector<std::string>& waiting = decision.waiting_for;
    for (const std::string& name : held) {
      waiting.erase(std::remove(waiting.begin(), waiting.end(), name),
                    waiting.end());
    }
    absl::StrAppend(&decision.why_open, decision.why_open.empty() ? "" : "; ",
                    "the outlier guard holds what ", absl::StrJoin(held, ", "),
                    " gave until it has three contributions of a chunk to "
                    "judge them by (its cold start)");
  }
  status.open_round_decision = std::move(decision);
  std::sort(status.open_round_participants.begin(),
            status.open_round_participants.end());
  std::sort(status.open_round_contributed.begin(),
            status.open_round_contributed.end());
}

std::vector<std::string> Stragglers(const std::vector<MemberInfo>& members) {
  std::vector<std::string> names;
  for (const MemberInfo& m : members) {
    if (m.missed_rounds >= kStragglerMisses) names.push_back(m.name);
  }
  return names;
}

std::string DescribeCommit(const RoundRecord& record) {
  if (record.reason == CloseReason::kSeed) {
    return absl::StrCat(
        "seeded by ", record.contributors[0],
        record.round > 0 ? absl::StrCat(" at round ", record.round) : "");
  }
  std::string line = absl::StrCat(
      "round ", record.round, " closed (", CloseReasonName(record.reason),
      ") in ", absl::FormatDuration(record.closed - record.opened),
      "; contributors [", absl::StrJoin(record.contributors, ", "), "]");
  if (!record.dropped.empty()) {
    absl::StrAppend(&line, "; dropped [", absl::StrJoin(record.dropped, ", "),
                    "]");
  }
  if (!record.timed_out.empty()) {
    absl::StrAppend(&line, "; timed out [",
                    absl::StrJoin(record.timed_out, ", "), "]");
  }
  return line;
}

RoundClosedEvent ClosedEvent(absl::string_view job_id,
                             const RoundRecord& record) {
  RoundClosedEvent event;
  event.job_id = std::string(job_id);
  event.round = record.round;
  event.reason = record.reason;
  event.duration = record.closed - record.opened;
  event.participants = static_cast<uint32_t>(record.participants.size());
  event.contributors = static_cast<uint32_t>(record.contributors.size());
  event.dropped = static_cast<uint32_t>(record.dropped.size());
  event.timed_out = static_cast<uint32_t>(record.timed_out.size());
  event.steps = record.steps;
  return event;
}

}  // namespace localsgd
