// Integration: an in-process coordinator on an ephemeral loopback port and N
// clients in threads, checked against averages the test computes itself.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/background_sync.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "src/tick_alarm.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testkit::LayoutOfSizes;

uint64_t Total(const std::vector<int64_t>& sizes) {
  uint64_t n = 0;
  for (int64_t s : sizes) n += s;
  return n;
}

// The value member `member` holds at element `j` before round `round`.
float Value(int member, uint64_t j, int round) {
  return std::sin(0.001f * static_cast<float>(j) + 0.7f * member) *
             (1.0f + member) +
         0.25f * round;
}

std::unique_ptr<CoordinatorServer> StartServer(uint32_t chunk_elements,
                                               DType wire = DType::kFloat32) {
  ServerOptions options = testkit::BaseServerOptions(chunk_elements);
  options.coordinator.default_settings.wire_dtype = wire;
  return testkit::StartServer(std::move(options));
}

std::unique_ptr<Client> MakeClient(
    int port, const std::string& job, const std::string& name,
    double weight = 1, uint32_t rendezvous_members = 0,
    Contribution contribution = Contribution::kUnspecified) {
  ClientOptions options;
  options.settings.rendezvous_members = rendezvous_members;
  options.settings.contribution = contribution;
  options.target = absl::StrCat("127.0.0.1:", port);
  options.job_id = job;
  options.member_name = name;
  options.weight = weight;
  options.max_retry_time = absl::Seconds(10);
  auto client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

// One client per `params` entry of job `job_id` at `server`, named m0, m1,
// ..., joined with `layout` and initialized from its entry; `configure`
// sets the rest of its options. Fewer on a failure (reported).
std::vector<std::unique_ptr<Client>> JoinedClients(
    const CoordinatorServer& server, const std::string& job_id,
    const Layout& layout, std::vector<std::vector<float>>& params,
    const std::function<void(ClientOptions&)>& configure) {
  std::vector<std::unique_ptr<Client>> clients;
  for (size_t i = 0; i < params.size(); ++i) {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server.port());
    options.job_id = job_id;
    options.member_name = absl::StrCat("m", i);
    configure(options);
    auto client = Client::Create(options);
    if (!client.ok()) {
      ADD_FAILURE() << client.status();
      break;
    }
    clients.push_back(*std::move(client));
    if (absl::Status s = clients[i]->Join(layout); !s.ok()) {
      ADD_FAILURE() << s;
      clients.pop_back();
      break;
    }
    if (absl::Status s = clients[i]->Initialize(absl::MakeSpan(params[i]));
        !s.ok()) {
      ADD_FAILURE() << s;
      clients.pop_back();
      break;
    }
  }
  return clients;
}

struct SyncCase {
  std::vector<int64_t> sizes;
  uint32_t chunk_elements;
  int members;
  std::vector<double> weights;  // empty: all 1
};

class ExactMeanTest : public ::testing::TestWithParam<SyncCase> {};

