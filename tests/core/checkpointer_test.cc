// The coordinator checkpoints every new global state in the background and a
// new coordinator over the same store restores the jobs.
#include <unistd.h>

#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "src/checkpoint.h"
#include "src/coordinator.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using testing_util::SaveWhole;

using testing_util::EncodeChunk;
using testing_util::SmallLayout;
using testing_util::SyncCapture;
using testing_util::TotalElements;

class CheckpointerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/lsgd-checkpointer-", getpid(),
                        "-", ::testing::UnitTest::GetInstance()->random_seed());
    auto store = CheckpointStore::Open(dir_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<Coordinator> NewCoordinator(ShardSpec shard = ShardSpec()) {
    CoordinatorOptions options;
    options.shard = shard;
    options.clock = &clock_;
    options.default_settings.chunk_elements = 5;
    options.checkpoint_store = store_.get();
    auto c = Coordinator::Create(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }

  // Member `member` of `job` sends `values` for `round`; returns the capture.
  // The session (the stream) stays open until the fixture ends, as a worker
  // waiting for its round's result would.
  SyncCapture Send(Job& job, const MemberId& member, RoundId round,
                   const std::vector<float>& values) {
    SyncCapture capture;
    auto session = job.BeginSync(member, round, capture.Callback());
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return capture;
    sessions_.push_back(*std::move(session));
    for (uint32_t c = 0; c < job.geometry().num_chunks(); ++c) {
      EXPECT_TRUE(sessions_.back()
                      ->AddChunk(c, EncodeChunk(values, job.geometry(), c,
                                                DType::kFloat32))
                      .ok());
    }
    return capture;
  }

  // The same for a pseudo-gradient job: `values` are the delta against
  // the state `anchor`, encoded in `dtype`.
  SyncCapture SendDelta(Job& job, const MemberId& member, RoundId round,
                        const std::vector<float>& values, DType dtype,
                        uint64_t anchor) {
    SyncCapture capture;
    auto session = job.BeginSync(member, round, capture.Callback(), {}, anchor);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return capture;
    sessions_.push_back(*std::move(session));
    for (uint32_t c = 0; c < job.geometry().num_chunks(); ++c) {
      EXPECT_TRUE(
          sessions_.back()
              ->AddChunk(c, EncodeChunk(values, job.geometry(), c, dtype))
              .ok());
    }
    return capture;
  }

  std::string dir_;
  FakeClock clock_;
  std::vector<std::unique_ptr<SyncSession>> sessions_;
  std::unique_ptr<CheckpointStore> store_;
};

TEST_F(CheckpointerTest, EveryNewStateIsWrittenAndRestoredByANewCoordinator) {
  const Layout layout = SmallLayout();
  const uint64_t n = TotalElements(layout);
  std::vector<float> round2;
  {
    auto coordinator = NewCoordinator();
    JoinRequestParams params;
    params.layout = layout;
    params.incarnation = 1;
    params.member_name = "a";
    auto a = coordinator->Join("job", params);
    params.member_name = "b";
    params.incarnation = 2;
    auto b = coordinator->Join("job", params);
    ASSERT_TRUE(a.ok() && b.ok());
    auto job = *coordinator->FindJob("job");
    std::vector<float> seed(n, 1.0f);
    Send(*job, a->member_id, 0, seed);
    coordinator->FlushCheckpoints();
    auto loaded = store_->LoadAll();
    ASSERT_TRUE(loaded.ok());
    ASSERT_EQ(loaded->size(), 1u);
    EXPECT_EQ((*loaded)[0].round, 0u);
    EXPECT_EQ((*loaded)[0].values, seed);

    for (RoundId r = 1; r <= 2; ++r) {
      SyncCapture ca =
          Send(*job, a->member_id, r, std::vector<float>(n, 1.0f * r));
      SyncCapture cb =
          Send(*job, b->member_id, r, std::vector<float>(n, 3.0f * r));
      ASSERT_TRUE(cb.result().ok());
      round2 = cb.result()->state->values;
    }
    EXPECT_EQ(round2, std::vector<float>(n, 4.0f));
    sessions_.clear();    // the streams end before their coordinator
    coordinator->Stop();  // writes what is queued
  }
  auto loaded = store_->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].round, 2u);
  EXPECT_EQ((*loaded)[0].values, round2);
  EXPECT_EQ((*loaded)[0].layout.fingerprint, layout.fingerprint);
  EXPECT_EQ((*loaded)[0].participants, 2u);

  // A new coordinator resumes the job at round 2; a member that joins fetches
  // it and the next round is 3. The job regathers: round 3 waits for members
  // that come back a little later, and counts them; with as many back as
  // round 2 had (two), it closes without waiting out the lease.
  auto restored = NewCoordinator();
  JoinRequestParams params;
  params.layout = layout;
  params.incarnation = 7;
  params.member_name = "c";
  auto c = restored->Join("job", params);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->has_state);
  EXPECT_EQ(c->state_round, 2u);
  auto job = *restored->FindJob("job");
  auto state = job->GetState(c->member_id);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->values, round2);
  SyncCapture cc = Send(*job, c->member_id, 3, std::vector<float>(n, 9.0f));
  restored->Tick();
  EXPECT_FALSE(cc.fired()) << "round 3 closed before the others could return";
  params.incarnation = 8;
  params.member_name = "d";
  auto d = restored->Join("job", params);
  ASSERT_TRUE(d.ok()) << d.status();
  SyncCapture cd = Send(*job, d->member_id, 3, std::vector<float>(n, 5.0f));
  restored->Tick();
  ASSERT_TRUE(cc.result().ok()) << cc.result().status();
  EXPECT_EQ(cc.result()->round, 3u);
  EXPECT_EQ(cc.result()->contributors, 2u);
  EXPECT_EQ(cc.result()->state->values, std::vector<float>(n, 7.0f));
}

