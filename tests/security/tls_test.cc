// TLS and mutual TLS with certificates the test makes itself (openssl CLI):
// who gets in, who is refused, and members bound to their client certificate.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/security/security_util.h"

namespace localsgd {
namespace {

using security_test::BaseClientOptions;
using security_test::BaseServerOptions;
using security_test::Certs;
using security_test::Channel;
using security_test::ExpectPairSyncsExactMean;
using security_test::JoinedClient;
using security_test::kElements;
using security_test::RandomToken;
using security_test::RawClient;
using security_test::StartServer;
using security_test::TempDir;

std::string Cert(const std::string& name) { return Certs::Get().Path(name); }

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(Certs::Get().error(), ""); }

  // A coordinator with TLS; with `mutual`, client certificates of ca.pem
  // are required.
  void Start(bool mutual, const std::string& token_file = "") {
    ServerOptions options = BaseServerOptions();
    options.tls_cert_file = Cert("server.pem");
    options.tls_key_file = Cert("server.key");
    if (mutual) options.tls_client_ca_file = Cert("ca.pem");
    options.token_file = token_file;
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
  }

  // Channel security of a client trusting `ca`, presenting `client` (a
  // name of Certs; empty: no certificate).
  static ChannelSecurity Security(const std::string& ca,
                                  const std::string& client = "",
                                  const std::string& server_name = "") {
    ChannelSecurity s;
    s.tls_ca_file = Cert(ca + ".pem");
    if (!client.empty()) {
      s.tls_cert_file = Cert(client + ".pem");
      s.tls_key_file = Cert(client + ".key");
    }
    s.tls_server_name = server_name;
    return s;
  }

  // A Join over a channel secured by `security` must fail the handshake.
  void ExpectRefused(const ChannelSecurity& security) {
    RawClient raw(Channel(*server_, security));
    const grpc::Status status = raw.Join("job", "intruder", nullptr);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << status.error_message();
    // Nothing of the job was created.
    EXPECT_TRUE(server_->coordinator()->Jobs().empty());
  }

