// libFuzzer target: the decode-and-apply path of Join. The input is a
// JoinScript (tests/fuzz/fuzz_input.proto): localsgd.v1.JoinRequests
// (fuzzed: job ids, names, layouts, settings, weights, incarnations) applied
// in order, each successful one retried (a retried Join must return the same
// member), with the `after` steps (Leave, Heartbeat, status, time passing,
// ...) applied in turn after each. See harness.h for the invariants.
#include <cstddef>
#include <cstdint>

#include "fuzz_input.pb.h"
#include "tests/fuzz/harness.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  localsgd::fuzz::InitFuzzing();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  localsgd::fuzz::JoinScript script;
  if (!script.ParseFromArray(data, static_cast<int>(size)) ||
      script.joins_size() > 256 || script.after_size() > 256) {
    return -1;
  }
  localsgd::fuzz::Harness harness(script.config());
  for (int i = 0; i < script.joins_size(); ++i) {
    harness.ApplyJoin(script.joins(i), /*retry=*/true);
    if (script.after_size() > 0) {
      harness.Apply(script.after(i % script.after_size()));
    }
  }
  harness.Finish();
  return 0;
}
