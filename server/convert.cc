#include "server/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/member_ref.h"

namespace localsgd {

namespace {

v1::CloseReason CloseReasonToProto(CloseReason reason) {
  switch (reason) {
    case CloseReason::kComplete:
      return v1::CLOSE_REASON_COMPLETE;
    case CloseReason::kDeadline:
      return v1::CLOSE_REASON_DEADLINE;
    case CloseReason::kMembersGone:
      return v1::CLOSE_REASON_MEMBERS_GONE;
    case CloseReason::kSeed:
      return v1::CLOSE_REASON_SEED;
  }
  return v1::CLOSE_REASON_UNSPECIFIED;
}

}  // namespace

void JobStatusToProto(const JobStatusSnapshot& s, absl::Time now,
                      v1::JobStatus* proto) {
  proto->set_job_id(s.job_id);
  SettingsToProto(s.settings, proto->mutable_settings());
  proto->set_num_tensors(static_cast<uint32_t>(s.layout.tensors.size()));
  proto->set_num_elements(s.geometry.num_elements());
  proto->set_num_chunks(s.geometry.num_chunks());
  proto->set_layout_fingerprint(s.layout.fingerprint);
  for (const MemberInfo& m : s.members) {
    v1::MemberStatus* p = proto->add_members();
    // Not the member id: whoever reads status could act as the member with
    // it. A reference that tells members apart instead (auth.h MemberRef).
    p->set_member_ref(MemberRef(m.id));
    p->set_member_name(m.name);
    p->set_weight(m.weight);
    p->set_incarnation(m.incarnation);
    p->set_idle_ms(static_cast<uint64_t>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(now - m.last_seen))));
    p->set_first_round(m.first_round);
    if (m.work.known()) {
      p->set_steps_per_second(m.work.steps_per_second());
      p->set_upload_ms(static_cast<uint64_t>(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(m.work.upload()))));
    }
    p->set_local_steps_budget(m.budget);
  }
  proto->set_has_state(s.has_state);
  proto->set_state_round(s.state_round);
  proto->set_round_open(s.round_open);
  for (const auto& n : s.open_round_participants) {
    proto->add_open_round_participants(n);
  }
  for (const auto& n : s.open_round_contributed) {
    proto->add_open_round_contributed(n);
  }
  if (s.round_open) {
    const CloseDecision& d = s.open_round_decision;
    proto->set_open_round_why(d.why_open);
    for (const auto& n : d.waiting_for) proto->add_open_round_waiting_for(n);
    if (d.deadline != absl::InfiniteFuture()) {
      proto->set_open_round_deadline_unix_ms(absl::ToUnixMillis(d.deadline));
    }
  }
  proto->set_learned_deadline_ms(static_cast<uint64_t>(
      absl::ToInt64Milliseconds(s.learned_deadline.usual)));
  proto->set_learned_patient_deadline_ms(static_cast<uint64_t>(
      absl::ToInt64Milliseconds(s.learned_deadline.patient)));
  for (const auto& n : s.stragglers) proto->add_stragglers(n);
  StepCountsToProto(s.steps, proto->mutable_steps());
  proto->set_goodput(s.steps.goodput());
  if (s.upstream.has_value()) {
    v1::UpstreamStatus* u = proto->mutable_upstream();
    u->set_target(s.upstream->target);
    u->set_member_name(s.upstream->member);
    u->set_upstream_round(s.upstream->upstream_round);
    u->set_answered(s.upstream->rounds);
    u->set_last_error(s.upstream->last_error);
    u->set_early_chunks(s.upstream->early_chunks);
  }
  for (const RoundRecord& r : s.recent_rounds) {
    RoundRecordToProto(r, proto->add_recent_rounds());
  }
}

void StepCountsToProto(const StepCounts& c, v1::StepCounts* p) {
  p->set_merged(c.merged);
  p->set_merged_stale(c.merged_stale);
  p->set_late(c.late);
  p->set_refused(c.refused);
  p->set_gone(c.gone);
  p->set_timed_out(c.timed_out);
}

StepCounts StepCountsFromProto(const v1::StepCounts& p) {
  StepCounts c;
  c.merged = p.merged();
  c.merged_stale = p.merged_stale();
  c.late = p.late();
  c.refused = p.refused();
  c.gone = p.gone();
  c.timed_out = p.timed_out();
  return c;
}

void RoundRecordToProto(const RoundRecord& r, v1::RoundStatus* p) {
  p->set_round(r.round);
  for (const auto& n : r.participants) p->add_participants(n);
  for (const auto& n : r.contributors) p->add_contributors(n);
  for (const auto& n : r.dropped) p->add_dropped(n);
  for (const auto& n : r.timed_out) p->add_timed_out(n);
  for (const auto& n : r.rejected) p->add_rejected(n);
  for (const auto& n : r.late) p->add_late(n);
  p->set_close_reason(CloseReasonToProto(r.reason));
  p->set_duration_ms(static_cast<uint64_t>(
      std::max<int64_t>(0, absl::ToInt64Milliseconds(r.closed - r.opened))));
  p->set_closed_unix_ms(absl::ToUnixMillis(r.closed));
  if (r.steps.merged + r.steps.discarded() > 0) {
    StepCountsToProto(r.steps, p->mutable_steps());
  }
}

RoundRecord RoundRecordFromProto(const v1::RoundStatus& p) {
  RoundRecord r;
  r.round = p.round();
  r.participants.assign(p.participants().begin(), p.participants().end());
  r.contributors.assign(p.contributors().begin(), p.contributors().end());
  r.dropped.assign(p.dropped().begin(), p.dropped().end());
  r.timed_out.assign(p.timed_out().begin(), p.timed_out().end());
  r.rejected.assign(p.rejected().begin(), p.rejected().end());
  r.late.assign(p.late().begin(), p.late().end());
  switch (p.close_reason()) {
    case v1::CLOSE_REASON_DEADLINE:
      r.reason = CloseReason::kDeadline;
      break;
    case v1::CLOSE_REASON_MEMBERS_GONE:
      r.reason = CloseReason::kMembersGone;
      break;
    case v1::CLOSE_REASON_SEED:
      r.reason = CloseReason::kSeed;
      break;
    default:
      r.reason = CloseReason::kComplete;
  }
  r.closed = absl::FromUnixMillis(p.closed_unix_ms());
  r.opened = r.closed - absl::Milliseconds(p.duration_ms());
  r.steps = StepCountsFromProto(p.steps());
  // Names are sorted (RoundState::Close); a hostile record need not be.
  for (std::vector<std::string>* names :
       {&r.participants, &r.contributors, &r.dropped, &r.timed_out, &r.rejected,
        &r.late}) {
    std::sort(names->begin(), names->end());
  }
  return r;
}

absl::StatusOr<JoinRequestParams> JoinParamsFromProto(
    const v1::JoinRequest& request, std::string principal) {
  JoinRequestParams params;
  params.principal = std::move(principal);
  params.member_name = request.member_name();
  params.weight = request.weight();
  params.incarnation = request.incarnation();
  absl::StatusOr<Layout> layout = LayoutFromProto(request.layout());
  if (!layout.ok()) return layout.status();
  params.layout = *std::move(layout);
  absl::StatusOr<JobSettings> settings = SettingsFromProto(request.settings());
  if (!settings.ok()) return settings.status();
  params.settings = *settings;
  return params;
}

}  // namespace localsgd
