#include "src/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/settings.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using testing_util::SaveWhole;

namespace fs = std::filesystem;
using checkpoint_internal::Crc32c;
using checkpoint_internal::Crc32cPortable;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using testing_util::MakeFloatLayout;
using testing_util::SmallLayout;
using testing_util::TotalElements;

// ---------------------------------------------------------------- CRC32C

// Known answers: the classic check value and RFC 3720 B.4 (also leveldb's
// crc32c_test).
TEST(Crc32cTest, KnownVectors) {
  std::string zeros(32, '\0');
  std::string ones(32, '\xff');
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  for (auto crc : {&Crc32c, &Crc32cPortable}) {
    EXPECT_EQ(crc(0, ""), 0u);
    EXPECT_EQ(crc(0, "123456789"), 0xE3069283u);
    EXPECT_EQ(crc(0, zeros), 0x8A9136AAu);
    EXPECT_EQ(crc(0, ones), 0x62A8AB43u);
    EXPECT_EQ(crc(0, ascending), 0x46DD794Eu);
    EXPECT_EQ(crc(0, descending), 0x113FDB5Cu);
  }
}

TEST(Crc32cTest, ExtendEqualsWholeAndPathsAgreeAtEveryAlignment) {
  std::mt19937 rng(7);
  std::string data(300, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  const uint32_t whole = Crc32cPortable(0, data);
  EXPECT_EQ(Crc32c(0, data), whole);
  for (size_t split = 0; split <= data.size(); ++split) {
    const absl::string_view a = absl::string_view(data).substr(0, split);
    const absl::string_view b = absl::string_view(data).substr(split);
    ASSERT_EQ(Crc32c(Crc32c(0, a), b), whole) << split;
    ASSERT_EQ(Crc32cPortable(Crc32cPortable(0, a), b), whole) << split;
  }
  for (size_t begin = 0; begin < 16; ++begin) {
    for (size_t len = 0; len + begin <= 64; ++len) {
      const absl::string_view s = absl::string_view(data).substr(begin, len);
      ASSERT_EQ(Crc32c(0, s), Crc32cPortable(0, s)) << begin << "+" << len;
    }
  }
}

// Long buffers take the three-stream paths (blocks of 3 x 4096, then of
// 3 x 512 bytes): it
// must agree with the table-driven CRC at every length around the block
// edges, from every alignment, and when continued.
TEST(Crc32cTest, LongBuffers_InterleavedPathAgreesWithPortable) {
  std::mt19937 rng(11);
  std::string data(3 * 3 * 4096 + 64, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t len :
       {size_t{3 * 4096 - 1}, size_t{3 * 4096}, size_t{3 * 4096 + 1},
        size_t{3 * 4096 + 8}, size_t{2 * 3 * 4096 - 8}, size_t{2 * 3 * 4096},
        size_t{2 * 3 * 4096 + 17}, size_t{3 * 3 * 4096},
        // the 3 x 512 blocks after the 3 x 4 KiB ones
        size_t{3 * 512 - 1}, size_t{3 * 512}, size_t{3 * 512 + 9},
        size_t{16384}, size_t{3 * 4096 + 3 * 512 + 7}}) {
    for (size_t begin = 0; begin < 9; ++begin) {
      const absl::string_view s = absl::string_view(data).substr(begin, len);
      ASSERT_EQ(Crc32c(0, s), Crc32cPortable(0, s)) << begin << "+" << len;
      ASSERT_EQ(Crc32c(0x12345678u, s), Crc32cPortable(0x12345678u, s))
          << begin << "+" << len;
    }
  }
  // One bit flipped anywhere in a block changes the CRC.
  const absl::string_view block = absl::string_view(data).substr(0, 3 * 4096);
  const uint32_t clean = Crc32c(0, block);
  std::string flipped(block);
  for (size_t at : {size_t{0}, size_t{4095}, size_t{4096}, size_t{8191},
                    size_t{8192}, size_t{12287}}) {
    flipped[at] ^= 0x10;
    EXPECT_NE(Crc32c(0, flipped), clean) << at;
    EXPECT_EQ(Crc32c(0, flipped), Crc32cPortable(0, flipped)) << at;
    flipped[at] ^= 0x10;
  }
}

// ---------------------------------------------------------------- format

TensorSpec Spec(std::string name, std::vector<int64_t> shape, DType dtype) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  return t;
}

JobSettings Settings(DType wire = DType::kFloat32, uint32_t rendezvous = 0) {
  JobSettings s;
  s.local_sgd_steps = 8;
  s.chunk_elements = 5;
  s.wire_dtype = wire;
  s.mode = AveragingMode::kMean;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.rendezvous_members = rendezvous;
  s.contribution = Contribution::kParameters;
  s.deadline_mode = DeadlineMode::kFixed;
  s.mean_encoding = MeanEncoding::kFloat32;
  return s;
}

// A pseudo-gradient job with an outer optimizer.
JobSettings NesterovSettings(DType wire = DType::kInt4Block) {
  JobSettings s = Settings(wire);
  s.contribution = Contribution::kPseudoGradients;
  s.mode = AveragingMode::kOuterNesterov;
  s.outer_lr = 0.7f;
  s.outer_momentum = 0.9f;
  return s;
}

// Values that only a bit-exact round trip preserves: signed zero, a
// subnormal, infinities, a NaN with a payload, the extremes.
std::vector<float> TrickyValues(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-3, 3);
  for (float& x : v) x = dist(rng);
  const float specials[] = {-0.0f,
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::lowest()};
  for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i] = specials[i];
  if (n > std::size(specials)) {
    const uint32_t nan_bits = 0x7fc01234u;
    std::memcpy(&v[std::size(specials)], &nan_bits, 4);
  }
  return v;
}

