#include "server/auth.h"

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "glog/logging.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/server_context.h"
#include "src/coordinator.h"

namespace localsgd {
namespace {

constexpr char kSha256Prefix[] = "sha256:";
constexpr size_t kMaxFileBytes = 1 << 20;
// Shorter plain tokens are accepted with a warning.
constexpr size_t kMinTokenLength = 16;

bool IsTokenChar(char c) { return c > 0x20 && c < 0x7f; }

absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read ", what, " '", path, "': ", std::strerror(errno)));
  }
  std::string contents;
  contents.resize(kMaxFileBytes + 1);
  in.read(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", what, " '", path, "'"));
  }
  contents.resize(static_cast<size_t>(in.gcount()));
  if (contents.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", path, "' is larger than ", kMaxFileBytes, " bytes"));
  }
  return contents;
}

// "Bearer <token>" -> token (the scheme is case-insensitive, RFC 6750).
std::optional<absl::string_view> BearerToken(absl::string_view value) {
  value = absl::StripAsciiWhitespace(value);
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return std::nullopt;
  }
  absl::string_view token =
      absl::StripLeadingAsciiWhitespace(value.substr(kScheme.size()));
  if (token.empty()) return std::nullopt;
  return token;
}

// The digest of the caller's token, or UNAUTHENTICATED.
absl::StatusOr<Digest> PresentedDigest(const CallerCredentials& caller) {
  if (caller.ambiguous) {
    return absl::UnauthenticatedError(
        "the call carries more than one 'authorization' metadata entry");
  }
  if (!caller.authorization.has_value()) {
    return absl::UnauthenticatedError(
        "this coordinator requires a per-job token: send the metadata "
        "'authorization: Bearer <token>' (client option token / token_file)");
  }
  std::optional<absl::string_view> token = BearerToken(*caller.authorization);
  if (!token.has_value()) {
    return absl::UnauthenticatedError(
        "the 'authorization' metadata is not of the form 'Bearer <token>'");
  }
  return Sha256(*token);
}

bool SameDigest(const Digest& a, const Digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "unknown error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyDeleter>;

BioPtr MemBio(absl::string_view data) {
  return BioPtr(BIO_new_mem_buf(data.data(), static_cast<int>(data.size())));
}

}  // namespace

CallerCredentials CallerFromContext(const grpc::ServerContextBase& context) {
  CallerCredentials caller;
  const auto& metadata = context.client_metadata();
  auto [begin, end] = metadata.equal_range("authorization");
  for (auto it = begin; it != end; ++it) {
    if (caller.authorization.has_value()) caller.ambiguous = true;
    caller.authorization.emplace(it->second.data(), it->second.size());
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> subject =
        auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
    if (!subject.empty() && !subject.front().empty()) {
      caller.peer.assign(subject.front().data(), subject.front().size());
    } else {
      const std::vector<grpc::string_ref> pem =
          auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
      if (!pem.empty()) {
        const Digest d =
            Sha256(absl::string_view(pem.front().data(), pem.front().size()));
        caller.peer = absl::StrCat(
            kSha256Prefix,
            ToHex(absl::string_view(reinterpret_cast<const char*>(d.data()),
                                    d.size())));
      }
    }
  }
  return caller;
}

std::string Principal::BindingKey() const {
  if (token_job.empty() && peer.empty()) return "";
  return absl::StrCat("token=", token_job, ";cert=", peer);
}

absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view contents,
                                          absl::string_view source) {
  TokenTable table;
  absl::flat_hash_map<std::string, int> line_of;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    // Never quote the line in an error: it may hold a token.
    const std::string where = absl::StrCat(source, ":", line_number, ": ");
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          "expected '<job_id> <token>' or '<job_id> sha256:<64 hex "
          "digits>'; found ",
          fields.size(), " fields"));
    }
    if (absl::Status s = ValidateJobId(fields[0]); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "bad job id: ", s.message()));
    }
    const std::string job(fields[0]);
    if (auto it = line_of.find(job); it != line_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "second entry for the job of line ", it->second,
                       "; one token per job"));
    }
    const absl::string_view secret = fields[1];
    Digest digest{};
    if (absl::StartsWith(secret, kSha256Prefix)) {
      const absl::string_view hex = secret.substr(strlen(kSha256Prefix));
      bool ok = hex.size() == 64;
      for (size_t i = 0; ok && i < 32; ++i) {
        auto nibble = [](char c) -> int {
          if (c >= '0' && c <= '9') return c - '0';
          if (c >= 'a' && c <= 'f') return c - 'a' + 10;
          if (c >= 'A' && c <= 'F') return c - 'A' + 10;
          return -1;
        };
        const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
        ok = hi >= 0 && lo >= 0;
        digest[i] = static_cast<uint8_t>(hi * 16 + lo);
      }
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "'sha256:' must be followed by exactly 64 hex digits"));
      }
    } else {
      for (char c : secret) {
        if (!IsTokenChar(c)) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, "a token may hold only printable ASCII without spaces"));
        }
      }
      if (secret.size() < kMinTokenLength) {
        LOG(WARNING) << where << "the token of job " << job << " is shorter "
                     << "than " << kMinTokenLength << " characters; use e.g. "
                     << "`openssl rand -hex 32`";
      }
      digest = Sha256(secret);
    }
    line_of[job] = line_number;
    table[job] = digest;
  }
  return table;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    std::string token_file) {
  std::unique_ptr<Authenticator> auth(new Authenticator(std::move(token_file)));
  if (!auth->tokens_enabled()) return auth;
  absl::StatusOr<std::shared_ptr<const TokenTable>> table = auth->ReadTable();
  if (!table.ok()) return table.status();
  {
    absl::MutexLock lock(&auth->mu_);
    auth->table_ = *std::move(table);
  }
  LOG(INFO) << "per-job tokens: " << auth->num_jobs() << " jobs in "
            << auth->token_file_ << "; calls without a job's token are "
            << "refused";
  return auth;
}

