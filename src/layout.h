// Model layouts: the ordered tensors a job averages, their fingerprint, and how
// the flat buffer they form is cut into chunks.
#ifndef LOCALSGD_SRC_LAYOUT_H_
#define LOCALSGD_SRC_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/types.h"

namespace localsgd {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // empty: scalar
  DType dtype = DType::kFloat32;

  friend bool operator==(const TensorSpec& a, const TensorSpec& b) {
    return a.name == b.name && a.shape == b.shape && a.dtype == b.dtype;
  }
};

struct Layout {
  std::vector<TensorSpec> tensors;
  uint64_t fingerprint = 0;
};

// FNV-1a 64 over the canonical form: for every tensor, its name, a 0 byte, the
// dtype as one byte, the rank as 8 little-endian bytes, then every dimension
// as 8 little-endian bytes.
uint64_t ComputeFingerprint(const std::vector<TensorSpec>& tensors);

// Returns `tensors` as a Layout with its fingerprint filled in.
Layout MakeLayout(std::vector<TensorSpec> tensors);

// Number of elements of one tensor (1 for a scalar).
uint64_t NumElements(const TensorSpec& tensor);

// Checks a layout received from a client: at least one tensor, names non-empty
// and unique, dims >= 0, a layout dtype, total elements in [1, max_elements],
// and the fingerprint matches ComputeFingerprint. Returns INVALID_ARGUMENT
// (naming the tensor) or RESOURCE_EXHAUSTED (too large). On success returns
// the total number of elements.
// The longest tensor name a layout may have.
inline constexpr size_t kMaxTensorNameBytes = 1024;

absl::StatusOr<uint64_t> ValidateLayout(const Layout& layout,
                                        uint64_t max_elements);

// Describes the first difference between two layouts, e.g.
// "tensor 3: name 'fc.bias' vs 'fc2.bias'"; empty if they are equal.
std::string FirstDifference(const Layout& expected, const Layout& actual);

// How the flat buffer of `num_elements` is cut into chunks of
// `chunk_elements` (the last may be shorter).
class ChunkGeometry {
 public:
  ChunkGeometry() = default;
  // Requires num_elements >= 1 and chunk_elements >= 1.
  ChunkGeometry(uint64_t num_elements, uint32_t chunk_elements);

  uint64_t num_elements() const { return num_elements_; }
  uint32_t chunk_elements() const { return chunk_elements_; }
  uint32_t num_chunks() const { return num_chunks_; }
  // First element of chunk `index` (< num_chunks()).
  uint64_t Offset(uint32_t index) const {
    return static_cast<uint64_t>(index) * chunk_elements_;
  }
  // Elements in chunk `index` (< num_chunks()).
  uint32_t Size(uint32_t index) const;

 private:
  uint64_t num_elements_ = 0;
  uint32_t chunk_elements_ = 1;
  uint32_t num_chunks_ = 0;
};

// Elements a coordinator replica holds of a flat buffer of `num_elements`
// cut into chunks of `chunk_elements`: the sum of the sizes of the chunks i
// with i mod shard.count == shard.index. Laid back to back they form the
// replica's own flat buffer, which chunk_elements cuts at the same places:
// the replica's chunk j is chunk j * shard.count + shard.index of the whole
// (only the very last chunk of the whole may be short, and it is the last of
// its replica). 0 if the replica owns no chunk. Requires chunk_elements >= 1
// and shard.count >= 1.
uint64_t ShardElements(uint64_t num_elements, uint32_t chunk_elements,
                       ShardSpec shard);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_LAYOUT_H_
