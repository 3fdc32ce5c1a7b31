// Node-local averaging: N nodes, each a ProcessGroupGloo of M ranks in
// threads of this process, their leaders members of an in-process
// coordinator. After one sync every rank must hold the weighted global mean,
// computed here independently in double precision.
//
// The NodeGroupCudaTest cases run where this build has the NCCL path and a
// CUDA device is present (they skip, saying why, elsewhere): NCCL node
// groups of one process (NCCL takes one rank per GPU, so on a machine with
// one GPU every NCCL group has size 1) with parameters on cuda:0, next to a
// Gloo node on the CPU, all syncing through one coordinator
// (scripts/device/nccl_check.sh runs them on a GPU machine).
#include "client/node_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#if __has_include(<gloo/algorithm.h>)  // as client/node_group.cc
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define LOCALSGD_TEST_HAVE_GLOO 1
#else
#define LOCALSGD_TEST_HAVE_GLOO 0
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/local_sgd.h"
#include "client/node_group_c10d.h"
#include "server/server.h"

namespace localsgd {
namespace {

// Odd sizes, two parameters, so that chunks and offsets are exercised.
struct Model : torch::nn::Module {
  Model() {
    w = register_parameter("w", torch::zeros({13, 7}));
    b = register_parameter("b", torch::zeros({5}));
  }
  torch::Tensor w, b;
};

// What global rank g holds at flat element j before the sync.
double Value(int g, int64_t j) {
  return std::sin(0.01 * static_cast<double>(j) + 0.7 * g) * (1.0 + g);
}

// Writes Value(g, .) into the parameters, on whatever device they are.
void SetValues(Model& model, int g) {
  torch::NoGradGuard no_grad;
  int64_t j = 0;
  for (auto& p : model.parameters()) {
    auto host = torch::empty({p.numel()}, torch::kFloat);
    auto values = host.accessor<float, 1>();
    for (int64_t i = 0; i < p.numel(); ++i, ++j) {
      values[i] = static_cast<float>(Value(g, j));
    }
    p.copy_(host.view(p.sizes()));
  }
}

// Adds delta(j) to element j of the parameters (local training, in tests).
template <typename Delta>
void AddToParameters(Model& model, Delta delta) {
  torch::NoGradGuard no_grad;
  int64_t j = 0;
  for (auto& p : model.parameters()) {
    auto flat = p.view({-1});
    for (int64_t i = 0; i < p.numel(); ++i, ++j) {
      flat[i] += static_cast<float>(delta(j));
    }
  }
}

std::vector<float> Flat(Model& model) {
  std::vector<float> out;
  for (auto& p : model.parameters()) {
    auto t = p.detach().cpu().contiguous().view({-1});
    out.insert(out.end(), t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return out;
}

std::unique_ptr<CoordinatorServer> StartServer() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.tick_interval = absl::Milliseconds(20);
  auto server = CoordinatorServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return *std::move(server);
}

std::unique_ptr<Client> MakeLeaderClient(int port, const std::string& job,
                                         int node, double weight, int nodes) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  options.job_id = job;
  options.member_name = absl::StrCat("node", node);
  options.weight = weight;
  options.settings.local_sgd_steps = 1;
  options.settings.rendezvous_members = static_cast<uint32_t>(nodes);
  options.max_retry_time = absl::Seconds(2);
  auto client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

// A Gloo group of `size` ranks over a FileStore; call from `size` threads.
NodeGroup MakeGlooGroup(const std::string& store_path, int rank, int size) {
#if !LOCALSGD_TEST_HAVE_GLOO
  ADD_FAILURE() << "no Gloo headers: the test should have skipped";
  return NodeGroup();
#else
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
  auto options =
      c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(20));
  options->devices.push_back(
      c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo =
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#if TORCH_VERSION_MAJOR >= 2
  // 2.x: ProcessGroupGloo is a c10d::Backend; wrap it in a ProcessGroup.
  return WrapProcessGroup(ProcessGroupForBackend(
      store, std::move(gloo), c10d::ProcessGroup::BackendType::GLOO,
      {c10::DeviceType::CPU}));
#else
  return WrapProcessGroup(std::move(gloo));
#endif
#endif  // LOCALSGD_TEST_HAVE_GLOO
}

// Gloo's headers are not in every LibTorch (PyTorch's pip wheels lack them):
// the Gloo cases skip there (scripts/device/nccl_check.sh expects that).
#define SKIP_WITHOUT_GLOO()                                           \
  do {                                                                \
    if (!LOCALSGD_TEST_HAVE_GLOO || !NodeGroupHasGloo()) {            \
      GTEST_SKIP() << "Gloo case skipped: this LibTorch has no Gloo " \
                      "headers";                                      \
    }                                                                 \
  } while (0)

// A free loopback port: bind port 0 through a throwaway TCPStore server.
int FreePort() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore probe("127.0.0.1", o);
  return probe.getPort();
}

std::string TempPath(const std::string& what) {
  static std::atomic<int> counter{0};
  std::string path = absl::StrCat(::testing::TempDir(), "/localsgd-node-",
                                  getpid(), "-", what, "-", counter++);
  std::remove(path.c_str());
  return path;
}

class NodeAveragingTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(NodeAveragingTest, Sync_AllRanksHoldWeightedGlobalMean) {
  SKIP_WITHOUT_GLOO();
  const std::vector<int> node_sizes = GetParam();
  const int nodes = static_cast<int>(node_sizes.size());
  auto server = StartServer();
  const std::string job =
      absl::StrCat("nodes-", absl::StrJoin(node_sizes, "x"));

