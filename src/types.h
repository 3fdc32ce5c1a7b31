// Plain value types shared by the core, the server and the client.
#ifndef LOCALSGD_SRC_TYPES_H_
#define LOCALSGD_SRC_TYPES_H_

#include <cstdint>
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
};

// "float32", "bfloat16", ... ; "unspecified" for kUnspecified.
absl::string_view DTypeName(DType dtype);
// Bytes per element; 0 for kUnspecified.
int DTypeSize(DType dtype);
// Whether chunks may travel in this dtype (float32, bfloat16).
bool IsWireDType(DType dtype);

// INVALID_ARGUMENT naming `what` if `value` holds a control character (a
// byte below 0x20, or 0x7f): names reach status and the logs, where a
// newline or an escape sequence would forge or hide lines.
absl::Status CheckNoControlCharacters(absl::string_view value,
                                      absl::string_view what);

enum class AveragingMode : int {
  kUnspecified = 0,
  kMean = 1,
};
// "mean"; "unspecified" for kUnspecified.
absl::string_view AveragingModeName(AveragingMode mode);

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
};

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
  bool has_state = false;   // whether the job had global state at Join
  RoundId state_round = 0;  // round of that state
  // This replica's chunks and elements (all of the layout's unsharded).
  uint32_t num_chunks = 0;
  uint64_t num_elements = 0;
  ShardSpec shard;
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
struct SeedOrigin {
  RoundId round = 0;
  uint32_t contributors = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SRC_TYPES_H_
