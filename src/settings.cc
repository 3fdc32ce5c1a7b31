#include "src/settings.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/sparse_codec.h"

namespace localsgd {
namespace {

// Text forms of the settings' values, as the coordinator's flags take them.
template <typename E>
struct Choice {
  absl::string_view name;
  E value;
};

template <typename E, size_t N>
absl::Status ParseChoice(absl::string_view text, const Choice<E> (&choices)[N],
                         E& out) {
  std::vector<absl::string_view> names;
  for (const Choice<E>& c : choices) {
    if (text == c.name) {
      out = c.value;
      return absl::OkStatus();
    }
    names.push_back(c.name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "must be one of ", absl::StrJoin(names, ", "), "; got '", text, "'"));
}

template <typename T>
absl::Status ParseNumber(absl::string_view text, T& out) {
  if (absl::SimpleAtoi(text, &out)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("must be a whole number >= 0; got '", text, "'"));
}

// The outlier guard's ratio: a number, or "off" (kOutlierGuardOff).
absl::Status ParseOutlierRatio(absl::string_view text, float& out) {
  if (text == "off") {
    out = kOutlierGuardOff;
    return absl::OkStatus();
  }
  float ratio;
  if (absl::SimpleAtof(text, &ratio) && ratio >= kMinOutlierRatio &&
      ratio <= kMaxOutlierRatio) {
    out = ratio;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("must be in [", kMinOutlierRatio, ", ", kMaxOutlierRatio,
                   "] or off; got '", text, "'"));
}

std::string OutlierRatioText(float ratio) {
  return ratio == kOutlierGuardOff ? "off" : absl::StrCat(ratio);
}

// The largest staleness merged: a number, or "off" (kMaxStalenessOff).
absl::Status ParseMaxStaleness(absl::string_view text, int32_t& out) {
  if (text == "off") {
    out = kMaxStalenessOff;
    return absl::OkStatus();
  }
  int32_t n;
  if (absl::SimpleAtoi(text, &n) && n >= 1 && n <= kMaxStalenessLimit) {
    out = n;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "must be in [1, ", kMaxStalenessLimit, "] or off; got '", text, "'"));
}

std::string MaxStalenessText(int32_t n) {
  return n == kMaxStalenessOff ? "off" : absl::StrCat(n);
}

absl::Status ParseFloat(absl::string_view text, float& out) {
  if (absl::SimpleAtof(text, &out)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("must be a number; got '", text, "'"));
}

constexpr Choice<DType> kWireDTypes[] = {
    {"float32", DType::kFloat32}, {"bfloat16", DType::kBFloat16},
    {"int8", DType::kInt8Block},  {"int4", DType::kInt4Block},
    {"sparse2", DType::kSparse2}, {"sparse4", DType::kSparse4}};
constexpr Choice<AveragingMode> kModes[] = {
    {"mean", AveragingMode::kMean},
    {"outer_nesterov", AveragingMode::kOuterNesterov},
    {"outer_sgd", AveragingMode::kOuterSgd}};
constexpr Choice<NonFinitePolicy> kPolicies[] = {
    {"reject", NonFinitePolicy::kReject}, {"drop", NonFinitePolicy::kDrop}};
constexpr Choice<Contribution> kContributions[] = {
    {"pseudo_gradients", Contribution::kPseudoGradients},
    {"parameters", Contribution::kParameters}};
constexpr Choice<MeanEncoding> kMeanEncodings[] = {
    {"float32", MeanEncoding::kFloat32}, {"wire", MeanEncoding::kWire}};
constexpr Choice<StepBudget> kStepBudgets[] = {
    {"fixed", StepBudget::kFixed}, {"adaptive", StepBudget::kAdaptive}};
constexpr Choice<DeadlineMode> kDeadlineModes[] = {
    {"fixed", DeadlineMode::kFixed}, {"adaptive", DeadlineMode::kAdaptive}};

// The parts of a row that follow from the field: whether it is set,
// equality, copy.
#define LOCALSGD_SETTING(field, unset)                   \
  [](const JobSettings& s) { return s.field != unset; }, \
      [](const JobSettings& a, const JobSettings& b) {   \
        return a.field == b.field;                       \
      },                                                 \
      [](const JobSettings& from, JobSettings& to) { to.field = from.field; }

// A row's text form: a number, or one of `choices` named by `name_of`.
#define LOCALSGD_NUMBER_TEXT(field, parse_fn)                 \
  [](const JobSettings& s) { return absl::StrCat(s.field); }, \
      [](absl::string_view text, JobSettings& s) {            \
        return parse_fn(text, s.field);                       \
      }
#define LOCALSGD_CHOICE_TEXT(field, choices, name_of)                 \
  [](const JobSettings& s) { return std::string(name_of(s.field)); }, \
      [](absl::string_view text, JobSettings& s) {                    \
        return ParseChoice(text, choices, s.field);                   \
      }

// In the order FirstDifference checks them. Each row: name; flag, its
// default and help; is_set, equal, copy; differs; format, parse; probe.
const JobSettingSpec kSpecs[] = {
    {"local_sgd_steps", nullptr, "",
     "Local steps between syncs (K); set by the job's first member, shown "
     "to the others.",
     LOCALSGD_SETTING(local_sgd_steps, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("syncs every ", job.local_sgd_steps,
                           " steps; member asks for ", asked.local_sgd_steps);
     },
     LOCALSGD_NUMBER_TEXT(local_sgd_steps, ParseNumber),
     [](JobSettings& s) { s.local_sgd_steps = 7; }},
    {"chunk_elements", "chunk_elements", "131072",
     "Default elements per chunk for new jobs (a job's first member may ask "
     "for another size).",
     LOCALSGD_SETTING(chunk_elements, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses chunks of ", job.chunk_elements,
                           " elements; member asks for ", asked.chunk_elements);
     },
     LOCALSGD_NUMBER_TEXT(chunk_elements, ParseNumber),
     [](JobSettings& s) { s.chunk_elements = 3000; }},
    {"wire_dtype", "wire_dtype", "float32",
     "Default wire dtype for new jobs: float32 or bfloat16, and for jobs of "
     "pseudo-gradients int8 or int4 (blockwise codes with error feedback) "
     "or sparse2 or sparse4 (the --sparse_keep largest of every 4096 values "
     "in 2 or 4 bits, with error feedback).",
     LOCALSGD_SETTING(wire_dtype, DType::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses wire dtype ", DTypeName(job.wire_dtype),
                           "; member asks for ", DTypeName(asked.wire_dtype));
     },
     LOCALSGD_CHOICE_TEXT(wire_dtype, kWireDTypes, DTypeName),
     [](JobSettings& s) { s.wire_dtype = DType::kInt8Block; }},
    {"rendezvous_members", nullptr, "",
     "Averaging starts once this many members take part (0 or 1: no "
     "rendezvous); set by the job's first member.",
     LOCALSGD_SETTING(rendezvous_members, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("starts with ", job.rendezvous_members,
                           " members; member asks for ",
                           asked.rendezvous_members);
     },
     LOCALSGD_NUMBER_TEXT(rendezvous_members, ParseNumber),
     [](JobSettings& s) { s.rendezvous_members = 3; }},
    {"mode", "averaging", "mean",
     "Default averaging rule for new jobs: mean, outer_nesterov (DiLoCo: "
     "torch.optim.SGD(nesterov=True) on the mean pseudo-gradient) or "
     "outer_sgd.",
     LOCALSGD_SETTING(mode, AveragingMode::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses averaging mode ", AveragingModeName(job.mode),
                           "; member asks for ", AveragingModeName(asked.mode));
     },
     LOCALSGD_CHOICE_TEXT(mode, kModes, AveragingModeName),
     [](JobSettings& s) { s.mode = AveragingMode::kOuterNesterov; }},
    {"nonfinite_policy", "nonfinite_policy", "reject",
     "Default for new jobs of what a chunk with a NaN or infinity does: "
     "reject (the Sync fails with INVALID_ARGUMENT) or drop (the member is "
     "dropped from that round).",
     LOCALSGD_SETTING(nonfinite_policy, NonFinitePolicy::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("treats non-finite values with policy '",
                           NonFinitePolicyName(job.nonfinite_policy),
                           "'; member asks for '",
                           NonFinitePolicyName(asked.nonfinite_policy), "'");
     },
     LOCALSGD_CHOICE_TEXT(nonfinite_policy, kPolicies, NonFinitePolicyName),
     [](JobSettings& s) { s.nonfinite_policy = NonFinitePolicy::kDrop; }},
    {"contribution", "contribution", "pseudo_gradients",
     "Default for new jobs of what members send: pseudo_gradients (their "
     "change since the state they trained from; the coordinator keeps the "
     "float32 state and the outer optimizer) or parameters (the protocol "
     "before pseudo-gradients: parameters are averaged as they are). A Join "
     "from a client that predates pseudo-gradients is refused by a job of "
     "pseudo-gradients.",
     LOCALSGD_SETTING(contribution, Contribution::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("takes ", ContributionName(job.contribution),
                           "; member sends ",
                           ContributionName(asked.contribution));
     },
     LOCALSGD_CHOICE_TEXT(contribution, kContributions, ContributionName),
     [](JobSettings& s) { s.contribution = Contribution::kPseudoGradients; }},
    {"outer_lr", "outer_lr", "0.7",
     "Default outer learning rate for new jobs (outer_nesterov, outer_sgd), "
     "in (0, 100].",
     LOCALSGD_SETTING(outer_lr, 0.0f),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses outer learning rate ", job.outer_lr,
                           "; member asks for ", asked.outer_lr);
     },
     LOCALSGD_NUMBER_TEXT(outer_lr, ParseFloat),
     [](JobSettings& s) { s.outer_lr = 0.25f; }},
    {"outer_momentum", "outer_momentum", "0.9",
     "Default outer momentum for new jobs (outer_nesterov), in (0, 1).",
     LOCALSGD_SETTING(outer_momentum, 0.0f),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses outer momentum ", job.outer_momentum,
                           "; member asks for ", asked.outer_momentum);
     },
     LOCALSGD_NUMBER_TEXT(outer_momentum, ParseFloat),
     [](JobSettings& s) { s.outer_momentum = 0.5f; }},
    {"deadline_mode", "deadline_mode", "fixed",
     "Default for new jobs of how rounds stop waiting for their slowest "
     "participants: fixed (--round_deadline, if any) or adaptive (learned "
     "from the job's recent rounds: a persistent straggler adopts instead "
     "of holding the others back; docs/design.md \"Rounds\").",
     LOCALSGD_SETTING(deadline_mode, DeadlineMode::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat(
           "uses deadline mode ", DeadlineModeName(job.deadline_mode),
           "; member asks for ", DeadlineModeName(asked.deadline_mode));
     },
     LOCALSGD_CHOICE_TEXT(deadline_mode, kDeadlineModes, DeadlineModeName),
     [](JobSettings& s) { s.deadline_mode = DeadlineMode::kAdaptive; }},
    {"outlier_ratio", "outlier_ratio", "10",
     "Default outlier guard for new jobs of pseudo-gradients: a "
     "contribution chunk whose L2 norm exceeds this many times the median "
     "of the chunk's recent contributions is refused and its member "
     "dropped from the round; in [2, 1e9], or off (docs/design.md "
     "\"Outlier guard\").",
     LOCALSGD_SETTING(outlier_ratio, 0.0f),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat(
           "uses outlier ratio ", OutlierRatioText(job.outlier_ratio),
           "; member asks for ", OutlierRatioText(asked.outlier_ratio));
     },
     [](const JobSettings& s) { return OutlierRatioText(s.outlier_ratio); },
     [](absl::string_view text, JobSettings& s) {
       return ParseOutlierRatio(text, s.outlier_ratio);
     },
     [](JobSettings& s) { s.outlier_ratio = 4; }},
    {"mean_encoding", "mean_encoding", "float32",
     "Default for new jobs of pseudo-gradients of what the rule is applied "
     "to: float32 (the round's mean delta as computed) or wire (the mean "
     "encoded in the wire dtype with the coordinator's error feedback: a "
     "standby then gets one member's download per round instead of the "
     "float32 mean, and a failover drops the mean's residual; "
     "docs/design.md \"Replication: what a failover keeps\").",
     LOCALSGD_SETTING(mean_encoding, MeanEncoding::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat(
           "uses mean encoding ", MeanEncodingName(job.mean_encoding),
           "; member asks for ", MeanEncodingName(asked.mean_encoding));
     },
     LOCALSGD_CHOICE_TEXT(mean_encoding, kMeanEncodings, MeanEncodingName),
     [](JobSettings& s) { s.mean_encoding = MeanEncoding::kWire; }},
    {"max_staleness", "max_staleness", "off",
     "Default for new jobs of pseudo-gradients of how many rounds old a "
     "member's anchor may be for its delta to be merged into the open round "
     "(weighted by 1/(1+staleness)) instead of thrown away; in [1, 64], or "
     "off (docs/design.md \"Stale contributions\").",
     LOCALSGD_SETTING(max_staleness, 0),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("merges deltas at most ",
                           MaxStalenessText(job.max_staleness),
                           " rounds stale; member asks for ",
                           MaxStalenessText(asked.max_staleness));
     },
     [](const JobSettings& s) { return MaxStalenessText(s.max_staleness); },
     [](absl::string_view text, JobSettings& s) {
       return ParseMaxStaleness(text, s.max_staleness);
     },
     [](JobSettings& s) { s.max_staleness = 3; }},
    {"step_budget", "step_budget", "fixed",
     "Default for new jobs of how many local steps members make between "
     "contributions: fixed (K each) or adaptive (the coordinator learns each "
     "member's step rate and upload time and hands it the steps to make so "
     "that contributions arrive together, weighing each by its steps; "
     "docs/design.md \"Step budgets\").",
     LOCALSGD_SETTING(step_budget, StepBudget::kUnspecified),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("uses step budget ", StepBudgetName(job.step_budget),
                           "; member asks for ",
                           StepBudgetName(asked.step_budget));
     },
     LOCALSGD_CHOICE_TEXT(step_budget, kStepBudgets, StepBudgetName),
     [](JobSettings& s) { s.step_budget = StepBudget::kAdaptive; }},
    {"min_local_steps", nullptr, "",
     "The fewest local steps an adaptive step budget says (0: max(1, K / "
     "4)).",
     LOCALSGD_SETTING(min_local_steps, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("budgets at least ", job.min_local_steps,
                           " local steps; member asks for ",
                           asked.min_local_steps);
     },
     LOCALSGD_NUMBER_TEXT(min_local_steps, ParseNumber),
     [](JobSettings& s) { s.min_local_steps = 2; }},
    {"max_local_steps", nullptr, "",
     "The most local steps an adaptive step budget says (0: 4 K).",
     LOCALSGD_SETTING(max_local_steps, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("budgets at most ", job.max_local_steps,
                           " local steps; member asks for ",
                           asked.max_local_steps);
     },
     LOCALSGD_NUMBER_TEXT(max_local_steps, ParseNumber),
     [](JobSettings& s) { s.max_local_steps = 40; }},
    {"sparse_keep", "sparse_keep", "64",
     "Default for new jobs of the values a sparse wire dtype (sparse2, "
     "sparse4) keeps per block of 4096, in [1, 4096] (64: 1.56%).",
     LOCALSGD_SETTING(sparse_keep, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("keeps ", job.sparse_keep,
                           " values per sparse block; member asks for ",
                           asked.sparse_keep);
     },
     LOCALSGD_NUMBER_TEXT(sparse_keep, ParseNumber),
     [](JobSettings& s) { s.sparse_keep = 100; }},
    {"sparse_result_keep", "sparse_result_keep", "256",
     "Default for new jobs of the values the coordinator's step keeps per "
     "block of 4096 in a sparse wire dtype, in [1, 4096] (the mean of W "
     "uploads has up to W x sparse_keep non-zero values per block).",
     LOCALSGD_SETTING(sparse_result_keep, 0u),
     [](const JobSettings& job, const JobSettings& asked) {
       return absl::StrCat("keeps ", job.sparse_result_keep,
                           " values per sparse block of a result; member "
                           "asks for ",
                           asked.sparse_result_keep);
     },
     LOCALSGD_NUMBER_TEXT(sparse_result_keep, ParseNumber),
     [](JobSettings& s) { s.sparse_result_keep = 300; }},
};

