#include "src/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// --- bfloat16 conversion
// ------------------------------------------------------

TEST(BFloat16Test, BFloat16ToFloat_IsTheUpperHalfOfFloat32) {
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(BFloat16ToFloat(0x0000), 0.0f);
  EXPECT_EQ(ToBits(BFloat16ToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(BFloat16ToFloat(0x7f80), kInf);
  EXPECT_EQ(BFloat16ToFloat(0xff80), -kInf);
  for (uint32_t h = 0; h <= 0xffff; h += 0x0101) {
    EXPECT_EQ(ToBits(BFloat16ToFloat(static_cast<uint16_t>(h))), h << 16);
  }
}

TEST(BFloat16Test, FloatToBFloat16_EveryNonNaNBFloat16_RoundTripsExactly) {
  // Every finite or infinite bfloat16 is exactly representable in float32.
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    if ((h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0) continue;  // NaN
    const float f = BFloat16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(FloatToBFloat16(f), h) << "bits 0x" << std::hex << h;
  }
}

TEST(BFloat16Test, FloatToBFloat16_CommonValues_AreExact) {
  for (float f : {0.0f, 1.0f, -1.0f, 0.5f, 2.0f, -3.0f, 3.140625f, 1024.0f,
                  -0.0078125f}) {
    EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(f)), f) << f;
  }
}

TEST(BFloat16Test, FloatToBFloat16_Ties_RoundToEven) {
  // 1 + 2^-8 lies halfway between 0x3f80 (even) and 0x3f81: to 0x3f80.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f808000u)), 0x3f80);
  // Halfway between 0x3f81 and 0x3f82 (even): up to 0x3f82.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f818000u)), 0x3f82);
  // Negative ties behave symmetrically.
  EXPECT_EQ(FloatToBFloat16(FromBits(0xbf808000u)), 0xbf80);
  EXPECT_EQ(FloatToBFloat16(FromBits(0xbf818000u)), 0xbf82);
  // Tie in the subnormal range.
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00008000u)), 0x0000);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00018000u)), 0x0002);
}

TEST(BFloat16Test, FloatToBFloat16_NonTies_RoundToNearest) {
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f808001u)), 0x3f81);  // just above
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f807fffu)), 0x3f80);  // just below
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f80ffffu)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f7fffffu)), 0x3f80);  // carries up
  // 1/3 = 0x3eaaaaab: the dropped half 0xaaab is above 0x8000, so it rounds up.
  EXPECT_EQ(FloatToBFloat16(1.0f / 3.0f), 0x3eab);
}

TEST(BFloat16Test, FloatToBFloat16_NaN_StaysNaN) {
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fbfffffu,
                        0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    const uint16_t h = FloatToBFloat16(FromBits(bits));
    EXPECT_TRUE(std::isnan(BFloat16ToFloat(h)))
        << "float bits 0x" << std::hex << bits << " -> 0x" << h;
    // The sign survives.
    EXPECT_EQ(h & 0x8000u, (bits >> 16) & 0x8000u);
  }
}

TEST(BFloat16Test, FloatToBFloat16_Infinity_StaysInfinity) {
  EXPECT_EQ(FloatToBFloat16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-kInf), 0xff80);
}

TEST(BFloat16Test, FloatToBFloat16_AboveLargestBFloat16_RoundsToInfinity) {
  // Round to nearest even: FLT_MAX is nearer to 2^128 than to 0x7f7f.
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  // The largest bf16 itself stays finite.
  EXPECT_EQ(FloatToBFloat16(BFloat16ToFloat(0x7f7f)), 0x7f7f);
}

// --- Encode / Decode
// ----------------------------------------------------------

TEST(CodecTest, WireBytes_IsElementsTimesDTypeSize) {
  EXPECT_EQ(WireBytes(DType::kFloat32, 0), 0u);
  EXPECT_EQ(WireBytes(DType::kFloat32, 7), 28u);
  EXPECT_EQ(WireBytes(DType::kBFloat16, 7), 14u);
}

TEST(CodecTest, EncodeValues_Sizes) {
  std::string out = "garbage that must go";
  EncodeValues(std::vector<float>(5, 1.0f), DType::kFloat32, &out);
  EXPECT_EQ(out.size(), 20u);
  EncodeValues(std::vector<float>(5, 1.0f), DType::kBFloat16, &out);
  EXPECT_EQ(out.size(), 10u);
  EncodeValues({}, DType::kFloat32, &out);
  EXPECT_EQ(out.size(), 0u);
}

TEST(CodecTest, EncodeDecode_Float32_BitExact) {
  const std::vector<float> values = {0.0f,
                                     -0.0f,
                                     1.5f,
                                     -3.25e-3f,
                                     std::numeric_limits<float>::denorm_min(),
                                     std::numeric_limits<float>::max(),
                                     -std::numeric_limits<float>::min(),
                                     123456.789f};
  std::string wire;
  EncodeValues(values, DType::kFloat32, &wire);
  ASSERT_EQ(wire.size(), values.size() * 4);
  // Little-endian fp32 in order.
  EXPECT_EQ(std::memcmp(wire.data(), values.data(), wire.size()), 0);
  std::vector<float> back(values.size(), 42.0f);
  ASSERT_TRUE(DecodeValues(wire, DType::kFloat32, absl::MakeSpan(back)).ok());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(ToBits(back[i]), ToBits(values[i])) << i;
  }
}

