// The command-line flags of a client's transport security and token, defined
// once for every binary that talks to the coordinator (the worker,
// localsgdctl): --tls_ca, --tls_cert, --tls_key, --tls_server_name,
// --token_file. Link localsgd_security_flags to get them.
#ifndef LOCALSGD_CLIENT_SECURITY_FLAGS_H_
#define LOCALSGD_CLIENT_SECURITY_FLAGS_H_

#include "absl/status/statusor.h"
#include "client/channel_security.h"

namespace localsgd {

// The flags' values, validated (INVALID_ARGUMENT naming the flags that do
// not go together, e.g. "--tls_cert and --tls_key go together").
absl::StatusOr<ChannelSecurity> ChannelSecurityFromFlags();

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_SECURITY_FLAGS_H_
