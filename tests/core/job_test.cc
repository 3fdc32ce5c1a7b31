// Tests of the round / lease / seed state machine of a job, driven through
// Coordinator::Join and Job::BeginSync with a fake clock. No sleeps.
#include "src/job.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/clock.h"
#include "src/codec.h"
#include "src/coordinator.h"
#include "src/layout.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing_util::EncodeChunk;
using testing_util::MakeFloatLayout;
using testing_util::SmallLayout;
using testing_util::SyncCapture;
using testing_util::TotalElements;

constexpr char kJob[] = "job-1";

std::vector<float> ValuesOf(const absl::StatusOr<SyncResult>& r) {
  if (!r.ok() || r->state == nullptr) return {};
  return r->state->values;
}

bool IsBFloat16Representable(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (bits & 0xffffu) == 0;
}

// A coordinator on a fake clock and helpers to drive one job of it.
class JobTest : public ::testing::Test {
 protected:
  struct Config {
    JobPolicy policy;
    DType wire = DType::kFloat32;
    uint32_t chunk = 4;
    Layout layout = SmallLayout();  // 23 elements: 6 chunks of 4, the last 3
    NonFinitePolicy nonfinite = NonFinitePolicy::kUnspecified;
  };

  void SetUp() override { Init(Config()); }

  void Init(const Config& config) {
    CoordinatorOptions options;
    options.clock = &clock_;
    options.policy = config.policy;
    absl::StatusOr<std::unique_ptr<Coordinator>> c =
        Coordinator::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
    policy_ = config.policy;
    wire_ = config.wire;
    chunk_ = config.chunk;
    layout_ = config.layout;
    nonfinite_ = config.nonfinite;
    n_ = TotalElements(layout_);
    geometry_ = ChunkGeometry(n_, chunk_);
  }

  JoinRequestParams Params(const std::string& name, double weight = 1,
                           uint64_t incarnation = 1) {
    JoinRequestParams p;
    p.member_name = name;
    p.layout = layout_;
    p.weight = weight;
    p.incarnation = incarnation;
    p.settings.chunk_elements = chunk_;
    p.settings.wire_dtype = wire_;
    p.settings.nonfinite_policy = nonfinite_;
    return p;
  }
  absl::StatusOr<JoinResult> TryJoin(const std::string& name, double weight = 1,
                                     uint64_t incarnation = 1) {
    return coordinator_->Join(kJob, Params(name, weight, incarnation));
  }
  MemberId Join(const std::string& name, double weight = 1,
                uint64_t incarnation = 1) {
    absl::StatusOr<JoinResult> r = TryJoin(name, weight, incarnation);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->member_id : MemberId();
  }

  std::shared_ptr<Job> job() { return coordinator_->FindJob(kJob).value(); }

  // Starts a Sync; throws (failing the test with the status) if refused.
  std::unique_ptr<SyncSession> Begin(const MemberId& m, RoundId round,
                                     SyncCapture& capture) {
    return job()->BeginSync(m, round, capture.Callback()).value();
  }
  absl::Status BeginStatus(const MemberId& m, RoundId round) {
    SyncCapture capture;
    return job()->BeginSync(m, round, capture.Callback()).status();
  }

  std::string Chunk(const std::vector<float>& values, uint32_t index) {
    return EncodeChunk(values, geometry_, index, wire_);
  }
  void Send(SyncSession& s, const std::vector<float>& values) {
    for (uint32_t i = 0; i < geometry_.num_chunks(); ++i) {
      const absl::Status st = s.AddChunk(i, Chunk(values, i));
      EXPECT_TRUE(st.ok()) << "chunk " << i << ": " << st;
    }
  }
  void SendChunks(SyncSession& s, const std::vector<float>& values,
                  const std::vector<uint32_t>& chunks) {
    for (uint32_t i : chunks) {
      const absl::Status st = s.AddChunk(i, Chunk(values, i));
      EXPECT_TRUE(st.ok()) << "chunk " << i << ": " << st;
    }
  }
  std::vector<uint32_t> AllChunksBut(uint32_t skip) {
    std::vector<uint32_t> v;
    for (uint32_t i = 0; i < geometry_.num_chunks(); ++i) {
      if (i != skip) v.push_back(i);
    }
    return v;
  }

  // Seeds the job with `values` through `m`.
  void Seed(const MemberId& m, const std::vector<float>& values) {
    SyncCapture capture;
    std::unique_ptr<SyncSession> s = Begin(m, 0, capture);
    Send(*s, values);
    ASSERT_TRUE(capture.fired());
    ASSERT_TRUE(capture.result().ok()) << capture.result().status();
  }

  // Begins a Sync of `m` for `round` and sends all of `values`.
  std::unique_ptr<SyncSession> Contribute(const MemberId& m, RoundId round,
                                          const std::vector<float>& values,
                                          SyncCapture& capture) {
    std::unique_ptr<SyncSession> s = Begin(m, round, capture);
    Send(*s, values);
    return s;
  }

  std::vector<float> StateValues(const MemberId& m) {
    absl::StatusOr<std::shared_ptr<const StateSnapshot>> s = job()->GetState(m);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? (*s)->values : std::vector<float>();
  }

  // values[j] = slope * j + offset; small integers and halves, so every mean
  // of up to 4 of them with unit weights is exact in fp32.
  std::vector<float> Ramp(float offset, float slope = 3) const {
    std::vector<float> v(n_);
    for (size_t j = 0; j < n_; ++j)
      v[j] = slope * static_cast<float>(j) + offset;
    return v;
  }
  // Per element, f(chunk index, element index).
  std::vector<float> PerChunk(
      const std::function<float(uint32_t, size_t)>& f) const {
    std::vector<float> v(n_);
    for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
      for (uint64_t j = geometry_.Offset(c);
           j < geometry_.Offset(c) + geometry_.Size(c); ++j) {
        v[j] = f(c, j);
      }
    }
    return v;
  }

  // The record of closed round `round`, if the job still keeps it.
  std::optional<RoundRecord> Record(RoundId round) {
    for (const RoundRecord& r : job()->Status(1000).recent_rounds) {
      if (r.round == round) return r;
    }
    return std::nullopt;
  }

  FakeClock clock_;
  std::unique_ptr<Coordinator> coordinator_;
  JobPolicy policy_;
  DType wire_ = DType::kFloat32;
  NonFinitePolicy nonfinite_ = NonFinitePolicy::kUnspecified;
  uint32_t chunk_ = 4;
  Layout layout_;
  uint64_t n_ = 0;
  ChunkGeometry geometry_;
};

// ===========================================================================
// Seeding (round 0)

