// Writes jobs' global states to a CheckpointStore in the background, so that
// no round closure or gRPC handler waits for a disk.
//
// Latest wins: if a job's state changes again before the previous one was
// written, only the newest is written. Thread-safe.
#ifndef LOCALSGD_SRC_CHECKPOINTER_H_
#define LOCALSGD_SRC_CHECKPOINTER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "src/checkpoint.h"
#include "src/job.h"

namespace localsgd {

class Checkpointer final : public StateSink {
 public:
  // `store` must outlive the checkpointer. Starts the writer thread. Jobs'
  // states hold the chunks of `shard` (see CoordinatorOptions::shard).
  // `epoch` (may be empty: 0) is read for each write: the coordinator's
  // epoch (JobCheckpoint::epoch).
  explicit Checkpointer(CheckpointStore* store, ShardSpec shard = ShardSpec(),
                        std::function<uint64_t()> epoch = nullptr);
  // Stop().
  ~Checkpointer() override;

  // Queues `state` of `job` for writing; returns at once.
  void StateChanged(std::shared_ptr<const Job> job,
                    std::shared_ptr<const StateSnapshot> state) override;

  // Queues the removal of `job_id`'s checkpoint (a reclaimed or deleted
  // job), in place of any write still queued for it; returns at once.
  void JobRemoved(const std::string& job_id);

  // Blocks until everything queued so far is written (or failed).
  void Flush();

  // Writes what is queued, then stops the writer thread. Idempotent; later
  // StateChanged calls are dropped with a warning.
  void Stop();

  // Checkpoints written and failed so far.
  int64_t saved() const;
  int64_t failed() const;

 private:
  // A state to write, or (job and state null) the checkpoint to remove.
  struct Pending {
    std::shared_ptr<const Job> job;
    std::shared_ptr<const StateSnapshot> state;
  };
  void Run();

  CheckpointStore* const store_;
  const ShardSpec shard_;
  const std::function<uint64_t()> epoch_;
  std::thread writer_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  int writing_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t saved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_CHECKPOINTER_H_
