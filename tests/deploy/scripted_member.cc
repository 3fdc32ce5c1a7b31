// A coordinator member driven line by line from stdin, for process-level
// tests (tests/deploy/health_drain_test.py, bench/process_soak.py): it uses
// the real client library (client/client.h) on a one-tensor model (with
// the client's security flags: --token_file, --tls_ca, ...) and
// answers every command with one line on stdout, so that a test can
// interleave several members and signals exactly, without sleeping.
//
// Commands (V, B: numbers; element j of the parameters becomes
// V + B * (j / chunk_elements), constant within each chunk of the job):
//   join            -> ok join member=<id> has_state=<0|1> state_round=<r>
//   init V [B]      -> ok init round=<r> chunks=<c0,c1,...>
//                      (seed or fetch; c_i: chunk i's first value after)
//   sync V [B]      -> ok sync round=<r> contributed=<0|1> late=<0|1>
//                         contributors=<n> value=<params[0] after>
//                         rejoined=<0|1> chunks=<c0,c1,...>
//   leave           -> ok leave
//   quit            -> (exits 0)
// A failed command prints: error <command> <CODE> <message>. A chunk whose
// elements are not all equal after a command is reported as "nan" in
// chunks= (the coordinator mixed values within a chunk).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/security_flags.h"
#include "src/layout.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Coordinator address");
ABSL_FLAG(std::string, job, "scripted", "Job id");
ABSL_FLAG(std::string, name, "member", "Member name");
ABSL_FLAG(int64_t, elements, 1000, "Parameters of the one-tensor model");
ABSL_FLAG(uint32_t, chunk_elements, 0, "Chunk size to ask for (0: default)");
ABSL_FLAG(absl::Duration, max_retry_time, absl::Seconds(10),
          "How long the client retries UNAVAILABLE/ABORTED per call; 0: once");
ABSL_FLAG(double, weight, 1.0, "The member's weight");
ABSL_FLAG(uint32_t, local_sgd_steps, 0,
          "The job's local_sgd_steps to ask for (0: any)");

namespace {

void Reply(const std::string& line) {
  std::cout << line << std::endl;  // flushed: the test waits for it
}

void ReplyError(const std::string& command, const absl::Status& status) {
  Reply(absl::StrCat("error ", command, " ",
                     absl::StatusCodeToString(status.code()), " ",
                     status.message()));
}

// params[j] := v + b * (j / chunk).
void Fill(std::vector<float>& params, uint32_t chunk, float v, float b) {
  for (size_t j = 0; j < params.size(); ++j) {
    params[j] = v + b * static_cast<float>(j / chunk);
  }
}

// Each chunk's value, comma-separated, "nan" where a chunk's elements
// differ. %.9g: every float exactly.
std::string Chunks(const std::vector<float>& params, uint32_t chunk) {
  std::string out;
  for (size_t start = 0; start < params.size(); start += chunk) {
    const size_t end = std::min(params.size(), start + chunk);
    bool same = true;
    for (size_t j = start; j < end; ++j)
      same = same && params[j] == params[start];
    if (!out.empty()) out += ',';
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.9g", params[start]);
    out += same ? std::string(buf) : std::string("nan");
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  localsgd::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.member_name = absl::GetFlag(FLAGS_name);
  options.settings.chunk_elements = absl::GetFlag(FLAGS_chunk_elements);
  options.settings.local_sgd_steps = absl::GetFlag(FLAGS_local_sgd_steps);
  options.max_retry_time = absl::GetFlag(FLAGS_max_retry_time);
  options.weight = absl::GetFlag(FLAGS_weight);
  options.initial_backoff = absl::Milliseconds(50);
  absl::StatusOr<localsgd::ChannelSecurity> security =
      localsgd::ChannelSecurityFromFlags();
  if (!security.ok()) {
    ReplyError("create", security.status());
    return 1;
  }
  options.security = *std::move(security);
  absl::StatusOr<std::unique_ptr<localsgd::Client>> client =
      localsgd::Client::Create(options);
  if (!client.ok()) {
    ReplyError("create", client.status());
    return 1;
  }
  const int64_t n = absl::GetFlag(FLAGS_elements);
  const localsgd::Layout layout =
      localsgd::MakeLayout({{"w", {n}, localsgd::DType::kFloat32}});
  std::vector<float> params(n, 0.0f);

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    float value = 0;
    float slope = 0;
    // The job's chunk size once joined (Fill and Chunks cut by it).
    const uint32_t chunk =
        std::max<uint32_t>(1, (*client)->info().settings.chunk_elements);
    if (command == "join") {
      absl::Status s = (*client)->Join(layout);
      if (!s.ok()) {
        ReplyError(command, s);
        continue;
      }
      const localsgd::JoinInfo& info = (*client)->info();
      Reply(absl::StrCat("ok join member=", info.member_id.str(),
                         " has_state=", info.has_state ? 1 : 0,
                         " state_round=", info.state_round));
    } else if (command == "init") {
      in >> value;
      if (!(in >> slope)) slope = 0;
      Fill(params, chunk, value, slope);
      absl::Status s = (*client)->Initialize(absl::MakeSpan(params));
      if (!s.ok()) {
        ReplyError(command, s);
        continue;
      }
      Reply(absl::StrCat("ok init round=", (*client)->state_round(),
                         " chunks=", Chunks(params, chunk)));
    } else if (command == "sync") {
      in >> value;
      if (!(in >> slope)) slope = 0;
      Fill(params, chunk, value, slope);
      absl::StatusOr<localsgd::SyncOutcome> out =
          (*client)->Sync(absl::MakeSpan(params));
      if (!out.ok()) {
        ReplyError(command, out.status());
        continue;
      }
      Reply(absl::StrCat(
          "ok sync round=", out->round,
          " contributed=", out->contributed ? 1 : 0,
          " late=", out->late ? 1 : 0, " contributors=", out->contributors,
          " value=", params[0], " rejoined=", out->rejoined ? 1 : 0,
          " chunks=", Chunks(params, chunk)));
    } else if (command == "leave") {
      absl::Status s = (*client)->Leave();
      if (!s.ok()) {
        ReplyError(command, s);
        continue;
      }
      Reply("ok leave");
    } else if (command == "quit") {
      return 0;
    } else if (!command.empty()) {
      Reply(
          absl::StrCat("error ", command, " INVALID_ARGUMENT unknown command"));
    }
  }
  return 0;
}
