// SHA-256 and the member reference that status and every log line show in
// place of a member's id (the id is the member's credential within its job).
// Both sides use it: the core and the client log references, the server's
// status shows them, the security layer hashes tokens.
#ifndef LOCALSGD_SRC_MEMBER_REF_H_
#define LOCALSGD_SRC_MEMBER_REF_H_

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

#endif  // LOCALSGD_SRC_MEMBER_REF_H_
