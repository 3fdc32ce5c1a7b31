#include "src/codec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace localsgd {

// The loops below are written so that GCC vectorizes them at -O2/-O3: plain
// indexed loops over local pointers (never an absl::Span's operator[],
// which hardened Abseil bound-checks), memcpy for type punning; __restrict
// only where the callers' buffers never overlap. Built with
// -ffp-contract=off (src/CMakeLists.txt): no a + b * c becomes an FMA, so
// every decode and step gives the same bits on every machine.
// The hot ones are also built for AVX2 and picked at load time where the CPU
// has it (x86-64's baseline is SSE2, which has no 32->16-bit pack: bf16
// encoding at SSE2 runs at a third of the AVX2 speed).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define LOCALSGD_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define LOCALSGD_KERNEL
#endif

// The blockwise encoders also come in AVX2 intrinsics (below), chosen at
// run time where the CPU has AVX2, with any compiler and sanitizer.
#if defined(__x86_64__) && defined(__GNUC__)
#define LOCALSGD_AVX2_KERNELS 1
#include <immintrin.h>
#else
#define LOCALSGD_AVX2_KERNELS 0
#endif

namespace {

std::atomic<bool> force_portable_kernels{false};

// Whether the AVX2 kernels run: the CPU has AVX2 and no test asked for
// the portable ones.
[[maybe_unused]] bool UseAvx2() {
#if LOCALSGD_AVX2_KERNELS
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  return has_avx2 && !force_portable_kernels.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Blockwise codes (codec.h): the largest code magnitude, and the bytes of
// the codes of n values.
constexpr int CodeMax(DType dtype) {
  return dtype == DType::kInt8Block ? 127 : 7;
}
size_t CodeBytes(DType dtype, size_t n) {
  return dtype == DType::kInt8Block ? n : (n + 1) / 2;
}
// The blocks of a well-sized payload of `bytes` bytes: its B scales and
// ceil(n / 2) or n code bytes, with n in (kQuantBlock (B - 1), kQuantBlock B].
size_t BlocksOfBytes(DType dtype, size_t bytes) {
  const size_t per_block = 4 + CodeBytes(dtype, kQuantBlock);
  return (bytes + per_block - 1) / per_block;
}
float ScaleAt(const char* data, size_t b) {
  float s;
  std::memcpy(&s, data + 4 * b, 4);
  return s;
}

// Codes for the n <= kQuantBlock values `e` with scale from their absmax;
// a non-finite value makes the scale NaN and the codes 0.
// Branch-free loops (GCC vectorizes them): a NaN fails `a <= max`, an
// infinity too; rounding is half away from zero.
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline float
QuantizeBlock(const float* e, size_t n, int max_code, int8_t* codes) {
  // The largest |e| in eight lanes (a max is exact in any order, so no
  // reduction has to be reassociated to vectorize), then across them.
  constexpr size_t kLanes = 8;
  float lanes[kLanes] = {};
  int not_finite = 0;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      const float a = std::fabs(e[i + k]);
      not_finite |= !(a <= std::numeric_limits<float>::max());
      lanes[k] = a > lanes[k] ? a : lanes[k];
    }
  }
  for (; i < n; ++i) {
    const float a = std::fabs(e[i]);
    not_finite |= !(a <= std::numeric_limits<float>::max());
    lanes[0] = a > lanes[0] ? a : lanes[0];
  }
  float absmax = 0;
  for (size_t k = 0; k < kLanes; ++k) {
    absmax = lanes[k] > absmax ? lanes[k] : absmax;
  }
  if (not_finite) {
    std::memset(codes, 0, n);
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (absmax == 0) {
    std::memset(codes, 0, n);
    return 1.0f;
  }
  // A positive normal scale, also for subnormal blocks, and at most
  // kMaxBlockScale (a block near the float32 limit saturates).
  const float scale = std::min(std::max(absmax / static_cast<float>(max_code),
                                        std::numeric_limits<float>::min()),
                               kMaxBlockScale);
  const float inv = 1.0f / scale;
  const float lim = static_cast<float>(max_code);
  for (i = 0; i < n; ++i) {
    float v = e[i] * inv;
    v = v > lim ? lim : (v < -lim ? -lim : v);
    v += v >= 0 ? 0.5f : -0.5f;
    codes[i] = static_cast<int8_t>(static_cast<int>(v));
  }
  return scale;
}

// Stores the `len` codes of the block starting at element `first` in the
// codes part of a payload: a byte each (int8), or two to a byte, the first
// in the low nibble (int4; an odd last one alone, its high nibble 0).
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline void
PutCodes(const int8_t* codes, size_t len, DType dtype, char* codes_out,
         size_t first) {
  if (dtype == DType::kInt8Block) {
    std::memcpy(codes_out + first, codes, len);
    return;
  }
  // kQuantBlock is even: a block's codes start on a byte.
  // Whole pairs, then an odd last one: no test in the loop (it vectorizes).
  uint8_t* p = reinterpret_cast<uint8_t*>(codes_out) + first / 2;
  const size_t pairs = len / 2;
  for (size_t k = 0; k < pairs; ++k) {
    p[k] = static_cast<uint8_t>((static_cast<uint8_t>(codes[2 * k]) & 0x0f) |
                                (static_cast<uint8_t>(codes[2 * k + 1]) << 4));
  }
  if (len % 2 != 0) p[pairs] = static_cast<uint8_t>(codes[len - 1]) & 0x0f;
}

// Blockwise codes with error feedback for the `len` values of block `b`
// (elements from `first`), in one pass: e = v + r, its scale and codes
// (QuantizeBlock, as EncodeBlocks), what they decode to (as
// DecodeBlocksImpl decodes them, weight 1: the codes are within [-max,
// max], so its clamp changes nothing), and r = e - decoded. Bit for bit
// EncodeValuesTo(v + r), DecodeValues, r = e - decoded. `d` may be `v` (a
// block is read whole before it is written); r is neither.
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline void
EncodeBlockWithFeedback(const float* v, float* r, DType dtype, char* out,
                        char* codes_out, float* d, size_t b, size_t len,
                        const float* a = nullptr) {
  const size_t first = b * kQuantBlock;
  float e[kQuantBlock];
  int8_t codes[kQuantBlock];
  const float* vb = v + first;
  float* rb = r + first;
  // Two copies of each loop, not a test inside one: they vectorize.
  if (a != nullptr) {
    // The delta v - a (SubtractTo's float32 difference), then + r.
    const float* ab = a + first;
    for (size_t i = 0; i < len; ++i) e[i] = (vb[i] - ab[i]) + rb[i];
  } else {
    for (size_t i = 0; i < len; ++i) e[i] = vb[i] + rb[i];
  }
  const float scale = QuantizeBlock(e, len, CodeMax(dtype), codes);
  std::memcpy(out + 4 * b, &scale, 4);
  const float s = 1.0f * scale;  // DecodeBlocksImpl's weight * scale
  if (d != nullptr) {
    float* db = d + first;
    for (size_t i = 0; i < len; ++i) {
      const float dv = s * static_cast<float>(codes[i]);
      db[i] = dv;
      rb[i] = e[i] - dv;
    }
  } else {
    for (size_t i = 0; i < len; ++i) {
      rb[i] = e[i] - s * static_cast<float>(codes[i]);
    }
  }
  PutCodes(codes, len, dtype, codes_out, first);
}

#if LOCALSGD_AVX2_KERNELS

// The blockwise encoders in AVX2 intrinsics, bit for bit the portable
// loops: the same IEEE operations on each value in the same order, and the
// portable code itself for the blocks it treats apart (a non-finite value,
// all zeros, a partial last block). GCC vectorizes the portable loops too,
// but not what dominates them: each block's absmax reduction and the two
// divisions of its scale (here done for eight blocks at once, one lane
// each), and the int32 -> int8 -> nibble packing (bench/reducer_bench
// EncodeFeedbackInt8 against EncodeFeedbackInt8Portable).
// Where the operations differ in form they agree in value:
//  - the absmax is a max over the bits of |e| as int32 (for non-negative
//    floats the integer order is the float order, a max is exact in any
//    order); bits above the largest finite float's mean Inf or NaN;
//  - the clamp is min/max, the portable selects' value for finite input;
//  - rounding half away from zero adds 0.5 with the sign of x (the
//    portable code adds +0.5 to -0.0 where this adds -0.5: both truncate
//    to the code 0, and everything else follows from the code).
static_assert(kQuantBlock == 64, "the AVX2 kernels hold a block in 8 x 8");
// What a block's values e are: v; v + r (error feedback: the decoded
// values go to d, what they lost to r); (v - a) + r (a delta against a,
// with feedback, nothing decoded kept).
enum class Source { kValues, kFeedback, kDelta };
constexpr size_t kGroupBlocks = 8;  // blocks whose scales share a division

// Eight values e of a block from element `at` (see Source).
template <Source kSource>
__attribute__((target("avx2"))) inline __m256 LoadAvx2(const float* v,
                                                       const float* a,
                                                       const float* r,
                                                       size_t at) {
  __m256 e = _mm256_loadu_ps(v + at);
  if (kSource == Source::kDelta) {
    e = _mm256_sub_ps(e, _mm256_loadu_ps(a + at));
  }
  if (kSource != Source::kValues) {
    e = _mm256_add_ps(e, _mm256_loadu_ps(r + at));
  }
  return e;
}

// The codes of the block at v (+ r with feedback; finite, scaled by
// `inv`, the reciprocal of its scale `s`) at `codes_out` (int8: 64 bytes;
// int4: 32), and with feedback what they decode to in d and the residual
// e - decoded in r. One register of values at a time, start to end (so
// that d may be v).
template <Source kSource>
__attribute__((target("avx2"))) inline void QuantizeBlockAvx2(
    const float* v, const float* a, float* r, __m256 inv, __m256 s, DType dtype,
    char* codes_out, float* d) {
  constexpr bool kFeedback = kSource != Source::kValues;
  const float max_code = static_cast<float>(CodeMax(dtype));
  const __m256 lim = _mm256_set1_ps(max_code);
  const __m256 neg_lim = _mm256_set1_ps(-max_code);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // int32 -> int8 (exact: |code| <= 127), in element order: the two packs
  // interleave 128-bit lanes, the permutation puts the dwords back.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i bytes[2];
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const int at = 32 * h + 8 * k;
      const __m256 e = LoadAvx2<kSource>(v, a, r, at);
      __m256 x = _mm256_mul_ps(e, inv);
      x = _mm256_min_ps(_mm256_max_ps(x, neg_lim), lim);
      x = _mm256_add_ps(x, _mm256_or_ps(_mm256_and_ps(x, sign), half));
      q[k] = _mm256_cvttps_epi32(x);
      if (kFeedback) {
        const __m256 decoded = _mm256_mul_ps(s, _mm256_cvtepi32_ps(q[k]));
        if (kSource == Source::kFeedback) _mm256_storeu_ps(d + at, decoded);
        _mm256_storeu_ps(r + at, _mm256_sub_ps(e, decoded));
      }
    }
    bytes[h] = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                           _mm256_packs_epi32(q[2], q[3])),
        order);
  }
  if (dtype == DType::kInt8Block) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes_out), bytes[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes_out + 32), bytes[1]);
    return;
  }
  // int4: each pair of codes (a 16-bit word, element 2k in its low byte)
  // into one byte, 2k in the low nibble; then 16 -> 8 bits (values <= 255:
  // exact), qwords back in order.
  const __m256i low = _mm256_set1_epi16(0x000f);
  const __m256i high = _mm256_set1_epi16(0x00f0);
  __m256i pairs[2];
  for (int h = 0; h < 2; ++h) {
    pairs[h] =
        _mm256_or_si256(_mm256_and_si256(bytes[h], low),
                        _mm256_and_si256(_mm256_srli_epi16(bytes[h], 4), high));
  }
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(codes_out),
      _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs[0], pairs[1]), 0xd8));
}

