// The client's retry policy (client/retry.h) on a FakeClock: which errors
// are retried, the backoff sequence, its cap, the jitter, the total bound
// and the message when it gives up. No sleeping: the waiter moves the clock.
#include "client/retry.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/match.h"
#include "src/clock.h"

namespace localsgd {
namespace {

// Jumps the clock to each wake time and records the waits; `early` makes a
// wait end that much sooner (a reconnected channel).
class FakeWaiter final : public RetryWaiter {
 public:
  explicit FakeWaiter(FakeClock* clock) : clock_(clock) {}
  void WaitUntil(absl::Time wake) override {
    const absl::Duration wait = wake - clock_->Now() - early;
    waits.push_back(wait);
    clock_->Advance(wait);
  }
  std::vector<absl::Duration> waits;
  absl::Duration early;

 private:
  FakeClock* const clock_;
};

class RetryTest : public ::testing::Test {
 protected:
  // Fails with `errors` in turn, then succeeds.
  std::function<absl::Status()> Failing(std::vector<absl::Status> errors) {
    return [this, errors]() {
      ++attempts_;
      return attempts_ <= static_cast<int>(errors.size())
                 ? errors[attempts_ - 1]
                 : absl::OkStatus();
    };
  }
  absl::Status Run(std::function<absl::Status()> attempt, double jitter = 1.0) {
    return RunWithRetries(
        policy_, clock_, waiter_, [jitter] { return jitter; },
        "Sync of round 3 at host:1", attempt);
  }

  FakeClock clock_;
  FakeWaiter waiter_{&clock_};
  RetryPolicy policy_;
  int attempts_ = 0;
};

TEST_F(RetryTest, FirstAttemptOk_NoWait) {
  EXPECT_TRUE(Run(Failing({})).ok());
  EXPECT_EQ(attempts_, 1);
  EXPECT_TRUE(waiter_.waits.empty());
}

TEST_F(RetryTest, RetryableErrors_RetriedWithDoublingBackoffUntilOk) {
  EXPECT_TRUE(Run(Failing({absl::UnavailableError("down"),
                           absl::AbortedError("moved on"),
                           absl::DeadlineExceededError("slow"),
                           absl::CancelledError("server stopping"),
                           absl::DataLossError("corrupt chunk")}))
                  .ok());
  EXPECT_EQ(attempts_, 6);
  EXPECT_EQ(waiter_.waits, (std::vector<absl::Duration>{
                               absl::Milliseconds(100), absl::Milliseconds(200),
                               absl::Milliseconds(400), absl::Milliseconds(800),
                               absl::Seconds(1)}));  // capped at max_backoff
}

TEST_F(RetryTest, NotRetryable_ReturnedAtOnceUnchanged) {
  for (const absl::Status& error :
       {absl::InvalidArgumentError("bad layout"), absl::NotFoundError("no job"),
        absl::FailedPreconditionError("fingerprint"),
        absl::PermissionDeniedError("token"),
        absl::ResourceExhaustedError("limit")}) {
    attempts_ = 0;
    EXPECT_EQ(Run(Failing({error})), error);
    EXPECT_EQ(attempts_, 1) << error;
  }
  EXPECT_TRUE(waiter_.waits.empty());
}

TEST_F(RetryTest, Jitter_ScalesEachWait) {
  EXPECT_TRUE(Run(Failing({absl::UnavailableError("down"),
                           absl::UnavailableError("down")}),
                  1.2)
                  .ok());
  EXPECT_EQ(waiter_.waits,
            (std::vector<absl::Duration>{absl::Milliseconds(120),
                                         absl::Milliseconds(240)}));
}

TEST_F(RetryTest, NeverOk_GivesUpWithinMaxRetryTimeKeepingTheCode) {
  policy_.max_retry_time = absl::Seconds(3);
  const absl::Time start = clock_.Now();
  const absl::Status s = Run([this] {
    ++attempts_;
    return absl::UnavailableError("connection refused");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  // 0.1 + 0.2 + 0.4 + 0.8 + 1 = 2.5 s of waits; the next (1 s) would end
  // at 3.5 s, past the 3 s bound.
  EXPECT_EQ(attempts_, 6);
  EXPECT_EQ(clock_.Now() - start, absl::Milliseconds(2500));
  EXPECT_EQ(s.message(),
            "Sync of round 3 at host:1 failed after 6 attempts over 3s: "
            "connection refused");
}

TEST_F(RetryTest, WaiterReturnsEarly_NextAttemptAtOnceBackoffStillGrows) {
  waiter_.early = absl::Milliseconds(50);
  EXPECT_TRUE(Run(Failing({absl::UnavailableError("down"),
                           absl::UnavailableError("down")}))
                  .ok());
  EXPECT_EQ(waiter_.waits,
            (std::vector<absl::Duration>{absl::Milliseconds(50),
                                         absl::Milliseconds(150)}));
}

TEST_F(RetryTest, Retryable_TheDocumentedCodes) {
  EXPECT_TRUE(Retryable(absl::UnavailableError("")));
  EXPECT_TRUE(Retryable(absl::DeadlineExceededError("")));
  EXPECT_TRUE(Retryable(absl::AbortedError("")));
  EXPECT_TRUE(Retryable(absl::CancelledError("")));
  EXPECT_TRUE(Retryable(absl::DataLossError("")));
  EXPECT_FALSE(Retryable(absl::OkStatus()));
  EXPECT_FALSE(Retryable(absl::InternalError("")));
  EXPECT_FALSE(Retryable(absl::UnauthenticatedError("")));
}

}  // namespace
}  // namespace localsgd
