// small_updates: how late small pseudo-gradient updates arrive with the
// lossy wire encodings, per parameter, as a function of the parameter's
// ratio to the largest value of its 64-element block.
//
// The path is the one a pseudo-gradient takes, through the project's own
// code, no network:
//   - W members (client/member_state.h MemberState, as the client keeps it):
//     each holds the anchor and its parameters, adds this round's update to
//     its parameters, and encodes each chunk of params - anchor with its
//     error feedback (MemberState::EncodeChunk -> EncodeWithFeedback with
//     the member's residual);
//   - the coordinator (src/round.h RoundAccumulator, src/state_commit.h
//     StateCommit, as src/job.cc drives them): the payloads accumulated
//     with weight 1 each, the round's MEAN, encoded for the download with
//     the coordinator's residual (StateCommit::FinalizeChunk), the new state
//     = old + decoded, committed;
//   - every member decodes the global delta onto its anchor
//     (DecodeOnto(delta, anchor) into MemberState::ResultSlice, as
//     client/sync_stream.cc does) and commits the Sync (the residual carries
//     on, the anchor becomes the parameters). The members' parameters are
//     checked bit for bit against the coordinator's state every round.
//
// The scenario: theta ~ N(0, 1) (n parameters, --seed), and every round
// every member's intended update of parameter i is
//   u_i = --relative * |theta0_i| * s_i,
// with theta0 the initial weights (so that u_i, and its ratio to its
// block's largest, stay fixed over the rounds; over 40 rounds of 1e-3,
// |theta| changes by at most 4%) and s_i a random sign per parameter, drawn
// once (the block codes are symmetric: the sign changes nothing but the
// direction). Every member adds the same u, so the MEAN is u: after r
// rounds parameter i should have moved by r |u_i| in the direction s_i.
//
// Reported, per wire dtype:
//  (a) after 5, 10, 20, 40 rounds (those <= --rounds): the fraction of
//      parameters whose movement (in the intended direction) is below 50%
//      and below 90% of the intended r |u_i|, and above 150%;
//  (b) the lag of each parameter: L_i = max over rounds r <= R of
//      (r - m_i(r) / |u_i|), m_i(r) its movement after round r. At every
//      round the parameter has moved at least as far as it was meant to by
//      round r - L_i; L_i is what error feedback still owed it at the worst
//      moment, in rounds of its own update (a parameter that never moved
//      has L_i = R: its true lag is R or more). Bucketed by
//      x_i = |u_i| / max_{j in i's block} |u_j|: the share of parameters,
//      median, p99 and max of L_i, the theory's lag 1/(2 x q), and the
//      largest L_i against the bound 1/((2q - 1) x).
//
// The theory (int8: q = 127, int4: q = 7). A block's code step is its
// largest |value + residual| / q, about max |u| / q. Whatever an encoding
// drops stays in the encoder's residual, and rounding to the nearest code
// leaves at most half a step there: what a parameter is still owed after
// any round is what the member's and the coordinator's residuals hold for
// it, at most half a step of each. Here every member sends the same values,
// so the mean the coordinator encodes is already on the members' grid and
// its residual stays ~0. A parameter of ratio x gets its first nonzero code
// after about 1/(2 x q) rounds (until then it does not move at all), and
// then one code step (1/(x q) rounds' worth) about every 1/(x q) rounds:
// its movement is a staircase around the intended line, about 1/(2 x q)
// rounds behind it at worst and as far ahead. Precisely, the block's
// largest |u + residual| exceeds max |u| by at most half the previous
// step, so the step is at most max |u| / (q - 1/2) and the lag at most
// half of it: L <= 1/((2q - 1) x) rounds (Bound below). Nothing is lost:
// the shortfall stays bounded, so the relative error of the movement goes
// to 0 as rounds pass. The bench counts the parameters whose lag exceeds
// ceil(1/((2q - 1) x)) + 1 (a round of slack for float32 rounding, ~1e-4
// rounds a round); any makes the exit status 1.
//
// Output: markdown tables on stdout, timings on stderr.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/member_state.h"
#include "src/codec.h"
#include "src/job_types.h"
#include "src/layout.h"
#include "src/round.h"
#include "src/settings.h"
#include "src/state_commit.h"
#include "src/types.h"

