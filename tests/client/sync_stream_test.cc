// The client's Sync and FetchState stream machines (client/sync_stream.h)
// against scripted coordinator replies, without gRPC: every refusal path
// has a row of the table, and the exact results (the contribution sent,
// the result decoded onto the anchor) are checked against an independent
// computation.
#include "client/sync_stream.h"

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/member_state.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {
namespace {

using Kind = ClientStreamAction::Kind;
using ::testing::HasSubstr;

constexpr uint32_t kChunkElements = 4;
constexpr uint32_t kChunks = 3;
constexpr uint32_t kElements = kChunkElements * kChunks - 1;  // short last
constexpr uint64_t kAnchorId = 0xa11c;

struct Job {
  Contribution contribution = Contribution::kPseudoGradients;
  DType wire = DType::kFloat32;
  bool early = true;
  uint64_t lead = 0;
  // The highest epoch seen for the shard (SyncStreamOptions::min_epoch).
  uint64_t min_epoch = 0;
  // SyncStreamOptions::on_early.
  std::function<void(uint32_t, absl::Span<const float>)> on_early = nullptr;
  // ClientOptions::error_reset, and the Sync's SyncWork::last.
  bool error_reset = false;
  bool last = false;
};

// A member of a job of kElements values in kChunks chunks, its anchor
// fetched (pseudo-gradient jobs) and its parameters = anchor + 0.5 + i/8.
class Harness {
 public:
  explicit Harness(const Job& job, RoundId round = 1) : job_(job) {
    JoinInfo info;
    info.settings.contribution = job.contribution;
    info.settings.wire_dtype = job.wire;
    info.settings.chunk_elements = kChunkElements;
    info.num_elements = kElements;
    info.num_chunks = kChunks;
    info.state_round = 4;
    member_.OnJoined(info, kElements);
    member_.set_error_reset(job.error_reset);
    for (uint32_t i = 0; i < kElements; ++i) anchor_.push_back(1.0f + i);
    if (job.contribution == Contribution::kPseudoGradients) FetchAnchor();
    params_ = anchor_;
    for (uint32_t i = 0; i < kElements; ++i) params_[i] += 0.5f + i / 8.0f;
    before_ = params_;
    SyncPlan plan;
    plan.round = round;
    plan.last = job.last;
    member_.BeginSync(plan, absl::MakeSpan(params_));
    member_.BeginAttempt();
    SyncStreamOptions options;
    options.job_id = "job";
    options.member_id = MemberId("m");
    options.layout_fingerprint = 7;
    options.early_results = job.early;
    options.max_lead_chunks = job.lead;
    options.min_epoch = job.min_epoch;
    options.on_early = job.on_early;
    machine_ = std::make_unique<SyncClientStream>(
        &member_, &staging_, &clock_, options,
        [this](ClientStreamAction a) { Take(std::move(a)); });
    machine_->Start();
  }

  // Completes writes until the writes are done or paced.
  void WriteAll() {
    while (write_in_flight_ && !machine_->finished()) WriteDone();
  }
  void WriteDone(bool ok = true) {
    ASSERT_TRUE(write_in_flight_);
    write_in_flight_ = false;
    machine_->OnWriteDone(ok);
  }

  // The result message: a delta result of round 5 with id 0x5 unless told.
  void Result(v1::ResultPayload payload, uint64_t state_id = 0x5,
              uint64_t epoch = 0) {
    v1::SyncResponse response;
    v1::SyncResult* r = response.mutable_result();
    r->set_round(5);
    r->set_contributed(true);
    r->set_contributors(2);
    r->set_contributor_weight(2);
    r->set_state_id(state_id);
    r->set_payload(payload);
    r->set_epoch(epoch);
    Read([&] { machine_->OnMessage(response); });
  }
  void DeltaResult() {
    Result(job_.contribution == Contribution::kPseudoGradients
               ? v1::RESULT_PAYLOAD_DELTA
               : v1::RESULT_PAYLOAD_UNSPECIFIED,
           job_.contribution == Contribution::kPseudoGradients ? 0x5 : 0);
  }

  // Result chunk j: the values ResultValue(i) (a delta of a pseudo-
  // gradient job, the new parameters of a parameter job) in the wire dtype,
  // with `mutate` applied to the message before it goes.
  void Chunk(uint32_t j,
             const std::function<void(v1::Chunk&)>& mutate = nullptr) {
    const ChunkGeometry g(kElements, kChunkElements);
    std::vector<float> values;
    for (uint32_t i = 0; i < g.Size(j); ++i) {
      values.push_back(ResultValue(g.Offset(j) + i));
    }
    v1::SyncResponse response;
    v1::Chunk* chunk = response.mutable_chunk();
    chunk->set_index(j);
    EncodeValues(values, job_.wire, chunk->mutable_data());
    chunk->set_crc32c(Crc32c(0, chunk->data()));
    if (mutate) mutate(*chunk);
    Read([&] { machine_->OnMessage(response); });
  }
  void AllChunks() {
    for (uint32_t j = 0; j < kChunks; ++j) Chunk(j);
  }
  static float ResultValue(uint32_t i) { return 0.25f * (i % 5) - 0.5f; }

  // The stream ends (if the machine is not finished) and the call with
  // `call`; the Sync's status, committed or rolled back as Replica does.
  absl::Status End(absl::Status call = absl::OkStatus()) {
    if (!machine_->finished()) machine_->OnReadsDone();
    absl::Status s = machine_->Conclude(call);
    if (s.ok()) {
      member_.CommitSync(machine_->outcome());
    } else {
      member_.RollBack();
    }
    return s;
  }

  SyncClientStream& machine() { return *machine_; }
  MemberState& member() { return member_; }
  const std::vector<ClientStreamAction>& actions() const { return actions_; }
  const std::vector<float>& params() const { return params_; }
  const std::vector<float>& before() const { return before_; }
  const std::vector<float>& anchor() const { return anchor_; }
  int finishes() const { return finishes_; }
  bool cancelled() const { return cancelled_; }
  // Chunk indices written, in order.
  std::vector<uint32_t> Written() const {
    std::vector<uint32_t> out;
    for (const auto& a : actions_) {
      if (a.kind == Kind::kWriteChunk) out.push_back(a.index);
    }
    return out;
  }

 private:
  void FetchAnchor() {
    std::vector<float> ignored(kElements);
    v1::FetchStateRequest request;
    FetchStateClientStream fetch(&member_, absl::MakeSpan(ignored), request,
                                 [](ClientStreamAction) {});
    fetch.Start();
    v1::FetchStateResponse header;
    header.mutable_header()->set_round(4);
    header.mutable_header()->set_state_id(kAnchorId);
    header.mutable_header()->set_num_chunks(kChunks);
    fetch.OnMessage(header);
    const ChunkGeometry g(kElements, kChunkElements);
    for (uint32_t j = 0; j < kChunks; ++j) {
      v1::FetchStateResponse chunk;
      chunk.mutable_chunk()->set_index(j);
      EncodeValues(absl::MakeConstSpan(anchor_).subspan(g.Offset(j), g.Size(j)),
                   DType::kFloat32, chunk.mutable_chunk()->mutable_data());
      chunk.mutable_chunk()->set_crc32c(Crc32c(0, chunk.chunk().data()));
      fetch.OnMessage(chunk);
    }
    fetch.OnReadsDone();
    ASSERT_TRUE(fetch.Conclude(absl::OkStatus()).ok());
    ASSERT_TRUE(member_
                    .CommitFetch(fetch.round(), fetch.state_id(),
                                 absl::MakeSpan(ignored))
                    .ok());
  }

  // A read completes with what `deliver` hands the machine.
  void Read(const std::function<void()>& deliver) {
    ASSERT_FALSE(machine_->finished()) << "a read after kFinish";
    ASSERT_TRUE(read_in_flight_) << "a reply the machine did not read for";
    read_in_flight_ = false;
    deliver();
  }

  void Take(ClientStreamAction a) {
    EXPECT_EQ(finishes_, 0) << "an action after kFinish";
    switch (a.kind) {
      case Kind::kWriteMessage:
      case Kind::kWriteChunk:
      case Kind::kWritesDone:
        EXPECT_FALSE(write_in_flight_) << "two writes in flight";
        write_in_flight_ = true;
        break;
      case Kind::kRead:
        EXPECT_FALSE(read_in_flight_) << "two reads in flight";
        read_in_flight_ = true;
        break;
      case Kind::kFinish:
        ++finishes_;
        cancelled_ = a.cancel;
        break;
    }
    actions_.push_back(std::move(a));
  }

  const Job job_;
  FakeClock clock_;
  MemberState member_;
  StagingPool staging_;
  std::vector<float> anchor_;
  std::vector<float> params_;
  std::vector<float> before_;
  std::unique_ptr<SyncClientStream> machine_;
  std::vector<ClientStreamAction> actions_;
  bool write_in_flight_ = false;
  bool read_in_flight_ = false;
  int finishes_ = 0;
  bool cancelled_ = false;
};

const Job kParams{Contribution::kParameters, DType::kFloat32, false, 0};
const Job kDelta{Contribution::kPseudoGradients, DType::kFloat32, true, 0};
const Job kDeltaHalf{Contribution::kPseudoGradients, DType::kFloat32, false, 0};

struct RefusalCase {
  std::string name;
  Job job;
  std::function<void(Harness&)> script;
  absl::StatusCode code;
  std::string message;
  // Whether the machine refused (cancelling the call) rather than the
  // stream ending short.
  bool cancel = true;
};

class SyncRefusalTest : public ::testing::TestWithParam<RefusalCase> {};

TEST_P(SyncRefusalTest, RefusesWithItsStatusAndLeavesParamsAsTheyWere) {
  const RefusalCase& c = GetParam();
  Harness h(c.job);
  c.script(h);
  const absl::Status s = h.End();
  EXPECT_EQ(s.code(), c.code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  EXPECT_EQ(h.finishes(), 1);
  EXPECT_EQ(h.cancelled(), c.cancel);
  EXPECT_EQ(h.params(), h.before()) << "a failed Sync changed the params";
  EXPECT_EQ(
      h.member().anchor_id(),
      c.job.contribution == Contribution::kPseudoGradients ? kAnchorId : 0u);
}

std::vector<RefusalCase> RefusalCases() {
  using C = absl::StatusCode;
  return {
      // A deposed primary (its epoch below one the member has seen): none
      // of its result is applied, early chunks included, and the call moves
      // on (UNAVAILABLE).
      {"ResultOfALowerEpoch_IsUnavailable",
       Job{Contribution::kPseudoGradients, DType::kFloat32, true, 0, 7},
       [](Harness& h) {
         h.Chunk(0);
         h.WriteAll();
         h.Result(v1::RESULT_PAYLOAD_DELTA);  // epoch 0
       },
       C::kUnavailable, "answered for epoch 0, older than epoch 7"},
      {"ChunkBeforeResult_WithoutEarlyResults", kParams,
       [](Harness& h) {
         h.WriteAll();
         h.Chunk(0);
       },
       C::kInternal, "Sync sent a chunk before its result"},
      {"SecondResult", kParams,
       [](Harness& h) {
         h.WriteAll();
         h.DeltaResult();
         h.Chunk(0);
         h.DeltaResult();
       },
       C::kInternal, "Sync sent a second result"},
      {"NeitherResultNorChunk", kDelta,
       [](Harness& h) {
         h.WriteAll();
         v1::SyncResponse empty;
         h.machine().OnMessage(empty);
       },
       C::kInternal, "neither result nor chunk"},
      {"EarlyChunksThenAStateResult", kDelta,
       [](Harness& h) {
         h.Chunk(0);
         h.WriteAll();
         h.Result(v1::RESULT_PAYLOAD_STATE);
       },
       C::kInternal, "early result chunks and then a result that is not"},
      {"ParameterJob_ResultSaysDelta", kParams,
       [](Harness& h) {
         h.WriteAll();
         h.Result(v1::RESULT_PAYLOAD_DELTA, 0);
       },
       C::kInternal, "parameter job says it carries a delta"},
      {"PseudoGradientResult_NoStateId", kDelta,
       [](Harness& h) {
         h.WriteAll();
         h.Result(v1::RESULT_PAYLOAD_DELTA, 0);
       },
       C::kInternal, "names no state id"},
      {"PseudoGradientResult_UnknownPayload", kDelta,
       [](Harness& h) {
         h.WriteAll();
         h.Result(static_cast<v1::ResultPayload>(9));
       },
       C::kInternal, "has payload 9"},
      {"PseudoGradientResult_UnspecifiedPayload", kDeltaHalf,
       [](Harness& h) {
         h.WriteAll();
         h.Result(v1::RESULT_PAYLOAD_UNSPECIFIED);
       },
       C::kInternal, "has payload 0"},
      {"ChunkRepeated", kDelta,
       [](Harness& h) {
         h.Chunk(1);
         h.Chunk(1);
       },
       C::kInternal, "Sync result stream out of order at chunk 1"},
      {"ChunkIndexOutOfRange", kDelta,
       [](Harness& h) {
         h.Chunk(0, [](v1::Chunk& c) { c.set_index(kChunks); });
       },
       C::kInternal, "out of order at chunk 3"},
      {"ChunkWithoutCrc", kDelta,
       [](Harness& h) { h.Chunk(0, [](v1::Chunk& c) { c.clear_crc32c(); }); },
       C::kInternal, "chunk 0 has no crc32c"},
      {"ChunkOfTheWrongSize", kDelta,
       [](Harness& h) {
         h.Chunk(2, [](v1::Chunk& c) {
           c.mutable_data()->append("abcd");
           c.set_crc32c(Crc32c(0, c.data()));
         });
       },
       C::kInternal, "chunk 2 has 16 bytes; expected 12 (3 float32 values)"},
      {"ChunkFailsItsCrc_IsDataLoss", kDelta,
       [](Harness& h) {
         h.Chunk(0, [](v1::Chunk& c) { c.set_crc32c(c.crc32c() ^ 1); });
       },
       C::kDataLoss, "does not match its CRC32C"},
      {"UnreadableMessage", kDelta,
       [](Harness& h) {
         h.machine().OnUnreadable(
             absl::InvalidArgumentError("Sync response of 3 bytes does not "
                                        "parse"));
       },
       C::kInternal, "does not parse"},
      {"EndsWithoutResult_IsUnavailable", kDelta,
       [](Harness& h) {
         h.WriteAll();
         h.AllChunks();
       },
       C::kUnavailable, "Sync ended without its result", /*cancel=*/false},
      {"EndsWithChunksMissing_IsUnavailable", kParams,
       [](Harness& h) {
         h.WriteAll();
         h.DeltaResult();
         h.Chunk(0);
       },
       C::kUnavailable, "Sync result ended after 1 of 3 chunks",
       /*cancel=*/false},
      {"WriteFails_ThenTheCallEnds", kDelta,
       [](Harness& h) { h.WriteDone(/*ok=*/false); }, C::kUnavailable,
       "Sync ended without its result", /*cancel=*/false},
  };
}

INSTANTIATE_TEST_SUITE_P(Table, SyncRefusalTest,
                         ::testing::ValuesIn(RefusalCases()),
                         [](const ::testing::TestParamInfo<RefusalCase>& info) {
                           return info.param.name;
                         });

TEST(SyncClientStreamTest, CallErrorComesThrough_ParamsAsTheyWere) {
  Harness h(kParams);
  h.WriteAll();
  h.DeltaResult();
  h.Chunk(0);  // overwrites chunk 0 of the parameters
  const absl::Status s = h.End(absl::DeadlineExceededError("deadline"));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.params(), h.before());
}

TEST(SyncClientStreamTest, ResultOfTheSameOrAHigherEpoch_IsTaken) {
  for (const uint64_t epoch : {uint64_t{7}, uint64_t{9}}) {
    Harness h(Job{Contribution::kPseudoGradients, DType::kFloat32, true, 0, 7});
    h.WriteAll();
    h.Result(v1::RESULT_PAYLOAD_DELTA, 0x5, epoch);
    h.AllChunks();
    ASSERT_TRUE(h.End().ok()) << epoch;
    EXPECT_EQ(h.machine().outcome().epoch, epoch);
  }
}

TEST(SyncClientStreamTest, Delta_SendsParamsMinusAnchor_ResultOntoAnchor) {
  Harness h(kDelta);
  h.WriteAll();
  ASSERT_EQ(h.Written(), (std::vector<uint32_t>{0, 1, 2}));
  // The header, then every chunk: params - anchor, bit for bit.
  ASSERT_EQ(h.actions()[0].kind, Kind::kWriteMessage);
  v1::SyncRequest header;
  ASSERT_TRUE(header.ParseFromString(h.actions()[0].message));
  EXPECT_EQ(header.header().round(), 1u);
  EXPECT_EQ(header.header().anchor_state_id(), kAnchorId);
  EXPECT_TRUE(header.header().early_results());
  const ChunkGeometry g(kElements, kChunkElements);
  for (const ClientStreamAction& a : h.actions()) {
    if (a.kind != Kind::kWriteChunk) continue;
    EXPECT_EQ(a.crc32c, Crc32c(0, *a.payload));
    std::vector<float> sent(g.Size(a.index));
    ASSERT_TRUE(
        DecodeValues(*a.payload, DType::kFloat32, absl::MakeSpan(sent)).ok());
    for (uint32_t i = 0; i < sent.size(); ++i) {
      const uint32_t e = g.Offset(a.index) + i;
      EXPECT_EQ(sent[i], h.before()[e] - h.anchor()[e]) << e;
    }
  }
  h.Chunk(1);  // early
  h.DeltaResult();
  h.Chunk(0);
  h.Chunk(2);
  ASSERT_TRUE(h.End().ok());
  EXPECT_EQ(h.machine().outcome().round, 5u);
  EXPECT_EQ(h.machine().outcome().contributors, 2u);
  EXPECT_EQ(h.member().anchor_id(), 0x5u);
  EXPECT_EQ(h.member().state_round(), 5u);
  for (uint32_t e = 0; e < kElements; ++e) {
    EXPECT_EQ(h.params()[e], h.anchor()[e] + Harness::ResultValue(e)) << e;
  }
}

// Each chunk that comes before the result message is told to on_early
// once decoded: its index and the new state's values there (anchor +
// delta); one that does not pass its checks, and those after the result
// message, are not.
TEST(SyncClientStreamTest, EarlyChunks_ToldWithTheirNewValues) {
  std::vector<std::pair<uint32_t, std::vector<float>>> told;
  Job job = kDelta;
  job.on_early = [&](uint32_t j, absl::Span<const float> values) {
    told.emplace_back(j, std::vector<float>(values.begin(), values.end()));
  };
  Harness h(job);
  h.WriteAll();
  h.Chunk(2);
  h.Chunk(1);
  h.DeltaResult();
  h.Chunk(0);
  ASSERT_TRUE(h.End().ok());
  const ChunkGeometry g(kElements, kChunkElements);
  ASSERT_EQ(told.size(), 2u);
  EXPECT_EQ(told[0].first, 2u);
  EXPECT_EQ(told[1].first, 1u);
  for (const auto& [j, values] : told) {
    ASSERT_EQ(values.size(), g.Size(j));
    for (uint32_t i = 0; i < values.size(); ++i) {
      const uint32_t e = g.Offset(j) + i;
      EXPECT_EQ(values[i], h.anchor()[e] + Harness::ResultValue(e)) << e;
      EXPECT_EQ(values[i], h.params()[e]) << "the state the Sync holds";
    }
  }

  told.clear();
  Harness bad(job);
  bad.WriteAll();
  bad.Chunk(1, [](v1::Chunk& c) { c.set_crc32c(c.crc32c() ^ 1); });
  EXPECT_TRUE(told.empty()) << "a chunk that fails its CRC32C";
  EXPECT_EQ(bad.End().code(), absl::StatusCode::kDataLoss);
}

TEST(SyncClientStreamTest, ParameterJob_ResultIntoParams) {
  Harness h(kParams);
  h.WriteAll();
  h.DeltaResult();
  h.AllChunks();
  ASSERT_TRUE(h.End().ok());
  for (uint32_t e = 0; e < kElements; ++e) {
    EXPECT_EQ(h.params()[e], Harness::ResultValue(e)) << e;
  }
}

TEST(SyncClientStreamTest, StateResult_ReplacesTheAnchor) {
  Harness h(kDeltaHalf);
  h.WriteAll();
  h.Result(v1::RESULT_PAYLOAD_STATE);
  h.AllChunks();
  ASSERT_TRUE(h.End().ok());
  for (uint32_t e = 0; e < kElements; ++e) {
    EXPECT_EQ(h.params()[e], Harness::ResultValue(e)) << e;
  }
}

TEST(SyncClientStreamTest, Paced_WritesWaitForResults) {
  Harness h(Job{Contribution::kPseudoGradients, DType::kFloat32, true, 1});
  h.WriteDone();  // the header: chunk 0 goes
  EXPECT_EQ(h.Written(), (std::vector<uint32_t>{0}));
  h.Chunk(0);     // a result back: from now on chunk c < received + 1
  h.WriteDone();  // chunk 0 done: 1 < 2, chunk 1 goes
  EXPECT_EQ(h.Written(), (std::vector<uint32_t>{0, 1}));
  h.WriteDone();  // chunk 1 done: 2 < 2 fails, paced
  EXPECT_EQ(h.machine().write_phase(), SyncClientStream::WritePhase::kPaced);
  EXPECT_EQ(h.machine().outcome().paced_writes, 1u);
  EXPECT_EQ(h.Written(), (std::vector<uint32_t>{0, 1}));
  h.Chunk(1);  // releases chunk 2
  EXPECT_EQ(h.Written(), (std::vector<uint32_t>{0, 1, 2}));
  h.WriteAll();
  EXPECT_EQ(h.machine().write_phase(), SyncClientStream::WritePhase::kDone);
  h.Chunk(2);
  h.DeltaResult();
  EXPECT_TRUE(h.End().ok());
}

// Result chunk j (Harness::Chunk's values in `wire`) decoded onto the
// anchor as DecodeOnto computes it; empty if it does not decode.
std::vector<float> ResultOnAnchor(const Harness& h, uint32_t j, DType wire) {
  const ChunkGeometry g(kElements, kChunkElements);
  std::vector<float> values;
  for (uint32_t i = 0; i < g.Size(j); ++i) {
    values.push_back(Harness::ResultValue(g.Offset(j) + i));
  }
  std::string data;
  EncodeValues(values, wire, &data);
  std::vector<float> out(g.Size(j));
  const absl::Status s = DecodeOnto(
      data, wire,
      absl::MakeConstSpan(h.anchor()).subspan(g.Offset(j), g.Size(j)),
      absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? out : std::vector<float>();
}

TEST(SyncClientStreamTest, Int8Delta_ErrorFeedbackCommittedOnlyOnSuccess) {
  const Job int8{Contribution::kPseudoGradients, DType::kInt8Block, true, 0};
  Harness h(int8);
  h.WriteAll();
  h.DeltaResult();
  h.AllChunks();
  ASSERT_TRUE(h.End().ok());
  // The result decoded onto the anchor as DecodeOnto computes it.
  const ChunkGeometry g(kElements, kChunkElements);
  for (uint32_t j = 0; j < kChunks; ++j) {
    const std::vector<float> want = ResultOnAnchor(h, j, DType::kInt8Block);
    ASSERT_EQ(want.size(), g.Size(j));
    for (uint32_t i = 0; i < g.Size(j); ++i) {
      EXPECT_EQ(h.params()[g.Offset(j) + i], want[i]);
    }
  }
}

// Error reset: the parameters after a counted Sync are the result decoded
// onto the anchor plus what the encoding of params - anchor lost (its
// residual, no earlier feedback added); after a last Sync, the result
// alone.
TEST(SyncClientStreamTest,
     ErrorReset_ParamsAreResultPlusResidual_LastResultAlone) {
  for (const bool last : {false, true}) {
    SCOPED_TRACE(last ? "last" : "not last");
    Job job{Contribution::kPseudoGradients, DType::kInt8Block, true, 0};
    job.error_reset = true;
    job.last = last;
    Harness h(job);
    h.WriteAll();
    h.DeltaResult();
    h.AllChunks();
    ASSERT_TRUE(h.End().ok());
    const ChunkGeometry g(kElements, kChunkElements);
    size_t with_residual = 0;
    for (uint32_t j = 0; j < kChunks; ++j) {
      const size_t off = g.Offset(j), n = g.Size(j);
      const std::vector<float> result = ResultOnAnchor(h, j, DType::kInt8Block);
      ASSERT_EQ(result.size(), n);
      // What the member's upload lost, from a zero residual.
      std::vector<float> delta(n), residual(n, 0.0f), decoded(n);
      for (uint32_t i = 0; i < n; ++i) {
        delta[i] = h.before()[off + i] - h.anchor()[off + i];
      }
      std::string upload(WireBytes(DType::kInt8Block, n), '\0');
      EncodeWithFeedback(delta, absl::MakeSpan(residual), DType::kInt8Block,
                         upload.data(), absl::MakeSpan(decoded));
      for (uint32_t i = 0; i < n; ++i) {
        const float want = last ? result[i] : result[i] + residual[i];
        EXPECT_EQ(h.params()[off + i], want) << "element " << off + i;
        with_residual += residual[i] != 0.0f;
      }
    }
    EXPECT_GT(with_residual, 0u);
  }
}

// --- FetchState ---

struct FetchCase {
  std::string name;
  std::function<void(FetchStateClientStream&)> script;
  absl::StatusCode code;
  std::string message;
  uint64_t min_epoch = 0;
};

v1::FetchStateResponse Header(uint32_t chunks) {
  v1::FetchStateResponse r;
  r.mutable_header()->set_round(3);
  r.mutable_header()->set_state_id(9);
  r.mutable_header()->set_num_chunks(chunks);
  return r;
}

v1::FetchStateResponse StateChunk(uint32_t j) {
  const ChunkGeometry g(kElements, kChunkElements);
  std::vector<float> values(g.Size(j), 2.0f);
  v1::FetchStateResponse r;
  r.mutable_chunk()->set_index(j);
  EncodeValues(values, DType::kFloat32, r.mutable_chunk()->mutable_data());
  r.mutable_chunk()->set_crc32c(Crc32c(0, r.chunk().data()));
  return r;
}

class FetchRefusalTest : public ::testing::TestWithParam<FetchCase> {};

TEST_P(FetchRefusalTest, Refuses) {
  MemberState member;
  JoinInfo info;
  info.settings.contribution = Contribution::kPseudoGradients;
  info.settings.chunk_elements = kChunkElements;
  info.num_elements = kElements;
  info.num_chunks = kChunks;
  member.OnJoined(info, kElements);
  std::vector<float> params(kElements, 1.0f);
  int finishes = 0;
  FetchStateClientStream fetch(
      &member, absl::MakeSpan(params), {},
      [&](ClientStreamAction a) {
        if (a.kind == Kind::kFinish) ++finishes;
      },
      GetParam().min_epoch);
  fetch.Start();
  GetParam().script(fetch);
  if (!fetch.finished()) fetch.OnReadsDone();
  absl::Status s = fetch.Conclude(absl::OkStatus());
  if (s.ok()) {
    s = member.CommitFetch(fetch.round(), fetch.state_id(),
                           absl::MakeSpan(params));
  }
  EXPECT_EQ(s.code(), GetParam().code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(GetParam().message));
  EXPECT_EQ(finishes, 1);
  EXPECT_EQ(params, std::vector<float>(kElements, 1.0f));
}

INSTANTIATE_TEST_SUITE_P(
    Table, FetchRefusalTest,
    ::testing::ValuesIn(std::vector<FetchCase>{
        {"ChunkBeforeHeader",
         [](FetchStateClientStream& f) { f.OnMessage(StateChunk(0)); },
         absl::StatusCode::kInternal,
         "FetchState sent a chunk before its header"},
        {"SecondHeader",
         [](FetchStateClientStream& f) {
           f.OnMessage(Header(kChunks));
           f.OnMessage(Header(kChunks));
         },
         absl::StatusCode::kInternal, "FetchState sent a second header"},
        {"WrongChunkCount",
         [](FetchStateClientStream& f) { f.OnMessage(Header(kChunks + 1)); },
         absl::StatusCode::kInternal,
         "FetchState header says 4 chunks; this member's shard has 3"},
        {"NeitherHeaderNorChunk",
         [](FetchStateClientStream& f) { f.OnMessage({}); },
         absl::StatusCode::kInternal, "neither header nor chunk"},
        {"Unreadable",
         [](FetchStateClientStream& f) {
           f.OnUnreadable(absl::InvalidArgumentError("does not parse"));
         },
         absl::StatusCode::kInternal, "does not parse"},
        {"EndsWithoutHeader", [](FetchStateClientStream&) {},
         absl::StatusCode::kUnavailable, "FetchState ended without its header"},
        {"EndsWithChunksMissing",
         [](FetchStateClientStream& f) {
           f.OnMessage(Header(kChunks));
           f.OnMessage(StateChunk(0));
         },
         absl::StatusCode::kUnavailable, "FetchState ended after 1 of 3"},
        {"HeaderOfALowerEpoch",
         [](FetchStateClientStream& f) {
           v1::FetchStateResponse h = Header(kChunks);
           h.mutable_header()->set_epoch(4);
           f.OnMessage(h);
           for (uint32_t j = 0; j < kChunks; ++j) f.OnMessage(StateChunk(j));
         },
         absl::StatusCode::kUnavailable,
         "answered for epoch 4, older than epoch 5", /*min_epoch=*/5},
        {"PseudoGradientStateWithoutId",
         [](FetchStateClientStream& f) {
           v1::FetchStateResponse h = Header(kChunks);
           h.mutable_header()->set_state_id(0);
           f.OnMessage(h);
           for (uint32_t j = 0; j < kChunks; ++j) f.OnMessage(StateChunk(j));
         },
         absl::StatusCode::kInternal, "names no state id"},
    }),
    [](const ::testing::TestParamInfo<FetchCase>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace localsgd