// Pairwise maxes of adjacent lanes of a and b, per 128-bit half: [a0|a1,
// a2|a3, b0|b1, b2|b3] (the max counterpart of hadd).
__attribute__((target("avx2"))) inline __m256i PairMaxAvx2(__m256i a,
                                                           __m256i b) {
  const __m256 fa = _mm256_castsi256_ps(a);
  const __m256 fb = _mm256_castsi256_ps(b);
  return _mm256_max_epi32(
      _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))),
      _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))));
}

// The `count` (1..8) whole blocks from block `first_block`: their scales from
// one division for all, the codes and (with feedback) decoded values and
// residuals of every block but those the portable code takes.
template <Source kSource>
__attribute__((target("avx2"))) void EncodeGroupAvx2(
    const float* v, const float* a, float* r, DType dtype, char* out,
    char* codes_out, float* d, size_t first_block, size_t count) {
  // The bits of each block's largest |e|, lane j for block j.
  const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff);
  __m256i m[kGroupBlocks];
  for (size_t j = 0; j < kGroupBlocks; ++j) {
    m[j] = _mm256_setzero_si256();
    if (j >= count) continue;
    const size_t first = (first_block + j) * kQuantBlock;
    for (size_t k = 0; k < kQuantBlock; k += 8) {
      const __m256 e = LoadAvx2<kSource>(v, a, r, first + k);
      m[j] = _mm256_max_epi32(
          m[j], _mm256_and_si256(_mm256_castps_si256(e), abs_bits));
    }
  }
  const __m256i m0123 =
      PairMaxAvx2(PairMaxAvx2(m[0], m[1]), PairMaxAvx2(m[2], m[3]));
  const __m256i m4567 =
      PairMaxAvx2(PairMaxAvx2(m[4], m[5]), PairMaxAvx2(m[6], m[7]));
  const __m256i max_bits =
      _mm256_max_epi32(_mm256_permute2x128_si256(m0123, m4567, 0x20),
                       _mm256_permute2x128_si256(m0123, m4567, 0x31));
  // Blocks the portable code takes: Inf or NaN (bits above float max), all
  // zeros, beyond `count`. Zero by a float compare, as the portable code
  // finds it: where the thread treats subnormals as zero (DAZ), a block of
  // subnormals is all zeros to both.
  const __m256i special_lanes = _mm256_or_si256(
      _mm256_cmpgt_epi32(max_bits, _mm256_set1_epi32(0x7f7fffff)),
      _mm256_castps_si256(_mm256_cmp_ps(_mm256_castsi256_ps(max_bits),
                                        _mm256_setzero_ps(), _CMP_EQ_OQ)));
  const unsigned special = static_cast<unsigned>(_mm256_movemask_ps(
                               _mm256_castsi256_ps(special_lanes))) |
                           (0xffu << count & 0xffu);
  // QuantizeBlock's scale and its reciprocal, lane by lane.
  const __m256 absmax = _mm256_castsi256_ps(max_bits);
  const __m256 scale = _mm256_min_ps(
      _mm256_max_ps(_mm256_div_ps(absmax, _mm256_set1_ps(static_cast<float>(
                                              CodeMax(dtype)))),
                    _mm256_set1_ps(std::numeric_limits<float>::min())),
      _mm256_set1_ps(kMaxBlockScale));
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), scale);
  alignas(32) float scales[kGroupBlocks];
  alignas(32) float invs[kGroupBlocks];
  _mm256_store_ps(scales, scale);
  _mm256_store_ps(invs, inv);
  for (size_t j = 0; j < count; ++j) {
    const size_t b = first_block + j;
    const size_t first = b * kQuantBlock;
    if (special >> j & 1u) {
      if (kSource != Source::kValues) {
        EncodeBlockWithFeedback(v, r, dtype, out, codes_out, d, b, kQuantBlock,
                                a);
      } else {
        int8_t codes[kQuantBlock];
        const float s =
            QuantizeBlock(v + first, kQuantBlock, CodeMax(dtype), codes);
        std::memcpy(out + 4 * b, &s, 4);
        PutCodes(codes, kQuantBlock, dtype, codes_out, first);
      }
      continue;
    }
    std::memcpy(out + 4 * b, &scales[j], 4);
    QuantizeBlockAvx2<kSource>(
        v + first, a == nullptr ? nullptr : a + first,
        r == nullptr ? nullptr : r + first, _mm256_broadcast_ss(&invs[j]),
        _mm256_broadcast_ss(&scales[j]), dtype,
        codes_out + (dtype == DType::kInt8Block ? first : first / 2),
        d == nullptr ? nullptr : d + first);
  }
}

