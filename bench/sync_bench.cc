// sync_bench: times one localsgd sync round barrier to barrier, the way
// ../shared/bench/peer_accelerate_localsgd.py times accelerate's LocalSGD on
// gloo, against a running localsgd-coordinator.
//
// The parent forks --world light worker processes (and, with --fetch, one late
// joiner) BEFORE any gRPC object exists; it never touches gRPC itself. The
// children meet at process-shared pthread barriers in anonymous shared memory
// and write their per-round times there. Every worker holds the peer's tensor
// mix (shapes() of the peer script: t0, t1, ... fp32), joins with
// rendezvous_members = world, initializes, then runs 1 warm-up round and
// --rounds timed rounds:
//
//   all workers pass a barrier; t0; Client::Sync; all pass a barrier; t1
//
// Before each round a worker overwrites its parameters with values that
// depend on its rank and the round (outside the timed region), and after the
// round it checks sampled elements against the expected mean, so a broken
// average fails the run, and the parent checks that every worker's whole
// state has the same CRC32C after every round.
//
// With --fetch, after the rounds (the workers still members) the late joiner
// joins and times Client::FetchState of the whole model --fetch_repeats times.
//
// With --coordinator_pid, the parent reads the coordinator's VmHWM (peak RSS)
// from /proc once every child is done, and its thread and descriptor
// counts every 100 ms while they run (the largest are reported).
//
// Every worker counts its process's CPU seconds (all its threads) over the
// timed rounds, and with --coordinator_pid rank 0 reads the coordinator's
// over the same span: the summary gives both per round and the share of
// the machine's cores they kept busy (on a machine whose few cores run
// every process, what the round's time is made of).
//
// With --status_poll_ms, one more child calls GetJobStatus on the (first)
// coordinator every that many ms from the end of the warm-up round until
// the last timed round ends, and the summary gives its latencies (what an
// operator's `localsgdctl status` or dashboard sees while rounds run).
//
// With --worker_netns=PREFIX, worker r runs in network namespace PREFIX<r>
// (bench/netns_scaleout.sh: one host per worker behind a rate-limited link).
//
// Output: a human-readable summary on stderr and one line on stdout:
//   RESULT world=.. params=.. wire=.. rounds=.. median_s=.. min_s=.. max_s=..
//          bytes_sent=.. bytes_received=.. fetch_median_s=.. fetch_GBps=..
//          coordinator_hwm_kib=.. [worker_cpu_s=.. [coordinator_cpu_s=..]]
//          [coordinator_threads=.. coordinator_fds=..]
//          [status_calls=.. status_p50_ms=..
//          status_p99_ms=.. status_max_ms=.. status_failed=.., and the same
//          with page_ for --status_page]
// (bytes_* per worker per round, payload only). Exit status 0 on success, 1 on
// any failure (a child's error, a wrong average, --timeout).
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/background_sync.h"
#include "client/client.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "src/crc32c.h"
#include "src/layout.h"
#include "src/malloc_tuning.h"
#include "src/types.h"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator address host:port, or a comma-separated list of "
          "replicas (sharded coordinators: chunk i goes to replica i mod S).");
ABSL_FLAG(int32_t, world, 4, "Worker processes.");
ABSL_FLAG(double, millions, 25, "Model size in millions of fp32 parameters.");
ABSL_FLAG(int32_t, rounds, 5, "Timed rounds (after one warm-up round).");
ABSL_FLAG(bool, parameters, false,
          "Send parameters (a job of parameters, the protocol before "
          "pseudo-gradients) instead of pseudo-gradients.");
ABSL_FLAG(std::string, wire_dtype, "float32",
          "float32, bfloat16, int8, int4, sparse2 or sparse4 (the job takes "
          "pseudo-gradients, the client's default). The sparse codes keep "
          "--sparse_keep of every 4096 values: the members then agree bit "
          "for bit (checked) but hold no mean to check against.");
ABSL_FLAG(uint32_t, sparse_keep, 64,
          "With --wire_dtype=sparse2 or sparse4: the values kept of every "
          "4096.");
ABSL_FLAG(uint32_t, sparse_result_keep, 256,
          "With --wire_dtype=sparse2 or sparse4: the values the coordinator's "
          "step keeps of every 4096.");
ABSL_FLAG(uint32_t, chunk_elements, 0,
          "Elements per chunk the job asks for; 0: the coordinator's default.");
ABSL_FLAG(bool, fetch, false,
          "After the rounds, time a late joiner's FetchState of the model.");
ABSL_FLAG(int32_t, fetch_repeats, 3, "FetchState calls the late joiner times.");
ABSL_FLAG(int64_t, coordinator_pid, 0,
          "If > 0, report this process's VmHWM (peak RSS) at the end, and its "
          "most threads and open descriptors while the workers ran, and its "
          "CPU seconds over the timed rounds.");
ABSL_FLAG(std::string, job_id, "bench", "Job id.");
ABSL_FLAG(int32_t, status_poll_ms, 0,
          "If > 0, a child calls GetJobStatus every this many ms while the "
          "timed rounds run (plaintext channel to the first coordinator) and "
          "the summary gives the calls' latencies.");
ABSL_FLAG(int32_t, worker_nice, 0,
          "Workers (and the late joiner) run at this nice value (0..19): "
          "with many workers on the coordinator's own machine, a higher one "
          "leaves the coordinator and the status poller the CPU they would "
          "have on a machine of their own.");
ABSL_FLAG(std::string, status_page, "",
          "With --status_poll_ms: also GET the status page's JSON "
          "(http://HOST:PORT/api/v1/status, the coordinator's --http_listen) "
          "each time, and give its latencies.");