ABSL_FLAG(int64_t, n, 1000000, "Parameters.");
ABSL_FLAG(int32_t, rounds, 40, "Rounds.");
ABSL_FLAG(int32_t, members, 2, "Members (each sends the same update).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of theta ~ N(0, 1) and of the signs.");
ABSL_FLAG(std::string, wire, "int8,int4,bfloat16,float32",
          "Wire dtypes, comma-separated (as --wire_dtype takes them).");
ABSL_FLAG(double, relative, 1e-3,
          "Each round's update of a parameter, relative to its |theta0|.");
ABSL_FLAG(int32_t, chunk_elements, 131072,
          "Elements per chunk (the coordinator's default).");

namespace localsgd {
namespace {

// Ratio buckets: [edge[b], edge[b + 1]), the last one closed at 1.
constexpr double kEdges[] = {0,        1.0 / 4096, 1.0 / 1024, 1.0 / 256,
                             1.0 / 64, 1.0 / 16,   1.0 / 4,    1.0};
constexpr int kBuckets = sizeof(kEdges) / sizeof(kEdges[0]) - 1;
const char* const kBucketNames[kBuckets] = {
    "[0, 1/4096)",  "[1/4096, 1/1024)", "[1/1024, 1/256)", "[1/256, 1/64)",
    "[1/64, 1/16)", "[1/16, 1/4)",      "[1/4, 1]"};
constexpr int kCheckpoints[] = {5, 10, 20, 40};

int BucketOf(double x) {
  for (int b = 0; b + 1 < kBuckets; ++b) {
    if (x < kEdges[b + 1]) return b;
  }
  return kBuckets - 1;
}

struct Checkpoint {
  int round = 0;
  int64_t below50 = 0, below90 = 0, above150 = 0;
};

struct Bucket {
  std::vector<float> lags;  // L_i of the bucket's parameters
  int64_t unmoved = 0;      // never moved by the last round
  // The largest L_i / Bound(x_i) over those whose bound is >= 1 round
  // (below, fp32 rounding, ~1e-4 rounds a round, is a visible share);
  // negative if none.
  double worst_vs_bound = -1;
  int64_t over_bound = 0;  // L_i > ceil(Bound(x_i)) + 1
};

struct WireResult {
  DType wire = DType::kFloat32;
  std::vector<Checkpoint> checkpoints;
  Bucket buckets[kBuckets];
  double seconds = 0;
};

int CodeMaxOf(DType wire) {
  return wire == DType::kInt8Block ? 127 : wire == DType::kInt4Block ? 7 : 0;
}

// The largest lag of a parameter of ratio x, in rounds: what the member's
// residual can hold, half a code step, with the block's step at most
// max |u| / (q - 1/2) (its largest |u + residual| is at most max |u| plus
// half the previous step).
double Bound(double x, int q) { return 1.0 / ((2.0 * q - 1) * x); }

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "small_updates: %s\n", what.c_str());
  std::exit(1);
}

