// Sharded coordinators (docs/design.md "Scale out"): S in-process replicas on
// loopback, each owning the chunks i with i mod S == its shard, and clients
// that sync with all of them in parallel. Checked against weighted means the
// test computes itself, across a replica restart with and without its state.
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "src/clock.h"
#include "src/job.h"
#include "src/layout.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

constexpr uint32_t kChunk = 7;

Layout TestLayout() {  // 78 elements: 12 chunks of 7, the last 1
  return MakeLayout({{"w", {10, 5}, DType::kFloat32},
                     {"b", {25}, DType::kFloat32},
                     {"s", {3}, DType::kFloat32}});
}

// Member `m`'s value at element `j` before round `round`.
float Value(int m, uint64_t j, int round) {
  return std::cos(0.01f * static_cast<float>(j) + 0.9f * m) * (1.0f + m) +
         0.125f * round;
}

class ShardTest : public ::testing::Test {
 protected:
  void TearDown() override {
    // Threads a failed test left blocked end once the replicas are gone
    // (their retries give up after max_retry_time).
    if (!threads_.empty()) {
      for (auto& server : servers_) server->Shutdown(absl::ZeroDuration());
      for (std::thread& t : threads_) t.join();
    }
    clients_.clear();
    servers_.clear();
    for (const std::string& d : dirs_) std::filesystem::remove_all(d);
  }

  // Starts replica `i` of `count` on `port` (0: any), with a state dir if
  // `with_state`, on `clock` (null: the real one).
  std::unique_ptr<CoordinatorServer> StartReplica(uint32_t i, uint32_t count,
                                                  int port, bool with_state,
                                                  Clock* clock = nullptr) {
    ServerOptions options = testkit::BaseServerOptions(kChunk);
    options.listen_address = absl::StrCat("127.0.0.1:", port);
    options.coordinator.shard = ShardSpec{i, count};
    options.coordinator.clock = clock;
    // A restored replica regathers until its last round's members are back,
    // or for one lease: a long one, so that a member slow to reconnect on a
    // busy machine still takes part in the next round.
    options.coordinator.policy.lease_ttl = absl::Seconds(30);
    if (with_state) {
      const std::string dir =
          absl::StrCat(::testing::TempDir(), "/shard_test.", getpid(), ".", i);
      if (port == 0) {
        std::filesystem::remove_all(dir);
        dirs_.push_back(dir);
      }
      options.state_dir = dir;
    }
    return testkit::StartServer(std::move(options));
  }

  void StartReplicas(uint32_t count, bool with_state = false) {
    for (uint32_t i = 0; i < count; ++i) {
      servers_.push_back(StartReplica(i, count, 0, with_state));
      ASSERT_NE(servers_.back(), nullptr);
    }
  }

  // Addresses of the replicas, rotated by `rotate` (the order is the
  // client's business: each replica says which shard it is).
  std::vector<std::string> Addresses(size_t rotate = 0) const {
    std::vector<std::string> out;
    for (size_t k = 0; k < servers_.size(); ++k) {
      out.push_back(absl::StrCat(
          "127.0.0.1:", servers_[(k + rotate) % servers_.size()]->port()));
    }
    return out;
  }

  absl::StatusOr<std::unique_ptr<Client>> NewClient(
      int m, double weight, std::vector<std::string> replicas) {
    ClientOptions options;
    options.replicas = std::move(replicas);
    options.job_id = "sharded";
    options.member_name = absl::StrCat("m", m);
    options.weight = weight;
    options.max_retry_time = absl::Seconds(20);
    options.settings = settings_;
    return Client::Create(options);
  }

  // Members 0..n-1 join (member m lists the replicas rotated by m) and
  // initialize from member 0's seed.
  void JoinMembers(const std::vector<double>& weights) {
    weights_ = weights;
    const Layout layout = TestLayout();
    n_ = 78;
    params_.assign(weights.size(), std::vector<float>(n_));
    for (size_t m = 0; m < weights.size(); ++m) {
      auto client = NewClient(static_cast<int>(m), weights[m], Addresses(m));
      ASSERT_TRUE(client.ok()) << client.status();
      clients_.push_back(*std::move(client));
      ASSERT_TRUE(clients_[m]->Join(layout).ok());
      EXPECT_EQ(clients_[m]->num_replicas(), servers_.size());
      EXPECT_EQ(clients_[m]->info().num_elements, n_);
      EXPECT_EQ(clients_[m]->info().num_chunks, 12u);
    }
    for (uint64_t j = 0; j < n_; ++j) params_[0][j] = Value(0, j, -1);
    for (size_t m = 0; m < clients_.size(); ++m) {
      ASSERT_TRUE(clients_[m]->Initialize(absl::MakeSpan(params_[m])).ok());
      EXPECT_EQ(params_[m], params_[0]) << "member " << m;
    }
  }

