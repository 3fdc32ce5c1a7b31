// Transport security and per-job tokens of a client's channel to the
// coordinator (docs/security.md). gRPC only: no core, no LibTorch, so that
// tools (localsgdctl) use it too.
#ifndef LOCALSGD_CLIENT_CREDENTIALS_H_
#define LOCALSGD_CLIENT_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace localsgd {

struct ClientOptions;

// What secures a channel. All empty: plaintext, no token.
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
  // goes before field names in the message (e.g. "ClientOptions.", "--").
  absl::Status Validate(absl::string_view prefix = "") const;
};

// The ChannelSecurity fields of ClientOptions.
ChannelSecurity ChannelSecurityOf(const ClientOptions& options);

// TLS credentials from the PEM files (read now), or insecure ones without
// tls_ca_file. Ignores the token. INVALID_ARGUMENT naming an unreadable or
// malformed file.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const ChannelSecurity& security);

// The token of `security` (read from token_file now); empty without one.
// INVALID_ARGUMENT if the file cannot be read, is empty, or the token has
// spaces or non-printable characters. The message never holds the token.
absl::StatusOr<std::string> ReadBearerToken(const ChannelSecurity& security);

// A channel to `target` secured as `security` says, with `args` (plus the
// server name override). The token goes on every call: over TLS as call
// credentials (never sent without transport security); over plaintext by a
// client interceptor, after a WARNING that it travels in the clear (fine on
// loopback only; gRPC 1.51 refuses call credentials on insecure channels).
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateSecureChannel(
    const std::string& target, const ChannelSecurity& security,
    grpc::ChannelArguments args);

// CreateSecureChannel(options.target, ChannelSecurityOf(options), args).
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateCoordinatorChannel(
    const ClientOptions& options, const grpc::ChannelArguments& args);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_CREDENTIALS_H_
