#include "src/types.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace localsgd {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt8Block:
      return "int8";
    case DType::kInt4Block:
      return "int4";
    case DType::kSparse2:
      return "sparse2";
    case DType::kSparse4:
      return "sparse4";
    case DType::kUnspecified:
      break;
  }
  return "unspecified";
}

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat64:
      return 8;
    case DType::kInt8Block:  // per element; scales come on top (WireBytes)
      return 1;
    case DType::kInt4Block:  // two per byte: see WireBytes
    case DType::kSparse2:    // positions and codes of the kept: WireBytes
    case DType::kSparse4:
    case DType::kUnspecified:
      break;
  }
  return 0;
}

absl::string_view DeadlineModeName(DeadlineMode mode) {
  switch (mode) {
    case DeadlineMode::kFixed:
      return "fixed";
    case DeadlineMode::kAdaptive:
      return "adaptive";
    case DeadlineMode::kUnspecified:
      break;
  }
  return "unspecified";
}

absl::string_view StepBudgetName(StepBudget budget) {
  switch (budget) {
    case StepBudget::kFixed:
      return "fixed";
    case StepBudget::kAdaptive:
      return "adaptive";
    case StepBudget::kUnspecified:
      break;
  }
  return "unspecified";
}

absl::string_view MeanEncodingName(MeanEncoding encoding) {
  switch (encoding) {
    case MeanEncoding::kFloat32:
      return "float32";
    case MeanEncoding::kWire:
      return "wire";
    case MeanEncoding::kUnspecified:
      break;
  }
  return "unspecified";
}

absl::string_view NonFinitePolicyName(NonFinitePolicy policy) {
  switch (policy) {
    case NonFinitePolicy::kReject:
      return "reject";
    case NonFinitePolicy::kDrop:
      return "drop";
    case NonFinitePolicy::kUnspecified:
      break;
  }
  return "unspecified";
}

absl::string_view AveragingModeName(AveragingMode mode) {
  switch (mode) {
    case AveragingMode::kMean:
      return "mean";
    case AveragingMode::kOuterNesterov:
      return "outer_nesterov";
    case AveragingMode::kOuterSgd:
      return "outer_sgd";
    case AveragingMode::kUnspecified:
      break;
  }
  return "unspecified";
}

absl::string_view ContributionName(Contribution contribution) {
  switch (contribution) {
    case Contribution::kParameters:
      return "parameters";
    case Contribution::kPseudoGradients:
      return "pseudo_gradients";
    case Contribution::kUnspecified:
      break;
  }
  return "unspecified";
}

bool IsWireDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         IsCodeDType(dtype);
}

absl::Status ValidateJobId(absl::string_view job_id) {
  if (job_id.empty() || job_id.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id must have 1 to 128 characters; got ", job_id.size()));
  }
  for (char c : job_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "job_id may contain only letters, digits, '.', '_' and '-'");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNoControlCharacters(absl::string_view value,
                                      absl::string_view what) {
  constexpr absl::string_view kWhy =
      "; names appear in status and logs, so only printable characters are "
      "allowed";
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a control character (0x",
                       absl::Hex(c, absl::kZeroPad2), ") at byte ", i, kWhy));
    }
    const unsigned char c1 =
        i + 1 < value.size() ? static_cast<unsigned char>(value[i + 1]) : 0;
    const unsigned char c2 =
        i + 2 < value.size() ? static_cast<unsigned char>(value[i + 2]) : 0;
    // C1 controls: U+0080-U+009F are C2 80-C2 9F in UTF-8.
    if (c == 0xc2 && c1 >= 0x80 && c1 <= 0x9f) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has a C1 control character (U+",
          absl::AsciiStrToUpper(absl::StrCat(absl::Hex(c1, absl::kZeroPad4))),
          ") at byte ", i, kWhy));
    }
    // Line and paragraph separators U+2028-U+2029 (E2 80 A8-A9): a new
    // line to some viewers.
    if (c == 0xe2 && c1 == 0x80 && (c2 == 0xa8 || c2 == 0xa9)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a line or paragraph separator (U+202",
                       c2 == 0xa8 ? "8" : "9", ") at byte ", i, kWhy));
    }
    // Bidi embeddings and overrides U+202A-U+202E (E2 80 AA-AE), isolates
    // U+2066-U+2069 (E2 81 A6-A9).
    if (c == 0xe2 && ((c1 == 0x80 && c2 >= 0xaa && c2 <= 0xae) ||
                      (c1 == 0x81 && c2 >= 0xa6 && c2 <= 0xa9))) {
      const unsigned code = 0x2000 | ((c1 & 0x3f) << 6) | (c2 & 0x3f);
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has a bidirectional formatting character (U+",
          absl::AsciiStrToUpper(absl::StrCat(absl::Hex(code, absl::kZeroPad4))),
          ") at byte ", i,
          "; names appear in status and logs, where it would show text "
          "reordered"));
    }
  }
  return absl::OkStatus();
}

bool MemberId::IsWellFormed(absl::string_view hex) {
  if (hex.size() != 32) return false;
  for (char c : hex) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace localsgd
