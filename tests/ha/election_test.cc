// The lease fence (pure, a fake clock) and the elector against a real etcd
// (tests/ha/etcd_process.h): one primary per (group, shard), take-over on a
// clean stop, the fence when etcd stops answering, independence of keys.
#include "ha/election.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ha/etcd_client.h"
#include "src/clock.h"
#include "tests/ha/etcd_process.h"

namespace localsgd {
namespace {

using ha_test::EtcdProcess;
using ::testing::HasSubstr;

absl::Duration Ms(int64_t ms) { return absl::Milliseconds(ms); }

// ---- The fence, pure ----

TEST(LeaseFenceTest, SafetyMargin) {
  EXPECT_EQ(LeaseFence::SafetyMargin(absl::Seconds(2)), Ms(200));
  EXPECT_EQ(LeaseFence::SafetyMargin(absl::Seconds(1)), Ms(100));
  EXPECT_EQ(LeaseFence::SafetyMargin(Ms(300)), Ms(50));  // floor
  EXPECT_EQ(LeaseFence::SafetyMargin(Ms(60)), Ms(30));   // at most ttl/2
}

TEST(LeaseFenceTest, ServingEndsAtServeUntilWithoutRenewal) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  LeaseFence fence;
  EXPECT_FALSE(fence.Serving(t0));
  EXPECT_EQ(fence.serve_until(), absl::InfinitePast());
  fence.Arm(t0, absl::Seconds(2));
  EXPECT_EQ(fence.serve_until(), t0 + Ms(1800));
  EXPECT_EQ(fence.last_sent(), t0);
  EXPECT_TRUE(fence.Serving(clock.Now()));
  clock.Advance(Ms(1799));
  EXPECT_TRUE(fence.Serving(clock.Now()));
  clock.Advance(Ms(1));  // exactly serve_until
  EXPECT_FALSE(fence.Serving(clock.Now()));
  clock.Advance(absl::Hours(1));
  EXPECT_FALSE(fence.Serving(clock.Now()));
}

// Steps applied in order to one fence armed at t0 with a 2 s TTL (margin
// 200 ms, so serve_until starts at t0 + 1800 ms). Times in ms after t0.
struct RenewStep {
  const char* what;
  int64_t sent;
  int64_t ttl;
  int64_t now;  // when the response is applied (its receipt)
  bool applied;
  int64_t serve_until;  // after the step
};

TEST(LeaseFenceTest, RenewalTable) {
  const RenewStep steps[] = {
      {"renewal extends from its send time, not its receipt", 600, 2000, 1500,
       true, 2400},
      {"a later one", 1000, 2000, 1100, true, 2800},
      {"stale (sent before the last applied), would move back", 700, 2000, 1200,
       false, 2800},
      {"stale, with a longer TTL, would move forward wrongly", 700, 5000, 1300,
       false, 2800},
      {"a smaller TTL never moves serve_until back", 1400, 1000, 1450, true,
       2800},
      {"same send time as the last applied", 1400, 2000, 1500, true, 3200},
      {"comes back at serve_until: the fence has run out", 3000, 2000, 3200,
       false, 3200},
      {"nothing after running out, even sent later", 3300, 2000, 3400, false,
       3200},
  };
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  LeaseFence fence;
  fence.Arm(t0, absl::Seconds(2));
  for (const RenewStep& step : steps) {
    SCOPED_TRACE(step.what);
    const absl::Time now = t0 + Ms(step.now);
    EXPECT_EQ(fence.Renew(t0 + Ms(step.sent), Ms(step.ttl), now), step.applied);
    EXPECT_EQ(fence.serve_until(), t0 + Ms(step.serve_until));
    EXPECT_EQ(fence.Serving(now), now < t0 + Ms(step.serve_until));
  }
  // Arm starts a new lease's fence.
  fence.Arm(t0 + Ms(4000), absl::Seconds(2));
  EXPECT_TRUE(fence.Serving(t0 + Ms(4000)));
  EXPECT_EQ(fence.serve_until(), t0 + Ms(5800));
  fence.Disarm();
  EXPECT_FALSE(fence.Serving(t0 + Ms(4000)));
  EXPECT_FALSE(fence.Renew(t0 + Ms(4100), absl::Seconds(2), t0 + Ms(4200)));
}

// ---- Options ----

TEST(ElectorOptionsTest, Validate) {
  ElectorOptions options;
  options.group = "job-1.v2_a";
  options.advertise = "10.0.0.1:50051";
  options.etcd.endpoints = {"127.0.0.1:2379"};
  EXPECT_TRUE(options.Validate().ok());
  for (const char* group : {"", "a/b", "a b", "ü", "*"}) {
    ElectorOptions bad = options;
    bad.group = group;
    EXPECT_FALSE(bad.Validate().ok()) << group;
  }
  ElectorOptions bad = options;
  bad.group = std::string(64, 'a');
  EXPECT_FALSE(bad.Validate().ok());
  bad.group = std::string(63, 'a');
  EXPECT_TRUE(bad.Validate().ok());
  bad = options;
  bad.advertise = "host";
  EXPECT_FALSE(bad.Validate().ok());
  bad = options;
  bad.lease_ttl = Ms(500);
  EXPECT_FALSE(bad.Validate().ok());
  bad = options;
  bad.etcd.endpoints.clear();
  EXPECT_FALSE(bad.Validate().ok());
  EXPECT_FALSE(Elector::Create(bad).ok());
  EXPECT_EQ(ElectionKey("g", 3), "/localsgd/g/shard/3/primary");
  EXPECT_EQ(SyncStandbysKey("g", 3), "/localsgd/g/shard/3/sync");
}

TEST(SyncStandbysTest, FormatAndParse) {
  const SyncStandbys sync{12, {"a:1", "b.local:2"}};
  EXPECT_EQ(FormatSyncStandbys(sync), "epoch 12\na:1\nb.local:2\n");
  absl::StatusOr<SyncStandbys> back =
      ParseSyncStandbys(FormatSyncStandbys(sync));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, 12);
  EXPECT_EQ(back->standbys, sync.standbys);
  back = ParseSyncStandbys("epoch 3\n");
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->standbys.empty());
  for (const char* bad : {"", "a:1\n", "epoch x\n", "epoch 0\n", "epoch -2\n",
                          "epoch 3\na b\n"}) {
    EXPECT_EQ(ParseSyncStandbys(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// ---- The elector, against etcd ----

// on_change's reports with the time each came.
class RoleLog {
 public:
  struct Entry {
    absl::Time at;
    ElectorRole role;
  };
  std::function<void(const ElectorRole&)> Callback() {
    return [this](const ElectorRole& role) {
      absl::MutexLock lock(&mu_);
      entries_.push_back({absl::Now(), role});
    };
  }
  std::vector<Entry> entries() const {
    absl::MutexLock lock(&mu_);
    return entries_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_;
};

void ExpectEpochsNeverDecrease(const RoleLog& log) {
  int64_t epoch = 0;
  for (const RoleLog::Entry& entry : log.entries()) {
    EXPECT_GE(entry.role.epoch, epoch);
    epoch = entry.role.epoch;
  }
}

// Polls cond every 2 ms until it holds (true) or timeout passes (false).
bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!cond()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(Ms(2));
  }
  return true;
}

class ElectorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Available()) {
      GTEST_SKIP() << ha_test::kEtcdBinary << " not installed";
    }
    auto etcd = EtcdProcess::Start();
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
  }

  std::unique_ptr<Elector> Make(const std::string& group, uint32_t shard,
                                const std::string& advertise, RoleLog* log,
                                absl::Duration ttl = absl::Seconds(2)) {
    ElectorOptions options;
    options.group = group;
    options.shard = shard;
    options.advertise = advertise;
    options.lease_ttl = ttl;
    options.etcd.endpoints = {etcd_->endpoint()};
    options.etcd.rpc_timeout = Ms(500);
    if (log != nullptr) options.on_change = log->Callback();
    auto elector = Elector::Create(options);
    CHECK(elector.ok()) << elector.status();
    return *std::move(elector);
  }

  // Waits until exactly one of a, b is primary and the other its standby
  // at its epoch; returns the primary's index (0: a), or -1.
  static int WaitForPrimaryAndStandby(Elector& a, Elector& b,
                                      const std::string& address_a,
                                      const std::string& address_b) {
    int primary = -1;
    WaitUntil(
        [&] {
          ElectorRole ra = a.role(), rb = b.role();
          if (ra.kind == ElectorRole::kPrimary &&
              rb.kind == ElectorRole::kStandby && rb.primary == address_a &&
              rb.epoch == ra.epoch) {
            primary = 0;
          } else if (rb.kind == ElectorRole::kPrimary &&
                     ra.kind == ElectorRole::kStandby &&
                     ra.primary == address_b && ra.epoch == rb.epoch) {
            primary = 1;
          }
          return primary >= 0;
        },
        absl::Seconds(5));
    return primary;
  }

  std::unique_ptr<EtcdProcess> etcd_;
};

