// The sparse wire dtypes end to end, over the real gRPC service: members
// that upload the top values of their deltas (2 or 4 bits each, error
// feedback) and a coordinator that accumulates them, applies its rule and
// sends its step sparse (keeping more per block: the mean of several
// uploads) with its own residual.
//
//   - MEAN: after every round the members hold, bit for bit, the state an
//     independent computation gives from the codec's encoders alone (each
//     member's upload with its residual, their mean, the coordinator's
//     encoding of it with its residual, added to the state);
//   - every rule: the members and a late joiner hold the same bits;
//   - restarted from its checkpoint, the coordinator goes on with the same
//     state, momentum and residual: the rounds after the restart equal
//     those of a coordinator that never stopped;
//   - with error reset (ClientOptions::error_reset) a member's parameters
//     after a round are, bit for bit, the state plus its own residual, the
//     state what the codec alone gives when each delta (the residual in it)
//     is encoded with no feedback added, and a last Sync (SyncWork::last)
//     leaves every member on the state alone.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "src/codec.h"
#include "src/sparse_codec.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

// Two chunks of one full block and a partial one each (4096 + 904): the
// partial block keeps its share, rounded up.
constexpr uint32_t kChunkElements = 5000;
constexpr uint64_t kN = 10000;
constexpr uint32_t kKeep = 64;
// The coordinator's step keeps more: the mean of two uploads.
constexpr uint32_t kResultKeep = 128;

struct Case {
  DType wire;
  AveragingMode mode;
};

std::string CaseName(const Case& c) {
  return absl::StrCat(DTypeName(c.wire), "_", AveragingModeName(c.mode));
}

// Member i's change in round r at element j: mixed magnitudes and signs,
// different for every member and round.
float Change(int i, int r, uint64_t j) {
  const float x = static_cast<float>(j);
  return 1e-3f * std::sin(0.37f * x + 1.3f * i + 0.71f * r) *
         (1.0f + static_cast<float>((j * 7 + i * 3 + r) % 11));
}

ServerOptions Options(const Case& c, const std::string& checkpoint_dir = "") {
  ServerOptions options = testkit::BaseServerOptions(kChunkElements);
  JobSettings& s = options.coordinator.default_settings;
  s.contribution = Contribution::kPseudoGradients;
  s.wire_dtype = c.wire;
  s.mode = c.mode;
  s.sparse_keep = kKeep;
  s.sparse_result_keep = kResultKeep;
  s.rendezvous_members = 2;
  if (!checkpoint_dir.empty()) {
    options.state_dir = checkpoint_dir;
    // The restored job regathers until round 2's two members are back, or
    // for one lease: a long one, so that a member slow to reconnect on a
    // busy machine still takes part in round 3.
    options.coordinator.policy.lease_ttl = absl::Seconds(30);
  }
  return options;
}

std::unique_ptr<Client> Member(const CoordinatorServer& server,
                               const std::string& name,
                               bool error_reset = false) {
  ClientOptions options = testkit::BaseClientOptions(server, "sparse", name);
  options.settings.contribution = Contribution::kPseudoGradients;
  options.error_reset = error_reset;
  auto client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  EXPECT_TRUE((*client)->Join(testkit::LayoutOfSizes({kN})).ok());
  return *std::move(client);
}

std::vector<float> Theta0() {
  std::vector<float> theta(kN);
  for (uint64_t j = 0; j < kN; ++j) {
    theta[j] =
        std::cos(0.01f * static_cast<float>(j)) * (j % 3 == 0 ? -1.0f : 1.0f);
  }
  return theta;
}

// The job as the codec alone computes it (MEAN, two members of weight 1).
// With error reset, each member's delta is encoded with no feedback added
// (its residual is in the parameters it holds).
class IndependentMean {
 public:
  IndependentMean(DType wire, const std::vector<float>& theta,
                  bool error_reset = false)
      : error_reset_(error_reset),
        code_(SparseCodeOf(WireCode(wire, kKeep))),
        result_code_(SparseCodeOf(WireCode(wire, kResultKeep))),
        state_(theta),
        coordinator_residual_(kN, 0.0f),
        member_residual_(2, std::vector<float>(kN, 0.0f)) {}

