#include "src/sparse_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// The encoder's first pass is also built for AVX2 and picked at load time
// where the CPU has it (GCC; not under the sanitizers, as src/codec.cc).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define LOCALSGD_SPARSE_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define LOCALSGD_SPARSE_KERNEL
#endif

namespace localsgd {
namespace {

// A magnitude's bin: bits 20-30 of |x|'s float32 (the exponent and the top
// three mantissa bits), 2048 bins in magnitude order; Inf and NaN fall in
// the bins from kNonFiniteBin up.
constexpr uint32_t kBinShift = 20;
constexpr uint32_t kBins = 1u << (31 - kBinShift);
constexpr uint32_t kNonFiniteBin = 0x7f800000u >> kBinShift;
// A position in a block: at most 12 bits (the most low bits a block's
// positions have).
constexpr unsigned kPositionBits = 12;
static_assert(kSparseBlock == size_t{1} << kPositionBits,
              "a position is at most 12 bits");
constexpr unsigned kMaxLevels = 8;  // 4-bit codes: 8 levels and a sign

size_t NumBlocks(size_t n) { return (n + kSparseBlock - 1) / kSparseBlock; }
size_t BlockLength(size_t n, size_t b) {
  return std::min(kSparseBlock, n - b * kSparseBlock);
}
size_t KeptInBlock(size_t nb, SparseCode code) {
  return (code.keep * nb + kSparseBlock - 1) / kSparseBlock;
}

// A block's positions, Elias-Fano coded: the low `low` bits of each entry's
// position (low = the largest l with kb x 2^l <= nb), kb x low bits, then
// the high parts (position >> low) in unary: entry t's high part h sets bit
// h + t of the next high_bits = ((nb - 1) >> low) + kb bits.
struct PositionLayout {
  unsigned low = 0;
  size_t high_bits = 0;
  size_t bits() const { return high_bits + kb * low; }
  size_t kb = 0;
};
PositionLayout PositionsOf(size_t nb, size_t kb) {
  PositionLayout p;
  p.kb = kb;
  while (p.low < kPositionBits && kb << (p.low + 1) <= nb) ++p.low;
  p.high_bits = ((nb - 1) >> p.low) + kb;
  return p;
}
// The bits of every block's positions, back to back.
size_t PositionBits(size_t n, SparseCode code) {
  const size_t full = n / kSparseBlock;
  const size_t tail = n % kSparseBlock;
  size_t bits =
      full * PositionsOf(kSparseBlock, KeptInBlock(kSparseBlock, code)).bits();
  if (tail != 0) bits += PositionsOf(tail, KeptInBlock(tail, code)).bits();
  return bits;
}
size_t PositionBytes(size_t n, SparseCode code) {
  return (PositionBits(n, code) + 7) / 8;
}
size_t CodeBytes(size_t kept, uint32_t bits) { return (bits * kept + 7) / 8; }

float FloatAt(const char* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// The bit streams, least significant bit first (bit t of a stream is bit
// t mod 8 of byte t / 8). The writers OR into a zeroed stream and touch no
// byte past the last one they set a bit of.
inline void PutBits(uint8_t* p, size_t bit, uint32_t v, unsigned width) {
  if (width == 0) return;
  uint8_t* q = p + bit / 8;
  uint32_t x = v << (bit % 8);
  const unsigned bytes = (bit % 8 + width + 7) / 8;  // at most 3
  for (unsigned i = 0; i < bytes; ++i, x >>= 8) q[i] |= static_cast<uint8_t>(x);
}
inline uint32_t GetBits(const uint8_t* p, size_t bit, unsigned width) {
  if (width == 0) return 0;
  const uint8_t* q = p + bit / 8;
  const unsigned bytes = (bit % 8 + width + 7) / 8;
  uint32_t x = 0;
  for (unsigned i = 0; i < bytes; ++i) x |= uint32_t{q[i]} << (8 * i);
  return (x >> (bit % 8)) & ((1u << width) - 1);
}

// Writes a block's kb ascending positions at bit `at` of the positions'
// stream.
void PutPositions(uint8_t* stream, size_t at, const PositionLayout& layout,
                  const uint16_t* pos) {
  const size_t high = at + layout.kb * layout.low;
  for (size_t t = 0; t < layout.kb; ++t) {
    PutBits(stream, at + t * layout.low, pos[t] & ((1u << layout.low) - 1),
            layout.low);
    const size_t one = high + (pos[t] >> layout.low) + t;
    stream[one / 8] |= static_cast<uint8_t>(1u << (one % 8));
  }
}

// Calls fn(t, position) for the entries of a block's positions at bit `at`
// of the stream, in order, up to layout.kb of them; returns how many the
// high parts hold (more than kb: the rest not visited).
template <typename Fn>
size_t ForEachPosition(const uint8_t* stream, size_t at,
                       const PositionLayout& layout, Fn fn) {
  const size_t high = at + layout.kb * layout.low;
  const size_t end = high + layout.high_bits;
  size_t t = 0;
  size_t ones = 0;
  for (size_t bit = high; bit < end;) {
    // The rest of this byte, or of the high parts.
    const size_t stop = std::min(end, (bit / 8 + 1) * 8);
    uint32_t byte = stream[bit / 8] >> (bit % 8);
    if (stop % 8 != 0 || stop == end) byte &= (1u << (stop - bit)) - 1;
    while (byte != 0) {
      const size_t one = bit + static_cast<size_t>(__builtin_ctz(byte));
      byte &= byte - 1;
      if (t < layout.kb) {
        const uint32_t h = static_cast<uint32_t>(one - high - t);
        fn(t, (h << layout.low) |
                  GetBits(stream, at + t * layout.low, layout.low));
        ++t;
      }
      ++ones;
    }
    bit = stop;
  }
  return ones;
}

inline void PutCode(uint8_t* p, size_t j, uint32_t bits, uint32_t c) {
  const size_t bit = bits * j;
  p[bit / 8] |= static_cast<uint8_t>(c << (bit % 8));
}
inline uint32_t GetCode(const uint8_t* p, size_t j, uint32_t bits) {
  const size_t bit = bits * j;
  return (uint32_t{p[bit / 8]} >> (bit % 8)) & ((1u << bits) - 1);
}

// The magnitudes the L = 2^(bits - 1) levels of a block decode to.
inline void Levels(float lo, float hi, uint32_t bits, float* mag) {
  const unsigned levels = 1u << (bits - 1);
  const float d = hi - lo;
  for (unsigned c = 0; c < levels; ++c) {
    // (2c + 1) / 2L: exact in float32.
    const float w =
        static_cast<float>(2 * c + 1) / static_cast<float>(2 * levels);
    mag[c] = lo + w * d;
  }
}

// e = (v - a) + r (without a: v + r; without r: no + r), the bins of e, and
// the largest bin: the encoder's first pass, built for AVX2 too where the
// compiler can pick at load time (as src/codec.cc's kernels). `e` may be
// `r`.
LOCALSGD_SPARSE_KERNEL
uint32_t ValuesAndBins(const float* v, const float* a, const float* r, float* e,
                       uint16_t* bin, size_t nb) {
  uint32_t top = 0;
  // One loop per case, no test inside: each vectorizes.
  auto bins = [&](size_t i, float x) {
    e[i] = x;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t b = (bits & 0x7fffffffu) >> kBinShift;
    bin[i] = static_cast<uint16_t>(b);
    top = b > top ? b : top;
  };
  if (a != nullptr && r != nullptr) {
    for (size_t i = 0; i < nb; ++i) bins(i, (v[i] - a[i]) + r[i]);
  } else if (a != nullptr) {
    for (size_t i = 0; i < nb; ++i) bins(i, v[i] - a[i]);
  } else if (r != nullptr) {
    for (size_t i = 0; i < nb; ++i) bins(i, v[i] + r[i]);
  } else {
    for (size_t i = 0; i < nb; ++i) bins(i, v[i]);
  }
  return top;
}

// Per-block work space of the encoder (64 KiB: on the heap, uninitialized).
struct BlockScratch {
  float e[kSparseBlock];  // e, where there is no residual to hold it
  float kept_value[kSparseBlock];
  uint16_t bin[kSparseBlock];
  uint16_t pos[kSparseBlock];
  uint16_t hist[4][kBins];  // four, so that equal bins in a row do not chain
};

// Encodes one block of nb values (e = v + r, or (v - a) + r with kDelta)
// whose kept values are j0, j0 + 1, ... of the payload. Passes: e and the
// bins (a loop GCC vectorizes; e goes straight into the residual, where the
// kept ones are then corrected), the histogram, the selection (sixteen bins
// at a time with SSE2; elsewhere, and for a block's last few, one at a
// time: the same rule, the same result), then the kept values alone.
template <bool kDelta>
void EncodeBlock(const float* v, const float* a, float* r, size_t nb, size_t kb,
                 SparseCode code, char* scales, uint8_t* positions,
                 size_t pos_bit, uint8_t* codes, size_t j0, float* decoded,
                 BlockScratch& s) {
  float* e = r != nullptr ? r : s.e;
  uint16_t* bin = s.bin;
  const uint32_t top = ValuesAndBins(v, kDelta ? a : nullptr, r, e, bin, nb);
  const bool finite = top < kNonFiniteBin;
  size_t kv = kb;  // the entries that are kept values; the rest pad
  float lo = std::numeric_limits<float>::quiet_NaN();
  float hi = lo;
  if (finite) {
    for (auto& h : s.hist) std::memset(h, 0, (top + 1) * sizeof(h[0]));
    size_t i = 0;
    for (; i + 4 <= nb; i += 4) {
      ++s.hist[0][bin[i]];
      ++s.hist[1][bin[i + 1]];
      ++s.hist[2][bin[i + 2]];
      ++s.hist[3][bin[i + 3]];
    }
    for (; i < nb; ++i) ++s.hist[0][bin[i]];
    // The lowest bin reached: the highest `star` with at least kb values in
    // bins >= star; `ties` of its values are kept, the first in index order.
    // Bin 0 (zeros, and magnitudes below 2^-129) is never kept: a block
    // with fewer than kb values above it keeps those (kv < kb) and pads.
    size_t above = 0;
    uint32_t star = top;
    if (top == 0) {
      kv = 0;
    } else {
      for (;; --star) {
        const size_t in = size_t{s.hist[0][star]} + s.hist[1][star] +
                          s.hist[2][star] + s.hist[3][star];
        if (above + in >= kb) break;
        if (star == 1) {
          kv = above + in;
          break;
        }
        above += in;
      }
    }
    size_t ties = kv - above;
    size_t count = 0;
    auto consider = [&](size_t at) {
      const uint32_t b = bin[at];
      if (b > star || (b == star && ties > 0)) {
        ties -= b == star;
        s.pos[count++] = static_cast<uint16_t>(at);
      }
    };
    i = 0;
#if defined(__SSE2__)
    // Sixteen bins at a time (SSE2, every x86-64): a mask of those >= star
    // (two bits each), and only those are looked at one by one.
    // Once the boundary bin's share is taken, only bins above it are
    // looked at (in the feedback's steady state many values wait in it).
    __m128i below = _mm_set1_epi16(static_cast<int16_t>(star) - 1);
    bool ties_taken = false;  // ties >= 1 here
    for (; i + 16 <= nb; i += 16) {
      if (!ties_taken && ties == 0) {
        ties_taken = true;
        below = _mm_set1_epi16(static_cast<int16_t>(star));
      }
      const __m128i a0 =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(bin + i));
      const __m128i a1 =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(bin + i + 8));
      uint32_t m =
          static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpgt_epi16(a0, below))) |
          static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpgt_epi16(a1, below)))
              << 16;
      for (; m != 0; m &= m - 1, m &= m - 1) {
        consider(i + static_cast<size_t>(__builtin_ctz(m)) / 2);
      }
    }
