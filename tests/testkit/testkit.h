// The shared kit of the tests that run a coordinator in-process: layouts, a
// loopback server, channels, a raw protocol client (localsgd.v1 messages,
// any job, member id and authorization header), clients of the library,
// temporary directories. Header-only; link localsgd_server, localsgd_client
// and GTest.
#ifndef LOCALSGD_TESTS_TESTKIT_TESTKIT_H_
#define LOCALSGD_TESTS_TESTKIT_TESTKIT_H_

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/credentials.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"

namespace localsgd {
namespace testkit {

// A layout of 1-D float32 tensors of the given sizes, named prefix0,
// prefix1, ...
inline Layout LayoutOfSizes(const std::vector<int64_t>& sizes,
                            const std::string& prefix = "t") {
  std::vector<TensorSpec> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back({absl::StrCat(prefix, i), {sizes[i]}, DType::kFloat32});
  }
  return MakeLayout(std::move(tensors));
}

// Elements per chunk of the test servers; TestLayout(40) makes 3 chunks.
inline constexpr uint32_t kChunk = 16;
inline constexpr uint64_t kElements = 40;

inline Layout TestLayout(uint64_t n = kElements) {
  return MakeLayout(
      {TensorSpec{"w", {static_cast<int64_t>(n)}, DType::kFloat32}});
}

// A fresh directory under $TMPDIR (or /tmp); removed by the destructor.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(base != nullptr ? base : "/tmp", "/localsgd-sec-XXXXXX");
    CHECK_NE(mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const {
    return absl::StrCat(path_, "/", name);
  }
  // Writes `contents` to File(name) (replacing it atomically) and returns the
  // path.
  std::string Write(const std::string& name,
                    const std::string& contents) const {
    const std::string tmp = File(name + ".tmp");
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << contents;
    }
    std::filesystem::rename(tmp, File(name));
    return File(name);
  }

 private:
  std::string path_;
};

// Waits until `condition()` holds, checking every 5 ms, for at most
// `timeout`; returns whether it held. For conditions that no notification
// announces (a coordinator's status, seen from a test).
template <typename Condition>
bool AwaitCondition(Condition condition,
                    absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time give_up = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));  // polling the condition
  }
  return true;
}

// 32 random hex digits.
inline std::string RandomToken() {
  static absl::BitGen* gen = new absl::BitGen();
  return absl::StrCat(
      absl::Hex(absl::Uniform<uint64_t>(*gen), absl::kZeroPad16),
      absl::Hex(absl::Uniform<uint64_t>(*gen), absl::kZeroPad16));
}

// A coordinator on an ephemeral loopback port, chunks of `chunk_elements`,
// ticking every 20 ms.
inline ServerOptions BaseServerOptions(uint32_t chunk_elements = kChunk) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.coordinator.default_settings.chunk_elements = chunk_elements;
  options.tick_interval = absl::Milliseconds(20);
  return options;
}

