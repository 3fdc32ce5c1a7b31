// Node-local averaging: N nodes, each a ProcessGroupGloo of M ranks in
// threads of this process, their leaders members of an in-process
// coordinator. After one sync every rank must hold the weighted global mean,
// computed here independently in double precision.
#include "client/node_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
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
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
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

void SetValues(Model& model, int g) {
  torch::NoGradGuard no_grad;
  int64_t j = 0;
  for (auto& p : model.parameters()) {
    auto flat = p.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i, ++j) {
      flat[i] = static_cast<float>(Value(g, j));
    }
  }
}

std::vector<float> Flat(Model& model) {
  std::vector<float> out;
  for (auto& p : model.parameters()) {
    auto t = p.detach().contiguous().view({-1});
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
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
  auto options =
      c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(20));
  options->devices.push_back(
      c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return WrapProcessGroup(
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options));
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
    for (int g = 0; g < world; ++g) {
      ASSERT_NEAR(result[g][j], expected, 1e-5)
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

TEST(NodeGroupTest, Create_LeaderWeightNotGroupSize_EveryRankInvalidArgument) {
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
  auto server = StartServer();
  std::vector<bool> skipped(2, false);
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
  // A free port: bind port 0 through a throwaway TCPStore server.
  int port = 0;
  {
    c10d::TCPStoreOptions o;
    o.port = 0;
    o.isServer = true;
    o.waitWorkers = false;
    c10d::TCPStore probe("127.0.0.1", o);
    port = probe.getPort();
  }
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

}  // namespace
}  // namespace localsgd
