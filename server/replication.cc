#include "server/replication.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "server/convert.h"
#include "server/replica_applier.h"
#include "src/codec.h"
#include "src/failpoint.h"

namespace localsgd {
namespace {

using FollowStream =
    grpc::ServerReaderWriter<v1::ReplicaUpdate, v1::FollowMessage>;

// Float32 little-endian, as everything on the wire (the hosts are).
std::string FloatBytes(absl::Span<const float> values) {
  std::string out(values.size() * sizeof(float), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

bool SameToken(const std::string& a, const std::string& b) {
  return a.size() == b.size() &&
         CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

// ---------------------------------------------------------------------------
// ReplicationHub

ReplicationHub::ReplicationHub(ReplicationOptions options,
                               std::function<uint64_t()> epoch,
                               std::function<bool()> serving)
    : options_(std::move(options)),
      epoch_(std::move(epoch)),
      serving_(std::move(serving)) {}

ReplicationHub::~ReplicationHub() { Shutdown(); }

uint64_t ReplicationHub::Chunk(ReplicatedChunk chunk) {
  {
    // No standby: a ticket, and nothing to encode.
    absl::MutexLock lock(&mu_);
    if (followers_.empty()) return ++last_;
  }
  v1::ReplicaUpdate update;
  v1::ChunkFinal* m = update.mutable_chunk();
  m->set_job_id(chunk.job_id);
  m->set_round(chunk.round);
  m->set_index(chunk.chunk);
  m->set_contributed(chunk.contributed);
  m->set_mean(FloatBytes(chunk.mean));
  m->set_encoded_mean(std::move(chunk.encoded_mean));
  return Append(chunk.job_id, std::move(update));
}

uint64_t ReplicationHub::Commit(ReplicatedCommit commit) {
  {
    absl::MutexLock lock(&mu_);
    if (followers_.empty()) return ++last_;
  }
  v1::ReplicaUpdate update;
  v1::StateCommit* m = update.mutable_commit();
  m->set_job_id(commit.job_id);
  m->set_round(commit.round);
  m->set_state_id(commit.state_id);
  m->set_previous_id(commit.previous_id);
  RoundRecordToProto(commit.record, m->mutable_record());
  m->set_contributor_weight(commit.record.contributor_weight);
  MembersToProto(commit.members, m->mutable_members());
  if (commit.seed != nullptr) {
    m->set_seed(true);
    m->set_seed_values(FloatBytes(commit.seed->values));
    LayoutToProto(commit.layout, m->mutable_layout());
    SettingsToProto(commit.settings, m->mutable_settings());
  }
  return Append(commit.job_id, std::move(update));
}

uint64_t ReplicationHub::Append(std::string job_id, v1::ReplicaUpdate update) {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = ++last_;
  if (followers_.empty()) return ticket;  // no one to send it to
  update.set_sequence(ticket);
  update.set_epoch(epoch_());
  log_.push_back(
      Entry{ticket, std::move(job_id),
            std::make_shared<const v1::ReplicaUpdate>(std::move(update))});
  return ticket;
}

uint64_t ReplicationHub::LastTicket() {
  absl::MutexLock lock(&mu_);
  return last_;
}

void ReplicationHub::WhenAcked(uint64_t ticket, std::function<void()> release) {
  std::vector<std::function<void()>> due;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;  // never released (see Shutdown)
    waiting_.emplace(ticket, std::move(release));
    due = DueLocked();
  }
  for (auto& fn : due) fn();
}

std::vector<std::string> ReplicationHub::InSyncLocked() const {
  std::vector<std::string> out;
  for (const auto& [id, f] : followers_) {
    if (f.in_sync && !f.dropped && f.acked >= f.through) {
      out.push_back(f.address);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<std::function<void()>> ReplicationHub::DueLocked() {
  bool any = false;
  uint64_t least = UINT64_MAX;
  for (const auto& [id, f] : followers_) {
    if (!f.in_sync || f.dropped) continue;
    any = true;
    least = std::min(least, f.acked);
  }
  if (publish_) {
    // A standby the list names (or may name: a write in flight or failed)
    // that is no longer in sync could win an election: nothing it lacks
    // goes out until the list no longer names it.
    const std::vector<std::string> live = InSyncLocked();
    for (const std::vector<std::string>* named : {&published_, &writing_}) {
      for (const std::string& a : *named) {
        if (!std::binary_search(live.begin(), live.end(), a)) return {};
      }
    }
  }
  std::vector<std::function<void()>> due;
  while (!waiting_.empty() && (!any || waiting_.begin()->first <= least)) {
    due.push_back(std::move(waiting_.begin()->second));
    waiting_.erase(waiting_.begin());
  }
  return due;
}

void ReplicationHub::TrimLocked() {
  uint64_t needed = last_ + 1;  // the first ticket some follower still needs
  for (const auto& [id, f] : followers_) needed = std::min(needed, f.sent + 1);
  while (!log_.empty() && log_.front().ticket < needed) log_.pop_front();
}

absl::Status ReplicationHub::CheckFollow(const v1::FollowRequest& request) {
  if (!options_.token.empty()) {
    if (request.token().empty()) {
      return absl::UnauthenticatedError(
          "the replication stream needs the group's token (--ha_token)");
    }
    if (!SameToken(request.token(), options_.token)) {
      return absl::PermissionDeniedError(
          "the replication token is not the group's (--ha_token)");
    }
  }
  if (request.group() != options_.group ||
      request.shard_index() != options_.shard_index) {
    return absl::FailedPreconditionError(
        absl::StrCat("a standby of group '", request.group(), "' shard ",
                     request.shard_index(), " follows a primary of group '",
                     options_.group, "' shard ", options_.shard_index));
  }
  // The synchronous-standby list names standbys by this address: one
  // line of it, without spaces.
  const std::string& standby = request.standby();
  if (standby.empty() || standby.size() > 255 ||
      std::any_of(standby.begin(), standby.end(), [](char c) {
        return static_cast<unsigned char>(c) <= ' ' ||
               static_cast<unsigned char>(c) >= 0x7f;
      })) {
    return absl::InvalidArgumentError(
        "a standby names its address (its --ha_advertise, host:port: 1 to "
        "255 printable characters, no spaces)");
  }
  if (!serving_()) {
    std::string advertise;
    {
      absl::MutexLock lock(&mu_);
      advertise = advertise_.empty() ? options_.advertise : advertise_;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "coordinator ", advertise, " is not the primary of its shard (now)"));
  }
  if (request.epoch() > epoch_()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the standby has seen epoch ", request.epoch(),
                     "; this primary's is ", epoch_(), ": it is deposed"));
  }
  return absl::OkStatus();
}

grpc::Status ReplicationHub::Follow(grpc::ServerContext* context,
                                    FollowStream* stream) {
  v1::FollowMessage first;
  if (!stream->Read(&first)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "no FollowRequest");
  }
  if (!first.has_follow()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "the first message of a Follow stream must be a FollowRequest"));
  }
  if (absl::Status s = CheckFollow(first.follow()); !s.ok()) {
    LOG(WARNING) << "replication: refused a standby at " << context->peer()
                 << ": " << s;
    return ToGrpcStatus(s);
  }
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
    }
    id = next_follower_++;
    Follower& f = followers_[id];
    f.address = first.follow().standby();
    f.context = context;
    f.next = last_ + 1;
    f.sent = last_;
    f.progress = absl::Now();
  }
  LOG(INFO) << "replication: standby " << first.follow().standby() << " ("
            << context->peer() << ") follows; catch-up";

  // Acks, on a thread of their own (one reader and one writer at a time).
  std::thread reader([this, id, stream] {
    v1::FollowMessage message;
    while (stream->Read(&message)) {
      if (message.kind_case() != v1::FollowMessage::kAcked) continue;
      std::vector<std::function<void()>> due;
      {
        absl::MutexLock lock(&mu_);
        auto it = followers_.find(id);
        if (it == followers_.end()) break;
        Follower& f = it->second;
        if (message.acked() > f.sent && f.caught_up_sent) {
          LOG(WARNING) << "replication: standby " << f.address
                       << " acknowledges update " << message.acked()
                       << ", beyond the last sent (" << f.sent << ")";
        }
        f.acked = std::max(f.acked, std::min(message.acked(), f.sent));
        f.progress = absl::Now();
        due = DueLocked();
      }
      for (auto& fn : due) fn();
    }
    absl::MutexLock lock(&mu_);
    auto it = followers_.find(id);
    if (it != followers_.end() && !it->second.dropped) {
      it->second.dropped = true;
    }
  });

  bool ok = WriteCatchUp(id, stream);
  bool shutting_down = false;
  std::string why = ok ? "" : "its stream broke during the catch-up";
  while (ok) {
    std::vector<Entry> batch;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this, id]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        const Follower& f = followers_.at(id);
        return shutdown_ || f.dropped ||
               (!log_.empty() && log_.back().ticket > f.sent);
      };
      while (!has_work()) {
        mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1));
      }
      const Follower& f = followers_.at(id);
      if (shutdown_) {
        why = "the primary shuts down";
        shutting_down = true;
        break;
      }
      if (f.dropped) {
        why = "it stopped acknowledging or its stream ended";
        break;
      }
      for (const Entry& e : log_) {
        if (e.ticket > f.sent) batch.push_back(e);
        if (batch.size() == 64) break;
      }
    }
    for (const Entry& e : batch) {
      {
        // Sent before it is written: its ack may come before Write returns.
        absl::MutexLock lock(&mu_);
        Follower& f = followers_.at(id);
        // Its ack timeout runs from the oldest update it has not
        // acknowledged: an idle gap between rounds is not a stall.
        if (f.acked >= f.sent) f.progress = absl::Now();
        f.sent = e.ticket;
      }
      if (!stream->Write(*e.update)) {
        ok = false;
        why = "its stream broke";
        break;
      }
    }
    absl::MutexLock lock(&mu_);
    TrimLocked();
  }
  if (ok && !shutting_down) {
    // Tell it, so that it does not count itself in sync (a cancelled call
    // would say nothing).
    v1::ReplicaUpdate dropped;
    dropped.set_epoch(epoch_());
    dropped.mutable_dropped()->set_why(why);
    stream->Write(dropped);
  }
  context->TryCancel();
  reader.join();
  std::vector<std::function<void()>> due;
  std::string address;
  {
    absl::MutexLock lock(&mu_);
    address = followers_.at(id).address;
    followers_.erase(id);
    TrimLocked();
    due = DueLocked();
  }
  for (auto& fn : due) fn();
  LOG(WARNING) << "replication: standby " << address
               << " no longer follows: " << why;
  // UNAVAILABLE: the standby is in sync (a clean stop); ABORTED: it is not.
  return grpc::Status(
      shutting_down ? grpc::StatusCode::UNAVAILABLE : grpc::StatusCode::ABORTED,
      why);
}