inline std::unique_ptr<CoordinatorServer> StartServer(ServerOptions options) {
  auto server = CoordinatorServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

inline std::string Target(const CoordinatorServer& server) {
  return absl::StrCat("127.0.0.1:", server.port());
}

// A channel to `server` secured as `security` says.
inline std::shared_ptr<grpc::Channel> Channel(
    const CoordinatorServer& server, const ChannelSecurity& security = {}) {
  auto channel =
      CreateSecureChannel(Target(server), security, grpc::ChannelArguments());
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *std::move(channel) : nullptr;
}

// The first message of a raw Sync stream: its header for `round`.
inline v1::SyncRequest SyncHeaderRequest(const std::string& job,
                                         const std::string& member,
                                         uint64_t round, const Layout& layout) {
  v1::SyncRequest request;
  v1::SyncHeader* header = request.mutable_header();
  header->set_job_id(job);
  header->set_member_id(member);
  header->set_round(round);
  header->set_layout_fingerprint(layout.fingerprint);
  return request;
}

// The wire protocol, call by call. `authorization` (if not empty) is sent as
// the call's `authorization` metadata as is, so tests can send any token for
// any job. Every call has a deadline of 10 s.
class RawClient {
 public:
  explicit RawClient(std::shared_ptr<grpc::Channel> channel,
                     std::string token = "")
      : stub_(v1::Coordinator::NewStub(std::move(channel))),
        authorization_(token.empty() ? "" : absl::StrCat("Bearer ", token)) {}

  void set_authorization(std::string value) {
    authorization_ = std::move(value);
  }
  // What its Joins say they send (JobSettings.contribution); unspecified
  // by default, as a client that predates pseudo-gradients.
  void set_contribution(v1::Contribution contribution) {
    contribution_ = contribution;
  }

  grpc::Status Join(const std::string& job, const std::string& name,
                    std::string* member_id, uint64_t incarnation = 7,
                    const Layout& layout = TestLayout()) {
    v1::JoinRequest request;
    request.set_job_id(job);
    request.set_member_name(name);
    request.set_incarnation(incarnation);
    request.mutable_settings()->set_contribution(contribution_);
    LayoutToProto(layout, request.mutable_layout());
    v1::JoinResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = stub_->Join(&context, request, &response);
    if (member_id != nullptr) *member_id = response.member_id();
    return status;
  }

  grpc::Status Leave(const std::string& job, const std::string& member) {
    v1::LeaveRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    v1::LeaveResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->Leave(&context, request, &response);
  }

  grpc::Status Heartbeat(const std::string& job, const std::string& member) {
    v1::HeartbeatRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->Heartbeat(&context, request, &response);
  }

  // One Sync stream: the header, every chunk of `values` (kChunk elements
  // each, fp32), then the result into `result` (if given).
  grpc::Status Sync(const std::string& job, const std::string& member,
                    uint64_t round, const std::vector<float>& values,
                    std::vector<float>* result = nullptr,
                    const Layout& layout = TestLayout()) {
    grpc::ClientContext context;
    Prepare(&context);
    auto stream = stub_->Sync(&context);
    v1::SyncRequest request = SyncHeaderRequest(job, member, round, layout);
    bool writing = stream->Write(request);
    for (uint32_t c = 0; writing && c * kChunk < values.size(); ++c) {
      const size_t begin = size_t{c} * kChunk;
      const size_t n = std::min<size_t>(kChunk, values.size() - begin);
      std::string data;
      EncodeValues(absl::MakeConstSpan(values).subspan(begin, n),
                   DType::kFloat32, &data);
      request.mutable_chunk()->set_index(c);
      request.mutable_chunk()->set_crc32c(Crc32c(0, data));
      request.mutable_chunk()->set_data(std::move(data));
      writing = stream->Write(request);
    }
    stream->WritesDone();
    ReadChunks<v1::SyncResponse>(stream.get(), values.size(), result);
    return stream->Finish();
  }

  grpc::Status FetchState(const std::string& job, const std::string& member,
                          std::vector<float>* state = nullptr,
                          const Layout& layout = TestLayout()) {
    v1::FetchStateRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    request.set_layout_fingerprint(layout.fingerprint);
    grpc::ClientContext context;
    Prepare(&context);
    auto reader = stub_->FetchState(&context, request);
    uint64_t n = 0;
    for (const TensorSpec& t : layout.tensors) n += NumElements(t);
    ReadChunks<v1::FetchStateResponse>(reader.get(), n, state);
    return reader->Finish();
  }

  grpc::Status GetJobStatus(const std::string& job,
                            v1::GetJobStatusResponse* response) {
    v1::GetJobStatusRequest request;
    request.set_job_id(job);
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->GetJobStatus(&context, request, response);
  }

  grpc::Status DeleteJob(const std::string& job) {
    v1::DeleteJobRequest request;
    request.set_job_id(job);
    v1::DeleteJobResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->DeleteJob(&context, request, &response);
  }

  v1::Coordinator::Stub* stub() { return stub_.get(); }
  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!authorization_.empty()) {
      context->AddMetadata("authorization", authorization_);
    }
  }

 private:
  // Reads the chunk messages of a Sync or FetchState stream into `out`.
  template <typename Response, typename Reader>
  static void ReadChunks(Reader* reader, size_t n, std::vector<float>* out) {
    if (out != nullptr) out->assign(n, std::nanf(""));
    Response response;
    while (reader->Read(&response)) {
      if (out == nullptr || !response.has_chunk()) continue;
      const v1::Chunk& c = response.chunk();
      const size_t begin = size_t{c.index()} * kChunk;
      if (begin >= n) continue;
      const size_t len = std::min<size_t>(kChunk, n - begin);
      (void)DecodeValues(c.data(), DType::kFloat32,
                         absl::MakeSpan(*out).subspan(begin, len));
    }
  }

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  v1::Contribution contribution_ = v1::CONTRIBUTION_UNSPECIFIED;
  std::string authorization_;
};

// Two joined clients of one job: `a` seeds zeros, `b` adopts them; then a
// round where a sends 1 and b sends 3 must give both exactly 2.
inline void ExpectPairSyncsExactMean(Client& a, Client& b) {
  std::vector<float> pa(kElements, 0.0f), pb(kElements, 5.0f);
  ASSERT_TRUE(a.Initialize(absl::MakeSpan(pa)).ok());
  ASSERT_TRUE(b.Initialize(absl::MakeSpan(pb)).ok());
  ASSERT_EQ(pb, pa);
  std::fill(pa.begin(), pa.end(), 1.0f);
  std::fill(pb.begin(), pb.end(), 3.0f);
  absl::StatusOr<SyncOutcome> ra, rb;
  std::thread t([&] { ra = a.Sync(absl::MakeSpan(pa)); });
  rb = b.Sync(absl::MakeSpan(pb));
  t.join();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(ra->contributors, 2u);
  EXPECT_EQ(pa, std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(pb, std::vector<float>(kElements, 2.0f));
}

inline ClientOptions BaseClientOptions(const CoordinatorServer& server,
                                       const std::string& job,
                                       const std::string& name) {
  ClientOptions options;
  options.target = Target(server);
  options.job_id = job;
  options.member_name = name;
  options.max_retry_time = absl::Seconds(5);
  options.rpc_timeout = absl::Seconds(10);
  options.sync_timeout = absl::Seconds(30);
  return options;
}

inline std::unique_ptr<Client> JoinedClient(const ClientOptions& options) {
  auto client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  absl::Status s = (*client)->Join(TestLayout());
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return nullptr;
  return *std::move(client);
}

}  // namespace testkit
}  // namespace localsgd

#endif  // LOCALSGD_TESTS_TESTKIT_TESTKIT_H_
