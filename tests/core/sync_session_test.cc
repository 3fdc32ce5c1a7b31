// The checks of a Sync that need no job (src/sync_session.h): its header
// and each chunk, against a table of hostile inputs. (SyncSession itself is
// driven through a job in job_test.cc.)
#include "src/sync_session.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/codec.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

const ChunkGeometry kGeometry(10, 4);  // chunks of 4, 4, 2 elements

TEST(CheckSyncHeaderTest, PlainRoundsAndSeedsPass) {
  EXPECT_TRUE(CheckSyncHeader("j", "a", 0, {}, 0, true).ok());
  EXPECT_TRUE(CheckSyncHeader("j", "a", 0, SeedOrigin{7, 3, 99}, 0, true).ok());
  EXPECT_TRUE(CheckSyncHeader("j", "a", 5, {}, 0, /*pseudo=*/false).ok());
  EXPECT_TRUE(CheckSyncHeader("j", "a", 5, {}, 42, /*pseudo=*/true).ok());
  EXPECT_TRUE(
      CheckSyncHeader("j", "a", 0, SeedOrigin{kMaxSeedRound}, 0, true).ok());
}

TEST(CheckSyncHeaderTest, HostileHeaders_ReturnInvalidArgumentSayingWhy) {
  struct Case {
    RoundId round;
    SeedOrigin origin;
    uint64_t anchor;
    const char* why;
  };
  for (const Case& c : std::vector<Case>{
           {5, SeedOrigin{3}, 1, "these go only with round 0"},
           {5, SeedOrigin{0, 2}, 1, "these go only with round 0"},
           {0, SeedOrigin{0, 2}, 0, "seed_contributors 2 without a seed_round"},
           {0, SeedOrigin{0, 0, 9}, 0, "seed_state_id 9 without a seed_round"},
           {0, SeedOrigin{kMaxSeedRound + 1}, 0, "at most"},
           {5, {}, 0, "names no anchor_state_id"},
       }) {
    const absl::Status s =
        CheckSyncHeader("job-1", "a", c.round, c.origin, c.anchor, true);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_THAT(s.message(), HasSubstr(c.why));
    EXPECT_THAT(s.message(), HasSubstr("member a of job 'job-1'"));
  }
}

std::string Wire(std::vector<float> values, DType dtype = DType::kFloat32) {
  std::string out;
  EncodeValues(values, dtype, &out);
  return out;
}

absl::StatusOr<int64_t> Check(uint32_t index, const std::string& wire,
                              bool drop = false,
                              DType dtype = DType::kFloat32) {
  const absl::string_view piece(wire);
  return CheckChunk("job-1", kGeometry, 3, index,
                    absl::MakeConstSpan(&piece, 1), dtype, drop);
}

TEST(CheckChunkTest, AGoodChunk_ReturnsMinusOne) {
  EXPECT_EQ(*Check(0, Wire({1, 2, 3, 4})), -1);
  EXPECT_EQ(*Check(2, Wire({1, 2})), -1);
}

TEST(CheckChunkTest, PiecesCountTogether) {
  const std::string wire = Wire({1, 2, 3, 4});
  const std::vector<absl::string_view> pieces = {
      absl::string_view(wire).substr(0, 5), absl::string_view(wire).substr(5)};
  EXPECT_EQ(
      *CheckChunk("job-1", kGeometry, 3, 0, pieces, DType::kFloat32, false),
      -1);
}

TEST(CheckChunkTest, IndexOutOfRange_NamesTheLayoutsChunks) {
  const absl::StatusOr<int64_t> r = Check(3, Wire({1, 2}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("chunk index 3 for round 3 of job 'job-1' is out of "
                        "range: the layout has 3 chunks (0..2)"));
}

TEST(CheckChunkTest, WrongSize_SaysWhatWasExpected) {
  const absl::StatusOr<int64_t> r = Check(2, Wire({1, 2, 3}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("has 12 bytes; expected 8 (2 float32 values)"));
  // A block dtype says its blocks: 4 bytes of scale + 2 codes.
  const absl::StatusOr<int64_t> block =
      Check(2, Wire({1, 2}), false, DType::kInt8Block);
  EXPECT_THAT(block.status().message(),
              HasSubstr("expected 6 (2 int8 values in 1 blocks)"));
}

TEST(CheckChunkTest, BadBlockScale_IsRefused) {
  // A negative scale (codec.h: scales lie in (0, kMaxBlockScale]).
  std::string wire = Wire({-1.5f}) + std::string(2, '\0');
  const absl::StatusOr<int64_t> r = Check(2, wire, false, DType::kInt8Block);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("chunk 2 for round 3"));
}

TEST(CheckChunkTest, NonFinite_RefusedOrReportedForADrop) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::string wire = Wire({1, 2, nan, 4});
  const absl::StatusOr<int64_t> refused = Check(1, wire);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("non-finite value at element 2 (flat index 6)"));
  EXPECT_EQ(*Check(1, wire, /*drop=*/true), 2);
}

}  // namespace
}  // namespace localsgd
