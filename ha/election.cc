#include "ha/election.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "glog/logging.h"

namespace localsgd {

absl::Duration LeaseFence::SafetyMargin(absl::Duration ttl) {
  return std::min(std::max(ttl / 10, absl::Milliseconds(50)), ttl / 2);
}

void LeaseFence::Arm(absl::Time sent_at, absl::Duration ttl) {
  armed_ = true;
  last_sent_ = sent_at;
  serve_until_ = sent_at + ttl - SafetyMargin(ttl);
}

bool LeaseFence::Renew(absl::Time sent_at, absl::Duration ttl, absl::Time now) {
  if (!Serving(now) || sent_at < last_sent_) return false;
  last_sent_ = sent_at;
  serve_until_ = std::max(serve_until_, sent_at + ttl - SafetyMargin(ttl));
  return true;
}

void LeaseFence::Disarm() { armed_ = false; }

const char* ElectorRoleKindName(ElectorRole::Kind kind) {
  switch (kind) {
    case ElectorRole::kCandidate:
      return "candidate";
    case ElectorRole::kPrimary:
      return "primary";
    case ElectorRole::kStandby:
      return "standby";
  }
  return "?";
}

std::string ElectionKey(const std::string& group, uint32_t shard) {
  return absl::StrCat("/localsgd/", group, "/shard/", shard, "/primary");
}

std::string SyncStandbysKey(const std::string& group, uint32_t shard) {
  return absl::StrCat("/localsgd/", group, "/shard/", shard, "/sync");
}

std::string FormatSyncStandbys(const SyncStandbys& sync) {
  std::string out = absl::StrCat("epoch ", sync.epoch, "\n");
  for (const std::string& s : sync.standbys) absl::StrAppend(&out, s, "\n");
  return out;
}

absl::StatusOr<SyncStandbys> ParseSyncStandbys(absl::string_view text) {
  SyncStandbys sync;
  std::vector<absl::string_view> lines =
      absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || !absl::ConsumePrefix(&lines[0], "epoch ") ||
      !absl::SimpleAtoi(lines[0], &sync.epoch) || sync.epoch <= 0) {
    return absl::InvalidArgumentError(
        "a synchronous-standby list starts with \"epoch <n>\"");
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    if (absl::StrContains(lines[i], ' ')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", i + 1, " of a synchronous-standby list is no address"));
    }
    sync.standbys.emplace_back(lines[i]);
  }
  return sync;
}

absl::Status ElectorOptions::Validate() const {
  if (group.empty() || group.size() > 63) {
    return absl::InvalidArgumentError(
        absl::StrCat("elector group \"", group, "\": 1 to 63 characters"));
  }
  for (char c : group) {
    if (!(absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "elector group \"", group, "\": only [A-Za-z0-9._-] allowed"));
    }
  }
  size_t colon = advertise.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(advertise.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "elector advertise address \"", advertise, "\" is not host:port"));
  }
  if (lease_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("elector lease_ttl ", absl::FormatDuration(lease_ttl),
                     " is under etcd's unit of 1s"));
  }
  return etcd.Validate();
}

absl::StatusOr<std::unique_ptr<Elector>> Elector::Create(
    ElectorOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      EtcdClient::Create(options.etcd);
  if (!client.ok()) return client.status();
  return std::unique_ptr<Elector>(
      new Elector(std::move(options), *std::move(client)));
}

Elector::Elector(ElectorOptions options, std::unique_ptr<EtcdClient> client)
    : options_(std::move(options)),
      key_(ElectionKey(options_.group, options_.shard)),
      sync_key_(SyncStandbysKey(options_.group, options_.shard)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      client_(std::move(client)) {}

Elector::~Elector() { Stop(); }

void Elector::Start() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (started_ || stopping_) return;
    started_ = true;
  }
  fence_thread_ = std::thread([this] { RunFence(); });
  thread_ = std::thread([this] { Run(); });
}

void Elector::Stop() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cancel_watch_.Cancel();
  if (thread_.joinable()) thread_.join();
  {
    absl::MutexLock lock(&mu_);
    fence_exit_ = true;
  }
  if (fence_thread_.joinable()) fence_thread_.join();
}

Elector::Role Elector::role() const {
  absl::MutexLock lock(&mu_);
  return role_;
}

bool Elector::Serving(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  return role_.kind == Role::kPrimary && fence_.Serving(now);
}

LeaseFence Elector::fence() const {
  absl::MutexLock lock(&mu_);
  return fence_;
}

bool Elector::stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

bool Elector::WaitOrStop(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&stopping_), d);
  return stopping_;
}

absl::Time Elector::RealDeadline(absl::Time clock_time) const {
  return absl::Now() + (clock_time - clock_->Now());
}

