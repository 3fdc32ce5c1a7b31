// libFuzzer target: the in-place chunk reader (proto/chunk_wire.h) and the
// piece-wise kernels it feeds (src/codec.h), against protobuf and the
// single-buffer kernels.
//
// Input: byte 0 = number of cuts (mod 16), then that many 2-byte cut
// positions, then the message bytes; the message is handed over as slices
// cut there (as gRPC's transport does). Checked:
//   - ParseChunkMessage says kChunk only for bytes protobuf parses as a
//     SyncRequest (and SyncResponse, FetchStateResponse) holding a chunk
//     with the same index, crc32c presence and value, and data;
//   - what it reads, ChunkMessage writes back so that it parses the same;
//   - over the chunk's pieces, the CRC, the non-finite check, accumulate
//     and decode (fp32 and bf16) equal the single-buffer versions on the
//     joined bytes.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "localsgd/v1/coordinator.pb.h"
#include "proto/chunk_wire.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "chunk_wire_fuzzer: %s\n", what);
    std::abort();
  }
}

std::string Joined(const localsgd::ChunkView& view) {
  std::string out(view.size, '\0');
  view.CopyTo(out.data());
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() ||
          std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void CheckKernels(const localsgd::ChunkView& view, const std::string& data) {
  using localsgd::DType;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const size_t size = static_cast<size_t>(localsgd::DTypeSize(dtype));
    if (data.size() % size != 0) continue;
    const size_t n = data.size() / size;
    Check(localsgd::FirstNonFinitePieces(view.pieces, dtype, n) ==
              localsgd::FirstNonFinite(data, dtype),
          "FirstNonFinitePieces differs");
    std::vector<float> want(n, 0.5f), got(n, 0.5f);
    localsgd::AccumulateWeighted(data, dtype, 0.75f, absl::MakeSpan(want));
    localsgd::AccumulateWeightedPieces(view.pieces, dtype, 0.75f,
                                       absl::MakeSpan(got));
    Check(SameBits(want, got), "AccumulateWeightedPieces differs");
    Check(localsgd::DecodeValues(data, dtype, absl::MakeSpan(want)).ok() &&
              localsgd::DecodeValuesPieces(view.pieces, dtype,
                                           absl::MakeSpan(got))
                  .ok(),
          "decode failed");
    Check(SameBits(want, got), "DecodeValuesPieces differs");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return -1;
  const size_t cuts = data[0] % 16;
  if (size < 1 + 2 * cuts) return -1;
  std::vector<size_t> at;
  const uint8_t* p = data + 1;
  const std::string message(reinterpret_cast<const char*>(p + 2 * cuts),
                            size - 1 - 2 * cuts);
  for (size_t i = 0; i < cuts; ++i) {
    const size_t pos = static_cast<size_t>(p[2 * i]) << 8 | p[2 * i + 1];
    at.push_back(message.empty() ? 0 : pos % (message.size() + 1));
  }
  at.push_back(0);
  at.push_back(message.size());
  std::sort(at.begin(), at.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    slices.emplace_back(message.data() + at[i], at[i + 1] - at[i]);
  }
  const grpc::ByteBuffer buffer(slices.data(), slices.size());

  localsgd::ChunkView view;
  if (localsgd::ParseChunkMessage(buffer, &view) !=
      localsgd::ChunkParse::kChunk) {
    return 0;  // left to protobuf: nothing of ours to check
  }
  const std::string joined = Joined(view);
  Check(joined.size() == view.size, "pieces do not add up to size");
  localsgd::v1::SyncRequest request;
  localsgd::v1::SyncResponse response;
  localsgd::v1::FetchStateResponse state;
  Check(request.ParseFromString(message) && request.has_chunk(),
        "kChunk but protobuf reads no SyncRequest chunk");
  Check(response.ParseFromString(message) && response.has_chunk() &&
            state.ParseFromString(message) && state.has_chunk(),
        "kChunk but protobuf reads no SyncResponse/FetchStateResponse chunk");
  const localsgd::v1::Chunk& chunk = request.chunk();
  Check(chunk.index() == view.index, "index differs from protobuf's");
  Check(chunk.has_crc32c() == view.has_crc32c, "crc32c presence differs");
  Check(!view.has_crc32c || chunk.crc32c() == view.crc32c,
        "crc32c differs from protobuf's");
  Check(chunk.data() == joined, "data differs from protobuf's");
  Check(view.ComputeCrc32c() == localsgd::Crc32c(0, joined),
        "CRC over the pieces differs");

  // What we read, written back, reads the same.
  auto owner = std::make_shared<std::string>(joined);
  const grpc::ByteBuffer again =
      localsgd::ChunkMessage(view.index, view.crc32c, *owner, owner);
  localsgd::ChunkView back;
  Check(localsgd::ParseChunkMessage(again, &back) ==
                localsgd::ChunkParse::kChunk &&
            back.index == view.index && back.crc32c == view.crc32c &&
            Joined(back) == joined,
        "ChunkMessage of a parsed chunk does not parse back");

  CheckKernels(view, joined);
  return 0;
}
