// Hostile input on the fields of pseudo-gradient jobs, table-driven: every
// row sends one bad request over the real gRPC service to a job of
// pseudo-gradients (int8 on the wire, or the row's sparse code;
// OUTER_NESTEROV) that two honest library clients run, and checks
//   - the status code and a message that says what is wrong, and
//   - that it changed nothing else: the honest members' next round is bit
//     for bit the round of a twin job that saw no hostile input (two members
//     of weight 1: their sums do not depend on arrival order), and counts
//     exactly the two of them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/sparse_codec.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testkit::kChunk;
using testkit::kElements;
using testkit::TestLayout;

// What a hostile row may use: a raw stub, a raw member of the job (joined
// saying it sends pseudo-gradients) and the id of the state it holds.
struct Env {
  v1::Coordinator::Stub* stub;
  std::string job;
  std::string member;
  uint64_t anchor = 0;
};

v1::JoinRequest PseudoJoin(const std::string& job, const std::string& name) {
  v1::JoinRequest request;
  request.set_job_id(job);
  request.set_member_name(name);
  request.set_incarnation(77);
  request.mutable_settings()->set_contribution(
      v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  LayoutToProto(TestLayout(), request.mutable_layout());
  return request;
}

grpc::Status Join(Env& env, const v1::JoinRequest& request,
                  v1::JoinResponse* response = nullptr) {
  v1::JoinResponse local;
  grpc::ClientContext context;
  return env.stub->Join(&context, request, response ? response : &local);
}

// One Sync stream: `header`, then `chunks` in index order (CRCs fixed);
// returns the status and the result's payload kind.
grpc::Status SyncChunks(Env& env, const v1::SyncHeader& header,
                        const std::vector<std::string>& chunks,
                        v1::ResultPayload* payload = nullptr,
                        v1::SyncResult* result = nullptr) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto stream = env.stub->Sync(&context);
  v1::SyncRequest request;
  *request.mutable_header() = header;
  stream->Write(request);
  for (size_t c = 0; c < chunks.size(); ++c) {
    request.mutable_chunk()->set_index(static_cast<uint32_t>(c));
    request.mutable_chunk()->set_data(chunks[c]);
    request.mutable_chunk()->set_crc32c(Crc32c(0, chunks[c]));
    if (!stream->Write(request)) break;
  }
  stream->WritesDone();
  v1::SyncResponse response;
  while (stream->Read(&response)) {
    if (response.has_result() && payload != nullptr) {
      *payload = response.result().payload();
    }
    if (response.has_result() && result != nullptr) {
      *result = response.result();
    }
  }
  return stream->Finish();
}

// Chunk 0 only: the stream ends early, unless the chunk is refused first.
grpc::Status SyncOneChunk(Env& env, const v1::SyncHeader& header,
                          const std::string& data) {
  return SyncChunks(env, header, {data});
}

// Every chunk of the layout, a valid int8 delta of 0.25.
std::vector<std::string> AllInt8Chunks() {
  std::vector<std::string> out;
  for (uint64_t first = 0; first < kElements; first += kChunk) {
    const size_t n = std::min<uint64_t>(kChunk, kElements - first);
    std::string data;
    EncodeValues(std::vector<float>(n, 0.25f), DType::kInt8Block, &data);
    out.push_back(std::move(data));
  }
  return out;
}

v1::SyncHeader Header(const Env& env, uint64_t round) {
  v1::SyncHeader h;
  h.set_job_id(env.job);
  h.set_member_id(env.member);
  h.set_round(round);
  h.set_layout_fingerprint(TestLayout().fingerprint);
  h.set_anchor_state_id(env.anchor);
  return h;
}

// Chunk 0 (kChunk elements) in int8 with its first scale replaced.
std::string Int8WithScale(float scale) {
  std::string data;
  EncodeValues(std::vector<float>(kChunk, 0.25f), DType::kInt8Block, &data);
  std::memcpy(data.data(), &scale, 4);
  return data;
}

