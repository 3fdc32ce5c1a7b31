// Unit tests of the credential checks without a server: the token file,
// Authenticator (tokens, reload), member references, the member binding and
// the Join rate limit of the core (fake clock, no sleeps).
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "src/clock.h"
#include "src/coordinator.h"
#include "tests/security/security_util.h"

namespace localsgd {
namespace {

using security_test::RandomToken;
using security_test::TempDir;
using security_test::TestLayout;

std::string Sha256Hex(const std::string& s) {
  const Digest d = Sha256(s);
  return ToHex(
      absl::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

CallerCredentials Bearer(const std::string& token) {
  CallerCredentials c;
  c.authorization = absl::StrCat("Bearer ", token);
  return c;
}

// --- The token file.

TEST(TokenFileTest, Parse_CommentsBlankLinesAndDigests_AreAccepted) {
  const std::string t1 = RandomToken(), t2 = RandomToken();
  absl::StatusOr<TokenTable> table = ParseTokenFile(
      absl::StrCat("# jobs of team x\n\n  job-a   ", t1, "  \n\tjob.b\tsha256:",
                   absl::AsciiStrToUpper(Sha256Hex(t2)), "\n# end"),
      "tokens.txt");
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->size(), 2u);
  EXPECT_EQ(table->at("job-a"), Sha256(t1));
  EXPECT_EQ(table->at("job.b"), Sha256(t2));
}

struct BadLine {
  std::string name;
  std::string line;  // the third line of the file
  std::string expect;
};

class TokenFileBadLineTest : public ::testing::TestWithParam<BadLine> {};

TEST_P(TokenFileBadLineTest, Parse_BadLine_NamesFileAndLineButNotTheLine) {
  const std::string secret = "s3cr3t-value-0123456789";
  const std::string line =
      absl::StrReplaceAll(GetParam().line, {{"SECRET", secret}});
  absl::StatusOr<TokenTable> table = ParseTokenFile(
      absl::StrCat("# header\njob-a ", RandomToken(), "\n", line, "\n"),
      "/etc/t.txt");
  ASSERT_FALSE(table.ok());
  EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(table.status().message());
  EXPECT_TRUE(absl::StartsWith(message, "/etc/t.txt:3: ")) << message;
  EXPECT_TRUE(absl::StrContains(message, GetParam().expect)) << message;
  EXPECT_FALSE(absl::StrContains(message, secret)) << message;
  EXPECT_FALSE(absl::StrContains(message, "s3cr3t")) << message;
}

INSTANTIATE_TEST_SUITE_P(
    Lines, TokenFileBadLineTest,
    ::testing::Values(
        BadLine{"OneField", "SECRET", "found 1 fields"},
        BadLine{"ThreeFields", "job-b SECRET extra", "found 3 fields"},
        BadLine{"BadJobId", "job/b SECRET", "bad job id"},
        BadLine{"Duplicate", "job-a SECRET", "second entry for the job of "
                                             "line 2"},
        BadLine{"ShortDigest", "job-b sha256:abcd", "exactly 64 hex digits"},
        BadLine{"NonHexDigest", absl::StrCat("job-b sha256:", std::string(63, 'a'), "g"),
                "exactly 64 hex digits"},
        BadLine{"ControlCharacter", "job-b SECRET\x01", "printable ASCII"}),
    [](const ::testing::TestParamInfo<BadLine>& info) {
      return info.param.name;
    });

// --- Authorize.

class AuthenticatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_a_ = RandomToken();
    token_b_ = RandomToken();
    path_ = dir_.Write("tokens", absl::StrCat("a ", token_a_, "\nb sha256:",
                                              Sha256Hex(token_b_), "\n"));
    auto auth = Authenticator::Create(path_);
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = *std::move(auth);
  }