bool ReplicationHub::WriteCatchUp(uint64_t id, FollowStream* stream) {
  // Each message written is progress (Tick drops a catch-up that stalls).
  auto write = [this, id, stream](const v1::ReplicaUpdate& update) {
    if (!stream->Write(update)) return false;
    HitFailpoint(Failpoint::kCatchUpSent);
    absl::MutexLock lock(&mu_);
    followers_.at(id).progress = absl::Now();
    return true;
  };
  for (const std::shared_ptr<Job>& job : coordinator_->Jobs()) {
    const JobReplica replica = job->ExportReplica();
    const ChunkGeometry& g = job->geometry();
    v1::ReplicaUpdate header;
    header.set_epoch(epoch_());
    v1::JobReplica* m = header.mutable_job();
    m->set_job_id(replica.job_id);
    LayoutToProto(replica.layout, m->mutable_layout());
    SettingsToProto(replica.settings, m->mutable_settings());
    m->set_sequence(replica.sequence);
    m->set_has_state(replica.state != nullptr);
    if (replica.state != nullptr) {
      m->set_round(replica.state->round);
      m->set_state_id(replica.state->id);
    }
    m->set_final_chunks(static_cast<uint32_t>(replica.final_chunks.size()));
    for (const RoundRecord& r : replica.recent_rounds) {
      RoundRecordToProto(r, m->add_recent_rounds());
    }
    MembersToProto(replica.members, m->mutable_members());
    if (!write(header)) return false;
    if (replica.state == nullptr) continue;
    const StateSnapshot& s = *replica.state;
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      v1::ReplicaUpdate chunk;
      chunk.set_epoch(epoch_());
      v1::ReplicaStateChunk* p = chunk.mutable_state_chunk();
      p->set_job_id(replica.job_id);
      p->set_index(c);
      auto part = [&](const std::vector<float>& v) {
        return v.empty() ? std::string()
                         : FloatBytes(absl::MakeConstSpan(v).subspan(
                               g.Offset(c), g.Size(c)));
      };
      p->set_values(part(s.values));
      p->set_momentum(part(s.momentum));
      p->set_residual(part(s.residual));
      if (!write(chunk)) return false;
    }
    const WireCode wire = ResultCodeOf(replica.settings);
    for (uint32_t c : replica.final_chunks) {
      v1::ReplicaUpdate chunk;
      chunk.set_epoch(epoch_());
      v1::ReplicaStateChunk* p = chunk.mutable_state_chunk();
      p->set_job_id(replica.job_id);
      p->set_index(c);
      p->set_open_round(true);
      p->set_values(FloatBytes(absl::MakeConstSpan(replica.partial_values)
                                   .subspan(g.Offset(c), g.Size(c))));
      const StateSnapshot& next = *replica.partial;
      if (!next.momentum.empty()) {
        p->set_momentum(FloatBytes(absl::MakeConstSpan(next.momentum)
                                       .subspan(g.Offset(c), g.Size(c))));
      }
      if (!next.residual.empty()) {
        p->set_residual(FloatBytes(absl::MakeConstSpan(next.residual)
                                       .subspan(g.Offset(c), g.Size(c))));
      }
      p->set_delta(next.delta.substr(WireBytes(wire, g.chunk_elements()) * c,
                                     WireBytes(wire, g.Size(c))));
      if (!write(chunk)) return false;
    }
  }
  v1::ReplicaUpdate done;
  done.set_epoch(epoch_());
  done.mutable_caught_up();
  {
    absl::MutexLock lock(&mu_);
    Follower& f = followers_.at(id);
    // From here on results wait for it. What was released during the
    // catch-up (tickets from f.next to `through`) it gets next; it counts
    // itself in sync once it has applied them.
    done.set_sequence(f.next - 1);
    done.mutable_caught_up()->set_through(last_);
    f.through = last_;
    f.caught_up_sent = true;
    f.in_sync = true;
    f.acked = std::max(f.acked, f.next - 1);
    f.progress = absl::Now();
  }
  LOG(INFO) << "replication: standby caught up; results wait for it";
  return stream->Write(done);
}

