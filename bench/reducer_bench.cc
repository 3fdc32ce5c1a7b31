// Google Benchmark of the coordinator's reducer kernels (src/codec.h) against
// memcpy of the same bytes, for chunks of 256Ki and 1Mi elements.
//
// Bytes processed (SetBytesProcessed) per iteration:
//  - Accumulate*: the chunk's payload in its wire dtype (4 bytes per element
//    for fp32 input, 2 for bf16), i.e. what arrives from the network; the
//    fp32 accumulator is read and written on top of that.
//  - Finalize*: the fp32 accumulator (4 bytes per element). There is no
//    standalone finalize function: Job::CloseRoundLocked (src/job.cc) runs
//    DivideInPlace over each chunk by its weight and then RoundTripInPlace
//    over the whole state for the wire dtype; these benchmarks run that same
//    pair per chunk.
//  - Encode/Decode bf16 (the client's side, for reference): the fp32 values.
//  - Accumulate{Int8,Int4}*: the same for the blockwise codes of
//    pseudo-gradient jobs (decode + weighted accumulate, what the coordinator
//    runs per chunk as it arrives); their payload bytes are the codes plus a
//    float32 scale per 64 elements. items/s (elements) is the figure to
//    read: the target is 2 G elements/s per core.
//  - EncodeFeedback{Bf16,Int8,Int4}: EncodeWithFeedback (both ends: values
//    + residual, encoded, decoded back, residual updated), per fp32 value;
//    items/s is the figure to read (the target: 2 G elements/s per core).
//    Also at 64Ki elements, whose 0.8 MiB of arrays fit in a core's L2: at
//    256Ki and 1Mi the 17 bytes each element moves come from L3 and memory. The
//    *Portable twins run the portable loops instead of the AVX2 kernels
//    (what a CPU without AVX2 gets; same bytes).
//  - EncodeDelta{Int8,Int4}: a member's upload, params - anchor encoded with
//    feedback in one pass (EncodeDeltaWithFeedback: 17 bytes moved per
//    element), and *TwoSteps, the SubtractTo + EncodeWithFeedback it
//    replaces (29 bytes); items/s.
//  - EncodeSparseDelta<keep>x<bits>: a member's upload in a sparse code
//    (src/sparse_codec.h: keep values per 4096, bits per value) with
//    feedback, on N(0, 1) values; AccumulateSparse<keep>x<bits>: the
//    coordinator's decode + weighted accumulate of such a payload. items/s
//    counts the chunk's elements (targets: 1 and 2 G elements/s per core).
//  - Crc32c (every chunk, both sides, src/crc32c.h) and its table-driven
//    fallback Crc32cPortable: the fp32 chunk's bytes.
//  - Memcpy/<bytes>: the same bytes copied between two reused buffers; the
//    baselines are Memcpy of 4 x elements (fp32 chunk) and 2 x elements (bf16
//    chunk).
// bench/sync_round.sh prints each kernel's bytes/s as a fraction of the
// memcpy of the same bytes.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "benchmark/benchmark.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/sparse_codec.h"
#include "src/types.h"

namespace localsgd {
namespace {

std::vector<float> Values(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>(static_cast<int>(i % 2048) - 1024) / 1000.0f;
  }
  return v;
}

std::string Payload(size_t n, DType dtype) {
  std::string out;
  EncodeValues(Values(n), dtype, &out);
  return out;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(bytes));
}

template <DType kWire>
void BM_Accumulate(benchmark::State& state, float weight) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::string payload = Payload(n, kWire);
  std::vector<float> acc(n, 0.0f);
  for (auto _ : state) {
    AccumulateWeighted(payload, kWire, weight, absl::MakeSpan(acc));
    benchmark::DoNotOptimize(acc.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(WireBytes(kWire, n)));
}
// The element count as items, for the kernels whose payload bytes are not
// 4 per element.
template <DType kWire>
void BM_AccumulateItems(benchmark::State& state, float weight) {
  BM_Accumulate<kWire>(state, weight);
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          state.range(0));
}
void BM_AccumulateInt8(benchmark::State& state) {
  BM_AccumulateItems<DType::kInt8Block>(state, 1.0f);
}
void BM_AccumulateInt8Weighted(benchmark::State& state) {
  BM_AccumulateItems<DType::kInt8Block>(state, 0.5f);
}
void BM_AccumulateInt4(benchmark::State& state) {
  BM_AccumulateItems<DType::kInt4Block>(state, 1.0f);
}
void BM_AccumulateInt4Weighted(benchmark::State& state) {
  BM_AccumulateItems<DType::kInt4Block>(state, 0.5f);
}