TEST(CodecTest, EncodeDecode_BFloat16_RoundsEachValue) {
  std::vector<float> values;
  for (int i = 0; i < 3000; ++i)
    values.push_back(std::sin(0.37f * i) * (i + 1));
  std::string wire;
  EncodeValues(values, DType::kBFloat16, &wire);
  ASSERT_EQ(wire.size(), values.size() * 2);
  std::vector<float> back(values.size());
  ASSERT_TRUE(DecodeValues(wire, DType::kBFloat16, absl::MakeSpan(back)).ok());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(back[i], BFloat16ToFloat(FloatToBFloat16(values[i]))) << i;
    // Relative error of one rounding to 8 significant bits.
    ASSERT_LE(std::fabs(back[i] - values[i]),
              std::ldexp(std::fabs(values[i]), -8))
        << i;
  }
}

TEST(CodecTest, EncodeValuesTo_MatchesEncodeValues) {
  const std::vector<float> values = {1.0f, -2.5f, 3.1f, 1e-20f, 7e20f};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    std::string expected;
    EncodeValues(values, dtype, &expected);
    std::string buffer(WireBytes(dtype, values.size()), '\xff');
    EncodeValuesTo(values, dtype, buffer.data());
    EXPECT_EQ(buffer, expected) << DTypeName(dtype);
  }
}

TEST(CodecTest, DecodeValues_WrongSize_ReturnsInvalidArgument) {
  std::vector<float> out(4);
  const std::string fp32(16, '\0');
  EXPECT_TRUE(DecodeValues(fp32, DType::kFloat32, absl::MakeSpan(out)).ok());
  for (const auto& [bytes, dtype] :
       std::vector<std::pair<size_t, DType>>{{15, DType::kFloat32},
                                             {17, DType::kFloat32},
                                             {0, DType::kFloat32},
                                             {8 - 1, DType::kBFloat16},
                                             {16, DType::kBFloat16}}) {
    const absl::Status s =
        DecodeValues(std::string(bytes, '\0'), dtype, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument)
        << bytes << " bytes of " << DTypeName(dtype);
  }
}

TEST(CodecTest, DecodeValues_WrongSize_LeavesOutputUntouched) {
  std::vector<float> out(3, 9.0f);
  EXPECT_FALSE(
      DecodeValues(std::string(5, '\0'), DType::kFloat32, absl::MakeSpan(out))
          .ok());
  EXPECT_EQ(out, std::vector<float>(3, 9.0f));
}

// --- FirstNonFinite
// -----------------------------------------------------------

std::string Encode(const std::vector<float>& v, DType dtype) {
  std::string s;
  EncodeValues(v, dtype, &s);
  return s;
}

TEST(FirstNonFiniteTest, FirstNonFinite_AllFinite_ReturnsMinusOne) {
  std::vector<float> v(5000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.1f * i) * 1e30f;
  v[17] = std::numeric_limits<float>::max();
  v[18] = -std::numeric_limits<float>::max();
  v[19] = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(FirstNonFinite(Encode(v, DType::kFloat32), DType::kFloat32), -1);
  // Stay below the largest bf16 so that rounding does not make an Inf.
  for (float& x : v) x = std::fmin(std::fmax(x, -1e38f), 1e38f);
  EXPECT_EQ(FirstNonFinite(Encode(v, DType::kBFloat16), DType::kBFloat16), -1);
  EXPECT_EQ(FirstNonFinite("", DType::kFloat32), -1);
  EXPECT_EQ(FirstNonFinite("", DType::kBFloat16), -1);
}

class FirstNonFiniteAtTest
    : public ::testing::TestWithParam<std::tuple<DType, size_t, float>> {};

TEST_P(FirstNonFiniteAtTest, FirstNonFinite_FindsTheIndex) {
  const auto [dtype, index, bad] = GetParam();
  std::vector<float> v(3001);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * static_cast<float>(i) - 7;
  v[index] = bad;
  EXPECT_EQ(FirstNonFinite(Encode(v, dtype), dtype),
            static_cast<int64_t>(index));
}

INSTANTIATE_TEST_SUITE_P(
    Positions, FirstNonFiniteAtTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16),
                       // Past the first 1024-element block, at block edges.
                       ::testing::Values(0u, 5u, 1023u, 1024u, 1025u, 1500u,
                                         2047u, 2048u, 3000u),
                       ::testing::Values(kNaN, kInf, -kInf, -kNaN)));

TEST(FirstNonFiniteTest, FirstNonFinite_Several_ReturnsTheFirst) {
  std::vector<float> v(4000, 1.0f);
  v[3500] = kNaN;
  v[1800] = kInf;
  v[2900] = kNaN;
  EXPECT_EQ(FirstNonFinite(Encode(v, DType::kFloat32), DType::kFloat32), 1800);
  EXPECT_EQ(FirstNonFinite(Encode(v, DType::kBFloat16), DType::kBFloat16),
            1800);
}

TEST(FirstNonFiniteTest, FirstNonFinite_SignalingNaNBits_AreFound) {
  std::vector<float> v(1200, 2.0f);
  v[1100] = FromBits(0x7f800001u);
  EXPECT_EQ(FirstNonFinite(Encode(v, DType::kFloat32), DType::kFloat32), 1100);
  std::string bf = Encode(std::vector<float>(1200, 2.0f), DType::kBFloat16);
  const uint16_t snan = 0x7f81;
  std::memcpy(bf.data() + 2 * 1199, &snan, 2);
  EXPECT_EQ(FirstNonFinite(bf, DType::kBFloat16), 1199);
}

// --- AccumulateWeighted / DivideInPlace / RoundTripInPlace
// ------------------------

// Values that are multiples of 1/4 and small: every product and sum below is
// exact in fp32, so results compare with ==.
std::vector<float> QuarterValues(size_t n, int seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = 0.25f *
           static_cast<float>(static_cast<int>((i * 7 + seed * 13) % 41) - 20);
  }
  return v;
}

