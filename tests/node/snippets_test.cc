// The usage snippets of the public headers and the README, compiled and run
// against an in-process coordinator: a snippet that stops compiling (a
// renamed option, a macro nobody defines) fails the build. Each function
// below is its snippet with only the address and the loop bounds made
// parameters; keep them in step with the comments they copy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/local_sgd.h"
#include "client/node_group.h"
#include "src/layout.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

// client/client.h, "Typical use".
absl::Status ClientSnippet(const std::string& target,
                           const std::vector<TensorSpec>& tensors,
                           absl::Span<float> flat_params, int rounds) {
  ClientOptions options;
  options.target = target;
  options.job_id = "mnist";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return client.status();
  absl::Status s = (*client)->Join(MakeLayout(tensors));
  if (s.ok()) s = (*client)->Initialize(flat_params);  // seed or fetch
  for (int round = 0; s.ok() && round < rounds; ++round) {
    // ... K local steps on flat_params ...
    absl::StatusOr<SyncOutcome> out = (*client)->Sync(flat_params);
    s = out.status();
  }
  absl::Status left = (*client)->Leave();
  return s.ok() ? left : s;
}

// client/local_sgd.h, "Typical use".
absl::Status LocalSgdSnippet(const std::string& target,
                             torch::nn::Module* model, int steps) {
  ClientOptions client_options;
  client_options.target = target;
  client_options.job_id = "mnist-torch";
  client_options.settings.local_sgd_steps = 16;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Create(client_options);
  if (!client.ok()) return client.status();
  LocalSGDOptions options;
  options.local_sgd_steps = 16;
  absl::StatusOr<std::unique_ptr<LocalSGD>> local_sgd =
      LocalSGD::Create(*model, client->get(), options);
  if (!local_sgd.ok()) return local_sgd.status();
  for (int step = 0; step < steps; ++step) {
    // ... forward, backward, optimizer.step() ...
    if (absl::Status s = (*local_sgd)->Step(); !s.ok()) return s;
  }
  // The final sync (accelerate's __exit__), then leave the job.
  if (absl::Status s = (*local_sgd)->Close(); !s.ok()) return s;
  return (*client)->Leave();
}

// client/node_group.h (compiled only: it needs a node's environment).
absl::Status NodeGroupSnippet() {
  absl::StatusOr<NodeGroup> group = MakeNodeGroupFromEnv();
  if (!group.ok()) return group.status();
  LocalSGDOptions options;
  options.node_group = *group;
  return absl::OkStatus();
}

struct Batch {
  torch::Tensor data, target;
};

// README.md, "Train with it (LibTorch)".
absl::Status ReadmeSnippet(const std::string& target, int world,
                           torch::nn::Linear& model,
                           torch::optim::SGD& optimizer,
                           const std::vector<Batch>& loader) {
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  localsgd::ClientOptions options;
  options.target = target;
  options.job_id = "my-run";
  options.settings.local_sgd_steps = 16;
  options.settings.rendezvous_members =
      world;  // first rounds wait for everyone
  auto client = localsgd::Client::Create(options).value();  // aborts on error
  localsgd::LocalSGDOptions local_sgd_options;
  local_sgd_options.local_sgd_steps = 16;
  auto local_sgd =
      localsgd::LocalSGD::Create(*model, client.get(), local_sgd_options)
          .value();
  for (auto& batch : loader) {
    optimizer.zero_grad();
    loss_fn(model->forward(batch.data), batch.target).backward();
    optimizer.step();
    if (absl::Status s = local_sgd->Step(); !s.ok())
      return s;  // every 16th: average
  }
  if (absl::Status s = local_sgd->Close(); !s.ok())
    return s;  // accelerate's __exit__
  return client->Leave();
}

class SnippetsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = testkit::StartServer(testkit::BaseServerOptions(64));
    ASSERT_NE(server_, nullptr);
  }
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(SnippetsTest, ClientH_TypicalUse_Runs) {
  std::vector<float> params(100, 1.5f);
  EXPECT_TRUE(ClientSnippet(testkit::Target(*server_),
                            {{"w", {10, 10}, DType::kFloat32}},
                            absl::MakeSpan(params), 3)
                  .ok());
  // One member: every round's mean is its own parameters.
  EXPECT_EQ(params, std::vector<float>(100, 1.5f));
}

TEST_F(SnippetsTest, LocalSgdH_TypicalUse_Runs) {
  torch::nn::Linear model(4, 2);
  EXPECT_TRUE(
      LocalSgdSnippet(testkit::Target(*server_), model.ptr().get(), 32).ok());
}

TEST_F(SnippetsTest, Readme_TrainWithIt_Runs) {
  torch::manual_seed(1);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  std::vector<Batch> loader;
  for (int i = 0; i < 40; ++i) {
    loader.push_back({torch::randn({8, 4}), torch::randn({8, 1})});
  }
  EXPECT_TRUE(
      ReadmeSnippet(testkit::Target(*server_), 1, model, optimizer, loader)
          .ok());
}

TEST(SnippetsCompile, NodeGroupH_IsReferenced) {
  // Compiled, not run (no node environment here).
  absl::Status (*snippet)() = &NodeGroupSnippet;
  EXPECT_NE(snippet, nullptr);
}

}  // namespace
}  // namespace localsgd
