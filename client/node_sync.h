// Node-group averaging for LocalSGD (client/local_sgd.h, "Node-local
// averaging"): the c10d collectives the processes of a node run around
// their leader's sync with the coordinator. The node mean (NodeMean), the
// leader's report of its part (ShareReport) and the leader's parameters
// (Broadcast) to every rank, and the error a follower returns when the
// leader failed (LeaderFailed).
//
// Internal to localsgd_torch: included by client/local_sgd.cc only, and
// not installed (it includes LibTorch's c10d headers, which the public
// headers must not).
//
// Every collective below is called by every rank of the group, in the same
// order, with tensors of the same size and dtype on the group's device; it
// blocks until every rank has taken part (or the group's timeout,
// NodeGroupOptions::timeout, passed). A rank that skips one leaves the
// others waiting in it until then. A failed collective is ABORTED: the
// group cannot go on in lockstep (a process of the node died or timed out).
//
// Thread-safety: none; one thread (the one that trains) per group.
#ifndef LOCALSGD_CLIENT_NODE_SYNC_H_
#define LOCALSGD_CLIENT_NODE_SYNC_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"

namespace localsgd {
namespace node_sync {

// The leader's status tensor (int64, on the group's device): kStatusSize
// fields, broadcast from rank 0 at every sync and at Create.
enum StatusField : int64_t {
  kKind = 0,          // StatusKind
  kCode = 1,          // absl::StatusCode when kError
  kRound = 2,         // SyncOutcome.round
  kContributors = 3,  // SyncOutcome.contributors
  kFlags = 4,         // flag bits (outcome, merged, started)
  kStatusSize = 5,
};
enum StatusKind : int64_t { kOk = 0, kSkipped = 1, kError = 2 };

// What the node's leader tells its group after its part of a sync.
struct NodeReport {
  StatusKind kind = kOk;
  int64_t code = 0;      // absl::StatusCode when kError
  SyncOutcome outcome;   // round, contributors and flags when kOk
  bool merged = false;   // overlap: a background round's result was merged
  bool started = false;  // overlap: a round is in flight after this sync
};

// Every rank: broadcasts the leader's report from rank 0 through `status`
// (the int64 tensor of kStatusSize on the group's device, overwritten).
// `leader`: whether this is rank 0; `mine` is read on the leader only (its
// outcome only when mine.kind is kOk). Blocks on the broadcast. Returns the
// leader's report as read back from the tensor, on every rank (the leader
// included): kind, code, merged, started, and of the outcome only round,
// contributors, contributed, late and rejoined (its other fields are not
// sent and stay default).
// Errors: INTERNAL ("LocalSGD: status: LibTorch error: ...") when writing
// or reading the tensor fails (a failed write skips the broadcast), ABORTED
// when the broadcast fails.
absl::StatusOr<NodeReport> ShareReport(c10d::ProcessGroup& group,
                                       at::Tensor& status, bool leader,
                                       const NodeReport& mine);

// Every rank: all-reduces `tensor` in place with `op`. Blocks until done.
// ABORTED on failure, its message naming `what` ("LocalSGD: node group
// <what> failed: ...") and the cause.
absl::Status Allreduce(c10d::ProcessGroup& group, at::Tensor& tensor,
                       c10d::ReduceOp op, absl::string_view what);

// Every rank: rank 0's `tensor` into `tensor` on every rank. Blocks until
// done. ABORTED on failure, as Allreduce.
absl::Status Broadcast(c10d::ProcessGroup& group, at::Tensor& tensor,
                       absl::string_view what);

// Every rank: `flat` becomes the node mean in place: an all-reduce (SUM)
// named "all-reduce", then a division by the group's size (Gloo has no AVG;
// SUM then divide works everywhere). Blocks on the all-reduce. A failed
// all-reduce is returned (ABORTED); a failed division is not: it goes into
// `local`, this rank's own error (unless `local` already holds one), which
// the rank reports after the group's remaining collectives, and OK is
// returned.
absl::Status NodeMean(c10d::ProcessGroup& group, at::Tensor& flat,
                      absl::Status& local);

// A follower (rank != 0): the error it returns when the leader's step
// `what` ("its sync", ...) failed with `code` (the leader's report): the
// same code, a message that points at the leader's log. No collective.
absl::Status LeaderFailed(int64_t code, absl::string_view what);

}  // namespace node_sync
}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_NODE_SYNC_H_
