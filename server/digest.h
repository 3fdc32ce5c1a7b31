// SHA-256 and the member reference status shows in place of a member's id.
// gRPC-free: the protocol layer (server/protocol.h) and the security layer
// (server/auth.h) both use it.
#ifndef LOCALSGD_SERVER_DIGEST_H_
#define LOCALSGD_SERVER_DIGEST_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "src/types.h"

namespace localsgd {

// SHA-256 digest.
using Digest = std::array<uint8_t, 32>;
Digest Sha256(absl::string_view data);
// Lower-case hex of `bytes`.
std::string ToHex(absl::string_view bytes);

// A reference to a member that status may show without letting the reader
// act as the member: the first 12 hex digits of SHA-256(member id).
std::string MemberRef(const MemberId& member);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_DIGEST_H_