class AccumulateTest : public ::testing::TestWithParam<DType> {};

TEST_P(AccumulateTest, AccumulateWeighted_UnitWeight_AddsValues) {
  const DType dtype = GetParam();
  for (size_t n : {1u, 7u, 1023u, 1024u, 2051u}) {
    const std::vector<float> x = QuarterValues(n, 1);
    std::vector<float> acc = QuarterValues(n, 2);
    const std::vector<float> before = acc;
    AccumulateWeighted(Encode(x, dtype), dtype, 1.0f, absl::MakeSpan(acc));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(acc[i], before[i] + x[i])
          << DTypeName(dtype) << " n=" << n << " i=" << i;
    }
  }
}

TEST_P(AccumulateTest, AccumulateWeighted_NonUnitWeight_AddsWeightedValues) {
  const DType dtype = GetParam();
  for (float w : {2.5f, 0.5f, 3.0f, 0.125f}) {
    const size_t n = 1500;
    const std::vector<float> x = QuarterValues(n, 3);
    std::vector<float> acc = QuarterValues(n, 4);
    const std::vector<float> before = acc;
    AccumulateWeighted(Encode(x, dtype), dtype, w, absl::MakeSpan(acc));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(acc[i], before[i] + w * x[i])
          << DTypeName(dtype) << " w=" << w << " i=" << i;
    }
  }
}

TEST_P(AccumulateTest, AccumulateWeighted_InexactValues_MatchFloatArithmetic) {
  const DType dtype = GetParam();
  const size_t n = 1200;
  std::vector<float> x(n), acc(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::sin(0.3f * i) * 3.7f;
    acc[i] = std::cos(0.2f * i);
  }
  const std::vector<float> before = acc;
  const float w = 1.37f;
  AccumulateWeighted(Encode(x, dtype), dtype, w, absl::MakeSpan(acc));
  for (size_t i = 0; i < n; ++i) {
    const float xv = dtype == DType::kBFloat16
                         ? BFloat16ToFloat(FloatToBFloat16(x[i]))
                         : x[i];
    const double expected = static_cast<double>(before[i]) +
                            static_cast<double>(w) * static_cast<double>(xv);
    // Two fp32 roundings at most (product, sum).
    ASSERT_NEAR(acc[i], expected, 4e-7 * (std::fabs(before[i]) + 5.1)) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(WireDTypes, AccumulateTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(CodecTest, DivideInPlace_DividesByTotalWeight) {
  std::vector<float> acc = {3.0f, -6.0f, 1.0f, 0.0f};
  DivideInPlace(absl::MakeSpan(acc), 3.0);
  EXPECT_EQ(acc[0], 1.0f);
  EXPECT_EQ(acc[1], -2.0f);
  EXPECT_EQ(acc[2], 1.0f / 3.0f);  // divide, as all_reduce-then-`/=` does
  EXPECT_EQ(acc[3], 0.0f);
}

// The element-wise kernels, bit for bit the scalar expressions, at sizes
// around the vector widths (the remainder loops too).
TEST(CodecTest, ElementwiseKernels_BitForBitTheScalarExpressions) {
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{17}, size_t{1031}}) {
    SCOPED_TRACE(n);
    std::vector<float> a(n), b(n), c(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = 1.0f / static_cast<float>(i + 1) + 1e3f;
      b[i] = 0.1f * static_cast<float>(i) - 7.0f / 3.0f;
      c[i] = -static_cast<float>(i % 13) / 11.0f;
    }
    std::string bytes(4 * n + 1, 'x');
    SubtractTo(a, b, bytes.data());
    EXPECT_EQ(bytes[4 * n], 'x');  // nothing past the values
    for (size_t i = 0; i < n; ++i) {
      const float want = a[i] - b[i];
      float got;
      std::memcpy(&got, bytes.data() + 4 * i, 4);
      ASSERT_EQ(ToBits(got), ToBits(want)) << i;
    }
    std::vector<float> acc = a;
    AddInPlace(absl::MakeSpan(acc), b);
    for (size_t i = 0; i < n; ++i) {
      const float want = a[i] + b[i];
      ASSERT_EQ(ToBits(acc[i]), ToBits(want)) << i;
    }
    std::vector<float> params = c;
    AddProgress(a, b, absl::MakeSpan(params));
    for (size_t i = 0; i < n; ++i) {
      const float want = a[i] + (c[i] - b[i]);
      ASSERT_EQ(ToBits(params[i]), ToBits(want)) << i;
    }
  }
}

TEST(CodecTest, RoundTripInPlace_Float32IsNoOp_BFloat16Rounds) {
  std::vector<float> v = {1.0f / 3.0f, 3.14159f, -2.7182818f, 1e-3f};
  const std::vector<float> original = v;
  RoundTripInPlace(absl::MakeSpan(v), DType::kFloat32);
  EXPECT_EQ(v, original);
  RoundTripInPlace(absl::MakeSpan(v), DType::kBFloat16);
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(v[i], BFloat16ToFloat(FloatToBFloat16(original[i])));
    EXPECT_EQ(ToBits(v[i]) & 0xffffu, 0u);  // representable in bf16
  }
}

}  // namespace
}  // namespace localsgd

// ------------------------------------------------- payloads in pieces
// gRPC hands a received chunk over as slices cut anywhere, also inside an
// element: the pieces versions must do exactly what the single-buffer ones
// do on the joined bytes.

