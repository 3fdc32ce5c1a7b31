// localsgd._localsgd: the C++ client (client/client.h) for Python, over
// pybind11. No LibTorch is linked: parameters cross as one flat, writable,
// C-contiguous float32 buffer (the buffer protocol: a numpy array, or
// `tensor.numpy()` of a CPU torch tensor, which shares its memory), so the
// module does not depend on torch's C++ ABI and survives torch upgrades.
//
// Every call that talks to the coordinator or waits releases the GIL. An
// error of the client raises localsgd.Error (a RuntimeError) whose `code`
// is the gRPC status code's name ("UNAVAILABLE") and whose `message` is the
// coordinator's or client's message; bad arguments raise ValueError or
// TypeError before anything is sent.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/background_sync.h"
#include "client/client.h"
#include "client/sync_schedule.h"
#include "glog/logging.h"
#include "src/layout.h"
#include "src/types.h"

namespace py = pybind11;

namespace localsgd {
namespace python {
namespace {

// Raised as localsgd.Error by the translator registered in the module.
struct StatusError {
  absl::Status status;
};

[[noreturn]] void Raise(absl::Status status) {
  throw StatusError{std::move(status)};
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

void OkOrRaise(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// `name` of the choices, or ValueError naming the argument and the choices.
template <typename T>
T Choose(const std::string& arg, const std::string& value,
         std::initializer_list<std::pair<const char*, T>> choices) {
  std::string names;
  for (const auto& [name, v] : choices) {
    if (value == name) return v;
    absl::StrAppend(&names, names.empty() ? "" : ", ", name);
  }
  throw py::value_error(
      absl::StrCat(arg, "=", value, ": expected one of ", names));
}

DType TensorDType(const std::string& value) {
  return Choose<DType>("dtype", value,
                       {{"float32", DType::kFloat32},
                        {"bfloat16", DType::kBFloat16},
                        {"float16", DType::kFloat16},
                        {"float64", DType::kFloat64}});
}

absl::Duration Seconds(const char* arg, double seconds) {
  if (!(seconds >= 0)) {
    throw py::value_error(absl::StrCat(arg, "=", seconds, ": must be >= 0"));
  }
  return absl::Seconds(seconds);
}

// A writable, C-contiguous float32 buffer of `expected` elements (0: any).
py::buffer_info Params(const py::buffer& buffer, uint64_t expected,
                       const char* what) {
  py::buffer_info info;
  try {
    info = buffer.request(/*writable=*/true);
  } catch (const py::error_already_set&) {
    throw py::type_error(absl::StrCat(
        what,
        ": needs a writable buffer (a numpy array, or tensor.numpy() "
        "of a CPU float32 tensor)"));
  }
  if (info.format != py::format_descriptor<float>::format() ||
      info.itemsize != 4) {
    throw py::type_error(absl::StrCat(what,
                                      ": needs float32 values, got "
                                      "buffer format '",
                                      info.format, "'"));
  }
  py::ssize_t stride = 4;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != stride) {
      throw py::value_error(
          absl::StrCat(what, ": the buffer must be C-contiguous"));
    }
    stride *= info.shape[d];
  }
  if (expected != 0 && static_cast<uint64_t>(info.size) != expected) {
    throw py::value_error(absl::StrCat(what, ": the buffer holds ", info.size,
                                       " values; the job's layout has ",
                                       expected));
  }
  return info;
}

absl::Span<float> SpanOf(py::buffer_info& info) {
  return absl::Span<float>(static_cast<float*>(info.ptr),
                           static_cast<size_t>(info.size));
}

// local_steps= of sync and start_sync: None (not said) or a whole number
// in [0, kMaxLocalSteps].
SyncWork WorkOf(const py::object& local_steps, const char* where) {
  SyncWork work;
  if (local_steps.is_none()) return work;
  if (!py::isinstance<py::int_>(local_steps) ||
      py::isinstance<py::bool_>(local_steps)) {
    throw py::value_error(absl::StrCat(
        where, ": local_steps=", std::string(py::repr(local_steps)),
        ": must be a whole number of local steps (an int) or None"));
  }
  // Through a Python int compare: any size, no overflow.
  if (local_steps.attr("__lt__")(0).cast<bool>() ||
      local_steps.attr("__gt__")(kMaxLocalSteps).cast<bool>()) {
    throw py::value_error(absl::StrCat(
        where, ": local_steps=", std::string(py::repr(local_steps)),
        ": must be in [0, ", kMaxLocalSteps, "]"));
  }
  work.local_steps = local_steps.cast<int64_t>();
  return work;
}

py::dict OutcomeDict(const SyncOutcome& o) {
  py::dict d;
  d["round"] = o.round;
  d["contributed"] = o.contributed;
  d["late"] = o.late;
  d["contributors"] = o.contributors;
  d["contributor_weight"] = o.contributor_weight;
  d["bytes_sent"] = o.bytes_sent;
  d["bytes_received"] = o.bytes_received;
  d["rejoined"] = o.rejoined;
  d["staleness"] = o.staleness;
  d["local_steps_budget"] = o.local_steps_budget;
  return d;
}

// The Python object: a Client and whether it joined. The C++ client is
// for one thread at a time; with the GIL released around its calls, mu_
// keeps two Python threads (or close() during a sync) from using it at
// once: a second caller waits (without the GIL) until the first returns.
class PyClient {
 public:
  explicit PyClient(ClientOptions options) {
    client_ = ValueOrRaise(Client::Create(std::move(options)));
  }
  // The C++ destructor leaves the job (an RPC) and joins the heartbeat
  // thread: not with the GIL held, which would stall every Python thread.
  ~PyClient() {
    if (client_ == nullptr) return;
    if (Py_IsInitialized() && !_Py_IsFinalizing() && PyGILState_Check()) {
      py::gil_scoped_release release;
      Reset();
    } else {
      Reset();
    }
  }

