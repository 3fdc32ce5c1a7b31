// Hostile input, table-driven: every field of every request of the protocol
// with out-of-range, negative, huge, empty, duplicated and mismatched values;
// truncated streams, streams that never end, non-finite values. Each row is a
// request (or a few) against an in-process coordinator on loopback, the gRPC
// status it must get (proto/localsgd/v1/coordinator.proto documents them),
// and, after EVERY row, the coordinator must still serve: the honest members
// heartbeat, and complete a round whose average is checked bit for bit
// against an independent computation (which includes exactly the chunks the
// contract says the row's hostile member got counted, e.g. the good chunks
// before a non-finite one).
//
// Each row runs twice: alone on a fresh server (HostileInput/Row.*), and all
// rows of a configuration one after another against one server
// (HostileInputSequence.*), so that damage that accumulates shows too.
//
// The honest members speak the raw protocol (well-formed messages built by
// Env), so that their averages are exact: values are small multiples of 1/4
// and weights 1, 2, 3, so every fp32 sum is exact and the only rounding is
// the final division (and the bf16 rounding of a bf16 job), which the
// independent computation reproduces.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "prometheus/counter.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using grpc::StatusCode;

// The honest job: 17 elements over 3 tensors, chunks of 4 (4, 4, 4, 4, 1):
// chunk boundaries cross tensor boundaries.
const std::vector<int64_t> kSizes = {5, 9, 3};
constexpr uint64_t kElements = 17;
constexpr uint32_t kChunk = 4;
constexpr uint32_t kNumChunks = 5;
constexpr int kHonest = 3;
constexpr double kHonestWeight[kHonest] = {1, 2, 3};
constexpr int kMaxMessageBytes = 1 << 20;
constexpr char kJob[] = "honest-job";

// What honest member `member` holds at element `j` before round `round`:
// a multiple of 1/4 in [-12, 12], exact in fp32 and bf16.
float HonestValue(int member, uint64_t round, uint64_t j) {
  const int k = static_cast<int>((member * 37 + round * 11 + j * 5) % 97) - 48;
  return static_cast<float>(k) / 4.0f;
}

Layout HonestLayout() { return testkit::LayoutOfSizes(kSizes, "layer"); }

