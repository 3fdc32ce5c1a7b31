// Plain value types shared by the core, the server and the client.
#ifndef LOCALSGD_SRC_TYPES_H_
#define LOCALSGD_SRC_TYPES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace localsgd {

// Element types. Values match localsgd.v1.DType on the wire.
enum class DType : int {
  kUnspecified = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kFloat64 = 4,
  // Wire only, pseudo-gradient jobs only (Contribution::kPseudoGradients):
  // blocks of kQuantBlock elements, each a float32 absmax scale and a signed
  // code per element (codec.h). Never a tensor's dtype.
  kInt8Block = 5,
  kInt4Block = 6,
  // Wire only, pseudo-gradient jobs only: per block of kSparseBlock
  // elements, the JobSettings::sparse_keep values of largest magnitude, each
  // a position (Elias-Fano coded) and a 2-bit (kSparse2) or 4-bit (kSparse4)
  // code, with
  // the block's smallest and largest kept magnitude (src/sparse_codec.h).
  kSparse2 = 7,
  kSparse4 = 8,
};

// "float32", "bfloat16", ... ; "unspecified" for kUnspecified.
absl::string_view DTypeName(DType dtype);
// Bytes per element; 0 for kUnspecified.
int DTypeSize(DType dtype);
// Whether chunks may travel in this dtype (float32, bfloat16, and the
// blockwise and sparse codes of pseudo-gradient jobs).
bool IsWireDType(DType dtype);
// Whether `dtype` is one of the blockwise codes (kInt8Block, kInt4Block).
inline bool IsBlockDType(DType dtype) {
  return dtype == DType::kInt8Block || dtype == DType::kInt4Block;
}
// Whether `dtype` is one of the sparse codes (kSparse2, kSparse4).
inline bool IsSparseDType(DType dtype) {
  return dtype == DType::kSparse2 || dtype == DType::kSparse4;
}
// Whether `dtype` is a code of a few bits that only pseudo-gradient jobs
// take (blockwise or sparse): a payload read whole, not element by element.
inline bool IsCodeDType(DType dtype) {
  return IsBlockDType(dtype) || IsSparseDType(dtype);
}

// A wire encoding in full: the dtype and what else its payloads' layout
// depends on. Built from a bare DType for the dtypes that need nothing
// else (every one but the sparse codes, which need sparse_keep: a job's
// comes from WireCodeOf).
struct WireCode {
  WireCode(DType dtype = DType::kFloat32, uint32_t sparse_keep = 0)  // NOLINT
      : dtype(dtype), sparse_keep(sparse_keep) {}
  DType dtype;
  // The sparse codes: the values kept per full block, in [1, kSparseBlock].
  uint32_t sparse_keep;
  bool operator==(const WireCode& o) const {
    return dtype == o.dtype &&
           (!IsSparseDType(dtype) || sparse_keep == o.sparse_keep);
  }
  bool operator!=(const WireCode& o) const { return !(*this == o); }
};

// Whether `job_id` is a valid job id: [A-Za-z0-9._-]{1,128}.
absl::Status ValidateJobId(absl::string_view job_id);

// INVALID_ARGUMENT naming `what` if `value` holds a control character (a
// byte below 0x20, 0x7f, or a C1 control U+0080-U+009F in UTF-8) or a
// bidirectional embedding, override or isolate (U+202A-U+202E,
// U+2066-U+2069) or a line or paragraph separator (U+2028, U+2029), with
// the code and its byte offset: names reach status,
// the status page and the logs, where a newline or an escape sequence
// would forge or hide lines and a bidi override would show them reordered.
absl::Status CheckNoControlCharacters(absl::string_view value,
                                      absl::string_view what);

// How a round combines its contributions; see localsgd.v1.AveragingMode.
enum class AveragingMode : int {
  kUnspecified = 0,
  kMean = 1,
  // Pseudo-gradient jobs only: DiLoCo's outer optimizer,
  // torch.optim.SGD(nesterov=True) on the outer gradient -mean(delta).
  kOuterNesterov = 2,
  // Pseudo-gradient jobs only: torch.optim.SGD without momentum.
  kOuterSgd = 3,
};
// "mean", "outer_nesterov", "outer_sgd"; "unspecified" for kUnspecified.
absl::string_view AveragingModeName(AveragingMode mode);

