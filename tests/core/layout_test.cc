#include "src/layout.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testing_util::MakeFloatLayout;

constexpr uint64_t kMax = uint64_t{1} << 30;

TensorSpec Spec(std::string name, std::vector<int64_t> shape,
                DType dtype = DType::kFloat32) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  return t;
}

// An independent FNV-1a 64 over the canonical form the header documents.
uint64_t ReferenceFingerprint(const std::vector<TensorSpec>& tensors) {
  std::vector<unsigned char> bytes;
  auto put_u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back((v >> (8 * i)) & 0xff);
  };
  for (const TensorSpec& t : tensors) {
    bytes.insert(bytes.end(), t.name.begin(), t.name.end());
    bytes.push_back(0);
    bytes.push_back(static_cast<unsigned char>(t.dtype));
    put_u64(t.shape.size());
    for (int64_t d : t.shape) put_u64(static_cast<uint64_t>(d));
  }
  uint64_t h = 14695981039346656037ull;
  for (unsigned char b : bytes) {
    h ^= b;
    h *= 1099511628211ull;
  }
  return h;
}

// --- Fingerprint ------------------------------------------------------------

TEST(FingerprintTest, ComputeFingerprint_MatchesDocumentedCanonicalForm) {
  const std::vector<TensorSpec> tensors = {
      Spec("fc.weight", {4, 3}), Spec("fc.bias", {4}, DType::kBFloat16),
      Spec("scale", {})};
  EXPECT_EQ(ComputeFingerprint(tensors), ReferenceFingerprint(tensors));
  // The empty layout is the FNV offset basis.
  EXPECT_EQ(ComputeFingerprint({}), 14695981039346656037ull);
}

TEST(FingerprintTest, ComputeFingerprint_SameTensors_SameValue) {
  const std::vector<TensorSpec> a = {Spec("w", {2, 3}), Spec("b", {3})};
  const std::vector<TensorSpec> b = {Spec("w", {2, 3}), Spec("b", {3})};
  EXPECT_EQ(ComputeFingerprint(a), ComputeFingerprint(a));
  EXPECT_EQ(ComputeFingerprint(a), ComputeFingerprint(b));
}

TEST(FingerprintTest, ComputeFingerprint_DiffersByName) {
  EXPECT_NE(ComputeFingerprint({Spec("w", {2, 3})}),
            ComputeFingerprint({Spec("v", {2, 3})}));
}

TEST(FingerprintTest, ComputeFingerprint_NameBoundaryMatters) {
  // "ab"+"c" and "a"+"bc" concatenate to the same bytes without a separator.
  EXPECT_NE(ComputeFingerprint({Spec("ab", {1}), Spec("c", {1})}),
            ComputeFingerprint({Spec("a", {1}), Spec("bc", {1})}));
}

TEST(FingerprintTest, ComputeFingerprint_DiffersByShape) {
  EXPECT_NE(ComputeFingerprint({Spec("w", {2, 3})}),
            ComputeFingerprint({Spec("w", {3, 2})}));
  EXPECT_NE(ComputeFingerprint({Spec("w", {6})}),
            ComputeFingerprint({Spec("w", {2, 3})}));
  EXPECT_NE(ComputeFingerprint({Spec("w", {})}),
            ComputeFingerprint({Spec("w", {1})}));
}

TEST(FingerprintTest, ComputeFingerprint_DiffersByDType) {
  EXPECT_NE(ComputeFingerprint({Spec("w", {2, 3}, DType::kFloat32)}),
            ComputeFingerprint({Spec("w", {2, 3}, DType::kBFloat16)}));
}

TEST(FingerprintTest, ComputeFingerprint_DiffersByOrder) {
  EXPECT_NE(ComputeFingerprint({Spec("w", {2, 3}), Spec("b", {3})}),
            ComputeFingerprint({Spec("b", {3}), Spec("w", {2, 3})}));
}

TEST(FingerprintTest, MakeLayout_FillsFingerprintAndKeepsTensors) {
  const std::vector<TensorSpec> tensors = {Spec("w", {2, 3}), Spec("b", {3})};
  const Layout layout = MakeLayout(tensors);
  EXPECT_EQ(layout.fingerprint, ComputeFingerprint(tensors));
  ASSERT_EQ(layout.tensors.size(), 2u);
  EXPECT_EQ(layout.tensors[0], tensors[0]);
  EXPECT_EQ(layout.tensors[1], tensors[1]);
}

// --- NumElements ------------------------------------------------------------

TEST(NumElementsTest, NumElements_ScalarIsOneAndShapesMultiply) {
  EXPECT_EQ(NumElements(Spec("s", {})), 1u);
  EXPECT_EQ(NumElements(Spec("v", {7})), 7u);
  EXPECT_EQ(NumElements(Spec("t", {2, 3, 4})), 24u);
  EXPECT_EQ(NumElements(Spec("z", {0, 5})), 0u);
}

