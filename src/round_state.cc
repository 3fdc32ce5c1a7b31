#include "src/round_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace localsgd {

// ---------------------------------------------------------------------------
// RoundState

RoundState::RoundState(RoundId id, absl::Time opened,
                       const ChunkGeometry& geometry, std::vector<float> buffer,
                       bool per_chunk_finality, bool adaptive)
    : id_(id),
      opened_(opened),
      clock_(opened),
      num_chunks_(geometry.num_chunks()),
      adaptive_(adaptive),
      sums_(std::move(buffer), geometry) {
  if (per_chunk_finality) {
    chunk_contributions_.assign(num_chunks_, 0);
    final_.assign(num_chunks_, false);
  }
}

namespace {

// When `member`'s next Sync is expected to begin (its last result's time
// plus its budget at its step rate) and how long its steps take; unknown
// (InfinitePast, zero) unless all are known.
void SetExpected(const MemberInfo& member, Participant& p) {
  const double rate = member.work.steps_per_second();
  if (member.result_at == absl::InfinitePast() || member.budget == 0 ||
      !(rate > 0)) {
    p.expected = absl::InfinitePast();
    p.step_time = absl::ZeroDuration();
    return;
  }
  p.expected = member.result_at + absl::Seconds(member.budget / rate);
  p.step_time = absl::Seconds(1 / rate);
}

}  // namespace

void RoundState::AddParticipant(const MemberInfo& member) {
  Participant p;
  p.name = member.name;
  p.weight = static_cast<float>(member.weight);
  p.got.assign(num_chunks_, false);
  p.straggler = adaptive_ && member.missed_rounds >= kStragglerMisses;
  SetExpected(member, p);
  participants_.emplace(member.id, std::move(p));
}

void RoundState::Expect(const MemberInfo& member) {
  auto it = participants_.find(member.id);
  if (it == participants_.end() || it->second.began() ||
      it->second.received > 0) {
    return;
  }
  SetExpected(member, it->second);
}

void RoundState::FitScale() {
  // Rescaling would scale the chunks that hold results already.
  CHECK_EQ(num_final_, num_prefinal_) << "participants changed after finality";
  double total = 0;
  for (const auto& [pid, p] : participants_) total += p.weight;
  for (const auto& [pid, p] : banked_) total += p.weight;
  sums_.FitScale(total);
}

bool RoundState::Bank(const MemberInfo& member) {
  auto it = participants_.find(member.id);
  if (it == participants_.end() || any_final_from_sums()) return false;
  const Participant& p = it->second;
  if (p.gone || !p.complete() || p.staleness == 0) return false;
  for (const auto& [id, banked] : banked_) {
    if (id == member.id) return false;
  }
  if (!chunk_contributions_.empty()) {
    for (uint32_t c = 0; c < num_chunks_; ++c) --chunk_contributions_[c];
  }
  banked_.emplace_back(member.id, std::move(it->second));
  participants_.erase(it);
  AddParticipant(member);
  FitScale();
  return true;
}

bool RoundState::Banked(const MemberId& member, uint64_t anchor) const {
  for (const auto& [id, p] : banked_) {
    if (id == member && p.anchor == anchor) return true;
  }
  return false;
}

RoundState::Added RoundState::Add(const MemberId& member, uint32_t index,
                                  absl::Span<const absl::string_view> pieces,
                                  WireCode code, absl::Time now) {
  auto it = participants_.find(member);
  if (it == participants_.end() || it->second.gone || it->second.got[index]) {
    return Added::kIgnored;
  }
  Participant& p = it->second;
  // A prefinal chunk's result is fixed: what is given of it is not summed.
  if (!IsPrefinal(index)) sums_.Add(index, pieces, code, p.weight);
  p.got[index] = true;
  if (!chunk_contributions_.empty()) ++chunk_contributions_[index];
  if (++p.received < num_chunks_) return Added::kAdded;
  p.completed = now;
  return Added::kCompleted;
}

const Participant* RoundState::Find(const MemberId& member) const {
  auto it = participants_.find(member);
  return it == participants_.end() ? nullptr : &it->second;
}