  TempDir dir_;
  std::string path_, token_a_, token_b_;
  std::unique_ptr<Authenticator> auth_;
};

TEST_F(AuthenticatorTest, Authorize_NoAuthorization_ReturnsUnauthenticated) {
  EXPECT_EQ(auth_->Authorize(CallerCredentials{}, "a").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth_->Authenticate(CallerCredentials{}).code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(AuthenticatorTest, Authorize_NotBearerOrEmpty_ReturnsUnauthenticated) {
  for (const std::string value :
       {std::string("Basic ") + token_a_, token_a_, std::string("Bearer "),
        std::string("Bearer")}) {
    CallerCredentials c;
    c.authorization = value;
    EXPECT_EQ(auth_->Authorize(c, "a").status().code(),
              absl::StatusCode::kUnauthenticated)
        << value;
  }
}

TEST_F(AuthenticatorTest, Authorize_TwoAuthorizationEntries_Unauthenticated) {
  CallerCredentials c = Bearer(token_a_);
  c.ambiguous = true;
  EXPECT_EQ(auth_->Authorize(c, "a").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(AuthenticatorTest, Authorize_OtherJobsToken_ReturnsPermissionDenied) {
  absl::StatusOr<Principal> p = auth_->Authorize(Bearer(token_b_), "a");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(absl::StrContains(p.status().message(), token_b_));
  EXPECT_FALSE(absl::StrContains(p.status().message(), token_a_));
  EXPECT_FALSE(auth_->MayAccess(Bearer(token_b_), "a"));
}

TEST_F(AuthenticatorTest, Authorize_JobNotInFile_ReturnsPermissionDenied) {
  absl::StatusOr<Principal> p = auth_->Authorize(Bearer(token_a_), "c");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(p.status().message(),
                                "job c has no credentials in the token file"))
      << p.status();
}

TEST_F(AuthenticatorTest, Authorize_RightTokens_ReturnPrincipalOfTheJob) {
  absl::StatusOr<Principal> a = auth_->Authorize(Bearer(token_a_), "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->token_job, "a");
  // A digest line accepts the token whose SHA-256 it holds; the scheme is
  // case-insensitive.
  CallerCredentials lower;
  lower.authorization = absl::StrCat("bearer ", token_b_);
  absl::StatusOr<Principal> b = auth_->Authorize(lower, "b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(a->BindingKey(), b->BindingKey());
  EXPECT_FALSE(absl::StrContains(a->BindingKey(), token_a_));
  // A prefix or an extension of the token is another token.
  EXPECT_FALSE(auth_->MayAccess(Bearer(token_a_.substr(1)), "a"));
  EXPECT_FALSE(auth_->MayAccess(Bearer(token_a_ + "0"), "a"));
}

TEST_F(AuthenticatorTest, Reload_NewFile_RotatesTokens) {
  const std::string token_a2 = RandomToken();
  dir_.Write("tokens", absl::StrCat("a ", token_a2, "\n"));
  ASSERT_TRUE(auth_->Reload().ok());
  EXPECT_EQ(auth_->Authorize(Bearer(token_a_), "a").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(auth_->Authorize(Bearer(token_a2), "a").ok());
  // b was dropped from the file: refused now.
  EXPECT_EQ(auth_->Authorize(Bearer(token_b_), "b").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(AuthenticatorTest, Reload_BadFile_KeepsOldTokensAndNamesLine) {
  const std::string leaked = RandomToken();
  dir_.Write("tokens", absl::StrCat("a ", RandomToken(), "\n", leaked, "\n"));
  absl::Status s = auth_->Reload();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(path_, ":2:")))
      << s;
  EXPECT_FALSE(absl::StrContains(s.message(), leaked)) << s;
  EXPECT_TRUE(auth_->Authorize(Bearer(token_a_), "a").ok());
  EXPECT_TRUE(auth_->Authorize(Bearer(token_b_), "b").ok());

  std::filesystem::remove(path_);
  EXPECT_EQ(auth_->Reload().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(auth_->Authorize(Bearer(token_a_), "a").ok());
}

TEST(AuthenticatorCreateTest, Create_MissingFile_NamesFlagAndFile) {
  auto auth = Authenticator::Create("/nonexistent/tokens.txt");
  ASSERT_FALSE(auth.ok());
  EXPECT_TRUE(absl::StrContains(auth.status().message(), "--token_file"));
  EXPECT_TRUE(
      absl::StrContains(auth.status().message(), "/nonexistent/tokens.txt"));
}

TEST(AuthenticatorCreateTest, NoTokenFile_AuthorizesEveryCall) {
  auto auth = Authenticator::Create("");
  ASSERT_TRUE(auth.ok());
  CallerCredentials c;
  c.peer = "CN=x";
  absl::StatusOr<Principal> p = (*auth)->Authorize(c, "any");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->BindingKey(), (Principal{"", "CN=x"}).BindingKey());
  EXPECT_EQ(Principal{}.BindingKey(), "");
  EXPECT_TRUE((*auth)->Reload().ok());
}

TEST(MemberRefTest, MemberRef_IsTwelveHexDigitsNotFromTheId) {
  const MemberId id("0123456789abcdef0123456789abcdef");
  const std::string ref = MemberRef(id);
  EXPECT_EQ(ref.size(), 12u);
  EXPECT_EQ(ref.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_FALSE(absl::StrContains(id.str(), ref));
  EXPECT_NE(ref, MemberRef(MemberId("1123456789abcdef0123456789abcdef")));
}

// --- The core: member binding and Join rate.

class CoreSecurityTest : public ::testing::Test {
 protected:
  void Make(double rate, uint32_t burst) {
    CoordinatorOptions options;
    options.clock = &clock_;
    options.default_settings.chunk_elements = security_test::kChunk;
    options.max_join_rate = rate;
    options.join_burst = burst;
    auto c = Coordinator::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
  }
  absl::StatusOr<JoinResult> Join(const std::string& job,
                                  const std::string& name,
                                  const std::string& principal,
                                  uint64_t incarnation = 1) {
    JoinRequestParams params;
    params.member_name = name;
    params.layout = TestLayout();
    params.incarnation = incarnation;
    params.principal = principal;
    return coordinator_->Join(job, std::move(params));
  }

  FakeClock clock_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(CoreSecurityTest, JoinSameName_OtherPrincipal_PermissionDeniedAndNoChange) {
  Make(0, 1);
  absl::StatusOr<JoinResult> x = Join("j", "x", "cert=A");
  ASSERT_TRUE(x.ok());
  // Same incarnation (would return x's id) and a new one (would replace x).
  for (uint64_t incarnation : {1, 2}) {
    absl::StatusOr<JoinResult> y = Join("j", "x", "cert=B", incarnation);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kPermissionDenied)
        << incarnation;
    EXPECT_TRUE(absl::StrContains(y.status().message(),
                                  "bound to other credentials"));
  }
  std::shared_ptr<Job> job = coordinator_->FindJob("j").value();
  ASSERT_EQ(job->num_members(), 1u);
  EXPECT_TRUE(job->Heartbeat(x->member_id).ok());
  EXPECT_EQ(job->CheckPrincipal(x->member_id, "cert=B").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(job->CheckPrincipal(x->member_id, "cert=A").ok());
  // Unknown members are left to the call.
  EXPECT_TRUE(job->CheckPrincipal(MemberId(std::string(32, 'a')), "x").ok());
  // The right principal rejoins as before.
  absl::StatusOr<JoinResult> again = Join("j", "x", "cert=A");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->member_id, x->member_id);
}

TEST_F(CoreSecurityTest, JoinRate_BurstThenRefill_ResourceExhaustedNamingLimit) {
  Make(/*rate=*/2, /*burst=*/3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Join("j", "x", "").ok()) << i;
  absl::StatusOr<JoinResult> refused = Join("j", "x", "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--max_join_rate"))
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "2 Joins per "
                                                            "second"))
      << refused.status();
  // Other names and other jobs have their own buckets.
  EXPECT_TRUE(Join("j", "y", "").ok());
  EXPECT_TRUE(Join("k", "x", "").ok());
  // Half a second refills one token at 2/s.
  clock_.Advance(absl::Milliseconds(499));
  EXPECT_EQ(Join("j", "x", "").status().code(),
            absl::StatusCode::kResourceExhausted);
  clock_.Advance(absl::Milliseconds(2));
  EXPECT_TRUE(Join("j", "x", "").ok());
  EXPECT_EQ(Join("j", "x", "").status().code(),
            absl::StatusCode::kResourceExhausted);
  // Tick forgets full buckets; a bucket refilled is a full burst again.
  clock_.Advance(absl::Seconds(10));
  coordinator_->Tick();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Join("j", "x", "").ok()) << i;
  EXPECT_FALSE(Join("j", "x", "").ok());
}

TEST(CoreSecurityOptionsTest, Validate_BadJoinRate_ReturnsInvalidArgument) {
  CoordinatorOptions options;
  options.max_join_rate = -1;
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  options.max_join_rate = 1;
  options.join_burst = 0;
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace localsgd
