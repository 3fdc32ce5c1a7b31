// Hostile input on the replication stream (localsgd.v1.Replication/Follow),
// table-driven: a primary of group "g" shard 0 with a token serves a job
// that one member trains; every row opens a Follow stream that is not a
// standby of the group's, and checks the status, the message, and that it
// changed nothing: the member's next round still completes (no result
// waits for a standby that is not one) and its state is the one it would
// have been. One more row follows properly and checks the catch-up.
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/replication.grpc.pb.h"
#include "server/server.h"
#include "server/serving_gate.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testkit::kElements;

// The election won: always serving.
class OpenGate : public ServingGate {
 public:
  absl::Status Check() const override { return absl::OkStatus(); }
};

v1::FollowRequest Good() {
  v1::FollowRequest r;
  r.set_group("g");
  r.set_shard_index(0);
  r.set_token("s3cret");
  r.set_standby("127.0.0.1:1");
  r.set_epoch(7);
  return r;
}

struct Row {
  std::string name;
  std::function<v1::FollowMessage()> first;
  grpc::StatusCode code;
  std::string message;
};

void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

v1::FollowMessage Follow(std::function<void(v1::FollowRequest&)> spoil) {
  v1::FollowMessage m;
  v1::FollowRequest r = Good();
  spoil(r);
  *m.mutable_follow() = r;
  return m;
}

std::vector<Row> Rows() {
  return {
      {"AckFirst_InvalidArgument",
       [] {
         v1::FollowMessage m;
         m.set_acked(99);
         return m;
       },
       grpc::StatusCode::INVALID_ARGUMENT, "must be a FollowRequest"},
      {"NoToken_Unauthenticated",
       [] { return Follow([](v1::FollowRequest& r) { r.clear_token(); }); },
       grpc::StatusCode::UNAUTHENTICATED, "needs the group's token"},
      {"WrongToken_PermissionDenied",
       [] {
         return Follow([](v1::FollowRequest& r) { r.set_token("s3creT"); });
       },
       grpc::StatusCode::PERMISSION_DENIED, "not the group's"},
      {"OtherGroup_FailedPrecondition",
       [] { return Follow([](v1::FollowRequest& r) { r.set_group("h"); }); },
       grpc::StatusCode::FAILED_PRECONDITION,
       "a standby of group 'h' shard 0 follows a primary of group 'g' shard 0"},
      {"OtherShard_FailedPrecondition",
       [] {
         return Follow([](v1::FollowRequest& r) { r.set_shard_index(3); });
       },
       grpc::StatusCode::FAILED_PRECONDITION, "shard 3 follows"},
      {"NoStandbyAddress_InvalidArgument",
       [] { return Follow([](v1::FollowRequest& r) { r.clear_standby(); }); },
       grpc::StatusCode::INVALID_ARGUMENT, "a standby names its address"},
      {"StandbyAddressWithASpace_InvalidArgument",
       [] {
         return Follow([](v1::FollowRequest& r) { r.set_standby("a b:1"); });
       },
       grpc::StatusCode::INVALID_ARGUMENT, "no spaces"},
      {"NewerEpoch_FailedPreconditionDeposed",
       [] { return Follow([](v1::FollowRequest& r) { r.set_epoch(8); }); },
       grpc::StatusCode::FAILED_PRECONDITION,
       "has seen epoch 8; this primary's is 7: it is deposed"},
  };
}

class ReplicationHostileInput : public ::testing::TestWithParam<Row> {};

struct Primary {
  OpenGate gate;
  std::unique_ptr<CoordinatorServer> server;
};

std::unique_ptr<Primary> StartPrimary() {
  auto p = std::make_unique<Primary>();
  ServerOptions options = testkit::BaseServerOptions();
  options.gate = &p->gate;
  options.replication.group = "g";
  options.replication.shard_index = 0;
  options.replication.token = "s3cret";
  options.replication.advertise = "primary";
  p->server = testkit::StartServer(std::move(options));
  if (p->server == nullptr) return nullptr;
  EXPECT_TRUE(p->server->Promote(7).ok());
  return p;
}

