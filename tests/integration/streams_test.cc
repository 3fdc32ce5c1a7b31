// The server's stream protocols (server/streams.h) driven directly, as a
// gRPC reactor drives them, against a real Coordinator on a FakeClock: the
// order of actions, every refusal and its status, the result's bytes, the
// admission's lifetime, and the wire cache (server/state_wire.h).
#include "server/streams.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "server/protocol.h"
#include "server/state_wire.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using testing_util::SmallLayout;

// What a member reads from a stream machine: its actions, recorded in the
// order they came, with the writes completed one at a time by Pump.
struct Reader {
  int reads_asked = 0;
  bool read_wanted = false;
  std::optional<StreamAction> write;
  std::vector<std::string> messages;  // serialized messages written
  std::vector<StreamAction> chunks;   // chunk writes
  bool finished = false;
  absl::Status status;
  int actions_after_finish = 0;
  // Called with kFinish, before it is recorded.
  std::function<void()> on_finish;

  StreamSink Sink() {
    return [this](StreamAction a) {
      if (finished) ++actions_after_finish;
      switch (a.kind) {
        case StreamAction::Kind::kRead:
          ++reads_asked;
          read_wanted = true;
          break;
        case StreamAction::Kind::kWriteMessage:
          messages.push_back(a.message);
          write = std::move(a);
          break;
        case StreamAction::Kind::kWriteChunk:
          chunks.push_back(a);
          write = std::move(a);
          break;
        case StreamAction::Kind::kFinish:
          if (on_finish) on_finish();
          finished = true;
          status = a.status;
          break;
      }
    };
  }

  // Completes writes until the machine stops writing.
  template <typename Machine>
  void Pump(Machine& machine) {
    while (write.has_value()) {
      write.reset();
      machine.OnWriteDone(true);
    }
  }

  // Takes the read the machine asked for (false if it asked for none).
  bool TakeRead() {
    if (!read_wanted) return false;
    read_wanted = false;
    return true;
  }
};

class StreamsTest : public ::testing::Test {
 protected:
  StreamsTest() {
    options_.clock = &clock_;
    options_.policy.lease_ttl = absl::Seconds(60);
    options_.policy.round_deadline = absl::Seconds(5);
    options_.default_settings.chunk_elements = 4;  // 23 elements: 6 chunks
    coordinator_ = *Coordinator::Create(options_);
  }
  ~StreamsTest() override { coordinator_->Stop(); }

