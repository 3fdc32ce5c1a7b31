// localsgdctl: an operator's command line for a running localsgd-coordinator.
//
//   localsgdctl [--target=HOST:PORT] status [--job=ID] [--rounds=N] [--json]
//   localsgdctl [--target=HOST:PORT] health [--service=NAME] [--json]
//   localsgdctl [--target=HOST:PORT] delete-job --job=ID
//   localsgdctl [--target=HOST:PORT] watch [--job=ID] [--interval=1s] [--once]
//
// `status` prints the coordinator's jobs (GetJobStatus): settings, members
// and the most recent rounds, as tables, or with --json as the
// GetJobStatusResponse in protobuf's JSON mapping (proto field names) for
// scripts. `health` asks grpc.health.v1.Health/Check and exits 0 if the
// answer is SERVING, 1 otherwise. `delete-job` removes a job that has no
// members, and its checkpoint (DeleteJob; with tokens, --token_file must
// hold that job's token). `watch` is a live view of the jobs, like top: one
// screen, redrawn every --interval on a terminal (frames one after another
// otherwise; Ctrl-C ends it, exit 0), that keeps going while the coordinator
// is unreachable; --once prints one frame and exits (1 if the call failed).
// Exit status: 0 success, 1 the call failed or the coordinator is not
// serving, 2 bad usage.
//
// Only a client of the wire contract: it links the generated protocol code,
// gRPC and the client's channel security (client/credentials.h: --tls_ca,
// --tls_cert, --tls_key, --tls_server_name, --token_file), nothing of the
// coordinator.
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/credentials.h"
#include "client/security_flags.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/convert.h"
#include "src/settings.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "gRPC target of the coordinator: host:port, or e.g. "
          "dns:///localsgd-coordinator:50051");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of the call");
ABSL_FLAG(bool, json, false,
          "Print JSON (protobuf's JSON mapping, proto field names) instead of "
          "tables");
ABSL_FLAG(std::string, job, "",
          "status: only this job (default: all); delete-job: the job to "
          "delete");
ABSL_FLAG(uint32_t, rounds, 10,
          "status: most recent closed rounds to show per job (at most 100)");
ABSL_FLAG(std::string, service, "",
          "health: the service to ask about. \"\" (the default) is the "
          "coordinator's readiness, \"liveness\" its liveness");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1),
          "watch: time between two refreshes");
ABSL_FLAG(bool, once, false, "watch: print one frame and exit");
// Transport security and tokens: client/security_flags.h (--tls_ca,
// --tls_cert, --tls_key, --tls_server_name, --token_file).