void ReplicationHub::Tick(absl::Time now) {
  std::vector<std::function<void()>> due;
  {
    absl::MutexLock lock(&mu_);
    bool dropped = false;
    for (auto& [id, f] : followers_) {
      if (f.dropped) {
        // Its stream ends with ABORTED (it knows it is out of sync) unless
        // a write is stuck on it: then cancelled.
        if (now - f.progress > options_.ack_timeout + absl::Seconds(1)) {
          f.context->TryCancel();
        }
        continue;
      }
      if (!f.in_sync) {
        // Catching up: every write of the catch-up is progress. One that
        // takes no write for catch_up_timeout (a standby that stopped
        // reading, or cut off) is dropped, so that the log it holds back is
        // freed.
        if (now - f.progress < options_.catch_up_timeout) continue;
        LOG(ERROR) << "replication: standby " << f.address
                   << "'s catch-up took nothing for "
                   << absl::FormatDuration(now - f.progress)
                   << "; dropped (it catches up again when it comes back)";
        f.dropped = true;
        f.context->TryCancel();
        continue;
      }
      if (f.acked >= f.sent) continue;
      if (now - f.progress < options_.ack_timeout) continue;
      LOG(ERROR) << "replication: standby " << f.address
                 << " acknowledged nothing for "
                 << absl::FormatDuration(now - f.progress) << " (" << f.acked
                 << " of " << f.sent
                 << " updates); going on without it until it catches up "
                    "again";
      f.dropped = true;
      dropped = true;
    }
    if (dropped) due = DueLocked();
  }
  for (auto& fn : due) fn();
}

