#include "src/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "src/crc32c.h"
#include "src/sparse_codec.h"

namespace localsgd {
namespace checkpoint_internal {
namespace {

inline uint32_t LoadLe32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace
}  // namespace checkpoint_internal

namespace {

constexpr char kMagic[8] = {'L', 'S', 'G', 'D', 'C', 'K', 'P', 'T'};
constexpr size_t kPrefixBytes = 24;  // magic, version, H, file length
constexpr size_t kCrcBytes = 4;
// Values go through the CRC and to the file in pieces this large: small
// enough to stay in cache between the two, large enough for few syscalls.
constexpr size_t kPieceBytes = size_t{1} << 20;
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
static_assert(sizeof(float) == 4, "floats must be IEEE-754 binary32");

// As leveldb's crc32c::Mask: a CRC stored in data that is itself CRC'd.
constexpr uint32_t kMaskDelta = 0xa282ead8u;
uint32_t MaskCrc(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out->append(b, sizeof(b));
}

void PutU64(std::string* out, uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out->append(b, sizeof(b));
}

uint32_t GetU32(const char* p) {
  return checkpoint_internal::LoadLe32(
      reinterpret_cast<const unsigned char*>(p));
}

uint64_t GetU64(const char* p) {
  const uint64_t lo = GetU32(p);
  const uint64_t hi = GetU32(p + 4);
  return lo | hi << 32;
}

bool IsKnownMode(AveragingMode mode) {
  // No default: a new mode makes the compiler point here (-Wswitch).
  switch (mode) {
    case AveragingMode::kMean:
    case AveragingMode::kOuterNesterov:
    case AveragingMode::kOuterSgd:
      return true;
    case AveragingMode::kUnspecified:
      return false;
  }
  return false;
}

// What Save refuses to write and Decode refuses to return, as a message; the
// caller picks the code (INVALID_ARGUMENT or DATA_LOSS).
std::string ContentProblem(const JobCheckpoint& c, uint64_t num_values,
                           uint64_t num_momentum, uint64_t num_residual,
                           uint64_t num_mean_residual) {
  if (absl::Status s = ValidateJobId(c.job_id); !s.ok()) {
    return std::string(s.message());
  }
  const uint64_t expected = ComputeFingerprint(c.layout.tensors);
  if (c.layout.fingerprint != expected) {
    return absl::StrCat("layout fingerprint mismatch: stored ",
                        absl::Hex(c.layout.fingerprint, absl::kZeroPad16),
                        ", the tensors give ",
                        absl::Hex(expected, absl::kZeroPad16));
  }
  absl::StatusOr<uint64_t> elements =
      ValidateLayout(c.layout, std::numeric_limits<uint64_t>::max());
  if (!elements.ok()) {
    return absl::StrCat("invalid layout: ", elements.status().message());
  }
  if (!IsWireDType(c.settings.wire_dtype)) {
    return absl::StrCat("unknown wire dtype ",
                        static_cast<int>(c.settings.wire_dtype));
  }
  if (IsSparseDType(c.settings.wire_dtype) &&
      (c.settings.sparse_keep < 1 || c.settings.sparse_keep > kSparseBlock ||
       c.settings.sparse_result_keep < 1 ||
       c.settings.sparse_result_keep > kSparseBlock)) {
    return absl::StrCat("sparse keep ", c.settings.sparse_keep, " (results ",
                        c.settings.sparse_result_keep, ") for wire ",
                        DTypeName(c.settings.wire_dtype));
  }
  if (!IsKnownMode(c.settings.mode)) {
    return absl::StrCat("unknown averaging mode ",
                        static_cast<int>(c.settings.mode));
  }
  if (c.settings.nonfinite_policy != NonFinitePolicy::kReject &&
      c.settings.nonfinite_policy != NonFinitePolicy::kDrop) {
    return absl::StrCat("unknown non-finite policy ",
                        static_cast<int>(c.settings.nonfinite_policy));
  }
  if (c.settings.chunk_elements < 1) {
    return "chunk_elements is 0";
  }
  if (c.settings.deadline_mode != DeadlineMode::kFixed &&
      c.settings.deadline_mode != DeadlineMode::kAdaptive) {
    return absl::StrCat("unknown deadline mode ",
                        static_cast<int>(c.settings.deadline_mode));
  }
  if (c.settings.contribution != Contribution::kParameters &&
      c.settings.contribution != Contribution::kPseudoGradients) {
    return absl::StrCat("unknown contribution ",
                        static_cast<int>(c.settings.contribution));
  }
  if (c.settings.outlier_ratio != 0 &&
      c.settings.outlier_ratio != kOutlierGuardOff &&
      !(c.settings.outlier_ratio >= kMinOutlierRatio &&
        c.settings.outlier_ratio <= kMaxOutlierRatio)) {
    return absl::StrCat("outlier ratio ", c.settings.outlier_ratio,
                        " is out of range");
  }
  if (c.settings.max_staleness != kMaxStalenessOff &&
      c.settings.max_staleness != 0 &&
      !(c.settings.max_staleness >= 1 &&
        c.settings.max_staleness <= kMaxStalenessLimit)) {
    return absl::StrCat("max staleness ", c.settings.max_staleness);
  }
  if (c.settings.step_budget != StepBudget::kFixed &&
      c.settings.step_budget != StepBudget::kAdaptive &&
      c.settings.step_budget != StepBudget::kUnspecified) {
    return absl::StrCat("unknown step budget ",
                        static_cast<int>(c.settings.step_budget));
  }
  if (c.settings.min_local_steps > kMaxLocalSteps ||
      c.settings.max_local_steps > kMaxLocalSteps) {
    return absl::StrCat("local step bounds ", c.settings.min_local_steps, ", ",
                        c.settings.max_local_steps);
  }
  if (c.settings.mean_encoding != MeanEncoding::kFloat32 &&
      c.settings.mean_encoding != MeanEncoding::kWire) {
    return absl::StrCat("unknown mean encoding ",
                        static_cast<int>(c.settings.mean_encoding));
  }
  if ((num_momentum != 0 && num_momentum != num_values) ||
      (num_residual != 0 && num_residual != num_values) ||
      (num_mean_residual != 0 && num_mean_residual != num_values)) {
    return absl::StrCat("momentum (", num_momentum, "), residual (",
                        num_residual, ") and mean residual (",
                        num_mean_residual, ") values must each be 0 or ",
                        num_values);
  }
  if (c.shard.count < 1 || c.shard.index >= c.shard.count) {
    return absl::StrCat("invalid shard ", c.shard.index, " of ", c.shard.count);
  }
  const uint64_t shard_elements =
      ShardElements(*elements, c.settings.chunk_elements, c.shard);
  if (shard_elements != num_values) {
    return absl::StrCat("values count ", num_values,
                        c.shard.count > 1 ? " != the shard's elements "
                                          : " != layout elements ",
                        shard_elements);
  }
  return "";
}

// Everything between the fixed prefix and the header CRC.
std::string EncodeHeader(const JobCheckpoint& c, uint64_t num_values,
                         uint64_t num_momentum, uint64_t num_residual,
                         uint64_t num_mean_residual) {
  std::string h;
  PutU32(&h, static_cast<uint32_t>(c.job_id.size()));
  h.append(c.job_id);
  PutU64(&h, c.round);
  PutU32(&h, c.settings.local_sgd_steps);
  PutU32(&h, c.settings.chunk_elements);
  PutU32(&h, static_cast<uint32_t>(c.settings.wire_dtype));
  PutU32(&h, static_cast<uint32_t>(c.settings.mode));
  PutU32(&h, c.settings.rendezvous_members);
  PutU32(&h, static_cast<uint32_t>(c.settings.nonfinite_policy));
  PutU64(&h, c.layout.fingerprint);
  PutU32(&h, static_cast<uint32_t>(c.layout.tensors.size()));
  for (const TensorSpec& t : c.layout.tensors) {
    PutU32(&h, static_cast<uint32_t>(t.name.size()));
    h.append(t.name);
    PutU32(&h, static_cast<uint32_t>(t.dtype));
    PutU32(&h, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) PutU64(&h, static_cast<uint64_t>(d));
  }
  PutU32(&h, c.shard.index);
  PutU32(&h, c.shard.count);
  PutU32(&h, static_cast<uint32_t>(c.settings.contribution));
  uint32_t bits;
  std::memcpy(&bits, &c.settings.outer_lr, 4);
  PutU32(&h, bits);
  std::memcpy(&bits, &c.settings.outer_momentum, 4);
  PutU32(&h, bits);
  PutU64(&h, c.state_id);
  PutU32(&h, static_cast<uint32_t>(c.settings.deadline_mode));
  PutU64(&h, c.epoch);
  std::memcpy(&bits, &c.settings.outlier_ratio, 4);
  PutU32(&h, bits);
  PutU32(&h, static_cast<uint32_t>(c.settings.mean_encoding));
  PutU32(&h, static_cast<uint32_t>(c.settings.max_staleness));
  PutU32(&h, static_cast<uint32_t>(c.settings.step_budget));
  PutU32(&h, c.settings.min_local_steps);
  PutU32(&h, c.settings.max_local_steps);
  PutU32(&h, static_cast<uint32_t>(c.ancestors.size()));
  for (uint64_t id : c.ancestors) PutU64(&h, id);
  PutU32(&h, c.settings.sparse_keep);
  PutU32(&h, c.settings.sparse_result_keep);
  PutU32(&h, c.participants);
  PutU64(&h, num_values);
  PutU64(&h, num_momentum);
  PutU64(&h, num_residual);
  PutU64(&h, num_mean_residual);
  return h;
}

// Where the encoder's bytes go: a string or a file.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual absl::Status Append(absl::string_view data) = 0;
};

class StringSink : public Sink {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  absl::Status Append(absl::string_view data) override {
    out_->append(data.data(), data.size());
    return absl::OkStatus();
  }