ABSL_FLAG(absl::Duration, timeout, absl::Minutes(15),
          "Whole-run limit; on expiry every child is killed and the run "
          "fails.");
ABSL_FLAG(std::string, worker_netns, "",
          "If set, worker r enters the network namespace named PREFIX<r> "
          "(/var/run/netns/PREFIX<r>, as `ip netns add` makes; needs root) "
          "before it creates its client. For bench/netns_scaleout.sh; not "
          "with --fetch.");
ABSL_FLAG(bool, verbose, false, "Client INFO logs on stderr.");
ABSL_FLAG(double, compute_ms, 0,
          "Free-running mode (> 0): every round is --local_steps simulated "
          "local steps of this many ms (a sleep: compute that does not use "
          "the CPU, like a GPU's) and then a sync, with no barrier between "
          "rounds; prints the wall time per round against compute alone. "
          "The exact-mean check is off (workers drift apart by design).");
ABSL_FLAG(int32_t, local_steps, 16, "Free-running mode: K, steps per round.");
ABSL_FLAG(bool, overlap, false,
          "Free-running mode: sync in the background (BackgroundSync) and "
          "merge at the next sync point, instead of a blocking Sync.");
ABSL_FLAG(int32_t, straggler_rank, -1,
          "Free-running mode: this rank's steps take --straggler_factor "
          "times longer.");
ABSL_FLAG(double, straggler_factor, 3, "See --straggler_rank.");
ABSL_FLAG(int32_t, delay_rank, -1,
          "Free-running mode: this rank waits --delay_ms more once, before "
          "the sync of round --delay_round (a one-off delay).");
ABSL_FLAG(int32_t, delay_round, 5, "See --delay_rank.");
ABSL_FLAG(double, delay_ms, 0, "See --delay_rank.");
ABSL_FLAG(std::string, deadline_mode, "",
          "The job's deadline mode: fixed or adaptive (empty: the "
          "coordinator's default).");
ABSL_FLAG(uint32_t, max_lead_chunks, 4,
          "With early results: write chunk c only while c < result chunks "
          "received + this, once the first is back (ClientOptions::"
          "max_lead_chunks); 0: no limit.");
ABSL_FLAG(bool, early_results, true,
          "Full duplex: read result chunks while writing "
          "(ClientOptions::early_results).");

namespace localsgd {
namespace {

using Clock = std::chrono::steady_clock;

// The peer's shapes(): sizes cycle through these until the total.
std::vector<int64_t> PeerShapes(int64_t total) {
  static constexpr int64_t kCycle[] = {4194304, 1048576, 768, 3072};
  std::vector<int64_t> out;
  int64_t left = total;
  for (size_t i = 0; left > 0; ++i) {
    const int64_t n = std::min(left, kCycle[i % 4]);
    out.push_back(n);
    left -= n;
  }
  return out;
}

Layout PeerLayout(int64_t total) {
  std::vector<TensorSpec> tensors;
  const std::vector<int64_t> sizes = PeerShapes(total);
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back(
        TensorSpec{absl::StrCat("t", i), {sizes[i]}, DType::kFloat32});
  }
  return MakeLayout(std::move(tensors));
}

// Worker `rank`'s parameters before round `round`: a pattern shared by all
// ranks plus a per-rank and per-round offset, so that the mean is known.
inline float Value(size_t i, int rank, int round) {
  return static_cast<float>(static_cast<int>(i % 1024) - 512) / 512.0f +
         0.25f * static_cast<float>(rank) + 0.0625f * static_cast<float>(round);
}
void Fill(std::vector<float>& params, int rank, int round) {
  const float offset =
      0.25f * static_cast<float>(rank) + 0.0625f * static_cast<float>(round);
  float* p = params.data();
  const size_t n = params.size();
  for (size_t i = 0; i < n; ++i) {
    p[i] =
        static_cast<float>(static_cast<int>(i % 1024) - 512) / 512.0f + offset;
  }
}
// The mean over ranks 0..world-1 of Value(i, rank, round).
double ExpectedMean(size_t i, int world, int round) {
  double sum = 0;
  for (int r = 0; r < world; ++r) sum += Value(i, r, round);
  return sum / world;
}

// This process's CPU seconds so far, every thread's, user + system.
double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + t.tv_nsec / 1e9;
}

