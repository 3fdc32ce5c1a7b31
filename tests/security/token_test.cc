// Per-job tokens on an in-process coordinator: missing and foreign tokens,
// reload, status visibility, and isolation between jobs (a member of job A
// holding A's token and A's member id attacks job B by every RPC; A's and
// B's averages stay exact).
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
using security_test::Channel;
using security_test::ExpectPairSyncsExactMean;
using security_test::JoinedClient;
using security_test::kElements;
using security_test::RandomToken;
using security_test::RawClient;
using security_test::StartServer;
using security_test::TempDir;

class TokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_a_ = RandomToken();
    token_b_ = RandomToken();
    token_file_ = dir_.Write("tokens", TokenFile(token_a_, token_b_));
    ServerOptions options = BaseServerOptions();
    options.token_file = token_file_;
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
  }

  static std::string TokenFile(const std::string& a, const std::string& b) {
    return absl::StrCat("# test jobs\njob-a ", a, "\njob-b ", b, "\n");
  }

  RawClient Raw(const std::string& token) {
    return RawClient(Channel(*server_), token);
  }

  ClientOptions Options(const std::string& job, const std::string& name,
                        const std::string& token) {
    ClientOptions o = BaseClientOptions(*server_, job, name);
    o.security.token = token;
    return o;
  }

  // Every RPC of `raw` for job/member must end with `code`.
  static void ExpectEveryRpc(RawClient& raw, const std::string& job,
                             const std::string& member, grpc::StatusCode code) {
    EXPECT_EQ(raw.Join(job, "intruder", nullptr).error_code(), code);
    EXPECT_EQ(raw.Heartbeat(job, member).error_code(), code);
    EXPECT_EQ(raw.FetchState(job, member).error_code(), code);
    EXPECT_EQ(raw.Sync(job, member, 1, std::vector<float>(kElements, 1e6f))
                  .error_code(),
              code);
    EXPECT_EQ(raw.Leave(job, member).error_code(), code);
    v1::GetJobStatusResponse status;
    EXPECT_EQ(raw.GetJobStatus(job, &status).error_code(), code);
    EXPECT_EQ(raw.DeleteJob(job).error_code(), code);
  }

  TempDir dir_;
  std::string token_a_, token_b_, token_file_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(TokenTest, NoToken_EveryRpc_ReturnsUnauthenticated) {
  RawClient a = Raw(token_a_);
  std::string member;
  ASSERT_TRUE(a.Join("job-a", "m", &member).ok());
  RawClient none = Raw("");
  ExpectEveryRpc(none, "job-a", member, grpc::StatusCode::UNAUTHENTICATED);
  v1::GetJobStatusResponse all;
  EXPECT_EQ(none.GetJobStatus("", &all).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Not a bearer token, or an empty one.
  none.set_authorization(absl::StrCat("Basic ", token_a_));
  EXPECT_EQ(none.Heartbeat("job-a", member).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  none.set_authorization("Bearer ");
  EXPECT_EQ(none.Heartbeat("job-a", member).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(a.Heartbeat("job-a", member).ok());
}

TEST_F(TokenTest, OtherJobsToken_EveryRpc_ReturnsPermissionDenied) {
  RawClient a = Raw(token_a_);
  std::string member;
  ASSERT_TRUE(a.Join("job-a", "m", &member).ok());
  RawClient b = Raw(token_b_);
  ExpectEveryRpc(b, "job-a", member, grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(a.Heartbeat("job-a", member).ok());
  // The message says what is wrong, and holds no token.
  const grpc::Status s = b.Heartbeat("job-a", member);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "not job job-a's token"))
      << s.error_message();
  EXPECT_FALSE(absl::StrContains(s.error_message(), token_a_));
  EXPECT_FALSE(absl::StrContains(s.error_message(), token_b_));
}

TEST_F(TokenTest, JobNotInTokenFile_IsRefusedEvenWithAValidToken) {
  RawClient a = Raw(token_a_);
  const grpc::Status s = a.Join("job-c", "m", nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(
      s.error_message(), "job job-c has no credentials in the token file"))
      << s.error_message();
  EXPECT_TRUE(server_->coordinator()->Jobs().empty());
}

TEST_F(TokenTest, RightToken_ClientJoinsAndSyncsExactMean) {
  auto m0 = JoinedClient(Options("job-a", "m0", token_a_));
  ClientOptions file_options = Options("job-a", "m1", "");
  file_options.security.token_file =
      dir_.Write("a.token", "  " + token_a_ + "\n");
  auto m1 = JoinedClient(file_options);
  ASSERT_NE(m0, nullptr);
  ASSERT_NE(m1, nullptr);
  ExpectPairSyncsExactMean(*m0, *m1);
}

TEST_F(TokenTest, ClientWithoutToken_JoinReturnsUnauthenticated) {
  auto client = Client::Create(Options("job-a", "m", ""));
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->Join(security_test::TestLayout()).code(),
            absl::StatusCode::kUnauthenticated);
  auto wrong = Client::Create(Options("job-a", "m", token_b_));
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->Join(security_test::TestLayout()).code(),
            absl::StatusCode::kPermissionDenied);
}

