// Pure math over spans: wire encoding of fp32 values and the reduction kernels.
// No locks, no I/O, no protobuf. All functions are thread-compatible.
#ifndef LOCALSGD_SRC_CODEC_H_
#define LOCALSGD_SRC_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/sparse_codec.h"
#include "src/types.h"

namespace localsgd {

// bfloat16 <-> float32. FloatToBFloat16 rounds to nearest even and keeps NaN a
// NaN; BFloat16ToFloat is exact.
// Written as a select rather than a branch so that loops over it vectorize.
inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  const uint32_t rounded = (bits + rounding_bias) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // keep NaN a NaN
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan
                                                                  : rounded);
}
inline float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Blockwise codes (DType::kInt8Block, kInt4Block). A payload of n values
// holds B = ceil(n / kQuantBlock) blocks: first the B scales (float32,
// little-endian; block b covers elements [b * kQuantBlock, (b + 1) *
// kQuantBlock)), then the n codes: int8, one byte each; int4, two per byte
// (element 2k in the low nibble of byte k, 2k+1 in the high one), two's
// complement. Element i of block b decodes to scale_b * max(code_i, -M), M =
// 127 (int8) or 7 (int4): a code of -128 / -8 reads as -M. Scales must be
// in (0, kMaxBlockScale] (a block of zeros has any and zero codes); a
// non-finite scale means a non-finite value (what an encoder writes for a
// block that holds one). The block size was chosen for int4 by measurement
// (bench/README.md "The block size and the value code"); int8 shares it.
inline constexpr size_t kQuantBlock = 64;
// The largest scale (float32 max / 128): every code times it stays finite.
inline constexpr float kMaxBlockScale = 3.40282347e38f / 128;
inline size_t NumBlocks(size_t n) {
  return (n + kQuantBlock - 1) / kQuantBlock;
}

// A sparse wire code's SparseCode (src/sparse_codec.h).
inline SparseCode SparseCodeOf(WireCode code) {
  return SparseCode{code.sparse_keep, code.dtype == DType::kSparse2 ? 2u : 4u};
}

// Bytes that `n` values take in wire code `code`.
inline size_t WireBytes(WireCode code, size_t n) {
  const DType dtype = code.dtype;
  switch (dtype) {
    case DType::kSparse2:
    case DType::kSparse4:
      return SparseWireBytes(n, SparseCodeOf(code));
    case DType::kInt8Block:
      return 4 * NumBlocks(n) + n;
    case DType::kInt4Block:
      return 4 * NumBlocks(n) + (n + 1) / 2;
    default:
      return n * static_cast<size_t>(DTypeSize(dtype));
  }
}

// Encodes `values` in `dtype` into `out` (resized to WireBytes). Blockwise
// codes: absmax scaling, round to nearest; a block with a non-finite value
// gets a NaN scale.
void EncodeValues(absl::Span<const float> values, WireCode code,
                  std::string* out);
// Encodes into a caller-provided buffer of exactly WireBytes(dtype, n) bytes.
void EncodeValuesTo(absl::Span<const float> values, WireCode code, char* out);

// Decodes `data` (WireBytes(dtype, out.size()) bytes) into `out`. Returns
// INVALID_ARGUMENT if the size is wrong.
absl::Status DecodeValues(absl::string_view data, WireCode code,
                          absl::Span<float> out);

// Returns the index of the first non-finite value in `data` (wire dtype
// `dtype`, not a sparse one: FirstNonFinitePieces), or -1 if all are finite.
// `data` must hold whole elements (for a blockwise code: be WireBytes of its
// element count; the index is then the first element of the first block whose
// scale is not finite).
int64_t FirstNonFinite(absl::string_view data, DType dtype);

// The largest |value| in `data` (wire dtype `dtype`, not a sparse one:
// MaxAbsPieces; whole elements, all finite): for a blockwise code an upper
// bound, the largest scale times the code's magnitude (what an absmax encoder's
// largest code decodes to). 0 for no elements.
float MaxAbs(absl::string_view data, DType dtype);

// INVALID_ARGUMENT unless the pieces hold together a well-formed payload of
// n values in `code`: its size, and for a blockwise code its scales
// (CheckBlockScales), for a sparse one its structure (CheckSparse). What
// the message names: the size, or the first offending block. Whether its
// values are finite is FirstNonFinitePieces's to say.
absl::Status CheckPayloadPieces(absl::Span<const absl::string_view> pieces,
                                WireCode code, size_t n);

// Blockwise codes: INVALID_ARGUMENT naming the first block whose scale is
// zero, negative or finite above kMaxBlockScale (a malformed payload,
// whatever the non-finite policy).
// `scales` is the payload's first 4 * NumBlocks(n) bytes (its scales).
absl::Status CheckBlockScales(absl::string_view scales, DType dtype);

// Encodes `values` + `residual` (error feedback: what earlier encodings
// lost) in `dtype` into `out` (WireBytes(dtype, n) bytes), writes what `out`
// decodes to into `decoded`, and leaves in `residual` what this encoding
// lost: (values + residual) - decoded. An empty `residual` means none (and
// none is kept). All spans hold n values; `decoded` may be `values`.
void EncodeWithFeedback(absl::Span<const float> values,
                        absl::Span<float> residual, WireCode code, char* out,
                        absl::Span<float> decoded);