  // Member m's parameters become Value(m, ., round).
  void SetValues(int round) {
    for (size_t m = 0; m < clients_.size(); ++m) {
      for (uint64_t j = 0; j < n_; ++j) {
        params_[m][j] = Value(static_cast<int>(m), j, round);
      }
    }
  }

  // Member m's Sync, in a thread of threads_, into *outcome.
  void StartSync(size_t m, absl::StatusOr<SyncOutcome>* outcome) {
    threads_.emplace_back([this, m, outcome] {
      *outcome = clients_[m]->Sync(absl::MakeSpan(params_[m]));
    });
  }

  // Replica `i`'s view of the job (empty before any member joined it).
  JobStatusSnapshot ReplicaStatus(size_t i) {
    auto job = servers_[i]->coordinator()->FindJob("sharded");
    return job.ok() ? (*job)->Status(/*max_rounds=*/4) : JobStatusSnapshot();
  }

  // Every member syncs Value(m, ., round) in parallel; returns the outcomes.
  std::vector<SyncOutcome> SyncRound(int round) {
    SetValues(round);
    std::vector<absl::StatusOr<SyncOutcome>> outcomes(clients_.size());
    std::vector<std::thread> threads;
    for (size_t m = 0; m < clients_.size(); ++m) {
      threads.emplace_back([&, m] {
        outcomes[m] = clients_[m]->Sync(absl::MakeSpan(params_[m]));
      });
    }
    for (auto& t : threads) t.join();
    std::vector<SyncOutcome> out;
    for (auto& o : outcomes) {
      EXPECT_TRUE(o.ok()) << o.status();
      out.push_back(o.ok() ? *o : SyncOutcome());
    }
    return out;
  }

  // Every member holds the weighted mean of round `round`'s values.
  void ExpectExactMean(int round) {
    double total = 0;
    for (double w : weights_) total += w;
    for (uint64_t j = 0; j < n_; ++j) {
      double sum = 0;
      for (size_t m = 0; m < weights_.size(); ++m) {
        sum += weights_[m] * Value(static_cast<int>(m), j, round);
      }
      const double want = sum / total;
      for (size_t m = 0; m < params_.size(); ++m) {
        ASSERT_NEAR(params_[m][j], want, 2e-6 * (1 + std::abs(want)))
            << "member " << m << " element " << j << " round " << round;
      }
    }
  }

  // Declared before the servers that may run on it: outlives them.
  FakeClock clock_;
  std::vector<std::unique_ptr<CoordinatorServer>> servers_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::thread> threads_;
  std::vector<std::vector<float>> params_;
  std::vector<double> weights_;
  std::vector<std::string> dirs_;
  uint64_t n_ = 0;
  // One replica against three, OUTER_NESTEROV over `wire`: bit for bit.
  void OuterNesterovShardedEqualsOne(DType wire);
  // What the members ask for. The outlier guard off: members send
  // unrelated values (one's delta may be many times another's in a chunk),
  // which the guard would rightly refuse.
  JobSettings settings_ = [] {
    JobSettings s;
    s.outlier_ratio = kOutlierGuardOff;
    return s;
  }();
};

class ShardCountTest : public ShardTest,
                       public ::testing::WithParamInterface<uint32_t> {};

TEST_P(ShardCountTest, Sync_EveryMemberHoldsTheWeightedMean) {
  const uint32_t s = GetParam();
  StartReplicas(s);
  JoinMembers({1.0, 2.0, 0.5});
  for (int round = 1; round <= 3; ++round) {
    const std::vector<SyncOutcome> outcomes = SyncRound(round);
    for (const SyncOutcome& o : outcomes) {
      EXPECT_EQ(o.round, static_cast<RoundId>(round));
      EXPECT_TRUE(o.contributed);
      EXPECT_EQ(o.contributors, 3u);
      // Every chunk went out and came back once, whichever replica has it.
      EXPECT_EQ(o.bytes_sent, 4 * n_);
      EXPECT_EQ(o.bytes_received, 4 * n_);
    }
    ExpectExactMean(round);
  }
  // Each replica holds its share of the model, no more.
  for (uint32_t i = 0; i < s; ++i) {
    auto job = servers_[i]->coordinator()->FindJob("sharded");
    ASSERT_TRUE(job.ok());
    EXPECT_EQ((*job)->geometry().num_elements(),
              ShardElements(n_, kChunk, ShardSpec{i, s}));
  }
}

