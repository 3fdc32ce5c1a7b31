#include "examples/fashion_mnist.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace localsgd {
namespace examples {
namespace {

// IDX stores its header big-endian: 0, 0, element type, rank, then `rank`
// 32-bit dimensions.
constexpr uint8_t kIdxUnsignedByte = 0x08;
// Largest payload accepted; Fashion-MNIST's largest file holds 47 MB.
constexpr int64_t kMaxIdxBytes = int64_t{1} << 31;

struct GzCloser {
  void operator()(gzFile file) const { gzclose(file); }
};
using GzFilePtr = std::unique_ptr<gzFile_s, GzCloser>;

// zlib's error text, which starts with the file's path: without it.
std::string ZlibError(gzFile file) {
  int errnum = 0;
  const char* message = gzerror(file, &errnum);
  absl::string_view text = message != nullptr ? message : "unknown zlib error";
  const size_t colon = text.rfind(": ");
  if (colon != absl::string_view::npos) text.remove_prefix(colon + 2);
  return std::string(text);
}

// Reads up to `size` bytes, stopping early only at the end of the file.
// Returns how many it read, or -1 on a zlib error (corrupt or truncated
// gzip data), with the error's text in `*error`.
int64_t ReadFully(gzFile file, uint8_t* out, int64_t size, std::string* error) {
  int64_t done = 0;
  while (done < size) {
    const unsigned int want =
        static_cast<unsigned int>(std::min<int64_t>(size - done, 1 << 20));
    const int got = gzread(file, out + done, want);
    if (got < 0) {
      *error = ZlibError(file);
      return -1;
    }
    if (got == 0) break;
    done += got;
  }
  int errnum = 0;
  gzerror(file, &errnum);
  if (errnum != Z_OK && errnum != Z_STREAM_END) {
    *error = ZlibError(file);
    return -1;
  }
  return done;
}

}  // namespace

absl::Status ReadIdxUbyte(const std::string& path, int expected_rank,
                          std::vector<int64_t>* dims,
                          std::vector<uint8_t>* data) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(
          path,
          ": no such file; is the data set installed (Debian package "
          "dataset-fashion-mnist) or --data_dir right?"));
    }
    return absl::UnavailableError(absl::StrCat(path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  GzFilePtr file(gzopen(path.c_str(), "rb"));
  if (file == nullptr) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat(
        path, ": cannot open: ", err != 0 ? std::strerror(err) : "zlib"));
  }
  std::string error;
  uint8_t header[4];
  int64_t got = ReadFully(file.get(), header, sizeof(header), &error);
  if (got < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt gzip data: ", error));
  }
  if (got < static_cast<int64_t>(sizeof(header)) || header[0] != 0 ||
      header[1] != 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": not an IDX file (bad magic number)"));
  }
  if (header[2] != kIdxUnsignedByte || header[3] != expected_rank) {
    return absl::DataLossError(absl::StrCat(
        path, ": IDX file of element type 0x",
        absl::Hex(header[2], absl::kZeroPad2), " and rank ",
        static_cast<int>(header[3]),
        "; expected unsigned bytes (0x08) and rank ", expected_rank));
  }
  std::vector<uint8_t> raw_dims(4 * static_cast<size_t>(expected_rank));
  got = ReadFully(file.get(), raw_dims.data(),
                  static_cast<int64_t>(raw_dims.size()), &error);
  if (got != static_cast<int64_t>(raw_dims.size())) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated IDX header",
                     error.empty() ? "" : absl::StrCat(" (", error, ")")));
  }
  dims->clear();
  int64_t total = 1;
  for (int d = 0; d < expected_rank; ++d) {
    const uint8_t* b = &raw_dims[4 * d];
    const int64_t dim = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) |
                        (int64_t{b[2]} << 8) | int64_t{b[3]};
    dims->push_back(dim);
    total *= dim;
    if (total > kMaxIdxBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path, ": IDX dimensions describe more than ",
                       kMaxIdxBytes, " bytes; corrupt header?"));
    }
  }
  data->resize(static_cast<size_t>(total));
  got = ReadFully(file.get(), data->data(), total, &error);
  if (got < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt gzip data: ", error));
  }
  if (got != total) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: holds ", got,
                                            " of ", total, " data bytes"));
  }
  uint8_t extra;
  got = ReadFully(file.get(), &extra, 1, &error);
  if (got != 0) {
    return absl::DataLossError(
        absl::StrCat(path,
                     got < 0 ? ": corrupt gzip data after the IDX payload: "
                             : ": trailing bytes after the IDX payload",
                     error));
  }
  return absl::OkStatus();
}

absl::StatusOr<ImageSet> LoadFashionMnist(absl::string_view dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto path_of = [&](absl::string_view name) {
    std::string gz = absl::StrCat(dir, "/", prefix, name, ".gz");
    struct stat st;
    if (stat(gz.c_str(), &st) != 0) {
      std::string plain = absl::StrCat(dir, "/", prefix, name);
      if (stat(plain.c_str(), &st) == 0) return plain;
    }
    return gz;  // NOT_FOUND names the .gz form
  };
  const std::string images_path = path_of("-images-idx3-ubyte");
  const std::string labels_path = path_of("-labels-idx1-ubyte");

  ImageSet set;
  std::vector<int64_t> dims;
  if (absl::Status s = ReadIdxUbyte(images_path, 3, &dims, &set.pixels);
      !s.ok()) {
    return s;
  }
  set.count = dims[0];
  set.rows = dims[1];
  set.cols = dims[2];
  if (absl::Status s = ReadIdxUbyte(labels_path, 1, &dims, &set.labels);
      !s.ok()) {
    return s;
  }
  if (dims[0] != set.count) {
    return absl::DataLossError(absl::StrCat(images_path, " holds ", set.count,
                                            " images but ", labels_path,
                                            " holds ", dims[0], " labels"));
  }
  for (int64_t i = 0; i < set.count; ++i) {
    if (set.labels[i] >= kNumClasses) {
      return absl::DataLossError(
          absl::StrCat(labels_path, ": label ", static_cast<int>(set.labels[i]),
                       " of example ", i, " is not below ", kNumClasses));
    }
  }
  return set;
}

}  // namespace examples
}  // namespace localsgd