// The synchronous-standby list: a candidate it does not name does not
// campaign (the key stays absent), one it names does; only the primary of
// the epoch it names writes it.
TEST_F(ElectorTest, OnlyASynchronousStandbyCampaigns) {
  auto etcd = EtcdClient::Create({{etcd_->endpoint()}, absl::Seconds(1)});
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string sync_key = SyncStandbysKey("g", 0);
  ASSERT_TRUE(
      (*etcd)->Put(sync_key, FormatSyncStandbys({7, {"b.local:2"}})).ok());
  absl::StatusOr<EtcdGetResult> before = (*etcd)->Get(ElectionKey("g", 0));
  ASSERT_TRUE(before.ok());
  RoleLog log_a;
  auto a = Make("g", 0, "a.local:1", &log_a);
  a->Start();
  // Two leases' time and the primary's key never appears: a waits.
  absl::StatusOr<EtcdChange> change = (*etcd)->WaitForChange(
      ElectionKey("g", 0), before->revision, absl::Seconds(4));
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(change->kind, EtcdChange::kTimeout)
      << "a candidate the list does not name campaigned";
  EXPECT_EQ(a->role().kind, ElectorRole::kCandidate);
  // b, which it names, wins; a follows it.
  auto b = Make("g", 0, "b.local:2", nullptr);
  b->Start();
  ASSERT_EQ(WaitForPrimaryAndStandby(*a, *b, "a.local:1", "b.local:2"), 1);
  const int64_t epoch = b->role().epoch;
  // Its list; a's write for an epoch it does not hold is refused.
  ASSERT_TRUE(b->PublishSyncStandbys(epoch, {"a.local:1"},
                                     absl::Now() + absl::Seconds(2))
                  .ok());
  EXPECT_EQ(
      a->PublishSyncStandbys(epoch + 1, {}, absl::Now() + absl::Seconds(2))
          .code(),
      absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<EtcdGetResult> got = (*etcd)->Get(sync_key);
  ASSERT_TRUE(got.ok() && got->kv.has_value());
  EXPECT_EQ(got->kv->value, FormatSyncStandbys({epoch, {"a.local:1"}}));
  // Now named, a takes over when b stops.
  b->Stop();
  EXPECT_TRUE(WaitUntil([&] { return a->role().kind == ElectorRole::kPrimary; },
                        absl::Seconds(2)));
  a->Stop();
}

// Each write of the synchronous-standby list names the revision it
// replaces: a write that lands after a later one (its caller gave up on it
// and wrote again) is refused, and the newer list stays. A list the
// primary did not write (such a write landing before its next): the next
// write says so, the one after writes over it.
TEST_F(ElectorTest, ALateListWriteCannotReplaceANewerOne) {
  auto etcd = EtcdClient::Create({{etcd_->endpoint()}, absl::Seconds(1)});
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string sync_key = SyncStandbysKey("g", 0);
  auto a = Make("g", 0, "a.local:1", nullptr);
  a->Start();
  ASSERT_TRUE(WaitUntil([&] { return a->role().kind == ElectorRole::kPrimary; },
                        absl::Seconds(5)));
  const int64_t epoch = a->role().epoch;
  auto publish = [&](std::vector<std::string> standbys) {
    return a->PublishSyncStandbys(epoch, standbys,
                                  absl::Now() + absl::Seconds(2));
  };
  auto list = [&]() -> std::string {
    absl::StatusOr<EtcdGetResult> got = (*etcd)->Get(sync_key);
    return got.ok() && got->kv.has_value() ? got->kv->value : "(none)";
  };
  ASSERT_TRUE(publish({"b.local:2"}).ok());
  absl::StatusOr<EtcdGetResult> first = (*etcd)->Get(sync_key);
  ASSERT_TRUE(first.ok() && first->kv.has_value());
  ASSERT_TRUE(publish({}).ok());
  // What a write meant to replace the first list, landing now, does.
  absl::StatusOr<int64_t> late = (*etcd)->PutIfCreated(
      sync_key, FormatSyncStandbys({epoch, {"b.local:2"}}), ElectionKey("g", 0),
      epoch, first->kv->mod_revision);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, 0) << "a late write replaced a newer list";
  EXPECT_EQ(list(), FormatSyncStandbys({epoch, {}}));
  // A list this primary did not write.
  ASSERT_TRUE(
      (*etcd)->Put(sync_key, FormatSyncStandbys({epoch, {"c.local:3"}})).ok());
  const absl::Status changed = publish({"b.local:2"});
  EXPECT_EQ(changed.code(), absl::StatusCode::kUnavailable) << changed;
  EXPECT_THAT(changed.message(),
              HasSubstr("changed since this primary last wrote it"));
  ASSERT_TRUE(publish({"b.local:2"}).ok());
  EXPECT_EQ(list(), FormatSyncStandbys({epoch, {"b.local:2"}}));
  a->Stop();
}

