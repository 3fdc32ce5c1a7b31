// When the coordinator's core should next tick: at its periodic tick, or
// earlier where a job asks for it (a round's deadline, which a periodic
// tick alone would overshoot by up to its interval).
#ifndef LOCALSGD_SRC_TICK_ALARM_H_
#define LOCALSGD_SRC_TICK_ALARM_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace localsgd {

// Times are of the real clock (absl::Now). Thread-safe.
class TickAlarm {
 public:
  // A tick is wanted `delay` from now (kept if it is the earliest asked
  // for; one waiting in WaitUntil for later wakes then). A delay, not a
  // time: the asker's clock may be another (a job's Clock).
  void After(absl::Duration delay) ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every WaitUntil now and from now on.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until `periodic` or the earliest time asked for by At, whichever
  // comes first (true; a time asked for that has come is forgotten), or
  // until Stop (false).
  bool WaitUntil(absl::Time periodic) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  absl::CondVar changed_;
  absl::Time asked_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_TICK_ALARM_H_
