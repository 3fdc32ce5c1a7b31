// A primary's job and its standby's, through an in-process Replicator that
// applies every update to the standby's job at once and acknowledges on the
// test's word (src/replicator.h): nothing reaches a member before the
// standby has it; the standby holds the primary's state, momentum and
// residual bit for bit after every round and seed; a promoted standby
// opens the round in flight with the chunks members may hold fixed; and
// updates that do not follow from the standby's state are refused, changing
// nothing. Fake clock, no sockets.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/coordinator.h"
#include "src/job.h"
#include "src/replicator.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::MakeFloatLayout;
using testing_util::SyncCapture;

constexpr uint32_t kChunk = 4;
constexpr uint64_t kElements = 10;  // chunks of 4, 4, 2

// Applies each update to `standby` as it is made (or, with hold(), queues
// it) and acknowledges up to the ticket the test names.
class TestReplicator : public Replicator {
 public:
  void set_standby(std::shared_ptr<Job> standby) { standby_ = standby; }

  uint64_t Chunk(ReplicatedChunk chunk) override {
    absl::MutexLock lock(&mu_);
    const uint64_t ticket = ++last_;
    if (standby_ != nullptr) {
      const absl::Status s = standby_->ApplyReplicated(chunk);
      EXPECT_TRUE(s.ok()) << s;
    }
    chunks_.push_back(std::move(chunk));
    return ticket;
  }
  uint64_t Commit(ReplicatedCommit commit) override {
    absl::MutexLock lock(&mu_);
    const uint64_t ticket = ++last_;
    if (standby_ != nullptr) {
      const absl::Status s = standby_->ApplyReplicated(commit);
      EXPECT_TRUE(s.ok()) << s;
    }
    commits_.push_back(std::move(commit));
    return ticket;
  }
  void WhenAcked(uint64_t ticket, std::function<void()> release) override {
    {
      absl::MutexLock lock(&mu_);
      if (ticket > acked_) {
        waiting_.emplace(ticket, std::move(release));
        return;
      }
    }
    release();
  }

  // Acknowledges every update up to `ticket` (all so far if 0).
  void Ack(uint64_t ticket = 0) {
    std::vector<std::function<void()>> run;
    {
      absl::MutexLock lock(&mu_);
      acked_ = std::max(acked_, ticket == 0 ? last_ : ticket);
      while (!waiting_.empty() && waiting_.begin()->first <= acked_) {
        run.push_back(std::move(waiting_.begin()->second));
        waiting_.erase(waiting_.begin());
      }
    }
    for (auto& fn : run) fn();
  }

  uint64_t LastTicket() override { return last(); }
  uint64_t last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }
  std::vector<ReplicatedChunk> chunks() {
    absl::MutexLock lock(&mu_);
    return chunks_;
  }
  std::vector<ReplicatedCommit> commits() {
    absl::MutexLock lock(&mu_);
    return commits_;
  }

 private:
  absl::Mutex mu_;
  std::shared_ptr<Job> standby_;
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  std::multimap<uint64_t, std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<ReplicatedChunk> chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<ReplicatedCommit> commits_ ABSL_GUARDED_BY(mu_);
};

// The chunks told to a member, in order.
struct FinalCapture {
  absl::Mutex mu;
  std::vector<uint32_t> told ABSL_GUARDED_BY(mu);
  std::shared_ptr<const StateSnapshot> next ABSL_GUARDED_BY(mu);

  FinalChunksCallback Callback() {
    return [this](std::vector<uint32_t> indices,
                  std::shared_ptr<const StateSnapshot> state) {
      absl::MutexLock lock(&mu);
      told.insert(told.end(), indices.begin(), indices.end());
      next = std::move(state);
    };
  }
  std::vector<uint32_t> Told() {
    absl::MutexLock lock(&mu);
    return told;
  }
};

