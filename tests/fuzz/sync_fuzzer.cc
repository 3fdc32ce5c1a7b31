// libFuzzer target: the decode-and-apply path of Sync. The input is a
// SyncScript (tests/fuzz/fuzz_input.proto): a job set up by the prologue,
// then Sync messages on up to 8 streams (real localsgd.v1.SyncRequest
// messages, fuzzed), stream ends and cancellations, Joins, Leaves,
// Heartbeats, time passing, status and FetchState calls. See harness.h for
// the invariants checked after every step.
#include <cstddef>
#include <cstdint>

#include "fuzz_input.pb.h"
#include "tests/fuzz/harness.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  localsgd::fuzz::InitFuzzing();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  localsgd::fuzz::SyncScript script;
  // Not a script, or too long to be quick: not worth keeping.
  if (!script.ParseFromArray(data, static_cast<int>(size)) ||
      script.steps_size() > 512) {
    return -1;
  }
  localsgd::fuzz::Harness harness(script.config());
  harness.RunPrologue(script.prologue());
  for (const auto& step : script.steps()) harness.Apply(step);
  harness.Finish();
  return 0;
}