// The n values' payload; with feedback also r (and d for kFeedback) as
// the portable code writes them.
template <Source kSource>
__attribute__((target("avx2"))) void EncodeBlocksAvx2(const float* v,
                                                      const float* a, float* r,
                                                      DType dtype, char* out,
                                                      float* d, size_t n) {
  const size_t blocks = NumBlocks(n);
  const size_t whole = n / kQuantBlock;
  char* codes_out = out + 4 * blocks;
  for (size_t b = 0; b < whole; b += kGroupBlocks) {
    EncodeGroupAvx2<kSource>(v, a, r, dtype, out, codes_out, d, b,
                             std::min(kGroupBlocks, whole - b));
  }
  if (whole == blocks) return;
  const size_t first = whole * kQuantBlock;
  if (kSource != Source::kValues) {
    EncodeBlockWithFeedback(v, r, dtype, out, codes_out, d, whole, n - first,
                            a);
  } else {
    int8_t codes[kQuantBlock];
    const float s = QuantizeBlock(v + first, n - first, CodeMax(dtype), codes);
    std::memcpy(out + 4 * whole, &s, 4);
    PutCodes(codes, n - first, dtype, codes_out, first);
  }
}

#endif  // LOCALSGD_AVX2_KERNELS

LOCALSGD_KERNEL
void EncodeBlocksPortable(absl::Span<const float> values, DType dtype,
                          char* out) {
  const size_t n = values.size();
  const size_t blocks = NumBlocks(n);
  char* codes_out = out + 4 * blocks;
  int8_t codes[kQuantBlock];
  for (size_t b = 0; b < blocks; ++b) {
    const size_t first = b * kQuantBlock;
    const size_t len = std::min(kQuantBlock, n - first);
    const float scale =
        QuantizeBlock(values.data() + first, len, CodeMax(dtype), codes);
    std::memcpy(out + 4 * b, &scale, 4);
    PutCodes(codes, len, dtype, codes_out, first);
  }
}

