#include "proto/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace localsgd {
namespace {

absl::StatusOr<NonFinitePolicy> NonFinitePolicyFromProto(int value) {
  switch (value) {
    case v1::NON_FINITE_POLICY_UNSPECIFIED:
      return NonFinitePolicy::kUnspecified;
    case v1::NON_FINITE_POLICY_REJECT:
      return NonFinitePolicy::kReject;
    case v1::NON_FINITE_POLICY_DROP:
      return NonFinitePolicy::kDrop;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.nonfinite_policy has unknown value ", value));
  }
}

absl::StatusOr<DeadlineMode> DeadlineModeFromProto(int value) {
  switch (value) {
    case v1::DEADLINE_MODE_UNSPECIFIED:
      return DeadlineMode::kUnspecified;
    case v1::DEADLINE_MODE_FIXED:
      return DeadlineMode::kFixed;
    case v1::DEADLINE_MODE_ADAPTIVE:
      return DeadlineMode::kAdaptive;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.deadline_mode has unknown value ", value));
  }
}

absl::StatusOr<StepBudget> StepBudgetFromProto(int value) {
  switch (value) {
    case v1::STEP_BUDGET_UNSPECIFIED:
      return StepBudget::kUnspecified;
    case v1::STEP_BUDGET_FIXED:
      return StepBudget::kFixed;
    case v1::STEP_BUDGET_ADAPTIVE:
      return StepBudget::kAdaptive;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.step_budget has unknown value ", value));
  }
}

v1::StepBudget StepBudgetToProto(StepBudget budget) {
  switch (budget) {
    case StepBudget::kFixed:
      return v1::STEP_BUDGET_FIXED;
    case StepBudget::kAdaptive:
      return v1::STEP_BUDGET_ADAPTIVE;
    case StepBudget::kUnspecified:
      break;
  }
  return v1::STEP_BUDGET_UNSPECIFIED;
}

absl::StatusOr<MeanEncoding> MeanEncodingFromProto(int value) {
  switch (value) {
    case v1::MEAN_ENCODING_UNSPECIFIED:
      return MeanEncoding::kUnspecified;
    case v1::MEAN_ENCODING_FLOAT32:
      return MeanEncoding::kFloat32;
    case v1::MEAN_ENCODING_WIRE:
      return MeanEncoding::kWire;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.mean_encoding has unknown value ", value));
  }
}

v1::MeanEncoding MeanEncodingToProto(MeanEncoding encoding) {
  switch (encoding) {
    case MeanEncoding::kFloat32:
      return v1::MEAN_ENCODING_FLOAT32;
    case MeanEncoding::kWire:
      return v1::MEAN_ENCODING_WIRE;
    case MeanEncoding::kUnspecified:
      break;
  }
  return v1::MEAN_ENCODING_UNSPECIFIED;
}

v1::DeadlineMode DeadlineModeToProto(DeadlineMode mode) {
  switch (mode) {
    case DeadlineMode::kFixed:
      return v1::DEADLINE_MODE_FIXED;
    case DeadlineMode::kAdaptive:
      return v1::DEADLINE_MODE_ADAPTIVE;
    case DeadlineMode::kUnspecified:
      break;
  }
  return v1::DEADLINE_MODE_UNSPECIFIED;
}

v1::NonFinitePolicy NonFinitePolicyToProto(NonFinitePolicy policy) {
  switch (policy) {
    case NonFinitePolicy::kReject:
      return v1::NON_FINITE_POLICY_REJECT;
    case NonFinitePolicy::kDrop:
      return v1::NON_FINITE_POLICY_DROP;
    case NonFinitePolicy::kUnspecified:
      break;
  }
  return v1::NON_FINITE_POLICY_UNSPECIFIED;
}

absl::StatusOr<AveragingMode> AveragingModeFromProto(int value) {
  switch (value) {
    case v1::AVERAGING_MODE_UNSPECIFIED:
      return AveragingMode::kUnspecified;
    case v1::AVERAGING_MODE_MEAN:
      return AveragingMode::kMean;
    case v1::AVERAGING_MODE_OUTER_NESTEROV:
      return AveragingMode::kOuterNesterov;
    case v1::AVERAGING_MODE_OUTER_SGD:
      return AveragingMode::kOuterSgd;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.mode has unknown value ", value));
  }
}

v1::AveragingMode AveragingModeToProto(AveragingMode mode) {
  switch (mode) {
    case AveragingMode::kMean:
      return v1::AVERAGING_MODE_MEAN;
    case AveragingMode::kOuterNesterov:
      return v1::AVERAGING_MODE_OUTER_NESTEROV;
    case AveragingMode::kOuterSgd:
      return v1::AVERAGING_MODE_OUTER_SGD;
    case AveragingMode::kUnspecified:
      break;
  }
  return v1::AVERAGING_MODE_UNSPECIFIED;
}

absl::StatusOr<Contribution> ContributionFromProto(int value) {
  switch (value) {
    case v1::CONTRIBUTION_UNSPECIFIED:
      return Contribution::kUnspecified;
    case v1::CONTRIBUTION_PARAMETERS:
      return Contribution::kParameters;
    case v1::CONTRIBUTION_PSEUDO_GRADIENTS:
      return Contribution::kPseudoGradients;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("settings.contribution has unknown value ", value));
  }
}