uint32_t ChunkSize(uint32_t index) {
  return static_cast<uint32_t>(
      std::min<uint64_t>(kChunk, kElements - uint64_t{index} * kChunk));
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// A server and job configuration; rows name the one they need.
struct Config {
  DType wire = DType::kFloat32;
  // Short leases and deadlines for the rows with streams that never end.
  absl::Duration lease = absl::Seconds(30);
  absl::Duration deadline = absl::ZeroDuration();
  v1::NonFinitePolicy nonfinite = v1::NON_FINITE_POLICY_UNSPECIFIED;

  std::string Name() const {
    std::string name = wire == DType::kBFloat16 ? "Bf16" : "Fp32";
    if (lease < absl::Seconds(30)) absl::StrAppend(&name, "ShortLease");
    if (deadline > absl::ZeroDuration()) absl::StrAppend(&name, "Deadline");
    if (nonfinite == v1::NON_FINITE_POLICY_DROP) {
      absl::StrAppend(&name, "DropNonFinite");
    }
    return name;
  }
  friend bool operator<(const Config& a, const Config& b) {
    return a.Name() < b.Name();
  }
};

const Config kFp32;
const Config kBf16{DType::kBFloat16};
const Config kShortLease{DType::kFloat32, absl::Seconds(1)};
const Config kDeadline{DType::kFloat32, absl::Seconds(30),
                       absl::Milliseconds(500)};
const Config kDrop{DType::kFloat32, absl::Seconds(30), absl::ZeroDuration(),
                   v1::NON_FINITE_POLICY_DROP};

struct StreamOutcome {
  grpc::Status status;
  std::vector<v1::SyncResponse> responses;
};

enum class StreamEnd {
  kWritesDone,  // the client half-closes, as a correct client does
  kCancel,      // the client cancels the call
};

// A Sync stream the client leaves open without closing it.
struct HangingStream {
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SyncRequest, v1::SyncResponse>>
      stream;
};

class Env {
 public:
  struct Honest {
    std::string name;
    double weight = 1;
    uint64_t incarnation = 0;
    std::string id;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Coordinator::Stub> stub;
  };

  // Starts a server, joins the honest members, seeds the job and runs one
  // honest round (so that rows can name past rounds). Check ok() after.
  explicit Env(const Config& config) : config_(config) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.max_message_bytes = kMaxMessageBytes;
    options.tick_interval = absl::Milliseconds(10);
    options.coordinator.policy.lease_ttl = config.lease;
    options.coordinator.policy.round_deadline = config.deadline;
    options.coordinator.default_settings.chunk_elements = 1024;
    options.coordinator.max_chunk_elements = (kMaxMessageBytes - 1024) / 4;
    absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
        CoordinatorServer::Start(options);
    if (!server.ok()) {
      ADD_FAILURE() << "server: " << server.status();
      return;
    }
    server_ = *std::move(server);
    target_ = absl::StrCat("127.0.0.1:", server_->port());
    hostile_stub_ = NewStub();
    for (int i = 0; i < kHonest; ++i) {
      Honest h;
      h.name = absl::StrCat("honest", i);
      h.weight = kHonestWeight[i];
      h.incarnation = 1000 + i;
      h.channel = NewChannel();
      h.stub = v1::Coordinator::NewStub(h.channel);
      honest_.push_back(std::move(h));
      if (!JoinHonest(i)) return;
    }
    if (config.lease < absl::Seconds(30)) {
      heartbeats_ = std::thread([this] {
        while (!stop_heartbeats_.WaitForNotificationWithTimeout(config_.lease /
                                                                5)) {
          for (int i = 0; i < kHonest; ++i) HeartbeatHonest(i);
        }
      });
    }
    // The seed: honest0 sends round 0; the others adopt it by FetchState.
    std::vector<float> seed(kElements);
    for (uint64_t j = 0; j < kElements; ++j) seed[j] = HonestValue(0, 0, j);
    StreamOutcome seeded =
        RunSync(honest_[0].stub.get(), FullSync(honest_[0].id, 0, seed));
    if (!seeded.status.ok()) {
      ADD_FAILURE() << "seed: " << seeded.status.error_message();
      return;
    }
    state_ = seed;
    for (int i = 1; i < kHonest; ++i) {
      std::vector<float> fetched;
      const grpc::Status s =
          FetchState(honest_[i].stub.get(), honest_[i].id, &fetched);
      if (!s.ok() || fetched != seed) {
        ADD_FAILURE() << "fetch of the seed: " << s.error_message();
        return;
      }
    }
    ok_ = HonestRoundExact("setup");
  }

  ~Env() {
    stop_heartbeats_.Notify();
    if (heartbeats_.joinable()) heartbeats_.join();
    for (HangingStream& h : hanging_) {
      h.context->TryCancel();
      v1::SyncResponse r;
      while (h.stream->Read(&r)) {
      }
      h.stream->Finish();
    }
    // Fails what still waits (a row that went wrong), so threads end.
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
    for (auto& t : spawned_) t.thread.join();
  }

  bool ok() const { return ok_; }
  const Config& config() const { return config_; }
  CoordinatorServer* server() { return server_.get(); }
  v1::Coordinator::Stub* stub() { return hostile_stub_.get(); }
  const Honest& honest(int i) const { return honest_[i]; }
  int num_honest() const { return static_cast<int>(honest_.size()); }
  // Round of the job's current state; rows contribute to next_round().
  uint64_t state_round() const { return state_round_; }
  uint64_t next_round() const { return state_round_ + 1; }
  const std::vector<float>& state() const { return state_; }
  uint64_t fingerprint() const { return layout_.fingerprint; }
  const Layout& layout() const { return layout_; }

  std::shared_ptr<grpc::Channel> NewChannel() {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    args.SetMaxReceiveMessageSize(64 << 20);
    // Separate connections: one per member, as real members have.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(target_,
                                     grpc::InsecureChannelCredentials(), args);
  }
  std::unique_ptr<v1::Coordinator::Stub> NewStub() {
    return v1::Coordinator::NewStub(NewChannel());
  }

  // --- Well-formed messages, for rows to corrupt one field of.

  v1::JoinRequest GoodJoin(const std::string& name) const {
    v1::JoinRequest r;
    r.set_job_id(kJob);
    r.set_member_name(name);
    r.set_incarnation(std::hash<std::string>()(name) | 1);
    r.set_weight(1);
    LayoutToProto(layout_, r.mutable_layout());
    return r;
  }
  v1::SyncRequest Header(const std::string& member, uint64_t round) const {
    v1::SyncRequest r;
    v1::SyncHeader* h = r.mutable_header();
    h->set_job_id(kJob);
    h->set_member_id(member);
    h->set_round(round);
    h->set_layout_fingerprint(layout_.fingerprint);
    return r;
  }
  // Chunk `index` holding `data`, with its CRC32C.
  static v1::SyncRequest Chunk(uint32_t index, std::string data) {
    v1::SyncRequest r;
    r.mutable_chunk()->set_index(index);
    r.mutable_chunk()->set_crc32c(Crc32c(0, data));
    r.mutable_chunk()->set_data(std::move(data));
    return r;
  }
  // `values` in the job's wire dtype.
  std::string Encode(const std::vector<float>& values) const {
    std::string out;
    EncodeValues(values, config_.wire, &out);
    return out;
  }
  // Chunk `index` filled with `v`.
  v1::SyncRequest ChunkOf(uint32_t index, float v) const {
    return Chunk(index, Encode(std::vector<float>(ChunkSize(index), v)));
  }
  // Header and every chunk of `values` (kElements of them).
  std::vector<v1::SyncRequest> FullSync(
      const std::string& member, uint64_t round,
      const std::vector<float>& values) const {
    std::vector<v1::SyncRequest> out = {Header(member, round)};
    for (uint32_t c = 0; c < kNumChunks; ++c) {
      out.push_back(Chunk(c, Encode(std::vector<float>(
                                 values.begin() + c * kChunk,
                                 values.begin() + c * kChunk + ChunkSize(c)))));
    }
    return out;
  }

  // --- Calls.

  grpc::Status Join(const v1::JoinRequest& request,
                    v1::JoinResponse* response = nullptr,
                    v1::Coordinator::Stub* stub = nullptr) {
    v1::JoinResponse ignored;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return (stub != nullptr ? stub : stub_ptr())
        ->Join(&context, request, response != nullptr ? response : &ignored);
  }
  // A name no member had before (the coordinator limits how often one name
  // joins).
  std::string UniqueName(const std::string& prefix) {
    return absl::StrCat(prefix, "-", ++names_);
  }
  // Joins a well-formed hostile member named `prefix`-N; it leaves after the
  // row (AfterRow).
  std::string JoinHostile(const std::string& prefix, double weight = 1) {
    const std::string name = UniqueName(prefix);
    v1::JoinRequest request = GoodJoin(name);
    request.set_weight(weight);
    v1::JoinResponse response;
    const grpc::Status s = Join(request, &response);
    EXPECT_TRUE(s.ok()) << "hostile Join: " << s.error_message();
    hostiles_.push_back(response.member_id());
    names_of_[response.member_id()] = name;
    return response.member_id();
  }
  grpc::Status Leave(const std::string& job, const std::string& member) {
    v1::LeaveRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    v1::LeaveResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub()->Leave(&context, request, &response);
  }
  grpc::Status Heartbeat(const std::string& job, const std::string& member,
                         v1::Coordinator::Stub* stub = nullptr,
                         uint64_t* round = nullptr) {
    v1::HeartbeatRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = (stub != nullptr ? stub : stub_ptr())
                         ->Heartbeat(&context, request, &response);
    if (round != nullptr) *round = response.state_round();
    return s;
  }
  grpc::Status GetJobStatus(const v1::GetJobStatusRequest& request,
                            v1::GetJobStatusResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub()->GetJobStatus(&context, request, response);
  }
  grpc::Status DeleteJob(const std::string& job_id) {
    v1::DeleteJobRequest request;
    request.set_job_id(job_id);
    v1::DeleteJobResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub()->DeleteJob(&context, request, &response);
  }
  // Runs a FetchState; on OK checks the stream's form (header, chunks in
  // order, sizes, CRC32C) and returns the decoded state in `values`.
  grpc::Status FetchState(v1::Coordinator::Stub* stub,
                          const std::string& member, std::vector<float>* values,
                          const std::string& job = kJob,
                          std::optional<uint64_t> fingerprint = std::nullopt) {
    v1::FetchStateRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    request.set_layout_fingerprint(fingerprint.value_or(layout_.fingerprint));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto reader = stub->FetchState(&context, request);
    std::vector<v1::FetchStateResponse> responses;
    v1::FetchStateResponse r;
    while (reader->Read(&r)) responses.push_back(r);
    grpc::Status status = reader->Finish();
    if (status.ok() && values != nullptr) {
      values->clear();
      EXPECT_FALSE(responses.empty());
      if (responses.empty()) return status;
      EXPECT_TRUE(responses[0].has_header());
      EXPECT_EQ(responses[0].header().num_chunks(), kNumChunks);
      EXPECT_EQ(responses[0].header().round(), state_round_);
      std::vector<v1::Chunk> chunks;
      for (size_t i = 1; i < responses.size(); ++i) {
        EXPECT_TRUE(responses[i].has_chunk());
        chunks.push_back(responses[i].chunk());
      }
      *values = DecodeChunks(chunks, "FetchState");
    }
    return status;
  }
  // Runs one Sync stream: writes `messages` (stopping at the first failed
  // write), then ends it as `end` says, reads everything and finishes.
  StreamOutcome RunSync(v1::Coordinator::Stub* stub,
                        const std::vector<v1::SyncRequest>& messages,
                        StreamEnd end = StreamEnd::kWritesDone) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    const double before = BytesReceived();
    auto stream = stub->Sync(&context);
    size_t payload = 0;
    for (const v1::SyncRequest& m : messages) {
      if (!stream->Write(m)) break;
      if (m.has_chunk()) payload += m.chunk().data().size();
    }
    if (end == StreamEnd::kCancel) {
      // Cancel once the server has read what was written (its byte counter
      // moved), so that the cancel does not overtake the chunks.
      WaitForBytesReceived(before, payload);
      context.TryCancel();
    } else {
      stream->WritesDone();
    }
    StreamOutcome out;
    v1::SyncResponse response;
    while (stream->Read(&response)) out.responses.push_back(response);
    out.status = stream->Finish();
    return out;
  }
  grpc::Status Sync(const std::vector<v1::SyncRequest>& messages,
                    StreamEnd end = StreamEnd::kWritesDone) {
    return RunSync(stub(), messages, end).status;
  }
  // Writes `messages` and leaves the stream open until the environment ends
  // (then it is cancelled). Returns once the server has read the chunks.
  void Hang(const std::vector<v1::SyncRequest>& messages) {
    HangingStream h;
    h.context = std::make_unique<grpc::ClientContext>();
    h.context->set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    const double before = BytesReceived();
    h.stream = stub()->Sync(h.context.get());
    size_t payload = 0;
    for (const v1::SyncRequest& m : messages) {
      EXPECT_TRUE(h.stream->Write(m));
      if (m.has_chunk()) payload += m.chunk().data().size();
    }
    WaitForBytesReceived(before, payload);
    hanging_.push_back(std::move(h));
  }
  // Runs `fn` (a Sync that returns only when the honest round closes) in a
  // thread; its status must be `code` once the round has closed. `fn` may
  // use only the thread-safe parts of Env (stub(), RunSync).
  void Spawn(std::function<StreamOutcome()> fn, StatusCode code,
             std::function<void(const StreamOutcome&)> check = nullptr) {
    Spawned s;
    s.code = code;
    s.check = std::move(check);
    s.outcome = std::make_shared<StreamOutcome>();
    s.thread =
        std::thread([fn = std::move(fn), out = s.outcome] { *out = fn(); });
    spawned_.push_back(std::move(s));
  }
  // The job's chunk payload bytes the server has read; waits until they
  // grew by `bytes` from `before`: the server has read what was written.
  double BytesReceived() {
    return server_->metrics()->ForJob(kJob).bytes_received->Value();
  }
  void WaitForBytesReceived(double before, size_t bytes) {
    const double target = before + static_cast<double>(bytes);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (BytesReceived() < target && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_GE(BytesReceived(), target) << "the server never read the chunks";
  }

  // --- What the row's hostile members got counted in the next round.

  // Chunk `chunk` of a (not complete) contribution with `weight`, all `v`.
  void Counted(uint32_t chunk, double weight, float v) {
    extra_.push_back({chunk, static_cast<float>(weight), v, false});
  }
  // As Counted, but the row cannot know whether the server had applied the
  // chunk before the member went away: either way is right.
  void MaybeCounted(uint32_t chunk, double weight, float v) {
    extra_.push_back({chunk, static_cast<float>(weight), v, true});
  }
  // A complete contribution: a contributor more.
  void CountedComplete(double weight, const std::vector<float>& per_chunk) {
    for (uint32_t c = 0; c < kNumChunks; ++c) {
      extra_.push_back({c, static_cast<float>(weight), per_chunk[c], false});
    }
    ++extra_contributors_;
    extra_weight_ += static_cast<float>(weight);
  }
  // The hostile members stay (their leases end them).
  void KeepHostiles() { keep_hostiles_ = true; }
  // The next round must list hostile member `id` as dropped (it left or
  // lost its lease, or was dropped for a non-finite value).
  void ExpectDropped(const std::string& id) {
    dropped_.push_back(names_of_[id]);
  }
  // The next round must list hostile member `id` as timed out (still a
  // member when the round closed at its deadline), not as dropped.
  void ExpectTimedOut(const std::string& id) {
    timed_out_.push_back(names_of_[id]);
  }
  // Makes honest member `i` join again (after a row took its place).
  bool JoinHonest(int i) {
    Honest& h = honest_[i];
    v1::JoinRequest request = GoodJoin(h.name);
    request.set_weight(h.weight);
    request.set_incarnation(h.incarnation);
    request.mutable_settings()->set_chunk_elements(kChunk);
    request.mutable_settings()->set_wire_dtype(
        static_cast<v1::DType>(static_cast<int>(config_.wire)));
    request.mutable_settings()->set_nonfinite_policy(config_.nonfinite);
    v1::JoinResponse response;
    const grpc::Status s = Join(request, &response, h.stub.get());
    if (!s.ok()) {
      ADD_FAILURE() << h.name << " Join: " << s.error_message();
      return false;
    }
    EXPECT_EQ(response.num_chunks(), kNumChunks);
    EXPECT_EQ(response.num_elements(), kElements);
    absl::MutexLock lock(&mu_);
    h.id = response.member_id();
    return true;
  }

  // After a row: the hostile members leave, the coordinator must still
  // serve (every honest member heartbeats, status answers) and the honest
  // members complete a round whose average is exactly the independent one
  // (with what the row got counted); the row's spawned Syncs end as
  // expected.
  void AfterRow(const std::string& row) {
    // A spawned Sync completes its member's contribution with the round, so
    // its member leaves after it; the others leave now, so that the round
    // need not wait for their leases.
    const bool leave_after = !spawned_.empty();
    auto leave = [&] {
      if (!keep_hostiles_) {
        for (const std::string& id : hostiles_) {
          EXPECT_TRUE(Leave(kJob, id).ok()) << row << ": hostile Leave";
        }
      }
      hostiles_.clear();
      keep_hostiles_ = false;
    };
    if (!leave_after) leave();
    for (int i = 0; i < kHonest; ++i) {
      uint64_t round = 0;
      const grpc::Status s =
          Heartbeat(kJob, honest_id(i), honest_[i].stub.get(), &round);
      EXPECT_TRUE(s.ok()) << row << ": " << honest_[i].name
                          << " Heartbeat: " << s.error_message();
      EXPECT_EQ(round, state_round_) << row;
    }
    EXPECT_TRUE(HonestRoundExact(row)) << row;
    for (Spawned& s : spawned_) {
      s.thread.join();
      EXPECT_EQ(s.outcome->status.error_code(), s.code)
          << row << ": spawned Sync: " << s.outcome->status.error_message();
      if (s.check) s.check(*s.outcome);
    }
    spawned_.clear();
    if (leave_after) leave();
    for (HangingStream& h : hanging_) {
      h.context->TryCancel();
      v1::SyncResponse r;
      while (h.stream->Read(&r)) {
      }
      EXPECT_EQ(h.stream->Finish().error_code(), StatusCode::CANCELLED) << row;
    }
    hanging_.clear();
    v1::GetJobStatusResponse status;
    EXPECT_TRUE(GetJobStatus(v1::GetJobStatusRequest(), &status).ok()) << row;
  }

  // Decodes a result's chunks (index order, sizes, CRC32C checked).
  std::vector<float> DecodeChunks(const std::vector<v1::Chunk>& chunks,
                                  const std::string& what) const {
    std::vector<float> values;
    EXPECT_EQ(chunks.size(), kNumChunks) << what;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const v1::Chunk& chunk = chunks[c];
      EXPECT_EQ(chunk.index(), c) << what;
      EXPECT_TRUE(chunk.has_crc32c())
          << what << ": chunk " << c << " without crc32c";
      EXPECT_EQ(chunk.crc32c(), Crc32c(0, chunk.data()))
          << what << ": chunk " << c << " crc32c";
      std::vector<float> v(ChunkSize(static_cast<uint32_t>(c)));
      EXPECT_TRUE(
          DecodeValues(chunk.data(), config_.wire, absl::MakeSpan(v)).ok())
          << what << ": chunk " << c << " size " << chunk.data().size();
      values.insert(values.end(), v.begin(), v.end());
    }
    return values;
  }

 private:
  struct Extra {
    uint32_t chunk;
    float weight;
    float value;
    bool maybe;
  };
  struct Spawned {
    std::thread thread;
    StatusCode code;
    std::function<void(const StreamOutcome&)> check;
    std::shared_ptr<StreamOutcome> outcome;
  };

  v1::Coordinator::Stub* stub_ptr() { return hostile_stub_.get(); }
  std::string honest_id(int i) {
    absl::MutexLock lock(&mu_);
    return honest_[i].id;
  }
  void HeartbeatHonest(int i) {
    Heartbeat(kJob, honest_id(i), honest_[i].stub.get());
  }

  // The average of the next round, computed independently: per chunk the
  // weighted mean of the honest values and the counted extras (with the
  // `maybe` ones if `with_maybe`), in double, rounded once to fp32 (exact
  // sums: see the file comment), then to the wire dtype.
  std::vector<float> Expected(bool with_maybe) const {
    std::vector<float> out(kElements);
    for (uint64_t j = 0; j < kElements; ++j) {
      const uint32_t c = static_cast<uint32_t>(j / kChunk);
      double sum = 0, weight = 0;
      for (int i = 0; i < kHonest; ++i) {
        sum += kHonestWeight[i] * HonestValue(i, next_round(), j);
        weight += kHonestWeight[i];
      }
      for (const Extra& e : extra_) {
        if (e.chunk != c || (e.maybe && !with_maybe)) continue;
        sum += static_cast<double>(e.weight) * e.value;
        weight += e.weight;
      }
      float mean = static_cast<float>(sum / weight);
      if (config_.wire == DType::kBFloat16) {
        mean = BFloat16ToFloat(FloatToBFloat16(mean));
      }
      out[j] = mean;
    }
    return out;
  }

  // The honest members sync the next round in parallel; checks the results.
  bool HonestRoundExact(const std::string& row) {
    const uint64_t round = next_round();
    std::vector<StreamOutcome> outcomes(kHonest);
    std::vector<std::thread> threads;
    for (int i = 0; i < kHonest; ++i) {
      std::vector<float> values(kElements);
      for (uint64_t j = 0; j < kElements; ++j) {
        values[j] = HonestValue(i, round, j);
      }
      threads.emplace_back([this, i, round, values, &outcomes] {
        outcomes[i] = RunSync(honest_[i].stub.get(),
                              FullSync(honest_id(i), round, values));
      });
    }
    for (auto& t : threads) t.join();
    const std::vector<float> expected = Expected(false);
    const std::vector<float> expected_maybe = Expected(true);
    bool ok = true;
    std::vector<float> first;
    for (int i = 0; i < kHonest; ++i) {
      const StreamOutcome& o = outcomes[i];
      const std::string who =
          absl::StrCat(row, ": ", honest_[i].name, " round ", round);
      if (!o.status.ok() || o.responses.empty() ||
          !o.responses[0].has_result()) {
        ADD_FAILURE() << who << ": " << o.status.error_message();
        ok = false;
        continue;
      }
      const v1::SyncResult& r = o.responses[0].result();
      EXPECT_EQ(r.round(), round) << who;
      EXPECT_TRUE(r.contributed()) << who;
      EXPECT_FALSE(r.late()) << who;
      EXPECT_EQ(r.contributors(),
                static_cast<uint32_t>(kHonest + extra_contributors_))
          << who;
      EXPECT_DOUBLE_EQ(r.contributor_weight(), 6.0 + extra_weight_) << who;
      std::vector<v1::Chunk> chunks;
      for (size_t k = 1; k < o.responses.size(); ++k) {
        chunks.push_back(o.responses[k].chunk());
      }
      const std::vector<float> got = DecodeChunks(chunks, who);
      if (got.size() != kElements) {
        ok = false;
        continue;
      }
      const bool exact =
          std::equal(got.begin(), got.end(), expected.begin(), SameBits);
      const bool exact_maybe =
          std::equal(got.begin(), got.end(), expected_maybe.begin(), SameBits);
      if (!exact && !exact_maybe) {
        ok = false;
        for (uint64_t j = 0; j < kElements; ++j) {
          if (!SameBits(got[j], expected[j])) {
            ADD_FAILURE() << who << ": element " << j << " is " << got[j]
                          << ", the independent average is " << expected[j]
                          << (expected_maybe[j] != expected[j]
                                  ? absl::StrCat(" (or ", expected_maybe[j],
                                                 ")")
                                  : "");
            break;
          }
        }
      }
      if (i == 0) first = got;
      EXPECT_EQ(got, first) << who << ": members hold different averages";
    }
    if (!dropped_.empty() || !timed_out_.empty()) {
      v1::GetJobStatusRequest request;
      request.set_job_id(kJob);
      v1::GetJobStatusResponse status;
      EXPECT_TRUE(GetJobStatus(request, &status).ok());
      if (status.jobs_size() == 1 && status.jobs(0).recent_rounds_size() > 0) {
        const v1::RoundStatus& r = status.jobs(0).recent_rounds(0);
        EXPECT_EQ(r.round(), round);
        for (const std::string& name : dropped_) {
          EXPECT_NE(std::find(r.dropped().begin(), r.dropped().end(), name),
                    r.dropped().end())
              << row << ": " << name << " not dropped from round " << round;
        }
        for (const std::string& name : timed_out_) {
          EXPECT_NE(std::find(r.timed_out().begin(), r.timed_out().end(), name),
                    r.timed_out().end())
              << row << ": " << name << " not timed out in round " << round;
          EXPECT_EQ(std::find(r.dropped().begin(), r.dropped().end(), name),
                    r.dropped().end())
              << row << ": " << name << " listed as dropped in round " << round
              << ", but it was still a member";
        }
      }
    }
    if (ok) {
      state_round_ = round;
      state_ = first;
    }
    extra_.clear();
    dropped_.clear();
    timed_out_.clear();
    extra_contributors_ = 0;
    extra_weight_ = 0;
    return ok;
  }

  const Config config_;
  const Layout layout_ = HonestLayout();
  std::unique_ptr<CoordinatorServer> server_;
  std::string target_;
  std::unique_ptr<v1::Coordinator::Stub> hostile_stub_;
  absl::Mutex mu_;  // honest ids, read by the heartbeat thread
  std::vector<Honest> honest_;
  std::thread heartbeats_;
  absl::Notification stop_heartbeats_;
  bool ok_ = false;
  int names_ = 0;
  std::map<std::string, std::string> names_of_;  // hostile id -> name
  uint64_t state_round_ = 0;
  std::vector<float> state_;
  std::vector<std::string> hostiles_;
  bool keep_hostiles_ = false;
  std::vector<Extra> extra_;
  int extra_contributors_ = 0;
  double extra_weight_ = 0;
  std::vector<std::string> dropped_;
  std::vector<std::string> timed_out_;
  std::vector<Spawned> spawned_;
  std::vector<HangingStream> hanging_;
};

