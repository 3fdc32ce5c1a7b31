// Election of one primary coordinator per (group, shard) through etcd, and
// the fence that keeps a primary from serving once another could have won.
//
// The shape is Patroni's: the primary holds the key
// /localsgd/<group>/shard/<i>/primary (its value: the primary's advertise
// address) under an etcd lease of lease_ttl, and renews the lease every
// ttl/3. The key's create revision is the primary's *epoch*: each new
// primary creates the key anew, so epochs only grow, and a stale primary's
// epoch is below the current one's (fencing tokens for whoever the primaries
// write to).
//
// The fence: etcd expires a lease no earlier than ttl after it received the
// last keepalive, and it received it no earlier than we sent it. So a
// primary that serves only until
//   serve_until = (send time of its last successful keepalive) + ttl
//                 - safety_margin
// has stopped before etcd can expire its lease and a standby can win. The
// margin (max(ttl/10, 50 ms), at most ttl/2) covers the rates of the two
// clocks differing. LeaseFence is this rule alone, pure; Elector runs it.
//
// The synchronous standbys (Patroni's /sync key): the primary keeps, in
// /localsgd/<group>/shard/<i>/sync (no lease), the standbys it waits for
// before it releases a result (server/replication.h), written only while
// its election key is the one it created. A candidate that the list does
// not name (when it names any) does not campaign: the last primary released
// states that only the named standbys are known to hold. An empty or absent
// list lets any candidate campaign.
//
// Not covered: a process paused (SIGSTOP, a long GC-like stall) between
// checking Serving() and acting on it can still act late; whoever the
// primary writes to should compare epochs as well.
#ifndef LOCALSGD_HA_ELECTION_H_
#define LOCALSGD_HA_ELECTION_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ha/etcd_client.h"
#include "src/clock.h"

namespace localsgd {

// Until when a primary may serve, from the send times of its lease's grant
// and renewals and the TTLs etcd answered with. Pure: no I/O, no threads, no
// clock reads (times are arguments). Not thread-safe; a value type.
class LeaseFence {
 public:
  // max(ttl/10, 50 ms), at most ttl/2: what serve_until keeps back from
  // send time + ttl for the clocks' rates differing.
  static absl::Duration SafetyMargin(absl::Duration ttl);

  // Starts the fence of a new lease: granted (or its key won) by a request
  // sent at sent_at, with ttl. Replaces whatever was before.
  void Arm(absl::Time sent_at, absl::Duration ttl);
  // A successful keepalive whose request was sent at sent_at, answered with
  // ttl. Applied only if the fence is armed, has not run out at now, and
  // sent_at is no earlier than the last applied send time (a stale response
  // changes nothing); then serve_until becomes
  // max(serve_until, sent_at + ttl - SafetyMargin(ttl)). Returns whether
  // it was applied. Once the fence has run out, only Arm starts it again.
  bool Renew(absl::Time sent_at, absl::Duration ttl, absl::Time now);
  // Stops serving at once (demotion, clean stop).
  void Disarm();

  bool armed() const { return armed_; }
  // armed and now < serve_until.
  bool Serving(absl::Time now) const { return armed_ && now < serve_until_; }
  // InfinitePast when not armed.
  absl::Time serve_until() const {
    return armed_ ? serve_until_ : absl::InfinitePast();
  }
  // The send time of the grant or renewal applied last.
  absl::Time last_sent() const { return last_sent_; }

 private:
  bool armed_ = false;
  absl::Time serve_until_ = absl::InfinitePast();
  absl::Time last_sent_ = absl::InfinitePast();
};

// What an Elector is and knows, as on_change reports it.
struct ElectorRole {
  enum Kind {
    kCandidate,  // neither primary nor following a known primary
    kPrimary,    // holds the key (serving while Elector::Serving says so)
    kStandby,    // another holds the key: `primary`, at `epoch`
  };
  Kind kind = kCandidate;
  // The create revision of the key: ours as primary, the holder's as
  // standby, the last known as candidate; 0 before any. Never decreases.
  int64_t epoch = 0;
  // The advertise address of the known primary (ours as primary); empty as
  // candidate.
  std::string primary;

  bool operator==(const ElectorRole& o) const {
    return kind == o.kind && epoch == o.epoch && primary == o.primary;
  }
  bool operator!=(const ElectorRole& o) const { return !(*this == o); }
};

const char* ElectorRoleKindName(ElectorRole::Kind kind);

// "/localsgd/<group>/shard/<shard>/primary".
std::string ElectionKey(const std::string& group, uint32_t shard);
// "/localsgd/<group>/shard/<shard>/sync".
std::string SyncStandbysKey(const std::string& group, uint32_t shard);

// The synchronous-standby list: the primary that wrote it (its epoch) and
// the advertise addresses of the standbys it waits for.
struct SyncStandbys {
  int64_t epoch = 0;
  std::vector<std::string> standbys;
};
// "epoch <n>\n" then one address a line. Parse: INVALID_ARGUMENT for
// anything else (an address is non-empty, without spaces).
std::string FormatSyncStandbys(const SyncStandbys& sync);
absl::StatusOr<SyncStandbys> ParseSyncStandbys(absl::string_view text);

struct ElectorOptions {
  // The job group: non-empty, at most 63 of [A-Za-z0-9._-].
  std::string group;
  uint32_t shard = 0;
  // host:port that members reach this coordinator at: the key's value.
  std::string advertise;
  // The lease's TTL: >= 1 s, rounded up to whole seconds (etcd's unit), and
  // etcd may grant more (its minimum: 2 s with its default election
  // timeout). The fence uses what etcd granted.
  absl::Duration lease_ttl = absl::Seconds(2);
  EtcdClientOptions etcd;
  // The fence's time source; null: Clock::Real(). The elector's threads wait
  // in real time, so a clock that does not follow real time only makes
  // sense for reading Serving() at chosen times.
  Clock* clock = nullptr;
  // Called on every change of role(), in order, from the elector's fence
  // thread with no lock of the elector held. Must not call Stop(); may call
  // role() and Serving(). May be empty.
  std::function<void(const ElectorRole&)> on_change;
  // Asked before each campaign while the key is absent: how long to let
  // others campaign first (a standby out of sync with the last primary
  // yields to one in sync, which holds every state members may hold). May
  // be empty (none); called from the elector's thread.
  std::function<absl::Duration()> campaign_delay;