void Elector::SetRoleLocked(Role role) {
  if (role.epoch < role_.epoch) {
    LOG(WARNING) << "election " << key_ << ": epoch " << role.epoch
                 << " below the known " << role_.epoch << "; keeping "
                 << role_.epoch;
    role.epoch = role_.epoch;
  }
  if (role == role_) return;
  VLOG(1) << "election " << key_ << ": " << ElectorRoleKindName(role_.kind)
          << " -> " << ElectorRoleKindName(role.kind) << " epoch " << role.epoch
          << " primary \"" << role.primary << "\"";
  role_ = role;
  pending_.push_back(role_);
}

void Elector::DemoteLocked(const std::string& why) {
  LOG(WARNING) << "election " << key_ << ": primary at epoch " << role_.epoch
               << " demoted: " << why;
  fence_.Disarm();
  SetRoleLocked({Role::kCandidate, role_.epoch, ""});
}

void Elector::RunFence() {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (role_.kind == Role::kPrimary && !fence_.Serving(clock_->Now())) {
      DemoteLocked("the fence ran out (no successful renewal in time)");
    }
    if (!pending_.empty()) {
      std::vector<Role> roles(pending_.begin(), pending_.end());
      pending_.clear();
      if (options_.on_change) {
        mu_.Unlock();
        for (const Role& role : roles) options_.on_change(role);
        mu_.Lock();
      }
      continue;
    }
    if (fence_exit_) return;
    absl::Duration timeout = absl::InfiniteDuration();
    if (role_.kind == Role::kPrimary) {
      timeout =
          std::max(fence_.serve_until() - clock_->Now(), absl::ZeroDuration());
    }
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_.empty() || fence_exit_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&woken), timeout);
  }
}

void Elector::Run() {
  int64_t stale_lease = 0;
  while (!stopping()) {
    stale_lease = Campaign(stale_lease);
  }
  {
    absl::MutexLock lock(&mu_);
    fence_.Disarm();
    SetRoleLocked({Role::kCandidate, role_.epoch, ""});
  }
  if (stale_lease != 0) {
    absl::Status s = client_->RevokeLease(
        stale_lease, absl::Now() + options_.etcd.rpc_timeout);
    if (!s.ok()) {
      LOG(WARNING) << "election " << key_ << ": revoking lease on stop: " << s;
    }
  }
}

int64_t Elector::Campaign(int64_t stale_lease) {
  const absl::Duration backoff =
      std::max(options_.lease_ttl / 10, absl::Milliseconds(100));
  if (stale_lease != 0) {
    // A lease of ours from before (a demotion, a failed campaign): its key
    // must go before anyone, us included, can win.
    absl::Status s = client_->RevokeLease(stale_lease);
    if (s.ok()) {
      stale_lease = 0;
    } else {
      LOG(WARNING) << "election " << key_ << ": revoking old lease: " << s;
    }
  }
  if (options_.campaign_delay) {
    const absl::Duration delay = options_.campaign_delay();
    if (delay > absl::ZeroDuration()) {
      // While the key stays absent, up to `delay`; a primary that wins
      // meanwhile is followed at once (the campaign below loses).
      const absl::Time until = absl::Now() + delay;
      while (absl::Now() < until) {
        absl::StatusOr<EtcdGetResult> got = client_->Get(key_);
        if (!got.ok() || got->kv.has_value()) break;
        if (WaitOrStop(
                std::min(absl::Milliseconds(100), until - absl::Now()))) {
          return stale_lease;
        }
      }
    }
  }
  if (std::optional<std::string> why = NotEligible(); why.has_value()) {
    if (*why != last_not_eligible_) {
      LOG(WARNING) << "election " << key_ << ": not campaigning: " << *why;
      last_not_eligible_ = *why;
    }
    // A named standby that wins meanwhile is followed.
    absl::StatusOr<EtcdGetResult> got = client_->Get(key_);
    if (got.ok() && got->kv.has_value()) {
      EtcdCampaign holder;
      holder.create_revision = got->kv->create_revision;
      holder.holder = got->kv->value;
      holder.holder_lease = got->kv->lease;
      holder.revision = got->revision;
      Follow(holder);
    } else {
      WaitOrStop(backoff);
    }
    return stale_lease;
  }
  last_not_eligible_.clear();
  const absl::Time sent = clock_->Now();
  absl::StatusOr<EtcdLease> lease = client_->GrantLease(options_.lease_ttl);
  if (!lease.ok()) {
    LOG(WARNING) << "election " << key_ << ": " << lease.status();
    WaitOrStop(backoff);
    return stale_lease;
  }
  const absl::Time fence_end =
      sent + lease->ttl - LeaseFence::SafetyMargin(lease->ttl);
  absl::StatusOr<EtcdCampaign> campaign = client_->CreateIfAbsent(
      key_, options_.advertise, lease->id, RealDeadline(fence_end));
  if (!campaign.ok()) {
    LOG(WARNING) << "election " << key_ << ": " << campaign.status();
    WaitOrStop(backoff);
    // It may have been applied: revoking the lease deletes the key if so.
    if (stale_lease != 0) client_->RevokeLease(stale_lease).IgnoreError();
    return lease->id;
  }
  if (!campaign->won) {
    // Not needed while standby; a campaign grants a new one.
    absl::Status s = client_->RevokeLease(lease->id);
    if (!s.ok()) {
      LOG(WARNING) << "election " << key_ << ": revoking unused lease: " << s;
      if (stale_lease != 0) client_->RevokeLease(stale_lease).IgnoreError();
      stale_lease = lease->id;
    }
    if (stale_lease != 0 && campaign->holder_lease == stale_lease) {
      // Our own old key, its lease not revoked yet: try again shortly.
      WaitOrStop(backoff);
      return stale_lease;
    }
    Follow(*campaign);
    return stale_lease;
  }
  bool serve = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    if (stopping_) {
      // Won on the way out: let the key go at once (below).
    } else if (now >= fence_end) {
      LOG(WARNING) << "election " << key_ << ": won at epoch "
                   << campaign->create_revision
                   << " but the fence ran out meanwhile";
    } else if (campaign->create_revision < role_.epoch) {
      LOG(ERROR) << "election " << key_ << ": won at epoch "
                 << campaign->create_revision << ", below the known "
                 << role_.epoch << " (etcd restored from a backup?)";
    } else {
      fence_.Arm(sent, lease->ttl);
      SetRoleLocked(
          {Role::kPrimary, campaign->create_revision, options_.advertise});
      LOG(INFO) << "election " << key_ << ": primary at epoch "
                << campaign->create_revision << ", lease ttl "
                << absl::FormatDuration(lease->ttl);
      serve = true;
    }
  }
  if (!serve) {
    client_->DeleteIfCreated(key_, campaign->create_revision)
        .status()
        .IgnoreError();
    WaitOrStop(backoff);
    return lease->id;
  }
  ServeAsPrimary(*lease, campaign->create_revision);
  return lease->id;
}

