// Sync that overlaps training (eager updates, Streaming DiLoCo's overlap):
// the sync of round r runs on a thread of its own while the caller goes on
// training, and its result is merged into the parameters the caller holds
// then, keeping the local progress made in the meantime:
//
//   theta <- theta_r + (theta_now - theta_snapshot)
//
// where theta_snapshot is what Start was given (the contribution to round
// r) and theta_r the round's result, bit for bit what every member and the
// coordinator hold (with ClientOptions::error_reset, plus this member's
// residual). In a job of pseudo-gradients the next contribution is then
// theta_next - (the round's state): the local progress since the snapshot,
// plus whatever the caller trains next (and the residual, with error
// reset). With an outer optimizer (OUTER_NESTEROV,
// OUTER_SGD) theta_r is the coordinator's outer step from the snapshot's
// round; the rule is the same. Every merge lands one round late by
// construction: the model trains on for the duration of the sync from the
// state it contributed.
//
// No LibTorch: flat fp32 spans as Client::Sync takes them. Used by
// LocalSGD (LocalSGDOptions::overlap), the Python package and
// bench/sync_bench.
//
// Memory: two model copies of fp32 (the buffer the client syncs and the
// snapshot), allocated once.
//
// Thread-safety: one thread drives a BackgroundSync; the client must not be
// used by anyone else while a sync is in flight (its heartbeats go on).
#ifndef LOCALSGD_CLIENT_BACKGROUND_SYNC_H_
#define LOCALSGD_CLIENT_BACKGROUND_SYNC_H_

#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace localsgd {

class BackgroundSync {
 public:
  // `client` (joined and initialized, with num_elements parameters) must
  // outlive this object.
  explicit BackgroundSync(Client* client);
  // Waits for a sync in flight (its result is dropped).
  ~BackgroundSync();
  BackgroundSync(const BackgroundSync&) = delete;
  BackgroundSync& operator=(const BackgroundSync&) = delete;

  // Copies `params` (the snapshot) and starts client->Sync of them on the
  // sync thread. FAILED_PRECONDITION if a sync is in flight (Finish it
  // first); INVALID_ARGUMENT if the size is not the client's.
  // `work`: as Client::Sync's.
  absl::Status Start(absl::Span<const float> params, SyncWork work = {});

  // Whether a sync was started and not yet finished.
  bool in_flight() const { return in_flight_; }
  // Whether the sync in flight is done (Finish will not wait).
  bool Ready() const ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for the sync in flight and merges its result into `params`
  // (theta_r + (params - snapshot), element by element in fp32). Returns
  // the sync's outcome, or its error with `params` untouched.
  // FAILED_PRECONDITION if no sync is in flight.
  absl::StatusOr<SyncOutcome> Finish(absl::Span<float> params)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The snapshot and the round's result of the last Finish (for node
  // groups, which merge on every rank).
  absl::Span<const float> snapshot() const { return snapshot_; }
  absl::Span<const float> result() const { return buffer_; }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  Client* const client_;
  // The buffer the sync thread hands to Client::Sync (the contribution in,
  // theta_r out), and the snapshot; owned by the sync thread from Start to
  // the result, by the caller otherwise.
  std::vector<float> buffer_;
  std::vector<float> snapshot_;
  bool in_flight_ = false;

  mutable absl::Mutex mu_;
  bool work_ ABSL_GUARDED_BY(mu_) = false;
  // What the sync in flight says of its contribution.
  SyncWork said_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::StatusOr<SyncOutcome>> result_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_BACKGROUND_SYNC_H_