TEST_F(JobTest, Join_FirstMember_HasNoState) {
  absl::StatusOr<JoinResult> r = TryJoin("a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_state);
  EXPECT_EQ(r->state_round, 0u);
  EXPECT_TRUE(MemberId::IsWellFormed(r->member_id.str())) << r->member_id.str();
  EXPECT_EQ(r->geometry.num_elements(), 23u);
  EXPECT_EQ(r->geometry.num_chunks(), 6u);
  EXPECT_EQ(r->settings.chunk_elements, 4u);
  EXPECT_EQ(job()->GetState(r->member_id).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(JobTest, Seed_RoundZeroByFirstMember_BecomesStateExactly) {
  const MemberId a = Join("a");
  const std::vector<float> seed = Ramp(0.1f, 1.37f);
  SyncCapture capture;
  std::unique_ptr<SyncSession> s = Begin(a, 0, capture);
  SendChunks(*s, seed, {5, 0, 3, 1, 4});
  EXPECT_FALSE(capture.fired()) << "seed resolved before its last chunk";
  SendChunks(*s, seed, {2});
  ASSERT_EQ(capture.calls(), 1);
  ASSERT_TRUE(capture.result().ok()) << capture.result().status();
  EXPECT_EQ(capture.result()->round, 0u);
  EXPECT_TRUE(capture.result()->contributed);
  EXPECT_FALSE(capture.result()->late);
  EXPECT_EQ(ValuesOf(capture.result()), seed);
  EXPECT_EQ(StateValues(a), seed);

  absl::StatusOr<JoinResult> b = TryJoin("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->has_state);
  EXPECT_EQ(b->state_round, 0u);
  EXPECT_EQ(StateValues(b->member_id), seed);

  const JobStatusSnapshot status = job()->Status(10);
  ASSERT_EQ(status.recent_rounds.size(), 1u);
  EXPECT_EQ(status.recent_rounds[0].round, 0u);
  EXPECT_EQ(status.recent_rounds[0].reason, CloseReason::kSeed);
  EXPECT_THAT(status.recent_rounds[0].contributors, ElementsAre("a"));
}

TEST_F(JobTest, Seed_ConcurrentRoundZero_SecondMemberAdoptsFirstSeed) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa = Begin(a, 0, ca);
  SendChunks(*sa, Ramp(1), {0, 1});
  std::unique_ptr<SyncSession> sb = Begin(b, 0, cb);
  // b's own parameters go nowhere: a owns the seed.
  Send(*sb, Ramp(1000));
  EXPECT_FALSE(cb.fired()) << "adopter resolved before the seed was complete";
  SendChunks(*sa, Ramp(1), {2, 3, 4, 5});
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(cb.fired());
  ASSERT_TRUE(cb.result().ok()) << cb.result().status();
  EXPECT_TRUE(ca.result()->contributed);
  EXPECT_FALSE(cb.result()->contributed);
  EXPECT_EQ(cb.result()->round, 0u);
  EXPECT_EQ(ValuesOf(cb.result()), Ramp(1));
  EXPECT_EQ(StateValues(b), Ramp(1));
}

TEST_F(JobTest, Seed_OwnerSessionDestroyedEarly_WaitersGetAborted) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa = Begin(a, 0, ca);
  SendChunks(*sa, Ramp(1), {0, 1, 2});
  std::unique_ptr<SyncSession> sb = Begin(b, 0, cb);
  sa.reset();  // a's stream ends half way
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(cb.result().status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(ca.fired()) << "a withdrew its own callback";
  EXPECT_EQ(job()->GetState(b).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // The job is not stuck: b seeds it now.
  sb.reset();
  Seed(b, Ramp(7));
  EXPECT_EQ(StateValues(a), Ramp(7));
}

TEST_F(JobTest, Seed_OwnerCancelled_WaitersGetAborted) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa = Begin(a, 0, ca);
  std::unique_ptr<SyncSession> sb = Begin(b, 0, cb);
  SendChunks(*sa, Ramp(1), {0});
  EXPECT_TRUE(sa->Cancel());
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(cb.result().status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(ca.fired());
  // Still a member; may seed again.
  Seed(a, Ramp(2));
  EXPECT_EQ(StateValues(b), Ramp(2));
}

TEST_F(JobTest, Seed_OwnerLeaves_OwnerAndWaitersGetAborted) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa = Begin(a, 0, ca);
  std::unique_ptr<SyncSession> sb = Begin(b, 0, cb);
  SendChunks(*sa, Ramp(1), {0, 1});
  ASSERT_TRUE(job()->Leave(a).ok());
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(cb.result().status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ca.result().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(sa->AddChunk(2, Chunk(Ramp(1), 2)).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(JobTest, Seed_OwnerLeaseExpires_WaitersGetAborted) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa = Begin(a, 0, ca);
  std::unique_ptr<SyncSession> sb = Begin(b, 0, cb);
  SendChunks(*sa, Ramp(1), {0, 1});
  clock_.Advance(policy_.lease_ttl / 2);
  ASSERT_TRUE(job()->Heartbeat(b).ok());
  clock_.Advance(policy_.lease_ttl / 2 + absl::Seconds(1));
  coordinator_->Tick();
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(cb.result().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(job()->Heartbeat(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(job()->Heartbeat(b).ok());
}

TEST_F(JobTest, Seed_DuplicateChunkWithOtherValues_FirstCopyWins) {
  const MemberId a = Join("a");
  SyncCapture capture;
  std::unique_ptr<SyncSession> s = Begin(a, 0, capture);
  SendChunks(*s, Ramp(1), {0, 1, 2});
  SendChunks(*s, Ramp(500), {1});
  EXPECT_EQ(s->received(), 3u);
  SendChunks(*s, Ramp(1), {3, 4, 5});
  ASSERT_TRUE(capture.fired());
  EXPECT_EQ(ValuesOf(capture.result()), Ramp(1));
}

TEST_F(JobTest, Seed_RetriedStreamOfOwner_CompletesSeed) {
  const MemberId a = Join("a");
  SyncCapture c1, c2;
  std::unique_ptr<SyncSession> s1 = Begin(a, 0, c1);
  SendChunks(*s1, Ramp(1), {0, 1, 2});
  std::unique_ptr<SyncSession> s2 = Begin(a, 0, c2);
  SendChunks(*s2, Ramp(1), {3, 4, 5});
  ASSERT_TRUE(c1.fired());
  ASSERT_TRUE(c2.fired());
  EXPECT_TRUE(c2.result()->contributed);
  EXPECT_EQ(StateValues(a), Ramp(1));
}

TEST_F(JobTest, Seed_RoundZeroAfterStateExists_AdoptsAtOnce) {
  const MemberId a = Join("a");
  Seed(a, Ramp(4));
  const MemberId c = Join("c");
  SyncCapture capture;
  std::unique_ptr<SyncSession> s = Begin(c, 0, capture);
  ASSERT_TRUE(capture.fired()) << "adopting an existing seed must not wait";
  ASSERT_TRUE(capture.result().ok());
  EXPECT_EQ(capture.result()->round, 0u);
  EXPECT_FALSE(capture.result()->contributed);
  EXPECT_FALSE(capture.result()->late);
  EXPECT_EQ(ValuesOf(capture.result()), Ramp(4));
  // Its chunks change nothing.
  Send(*s, Ramp(99));
  EXPECT_EQ(StateValues(c), Ramp(4));
}

TEST_F(JobTest, Sync_RoundOneBeforeSeed_ReturnsFailedPrecondition) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  EXPECT_EQ(BeginStatus(a, 1).code(), absl::StatusCode::kFailedPrecondition);
  // Also while a seed is in progress.
  SyncCapture capture;
  std::unique_ptr<SyncSession> s = Begin(a, 0, capture);
  SendChunks(*s, Ramp(1), {0});
  EXPECT_EQ(BeginStatus(b, 1).code(), absl::StatusCode::kFailedPrecondition);
}

// A re-seed (seed_round > 0: a member re-seeding a job its coordinator
// lost) makes the state that round, so numbering goes on from there; those
// who adopt it get that round, not late. The next round regathers for one
// lease: the re-seeder alone does not close it, a member that joins meanwhile
// takes part, and it closes at the lease's end with both.
TEST_F(JobTest, Reseed_SeedRound_ContinuesNumberingAndRegathersForALease) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  std::unique_ptr<SyncSession> sa =
      job()->BeginSync(a, 0, ca.Callback(), SeedOrigin{5, 0}).value();
  std::unique_ptr<SyncSession> sb =
      job()->BeginSync(b, 0, cb.Callback(), SeedOrigin{5, 0}).value();
  Send(*sa, Ramp(1));
  ASSERT_TRUE(ca.fired() && cb.fired());
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  ASSERT_TRUE(cb.result().ok()) << cb.result().status();
  EXPECT_EQ(ca.result()->round, 5u);
  EXPECT_EQ(cb.result()->round, 5u);
  EXPECT_FALSE(cb.result()->contributed);
  EXPECT_FALSE(cb.result()->late) << "adopting a seed is never late";
  ASSERT_EQ(Record(5).value().reason, CloseReason::kSeed);
  const JoinResult late = TryJoin("late").value();
  EXPECT_EQ(late.state_round, 5u);
  ASSERT_TRUE(job()->Leave(late.member_id).ok());

  SyncCapture ra, rb, rc;
  std::unique_ptr<SyncSession> a6 = Contribute(a, 6, Ramp(2), ra);
  std::unique_ptr<SyncSession> b6 = Contribute(b, 6, Ramp(4), rb);
  coordinator_->Tick();
  EXPECT_FALSE(ra.fired()) << "round 6 closed before the regather ended";
  const MemberId c = Join("c");  // joins the open round
  std::unique_ptr<SyncSession> c6 = Contribute(c, 6, Ramp(6), rc);
  coordinator_->Tick();
  EXPECT_FALSE(ra.fired());
  clock_.Advance(policy_.lease_ttl);  // exactly: no lease runs out
  coordinator_->Tick();
  ASSERT_TRUE(ra.fired() && rb.fired() && rc.fired());
  ASSERT_TRUE(rc.result().ok()) << rc.result().status();
  EXPECT_EQ(rc.result()->round, 6u);
  EXPECT_TRUE(rc.result()->contributed);
  EXPECT_EQ(rc.result()->contributors, 3u);
  EXPECT_EQ(ValuesOf(rc.result()), Ramp(4));
}

// A re-seed that says how many contributed to its round (3) regathers
// until that many are back, not for the whole lease; and only for its first
// round.
TEST_F(JobTest, Reseed_WithContributors_RegatherEndsWhenTheyAreBack) {
  const MemberId a = Join("a");
  SyncCapture seed;
  std::unique_ptr<SyncSession> s =
      job()->BeginSync(a, 0, seed.Callback(), SeedOrigin{5, 3}).value();
  Send(*s, Ramp(1));
  ASSERT_TRUE(seed.fired());
  SyncCapture ra, rb, rc;
  std::unique_ptr<SyncSession> a6 = Contribute(a, 6, Ramp(2), ra);
  const MemberId b = Join("b");
  std::unique_ptr<SyncSession> b6 = Contribute(b, 6, Ramp(4), rb);
  coordinator_->Tick();
  EXPECT_FALSE(ra.fired()) << "closed with 2 of the 3 contributors back";
  EXPECT_NE(job()->Status(1).open_round_decision.why_open.find(
                "until 3 are back (2 so far)"),
            std::string::npos)
      << job()->Status(1).open_round_decision.why_open;
  const MemberId c = Join("c");
  std::unique_ptr<SyncSession> c6 = Contribute(c, 6, Ramp(6), rc);
  ASSERT_TRUE(ra.fired() && rb.fired() && rc.fired())
      << "the regather did not end with all 3 back";
  EXPECT_EQ(rc.result()->contributors, 3u);
  EXPECT_EQ(ValuesOf(rc.result()), Ramp(4));
  // Round 7, still within the lease: no regather; b and c leave, and it
  // closes without them.
  SyncCapture r7;
  std::unique_ptr<SyncSession> a7 = Contribute(a, 7, Ramp(2), r7);
  ASSERT_TRUE(job()->Leave(b).ok());
  ASSERT_TRUE(job()->Leave(c).ok());
  ASSERT_TRUE(r7.fired()) << "round 7 regathered";
  EXPECT_EQ(r7.result()->round, 7u);
}

// The coordinator lost round 6 after b got its result and before a did: a,
// back first, re-seeds at round 5; b, holding round 6's state, re-seeds at
// 6 before any round closed on a's: b's state supersedes a's, the round
// open on a's fails with ABORTED, and a, retrying, adopts round 6.
TEST_F(JobTest, Reseed_NewerReseedBeforeARoundClosed_SupersedesIt) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture seed_a, ra;
  std::unique_ptr<SyncSession> sa =
      job()->BeginSync(a, 0, seed_a.Callback(), SeedOrigin{5, 2}).value();
  Send(*sa, Ramp(1));
  ASSERT_TRUE(seed_a.fired());
  std::unique_ptr<SyncSession> a6 = Contribute(a, 6, Ramp(2), ra);
  EXPECT_FALSE(ra.fired()) << "round 6 closed before the regather ended";
  SyncCapture seed_b;
  std::unique_ptr<SyncSession> sb =
      job()->BeginSync(b, 0, seed_b.Callback(), SeedOrigin{6, 2}).value();
  ASSERT_TRUE(ra.fired());
  EXPECT_EQ(ra.result().status().code(), absl::StatusCode::kAborted)
      << ra.result().status();
  Send(*sb, Ramp(3));
  ASSERT_TRUE(seed_b.fired());
  ASSERT_TRUE(seed_b.result().ok()) << seed_b.result().status();
  EXPECT_EQ(seed_b.result()->round, 6u);
  EXPECT_EQ(StateValues(b), Ramp(3));
  SyncCapture retry;
  std::unique_ptr<SyncSession> a6b = Contribute(a, 6, Ramp(2), retry);
  ASSERT_TRUE(retry.fired());
  ASSERT_TRUE(retry.result().ok()) << retry.result().status();
  EXPECT_EQ(retry.result()->round, 6u);
  EXPECT_TRUE(retry.result()->late);
  EXPECT_EQ(ValuesOf(retry.result()), Ramp(3));
}

// Once a round has closed on a re-seeded state, a newer re-seed no longer
// replaces it (members have trained from it): the re-seeder adopts.
TEST_F(JobTest, Reseed_NewerReseedAfterARoundClosed_Adopts) {
  const MemberId a = Join("a");
  SyncCapture seed_a, ra;
  std::unique_ptr<SyncSession> sa =
      job()->BeginSync(a, 0, seed_a.Callback(), SeedOrigin{5, 1}).value();
  Send(*sa, Ramp(1));
  std::unique_ptr<SyncSession> a6 = Contribute(a, 6, Ramp(2), ra);
  ASSERT_TRUE(ra.fired()) << "the regather waits for 1, back already";
  const MemberId b = Join("b");
  SyncCapture seed_b;
  std::unique_ptr<SyncSession> sb =
      job()->BeginSync(b, 0, seed_b.Callback(), SeedOrigin{7, 2}).value();
  ASSERT_TRUE(seed_b.fired()) << "a seed of a job with state adopts at once";
  ASSERT_TRUE(seed_b.result().ok()) << seed_b.result().status();
  EXPECT_EQ(seed_b.result()->round, 6u);
  EXPECT_FALSE(seed_b.result()->contributed);
  EXPECT_EQ(StateValues(a), Ramp(2));
}

// Fewer come back than the re-seed waits for: the round closes at the end
// of the lease with those that did.
TEST_F(JobTest, Reseed_WithContributors_FewerBack_ClosesAtTheLeaseEnd) {
  const MemberId a = Join("a");
  SyncCapture seed, ra;
  std::unique_ptr<SyncSession> s =
      job()->BeginSync(a, 0, seed.Callback(), SeedOrigin{2, 4}).value();
  Send(*s, Ramp(1));
  std::unique_ptr<SyncSession> a3 = Contribute(a, 3, Ramp(2), ra);
  coordinator_->Tick();
  EXPECT_FALSE(ra.fired());
  clock_.Advance(policy_.lease_ttl);
  coordinator_->Tick();
  ASSERT_TRUE(ra.fired());
  EXPECT_EQ(ra.result()->round, 3u);
  EXPECT_EQ(ra.result()->contributors, 1u);
}

// A plain seed (seed_round 0) does not regather: the next round closes as
// soon as its participants are in.
TEST_F(JobTest, Seed_RoundZero_NextRoundDoesNotRegather) {
  const MemberId a = Join("a");
  Seed(a, Ramp(1));
  SyncCapture ra;
  std::unique_ptr<SyncSession> s = Contribute(a, 1, Ramp(2), ra);
  ASSERT_TRUE(ra.fired());
  EXPECT_EQ(ra.result()->round, 1u);
}

TEST_F(JobTest, Reseed_MalformedOrigin_InvalidArgumentAndNothingChanges) {
  const MemberId a = Join("a");
  Seed(a, Ramp(1));
  SyncCapture c1, c2;
  SyncCapture c3;
  absl::Status s =
      job()->BeginSync(a, 1, c1.Callback(), SeedOrigin{3, 0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("only with round 0"), std::string::npos) << s;
  s = job()
          ->BeginSync(a, 0, c2.Callback(), SeedOrigin{kMaxSeedRound + 1, 0})
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("at most"), std::string::npos) << s;
  s = job()->BeginSync(a, 0, c3.Callback(), SeedOrigin{0, 2}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("without a seed_round"), std::string::npos) << s;
  EXPECT_FALSE(c1.fired() || c2.fired() || c3.fired());
  // Nothing changed: the state is the seed's, round 0.
  EXPECT_EQ(job()->Status(1).state_round, 0u);
  EXPECT_EQ(StateValues(a), Ramp(1));
}

TEST_F(JobTest, Seed_BFloat16Wire_StoresDecodedValues) {
  Config config;
  config.wire = DType::kBFloat16;
  Init(config);
  const MemberId a = Join("a");
  std::vector<float> seed(n_);
  for (size_t j = 0; j < n_; ++j) seed[j] = std::sin(0.7f * j) * 3.3f;
  Seed(a, seed);
  std::vector<float> expected = seed;
  RoundTripInPlace(absl::MakeSpan(expected), DType::kBFloat16);
  EXPECT_EQ(StateValues(a), expected);
}

// ===========================================================================
// Weighted mean against an independent computation, over member counts and
// layouts whose sizes do not divide the chunk size.

struct LayoutCase {
  std::string name;
  Layout layout;
  uint32_t chunk;
};

std::vector<LayoutCase> LayoutCases() {
  return {
      {"Small23Chunk4", SmallLayout(), 4},
      {"Small23Chunk1", SmallLayout(), 1},
      {"Odd1036Chunk100", MakeFloatLayout({{"w", {33, 31}}, {"b", {13}}}), 100},
      {"Odd1036Chunk1500", MakeFloatLayout({{"w", {33, 31}}, {"b", {13}}}),
       1500},
      {"Odd2053Chunk1024",
       MakeFloatLayout({{"emb", {29, 67}}, {"ln", {109}}, {"s", {}}}), 1024},
  };
}

class WeightedMeanTest
    : public JobTest,
      public ::testing::WithParamInterface<std::tuple<int, LayoutCase>> {
 protected:
  void SetUp() override {
    Config config;
    config.layout = std::get<1>(GetParam()).layout;
    config.chunk = std::get<1>(GetParam()).chunk;
    Init(config);
  }
  int N() const { return std::get<0>(GetParam()); }

  // Runs round 1 with N members sending values(i) with weights(i), chunks
  // interleaved across members and in a different order per member; checks
  // that no callback runs before the very last chunk. Returns the results.
  std::vector<absl::StatusOr<SyncResult>> RunRound(
      const std::function<double(int)>& weight,
      const std::function<std::vector<float>(int)>& values) {
    std::vector<MemberId> ids;
    for (int i = 0; i < N(); ++i)
      ids.push_back(Join("m" + std::to_string(i), weight(i)));
    std::vector<float> seed(n_);
    for (size_t j = 0; j < n_; ++j) seed[j] = -static_cast<float>(j);
    Seed(ids[0], seed);

    std::vector<SyncCapture> captures(N());
    std::vector<std::unique_ptr<SyncSession>> sessions;
    std::vector<std::vector<float>> x;
    for (int i = 0; i < N(); ++i) {
      sessions.push_back(Begin(ids[i], 1, captures[i]));
      x.push_back(values(i));
    }
    const uint32_t nc = geometry_.num_chunks();
    for (uint32_t step = 0; step < nc; ++step) {
      for (int i = 0; i < N(); ++i) {
        const bool last = step == nc - 1 && i == N() - 1;
        if (last) {
          for (int k = 0; k < N(); ++k) {
            EXPECT_FALSE(captures[k].fired())
                << "member " << k << " resolved before the last chunk";
          }
        }
        const uint32_t c = (step + static_cast<uint32_t>(i) * 5) % nc;
        const absl::Status s = sessions[i]->AddChunk(c, Chunk(x[i], c));
        EXPECT_TRUE(s.ok()) << s;
      }
    }
    std::vector<absl::StatusOr<SyncResult>> results;
    for (int i = 0; i < N(); ++i) {
      EXPECT_EQ(captures[i].calls(), 1) << "member " << i;
      results.push_back(captures[i].result());
    }
    return results;
  }
};

TEST_P(WeightedMeanTest, Sync_WeightedMean_MatchesIndependentComputation) {
  auto weight = [](int i) { return 0.5 + 0.75 * i; };
  auto f = [](int i, size_t j) {
    return static_cast<float>(std::sin(0.37 * i + 0.011 * j) * (1 + i) +
                              0.001 * j);
  };
  auto values = [&](int i) {
    std::vector<float> v(n_);
    for (size_t j = 0; j < n_; ++j) v[j] = f(i, j);
    return v;
  };
  const std::vector<absl::StatusOr<SyncResult>> results =
      RunRound(weight, values);

  double total_weight = 0;
  for (int i = 0; i < N(); ++i) total_weight += weight(i);
  std::vector<double> expected(n_), bound(n_);
  for (size_t j = 0; j < n_; ++j) {
    double sum = 0, magnitude = 0;
    for (int i = 0; i < N(); ++i) {
      sum += weight(i) * static_cast<double>(f(i, j));
      magnitude += weight(i) * std::fabs(static_cast<double>(f(i, j)));
    }
    expected[j] = sum / total_weight;
    // fp32 accumulation of N weighted terms plus the division.
    bound[j] =
        2.0 * (N() + 2) * std::ldexp(magnitude / total_weight, -24) + 1e-30;
  }
  for (int i = 0; i < N(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->round, 1u);
    EXPECT_TRUE(results[i]->contributed);
    EXPECT_FALSE(results[i]->late);
    EXPECT_EQ(results[i]->contributors, static_cast<uint32_t>(N()));
    EXPECT_DOUBLE_EQ(results[i]->contributor_weight, total_weight);
    EXPECT_EQ(results[i]->state, results[0]->state) << "one shared snapshot";
  }
  const std::vector<float> got = ValuesOf(results[0]);
  ASSERT_EQ(got.size(), n_);
  for (size_t j = 0; j < n_; ++j) {
    ASSERT_NEAR(got[j], expected[j], bound[j]) << "element " << j;
  }
}

TEST_P(WeightedMeanTest, Sync_UnitWeights_MeanIsClosedForm) {
  // Member i sends i + (j % 5): the mean is (N - 1) / 2 + (j % 5), exact.
  auto values = [&](int i) {
    std::vector<float> v(n_);
    for (size_t j = 0; j < n_; ++j) v[j] = static_cast<float>(i + j % 5);
    return v;
  };
  const std::vector<absl::StatusOr<SyncResult>> results =
      RunRound([](int) { return 1.0; }, values);
  std::vector<float> expected(n_);
  for (size_t j = 0; j < n_; ++j) {
    expected[j] = static_cast<float>(N() - 1) / 2 + static_cast<float>(j % 5);
  }
  for (int i = 0; i < N(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(ValuesOf(results[i]), expected) << "member " << i;
  }
  const absl::StatusOr<JoinResult> late = TryJoin("late");
  ASSERT_TRUE(late.ok());
  EXPECT_TRUE(late->has_state);
  EXPECT_EQ(late->state_round, 1u);
  EXPECT_EQ(StateValues(late->member_id), expected);
}

INSTANTIATE_TEST_SUITE_P(
    MembersAndLayouts, WeightedMeanTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 7),
                       ::testing::ValuesIn(LayoutCases())),
    [](const ::testing::TestParamInfo<WeightedMeanTest::ParamType>& info) {
      return "N" + std::to_string(std::get<0>(info.param)) + "_" +
             std::get<1>(info.param).name;
    });

// ===========================================================================
// Rounds of three members a, b, c (unit weights), seeded by a.

class RoundTest : public JobTest {
 protected:
  virtual JobPolicy Policy() { return JobPolicy(); }

  void SetUp() override {
    Config config;
    config.policy = Policy();
    Init(config);
    a_ = Join("a");
    b_ = Join("b");
    c_ = Join("c");
    seed_ = Ramp(100, 1);
    Seed(a_, seed_);
    va_ = Ramp(0);
    vb_ = Ramp(3);
    vc_ = Ramp(6);
  }

  MemberId a_, b_, c_;
  std::vector<float> seed_, va_, vb_, vc_;
};

// --- Closure
// ---------------------------------------------------------------------

TEST_F(RoundTest, Sync_AllParticipantsComplete_ClosesOnlyAfterLastChunk) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  EXPECT_FALSE(ca.fired());
  EXPECT_FALSE(cb.fired());
  auto sc = Begin(c_, 1, cc);
  SendChunks(*sc, vc_, AllChunksBut(2));
  EXPECT_FALSE(ca.fired()) << "closed with a chunk of c missing";
  EXPECT_FALSE(cc.fired());
  SendChunks(*sc, vc_, {2});
  for (SyncCapture* cap : {&ca, &cb, &cc}) {
    ASSERT_EQ(cap->calls(), 1);
    ASSERT_TRUE(cap->result().ok()) << cap->result().status();
    EXPECT_EQ(cap->result()->round, 1u);
    EXPECT_TRUE(cap->result()->contributed);
    EXPECT_FALSE(cap->result()->late);
    EXPECT_EQ(cap->result()->contributors, 3u);
    EXPECT_EQ(ValuesOf(cap->result()), Ramp(3));
  }
  EXPECT_EQ(StateValues(b_), Ramp(3));
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->reason, CloseReason::kComplete);
}

TEST_F(RoundTest, Sync_MissingParticipantWithoutDeadline_RoundStaysOpen) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  // c keeps its lease but never syncs: without a deadline the round waits.
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(policy_.lease_ttl / 2);
    ASSERT_TRUE(job()->Heartbeat(a_).ok());
    ASSERT_TRUE(job()->Heartbeat(b_).ok());
    ASSERT_TRUE(job()->Heartbeat(c_).ok());
    coordinator_->Tick();
  }
  EXPECT_FALSE(ca.fired());
  EXPECT_FALSE(cb.fired());
  EXPECT_TRUE(job()->Status(10).round_open);
  SyncCapture cc;
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(RoundTest, Leave_ParticipantWithoutContribution_ClosesRoundWithOthers) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  EXPECT_FALSE(ca.fired());
  ASSERT_TRUE(job()->Leave(c_).ok());
  for (SyncCapture* cap : {&ca, &cb}) {
    ASSERT_TRUE(cap->fired());
    ASSERT_TRUE(cap->result().ok()) << cap->result().status();
    EXPECT_TRUE(cap->result()->contributed);
    EXPECT_EQ(cap->result()->contributors, 2u);
    EXPECT_DOUBLE_EQ(cap->result()->contributor_weight, 2.0);
    EXPECT_EQ(ValuesOf(cap->result()), Ramp(1.5f));  // mean of a and b
  }
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->reason, CloseReason::kMembersGone);
  EXPECT_THAT(r1->participants, ElementsAre("a", "b", "c"));
  EXPECT_THAT(r1->contributors, ElementsAre("a", "b"));
  EXPECT_THAT(r1->dropped, ElementsAre("c"));
  EXPECT_EQ(job()->num_members(), 2u);
}