void Elector::ServeAsPrimary(const EtcdLease& lease, int64_t epoch) {
  const absl::Duration interval = lease.ttl / 3;
  const absl::Duration retry = std::max(lease.ttl / 20, absl::Milliseconds(50));
  absl::Time next;
  {
    absl::MutexLock lock(&mu_);
    next = fence_.last_sent() + interval;
  }
  while (true) {
    absl::Time serve_until;
    {
      absl::MutexLock lock(&mu_);
      auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || role_.kind != Role::kPrimary;
      };
      mu_.AwaitWithTimeout(absl::Condition(&done), next - clock_->Now());
      if (role_.kind != Role::kPrimary) return;  // the fence thread demoted
      if (stopping_) {
        // Clean stop: stop serving first, then let the key go.
        fence_.Disarm();
        SetRoleLocked({Role::kCandidate, role_.epoch, ""});
        break;
      }
      serve_until = fence_.serve_until();
    }
    const absl::Time sent = clock_->Now();
    absl::StatusOr<absl::Duration> ttl =
        client_->KeepAliveOnce(lease.id, RealDeadline(serve_until));
    absl::MutexLock lock(&mu_);
    if (role_.kind != Role::kPrimary) return;
    const absl::Time now = clock_->Now();
    if (ttl.ok()) {
      if (!fence_.Renew(sent, *ttl, now) && !fence_.Serving(now)) {
        DemoteLocked("the renewal came back after the fence ran out");
        return;
      }
      // A renewal that takes a third of the lease: two more like it and
      // the fence runs out (a false failover). Said once a minute at most.
      if (now - sent > interval &&
          now - last_slow_warning_ > absl::Minutes(1)) {
        last_slow_warning_ = now;
        LOG(WARNING) << "election " << key_ << ": a lease renewal took "
                     << absl::FormatDuration(now - sent) << " of a "
                     << absl::FormatDuration(lease.ttl)
                     << " lease; the link to etcd is slow or saturated (it "
                        "carries the workers' traffic too?): a longer "
                        "--ha_lease_ttl avoids false failovers";
      }
      next = sent + interval;
    } else if (ttl.status().code() == absl::StatusCode::kNotFound) {
      DemoteLocked(std::string(ttl.status().message()));
      return;
    } else {
      LOG(WARNING) << "election " << key_ << ": renewal failed, serving until "
                   << absl::FormatDuration(fence_.serve_until() - now)
                   << " from now: " << ttl.status();
      if (!fence_.Serving(now)) {
        DemoteLocked(std::string(ttl.status().message()));
        return;
      }
      next = now + retry;
    }
  }
  const absl::Time deadline = absl::Now() + options_.etcd.rpc_timeout;
  absl::StatusOr<bool> deleted =
      client_->DeleteIfCreated(key_, epoch, deadline);
  if (!deleted.ok()) {
    LOG(WARNING) << "election " << key_
                 << ": deleting the key on stop: " << deleted.status();
  }
}

