// The sparse codes (src/sparse_codec.h) against the format as documented,
// computed here independently: which values a block keeps (a sort by bin,
// then index), what the payload's bytes hold (read bit by bit), what each
// value decodes to, the residual, and the hostile payloads CheckSparse
// refuses.
#include "src/sparse_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
bool SameBits(float a, float b) { return BitsOf(a) == BitsOf(b); }

// Bit `k` of a byte string, least significant bit of byte 0 first.
uint32_t Bit(const std::string& s, size_t k) {
  return (static_cast<uint8_t>(s[k / 8]) >> (k % 8)) & 1u;
}
uint32_t Field(const std::string& s, size_t first_bit, unsigned width) {
  uint32_t v = 0;
  for (unsigned t = 0; t < width; ++t) v |= Bit(s, first_bit + t) << t;
  return v;
}

// A block's positions' layout by the letter of the format: l the largest
// with kb x 2^l <= nb, then kb x l low bits and ((nb - 1) >> l) + kb high.
struct PositionPart {
  unsigned low;
  size_t high_bits;
  size_t bits(size_t kb) const { return kb * low + high_bits; }
};
PositionPart PartOf(size_t nb, size_t kb) {
  PositionPart p{0, 0};
  while ((size_t{1} << (p.low + 1)) * kb <= nb) ++p.low;
  p.high_bits = ((nb - 1) >> p.low) + kb;
  return p;
}
size_t KeptIn(size_t nb, SparseCode code) {
  return (code.keep * nb + kSparseBlock - 1) / kSparseBlock;
}
size_t NumBlocksOf(size_t n) { return (n + kSparseBlock - 1) / kSparseBlock; }
size_t BlockSize(size_t n, size_t b) {
  return std::min(kSparseBlock, n - b * kSparseBlock);
}
// Where block b's positions start, in bits past the scales.
size_t PositionBitOf(size_t n, SparseCode code, size_t b) {
  size_t bit = 0;
  for (size_t i = 0; i < b; ++i) {
    const size_t nb = BlockSize(n, i);
    bit += PartOf(nb, KeptIn(nb, code)).bits(KeptIn(nb, code));
  }
  return bit;
}

// The payload, read by the letter of the format: block b's positions are
// those its high parts hold (ones_in_high: how many; kb in a valid one).
struct Block {
  float lo, hi;
  std::vector<uint32_t> positions, codes;
  size_t ones_in_high = 0;
};
std::vector<Block> Parse(const std::string& p, size_t n, SparseCode code) {
  const size_t blocks = NumBlocksOf(n);
  std::vector<Block> out(blocks);
  size_t kept = 0;
  for (size_t b = 0; b < blocks; ++b) kept += KeptIn(BlockSize(n, b), code);
  const size_t pos_bit = 8 * 8 * blocks;
  const size_t code_bit =
      pos_bit + 8 * ((PositionBitOf(n, code, blocks) + 7) / 8);
  size_t j = 0;
  for (size_t b = 0; b < blocks; ++b) {
    std::memcpy(&out[b].lo, p.data() + 8 * b, 4);
    std::memcpy(&out[b].hi, p.data() + 8 * b + 4, 4);
    const size_t nb = BlockSize(n, b);
    const size_t kb = KeptIn(nb, code);
    const PositionPart part = PartOf(nb, kb);
    const size_t at = pos_bit + PositionBitOf(n, code, b);
    const size_t high = at + kb * part.low;
    for (size_t q = 0; q < part.high_bits; ++q) {
      if (Bit(p, high + q) == 0) continue;
      const size_t t = out[b].ones_in_high++;
      if (t >= kb) continue;
      const uint32_t h = static_cast<uint32_t>(q - t);
      out[b].positions.push_back(h << part.low |
                                 Field(p, at + t * part.low, part.low));
    }
    for (size_t t = 0; t < kb; ++t, ++j) {
      out[b].codes.push_back(Field(p, code_bit + code.bits * j, code.bits));
    }
  }
  return out;
}

