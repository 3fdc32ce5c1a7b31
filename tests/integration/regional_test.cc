// Regional coordinators end to end, over the real gRPC service: two regional
// coordinators (--upstream) of two members each, members of one upstream
// job, against a flat coordinator with the same four members.
//
//   - a two-level MEAN is the flat weighted mean within float32 rounding
//     (both checked against a double-precision computation), with weights
//     that differ within and between regions; every member of both regions
//     holds the upstream state bit for bit after every round, and a late
//     joiner of a region fetches the same bits;
//   - under OUTER_NESTEROV upstream (the outer rule at the top, MEAN in the
//     regions), every member holds the upstream state bit for bit;
//   - a regional coordinator killed between rounds and restarted from its
//     checkpoint goes on: its members hold the upstream state again, and
//     their contributions count again upstream;
//   - a region that stops: the upstream job goes on without it;
//   - the upstream killed between rounds and restarted from its
//     checkpoint: the round in flight goes through, the regions go on;
//     down for longer than the links' retries: the round fails UNAVAILABLE
//     and the members retry it until it goes through;
//   - the region's download pipelined: the upstream's result chunks reach
//     a region's members before the upstream round's whole answer, and
//     every member still holds the upstream state bit for bit;
//   - each region's status names its upstream, the upstream's lists the
//     regions as its members;
//   - a regional job refuses settings other than MEAN over float32 with
//     FAILED_PRECONDITION, naming them.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "server/upstream_link.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kChunkElements = 3000;
constexpr uint64_t kN = 10000;
constexpr char kJob[] = "regional";

// Member i's change in round r at element j.
float Change(int i, int r, uint64_t j) {
  const float x = static_cast<float>(j);
  return 1e-2f * std::sin(0.37f * x + 1.3f * i + 0.71f * r) *
         (1.0f + static_cast<float>((j * 7 + i * 3 + r) % 11));
}

std::vector<float> Theta0() {
  std::vector<float> theta(kN);
  for (uint64_t j = 0; j < kN; ++j) {
    theta[j] = std::cos(0.01f * static_cast<float>(j));
  }
  return theta;
}

ServerOptions Options(uint32_t rendezvous, AveragingMode mode,
                      const std::string& state_dir = "") {
  ServerOptions options = testkit::BaseServerOptions(kChunkElements);
  JobSettings& s = options.coordinator.default_settings;
  s.contribution = Contribution::kPseudoGradients;
  s.wire_dtype = DType::kFloat32;
  s.mode = mode;
  s.outer_lr = 0.7f;
  s.outer_momentum = 0.5f;
  s.rendezvous_members = rendezvous;
  options.coordinator.policy.lease_ttl = absl::Seconds(3);
  options.state_dir = state_dir;
  return options;
}

// The upstream's client options for a region named `name`.
ClientOptions UpstreamOptions(const CoordinatorServer& upstream,
                              const std::string& name) {
  return testkit::BaseClientOptions(upstream, kJob, name);
}

struct Member {
  std::unique_ptr<Client> client;
  std::vector<float> params;
  int index = 0;  // which Change it adds
};

// `early`, if not null, counts the result chunks the member gets before
// its rounds' result messages (ClientOptions::on_early_result).
std::unique_ptr<Client> Joined(const CoordinatorServer& server,
                               const std::string& name, double weight,
                               std::atomic<uint64_t>* early = nullptr) {
  ClientOptions options = testkit::BaseClientOptions(server, kJob, name);
  options.settings.contribution = Contribution::kPseudoGradients;
  options.weight = weight;
  if (early != nullptr) {
    options.on_early_result = [early](uint64_t, absl::Span<const float>) {
      early->fetch_add(1);
    };
  }
  options.max_retry_time = absl::Seconds(20);
  auto client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  absl::Status s = (*client)->Join(testkit::LayoutOfSizes({kN}));
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? *std::move(client) : nullptr;
}

