// A small blocking etcd v3 client: the calls that the election
// (ha/election.h) needs, over etcd's gRPC API. Thread-safe.
//
// Endpoints: tried in the order given, starting at the last one that
// answered; a call that gets UNAVAILABLE or DEADLINE_EXCEEDED from one moves
// on to the next, once round the list. Every attempt has a deadline:
// rpc_timeout from its start, or the call's own deadline if that is sooner;
// a call given a deadline never runs past it, but one without can take
// rpc_timeout per endpoint. Each call also asks etcd to answer only with a
// leader (the "hasleader" metadata of etcd's clientv3), so a member cut off
// from its cluster says UNAVAILABLE instead of serving stale reads.
//
// Errors: absl codes (the same numbering as gRPC's), each message naming the
// endpoint and the call, e.g. "etcd 127.0.0.1:2379: LeaseGrant: deadline
// exceeded after 1s"; when every endpoint failed, the code of the last and
// the messages of all, "; " between them.
//
// Retries after a deadline can repeat a call that etcd did apply. The calls
// below are written so that this is harmless: see each one.
//
// TLS to etcd is not done yet: plain-text channels only.
#ifndef LOCALSGD_HA_ETCD_CLIENT_H_
#define LOCALSGD_HA_ETCD_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace localsgd {

struct EtcdClientOptions {
  // host:port of etcd's client URLs, at least one. Plain text (no TLS yet).
  std::vector<std::string> endpoints;
  // Deadline of each attempt at a call on one endpoint. > 0.
  absl::Duration rpc_timeout = absl::Seconds(1);

  absl::Status Validate() const;
};

// A lease as etcd granted it.
struct EtcdLease {
  int64_t id = 0;
  // What etcd granted: whole seconds, and at least etcd's minimum TTL
  // (1.5 election timeouts rounded up: 2 s with etcd's defaults), so it can
  // be more than what was asked.
  absl::Duration ttl;
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  // 0: no lease.
  int64_t lease = 0;
};

struct EtcdGetResult {
  // Absent: no such key.
  std::optional<EtcdKeyValue> kv;
  // The store's revision when the read was served: a watch from revision + 1
  // misses nothing that happened to the key after this read.
  int64_t revision = 0;
};

// The outcome of CreateIfAbsent.
struct EtcdCampaign {
  // True: the key is ours (created by this call, with our value and lease).
  bool won = false;
  // The key's create revision now: ours if won, else the holder's.
  int64_t create_revision = 0;
  // The holder's value and lease (ours if won).
  std::string holder;
  int64_t holder_lease = 0;
  // The store's revision when the transaction was applied.
  int64_t revision = 0;
};

// The outcome of WaitForChange.
struct EtcdChange {
  enum Kind {
    kTimeout,  // no event for the key within the timeout
    kPut,      // the key was created or changed: kv is what it became
    kDelete,   // the key was deleted (or its lease expired)
  };
  Kind kind = kTimeout;
  // The event's revision (kPut, kDelete).
  int64_t revision = 0;
  // kPut: the key after the event.
  std::optional<EtcdKeyValue> kv;
};

// Ends a WaitForChange from another thread: Cancel() ends the wait in
// progress and every later one given this object, which then return
// CANCELLED at once. Thread-safe; must outlive the waits given it.
class EtcdCancel {
 public:
  void Cancel();
  bool cancelled() const;