// The sparse rows' code: 768 of 4096 kept, so that a chunk of kChunk (16)
// values keeps 3: 8 bytes of scales, 12 bits of positions (2 bytes, 4
// padding bits: 3 x 2 low bits, then 3 + 3 high), 6 bits of codes (1
// byte). The chunk's values are 0.25 + 0.01 i: it keeps 13, 14 and 15.
constexpr uint32_t kSparseKeep = 768;
constexpr SparseCode kSparseRowCode{kSparseKeep, 2};

// Chunk 0 (kChunk elements) in sparse2, valid: values 0.25 + 0.01 i.
std::string SparseChunk() {
  std::vector<float> values(kChunk);
  for (uint32_t i = 0; i < kChunk; ++i) values[i] = 0.25f + 0.01f * i;
  std::string data(SparseWireBytes(kChunk, kSparseRowCode), '\0');
  EncodeSparseWithFeedback(values, {}, kSparseRowCode, data.data());
  return data;
}

// The sparse chunk with its scales (lo, hi) replaced.
std::string SparseWithScales(float lo, float hi) {
  std::string data = SparseChunk();
  std::memcpy(data.data(), &lo, 4);
  std::memcpy(data.data() + 4, &hi, 4);
  return data;
}

// Sets `width` bits at `bit` of a sparse chunk's positions and codes
// (which follow the 8 bytes of scales) to `value`, LSB first.
void SetSparseBits(std::string& data, size_t bit, size_t width,
                   uint32_t value) {
  for (size_t k = 0; k < width; ++k) {
    const size_t at = 64 + bit + k;
    const char mask = static_cast<char>(1u << (at % 8));
    data[at / 8] =
        (value >> k) & 1 ? (data[at / 8] | mask) : (data[at / 8] & ~mask);
  }
}

// The sparse chunk with those bits set.
std::string SparseWithBits(size_t bit, size_t width, uint32_t value) {
  std::string data = SparseChunk();
  SetSparseBits(data, bit, width, value);
  return data;
}

// The sparse chunk with its three positions written by the letter of the
// format (high parts non-decreasing): 2 low bits each, then entry t's high
// part h (position >> 2) as bit h + t of the next 6.
std::string SparseWithPositions(const std::vector<uint32_t>& positions) {
  std::string data = SparseChunk();
  SetSparseBits(data, 0, 12, 0);
  for (size_t t = 0; t < 3; ++t) {
    SetSparseBits(data, 2 * t, 2, positions[t] & 3u);
    SetSparseBits(data, 6 + (positions[t] >> 2) + t, 1, 1);
  }
  return data;
}

struct Row {
  std::string name;
  std::function<grpc::Status(Env&)> act;
  grpc::StatusCode code;
  std::string message;
  // The job's wire (its sparse code keeps kSparseKeep).
  DType wire = DType::kInt8Block;
};

void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