namespace localsgd {
namespace {

std::vector<absl::string_view> Cut(absl::string_view bytes,
                                   std::vector<size_t> at) {
  at.push_back(0);
  at.push_back(bytes.size());
  std::sort(at.begin(), at.end());
  std::vector<absl::string_view> pieces;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    pieces.push_back(bytes.substr(at[i], at[i + 1] - at[i]));
  }
  return pieces;
}

class PiecesTest : public ::testing::TestWithParam<DType> {};

TEST_P(PiecesTest, EveryCut_SameAsJoinedBytes) {
  const DType dtype = GetParam();
  const size_t n = 37;
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = 0.37f * static_cast<float>(i) - 5;
  std::string bytes;
  EncodeValues(values, dtype, &bytes);
  std::vector<std::vector<size_t>> cuts = {{}, {1}, {3}, {5, 6, 7}};
  for (size_t a = 0; a <= bytes.size(); a += 3) cuts.push_back({a, a + 1});
  for (const std::vector<size_t>& at : cuts) {
    std::vector<size_t> clipped;
    for (size_t x : at) clipped.push_back(std::min(x, bytes.size()));
    const auto pieces = Cut(bytes, clipped);
    std::vector<float> want(n), got(n);
    ASSERT_TRUE(DecodeValues(bytes, dtype, absl::MakeSpan(want)).ok());
    ASSERT_TRUE(DecodeValuesPieces(pieces, dtype, absl::MakeSpan(got)).ok());
    EXPECT_EQ(got, want);
    std::vector<float> acc_want(n, 1.5f), acc_got(n, 1.5f);
    AccumulateWeighted(bytes, dtype, 0.25f, absl::MakeSpan(acc_want));
    AccumulateWeightedPieces(pieces, dtype, 0.25f, absl::MakeSpan(acc_got));
    EXPECT_EQ(acc_got, acc_want);
    EXPECT_EQ(FirstNonFinitePieces(pieces, dtype, n), -1);
  }
}

TEST_P(PiecesTest, NonFiniteAnywhere_FoundAtItsIndexWhateverTheCut) {
  const DType dtype = GetParam();
  const size_t size = static_cast<size_t>(DTypeSize(dtype));
  const size_t n = 20;
  for (size_t bad : {size_t{0}, size_t{7}, size_t{19}}) {
    std::vector<float> values(n, 1.0f);
    values[bad] = std::numeric_limits<float>::quiet_NaN();
    values[n - 1 == bad ? 0 : n - 1] = 2.0f;
    std::string bytes;
    EncodeValues(values, dtype, &bytes);
    // A cut through the bad element, one before it, one after it.
    for (size_t at : {bad * size + 1, bad * size, (bad + 1) * size}) {
      const auto pieces = Cut(bytes, {std::min(at, bytes.size())});
      EXPECT_EQ(FirstNonFinitePieces(pieces, dtype, n),
                static_cast<int64_t>(bad))
          << "bad " << bad << " cut at " << at;
    }
  }
}

TEST_P(PiecesTest, DecodeValuesPieces_WrongSize_InvalidArgument) {
  const DType dtype = GetParam();
  std::string bytes(4 * DTypeSize(dtype) + 1, '\0');
  std::vector<float> out(4, 7.0f);
  const auto pieces = Cut(bytes, {2});
  EXPECT_EQ(DecodeValuesPieces(pieces, dtype, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));
}

// DecodeOnto(Pieces): a delta decoded onto its base, bit for bit what
// DecodeValues then an add gives, for every wire dtype and every cut.
class DecodeOntoTest : public ::testing::TestWithParam<DType> {};

TEST_P(DecodeOntoTest, ManyCuts_BitForBitBasePlusDecoded) {
  const DType dtype = GetParam();
  // Two blockwise blocks and a partial one (an odd count for int4).
  const size_t n = 2 * kQuantBlock + 37;
  std::vector<float> values(n), base(n);
  for (size_t i = 0; i < n; ++i) {
    values[i] = 0.37f * static_cast<float>(i % 101) - 17.0f / 3.0f;
    base[i] = 1.0f / static_cast<float>(i + 3) - 0.1f * static_cast<float>(i);
  }
  std::string bytes;
  EncodeValues(values, dtype, &bytes);
  std::vector<float> want(n);
  ASSERT_TRUE(DecodeValues(bytes, dtype, absl::MakeSpan(want)).ok());
  for (size_t i = 0; i < n; ++i) want[i] = base[i] + want[i];

  std::vector<float> got(n, 7.0f);
  ASSERT_TRUE(DecodeOnto(bytes, dtype, base, absl::MakeSpan(got)).ok());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n * sizeof(float)));
  // In place (out is base).
  std::vector<float> in_place = base;
  ASSERT_TRUE(
      DecodeOnto(bytes, dtype, in_place, absl::MakeSpan(in_place)).ok());
  EXPECT_EQ(0, std::memcmp(in_place.data(), want.data(), n * sizeof(float)));

  std::vector<std::vector<size_t>> cuts = {{}, {1}, {3}, {5, 6, 7}};
  for (size_t a = 0; a <= bytes.size(); a += 97) cuts.push_back({a, a + 1});
  for (const std::vector<size_t>& at : cuts) {
    std::vector<size_t> clipped;
    for (size_t x : at) clipped.push_back(std::min(x, bytes.size()));
    std::fill(got.begin(), got.end(), 7.0f);
    ASSERT_TRUE(
        DecodeOntoPieces(Cut(bytes, clipped), dtype, base, absl::MakeSpan(got))
            .ok());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n * sizeof(float)))
        << "cut at " << (at.empty() ? 0 : at[0]);
  }
}

