// libFuzzer target: the sparse codes (src/sparse_codec.h) on arbitrary
// payloads and arbitrary values.
//
// Input: byte 0 picks keep (1 + byte x 16, at most 4096), byte 1 the bits
// (2 or 4, its low bit), bytes 2-3 the element count n (little-endian, at
// most 65535: up to 16 blocks), byte 4 the mode; the rest is
//   mode even: a payload. Checked: the decoders never read or write out of
//     bounds (the sanitizers), refuse a payload of the wrong size, and on
//     one CheckSparse accepts agree with each other (accumulate into zeros
//     with weight 1 = decode, but for -0) and with SparseMaxAbs and
//     SparseFirstNonFinite; at most K values are not zero;
//   mode odd: float32 values (then as many residual values, as far as the
//     bytes go; the rest 0). Checked: the encoder's payload passes
//     CheckSparse, decodes to what the encoder said it decodes to, and the
//     residual is (values + residual) - decoded, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/sparse_codec.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "sparse_codec_fuzzer: %s\n", what);
    std::abort();
  }
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

void Payload(const std::string& data, size_t n, localsgd::SparseCode code) {
  std::vector<float> out(n, 1.0f);
  const bool sized = data.size() == localsgd::SparseWireBytes(n, code);
  const absl::Status decoded =
      localsgd::DecodeSparse(data, code, absl::MakeSpan(out));
  Check(decoded.ok() == sized, "DecodeSparse refused a well-sized payload");
  if (!sized) {
    for (float x : out) Check(x == 1.0f, "a refused decode wrote");
    return;
  }
  std::vector<float> acc(n, 0.0f);
  Check(
      localsgd::AccumulateSparseWeighted(data, code, 1.0f, absl::MakeSpan(acc))
          .ok(),
      "AccumulateSparseWeighted refused a well-sized payload");
  if (!localsgd::CheckSparse(data, n, code).ok()) return;
  const int64_t flagged = localsgd::SparseFirstNonFinite(data, n, code);
  const float bound = localsgd::SparseMaxAbs(data, n, code);
  size_t nonzero = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = out[i];
    if (x != 0.0f || std::isnan(x)) ++nonzero;
    Check(Bits(acc[i]) == Bits(x) || (x == 0.0f && acc[i] == 0.0f) ||
              (std::isnan(x) && std::isnan(acc[i])),
          "accumulate into zeros differs from decode");
    if (std::isnan(x)) {
      Check(flagged >= 0 && i >= static_cast<size_t>(flagged),
            "a NaN before the first flagged block");
    } else {
      Check(std::fabs(x) <= bound, "a value above SparseMaxAbs");
    }
  }
  Check(nonzero <= localsgd::SparseKept(n, code), "more values than kept");
}

void Values(const uint8_t* p, size_t size, size_t n,
            localsgd::SparseCode code) {
  std::vector<float> v(n, 0.0f), r(n, 0.0f);
  const size_t floats = size / 4;
  for (size_t k = 0; k < floats && k < 2 * n; ++k) {
    float f;
    std::memcpy(&f, p + 4 * k, 4);
    (k < n ? v[k] : r[k - n]) = f;
  }
  std::vector<float> e(n);
  for (size_t i = 0; i < n; ++i) e[i] = v[i] + r[i];
  std::string payload(localsgd::SparseWireBytes(n, code), '\0');
  std::vector<float> decoded(n);
  localsgd::EncodeSparseWithFeedback(v, absl::MakeSpan(r), code, payload.data(),
                                     absl::MakeSpan(decoded));
  Check(localsgd::CheckSparse(payload, n, code).ok(),
        "CheckSparse refused the encoder's payload");
  std::vector<float> again(n);
  Check(localsgd::DecodeSparse(payload, code, absl::MakeSpan(again)).ok(),
        "DecodeSparse refused the encoder's payload");
  for (size_t i = 0; i < n; ++i) {
    Check(Bits(again[i]) == Bits(decoded[i]) ||
              (std::isnan(again[i]) && std::isnan(decoded[i])),
          "decodes to other than the encoder said");
    const float lost = e[i] - decoded[i];
    Check(Bits(r[i]) == Bits(lost) || (std::isnan(r[i]) && std::isnan(lost)),
          "the residual is not what the encoding lost");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  localsgd::SparseCode code;
  code.keep = std::min<uint32_t>(1 + 16u * data[0], 4096);
  code.bits = (data[1] & 1) != 0 ? 4 : 2;
  const size_t n = data[2] | static_cast<size_t>(data[3]) << 8;
  const bool values = (data[4] & 1) != 0;
  data += 5;
  size -= 5;
  if (values) {
    Values(data, size, n, code);
  } else {
    Payload(std::string(reinterpret_cast<const char*>(data), size), n, code);
  }
  return 0;
}