bool RoundState::BeginContribution(const MemberId& member, int64_t steps,
                                   uint64_t anchor, uint32_t staleness,
                                   double weight_factor, absl::Time now,
                                   double weight) {
  auto it = participants_.find(member);
  if (it == participants_.end() || it->second.gone) return false;
  Participant& p = it->second;
  if (p.received > 0 || p.began()) {
    // A retry: the same contribution again, or nothing.
    if (p.anchor != (staleness > 0 ? anchor : 0)) return false;
    if (steps >= 0) p.steps = steps;
    return true;
  }
  p.began_at = now;
  p.steps = steps;
  const float before = p.weight;
  if (staleness > 0) {
    p.anchor = anchor;
    p.staleness = staleness;
  }
  if (weight > 0) {
    p.weight = static_cast<float>(weight / (1.0 + staleness));
  } else if (staleness > 0 || weight_factor != 1.0) {
    p.weight = static_cast<float>(static_cast<double>(p.weight) *
                                  weight_factor / (1.0 + staleness));
  }
  // Nothing it gives is summed yet, and no chunk is final from the sums
  // (it has not given any): a lower weight keeps the scale bound, a higher
  // one refits it.
  if (p.weight > before) FitScale();
  return true;
}

bool RoundState::MarkGone(const MemberId& member, absl::string_view rejected) {
  auto it = participants_.find(member);
  if (it == participants_.end() || it->second.complete()) return false;
  Participant& p = it->second;
  if (!p.gone) ++num_gone_;
  p.gone = true;
  if (!rejected.empty() && !p.nonfinite) {
    p.nonfinite = true;
    p.rejected = std::string(rejected);
  }
  return true;
}

bool RoundState::ChunkGiven(uint32_t c) const {
  if (chunk_contributions_.empty()) return false;
  if (chunk_contributions_[c] >= participants_.size()) return true;
  // A participant that is gone (left, lost its lease, dropped for a
  // non-finite value) gives nothing more: the chunk is the mean of those
  // that gave it, as at the close.
  if (num_gone_ == 0 || chunk_contributions_[c] == 0) return false;
  for (const auto& [id, p] : participants_) {
    if (!p.gone && !p.got[c]) return false;
  }
  return true;
}

bool RoundState::ChunkReady(uint32_t c, bool gathering) {
  if (IsFinal(c) || !ChunkGiven(c)) return false;
  // While the round gathers, a member that joins becomes a participant and
  // may still give this chunk.
  if (gathering) {
    held_ = true;
    return false;
  }
  return true;
}

std::vector<uint32_t> RoundState::ReadyChunks(bool gathering) {
  std::vector<uint32_t> ready;
  if (final_.empty()) return ready;
  if (gathering) {
    held_ = true;
    return ready;
  }
  held_ = false;
  for (uint32_t c = 0; c < num_chunks_; ++c) {
    if (!final_[c] && ChunkGiven(c)) ready.push_back(c);
  }
  return ready;
}

void RoundState::MarkFinal(uint32_t c) {
  CHECK(!final_[c]) << "chunk " << c << " of round " << id_ << " final twice";
  final_[c] = true;
  ++num_final_;
}

void RoundState::MarkPrefinal(uint32_t c) {
  CHECK(!any_final_from_sums()) << "prefinal chunk after a final one";
  if (prefinal_.empty()) prefinal_.assign(num_chunks_, false);
  MarkFinal(c);
  prefinal_[c] = true;
  ++num_prefinal_;
}

std::vector<uint32_t> RoundState::ChunksWhere(bool final) const {
  std::vector<uint32_t> indices;
  for (uint32_t c = 0; c < final_.size(); ++c) {
    if (final_[c] == final) indices.push_back(c);
  }
  return indices;
}