  std::string Join(const std::string& name, DType wire = DType::kFloat32,
                   uint32_t weight = 1) {
    v1::JoinRequest request;
    request.set_job_id("j");
    request.set_member_name(name);
    request.set_incarnation(1);
    request.set_weight(weight);
    LayoutToProto(SmallLayout(), request.mutable_layout());
    request.mutable_settings()->set_wire_dtype(
        wire == DType::kBFloat16 ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT32);
    v1::JoinResponse response;
    const absl::Status s =
        HandleJoin(*coordinator_, request, "", 1 << 20, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.member_id();
  }

  std::shared_ptr<Job> job() { return *coordinator_->FindJob("j"); }
  const ChunkGeometry& geometry() { return job()->geometry(); }

  v1::SyncRequest Header(const std::string& member, RoundId round) {
    v1::SyncRequest r;
    r.mutable_header()->set_job_id("j");
    r.mutable_header()->set_member_id(member);
    r.mutable_header()->set_round(round);
    r.mutable_header()->set_layout_fingerprint(SmallLayout().fingerprint);
    return r;
  }

  v1::SyncRequest Chunk(const std::vector<float>& values, uint32_t index) {
    v1::SyncRequest r;
    v1::Chunk* c = r.mutable_chunk();
    c->set_index(index);
    c->set_data(testing_util::EncodeChunk(values, geometry(), index,
                                          job()->settings().wire_dtype));
    c->set_crc32c(Crc32c(0, c->data()));
    return r;
  }

  // A stream with its reader; started (it asks for the header).
  struct Sync {
    Reader reader;
    std::unique_ptr<SyncServerStream> machine;
  };
  std::unique_ptr<Sync> NewSync(StreamAdmission admit = nullptr) {
    auto s = std::make_unique<Sync>();
    s->machine = std::make_unique<SyncServerStream>(
        coordinator_.get(), &wires_, std::move(admit), s->reader.Sink());
    s->machine->Start();
    return s;
  }

  // Feeds the header and every chunk of `values`, each only when asked.
  void SendAll(Sync& s, const std::string& member, RoundId round,
               const std::vector<float>& values) {
    ASSERT_TRUE(s.reader.TakeRead());
    s.machine->OnMessage(Header(member, round));
    for (uint32_t c = 0; c < geometry().num_chunks(); ++c) {
      ASSERT_TRUE(s.reader.TakeRead()) << "no read asked for chunk " << c;
      s.machine->OnMessage(Chunk(values, c));
    }
    EXPECT_FALSE(s.reader.read_wanted) << "a read asked after the last chunk";
  }

  // The state a reader received: the chunks decoded, in order.
  std::vector<float> Received(const Reader& r) {
    std::vector<float> out;
    for (size_t i = 0; i < r.chunks.size(); ++i) {
      const StreamAction& a = r.chunks[i];
      EXPECT_EQ(a.index, i);
      EXPECT_EQ(a.chunk.crc32c, Crc32c(0, a.chunk.data)) << "chunk " << i;
      std::vector<float> v(geometry().Size(a.index));
      EXPECT_TRUE(DecodeValues(a.chunk.data, job()->settings().wire_dtype,
                               absl::MakeSpan(v))
                      .ok());
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  static std::vector<float> Values(float base) {
    std::vector<float> v(23);
    for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.25f * i;
    return v;
  }

  FakeClock clock_;
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  WireCache wires_;
};

TEST_F(StreamsTest, Sync_Seed_ResultHeaderThenEveryChunkInOrder) {
  const std::string a = Join("a");
  auto s = NewSync();
  SendAll(*s, a, 0, Values(1));
  ASSERT_EQ(s->reader.messages.size(), 1u);
  EXPECT_EQ(s->machine->phase(), SyncServerStream::Phase::kSending);
  s->reader.Pump(*s->machine);
  ASSERT_TRUE(s->reader.finished);
  EXPECT_TRUE(s->reader.status.ok()) << s->reader.status;
  EXPECT_EQ(s->reader.actions_after_finish, 0);
  v1::SyncResponse header;
  ASSERT_TRUE(header.ParseFromString(s->reader.messages[0]));
  ASSERT_TRUE(header.has_result());
  EXPECT_EQ(header.result().round(), 0u);
  EXPECT_EQ(s->reader.chunks.size(), geometry().num_chunks());
  EXPECT_EQ(Received(s->reader), Values(1));
}

TEST_F(StreamsTest, Sync_TwoMembers_WeightedMeanAndOneSharedWireForm) {
  const std::string a = Join("a", DType::kFloat32, 1);
  const std::string b = Join("b", DType::kFloat32, 3);
  {
    auto seed = NewSync();
    SendAll(*seed, a, 0, Values(0));
    seed->reader.Pump(*seed->machine);
    ASSERT_TRUE(seed->reader.status.ok());
  }
  auto sa = NewSync();
  auto sb = NewSync();
  SendAll(*sa, a, 1, Values(4));
  EXPECT_TRUE(sa->reader.messages.empty()) << "a result before b contributed";
  SendAll(*sb, b, 1, Values(8));
  ASSERT_EQ(sa->reader.messages.size(), 1u);
  ASSERT_EQ(sb->reader.messages.size(), 1u);
  sa->reader.Pump(*sa->machine);
  sb->reader.Pump(*sb->machine);
  ASSERT_TRUE(sa->reader.status.ok()) << sa->reader.status;
  ASSERT_TRUE(sb->reader.status.ok()) << sb->reader.status;
  // (1 * 4 + 3 * 8) / 4 = 7 at element 0, and 0.25 per element on top.
  EXPECT_EQ(Received(sa->reader), Values(7));
  EXPECT_EQ(Received(sb->reader), Values(7));
  // Both members were sent the bytes of one StateWire.
  EXPECT_EQ(sa->reader.chunks[0].wire, sb->reader.chunks[0].wire);
  EXPECT_EQ(sa->reader.chunks[0].chunk.data.data(),
            sb->reader.chunks[0].chunk.data.data());
}

TEST_F(StreamsTest, Sync_ChunkBeforeHeader_InvalidArgumentAndNothingMore) {
  Join("a");
  auto s = NewSync();
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnMessage(Chunk(Values(1), 0));
  ASSERT_TRUE(s->reader.finished);
  EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->reader.status.message().find("before its header"),
            std::string::npos)
      << s->reader.status;
  EXPECT_FALSE(s->reader.read_wanted);
  s->machine->OnCancel();  // a late cancel changes nothing
  EXPECT_EQ(s->reader.actions_after_finish, 0);
}

TEST_F(StreamsTest, Sync_SecondHeader_InvalidArgument) {
  const std::string a = Join("a");
  auto s = NewSync();
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnMessage(Header(a, 0));
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnMessage(Header(a, 0));
  ASSERT_TRUE(s->reader.finished);
  EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->reader.status.message().find("second header"),
            std::string::npos);
}

TEST_F(StreamsTest, Sync_BadHeaders_EachItsStatus) {
  const std::string a = Join("a");
  struct Case {
    std::string name;
    v1::SyncRequest header;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  cases.push_back({"unknown job", Header(a, 0), absl::StatusCode::kNotFound});
  cases.back().header.mutable_header()->set_job_id("nope");
  cases.push_back({"malformed member", Header("xyz", 0),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back(
      {"no fingerprint", Header(a, 0), absl::StatusCode::kInvalidArgument});
  cases.back().header.mutable_header()->set_layout_fingerprint(0);
  cases.push_back({"other fingerprint", Header(a, 0),
                   absl::StatusCode::kFailedPrecondition});
  cases.back().header.mutable_header()->set_layout_fingerprint(12345);
  for (const Case& c : cases) {
    auto s = NewSync();
    ASSERT_TRUE(s->reader.TakeRead());
    s->machine->OnMessage(c.header);
    ASSERT_TRUE(s->reader.finished) << c.name;
    EXPECT_EQ(s->reader.status.code(), c.code)
        << c.name << ": " << s->reader.status;
    EXPECT_FALSE(s->reader.status.message().empty()) << c.name;
    EXPECT_EQ(s->machine->job(), nullptr) << c.name;
  }
  EXPECT_FALSE(job()->Status(1).has_state);
}

TEST_F(StreamsTest, Sync_CorruptChunk_DataLossAndNothingOfItCounted) {
  const std::string a = Join("a");
  auto s = NewSync();
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnMessage(Header(a, 0));
  ASSERT_TRUE(s->reader.TakeRead());
  v1::SyncRequest bad = Chunk(Values(1), 0);
  bad.mutable_chunk()->set_crc32c(bad.chunk().crc32c() ^ 1);
  s->machine->OnMessage(bad);
  ASSERT_TRUE(s->reader.finished);
  EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kDataLoss);
  // The seed was aborted with the stream: another stream seeds it whole.
  auto again = NewSync();
  SendAll(*again, a, 0, Values(2));
  again->reader.Pump(*again->machine);
  ASSERT_TRUE(again->reader.status.ok()) << again->reader.status;
  EXPECT_EQ(Received(again->reader), Values(2));
}

TEST_F(StreamsTest, Sync_ReadsEndEarly_InvalidArgumentNamingTheCount) {
  const std::string a = Join("a");
  auto s = NewSync();
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnMessage(Header(a, 0));
  for (uint32_t c = 0; c < 2; ++c) {
    ASSERT_TRUE(s->reader.TakeRead());
    s->machine->OnMessage(Chunk(Values(1), c));
  }
  ASSERT_TRUE(s->reader.TakeRead());
  s->machine->OnReadsDone();
  ASSERT_TRUE(s->reader.finished);
  EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->reader.status.message().find("after 2 of 6 chunks"),
            std::string::npos)
      << s->reader.status;
}

TEST_F(StreamsTest, Sync_LateMember_ResultWaitsUntilItsChunksAreRead) {
  const std::string a = Join("a");
  const std::string b = Join("b");
  {
    auto seed = NewSync();
    SendAll(*seed, a, 0, Values(0));
    seed->reader.Pump(*seed->machine);
  }
  // Round 1 closes at its deadline with a alone.
  auto sa = NewSync();
  SendAll(*sa, a, 1, Values(4));
  clock_.Advance(absl::Seconds(6));
  coordinator_->Tick();
  sa->reader.Pump(*sa->machine);
  ASSERT_TRUE(sa->reader.status.ok()) << sa->reader.status;
  // b's Sync for round 1 is late: its result exists at once, but the
  // protocol sends it only after b's chunks.
  auto sb = NewSync();
  ASSERT_TRUE(sb->reader.TakeRead());
  sb->machine->OnMessage(Header(b, 1));
  EXPECT_TRUE(sb->reader.messages.empty());
  for (uint32_t c = 0; c < geometry().num_chunks(); ++c) {
    EXPECT_TRUE(sb->reader.messages.empty()) << "result before chunk " << c;
    ASSERT_TRUE(sb->reader.TakeRead());
    sb->machine->OnMessage(Chunk(Values(100), c));
  }
  ASSERT_EQ(sb->reader.messages.size(), 1u);
  sb->reader.Pump(*sb->machine);
  ASSERT_TRUE(sb->reader.status.ok()) << sb->reader.status;
  v1::SyncResponse header;
  ASSERT_TRUE(header.ParseFromString(sb->reader.messages[0]));
  const RoundOutcome outcome = RoundOutcomeFromProto(header.result());
  EXPECT_EQ(outcome.round, 1u);
  EXPECT_FALSE(outcome.contributed);
  EXPECT_EQ(Received(sb->reader), Values(4));  // a's, not b's late data
}

TEST_F(StreamsTest, Sync_CancelWhileWaiting_CancelledAtOnceNoCallbackLater) {
  const std::string a = Join("a");
  const std::string b = Join("b");
  {
    auto seed = NewSync();
    SendAll(*seed, a, 0, Values(0));
    seed->reader.Pump(*seed->machine);
  }
  auto sa = NewSync();
  SendAll(*sa, a, 1, Values(4));
  EXPECT_EQ(sa->machine->phase(), SyncServerStream::Phase::kAwaitResult);
  sa->machine->OnCancel();
  ASSERT_TRUE(sa->reader.finished);
  EXPECT_EQ(sa->reader.status.code(), absl::StatusCode::kCancelled);
  // The round still closes (a's chunks stay counted) without calling the
  // cancelled stream back.
  auto sb = NewSync();
  SendAll(*sb, b, 1, Values(8));
  sb->reader.Pump(*sb->machine);
  ASSERT_TRUE(sb->reader.status.ok()) << sb->reader.status;
  EXPECT_EQ(Received(sb->reader), Values(6));
  EXPECT_EQ(sa->reader.actions_after_finish, 0);
}

TEST_F(StreamsTest, Sync_WriteFails_CancelledAndNoMoreWrites) {
  const std::string a = Join("a");
  auto s = NewSync();
  SendAll(*s, a, 0, Values(1));
  ASSERT_TRUE(s->reader.write.has_value());
  s->reader.write.reset();
  s->machine->OnWriteDone(false);
  ASSERT_TRUE(s->reader.finished);
  EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(s->reader.chunks.empty());
}

TEST_F(StreamsTest, Sync_Admission_RefusedStatusOrHeldUntilJustBeforeFinish) {
  const std::string a = Join("a");
  {
    auto s = NewSync(
        [](const std::string&,
           const std::string&) -> absl::StatusOr<std::shared_ptr<void>> {
          return absl::ResourceExhaustedError("too many streams");
        });
    ASSERT_TRUE(s->reader.TakeRead());
    s->machine->OnMessage(Header(a, 0));
    ASSERT_TRUE(s->reader.finished);
    EXPECT_EQ(s->reader.status.code(), absl::StatusCode::kResourceExhausted);
  }
  std::weak_ptr<int> held;
  std::string admitted_job, admitted_member;
  auto s = NewSync(
      [&](const std::string& job_id,
          const std::string& member) -> absl::StatusOr<std::shared_ptr<void>> {
        admitted_job = job_id;
        admitted_member = member;
        auto slot = std::make_shared<int>(1);
        held = slot;
        return std::shared_ptr<void>(slot);
      });
  bool released_before_finish = false;
  s->reader.on_finish = [&] { released_before_finish = held.expired(); };
  SendAll(*s, a, 0, Values(1));
  EXPECT_EQ(admitted_job, "j");
  EXPECT_EQ(admitted_member, a);
  EXPECT_FALSE(held.expired()) << "the admission went before the stream ended";
  s->reader.Pump(*s->machine);
  ASSERT_TRUE(s->reader.status.ok());
  EXPECT_TRUE(released_before_finish);
}

// Full duplex (SyncHeader.early_results) in a job of pseudo-gradients: the
// members of the fixture's job "j" are replaced by those of job "pg".
class EarlyResultsTest : public StreamsTest {
 protected:
  std::string JoinPg(const std::string& name) {
    v1::JoinRequest request;
    request.set_job_id("pg");
    request.set_member_name(name);
    request.set_incarnation(1);
    LayoutToProto(SmallLayout(), request.mutable_layout());
    request.mutable_settings()->set_contribution(
        v1::CONTRIBUTION_PSEUDO_GRADIENTS);
    v1::JoinResponse response;
    const absl::Status s =
        HandleJoin(*coordinator_, request, "", 1 << 20, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.member_id();
  }
  std::shared_ptr<Job> pg() { return *coordinator_->FindJob("pg"); }

  v1::SyncRequest PgHeader(const std::string& member, RoundId round,
                           bool early) {
    v1::SyncRequest r = Header(member, round);
    r.mutable_header()->set_job_id("pg");
    r.mutable_header()->set_anchor_state_id(round == 0 ? 0 : anchor_);
    r.mutable_header()->set_early_results(early);
    return r;
  }
  v1::SyncRequest PgChunk(const std::vector<float>& values, uint32_t index) {
    v1::SyncRequest r;
    v1::Chunk* c = r.mutable_chunk();
    c->set_index(index);
    c->set_data(testing_util::EncodeChunk(values, pg()->geometry(), index,
                                          DType::kFloat32));
    c->set_crc32c(Crc32c(0, c->data()));
    return r;
  }

  // Seeds "pg" with zeros through `member`; anchor_ is then the seed's id.
  void Seed(const std::string& member) {
    auto s = NewSync();
    ASSERT_TRUE(s->reader.TakeRead());
    s->machine->OnMessage(PgHeader(member, 0, false));
    for (uint32_t c = 0; c < pg()->geometry().num_chunks(); ++c) {
      ASSERT_TRUE(s->reader.TakeRead());
      s->machine->OnMessage(PgChunk(std::vector<float>(23, 0.0f), c));
    }
    s->reader.Pump(*s->machine);
    ASSERT_TRUE(s->reader.status.ok()) << s->reader.status;
    v1::SyncResponse header;
    ASSERT_TRUE(header.ParseFromString(s->reader.messages[0]));
    anchor_ = header.result().state_id();
  }

  // Opens a Sync of round 1 (header read) for `member`.
  std::unique_ptr<Sync> Open(const std::string& member, bool early) {
    auto s = NewSync();
    EXPECT_TRUE(s->reader.TakeRead());
    s->machine->OnMessage(PgHeader(member, 1, early));
    return s;
  }
  void Send(Sync& s, const std::vector<float>& delta, uint32_t chunk) {
    ASSERT_TRUE(s.reader.TakeRead()) << "no read asked for chunk " << chunk;
    s.machine->OnMessage(PgChunk(delta, chunk));
  }
  // Chunks [from, to) from every stream in turn, the writes completed after
  // each chunk.
  void SendInStep(const std::vector<Sync*>& streams,
                  const std::vector<const std::vector<float>*>& deltas,
                  uint32_t from, uint32_t to) {
    for (uint32_t k = from; k < to; ++k) {
      for (size_t i = 0; i < streams.size(); ++i)
        Send(*streams[i], *deltas[i], k);
      for (Sync* s : streams) s->reader.Pump(*s->machine);
    }
  }
  // The result when chunks before `three` are the mean of three deltas and
  // the rest the mean of the first two.
  std::vector<float> MeanOfThreeThenTwo(const std::vector<float>& da,
                                        const std::vector<float>& db,
                                        const std::vector<float>& dc,
                                        uint32_t three) {
    const ChunkGeometry& g = pg()->geometry();
    std::vector<float> want(da.size());
    for (size_t i = 0; i < want.size(); ++i) {
      want[i] = i < g.Offset(three) ? (da[i] + db[i] + dc[i]) / 3
                                    : (da[i] + db[i]) / 2;
    }
    return want;
  }

  // What a reader got: per chunk index, its position among the chunk
  // writes, each index once; the delta decoded into place; the result.
  struct Got {
    std::vector<int> position;
    std::vector<float> delta;
    v1::SyncResult result;
  };
  Got Collect(const Reader& r) {
    Got got;
    const ChunkGeometry& g = pg()->geometry();
    got.position.assign(g.num_chunks(), -1);
    got.delta.assign(g.num_elements(), -1000.0f);
    EXPECT_EQ(r.messages.size(), 1u);
    if (!r.messages.empty()) {
      v1::SyncResponse header;
      EXPECT_TRUE(header.ParseFromString(r.messages[0]));
      got.result = header.result();
    }
    for (size_t i = 0; i < r.chunks.size(); ++i) {
      const StreamAction& a = r.chunks[i];
      EXPECT_EQ(got.position[a.index], -1) << "chunk " << a.index << " twice";
      got.position[a.index] = static_cast<int>(i);
      EXPECT_EQ(a.chunk.crc32c, Crc32c(0, a.chunk.data));
      EXPECT_TRUE(DecodeValues(a.chunk.data, DType::kFloat32,
                               absl::MakeSpan(got.delta).subspan(
                                   g.Offset(a.index), g.Size(a.index)))
                      .ok());
    }
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      EXPECT_NE(got.position[c], -1) << "chunk " << c << " never sent";
    }
    return got;
  }

  uint64_t anchor_ = 0;
};

// Two members: a chunk goes back to both as soon as both gave it, while they
// still send; then the result header and the chunks not sent yet. The
// bytes are those of a member that asked for no early results.
TEST_F(EarlyResultsTest, ChunkFinalWhenAllGaveIt_SentAtOnceWhileReceiving) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  const std::string c = JoinPg("c");
  Seed(a);
  auto sa = Open(a, true);
  auto sb = Open(b, true);
  auto sc = Open(c, false);
  const std::vector<float> da = Values(3), db = Values(6), dc = Values(9);
  const uint32_t n = pg()->geometry().num_chunks();
  // Chunk 0 from all three: final; a and b get it at once, c nothing.
  Send(*sa, da, 0);
  Send(*sb, db, 0);
  EXPECT_TRUE(sa->reader.chunks.empty()) << "final before c gave it";
  Send(*sc, dc, 0);
  ASSERT_EQ(sa->reader.chunks.size(), 1u);
  ASSERT_EQ(sb->reader.chunks.size(), 1u);
  EXPECT_EQ(sa->reader.chunks[0].index, 0u);
  EXPECT_TRUE(sa->reader.messages.empty());
  EXPECT_TRUE(sc->reader.chunks.empty());
  EXPECT_EQ(sa->machine->phase(), SyncServerStream::Phase::kReceiving);
  // One write at a time: chunk 1 waits for chunk 0's write to complete.
  for (auto* s : {sa.get(), sb.get(), sc.get()}) {
    Send(*s, s == sa.get() ? da : s == sb.get() ? db : dc, 1);
  }
  EXPECT_EQ(sa->reader.chunks.size(), 1u);
  sa->reader.Pump(*sa->machine);
  EXPECT_EQ(sa->reader.chunks.size(), 2u);
  // The rest: a and b first, c last closes the round.
  for (uint32_t k = 2; k < n; ++k) {
    Send(*sa, da, k);
    Send(*sb, db, k);
  }
  for (uint32_t k = 2; k < n; ++k) Send(*sc, dc, k);
  for (auto* s : {sa.get(), sb.get(), sc.get()}) {
    s->reader.Pump(*s->machine);
    ASSERT_TRUE(s->reader.finished);
    ASSERT_TRUE(s->reader.status.ok()) << s->reader.status;
  }
  const Got ga = Collect(sa->reader);
  const Got gb = Collect(sb->reader);
  const Got gc = Collect(sc->reader);
  std::vector<float> mean(23);
  for (size_t i = 0; i < 23; ++i) mean[i] = (da[i] + db[i] + dc[i]) / 3;
  EXPECT_EQ(ga.delta, mean);
  EXPECT_EQ(gb.delta, mean);
  EXPECT_EQ(gc.delta, mean);
  EXPECT_EQ(ga.result.payload(), v1::RESULT_PAYLOAD_DELTA);
  EXPECT_TRUE(ga.result.contributed());
  EXPECT_EQ(ga.result.contributors(), 3u);
  // c asked for none: every chunk after its header, in order.
  for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(gc.position[k], int(k));
  // One wire form for all.
  EXPECT_EQ(sa->reader.chunks[0].chunk.data.data(),
            sc->reader.chunks[0].chunk.data.data());
  // The committed state is the anchor (zeros) plus what was sent.
  auto state = pg()->GetState(MemberId(a));
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, mean);
}

