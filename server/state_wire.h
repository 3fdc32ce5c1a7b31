// The wire form of a job's global state, shared by every stream that sends
// it. Protocol layer (gRPC-free).
//
// A round's result goes to every participant, and a late joiner fetches the
// same state: each chunk's payload in the job's wire dtype and its CRC32C are
// computed the first time a stream asks and reused by every other stream
// that sends the same state. For fp32 on the wire the payload is the state's
// own bytes (no copy); for bf16 the encoded chunk is kept (half the state's
// size) while any stream still sends it.
#ifndef LOCALSGD_SERVER_STATE_WIRE_H_
#define LOCALSGD_SERVER_STATE_WIRE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "src/job.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

// One state in its wire form. Thread-safe.
class StateWire {
 public:
  struct Chunk {
    absl::string_view data;  // valid while this StateWire lives
    uint32_t crc32c = 0;
  };

  // `state` must hold geometry.num_elements() values.
  StateWire(std::shared_ptr<const StateSnapshot> state,
            const ChunkGeometry& geometry, DType wire_dtype);

  // Chunk `index` (< num_chunks()): encoded and checksummed on first use.
  Chunk Get(uint32_t index) const ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<const StateSnapshot>& state() const { return state_; }
  RoundId round() const { return state_->round; }
  uint32_t num_chunks() const { return geometry_.num_chunks(); }
  DType wire_dtype() const { return wire_dtype_; }

 private:
  struct Slot {
    bool ready = false;
    std::unique_ptr<char[]> encoded;  // not for fp32
    uint32_t crc32c = 0;
  };

  const std::shared_ptr<const StateSnapshot> state_;
  const ChunkGeometry geometry_;
  const DType wire_dtype_;
  mutable absl::Mutex mu_;
  mutable std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
};

// Per job, the wire form of the state its streams are sending now. A
// StateWire lives while a stream holds it: the members of a round receive
// their results at the same time and share one; a state nobody is sending
// costs nothing here. Thread-safe.
class WireCache {
 public:
  // The wire form of `state` of `job` (its geometry and wire dtype).
  std::shared_ptr<const StateWire> For(
      const Job& job, std::shared_ptr<const StateSnapshot> state)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<const StateWire>> by_job_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_STATE_WIRE_H_