// One member's round: its parameters + 1.
void Round(Client& client, std::vector<float>& params, RoundId round) {
  for (float& v : params) v += 1.0f;
  absl::StatusOr<SyncOutcome> out = client.Sync(absl::MakeSpan(params));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->round, round);
  EXPECT_TRUE(out->contributed);
  EXPECT_EQ(params, std::vector<float>(kElements, 1.0f * round));
}

TEST_P(ReplicationHostileInput, Row) {
  const Row& row = GetParam();
  std::unique_ptr<Primary> primary = StartPrimary();
  ASSERT_NE(primary, nullptr);
  auto member = testkit::JoinedClient(
      testkit::BaseClientOptions(*primary->server, "job", "m"));
  ASSERT_NE(member, nullptr);
  std::vector<float> params(kElements, 0.0f);
  ASSERT_TRUE(member->Initialize(absl::MakeSpan(params)).ok());
  Round(*member, params, 1);

  auto stub = v1::Replication::NewStub(grpc::CreateChannel(
      testkit::Target(*primary->server), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = stub->Follow(&context);
  ASSERT_TRUE(stream->Write(row.first()));
  stream->WritesDone();
  v1::ReplicaUpdate update;
  EXPECT_FALSE(stream->Read(&update)) << "it was sent " << update.DebugString();
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), row.code) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(row.message));

  // Nothing changed: the rounds go on, released at once.
  Round(*member, params, 2);
}

INSTANTIATE_TEST_SUITE_P(Rows, ReplicationHostileInput,
                         ::testing::ValuesIn(Rows()),
                         [](const auto& info) { return info.param.name; });