TEST_F(ElectorTest, OnePrimaryTheOtherStandbyThenTakeOverOnStop) {
  RoleLog log_a, log_b;
  auto a = Make("g", 0, "a.local:1", &log_a);
  auto b = Make("g", 0, "b.local:2", &log_b);
  a->Start();
  b->Start();
  const int first = WaitForPrimaryAndStandby(*a, *b, "a.local:1", "b.local:2");
  ASSERT_GE(first, 0) << "a: " << ElectorRoleKindName(a->role().kind)
                      << " b: " << ElectorRoleKindName(b->role().kind);
  Elector& primary = first == 0 ? *a : *b;
  Elector& standby = first == 0 ? *b : *a;
  const int64_t epoch = primary.role().epoch;
  EXPECT_GT(epoch, 0);
  EXPECT_TRUE(primary.Serving(absl::Now()));
  EXPECT_FALSE(standby.Serving(absl::Now()));
  // Renewals keep it primary past a TTL.
  ASSERT_FALSE(WaitUntil([&] { return !primary.Serving(absl::Now()); },
                         absl::Seconds(3)));
  EXPECT_EQ(primary.role().epoch, epoch);

  // A clean stop deletes the key (before Stop returns): the standby takes
  // over within a second, at a higher epoch.
  primary.Stop();
  const absl::Time stopped = absl::Now();
  EXPECT_EQ(primary.role().kind, ElectorRole::kCandidate);
  EXPECT_FALSE(primary.Serving(absl::Now()));
  ASSERT_TRUE(
      WaitUntil([&] { return standby.role().kind == ElectorRole::kPrimary; },
                absl::Seconds(1)))
      << ElectorRoleKindName(standby.role().kind);
  LOG(INFO) << "take-over " << (absl::Now() - stopped) << " after Stop";
  EXPECT_GT(standby.role().epoch, epoch);
  EXPECT_EQ(standby.role().primary, first == 0 ? "b.local:2" : "a.local:1");
  EXPECT_TRUE(standby.Serving(absl::Now()));
  primary.Stop();  // idempotent
  standby.Stop();
  EXPECT_EQ(standby.role().kind, ElectorRole::kCandidate);
  ExpectEpochsNeverDecrease(log_a);
  ExpectEpochsNeverDecrease(log_b);
  // The stopped primary reported its way down.
  const RoleLog& stopped_log = first == 0 ? log_a : log_b;
  ASSERT_FALSE(stopped_log.entries().empty());
  EXPECT_EQ(stopped_log.entries().back().role.kind, ElectorRole::kCandidate);
}