#endif
    for (; i < nb; ++i) consider(i);
    lo = std::numeric_limits<float>::max();
    hi = 0;
    for (size_t j = 0; j < kv; ++j) {
      const float m = std::fabs(e[s.pos[j]]);
      lo = m < lo ? m : lo;
      hi = m > hi ? m : hi;
    }
    if (kv == 0 && kb > 0) {
      // Nothing to keep: one entry at position 0 that decodes to 0 (lo =
      // hi = 0), then padding. (kb >= 1 for a valid code; the guard keeps
      // an invalid one from writing past its payload.)
      lo = 0;
      s.pos[0] = 0;
      kv = 1;
    }
  } else {
    for (size_t j = 0; j < kb; ++j) s.pos[j] = static_cast<uint16_t>(j);
  }
  std::memcpy(scales, &lo, 4);
  std::memcpy(scales + 4, &hi, 4);
  float mag[kMaxLevels];
  Levels(lo, hi, code.bits, mag);
  const unsigned levels = 1u << (code.bits - 1);
  const double d = static_cast<double>(hi) - static_cast<double>(lo);
  const double per = d > 0 ? levels / d : 0;  // NaN scales: d > 0 is false
  for (size_t j = 0; j < kv; ++j) {
    const float x = e[s.pos[j]];
    unsigned c = 0;
    if (per > 0) {
      const double t = (std::fabs(static_cast<double>(x)) - lo) * per;
      c = t >= levels - 1 ? levels - 1 : static_cast<unsigned>(t);
    }
    const bool negative = finite && std::signbit(x);
    s.kept_value[j] = negative ? -mag[c] : mag[c];
    PutCode(codes, j0 + j, code.bits,
            (negative ? levels : 0u) | c);  // the sign is the top bit
  }
  // Padding: the last kept position again, code 0.
  for (size_t j = kv; j < kb; ++j) s.pos[j] = s.pos[kv - 1];
  PutPositions(positions, pos_bit, PositionsOf(nb, kb), s.pos);
  if (r != nullptr) {
    // r holds e: the kept ones lose what they decode to.
    for (size_t j = 0; j < kv; ++j) r[s.pos[j]] = r[s.pos[j]] - s.kept_value[j];
  }
  if (decoded != nullptr) {
    std::memset(decoded, 0, nb * sizeof(float));
    for (size_t j = 0; j < kv; ++j) decoded[s.pos[j]] = s.kept_value[j];
  }
}