  void Join(const std::vector<std::tuple<std::string, std::vector<int64_t>,
                                         std::string>>& tensors) {
    std::vector<TensorSpec> specs;
    for (const auto& [name, shape, dtype] : tensors) {
      TensorSpec spec;
      spec.name = name;
      spec.shape = shape;
      spec.dtype = TensorDType(dtype);
      specs.push_back(std::move(spec));
    }
    Layout layout = MakeLayout(std::move(specs));
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      // Checked under mu_, as every other read of client_ and joined_.
      if (client_ == nullptr) throw py::value_error("the client is closed");
      if (joined_) throw py::value_error("join: already joined");
      status = client_->Join(layout);
      if (status.ok()) joined_ = true;
    }
    OkOrRaise(status);
  }

  void Initialize(const py::buffer& buffer) {
    py::buffer_info info = Params(buffer, NumElements(), "initialize");
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      status = Idle();
      if (status.ok()) status = client_->Initialize(SpanOf(info));
    }
    OkOrRaise(status);
  }

  py::dict Sync(const py::buffer& buffer, const py::object& local_steps,
                bool last) {
    py::buffer_info info = Params(buffer, NumElements(), "sync");
    SyncWork work = WorkOf(local_steps, "sync");
    work.last = last;
    absl::StatusOr<SyncOutcome> outcome;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      if (absl::Status s = Idle(); !s.ok()) {
        outcome = s;
      } else {
        outcome = client_->Sync(SpanOf(info), work);
      }
    }
    return OutcomeDict(ValueOrRaise(std::move(outcome)));
  }