// Initializes every member at once (each region's first seeds it, and the
// upstream job through it).
void InitializeAll(std::vector<Member*> members) {
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(members.size());
  for (size_t k = 0; k < members.size(); ++k) {
    threads.emplace_back([&, k] {
      status[k] =
          members[k]->client->Initialize(absl::MakeSpan(members[k]->params));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) EXPECT_TRUE(s.ok()) << s;
}

// Every member adds its change for round r and syncs, all at once.
std::vector<absl::StatusOr<SyncOutcome>> SyncAll(std::vector<Member*> members,
                                                 int r) {
  std::vector<absl::StatusOr<SyncOutcome>> out(members.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < members.size(); ++k) {
    Member& m = *members[k];
    for (uint64_t j = 0; j < kN; ++j) m.params[j] += Change(m.index, r, j);
    threads.emplace_back([&, k] {
      out[k] = members[k]->client->Sync(absl::MakeSpan(members[k]->params));
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// Two regions of two members under one upstream, and the same four members
// flat: weights 1 and 3 in region a, 2 and 5 in region b (4 against 7: the
// regions weigh what their members do, not one each).
class RegionalTest : public ::testing::Test {
 protected:
  void Start(AveragingMode upstream_mode) {
    upstream_ = testkit::StartServer(Options(2, upstream_mode, upstream_dir_));
    ASSERT_NE(upstream_, nullptr);
    for (int g = 0; g < 2; ++g) {
      links_[g] = std::make_unique<UpstreamLinkFactory>(
          UpstreamOptions(*upstream_, absl::StrCat("region-", g)));
      ServerOptions options = Options(2, AveragingMode::kMean, dirs_[g]);
      options.coordinator.upstream = links_[g].get();
      regions_[g] = testkit::StartServer(std::move(options));
      ASSERT_NE(regions_[g], nullptr);
    }
    const double weights[4] = {1, 3, 2, 5};
    for (int i = 0; i < 4; ++i) {
      members_[i].index = i;
      members_[i].params = Theta0();
      members_[i].client = Joined(*regions_[i / 2], absl::StrCat("m", i),
                                  weights[i], &early_[i]);
      ASSERT_NE(members_[i].client, nullptr);
    }
    InitializeAll(all());
  }

  std::vector<Member*> all() {
    return {&members_[0], &members_[1], &members_[2], &members_[3]};
  }

  // Every member syncs round r, and each Sync succeeds.
  void SyncAllOk(int r) {
    auto out = SyncAll(all(), r);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(out[i].ok()) << "round " << r << ": " << out[i].status();
    }
  }

  // `server` dies with its checkpoints written; returns the port it had.
  static int Crash(std::unique_ptr<CoordinatorServer>& server) {
    const int port = server->port();
    server->coordinator()->FlushCheckpoints();
    server->Shutdown(absl::ZeroDuration());
    server.reset();
    return port;
  }

  // `options` on `port` (a coordinator started again where it was).
  static ServerOptions OnPort(ServerOptions options, int port) {
    options.listen_address = absl::StrCat("127.0.0.1:", port);
    return options;
  }

  // The upstream job's state.
  std::vector<float> UpstreamState() {
    std::vector<float> state(kN);
    ClientOptions options = UpstreamOptions(*upstream_, "watcher");
    options.settings.contribution = Contribution::kPseudoGradients;
    auto watcher = Client::Create(options);
    EXPECT_TRUE(watcher.ok()) << watcher.status();
    if (!watcher.ok()) return state;
    EXPECT_TRUE((*watcher)->Join(testkit::LayoutOfSizes({kN})).ok());
    EXPECT_TRUE((*watcher)->FetchState(absl::MakeSpan(state)).ok());
    EXPECT_TRUE((*watcher)->Leave().ok());
    return state;
  }

  std::string dirs_[2];
  std::string upstream_dir_;
  std::unique_ptr<CoordinatorServer> upstream_;
  std::unique_ptr<UpstreamLinkFactory> links_[2];
  std::unique_ptr<CoordinatorServer> regions_[2];
  Member members_[4];
  std::atomic<uint64_t> early_[4]{};
};

TEST_F(RegionalTest, TwoLevelMean_EqualsFlatWeightedMean_MembersIdentical) {
  Start(AveragingMode::kMean);
  if (HasFatalFailure()) return;
  // The same four members, flat.
  auto flat = testkit::StartServer(Options(4, AveragingMode::kMean));
  ASSERT_NE(flat, nullptr);
  const double weights[4] = {1, 3, 2, 5};
  Member flat_members[4];
  std::vector<Member*> flats;
  for (int i = 0; i < 4; ++i) {
    flat_members[i].index = i;
    flat_members[i].params = Theta0();
    flat_members[i].client = Joined(*flat, absl::StrCat("m", i), weights[i]);
    ASSERT_NE(flat_members[i].client, nullptr);
    flats.push_back(&flat_members[i]);
  }
  InitializeAll(flats);
  // The weighted mean in double, from the changes alone.
  std::vector<double> exact(kN);
  const std::vector<float> theta0 = Theta0();
  for (uint64_t j = 0; j < kN; ++j) exact[j] = theta0[j];
  for (int r = 1; r <= 5; ++r) {
    auto regional = SyncAll(all(), r);
    auto flat_out = SyncAll(flats, r);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(regional[i].ok())
          << "round " << r << " member " << i << ": " << regional[i].status();
      ASSERT_TRUE(flat_out[i].ok()) << flat_out[i].status();
      EXPECT_TRUE(regional[i]->contributed) << "round " << r << " member " << i;
    }
    for (uint64_t j = 0; j < kN; ++j) {
      double sum = 0;
      for (int i = 0; i < 4; ++i) sum += weights[i] * Change(i, r, j);
      exact[j] += sum / 11;
    }
    for (int i = 1; i < 4; ++i) {
      ASSERT_EQ(members_[i].params, members_[0].params)
          << "round " << r << ": member " << i << " of region " << i / 2;
    }
    for (uint64_t j = 0; j < kN; ++j) {
      const double tolerance = 4e-7 * (1.0 + std::fabs(exact[j])) * r;
      ASSERT_NEAR(flat_members[0].params[j], exact[j], tolerance)
          << "flat, round " << r << ", element " << j;
      ASSERT_NEAR(members_[0].params[j], exact[j], tolerance)
          << "two-level, round " << r << ", element " << j;
    }
  }
  EXPECT_EQ(UpstreamState(), members_[0].params);
  // A late joiner of region b fetches the same bits.
  auto late = Joined(*regions_[1], "late", 1);
  ASSERT_NE(late, nullptr);
  std::vector<float> fetched(kN);
  ASSERT_TRUE(late->Initialize(absl::MakeSpan(fetched)).ok());
  EXPECT_EQ(fetched, members_[0].params);
  // The upstream job has the two regions as its members.
  const JobStatusSnapshot status =
      upstream_->coordinator()->FindJob(kJob).value()->Status(1);
  ASSERT_EQ(status.members.size(), 2u);
  EXPECT_EQ(status.members[0].name, "region-0");
  EXPECT_EQ(status.members[1].name, "region-1");
  EXPECT_DOUBLE_EQ(status.recent_rounds[0].contributor_weight, 11.0);
  // Each region's status names its upstream: the tree's other level.
  for (int g = 0; g < 2; ++g) {
    const JobStatusSnapshot region =
        regions_[g]->coordinator()->FindJob(kJob).value()->Status(1);
    ASSERT_TRUE(region.upstream.has_value());
    EXPECT_EQ(region.upstream->member, absl::StrCat("region-", g));
    EXPECT_EQ(region.upstream->target, testkit::Target(*upstream_));
    EXPECT_EQ(region.upstream->upstream_round, 5u);
    EXPECT_EQ(region.upstream->rounds, 6u) << "the seed and 5 rounds";
    EXPECT_EQ(region.upstream->last_error, "");
    EXPECT_EQ(region.state_round, 5u);
  }
}

// The region's download pipelined on the upstream's: region a's round
// goes up and waits there for region b; as region b's chunks arrive, the
// upstream's result chunks come back to region a's link before the
// upstream round ends, and go on to region a's members at once (early
// result chunks, Job::UpstreamChunk). The states are those of a round
// answered whole: every member of both regions holds the upstream state
// bit for bit after every round.
TEST_F(RegionalTest, UpstreamChunksGoOnEarly_MembersHoldTheUpstreamState) {
  Start(AveragingMode::kMean);
  if (HasFatalFailure()) return;
  for (int r = 1; r <= 3; ++r) {
    std::vector<absl::StatusOr<SyncOutcome>> out(4);
    std::vector<std::thread> threads;
    auto sync = [&](int i) {
      Member& m = members_[i];
      for (uint64_t j = 0; j < kN; ++j) m.params[j] += Change(m.index, r, j);
      threads.emplace_back([&, i] {
        out[i] = members_[i].client->Sync(absl::MakeSpan(members_[i].params));
      });
    };
    // Region a alone, until its contribution is in upstream.
    sync(0);
    sync(1);
    const bool waiting = testkit::AwaitCondition([&] {
      const JobStatusSnapshot s =
          upstream_->coordinator()->FindJob(kJob).value()->Status(0);
      return s.round_open &&
             std::count(s.open_round_contributed.begin(),
                        s.open_round_contributed.end(), "region-0") == 1;
    });
    sync(2);
    sync(3);
    for (std::thread& t : threads) t.join();
    ASSERT_TRUE(waiting) << "round " << r
                         << ": region a's contribution never got upstream";
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(out[i].ok())
          << "round " << r << " member " << i << ": " << out[i].status();
      EXPECT_TRUE(out[i]->contributed) << "round " << r << " member " << i;
    }
    for (int i = 1; i < 4; ++i) {
      ASSERT_EQ(members_[i].params, members_[0].params)
          << "round " << r << ": member " << i << " of region " << i / 2;
    }
    ASSERT_EQ(UpstreamState(), members_[0].params) << "round " << r;
  }
  const JobStatusSnapshot a =
      regions_[0]->coordinator()->FindJob(kJob).value()->Status(1);
  ASSERT_TRUE(a.upstream.has_value());
  EXPECT_GT(a.upstream->early_chunks, 0u)
      << "region a told its members no result chunk before their round's "
         "whole upstream answer";
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(early_[i].load(), 0u)
        << "member " << i << " of region a got no early result chunk";
  }
  EXPECT_EQ(a.upstream->last_error, "");
  EXPECT_EQ(a.upstream->rounds, 4u) << "the seed and 3 rounds";
}

// A region that stops for good is a member that left: its link leaves the
// upstream job as its job stops (a region that dies without it is dropped
// at its lease's end, as any member), the upstream rounds go on without it,
// and the other region's members keep the upstream state.
TEST_F(RegionalTest, RegionStops_UpstreamGoesOnWithoutIt) {
  Start(AveragingMode::kMean);
  if (HasFatalFailure()) return;
  SyncAllOk(1);
  if (HasFatalFailure()) return;
  // Region 1's members go, then the region, without a drain.
  members_[2].client.reset();
  members_[3].client.reset();
  regions_[1]->Shutdown(absl::ZeroDuration());
  regions_[1].reset();
  std::vector<Member*> left = {&members_[0], &members_[1]};
  for (int r = 2; r <= 3; ++r) {
    auto out = SyncAll(left, r);
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(out[i].ok()) << "round " << r << ": " << out[i].status();
      EXPECT_TRUE(out[i]->contributed);
    }
    ASSERT_EQ(members_[0].params, members_[1].params);
  }
  EXPECT_EQ(UpstreamState(), members_[0].params);
  const JobStatusSnapshot up =
      upstream_->coordinator()->FindJob(kJob).value()->Status(1);
  ASSERT_EQ(up.members.size(), 1u);
  EXPECT_EQ(up.members[0].name, "region-0");
}

TEST_F(RegionalTest, OuterNesterovUpstream_MembersHoldTheUpstreamState) {
  Start(AveragingMode::kOuterNesterov);
  if (HasFatalFailure()) return;
  for (int r = 1; r <= 4; ++r) {
    auto out = SyncAll(all(), r);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(out[i].ok()) << "round " << r << ": " << out[i].status();
    }
    for (int i = 1; i < 4; ++i) {
      ASSERT_EQ(members_[i].params, members_[0].params) << "round " << r;
    }
  }
  EXPECT_EQ(UpstreamState(), members_[0].params);
  EXPECT_NE(members_[0].params, Theta0());
}

