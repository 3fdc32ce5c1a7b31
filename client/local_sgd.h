// LocalSGD for LibTorch modules: Hugging Face accelerate's `LocalSGD`, with a
// localsgd coordinator in place of a torch.distributed all-reduce.
//
// Every `local_sgd_steps`-th call of Step() replaces every parameter of the
// module with its mean over all members of the job. Only parameters are
// averaged (module.parameters(), as accelerate does): buffers such as
// BatchNorm running statistics and optimizer state (momentum) stay local.
//
// Typical use, one per worker process (compiled and run as
// tests/node/snippets_test.cc):
//
//   ClientOptions client_options;
//   client_options.target = "localhost:50051";
//   client_options.job_id = "mnist";
//   client_options.settings.local_sgd_steps = 16;
//   absl::StatusOr<std::unique_ptr<Client>> client =
//       Client::Create(client_options);
//   if (!client.ok()) return client.status();
//   LocalSGDOptions options;
//   options.local_sgd_steps = 16;
//   absl::StatusOr<std::unique_ptr<LocalSGD>> local_sgd =
//       LocalSGD::Create(*model, client->get(), options);
//   if (!local_sgd.ok()) return local_sgd.status();
//   for (int step = 0; step < steps; ++step) {
//     // ... forward, backward, optimizer.step() ...
//     if (absl::Status s = (*local_sgd)->Step(); !s.ok()) return s;
//   }
//   // The final sync (accelerate's __exit__), then leave the job.
//   if (absl::Status s = (*local_sgd)->Close(); !s.ok()) return s;
//   return (*client)->Leave();
//
// Node-local averaging (LocalSGDOptions::node_group): the processes of a node
// form a c10d process group (client/node_group.h; NCCL for CUDA tensors,
// Gloo for CPU, or any group the caller wraps). At every sync, in this order
// and in lockstep on every rank of the group:
//  1. the parameters are flattened into one fp32 tensor on their device
//     (allocated once, reused) and all-reduced within the node (SUM, then
//     divided by the group size: the node mean);
//  2. rank 0 (the node's leader, the only rank with a Client, joined with
//     ClientOptions::weight = group size) copies the node mean into one
//     reused host buffer (pinned when the parameters are on CUDA; no copy at
//     all for CPU tensors), syncs it with the coordinator and copies the
//     result back;
//  3. rank 0 broadcasts a small status (ok / skipped / error code, round,
//     contributors) and, if ok, the global mean; every rank writes it into
//     its parameters. When the leader skips a sync (coordinator unreachable,
//     keep_training_when_unavailable) every rank skips it and keeps its own
//     parameters; when the leader's sync fails, every rank returns an error
//     with the leader's code.
// If a process of the node dies, the others' collectives fail (Gloo notices
// a closed connection at once; otherwise after NodeGroupOptions::timeout)
// and they return ABORTED; the leader's lease then runs out and the
// coordinator drops the node. Restarting the whole node (torchrun restarts
// all local workers together) brings it back as a late joiner: the new
// leader fetches the job's state in Create and broadcasts it to the node.
//
// This header includes no LibTorch header; local_sgd.cc and the internal
// client/node_sync.h (the node group's collectives) do.
//
// Thread-safety: none. One thread drives a LocalSGD (the thread that trains
// the module); the module must not be trained concurrently with Step(),
// SyncNow() or Close().
//
// Lifetime: `module` and `client` must outlive the LocalSGD. The set of
// parameters of the module must not change after Create (moving the module
// to another device or dtype with module.to() is fine: parameters keep their
// identity).
//
// Errors: no call throws. Exceptions LibTorch throws (c10::Error) are caught
// and returned as INTERNAL (or INVALID_ARGUMENT where the input is at fault);
// errors of the client are returned as they are.
#ifndef LOCALSGD_CLIENT_LOCAL_SGD_H_
#define LOCALSGD_CLIENT_LOCAL_SGD_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/background_sync.h"
#include "client/client.h"
#include "client/node_group.h"
#include "src/layout.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace localsgd {

