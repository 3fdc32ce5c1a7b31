// The gRPC client of a localsgd coordinator. No LibTorch: it works on a flat
// span of fp32 parameters laid out as the job's Layout describes.
//
// Typical use, one per worker process (or per node leader); compiled and run
// as tests/node/snippets_test.cc:
//
//   ClientOptions options;
//   options.target = "localhost:50051";
//   options.job_id = "mnist";
//   absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
//   if (!client.ok()) return client.status();
//   absl::Status s = (*client)->Join(MakeLayout(tensors));
//   if (s.ok()) s = (*client)->Initialize(flat_params);  // seed or fetch
//   for (int round = 0; s.ok() && round < rounds; ++round) {
//     // ... K local steps on flat_params ...
//     absl::StatusOr<SyncOutcome> out = (*client)->Sync(flat_params);
//     s = out.status();
//   }
//   absl::Status left = (*client)->Leave();
//   return s.ok() ? left : s;
//
// Thread-safety: one thread drives Join/Initialize/Sync/FetchState/Leave; the
// client runs its own heartbeat thread, started by Join and joined by Leave or
// the destructor. Calls from several threads at once are not supported.
#ifndef LOCALSGD_CLIENT_CLIENT_H_
#define LOCALSGD_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/channel_security.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

struct ClientOptions {
  // gRPC target of the coordinator, e.g. "localhost:50051" or
  // "dns:///svc:50051". Ignored when `replicas` is set.
  std::string target;
  // Sharded coordinators (docs/design.md "Scale out"): the address of every
  // replica, in any order. Each replica owns the chunks i with i mod S ==
  // its shard index (it says which at Join; --shard_index/--shard_count);
  // the client syncs with all of them in parallel. Empty: `target` alone.
  // In Kubernetes list the StatefulSet pods' stable names
  // (coordinator-0.coordinator:50051, ...), or see resolve_replicas.
  //
  // A shard with standby coordinators (--ha_etcd) is one entry that lists
  // its addresses separated by '|' ("coord-0a:50051|coord-0b:50051"; so can
  // `target`): calls go to the first, and on UNAVAILABLE (a standby, a
  // primary that died or lost its lease) to the next, in turn.
  std::vector<std::string> replicas;
  // Take the replicas from DNS: `target` ("host:port") is resolved once, at
  // Create, and every address it resolves to is a replica (a headless
  // Service). A replica that comes back under a new address is not found
  // again: prefer stable per-replica names in `replicas`.
  bool resolve_replicas = false;
  // Job to join; created by its first member.
  std::string job_id;
  // Member name for logs and status; default "<hostname>/<pid>".
  std::string member_name;
  // Weight of this member's contribution (> 0); a node leader passes its
  // node's number of workers.
  double weight = 1.0;
  // Settings this member asks for; zero fields take the job's / coordinator's.
  // The averaging rule (mode, outer_lr, outer_momentum) and the wire dtype
  // (float32, bfloat16, int8, int4) are per job. `contribution` unset means
  // pseudo-gradients: the client then sends its change since the state it
  // holds and keeps that state (its anchor, one model of fp32) and, for a
  // lossy wire dtype, its error feedback (two more); kParameters joins a job
  // of parameters (the protocol before pseudo-gradients).
  JobSettings settings;
  // Full duplex (jobs of pseudo-gradients): each Sync reads the round's
  // result chunks while it still writes its own, and the coordinator sends
  // each as soon as every participant has given it (SyncHeader.
  // early_results), so that the upload and the download of a round
  // overlap. false: the result only after the whole upload, as the
  // protocol before it.
  bool early_results = true;
  // With early results, once the first result chunk is back, chunk c is
  // written only while c < result chunks received + max_lead_chunks: the
  // upload keeps pace with the round's results, so that members that share
  // the coordinator's link finish their uploads together (a chunk is final
  // only once the slowest member gave it) instead of one flow taking the
  // link while the results of the others wait. 0: no limit. Only against a
  // coordinator that says it keeps sending results while a member writes
  // (CoordinatorPolicy.paced_uploads; an older one gets the upload as fast
  // as it goes), and only in jobs whose rounds have no deadline (neither
  // the coordinator's --round_deadline nor deadline_mode adaptive): a paced
  // member completes only as the slowest participant gives its chunks, so
  // a deadline, which closes a round once enough members are complete,
  // could not leave a slow or dead member out.
  uint32_t max_lead_chunks = 4;
  // With early results: called for each result chunk that comes back
  // before its round's result message, once decoded, with the chunk's first
  // element in the whole layout and the values there of the state the
  // Sync will hold if it succeeds. On the Sync's threads (one per replica),
  // before Sync returns; an attempt retried may call it again for a chunk,
  // with other values if it syncs another round. For a coordinator that
  // passes a round's result on as it arrives (a regional coordinator's
  // upstream link, server/upstream_link.h). With several replicas it may
  // run on several threads at once; `values` is valid during the call
  // only. Null: none.
  std::function<void(uint64_t offset, absl::Span<const float> values)>
      on_early_result;
  // Error reset, for a pseudo-gradient job on a lossy wire dtype: the
  // parameters a Sync hands back are the round's result (the global state)
  // plus this member's residual (what the encoding of its deltas has not
  // sent yet), so that its local training goes on from its own unsent
  // work instead of dropping it from the parameters until the encoding
  // sends it. Each round then encodes parameters - anchor, in which the
  // residual already is, with no error feedback added. The global state
  // stays bit for bit every member's and the coordinator's; the parameters
  // differ from it by each member's residual until a Sync with
  // SyncWork::last (LocalSGD's final sync), which hands back the global
  // state alone. A Sync whose delta was not counted hands back the global
  // state and drops the residual, as without error reset. false: the
  // parameters are the global state after every Sync. No effect on
  // float32, parameter jobs or a member that only seeds. The residual lives
  // in the parameters: a caller that keeps them in bfloat16 or float16
  // (LocalSGD on such a model) rounds part of it away.
  bool error_reset = false;
  // Deadline of each unary RPC attempt.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Deadline of one Sync attempt, including the wait for the round to close.
  absl::Duration sync_timeout = absl::Minutes(30);
  // Retries of UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED: exponential backoff
  // from initial_backoff, doubling up to max_backoff, with +-20% jitter, for
  // at most max_retry_time in total per call.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(1);
  absl::Duration max_retry_time = absl::Minutes(1);

