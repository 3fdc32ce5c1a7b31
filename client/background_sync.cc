#include "client/background_sync.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/codec.h"

namespace localsgd {

BackgroundSync::BackgroundSync(Client* client) : client_(client) {
  const size_t n = client_->info().num_elements;
  buffer_.assign(n, 0.0f);
  snapshot_.assign(n, 0.0f);
  thread_ = std::thread([this] { Loop(); });
}

BackgroundSync::~BackgroundSync() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void BackgroundSync::Loop() {
  while (true) {
    SyncWork said;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BackgroundSync* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->work_ || self->stop_;
          },
          this));
      // A sync in flight finishes before the thread stops (the destructor
      // waits for it).
      if (!work_) return;
      said = said_;
    }
    absl::StatusOr<SyncOutcome> outcome =
        client_->Sync(absl::MakeSpan(buffer_), said);
    absl::MutexLock lock(&mu_);
    work_ = false;
    result_ = std::move(outcome);
  }
}

absl::Status BackgroundSync::Start(absl::Span<const float> params,
                                   SyncWork work) {
  if (in_flight_) {
    return absl::FailedPreconditionError(
        "BackgroundSync::Start with a sync in flight; Finish it first");
  }
  if (params.size() != buffer_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BackgroundSync::Start with ", params.size(),
                     " parameters; the job has ", buffer_.size()));
  }
  std::copy(params.begin(), params.end(), snapshot_.begin());
  std::copy(params.begin(), params.end(), buffer_.begin());
  in_flight_ = true;
  absl::MutexLock lock(&mu_);
  result_.reset();
  said_ = work;
  work_ = true;
  return absl::OkStatus();
}

bool BackgroundSync::Ready() const {
  absl::MutexLock lock(&mu_);
  return result_.has_value();
}

absl::StatusOr<SyncOutcome> BackgroundSync::Finish(absl::Span<float> params) {
  if (!in_flight_) {
    return absl::FailedPreconditionError(
        "BackgroundSync::Finish with no sync in flight");
  }
  if (params.size() != buffer_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BackgroundSync::Finish with ", params.size(),
                     " parameters; the job has ", buffer_.size()));
  }
  absl::StatusOr<SyncOutcome> outcome;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::optional<absl::StatusOr<SyncOutcome>>* r) {
          return r->has_value();
        },
        &result_));
    outcome = *std::move(result_);
    result_.reset();
  }
  in_flight_ = false;
  if (!outcome.ok()) return outcome;
  // theta_r + (theta_now - theta_snapshot): the local progress since the
  // snapshot on top of the round's result.
  AddProgress(buffer_, snapshot_, params);
  return outcome;
}

}  // namespace localsgd