// A replicated seed of job "r": state 7, every value 1.
ReplicatedCommit SeedOfOnes() {
  ReplicatedCommit seed;
  seed.job_id = "r";
  seed.round = 0;
  seed.state_id = 7;
  auto values = std::make_shared<StateSnapshot>();
  values->values.assign(kElements, 1.0f);
  seed.seed = values;
  return seed;
}

JobSettings Settings(DType wire, AveragingMode mode) {
  JobSettings s;
  s.chunk_elements = kChunk;
  s.wire_dtype = wire;
  s.mode = mode;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  s.contribution = Contribution::kPseudoGradients;
  s.outer_lr = 0.7f;
  s.outer_momentum = 0.9f;
  return s;
}

class ReplicationTest : public ::testing::Test {
 protected:
  void Make(JobSettings settings) {
    settings_ = settings;
    const Layout layout = MakeFloatLayout({{"w", {10}}});
    primary_ =
        std::make_shared<Job>("r", layout, kElements, settings, JobPolicy(),
                              &clock_, nullptr, nullptr, &replicator_);
    standby_ = std::make_shared<Job>("r", layout, kElements, settings,
                                     JobPolicy(), &clock_);
    replicator_.set_standby(standby_);
  }

  static MemberId Join(Job& job, const std::string& name) {
    JoinRequestParams p;
    p.member_name = name;
    p.layout = job.layout();
    p.incarnation = 1;
    absl::StatusOr<JoinResult> r = job.Join(p);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->member_id : MemberId();
  }

  // Starts a Sync of `m` and sends chunks `first`..`last` of `values`.
  SyncSession* Begin(Job& job, const MemberId& m, RoundId round,
                     SyncCapture& capture, uint64_t anchor,
                     FinalChunksCallback on_final = nullptr) {
    absl::StatusOr<std::unique_ptr<SyncSession>> session = job.BeginSync(
        m, round, capture.Callback(), {}, anchor, std::move(on_final));
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return nullptr;
    sessions_.push_back(*std::move(session));
    return sessions_.back().get();
  }
  void SendChunks(Job& job, SyncSession* session,
                  const std::vector<float>& values, DType dtype,
                  std::vector<uint32_t> chunks) {
    for (uint32_t c : chunks) {
      const std::string wire =
          testing_util::EncodeChunk(values, job.geometry(), c, dtype);
      const absl::Status s = session->AddChunk(c, wire);
      EXPECT_TRUE(s.ok()) << s;
    }
  }

  uint64_t Seed(Job& job, const MemberId& m, const std::vector<float>& v) {
    SyncCapture seed;
    // A pseudo-gradient job's seed is float32, a parameter job's the wire's.
    const DType dtype = settings_.contribution == Contribution::kPseudoGradients
                            ? DType::kFloat32
                            : settings_.wire_dtype;
    SendChunks(job, Begin(job, m, 0, seed, 0), v, dtype, {0, 1, 2});
    replicator_.Ack();
    EXPECT_TRUE(seed.result().ok()) << seed.result().status();
    return seed.result().ok() ? seed.result()->state_id : 0;
  }

  // The standby's state (through a member of its own, as a member would
  // fetch it after a promotion).
  static std::shared_ptr<const StateSnapshot> StateOf(Job& job) {
    const MemberId reader = Join(job, "reader");
    absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
        job.GetState(reader);
    EXPECT_TRUE(job.Leave(reader).ok());
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *state : nullptr;
  }

  static void ExpectSameState(const StateSnapshot& a, const StateSnapshot& b) {
    EXPECT_EQ(a.round, b.round);
    EXPECT_EQ(a.id, b.id);
    EXPECT_EQ(a.values, b.values);
    EXPECT_EQ(a.momentum, b.momentum);
    EXPECT_EQ(a.residual, b.residual);
  }

