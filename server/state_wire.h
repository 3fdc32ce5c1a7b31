// The wire form of a job's global state, shared by every stream that sends
// it. Protocol layer (gRPC-free).
//
// A round's result goes to every participant, and a late joiner fetches the
// same state: each chunk's payload and its CRC32C are computed the first
// time a stream asks and reused by every other stream that sends the same
// state in the same form. A state goes out in one of two forms: its values
// (in the wire dtype in a job of parameters, in float32 in a job of
// pseudo-gradients; for float32 the payload is the state's own bytes, no
// copy; for bf16 the encoded chunk is kept while any stream still sends it),
// or, in a job of pseudo-gradients, the round's global delta as the job
// encoded it (StateSnapshot::delta, no copy).
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

  enum class Form {
    kValues,  // state->values, encoded in `dtype`
    kDelta,   // state->delta, which is in `dtype`
  };

  // `state` must hold geometry.num_elements() values (and a delta for
  // kDelta).
  StateWire(std::shared_ptr<const StateSnapshot> state,
            const ChunkGeometry& geometry, WireCode code, Form form);

  // Chunk `index` (< num_chunks()): encoded and checksummed on first use.
  Chunk Get(uint32_t index) const ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<const StateSnapshot>& state() const { return state_; }
  RoundId round() const { return state_->round; }
  uint32_t num_chunks() const { return geometry_.num_chunks(); }
  WireCode wire_code() const { return wire_; }
  Form form() const { return form_; }

 private:
  struct Slot {
    bool ready = false;
    std::unique_ptr<char[]> encoded;  // not for fp32
    uint32_t crc32c = 0;
  };

  const std::shared_ptr<const StateSnapshot> state_;
  const ChunkGeometry geometry_;
  const WireCode wire_;
  const Form form_;
  mutable absl::Mutex mu_;
  mutable std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
};

// Per job, the wire form of the state its streams are sending now. A
// StateWire lives while a stream holds it: the members of a round receive
// their results at the same time and share one; a state nobody is sending
// costs nothing here. Thread-safe.
class WireCache {
 public:
  // The wire form of `state` of `job` (its geometry; the dtype its form
  // travels in): the delta if `delta` (a job of pseudo-gradients'
  // SyncResult::delta), else the values.
  std::shared_ptr<const StateWire> For(
      const Job& job, std::shared_ptr<const StateSnapshot> state,
      bool delta = false) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<const StateWire>> by_job_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_STATE_WIRE_H_
