// Runs a pseudo-gradient job of the core (src/job.h) with an outer rule
// over rounds in which members join and leave and one member's delta comes
// three rounds stale (max_staleness 3: it counts with its weight / 4; the
// weight printed is the one it counted with), and prints, one JSON object
// per line, the seed state and every round's weighted contributions and the
// state the coordinator arrived at: the input of outer_rule_check.py, which
// replays the rounds with torch.optim.SGD and compares.
//
//   outer_rule_dump RULE LR MOMENTUM    (RULE: outer_nesterov | outer_sgd)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "src/clock.h"
#include "src/codec.h"
#include "src/job.h"
#include "src/layout.h"

namespace localsgd {
namespace {

constexpr uint64_t kElements = 37;  // chunks of 8: 8, 8, 8, 8, 5
constexpr uint32_t kChunk = 8;

void PrintArray(const char* name, const std::vector<float>& v) {
  std::printf("\"%s\": [", name);
  for (size_t i = 0; i < v.size(); ++i) {
    std::printf("%s%.9g", i ? ", " : "", v[i]);
  }
  std::printf("]");
}

int Run(const std::string& rule, float lr, float mu) {
  JobSettings s;
  s.chunk_elements = kChunk;
  s.wire_dtype = DType::kFloat32;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.contribution = Contribution::kPseudoGradients;
  s.mode = rule == "outer_sgd" ? AveragingMode::kOuterSgd
                               : AveragingMode::kOuterNesterov;
  s.outer_lr = lr;
  s.outer_momentum = mu;
  s.max_staleness = 3;
  FakeClock clock;
  JobPolicy policy;
  policy.round_deadline = absl::Seconds(5);
  auto job = std::make_shared<Job>(
      "reference",
      MakeLayout({TensorSpec{
          "w", {static_cast<int64_t>(kElements)}, DType::kFloat32}}),
      kElements, s, policy, &clock);
  auto join = [&](const std::string& name, double weight) {
    JoinRequestParams p;
    p.member_name = name;
    p.layout = job->layout();
    p.incarnation = 1;
    p.weight = weight;
    absl::StatusOr<JoinResult> r = job->Join(p);
    if (!r.ok()) std::abort();
    return r->member_id;
  };
  std::vector<std::unique_ptr<SyncSession>> sessions;
  auto send = [&](const MemberId& m, RoundId round, const std::vector<float>& v,
                  uint64_t anchor, std::shared_ptr<const StateSnapshot>* out) {
    auto session = job->BeginSync(
        m, round,
        [out](absl::StatusOr<SyncResult> r) {
          if (out != nullptr && r.ok()) *out = r->state;
        },
        {}, anchor);
    if (!session.ok()) std::abort();
    const ChunkGeometry& g = job->geometry();
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      std::string wire;
      EncodeValues(absl::MakeConstSpan(v).subspan(g.Offset(c), g.Size(c)),
                   DType::kFloat32, &wire);
      if (!(*session)->AddChunk(c, wire).ok()) std::abort();
    }
    sessions.push_back(*std::move(session));
  };
  struct Member {
    std::string name;
    double weight;
    MemberId id;
  };
  std::vector<Member> members = {{"a", 1, {}}, {"b", 2, {}}};
  for (Member& m : members) m.id = join(m.name, m.weight);
  std::vector<float> seed(kElements);
  for (uint64_t i = 0; i < kElements; ++i) seed[i] = std::sin(0.3f * i);
  std::shared_ptr<const StateSnapshot> state;
  send(members[0].id, 0, seed, 0, &state);
  if (state == nullptr) std::abort();
  std::printf("{");
  PrintArray("seed", state->values);
  std::printf("}\n");
  // The state of each round, for a's stale delta: a sits out rounds 3 to 5
  // (they close at their deadline without it) and in round 6 sends its
  // delta against round 2's state, for round 3: three rounds stale (after
  // the others' fresh ones, so that the round closes with it; sent first
  // it would be banked and a answered at once, RoundState::Bank).
  std::vector<std::shared_ptr<const StateSnapshot>> states = {state};
  for (RoundId r = 1; r <= 8; ++r) {
    if (r == 3) members.push_back({"c", 0.5, join("c", 0.5)});  // joins
    if (r == 6) {                                               // b leaves
      if (!job->Leave(members[1].id).ok()) std::abort();
      members.erase(members.begin() + 1);
    }
    std::shared_ptr<const StateSnapshot> next;
    std::vector<float> stale_delta;
    std::printf("{\"round\": %d, \"contributions\": [", static_cast<int>(r));
    bool first = true;
    for (size_t k = 0; k < members.size(); ++k) {
      const bool away = k == 0 && r >= 3 && r <= 5;
      const bool stale = k == 0 && r == 6;
      if (away) continue;
      std::vector<float> d(kElements);
      for (uint64_t i = 0; i < kElements; ++i) {
        d[i] = 0.01f * std::cos(0.7f * i + 1.3f * k + 0.11f * r) +
               0.002f * static_cast<float>(r);
      }
      // The weight it counts with (a quarter of a's: exact).
      const float weight =
          static_cast<float>(members[k].weight) * (stale ? 0.25f : 1.0f);
      std::printf("%s{\"weight\": %.9g, ", first ? "" : ", ", weight);
      first = false;
      PrintArray("delta", d);
      std::printf("}");
      if (stale) {
        stale_delta = d;  // sent last: the round closes with it
      } else {
        send(members[k].id, r, d, state->id, &next);
      }
    }
    if (!stale_delta.empty()) {
      send(members[0].id, 3, stale_delta, states[2]->id, nullptr);
      stale_delta.clear();
    }
    if (r >= 3 && r <= 5) {
      // Round r closes at its deadline, without a.
      clock.Advance(absl::Seconds(6));
      job->Tick();
    }
    if (next == nullptr || next->round != r) std::abort();
    state = next;
    states.push_back(state);
    std::printf("], ");
    PrintArray("state", state->values);
    std::printf("}\n");
  }
  return 0;
}

}  // namespace
}  // namespace localsgd

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s outer_nesterov|outer_sgd LR MOMENTUM\n",
                 argv[0]);
    return 2;
  }
  return localsgd::Run(argv[1], std::strtof(argv[2], nullptr),
                       std::strtof(argv[3], nullptr));
}
