#include "src/member_ref.h"

#include <openssl/evp.h>

#include <cstdlib>

namespace localsgd {

Digest Sha256(absl::string_view data) {
  Digest digest{};
  unsigned int size = 0;
  // EVP_Digest only fails on allocation failure.
  if (EVP_Digest(data.data(), data.size(), digest.data(), &size, EVP_sha256(),
                 nullptr) != 1 ||
      size != digest.size()) {
    std::abort();
  }
  return digest;
}

std::string ToHex(absl::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  return hex;
}

std::string MemberRef(const MemberId& member) {
  const Digest d = Sha256(member.str());
  return ToHex(absl::string_view(reinterpret_cast<const char*>(d.data()), 6));
}

}  // namespace localsgd