template <bool kDelta>
void Encode(const float* v, const float* a, float* r, size_t n, SparseCode code,
            char* out, float* decoded) {
  if (n == 0) return;
  const size_t blocks = NumBlocks(n);
  const size_t kept = SparseKept(n, code);
  uint8_t* positions = reinterpret_cast<uint8_t*>(out) + 8 * blocks;
  uint8_t* codes = positions + PositionBytes(n, code);
  std::memset(positions, 0,
              PositionBytes(n, code) + CodeBytes(kept, code.bits));
  std::unique_ptr<BlockScratch> scratch(new BlockScratch);
  size_t j0 = 0;
  size_t pos_bit = 0;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t first = b * kSparseBlock;
    const size_t nb = BlockLength(n, b);
    const size_t kb = KeptInBlock(nb, code);
    EncodeBlock<kDelta>(v + first, kDelta ? a + first : nullptr,
                        r != nullptr ? r + first : nullptr, nb, kb, code,
                        out + 8 * b, positions, pos_bit, codes, j0,
                        decoded != nullptr ? decoded + first : nullptr,
                        *scratch);
    j0 += kb;
    pos_bit += PositionsOf(nb, kb).bits();
  }
}

// Calls fn(element, value) for every kept element of a payload of the
// right size (memory safe on any such payload; CheckSparse judges it).
template <typename Fn>
void ForEachKept(absl::string_view data, size_t n, SparseCode code, Fn fn) {
  const size_t blocks = NumBlocks(n);
  const uint8_t* positions =
      reinterpret_cast<const uint8_t*>(data.data()) + 8 * blocks;
  const uint8_t* codes = positions + PositionBytes(n, code);
  const unsigned levels = 1u << (code.bits - 1);
  size_t j0 = 0;
  size_t pos_bit = 0;
  for (size_t b = 0; b < blocks; ++b) {
    float mag[kMaxLevels];
    Levels(FloatAt(data.data() + 8 * b), FloatAt(data.data() + 8 * b + 4),
           code.bits, mag);
    const size_t first = b * kSparseBlock;
    const size_t nb = BlockLength(n, b);
    const size_t kb = KeptInBlock(nb, code);
    const PositionLayout layout = PositionsOf(nb, kb);
    int64_t previous = -1;
    ForEachPosition(positions, pos_bit, layout, [&](size_t t, uint32_t pos) {
      const uint32_t c = GetCode(codes, j0 + t, code.bits);
      const float m = mag[c & (levels - 1)];
      // A position not after the one before is padding.
      if (pos<nb&& static_cast<int64_t>(pos)> previous) {
        fn(first + pos, (c & levels) != 0 ? -m : m);
      }
      previous = std::max<int64_t>(previous, pos);
    });
    j0 += kb;
    pos_bit += layout.bits();
  }
}