TEST_P(DecodeOntoTest, WrongSizes_InvalidArgumentAndNothingWritten) {
  const DType dtype = GetParam();
  std::vector<float> values(8, 1.5f), base(8, 2.0f);
  std::string bytes;
  EncodeValues(values, dtype, &bytes);
  std::vector<float> out(8, 7.0f);
  const std::string longer = bytes + "x";
  EXPECT_EQ(DecodeOnto(longer, dtype, base, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeOntoPieces(Cut(longer, {3}), dtype, base, absl::MakeSpan(out))
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<float> short_base(7, 2.0f);
  EXPECT_EQ(DecodeOnto(bytes, dtype, short_base, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      DecodeOntoPieces(Cut(bytes, {3}), dtype, short_base, absl::MakeSpan(out))
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, std::vector<float>(8, 7.0f));
}

INSTANTIATE_TEST_SUITE_P(WireDTypes, DecodeOntoTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                           DType::kInt8Block,
                                           DType::kInt4Block),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(WireDTypes, PiecesTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace localsgd

// src/malloc_tuning.h: on glibc the settings must take (an #if on a macro
// that no header had defined yet once made it a silent no-op).
#include "src/malloc_tuning.h"

namespace localsgd {
namespace {

// The sanitizers bring their own malloc, whose mallopt refuses everything.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LOCALSGD_TEST_MALLOC_REPLACED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define LOCALSGD_TEST_MALLOC_REPLACED 1
#endif
#endif

TEST(MallocTuningTest, KeepFreedMemoryForReuse_TakesOnGlibc) {
#if defined(LOCALSGD_TEST_MALLOC_REPLACED)
  GTEST_SKIP() << "a sanitizer replaces malloc (its mallopt refuses)";
#elif defined(__GLIBC__)
  EXPECT_TRUE(KeepFreedMemoryForReuse());
#else
  GTEST_SKIP() << "not glibc";
#endif
}

// Blockwise codes ------------------------------------------------------

std::vector<float> Wavy(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = scale * std::sin(0.37f * i) * (1 + (i % 13 == 0 ? 9 : 0));
  }
  return v;
}

TEST(BlockCodeTest, WireBytes_ScalesThenCodes) {
  EXPECT_EQ(WireBytes(DType::kInt8Block, 1), 4u + 1);
  EXPECT_EQ(WireBytes(DType::kInt8Block, 64), 4u + 64);
  EXPECT_EQ(WireBytes(DType::kInt8Block, 65), 8u + 65);
  EXPECT_EQ(WireBytes(DType::kInt4Block, 1), 4u + 1);
  EXPECT_EQ(WireBytes(DType::kInt4Block, 64), 4u + 32);
  EXPECT_EQ(WireBytes(DType::kInt4Block, 129), 12u + 65);
}

// Every decoded value is within half a code step of the value: scale / 2,
// scale = block absmax / M; the block's absmax itself is exact up to fp32.
TEST(BlockCodeTest, RoundTrip_ErrorWithinHalfAStepPerBlock) {
  for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
    const int max_code = dtype == DType::kInt8Block ? 127 : 7;
    for (size_t n : {1u, 63u, 64u, 65u, 1000u}) {
      const std::vector<float> v = Wavy(n, 0.01f);
      std::string wire;
      EncodeValues(v, dtype, &wire);
      ASSERT_EQ(wire.size(), WireBytes(dtype, n));
      std::vector<float> back(n);
      ASSERT_TRUE(DecodeValues(wire, dtype, absl::MakeSpan(back)).ok());
      for (size_t b = 0; b * kQuantBlock < n; ++b) {
        float absmax = 0;
        const size_t end = std::min(n, (b + 1) * kQuantBlock);
        for (size_t i = b * kQuantBlock; i < end; ++i) {
          absmax = std::max(absmax, std::fabs(v[i]));
        }
        for (size_t i = b * kQuantBlock; i < end; ++i) {
          EXPECT_LE(std::fabs(back[i] - v[i]),
                    0.5001f * absmax / max_code + 1e-12f)
              << DTypeName(dtype) << " n=" << n << " i=" << i;
        }
      }
      EXPECT_EQ(FirstNonFinite(wire, dtype), -1);
      EXPECT_TRUE(
          CheckBlockScales(wire.substr(0, 4 * NumBlocks(n)), dtype).ok());
    }
  }
}

TEST(BlockCodeTest, ZerosAndNonFinite) {
  for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
    std::vector<float> v(130, 0.0f);
    std::string wire;
    EncodeValues(v, dtype, &wire);
    std::vector<float> back(130, 7.0f);
    ASSERT_TRUE(DecodeValues(wire, dtype, absl::MakeSpan(back)).ok());
    EXPECT_EQ(back, v);
    EXPECT_TRUE(CheckBlockScales(wire.substr(0, 12), dtype).ok());  // 1.0
    v[70] = std::numeric_limits<float>::infinity();
    EncodeValues(v, dtype, &wire);
    EXPECT_EQ(FirstNonFinite(wire, dtype), 64);  // block 1's first element
  }
}

// A code of -128 (int8) or -8 (int4) no encoder writes reads as -M: any
// positive finite scale decodes to finite values.
TEST(BlockCodeTest, MostNegativeCode_ReadsAsMinusMax) {
  std::string wire(4 + 2, '\0');
  const float scale = kMaxBlockScale;
  std::memcpy(wire.data(), &scale, 4);
  EXPECT_TRUE(CheckBlockScales(wire.substr(0, 4), DType::kInt8Block).ok());
  const float too_large = std::numeric_limits<float>::max() / 127;
  EXPECT_THAT(
      CheckBlockScales(
          absl::string_view(reinterpret_cast<const char*>(&too_large), 4),
          DType::kInt8Block)
          .message(),
      HasSubstr("at most float32 max / 128"));
  wire[4] = static_cast<char>(-128);
  wire[5] = 1;
  std::vector<float> out(2);
  ASSERT_TRUE(DecodeValues(wire, DType::kInt8Block, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[0], -127 * scale);
  EXPECT_TRUE(std::isfinite(out[0]));
  std::string wire4(4 + 1, '\0');
  const float one = 1;
  std::memcpy(wire4.data(), &one, 4);
  wire4[4] = static_cast<char>(0x78);  // low nibble 8 (-8), high 7
  ASSERT_TRUE(DecodeValues(wire4, DType::kInt4Block, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[0], -7.0f);
  EXPECT_EQ(out[1], 7.0f);
}

// Accumulating is weight x decoding, and the pieces form reads the same.
TEST(BlockCodeTest, AccumulateAndPieces_MatchDecode) {
  for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
    const std::vector<float> v = Wavy(301, 2.0f);
    std::string wire;
    EncodeValues(v, dtype, &wire);
    std::vector<float> decoded(301);
    ASSERT_TRUE(DecodeValues(wire, dtype, absl::MakeSpan(decoded)).ok());
    std::vector<float> acc(301, 1.0f);
    const absl::string_view all(wire);
    const absl::string_view pieces[] = {all.substr(0, 7), all.substr(7, 100),
                                        all.substr(107)};
    AccumulateWeightedPieces(pieces, dtype, 1.0f, absl::MakeSpan(acc));
    std::vector<float> from_pieces(301);
    ASSERT_TRUE(
        DecodeValuesPieces(pieces, dtype, absl::MakeSpan(from_pieces)).ok());
    EXPECT_EQ(from_pieces, decoded);
    for (size_t i = 0; i < 301; ++i) {
      EXPECT_EQ(acc[i], 1.0f + decoded[i]) << i;
    }
  }
}

// Error feedback: what the encoding drops is kept and sent later, so the
// sum of what was decoded over rounds tracks the sum of the inputs within
// one round's error, for every wire dtype.
TEST(BlockCodeTest, EncodeWithFeedback_NothingIsLostOverRounds) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt8Block,
                      DType::kInt4Block}) {
    const size_t n = 2500;  // more than one step of the encoder, odd tail
    const std::vector<float> step = Wavy(n, 1e-3f);
    std::vector<float> residual(dtype == DType::kFloat32 ? 0 : n, 0.0f);
    std::vector<double> sent(n, 0.0);
    std::string wire(WireBytes(dtype, n), '\0');
    std::vector<float> decoded(n);
    for (int round = 0; round < 50; ++round) {
      EncodeWithFeedback(step, absl::MakeSpan(residual), dtype, wire.data(),
                         absl::MakeSpan(decoded));
      std::vector<float> check(n);
      ASSERT_TRUE(DecodeValues(wire, dtype, absl::MakeSpan(check)).ok());
      ASSERT_EQ(check, decoded) << DTypeName(dtype);
      for (size_t i = 0; i < n; ++i) sent[i] += decoded[i];
    }
    for (size_t i = 0; i < n; ++i) {
      const double want = 50.0 * step[i];
      // residual_50 = sum(inputs) - sum(decoded), bounded by one step's
      // error (for int4: absmax / 14 of the block, absmax <= 1e-2).
      EXPECT_NEAR(sent[i], want, 1e-3) << DTypeName(dtype) << " i=" << i;
      if (!residual.empty()) {
        EXPECT_NEAR(sent[i] + residual[i], want, 1e-6 + 1e-6 * std::fabs(want));
      }
    }
  }
}

// The blockwise encoder with error feedback, one pass per block, gives
// bit for bit what its parts give: encode(v + r), its decoding, and
// r = (v + r) - decoded; over blocks of every kind (zeros, subnormals,
// values near the float32 limit, a NaN, an infinity, mixed magnitudes),
// sizes with a partial last block and an odd one, and `decoded` in place
// of `values`.
TEST(BlockCodeTest, EncodeWithFeedback_BitForBitItsParts) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
    for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65},
                     size_t{64 * 40 + 17}}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " n=", n,
                                  in_place ? " in place" : ""));
        std::vector<float> v(n), r(n);
        for (size_t i = 0; i < n; ++i) {
          const size_t block = i / kQuantBlock;
          const float scale = block % 5 == 1   ? 1e-41f
                              : block % 5 == 2 ? 1e37f
                              : block % 5 == 3
                                  ? 0.0f
                                  : std::ldexp(1.0f, -static_cast<int>(i % 9));
          v[i] = normal(rng) * scale;
          r[i] = normal(rng) * scale * 0.01f;
        }
        if (n > 3 * kQuantBlock) {
          v[3 * kQuantBlock + 5] = std::numeric_limits<float>::quiet_NaN();
          v[4 * kQuantBlock + 1] = std::numeric_limits<float>::infinity();
        }
        // The parts.
        std::vector<float> e(n);
        for (size_t i = 0; i < n; ++i) e[i] = v[i] + r[i];
        std::string want_bytes;
        EncodeValues(e, dtype, &want_bytes);
        std::vector<float> want_decoded(n);
        ASSERT_TRUE(
            DecodeValues(want_bytes, dtype, absl::MakeSpan(want_decoded)).ok());
        std::vector<float> want_residual(n);
        for (size_t i = 0; i < n; ++i)
          want_residual[i] = e[i] - want_decoded[i];
        // The fused encoder.
        std::string bytes(WireBytes(dtype, n), '\0');
        std::vector<float> decoded(n);
        std::vector<float> values = v;
        EncodeWithFeedback(
            values, absl::MakeSpan(r), dtype, bytes.data(),
            in_place ? absl::MakeSpan(values) : absl::MakeSpan(decoded));
        const std::vector<float>& got = in_place ? values : decoded;
        EXPECT_EQ(bytes, want_bytes);
        EXPECT_EQ(std::memcmp(got.data(), want_decoded.data(), 4 * n), 0);
        EXPECT_EQ(std::memcmp(r.data(), want_residual.data(), 4 * n), 0);
      }
    }
  }
}