JobCheckpoint MakeCheckpoint(std::string job_id, Layout layout,
                             RoundId round = 3,
                             JobSettings settings = Settings()) {
  JobCheckpoint c;
  c.job_id = std::move(job_id);
  c.values = TrickyValues(TotalElements(layout), static_cast<uint32_t>(round));
  c.layout = std::move(layout);
  c.settings = settings;
  c.round = round;
  return c;
}

// Bit-exact comparison of everything a checkpoint holds.
void ExpectSame(const JobCheckpoint& got, const JobCheckpoint& want) {
  EXPECT_EQ(got.job_id, want.job_id);
  EXPECT_EQ(got.round, want.round);
  EXPECT_EQ(got.layout.fingerprint, want.layout.fingerprint);
  EXPECT_TRUE(got.layout.tensors == want.layout.tensors);
  EXPECT_EQ(got.settings.local_sgd_steps, want.settings.local_sgd_steps);
  EXPECT_EQ(got.settings.chunk_elements, want.settings.chunk_elements);
  EXPECT_EQ(got.settings.wire_dtype, want.settings.wire_dtype);
  EXPECT_EQ(got.settings.mode, want.settings.mode);
  EXPECT_EQ(got.settings.rendezvous_members, want.settings.rendezvous_members);
  EXPECT_EQ(got.settings.nonfinite_policy, want.settings.nonfinite_policy);
  EXPECT_EQ(got.settings.contribution, want.settings.contribution);
  EXPECT_EQ(got.settings.outer_lr, want.settings.outer_lr);
  EXPECT_EQ(got.settings.outer_momentum, want.settings.outer_momentum);
  EXPECT_EQ(got.settings.deadline_mode, want.settings.deadline_mode);
  EXPECT_EQ(got.state_id, want.state_id);
  EXPECT_EQ(got.participants, want.participants);
  EXPECT_EQ(got.shard, want.shard);
  ASSERT_EQ(got.values.size(), want.values.size());
  EXPECT_EQ(std::memcmp(got.values.data(), want.values.data(),
                        4 * want.values.size()),
            0);
  ASSERT_EQ(got.momentum.size(), want.momentum.size());
  ASSERT_EQ(got.residual.size(), want.residual.size());
  EXPECT_TRUE(got.momentum.empty() ||
              std::memcmp(got.momentum.data(), want.momentum.data(),
                          4 * want.momentum.size()) == 0);
  EXPECT_TRUE(got.residual.empty() ||
              std::memcmp(got.residual.data(), want.residual.data(),
                          4 * want.residual.size()) == 0);
}

struct RoundTripCase {
  std::string name;
  Layout layout;
  JobSettings settings;
  RoundId round;
};

class CheckpointRoundTripTest : public ::testing::TestWithParam<RoundTripCase> {
};

TEST_P(CheckpointRoundTripTest, DecodeOfEncode_IsBitExact) {
  const RoundTripCase& p = GetParam();
  const JobCheckpoint c =
      MakeCheckpoint("job-1", p.layout, p.round, p.settings);
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, c);
}

std::vector<RoundTripCase> RoundTripCases() {
  std::vector<int64_t> rank16(16, 1);
  rank16[3] = 2;
  return {
      {"Small", SmallLayout(), Settings(), 0},
      {"Scalar", MakeFloatLayout({{"s", {}}}), Settings(), 1},
      {"Bf16WireWithRendezvous", SmallLayout(), Settings(DType::kBFloat16, 4),
       77},
      {"MixedDtypesAndRanks",
       MakeLayout({Spec("emb", {10, 4}, DType::kBFloat16),
                   Spec("h", {3}, DType::kFloat16),
                   Spec("d", {2, 2}, DType::kFloat64),
                   Spec("deep", rank16, DType::kFloat32),
                   Spec(std::string(300, 'n'), {1}, DType::kFloat32)}),
       Settings(), uint64_t{1} << 40},
      // Over 1 MiB of values: several pieces through the streaming CRC.
      {"SeveralPieces", MakeFloatLayout({{"w", {600, 1000}}, {"b", {7}}}),
       Settings(DType::kBFloat16, 2), 12345},
  };
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointRoundTripTest, ::testing::ValuesIn(RoundTripCases()),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) {
      return info.param.name;
    });

