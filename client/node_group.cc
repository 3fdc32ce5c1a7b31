#include "client/node_group.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

// c10d's Gloo backend is in every LibTorch built with USE_C10D_GLOO, but its
// header needs Gloo's own headers, which a LibTorch may not ship (PyTorch's
// pip wheels do not). Without them this build has no Gloo node groups.
#if __has_include(<gloo/algorithm.h>)
#define LOCALSGD_HAVE_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#else
#define LOCALSGD_HAVE_GLOO 0
#endif

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/log_bridge.h"
#include "client/node_group_c10d.h"

namespace localsgd {

class NodeGroup::Impl {
 public:
  Impl(c10::intrusive_ptr<c10d::Store> store,
       c10::intrusive_ptr<c10d::ProcessGroup> group)
      : store_(std::move(store)), group_(std::move(group)) {}

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

 private:
  // Kept alive for the group's lifetime: local rank 0 serves it. Null when
  // the caller wrapped its own group.
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

int NodeGroup::rank() const { return impl_ ? impl_->group()->getRank() : 0; }
int NodeGroup::size() const { return impl_ ? impl_->group()->getSize() : 1; }
std::string NodeGroup::backend() const {
  return impl_ ? impl_->group()->getBackendName() : std::string("none");
}

NodeGroup WrapProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  LOCALSGD_CHECK(group) << "WrapProcessGroup: null process group";
  return NodeGroup(std::make_shared<NodeGroup::Impl>(
      c10::intrusive_ptr<c10d::Store>(), std::move(group)));
}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupOf(const NodeGroup& group) {
  if (group.impl() == nullptr) return {};
  return group.impl()->group();
}

#if TORCH_VERSION_MAJOR >= 2
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupForBackend(
    c10::intrusive_ptr<c10d::Store> store,
    c10::intrusive_ptr<c10d::Backend> backend,
    c10d::ProcessGroup::BackendType type,
    std::initializer_list<c10::DeviceType> devices) {
  LOCALSGD_CHECK(backend) << "ProcessGroupForBackend: null backend";
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      std::move(store), backend->getRank(), backend->getSize());
  // The default backend is what getBackendName() reports ("gloo", "nccl").
  group->setDefaultBackend(type);
  for (const c10::DeviceType device : devices) {
    group->setBackend(device, type, backend);
  }
  return group;
}
#endif

bool NodeGroupHasGloo() { return LOCALSGD_HAVE_GLOO != 0; }

bool NodeGroupHasNccl() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

namespace {

// Splits "host:port" (the host may be a bracketed IPv6 address).
absl::Status ParseHostPort(const std::string& address, std::string* host,
                           uint16_t* port) {
  const size_t colon = address.rfind(':');
  uint32_t value = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &value) || value == 0 ||
      value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node store address '", address,
        "' is not host:port (e.g. 127.0.0.1:29500); set "
        "LOCALSGD_NODE_STORE or MASTER_ADDR/MASTER_PORT, or --node_store"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = static_cast<uint16_t>(value);
  return absl::OkStatus();
}

absl::StatusOr<int> EnvInt(const char* name) {
  const char* value = std::getenv(name);
  int parsed = 0;
  if (value == nullptr || !absl::SimpleAtoi(value, &parsed)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name, " is ",
        value == nullptr ? "not set" : absl::StrCat("'", value, "'"),
        "; expected an integer (torchrun sets LOCAL_RANK and "
        "LOCAL_WORLD_SIZE; scripts/run-nodes.sh does too)"));
  }
  return parsed;
}

}  // namespace

absl::Status NodeGroupOptions::Validate() const {
  if (local_world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("NodeGroupOptions.local_world_size must be >= 1, got ",
                     local_world_size));
  }
  if (local_rank < 0 || local_rank >= local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NodeGroupOptions.local_rank ", local_rank,
        " is not in [0, local_world_size=", local_world_size, ")"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NodeGroupOptions.timeout must be > 0");
  }
  std::string host;
  uint16_t port = 0;
  return ParseHostPort(store_address, &host, &port);
}

