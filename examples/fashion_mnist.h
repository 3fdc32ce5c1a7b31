// Reader of the Fashion-MNIST data set in its original IDX format, gzipped
// (train-images-idx3-ubyte.gz, ...), as Debian's dataset-fashion-mnist ships
// it in /usr/share/datasets/fashion-mnist. No LibTorch: the worker turns the
// bytes into tensors.
#ifndef LOCALSGD_EXAMPLES_FASHION_MNIST_H_
#define LOCALSGD_EXAMPLES_FASHION_MNIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace localsgd {
namespace examples {

// One split of an image classification set: `count` images of rows x cols
// pixels (row-major, 0..255, one byte each) and their labels.
struct ImageSet {
  int64_t count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols
  std::vector<uint8_t> labels;  // count, each < kNumClasses
};

inline constexpr int kNumClasses = 10;

// Reads an IDX file of unsigned bytes (type 0x08) with `expected_rank`
// dimensions, gzipped or not (zlib reads both), into `data`; `dims` gets the
// dimensions. Errors: NOT_FOUND (no such file), DATA_LOSS (not an IDX file
// of that type and rank, truncated, or trailing bytes), RESOURCE_EXHAUSTED
// (absurdly large dimensions).
absl::Status ReadIdxUbyte(const std::string& path, int expected_rank,
                          std::vector<int64_t>* dims,
                          std::vector<uint8_t>* data);

// Reads the training split ("train-images-idx3-ubyte.gz" and
// "train-labels-idx1-ubyte.gz") or the test split ("t10k-...") from `dir`.
// A file missing in its .gz form is looked for without the suffix. Errors as
// ReadIdxUbyte, and DATA_LOSS if images and labels disagree in count or a
// label is not below kNumClasses.
absl::StatusOr<ImageSet> LoadFashionMnist(absl::string_view dir, bool train);

}  // namespace examples
}  // namespace localsgd

#endif  // LOCALSGD_EXAMPLES_FASHION_MNIST_H_
