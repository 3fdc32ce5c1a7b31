// Durable checkpoints of coordinator job state: what a restarted coordinator
// needs to resume a job (layout, settings, round, global parameters).
//
// File format, version 10. All integers little-endian; floats IEEE-754
// binary32, little-endian.
//
//   offset  size  field
//   0       8     magic "LSGDCKPT"
//   8       4     format version (10; 1 to 9 are read too)
//   12      4     H: header length in bytes
//   16      8     file length in bytes (all of it, the trailer included)
//   24      H     header:
//                   u32 job id length, job id bytes
//                   u64 round
//                   u32 local_sgd_steps, u32 chunk_elements, u32 wire_dtype,
//                   u32 mode, u32 rendezvous_members
//                   u32 nonfinite_policy                 (version 2)
//                   u64 layout fingerprint
//                   u32 tensor count; per tensor: u32 name length, name
//                     bytes, u32 dtype, u32 rank, rank x i64 dimensions
//                   u32 shard index, u32 shard count     (version 2)
//                   u32 contribution, f32 outer_lr, f32 outer_momentum,
//                   u64 state id                         (version 3)
//                   u32 deadline_mode                    (version 4)
//                   u64 epoch                            (version 5)
//                   f32 outlier_ratio                    (version 6)
//                   u32 mean_encoding                    (version 7)
//                   i32 max_staleness, u32 step_budget,
//                   u32 min_local_steps, u32 max_local_steps (version 8)
//                   u32 A, A x u64: the ids of the states before this
//                     one, newest first, A <= 64         (version 8)
//                   u32 sparse_keep, u32 sparse_result_keep (version 9)
//                   u32 participants of the state's round (version 10)
//                   u64 N: number of values (the shard's elements)
//                   u64 M, u64 R: momentum and residual values, each 0
//                     or N                               (version 3)
//                   u64 P: mean residual values, 0 or N  (version 7)
//   24+H    4     masked CRC32C of bytes [0, 24+H)
//   28+H    4N    the values
//           4M    the momentum (version 3)
//           4R    the residual (version 3)
//           4P    the mean residual (version 7)
//   end-4   4     masked CRC32C of bytes [0, end-4)
//
// CRCs are masked as leveldb masks them (a CRC over data that holds CRCs is
// weak otherwise). The header CRC lets a reader trust the header's lengths
// before it reads gigabytes of values; the trailing CRC covers everything. A
// later version changes the format version. This build writes version 10 and
// reads 1 (which had no non-finite policy, "reject", and no shards, {0, 1}),
// 2 (which had no pseudo-gradients: contribution "parameters", outer
// hyper-parameters 0, no state id, momentum or residual), 3 (no deadline
// mode: "fixed"), 4 (no epoch: 0), 5 (no outlier guard: off, as the job
// ran), 6 (no mean encoding: float32), 7 (no stale contributions: off, no
// ancestors; step budget fixed), 8 (no sparse codes: sparse_keep 0), 9 (no
// participants: 0, a restored job regathers for a whole lease) and 10.
#ifndef LOCALSGD_SRC_CHECKPOINT_H_
#define LOCALSGD_SRC_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

// What a restarted coordinator needs to resume a job.
struct JobCheckpoint {
  std::string job_id;
  Layout layout;         // tensors and fingerprint
  JobSettings settings;  // complete: the job's effective settings
  RoundId round = 0;     // round of `values` (0: the seed)
  // The chunks of the layout this state holds (sharded coordinators).
  ShardSpec shard;
  // The global state: one float per element of the shard's chunks, back to
  // back (every layout element without shards).
  std::vector<float> values;
  // Pseudo-gradient jobs: the state's id (0: none), the averaging rule's
  // momentum and the coordinator's quantization residual (each empty or one
  // float per value).
  uint64_t state_id = 0;
  std::vector<float> momentum;
  std::vector<float> residual;
  // With mean encoding wire: what the encodings of the round means dropped
  // (empty or one float per value).
  std::vector<float> mean_residual;
  // The epoch of the coordinator that wrote it (the etcd revision at which
  // it won its shard's election, --ha_etcd); 0 without an election.
  // CheckpointStore::Save refuses to replace a checkpoint of a higher one.
  uint64_t epoch = 0;
  // Pseudo-gradient jobs: the ids of the states before `state_id`, newest
  // first (at most kMaxStalenessLimit): how stale a delta against one of
  // them is (JobSettings::max_staleness).
  std::vector<uint64_t> ancestors;
  // How many members took part in the round that made this state (0: not
  // known, as for a seed): a job restored from it regathers until as many
  // are back, or for one lease (Job::RestoreState).
  uint32_t participants = 0;
};

// The file format version this build writes and reads.
inline constexpr uint32_t kCheckpointFormatVersion = 10;
// The oldest format version this build reads.
inline constexpr uint32_t kOldestCheckpointFormatVersion = 1;

// Returns the checkpoint in the file format above. `checkpoint` should be
// valid (see CheckpointStore::Save); an invalid one is encoded as given and
// DecodeCheckpoint rejects it. Builds the whole file in memory: for tests and
// small models; CheckpointStore::Save streams to the file instead.
std::string EncodeCheckpoint(const JobCheckpoint& checkpoint);