TEST_P(ExactMeanTest, Sync_AllMembersHoldTheIndependentWeightedMean) {
  const SyncCase& c = GetParam();
  auto server = StartServer(c.chunk_elements);
  const Layout layout = LayoutOfSizes(c.sizes);
  const uint64_t n = Total(c.sizes);
  const int members = c.members;
  auto weight = [&](int i) { return c.weights.empty() ? 1.0 : c.weights[i]; };

  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(members, std::vector<float>(n));
  for (int i = 0; i < members; ++i) {
    clients.push_back(
        MakeClient(server->port(), "exact", absl::StrCat("m", i), weight(i)));
    ASSERT_TRUE(clients.back()->Join(layout).ok());
  }
  // Member 0 seeds; the others fetch: all start identical.
  for (uint64_t j = 0; j < n; ++j) params[0][j] = Value(0, j, -1);
  ASSERT_TRUE(clients[0]->Initialize(absl::MakeSpan(params[0])).ok());
  for (int i = 1; i < members; ++i) {
    // These joined before the seed existed: Initialize asks to seed (round 0)
    // and adopts member 0's seed instead.
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
    EXPECT_EQ(params[i], params[0])
        << "member " << i << " did not get the seed";
  }

  constexpr int kRounds = 3;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < members; ++i) {
      for (uint64_t j = 0; j < n; ++j) params[i][j] = Value(i, j, round);
    }
    std::vector<absl::StatusOr<SyncOutcome>> outcomes(members);
    std::vector<std::thread> threads;
    for (int i = 0; i < members; ++i) {
      threads.emplace_back([&, i] {
        outcomes[i] = clients[i]->Sync(absl::MakeSpan(params[i]));
      });
    }
    for (auto& t : threads) t.join();
    double total_weight = 0;
    for (int i = 0; i < members; ++i) total_weight += weight(i);
    for (int i = 0; i < members; ++i) {
      ASSERT_TRUE(outcomes[i].ok()) << outcomes[i].status();
      EXPECT_EQ(outcomes[i]->round, static_cast<RoundId>(round + 1));
      EXPECT_TRUE(outcomes[i]->contributed);
      EXPECT_EQ(outcomes[i]->contributors, static_cast<uint32_t>(members));
      EXPECT_DOUBLE_EQ(outcomes[i]->contributor_weight, total_weight);
    }
    for (uint64_t j = 0; j < n; ++j) {
      double expected = 0;
      for (int i = 0; i < members; ++i)
        expected += weight(i) * Value(i, j, round);
      expected /= total_weight;
      // fp32 accumulation: summation-order tolerance.
      ASSERT_NEAR(params[0][j], expected, 1e-5 * (1 + std::abs(expected)))
          << "element " << j << " round " << round;
      for (int i = 1; i < members; ++i) {
        ASSERT_EQ(params[i][j], params[0][j])
            << "member " << i << " element " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ExactMeanTest,
    ::testing::Values(
        SyncCase{{1}, 4, 1, {}},            // one scalar
        SyncCase{{10}, 3, 2, {}},           // chunks do not divide
        SyncCase{{7, 1, 33, 2}, 8, 3, {}},  // odd tensors, odd chunks
        SyncCase{{1000, 3, 517}, 256, 4, {1, 2, 3, 4}},  // weighted
        SyncCase{{100000, 77}, 4096, 4, {}},             // many chunks
        SyncCase{{5000}, 5000, 5, {2, 1, 1, 1, 1}}),     // one chunk, weights
    [](const ::testing::TestParamInfo<SyncCase>& info) {
      const SyncCase& c = info.param;
      return absl::StrCat("members", c.members, "_tensors", c.sizes.size(),
                          "_elements", Total(c.sizes), "_chunk",
                          c.chunk_elements,
                          c.weights.empty() ? "" : "_weighted");
    });

// bfloat16 on the wire, both contributions: parameters (each rounded, and the
// state itself rounded to bf16) and pseudo-gradients (the deltas rounded,
// the state float32).
class BFloat16WireTest : public ::testing::TestWithParam<Contribution> {};

TEST_P(BFloat16WireTest, Sync_ResultWithinBFloat16ToleranceAndIdenticalOnAll) {
  const bool parameters = GetParam() == Contribution::kParameters;
  auto server = StartServer(1000, DType::kBFloat16);
  const std::vector<int64_t> sizes = {2500, 13};
  const Layout layout = LayoutOfSizes(sizes);
  const uint64_t n = Total(sizes);
  constexpr int kMembers = 3;
  constexpr float kSeed = 0.5f;
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(kMembers,
                                         std::vector<float>(n, kSeed));
  for (int i = 0; i < kMembers; ++i) {
    clients.push_back(MakeClient(server->port(), "bf16", absl::StrCat("m", i),
                                 1, 0, GetParam()));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  for (int i = 0; i < kMembers; ++i) {
    for (uint64_t j = 0; j < n; ++j) params[i][j] = Value(i, j, 0);
  }
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<SyncOutcome>> outcomes(kMembers);
  for (int i = 0; i < kMembers; ++i) {
    threads.emplace_back(
        [&, i] { outcomes[i] = clients[i]->Sync(absl::MakeSpan(params[i])); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kMembers; ++i) {
    ASSERT_TRUE(outcomes[i].ok()) << outcomes[i].status();
    EXPECT_EQ(outcomes[i]->bytes_sent, n * 2);
  }
  for (uint64_t j = 0; j < n; ++j) {
    // What is rounded: the parameters, or the deltas against the seed.
    const double base = parameters ? 0 : kSeed;
    double expected = 0, mean_abs = 0;
    for (int i = 0; i < kMembers; ++i) {
      expected += Value(i, j, 0) - base;
      mean_abs += std::abs(Value(i, j, 0) - base);
    }
    expected /= kMembers;
    mean_abs /= kMembers;
    // Each input is rounded to bf16 (unit roundoff 2^-8), and so is the
    // result: |error| <= 2^-8 * (mean |x_i| + |mean|), plus slack.
    ASSERT_NEAR(params[0][j] - base, expected,
                std::ldexp(1.0, -8) * (mean_abs + std::abs(expected)) + 1e-7)
        << "element " << j;
    if (parameters) {
      EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(params[0][j])), params[0][j]);
    }
    for (int i = 1; i < kMembers; ++i) ASSERT_EQ(params[i][j], params[0][j]);
  }
}

INSTANTIATE_TEST_SUITE_P(Contributions, BFloat16WireTest,
                         ::testing::Values(Contribution::kParameters,
                                           Contribution::kPseudoGradients),
                         [](const auto& info) {
                           return std::string(ContributionName(info.param));
                         });

// The scenario that stalled training with parameters in bfloat16: two
// members at theta each contribute theta + 1e-3 |theta| (a fine-tuning-sized
// step) for 20 rounds. The magnitudes here are near-equal within each
// 64-element block of the int8/int4 codes (a ramp: a block's smallest is at
// least 0.9 of its largest), and then, with pseudo-gradients and error
// feedback at both ends, every parameter moves by the intended amount in
// every wire dtype; every member and a late joiner hold the same bits. With
// parameters in bfloat16 (the control) no parameter moves at all: every
// update is below half a bf16 ulp. Blocks of mixed magnitudes lag with int8
// and int4: a parameter a fraction x of its block's largest does not move
// for about 1/(2 x q) rounds (q = 127, 7) and is never more than
// 1/((2q - 1) x) rounds of its update behind (core_tests:
// StateCommitTest.SmallUpdates_LagByTheirRatioInTheBlock; bench/small_updates
// measures it over N(0, 1) weights).
struct SmallUpdatesCase {
  Contribution contribution;
  DType wire;
};

class SmallUpdatesTest : public ::testing::TestWithParam<SmallUpdatesCase> {};

TEST_P(SmallUpdatesTest, TwentyRoundsOfRelative1e3_MoveEveryParameter) {
  const SmallUpdatesCase& c = GetParam();
  ServerOptions options = testkit::BaseServerOptions(1000);
  options.coordinator.default_settings.wire_dtype = c.wire;
  options.coordinator.default_settings.contribution = c.contribution;
  auto server = testkit::StartServer(std::move(options));
  const std::vector<int64_t> sizes = {4096};
  const Layout layout = LayoutOfSizes(sizes);
  const uint64_t n = 4096;
  std::vector<float> theta0(n);
  for (uint64_t j = 0; j < n; ++j) {
    // Magnitudes from 0.5 to 4, both signs, each exact in bf16.
    theta0[j] = BFloat16ToFloat(FloatToBFloat16(
        (j % 2 ? -1.0f : 1.0f) * (0.5f + 3.5f * static_cast<float>(j) / n)));
  }
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(2, theta0);
  for (int i = 0; i < 2; ++i) {
    clients.push_back(MakeClient(server->port(), "small", absl::StrCat("m", i),
                                 1, 2, c.contribution));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
  }
  {
    std::thread t([&] {
      ASSERT_TRUE(clients[1]->Initialize(absl::MakeSpan(params[1])).ok());
    });
    ASSERT_TRUE(clients[0]->Initialize(absl::MakeSpan(params[0])).ok());
    t.join();
  }
  ASSERT_EQ(params[0], theta0);
  for (int r = 0; r < 20; ++r) {
    for (int i = 0; i < 2; ++i) {
      for (float& v : params[i]) v += 1e-3f * std::fabs(v);
    }
    absl::StatusOr<SyncOutcome> a, b;
    std::thread t([&] { b = clients[1]->Sync(absl::MakeSpan(params[1])); });
    a = clients[0]->Sync(absl::MakeSpan(params[0]));
    t.join();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->contributors, 2u);
    ASSERT_EQ(params[0], params[1]) << "round " << r;
  }
  uint64_t moved_ok = 0, unmoved = 0;
  double worst = 0;
  for (uint64_t j = 0; j < n; ++j) {
    // Each round moves theta by 1e-3 |theta|: theta_20 = theta_0 (1 +
    // 1e-3)^20 for theta_0 > 0, theta_0 (1 - 1e-3)^20 for theta_0 < 0.
    const double want = theta0[j] > 0
                            ? theta0[j] * (std::pow(1.001, 20) - 1)
                            : std::fabs(theta0[j]) * (1 - std::pow(0.999, 20));
    const double moved = params[0][j] - theta0[j];
    if (moved == 0) ++unmoved;
    const double error = std::fabs(moved - want) / want;
    worst = std::max(worst, error);
    // Within the encoding's error after error feedback: what is still in
    // the residuals is at most one round's rounding (int4: absmax / 14 of
    // a block's 1e-3 delta) from each end, under 1% of 20 rounds' worth
    // because every value of a block is at least 0.9 of its largest
    // (measured worst: float32 0, bf16 and int8 0.02%, int4 0.4%).
    if (error <= 0.01) ++moved_ok;
  }
  const bool stalls =
      c.contribution == Contribution::kParameters && c.wire == DType::kBFloat16;
  if (stalls) {
    EXPECT_EQ(unmoved, n) << "the control no longer stalls";
  } else {
    EXPECT_EQ(moved_ok, n) << "worst relative error " << worst;
    EXPECT_EQ(unmoved, 0u);
  }
  // A late joiner holds the same bits (it fetches the float32 state).
  auto late = MakeClient(server->port(), "small", "late", 1, 2, c.contribution);
  ASSERT_TRUE(late->Join(layout).ok());
  std::vector<float> fetched(n);
  ASSERT_TRUE(late->Initialize(absl::MakeSpan(fetched)).ok());
  EXPECT_EQ(fetched, params[0]);
  std::printf("%s %s: worst relative error of the movement %.4f\n",
              std::string(ContributionName(c.contribution)).c_str(),
              std::string(DTypeName(c.wire)).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(
    Encodings, SmallUpdatesTest,
    ::testing::Values(
        SmallUpdatesCase{Contribution::kPseudoGradients, DType::kFloat32},
        SmallUpdatesCase{Contribution::kPseudoGradients, DType::kBFloat16},
        SmallUpdatesCase{Contribution::kPseudoGradients, DType::kInt8Block},
        SmallUpdatesCase{Contribution::kPseudoGradients, DType::kInt4Block},
        SmallUpdatesCase{Contribution::kParameters, DType::kBFloat16}),
    [](const auto& info) {
      return absl::StrCat(ContributionName(info.param.contribution), "_",
                          DTypeName(info.param.wire));
    });

TEST(LateJoinerTest, FetchState_EqualsWhatTheOthersHold) {
  auto server = StartServer(64);
  const std::vector<int64_t> sizes = {300};
  const Layout layout = LayoutOfSizes(sizes);
  std::vector<std::vector<float>> params(2, std::vector<float>(300));
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 2; ++i) {
    clients.push_back(MakeClient(server->port(), "late", absl::StrCat("m", i)));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    for (int j = 0; j < 300; ++j) params[i][j] = Value(i, j, 0);
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  for (int round = 1; round <= 4; ++round) {
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 300; ++j) params[i][j] += Value(i, j, round);
    }
    std::thread t(
        [&] { ASSERT_TRUE(clients[1]->Sync(absl::MakeSpan(params[1])).ok()); });
    ASSERT_TRUE(clients[0]->Sync(absl::MakeSpan(params[0])).ok());
    t.join();
  }
  auto late = MakeClient(server->port(), "late", "late");
  ASSERT_TRUE(late->Join(layout).ok());
  EXPECT_TRUE(late->info().has_state);
  EXPECT_EQ(late->info().state_round, 4u);
  std::vector<float> mine(300, -1.0f);
  ASSERT_TRUE(late->Initialize(absl::MakeSpan(mine)).ok());
  EXPECT_EQ(mine, params[0]);
  EXPECT_EQ(late->state_round(), 4u);
}

// BackgroundSync (overlap): a's round runs while a trains on; its result
// is merged as the round's result plus a's progress since the snapshot, bit
// for bit what b holds plus that progress. Over several rounds, with b
// syncing plainly, both stay consistent with the job's state.
TEST(BackgroundSyncTest, Finish_IsTheRoundsResultPlusProgressSinceSnapshot) {
  auto server = StartServer(64);
  const Layout layout = LayoutOfSizes({200, 57});
  const size_t n = 257;
  auto a = MakeClient(server->port(), "overlap", "a");
  auto b = MakeClient(server->port(), "overlap", "b");
  std::vector<float> pa(n), pb(n);
  for (size_t j = 0; j < n; ++j) pa[j] = Value(0, j, 0);
  ASSERT_TRUE(a->Join(layout).ok());
  ASSERT_TRUE(a->Initialize(absl::MakeSpan(pa)).ok());
  ASSERT_TRUE(b->Join(layout).ok());
  ASSERT_TRUE(b->Initialize(absl::MakeSpan(pb)).ok());
  BackgroundSync background(a.get());
  // Refusals that change nothing.
  EXPECT_EQ(background.Finish(absl::MakeSpan(pa)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<float> wrong(n + 1);
  EXPECT_EQ(background.Start(wrong).code(), absl::StatusCode::kInvalidArgument);
  for (int round = 1; round <= 3; ++round) {
    for (size_t j = 0; j < n; ++j) {
      pa[j] += Value(0, j, round);
      pb[j] += Value(1, j, round);
    }
    const std::vector<float> snapshot = pa;
    ASSERT_TRUE(background.Start(pa).ok());
    EXPECT_EQ(background.Start(pa).code(),
              absl::StatusCode::kFailedPrecondition);
    // a trains on while its round runs.
    for (size_t j = 0; j < n; ++j) pa[j] += 0.125f * static_cast<float>(j % 7);
    const std::vector<float> progressed = pa;
    std::vector<float> b_before = pb;
    absl::StatusOr<SyncOutcome> ob = b->Sync(absl::MakeSpan(pb));
    ASSERT_TRUE(ob.ok()) << ob.status();
    absl::StatusOr<SyncOutcome> oa = background.Finish(absl::MakeSpan(pa));
    ASSERT_TRUE(oa.ok()) << oa.status();
    EXPECT_TRUE(oa->contributed);
    EXPECT_EQ(oa->round, static_cast<RoundId>(round));
    EXPECT_EQ(oa->contributors, 2u);
    EXPECT_FALSE(background.in_flight());
    for (size_t j = 0; j < n; ++j) {
      // b holds the round's result.
      const float global = pb[j];
      ASSERT_EQ(pa[j], global + (progressed[j] - snapshot[j])) << j;
      // The result is the mean of what a contributed (the snapshot, not
      // its later progress) and what b did (an independent computation).
      ASSERT_NEAR(global, 0.5 * (double(snapshot[j]) + double(b_before[j])),
                  1e-5)
          << j;
    }
  }
}

// The id of job `job`'s current state, as FetchState's header names it to
// raw member `member`.
grpc::Status FetchStateId(testkit::RawClient& raw, const std::string& job,
                          const std::string& member, const Layout& layout,
                          uint64_t* state_id) {
  v1::FetchStateRequest request;
  request.set_job_id(job);
  request.set_member_id(member);
  request.set_layout_fingerprint(layout.fingerprint);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto reader = raw.stub()->FetchState(&context, request);
  v1::FetchStateResponse response;
  while (reader->Read(&response)) {
    if (response.has_header()) *state_id = response.header().state_id();
  }
  return reader->Finish();
}

// Joins raw member `name` to pseudo-gradient job `job` and reads the id of
// the job's current state (the anchor of its first delta).
grpc::Status JoinPseudoGradientMember(testkit::RawClient& raw,
                                      const std::string& job,
                                      const std::string& name,
                                      const Layout& layout, std::string* member,
                                      uint64_t* anchor) {
  raw.set_contribution(v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  grpc::Status status = raw.Join(job, name, member, 7, layout);
  if (!status.ok()) return status;
  return FetchStateId(raw, job, *member, layout, anchor);
}

// The header of a raw pseudo-gradient Sync asking for early results.
v1::SyncRequest EarlySyncHeader(const std::string& job,
                                const std::string& member, uint64_t round,
                                const Layout& layout, uint64_t anchor) {
  v1::SyncRequest request =
      testkit::SyncHeaderRequest(job, member, round, layout);
  request.mutable_header()->set_anchor_state_id(anchor);
  request.mutable_header()->set_early_results(true);
  return request;
}

// A paced upload (ClientOptions::max_lead_chunks = 1) against a raw member
// b that sends chunk k only once it has read k result chunks: a may write
// chunk c only once c results came back, so both go in lockstep, a's writes
// wait for results (and resume: a broken resume ends a's Sync at its
// deadline), and both get the exact mean.
TEST(PacedUploadTest, LeadLimit_WritesWaitForResultsAndResume) {
  constexpr uint32_t kChunkElements = 16 * 1024;
  constexpr uint32_t kChunks = 128;
  constexpr size_t n = size_t{kChunkElements} * kChunks;
  auto server = StartServer(kChunkElements);
  const Layout layout = LayoutOfSizes({static_cast<int64_t>(n)});
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server->port());
  options.job_id = "paced";
  options.member_name = "a";
  options.settings.rendezvous_members = 2;  // round 1 waits for both
  options.max_lead_chunks = 1;
  options.sync_timeout = absl::Seconds(20);
  options.max_retry_time = absl::Seconds(1);
  auto a = Client::Create(options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->Join(layout).ok());
  std::vector<float> pa(n);
  for (size_t j = 0; j < n; ++j) pa[j] = 0.5f * static_cast<float>(j % 8);
  const std::vector<float> seed = pa;
  ASSERT_TRUE((*a)->Initialize(absl::MakeSpan(pa)).ok());

  testkit::RawClient raw(testkit::Channel(*server));
  std::string b;
  uint64_t anchor = 0;
  ASSERT_TRUE(
      JoinPseudoGradientMember(raw, "paced", "b", layout, &b, &anchor).ok());
  ASSERT_NE(anchor, 0u);

  // Each round a adds 1 everywhere and b sends +3: the mean delta is 2,
  // exactly. Whether a's writes get ahead of its first result is up to the
  // scheduler (gRPC accepts writes before they reach the wire): rounds go
  // on until one paced a (at most kRounds; every one is checked).
  constexpr int kRounds = 5;
  std::string data;
  EncodeValues(std::vector<float>(kChunkElements, 3.0f), DType::kFloat32,
               &data);
  uint32_t paced = 0;
  for (int round = 1; round <= kRounds && paced == 0; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    for (float& v : pa) v += 1.0f;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    auto stream = raw.stub()->Sync(&context);
    v1::SyncRequest request =
        EarlySyncHeader("paced", b, round, layout, anchor);
    ASSERT_TRUE(stream->Write(request));
    request.mutable_chunk()->set_crc32c(Crc32c(0, data));
    request.mutable_chunk()->set_data(data);
    // b's chunk 0 goes first (it needs no result), then a starts.
    request.mutable_chunk()->set_index(0);
    ASSERT_TRUE(stream->Write(request));
    absl::StatusOr<SyncOutcome> oa;
    std::thread ta([&] { oa = (*a)->Sync(absl::MakeSpan(pa)); });
    std::vector<bool> got(kChunks, false);
    uint32_t results = 0;
    bool have_header = false;
    bool exact = true;
    std::vector<float> decoded(kChunkElements);
    auto read_one = [&]() -> bool {
      v1::SyncResponse response;
      if (!stream->Read(&response)) return false;
      if (response.has_result()) {
        have_header = true;
        EXPECT_TRUE(response.result().contributed());
        EXPECT_EQ(response.result().contributors(), 2u);
        anchor = response.result().state_id();
        return true;
      }
      const uint32_t c = response.chunk().index();
      EXPECT_LT(c, kChunks);
      if (c >= kChunks || got[c]) return true;
      got[c] = true;
      ++results;
      EXPECT_TRUE(DecodeValues(response.chunk().data(), DType::kFloat32,
                               absl::MakeSpan(decoded))
                      .ok());
      for (float v : decoded) exact = exact && v == 2.0f;
      return true;
    };
    bool ended = false;
    for (uint32_t k = 1; k < kChunks && !ended; ++k) {
      while (results < k && !ended) ended = !read_one();
      EXPECT_FALSE(have_header) << "result header before b's chunk " << k;
      request.mutable_chunk()->set_index(k);
      ended = ended || !stream->Write(request);
    }
    EXPECT_FALSE(ended) << "b's stream ended before its last chunk";
    stream->WritesDone();
    while (read_one()) {
    }
    const grpc::Status status = stream->Finish();
    ta.join();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_TRUE(oa.ok()) << oa.status();
    EXPECT_TRUE(oa->contributed);
    EXPECT_TRUE(have_header);
    EXPECT_EQ(results, kChunks);
    EXPECT_TRUE(exact) << "b got a result other than the mean delta 2";
    for (size_t j = 0; j < n; ++j) {
      ASSERT_EQ(pa[j], seed[j] + 2.0f * round) << j;
    }
    paced = oa->paced_writes;
  }
  EXPECT_GT(paced, 0u) << "a's upload never waited for results in " << kRounds
                       << " rounds";
}

// With a round deadline the clients do not pace: a member that stops after
// its first chunk (its process hung; its lease still runs) must not hold
// the others' uploads, or the deadline, which closes a round once a member
// is complete, could not close it without that member.
TEST(PacedUploadTest,
     RoundDeadline_NoPacing_DeadlineClosesWithoutAStalledMember) {
  constexpr uint32_t kChunkElements = 16 * 1024;
  constexpr uint32_t kChunks = 128;
  constexpr size_t n = size_t{kChunkElements} * kChunks;
  ServerOptions server_options = testkit::BaseServerOptions(kChunkElements);
  // The deadline counts from the stalled member's first chunk: the two
  // others must upload 8 MiB each before it, also under ASan on a loaded
  // 2-core machine (300 ms was not enough there). With pacing they would
  // never complete, whatever the deadline.
  server_options.coordinator.policy.round_deadline = absl::Seconds(2);
  server_options.coordinator.policy.lease_ttl = absl::Seconds(120);
  auto server = testkit::StartServer(std::move(server_options));
  const Layout layout = LayoutOfSizes({static_cast<int64_t>(n)});
  std::vector<std::vector<float>> params(2, std::vector<float>(n, 1.0f));
  std::vector<std::unique_ptr<Client>> clients =
      JoinedClients(*server, "deadline", layout, params, [](ClientOptions& o) {
        o.sync_timeout = absl::Seconds(20);
        o.max_retry_time = absl::Seconds(1);
      });
  ASSERT_EQ(clients.size(), 2u);
  testkit::RawClient raw(testkit::Channel(*server));
  std::string b;
  uint64_t anchor = 0;
  ASSERT_TRUE(
      JoinPseudoGradientMember(raw, "deadline", "stalled", layout, &b, &anchor)
          .ok());
  // The stalled member opens round 1 and gives chunk 0 only.
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto stream = raw.stub()->Sync(&context);
  v1::SyncRequest request = EarlySyncHeader("deadline", b, 1, layout, anchor);
  ASSERT_TRUE(stream->Write(request));
  std::string data;
  EncodeValues(std::vector<float>(kChunkElements, 0.0f), DType::kFloat32,
               &data);
  request.mutable_chunk()->set_index(0);
  request.mutable_chunk()->set_crc32c(Crc32c(0, data));
  request.mutable_chunk()->set_data(data);
  ASSERT_TRUE(stream->Write(request));
  std::vector<absl::StatusOr<SyncOutcome>> outcomes(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    for (float& v : params[i]) v += 2.0f * static_cast<float>(i + 1);
    threads.emplace_back(
        [&, i] { outcomes[i] = clients[i]->Sync(absl::MakeSpan(params[i])); });
  }
  for (auto& t : threads) t.join();
  context.TryCancel();
  (void)stream->Finish();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(outcomes[i].ok()) << i << ": " << outcomes[i].status();
    EXPECT_TRUE(outcomes[i]->contributed) << i;
    EXPECT_EQ(outcomes[i]->contributors, 2u) << i;
    EXPECT_EQ(outcomes[i]->paced_writes, 0u) << i;
  }
  // Chunk 0 is the mean of three (1 + (2 + 4 + 0) / 3 = 3), the rest of
  // the two that completed (1 + (2 + 4) / 2 = 4).
  EXPECT_EQ(params[0][0], 3.0f);
  EXPECT_EQ(params[0][n - 1], 4.0f);
  EXPECT_EQ(params[0], params[1]);
}

// A Sync that fails after result chunks came back early leaves the
// parameters exactly as they were (a pseudo-gradient job's result goes to
// the next anchor, and into the parameters only once the Sync succeeded),
// and the next Sync gets the round's result, bit for bit what raw member b
// decodes. The round cannot close: b gives half its chunks and holds its
// stream, so chunks 0-3 are final and sent to both (b reads them while a's
// Sync runs), and a's Sync ends at its deadline. In float32 and int8 (the
// blockwise decode onto the anchor, and the error feedback of a Sync that
// failed).
class EarlyResultsClientTest : public ::testing::TestWithParam<DType> {};

TEST_P(EarlyResultsClientTest, SyncFailsAfterEarlyResults_ParamsAsTheyWere) {
  const DType wire = GetParam();
  constexpr uint32_t kChunkElements = 256;
  constexpr uint32_t kChunks = 8;
  constexpr uint32_t kGiven = 4;
  constexpr size_t n = size_t{kChunkElements} * kChunks;
  auto server = StartServer(kChunkElements);
  const Layout layout = LayoutOfSizes({static_cast<int64_t>(n)});
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server->port());
  options.job_id = "fails-early";
  options.member_name = "a";
  options.settings.rendezvous_members = 2;  // round 1 waits for both
  options.settings.wire_dtype = wire;
  options.sync_timeout = absl::Seconds(2);
  options.max_retry_time = absl::ZeroDuration();  // one attempt
  auto a = Client::Create(options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->Join(layout).ok());
  std::vector<float> pa(n);
  for (size_t j = 0; j < n; ++j) pa[j] = 0.5f * static_cast<float>(j % 5);
  const std::vector<float> seed = pa;
  ASSERT_TRUE((*a)->Initialize(absl::MakeSpan(pa)).ok());

  testkit::RawClient raw(testkit::Channel(*server));
  std::string b;
  uint64_t anchor = 0;
  ASSERT_TRUE(
      JoinPseudoGradientMember(raw, "fails-early", "b", layout, &b, &anchor)
          .ok());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto stream = raw.stub()->Sync(&context);
  v1::SyncRequest request =
      EarlySyncHeader("fails-early", b, 1, layout, anchor);
  ASSERT_TRUE(stream->Write(request));
  std::string data;
  EncodeValues(std::vector<float>(kChunkElements, 3.0f), wire, &data);
  request.mutable_chunk()->set_crc32c(Crc32c(0, data));
  request.mutable_chunk()->set_data(data);
  for (uint32_t c = 0; c < kGiven; ++c) {
    request.mutable_chunk()->set_index(c);
    ASSERT_TRUE(stream->Write(request));
  }

  // What b decodes of each result chunk: the round's delta.
  std::vector<float> delta(n, std::numeric_limits<float>::quiet_NaN());
  uint32_t results = 0;
  auto take = [&](const v1::SyncResponse& response) {
    if (!response.has_chunk()) return;
    const uint32_t c = response.chunk().index();
    EXPECT_LT(c, kChunks);
    if (c >= kChunks) return;
    EXPECT_TRUE(DecodeValues(response.chunk().data(), wire,
                             absl::MakeSpan(delta).subspan(c * kChunkElements,
                                                           kChunkElements))
                    .ok());
    ++results;
  };

  // a's delta is +1, b's +3 (float32: the mean delta is 2, exactly).
  for (float& v : pa) v += 1.0f;
  const std::vector<float> contribution = pa;
  absl::StatusOr<SyncOutcome> failed;
  std::thread ta([&] { failed = (*a)->Sync(absl::MakeSpan(pa)); });
  // The chunks both gave are final and go to both while a's Sync waits.
  for (uint32_t k = 0; k < kGiven; ++k) {
    v1::SyncResponse response;
    const bool read = stream->Read(&response);
    EXPECT_TRUE(read && response.has_chunk()) << "early result " << k;
    if (!read) break;
    take(response);
  }
  ta.join();
  EXPECT_EQ(results, kGiven);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDeadlineExceeded)
      << failed.status();
  for (size_t j = 0; j < n; ++j) ASSERT_EQ(pa[j], contribution[j]) << j;

  // b completes; the round closes; a's next Sync gets its result.
  for (uint32_t c = kGiven; c < kChunks; ++c) {
    request.mutable_chunk()->set_index(c);
    ASSERT_TRUE(stream->Write(request));
  }
  stream->WritesDone();
  v1::SyncResponse response;
  while (stream->Read(&response)) take(response);
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(results, kChunks);
  absl::StatusOr<SyncOutcome> retried = (*a)->Sync(absl::MakeSpan(pa));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->round, 1u);
  for (size_t j = 0; j < n; ++j) {
    ASSERT_EQ(pa[j], seed[j] + delta[j]) << j;
    if (wire == DType::kFloat32) ASSERT_EQ(delta[j], 2.0f) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Wires, EarlyResultsClientTest,
                         ::testing::Values(DType::kFloat32, DType::kInt8Block),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(LeaveTest, Leave_OpenRoundStopsWaitingForTheLeaver) {
  auto server = StartServer(16);
  const Layout layout = LayoutOfSizes({40});
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(3, std::vector<float>(40, 1.0f));
  for (int i = 0; i < 3; ++i) {
    clients.push_back(
        MakeClient(server->port(), "leave", absl::StrCat("m", i)));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  for (int i = 0; i < 3; ++i)
    std::fill(params[i].begin(), params[i].end(), float(i));
  absl::StatusOr<SyncOutcome> a, b;
  std::thread t0([&] { a = clients[0]->Sync(absl::MakeSpan(params[0])); });
  std::thread t1([&] { b = clients[1]->Sync(absl::MakeSpan(params[1])); });
  // Member 2 leaves without contributing; the round must close with 0 and 1.
  // (Leave is valid at any time, so no ordering with the Syncs is needed.)
  ASSERT_TRUE(clients[2]->Leave().ok());
  t0.join();
  t1.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->contributors, 2u);
  for (float v : params[0]) EXPECT_FLOAT_EQ(v, 0.5f);
  EXPECT_EQ(params[0], params[1]);
}

// What the coordinator reports to raw requests, next to two honest members.
// (Bad input, every field of every request: hostile_input_test.cc.)
class ProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer(kChunk);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    channel_ =
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                  grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Coordinator::NewStub(channel_);
    layout_ = LayoutOfSizes({50, 25});
    // Two honest members, seeded with zeros.
    for (int i = 0; i < 2; ++i) {
      honest_.push_back(
          MakeClient(server_->port(), "job", absl::StrCat("honest", i)));
      ASSERT_TRUE(honest_[i]->Join(layout_).ok());
      params_.emplace_back(75, 0.0f);
      ASSERT_TRUE(honest_[i]->Initialize(absl::MakeSpan(params_[i])).ok());
    }
  }

  // The honest members sync values 1 and 3; the result must be exactly 2.
  void ExpectHonestRoundExact() {
    std::fill(params_[0].begin(), params_[0].end(), 1.0f);
    std::fill(params_[1].begin(), params_[1].end(), 3.0f);
    absl::StatusOr<SyncOutcome> a, b;
    std::thread t([&] { a = honest_[0]->Sync(absl::MakeSpan(params_[0])); });
    b = honest_[1]->Sync(absl::MakeSpan(params_[1]));
    t.join();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    for (int i = 0; i < 2; ++i) {
      for (float v : params_[i]) ASSERT_EQ(v, 2.0f);
    }
  }

  static constexpr uint32_t kChunk = 32;  // 75 elements: chunks of 32, 32, 11
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  Layout layout_;
  std::vector<std::unique_ptr<Client>> honest_;
  std::vector<std::vector<float>> params_;
};