  // Sync that overlaps training (client/background_sync.h).
  void StartSync(const py::buffer& buffer, const py::object& local_steps) {
    py::buffer_info info = Params(buffer, NumElements(), "start_sync");
    const SyncWork work = WorkOf(local_steps, "start_sync");
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      status = Idle();
      if (status.ok()) {
        if (background_ == nullptr) {
          background_ = std::make_unique<BackgroundSync>(client_.get());
        }
        status = background_->Start(SpanOf(info), work);
      }
    }
    OkOrRaise(status);
  }

  bool SyncInFlight() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_) return true;
    return background_ != nullptr && background_->in_flight();
  }

  bool SyncReady() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    // Ready() takes the BackgroundSync's own lock: safe while another
    // thread waits in Finish.
    if (finishing_) return background_->Ready();
    return background_ != nullptr && background_->in_flight() &&
           background_->Ready();
  }

  py::dict FinishSync(const py::buffer& buffer) {
    py::buffer_info info = Params(buffer, NumElements(), "finish_sync");
    absl::StatusOr<SyncOutcome> outcome;
    {
      py::gil_scoped_release release;
      BackgroundSync* background = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (client_ == nullptr) {
          outcome = absl::FailedPreconditionError("the client is closed");
        } else if (finishing_) {
          outcome = absl::FailedPreconditionError(
              "finish_sync: another thread is already finishing this sync");
        } else if (background_ == nullptr || !background_->in_flight()) {
          outcome = absl::FailedPreconditionError(
              "finish_sync: no sync in flight (start_sync first)");
        } else {
          finishing_ = true;
          background = background_.get();
        }
      }
      if (background != nullptr) {
        // The wait (up to a round) runs without mu_, so that sync_ready
        // and sync_in_flight answer from other threads meanwhile; every
        // other call is refused while finishing_, and close() waits.
        outcome = background->Finish(SpanOf(info));
        std::lock_guard<std::mutex> lock(mu_);
        finishing_ = false;
        finished_.notify_all();
      }
    }
    return OutcomeDict(ValueOrRaise(std::move(outcome)));
  }

  uint64_t FetchState(const py::buffer& buffer) {
    py::buffer_info info = Params(buffer, NumElements(), "fetch_state");
    absl::StatusOr<RoundId> round;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      if (absl::Status s = Idle(); !s.ok()) {
        round = s;
      } else {
        round = client_->FetchState(SpanOf(info));
      }
    }
    return ValueOrRaise(std::move(round));
  }

  // Idempotent, also after close().
  void Leave() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      if (client_ != nullptr) {
        status = Idle();
        if (status.ok()) status = client_->Leave();
      }
    }
    OkOrRaise(status);
  }

  void Close() {
    py::gil_scoped_release release;
    Reset();
  }

  uint64_t state_round() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    return Checked().state_round();
  }
  py::dict Info() {
    JoinInfo i;
    size_t replicas = 0;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      i = Checked().info();
      replicas = Checked().num_replicas();
    }
    py::dict d;
    d["num_elements"] = i.num_elements;
    d["num_chunks"] = i.num_chunks;
    d["has_state"] = i.has_state;
    d["state_round"] = i.state_round;
    d["local_sgd_steps"] = i.settings.local_sgd_steps;
    d["chunk_elements"] = i.settings.chunk_elements;
    d["wire_dtype"] = std::string(DTypeName(i.settings.wire_dtype));
    d["sparse_keep"] = i.settings.sparse_keep;
    d["sparse_result_keep"] = i.settings.sparse_result_keep;
    d["averaging"] = std::string(AveragingModeName(i.settings.mode));
    d["contribution"] = std::string(ContributionName(i.settings.contribution));
    d["outer_lr"] = i.settings.outer_lr;
    d["outer_momentum"] = i.settings.outer_momentum;
    d["mean_encoding"] =
        std::string(MeanEncodingName(i.settings.mean_encoding));
    d["lease_ttl_seconds"] = absl::ToDoubleSeconds(i.lease_ttl);
    d["replicas"] = replicas;
    return d;
  }

 private:
  // Leaves (best effort) and joins the heartbeat thread; call without the
  // GIL (or at finalization).
  void Reset() {
    std::unique_lock<std::mutex> lock(mu_);
    finished_.wait(lock, [this] { return !finishing_; });
    background_.reset();  // waits for a sync in flight
    client_.reset();
  }
  // With mu_ held: OK if the client is open and no background sync is in
  // flight (the client is then the sync thread's).
  absl::Status Idle() const {
    if (client_ == nullptr) {
      return absl::FailedPreconditionError("the client is closed");
    }
    if (finishing_ || (background_ != nullptr && background_->in_flight())) {
      return absl::FailedPreconditionError(
          "a background sync is in flight (start_sync); finish_sync first");
    }
    return absl::OkStatus();
  }
  // With mu_ held. Raises (a C++ exception pybind11 turns into ValueError
  // once the GIL is back) when closed.
  const Client& Checked() const {
    if (client_ == nullptr) throw py::value_error("the client is closed");
    if (finishing_ || (background_ != nullptr && background_->in_flight())) {
      throw py::value_error(
          "a background sync is in flight (start_sync); finish_sync first");
    }
    return *client_;
  }
  // Called with the GIL, before a call: the layout's size, or ValueError.
  uint64_t NumElements() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    if (client_ == nullptr) throw py::value_error("the client is closed");
    if (!joined_) throw py::value_error("join first");
    return client_->info().num_elements;
  }

  std::mutex mu_;
  std::unique_ptr<Client> client_;  // null once closed
  bool joined_ = false;
  std::unique_ptr<BackgroundSync> background_;  // made by the first start_sync
  // A finish_sync waits for its result without mu_ (see FinishSync);
  // close() waits for it on finished_.
  bool finishing_ = false;
  std::condition_variable finished_;
};