 private:
  std::string* const out_;
};

class FileSink : public Sink {
 public:
  FileSink(int fd, const std::string& path) : fd_(fd), path_(path) {}
  absl::Status Append(absl::string_view data) override {
    const char* p = data.data();
    size_t n = data.size();
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return absl::ErrnoToStatus(errno, absl::StrCat("write ", path_));
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const std::string& path_;
};

// Streams the file: prefix and header, then the values in pieces with the
// CRC carried along, so a model of gigabytes is never copied whole.
absl::Status WriteCheckpoint(const JobCheckpoint& c,
                             absl::Span<const float> values,
                             absl::Span<const float> momentum,
                             absl::Span<const float> residual,
                             absl::Span<const float> mean_residual,
                             Sink& sink) {
  const std::string header = EncodeHeader(
      c, values.size(), momentum.size(), residual.size(), mean_residual.size());
  if (header.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint header of job '", c.job_id, "' has ",
                     header.size(), " bytes; at most 4 GiB fit the format"));
  }
  const uint64_t value_bytes =
      uint64_t{4} * (values.size() + momentum.size() + residual.size() +
                     mean_residual.size());
  const uint64_t file_length =
      kPrefixBytes + header.size() + kCrcBytes + value_bytes + kCrcBytes;

  std::string head;
  head.reserve(kPrefixBytes + header.size() + kCrcBytes);
  head.append(kMagic, sizeof(kMagic));
  PutU32(&head, kCheckpointFormatVersion);
  PutU32(&head, static_cast<uint32_t>(header.size()));
  PutU64(&head, file_length);
  head.append(header);
  uint32_t crc = Crc32c(0, head);
  const size_t crc_at = head.size();
  PutU32(&head, MaskCrc(crc));
  crc = Crc32c(crc, absl::string_view(head).substr(crc_at));
  if (absl::Status s = sink.Append(head); !s.ok()) return s;