// `p` with block b's positions written by the letter of the format (kb of
// them, their high parts non-decreasing), its other bits unchanged.
std::string WithPositions(std::string p, size_t n, SparseCode code, size_t b,
                          const std::vector<uint32_t>& positions) {
  const size_t nb = BlockSize(n, b);
  const size_t kb = KeptIn(nb, code);
  const PositionPart part = PartOf(nb, kb);
  const size_t at = 8 * 8 * NumBlocksOf(n) + PositionBitOf(n, code, b);
  auto set = [&](size_t k, uint32_t v) {
    const char mask = static_cast<char>(1u << (k % 8));
    p[k / 8] = v != 0 ? (p[k / 8] | mask) : (p[k / 8] & ~mask);
  };
  for (size_t k = 0; k < part.bits(kb); ++k) set(at + k, 0);
  for (size_t t = 0; t < kb; ++t) {
    for (unsigned k = 0; k < part.low; ++k) {
      set(at + t * part.low + k, (positions[t] >> k) & 1u);
    }
    set(at + kb * part.low + (positions[t] >> part.low) + t, 1);
  }
  return p;
}

// What the documented selection keeps of e (one block): the k values first
// in (bin descending, index ascending) order, as ascending positions.
std::vector<uint32_t> ReferenceKept(const std::vector<float>& e, size_t k) {
  std::vector<uint32_t> order(e.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  auto bin = [&](uint32_t i) { return (BitsOf(e[i]) & 0x7fffffffu) >> 20; };
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return bin(a) > bin(b); });
  order.resize(k);
  // Bin 0 (zeros and magnitudes below 2^-129) is never kept; a block with
  // nothing else keeps position 0 (as 0).
  order.erase(std::remove_if(order.begin(), order.end(),
                             [&](uint32_t i) { return bin(i) == 0; }),
              order.end());
  if (order.empty()) order.push_back(0);
  std::sort(order.begin(), order.end());
  return order;
}

float Level(float lo, float hi, uint32_t bits, uint32_t c) {
  const float levels = static_cast<float>(1u << (bits - 1));
  const float d = hi - lo;
  return lo + ((2.0f * c + 1.0f) / (2.0f * levels)) * d;
}

std::vector<float> Normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct Encoded {
  std::string payload;
  std::vector<float> residual, decoded;
};
Encoded Encode(const std::vector<float>& v, std::vector<float> residual,
               SparseCode code) {
  Encoded out;
  out.payload.assign(SparseWireBytes(v.size(), code), '\x5a');
  out.decoded.assign(v.size(), -1.0f);
  EncodeSparseWithFeedback(v, absl::MakeSpan(residual), code,
                           out.payload.data(), absl::MakeSpan(out.decoded));
  out.residual = std::move(residual);
  return out;
}

