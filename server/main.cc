// localsgd-coordinator: the daemon that averages Local SGD workers' parameters.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/server.h"

extern char** environ;

// Every flag below can also come from the environment: --foo_bar from
// LOCALSGD_FOO_BAR (see ApplyEnvironment). Keep flags here, in this file.

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "Address to serve gRPC on, host:port. Port 0 picks a free port "
          "(see --port_file).");
ABSL_FLAG(std::string, port_file, "",
          "If set, write the bound port to this file once serving (for "
          "scripts and tests that listen on port 0).");
ABSL_FLAG(std::string, metrics_listen, "",
          "Address to serve Prometheus metrics on (GET /metrics), host:port, "
          "e.g. 0.0.0.0:9090 (the container image sets that). Port 0 picks a "
          "free port (see --metrics_port_file). Empty: no metrics endpoint.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, write the bound metrics port to this file once serving.");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(30),
          "A member that makes no call (heartbeats included) for this long is "
          "dropped; an open round stops waiting for it.");
ABSL_FLAG(absl::Duration, round_deadline, absl::ZeroDuration(),
          "Once a round has been open this long, it closes as soon as "
          "--min_quorum members have contributed. 0: no deadline (rounds "
          "wait for every participant, or its lease).");
ABSL_FLAG(uint32_t, min_quorum, 1,
          "Complete contributions a round needs to close at its deadline.");
ABSL_FLAG(uint32_t, chunk_elements, 256 * 1024,
          "Default elements per chunk for new jobs (a job's first member may "
          "ask for another size).");
ABSL_FLAG(std::string, wire_dtype, "float32",
          "Default wire dtype for new jobs: float32 or bfloat16.");
ABSL_FLAG(uint32_t, max_jobs, 64, "Most jobs this coordinator holds.");
ABSL_FLAG(uint32_t, max_members_per_job, 1024, "Most members in one job.");
ABSL_FLAG(uint64_t, max_model_elements, uint64_t{2} << 30,
          "Largest model of a job, in elements (fp32 parameters).");
ABSL_FLAG(int32_t, max_message_bytes, 17 << 20,
          "Largest gRPC message accepted or sent; bounds the chunk size.");
ABSL_FLAG(uint32_t, recent_rounds, 100,
          "Closed rounds kept per job for status and late members.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for job checkpoints (created if missing). Every new "
          "global state is written there atomically in the background, and "
          "jobs are restored from it on start, before serving. Empty: no "
          "checkpoints; a restarted coordinator then re-seeds jobs from the "
          "workers' next Sync.");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(10),
          "The drain on SIGTERM/SIGINT: health goes NOT_SERVING at once and "
          "no new round opens; rounds already open get this long to close, "
          "then their members are told UNAVAILABLE (they retry), the "
          "checkpoints are written and the process exits 0. Results still "
          "being sent get at least 2 s more. Set Kubernetes' "
          "terminationGracePeriodSeconds above it.");

namespace {

constexpr char kProgram[] = "localsgd-coordinator";
constexpr char kEnvPrefix[] = "LOCALSGD_";

bool IsOwnFlag(const absl::CommandLineFlag& flag) {
  return absl::EndsWith(flag.Filename(), "server/main.cc");
}

// LOCALSGD_ + the flag name in upper case: --state_dir is LOCALSGD_STATE_DIR.
std::string EnvName(absl::string_view flag_name) {
  return absl::StrCat(kEnvPrefix, absl::AsciiStrToUpper(flag_name));
}

// Sets every flag of this file whose environment variable is set, before the
// command line is parsed (so the command line wins). INVALID_ARGUMENT naming
// the variable if a value does not parse. Warns of LOCALSGD_ variables that
// name no flag (a typo would otherwise go unnoticed).
absl::Status ApplyEnvironment() {
  absl::flat_hash_set<std::string> known;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsOwnFlag(*flag)) continue;
    const std::string env = EnvName(name);
    known.insert(env);
    const char* value = std::getenv(env.c_str());
    if (value == nullptr) continue;
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable ", env, "='", value,
                       "' is not a valid --", name, ": ", error));
    }
  }
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    if (!absl::StartsWith(entry, kEnvPrefix)) continue;
    const absl::string_view name = entry.substr(0, entry.find('='));
    if (!known.contains(name)) {
      std::fprintf(stderr,
                   "%s: warning: environment variable %.*s names no flag; "
                   "ignored\n",
                   kProgram, static_cast<int>(name.size()), name.data());
    }
  }
  return absl::OkStatus();
}

// Writes `port` to `path` atomically (write, then rename), so that a reader
// never sees a partial file.
bool WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out) {
      LOG(ERROR) << "cannot write " << tmp;
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    LOG(ERROR) << "cannot rename " << tmp << " to " << path;
    return false;
  }
  return true;
}

absl::StatusOr<localsgd::ServerOptions> OptionsFromFlags() {
  localsgd::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen_address = absl::GetFlag(FLAGS_metrics_listen);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  localsgd::CoordinatorOptions& c = options.coordinator;
  c.policy.lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  c.policy.round_deadline = absl::GetFlag(FLAGS_round_deadline);
  c.policy.min_quorum = absl::GetFlag(FLAGS_min_quorum);
  c.policy.max_members = absl::GetFlag(FLAGS_max_members_per_job);
  c.policy.max_recent_rounds = absl::GetFlag(FLAGS_recent_rounds);
  c.default_settings.chunk_elements = absl::GetFlag(FLAGS_chunk_elements);
  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  if (wire == "float32") {
    c.default_settings.wire_dtype = localsgd::DType::kFloat32;
  } else if (wire == "bfloat16") {
    c.default_settings.wire_dtype = localsgd::DType::kBFloat16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--wire_dtype must be float32 or bfloat16; got '", wire, "'"));
  }
  c.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  c.max_model_elements = absl::GetFlag(FLAGS_max_model_elements);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "localsgd-coordinator: averages the parameters of Local SGD workers.\n"
      "Workers join a job, train K local steps, and Sync; the coordinator "
      "returns the weighted mean of the round's contributions.\n"
      "usage: localsgd-coordinator [--listen=HOST:PORT] [flags]\n"
      "Every flag can also be set by an environment variable: LOCALSGD_ and "
      "the flag name in upper case (--state_dir: LOCALSGD_STATE_DIR, "
      "--lease_ttl: LOCALSGD_LEASE_TTL). The command line wins over the "
      "environment.");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  if (absl::Status s = ApplyEnvironment(); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 std::string(s.message()).c_str());
    return 2;
  }
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);

  // Block the shutdown signals in every thread (gRPC's included, which are
  // created below) and take them synchronously in main.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<localsgd::ServerOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 options.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<localsgd::CoordinatorServer>> server =
      localsgd::CoordinatorServer::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 server.status().ToString().c_str());
    return 1;
  }
  // The metrics port first: a script that sees --port_file may scrape.
  const std::string metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  if (!metrics_port_file.empty() &&
      !WritePortFile(metrics_port_file, (*server)->metrics_port())) {
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !WritePortFile(port_file, (*server)->port())) {
    return 1;
  }

  int sig = 0;
  sigwait(&signals, &sig);
  LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
            << "; draining";
  (*server)->Drain(absl::GetFlag(FLAGS_shutdown_grace));
  return 0;
}