absl::StatusOr<std::shared_ptr<const TokenTable>> Authenticator::ReadTable()
    const {
  absl::StatusOr<std::string> contents =
      ReadSmallFile(token_file_, "token file (--token_file)");
  if (!contents.ok()) return contents.status();
  absl::StatusOr<TokenTable> table = ParseTokenFile(*contents, token_file_);
  if (!table.ok()) return table.status();
  struct stat st;
  if (stat(token_file_.c_str(), &st) == 0 && (st.st_mode & S_IROTH) != 0) {
    LOG(WARNING) << "token file " << token_file_
                 << " is readable by every user; chmod o-r it";
  }
  return std::make_shared<const TokenTable>(*std::move(table));
}

absl::Status Authenticator::Reload() {
  if (!tokens_enabled()) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<const TokenTable>> table = ReadTable();
  if (!table.ok()) {
    return absl::Status(table.status().code(),
                        absl::StrCat(table.status().message(), "; keeping the ",
                                     num_jobs(), " job tokens loaded before"));
  }
  size_t jobs;
  {
    absl::MutexLock lock(&mu_);
    table_ = *std::move(table);
    jobs = table_->size();
  }
  LOG(INFO) << "per-job tokens reloaded: " << jobs << " jobs in "
            << token_file_;
  return absl::OkStatus();
}

std::shared_ptr<const TokenTable> Authenticator::table() const {
  absl::MutexLock lock(&mu_);
  return table_;
}

size_t Authenticator::num_jobs() const {
  std::shared_ptr<const TokenTable> t = table();
  return t == nullptr ? 0 : t->size();
}

absl::StatusOr<Principal> Authenticator::Authorize(
    const CallerCredentials& caller, absl::string_view job_id) const {
  Principal principal;
  principal.peer = caller.peer;
  if (!tokens_enabled()) return principal;
  absl::StatusOr<Digest> presented = PresentedDigest(caller);
  if (!presented.ok()) return presented.status();
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  std::shared_ptr<const TokenTable> t = table();
  auto it = t->find(job_id);
  if (it == t->end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job ", job_id,
        " has no credentials in the token file; a job needs a token once "
        "tokens are configured (ask the operator to add it)"));
  }
  if (!SameDigest(it->second, *presented)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the presented token is not job ", job_id, "'s token"));
  }
  principal.token_job = std::string(job_id);
  return principal;
}

absl::Status Authenticator::Authenticate(
    const CallerCredentials& caller) const {
  if (!tokens_enabled()) return absl::OkStatus();
  return PresentedDigest(caller).status();
}

bool Authenticator::MayAccess(const CallerCredentials& caller,
                              absl::string_view job_id) const {
  return Authorize(caller, job_id).ok();
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path,
                                        absl::string_view setting,
                                        PemKind what) {
  const std::string name = absl::StrCat(setting, " file");
  absl::StatusOr<std::string> pem = ReadSmallFile(path, name);
  if (!pem.ok()) return pem.status();
  BioPtr bio = MemBio(*pem);
  if (what == PemKind::kCertificates) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " '", path, "' holds no PEM certificate (",
                       OpenSslError(), ")"));
    }
  } else {
    KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (key == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " '", path, "' holds no unencrypted PEM private key (",
          OpenSslError(), ")"));
    }
  }
  ERR_clear_error();
  return pem;
}

absl::Status CheckKeyMatchesCertificate(absl::string_view cert_pem,
                                        absl::string_view key_pem,
                                        absl::string_view cert_setting,
                                        absl::string_view key_setting) {
  BioPtr cert_bio = MemBio(cert_pem);
  BioPtr key_bio = MemBio(key_pem);
  X509Ptr cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  KeyPtr key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr || key == nullptr ||
      X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("the private key of ", key_setting,
                     " does not belong to the (first) "
                     "certificate of ",
                     cert_setting));
  }
  return absl::OkStatus();
}

}  // namespace localsgd