// Every claim of the format on one encoding of v (+ r0).
void CheckAgainstFormat(const std::vector<float>& v,
                        const std::vector<float>& r0, SparseCode code) {
  const size_t n = v.size();
  const Encoded enc = Encode(v, r0, code);
  ASSERT_TRUE(CheckSparse(enc.payload, n, code).ok())
      << CheckSparse(enc.payload, n, code);
  const std::vector<Block> blocks = Parse(enc.payload, n, code);
  const uint32_t levels = 1u << (code.bits - 1);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const size_t first = b * kSparseBlock;
    const size_t nb = std::min(kSparseBlock, n - first);
    std::vector<float> e(nb);
    for (size_t i = 0; i < nb; ++i) e[i] = v[first + i] + r0[first + i];
    const size_t kb = (code.keep * nb + kSparseBlock - 1) / kSparseBlock;
    SCOPED_TRACE(testing::Message() << "block " << b << " keeps " << kb);
    const Block& blk = blocks[b];
    // The kept values, then padding: the last position again, code 0.
    const std::vector<uint32_t> kept = ReferenceKept(e, kb);
    const size_t kv = kept.size();
    ASSERT_EQ(std::vector<uint32_t>(blk.positions.begin(),
                                    blk.positions.begin() + kv),
              kept);
    for (size_t t = kv; t < kb; ++t) {
      EXPECT_EQ(blk.positions[t], kept.back());
      EXPECT_EQ(blk.codes[t], 0u);
    }
    float lo = std::numeric_limits<float>::infinity(), hi = 0;
    for (uint32_t p : kept) {
      lo = std::min(lo, std::fabs(e[p]));
      hi = std::max(hi, std::fabs(e[p]));
    }
    if (kv == 1 && std::fabs(e[kept[0]]) < 1e-37f) lo = hi = 0;  // nothing
    EXPECT_TRUE(SameBits(blk.lo, lo));
    EXPECT_TRUE(SameBits(blk.hi, hi));
    std::vector<bool> is_kept(nb, false);
    for (size_t t = 0; t < kv; ++t) {
      const uint32_t p = blk.positions[t];
      const uint32_t c = blk.codes[t];
      is_kept[p] = true;
      const float m = Level(lo, hi, code.bits, c & (levels - 1));
      const float value = (c & levels) != 0 ? -m : m;
      // The sign is the value's; the level the nearest of the L (the step
      // is (hi - lo) / L: at most half of it away, and a hair for rounding).
      EXPECT_EQ((c & levels) != 0, std::signbit(e[p])) << "position " << p;
      EXPECT_LE(std::fabs(std::fabs(e[p]) - m),
                (hi - lo) / (2.0f * levels) * 1.0001f + 1e-30f)
          << "position " << p;
      EXPECT_TRUE(SameBits(enc.decoded[first + p], value)) << "position " << p;
      EXPECT_TRUE(SameBits(enc.residual[first + p], e[p] - value));
    }
    for (size_t i = 0; i < nb; ++i) {
      if (is_kept[i]) continue;
      EXPECT_TRUE(SameBits(enc.decoded[first + i], 0.0f)) << "element " << i;
      EXPECT_TRUE(SameBits(enc.residual[first + i], e[i])) << "element " << i;
    }
  }
  // The decoders agree with the encoder's decoding, bit for bit.
  std::vector<float> out(n, 7.0f);
  ASSERT_TRUE(DecodeSparse(enc.payload, code, absl::MakeSpan(out)).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(SameBits(out[i], enc.decoded[i])) << "element " << i;
  }
  std::vector<float> acc = Normal(n, 99);
  std::vector<float> expected = acc;
  for (size_t i = 0; i < n; ++i) {
    if (enc.decoded[i] != 0.0f) expected[i] += 0.375f * enc.decoded[i];
  }
  ASSERT_TRUE(
      AccumulateSparseWeighted(enc.payload, code, 0.375f, absl::MakeSpan(acc))
          .ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(SameBits(acc[i], expected[i])) << "element " << i;
  }
}

TEST(SparseCodecTest, SizesFollowTheFormat) {
  const SparseCode c2{64, 2};
  EXPECT_EQ(SparseKept(4096, c2), 64u);
  // 64 positions of 6 low bits and 63 + 64 high: 511 bits, 64 bytes.
  EXPECT_EQ(SparseWireBytes(4096, c2), 8u + 64u + 16u);  // 88 bytes
  // 256 kept: 4 low bits each and 255 + 256 high: 1535 bits.
  EXPECT_EQ(SparseWireBytes(4096, {256, 2}), 8u + 192u + 64u);
  // A partial block keeps its share, rounded up: 100 values -> 2 kept, 5
  // low bits each and (99 >> 5) + 2 high: 15 bits.
  EXPECT_EQ(SparseKept(4096 + 100, c2), 66u);
  EXPECT_EQ(SparseWireBytes(4096 + 100, c2), 16u + (511 + 15 + 7) / 8 + 17u);
  EXPECT_EQ(SparseKept(1, c2), 1u);
  EXPECT_EQ(SparseKept(0, c2), 0u);
  EXPECT_EQ(SparseWireBytes(0, c2), 0u);
  // Odd counts: positions and codes end mid-byte (3 kept: 10 low bits
  // each and 3 + 3 high, 36 bits a block).
  const SparseCode c4{3, 4};
  EXPECT_EQ(SparseKept(3 * 4096, c4), 9u);
  EXPECT_EQ(SparseWireBytes(3 * 4096, c4), 24u + 14u + 5u);
  // Everything: no low bits, 4095 + 4096 high bits (entry t's one at 2t).
  EXPECT_EQ(SparseKept(4096, {4096, 2}), 4096u);
  EXPECT_EQ(SparseWireBytes(4096, {4096, 2}), 8u + 1024u + 1024u);
  // One kept: 12 low bits and 1 high.
  EXPECT_EQ(SparseWireBytes(4096, {1, 2}), 8u + 2u + 1u);
}

