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
// The SSE4.2 crc32 instruction computes exactly CRC32C. One dependent chain
// of 8-byte steps runs at several GB/s, well above what the disk takes.
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(uint32_t l,
                                                       const unsigned char* p,
                                                       size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    l = _mm_crc32_u8(l, *p++);
    --n;
  }
  uint64_t l64 = l;
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