TEST_F(ElectorTest, PrimaryStopsServingByTheFenceWhenEtcdHangs) {
  RoleLog log_a, log_b;
  auto a = Make("g", 0, "a.local:1", &log_a);
  auto b = Make("g", 0, "b.local:2", &log_b);
  a->Start();
  b->Start();
  const int first = WaitForPrimaryAndStandby(*a, *b, "a.local:1", "b.local:2");
  ASSERT_GE(first, 0);
  Elector& primary = first == 0 ? *a : *b;
  const int64_t epoch = primary.role().epoch;
  const absl::Duration ttl = absl::Seconds(2);

  ASSERT_TRUE(etcd_->Pause().ok());
  const absl::Time paused = absl::Now();
  // Serving ends by the last successful renewal's send time + ttl (in fact
  // by serve_until, the margin before), whatever the hung calls do.
  absl::Time off = absl::InfiniteFuture();
  ASSERT_TRUE(WaitUntil(
      [&] {
        const absl::Time now = absl::Now();
        EXPECT_FALSE(a->Serving(now) && b->Serving(now));
        if (primary.Serving(now)) return false;
        off = now;
        return true;
      },
      ttl + absl::Seconds(1)));
  const absl::Time last_sent = primary.fence().last_sent();
  LOG(INFO) << "stopped serving " << (off - paused) << " after the pause, "
            << (off - last_sent) << " after the last renewal was sent";
  EXPECT_LE(off, last_sent + ttl);
  // The fence thread demotes it on time too.
  ASSERT_TRUE(
      WaitUntil([&] { return primary.role().kind != ElectorRole::kPrimary; },
                last_sent + ttl - absl::Now()));
  EXPECT_EQ(primary.role().kind, ElectorRole::kCandidate);

  // Keep etcd paused past the lease's expiry, then let it go: a new
  // election, at a higher epoch.
  absl::SleepFor(last_sent + ttl + Ms(300) - absl::Now());
  ASSERT_TRUE(etcd_->Resume().ok());
  ASSERT_TRUE(WaitUntil(
      [&] {
        const absl::Time now = absl::Now();
        EXPECT_FALSE(a->Serving(now) && b->Serving(now));
        return (a->Serving(now) && a->role().epoch > epoch) ||
               (b->Serving(now) && b->role().epoch > epoch);
      },
      absl::Seconds(10)));
  const int second = WaitForPrimaryAndStandby(*a, *b, "a.local:1", "b.local:2");
  ASSERT_GE(second, 0);
  a->Stop();
  b->Stop();
  ExpectEpochsNeverDecrease(log_a);
  ExpectEpochsNeverDecrease(log_b);
}