// Another process's CPU seconds so far (user + system, counted by the
// kernel in clock ticks: 10 ms at 100 Hz), or -1.
double ProcCpuSeconds(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  // Fields after the command's ")": state is the 3rd field, utime the 14th.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  const std::vector<std::string> fields =
      absl::StrSplit(stat.substr(close + 1), ' ', absl::SkipEmpty());
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// Laid out in MAP_SHARED | MAP_ANONYMOUS memory, followed by the per-round
// times: double[(rounds + 1) * world].
struct Shared {
  pthread_barrier_t workers;  // the `world` workers
  pthread_barrier_t all;      // the workers and the late joiner
  std::atomic<int> failed;
  uint64_t bytes_sent;  // rank 0, per round (the last timed one)
  uint64_t bytes_received;
  double fetch_seconds[64];
  int fetch_done;
  // Per rank (< 64), the last timed round's phases (SyncOutcome): seconds
  // from the stream's start to its last write, first and last result chunk.
  double upload_s[64];
  // --status_poll_ms: rank 0 sets warm once its warm-up round is done and
  // done after its last timed round; the poller's latencies in between.
  std::atomic<int> warm;
  std::atomic<int> done;
  static constexpr int kMaxStatusCalls = 16384;
  double status_ms[kMaxStatusCalls];
  int status_calls;
  int status_errors;
  double page_ms[kMaxStatusCalls];
  int page_calls;
  int page_errors;
  double first_result_s[64];
  double result_s[64];
  // Free-running mode, per rank (< 64): syncs whose contribution counted.
  int counted[64];
  // Barrier mode, per rank (< 64): the worker process's CPU seconds (every
  // thread, user + system) over the timed rounds, each from its Sync's start
  // to the barrier after it. With --coordinator_pid, rank 0's reading of
  // the coordinator's CPU seconds over the same span (-1: not read).
  double worker_cpu_s[64];
  double coordinator_cpu_s;
};
static_assert(std::atomic<int>::is_always_lock_free);

struct Config {
  std::vector<std::string> addresses;
  int world = 0;
  int64_t params = 0;
  int rounds = 0;
  DType wire = DType::kFloat32;
  uint32_t sparse_keep = 0;
  uint32_t sparse_result_keep = 0;
  uint32_t chunk_elements = 0;
  bool fetch = false;
  int fetch_repeats = 0;
  std::string job_id;
  std::string worker_netns;  // prefix; empty: stay in this namespace
};

// Whether ClientOptions has `replicas` (sharded coordinators); set it through
// `if constexpr` so this file builds with and without it.
template <typename T, typename = void>
struct HasReplicas : std::false_type {};
template <typename T>
struct HasReplicas<T, std::void_t<decltype(std::declval<T&>().replicas)>>
    : std::true_type {};
template <typename Options>
bool SetReplicas(Options& options, const std::vector<std::string>& list) {
  if constexpr (HasReplicas<Options>::value) {
    options.replicas = list;
    return true;
  } else {
    return false;
  }
}

// The outlier guard off where the library has one (JobSettings has
// `outlier_ratio`): the synthetic deltas differ in norm by rank by design
// (Value: the mean is known), up to 60x at 16 workers, which the guard
// refuses as outliers. The peer has no guard either.
template <typename T, typename = void>
struct HasOutlierGuard : std::false_type {};
template <typename T>
struct HasOutlierGuard<T,
                       std::void_t<decltype(std::declval<T&>().outlier_ratio)>>
    : std::true_type {};
template <typename Settings>
void GuardOff(Settings& settings) {
  if constexpr (HasOutlierGuard<Settings>::value) {
    settings.outlier_ratio = -1.0f;  // kOutlierGuardOff
  }
}

absl::StatusOr<ClientOptions> MakeOptions(const Config& config,
                                          std::string member_name) {
  ClientOptions options;
  options.target = config.addresses.front();
  if (config.addresses.size() > 1) {
    if (!SetReplicas(options, config.addresses)) {
      return absl::UnimplementedError(absl::StrCat(
          "--coordinator lists ", config.addresses.size(),
          " replicas, but this client library has no "
          "ClientOptions::replicas (sharded coordinators); give one address"));
    }
  }
  options.job_id = config.job_id;
  options.member_name = std::move(member_name);
  options.settings.wire_dtype = config.wire;
  options.settings.sparse_keep = config.sparse_keep;
  options.settings.sparse_result_keep = config.sparse_result_keep;
  options.settings.chunk_elements = config.chunk_elements;
  if (absl::GetFlag(FLAGS_parameters)) {
    options.settings.contribution = localsgd::Contribution::kParameters;
  }
  options.settings.rendezvous_members = static_cast<uint32_t>(config.world);
  GuardOff(options.settings);
  options.sync_timeout = absl::Minutes(10);
  options.rpc_timeout = absl::Seconds(60);
  options.early_results = absl::GetFlag(FLAGS_early_results);
  options.max_lead_chunks = absl::GetFlag(FLAGS_max_lead_chunks);
  if (absl::GetFlag(FLAGS_deadline_mode) == "adaptive") {
    options.settings.deadline_mode = localsgd::DeadlineMode::kAdaptive;
  } else if (absl::GetFlag(FLAGS_deadline_mode) == "fixed") {
    options.settings.deadline_mode = localsgd::DeadlineMode::kFixed;
  } else if (!absl::GetFlag(FLAGS_deadline_mode).empty()) {
    return absl::InvalidArgumentError("--deadline_mode: fixed or adaptive");
  }
  return options;
}

void Wait(pthread_barrier_t* barrier) { pthread_barrier_wait(barrier); }

[[noreturn]] void Fail(Shared* shared, const std::string& who,
                       const std::string& message) {
  std::fprintf(stderr, "sync_bench: %s: %s\n", who.c_str(), message.c_str());
  std::fflush(stderr);
  shared->failed.store(1);
  _exit(1);
}

// Where the workers' per-round state CRC32Cs are: after `times`.
uint32_t* StateCrcs(const Config& config, double* times) {
  return reinterpret_cast<uint32_t*>(
      times + static_cast<size_t>(config.rounds + 1) * config.world);
}

// One worker process. Returns only by _exit.
// A worker's start: its network namespace (if any), its client joined and
// initialized with `params` (rank's values of round 0).
std::unique_ptr<Client> StartWorker(const Config& config, int rank,
                                    Shared* shared,
                                    std::vector<float>& params) {
  const std::string who = absl::StrCat("worker ", rank);
  if (!config.worker_netns.empty()) {
    const std::string path =
        absl::StrCat("/var/run/netns/", config.worker_netns, rank);
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
      Fail(shared, who,
           absl::StrCat("cannot enter network namespace ", path, ": ",
                        std::strerror(errno)));
    }
    close(fd);
  }
  absl::StatusOr<ClientOptions> options =
      MakeOptions(config, absl::StrCat("bench-w", rank, "/", getpid()));
  if (!options.ok()) Fail(shared, who, options.status().ToString());
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(*options);
  if (!client.ok()) Fail(shared, who, client.status().ToString());
  if (absl::Status s = (*client)->Join(PeerLayout(config.params)); !s.ok()) {
    Fail(shared, who, absl::StrCat("Join: ", s.ToString()));
  }
  params.assign(static_cast<size_t>(config.params), 0.0f);
  Fill(params, rank, 0);
  if (absl::Status s = (*client)->Initialize(absl::MakeSpan(params)); !s.ok()) {
    Fail(shared, who, absl::StrCat("Initialize: ", s.ToString()));
  }
  return *std::move(client);
}

