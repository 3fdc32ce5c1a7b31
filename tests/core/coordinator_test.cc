// Tests of the Coordinator: option and request validation, limits, jobs kept
// apart, Tick and Stop across jobs, and a concurrency smoke test with real
// threads that synchronise only through the Sync callbacks.
#include "src/coordinator.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/checkpoint.h"
#include "src/clock.h"
#include "src/job.h"
#include "src/layout.h"
#include "tests/core/test_util.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testing_util::EncodeChunk;
using testing_util::MakeFloatLayout;
using testing_util::SmallLayout;
using testing_util::SyncCapture;
using testing_util::TotalElements;

// --- Options ----------------------------------------------------------------

TEST(CoordinatorOptionsTest, Create_DefaultOptions_Succeeds) {
  absl::StatusOr<std::unique_ptr<Coordinator>> c =
      Coordinator::Create(CoordinatorOptions());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Jobs().empty());
}

TEST(CoordinatorOptionsTest, Create_InvalidOptions_ReturnsInvalidArgument) {
  std::vector<std::pair<std::string, CoordinatorOptions>> bad;
  auto add = [&](std::string what, auto mutate) {
    CoordinatorOptions o;
    mutate(o);
    bad.emplace_back(std::move(what), o);
  };
  add("lease_ttl 0",
      [](CoordinatorOptions& o) { o.policy.lease_ttl = absl::ZeroDuration(); });
  add("lease_ttl < 0",
      [](CoordinatorOptions& o) { o.policy.lease_ttl = -absl::Seconds(1); });
  add("round_deadline < 0", [](CoordinatorOptions& o) {
    o.policy.round_deadline = -absl::Seconds(1);
  });
  add("min_quorum 0", [](CoordinatorOptions& o) { o.policy.min_quorum = 0; });
  add("max_members 0", [](CoordinatorOptions& o) { o.policy.max_members = 0; });
  add("max_jobs 0", [](CoordinatorOptions& o) { o.max_jobs = 0; });
  add("max_recent_rounds 0",
      [](CoordinatorOptions& o) { o.policy.max_recent_rounds = 0; });
  add("max_chunk_elements 0",
      [](CoordinatorOptions& o) { o.max_chunk_elements = 0; });
  add("max_model_elements 0",
      [](CoordinatorOptions& o) { o.max_model_elements = 0; });
  add("chunk 0",
      [](CoordinatorOptions& o) { o.default_settings.chunk_elements = 0; });
  add("chunk > max", [](CoordinatorOptions& o) {
    o.default_settings.chunk_elements = o.max_chunk_elements + 1;
  });
  add("wire fp16", [](CoordinatorOptions& o) {
    o.default_settings.wire_dtype = DType::kFloat16;
  });
  add("wire unspecified", [](CoordinatorOptions& o) {
    o.default_settings.wire_dtype = DType::kUnspecified;
  });
  add("mode unspecified", [](CoordinatorOptions& o) {
    o.default_settings.mode = AveragingMode::kUnspecified;
  });
  for (const auto& [what, options] : bad) {
    EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument)
        << what;
    EXPECT_EQ(Coordinator::Create(options).status().code(),
              absl::StatusCode::kInvalidArgument)
        << what;
  }
}