TEST_F(ProtocolTest, GetJobStatus_ReportsMembersAndRounds) {
  ExpectHonestRoundExact();
  v1::GetJobStatusRequest request;
  request.set_job_id("job");
  v1::GetJobStatusResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetJobStatus(&context, request, &response).ok());
  ASSERT_EQ(response.jobs_size(), 1);
  const v1::JobStatus& job = response.jobs(0);
  EXPECT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.state_round(), 1u);
  ASSERT_GE(job.recent_rounds_size(), 2);
  EXPECT_EQ(job.recent_rounds(0).round(), 1u);
  EXPECT_EQ(job.recent_rounds(0).contributors_size(), 2);
  EXPECT_EQ(job.recent_rounds(0).close_reason(), v1::CLOSE_REASON_COMPLETE);
  EXPECT_EQ(job.recent_rounds(1).close_reason(), v1::CLOSE_REASON_SEED);
}

// A client that predates pseudo-gradients says nothing of what it sends (it
// sends parameters): it is refused by a job of pseudo-gradients, and by a
// coordinator whose new jobs take them, with what to upgrade; the job is
// not touched.
v1::JoinRequest OldClientJoin(const std::string& job, const Layout& layout) {
  v1::JoinRequest request;
  request.set_job_id(job);
  request.set_member_name("old");
  request.set_incarnation(9);
  LayoutToProto(layout, request.mutable_layout());
  return request;
}

