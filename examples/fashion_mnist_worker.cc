// localsgd-fashion-mnist: a real Local SGD worker. Trains a small CNN on its
// shard of Fashion-MNIST and averages the parameters with the other workers
// through a localsgd coordinator every --k steps (client/local_sgd.h).
//
// One line per event on stdout, key=value, for people and for grep:
//   rank=0 joined member=<id> state_round=0 elements=27562
//   rank=0 start world=4 k=16 batch_size=64 ... steps=468 ...
//   rank=0 step=100 epoch=0 loss=0.6123
//   rank=0 sync round=3 step=48 seconds=0.012 contributed=1 late=0
//          contributors=4 rejoined=0
//   rank=0 sync skipped step=52 (coordinator unreachable; ...)
//   rank=0 max_rounds reached round=40 step=160
//   rank=0 eval round=3 step=48 test_accuracy=0.8123 test_loss=0.5200
//   rank=0 final step=940 rounds=58 test_accuracy=0.8500 test_loss=0.41
//          first_loss=2.3000 last_loss=0.4100 sync_seconds_total=1.200
//          train_seconds=60.0 bytes_sent=6484224 bytes_received=6484224
// (wrapped here: each event is one line). `loss` is the mean over the last
// --log_every steps; first_loss and last_loss the means over the first and
// the last --log_every steps. Only rank 0 evaluates, so test_* appear in its
// lines only.
// bytes_sent/bytes_received: chunk payload exchanged with the coordinator
// by the syncs (0 on the local ranks > 0 of a node group, which never talk
// to it; the state's first seed or fetch, when the worker starts, is not
// counted).
//
// Node-local averaging (--local_world_size > 1, or LOCAL_WORLD_SIZE set as
// torchrun does): the processes of a node form a c10d group (Gloo on CPU,
// NCCL on CUDA where LibTorch has it) over the store --node_store; only
// local rank 0 joins the job, with weight --local_world_size. --rank and
// --world stay the global ones (rank = node * M + local_rank, world = N * M)
// and choose the data shard. scripts/run-nodes.sh runs N nodes x M processes.
// Errors go to stderr as "localsgd-fashion-mnist: rank=R error: <status>" and
// the exit status is 1 (2 for bad flags).
#include <glog/logging.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/local_sgd.h"
#include "client/node_group.h"
#include "client/security_flags.h"
#include "examples/fashion_mnist.h"
#include "src/malloc_tuning.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051",
          "gRPC target of the localsgd coordinator (host:port); for sharded "
          "coordinators a comma-separated list of every replica; a shard "
          "with standby coordinators (--ha_etcd) lists its addresses "
          "separated by '|'");
ABSL_FLAG(bool, resolve_replicas, false,
          "Sharded coordinators behind one DNS name (a headless Service): "
          "every address --coordinator resolves to is a replica");
ABSL_FLAG(std::string, job, "fashion-mnist",
          "Job id; all workers of one training run use the same");
ABSL_FLAG(int32_t, rank, 0, "This worker's rank, in [0, --world)");
ABSL_FLAG(int32_t, world, 1,
          "Number of workers; the training set is split in --world shards");
ABSL_FLAG(int32_t, k, 16, "Local SGD steps between two averagings");
ABSL_FLAG(int32_t, epochs, 1, "Passes over this worker's shard");
ABSL_FLAG(int64_t, max_steps, 0,
          "Stop after this many optimizer steps (0: no limit)");
ABSL_FLAG(int32_t, batch_size, 64, "Examples per optimizer step");
ABSL_FLAG(double, lr, 0.05, "SGD learning rate");
ABSL_FLAG(double, momentum, 0.9,
          "SGD momentum (the momentum buffers stay local, as in accelerate)");
ABSL_FLAG(uint64_t, seed, 1,
          "Seed of the model's initial parameters and of the data split; use "
          "the same on every worker");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda (cuda:N)");
ABSL_FLAG(int32_t, threads, 1,
          "LibTorch intra-op threads (keep 1 when several workers share a "
          "machine)");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist",
          "Directory of the gzipped Fashion-MNIST IDX files");
ABSL_FLAG(std::string, wire_dtype, "float32",
          "Dtype of contributions and results on the wire: float32, "
          "bfloat16, int8 or int4 (the block codes), sparse2 or sparse4 (the "
          "sparse codes; the codes: pseudo-gradients only)");
ABSL_FLAG(std::string, model, "small",
          "small (27,562 parameters) or wide (1,049,866): the CNN's widths");
ABSL_FLAG(uint32_t, sparse_keep, 0,
          "With --wire_dtype=sparse2 or sparse4: the values kept of every "
          "4096 (0: the coordinator's default)");
ABSL_FLAG(uint32_t, sparse_result_keep, 0,
          "With --wire_dtype=sparse2 or sparse4: the values the coordinator's "
          "step keeps of every 4096 (0: the coordinator's default)");
