// Integration: Prometheus metrics over a real HTTP scrape of an in-process
// coordinator (fake clock: leases expire when the test says so). Clients and
// raw protocol calls make a known history; every counter must have moved by
// exactly what that history implies.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

constexpr char kJob[] = "metrics-job";
constexpr uint32_t kChunk = 100;
constexpr int64_t kElements = 1000;       // 10 chunks
constexpr double kModel = kElements * 4;  // bytes of one fp32 model

// GET http://127.0.0.1:port/metrics with a plain socket; returns the body.
std::string HttpGetMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string request =
      "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(write(fd, request.data(), request.size()),
            static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  EXPECT_TRUE(absl::StartsWith(response, "HTTP/1.")) << response;
  EXPECT_TRUE(
      absl::StrContains(response.substr(0, response.find("\r\n")), " 200 "))
      << response;
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// Samples of a text exposition: "name{labels}" -> value.
struct Scrape {
  std::map<std::string, double> samples;
  std::string text;

  double Get(const std::string& key) const {
    auto it = samples.find(key);
    return it == samples.end() ? -1 : it->second;
  }
};

Scrape ScrapeMetrics(int port) {
  Scrape scrape;
  scrape.text = HttpGetMetrics(port);
  for (absl::string_view line : absl::StrSplit(scrape.text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value;
    if (space == absl::string_view::npos ||
        !absl::SimpleAtod(line.substr(space + 1), &value)) {
      ADD_FAILURE() << "unparsable line: " << line;
      continue;
    }
    scrape.samples[std::string(line.substr(0, space))] = value;
  }
  return scrape;
}

std::string JobKey(const std::string& name) {
  return absl::StrCat(name, "{job_id=\"", kJob, "\"}");
}
std::string RoundsKey(const std::string& reason) {
  return absl::StrCat("localsgd_rounds_closed_total{job_id=\"", kJob,
                      "\",reason=\"", reason, "\"}");
}
std::string RejectedKey(const std::string& method, const std::string& code) {
  return absl::StrCat("localsgd_requests_rejected_total{code=\"", code,
                      "\",method=\"", method, "\"}");
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testkit::BaseServerOptions(kChunk);
    options.metrics_listen_address = "127.0.0.1:0";
    options.coordinator.clock = &clock_;
    server_ = testkit::StartServer(std::move(options));
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(server_->metrics_port(), 0);
    layout_ = MakeLayout({{"w", {kElements}, DType::kFloat32}});
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<Client> NewClient(const std::string& name) {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server_->port());
    options.job_id = kJob;
    options.member_name = name;
    options.max_retry_time = absl::Seconds(10);
    auto client = Client::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // Every client syncs at once, each from its own thread.
  void SyncAll() {
    std::vector<std::thread> threads;
    std::vector<absl::StatusOr<SyncOutcome>> out(clients_.size());
    for (size_t i = 0; i < clients_.size(); ++i) {
      threads.emplace_back([&, i] {
        std::fill(params_[i].begin(), params_[i].end(), 1.0f * i);
        out[i] = clients_[i]->Sync(absl::MakeSpan(params_[i]));
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& o : out) ASSERT_TRUE(o.ok()) << o.status();
  }

  std::string RawJoin(const std::string& job, const std::string& name,
                      grpc::Status* status_out = nullptr) {
    v1::JoinRequest request;
    request.set_job_id(job);
    request.set_member_name(name);
    request.set_incarnation(7);
    request.mutable_settings()->set_contribution(
        v1::CONTRIBUTION_PSEUDO_GRADIENTS);
    LayoutToProto(layout_, request.mutable_layout());
    v1::JoinResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->Join(&context, request, &response);
    if (status_out != nullptr) *status_out = status;
    state_ids_[response.member_id()] = response.state_id();
    return response.member_id();
  }

  // A raw Sync stream that sends the header and the first `chunks` chunks,
  // then half-closes; returns its status and the payload bytes received.
  grpc::Status RawSync(const std::string& member, uint64_t round,
                       uint32_t chunks, size_t* bytes_back) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    auto stream = stub_->Sync(&context);
    v1::SyncRequest request;
    request.mutable_header()->set_job_id(kJob);
    request.mutable_header()->set_member_id(member);
    request.mutable_header()->set_round(round);
    request.mutable_header()->set_layout_fingerprint(layout_.fingerprint);
    // The state it joined at: its anchor.
    request.mutable_header()->set_anchor_state_id(state_ids_[member]);
    stream->Write(request);
    std::string data;
    EncodeValues(std::vector<float>(kChunk, 1.0f), DType::kFloat32, &data);
    for (uint32_t i = 0; i < chunks; ++i) {
      request.mutable_chunk()->set_index(i);
      request.mutable_chunk()->set_data(data);
      request.mutable_chunk()->set_crc32c(Crc32c(0, data));
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
    v1::SyncResponse response;
    *bytes_back = 0;
    while (stream->Read(&response)) {
      if (response.has_chunk()) *bytes_back += response.chunk().data().size();
    }
    return stream->Finish();
  }

  FakeClock clock_;
  std::unique_ptr<CoordinatorServer> server_;
  Layout layout_;
  // Per raw member: the id of the state it joined at.
  std::map<std::string, uint64_t> state_ids_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::vector<float>> params_;
};

TEST_F(MetricsTest, Scrape_CountersMoveByExactlyWhatHappened) {
  // Before any job: no job series yet.
  Scrape s0 = ScrapeMetrics(server_->metrics_port());
  EXPECT_EQ(s0.Get("localsgd_jobs"), 0);
  EXPECT_FALSE(absl::StrContains(s0.text, kJob));

  // a seeds; b and c fetch the seed.
  for (const char* name : {"a", "b", "c"}) {
    clients_.push_back(NewClient(name));
    params_.emplace_back(kElements, 0.5f);
    ASSERT_TRUE(clients_.back()->Join(layout_).ok());
    ASSERT_TRUE(
        clients_.back()->Initialize(absl::MakeSpan(params_.back())).ok());
  }
  Scrape s1 = ScrapeMetrics(server_->metrics_port());
  for (const char* type :
       {"localsgd_rounds_closed_total counter",
        "localsgd_round_duration_seconds histogram", "localsgd_members gauge",
        "localsgd_bytes_received_total counter",
        "localsgd_late_contributions_total counter",
        "localsgd_lease_expiries_total counter"}) {
    EXPECT_TRUE(absl::StrContains(s1.text, absl::StrCat("# TYPE ", type)))
        << type;
  }
  EXPECT_EQ(s1.Get("localsgd_jobs"), 1);
  EXPECT_EQ(s1.Get(JobKey("localsgd_members")), 3);
  EXPECT_EQ(s1.Get(RoundsKey("seed")), 1);
  EXPECT_EQ(s1.Get(RoundsKey("complete")), 0);  // present at 0 from the start
  EXPECT_EQ(s1.Get(JobKey("localsgd_bytes_received_total")), kModel);
  // The seed's result back to a, FetchState to b and c.
  EXPECT_EQ(s1.Get(JobKey("localsgd_bytes_sent_total")), 3 * kModel);

  // Three complete rounds of three.
  for (int r = 0; r < 3; ++r) SyncAll();
  Scrape s2 = ScrapeMetrics(server_->metrics_port());
  EXPECT_EQ(s2.Get(RoundsKey("complete")), 3);
  EXPECT_EQ(s2.Get(JobKey("localsgd_round_duration_seconds_count")), 3);
  EXPECT_EQ(s2.Get(JobKey("localsgd_contributions_total")), 9);
  EXPECT_EQ(s2.Get(JobKey("localsgd_bytes_received_total")) -
                s1.Get(JobKey("localsgd_bytes_received_total")),
            9 * kModel);
  EXPECT_EQ(s2.Get(JobKey("localsgd_bytes_sent_total")) -
                s1.Get(JobKey("localsgd_bytes_sent_total")),
            9 * kModel);
  EXPECT_EQ(s2.Get(JobKey("localsgd_dropped_contributions_total")), 0);

  // d opens round 4 with one chunk, its stream ends early (INVALID_ARGUMENT),
  // it leaves: the round closes without it (members_gone, one dropped).
  const std::string d = RawJoin(kJob, "d");
  ASSERT_FALSE(d.empty());
  size_t back = 0;
  EXPECT_EQ(RawSync(d, 4, 1, &back).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  {
    v1::LeaveRequest request;
    request.set_job_id(kJob);
    request.set_member_id(d);
    v1::LeaveResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Leave(&context, request, &response).ok());
  }
  SyncAll();
  // e joins after round 4 closed and sends round 4: late, adopts it.
  const std::string e = RawJoin(kJob, "e");
  ASSERT_TRUE(RawSync(e, 4, kElements / kChunk, &back).ok());
  EXPECT_EQ(back, kModel);
  // Refused calls: a bad job id, an unknown member's heartbeat.
  grpc::Status bad;
  RawJoin("bad job id", "x", &bad);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  {
    v1::HeartbeatRequest request;
    request.set_job_id(kJob);
    request.set_member_id(std::string(32, 'a'));
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    EXPECT_EQ(stub_->Heartbeat(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // a, b, c leave; e's lease runs out.
  for (auto& client : clients_) ASSERT_TRUE(client->Leave().ok());
  clock_.Advance(server_->coordinator()->options().policy.lease_ttl +
                 absl::Seconds(1));
  server_->coordinator()->Tick();

  Scrape s3 = ScrapeMetrics(server_->metrics_port());
  EXPECT_EQ(s3.Get(RoundsKey("seed")), 1);
  EXPECT_EQ(s3.Get(RoundsKey("complete")), 3);
  EXPECT_EQ(s3.Get(RoundsKey("members_gone")), 1);
  EXPECT_EQ(s3.Get(RoundsKey("deadline")), 0);
  EXPECT_EQ(s3.Get(JobKey("localsgd_round_duration_seconds_count")), 4);
  // The fake clock stood still during the rounds.
  EXPECT_EQ(s3.Get(JobKey("localsgd_round_duration_seconds_sum")), 0);
  EXPECT_EQ(
      s3.Get(absl::StrCat("localsgd_round_duration_seconds_bucket{job_id=\"",
                          kJob, "\",le=\"0.005\"}")),
      4);
  EXPECT_EQ(s3.Get(JobKey("localsgd_contributions_total")), 12);
  EXPECT_EQ(s3.Get(JobKey("localsgd_dropped_contributions_total")), 1);
  EXPECT_EQ(s3.Get(JobKey("localsgd_late_contributions_total")), 1);
  EXPECT_EQ(s3.Get(JobKey("localsgd_lease_expiries_total")), 1);
  EXPECT_EQ(s3.Get(JobKey("localsgd_members")), 0);
  // Round 4: d's one chunk, a, b and c; then e's late model.
  EXPECT_EQ(s3.Get(JobKey("localsgd_bytes_received_total")) -
                s2.Get(JobKey("localsgd_bytes_received_total")),
            kChunk * 4 + 3 * kModel + kModel);
  EXPECT_EQ(s3.Get(JobKey("localsgd_bytes_sent_total")) -
                s2.Get(JobKey("localsgd_bytes_sent_total")),
            3 * kModel + kModel);
  EXPECT_EQ(s3.Get(RejectedKey("Sync", "INVALID_ARGUMENT")), 1);
  EXPECT_EQ(s3.Get(RejectedKey("Join", "INVALID_ARGUMENT")), 1);
  EXPECT_EQ(s3.Get(RejectedKey("Heartbeat", "NOT_FOUND")), 1);
  double rejected = 0;
  for (const auto& [key, value] : s3.samples) {
    if (absl::StartsWith(key, "localsgd_requests_rejected_total")) {
      rejected += value;
    }
  }
  EXPECT_EQ(rejected, 3) << s3.text;
}

TEST(MetricsServeTest, Start_MetricsAddressInUse_ReturnsUnavailable) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_listen_address = "127.0.0.1:0";
  auto first = CoordinatorServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.metrics_listen_address =
      absl::StrCat("127.0.0.1:", (*first)->metrics_port());
  auto second = CoordinatorServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "metrics"));
}

TEST(MetricsServeTest, Start_NoMetricsAddress_NoEndpoint) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->metrics_port(), 0);
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// The election's gauges (--ha_etcd sets them from its role changes).
TEST(HaMetricsTest, SetHaRole_OneRoleAtATimeAndPromotionsCounted) {
  Metrics metrics;
  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator =
      Coordinator::Create(CoordinatorOptions());
  ASSERT_TRUE(coordinator.ok());
  metrics.SetHaRole("standby", 5);
  std::string text = metrics.ScrapeText(coordinator->get());
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_role{role=\"standby\"} 1"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_role{role=\"primary\"} 0"));
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_epoch 5"));
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_promotions_total 0"));
  metrics.SetHaRole("primary", 9);
  text = metrics.ScrapeText(coordinator->get());
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_role{role=\"primary\"} 1"));
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_role{role=\"standby\"} 0"));
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_epoch 9"));
  EXPECT_TRUE(absl::StrContains(text, "localsgd_ha_promotions_total 1"));
}

}  // namespace
}  // namespace localsgd