  absl::Status Validate() const;
};

// Campaigns for the key of (group, shard), serves as primary under the
// fence, or follows the primary as standby. Thread-safe.
//
// As candidate: grants a lease and creates the key under it if absent. Lost:
// standby, watching the key until it is deleted (polling with reads if the
// watch fails), then campaigns again. Won: primary, renewing the lease every
// ttl/3 through the fence; each renewal's deadline is no later than
// serve_until. When a renewal says the lease is gone, or the fence runs out
// (checked by a thread of its own, on the clock, whatever the etcd calls
// are doing), it demotes to candidate at once, revokes the old lease (if
// etcd still has it) and campaigns with a new one.
class Elector {
 public:
  using Role = ElectorRole;

  static absl::StatusOr<std::unique_ptr<Elector>> Create(
      ElectorOptions options);
  // Stop().
  ~Elector();
  Elector(const Elector&) = delete;
  Elector& operator=(const Elector&) = delete;

  // Starts the threads. At most once; nothing after Stop().
  void Start();
  // Idempotent; joins the threads. A primary stops serving first, then
  // deletes its key and revokes its lease (best effort, within rpc_timeout
  // each) so that a standby wins at once. Ends as kCandidate.
  void Stop();

  Role role() const;
  // Writes the synchronous-standby list of the primary of `epoch` (ours),
  // only while the election key is still the one created at `epoch`, and
  // only over the list this primary last wrote: each write names the
  // revision it replaces, so that a write that timed out here and lands in
  // etcd later cannot replace a newer list. FAILED_PRECONDITION if the key
  // is not ours (deposed); UNAVAILABLE if the list changed since this
  // primary last knew it (such a late write landed: the next call writes
  // over it); etcd's errors otherwise. Blocks up to `deadline`; any
  // thread.
  absl::Status PublishSyncStandbys(int64_t epoch,
                                   const std::vector<std::string>& standbys,
                                   absl::Time deadline);
  // role is kPrimary and now < the fence's serve_until (now on the clock of
  // the options).
  bool Serving(absl::Time now) const;
  // A copy of the fence, e.g. to read serve_until and the last send time.
  LeaseFence fence() const;
  const std::string& key() const { return key_; }

 private:
  Elector(ElectorOptions options, std::unique_ptr<EtcdClient> client);

  void Run();
  void RunFence();
  // Campaigns once; returns the lease to revoke later (0: none).
  int64_t Campaign(int64_t stale_lease);
  // As primary on `lease` until demoted or stopping.
  void ServeAsPrimary(const EtcdLease& lease, int64_t epoch);
  // As standby of `holder` until its key is gone or stopping.
  void Follow(const EtcdCampaign& holder);
  // Why this candidate may not campaign now (the synchronous-standby list
  // names others); nullopt if it may.
  std::optional<std::string> NotEligible();
  // Waits d (real time) or until stopping; true if stopping.
  bool WaitOrStop(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const ABSL_LOCKS_EXCLUDED(mu_);
  // The real-time deadline of a time on clock_.
  absl::Time RealDeadline(absl::Time clock_time) const;

  void SetRoleLocked(Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DemoteLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ElectorOptions options_;
  const std::string key_;
  const std::string sync_key_;
  Clock* const clock_;
  const std::unique_ptr<EtcdClient> client_;
  // Ends the standby's watch on Stop.
  EtcdCancel cancel_watch_;
  // The last reason NotEligible gave (logged once per change), and when a
  // slow renewal was last logged; Run's thread only.
  std::string last_not_eligible_;
  absl::Time last_slow_warning_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  Role role_ ABSL_GUARDED_BY(mu_);
  LeaseFence fence_ ABSL_GUARDED_BY(mu_);
  // Roles not yet given to on_change, oldest first.
  std::deque<Role> pending_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool fence_exit_ ABSL_GUARDED_BY(mu_) = false;

  // The revision of the synchronous-standby list this primary last wrote
  // for sync_epoch_ (-1: to be read from etcd before the next write).
  absl::Mutex sync_mu_;
  int64_t sync_epoch_ ABSL_GUARDED_BY(sync_mu_) = 0;
  int64_t sync_revision_ ABSL_GUARDED_BY(sync_mu_) = -1;

  // Start/Stop against each other.
  absl::Mutex lifecycle_mu_;
  std::thread thread_;
  std::thread fence_thread_;
};

}  // namespace localsgd

#endif  // LOCALSGD_HA_ELECTION_H_
