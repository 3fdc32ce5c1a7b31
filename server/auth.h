// Who may call the coordinator for which job: per-job bearer tokens (the
// token file), the identity of a client certificate (mutual TLS), and the
// PEM files of transport security. See docs/security.md.
//
// The token file has one line per job:
//
//   # comment lines and blank lines are ignored
//   <job_id> <token>                 the token itself (printable ASCII, no
//                                    spaces)
//   <job_id> sha256:<64 hex digits>  the SHA-256 of the token, so that the
//                                    file need not hold the token
//
// Once a token file is configured every call needs the metadata
// `authorization: Bearer <token>`, and the token must be the named job's.
// Tokens are kept only as SHA-256 digests and compared in constant time; they
// never appear in a log line, a status message or a metric.
//
// Everything here but CallerFromContext is free of gRPC, so that it can be
// tested without a server.
#ifndef LOCALSGD_SERVER_AUTH_H_
#define LOCALSGD_SERVER_AUTH_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "src/member_ref.h"
#include "src/types.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace localsgd {

// What one call presents, read from its gRPC context (CallerFromContext).
struct CallerCredentials {
  // The value of the `authorization` metadata; nullopt if the call has none.
  std::optional<std::string> authorization;
  // The call carried more than one `authorization` entry (refused).
  bool ambiguous = false;
  // The verified client certificate's identity (mutual TLS): its subject, or
  // "sha256:<hex>" of the certificate if it has no subject. Empty without a
  // client certificate.
  std::string peer;
};

// Reads the `authorization` metadata and the client certificate's identity
// of a call. Does not block.
CallerCredentials CallerFromContext(const grpc::ServerContextBase& context);

// Whom a call was authorized as.
struct Principal {
  // The job whose token the call presented; empty without a token file.
  std::string token_job;
  // CallerCredentials::peer.
  std::string peer;

  // What a member is bound to at Join (JoinRequestParams::principal): empty
  // when neither tokens nor client certificates are in use, so that every
  // call matches. Holds no secret.
  std::string BindingKey() const;
};

// The parsed token file: job id -> SHA-256 of its token.
using TokenTable = absl::flat_hash_map<std::string, Digest>;

// Parses the contents of a token file. INVALID_ARGUMENT naming `source` and
// the line; the message never quotes the line (it may hold a token).
absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view contents,
                                          absl::string_view source);

// The token file and the checks made with it. Thread-safe: Reload may run
// while calls are authorized; each call sees the old or the new table whole.
class Authenticator {
 public:
  // Reads `token_file`. Empty: no tokens, every call is authorized (with the
  // principal of its client certificate, if any). INVALID_ARGUMENT if the file
  // cannot be read or does not parse (the message names the file and line).
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      std::string token_file);

  // Reads the token file again (SIGHUP). On error keeps the tokens it had and
  // returns the error; OK and no-op without a token file.
  absl::Status Reload();

  // Whether a token file is configured.
  bool tokens_enabled() const { return !token_file_.empty(); }
  const std::string& token_file() const { return token_file_; }
  // Jobs in the current table.
  size_t num_jobs() const;

  // Authorizes a call for `job_id`. Without a token file: OK (the principal
  // carries only the certificate identity). With one:
  //   UNAUTHENTICATED     no `authorization` metadata, more than one, or not
  //                       "Bearer <token>";
  //   INVALID_ARGUMENT    malformed job id;
  //   PERMISSION_DENIED   the job is not in the token file, or the token is
  //                       not the job's.
  absl::StatusOr<Principal> Authorize(const CallerCredentials& caller,
                                      absl::string_view job_id) const;

  // For listing jobs: UNAUTHENTICATED as above (OK without a token file).
  absl::Status Authenticate(const CallerCredentials& caller) const;
  // Whether the caller's token is `job_id`'s (true without a token file).
  bool MayAccess(const CallerCredentials& caller,
                 absl::string_view job_id) const;

 private:
  explicit Authenticator(std::string token_file)
      : token_file_(std::move(token_file)) {}
  absl::StatusOr<std::shared_ptr<const TokenTable>> ReadTable() const;
  std::shared_ptr<const TokenTable> table() const;

  const std::string token_file_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
};

// Reads a PEM file for a TLS setting and checks that it holds what it should:
// `what` is kCertificates (one or more certificates) or kPrivateKey.
// INVALID_ARGUMENT naming `setting` (e.g. "--tls_cert") and the file.
enum class PemKind { kCertificates, kPrivateKey };
absl::StatusOr<std::string> ReadPemFile(const std::string& path,
                                        absl::string_view setting,
                                        PemKind what);

// INVALID_ARGUMENT unless `key_pem` is the private key of the first
// certificate of `cert_pem`.
absl::Status CheckKeyMatchesCertificate(absl::string_view cert_pem,
                                        absl::string_view key_pem,
                                        absl::string_view cert_setting,
                                        absl::string_view key_setting);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_AUTH_H_
