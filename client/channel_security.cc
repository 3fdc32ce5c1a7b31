#include "client/channel_security.h"

#include "absl/strings/str_cat.h"

namespace localsgd {

absl::Status ChannelSecurity::Validate(absl::string_view prefix) const {
  return Validate([prefix](absl::string_view field) {
    return absl::StrCat(prefix, field);
  });
}

absl::Status ChannelSecurity::Validate(
    const std::function<std::string(absl::string_view field)>& name_of) const {
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_of("tls_cert_file"), " and ", name_of("tls_key_file"),
                     " go together (mutual TLS): give both or neither"));
  }
  if (tls_ca_file.empty() &&
      (!tls_cert_file.empty() || !tls_server_name.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_of("tls_cert_file"), " / ", name_of("tls_server_name"), " need ",
        name_of("tls_ca_file"),
        " (the CA that signed the coordinator's certificate)"));
  }
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("give ", name_of("token"), " or ", name_of("token_file"),
                     ", not both"));
  }
  return absl::OkStatus();
}

}  // namespace localsgd