// What members send a round; see localsgd.v1.Contribution.
enum class Contribution : int {
  kUnspecified = 0,
  // Their parameters; the state is their weighted mean (rounded to the wire
  // dtype). MEAN only, float32 or bfloat16 only.
  kParameters = 1,
  // Their pseudo-gradients (theta_local - anchor); the coordinator keeps the
  // fp32 state and sends back the global delta.
  kPseudoGradients = 2,
};
// "parameters", "pseudo_gradients"; "unspecified" for kUnspecified.
absl::string_view ContributionName(Contribution contribution);

// What a chunk with a NaN or infinity does; see localsgd.v1.NonFinitePolicy.
enum class NonFinitePolicy : int {
  kUnspecified = 0,
  // The Sync fails with INVALID_ARGUMENT naming the chunk and element.
  kReject = 1,
  // The member is dropped from the round; its Sync gets the result with
  // contributed = false.
  kDrop = 2,
};
absl::string_view NonFinitePolicyName(NonFinitePolicy policy);

// How a job's rounds stop waiting for the slowest; see
// localsgd.v1.DeadlineMode.
enum class DeadlineMode : int {
  kUnspecified = 0,
  // The coordinator's --round_deadline (or none).
  kFixed = 1,
  // Learned from the job's recent rounds (LagHistory, src/round.h); the
  // fixed deadline, if any, still bounds it.
  kAdaptive = 2,
};
// "fixed", "adaptive"; "unspecified" for kUnspecified.
absl::string_view DeadlineModeName(DeadlineMode mode);

// How many local steps members make between contributions; see
// localsgd.v1.StepBudget.
enum class StepBudget : int {
  kUnspecified = 0,
  kFixed = 1,
  kAdaptive = 2,
};
// "fixed", "adaptive"; "unspecified" for kUnspecified.
absl::string_view StepBudgetName(StepBudget budget);

// What a pseudo-gradient job's rule is applied to; see
// localsgd.v1.MeanEncoding.
enum class MeanEncoding : int {
  kUnspecified = 0,
  // The weighted mean delta in float32.
  kFloat32 = 1,
  // The mean encoded in the wire dtype with the coordinator's mean
  // residual (error feedback), as it decodes.
  kWire = 2,
};
// "float32", "wire"; "unspecified" for kUnspecified.
absl::string_view MeanEncodingName(MeanEncoding encoding);

// Which chunks a coordinator replica owns: chunk i of a layout belongs to
// replica i mod count. {0, 1}: one coordinator owns every chunk.
struct ShardSpec {
  uint32_t index = 0;
  uint32_t count = 1;
  bool operator==(const ShardSpec& o) const {
    return index == o.index && count == o.count;
  }
};

// Per-job settings; see localsgd.v1.JobSettings. Zero/unspecified fields mean
// "coordinator default" in a request.
struct JobSettings {
  uint32_t local_sgd_steps = 0;
  uint32_t chunk_elements = 0;
  DType wire_dtype = DType::kUnspecified;
  AveragingMode mode = AveragingMode::kUnspecified;
  // Averaging starts once this many members take part; see
  // localsgd.v1.JobSettings.rendezvous_members. 0 or 1: no rendezvous.
  uint32_t rendezvous_members = 0;
  NonFinitePolicy nonfinite_policy = NonFinitePolicy::kUnspecified;
  Contribution contribution = Contribution::kUnspecified;
  // The outer optimizer's (OUTER_NESTEROV, OUTER_SGD; MEAN ignores them).
  // 0: unset.
  float outer_lr = 0;
  float outer_momentum = 0;
  DeadlineMode deadline_mode = DeadlineMode::kUnspecified;
  // The outlier guard (pseudo-gradient jobs; src/outlier_guard.h): a
  // contribution chunk whose L2 norm exceeds this many times the median of
  // the chunk's recent ones is refused. 0: unset; kOutlierGuardOff: off.
  float outlier_ratio = 0;
  MeanEncoding mean_encoding = MeanEncoding::kUnspecified;
  // Pseudo-gradient jobs: a delta against a state at most this many rounds
  // older than the job's is merged into the open round, discounted by its
  // staleness, instead of being thrown away (docs/design.md "Stale
  // contributions"). 0: unset (in a job's settings, as from a peer that
  // predates it: off); kMaxStalenessOff: off (only deltas against the
  // current state count); else in [1, kMaxStalenessLimit].
  int32_t max_staleness = 0;
  // Per-member step budgets (StepBudget::kAdaptive: the coordinator hands
  // each member the local steps to make, and weighs contributions by their
  // steps) and their bounds (0: max(1, K / 4) and 4 K).
  StepBudget step_budget = StepBudget::kUnspecified;
  uint32_t min_local_steps = 0;
  uint32_t max_local_steps = 0;
  // The sparse wire dtypes' values kept per block of 4096: in a member's
  // upload, and in the coordinator's step (the mean of W uploads has up to
  // W times as many non-zero values). A set value in [1, 4096] whatever
  // the dtype; 0: unset.
  uint32_t sparse_keep = 0;
  uint32_t sparse_result_keep = 0;
};

