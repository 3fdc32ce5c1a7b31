#include "src/seed.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "src/codec.h"

namespace localsgd {

SeedState::SeedState(MemberId owner, SeedOrigin origin,
                     std::vector<float> buffer, const ChunkGeometry& geometry)
    : owner_(std::move(owner)),
      origin_(origin),
      geometry_(geometry),
      values_(std::move(buffer)),
      got_(geometry.num_chunks(), false) {
  values_.resize(geometry.num_elements());
}

absl::StatusOr<bool> SeedState::Add(uint32_t index,
                                    absl::Span<const absl::string_view> pieces,
                                    WireCode code) {
  if (got_[index]) return false;
  if (absl::Status s = DecodeValuesPieces(
          pieces, code,
          absl::MakeSpan(values_).subspan(geometry_.Offset(index),
                                          geometry_.Size(index)));
      !s.ok()) {
    return s;
  }
  got_[index] = true;
  return ++received_ == got_.size();
}

SeedState::Completed SeedState::Complete(const std::string& name, double weight,
                                         absl::Time now) {
  Completed out;
  RoundRecord& record = out.record;
  record.round = origin_.round;
  record.reason = CloseReason::kSeed;
  record.opened = now;
  record.closed = now;
  record.participants = {name};
  record.contributors = {name};
  record.contributor_ids.insert(owner_);
  record.contributor_weight = weight;
  out.state = std::make_shared<StateSnapshot>();
  out.state->round = origin_.round;
  out.state->values = std::move(values_);
  out.state->id = renamed_ ? 0 : origin_.state_id;
  return out;
}

void SeedState::TakeUpstream(absl::Span<const float> values) {
  if (!std::equal(values.begin(), values.end(), values_.begin(), values_.end(),
                  [](float a, float b) {
                    return absl::bit_cast<uint32_t>(a) ==
                           absl::bit_cast<uint32_t>(b);
                  })) {
    renamed_ = true;
  }
  std::copy(values.begin(), values.end(), values_.begin());
}

std::string SeedState::Describe() const {
  if (origin_.round == 0) return "seeds the global state";
  return absl::StrCat("re-seeds the global state at round ", origin_.round,
                      " (", origin_.contributors, " contributed to it)");
}

}  // namespace localsgd