// An independent encoder that follows the format table in checkpoint.h.
class ReferenceWriter {
 public:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i)
      bytes_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i)
      bytes_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    bytes_ += s;
  }
  void Raw(absl::string_view s) { bytes_.append(s.data(), s.size()); }
  void MaskedCrc() {
    const uint32_t crc = Crc32cPortable(0, bytes_);
    U32(((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

// The file the format table in checkpoint.h describes, for `version` (1 has
// no non-finite policy and no shard fields).
std::string ReferenceFile(const JobCheckpoint& c, uint32_t version) {
  ReferenceWriter header;
  header.Str("fmt");
  header.U64(9);
  for (uint32_t v : {c.settings.local_sgd_steps, c.settings.chunk_elements,
                     static_cast<uint32_t>(c.settings.wire_dtype),
                     static_cast<uint32_t>(c.settings.mode),
                     c.settings.rendezvous_members}) {
    header.U32(v);
  }
  if (version >= 2)
    header.U32(static_cast<uint32_t>(c.settings.nonfinite_policy));
  header.U64(c.layout.fingerprint);
  header.U32(2);
  header.Str("w");
  header.U32(1);
  header.U32(2);
  header.U64(2);
  header.U64(1);
  header.Str("bias");
  header.U32(2);
  header.U32(0);
  if (version >= 2) {
    header.U32(c.shard.index);
    header.U32(c.shard.count);
  }
  if (version >= 3) {
    header.U32(static_cast<uint32_t>(c.settings.contribution));
    uint32_t bits;
    std::memcpy(&bits, &c.settings.outer_lr, 4);
    header.U32(bits);
    std::memcpy(&bits, &c.settings.outer_momentum, 4);
    header.U32(bits);
    header.U64(c.state_id);
  }
  if (version >= 4) {
    header.U32(static_cast<uint32_t>(c.settings.deadline_mode));
  }
  if (version >= 5) header.U64(c.epoch);
  if (version >= 6) {
    uint32_t bits;
    std::memcpy(&bits, &c.settings.outlier_ratio, 4);
    header.U32(bits);
  }
  if (version >= 7) {
    header.U32(static_cast<uint32_t>(c.settings.mean_encoding));
  }
  if (version >= 8) {
    header.U32(static_cast<uint32_t>(c.settings.max_staleness));
    header.U32(static_cast<uint32_t>(c.settings.step_budget));
    header.U32(c.settings.min_local_steps);
    header.U32(c.settings.max_local_steps);
    header.U32(static_cast<uint32_t>(c.ancestors.size()));
    for (uint64_t id : c.ancestors) header.U64(id);
  }
  if (version >= 9) {
    header.U32(c.settings.sparse_keep);
    header.U32(c.settings.sparse_result_keep);
  }
  if (version >= 10) header.U32(c.participants);
  header.U64(3);
  if (version >= 3) {
    header.U64(c.momentum.size());
    header.U64(c.residual.size());
  }
  if (version >= 7) header.U64(c.mean_residual.size());

  const uint64_t h = header.bytes().size();
  ReferenceWriter file;
  file.Raw("LSGDCKPT");
  file.U32(version);
  file.U32(static_cast<uint32_t>(h));
  const size_t floats =
      3 + c.momentum.size() + c.residual.size() + c.mean_residual.size();
  file.U64(24 + h + 4 + floats * 4 + 4);
  file.Raw(header.bytes());
  file.MaskedCrc();
  for (const std::vector<float>* array :
       {&c.values, &c.momentum, &c.residual, &c.mean_residual}) {
    for (float f : *array) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      file.U32(bits);
    }
  }
  file.MaskedCrc();
  return file.bytes();
}

JobCheckpoint FormatCheckpoint() {
  JobCheckpoint c =
      MakeCheckpoint("fmt",
                     MakeLayout({Spec("w", {2, 1}, DType::kFloat32),
                                 Spec("bias", {}, DType::kBFloat16)}),
                     /*round=*/9, Settings(DType::kBFloat16, 3));
  c.settings.nonfinite_policy = NonFinitePolicy::kDrop;
  return c;
}

TEST(CheckpointFormatTest, Encode_MatchesTheDocumentedFormat) {
  const JobCheckpoint c = FormatCheckpoint();
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
}

// Version 3: a pseudo-gradient job keeps its state id, its outer
// optimizer's momentum and its quantization residual.
TEST(CheckpointFormatTest, PseudoGradientJob_KeepsMomentumResidualAndStateId) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings = NesterovSettings();
  c.state_id = 0x0123456789abcdefull;
  c.momentum = {0.5f, -0.25f, 1e-30f};
  c.residual = {-1e-3f, 0.0f, 2e-3f};
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, c);
  c.momentum.pop_back();  // neither 0 nor the values' count
  EXPECT_EQ(DecodeCheckpoint(EncodeCheckpoint(c)).status().code(),
            absl::StatusCode::kDataLoss);
}

// Version 4: the deadline mode; version 3 files restore with "fixed" (all
// there was).
TEST(CheckpointFormatTest, DeadlineMode_KeptAndVersion3ReadsAsFixed) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings.deadline_mode = DeadlineMode::kAdaptive;
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.deadline_mode, DeadlineMode::kAdaptive);
  back = DecodeCheckpoint(ReferenceFile(c, 3));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.deadline_mode, DeadlineMode::kFixed);
  c.settings.deadline_mode = static_cast<DeadlineMode>(7);
  EXPECT_EQ(DecodeCheckpoint(EncodeCheckpoint(c)).status().code(),
            absl::StatusCode::kDataLoss);
}

// Version 5: the epoch of the primary that wrote it; version 4 files read
// as written without an election (0).
TEST(CheckpointFormatTest, Epoch_KeptAndVersion4ReadsAsZero) {
  JobCheckpoint c = FormatCheckpoint();
  c.epoch = 0x1122334455ull;
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, c.epoch);
  back = DecodeCheckpoint(ReferenceFile(c, 4));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, 0u);
}

// Version 6: the outlier guard's ratio; version 5 files restore with the
// guard off (as those jobs ran).
TEST(CheckpointFormatTest, OutlierRatio_KeptAndVersion5ReadsAsOff) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings = NesterovSettings();
  c.settings.outlier_ratio = 7.5f;
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.outlier_ratio, 7.5f);
  back = DecodeCheckpoint(ReferenceFile(c, 5));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.outlier_ratio, kOutlierGuardOff);
  // Out of its range (a corrupt or hostile file): refused.
  c.settings.outlier_ratio = 1.0f;
  EXPECT_EQ(DecodeCheckpoint(ReferenceFile(c, kCheckpointFormatVersion))
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
}