// Over 60 lines on purpose: the store, then the process group, each with
// its backend and LibTorch-version #ifs inline, so that every build variant
// (NCCL or not, Gloo or not, LibTorch 1.x or 2.x) reads in one place.
absl::StatusOr<NodeGroup> MakeNodeGroup(const NodeGroupOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.cuda && !NodeGroupHasNccl()) {
    return absl::FailedPreconditionError(
        "MakeNodeGroup: cuda requested but this build has no NCCL path "
        "(LibTorch without CUDA/NCCL; see the configure message "
        "'localsgd: NCCL node-local path'); use Gloo with CPU tensors");
  }
  if (!options.cuda && !NodeGroupHasGloo()) {
    return absl::FailedPreconditionError(
        "MakeNodeGroup: this build has no Gloo node groups: its LibTorch "
        "ships no Gloo headers (gloo/algorithm.h; PyTorch's pip wheels do "
        "not); use cuda (NCCL), or build against a LibTorch with them "
        "(Debian's libtorch-dev + libgloo-dev)");
  }
  std::string host;
  uint16_t port = 0;
  if (absl::Status s = ParseHostPort(options.store_address, &host, &port);
      !s.ok()) {
    return s;
  }
  const auto timeout =
      std::chrono::milliseconds(absl::ToInt64Milliseconds(options.timeout));
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = port;
    store_options.isServer = options.local_rank == 0;
    store_options.numWorkers = options.local_world_size;
    store_options.waitWorkers = false;  // the group's rendezvous waits
    store_options.timeout = timeout;
    store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "MakeNodeGroup: local rank ", options.local_rank, " could not ",
        options.local_rank == 0 ? "serve" : "reach", " the node store at ",
        options.store_address, ": ", e.what()));
  }
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    if (options.cuda) {
#ifdef USE_C10D_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          store, options.local_rank, options.local_world_size, nccl_options);
#if TORCH_VERSION_MAJOR >= 2
      // CUDA tensors only, as before (ProcessGroupNCCL rejects CPU ones).
      group = ProcessGroupForBackend(store, std::move(nccl),
                                     c10d::ProcessGroup::BackendType::NCCL,
                                     {c10::DeviceType::CUDA});
#else
      group = std::move(nccl);
#endif
#endif
    } else {
#if LOCALSGD_HAVE_GLOO
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
      // Loopback: the group never leaves the machine.
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
          store, options.local_rank, options.local_world_size, gloo_options);
#if TORCH_VERSION_MAJOR >= 2
      // Gloo takes CPU and CUDA tensors, as a 1.x ProcessGroupGloo did.
      group = ProcessGroupForBackend(
          store, std::move(gloo), c10d::ProcessGroup::BackendType::GLOO,
          {c10::DeviceType::CPU, c10::DeviceType::CUDA});
#else
      group = std::move(gloo);
#endif
#endif  // LOCALSGD_HAVE_GLOO
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "MakeNodeGroup: local rank ", options.local_rank, " of ",
        options.local_world_size, " could not form the node group (",
        options.cuda ? "nccl" : "gloo", ", store ", options.store_address,
        "): ", e.what(),
        "; did all local processes start with the same store address?"));
  }
  LOCALSGD_LOG(INFO) << "node group: local rank " << options.local_rank
                     << " of " << options.local_world_size << ", backend "
                     << group->getBackendName() << ", store "
                     << options.store_address;
  return NodeGroup(
      std::make_shared<NodeGroup::Impl>(std::move(store), std::move(group)));
}

absl::StatusOr<NodeGroup> MakeNodeGroupFromEnv(bool cuda) {
  NodeGroupOptions options;
  options.cuda = cuda;
  absl::StatusOr<int> rank = EnvInt("LOCAL_RANK");
  if (!rank.ok()) return rank.status();
  absl::StatusOr<int> size = EnvInt("LOCAL_WORLD_SIZE");
  if (!size.ok()) return size.status();
  options.local_rank = *rank;
  options.local_world_size = *size;
  if (const char* store = std::getenv("LOCALSGD_NODE_STORE");
      store != nullptr && *store != '\0') {
    options.store_address = store;
  } else {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (addr == nullptr || port == nullptr) {
      return absl::InvalidArgumentError(
          "MakeNodeGroupFromEnv: no store address: set LOCALSGD_NODE_STORE="
          "host:port, or MASTER_ADDR and MASTER_PORT");
    }
    options.store_address = absl::StrCat(addr, ":", port);
  }
  return MakeNodeGroup(options);
}

}  // namespace localsgd