TEST(SparseCodecTest, ValidatesTheCode) {
  EXPECT_TRUE(ValidateSparseCode({1, 2}).ok());
  EXPECT_TRUE(ValidateSparseCode({4096, 4}).ok());
  EXPECT_THAT(ValidateSparseCode({0, 2}).message(), HasSubstr("[1, 4096]"));
  EXPECT_THAT(ValidateSparseCode({4097, 2}).message(), HasSubstr("[1, 4096]"));
  EXPECT_THAT(ValidateSparseCode({64, 3}).message(), HasSubstr("2 or 4"));
  EXPECT_THAT(CheckSparse("", 0, {64, 8}).message(), HasSubstr("2 or 4"));
}

TEST(SparseCodecTest, NormalValuesWithFeedback_MatchTheFormat) {
  for (SparseCode code : {SparseCode{64, 2}, SparseCode{41, 4},
                          SparseCode{1, 2}, SparseCode{4096, 4}}) {
    for (size_t n :
         {size_t{1}, size_t{7}, size_t{4096}, size_t{3 * 4096 + 5}}) {
      SCOPED_TRACE(testing::Message() << "keep " << code.keep << " bits "
                                      << code.bits << " n " << n);
      CheckAgainstFormat(Normal(n, 1 + n), Normal(n, 2 + n, 0.1f), code);
    }
  }
}

TEST(SparseCodecTest, TiesAndEdges_MatchTheFormat) {
  const size_t n = 2 * 4096 + 300;
  // Many values in one bin (ties broken by index), zeros, -0, subnormals,
  // the float32 limit, all-equal magnitudes of both signs.
  std::vector<float> v(n, 0.0f);
  for (size_t i = 0; i < 4096; ++i) v[i] = (i % 3 == 0) ? 1.0f : -1.01f;
  for (size_t i = 4096; i < 8192; ++i) {
    v[i] = (i % 5 == 0) ? std::numeric_limits<float>::denorm_min() * (i % 7)
                        : -0.0f;
  }
  v[5000] = std::numeric_limits<float>::max();
  v[5001] = -std::numeric_limits<float>::max();
  for (size_t i = 8192; i < n; ++i) v[i] = (i % 2 == 0) ? 3.0f : -3.0f;
  const std::vector<float> none(n, 0.0f);
  for (SparseCode code : {SparseCode{64, 2}, SparseCode{200, 4}}) {
    CheckAgainstFormat(v, none, code);
  }
  // A block of zeros keeps position 0, as 0, then pads.
  std::vector<float> zeros(4096, 0.0f);
  const Encoded enc = Encode(zeros, zeros, {5, 2});
  EXPECT_THAT(Parse(enc.payload, 4096, {5, 2})[0].positions,
              testing::ElementsAre(0u, 0u, 0u, 0u, 0u));
  for (float x : enc.decoded) EXPECT_EQ(x, 0.0f);
  // A block with fewer non-zero values than it keeps: those, then padding
  // (a mean of a few sparse uploads, re-encoded with a larger keep).
  std::vector<float> few(4096, 0.0f);
  few[7] = 1.0f;
  few[900] = -3.0f;
  const Encoded some = Encode(few, std::vector<float>(4096, 0.0f), {4, 2});
  const Block blk = Parse(some.payload, 4096, {4, 2})[0];
  EXPECT_THAT(blk.positions, testing::ElementsAre(7u, 900u, 900u, 900u));
  EXPECT_THAT(blk.codes, testing::ElementsAre(0u, 3u, 0u, 0u));
  EXPECT_EQ(blk.lo, 1.0f);
  EXPECT_EQ(blk.hi, 3.0f);
  EXPECT_TRUE(CheckSparse(some.payload, 4096, {4, 2}).ok());
  for (size_t i = 0; i < 4096; ++i) {
    if (i != 7 && i != 900) {
      ASSERT_EQ(some.decoded[i], 0.0f) << i;
    }
  }
  EXPECT_EQ(some.decoded[7], 1.5f);     // lo + (hi - lo) / 4
  EXPECT_EQ(some.decoded[900], -2.5f);  // -(lo + 3 (hi - lo) / 4)
}

