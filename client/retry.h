// Retries of one client call: exponential backoff with jitter, bounded in
// total time. The clock, the wait and the jitter are injected, so that the
// policy is tested without sleeping (tests/client/retry_test.cc).
#ifndef LOCALSGD_CLIENT_RETRY_H_
#define LOCALSGD_CLIENT_RETRY_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/clock.h"

namespace localsgd {

struct RetryPolicy {
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(1);
  absl::Duration max_retry_time = absl::Minutes(1);
};

// Whether trying again can mend `status`: UNAVAILABLE (no coordinator, or
// one shutting down), DEADLINE_EXCEEDED, ABORTED (the round moved on),
// CANCELLED (a call the server cut off while shutting down; the client's own
// cancellations return before this is asked), DATA_LOSS (a chunk corrupted
// in transfer; resending the stream mends it).
bool Retryable(const absl::Status& status);

// How a retry loop waits between attempts.
class RetryWaiter {
 public:
  virtual ~RetryWaiter() = default;
  // Returns at `wake` (by the loop's clock) at the latest; earlier when a
  // retry is worth making sooner (the channel reconnected).
  virtual void WaitUntil(absl::Time wake) = 0;
};

// Runs `attempt` until it returns OK or an error Retryable says no to
// (returned as it is), or until the next wait would end more than
// policy.max_retry_time after the first attempt began: then the last error,
// its code kept, as "<what> failed after <n> attempts over <max_retry_time>:
// <message>". The n-th wait is initial_backoff * 2^(n-1), at most
// max_backoff, times jitter() (a factor in [0.8, 1.2]); each is logged.
absl::Status RunWithRetries(const RetryPolicy& policy, Clock& clock,
                            RetryWaiter& waiter,
                            const std::function<double()>& jitter,
                            absl::string_view what,
                            const std::function<absl::Status()>& attempt);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_RETRY_H_
