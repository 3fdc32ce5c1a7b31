// libFuzzer target: the member's side of Sync (client/sync_stream.h,
// client/member_state.h) against arbitrary coordinator replies. The input
// picks a job (contribution, wire dtype, chunk size, model size, round,
// full duplex, pacing), then a sequence of events: writes completing or
// failing, result messages with fuzzed fields, chunks well formed or not
// (cut into pieces anywhere), arbitrary protobuf messages, unreadable
// messages, the reads ending, and the call's status. Checked on every
// input: at most one write and one read in flight, nothing after kFinish
// and kFinish exactly once, chunks written in order and each once, and a
// Sync that fails leaves the parameters bit for bit as they were; one that
// succeeds received every chunk of the result.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/member_state.h"
#include "client/sync_stream.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {
namespace {

#define FUZZ_CHECK(cond)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      fprintf(stderr, "sync_client_fuzzer: failed: %s\n", #cond); \
      abort();                                                    \
    }                                                             \
  } while (0)

constexpr DType kWires[] = {DType::kFloat32, DType::kBFloat16,
                            DType::kInt8Block, DType::kInt4Block};

struct Driver {
  bool write_in_flight = false;
  bool read_in_flight = false;
  int finishes = 0;
  std::vector<uint32_t> written;

  void Take(const ClientStreamAction& a) {
    FUZZ_CHECK(finishes == 0);
    switch (a.kind) {
      case ClientStreamAction::Kind::kWriteChunk:
        FUZZ_CHECK(a.index == written.size());
        FUZZ_CHECK(a.crc32c == Crc32c(0, *a.payload));
        written.push_back(a.index);
        [[fallthrough]];
      case ClientStreamAction::Kind::kWriteMessage:
      case ClientStreamAction::Kind::kWritesDone:
        FUZZ_CHECK(!write_in_flight);
        write_in_flight = true;
        return;
      case ClientStreamAction::Kind::kRead:
        FUZZ_CHECK(!read_in_flight);
        read_in_flight = true;
        return;
      case ClientStreamAction::Kind::kFinish:
        FUZZ_CHECK(a.cancel == !a.status.ok());
        ++finishes;
        return;
    }
  }
};

// A result chunk: mostly well formed for the index the input names, in the
// dtype a result of this job may come in, sometimes with a bad CRC32C or
// arbitrary bytes; cut into up to three pieces.
void SendChunk(FuzzedDataProvider& in, const MemberState& member,
               SyncClientStream& machine) {
  const uint32_t n = member.num_chunks();
  const uint32_t index = in.ConsumeIntegralInRange<uint32_t>(0, n);
  std::string data;
  if (in.ConsumeBool() && index < n) {
    const WireCode dtype =
        in.ConsumeBool() ? member.result_code() : WireCode(DType::kFloat32);
    std::vector<float> values(member.local().Size(index));
    for (float& v : values) {
      v = in.ConsumeFloatingPointInRange<float>(-4.0f, 4.0f);
    }
    EncodeValues(values, dtype, &data);
  } else {
    data = in.ConsumeRandomLengthString(256);
  }
  ChunkPieces chunk;
  chunk.index = index;
  chunk.has_crc32c = in.ConsumeIntegral<uint8_t>() != 0;
  chunk.crc32c = Crc32c(0, data) ^ (in.ConsumeIntegral<uint8_t>() < 8 ? 1 : 0);
  chunk.size = data.size();
  const size_t cut1 = in.ConsumeIntegralInRange<size_t>(0, data.size());
  const size_t cut2 = in.ConsumeIntegralInRange<size_t>(cut1, data.size());
  const absl::string_view all(data);
  chunk.pieces = {all.substr(0, cut1), all.substr(cut1, cut2 - cut1),
                  all.substr(cut2)};
  machine.OnChunk(chunk);
}

