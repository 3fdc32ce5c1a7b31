#include "client/channel_security.h"

#include "absl/strings/str_cat.h"

namespace localsgd {

absl::Status ChannelSecurity::Validate(absl::string_view prefix) const {
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "tls_cert_file and ", prefix,
        "tls_key_file go together (mutual TLS): give both or neither"));
  }
  if (tls_ca_file.empty() &&
      (!tls_cert_file.empty() || !tls_server_name.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "tls_cert_file / ", prefix, "tls_server_name need ", prefix,
        "tls_ca_file (the CA that signed the coordinator's certificate)"));
  }
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give ", prefix, "token or ", prefix, "token_file, not both"));
  }
  return absl::OkStatus();
}

}  // namespace localsgd
