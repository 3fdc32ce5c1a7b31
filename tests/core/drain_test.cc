// Tests of the coordinator's drain (the graceful half of a shutdown) and of
// the events it reports to a CoordinatorObserver. Fake clock; the only real
// waits are Drain's own, bounded by its deadline.
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/coordinator.h"
#include "src/job.h"
#include "src/observer.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testing_util::EncodeChunk;
using testing_util::SmallLayout;
using testing_util::SyncCapture;
using testing_util::TotalElements;

// Records every event, thread-safely.
class RecordingObserver : public CoordinatorObserver {
 public:
  void RoundClosed(const RoundClosedEvent& event) override {
    absl::MutexLock lock(&mu_);
    rounds_.push_back(event);
  }
  void LeaseExpired(absl::string_view job_id,
                    absl::string_view member_name) override {
    absl::MutexLock lock(&mu_);
    expired_.push_back(absl::StrCat(job_id, "/", member_name));
  }
  void LateContribution(absl::string_view job_id, RoundId round) override {
    absl::MutexLock lock(&mu_);
    late_.push_back(absl::StrCat(job_id, "/", round));
  }

  std::vector<RoundClosedEvent> rounds() {
    absl::MutexLock lock(&mu_);
    return rounds_;
  }
  std::vector<std::string> expired() {
    absl::MutexLock lock(&mu_);
    return expired_;
  }
  std::vector<std::string> late() {
    absl::MutexLock lock(&mu_);
    return late_;
  }

 private:
  absl::Mutex mu_;
  std::vector<RoundClosedEvent> rounds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> expired_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> late_ ABSL_GUARDED_BY(mu_);
};

class DrainTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(CoordinatorOptions()); }

  void Init(CoordinatorOptions options) {
    options.clock = &clock_;
    options.observer = &observer_;
    absl::StatusOr<std::unique_ptr<Coordinator>> c =
        Coordinator::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
  }

  static JoinRequestParams Params(const std::string& name) {
    return testing_util::SmallJoin(name);
  }

  MemberId Join(const std::string& job_id, const std::string& name) {
    absl::StatusOr<JoinResult> r = coordinator_->Join(job_id, Params(name));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->member_id : MemberId();
  }

  std::shared_ptr<Job> GetJob(const std::string& job_id) {
    return coordinator_->FindJob(job_id).value();
  }

  // Starts a Sync of `member` for `round` and sends every chunk of
  // `value`-filled parameters. The session stays open in `sessions_`.
  SyncCapture Contribute(const std::string& job_id, const MemberId& member,
                         RoundId round, float value) {
    std::shared_ptr<Job> job = GetJob(job_id);
    SyncCapture capture;
    absl::StatusOr<std::unique_ptr<SyncSession>> s =
        job->BeginSync(member, round, capture.Callback());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return capture;
    const std::vector<float> values(TotalElements(SmallLayout()), value);
    for (uint32_t i = 0; i < job->geometry().num_chunks(); ++i) {
      EXPECT_TRUE((*s)->AddChunk(i, EncodeChunk(values, job->geometry(), i,
                                                DType::kFloat32))
                      .ok());
    }
    sessions_.push_back(*std::move(s));
    return capture;
  }

  absl::StatusCode SyncCode(const std::string& job_id, const MemberId& member,
                            RoundId round) {
    SyncCapture capture;
    return GetJob(job_id)
        ->BeginSync(member, round, capture.Callback())
        .status()
        .code();
  }

  FakeClock clock_;
  RecordingObserver observer_;
  std::unique_ptr<Coordinator> coordinator_;
  std::vector<std::unique_ptr<SyncSession>> sessions_;
};

TEST_F(DrainTest, Drain_NothingOpen_ReturnsTrueAtOnce) {
  const MemberId a = Join("x", "a");
  ASSERT_TRUE(Contribute("x", a, 0, 1.0f).fired());
  EXPECT_TRUE(coordinator_->Drain(absl::InfiniteFuture()));
}

