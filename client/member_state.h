// What a member holds of one coordinator shard and what it computes for it:
// the client's half of the protocol's data, with no gRPC, threads or clock
// (the mirror of the coordinator's job state; the streams that carry it are
// client/sync_stream.h). Internal to the client library; not installed.
//
// A member's parameters are one flat fp32 buffer laid out as the job's
// Layout says; a shard owns the chunks i with i mod S == its index, and
// MemberState holds only those, back to back (its "local" chunks j).
//
// A pseudo-gradient job (JobSettings.contribution) keeps here:
//  - the anchor: the global state the parameters were trained from, and its
//    id; every contribution is the delta parameters - anchor;
//  - the next anchor: where a round's result is decoded (onto the anchor,
//    for a delta result) as it arrives; it becomes the anchor when the Sync
//    succeeds (CommitSync), and is dropped when it fails (RollBack), so a
//    failed Sync leaves the parameters and the anchor as they were;
//  - for a lossy wire dtype, the error feedback: what the encoding of this
//    member's deltas has lost so far (residual), and the same after the
//    Sync in progress, committed only if the contribution counted. With
//    error reset (ClientOptions::error_reset) the residual goes back into
//    the parameters after each Sync (parameters = anchor + residual), so
//    the next delta holds it and is encoded with no feedback added.
// A parameter job sends the parameters themselves; its result goes
// straight into them, each chunk's contribution kept just before it is
// overwritten, so that RollBack can put it back.
//
// Thread-safety: none; one thread drives a member's state (the client's
// thread for this shard).
#ifndef LOCALSGD_CLIENT_MEMBER_STATE_H_
#define LOCALSGD_CLIENT_MEMBER_STATE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

// What one Sync sends.
struct SyncPlan {
  // The round contributed to; 0 is a seed.
  RoundId round = 0;
  // A seed's origin: the state it continues (a re-seed) and how many
  // contributed to it; all zero for a job's first seed.
  SeedOrigin origin;
  // Whether a pseudo-gradient job's result goes into the parameters when
  // the Sync succeeds (a re-seed's caller decides later). Parameter jobs
  // always write their result into the parameters.
  bool result_to_params = true;
  // The local steps the contribution holds (SyncHeader.local_steps; -1:
  // not said).
  int64_t local_steps = -1;
  // The contribution's weight in place of the member's (SyncHeader.weight;
  // none: the member's).
  std::optional<double> weight;
  // With error reset: the parameters get the result alone (SyncWork::last).
  bool last = false;
};

class MemberState {
 public:
  MemberState() = default;
  MemberState(const MemberState&) = delete;
  MemberState& operator=(const MemberState&) = delete;

  // The member (re)joined a job of a `total`-element layout as `info`
  // says (its shard's chunks, wire dtype, contribution, state round). The
  // anchor, its id and the error feedback carry over a re-join (a re-seed
  // needs the anchor, a contribution after the re-join the error feedback;
  // a re-seed's commit resets the error feedback: SetAnchorId); buffers are
  // sized to the shard. Requires info.settings.chunk_elements >= 1.
  void OnJoined(const JoinInfo& info, uint64_t total);

  // ClientOptions::error_reset: the parameters after a Sync are the anchor
  // plus the residual, and a delta carries the residual in it. Set before
  // the first Sync.
  void set_error_reset(bool on) { error_reset_ = on; }

  bool pseudo_gradients() const { return pseudo_gradients_; }
  WireCode wire() const { return wire_; }
  // What the coordinator's deltas come in (ResultCodeOf).
  WireCode result_code() const { return result_; }
  // This shard's chunks, back to back.
  const ChunkGeometry& local() const { return local_; }
  uint32_t num_chunks() const { return local_.num_chunks(); }
  // The dtype a state travels in: a FetchState, a seed, a late result
  // (float32 in a pseudo-gradient job, else the wire dtype).
  WireCode StateCode() const;

  // Round of the state the parameters hold, and how many contributed to
  // the last round this member saw close (a re-seed waits for as many).
  RoundId state_round() const { return state_round_; }
  uint32_t last_contributors() const { return last_contributors_; }
  // A re-join that did not get a newer state puts back what the
  // parameters grew from.
  void RestoreRound(RoundId round, uint32_t contributors) {
    state_round_ = round;
    last_contributors_ = contributors;
  }
  // The id of the anchor's state (pseudo-gradient jobs; 0 before one).
  uint64_t anchor_id() const { return anchor_id_; }

