#include "server/convert.h"

#include "absl/strings/str_cat.h"
#include "server/auth.h"

namespace localsgd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view what) {
  switch (value) {
    case v1::DTYPE_UNSPECIFIED:
      return DType::kUnspecified;
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_FLOAT64:
      return DType::kFloat64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has unknown dtype value ", value));
  }
}

v1::DType DTypeToProto(DType dtype) {
  return static_cast<v1::DType>(static_cast<int>(dtype));
}

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto) {
  Layout layout;
  layout.fingerprint = proto.fingerprint();
  layout.tensors.reserve(proto.tensors_size());
  for (int i = 0; i < proto.tensors_size(); ++i) {
    const v1::TensorSpec& t = proto.tensors(i);
    TensorSpec spec;
    spec.name = t.name();
    spec.shape.assign(t.shape().begin(), t.shape().end());
    absl::StatusOr<DType> dtype =
        DTypeFromProto(t.dtype(), absl::StrCat("layout tensor ", i));
    if (!dtype.ok()) return dtype.status();
    spec.dtype = *dtype;
    layout.tensors.push_back(std::move(spec));
  }
  return layout;
}

void LayoutToProto(const Layout& layout, v1::Layout* proto) {
  proto->Clear();
  proto->set_fingerprint(layout.fingerprint);
  for (const TensorSpec& spec : layout.tensors) {
    v1::TensorSpec* t = proto->add_tensors();
    t->set_name(spec.name);
    for (int64_t d : spec.shape) t->add_shape(d);
    t->set_dtype(DTypeToProto(spec.dtype));
  }
}

absl::StatusOr<JobSettings> SettingsFromProto(const v1::JobSettings& proto) {
  JobSettings settings;
  settings.local_sgd_steps = proto.local_sgd_steps();
  settings.chunk_elements = proto.chunk_elements();
  settings.rendezvous_members = proto.rendezvous_members();
  absl::StatusOr<DType> dtype =
      DTypeFromProto(proto.wire_dtype(), "settings.wire_dtype");
  if (!dtype.ok()) return dtype.status();
  settings.wire_dtype = *dtype;
  switch (proto.nonfinite_policy()) {
    case v1::NON_FINITE_POLICY_UNSPECIFIED:
      settings.nonfinite_policy = NonFinitePolicy::kUnspecified;
      break;
    case v1::NON_FINITE_POLICY_REJECT:
      settings.nonfinite_policy = NonFinitePolicy::kReject;
      break;
    case v1::NON_FINITE_POLICY_DROP:
      settings.nonfinite_policy = NonFinitePolicy::kDrop;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.nonfinite_policy has unknown value ",
                       proto.nonfinite_policy()));
  }
  switch (proto.mode()) {
    case v1::AVERAGING_MODE_UNSPECIFIED:
      settings.mode = AveragingMode::kUnspecified;
      break;
    case v1::AVERAGING_MODE_MEAN:
      settings.mode = AveragingMode::kMean;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.mode has unknown value ", proto.mode()));
  }
  return settings;
}

void SettingsToProto(const JobSettings& settings, v1::JobSettings* proto) {
  proto->set_local_sgd_steps(settings.local_sgd_steps);
  proto->set_chunk_elements(settings.chunk_elements);
  proto->set_rendezvous_members(settings.rendezvous_members);
  proto->set_wire_dtype(DTypeToProto(settings.wire_dtype));
  proto->set_mode(
      static_cast<v1::AveragingMode>(static_cast<int>(settings.mode)));
  proto->set_nonfinite_policy(static_cast<v1::NonFinitePolicy>(
      static_cast<int>(settings.nonfinite_policy)));
}

absl::StatusOr<MemberId> ParseMemberId(const std::string& hex) {
  if (!MemberId::IsWellFormed(hex)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "member_id '", hex.substr(0, 40), hex.size() > 40 ? "..." : "",
        "' is malformed: expected the 32 lower-case hex digits Join returned"));
  }
  return MemberId(hex);
}

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
  for (const RoundRecord& r : s.recent_rounds) {
    v1::RoundStatus* p = proto->add_recent_rounds();
    p->set_round(r.round);
    for (const auto& n : r.participants) p->add_participants(n);
    for (const auto& n : r.contributors) p->add_contributors(n);
    for (const auto& n : r.dropped) p->add_dropped(n);
    for (const auto& n : r.late) p->add_late(n);
    p->set_close_reason(CloseReasonToProto(r.reason));
    p->set_duration_ms(static_cast<uint64_t>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(r.closed - r.opened))));
    p->set_closed_unix_ms(absl::ToUnixMillis(r.closed));
  }
}

}  // namespace localsgd