v1::Contribution ContributionToProto(Contribution contribution) {
  switch (contribution) {
    case Contribution::kParameters:
      return v1::CONTRIBUTION_PARAMETERS;
    case Contribution::kPseudoGradients:
      return v1::CONTRIBUTION_PSEUDO_GRADIENTS;
    case Contribution::kUnspecified:
      break;
  }
  return v1::CONTRIBUTION_UNSPECIFIED;
}

}  // namespace

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
    case v1::DTYPE_INT8_BLOCK:
      return DType::kInt8Block;
    case v1::DTYPE_INT4_BLOCK:
      return DType::kInt4Block;
    case v1::DTYPE_SPARSE2:
      return DType::kSparse2;
    case v1::DTYPE_SPARSE4:
      return DType::kSparse4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has unknown dtype value ", value));
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kFloat64:
      return v1::DTYPE_FLOAT64;
    case DType::kInt8Block:
      return v1::DTYPE_INT8_BLOCK;
    case DType::kInt4Block:
      return v1::DTYPE_INT4_BLOCK;
    case DType::kSparse2:
      return v1::DTYPE_SPARSE2;
    case DType::kSparse4:
      return v1::DTYPE_SPARSE4;
    case DType::kUnspecified:
      break;
  }
  return v1::DTYPE_UNSPECIFIED;
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

v1::Layout LayoutToProto(const Layout& layout) {
  v1::Layout proto;
  LayoutToProto(layout, &proto);
  return proto;
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
  absl::StatusOr<NonFinitePolicy> policy =
      NonFinitePolicyFromProto(proto.nonfinite_policy());
  if (!policy.ok()) return policy.status();
  settings.nonfinite_policy = *policy;
  absl::StatusOr<AveragingMode> mode = AveragingModeFromProto(proto.mode());
  if (!mode.ok()) return mode.status();
  settings.mode = *mode;
  absl::StatusOr<Contribution> contribution =
      ContributionFromProto(proto.contribution());
  if (!contribution.ok()) return contribution.status();
  settings.contribution = *contribution;
  settings.outer_lr = proto.outer_lr();
  settings.outer_momentum = proto.outer_momentum();
  settings.outlier_ratio = proto.outlier_ratio();
  absl::StatusOr<DeadlineMode> deadline =
      DeadlineModeFromProto(proto.deadline_mode());
  if (!deadline.ok()) return deadline.status();
  settings.deadline_mode = *deadline;
  absl::StatusOr<MeanEncoding> mean_encoding =
      MeanEncodingFromProto(proto.mean_encoding());
  if (!mean_encoding.ok()) return mean_encoding.status();
  settings.mean_encoding = *mean_encoding;
  settings.max_staleness = proto.max_staleness();
  absl::StatusOr<StepBudget> budget = StepBudgetFromProto(proto.step_budget());
  if (!budget.ok()) return budget.status();
  settings.step_budget = *budget;
  settings.min_local_steps = proto.min_local_steps();
  settings.max_local_steps = proto.max_local_steps();
  settings.sparse_keep = proto.sparse_keep();
  settings.sparse_result_keep = proto.sparse_result_keep();
  return settings;
}