// A coordinator that is not (yet) the primary refuses to be followed.
TEST(ReplicationTest, NotThePrimary_FailedPrecondition) {
  OpenGate gate;
  ServerOptions options = testkit::BaseServerOptions();
  options.gate = &gate;
  options.replication.group = "g";
  options.replication.token = "s3cret";
  auto server = testkit::StartServer(std::move(options));
  ASSERT_NE(server, nullptr);
  auto stub = v1::Replication::NewStub(grpc::CreateChannel(
      testkit::Target(*server), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  auto stream = stub->Follow(&context);
  v1::FollowMessage m;
  *m.mutable_follow() = Good();
  m.mutable_follow()->set_epoch(0);
  ASSERT_TRUE(stream->Write(m));
  stream->WritesDone();
  v1::ReplicaUpdate update;
  EXPECT_FALSE(stream->Read(&update));
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("is not the primary"));
}

// A standby of the group follows: the catch-up holds the job's state, then
// CaughtUp; a round made meanwhile waits for its ack, and an ack beyond what
// was sent does not release more than was sent.
TEST(ReplicationTest, Follow_CatchUpThenUpdatesWaitForTheAck) {
  std::unique_ptr<Primary> primary = StartPrimary();
  ASSERT_NE(primary, nullptr);
  auto member = testkit::JoinedClient(
      testkit::BaseClientOptions(*primary->server, "job", "m"));
  ASSERT_NE(member, nullptr);
  std::vector<float> params(kElements, 0.0f);
  ASSERT_TRUE(member->Initialize(absl::MakeSpan(params)).ok());
  Round(*member, params, 1);

  auto stub = v1::Replication::NewStub(grpc::CreateChannel(
      testkit::Target(*primary->server), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto stream = stub->Follow(&context);
  v1::FollowMessage hello;
  *hello.mutable_follow() = Good();
  ASSERT_TRUE(stream->Write(hello));
  v1::ReplicaUpdate update;
  ASSERT_TRUE(stream->Read(&update));
  ASSERT_TRUE(update.has_job()) << update.DebugString();
  EXPECT_EQ(update.job().job_id(), "job");
  EXPECT_EQ(update.job().round(), 1u);
  EXPECT_EQ(update.epoch(), 7u);
  std::string values;
  while (stream->Read(&update) && update.has_state_chunk()) {
    values += update.state_chunk().values();
  }
  ASSERT_EQ(values.size(), kElements * sizeof(float));
  for (size_t i = 0; i < kElements; ++i) {
    float v;
    std::memcpy(&v, values.data() + i * sizeof(float), sizeof(float));
    EXPECT_EQ(v, 1.0f) << i;
  }
  ASSERT_TRUE(update.has_caught_up()) << update.DebugString();
  v1::FollowMessage ack;
  ack.set_acked(update.sequence());
  ASSERT_TRUE(stream->Write(ack));
  // In sync: round 2's result waits for this standby's ack.
  ASSERT_TRUE(testkit::AwaitCondition([&] {
    v1::GetJobStatusResponse status;
    auto coordinator_stub = v1::Coordinator::NewStub(grpc::CreateChannel(
        testkit::Target(*primary->server), grpc::InsecureChannelCredentials()));
    grpc::ClientContext c;
    v1::GetJobStatusRequest request;
    return coordinator_stub->GetJobStatus(&c, request, &status).ok() &&
           status.standbys_size() == 1 && status.standbys(0).in_sync();
  }));
  // And in the metrics.
  const std::string metrics =
      primary->server->metrics()->ScrapeText(primary->server->coordinator());
  EXPECT_THAT(
      metrics,
      HasSubstr("localsgd_ha_standby_in_sync{standby=\"127.0.0.1:1\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("localsgd_ha_replication_lag_updates{"
                                 "standby=\"127.0.0.1:1\"} 0"));
  absl::StatusOr<SyncOutcome> out;
  std::atomic<bool> returned{false};
  std::thread sync([&] {
    for (float& v : params) v += 1.0f;
    out = member->Sync(absl::MakeSpan(params));
    returned = true;
  });
  uint64_t last = 0;
  int chunks = 0;
  bool committed = false;
  while (!committed && stream->Read(&update)) {
    if (update.has_chunk()) ++chunks;
    committed = update.has_commit();
    last = update.sequence();
  }
  ASSERT_TRUE(committed);
  EXPECT_EQ(chunks, 3);  // 40 elements in chunks of 16
  EXPECT_EQ(update.commit().round(), 2u);
  // Not released before the ack (it cannot be: the result waits for it).
  EXPECT_FALSE(returned.load());
  ack.set_acked(last);
  ASSERT_TRUE(stream->Write(ack));
  sync.join();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->round, 2u);
  EXPECT_EQ(params, std::vector<float>(kElements, 2.0f));
  context.TryCancel();
  stream->Finish().ok();
}

// The synchronous-standby list, written through a publisher that fails on
// the test's word (etcd unreachable). A new primary writes an empty list
// before it serves; a standby in sync is added; once the primary drops it
// (no ack for ack_timeout), a round's result waits until the list without
// it is written, however long that takes, and is released once it is.
struct FakeList {
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, std::vector<std::string>>> written
      ABSL_GUARDED_BY(mu);
  int failed ABSL_GUARDED_BY(mu) = 0;
  bool fail ABSL_GUARDED_BY(mu) = false;

  ReplicationHub::SyncPublisher Publisher() {
    return [this](uint64_t epoch, const std::vector<std::string>& standbys) {
      absl::MutexLock lock(&mu);
      if (fail) {
        ++failed;
        return absl::UnavailableError("etcd is unreachable (the test's)");
      }
      written.emplace_back(epoch, standbys);
      return absl::OkStatus();
    };
  }
  std::vector<std::string> Last() {
    absl::MutexLock lock(&mu);
    return written.empty() ? std::vector<std::string>{"(none)"}
                           : written.back().second;
  }
};

// A primary publishing to a FakeList, a member that has made round 1, and
// a standby stream the test drives by hand.
class SynchronousListTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testkit::BaseServerOptions();
    options.gate = &gate_;
    options.replication.group = "g";
    options.replication.shard_index = 0;
    options.replication.token = "s3cret";
    options.replication.advertise = "primary";
    options.replication.ack_timeout = absl::Seconds(1);
    server_ = testkit::StartServer(std::move(options));
    ASSERT_NE(server_, nullptr);
    server_->StartSyncPublisher(list_.Publisher());
    ASSERT_TRUE(server_->Promote(7).ok());
    member_ =
        testkit::JoinedClient(testkit::BaseClientOptions(*server_, "job", "m"));
    ASSERT_NE(member_, nullptr);
    ASSERT_TRUE(member_->Initialize(absl::MakeSpan(params_)).ok());
    Round(*member_, params_, 1);
  }
  void TearDown() override {
    if (sync_.joinable()) sync_.join();
    if (stream_ != nullptr) {
      context_.TryCancel();
      stream_->Finish().ok();
    }
    if (server_ != nullptr) server_->StopSyncPublisher();
  }

  // A standby follows and acknowledges its catch-up.
  void FollowAndCatchUp() {
    stub_ = v1::Replication::NewStub(grpc::CreateChannel(
        testkit::Target(*server_), grpc::InsecureChannelCredentials()));
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    stream_ = stub_->Follow(&context_);
    v1::FollowMessage hello;
    *hello.mutable_follow() = Good();
    ASSERT_TRUE(stream_->Write(hello));
    v1::ReplicaUpdate update;
    while (stream_->Read(&update) && !update.has_caught_up()) {
    }
    ASSERT_TRUE(update.has_caught_up());
    v1::FollowMessage ack;
    ack.set_acked(update.sequence());
    ASSERT_TRUE(stream_->Write(ack));
  }

  // etcd unreachable (true) or back.
  void SetFail(bool fail) {
    absl::MutexLock lock(&list_.mu);
    list_.fail = fail;
  }
  int Failed() {
    absl::MutexLock lock(&list_.mu);
    return list_.failed;
  }

  // The member's round 2, in a thread: `returned_` once its Sync did.
  void StartRound() {
    sync_ = std::thread([this] {
      for (float& v : params_) v += 1.0f;
      out_ = member_->Sync(absl::MakeSpan(params_));
      returned_ = true;
    });
  }

  OpenGate gate_;
  FakeList list_;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<Client> member_;
  std::vector<float> params_ = std::vector<float>(kElements, 0.0f);
  std::unique_ptr<v1::Replication::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::FollowMessage, v1::ReplicaUpdate>>
      stream_;
  std::thread sync_;
  absl::StatusOr<SyncOutcome> out_;
  std::atomic<bool> returned_{false};
};

TEST_F(SynchronousListTest, ResultsWaitUntilADroppedStandbyLeavesIt) {
  {
    absl::MutexLock lock(&list_.mu);
    ASSERT_EQ(list_.written.size(), 1u);  // before it served
    EXPECT_EQ(list_.written[0].first, 7u);
    EXPECT_TRUE(list_.written[0].second.empty());
  }
  // A standby follows and acknowledges its catch-up: it is in the list.
  ASSERT_NO_FATAL_FAILURE(FollowAndCatchUp());
  ASSERT_TRUE(testkit::AwaitCondition(
      [&] { return list_.Last() == std::vector<std::string>{"127.0.0.1:1"}; }));

  // etcd goes away; the standby stops acknowledging; a round.
  SetFail(true);
  StartRound();
  // Dropped (after ack_timeout), and the list without it tried and failed
  // a few times: the result is still held.
  EXPECT_TRUE(testkit::AwaitCondition([&] { return Failed() >= 3; },
                                      absl::Seconds(20)));
  EXPECT_FALSE(returned_.load())
      << "a result reached a member while the list named a standby that "
         "lacks it";
  // etcd is back: the list without it, then the result.
  SetFail(false);
  sync_.join();
  ASSERT_TRUE(out_.ok()) << out_.status();
  EXPECT_EQ(out_->round, 2u);
  EXPECT_EQ(params_, std::vector<float>(kElements, 2.0f));
  EXPECT_TRUE(list_.Last().empty());
}

// A write of the list that fails may have landed: until one succeeds, the
// results wait, even once the list it would write is the last one written
// again (the standby it added dropped meanwhile).
TEST_F(SynchronousListTest, AFailedWriteThenADrop_WritesItAgain) {
  SetFail(true);  // etcd goes away
  // A standby catches up: the list naming it cannot be written.
  ASSERT_NO_FATAL_FAILURE(FollowAndCatchUp());
  EXPECT_TRUE(testkit::AwaitCondition([&] { return Failed() >= 1; }));
  // A round; the standby acknowledges none of it and is dropped.
  StartRound();
  const int failed_before = Failed();
  EXPECT_TRUE(testkit::AwaitCondition(
      [&] { return Failed() >= failed_before + 8; },  // past the drop
      absl::Seconds(20)));
  EXPECT_FALSE(returned_.load()) << "a result went out while a failed write "
                                    "naming a dropped standby may have landed";
  SetFail(false);
  EXPECT_TRUE(testkit::AwaitCondition([&] { return returned_.load(); },
                                      absl::Seconds(20)))
      << "the list was not written again";
  sync_.join();
  ASSERT_TRUE(out_.ok()) << out_.status();
  EXPECT_EQ(out_->round, 2u);
  EXPECT_TRUE(list_.Last().empty());
}

// A "standby" that asks to follow and then reads nothing: the catch-up of
// a model larger than the stream's flow-control window stalls. The primary
// drops it after a while without a write (so that the log it holds
// back is freed, and it does not count as a standby any more), and rounds
// go on meanwhile: a standby that is not in sync holds no result. (The
// timeout is catch_up_timeout, 1 s here.)
TEST(ReplicationTest, StalledCatchUp_DroppedRoundsGoOn) {
  OpenGate gate;
  constexpr uint64_t kBig = 8u << 20;  // 32 MiB of state
  ServerOptions options =
      testkit::BaseServerOptions(/*chunk_elements=*/1 << 18);
  options.gate = &gate;
  options.replication.group = "g";
  options.replication.shard_index = 0;
  options.replication.token = "s3cret";
  options.replication.advertise = "primary";
  options.replication.ack_timeout = absl::Seconds(1);
  options.replication.catch_up_timeout = absl::Seconds(1);
  auto server = testkit::StartServer(std::move(options));
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(server->Promote(7).ok());
  auto created =
      Client::Create(testkit::BaseClientOptions(*server, "big", "m"));
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Client> member = *std::move(created);
  ASSERT_TRUE(member->Join(testkit::TestLayout(kBig)).ok());
  std::vector<float> params(kBig, 0.0f);
  ASSERT_TRUE(member->Initialize(absl::MakeSpan(params)).ok());

  auto stub = v1::Replication::NewStub(grpc::CreateChannel(
      testkit::Target(*server), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto stream = stub->Follow(&context);
  v1::FollowMessage hello;
  *hello.mutable_follow() = Good();
  ASSERT_TRUE(stream->Write(hello));
  auto standbys = [&] {
    auto coordinator_stub = v1::Coordinator::NewStub(grpc::CreateChannel(
        testkit::Target(*server), grpc::InsecureChannelCredentials()));
    grpc::ClientContext c;
    v1::GetJobStatusRequest request;
    v1::GetJobStatusResponse status;
    EXPECT_TRUE(coordinator_stub->GetJobStatus(&c, request, &status).ok());
    return status.standbys_size();
  };
  ASSERT_TRUE(testkit::AwaitCondition([&] { return standbys() == 1; }));
  // A round while it stalls: released at once.
  for (float& v : params) v += 1.0f;
  absl::StatusOr<SyncOutcome> out = member->Sync(absl::MakeSpan(params));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->round, 1u);
  // Dropped: its stream ends, it is no standby any more.
  ASSERT_TRUE(testkit::AwaitCondition([&] { return standbys() == 0; },
                                      absl::Seconds(20)));
  context.TryCancel();
  stream->Finish().ok();
  for (float& v : params) v += 1.0f;
  out = member->Sync(absl::MakeSpan(params));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->round, 2u);
  EXPECT_EQ(params[kBig - 1], 2.0f);
}

}  // namespace
}  // namespace localsgd