ABSL_FLAG(bool, error_reset, false,
          "With a lossy --wire_dtype: after each counted sync, train on "
          "from the global state plus this worker's residual, its unsent "
          "work (ClientOptions::error_reset); the final sync leaves the "
          "global state alone");
ABSL_FLAG(std::string, contribution, "pseudo_gradients",
          "What this worker sends: pseudo_gradients (its change since the "
          "last global state) or parameters");
ABSL_FLAG(std::string, averaging, "mean",
          "The job's averaging rule: mean, nesterov (DiLoCo's outer "
          "Nesterov optimizer on the coordinator) or outer_sgd");
ABSL_FLAG(double, outer_lr, 0,
          "Outer learning rate (nesterov, outer_sgd); 0: the coordinator's "
          "default (0.7)");
ABSL_FLAG(double, outer_momentum, 0,
          "Outer momentum (nesterov); 0: the coordinator's default (0.9)");
ABSL_FLAG(bool, no_sync, false,
          "Train alone, without a coordinator (the no-averaging baseline)");
ABSL_FLAG(std::string, dump_params, "",
          "At the end, write the final parameters (named order, flattened) "
          "to this file as raw little-endian float32");
ABSL_FLAG(int32_t, log_every, 50,
          "Print the mean training loss every this many steps; also the "
          "window of first_loss and last_loss");
ABSL_FLAG(int32_t, eval_every_sync, 1,
          "Rank 0 evaluates on the test set after every this many syncs "
          "(with --no_sync: every this many times --k steps); 0: only at the "
          "end");
ABSL_FLAG(int32_t, eval_examples, 0,
          "Evaluate on the first this many test images (0: all 10000)");
ABSL_FLAG(int32_t, rendezvous, -1,
          "Averaging starts once this many workers take part (the job's "
          "rendezvous_members; rounds before then wait for the rest to "
          "join). -1: --world; 0 or 1: no rendezvous");
ABSL_FLAG(int32_t, max_rounds, 0,
          "Stop training once a sync has brought the job to round >= this "
          "(then the final sync and Leave, as at the normal end); workers "
          "that joined at different times so end in the same round. 0: no "
          "limit");
ABSL_FLAG(std::string, dump_dir, "",
          "If set, write the parameters (as --dump_params) to "
          "DIR/r<rank>_init_round<R>.bin once the job's state is adopted "
          "(R: its round) and to DIR/r<rank>_round<R>.bin after every "
          "successful sync (R: the round the parameters now hold)");
ABSL_FLAG(int32_t, chunk_elements, 0,
          "Parameters per chunk on the wire (the job's chunk_elements; all "
          "workers of a job must agree). 0: the coordinator's default");

ABSL_FLAG(int32_t, local_rank, -1,
          "Rank in this node's process group; -1: $LOCAL_RANK, else 0");
ABSL_FLAG(int32_t, local_world_size, -1,
          "Processes of this node averaging among themselves before the "
          "node's rank 0 syncs with the coordinator (weight = this); -1: "
          "$LOCAL_WORLD_SIZE, else 1 (no node group)");
ABSL_FLAG(std::string, node_store, "",
          "host:port of the node group's c10d TCPStore (local rank 0 serves "
          "it); empty: $LOCALSGD_NODE_STORE, else $MASTER_ADDR:$MASTER_PORT");
ABSL_FLAG(int32_t, node_timeout_seconds, 300,
          "Timeout of the node group's rendezvous and collectives");
ABSL_FLAG(bool, overlap, false,
          "Train on while a round syncs in the background and merge its "
          "result as global + (now - snapshot) (LocalSGDOptions::overlap; "
          "with a node group, at sync points in lockstep)");
ABSL_FLAG(std::string, deadline_mode, "",
          "How the job's rounds stop waiting for stragglers: fixed or "
          "adaptive (learned); empty: the coordinator's default");
ABSL_FLAG(std::string, mean_encoding, "",
          "What the job's rule runs on: float32 (the round's mean) or wire "
          "(the mean as the wire dtype encodes it; a standby then gets one "
          "member's download per round); empty: the coordinator's default");
ABSL_FLAG(double, scale_delta, 1,
          "A diverging or hostile member, for the outlier guard's benchmark "
          "(bench/outlier_guard.py): before each sync, this worker's change "
          "since the state it trained from is multiplied by this (1: an "
          "honest worker). Blocking syncs of pseudo-gradients, no node "
          "group");
// Transport security and the job's token: client/security_flags.h
// (--tls_ca, --tls_cert, --tls_key, --tls_server_name, --token_file).