// Parses a file in the format above. DATA_LOSS, with a message that names
// what is wrong, if the bytes are not a complete, intact, consistent
// checkpoint: empty, bad magic, unsupported version, truncated at byte N,
// trailing bytes, header or file checksum mismatch, malformed header, invalid
// job id or layout, layout fingerprint mismatch, values count != layout
// elements, unknown wire dtype or mode.
absl::StatusOr<JobCheckpoint> DecodeCheckpoint(absl::string_view bytes);

// A directory of job checkpoints, one file per job: <dir>/<job_id>.ckpt.
//
// Durability: Save writes <job_id>.ckpt.tmp, fsyncs it, renames it over
// <job_id>.ckpt and fsyncs the directory, so a crash at any point leaves the
// old or the new checkpoint (and perhaps a .tmp file that LoadAll removes).
//
// Thread-safety: all methods are thread-safe. Saves of different jobs run in
// parallel; Saves (and Removes) of one job run one at a time, in the order
// they take the job's lock: a caller that saves one job from several threads
// must order the calls itself, or an older round may land last. LoadAll waits
// for running Saves and Removes and holds off new ones until it returns.
// All methods block on file I/O: never call them from a gRPC callback
// handler or with a job's lock held.
class CheckpointStore {
 public:
  // Opens `dir`, creating it and missing parents (like mkdir -p, mode 0755).
  // INVALID_ARGUMENT: `dir` is empty. FAILED_PRECONDITION: it cannot be
  // created, is not a directory, or is not writable (the message names the
  // path and the reason).
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(std::string dir);

  CheckpointStore(const CheckpointStore&) = delete;
  CheckpointStore& operator=(const CheckpointStore&) = delete;

  // Atomically replaces the checkpoint of `checkpoint.job_id` (see above)
  // with `values` as its values: checkpoint.values must be empty (or be
  // `values` itself), INVALID_ARGUMENT otherwise, so that a caller that holds
  // the state elsewhere (a StateSnapshot that Sync streams share) does not
  // copy a large model to save it. `values` must not change during the call.
  // INVALID_ARGUMENT: malformed job id, invalid layout, values count !=
  // layout elements, unknown wire dtype or mode; nothing is written then.
  // Other codes (from errno, e.g. RESOURCE_EXHAUSTED for a full disk,
  // PERMISSION_DENIED) name the path and the reason; the previous checkpoint
  // is left in place and the temporary file removed.
  // `momentum`, `residual` and `mean_residual` the same (each empty or of
  // values.size()).
  // FAILED_PRECONDITION, nothing written, if checkpoint.epoch > 0 (an
  // elected primary) and the job's checkpoint in place was written at a
  // higher epoch (a deposed primary sharing the directory with the one that
  // replaced it). A coordinator without an election (epoch 0) does not
  // fence.
  absl::Status Save(const JobCheckpoint& checkpoint,
                    absl::Span<const float> values,
                    absl::Span<const float> momentum = {},
                    absl::Span<const float> residual = {},
                    absl::Span<const float> mean_residual = {});

  // Loads every <job_id>.ckpt in the directory, sorted by job id. A file that
  // cannot be read or decoded, or whose name is not a job id or not the job
  // id inside it, is skipped: logged with LOG(ERROR) and described (path:
  // reason) in `*errors` if `errors` is not null; it is left in place for an
  // operator to inspect. Leftover <anything>.ckpt.tmp files (a Save that a
  // crash interrupted) are removed; other files are ignored. Fails only if the
  // directory cannot be listed (code from errno).
  absl::StatusOr<std::vector<JobCheckpoint>> LoadAll(
      std::vector<std::string>* errors = nullptr);

  // Removes the checkpoint of `job_id` (a reclaimed or deleted job); OK if
  // there is none. INVALID_ARGUMENT: malformed job id. Other codes from
  // errno.
  absl::Status Remove(absl::string_view job_id);

  // The directory, as given to Open.
  const std::string& dir() const { return dir_; }

 private:
  explicit CheckpointStore(std::string dir) : dir_(std::move(dir)) {}

  // The lock that serializes Saves and Removes of `job_id`.
  std::shared_ptr<absl::Mutex> JobLock(absl::string_view job_id);
  std::string PathOf(absl::string_view file_name) const;

  const std::string dir_;
  // Roles: Save and Remove hold it shared, LoadAll exclusive (it deletes
  // .tmp files that a running Save would be writing).
  absl::Mutex dir_mu_;
  absl::Mutex locks_mu_ ABSL_ACQUIRED_AFTER(dir_mu_);
  // One per job ever saved or removed; never erased, so that two callers can
  // never hold different locks for one job. A few bytes per job.
  absl::flat_hash_map<std::string, std::shared_ptr<absl::Mutex>> job_locks_
      ABSL_GUARDED_BY(locks_mu_);
};

namespace checkpoint_internal {
// Kept for the checkpoint tests; see src/crc32c.h.
using ::localsgd::Crc32c;
using ::localsgd::Crc32cHasHardware;
using ::localsgd::Crc32cPortable;
}  // namespace checkpoint_internal
}  // namespace localsgd

#endif  // LOCALSGD_SRC_CHECKPOINT_H_