// A member dies after some chunks were final: those were sent and stay as
// they were (the mean of all three); the others are the mean of the two
// that finished, sent after the close; nothing is sent twice.
TEST_F(EarlyResultsTest, MemberDiesAfterSomeChunksFinal_SentChunksNeverChange) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  const std::string c = JoinPg("c");
  Seed(a);
  auto sa = Open(a, true);
  auto sb = Open(b, true);
  auto sc = Open(c, true);
  const std::vector<float> da = Values(3), db = Values(6), dc = Values(9);
  const uint32_t n = pg()->geometry().num_chunks();
  SendInStep({sa.get(), sb.get(), sc.get()}, {&da, &db, &dc}, 0, 3);
  ASSERT_EQ(sa->reader.chunks.size(), 3u);
  ASSERT_EQ(sc->reader.chunks.size(), 3u);
  // c's stream breaks and c leaves.
  sc->machine->OnCancel();
  ASSERT_TRUE(sc->reader.finished);
  EXPECT_EQ(sc->reader.status.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(pg()->Leave(MemberId(c)).ok());
  for (uint32_t k = 3; k < n; ++k) {
    Send(*sa, da, k);
    Send(*sb, db, k);
  }
  for (auto* s : {sa.get(), sb.get()}) {
    s->reader.Pump(*s->machine);
    ASSERT_TRUE(s->reader.status.ok()) << s->reader.status;
  }
  EXPECT_EQ(sc->reader.actions_after_finish, 0);
  const Got ga = Collect(sa->reader);
  const Got gb = Collect(sb->reader);
  const std::vector<float> want = MeanOfThreeThenTwo(da, db, dc, 3);
  EXPECT_EQ(ga.delta, want);
  EXPECT_EQ(gb.delta, want);
  EXPECT_EQ(ga.result.contributors(), 2u);
  for (uint32_t k = 0; k < 3; ++k) EXPECT_EQ(ga.position[k], int(k));
  auto state = pg()->GetState(MemberId(a));
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, want);
  const JobStatusSnapshot status = pg()->Status(1);
  ASSERT_EQ(status.recent_rounds.size(), 1u);
  EXPECT_EQ(status.recent_rounds[0].dropped, std::vector<std::string>{"c"});
}