[[noreturn]] void RunWorker(const Config& config, int rank, Shared* shared,
                            double* times) {
  const std::string who = absl::StrCat("worker ", rank);
  std::vector<float> params;
  std::unique_ptr<Client> client = StartWorker(config, rank, shared, params);
  const double tolerance = config.wire == DType::kBFloat16 ? 1.0 / 64 : 1e-5;
  const size_t n = params.size();
  const size_t samples[] = {0, 1, n / 3, n / 2, n - 1};
  const int64_t coordinator_pid = absl::GetFlag(FLAGS_coordinator_pid);
  double cpu_s = 0, coordinator_cpu_start = -1;
  for (int r = 0; r <= config.rounds; ++r) {
    Fill(params, rank, r + 1);
    if (rank == 0 && r == 1 && coordinator_pid > 0) {
      coordinator_cpu_start = ProcCpuSeconds(coordinator_pid);
    }
    Wait(&shared->workers);
    const auto t0 = Clock::now();
    const double cpu0 = ProcessCpuSeconds();
    absl::StatusOr<SyncOutcome> outcome = client->Sync(absl::MakeSpan(params));
    Wait(&shared->workers);
    const auto t1 = Clock::now();
    if (r >= 1) cpu_s += ProcessCpuSeconds() - cpu0;
    if (rank == 0 && r == config.rounds && coordinator_cpu_start >= 0) {
      // Left at -1 (not read) unless both readings succeeded.
      const double end = ProcCpuSeconds(coordinator_pid);
      if (end >= 0) shared->coordinator_cpu_s = end - coordinator_cpu_start;
    }
    if (!outcome.ok()) {
      Fail(shared, who, absl::StrCat("Sync: ", outcome.status().ToString()));
    }
    times[r * config.world + rank] =
        std::chrono::duration<double>(t1 - t0).count();
    if (rank == 0 && r == 0) shared->warm.store(1);
    if (rank == 0 && r == config.rounds) shared->done.store(1);
    if (!outcome->contributed || outcome->late ||
        outcome->contributors != static_cast<uint32_t>(config.world)) {
      Fail(shared, who,
           absl::StrCat(
               "round ", outcome->round, ": contributed=", outcome->contributed,
               " late=", outcome->late, " contributors=", outcome->contributors,
               " (want ", config.world, ")"));
    }
    for (size_t i : samples) {
      // A sparse round moves a few values of each block: no mean to check.
      if (IsSparseDType(config.wire)) break;
      const double want = ExpectedMean(i, config.world, r + 1);
      if (std::abs(params[i] - want) >
          tolerance * std::max(1.0, std::abs(want))) {
        Fail(shared, who,
             absl::StrFormat("round %d: element %d is %.7g, want the mean "
                             "%.7g",
                             r, i, params[i], want));
      }
    }
    // The whole state's CRC32C, which the parent compares across workers.
    StateCrcs(config, times)[r * config.world + rank] = Crc32c(
        0, absl::string_view(reinterpret_cast<const char*>(params.data()),
                             params.size() * sizeof(float)));
    if (rank == 0) {
      shared->bytes_sent = outcome->bytes_sent;
      shared->bytes_received = outcome->bytes_received;
    }
    if (rank < 64) {
      shared->upload_s[rank] = absl::ToDoubleSeconds(outcome->upload_time);
      shared->first_result_s[rank] =
          absl::ToDoubleSeconds(outcome->first_result_time);
      shared->result_s[rank] = absl::ToDoubleSeconds(outcome->result_time);
    }
  }
  if (rank < 64) shared->worker_cpu_s[rank] = cpu_s;
  // Stay a member while the late joiner fetches, then leave.
  Wait(&shared->all);
  Wait(&shared->all);
  (void)client->Leave();
  client.reset();
  _exit(0);
}

// Free-running mode (--compute_ms > 0): K simulated steps, then a sync
// (blocking, or started in the background and merged at the next sync
// point), no barrier between rounds. times[r * world + rank] = the wall time
// of round r, from its first step to the next round's first step (the
// last round's: to its own sync's end). Returns only by _exit.
[[noreturn]] void RunComputeWorker(const Config& config, int rank,
                                   Shared* shared, double* times) {
  const std::string who = absl::StrCat("worker ", rank);
  std::vector<float> params;
  std::unique_ptr<Client> client = StartWorker(config, rank, shared, params);
  const bool overlap = absl::GetFlag(FLAGS_overlap);
  const int k = absl::GetFlag(FLAGS_local_steps);
  const double factor = rank == absl::GetFlag(FLAGS_straggler_rank)
                            ? absl::GetFlag(FLAGS_straggler_factor)
                            : 1.0;
  const auto step = std::chrono::duration<double, std::milli>(
      absl::GetFlag(FLAGS_compute_ms) * factor);
  BackgroundSync background(client.get());
  int counted = 0;
  auto count = [&](const absl::StatusOr<SyncOutcome>& outcome) {
    if (!outcome.ok()) {
      Fail(shared, who, absl::StrCat("Sync: ", outcome.status().ToString()));
    }
    if (outcome->contributed) ++counted;
  };
  Wait(&shared->workers);  // start together; then free-running
  auto round_start = Clock::now();
  for (int r = 0; r <= config.rounds; ++r) {
    for (int s = 0; s < k; ++s) {
      // A training step changes the parameters a little (not timed).
      params[static_cast<size_t>(s) % params.size()] += 1e-3f;
      std::this_thread::sleep_for(step);
      if (overlap && background.in_flight() && background.Ready()) {
        count(background.Finish(absl::MakeSpan(params)));
      }
    }
    if (rank == absl::GetFlag(FLAGS_delay_rank) &&
        r == absl::GetFlag(FLAGS_delay_round)) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(
          absl::GetFlag(FLAGS_delay_ms)));
    }
    if (overlap) {
      if (background.in_flight()) {
        count(background.Finish(absl::MakeSpan(params)));
      }
      if (absl::Status s = background.Start(params); !s.ok()) {
        Fail(shared, who, s.ToString());
      }
    } else {
      count(client->Sync(absl::MakeSpan(params)));
    }
    const auto now = Clock::now();
    times[r * config.world + rank] =
        std::chrono::duration<double>(now - round_start).count();
    round_start = now;
    if (rank == 0 && r == 0) shared->warm.store(1);
    if (rank == 0 && r == config.rounds) shared->done.store(1);
  }
  if (background.in_flight()) count(background.Finish(absl::MakeSpan(params)));
  if (rank < 64) shared->counted[rank] = counted;
  Wait(&shared->all);
  Wait(&shared->all);
  (void)client->Leave();
  client.reset();
  _exit(0);
}