// EncodeWithFeedback of the delta params - anchor in a blockwise or sparse
// code with a residual, in one pass and without the
// delta or its decoding in memory: bit for bit SubtractTo(params, anchor)
// then EncodeWithFeedback of that delta (a member's upload). All spans
// hold n values; `out` holds WireBytes(dtype, n) bytes.
void EncodeDeltaWithFeedback(absl::Span<const float> params,
                             absl::Span<const float> anchor,
                             absl::Span<float> residual, WireCode code,
                             char* out);

// out[i] = base[i] + value(data, i) for every i, in one pass: a delta
// decoded onto the state it is against, bit for bit base + DecodeValues.
// `out` may be `base`. INVALID_ARGUMENT, changing nothing, if `data` does
// not hold WireBytes(dtype, out.size()) bytes or the spans differ in size.
absl::Status DecodeOnto(absl::string_view data, WireCode code,
                        absl::Span<const float> base, absl::Span<float> out);

// acc[i] += weight * value(data, i) for every i. `data` holds acc.size()
// elements of wire dtype `dtype`.
void AccumulateWeighted(absl::string_view data, WireCode code, float weight,
                        absl::Span<float> acc);

// The same four for a payload that arrived in pieces (gRPC's slices; an
// element may straddle two pieces). `pieces` hold together exactly the
// elements the single-buffer version takes: n of them (which the sparse
// codes' layout needs to be read).
int64_t FirstNonFinitePieces(absl::Span<const absl::string_view> pieces,
                             WireCode code, size_t n);
float MaxAbsPieces(absl::Span<const absl::string_view> pieces, WireCode code,
                   size_t n);
// A contribution chunk's magnitude, for the coordinator's guards: MaxAbs
// (the finite-state guard's bound) and the sum of the squares of the values
// as they decode, in double (the outlier guard's L2 norm is its root).
struct ChunkMagnitude {
  float max_abs = 0;
  double sum_of_squares = 0;
};
// Of `n` elements in wire dtype `dtype` (all finite, sizes checked), in
// one pass over a float32 or bfloat16 payload; for a blockwise one the
// sum of squares decodes it into a buffer of the calling thread. Without
// `with_norm`, sum_of_squares is 0 (MaxAbsPieces's cost).
ChunkMagnitude MagnitudePieces(absl::Span<const absl::string_view> pieces,
                               WireCode code, size_t n, bool with_norm);
void AccumulateWeightedPieces(absl::Span<const absl::string_view> pieces,
                              WireCode code, float weight,
                              absl::Span<float> acc);
// These two: INVALID_ARGUMENT, changing nothing, if the pieces do not hold
// WireBytes(dtype, out.size()) bytes (or base and out differ in size).
absl::Status DecodeValuesPieces(absl::Span<const absl::string_view> pieces,
                                WireCode code, absl::Span<float> out);
absl::Status DecodeOntoPieces(absl::Span<const absl::string_view> pieces,
                              WireCode code, absl::Span<const float> base,
                              absl::Span<float> out);

// acc[i] /= total_weight for every i (total_weight > 0).
void DivideInPlace(absl::Span<float> acc, double total_weight);

// Element-wise kernels of the hot paths, over raw pointers: an
// absl::Span's operator[] is bounds-checked in Debian's hardened Abseil
// (ABSL_OPTION_HARDENED), which keeps a loop over it from vectorizing.
// The spans of one call hold the same number of values.
//
// out (WireBytes(kFloat32, a.size()) bytes) = the float32 bytes of
// a[i] - b[i]: a delta in float32 wire form, in one pass. `out` may not
// overlap a or b.
void SubtractTo(absl::Span<const float> a, absl::Span<const float> b,
                char* out);
// acc[i] += values[i] (`values` may not overlap acc).
void AddInPlace(absl::Span<float> acc, absl::Span<const float> values);
// params[i] = base[i] + (params[i] - snapshot[i]): the progress since
// `snapshot` on top of `base` (BackgroundSync's merge).
void AddProgress(absl::Span<const float> base, absl::Span<const float> snapshot,
                 absl::Span<float> params);

// The blockwise encoders (EncodeValues, EncodeValuesTo, EncodeWithFeedback
// for kInt8Block and kInt4Block) run in AVX2 intrinsics where the CPU has
// AVX2 and in portable loops elsewhere, bit for bit alike (tested), so
// that members and coordinators on different CPUs compute the same bytes.
enum class CodecKernels { kPortable, kAvx2 };
CodecKernels ActiveCodecKernels();
// Makes every thread use the portable kernels (true) or the CPU's best
// (false, the default): for the tests and benchmarks that compare them.
void ForcePortableCodecKernels(bool portable);

// Replaces every value by the nearest value representable in `dtype`
// (bfloat16: round to nearest even; float32: no-op).
void RoundTripInPlace(absl::Span<float> values, DType dtype);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_CODEC_H_