// The round closes at its deadline while c, whose first chunks were final,
// still sends: c's stream goes on sending every result chunk early, each
// once, while it reads c's rest, since a member that paces its upload on
// the results (ClientOptions::max_lead_chunks) sends no more until they
// come; the header follows c's last chunk, and c adopts as a late member.
TEST_F(EarlyResultsTest, RoundClosesWhileMemberSends_RestSentEarly) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  const std::string c = JoinPg("c");
  Seed(a);
  auto sa = Open(a, true);
  auto sb = Open(b, true);
  auto sc = Open(c, true);
  const std::vector<float> da = Values(3), db = Values(6), dc = Values(9);
  const uint32_t n = pg()->geometry().num_chunks();
  SendInStep({sa.get(), sb.get(), sc.get()}, {&da, &db, &dc}, 0, 3);
  for (uint32_t k = 3; k < n; ++k) {
    Send(*sa, da, k);
    Send(*sb, db, k);
  }
  ASSERT_EQ(sc->reader.chunks.size(), 3u);
  clock_.Advance(absl::Seconds(6));
  coordinator_->Tick();
  // c sends nothing more: the rest still comes, before any header.
  sc->reader.Pump(*sc->machine);
  EXPECT_EQ(sc->reader.chunks.size(), n);
  EXPECT_TRUE(sc->reader.messages.empty()) << "header before c's last chunk";
  EXPECT_EQ(sc->machine->phase(), SyncServerStream::Phase::kReceiving);
  for (uint32_t k = 3; k < n; ++k) Send(*sc, dc, k);
  for (auto* s : {sa.get(), sb.get(), sc.get()}) {
    s->reader.Pump(*s->machine);
    ASSERT_TRUE(s->reader.finished);
    ASSERT_TRUE(s->reader.status.ok()) << s->reader.status;
  }
  const std::vector<float> want = MeanOfThreeThenTwo(da, db, dc, 3);
  const Got gc = Collect(sc->reader);
  EXPECT_EQ(gc.delta, want);
  EXPECT_EQ(gc.result.payload(), v1::RESULT_PAYLOAD_DELTA);
  EXPECT_FALSE(gc.result.contributed());
  for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(gc.position[k], int(k));
  EXPECT_EQ(Collect(sa->reader).delta, want);
  auto state = pg()->GetState(MemberId(a));
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, want);
}

