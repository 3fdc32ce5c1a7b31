#include "client/local_sgd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <chrono>
#include <exception>
#include <string>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"

namespace localsgd {

struct LocalSGD::Params {
  // Handles of the module's parameters: they share storage (and identity)
  // with the module's, so copy_() into them updates the module.
  std::vector<at::Tensor> tensors;
  // Element offset of each tensor in the flat buffer.
  std::vector<uint64_t> offsets;
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
  uint64_t total = 0;
  for (const TensorSpec& spec : layout_.tensors) total += NumElements(spec);
  flat_.resize(total);
}

absl::StatusOr<std::unique_ptr<LocalSGD>> LocalSGD::Create(
    torch::nn::Module& module, Client* client, LocalSGDOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.enabled) {
    if (client == nullptr) {
      return absl::InvalidArgumentError(
          "LocalSGD::Create: client is null; pass a Client, or set "
          "LocalSGDOptions.enabled = false to train without averaging");
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
  }

  // 1. The parameters, in registration order, and their layout.
  auto params = std::make_unique<Params>();
  std::vector<TensorSpec> specs;
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
      params->tensors.push_back(tensor);
      params->offsets.push_back(offset);
      offset += static_cast<uint64_t>(tensor.numel());
      specs.push_back(std::move(spec));
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD::Create: reading the module's parameters", e);
  } catch (const std::exception& e) {
    return FromException("LocalSGD::Create: reading the module's parameters",
                         e);
  }
  if (specs.empty()) {
    return absl::InvalidArgumentError(
        "LocalSGD::Create: the module has no parameters to average");
  }

  Layout layout = MakeLayout(std::move(specs));
  auto local_sgd =
      absl::WrapUnique(new LocalSGD(options.enabled ? client : nullptr, options,
                                    std::move(params), std::move(layout)));
  if (!options.enabled) {
    LOG(INFO) << "LocalSGD disabled: " << local_sgd->layout_.tensors.size()
              << " tensors, " << local_sgd->flat_.size()
              << " elements; training without averaging";
    return local_sgd;
  }
  // From here on a failure must not make the destructor sync.
  auto fail = [&local_sgd](absl::Status status) {
    local_sgd->closed_ = true;
    return status;
  };

  // 2. Join.
  if (absl::Status s = client->Join(local_sgd->layout_); !s.ok()) {
    return fail(s);
  }
  const JoinInfo& info = client->info();
  const uint32_t job_k = info.settings.local_sgd_steps;
  if (job_k != 0 && job_k != static_cast<uint32_t>(options.local_sgd_steps)) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "LocalSGD::Create: job '", client->options().job_id, "' syncs every ",
        job_k,
        " steps (its local_sgd_steps) but LocalSGDOptions.local_sgd_steps "
        "is ",
        options.local_sgd_steps,
        "; set ClientOptions.settings.local_sgd_steps and "
        "LocalSGDOptions.local_sgd_steps to the job's K")));
  }
  if (info.num_elements != 0 && info.num_elements != local_sgd->flat_.size()) {
    return fail(absl::InternalError(absl::StrCat(
        "LocalSGD::Create: the coordinator reports ", info.num_elements,
        " elements for a layout of ", local_sgd->flat_.size())));
  }

  // 3. Seed or fetch the global state, 4. adopt it.
  if (absl::Status s = local_sgd->Flatten(); !s.ok()) return fail(s);
  if (absl::Status s = client->Initialize(absl::MakeSpan(local_sgd->flat_));
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = local_sgd->Unflatten(); !s.ok()) return fail(s);

  LOG(INFO) << "LocalSGD: job '" << client->options().job_id << "' member "
            << info.member_id.str() << ": " << local_sgd->layout_.tensors.size()
            << " tensors, " << local_sgd->flat_.size()
            << " elements, K=" << options.local_sgd_steps
            << ", starting from state round " << client->state_round()
            << (info.has_state ? " (fetched)" : " (seeded or adopted seed)");
  return local_sgd;
}

