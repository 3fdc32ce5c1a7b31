#include "src/checkpointer.h"

#include <utility>

#include "glog/logging.h"

namespace localsgd {

Checkpointer::Checkpointer(CheckpointStore* store, ShardSpec shard,
                           std::function<uint64_t()> epoch)
    : store_(store), shard_(shard), epoch_(std::move(epoch)) {
  writer_ = std::thread([this] { Run(); });
}

Checkpointer::~Checkpointer() { Stop(); }

void Checkpointer::StateChanged(std::shared_ptr<const Job> job,
                                std::shared_ptr<const StateSnapshot> state) {
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    LOG(WARNING) << "checkpointer stopped; round " << state->round << " of job "
                 << job->id() << " not saved";
    return;
  }
  const std::string id = job->id();
  pending_[id] = Pending{std::move(job), std::move(state)};
}

void Checkpointer::JobRemoved(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  pending_[job_id] = Pending();
}

void Checkpointer::Run() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](Checkpointer* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
          return c->stopping_ || !c->pending_.empty();
        },
        this));
    if (pending_.empty()) return;  // stopping, and nothing left to write
    auto it = pending_.begin();
    const std::string id = it->first;
    Pending p = std::move(it->second);
    pending_.erase(it);
    ++writing_;
    mu_.Unlock();
    if (p.state == nullptr) {  // a removal
      const absl::Status s = store_->Remove(id);
      if (!s.ok()) {
        LOG(ERROR) << "removing the checkpoint of job " << id
                   << " failed: " << s;
      }
      mu_.Lock();
      --writing_;
      continue;
    }
    JobCheckpoint meta;
    meta.job_id = p.job->id();
    meta.layout = p.job->layout();
    meta.settings = p.job->settings();
    meta.round = p.state->round;
    meta.shard = shard_;
    meta.state_id = p.state->id;
    meta.ancestors = p.state->ancestors;
    meta.participants = p.state->participants;
    meta.epoch = epoch_ != nullptr ? epoch_() : 0;
    const absl::Status s =
        store_->Save(meta, p.state->values, p.state->momentum,
                     p.state->residual, p.state->mean_residual);
    if (s.ok()) {
      VLOG(1) << "checkpointed job " << meta.job_id << " at round "
              << meta.round;
    } else {
      LOG(ERROR) << "checkpoint of job " << meta.job_id << " round "
                 << meta.round << " failed: " << s;
    }
    p = Pending();  // release the snapshot before taking the lock
    mu_.Lock();
    --writing_;
    ++(s.ok() ? saved_ : failed_);
  }
}

void Checkpointer::Flush() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Checkpointer* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
        return c->pending_.empty() && c->writing_ == 0;
      },
      this));
}

void Checkpointer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (writer_.joinable()) writer_.join();
}

int64_t Checkpointer::saved() const {
  absl::MutexLock lock(&mu_);
  return saved_;
}

int64_t Checkpointer::failed() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

}  // namespace localsgd