// ---------------------------------------------------------------------------
// The table.

struct Row {
  std::string name;  // Rpc_Input_ReturnsCode
  Config config;
  // The hostile request(s); returns the status of the one under test.
  std::function<grpc::Status(Env&)> act;
  StatusCode code;
  // A substring the status message must contain (empty: not checked).
  std::string message;
};

void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

// Helpers for rows.
std::string Floats(const std::vector<float>& v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}
std::string Bf16Bits(std::vector<uint16_t> v) {
  std::string out(v.size() * 2, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
float SignalingNaN() {
  const uint32_t bits = 0x7f800001u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
float NaNWithPayload() {
  const uint32_t bits = 0xffc12345u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A Join that differs from a good one by `mutate`.
std::function<grpc::Status(Env&)> JoinWith(
    std::function<void(v1::JoinRequest&)> mutate) {
  return [mutate](Env& env) {
    v1::JoinRequest r = env.GoodJoin(env.UniqueName("mutant"));
    mutate(r);
    return env.Join(r);
  };
}
void SetSizes(v1::JoinRequest& r, std::vector<int64_t> sizes) {
  std::vector<TensorSpec> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back({absl::StrCat("t", i), {sizes[i]}, DType::kFloat32});
  }
  LayoutToProto(MakeLayout(std::move(tensors)), r.mutable_layout());
}
// Recomputes the layout's fingerprint after a row changed its tensors, so
// that the change itself is what the coordinator judges.
void Refingerprint(v1::JoinRequest& r) {
  std::vector<TensorSpec> tensors;
  for (const v1::TensorSpec& t : r.layout().tensors()) {
    TensorSpec spec;
    spec.name = t.name();
    spec.shape.assign(t.shape().begin(), t.shape().end());
    spec.dtype = static_cast<DType>(t.dtype());
    tensors.push_back(std::move(spec));
  }
  r.mutable_layout()->set_fingerprint(ComputeFingerprint(tensors));
}

// A hostile member's Sync of the next round, built by `build` from the
// member id; the member leaves after the row.
std::function<grpc::Status(Env&)> SyncWith(
    std::function<std::vector<v1::SyncRequest>(Env&, const std::string&)> build,
    StreamEnd end = StreamEnd::kWritesDone) {
  return [build, end](Env& env) {
    const std::string member = env.JoinHostile("hostile");
    return env.Sync(build(env, member), end);
  };
}

std::function<grpc::Status(Env&)> HeartbeatOf(std::string job,
                                              std::string member) {
  return [job, member](Env& env) { return env.Heartbeat(job, member); };
}

std::function<grpc::Status(Env&)> FetchWith(
    std::function<void(Env&, v1::FetchStateRequest&)> mutate) {
  return [mutate](Env& env) {
    const std::string member = env.JoinHostile("fetcher");
    v1::FetchStateRequest r;
    r.set_job_id(kJob);
    r.set_member_id(member);
    r.set_layout_fingerprint(env.fingerprint());
    mutate(env, r);
    std::vector<float> values;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto reader = env.stub()->FetchState(&context, r);
    v1::FetchStateResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  };
}

// Calls unary method `method` with `body` as its serialized request,
// whatever it holds (the typed stubs only send messages that parse).
grpc::Status RawUnaryCall(Env& env, const std::string& method,
                          const std::string& body) {
  grpc::GenericStub stub(env.NewChannel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, absl::StrCat("/localsgd.v1.Coordinator/", method),
                 grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  return status;
}

std::vector<Row> Rows() {
  std::vector<Row> rows;
  auto add = [&rows](std::string name, Config config,
                     std::function<grpc::Status(Env&)> act, StatusCode code,
                     std::string message = "") {
    rows.push_back(
        {std::move(name), config, std::move(act), code, std::move(message)});
  };
  const StatusCode kOk = StatusCode::OK;
  const StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;
  const StatusCode kPrecondition = StatusCode::FAILED_PRECONDITION;
  const StatusCode kNotFound = StatusCode::NOT_FOUND;
  const StatusCode kExhausted = StatusCode::RESOURCE_EXHAUSTED;
  const StatusCode kDataLoss = StatusCode::DATA_LOSS;

  // ---- Join: job_id.
  add("Join_JobIdEmpty_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_job_id(""); }), kInvalid, "job_id");
  add("Join_JobIdTooLong_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_job_id(std::string(129, 'j')); }), kInvalid,
      "job_id");
  add("Join_JobIdOf128Chars_CreatesJob", kFp32,
      JoinWith([](auto& r) { r.set_job_id(std::string(128, 'j')); }), kOk);
  add("Join_JobIdWithSlashAndSpace_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_job_id("../etc passwd"); }), kInvalid,
      "job_id");
  add("Join_JobIdWithNul_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_job_id(std::string("job\0x", 5)); }),
      kInvalid, "job_id");
  // Not UTF-8: protobuf refuses to parse a proto3 string that is not; the
  // unary methods are registered raw and parse in our code, which says so.
  add("Join_JobIdNotUtf8_IsRefusedByTheParser", kFp32,
      JoinWith([](auto& r) { r.set_job_id("job\xff\xfe"); }), kInvalid,
      "Join request of");
  // ---- Join: member_name.
  add("Join_MemberNameTooLong_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_member_name(std::string(257, 'n')); }),
      kInvalid, "member_name");
  add("Join_MemberNameNotUtf8_IsRefusedByTheParser", kFp32,
      JoinWith([](auto& r) { r.set_member_name("\xc3\x28"); }), kInvalid,
      "does not parse as localsgd.v1.JoinRequest");
  // ---- Every unary method: a body that is no protobuf message at all.
  for (const char* method :
       {"Join", "Leave", "Heartbeat", "GetJobStatus", "DeleteJob"}) {
    add(
        absl::StrCat(method, "_UnparseableBody_ReturnsInvalidArgument"), kFp32,
        [method](Env& env) {
          return RawUnaryCall(env, method, std::string("\x0a\xff\xff", 3));
        },
        kInvalid, absl::StrCat(method, " request of 3 bytes does not parse"));
  }
  // An unnamed member was once named by its id (its credential) in
  // status, and every retry of its Join added another member.
  add("Join_MemberNameEmpty_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_member_name(""); }), kInvalid,
      "member_name is empty");
  add(
      "Join_MemberNameEmptyRetried_AddsNoMember", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("");
        grpc::Status s = env.Join(r);
        grpc::Status again = env.Join(r);
        EXPECT_EQ(again.error_code(), s.error_code());
        v1::GetJobStatusRequest q;
        q.set_job_id(kJob);
        v1::GetJobStatusResponse status;
        EXPECT_TRUE(env.GetJobStatus(q, &status).ok());
        EXPECT_EQ(status.jobs(0).members_size(), env.num_honest());
        return s;
      },
      kInvalid, "member_name is empty");
  // Names reach the logs; a newline or an escape would forge or
  // hide lines.
  add("Join_MemberNameWithNewline_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name("w1\nI1201 00:00:00.000000 1 job.cc:1] forged");
      }),
      kInvalid, "control character (0x0a)");
  add("Join_MemberNameWithEscape_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_member_name("w1\x1b[2K"); }), kInvalid,
      "control character (0x1b)");
  add("Join_MemberNameWithDel_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_member_name("w\x7f"); }), kInvalid,
      "control character (0x7f)");
  // C1 controls (NEL, CSI) and bidi overrides: as C0, refused by code point.
  add("Join_MemberNameWithC1Nel_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name(
            "w1\xc2\x85"
            "forged");
      }),
      kInvalid, "C1 control character (U+0085) at byte 2");
  add("Join_MemberNameWithC1Csi_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name(
            "\xc2\x9b"
            "2K");
      }),
      kInvalid, "C1 control character (U+009B) at byte 0");
  add("Join_MemberNameWithBidiOverride_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name(
            "w\xe2\x80\xae"
            "txt.exe");
      }),
      kInvalid, "bidirectional formatting character (U+202E) at byte 1");
  add("Join_MemberNameWithLineSeparator_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name(
            "w1\xe2\x80\xa8"
            "I1201");
      }),
      kInvalid, "line or paragraph separator (U+2028) at byte 2");
  add("Join_MemberNameWithBidiIsolate_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_member_name(
            "ab\xe2\x81\xa6"
            "c");
      }),
      kInvalid, "bidirectional formatting character (U+2066) at byte 2");
  add(
      "Join_MemberNameUtf8_Joins", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(
            "n\xc3\xb6"
            "de-\xe2\x82\xac");
        v1::JoinResponse response;
        grpc::Status s = env.Join(r, &response);
        env.Leave(kJob, response.member_id());
        return s;
      },
      kOk);
  // A retried Join with another weight once kept the old one silently.
  add(
      "Join_RetriedWithOtherWeight_ReturnsFailedPreconditionNamingBoth", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.UniqueName("reweighed"));
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        r.set_weight(2.5);
        grpc::Status s = env.Join(r);
        EXPECT_NE(s.error_message().find("weight 1"), std::string::npos)
            << s.error_message();
        env.Leave(kJob, response.member_id());
        return s;
      },
      kPrecondition, "asks for 2.5");
  add(
      "Join_SameNameAndIncarnationTwice_ReturnsTheSameMember", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.UniqueName("twice"));
        v1::JoinResponse a, b;
        EXPECT_TRUE(env.Join(r, &a).ok());
        grpc::Status s = env.Join(r, &b);
        EXPECT_EQ(a.member_id(), b.member_id());
        env.Leave(kJob, a.member_id());
        return s;
      },
      kOk);
  add(
      "Join_SameNameNewIncarnation_ReplacesTheMember", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.UniqueName("restarted"));
        v1::JoinResponse a, b;
        EXPECT_TRUE(env.Join(r, &a).ok());
        r.set_incarnation(r.incarnation() + 2);
        grpc::Status s = env.Join(r, &b);
        EXPECT_NE(a.member_id(), b.member_id());
        EXPECT_EQ(env.Heartbeat(kJob, a.member_id()).error_code(),
                  StatusCode::NOT_FOUND);
        env.Leave(kJob, b.member_id());
        return s;
      },
      kOk);
  // Without credentials a member name is not bound to anyone: a Join under
  // an honest member's name with another incarnation replaces it (a
  // restart). The honest member finds out (NOT_FOUND) and joins again.
  // With tokens or client certificates the name is bound (PERMISSION_DENIED;
  // tests/security).
  add(
      "Join_HonestMembersNameWithoutCredentials_ReplacesItUntilItRejoins",
      kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.honest(1).name);
        r.set_incarnation(999);
        v1::JoinResponse response;
        grpc::Status s = env.Join(r, &response);
        EXPECT_EQ(env.Heartbeat(kJob, env.honest(1).id).error_code(),
                  StatusCode::NOT_FOUND);
        EXPECT_TRUE(env.JoinHonest(1));
        return s;
      },
      kOk);
  // ---- Join: incarnation, weight.
  add("Join_IncarnationZero_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.set_incarnation(0); }), kInvalid, "incarnation");
  for (const auto& [label, w] : std::vector<std::pair<std::string, double>>{
           {"Negative", -1},
           {"NaN", std::nan("")},
           {"PlusInf", HUGE_VAL},
           {"MinusInf", -HUGE_VAL},
           {"Huge", 1e300},
           {"AboveLimit", 1e6 * 1.0000001},
           // Below 1e-6: would vanish next to the others' weights (and
           // 1e-300 is 0 in the fp32 accumulator).
           {"TinyPositive", 1e-300},
           {"BelowLimit", 1e-6 * 0.99},
           {"NegativeZeroPointFive", -0.5}}) {
    add(absl::StrCat("Join_Weight", label, "_ReturnsInvalidArgument"), kFp32,
        JoinWith([w = w](auto& r) { r.set_weight(w); }), kInvalid, "weight");
  }
  add(
      "Join_WeightZero_MeansOne", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("weight0", 0);
        // A complete contribution of 4 with weight 1 (0 means 1).
        const auto msgs =
            env.FullSync(m, env.next_round(), std::vector<float>(kElements, 4));
        env.Spawn([&env, msgs] { return env.RunSync(env.stub(), msgs); },
                  StatusCode::OK);
        env.CountedComplete(1, std::vector<float>(kNumChunks, 4));
        return grpc::Status::OK;
      },
      kOk);
  // ---- Join: layout.
  add("Join_LayoutNoTensors_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-empty");
        r.mutable_layout()->clear_tensors();
        Refingerprint(r);
      }),
      kInvalid, "no tensors");
  add("Join_LayoutDuplicateTensorNames_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-dup");
        r.mutable_layout()->mutable_tensors(1)->set_name("layer0");
        Refingerprint(r);
      }),
      kInvalid, "repeats");
  add("Join_LayoutEmptyTensorName_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-noname");
        r.mutable_layout()->mutable_tensors(2)->set_name("");
        Refingerprint(r);
      }),
      kInvalid, "empty name");
  add("Join_LayoutTensorNameWithNewline_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-newline");
        r.mutable_layout()->mutable_tensors(2)->set_name("w\nforged");
        Refingerprint(r);
      }),
      kInvalid, "control character");
  add("Join_LayoutTensorNameTooLong_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-longname");
        r.mutable_layout()->mutable_tensors(2)->set_name(
            std::string(1025, 'n'));
        Refingerprint(r);
      }),
      kInvalid, "at most 1024");
  // 10^6 empty tensors once took ~300 MB; the count is a limit now.
  add("Join_LayoutAboveMaxTensors_ReturnsResourceExhausted", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-manytensors");
        r.mutable_layout()->clear_tensors();
        for (int i = 0; i < 65537; ++i) {
          auto* t = r.mutable_layout()->add_tensors();
          t->set_name(absl::StrCat("x", i));
          t->add_shape(1);
          t->set_dtype(v1::DTYPE_FLOAT32);
        }
        Refingerprint(r);
      }),
      kExhausted, "65537 tensors, more than 65536 (--max_tensors)");
  add("Join_LayoutNegativeDim_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-neg");
        r.mutable_layout()->mutable_tensors(0)->set_shape(0, -5);
        Refingerprint(r);
      }),
      kInvalid, "negative");
  add("Join_LayoutMinInt64Dim_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-minint");
        r.mutable_layout()->mutable_tensors(0)->set_shape(
            0, std::numeric_limits<int64_t>::min());
        Refingerprint(r);
      }),
      kInvalid, "negative");
  add("Join_LayoutNumelOverflowsUint64_ReturnsResourceExhausted", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-overflow");
        auto* t = r.mutable_layout()->mutable_tensors(0);
        t->clear_shape();
        for (int i = 0; i < 3; ++i) t->add_shape(int64_t{1} << 40);
        t->add_shape(0);  // a later zero does not make it small
        Refingerprint(r);
      }),
      kExhausted, "elements");
  add("Join_LayoutAboveModelLimit_ReturnsResourceExhausted", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-huge");
        SetSizes(r, {int64_t{1} << 40});
      }),
      kExhausted, "elements");
  add("Join_LayoutZeroElements_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-zero");
        SetSizes(r, {0, 0});
      }),
      kInvalid, "no elements");
  add("Join_LayoutRank17_ReturnsInvalidArgument", kFp32, JoinWith([](auto& r) {
        r.set_job_id("other-rank");
        auto* t = r.mutable_layout()->mutable_tensors(0);
        t->clear_shape();
        for (int i = 0; i < 17; ++i) t->add_shape(1);
        Refingerprint(r);
      }),
      kInvalid, "rank");
  add("Join_LayoutUnknownDtype_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_layout()->mutable_tensors(0)->set_dtype(
            static_cast<v1::DType>(99));
      }),
      kInvalid, "dtype");
  add("Join_LayoutDtypeUnspecified_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.set_job_id("other-nodtype");
        r.mutable_layout()->mutable_tensors(0)->set_dtype(
            v1::DTYPE_UNSPECIFIED);
        Refingerprint(r);
      }),
      kInvalid, "dtype");
  add("Join_LayoutWrongFingerprint_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_layout()->set_fingerprint(r.layout().fingerprint() ^ 1);
      }),
      kInvalid, "fingerprint");
  add("Join_LayoutFingerprintZero_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) { r.mutable_layout()->set_fingerprint(0); }),
      kInvalid, "fingerprint");
  add("Join_LayoutOtherShape_ReturnsFailedPreconditionNamingTensor", kFp32,
      JoinWith([](auto& r) {
        SetSizes(r, {5, 9, 4});
      }),
      kPrecondition, "tensor 0");
  add("Join_LayoutExtraTensor_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) {
        auto* t = r.mutable_layout()->add_tensors();
        t->set_name("extra");
        t->add_shape(1);
        t->set_dtype(v1::DTYPE_FLOAT32);
        Refingerprint(r);
      }),
      kPrecondition, "extra");
  add("Join_LayoutOtherTensorDtype_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) {
        r.mutable_layout()->mutable_tensors(1)->set_dtype(v1::DTYPE_FLOAT16);
        Refingerprint(r);
      }),
      kPrecondition, "dtype");
  add("Join_LayoutOf20000Tensors_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) {
        for (int i = 0; i < 20000; ++i) {
          auto* t = r.mutable_layout()->add_tensors();
          t->set_name(absl::StrCat("x", i));
          t->add_shape(1);
          t->set_dtype(v1::DTYPE_FLOAT32);
        }
        Refingerprint(r);
      }),
      kPrecondition);
  // ---- Join: settings.
  add("Join_SettingsChunkElementsHuge_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_chunk_elements(0xffffffffu);
      }),
      kInvalid, "chunk_elements");
  add("Join_SettingsChunkElementsOther_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) { r.mutable_settings()->set_chunk_elements(5); }),
      kPrecondition, "chunks of");
  add(
      "Join_SettingsChunkElementsZero_TakesTheJobs", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.UniqueName("chunk0"));
        r.mutable_settings()->set_chunk_elements(0);
        v1::JoinResponse response;
        grpc::Status s = env.Join(r, &response);
        EXPECT_EQ(response.settings().chunk_elements(), kChunk);
        env.Leave(kJob, response.member_id());
        return s;
      },
      kOk);
  add("Join_SettingsChunkElementsOneOnLargeLayout_ReturnsInvalidArgument",
      kFp32, JoinWith([](auto& r) {
        r.set_job_id("other-chunks");
        SetSizes(r, {int64_t{1} << 25});
        r.mutable_settings()->set_chunk_elements(1);
      }),
      kInvalid, "chunks");
  add("Join_SettingsWireDtypeUnknown_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_wire_dtype(static_cast<v1::DType>(77));
      }),
      kInvalid, "wire_dtype");
  add("Join_SettingsWireDtypeFloat16_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_wire_dtype(v1::DTYPE_FLOAT16);
      }),
      kInvalid, "wire dtype");
  add("Join_SettingsWireDtypeFloat64_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_wire_dtype(v1::DTYPE_FLOAT64);
      }),
      kInvalid, "wire dtype");
  add("Join_SettingsWireDtypeOther_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_wire_dtype(v1::DTYPE_BFLOAT16);
      }),
      kPrecondition, "wire dtype");
  add("Join_SettingsModeUnknown_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_mode(static_cast<v1::AveragingMode>(9));
      }),
      kInvalid, "mode");
  add("Join_SettingsLocalSgdStepsOther_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) { r.mutable_settings()->set_local_sgd_steps(7); }),
      kPrecondition, "steps");
  add("Join_SettingsRendezvousAboveMaxMembers_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_rendezvous_members(1u << 30);
      }),
      kInvalid, "rendezvous_members");
  add("Join_SettingsRendezvousOther_ReturnsFailedPrecondition", kFp32,
      JoinWith(
          [](auto& r) { r.mutable_settings()->set_rendezvous_members(2); }),
      kPrecondition, "members");
  add("Join_SettingsNonFinitePolicyUnknown_ReturnsInvalidArgument", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_nonfinite_policy(
            static_cast<v1::NonFinitePolicy>(9));
      }),
      kInvalid, "nonfinite_policy");
  add("Join_SettingsNonFinitePolicyOther_ReturnsFailedPrecondition", kFp32,
      JoinWith([](auto& r) {
        r.mutable_settings()->set_nonfinite_policy(v1::NON_FINITE_POLICY_DROP);
      }),
      kPrecondition, "non-finite");
  add("Join_OversizedMessage_ReturnsResourceExhausted", kFp32,
      JoinWith([](auto& r) { r.set_member_name(std::string(2 << 20, 'n')); }),
      kExhausted);

  // ---- Leave.
  add(
      "Leave_JobIdEmpty_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Leave("", env.honest(0).id); }, kInvalid,
      "job_id");
  add(
      "Leave_UnknownJob_ReturnsNotFound", kFp32,
      [](Env& env) { return env.Leave("nojob", env.honest(0).id); }, kNotFound,
      "nojob");
  add(
      "Leave_MemberIdMalformed_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Leave(kJob, "not-a-member"); }, kInvalid,
      "member_id");
  add(
      "Leave_MemberIdUpperCase_ReturnsInvalidArgument", kFp32,
      [](Env& env) {
        std::string id = env.honest(0).id;
        for (char& c : id) c = static_cast<char>(std::toupper(c));
        if (id == env.honest(0).id) id[0] = 'G';
        return env.Leave(kJob, id);
      },
      kInvalid, "member_id");
  add(
      "Leave_MemberIdOneMegabyte_ReturnsInvalidArgumentNotEchoed", kFp32,
      [](Env& env) {
        grpc::Status s = env.Leave(kJob, std::string(900 << 10, 'a'));
        EXPECT_LT(s.error_message().size(), 1000u);
        EXPECT_EQ(s.error_message().find("aaaa"), std::string::npos);
        return s;
      },
      kInvalid, "member_id of 921600 bytes is malformed");
  add(
      "Leave_UnknownMember_IsOk", kFp32,
      [](Env& env) { return env.Leave(kJob, std::string(32, '0')); }, kOk);
  add(
      "Leave_Twice_IsOk", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("leaver");
        EXPECT_TRUE(env.Leave(kJob, m).ok());
        return env.Leave(kJob, m);
      },
      kOk);
  add(
      "Leave_HonestMemberUnderAnotherJob_ChangesNothing", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("other-member");
        r.set_job_id("other");
        EXPECT_TRUE(env.Join(r).ok());
        return env.Leave("other", env.honest(0).id);
      },
      kOk);

  // ---- Heartbeat.
  add(
      "Heartbeat_JobIdEmpty_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Heartbeat("", env.honest(0).id); }, kInvalid);
  add(
      "Heartbeat_UnknownJob_ReturnsNotFound", kFp32,
      [](Env& env) { return env.Heartbeat("nojob", env.honest(0).id); },
      kNotFound);
  add("Heartbeat_MemberIdEmpty_ReturnsInvalidArgument", kFp32,
      HeartbeatOf(kJob, ""), kInvalid, "member_id");
  add("Heartbeat_MemberId33Chars_ReturnsInvalidArgument", kFp32,
      HeartbeatOf(kJob, std::string(33, 'a')), kInvalid, "member_id");
  add("Heartbeat_UnknownMember_ReturnsNotFound", kFp32,
      HeartbeatOf(kJob, std::string(32, 'b')), kNotFound);
  add(
      "Heartbeat_MemberOfAnotherJob_ReturnsNotFound", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("other-member");
        r.set_job_id("other");
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        return env.Heartbeat(kJob, response.member_id());
      },
      kNotFound);
  add(
      "Heartbeat_AfterLeave_ReturnsNotFound", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("gone");
        EXPECT_TRUE(env.Leave(kJob, m).ok());
        return env.Heartbeat(kJob, m);
      },
      kNotFound);

  // ---- Sync: stream structure.
  add(
      "Sync_NoMessages_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Sync({}); }, kInvalid, "header");
  add(
      "Sync_ChunkBeforeHeader_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Sync({env.ChunkOf(0, 1)}); }, kInvalid,
      "before its header");
  add(
      "Sync_EmptyMessage_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Sync({v1::SyncRequest()}); }, kInvalid,
      "neither");
  add("Sync_SecondHeader_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()),
                                            env.Header(m, env.next_round())};
      }),
      kInvalid, "second header");
  add("Sync_SecondHeaderAfterAChunk_ReturnsInvalidArgumentChunkCounted", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        env.Counted(0, 1, 2.5f);
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()),
                                            env.ChunkOf(0, 2.5f),
                                            env.Header(m, env.next_round())};
      }),
      kInvalid, "second header");
  // ---- Sync: header fields.
  add("Sync_HeaderJobIdEmpty_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_job_id("");
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 1)};
      }),
      kInvalid, "job_id");
  // The service parses Sync messages itself (the method is raw): one that
  // does not parse is named as such.
  add("Sync_HeaderJobIdNotUtf8_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_job_id("\xff");
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 1)};
      }),
      kInvalid, "does not parse as localsgd.v1.SyncRequest");
  add("Sync_HeaderUnknownJob_ReturnsNotFound", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_job_id("nojob");
        return std::vector<v1::SyncRequest>{h};
      }),
      kNotFound, "nojob");
  add(
      "Sync_HeaderMemberIdMalformed_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.Sync({env.Header("xyz", env.next_round())}); },
      kInvalid, "member_id");
  add(
      "Sync_HeaderUnknownMember_ReturnsNotFound", kFp32,
      [](Env& env) {
        return env.Sync({env.Header(std::string(32, 'c'), env.next_round()),
                         env.ChunkOf(0, 100)});
      },
      kNotFound);
  add(
      "Sync_HeaderMemberOfAnotherJob_ReturnsNotFound", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("other-member");
        r.set_job_id("other");
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        return env.Sync(env.FullSync(response.member_id(), env.next_round(),
                                     std::vector<float>(kElements, 100)));
      },
      kNotFound);
  add("Sync_HeaderFingerprintZero_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_layout_fingerprint(0);
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 100)};
      }),
      kInvalid, "fingerprint");
  add("Sync_HeaderFingerprintOther_ReturnsFailedPrecondition", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_layout_fingerprint(env.fingerprint() + 1);
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 100)};
      }),
      kPrecondition, "fingerprint");
  add("Sync_SeedRoundWithRoundAboveZero_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, env.next_round());
        h.mutable_header()->set_seed_round(7);
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 100)};
      }),
      kInvalid, "seed_round");
  add("Sync_SeedRoundAboveLimit_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, 0);
        h.mutable_header()->set_seed_round(
            std::numeric_limits<uint64_t>::max());
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 100)};
      }),
      kInvalid, "seed_round");
  add("Sync_SeedContributorsWithoutSeedRound_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto h = env.Header(m, 0);
        h.mutable_header()->set_seed_contributors(3);
        return std::vector<v1::SyncRequest>{h, env.ChunkOf(0, 100)};
      }),
      kInvalid, "seed_contributors");
  add("Sync_RoundFarInFuture_ReturnsFailedPrecondition", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{env.Header(m, 1000),
                                            env.ChunkOf(0, 100)};
      }),
      kPrecondition, "1000");
  add("Sync_RoundMaxUint64_ReturnsFailedPrecondition", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, std::numeric_limits<uint64_t>::max())};
      }),
      kPrecondition);
  add(
      "Sync_RoundInThePast_AdoptsTheStateUncounted", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("straggler");
        StreamOutcome o = env.RunSync(
            env.stub(), env.FullSync(m, env.state_round(),
                                     std::vector<float>(kElements, 100)));
        EXPECT_FALSE(o.responses.empty());
        if (!o.responses.empty()) {
          EXPECT_TRUE(o.responses[0].result().late());
          EXPECT_FALSE(o.responses[0].result().contributed());
          EXPECT_EQ(o.responses[0].result().round(), env.state_round());
          std::vector<v1::Chunk> chunks;
          for (size_t i = 1; i < o.responses.size(); ++i) {
            chunks.push_back(o.responses[i].chunk());
          }
          EXPECT_EQ(env.DecodeChunks(chunks, "adopted"), env.state());
        }
        return o.status;
      },
      kOk);
  add(
      "Sync_RoundZeroOnceSeeded_AdoptsTheStateUncounted", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("reseeder");
        StreamOutcome o = env.RunSync(
            env.stub(), env.FullSync(m, 0, std::vector<float>(kElements, 100)));
        EXPECT_FALSE(o.responses.empty());
        if (!o.responses.empty()) {
          EXPECT_FALSE(o.responses[0].result().contributed());
          EXPECT_EQ(o.responses[0].result().round(), env.state_round());
        }
        return o.status;
      },
      kOk);
  // ---- Sync: chunks.
  add("Sync_ChunkIndexOutOfRange_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, env.next_round()),
            Env::Chunk(kNumChunks, env.Encode({1, 1, 1, 1}))};
      }),
      kInvalid, "out of range");
  add("Sync_ChunkIndexMaxUint32_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, env.next_round()),
            Env::Chunk(0xffffffffu, env.Encode({1, 1, 1, 1}))};
      }),
      kInvalid, "out of range");
  add(
      "Sync_ChunkDuplicatedWithOtherData_CountsTheFirstOnce", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("duplicator");
        std::vector<v1::SyncRequest> msgs = {env.Header(m, env.next_round())};
        msgs.push_back(env.ChunkOf(2, 6.0f));
        msgs.push_back(env.ChunkOf(2, -100.0f));
        for (uint32_t c = 0; c < kNumChunks; ++c) {
          msgs.push_back(env.ChunkOf(c, 6.0f));
        }
        env.Spawn([&env, msgs] { return env.RunSync(env.stub(), msgs); },
                  StatusCode::OK);
        env.CountedComplete(1, std::vector<float>(kNumChunks, 6.0f));
        return grpc::Status::OK;
      },
      kOk);
  for (const auto& [label, delta] :
       std::vector<std::pair<std::string, int>>{{"OneByteShort", -1},
                                                {"OneByteLong", 1},
                                                {"OneElementShort", -4},
                                                {"Empty", -16},
                                                {"HalfMegabyte", 512 << 10}}) {
    add(absl::StrCat("Sync_ChunkPayload", label, "_ReturnsInvalidArgument"),
        kFp32, SyncWith([delta = delta](Env& env, const std::string& m) {
          std::string data = env.Encode({1, 1, 1, 1});
          data.resize(data.size() + delta, '\0');
          return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()),
                                              Env::Chunk(0, data)};
        }),
        kInvalid, "bytes; expected");
  }
  add("Sync_ChunkPayloadOddBytesForBf16_ReturnsInvalidArgument", kBf16,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()),
                                            Env::Chunk(0, std::string(7, 0))};
      }),
      kInvalid, "bytes; expected");
  add("Sync_ChunkPayloadFp32SizeForBf16Job_ReturnsInvalidArgument", kBf16,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, env.next_round()),
            Env::Chunk(0, Floats({1, 1, 1, 1}))};
      }),
      kInvalid, "bytes; expected");
  add("Sync_LastChunkFullSize_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, env.next_round()),
            Env::Chunk(kNumChunks - 1, env.Encode({1, 1, 1, 1}))};
      }),
      kInvalid, "bytes; expected");
  // ---- Sync: integrity (CRC32C).
  add("Sync_ChunkWithoutCrc32c_ReturnsInvalidArgument", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto c = env.ChunkOf(0, 100);
        c.mutable_chunk()->clear_crc32c();
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()), c};
      }),
      kInvalid, "crc32c");
  add("Sync_ChunkCrc32cMismatch_ReturnsDataLossNothingCounted", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto c = env.ChunkOf(0, 100);
        c.mutable_chunk()->set_crc32c(c.chunk().crc32c() ^ 0x80000000u);
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()), c};
      }),
      kDataLoss);
  add("Sync_ChunkDataFlippedAfterCrc_ReturnsDataLossGoodChunksCounted", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        env.Counted(1, 1, 3.0f);
        auto c = env.ChunkOf(0, 100);
        (*c.mutable_chunk()->mutable_data())[3] ^= 0x01;
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()),
                                            env.ChunkOf(1, 3.0f), c};
      }),
      kDataLoss);
  add("Sync_ChunkCrc32cZeroOfNonzeroData_ReturnsDataLoss", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        auto c = env.ChunkOf(0, 100);
        c.mutable_chunk()->set_crc32c(0);
        return std::vector<v1::SyncRequest>{env.Header(m, env.next_round()), c};
      }),
      kDataLoss);
  // ---- Sync: non-finite values (NonFinitePolicy REJECT, the default).
  const std::vector<std::pair<std::string, float>> nonfinite = {
      {"NaN", kNaN},
      {"SignalingNaN", SignalingNaN()},
      {"NaNWithPayload", NaNWithPayload()},
      {"PlusInf", kInf},
      {"MinusInf", -kInf}};
  for (const auto& [label, bad] : nonfinite) {
    add(absl::StrCat("Sync_Fp32", label,
                     "_ReturnsInvalidArgumentNamingChunkGoodChunksCounted"),
        kFp32, SyncWith([bad = bad](Env& env, const std::string& m) {
          env.Counted(0, 1, 5.0f);
          env.Counted(1, 1, -5.0f);
          return std::vector<v1::SyncRequest>{
              env.Header(m, env.next_round()), env.ChunkOf(0, 5.0f),
              env.ChunkOf(1, -5.0f), Env::Chunk(2, Floats({1, 2, bad, 4}))};
        }),
        kInvalid, "chunk 2");
  }
  for (const auto& [label, bits] :
       std::vector<std::pair<std::string, uint16_t>>{{"NaN", 0x7fc0},
                                                     {"SignalingNaN", 0x7f81},
                                                     {"PlusInf", 0x7f80},
                                                     {"MinusInf", 0xff80}}) {
    add(absl::StrCat("Sync_Bf16", label,
                     "_ReturnsInvalidArgumentNamingChunkGoodChunksCounted"),
        kBf16, SyncWith([bits = bits](Env& env, const std::string& m) {
          env.Counted(3, 1, 0.5f);
          return std::vector<v1::SyncRequest>{
              env.Header(m, env.next_round()), env.ChunkOf(3, 0.5f),
              Env::Chunk(1, Bf16Bits({0x3f80, 0x3f80, 0x3f80, bits}))};
        }),
        kInvalid, "chunk 1");
  }
  add(
      "Sync_NonFiniteInTheSeed_ReturnsInvalidArgument", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("seeder");
        r.set_job_id("fresh");
        r.mutable_settings()->set_chunk_elements(kChunk);
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        auto msgs = env.FullSync(response.member_id(), 0,
                                 std::vector<float>(kElements, 1));
        msgs[1] = Env::Chunk(0, Floats({1, kNaN, 1, 1}));
        for (auto& msg : msgs) {
          if (msg.has_header()) msg.mutable_header()->set_job_id("fresh");
        }
        grpc::Status s = env.Sync(msgs);
        std::vector<float> values;
        EXPECT_EQ(
            env.FetchState(env.stub(), response.member_id(), &values, "fresh")
                .error_code(),
            StatusCode::FAILED_PRECONDITION)
            << "the job must have no state";
        return s;
      },
      kInvalid, "non-finite");
  add(
      "Sync_RetryAfterNonFinite_CountsTheFirstStreamsChunksOnce", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("retrier");
        grpc::Status s =
            env.Sync({env.Header(m, env.next_round()), env.ChunkOf(0, 7.0f),
                      Env::Chunk(1, Floats({kNaN, 0, 0, 0}))});
        EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
        // The retry sends every chunk with finite values; chunk 0 of the
        // first stream stays the one counted.
        std::vector<v1::SyncRequest> msgs = {env.Header(m, env.next_round())};
        msgs.push_back(env.ChunkOf(0, -7.0f));
        for (uint32_t c = 1; c < kNumChunks; ++c) {
          msgs.push_back(env.ChunkOf(c, 1.0f));
        }
        env.Spawn([&env, msgs] { return env.RunSync(env.stub(), msgs); },
                  StatusCode::OK);
        env.CountedComplete(1, {7.0f, 1.0f, 1.0f, 1.0f, 1.0f});
        return s;
      },
      kInvalid, "non-finite");
  // NonFinitePolicy DROP: the member is dropped from the round, its chunks
  // counted before stay counted, the rest are ignored; its Sync returns the
  // round's result with contributed = false.
  for (const auto& [label, bad] : nonfinite) {
    add(
        absl::StrCat("Sync_Drop", label, "_DropsTheMemberKeepsEarlierChunks"),
        kDrop,
        [bad = bad](Env& env) {
          const std::string m = env.JoinHostile("dropped");
          std::vector<v1::SyncRequest> msgs = {
              env.Header(m, env.next_round()), env.ChunkOf(0, 8.0f),
              Env::Chunk(1, Floats({1, bad, 1, 1}))};
          for (uint32_t c = 2; c < kNumChunks; ++c) {
            msgs.push_back(env.ChunkOf(c, 100.0f));  // ignored
          }
          env.Counted(0, 1, 8.0f);
          env.ExpectDropped(m);
          env.Spawn([&env, msgs] { return env.RunSync(env.stub(), msgs); },
                    StatusCode::OK,
                    [](const StreamOutcome& o) {
                      ASSERT_FALSE(o.responses.empty());
                      EXPECT_FALSE(o.responses[0].result().contributed());
                    });
          return grpc::Status::OK;
        },
        kOk);
  }
  // ---- Sync: truncated streams and streams that never end.
  for (uint32_t k : {0u, 1u, kNumChunks - 1}) {
    add(absl::StrCat("Sync_StreamEndsAfter", k,
                     "Chunks_ReturnsInvalidArgumentChunksCounted"),
        kFp32, SyncWith([k](Env& env, const std::string& m) {
          std::vector<v1::SyncRequest> msgs = {env.Header(m, env.next_round())};
          for (uint32_t c = 0; c < k; ++c) {
            msgs.push_back(env.ChunkOf(c, 9.0f));
            env.Counted(c, 1, 9.0f);
          }
          return msgs;
        }),
        kInvalid, absl::StrCat("ended after ", k, " of ", kNumChunks));
    add(absl::StrCat("Sync_ClientCancelsAfter", k, "Chunks_ChunksCountedOrNot"),
        kFp32,
        SyncWith(
            [k](Env& env, const std::string& m) {
              std::vector<v1::SyncRequest> msgs = {
                  env.Header(m, env.next_round())};
              for (uint32_t c = 0; c < k; ++c) {
                msgs.push_back(env.ChunkOf(c, 11.0f));
                env.MaybeCounted(c, 1, 11.0f);
              }
              return msgs;
            },
            StreamEnd::kCancel),
        StatusCode::CANCELLED);
  }
  // The member stops sending and never closes its stream, nor calls again:
  // the others are not blocked; the round closes when its lease runs out,
  // with its chunks so far counted.
  for (uint32_t k : {0u, 2u}) {
    add(
        absl::StrCat("Sync_StreamNeverEndsAfter", k,
                     "Chunks_RoundClosesAtLeaseExpiry"),
        kShortLease,
        [k](Env& env) {
          const std::string m = env.JoinHostile("hanger");
          std::vector<v1::SyncRequest> msgs = {env.Header(m, env.next_round())};
          for (uint32_t c = 0; c < k; ++c) {
            msgs.push_back(env.ChunkOf(c, 12.0f));
            env.Counted(c, 1, 12.0f);
          }
          env.Hang(msgs);
          env.KeepHostiles();
          env.ExpectDropped(m);
          // Others are served while it hangs.
          return env.Heartbeat(kJob, env.honest(0).id, nullptr);
        },
        kOk);
  }
  // The same with a round deadline: the member keeps its lease (it
  // heartbeats), the round closes at the deadline with the quorum.
  add(
      "Sync_StreamNeverEnds_RoundClosesAtDeadline", kDeadline,
      [](Env& env) {
        const std::string m = env.JoinHostile("hanger");
        env.Hang({env.Header(m, env.next_round()), env.ChunkOf(4, 12.0f)});
        env.Counted(4, 1, 12.0f);
        env.KeepHostiles();
        env.ExpectTimedOut(m);
        return env.Heartbeat(kJob, m);
      },
      kOk);
  add("Sync_OversizedMessage_ReturnsResourceExhausted", kFp32,
      SyncWith([](Env& env, const std::string& m) {
        return std::vector<v1::SyncRequest>{
            env.Header(m, env.next_round()),
            Env::Chunk(0, std::string(2 << 20, '\0'))};
      }),
      kExhausted);
  add(
      "Sync_FiveStreamsOfOneMember_FifthReturnsResourceExhausted", kFp32,
      [](Env& env) {
        // Four streams for a past round (they adopt, nothing counts) that
        // stay open, each read up to its chunk: they hold their slots.
        const std::string m = env.JoinHostile("greedy");
        for (int i = 0; i < 4; ++i) {
          env.Hang({env.Header(m, env.state_round()), env.ChunkOf(0, 13)});
        }
        return env.Sync({env.Header(m, env.next_round())});
      },
      kExhausted, "streams");

  // ---- FetchState.
  add(
      "FetchState_WellFormed_ReturnsTheState", kFp32,
      [](Env& env) {
        const std::string m = env.JoinHostile("reader");
        std::vector<float> values;
        grpc::Status s = env.FetchState(env.stub(), m, &values);
        EXPECT_EQ(values, env.state());
        return s;
      },
      kOk);
  add(
      "FetchState_WellFormedBf16_ReturnsTheState", kBf16,
      [](Env& env) {
        const std::string m = env.JoinHostile("reader");
        std::vector<float> values;
        grpc::Status s = env.FetchState(env.stub(), m, &values);
        EXPECT_EQ(values, env.state());
        return s;
      },
      kOk);
  add("FetchState_JobIdEmpty_ReturnsInvalidArgument", kFp32,
      FetchWith([](Env&, auto& r) { r.set_job_id(""); }), kInvalid);
  add("FetchState_UnknownJob_ReturnsNotFound", kFp32,
      FetchWith([](Env&, auto& r) { r.set_job_id("nojob"); }), kNotFound);
  add("FetchState_MemberIdMalformed_ReturnsInvalidArgument", kFp32,
      FetchWith([](Env&, auto& r) { r.set_member_id("0x1234"); }), kInvalid,
      "member_id");
  add("FetchState_UnknownMember_ReturnsNotFound", kFp32,
      FetchWith([](Env&, auto& r) { r.set_member_id(std::string(32, 'd')); }),
      kNotFound);
  add("FetchState_MemberOfAnotherJob_ReturnsNotFound", kFp32,
      FetchWith([](Env& env, auto& r) {
        v1::JoinRequest j = env.GoodJoin("other-member");
        j.set_job_id("other");
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(j, &response).ok());
        r.set_member_id(response.member_id());
      }),
      kNotFound);
  add("FetchState_FingerprintZero_ReturnsInvalidArgument", kFp32,
      FetchWith([](Env&, auto& r) { r.set_layout_fingerprint(0); }), kInvalid,
      "fingerprint");
  add("FetchState_FingerprintOther_ReturnsFailedPrecondition", kFp32,
      FetchWith([](Env& env, auto& r) {
        r.set_layout_fingerprint(~env.fingerprint());
      }),
      kPrecondition, "fingerprint");
  add(
      "FetchState_JobWithoutState_ReturnsFailedPrecondition", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin("unseeded");
        r.set_job_id("unseeded");
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        return env.FetchState(env.stub(), response.member_id(), nullptr,
                              "unseeded");
      },
      kPrecondition, "no global state");
  add("FetchState_AfterLeave_ReturnsNotFound", kFp32,
      FetchWith([](Env& env, auto& r) { env.Leave(kJob, r.member_id()); }),
      kNotFound);

  // ---- GetJobStatus.
  add(
      "GetJobStatus_MaxRoundsHuge_ReportsAtMost100", kFp32,
      [](Env& env) {
        v1::GetJobStatusRequest r;
        r.set_job_id(kJob);
        r.set_max_rounds(0xffffffffu);
        v1::GetJobStatusResponse response;
        grpc::Status s = env.GetJobStatus(r, &response);
        EXPECT_EQ(response.jobs_size(), 1);
        if (response.jobs_size() == 1) {
          EXPECT_LE(response.jobs(0).recent_rounds_size(), 100);
          EXPECT_GE(response.jobs(0).recent_rounds_size(), 2);
          // Member ids act as credentials: status never shows them (no
          // field carries one; field 1, once member_id, is reserved).
          const std::string bytes = response.SerializeAsString();
          for (int i = 0; i < env.num_honest(); ++i) {
            EXPECT_FALSE(absl::StrContains(bytes, env.honest(i).id))
                << env.honest(i).name;
          }
          for (const auto& m : response.jobs(0).members()) {
            EXPECT_TRUE(m.GetReflection()->GetUnknownFields(m).empty())
                << m.member_name();
          }
        }
        return s;
      },
      kOk);
  // ---- DeleteJob.
  add(
      "DeleteJob_JobIdEmpty_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.DeleteJob(""); }, kInvalid, "job_id");
  add(
      "DeleteJob_JobIdMalformed_ReturnsInvalidArgument", kFp32,
      [](Env& env) { return env.DeleteJob("../x\n"); }, kInvalid, "job_id");
  add(
      "DeleteJob_UnknownJob_ReturnsNotFound", kFp32,
      [](Env& env) { return env.DeleteJob("nojob"); }, kNotFound, "nojob");
  add(
      "DeleteJob_JobWithMembers_ReturnsFailedPreconditionChangesNothing", kFp32,
      [](Env& env) { return env.DeleteJob(kJob); }, kPrecondition,
      "has 3 members");
  add(
      "DeleteJob_EmptyJob_RemovesIt", kFp32,
      [](Env& env) {
        v1::JoinRequest r = env.GoodJoin(env.UniqueName("lonely"));
        r.set_job_id("lonely-job");
        v1::JoinResponse response;
        EXPECT_TRUE(env.Join(r, &response).ok());
        EXPECT_EQ(env.DeleteJob("lonely-job").error_code(),
                  StatusCode::FAILED_PRECONDITION);
        env.Leave("lonely-job", response.member_id());
        grpc::Status s = env.DeleteJob("lonely-job");
        v1::GetJobStatusRequest q;
        q.set_job_id("lonely-job");
        v1::GetJobStatusResponse status;
        EXPECT_EQ(env.GetJobStatus(q, &status).error_code(),
                  StatusCode::NOT_FOUND);
        return s;
      },
      kOk);
  add(
      "GetJobStatus_JobIdMalformed_ReturnsInvalidArgument", kFp32,
      [](Env& env) {
        v1::GetJobStatusRequest r;
        r.set_job_id("a b");
        v1::GetJobStatusResponse response;
        return env.GetJobStatus(r, &response);
      },
      kInvalid, "job_id");
  add(
      "GetJobStatus_JobIdTooLong_ReturnsInvalidArgument", kFp32,
      [](Env& env) {
        v1::GetJobStatusRequest r;
        r.set_job_id(std::string(1000, 'x'));
        v1::GetJobStatusResponse response;
        return env.GetJobStatus(r, &response);
      },
      kInvalid, "job_id");
  add(
      "GetJobStatus_UnknownJob_ReturnsNotFound", kFp32,
      [](Env& env) {
        v1::GetJobStatusRequest r;
        r.set_job_id("nojob");
        v1::GetJobStatusResponse response;
        return env.GetJobStatus(r, &response);
      },
      kNotFound);
  return rows;
}

