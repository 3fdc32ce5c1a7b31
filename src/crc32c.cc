#include "src/crc32c.h"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define LOCALSGD_CRC32C_SSE42 1
#endif

namespace localsgd {
namespace {

constexpr uint32_t kCastagnoli = 0x82F63B78u;

struct Crc32cTables {
  uint32_t t[8][256];
};

// t[0] is the classic byte-at-a-time table; t[s][b] is the CRC of byte b
// followed by s zero bytes, which lets the loop fold 8 bytes per step
// ("slicing-by-8").
constexpr Crc32cTables MakeCrc32cTables() {
  Crc32cTables tables{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int k = 0; k < 8; ++k)
      crc = (crc >> 1) ^ ((crc & 1) ? kCastagnoli : 0);
    tables.t[0][i] = crc;
  }
  for (int s = 1; s < 8; ++s) {
    for (uint32_t i = 0; i < 256; ++i) {
      const uint32_t prev = tables.t[s - 1][i];
      tables.t[s][i] = (prev >> 8) ^ tables.t[0][prev & 0xff];
    }
  }
  return tables;
}

constexpr Crc32cTables kTables = MakeCrc32cTables();

inline uint32_t LoadLe32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

#ifdef LOCALSGD_CRC32C_SSE42
// The SSE4.2 crc32 instruction computes exactly CRC32C (the raw register
// update; Crc32c adds the conditioning). It takes 3 cycles and can start
// one per cycle: a single dependent chain runs at a third of what the unit
// can do (~8 GB/s here). So buffers go in blocks of three streams of
// kStride bytes, each its own chain, joined with the "append kStride zero
// bytes" operator: for the raw update R_X over bytes X (linear over GF(2)),
// R_{AB}(s) = Z(R_A(s)) ^ R_B(0), where Z is the update over |B| zeros.
// Two block sizes: 3 x 4 KiB for long buffers, then 3 x 512 bytes for
// what is left (gRPC hands received payloads over in pieces of up to 16 KiB,
// its HTTP/2 frame size).
constexpr size_t kLongStride = 4096;
constexpr size_t kShortStride = 512;

inline uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // x86 is little-endian, as the CRC wants
  return v;
}

// Z for `stride` bytes as four byte-indexed tables (Z is linear, so
// Z(c) = t[0][byte 0 of c] ^ ... ^ t[3][byte 3 of c]).
struct StrideShift {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) StrideShift MakeStrideShift(
    size_t stride) {
  uint32_t basis[32];
  for (int bit = 0; bit < 32; ++bit) {
    uint64_t c = uint64_t{1} << bit;
    for (size_t i = 0; i < stride; i += 8) c = _mm_crc32_u64(c, 0);
    basis[bit] = static_cast<uint32_t>(c);
  }
  StrideShift shift{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t r = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if ((v >> bit) & 1) r ^= basis[8 * k + bit];
      }
      shift.t[k][v] = r;
    }
  }
  return shift;
}

inline uint32_t Shift(const StrideShift& z, uint32_t c) {
  return z.t[0][c & 0xff] ^ z.t[1][(c >> 8) & 0xff] ^
         z.t[2][(c >> 16) & 0xff] ^ z.t[3][c >> 24];
}

// Runs whole blocks of 3 x kStride bytes from *p, three chains each.
template <size_t kStride>
__attribute__((target("sse4.2"))) inline uint64_t Interleaved(
    uint64_t l64, const unsigned char*& p, size_t& n, const StrideShift& z) {
  while (n >= 3 * kStride) {
    uint64_t c0 = l64, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kStride; i += 8) {
      c0 = _mm_crc32_u64(c0, Load64(p + i));
      c1 = _mm_crc32_u64(c1, Load64(p + kStride + i));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * kStride + i));
    }
    uint32_t c =
        Shift(z, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c = Shift(z, c) ^ static_cast<uint32_t>(c2);
    l64 = c;
    p += 3 * kStride;
    n -= 3 * kStride;
  }
  return l64;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(uint32_t l,
                                                       const unsigned char* p,
                                                       size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    l = _mm_crc32_u8(l, *p++);
    --n;
  }
  uint64_t l64 = l;
  if (n >= 3 * kShortStride) {
    static const StrideShift long_shift = MakeStrideShift(kLongStride);
    static const StrideShift short_shift = MakeStrideShift(kShortStride);
    l64 = Interleaved<kLongStride>(l64, p, n, long_shift);
    l64 = Interleaved<kShortStride>(l64, p, n, short_shift);
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // x86 is little-endian, as the CRC wants
    l64 = _mm_crc32_u64(l64, v);
    p += 8;
    n -= 8;
  }
  l = static_cast<uint32_t>(l64);
  while (n > 0) {
    l = _mm_crc32_u8(l, *p++);
    --n;
  }
  return l;
}
#endif

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, absl::string_view data) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t n = data.size();
  const auto& t = kTables.t;
  uint32_t l = crc ^ 0xffffffffu;
  while (n >= 8) {
    const uint32_t lo = l ^ LoadLe32(p);
    const uint32_t hi = LoadLe32(p + 4);
    l = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^
        t[4][lo >> 24] ^ t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^
        t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    l = t[0][(l ^ *p++) & 0xff] ^ (l >> 8);
    --n;
  }
  return l ^ 0xffffffffu;
}

bool Crc32cHasHardware() {
#ifdef LOCALSGD_CRC32C_SSE42
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t Crc32c(uint32_t crc, absl::string_view data) {
#ifdef LOCALSGD_CRC32C_SSE42
  if (Crc32cHasHardware()) {
    return Crc32cSse42(crc ^ 0xffffffffu,
                       reinterpret_cast<const unsigned char*>(data.data()),
                       data.size()) ^
           0xffffffffu;
  }
#endif
  return Crc32cPortable(crc, data);
}

}  // namespace localsgd