INSTANTIATE_TEST_SUITE_P(Replicas, ShardCountTest, ::testing::Values(1, 2, 3),
                         [](const auto& info) {
                           return absl::StrCat("S", info.param);
                         });

// The outer optimizer's momentum and the coordinator's error feedback are
// per element, so a sharded job (each replica holding its chunks' momentum
// and residual) computes exactly what one coordinator does: OUTER_NESTEROV
// over an int4 wire and over a sparse one (4 of a chunk's 16 values kept),
// two members of weight 1 (sums independent of arrival order), 3 rounds,
// one replica against three, bit for bit.
TEST_F(ShardTest, OuterNesterovCodes_ShardedEqualsOneCoordinatorBitForBit) {
  for (DType wire : {DType::kInt4Block, DType::kSparse4}) {
    SCOPED_TRACE(DTypeName(wire));
    OuterNesterovShardedEqualsOne(wire);
  }
}

void ShardTest::OuterNesterovShardedEqualsOne(DType wire) {
  settings_.mode = AveragingMode::kOuterNesterov;
  settings_.wire_dtype = wire;
  settings_.sparse_keep = 1024;
  std::vector<std::vector<std::vector<float>>> held;  // [shards][round]
  for (uint32_t s : {1u, 3u}) {
    StartReplicas(s);
    JoinMembers({1.0, 1.0});
    held.emplace_back();
    for (int round = 1; round <= 3; ++round) {
      for (const SyncOutcome& o : SyncRound(round)) {
        EXPECT_TRUE(o.contributed);
        EXPECT_EQ(o.contributors, 2u);
      }
      ASSERT_EQ(params_[0], params_[1]) << "S=" << s << " round " << round;
      held.back().push_back(params_[0]);
    }
    // A replica holds the momentum of its own chunks only (shard 0's, whose
    // member id the client reports).
    {
      auto job = servers_[0]->coordinator()->FindJob("sharded");
      ASSERT_TRUE(job.ok());
      auto state = (*job)->GetState(clients_[0]->info().member_id);
      ASSERT_TRUE(state.ok()) << state.status();
      EXPECT_EQ((*state)->momentum.size(),
                ShardElements(n_, kChunk, ShardSpec{0, s}));
    }
    clients_.clear();
    servers_.clear();
  }
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(held[1][round], held[0][round]) << "round " << round + 1;
  }
  // And the rule moved the state (not a no-op).
  EXPECT_NE(held[0][2], held[0][0]);
}

// A replica killed and restarted on its state dir resumes its rounds: the
// members go on to exact means, round numbering continues.
TEST_F(ShardTest, ReplicaRestart_WithState_ResumesExactly) {
  StartReplicas(2, /*with_state=*/true);
  JoinMembers({1.0, 3.0});
  SyncRound(1);
  ExpectExactMean(1);
  const int port = servers_[1]->port();
  servers_[1]->Shutdown(absl::ZeroDuration());
  servers_[1] = StartReplica(1, 2, port, /*with_state=*/true);
  ASSERT_NE(servers_[1], nullptr);
  for (int round = 2; round <= 3; ++round) {
    const std::vector<SyncOutcome> outcomes = SyncRound(round);
    for (const SyncOutcome& o : outcomes) {
      EXPECT_EQ(o.round, static_cast<RoundId>(round));
    }
    ExpectExactMean(round);
  }
}

// Without a state dir the restarted replica has no job: the members re-join
// it and re-seed its chunks from their parameters (MEAN mode); they end the
// round identical, and the next round is an exact mean again.
TEST_F(ShardTest, ReplicaRestart_WithoutState_ReseedsAndConverges) {
  StartReplicas(2);
  JoinMembers({1.0, 1.0, 1.0});
  SyncRound(1);
  ExpectExactMean(1);
  const int port = servers_[0]->port();
  servers_[0]->Shutdown(absl::ZeroDuration());
  servers_[0] = StartReplica(0, 2, port, /*with_state=*/false);
  ASSERT_NE(servers_[0], nullptr);
  const std::vector<SyncOutcome> outcomes = SyncRound(2);
  bool any_rejoined = false;
  for (const SyncOutcome& o : outcomes) any_rejoined |= o.rejoined;
  EXPECT_TRUE(any_rejoined);
  for (size_t m = 1; m < params_.size(); ++m) {
    EXPECT_EQ(params_[m], params_[0]) << "member " << m;
  }
  SyncRound(3);
  ExpectExactMean(3);
}