TEST_F(RegionalTest, RegionRestartsFromCheckpoint_MembersGoOnWithTheUpstream) {
  dirs_[0] = absl::StrCat(::testing::TempDir(), "/lsgd-regional-", getpid());
  Start(AveragingMode::kMean);
  if (HasFatalFailure()) return;
  for (int r = 1; r <= 2; ++r) {
    SyncAllOk(r);
    if (HasFatalFailure()) return;
  }
  // Region a dies after round 2 (its checkpoint survives) and comes back on
  // the same port; its members' next Sync finds it.
  const int port = Crash(regions_[0]);
  ServerOptions again =
      OnPort(Options(2, AveragingMode::kMean, dirs_[0]), port);
  again.coordinator.upstream = links_[0].get();
  regions_[0] = testkit::StartServer(std::move(again));
  ASSERT_NE(regions_[0], nullptr);
  bool counted_again = false;
  for (int r = 3; r <= 8 && !counted_again; ++r) {
    auto out = SyncAll(all(), r);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(out[i].ok()) << "round " << r << ": " << out[i].status();
    }
    for (int i = 1; i < 4; ++i) {
      ASSERT_EQ(members_[i].params, members_[0].params) << "round " << r;
    }
    // Both regions' weight in the upstream round: region a counted again.
    const JobStatusSnapshot up =
        upstream_->coordinator()->FindJob(kJob).value()->Status(1);
    counted_again = out[0]->contributed && !up.recent_rounds.empty() &&
                    up.recent_rounds[0].contributor_weight == 11.0;
  }
  EXPECT_TRUE(counted_again)
      << "region a's members never counted upstream again";
  EXPECT_EQ(UpstreamState(), members_[0].params);
}