// The AVX2 kernels give the portable loops' bytes and floats, bit for bit,
// with and without error feedback: blocks of every kind (normal values,
// values that scale to exactly +-k.5 and to the code limit, +-0 and -0
// only, subnormals, values near the float32 limit, a NaN, an infinity),
// whole blocks and a partial last one, and `decoded` in place of `values`.
TEST(BlockCodeTest, Avx2KernelsMatchPortable_BitForBit) {
  if (ActiveCodecKernels() != CodecKernels::kAvx2) {
    GTEST_SKIP() << "this CPU has no AVX2: only the portable kernels run";
  }
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Whole groups of eight blocks and a partial last block; a partial
  // group; a single block.
  for (size_t n : {size_t{64 * 24 + 37}, size_t{64 * 11}, size_t{64}}) {
    std::vector<float> v(n), r(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t block = i / kQuantBlock;
      const size_t j = i % kQuantBlock;
      float x = normal(rng);
      switch (block % 12) {
        case 1:  // halves after scaling by 127 / 127 and 7 / 7: ties
          x = j == 0 ? 127.0f
                     : static_cast<float>(static_cast<int>(j) - 32) + 0.5f;
          break;
        case 2:
          x = j % 2 ? -0.0f : 0.0f;
          break;
        case 3:
          x *= 1e-41f;  // subnormal
          break;
        case 4:
          x *= 3e38f;  // at the float32 limit: the scale saturates
          break;
        case 5:
          if (j == 17) x = std::numeric_limits<float>::quiet_NaN();
          break;
        case 6:
          if (j == 40) x = -std::numeric_limits<float>::infinity();
          break;
        case 7:
          x = j == 3 ? -1.0f : x * 1e-9f;  // one large, the rest round to 0
          break;
        case 8:
          x = -std::fabs(x);  // all negative
          break;
        default:
          x *= std::ldexp(1.0f, static_cast<int>(block % 9) - 4);
      }
      v[i] = x;
      r[i] = (block % 12 == 2) ? 0.0f : normal(rng) * 1e-3f;
    }
    for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " n=", n,
                                  in_place ? " in place" : ""));
        struct Out {
          std::string plain, fed;
          std::vector<float> decoded, residual;
        };
        auto run = [&](bool portable) {
          ForcePortableCodecKernels(portable);
          Out o;
          EncodeValues(v, dtype, &o.plain);
          o.fed.assign(WireBytes(dtype, n), '\0');
          o.residual = r;
          std::vector<float> values = v;
          o.decoded.assign(n, 0.0f);
          EncodeWithFeedback(
              values, absl::MakeSpan(o.residual), dtype, o.fed.data(),
              in_place ? absl::MakeSpan(values) : absl::MakeSpan(o.decoded));
          if (in_place) o.decoded = values;
          ForcePortableCodecKernels(false);
          return o;
        };
        const Out portable = run(true);
        const Out avx2 = run(false);
        EXPECT_EQ(avx2.plain, portable.plain);
        EXPECT_EQ(avx2.fed, portable.fed);
        EXPECT_EQ(
            std::memcmp(avx2.decoded.data(), portable.decoded.data(), 4 * n),
            0);
        EXPECT_EQ(
            std::memcmp(avx2.residual.data(), portable.residual.data(), 4 * n),
            0);
        // The ties were there to be rounded (not every block scaled to zero).
        std::vector<float> decoded(n);
        ASSERT_TRUE(
            DecodeValues(portable.plain, dtype, absl::MakeSpan(decoded)).ok());
        if (n > 2 * kQuantBlock) {
          EXPECT_EQ(decoded[64 + 0], 127.0f);
        }
      }
    }
  }
}