TEST_F(RoundTest, Leave_BeforeOthersComplete_RoundWaitsForTheRest) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  ASSERT_TRUE(job()->Leave(c_).ok());
  EXPECT_FALSE(ca.fired()) << "b is still expected";
  auto sb = Contribute(b_, 1, vb_, cb);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(1.5f));
  EXPECT_EQ(Record(1).value().reason, CloseReason::kMembersGone);
}

TEST_F(RoundTest, Leave_ParticipantAfterContributing_CountsItsContribution) {
  SyncCapture ca, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(job()->Leave(c_).ok());
  EXPECT_FALSE(ca.fired()) << "b is still expected";
  SyncCapture cb;
  auto sb = Contribute(b_, 1, vb_, cb);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
  EXPECT_EQ(ca.result()->contributors, 3u);
}

TEST_F(RoundTest, Leave_UnknownOrRepeated_IsOk) {
  EXPECT_TRUE(job()->Leave(MemberId("0123456789abcdef0123456789abcdef")).ok());
  EXPECT_TRUE(job()->Leave(c_).ok());
  EXPECT_TRUE(job()->Leave(c_).ok());
  EXPECT_EQ(job()->num_members(), 2u);
}

TEST_F(RoundTest, LeaseExpiry_SilentParticipant_ClosesRoundAtTick) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(policy_.lease_ttl / 2);
  ASSERT_TRUE(job()->Heartbeat(a_).ok());
  ASSERT_TRUE(job()->Heartbeat(b_).ok());
  clock_.Advance(policy_.lease_ttl / 2 + absl::Seconds(1));  // c: ttl + 1s
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(1.5f));
  EXPECT_EQ(ca.result()->contributors, 2u);
  EXPECT_EQ(job()->Heartbeat(c_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(job()->Heartbeat(a_).ok());
  EXPECT_TRUE(job()->Heartbeat(b_).ok());
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->reason, CloseReason::kMembersGone);
  EXPECT_THAT(r1->dropped, ElementsAre("c"));
}

