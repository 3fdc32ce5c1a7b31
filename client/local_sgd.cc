#include "client/local_sgd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <chrono>
#include <exception>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "client/log_bridge.h"
#include "client/node_group_c10d.h"
#include "client/node_sync.h"
#include "client/sync_schedule.h"
#include "src/member_ref.h"

namespace localsgd {

struct LocalSGD::Params {
  // Handles of the module's parameters: they share storage (and identity)
  // with the module's, so copy_() into them updates the module.
  std::vector<at::Tensor> tensors;
  // Element offset of each tensor in the flat buffer.
  std::vector<uint64_t> offsets;
  // All parameters as one fp32 tensor on the (first) parameter's device:
  // what the node group all-reduces and broadcasts.
  at::Tensor flat;
  // What Client::Sync reads and writes: `flat` itself when that is on the
  // CPU (no copy), otherwise one host buffer, pinned for fast, reusable
  // device <-> host copies.
  at::Tensor host;
  // The leader's status broadcast (node_sync::StatusField), on flat's
  // device.
  at::Tensor status;
  // The node group; null without one.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

namespace {

absl::StatusOr<DType> ToDType(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", c10::toString(type),
                       " is not a floating-point type LocalSGD can average "
                       "(float32, bfloat16, float16, float64)"));
  }
}

// A torch exception as a status: the message without LibTorch's backtrace.
absl::Status FromTorch(absl::string_view what, const c10::Error& e) {
  return absl::InternalError(
      absl::StrCat(what, ": LibTorch error: ", e.what_without_backtrace()));
}
absl::Status FromException(absl::string_view what, const std::exception& e) {
  return absl::InternalError(absl::StrCat(what, ": ", e.what()));
}

// Returns `status` with `prefix` in front of its message, same code.
absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

// Create's checks of the leader's `client` (LocalSGD enabled; no node
// group, or its rank 0): INVALID_ARGUMENT when it is null or its
// ClientOptions name another K than `options`.
absl::Status CheckLeaderClient(const Client* client,
                               const LocalSGDOptions& options, bool grouped) {
  if (client == nullptr) {
    return absl::InvalidArgumentError(
        grouped ? "LocalSGD::Create: rank 0 of the node group has a null "
                  "client; the node's leader needs a Client (joined with "
                  "ClientOptions.weight = the group's size)"
                : "LocalSGD::Create: client is null; pass a Client, or set "
                  "LocalSGDOptions.enabled = false to train without "
                  "averaging");
  }
  const uint32_t client_k = client->options().settings.local_sgd_steps;
  if (client_k != 0 &&
      client_k != static_cast<uint32_t>(options.local_sgd_steps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LocalSGD::Create: LocalSGDOptions.local_sgd_steps is ",
                     options.local_sgd_steps,
                     " but ClientOptions.settings.local_sgd_steps is ",
                     client_k, "; pass the same K to both"));
  }
  return absl::OkStatus();
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

absl::Status LocalSGDOptions::Validate() const {
  if (local_sgd_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LocalSGDOptions.local_sgd_steps must be >= 1, got ", local_sgd_steps));
  }
  return absl::OkStatus();
}

LocalSGD::LocalSGD(Client* client, LocalSGDOptions options,
                   std::unique_ptr<Params> params, Layout layout)
    : client_(client),
      options_(options),
      params_(std::move(params)),
      layout_(std::move(layout)) {
  for (const TensorSpec& spec : layout_.tensors) {
    num_elements_ += NumElements(spec);
  }
}