// A job's wire encoding of what members upload: its wire dtype and, for a
// sparse one, sparse_keep.
inline WireCode WireCodeOf(const JobSettings& s) {
  return WireCode(s.wire_dtype, s.sparse_keep);
}
// And of what the coordinator sends back as a round's delta (its step, or
// the encoded mean): the same, but a sparse one keeps sparse_result_keep.
inline WireCode ResultCodeOf(const JobSettings& s) {
  return WireCode(s.wire_dtype, s.sparse_result_keep);
}

// JobSettings.max_staleness's value for "no stale contributions", and the
// largest staleness a job may accept.
inline constexpr int32_t kMaxStalenessOff = -1;
inline constexpr int32_t kMaxStalenessLimit = 64;

// JobSettings.outlier_ratio's value for "no outlier guard", and the range of
// the others.
inline constexpr float kOutlierGuardOff = -1.0f;
inline constexpr float kMinOutlierRatio = 2.0f;
inline constexpr float kMaxOutlierRatio = 1e9f;

// Round number of a job. Round 0 is the seed; averaging rounds start at 1.
using RoundId = uint64_t;

// Server-assigned member identity: 128 random bits as 32 lower-case hex digits.
class MemberId {
 public:
  MemberId() = default;
  explicit MemberId(std::string hex) : hex_(std::move(hex)) {}
  // Whether `hex` has the form of a member id.
  static bool IsWellFormed(absl::string_view hex);

  const std::string& str() const { return hex_; }
  bool empty() const { return hex_.empty(); }

  friend bool operator==(const MemberId& a, const MemberId& b) {
    return a.hex_ == b.hex_;
  }
  friend bool operator!=(const MemberId& a, const MemberId& b) {
    return !(a == b);
  }
  friend bool operator<(const MemberId& a, const MemberId& b) {
    return a.hex_ < b.hex_;
  }
  template <typename H>
  friend H AbslHashValue(H h, const MemberId& id) {
    return H::combine(std::move(h), id.hex_);
  }

 private:
  std::string hex_;
};

// What a Join tells the member (localsgd.v1.JoinResponse).
struct JoinInfo {
  MemberId member_id;
  JobSettings settings;      // the job's, after defaults
  absl::Duration lease_ttl;  // heartbeats go every lease_ttl / 3
  // The coordinator's round rules and message limit.
  absl::Duration round_deadline;  // zero: none
  uint32_t min_quorum = 1;
  uint64_t max_message_bytes = 0;
  // CoordinatorPolicy.paced_uploads: a member may pace its upload on the
  // early results (ClientOptions::max_lead_chunks).
  bool paced_uploads = false;
  bool has_state = false;   // whether the job had global state at Join
  RoundId state_round = 0;  // round of that state
  uint64_t state_id = 0;    // and its id (pseudo-gradient jobs)
  // This replica's chunks and elements (all of the layout's unsharded).
  uint32_t num_chunks = 0;
  uint64_t num_elements = 0;
  ShardSpec shard;
  // The answering primary's epoch (JoinResponse.epoch); 0 without an
  // election.
  uint64_t epoch = 0;
};

