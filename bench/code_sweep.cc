// code_sweep: the 4-bit blockwise code's block size and value code, chosen
// by measurement. Candidates: blocks of 32, 64 and 128 elements (one
// float32 scale each: 0.625, 0.5625 and 0.53125 bytes an element), and
// three sets of 4-bit values, scaled by the block's largest |value|:
//   uniform  k / 7, k = -7..7 (the int4 wire's code, src/codec.h);
//   nf4      the normal-float levels of QLoRA (arXiv 2305.14314): the
//            quantiles of N(0, 1) scaled to [-1, 1], 7 below 0, 8 above;
//   e2m1     the values of fp4 e2m1 (the element set of OCP MX fp4, here
//            with a float32 absmax scale): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} / 6.
// Every candidate encodes with error feedback as the wire does (e = delta +
// residual; each value to its nearest level times the block's max |e|;
// residual = e - decoded). One encoder stands for the path: every member
// sends the same update, so the coordinator's mean is on the members' grid
// and its own residual stays 0 (bench/small_updates.cc says why); the
// "int4 wire" row runs the project's encoder (EncodeWithFeedback, blocks
// of 64) on the same inputs as a check of the model's "uniform 64".
//
// Two scenarios, theta ~ N(0, 1) (n parameters, --seed; or Student's t
// with 3 degrees of freedom, --distribution=t3, theta and the noise z):
//  (A) small updates (bench/small_updates.cc): every round parameter i is
//      meant to move by u_i = --relative * |theta0_i| * s_i, s_i a random
//      sign drawn once. Reported: the parameters still below 50% of their
//      intended movement after 10 and after --rounds rounds, and their lag
//      (the largest shortfall over the rounds, in rounds of their own
//      update: how long a small movement waits in the residual), median,
//      p90 and p99 over all parameters.
//  (B) noisy pseudo-gradients: every round a fresh update u_i(r) =
//      --relative * |theta0_i| * (--drift * s_i + z), z ~ N(0, 1), so that
//      most of a round's update is noise and the signal is what adds up.
//      Reported: the mean over rounds of one round's error |decoded - u| /
//      |u| (L2 norms over all parameters), and after --rounds
//      rounds the error of the total movement against the total intended,
//      |sum decoded - sum u| / |sum u| (what feedback still owes: the
//      residual).
//
// Output: markdown tables on stdout. Not part of ctest.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "src/codec.h"
#include "src/types.h"

ABSL_FLAG(int64_t, n, 1 << 20, "Parameters.");
ABSL_FLAG(int32_t, rounds, 40, "Rounds.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of theta ~ N(0, 1), signs and noise.");
ABSL_FLAG(double, relative, 1e-3,
          "Each round's update of a parameter, relative to its |theta0|.");
ABSL_FLAG(std::string, distribution, "normal",
          "theta0 and scenario B's noise: normal (N(0, 1)) or t3 (Student's "
          "t with 3 degrees of freedom: heavy tails).");
ABSL_FLAG(double, drift, 0.2,
          "Scenario B: the steady part of an update against its noise "
          "(drawn from --distribution).");

namespace localsgd {
namespace {

struct Code {
  std::string name;
  std::vector<float> levels;  // ascending, the largest |level| is 1
};

std::vector<Code> Codes() {
  Code uniform{"uniform", {}};
  for (int k = -7; k <= 7; ++k) uniform.levels.push_back(k / 7.0f);
  // QLoRA's NF4 table.
  Code nf4{"nf4",
           {-1.0f, -0.6961928f, -0.5250731f, -0.3949175f, -0.2844414f,
            -0.18477343f, -0.0910500f, 0.0f, 0.0795803f, 0.1609302f, 0.2461123f,
            0.3379152f, 0.4407098f, 0.5626170f, 0.7229568f, 1.0f}};
  Code e2m1{"e2m1", {}};
  const float mags[] = {6, 4, 3, 2, 1.5f, 1, 0.5f};
  for (float m : mags) e2m1.levels.push_back(-m / 6);
  e2m1.levels.push_back(0);
  for (int i = 6; i >= 0; --i) e2m1.levels.push_back(mags[i] / 6);
  return {uniform, nf4, e2m1};
}

// Draws from --distribution.
class Draw {
 public:
  Draw(bool t3, uint64_t seed) : t3_(t3), rng_(seed) {}
  double operator()() { return t3_ ? student_(rng_) : normal_(rng_); }

