// Helpers shared by the core unit tests: layouts, chunk encoding, and a
// thread-safe capture of a Sync callback.
#ifndef LOCALSGD_TESTS_CORE_TEST_UTIL_H_
#define LOCALSGD_TESTS_CORE_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "src/checkpoint.h"
#include "src/codec.h"
#include "src/job.h"
#include "src/layout.h"

namespace localsgd {
namespace testing_util {

// A layout of float32 tensors named and shaped as given.
inline Layout MakeFloatLayout(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& specs) {
  std::vector<TensorSpec> tensors;
  for (const auto& [name, shape] : specs) {
    TensorSpec t;
    t.name = name;
    t.shape = shape;
    t.dtype = DType::kFloat32;
    tensors.push_back(std::move(t));
  }
  return MakeLayout(std::move(tensors));
}

// A small model of 23 elements: a [3,5] weight, a [7] bias and a scalar.
inline Layout SmallLayout() {
  return MakeFloatLayout(
      {{"fc.weight", {3, 5}}, {"fc.bias", {7}}, {"scale", {}}});
}

// Total elements of a (valid) layout.
inline uint64_t TotalElements(const Layout& layout) {
  uint64_t n = 0;
  for (const TensorSpec& t : layout.tensors) n += NumElements(t);
  return n;
}

// The wire bytes of chunk `index` of the flat buffer `values`.
inline std::string EncodeChunk(const std::vector<float>& values,
                               const ChunkGeometry& geometry, uint32_t index,
                               DType dtype) {
  std::string out;
  EncodeValues(absl::MakeConstSpan(values).subspan(geometry.Offset(index),
                                                   geometry.Size(index)),
               dtype, &out);
  return out;
}

// A Join of member `name` with SmallLayout() in chunks of 4.
inline JoinRequestParams SmallJoin(const std::string& name,
                                   uint64_t incarnation = 1) {
  JoinRequestParams p;
  p.member_name = name;
  p.layout = SmallLayout();
  p.incarnation = incarnation;
  p.settings.chunk_elements = 4;
  return p;
}

// Saves `checkpoint` with its own values (CheckpointStore::Save).
inline absl::Status SaveWhole(CheckpointStore& store,
                              const JobCheckpoint& checkpoint) {
  return store.Save(checkpoint, checkpoint.values);
}

// Records every call of a SyncCallback. Copies of the callback share the
// record, so it stays valid even if the callback outlives this object.
class SyncCapture {
 public:
  SyncCapture() : state_(std::make_shared<State>()) {}

  SyncCallback Callback() {
    std::shared_ptr<State> state = state_;
    return [state](absl::StatusOr<SyncResult> result) {
      absl::MutexLock lock(&state->mu);
      ++state->calls;
      state->result = std::move(result);
    };
  }

  int calls() const {
    absl::MutexLock lock(&state_->mu);
    return state_->calls;
  }
  bool fired() const { return calls() > 0; }

  // The last result; UNKNOWN if the callback never ran.
  absl::StatusOr<SyncResult> result() const {
    absl::MutexLock lock(&state_->mu);
    return state_->result;
  }

  // Blocks until the callback has run at least once. For the threaded tests
  // only; single-threaded tests check fired() instead.
  void Wait() const {
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](State* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->calls > 0; },
        state_.get()));
  }

 private:
  struct State {
    mutable absl::Mutex mu;
    int calls ABSL_GUARDED_BY(mu) = 0;
    absl::StatusOr<SyncResult> result ABSL_GUARDED_BY(mu) =
        absl::UnknownError("callback has not run");
  };
  std::shared_ptr<State> state_;
};

}  // namespace testing_util
}  // namespace localsgd

#endif  // LOCALSGD_TESTS_CORE_TEST_UTIL_H_