std::vector<Row> Rows() {
  auto settings_join = [](std::function<void(v1::JobSettings*)> spoil,
                          const std::string& job_suffix = "") {
    return [spoil, job_suffix](Env& env) {
      v1::JoinRequest request = PseudoJoin(env.job + job_suffix, "bad");
      spoil(request.mutable_settings());
      return Join(env, request);
    };
  };
  return {
      {"Join_UnknownContribution_InvalidArgument",
       settings_join([](v1::JobSettings* s) {
         s->set_contribution(static_cast<v1::Contribution>(7));
       }),
       grpc::StatusCode::INVALID_ARGUMENT,
       "settings.contribution has unknown value 7"},
      {"Join_UnknownAveragingMode_InvalidArgument",
       settings_join([](v1::JobSettings* s) {
         s->set_mode(static_cast<v1::AveragingMode>(9));
       }),
       grpc::StatusCode::INVALID_ARGUMENT, "settings.mode has unknown value 9"},
      {"Join_OuterLrNaN_InvalidArgument", settings_join([](v1::JobSettings* s) {
         s->set_outer_lr(std::numeric_limits<float>::quiet_NaN());
       }),
       grpc::StatusCode::INVALID_ARGUMENT, "outer_lr nan is out of range"},
      {"Join_OuterLrNegative_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_outer_lr(-0.5f); }),
       grpc::StatusCode::INVALID_ARGUMENT, "outer_lr -0.5 is out of range"},
      {"Join_OuterMomentumOne_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_outer_momentum(1.0f); }),
       grpc::StatusCode::INVALID_ARGUMENT, "outer_momentum 1 is out of range"},
      {"Join_OutlierRatioBelowTwo_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_outlier_ratio(1.5f); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       "outlier_ratio 1.5 is out of range; use [2, 1e+09], or -1"},
      {"Join_OutlierRatioNaN_InvalidArgument",
       settings_join([](v1::JobSettings* s) {
         s->set_outlier_ratio(std::numeric_limits<float>::quiet_NaN());
       }),
       grpc::StatusCode::INVALID_ARGUMENT, "outlier_ratio nan is out of range"},
      {"Join_OutlierRatioInfinite_InvalidArgument",
       settings_join([](v1::JobSettings* s) {
         s->set_outlier_ratio(std::numeric_limits<float>::infinity());
       }),
       grpc::StatusCode::INVALID_ARGUMENT, "outlier_ratio inf is out of range"},
      {"Join_OutlierRatioNegativeNotOff_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_outlier_ratio(-2.0f); }),
       grpc::StatusCode::INVALID_ARGUMENT, "outlier_ratio -2 is out of range"},
      {"Join_OtherOutlierRatio_FailedPreconditionNamingBoth",
       settings_join([](v1::JobSettings* s) { s->set_outlier_ratio(-1.0f); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "uses outlier ratio 10; member asks for off"},
      {"Join_OtherRule_FailedPreconditionNamingBoth",
       settings_join([](v1::JobSettings* s) {
         s->set_mode(v1::AVERAGING_MODE_OUTER_SGD);
       }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "uses averaging mode outer_nesterov; member asks for outer_sgd"},
      {"Join_OtherOuterLr_FailedPreconditionNamingBoth",
       settings_join([](v1::JobSettings* s) { s->set_outer_lr(0.5f); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "uses outer learning rate 0.7; member asks for 0.5"},
      {"Join_ParametersIntoPseudoGradientJob_FailedPrecondition",
       settings_join([](v1::JobSettings* s) {
         s->set_contribution(v1::CONTRIBUTION_PARAMETERS);
       }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "takes pseudo_gradients; member sends parameters"},
      {"Join_OldClient_FailedPreconditionSaysUpgrade",
       settings_join([](v1::JobSettings* s) {
         s->set_contribution(v1::CONTRIBUTION_UNSPECIFIED);
       }),
       grpc::StatusCode::FAILED_PRECONDITION, "Upgrade the client library"},
      {"Join_NewJobInt8OfParameters_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) {
             s->set_contribution(v1::CONTRIBUTION_PARAMETERS);
             s->set_mode(v1::AVERAGING_MODE_MEAN);
           },
           "-other"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "wire dtype int8 needs contribution pseudo_gradients"},
      {"Join_NewJobNesterovOfParameters_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) {
             s->set_contribution(v1::CONTRIBUTION_PARAMETERS);
             s->set_wire_dtype(v1::DTYPE_FLOAT32);
           },
           "-other"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "outer_nesterov needs contribution pseudo_gradients"},
      {"Join_Int8TensorInTheLayout_InvalidArgument",
       [](Env& env) {
         v1::JoinRequest request = PseudoJoin(env.job + "-other", "bad");
         request.mutable_layout()->mutable_tensors(0)->set_dtype(
             v1::DTYPE_INT8_BLOCK);
         return Join(env, request);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "has no floating-point dtype"},
      {"Sync_NoAnchor_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_anchor_state_id(0);
         return SyncOneChunk(env, h, Int8WithScale(1.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "names no anchor_state_id"},
      {"Sync_SeedStateIdWithoutSeedRound_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 0);
         h.set_seed_state_id(42);
         std::string data;
         EncodeValues(std::vector<float>(kChunk, 1.0f), DType::kFloat32, &data);
         return SyncOneChunk(env, h, data);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "names seed_state_id 42 without a seed_round"},
      {"Sync_ScaleZero_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), Int8WithScale(0.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "has scale 0; scales must be"},
      {"Sync_ScaleNegative_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), Int8WithScale(-2.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "has scale -2; scales must be"},
      {"Sync_ScaleTooLarge_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), Int8WithScale(1e38f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "at most float32 max / 128"},
      {"Sync_ScaleNaN_InvalidArgumentNonFinite",
       [](Env& env) {
         return SyncOneChunk(
             env, Header(env, 2),
             Int8WithScale(std::numeric_limits<float>::quiet_NaN()));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "has a non-finite value at element 0"},
      {"Sync_ScaleInfinite_InvalidArgumentNonFinite",
       [](Env& env) {
         return SyncOneChunk(
             env, Header(env, 2),
             Int8WithScale(std::numeric_limits<float>::infinity()));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "has a non-finite value at element 0"},
      {"Sync_MissingBlockScale_InvalidArgument",
       [](Env& env) {
         // kChunk codes without their scale: one block short.
         return SyncOneChunk(env, Header(env, 2), std::string(kChunk, '\1'));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("expected ", 4 + kChunk, " (", kChunk,
                    " int8 values in 1 blocks)")},
      {"Sync_Float32PayloadInAnInt8Job_InvalidArgument",
       [](Env& env) {
         std::string data;
         EncodeValues(std::vector<float>(kChunk, 1.0f), DType::kFloat32, &data);
         return SyncOneChunk(env, Header(env, 2), data);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("has ", 4 * kChunk, " bytes; expected ", 4 + kChunk)},
      {"Join_MaxStalenessOutOfRange_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_max_staleness(65); },
                     "-stale"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "max_staleness 65 is out of range; use [1, 64]"},
      {"Join_MaxStalenessNegativeNotOff_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_max_staleness(-2); },
                     "-stale"),
       grpc::StatusCode::INVALID_ARGUMENT, "max_staleness -2 is out of range"},
      {"Join_UnknownStepBudget_InvalidArgument",
       settings_join([](v1::JobSettings* s) {
         s->set_step_budget(static_cast<v1::StepBudget>(7));
       }),
       grpc::StatusCode::INVALID_ARGUMENT,
       "settings.step_budget has unknown value 7"},
      {"Join_MinLocalStepsAboveMax_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) {
             s->set_min_local_steps(9);
             s->set_max_local_steps(8);
           },
           "-bounds"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "min_local_steps 9 exceeds max_local_steps 8"},
      {"Join_MaxLocalStepsAbsurd_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) { s->set_max_local_steps(1u << 21); },
           "-bounds"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "max_local_steps 2097152 is out of range; at most 1048576"},
      {"Sync_LocalStepsAbsurd_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_local_steps(kMaxLocalSteps + 1);
         return SyncChunks(env, h, AllInt8Chunks());
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "says local_steps 1048577; at most 1048576"},
      {"Sync_WeightNaN_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_weight(std::numeric_limits<double>::quiet_NaN());
         return SyncChunks(env, h, AllInt8Chunks());
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "says weight nan; a weight is finite and in [1e-6, 1e6]"},
      {"Sync_WeightZero_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_weight(0);
         return SyncChunks(env, h, AllInt8Chunks());
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "says weight 0; a weight is finite and in [1e-6, 1e6]"},
      {"Sync_WeightAbsurd_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_weight(1e7);
         return SyncChunks(env, h, AllInt8Chunks());
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "says weight 1e+07; a weight is finite and in [1e-6, 1e6]"},
      {"Sync_WeightOnASeed_InvalidArgument",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 0);
         h.set_anchor_state_id(0);
         h.set_weight(2);
         return SyncChunks(env, h, AllInt8Chunks());
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "for round 0 says weight 2; only a pseudo-gradient contribution "
       "(round >= 1) has one"},
      // An anchor the job never issued (a stale one, with or without
      // max_staleness): adopted, never averaged.
      {"Sync_DeltaAgainstAnotherAnchor_AdoptsTheStateNotAveraged",
       [](Env& env) {
         v1::SyncHeader h = Header(env, 2);
         h.set_anchor_state_id(env.anchor ^ 0x5a5a);
         v1::ResultPayload payload = v1::RESULT_PAYLOAD_UNSPECIFIED;
         grpc::Status s = SyncChunks(env, h, AllInt8Chunks(), &payload);
         if (s.ok() && payload != v1::RESULT_PAYLOAD_STATE) {
           return grpc::Status(grpc::StatusCode::INTERNAL,
                               "the result is not the float32 state");
         }
         return s;
       },
       grpc::StatusCode::OK, ""},
      // The sparse codes: every malformed part of a payload, refused before
      // it touches the round; the settings that go with them.
      // (A position past a chunk of 16 cannot be written: 2 low bits and
      // a high part of at most 3. The codec's tests write one past a block
      // of 100.)
      {"Sync_SparseMoreEntriesThanKept_InvalidArgument",
       [](Env& env) {
         // The high parts' ones at 9, 10, 11 (13, 14, 15): one more at 6.
         return SyncOneChunk(env, Header(env, 2), SparseWithBits(6, 1, 1));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "sparse block 0 (16 values): its positions' high parts hold 4 "
       "entries; the block has 3",
       DType::kSparse2},
      {"Sync_SparseFewerEntriesThanKept_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), SparseWithBits(11, 1, 0));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "sparse block 0 (16 values): its positions' high parts hold 2 "
       "entries; the block has 3",
       DType::kSparse2},
      {"Sync_SparsePositionRepeated_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2),
                             SparseWithPositions({13, 13, 15}));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "again with code 1; a repeated position is padding, its code 0",
       DType::kSparse2},
      {"Sync_SparsePositionsDescending_InvalidArgument",
       [](Env& env) {
         // The first two positions swapped.
         return SyncOneChunk(env, Header(env, 2),
                             SparseWithPositions({14, 13, 15}));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "entry 1 is at position 13, before the one before (14)",
       DType::kSparse2},
      {"Sync_SparsePaddingBitSet_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), SparseWithBits(15, 1, 1));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "padding bits after the last position or code are not zero",
       DType::kSparse2},
      {"Sync_SparseLoAboveHi_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), SparseWithScales(2.0f, 1.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sparse block 0 has scales (2, 1)",
       DType::kSparse2},
      {"Sync_SparseNegativeLo_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2),
                             SparseWithScales(-1.0f, 1.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sparse block 0 has scales (-1, 1)",
       DType::kSparse2},
      {"Sync_SparseInfiniteHi_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(
             env, Header(env, 2),
             SparseWithScales(1.0f, std::numeric_limits<float>::infinity()));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sparse block 0 has scales (1, inf)",
       DType::kSparse2},
      {"Sync_SparseOneScaleNaN_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(
             env, Header(env, 2),
             SparseWithScales(std::numeric_limits<float>::quiet_NaN(), 1.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sparse block 0 has scales (nan, 1)",
       DType::kSparse2},
      {"Sync_SparseBothScalesNaN_InvalidArgumentNonFinite",
       [](Env& env) {
         const float nan = std::numeric_limits<float>::quiet_NaN();
         return SyncOneChunk(env, Header(env, 2), SparseWithScales(nan, nan));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "has a non-finite value at element 0", DType::kSparse2},
      {"Sync_SparseTruncated_InvalidArgument",
       [](Env& env) {
         std::string data = SparseChunk();
         data.pop_back();
         return SyncOneChunk(env, Header(env, 2), data);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "has 10 bytes; expected 11 (16 sparse2 values, 3 kept)",
       DType::kSparse2},
      {"Sync_Int8PayloadInASparseJob_InvalidArgument",
       [](Env& env) {
         return SyncOneChunk(env, Header(env, 2), Int8WithScale(1.0f));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("has ", 4 + kChunk, " bytes; expected 11"),
       DType::kSparse2},
      {"Join_SparseKeepOutOfRange_InvalidArgument",
       settings_join([](v1::JobSettings* s) { s->set_sparse_keep(4097); },
                     "-keep"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "sparse_keep 4097 is out of range; a sparse block keeps 1 to 4096",
       DType::kSparse2},
      {"Join_OtherSparseKeep_FailedPreconditionNamingBoth",
       settings_join([](v1::JobSettings* s) { s->set_sparse_keep(64); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "keeps 768 values per sparse block; member asks for 64",
       DType::kSparse2},
      {"Join_SparseResultKeepZeroIsDefaultButOutOfRangeRefused_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) { s->set_sparse_result_keep(5000); },
           "-keep"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "sparse_result_keep 5000 is out of range", DType::kSparse2},
      {"Join_OtherSparseResultKeep_FailedPreconditionNamingBoth",
       settings_join([](v1::JobSettings* s) { s->set_sparse_result_keep(64); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "keeps 256 values per sparse block of a result; member asks for 64",
       DType::kSparse2},
      {"Join_OtherSparseCode_FailedPreconditionNamingBoth",
       settings_join(
           [](v1::JobSettings* s) { s->set_wire_dtype(v1::DTYPE_SPARSE4); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "uses wire dtype sparse2; member asks for sparse4", DType::kSparse2},
      {"Join_NewJobSparseOfParameters_InvalidArgument",
       settings_join(
           [](v1::JobSettings* s) {
             s->set_contribution(v1::CONTRIBUTION_PARAMETERS);
             s->set_mode(v1::AVERAGING_MODE_MEAN);
           },
           "-other"),
       grpc::StatusCode::INVALID_ARGUMENT,
       "wire dtype sparse2 needs contribution pseudo_gradients",
       DType::kSparse2},
      {"Join_SparseTensorInTheLayout_InvalidArgument",
       [](Env& env) {
         v1::JoinRequest request = PseudoJoin(env.job + "-other", "bad");
         request.mutable_layout()->mutable_tensors(0)->set_dtype(
             v1::DTYPE_SPARSE2);
         return Join(env, request);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "has no floating-point dtype",
       DType::kSparse2},
  };
}

class PseudoGradientHostileInput : public ::testing::TestWithParam<Row> {};

// Two honest members of `job`: seed (values 1), then one round with values
// 1 + 0.01 j and 1 - 0.02 j; returns their parameters after it.
struct Honest {
  std::unique_ptr<Client> a, b;
  std::vector<float> pa, pb;
};

Honest StartHonest(const CoordinatorServer& server, const std::string& job) {
  Honest h;
  h.a = testkit::JoinedClient(testkit::BaseClientOptions(server, job, "ha"));
  h.b = testkit::JoinedClient(testkit::BaseClientOptions(server, job, "hb"));
  h.pa.assign(kElements, 1.0f);
  h.pb.assign(kElements, 1.0f);
  EXPECT_TRUE(h.a->Initialize(absl::MakeSpan(h.pa)).ok());
  EXPECT_TRUE(h.b->Initialize(absl::MakeSpan(h.pb)).ok());
  return h;
}

void HonestRound(Honest& h, int r) {
  for (uint64_t j = 0; j < kElements; ++j) {
    h.pa[j] += 0.01f * r * j;
    h.pb[j] -= 0.02f * j + 0.001f * r;
  }
  absl::StatusOr<SyncOutcome> oa, ob;
  std::thread t([&] { ob = h.b->Sync(absl::MakeSpan(h.pb)); });
  oa = h.a->Sync(absl::MakeSpan(h.pa));
  t.join();
  ASSERT_TRUE(oa.ok()) << oa.status();
  ASSERT_TRUE(ob.ok()) << ob.status();
  EXPECT_EQ(oa->contributors, 2u);
  EXPECT_TRUE(oa->contributed && ob->contributed);
  EXPECT_EQ(h.pa, h.pb);
}

TEST_P(PseudoGradientHostileInput, Row) {
  const Row& row = GetParam();
  ServerOptions options = testkit::BaseServerOptions();
  options.coordinator.default_settings.contribution =
      Contribution::kPseudoGradients;
  options.coordinator.default_settings.wire_dtype = row.wire;
  options.coordinator.default_settings.sparse_keep = kSparseKeep;
  options.coordinator.default_settings.mode = AveragingMode::kOuterNesterov;
  auto server = testkit::StartServer(std::move(options));
  ASSERT_NE(server, nullptr);
  Honest twin = StartHonest(*server, "twin");
  Honest honest = StartHonest(*server, "job");
  HonestRound(twin, 1);
  HonestRound(honest, 1);
  ASSERT_EQ(honest.pa, twin.pa);

  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
      testkit::Target(*server), grpc::InsecureChannelCredentials()));
  Env env{stub.get(), "job", "", 0};
  v1::JoinResponse joined;
  ASSERT_TRUE(Join(env, PseudoJoin("job", "raw"), &joined).ok());
  env.member = joined.member_id();
  env.anchor = joined.state_id();
  ASSERT_NE(env.anchor, 0u);

  const grpc::Status s = row.act(env);
  EXPECT_EQ(s.error_code(), row.code) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(row.message));

  // The raw member leaves (its partial contribution, if any, is gone with
  // it); the next honest round equals the twin's, bit for bit.
  {
    v1::LeaveRequest request;
    request.set_job_id("job");
    request.set_member_id(env.member);
    v1::LeaveResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Leave(&context, request, &response).ok());
  }
  HonestRound(twin, 2);
  HonestRound(honest, 2);
  EXPECT_EQ(honest.pa, twin.pa) << row.name << " changed the honest round";
  auto job = server->coordinator()->FindJob("job");
  ASSERT_TRUE(job.ok());
  const JobStatusSnapshot status = (*job)->Status(1);
  ASSERT_FALSE(status.recent_rounds.empty());
  EXPECT_EQ(status.recent_rounds[0].contributors,
            (std::vector<std::string>{"ha", "hb"}));
}

// The finite-state guard over the wire: a member whose int8 delta is as
// large as a valid payload allows (every scale at its limit, codes 127)
// would overflow the outer Nesterov step; it is refused, its Sync still
// ends OK with the round's result (contributed = false, late = false), the
// round is named in status with the reason, and the honest members' round
// equals the twin's bit for bit.
TEST(PseudoGradientOverflowTest, LargestValidDelta_RefusedRoundGoesOnAsTwin) {
  ServerOptions options = testkit::BaseServerOptions();
  options.coordinator.default_settings.contribution =
      Contribution::kPseudoGradients;
  options.coordinator.default_settings.wire_dtype = DType::kInt8Block;
  options.coordinator.default_settings.mode = AveragingMode::kOuterNesterov;
  auto server = testkit::StartServer(std::move(options));
  ASSERT_NE(server, nullptr);
  Honest twin = StartHonest(*server, "twin");
  Honest honest = StartHonest(*server, "job");
  HonestRound(twin, 1);
  HonestRound(honest, 1);

  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
      testkit::Target(*server), grpc::InsecureChannelCredentials()));
  Env env{stub.get(), "job", "", 0};
  v1::JoinResponse joined;
  ASSERT_TRUE(Join(env, PseudoJoin("job", "x"), &joined).ok());
  env.member = joined.member_id();
  env.anchor = joined.state_id();
  std::vector<std::string> huge;
  for (uint64_t first = 0; first < kElements; first += kChunk) {
    const size_t n = std::min<uint64_t>(kChunk, kElements - first);
    std::string data;
    EncodeValues(std::vector<float>(n, -kMaxBlockScale * 127),
                 DType::kInt8Block, &data);
    huge.push_back(std::move(data));
  }
  grpc::Status hostile;
  v1::SyncResult result;
  std::thread x([&] {
    hostile = SyncChunks(env, Header(env, 2), huge, nullptr, &result);
  });
  HonestRound(honest, 2);
  x.join();
  EXPECT_TRUE(hostile.ok()) << hostile.error_message();
  EXPECT_EQ(result.round(), 2u);
  EXPECT_FALSE(result.contributed());
  EXPECT_FALSE(result.late());
  HonestRound(twin, 2);
  EXPECT_EQ(honest.pa, twin.pa);
  for (float v : honest.pa) ASSERT_TRUE(std::isfinite(v));

  v1::GetJobStatusRequest request;
  request.set_job_id("job");
  v1::GetJobStatusResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub->GetJobStatus(&context, request, &response).ok());
  ASSERT_EQ(response.jobs_size(), 1);
  const v1::RoundStatus& round = response.jobs(0).recent_rounds(0);
  EXPECT_EQ(round.round(), 2u);
  EXPECT_THAT(round.contributors(), ::testing::ElementsAre("ha", "hb"));
  ASSERT_EQ(round.rejected_size(), 1);
  EXPECT_THAT(round.rejected(0), HasSubstr("x: a delta of magnitude up to"));
  EXPECT_THAT(round.rejected(0), HasSubstr("would overflow"));
}

INSTANTIATE_TEST_SUITE_P(Rows, PseudoGradientHostileInput,
                         ::testing::ValuesIn(Rows()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace localsgd
