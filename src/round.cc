#include "src/round.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/codec.h"

namespace localsgd {

absl::string_view CloseReasonName(CloseReason reason) {
  switch (reason) {
    case CloseReason::kComplete:
      return "complete";
    case CloseReason::kDeadline:
      return "deadline";
    case CloseReason::kMembersGone:
      return "members_gone";
    case CloseReason::kSeed:
      return "seed";
  }
  return "unknown";
}

void LagHistory::Add(absl::Duration lag) {
  if (lags_.size() < kMaxLags) {
    lags_.push_back(lag);
  } else {
    lags_[next_] = lag;
  }
  next_ = (next_ + 1) % kMaxLags;
}

LearnedDeadline LagHistory::Learn() const {
  LearnedDeadline learned;
  if (lags_.size() < kMinLags) return learned;
  auto median = [](std::vector<absl::Duration> v) {
    const size_t mid = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + mid, v.end());
    absl::Duration m = v[mid];
    if (v.size() % 2 == 0) {
      m = (m + *std::max_element(v.begin(), v.begin() + mid)) / 2;
    }
    return m;
  };
  const absl::Duration center = median(lags_);
  std::vector<absl::Duration> deviations;
  deviations.reserve(lags_.size());
  for (absl::Duration lag : lags_)
    deviations.push_back(absl::AbsDuration(lag - center));
  const absl::Duration mad = std::max(
      {median(std::move(deviations)), center / 20, absl::Milliseconds(1)});
  learned.usual = center + 3 * mad;
  learned.patient = 2 * learned.usual;
  return learned;
}

CloseDecision DecideClose(const Participants& participants, absl::Time opened,
                          const Gathering& gathering, const CloseRules& rules,
                          absl::Time now, const LearnedDeadline& learned) {
  CloseDecision d;
  uint32_t complete = 0;
  bool any_gone = false;
  bool only_stragglers = true;  // among those it waits for
  bool none_began = true;       // likewise
  // The learned deadline: the longest wait among those it waits for.
  absl::Duration wait = absl::ZeroDuration();
  for (const auto& [id, p] : participants) {
    if (p.complete()) {
      ++complete;
    } else if (p.gone) {
      any_gone = true;
    } else {
      d.waiting_for.push_back(p.name);
      only_stragglers = only_stragglers && p.straggler;
      const bool began = p.began() || p.received > 0;
      none_began = none_began && !began;
      // Expected later than the round's clock (handed its result later
      // than the others: banked, or late): waited for that much longer, up
      // to `usual` more (one expected later still merges stale, or is
      // late).
      const absl::Duration due =
          p.expected > opened ? std::min(p.expected - opened, learned.usual)
                              : absl::ZeroDuration();
      absl::Duration limit =
          due + (p.straggler ? learned.usual : learned.patient);
      if (rules.stale_merged && !began &&
          learned.arrival > absl::ZeroDuration()) {
        limit = std::min(limit, due + std::max(learned.arrival, p.step_time));
      }
      wait = std::max(wait, limit);
    }
  }
  std::sort(d.waiting_for.begin(), d.waiting_for.end());
  const bool gathering_now = gathering.Active(participants.size(), now);
  if (!gathering_now && d.waiting_for.empty()) {
    d.close = true;
    d.reason = any_gone ? CloseReason::kMembersGone : CloseReason::kComplete;
    return d;
  }
  if (rules.round_deadline > absl::ZeroDuration()) {
    d.deadline = opened + rules.round_deadline;
    if (now >= d.deadline && complete >= rules.min_quorum) {
      d.close = true;
      d.reason = CloseReason::kDeadline;
      return d;
    }
  }
  bool learned_deadline = false;
  if (learned.learned() && !gathering_now) {
    const absl::Time until = opened + wait;
    if (until < d.deadline) {
      d.deadline = until;
      learned_deadline = true;
    }
    if (now >= until && complete >= rules.min_quorum) {
      d.close = true;
      d.reason = CloseReason::kDeadline;
      return d;
    }
  }
  // Stays open: say why.
  std::vector<std::string> reasons;
  if (gathering_now) {
    if (gathering.Regathering(participants.size(), now)) {
      reasons.push_back(absl::StrCat(
          "regathering members after a restart until ",
          absl::FormatTime(gathering.regather_until, absl::UTCTimeZone()),
          gathering.regather_members > 0
              ? absl::StrCat(" or until ", gathering.regather_members,
                             " are back (", participants.size(), " so far)")
              : std::string()));
    } else {
      reasons.push_back(absl::StrCat("gathering: ", participants.size(), " of ",
                                     gathering.rendezvous_members,
                                     " rendezvous members"));
    }
  }
  if (!d.waiting_for.empty()) {
    reasons.push_back(absl::StrCat("waiting for ", d.waiting_for.size(), " of ",
                                   participants.size(), " participants (",
                                   absl::StrJoin(d.waiting_for, ", "), ")"));
  }
  if (d.deadline != absl::InfiniteFuture()) {
    const char* which =
        !learned_deadline ? "deadline"
        : rules.stale_merged && none_began
            ? "learned deadline (none began; a late delta merges stale)"
        : only_stragglers ? "learned deadline (stragglers)"
                          : "learned deadline";
    reasons.push_back(
        now >= d.deadline
            ? absl::StrCat(which, " passed with ", complete, " of ",
                           rules.min_quorum, " complete contributions needed")
            : absl::StrCat(which, " ",
                           absl::FormatTime(d.deadline, absl::UTCTimeZone()),
                           " (needs ", rules.min_quorum, " complete)"));
  }
  d.why_open = absl::StrJoin(reasons, "; ");
  return d;
}

RoundAccumulator::RoundAccumulator(std::vector<float> buffer,
                                   const ChunkGeometry& geometry)
    : geometry_(geometry),
      sums_(std::move(buffer)),
      chunk_weight_(geometry.num_chunks(), 0.0) {
  sums_.resize(geometry.num_elements());
  std::fill(sums_.begin(), sums_.end(), 0.0f);
}

void RoundAccumulator::FitScale(double total_weight) {
  int exp = 0;
  while (std::ldexp(1.0, exp) < total_weight) ++exp;
  if (exp <= scale_exp_) return;
  const int shift = exp - scale_exp_;
  scale_exp_ = exp;
  const bool any_sums = std::any_of(chunk_weight_.begin(), chunk_weight_.end(),
                                    [](double w) { return w > 0; });
  if (!any_sums) return;
  // Only when a gathering round admits members into a round that has sums.
  // Multiplying by a power of two is exact (short of subnormals).
  const float factor = std::ldexp(1.0f, -shift);
  for (float& v : sums_) v *= factor;
}

void RoundAccumulator::Add(uint32_t index,
                           absl::Span<const absl::string_view> pieces,
                           WireCode code, float weight) {
  AccumulateWeightedPieces(pieces, code, std::ldexp(weight, -scale_exp_),
                           scaled_sums(index));
  chunk_weight_[index] += weight;
}

absl::Span<float> RoundAccumulator::scaled_sums(uint32_t index) {
  return absl::MakeSpan(sums_).subspan(geometry_.Offset(index),
                                       geometry_.Size(index));
}

double RoundAccumulator::scaled_weight(uint32_t index) const {
  return std::ldexp(chunk_weight_[index], -scale_exp_);
}

}  // namespace localsgd
