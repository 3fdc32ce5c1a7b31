// A node-local process group for LocalSGD: the processes of one machine (or
// one torchrun "node") average among themselves with a c10d collective, and
// only the group's rank 0 talks to the coordinator, with weight = group size.
// See client/local_sgd.h (LocalSGDOptions::node_group) and docs/design.md
// ("Node-local averaging").
//
// NodeGroup is a small copyable handle (shared ownership) around a
// c10d::ProcessGroup of any backend. This header includes no LibTorch
// header; client/node_group_c10d.h wraps or unwraps a c10d::ProcessGroup for
// code that already uses LibTorch.
//
//   absl::StatusOr<NodeGroup> group = MakeNodeGroupFromEnv();
//   if (!group.ok()) return group.status();
//   LocalSGDOptions options;
//   options.node_group = *group;
//   // Only group.rank() == 0 creates a Client, with
//   // ClientOptions.weight = group.size(); the others pass nullptr.
//
// Thread-safety: a NodeGroup is used by one thread (the one that trains);
// copies share the same process group.
#ifndef LOCALSGD_CLIENT_NODE_GROUP_H_
#define LOCALSGD_CLIENT_NODE_GROUP_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace localsgd {

struct NodeGroupOptions {
  // This process's rank in the node, in [0, local_world_size).
  int local_rank = 0;
  // Number of processes of the node (>= 1).
  int local_world_size = 1;
  // host:port of the node's c10d TCPStore; local rank 0 serves it, the
  // others connect to it.
  std::string store_address;
  // Use NCCL (tensors on CUDA). Only where LibTorch was built with NCCL
  // (NodeGroupHasNccl()); otherwise MakeNodeGroup returns
  // FAILED_PRECONDITION. False: Gloo (CPU tensors).
  bool cuda = false;
  // Timeout of the store's rendezvous and of every collective: a process
  // whose peer died returns an error after at most this long (Gloo usually
  // notices a closed connection at once).
  absl::Duration timeout = absl::Minutes(5);

  // INVALID_ARGUMENT on a rank outside [0, size), a size < 1, or a
  // store_address that is not host:port (when size > 1).
  absl::Status Validate() const;
};

class NodeGroup {
 public:
  // The process group, its rank, size and backend; defined in
  // node_group.cc (needs LibTorch).
  class Impl;

  // An empty handle: rank 0 of a group of 1, no process group.
  NodeGroup() = default;
  explicit NodeGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  // Rank of this process in the node, and the node's process count.
  int rank() const;
  int size() const;
  // "gloo", "nccl", ... ("none" for an empty handle).
  std::string backend() const;
  // Whether this handle holds a process group.
  bool valid() const { return impl_ != nullptr; }

  Impl* impl() const { return impl_.get(); }

 private:
  std::shared_ptr<Impl> impl_;
};

// Makes the node group: a c10d TCPStore at options.store_address (served by
// local rank 0) and a ProcessGroupNCCL (options.cuda) or ProcessGroupGloo
// over loopback. Blocks until all local_world_size processes have joined or
// options.timeout passed. Errors: INVALID_ARGUMENT (options),
// FAILED_PRECONDITION (cuda without NCCL support), UNAVAILABLE (store or
// rendezvous failed, e.g. timed out: the message says which).
absl::StatusOr<NodeGroup> MakeNodeGroup(const NodeGroupOptions& options);

// MakeNodeGroup with options from the usual torchrun environment:
// LOCAL_RANK, LOCAL_WORLD_SIZE, and the store address LOCALSGD_NODE_STORE
// (host:port), else MASTER_ADDR:MASTER_PORT. `cuda` as in NodeGroupOptions.
// INVALID_ARGUMENT when a variable is missing or malformed; otherwise as
// MakeNodeGroup.
absl::StatusOr<NodeGroup> MakeNodeGroupFromEnv(bool cuda = false);

// Whether this build has Gloo node groups (NodeGroupOptions::cuda = false):
// its LibTorch ships Gloo's headers (Debian's does; PyTorch's pip wheels do
// not). Without them MakeNodeGroup without cuda is FAILED_PRECONDITION.
bool NodeGroupHasGloo();

// Whether this build of localsgd compiled the NCCL path (LibTorch with CUDA
// and USE_C10D_NCCL); see the configure-time message
// "localsgd: NCCL node-local path".
bool NodeGroupHasNccl();

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_NODE_GROUP_H_