TEST_F(ElectorTest, ShardsAndGroupsAreIndependent) {
  auto g1s0 = Make("g1", 0, "h:1", nullptr);
  auto g1s1 = Make("g1", 1, "h:2", nullptr);
  auto g2s0 = Make("g2", 0, "h:3", nullptr);
  for (Elector* e : {g1s0.get(), g1s1.get(), g2s0.get()}) e->Start();
  ASSERT_TRUE(WaitUntil(
      [&] {
        const absl::Time now = absl::Now();
        return g1s0->Serving(now) && g1s1->Serving(now) && g2s0->Serving(now);
      },
      absl::Seconds(5)));
  EXPECT_NE(g1s0->key(), g1s1->key());
  EXPECT_NE(g1s0->key(), g2s0->key());
  EXPECT_NE(g1s0->role().epoch, g1s1->role().epoch);
  // Stopping one leaves the others serving.
  g1s1->Stop();
  EXPECT_TRUE(g1s0->Serving(absl::Now()));
  EXPECT_TRUE(g2s0->Serving(absl::Now()));
}

TEST_F(ElectorTest, StopWithoutStartAndStartAfterStop) {
  auto e = Make("g", 0, "h:1", nullptr);
  e->Stop();
  e->Stop();
  e->Start();  // nothing after Stop
  EXPECT_EQ(e->role().kind, ElectorRole::kCandidate);
  EXPECT_FALSE(e->Serving(absl::Now()));
}

TEST_F(ElectorTest, WaitsForEtcdThenWins) {
  ASSERT_TRUE(etcd_->Stop().ok());
  RoleLog log;
  auto e = Make("g", 0, "h:1", &log);
  e->Start();
  EXPECT_FALSE(WaitUntil([&] { return e->Serving(absl::Now()); }, Ms(500)));
  EXPECT_EQ(e->role().kind, ElectorRole::kCandidate);
  ASSERT_TRUE(etcd_->Restart().ok());
  ASSERT_TRUE(
      WaitUntil([&] { return e->Serving(absl::Now()); }, absl::Seconds(5)));
  e->Stop();
  ExpectEpochsNeverDecrease(log);
}

}  // namespace
}  // namespace localsgd