  std::string staging;  // big-endian hosts only
  for (const absl::Span<const float> array :
       {values, momentum, residual, mean_residual}) {
    const char* const base = reinterpret_cast<const char*>(array.data());
    const uint64_t array_bytes = uint64_t{4} * array.size();
    for (uint64_t off = 0; off < array_bytes; off += kPieceBytes) {
      const size_t len = static_cast<size_t>(
          std::min<uint64_t>(kPieceBytes, array_bytes - off));
      absl::string_view piece;
      if constexpr (kLittleEndian) {
        piece = absl::string_view(base + off, len);
      } else {
        staging.resize(len);
        for (size_t i = 0; i < len; i += 4) {
          uint32_t v;
          std::memcpy(&v, base + off + i, 4);
          v = __builtin_bswap32(v);
          std::memcpy(&staging[i], &v, 4);
        }
        piece = staging;
      }
      crc = Crc32c(crc, piece);
      if (absl::Status s = sink.Append(piece); !s.ok()) return s;
    }
  }

  std::string trailer;
  PutU32(&trailer, MaskCrc(crc));
  return sink.Append(trailer);
}

// Where the decoder's bytes come from: a string or a file.
class Source {
 public:
  virtual ~Source() = default;
  // Bytes in the whole input.
  virtual uint64_t size() const = 0;
  // Reads the next `n` bytes into `dst`; they exist (the caller checked
  // size()), unless a file shrank meanwhile.
  virtual absl::Status Read(char* dst, size_t n) = 0;
};

class MemorySource : public Source {
 public:
  explicit MemorySource(absl::string_view data) : data_(data) {}
  uint64_t size() const override { return data_.size(); }
  absl::Status Read(char* dst, size_t n) override {
    if (n > data_.size() - pos_) {
      return absl::DataLossError(
          absl::StrCat("truncated at byte ", data_.size()));
    }
    std::memcpy(dst, data_.data() + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }

 private:
  const absl::string_view data_;
  size_t pos_ = 0;
};

class FileSource : public Source {
 public:
  FileSource(int fd, uint64_t size, const std::string& path)
      : fd_(fd), size_(size), path_(path) {}
  uint64_t size() const override { return size_; }
  absl::Status Read(char* dst, size_t n) override {
    while (n > 0) {
      const ssize_t r = ::read(fd_, dst, n);
      if (r < 0) {
        if (errno == EINTR) continue;
        return absl::ErrnoToStatus(errno, absl::StrCat("read ", path_));
      }
      if (r == 0) {
        return absl::DataLossError(absl::StrCat(
            "truncated at byte ", pos_, ": the file shrank while it was read"));
      }
      dst += r;
      n -= static_cast<size_t>(r);
      pos_ += static_cast<uint64_t>(r);
    }
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const uint64_t size_;
  const std::string& path_;
  uint64_t pos_ = 0;
};

// Reads the fields of a header whose CRC has been checked; a field that runs
// past its end means a writer bug or a forged file.
class HeaderReader {
 public:
  explicit HeaderReader(absl::string_view data) : data_(data) {}