// Runs one row against `env` and checks its status.
void RunRow(Env& env, const Row& row) {
  SCOPED_TRACE(row.name);
  const grpc::Status status = row.act(env);
  EXPECT_EQ(status.error_code(), row.code)
      << row.name << ": " << status.error_message();
  if (!row.message.empty() && !status.ok()) {
    EXPECT_NE(status.error_message().find(row.message), std::string::npos)
        << row.name << ": message '" << status.error_message() << "' lacks '"
        << row.message << "'";
  }
  env.AfterRow(row.name);
}

class HostileInput : public ::testing::TestWithParam<Row> {};

TEST_P(HostileInput, Row) {
  Env env(GetParam().config);
  ASSERT_TRUE(env.ok());
  RunRow(env, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Rows, HostileInput, ::testing::ValuesIn(Rows()),
                         [](const ::testing::TestParamInfo<Row>& info) {
                           return info.param.name;
                         });

// Every row of a configuration, one after another, against one server: the
// coordinator keeps serving and averaging exactly whatever came before.
TEST(HostileInputSequence, AllRowsAgainstOneServer_KeepServingExactly) {
  std::map<Config, std::vector<Row>> by_config;
  for (Row& row : Rows()) by_config[row.config].push_back(std::move(row));
  for (const auto& [config, rows] : by_config) {
    SCOPED_TRACE(config.Name());
    Env env(config);
    ASSERT_TRUE(env.ok());
    for (const Row& row : rows) RunRow(env, row);
  }
}

// Two members send large but finite values (3e38, near FLT_MAX): the
// weighted mean of the contributions is finite (about 7.5e37), and it is what
// every member must get. A sum accumulated in fp32 overflows to +inf, which
// would hand every member an infinite parameter: what the non-finite policy
// keeps out of the accumulator must not come out of it either.
TEST(NumericalHygiene, Sync_FiniteValuesWhoseSumOverflowsFp32_AverageIsFinite) {
  Env env(kFp32);
  ASSERT_TRUE(env.ok());
  const Row row{
      "Sync_FiniteValuesWhoseSumOverflowsFp32_AverageIsFinite", kFp32,
      [](Env& env) {
        // Both join before either syncs: a member that joins while the
        // round is open takes part only from the next one.
        std::vector<std::string> members;
        for (int i = 0; i < 2; ++i) members.push_back(env.JoinHostile("large"));
        for (const std::string& m : members) {
          const auto msgs = env.FullSync(m, env.next_round(),
                                         std::vector<float>(kElements, 3e38f));
          env.Spawn([&env, msgs] { return env.RunSync(env.stub(), msgs); },
                    StatusCode::OK);
          env.CountedComplete(1, std::vector<float>(kNumChunks, 3e38f));
        }
        return grpc::Status::OK;
      },
      StatusCode::OK, ""};
  RunRow(env, row);
}

TEST(HostileInputTable, CoversEveryRpc) {
  int join = 0, leave = 0, heartbeat = 0, sync = 0, fetch = 0, status = 0,
      deletes = 0;
  for (const Row& row : Rows()) {
    deletes += absl::StartsWith(row.name, "DeleteJob_");
    join += absl::StartsWith(row.name, "Join_");
    leave += absl::StartsWith(row.name, "Leave_");
    heartbeat += absl::StartsWith(row.name, "Heartbeat_");
    sync += absl::StartsWith(row.name, "Sync_");
    fetch += absl::StartsWith(row.name, "FetchState_");
    status += absl::StartsWith(row.name, "GetJobStatus_");
  }
  EXPECT_GT(join, 0);
  EXPECT_GT(leave, 0);
  EXPECT_GT(heartbeat, 0);
  EXPECT_GT(sync, 0);
  EXPECT_GT(fetch, 0);
  EXPECT_GT(status, 0);
  EXPECT_GT(deletes, 0);
  std::printf(
      "hostile rows: Join %d, Leave %d, Heartbeat %d, Sync %d, "
      "FetchState %d, GetJobStatus %d, DeleteJob %d\n",
      join, leave, heartbeat, sync, fetch, status, deletes);
}

}  // namespace
}  // namespace localsgd