TEST(SparseCodecTest, NonFiniteBlock_FlaggedByNaNScales) {
  std::vector<float> v = Normal(2 * 4096, 5);
  v[4096 + 17] = std::numeric_limits<float>::infinity();
  std::vector<float> r(v.size(), 0.0f);
  const Encoded enc = Encode(v, r, {8, 2});
  ASSERT_TRUE(CheckSparse(enc.payload, v.size(), {8, 2}).ok());
  const std::vector<Block> blocks = Parse(enc.payload, v.size(), {8, 2});
  EXPECT_FALSE(std::isnan(blocks[0].lo));
  EXPECT_TRUE(std::isnan(blocks[1].lo) && std::isnan(blocks[1].hi));
  EXPECT_THAT(blocks[1].positions,
              testing::ElementsAre(0u, 1u, 2u, 3u, 4u, 5u, 6u, 7u));
  EXPECT_THAT(blocks[1].codes, testing::Each(0u));
  EXPECT_TRUE(std::isnan(enc.decoded[4096]));
  EXPECT_TRUE(std::isnan(enc.residual[4096]));
  EXPECT_EQ(enc.residual[4096 + 8], v[4096 + 8]);  // not kept: carried
  EXPECT_EQ(SparseFirstNonFinite(enc.payload, v.size(), {8, 2}), 4096);
  std::vector<float> out(v.size());
  ASSERT_TRUE(DecodeSparse(enc.payload, {8, 2}, absl::MakeSpan(out)).ok());
  EXPECT_TRUE(std::isnan(out[4096 + 7]));
  EXPECT_EQ(out[4096 + 8], 0.0f);
  // The guard's bound counts the finite block alone.
  const float top = Level(blocks[0].lo, blocks[0].hi, 2, 1);
  EXPECT_EQ(SparseMaxAbs(enc.payload, v.size(), {8, 2}), top);
  EXPECT_GE(top, blocks[0].lo);  // the middle of the top step
  EXPECT_LE(top, blocks[0].hi);
}

// A NaN value, a NaN carried in the residual, and a finite value plus a
// finite residual that overflows: each flags its block alone.
TEST(SparseCodecTest, NonFiniteFromValuesResidualOrOverflow) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float big = std::numeric_limits<float>::max();
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE(which);
    std::vector<float> v = Normal(3 * 4096, 61);
    std::vector<float> r(v.size(), 0.0f);
    const size_t at = 4096 + 1234;
    if (which == 0) v[at] = nan;
    if (which == 1) r[at] = nan;
    if (which == 2) v[at] = r[at] = big;
    const Encoded enc = Encode(v, r, {16, 4});
    ASSERT_TRUE(CheckSparse(enc.payload, v.size(), {16, 4}).ok());
    EXPECT_EQ(SparseFirstNonFinite(enc.payload, v.size(), {16, 4}), 4096);
    const std::vector<Block> blocks = Parse(enc.payload, v.size(), {16, 4});
    EXPECT_FALSE(std::isnan(blocks[0].lo) || std::isnan(blocks[2].lo));
    EXPECT_TRUE(std::isnan(blocks[1].lo) && std::isnan(blocks[1].hi));
  }
}

