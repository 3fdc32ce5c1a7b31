// NodeGroup <-> c10d::ProcessGroup, for code that already uses LibTorch's
// distributed API (this header includes c10d's ProcessGroup.hpp).
#ifndef LOCALSGD_CLIENT_NODE_GROUP_C10D_H_
#define LOCALSGD_CLIENT_NODE_GROUP_C10D_H_

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "client/node_group.h"

namespace localsgd {

// Wraps an existing process group of any backend (Gloo, NCCL, MPI, ...);
// the NodeGroup shares ownership. `group` must not be null.
NodeGroup WrapProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group);

// The wrapped process group; null for an empty handle.
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupOf(const NodeGroup& group);

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_NODE_GROUP_C10D_H_