TEST_F(RoundTest, LeaseExpiry_ExactlyTtl_NotExpiredOneSecondMoreIs) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(policy_.lease_ttl - absl::Seconds(1));
  ASSERT_TRUE(job()->Heartbeat(a_).ok());
  ASSERT_TRUE(job()->Heartbeat(b_).ok());
  clock_.Advance(absl::Seconds(1));  // c silent for exactly lease_ttl
  coordinator_->Tick();
  EXPECT_FALSE(ca.fired());
  EXPECT_EQ(job()->num_members(), 3u);
  clock_.Advance(absl::Seconds(1));
  coordinator_->Tick();
  EXPECT_TRUE(ca.fired());
  EXPECT_EQ(job()->num_members(), 2u);
}

TEST_F(RoundTest, Heartbeat_KeepsSilentMemberAcrossManyLeases) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  for (int i = 0; i < 12; ++i) {
    clock_.Advance(policy_.lease_ttl / 3);
    absl::StatusOr<RoundId> round = job()->Heartbeat(c_);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(*round, 0u);
    ASSERT_TRUE(job()->Heartbeat(a_).ok());
    ASSERT_TRUE(job()->Heartbeat(b_).ok());
    coordinator_->Tick();
  }
  EXPECT_FALSE(ca.fired()) << "c heartbeats, so the round waits for it";
  SyncCapture cc;
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(cc.fired());
  EXPECT_EQ(ValuesOf(cc.result()), Ramp(3));
  EXPECT_EQ(Record(1).value().reason, CloseReason::kComplete);
  EXPECT_EQ(*job()->Heartbeat(c_), 1u);
}