 private:
  bool t3_;
  std::mt19937_64 rng_;
  std::normal_distribution<double> normal_{0.0, 1.0};
  std::student_t_distribution<double> student_{3.0};
};

// One candidate encoder with error feedback: `values` + `residual`, each
// block of `block` scaled by its largest |e|, every value to its nearest
// level; `decoded` gets what the receiver adds, `residual` what is left.
void EncodeCandidate(const Code& code, size_t block,
                     absl::Span<const float> values, absl::Span<float> residual,
                     absl::Span<float> decoded) {
  const std::vector<float>& lv = code.levels;
  // Midpoints between neighbouring levels: a value goes to the level whose
  // interval holds it.
  std::vector<float> mid(lv.size() - 1);
  for (size_t j = 0; j + 1 < lv.size(); ++j) mid[j] = (lv[j] + lv[j + 1]) / 2;
  std::vector<float> e(block);
  for (size_t first = 0; first < values.size(); first += block) {
    const size_t len = std::min(block, values.size() - first);
    float max = 0;
    for (size_t i = 0; i < len; ++i) {
      e[i] = values[first + i] + residual[first + i];
      max = std::max(max, std::fabs(e[i]));
    }
    for (size_t i = 0; i < len; ++i) {
      float d = 0;
      if (max > 0) {
        const float t = e[i] / max;
        const size_t j =
            std::upper_bound(mid.begin(), mid.end(), t) - mid.begin();
        d = lv[j] * max;
      }
      decoded[first + i] = d;
      residual[first + i] = e[i] - d;
    }
  }
}

struct Candidate {
  std::string name;
  double bytes_per_element = 0;
  // Encodes values with residual into decoded.
  std::function<void(absl::Span<const float>, absl::Span<float>,
                     absl::Span<float>)>
      encode;
};

struct ResultA {
  double below50_early = 0, below50_last = 0;  // shares
  float lag_p50 = 0, lag_p90 = 0, lag_p99 = 0;
};

struct ResultB {
  double round_error = 0;  // mean over rounds
  double total_error = 0;  // after the last round
};

// The p-quantile (0..1) of `v` (reordered), nearest rank.
float Quantile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(
      v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - (p > 0));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

ResultA RunSmallUpdates(const Candidate& c, const std::vector<float>& u,
                        int rounds) {
  const size_t n = u.size();
  std::vector<float> residual(n, 0.0f), decoded(n), moved(n, 0.0f), lag;
  lag.reserve(n);
  std::vector<float> lag_of(n, 0.0f);
  ResultA r;
  const int early = std::min(10, rounds);
  for (int round = 1; round <= rounds; ++round) {
    c.encode(u, absl::MakeSpan(residual), absl::MakeSpan(decoded));
    int64_t below = 0;
    for (size_t k = 0; k < n; ++k) {
      moved[k] += decoded[k];
      const double step = std::fabs(static_cast<double>(u[k]));
      if (step == 0) continue;  // --relative below float32's range
      const double m = moved[k] * (u[k] > 0 ? 1.0 : -1.0);
      if (m < 0.5 * round * step) ++below;
      lag_of[k] = std::max(lag_of[k], static_cast<float>(round - m / step));
    }
    if (round == early) r.below50_early = static_cast<double>(below) / n;
    if (round == rounds) r.below50_last = static_cast<double>(below) / n;
  }
  for (size_t k = 0; k < n; ++k) {
    if (u[k] != 0) lag.push_back(lag_of[k]);
  }
  r.lag_p50 = Quantile(lag, 0.5);
  r.lag_p90 = Quantile(lag, 0.9);
  r.lag_p99 = Quantile(lag, 0.99);
  return r;
}

ResultB RunNoisy(const Candidate& c, const std::vector<float>& theta0,
                 const std::vector<float>& sign, int rounds, double relative,
                 double drift, bool t3, uint64_t seed) {
  const size_t n = theta0.size();
  Draw noise(t3, seed * 7919 + 17);
  std::vector<float> u(n), residual(n, 0.0f), decoded(n);
  std::vector<double> sum_u(n, 0.0), sum_d(n, 0.0);
  ResultB r;
  for (int round = 1; round <= rounds; ++round) {
    for (size_t k = 0; k < n; ++k) {
      u[k] = static_cast<float>(relative * std::fabs(theta0[k]) *
                                (drift * sign[k] + noise()));
    }
    c.encode(u, absl::MakeSpan(residual), absl::MakeSpan(decoded));
    double err = 0, norm = 0;
    for (size_t k = 0; k < n; ++k) {
      const double d = static_cast<double>(decoded[k]) - u[k];
      err += d * d;
      norm += static_cast<double>(u[k]) * u[k];
      sum_u[k] += u[k];
      sum_d[k] += decoded[k];
    }
    r.round_error += std::sqrt(err / norm) / rounds;
  }
  double err = 0, norm = 0;
  for (size_t k = 0; k < n; ++k) {
    err += (sum_d[k] - sum_u[k]) * (sum_d[k] - sum_u[k]);
    norm += sum_u[k] * sum_u[k];
  }
  r.total_error = std::sqrt(err / norm);
  return r;
}

}  // namespace
}  // namespace localsgd