// One GET of http://host:port/api/v1/status over a plain socket (HTTP/1.0:
// the server closes when done). Whether a 200 came back.
bool GetStatusPage(const std::string& host_port) {
  const std::vector<std::string> parts = absl::StrSplit(host_port, ':');
  if (parts.size() != 2) return false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(parts[0].c_str(), parts[1].c_str(), &hints, &found) != 0) {
    return false;
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  // A page that never answers fails the call, not the run.
  const timeval timeout{5, 0};
  const bool connected =
      fd >= 0 &&
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) == 0 &&
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout)) == 0 &&
      connect(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!connected) {
    if (fd >= 0) close(fd);
    return false;
  }
  const std::string request = absl::StrCat(
      "GET /api/v1/status HTTP/1.0\r\nHost: ", host_port, "\r\n\r\n");
  bool ok = write(fd, request.data(), request.size()) ==
            static_cast<ssize_t>(request.size());
  std::string response;
  char buffer[65536];
  for (ssize_t got; ok && (got = read(fd, buffer, sizeof(buffer))) > 0;) {
    response.append(buffer, static_cast<size_t>(got));
  }
  close(fd);
  return ok && absl::StartsWith(response, "HTTP/1.") &&
         response.find(" 200 ") != std::string::npos;
}

// --status_poll_ms: GetJobStatus (and the status page) every that many ms
// from the end of rank 0's warm-up round to the end of its last round.
[[noreturn]] void RunStatusPoller(const Config& config, Shared* shared) {
  const auto every =
      std::chrono::milliseconds(absl::GetFlag(FLAGS_status_poll_ms));
  const std::string page = absl::GetFlag(FLAGS_status_page);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
      config.addresses[0], grpc::InsecureChannelCredentials()));
  while (!shared->warm.load() && !shared->failed.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto ms_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  while (!shared->done.load() && !shared->failed.load()) {
    v1::GetJobStatusRequest request;
    request.set_job_id(config.job_id);
    v1::GetJobStatusResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    auto t0 = Clock::now();
    const bool ok = stub->GetJobStatus(&context, request, &response).ok();
    const double ms = ms_since(t0);
    if (!ok) {
      ++shared->status_errors;
    } else if (shared->status_calls < Shared::kMaxStatusCalls) {
      shared->status_ms[shared->status_calls++] = ms;
    }
    if (!page.empty()) {
      t0 = Clock::now();
      const bool page_ok = GetStatusPage(page);
      const double page_ms = ms_since(t0);
      if (!page_ok) {
        ++shared->page_errors;
      } else if (shared->page_calls < Shared::kMaxStatusCalls) {
        shared->page_ms[shared->page_calls++] = page_ms;
      }
    }
    std::this_thread::sleep_for(every);
  }
  _exit(0);
}

// The late joiner. Returns only by _exit.
[[noreturn]] void RunFetcher(const Config& config, Shared* shared) {
  const std::string who = "late joiner";
  Wait(&shared->all);  // the workers' rounds are done
  absl::StatusOr<ClientOptions> options =
      MakeOptions(config, absl::StrCat("bench-late/", getpid()));
  if (!options.ok()) Fail(shared, who, options.status().ToString());
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(*options);
  if (!client.ok()) Fail(shared, who, client.status().ToString());
  if (absl::Status s = (*client)->Join(PeerLayout(config.params)); !s.ok()) {
    Fail(shared, who, absl::StrCat("Join: ", s.ToString()));
  }
  if (!(*client)->info().has_state) {
    Fail(shared, who, "the job has no state after the rounds");
  }
  std::vector<float> params(static_cast<size_t>(config.params));
  // Touch the pages once so the timing is of the fetch, not of page faults
  // (the client's staging buffer still faults in on the first call).
  std::fill(params.begin(), params.end(), 0.0f);
  const int repeats = std::min(config.fetch_repeats, 64);
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    absl::StatusOr<RoundId> round =
        (*client)->FetchState(absl::MakeSpan(params));
    const auto t1 = Clock::now();
    if (!round.ok()) {
      Fail(shared, who,
           absl::StrCat("FetchState: ", round.status().ToString()));
    }
    shared->fetch_seconds[i] = std::chrono::duration<double>(t1 - t0).count();
  }
  const size_t n = params.size();
  const double want = ExpectedMean(n / 2, config.world, config.rounds + 1);
  const double tolerance = config.wire == DType::kBFloat16 ? 1.0 / 64 : 1e-5;
  if (!IsSparseDType(config.wire) &&
      std::abs(params[n / 2] - want) >
          tolerance * std::max(1.0, std::abs(want))) {
    Fail(shared, who,
         absl::StrFormat("fetched element %d is %.7g, want %.7g", n / 2,
                         params[n / 2], want));
  }
  shared->fetch_done = repeats;
  (void)(*client)->Leave();
  client->reset();
  Wait(&shared->all);
  _exit(0);
}