  std::vector<int> first_rank(nodes, 0);
  int world = 0;
  for (int n = 0; n < nodes; ++n) {
    first_rank[n] = world;
    world += node_sizes[n];
  }
  std::vector<std::vector<float>> result(world);
  std::vector<absl::Status> status(world);
  std::vector<std::string> store_paths;
  for (int n = 0; n < nodes; ++n) store_paths.push_back(TempPath("store"));

  // The leaders' clients outlive the threads: a Client leaves the job when
  // destroyed, and the coordinator's view is checked below.
  std::vector<std::unique_ptr<Client>> clients(nodes);
  std::vector<double> contributor_weight(world, 0);
  std::vector<std::thread> threads;
  for (int n = 0; n < nodes; ++n) {
    for (int l = 0; l < node_sizes[n]; ++l) {
      threads.emplace_back([&, n, l] {
        const int g = first_rank[n] + l;
        torch::manual_seed(100 + g);  // distinct initial values everywhere
        Model model;
        SetValues(model, 1000 + g);
        NodeGroup group = MakeGlooGroup(store_paths[n], l, node_sizes[n]);
        if (l == 0) {
          clients[n] =
              MakeLeaderClient(server->port(), job, n, node_sizes[n], nodes);
        }
        LocalSGDOptions options;
        options.local_sgd_steps = 1;
        options.node_group = group;
        options.keep_training_when_unavailable = false;
        auto local_sgd = LocalSGD::Create(
            model, l == 0 ? clients[n].get() : nullptr, options);
        if (!local_sgd.ok()) {
          status[g] = local_sgd.status();
          return;
        }
        SetValues(model, g);
        status[g] = (*local_sgd)->SyncNow();
        result[g] = Flat(model);
        contributor_weight[g] = (*local_sgd)->last_outcome().contributor_weight;
        (*local_sgd)->Abandon();
      });
    }
  }
  for (auto& t : threads) t.join();

  // Members and weights as the coordinator sees them (before anyone left).
  auto found = server->coordinator()->FindJob(job);
  ASSERT_TRUE(found.ok()) << found.status();
  JobStatusSnapshot snapshot = (*found)->Status(10);
  ASSERT_EQ(snapshot.members.size(), static_cast<size_t>(nodes));
  for (const MemberInfo& member : snapshot.members) {
    const int n = std::stoi(member.name.substr(4));  // "node<n>"
    EXPECT_EQ(member.weight, node_sizes[n]) << member.name;
  }