// Error feedback loses nothing: over R rounds of the same values, what was
// sent plus what is held back is R x the values, and what is held back
// stays bounded (a value is sent once it grows to the kept magnitudes).
TEST(SparseCodecTest, ErrorFeedback_SentPlusResidualIsTheSum) {
  const size_t n = 4096;
  const std::vector<float> v = Normal(n, 11);
  std::vector<float> r(n, 0.0f), sent(n, 0.0f);
  std::string payload(SparseWireBytes(n, {64, 2}), '\0');
  std::vector<float> decoded(n);
  const int rounds = 400;
  for (int t = 0; t < rounds; ++t) {
    EncodeSparseWithFeedback(v, absl::MakeSpan(r), {64, 2}, payload.data(),
                             absl::MakeSpan(decoded));
    for (size_t i = 0; i < n; ++i) sent[i] += decoded[i];
  }
  double worst = 0, sum_abs = 0, max_abs = 0;
  for (float x : v) {
    sum_abs += std::fabs(x);
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
  }
  for (size_t i = 0; i < n; ++i) {
    // sent + r == rounds * v up to float rounding of the sums.
    EXPECT_NEAR(sent[i] + r[i], rounds * v[i], 1e-3 * rounds) << i;
    worst = std::max(worst, std::fabs(static_cast<double>(r[i])));
  }
  // What is held back drains at 64 values a round: in the steady state a
  // value is sent once it reaches about sum|v| / 64 (the inflow per round
  // over the values sent), plus one round's value and the step of a level.
  EXPECT_LT(worst, 2 * sum_abs / 64 + max_abs);
}

TEST(SparseCodecTest, DeltaEncoder_BitForBitSubtractThenEncode) {
  const size_t n = 3 * 4096 + 77;
  const std::vector<float> params = Normal(n, 21), anchor = Normal(n, 22);
  std::vector<float> delta(n);
  for (size_t i = 0; i < n; ++i) delta[i] = params[i] - anchor[i];
  for (SparseCode code : {SparseCode{64, 2}, SparseCode{128, 4}}) {
    std::vector<float> r1 = Normal(n, 23, 0.2f), r2 = r1;
    std::string a(SparseWireBytes(n, code), '\0'), b = a;
    EncodeSparseWithFeedback(delta, absl::MakeSpan(r1), code, a.data());
    EncodeSparseDeltaWithFeedback(params, anchor, absl::MakeSpan(r2), code,
                                  b.data());
    EXPECT_EQ(a, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(SameBits(r1[i], r2[i])) << i;
  }
}

TEST(SparseCodecTest, WithoutResidual_DecodedInPlace) {
  std::vector<float> v = Normal(5000, 31);
  const std::vector<float> original = v;
  std::string payload(SparseWireBytes(v.size(), {64, 4}), '\0');
  EncodeSparseWithFeedback(v, {}, {64, 4}, payload.data(), absl::MakeSpan(v));
  std::vector<float> again(v.size());
  ASSERT_TRUE(DecodeSparse(payload, {64, 4}, absl::MakeSpan(again)).ok());
  size_t kept = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_TRUE(SameBits(v[i], again[i]));
    kept += v[i] != 0.0f;
  }
  EXPECT_EQ(kept, SparseKept(v.size(), {64, 4}));
}

// decoded == values with a residual: e goes through the residual's memory.
TEST(SparseCodecTest, DecodedInPlaceWithResidual_SameAsApart) {
  const std::vector<float> v = Normal(4096 + 9, 33);
  const std::vector<float> r0 = Normal(v.size(), 34, 0.3f);
  const Encoded apart = Encode(v, r0, {64, 2});
  std::vector<float> in_place = v, r = r0;
  std::string payload(SparseWireBytes(v.size(), {64, 2}), '\0');
  EncodeSparseWithFeedback(in_place, absl::MakeSpan(r), {64, 2}, payload.data(),
                           absl::MakeSpan(in_place));
  EXPECT_EQ(payload, apart.payload);
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_TRUE(SameBits(in_place[i], apart.decoded[i])) << i;
    ASSERT_TRUE(SameBits(r[i], apart.residual[i])) << i;
  }
}