void SettingsToProto(const JobSettings& settings, v1::JobSettings* proto) {
  proto->set_local_sgd_steps(settings.local_sgd_steps);
  proto->set_chunk_elements(settings.chunk_elements);
  proto->set_rendezvous_members(settings.rendezvous_members);
  proto->set_wire_dtype(DTypeToProto(settings.wire_dtype));
  proto->set_mode(AveragingModeToProto(settings.mode));
  proto->set_nonfinite_policy(
      NonFinitePolicyToProto(settings.nonfinite_policy));
  proto->set_contribution(ContributionToProto(settings.contribution));
  proto->set_outer_lr(settings.outer_lr);
  proto->set_outer_momentum(settings.outer_momentum);
  proto->set_outlier_ratio(settings.outlier_ratio);
  proto->set_deadline_mode(DeadlineModeToProto(settings.deadline_mode));
  proto->set_mean_encoding(MeanEncodingToProto(settings.mean_encoding));
  proto->set_max_staleness(settings.max_staleness);
  proto->set_step_budget(StepBudgetToProto(settings.step_budget));
  proto->set_min_local_steps(settings.min_local_steps);
  proto->set_max_local_steps(settings.max_local_steps);
  proto->set_sparse_keep(settings.sparse_keep);
  proto->set_sparse_result_keep(settings.sparse_result_keep);
}

absl::StatusOr<MemberId> ParseMemberId(const std::string& hex) {
  if (!MemberId::IsWellFormed(hex)) {
    // Not echoed: it may be most of a real member id (a credential), or
    // hold control characters, and messages end up in logs.
    return absl::InvalidArgumentError(absl::StrCat(
        "member_id of ", hex.size(),
        " bytes is malformed: expected the 32 lower-case hex digits Join "
        "returned"));
  }
  return MemberId(hex);
}

void JoinInfoToProto(const JoinInfo& info, v1::JoinResponse* proto) {
  proto->set_member_id(info.member_id.str());
  SettingsToProto(info.settings, proto->mutable_settings());
  v1::CoordinatorPolicy* policy = proto->mutable_policy();
  policy->set_lease_ttl_ms(absl::ToInt64Milliseconds(info.lease_ttl));
  policy->set_round_deadline_ms(absl::ToInt64Milliseconds(info.round_deadline));
  policy->set_min_quorum(info.min_quorum);
  policy->set_max_message_bytes(info.max_message_bytes);
  policy->set_paced_uploads(info.paced_uploads);
  proto->set_has_state(info.has_state);
  proto->set_state_round(info.state_round);
  proto->set_state_id(info.state_id);
  proto->set_num_chunks(info.num_chunks);
  proto->set_num_elements(info.num_elements);
  proto->set_shard_index(info.shard.index);
  proto->set_shard_count(info.shard.count);
  proto->set_epoch(info.epoch);
}

absl::StatusOr<JoinInfo> JoinInfoFromProto(const v1::JoinResponse& proto) {
  JoinInfo info;
  absl::StatusOr<MemberId> id = ParseMemberId(proto.member_id());
  if (!id.ok()) return id.status();
  info.member_id = *std::move(id);
  absl::StatusOr<JobSettings> settings = SettingsFromProto(proto.settings());
  if (!settings.ok()) return settings.status();
  info.settings = *settings;
  info.lease_ttl = absl::Milliseconds(proto.policy().lease_ttl_ms());
  info.round_deadline = absl::Milliseconds(proto.policy().round_deadline_ms());
  info.min_quorum = proto.policy().min_quorum();
  info.max_message_bytes = proto.policy().max_message_bytes();
  info.paced_uploads = proto.policy().paced_uploads();
  info.has_state = proto.has_state();
  info.state_round = proto.state_round();
  info.state_id = proto.state_id();
  info.num_chunks = proto.num_chunks();
  info.num_elements = proto.num_elements();
  info.shard = ShardSpec{proto.shard_index(),
                         std::max<uint32_t>(proto.shard_count(), 1)};
  info.epoch = proto.epoch();
  return info;
}

void RoundOutcomeToProto(const RoundOutcome& outcome, v1::SyncResult* proto) {
  proto->set_round(outcome.round);
  proto->set_contributed(outcome.contributed);
  proto->set_late(outcome.late);
  proto->set_contributors(outcome.contributors);
  proto->set_contributor_weight(outcome.contributor_weight);
  proto->set_state_id(outcome.state_id);
  proto->set_epoch(outcome.epoch);
  proto->set_staleness(outcome.staleness);
  proto->set_local_steps_budget(outcome.local_steps_budget);
}

RoundOutcome RoundOutcomeFromProto(const v1::SyncResult& proto) {
  RoundOutcome outcome;
  outcome.round = proto.round();
  outcome.contributed = proto.contributed();
  outcome.late = proto.late();
  outcome.contributors = proto.contributors();
  outcome.contributor_weight = proto.contributor_weight();
  outcome.state_id = proto.state_id();
  outcome.epoch = proto.epoch();
  outcome.staleness = proto.staleness();
  outcome.local_steps_budget = proto.local_steps_budget();
  return outcome;
}

}  // namespace localsgd