void EncodeBlocks(absl::Span<const float> values, DType dtype, char* out) {
#if LOCALSGD_AVX2_KERNELS
  if (UseAvx2()) {
    EncodeBlocksAvx2<Source::kValues>(values.data(), nullptr, nullptr, dtype,
                                      out, nullptr, values.size());
    return;
  }
#endif
  EncodeBlocksPortable(values, dtype, out);
}

// acc[i] = (accumulate ? base[i] : 0) + weight * decode(i), block by block
// (base may be acc itself).
template <bool kAccumulate>
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline void
DecodeBlocksImpl(const char* data, DType dtype, float weight, const float* base,
                 float* acc, size_t n) {
  const size_t blocks = NumBlocks(n);
  const char* codes = data + 4 * blocks;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t first = b * kQuantBlock;
    const size_t len = std::min(kQuantBlock, n - first);
    const float scale = weight * ScaleAt(data, b);
    const float* in = base + first;
    float* a = acc + first;
    if (dtype == DType::kInt8Block) {
      const int8_t* q = reinterpret_cast<const int8_t*>(codes) + first;
      for (size_t i = 0; i < len; ++i) {
        const int c = q[i] < -127 ? -127 : q[i];
        const float v = scale * static_cast<float>(c);
        a[i] = kAccumulate ? in[i] + v : v;
      }
    } else {
      // Two elements per byte, sign-extended by shifts (vectorizes).
      const int8_t* q = reinterpret_cast<const int8_t*>(codes) + first / 2;
      const size_t pairs = len / 2;
      for (size_t k = 0; k < pairs; ++k) {
        const int8_t byte = q[k];
        int lo = static_cast<int8_t>(static_cast<uint8_t>(byte) << 4) >> 4;
        int hi = byte >> 4;
        lo = lo < -7 ? -7 : lo;
        hi = hi < -7 ? -7 : hi;
        const float vlo = scale * static_cast<float>(lo);
        const float vhi = scale * static_cast<float>(hi);
        a[2 * k] = kAccumulate ? in[2 * k] + vlo : vlo;
        a[2 * k + 1] = kAccumulate ? in[2 * k + 1] + vhi : vhi;
      }
      if (len % 2 != 0) {
        int lo = static_cast<int8_t>(static_cast<uint8_t>(q[pairs]) << 4) >> 4;
        lo = lo < -7 ? -7 : lo;
        const float v = scale * static_cast<float>(lo);
        a[len - 1] = kAccumulate ? in[len - 1] + v : v;
      }
    }
  }
}

}  // namespace