 private:
  friend class EtcdClient;
  // Registers the context of a wait; false if already cancelled.
  bool Attach(grpc::ClientContext* context);
  void Detach(grpc::ClientContext* context);

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class EtcdClient {
 public:
  // Validates the options and makes one channel per endpoint; connects
  // lazily (an etcd that is down makes calls fail, not Create).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(
      EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // Each call below ends by `deadline` at the latest (DEADLINE_EXCEEDED).
  static constexpr absl::Time kNoDeadline = absl::InfiniteFuture();

  // A new lease of ttl (rounded up to whole seconds, at least 1 s). A retry
  // after a deadline can leave an unused lease behind; it expires by itself.
  absl::StatusOr<EtcdLease> GrantLease(absl::Duration ttl,
                                       absl::Time deadline = kNoDeadline);
  // Renews the lease once (a LeaseKeepAlive stream: one request, one
  // response) and returns the TTL etcd answered with, counted from when etcd
  // received the request. NOT_FOUND: the lease is gone (expired or
  // revoked).
  absl::StatusOr<absl::Duration> KeepAliveOnce(
      int64_t lease, absl::Time deadline = kNoDeadline);
  // Revokes the lease, deleting the keys attached to it. OK as well if the
  // lease was already gone.
  absl::Status RevokeLease(int64_t lease, absl::Time deadline = kNoDeadline);
  // One transaction: if the key does not exist, puts value under lease (0:
  // none); else reads the key. A retry that finds the key held by this very
  // lease (the first attempt was applied, its answer lost) counts as won,
  // with the key's create revision.
  absl::StatusOr<EtcdCampaign> CreateIfAbsent(
      const std::string& key, const std::string& value, int64_t lease,
      absl::Time deadline = kNoDeadline);
  // The key (absent if none) and the store's revision.
  absl::StatusOr<EtcdGetResult> Get(const std::string& key,
                                    absl::Time deadline = kNoDeadline);
  // Deletes the key only if its create revision is create_revision (the
  // creation we know of, not a later one). True if it deleted it.
  absl::StatusOr<bool> DeleteIfCreated(const std::string& key,
                                       int64_t create_revision,
                                       absl::Time deadline = kNoDeadline);
  // Puts value under `key` (no lease) only if `guard`'s create revision is
  // guard_create_revision (e.g. only while this primary's election key is
  // the one it created) and, with key_mod_revision >= 0, only if `key` was
  // last modified at key_mod_revision (0: it does not exist), so that a
  // write that arrives late (its caller gave up on it) cannot replace a
  // later one. Returns the revision of the write, or 0 if a condition did
  // not hold and nothing was put.
  absl::StatusOr<int64_t> PutIfCreated(const std::string& key,
                                       const std::string& value,
                                       const std::string& guard,
                                       int64_t guard_create_revision,
                                       int64_t key_mod_revision,
                                       absl::Time deadline = kNoDeadline);
  // Puts value under the key, no lease; returns the store's revision after.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                              absl::Time deadline = kNoDeadline);
  // Watches the key from after_revision + 1 and returns its first event, or
  // kTimeout if none came within timeout. The watch is cancelled on return.
  // OUT_OF_RANGE: after_revision + 1 was compacted away (read the key again).
  // DEADLINE_EXCEEDED: etcd did not even set up the watch within timeout.
  // CANCELLED: `cancel` was cancelled (may be null).
  absl::StatusOr<EtcdChange> WaitForChange(const std::string& key,
                                           int64_t after_revision,
                                           absl::Duration timeout,
                                           EtcdCancel* cancel = nullptr);

  const EtcdClientOptions& options() const { return options_; }

 private:
  struct Stubs;
  struct Endpoint;
  explicit EtcdClient(EtcdClientOptions options);

  // Runs attempt(stubs, context) on the endpoints in turn, as the header
  // comment says; `call` names it in errors. attempt returns the gRPC status
  // as an absl::Status without a message prefix.
  // Each attempt's deadline is attempt_timeout (default rpc_timeout) from
  // its start, or `deadline` if sooner.
  template <typename Attempt>
  absl::Status RunWithFailover(const char* call, absl::Time deadline,
                               Attempt attempt);
  template <typename Attempt>
  absl::Status RunWithFailover(const char* call, absl::Time deadline,
                               absl::Duration attempt_timeout, Attempt attempt);

  const EtcdClientOptions options_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  absl::Mutex mu_;
  // The endpoint that answered last: where the next call starts.
  size_t preferred_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_HA_ETCD_CLIENT_H_
