#include "src/failpoint.h"

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/ascii.h"
#include "glog/logging.h"

namespace localsgd {
namespace {

constexpr Failpoint kAll[] = {Failpoint::kContributionChunk,
                              Failpoint::kResultChunkSent,
                              Failpoint::kRoundClosed, Failpoint::kCatchUpSent};

// Bit i: failpoint i armed.
std::atomic<uint32_t> armed{0};

const char* Path() {
  static const char* const path = [] {
    const char* p = std::getenv("LOCALSGD_FAILPOINTS");
    return p != nullptr && *p != '\0' ? p : nullptr;
  }();
  return path;
}

uint32_t Bit(Failpoint failpoint) {
  return 1u << static_cast<uint32_t>(failpoint);
}

}  // namespace

const char* FailpointName(Failpoint failpoint) {
  switch (failpoint) {
    case Failpoint::kContributionChunk:
      return "contribution_chunk";
    case Failpoint::kResultChunkSent:
      return "result_chunk_sent";
    case Failpoint::kRoundClosed:
      return "round_closed";
    case Failpoint::kCatchUpSent:
      return "catch_up_sent";
  }
  return "?";
}

bool FailpointsEnabled() { return Path() != nullptr; }

void ReloadFailpoints() {
  const char* path = Path();
  if (path == nullptr) return;
  uint32_t bits = 0;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const std::string name(absl::StripAsciiWhitespace(line));
    if (name.empty()) continue;
    bool known = false;
    for (Failpoint f : kAll) {
      if (name == FailpointName(f)) {
        bits |= Bit(f);
        known = true;
      }
    }
    LOG_IF(WARNING, !known) << "failpoints file " << path
                            << ": unknown failpoint '" << name << "' ignored";
  }
  const uint32_t before = armed.exchange(bits, std::memory_order_acq_rel);
  for (Failpoint f : kAll) {
    if ((bits & Bit(f)) != 0 && (before & Bit(f)) == 0) {
      LOG(WARNING) << "failpoint " << FailpointName(f)
                   << " armed: this process kills itself there";
    }
  }
}

void HitFailpoint(Failpoint failpoint) {
  if ((armed.load(std::memory_order_acquire) & Bit(failpoint)) == 0) return;
  LOG(ERROR) << "failpoint " << FailpointName(failpoint)
             << " hit: killing this process (SIGKILL)";
  google::FlushLogFiles(google::GLOG_INFO);
  raise(SIGKILL);
}

}  // namespace localsgd