WireResult RunWire(DType wire, const std::vector<float>& theta0,
                   const std::vector<float>& u, const std::vector<float>& x,
                   int rounds, int members, uint32_t chunk_elements) {
  const auto start = std::chrono::steady_clock::now();
  const size_t n = theta0.size();
  // The coordinator binary's defaults, then this bench's choices.
  JobSettings settings;
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    if (spec.flag == nullptr || spec.flag_default == nullptr) continue;
    if (absl::Status s = spec.parse(spec.flag_default, settings); !s.ok()) {
      Die(s.ToString());
    }
  }
  settings.chunk_elements = chunk_elements;
  settings.wire_dtype = wire;
  settings.mode = AveragingMode::kMean;
  settings.nonfinite_policy = NonFinitePolicy::kReject;
  settings.contribution = Contribution::kPseudoGradients;
  if (absl::Status s = ValidateComplete(settings, SettingsLimits(), "");
      !s.ok()) {
    Die(s.ToString());
  }
  const ChunkGeometry geometry(n, chunk_elements);
  const uint32_t chunks = geometry.num_chunks();

  // The coordinator, seeded with theta0.
  StateCommit commit(settings, geometry);
  commit.Restore(0, theta0, /*id=*/0, {}, {});
  std::shared_ptr<const StateSnapshot> state = commit.shared_state();

  // The members, each having fetched the seed.
  JoinInfo info;
  info.settings = settings;
  info.has_state = true;
  info.state_round = 0;
  info.state_id = state->id;
  info.num_chunks = chunks;
  info.num_elements = n;
  info.shard = ShardSpec{0, 1};
  std::vector<std::unique_ptr<MemberState>> m;
  std::vector<std::vector<float>> params(members, std::vector<float>(n));
  for (int i = 0; i < members; ++i) {
    m.push_back(std::make_unique<MemberState>());
    m[i]->OnJoined(info, n);
    for (uint32_t j = 0; j < chunks; ++j) {
      const absl::Span<float> to =
          m[i]->FetchSlice(absl::MakeSpan(params[i]), j);
      std::copy_n(theta0.begin() + geometry.Offset(j), to.size(), to.begin());
    }
    if (absl::Status s =
            m[i]->CommitFetch(0, state->id, absl::MakeSpan(params[i]));
        !s.ok()) {
      Die(s.ToString());
    }
  }

  WireResult result;
  result.wire = wire;
  std::vector<float> lag(n, 0.0f);  // max over rounds so far
  std::vector<std::vector<std::string>> payload(
      members, std::vector<std::string>(chunks));
  std::vector<uint32_t> pending(chunks);
  for (uint32_t c = 0; c < chunks; ++c) pending[c] = c;

  for (int r = 1; r <= rounds; ++r) {
    // Members: the update on top of the anchor, encoded with feedback.
    for (int i = 0; i < members; ++i) {
      float* p = params[i].data();
      for (size_t k = 0; k < n; ++k) p[k] += u[k];
      SyncPlan plan;
      plan.round = static_cast<RoundId>(r);
      m[i]->BeginSync(plan, absl::MakeSpan(params[i]));
      m[i]->BeginAttempt();
      for (uint32_t c = 0; c < chunks; ++c) {
        payload[i][c].resize(m[i]->SendBytes(c));
        m[i]->EncodeChunk(c, payload[i][c].data());
      }
    }
    // The coordinator: sums, the mean, the download with its residual.
    RoundAccumulator sums(commit.TakeBuffer(), geometry);
    sums.FitScale(members);
    std::shared_ptr<StateSnapshot> next = commit.NewNext();
    for (uint32_t c = 0; c < chunks; ++c) {
      for (int i = 0; i < members; ++i) {
        const absl::string_view piece(payload[i][c]);
        sums.Add(c, absl::MakeConstSpan(&piece, 1), m[i]->SendCode(), 1.0f);
      }
    }
    next = commit.FinishNext(std::move(sums), pending, std::move(next));
    state = commit.Commit(std::move(next), static_cast<RoundId>(r));
    // Members: the global delta onto the anchor, the Sync committed.
    RoundOutcome outcome;
    outcome.round = static_cast<RoundId>(r);
    outcome.contributed = true;
    outcome.contributors = static_cast<uint32_t>(members);
    outcome.contributor_weight = members;
    outcome.state_id = state->id;
    const size_t stride = WireBytes(wire, chunk_elements);
    for (int i = 0; i < members; ++i) {
      for (uint32_t j = 0; j < chunks; ++j) {
        const absl::string_view data(state->delta.data() + stride * j,
                                     WireBytes(wire, geometry.Size(j)));
        if (absl::Status s = DecodeOnto(data, wire, m[i]->AnchorSlice(j),
                                        m[i]->ResultSlice(j));
            !s.ok()) {
          Die(s.ToString());
        }
      }
      m[i]->CommitSync(outcome);
      if (std::memcmp(params[i].data(), state->values.data(),
                      n * sizeof(float)) != 0) {
        Die(
            absl::StrFormat("round %d: member %d does not hold the "
                            "coordinator's state",
                            r, i));
      }
    }
    // The movement against the intended one.
    Checkpoint cp;
    cp.round = r;
    const float* now = params[0].data();
    for (size_t k = 0; k < n; ++k) {
      const double step = std::fabs(static_cast<double>(u[k]));
      if (step == 0) continue;
      const double moved =
          (static_cast<double>(now[k]) - theta0[k]) * (u[k] > 0 ? 1 : -1);
      const double intended = r * step;
      if (moved < 0.5 * intended) ++cp.below50;
      if (moved < 0.9 * intended) ++cp.below90;
      if (moved > 1.5 * intended) ++cp.above150;
      lag[k] = std::max(lag[k], static_cast<float>(r - moved / step));
    }
    if (std::find(std::begin(kCheckpoints), std::end(kCheckpoints), r) !=
            std::end(kCheckpoints) ||
        r == rounds) {
      result.checkpoints.push_back(cp);
    }
  }

  // Lags by ratio.
  const int q = CodeMaxOf(wire);
  const float* now = params[0].data();
  for (size_t k = 0; k < n; ++k) {
    if (u[k] == 0) continue;
    Bucket& b = result.buckets[BucketOf(x[k])];
    b.lags.push_back(lag[k]);
    if (now[k] == theta0[k]) ++b.unmoved;
    if (q > 0) {
      const double bound = Bound(x[k], q);
      if (bound >= 1) {
        b.worst_vs_bound = std::max(b.worst_vs_bound, lag[k] / bound);
      }
      if (lag[k] > std::ceil(bound) + 1) ++b.over_bound;
    }
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return result;
}