void ReplicationHub::Shutdown() {
  std::multimap<uint64_t, std::function<void()>> unreleased;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    for (auto& [id, f] : followers_) f.context->TryCancel();
    // Not released: a standby may not have them. Their members' calls end
    // with the server; they retry against the next primary.
    unreleased.swap(waiting_);
  }
  StopSyncPublisher();
}

void ReplicationHub::StartSyncPublisher(SyncPublisher publish) {
  absl::MutexLock lock(&mu_);
  if (publish_ || shutdown_) return;
  publish_ = std::move(publish);
  publisher_ = std::thread([this] { PublishLoop(); });
}

void ReplicationHub::set_advertise(std::string address) {
  absl::MutexLock lock(&mu_);
  advertise_ = std::move(address);
}

void ReplicationHub::StopSyncPublisher() {
  {
    absl::MutexLock lock(&mu_);
    stop_publishing_ = true;
  }
  if (publisher_.joinable()) publisher_.join();
}

absl::Status ReplicationHub::PublishInitial(uint64_t epoch,
                                            absl::Time deadline) {
  SyncPublisher publish;
  {
    absl::MutexLock lock(&mu_);
    publish = publish_;
  }
  if (!publish) return absl::OkStatus();
  while (true) {
    const absl::Status s = publish(epoch, {});
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      published_.clear();
      writing_.clear();
      LOG(INFO) << "replication: synchronous standbys of epoch " << epoch
                << ": none yet";
      return absl::OkStatus();
    }
    // Deposed already, or out of time: the caller does not serve.
    if (s.code() == absl::StatusCode::kFailedPrecondition ||
        absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("cannot publish the synchronous standbys of epoch ",
                       epoch, ": ", s.ToString()));
    }
    absl::SleepFor(absl::Milliseconds(100));  // the role thread, not a handler
  }
}

