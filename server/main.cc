// localsgd-coordinator: the daemon that averages Local SGD workers' parameters.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "Address to serve gRPC on, host:port. Port 0 picks a free port "
          "(see --port_file).");
ABSL_FLAG(std::string, port_file, "",
          "If set, write the bound port to this file once serving (for "
          "scripts and tests that listen on port 0).");
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
          "On SIGTERM/SIGINT, how long in-flight calls get to finish.");

namespace {

absl::StatusOr<localsgd::ServerOptions> OptionsFromFlags() {
  localsgd::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
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
      "usage: localsgd-coordinator [--listen=HOST:PORT] [flags]");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
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
    std::fprintf(stderr, "localsgd-coordinator: %s\n",
                 options.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<localsgd::CoordinatorServer>> server =
      localsgd::CoordinatorServer::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "localsgd-coordinator: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    // Write then rename, so a reader never sees a partial file.
    const std::string tmp = port_file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << (*server)->port() << "\n";
      if (!out) {
        LOG(ERROR) << "cannot write --port_file " << tmp;
        return 1;
      }
    }
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      LOG(ERROR) << "cannot rename " << tmp << " to " << port_file;
      return 1;
    }
  }

  int sig = 0;
  sigwait(&signals, &sig);
  LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
            << "; draining";
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace));
  return 0;
}
