#include "proto/chunk.h"

#include <cstring>

#include "src/crc32c.h"

namespace localsgd {

uint32_t ChunkPieces::ComputeCrc32c() const {
  uint32_t crc = 0;
  for (absl::string_view piece : pieces) crc = Crc32c(crc, piece);
  return crc;
}

void ChunkPieces::CopyTo(char* out) const {
  for (absl::string_view piece : pieces) {
    if (piece.empty()) continue;
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
}

ChunkPieces PiecesOf(const v1::Chunk& chunk) {
  ChunkPieces view;
  view.index = chunk.index();
  view.has_crc32c = chunk.has_crc32c();
  view.crc32c = chunk.crc32c();
  view.pieces.push_back(chunk.data());
  view.size = chunk.data().size();
  return view;
}

}  // namespace localsgd