// The job stops while members that got early chunks still send: their
// streams end at once with the job's status (a paced member would wait for
// results that never come), after the write in flight.
TEST_F(EarlyResultsTest, JobStopsWhileMembersSend_StreamsEndAtOnce) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  Seed(a);
  auto sa = Open(a, true);
  auto sb = Open(b, true);
  Send(*sa, Values(3), 0);
  Send(*sb, Values(6), 0);
  ASSERT_TRUE(sa->reader.write.has_value());
  sb->reader.Pump(*sb->machine);
  pg()->Stop();
  EXPECT_TRUE(sb->reader.finished);
  EXPECT_EQ(sb->reader.status.code(), absl::StatusCode::kUnavailable)
      << sb->reader.status;
  EXPECT_FALSE(sa->reader.finished) << "finished with a write in flight";
  sa->reader.Pump(*sa->machine);
  ASSERT_TRUE(sa->reader.finished);
  EXPECT_EQ(sa->reader.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(sa->reader.actions_after_finish, 0);
  EXPECT_EQ(sb->reader.actions_after_finish, 0);
}

// The wire cache keeps one delta form per job: another stream asking for
// another state's (a straggler's late result, a retry) in the middle of a
// round must not void the early chunks already sent (a regression once).
TEST_F(EarlyResultsTest, CacheEntryReplacedMidRound_EarlyStreamsStillEndOk) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  Seed(a);
  auto sa = Open(a, true);
  auto sb = Open(b, true);
  const std::vector<float> da = Values(3), db = Values(6);
  Send(*sa, da, 0);
  Send(*sb, db, 0);
  ASSERT_EQ(sa->reader.chunks.size(), 1u);
  // Another state's delta form takes the cache's slot.
  absl::StatusOr<std::shared_ptr<const StateSnapshot>> seed =
      pg()->GetState(MemberId(a));
  ASSERT_TRUE(seed.ok());
  auto other = std::make_shared<StateSnapshot>(**seed);
  other->delta.assign(
      WireBytes(DType::kFloat32, pg()->geometry().num_elements()), '\0');
  std::shared_ptr<const StateWire> held = wires_.For(*pg(), other, true);
  for (uint32_t k = 1; k < pg()->geometry().num_chunks(); ++k) {
    Send(*sa, da, k);
    Send(*sb, db, k);
  }
  for (auto* s : {sa.get(), sb.get()}) {
    s->reader.Pump(*s->machine);
    ASSERT_TRUE(s->reader.finished);
    EXPECT_TRUE(s->reader.status.ok()) << s->reader.status;
  }
  std::vector<float> mean(23);
  for (size_t i = 0; i < 23; ++i) mean[i] = (da[i] + db[i]) / 2;
  EXPECT_EQ(Collect(sa->reader).delta, mean);
  EXPECT_EQ(Collect(sb->reader).delta, mean);
}

