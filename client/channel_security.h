// What secures a client's channel to the coordinator: TLS files and the
// job's bearer token (docs/security.md). A plain struct, gRPC-free, shared by
// ClientOptions, localsgdctl and the command-line flags of
// client/security_flags.h; client/credentials.h turns it into gRPC channel
// credentials.
#ifndef LOCALSGD_CLIENT_CHANNEL_SECURITY_H_
#define LOCALSGD_CLIENT_CHANNEL_SECURITY_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace localsgd {

// All empty: plaintext, no token.
struct ChannelSecurity {
  // PEM CA bundle that signed the coordinator's certificate. Non-empty: TLS.
  std::string tls_ca_file;
  // PEM client certificate and its unencrypted key, for mutual TLS. Both or
  // neither; need tls_ca_file.
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name the coordinator's certificate must carry, if not the target's
  // host name (e.g. connecting by IP address). Needs tls_ca_file.
  std::string tls_server_name;
  // Bearer token of the job, sent as `authorization: Bearer <token>` on every
  // call; or a file holding it (surrounding whitespace ignored). At most one.
  std::string token;
  std::string token_file;

  // INVALID_ARGUMENT naming the fields that do not go together; `prefix`
  // goes before field names in the message (e.g. "ClientOptions.security.").
  // Files are read when the channel is made.
  absl::Status Validate(absl::string_view prefix = "") const;
  // The same, with `name_of(field)` naming each field in the message (e.g.
  // the command-line flag that sets it).
  absl::Status Validate(
      const std::function<std::string(absl::string_view field)>& name_of) const;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_CHANNEL_SECURITY_H_