int main(int argc, char** argv) {
  using namespace localsgd;
  absl::SetProgramUsageMessage(
      "The 4-bit block code's block size and value code by measurement:\n"
      "  code_sweep --n=1048576 --rounds=40 --seed=1 --relative=1e-3 "
      "--drift=0.2 --distribution=normal");
  absl::ParseCommandLine(argc, argv);
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const double relative = absl::GetFlag(FLAGS_relative);
  const double drift = absl::GetFlag(FLAGS_drift);
  const std::string distribution = absl::GetFlag(FLAGS_distribution);
  if (n < 128 || rounds < 1 || !(relative > 0) || !(drift >= 0) ||
      (distribution != "normal" && distribution != "t3")) {
    std::fprintf(stderr,
                 "code_sweep: need --n >= 128, --rounds >= 1, --relative > 0, "
                 "--drift >= 0, --distribution normal or t3\n");
    return 2;
  }
  const bool t3 = distribution == "t3";

  Draw draw(t3, seed);
  std::mt19937_64 rng(seed + 1);
  std::vector<float> theta0(n), sign(n), u(n);
  for (int64_t k = 0; k < n; ++k) theta0[k] = static_cast<float>(draw());
  for (int64_t k = 0; k < n; ++k) {
    sign[k] = (rng() & 1) ? 1.0f : -1.0f;
    u[k] = sign[k] * static_cast<float>(relative) * std::fabs(theta0[k]);
  }

  std::vector<Candidate> candidates;
  for (const Code& code : Codes()) {
    for (size_t block : {32, 64, 128}) {
      candidates.push_back(Candidate{
          absl::StrFormat("%s %d", code.name, block), 0.5 + 4.0 / block,
          [code, block](absl::Span<const float> v, absl::Span<float> r,
                        absl::Span<float> d) {
            EncodeCandidate(code, block, v, r, d);
          }});
    }
  }
  std::vector<char> payload(WireBytes(DType::kInt4Block, n));
  candidates.push_back(Candidate{
      absl::StrFormat("int4 wire (%d)", kQuantBlock), 0.5 + 4.0 / kQuantBlock,
      [&payload](absl::Span<const float> v, absl::Span<float> r,
                 absl::Span<float> d) {
        EncodeWithFeedback(v, r, WireCode{DType::kInt4Block}, payload.data(),
                           d);
      }});

  std::printf(
      "code_sweep: n=%lld rounds=%d seed=%llu relative=%g drift=%g "
      "distribution=%s\n\n",
      static_cast<long long>(n), rounds, static_cast<unsigned long long>(seed),
      relative, drift, distribution.c_str());
  std::printf(
      "| code, block | bytes/element | (A) below 50%% after %d | after %d | "
      "lag p50 | p90 | p99 | (B) one round's error | total's error after %d "
      "|\n",
      std::min(10, rounds), rounds, rounds);
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Candidate& c : candidates) {
    const ResultA a = RunSmallUpdates(c, u, rounds);
    const ResultB b =
        RunNoisy(c, theta0, sign, rounds, relative, drift, t3, seed);
    // A lag of `rounds` or more: not moved (or moved backwards) by the end.
    auto lag = [rounds](float l) {
      return l >= rounds ? absl::StrFormat(">= %d", rounds)
                         : absl::StrFormat("%.3g", l);
    };
    std::printf(
        "| %s | %.6g | %.2f%% | %.2f%% | %s | %s | %s | %.3f | %.4f |\n",
        c.name.c_str(), c.bytes_per_element, 100 * a.below50_early,
        100 * a.below50_last, lag(a.lag_p50).c_str(), lag(a.lag_p90).c_str(),
        lag(a.lag_p99).c_str(), b.round_error, b.total_error);
    std::fflush(stdout);
  }
  return 0;
}