  std::vector<float> Delta(int member, RoundId round) {
    std::vector<float> d(kElements);
    for (uint64_t i = 0; i < kElements; ++i) {
      d[i] = 0.01f * (member + 1) * round - 0.003f * i * member;
    }
    return d;
  }

  FakeClock clock_;
  JobSettings settings_;
  TestReplicator replicator_;
  std::shared_ptr<Job> primary_, standby_;
  std::vector<std::unique_ptr<SyncSession>> sessions_;
};

// Over rounds of OUTER_NESTEROV on the int8 wire: no chunk and no result
// before the standby acknowledged it; after every round the standby holds
// the primary's state, momentum and residual bit for bit.
TEST_F(ReplicationTest, ResultsWaitForTheAck_StandbyBitForBit) {
  Make(Settings(DType::kInt8Block, AveragingMode::kOuterNesterov));
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  uint64_t anchor = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  ASSERT_NE(anchor, 0u);
  ASSERT_EQ(replicator_.commits().size(), 1u);
  EXPECT_NE(replicator_.commits()[0].seed, nullptr);
  for (RoundId r = 1; r <= 4; ++r) {
    SyncCapture ca, cb;
    FinalCapture fa;
    SyncSession* sa = Begin(*primary_, a, r, ca, anchor, fa.Callback());
    SyncSession* sb = Begin(*primary_, b, r, cb, anchor);
    SendChunks(*primary_, sa, Delta(0, r), DType::kInt8Block, {0, 1, 2});
    SendChunks(*primary_, sb, Delta(1, r), DType::kInt8Block, {0});
    // Chunk 0 is final and shipped; no one is told before the ack.
    const uint64_t chunk0 = replicator_.last();
    EXPECT_TRUE(fa.Told().empty());
    replicator_.Ack(chunk0);
    EXPECT_THAT(fa.Told(), ElementsAre(0u));
    SendChunks(*primary_, sb, Delta(1, r), DType::kInt8Block, {1, 2});
    // Closed: the rest shipped and the commit; nothing more told yet.
    EXPECT_FALSE(ca.fired());
    EXPECT_FALSE(cb.fired());
    EXPECT_THAT(fa.Told(), ElementsAre(0u));
    replicator_.Ack();
    ASSERT_TRUE(ca.result().ok()) << ca.result().status();
    ASSERT_TRUE(cb.result().ok());
    EXPECT_TRUE(ca.result()->contributed);
    ExpectSameState(*ca.result()->state, *StateOf(*standby_));
    EXPECT_EQ(ca.result()->state->delta, StateOf(*standby_)->delta);
    EXPECT_FALSE(ca.result()->state->momentum.empty());
    EXPECT_FALSE(ca.result()->state->residual.empty());
    anchor = ca.result()->state_id;
  }
}

// A member that adopts (late) or fetches gets only a state the standby
// acknowledged.
TEST_F(ReplicationTest, AdoptedAndFetchedStates_WaitForTheAck) {
  Make(Settings(DType::kFloat32, AveragingMode::kMean));
  const MemberId a = Join(*primary_, "a");
  const uint64_t seed = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  SyncCapture ca;
  SendChunks(*primary_, Begin(*primary_, a, 1, ca, seed), Delta(0, 1),
             DType::kFloat32, {0, 1, 2});
  EXPECT_FALSE(ca.fired());
  // The fetchable state is still the seed; a late Sync waits.
  EXPECT_EQ((*primary_->GetState(a))->id, seed);
  SyncCapture late;
  Begin(*primary_, a, 1, late, seed);
  EXPECT_FALSE(late.fired());
  replicator_.Ack();
  ASSERT_TRUE(ca.result().ok());
  ASSERT_TRUE(late.result().ok());
  EXPECT_EQ(late.result()->state_id, ca.result()->state_id);
  EXPECT_EQ((*primary_->GetState(a))->id, ca.result()->state_id);
}

