#include "client/node_sync.h"

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace localsgd {
namespace node_sync {
namespace {

// The kFlags field's bits.
enum NodeFlag : int64_t {
  kContributed = 1,
  kLate = 2,
  kRejoined = 4,
  kMerged = 8,    // overlap: a background round's result was merged
  kStarted = 16,  // overlap: the next round started in the background
};

// A torch exception as a status: the message without LibTorch's backtrace
// (as local_sgd.cc words it).
absl::Status FromTorch(absl::string_view what, const c10::Error& e) {
  return absl::InternalError(
      absl::StrCat(what, ": LibTorch error: ", e.what_without_backtrace()));
}

// Runs a collective and waits for it. A failure (a peer died, a timeout) is
// ABORTED: the group cannot go on in lockstep.
absl::Status RunCollective(
    absl::string_view what,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& collective) {
  try {
    c10::intrusive_ptr<c10d::Work> work = collective();
    work->wait();
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
      message = error->what_without_backtrace();
    }
    return absl::AbortedError(absl::StrCat(
        "LocalSGD: node group ", what,
        " failed: a process of this node (perhaps its leader, local rank 0) "
        "died or timed out, so the node has left the job; restart the whole "
        "node (torchrun restarts all local workers) and it re-joins as a "
        "late joiner. Cause: ",
        message));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Allreduce(c10d::ProcessGroup& group, at::Tensor& tensor,
                       c10d::ReduceOp op, absl::string_view what) {
  return RunCollective(what, [&] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    return group.allreduce(tensors, options);
  });
}

absl::Status Broadcast(c10d::ProcessGroup& group, at::Tensor& tensor,
                       absl::string_view what) {
  return RunCollective(what, [&] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    options.rootTensor = 0;
    return group.broadcast(tensors, options);
  });
}

absl::StatusOr<NodeReport> ShareReport(c10d::ProcessGroup& group,
                                       at::Tensor& status, bool leader,
                                       const NodeReport& mine) {
  try {
    std::vector<int64_t> fields(kStatusSize, 0);
    if (leader) {
      fields[kKind] = mine.kind;
      fields[kCode] = mine.code;
      if (mine.kind == kOk) {
        fields[kRound] = static_cast<int64_t>(mine.outcome.round);
        fields[kContributors] = mine.outcome.contributors;
        fields[kFlags] = (mine.outcome.contributed ? kContributed : 0) |
                         (mine.outcome.late ? kLate : 0) |
                         (mine.outcome.rejoined ? kRejoined : 0);
      }
      fields[kFlags] |=
          (mine.merged ? kMerged : 0) | (mine.started ? kStarted : 0);
    }
    status.copy_(at::tensor(fields, at::kLong));
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: status", e);
  }
  if (absl::Status s = Broadcast(group, status, "status"); !s.ok()) return s;
  NodeReport report;
  try {
    const at::Tensor fields = status.cpu();
    report.kind = static_cast<StatusKind>(fields[kKind].item<int64_t>());
    report.code = fields[kCode].item<int64_t>();
    const int64_t flags = fields[kFlags].item<int64_t>();
    report.outcome.round = static_cast<RoundId>(fields[kRound].item<int64_t>());
    report.outcome.contributors =
        static_cast<uint32_t>(fields[kContributors].item<int64_t>());
    report.outcome.contributed = (flags & kContributed) != 0;
    report.outcome.late = (flags & kLate) != 0;
    report.outcome.rejoined = (flags & kRejoined) != 0;
    report.merged = (flags & kMerged) != 0;
    report.started = (flags & kStarted) != 0;
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: status", e);
  }
  return report;
}

absl::Status NodeMean(c10d::ProcessGroup& group, at::Tensor& flat,
                      absl::Status& local) {
  if (absl::Status s =
          Allreduce(group, flat, c10d::ReduceOp::SUM, "all-reduce");
      !s.ok()) {
    return s;
  }
  try {
    flat.div_(static_cast<double>(group.getSize()));
  } catch (const c10::Error& e) {
    if (local.ok()) local = FromTorch("LocalSGD: node mean", e);
  }
  return absl::OkStatus();
}

absl::Status LeaderFailed(int64_t code, absl::string_view what) {
  return absl::Status(
      static_cast<absl::StatusCode>(code),
      absl::StrCat(
          "LocalSGD: the node's leader (local rank 0) failed ", what,
          " with code ",
          absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
          "; its log has the cause"));
}

}  // namespace node_sync
}  // namespace localsgd