// A stream that comes after chunks were final gets them at once; one that
// fails after early chunks finishes only once its write is done.
TEST_F(EarlyResultsTest, LateStreamGetsFinalChunksAndFailureWaitsForWrite) {
  const std::string a = JoinPg("a");
  const std::string b = JoinPg("b");
  Seed(a);
  auto sa = Open(a, false);
  auto sb = Open(b, false);
  const std::vector<float> da = Values(3), db = Values(6);
  Send(*sa, da, 0);
  Send(*sa, da, 1);
  Send(*sb, db, 0);
  Send(*sb, db, 1);
  // b's stream breaks; its retry asks for early results and gets chunks 0
  // and 1 at once (one write now, the next when it completes).
  sb->machine->OnCancel();
  ASSERT_TRUE(sb->reader.finished);
  auto retry = Open(b, true);
  ASSERT_EQ(retry->reader.chunks.size(), 1u);
  retry->reader.Pump(*retry->machine);
  ASSERT_EQ(retry->reader.chunks.size(), 2u);
  EXPECT_EQ(retry->reader.chunks[0].index, 0u);
  EXPECT_EQ(retry->reader.chunks[1].index, 1u);
  // A chunk out of range fails the retry; chunk 2 becomes final first
  // and its write is in flight: the finish waits for it.
  Send(*sa, da, 2);
  Send(*retry, db, 2);
  ASSERT_TRUE(retry->reader.write.has_value());
  ASSERT_TRUE(retry->reader.TakeRead());
  v1::SyncRequest bad = PgChunk(db, 0);
  bad.mutable_chunk()->set_index(99);
  retry->machine->OnMessage(bad);
  EXPECT_FALSE(retry->reader.finished) << "finished with a write in flight";
  EXPECT_EQ(retry->machine->phase(), SyncServerStream::Phase::kDraining);
  retry->reader.write.reset();
  retry->machine->OnWriteDone(true);
  ASSERT_TRUE(retry->reader.finished);
  EXPECT_EQ(retry->reader.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(retry->reader.actions_after_finish, 0);
  EXPECT_EQ(retry->reader.chunks.size(), 3u);
}

TEST_F(StreamsTest, FetchState_HeaderThenTheStateChunkByChunk) {
  const std::string a = Join("a", DType::kBFloat16);
  {
    auto seed = NewSync();
    SendAll(*seed, a, 0, Values(1));
    seed->reader.Pump(*seed->machine);
    ASSERT_TRUE(seed->reader.status.ok()) << seed->reader.status;
  }
  Reader reader;
  FetchStateServerStream machine(coordinator_.get(), &wires_, nullptr,
                                 reader.Sink());
  v1::FetchStateRequest request;
  request.set_job_id("j");
  request.set_member_id(a);
  request.set_layout_fingerprint(SmallLayout().fingerprint);
  machine.Start(request);
  ASSERT_EQ(reader.messages.size(), 1u);
  reader.Pump(machine);
  ASSERT_TRUE(reader.finished);
  EXPECT_TRUE(reader.status.ok()) << reader.status;
  v1::FetchStateResponse header;
  ASSERT_TRUE(header.ParseFromString(reader.messages[0]));
  EXPECT_EQ(header.header().round(), 0u);
  EXPECT_EQ(header.header().num_chunks(), 6u);
  EXPECT_EQ(Received(reader), Values(1));  // exact in bfloat16
  EXPECT_EQ(reader.reads_asked, 0);
}

TEST_F(StreamsTest, FetchState_Refusals_EachItsStatusAndNoWrite) {
  const std::string a = Join("a");
  struct Case {
    std::string name;
    std::string job, member;
    uint64_t fingerprint;
    absl::StatusCode code;
  };
  const uint64_t fp = SmallLayout().fingerprint;
  const std::vector<Case> cases = {
      {"unknown job", "nope", a, fp, absl::StatusCode::kNotFound},
      {"malformed member", "j", "zz", fp, absl::StatusCode::kInvalidArgument},
      {"no fingerprint", "j", a, 0, absl::StatusCode::kInvalidArgument},
      {"other fingerprint", "j", a, 7, absl::StatusCode::kFailedPrecondition},
      {"no state yet", "j", a, fp, absl::StatusCode::kFailedPrecondition},
  };
  for (const Case& c : cases) {
    Reader reader;
    FetchStateServerStream machine(coordinator_.get(), &wires_, nullptr,
                                   reader.Sink());
    v1::FetchStateRequest request;
    request.set_job_id(c.job);
    request.set_member_id(c.member);
    request.set_layout_fingerprint(c.fingerprint);
    machine.Start(request);
    ASSERT_TRUE(reader.finished) << c.name;
    EXPECT_EQ(reader.status.code(), c.code) << c.name << ": " << reader.status;
    EXPECT_TRUE(reader.messages.empty()) << c.name;
  }
  Reader unreadable;
  FetchStateServerStream machine(coordinator_.get(), &wires_, nullptr,
                                 unreadable.Sink());
  machine.OnUnreadable(absl::InvalidArgumentError("does not parse"));
  ASSERT_TRUE(unreadable.finished);
  EXPECT_EQ(unreadable.status.code(), absl::StatusCode::kInvalidArgument);
}

TEST(StateWireTest, Bfloat16_EncodedOnceAndChecksummed) {
  auto state = std::make_shared<StateSnapshot>();
  state->round = 3;
  state->values = {1.0f, 2.5f, -3.0f, 0.5f, 8.0f};
  const ChunkGeometry geometry(5, 2);
  StateWire wire(state, geometry, DType::kBFloat16, StateWire::Form::kValues);
  EXPECT_EQ(wire.num_chunks(), 3u);
  EXPECT_EQ(wire.round(), 3u);
  const StateWire::Chunk first = wire.Get(1);
  const StateWire::Chunk again = wire.Get(1);
  EXPECT_EQ(first.data.data(), again.data.data());  // not encoded twice
  EXPECT_EQ(first.data.size(), 4u);
  EXPECT_EQ(first.crc32c, Crc32c(0, first.data));
  std::string want;
  EncodeValues(absl::MakeConstSpan(state->values).subspan(2, 2),
               DType::kBFloat16, &want);
  EXPECT_EQ(first.data, want);
  EXPECT_EQ(wire.Get(2).data.size(), 2u);  // the short last chunk
}

TEST(StateWireTest, Float32_IsTheStatesOwnBytes) {
  auto state = std::make_shared<StateSnapshot>();
  state->values = {1.0f, 2.0f, 3.0f};
  StateWire wire(state, ChunkGeometry(3, 2), DType::kFloat32,
                 StateWire::Form::kValues);
  const StateWire::Chunk c = wire.Get(1);
  EXPECT_EQ(c.data.data(), reinterpret_cast<const char*>(&state->values[2]));
  EXPECT_EQ(c.crc32c, Crc32c(0, c.data));
}

}  // namespace
}  // namespace localsgd