  bool U32(uint32_t* v) {
    if (data_.size() - pos_ < 4) return false;
    *v = GetU32(data_.data() + pos_);
    pos_ += 4;
    return true;
  }
  bool U64(uint64_t* v) {
    if (data_.size() - pos_ < 8) return false;
    *v = GetU64(data_.data() + pos_);
    pos_ += 8;
    return true;
  }
  bool String(std::string* s) {
    uint32_t n;
    if (!U32(&n) || data_.size() - pos_ < n) return false;
    s->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return data_.size() - pos_; }
  // File offset of the next field.
  uint64_t offset() const { return kPrefixBytes + pos_; }

 private:
  const absl::string_view data_;
  size_t pos_ = 0;
};

absl::Status Malformed(const HeaderReader& r, absl::string_view field) {
  return absl::DataLossError(absl::StrCat("malformed header: ", field,
                                          " at byte ", r.offset(),
                                          " runs past the header's end"));
}

// Fills everything but the values from the header bytes; returns the number
// of values the header announces.
struct ArrayCounts {
  uint64_t values = 0;
  uint64_t momentum = 0;
  uint64_t residual = 0;
  uint64_t mean_residual = 0;
};

absl::StatusOr<ArrayCounts> ParseHeader(absl::string_view header,
                                        uint32_t version, JobCheckpoint* c) {
  HeaderReader r(header);
  if (!r.String(&c->job_id)) return Malformed(r, "job id");
  if (!r.U64(&c->round)) return Malformed(r, "round");
  uint32_t wire_dtype, mode;
  if (!r.U32(&c->settings.local_sgd_steps) ||
      !r.U32(&c->settings.chunk_elements) || !r.U32(&wire_dtype) ||
      !r.U32(&mode) || !r.U32(&c->settings.rendezvous_members)) {
    return Malformed(r, "settings");
  }
  // Out-of-range values are caught by ContentProblem; the casts are defined
  // for any value of the enums' underlying int.
  c->settings.wire_dtype = static_cast<DType>(wire_dtype);
  c->settings.mode = static_cast<AveragingMode>(mode);
  c->settings.nonfinite_policy = NonFinitePolicy::kReject;
  if (version >= 2) {
    uint32_t policy;
    if (!r.U32(&policy)) return Malformed(r, "nonfinite policy");
    c->settings.nonfinite_policy = static_cast<NonFinitePolicy>(policy);
  }
  if (!r.U64(&c->layout.fingerprint)) return Malformed(r, "fingerprint");
  uint32_t num_tensors;
  if (!r.U32(&num_tensors)) return Malformed(r, "tensor count");
  // Each tensor takes at least 12 bytes: bound the reservation by the header.
  if (num_tensors > r.remaining() / 12) {
    return absl::DataLossError(
        absl::StrCat("malformed header: ", num_tensors,
                     " tensors cannot fit in the header's remaining ",
                     r.remaining(), " bytes"));
  }
  c->layout.tensors.resize(num_tensors);
  for (uint32_t i = 0; i < num_tensors; ++i) {
    TensorSpec& t = c->layout.tensors[i];
    uint32_t dtype, rank;
    if (!r.String(&t.name) || !r.U32(&dtype) || !r.U32(&rank)) {
      return Malformed(r, absl::StrCat("tensor ", i));
    }
    t.dtype = static_cast<DType>(dtype);
    t.shape.reserve(std::min<size_t>(rank, r.remaining() / 8));
    for (uint32_t k = 0; k < rank; ++k) {
      uint64_t d;
      if (!r.U64(&d)) return Malformed(r, absl::StrCat("tensor ", i, " shape"));
      t.shape.push_back(static_cast<int64_t>(d));
    }
  }
  c->shard = ShardSpec();
  if (version >= 2 && (!r.U32(&c->shard.index) || !r.U32(&c->shard.count))) {
    return Malformed(r, "shard");
  }
  c->settings.contribution = Contribution::kParameters;
  if (version >= 3) {
    uint32_t contribution, lr, momentum;
    if (!r.U32(&contribution) || !r.U32(&lr) || !r.U32(&momentum) ||
        !r.U64(&c->state_id)) {
      return Malformed(r, "pseudo-gradient settings");
    }
    c->settings.contribution = static_cast<Contribution>(contribution);
    std::memcpy(&c->settings.outer_lr, &lr, 4);
    std::memcpy(&c->settings.outer_momentum, &momentum, 4);
  }
  c->settings.deadline_mode = DeadlineMode::kFixed;
  if (version >= 4) {
    uint32_t deadline;
    if (!r.U32(&deadline)) return Malformed(r, "deadline mode");
    c->settings.deadline_mode = static_cast<DeadlineMode>(deadline);
  }
  if (version >= 5 && !r.U64(&c->epoch)) return Malformed(r, "epoch");
  c->settings.outlier_ratio = kOutlierGuardOff;
  if (version >= 6) {
    uint32_t ratio;
    if (!r.U32(&ratio)) return Malformed(r, "outlier ratio");
    std::memcpy(&c->settings.outlier_ratio, &ratio, 4);
  }
  c->settings.mean_encoding = MeanEncoding::kFloat32;
  if (version >= 7) {
    uint32_t encoding;
    if (!r.U32(&encoding)) return Malformed(r, "mean encoding");
    c->settings.mean_encoding = static_cast<MeanEncoding>(encoding);
  }
  c->settings.max_staleness = kMaxStalenessOff;
  c->settings.step_budget = StepBudget::kFixed;
  if (version >= 8) {
    uint32_t staleness;
    uint32_t budget;
    uint32_t count;
    if (!r.U32(&staleness)) return Malformed(r, "max staleness");
    c->settings.max_staleness = static_cast<int32_t>(staleness);
    if (!r.U32(&budget) || !r.U32(&c->settings.min_local_steps) ||
        !r.U32(&c->settings.max_local_steps)) {
      return Malformed(r, "step budget");
    }
    c->settings.step_budget = static_cast<StepBudget>(budget);
    if (!r.U32(&count)) return Malformed(r, "ancestor count");
    if (count > static_cast<uint32_t>(kMaxStalenessLimit)) {
      return absl::DataLossError(absl::StrCat("malformed header: ", count,
                                              " ancestor ids; at most ",
                                              kMaxStalenessLimit));
    }
    c->ancestors.resize(count);
    for (uint64_t& id : c->ancestors) {
      if (!r.U64(&id)) return Malformed(r, "ancestor ids");
    }
  }
  if (version >= 9 && (!r.U32(&c->settings.sparse_keep) ||
                       !r.U32(&c->settings.sparse_result_keep))) {
    return Malformed(r, "sparse keep");
  }
  if (version >= 10 && !r.U32(&c->participants)) {
    return Malformed(r, "participants");
  }
  ArrayCounts counts;
  if (!r.U64(&counts.values)) return Malformed(r, "values count");
  if (version >= 3 && (!r.U64(&counts.momentum) || !r.U64(&counts.residual))) {
    return Malformed(r, "momentum and residual counts");
  }
  if (version >= 7 && !r.U64(&counts.mean_residual)) {
    return Malformed(r, "mean residual count");
  }
  if (r.remaining() != 0) {
    return absl::DataLossError(absl::StrCat("malformed header: ", r.remaining(),
                                            " unparsed bytes at its end"));
  }
  return counts;
}

// Longer than a screen on purpose: it reads one file front to back, and each
// check (magic, version, header CRC, lengths, values CRC) decides whether the
// next part can be trusted at all, with one running CRC across them; kept in
// one piece so that the order of the checks reads top to bottom.
absl::StatusOr<JobCheckpoint> Decode(Source& in, bool header_only = false) {
  const uint64_t size = in.size();
  if (size == 0) {
    return absl::DataLossError("empty file: truncated at byte 0");
  }
  char prefix[kPrefixBytes];
  const size_t got =
      static_cast<size_t>(std::min<uint64_t>(size, kPrefixBytes));
  if (absl::Status s = in.Read(prefix, got); !s.ok()) return s;
  if (std::memcmp(prefix, kMagic, std::min(got, sizeof(kMagic))) != 0) {
    return absl::DataLossError(
        absl::StrCat("bad magic \"",
                     absl::CHexEscape(absl::string_view(
                         prefix, std::min(got, sizeof(kMagic)))),
                     "\": not a localsgd checkpoint (expected \"LSGDCKPT\")"));
  }
  if (got < kPrefixBytes) {
    return absl::DataLossError(absl::StrCat("truncated at byte ", got,
                                            ": the fixed header has ",
                                            kPrefixBytes, " bytes"));
  }
  const uint32_t version = GetU32(prefix + 8);
  if (version < kOldestCheckpointFormatVersion ||
      version > kCheckpointFormatVersion) {
    return absl::DataLossError(absl::StrCat(
        "unsupported format version ", version, "; this build reads versions ",
        kOldestCheckpointFormatVersion, " to ", kCheckpointFormatVersion,
        " (written by a newer coordinator?)"));
  }
  const uint64_t header_bytes = GetU32(prefix + 12);
  const uint64_t file_length = GetU64(prefix + 16);
  const uint64_t header_end = kPrefixBytes + header_bytes + kCrcBytes;
  if (size < header_end) {
    return absl::DataLossError(
        absl::StrCat("truncated at byte ", size, ": the header (", header_bytes,
                     " bytes) and its checksum end at byte ", header_end));
  }
  std::string header(static_cast<size_t>(header_bytes + kCrcBytes), '\0');
  if (absl::Status s = in.Read(header.data(), header.size()); !s.ok()) {
    return s;
  }
  uint32_t crc = Crc32c(0, absl::string_view(prefix, kPrefixBytes));
  crc = Crc32c(crc, absl::string_view(header).substr(0, header_bytes));
  const uint32_t stored_header_crc = GetU32(header.data() + header_bytes);
  if (MaskCrc(crc) != stored_header_crc) {
    return absl::DataLossError(absl::StrCat(
        "header checksum mismatch: stored ", absl::Hex(stored_header_crc),
        ", bytes [0, ", kPrefixBytes + header_bytes, ") give ",
        absl::Hex(MaskCrc(crc))));
  }
  crc = Crc32c(crc, absl::string_view(header).substr(header_bytes));
  // The header is intact from here on: its lengths can be trusted.
  if (size < file_length) {
    return absl::DataLossError(absl::StrCat("truncated at byte ", size,
                                            ": the header says the file has ",
                                            file_length, " bytes"));
  }
  if (size > file_length) {
    return absl::DataLossError(absl::StrCat(size - file_length,
                                            " trailing bytes after byte ",
                                            file_length, ", the file's end"));
  }

  JobCheckpoint c;
  absl::StatusOr<ArrayCounts> counts = ParseHeader(
      absl::string_view(header).substr(0, header_bytes), version, &c);
  if (!counts.ok()) return counts.status();
  if (header_only) return c;  // no values; the header checked
  // Each count is bounded by the file length before it is added up.
  const uint64_t floats =
      (file_length - std::min(file_length, header_end + kCrcBytes)) / 4;
  if (file_length < header_end + kCrcBytes || counts->values > floats ||
      counts->momentum > floats || counts->residual > floats ||
      counts->mean_residual > floats ||
      counts->values + counts->momentum + counts->residual +
              counts->mean_residual !=
          floats ||
      (file_length - header_end - kCrcBytes) % 4 != 0) {
    return absl::DataLossError(
        absl::StrCat("values count ", counts->values, " (momentum ",
                     counts->momentum, ", residual ", counts->residual,
                     ", mean residual ", counts->mean_residual,
                     ") does not match the file length ", file_length));
  }
  if (std::string problem =
          ContentProblem(c, counts->values, counts->momentum, counts->residual,
                         counts->mean_residual);
      !problem.empty()) {
    return absl::DataLossError(problem);
  }

  c.values.resize(static_cast<size_t>(counts->values));
  c.momentum.resize(static_cast<size_t>(counts->momentum));
  c.residual.resize(static_cast<size_t>(counts->residual));
  c.mean_residual.resize(static_cast<size_t>(counts->mean_residual));
  for (std::vector<float>* array :
       {&c.values, &c.momentum, &c.residual, &c.mean_residual}) {
    char* const base = reinterpret_cast<char*>(array->data());
    const uint64_t array_bytes = uint64_t{4} * array->size();
    for (uint64_t off = 0; off < array_bytes; off += kPieceBytes) {
      const size_t len = static_cast<size_t>(
          std::min<uint64_t>(kPieceBytes, array_bytes - off));
      if (absl::Status s = in.Read(base + off, len); !s.ok()) return s;
      crc = Crc32c(crc, absl::string_view(base + off, len));
      if constexpr (!kLittleEndian) {
        for (size_t i = 0; i < len; i += 4) {
          uint32_t v;
          std::memcpy(&v, base + off + i, 4);
          v = __builtin_bswap32(v);
          std::memcpy(base + off + i, &v, 4);
        }
      }
    }
  }
  char trailer[kCrcBytes];
  if (absl::Status s = in.Read(trailer, sizeof(trailer)); !s.ok()) return s;
  const uint32_t stored_crc = GetU32(trailer);
  if (MaskCrc(crc) != stored_crc) {
    return absl::DataLossError(absl::StrCat(
        "checksum mismatch: stored ", absl::Hex(stored_crc), ", the file's ",
        file_length - kCrcBytes, " bytes give ", absl::Hex(MaskCrc(crc))));
  }
  return c;
}

// The names in directory `dir` (with "." and ".."), unsorted.
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("list checkpoint directory ", dir));
  }
  while (true) {
    errno = 0;
    const struct dirent* entry = ::readdir(d);
    if (entry == nullptr) break;
    names.emplace_back(entry->d_name);
  }
  const int error_number = errno;
  ::closedir(d);
  if (error_number != 0) {
    return absl::ErrnoToStatus(error_number,
                               absl::StrCat("list checkpoint directory ", dir));
  }
  return names;
}