// The upstream coordinator killed between rounds and restarted from its
// checkpoint: the regions' links re-join it (their client's retries), the
// round in flight goes through, and every member holds the upstream state.
TEST_F(RegionalTest, UpstreamRestartsFromCheckpoint_RegionsGoOn) {
  upstream_dir_ =
      absl::StrCat(::testing::TempDir(), "/lsgd-regional-up-", getpid());
  Start(AveragingMode::kOuterNesterov);
  if (HasFatalFailure()) return;
  for (int r = 1; r <= 2; ++r) {
    SyncAllOk(r);
    if (HasFatalFailure()) return;
  }
  const int port = Crash(upstream_);
  // Round 3 starts while the upstream is down; it comes back on its port.
  std::vector<absl::StatusOr<SyncOutcome>> out;
  std::thread round3([&] { out = SyncAll(all(), 3); });
  upstream_ = testkit::StartServer(
      OnPort(Options(2, AveragingMode::kOuterNesterov, upstream_dir_), port));
  round3.join();
  ASSERT_NE(upstream_, nullptr);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(out[i].ok()) << "member " << i << ": " << out[i].status();
  }
  for (int r = 4; r <= 5; ++r) {
    auto next = SyncAll(all(), r);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(next[i].ok()) << "round " << r << ": " << next[i].status();
      EXPECT_TRUE(next[i]->contributed) << "round " << r << " member " << i;
    }
    for (int i = 1; i < 4; ++i) {
      ASSERT_EQ(members_[i].params, members_[0].params) << "round " << r;
    }
  }
  EXPECT_EQ(UpstreamState(), members_[0].params);
}