// The module's parameters, in registration order: their handles, offsets
// and specs, and the flat, host and status tensors for them.
absl::Status LocalSGD::ReadParameters(torch::nn::Module& module, Params& params,
                                      std::vector<TensorSpec>& specs) {
  try {
    uint64_t offset = 0;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& tensor = item.value();
      absl::StatusOr<DType> dtype = ToDType(tensor.scalar_type());
      if (!dtype.ok()) {
        return Annotate(
            dtype.status(),
            absl::StrCat("LocalSGD::Create: parameter '", item.key(), "': "));
      }
      TensorSpec spec;
      spec.name = item.key();
      spec.shape = tensor.sizes().vec();
      spec.dtype = *dtype;
      params.tensors.push_back(tensor);
      params.offsets.push_back(offset);
      offset += static_cast<uint64_t>(tensor.numel());
      specs.push_back(std::move(spec));
    }
    if (!specs.empty()) {
      const auto on_device = at::TensorOptions()
                                 .dtype(at::kFloat)
                                 .device(params.tensors.front().device());
      params.flat = at::zeros({static_cast<int64_t>(offset)}, on_device);
      params.host =
          params.flat.is_cpu()
              ? params.flat
              : at::empty(
                    {static_cast<int64_t>(offset)},
                    at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
      params.status =
          at::zeros({node_sync::kStatusSize}, on_device.dtype(at::kLong));
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD::Create: reading the module's parameters", e);
  } catch (const std::exception& e) {
    return FromException("LocalSGD::Create: reading the module's parameters",
                         e);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LocalSGD>> LocalSGD::Create(
    torch::nn::Module& module, Client* client, LocalSGDOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  const bool grouped = options.enabled && options.node_group.valid();
  const bool leader = !grouped || options.node_group.rank() == 0;
  if (options.enabled && leader) {
    if (absl::Status s = CheckLeaderClient(client, options, grouped); !s.ok()) {
      return s;
    }
  }

  // 1. The parameters, in registration order, and their layout.
  auto params = std::make_unique<Params>();
  std::vector<TensorSpec> specs;
  if (absl::Status s = ReadParameters(module, *params, specs); !s.ok()) {
    return s;
  }
  if (specs.empty()) {
    return absl::InvalidArgumentError(
        "LocalSGD::Create: the module has no parameters to average");
  }
  if (grouped) params->group = ProcessGroupOf(options.node_group);

  Layout layout = MakeLayout(std::move(specs));
  auto local_sgd = absl::WrapUnique(
      new LocalSGD(options.enabled && leader ? client : nullptr, options,
                   std::move(params), std::move(layout)));
  if (!options.enabled) {
    LOCALSGD_LOG(INFO) << "LocalSGD disabled: "
                       << local_sgd->layout_.tensors.size() << " tensors, "
                       << local_sgd->num_elements_
                       << " elements; training without averaging";
    return local_sgd;
  }
  // A follower given a client is a setup error, reported by every rank.
  if (absl::Status s = local_sgd->Initialize(
          /*misconfigured=*/grouped && !leader && client != nullptr);
      !s.ok()) {
    // A failed Create must not make the destructor sync.
    local_sgd->closed_ = true;
    return s;
  }
  local_sgd->LogCreated(grouped);
  return local_sgd;
}

void LocalSGD::LogCreated(bool grouped) const {
  if (is_leader()) {
    LOCALSGD_LOG(INFO)
        << "LocalSGD: job '" << client_->options().job_id << "' member_ref "
        << MemberRef(client_->info().member_id) << ": "
        << layout_.tensors.size() << " tensors, " << num_elements_
        << " elements, K=" << options_.local_sgd_steps
        << ", starting from state round " << client_->state_round()
        << (client_->info().has_state ? " (fetched)"
                                      : " (seeded or adopted seed)")
        << (grouped ? absl::StrCat(", leader of a node group of ",
                                   options_.node_group.size(), " (",
                                   options_.node_group.backend(), ")")
                    : std::string());
  } else {
    LOCALSGD_LOG(INFO) << "LocalSGD: local rank " << options_.node_group.rank()
                       << " of " << options_.node_group.size() << " ("
                       << options_.node_group.backend()
                       << "): adopted the leader's parameters, "
                       << num_elements_
                       << " elements, K=" << options_.local_sgd_steps;
  }
}

// Checked together, so that a rank with a bad setup fails the whole group
// instead of leaving the others waiting in a collective.
absl::Status LocalSGD::CheckNodeGroup(bool misconfigured) {
  c10d::ProcessGroup* group = params_->group.get();
  // MAX of (n, -n, bad) gives max n, -min n and whether any rank is bad.
  int64_t bad = misconfigured ? 1 : 0;
  if (misconfigured) {
    LOCALSGD_LOG(ERROR) << "LocalSGD::Create: local rank " << group->getRank()
                        << " was given a Client; only the node leader (rank 0) "
                           "talks to the coordinator, the others pass nullptr";
  }
  if (group->getRank() == 0 &&
      client_->options().weight != static_cast<double>(group->getSize())) {
    LOCALSGD_LOG(ERROR) << "LocalSGD::Create: the node leader's "
                           "ClientOptions.weight is "
                        << client_->options().weight << ", not the group size "
                        << group->getSize();
    bad = 1;
  }
  at::Tensor check;
  try {
    const int64_t n = static_cast<int64_t>(num_elements_);
    check = at::tensor(std::vector<int64_t>{n, -n, bad}, at::kLong)
                .to(params_->flat.device());
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD::Create: node group check", e);
  }
  if (absl::Status s = node_sync::Allreduce(*group, check, c10d::ReduceOp::MAX,
                                            "check at Create");
      !s.ok()) {
    return s;
  }
  check = check.cpu();
  const int64_t max_n = check[0].item<int64_t>();
  const int64_t min_n = -check[1].item<int64_t>();
  if (check[2].item<int64_t>() != 0) {
    return absl::InvalidArgumentError(
        "LocalSGD::Create: node group misconfigured: the leader (local "
        "rank 0) must pass a Client whose ClientOptions.weight equals the "
        "group's size, and the other ranks must pass nullptr (see the "
        "log of the rank at fault)");
  }
  if (max_n != min_n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LocalSGD::Create: the node group's ranks have models of different "
        "sizes (",
        min_n, " to ", max_n,
        " parameter elements); every local process must build the same "
        "model"));
  }
  return absl::OkStatus();
}

// The leader: join, then seed or fetch the job's state into the parameters.
absl::Status LocalSGD::JoinAndInitialize() {
  absl::Status status = client_->Join(layout_);
  const JoinInfo& info = client_->info();
  const uint32_t job_k = info.settings.local_sgd_steps;
  if (status.ok() && job_k != 0 &&
      job_k != static_cast<uint32_t>(options_.local_sgd_steps)) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "LocalSGD::Create: job '", client_->options().job_id, "' syncs every ",
        job_k,
        " steps (its local_sgd_steps) but LocalSGDOptions.local_sgd_steps "
        "is ",
        options_.local_sgd_steps,
        "; set ClientOptions.settings.local_sgd_steps and "
        "LocalSGDOptions.local_sgd_steps to the job's K"));
  }
  if (status.ok() && info.num_elements != 0 &&
      info.num_elements != num_elements_) {
    status = absl::InternalError(absl::StrCat(
        "LocalSGD::Create: the coordinator reports ", info.num_elements,
        " elements for a layout of ", num_elements_));
  }
  if (status.ok()) status = Flatten();
  if (status.ok()) status = ToHost();
  if (status.ok()) {
    status = client_->Initialize(
        absl::MakeSpan(params_->host.data_ptr<float>(), num_elements_));
  }
  if (status.ok()) status = FromHost("initial");
  return status;
}

