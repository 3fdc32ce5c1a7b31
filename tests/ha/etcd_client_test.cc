// EtcdClient against a real etcd (tests/ha/etcd_process.h): every call,
// lease expiry, a create race, watches, a stopped or paused etcd, endpoint
// failover.
#include "ha/etcd_client.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "gtest/gtest.h"
#include "tests/ha/etcd_process.h"

namespace localsgd {
namespace {

using ha_test::EtcdProcess;

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Available()) {
      GTEST_SKIP() << ha_test::kEtcdBinary << " not installed";
    }
    auto etcd = EtcdProcess::Start();
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
  }

  std::unique_ptr<EtcdClient> Client(
      absl::Duration rpc_timeout = absl::Seconds(1)) {
    EtcdClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    options.rpc_timeout = rpc_timeout;
    auto client = EtcdClient::Create(options);
    CHECK(client.ok()) << client.status();
    return *std::move(client);
  }

  std::unique_ptr<EtcdProcess> etcd_;
};

TEST(EtcdClientOptionsTest, Validate) {
  EtcdClientOptions options;
  EXPECT_FALSE(options.Validate().ok());  // no endpoints
  options.endpoints = {"127.0.0.1:2379", "etcd-1.local:2379", "[::1]:2379"};
  EXPECT_TRUE(options.Validate().ok());
  for (const char* bad :
       {"127.0.0.1", ":2379", "host:0", "host:70000", "host:port", ""}) {
    options.endpoints = {bad};
    EXPECT_FALSE(options.Validate().ok()) << bad;
  }
  options.endpoints = {"127.0.0.1:2379"};
  options.rpc_timeout = absl::ZeroDuration();
  EXPECT_FALSE(options.Validate().ok());
  EXPECT_FALSE(EtcdClient::Create(options).ok());
}

TEST_F(EtcdClientTest, LeaseGrantKeepAliveRevoke) {
  auto client = Client();
  auto lease = client->GrantLease(absl::Seconds(3));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_NE(lease->id, 0);
  EXPECT_EQ(lease->ttl, absl::Seconds(3));
  auto ttl = client->KeepAliveOnce(lease->id);
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_EQ(*ttl, absl::Seconds(3));

  // A key under the lease goes with it.
  auto campaign = client->CreateIfAbsent("/t/leased", "v", lease->id);
  ASSERT_TRUE(campaign.ok()) << campaign.status();
  ASSERT_TRUE(campaign->won);
  ASSERT_TRUE(client->RevokeLease(lease->id).ok());
  auto got = client->Get("/t/leased");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->kv.has_value());
  EXPECT_EQ(client->KeepAliveOnce(lease->id).status().code(),
            absl::StatusCode::kNotFound);
  // Revoking again: already gone, OK.
  EXPECT_TRUE(client->RevokeLease(lease->id).ok());
  // A TTL under a second is rounded up to etcd's unit.
  auto short_lease = client->GrantLease(absl::Milliseconds(300));
  ASSERT_TRUE(short_lease.ok()) << short_lease.status();
  EXPECT_GE(short_lease->ttl, absl::Seconds(1));
}

