#include "server/state_wire.h"

#include <utility>

#include "absl/types/span.h"
#include "glog/logging.h"
#include "src/codec.h"
#include "src/crc32c.h"

namespace localsgd {

StateWire::StateWire(std::shared_ptr<const StateSnapshot> state,
                     const ChunkGeometry& geometry, DType wire_dtype)
    : state_(std::move(state)),
      geometry_(geometry),
      wire_dtype_(wire_dtype),
      slots_(geometry.num_chunks()) {
  CHECK(state_ != nullptr && state_->values.size() == geometry_.num_elements());
}

StateWire::Chunk StateWire::Get(uint32_t index) const {
  CHECK_LT(index, geometry_.num_chunks());
  const auto values =
      absl::MakeConstSpan(state_->values)
          .subspan(geometry_.Offset(index), geometry_.Size(index));
  const size_t bytes = WireBytes(wire_dtype_, values.size());
  {
    absl::MutexLock lock(&mu_);
    const Slot& slot = slots_[index];
    if (slot.ready) {
      return {slot.encoded == nullptr
                  ? absl::string_view(
                        reinterpret_cast<const char*>(values.data()), bytes)
                  : absl::string_view(slot.encoded.get(), bytes),
              slot.crc32c};
    }
  }
  // Outside the lock: two streams may both compute a chunk first (the same
  // bytes); the first to finish is kept.
  std::unique_ptr<char[]> encoded;
  absl::string_view data;
  if (wire_dtype_ == DType::kFloat32) {  // the values' own bytes
    data =
        absl::string_view(reinterpret_cast<const char*>(values.data()), bytes);
  } else {
    encoded = std::make_unique<char[]>(bytes);
    EncodeValuesTo(values, wire_dtype_, encoded.get());
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
    const Job& job, std::shared_ptr<const StateSnapshot> state) {
  absl::MutexLock lock(&mu_);
  std::weak_ptr<const StateWire>& entry = by_job_[job.id()];
  if (std::shared_ptr<const StateWire> wire = entry.lock();
      wire != nullptr && wire->state() == state) {
    return wire;
  }
  auto wire = std::make_shared<const StateWire>(
      std::move(state), job.geometry(), job.settings().wire_dtype);
  entry = wire;
  // Forget the jobs nobody is sending to (bounded by the jobs that exist).
  if (by_job_.size() > 64) {
    absl::erase_if(by_job_, [](const auto& kv) { return kv.second.expired(); });
  }
  return wire;
}

}  // namespace localsgd
