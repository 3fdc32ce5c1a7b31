// A LibTorch worker built against the installed package (localsgd::torch):
// a linear model whose parameters every member sets to its rank before each
// sync; after the sync every parameter must be the mean rank (up to float32
// rounding: the job takes pseudo-gradients, and the mean is the initial
// state plus the mean of rank - initial state).
//
//   consumer_torch_worker TARGET JOB RANK WORKERS ROUNDS
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "client/client.h"
#include "client/local_sgd.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s TARGET JOB RANK WORKERS ROUNDS\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[3]);
  const int workers = std::atoi(argv[4]);
  const int rounds = std::atoi(argv[5]);
  localsgd::ClientOptions options;
  options.target = argv[1];
  options.job_id = argv[2];
  options.member_name = "torch" + std::to_string(rank);
  options.settings.rendezvous_members = static_cast<uint32_t>(workers);
  options.settings.local_sgd_steps = 1;
  auto client = localsgd::Client::Create(options);
  if (!client.ok()) {
    std::fprintf(stderr, "Create: %s\n", client.status().ToString().c_str());
    return 1;
  }
  torch::nn::Linear model(8, 4);
  localsgd::LocalSGDOptions lsgd;
  lsgd.local_sgd_steps = 1;
  auto local_sgd = localsgd::LocalSGD::Create(*model, client->get(), lsgd);
  if (!local_sgd.ok()) {
    std::fprintf(stderr, "LocalSGD::Create: %s\n",
                 local_sgd.status().ToString().c_str());
    return 1;
  }
  const double want = (workers - 1) / 2.0;
  for (int r = 1; r <= rounds; ++r) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(static_cast<double>(rank));
    }
    if (auto s = (*local_sgd)->Step(); !s.ok()) {
      std::fprintf(stderr, "Step: %s\n", s.ToString().c_str());
      return 1;
    }
    for (const auto& p : model->parameters()) {
      const double lo = p.min().item<double>(), hi = p.max().item<double>();
      if (std::abs(lo - want) > 1e-6 || std::abs(hi - want) > 1e-6) {
        std::fprintf(stderr, "round %d: parameters in [%g, %g], want %g\n", r,
                     lo, hi, want);
        return 1;
      }
    }
    std::printf("rank=%d round=%d ok\n", rank, r);
  }
  if (auto s = (*local_sgd)->Close(); !s.ok()) {
    std::fprintf(stderr, "Close: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