template <DType kWire>
void BM_EncodeFeedback(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> values = Values(n);
  std::vector<float> residual(n, 0.0f), decoded(n);
  std::string out(WireBytes(kWire, n), '\0');
  for (auto _ : state) {
    EncodeWithFeedback(values, absl::MakeSpan(residual), kWire, out.data(),
                       absl::MakeSpan(decoded));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(4 * n));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          state.range(0));
}
// The same with the portable loops in place of the AVX2 kernels.
template <DType kWire>
void BM_EncodeFeedbackPortable(benchmark::State& state) {
  ForcePortableCodecKernels(true);
  BM_EncodeFeedback<kWire>(state);
  ForcePortableCodecKernels(false);
}
// A member's upload of a delta: params - anchor encoded with feedback, in
// one pass (EncodeDeltaWithFeedback) or in the two steps it replaces
// (SubtractTo into a buffer, then EncodeWithFeedback).
template <DType kWire, bool kOnePass>
void BM_EncodeDelta(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> anchor = Values(n);
  std::vector<float> params = anchor;
  for (size_t i = 0; i < n; ++i) params[i] += 1e-3f * anchor[(i * 7) % n];
  std::vector<float> residual(n, 0.0f), delta(n), decoded(n);
  std::string out(WireBytes(kWire, n), '\0');
  for (auto _ : state) {
    if (kOnePass) {
      EncodeDeltaWithFeedback(params, anchor, absl::MakeSpan(residual), kWire,
                              out.data());
    } else {
      SubtractTo(params, anchor, reinterpret_cast<char*>(delta.data()));
      EncodeWithFeedback(delta, absl::MakeSpan(residual), kWire, out.data(),
                         absl::MakeSpan(decoded));
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          state.range(0));
}
void BM_EncodeDeltaInt8(benchmark::State& state) {
  BM_EncodeDelta<DType::kInt8Block, true>(state);
}
void BM_EncodeDeltaInt8TwoSteps(benchmark::State& state) {
  BM_EncodeDelta<DType::kInt8Block, false>(state);
}
void BM_EncodeDeltaInt4(benchmark::State& state) {
  BM_EncodeDelta<DType::kInt4Block, true>(state);
}
void BM_EncodeDeltaInt4TwoSteps(benchmark::State& state) {
  BM_EncodeDelta<DType::kInt4Block, false>(state);
}

void BM_EncodeFeedbackBf16(benchmark::State& state) {
  BM_EncodeFeedback<DType::kBFloat16>(state);
}
void BM_EncodeFeedbackInt8(benchmark::State& state) {
  BM_EncodeFeedback<DType::kInt8Block>(state);
}
void BM_EncodeFeedbackInt4(benchmark::State& state) {
  BM_EncodeFeedback<DType::kInt4Block>(state);
}
void BM_EncodeFeedbackInt8Portable(benchmark::State& state) {
  BM_EncodeFeedbackPortable<DType::kInt8Block>(state);
}
void BM_EncodeFeedbackInt4Portable(benchmark::State& state) {
  BM_EncodeFeedbackPortable<DType::kInt4Block>(state);
}

// The sparse codes (src/sparse_codec.h), on N(0, 1) values (where a
// block's top values stand out as they do in a pseudo-gradient): a
// member's upload (params - anchor with feedback, one pass; the residual
// carried from iteration to iteration, as a member's is from round to
// round: the feedback's steady state) and the coordinator's decode +
// accumulate; items are the chunk's elements.
std::vector<float> NormalValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}
template <uint32_t kKeep, uint32_t kBits>
void BM_EncodeSparseDelta(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const SparseCode code{kKeep, kBits};
  const std::vector<float> anchor = NormalValues(n, 1);
  std::vector<float> params = NormalValues(n, 2);
  for (size_t i = 0; i < n; ++i) params[i] += anchor[i];
  std::vector<float> residual(n, 0.0f);
  std::string out(SparseWireBytes(n, code), '\0');
  for (auto _ : state) {
    EncodeSparseDeltaWithFeedback(params, anchor, absl::MakeSpan(residual),
                                  code, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          state.range(0));
}
template <uint32_t kKeep, uint32_t kBits>
void BM_AccumulateSparse(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const SparseCode code{kKeep, kBits};
  std::vector<float> values = NormalValues(n, 3);
  std::string payload(SparseWireBytes(n, code), '\0');
  EncodeSparseWithFeedback(values, {}, code, payload.data());
  std::vector<float> acc(n, 0.0f);
  for (auto _ : state) {
    if (!AccumulateSparseWeighted(payload, code, 0.5f, absl::MakeSpan(acc))
             .ok()) {
      state.SkipWithError("AccumulateSparseWeighted refused the payload");
    }
    benchmark::DoNotOptimize(acc.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          state.range(0));
}
void BM_EncodeSparseDelta64x2(benchmark::State& state) {
  BM_EncodeSparseDelta<64, 2>(state);
}
void BM_EncodeSparseDelta128x4(benchmark::State& state) {
  BM_EncodeSparseDelta<128, 4>(state);
}
void BM_AccumulateSparse64x2(benchmark::State& state) {
  BM_AccumulateSparse<64, 2>(state);
}
void BM_AccumulateSparse128x4(benchmark::State& state) {
  BM_AccumulateSparse<128, 4>(state);
}

void BM_AccumulateFp32(benchmark::State& state) {
  BM_Accumulate<DType::kFloat32>(state, 1.0f);
}
void BM_AccumulateFp32Weighted(benchmark::State& state) {
  BM_Accumulate<DType::kFloat32>(state, 0.5f);
}
void BM_AccumulateBf16(benchmark::State& state) {
  BM_Accumulate<DType::kBFloat16>(state, 1.0f);
}
void BM_AccumulateBf16Weighted(benchmark::State& state) {
  BM_Accumulate<DType::kBFloat16>(state, 0.5f);
}

// What Job::CloseRoundLocked does to one chunk of the accumulator.
template <DType kWire>
void BM_Finalize(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> values = Values(n);
  std::vector<float> acc = values;
  volatile double total_weight = 1.0;
  for (auto _ : state) {
    const double weight = total_weight;
    // Dividing by 1 keeps the values bounded over the iterations; the
    // division runs all the same (DivideInPlace is in another translation
    // unit and the weight is read from a volatile).
    DivideInPlace(absl::MakeSpan(acc), weight);
    RoundTripInPlace(absl::MakeSpan(acc), kWire);
    benchmark::DoNotOptimize(acc.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * sizeof(float)));
}
void BM_FinalizeFp32(benchmark::State& state) {
  BM_Finalize<DType::kFloat32>(state);
}
void BM_FinalizeBf16(benchmark::State& state) {
  BM_Finalize<DType::kBFloat16>(state);
}

void BM_EncodeBf16(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> values = Values(n);
  std::string out(WireBytes(DType::kBFloat16, n), '\0');
  for (auto _ : state) {
    EncodeValuesTo(values, DType::kBFloat16, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * sizeof(float)));
}

void BM_DecodeBf16(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::string payload = Payload(n, DType::kBFloat16);
  std::vector<float> out(n);
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        DecodeValues(payload, DType::kBFloat16, absl::MakeSpan(out)).ok());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * sizeof(float)));
}

