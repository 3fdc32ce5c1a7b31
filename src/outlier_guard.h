// The outlier guard of a pseudo-gradient job (JobSettings.outlier_ratio): a
// contribution whose chunk has an L2 norm more than `ratio` times the
// robust center of that chunk's recent contributions is refused, and its
// member dropped from the round as the finite-state guard drops one (its
// chunks accepted before stay counted; its Sync gets the round's result,
// contributed = false).
//
// The center of chunk c is the median of the norms of the last kHistory
// contributions of c the guard accepted (this round's too), zero norms left
// out (a chunk a member did not change says nothing of the scale: frozen
// or sparsely updated parameters). A zero-norm contribution is always
// accepted.
//
// Cold start: while it knows fewer than kMinReference norms of a chunk (a
// job's first round; the first after a restart, a failover, a re-seed or a
// change of scale, below), the guard *holds* what it gets of that chunk (a
// copy of the bytes; at most kMinReference - 1 per chunk, so at most twice
// the model in its wire dtype) and judges the held ones together, in
// arrival order, against the median of their norms and those it knows,
// once it knows enough, once no participant that could still give the
// chunk is left, or at the round's deadline. With fewer than kMinReference
// norms in all it accepts them: of two contributions, nothing says which
// one is the outlier.
//
// A change of scale: when the guard refuses more of a round's participants
// than the round counts contributions of (a majority moved at once: a
// learning-rate schedule, a restart from another state), it forgets every
// chunk's norms and learns them anew from the next round, as at a cold
// start. A minority of outliers never moves the center: refused norms are
// not kept.
//
// No locks, no I/O: Job (src/job.h) owns one and calls it under its mutex.
#ifndef LOCALSGD_SRC_OUTLIER_GUARD_H_
#define LOCALSGD_SRC_OUTLIER_GUARD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/types.h"

namespace localsgd {

class OutlierGuard {
 public:
  // Norms kept per chunk (the most recent accepted), and the fewest that
  // make a center.
  static constexpr size_t kHistory = 16;
  static constexpr size_t kMinReference = 3;

  // `ratio` <= 0: off (every verdict is kAccept, nothing is kept).
  OutlierGuard(uint32_t num_chunks, float ratio);

  bool enabled() const { return ratio_ > 0; }
  float ratio() const { return ratio_; }

  enum class Verdict { kAccept, kReject, kHold };
  // The verdict on a contribution of chunk `c` with L2 norm `norm` that
  // arrives now. kReject sets *why (what the round record says).
  Verdict Judge(uint32_t c, double norm, std::string* why) const;
  // Keeps the norm of an accepted contribution of chunk `c` (kAccept: the
  // caller counted it).
  void Accept(uint32_t c, double norm);

  // Holds a contribution of chunk `c` (kHold), copying its bytes.
  void Hold(uint32_t c, const MemberId& member,
            absl::Span<const absl::string_view> pieces, double norm);
  // Whether chunk `c`'s held contributions can be judged: the guard knows
  // kMinReference norms of it, held ones included.
  bool Due(uint32_t c) const;
  bool Holds(uint32_t c, const MemberId& member) const;
  bool HoldsChunk(uint32_t c) const { return held_.contains(c); }
  bool any_held() const { return !held_.empty(); }
  // The chunks that hold contributions, in order.
  std::vector<uint32_t> HeldChunks() const;
  size_t held_bytes() const { return held_bytes_; }

  // Chunk `c`'s held contributions judged, in arrival order; the accepted
  // ones' norms are kept (as Accept), and nothing of `c` is held after.
  struct Judged {
    MemberId member;
    std::string bytes;
    double norm = 0;
    bool accepted = false;
    std::string why;  // when refused
  };
  std::vector<Judged> Release(uint32_t c);

  // Drops what `member` holds (it is gone from the round); everything held
  // (its round is gone).
  void Forget(const MemberId& member);
  void DropHeld();
  // The round closed with `refused` participants refused by the guard and
  // `counted` complete contributions: drops anything still held, and
  // forgets every norm if refused > counted (a change of scale; returns
  // true then).
  bool RoundClosed(uint32_t refused, uint32_t counted);
  // Forgets everything (a new state: a seed or a re-seed).
  void Reset();

  // The center of chunk `c`: the median of its kept norms (0 if none).
  double Center(uint32_t c) const;
  size_t known(uint32_t c) const { return history_[c].size(); }

 private:
  struct Held {
    MemberId member;
    std::string bytes;
    double norm = 0;
  };
  std::string Why(uint32_t c, double norm, double center, size_t over) const;

  const float ratio_;
  // Per chunk: a ring of up to kHistory norms, and where the next goes.
  std::vector<std::vector<double>> history_;
  std::vector<uint8_t> next_;
  absl::flat_hash_map<uint32_t, std::vector<Held>> held_;
  size_t held_bytes_ = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_OUTLIER_GUARD_H_
