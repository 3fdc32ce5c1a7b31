// One coordinator shard as the client sees it: where its calls go
// (ShardEndpoints), this process's membership there (member id,
// heartbeats), what the member holds of the shard's chunks (MemberState)
// and the transport that pumps the Sync and FetchState stream machines
// (client/sync_stream.h) over gRPC, with retries and re-joins. Without
// sharding the client has exactly one, owning every chunk. Internal to the
// client library; not installed.
//
// Thread-safety: Client drives a replica from one thread at a time (its own
// in Client::ForEachReplica); the heartbeat thread touches only mu_-guarded
// fields and the thread-safe endpoints.
#ifndef LOCALSGD_CLIENT_REPLICA_H_
#define LOCALSGD_CLIENT_REPLICA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/endpoints.h"
#include "client/member_state.h"
#include "client/sync_stream.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

class Replica {
 public:
  // `options` must outlive the replica.
  Replica(const ClientOptions& options,
          std::unique_ptr<ShardEndpoints> endpoints, uint64_t incarnation);
  ~Replica();
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;

  std::string address() const { return endpoints_->address(); }
  const JoinInfo& info() const { return info_; }
  ShardSpec shard() const { return info_.shard; }
  RoundId state_round() const { return member_.state_round(); }

  // Joins with `layout` (whole model of `total` elements) and starts
  // heartbeats. `expect_shard`: the shard this replica held before (a
  // re-join), to check it still does.
  absl::Status Join(const Layout& layout, uint64_t total,
                    const ShardSpec* expect_shard);
  // Seeds this replica's chunks of `params` or fetches them.
  absl::Status Initialize(const Layout& layout, absl::Span<float> params);
  // This replica's chunks of the job's state into `params`; its round.
  absl::StatusOr<RoundId> FetchState(const Layout& layout,
                                     absl::Span<float> params);
  // Client::Sync for this replica's chunks, re-joining if needed.
  // `work`: what the contribution says of itself (SyncHeader).
  absl::StatusOr<SyncOutcome> Sync(const Layout& layout,
                                   absl::Span<float> params,
                                   SyncWork work = {});
  // Ends the membership; stops heartbeats.
  absl::Status Leave();

 private:
  absl::Status CheckJoinInfo(const JoinInfo& info, uint64_t total,
                             const ShardSpec* expect_shard) const;
  absl::StatusOr<SyncOutcome> Rejoin(const Layout& layout,
                                     absl::Span<float> params, SyncWork work);
  // `work`: what the contribution after the seed says (its steps, its
  // weight).
  absl::StatusOr<SyncOutcome> ReseedThenContribute(const Layout& layout,
                                                   SeedOrigin origin,
                                                   absl::Span<float> params,
                                                   const SyncWork& work);
  // Sends the replica's chunks of `params` as `plan` says and stores the
  // result (MemberState: a failed Sync leaves `params` as they were).
  absl::StatusOr<SyncOutcome> SyncRound(const Layout& layout,
                                        const SyncPlan& plan,
                                        absl::Span<float> params);
  // One attempt of each stream over `connection`.
  absl::Status SyncAttempt(Connection& connection, const Layout& layout,
                           SyncOutcome* outcome);
  absl::Status FetchAttempt(Connection& connection, const Layout& layout,
                            absl::Span<float> params, RoundId* round,
                            uint64_t* state_id);
  SyncStreamOptions StreamOptions(const Layout& layout) const;
  // Runs `attempt` on the connection in use with the retry policy of the
  // options (client/retry.h), waiting on its channel: a retry comes as soon
  // as the coordinator is reachable again, at the latest after the backoff;
  // at once where the endpoints moved to another address.
  absl::Status WithRetries(
      absl::string_view what,
      const std::function<absl::Status(Connection&)>& attempt);

  void StartHeartbeats(MemberId member, absl::Duration interval);
  void StopHeartbeats();
  void HeartbeatLoop(absl::Duration interval);

  const ClientOptions& options_;
  const std::unique_ptr<ShardEndpoints> endpoints_;
  const uint64_t incarnation_;
  JoinInfo info_;
  uint64_t total_ = 0;  // elements of the whole layout
  MemberState member_;
  StagingPool staging_;
  std::thread heartbeat_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = true;
  MemberId member_id_ ABSL_GUARDED_BY(mu_);
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_REPLICA_H_
