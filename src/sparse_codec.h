// Sparse codes: per block of a chunk, the values of largest magnitude, each
// as a position (Elias-Fano coded) and a 2- or 4-bit code, with error
// feedback carrying the rest (top-k sparsification with quantized values,
// as SparseLoCo sends pseudo-gradients). Pure math over spans, like
// src/codec.h: no locks, no I/O, no protobuf; thread-compatible.
//
// Payload of n values in the code {keep, bits}:
//
//   B = ceil(n / kSparseBlock) blocks; block b holds the n_b elements
//   [b * kSparseBlock, min(n, (b + 1) * kSparseBlock)) and keeps
//   k_b = ceil(keep * n_b / kSparseBlock) of them (keep in [1,
//   kSparseBlock], so 1 <= k_b <= n_b: a partial last block keeps its share).
//   K = the sum of the k_b.
//
//   1. B pairs of float32, little-endian: (lo_b, hi_b), the smallest and
//      the largest magnitude among block b's kept values;
//   2. the kept values' positions in their block, a bit stream (bit t of
//      it is bit t mod 8 of byte t / 8), block after block, each block's
//      k_b positions Elias-Fano coded in a number of bits that follows
//      from n_b and k_b alone: with l_b the largest l with k_b x 2^l <=
//      n_b, first the low l_b bits of each entry's position (entry t at
//      bits [t l_b, t l_b + l_b) of the block's part, least significant
//      first), then H_b = ((n_b - 1) >> l_b) + k_b bits in which entry t's
//      high part h (its position >> l_b) sets bit h + t, and no other bit
//      is set. Ascending within a block, where an entry whose position
//      equals the one before is padding (code 0, decodes to nothing; only
//      padding may follow it in the block: a block keeps fewer than k_b
//      values when fewer lie above bin 0); ceil(P / 8) bytes, P the sum of
//      the blocks' k_b l_b + H_b bits, the bits past the last block's zero;
//   3. their codes, `bits` each, in the same order (kept value j of the
//      payload, block after block, at bits [bits j, bits j + bits); ceil(bits
//      K / 8) bytes, the bits past the last code zero): the top bit the sign
//      (1: negative), the others a level c in [0, L), L = 2^(bits - 1).
//
//   A kept value decodes to +-(lo + w_c x (hi - lo)), w_c = (2c + 1) / 2L
//   (the middle of the c-th of L equal steps from lo to hi), computed in
//   float32 in that order (d = hi - lo; m = lo + w_c * d); every other
//   element decodes to 0. Valid scales: 0 <= lo <= hi <= the largest
//   float32, or both NaN, which says the block held a non-finite value (the
//   blockwise codes' policy: such a payload is the non-finite policy's to
//   judge; its kept values decode to NaN).
//
// Bytes of a payload of one block of 4096 values and 2 bits (blocks of a
// longer payload share bytes: 511 bits of positions each): keep = 64
// (1.56%) 88 (positions 64: 8 bits each; 0.021 bytes per value, 186x fewer
// than float32), keep = 256 264 (positions 192: 6 bits each). Positions as
// 12-bit indices would take 96 and 384 bytes; a bitmap 512; varint-coded
// gaps ~8 bits each at 1.5% but a size that depends on the values. The
// Elias-Fano code is within 2 bits per entry of log2(C(n_b, k_b)) / k_b,
// the fewest a fixed size can take, and keeps every chunk's length
// checkable from the layout alone, as for every other dtype.
#ifndef LOCALSGD_SRC_SPARSE_CODEC_H_
#define LOCALSGD_SRC_SPARSE_CODEC_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace localsgd {

inline constexpr size_t kSparseBlock = 4096;

// A sparse code: the values kept per full block and the bits of each
// value's code.
struct SparseCode {
  uint32_t keep = 64;  // [1, kSparseBlock]
  uint32_t bits = 2;   // 2 or 4
};

// INVALID_ARGUMENT unless keep is in [1, kSparseBlock] and bits is 2 or 4.
absl::Status ValidateSparseCode(SparseCode code);

// The values a payload of n values keeps (K above).
size_t SparseKept(size_t n, SparseCode code);
// The bytes of a payload of n values (a valid code).
size_t SparseWireBytes(size_t n, SparseCode code);

// Encodes values + residual (error feedback) into `out` (SparseWireBytes(n)
// bytes; `code` valid: ValidateSparseCode, which the caller checks once per
// job), and leaves in `residual` what the encoding lost: (values +
// residual) - decoded, exactly the elements not kept, and for the kept ones
// their value minus what it decodes to. An empty `residual` means none (and
// none is kept). `decoded`, if not empty, receives what `out` decodes to
// (n values; may be `values`). Which values a block keeps: those in the
// highest magnitude bins, a bin being bits 20-30 of |x|'s float32 (the
// exponent and three mantissa bits: a bin spans 6.7-12.5% of its lower
// magnitude), and from the lowest bin reached the first ones in index order; a
// histogram pass finds that bin (no sort). A block with a non-finite value
// keeps its first k_b elements with NaN scales and codes 0.
void EncodeSparseWithFeedback(absl::Span<const float> values,
                              absl::Span<float> residual, SparseCode code,
                              char* out, absl::Span<float> decoded = {});

// The same for the delta params - anchor (SubtractTo's float32 difference),
// in one pass without the delta in memory: a member's upload (an empty
// `residual`: none).
void EncodeSparseDeltaWithFeedback(absl::Span<const float> params,
                                   absl::Span<const float> anchor,
                                   absl::Span<float> residual, SparseCode code,
                                   char* out);

// INVALID_ARGUMENT, naming the first offence (the block and what), unless
// `data` is a well-formed payload of n values: its size SparseWireBytes(n),
// valid scales, k_b entries in each block's high parts, positions within
// their block and ascending (a repeat being padding, code 0, nothing but
// padding after it), zero padding bits.
absl::Status CheckSparse(absl::string_view data, size_t n, SparseCode code);

// out[i] = the value of element i, n = out.size(). INVALID_ARGUMENT,
// changing nothing, for an invalid code or a payload that is not
// SparseWireBytes(n) bytes; a position past its block is skipped (memory
// safe on any input: CheckSparse is what judges a payload).
absl::Status DecodeSparse(absl::string_view data, SparseCode code,
                          absl::Span<float> out);
// acc[i] += weight * value(i), for the kept elements only (the others add
// 0): O(K) work on the accumulator, no dense copy. Errors as DecodeSparse.
absl::Status AccumulateSparseWeighted(absl::string_view data, SparseCode code,
                                      float weight, absl::Span<float> acc);

// For the coordinator's guards, on a payload CheckSparse accepted: the
// first element of the first block flagged non-finite (NaN scales), or -1;
// and a bound on the magnitudes values decode to: the largest block's top
// level (0 for none; blocks flagged non-finite are not counted).
int64_t SparseFirstNonFinite(absl::string_view data, size_t n, SparseCode code);
float SparseMaxAbs(absl::string_view data, size_t n, SparseCode code);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_SPARSE_CODEC_H_
