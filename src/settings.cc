#include "src/settings.h"

#include "absl/strings/str_cat.h"

namespace localsgd {
namespace {

// One row per setting: whether a request sets it, whether two settings agree
// on it, copying it, and how the job and a member's wish are described.
struct SettingField {
  bool (*is_set)(const JobSettings&);
  bool (*equal)(const JobSettings&, const JobSettings&);
  void (*copy)(const JobSettings& from, JobSettings& to);
  // "<the job's value described>; member asks for <the asked value>".
  std::string (*differs)(const JobSettings& job, const JobSettings& asked);
};

#define LOCALSGD_SETTING(field, unset)                   \
  [](const JobSettings& s) { return s.field != unset; }, \
      [](const JobSettings& a, const JobSettings& b) {   \
        return a.field == b.field;                       \
      },                                                 \
      [](const JobSettings& from, JobSettings& to) { to.field = from.field; }

const SettingField kSettingFields[] = {
    {LOCALSGD_SETTING(local_sgd_steps, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("syncs every ", job.local_sgd_steps,
                           " steps; member asks for ", asked.local_sgd_steps);
     }},
    {LOCALSGD_SETTING(chunk_elements, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses chunks of ", job.chunk_elements,
                           " elements; member asks for ", asked.chunk_elements);
     }},
    {LOCALSGD_SETTING(wire_dtype, DType::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses wire dtype ", DTypeName(job.wire_dtype),
                           "; member asks for ", DTypeName(asked.wire_dtype));
     }},
    {LOCALSGD_SETTING(rendezvous_members, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("starts with ", job.rendezvous_members,
                           " members; member asks for ",
                           asked.rendezvous_members);
     }},
    {LOCALSGD_SETTING(mode, AveragingMode::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses averaging mode ", AveragingModeName(job.mode),
                           "; member asks for ", AveragingModeName(asked.mode));
     }},
    {LOCALSGD_SETTING(nonfinite_policy, NonFinitePolicy::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("treats non-finite values with policy '",
                           NonFinitePolicyName(job.nonfinite_policy),
                           "'; member asks for '",
                           NonFinitePolicyName(asked.nonfinite_policy), "'");
     }},
    {LOCALSGD_SETTING(contribution, Contribution::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("takes ", ContributionName(job.contribution),
                           "; member sends ",
                           ContributionName(asked.contribution));
     }},
    {LOCALSGD_SETTING(outer_lr, 0.0f),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses outer learning rate ", job.outer_lr,
                           "; member asks for ", asked.outer_lr);
     }},
    {LOCALSGD_SETTING(outer_momentum, 0.0f),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses outer momentum ", job.outer_momentum,
                           "; member asks for ", asked.outer_momentum);
     }},
    {LOCALSGD_SETTING(deadline_mode, DeadlineMode::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat(
           "uses deadline mode ", DeadlineModeName(job.deadline_mode),
           "; member asks for ", DeadlineModeName(asked.deadline_mode));
     }},
};

#undef LOCALSGD_SETTING

}  // namespace