// --- Join validation
// --------------------------------------------------------------

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(CoordinatorOptions()); }

  void Init(CoordinatorOptions options) {
    options.clock = &clock_;
    absl::StatusOr<std::unique_ptr<Coordinator>> c =
        Coordinator::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
  }

  static JoinRequestParams Params(const std::string& name,
                                  uint64_t incarnation = 1,
                                  Layout layout = SmallLayout()) {
    JoinRequestParams p;
    p.member_name = name;
    p.layout = std::move(layout);
    p.incarnation = incarnation;
    p.settings.chunk_elements = 4;
    return p;
  }
  absl::StatusCode JoinCode(const std::string& job_id, JoinRequestParams p) {
    return coordinator_->Join(job_id, std::move(p)).status().code();
  }

  // Seeds `job_id` through `member` with `values`, in chunks of 4 (fp32).
  void Seed(const std::string& job_id, const MemberId& member,
            const std::vector<float>& values) {
    std::shared_ptr<Job> job = coordinator_->FindJob(job_id).value();
    SyncCapture capture;
    auto s = job->BeginSync(member, 0, capture.Callback()).value();
    for (uint32_t i = 0; i < job->geometry().num_chunks(); ++i) {
      ASSERT_TRUE(s->AddChunk(i, EncodeChunk(values, job->geometry(), i,
                                             DType::kFloat32))
                      .ok());
    }
    ASSERT_TRUE(capture.fired());
  }

  FakeClock clock_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(CoordinatorTest, Join_BadJobId_ReturnsInvalidArgument) {
  for (const std::string& id :
       {std::string(), std::string("a/b"), std::string("has space"),
        std::string("ümlaut"), std::string("x\n"), std::string(129, 'a')}) {
    EXPECT_EQ(JoinCode(id, Params("m")), absl::StatusCode::kInvalidArgument)
        << "'" << id << "'";
  }
  EXPECT_TRUE(coordinator_->Jobs().empty());
}

TEST_F(CoordinatorTest, Join_ValidJobIdCharacters_Accepted) {
  for (const std::string& id :
       {std::string("job-1.a_B"), std::string(128, 'z'), std::string("0")}) {
    EXPECT_EQ(JoinCode(id, Params("m")), absl::StatusCode::kOk) << id;
    EXPECT_TRUE(ValidateJobId(id).ok());
  }
}