TEST_F(EtcdClientTest, LeaseExpiresWithoutRenewal) {
  auto client = Client();
  const absl::Time granted_at = absl::Now();
  auto lease = client->GrantLease(absl::Seconds(1));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->ttl, absl::Seconds(1));  // etcd's minimum here (see header)
  auto campaign = client->CreateIfAbsent("/t/expiring", "v", lease->id);
  ASSERT_TRUE(campaign.ok() && campaign->won);

  // Not renewed: the key goes once etcd expires the lease (it checks every
  // 500 ms, so up to ttl + 0.5 s).
  const absl::Time deadline = granted_at + absl::Seconds(5);
  absl::Time gone_at = absl::InfiniteFuture();
  while (absl::Now() < deadline) {
    auto got = client->Get("/t/expiring");
    ASSERT_TRUE(got.ok()) << got.status();
    if (!got->kv.has_value()) {
      gone_at = absl::Now();
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_LT(gone_at, deadline) << "the key outlived its lease";
  EXPECT_GE(gone_at - granted_at, lease->ttl);
  LOG(INFO) << "lease of ttl " << lease->ttl << " expired after "
            << (gone_at - granted_at);
  auto renewed = client->KeepAliveOnce(lease->id);
  EXPECT_EQ(renewed.status().code(), absl::StatusCode::kNotFound)
      << renewed.status();
}

TEST_F(EtcdClientTest, CreateIfAbsentRaceHasOneWinner) {
  for (int round = 0; round < 5; ++round) {
    auto a = Client();
    auto b = Client();
    auto lease_a = a->GrantLease(absl::Seconds(5));
    auto lease_b = b->GrantLease(absl::Seconds(5));
    ASSERT_TRUE(lease_a.ok() && lease_b.ok());
    const std::string key = absl::StrCat("/t/race/", round);
    absl::StatusOr<EtcdCampaign> result_a, result_b;
    std::atomic<bool> go{false};
    std::thread ta([&] {
      while (!go) {
      }
      result_a = a->CreateIfAbsent(key, "a", lease_a->id);
    });
    std::thread tb([&] {
      while (!go) {
      }
      result_b = b->CreateIfAbsent(key, "b", lease_b->id);
    });
    go = true;
    ta.join();
    tb.join();
    ASSERT_TRUE(result_a.ok()) << result_a.status();
    ASSERT_TRUE(result_b.ok()) << result_b.status();
    EXPECT_NE(result_a->won, result_b->won);
    EXPECT_GT(result_a->create_revision, 0);
    EXPECT_EQ(result_a->create_revision, result_b->create_revision);
    const EtcdCampaign& loser = result_a->won ? *result_b : *result_a;
    EXPECT_EQ(loser.holder, result_a->won ? "a" : "b");
    EXPECT_EQ(loser.holder_lease, result_a->won ? lease_a->id : lease_b->id);
    auto got = a->Get(key);
    ASSERT_TRUE(got.ok() && got->kv.has_value());
    EXPECT_EQ(got->kv->create_revision, result_a->create_revision);
    EXPECT_EQ(got->kv->value, loser.holder);
  }
}

TEST_F(EtcdClientTest, CreateIfAbsentRepeatedByTheWinnerCountsAsWon) {
  // What a retry after a lost answer sees.
  auto client = Client();
  auto lease = client->GrantLease(absl::Seconds(5));
  ASSERT_TRUE(lease.ok());
  auto first = client->CreateIfAbsent("/t/again", "v", lease->id);
  auto second = client->CreateIfAbsent("/t/again", "v", lease->id);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(first->won);
  EXPECT_TRUE(second->won);
  EXPECT_EQ(first->create_revision, second->create_revision);
}

TEST_F(EtcdClientTest, PutGetDeleteIfCreated) {
  auto client = Client();
  auto missing = client->Get("/t/kv");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_FALSE(missing->kv.has_value());
  EXPECT_GT(missing->revision, 0);

  auto put = client->Put("/t/kv", "one");
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_GT(*put, missing->revision);
  auto put2 = client->Put("/t/kv", "two");
  ASSERT_TRUE(put2.ok());
  auto got = client->Get("/t/kv");
  ASSERT_TRUE(got.ok() && got->kv.has_value());
  EXPECT_EQ(got->kv->key, "/t/kv");
  EXPECT_EQ(got->kv->value, "two");
  EXPECT_EQ(got->kv->create_revision, *put);
  EXPECT_EQ(got->kv->mod_revision, *put2);
  EXPECT_EQ(got->kv->version, 2);
  EXPECT_EQ(got->kv->lease, 0);
  EXPECT_EQ(got->revision, *put2);

  // Only the creation we name.
  auto wrong = client->DeleteIfCreated("/t/kv", *put2);
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(*wrong);
  EXPECT_TRUE(client->Get("/t/kv")->kv.has_value());
  auto right = client->DeleteIfCreated("/t/kv", *put);
  ASSERT_TRUE(right.ok());
  EXPECT_TRUE(*right);
  EXPECT_FALSE(client->Get("/t/kv")->kv.has_value());
  auto again = client->DeleteIfCreated("/t/kv", *put);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);
}