namespace {

// INVALID_ARGUMENT unless a payload of `bytes` holds `out` values of
// `code` and a decode's base (if any) has as many.
absl::Status CheckDecodeSizes(size_t bytes, WireCode code, size_t base,
                              size_t out) {
  if (base != out) {
    return absl::InvalidArgumentError(
        absl::StrCat("base has ", base, " values; out has ", out));
  }
  if (bytes != WireBytes(code, out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload has ", bytes, " bytes; expected ", WireBytes(code, out), " (",
        out, " ", DTypeName(code.dtype), " values)"));
  }
  return absl::OkStatus();
}

}  // namespace

LOCALSGD_KERNEL
void EncodeValuesTo(absl::Span<const float> values, WireCode code, char* out) {
  const DType dtype = code.dtype;
  if (IsSparseDType(dtype)) {
    EncodeSparseWithFeedback(values, {}, SparseCodeOf(code), out);
  } else if (IsBlockDType(dtype)) {
    EncodeBlocks(values, dtype, out);
  } else if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h = FloatToBFloat16(values[i]);
      std::memcpy(out + 2 * i, &h, 2);
    }
  } else if (!values.empty()) {
    std::memcpy(out, values.data(), values.size() * sizeof(float));
  }
}

void EncodeValues(absl::Span<const float> values, WireCode code,
                  std::string* out) {
  out->resize(WireBytes(code, values.size()));
  EncodeValuesTo(values, code, out->data());
}

LOCALSGD_KERNEL
absl::Status DecodeValues(absl::string_view data, WireCode code,
                          absl::Span<float> out) {
  const DType dtype = code.dtype;
  if (absl::Status s =
          CheckDecodeSizes(data.size(), code, out.size(), out.size());
      !s.ok()) {
    return s;
  }
  if (IsSparseDType(dtype)) return DecodeSparse(data, SparseCodeOf(code), out);
  if (IsBlockDType(dtype)) {
    // Decoding is the weight-1 case of accumulating, so that a decoded value
    // is bit for bit the one the coordinator adds.
    // (The base is not read without accumulating; out.data() keeps its
    // per-block offsets off a null pointer.)
    DecodeBlocksImpl<false>(data.data(), dtype, 1.0f, out.data(), out.data(),
                            out.size());
  } else if (dtype == DType::kBFloat16) {
    float* o = out.data();
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, data.data() + 2 * i, 2);
      o[i] = BFloat16ToFloat(h);
    }
  } else if (!data.empty()) {
    std::memcpy(out.data(), data.data(), data.size());
  }
  return absl::OkStatus();
}

LOCALSGD_KERNEL
absl::Status DecodeOnto(absl::string_view data, WireCode code,
                        absl::Span<const float> base, absl::Span<float> out) {
  const DType dtype = code.dtype;
  if (absl::Status s =
          CheckDecodeSizes(data.size(), code, base.size(), out.size());
      !s.ok()) {
    return s;
  }
  const float* b = base.data();
  float* o = out.data();
  const size_t n = out.size();
  const char* p = data.data();
  if (IsSparseDType(dtype)) {
    // Every element, kept or not, as base + its decoded value (an element
    // not kept adds +0.0, which turns a -0.0 base into +0.0): bit for bit
    // what the coordinator's state gets.
    thread_local std::vector<float> decoded;
    decoded.resize(n);
    if (absl::Status s =
            DecodeSparse(data, SparseCodeOf(code), absl::MakeSpan(decoded));
        !s.ok()) {
      return s;
    }
    const float* d = decoded.data();
    for (size_t i = 0; i < n; ++i) o[i] = b[i] + d[i];
  } else if (IsBlockDType(dtype)) {
    // The weight-1 accumulation: bit for bit base + DecodeValues.
    DecodeBlocksImpl<true>(p, dtype, 1.0f, b, o, n);
  } else if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      o[i] = b[i] + BFloat16ToFloat(h);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      float d;
      std::memcpy(&d, p + 4 * i, 4);
      o[i] = b[i] + d;
    }
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
  if (IsBlockDType(dtype)) {
    const size_t blocks = BlocksOfBytes(dtype, data.size());
    const int64_t bad = FirstWithExponentAllOnes<uint32_t>(
        data.substr(0, 4 * blocks), 0x7f800000u);
    return bad < 0 ? -1 : bad * static_cast<int64_t>(kQuantBlock);
  }
  // Exponent all ones means Inf or NaN: the same test for bf16 (the upper
  // half of a float32) and float32 bits.
  if (dtype == DType::kBFloat16) {
    return FirstWithExponentAllOnes<uint16_t>(data, 0x7f80u);
  }
  return FirstWithExponentAllOnes<uint32_t>(data, 0x7f800000u);
}