TEST_F(CoordinatorTest, Join_ZeroIncarnation_ReturnsInvalidArgument) {
  EXPECT_EQ(JoinCode("j", Params("m", /*incarnation=*/0)),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, Join_BadWeight_ReturnsInvalidArgument) {
  for (double w :
       {-1.0, -1e-9, std::nan(""), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity(), 1e6 + 1}) {
    JoinRequestParams p = Params("m");
    p.weight = w;
    EXPECT_EQ(JoinCode("j", p), absl::StatusCode::kInvalidArgument) << w;
  }
}

TEST_F(CoordinatorTest, Join_ZeroWeight_MeansDefaultOfOne) {
  JoinRequestParams p = Params("m");
  p.weight = 0;
  ASSERT_EQ(JoinCode("j", p), absl::StatusCode::kOk);
  const JobStatusSnapshot s = coordinator_->FindJob("j").value()->Status(1);
  ASSERT_EQ(s.members.size(), 1u);
  EXPECT_EQ(s.members[0].weight, 1.0);
}

TEST_F(CoordinatorTest, Join_MemberNameTooLong_ReturnsInvalidArgument) {
  EXPECT_EQ(JoinCode("j", Params(std::string(257, 'n'))),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinCode("j", Params(std::string(256, 'n'))),
            absl::StatusCode::kOk);
}

TEST_F(CoordinatorTest, Join_InvalidLayout_ReturnsInvalidArgument) {
  Layout wrong_fingerprint = SmallLayout();
  wrong_fingerprint.fingerprint += 1;
  EXPECT_EQ(JoinCode("j", Params("m", 1, wrong_fingerprint)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      JoinCode("j", Params("m", 1, MakeFloatLayout({{"w", {2}}, {"w", {3}}}))),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinCode("j", Params("m", 1, MakeLayout({}))),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(coordinator_->Jobs().empty()) << "a refused Join created a job";
}

TEST_F(CoordinatorTest, Join_ModelTooLarge_ReturnsResourceExhausted) {
  CoordinatorOptions options;
  options.max_model_elements = 100;
  Init(options);
  EXPECT_EQ(JoinCode("j", Params("m", 1, MakeFloatLayout({{"w", {101}}}))),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(JoinCode("j", Params("m", 1, MakeFloatLayout({{"w", {10, 10}}}))),
            absl::StatusCode::kOk);
}

TEST_F(CoordinatorTest, Join_ChunkCountAboveUint32_IsRefusedNotTruncated) {
  // max_model_elements is a uint64 with no upper bound in Validate(). A model
  // of 2^32 + 8 elements in chunks of 1 has 2^32 + 8 chunks, which the
  // uint32 chunk count cannot hold. Join allocates nothing per element, so
  // this is cheap to ask.
  CoordinatorOptions options;
  options.max_model_elements = uint64_t{1} << 40;
  Init(options);
  JoinRequestParams p =
      Params("m", 1, MakeFloatLayout({{"w", {(int64_t{1} << 32) + 8}}}));
  p.settings.chunk_elements = 1;
  absl::StatusOr<JoinResult> r = coordinator_->Join("j", p);
  if (r.ok()) {
    const ChunkGeometry& g = r->geometry;
    ADD_FAILURE() << "accepted with " << g.num_chunks() << " chunks of "
                  << g.chunk_elements() << " for " << g.num_elements()
                  << " elements";
  } else {
    EXPECT_THAT(r.status().code(),
                ::testing::AnyOf(absl::StatusCode::kInvalidArgument,
                                 absl::StatusCode::kResourceExhausted))
        << r.status();
  }
}

TEST_F(CoordinatorTest, Join_UnsupportedSettings_ReturnInvalidArgument) {
  JoinRequestParams big_chunk = Params("m");
  big_chunk.settings.chunk_elements =
      coordinator_->options().max_chunk_elements + 1;
  EXPECT_EQ(JoinCode("j", big_chunk), absl::StatusCode::kInvalidArgument);
  JoinRequestParams fp16 = Params("m");
  fp16.settings.wire_dtype = DType::kFloat16;
  EXPECT_EQ(JoinCode("j", fp16), absl::StatusCode::kInvalidArgument);
  JoinRequestParams mode = Params("m");
  mode.settings.mode = static_cast<AveragingMode>(7);
  EXPECT_EQ(JoinCode("j", mode), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, Join_FirstMemberFixesSettings_DefaultsFillTheRest) {
  JoinRequestParams p = Params("m");
  p.settings.local_sgd_steps = 16;
  p.settings.chunk_elements = 0;
  p.settings.wire_dtype = DType::kBFloat16;
  absl::StatusOr<JoinResult> r = coordinator_->Join("j", p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->settings.local_sgd_steps, 16u);
  EXPECT_EQ(r->settings.chunk_elements,
            coordinator_->options().default_settings.chunk_elements);
  EXPECT_EQ(r->settings.wire_dtype, DType::kBFloat16);
  EXPECT_EQ(r->settings.mode, AveragingMode::kMean);
  // A later member that asks for nothing gets the job's settings.
  JoinRequestParams q = Params("n");
  q.settings = JobSettings();
  absl::StatusOr<JoinResult> r2 = coordinator_->Join("j", q);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->settings.local_sgd_steps, 16u);
  EXPECT_EQ(r2->settings.wire_dtype, DType::kBFloat16);
}

TEST_F(CoordinatorTest,
       Join_LayoutMismatch_ReturnsFailedPreconditionNamingTensor) {
  const Layout job_layout =
      MakeFloatLayout({{"fc.weight", {4, 3}}, {"fc.bias", {4}}});
  ASSERT_EQ(JoinCode("j", Params("a", 1, job_layout)), absl::StatusCode::kOk);

  struct Case {
    Layout layout;
    std::string must_name;
  };
  std::vector<Case> cases = {
      {MakeFloatLayout({{"fc.weight", {4, 3}}, {"fc.bias", {5}}}), "fc.bias"},
      {MakeFloatLayout({{"fc.weight", {4, 3}}, {"fc2.bias", {4}}}), "fc2.bias"},
      {MakeFloatLayout({{"fc.weight", {3, 4}}, {"fc.bias", {4}}}), "fc.weight"},
      {MakeLayout({TensorSpec{"fc.weight", {4, 3}, DType::kBFloat16},
                   TensorSpec{"fc.bias", {4}, DType::kFloat32}}),
       "fc.weight"},
      {MakeFloatLayout({{"fc.bias", {4}}, {"fc.weight", {4, 3}}}), "fc.weight"},
  };
  for (const Case& c : cases) {
    const absl::Status s =
        coordinator_->Join("j", Params("b", 1, c.layout)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.must_name;
    EXPECT_THAT(s.message(), HasSubstr(c.must_name));
  }
  // An extra or missing tensor is refused too.
  EXPECT_EQ(JoinCode("j", Params("b", 1,
                                 MakeFloatLayout({{"fc.weight", {4, 3}},
                                                  {"fc.bias", {4}},
                                                  {"extra", {1}}}))),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      JoinCode("j", Params("b", 1, MakeFloatLayout({{"fc.weight", {4, 3}}}))),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(coordinator_->FindJob("j").value()->num_members(), 1u);
}

TEST_F(CoordinatorTest, Join_SettingsMismatch_ReturnsFailedPrecondition) {
  JoinRequestParams first = Params("a");
  first.settings.local_sgd_steps = 8;
  first.settings.wire_dtype = DType::kFloat32;
  ASSERT_EQ(JoinCode("j", first), absl::StatusCode::kOk);

  JoinRequestParams k = Params("b");
  k.settings.local_sgd_steps = 16;
  EXPECT_EQ(JoinCode("j", k), absl::StatusCode::kFailedPrecondition);
  JoinRequestParams wire = Params("b");
  wire.settings.wire_dtype = DType::kBFloat16;
  const absl::Status s = coordinator_->Join("j", wire).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("bfloat16"));
  JoinRequestParams chunk = Params("b");
  chunk.settings.chunk_elements = 8;
  EXPECT_EQ(JoinCode("j", chunk), absl::StatusCode::kFailedPrecondition);

  // Zero fields mean "no preference" and match anything; same values match.
  JoinRequestParams none = Params("b");
  none.settings = JobSettings();
  EXPECT_EQ(JoinCode("j", none), absl::StatusCode::kOk);
  JoinRequestParams same = first;
  same.member_name = "c";
  EXPECT_EQ(JoinCode("j", same), absl::StatusCode::kOk);
}

TEST_F(CoordinatorTest, Join_MaxJobs_ReturnsResourceExhausted) {
  CoordinatorOptions options;
  options.max_jobs = 2;
  Init(options);
  ASSERT_EQ(JoinCode("j1", Params("m")), absl::StatusCode::kOk);
  ASSERT_EQ(JoinCode("j2", Params("m")), absl::StatusCode::kOk);
  EXPECT_EQ(JoinCode("j3", Params("m")), absl::StatusCode::kResourceExhausted);
  // Existing jobs still take members.
  EXPECT_EQ(JoinCode("j1", Params("n")), absl::StatusCode::kOk);
  EXPECT_EQ(coordinator_->Jobs().size(), 2u);
}

TEST_F(CoordinatorTest, Join_MaxMembers_ReturnsResourceExhausted) {
  CoordinatorOptions options;
  options.policy.max_members = 3;
  Init(options);
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_EQ(JoinCode("j", Params(name)), absl::StatusCode::kOk) << name;
  }
  EXPECT_EQ(JoinCode("j", Params("d")), absl::StatusCode::kResourceExhausted);
  // The limit is per job.
  EXPECT_EQ(JoinCode("other", Params("d")), absl::StatusCode::kOk);
}

// --- Jobs
// ----------------------------------------------------------------------

TEST_F(CoordinatorTest,
       FindJob_UnknownOrMalformed_ReturnsNotFoundOrInvalidArgument) {
  EXPECT_EQ(coordinator_->FindJob("nope").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->FindJob("bad id").status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(JoinCode("yes", Params("m")), absl::StatusCode::kOk);
  absl::StatusOr<std::shared_ptr<Job>> job = coordinator_->FindJob("yes");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ((*job)->id(), "yes");
}

TEST_F(CoordinatorTest, Jobs_SortedById) {
  for (const char* id : {"zeta", "alpha", "Mid", "beta"}) {
    ASSERT_EQ(JoinCode(id, Params("m")), absl::StatusCode::kOk);
  }
  std::vector<std::string> ids;
  for (const auto& job : coordinator_->Jobs()) ids.push_back(job->id());
  EXPECT_THAT(ids, ::testing::ElementsAre("Mid", "alpha", "beta", "zeta"));
}

TEST_F(CoordinatorTest, Jobs_AreIsolated) {
  // Same member name and layout in two jobs: two distinct members.
  absl::StatusOr<JoinResult> x = coordinator_->Join("x", Params("m"));
  absl::StatusOr<JoinResult> y = coordinator_->Join("y", Params("m"));
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_NE(x->member_id, y->member_id);
  std::shared_ptr<Job> jx = coordinator_->FindJob("x").value();
  std::shared_ptr<Job> jy = coordinator_->FindJob("y").value();
  const uint64_t n = TotalElements(SmallLayout());
  Seed("x", x->member_id, std::vector<float>(n, 1.0f));
  // A member of x is unknown to y.
  SyncCapture capture;
  EXPECT_EQ(jy->BeginSync(x->member_id, 0, capture.Callback()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(jy->GetState(x->member_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(jy->Heartbeat(x->member_id).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(jy->Leave(x->member_id).ok());
  EXPECT_EQ(jx->num_members(), 1u) << "Leave on job y removed a member of x";
  // y has no state; x's is untouched by y's seed.
  EXPECT_EQ(jy->GetState(y->member_id).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Seed("y", y->member_id, std::vector<float>(n, 2.0f));
  EXPECT_EQ(jx->GetState(x->member_id).value()->values,
            std::vector<float>(n, 1.0f));
  EXPECT_EQ(jy->GetState(y->member_id).value()->values,
            std::vector<float>(n, 2.0f));
}

TEST_F(CoordinatorTest, Tick_ExpiresLeasesInEveryJob) {
  absl::StatusOr<JoinResult> x = coordinator_->Join("x", Params("m"));
  absl::StatusOr<JoinResult> y = coordinator_->Join("y", Params("m"));
  ASSERT_TRUE(x.ok() && y.ok());
  const absl::Duration ttl = coordinator_->options().policy.lease_ttl;
  clock_.Advance(ttl / 2);
  ASSERT_TRUE(coordinator_->FindJob("y").value()->Heartbeat(y->member_id).ok());
  clock_.Advance(ttl / 2 + absl::Seconds(1));
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->FindJob("x").value()->num_members(), 0u);
  EXPECT_EQ(coordinator_->FindJob("y").value()->num_members(), 1u);
}

TEST_F(CoordinatorTest, Stop_FailsPendingSyncsInEveryJobAndRefusesJoin) {
  absl::StatusOr<JoinResult> x = coordinator_->Join("x", Params("m"));
  absl::StatusOr<JoinResult> y = coordinator_->Join("y", Params("m"));
  ASSERT_TRUE(x.ok() && y.ok());
  SyncCapture cx, cy;
  auto sx = coordinator_->FindJob("x").value()->BeginSync(x->member_id, 0,
                                                          cx.Callback());
  auto sy = coordinator_->FindJob("y").value()->BeginSync(y->member_id, 0,
                                                          cy.Callback());
  ASSERT_TRUE(sx.ok() && sy.ok());
  coordinator_->Stop();
  EXPECT_EQ(cx.result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cy.result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(JoinCode("x", Params("n")), absl::StatusCode::kUnavailable);
  EXPECT_EQ(JoinCode("new", Params("n")), absl::StatusCode::kUnavailable);
  coordinator_->Stop();
  EXPECT_EQ(cx.calls(), 1);
  EXPECT_EQ(cy.calls(), 1);
}

TEST_F(CoordinatorTest, Destructor_FailsPendingSyncsWithUnavailable) {
  absl::StatusOr<JoinResult> x = coordinator_->Join("x", Params("m"));
  ASSERT_TRUE(x.ok());
  SyncCapture capture;
  absl::StatusOr<std::unique_ptr<SyncSession>> s =
      coordinator_->FindJob("x").value()->BeginSync(x->member_id, 0,
                                                    capture.Callback());
  ASSERT_TRUE(s.ok());
  coordinator_.reset();
  ASSERT_EQ(capture.calls(), 1);
  EXPECT_EQ(capture.result().status().code(), absl::StatusCode::kUnavailable);
  // The session outlives the coordinator safely.
  EXPECT_EQ((*s)->AddChunk(0, std::string(16, '\0')).code(),
            absl::StatusCode::kUnavailable);
  s->reset();
}

// --- Concurrency smoke test
// --------------------------------------------------------

// N threads, each driving its own member through R rounds at once. Member i
// has weight i + 1 and sends r + i + (j % 7): the weighted sum is an exact
// integer in fp32, so the mean is that sum divided by the total weight, as
// fp32 divides it. Threads meet only through the Sync callbacks.
class ConcurrencyTest
    : public CoordinatorTest,
      public ::testing::WithParamInterface<std::tuple<int, int>> {};

TEST_P(ConcurrencyTest, ConcurrentMembers_ManyRounds_ResultsExact) {
  const int members = std::get<0>(GetParam());
  const int rounds = std::get<1>(GetParam());
  const Layout layout = MakeFloatLayout({{"w", {33, 31}}, {"b", {13}}});
  const uint64_t n = TotalElements(layout);  // 1036: 11 chunks of 100, last 36
  std::vector<MemberId> ids;
  for (int i = 0; i < members; ++i) {
    JoinRequestParams p = Params(absl::StrCat("m", i), 1, layout);
    p.settings.chunk_elements = 100;
    p.weight = i + 1;
    absl::StatusOr<JoinResult> r = coordinator_->Join("job", p);
    ASSERT_TRUE(r.ok()) << r.status();
    ids.push_back(r->member_id);
  }
  std::shared_ptr<Job> job = coordinator_->FindJob("job").value();
  const ChunkGeometry geometry = job->geometry();
  ASSERT_EQ(geometry.num_chunks(), 11u);
  Seed("job", ids[0], std::vector<float>(n, 0.0f));

  const float total_weight = static_cast<float>(members * (members + 1) / 2);
  auto expected = [&](int r, size_t j) {
    int64_t sum = 0;
    for (int i = 0; i < members; ++i)
      sum += (i + 1) * (r + i + static_cast<int>(j % 7));
    return static_cast<float>(sum) / total_weight;
  };

  std::vector<std::string> failures(members);
  std::vector<std::thread> threads;
  for (int i = 0; i < members; ++i) {
    threads.emplace_back([&, i] {
      std::vector<float> values(n);
      for (int r = 1; r <= rounds; ++r) {
        for (size_t j = 0; j < n; ++j) {
          values[j] = static_cast<float>(r + i + static_cast<int>(j % 7));
        }
        SyncCapture capture;
        absl::StatusOr<std::unique_ptr<SyncSession>> session =
            job->BeginSync(ids[i], static_cast<RoundId>(r), capture.Callback());
        if (!session.ok()) {
          failures[i] =
              absl::StrCat("round ", r, ": ", session.status().ToString());
          break;
        }
        for (uint32_t k = 0; k < geometry.num_chunks(); ++k) {
          const uint32_t c =
              (k + static_cast<uint32_t>(i + r)) % geometry.num_chunks();
          absl::Status s = (*session)->AddChunk(
              c, EncodeChunk(values, geometry, c, DType::kFloat32));
          if (!s.ok()) {
            failures[i] =
                absl::StrCat("round ", r, " chunk ", c, ": ", s.ToString());
            break;
          }
          if (k == 3) coordinator_->Tick();  // timers run concurrently too
        }
        if (!failures[i].empty()) break;
        capture.Wait();
        absl::StatusOr<SyncResult> result = capture.result();
        if (!result.ok()) {
          failures[i] =
              absl::StrCat("round ", r, ": ", result.status().ToString());
          break;
        }
        if (result->round != static_cast<RoundId>(r) || !result->contributed ||
            result->contributors != static_cast<uint32_t>(members)) {
          failures[i] = absl::StrCat("round ", r, ": round ", result->round,
                                     " contributed ", result->contributed,
                                     " contributors ", result->contributors);
          break;
        }
        for (size_t j = 0; j < n; ++j) {
          if (result->state->values[j] != expected(r, j)) {
            failures[i] =
                absl::StrCat("round ", r, " element ", j, ": ",
                             result->state->values[j], " != ", expected(r, j));
            break;
          }
        }
        if (!failures[i].empty()) break;
      }
      // Whatever happened, stop holding the others up.
      if (!failures[i].empty()) (void)job->Leave(ids[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < members; ++i) {
    EXPECT_EQ(failures[i], "") << "member " << i;
  }
  EXPECT_EQ(job->Status(1).state_round, static_cast<RoundId>(rounds));
}

INSTANTIATE_TEST_SUITE_P(MembersAndRounds, ConcurrencyTest,
                         ::testing::Values(std::make_tuple(2, 40),
                                           std::make_tuple(4, 30),
                                           std::make_tuple(8, 15)),
                         [](const auto& info) {
                           return absl::StrCat("N", std::get<0>(info.param),
                                               "_R", std::get<1>(info.param));
                         });

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// A replica of a sharded coordinator holds only its chunks: SmallLayout's 23
// elements in chunks of 4 are 6 chunks; shard 1 of 2 owns chunks 1, 3, 5
// (4 + 4 + 3 elements).
TEST_F(CoordinatorTest, Join_ShardedReplica_HoldsOnlyItsChunks) {
  CoordinatorOptions options;
  options.shard = ShardSpec{1, 2};
  Init(options);
  absl::StatusOr<JoinResult> r = coordinator_->Join("job", Params("a"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->geometry.num_elements(), 11u);
  EXPECT_EQ(r->geometry.num_chunks(), 3u);
  EXPECT_EQ(r->geometry.Size(2), 3u);
}

TEST_F(CoordinatorTest, Join_ShardOwningNoChunk_ReturnsFailedPrecondition) {
  CoordinatorOptions options;
  options.shard = ShardSpec{6, 7};  // 6 chunks: shard 6 owns none
  Init(options);
  absl::StatusOr<JoinResult> r = coordinator_->Join("job", Params("a"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("smaller chunk_elements"));
}

TEST(CoordinatorOptionsTest, InvalidShard_ReturnsInvalidArgument) {
  CoordinatorOptions options;
  options.shard = ShardSpec{2, 2};
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  options.shard = ShardSpec{0, 0};
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace localsgd

namespace localsgd {
namespace {

// Jobs whose members all left were once never reclaimed, so with
// --max_jobs=2 two such jobs blocked a third until a restart.
class IdleJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(
        ::testing::TempDir(), "/lsgd-idle-", getpid(), "-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    store_ = *CheckpointStore::Open(dir_);
  }
  void TearDown() override {
    coordinator_.reset();
    std::filesystem::remove_all(dir_);
  }

  void Start(bool keep_checkpoints = false) {
    coordinator_.reset();
    CoordinatorOptions options;
    options.clock = &clock_;
    options.max_jobs = 2;
    options.job_idle_ttl = absl::Minutes(10);
    options.keep_checkpoints = keep_checkpoints;
    options.checkpoint_store = store_.get();
    options.policy.lease_ttl = absl::Minutes(1);
    coordinator_ = *Coordinator::Create(options);
  }

  static JoinRequestParams Params(const std::string& name) {
    return testing_util::SmallJoin(name, /*incarnation=*/7);
  }

  // Joins `job` as `name`, seeds it (so that it has a checkpoint).
  MemberId JoinAndSeed(const std::string& job, const std::string& name) {
    absl::StatusOr<JoinResult> j = coordinator_->Join(job, Params(name));
    EXPECT_TRUE(j.ok()) << j.status();
    std::shared_ptr<Job> found = coordinator_->FindJob(job).value();
    SyncCapture capture;
    auto s = found->BeginSync(j->member_id, 0, capture.Callback()).value();
    const std::vector<float> values(TotalElements(SmallLayout()), 1.5f);
    for (uint32_t i = 0; i < found->geometry().num_chunks(); ++i) {
      EXPECT_TRUE(s->AddChunk(i, EncodeChunk(values, found->geometry(), i,
                                             DType::kFloat32))
                      .ok());
    }
    EXPECT_TRUE(capture.fired());
    return j->member_id;
  }

  std::vector<std::string> Checkpointed() {
    coordinator_->FlushCheckpoints();
    absl::StatusOr<std::vector<JobCheckpoint>> all = store_->LoadAll();
    EXPECT_TRUE(all.ok()) << all.status();
    std::vector<std::string> ids;
    if (all.ok()) {
      for (const JobCheckpoint& c : *all) ids.push_back(c.job_id);
    }
    return ids;
  }

  FakeClock clock_;
  std::string dir_;
  std::unique_ptr<CheckpointStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(IdleJobTest, EmptyForTheTtl_RemovedWithItsCheckpoint_FreesItsSlot) {
  Start();
  const MemberId a = JoinAndSeed("a", "m");
  const MemberId b = JoinAndSeed("b", "m");
  EXPECT_EQ(coordinator_->Join("c", Params("m")).status().code(),
            absl::StatusCode::kResourceExhausted);  // max_jobs
  ASSERT_TRUE(coordinator_->FindJob("a").value()->Leave(a).ok());
  ASSERT_TRUE(coordinator_->FindJob("b").value()->Leave(b).ok());
  EXPECT_THAT(Checkpointed(), ::testing::ElementsAre("a", "b"));

  clock_.Advance(absl::Minutes(10) - absl::Seconds(1));
  coordinator_->Tick();
  EXPECT_TRUE(coordinator_->FindJob("a").ok()) << "reclaimed before its TTL";
  clock_.Advance(absl::Seconds(1));
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->FindJob("a").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->FindJob("b").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(Checkpointed(), ::testing::IsEmpty());
  // The slots are free again, and a reclaimed job's id can start afresh.
  EXPECT_TRUE(coordinator_->Join("c", Params("m")).ok());
  absl::StatusOr<JoinResult> again = coordinator_->Join("a", Params("m"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->has_state);
}

TEST_F(IdleJobTest, KeepCheckpoints_JobRemovedCheckpointKeptAndRestorable) {
  Start(/*keep_checkpoints=*/true);
  const MemberId a = JoinAndSeed("a", "m");
  ASSERT_TRUE(coordinator_->FindJob("a").value()->Leave(a).ok());
  clock_.Advance(absl::Minutes(10));
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->FindJob("a").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(Checkpointed(), ::testing::ElementsAre("a"));
  Start(/*keep_checkpoints=*/true);  // a restart restores it
  EXPECT_TRUE(coordinator_->FindJob("a").ok());
}

TEST_F(IdleJobTest, JobWithAMember_IsNeverReclaimed) {
  Start();
  const MemberId a = JoinAndSeed("a", "m");
  for (int i = 0; i < 30; ++i) {
    clock_.Advance(absl::Seconds(50));  // within the member's lease
    ASSERT_TRUE(coordinator_->FindJob("a").value()->Heartbeat(a).ok());
    coordinator_->Tick();
  }
  EXPECT_TRUE(coordinator_->FindJob("a").ok());
  EXPECT_THAT(Checkpointed(), ::testing::ElementsAre("a"));
}

TEST_F(IdleJobTest, RestoredJobWhoseMembersNeverReturn_IsReclaimed) {
  Start();
  JoinAndSeed("a", "m");
  Start();  // restart: "a" restored, its member gone with the old process
  ASSERT_TRUE(coordinator_->FindJob("a").ok());
  clock_.Advance(absl::Minutes(10));
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->FindJob("a").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(Checkpointed(), ::testing::IsEmpty());
}

TEST_F(IdleJobTest, RetiredJob_RefusesJoinWithUnavailable) {
  Start();
  const MemberId a = JoinAndSeed("a", "m");
  std::shared_ptr<Job> job = coordinator_->FindJob("a").value();
  ASSERT_TRUE(job->Leave(a).ok());
  // A Join that found the job just before it was retired is told to retry.
  ASSERT_TRUE(job->RetireIfEmptyFor(clock_.Now(), absl::ZeroDuration()));
  absl::StatusOr<JoinResult> late = job->Join(Params("late"));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(late.status().message(), HasSubstr("retry the Join"));
}

}  // namespace
}  // namespace localsgd