// A node group: the leader's outcome of `status` to every rank, then (if
// ok) its parameters.
absl::Status LocalSGD::ShareInitialState(const absl::Status& status) {
  c10d::ProcessGroup* group = params_->group.get();
  try {
    params_->status.zero_();
    if (is_leader() && !status.ok()) {
      params_->status.copy_(at::tensor(
          std::vector<int64_t>{node_sync::kError,
                               static_cast<int64_t>(status.code()), 0, 0, 0},
          at::kLong));
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD::Create: status", e);
  }
  if (absl::Status s =
          node_sync::Broadcast(*group, params_->status, "status at Create");
      !s.ok()) {
    return s;
  }
  const at::Tensor leader_status = params_->status.cpu();
  if (leader_status[node_sync::kKind].item<int64_t>() != node_sync::kOk) {
    return is_leader() ? status
                       : node_sync::LeaderFailed(
                             leader_status[node_sync::kCode].item<int64_t>(),
                             "to join and initialize");
  }
  if (absl::Status s =
          node_sync::Broadcast(*group, params_->flat, "initial state");
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

absl::Status LocalSGD::Initialize(bool misconfigured) {
  const bool grouped = params_->group != nullptr;
  if (grouped) {
    if (absl::Status s = CheckNodeGroup(misconfigured); !s.ok()) return s;
  }
  // 2.-4. on the leader: join, seed or fetch; then the node shares it.
  absl::Status status = is_leader() ? JoinAndInitialize() : absl::OkStatus();
  if (grouped) {
    if (absl::Status s = ShareInitialState(status); !s.ok()) return s;
  } else if (!status.ok()) {
    return status;
  }
  return Unflatten();
}

LocalSGD::~LocalSGD() {
  if (closed_) return;
  if (absl::Status s = Close(); !s.ok()) {
    LOCALSGD_LOG(WARNING)
        << "LocalSGD destroyed without Close(); its final sync "
           "failed: "
        << s;
  }
}

absl::Status LocalSGD::Step() {
  if (closed_) {
    return absl::FailedPreconditionError("LocalSGD::Step() after Close()");
  }
  ++steps_;
  if (!options_.enabled) return absl::OkStatus();
  // What this step does: client/sync_schedule.h (the Python LocalSGD
  // follows the same table through the binding).
  StepState state;
  state.steps = static_cast<uint64_t>(steps_);
  state.local_sgd_steps = static_cast<uint64_t>(options_.local_sgd_steps);
  state.since_sync = static_cast<uint64_t>(steps_ - contributed_at_);
  state.budget = last_outcome_.local_steps_budget;
  state.overlap = options_.overlap;
  state.node_group = params_->group != nullptr;
  state.in_flight = background_ != nullptr && background_->in_flight();
  state.ready = state.in_flight && background_->Ready();
  switch (DecideStep(state)) {
    case StepAction::kNone:
      return absl::OkStatus();
    case StepAction::kSync:
      return DoSync();
    case StepAction::kNodeSyncPoint:
      return NodeSyncPointOverlapped(/*start_next=*/true);
    case StepAction::kMerge:
      return MergeBackgroundSync();
    case StepAction::kStart:
      return StartBackgroundSync();
    case StepAction::kMergeThenStart:
      if (absl::Status s = MergeBackgroundSync(); !s.ok()) return s;
      return StartBackgroundSync();
  }
  return absl::OkStatus();
}

absl::Status LocalSGD::StartBackgroundSync() {
  if (absl::Status s = Flatten(); !s.ok()) return s;
  if (background_ == nullptr) {
    background_ = std::make_unique<BackgroundSync>(client_);
  }
  if (absl::Status s = ToHost(); !s.ok()) return s;
  background_start_ = std::chrono::steady_clock::now();
  absl::Status started = background_->Start(
      absl::MakeConstSpan(params_->host.data_ptr<float>(), num_elements_),
      SyncWork{steps_ - contributed_at_});
  if (started.ok()) contributed_at_ = steps_;
  return started;
}

absl::Status LocalSGD::MergeBackgroundSync() {
  const auto start = std::chrono::steady_clock::now();
  // The parameters as they are now, merged on the host (where the result
  // is), then written back.
  absl::Status status = Flatten();
  if (status.ok()) status = ToHost();
  // Without the current parameters on the host the result stays in flight
  // (merging it into stale values would lose the steps since).
  if (!status.ok()) return status;
  absl::StatusOr<SyncOutcome> outcome = background_->Finish(
      absl::MakeSpan(params_->host.data_ptr<float>(), num_elements_));
  // The time this process waited for it, and the merge.
  sync_seconds_total_ += SecondsSince(start);
  if (!outcome.ok()) {
    if ((absl::IsUnavailable(outcome.status()) ||
         absl::IsDeadlineExceeded(outcome.status())) &&
        options_.keep_training_when_unavailable) {
      LOCALSGD_LOG(WARNING)
          << "LocalSGD background sync before step " << steps_
          << " skipped, training on locally: " << outcome.status();
      ++num_skipped_syncs_;
      last_sync_skipped_ = true;
      return absl::OkStatus();
    }
    return outcome.status();
  }
  if (absl::Status s = FromHost("merged"); !s.ok()) return s;
  if (absl::Status s = Unflatten(); !s.ok()) return s;
  last_sync_skipped_ = false;
  ++num_merges_;
  CountOutcome(*outcome, SecondsSince(background_start_));
  return absl::OkStatus();
}

void LocalSGD::CountOutcome(const SyncOutcome& outcome, double seconds) {
  last_outcome_ = outcome;
  bytes_sent_total_ += outcome.bytes_sent;
  bytes_received_total_ += outcome.bytes_received;
  last_sync_seconds_ = seconds;
  ++num_syncs_;
}

absl::Status LocalSGD::SyncNow() {
  if (!options_.enabled) {
    return absl::FailedPreconditionError(
        "LocalSGD::SyncNow(): LocalSGD is disabled (no client)");
  }
  if (closed_) {
    return absl::FailedPreconditionError("LocalSGD::SyncNow() after Close()");
  }
  if (sync_in_flight()) {
    if (absl::Status s = MergeInFlight(); !s.ok()) return s;
  }
  return DoSync();
}

absl::Status LocalSGD::MergeInFlight() {
  return params_->group != nullptr
             ? NodeSyncPointOverlapped(/*start_next=*/false)
             : MergeBackgroundSync();
}

// One overlapped node sync point on this rank, from step to step.
struct LocalSGD::SyncPoint {
  std::chrono::steady_clock::time_point start;
  // This rank's own error so far (Flatten, the node mean, the leader's
  // part); a rank reports it after the node's collectives.
  absl::Status status;
  // The leader: its report to the node, and how long the merged round took.
  node_sync::NodeReport mine;
  double round_seconds = 0;
  // Every rank: the leader's report as the node received it.
  node_sync::NodeReport leader;
};

absl::Status LocalSGD::NodeSyncPointOverlapped(bool start_next) {
  SyncPoint point;
  point.start = std::chrono::steady_clock::now();
  c10d::ProcessGroup& group = *params_->group;
  // 1. The node mean, as in DoSync (a failed Flatten still takes part).
  point.status = Flatten();
  if (absl::Status s = node_sync::NodeMean(group, params_->flat, point.status);
      !s.ok()) {
    sync_seconds_total_ += SecondsSince(point.start);
    return s;
  }
  // 2. The leader merges the round in flight into the node mean (theta_r +
  // (mean_now - mean_then): the node's progress since its contribution) and
  // starts the next round from that.
  if (is_leader()) MergeAndStartRound(start_next, point);
  // 3. The leader's report, then (if it merged) the merged parameters, to
  // every rank. Otherwise every rank already holds the node mean.
  absl::StatusOr<node_sync::NodeReport> leader =
      node_sync::ShareReport(group, params_->status, is_leader(), point.mine);
  if (!leader.ok()) {
    sync_seconds_total_ += SecondsSince(point.start);
    return leader.status();
  }
  point.leader = *leader;
  node_round_in_flight_ = point.leader.started;
  if (point.leader.kind == node_sync::kError) {
    sync_seconds_total_ += SecondsSince(point.start);
    return is_leader() ? point.status
                       : node_sync::LeaderFailed(point.leader.code,
                                                 "its background sync");
  }
  if (point.leader.merged) {
    if (absl::Status s =
            node_sync::Broadcast(group, params_->flat, "broadcast");
        !s.ok()) {
      sync_seconds_total_ += SecondsSince(point.start);
      return s;
    }
  }
  // Every rank continues from the node's state: merged, or the node mean;
  // a rank whose own part failed (Flatten, the mean) keeps its parameters
  // and returns its error.
  if (point.status.ok()) point.status = Unflatten();
  sync_seconds_total_ += SecondsSince(point.start);
  if (!point.status.ok()) return point.status;
  CountSyncPoint(point);
  return absl::OkStatus();
}

// The leader's step 2 of a sync point: the node mean to the host, the round
// in flight (if any) finished and merged into it, and the next one started
// (`start_next`). Fills point.mine; an error goes into point.status.
void LocalSGD::MergeAndStartRound(bool start_next, SyncPoint& point) {
  absl::Status& status = point.status;
  node_sync::NodeReport& mine = point.mine;
  if (status.ok()) status = ToHost();
  if (status.ok() && background_ != nullptr && background_->in_flight()) {
    absl::StatusOr<SyncOutcome> outcome = background_->Finish(
        absl::MakeSpan(params_->host.data_ptr<float>(), num_elements_));
    point.round_seconds = SecondsSince(background_start_);
    if (outcome.ok()) {
      mine.merged = true;
      mine.outcome = *outcome;
    } else if ((absl::IsUnavailable(outcome.status()) ||
                absl::IsDeadlineExceeded(outcome.status())) &&
               options_.keep_training_when_unavailable) {
      LOCALSGD_LOG(WARNING)
          << "LocalSGD background sync before step " << steps_
          << " skipped, training on locally: " << outcome.status();
      mine.kind = node_sync::kSkipped;
    } else {
      status = outcome.status();
    }
  }
  if (status.ok() && mine.merged) status = FromHost("merged");
  if (status.ok() && start_next) {
    if (background_ == nullptr) {
      background_ = std::make_unique<BackgroundSync>(client_);
    }
    background_start_ = std::chrono::steady_clock::now();
    status = background_->Start(
        absl::MakeConstSpan(params_->host.data_ptr<float>(), num_elements_),
        SyncWork{steps_ - contributed_at_});
    if (status.ok()) contributed_at_ = steps_;
  }
  // What is in flight now, whatever failed: a round this sync point could
  // not finish (an error before Finish) is still the sync thread's, and
  // every rank must know it (sync_in_flight, Close) to merge it later.
  mine.started = background_ != nullptr && background_->in_flight();
  if (!status.ok()) {
    mine.kind = node_sync::kError;
    mine.code = static_cast<int64_t>(status.code());
  }
}

// A sync point's end on every rank, once the parameters hold the node's
// state: counts what the leader reported (a skip, or a merged round).
void LocalSGD::CountSyncPoint(const SyncPoint& point) {
  if (point.leader.kind == node_sync::kSkipped) {
    ++num_skipped_syncs_;
    last_sync_skipped_ = true;
  } else if (point.leader.merged) {
    last_sync_skipped_ = false;
    ++num_merges_;
    CountOutcome(is_leader() ? point.mine.outcome : point.leader.outcome,
                 is_leader() ? point.round_seconds : SecondsSince(point.start));
  }
}

absl::Status LocalSGD::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (!options_.enabled) return absl::OkStatus();
  // As accelerate's __exit__: one more sync, even right after a Step() that
  // synced, so that every member ends on the same parameters whatever its
  // step count modulo K. With overlap, the round in flight first.
  if (sync_in_flight()) {
    if (absl::Status s = MergeInFlight(); !s.ok()) {
      return Annotate(s, "LocalSGD::Close(): the background sync failed: ");
    }
  }
  if (absl::Status s = DoSync(/*last=*/true); !s.ok()) {
    return Annotate(s, "LocalSGD::Close(): final sync failed: ");
  }
  LOCALSGD_LOG(INFO) << "LocalSGD closed: " << steps_ << " steps, "
                     << num_syncs_ << " syncs, " << sync_seconds_total_
                     << " s syncing, last round " << last_outcome_.round;
  return absl::OkStatus();
}

// One blocking sync on this rank, from step to step.
struct LocalSGD::SyncAttempt {
  // This rank's own error so far (Flatten, the node mean, the leader's
  // exchange); a rank reports it after the node's collectives.
  absl::Status status;
  // The round's outcome: the leader's own, or on the other ranks of a node
  // group the leader's report (set when it is ok).
  absl::StatusOr<SyncOutcome> outcome;
  // The leader skipped the sync (coordinator unreachable and
  // keep_training_when_unavailable).
  bool skipped = false;
};

absl::Status LocalSGD::DoSync(bool last) {
  const auto start = std::chrono::steady_clock::now();
  c10d::ProcessGroup* group = params_->group.get();
  SyncAttempt sync;
  sync.status = Flatten();
  // 1. The node mean.
  if (group != nullptr) {
    // A failed Flatten (LibTorch error, not expected) still takes part, so
    // that the group stays in lockstep; it reports its error at the end.
    if (absl::Status s =
            node_sync::NodeMean(*group, params_->flat, sync.status);
        !s.ok()) {
      sync_seconds_total_ += SecondsSince(start);
      return s;
    }
  }
  // 2. The leader exchanges it with the coordinator.
  if (is_leader()) SyncWithCoordinator(sync, last);
  // 3. The leader's outcome and the global mean to the whole node.
  if (group != nullptr) {
    if (absl::Status s = ShareSyncResult(sync); !s.ok()) {
      sync_seconds_total_ += SecondsSince(start);
      return s;
    }
  }
  return FinishSync(sync, start);
}

// DoSync's step 2 on the leader: the flat parameters (the node mean) to the
// host, Client::Sync, the global mean back. An error goes into sync.status;
// an unreachable coordinator with keep_training_when_unavailable is a skip
// instead (logged; sync.status cleared).
void LocalSGD::SyncWithCoordinator(SyncAttempt& sync, bool last) {
  absl::Status& status = sync.status;
  if (status.ok()) status = ToHost();
  if (status.ok()) {
    sync.outcome = client_->Sync(
        absl::MakeSpan(params_->host.data_ptr<float>(), num_elements_),
        SyncWork{steps_ - contributed_at_, std::nullopt, last});
    status = sync.outcome.status();
    if (status.ok()) contributed_at_ = steps_;
  }
  if (status.ok()) status = FromHost("averaged");
  if ((absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) &&
      options_.keep_training_when_unavailable) {
    LOCALSGD_LOG(WARNING) << "LocalSGD sync at step " << steps_
                          << " skipped, training on locally: " << status;
    sync.skipped = true;
    status = absl::OkStatus();
  }
}

// DoSync's step 3 with a node group, on every rank: the leader's report
// (error, skip or outcome), then, if ok, the global mean from the leader.
// The other ranks take the skip and the outcome from the report. Returns
// the error that ends the sync here: a failed collective, or on the other
// ranks the leader's failure.
absl::Status LocalSGD::ShareSyncResult(SyncAttempt& sync) {
  c10d::ProcessGroup& group = *params_->group;
  node_sync::NodeReport mine;
  if (is_leader()) {
    if (!sync.status.ok()) {
      mine.kind = node_sync::kError;
      mine.code = static_cast<int64_t>(sync.status.code());
    } else if (sync.skipped) {
      mine.kind = node_sync::kSkipped;
    } else {
      mine.outcome = *sync.outcome;
    }
  }
  absl::StatusOr<node_sync::NodeReport> leader =
      node_sync::ShareReport(group, params_->status, is_leader(), mine);
  if (!leader.ok()) return leader.status();
  if (!is_leader()) {
    if (leader->kind == node_sync::kError) {
      return node_sync::LeaderFailed(leader->code, "its sync");
    }
    sync.skipped = leader->kind == node_sync::kSkipped;
    if (leader->kind == node_sync::kOk) sync.outcome = leader->outcome;
  }
  if (leader->kind == node_sync::kOk) {
    return node_sync::Broadcast(group, params_->flat, "broadcast");
  }
  return absl::OkStatus();
}

// DoSync's end on every rank: the global mean into the parameters unless
// the sync failed or was skipped, then the sync counted.
absl::Status LocalSGD::FinishSync(SyncAttempt& sync,
                                  std::chrono::steady_clock::time_point start) {
  // The parameters are written only on success: a skipped or failed sync
  // leaves them as they were.
  if (sync.status.ok() && !sync.skipped) sync.status = Unflatten();
  const double seconds = SecondsSince(start);
  sync_seconds_total_ += seconds;
  last_sync_skipped_ = sync.skipped;
  if (sync.skipped) {
    ++num_skipped_syncs_;
    return absl::OkStatus();
  }
  if (!sync.status.ok()) return sync.status;

  CountOutcome(*sync.outcome, seconds);
  LOCALSGD_VLOG(1) << "LocalSGD sync at step " << steps_ << ": round "
                   << last_outcome_.round << ", " << last_outcome_.contributors
                   << " contributors, " << seconds << " s";
  return absl::OkStatus();
}

absl::Status LocalSGD::ToHost() {
  if (params_->host.is_same(params_->flat)) return absl::OkStatus();
  try {
    params_->host.copy_(params_->flat);
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: copying parameters to the host", e);
  }
  return absl::OkStatus();
}

absl::Status LocalSGD::FromHost(absl::string_view what) {
  if (params_->host.is_same(params_->flat)) return absl::OkStatus();
  try {
    params_->flat.copy_(params_->host);
  } catch (const c10::Error& e) {
    return FromTorch(absl::StrCat("LocalSGD: copying ", what, " parameters in"),
                     e);
  }
  return absl::OkStatus();
}

absl::Status LocalSGD::Flatten() {
  try {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_->tensors.size(); ++i) {
      const at::Tensor& param = params_->tensors[i];
      if (param.numel() == 0) continue;
      // A view of the tensor's slice of the flat tensor; copy_ converts
      // dtype (and device) and handles non-contiguous parameters in one
      // pass, on the parameters' device.
      params_->flat
          .narrow(0, static_cast<int64_t>(params_->offsets[i]), param.numel())
          .view(param.sizes())
          .copy_(param);
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: copying parameters out", e);
  } catch (const std::exception& e) {
    return FromException("LocalSGD: copying parameters out", e);
  }
  return absl::OkStatus();
}

absl::Status LocalSGD::Unflatten() {
  try {
    // In place, as torch optimizers update parameters: under NoGradGuard a
    // leaf that requires grad may be written, and the tensor keeps its
    // identity, dtype and device (optimizers keep pointing at it).
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_->tensors.size(); ++i) {
      at::Tensor& param = params_->tensors[i];
      if (param.numel() == 0) continue;
      param.copy_(params_->flat
                      .narrow(0, static_cast<int64_t>(params_->offsets[i]),
                              param.numel())
                      .view(param.sizes()));
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: copying averaged parameters in", e);
  } catch (const std::exception& e) {
    return FromException("LocalSGD: copying averaged parameters in", e);
  }
  return absl::OkStatus();
}

}  // namespace localsgd