RoundClosure RoundState::Close(CloseReason reason, absl::Time now) const {
  RoundClosure out;
  RoundRecord& record = out.record;
  record.round = id_;
  record.reason = reason;
  record.opened = opened_;
  record.closed = now;
  for (const auto& [id, p] : participants_) {
    record.participants.push_back(p.name);
    const uint64_t steps = p.began() && p.steps > 0 ? p.steps : 0;
    if (p.anchor != 0 && p.received > 0) {
      out.stale.push_back({id, p.anchor, p.complete()});
    }
    if (p.complete()) {
      if (p.staleness == 0 && steps > 0) {
        out.work.push_back({id, steps, p.began_at, p.completed});
      }
      record.steps.merged += steps;
      if (p.staleness > 0) record.steps.merged_stale += steps;
      record.contributors.push_back(p.name);
      record.contributor_ids.insert(id);
      record.contributor_weight += p.weight;
      out.contributed.push_back(id);
      // A stale contribution's lag says when its member came back, not how
      // long the round's work takes.
      if (adaptive_ && p.staleness == 0) {
        out.lags.emplace_back(p.name, p.completed - clock_);
        if (p.began()) {
          out.arrivals.push_back(
              std::max(absl::ZeroDuration(), p.began_at - clock_));
        }
      }
    } else if (p.gone) {
      record.dropped.push_back(p.name);
      (p.nonfinite ? record.steps.refused : record.steps.gone) += steps;
      if (p.nonfinite) {
        out.refused.insert(id);
        record.rejected.push_back(absl::StrCat(p.name, ": ", p.rejected));
      }
    } else {
      record.timed_out.push_back(p.name);
      out.timed_out.push_back(id);
      // One that had not begun says its steps when its Sync comes (late,
      // or merged stale into a later round).
      record.steps.timed_out += steps;
    }
  }
  for (const auto& [id, p] : banked_) {
    const uint64_t steps = p.steps > 0 ? p.steps : 0;
    out.stale.push_back({id, p.anchor, /*counted=*/true});
    record.steps.merged += steps;
    record.steps.merged_stale += steps;
    if (record.contributor_ids.insert(id).second) {
      record.contributors.push_back(p.name);
    }
    record.contributor_weight += p.weight;
  }
  for (std::vector<std::string>* names :
       {&record.participants, &record.contributors, &record.dropped,
        &record.timed_out, &record.rejected}) {
    std::sort(names->begin(), names->end());
  }
  return out;
}

// ---------------------------------------------------------------------------
// RoundPacing

RoundPacing::RoundPacing(std::string job_id, uint32_t rendezvous_members,
                         bool adaptive, CloseRules rules)
    : job_id_(std::move(job_id)),
      rendezvous_members_(rendezvous_members),
      adaptive_(adaptive),
      rules_(rules),
      rendezvous_done_(rendezvous_members <= 1) {}

Gathering RoundPacing::gathering() const {
  Gathering g;
  g.rendezvous_pending = !rendezvous_done_;
  g.rendezvous_members = rendezvous_members_;
  g.regather_until = regather_until_;
  g.regather_members = regather_members_;
  return g;
}

CloseDecision RoundPacing::Decide(const RoundState& round,
                                  absl::Time now) const {
  return DecideClose(round.participants(), round.clock(), gathering(), rules_,
                     now, learned_);
}

void RoundPacing::Restored(RoundId round, absl::Time until, uint32_t members) {
  if (round > 0) rendezvous_done_ = true;
  regather_until_ = until;
  regather_members_ = members;
}

void RoundPacing::Reseeded(absl::Time until, uint32_t members) {
  rendezvous_done_ = true;
  regather_until_ = until;
  regather_members_ = members;
}

void RoundPacing::Closed(const RoundClosure& closure) {
  const RoundRecord& record = closure.record;
  if (adaptive_) {
    for (const auto& [name, lag] : closure.lags) {
      lags_.Add(lag);
      VLOG(1) << "job " << job_id_ << ": round " << record.round << ": " << name
              << " complete after " << absl::FormatDuration(lag);
    }
    for (absl::Duration arrival : closure.arrivals) arrivals_.Add(arrival);
    const LearnedDeadline before = learned_;
    learned_ = lags_.Learn();
    learned_.arrival = arrivals_.Learn().usual;
    VLOG(1) << "job " << job_id_ << ": round " << record.round
            << ": learned usual " << absl::FormatDuration(learned_.usual)
            << ", begins within " << absl::FormatDuration(learned_.arrival);
    if (learned_.learned() && !before.learned()) {
      LOG(INFO) << "job " << job_id_ << ": learned its round deadline: "
                << absl::FormatDuration(learned_.usual) << " (patient "
                << absl::FormatDuration(learned_.patient) << "; begins within "
                << absl::FormatDuration(learned_.arrival) << ") from "
                << lags_.size() << " contributions";
    }
  }
  if (record.participants.size() >= rendezvous_members_ && !rendezvous_done_) {
    rendezvous_done_ = true;
    LOG(INFO) << "job " << job_id_ << ": rendezvous of " << rendezvous_members_
              << " members complete";
  }
  if (regather_members_ > 0) {
    // A re-seed's or a restore's regather by members lasts its first round.
    regather_members_ = 0;
    regather_until_ = absl::InfinitePast();
  }
}

}  // namespace localsgd