struct LocalSGDOptions {
  // K: optimizer steps between two syncs (>= 1). Should equal the job's
  // local_sgd_steps (ClientOptions::settings.local_sgd_steps).
  int local_sgd_steps = 8;
  // When false, LocalSGD is a pass-through, as accelerate's
  // LocalSGD(enabled=False): Create neither joins nor initializes, Step()
  // only counts, Close() does nothing, and `client` may be null.
  bool enabled = true;
  // When a sync cannot reach the coordinator (UNAVAILABLE or
  // DEADLINE_EXCEEDED after the client's retries), keep the local parameters
  // and go on training: Step() returns OK and the next sync tries again
  // (the client joins again if the coordinator forgot the member). When
  // false, Step() returns the error.
  bool keep_training_when_unavailable = true;
  // The node-local process group (see the top of this file); an empty
  // handle (the default) makes this process a member of its own. With a
  // group, every rank of it must call Create, Step, SyncNow and Close in
  // lockstep; rank 0 passes a Client whose ClientOptions::weight equals the
  // group's size, the other ranks pass nullptr.
  NodeGroup node_group;
  // Training that does not wait for the network (client/background_sync.h):
  // every K-th Step() starts the round's sync in the background and
  // returns at once; the first Step() that finds the result arrived merges
  // it as theta_r + (theta_now - theta_snapshot), keeping the local steps
  // made during the sync; a sync still in flight at the next K-th step is
  // waited for and merged first. Close() merges the one in flight, then
  // makes the final (blocking) sync. One round of delay: the model trains
  // from its own state while its round runs.
  // With a node group the merge is in lockstep, at sync points only: every
  // K-th Step() all-reduces the node mean; the leader waits for the round
  // in flight (started K steps before) and merges it into the node mean,
  // theta_r + (mean_now - mean_then), starts the next round from that and
  // broadcasts it; every rank goes on from it (from the node mean when no
  // round was merged). Same collectives as a blocking sync; the node
  // behaves as one member of weight = the group's size. Default off.
  bool overlap = false;

  // INVALID_ARGUMENT if local_sgd_steps < 1.
  absl::Status Validate() const;
};

class LocalSGD {
 public:
  // Makes the module's parameters the job's global state and returns the
  // LocalSGD that keeps them averaged. In order:
  //  1. collects module.named_parameters() (recursive, registration order)
  //     into a Layout: name, shape and dtype of each parameter;
  //  2. client->Join(layout) (Create must be given a client that has not
  //     joined yet);
  //  3. flattens the parameters to fp32 and calls client->Initialize: the
  //     first member seeds the job with its parameters, later members fetch
  //     the job's state;
  //  4. writes the resulting values back into the parameters in place.
  // With a node group, steps 2-3 run on rank 0 only, which then broadcasts
  // the state to the group (after checking that every rank has the same
  // number of parameter elements and the right client).
  // On return every member's module holds the same parameters.
  //
  // Errors: INVALID_ARGUMENT (options invalid; null client while enabled; no
  // parameters; a parameter that is not floating point;
  // client->options().settings.local_sgd_steps set and different from
  // options.local_sgd_steps), FAILED_PRECONDITION (the job's local_sgd_steps
  // differs from options.local_sgd_steps; in that case the client has
  // joined and the caller should Leave), INTERNAL (LibTorch failed), and any
  // error of Client::Join / Client::Initialize. With a node group also:
  // INVALID_ARGUMENT on every rank if any rank's parameters differ in size,
  // rank 0 has no client or a weight other than the group size, or another
  // rank has a client; the leader's error code on the other ranks when the
  // leader fails; ABORTED when a collective fails (a process of the node
  // died). Blocks on those RPCs and collectives.
  static absl::StatusOr<std::unique_ptr<LocalSGD>> Create(
      torch::nn::Module& module, Client* client, LocalSGDOptions options);

  // Calls Close() if it was not called, and logs its error if it fails. Like
  // Close(), this may block on a final sync.
  ~LocalSGD();

  LocalSGD(const LocalSGD&) = delete;
  LocalSGD& operator=(const LocalSGD&) = delete;

