// One member's Sync stream into a job (SyncSession), and the checks of a
// Sync that need neither the job's state nor its lock: its header (the seed
// origin, the anchor) and each chunk (index, size, block scales, finite
// values). Job::BeginSync creates the sessions; src/job.h includes this
// header.
#ifndef LOCALSGD_SRC_SYNC_SESSION_H_
#define LOCALSGD_SRC_SYNC_SESSION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

class Job;

// The header of a Sync of member `member` (its name) of job `job` for
// `round`. INVALID_ARGUMENT: an `origin` with a round other than 0,
// contributors or a state id without a seed round, a seed round above
// kMaxSeedRound; in a pseudo-gradient job, no `anchor` for a round >= 1.
absl::Status CheckSyncHeader(absl::string_view job, absl::string_view member,
                             RoundId round, const SeedOrigin& origin,
                             uint64_t anchor, bool pseudo_gradients);

// Chunk `index` of a Sync stream for `round` of job `job` (of `geometry`),
// its `pieces` in `code`. INVALID_ARGUMENT, the message naming the chunk
// (and the element of a non-finite value): index out of range, wrong size,
// a malformed code (CheckPayloadPieces: block scales, sparse positions and
// scales), a non-finite value unless `drop_nonfinite` (the member
// is then dropped from its round instead: NonFinitePolicy::kDrop, a
// contribution). Returns -1, or (drop_nonfinite) the first non-finite
// element.
absl::StatusOr<int64_t> CheckChunk(absl::string_view job,
                                   const ChunkGeometry& geometry, RoundId round,
                                   uint32_t index,
                                   absl::Span<const absl::string_view> pieces,
                                   WireCode code, bool drop_nonfinite);

// One Sync stream of one member: feeds its chunks to the job. Created by
// Job::BeginSync. Not thread-safe: the stream's reads are sequential.
class SyncSession {
 public:
  ~SyncSession();
  SyncSession(const SyncSession&) = delete;
  SyncSession& operator=(const SyncSession&) = delete;

  // Validates and applies one chunk. INVALID_ARGUMENT: index out of range,
  // wrong payload size, non-finite value (the message names the chunk and
  // element); nothing is applied then. A chunk this member already gave for
  // this round is ignored (OK). NOT_FOUND: the member is gone; UNAVAILABLE:
  // the job is stopping.
  absl::Status AddChunk(uint32_t index, absl::string_view data);
  // The same for a payload that arrived in pieces (gRPC's slices), read in
  // place.
  absl::Status AddChunk(uint32_t index,
                        absl::Span<const absl::string_view> pieces);

  // Whether this stream has delivered every chunk.
  bool complete() const { return received_ == got_.size(); }
  uint32_t received() const { return received_; }
  uint32_t num_chunks() const { return static_cast<uint32_t>(got_.size()); }
  RoundId round() const { return round_; }

  // Withdraws the callback. Returns true if it will never run; false if it
  // has run or is running (the caller must let it finish). Chunks already
  // given stay counted. A seeding session that is cancelled before it is
  // complete aborts the seed.
  bool Cancel();

 private:
  friend class Job;
  enum class Role { kContribute, kSeed, kAdopt };
  SyncSession(std::shared_ptr<Job> job, MemberId member, RoundId round,
              Role role, uint64_t waiter_id, uint32_t num_chunks);
  // Counts chunk `index` as delivered (once).
  void Delivered(uint32_t index) {
    if (!got_[index]) {
      got_[index] = true;
      ++received_;
    }
  }

  std::shared_ptr<Job> job_;
  MemberId member_;
  RoundId round_;
  Role role_;
  uint64_t waiter_id_;
  std::vector<bool> got_;
  uint32_t received_ = 0;
  bool cancelled_ = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_SYNC_SESSION_H_
