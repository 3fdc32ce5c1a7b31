// NodeGroup <-> c10d::ProcessGroup, for code that already uses LibTorch's
// distributed API (this header includes c10d's ProcessGroup.hpp).
#ifndef LOCALSGD_CLIENT_NODE_GROUP_C10D_H_
#define LOCALSGD_CLIENT_NODE_GROUP_C10D_H_

#include <torch/version.h>

#include <initializer_list>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "client/node_group.h"

namespace localsgd {

// Wraps an existing process group of any backend (Gloo, NCCL, MPI, ...);
// the NodeGroup shares ownership. `group` must not be null.
NodeGroup WrapProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group);

// The wrapped process group; null for an empty handle.
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupOf(const NodeGroup& group);

#if TORCH_VERSION_MAJOR >= 2
// LibTorch 2.x only. There, c10d's ProcessGroupGloo and ProcessGroupNCCL
// are c10d::Backends, no longer c10d::ProcessGroups: a ProcessGroup holds
// one backend per device type and dispatches each collective by its
// tensors' device. This wraps `backend` (of kind `type`, e.g.
// ProcessGroup::BackendType::NCCL) in a ProcessGroup of the same rank and
// size over `store` that sends tensors of `devices` to it and reports its
// name as getBackendName(), as torch.distributed.init_process_group does
// (Gloo: CPU and CUDA; NCCL: CUDA). A collective on a tensor of another
// device type fails with a c10::Error. For WrapProcessGroup.
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupForBackend(
    c10::intrusive_ptr<c10d::Store> store,
    c10::intrusive_ptr<c10d::Backend> backend,
    c10d::ProcessGroup::BackendType type,
    std::initializer_list<c10::DeviceType> devices);
#endif

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_NODE_GROUP_C10D_H_