LOCALSGD_KERNEL
float MaxAbs(absl::string_view data, DType dtype) {
  float max = 0.0f;
  if (IsBlockDType(dtype)) {
    const size_t blocks = BlocksOfBytes(dtype, data.size());
    for (size_t b = 0; b < blocks; ++b) {
      float scale;
      std::memcpy(&scale, data.data() + 4 * b, 4);
      max = std::max(max, std::fabs(scale));
    }
    return max * static_cast<float>(CodeMax(dtype));
  }
  const char* p = data.data();
  if (dtype == DType::kBFloat16) {
    const size_t n = data.size() / 2;
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      max = std::max(max, std::fabs(BFloat16ToFloat(h)));
    }
    return max;
  }
  // Eight lanes (a max is exact in any order, so the loop vectorizes
  // without reassociating a reduction), then across them. A NaN is passed
  // over, as by std::max(max, NaN).
  constexpr size_t kLanes = 8;
  float lanes[kLanes] = {};
  const size_t n = data.size() / 4;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      float v;
      std::memcpy(&v, p + 4 * (i + k), 4);
      const float a = std::fabs(v);
      lanes[k] = a > lanes[k] ? a : lanes[k];
    }
  }
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    const float a = std::fabs(v);
    lanes[0] = a > lanes[0] ? a : lanes[0];
  }
  for (size_t k = 0; k < kLanes; ++k) max = lanes[k] > max ? lanes[k] : max;
  return max;
}

LOCALSGD_KERNEL
void AccumulateWeighted(absl::string_view data, WireCode code, float weight,
                        absl::Span<float> acc) {
  const DType dtype = code.dtype;
  float* a = acc.data();
  const size_t n = acc.size();
  if (IsSparseDType(dtype)) {
    // The kept elements only: O(kept) on the accumulator. (Sizes are the
    // caller's to check, as for every dtype.)
    (void)AccumulateSparseWeighted(data, SparseCodeOf(code), weight, acc);
    return;
  }
  if (IsBlockDType(dtype)) {
    DecodeBlocksImpl<true>(data.data(), dtype, weight, a, a, n);
    return;
  }
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

// A blockwise payload in one piece: its scales sit apart from its codes, so
// a payload that arrived in several is made contiguous (in a buffer of the
// calling thread, reused) before it is read.
absl::string_view Contiguous(absl::Span<const absl::string_view> pieces) {
  if (pieces.size() == 1) return pieces[0];
  thread_local std::string gathered;
  gathered.clear();
  for (absl::string_view piece : pieces) {
    gathered.append(piece.data(), piece.size());
  }
  return gathered;
}

}  // namespace

int64_t FirstNonFinitePieces(absl::Span<const absl::string_view> pieces,
                             WireCode code, size_t n) {
  const DType dtype = code.dtype;
  if (IsSparseDType(dtype)) {
    return SparseFirstNonFinite(Contiguous(pieces), n, SparseCodeOf(code));
  }
  if (IsBlockDType(dtype)) return FirstNonFinite(Contiguous(pieces), dtype);
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

float MaxAbsPieces(absl::Span<const absl::string_view> pieces, WireCode code,
                   size_t n) {
  const DType dtype = code.dtype;
  if (IsSparseDType(dtype)) {
    return SparseMaxAbs(Contiguous(pieces), n, SparseCodeOf(code));
  }
  if (IsBlockDType(dtype)) return MaxAbs(Contiguous(pieces), dtype);
  float max = 0.0f;
  ForEachElementRun(pieces, DTypeSize(dtype),
                    [&](absl::string_view run, size_t) {
                      max = std::max(max, MaxAbs(run, dtype));
                      return true;
                    });
  return max;
}

ChunkMagnitude MagnitudePieces(absl::Span<const absl::string_view> pieces,
                               WireCode code, size_t n, bool with_norm) {
  const DType dtype = code.dtype;
  ChunkMagnitude m;
  if (!with_norm) {
    m.max_abs = MaxAbsPieces(pieces, code, n);
    return m;
  }
  if (IsCodeDType(dtype)) {
    const absl::string_view data = Contiguous(pieces);
    m.max_abs = IsSparseDType(dtype) ? SparseMaxAbs(data, n, SparseCodeOf(code))
                                     : MaxAbs(data, dtype);
    thread_local std::vector<float> decoded;
    decoded.resize(n);
    if (!DecodeValues(data, code, absl::MakeSpan(decoded)).ok()) return m;
    const float* v = decoded.data();
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += static_cast<double>(v[i]) * v[i];
    m.sum_of_squares = sum;
    return m;
  }
  const size_t size = DTypeSize(dtype);
  float max = 0.0f;
  double sum = 0;
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t) {
    const char* p = run.data();
    const size_t count = run.size() / size;
    for (size_t i = 0; i < count; ++i) {
      float v;
      if (dtype == DType::kBFloat16) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        v = BFloat16ToFloat(h);
      } else {
        std::memcpy(&v, p + 4 * i, 4);
      }
      max = std::max(max, std::fabs(v));
      sum += static_cast<double>(v) * v;
    }
    return true;
  });
  m.max_abs = max;
  m.sum_of_squares = sum;
  return m;
}

