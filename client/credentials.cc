#include "client/credentials.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/support/interceptor.h"

namespace localsgd {
namespace {

constexpr size_t kMaxFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     absl::string_view setting) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read ", setting, " file '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad() || contents.str().size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        setting, " file '", path, "' cannot be read or is over 1 MiB"));
  }
  return contents.str();
}

// Reads a PEM file and checks that it holds a block of the `kind` (e.g.
// "CERTIFICATE", "PRIVATE KEY"); TLS itself verifies the rest.
absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    absl::string_view setting,
                                    absl::string_view kind) {
  absl::StatusOr<std::string> pem = ReadFile(path, setting);
  if (!pem.ok()) return pem.status();
  if (!absl::StrContains(*pem, "-----BEGIN ") ||
      !absl::StrContains(*pem, absl::StrCat(kind, "-----"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        setting, " file '", path, "' holds no PEM ", kind, " block"));
  }
  return pem;
}

// Sends the token with every call on a plaintext channel.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::shared_ptr<const std::string> header)
      : header_(std::move(header)) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  std::shared_ptr<const std::string> header_;
};

class BearerInterceptorFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::shared_ptr<const std::string> header)
      : header_(std::move(header)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new BearerInterceptor(header_);
  }

 private:
  std::shared_ptr<const std::string> header_;
};

// Sends the token with every call on a TLS channel.
class BearerPlugin : public grpc::MetadataCredentialsPlugin {
 public:
  explicit BearerPlugin(std::string header) : header_(std::move(header)) {}
  bool IsBlocking() const override { return false; }
  const char* GetType() const override { return "localsgd-bearer-token"; }
  grpc::Status GetMetadata(
      grpc::string_ref service_url, grpc::string_ref method_name,
      const grpc::AuthContext& channel_auth_context,
      std::multimap<std::string, std::string>* metadata) override {
    metadata->emplace("authorization", header_);
    return grpc::Status::OK;
  }
  std::string DebugString() override {
    return "localsgd bearer token (not shown)";
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const ChannelSecurity& security) {
  if (absl::Status s = security.Validate(); !s.ok()) return s;
  if (security.tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca =
      ReadPem(security.tls_ca_file, "tls_ca_file", "CERTIFICATE");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!security.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert =
        ReadPem(security.tls_cert_file, "tls_cert_file", "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key =
        ReadPem(security.tls_key_file, "tls_key_file", "PRIVATE KEY");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::string> ReadBearerToken(const ChannelSecurity& security) {
  std::string token = security.token;  // empty: no token
  if (!security.token_file.empty()) {
    absl::StatusOr<std::string> contents =
        ReadFile(security.token_file, "token_file");
    if (!contents.ok()) return contents.status();
    token = std::string(absl::StripAsciiWhitespace(*contents));
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token_file '", security.token_file, "' holds no token"));
    }
  }
  for (char c : token) {
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          "the token holds spaces or non-printable characters; it must be "
          "one word of printable ASCII");
    }
  }
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateSecureChannel(
    const std::string& target, const ChannelSecurity& security,
    grpc::ChannelArguments args) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(security);
  if (!credentials.ok()) return credentials.status();
  absl::StatusOr<std::string> token = ReadBearerToken(security);
  if (!token.ok()) return token.status();
  if (!security.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(security.tls_server_name);
  }
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials =
      *std::move(credentials);
  if (token->empty()) {
    return grpc::CreateCustomChannel(target, channel_credentials, args);
  }
  const std::string header = absl::StrCat("Bearer ", *token);
  if (!security.tls_ca_file.empty()) {
    // Call credentials: gRPC sends them only over a secure transport.
    channel_credentials = grpc::CompositeChannelCredentials(
        channel_credentials, grpc::MetadataCredentialsFromPlugin(
                                 std::make_unique<BearerPlugin>(header)));
    return grpc::CreateCustomChannel(target, channel_credentials, args);
  }
  LOG(WARNING) << "sending the job token to " << target
               << " over plaintext: anyone on the path can read it. Use TLS "
                  "(tls_ca_file) unless the coordinator is on loopback";
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<BearerInterceptorFactory>(
      std::make_shared<const std::string>(header)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, channel_credentials, args, std::move(interceptors));
}

}  // namespace localsgd