// What SIGHUP runs (CoordinatorServer::ReloadCredentials), in process.
TEST_F(TokenTest, Reload_RotatedToken_OldRefusedNewAcceptedMembersKept) {
  RawClient old_a = Raw(token_a_);
  std::string member;
  ASSERT_TRUE(old_a.Join("job-a", "m", &member).ok());
  const std::string new_a = RandomToken();
  dir_.Write("tokens", TokenFile(new_a, token_b_));
  ASSERT_TRUE(server_->ReloadCredentials().ok());
  EXPECT_EQ(old_a.Heartbeat("job-a", member).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // The member is bound to the job's token, not its value: it goes on with
  // the new token.
  RawClient rotated = Raw(new_a);
  EXPECT_TRUE(rotated.Heartbeat("job-a", member).ok());

  // A bad file keeps the tokens in force.
  dir_.Write("tokens", absl::StrCat("job-a ", RandomToken(), " junk\n"));
  const absl::Status bad = server_->ReloadCredentials();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), absl::StrCat(token_file_, ":1")))
      << bad;
  EXPECT_TRUE(rotated.Heartbeat("job-a", member).ok());
  EXPECT_EQ(old_a.Heartbeat("job-a", member).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(TokenTest, GetJobStatus_ShowsOnlyTheTokensJobsAndNoSecrets) {
  RawClient a = Raw(token_a_), b = Raw(token_b_);
  std::string ma, mb;
  ASSERT_TRUE(a.Join("job-a", "ma", &ma).ok());
  ASSERT_TRUE(b.Join("job-b", "mb", &mb).ok());

  v1::GetJobStatusResponse all;
  ASSERT_TRUE(a.GetJobStatus("", &all).ok());
  ASSERT_EQ(all.jobs_size(), 1);
  EXPECT_EQ(all.jobs(0).job_id(), "job-a");
  ASSERT_EQ(all.jobs(0).members_size(), 1);
  const v1::MemberStatus& m = all.jobs(0).members(0);
  EXPECT_EQ(m.member_name(), "ma");
  EXPECT_TRUE(m.GetReflection()->GetUnknownFields(m).empty());  // no field 1
  EXPECT_EQ(m.member_ref(), MemberRef(MemberId(ma)));
  EXPECT_EQ(m.member_ref().size(), 12u);
  const std::string dump = all.DebugString();
  EXPECT_FALSE(absl::StrContains(dump, ma));
  EXPECT_FALSE(absl::StrContains(dump, token_a_));

  v1::GetJobStatusResponse named;
  EXPECT_EQ(a.GetJobStatus("job-b", &named).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(b.GetJobStatus("job-b", &named).ok());
  ASSERT_EQ(named.jobs_size(), 1);
  EXPECT_FALSE(absl::StrContains(named.DebugString(), mb));

  // A token of no job sees nothing (and is not told more).
  RawClient stranger = Raw(RandomToken());
  v1::GetJobStatusResponse none;
  ASSERT_TRUE(stranger.GetJobStatus("", &none).ok());
  EXPECT_EQ(none.jobs_size(), 0);
}

// A member of job A (A's token, a valid member id of A) tries every RPC on
// job B, also naming B's members; B's and A's rounds stay exact.
TEST_F(TokenTest, Isolation_MemberOfAHasNoWayIntoB) {
  RawClient a = Raw(token_a_), b = Raw(token_b_);
  std::string a1, a2, b1;
  ASSERT_TRUE(a.Join("job-a", "a1", &a1).ok());
  ASSERT_TRUE(a.Join("job-a", "a2", &a2).ok());
  ASSERT_TRUE(b.Join("job-b", "b1", &b1).ok());
  ASSERT_TRUE(a.Sync("job-a", a1, 0, std::vector<float>(kElements, 0.0f)).ok());
  ASSERT_TRUE(b.Sync("job-b", b1, 0, std::vector<float>(kElements, 7.0f)).ok());

  const std::vector<float> poison(kElements, 1e6f);
  for (const std::string& member : {a1, b1}) {
    // A's token on job B, naming A's member and B's member.
    EXPECT_EQ(a.FetchState("job-b", member).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(a.Sync("job-b", member, 1, poison).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(a.Heartbeat("job-b", member).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(a.Leave("job-b", member).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(a.Join("job-b", "b1", nullptr).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::GetJobStatusResponse status;
  EXPECT_EQ(a.GetJobStatus("job-b", &status).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // B's member id under job A (where A's token is valid): unknown there.
  EXPECT_EQ(a.FetchState("job-a", b1).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(a.Sync("job-a", b1, 1, poison).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(a.Heartbeat("job-a", b1).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(a.Leave("job-a", b1).ok());  // Leave is idempotent
  EXPECT_TRUE(b.Heartbeat("job-b", b1).ok()) << "b1 must still be a member";

  // A's round 1: 1 and 3 give exactly 2. B's state is still its seed.
  std::vector<float> r1, r2, state_b;
  grpc::Status s1;
  std::thread t([&] {
    s1 = a.Sync("job-a", a1, 1, std::vector<float>(kElements, 1.0f), &r1);
  });
  const grpc::Status s2 =
      a.Sync("job-a", a2, 1, std::vector<float>(kElements, 3.0f), &r2);
  t.join();
  ASSERT_TRUE(s1.ok()) << s1.error_message();
  ASSERT_TRUE(s2.ok()) << s2.error_message();
  EXPECT_EQ(r1, std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(r2, std::vector<float>(kElements, 2.0f));
  ASSERT_TRUE(b.FetchState("job-b", b1, &state_b).ok());
  EXPECT_EQ(state_b, std::vector<float>(kElements, 7.0f));
  // B's next round is B's alone: exactly b1's values.
  std::vector<float> rb;
  ASSERT_TRUE(
      b.Sync("job-b", b1, 1, std::vector<float>(kElements, 5.0f), &rb).ok());
  EXPECT_EQ(rb, std::vector<float>(kElements, 5.0f));
}

}  // namespace
}  // namespace localsgd