namespace localsgd {
namespace examples {
namespace {

constexpr char kProgram[] = "localsgd-fashion-mnist";
// Fashion-MNIST training-set pixel mean and standard deviation (of x/255).
constexpr float kPixelMean = 0.2860f;
constexpr float kPixelStd = 0.3530f;
constexpr int64_t kEvalBatch = 1000;

// conv(1->c1, 3x3) relu maxpool2, conv(c1->c2, 3x3) relu maxpool2, fc
// 25 c2->h, relu, fc h->10. --model=small: c1, c2, h = 8, 16, 64, 27562
// parameters, about 1.3 MFLOP per training example; --model=wide: 32, 64,
// 640, 1,049,866 parameters (where top-k behaves as on larger models: most
// of them in one matrix).
struct NetWidths {
  int64_t c1, c2, hidden;
};
struct NetImpl : torch::nn::Module {
  explicit NetImpl(NetWidths w)
      : conv1(register_module(
            "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, w.c1, 3)))),
        conv2(register_module(
            "conv2",
            torch::nn::Conv2d(torch::nn::Conv2dOptions(w.c1, w.c2, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(w.c2 * 5 * 5, w.hidden))),
        fc2(register_module("fc2", torch::nn::Linear(w.hidden, kNumClasses))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // c1 x 13 x 13
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // c2 x 5 x 5
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

struct Config {
  std::string coordinator;
  std::string job;
  int rank = 0;
  int world = 1;
  int k = 16;
  int epochs = 1;
  int64_t max_steps = 0;
  int batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  uint64_t seed = 1;
  std::string device;
  int threads = 1;
  std::string data_dir;
  DType wire_dtype = DType::kFloat32;
  uint32_t sparse_keep = 0;
  uint32_t sparse_result_keep = 0;
  NetWidths widths{8, 16, 64};
  Contribution contribution = Contribution::kPseudoGradients;
  AveragingMode averaging = AveragingMode::kMean;
  double outer_lr = 0;
  double outer_momentum = 0;
  bool no_sync = false;
  std::string dump_params;
  int log_every = 50;
  int eval_every_sync = 1;
  int eval_examples = 0;
  int rendezvous = -1;
  int max_rounds = 0;
  std::string dump_dir;
  int chunk_elements = 0;
  int local_rank = 0;
  int local_world_size = 1;
  double scale_delta = 1;
  std::string node_store;
  int node_timeout_seconds = 300;
};

// The value of a flag that defaults to an environment variable.
int IntFromEnv(int flag, const char* name, int fallback) {
  if (flag >= 0) return flag;
  const char* value = std::getenv(name);
  int parsed = 0;
  if (value != nullptr && absl::SimpleAtoi(value, &parsed)) return parsed;
  return fallback;
}

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.coordinator = absl::GetFlag(FLAGS_coordinator);
  c.job = absl::GetFlag(FLAGS_job);
  c.rank = absl::GetFlag(FLAGS_rank);
  c.world = absl::GetFlag(FLAGS_world);
  c.k = absl::GetFlag(FLAGS_k);
  c.epochs = absl::GetFlag(FLAGS_epochs);
  c.max_steps = absl::GetFlag(FLAGS_max_steps);
  c.batch_size = absl::GetFlag(FLAGS_batch_size);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.momentum = absl::GetFlag(FLAGS_momentum);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.device = absl::GetFlag(FLAGS_device);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.data_dir = absl::GetFlag(FLAGS_data_dir);
  c.no_sync = absl::GetFlag(FLAGS_no_sync);
  c.dump_params = absl::GetFlag(FLAGS_dump_params);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.eval_every_sync = absl::GetFlag(FLAGS_eval_every_sync);
  c.eval_examples = absl::GetFlag(FLAGS_eval_examples);
  c.local_rank = IntFromEnv(absl::GetFlag(FLAGS_local_rank), "LOCAL_RANK", 0);
  c.local_world_size =
      IntFromEnv(absl::GetFlag(FLAGS_local_world_size), "LOCAL_WORLD_SIZE", 1);
  c.scale_delta = absl::GetFlag(FLAGS_scale_delta);
  c.node_store = absl::GetFlag(FLAGS_node_store);
  if (c.node_store.empty()) {
    const char* store = std::getenv("LOCALSGD_NODE_STORE");
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (store != nullptr) {
      c.node_store = store;
    } else if (addr != nullptr && port != nullptr) {
      c.node_store = absl::StrCat(addr, ":", port);
    }
  }
  c.node_timeout_seconds = absl::GetFlag(FLAGS_node_timeout_seconds);
  c.rendezvous = absl::GetFlag(FLAGS_rendezvous);
  // The job's members are nodes (their leaders).
  if (c.rendezvous < 0) {
    c.rendezvous = c.local_world_size > 0 ? c.world / c.local_world_size : 0;
  }
  c.max_rounds = absl::GetFlag(FLAGS_max_rounds);
  c.dump_dir = absl::GetFlag(FLAGS_dump_dir);
  c.chunk_elements = absl::GetFlag(FLAGS_chunk_elements);

  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  if (wire == "float32") {
    c.wire_dtype = DType::kFloat32;
  } else if (wire == "bfloat16") {
    c.wire_dtype = DType::kBFloat16;
  } else if (wire == "int8") {
    c.wire_dtype = DType::kInt8Block;
  } else if (wire == "int4") {
    c.wire_dtype = DType::kInt4Block;
  } else if (wire == "sparse2") {
    c.wire_dtype = DType::kSparse2;
  } else if (wire == "sparse4") {
    c.wire_dtype = DType::kSparse4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire_dtype=", wire,
                     ": expected float32, bfloat16, int8, int4, sparse2 or "
                     "sparse4"));
  }
  c.sparse_keep = absl::GetFlag(FLAGS_sparse_keep);
  c.sparse_result_keep = absl::GetFlag(FLAGS_sparse_result_keep);
  if (const std::string m = absl::GetFlag(FLAGS_model); m == "wide") {
    c.widths = NetWidths{32, 64, 640};
  } else if (m != "small") {
    return absl::InvalidArgumentError(
        absl::StrCat("--model=", m, ": expected small or wide"));
  }
  const std::string contribution = absl::GetFlag(FLAGS_contribution);
  if (contribution == "pseudo_gradients") {
    c.contribution = Contribution::kPseudoGradients;
  } else if (contribution == "parameters") {
    c.contribution = Contribution::kParameters;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--contribution=", contribution,
                     ": expected pseudo_gradients or parameters"));
  }
  const std::string averaging = absl::GetFlag(FLAGS_averaging);
  if (averaging == "mean") {
    c.averaging = AveragingMode::kMean;
  } else if (averaging == "nesterov" || averaging == "outer_nesterov") {
    c.averaging = AveragingMode::kOuterNesterov;
  } else if (averaging == "outer_sgd") {
    c.averaging = AveragingMode::kOuterSgd;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--averaging=", averaging, ": expected mean, nesterov or outer_sgd"));
  }
  c.outer_lr = absl::GetFlag(FLAGS_outer_lr);
  c.outer_momentum = absl::GetFlag(FLAGS_outer_momentum);
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(what);
  };
  if (c.world < 1) return bad("--world must be >= 1");
  if (c.rank < 0 || c.rank >= c.world) {
    return bad(absl::StrCat("--rank=", c.rank,
                            " is not in [0, --world=", c.world, ")"));
  }
  if (c.k < 1) return bad("--k must be >= 1");
  if (c.epochs < 1) return bad("--epochs must be >= 1");
  if (c.max_steps < 0) return bad("--max_steps must be >= 0");
  if (c.batch_size < 1) return bad("--batch_size must be >= 1");
  if (!(c.lr > 0)) return bad("--lr must be > 0");
  if (!(c.momentum >= 0 && c.momentum < 1)) {
    return bad("--momentum must be in [0, 1)");
  }
  if (c.threads < 1) return bad("--threads must be >= 1");
  if (c.log_every < 1) return bad("--log_every must be >= 1");
  if (c.eval_every_sync < 0) return bad("--eval_every_sync must be >= 0");
  if (c.eval_examples < 0) return bad("--eval_examples must be >= 0");
  if (c.rendezvous > c.world) {
    return bad("--rendezvous must be at most --world");
  }
  if (c.max_rounds < 0) return bad("--max_rounds must be >= 0");
  if (c.chunk_elements < 0) return bad("--chunk_elements must be >= 0");
  if (c.no_sync && (c.max_rounds > 0 || c.chunk_elements > 0)) {
    return bad(
        "--max_rounds and --chunk_elements need a coordinator; drop "
        "them or --no_sync");
  }
  if (c.local_world_size < 1) return bad("--local_world_size must be >= 1");
  if (!std::isfinite(c.scale_delta)) {
    return bad("--scale_delta must be finite");
  }
  if (c.scale_delta != 1 &&
      (c.no_sync || c.local_world_size > 1 || absl::GetFlag(FLAGS_overlap) ||
       c.contribution != Contribution::kPseudoGradients)) {
    return bad(
        "--scale_delta needs blocking syncs of pseudo_gradients without a "
        "node group (no --no_sync, --overlap or --local_world_size > 1)");
  }
  if (c.local_rank < 0 || c.local_rank >= c.local_world_size) {
    return bad(absl::StrCat(
        "--local_rank=", c.local_rank,
        " is not in [0, --local_world_size=", c.local_world_size, ")"));
  }
  if (c.local_world_size > 1) {
    if (c.no_sync) {
      return bad(
          "--no_sync trains every process alone; drop "
          "--local_world_size (LOCAL_WORLD_SIZE) or --no_sync");
    }
    if (c.max_rounds > 0) {
      return bad(
          "--max_rounds is not supported with a node group (the "
          "node's processes must stop together)");
    }
    if (c.node_store.empty()) {
      return bad(
          "--local_world_size > 1 needs --node_store=host:port (or "
          "LOCALSGD_NODE_STORE, or MASTER_ADDR and MASTER_PORT)");
    }
    if (c.node_timeout_seconds < 1) {
      return bad("--node_timeout_seconds must be >= 1");
    }
  }
  if (!c.no_sync && c.coordinator.empty()) {
    return bad("--coordinator is empty; give host:port, or --no_sync");
  }
  return c;
}

// One event line on stdout, flushed at once so that launchers interleave
// workers' lines as they happen.
void Emit(const Config& c, const std::string& line) {
  std::string out = absl::StrCat("rank=", c.rank, " ", line, "\n");
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

// The shuffles both example workers (this one and examples/fashion_mnist.py)
// draw alike, so that a job mixing C++ and Python workers splits and
// shuffles the data exactly as a job of either: Fisher-Yates on SplitMix64
// (std::shuffle's draws are the standard library's own).
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void PortableShuffle(std::vector<int64_t>& v, uint64_t seed) {
  uint64_t state = seed;
  for (size_t i = v.size(); i > 1; --i) {
    std::swap(v[i - 1], v[SplitMix64(state) % i]);
  }
}

uint64_t EpochSeed(uint64_t seed, int rank, int epoch) {
  constexpr uint64_t kPrime = 0x100000001B3ull;  // FNV-1a's
  return (((seed * kPrime) ^ static_cast<uint64_t>(rank + 1)) * kPrime) ^
         static_cast<uint64_t>(epoch + 1);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Images as normalized float [N, 1, rows, cols], labels as int64 [N].
std::pair<torch::Tensor, torch::Tensor> ToTensors(const ImageSet& set,
                                                  int64_t limit) {
  const int64_t n = limit > 0 ? std::min(limit, set.count) : set.count;
  torch::Tensor images =
      torch::from_blob(const_cast<uint8_t*>(set.pixels.data()),
                       {n, 1, set.rows, set.cols}, torch::kUInt8)
          .to(torch::kFloat)
          .div_(255.0f)
          .sub_(kPixelMean)
          .div_(kPixelStd);
  torch::Tensor labels =
      torch::from_blob(const_cast<uint8_t*>(set.labels.data()), {n},
                       torch::kUInt8)
          .to(torch::kLong);
  return {images, labels};
}

struct EvalResult {
  double accuracy = 0;
  double loss = 0;
};

EvalResult Evaluate(Net& model, const torch::Tensor& images,
                    const torch::Tensor& labels, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  const int64_t n = images.size(0);
  int64_t correct = 0;
  double loss_sum = 0;
  for (int64_t begin = 0; begin < n; begin += kEvalBatch) {
    const int64_t end = std::min(n, begin + kEvalBatch);
    torch::Tensor x = images.slice(0, begin, end).to(device);
    torch::Tensor y = labels.slice(0, begin, end).to(device);
    torch::Tensor logits = model->forward(x);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, y,
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(
                        torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  model->train();
  return {static_cast<double>(correct) / n, loss_sum / n};
}

// Writes the parameters, in named order, as raw little-endian float32 (the
// layout's flat buffer; x86 and arm64 hosts are little-endian). `flag` names
// the flag that asked for it, for error messages.
absl::Status DumpParams(Net& model, const std::string& path,
                        absl::string_view flag) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": cannot open ", path, " for writing"));
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    torch::Tensor t =
        item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();
    out.write(reinterpret_cast<const char*>(t.data_ptr<float>()),
              static_cast<std::streamsize>(t.numel() * sizeof(float)));
  }
  out.close();
  if (!out) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": writing ", path, " failed"));
  }
  return absl::OkStatus();
}

