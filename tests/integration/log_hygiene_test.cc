// What the logs of a coordinator and its clients may hold : never
// a member id (the member's credential; logs show member_ref), and never a
// raw control character from a name a caller sent. Every log line of the
// process (core, server and client: they share glog here) is captured while
// members join, seed, sync, lose their lease, make bad calls and leave.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "glog/logging.h"
#include "src/member_ref.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

// Every message logged while it is installed.
class CapturingSink final : public google::LogSink {
 public:
  CapturingSink() { google::AddLogSink(this); }
  ~CapturingSink() override { google::RemoveLogSink(this); }
  void send(google::LogSeverity, const char*, const char* base_filename,
            int line, const struct ::tm*, const char* message,
            size_t message_len) override {
    absl::MutexLock lock(&mu_);
    lines_.push_back(absl::StrCat(base_filename, ":", line, "] ",
                                  absl::string_view(message, message_len)));
  }
  std::vector<std::string> lines() const {
    absl::MutexLock lock(&mu_);
    return lines_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
};

TEST(LogHygieneTest, NoMemberIdAndNoRawControlCharacterInAnyLogLine) {
  CapturingSink sink;
  ServerOptions options = testkit::BaseServerOptions();
  options.coordinator.policy.lease_ttl = absl::Milliseconds(500);
  std::unique_ptr<CoordinatorServer> server =
      testkit::StartServer(std::move(options));
  ASSERT_NE(server, nullptr);

  std::vector<std::string> ids;
  // Two library clients: join, seed/adopt, one exact round, leave.
  ClientOptions a_options = testkit::BaseClientOptions(*server, "job", "a");
  ClientOptions b_options = testkit::BaseClientOptions(*server, "job", "b");
  auto a = testkit::JoinedClient(a_options);
  auto b = testkit::JoinedClient(b_options);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ids.push_back(a->info().member_id.str());
  ids.push_back(b->info().member_id.str());
  testkit::ExpectPairSyncsExactMean(*a, *b);

  // A raw member that never heartbeats: it loses its lease (logged).
  testkit::RawClient raw(testkit::Channel(*server));
  raw.set_contribution(v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  std::string ghost;
  ASSERT_TRUE(raw.Join("job", "ghost", &ghost).ok());
  ids.push_back(ghost);
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  for (;;) {
    v1::GetJobStatusResponse status;
    ASSERT_TRUE(raw.GetJobStatus("job", &status).ok());
    bool present = false;
    for (const auto& m : status.jobs(0).members()) {
      present |= m.member_name() == "ghost";
    }
    if (!present) break;
    ASSERT_LT(absl::Now(), give_up) << "the ghost never lost its lease";
    // Heartbeats keep a and b; the ghost's lease runs out meanwhile.
    ASSERT_TRUE(raw.Heartbeat("job", ids[0]).ok());
    ASSERT_TRUE(raw.Heartbeat("job", ids[1]).ok());
    absl::SleepFor(absl::Milliseconds(50));  // polling the condition above
  }
  // Calls naming the gone member: refused, and the refusal is logged by
  // whoever logs it.
  EXPECT_EQ(raw.Heartbeat("job", ghost).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(raw.Sync("job", ghost, 2, std::vector<float>(testkit::kElements, 1))
                .error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Refused Joins whose names would forge log lines.
  std::string ignored;
  EXPECT_EQ(raw.Join("job", "x\nI1201 forged line", &ignored).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(raw.Join("job\n\x1b[2K", "y", &ignored).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(a->Leave().ok());
  EXPECT_TRUE(b->Leave().ok());
  server.reset();

  const std::vector<std::string> lines = sink.lines();
  ASSERT_GT(lines.size(), 5u);
  bool saw_ref = false, saw_refusal = false;
  for (const std::string& line : lines) {
    for (const std::string& id : ids) {
      EXPECT_FALSE(absl::StrContains(line, id))
          << "a log line holds a member id: " << line;
      saw_ref |= absl::StrContains(line, MemberRef(MemberId(id)));
    }
    for (char c : line) {
      EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 ||
                   static_cast<unsigned char>(c) == 0x7f)
          << "a log line holds control character "
          << static_cast<int>(static_cast<unsigned char>(c)) << ": "
          << absl::CHexEscape(line);
    }
    saw_refusal |= absl::StrContains(line, "forged line");
  }
  EXPECT_TRUE(saw_ref) << "no log line names a member by its member_ref";
  EXPECT_TRUE(saw_refusal) << "the refused Join was not logged";
}

}  // namespace
}  // namespace localsgd
