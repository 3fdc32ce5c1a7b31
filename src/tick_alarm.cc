#include "src/tick_alarm.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace localsgd {

void TickAlarm::After(absl::Duration delay) {
  const absl::Time at = absl::Now() + delay;
  absl::MutexLock lock(&mu_);
  if (at >= asked_) return;
  asked_ = at;
  changed_.SignalAll();
}

void TickAlarm::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  changed_.SignalAll();
}

bool TickAlarm::WaitUntil(absl::Time periodic) {
  absl::MutexLock lock(&mu_);
  while (!stopped_) {
    const absl::Time due = std::min(periodic, asked_);
    if (absl::Now() >= due) {
      if (asked_ <= due) asked_ = absl::InfiniteFuture();
      return true;
    }
    changed_.WaitWithDeadline(&mu_, due);
  }
  return false;
}

}  // namespace localsgd