TEST_F(CheckpointerTest, CheckpointOverTheLimits_IsSkippedNotFatal) {
  JobCheckpoint big;
  big.job_id = "big";
  big.layout = testing_util::MakeFloatLayout({{"w", {100}}});
  big.settings = {0,
                  10,
                  DType::kFloat32,
                  AveragingMode::kMean,
                  0,
                  NonFinitePolicy::kReject,
                  Contribution::kParameters};
  big.settings.deadline_mode = DeadlineMode::kFixed;
  big.settings.mean_encoding = MeanEncoding::kFloat32;
  big.round = 3;
  big.values.assign(100, 0.5f);
  ASSERT_TRUE(SaveWhole(*store_, big).ok());
  CoordinatorOptions options;
  options.clock = &clock_;
  options.default_settings.chunk_elements = 5;
  options.max_model_elements = 50;  // the checkpoint no longer fits
  options.checkpoint_store = store_.get();
  auto coordinator = Coordinator::Create(options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  EXPECT_TRUE(absl::IsNotFound((*coordinator)->FindJob("big").status()));
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// A replica's checkpoint holds its shard's chunks and restores only into the
// same shard: a replica started with another --shard_index on that volume
// must not serve another shard's parameters as its own.
TEST_F(CheckpointerTest, ShardCheckpoint_RestoresOnlyIntoTheSameShard) {
  const Layout layout = SmallLayout();  // 23 elements, chunks of 5: 5 chunks
  const ShardSpec shard{1, 2};          // chunks 1, 3: 10 elements
  {
    auto coordinator = NewCoordinator(shard);
    JoinRequestParams params;
    params.layout = layout;
    params.incarnation = 1;
    params.member_name = "a";
    auto a = coordinator->Join("job", params);
    ASSERT_TRUE(a.ok()) << a.status();
    auto job = *coordinator->FindJob("job");
    ASSERT_EQ(job->geometry().num_elements(), 10u);
    Send(*job, a->member_id, 0, std::vector<float>(10, 2.5f));
    sessions_.clear();
    coordinator->Stop();
  }
  auto loaded = store_->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].shard, shard);
  EXPECT_EQ((*loaded)[0].values, std::vector<float>(10, 2.5f));

  auto same = NewCoordinator(shard);
  EXPECT_TRUE(same->FindJob("job").ok());
  same->Stop();
  auto other = NewCoordinator(ShardSpec{0, 2});
  EXPECT_EQ(other->FindJob("job").status().code(), absl::StatusCode::kNotFound);
}