TEST_F(EtcdClientTest, WaitForChangeWakesOnDelete) {
  auto client = Client();
  auto put = client->Put("/t/watched", "v");
  ASSERT_TRUE(put.ok());
  absl::StatusOr<EtcdChange> change;
  const absl::Time start = absl::Now();
  std::thread waiter([&] {
    change = client->WaitForChange("/t/watched", *put, absl::Seconds(10));
  });
  // No wait for the watch to be set up: it starts at put + 1, so it sees a
  // delete that comes before it.
  auto deleted = client->DeleteIfCreated("/t/watched", *put);
  waiter.join();
  ASSERT_TRUE(deleted.ok() && *deleted);
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(change->kind, EtcdChange::kDelete);
  EXPECT_GT(change->revision, *put);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(EtcdClientTest, WaitForChangeSeesPutsAndTimesOut) {
  auto client = Client();
  auto before = client->Get("/t/w2");
  ASSERT_TRUE(before.ok());
  auto put = client->Put("/t/w2", "x");
  ASSERT_TRUE(put.ok());
  auto change =
      client->WaitForChange("/t/w2", before->revision, absl::Seconds(5));
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(change->kind, EtcdChange::kPut);
  ASSERT_TRUE(change->kv.has_value());
  EXPECT_EQ(change->kv->value, "x");
  EXPECT_EQ(change->revision, *put);

  // Other keys are not events of this one.
  ASSERT_TRUE(client->Put("/t/w2-other", "y").ok());
  const absl::Time start = absl::Now();
  auto quiet = client->WaitForChange("/t/w2", *put, absl::Seconds(1));
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  EXPECT_EQ(quiet->kind, EtcdChange::kTimeout);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(990));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(EtcdClientTest, WaitForChangeCancelled) {
  auto client = Client();
  auto put = client->Put("/t/w3", "v");
  ASSERT_TRUE(put.ok());
  EtcdCancel cancel;
  absl::StatusOr<EtcdChange> change;
  const absl::Time start = absl::Now();
  std::thread waiter([&] {
    change = client->WaitForChange("/t/w3", *put, absl::Seconds(20), &cancel);
  });
  cancel.Cancel();
  waiter.join();
  EXPECT_EQ(change.status().code(), absl::StatusCode::kCancelled)
      << change.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // And every later wait given it.
  EXPECT_EQ(client->WaitForChange("/t/w3", *put, absl::Seconds(20), &cancel)
                .status()
                .code(),
            absl::StatusCode::kCancelled);
}

TEST_F(EtcdClientTest, StoppedOrPausedEtcdFailsWithinTheTimeout) {
  const absl::Duration timeout = absl::Milliseconds(500);
  auto client = Client(timeout);
  ASSERT_TRUE(client->Put("/t/x", "v").ok());

  ASSERT_TRUE(etcd_->Pause().ok());
  absl::Time start = absl::Now();
  auto got = client->Get("/t/x");
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded)
      << got.status();
  EXPECT_TRUE(absl::StrContains(
      got.status().message(),
      absl::StrCat("etcd ", etcd_->endpoint(), ": Range: deadline exceeded")))
      << got.status();
  EXPECT_LT(took, timeout + absl::Milliseconds(400));
  // A deadline of the call's own, sooner than the timeout.
  start = absl::Now();
  auto lease = client->GrantLease(absl::Seconds(5),
                                  absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(400));
  ASSERT_TRUE(etcd_->Resume().ok());
  EXPECT_TRUE(client->Get("/t/x").ok());

  ASSERT_TRUE(etcd_->Stop().ok());
  start = absl::Now();
  for (auto status :
       {client->Get("/t/x").status(),
        client->GrantLease(absl::Seconds(2)).status(),
        client->KeepAliveOnce(1).status(), client->Put("/t/x", "w").status(),
        client->WaitForChange("/t/x", 1, timeout).status()}) {
    EXPECT_TRUE(status.code() == absl::StatusCode::kUnavailable ||
                status.code() == absl::StatusCode::kDeadlineExceeded)
        << status;
    EXPECT_TRUE(absl::StrContains(status.message(), etcd_->endpoint()))
        << status;
  }
  EXPECT_LT(absl::Now() - start, 5 * (timeout + absl::Milliseconds(200)));

  // Back on the same data and port: the client reconnects. A call made
  // while its channel still waits out gRPC's reconnect backoff (at most 1 s
  // here) may fail fast; the client is judged on reconnecting, bounded.
  ASSERT_TRUE(etcd_->Restart().ok());
  absl::StatusOr<EtcdGetResult> after = client->Get("/t/x");
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!after.ok() && absl::Now() < give_up) {
    EXPECT_TRUE(after.status().code() == absl::StatusCode::kUnavailable ||
                after.status().code() == absl::StatusCode::kDeadlineExceeded)
        << after.status();
    absl::SleepFor(absl::Milliseconds(50));  // poll interval
    after = client->Get("/t/x", absl::Now() + timeout);
  }
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_TRUE(after->kv.has_value());
  EXPECT_EQ(after->kv->value, "v");
}

TEST_F(EtcdClientTest, FailsOverFromADeadEndpoint) {
  auto dead = EtcdProcess::DeadEndpoint();
  ASSERT_TRUE(dead.ok());
  EtcdClientOptions options;
  options.endpoints = {*dead, etcd_->endpoint()};
  options.rpc_timeout = absl::Milliseconds(500);
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  const absl::Time start = absl::Now();
  auto put = (*client)->Put("/t/failover", "v");
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  auto got = (*client)->Get("/t/failover");
  ASSERT_TRUE(got.ok() && got->kv.has_value());

  // Both dead: the error names both.
  ASSERT_TRUE(etcd_->Stop().ok());
  auto none = (*client)->Get("/t/failover");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable)
      << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), *dead));
  EXPECT_TRUE(absl::StrContains(none.status().message(), etcd_->endpoint()));
}

}  // namespace
}  // namespace localsgd