void ReplicationHub::PublishLoop() {
  int failures = 0;  // in a row
  absl::MutexLock lock(&mu_);
  while (!stop_publishing_ && !shutdown_) {
    if (!serving_()) {
      // Not the primary (yet): serving_ is not under mu_, so looked at
      // again every 100 ms.
      auto stop = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return stop_publishing_ || shutdown_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(100));
      continue;
    }
    const std::vector<std::string> want = InSyncLocked();
    // Also while a failed write may have landed (writing_): until a write
    // succeeds, what etcd holds is not known, and releases wait.
    if (want == published_ && writing_.empty()) {
      auto changed = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return stop_publishing_ || shutdown_ || !writing_.empty() ||
               InSyncLocked() != published_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(100));
      continue;
    }
    // Until a write succeeds, every list tried may be the one in etcd.
    for (const std::string& a : want) {
      if (std::find(writing_.begin(), writing_.end(), a) == writing_.end()) {
        writing_.push_back(a);
      }
    }
    const uint64_t epoch = epoch_();
    const SyncPublisher publish = publish_;
    mu_.Unlock();
    const absl::Status s = publish(epoch, want);
    mu_.Lock();
    if (!s.ok()) {
      // Every 200 ms while etcd is away: the first and then every 50th.
      if (++failures % 50 == 1) {
        LOG(WARNING) << "replication: cannot publish the synchronous standbys ("
                     << (want.empty() ? "none" : absl::StrJoin(want, ", "))
                     << "; attempt " << failures << "): " << s
                     << "; results wait until it can";
      }
      auto stop = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return stop_publishing_ || shutdown_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(200));
      continue;
    }
    published_ = want;
    writing_.clear();
    LOG(INFO) << "replication: synchronous standbys of epoch " << epoch << ": "
              << (want.empty() ? "none" : absl::StrJoin(want, ", "))
              << (failures > 0
                      ? absl::StrCat(" (after ", failures, " failed attempts)")
                      : "");
    failures = 0;
    std::vector<std::function<void()>> due = DueLocked();
    mu_.Unlock();
    for (auto& fn : due) fn();
    mu_.Lock();
  }
}