// Version 7: the mean encoding and the mean residual; version 6 files
// restore with float32 (all there was) and no mean residual.
TEST(CheckpointFormatTest, MeanEncoding_KeptAndVersion6ReadsAsFloat32) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings = NesterovSettings();
  c.settings.wire_dtype = DType::kInt4Block;
  c.settings.mean_encoding = MeanEncoding::kWire;
  c.residual = {-1e-3f, 0.0f, 2e-3f};
  c.mean_residual = {4e-3f, -5e-3f, 0.0f};
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.mean_encoding, MeanEncoding::kWire);
  EXPECT_EQ(back->mean_residual, c.mean_residual);
  c.mean_residual.clear();
  back = DecodeCheckpoint(ReferenceFile(c, 6));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.mean_encoding, MeanEncoding::kFloat32);
  EXPECT_TRUE(back->mean_residual.empty());
  // Neither 0 nor the values' count, or an unknown encoding: refused.
  c.mean_residual = {1.0f};
  EXPECT_EQ(DecodeCheckpoint(ReferenceFile(c, kCheckpointFormatVersion))
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
  c.mean_residual.clear();
  c.settings.mean_encoding = static_cast<MeanEncoding>(9);
  EXPECT_EQ(DecodeCheckpoint(ReferenceFile(c, kCheckpointFormatVersion))
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
}

// Version 8: stale contributions' bound and the ids of the states before
// the checkpointed one; version 7 files restore with them off and none.
TEST(CheckpointFormatTest, MaxStaleness_KeptAndVersion7ReadsAsOff) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings = NesterovSettings();
  c.state_id = 0x0123456789abcdefull;
  c.settings.max_staleness = 3;
  c.settings.step_budget = StepBudget::kAdaptive;
  c.settings.min_local_steps = 4;
  c.settings.max_local_steps = 64;
  c.ancestors = {0x1111ull, 0x2222ull, 0x3333ull};
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.max_staleness, 3);
  EXPECT_EQ(back->settings.step_budget, StepBudget::kAdaptive);
  EXPECT_EQ(back->settings.min_local_steps, 4u);
  EXPECT_EQ(back->settings.max_local_steps, 64u);
  EXPECT_EQ(back->ancestors, c.ancestors);
  back = DecodeCheckpoint(ReferenceFile(c, 7));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.max_staleness, kMaxStalenessOff);
  EXPECT_EQ(back->settings.step_budget, StepBudget::kFixed);
  EXPECT_TRUE(back->ancestors.empty());
  // Out of range, or more ancestors than any job keeps: refused.
  c.settings.max_staleness = kMaxStalenessLimit + 1;
  EXPECT_EQ(DecodeCheckpoint(ReferenceFile(c, 8)).status().code(),
            absl::StatusCode::kDataLoss);
  c.settings.max_staleness = 3;
  c.ancestors.assign(kMaxStalenessLimit + 1, 7);
  EXPECT_EQ(DecodeCheckpoint(ReferenceFile(c, 8)).status().code(),
            absl::StatusCode::kDataLoss);
}

// Version 9: the sparse codes' keep; version 8 files restore with none (no
// job of theirs had a sparse wire).
TEST(CheckpointFormatTest, SparseKeep_KeptAndVersion8ReadsAsNone) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings = NesterovSettings();
  c.settings.wire_dtype = DType::kSparse2;
  c.settings.sparse_keep = 100;
  c.settings.sparse_result_keep = 400;
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, kCheckpointFormatVersion));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.wire_dtype, DType::kSparse2);
  EXPECT_EQ(back->settings.sparse_keep, 100u);
  EXPECT_EQ(back->settings.sparse_result_keep, 400u);
  c.settings.wire_dtype = DType::kInt4Block;
  back = DecodeCheckpoint(ReferenceFile(c, 8));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->settings.sparse_keep, 0u);
  EXPECT_EQ(back->settings.sparse_result_keep, 0u);
  // A sparse wire with a keep no block can have: refused.
  c.settings.wire_dtype = DType::kSparse4;
  for (uint32_t keep : {0u, 4097u}) {
    c.settings.sparse_keep = keep;
    absl::StatusOr<JobCheckpoint> bad =
        DecodeCheckpoint(ReferenceFile(c, kCheckpointFormatVersion));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << keep;
    EXPECT_THAT(std::string(bad.status().message()),
                HasSubstr(absl::StrCat("sparse keep ", keep)));
  }
}

// Version 10: how many took part in the state's round; version 9 files
// read as not known (0), so that their job regathers for a whole lease.
TEST(CheckpointFormatTest, Participants_KeptAndVersion9ReadsAsNotKnown) {
  JobCheckpoint c = FormatCheckpoint();
  c.participants = 37;
  EXPECT_EQ(EncodeCheckpoint(c), ReferenceFile(c, 10));
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->participants, 37u);
  back = DecodeCheckpoint(ReferenceFile(c, 9));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->participants, 0u);
  EXPECT_EQ(back->round, c.round);
}

// Every setting of the settings table (src/settings.h) survives a restart:
// each row's probe value, all at once, comes back from the file.
TEST(CheckpointFormatTest, EverySetting_RoundTrips) {
  JobCheckpoint c = FormatCheckpoint();
  for (const JobSettingSpec& spec : JobSettingSpecs()) spec.probe(c.settings);
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    EXPECT_TRUE(spec.equal(back->settings, c.settings))
        << spec.name << ": wrote " << spec.format(c.settings) << ", read "
        << spec.format(back->settings);
  }
}

// Checkpoints written before pseudo-gradients restore as parameter jobs.
TEST(CheckpointFormatTest, Decode_Version2_ReadsAsAParameterJob) {
  JobCheckpoint c = FormatCheckpoint();
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(ReferenceFile(c, 2));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, c);
  EXPECT_EQ(back->settings.contribution, Contribution::kParameters);
  EXPECT_EQ(back->state_id, 0u);
}

// Checkpoints written before non-finite policies and shards existed restore
// with the policy they had (reject) as the only shard.
TEST(CheckpointFormatTest, Decode_Version1_ReadsWithRejectAndOneShard) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings.nonfinite_policy = NonFinitePolicy::kReject;
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(ReferenceFile(c, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, c);
  EXPECT_EQ(back->settings.nonfinite_policy, NonFinitePolicy::kReject);
  EXPECT_EQ(back->shard, ShardSpec());
}

