#include "src/state_commit.h"

#include <algorithm>
#include <utility>

#include "glog/logging.h"
#include "src/codec.h"

namespace localsgd {
namespace {

// to = from[offset, offset + to.size()), or zeros if `from` is empty.
void CopyOrZero(const std::vector<float>& from, size_t offset,
                absl::Span<float> to) {
  if (from.empty()) {
    std::fill(to.begin(), to.end(), 0.0f);
  } else {
    std::copy_n(from.begin() + offset, to.size(), to.begin());
  }
}

// The averaging rule of a pseudo-gradient job (parameter jobs average
// parameters: MeanOfParameters). The settings are validated before a job
// exists (Coordinator::Join, checkpoint restore): a mode without a rule here
// is a bug, not bad input.
std::unique_ptr<AveragingRule> RuleFor(const JobSettings& settings) {
  if (settings.contribution != Contribution::kPseudoGradients) return nullptr;
  absl::StatusOr<std::unique_ptr<AveragingRule>> rule =
      MakeAveragingRule(settings);
  CHECK(rule.ok()) << rule.status();
  return *std::move(rule);
}

}  // namespace

StateCommit::StateCommit(const JobSettings& settings,
                         const ChunkGeometry& geometry)
    : settings_(settings), geometry_(geometry), rule_(RuleFor(settings)) {}

uint64_t StateCommit::NewStateId() {
  uint64_t id = 0;
  while (id == 0) id = absl::Uniform<uint64_t>(bitgen_);
  return id;
}

void StateCommit::Restore(RoundId round, std::vector<float> values, uint64_t id,
                          std::vector<float> momentum,
                          std::vector<float> residual) {
  auto state = std::make_shared<StateSnapshot>();
  state->round = round;
  state->values = std::move(values);
  state->id = id != 0 ? id : NewStateId();
  state->momentum = std::move(momentum);
  state->residual = std::move(residual);
  state_ = std::move(state);
}

std::vector<float> StateCommit::TakeBuffer() {
  return Recycled(spare_, geometry_.num_elements());
}

void StateCommit::GiveBack(std::vector<float> buffer) {
  if (spare_.empty()) spare_ = std::move(buffer);
}

std::vector<float> StateCommit::Recycled(std::vector<float>& spare, size_t n) {
  std::vector<float> buffer = std::move(spare);
  spare.clear();
  buffer.resize(n);
  return buffer;
}

std::shared_ptr<StateSnapshot> StateCommit::Mean(RoundAccumulator sums) const {
  auto state = std::make_shared<StateSnapshot>();
  state->values = MeanOfParameters(std::move(sums), state_->values);
  // Store exactly what members receive, so that a late joiner's fetched
  // state equals what the others hold.
  RoundTripInPlace(absl::MakeSpan(state->values), settings_.wire_dtype);
  return state;
}

std::shared_ptr<StateSnapshot> StateCommit::NewNext() {
  const DType wire = settings_.wire_dtype;
  const size_t n = geometry_.num_elements();
  auto next = std::make_shared<StateSnapshot>();
  next->previous_id = state_->id;
  next->delta = std::move(spare_delta_);
  spare_delta_.clear();
  next->delta.resize(
      WireBytes(wire, geometry_.chunk_elements()) *
          (geometry_.num_chunks() - 1) +
      WireBytes(wire, geometry_.Size(geometry_.num_chunks() - 1)));
  if (rule_->has_momentum()) next->momentum = Recycled(spare_momentum_, n);
  if (wire != DType::kFloat32) next->residual = Recycled(spare_residual_, n);
  return next;
}

void StateCommit::FinalizeChunk(RoundAccumulator& sums, uint32_t c,
                                StateSnapshot& next) const {
  const DType wire = settings_.wire_dtype;
  const bool lossy = wire != DType::kFloat32;
  const StateSnapshot& old = *state_;
  const size_t offset = geometry_.Offset(c);
  const absl::Span<float> chunk = sums.scaled_sums(c);
  const size_t len = chunk.size();
  // Carried over from the old state (zeros after a seed or a restore
  // without them), then updated in place.
  absl::Span<float> momentum;
  if (rule_->has_momentum()) {
    momentum = absl::MakeSpan(next.momentum).subspan(offset, len);
    CopyOrZero(old.momentum, offset, momentum);
  }
  absl::Span<float> residual;
  if (lossy) {
    residual = absl::MakeSpan(next.residual).subspan(offset, len);
    CopyOrZero(old.residual, offset, residual);
  }
  char* out =
      next.delta.data() + WireBytes(wire, geometry_.chunk_elements()) * c;
  if (sums.chunk_weight(c) > 0) {
    // mean delta -> the rule's step -> encoded with the residual -> what
    // the encoding decodes to (in place), as every member decodes it.
    DivideInPlace(chunk, sums.scaled_weight(c));
    rule_->Step(chunk, momentum, momentum);
    if (lossy) {
      EncodeWithFeedback(chunk, residual, wire, out, chunk);
    } else {
      // float32 decodes to itself: the step is what members add.
      EncodeValuesTo(chunk, wire, out);
    }
  } else {
    // No one contributed: the chunk keeps its state, momentum and
    // residual; its delta is zeros.
    std::fill(chunk.begin(), chunk.end(), 0.0f);
    EncodeValuesTo(chunk, wire, out);
  }
  const auto previous = absl::MakeConstSpan(old.values).subspan(offset, len);
  AddInPlace(chunk, previous);
}

std::shared_ptr<StateSnapshot> StateCommit::FinishNext(
    RoundAccumulator sums, const std::vector<uint32_t>& pending,
    std::shared_ptr<StateSnapshot> next) const {
  for (uint32_t c : pending) FinalizeChunk(sums, c, *next);
  next->values = sums.TakeBuffer();
  return next;
}

std::shared_ptr<const StateSnapshot> StateCommit::Commit(
    std::shared_ptr<StateSnapshot> state, RoundId round) {
  state->round = round;
  if (state->id == 0) state->id = NewStateId();
  std::shared_ptr<StateSnapshot> old = std::move(state_);
  state_ = state;
  // Recycle the old state's memory for the next accumulator unless a stream
  // (or the checkpointer) still reads it.
  if (old != nullptr && old.use_count() == 1) {
    if (spare_.empty()) spare_ = std::move(old->values);
    if (spare_momentum_.empty()) spare_momentum_ = std::move(old->momentum);
    if (spare_residual_.empty()) spare_residual_ = std::move(old->residual);
    if (spare_delta_.empty()) spare_delta_ = std::move(old->delta);
  }
  return state;
}

}  // namespace localsgd