TEST_F(RoundTest, LeaseExpiry_WithoutTick_CallsAreRefused) {
  clock_.Advance(policy_.lease_ttl + absl::Seconds(1));
  EXPECT_EQ(job()->Heartbeat(a_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(BeginStatus(b_, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(job()->GetState(c_).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RoundTest, AddChunk_AfterLeaseExpired_ReturnsNotFound) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  SendChunks(*sa, va_, {0});
  clock_.Advance(policy_.lease_ttl + absl::Seconds(1));
  EXPECT_EQ(sa->AddChunk(1, Chunk(va_, 1)).code(), absl::StatusCode::kNotFound);
}

TEST_F(RoundTest, Partial_LeftMember_ChunksItSentCountOthersDoNot) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Begin(c_, 1, cc);
  SendChunks(*sc, vc_, {1, 4});
  EXPECT_FALSE(ca.fired());
  ASSERT_TRUE(job()->Leave(c_).ok());
  ASSERT_TRUE(ca.fired());
  // Chunks 1 and 4: mean of a, b, c = 3j + 3. Others: mean of a, b = 3j + 1.5.
  const std::vector<float> expected = PerChunk([](uint32_t c, size_t j) {
    return 3.0f * j + ((c == 1 || c == 4) ? 3.0f : 1.5f);
  });
  EXPECT_EQ(ValuesOf(ca.result()), expected);
  EXPECT_EQ(ca.result()->contributors, 2u) << "c is not a complete contributor";
  EXPECT_EQ(StateValues(b_), expected);
}

TEST_F(JobTest,
       Partial_WeightedMembers_EachChunkIsWeightedMeanOfItsContributions) {
  // Weights 1, 2, 4; c gives chunks 0 and 3 only, then its lease runs out.
  const MemberId a = Join("a", 1);
  const MemberId b = Join("b", 2);
  const MemberId c = Join("c", 4);
  Seed(a, Ramp(100));
  const std::vector<float> va = Ramp(0), vb = Ramp(3), vc = Ramp(6);
  SyncCapture ca, cb, cc;
  auto sc = Begin(c, 1, cc);
  SendChunks(*sc, vc, {0, 3});
  auto sa = Contribute(a, 1, va, ca);
  auto sb = Contribute(b, 1, vb, cb);
  clock_.Advance(policy_.lease_ttl / 2);
  ASSERT_TRUE(job()->Heartbeat(a).ok());
  ASSERT_TRUE(job()->Heartbeat(b).ok());
  clock_.Advance(policy_.lease_ttl / 2 + absl::Seconds(1));
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  // Integer sums are exact; the division is fp32's.
  const std::vector<float> expected = PerChunk([&](uint32_t k, size_t j) {
    if (k == 0 || k == 3) return (va[j] + 2 * vb[j] + 4 * vc[j]) / 7.0f;
    return (va[j] + 2 * vb[j]) / 3.0f;
  });
  EXPECT_EQ(ValuesOf(ca.result()), expected);
  EXPECT_EQ(ca.result()->contributors, 2u);
  EXPECT_DOUBLE_EQ(ca.result()->contributor_weight, 3.0);
  EXPECT_EQ(ValuesOf(cb.result()), expected);
  // c lost its lease; its pending Sync still hears how the round ended.
  ASSERT_TRUE(cc.fired());
  ASSERT_TRUE(cc.result().ok()) << cc.result().status();
  EXPECT_FALSE(cc.result()->contributed);
}

TEST_F(RoundTest, Close_ChunkWithoutContributions_KeepsPreviousState) {
  SyncCapture ca, cb, cc, cd;
  auto sa = Begin(a_, 1, ca);
  SendChunks(*sa, va_, {0});
  auto sb = Begin(b_, 1, cb);
  SendChunks(*sb, vb_, {0, 1});
  // d joins while round 1 is open: it only watches.
  const MemberId d = Join("d");
  auto sd = Begin(d, 1, cd);
  ASSERT_TRUE(job()->Leave(a_).ok());
  ASSERT_TRUE(job()->Leave(b_).ok());
  EXPECT_FALSE(cd.fired());
  ASSERT_TRUE(job()->Leave(c_).ok());
  ASSERT_TRUE(cd.fired());
  ASSERT_TRUE(cd.result().ok()) << cd.result().status();
  const std::vector<float> expected = PerChunk([&](uint32_t c, size_t j) {
    if (c == 0) return (va_[j] + vb_[j]) / 2;
    if (c == 1) return vb_[j];
    return seed_[j];
  });
  EXPECT_EQ(ValuesOf(cd.result()), expected);
  EXPECT_EQ(cd.result()->contributors, 0u);
  EXPECT_FALSE(cd.result()->contributed);
  EXPECT_EQ(StateValues(d), expected);
}

// --- Deadline
// -------------------------------------------------------------------

class DeadlineRoundTest : public RoundTest {
 protected:
  JobPolicy Policy() override {
    JobPolicy p;
    p.round_deadline = absl::Seconds(10);
    p.min_quorum = 2;
    return p;
  }
};

TEST_F(DeadlineRoundTest, Deadline_QuorumComplete_ClosesAtDeadlineNotBefore) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);  // opens round 1 now
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(absl::Seconds(9));
  coordinator_->Tick();
  EXPECT_FALSE(ca.fired()) << "closed before the deadline";
  clock_.Advance(absl::Seconds(1));
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());
  ASSERT_TRUE(cb.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(1.5f));
  EXPECT_EQ(ca.result()->contributors, 2u);
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->reason, CloseReason::kDeadline);
  EXPECT_THAT(r1->dropped, IsEmpty());
  EXPECT_THAT(r1->timed_out, ElementsAre("c"));
  // c is still a member: it adopts round 1 and takes part in round 2.
  EXPECT_EQ(job()->num_members(), 3u);
}

TEST_F(DeadlineRoundTest,
       Deadline_WithoutQuorum_WaitsThenClosesWhenQuorumCompletes) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Begin(b_, 1, cb);
  SendChunks(*sb, vb_, AllChunksBut(5));
  clock_.Advance(absl::Seconds(15));
  coordinator_->Tick();
  EXPECT_FALSE(ca.fired()) << "closed with 1 complete contribution, quorum 2";
  SendChunks(*sb, vb_, {5});
  ASSERT_TRUE(ca.fired()) << "quorum reached after the deadline: close at once";
  // b's partial chunks count as its complete contribution now.
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(1.5f));
  EXPECT_EQ(Record(1).value().reason, CloseReason::kDeadline);
}

TEST_F(DeadlineRoundTest, Deadline_AllCompleteBeforeDeadline_ClosesComplete) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(absl::Seconds(3));
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
  EXPECT_EQ(Record(1).value().reason, CloseReason::kComplete);
}

TEST_F(DeadlineRoundTest, Deadline_PartialChunksOfLateMember_CountPerChunk) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Begin(c_, 1, cc);
  SendChunks(*sc, vc_, {0, 5});
  clock_.Advance(absl::Seconds(10));
  coordinator_->Tick();
  ASSERT_TRUE(cc.fired());
  ASSERT_TRUE(cc.result().ok());
  EXPECT_FALSE(cc.result()->contributed);
  EXPECT_TRUE(cc.result()->late);
  const std::vector<float> expected = PerChunk([](uint32_t c, size_t j) {
    return 3.0f * j + ((c == 0 || c == 5) ? 3.0f : 1.5f);
  });
  EXPECT_EQ(ValuesOf(cc.result()), expected);
  // Chunks c sends after the close go nowhere.
  SendChunks(*sc, vc_, {1, 2, 3, 4});
  EXPECT_EQ(StateValues(a_), expected);
}

TEST_F(DeadlineRoundTest, Deadline_MeasuredFromRoundOpen) {
  clock_.Advance(absl::Seconds(8));
  ASSERT_TRUE(job()->Heartbeat(b_).ok());
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);  // opens at t = 8s
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(absl::Seconds(9));
  coordinator_->Tick();
  EXPECT_FALSE(ca.fired()) << "deadline counted from before the round opened";
  clock_.Advance(absl::Seconds(1));
  coordinator_->Tick();
  EXPECT_TRUE(ca.fired());
}

// --- Late arrivals and members that join mid-round
// ------------------------------------

TEST_F(DeadlineRoundTest, Sync_AfterRoundClosed_AdoptsLatestResultLate) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(absl::Seconds(10));
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());

  SyncCapture cc;
  auto sc = Begin(c_, 1, cc);
  ASSERT_TRUE(cc.fired()) << "a late member gets the result at once";
  ASSERT_TRUE(cc.result().ok()) << cc.result().status();
  EXPECT_EQ(cc.result()->round, 1u);
  EXPECT_TRUE(cc.result()->late);
  EXPECT_FALSE(cc.result()->contributed);
  EXPECT_EQ(cc.result()->contributors, 2u);
  EXPECT_EQ(cc.result()->state, ca.result()->state);
  // Its chunks go nowhere.
  Send(*sc, Ramp(1e6f));
  EXPECT_EQ(StateValues(c_), Ramp(1.5f));
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_THAT(r1->late, ElementsAre("c"));

  // c takes part in round 2: the round waits for it.
  SyncCapture da, db, dc;
  auto ta = Contribute(a_, 2, va_, da);
  auto tb = Contribute(b_, 2, vb_, db);
  EXPECT_FALSE(da.fired());
  auto tc = Contribute(c_, 2, vc_, dc);
  ASSERT_TRUE(dc.fired());
  EXPECT_TRUE(dc.result()->contributed);
  EXPECT_EQ(ValuesOf(dc.result()), Ramp(3));
}

TEST_F(DeadlineRoundTest,
       Sync_ContributorRetriesAfterClose_GetsItsResultNotLate) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  clock_.Advance(absl::Seconds(10));
  coordinator_->Tick();
  ASSERT_TRUE(ca.fired());
  SyncCapture retry;
  auto s = Begin(a_, 1, retry);
  ASSERT_TRUE(retry.fired());
  ASSERT_TRUE(retry.result().ok());
  EXPECT_TRUE(retry.result()->contributed);
  EXPECT_FALSE(retry.result()->late);
  EXPECT_EQ(retry.result()->round, 1u);
  EXPECT_EQ(ValuesOf(retry.result()), Ramp(1.5f));
  EXPECT_THAT(Record(1).value().late, IsEmpty());
}

TEST_F(DeadlineRoundTest, Sync_StragglerTwoRoundsBehind_AdoptsTheLatestRound) {
  for (RoundId r = 1; r <= 2; ++r) {
    SyncCapture ca, cb;
    auto sa = Contribute(a_, r, Ramp(10.0f * r), ca);
    auto sb = Contribute(b_, r, Ramp(10.0f * r + 2), cb);
    clock_.Advance(absl::Seconds(10));
    coordinator_->Tick();
    ASSERT_TRUE(ca.fired()) << "round " << r;
  }
  SyncCapture cc;
  auto sc = Begin(c_, 1, cc);
  ASSERT_TRUE(cc.fired());
  ASSERT_TRUE(cc.result().ok()) << cc.result().status();
  EXPECT_EQ(cc.result()->round, 2u);
  EXPECT_TRUE(cc.result()->late);
  EXPECT_FALSE(cc.result()->contributed);
  EXPECT_EQ(ValuesOf(cc.result()), Ramp(21));
  // Round 3 includes c again.
  SyncCapture da, db, dc;
  auto ta = Contribute(a_, 3, va_, da);
  auto tb = Contribute(b_, 3, vb_, db);
  EXPECT_FALSE(da.fired());
  auto tc = Contribute(c_, 3, vc_, dc);
  ASSERT_TRUE(da.fired());
  EXPECT_EQ(ValuesOf(da.result()), Ramp(3));
}