  // The independent closed form: the node means weighted by node size, i.e.
  // the plain mean over every rank of every node.
  const size_t num_elements = 13 * 7 + 5;
  for (int g = 0; g < world; ++g) {
    ASSERT_TRUE(status[g].ok()) << "rank " << g << ": " << status[g];
    ASSERT_EQ(result[g].size(), num_elements);
  }
  // Every node's leader counted the round's total weight = all processes.
  for (int n = 0; n < nodes; ++n) {
    EXPECT_EQ(contributor_weight[first_rank[n]], world) << "node " << n;
  }
  for (size_t j = 0; j < num_elements; ++j) {
    double sum_weighted_node_means = 0;
    for (int n = 0; n < nodes; ++n) {
      double node_sum = 0;
      for (int l = 0; l < node_sizes[n]; ++l) {
        node_sum += Value(first_rank[n] + l, static_cast<int64_t>(j));
      }
      sum_weighted_node_means += node_sizes[n] * (node_sum / node_sizes[n]);
    }
    const double expected = sum_weighted_node_means / world;
    // The job takes pseudo-gradients: the result is the seed plus the mean
    // of (node mean - seed) in float32, so its rounding is a few ulps of the
    // seed's magnitude (up to ~1000 here: Value(1000 + g, .)).
    const double tolerance = 1e-5 + 4 * std::ldexp(1.0, -24) * 1024;
    for (int g = 0; g < world; ++g) {
      ASSERT_NEAR(result[g][j], expected, tolerance)
          << "rank " << g << " element " << j;
      ASSERT_EQ(result[g][j], result[0][j]) << "rank " << g << " element " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    NodeSizes, NodeAveragingTest,
    ::testing::Values(std::vector<int>{2, 2}, std::vector<int>{2, 1},
                      std::vector<int>{1, 3, 2}),
    [](const ::testing::TestParamInfo<std::vector<int>>& info) {
      return absl::StrJoin(info.param, "x");
    });

// Runs `body(local_rank, group)` on `size` threads sharing one Gloo group.
template <typename Body>
void RunGroup(int size, Body body) {
  const std::string path = TempPath("group");
  std::vector<std::thread> threads;
  for (int l = 0; l < size; ++l) {
    threads.emplace_back([&, l] { body(l, MakeGlooGroup(path, l, size)); });
  }
  for (auto& t : threads) t.join();
}

// Overlap with node groups (LocalSGDOptions::overlap): a node of 2 ranks
// and a node of 1, K = 1. Step 1 starts round 1 with each node's mean m1
// and every rank goes on from its node's m1; each rank then "trains" d_g;
// step 2 merges round 1 into the node mean of now, theta_1 + (m2 - m1),
// in lockstep, and starts round 2 from that; Close merges round 2 and
// makes the final sync. Checked against the closed forms in double:
// theta_1 = mean over all ranks of Value(g); after step 2, node n holds
// theta_1 + mean of d over n; at the end every rank holds theta_1 + mean
// of d over all ranks.
TEST(NodeGroupTest, Overlap_NodesMergeInLockstep_ProgressOfTheNodeKept) {
  SKIP_WITHOUT_GLOO();
  const std::vector<int> node_sizes = {2, 1};
  const int nodes = 2, world = 3;
  const std::vector<int> first_rank = {0, 2};
  auto server = StartServer();
  const std::vector<std::string> store_paths = {TempPath("ov0"),
                                                TempPath("ov1")};
  auto d = [](int g, int64_t j) {
    return 0.05 * (g + 1) * std::cos(0.3 * static_cast<double>(j));
  };
  std::vector<std::unique_ptr<Client>> clients(nodes);
  std::vector<absl::Status> status(world);
  std::vector<std::vector<float>> after_step1(world), after_step2(world),
      final_values(world);
  std::vector<char> in_flight_after_step2(world, false),
      in_flight_after_close(world, true);
  std::vector<int64_t> merges_after_step2(world, -1), merges(world, -1),
      syncs(world, -1);
  std::vector<std::thread> threads;
  for (int n = 0; n < nodes; ++n) {
    for (int l = 0; l < node_sizes[n]; ++l) {
      threads.emplace_back([&, n, l] {
        const int g = first_rank[n] + l;
        Model model;
        SetValues(model, 1000 + g);
        NodeGroup group = MakeGlooGroup(store_paths[n], l, node_sizes[n]);
        if (l == 0) {
          clients[n] = MakeLeaderClient(server->port(), "overlap-nodes", n,
                                        node_sizes[n], nodes);
        }
        LocalSGDOptions options;
        options.local_sgd_steps = 1;
        options.node_group = group;
        options.overlap = true;
        options.keep_training_when_unavailable = false;
        auto local_sgd = LocalSGD::Create(
            model, l == 0 ? clients[n].get() : nullptr, options);
        if (!local_sgd.ok()) {
          status[g] = local_sgd.status();
          return;
        }
        SetValues(model, g);
        status[g] = (*local_sgd)->Step();
        if (!status[g].ok()) return;
        after_step1[g] = Flat(model);
        AddToParameters(model, [&](int64_t j) { return d(g, j); });
        status[g] = (*local_sgd)->Step();
        if (!status[g].ok()) return;
        after_step2[g] = Flat(model);
        in_flight_after_step2[g] = (*local_sgd)->sync_in_flight();
        merges_after_step2[g] = (*local_sgd)->num_merges();
        status[g] = (*local_sgd)->Close();
        final_values[g] = Flat(model);
        in_flight_after_close[g] = (*local_sgd)->sync_in_flight();
        merges[g] = (*local_sgd)->num_merges();
        syncs[g] = (*local_sgd)->num_syncs();
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < world; ++g) {
    ASSERT_TRUE(status[g].ok()) << "rank " << g << ": " << status[g];
    EXPECT_TRUE(in_flight_after_step2[g]) << "rank " << g;
    EXPECT_FALSE(in_flight_after_close[g]) << "rank " << g;
    EXPECT_EQ(merges_after_step2[g], 1) << "rank " << g;
    EXPECT_EQ(merges[g], 2) << "rank " << g;
    EXPECT_EQ(syncs[g], 3) << "rank " << g;  // two merges, Close's sync
  }
  const size_t num_elements = 13 * 7 + 5;
  const double tolerance = 1e-5 + 8 * std::ldexp(1.0, -24) * 1024;
  for (size_t j = 0; j < num_elements; ++j) {
    const auto jj = static_cast<int64_t>(j);
    double theta1 = 0, all_d = 0;
    for (int g = 0; g < world; ++g) {
      theta1 += Value(g, jj) / world;
      all_d += d(g, jj) / world;
    }
    for (int n = 0; n < nodes; ++n) {
      double node_mean1 = 0, node_d = 0;
      for (int l = 0; l < node_sizes[n]; ++l) {
        node_mean1 += Value(first_rank[n] + l, jj) / node_sizes[n];
        node_d += d(first_rank[n] + l, jj) / node_sizes[n];
      }
      for (int l = 0; l < node_sizes[n]; ++l) {
        const int g = first_rank[n] + l;
        // Step 1: the node mean (no round was in flight to merge).
        ASSERT_NEAR(after_step1[g][j], node_mean1, tolerance)
            << "rank " << g << " element " << j;
        // Step 2: round 1's result plus the node's own progress.
        ASSERT_NEAR(after_step2[g][j], theta1 + node_d, tolerance)
            << "rank " << g << " element " << j;
        ASSERT_EQ(after_step2[g][j], after_step2[first_rank[n]][j])
            << "rank " << g << " element " << j;
      }
    }
    for (int g = 0; g < world; ++g) {
      ASSERT_NEAR(final_values[g][j], theta1 + all_d, tolerance)
          << "rank " << g << " element " << j;
      ASSERT_EQ(final_values[g][j], final_values[0][j])
          << "rank " << g << " element " << j;
    }
  }
}

// Overlap without node groups (LocalSGDOptions::overlap, the schedule's
// kStart and kMergeThenStart): two members, K = 1. Step 1 starts round 1
// with Value(g); each member then "trains" d_g; step 2 waits for round 1,
// merges it as theta_1 + (now - snapshot) = theta_1 + d_g (the member's own
// progress kept) and starts round 2 from that; Close merges round 2 and
// makes the final sync: every member holds theta_1 + mean of d. Closed
// forms in double.
TEST(LocalSgdOverlapTest, TwoMembers_MergeKeepsOwnProgress) {
  const int members = 2;
  auto server = StartServer();
  auto d = [](int g, int64_t j) {
    return 0.03 * (g + 2) * std::sin(0.2 * static_cast<double>(j));
  };
  std::vector<absl::Status> status(members);
  std::vector<std::vector<float>> after_step2(members), final_values(members);
  std::vector<char> in_flight_after_step1(members, false);
  std::vector<int64_t> merges_after_step2(members, -1), syncs(members, -1);
  std::vector<std::thread> threads;
  for (int g = 0; g < members; ++g) {
    threads.emplace_back([&, g] {
      Model model;
      SetValues(model, 1000 + g);
      std::unique_ptr<Client> client =
          MakeLeaderClient(server->port(), "overlap-members", g, 1, members);
      LocalSGDOptions options;
      options.local_sgd_steps = 1;
      options.overlap = true;
      options.keep_training_when_unavailable = false;
      auto local_sgd = LocalSGD::Create(model, client.get(), options);
      if (!local_sgd.ok()) {
        status[g] = local_sgd.status();
        return;
      }
      SetValues(model, g);
      status[g] = (*local_sgd)->Step();  // starts round 1
      if (!status[g].ok()) return;
      in_flight_after_step1[g] = (*local_sgd)->sync_in_flight();
      AddToParameters(model, [&](int64_t j) { return d(g, j); });
      status[g] = (*local_sgd)->Step();  // merges round 1, starts round 2
      if (!status[g].ok()) return;
      after_step2[g] = Flat(model);
      merges_after_step2[g] = (*local_sgd)->num_merges();
      status[g] = (*local_sgd)->Close();
      final_values[g] = Flat(model);
      syncs[g] = (*local_sgd)->num_syncs();
    });
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < members; ++g) {
    ASSERT_TRUE(status[g].ok()) << "member " << g << ": " << status[g];
    EXPECT_TRUE(in_flight_after_step1[g]) << "member " << g;
    EXPECT_EQ(merges_after_step2[g], 1) << "member " << g;
    EXPECT_EQ(syncs[g], 3) << "member " << g;  // two merges, Close's sync
  }
  const size_t num_elements = 13 * 7 + 5;
  const double tolerance = 1e-5 + 8 * std::ldexp(1.0, -24) * 1024;
  for (size_t j = 0; j < num_elements; ++j) {
    const auto jj = static_cast<int64_t>(j);
    double theta1 = 0, all_d = 0;
    for (int g = 0; g < members; ++g) {
      theta1 += Value(g, jj) / members;
      all_d += d(g, jj) / members;
    }
    for (int g = 0; g < members; ++g) {
      ASSERT_NEAR(after_step2[g][j], theta1 + d(g, jj), tolerance)
          << "member " << g << " element " << j;
      ASSERT_NEAR(final_values[g][j], theta1 + all_d, tolerance)
          << "member " << g << " element " << j;
      ASSERT_EQ(final_values[g][j], final_values[0][j])
          << "member " << g << " element " << j;
    }
  }
}

// Error reset (ClientOptions::error_reset) under LocalSGD, with and
// without overlap: two members on SPARSE2 (a few values of the 96 kept per
// round). After a sync each holds the job's state plus its own residual,
// so the two differ; Close's final sync (SyncWork::last) leaves both on
// the state alone, bit for bit.
TEST(LocalSgdErrorResetTest,
     TwoMembers_TrainOnTheResidual_CloseEndsOnTheState) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "blocking");
    const int members = 2;
    auto server = StartServer();
    std::vector<absl::Status> status(members);
    std::vector<std::vector<float>> after_sync(members), final_values(members);
    std::vector<std::thread> threads;
    for (int g = 0; g < members; ++g) {
      threads.emplace_back([&, g] {
        Model model;
        SetValues(model, 1000);
        ClientOptions client_options;
        client_options.target = absl::StrCat("127.0.0.1:", server->port());
        client_options.job_id = overlap ? "reset-overlap" : "reset";
        client_options.member_name = absl::StrCat("m", g);
        client_options.settings.local_sgd_steps = 1;
        client_options.settings.rendezvous_members = members;
        client_options.settings.contribution = Contribution::kPseudoGradients;
        client_options.settings.wire_dtype = DType::kSparse2;
        client_options.error_reset = true;
        client_options.max_retry_time = absl::Seconds(2);
        auto client = Client::Create(client_options);
        if (!client.ok()) {
          status[g] = client.status();
          return;
        }
        LocalSGDOptions options;
        options.local_sgd_steps = 1;
        options.overlap = overlap;
        options.keep_training_when_unavailable = false;
        auto local_sgd = LocalSGD::Create(model, client->get(), options);
        if (!local_sgd.ok()) {
          status[g] = local_sgd.status();
          return;
        }
        SetValues(model, g);
        status[g] = (*local_sgd)->Step();  // a sync, or one started
        if (status[g].ok() && overlap) {
          status[g] = (*local_sgd)->Step();  // the merge of round 1
        }
        if (!status[g].ok()) return;
        after_sync[g] = Flat(model);
        status[g] = (*local_sgd)->Close();
        final_values[g] = Flat(model);
      });
    }
    for (auto& t : threads) t.join();
    for (int g = 0; g < members; ++g) {
      ASSERT_TRUE(status[g].ok()) << "member " << g << ": " << status[g];
    }
    EXPECT_NE(after_sync[0], after_sync[1]);
    EXPECT_EQ(final_values[0], final_values[1]);
    EXPECT_NE(final_values[0], after_sync[0]);
  }
}

TEST(NodeGroupTest, Create_LeaderWeightNotGroupSize_EveryRankInvalidArgument) {
  SKIP_WITHOUT_GLOO();
  auto server = StartServer();
  std::vector<absl::Status> status(2);
  RunGroup(2, [&](int l, NodeGroup group) {
    Model model;
    std::unique_ptr<Client> client;
    if (l == 0) client = MakeLeaderClient(server->port(), "w", 0, 1.0, 1);
    LocalSGDOptions options;
    options.local_sgd_steps = 1;
    options.node_group = group;
    status[l] = LocalSGD::Create(model, client.get(), options).status();
  });
  for (const auto& s : status) {
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  }
}

TEST(NodeGroupTest, Sync_CoordinatorGone_EveryRankSkipsAndKeepsParameters) {
  SKIP_WITHOUT_GLOO();
  auto server = StartServer();
  std::vector<char> skipped(2, false);
  std::vector<absl::Status> status(2);
  std::vector<std::vector<float>> before(2), after(2);
  std::atomic<int> created{0};
  RunGroup(2, [&](int l, NodeGroup group) {
    Model model;
    std::unique_ptr<Client> client;
    if (l == 0) client = MakeLeaderClient(server->port(), "gone", 0, 2.0, 1);
    LocalSGDOptions options;
    options.local_sgd_steps = 1;
    options.node_group = group;
    auto local_sgd = LocalSGD::Create(model, client.get(), options);
    ASSERT_TRUE(local_sgd.ok()) << local_sgd.status();
    ++created;
    if (l == 0) {
      while (created.load() < 2) std::this_thread::yield();
      server->Shutdown(absl::ZeroDuration());
    }
    SetValues(model, l);
    before[l] = Flat(model);
    status[l] = (*local_sgd)->SyncNow();
    skipped[l] = (*local_sgd)->last_sync_skipped();
    after[l] = Flat(model);
    (*local_sgd)->Abandon();
  });
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(status[l].ok()) << status[l];
    EXPECT_TRUE(skipped[l]) << "rank " << l;
    EXPECT_EQ(before[l], after[l]) << "rank " << l;
  }
}

TEST(NodeGroupTest, Sync_LeaderGone_FollowerGetsAborted) {
  SKIP_WITHOUT_GLOO();
  auto server = StartServer();
  absl::Status follower;
  RunGroup(2, [&](int l, NodeGroup group) {
    Model model;
    std::unique_ptr<Client> client;
    if (l == 0) client = MakeLeaderClient(server->port(), "dead", 0, 2.0, 1);
    LocalSGDOptions options;
    options.local_sgd_steps = 1;
    options.node_group = group;
    auto local_sgd = LocalSGD::Create(model, client.get(), options);
    ASSERT_TRUE(local_sgd.ok()) << local_sgd.status();
    if (l == 0) {
      // The leader "dies": its LocalSGD and its group (connections) go.
      (*local_sgd)->Abandon();
      local_sgd->reset();
      group = NodeGroup();
      return;
    }
    follower = (*local_sgd)->SyncNow();
    (*local_sgd)->Abandon();
  });
  EXPECT_TRUE(absl::IsAborted(follower)) << follower;
  EXPECT_NE(follower.message().find("re-joins as a late joiner"),
            std::string::npos)
      << follower;
}

TEST(NodeGroupTest, MakeNodeGroup_TcpStore_FormsGlooGroup) {
  SKIP_WITHOUT_GLOO();
  const int port = FreePort();
  std::vector<absl::StatusOr<NodeGroup>> groups(3);
  std::vector<std::thread> threads;
  for (int l = 0; l < 3; ++l) {
    threads.emplace_back([&, l] {
      NodeGroupOptions options;
      options.local_rank = l;
      options.local_world_size = 3;
      options.store_address = absl::StrCat("127.0.0.1:", port);
      options.timeout = absl::Seconds(20);
      groups[l] = MakeNodeGroup(options);
    });
  }
  for (auto& t : threads) t.join();
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(groups[l].ok()) << groups[l].status();
    EXPECT_EQ(groups[l]->rank(), l);
    EXPECT_EQ(groups[l]->size(), 3);
    EXPECT_EQ(groups[l]->backend(), "gloo");
  }
}

TEST(NodeGroupTest, MakeNodeGroupFromEnv_NoLocalRank_InvalidArgument) {
  unsetenv("LOCAL_RANK");
  auto group = MakeNodeGroupFromEnv();
  EXPECT_TRUE(absl::IsInvalidArgument(group.status())) << group.status();
}

TEST(NodeGroupTest, MakeNodeGroup_CudaWithoutNccl_FailedPrecondition) {
  if (NodeGroupHasNccl()) GTEST_SKIP() << "this build has NCCL";
  NodeGroupOptions options;
  options.store_address = "127.0.0.1:1";
  options.cuda = true;
  EXPECT_TRUE(absl::IsFailedPrecondition(MakeNodeGroup(options).status()));
}

TEST(NodeGroupTest, NcclPath_CompiledExactlyWhereConfigureFoundIt) {
  EXPECT_EQ(NodeGroupHasNccl(), LOCALSGD_EXPECT_NCCL != 0);
}

// --- NCCL on CUDA (run where the build has NCCL and a GPU is present) ---

// Why the CUDA cases cannot run here; empty where they can.
std::string CudaSkipReason() {
  if (!NodeGroupHasNccl()) {
    return "this build has no NCCL path (LibTorch without CUDA/NCCL)";
  }
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 1) {
    return "no CUDA device";
  }
  return "";
}

#define SKIP_WITHOUT_CUDA_NCCL()                                        \
  do {                                                                  \
    if (const std::string reason = CudaSkipReason(); !reason.empty()) { \
      GTEST_SKIP() << "CUDA/NCCL case skipped: " << reason;             \
    }                                                                   \
  } while (0)

absl::StatusOr<NodeGroup> MakeSingleGroup(bool cuda) {
  NodeGroupOptions options;
  options.local_rank = 0;
  options.local_world_size = 1;
  options.store_address = absl::StrCat("127.0.0.1:", FreePort());
  options.cuda = cuda;
  options.timeout = absl::Seconds(60);
  return MakeNodeGroup(options);
}

TEST(NodeGroupCudaTest, MakeNodeGroup_Cuda_FormsNcclGroupOnCudaTensors) {
  SKIP_WITHOUT_CUDA_NCCL();
  absl::StatusOr<NodeGroup> group = MakeSingleGroup(/*cuda=*/true);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->size(), 1);
  EXPECT_EQ(group->backend(), "nccl");
  c10::intrusive_ptr<c10d::ProcessGroup> pg = ProcessGroupOf(*group);
  ASSERT_TRUE(pg);