// Parameter jobs replicate their new values per chunk.
TEST_F(ReplicationTest, ParameterJob_StandbyHoldsTheMean) {
  JobSettings s;
  s.chunk_elements = kChunk;
  s.wire_dtype = DType::kBFloat16;
  s.mode = AveragingMode::kMean;
  s.contribution = Contribution::kParameters;
  s.nonfinite_policy = NonFinitePolicy::kReject;
  Make(s);
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  SyncCapture ca, cb;
  SendChunks(*primary_, Begin(*primary_, a, 1, ca, 0),
             std::vector<float>(kElements, 2.0f), DType::kBFloat16, {0, 1, 2});
  SendChunks(*primary_, Begin(*primary_, b, 1, cb, 0),
             std::vector<float>(kElements, 3.0f), DType::kBFloat16, {0, 1, 2});
  EXPECT_FALSE(ca.fired());
  replicator_.Ack();
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->state->values, std::vector<float>(kElements, 2.5f));
  ExpectSameState(*ca.result()->state, *StateOf(*standby_));
}

// The primary dies after members were told chunks 0 and 1 of round 2: the
// promoted standby opens round 2 with those chunks as they were, and the
// contributions sent again (here only a's: b is gone) make the rest.
TEST_F(ReplicationTest, Promote_RoundInFlightKeepsTheChunksMembersHold) {
  Make(Settings(DType::kFloat32, AveragingMode::kMean));
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  uint64_t anchor = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  {
    SyncCapture ca, cb;
    SendChunks(*primary_, Begin(*primary_, a, 1, ca, anchor), Delta(0, 1),
               DType::kFloat32, {0, 1, 2});
    SendChunks(*primary_, Begin(*primary_, b, 1, cb, anchor), Delta(1, 1),
               DType::kFloat32, {0, 1, 2});
    replicator_.Ack();
    ASSERT_TRUE(ca.result().ok());
    anchor = ca.result()->state_id;
  }
  const std::vector<float> before = StateOf(*standby_)->values;
  SyncCapture ca, cb;
  FinalCapture fa;
  SyncSession* sa = Begin(*primary_, a, 2, ca, anchor, fa.Callback());
  SyncSession* sb = Begin(*primary_, b, 2, cb, anchor);
  SendChunks(*primary_, sa, Delta(0, 2), DType::kFloat32, {0, 1, 2});
  SendChunks(*primary_, sb, Delta(1, 2), DType::kFloat32, {0, 1});
  replicator_.Ack();
  ASSERT_THAT(fa.Told(), ElementsAre(0u, 1u));
  std::shared_ptr<const StateSnapshot> held;
  {
    absl::MutexLock lock(&fa.mu);
    held = fa.next;
  }
  // The primary is gone; the standby serves.
  primary_->Stop();
  standby_->Promote();
  const MemberId a2 = Join(*standby_, "a");
  EXPECT_EQ(StateOf(*standby_)->id, anchor);
  SyncCapture again;
  FinalCapture fa2;
  SyncSession* s2 = Begin(*standby_, a2, 2, again, anchor, fa2.Callback());
  // Told at once: the chunks it may hold already.
  EXPECT_THAT(fa2.Told(), ElementsAre(0u, 1u));
  SendChunks(*standby_, s2, Delta(0, 2), DType::kFloat32, {0, 1, 2});
  EXPECT_FALSE(again.fired());
  // The regather (one lease) waits for b, which does not come back.
  for (int half = 0; half < 2; ++half) {
    clock_.Advance(JobPolicy().lease_ttl / 2 + absl::Seconds(1));
    ASSERT_TRUE(standby_->Heartbeat(a2).ok());
  }
  standby_->Tick();
  const absl::StatusOr<SyncResult> result = again.result();  // held
  ASSERT_TRUE(result.ok()) << result.status();
  const SyncResult& got = *result;
  EXPECT_TRUE(got.contributed);
  EXPECT_EQ(got.round, 2u);
  const std::vector<float>& values = got.state->values;
  for (uint64_t i = 0; i < 8; ++i) {  // chunks 0, 1: as told before
    EXPECT_EQ(values[i], before[i] + (Delta(0, 2)[i] + Delta(1, 2)[i]) / 2)
        << i;
  }
  for (uint64_t i = 8; i < kElements; ++i) {  // chunk 2: a's delta alone
    EXPECT_EQ(values[i], before[i] + Delta(0, 2)[i]) << i;
  }
  // What members decode of chunks 0 and 1 is what the dead primary sent.
  EXPECT_EQ(got.state->delta.substr(0, 8 * sizeof(float)),
            held->delta.substr(0, 8 * sizeof(float)));
}

