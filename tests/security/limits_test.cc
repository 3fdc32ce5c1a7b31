// Limits on an in-process coordinator: each returns RESOURCE_EXHAUSTED with
// a message naming the limit and its value, and the coordinator keeps
// serving the members within the limits.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "tests/security/security_util.h"

namespace localsgd {
namespace {

using security_test::BaseServerOptions;
using security_test::Channel;
using security_test::kChunk;
using security_test::kElements;
using security_test::RawClient;
using security_test::StartServer;
using security_test::TestLayout;

void ExpectExhausted(const grpc::Status& status, const std::string& limit,
                     const std::string& value) {
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), limit))
      << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), value))
      << status.error_message();
}

TEST(LimitsTest, MaxJobs_NextJob_ResourceExhaustedOthersServed) {
  ServerOptions options = BaseServerOptions();
  options.coordinator.max_jobs = 2;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  std::string m;
  ASSERT_TRUE(raw.Join("j1", "m", &m).ok());
  ASSERT_TRUE(raw.Join("j2", "m", nullptr).ok());
  ExpectExhausted(raw.Join("j3", "m", nullptr), "--max_jobs", "2 jobs");
  EXPECT_TRUE(raw.Heartbeat("j1", m).ok());
}

TEST(LimitsTest, MaxMembersPerJob_NextMember_ResourceExhausted) {
  ServerOptions options = BaseServerOptions();
  options.coordinator.policy.max_members = 2;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  std::string m;
  ASSERT_TRUE(raw.Join("j", "m1", &m).ok());
  ASSERT_TRUE(raw.Join("j", "m2", nullptr).ok());
  ExpectExhausted(raw.Join("j", "m3", nullptr), "--max_members_per_job",
                  "2 members");
  // Another job has room of its own; a retried Join of a member is no new
  // member.
  EXPECT_TRUE(raw.Join("k", "m3", nullptr).ok());
  EXPECT_TRUE(raw.Join("j", "m1", nullptr).ok());
  EXPECT_TRUE(raw.Heartbeat("j", m).ok());
}

TEST(LimitsTest, MaxModelElements_LargerLayout_ResourceExhausted) {
  ServerOptions options = BaseServerOptions();
  options.coordinator.max_model_elements = kElements - 1;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  ExpectExhausted(raw.Join("j", "m", nullptr), "--max_model_elements",
                  absl::StrCat(kElements - 1));
  EXPECT_TRUE(
      raw.Join("j", "m", nullptr, 7, TestLayout(kElements - 1)).ok());
}

TEST(LimitsTest, MaxMessageBytes_LargerMessage_ResourceExhausted) {
  ServerOptions options = BaseServerOptions();
  options.max_message_bytes = 4096;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  std::string m;
  ASSERT_TRUE(raw.Join("j", "m", &m).ok());
  // A chunk message of 8 KiB: gRPC refuses it before the service sees it.
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.stub()->Sync(&context);
  v1::SyncRequest request;
  request.mutable_chunk()->set_index(0);
  request.mutable_chunk()->set_data(std::string(8192, '\0'));
  stream->Write(request);
  stream->WritesDone();
  v1::SyncResponse response;
  while (stream->Read(&response)) {
  }
  ExpectExhausted(stream->Finish(), "larger than max", "4096");
  // The coordinator still serves the member.
  EXPECT_TRUE(raw.Heartbeat("j", m).ok());
  EXPECT_TRUE(raw.Sync("j", m, 0, std::vector<float>(kElements, 1.0f)).ok());
}

TEST(LimitsTest, MaxStreamsPerMember_ExtraStreams_ResourceExhaustedThenFreed) {
  ServerOptions options = BaseServerOptions();
  options.max_streams_per_member = 1;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  std::string x, y;
  ASSERT_TRUE(raw.Join("j", "x", &x).ok());
  ASSERT_TRUE(raw.Join("j", "y", &y).ok());
  ASSERT_TRUE(raw.Sync("j", x, 0, std::vector<float>(kElements, 0.0f)).ok());

  // x's Sync for round 1, complete, waiting for y: one stream open.
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto open = raw.stub()->Sync(&context);
  v1::SyncRequest request;
  request.mutable_header()->set_job_id("j");
  request.mutable_header()->set_member_id(x);
  request.mutable_header()->set_round(1);
  request.mutable_header()->set_layout_fingerprint(TestLayout().fingerprint);
  ASSERT_TRUE(open->Write(request));
  const std::vector<float> ones(kElements, 1.0f);
  for (uint32_t c = 0; c * kChunk < kElements; ++c) {
    std::string data;
    EncodeValues(absl::MakeConstSpan(ones).subspan(
                     c * kChunk, std::min<uint64_t>(kChunk, kElements - c * kChunk)),
                 DType::kFloat32, &data);
    request.mutable_chunk()->set_index(c);
    request.mutable_chunk()->set_crc32c(Crc32c(0, data));
    request.mutable_chunk()->set_data(data);
    ASSERT_TRUE(open->Write(request));
  }
  // Wait (bounded) until the coordinator has counted x's contribution.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  for (;;) {
    v1::GetJobStatusResponse status;
    ASSERT_TRUE(raw.GetJobStatus("j", &status).ok());
    if (status.jobs(0).open_round_contributed_size() == 1) break;
    ASSERT_LT(absl::Now(), give_up) << "x's contribution never counted";
    absl::SleepFor(absl::Milliseconds(5));  // polling a condition
  }

  ExpectExhausted(raw.Sync("j", x, 1, ones), "--max_streams_per_member",
                  "=1");
  ExpectExhausted(raw.FetchState("j", x), "--max_streams_per_member", "=1");
  // y has streams of its own: its Sync closes the round.
  std::vector<float> ry;
  ASSERT_TRUE(raw.Sync("j", y, 1, std::vector<float>(kElements, 3.0f), &ry)
                  .ok());
  EXPECT_EQ(ry, std::vector<float>(kElements, 2.0f));
  open->WritesDone();
  v1::SyncResponse response;
  while (open->Read(&response)) {
  }
  ASSERT_TRUE(open->Finish().ok());
  // The slot is freed once the server is done with the stream (bounded).
  grpc::Status fetch;
  while ((fetch = raw.FetchState("j", x)).error_code() ==
             grpc::StatusCode::RESOURCE_EXHAUSTED &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));  // polling a condition
  }
  EXPECT_TRUE(fetch.ok()) << fetch.error_message();
}

TEST(LimitsTest, JoinRate_BurstExceeded_ResourceExhaustedUntilRefill) {
  FakeClock clock;
  ServerOptions options = BaseServerOptions();
  options.coordinator.clock = &clock;
  options.coordinator.max_join_rate = 1;
  options.coordinator.join_burst = 2;
  auto server = StartServer(options);
  RawClient raw(Channel(*server));
  std::string first, again;
  ASSERT_TRUE(raw.Join("j", "x", &first).ok());
  ASSERT_TRUE(raw.Join("j", "x", &again).ok());
  EXPECT_EQ(again, first);  // a retried Join
  ExpectExhausted(raw.Join("j", "x", nullptr), "--max_join_rate",
                  "1 Joins per second with bursts of 2");
  EXPECT_TRUE(raw.Join("j", "y", nullptr).ok());  // its own bucket
  clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(raw.Join("j", "x", nullptr).ok());
  EXPECT_TRUE(raw.Heartbeat("j", first).ok());
}

}  // namespace
}  // namespace localsgd
