#include "server/state_wire.h"

#include <utility>

#include "absl/types/span.h"
#include "glog/logging.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {

StateWire::StateWire(std::shared_ptr<const StateSnapshot> state,
                     const ChunkGeometry& geometry, WireCode code, Form form)
    : state_(std::move(state)),
      geometry_(geometry),
      wire_(code),
      form_(form),
      slots_(geometry.num_chunks()) {
  // A delta's state may still be in the making (a round whose chunks are
  // sent as they become final): only its delta is read, and only the
  // chunks asked for.
  CHECK(state_ != nullptr);
  CHECK(form_ == Form::kDelta ||
        state_->values.size() == geometry_.num_elements());
  CHECK(form_ == Form::kValues ||
        state_->delta.size() ==
            WireBytes(code, geometry_.chunk_elements()) *
                    (geometry_.num_chunks() - 1) +
                WireBytes(code, geometry_.Size(geometry_.num_chunks() - 1)));
}

StateWire::Chunk StateWire::Get(uint32_t index) const {
  CHECK_LT(index, geometry_.num_chunks());
  const size_t bytes = WireBytes(wire_, geometry_.Size(index));
  absl::Span<const float> values;
  if (form_ == Form::kValues) {
    values = absl::MakeConstSpan(state_->values)
                 .subspan(geometry_.Offset(index), geometry_.Size(index));
  }
  // The bytes that are already there: the state's own (float32 values) or
  // the job's encoded delta.
  absl::string_view own;
  if (form_ == Form::kDelta) {
    own = absl::string_view(state_->delta)
              .substr(WireBytes(wire_, geometry_.chunk_elements()) * index,
                      bytes);
  } else if (wire_.dtype == DType::kFloat32) {
    own =
        absl::string_view(reinterpret_cast<const char*>(values.data()), bytes);
  }
  {
    absl::MutexLock lock(&mu_);
    const Slot& slot = slots_[index];
    if (slot.ready) {
      return {slot.encoded == nullptr
                  ? own
                  : absl::string_view(slot.encoded.get(), bytes),
              slot.crc32c};
    }
  }
  // Outside the lock: two streams may both compute a chunk first (the same
  // bytes); the first to finish is kept.
  std::unique_ptr<char[]> encoded;
  absl::string_view data;
  if (form_ == Form::kDelta || wire_.dtype == DType::kFloat32) {
    data = own;
  } else {
    encoded = std::make_unique<char[]>(bytes);
    EncodeValuesTo(values, wire_, encoded.get());
    data = absl::string_view(encoded.get(), bytes);
  }
  const uint32_t crc = Crc32c(0, data);
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[index];
  if (!slot.ready) {
    slot.ready = true;
    slot.encoded = std::move(encoded);
    slot.crc32c = crc;
  }
  return {slot.encoded == nullptr
              ? data
              : absl::string_view(slot.encoded.get(), bytes),
          slot.crc32c};
}

std::shared_ptr<const StateWire> WireCache::For(
    const Job& job, std::shared_ptr<const StateSnapshot> state, bool delta) {
  const bool pseudo_gradients =
      job.settings().contribution == Contribution::kPseudoGradients;
  const StateWire::Form form = pseudo_gradients && delta
                                   ? StateWire::Form::kDelta
                                   : StateWire::Form::kValues;
  // A job of pseudo-gradients sends its values in float32 (a late member
  // or FetchState: the state as the coordinator holds it).
  const WireCode code = pseudo_gradients && form == StateWire::Form::kValues
                            ? WireCode(DType::kFloat32)
                            : ResultCodeOf(job.settings());
  absl::MutexLock lock(&mu_);
  std::weak_ptr<const StateWire>& entry =
      by_job_[form == StateWire::Form::kDelta ? job.id() + "/delta" : job.id()];
  if (std::shared_ptr<const StateWire> wire = entry.lock();
      wire != nullptr && wire->state() == state) {
    return wire;
  }
  auto wire = std::make_shared<const StateWire>(std::move(state),
                                                job.geometry(), code, form);
  entry = wire;
  // Forget the jobs nobody is sending to (bounded by the jobs that exist).
  if (by_job_.size() > 64) {
    absl::erase_if(by_job_, [](const auto& kv) { return kv.second.expired(); });
  }
  return wire;
}

}  // namespace localsgd