namespace localsgd {
namespace ctl {
namespace {

constexpr char kProgram[] = "localsgdctl";

// Plain-text table: left-aligned columns two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const {
    std::vector<size_t> width(rows_[0].size(), 0);
    for (const auto& row : rows_) {
      for (size_t i = 0; i < row.size(); ++i) {
        width[i] = std::max(width[i], row[i].size());
      }
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line;
      for (size_t i = 0; i < row.size(); ++i) {
        absl::StrAppend(&line, row[i]);
        if (i + 1 < row.size()) {
          line.append(width[i] - row[i].size() + 2, ' ');
        }
      }
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "DTYPE_BFLOAT16" -> "bfloat16", "CLOSE_REASON_MEMBERS_GONE" ->
// "members_gone".
std::string EnumName(const std::string& full, absl::string_view prefix) {
  if (full.empty()) return "?";
  return absl::AsciiStrToLower(absl::StripPrefix(full, prefix));
}

std::string Names(const google::protobuf::RepeatedPtrField<std::string>& v) {
  return v.empty() ? "-" : absl::StrJoin(v, ",");
}

std::string Millis(uint64_t ms) {
  return absl::FormatDuration(absl::Milliseconds(ms));
}

// Every job setting as name=value, from the settings table (src/settings.h),
// so that a setting shows here as soon as it has its row.
std::string SettingsLine(const v1::JobSettings& proto) {
  absl::StatusOr<localsgd::JobSettings> settings =
      localsgd::SettingsFromProto(proto);
  if (!settings.ok()) {
    return absl::StrCat("(unreadable: ", settings.status().message(), ")");
  }
  std::vector<std::string> parts;
  for (const localsgd::JobSettingSpec& spec : localsgd::JobSettingSpecs()) {
    parts.push_back(absl::StrCat(spec.name, "=", spec.format(*settings)));
  }
  return absl::StrJoin(parts, " ");
}

// "goodput 0.973: local steps merged 1200 (stale 80), thrown away 33 (late
// 16, refused 0, gone 0, timed out 17)", or that none were said.
std::string GoodputLine(const v1::JobStatus& job) {
  const v1::StepCounts& c = job.steps();
  const uint64_t away = c.late() + c.refused() + c.gone() + c.timed_out();
  if (c.merged() + away == 0) {
    return "goodput: no local steps counted (members that say them: "
           "SyncHeader.local_steps)";
  }
  return absl::StrCat("goodput ", absl::StrFormat("%.3f", job.goodput()),
                      ": local steps merged ", c.merged(), " (stale ",
                      c.merged_stale(), "), thrown away ", away, " (late ",
                      c.late(), ", refused ", c.refused(), ", gone ", c.gone(),
                      ", timed out ", c.timed_out(), ")");
}

void PrintJob(const v1::JobStatus& job, std::ostream& out) {
  const v1::JobSettings& s = job.settings();
  out << "job " << job.job_id() << "\n";
  Table summary({"STATE_ROUND", "OPEN_ROUND", "MEMBERS", "ELEMENTS", "CHUNKS",
                 "CHUNK_ELEMENTS", "WIRE", "K", "RENDEZVOUS", "CONTRIBUTION",
                 "AVERAGING"});
  summary.Add(
      {job.has_state() ? absl::StrCat(job.state_round()) : "none",
       job.round_open() ? absl::StrCat(job.state_round() + 1) : "-",
       absl::StrCat(job.members_size()), absl::StrCat(job.num_elements()),
       absl::StrCat(job.num_chunks()), absl::StrCat(s.chunk_elements()),
       EnumName(v1::DType_Name(s.wire_dtype()), "DTYPE_"),
       absl::StrCat(s.local_sgd_steps()), absl::StrCat(s.rendezvous_members()),
       EnumName(v1::Contribution_Name(s.contribution()), "CONTRIBUTION_"),
       s.mode() == v1::AVERAGING_MODE_MEAN
           ? std::string("mean")
           : absl::StrCat(
                 EnumName(v1::AveragingMode_Name(s.mode()), "AVERAGING_MODE_"),
                 " lr=", s.outer_lr(),
                 s.mode() == v1::AVERAGING_MODE_OUTER_NESTEROV
                     ? absl::StrCat(" mu=", s.outer_momentum())
                     : std::string())});
  out << summary.Render();
  out << "settings: " << SettingsLine(s) << "\n";
  if (job.round_open()) {
    out << "\nopen round " << job.state_round() + 1 << ": contributed "
        << job.open_round_contributed_size() << " of "
        << job.open_round_participants_size() << " participants ["
        << Names(job.open_round_participants()) << "]; contributed ["
        << Names(job.open_round_contributed()) << "]\n";
    if (!job.open_round_why().empty()) {
      out << "still open: " << job.open_round_why() << "\n";
    }
  }
  if (s.deadline_mode() == v1::DEADLINE_MODE_ADAPTIVE) {
    out << "\nadaptive deadline: ";
    if (job.learned_deadline_ms() == 0) {
      out << "not learned yet";
    } else {
      out << "usual " << Millis(job.learned_deadline_ms()) << ", patient "
          << Millis(job.learned_patient_deadline_ms());
    }
    out << "; persistent stragglers ["
        << (job.stragglers().empty() ? std::string("none")
                                     : Names(job.stragglers()))
        << "]\n";
  }
  if (job.has_upstream()) {
    const v1::UpstreamStatus& u = job.upstream();
    out << "\nregional: member " << u.member_name() << " of job "
        << job.job_id() << " at " << u.target() << "; upstream round "
        << u.upstream_round() << ", " << u.answered() << " answered, "
        << u.early_chunks() << " chunks early"
        << (u.last_error().empty()
                ? std::string()
                : absl::StrCat("; last error: ", u.last_error()))
        << "\n";
  }
  out << "\n" << GoodputLine(job) << "\n";
  out << "\nmembers\n";
  if (job.members().empty()) {
    out << "(none)\n";
  } else {
    const bool budgets = s.step_budget() == v1::STEP_BUDGET_ADAPTIVE;
    std::vector<std::string> header = {"NAME", "MEMBER_REF", "WEIGHT", "IDLE",
                                       "FIRST_ROUND"};
    if (budgets) {
      header.insert(header.end(), {"STEPS_PER_S", "UPLOAD", "BUDGET"});
    }
    Table members(header);
    for (const v1::MemberStatus& m : job.members()) {
      std::vector<std::string> row = {
          m.member_name(), m.member_ref(), absl::StrCat(m.weight()),
          Millis(m.idle_ms()), absl::StrCat(m.first_round())};
      if (budgets) {
        const bool known = m.steps_per_second() > 0;
        row.push_back(known ? absl::StrFormat("%.1f", m.steps_per_second())
                            : std::string("-"));
        row.push_back(known ? Millis(m.upload_ms()) : std::string("-"));
        row.push_back(m.local_steps_budget() > 0
                          ? absl::StrCat(m.local_steps_budget())
                          : absl::StrCat("K=", s.local_sgd_steps()));
      }
      members.Add(row);
    }
    out << members.Render();
  }
  out << "\nrecent rounds\n";
  if (job.recent_rounds().empty()) {
    out << "(none)\n";
  } else {
    Table rounds({"ROUND", "REASON", "DURATION", "CLOSED_UTC", "CONTRIBUTORS",
                  "DROPPED", "TIMED_OUT", "LATE", "REJECTED"});
    for (const v1::RoundStatus& r : job.recent_rounds()) {
      rounds.Add(
          {absl::StrCat(r.round()),
           EnumName(v1::CloseReason_Name(r.close_reason()), "CLOSE_REASON_"),
           Millis(r.duration_ms()),
           absl::FormatTime("%Y-%m-%d %H:%M:%E3S",
                            absl::FromUnixMillis(r.closed_unix_ms()),
                            absl::UTCTimeZone()),
           Names(r.contributors()), Names(r.dropped()), Names(r.timed_out()),
           Names(r.late()), Names(r.rejected())});
    }
    out << rounds.Render();
  }
}

std::shared_ptr<grpc::Channel> Channel() {
  absl::StatusOr<ChannelSecurity> security = ChannelSecurityFromFlags();
  if (!security.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 std::string(security.status().message()).c_str());
    std::exit(2);
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = CreateSecureChannel(
      absl::GetFlag(FLAGS_target), *security, grpc::ChannelArguments());
  if (!channel.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 std::string(channel.status().message()).c_str());
    std::exit(2);
  }
  return *std::move(channel);
}

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(
      absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
}

// The canonical name of a gRPC status code, e.g. "UNAVAILABLE".
std::string CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  if (i < 0 || i >= static_cast<int>(std::size(kNames))) {
    return absl::StrCat("CODE_", i);
  }
  return kNames[i];
}

int Fail(const grpc::Status& status, absl::string_view what) {
  std::fprintf(stderr, "%s: %s on %s failed: %s: %s\n", kProgram,
               std::string(what).c_str(), absl::GetFlag(FLAGS_target).c_str(),
               CodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return 1;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  // Only fails for messages with unresolvable Any fields; these have none.
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

int Status() {
  auto stub = v1::Coordinator::NewStub(Channel());
  v1::GetJobStatusRequest request;
  request.set_job_id(absl::GetFlag(FLAGS_job));
  request.set_max_rounds(absl::GetFlag(FLAGS_rounds));
  v1::GetJobStatusResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->GetJobStatus(&context, request, &response);
  if (!status.ok()) return Fail(status, "GetJobStatus");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << ToJson(response);
    return 0;
  }
  if (response.epoch() != 0) {
    std::cout << "primary of its shard at epoch " << response.epoch()
              << " (standby coordinators, --ha_etcd)\n";
    if (response.standbys().empty()) {
      std::cout << "no standby follows its state\n";
    }
    for (const v1::StandbyStatus& s : response.standbys()) {
      std::cout << "standby " << s.address() << ": "
                << (s.in_sync() ? "in sync" : "catching up") << ", lag "
                << s.lag() << " updates\n";
    }
  }
  if (response.jobs().empty()) {
    std::cout << "no jobs on " << absl::GetFlag(FLAGS_target) << "\n";
  }
  for (int i = 0; i < response.jobs_size(); ++i) {
    if (i > 0) std::cout << "\n";
    PrintJob(response.jobs(i), std::cout);
  }
  return 0;
}

int Health() {
  auto stub = grpc::health::v1::Health::NewStub(Channel());
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return Fail(status, "grpc.health.v1.Health/Check");
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
          response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << ToJson(response);
  } else {
    std::cout << name << "\n";
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING
             ? 0
             : 1;
}

// --- watch ---------------------------------------------------------------

volatile sig_atomic_t g_stop_watch = 0;

// Rows and columns of the terminal on stdout; 0, 0 if it is not one.
std::pair<int, int> TerminalSize() {
  winsize w{};
  if (!isatty(STDOUT_FILENO) || ioctl(STDOUT_FILENO, TIOCGWINSZ, &w) != 0) {
    return {0, 0};
  }
  return {w.ws_row, w.ws_col};
}

// One job in a few lines: the state, the open round and whom it waits for,
// rounds per minute and round times over the rounds shown, the members,
// then as many recent rounds as `round_rows` allows.
void WatchJob(const v1::JobStatus& job, absl::Time now, int round_rows,
              std::string* out) {
  const v1::JobSettings& s = job.settings();
  absl::StrAppend(
      out, "job ", job.job_id(), "  state round ",
      job.has_state() ? absl::StrCat(job.state_round()) : "none", "  ",
      EnumName(v1::Contribution_Name(s.contribution()), "CONTRIBUTION_"), " ",
      EnumName(v1::AveragingMode_Name(s.mode()), "AVERAGING_MODE_"), " ",
      EnumName(v1::DType_Name(s.wire_dtype()), "DTYPE_"),
      s.local_sgd_steps() > 0 ? absl::StrCat(" K=", s.local_sgd_steps())
                              : std::string(),
      "  ", job.num_elements(), " parameters\n");
  if (job.round_open()) {
    absl::StrAppend(out, "  round ", job.state_round() + 1,
                    " open: ", job.open_round_contributed_size(), "/",
                    job.open_round_participants_size(), " contributed");
    if (!job.open_round_waiting_for().empty()) {
      absl::StrAppend(out, ", waiting for ",
                      Names(job.open_round_waiting_for()));
    }
    if (job.open_round_deadline_unix_ms() > 0) {
      absl::StrAppend(
          out, ", deadline in ",
          absl::FormatDuration(absl::Trunc(
              std::max(absl::ZeroDuration(),
                       absl::FromUnixMillis(job.open_round_deadline_unix_ms()) -
                           now),
              absl::Milliseconds(100))));
    }
    absl::StrAppend(out, "\n");
  } else {
    absl::StrAppend(out, "  no round open\n");
  }
  if (s.deadline_mode() == v1::DEADLINE_MODE_ADAPTIVE) {
    absl::StrAppend(
        out, "  adaptive deadline: ",
        job.learned_deadline_ms() == 0
            ? std::string("not learned yet")
            : absl::StrCat(Millis(job.learned_deadline_ms()), " (patient ",
                           Millis(job.learned_patient_deadline_ms()), ")"),
        job.stragglers().empty()
            ? std::string()
            : absl::StrCat("; stragglers ", Names(job.stragglers())),
        "\n");
  }
  absl::StrAppend(out, "  ", GoodputLine(job), "\n");
  if (s.step_budget() == v1::STEP_BUDGET_ADAPTIVE) {
    std::vector<std::string> budgets;
    for (const v1::MemberStatus& m : job.members()) {
      budgets.push_back(absl::StrCat(
          m.member_name(), " ",
          m.local_steps_budget() > 0 ? absl::StrCat(m.local_steps_budget())
                                     : absl::StrCat("K=", s.local_sgd_steps()),
          m.steps_per_second() > 0
              ? absl::StrFormat(" (%.1f/s, up %s)", m.steps_per_second(),
                                Millis(m.upload_ms()))
              : std::string()));
    }
    absl::StrAppend(out, "  step budgets: ",
                    budgets.empty() ? std::string("no members")
                                    : absl::StrJoin(budgets, ", "),
                    "\n");
  }
  // Averaging rounds shown (not seeds): their rate, mean and worst time,
  // and who fell out of them.
  int n = 0, late = 0, dropped = 0, timed_out = 0;
  uint64_t total_ms = 0, max_ms = 0;
  int64_t first_ms = 0, last_ms = 0;
  for (const v1::RoundStatus& r : job.recent_rounds()) {
    if (r.close_reason() == v1::CLOSE_REASON_SEED) continue;
    ++n;
    total_ms += r.duration_ms();
    max_ms = std::max(max_ms, r.duration_ms());
    late += r.late_size();
    dropped += r.dropped_size();
    timed_out += r.timed_out_size();
    if (n == 1) last_ms = r.closed_unix_ms();
    first_ms = r.closed_unix_ms();
  }
  if (n > 0) {
    if (n == 1) {
      absl::StrAppend(out, "  last round: ", Millis(max_ms));
    } else {
      absl::StrAppend(out, "  last ", n, " rounds: mean ", Millis(total_ms / n),
                      ", max ", Millis(max_ms));
    }
    if (n > 1 && last_ms > first_ms) {
      absl::StrAppend(
          out, ", ",
          absl::StrFormat("%.1f", (n - 1) * 60000.0 / (last_ms - first_ms)),
          " rounds/min");
    }
    absl::StrAppend(out, "; late ", late, ", dropped ", dropped, ", timed out ",
                    timed_out, "\n");
  }
  Table members({"  MEMBER", "REF", "WEIGHT", "IDLE", "FIRST_ROUND"});
  for (const v1::MemberStatus& m : job.members()) {
    members.Add({absl::StrCat("  ", m.member_name()), m.member_ref(),
                 absl::StrCat(m.weight()), Millis(m.idle_ms() / 100 * 100),
                 absl::StrCat(m.first_round())});
  }
  if (job.members().empty()) {
    absl::StrAppend(out, "  (no members)\n");
  } else {
    absl::StrAppend(out, members.Render());
  }
  if (round_rows <= 0 || job.recent_rounds().empty()) return;
  Table rounds({"  ROUND", "REASON", "DURATION", "CONTRIBUTORS", "LATE",
                "DROPPED", "TIMED_OUT"});
  int shown = 0;
  for (const v1::RoundStatus& r : job.recent_rounds()) {
    if (shown++ == round_rows) break;
    rounds.Add(
        {absl::StrCat("  ", r.round()),
         EnumName(v1::CloseReason_Name(r.close_reason()), "CLOSE_REASON_"),
         Millis(r.duration_ms()),
         absl::StrCat(r.contributors_size(), "/", r.participants_size()),
         Names(r.late()), Names(r.dropped()), Names(r.timed_out())});
  }
  absl::StrAppend(out, rounds.Render());
}

// A frame of `watch`: at most `rows` lines (0: no limit), each cut to
// `cols` columns (0: no limit).
std::string WatchFrame(const grpc::Status& status,
                       const v1::GetJobStatusResponse& response, absl::Time now,
                       int rows, int cols) {
  std::string out = absl::StrCat(
      "localsgd ", absl::GetFlag(FLAGS_target), "  ",
      absl::FormatTime("%H:%M:%S UTC", now, absl::UTCTimeZone()), "  every ",
      absl::FormatDuration(absl::GetFlag(FLAGS_interval)));
  if (!status.ok()) {
    absl::StrAppend(&out,
                    "\n\nGetJobStatus failed: ", CodeName(status.error_code()),
                    ": ", status.error_message(), "\n(retrying)\n");
  } else {
    absl::StrAppend(&out, "  ", response.jobs_size(),
                    response.jobs_size() == 1 ? " job" : " jobs",
                    response.epoch() != 0
                        ? absl::StrCat("  primary, epoch ", response.epoch())
                        : std::string(),
                    "\n");
    if (response.jobs().empty()) absl::StrAppend(&out, "\n(no jobs)\n");
    // Rounds share what is left of the screen after the fixed lines.
    int fixed = 1;
    for (const v1::JobStatus& job : response.jobs()) {
      fixed += 5 + job.members_size();
    }
    const int jobs = std::max(1, response.jobs_size());
    const int round_rows =
        rows > 0 ? std::max(0, (rows - fixed) / jobs - 1) : 10;
    for (const v1::JobStatus& job : response.jobs()) {
      absl::StrAppend(&out, "\n");
      WatchJob(job, now, std::min(round_rows, 10), &out);
    }
  }
  std::vector<std::string> lines = absl::StrSplit(out, '\n');
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (rows > 0 && static_cast<int>(lines.size()) > rows) {
    const size_t cut = lines.size() - static_cast<size_t>(rows) + 1;
    lines.resize(static_cast<size_t>(rows) - 1);
    lines.push_back(absl::StrCat("... ", cut,
                                 " more lines (enlarge the "
                                 "terminal, or --job=ID)"));
  }
  if (cols > 0) {
    for (std::string& line : lines) {
      if (static_cast<int>(line.size()) > cols) line.resize(cols);
    }
  }
  return absl::StrCat(absl::StrJoin(lines, "\n"), "\n");
}

int Watch() {
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  if (interval < absl::Milliseconds(100)) {
    std::fprintf(stderr, "%s: --interval must be at least 100ms\n", kProgram);
    return 2;
  }
  const bool once = absl::GetFlag(FLAGS_once);
  struct sigaction action {};
  action.sa_handler = [](int) { g_stop_watch = 1; };
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  auto stub = v1::Coordinator::NewStub(Channel());
  const bool tty = !once && isatty(STDOUT_FILENO);
  if (tty) std::fputs("\x1b[?25l", stdout);  // hide the cursor
  int rc = 0;
  while (g_stop_watch == 0) {
    v1::GetJobStatusRequest request;
    request.set_job_id(absl::GetFlag(FLAGS_job));
    request.set_max_rounds(10);
    v1::GetJobStatusResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(
        absl::Now() + std::min(absl::GetFlag(FLAGS_timeout), interval * 5)));
    const grpc::Status status =
        stub->GetJobStatus(&context, request, &response);
    const auto [rows, cols] = TerminalSize();
    const std::string frame = WatchFrame(status, response, absl::Now(),
                                         tty ? rows : 0, tty ? cols : 0);
    if (tty) {
      // Home, the frame with each line's rest cleared, then the rest of
      // the screen; no newline after the last line, so that a frame of
      // the screen's height does not scroll its first line away.
      std::string painted = absl::StrCat(
          "\x1b[H",
          absl::StrJoin(absl::StrSplit(absl::StripSuffix(frame, "\n"), '\n'),
                        "\x1b[K\n"),
          "\x1b[K\x1b[J");
      std::fputs(painted.c_str(), stdout);
    } else {
      std::fputs(frame.c_str(), stdout);
    }
    std::fflush(stdout);
    if (once) {
      if (!status.ok()) rc = 1;
      break;
    }
    if (!tty) std::fputs("\n", stdout);
    // Sleeps in short steps so that Ctrl-C ends it at once.
    const absl::Time next = absl::Now() + interval;
    while (g_stop_watch == 0 && absl::Now() < next) {
      absl::SleepFor(std::min(absl::Milliseconds(50), next - absl::Now()));
    }
  }
  if (tty) std::fputs("\x1b[?25h\n", stdout);  // the cursor back
  std::fflush(stdout);
  return rc;
}

int DeleteJob() {
  const std::string job = absl::GetFlag(FLAGS_job);
  if (job.empty()) {
    std::fprintf(stderr, "%s: delete-job needs --job=ID\n", kProgram);
    return 2;
  }
  auto stub = v1::Coordinator::NewStub(Channel());
  v1::DeleteJobRequest request;
  request.set_job_id(job);
  v1::DeleteJobResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->DeleteJob(&context, request, &response);
  if (!status.ok()) return Fail(status, "DeleteJob");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << ToJson(response);
  } else {
    std::cout << "deleted job " << job << " (state at round "
              << response.state_round() << ") and its checkpoint\n";
  }
  return 0;
}

}  // namespace
}  // namespace ctl
}  // namespace localsgd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "operator's command line for a localsgd-coordinator.\n"
      "usage:\n"
      "  localsgdctl [--target=HOST:PORT] status [--job=ID] [--rounds=N] "
      "[--json]\n"
      "      jobs, members and recent rounds (tables; --json for scripts)\n"
      "  localsgdctl [--target=HOST:PORT] health [--service=NAME] [--json]\n"
      "      grpc.health.v1 status; exit 0 if SERVING, 1 otherwise\n"
      "  localsgdctl [--target=HOST:PORT] delete-job --job=ID\n"
      "      removes a job without members, and its checkpoint\n"
      "  localsgdctl [--target=HOST:PORT] watch [--job=ID] [--interval=1s] "
      "[--once]\n"
      "      a live view of jobs, members and rounds (like top); Ctrl-C "
      "ends it");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "tools/localsgdctl.cc") ||
           absl::EndsWith(file, "client/security_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr,
                 "%s: expected one command, status, health, delete-job or "
                 "watch (see --help)\n",
                 localsgd::ctl::kProgram);
    return 2;
  }
  const std::string command = args[1];
  if (command == "status") return localsgd::ctl::Status();
  if (command == "health") return localsgd::ctl::Health();
  if (command == "delete-job") return localsgd::ctl::DeleteJob();
  if (command == "watch") return localsgd::ctl::Watch();
  std::fprintf(stderr,
               "%s: unknown command '%s'; expected status, health, "
               "delete-job or watch\n",
               localsgd::ctl::kProgram, command.c_str());
  return 2;
}