ClientOptions MakeOptions(
    const std::string& target, const std::string& job,
    const std::string& member_name, double weight,
    const std::vector<std::string>& replicas, uint32_t local_sgd_steps,
    const std::string& wire_dtype, const std::string& averaging,
    double outer_lr, double outer_momentum, const std::string& contribution,
    uint32_t chunk_elements, uint32_t rendezvous, const std::string& tls_ca,
    const std::string& tls_cert, const std::string& tls_key,
    const std::string& tls_server_name, const std::string& token,
    const std::string& token_file, double rpc_timeout, double sync_timeout,
    double max_retry_time, const std::string& deadline_mode,
    const std::string& mean_encoding, const std::string& max_staleness,
    const std::string& step_budget, uint32_t sparse_keep,
    uint32_t sparse_result_keep, bool error_reset) {
  ClientOptions o;
  o.target = target;
  o.job_id = job;
  o.member_name = member_name;
  o.weight = weight;
  o.replicas = replicas;
  o.settings.local_sgd_steps = local_sgd_steps;
  o.settings.wire_dtype = wire_dtype.empty()
                              ? DType::kUnspecified
                              : Choose<DType>("wire_dtype", wire_dtype,
                                              {{"float32", DType::kFloat32},
                                               {"bfloat16", DType::kBFloat16},
                                               {"int8", DType::kInt8Block},
                                               {"int4", DType::kInt4Block},
                                               {"sparse2", DType::kSparse2},
                                               {"sparse4", DType::kSparse4}});
  o.settings.sparse_keep = sparse_keep;
  o.settings.sparse_result_keep = sparse_result_keep;
  o.error_reset = error_reset;
  o.settings.mode =
      averaging.empty()
          ? AveragingMode::kUnspecified
          : Choose<AveragingMode>(
                "averaging", averaging,
                {{"mean", AveragingMode::kMean},
                 {"nesterov", AveragingMode::kOuterNesterov},
                 {"outer_nesterov", AveragingMode::kOuterNesterov},
                 {"outer_sgd", AveragingMode::kOuterSgd}});
  o.settings.outer_lr = static_cast<float>(outer_lr);
  o.settings.outer_momentum = static_cast<float>(outer_momentum);
  o.settings.contribution = Choose<Contribution>(
      "contribution", contribution,
      {{"pseudo_gradients", Contribution::kPseudoGradients},
       {"parameters", Contribution::kParameters}});
  o.settings.chunk_elements = chunk_elements;
  o.settings.rendezvous_members = rendezvous;
  o.settings.deadline_mode =
      deadline_mode.empty()
          ? DeadlineMode::kUnspecified
          : Choose<DeadlineMode>("deadline_mode", deadline_mode,
                                 {{"fixed", DeadlineMode::kFixed},
                                  {"adaptive", DeadlineMode::kAdaptive}});
  o.settings.mean_encoding =
      mean_encoding.empty()
          ? MeanEncoding::kUnspecified
          : Choose<MeanEncoding>("mean_encoding", mean_encoding,
                                 {{"float32", MeanEncoding::kFloat32},
                                  {"wire", MeanEncoding::kWire}});
  if (max_staleness == "off") {
    o.settings.max_staleness = kMaxStalenessOff;
  } else if (!max_staleness.empty()) {
    int32_t n = 0;
    if (!absl::SimpleAtoi(max_staleness, &n) || n < 1 ||
        n > kMaxStalenessLimit) {
      throw py::value_error(absl::StrCat("max_staleness='", max_staleness,
                                         "': must be 'off' or 1 to ",
                                         kMaxStalenessLimit));
    }
    o.settings.max_staleness = n;
  }
  o.settings.step_budget =
      step_budget.empty()
          ? StepBudget::kUnspecified
          : Choose<StepBudget>("step_budget", step_budget,
                               {{"fixed", StepBudget::kFixed},
                                {"adaptive", StepBudget::kAdaptive}});
  o.security.tls_ca_file = tls_ca;
  o.security.tls_cert_file = tls_cert;
  o.security.tls_key_file = tls_key;
  o.security.tls_server_name = tls_server_name;
  o.security.token = token;
  o.security.token_file = token_file;
  o.rpc_timeout = Seconds("rpc_timeout", rpc_timeout);
  o.sync_timeout = Seconds("sync_timeout", sync_timeout);
  o.max_retry_time = Seconds("max_retry_time", max_retry_time);
  return o;
}

}  // namespace
}  // namespace python
}  // namespace localsgd

