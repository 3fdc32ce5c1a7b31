// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of
// checkpoint files and of every chunk on the wire.
#ifndef LOCALSGD_SRC_CRC32C_H_
#define LOCALSGD_SRC_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace localsgd {

// CRC32C of `data` continued from `crc`, the CRC32C of the bytes before it (0
// for none): Crc32c(Crc32c(0, a), b) == Crc32c(0, a + b). Uses the SSE4.2
// instruction where the CPU has it (several GB/s on one core).
uint32_t Crc32c(uint32_t crc, absl::string_view data);
// The same, table-driven (slicing-by-8), on every CPU.
uint32_t Crc32cPortable(uint32_t crc, absl::string_view data);
// Whether Crc32c uses a CPU instruction.
bool Crc32cHasHardware();

}  // namespace localsgd

#endif  // LOCALSGD_SRC_CRC32C_H_