// A replica's checkpoint holds only its chunks: 3 elements in chunks of 2
// make chunks {0, 1} and {2}; shard 1 of 2 owns the last, 1 element.
TEST(CheckpointFormatTest, ShardCheckpoint_HoldsTheShardsElements) {
  JobCheckpoint c = FormatCheckpoint();
  c.settings.chunk_elements = 2;
  c.shard = ShardSpec{1, 2};
  c.values.resize(1);
  absl::StatusOr<JobCheckpoint> back = DecodeCheckpoint(EncodeCheckpoint(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shard, (ShardSpec{1, 2}));
  ExpectSame(*back, c);
  c.values.resize(3);  // the whole layout is not the shard's state
  EXPECT_EQ(DecodeCheckpoint(EncodeCheckpoint(c)).status().code(),
            absl::StatusCode::kDataLoss);
}

// A checkpoint small enough to corrupt at every byte.
JobCheckpoint TinyCheckpoint() { return MakeCheckpoint("tiny", SmallLayout()); }

void PatchU32(std::string* bytes, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    (*bytes)[at + i] = static_cast<char>(v >> (8 * i));
}

TEST(CheckpointFormatTest, Decode_AnyFlippedBit_ReturnsDataLoss) {
  const std::string good = EncodeCheckpoint(TinyCheckpoint());
  ASSERT_TRUE(DecodeCheckpoint(good).ok());
  for (size_t i = 0; i < good.size(); ++i) {
    for (int bit : {0, 7}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      absl::StatusOr<JobCheckpoint> c = DecodeCheckpoint(bad);
      ASSERT_EQ(c.status().code(), absl::StatusCode::kDataLoss)
          << "byte " << i << " bit " << bit << ": " << c.status();
    }
  }
}

TEST(CheckpointFormatTest, Decode_FlippedByte_NamesTheChecksumThatCaughtIt) {
  const std::string good = EncodeCheckpoint(TinyCheckpoint());
  std::string bad_header = good;
  bad_header[30] ^= 0x10;  // inside the job id
  EXPECT_THAT(DecodeCheckpoint(bad_header).status().message(),
              HasSubstr("header checksum mismatch"));
  std::string bad_value = good;
  bad_value[good.size() - 10] ^= 0x10;  // inside the values
  absl::Status s = DecodeCheckpoint(bad_value).status();
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("header")));
}

TEST(CheckpointFormatTest, Decode_TruncatedAnywhere_ReturnsDataLoss) {
  const std::string good = EncodeCheckpoint(TinyCheckpoint());
  for (size_t n = 0; n < good.size(); ++n) {
    absl::Status s =
        DecodeCheckpoint(absl::string_view(good).substr(0, n)).status();
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << n << ": " << s;
    ASSERT_THAT(s.message(), HasSubstr(absl::StrCat("truncated at byte ", n)))
        << s;
  }
}

TEST(CheckpointFormatTest, Decode_Empty_SaysEmpty) {
  absl::Status s = DecodeCheckpoint("").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("empty"));
}

TEST(CheckpointFormatTest, Decode_TrailingBytes_ReturnsDataLoss) {
  const std::string bad = EncodeCheckpoint(TinyCheckpoint()) + "x";
  absl::Status s = DecodeCheckpoint(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("1 trailing bytes"));
}

TEST(CheckpointFormatTest, Decode_WrongMagic_SaysBadMagic) {
  for (const std::string& bad :
       {std::string("PK\x03\x04 a zip file, not ours......"),
        std::string("LSGDCKPX"), std::string("X")}) {
    absl::Status s = DecodeCheckpoint(bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(s.message(), HasSubstr("bad magic")) << bad;
  }
  std::string good = EncodeCheckpoint(TinyCheckpoint());
  good[0] = 'l';
  EXPECT_THAT(DecodeCheckpoint(good).status().message(),
              HasSubstr("bad magic"));
}

TEST(CheckpointFormatTest, Decode_OtherVersion_SaysUnsupportedVersion) {
  std::string bad = EncodeCheckpoint(TinyCheckpoint());
  PatchU32(&bad, 8, kCheckpointFormatVersion + 1);
  absl::Status s = DecodeCheckpoint(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("unsupported format version ",
                                     kCheckpointFormatVersion + 1)));
}

// Contents that no Save writes, with intact checksums (EncodeCheckpoint
// writes what it is given).
TEST(CheckpointFormatTest, Decode_InconsistentContents_ReturnsDataLoss) {
  struct Case {
    std::string name;
    std::function<void(JobCheckpoint&)> spoil;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"fingerprint", [](JobCheckpoint& c) { c.layout.fingerprint ^= 1; },
       "layout fingerprint mismatch"},
      {"too few values", [](JobCheckpoint& c) { c.values.pop_back(); },
       "values count 22 != layout elements 23"},
      {"too many values", [](JobCheckpoint& c) { c.values.push_back(1); },
       "values count 24 != layout elements 23"},
      {"job id", [](JobCheckpoint& c) { c.job_id = "../etc"; },
       "job_id may contain only"},
      {"empty job id", [](JobCheckpoint& c) { c.job_id = ""; },
       "job_id must have 1 to 128"},
      {"wire dtype",
       [](JobCheckpoint& c) { c.settings.wire_dtype = DType::kFloat64; },
       "unknown wire dtype 4"},
      {"mode",
       [](JobCheckpoint& c) { c.settings.mode = AveragingMode::kUnspecified; },
       "unknown averaging mode 0"},
      {"layout",
       [](JobCheckpoint& c) {
         c.layout = MakeLayout({Spec("a", {23}, DType::kFloat32),
                                Spec("a", {}, DType::kFloat32)});
         c.values.resize(24);
       },
       "repeats an earlier name"},
  };
  for (const Case& k : cases) {
    JobCheckpoint c = TinyCheckpoint();
    k.spoil(c);
    absl::Status s = DecodeCheckpoint(EncodeCheckpoint(c)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << k.name;
    EXPECT_THAT(s.message(), HasSubstr(k.message)) << k.name;
  }
}

// ---------------------------------------------------------------- store

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    names.insert(e.path().filename().string());
  }
  return names;
}

class CheckpointStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = absl::StrCat(::testing::TempDir(), "/checkpoint_test.", getpid(),
                         ".", info->name());
    fs::remove_all(root_);
    ASSERT_TRUE(fs::create_directories(root_));
    dir_ = root_ + "/state";
    absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
        CheckpointStore::Open(dir_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::string Path(absl::string_view name) const {
    return absl::StrCat(dir_, "/", name);
  }

  std::vector<JobCheckpoint> LoadAllOk(std::vector<std::string>* errors) {
    absl::StatusOr<std::vector<JobCheckpoint>> all = store_->LoadAll(errors);
    EXPECT_TRUE(all.ok()) << all.status();
    return all.ok() ? *std::move(all) : std::vector<JobCheckpoint>{};
  }

  std::string root_;
  std::string dir_;
  std::unique_ptr<CheckpointStore> store_;
};

TEST_F(CheckpointStoreTest, Open_CreatesMissingParents) {
  const std::string nested = root_ + "/a/b//c/";
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
      CheckpointStore::Open(nested);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(fs::is_directory(root_ + "/a/b/c"));
  EXPECT_EQ((*store)->dir(), nested);
  // Opening an existing directory is fine too.
  EXPECT_TRUE(CheckpointStore::Open(dir_).ok());
}

TEST_F(CheckpointStoreTest,
       Open_PathUnderARegularFile_ReturnsFailedPrecondition) {
  WriteFile(root_ + "/file", "x");
  for (const std::string& dir :
       {root_ + "/file", root_ + "/file/sub", root_ + "/file/sub/deeper"}) {
    absl::Status s = CheckpointStore::Open(dir).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << dir;
    EXPECT_THAT(s.message(), HasSubstr(dir));
  }
  EXPECT_EQ(CheckpointStore::Open("").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointStoreTest, Open_ReadOnlyDirectory_ReturnsFailedPrecondition) {
  if (geteuid() == 0) GTEST_SKIP() << "root may write anywhere";
  const std::string ro = root_ + "/ro";
  ASSERT_TRUE(fs::create_directories(ro));
  ASSERT_EQ(chmod(ro.c_str(), 0500), 0);
  EXPECT_EQ(CheckpointStore::Open(ro).status().code(),
            absl::StatusCode::kFailedPrecondition);
  chmod(ro.c_str(), 0700);
}

TEST_F(CheckpointStoreTest, SaveThenLoadAll_RoundTrips) {
  const JobCheckpoint c =
      MakeCheckpoint("job", SmallLayout(), 5, Settings(DType::kBFloat16, 3));
  ASSERT_TRUE(SaveWhole(*store_, c).ok());
  EXPECT_THAT(Listing(dir_), ElementsAre("job.ckpt"));
  // The streaming writer writes exactly what EncodeCheckpoint returns.
  EXPECT_EQ(ReadFile(Path("job.ckpt")), EncodeCheckpoint(c));
  std::vector<std::string> errors;
  std::vector<JobCheckpoint> all = LoadAllOk(&errors);
  EXPECT_THAT(errors, IsEmpty());
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], c);
}

// The fence for a directory two primaries of a shard share: a checkpoint
// written at epoch 7 is never replaced by one of epoch 5 (a deposed
// primary); a later epoch, or the same, replaces it.
TEST_F(CheckpointStoreTest, Save_LowerEpochThanTheOneInPlace_IsRefused) {
  JobCheckpoint newer =
      MakeCheckpoint("job", SmallLayout(), 8, Settings(DType::kFloat32, 3));
  newer.epoch = 7;
  ASSERT_TRUE(SaveWhole(*store_, newer).ok());
  JobCheckpoint deposed = newer;
  deposed.round = 9;
  deposed.epoch = 5;
  const absl::Status s = SaveWhole(*store_, deposed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("written at epoch 7"));
  EXPECT_THAT(s.message(), HasSubstr("epoch 5"));
  EXPECT_EQ(ReadFile(Path("job.ckpt")), EncodeCheckpoint(newer));
  EXPECT_THAT(Listing(dir_), ElementsAre("job.ckpt"));  // no .tmp left
  JobCheckpoint same = newer;
  same.round = 9;
  EXPECT_TRUE(SaveWhole(*store_, same).ok());
  same.epoch = 12;
  same.round = 10;
  EXPECT_TRUE(SaveWhole(*store_, same).ok());
  EXPECT_EQ(ReadFile(Path("job.ckpt")), EncodeCheckpoint(same));
  // A coordinator without an election (epoch 0) does not fence.
  JobCheckpoint plain = same;
  plain.epoch = 0;
  plain.round = 11;
  EXPECT_TRUE(SaveWhole(*store_, plain).ok());
  EXPECT_EQ(ReadFile(Path("job.ckpt")), EncodeCheckpoint(plain));
}

TEST_F(CheckpointStoreTest, Save_LargeModel_StreamsAndRoundTrips) {
  // 3 MiB and a bit: several pieces, a partial last one.
  const JobCheckpoint c =
      MakeCheckpoint("big", MakeFloatLayout({{"w", {786433}}}), 2);
  ASSERT_TRUE(SaveWhole(*store_, c).ok());
  EXPECT_EQ(fs::file_size(Path("big.ckpt")), ReadFile(Path("big.ckpt")).size());
  std::vector<JobCheckpoint> all = LoadAllOk(nullptr);
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], c);
}

TEST_F(CheckpointStoreTest, SaveOfBorrowedValues_EqualsSaveOfOwnedValues) {
  JobCheckpoint c = MakeCheckpoint("job", SmallLayout(), 4);
  const std::vector<float> values = c.values;
  c.values.clear();
  ASSERT_TRUE(store_->Save(c, values).ok());
  JobCheckpoint owned = c;
  owned.values = values;
  EXPECT_EQ(ReadFile(Path("job.ckpt")), EncodeCheckpoint(owned));

  // Values in both places is ambiguous.
  EXPECT_EQ(store_->Save(owned, values).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointStoreTest, SaveTwice_LoadsTheLatest) {
  ASSERT_TRUE(SaveWhole(*store_, MakeCheckpoint("job", SmallLayout(), 1)).ok());
  const JobCheckpoint second = MakeCheckpoint("job", SmallLayout(), 2);
  ASSERT_TRUE(SaveWhole(*store_, second).ok());
  EXPECT_THAT(Listing(dir_), ElementsAre("job.ckpt"));
  std::vector<JobCheckpoint> all = LoadAllOk(nullptr);
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], second);
}