// --- ValidateLayout
// -----------------------------------------------------------

TEST(ValidateLayoutTest, ValidateLayout_ValidLayout_ReturnsTotalElements) {
  const Layout layout =
      MakeFloatLayout({{"fc.weight", {3, 5}}, {"fc.bias", {7}}, {"scale", {}}});
  absl::StatusOr<uint64_t> n = ValidateLayout(layout, kMax);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 23u);
}

TEST(ValidateLayoutTest, ValidateLayout_AllLayoutDTypes_Accepted) {
  const Layout layout = MakeLayout(
      {Spec("a", {2}, DType::kFloat32), Spec("b", {2}, DType::kBFloat16),
       Spec("c", {2}, DType::kFloat16), Spec("d", {2}, DType::kFloat64)});
  absl::StatusOr<uint64_t> n = ValidateLayout(layout, kMax);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 8u);
}

TEST(ValidateLayoutTest, ValidateLayout_ZeroSizedTensorAmongOthers_Accepted) {
  const Layout layout = MakeFloatLayout({{"empty", {0, 4}}, {"w", {3}}});
  absl::StatusOr<uint64_t> n = ValidateLayout(layout, kMax);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 3u);
}

TEST(ValidateLayoutTest, ValidateLayout_NoTensors_ReturnsInvalidArgument) {
  const Layout layout = MakeLayout({});
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayoutTest, ValidateLayout_NoElements_ReturnsInvalidArgument) {
  const Layout layout = MakeFloatLayout({{"a", {0}}, {"b", {3, 0}}});
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayoutTest, ValidateLayout_EmptyName_ReturnsInvalidArgument) {
  const Layout layout = MakeFloatLayout({{"w", {2}}, {"", {3}}});
  const absl::Status s = ValidateLayout(layout, kMax).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1"));
}

TEST(ValidateLayoutTest, ValidateLayout_DuplicateNames_ReturnsInvalidArgument) {
  const Layout layout = MakeFloatLayout(
      {{"fc.weight", {2}}, {"fc.bias", {2}}, {"fc.weight", {3}}});
  const absl::Status s = ValidateLayout(layout, kMax).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("fc.weight"));
}

TEST(ValidateLayoutTest, ValidateLayout_NegativeDim_ReturnsInvalidArgument) {
  const Layout layout =
      MakeFloatLayout({{"ok", {2}}, {"conv.weight", {3, -1}}});
  const absl::Status s = ValidateLayout(layout, kMax).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("conv.weight"));
}

TEST(ValidateLayoutTest,
     ValidateLayout_UnspecifiedDType_ReturnsInvalidArgument) {
  const Layout layout =
      MakeLayout({Spec("w", {2}), Spec("mask", {2}, DType::kUnspecified)});
  const absl::Status s = ValidateLayout(layout, kMax).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("mask"));
}

TEST(ValidateLayoutTest,
     ValidateLayout_OutOfRangeDType_ReturnsInvalidArgument) {
  const Layout layout = MakeLayout({Spec("w", {2}, static_cast<DType>(99))});
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayoutTest, ValidateLayout_RankAbove16_ReturnsInvalidArgument) {
  const Layout layout =
      MakeFloatLayout({{"deep", std::vector<int64_t>(17, 1)}});
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayoutTest, ValidateLayout_ExactlyMaxElements_Accepted) {
  const Layout layout = MakeFloatLayout({{"a", {60}}, {"b", {40}}});
  absl::StatusOr<uint64_t> n = ValidateLayout(layout, 100);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 100u);
}

TEST(ValidateLayoutTest,
     ValidateLayout_TooManyElements_ReturnsResourceExhausted) {
  const Layout one = MakeFloatLayout({{"big", {11, 10}}});
  EXPECT_EQ(ValidateLayout(one, 100).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Each tensor fits; their sum does not.
  const Layout sum = MakeFloatLayout({{"a", {60}}, {"b", {41}}});
  const absl::Status s = ValidateLayout(sum, 100).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("'b'"));
}

TEST(ValidateLayoutTest,
     ValidateLayout_HugeDims_ReturnResourceExhaustedNotOverflow) {
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max();
  // Products that wrap around uint64 must not look small.
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {kBig, kBig},
           {int64_t{1} << 32, int64_t{1} << 32},
           {int64_t{1} << 32, int64_t{1} << 32, 2},
           {kBig, 2, 1},
           {2, 2, kBig}}) {
    const Layout layout = MakeFloatLayout({{"small", {3}}, {"huge", shape}});
    const absl::Status s = ValidateLayout(layout, kMax).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted)
        << s << " for shape of rank " << shape.size();
  }
}