  // Transport security and the job's token (client/channel_security.h,
  // docs/security.md). All empty: plaintext without a token.
  ChannelSecurity security;

  // INVALID_ARGUMENT on empty target/job_id or a weight that is not > 0, or
  // TLS / token fields that do not go together. Files are read by
  // Client::Create.
  absl::Status Validate() const;
};

// What a Sync did: how the round ended for this member (RoundOutcome:
// round, contributed, late, contributors, contributor_weight) and what it
// cost.
struct SyncOutcome : RoundOutcome {
  // Bytes of chunk payload sent and received.
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // The member had lost its membership (lease expired, coordinator restarted)
  // and joined again during this Sync.
  bool rejoined = false;
  // Where the time of the last attempt went, from the stream's start: until
  // the last chunk was written (the writes' end handed to gRPC), until the
  // first result chunk arrived (with early results it may come before the
  // last write), and until the last one did. With several replicas, the
  // slowest replica's. Zero when the attempt did not get that far.
  absl::Duration upload_time;
  absl::Duration first_result_time;
  absl::Duration result_time;
  // Chunk writes of the last attempt that waited for results
  // (ClientOptions::max_lead_chunks); summed over the replicas.
  uint32_t paced_writes = 0;
};

// What Join learnt: JoinInfo (src/types.h).

class Replica;  // one coordinator shard (client/replica.h)

