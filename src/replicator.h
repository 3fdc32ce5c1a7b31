// What a primary coordinator's jobs hand their standbys, and when a result
// may reach members (docs/design.md, "Standby coordinators").
//
// The invariant: no member ever holds a state, or a chunk of one, that a
// surviving standby in sync cannot reproduce bit for bit. A job in a primary
// tells its Replicator, under its lock and so in its own order, what makes
// each new state:
//   - per chunk of a round's result as it becomes final, the chunk's weighted
//     mean delta in float32 (or that no one gave it): a standby applies the
//     same rule step, encoding with error feedback and sum
//     (StateCommit::FinalizeMean) and gets the same values, momentum,
//     residual and encoded delta, bit for bit;
//   - per closed round, its id and record; per seed, its values; with
//     each, the job's members (so that they go on after a failover under
//     their ids, without a Join).
// Each update gets a ticket, increasing. A result (a final chunk told to
// members, a round's result, an adopted state) is released only once the
// standbys in sync have acknowledged every update up to its ticket
// (WhenAcked). The standby applies the same updates to a job of its own
// (Job::ApplyReplicated*); at its promotion a round it holds only some final
// chunks of opens with those chunks fixed (Job::Promote).
//
// The cost of the choice: 4 bytes per parameter per round to each standby,
// one float32 download (at W members, 1/W of the primary's egress in float32
// rounds; 8x an int4 download). In exchange the rule's state (momentum,
// residual) is exact on the standby, and the standby reproduces what members
// hold without the members' inputs. A job of mean encoding wire applies its
// rule to the encoded mean, so its standbys get that (one member's
// download) and reproduce the rest; only the primary's mean residual (what
// its encodings of the mean lost) is not replicated: a failover drops it.
#ifndef LOCALSGD_SRC_REPLICATOR_H_
#define LOCALSGD_SRC_REPLICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "src/job_types.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

// Chunk `chunk` of round `round`'s result became final: `mean` its weighted
// mean delta (float32, the chunk's elements), empty if no one gave it; with
// mean encoding wire (StateCommit::encodes_mean) `encoded_mean` instead,
// the mean as the primary encoded it (the chunk's wire bytes).
struct ReplicatedChunk {
  std::string job_id;
  RoundId round = 0;
  uint32_t chunk = 0;
  bool contributed = false;
  std::vector<float> mean;
  std::string encoded_mean;
};

// A new state: round `round` closed (every chunk shipped before), or a seed
// (`seed` holds its values; round 0, or a re-seed's round; with the job's
// layout and settings, for a standby that has not seen the job yet).
struct ReplicatedCommit {
  std::string job_id;
  RoundId round = 0;
  uint64_t state_id = 0;
  uint64_t previous_id = 0;  // 0 for a seed
  RoundRecord record;
  std::shared_ptr<const StateSnapshot> seed;
  Layout layout;
  JobSettings settings;
  // The job's members as the state is committed (sorted by name): every
  // member that can hold this state is among them, so that after a
  // failover its calls go on without a new Join.
  std::vector<MemberInfo> members;
};

// A job as its primary holds it when a standby starts following (the
// catch-up): its state and the final chunks of its open round; its updates
// after ticket `sequence` follow.
struct JobReplica {
  std::string job_id;
  Layout layout;
  JobSettings settings;
  uint64_t sequence = 0;
  std::shared_ptr<const StateSnapshot> state;  // null: no state yet
  // The open round's final chunks (of round state->round + 1): their new
  // values (in a buffer of the whole state), momentum, residual and
  // encoded delta (in `partial`, laid out as a next state's).
  std::vector<uint32_t> final_chunks;
  std::vector<float> partial_values;
  std::shared_ptr<const StateSnapshot> partial;
  std::vector<RoundRecord> recent_rounds;  // newest first
  std::vector<MemberInfo> members;         // sorted by name
};

// A standby as its primary sees it (status, metrics).
struct StandbyStatus {
  std::string address;
  bool in_sync = false;
  uint64_t acked = 0;  // the last update it acknowledged
  uint64_t lag = 0;    // updates made and not acknowledged by it
};

class Replicator {
 public:
  virtual ~Replicator() = default;

  // Called under the job's lock, in the job's order; must not block or call
  // into the job. Each returns the update's ticket (increasing).
  virtual uint64_t Chunk(ReplicatedChunk chunk) = 0;
  virtual uint64_t Commit(ReplicatedCommit commit) = 0;
  // The ticket of the last update (0: none yet); under a job's lock, what
  // its later updates exceed.
  virtual uint64_t LastTicket() = 0;

  // Runs `release` once the standbys in sync have acknowledged every update
  // up to `ticket`: at once (on this thread) if they have or if none is in
  // sync, else later on another thread. Called without the job's lock;
  // `release` must not block.
  virtual void WhenAcked(uint64_t ticket, std::function<void()> release) = 0;

  // The standbys following now (none by default).
  virtual std::vector<StandbyStatus> Standbys() { return {}; }
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_REPLICATOR_H_