// Whether the bits of a stream of `used` bits in `bytes` bytes past the
// used ones are zero.
bool PaddingIsZero(const uint8_t* p, size_t used, size_t bytes) {
  if (used % 8 == 0) return true;
  return (p[bytes - 1] >> (used % 8)) == 0;
}

}  // namespace

absl::Status ValidateSparseCode(SparseCode code) {
  if (code.keep < 1 || code.keep > kSparseBlock) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse code keeps ", code.keep, " values per block of ",
                     kSparseBlock, ": must be in [1, ", kSparseBlock, "]"));
  }
  if (code.bits != 2 && code.bits != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse code of ", code.bits, " bits per value: must be 2 or 4"));
  }
  return absl::OkStatus();
}

size_t SparseKept(size_t n, SparseCode code) {
  const size_t full = n / kSparseBlock;
  const size_t tail = n % kSparseBlock;
  return full * code.keep + (tail != 0 ? KeptInBlock(tail, code) : 0);
}

size_t SparseWireBytes(size_t n, SparseCode code) {
  const size_t kept = SparseKept(n, code);
  return 8 * NumBlocks(n) + PositionBytes(n, code) + CodeBytes(kept, code.bits);
}

void EncodeSparseWithFeedback(absl::Span<const float> values,
                              absl::Span<float> residual, SparseCode code,
                              char* out, absl::Span<float> decoded) {
  Encode<false>(values.data(), nullptr,
                residual.empty() ? nullptr : residual.data(), values.size(),
                code, out, decoded.empty() ? nullptr : decoded.data());
}

