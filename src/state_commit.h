// A job's global state and how a round's sums become the next one
// (src/averaging.h has the rules):
//  - parameter jobs: the weighted mean of the parameters, rounded as the
//    wire dtype carries it (so that a late joiner fetches what the others
//    hold);
//  - pseudo-gradient jobs, chunk by chunk: the weighted mean delta (with
//    mean encoding wire and a lossy wire: encoded with the mean residual
//    carried from the previous state, and what that decodes to), the
//    rule's step on it (with the rule's momentum), the step encoded for the
//    wire with error feedback (the quantization residual carried from the
//    previous state; with mean encoding wire and MEAN the step is the
//    encoded mean itself), and the previous state plus what that encoding
//    decodes to, exactly as every member computes it. A chunk no one gave
//    keeps its values, momentum and residuals; its delta is zeros.
// It also names states (random non-zero ids) and recycles the buffers of
// states no one reads any more (fresh pages cost ~20x more than reused ones):
// a state still read when it is replaced (a member's result, the released
// state) is kept aside and its buffers taken once its last reader let go.
//
// Not thread-safe: Job owns one under its mutex (`Job::mu_`) and calls it
// only with that held. The states it hands out as shared_ptr<const> are not
// written again; a next state under construction (NewNext) is written only
// in chunks not yet final.
#ifndef LOCALSGD_SRC_STATE_COMMIT_H_
#define LOCALSGD_SRC_STATE_COMMIT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "src/averaging.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/round.h"
#include "src/types.h"

namespace localsgd {

class StateCommit {
 public:
  // `settings` complete and valid; a state has geometry.num_elements()
  // values.
  StateCommit(const JobSettings& settings, const ChunkGeometry& geometry);

  // The current state; null until seeded or restored.
  const StateSnapshot* state() const { return state_.get(); }
  std::shared_ptr<const StateSnapshot> shared_state() const { return state_; }
  // The current state's round and id; 0 without a state.
  RoundId state_round() const { return state_ != nullptr ? state_->round : 0; }
  uint64_t state_id() const { return state_ != nullptr ? state_->id : 0; }

  // Forgets the current state (a re-seed superseded by a newer one): no
  // state until the next Commit or Restore.
  void Drop() {
    state_.reset();
    magnitudes_.clear();
  }

  // A random non-zero state id.
  uint64_t NewStateId();

  // Makes the restored state (round, values; id 0: a new one; momentum,
  // residual and mean residual empty or of num_elements) the current one.
  void Restore(RoundId round, std::vector<float> values, uint64_t id,
               std::vector<float> momentum, std::vector<float> residual,
               std::vector<float> mean_residual = {},
               std::vector<uint64_t> ancestors = {});

  // How many rounds older than the current state the state `id` is: 0 for
  // the current one, s for its s-th ancestor (at most the job's
  // max_staleness are kept); -1 if it is none of them (older, of another
  // lineage, or never issued).
  int Staleness(uint64_t id) const;

  // Whether the rule is applied to the mean as the wire encodes it (mean
  // encoding wire, a lossy wire dtype): then a chunk's mean travels to
  // standbys encoded (EncodeMean, DecodeMean) and FinalizeMean takes it so.
  bool encodes_mean() const { return encodes_mean_; }

  // A buffer of num_elements floats (contents undefined), recycled from an
  // old state if possible; and one handed back unused (an abandoned seed).
  std::vector<float> TakeBuffer();
  void GiveBack(std::vector<float> buffer);

  // Parameter jobs: the state after a round, from its sums and the current
  // state's values (a chunk no one gave keeps them). Requires a state.
  std::shared_ptr<StateSnapshot> Mean(RoundAccumulator sums) const;