// Readers that open the file while Saves replace it see one whole checkpoint
// or the other, never a mix or a partial file: the replacement is a rename.
TEST_F(CheckpointStoreTest, Save_ReaderDuringReplacement_SeesOldOrNewWhole) {
  const Layout layout = MakeFloatLayout({{"w", {70000}}});
  auto checkpoint_of = [&](RoundId round) {
    JobCheckpoint c = MakeCheckpoint("job", layout, round);
    std::fill(c.values.begin(), c.values.end(), static_cast<float>(round));
    return c;
  };
  ASSERT_TRUE(SaveWhole(*store_, checkpoint_of(1)).ok());
  constexpr RoundId kRounds = 40;
  std::atomic<bool> done{false};
  std::atomic<int> reads{0};
  std::thread reader([&] {
    // At least a few reads, and on until the writer is done.
    for (int i = 0; i < 5 || !done.load(); ++i) {
      absl::StatusOr<JobCheckpoint> c =
          DecodeCheckpoint(ReadFile(Path("job.ckpt")));
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_GE(c->round, 1u);
      ASSERT_LE(c->round, kRounds);
      for (float v : c->values) ASSERT_EQ(v, static_cast<float>(c->round));
      ++reads;
    }
  });
  for (RoundId r = 2; r <= kRounds; ++r) {
    ASSERT_TRUE(SaveWhole(*store_, checkpoint_of(r)).ok());
  }
  done = true;
  reader.join();
  EXPECT_GE(reads.load(), 5);
}

TEST_F(CheckpointStoreTest, Save_FailsMidway_LeavesTheOldCheckpoint) {
  const JobCheckpoint old = MakeCheckpoint("job", SmallLayout(), 1);
  ASSERT_TRUE(SaveWhole(*store_, old).ok());
  // A directory where the temporary file goes makes the next Save fail.
  ASSERT_TRUE(fs::create_directory(Path("job.ckpt.tmp")));
  absl::Status s = SaveWhole(*store_, MakeCheckpoint("job", SmallLayout(), 2));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(Path("job.ckpt.tmp")));
  fs::remove(Path("job.ckpt.tmp"));
  std::vector<JobCheckpoint> all = LoadAllOk(nullptr);
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], old);
}

TEST_F(CheckpointStoreTest,
       Save_DirectoryRemovedAfterOpen_ReturnsErrorNamingPath) {
  fs::remove_all(dir_);
  absl::Status s = SaveWhole(*store_, MakeCheckpoint("job", SmallLayout()));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(Path("job.ckpt.tmp")));
  EXPECT_EQ(store_->LoadAll().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointStoreTest, LoadAll_SeveralJobs_SortedById) {
  const std::vector<std::string> ids = {
      "zeta", ".", "..", "a-b_c.D", std::string(128, 'x'), "7"};
  std::vector<JobCheckpoint> saved;
  RoundId round = 0;
  for (const std::string& id : ids) {
    saved.push_back(MakeCheckpoint(
        id, MakeFloatLayout({{"w", {static_cast<int64_t>(round) + 1}}}),
        round));
    ++round;
    ASSERT_TRUE(SaveWhole(*store_, saved.back()).ok()) << id;
  }
  // "." and ".." are valid ids; their files stay inside the directory.
  EXPECT_TRUE(fs::exists(Path("..ckpt")));
  EXPECT_TRUE(fs::exists(Path("...ckpt")));
  EXPECT_THAT(Listing(dir_), SizeIs(ids.size()));
  EXPECT_THAT(Listing(root_), ElementsAre("state"));

  std::sort(saved.begin(), saved.end(),
            [](const JobCheckpoint& a, const JobCheckpoint& b) {
              return a.job_id < b.job_id;
            });
  std::vector<std::string> errors;
  std::vector<JobCheckpoint> all = LoadAllOk(&errors);
  EXPECT_THAT(errors, IsEmpty());
  ASSERT_EQ(all.size(), saved.size());
  for (size_t i = 0; i < all.size(); ++i) ExpectSame(all[i], saved[i]);
}

TEST_F(CheckpointStoreTest, LoadAll_BadFiles_AreSkippedAndReported) {
  const JobCheckpoint good = MakeCheckpoint("good", SmallLayout(), 6);
  ASSERT_TRUE(SaveWhole(*store_, good).ok());
  const std::string bytes =
      EncodeCheckpoint(MakeCheckpoint("x", SmallLayout()));
  std::string flipped =
      EncodeCheckpoint(MakeCheckpoint("flipped", SmallLayout()));
  flipped[flipped.size() - 7] ^= 0x01;
  const std::string truncated =
      EncodeCheckpoint(MakeCheckpoint("truncated", SmallLayout()));
  WriteFile(Path("flipped.ckpt"), flipped);
  WriteFile(Path("truncated.ckpt"), absl::string_view(truncated).substr(0, 50));
  WriteFile(Path("empty.ckpt"), "");
  WriteFile(Path("magic.ckpt"), "not a checkpoint at all, just some text");
  WriteFile(Path("renamed.ckpt"), bytes);  // holds job "x"
  WriteFile(Path("bad name.ckpt"), bytes);
  ASSERT_TRUE(fs::create_directory(Path("dir.ckpt")));
  WriteFile(Path("README"), "unrelated files are left alone");

  std::vector<std::string> errors;
  std::vector<JobCheckpoint> all = LoadAllOk(&errors);
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], good);
  ASSERT_THAT(errors, SizeIs(7));
  // Sorted by file name.
  EXPECT_THAT(errors[0], HasSubstr(Path("bad name.ckpt")));
  EXPECT_THAT(errors[0], HasSubstr("not <job id>.ckpt"));
  EXPECT_THAT(errors[1], HasSubstr(Path("dir.ckpt")));
  EXPECT_THAT(errors[1], HasSubstr("not a regular file"));
  EXPECT_THAT(errors[2], HasSubstr(Path("empty.ckpt")));
  EXPECT_THAT(errors[2], HasSubstr("DATA_LOSS: empty file"));
  EXPECT_THAT(errors[3], HasSubstr(Path("flipped.ckpt")));
  EXPECT_THAT(errors[3], HasSubstr("DATA_LOSS: checksum mismatch"));
  EXPECT_THAT(errors[4], HasSubstr(Path("magic.ckpt")));
  EXPECT_THAT(errors[4], HasSubstr("bad magic"));
  EXPECT_THAT(errors[5], HasSubstr(Path("renamed.ckpt")));
  EXPECT_THAT(errors[5], HasSubstr("holds job 'x'"));
  EXPECT_THAT(errors[6], HasSubstr(Path("truncated.ckpt")));
  EXPECT_THAT(errors[6], HasSubstr("truncated at byte 50"));
  // Bad files stay for an operator to inspect.
  EXPECT_TRUE(fs::exists(Path("flipped.ckpt")));
  EXPECT_TRUE(fs::exists(Path("README")));

  // Errors are optional.
  EXPECT_THAT(LoadAllOk(nullptr), SizeIs(1));
}

