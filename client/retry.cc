#include "client/retry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace localsgd {

bool Retryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsAborted(status) ||
         absl::IsDeadlineExceeded(status) || absl::IsCancelled(status) ||
         absl::IsDataLoss(status);
}

absl::Status RunWithRetries(const RetryPolicy& policy, Clock& clock,
                            RetryWaiter& waiter,
                            const std::function<double()>& jitter,
                            absl::string_view what,
                            const std::function<absl::Status()>& attempt) {
  const absl::Time give_up = clock.Now() + policy.max_retry_time;
  absl::Duration backoff = policy.initial_backoff;
  for (int n = 1;; ++n) {
    absl::Status status = attempt();
    if (status.ok() || !Retryable(status)) return status;
    const absl::Duration wait = backoff * jitter();
    const absl::Time wake = clock.Now() + wait;
    if (wake > give_up) {
      return absl::Status(
          status.code(),
          absl::StrCat(what, " failed after ", n, " attempts over ",
                       absl::FormatDuration(policy.max_retry_time), ": ",
                       status.message()));
    }
    LOG(WARNING) << what << " attempt " << n << " failed (" << status
                 << "); retrying in " << absl::FormatDuration(wait);
    waiter.WaitUntil(wake);
    backoff = std::min(backoff * 2, policy.max_backoff);
  }
}

}  // namespace localsgd