void EncodeSparseDeltaWithFeedback(absl::Span<const float> params,
                                   absl::Span<const float> anchor,
                                   absl::Span<float> residual, SparseCode code,
                                   char* out) {
  Encode<true>(params.data(), anchor.data(), residual.data(), params.size(),
               code, out, nullptr);
}

namespace {

// A valid code, and `data` the size it takes for n values: what every
// reader of a payload checks first.
absl::Status CheckDecodeSize(absl::string_view data, size_t n,
                             SparseCode code) {
  if (absl::Status s = ValidateSparseCode(code); !s.ok()) return s;
  const size_t expected = SparseWireBytes(n, code);
  if (data.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse payload of ", data.size(), " bytes for ", n,
                     " values: the code (", code.keep, " kept per ",
                     kSparseBlock, ", ", code.bits, " bits) takes ", expected));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSparse(absl::string_view data, size_t n, SparseCode code) {
  if (absl::Status s = CheckDecodeSize(data, n, code); !s.ok()) return s;
  const size_t blocks = NumBlocks(n);
  const size_t kept = SparseKept(n, code);
  const uint8_t* positions =
      reinterpret_cast<const uint8_t*>(data.data()) + 8 * blocks;
  const uint8_t* codes = positions + PositionBytes(n, code);
  size_t j0 = 0;
  size_t pos_bit = 0;
  for (size_t b = 0; b < blocks; ++b) {
    const float lo = FloatAt(data.data() + 8 * b);
    const float hi = FloatAt(data.data() + 8 * b + 4);
    const bool flagged = std::isnan(lo) && std::isnan(hi);
    if (!flagged &&
        !(lo >= 0 && lo <= hi && hi <= std::numeric_limits<float>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sparse block ", b, " has scales (", lo, ", ", hi,
          "): they must be 0 <= lo <= hi <= the largest float32, or both "
          "NaN (a non-finite value)"));
    }
    const size_t nb = BlockLength(n, b);
    const size_t kb = KeptInBlock(nb, code);
    const PositionLayout layout = PositionsOf(nb, kb);
    int64_t previous = -1;
    bool padding = false;
    absl::Status status;
    const size_t entries = ForEachPosition(
        positions, pos_bit, layout, [&](size_t t, uint32_t pos) {
          if (!status.ok()) return;
          // Formatted on an error only: this runs for every entry of every
          // upload.
          auto where = [&] {
            return absl::StrCat("sparse block ", b, " (", nb,
                                " values): entry ", t, " is at position ", pos);
          };
          if (pos >= nb) {
            status = absl::InvalidArgumentError(
                absl::StrCat(where(), ", past the block's end"));
          } else if (static_cast<int64_t>(pos) < previous) {
            status = absl::InvalidArgumentError(
                absl::StrCat(where(), ", before the one before (", previous,
                             "); positions must ascend"));
          } else if (static_cast<int64_t>(pos) == previous) {
            // Padding: the block keeps fewer values than it has entries.
            if (const uint32_t c = GetCode(codes, j0 + t, code.bits); c != 0) {
              status = absl::InvalidArgumentError(
                  absl::StrCat(where(), " again with code ", c,
                               "; a repeated position is padding, its code 0"));
            }
            padding = true;
          } else if (padding) {
            status = absl::InvalidArgumentError(
                absl::StrCat(where(), " after padding; padding ends a block"));
          }
          previous = pos;
        });
    // The count first: a one too many or too few shifts every entry after
    // it, whose positions then say little.
    if (entries != kb) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse block ", b, " (", nb,
                       " values): its positions' high parts "
                       "hold ",
                       entries, " entries; the block has ", kb));
    }
    if (!status.ok()) return status;
    j0 += kb;
    pos_bit += layout.bits();
  }
  if (!PaddingIsZero(positions, PositionBits(n, code),
                     PositionBytes(n, code)) ||
      !PaddingIsZero(codes, code.bits * kept, CodeBytes(kept, code.bits))) {
    return absl::InvalidArgumentError(
        "sparse payload: the padding bits after the last position or code "
        "are not zero");
  }
  return absl::OkStatus();
}

