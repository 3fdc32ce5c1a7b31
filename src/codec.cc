#include "src/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace localsgd {

// The loops below are written so that GCC vectorizes them at -O2/-O3: plain
// indexed loops over restrict-free local pointers, memcpy for type punning.
// The hot ones are also built for AVX2 and picked at load time where the CPU
// has it (x86-64's baseline is SSE2, which has no 32->16-bit pack: bf16
// encoding at SSE2 runs at a third of the AVX2 speed).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define LOCALSGD_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define LOCALSGD_KERNEL
#endif

LOCALSGD_KERNEL
void EncodeValuesTo(absl::Span<const float> values, DType dtype, char* out) {
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h = FloatToBFloat16(values[i]);
      std::memcpy(out + 2 * i, &h, 2);
    }
  } else if (!values.empty()) {
    std::memcpy(out, values.data(), values.size() * sizeof(float));
  }
}

void EncodeValues(absl::Span<const float> values, DType dtype,
                  std::string* out) {
  out->resize(WireBytes(dtype, values.size()));
  EncodeValuesTo(values, dtype, out->data());
}

LOCALSGD_KERNEL
absl::Status DecodeValues(absl::string_view data, DType dtype,
                          absl::Span<float> out) {
  if (data.size() != WireBytes(dtype, out.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload has ", data.size(), " bytes; expected ",
                     WireBytes(dtype, out.size()), " (", out.size(), " ",
                     DTypeName(dtype), " values)"));
  }
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, data.data() + 2 * i, 2);
      out[i] = BFloat16ToFloat(h);
    }
  } else if (!data.empty()) {
    std::memcpy(out.data(), data.data(), data.size());
  }
  return absl::OkStatus();
}

namespace {

// Index of the first element of `data` (elements of type Bits) whose bits
// under `exponent` are all ones, or -1. Checks blocks without branches
// (vectorizable) and looks for the index only in a block that has one.
template <typename Bits>
inline int64_t FirstWithExponentAllOnes(absl::string_view data,
                                        uint32_t exponent) {
  constexpr size_t kBlock = 1024;
  const size_t n = data.size() / sizeof(Bits);
  auto bad_at = [&](size_t i) {
    Bits bits;
    std::memcpy(&bits, data.data() + sizeof(Bits) * i, sizeof(Bits));
    return (static_cast<uint32_t>(bits) & exponent) == exponent;
  };
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    uint32_t bad = 0;
    for (size_t i = b; i < e; ++i) bad |= bad_at(i);
    if (bad) {
      for (size_t i = b; i < e; ++i) {
        if (bad_at(i)) return static_cast<int64_t>(i);
      }
    }
  }
  return -1;
}

}  // namespace

LOCALSGD_KERNEL
int64_t FirstNonFinite(absl::string_view data, DType dtype) {
  // Exponent all ones means Inf or NaN: the same test for bf16 (the upper
  // half of a float32) and float32 bits.
  if (dtype == DType::kBFloat16) {
    return FirstWithExponentAllOnes<uint16_t>(data, 0x7f80u);
  }
  return FirstWithExponentAllOnes<uint32_t>(data, 0x7f800000u);
}

LOCALSGD_KERNEL
void AccumulateWeighted(absl::string_view data, DType dtype, float weight,
                        absl::Span<float> acc) {
  float* a = acc.data();
  const size_t n = acc.size();
  if (dtype == DType::kBFloat16) {
    const char* p = data.data();
    if (weight == 1.0f) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        a[i] += BFloat16ToFloat(h);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        a[i] += weight * BFloat16ToFloat(h);
      }
    }
    return;
  }
  const char* p = data.data();
  if (weight == 1.0f) {
    // Unit weight (the common case) adds exactly, like all_reduce(SUM).
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      a[i] += v;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      a[i] += weight * v;
    }
  }
}

namespace {

// Calls run(bytes, first) for consecutive runs of whole elements of
// `element_size` bytes, in order, `first` being the run's first element's
// index; an element split between pieces comes as a run of one, assembled
// in a small buffer. Stops early when run returns false. Bytes after the
// last whole element are ignored (callers check the total size first).
template <typename Run>
void ForEachElementRun(absl::Span<const absl::string_view> pieces,
                       size_t element_size, Run run) {
  char carry[8];
  size_t carried = 0;
  size_t element = 0;
  for (absl::string_view piece : pieces) {
    if (carried > 0) {
      const size_t take = std::min(element_size - carried, piece.size());
      if (take == 0) continue;  // an empty piece
      std::memcpy(carry + carried, piece.data(), take);
      carried += take;
      piece.remove_prefix(take);
      if (carried < element_size) continue;
      if (!run(absl::string_view(carry, element_size), element)) return;
      ++element;
      carried = 0;
    }
    const size_t whole = piece.size() / element_size * element_size;
    if (whole > 0) {
      if (!run(piece.substr(0, whole), element)) return;
      element += whole / element_size;
    }
    carried = piece.size() - whole;
    if (carried > 0) std::memcpy(carry, piece.data() + whole, carried);
  }
}

size_t TotalSize(absl::Span<const absl::string_view> pieces) {
  size_t n = 0;
  for (absl::string_view piece : pieces) n += piece.size();
  return n;
}

}  // namespace

int64_t FirstNonFinitePieces(absl::Span<const absl::string_view> pieces,
                             DType dtype) {
  int64_t found = -1;
  ForEachElementRun(pieces, DTypeSize(dtype),
                    [&](absl::string_view run, size_t first) {
                      const int64_t bad = FirstNonFinite(run, dtype);
                      if (bad < 0) return true;
                      found = static_cast<int64_t>(first) + bad;
                      return false;
                    });
  return found;
}

void AccumulateWeightedPieces(absl::Span<const absl::string_view> pieces,
                              DType dtype, float weight,
                              absl::Span<float> acc) {
  const size_t size = DTypeSize(dtype);
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t first) {
    AccumulateWeighted(run, dtype, weight,
                       acc.subspan(first, run.size() / size));
    return true;
  });
}

absl::Status DecodeValuesPieces(absl::Span<const absl::string_view> pieces,
                                DType dtype, absl::Span<float> out) {
  const size_t bytes = TotalSize(pieces);
  if (bytes != WireBytes(dtype, out.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload has ", bytes, " bytes; expected ",
                     WireBytes(dtype, out.size()), " (", out.size(), " ",
                     DTypeName(dtype), " values)"));
  }
  const size_t size = DTypeSize(dtype);
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t first) {
    // The size is right: DecodeValues cannot fail.
    (void)DecodeValues(run, dtype, out.subspan(first, run.size() / size));
    return true;
  });
  return absl::OkStatus();
}

LOCALSGD_KERNEL
void DivideInPlace(absl::Span<float> acc, double total_weight) {
  // Divide (not multiply by the reciprocal) to match accelerate's `c /= world`.
  const float w = static_cast<float>(total_weight);
  for (float& v : acc) v /= w;
}

LOCALSGD_KERNEL
void RoundTripInPlace(absl::Span<float> values, DType dtype) {
  if (dtype != DType::kBFloat16) return;
  for (float& v : values) v = BFloat16ToFloat(FloatToBFloat16(v));
}

}  // namespace localsgd