#undef LOCALSGD_SETTING
#undef LOCALSGD_NUMBER_TEXT
#undef LOCALSGD_CHOICE_TEXT

// Does not compile when JobSettings gains or loses a field: give the new
// one its row in kSpecs (and see settings.h for the other layers).
[[maybe_unused]] void EveryFieldHasARow(const JobSettings& s) {
  [[maybe_unused]] const auto& [f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11,
                                f12, f13, f14, f15, f16, f17, f18] = s;
  static_assert(sizeof(kSpecs) / sizeof(kSpecs[0]) == 18,
                "one row of kSpecs per field of JobSettings");
}

}  // namespace

absl::Span<const JobSettingSpec> JobSettingSpecs() { return kSpecs; }

const JobSettingSpec* FindJobSetting(absl::string_view name) {
  for (const JobSettingSpec& spec : kSpecs) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

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
                     " is not supported; use float32, bfloat16, int8, int4, "
                     "sparse2 or sparse4"));
  }
  for (const auto& [name, keep] :
       {std::pair<const char*, uint32_t>{"sparse_keep", s.sparse_keep},
        {"sparse_result_keep", s.sparse_result_keep}}) {
    if (keep != 0 && !ValidateSparseCode(SparseCode{keep, 2}).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, name, " ", keep, " is out of range; a sparse block keeps 1 to ",
          kSparseBlock, " of its ", kSparseBlock, " values"));
    }
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
  if (s.outlier_ratio != 0 && s.outlier_ratio != kOutlierGuardOff &&
      !(s.outlier_ratio >= kMinOutlierRatio &&
        s.outlier_ratio <= kMaxOutlierRatio)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "outlier_ratio ", s.outlier_ratio, " is out of range; use [",
        kMinOutlierRatio, ", ", kMaxOutlierRatio, "], or ", kOutlierGuardOff,
        " for no outlier guard"));
  }
  if (s.max_staleness != 0 && s.max_staleness != kMaxStalenessOff &&
      !(s.max_staleness >= 1 && s.max_staleness <= kMaxStalenessLimit)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "max_staleness ", s.max_staleness,
                     " is out of range; use [1, ", kMaxStalenessLimit, "], or ",
                     kMaxStalenessOff, " for no stale contributions"));
  }
  if (s.step_budget != StepBudget::kUnspecified &&
      s.step_budget != StepBudget::kFixed &&
      s.step_budget != StepBudget::kAdaptive) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "step budget ", static_cast<int>(s.step_budget),
                     " is not supported; use fixed or adaptive"));
  }
  for (const auto& [name, n] :
       {std::pair<const char*, uint32_t>{"min_local_steps", s.min_local_steps},
        {"max_local_steps", s.max_local_steps}}) {
    if (n > kMaxLocalSteps) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, name, " ", n, " is out of range; at most ", kMaxLocalSteps));
    }
  }
  if (s.min_local_steps != 0 && s.max_local_steps != 0 &&
      s.min_local_steps > s.max_local_steps) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "min_local_steps ", s.min_local_steps,
                     " exceeds max_local_steps ", s.max_local_steps));
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
  if (s.mean_encoding != MeanEncoding::kUnspecified &&
      s.mean_encoding != MeanEncoding::kFloat32 &&
      s.mean_encoding != MeanEncoding::kWire) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "mean encoding ", static_cast<int>(s.mean_encoding),
                     " is not supported; use float32 or wire"));
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
  if (IsSparseDType(s.wire_dtype) &&
      (s.sparse_keep == 0 || s.sparse_result_keep == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "wire dtype ", DTypeName(s.wire_dtype),
                     " needs a sparse_keep and a sparse_result_keep"));
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
  if (s.mean_encoding == MeanEncoding::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "mean encoding must be float32 or wire"));
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
    if (IsCodeDType(s.wire_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "wire dtype ", DTypeName(s.wire_dtype),
          " needs contribution pseudo_gradients (parameters travel as "
          "float32 or bfloat16)"));
    }
    if (s.mean_encoding != MeanEncoding::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "mean encoding ", MeanEncodingName(s.mean_encoding),
          " needs contribution pseudo_gradients (a job of parameters "
          "averages them as they are: float32)"));
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
  for (const JobSettingSpec& f : kSpecs) {
    if (f.is_set(asked)) f.copy(asked, out);
  }
  return out;
}

std::string FirstDifference(const JobSettings& job, const JobSettings& asked) {
  for (const JobSettingSpec& f : kSpecs) {
    if (f.is_set(asked) && !f.equal(job, asked)) return f.differs(job, asked);
  }
  return "";
}

}  // namespace localsgd