  // The elements of `params` (the whole layout) that local chunk `j`
  // covers.
  absl::Span<float> Slice(absl::Span<float> params, uint32_t j) const;
  // Local chunk `j` of the anchor.
  absl::Span<const float> AnchorSlice(uint32_t j) const;
  // Local chunk `j`'s first element in the whole layout.
  uint64_t GlobalOffset(uint32_t j) const;

  // --- One Sync ---
  // Starts a Sync of `plan` over `params`, which must stay valid until
  // CommitSync or RollBack.
  void BeginSync(const SyncPlan& plan, absl::Span<float> params);
  // Starts an attempt of the Sync (the first or a retry): puts back the
  // contribution a failed attempt's result overwrote, and restarts the
  // error feedback of this attempt from the committed residual (from zero
  // with error reset: the residual is in the parameters).
  void BeginAttempt();
  const SyncPlan& plan() const { return plan_; }
  // Whether the chunks sent are a delta against the anchor (a
  // pseudo-gradient job's round; its seeds are states).
  bool SendsDelta() const { return pseudo_gradients_ && plan_.round != 0; }
  // Whether a seed sends the anchor (a pseudo-gradient re-seed).
  bool SendsAnchor() const {
    return pseudo_gradients_ && plan_.round == 0 && plan_.origin.round > 0 &&
           plan_.origin.state_id != 0;
  }
  // The dtype of the chunks sent.
  WireCode SendCode() const;
  // Bytes of local chunk `c` as sent.
  size_t SendBytes(uint32_t c) const;
  // Encodes local chunk `c` of the contribution into `out` (SendBytes(c)
  // bytes): a delta with this attempt's error feedback, the anchor, or the
  // parameters. A chunk whose result already came back is sent as it was.
  void EncodeChunk(uint32_t c, char* out);
  // Where local chunk `j` of the result goes (the next anchor, or the
  // parameters after keeping the contribution there).
  absl::Span<float> ResultSlice(uint32_t j);
  // The Sync succeeded with `outcome`: the result becomes the anchor (and,
  // unless the plan says otherwise, the parameters); the error feedback
  // carries on if the delta counted.
  void CommitSync(const RoundOutcome& outcome);
  // The Sync failed: the parameters are as they were before it.
  void RollBack();
  // Puts this member's contribution back where the last Sync's result
  // overwrote it in the parameters (parameter jobs; a re-seed that goes on
  // to contribute them).
  void RestoreContribution() { RollBack(); }
  // Copies the anchor into the parameters' local chunks.
  void CopyAnchorTo(absl::Span<float> params) const;

  // --- One FetchState ---
  // Where local chunk `j` of a fetched state goes: the next anchor in a
  // pseudo-gradient job, else straight into `params`.
  absl::Span<float> FetchSlice(absl::Span<float> params, uint32_t j);
  // The fetch of the state `state_id` at `round` succeeded. INTERNAL for a
  // pseudo-gradient job's state without an id (then nothing changes).
  absl::Status CommitFetch(RoundId round, uint64_t state_id,
                           absl::Span<float> params);

 private:
  absl::Span<float> NextSlice(uint32_t j);
  // The anchor now holds the state `id`. The error feedback carries on if
  // this member's delta was counted, and starts over otherwise (the
  // parameters it was about were replaced).
  void SetAnchorId(uint64_t id, bool contributed);
  void EncodeDelta(uint32_t c, absl::Span<const float> params, char* out);

  bool pseudo_gradients_ = false;
  bool error_reset_ = false;
  WireCode wire_ = DType::kFloat32;
  WireCode result_ = DType::kFloat32;
  ShardSpec shard_;
  ChunkGeometry global_;  // the whole layout
  ChunkGeometry local_;   // this shard's chunks, back to back
  RoundId state_round_ = 0;
  uint32_t last_contributors_ = 0;

  // Pseudo-gradient jobs: the anchor and its id, the next anchor, the error
  // feedback committed and in progress (lossy wire dtypes only); scratch
  // for one chunk's delta and its decoded value.
  std::vector<float> anchor_;
  std::vector<float> next_;
  uint64_t anchor_id_ = 0;
  std::vector<float> residual_;
  std::vector<float> residual_next_;
  // The chunks whose residual_next_ this attempt's encoding wrote.
  std::vector<bool> residual_encoded_;
  std::vector<float> delta_;
  std::vector<float> decoded_;

  // The Sync in progress.
  SyncPlan plan_;
  absl::Span<float> params_;
  // Parameter jobs: this member's contribution to the chunks whose result
  // has been written over it in the current Sync (one model's worth,
  // reused).
  std::vector<float> kept_;
  std::vector<bool> kept_chunk_;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_MEMBER_STATE_H_