void BM_Crc32c(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::string payload = Payload(n, DType::kFloat32);
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(0, payload));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(payload.size()));
}

void BM_Crc32cPortable(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::string payload = Payload(n, DType::kFloat32);
  for (auto _ : state) benchmark::DoNotOptimize(Crc32cPortable(0, payload));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(payload.size()));
}

constexpr int64_t k64K = 64 * 1024;
constexpr int64_t k256K = 256 * 1024;
constexpr int64_t k1M = 1024 * 1024;

BENCHMARK(BM_Memcpy)->Arg(2 * k256K)->Arg(4 * k256K)->Arg(2 * k1M)->Arg(4 *
                                                                        k1M);
BENCHMARK(BM_AccumulateFp32)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateFp32Weighted)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateBf16)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateBf16Weighted)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateInt8)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateInt8Weighted)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateInt4)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_AccumulateInt4Weighted)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeFeedbackBf16)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeFeedbackInt8)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeFeedbackInt4)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeDeltaInt8)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeDeltaInt8TwoSteps)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeDeltaInt4)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeDeltaInt4TwoSteps)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeFeedbackInt8Portable)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeFeedbackInt4Portable)->Arg(k64K)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_FinalizeFp32)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_FinalizeBf16)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeBf16)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_DecodeBf16)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_EncodeSparseDelta64x2)->Arg(k64K)->Arg(k1M);
BENCHMARK(BM_EncodeSparseDelta128x4)->Arg(k64K)->Arg(k1M);
BENCHMARK(BM_AccumulateSparse64x2)->Arg(k64K)->Arg(k1M);
BENCHMARK(BM_AccumulateSparse128x4)->Arg(k64K)->Arg(k1M);
BENCHMARK(BM_Crc32c)->Arg(k256K)->Arg(k1M);
BENCHMARK(BM_Crc32cPortable)->Arg(k256K);

}  // namespace
}  // namespace localsgd

BENCHMARK_MAIN();