std::vector<StandbyStatus> ReplicationHub::Standbys() {
  absl::MutexLock lock(&mu_);
  std::vector<StandbyStatus> out;
  for (const auto& [id, f] : followers_) {
    StandbyStatus s;
    s.address = f.address;
    s.in_sync = f.in_sync && !f.dropped;
    s.acked = f.acked;
    s.lag = last_ - std::min(last_, f.acked);
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------
// ReplicaFollower

ReplicaFollower::ReplicaFollower(ReplicationOptions options,
                                 Coordinator* coordinator)
    : options_(std::move(options)), coordinator_(coordinator) {
  thread_ = std::thread([this] { Loop(); });
}

ReplicaFollower::~ReplicaFollower() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  thread_.join();
}

void ReplicaFollower::Follow(std::string primary, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (primary == primary_ && epoch == epoch_) return;
  // Another primary: what it serves before this standby catches up with
  // it is not here.
  if (epoch != epoch_) in_sync_ = false;
  primary_ = std::move(primary);
  epoch_ = epoch;
  ++generation_;
  if (context_ != nullptr) context_->TryCancel();
}

bool ReplicaFollower::Stop() {
  absl::MutexLock lock(&mu_);
  primary_.clear();
  ++generation_;
  if (context_ != nullptr) context_->TryCancel();
  mu_.Await(absl::Condition(
      +[](ReplicaFollower* f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(f->mu_) {
        return f->context_ == nullptr;
      },
      this));
  return in_sync_;
}

uint64_t ReplicaFollower::applied() {
  absl::MutexLock lock(&mu_);
  return applied_;
}

void ReplicaFollower::set_advertise(std::string address) {
  absl::MutexLock lock(&mu_);
  advertise_ = std::move(address);
}

bool ReplicaFollower::in_sync() {
  absl::MutexLock lock(&mu_);
  return in_sync_;
}

void ReplicaFollower::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (primary_.empty()) {
      mu_.Await(absl::Condition(
          +[](ReplicaFollower* f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(f->mu_) {
            return f->stop_ || !f->primary_.empty();
          },
          this));
      continue;
    }
    const std::string primary = primary_;
    const uint64_t epoch = epoch_;
    const uint64_t generation = generation_;
    mu_.Unlock();
    const absl::Status s = FollowOnce(primary, epoch, generation);
    mu_.Lock();
    if (stop_) break;
    LOG(WARNING) << "replication: following " << primary << " ended: " << s;
    if (generation == generation_) {
      // The same primary: again after a pause (it may be restarting, or
      // gone: etcd names the next one).
      auto changed = [this, generation]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return stop_ || generation_ != generation;
      };
      mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(500));
    }
  }
}