TEST(ValidateLayoutTest,
     ValidateLayout_HugeDimsWithUnboundedMax_ReturnResourceExhausted) {
  // max_elements is a uint64 option with no upper bound in
  // CoordinatorOptions::Validate; "no limit" naturally maps to UINT64_MAX.
  // 2^32 x 2^32 = 2^64 elements does not fit in that limit.
  constexpr uint64_t kUnbounded = std::numeric_limits<uint64_t>::max();
  const Layout layout = MakeFloatLayout(
      {{"small", {3}}, {"huge", {int64_t{1} << 32, int64_t{1} << 32}}});
  absl::StatusOr<uint64_t> n = ValidateLayout(layout, kUnbounded);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kResourceExhausted)
      << (n.ok() ? absl::StrCat("accepted with ", *n, " elements")
                 : n.status().ToString());
}

TEST(ValidateLayoutTest,
     ValidateLayout_WrongFingerprint_ReturnsInvalidArgument) {
  Layout layout = MakeFloatLayout({{"w", {2, 3}}});
  layout.fingerprint ^= 1;
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
  layout.fingerprint = 0;
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayoutTest,
     ValidateLayout_TensorsChangedAfterFingerprint_ReturnsInvalidArgument) {
  Layout layout = MakeFloatLayout({{"w", {2, 3}}});
  layout.tensors[0].shape = {3, 2};
  EXPECT_EQ(ValidateLayout(layout, kMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --- FirstDifference
// ----------------------------------------------------------

TEST(FirstDifferenceTest, FirstDifference_EqualLayouts_IsEmpty) {
  const Layout a = MakeFloatLayout({{"w", {2, 3}}, {"b", {3}}});
  EXPECT_EQ(FirstDifference(a, a), "");
  EXPECT_EQ(FirstDifference(a, MakeFloatLayout({{"w", {2, 3}}, {"b", {3}}})),
            "");
}

TEST(FirstDifferenceTest, FirstDifference_Name_NamesBothTensors) {
  const Layout job = MakeFloatLayout({{"fc.weight", {2}}, {"fc.bias", {2}}});
  const Layout member =
      MakeFloatLayout({{"fc.weight", {2}}, {"fc2.bias", {2}}});
  const std::string diff = FirstDifference(job, member);
  EXPECT_THAT(diff, HasSubstr("tensor 1"));
  EXPECT_THAT(diff, HasSubstr("fc.bias"));
  EXPECT_THAT(diff, HasSubstr("fc2.bias"));
}

TEST(FirstDifferenceTest, FirstDifference_Shape_NamesTensorAndShapes) {
  const Layout job = MakeFloatLayout({{"fc.weight", {4, 3}}, {"fc.bias", {4}}});
  const Layout member =
      MakeFloatLayout({{"fc.weight", {4, 3}}, {"fc.bias", {5}}});
  const std::string diff = FirstDifference(job, member);
  EXPECT_THAT(diff, HasSubstr("fc.bias"));
  EXPECT_THAT(diff, HasSubstr("[5]"));
  EXPECT_THAT(diff, HasSubstr("[4]"));
}

TEST(FirstDifferenceTest, FirstDifference_DType_NamesTensorAndDTypes) {
  const Layout job = MakeLayout({Spec("emb", {8}, DType::kFloat32)});
  const Layout member = MakeLayout({Spec("emb", {8}, DType::kBFloat16)});
  const std::string diff = FirstDifference(job, member);
  EXPECT_THAT(diff, HasSubstr("emb"));
  EXPECT_THAT(diff, HasSubstr("bfloat16"));
  EXPECT_THAT(diff, HasSubstr("float32"));
}

TEST(FirstDifferenceTest, FirstDifference_ReportsFirstOfSeveral) {
  const Layout job = MakeFloatLayout({{"a", {1}}, {"b", {2}}, {"c", {3}}});
  const Layout member = MakeFloatLayout({{"a", {1}}, {"b", {9}}, {"x", {3}}});
  const std::string diff = FirstDifference(job, member);
  EXPECT_THAT(diff, HasSubstr("'b'"));
  EXPECT_THAT(diff, ::testing::Not(HasSubstr("'x'")));
}

TEST(FirstDifferenceTest, FirstDifference_TensorCount_IsNonEmpty) {
  const Layout job = MakeFloatLayout({{"a", {1}}, {"b", {2}}});
  const Layout more = MakeFloatLayout({{"a", {1}}, {"b", {2}}, {"c", {3}}});
  const Layout fewer = MakeFloatLayout({{"a", {1}}});
  EXPECT_THAT(FirstDifference(job, more), HasSubstr("3"));
  EXPECT_THAT(FirstDifference(job, fewer), HasSubstr("1"));
  EXPECT_NE(FirstDifference(job, more), "");
  EXPECT_NE(FirstDifference(job, fewer), "");
}

// --- ChunkGeometry
// ------------------------------------------------------------

TEST(ChunkGeometryTest, ChunkGeometry_SizeNotDivisible_LastChunkShorter) {
  const ChunkGeometry g(10, 3);
  EXPECT_EQ(g.num_elements(), 10u);
  EXPECT_EQ(g.chunk_elements(), 3u);
  ASSERT_EQ(g.num_chunks(), 4u);
  EXPECT_EQ(g.Offset(0), 0u);
  EXPECT_EQ(g.Offset(1), 3u);
  EXPECT_EQ(g.Offset(2), 6u);
  EXPECT_EQ(g.Offset(3), 9u);
  EXPECT_EQ(g.Size(0), 3u);
  EXPECT_EQ(g.Size(1), 3u);
  EXPECT_EQ(g.Size(2), 3u);
  EXPECT_EQ(g.Size(3), 1u);
}

TEST(ChunkGeometryTest, ChunkGeometry_SizeDivisible_AllChunksFull) {
  const ChunkGeometry g(9, 3);
  ASSERT_EQ(g.num_chunks(), 3u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(g.Size(i), 3u);
}

TEST(ChunkGeometryTest, ChunkGeometry_ChunkLargerThanModel_OneChunk) {
  const ChunkGeometry g(7, 1024);
  ASSERT_EQ(g.num_chunks(), 1u);
  EXPECT_EQ(g.Offset(0), 0u);
  EXPECT_EQ(g.Size(0), 7u);
}

TEST(ChunkGeometryTest, ChunkGeometry_ChunksOfOne_OneChunkPerElement) {
  const ChunkGeometry g(5, 1);
  ASSERT_EQ(g.num_chunks(), 5u);
  for (uint32_t i = 0; i < 5; ++i) {
    EXPECT_EQ(g.Offset(i), i);
    EXPECT_EQ(g.Size(i), 1u);
  }
}

TEST(ChunkGeometryTest, ChunkGeometry_ChunksTileTheBufferExactly) {
  for (uint64_t n : {1ull, 2ull, 23ull, 1000ull, 1036ull, 65537ull}) {
    for (uint32_t c : {1u, 3u, 4u, 7u, 100u, 1024u, 70000u}) {
      const ChunkGeometry g(n, c);
      ASSERT_EQ(g.num_chunks(), (n + c - 1) / c) << n << " / " << c;
      uint64_t next = 0;
      for (uint32_t i = 0; i < g.num_chunks(); ++i) {
        EXPECT_EQ(g.Offset(i), next);
        EXPECT_GE(g.Size(i), 1u);
        EXPECT_LE(g.Size(i), c);
        next += g.Size(i);
      }
      EXPECT_EQ(next, n) << n << " / " << c;
    }
  }
}

TEST(ChunkGeometryTest, ChunkGeometry_ModelAbove4GiElements_OffsetsDoNotWrap) {
  const uint64_t n = (uint64_t{5} << 30) + 17;  // 5 Gi elements + 17
  const uint32_t c = 4u << 20;
  const ChunkGeometry g(n, c);
  ASSERT_EQ(g.num_chunks(), 1281u);
  EXPECT_EQ(g.Offset(1280), uint64_t{1280} * c);
  EXPECT_EQ(g.Size(1280), 17u);
  EXPECT_EQ(g.Size(1279), c);
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// Shards own chunks i with i mod count == index; the last chunk of the whole
// may be short. 10 elements in chunks of 3: {3, 3, 3, 1}.
TEST(ShardElementsTest, SumsTheOwnedChunks) {
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{0, 1}), 10u);
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{0, 2}), 6u);  // chunks 0, 2
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{1, 2}), 4u);  // chunks 1, 3
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{0, 3}), 4u);  // chunks 0, 3
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{2, 3}), 3u);  // chunk 2
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{3, 4}), 1u);  // chunk 3
  EXPECT_EQ(ShardElements(10, 3, ShardSpec{4, 5}), 0u);  // none
  // Every shard together holds every element exactly once.
  for (uint64_t n : {1u, 7u, 64u, 1000u}) {
    for (uint32_t chunk : {1u, 3u, 64u}) {
      for (uint32_t count : {1u, 2u, 3u, 5u}) {
        uint64_t total = 0;
        for (uint32_t i = 0; i < count; ++i) {
          total += ShardElements(n, chunk, ShardSpec{i, count});
        }
        EXPECT_EQ(total, n) << n << " " << chunk << " " << count;
      }
    }
  }
}

}  // namespace
}  // namespace localsgd
