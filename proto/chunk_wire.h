// Chunk messages without protobuf copies of their payload.
//
// SyncRequest, SyncResponse and FetchStateResponse all carry a chunk as field
// 2 (`Chunk chunk = 2` in their oneof), and a Chunk is {index = 1, data = 2,
// crc32c = 3}. A chunk's payload is most of the bytes on the wire, and the
// generated code copies it twice per hop: into the message's `bytes` field,
// then into gRPC's slices (and the reverse on receipt), each time into fresh
// memory. Here:
//
//   - ChunkMessage builds the serialized message as a grpc::ByteBuffer of two
//     slices: a few bytes of framing, then the payload itself, not copied;
//     the payload's owner is kept alive by the slice until gRPC has sent it.
//     The bytes are ordinary protobuf wire format (fields in the order index,
//     crc32c, data): any protobuf parser reads the same Chunk.
//   - ParseChunkMessage reads a received message's chunk in place: the
//     payload as the pieces of gRPC's own slices (no copy). It accepts only
//     the plain shape (one chunk field; index, crc32c and data at most once
//     each, no other fields); for anything else it answers kNotPlain and the
//     caller parses the message with protobuf, so every valid encoding still
//     means exactly what protobuf says it means.
#ifndef LOCALSGD_PROTO_CHUNK_WIRE_H_
#define LOCALSGD_PROTO_CHUNK_WIRE_H_

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "localsgd/v1/coordinator.pb.h"
#include "proto/chunk.h"

namespace localsgd {

// The field number of `chunk` in SyncRequest, SyncResponse and
// FetchStateResponse (checked against the generated code in chunk_wire.cc).
inline constexpr uint32_t kChunkFieldNumber = 2;

// A serialized message {chunk: {index, crc32c, data}}. `data` is not copied:
// it must stay valid and unchanged while `owner` lives; the buffer's slice
// holds a reference to `owner` until gRPC drops the slice (which can be a
// little after the write completes).
grpc::ByteBuffer ChunkMessage(uint32_t index, uint32_t crc32c,
                              absl::string_view data,
                              std::shared_ptr<const void> owner);

// A received chunk, read in place from gRPC's slices: the pieces point
// into `slices`, which keep their memory alive.
struct ChunkView : ChunkPieces {
  std::vector<grpc::Slice> slices;
};

// A chunk parsed by protobuf, as a view: one piece, valid while `chunk`
// lives and is not changed; no slices.
ChunkView ViewOf(const v1::Chunk& chunk);

enum class ChunkParse {
  kChunk,     // `out` holds the chunk
  kNotPlain,  // not a plain chunk message: parse it with protobuf
};

// Reads `buffer` as a plain chunk message (see the file comment). The
// buffer is not consumed; `out` shares its slices.
ChunkParse ParseChunkMessage(const grpc::ByteBuffer& buffer, ChunkView* out);

// A (small) protobuf message, serialized for a raw stream.
template <typename Message>
grpc::ByteBuffer SerializeMessage(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  const grpc::Status s = grpc::SerializationTraits<Message>::Serialize(
      message, &buffer, &own_buffer);
  // Serializing an in-memory message fails only beyond 2 GiB.
  if (!s.ok()) std::abort();
  return buffer;
}

// Parses a raw stream's message (`raw` is not consumed). INVALID_ARGUMENT,
// naming `what`, if it does not parse.
template <typename Message>
absl::Status ParseMessage(const grpc::ByteBuffer& raw, Message* message,
                          absl::string_view what) {
  grpc::ByteBuffer copy(raw);  // shares the slices; Deserialize consumes it
  const grpc::Status s =
      grpc::SerializationTraits<Message>::Deserialize(&copy, message);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of ", raw.Length(), " bytes does not parse as ",
                     Message::descriptor()->full_name(),
                     " (malformed, or a string field that is not UTF-8)",
                     s.error_message().empty() ? "" : ": ", s.error_message()));
  }
  return absl::OkStatus();
}

}  // namespace localsgd

#endif  // LOCALSGD_PROTO_CHUNK_WIRE_H_