  ClientOptions Options(const std::string& name, const ChannelSecurity& s) {
    ClientOptions o = BaseClientOptions(*server_, "job", name);
    o.security = s;
    return o;
  }

  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(TlsTest, Tls_ClientTrustingTheCa_JoinsAndSyncsExactMean) {
  Start(/*mutual=*/false);
  auto a = JoinedClient(Options("a", Security("ca")));
  // The name checked may also be given explicitly.
  auto b = JoinedClient(Options("b", Security("ca", "", "localhost")));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ExpectPairSyncsExactMean(*a, *b);
}

TEST_F(TlsTest, Tls_PlaintextClient_IsRefused) {
  Start(false);
  ExpectRefused(ChannelSecurity{});
}

TEST_F(TlsTest, Tls_WrongServerName_IsRefused) {
  Start(false);
  ExpectRefused(Security("ca", "", "coordinator.example.com"));
}

TEST_F(TlsTest, Tls_ServerCertificateOfAnotherCa_IsRefused) {
  Start(false);
  ExpectRefused(Security("other_ca"));
}

TEST_F(TlsTest, MutualTls_RightClientCertificates_JoinAndSyncExactMean) {
  Start(/*mutual=*/true);
  auto a = JoinedClient(Options("a", Security("ca", "client_a")));
  auto b = JoinedClient(Options("b", Security("ca", "client_b")));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ExpectPairSyncsExactMean(*a, *b);
}

TEST_F(TlsTest, MutualTls_NoClientCertificate_IsRefused) {
  Start(true);
  ExpectRefused(Security("ca"));
}

TEST_F(TlsTest, MutualTls_ClientCertificateOfAnotherCa_IsRefused) {
  Start(true);
  // Same subject (CN=worker-a) as client_a, signed by the other CA.
  ExpectRefused(Security("ca", "other_client"));
}

TEST_F(TlsTest, MutualTls_WrongServerName_IsRefused) {
  Start(true);
  ExpectRefused(Security("ca", "client_a", "coordinator.example.com"));
}

TEST_F(TlsTest, MutualTls_PlaintextClient_IsRefused) {
  Start(true);
  ExpectRefused(ChannelSecurity{});
}

// A member is bound to the client certificate it joined with: another
// certificate of the same CA cannot act as it, and its round is unaffected.
TEST_F(TlsTest,
       MemberBinding_OtherCertificate_PermissionDeniedRoundUnaffected) {
  Start(true);
  RawClient x(Channel(*server_, Security("ca", "client_a")));
  RawClient y(Channel(*server_, Security("ca", "client_b")));
  std::string xid, yid;
  ASSERT_TRUE(x.Join("job", "x", &xid, /*incarnation=*/11).ok());
  ASSERT_TRUE(y.Join("job", "y", &yid, /*incarnation=*/12).ok());
  ASSERT_TRUE(x.Sync("job", xid, 0, std::vector<float>(kElements, 0.0f)).ok());

  // y's credentials (client_b) naming x.
  const std::vector<float> poison(kElements, 1e6f);
  EXPECT_EQ(y.Heartbeat("job", xid).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(y.FetchState("job", xid).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  const grpc::Status sync = y.Sync("job", xid, 1, poison);
  EXPECT_EQ(sync.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(
      absl::StrContains(sync.error_message(), "bound to other credentials"))
      << sync.error_message();
  EXPECT_EQ(y.Leave("job", xid).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Taking over x's name: the same incarnation would return x's id, a new
  // one would replace x.
  std::string stolen;
  EXPECT_EQ(y.Join("job", "x", &stolen, 11).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(stolen.empty());
  EXPECT_EQ(y.Join("job", "x", nullptr, 99).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // The same subject from another CA does not even connect.
  RawClient forged(Channel(*server_, Security("ca", "other_client")));
  EXPECT_EQ(forged.Heartbeat("job", xid).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  // x is still a member, and round 1 is x's 1 and y's 3: exactly 2.
  ASSERT_TRUE(x.Heartbeat("job", xid).ok());
  std::vector<float> rx, ry;
  grpc::Status sx;
  std::thread t([&] {
    sx = x.Sync("job", xid, 1, std::vector<float>(kElements, 1.0f), &rx);
  });
  const grpc::Status sy =
      y.Sync("job", yid, 1, std::vector<float>(kElements, 3.0f), &ry);
  t.join();
  ASSERT_TRUE(sx.ok()) << sx.error_message();
  ASSERT_TRUE(sy.ok()) << sy.error_message();
  EXPECT_EQ(rx, std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(ry, std::vector<float>(kElements, 2.0f));
  // And x itself may leave.
  EXPECT_TRUE(x.Leave("job", xid).ok());
}

TEST_F(TlsTest, TokenOverTls_SentAsCallCredentials) {
  TempDir dir;
  const std::string token = RandomToken();
  Start(false, dir.Write("tokens", absl::StrCat("job ", token, "\n")));
  ClientOptions with = Options("a", Security("ca"));
  with.security.token_file = dir.Write("a.token", token + "\n");
  auto a = JoinedClient(with);
  ASSERT_NE(a, nullptr);
  ClientOptions without = Options("b", Security("ca"));
  auto b = Client::Create(without);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Join(security_test::TestLayout()).code(),
            absl::StatusCode::kUnauthenticated);
}

// --- Bad TLS settings stop the start with a message naming them.

TEST_F(TlsTest, Start_UnreadableCertificate_InvalidArgumentNamingFlag) {
  ServerOptions options = BaseServerOptions();
  options.tls_cert_file = "/nonexistent/server.pem";
  options.tls_key_file = Cert("server.key");
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(server.status().message(), "--tls_cert"));
  EXPECT_TRUE(
      absl::StrContains(server.status().message(), "/nonexistent/server.pem"));
}

TEST_F(TlsTest, Start_KeyOfAnotherCertificate_InvalidArgumentNamingFlags) {
  ServerOptions options = BaseServerOptions();
  options.tls_cert_file = Cert("server.pem");
  options.tls_key_file = Cert("client_a.key");
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(server.status().message(), "--tls_key"))
      << server.status();
}

TEST_F(TlsTest, Start_ClientCaNotPem_InvalidArgumentNamingFlag) {
  ServerOptions options = BaseServerOptions();
  options.tls_cert_file = Cert("server.pem");
  options.tls_key_file = Cert("server.key");
  options.tls_client_ca_file = Cert("server.key");  // a key, not a cert
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::StrContains(server.status().message(), "--tls_client_ca"))
      << server.status();
}

TEST_F(TlsTest, Validate_HalfTlsSettings_ReturnInvalidArgument) {
  ServerOptions options = BaseServerOptions();
  options.tls_cert_file = Cert("server.pem");
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  options = BaseServerOptions();
  options.tls_client_ca_file = Cert("ca.pem");
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);

  ClientOptions client;
  client.target = "127.0.0.1:1";
  client.job_id = "job";
  client.security.tls_cert_file = Cert("client_a.pem");
  client.security.tls_key_file = Cert("client_a.key");
  EXPECT_EQ(client.Validate().code(), absl::StatusCode::kInvalidArgument);
  client.security.tls_ca_file = Cert("ca.pem");
  EXPECT_TRUE(client.Validate().ok());
  client.security.token = "x";
  client.security.token_file = "/x";
  EXPECT_EQ(client.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TlsTest, ClientCreate_MissingCaFile_InvalidArgumentNamingOption) {
  ClientOptions client;
  client.target = "127.0.0.1:1";
  client.job_id = "job";
  client.security.tls_ca_file = "/nonexistent/ca.pem";
  auto created = Client::Create(client);
  ASSERT_FALSE(created.ok());
  EXPECT_TRUE(absl::StrContains(created.status().message(), "tls_ca_file"));
  client.security.tls_ca_file = Cert("server.key");  // not a certificate
  created = Client::Create(client);
  ASSERT_FALSE(created.ok());
  EXPECT_TRUE(absl::StrContains(created.status().message(), "CERTIFICATE"));
}

}  // namespace
}  // namespace localsgd