absl::Status ValidateSetFields(const JobSettings& s,
                               const SettingsLimits& limits,
                               absl::string_view what) {
  if (s.chunk_elements > limits.max_chunk_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "chunk_elements ", s.chunk_elements,
        " exceeds the coordinator's limit of ", limits.max_chunk_elements));
  }
  if (s.wire_dtype != DType::kUnspecified && !IsWireDType(s.wire_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "wire dtype ", DTypeName(s.wire_dtype),
                     " is not supported; use float32, bfloat16, int8 or int4"));
  }
  if (s.contribution != Contribution::kUnspecified &&
      s.contribution != Contribution::kParameters &&
      s.contribution != Contribution::kPseudoGradients) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "contribution ", static_cast<int>(s.contribution),
                     " is not supported; use parameters or pseudo_gradients"));
  }
  // Negated comparisons so that NaN fails them too.
  if (s.outer_lr != 0 && !(s.outer_lr > 0 && s.outer_lr <= 100)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "outer_lr ", s.outer_lr, " is out of range; use (0, 100]"));
  }
  if (s.outer_momentum != 0 &&
      !(s.outer_momentum > 0 && s.outer_momentum < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "outer_momentum ", s.outer_momentum,
                     " is out of range; use (0, 1) (no momentum: outer_sgd)"));
  }
  if (s.rendezvous_members > limits.max_members) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "rendezvous_members ", s.rendezvous_members,
        " exceeds the members a job may have (", limits.max_members, ")"));
  }
  if (s.nonfinite_policy != NonFinitePolicy::kUnspecified &&
      s.nonfinite_policy != NonFinitePolicy::kReject &&
      s.nonfinite_policy != NonFinitePolicy::kDrop) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "non-finite policy ", static_cast<int>(s.nonfinite_policy),
        " is not supported; use reject or drop"));
  }
  if (s.deadline_mode != DeadlineMode::kUnspecified &&
      s.deadline_mode != DeadlineMode::kFixed &&
      s.deadline_mode != DeadlineMode::kAdaptive) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "deadline mode ", static_cast<int>(s.deadline_mode),
                     " is not supported; use fixed or adaptive"));
  }
  if (s.mode != AveragingMode::kUnspecified && s.mode != AveragingMode::kMean &&
      s.mode != AveragingMode::kOuterNesterov &&
      s.mode != AveragingMode::kOuterSgd) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "averaging mode ", static_cast<int>(s.mode),
                     " is not supported; use mean, outer_nesterov or "
                     "outer_sgd"));
  }
  return absl::OkStatus();
}

absl::Status ValidateComplete(const JobSettings& s,
                              const SettingsLimits& limits,
                              absl::string_view what) {
  if (s.chunk_elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "chunk_elements must be in [1, ",
                     limits.max_chunk_elements, "]"));
  }
  if (s.wire_dtype == DType::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "wire dtype must be float32 or bfloat16"));
  }
  if (s.nonfinite_policy == NonFinitePolicy::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "non-finite policy must be reject or drop"));
  }
  if (s.deadline_mode == DeadlineMode::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "deadline mode must be fixed or adaptive"));
  }
  if (s.mode == AveragingMode::kUnspecified) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "averaging mode must be mean, outer_nesterov or outer_sgd"));
  }
  if (s.contribution == Contribution::kUnspecified) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "contribution must be parameters or pseudo_gradients"));
  }
  if (s.contribution == Contribution::kParameters) {
    // Parameters are averaged as they are: no outer step, and a code of a
    // few bits would round the state itself.
    if (s.mode != AveragingMode::kMean) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "averaging mode ", AveragingModeName(s.mode),
          " needs contribution pseudo_gradients (a job of parameters "
          "averages them: mean)"));
    }
    if (IsBlockDType(s.wire_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "wire dtype ", DTypeName(s.wire_dtype),
          " needs contribution pseudo_gradients (parameters travel as "
          "float32 or bfloat16)"));
    }
  }
  if (s.mode == AveragingMode::kOuterNesterov ||
      s.mode == AveragingMode::kOuterSgd) {
    if (s.outer_lr == 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, "averaging mode ",
                                                     AveragingModeName(s.mode),
                                                     " needs an outer_lr"));
    }
  }
  if (s.mode == AveragingMode::kOuterNesterov && s.outer_momentum == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     "averaging mode outer_nesterov needs an "
                     "outer_momentum"));
  }
  return ValidateSetFields(s, limits, what);
}

JobSettings WithDefaults(const JobSettings& asked,
                         const JobSettings& defaults) {
  JobSettings out = defaults;
  for (const SettingField& f : kSettingFields) {
    if (f.is_set(asked)) f.copy(asked, out);
  }
  return out;
}

std::string FirstDifference(const JobSettings& job, const JobSettings& asked) {
  for (const SettingField& f : kSettingFields) {
    if (f.is_set(asked) && !f.equal(job, asked)) return f.differs(job, asked);
  }
  return "";
}

}  // namespace localsgd