// A member's upload in one pass: the delta params - anchor encoded with
// feedback gives SubtractTo then EncodeWithFeedback's bytes and residual,
// bit for bit, with either set of kernels: blocks of every kind (a NaN, an
// infinity minus itself, zeros, subnormal and huge deltas), whole groups
// of blocks, a partial group and a partial last block.
TEST(BlockCodeTest, EncodeDeltaWithFeedback_BitForBitSubtractThenEncode) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (DType dtype : {DType::kInt8Block, DType::kInt4Block}) {
    for (size_t n : {size_t{64 * 19 + 9}, size_t{64 * 8}, size_t{5}}) {
      std::vector<float> params(n), anchor(n), r(n);
      for (size_t i = 0; i < n; ++i) {
        const size_t block = i / kQuantBlock;
        anchor[i] = normal(rng);
        const float step = block % 6 == 1   ? 1e-41f
                           : block % 6 == 2 ? 1e30f
                           : block % 6 == 3 ? 0.0f
                                            : 1e-3f;
        params[i] = anchor[i] + normal(rng) * step;
        r[i] = block % 6 == 3 ? 0.0f : normal(rng) * 1e-4f;
      }
      if (n > 6 * kQuantBlock) {
        params[4 * kQuantBlock + 2] = std::numeric_limits<float>::quiet_NaN();
        params[5 * kQuantBlock + 7] = std::numeric_limits<float>::infinity();
        anchor[5 * kQuantBlock + 7] = std::numeric_limits<float>::infinity();
      }
      for (bool portable : {true, false}) {
        if (!portable && ActiveCodecKernels() != CodecKernels::kAvx2) continue;
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " n=", n,
                                  portable ? " portable" : " avx2"));
        ForcePortableCodecKernels(portable);
        // The two steps.
        std::vector<float> delta(n), decoded(n), want_residual = r;
        SubtractTo(params, anchor, reinterpret_cast<char*>(delta.data()));
        std::string want(WireBytes(dtype, n), '\0');
        EncodeWithFeedback(delta, absl::MakeSpan(want_residual), dtype,
                           want.data(), absl::MakeSpan(decoded));
        // The one pass.
        std::vector<float> residual = r;
        std::string got(WireBytes(dtype, n), '\0');
        EncodeDeltaWithFeedback(params, anchor, absl::MakeSpan(residual), dtype,
                                got.data());
        ForcePortableCodecKernels(false);
        EXPECT_EQ(got, want);
        EXPECT_EQ(std::memcmp(residual.data(), want_residual.data(), 4 * n), 0);
      }
    }
  }
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// The sparse wire codes through the codec's entry points, which dispatch on
// the WireCode: the same bytes and values as the sparse codec's own
// functions, from contiguous bytes or cut into pieces anywhere; a delta
// applied densely (an element not kept adds +0.0); and every malformed
// payload named by CheckPayloadPieces.
TEST(SparseWireCodeTest, EntryPoints_AgreeWithTheSparseCodecWhateverTheCut) {
  for (const DType dtype : {DType::kSparse2, DType::kSparse4}) {
    SCOPED_TRACE(DTypeName(dtype));
    const WireCode wire(dtype, 100);
    const SparseCode code = SparseCodeOf(wire);
    const size_t n = kSparseBlock + 1000;  // a full block and a partial one
    std::vector<float> values(n), base(n);
    for (size_t i = 0; i < n; ++i) {
      values[i] = std::sin(0.3f * static_cast<float>(i)) *
                  static_cast<float>(1 + i % 13);
      base[i] = i % 5 == 0 ? -0.0f : 0.01f * static_cast<float>(i);
    }
    ASSERT_EQ(WireBytes(wire, n), SparseWireBytes(n, code));
    std::string bytes(WireBytes(wire, n), '\0');
    std::vector<float> residual(n, 0.0f), decoded(n);
    EncodeWithFeedback(values, absl::MakeSpan(residual), wire, bytes.data(),
                       absl::MakeSpan(decoded));
    std::string direct(SparseWireBytes(n, code), '\0');
    std::vector<float> direct_residual(n, 0.0f);
    EncodeSparseWithFeedback(values, absl::MakeSpan(direct_residual), code,
                             direct.data());
    ASSERT_EQ(bytes, direct);
    EXPECT_EQ(residual, direct_residual);
    std::vector<float> want(n);
    ASSERT_TRUE(DecodeSparse(bytes, code, absl::MakeSpan(want)).ok());
    EXPECT_EQ(decoded, want);
    for (std::vector<size_t> at :
         {std::vector<size_t>{}, std::vector<size_t>{1, 9, 77},
          std::vector<size_t>{bytes.size() / 2}}) {
      const auto pieces = Cut(bytes, at);
      EXPECT_TRUE(CheckPayloadPieces(pieces, wire, n).ok());
      EXPECT_EQ(FirstNonFinitePieces(pieces, wire, n), -1);
      EXPECT_EQ(MaxAbsPieces(pieces, wire, n), SparseMaxAbs(bytes, n, code));
      std::vector<float> got(n);
      ASSERT_TRUE(DecodeValuesPieces(pieces, wire, absl::MakeSpan(got)).ok());
      EXPECT_EQ(got, want);
      std::vector<float> acc(n, 0.5f), acc_want(n, 0.5f);
      AccumulateWeightedPieces(pieces, wire, 0.25f, absl::MakeSpan(acc));
      ASSERT_TRUE(
          AccumulateSparseWeighted(bytes, code, 0.25f, absl::MakeSpan(acc_want))
              .ok());
      EXPECT_EQ(acc, acc_want);
      // Onto a base: every element base + value, -0.0 + 0 included.
      std::vector<float> onto(n);
      ASSERT_TRUE(
          DecodeOntoPieces(pieces, wire, base, absl::MakeSpan(onto)).ok());
      for (size_t i = 0; i < n; ++i) {
        const float sum = base[i] + want[i];
        ASSERT_EQ(0, std::memcmp(&onto[i], &sum, 4)) << i;
      }
      const ChunkMagnitude m =
          MagnitudePieces(pieces, wire, n, /*with_norm=*/true);
      double squares = 0;
      for (float v : want) squares += static_cast<double>(v) * v;
      EXPECT_EQ(m.sum_of_squares, squares);
      EXPECT_EQ(m.max_abs, SparseMaxAbs(bytes, n, code));
    }
    // The size, then the structure.
    EXPECT_THAT(
        std::string(CheckPayloadPieces(
                        Cut(bytes.substr(0, bytes.size() - 1), {}), wire, n)
                        .message()),
        HasSubstr("bytes for 5096 values"));
    std::string inverted = bytes;
    std::swap_ranges(inverted.begin(), inverted.begin() + 4,
                     inverted.begin() + 4);
    EXPECT_THAT(
        std::string(CheckPayloadPieces(Cut(inverted, {3}), wire, n).message()),
        HasSubstr("sparse block 0 has scales"));
    // A block flagged non-finite: its first element.
    std::string nan_block = bytes;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(nan_block.data() + 8, &nan, 4);
    std::memcpy(nan_block.data() + 12, &nan, 4);
    EXPECT_EQ(FirstNonFinitePieces(Cut(nan_block, {5}), wire, n),
              static_cast<int64_t>(kSparseBlock));
    EXPECT_TRUE(CheckPayloadPieces(Cut(nan_block, {}), wire, n).ok());
  }
}

}  // namespace
}  // namespace localsgd