// Closes the descriptor it holds unless released.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

int OpenRetrying(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

int FsyncRetrying(int fd) {
  int r;
  do {
    r = ::fsync(fd);
  } while (r < 0 && errno == EINTR);
  return r;
}

// Makes a rename or unlink in `dir` durable.
absl::Status SyncDir(const std::string& dir) {
  ScopedFd fd(OpenRetrying(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("open directory ", dir));
  }
  // EINVAL: the file system cannot sync directories (some FUSE file systems);
  // there is nothing more to do then.
  if (FsyncRetrying(fd.get()) < 0 && errno != EINVAL) {
    return absl::ErrnoToStatus(errno, absl::StrCat("fsync directory ", dir));
  }
  return absl::OkStatus();
}

absl::Status NotUsable(int error_number, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::ErrnoToStatus(error_number, what).message());
}

// mkdir -p `dir`, mode 0755.
absl::Status MakeDirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1);; slash = dir.find('/', slash + 1)) {
    const std::string prefix = dir.substr(0, slash);
    if (!prefix.empty() && prefix.back() != '/' &&
        ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return NotUsable(errno,
                       absl::StrCat("cannot create checkpoint directory ", dir,
                                    " (at ", prefix, ")"));
    }
    if (slash == std::string::npos) break;
  }
  return absl::OkStatus();
}

