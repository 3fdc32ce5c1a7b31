// A worker built against the installed client library only (no localsgd
// source tree): joins a job, syncs a few rounds of a closed-form model and
// checks each result.
//
//   consumer_worker TARGET JOB RANK WORKERS ROUNDS
//
// Every member of WORKERS sends, in round r, element e = RANK + r + e/1000;
// the mean is (WORKERS-1)/2 + r + e/1000. Exits 0 if every round's result
// is that mean and counted every member; prints what differed otherwise.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "client/client.h"
#include "src/layout.h"

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
  options.member_name = "consumer" + std::to_string(rank);
  // Every round waits for all workers: the closed form counts them all.
  options.settings.rendezvous_members = static_cast<uint32_t>(workers);
  auto client = localsgd::Client::Create(options);
  if (!client.ok()) {
    std::fprintf(stderr, "Create: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const localsgd::Layout layout =
      localsgd::MakeLayout({{"w", {10, 100}, localsgd::DType::kFloat32},
                            {"b", {24}, localsgd::DType::kFloat32}});
  std::vector<float> params(1024, static_cast<float>(rank));
  if (auto s = (*client)->Join(layout); !s.ok()) {
    std::fprintf(stderr, "Join: %s\n", s.ToString().c_str());
    return 1;
  }
  if (auto s = (*client)->Initialize(absl::MakeSpan(params)); !s.ok()) {
    std::fprintf(stderr, "Initialize: %s\n", s.ToString().c_str());
    return 1;
  }
  for (int r = 1; r <= rounds; ++r) {
    for (size_t e = 0; e < params.size(); ++e) {
      params[e] = static_cast<float>(rank + r + e / 1000.0);
    }
    auto outcome = (*client)->Sync(absl::MakeSpan(params));
    if (!outcome.ok()) {
      std::fprintf(stderr, "Sync: %s\n", outcome.status().ToString().c_str());
      return 1;
    }
    if (outcome->contributors != static_cast<uint32_t>(workers) ||
        !outcome->contributed) {
      std::fprintf(stderr,
                   "round %d: %u contributors (want %d), contributed=%d\n", r,
                   outcome->contributors, workers, outcome->contributed);
      return 1;
    }
    for (size_t e = 0; e < params.size(); ++e) {
      const double want = (workers - 1) / 2.0 + r + e / 1000.0;
      if (std::fabs(params[e] - want) > 1e-5 * std::fabs(want)) {
        std::fprintf(stderr, "round %d element %zu: %.7f, want %.7f\n", r, e,
                     params[e], want);
        return 1;
      }
    }
    std::printf("rank=%d round=%llu ok\n", rank,
                static_cast<unsigned long long>(outcome->round));
  }
  if (auto s = (*client)->Leave(); !s.ok()) {
    std::fprintf(stderr, "Leave: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