  // Pseudo-gradient jobs (require a state):
  // The empty next state of a round opening now: previous_id, a delta of
  // the wire size, momentum (if the rule has one), residual (if the step is
  // encoded lossily) and mean residual (encodes_mean()) buffers; no values
  // yet.
  std::shared_ptr<StateSnapshot> NewNext();
  // Computes chunk `c` of `next` from `sums` (see above); the chunk's sums
  // are overwritten with its new values. Returns false if the result was
  // not finite and the chunk kept its state instead (its delta zeros; the
  // finite-state guard, CheckHeadroom, admits nothing that gets there).
  bool FinalizeChunk(RoundAccumulator& sums, uint32_t c,
                     StateSnapshot& next) const;
  // The same from chunk `c`'s weighted mean delta (`contributed`: someone
  // gave the chunk; otherwise `chunk`'s contents are ignored), in `chunk`
  // on entry and its new values on return: what a standby, given the mean
  // its primary computed, reproduces bit for bit. With encodes_mean() and
  // `contributed`, `chunk` holds what `encoded_mean` decodes to (EncodeMean
  // or DecodeMean put it there).
  bool FinalizeMean(absl::Span<float> chunk, bool contributed, uint32_t c,
                    StateSnapshot& next,
                    absl::string_view encoded_mean = {}) const;
  // encodes_mean(), a primary, a chunk someone gave: encodes `chunk` (its
  // weighted mean delta) plus the mean residual carried from the current
  // state into `encoded_mean` (the chunk's wire bytes), keeps what the
  // encoding lost in next's mean residual, and leaves in `chunk` what
  // `encoded_mean` decodes to.
  void EncodeMean(absl::Span<float> chunk, uint32_t c, StateSnapshot& next,
                  std::string* encoded_mean) const;
  // encodes_mean(), a standby given a chunk's encoded mean: INVALID_ARGUMENT
  // (naming `what`), changing nothing, unless it is the chunk's wire bytes
  // with finite, valid scales; else `chunk` receives what it decodes to and
  // next's mean residual is zeros in the chunk (a standby has none of its
  // own: a failover drops the primary's).
  absl::Status DecodeMean(absl::string_view encoded_mean, uint32_t c,
                          StateSnapshot& next, absl::Span<float> chunk,
                          absl::string_view what) const;
  // The round's next state: its chunks `pending` (those not final yet)
  // computed now, and the sums' buffer as its values.
  std::shared_ptr<StateSnapshot> FinishNext(
      RoundAccumulator sums, const std::vector<uint32_t>& pending,
      std::shared_ptr<StateSnapshot> next) const;

  // The finite-state guard (pseudo-gradient jobs; requires a state): OK if
  // a contribution to chunk `c` whose values are at most `max_abs` in
  // magnitude keeps every value of the chunk's next state finite (values,
  // momentum, residual, encoded step), in any mean with other contributions
  // that pass; otherwise OUT_OF_RANGE saying what would overflow. The mean
  // of contributions lies between them and every step of the rule and the
  // encoding is monotone in it, so contributions that pass one by one pass
  // together; a margin of 1% on what the rule computes covers rounding. A
  // state at float32's limit takes deltas that do not push it over.
  absl::Status CheckHeadroom(uint32_t c, float max_abs);

  // Makes `state` the current one as the state of `round` (a new id if it
  // has none; its ancestors: the current state and its ancestors if it
  // follows from it, else none), and recycles the old one's buffers, or, if
  // someone else still reads it, keeps it aside to recycle once no one does (at
  // most kRetired states; an older one is left to its readers). Returns it.
  std::shared_ptr<const StateSnapshot> Commit(
      std::shared_ptr<StateSnapshot> state, RoundId round);

 private:
  // `spare` handed over (emptied) and resized to `n` floats.
  static std::vector<float> Recycled(std::vector<float>& spare, size_t n);
  // Moves the buffers of `old` (read by no one else) to the empty spares.
  void Harvest(StateSnapshot& old);
  // Harvests the states kept aside that no one reads any more.
  void HarvestRetired();
  // How many ancestors a state keeps: the job's max_staleness (0 off).
  size_t MaxAncestors() const;
  static constexpr size_t kRetired = 1;

  const JobSettings settings_;
  const ChunkGeometry geometry_;
  // The rule of a pseudo-gradient job (null in parameter jobs).
  const std::unique_ptr<AveragingRule> rule_;
  // Null until seeded. Kept non-const here so that a buffer no stream reads
  // any more can be recycled; handed out as shared_ptr<const>.
  std::shared_ptr<StateSnapshot> state_;
  std::vector<float> spare_;
  std::vector<float> spare_momentum_;
  std::vector<float> spare_residual_;
  std::vector<float> spare_mean_residual_;
  std::string spare_delta_;
  // Replaced states that were still read then (oldest first).
  std::vector<std::shared_ptr<StateSnapshot>> retired_;
  // Mean encoding wire with a lossy wire (encodes_mean()), and whether the
  // step is encoded with a residual of its own (a lossy wire, unless the
  // step is the encoded mean itself).
  const bool encodes_mean_;
  const bool encodes_step_;
  // The largest |value|, |momentum|, |residual| and |mean residual| of each
  // chunk of state_ (CheckHeadroom), computed when first needed; cleared
  // with a new state.
  struct ChunkMagnitudes {
    bool known = false;
    float values = 0, momentum = 0, residual = 0, mean_residual = 0;
  };
  std::vector<ChunkMagnitudes> magnitudes_;
  absl::BitGen bitgen_;  // state ids
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_STATE_COMMIT_H_