// VmHWM of `pid` in KiB, or -1.
// The number in the line of /proc/PID/status that starts with `key`, or -1.
int64_t ProcStatus(int64_t pid, absl::string_view key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, key)) {
      int64_t value = -1;
      std::string digits;
      for (char c : line) {
        if (c >= '0' && c <= '9') digits += c;
      }
      if (absl::SimpleAtoi(digits, &value)) return value;
    }
  }
  return -1;
}

int64_t PeakRssKib(int64_t pid) { return ProcStatus(pid, "VmHWM:"); }

// The process's open file descriptors, or -1.
int64_t OpenFds(int64_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

int Main(const Config& config, absl::Duration timeout, int64_t coordinator_pid,
         bool verbose) {
  // Checked here, before forking, so a bad address list fails once.
  if (absl::StatusOr<ClientOptions> options = MakeOptions(config, "check");
      !options.ok()) {
    std::fprintf(stderr, "sync_bench: %s\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }
  const int children = config.world + (config.fetch ? 1 : 0);
  const bool poll = absl::GetFlag(FLAGS_status_poll_ms) > 0;
  const size_t times_count =
      static_cast<size_t>(config.rounds + 1) * config.world;
  // times, then each round's CRC32C of each worker's state (barrier mode).
  const size_t bytes = sizeof(Shared) + times_count * sizeof(double) +
                       times_count * sizeof(uint32_t);
  void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    std::perror("sync_bench: mmap");
    return 1;
  }
  Shared* shared = new (memory) Shared();
  shared->coordinator_cpu_s = -1;
  double* times =
      reinterpret_cast<double*>(static_cast<char*>(memory) + sizeof(Shared));
  pthread_barrierattr_t attr;
  pthread_barrierattr_init(&attr);
  pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_barrier_init(&shared->workers, &attr, config.world);
  pthread_barrier_init(&shared->all, &attr, children);
  pthread_barrierattr_destroy(&attr);

  // Fork before anything creates a gRPC object (gRPC does not survive fork).
  std::fflush(nullptr);
  const pid_t parent = getpid();
  std::vector<pid_t> pids;
  for (int c = 0; c < children + (poll ? 1 : 0); ++c) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("sync_bench: fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      if (!verbose) FLAGS_minloglevel = 1;  // warnings and errors only
      // nice() may return -1 on success: errno tells.
      if (c < children && absl::GetFlag(FLAGS_worker_nice) > 0 &&
          (errno = 0, nice(absl::GetFlag(FLAGS_worker_nice))) == -1 &&
          errno != 0) {
        std::perror("sync_bench: nice");
        _exit(1);
      }
      if (c < config.world) {
        if (absl::GetFlag(FLAGS_compute_ms) > 0) {
          RunComputeWorker(config, c, shared, times);
        }
        RunWorker(config, c, shared, times);
      }
      if (c == children) RunStatusPoller(config, shared);
      RunFetcher(config, shared);
    }
    pids.push_back(pid);
  }

  // Wait for every child; a failure or the timeout kills the rest (they may
  // be blocked at a barrier the failed one will never reach).
  const auto deadline = Clock::now() + absl::ToChronoSeconds(timeout);
  int alive = children + (poll ? 1 : 0);
  // The coordinator's most threads and open descriptors while the children
  // run, sampled every 100 ms.
  int64_t max_threads = -1, max_fds = -1;
  auto next_sample = Clock::now();
  bool ok = true;
  std::string why;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      --alive;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        if (ok) {
          why = WIFSIGNALED(status)
                    ? absl::StrCat("a child died of signal ", WTERMSIG(status))
                    : "a child failed";
        }
        ok = false;
      }
      continue;
    }
    if (!ok || Clock::now() > deadline) {
      if (ok)
        why = absl::StrCat("timed out after ", absl::FormatDuration(timeout));
      ok = false;
      for (pid_t p : pids) kill(p, SIGKILL);
      while (waitpid(-1, nullptr, 0) > 0) {
      }
      break;
    }
    if (coordinator_pid > 0 && Clock::now() >= next_sample) {
      max_threads =
          std::max(max_threads, ProcStatus(coordinator_pid, "Threads:"));
      max_fds = std::max(max_fds, OpenFds(coordinator_pid));
      next_sample = Clock::now() + std::chrono::milliseconds(100);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int64_t hwm = coordinator_pid > 0 ? PeakRssKib(coordinator_pid) : -1;
  if (ok && absl::GetFlag(FLAGS_compute_ms) <= 0) {
    // Every worker holds the same state after every round, bit for bit.
    const uint32_t* crcs = StateCrcs(config, times);
    for (int r = 0; ok && r <= config.rounds; ++r) {
      for (int w = 1; ok && w < config.world; ++w) {
        if (crcs[r * config.world + w] != crcs[r * config.world]) {
          ok = false;
          why = absl::StrFormat(
              "after round %d worker %d's state (CRC32C %08x) differs from "
              "worker 0's (%08x)",
              r, w, crcs[r * config.world + w], crcs[r * config.world]);
        }
      }
    }
  }
  if (!ok) {
    std::fprintf(stderr, "sync_bench: FAILED: %s\n", why.c_str());
    return 1;
  }

  // Rank 0's times, like the peer (barrier to barrier, so all ranks agree to
  // within a barrier's wake-up).
  std::vector<double> rank0;
  for (int r = 1; r <= config.rounds; ++r)
    rank0.push_back(times[r * config.world]);
  const double median = Median(rank0);
  const double min = *std::min_element(rank0.begin(), rank0.end());
  const double max = *std::max_element(rank0.begin(), rank0.end());
  std::vector<double> fetch(shared->fetch_seconds,
                            shared->fetch_seconds + shared->fetch_done);
  const double fetch_median = Median(fetch);
  // The job takes pseudo-gradients (the client's default): its state is
  // fetched in float32 whatever the wire dtype.
  const double model_wire_bytes = static_cast<double>(config.params) * 4;
  const double fetch_gbps =
      fetch.empty() ? 0 : model_wire_bytes / fetch_median / 1e9;

  std::fprintf(stderr,
               "sync_bench: world=%d params=%lld wire=%s rounds=%d "
               "(+1 warm-up): median %.4f s, min %.4f s, max %.4f s; "
               "%.1f MB sent + %.1f MB received per worker per round\n",
               config.world, static_cast<long long>(config.params),
               std::string(DTypeName(config.wire)).c_str(), config.rounds,
               median, min, max, shared->bytes_sent / 1e6,
               shared->bytes_received / 1e6);
  if (absl::GetFlag(FLAGS_compute_ms) > 0) {
    // Free-running: rank 0's wall time per round (K steps and its sync)
    // against the compute alone.
    const double compute = absl::GetFlag(FLAGS_local_steps) *
                           absl::GetFlag(FLAGS_compute_ms) / 1e3;
    double sum = 0;
    for (double t : rank0) sum += t;
    const double mean = rank0.empty() ? 0 : sum / rank0.size();
    std::string counted;
    for (int r = 0; r < std::min(config.world, 64); ++r) {
      absl::StrAppend(&counted, r == 0 ? "" : ",", shared->counted[r]);
    }
    std::fprintf(stderr,
                 "sync_bench: free-running K=%d x %.1f ms%s%s: wall per "
                 "round median %.4f s, mean %.4f s; compute alone %.4f s "
                 "(mean/compute %.3f); syncs counted per rank of %d: %s\n",
                 absl::GetFlag(FLAGS_local_steps),
                 absl::GetFlag(FLAGS_compute_ms),
                 absl::GetFlag(FLAGS_overlap) ? ", overlap" : ", blocking",
                 absl::GetFlag(FLAGS_straggler_rank) >= 0
                     ? absl::StrFormat(", rank %d x%.1f slower",
                                       absl::GetFlag(FLAGS_straggler_rank),
                                       absl::GetFlag(FLAGS_straggler_factor))
                           .c_str()
                     : "",
                 median, mean, compute, compute > 0 ? mean / compute : 0,
                 config.rounds + 1, counted.c_str());
    std::printf(
        "COMPUTE overlap=%d straggler_rank=%d median_s=%.6f mean_s=%.6f "
        "compute_s=%.6f counted=%s\n",
        absl::GetFlag(FLAGS_overlap) ? 1 : 0,
        absl::GetFlag(FLAGS_straggler_rank), median, mean, compute,
        counted.c_str());
  }
  std::string cpu_fields;
  if (absl::GetFlag(FLAGS_compute_ms) <= 0) {
    // Where the last round's time went, per worker: with full duplex the
    // first result chunk comes before the last write.
    std::string phases;
    for (int r = 0; r < std::min(config.world, 64); ++r) {
      absl::StrAppendFormat(&phases, "%s%.2f/%.2f/%.2f", r == 0 ? "" : "  ",
                            shared->upload_s[r], shared->first_result_s[r],
                            shared->result_s[r]);
    }
    std::fprintf(stderr,
                 "sync_bench: last round per worker, s from its stream's "
                 "start to last write / first result chunk / last: %s\n",
                 phases.c_str());
    // CPU per round: a worker's (the mean over workers) and the
    // coordinator's, and what share of the machine's cores all of them
    // kept busy during the median round.
    double worker_cpu = 0;
    const int counted_ranks = std::min(config.world, 64);
    for (int r = 0; r < counted_ranks; ++r)
      worker_cpu += shared->worker_cpu_s[r];
    worker_cpu /= static_cast<double>(counted_ranks) * config.rounds;
    // Without --coordinator_pid, or where /proc could not be read, the
    // coordinator's CPU is not known: left out of the sum and the RESULT.
    const bool coordinator_read = shared->coordinator_cpu_s >= 0;
    const double coordinator_cpu =
        coordinator_read ? shared->coordinator_cpu_s / config.rounds : 0;
    const double busy =
        (worker_cpu * config.world + coordinator_cpu) /
        (static_cast<double>(std::thread::hardware_concurrency()) * median);
    std::fprintf(
        stderr,
        "sync_bench: CPU per round: %.4f s a worker, %s; %.0f%% of %u cores "
        "busy in a median round%s\n",
        worker_cpu,
        coordinator_read
            ? absl::StrFormat("%.4f s the coordinator", coordinator_cpu).c_str()
            : "the coordinator's not read",
        100 * busy, std::thread::hardware_concurrency(),
        coordinator_read ? "" : " (the workers alone)");
    cpu_fields = absl::StrFormat(" worker_cpu_s=%.6f", worker_cpu);
    if (coordinator_read) {
      absl::StrAppendFormat(&cpu_fields, " coordinator_cpu_s=%.6f",
                            coordinator_cpu);
    }
  }
  if (!fetch.empty()) {
    std::fprintf(stderr,
                 "sync_bench: late joiner FetchState of %.1f MB: median %.4f s "
                 "= %.2f GB/s\n",
                 model_wire_bytes / 1e6, fetch_median, fetch_gbps);
  }
  if (hwm >= 0) {
    std::fprintf(stderr,
                 "sync_bench: coordinator %lld peak RSS %.1f MiB, at most %lld "
                 "threads and %lld open descriptors\n",
                 static_cast<long long>(coordinator_pid), hwm / 1024.0,
                 static_cast<long long>(max_threads),
                 static_cast<long long>(max_fds));
  }
  std::printf(
      "RESULT world=%d params=%lld wire=%s rounds=%d median_s=%.6f "
      "min_s=%.6f max_s=%.6f bytes_sent=%llu bytes_received=%llu "
      "fetch_median_s=%.6f fetch_GBps=%.4f coordinator_hwm_kib=%lld",
      config.world, static_cast<long long>(config.params),
      std::string(DTypeName(config.wire)).c_str(), config.rounds, median, min,
      max, static_cast<unsigned long long>(shared->bytes_sent),
      static_cast<unsigned long long>(shared->bytes_received), fetch_median,
      fetch_gbps, static_cast<long long>(hwm));
  std::printf("%s", cpu_fields.c_str());
  if (coordinator_pid > 0) {
    std::printf(" coordinator_threads=%lld coordinator_fds=%lld",
                static_cast<long long>(max_threads),
                static_cast<long long>(max_fds));
  }
  if (poll) {
    // Latencies of the polls: calls, p50, p99, max (ms), and the failures.
    auto report = [](const char* what, double* ms, int calls, int errors) {
      std::vector<double> v(ms, ms + calls);
      std::sort(v.begin(), v.end());
      auto at = [&](double q) {
        if (v.empty()) return 0.0;
        const size_t i = static_cast<size_t>(std::ceil(q * v.size()));
        return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
      };
      std::fprintf(stderr,
                   "sync_bench: %s while rounds ran: %d calls, p50 %.1f ms, "
                   "p99 %.1f ms, max %.1f ms, %d failed\n",
                   what, calls, at(0.5), at(0.99), v.empty() ? 0.0 : v.back(),
                   errors);
      std::printf(
          " %s_calls=%d %s_p50_ms=%.2f %s_p99_ms=%.2f %s_max_ms=%.2f "
          "%s_failed=%d",
          what, calls, what, at(0.5), what, at(0.99), what,
          v.empty() ? 0.0 : v.back(), what, errors);
    };
    report("status", shared->status_ms, shared->status_calls,
           shared->status_errors);
    if (!absl::GetFlag(FLAGS_status_page).empty()) {
      report("page", shared->page_ms, shared->page_calls, shared->page_errors);
    }
  }
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace localsgd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times localsgd sync rounds against a running coordinator:\n"
      "  sync_bench --coordinator=127.0.0.1:PORT --world=4 --millions=25 "
      "--rounds=5 --wire_dtype=float32 [--fetch] [--coordinator_pid=PID]");
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  // As a worker may (src/malloc_tuning.h); forked workers inherit it.
  localsgd::KeepFreedMemoryForReuse();
  FLAGS_logtostderr = true;

  localsgd::Config config;
  for (absl::string_view a : absl::StrSplit(absl::GetFlag(FLAGS_coordinator),
                                            ',', absl::SkipEmpty())) {
    config.addresses.emplace_back(a);
  }
  config.world = absl::GetFlag(FLAGS_world);
  config.params =
      static_cast<int64_t>(std::llround(absl::GetFlag(FLAGS_millions) * 1e6));
  config.rounds = absl::GetFlag(FLAGS_rounds);
  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  config.wire = wire == "float32"    ? localsgd::DType::kFloat32
                : wire == "bfloat16" ? localsgd::DType::kBFloat16
                : wire == "int8"     ? localsgd::DType::kInt8Block
                : wire == "int4"     ? localsgd::DType::kInt4Block
                : wire == "sparse2"  ? localsgd::DType::kSparse2
                : wire == "sparse4"  ? localsgd::DType::kSparse4
                                     : localsgd::DType::kUnspecified;
  config.sparse_keep = absl::GetFlag(FLAGS_sparse_keep);
  config.sparse_result_keep = absl::GetFlag(FLAGS_sparse_result_keep);
  config.chunk_elements = absl::GetFlag(FLAGS_chunk_elements);
  config.fetch =
      absl::GetFlag(FLAGS_fetch) && absl::GetFlag(FLAGS_compute_ms) <= 0;
  config.fetch_repeats = absl::GetFlag(FLAGS_fetch_repeats);
  config.job_id = absl::GetFlag(FLAGS_job_id);
  config.worker_netns = absl::GetFlag(FLAGS_worker_netns);

  std::string error;
  if (config.addresses.empty()) error = "--coordinator is required";
  if (config.world < 1 || config.world > 4096)
    error = "--world must be 1..4096";
  if (config.params < 1) error = "--millions must give at least 1 parameter";
  if (config.rounds < 1) error = "--rounds must be >= 1";
  if (config.wire == localsgd::DType::kUnspecified) {
    error =
        "--wire_dtype must be float32, bfloat16, int8, int4, sparse2 or "
        "sparse4";
  }
  if (config.fetch && !config.worker_netns.empty()) {
    error = "--fetch does not combine with --worker_netns";
  }
  if (config.fetch_repeats < 1 || config.fetch_repeats > 64) {
    error = "--fetch_repeats must be 1..64";
  }
  if (!error.empty()) {
    std::fprintf(stderr, "sync_bench: %s\n", error.c_str());
    return 2;
  }
  return localsgd::Main(config, absl::GetFlag(FLAGS_timeout),
                        absl::GetFlag(FLAGS_coordinator_pid),
                        absl::GetFlag(FLAGS_verbose));
}