TEST_F(CheckpointStoreTest, LoadAll_LeftoverTmpFiles_AreRemoved) {
  const JobCheckpoint old = MakeCheckpoint("job", SmallLayout(), 1);
  ASSERT_TRUE(SaveWhole(*store_, old).ok());
  // A crash in the middle of the next Save of "job", and of a first Save of
  // "new" (no .ckpt yet).
  const std::string next =
      EncodeCheckpoint(MakeCheckpoint("job", SmallLayout(), 2));
  WriteFile(Path("job.ckpt.tmp"), absl::string_view(next).substr(0, 40));
  WriteFile(Path("new.ckpt.tmp"), "");
  WriteFile(Path("other.tmp"), "not ours");

  std::vector<std::string> errors;
  std::vector<JobCheckpoint> all = LoadAllOk(&errors);
  EXPECT_THAT(errors, IsEmpty());
  ASSERT_THAT(all, SizeIs(1));
  ExpectSame(all[0], old);
  EXPECT_THAT(Listing(dir_), ElementsAre("job.ckpt", "other.tmp"));
}

TEST_F(CheckpointStoreTest,
       Save_InvalidJobId_ReturnsInvalidArgumentAndWritesNothing) {
  for (const std::string& id :
       {std::string(""), std::string("a/b"), std::string("../escape"),
        std::string("/abs"), std::string("a b"), std::string(129, 'x'),
        std::string("nul\0id", 6)}) {
    absl::Status s = SaveWhole(*store_, MakeCheckpoint(id, SmallLayout()));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_EQ(store_->Remove(id).code(), absl::StatusCode::kInvalidArgument)
        << id;
  }
  EXPECT_THAT(Listing(dir_), IsEmpty());
  EXPECT_THAT(Listing(root_), ElementsAre("state"));
}

TEST_F(CheckpointStoreTest,
       Save_InconsistentCheckpoint_ReturnsInvalidArgument) {
  JobCheckpoint bad_values = MakeCheckpoint("job", SmallLayout());
  bad_values.values.pop_back();
  JobCheckpoint bad_fingerprint = MakeCheckpoint("job", SmallLayout());
  bad_fingerprint.layout.fingerprint ^= 1;
  JobCheckpoint bad_dtype = MakeCheckpoint("job", SmallLayout());
  bad_dtype.settings.wire_dtype = DType::kUnspecified;
  JobCheckpoint bad_chunk = MakeCheckpoint("job", SmallLayout());
  bad_chunk.settings.chunk_elements = 0;
  for (const JobCheckpoint* c :
       {&bad_values, &bad_fingerprint, &bad_dtype, &bad_chunk}) {
    absl::Status s = SaveWhole(*store_, *c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("checkpoint of job 'job'"));
  }
  EXPECT_THAT(Listing(dir_), IsEmpty());
}

TEST_F(CheckpointStoreTest, Remove_DeletesTheCheckpoint_AndAbsentIsOk) {
  ASSERT_TRUE(SaveWhole(*store_, MakeCheckpoint("a", SmallLayout())).ok());
  ASSERT_TRUE(SaveWhole(*store_, MakeCheckpoint("b", SmallLayout())).ok());
  EXPECT_TRUE(store_->Remove("a").ok());
  EXPECT_TRUE(store_->Remove("a").ok());
  EXPECT_TRUE(store_->Remove("never-saved").ok());
  std::vector<JobCheckpoint> all = LoadAllOk(nullptr);
  ASSERT_THAT(all, SizeIs(1));
  EXPECT_EQ(all[0].job_id, "b");
}

TEST_F(CheckpointStoreTest, ConcurrentSaves_OfSeveralJobs_AllLand) {
  constexpr int kJobs = 4;
  constexpr int kRounds = 10;
  std::vector<std::thread> threads;
  for (int j = 0; j < kJobs; ++j) {
    threads.emplace_back([&, j] {
      for (int r = 1; r <= kRounds; ++r) {
        // Two threads per job id would race on order; one per job does not.
        EXPECT_TRUE(SaveWhole(*store_, MakeCheckpoint(absl::StrCat("job", j),
                                                      SmallLayout(), r))
                        .ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<JobCheckpoint> all = LoadAllOk(nullptr);
  ASSERT_THAT(all, SizeIs(kJobs));
  for (int j = 0; j < kJobs; ++j) {
    ExpectSame(all[j],
               MakeCheckpoint(absl::StrCat("job", j), SmallLayout(), kRounds));
  }
}

}  // namespace
}  // namespace localsgd
