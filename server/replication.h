// Replication between the coordinators of one shard (--ha_etcd), over the
// localsgd.v1.Replication service (proto/localsgd/v1/replication.proto):
//
//   ReplicationHub   the primary's side: the Replicator its jobs tell every
//                    update (src/replicator.h), and the Follow method a
//                    standby calls: the catch-up (each job's replica), then
//                    every update in order; results wait for the acks of
//                    the standbys in sync.
//   ReplicaFollower  the standby's side: follows the primary etcd names,
//                    applies what it sends to its own coordinator's jobs
//                    (Coordinator::AdoptReplica, ApplyReplicated) and acks.
//
// A standby is in sync from the ack of its catch-up until its stream ends.
// One that stops acknowledging for `ack_timeout` (hung, or cut off) is
// dropped: the primary goes on without it (logged; the job is not held
// hostage by a dead standby), and it catches up again when it comes back.
//
// The synchronous standbys (with a SyncPublisher: etcd's list, see
// ha/election.h): the primary publishes the addresses of the standbys in
// sync, and releases nothing while the list it published (or is writing)
// names a standby that is no longer in sync: a dropped standby leaves the
// list before anything it lacks reaches a member, so a standby that the
// list names holds every state a member holds, and one it does not name
// never campaigns. A new primary publishes its (empty) list before it
// serves (PublishInitial).
//
// Follow is refused to a caller without the group's token (--ha_token; none
// set: anyone who reaches the port may follow, logged at start), of another
// group or shard, or when this coordinator is not the primary. The stream
// runs on the coordinator's port, so over its TLS (mutual where it asks
// for client certificates); the standby checks the primary's certificate
// against ReplicationOptions::tls_ca_pem and presents its own.
//
// Thread-safety: all methods are thread-safe.
#ifndef LOCALSGD_SERVER_REPLICATION_H_
#define LOCALSGD_SERVER_REPLICATION_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "localsgd/v1/replication.grpc.pb.h"
#include "src/coordinator.h"
#include "src/replicator.h"