void SendResult(FuzzedDataProvider& in, SyncClientStream& machine) {
  v1::SyncResponse response;
  v1::SyncResult* r = response.mutable_result();
  r->set_round(in.ConsumeIntegralInRange<uint64_t>(0, 9));
  r->set_contributed(in.ConsumeBool());
  r->set_late(in.ConsumeBool());
  r->set_contributors(in.ConsumeIntegralInRange<uint32_t>(0, 4));
  r->set_state_id(in.ConsumeIntegralInRange<uint64_t>(0, 3));
  r->set_payload(
      static_cast<v1::ResultPayload>(in.ConsumeIntegralInRange<int>(0, 3)));
  machine.OnMessage(response);
}

void Run(FuzzedDataProvider& in) {
  JoinInfo info;
  const bool pseudo_gradients = in.ConsumeBool();
  info.settings.contribution = pseudo_gradients ? Contribution::kPseudoGradients
                                                : Contribution::kParameters;
  info.settings.wire_dtype = in.PickValueInArray(kWires);
  info.settings.chunk_elements = in.ConsumeIntegralInRange<uint32_t>(1, 80);
  const uint32_t elements = in.ConsumeIntegralInRange<uint32_t>(1, 300);
  info.num_elements = elements;
  MemberState member;
  member.OnJoined(info, elements);
  std::vector<float> params(elements);
  for (uint32_t i = 0; i < elements; ++i) params[i] = 0.5f * i - 3.0f;
  const std::vector<float> before = params;
  SyncPlan plan;
  plan.round = in.ConsumeIntegralInRange<RoundId>(0, 3);
  if (plan.round == 0 && in.ConsumeBool()) {
    plan.origin = SeedOrigin{2, 1, in.ConsumeIntegralInRange<uint64_t>(0, 2)};
  }
  member.BeginSync(plan, absl::MakeSpan(params));
  member.BeginAttempt();
  SyncStreamOptions options;
  options.job_id = "fuzz";
  options.early_results = in.ConsumeBool();
  options.max_lead_chunks = in.ConsumeIntegralInRange<uint64_t>(0, 3);
  FakeClock clock;
  StagingPool staging;
  Driver driver;
  SyncClientStream machine(&member, &staging, &clock, options,
                           [&](ClientStreamAction a) { driver.Take(a); });
  machine.Start();
  while (in.remaining_bytes() > 0 && !machine.finished()) {
    const int op = in.ConsumeIntegralInRange<int>(0, 6);
    if (op <= 1) {
      if (!driver.write_in_flight) continue;
      driver.write_in_flight = false;
      machine.OnWriteDone(op == 0 || in.ConsumeBool());
      continue;
    }
    if (op == 6) break;  // the reads end
    if (!driver.read_in_flight) continue;
    driver.read_in_flight = false;
    if (op == 2) {
      SendResult(in, machine);
    } else if (op == 3) {
      SendChunk(in, member, machine);
    } else if (op == 4) {
      v1::SyncResponse any;
      if (any.ParseFromString(in.ConsumeRandomLengthString(128))) {
        machine.OnMessage(any);
      } else {
        machine.OnUnreadable(absl::InvalidArgumentError("does not parse"));
      }
    } else {
      machine.OnUnreadable(absl::InvalidArgumentError("does not parse"));
    }
    clock.Advance(absl::Milliseconds(1));
  }
  if (!machine.finished()) machine.OnReadsDone();
  FUZZ_CHECK(driver.finishes == 1);
  const absl::Status call = in.ConsumeBool()
                                ? absl::OkStatus()
                                : absl::UnavailableError("call failed");
  const absl::Status s = machine.Conclude(call);
  if (s.ok()) {
    FUZZ_CHECK(call.ok());
    member.CommitSync(machine.outcome());
  } else {
    member.RollBack();
    FUZZ_CHECK(std::memcmp(params.data(), before.data(),
                           params.size() * sizeof(float)) == 0);
  }
}

}  // namespace
}  // namespace localsgd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  localsgd::Run(in);
  return 0;
}