// A state that an older build let become non-finite is never served: the
// job is not restored (the log says why), and a Join creates it anew, for
// its members to re-seed.
TEST_F(CheckpointerTest, NonFiniteCheckpointedState_IsNotRestored) {
  const Layout layout = SmallLayout();
  {
    auto coordinator = NewCoordinator();
    JoinRequestParams params;
    params.layout = layout;
    params.incarnation = 1;
    params.member_name = "a";
    auto a = coordinator->Join("job", params);
    ASSERT_TRUE(a.ok()) << a.status();
    auto job = *coordinator->FindJob("job");
    Send(*job, a->member_id, 0,
         std::vector<float>(TotalElements(layout), 2.5f));
    sessions_.clear();
    coordinator->Stop();
  }
  auto loaded = store_->LoadAll();
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 1u);
  JobCheckpoint poisoned = (*loaded)[0];
  poisoned.values[3] = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(store_->Save(poisoned, poisoned.values).ok());

  auto restarted = NewCoordinator();
  EXPECT_EQ(restarted->FindJob("job").status().code(),
            absl::StatusCode::kNotFound);
  JoinRequestParams params;
  params.layout = layout;
  params.incarnation = 1;
  params.member_name = "a";
  auto again = restarted->Join("job", params);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->has_state);
  restarted->Stop();
}

// A pseudo-gradient job restarts where it was: the restored coordinator
// holds the same state (and id, so members go on with their deltas), the
// outer optimizer's momentum and the quantization residual, and its next
// round equals the one the first coordinator would have closed.
TEST_F(CheckpointerTest, PseudoGradientJob_RestartKeepsMomentumAndResidual) {
  const Layout layout = SmallLayout();
  const uint64_t n = TotalElements(layout);
  JoinRequestParams params;
  params.layout = layout;
  params.incarnation = 1;
  params.member_name = "a";
  params.settings.contribution = Contribution::kPseudoGradients;
  params.settings.mode = AveragingMode::kOuterNesterov;
  params.settings.wire_dtype = DType::kInt8Block;
  std::vector<float> round3_delta(n);
  for (uint64_t i = 0; i < n; ++i) round3_delta[i] = 0.01f * (i % 7) - 0.02f;
  auto delta = [&](RoundId r) {
    std::vector<float> d(n);
    for (uint64_t i = 0; i < n; ++i) d[i] = 0.001f * r * (i % 5) + 0.003f;
    return d;
  };
  // Rounds 1..last on `coordinator`; returns the states after each round.
  auto run = [&](Coordinator& coordinator, RoundId last) {
    std::vector<std::shared_ptr<const StateSnapshot>> states;
    auto a = coordinator.Join("job", params);
    EXPECT_TRUE(a.ok()) << a.status();
    auto job = *coordinator.FindJob("job");
    SyncCapture seed = Send(*job, a->member_id, 0, std::vector<float>(n, 1));
    uint64_t anchor = seed.result()->state_id;
    for (RoundId r = 1; r <= last; ++r) {
      SyncCapture c =
          SendDelta(*job, a->member_id, r, r == 3 ? round3_delta : delta(r),
                    DType::kInt8Block, anchor);
      EXPECT_TRUE(c.result().ok()) << c.result().status();
      anchor = c.result()->state_id;
      states.push_back(c.result()->state);
    }
    sessions_.clear();
    coordinator.Stop();
    return states;
  };
  // Without a restart (and without checkpoints).
  CoordinatorOptions plain;
  plain.clock = &clock_;
  plain.default_settings.chunk_elements = 5;
  auto reference = *Coordinator::Create(plain);
  const std::shared_ptr<const StateSnapshot> at3 = run(*reference, 3).back();
  // With a restart after round 2.
  std::shared_ptr<const StateSnapshot> at2;
  {
    auto coordinator = NewCoordinator();
    at2 = run(*coordinator, 2).back();
  }
  ASSERT_FALSE(at2->momentum.empty());
  ASSERT_FALSE(at2->residual.empty());
  auto restored = NewCoordinator();
  auto a = restored->Join("job", params);
  ASSERT_TRUE(a.ok()) << a.status();
  auto job = *restored->FindJob("job");
  auto state = job->GetState(a->member_id);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->id, at2->id);
  EXPECT_EQ((*state)->values, at2->values);
  SyncCapture c3 = SendDelta(*job, a->member_id, 3, round3_delta,
                             DType::kInt8Block, at2->id);
  clock_.Advance(restored->options().policy.lease_ttl);  // the regather
  restored->Tick();
  ASSERT_TRUE(c3.result().ok()) << c3.result().status();
  EXPECT_TRUE(c3.result()->delta);
  EXPECT_EQ(c3.result()->state->values, at3->values);
  EXPECT_EQ(c3.result()->state->momentum, at3->momentum);
  EXPECT_EQ(c3.result()->state->residual, at3->residual);
  EXPECT_EQ(c3.result()->state->delta, at3->delta);
  sessions_.clear();
  restored->Stop();
}

}  // namespace
}  // namespace localsgd