// The members travel with every state: a promoted standby knows them under
// their ids, weights and credentials, so their next Syncs go on there
// without a Join, and the round counts them.
TEST_F(ReplicationTest, Promote_MembersGoOnUnderTheirIds) {
  Make(Settings(DType::kFloat32, AveragingMode::kMean));
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  uint64_t anchor = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  const std::vector<MemberInfo> on_primary = primary_->Status(0).members;
  ASSERT_EQ(on_primary.size(), 2u);
  std::vector<MemberInfo> on_standby = standby_->Status(0).members;
  ASSERT_EQ(on_standby.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(on_standby[i].id, on_primary[i].id);
    EXPECT_EQ(on_standby[i].name, on_primary[i].name);
    EXPECT_EQ(on_standby[i].weight, on_primary[i].weight);
    EXPECT_EQ(on_standby[i].incarnation, on_primary[i].incarnation);
    EXPECT_EQ(on_standby[i].principal, on_primary[i].principal);
    EXPECT_EQ(on_standby[i].first_round, on_primary[i].first_round);
  }
  primary_->Stop();
  standby_->Promote();
  SyncCapture ca, cb;
  SendChunks(*standby_, Begin(*standby_, a, 1, ca, anchor), Delta(0, 1),
             DType::kFloat32, {0, 1, 2});
  SendChunks(*standby_, Begin(*standby_, b, 1, cb, anchor), Delta(1, 1),
             DType::kFloat32, {0, 1, 2});
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  ASSERT_TRUE(cb.result().ok()) << cb.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(ca.result()->contributors, 2u);
  for (uint64_t i = 0; i < kElements; ++i) {
    EXPECT_EQ(ca.result()->state->values[i],
              1.0f + (Delta(0, 1)[i] + Delta(1, 1)[i]) / 2)
        << i;
  }
}

// A standby's members are its primary's: while it follows, their leases do
// not run out here however long the gap between two commits (they call
// the primary); promoted, it starts them again and they are all there.
TEST(StandbyCoordinatorTest, FollowingKeepsTheMembersLeases) {
  FakeClock clock;
  CoordinatorOptions options;
  options.clock = &clock;
  auto created = Coordinator::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  Coordinator& standby = **created;
  standby.BeginFollowing();
  ReplicatedCommit seed = SeedOfOnes();
  seed.layout = MakeFloatLayout({{"w", {10}}});
  seed.settings = Settings(DType::kFloat32, AveragingMode::kMean);
  seed.settings.deadline_mode = DeadlineMode::kFixed;  // complete, as sent
  seed.settings.mean_encoding = MeanEncoding::kFloat32;
  seed.settings.rendezvous_members = 1;
  seed.settings.outlier_ratio = 10;
  for (int i = 0; i < 2; ++i) {
    MemberInfo m;
    m.id = MemberId(std::string(31, 'a') + static_cast<char>('0' + i));
    m.name = "m" + std::to_string(i);
    seed.members.push_back(m);
  }
  const absl::Status applied = standby.ApplyReplicated(seed);
  ASSERT_TRUE(applied.ok()) << applied;
  clock.Advance(JobPolicy().lease_ttl * 3);  // a long round at the primary
  standby.Tick();
  ASSERT_EQ(standby.Jobs().size(), 1u);
  EXPECT_EQ(standby.Jobs()[0]->Status(0).members.size(), 2u);
  standby.PromoteReplicas();
  standby.Tick();
  EXPECT_EQ(standby.Jobs()[0]->Status(0).members.size(), 2u);
  // Promoted, the leases run here: one lease later without a call, gone.
  clock.Advance(JobPolicy().lease_ttl + absl::Seconds(1));
  standby.Tick();
  EXPECT_EQ(standby.Jobs()[0]->Status(0).members.size(), 0u);
}

