#include "proto/chunk_wire.h"

#include <cstring>
#include <utility>

#include "localsgd/v1/coordinator.pb.h"
#include "src/crc32c.h"

namespace localsgd {
namespace {

static_assert(v1::SyncRequest::kChunkFieldNumber == kChunkFieldNumber);
static_assert(v1::SyncResponse::kChunkFieldNumber == kChunkFieldNumber);
static_assert(v1::FetchStateResponse::kChunkFieldNumber == kChunkFieldNumber);
static_assert(v1::Chunk::kIndexFieldNumber == 1);
static_assert(v1::Chunk::kDataFieldNumber == 2);
static_assert(v1::Chunk::kCrc32CFieldNumber == 3);

// Wire types (protobuf encoding).
constexpr uint32_t kVarint = 0;
constexpr uint32_t kLengthDelimited = 2;
constexpr uint32_t kFixed32 = 5;

constexpr uint32_t Tag(uint32_t field, uint32_t wire_type) {
  return (field << 3) | wire_type;
}

char* PutVarint(uint64_t value, char* out) {
  while (value >= 0x80) {
    *out++ = static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  *out++ = static_cast<char>(value);
  return out;
}

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

// Deletes the shared_ptr a payload slice holds.
void ReleaseOwner(void* user_data) {
  delete static_cast<std::shared_ptr<const void>*>(user_data);
}

// Reads bytes across the slices of a buffer.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    Skip();
  }

  size_t consumed() const { return consumed_; }

  bool ReadByte(uint8_t* byte) {
    if (slice_ == slices_.size()) return false;
    *byte = slices_[slice_].begin()[offset_];
    Advance(1);
    return true;
  }

  // A minimally encoded varint of at most 10 bytes; false at the end, on a
  // longer one, or on an overlong encoding (a last byte of 0 after the
  // first), which protobuf treats differently by field (a size varint of
  // more than 5 bytes fails there): such messages go to protobuf.
  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      if (shift == 63 && byte > 1) return false;
      if (shift > 0 && byte == 0) return false;
      *value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  bool ReadFixed32(uint32_t* value) {
    uint8_t b[4];
    for (uint8_t& x : b) {
      if (!ReadByte(&x)) return false;
    }
    *value = static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
             (static_cast<uint32_t>(b[2]) << 16) |
             (static_cast<uint32_t>(b[3]) << 24);
    return true;
  }

  // The next `n` bytes as pieces of the slices, in place.
  bool ReadPieces(size_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      if (slice_ == slices_.size()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t take = std::min(n, s.size() - offset_);
      pieces->emplace_back(reinterpret_cast<const char*>(s.begin()) + offset_,
                           take);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    consumed_ += n;
    Skip();
  }
  // Moves past exhausted (and empty) slices.
  void Skip() {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t consumed_ = 0;
};

}  // namespace

grpc::ByteBuffer ChunkMessage(uint32_t index, uint32_t crc32c,
                              absl::string_view data,
                              std::shared_ptr<const void> owner) {
  // Chunk body: index (varint), crc32c (fixed32), data (length-delimited).
  const size_t body =
      1 + VarintSize(index) + 1 + 4 + 1 + VarintSize(data.size()) + data.size();
  char head[40];
  char* p = head;
  p = PutVarint(Tag(kChunkFieldNumber, kLengthDelimited), p);
  p = PutVarint(body, p);
  p = PutVarint(Tag(1, kVarint), p);
  p = PutVarint(index, p);
  p = PutVarint(Tag(3, kFixed32), p);
  for (int i = 0; i < 4; ++i) *p++ = static_cast<char>(crc32c >> (8 * i));
  p = PutVarint(Tag(2, kLengthDelimited), p);
  p = PutVarint(data.size(), p);
  grpc::Slice slices[2] = {
      grpc::Slice(head, static_cast<size_t>(p - head)),
      data.empty()
          ? grpc::Slice()
          : grpc::Slice(const_cast<char*>(data.data()), data.size(),
                        &ReleaseOwner,
                        new std::shared_ptr<const void>(std::move(owner))),
  };
  return grpc::ByteBuffer(slices, data.empty() ? 1 : 2);
}

ChunkView ViewOf(const v1::Chunk& chunk) {
  ChunkView view;
  static_cast<ChunkPieces&>(view) = PiecesOf(chunk);
  return view;
}

ChunkParse ParseChunkMessage(const grpc::ByteBuffer& buffer, ChunkView* out) {
  *out = ChunkView();
  if (!buffer.Dump(&out->slices).ok()) return ChunkParse::kNotPlain;
  const size_t total = buffer.Length();
  Cursor in(out->slices);
  uint64_t tag = 0, length = 0;
  // One field: the chunk, spanning the rest of the message.
  if (!in.ReadVarint(&tag) || tag != Tag(kChunkFieldNumber, kLengthDelimited) ||
      !in.ReadVarint(&length) || length != total - in.consumed()) {
    return ChunkParse::kNotPlain;
  }
  bool index_seen = false, data_seen = false;
  while (in.consumed() < total) {
    if (!in.ReadVarint(&tag)) return ChunkParse::kNotPlain;
    if (tag == Tag(1, kVarint) && !index_seen) {
      uint64_t index = 0;
      // A varint beyond 32 bits is legal (protobuf truncates it): leave
      // such oddities to protobuf.
      if (!in.ReadVarint(&index) || index > UINT32_MAX) {
        return ChunkParse::kNotPlain;
      }
      out->index = static_cast<uint32_t>(index);
      index_seen = true;
    } else if (tag == Tag(3, kFixed32) && !out->has_crc32c) {
      if (!in.ReadFixed32(&out->crc32c)) return ChunkParse::kNotPlain;
      out->has_crc32c = true;
    } else if (tag == Tag(2, kLengthDelimited) && !data_seen) {
      if (!in.ReadVarint(&length) || length > total - in.consumed() ||
          !in.ReadPieces(length, &out->pieces)) {
        return ChunkParse::kNotPlain;
      }
      out->size = length;
      data_seen = true;
    } else {
      return ChunkParse::kNotPlain;
    }
  }
  return ChunkParse::kChunk;
}

}  // namespace localsgd