  // One round in which member i holds params[i] (each against the state).
  void Round(const std::vector<std::vector<float>>& params) {
    std::vector<float> next = state_;
    for (uint64_t first = 0; first < kN; first += kChunkElements) {
      const size_t n = std::min<uint64_t>(kChunkElements, kN - first);
      std::vector<float> mean(n, 0.0f);
      std::string bytes(SparseWireBytes(n, code_), '\0');
      for (int i = 0; i < 2; ++i) {
        if (error_reset_) {
          std::fill_n(member_residual_[i].begin() + first, n, 0.0f);
        }
        EncodeSparseDeltaWithFeedback(
            absl::MakeConstSpan(params[i]).subspan(first, n),
            absl::MakeConstSpan(state_).subspan(first, n),
            absl::MakeSpan(member_residual_[i]).subspan(first, n), code_,
            bytes.data());
        std::vector<float> decoded(n);
        ASSERT_TRUE(DecodeSparse(bytes, code_, absl::MakeSpan(decoded)).ok());
        for (size_t k = 0; k < n; ++k) mean[k] += decoded[k];
      }
      for (float& v : mean) v /= 2.0f;
      std::vector<float> step(n);
      std::string result(SparseWireBytes(n, result_code_), '\0');
      EncodeSparseWithFeedback(
          mean, absl::MakeSpan(coordinator_residual_).subspan(first, n),
          result_code_, result.data(), absl::MakeSpan(step));
      for (size_t k = 0; k < n; ++k)
        next[first + k] = state_[first + k] + step[k];
    }
    state_ = std::move(next);
  }

  const std::vector<float>& state() const { return state_; }
  const std::vector<float>& residual(int i) const {
    return member_residual_[i];
  }

 private:
  bool error_reset_;
  SparseCode code_;
  SparseCode result_code_;
  std::vector<float> state_;
  std::vector<float> coordinator_residual_;
  std::vector<std::vector<float>> member_residual_;
};

// Both members sync round r (saying `work`); each adds its change first.
void SyncRound(std::vector<std::unique_ptr<Client>>& clients,
               std::vector<std::vector<float>>& params, int r,
               SyncWork work = {}) {
  for (int i = 0; i < 2; ++i) {
    for (uint64_t j = 0; j < kN; ++j) params[i][j] += Change(i, r, j);
  }
  absl::StatusOr<SyncOutcome> a, b;
  std::thread t([&] { b = clients[1]->Sync(absl::MakeSpan(params[1]), work); });
  a = clients[0]->Sync(absl::MakeSpan(params[0]), work);
  t.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->contributors, 2u);
  EXPECT_TRUE(a->contributed && b->contributed);
}

// The job's state as a member joining now fetches it (then it leaves).
std::vector<float> FetchedState(const CoordinatorServer& server,
                                const std::string& name) {
  auto member = Member(server, name);
  std::vector<float> state(kN);
  const absl::Status s = member->Initialize(absl::MakeSpan(state));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(member->Leave().ok());
  return s.ok() ? state : std::vector<float>();
}

std::vector<std::unique_ptr<Client>> StartMembers(
    const CoordinatorServer& server, std::vector<std::vector<float>>& params,
    bool error_reset = false) {
  std::vector<std::unique_ptr<Client>> clients;
  clients.push_back(Member(server, "m0", error_reset));
  clients.push_back(Member(server, "m1", error_reset));
  std::thread t([&] {
    EXPECT_TRUE(clients[1]->Initialize(absl::MakeSpan(params[1])).ok());
  });
  EXPECT_TRUE(clients[0]->Initialize(absl::MakeSpan(params[0])).ok());
  t.join();
  return clients;
}

class SparseWireTest : public ::testing::TestWithParam<Case> {};

TEST_P(SparseWireTest, EveryRound_MembersIdentical_MeanEqualsTheCodecAlone) {
  const Case& c = GetParam();
  auto server = testkit::StartServer(Options(c));
  ASSERT_NE(server, nullptr);
  const std::vector<float> theta0 = Theta0();
  std::vector<std::vector<float>> params(2, theta0);
  auto clients = StartMembers(*server, params);
  ASSERT_EQ(params[0], theta0);
  IndependentMean expected(c.wire, theta0);
  for (int r = 1; r <= 8; ++r) {
    SyncRound(clients, params, r);
    if (HasFatalFailure()) return;
    ASSERT_EQ(params[0], params[1]) << "round " << r;
    if (c.mode == AveragingMode::kMean) {
      std::vector<std::vector<float>> held(2, expected.state());
      for (int i = 0; i < 2; ++i) {
        for (uint64_t j = 0; j < kN; ++j) held[i][j] += Change(i, r, j);
      }
      expected.Round(held);
      ASSERT_EQ(params[0], expected.state()) << "round " << r;
    }
  }
  // Only the kept values moved in round 1, and no more than keep per block
  // in any round: the state is sparse-updated, not densified.
  size_t moved = 0;
  for (uint64_t j = 0; j < kN; ++j) moved += params[0][j] != theta0[j];
  EXPECT_GT(moved, 0u);
  // A late joiner fetches the coordinator's float32 state: the same bits.
  EXPECT_EQ(FetchedState(*server, "late"), params[0]);
  // The bytes a round moves: a sparse upload per member and chunk.
  const SparseCode code = SparseCodeOf(WireCode(c.wire, kKeep));
  std::printf("%s: %zu bytes per upload of %llu values (float32: %llu)\n",
              CaseName(c).c_str(), 2 * SparseWireBytes(kChunkElements, code),
              static_cast<unsigned long long>(kN),
              static_cast<unsigned long long>(4 * kN));
}