TEST(SparseCodecTest, NoValues) {
  std::vector<float> none;
  EncodeSparseWithFeedback(none, {}, {64, 2}, nullptr);
  EXPECT_TRUE(CheckSparse("", 0, {64, 2}).ok());
  EXPECT_TRUE(DecodeSparse("", {64, 2}, absl::MakeSpan(none)).ok());
  EXPECT_EQ(SparseFirstNonFinite("", 0, {64, 2}), -1);
  EXPECT_EQ(SparseMaxAbs("", 0, {64, 2}), 0.0f);
}

// The decoders refuse what they cannot read, change nothing then, and stay
// within the output on any bytes of the right size.
TEST(SparseCodecTest, Decoders_SafeOnAnyInput) {
  const size_t n = 4096 + 100;
  const std::string good =
      Encode(Normal(n, 51), std::vector<float>(n, 0.0f), {64, 2}).payload;
  std::vector<float> out(n, 5.0f);
  EXPECT_FALSE(
      DecodeSparse(good, {64, 2}, absl::MakeSpan(out).subspan(0, 4096)).ok());
  EXPECT_FALSE(DecodeSparse(good, {64, 3}, absl::MakeSpan(out)).ok());
  EXPECT_FALSE(AccumulateSparseWeighted(good.substr(1), {64, 2}, 1.0f,
                                        absl::MakeSpan(out))
                   .ok());
  EXPECT_THAT(out, testing::Each(5.0f));
  // Every bit of the positions set: each block's high parts hold more
  // entries than it has (the first kb read, each at high part 0 with every
  // low bit set: block 0 at 63 again and again, block 1 at 31); decoded
  // as those, the repeats as padding.
  std::string bad = good;
  const size_t codes = (2 * 66 + 7) / 8;
  std::fill(bad.begin() + 16, bad.end() - codes, '\xff');
  EXPECT_THAT(CheckSparse(bad, n, {64, 2}).message(),
              HasSubstr("high parts hold 127 entries; the block has 64"));
  std::vector<float> acc(n, 0.0f);
  EXPECT_TRUE(
      AccumulateSparseWeighted(bad, {64, 2}, 1.0f, absl::MakeSpan(acc)).ok());
  for (size_t i = 0; i < n; ++i) {
    if (i != 63 && i != 4096 + 31) {
      EXPECT_EQ(acc[i], 0.0f) << i;
    }
  }
  EXPECT_NE(acc[63], 0.0f);
  // A position past a partial block's end (100 values, 5 low bits: high
  // part 3 and low 31 is 127): skipped.
  const uint32_t first1 = Parse(good, n, {64, 2})[1].positions[0];
  ASSERT_LT(first1, 96u);
  const std::string past = WithPositions(good, n, {64, 2}, 1, {first1, 127});
  std::fill(acc.begin(), acc.end(), 0.0f);
  EXPECT_TRUE(
      AccumulateSparseWeighted(past, {64, 2}, 1.0f, absl::MakeSpan(acc)).ok());
  EXPECT_EQ(acc.size(), n);
  EXPECT_NE(acc[4096 + first1], 0.0f);
}