// A standby that starts following mid-round (the catch-up: the primary's
// state and the final chunks of its open round, then the updates after the
// cut) holds the primary's state bit for bit after that round's close.
TEST_F(ReplicationTest, CatchUpMidRound_ThenFollowsBitForBit) {
  Make(Settings(DType::kInt4Block, AveragingMode::kOuterNesterov));
  replicator_.set_standby(nullptr);
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  uint64_t anchor = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  for (RoundId r = 1; r <= 2; ++r) {
    SyncCapture ca, cb;
    SyncSession* sa = Begin(*primary_, a, r, ca, anchor);
    SyncSession* sb = Begin(*primary_, b, r, cb, anchor);
    SendChunks(*primary_, sa, Delta(0, r), DType::kInt4Block, {0, 1, 2});
    SendChunks(*primary_, sb, Delta(1, r), DType::kInt4Block, {0, 1});
    if (r == 2) {
      // Chunks 0 and 1 final: the standby catches up now.
      const JobReplica replica = primary_->ExportReplica();
      EXPECT_EQ(replica.sequence, replicator_.last());
      EXPECT_THAT(replica.final_chunks, ElementsAre(0u, 1u));
      standby_ = std::make_shared<Job>("r", primary_->layout(), kElements,
                                       settings_, JobPolicy(), &clock_);
      ASSERT_TRUE(standby_->ImportReplica(replica).ok());
      replicator_.set_standby(standby_);
    }
    SendChunks(*primary_, sb, Delta(1, r), DType::kInt4Block, {2});
    replicator_.Ack();
    ASSERT_TRUE(ca.result().ok()) << ca.result().status();
    anchor = ca.result()->state_id;
    if (r == 2) {
      ExpectSameState(*ca.result()->state, *StateOf(*standby_));
      EXPECT_EQ(ca.result()->state->delta, StateOf(*standby_)->delta);
    }
  }
}

// Mean encoding wire over the int4 wire: each chunk a member gave goes to
// the standby as its encoded mean, the chunk's int4 bytes (the size of a
// member's download of it), never in float32; the standby holds the
// primary's state, momentum, step residual and delta bit for bit, and no
// mean residual of its own (the primary's is not replicated).
TEST_F(ReplicationTest,
       EncodedMean_StandbyGetsTheWireBytesAndFollowsBitForBit) {
  JobSettings settings =
      Settings(DType::kInt4Block, AveragingMode::kOuterNesterov);
  settings.mean_encoding = MeanEncoding::kWire;
  Make(settings);
  const MemberId a = Join(*primary_, "a"), b = Join(*primary_, "b");
  uint64_t anchor = Seed(*primary_, a, std::vector<float>(kElements, 1.0f));
  for (RoundId r = 1; r <= 4; ++r) {
    SyncCapture ca, cb;
    SyncSession* sa = Begin(*primary_, a, r, ca, anchor);
    SyncSession* sb = Begin(*primary_, b, r, cb, anchor);
    SendChunks(*primary_, sa, Delta(0, r), DType::kInt4Block, {0, 1, 2});
    SendChunks(*primary_, sb, Delta(1, r), DType::kInt4Block, {0, 1, 2});
    replicator_.Ack();
    ASSERT_TRUE(ca.result().ok()) << ca.result().status();
    const StateSnapshot& primary = *ca.result()->state;
    const std::shared_ptr<const StateSnapshot> standby = StateOf(*standby_);
    ExpectSameState(primary, *standby);
    EXPECT_EQ(primary.delta, standby->delta);
    EXPECT_FALSE(primary.residual.empty());
    EXPECT_THAT(standby->mean_residual, Each(0.0f));
    EXPECT_THAT(primary.mean_residual, Not(Each(0.0f)));
    anchor = ca.result()->state_id;
  }
  size_t encoded_bytes = 0;
  for (const ReplicatedChunk& c : replicator_.chunks()) {
    EXPECT_TRUE(c.mean.empty())
        << "chunk " << c.chunk << " of round " << c.round << " went in float32";
    EXPECT_EQ(c.encoded_mean.size(),
              WireBytes(DType::kInt4Block, primary_->geometry().Size(c.chunk)));
    encoded_bytes += c.encoded_mean.size();
  }
  // Four rounds of one download each.
  EXPECT_EQ(encoded_bytes, 4 * StateOf(*primary_)->delta.size());
}