// The interleaving that hung a job in an earlier build, forced: replica 0
// restarts without its state, one member (m2) re-joins it, re-seeds it and
// contributes before the others have noticed. The re-seed continues the
// job's numbering (the state is round 1, as on replica 1) and the job
// regathers until round 1's three contributors are back, so m2 does not
// close round 2 alone; m0 and m1 re-join and take part in the same round 2.
// Replica 0 runs on a fake clock that the test never advances: no lease
// runs out, and the regather ends only by the members' return.
TEST_F(ShardTest, ReplicaRestart_WithoutState_FirstReseederWaitsForTheOthers) {
  StartReplicas(2);
  JoinMembers({1.0, 2.0, 0.5});
  SyncRound(1);
  ExpectExactMean(1);
  const int port = servers_[0]->port();
  servers_[0]->Shutdown(absl::ZeroDuration());
  servers_[0] = StartReplica(0, 2, port, /*with_state=*/false, &clock_);
  ASSERT_NE(servers_[0], nullptr);

  SetValues(2);
  std::vector<absl::StatusOr<SyncOutcome>> outcomes(3);
  StartSync(2, &outcomes[2]);
  ASSERT_TRUE(testkit::AwaitCondition([&] {
    const JobStatusSnapshot s = ReplicaStatus(0);
    return s.has_state && s.round_open &&
           s.open_round_contributed == std::vector<std::string>{"m2"};
  })) << "m2 never re-seeded replica 0 and contributed to its open round";
  {
    const JobStatusSnapshot s = ReplicaStatus(0);
    EXPECT_EQ(s.state_round, 1u) << "the re-seed continues round 1";
    EXPECT_EQ(s.open_round, 2u);
    EXPECT_NE(s.open_round_decision.why_open.find("regathering"),
              std::string::npos)
        << s.open_round_decision.why_open;
  }
  // m2 saw 3 contributors in round 1: the regather ends when m0 and m1 are
  // back (the fake clock never ends it).
  StartSync(0, &outcomes[0]);
  StartSync(1, &outcomes[1]);
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  for (size_t m = 0; m < outcomes.size(); ++m) {
    ASSERT_TRUE(outcomes[m].ok())
        << "member " << m << ": " << outcomes[m].status();
    EXPECT_EQ(outcomes[m]->round, 2u) << "member " << m;
    EXPECT_TRUE(outcomes[m]->contributed) << "member " << m;
    EXPECT_EQ(outcomes[m]->contributors, 3u) << "member " << m;
    EXPECT_TRUE(outcomes[m]->rejoined) << "member " << m;
  }
  ExpectExactMean(2);
  const std::vector<SyncOutcome> next = SyncRound(3);
  for (const SyncOutcome& o : next) EXPECT_EQ(o.round, 3u);
  ExpectExactMean(3);
}

TEST_F(ShardTest, Join_MissingReplica_ReturnsFailedPrecondition) {
  StartReplicas(2);
  auto client = NewClient(0, 1, {Addresses()[0]});
  ASSERT_TRUE(client.ok());
  absl::Status s = (*client)->Join(TestLayout());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("list every replica"), std::string::npos) << s;
}

TEST_F(ShardTest, Join_TwoReplicasWithOneShard_ReturnsFailedPrecondition) {
  servers_.push_back(StartReplica(0, 2, 0, false));
  servers_.push_back(StartReplica(0, 2, 0, false));
  auto client = NewClient(0, 1, Addresses());
  ASSERT_TRUE(client.ok());
  absl::Status s = (*client)->Join(TestLayout());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("both shard 0"), std::string::npos) << s;
}

TEST(ResolveReplicaAddressesTest, Localhost_ResolvesToLoopback) {
  auto r = ResolveReplicaAddresses("localhost:50051");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_FALSE(r->empty());
  for (const std::string& a : *r) {
    EXPECT_TRUE(a == "127.0.0.1:50051" || a == "[::1]:50051") << a;
  }
  EXPECT_EQ(ResolveReplicaAddresses("localhost").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace localsgd