class Client {
 public:
  // Validates options and creates the channel (connects lazily).
  static absl::StatusOr<std::unique_ptr<Client>> Create(ClientOptions options);
  // Leaves the job (best effort) and joins the heartbeat thread.
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Joins the job with `layout` (which must carry its fingerprint; see
  // MakeLayout) and starts heartbeats. Retries UNAVAILABLE. Errors:
  // FAILED_PRECONDITION (layout/settings differ from the job's; the message
  // names the first difference), INVALID_ARGUMENT, RESOURCE_EXHAUSTED.
  absl::Status Join(const Layout& layout);

  // Makes `params` (num_elements values) the job's global state: fetches it
  // if the job has state, otherwise seeds the job with `params` (if another
  // member seeded first, adopts that seed instead). On return every member
  // holds identical parameters. Requires Join.
  absl::Status Initialize(absl::Span<float> params);

  // Overwrites `params` with the job's current global state. Requires Join.
  // Returns the state's round.
  absl::StatusOr<RoundId> FetchState(absl::Span<float> params);

  // Contributes `params` to the next round and overwrites them in place with
  // the round's result (in a job of pseudo-gradients: the state they were
  // trained from plus the round's global delta, bit for bit what every
  // member and the coordinator hold; with ClientOptions::error_reset, plus
  // this member's residual unless `work.last`). Blocks until the round
  // closes. Retries UNAVAILABLE and ABORTED (a repeated chunk counts once)
  // for up to max_retry_time.
  //
  // Faults that re-joining mends are handled here, invisibly to the caller
  // except for `rejoined` in the outcome: if the coordinator no longer knows
  // the member (its lease ran out, or the coordinator restarted) or the job is
  // behind the member (restarted from an older checkpoint, or without state),
  // the client joins again with the same layout and then
  //  - seeds the job with `params` if it has no state (MEAN mode re-seed);
  //  - contributes `params` to the job's next round if the job's state is not
  //    newer than the one `params` was trained from;
  //  - otherwise (it missed rounds) adopts the job's state (FetchState).
  // Requires Initialize.
  //
  // `work.local_steps` (>= 0): the local steps `params` hold since the
  // state they were trained from; the coordinator counts them by fate
  // (merged or thrown away: the job's goodput). -1: not said.
  // `work.weight`: this contribution's weight in place of
  // ClientOptions::weight (times its step weight); for a member that
  // stands for a varying number of others.
  absl::StatusOr<SyncOutcome> Sync(absl::Span<float> params,
                                   SyncWork work = {});

  // Ends membership at once and stops heartbeats. Idempotent.
  absl::Status Leave();

  // Valid after Join. With several replicas: the member id and settings of
  // shard 0's replica, the whole layout's chunks and elements, the shortest
  // lease, and whether every replica had state.
  const JoinInfo& info() const { return info_; }
  // Round of the state the parameters hold (after Initialize / Sync); with
  // several replicas, the oldest of their rounds (they agree unless a
  // replica lost its state).
  RoundId state_round() const;
  // Coordinator replicas (1 without sharding).
  size_t num_replicas() const { return replicas_.size(); }
  const ClientOptions& options() const { return options_; }

 private:
  explicit Client(ClientOptions options);
  // Runs `fn` for every replica, in parallel (replica 0 on this thread);
  // returns the first error, naming the replica when there are several.
  absl::Status ForEachReplica(const std::function<absl::Status(Replica&)>& fn);
  // FAILED_PRECONDITION unless the joined replicas are the shards 0..S-1 of
  // S (S = their number) with the same chunk size and wire dtype.
  absl::Status CheckReplicaSet() const;

  ClientOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  JoinInfo info_;
  Layout layout_;  // as given to Join, for joining again
  bool joined_ = false;
};

// The addresses `host:port` resolves to, as "ip:port" / "[ipv6]:port", sorted
// and without duplicates (ClientOptions::resolve_replicas). UNAVAILABLE if
// the name does not resolve; INVALID_ARGUMENT if it has no port.
absl::StatusOr<std::vector<std::string>> ResolveReplicaAddresses(
    absl::string_view host_port);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_CLIENT_H_