// A chunk's mean in the form the job does not take, or encoded bytes that
// are not the chunk's: refused, and nothing changed (the good one applies
// after them).
TEST_F(ReplicationTest, EncodedMean_RefusesTheWrongForm) {
  JobSettings settings =
      Settings(DType::kInt4Block, AveragingMode::kOuterNesterov);
  settings.mean_encoding = MeanEncoding::kWire;
  Make(settings);
  replicator_.set_standby(nullptr);
  ASSERT_TRUE(standby_->ApplyReplicated(SeedOfOnes()).ok());
  ReplicatedChunk good;
  good.job_id = "r";
  good.round = 1;
  good.chunk = 0;
  good.contributed = true;
  EncodeValues(std::vector<float>(kChunk, 0.5f), DType::kInt4Block,
               &good.encoded_mean);
  ReplicatedChunk as_float32 = good;
  as_float32.encoded_mean.clear();
  as_float32.mean.assign(kChunk, 0.5f);
  EXPECT_THAT(standby_->ApplyReplicated(as_float32).message(),
              HasSubstr("has 4 values; expected 0"));
  ReplicatedChunk short_bytes = good;
  short_bytes.encoded_mean.pop_back();
  EXPECT_THAT(standby_->ApplyReplicated(short_bytes).message(),
              HasSubstr("bytes; chunk 0 takes"));
  ReplicatedChunk nobody = good;
  nobody.contributed = false;
  EXPECT_THAT(standby_->ApplyReplicated(nobody).message(),
              HasSubstr("takes none for a chunk no one gave"));
  EXPECT_TRUE(standby_->ApplyReplicated(good).ok());
  // A job of mean encoding float32 takes no encoded mean.
  Make(Settings(DType::kInt4Block, AveragingMode::kOuterNesterov));
  replicator_.set_standby(nullptr);
  ASSERT_TRUE(standby_->ApplyReplicated(SeedOfOnes()).ok());
  good.mean.assign(kChunk, 0.5f);
  const absl::Status s = standby_->ApplyReplicated(good);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("has mean encoding float32"));
}