TEST_F(DrainTest, Drain_RefusesJoinsSeedsAndNewRounds_WithUnavailable) {
  const MemberId a = Join("seeded", "a");
  ASSERT_TRUE(Contribute("seeded", a, 0, 1.0f).fired());
  const MemberId b = Join("empty", "b");
  ASSERT_TRUE(coordinator_->Drain(absl::InfinitePast()));

  absl::StatusOr<JoinResult> join = coordinator_->Join("seeded", Params("c"));
  EXPECT_EQ(join.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(join.status().message(), HasSubstr("draining"));
  EXPECT_EQ(coordinator_->Join("new-job", Params("c")).status().code(),
            absl::StatusCode::kUnavailable);
  // A round would open, a seed would start: refused, to be retried.
  SyncCapture capture;
  absl::StatusOr<std::unique_ptr<SyncSession>> next =
      GetJob("seeded")->BeginSync(a, 1, capture.Callback());
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(next.status().message(), HasSubstr("opens no new round"));
  EXPECT_EQ(SyncCode("empty", b, 0), absl::StatusCode::kUnavailable);
  // What needs no new round goes on: heartbeats, fetching, adopting.
  EXPECT_TRUE(GetJob("seeded")->Heartbeat(a).ok());
  EXPECT_TRUE(GetJob("seeded")->GetState(a).ok());
  EXPECT_TRUE(Contribute("seeded", a, 0, 5.0f).fired());
  EXPECT_TRUE(GetJob("seeded")->Leave(a).ok());
}

TEST_F(DrainTest, Drain_OpenRoundStillClosesByContributions) {
  const MemberId a = Join("x", "a");
  const MemberId b = Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 2.0f);
  ASSERT_FALSE(ca.fired());
  // The deadline has passed: Drain begins and reports the open round.
  EXPECT_FALSE(coordinator_->Drain(absl::InfinitePast()));
  // b still joins the open round, and its contribution closes it.
  SyncCapture cb = Contribute("x", b, 1, 4.0f);
  ASSERT_TRUE(ca.fired() && cb.fired());
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_EQ(ca.result()->round, 1u);
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_EQ(ca.result()->state->values[0], 3.0f);
  EXPECT_TRUE(coordinator_->Drain(absl::InfinitePast()));
  // The next round does not open.
  EXPECT_EQ(SyncCode("x", a, 2), absl::StatusCode::kUnavailable);
}

TEST_F(DrainTest, Drain_WaitsUntilTheOpenRoundCloses) {
  const MemberId a = Join("x", "a");
  const MemberId b = Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 2.0f);
  bool drained = false;
  std::thread drainer(
      [&] { drained = coordinator_->Drain(absl::InfiniteFuture()); });
  // Whether or not the drainer waits yet, it returns only once b closes the
  // round.
  SyncCapture cb = Contribute("x", b, 1, 4.0f);
  drainer.join();
  EXPECT_TRUE(drained);
  EXPECT_TRUE(ca.fired() && cb.fired());
}

TEST_F(DrainTest, Drain_RoundClosesWhenTheMissingMemberLosesItsLease) {
  const MemberId a = Join("x", "a");
  const MemberId b = Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 2.0f);
  EXPECT_FALSE(coordinator_->Drain(absl::InfinitePast()));
  const absl::Duration ttl = coordinator_->options().policy.lease_ttl;
  clock_.Advance(ttl / 2);
  ASSERT_TRUE(GetJob("x")->Heartbeat(a).ok());
  clock_.Advance(ttl / 2 + absl::Seconds(1));
  coordinator_->Tick();  // b's lease is gone: the round closes without it
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(ca.result().ok());
  EXPECT_EQ(ca.result()->round, 1u);
  EXPECT_TRUE(coordinator_->Drain(absl::InfinitePast()));
  EXPECT_EQ(SyncCode("x", b, 2), absl::StatusCode::kNotFound);
}

TEST_F(DrainTest, Drain_DeadlinePasses_ReturnsFalse_StopFailsWaiters) {
  const MemberId a = Join("x", "a");
  Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 2.0f);
  // A real (short) wait: nothing will close the round.
  EXPECT_FALSE(coordinator_->Drain(absl::Now() + absl::Milliseconds(20)));
  EXPECT_FALSE(ca.fired());
  coordinator_->Stop();
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ca.result().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(DrainTest, Drain_SeedInProgressMayComplete) {
  const MemberId a = Join("x", "a");
  std::shared_ptr<Job> job = GetJob("x");
  SyncCapture capture;
  std::unique_ptr<SyncSession> s =
      job->BeginSync(a, 0, capture.Callback()).value();
  EXPECT_FALSE(coordinator_->Drain(absl::InfinitePast()));
  const std::vector<float> values(TotalElements(SmallLayout()), 1.0f);
  for (uint32_t i = 0; i < job->geometry().num_chunks(); ++i) {
    ASSERT_TRUE(
        s->AddChunk(i, EncodeChunk(values, job->geometry(), i, DType::kFloat32))
            .ok());
  }
  ASSERT_TRUE(capture.fired());
  EXPECT_TRUE(capture.result().ok());
  EXPECT_TRUE(coordinator_->Drain(absl::InfinitePast()));
}