// The p-quantile (0..1) of `v` (reordered), nearest rank.
float Quantile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(
      v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - (p > 0));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

std::string Percent(int64_t count, int64_t total) {
  if (count == 0) return "0";
  return absl::StrFormat("%.3g%%", 100.0 * count / total);
}

// The lag 1/(2 x q) over a bucket of ratios, in rounds, as text.
std::string TheoryText(int b, int q) {
  if (q == 0) return "-";
  auto lag = [&](double x) { return 1.0 / (2.0 * x * q); };
  const double hi = lag(kEdges[b + 1]);
  if (kEdges[b] == 0) return absl::StrFormat("> %.3g", hi);
  return absl::StrFormat("%.3g - %.3g", hi, lag(kEdges[b]));
}

std::string LagText(float lag, int rounds) {
  if (lag >= rounds) return absl::StrFormat(">= %d", rounds);
  return absl::StrFormat("%.3g", lag);
}

}  // namespace
}  // namespace localsgd

int main(int argc, char** argv) {
  using namespace localsgd;
  absl::SetProgramUsageMessage(
      "How late small pseudo-gradient updates arrive with each wire dtype:\n"
      "  small_updates --n=1000000 --rounds=40 --members=2 --seed=1 "
      "--wire=int8,int4,bfloat16,float32");
  absl::ParseCommandLine(argc, argv);
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int members = absl::GetFlag(FLAGS_members);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const double relative = absl::GetFlag(FLAGS_relative);
  const int32_t chunk_elements = absl::GetFlag(FLAGS_chunk_elements);
  if (n < 1 || rounds < 1 || members < 1 || members > 1024 ||
      chunk_elements < 1 || !(relative > 0)) {
    Die("need --n >= 1, --rounds >= 1, --members in 1..1024, "
        "--chunk_elements >= 1, --relative > 0");
  }
  std::vector<DType> wires;
  const JobSettingSpec* wire_spec = FindJobSetting("wire_dtype");
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_wire), ',', absl::SkipEmpty())) {
    JobSettings s;
    if (absl::Status st = wire_spec->parse(name, s); !st.ok()) {
      Die(st.ToString());
    }
    if (IsSparseDType(s.wire_dtype)) {
      // Their lag is how many rounds a value waits to be among its block's
      // largest, which this bench's model of the block codes does not say.
      Die(absl::StrCat("--wire=", name,
                       ": the sparse codes are not measured here "
                       "(bench/quality.py and tests/integration/"
                       "sparse_wire_test.cc are)"));
    }
    wires.push_back(s.wire_dtype);
  }

  // theta0 ~ N(0, 1), the updates, and each one's ratio to its block's
  // largest (blocks of kQuantBlock from each chunk's first element).
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> theta0(n), u(n), x(n);
  for (int64_t k = 0; k < n; ++k) theta0[k] = static_cast<float>(normal(rng));
  for (int64_t k = 0; k < n; ++k) {
    const float sign = (rng() & 1) ? 1.0f : -1.0f;
    u[k] = sign * static_cast<float>(relative) * std::fabs(theta0[k]);
  }
  for (int64_t chunk = 0; chunk < n; chunk += chunk_elements) {
    const int64_t chunk_end = std::min<int64_t>(n, chunk + chunk_elements);
    for (int64_t b = chunk; b < chunk_end; b += kQuantBlock) {
      const int64_t end = std::min<int64_t>(chunk_end, b + kQuantBlock);
      float max = 0;
      for (int64_t k = b; k < end; ++k) max = std::max(max, std::fabs(u[k]));
      for (int64_t k = b; k < end; ++k) {
        x[k] = max > 0 ? std::fabs(u[k]) / max : 0.0f;
      }
    }
  }

  std::vector<WireResult> results;
  for (DType wire : wires) {
    results.push_back(RunWire(wire, theta0, u, x, rounds, members,
                              static_cast<uint32_t>(chunk_elements)));
    std::fprintf(stderr, "%s: %.2f s\n", std::string(DTypeName(wire)).c_str(),
                 results.back().seconds);
  }

  std::printf(
      "small_updates: n=%lld rounds=%d members=%d seed=%llu relative=%g "
      "chunk_elements=%d; theta ~ N(0,1), u = relative * |theta0| * random "
      "sign, the same on every member, MEAN\n\n",
      static_cast<long long>(n), rounds, members,
      static_cast<unsigned long long>(seed), relative, chunk_elements);

  std::printf(
      "Parameters whose movement is below 50%% / below 90%% / above 150%% of "
      "the intended after r rounds:\n\n");
  std::printf("| wire | rounds | below 50%% | below 90%% | above 150%% |\n");
  std::printf("|---|---:|---:|---:|---:|\n");
  for (const WireResult& w : results) {
    for (const Checkpoint& c : w.checkpoints) {
      std::printf("| %s | %d | %s | %s | %s |\n",
                  std::string(DTypeName(w.wire)).c_str(), c.round,
                  Percent(c.below50, n).c_str(), Percent(c.below90, n).c_str(),
                  Percent(c.above150, n).c_str());
    }
  }

  std::printf(
      "\nLag L, in rounds: the largest shortfall over the %d rounds, in "
      "rounds of the parameter's own update; by x = |u_i| / max |u| of its "
      "block. '1/(2xq)': the theory's lag (q = 127 int8, 7 int4); '>= %d': "
      "not moved yet after %d rounds; 'L / bound': the largest L / "
      "(1/((2q-1) x)) where that bound is >= 1 round; 'over': parameters "
      "with L > ceil(1/((2q-1) x)) + 1:\n\n",
      rounds, rounds, rounds);
  std::printf(
      "| wire | x | share | 1/(2xq) | median L | p99 L | max L | "
      "never moved | L / bound | over |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bool ok = true;
  for (WireResult& w : results) {
    const int q = CodeMaxOf(w.wire);
    const std::string wire(DTypeName(w.wire));
    for (int b = 0; b < kBuckets; ++b) {
      Bucket& bucket = w.buckets[b];
      const int64_t count = static_cast<int64_t>(bucket.lags.size());
      if (count == 0) {
        std::printf("| %s | %s | 0 | %s | - | - | - | - | - | - |\n",
                    wire.c_str(), kBucketNames[b], TheoryText(b, q).c_str());
        continue;
      }
      const float median = Quantile(bucket.lags, 0.5);
      const float p99 = Quantile(bucket.lags, 0.99);
      const float max = Quantile(bucket.lags, 1.0);
      const std::string vs_bound =
          q > 0 && bucket.worst_vs_bound >= 0
              ? absl::StrFormat("%.3f", bucket.worst_vs_bound)
              : "-";
      const std::string over =
          q > 0 ? absl::StrFormat("%d", bucket.over_bound) : "-";
      std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                  wire.c_str(), kBucketNames[b], Percent(count, n).c_str(),
                  TheoryText(b, q).c_str(), LagText(median, rounds).c_str(),
                  LagText(p99, rounds).c_str(), LagText(max, rounds).c_str(),
                  Percent(bucket.unmoved, n).c_str(), vs_bound.c_str(),
                  over.c_str());
      if (bucket.over_bound > 0) ok = false;
    }
  }
  return ok ? 0 : 1;
}