// Updates that do not follow from the standby's state are refused, and
// change nothing.
TEST_F(ReplicationTest, ApplyReplicated_RefusesWhatDoesNotFollow) {
  Make(Settings(DType::kFloat32, AveragingMode::kMean));
  replicator_.set_standby(nullptr);  // the test feeds the standby
  ReplicatedCommit seed = SeedOfOnes();
  ReplicatedChunk chunk;
  chunk.job_id = "r";
  chunk.round = 1;
  chunk.chunk = 0;
  chunk.contributed = true;
  chunk.mean.assign(kChunk, 0.5f);
  // Before any state.
  EXPECT_EQ(standby_->ApplyReplicated(chunk).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(standby_->ApplyReplicated(seed).ok());
  struct Bad {
    std::string name;
    std::function<void(ReplicatedChunk&)> spoil;
    absl::StatusCode code;
    std::string message;
  };
  for (const Bad& bad : std::vector<Bad>{
           {"another round", [](ReplicatedChunk& c) { c.round = 3; },
            absl::StatusCode::kFailedPrecondition, "so it takes round 1"},
           {"index", [](ReplicatedChunk& c) { c.chunk = 3; },
            absl::StatusCode::kInvalidArgument, "the job has 3 chunks"},
           {"size", [](ReplicatedChunk& c) { c.mean.pop_back(); },
            absl::StatusCode::kInvalidArgument, "has 3 values; expected 4"},
           {"non-finite",
            [](ReplicatedChunk& c) {
              c.mean[2] = std::numeric_limits<float>::quiet_NaN();
            },
            absl::StatusCode::kInvalidArgument,
            "non-finite value at element 2"},
       }) {
    ReplicatedChunk c = chunk;
    bad.spoil(c);
    const absl::Status s = standby_->ApplyReplicated(c);
    EXPECT_EQ(s.code(), bad.code) << bad.name << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(bad.message)) << bad.name;
  }
  ASSERT_TRUE(standby_->ApplyReplicated(chunk).ok());
  EXPECT_EQ(standby_->ApplyReplicated(chunk).code(),
            absl::StatusCode::kFailedPrecondition);  // final twice
  ReplicatedCommit commit;
  commit.job_id = "r";
  commit.round = 1;
  commit.state_id = 8;
  commit.previous_id = 7;
  const absl::Status early = standby_->ApplyReplicated(commit);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("before every chunk of it: 1 of 3"));
  commit.previous_id = 6;
  EXPECT_THAT(standby_->ApplyReplicated(commit).message(),
              HasSubstr("follows state 6"));
  // Members that are not well formed: refused before anything changes.
  MemberInfo m;
  m.id = MemberId(std::string(32, 'a'));
  m.name = "a";
  for (const auto& [name, members, message] : std::vector<
           std::tuple<std::string, std::vector<MemberInfo>, std::string>>{
           {"id",
            {[m] {
              MemberInfo x = m;
              x.id = MemberId("zz");
              return x;
            }()},
            "member 0 has no well-formed member id"},
           {"name",
            {[m] {
              MemberInfo x = m;
              x.name.clear();
              return x;
            }()},
            "member 0 has no name"},
           {"weight",
            {[m] {
              MemberInfo x = m;
              x.weight = std::numeric_limits<double>::infinity();
              return x;
            }()},
            "has weight inf"},
           {"twice", {m, m}, "member 1 ('a') repeats another's id or name"},
           {"too many", std::vector<MemberInfo>(JobPolicy().max_members + 1, m),
            "more than the 1024"},
       }) {
    ReplicatedCommit c = commit;
    c.previous_id = 7;
    c.members = members;
    const absl::Status st = standby_->ApplyReplicated(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name << st;
    EXPECT_THAT(st.message(), HasSubstr(message)) << name;
  }
  // Nothing changed: the seed is the state; the rest completes round 1.
  EXPECT_EQ(StateOf(*standby_)->id, 7u);
  chunk.chunk = 1;
  ASSERT_TRUE(standby_->ApplyReplicated(chunk).ok());
  chunk.chunk = 2;
  chunk.mean.assign(2, 0.5f);
  ASSERT_TRUE(standby_->ApplyReplicated(chunk).ok());
  commit.previous_id = 7;
  ASSERT_TRUE(standby_->ApplyReplicated(commit).ok());
  EXPECT_EQ(StateOf(*standby_)->values, std::vector<float>(kElements, 1.5f));
  EXPECT_EQ(StateOf(*standby_)->round, 1u);
}

}  // namespace
}  // namespace localsgd