std::optional<std::string> Elector::NotEligible() {
  absl::StatusOr<EtcdGetResult> got = client_->Get(sync_key_);
  if (!got.ok()) {
    return absl::StrCat("cannot read the synchronous standbys (", sync_key_,
                        "): ", got.status().ToString());
  }
  if (!got->kv.has_value()) return std::nullopt;  // no primary wrote one yet
  absl::StatusOr<SyncStandbys> sync = ParseSyncStandbys(got->kv->value);
  if (!sync.ok()) {
    return absl::StrCat(sync_key_, " holds no synchronous-standby list (",
                        sync.status().message(), "); `etcdctl del ", sync_key_,
                        "` lets any standby take over");
  }
  if (sync->standbys.empty() ||
      std::find(sync->standbys.begin(), sync->standbys.end(),
                options_.advertise) != sync->standbys.end()) {
    return std::nullopt;
  }
  return absl::StrCat(
      "the primary of epoch ", sync->epoch,
      " released states that only its synchronous standbys (",
      absl::StrJoin(sync->standbys, ", "),
      ") are known to hold; one of them takes over. If they are gone for "
      "good, `etcdctl del ",
      sync_key_,
      "` lets this one take over, losing the rounds it does not hold");
}

absl::Status Elector::PublishSyncStandbys(
    int64_t epoch, const std::vector<std::string>& standbys,
    absl::Time deadline) {
  // One write at a time: each names the revision the last one made.
  absl::MutexLock lock(&sync_mu_);
  if (sync_epoch_ != epoch) {
    sync_epoch_ = epoch;
    sync_revision_ = -1;
  }
  if (sync_revision_ < 0) {
    absl::StatusOr<EtcdGetResult> got = client_->Get(sync_key_, deadline);
    if (!got.ok()) return got.status();
    sync_revision_ = got->kv.has_value() ? got->kv->mod_revision : 0;
  }
  absl::StatusOr<int64_t> put =
      client_->PutIfCreated(sync_key_, FormatSyncStandbys({epoch, standbys}),
                            key_, epoch, sync_revision_, deadline);
  // A write whose answer was lost may land later: it names the revision it
  // meant to replace, so it cannot replace a later one.
  if (!put.ok()) return put.status();
  if (*put > 0) {
    sync_revision_ = *put;
    return absl::OkStatus();
  }
  // A condition failed: the election key is no longer ours, or the list
  // is not the one this primary last wrote.
  sync_revision_ = -1;
  absl::StatusOr<EtcdGetResult> ours = client_->Get(key_, deadline);
  if (!ours.ok()) return ours.status();
  if (!ours->kv.has_value() || ours->kv->create_revision != epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "not the primary of epoch ", epoch, " any more (", key_,
        " was not created at ", epoch, "): the synchronous standbys stay"));
  }
  return absl::UnavailableError(absl::StrCat(
      sync_key_,
      " changed since this primary last wrote it (a write of its own that "
      "timed out landed late); it is written again"));
}

void Elector::Follow(const EtcdCampaign& holder) {
  int64_t holder_revision = holder.create_revision;
  {
    absl::MutexLock lock(&mu_);
    SetRoleLocked({Role::kStandby, holder.create_revision, holder.holder});
  }
  int64_t after = holder.revision;
  const absl::Duration slice = std::max(options_.lease_ttl, absl::Seconds(1));
  const absl::Duration poll = options_.lease_ttl / 3;
  while (!stopping()) {
    absl::StatusOr<EtcdChange> change =
        client_->WaitForChange(key_, after, slice, &cancel_watch_);
    if (change.ok()) {
      if (change->kind == EtcdChange::kDelete) return;
      if (change->kind == EtcdChange::kPut) {
        after = change->revision;
        if (change->kv->create_revision != holder_revision) {
          holder_revision = change->kv->create_revision;
        }
        absl::MutexLock lock(&mu_);
        SetRoleLocked({Role::kStandby, holder_revision, change->kv->value});
      }
      continue;
    }
    if (change.status().code() == absl::StatusCode::kCancelled) return;
    VLOG(1) << "election " << key_ << ": watch: " << change.status();
    // Poll with reads until the watch works again.
    if (WaitOrStop(poll)) return;
    absl::StatusOr<EtcdGetResult> got = client_->Get(key_);
    if (!got.ok()) continue;
    if (!got->kv.has_value()) return;
    after = got->revision;
    holder_revision = got->kv->create_revision;
    absl::MutexLock lock(&mu_);
    SetRoleLocked({Role::kStandby, holder_revision, got->kv->value});
  }
}

}  // namespace localsgd
