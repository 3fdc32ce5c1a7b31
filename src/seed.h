// A job's seed in progress: the first member to Sync round 0 of a job that
// has no state sends its parameters, chunk by chunk, and they become the
// state (of round 0, or of the round a re-seed names: SeedOrigin); the other
// members adopt it once it is complete. Seed chunks are float32 in
// pseudo-gradient jobs and the wire dtype otherwise (Job::ChunkCode).
//
// Not thread-safe: Job owns at most one under its mutex (`Job::mu_`) and
// calls it only with that held.
#ifndef LOCALSGD_SRC_SEED_H_
#define LOCALSGD_SRC_SEED_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

class SeedState {
 public:
  // The seed of `owner`, continuing `origin`, of a layout of `geometry`;
  // `buffer` is memory for its values (recycled, any size).
  SeedState(MemberId owner, SeedOrigin origin, std::vector<float> buffer,
            const ChunkGeometry& geometry);

  const MemberId& owner() const { return owner_; }
  const SeedOrigin& origin() const { return origin_; }

  // Chunk `index` (checked: index, size, finite values) in `code`, decoded
  // into the values; one that arrived already is ignored. Returns whether
  // the seed is complete now. INVALID_ARGUMENT (nothing changed) if the
  // pieces do not decode.
  absl::StatusOr<bool> Add(uint32_t index,
                           absl::Span<const absl::string_view> pieces,
                           WireCode code);

  // What the complete seed commits at `now`: its record (the owner, named
  // `name`, of `weight`, its one participant and contributor) and the state
  // (the values, handed over; id origin.state_id, 0 for the commit to name
  // it). The round of both is origin.round.
  struct Completed {
    RoundRecord record;
    std::shared_ptr<StateSnapshot> state;
  };
  Completed Complete(const std::string& name, double weight, absl::Time now);

  // The values' buffer, handed back (an abandoned seed).
  std::vector<float> TakeValues() { return std::move(values_); }

  // A regional job's complete seed takes its upstream job's state
  // (src/upstream.h): `values` (as many as the seed's) replace its own and,
  // if they differ, the state is named anew at its commit rather than as
  // the origin named it.
  void TakeUpstream(absl::Span<const float> values);
  const std::vector<float>& values() const { return values_; }

  // "seeds the global state", or for a re-seed "re-seeds the global state at
  // round r (n contributed to it)".
  std::string Describe() const;

 private:
  const MemberId owner_;
  const SeedOrigin origin_;
  const ChunkGeometry geometry_;
  std::vector<float> values_;
  std::vector<bool> got_;
  uint32_t received_ = 0;
  bool renamed_ = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_SEED_H_