namespace localsgd {

struct ReplicationOptions {
  std::string group;  // --ha_group
  uint32_t shard_index = 0;
  std::string token;      // --ha_token; empty: none
  std::string advertise;  // this coordinator's address (--ha_advertise)
  // The standby's side of TLS, PEM contents: the CA bundle the primary's
  // certificate must be signed by (empty: plaintext), and the certificate
  // and key it presents for mutual TLS (both or neither).
  std::string tls_ca_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // A standby in sync that acknowledges nothing for this long is dropped.
  absl::Duration ack_timeout = absl::Seconds(5);
  // A catch-up that takes no message for this long is dropped (a standby
  // that stopped reading: the log it holds back is freed). Longer than
  // ack_timeout: the standby adopts a job's replica (a copy and a check of
  // the whole state) while the next one waits to be written.
  absl::Duration catch_up_timeout = absl::Seconds(30);
};

class ReplicationHub final : public Replicator,
                             public v1::Replication::Service {
 public:
  // `epoch` and `serving`: this coordinator's election epoch, and whether
  // it serves as the primary now (only then is Follow taken).
  ReplicationHub(ReplicationOptions options, std::function<uint64_t()> epoch,
                 std::function<bool()> serving);
  ~ReplicationHub() override;

  // The coordinator whose jobs the catch-up exports; set once, before
  // serving.
  void set_coordinator(Coordinator* coordinator) { coordinator_ = coordinator; }

  // Replicator.
  uint64_t Chunk(ReplicatedChunk chunk) override;
  uint64_t Commit(ReplicatedCommit commit) override;
  uint64_t LastTicket() override;
  void WhenAcked(uint64_t ticket, std::function<void()> release) override;

  // localsgd.v1.Replication.
  grpc::Status Follow(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::ReplicaUpdate, v1::FollowMessage>* stream)
      override;

  // Writes the synchronous-standby list of the primary of `epoch` (the
  // addresses of the standbys in sync): OK once written. Blocks; called
  // from the hub's publishing thread.
  using SyncPublisher = std::function<absl::Status(
      uint64_t epoch, const std::vector<std::string>& standbys)>;
  // Starts publishing the standbys in sync through `publish` (once, before
  // serving); until then (and without it) releases wait for no list.
  void StartSyncPublisher(SyncPublisher publish) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops it (joins its thread); idempotent. Before `publish`'s target goes.
  void StopSyncPublisher() ABSL_LOCKS_EXCLUDED(mu_);
  // This coordinator's address as others reach it, once known (the
  // default of --ha_advertise is known only once the port is bound): for
  // messages.
  void set_advertise(std::string address) ABSL_LOCKS_EXCLUDED(mu_);
  // A new primary, before it serves: publishes an empty list for `epoch`
  // (no standby follows it yet), trying until `deadline`. OK without a
  // publisher.
  absl::Status PublishInitial(uint64_t epoch, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Drops the standbys in sync that stopped acknowledging (ack_timeout).
  void Tick(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every Follow stream and releases what waits; later updates are
  // released at once.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<StandbyStatus> Standbys() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Follower {
    std::string address;
    grpc::ServerContext* context = nullptr;
    uint64_t next = 0;   // the first ticket of the live updates it gets
    uint64_t sent = 0;   // the last ticket written to it
    uint64_t acked = 0;  // the last ticket it acknowledged
    bool caught_up_sent = false;
    // Results wait for it from its CaughtUp on; it holds every state
    // members may hold once it has acknowledged `through` (what was
    // released during its catch-up): only then may the list name it.
    bool in_sync = false;
    uint64_t through = 0;
    bool dropped = false;
    absl::Time progress;  // its last ack (or when it came)
    // Per job: updates at or below this ticket are in its catch-up.
    absl::flat_hash_map<std::string, uint64_t> cuts;
  };
  struct Entry {
    uint64_t ticket;
    std::string job_id;
    std::shared_ptr<const v1::ReplicaUpdate> update;
  };

  uint64_t Append(std::string job_id, v1::ReplicaUpdate update)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The releases now due (every waiter at or below the least ack of the
  // standbys in sync; all of them if none is; none while the published
  // list names a standby not in sync), taken out of waiting_.
  std::vector<std::function<void()>> DueLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The addresses of the standbys in sync that have acknowledged what was
  // released during their catch-up (each holds every state a member may
  // hold), sorted, once each.
  std::vector<std::string> InSyncLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Drops log entries no follower still needs.
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(uint64_t id, absl::string_view why) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckFollow(const v1::FollowRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The catch-up of follower `id`: every job's replica, then CaughtUp.
  bool WriteCatchUp(
      uint64_t id,
      grpc::ServerReaderWriter<v1::ReplicaUpdate, v1::FollowMessage>* stream);

  const ReplicationOptions options_;
  const std::function<uint64_t()> epoch_;
  const std::function<bool()> serving_;
  Coordinator* coordinator_ = nullptr;

  absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_follower_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Follower> followers_ ABSL_GUARDED_BY(mu_);
  std::deque<Entry> log_ ABSL_GUARDED_BY(mu_);
  std::multimap<uint64_t, std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);

  // The synchronous standbys: what the list says (last written), and what
  // is being written now (it may have landed).
  SyncPublisher publish_ ABSL_GUARDED_BY(mu_);
  std::string advertise_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> published_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> writing_ ABSL_GUARDED_BY(mu_);
  bool stop_publishing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread publisher_;
};

// The standby's side.
class ReplicaFollower {
 public:
  ReplicaFollower(ReplicationOptions options, Coordinator* coordinator);
  ~ReplicaFollower();

  // Follows `primary` (host:port) of election epoch `epoch` from now on
  // (a new catch-up), until Stop or another Follow.
  void Follow(std::string primary, uint64_t epoch) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops following and returns once the stream has ended; the jobs stay
  // as they are. Returns whether they were in sync when it ended (caught
  // up, and every update applied without error): the promoted standby then
  // serves them.
  bool Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // The address this standby gives its primary (the synchronous-standby
  // list names it): --ha_advertise, or its default once the port is bound.
  // Before the first Follow.
  void set_advertise(std::string address) ABSL_LOCKS_EXCLUDED(mu_);

  // The last update applied (0: none), and whether in sync now.
  uint64_t applied() ABSL_LOCKS_EXCLUDED(mu_);
  bool in_sync() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();
  // One stream to `primary`: returns when it ends (with why).
  absl::Status FollowOnce(const std::string& primary, uint64_t epoch,
                          uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);

  const ReplicationOptions options_;
  Coordinator* const coordinator_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string primary_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool in_sync_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::string advertise_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_REPLICATION_H_
