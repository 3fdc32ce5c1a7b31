#include "src/sync_session.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/codec.h"
#include "src/job.h"

namespace localsgd {

absl::Status CheckSyncHeader(absl::string_view job, absl::string_view member,
                             RoundId round, const SeedOrigin& origin,
                             uint64_t anchor, bool pseudo_gradients) {
  if ((origin.round != 0 || origin.contributors != 0) && round != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Sync header of member ", member, " of job '", job, "' for round ",
        round, " names seed_round ", origin.round, " and seed_contributors ",
        origin.contributors, "; these go only with round 0 (a seed)"));
  }
  if (origin.contributors != 0 && origin.round == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sync header of member ", member, " of job '", job,
                     "' names seed_contributors ", origin.contributors,
                     " without a seed_round; they go with a re-seed"));
  }
  if (origin.state_id != 0 && origin.round == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sync header of member ", member, " of job '", job,
                     "' names seed_state_id ", origin.state_id,
                     " without a seed_round; it goes with a re-seed"));
  }
  if (origin.round > kMaxSeedRound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Sync header of member ", member, " of job '", job,
        "' names seed_round ", origin.round, "; at most ", kMaxSeedRound));
  }
  if (pseudo_gradients && round != 0 && anchor == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Sync header of member ", member, " of job '", job, "' for round ",
        round,
        " names no anchor_state_id; in a pseudo-gradient job it is "
        "required: the id of the state the delta was taken against"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CheckChunk(absl::string_view job,
                                   const ChunkGeometry& geometry, RoundId round,
                                   uint32_t index,
                                   absl::Span<const absl::string_view> pieces,
                                   WireCode code, bool drop_nonfinite) {
  const DType dtype = code.dtype;
  const uint32_t n = geometry.num_chunks();
  if (index >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk index ", index, " for round ", round, " of job '",
                     job, "' is out of range: the layout has ", n,
                     " chunks (0..", n - 1, "); did the model change?"));
  }
  const uint32_t elements = geometry.Size(index);
  const size_t expected = WireBytes(code, elements);
  size_t size = 0;
  for (absl::string_view piece : pieces) size += piece.size();
  if (size != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk ", index, " for round ", round, " of job '", job, "' has ", size,
        " bytes; expected ", expected, " (", elements, " ", DTypeName(dtype),
        IsBlockDType(dtype)
            ? absl::StrCat(" values in ", NumBlocks(elements), " blocks")
        : IsSparseDType(dtype)
            ? absl::StrCat(" values, ",
                           SparseKept(elements, SparseCodeOf(code)), " kept")
            : std::string(" values"),
        ")"));
  }
  if (IsCodeDType(dtype)) {
    if (absl::Status s = CheckPayloadPieces(pieces, code, elements); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", index, " for round ", round, " of job '", job,
                       "': ", s.message()));
    }
  }
  const int64_t bad = FirstNonFinitePieces(pieces, code, elements);
  if (bad < 0 || drop_nonfinite) return bad;
  return absl::InvalidArgumentError(
      absl::StrCat("chunk ", index, " for round ", round, " of job '", job,
                   "' has a non-finite value at element ", bad, " (flat index ",
                   geometry.Offset(index) + bad, "); contribution refused"));
}

// ---------------------------------------------------------------------------
// SyncSession

SyncSession::SyncSession(std::shared_ptr<Job> job, MemberId member,
                         RoundId round, Role role, uint64_t waiter_id,
                         uint32_t num_chunks)
    : job_(std::move(job)),
      member_(std::move(member)),
      round_(round),
      role_(role),
      waiter_id_(waiter_id),
      got_(num_chunks, false) {}

SyncSession::~SyncSession() {
  if (!cancelled_) Cancel();
}

absl::Status SyncSession::AddChunk(uint32_t index, absl::string_view data) {
  return AddChunk(index, absl::MakeConstSpan(&data, 1));
}

absl::Status SyncSession::AddChunk(uint32_t index,
                                   absl::Span<const absl::string_view> pieces) {
  // Checked before taking the job's lock or touching any accumulator. Seeds
  // are always refused a non-finite value: a seed is the state everyone
  // starts from.
  const absl::StatusOr<int64_t> nonfinite = CheckChunk(
      job_->id(), job_->geometry(), round_, index, pieces,
      job_->ChunkCode(*this),
      role_ == Role::kContribute &&
          job_->settings().nonfinite_policy == NonFinitePolicy::kDrop);
  if (!nonfinite.ok()) return nonfinite.status();
  if (*nonfinite >= 0) {
    job_->DropNonFinite(*this, index, *nonfinite);
    return absl::OkStatus();
  }
  const ChunkMagnitude magnitude =
      role_ == Role::kContribute && round_ > 0 && job_->pseudo_gradients()
          ? MagnitudePieces(pieces, job_->ChunkCode(*this),
                            job_->geometry().Size(index),
                            /*with_norm=*/job_->settings().outlier_ratio > 0)
          : ChunkMagnitude();
  return job_->AddChunk(*this, index, pieces, magnitude);
}

bool SyncSession::Cancel() {
  cancelled_ = true;
  return job_->CancelWaiter(*this);
}

}  // namespace localsgd
