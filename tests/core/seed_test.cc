// SeedState (src/seed.h) on its own: chunks in any order, repeats ignored,
// the record and the state of a complete seed, a re-seed's round and id.
#include "src/seed.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

const ChunkGeometry kGeometry(5, 2);  // chunks of 2, 2, 1 elements
const MemberId kOwner(std::string(32, 'a'));

absl::StatusOr<bool> AddChunk(SeedState& seed, uint32_t index,
                              std::vector<float> values) {
  std::string wire;
  EncodeValues(values, DType::kFloat32, &wire);
  const absl::string_view piece(wire);
  return seed.Add(index, absl::MakeConstSpan(&piece, 1), DType::kFloat32);
}

TEST(SeedStateTest, CompletesOnItsLastChunkInAnyOrder) {
  FakeClock clock;
  SeedState seed(kOwner, {}, std::vector<float>(99, -1.0f), kGeometry);
  EXPECT_FALSE(*AddChunk(seed, 2, {5}));
  EXPECT_FALSE(*AddChunk(seed, 0, {1, 2}));
  EXPECT_FALSE(*AddChunk(seed, 0, {7, 7}));  // a repeat: ignored
  EXPECT_TRUE(*AddChunk(seed, 1, {3, 4}));
  const SeedState::Completed done = seed.Complete("a", 2.5, clock.Now());
  EXPECT_THAT(done.state->values, ElementsAre(1, 2, 3, 4, 5));
  EXPECT_EQ(done.state->round, 0u);
  EXPECT_EQ(done.state->id, 0u);  // named by the commit
  const RoundRecord& r = done.record;
  EXPECT_EQ(r.round, 0u);
  EXPECT_EQ(r.reason, CloseReason::kSeed);
  EXPECT_EQ(r.opened, clock.Now());
  EXPECT_EQ(r.closed, clock.Now());
  EXPECT_THAT(r.participants, ElementsAre("a"));
  EXPECT_THAT(r.contributors, ElementsAre("a"));
  EXPECT_THAT(r.contributor_ids, UnorderedElementsAre(kOwner));
  EXPECT_EQ(r.contributor_weight, 2.5);
  EXPECT_EQ(seed.Describe(), "seeds the global state");
}

TEST(SeedStateTest, Reseed_TakesItsOriginsRoundAndId) {
  SeedOrigin origin;
  origin.round = 40;
  origin.contributors = 3;
  origin.state_id = 1234;
  SeedState seed(kOwner, origin, {}, kGeometry);
  for (uint32_t c = 0; c < 3; ++c) {
    ASSERT_TRUE(
        AddChunk(seed, c, std::vector<float>(kGeometry.Size(c), 1)).ok());
  }
  const SeedState::Completed done = seed.Complete("a", 1, FakeClock().Now());
  EXPECT_EQ(done.record.round, 40u);
  EXPECT_EQ(done.state->round, 40u);
  EXPECT_EQ(done.state->id, 1234u);
  EXPECT_EQ(seed.Describe(),
            "re-seeds the global state at round 40 (3 contributed to it)");
}

TEST(SeedStateTest, UndecodablePieces_ReturnInvalidArgumentAndCountNothing) {
  SeedState seed(kOwner, {}, {}, kGeometry);
  const absl::string_view short_piece("abc");
  EXPECT_EQ(seed.Add(2, absl::MakeConstSpan(&short_piece, 1), DType::kFloat32)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(*AddChunk(seed, 0, {1, 2}));
  EXPECT_FALSE(*AddChunk(seed, 1, {3, 4}));
  EXPECT_TRUE(*AddChunk(seed, 2, {5}));
}

TEST(SeedStateTest, TakeValues_HandsTheBufferBack) {
  std::vector<float> buffer(5, 0.0f);
  const float* data = buffer.data();
  SeedState seed(kOwner, {}, std::move(buffer), kGeometry);
  EXPECT_EQ(seed.TakeValues().data(), data);
}

}  // namespace
}  // namespace localsgd