// How a round ended for one member (localsgd.v1.SyncResult).
struct RoundOutcome {
  // The round whose result the member now holds.
  RoundId round = 0;
  // Whether this member's contribution was counted in it.
  bool contributed = false;
  // The member's round had closed already (or it joined while the round was
  // open): it adopted the latest result instead.
  bool late = false;
  // Members counted in the round and their total weight.
  uint32_t contributors = 0;
  double contributor_weight = 0;
  // The id of the state the member now holds: in a pseudo-gradient job,
  // what its next contribution names as its anchor (parameter jobs' states
  // have ids too; their members do not send them).
  uint64_t state_id = 0;
  // The epoch of the primary that answered (SyncResult.epoch); 0 without
  // an election.
  uint64_t epoch = 0;
  // Pseudo-gradient jobs with stale contributions: how many rounds older
  // than the job's state the member's anchor was when its delta was merged
  // (0: it was current, or nothing was merged).
  uint32_t staleness = 0;
  // StepBudget::kAdaptive: the local steps to make before the next
  // contribution (0: K).
  uint32_t local_steps_budget = 0;
};

// The most local steps one contribution may say it holds
// (SyncHeader.local_steps): far beyond any real K.
inline constexpr uint32_t kMaxLocalSteps = 1u << 20;

// What a member's Sync says of its contribution besides its round and
// anchor (SyncHeader.local_steps).
struct SyncWork {
  // The local steps its delta holds; -1: not said.
  int64_t local_steps = -1;
  // The contribution's weight in place of its member's weight times its
  // step weight (SyncHeader.weight); none: not said.
  std::optional<double> weight;
  // The member's last Sync of its training (LocalSGD's final sync): with
  // ClientOptions::error_reset, the parameters it hands back are the
  // global state alone and the member's residual is dropped, so that every
  // member ends on the same parameters. No effect otherwise.
  bool last = false;
};

// Local steps by their fate (localsgd.v1.StepCounts): those whose effect
// entered the global state and those thrown away, and why.
struct StepCounts {
  // Entered the state: in a round's mean, and of those, merged stale.
  uint64_t merged = 0;
  uint64_t merged_stale = 0;
  // Thrown away: the delta came after its round closed (too stale, or
  // stale contributions off), was refused (a non-finite value, the
  // finite-state guard, the outlier guard), its member went away before
  // it was complete, or its round closed at a deadline before it was.
  uint64_t late = 0;
  uint64_t refused = 0;
  uint64_t gone = 0;
  uint64_t timed_out = 0;

  uint64_t discarded() const { return late + refused + gone + timed_out; }
  // merged / (merged + discarded); 1 when nothing was counted.
  double goodput() const {
    const uint64_t all = merged + discarded();
    return all == 0 ? 1.0 : static_cast<double>(merged) / all;
  }
  void Add(const StepCounts& o) {
    merged += o.merged;
    merged_stale += o.merged_stale;
    late += o.late;
    refused += o.refused;
    gone += o.gone;
    timed_out += o.timed_out;
  }
};

// The largest round a re-seed may name (Job::BeginSync): far beyond any
// real job, and far from overflowing the round arithmetic.
inline constexpr RoundId kMaxSeedRound = RoundId{1} << 48;

// What a seed continues (SyncHeader.seed_round, Job::BeginSync). A new
// job's seed is round 0. A member re-seeding a job that its coordinator
// lost names the round of the state its parameters were trained from, and
// how many members contributed to that round as it last saw it: the job's
// numbering goes on from that round, and its next round regathers until
// that many members are back in it (for at most one lease TTL).
//
// In a pseudo-gradient job a re-seed sends the state its parameters were
// trained from (its anchor) and names that state's id (state_id), so that
// the members holding the same state go on contributing their deltas
// against it; 0 gives the seed a new id (a new job's seed always gets one).
struct SeedOrigin {
  RoundId round = 0;
  uint32_t contributors = 0;
  uint64_t state_id = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_TYPES_H_
