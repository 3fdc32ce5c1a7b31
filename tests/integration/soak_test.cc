// Soak: many rounds through a real in-process coordinator with random joins,
// leaves (mid-round), and kills (a member that streams part of its chunks,
// ends the stream and never calls again, so its lease runs out). For every
// closed round the test recomputes, independently, the weighted mean of
// exactly the contributions the round counted: the complete contributions of
// the members whose Sync says `contributed`, plus each killed member's chunks
// that it finished before dying (per-chunk, as DESIGN.md specifies). The job
// takes pseudo-gradients (the client's default): members send their change
// since the previous round's state, which the killed members (raw streams)
// do by hand; the state is the previous one plus the mean change, i.e. the
// mean of the parameters up to float32 rounding.
//
// CI runs it short; a long run is the same test with the environment set:
//   LOCALSGD_SOAK_ROUNDS (60), LOCALSGD_SOAK_SEED (20261129),
//   LOCALSGD_SOAK_KILL_RATE (0.25: the chance a round has a member that dies
//   in it). Every 100 rounds it prints the process's RSS and open file
//   descriptors (the coordinator and the clients share the process):
//   LOCALSGD_SOAK_ROUNDS=2000 build/tests/integration/integration_tests
//     --gtest_filter='SoakTest.*'

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

constexpr uint32_t kChunk = 97;
const std::vector<int64_t> kSizes = {300, 7, 450, 1};  // 758 elements, 8 chunks
constexpr absl::Duration kLease = absl::Milliseconds(800);

// An environment variable as a number, or `fallback` if unset.
double EnvNumber(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::strtod(v, nullptr);
}

// This process's resident set (KiB) and open file descriptors.
std::pair<long, int> RssAndFds() {
  long rss = -1;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0)
      rss = std::strtol(line.c_str() + 6, nullptr, 10);
  }
  int fds = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++fds;
  }
  return {rss, fds};
}

float Contribution(int uid, RoundId round, uint64_t j) {
  return std::cos(0.01f * j + 0.37f * uid) * (1 + uid % 5) + 0.125f * round;
}

struct Honest {
  int uid;
  double weight;
  std::unique_ptr<Client> client;
  std::vector<float> params;
};

struct Killer {
  int uid;
  double weight;
  std::string member_id;
  uint32_t chunks_sent;    // chunks [0, chunks_sent) reach the coordinator
  uint64_t anchor_id = 0;  // the state it joined at, which it holds
  std::vector<float> anchor;
};

class SoakTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testkit::BaseServerOptions(kChunk);
    options.coordinator.policy.lease_ttl = kLease;
    // No outlier guard: the members' changes differ in scale by design (up
    // to 5 times, so that a wrong weight shows), and the guard would refuse
    // some of them now and then, rightly, dropping a member whose counted
    // chunks this check cannot know. The guard has its own tests; the
    // process soak (bench/process_soak.py) checks its refusals.
    options.coordinator.default_settings.outlier_ratio = kOutlierGuardOff;
    options.tick_interval = absl::Milliseconds(10);
    server_ = testkit::StartServer(std::move(options));
    ASSERT_NE(server_, nullptr);
    target_ = testkit::Target(*server_);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
    layout_ = testkit::LayoutOfSizes(kSizes, "p");
    geometry_ = ChunkGeometry(758, kChunk);
  }

  std::unique_ptr<Honest> NewHonest(int uid, double weight) {
    ClientOptions options;
    options.target = target_;
    options.job_id = "soak";
    options.member_name = absl::StrCat("h", uid);
    options.weight = weight;
    options.max_retry_time = absl::Seconds(20);
    auto client = Client::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    auto h = std::make_unique<Honest>();
    h->uid = uid;
    h->weight = weight;
    h->client = *std::move(client);
    h->params.assign(geometry_.num_elements(), 0.0f);
    EXPECT_TRUE(h->client->Join(layout_).ok());
    EXPECT_TRUE(h->client->Initialize(absl::MakeSpan(h->params)).ok());
    return h;
  }

  // Joins; `*state_id` gets the state's id.
  std::string RawJoin(int uid, double weight, uint64_t* state_id) {
    v1::JoinRequest request;
    request.mutable_settings()->set_contribution(
        v1::CONTRIBUTION_PSEUDO_GRADIENTS);
    request.set_job_id("soak");
    request.set_member_name(absl::StrCat("k", uid));
    request.set_weight(weight);
    request.set_incarnation(1000 + uid);
    LayoutToProto(layout_, request.mutable_layout());
    v1::JoinResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->Join(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    *state_id = response.state_id();
    return response.member_id();
  }

  // Streams chunks [0, k.chunks_sent) of round `round`, half-closes and
  // returns the status: the member then "dies" (it never calls again).
  grpc::Status RawPartialSync(const Killer& k, RoundId round) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    auto stream = stub_->Sync(&context);
    v1::SyncRequest request;
    request.mutable_header()->set_job_id("soak");
    request.mutable_header()->set_member_id(k.member_id);
    request.mutable_header()->set_round(round);
    request.mutable_header()->set_layout_fingerprint(layout_.fingerprint);
    request.mutable_header()->set_anchor_state_id(k.anchor_id);
    stream->Write(request);
    std::vector<float> values;
    for (uint32_t c = 0; c < k.chunks_sent; ++c) {
      values.clear();
      for (uint32_t e = 0; e < geometry_.Size(c); ++e) {
        const uint64_t j = geometry_.Offset(c) + e;
        values.push_back(Contribution(k.uid, round, j) - k.anchor[j]);
      }
      request.mutable_chunk()->set_index(c);
      EncodeValues(values, DType::kFloat32,
                   request.mutable_chunk()->mutable_data());
      request.mutable_chunk()->set_crc32c(Crc32c(0, request.chunk().data()));
      stream->Write(request);
    }
    stream->WritesDone();
    v1::SyncResponse response;
    while (stream->Read(&response)) {
    }
    return stream->Finish();
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::string target_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  Layout layout_;
  ChunkGeometry geometry_;
};