absl::Status DecodeSparse(absl::string_view data, SparseCode code,
                          absl::Span<float> out) {
  if (absl::Status s = CheckDecodeSize(data, out.size(), code); !s.ok()) {
    return s;
  }
  float* o = out.data();
  std::fill(o, o + out.size(), 0.0f);
  ForEachKept(data, out.size(), code,
              [o](size_t i, float value) { o[i] = value; });
  return absl::OkStatus();
}

absl::Status AccumulateSparseWeighted(absl::string_view data, SparseCode code,
                                      float weight, absl::Span<float> acc) {
  if (absl::Status s = CheckDecodeSize(data, acc.size(), code); !s.ok()) {
    return s;
  }
  float* o = acc.data();
  ForEachKept(data, acc.size(), code,
              [o, weight](size_t i, float value) { o[i] += weight * value; });
  return absl::OkStatus();
}

int64_t SparseFirstNonFinite(absl::string_view data, size_t n,
                             SparseCode code) {
  for (size_t b = 0; b < NumBlocks(n); ++b) {
    if (std::isnan(FloatAt(data.data() + 8 * b))) {
      return static_cast<int64_t>(b * kSparseBlock);
    }
  }
  return -1;
}

float SparseMaxAbs(absl::string_view data, size_t n, SparseCode code) {
  float most = 0;
  for (size_t b = 0; b < NumBlocks(n); ++b) {
    float mag[kMaxLevels];
    Levels(FloatAt(data.data() + 8 * b), FloatAt(data.data() + 8 * b + 4),
           code.bits, mag);
    const float top = mag[(1u << (code.bits - 1)) - 1];
    most = top > most ? top : most;  // a NaN (flagged) block: not counted
  }
  return most;
}

}  // namespace localsgd