absl::Status ReplicaFollower::FollowOnce(const std::string& primary,
                                         uint64_t epoch, uint64_t generation) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // a seed is the whole model
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options_.tls_ca_pem.empty()) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls_ca_pem;
    ssl.pem_cert_chain = options_.tls_cert_pem;
    ssl.pem_private_key = options_.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  auto stub = v1::Replication::NewStub(
      grpc::CreateCustomChannel(primary, credentials, args));
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    // Stopped (to be promoted) or re-targeted since Loop let go of the
    // lock: not this stream.
    if (stop_ || generation != generation_) {
      return absl::CancelledError("no longer following " + primary);
    }
    context_ = &context;
  }
  absl::Status status = absl::OkStatus();
  bool began = false;
  auto stream = stub->Follow(&context);
  v1::FollowMessage hello;
  v1::FollowRequest* request = hello.mutable_follow();
  request->set_group(options_.group);
  request->set_shard_index(options_.shard_index);
  request->set_token(options_.token);
  {
    absl::MutexLock lock(&mu_);
    request->set_standby(advertise_.empty() ? options_.advertise : advertise_);
  }
  request->set_epoch(epoch);
  if (!stream->Write(hello)) status = absl::UnavailableError("cannot write");
  uint64_t through = 0;  // CaughtUp's: in sync once applied through it
  ReplicaApplier applier(coordinator_, epoch);
  auto ack = [&](uint64_t sequence) {
    v1::FollowMessage m;
    m.set_acked(sequence);
    stream->Write(m);
  };
  v1::ReplicaUpdate update;
  while (status.ok() && stream->Read(&update)) {
    if (!applier.began() && update.epoch() >= epoch) {
      // A new catch-up replaces every job: not in sync from here on.
      absl::MutexLock lock(&mu_);
      in_sync_ = false;
    }
    absl::StatusOr<ReplicaApplier::Applied> applied = applier.Apply(update);
    began = applier.began();
    if (!applied.ok()) {
      status = applied.status();
      if (status.code() == absl::StatusCode::kFailedPrecondition) {
        status = absl::FailedPreconditionError(
            absl::StrCat(primary, ": ", status.message()));
      }
      break;
    }
    if (applied->caught_up) {
      // In sync once it has applied what the primary released during the
      // catch-up (up to `through`).
      through = applied->through;
      {
        absl::MutexLock lock(&mu_);
        applied_ = update.sequence();
        in_sync_ = through <= applied_;
      }
      LOG(INFO) << "replication: caught up with " << primary << " (epoch "
                << update.epoch() << "); in sync from update " << through;
    }
    if (applied->acknowledge) ack(update.sequence());
    if (update.sequence() > 0) {
      absl::MutexLock lock(&mu_);
      applied_ = std::max(applied_, update.sequence());
      if (through > 0 && applied_ >= through) in_sync_ = true;
    }
  }
  const bool dropped = applier.dropped();
  const bool local_error = !status.ok() && !dropped;
  if (local_error) {
    LOG(ERROR) << "replication: " << status
               << "; not in sync until a new catch-up";
    context.TryCancel();
  }
  const grpc::Status end = stream->Finish();
  if (status.ok() && !end.ok()) status = FromGrpcStatus(end);
  absl::MutexLock lock(&mu_);
  // Still in sync if the stream only broke (the primary died, however the
  // transport says so, or this standby stops to be promoted): every update
  // it got is applied. Not if an update failed here or the primary dropped
  // it (ABORTED). A stream refused at its start (the callee is no primary
  // yet) changes nothing.
  if (began && (local_error || dropped ||
                end.error_code() == grpc::StatusCode::ABORTED)) {
    in_sync_ = false;
  }
  context_ = nullptr;
  return status;
}

}  // namespace localsgd