// The upstream down for longer than the links' retries: the regional
// round fails UNAVAILABLE (whatever the upstream's error) and its members
// retry it; once the upstream is back (from its checkpoint) the round goes
// through and every member holds the upstream state.
TEST_F(RegionalTest, UpstreamDownPastTheLinksRetries_MembersRetryTheRound) {
  upstream_dir_ =
      absl::StrCat(::testing::TempDir(), "/lsgd-regional-down-", getpid());
  Start(AveragingMode::kMean);
  if (HasFatalFailure()) return;
  SyncAllOk(1);
  if (HasFatalFailure()) return;
  const int port = Crash(upstream_);
  std::vector<absl::StatusOr<SyncOutcome>> out;
  std::thread round2([&] { out = SyncAll(all(), 2); });
  // Both regions' links gave up once (their client's 5 s of retries).
  auto failed = [&](int g) {
    auto job = regions_[g]->coordinator()->FindJob(kJob);
    if (!job.ok()) return false;
    const JobStatusSnapshot status = (*job)->Status(1);
    return status.upstream.has_value() && !status.upstream->last_error.empty();
  };
  const bool both_failed = testkit::AwaitCondition(
      [&] { return failed(0) && failed(1); }, absl::Seconds(30));
  upstream_ = testkit::StartServer(
      OnPort(Options(2, AveragingMode::kMean, upstream_dir_), port));
  round2.join();
  ASSERT_TRUE(both_failed) << "the links never reported the upstream down";
  ASSERT_NE(upstream_, nullptr);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(out[i].ok()) << "member " << i << ": " << out[i].status();
  }
  for (int i = 1; i < 4; ++i) {
    ASSERT_EQ(members_[i].params, members_[0].params);
  }
  auto next = SyncAll(all(), 3);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(next[i].ok()) << next[i].status();
    EXPECT_TRUE(next[i]->contributed) << "member " << i;
  }
  EXPECT_EQ(UpstreamState(), members_[0].params);
  EXPECT_EQ(regions_[0]
                ->coordinator()
                ->FindJob(kJob)
                .value()
                ->Status(1)
                .upstream->last_error,
            "");
}

TEST(RegionalSettingsTest, OtherThanMeanOverFloat32_FailedPrecondition) {
  ServerOptions upstream_options = Options(1, AveragingMode::kMean);
  auto upstream = testkit::StartServer(std::move(upstream_options));
  ASSERT_NE(upstream, nullptr);
  UpstreamLinkFactory links(UpstreamOptions(*upstream, "region"));
  ServerOptions options = Options(1, AveragingMode::kMean);
  options.coordinator.upstream = &links;
  auto region = testkit::StartServer(std::move(options));
  ASSERT_NE(region, nullptr);
  ClientOptions client = testkit::BaseClientOptions(*region, kJob, "m");
  client.settings.contribution = Contribution::kPseudoGradients;
  client.settings.wire_dtype = DType::kInt4Block;
  auto member = Client::Create(client);
  ASSERT_TRUE(member.ok());
  const absl::Status s = (*member)->Join(testkit::LayoutOfSizes({kN}));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("this coordinator is regional"));
  EXPECT_THAT(s.message(), HasSubstr("wire int4"));
  EXPECT_EQ(region->coordinator()->FindJob(kJob).status().code(),
            absl::StatusCode::kNotFound)
      << "no job was made";
}

}  // namespace
}  // namespace localsgd