// A sink that blocks in StateChanged until released, and records the order
// of events.
class BlockingSink : public StateSink {
 public:
  void StateChanged(std::shared_ptr<const Job> job,
                    std::shared_ptr<const StateSnapshot> state) override {
    entered_.Notify();
    release_.WaitForNotification();
    Record(absl::StrCat("sink got round ", state->round));
  }
  void Record(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  absl::Notification entered_;
  absl::Notification release_;

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

TEST(JobStopTest, Stop_ReturnsOnlyAfterTheSinkHasTheLastState) {
  // The seed's state is being handed to the sink (by the thread that
  // completed it) when Stop is called: Stop must wait for it, or a
  // coordinator that stops its checkpointer next would lose that state.
  FakeClock clock;
  BlockingSink sink;
  auto job = std::make_shared<Job>(
      "x", SmallLayout(), TotalElements(SmallLayout()),
      JobSettings{0, 4, DType::kFloat32, AveragingMode::kMean, 0}, JobPolicy(),
      &clock, &sink);
  JoinRequestParams params;
  params.member_name = "a";
  params.layout = SmallLayout();
  params.incarnation = 1;
  const MemberId a = job->Join(params).value().member_id;
  std::thread seeder([&] {
    SyncCapture capture;
    std::unique_ptr<SyncSession> s =
        job->BeginSync(a, 0, capture.Callback()).value();
    const std::vector<float> values(TotalElements(SmallLayout()), 1.0f);
    for (uint32_t i = 0; i < job->geometry().num_chunks(); ++i) {
      ASSERT_TRUE(s->AddChunk(i, EncodeChunk(values, job->geometry(), i,
                                             DType::kFloat32))
                      .ok());
    }
  });
  sink.entered_.WaitForNotification();
  std::thread stopper([&] {
    job->Stop();
    sink.Record("stop returned");
  });
  sink.release_.Notify();
  stopper.join();
  seeder.join();
  EXPECT_THAT(sink.events(),
              ::testing::ElementsAre("sink got round 0", "stop returned"));
}

// --- Observer ------------------------------------------------------------

TEST_F(DrainTest, Observer_SeedAndCompleteRound_ReportedWithDuration) {
  const MemberId a = Join("x", "a");
  const MemberId b = Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 1.0f);
  clock_.Advance(absl::Milliseconds(250));
  ASSERT_TRUE(Contribute("x", b, 1, 3.0f).fired());
  const std::vector<RoundClosedEvent> rounds = observer_.rounds();
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[0].job_id, "x");
  EXPECT_EQ(rounds[0].round, 0u);
  EXPECT_EQ(rounds[0].reason, CloseReason::kSeed);
  EXPECT_EQ(rounds[1].round, 1u);
  EXPECT_EQ(rounds[1].reason, CloseReason::kComplete);
  EXPECT_EQ(rounds[1].duration, absl::Milliseconds(250));
  EXPECT_EQ(rounds[1].participants, 2u);
  EXPECT_EQ(rounds[1].contributors, 2u);
  EXPECT_EQ(rounds[1].dropped, 0u);
  EXPECT_TRUE(observer_.expired().empty());
  EXPECT_TRUE(observer_.late().empty());
}

TEST_F(DrainTest, Observer_LeaseExpiryDropsParticipant_ReportsBoth) {
  const MemberId a = Join("x", "a");
  Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 1.0f);
  const absl::Duration ttl = coordinator_->options().policy.lease_ttl;
  clock_.Advance(ttl / 2);
  ASSERT_TRUE(GetJob("x")->Heartbeat(a).ok());
  clock_.Advance(ttl / 2 + absl::Seconds(1));
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());
  EXPECT_THAT(observer_.expired(), ::testing::ElementsAre("x/b"));
  const std::vector<RoundClosedEvent> rounds = observer_.rounds();
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[1].reason, CloseReason::kMembersGone);
  EXPECT_EQ(rounds[1].contributors, 1u);
  EXPECT_EQ(rounds[1].dropped, 1u);
}

TEST_F(DrainTest, Observer_LeaveIsNotALeaseExpiry) {
  const MemberId a = Join("x", "a");
  ASSERT_TRUE(GetJob("x")->Leave(a).ok());
  coordinator_->Tick();
  EXPECT_TRUE(observer_.expired().empty());
}

TEST_F(DrainTest, Observer_StragglerAfterDeadline_IsLate) {
  CoordinatorOptions options;
  options.policy.round_deadline = absl::Seconds(5);
  options.policy.min_quorum = 1;
  Init(options);
  const MemberId a = Join("x", "a");
  const MemberId b = Join("x", "b");
  ASSERT_TRUE(Contribute("x", a, 0, 0.0f).fired());
  SyncCapture ca = Contribute("x", a, 1, 1.0f);
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(GetJob("x")->Heartbeat(b).ok());
  coordinator_->Tick();  // deadline with quorum: closes without b
  ASSERT_TRUE(ca.fired());
  SyncCapture cb = Contribute("x", b, 1, 3.0f);  // too late
  ASSERT_TRUE(cb.fired());
  ASSERT_TRUE(cb.result().ok());
  EXPECT_TRUE(cb.result()->late);
  EXPECT_THAT(observer_.late(), ::testing::ElementsAre("x/1"));
  const std::vector<RoundClosedEvent> rounds = observer_.rounds();
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[1].reason, CloseReason::kDeadline);
  EXPECT_EQ(rounds[1].dropped, 0u);    // b kept its lease:
  EXPECT_EQ(rounds[1].timed_out, 1u);  // it missed the deadline
  EXPECT_EQ(rounds[1].duration, absl::Seconds(6));
}

}  // namespace
}  // namespace localsgd