TEST_F(RoundTest, Join_WhileRoundOpen_NotAParticipantUntilNextRound) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  SendChunks(*sa, va_, {0, 1});  // round 1 is open

  absl::StatusOr<JoinResult> joined = TryJoin("d");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_TRUE(joined->has_state);
  EXPECT_EQ(joined->state_round, 0u);
  const MemberId d = joined->member_id;
  EXPECT_EQ(StateValues(d), seed_);

  SyncCapture cd;
  auto sd = Begin(d, 1, cd);
  Send(*sd, Ramp(1e6f));  // ignored: d is no participant of round 1
  EXPECT_FALSE(cd.fired());
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  EXPECT_FALSE(ca.fired());
  SendChunks(*sa, va_, {2, 3, 4, 5});
  ASSERT_TRUE(ca.fired()) << "round 1 must not wait for d";
  ASSERT_TRUE(cd.fired());
  ASSERT_TRUE(cd.result().ok()) << cd.result().status();
  EXPECT_EQ(cd.result()->round, 1u);
  EXPECT_FALSE(cd.result()->contributed);
  EXPECT_TRUE(cd.result()->late);
  EXPECT_EQ(ValuesOf(cd.result()), Ramp(3));
  EXPECT_EQ(Record(1).value().reason, CloseReason::kComplete);
  EXPECT_THAT(Record(1).value().participants, ElementsAre("a", "b", "c"));

  // Round 2 waits for d.
  SyncCapture da, db, dc, dd;
  auto ta = Contribute(a_, 2, va_, da);
  auto tb = Contribute(b_, 2, vb_, db);
  auto tc = Contribute(c_, 2, vc_, dc);
  EXPECT_FALSE(da.fired()) << "d is a participant of round 2";
  auto td = Contribute(d, 2, Ramp(9), dd);
  ASSERT_TRUE(dd.fired());
  EXPECT_TRUE(dd.result()->contributed);
  EXPECT_FALSE(dd.result()->late);
  EXPECT_EQ(ValuesOf(dd.result()), Ramp(4.5f));  // (0 + 3 + 6 + 9) / 4 + 3j
}

// --- Idempotence
// -----------------------------------------------------------------

TEST_F(RoundTest, AddChunk_SameChunkTwice_CountsOnce) {
  SyncCapture ca, cb, cc;
  auto sa = Begin(a_, 1, ca);
  SendChunks(*sa, va_, {0, 1, 2});
  SendChunks(*sa, va_, {2});
  SendChunks(*sa, Ramp(1e5f), {1});  // a different copy is ignored too
  EXPECT_EQ(sa->received(), 3u);
  SendChunks(*sa, va_, {3, 4, 5});
  EXPECT_TRUE(sa->complete());
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(RoundTest, AddChunk_RetriedStreamSameRound_ChunksCountOnce) {
  SyncCapture first, second;
  auto s1 = Begin(a_, 1, first);
  SendChunks(*s1, va_, {0, 1, 2});
  // The stream breaks; the client retries the whole round on a new one.
  auto s2 = Begin(a_, 1, second);
  SendChunks(*s2, Ramp(-777), {0, 1});  // already given: ignored
  SendChunks(*s2, va_, {2, 3, 4, 5});
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(second.fired());
  ASSERT_TRUE(second.result().ok());
  EXPECT_TRUE(second.result()->contributed);
  EXPECT_EQ(ValuesOf(second.result()), Ramp(3));
  EXPECT_EQ(ValuesOf(cb.result()), Ramp(3));
  // The first stream was not cancelled: it is answered as well.
  ASSERT_TRUE(first.fired());
  EXPECT_TRUE(first.result()->contributed);
}

TEST_F(RoundTest,
       AddChunk_RetriedStreamAfterFirstCompleted_DoesNotDoubleCount) {
  SyncCapture first, second;
  auto s1 = Contribute(a_, 1, va_, first);
  s1.reset();  // cancelled after all chunks: they stay counted
  auto s2 = Contribute(a_, 1, va_, second);
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  EXPECT_FALSE(second.fired());
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(second.fired());
  EXPECT_FALSE(first.fired());
  EXPECT_EQ(ValuesOf(second.result()), Ramp(3));
  EXPECT_EQ(second.result()->contributors, 3u);
}

// --- Cancel
// -------------------------------------------------------------------

TEST_F(RoundTest,
       Cancel_PendingContributor_CallbackNeverRunsChunksStayCounted) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  EXPECT_TRUE(sa->Cancel());
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(cb.fired());
  EXPECT_FALSE(ca.fired());
  EXPECT_EQ(ValuesOf(cb.result()), Ramp(3));
  EXPECT_EQ(cb.result()->contributors, 3u);
}

TEST_F(RoundTest, Cancel_AfterCallbackRan_ReturnsFalse) {
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_FALSE(sa->Cancel());
  EXPECT_EQ(ca.calls(), 1);
}

TEST_F(RoundTest, SessionDestroyedBeforeClose_CallbackNeverRuns) {
  SyncCapture ca, cb, cc;
  {
    auto sa = Begin(a_, 1, ca);
    SendChunks(*sa, va_, {0, 1, 2});
  }
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  // a's partial contribution keeps the round open until a finishes or goes.
  EXPECT_FALSE(cb.fired());
  SyncCapture again;
  auto sa2 = Begin(a_, 1, again);
  SendChunks(*sa2, va_, {3, 4, 5});
  ASSERT_TRUE(cb.fired());
  EXPECT_FALSE(ca.fired());
  ASSERT_TRUE(again.fired());
  EXPECT_EQ(ValuesOf(again.result()), Ramp(3));
}

// --- Bad input
// ------------------------------------------------------------------

TEST_F(RoundTest, Sync_ChunkOutOfRange_ReturnsInvalidArgument) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  const std::string payload = Chunk(va_, 0);
  const absl::Status s = sa->AddChunk(6, payload);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("6"));
  EXPECT_EQ(sa->AddChunk(0xffffffffu, payload).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sa->received(), 0u);
  Send(*sa, va_);
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(RoundTest, Sync_WrongPayloadSize_ReturnsInvalidArgument) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  const std::string full = Chunk(va_, 0);  // 4 values
  for (const std::string& bad :
       {full.substr(0, 15), full + "x", std::string(), full + full}) {
    EXPECT_EQ(sa->AddChunk(0, bad).code(), absl::StatusCode::kInvalidArgument)
        << bad.size() << " bytes";
  }
  // The last chunk holds 3 values: a full-size payload is wrong there.
  EXPECT_EQ(sa->AddChunk(5, full).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sa->received(), 0u);
  Send(*sa, va_);
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(RoundTest,
       Sync_NonFinitePayload_ReturnsInvalidArgumentAndChangesNothing) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> poisoned = va_;
    poisoned[geometry_.Offset(2) + 1] = bad;
    const absl::Status s = sa->AddChunk(2, Chunk(poisoned, 2));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("element 1"));
  }
  EXPECT_EQ(sa->received(), 0u);
  // The refused chunk may be sent again, honestly.
  Send(*sa, va_);
  SyncCapture cb, cc;
  auto sb = Contribute(b_, 1, vb_, cb);
  auto sc = Contribute(c_, 1, vc_, cc);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(JobTest,
       Sync_NonFinitePastFirstBlock_ReturnsInvalidArgumentNamingElement) {
  Config config;
  config.layout = MakeFloatLayout({{"w", {3000}}});
  config.chunk = 1500;
  Init(config);
  const MemberId a = Join("a");
  Seed(a, std::vector<float>(n_, 1.0f));
  SyncCapture ca;
  auto sa = Begin(a, 1, ca);
  std::vector<float> v(n_, 2.0f);
  v[1500 + 1300] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status s = sa->AddChunk(1, Chunk(v, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("element 1300"));
  v[1500 + 1300] = 2.0f;
  Send(*sa, v);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), std::vector<float>(n_, 2.0f));
}

// Policy drop: a member whose chunk 2 holds a NaN is dropped from the round
// at that chunk. Its chunks 0 and 1 count, as for a member killed
// mid-stream; the rest of its stream is ignored; its Sync gets the result
// with contributed = false; the member stays for the next round.
TEST_F(JobTest, Sync_NonFiniteWithDropPolicy_DropsMemberFromRoundOnly) {
  Config config;
  config.nonfinite = NonFinitePolicy::kDrop;
  Init(config);
  const MemberId a = Join("a"), b = Join("b"), c = Join("c");
  EXPECT_EQ(job()->settings().nonfinite_policy, NonFinitePolicy::kDrop);
  Seed(a, Ramp(100, 1));
  std::vector<float> poisoned = Ramp(0);
  poisoned[geometry_.Offset(2) + 1] = std::numeric_limits<float>::infinity();
  SyncCapture ca, cb, cc;
  auto sa = Begin(a, 1, ca);
  Send(*sa, poisoned);  // every AddChunk is OK
  EXPECT_TRUE(sa->complete());
  EXPECT_FALSE(ca.fired());
  auto sb = Contribute(b, 1, Ramp(3), cb);
  auto sc = Contribute(c, 1, Ramp(6), cc);
  ASSERT_TRUE(ca.fired() && cb.fired() && cc.fired());
  ASSERT_TRUE(ca.result().ok()) << ca.result().status();
  EXPECT_FALSE(ca.result()->contributed);
  EXPECT_FALSE(ca.result()->late);  // on time, refused
  EXPECT_TRUE(cb.result()->contributed);
  EXPECT_EQ(cb.result()->contributors, 2u);
  // Chunks 0, 1: mean of 0, 3, 6 (offset 3); from chunk 2 on: of 3 and 6.
  const std::vector<float> want = PerChunk([&](uint32_t chunk, size_t j) {
    return 3.0f * static_cast<float>(j) + (chunk < 2 ? 3.0f : 4.5f);
  });
  EXPECT_EQ(ValuesOf(ca.result()), want);
  EXPECT_EQ(ValuesOf(cb.result()), want);
  const std::optional<RoundRecord> record = Record(1);
  ASSERT_TRUE(record.has_value());
  EXPECT_THAT(record->dropped, ::testing::ElementsAre("a"));
  // Still a member: it contributes to round 2.
  SyncCapture ca2, cb2, cc2;
  auto sa2 = Contribute(a, 2, Ramp(0), ca2);
  auto sb2 = Contribute(b, 2, Ramp(3), cb2);
  auto sc2 = Contribute(c, 2, Ramp(6), cc2);
  ASSERT_TRUE(ca2.fired());
  EXPECT_TRUE(ca2.result()->contributed);
  EXPECT_EQ(ValuesOf(ca2.result()), Ramp(3));
}