double Mean(const std::vector<float>& v, size_t begin, size_t end) {
  if (begin >= end) return 0;
  return std::accumulate(v.begin() + begin, v.begin() + end, 0.0) /
         static_cast<double>(end - begin);
}

std::string SyncLine(const LocalSGD& local_sgd) {
  const SyncOutcome& o = local_sgd.last_outcome();
  return absl::StrFormat(
      "sync round=%d step=%d seconds=%.3f contributed=%d late=%d "
      "contributors=%d bytes_sent=%d bytes_received=%d rejoined=%d",
      o.round, local_sgd.steps(), local_sgd.last_sync_seconds(),
      o.contributed ? 1 : 0, o.late ? 1 : 0, o.contributors,
      local_sgd.bytes_sent_total(), local_sgd.bytes_received_total(),
      o.rejoined ? 1 : 0);
}

absl::Status Run(const Config& c) {
  torch::set_num_threads(c.threads);
  torch::Device device(torch::kCPU);
  try {
    device = torch::Device(c.device);
  } catch (const c10::Error&) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", c.device, ": expected cpu or cuda[:N]"));
  }
  if (device.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", c.device,
        ": CUDA is not available (this LibTorch has no CUDA support or no "
        "GPU is visible); use --device=cpu"));
  }
  if (!device.is_cpu() && !device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", c.device, ": expected cpu or cuda[:N]"));
  }

  // Data first: a missing data set fails before joining the job.
  absl::StatusOr<ImageSet> train_set = LoadFashionMnist(c.data_dir, true);
  if (!train_set.ok()) return train_set.status();
  absl::StatusOr<ImageSet> test_set = LoadFashionMnist(c.data_dir, false);
  if (!test_set.ok()) return test_set.status();
  auto [train_images, train_labels] = ToTensors(*train_set, 0);
  auto [test_images, test_labels] = ToTensors(*test_set, c.eval_examples);
  train_set->pixels.clear();
  train_set->pixels.shrink_to_fit();

  // A permutation of the training set that every worker draws from the same
  // seed; rank r takes its positions i with i % world == r.
  const int64_t num_train = train_images.size(0);
  std::vector<int64_t> permutation(num_train);
  std::iota(permutation.begin(), permutation.end(), 0);
  PortableShuffle(permutation, c.seed);
  std::vector<int64_t> shard;
  for (int64_t i = c.rank; i < num_train; i += c.world) {
    shard.push_back(permutation[i]);
  }
  // Every worker runs the same number of steps (the smallest shard's), so
  // that all take part in the same rounds.
  const int64_t steps_per_epoch = (num_train / c.world) / c.batch_size;
  if (steps_per_epoch == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shard of ", num_train / c.world,
                     " examples is smaller than --batch_size=", c.batch_size));
  }
  int64_t total_steps = steps_per_epoch * c.epochs;
  if (c.max_steps > 0) total_steps = std::min(total_steps, c.max_steps);

  // The model. Every worker builds it from the same seed; the coordinator's
  // seed/fetch makes the parameters identical in any case.
  torch::manual_seed(c.seed);
  Net model(c.widths);
  model->to(device);

  // The node group, if any: local rank 0 is the node's only member of the
  // job, with weight = the node's process count.
  NodeGroup node_group;
  if (c.local_world_size > 1) {
    NodeGroupOptions group_options;
    group_options.local_rank = c.local_rank;
    group_options.local_world_size = c.local_world_size;
    group_options.store_address = c.node_store;
    group_options.cuda = device.is_cuda() && NodeGroupHasNccl();
    group_options.timeout = absl::Seconds(c.node_timeout_seconds);
    absl::StatusOr<NodeGroup> made = MakeNodeGroup(group_options);
    if (!made.ok()) return made.status();
    node_group = *std::move(made);
    Emit(c, absl::StrFormat("node_group local_rank=%d local_world_size=%d "
                            "backend=%s store=%s",
                            node_group.rank(), node_group.size(),
                            node_group.backend(), c.node_store));
  }

  // Join the job and adopt its global state (the first member seeds it).
  std::unique_ptr<Client> client;
  if (!c.no_sync && node_group.rank() == 0) {
    ClientOptions options;
    options.target = c.coordinator;
    if (absl::StrContains(c.coordinator, ',')) {
      options.replicas = absl::StrSplit(c.coordinator, ',', absl::SkipEmpty());
    }
    options.resolve_replicas = absl::GetFlag(FLAGS_resolve_replicas);
    options.job_id = c.job;
    options.member_name =
        node_group.valid()
            ? absl::StrCat("node-rank", c.rank, "x", node_group.size())
            : absl::StrCat("rank", c.rank);
    options.weight = node_group.size();
    options.settings.local_sgd_steps = static_cast<uint32_t>(c.k);
    options.settings.wire_dtype = c.wire_dtype;
    options.settings.sparse_keep = c.sparse_keep;
    options.settings.sparse_result_keep = c.sparse_result_keep;
    options.error_reset = absl::GetFlag(FLAGS_error_reset);
    options.settings.contribution = c.contribution;
    options.settings.mode = c.averaging;
    options.settings.outer_lr = static_cast<float>(c.outer_lr);
    options.settings.outer_momentum = static_cast<float>(c.outer_momentum);
    options.settings.rendezvous_members = static_cast<uint32_t>(c.rendezvous);
    options.settings.chunk_elements = static_cast<uint32_t>(c.chunk_elements);
    if (const std::string mode = absl::GetFlag(FLAGS_deadline_mode);
        mode == "adaptive") {
      options.settings.deadline_mode = DeadlineMode::kAdaptive;
    } else if (mode == "fixed") {
      options.settings.deadline_mode = DeadlineMode::kFixed;
    } else if (!mode.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--deadline_mode must be fixed or adaptive, got '", mode, "'"));
    }
    if (const std::string e = absl::GetFlag(FLAGS_mean_encoding); e == "wire") {
      options.settings.mean_encoding = MeanEncoding::kWire;
    } else if (e == "float32") {
      options.settings.mean_encoding = MeanEncoding::kFloat32;
    } else if (!e.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--mean_encoding must be float32 or wire, got '", e, "'"));
    }
    absl::StatusOr<ChannelSecurity> security = ChannelSecurityFromFlags();
    if (!security.ok()) return security.status();
    options.security = *std::move(security);
    absl::StatusOr<std::unique_ptr<Client>> created = Client::Create(options);
    if (!created.ok()) return created.status();
    client = std::move(*created);
  }
  LocalSGDOptions local_sgd_options;
  local_sgd_options.local_sgd_steps = c.k;
  local_sgd_options.enabled = !c.no_sync;
  local_sgd_options.node_group = node_group;
  local_sgd_options.overlap = absl::GetFlag(FLAGS_overlap);
  absl::StatusOr<std::unique_ptr<LocalSGD>> created =
      LocalSGD::Create(*model, client.get(), local_sgd_options);
  if (!created.ok()) {
    if (client != nullptr) client->Leave().IgnoreError();
    return created.status();
  }
  std::unique_ptr<LocalSGD> local_sgd = std::move(*created);
  // On an error below: no final sync (the others may be gone), leave at once.
  bool finished = false;
  absl::Cleanup on_error = [&] {
    if (finished) return;
    local_sgd->Abandon();
    if (client != nullptr) client->Leave().IgnoreError();
  };
  if (client != nullptr) {
    Emit(c, absl::StrCat("joined member=", client->info().member_id.str(),
                         " state_round=", client->state_round(),
                         " elements=", local_sgd->num_elements()));
  }
  // --dump_dir: the parameters as adopted (the job's state of round R), and
  // after every successful sync.
  const int64_t start_round =
      client != nullptr ? static_cast<int64_t>(client->state_round()) : 0;
  auto dump_round = [&](absl::string_view what, int64_t round) -> absl::Status {
    if (c.dump_dir.empty()) return absl::OkStatus();
    return DumpParams(
        model, absl::StrCat(c.dump_dir, "/r", c.rank, "_", what, round, ".bin"),
        "--dump_dir");
  };
  if (absl::Status s = dump_round("init_round", start_round); !s.ok()) {
    return s;
  }
  // --max_rounds: whether the job's state this worker holds has reached it.
  auto reached_max_rounds = [&] {
    return c.max_rounds > 0 && client != nullptr &&
           client->state_round() >= static_cast<uint64_t>(c.max_rounds);
  };

  Emit(c,
       absl::StrFormat(
           "start world=%d k=%d batch_size=%d lr=%g momentum=%g "
           "shard=%d steps=%d params=%d device=%s threads=%d sync=%d "
           "wire_dtype=%s contribution=%s averaging=%s",
           c.world, c.k, c.batch_size, c.lr, c.momentum, shard.size(),
           total_steps, local_sgd->num_elements(), device.str(), c.threads,
           c.no_sync ? 0 : 1, DTypeName(c.wire_dtype),
           ContributionName(c.contribution), AveragingModeName(c.averaging)));

  torch::optim::SGD optimizer(
      model->parameters(), torch::optim::SGDOptions(c.lr).momentum(c.momentum));
  // --scale_delta: the state this worker trained from (what it adopted,
  // then every sync's result).
  std::vector<torch::Tensor> trained_from;
  auto remember_state = [&] {
    if (c.scale_delta == 1) return;
    torch::NoGradGuard no_grad;
    trained_from.clear();
    for (const torch::Tensor& p : model->parameters()) {
      trained_from.push_back(p.detach().clone());
    }
  };
  remember_state();
  model->train();
  std::vector<float> losses;
  losses.reserve(static_cast<size_t>(total_steps));
  const auto train_start = std::chrono::steady_clock::now();
  int64_t step = 0;
  int64_t evals_due = 0;  // syncs (or K-step periods) since the last eval
  bool stop = reached_max_rounds();
  if (stop) {
    Emit(c, absl::StrFormat("max_rounds reached round=%d step=%d",
                            client->state_round(), step));
  }
  for (int epoch = 0; epoch < c.epochs && step < total_steps && !stop;
       ++epoch) {
    PortableShuffle(shard, EpochSeed(c.seed, c.rank, epoch));
    for (int64_t b = 0; b < steps_per_epoch && step < total_steps && !stop;
         ++b) {
      torch::Tensor index = torch::from_blob(shard.data() + b * c.batch_size,
                                             {c.batch_size}, torch::kLong);
      torch::Tensor x = train_images.index_select(0, index).to(device);
      torch::Tensor y = train_labels.index_select(0, index).to(device);
      optimizer.zero_grad();
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      optimizer.step();
      losses.push_back(loss.item<float>());
      ++step;

      const int64_t syncs_before = local_sgd->num_syncs();
      const int64_t skipped_before = local_sgd->num_skipped_syncs();
      if (c.scale_delta != 1 && (local_sgd->steps() + 1) % c.k == 0) {
        // This step syncs: theta = anchor + scale * (theta - anchor).
        torch::NoGradGuard no_grad;
        std::vector<torch::Tensor> params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          params[i]
              .sub_(trained_from[i])
              .mul_(c.scale_delta)
              .add_(trained_from[i]);
        }
      }
      if (absl::Status s = local_sgd->Step(); !s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("sync at step ", step, ": ", s.message()));
      }
      bool period_ended = false;
      if (local_sgd->num_skipped_syncs() != skipped_before) {
        Emit(c, absl::StrFormat("sync skipped step=%d (coordinator "
                                "unreachable; training on locally)",
                                step));
      } else if (local_sgd->num_syncs() != syncs_before) {
        Emit(c, SyncLine(*local_sgd));
        period_ended = true;
        remember_state();
        if (absl::Status s =
                dump_round("round", local_sgd->last_outcome().round);
            !s.ok()) {
          return s;
        }
        if (reached_max_rounds()) {
          stop = true;
          Emit(c, absl::StrFormat("max_rounds reached round=%d step=%d",
                                  client->state_round(), step));
        }
      } else if (c.no_sync && step % c.k == 0) {
        period_ended = true;
      }
      if (step % c.log_every == 0) {
        Emit(c, absl::StrFormat(
                    "step=%d epoch=%d loss=%.4f", step, epoch,
                    Mean(losses, losses.size() - c.log_every, losses.size())));
      }
      if (period_ended && c.rank == 0 && c.eval_every_sync > 0 &&
          ++evals_due == c.eval_every_sync) {
        evals_due = 0;
        const EvalResult r = Evaluate(model, test_images, test_labels, device);
        Emit(c, absl::StrFormat(
                    "eval round=%d step=%d test_accuracy=%.4f test_loss=%.4f",
                    local_sgd->last_outcome().round, step, r.accuracy, r.loss));
      }
    }
  }
  const double train_seconds = SecondsSince(train_start);

  // As accelerate's __exit__: one final sync; then leave the job.
  const int64_t syncs_before_close = local_sgd->num_syncs();
  if (absl::Status s = local_sgd->Close(); !s.ok()) return s;
  if (local_sgd->num_syncs() != syncs_before_close) {
    Emit(c, SyncLine(*local_sgd));
    if (absl::Status s = dump_round("round", local_sgd->last_outcome().round);
        !s.ok()) {
      return s;
    }
  } else if (local_sgd->last_sync_skipped()) {
    Emit(c, absl::StrFormat("sync skipped step=%d (coordinator unreachable; "
                            "final sync lost, keeping local parameters)",
                            step));
  }
  finished = true;
  if (client != nullptr) {
    if (absl::Status s = client->Leave(); !s.ok()) {
      LOG(WARNING) << "Leave failed (the coordinator drops the member when "
                      "its lease expires): "
                   << s;
    }
  }

  const size_t window = std::min<size_t>(c.log_every, losses.size());
  std::string final_line =
      absl::StrFormat("final step=%d rounds=%d", step, local_sgd->num_syncs());
  if (c.rank == 0) {
    // Every worker holds the same parameters now: one evaluation suffices.
    const EvalResult r = Evaluate(model, test_images, test_labels, device);
    absl::StrAppendFormat(&final_line, " test_accuracy=%.4f test_loss=%.4f",
                          r.accuracy, r.loss);
  }
  absl::StrAppendFormat(
      &final_line,
      " first_loss=%.4f last_loss=%.4f sync_seconds_total=%.3f "
      "train_seconds=%.1f bytes_sent=%d bytes_received=%d",
      Mean(losses, 0, window),
      Mean(losses, losses.size() - window, losses.size()),
      local_sgd->sync_seconds_total(), train_seconds,
      local_sgd->bytes_sent_total(), local_sgd->bytes_received_total());
  if (!c.dump_params.empty()) {
    if (absl::Status s = DumpParams(model, c.dump_params, "--dump_params");
        !s.ok()) {
      return s;
    }
  }
  Emit(c, final_line);
  return absl::OkStatus();
}

}  // namespace
}  // namespace examples
}  // namespace localsgd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(absl::StrCat(
      "Trains a small CNN on Fashion-MNIST with Local SGD: every --k steps "
      "the workers' parameters are averaged by a localsgd coordinator.\n\n"
      "Example, 4 workers (see scripts/run-demo.sh):\n"
      "  localsgd-coordinator --listen=127.0.0.1:50051 &\n"
      "  for r in 0 1 2 3; do\n"
      "    ",
      localsgd::examples::kProgram,
      " --coordinator=127.0.0.1:50051 --world=4 --rank=$r --k=16 &\n"
      "  done; wait\n\n"
      "Baseline without averaging: ",
      localsgd::examples::kProgram, " --no_sync --world=4 --rank=0"));
  // --help lists the flags of this file (Abseil's default looks for a file
  // named after the program).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "fashion_mnist_worker.") ||
           absl::EndsWith(file, "client/security_flags.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // Warm buffers for the sync's messages (src/malloc_tuning.h).
  localsgd::KeepFreedMemoryForReuse();

  absl::StatusOr<localsgd::examples::Config> config =
      localsgd::examples::ConfigFromFlags();
  if (!config.ok()) {
    std::cerr << localsgd::examples::kProgram << ": " << config.status()
              << " (see --help)\n";
    return 2;
  }
  absl::Status status;
  try {
    status = localsgd::examples::Run(*config);
  } catch (const c10::Error& e) {
    status = absl::InternalError(
        absl::StrCat("LibTorch error: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    std::cerr << localsgd::examples::kProgram << ": rank=" << config->rank
              << " error: " << status << "\n";
    return 1;
  }
  return 0;
}