TEST_F(ProtocolTest, Join_OfAnOldClient_IsRefusedWithWhatToUpgrade) {
  {
    v1::JoinRequest request;
    request = OldClientJoin("job", layout_);
    v1::JoinResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub_->Join(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(),
                HasSubstr("job 'job' takes pseudo-gradients"));
    EXPECT_THAT(s.error_message(),
                HasSubstr("predates pseudo-gradients and sends parameters. "
                          "Upgrade the client library"));
  }
  EXPECT_EQ((*server_->coordinator()->FindJob("job"))->num_members(), 2u);
  ExpectHonestRoundExact();
  // A coordinator whose new jobs take pseudo-gradients (the binary's
  // default) creates none for it.
  ServerOptions options = testkit::BaseServerOptions(kChunk);
  options.coordinator.default_settings.contribution =
      Contribution::kPseudoGradients;
  auto other = testkit::StartServer(std::move(options));
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", other->port()),
                          grpc::InsecureChannelCredentials()));
  v1::JoinResponse response;
  grpc::ClientContext context;
  const grpc::Status s =
      stub->Join(&context, OldClientJoin("new-job", layout_), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("would take (the coordinator's default) "
                        "pseudo-gradients"));
  EXPECT_FALSE(other->coordinator()->FindJob("new-job").ok());
  // And one whose new jobs take parameters lets it in (nothing misread).
  grpc::ClientContext context2;
  EXPECT_TRUE(
      stub_->Join(&context2, OldClientJoin("params-job", layout_), &response)
          .ok());
  EXPECT_EQ(response.settings().contribution(), v1::CONTRIBUTION_PARAMETERS);
}

