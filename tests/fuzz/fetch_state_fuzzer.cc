// libFuzzer target: the decode-and-apply path of FetchState. The input is a
// FetchStateScript (tests/fuzz/fuzz_input.proto): the steps of the Sync
// target (rounds, leaves, time passing, ...) with fuzzed FetchStateRequests;
// after every step each member that joined also fetches the state as a
// well-formed client would, which must be the state the last round closed
// with (or a documented error). See harness.h for the invariants.
#include <cstddef>
#include <cstdint>

#include "fuzz_input.pb.h"
#include "tests/fuzz/harness.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  localsgd::fuzz::InitFuzzing();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  localsgd::fuzz::FetchStateScript script;
  if (!script.ParseFromArray(data, static_cast<int>(size)) ||
      script.steps_size() > 256) {
    return -1;
  }
  localsgd::fuzz::Harness harness(script.config());
  harness.RunPrologue(script.prologue());
  localsgd::fuzz::Step fetch;
  fetch.mutable_fetch()->set_fix_fingerprint(true);
  for (const auto& step : script.steps()) {
    harness.Apply(step);
    // Every member fetches, as a late joiner or a restarted worker does.
    for (uint32_t ref = 1; ref <= 4; ++ref) {
      fetch.mutable_fetch()->set_member_ref(ref);
      harness.Apply(fetch);
    }
  }
  harness.Finish();
  return 0;
}
