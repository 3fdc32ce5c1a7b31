// A received chunk as the protocol layer handles it: index, checksum, and
// the payload as pieces of memory the caller owns (gRPC's slices when read
// in place, proto/chunk_wire.h; a protobuf `bytes` field otherwise).
// gRPC-free.
#ifndef LOCALSGD_PROTO_CHUNK_H_
#define LOCALSGD_PROTO_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "localsgd/v1/coordinator.pb.h"

namespace localsgd {

struct ChunkPieces {
  uint32_t index = 0;
  bool has_crc32c = false;
  uint32_t crc32c = 0;
  // The payload, in order; together `size` bytes.
  std::vector<absl::string_view> pieces;
  size_t size = 0;

  // CRC32C of the payload.
  uint32_t ComputeCrc32c() const;
  // Copies the payload to `out` (`size` bytes).
  void CopyTo(char* out) const;
};

// A chunk parsed by protobuf, as pieces: one piece, valid while `chunk`
// lives and is not changed.
ChunkPieces PiecesOf(const v1::Chunk& chunk);

}  // namespace localsgd

#endif  // LOCALSGD_PROTO_CHUNK_H_