TEST_F(ProtocolTest, Join_ReportsTheCoordinatorsPolicy) {
  v1::JoinRequest request;
  request.set_job_id("job");
  request.set_member_name("policy");
  request.set_incarnation(9);
  request.mutable_settings()->set_contribution(
      v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  LayoutToProto(layout_, request.mutable_layout());
  v1::JoinResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->Join(&context, request, &response).ok());
  EXPECT_NE(response.state_id(), 0u);
  EXPECT_EQ(response.settings().contribution(),
            v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  EXPECT_EQ(response.policy().max_message_bytes(), 17u << 20);
  EXPECT_EQ(response.policy().lease_ttl_ms(), 30000u);
  EXPECT_EQ(response.policy().min_quorum(), 1u);
  EXPECT_TRUE(response.policy().paced_uploads());
  EXPECT_EQ(response.num_chunks(), 3u);
  EXPECT_EQ(response.num_elements(), 75u);
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// Members that lose their membership join again inside Sync, invisibly to the
// training loop.
TEST(ElasticTest, Sync_AfterMembershipLost_RejoinsAndContributes) {
  auto server = StartServer(16);
  const Layout layout = LayoutOfSizes({40});
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(2, std::vector<float>(40, 1.0f));
  for (int i = 0; i < 2; ++i) {
    clients.push_back(
        MakeClient(server->port(), "elastic", absl::StrCat("m", i)));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  // The coordinator forgets member 1 (as when its lease runs out).
  auto job = server->coordinator()->FindJob("elastic");
  ASSERT_TRUE(job.ok());
  const MemberId old_id = clients[1]->info().member_id;
  ASSERT_TRUE((*job)->Leave(old_id).ok());

  std::fill(params[0].begin(), params[0].end(), 2.0f);
  std::fill(params[1].begin(), params[1].end(), 4.0f);
  absl::StatusOr<SyncOutcome> a, b;
  std::thread t([&] { a = clients[0]->Sync(absl::MakeSpan(params[0])); });
  b = clients[1]->Sync(absl::MakeSpan(params[1]));
  t.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->rejoined);
  EXPECT_NE(clients[1]->info().member_id, old_id);
  // Member 1 joined again before round 1 opened or while it was open; either
  // way both end with the same parameters, and round 1 counted member 0.
  EXPECT_TRUE(a->contributed);
  EXPECT_EQ(params[0], params[1]);
  if (b->contributed) {
    for (float v : params[0]) EXPECT_EQ(v, 3.0f);
  }
}

TEST(ElasticTest, Sync_CoordinatorRestartedWithoutState_ReseedsAndContinues) {
  auto server = StartServer(16);
  const int port = server->port();
  const Layout layout = LayoutOfSizes({40});
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(2, std::vector<float>(40, 1.0f));
  // With a rendezvous of 2, a job the coordinator re-creates after losing it
  // also starts only once both members are back.
  for (int i = 0; i < 2; ++i) {
    clients.push_back(MakeClient(port, "restart", absl::StrCat("m", i), 1, 2));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  for (int round = 1; round <= 3; ++round) {
    std::thread t(
        [&] { ASSERT_TRUE(clients[1]->Sync(absl::MakeSpan(params[1])).ok()); });
    ASSERT_TRUE(clients[0]->Sync(absl::MakeSpan(params[0])).ok());
    t.join();
  }
  EXPECT_EQ(clients[0]->state_round(), 3u);
  // Restart on the same port, state lost.
  server->Shutdown(absl::ZeroDuration());
  server.reset();
  ServerOptions options;
  options.listen_address = absl::StrCat("127.0.0.1:", port);
  options.coordinator.default_settings.chunk_elements = 16;
  auto restarted = CoordinatorServer::Start(options);
  ASSERT_TRUE(restarted.ok()) << restarted.status();

  // Each member trains on (here: sets its values) and syncs until it holds
  // round 4, as a training loop would. Whoever comes back first re-seeds the
  // job at round 3 (numbering goes on); the other contributes or adopts; the
  // re-seed's regather (2 contributed to round 3) makes round 4 wait for
  // both, and both average every round after.
  std::vector<absl::StatusOr<SyncOutcome>> first(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      bool first_sync = true;
      while (clients[i]->state_round() < 4 || first_sync) {
        std::fill(params[i].begin(), params[i].end(), 5.0f + 2 * i);
        absl::StatusOr<SyncOutcome> o =
            clients[i]->Sync(absl::MakeSpan(params[i]));
        if (first_sync) first[i] = o;
        first_sync = false;
        if (!o.ok()) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(first[i].ok()) << first[i].status();
    EXPECT_TRUE(first[i]->rejoined) << "member " << i;
    EXPECT_EQ(first[i]->round, 4u) << "member " << i;
    EXPECT_TRUE(first[i]->contributed) << "member " << i;
    EXPECT_EQ(clients[i]->state_round(), 4u);
  }
  // Round 4 averaged both: 5 and 7.
  EXPECT_EQ(params[0], params[1]);
  for (float v : params[0]) EXPECT_EQ(v, 6.0f);
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

TEST(ElasticTest, Sync_CoordinatorRestartedWithStateDir_ResumesRoundNumbering) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/lsgd-restart-", getpid());
  auto start = [&](int port) {
    ServerOptions options;
    options.listen_address = absl::StrCat("127.0.0.1:", port);
    options.coordinator.default_settings.chunk_elements = 16;
    // The restored job regathers until round 4's two members are back, or
    // for one lease: a long one, so that a member slow to reconnect on a
    // busy machine still takes part in round 5.
    options.coordinator.policy.lease_ttl = absl::Seconds(30);
    options.state_dir = dir;
    auto server = CoordinatorServer::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return *std::move(server);
  };
  auto server = start(0);
  const int port = server->port();
  const Layout layout = LayoutOfSizes({40, 3});
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> params(2, std::vector<float>(43, 1.0f));
  for (int i = 0; i < 2; ++i) {
    clients.push_back(MakeClient(port, "ckpt", absl::StrCat("m", i)));
    ASSERT_TRUE(clients[i]->Join(layout).ok());
    ASSERT_TRUE(clients[i]->Initialize(absl::MakeSpan(params[i])).ok());
  }
  for (int round = 1; round <= 4; ++round) {
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 43; ++j) params[i][j] = Value(i, j, round);
    }
    std::thread t(
        [&] { ASSERT_TRUE(clients[1]->Sync(absl::MakeSpan(params[1])).ok()); });
    ASSERT_TRUE(clients[0]->Sync(absl::MakeSpan(params[0])).ok());
    t.join();
  }
  const std::vector<float> state4 = params[0];
  server->coordinator()->FlushCheckpoints();
  // A crash: nothing beyond the checkpoints survives.
  server->Shutdown(absl::ZeroDuration());
  server.reset();
  server = start(port);

  // A newcomer sees the restored state at round 4.
  auto newcomer = MakeClient(port, "ckpt", "newcomer");
  ASSERT_TRUE(newcomer->Join(layout).ok());
  EXPECT_TRUE(newcomer->info().has_state);
  EXPECT_EQ(newcomer->info().state_round, 4u);
  std::vector<float> fetched(43);
  ASSERT_TRUE(newcomer->FetchState(absl::MakeSpan(fetched)).ok());
  EXPECT_EQ(fetched, state4);
  ASSERT_TRUE(newcomer->Leave().ok());

  // The old members join again and contribute to round 5.
  std::fill(params[0].begin(), params[0].end(), 2.0f);
  std::fill(params[1].begin(), params[1].end(), 4.0f);
  absl::StatusOr<SyncOutcome> a, b;
  std::thread t([&] { b = clients[1]->Sync(absl::MakeSpan(params[1])); });
  a = clients[0]->Sync(absl::MakeSpan(params[0]));
  t.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(a->rejoined);
  EXPECT_EQ(a->round, 5u);
  EXPECT_EQ(b->round, 5u);
  EXPECT_EQ(params[0], params[1]);
  clients.clear();
  server.reset();  // its checkpointer may still be writing into `dir`
  std::filesystem::remove_all(dir);
}

// A stale delta over the wire: member b misses round 1 (its deadline closes
// it with a alone), then contributes its delta against the seed; with
// max_staleness 2 it is banked into round 2 with weight 1/2 and b is
// answered at once with round 1's state whole (contributed, staleness 1).
// b then contributes to round 2 from that state, next to a, and both hold
// the same state: 3 + (1 * 1 + 0.5 * 6 + 1 * 2) / 2.5. The job's goodput
// counts every step.
TEST(StaleContributionTest, OverTheWire_MergedAndEveryMemberHoldsTheState) {
  constexpr size_t n = 300;
  ServerOptions server_options = testkit::BaseServerOptions(128);
  server_options.coordinator.policy.round_deadline = absl::Seconds(1);
  auto server = testkit::StartServer(std::move(server_options));
  const Layout layout = LayoutOfSizes({static_cast<int64_t>(n)});
  std::vector<std::vector<float>> params(2, std::vector<float>(n, 1.0f));
  std::vector<std::unique_ptr<Client>> clients =
      JoinedClients(*server, "stale", layout, params, [](ClientOptions& o) {
        o.settings.contribution = Contribution::kPseudoGradients;
        o.settings.max_staleness = 2;
        // Without history the outlier guard holds a chunk until the
        // round's deadline, and a round a stale Sync opened has none
        // before a fresh one: m1's would wait for m0's, which this test
        // sends after it.
        o.settings.outlier_ratio = kOutlierGuardOff;
        o.sync_timeout = absl::Seconds(20);
      });
  ASSERT_EQ(clients.size(), 2u);
  // Round 1: m0 alone, at the deadline.
  for (float& v : params[0]) v += 2.0f;
  absl::StatusOr<SyncOutcome> first =
      clients[0]->Sync(absl::MakeSpan(params[0]), SyncWork{16});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->contributors, 1u);
  // m1, still from the seed: banked, answered with round 1's state.
  for (float& v : params[1]) v += 6.0f;
  absl::StatusOr<SyncOutcome> stale =
      clients[1]->Sync(absl::MakeSpan(params[1]), SyncWork{16});
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_TRUE(stale->contributed);
  EXPECT_EQ(stale->round, 1u);
  EXPECT_EQ(stale->staleness, 1u);
  EXPECT_EQ(params[1], params[0]);
  // Round 2: both from round 1.
  params[0].assign(n, params[0][0] + 1.0f);
  params[1].assign(n, params[1][0] + 2.0f);
  std::vector<absl::StatusOr<SyncOutcome>> outcomes(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      outcomes[i] = clients[i]->Sync(absl::MakeSpan(params[i]), SyncWork{16});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(outcomes[i].ok()) << i << ": " << outcomes[i].status();
    EXPECT_TRUE(outcomes[i]->contributed) << i;
    EXPECT_EQ(outcomes[i]->round, 2u) << i;
    EXPECT_EQ(outcomes[i]->contributors, 2u) << i;
    EXPECT_EQ(outcomes[i]->staleness, 0u) << i;
  }
  EXPECT_EQ(params[0], params[1]);
  EXPECT_NEAR(params[0][0], 3.0f + 6.0f / 2.5f, 1e-5f);
  // Both go on from round 2's state.
  for (int i = 0; i < 2; ++i) {
    for (float& v : params[i]) v += 1.0f;
    threads[i] = std::thread([&, i] {
      outcomes[i] = clients[i]->Sync(absl::MakeSpan(params[i]), SyncWork{16});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(outcomes[i].ok()) << i << ": " << outcomes[i].status();
    EXPECT_EQ(outcomes[i]->round, 3u);
    EXPECT_EQ(outcomes[i]->staleness, 0u);
  }
  EXPECT_EQ(params[0], params[1]);
  EXPECT_NEAR(params[0][0], 3.0f + 6.0f / 2.5f + 1.0f, 1e-5f);
  v1::GetJobStatusRequest request;
  request.set_job_id("stale");
  v1::GetJobStatusResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(testkit::RawClient(testkit::Channel(*server))
                  .stub()
                  ->GetJobStatus(&context, request, &response)
                  .ok());
  ASSERT_EQ(response.jobs_size(), 1);
  EXPECT_EQ(response.jobs(0).steps().merged(), 6u * 16u);
  EXPECT_EQ(response.jobs(0).steps().merged_stale(), 16u);
  EXPECT_DOUBLE_EQ(response.jobs(0).goodput(), 1.0);
}

// A round's deadline closes it when it passes, not at the next periodic
// tick: with a tick every hour, a round that waits for a member that never
// comes still closes at its 300 ms deadline (the job asks the server's
// TickAlarm for a tick then).
TEST(DeadlineTest, ClosesAtTheDeadlineNotAtTheNextTick) {
  constexpr size_t n = 64;
  ServerOptions server_options = testkit::BaseServerOptions(128);
  server_options.tick_interval = absl::Hours(1);
  server_options.coordinator.policy.round_deadline = absl::Milliseconds(300);
  auto server = testkit::StartServer(std::move(server_options));
  const Layout layout = LayoutOfSizes({static_cast<int64_t>(n)});
  std::vector<std::vector<float>> params(2, std::vector<float>(n, 1.0f));
  std::vector<std::unique_ptr<Client>> clients = JoinedClients(
      *server, "deadline", layout, params,
      [](ClientOptions& o) { o.sync_timeout = absl::Seconds(30); });
  ASSERT_EQ(clients.size(), 2u);
  // m1 never syncs: m0's round closes at the deadline.
  std::fill(params[0].begin(), params[0].end(), 5.0f);
  absl::StatusOr<SyncOutcome> alone =
      clients[0]->Sync(absl::MakeSpan(params[0]));
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->round, 1u);
  EXPECT_EQ(alone->contributors, 1u);
  EXPECT_EQ(params[0][0], 5.0f);
}

// TickAlarm: WaitUntil wakes at the earliest time asked for (from another
// thread while it waits, too), else at its periodic time; Stop ends it.
TEST(TickAlarmTest, WakesAtTheEarliestAskedTimeAndStops) {
  TickAlarm alarm;
  const absl::Time far = absl::Now() + absl::Hours(1);
  alarm.After(absl::Milliseconds(10));
  alarm.After(absl::Minutes(10));  // later: the earlier one stays
  EXPECT_TRUE(alarm.WaitUntil(far));
  EXPECT_LT(absl::Now(), far);
  // Asked while it waits.
  std::thread asker([&] { alarm.After(absl::Milliseconds(20)); });
  EXPECT_TRUE(alarm.WaitUntil(far));
  asker.join();
  EXPECT_LT(absl::Now(), far);
  // The periodic time, when nothing is asked for.
  EXPECT_TRUE(alarm.WaitUntil(absl::Now() + absl::Milliseconds(5)));
  std::thread stopper([&] { alarm.Stop(); });
  EXPECT_FALSE(alarm.WaitUntil(far));
  stopper.join();
  EXPECT_FALSE(alarm.WaitUntil(far)) << "stays stopped";
}

}  // namespace
}  // namespace localsgd