TEST_P(SparseWireTest, ErrorReset_ParamsAreTheStatePlusTheOwnResidual) {
  const Case& c = GetParam();
  auto server = testkit::StartServer(Options(c));
  ASSERT_NE(server, nullptr);
  const std::vector<float> theta0 = Theta0();
  std::vector<std::vector<float>> params(2, theta0);
  auto clients = StartMembers(*server, params, /*error_reset=*/true);
  IndependentMean expected(c.wire, theta0, /*error_reset=*/true);
  std::vector<std::vector<float>> held(2, theta0);
  for (int r = 1; r <= 8; ++r) {
    SyncRound(clients, params, r);
    if (HasFatalFailure()) return;
    // What each member holds: the state plus its own residual.
    const std::vector<float> state =
        FetchedState(*server, absl::StrCat("late", r));
    ASSERT_EQ(state.size(), kN);
    size_t differ = 0;
    for (uint64_t j = 0; j < kN; ++j) differ += params[0][j] != state[j];
    EXPECT_GT(differ, kN / 2) << "round " << r << ": no residual kept";
    if (c.mode != AveragingMode::kMean) continue;
    for (int i = 0; i < 2; ++i) {
      for (uint64_t j = 0; j < kN; ++j) held[i][j] += Change(i, r, j);
    }
    expected.Round(held);
    if (HasFatalFailure()) return;
    ASSERT_EQ(state, expected.state()) << "round " << r;
    for (int i = 0; i < 2; ++i) {
      for (uint64_t j = 0; j < kN; ++j) {
        held[i][j] = expected.state()[j] + expected.residual(i)[j];
      }
      ASSERT_EQ(params[i], held[i]) << "member " << i << ", round " << r;
    }
  }
  // The last Sync: both members end on the state alone, the same bits.
  SyncWork last;
  last.last = true;
  SyncRound(clients, params, 9, last);
  if (HasFatalFailure()) return;
  EXPECT_EQ(params[0], params[1]);
  EXPECT_EQ(params[0], FetchedState(*server, "late-end"));
}

// A coordinator restarted from its checkpoint between two rounds goes on
// exactly as one that never stopped: the checkpoint holds its residual and
// momentum, the members keep theirs.
TEST_P(SparseWireTest, RestartFromCheckpoint_RoundsEqualAnUnbrokenRun) {
  const Case& c = GetParam();
  const std::vector<float> theta0 = Theta0();
  std::vector<std::vector<float>> unbroken(2, theta0);
  {
    auto server = testkit::StartServer(Options(c));
    ASSERT_NE(server, nullptr);
    auto clients = StartMembers(*server, unbroken);
    for (int r = 1; r <= 4; ++r) {
      SyncRound(clients, unbroken, r);
      if (HasFatalFailure()) return;
    }
  }
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/lsgd-sparse-restart-", getpid(), "-",
                   CaseName(c));
  std::vector<std::vector<float>> params(2, theta0);
  auto server = testkit::StartServer(Options(c, dir));
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  auto clients = StartMembers(*server, params);
  for (int r = 1; r <= 2; ++r) {
    SyncRound(clients, params, r);
    if (HasFatalFailure()) return;
  }
  // A crash after round 2: nothing beyond the checkpoints survives. Started
  // again on the same port; the members' next Sync finds it.
  server->coordinator()->FlushCheckpoints();
  server->Shutdown(absl::ZeroDuration());
  server.reset();
  ServerOptions again = Options(c, dir);
  again.listen_address = absl::StrCat("127.0.0.1:", port);
  server = testkit::StartServer(std::move(again));
  ASSERT_NE(server, nullptr);
  for (int r = 3; r <= 4; ++r) {
    SyncRound(clients, params, r);
    if (HasFatalFailure()) return;
    ASSERT_EQ(params[0], params[1]) << "round " << r;
  }
  EXPECT_EQ(params[0], unbroken[0]);
}

INSTANTIATE_TEST_SUITE_P(
    Codes, SparseWireTest,
    ::testing::Values(Case{DType::kSparse2, AveragingMode::kMean},
                      Case{DType::kSparse4, AveragingMode::kMean},
                      Case{DType::kSparse2, AveragingMode::kOuterNesterov},
                      Case{DType::kSparse4, AveragingMode::kOuterNesterov}),
    [](const auto& info) { return CaseName(info.param); });

}  // namespace
}  // namespace localsgd