TEST_F(SoakTest, RandomJoinsLeavesKills_EveryRoundIsTheMeanOfWhatItCounted) {
  const uint32_t seed =
      static_cast<uint32_t>(EnvNumber("LOCALSGD_SOAK_SEED", 20261129));
  const int kRounds = static_cast<int>(EnvNumber("LOCALSGD_SOAK_ROUNDS", 60));
  const double kill_rate = EnvNumber("LOCALSGD_SOAK_KILL_RATE", 0.25);
  std::mt19937 rng(seed);
  auto coin = [&](double p) {
    return std::uniform_real_distribution<>(0, 1)(rng) < p;
  };
  auto pick_weight = [&] { return static_cast<double>(1 + rng() % 3); };

  std::vector<std::unique_ptr<Honest>> honest;
  int next_uid = 0;
  int joins = 0, leaves = 0, kills = 0, mismatches = 0, late_adopts = 0;
  for (int i = 0; i < 3; ++i) {
    honest.push_back(NewHonest(next_uid++, pick_weight()));
    ++joins;
  }
  RoundId round = 0;
  std::printf("soak: round   rss_kib  open_fds\n");
  for (int r = 0; r < kRounds; ++r) {
    if (r % 100 == 0) {
      const auto [rss, fds] = RssAndFds();
      std::printf("soak: %5d  %8ld  %8d\n", r, rss, fds);
      std::fflush(stdout);
    }
    // Between rounds: joins (they take part in the next round).
    if (honest.size() < 2 || (honest.size() < 7 && coin(0.3))) {
      honest.push_back(NewHonest(next_uid++, pick_weight()));
      ++joins;
    }
    // A member that will die in this round, having sent some chunks.
    std::vector<Killer> killers;
    if (coin(kill_rate)) {
      Killer k;
      k.uid = next_uid++;
      k.weight = pick_weight();
      k.member_id = RawJoin(k.uid, k.weight, &k.anchor_id);
      k.anchor = honest[0]->params;  // the state every member holds
      k.chunks_sent = rng() % geometry_.num_chunks();  // never all
      killers.push_back(k);
      ++joins;
      ++kills;
    }
    // A participant that leaves mid-round instead of syncing.
    int leaver = -1;
    if (honest.size() > 2 && coin(0.2))
      leaver = static_cast<int>(rng() % honest.size());
    // A member that joins while the round may be open: it syncs too, and the
    // round counts it only if it was a participant (its outcome says).
    const bool mid_joiner = coin(0.15);

    const RoundId this_round = round + 1;
    std::vector<absl::StatusOr<SyncOutcome>> outcomes(honest.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < honest.size(); ++i) {
      if (static_cast<int>(i) == leaver) continue;
      Honest* h = honest[i].get();
      for (uint64_t j = 0; j < h->params.size(); ++j) {
        h->params[j] = Contribution(h->uid, this_round, j);
      }
      threads.emplace_back([h, &outcomes, i] {
        outcomes[i] = h->client->Sync(absl::MakeSpan(h->params));
      });
    }
    for (const Killer& k : killers) {
      threads.emplace_back([this, k, this_round] {
        grpc::Status s = RawPartialSync(k, this_round);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
            << s.error_message();
      });
    }
    std::unique_ptr<Honest> joiner;
    absl::StatusOr<SyncOutcome> joiner_outcome;
    if (mid_joiner) {
      joiner = NewHonest(next_uid++, pick_weight());
      ++joins;
      for (uint64_t j = 0; j < joiner->params.size(); ++j) {
        joiner->params[j] = Contribution(joiner->uid, this_round, j);
      }
      // Its state may already be this round's (if it closed meanwhile): then
      // its Sync is for the next round, which nobody else joins; give it a
      // thread so the round can close without it.
      if (joiner->client->state_round() + 1 == this_round) {
        threads.emplace_back([&] {
          joiner_outcome = joiner->client->Sync(absl::MakeSpan(joiner->params));
        });
      }
    }
    if (leaver >= 0) {
      ASSERT_TRUE(honest[leaver]->client->Leave().ok());
      ++leaves;
    }
    for (auto& t : threads) t.join();

    // Which contributions did the round count?
    double total_weight = 0;
    std::vector<const Honest*> counted;
    const std::vector<float>* result = nullptr;
    for (size_t i = 0; i < honest.size(); ++i) {
      if (static_cast<int>(i) == leaver) continue;
      ASSERT_TRUE(outcomes[i].ok()) << outcomes[i].status();
      ASSERT_EQ(outcomes[i]->round, this_round);
      if (outcomes[i]->contributed) {
        counted.push_back(honest[i].get());
        total_weight += honest[i]->weight;
      }
      result = &honest[i]->params;
    }
    if (joiner != nullptr && joiner_outcome.ok() &&
        joiner_outcome->round == this_round) {
      if (joiner_outcome->contributed) {
        counted.push_back(joiner.get());
        total_weight += joiner->weight;
      } else {
        ++late_adopts;
      }
    }
    ASSERT_NE(result, nullptr);
    for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
      for (uint32_t e = 0; e < geometry_.Size(c); ++e) {
        const uint64_t j = geometry_.Offset(c) + e;
        double sum = 0, weight = 0;
        for (const Honest* h : counted) {
          sum += h->weight * Contribution(h->uid, this_round, j);
          weight += h->weight;
        }
        for (const Killer& k : killers) {
          if (c < k.chunks_sent) {
            sum += k.weight * Contribution(k.uid, this_round, j);
            weight += k.weight;
          }
        }
        const double expected = sum / weight;
        if (std::abs((*result)[j] - expected) >
            1e-5 * (1 + std::abs(expected))) {
          if (++mismatches <= 5) {
            ADD_FAILURE() << "round " << this_round << " element " << j
                          << ": got " << (*result)[j] << ", expected "
                          << expected;
          }
        }
      }
    }
    // Every member that got the result holds the same bits.
    for (size_t i = 0; i < honest.size(); ++i) {
      if (static_cast<int>(i) == leaver) continue;
      ASSERT_EQ(honest[i]->params, *result) << "member " << honest[i]->uid;
    }
    if (leaver >= 0) honest.erase(honest.begin() + leaver);
    if (joiner != nullptr) {
      if (joiner_outcome.ok() && joiner_outcome->round == this_round) {
        honest.push_back(std::move(joiner));
      } else {
        ASSERT_TRUE(joiner->client->Leave().ok());  // out of step; drop it
        ++leaves;
      }
    }
    round = this_round;
  }

  // The coordinator's own record agrees on the count of rounds.
  v1::GetJobStatusRequest request;
  request.set_job_id("soak");
  v1::GetJobStatusResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetJobStatus(&context, request, &response).ok());
  EXPECT_EQ(response.jobs(0).state_round(), static_cast<uint64_t>(kRounds));
  {
    const auto [rss, fds] = RssAndFds();
    std::printf("soak: %5d  %8ld  %8d\n", kRounds, rss, fds);
  }
  std::printf(
      "soak: seed=%u rounds=%d joins=%d leaves=%d kills=%d late_adopts=%d "
      "mismatches=%d\n",
      seed, kRounds, joins, leaves, kills, late_adopts, mismatches);
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace localsgd