void AccumulateWeightedPieces(absl::Span<const absl::string_view> pieces,
                              WireCode code, float weight,
                              absl::Span<float> acc) {
  const DType dtype = code.dtype;
  if (IsCodeDType(dtype)) {
    AccumulateWeighted(Contiguous(pieces), code, weight, acc);
    return;
  }
  const size_t size = DTypeSize(dtype);
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t first) {
    AccumulateWeighted(run, code, weight,
                       acc.subspan(first, run.size() / size));
    return true;
  });
}

absl::Status DecodeValuesPieces(absl::Span<const absl::string_view> pieces,
                                WireCode code, absl::Span<float> out) {
  const DType dtype = code.dtype;
  if (absl::Status s =
          CheckDecodeSizes(TotalSize(pieces), code, out.size(), out.size());
      !s.ok()) {
    return s;
  }
  if (IsCodeDType(dtype)) return DecodeValues(Contiguous(pieces), code, out);
  const size_t size = DTypeSize(dtype);
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t first) {
    // The size is right: DecodeValues cannot fail.
    (void)DecodeValues(run, code, out.subspan(first, run.size() / size));
    return true;
  });
  return absl::OkStatus();
}

absl::Status DecodeOntoPieces(absl::Span<const absl::string_view> pieces,
                              WireCode code, absl::Span<const float> base,
                              absl::Span<float> out) {
  const DType dtype = code.dtype;
  if (absl::Status s =
          CheckDecodeSizes(TotalSize(pieces), code, base.size(), out.size());
      !s.ok()) {
    return s;
  }
  if (IsCodeDType(dtype)) {
    return DecodeOnto(Contiguous(pieces), code, base, out);
  }
  const size_t size = DTypeSize(dtype);
  ForEachElementRun(pieces, size, [&](absl::string_view run, size_t first) {
    const size_t n = run.size() / size;
    // The sizes are right: DecodeOnto cannot fail.
    (void)DecodeOnto(run, code, base.subspan(first, n), out.subspan(first, n));
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
void SubtractTo(absl::Span<const float> a, absl::Span<const float> b,
                char* out) {
  const float* __restrict pa = a.data();
  const float* __restrict pb = b.data();
  char* __restrict o = out;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const float d = pa[i] - pb[i];
    std::memcpy(o + 4 * i, &d, 4);
  }
}

LOCALSGD_KERNEL
void AddInPlace(absl::Span<float> acc, absl::Span<const float> values) {
  float* __restrict a = acc.data();
  const float* __restrict v = values.data();
  const size_t n = std::min(acc.size(), values.size());
  for (size_t i = 0; i < n; ++i) a[i] += v[i];
}

LOCALSGD_KERNEL
void AddProgress(absl::Span<const float> base, absl::Span<const float> snapshot,
                 absl::Span<float> params) {
  const float* b = base.data();
  const float* s = snapshot.data();
  float* p = params.data();
  const size_t n = std::min({base.size(), snapshot.size(), params.size()});
  for (size_t i = 0; i < n; ++i) p[i] = b[i] + (p[i] - s[i]);
}

LOCALSGD_KERNEL
void RoundTripInPlace(absl::Span<float> values, DType dtype) {
  if (dtype != DType::kBFloat16) return;
  for (float& v : values) v = BFloat16ToFloat(FloatToBFloat16(v));
}

absl::Status CheckPayloadPieces(absl::Span<const absl::string_view> pieces,
                                WireCode code, size_t n) {
  const DType dtype = code.dtype;
  if (IsSparseDType(dtype)) {
    return CheckSparse(Contiguous(pieces), n, SparseCodeOf(code));
  }
  if (absl::Status s = CheckDecodeSizes(TotalSize(pieces), code, n, n);
      !s.ok()) {
    return s;
  }
  if (!IsBlockDType(dtype)) return absl::OkStatus();
  // The scales lead the payload.
  std::string scales;
  const size_t want = 4 * NumBlocks(n);
  for (absl::string_view piece : pieces) {
    if (scales.size() == want) break;
    const absl::string_view part = piece.substr(0, want - scales.size());
    scales.append(part.data(), part.size());
  }
  return CheckBlockScales(scales, dtype);
}

absl::Status CheckBlockScales(absl::string_view scales, DType dtype) {
  const size_t blocks = scales.size() / 4;
  for (size_t b = 0; b < blocks; ++b) {
    const float scale = ScaleAt(scales.data(), b);
    // NaN and +inf pass: FirstNonFinite reports them (non-finite values).
    if (scale <= 0 || (scale > kMaxBlockScale &&
                       scale != std::numeric_limits<float>::infinity())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", b, " (elements from ", b * kQuantBlock, ") of the ",
          DTypeName(dtype), " payload has scale ", scale,
          "; scales must be positive (a block of zeros takes any positive "
          "scale and zero codes) and at most float32 max / 128 (about 2^121)"));
    }
  }
  return absl::OkStatus();
}

