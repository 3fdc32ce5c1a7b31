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
#include "client/channel_security.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace localsgd {

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

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_CREDENTIALS_H_