constexpr absl::string_view kSuffix = ".ckpt";
constexpr absl::string_view kTmpSuffix = ".ckpt.tmp";

absl::StatusOr<JobCheckpoint> LoadFile(const std::string& path,
                                       bool header_only = false) {
  ScopedFd fd(OpenRetrying(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::ErrnoToStatus(errno, "open");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return absl::ErrnoToStatus(errno, "fstat");
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError("not a regular file");
  }
  FileSource source(fd.get(), static_cast<uint64_t>(st.st_size), path);
  return Decode(source, header_only);
}

}  // namespace

std::string EncodeCheckpoint(const JobCheckpoint& checkpoint) {
  std::string out;
  StringSink sink(&out);
  if (!WriteCheckpoint(checkpoint, checkpoint.values, checkpoint.momentum,
                       checkpoint.residual, checkpoint.mean_residual, sink)
           .ok()) {
    return "";  // a header over 4 GiB; Decode rejects the empty string
  }
  return out;
}

absl::StatusOr<JobCheckpoint> DecodeCheckpoint(absl::string_view bytes) {
  MemorySource source(bytes);
  return Decode(source);
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(
    std::string dir) {
  if (dir.empty()) {
    return absl::InvalidArgumentError("checkpoint directory is empty");
  }
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return NotUsable(errno, absl::StrCat("checkpoint directory ", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint directory ", dir, " is not a directory"));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return NotUsable(
        errno, absl::StrCat("checkpoint directory ", dir, " is not writable"));
  }
  return std::unique_ptr<CheckpointStore>(new CheckpointStore(std::move(dir)));
}

std::string CheckpointStore::PathOf(absl::string_view file_name) const {
  return absl::StrCat(dir_, "/", file_name);
}

std::shared_ptr<absl::Mutex> CheckpointStore::JobLock(
    absl::string_view job_id) {
  absl::MutexLock lock(&locks_mu_);
  std::shared_ptr<absl::Mutex>& mu = job_locks_[job_id];
  if (mu == nullptr) mu = std::make_shared<absl::Mutex>();
  return mu;
}

absl::Status CheckpointStore::Save(const JobCheckpoint& checkpoint,
                                   absl::Span<const float> values,
                                   absl::Span<const float> momentum,
                                   absl::Span<const float> residual,
                                   absl::Span<const float> mean_residual) {
  if (!checkpoint.values.empty() && values.data() != checkpoint.values.data()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint of job '", checkpoint.job_id,
        "' has values and is given values apart: pass one or the other"));
  }
  // Validating the id here is what keeps the path inside dir_: an id has no
  // '/', and with the suffix the name is never "." or "..".
  if (std::string problem =
          ContentProblem(checkpoint, values.size(), momentum.size(),
                         residual.size(), mean_residual.size());
      !problem.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of job '", checkpoint.job_id, "': ", problem));
  }
  absl::ReaderMutexLock dir_lock(&dir_mu_);
  std::shared_ptr<absl::Mutex> job_mu = JobLock(checkpoint.job_id);
  absl::MutexLock job_lock(job_mu.get());

  const std::string path = PathOf(absl::StrCat(checkpoint.job_id, kSuffix));
  // The fence: a newer primary of this shard wrote the job's checkpoint.
  // (A checkpoint in place that does not decode does not fence; LoadAll
  // reports it. No file, the usual first write, is told by stat: LoadFile's
  // error would format errno, whose text absl caches without a lock.)
  struct stat in_place_stat;
  absl::StatusOr<JobCheckpoint> in_place =
      checkpoint.epoch != 0 && ::stat(path.c_str(), &in_place_stat) == 0
          ? LoadFile(path, /*header_only=*/true)
          : absl::NotFoundError("no checkpoint in place");
  if (checkpoint.epoch != 0 && in_place.ok() &&
      in_place->epoch > checkpoint.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint of job '", checkpoint.job_id, "' at ", path,
        " was written at epoch ", in_place->epoch,
        ", after this "
        "coordinator's epoch ",
        checkpoint.epoch,
        ": a newer primary serves this shard; this one is deposed and writes "
        "nothing"));
  }
  const std::string tmp = absl::StrCat(path, ".tmp");
  ScopedFd fd(OpenRetrying(tmp.c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("create ", tmp));
  }
  FileSink sink(fd.get(), tmp);
  absl::Status status = WriteCheckpoint(checkpoint, values, momentum, residual,
                                        mean_residual, sink);
  if (status.ok() && FsyncRetrying(fd.get()) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("fsync ", tmp));
  }
  // close() is not retried on EINTR: on Linux the descriptor is gone anyway.
  if (status.ok() && ::close(fd.release()) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("close ", tmp));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status =
        absl::ErrnoToStatus(errno, absl::StrCat("rename ", tmp, " to ", path));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());  // an open descriptor closes with `fd`
    return status;
  }
  // Without this the rename may not survive a crash; the file is in place
  // either way, so a failure here is reported but nothing is undone.
  if (absl::Status s = SyncDir(dir_); !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat(s.message(), " after writing ", path,
                               "; the checkpoint may not survive a crash"));
  }
  VLOG(1) << "saved checkpoint of job " << checkpoint.job_id << " at round "
          << checkpoint.round << " (" << values.size() << " values) to "
          << path;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<JobCheckpoint>> CheckpointStore::LoadAll(
    std::vector<std::string>* errors) {
  absl::MutexLock dir_lock(&dir_mu_);
  absl::StatusOr<std::vector<std::string>> listed = ListDirectory(dir_);
  if (!listed.ok()) return listed.status();
  std::vector<std::string> names = *std::move(listed);
  std::sort(names.begin(), names.end());

  std::vector<JobCheckpoint> loaded;
  auto fail = [&](const std::string& path, absl::string_view why) {
    LOG(ERROR) << "skipping checkpoint " << path << ": " << why;
    if (errors != nullptr) errors->push_back(absl::StrCat(path, ": ", why));
  };
  for (const std::string& name : names) {
    const std::string path = PathOf(name);
    if (absl::EndsWith(name, kTmpSuffix)) {
      if (::unlink(path.c_str()) == 0) {
        LOG(WARNING) << "removed " << path
                     << ", left by a save that did not finish";
      } else {
        PLOG(WARNING) << "cannot remove " << path
                      << ", left by a save that did not finish";
      }
      continue;
    }
    if (!absl::EndsWith(name, kSuffix)) continue;
    const absl::string_view job_id =
        absl::string_view(name).substr(0, name.size() - kSuffix.size());
    if (absl::Status s = ValidateJobId(job_id); !s.ok()) {
      fail(path, absl::StrCat("the name is not <job id>.ckpt: ", s.message()));
      continue;
    }
    absl::StatusOr<JobCheckpoint> c = LoadFile(path);
    if (!c.ok()) {
      fail(path, c.status().ToString());
      continue;
    }
    if (c->job_id != job_id) {
      fail(path, absl::StrCat("holds job '", c->job_id, "', not '", job_id,
                              "' as its name says; was it renamed?"));
      continue;
    }
    LOG(INFO) << "loaded checkpoint of job " << c->job_id << " at round "
              << c->round << " (" << c->values.size() << " values) from "
              << path;
    loaded.push_back(*std::move(c));
  }
  // File names sort differently from ids: "...ckpt" (job "..") < "..ckpt".
  std::sort(loaded.begin(), loaded.end(),
            [](const JobCheckpoint& a, const JobCheckpoint& b) {
              return a.job_id < b.job_id;
            });
  return loaded;
}

absl::Status CheckpointStore::Remove(absl::string_view job_id) {
  if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
  absl::ReaderMutexLock dir_lock(&dir_mu_);
  std::shared_ptr<absl::Mutex> job_mu = JobLock(job_id);
  absl::MutexLock job_lock(job_mu.get());
  const std::string path = PathOf(absl::StrCat(job_id, kSuffix));
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::ErrnoToStatus(errno, absl::StrCat("remove ", path));
  }
  LOG(INFO) << "removed checkpoint of job " << job_id << " (" << path << ")";
  return SyncDir(dir_);
}

}  // namespace localsgd