  // All-reduce (SUM over one rank) and broadcast really run on cuda:0.
  auto t =
      torch::arange(1, 6, torch::dtype(torch::kFloat).device(torch::kCUDA));
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions sum;
  sum.reduceOp = c10d::ReduceOp::SUM;
  pg->allreduce(tensors, sum)->wait();
  c10d::BroadcastOptions from0;
  from0.rootRank = 0;
  from0.rootTensor = 0;
  pg->broadcast(tensors, from0)->wait();
  EXPECT_TRUE(t.is_cuda());
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(1, 6, torch::kFloat)));

  // NCCL takes CUDA tensors only, as ProcessGroupNCCL always did.
  std::vector<at::Tensor> on_cpu{torch::ones({3})};
  EXPECT_ANY_THROW(pg->allreduce(on_cpu, sum)->wait());
}

// The headline: two NCCL nodes of one process each, parameters on cuda:0,
// and a Gloo node of two ranks on the CPU, all in threads of this process,
// their leaders members of one coordinator. After one sync every rank holds
// exactly the same parameters, the weighted (by node size) mean computed
// here in double precision; the CUDA parameters stay the same tensors
// (identity, storage, device) that the model and any optimizer hold.
TEST(NodeGroupCudaTest, Sync_NcclNodesAndGlooNode_AllHoldWeightedMean) {
  SKIP_WITHOUT_CUDA_NCCL();
  struct Node {
    bool cuda;
    int size;
  };
  // Without Gloo headers (pip LibTorch), the two NCCL nodes alone.
  std::vector<Node> nodes = {{true, 1}, {true, 1}};
  if (NodeGroupHasGloo()) nodes.push_back({false, 2});
  const int num_nodes = static_cast<int>(nodes.size());
  auto server = StartServer();
  const std::string job = "nccl-nodes";

  std::vector<int> first_rank(num_nodes, 0);
  int world = 0;
  for (int n = 0; n < num_nodes; ++n) {
    first_rank[n] = world;
    world += nodes[n].size;
  }
  std::vector<std::string> stores;
  for (int n = 0; n < num_nodes; ++n) {
    stores.push_back(absl::StrCat("127.0.0.1:", FreePort()));
  }
  std::vector<std::vector<float>> result(world);
  std::vector<absl::Status> status(world);
  std::vector<std::string> backend(world);
  std::vector<std::string> identity_problem(world);
  std::vector<double> contributor_weight(world, 0);
  std::vector<std::unique_ptr<Client>> clients(num_nodes);
  std::vector<std::thread> threads;
  for (int n = 0; n < num_nodes; ++n) {
    for (int l = 0; l < nodes[n].size; ++l) {
      threads.emplace_back([&, n, l] {
        const int g = first_rank[n] + l;
        NodeGroupOptions group_options;
        group_options.local_rank = l;
        group_options.local_world_size = nodes[n].size;
        group_options.store_address = stores[n];
        group_options.cuda = nodes[n].cuda;
        group_options.timeout = absl::Seconds(60);
        absl::StatusOr<NodeGroup> group = MakeNodeGroup(group_options);
        if (!group.ok()) {
          status[g] = group.status();
          return;
        }
        backend[g] = group->backend();
        Model model;
        if (nodes[n].cuda) model.to(torch::Device(torch::kCUDA, 0));
        SetValues(model, 1000 + g);
        if (l == 0) {
          clients[n] = MakeLeaderClient(server->port(), job, n, nodes[n].size,
                                        num_nodes);
        }
        LocalSGDOptions options;
        options.local_sgd_steps = 1;
        options.node_group = *group;
        options.keep_training_when_unavailable = false;
        auto local_sgd = LocalSGD::Create(
            model, l == 0 ? clients[n].get() : nullptr, options);
        if (!local_sgd.ok()) {
          status[g] = local_sgd.status();
          return;
        }
        SetValues(model, g);
        // What the model's (and an optimizer's) parameters are before.
        std::vector<torch::Tensor> before = model.parameters();
        std::vector<const void*> impl, data;
        for (const auto& p : before) {
          impl.push_back(p.unsafeGetTensorImpl());
          data.push_back(p.data_ptr());
        }
        status[g] = (*local_sgd)->SyncNow();
        const std::vector<torch::Tensor> after = model.parameters();
        const torch::Device expected_device =
            nodes[n].cuda ? torch::Device(torch::kCUDA, 0)
                          : torch::Device(torch::kCPU);
        for (size_t i = 0; i < after.size(); ++i) {
          if (after[i].unsafeGetTensorImpl() != impl[i] ||
              after[i].data_ptr() != data[i] ||
              after[i].device() != expected_device ||
              !model.w.is_same(model.named_parameters()["w"])) {
            identity_problem[g] = absl::StrCat(
                "parameter ", i, " changed identity, storage or device (now ",
                after[i].device().str(), ")");
          }
        }
        result[g] = Flat(model);
        contributor_weight[g] = (*local_sgd)->last_outcome().contributor_weight;
        (*local_sgd)->Abandon();
      });
    }
  }
  for (auto& t : threads) t.join();

  for (int n = 0; n < num_nodes; ++n) {
    for (int l = 0; l < nodes[n].size; ++l) {
      const int g = first_rank[n] + l;
      ASSERT_TRUE(status[g].ok())
          << "node " << n << " rank " << l << ": " << status[g];
      EXPECT_EQ(backend[g], nodes[n].cuda ? "nccl" : "gloo") << "node " << n;
      EXPECT_EQ(identity_problem[g], "") << "node " << n << " rank " << l;
    }
    EXPECT_EQ(contributor_weight[first_rank[n]], world) << "node " << n;
  }
  auto found = server->coordinator()->FindJob(job);
  ASSERT_TRUE(found.ok()) << found.status();
  JobStatusSnapshot snapshot = (*found)->Status(10);
  ASSERT_EQ(snapshot.members.size(), static_cast<size_t>(num_nodes));
  for (const MemberInfo& member : snapshot.members) {
    const int n = std::stoi(member.name.substr(4));  // "node<n>"
    EXPECT_EQ(member.weight, nodes[n].size) << member.name;
  }

  // Independent closed form, in double: node means weighted by node size.
  const size_t num_elements = 13 * 7 + 5;
  for (int g = 0; g < world; ++g) ASSERT_EQ(result[g].size(), num_elements);
  for (size_t j = 0; j < num_elements; ++j) {
    double weighted = 0;
    for (int n = 0; n < num_nodes; ++n) {
      double node_sum = 0;
      for (int l = 0; l < nodes[n].size; ++l) {
        node_sum += Value(first_rank[n] + l, static_cast<int64_t>(j));
      }
      weighted += nodes[n].size * (node_sum / nodes[n].size);
    }
    const double expected = weighted / world;
    for (int g = 0; g < world; ++g) {
      ASSERT_NEAR(result[g][j], expected, 1e-5)
          << "rank " << g << " element " << j;
      ASSERT_EQ(result[g][j], result[0][j]) << "rank " << g << " element " << j;
    }
  }
}