// A seed is the state everyone starts from: never dropped into, refused.
TEST_F(JobTest, Seed_NonFiniteWithDropPolicy_IsStillRefused) {
  Config config;
  config.nonfinite = NonFinitePolicy::kDrop;
  Init(config);
  const MemberId a = Join("a");
  std::vector<float> poisoned = Ramp(0);
  poisoned[0] = std::numeric_limits<float>::quiet_NaN();
  SyncCapture ca;
  auto sa = Begin(a, 0, ca);
  EXPECT_EQ(sa->AddChunk(0, Chunk(poisoned, 0)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(JobTest, Join_OtherNonFinitePolicy_ReturnsFailedPrecondition) {
  Join("a");  // the job's policy: the coordinator's default, reject
  EXPECT_EQ(job()->settings().nonfinite_policy, NonFinitePolicy::kReject);
  JoinRequestParams p = Params("b");
  p.settings.nonfinite_policy = NonFinitePolicy::kDrop;
  absl::StatusOr<JoinResult> r = coordinator_->Join(kJob, p);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("non-finite"));
}

TEST_F(RoundTest, Sync_UnknownMember_ReturnsNotFound) {
  const MemberId stranger("0123456789abcdef0123456789abcdef");
  EXPECT_EQ(BeginStatus(stranger, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(BeginStatus(MemberId(), 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(job()->GetState(stranger).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(job()->Heartbeat(stranger).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RoundTest, Sync_RoundFarInTheFuture_ReturnsFailedPrecondition) {
  EXPECT_EQ(BeginStatus(a_, 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(BeginStatus(a_, 1000).code(),
            absl::StatusCode::kFailedPrecondition);
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);  // round 1 open
  EXPECT_EQ(BeginStatus(b_, 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(ca.fired());
}

TEST_F(RoundTest, AddChunk_AfterLeave_ReturnsNotFound) {
  SyncCapture ca;
  auto sa = Begin(a_, 1, ca);
  SendChunks(*sa, va_, {0});
  ASSERT_TRUE(job()->Leave(a_).ok());
  EXPECT_EQ(sa->AddChunk(1, Chunk(va_, 1)).code(), absl::StatusCode::kNotFound);
}

// --- Membership
// ------------------------------------------------------------------

TEST_F(RoundTest, Join_SameNameSameIncarnation_ReturnsSameMember) {
  absl::StatusOr<JoinResult> again = TryJoin("b", 1, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->member_id, b_);
  EXPECT_EQ(job()->num_members(), 3u);
  EXPECT_TRUE(again->has_state);
}

TEST_F(RoundTest, Join_SameNameNewIncarnation_ReplacesOldMember) {
  absl::StatusOr<JoinResult> restarted = TryJoin("b", 1, 2);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  const MemberId b2 = restarted->member_id;
  EXPECT_NE(b2, b_);
  EXPECT_EQ(job()->num_members(), 3u);
  EXPECT_EQ(job()->Heartbeat(b_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(BeginStatus(b_, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(job()->GetState(b_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(job()->Heartbeat(b2).ok());
  EXPECT_EQ(StateValues(b2), seed_);
  // The new incarnation takes part in the next round like anyone.
  SyncCapture ca, cb, cc;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sc = Contribute(c_, 1, vc_, cc);
  EXPECT_FALSE(ca.fired());
  auto sb = Contribute(b2, 1, vb_, cb);
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(3));
}

TEST_F(RoundTest, Join_NewIncarnationOfParticipant_RoundStopsWaitingForOldOne) {
  SyncCapture ca, cc, cold;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sc = Contribute(c_, 1, vc_, cc);
  auto sb = Begin(b_, 1, cold);
  SendChunks(*sb, Ramp(9), {0});
  absl::StatusOr<JoinResult> restarted = TryJoin("b", 1, 2);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ASSERT_TRUE(ca.fired()) << "the old b is gone; a and c are complete";
  // Chunk 0 has the old b's contribution: (0 + 9 + 6) / 3 + 3j. The rest is
  // the mean of a and c: 3j + 3.
  const std::vector<float> expected = PerChunk(
      [](uint32_t c, size_t j) { return 3.0f * j + (c == 0 ? 5.0f : 3.0f); });
  EXPECT_EQ(ValuesOf(ca.result()), expected);
  const std::optional<RoundRecord> r1 = Record(1);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->reason, CloseReason::kMembersGone);
  EXPECT_THAT(r1->dropped, ElementsAre("b"));
  EXPECT_EQ(sb->AddChunk(1, Chunk(vb_, 1)).code(), absl::StatusCode::kNotFound);
}

TEST_F(JobTest, Join_MaxMembers_ReturnsResourceExhaustedButAllowsRestart) {
  Config config;
  config.policy.max_members = 2;
  Init(config);
  const MemberId a = Join("a");
  Join("b");
  EXPECT_EQ(TryJoin("c").status().code(), absl::StatusCode::kResourceExhausted);
  // A repeated Join and a restart of an existing member still work.
  EXPECT_EQ(Join("a"), a);
  absl::StatusOr<JoinResult> a2 = TryJoin("a", 1, 7);
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_NE(a2->member_id, a);
  // A slot frees when a member leaves.
  ASSERT_TRUE(job()->Leave(a2->member_id).ok());
  EXPECT_TRUE(TryJoin("c").ok());
}

// --- bf16 wire
// --------------------------------------------------------------------

TEST_F(JobTest, Bf16Wire_ResultIsRepresentableAndNearFp32Mean) {
  Config config;
  config.wire = DType::kBFloat16;
  config.layout = MakeFloatLayout({{"w", {37, 29}}, {"b", {11}}});
  config.chunk = 100;
  Init(config);
  const std::vector<double> weights = {1, 2, 3.5};
  std::vector<MemberId> ids;
  std::vector<std::vector<float>> x(3, std::vector<float>(n_));
  for (int i = 0; i < 3; ++i) {
    ids.push_back(Join("m" + std::to_string(i), weights[i]));
    for (size_t j = 0; j < n_; ++j) {
      x[i][j] = static_cast<float>(std::sin(0.013 * j + i) * (i + 1) * 0.7);
    }
  }
  Seed(ids[0], x[0]);
  std::vector<SyncCapture> caps(3);
  std::vector<std::unique_ptr<SyncSession>> sessions;
  for (int i = 0; i < 3; ++i)
    sessions.push_back(Contribute(ids[i], 1, x[i], caps[i]));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(caps[i].fired());
    ASSERT_TRUE(caps[i].result().ok()) << caps[i].result().status();
  }
  const std::vector<float> got = ValuesOf(caps[0].result());
  ASSERT_EQ(got.size(), n_);
  for (size_t j = 0; j < n_; ++j) {
    double sum = 0, magnitude = 0;
    for (int i = 0; i < 3; ++i) {
      sum += weights[i] * x[i][j];
      magnitude = std::max(magnitude, std::fabs(static_cast<double>(x[i][j])));
    }
    const double mean = sum / 6.5;
    EXPECT_TRUE(IsBFloat16Representable(got[j])) << j << ": " << got[j];
    // One bf16 rounding of each input and one of the result: 2^-8 relative
    // to the largest input is a generous bound.
    EXPECT_NEAR(got[j], mean, std::ldexp(magnitude, -7)) << j;
  }
  // What a late joiner fetches equals what the members received.
  const MemberId late = Join("late");
  EXPECT_EQ(StateValues(late), got);
  EXPECT_EQ(ValuesOf(caps[2].result()), got);
}

TEST_F(JobTest, Bf16Wire_BadPayloads_ReturnInvalidArgument) {
  Config config;
  config.wire = DType::kBFloat16;
  Init(config);
  const MemberId a = Join("a");
  Seed(a, Ramp(1));
  SyncCapture ca;
  auto sa = Begin(a, 1, ca);
  std::string fp32;
  EncodeValues(std::vector<float>(4, 1.0f), DType::kFloat32, &fp32);
  EXPECT_EQ(sa->AddChunk(0, fp32).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> nan = Ramp(2);
  nan[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(sa->AddChunk(0, Chunk(nan, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  Send(*sa, Ramp(2));
  ASSERT_TRUE(ca.fired());
  EXPECT_EQ(ValuesOf(ca.result()), Ramp(2));
}

// --- Stop
// ----------------------------------------------------------------------

TEST_F(RoundTest, Stop_PendingCallbacksGetUnavailable_LaterCallsRefused) {
  SyncCapture ca, cb;
  auto sa = Contribute(a_, 1, va_, ca);
  auto sb = Begin(b_, 1, cb);
  SendChunks(*sb, vb_, {0});
  coordinator_->Stop();
  for (SyncCapture* cap : {&ca, &cb}) {
    ASSERT_EQ(cap->calls(), 1);
    EXPECT_EQ(cap->result().status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(BeginStatus(c_, 1).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(sb->AddChunk(1, Chunk(vb_, 1)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(job()->GetState(a_).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(TryJoin("d").status().code(), absl::StatusCode::kUnavailable);
  coordinator_->Stop();  // idempotent
  coordinator_->Tick();
  EXPECT_EQ(ca.calls(), 1);
  EXPECT_EQ(cb.calls(), 1);
  EXPECT_FALSE(sa->Cancel());
}

TEST_F(JobTest, Stop_PendingSeedCallbacks_GetUnavailable) {
  const MemberId a = Join("a");
  const MemberId b = Join("b");
  SyncCapture ca, cb;
  auto sa = Begin(a, 0, ca);
  SendChunks(*sa, Ramp(1), {0});
  auto sb = Begin(b, 0, cb);
  job()->Stop();
  EXPECT_EQ(ca.result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cb.result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(BeginStatus(a, 0).code(), absl::StatusCode::kUnavailable);
  sa.reset();
  sb.reset();
  EXPECT_EQ(ca.calls(), 1);
  EXPECT_EQ(cb.calls(), 1);
}

// --- Many rounds
// ---------------------------------------------------------------------

TEST_F(JobTest, Sync_FiftyRounds_EachExact) {
  const std::vector<double> weights = {1, 1, 2};
  std::vector<MemberId> ids;
  for (int i = 0; i < 3; ++i)
    ids.push_back(Join("m" + std::to_string(i), weights[i]));
  Seed(ids[0], Ramp(0));
  // Integer values: the weighted sum is exact and the mean a multiple of 1/4.
  auto value = [](RoundId r, int i, size_t j) {
    return static_cast<float>(static_cast<int>((r * 7 + i * 13 + j * 3) % 23) -
                              11);
  };
  std::shared_ptr<const StateSnapshot> kept;  // a snapshot held across rounds
  std::vector<float> kept_copy;
  for (RoundId r = 1; r <= 50; ++r) {
    std::vector<SyncCapture> caps(3);
    std::vector<std::unique_ptr<SyncSession>> sessions(3);
    std::vector<float> expected(n_);
    for (size_t j = 0; j < n_; ++j) {
      float sum = 0;
      for (int i = 0; i < 3; ++i)
        sum += static_cast<float>(weights[i]) * value(r, i, j);
      expected[j] = sum / 4;
    }
    // A different member goes last each round.
    for (int k = 0; k < 3; ++k) {
      const int i = static_cast<int>((k + r) % 3);
      std::vector<float> v(n_);
      for (size_t j = 0; j < n_; ++j) v[j] = value(r, i, j);
      sessions[i] = Contribute(ids[i], r, v, caps[i]);
      if (k < 2) {
        ASSERT_FALSE(caps[i].fired()) << "round " << r;
      }
    }
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(caps[i].fired()) << "round " << r;
      ASSERT_TRUE(caps[i].result().ok()) << caps[i].result().status();
      ASSERT_EQ(caps[i].result()->round, r);
      ASSERT_EQ(ValuesOf(caps[i].result()), expected) << "round " << r;
    }
    if (r == 10) {
      kept = caps[0].result()->state;
      kept_copy = kept->values;
    }
    // caps and sessions go out of scope: the old state's buffer may be reused.
  }
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->round, 10u);
  EXPECT_EQ(kept->values, kept_copy) << "a handed-out snapshot changed";
  EXPECT_EQ(job()->Status(100).state_round, 50u);
}

// --- Status
// ----------------------------------------------------------------------

TEST_F(JobTest, Status_RecentRounds_ListNamesAndReasons) {
  Config config;
  config.policy.round_deadline = absl::Seconds(10);
  config.policy.min_quorum = 1;
  Init(config);
  const MemberId d = Join("d");
  const MemberId b = Join("b", 2);
  const MemberId a = Join("a");
  const MemberId c = Join("c");
  Seed(b, Ramp(0));
  {  // round 1: complete
    std::vector<SyncCapture> caps(4);
    std::vector<std::unique_ptr<SyncSession>> s;
    const std::vector<MemberId> all = {a, b, c, d};
    for (int i = 0; i < 4; ++i)
      s.push_back(Contribute(all[i], 1, Ramp(i), caps[i]));
    ASSERT_TRUE(caps[0].fired());
  }
  {  // round 2: d misses the deadline, then arrives late
    std::vector<SyncCapture> caps(3);
    std::vector<std::unique_ptr<SyncSession>> s;
    const std::vector<MemberId> some = {a, b, c};
    for (int i = 0; i < 3; ++i)
      s.push_back(Contribute(some[i], 2, Ramp(i), caps[i]));
    clock_.Advance(absl::Seconds(10));
    coordinator_->Tick();
    ASSERT_TRUE(caps[0].fired());
    SyncCapture late;
    auto sd = Begin(d, 2, late);
    ASSERT_TRUE(late.fired());
  }
  {  // round 3: d leaves without contributing
    std::vector<SyncCapture> caps(3);
    std::vector<std::unique_ptr<SyncSession>> s;
    const std::vector<MemberId> some = {a, b, c};
    for (int i = 0; i < 3; ++i)
      s.push_back(Contribute(some[i], 3, Ramp(i), caps[i]));
    EXPECT_FALSE(caps[0].fired());
    ASSERT_TRUE(job()->Leave(d).ok());
    ASSERT_TRUE(caps[0].fired());
  }
  // Round 4 open, a has contributed.
  SyncCapture c4;
  auto s4 = Contribute(a, 4, Ramp(0), c4);

  const JobStatusSnapshot s = job()->Status(10);
  EXPECT_EQ(s.job_id, kJob);
  EXPECT_TRUE(s.has_state);
  EXPECT_EQ(s.state_round, 3u);
  ASSERT_EQ(s.members.size(), 3u);
  EXPECT_EQ(s.members[0].name, "a");
  EXPECT_EQ(s.members[1].name, "b");
  EXPECT_EQ(s.members[1].weight, 2.0);
  EXPECT_EQ(s.members[2].name, "c");
  EXPECT_TRUE(s.round_open);
  EXPECT_THAT(s.open_round_participants, ElementsAre("a", "b", "c"));
  EXPECT_THAT(s.open_round_contributed, ElementsAre("a"));
  // Why it is still open: the close decision as of now.
  EXPECT_EQ(s.open_round, 4u);
  EXPECT_FALSE(s.open_round_decision.close);
  EXPECT_THAT(s.open_round_decision.waiting_for, ElementsAre("b", "c"));
  EXPECT_THAT(s.open_round_decision.why_open,
              HasSubstr("waiting for 2 of 3 participants (b, c)"));

  ASSERT_EQ(s.recent_rounds.size(), 4u);
  const RoundRecord& r3 = s.recent_rounds[0];
  const RoundRecord& r2 = s.recent_rounds[1];
  const RoundRecord& r1 = s.recent_rounds[2];
  const RoundRecord& r0 = s.recent_rounds[3];
  EXPECT_EQ(r3.round, 3u);
  EXPECT_EQ(r3.reason, CloseReason::kMembersGone);
  EXPECT_THAT(r3.participants, ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(r3.contributors, ElementsAre("a", "b", "c"));
  EXPECT_THAT(r3.dropped, ElementsAre("d"));
  EXPECT_THAT(r3.late, IsEmpty());
  EXPECT_DOUBLE_EQ(r3.contributor_weight, 4.0);

  EXPECT_EQ(r2.round, 2u);
  EXPECT_EQ(r2.reason, CloseReason::kDeadline);
  EXPECT_THAT(r2.contributors, ElementsAre("a", "b", "c"));
  // d was still a member when the deadline passed: timed out, not dropped.
  EXPECT_THAT(r2.dropped, IsEmpty());
  EXPECT_THAT(r2.timed_out, ElementsAre("d"));
  EXPECT_THAT(r2.late, ElementsAre("d"));
  EXPECT_EQ(r2.closed - r2.opened, absl::Seconds(10));

  EXPECT_EQ(r1.round, 1u);
  EXPECT_EQ(r1.reason, CloseReason::kComplete);
  EXPECT_THAT(r1.participants, ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(r1.contributors, ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(r1.dropped, IsEmpty());
  EXPECT_DOUBLE_EQ(r1.contributor_weight, 5.0);

  EXPECT_EQ(r0.round, 0u);
  EXPECT_EQ(r0.reason, CloseReason::kSeed);
  EXPECT_THAT(r0.contributors, ElementsAre("b"));

  EXPECT_EQ(job()->Status(2).recent_rounds.size(), 2u);
  EXPECT_EQ(job()->Status(2).recent_rounds[0].round, 3u);
  EXPECT_EQ(CloseReasonName(CloseReason::kMembersGone), "members_gone");
  EXPECT_EQ(CloseReasonName(CloseReason::kDeadline), "deadline");
}

TEST_F(JobTest, Status_MaxRecentRounds_KeepsOnlyTheNewest) {
  Config config;
  config.policy.max_recent_rounds = 3;
  Init(config);
  const MemberId a = Join("a");
  Seed(a, Ramp(0));
  for (RoundId r = 1; r <= 5; ++r) {
    SyncCapture cap;
    auto s = Contribute(a, r, Ramp(r), cap);
    ASSERT_TRUE(cap.fired());
  }
  const JobStatusSnapshot s = job()->Status(100);
  ASSERT_EQ(s.recent_rounds.size(), 3u);
  EXPECT_EQ(s.recent_rounds[0].round, 5u);
  EXPECT_EQ(s.recent_rounds[2].round, 3u);
  // A very late straggler still adopts the latest state.
  const MemberId b = Join("b");
  SyncCapture late;
  auto sb = Begin(b, 1, late);
  ASSERT_TRUE(late.fired());
  ASSERT_TRUE(late.result().ok()) << late.result().status();
  EXPECT_EQ(late.result()->round, 5u);
  EXPECT_EQ(ValuesOf(late.result()), Ramp(5));
}

}  // namespace
}  // namespace localsgd
