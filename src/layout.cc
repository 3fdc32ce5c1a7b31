#include "src/layout.h"

#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace localsgd {
namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

void FnvBytes(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnvPrime;
  }
}

void FnvU64(uint64_t& h, uint64_t v) {
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i));
  FnvBytes(h, le, sizeof(le));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsLayoutDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16 || dtype == DType::kFloat64;
}

}  // namespace

uint64_t ComputeFingerprint(const std::vector<TensorSpec>& tensors) {
  uint64_t h = kFnvOffset;
  for (const TensorSpec& t : tensors) {
    FnvBytes(h, t.name.data(), t.name.size());
    const unsigned char zero = 0;
    FnvBytes(h, &zero, 1);
    const auto dtype = static_cast<unsigned char>(t.dtype);
    FnvBytes(h, &dtype, 1);
    FnvU64(h, t.shape.size());
    for (int64_t d : t.shape) FnvU64(h, static_cast<uint64_t>(d));
  }
  return h;
}

Layout MakeLayout(std::vector<TensorSpec> tensors) {
  Layout layout;
  layout.fingerprint = ComputeFingerprint(tensors);
  layout.tensors = std::move(tensors);
  return layout;
}

uint64_t NumElements(const TensorSpec& tensor) {
  uint64_t n = 1;
  for (int64_t d : tensor.shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<uint64_t> ValidateLayout(const Layout& layout,
                                        uint64_t max_elements) {
  if (layout.tensors.empty()) {
    return absl::InvalidArgumentError("layout has no tensors");
  }
  absl::flat_hash_set<absl::string_view> names;
  uint64_t total = 0;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorSpec& t = layout.tensors[i];
    if (t.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", i, " has an empty name"));
    }
    if (t.name.size() > kMaxTensorNameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", i, " has a name of ", t.name.size(),
                       " bytes; at most ", kMaxTensorNameBytes));
    }
    if (absl::Status s = CheckNoControlCharacters(
            t.name, absl::StrCat("the name of layout tensor ", i));
        !s.ok()) {
      return s;
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layout tensor ", i, " '", t.name, "' repeats an earlier name"));
    }
    if (!IsLayoutDType(t.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", i, " '", t.name,
                       "' has no floating-point dtype (got ",
                       static_cast<int>(t.dtype), ")"));
    }
    if (t.shape.size() > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", i, " '", t.name, "' has rank ",
                       t.shape.size(), "; at most 16 is supported"));
    }
    uint64_t n = 1;
    bool too_large = false;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layout tensor ", i, " '", t.name,
            "' has a negative dimension: shape ", ShapeString(t.shape)));
      }
      // Overflow-checked product; a later zero dimension does not make an
      // overflowed tensor small.
      too_large |= __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n);
    }
    if (too_large || n > max_elements ||
        __builtin_add_overflow(total, n, &total) || total > max_elements) {
      return absl::ResourceExhaustedError(
          absl::StrCat("layout has more than ", max_elements,
                       " elements (at tensor ", i, " '", t.name, "' shape ",
                       ShapeString(t.shape), "); raise --max_model_elements"));
    }
  }
  if (total == 0) {
    return absl::InvalidArgumentError("layout has no elements");
  }
  const uint64_t expected = ComputeFingerprint(layout.tensors);
  if (layout.fingerprint != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout fingerprint ", absl::Hex(layout.fingerprint),
        " does not match its tensors (expected ", absl::Hex(expected),
        "); the client computes it differently"));
  }
  return total;
}

std::string FirstDifference(const Layout& expected, const Layout& actual) {
  const size_t n = std::min(expected.tensors.size(), actual.tensors.size());
  for (size_t i = 0; i < n; ++i) {
    const TensorSpec& e = expected.tensors[i];
    const TensorSpec& a = actual.tensors[i];
    if (e.name != a.name) {
      return absl::StrCat("tensor ", i, ": name '", a.name,
                          "' where the job has '", e.name, "'");
    }
    if (e.shape != a.shape) {
      return absl::StrCat("tensor ", i, " '", e.name, "': shape ",
                          ShapeString(a.shape), " where the job has ",
                          ShapeString(e.shape));
    }
    if (e.dtype != a.dtype) {
      return absl::StrCat("tensor ", i, " '", e.name, "': dtype ",
                          DTypeName(a.dtype), " where the job has ",
                          DTypeName(e.dtype));
    }
  }
  if (actual.tensors.size() > n) {
    return absl::StrCat(actual.tensors.size(), " tensors where the job has ",
                        expected.tensors.size(), "; first extra tensor ", n,
                        " '", actual.tensors[n].name, "'");
  }
  if (expected.tensors.size() > n) {
    return absl::StrCat(actual.tensors.size(), " tensors where the job has ",
                        expected.tensors.size(), "; first missing tensor ", n,
                        " '", expected.tensors[n].name, "'");
  }
  return "";
}

ChunkGeometry::ChunkGeometry(uint64_t num_elements, uint32_t chunk_elements)
    : num_elements_(num_elements),
      chunk_elements_(chunk_elements),
      num_chunks_(static_cast<uint32_t>((num_elements + chunk_elements - 1) /
                                        chunk_elements)) {}

uint32_t ChunkGeometry::Size(uint32_t index) const {
  const uint64_t begin = Offset(index);
  const uint64_t end =
      std::min<uint64_t>(begin + chunk_elements_, num_elements_);
  return static_cast<uint32_t>(end - begin);
}

uint64_t ShardElements(uint64_t num_elements, uint32_t chunk_elements,
                       ShardSpec shard) {
  const uint64_t chunks = (num_elements + chunk_elements - 1) / chunk_elements;
  if (shard.index >= chunks) return 0;
  // Chunks index, index + count, ...: all full but possibly the last chunk of
  // the whole.
  const uint64_t owned = (chunks - 1 - shard.index) / shard.count + 1;
  const uint64_t last = shard.index + (owned - 1) * shard.count;
  const uint64_t last_size = last + 1 == chunks
                                 ? num_elements - last * chunk_elements
                                 : chunk_elements;
  return (owned - 1) * chunk_elements + last_size;
}

}  // namespace localsgd