namespace {

LOCALSGD_KERNEL
void EncodeBlocksWithFeedbackPortable(const float* v, float* r, DType dtype,
                                      char* out, float* d, size_t n) {
  const size_t blocks = NumBlocks(n);
  char* codes_out = out + 4 * blocks;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t len = std::min(kQuantBlock, n - b * kQuantBlock);
    EncodeBlockWithFeedback(v, r, dtype, out, codes_out, d, b, len);
  }
}

void EncodeBlocksWithFeedback(const float* v, float* r, DType dtype, char* out,
                              float* d, size_t n) {
#if LOCALSGD_AVX2_KERNELS
  if (UseAvx2()) {
    EncodeBlocksAvx2<Source::kFeedback>(v, nullptr, r, dtype, out, d, n);
    return;
  }
#endif
  EncodeBlocksWithFeedbackPortable(v, r, dtype, out, d, n);
}

}  // namespace

void EncodeWithFeedback(absl::Span<const float> values,
                        absl::Span<float> residual, WireCode code, char* out,
                        absl::Span<float> decoded) {
  const DType dtype = code.dtype;
  const size_t n = values.size();
  if (IsSparseDType(dtype)) {
    EncodeSparseWithFeedback(values, residual, SparseCodeOf(code), out,
                             decoded);
    return;
  }
  if (residual.empty()) {
    EncodeValuesTo(values, code, out);
    (void)DecodeValues(absl::string_view(out, WireBytes(code, n)), code,
                       decoded);
    return;
  }
  if (IsBlockDType(dtype)) {
    EncodeBlocksWithFeedback(values.data(), residual.data(), dtype, out,
                             decoded.data(), n);
    return;
  }
  // bfloat16, piece by piece (so that `decoded` may be `values`): e =
  // values + residual, encoded; residual = e - decode(e's encoding).
  constexpr size_t kStep = 16 * kQuantBlock;  // whole pairs
  float e[kStep];
  // Raw pointers: a Span's hardened operator[] keeps a loop scalar.
  const float* v = values.data();
  float* r = residual.data();
  const float* d = decoded.data();
  for (size_t first = 0; first < n; first += kStep) {
    const size_t len = std::min(kStep, n - first);
    for (size_t i = 0; i < len; ++i) e[i] = v[first + i] + r[first + i];
    const size_t offset = WireBytes(code, first);  // first: whole pairs
    const size_t bytes = WireBytes(code, len);
    char* piece = out + offset;
    EncodeValuesTo(absl::MakeConstSpan(e, len), code, piece);
    (void)DecodeValues(absl::string_view(piece, bytes), code,
                       decoded.subspan(first, len));
    for (size_t i = 0; i < len; ++i) {
      r[first + i] = e[i] - d[first + i];
    }
  }
}

namespace {

LOCALSGD_KERNEL
void EncodeBlocksDeltaPortable(const float* p, const float* a, float* r,
                               DType dtype, char* out, size_t n) {
  const size_t blocks = NumBlocks(n);
  char* codes_out = out + 4 * blocks;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t len = std::min(kQuantBlock, n - b * kQuantBlock);
    EncodeBlockWithFeedback(p, r, dtype, out, codes_out, nullptr, b, len, a);
  }
}

}  // namespace

void EncodeDeltaWithFeedback(absl::Span<const float> params,
                             absl::Span<const float> anchor,
                             absl::Span<float> residual, WireCode code,
                             char* out) {
  const DType dtype = code.dtype;
  const size_t n = params.size();
  if (IsSparseDType(dtype)) {
    EncodeSparseDeltaWithFeedback(params, anchor, residual, SparseCodeOf(code),
                                  out);
    return;
  }
#if LOCALSGD_AVX2_KERNELS
  if (UseAvx2()) {
    EncodeBlocksAvx2<Source::kDelta>(params.data(), anchor.data(),
                                     residual.data(), dtype, out, nullptr, n);
    return;
  }
#endif
  EncodeBlocksDeltaPortable(params.data(), anchor.data(), residual.data(),
                            dtype, out, n);
}

CodecKernels ActiveCodecKernels() {
  return UseAvx2() ? CodecKernels::kAvx2 : CodecKernels::kPortable;
}

void ForcePortableCodecKernels(bool portable) {
  force_portable_kernels.store(portable, std::memory_order_relaxed);
}

}  // namespace localsgd