PYBIND11_MODULE(_localsgd, m) {
  using localsgd::python::PyClient;
  using localsgd::python::StatusError;
  m.doc() =
      "The localsgd client (C++, over gRPC) for Python. Use localsgd.Client "
      "or localsgd.LocalSGD; see help(localsgd).";

  // The client logs through glog: warnings and errors to stderr by default
  // (LOCALSGD_LOG=info shows joins, seeds and leaves too). Another library
  // of the process may have set glog up already.
  if (!google::IsGoogleLoggingInitialized()) {
    FLAGS_logtostderr = true;
    const char* level = std::getenv("LOCALSGD_LOG");
    FLAGS_minloglevel =
        level != nullptr && std::string(level) == "info" ? 0 : 1;
    google::InitGoogleLogging("localsgd");
  }

  // The C++ LocalSGD's schedule (client/sync_schedule.h), so that the
  // Python LocalSGD decides each step by the same table.
  m.def(
      "decide_step",
      [](uint64_t steps, uint64_t local_sgd_steps, bool overlap,
         bool node_group, bool in_flight, bool ready, uint64_t since_sync,
         uint64_t budget) {
        if (local_sgd_steps < 1) {
          throw py::value_error("decide_step: local_sgd_steps must be >= 1");
        }
        localsgd::StepState state;
        state.steps = steps;
        state.local_sgd_steps = local_sgd_steps;
        state.overlap = overlap;
        state.node_group = node_group;
        state.in_flight = in_flight;
        state.ready = ready;
        state.since_sync = since_sync;
        state.budget = budget;
        return std::string(
            localsgd::StepActionName(localsgd::DecideStep(state)));
      },
      py::arg("steps"), py::arg("local_sgd_steps"), py::arg("overlap"),
      py::arg("node_group"), py::arg("in_flight"), py::arg("ready"),
      py::arg("since_sync") = 0, py::arg("budget") = 0,
      "What LocalSGD does at this optimizer step (steps counted with it; "
      "since_sync: steps since the last contribution, budget: the "
      "coordinator's step budget, 0 for none): "
      "'none', 'sync', 'node_sync_point', 'merge', 'start' or "
      "'merge_then_start' (the table of client/sync_schedule.h).");

  static py::exception<StatusError> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const std::string code(absl::StatusCodeToString(e.status.code()));
      const std::string message(e.status.message());
      // The message may hold bytes that are not UTF-8 (a peer's): replaced.
      auto text = [](const std::string& s) {
        return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(
            s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
      };
      py::object type = py::reinterpret_borrow<py::object>(error.ptr());
      py::object instance = type(text(absl::StrCat(code, ": ", message)));
      instance.attr("code") = code;
      instance.attr("message") = text(message);
      PyErr_SetObject(error.ptr(), instance.ptr());
    }
  });

  py::class_<PyClient>(m, "Client", R"doc(
A member of a localsgd job: joins, seeds or fetches the global state, syncs.

Parameters cross as one flat writable C-contiguous float32 buffer (a numpy
array, or tensor.numpy() of a CPU float32 tensor) of the layout's size.
Every call that talks to the coordinator releases the GIL and may raise
localsgd.Error (.code: the gRPC status code name, .message).
)doc")
      .def(py::init([](const std::string& target, const std::string& job,
                       const std::string& member_name, double weight,
                       const std::vector<std::string>& replicas,
                       uint32_t local_sgd_steps, const std::string& wire_dtype,
                       const std::string& averaging, double outer_lr,
                       double outer_momentum, const std::string& contribution,
                       uint32_t chunk_elements, uint32_t rendezvous,
                       const std::string& tls_ca, const std::string& tls_cert,
                       const std::string& tls_key,
                       const std::string& tls_server_name,
                       const std::string& token, const std::string& token_file,
                       double rpc_timeout, double sync_timeout,
                       double max_retry_time, const std::string& deadline_mode,
                       const std::string& mean_encoding,
                       const std::string& max_staleness,
                       const std::string& step_budget, uint32_t sparse_keep,
                       uint32_t sparse_result_keep, bool error_reset) {
             return std::make_unique<PyClient>(localsgd::python::MakeOptions(
                 target, job, member_name, weight, replicas, local_sgd_steps,
                 wire_dtype, averaging, outer_lr, outer_momentum, contribution,
                 chunk_elements, rendezvous, tls_ca, tls_cert, tls_key,
                 tls_server_name, token, token_file, rpc_timeout, sync_timeout,
                 max_retry_time, deadline_mode, mean_encoding, max_staleness,
                 step_budget, sparse_keep, sparse_result_keep, error_reset));
           }),
           py::kw_only(), py::arg("target"), py::arg("job"),
           py::arg("member_name") = "", py::arg("weight") = 1.0,
           py::arg("replicas") = std::vector<std::string>(),
           py::arg("local_sgd_steps") = 0, py::arg("wire_dtype") = "",
           py::arg("averaging") = "", py::arg("outer_lr") = 0.0,
           py::arg("outer_momentum") = 0.0,
           py::arg("contribution") = "pseudo_gradients",
           py::arg("chunk_elements") = 0, py::arg("rendezvous") = 0,
           py::arg("tls_ca") = "", py::arg("tls_cert") = "",
           py::arg("tls_key") = "", py::arg("tls_server_name") = "",
           py::arg("token") = "", py::arg("token_file") = "",
           py::arg("rpc_timeout") = 30.0, py::arg("sync_timeout") = 1800.0,
           py::arg("max_retry_time") = 60.0, py::arg("deadline_mode") = "",
           py::arg("mean_encoding") = "", py::arg("max_staleness") = "",
           py::arg("step_budget") = "", py::arg("sparse_keep") = 0,
           py::arg("sparse_result_keep") = 0, py::arg("error_reset") = false)
      .def("join", &PyClient::Join, py::arg("tensors"),
           "Joins the job with the layout [(name, shape, dtype), ...] "
           "(dtype: float32, bfloat16, float16, float64) and starts "
           "heartbeats.")
      .def("initialize", &PyClient::Initialize, py::arg("params"),
           "Seeds the job with params, or overwrites params with the job's "
           "state if it has one.")
      .def("sync", &PyClient::Sync, py::arg("params"),
           py::arg("local_steps") = py::none(), py::arg("last") = false,
           "Contributes params to the next round and overwrites them with "
           "its result; returns the outcome as a dict (round, contributed, "
           "late, contributors, contributor_weight, bytes_sent, "
           "bytes_received, rejoined, staleness). local_steps: the local "
           "steps params hold since the state they were trained from (an "
           "int in [0, 2^20]; counted by fate for the job's goodput), or "
           "None. last: the member's final sync (with error_reset, params "
           "get the global state alone and the residual is dropped).")
      .def("start_sync", &PyClient::StartSync, py::arg("params"),
           py::arg("local_steps") = py::none(),
           "Copies params and syncs them with the job's next round on a "
           "thread of its own; the client takes no other call until "
           "finish_sync.")
      .def("finish_sync", &PyClient::FinishSync, py::arg("params"),
           "Waits for the sync start_sync began and merges its result into "
           "params as result + (params - snapshot): the local progress "
           "since start_sync on top of the round's result; returns the "
           "outcome dict. On an error params are left as they were.")
      .def_property_readonly("sync_in_flight", &PyClient::SyncInFlight)
      .def_property_readonly("sync_ready", &PyClient::SyncReady,
                             "Whether finish_sync would not wait.")
      .def("fetch_state", &PyClient::FetchState, py::arg("params"),
           "Overwrites params with the job's state; returns its round.")
      .def("leave", &PyClient::Leave, "Ends membership. Idempotent.")
      .def("close", &PyClient::Close,
           "Leaves (best effort) and releases the client. Idempotent.")
      .def_property_readonly("state_round", &PyClient::state_round)
      .def_property_readonly("info", &PyClient::Info);
}