// Several syncs on CUDA: a single NCCL node alone in its job keeps its own
// values (the mean of one), the parameters stay on cuda:0, and the node's
// status broadcast (on CUDA too) reports each round.
TEST(NodeGroupCudaTest, SyncNow_NcclNodeAlone_KeepsValuesOverRounds) {
  SKIP_WITHOUT_CUDA_NCCL();
  auto server = StartServer();
  absl::StatusOr<NodeGroup> group = MakeSingleGroup(/*cuda=*/true);
  ASSERT_TRUE(group.ok()) << group.status();
  Model model;
  model.to(torch::Device(torch::kCUDA, 0));
  auto client = MakeLeaderClient(server->port(), "alone", 0, 1.0, 1);
  LocalSGDOptions options;
  options.local_sgd_steps = 1;
  options.node_group = *group;
  options.keep_training_when_unavailable = false;
  auto local_sgd = LocalSGD::Create(model, client.get(), options);
  ASSERT_TRUE(local_sgd.ok()) << local_sgd.status();
  uint64_t last_round = 0;
  for (int round = 0; round < 3; ++round) {
    SetValues(model, 7 + round);
    const std::vector<float> before = Flat(model);
    ASSERT_TRUE((*local_sgd)->SyncNow().ok()) << "round " << round;
    EXPECT_EQ(Flat(model), before) << "round " << round;
    EXPECT_TRUE(model.w.is_cuda());
    EXPECT_TRUE(model.b.is_cuda());
    const uint64_t r = (*local_sgd)->last_outcome().round;
    if (round > 0) {
      EXPECT_GT(r, last_round);
    }
    last_round = r;
  }
  (*local_sgd)->Abandon();
}

}  // namespace
}  // namespace localsgd