LocalSGD::~LocalSGD() {
  if (closed_) return;
  if (absl::Status s = Close(); !s.ok()) {
    LOG(WARNING) << "LocalSGD destroyed without Close(); its final sync "
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
  if (steps_ % options_.local_sgd_steps != 0) return absl::OkStatus();
  return DoSync();
}

absl::Status LocalSGD::SyncNow() {
  if (!options_.enabled) {
    return absl::FailedPreconditionError(
        "LocalSGD::SyncNow(): LocalSGD is disabled (no client)");
  }
  if (closed_) {
    return absl::FailedPreconditionError("LocalSGD::SyncNow() after Close()");
  }
  return DoSync();
}

absl::Status LocalSGD::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (!options_.enabled) return absl::OkStatus();
  // As accelerate's __exit__: one more sync, even right after a Step() that
  // synced, so that every member ends on the same parameters whatever its
  // step count modulo K.
  if (absl::Status s = DoSync(); !s.ok()) {
    return Annotate(s, "LocalSGD::Close(): final sync failed: ");
  }
  LOG(INFO) << "LocalSGD closed: " << steps_ << " steps, " << num_syncs_
            << " syncs, " << sync_seconds_total_ << " s syncing, last round "
            << last_outcome_.round;
  return absl::OkStatus();
}

absl::Status LocalSGD::DoSync() {
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = Flatten();
  absl::StatusOr<SyncOutcome> outcome;
  if (status.ok()) {
    outcome = client_->Sync(absl::MakeSpan(flat_));
    status = outcome.status();
  }
  if (status.ok()) status = Unflatten();
  const double seconds = SecondsSince(start);
  sync_seconds_total_ += seconds;
  last_sync_skipped_ = false;
  if ((absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) &&
      options_.keep_training_when_unavailable) {
    // The parameters are untouched (the client writes them only on success):
    // train on locally and try again at the next sync.
    ++num_skipped_syncs_;
    last_sync_skipped_ = true;
    LOG(WARNING) << "LocalSGD sync at step " << steps_
                 << " skipped, training on locally: " << status;
    return absl::OkStatus();
  }
  if (!status.ok()) return status;

  last_outcome_ = *outcome;
  last_sync_seconds_ = seconds;
  ++num_syncs_;
  VLOG(1) << "LocalSGD sync at step " << steps_ << ": round "
          << last_outcome_.round << ", " << last_outcome_.contributors
          << " contributors, " << seconds << " s";
  return absl::OkStatus();
}

absl::Status LocalSGD::Flatten() {
  try {
    torch::NoGradGuard no_grad;
    const auto cpu_float = at::TensorOptions().dtype(at::kFloat);
    for (size_t i = 0; i < params_->tensors.size(); ++i) {
      const at::Tensor& param = params_->tensors[i];
      if (param.numel() == 0) continue;
      // A view of the tensor's slice of the staging buffer; copy_ converts
      // dtype and device and handles non-contiguous parameters in one pass.
      at::Tensor slice = at::from_blob(flat_.data() + params_->offsets[i],
                                       param.sizes(), cpu_float);
      slice.copy_(param);
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
    const auto cpu_float = at::TensorOptions().dtype(at::kFloat);
    for (size_t i = 0; i < params_->tensors.size(); ++i) {
      at::Tensor& param = params_->tensors[i];
      if (param.numel() == 0) continue;
      at::Tensor slice = at::from_blob(flat_.data() + params_->offsets[i],
                                       param.sizes(), cpu_float);
      param.copy_(slice);
    }
  } catch (const c10::Error& e) {
    return FromTorch("LocalSGD: copying averaged parameters in", e);
  } catch (const std::exception& e) {
    return FromException("LocalSGD: copying averaged parameters in", e);
  }
  return absl::OkStatus();
}

}  // namespace localsgd