  // Call once after every optimizer step. Counts the step; every
  // local_sgd_steps-th call syncs (SyncNow) if enabled. Returns the sync's
  // error, or FAILED_PRECONDITION after Close().
  absl::Status Step();

  // Averages the parameters with the job now, whatever the step count:
  // flattens them to fp32 into the staging buffer (copying from any device
  // and floating-point dtype), contributes them with client->Sync (which
  // blocks until the round closes), and copies the average back into the
  // parameters in place, each in its own dtype and on its own device.
  // With a node group, the node mean first and the leader alone syncing
  // (see the top of this file).
  // Errors: FAILED_PRECONDITION when disabled or after Close(), INTERNAL
  // (LibTorch failed), ABORTED (a collective of the node group failed), and
  // any error of Client::Sync (on the other ranks of a node group: the
  // leader's code), in which case the parameters are left as they were.
  absl::Status SyncNow();

  // Ends LocalSGD as accelerate's __exit__ does: a final sync if enabled
  // (whether or not the last Step() synced), which with
  // ClientOptions::error_reset leaves the global state alone in the
  // parameters (SyncWork::last). Does not Leave the job: the caller owns
  // the client. Idempotent: only the first call syncs; later
  // calls return OK.
  absl::Status Close();

  // Closes without the final sync, for error paths where the other members
  // may be gone and a sync could wait for its round until the client's
  // sync_timeout. Later Close() calls return OK; the destructor does nothing
  // (but wait for a background sync in flight, which ends with its round,
  // the coordinator's answer or the client's timeouts).
  void Abandon() { closed_ = true; }

  // Optimizer steps counted by Step().
  int64_t steps() const { return steps_; }
  // Overlap: whether a sync runs in the background now, and how many
  // results were merged (each also counts in num_syncs()).
  bool sync_in_flight() const {
    if (options_.node_group.valid()) return node_round_in_flight_;
    return background_ != nullptr && background_->in_flight();
  }
  int64_t num_merges() const { return num_merges_; }
  // Successful syncs (including the one of Close()).
  int64_t num_syncs() const { return num_syncs_; }
  // Wall time spent in successful and failed SyncNow() calls, flattening and
  // writing back included; with overlap, the time Step() and Close() waited
  // for background results and merged them.
  double sync_seconds_total() const { return sync_seconds_total_; }
  // The outcome of the last successful sync; default-constructed before the
  // first.
  const SyncOutcome& last_outcome() const { return last_outcome_; }
  // Syncs skipped because the coordinator was unreachable (see
  // keep_training_when_unavailable), and whether the last attempt was one.
  int64_t num_skipped_syncs() const { return num_skipped_syncs_; }
  bool last_sync_skipped() const { return last_sync_skipped_; }
  // Bytes of chunk payload this process sent to / received from the
  // coordinator over all syncs (0 on ranks other than a node group's 0).
  uint64_t bytes_sent_total() const { return bytes_sent_total_; }
  uint64_t bytes_received_total() const { return bytes_received_total_; }
  // Seconds the last successful sync took.
  double last_sync_seconds() const { return last_sync_seconds_; }
  // The layout this LocalSGD joined with (also when disabled).
  const Layout& layout() const { return layout_; }
  // Total number of parameter elements (the flat buffer's size).
  uint64_t num_elements() const { return num_elements_; }
  bool enabled() const { return options_.enabled; }
  bool closed() const { return closed_; }

 private:
  // The module's parameters, the flat buffers and the node group (LibTorch
  // tensors); defined in local_sgd.cc so that this header needs no LibTorch.
  struct Params;
  // Create's first part: the module's parameters, their layout's specs, and
  // the tensors LocalSGD keeps for them.
  static absl::Status ReadParameters(torch::nn::Module& module, Params& params,
                                     std::vector<TensorSpec>& specs);

  LocalSGD(Client* client, LocalSGDOptions options,
           std::unique_ptr<Params> params, Layout layout);

  // One sync's state as it passes from one step of DoSync, or of
  // NodeSyncPointOverlapped, to the next (this rank's own error, the
  // leader's outcome or report); defined in local_sgd.cc.
  struct SyncAttempt;
  struct SyncPoint;