// Hostile payloads: each refused with what and where, from a good one.
TEST(SparseCodecTest, CheckSparse_RefusesMalformedPayloads) {
  const size_t n = 4096 + 100;
  const SparseCode code{64, 2};
  const std::string good =
      Encode(Normal(n, 41), std::vector<float>(n, 0.0f), code).payload;
  ASSERT_TRUE(CheckSparse(good, n, code).ok());
  auto put_float = [](std::string s, size_t at, float f) {
    std::memcpy(s.data() + at, &f, 4);
    return s;
  };
  // Sizes: truncated, one byte too many, the wrong element count.
  EXPECT_THAT(CheckSparse(good.substr(0, good.size() - 1), n, code).message(),
              HasSubstr("takes " + std::to_string(good.size())));
  EXPECT_FALSE(CheckSparse(good + '\0', n, code).ok());
  EXPECT_FALSE(CheckSparse(good, n + 4096, code).ok());
  EXPECT_FALSE(CheckSparse(good, n, {65, 2}).ok());
  // Scales: negative, lo > hi, infinite, one NaN, both NaN (allowed).
  EXPECT_THAT(CheckSparse(put_float(good, 0, -1.0f), n, code).message(),
              HasSubstr("sparse block 0 has scales"));
  EXPECT_THAT(CheckSparse(put_float(good, 8, 1e30f), n, code).message(),
              HasSubstr("sparse block 1"));  // lo above hi
  EXPECT_FALSE(
      CheckSparse(put_float(good, 4, std::numeric_limits<float>::infinity()), n,
                  code)
          .ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(CheckSparse(put_float(good, 4, nan), n, code).ok());
  EXPECT_TRUE(
      CheckSparse(put_float(put_float(good, 0, nan), 4, nan), n, code).ok());
  // Positions: the second equal to the first, out of order, past the end
  // of the (partial) last block, more or fewer entries than the block has.
  const std::vector<Block> blocks = Parse(good, n, code);
  ASSERT_EQ(blocks[0].ones_in_high, 64u);
  ASSERT_EQ(blocks[0].positions.size(), 64u);
  auto with_positions = [&](size_t b, std::vector<uint32_t> positions) {
    return WithPositions(good, n, code, b, positions);
  };
  std::vector<uint32_t> p0 = blocks[0].positions;
  // A repeated position is padding: its code must be 0 and no kept value
  // may follow it in its block (one of the two, whichever the code is).
  std::vector<uint32_t> repeated = p0;
  repeated[1] = repeated[0];
  EXPECT_THAT(
      std::string(CheckSparse(with_positions(0, repeated), n, code).message()),
      HasSubstr("padding"));
  // Out of order within one high part (64 positions of 6 low bits: the
  // high part is the position's 64-value stretch).
  std::vector<uint32_t> swapped = p0;
  const uint32_t stretch = p0[1] & ~63u;
  swapped[0] = stretch | 5;
  swapped[1] = stretch | 3;
  EXPECT_THAT(
      std::string(CheckSparse(with_positions(0, swapped), n, code).message()),
      HasSubstr("entry 1 is at position " + std::to_string(stretch | 3) +
                ", before the one before"));
  EXPECT_THAT(
      CheckSparse(with_positions(1, {blocks[1].positions[0], 127}), n, code)
          .message(),
      HasSubstr("sparse block 1 (100 values): entry 1 is at position 127, "
                "past the block's end"));
  // One more one in block 0's high parts (a zero of them set), and one
  // fewer (a one cleared).
  auto flip = [&](size_t bit) {
    std::string s = good;
    s[16 + bit / 8] = static_cast<char>(s[16 + bit / 8] ^ (1u << (bit % 8)));
    return s;
  };
  const size_t high0 = 64 * 6;
  size_t a_zero = high0;
  while (Bit(good, 8 * 16 + a_zero) == 1) ++a_zero;
  EXPECT_THAT(CheckSparse(flip(a_zero), n, code).message(),
              HasSubstr("sparse block 0 (4096 values): its positions' high "
                        "parts hold 65 entries; the block has 64"));
  size_t a_one = high0;
  while (Bit(good, 8 * 16 + a_one) == 0) ++a_one;
  EXPECT_THAT(CheckSparse(flip(a_one), n, code).message(),
              HasSubstr("hold 63 entries"));
  // Padding bits: 66 codes of 2 bits end mid-byte.
  std::string padded = good;
  padded.back() = static_cast<char>(padded.back() | 0x80);
  EXPECT_THAT(CheckSparse(padded, n, code).message(), HasSubstr("padding"));
  // 3 positions of 36 bits end mid-byte too (byte 8 + 4 holds the last
  // 4 bits of the high parts and 4 padding bits).
  const std::string three =
      Encode(Normal(4096, 43), std::vector<float>(4096, 0.0f), {3, 2}).payload;
  ASSERT_EQ(three.size(), 8u + 5u + 1u);
  ASSERT_TRUE(CheckSparse(three, 4096, {3, 2}).ok());
  std::string bad_pad = three;
  bad_pad[12] = static_cast<char>(bad_pad[12] | 0x80);
  EXPECT_THAT(CheckSparse(bad_pad, 4096, {3, 2}).message(),
              HasSubstr("padding"));
}

}  // namespace
}  // namespace localsgd