  // SyncNow() without its checks; Close() uses it too. In steps: the node
  // mean, SyncWithCoordinator (the leader), ShareSyncResult (a node group),
  // FinishSync.
  // `last`: Close's final sync (SyncWork::last).
  absl::Status DoSync(bool last = false);
  void SyncWithCoordinator(SyncAttempt& sync, bool last);
  absl::Status ShareSyncResult(SyncAttempt& sync);
  absl::Status FinishSync(SyncAttempt& sync,
                          std::chrono::steady_clock::time_point start);
  // Overlap: starts the background sync of the current parameters; waits
  // for the one in flight and merges it into the parameters.
  absl::Status StartBackgroundSync();
  absl::Status MergeBackgroundSync();
  // Overlap with a node group: a sync point in lockstep on every rank (the
  // node mean; the leader merges the round in flight into it and, if
  // `start_next`, starts the next round from the result; the result to
  // every rank). See LocalSGDOptions::overlap.
  // In steps: the node mean, MergeAndStartRound (the leader), the leader's
  // report and result to every rank, CountSyncPoint.
  absl::Status NodeSyncPointOverlapped(bool start_next);
  void MergeAndStartRound(bool start_next, SyncPoint& point);
  void CountSyncPoint(const SyncPoint& point);
  // The round in flight merged (MergeBackgroundSync, or with a node group
  // NodeSyncPointOverlapped without starting the next).
  absl::Status MergeInFlight();
  // Counts a finished sync's outcome (DoSync and the merge).
  void CountOutcome(const SyncOutcome& outcome, double seconds);
  // Create's log line on success (`grouped`: with a node group): the
  // leader's job, member and starting state, or a follower's rank.
  void LogCreated(bool grouped) const;
  // Create's steps 2-4 once the LocalSGD exists (see Create);
  // `misconfigured`: this rank of a node group has a setup error that must
  // fail the whole group.
  absl::Status Initialize(bool misconfigured);
  // Copies the parameters into the flat fp32 tensor on their device, in
  // layout order.
  absl::Status Flatten();
  // Copies the flat tensor back into the parameters in place.
  absl::Status Unflatten();
  // The flat tensor to the host buffer the client reads, and back (`what`:
  // "merged" or "averaged", for the error); nothing where they are one
  // tensor (CPU parameters).
  absl::Status ToHost();
  // Initialize's parts: the node group's agreement on its setup, the
  // leader's join and seed or fetch, and its outcome shared with the group.
  absl::Status CheckNodeGroup(bool misconfigured);
  absl::Status JoinAndInitialize();
  absl::Status ShareInitialState(const absl::Status& status);
  absl::Status FromHost(absl::string_view what);
  // Whether this process talks to the coordinator (no group, or rank 0).
  bool is_leader() const { return client_ != nullptr; }

  Client* const client_;  // not owned; null when disabled or not rank 0
  const LocalSGDOptions options_;
  // Flat buffers allocated once in Create and reused by every sync.
  const std::unique_ptr<Params> params_;
  const Layout layout_;
  uint64_t num_elements_ = 0;

  int64_t steps_ = 0;
  // steps_ when the last contribution was handed to the coordinator: what
  // the next one holds is steps_ - contributed_at_ (SyncWork).
  int64_t contributed_at_ = 0;
  int64_t num_syncs_ = 0;
  int64_t num_skipped_syncs_ = 0;
  bool last_sync_skipped_ = false;
  double sync_seconds_total_ = 0;
  double last_sync_seconds_ = 0;
  uint64_t bytes_sent_total_ = 0;
  uint64_t bytes_received_total_ = 0;
  SyncOutcome last_outcome_;
  bool closed_ = false;
  // Overlap (leader only): the background sync, and when it started.
  std::unique_ptr<BackgroundSync> background_;
  std::chrono::steady_clock::time_point background_start_;
  int64_t num_merges_ = 0;
  // Overlap with a node group: the leader's round in flight, as every rank
  // of the node knows it (from the leader's report).
  bool node_round_in_flight_ = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_LOCAL_SGD_H_
