// localsgd-coordinator: the daemon that averages Local SGD workers' parameters.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "ha/election.h"
#include "server/server.h"
#include "server/serving_gate.h"
#include "server/upstream_link.h"
#include "src/malloc_tuning.h"
#include "src/settings.h"

extern char** environ;

// Every flag below can also come from the environment: --foo_bar from
// LOCALSGD_FOO_BAR (see ApplyEnvironment). Keep flags here, in this file.

// The settings table's row whose coordinator flag is `flag`.
const localsgd::JobSettingSpec& SettingFlagRow(absl::string_view flag) {
  for (const localsgd::JobSettingSpec& spec : localsgd::JobSettingSpecs()) {
    if (spec.flag != nullptr && flag == spec.flag) return spec;
  }
  std::fprintf(stderr, "localsgd-coordinator: no job setting has flag --%.*s\n",
               static_cast<int>(flag.size()), flag.data());
  std::abort();
}

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
ABSL_FLAG(std::string, http_listen, "",
          "Address to serve the status page on, host:port, e.g. "
          "127.0.0.1:8080: GET / (a live view of jobs, members and rounds), "
          "/api/v1/status (the same as JSON) and /metrics. Plaintext HTTP; "
          "with --token_file a job shows only to its token. Port 0 picks a "
          "free port (see --http_port_file). Empty: no status page.");
ABSL_FLAG(std::string, http_port_file, "",
          "If set, write the bound status page port to this file once "
          "serving.");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(30),
          "A member that makes no call (heartbeats included) for this long is "
          "dropped; an open round stops waiting for it.");
ABSL_FLAG(absl::Duration, round_deadline, absl::ZeroDuration(),
          "Once a round has been open this long, it closes as soon as "
          "--min_quorum members have contributed. 0: no deadline (rounds "
          "wait for every participant, or its lease).");
ABSL_FLAG(uint32_t, min_quorum, 1,
          "Complete contributions a round needs to close at its deadline.");
// The defaults of new jobs' settings: one flag per row of the settings
// table that has one (src/settings.h: the row gives its name, default,
// help, and parses its value). A string flag each, read through the row.
#define LOCALSGD_SETTING_FLAG(flag)                                \
  ABSL_FLAG(std::string, flag, SettingFlagRow(#flag).flag_default, \
            SettingFlagRow(#flag).help)
LOCALSGD_SETTING_FLAG(chunk_elements);
LOCALSGD_SETTING_FLAG(wire_dtype);
LOCALSGD_SETTING_FLAG(averaging);
LOCALSGD_SETTING_FLAG(nonfinite_policy);
LOCALSGD_SETTING_FLAG(contribution);
LOCALSGD_SETTING_FLAG(outer_lr);
LOCALSGD_SETTING_FLAG(outer_momentum);
LOCALSGD_SETTING_FLAG(deadline_mode);
LOCALSGD_SETTING_FLAG(outlier_ratio);
LOCALSGD_SETTING_FLAG(mean_encoding);
LOCALSGD_SETTING_FLAG(max_staleness);
LOCALSGD_SETTING_FLAG(step_budget);
LOCALSGD_SETTING_FLAG(sparse_keep);
LOCALSGD_SETTING_FLAG(sparse_result_keep);
#undef LOCALSGD_SETTING_FLAG

ABSL_FLAG(bool, keep_freed_memory, true,
          "Keep memory that gRPC's message buffers free in the heap for "
          "reuse instead of returning it to the kernel (glibc mallopt; "
          "src/malloc_tuning.h): no page fault per 4 KiB moved. Peak memory "
          "is the same; memory freed after a peak is kept.");
ABSL_FLAG(int32_t, stream_window_bytes, 8 << 20,
          "HTTP/2 flow-control window per stream: what each worker's stream "
          "may hold in the coordinator, so that its memory stays flat in the "
          "number of workers. Fills a link of rate R when >= R x the round "
          "trip (8 MiB: 1 Gbit/s up to 60 ms). 0: gRPC's window, grown by "
          "bandwidth probing without bound: 7% faster rounds where one "
          "coordinator's 1 Gbit/s link is the bottleneck of an fp32 job, "
          "but 25-40 MiB more per worker at 25M where the coordinator falls "
          "behind its links (docs/design.md \"Memory\").");
ABSL_FLAG(uint32_t, shard_count, 1,
          "Sharded coordinators: the number of replicas that share every job "
          "(chunk i of a layout goes to replica i mod shard_count). Clients "
          "list every replica. 1: this coordinator owns every chunk.");
ABSL_FLAG(std::string, shard_index, "0",
          "This replica's shard, in [0, shard_count); or 'ordinal' to take "
          "the number after the last '-' of the host name (a StatefulSet "
          "pod's ordinal).");
ABSL_FLAG(uint32_t, max_jobs, 64, "Most jobs this coordinator holds.");
ABSL_FLAG(uint32_t, max_members_per_job, 1024, "Most members in one job.");
ABSL_FLAG(absl::Duration, job_idle_ttl, absl::Hours(24),
          "A job with no member for this long is removed, and its checkpoint "
          "in --state_dir with it unless --keep_checkpoints; a restored job "
          "whose members never come back too. 0: jobs stay until a restart.");
ABSL_FLAG(bool, keep_checkpoints, false,
          "Keep the checkpoint of a job removed for --job_idle_ttl (a later "
          "restart restores it).");
ABSL_FLAG(uint32_t, max_tensors, 65536,
          "Most tensors a job's layout may have; a Join with more gets "
          "RESOURCE_EXHAUSTED. With names of at most 1 KiB, a layout costs "
          "at most about max_tensors x 1.2 KiB of coordinator memory.");
ABSL_FLAG(uint64_t, max_model_elements, uint64_t{2} << 30,
          "Largest model of a job, in elements (fp32 parameters).");
ABSL_FLAG(int32_t, max_message_bytes, 17 << 20,
          "Largest gRPC message accepted or sent; bounds the chunk size.");
ABSL_FLAG(uint32_t, max_streams_per_member, 4,
          "Most Sync and FetchState streams one member may have open at "
          "once; more get RESOURCE_EXHAUSTED. 0: no limit.");
ABSL_FLAG(double, max_join_rate, 10,
          "Join calls per second allowed per (job, member name), as a token "
          "bucket holding --join_burst; more get RESOURCE_EXHAUSTED. 0: no "
          "limit.");
ABSL_FLAG(uint32_t, join_burst, 20,
          "Join calls one (job, member name) may make at once before "
          "--max_join_rate applies.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of the coordinator. With --tls_key: gRPC "
          "over TLS. Empty: plaintext (logged as a WARNING at start). The "
          "metrics endpoint stays plaintext. See docs/security.md.");
ABSL_FLAG(std::string, tls_key, "",
          "PEM private key of --tls_cert (unencrypted).");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle for mutual TLS: only clients with a certificate "
          "signed by it get in, and members are bound to their "
          "certificate's subject. Needs --tls_cert. Empty: no client "
          "certificates asked for.");
ABSL_FLAG(std::string, token_file, "",
          "Per-job bearer tokens, one '<job_id> <token>' or '<job_id> "
          "sha256:<64 hex>' per line (# comments). Once set, every call needs "
          "'authorization: Bearer <token>' with its job's token, and jobs not "
          "in the file are refused. Reloaded on SIGHUP (a bad file keeps the "
          "old tokens). Empty: no tokens.");
ABSL_FLAG(uint32_t, recent_rounds, 100,
          "Closed rounds kept per job for status and late members.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for job checkpoints (created if missing). Every new "
          "global state is written there atomically in the background, and "
          "jobs are restored from it on start, before serving. Empty: no "
          "checkpoints; a restarted coordinator then re-seeds jobs from the "
          "workers' next Sync.");
ABSL_FLAG(std::string, ha_etcd, "",
          "High availability: etcd client endpoints (host:port,...). Set, "
          "this coordinator is one of its shard's primary and standbys "
          "(--ha_group, --shard_index): it serves only while it holds the "
          "shard's key in etcd under a lease of --ha_lease_ttl (the key's "
          "revision is the epoch stamped on what it answers), answers "
          "UNAVAILABLE naming the primary while it is a standby, restores "
          "--state_dir when it wins, and exits with status 3 when it loses "
          "the lease (its supervisor restarts it as a standby). Empty: no "
          "election; this coordinator serves from its start.");
ABSL_FLAG(std::string, ha_group, "localsgd",
          "High availability: the coordinators that elect together, one "
          "election per shard index (a name of at most 63 of "
          "[A-Za-z0-9._-]).");
ABSL_FLAG(std::string, ha_advertise, "",
          "High availability: the host:port members reach this coordinator "
          "at, shown to members and standbys as the primary's address. "
          "Empty: this host's name and the bound port.");
ABSL_FLAG(std::string, ha_token, "",
          "High availability: the secret a standby presents to follow its "
          "primary's state (the replication stream; the same on every "
          "coordinator of the group). Set it from the environment "
          "(LOCALSGD_HA_TOKEN) or a secret, not the command line. Empty: "
          "anyone who reaches a primary's port can follow its state (logged "
          "at start).");
ABSL_FLAG(std::string, ha_tls_ca, "",
          "High availability with TLS (--tls_cert): the PEM CA bundle that "
          "signed the other coordinators' certificates. A standby checks "
          "its primary's certificate against it on the replication stream "
          "and presents --tls_cert as its own (their certificates need the "
          "clientAuth usage where the primary asks for client "
          "certificates). Empty: --tls_client_ca; one of the two is needed "
          "with TLS.");
ABSL_FLAG(absl::Duration, ha_lease_ttl, absl::Seconds(2),
          "High availability: the etcd lease of the primary's key (whole "
          "seconds, at least etcd's minimum, 2 s with its defaults). A "
          "primary that cannot renew it stops serving before it expires; a "
          "standby takes over once it has. Shorter: faster failover, more "
          "false failovers when etcd or the network is slow.");
ABSL_FLAG(std::string, upstream, "",
          "A regional coordinator: the upstream coordinator's address "
          "(host:port; a sharded upstream's replicas separated by ',', a "
          "shard's standbys by '|'). Set, every job here is one member of "
          "the job of the same name there: a round here averages its "
          "members' deltas (MEAN over float32; other settings are refused), "
          "contributes that mean upstream with its contributors' weight, and "
          "commits the upstream round's result as its own. Not with "
          "--shard_count > 1 or --ha_etcd. Empty: not regional.");
ABSL_FLAG(std::string, upstream_member, "",
          "A regional coordinator: its member name in the upstream jobs "
          "(the same after a restart: it then takes its own place). Empty: "
          "'<hostname>/regional-<port>' (the --listen port; the pid with "
          "port 0).");
ABSL_FLAG(uint32_t, upstream_rendezvous, 0,
          "A regional coordinator: the regions an upstream job it creates "
          "waits for before its first round (its rendezvous_members; every "
          "region should say the same). 0: none, the first round takes the "
          "regions that joined by then.");
ABSL_FLAG(std::string, upstream_token_file, "",
          "A regional coordinator: a file holding the upstream jobs' bearer "
          "token (one token; the upstream's --token_file names it for each "
          "job). Empty: no token.");
ABSL_FLAG(std::string, upstream_tls_ca, "",
          "A regional coordinator: TLS to the upstream, the PEM CA bundle "
          "that signed its certificate. Empty: plaintext.");
ABSL_FLAG(std::string, upstream_tls_cert, "",
          "A regional coordinator: with --upstream_tls_ca, the PEM "
          "certificate it presents to an upstream that asks for client "
          "certificates (with --upstream_tls_key).");
ABSL_FLAG(std::string, upstream_tls_key, "",
          "A regional coordinator: the PEM key of --upstream_tls_cert.");
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
  // Not a flag: the fault tests' failpoints file (src/failpoint.h).
  absl::flat_hash_set<std::string> known = {"LOCALSGD_FAILPOINTS"};
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

// The defaults of new jobs' settings from their flags (the rows of the
// settings table that have one). INVALID_ARGUMENT naming the flag.
absl::Status SettingDefaultsFromFlags(localsgd::JobSettings* settings) {
  for (const localsgd::JobSettingSpec& spec : localsgd::JobSettingSpecs()) {
    if (spec.flag == nullptr) continue;
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(spec.flag);
    if (flag == nullptr) {
      return absl::InternalError(
          absl::StrCat("job setting ", spec.name, " names flag --", spec.flag,
                       " but no LOCALSGD_SETTING_FLAG declares it"));
    }
    if (absl::Status s = spec.parse(flag->CurrentValue(), *settings); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", spec.flag, " ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<localsgd::ServerOptions> OptionsFromFlags() {
  localsgd::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen_address = absl::GetFlag(FLAGS_metrics_listen);
  options.http_listen_address = absl::GetFlag(FLAGS_http_listen);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.token_file = absl::GetFlag(FLAGS_token_file);
  options.max_streams_per_member = absl::GetFlag(FLAGS_max_streams_per_member);
  localsgd::CoordinatorOptions& c = options.coordinator;
  c.policy.lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  c.policy.round_deadline = absl::GetFlag(FLAGS_round_deadline);
  c.policy.min_quorum = absl::GetFlag(FLAGS_min_quorum);
  c.policy.max_members = absl::GetFlag(FLAGS_max_members_per_job);
  c.policy.max_recent_rounds = absl::GetFlag(FLAGS_recent_rounds);
  if (absl::Status st = SettingDefaultsFromFlags(&c.default_settings);
      !st.ok()) {
    return st;
  }
  c.shard.count = absl::GetFlag(FLAGS_shard_count);
  {
    std::string index = absl::GetFlag(FLAGS_shard_index);
    std::string from = "--shard_index";
    if (index == "ordinal") {
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      const std::string name(host);
      index = name.substr(name.rfind('-') + 1);
      from = absl::StrCat("the ordinal of host name '", name, "'");
    }
    if (!absl::SimpleAtoi(index, &c.shard.index)) {
      return absl::InvalidArgumentError(
          absl::StrCat(from, " is not a shard index (a number or 'ordinal'): '",
                       index, "'"));
    }
  }
  c.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  c.max_model_elements = absl::GetFlag(FLAGS_max_model_elements);
  c.max_tensors = absl::GetFlag(FLAGS_max_tensors);
  c.job_idle_ttl = absl::GetFlag(FLAGS_job_idle_ttl);
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.max_join_rate = absl::GetFlag(FLAGS_max_join_rate);
  c.join_burst = absl::GetFlag(FLAGS_join_burst);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.stream_window_bytes = absl::GetFlag(FLAGS_stream_window_bytes);
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  options.replication.group = absl::GetFlag(FLAGS_ha_group);
  options.replication.shard_index = options.coordinator.shard.index;
  options.replication.token = absl::GetFlag(FLAGS_ha_token);
  options.replication.advertise = absl::GetFlag(FLAGS_ha_advertise);
  // Checked by Start, with the gate.
  options.ha_tls_ca_file = absl::GetFlag(FLAGS_ha_tls_ca);
  return options;
}

// --upstream: the links of a regional coordinator's jobs (null without).
absl::StatusOr<std::unique_ptr<localsgd::UpstreamLinkFactory>>
UpstreamFromFlags(bool ha, uint32_t shard_count) {
  const std::string target = absl::GetFlag(FLAGS_upstream);
  if (target.empty()) return nullptr;
  if (ha || shard_count > 1) {
    return absl::InvalidArgumentError(
        "--upstream (a regional coordinator) runs without --ha_etcd and "
        "without --shard_count > 1");
  }
  localsgd::ClientOptions client;
  if (absl::StrContains(target, ',')) {
    client.replicas = absl::StrSplit(target, ',');
  } else {
    client.target = target;
  }
  client.member_name = absl::GetFlag(FLAGS_upstream_member);
  if (client.member_name.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    // Two regional coordinators of one host (or of one name: network
    // namespaces) must not take each other's place upstream: the port
    // they listen on, or their pid where it is chosen at start.
    const std::string listen = absl::GetFlag(FLAGS_listen);
    const std::string port = listen.substr(listen.rfind(':') + 1);
    client.member_name = port.empty() || port == "0"
                             ? absl::StrCat(host, "/regional-", getpid())
                             : absl::StrCat(host, "/regional-", port);
  }
  client.settings.rendezvous_members = absl::GetFlag(FLAGS_upstream_rendezvous);
  client.security.token_file = absl::GetFlag(FLAGS_upstream_token_file);
  client.security.tls_ca_file = absl::GetFlag(FLAGS_upstream_tls_ca);
  client.security.tls_cert_file = absl::GetFlag(FLAGS_upstream_tls_cert);
  client.security.tls_key_file = absl::GetFlag(FLAGS_upstream_tls_key);
  // The job here is the client's job id, set per link; a placeholder to
  // validate the rest.
  client.job_id = "upstream";
  if (absl::Status s = client.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--upstream*: ", s.message()));
  }
  return std::make_unique<localsgd::UpstreamLinkFactory>(std::move(client));
}

// The exit status of a primary that lost its lease.
constexpr int kExitDeposed = 3;

// --ha_etcd: this coordinator's place in its shard's election, and the
// server's serving gate. The elector campaigns; when it wins, the role
// thread promotes the server (restores the checkpoints, stamps the epoch)
// and opens the gate; when a primary loses its role, the process ends
// (kExitDeposed) without another write: it holds a state a newer primary
// may have moved past, and its supervisor restarts it as a standby.
class HaRole final : public localsgd::ServingGate {
 public:
  explicit HaRole(uint32_t shard) : shard_(shard) {}
  ~HaRole() override {
    // Its thread calls the elector (started once the elector exists; the
    // server outlives this object from then on).
    if (elector_ != nullptr) server_->StopSyncPublisher();
    Resign();
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Start(localsgd::ElectorOptions options,
                     localsgd::CoordinatorServer* server) {
    server_ = server;
    advertise_ = options.advertise;
    server_->SetAdvertise(options.advertise);
    // A standby out of sync yields the first turn to one in sync.
    options.campaign_delay = [this, ttl = options.lease_ttl] {
      return server_->InSync() ? absl::ZeroDuration() : ttl;
    };
    options.on_change = [this](const localsgd::ElectorRole& role) {
      absl::MutexLock lock(&mu_);
      changes_.push_back(role);
    };
    absl::StatusOr<std::unique_ptr<localsgd::Elector>> elector =
        localsgd::Elector::Create(std::move(options));
    if (!elector.ok()) return elector.status();
    elector_ = *std::move(elector);
    live_.store(elector_.get(), std::memory_order_release);
    // The standbys in sync, in etcd: only those may take over.
    server_->StartSyncPublisher([elector = elector_.get()](
                                    uint64_t epoch,
                                    const std::vector<std::string>& standbys) {
      return elector->PublishSyncStandbys(static_cast<int64_t>(epoch), standbys,
                                          absl::Now() + absl::Seconds(2));
    });
    thread_ = std::thread([this] { RoleLoop(); });
    elector_->Start();
    return absl::OkStatus();
  }

  // A clean stop (SIGTERM, after the drain): the key goes, so that a
  // standby wins at once.
  void BeginResign() { resigning_.store(true, std::memory_order_release); }
  void Resign() {
    BeginResign();
    if (elector_ != nullptr) elector_->Stop();
  }

  absl::Status Check() const override {
    // Calls may come before Start (the port is bound first).
    const localsgd::Elector* elector = live_.load(std::memory_order_acquire);
    if (elector == nullptr) {
      return absl::UnavailableError(
          "this coordinator has not joined its shard's election yet");
    }
    if (promoted_.load(std::memory_order_acquire) &&
        elector->Serving(absl::Now())) {
      return absl::OkStatus();
    }
    const localsgd::ElectorRole role = elector->role();
    std::string what;
    if (role.kind == localsgd::ElectorRole::kPrimary) {
      what = promoted_.load() ? "lost its lease in etcd (it stops)"
                              : "won the election and is restoring its state";
    } else {
      what = "is a standby";
    }
    const bool other = !role.primary.empty() && role.primary != advertise_;
    return absl::UnavailableError(absl::StrCat(
        "coordinator ", advertise_, " of shard ", shard_, " ", what, "; ",
        other ? absl::StrCat("the primary is ", role.primary, " (epoch ",
                             role.epoch, ")")
              : std::string("no other primary is known yet"),
        ": retry there, or later"));
  }

 private:
  void RoleLoop() {
    bool was_primary = false;
    absl::MutexLock lock(&mu_);
    while (true) {
      mu_.Await(absl::Condition(
          +[](HaRole* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return r->stop_ || !r->changes_.empty();
          },
          this));
      if (stop_) return;
      const localsgd::ElectorRole role = changes_.front();
      changes_.pop_front();
      mu_.Unlock();
      LOG(INFO) << "shard " << shard_ << ": "
                << localsgd::ElectorRoleKindName(role.kind) << " at epoch "
                << role.epoch
                << (role.primary.empty()
                        ? ""
                        : absl::StrCat(", primary ", role.primary));
      server_->metrics()->SetHaRole(localsgd::ElectorRoleKindName(role.kind),
                                    static_cast<uint64_t>(role.epoch));
      if (role.kind != localsgd::ElectorRole::kPrimary && !was_primary &&
          !role.primary.empty() && role.primary != advertise_) {
        // A standby follows the primary's state.
        server_->Follow(role.primary, static_cast<uint64_t>(role.epoch));
      }
      if (role.kind == localsgd::ElectorRole::kPrimary && !was_primary) {
        was_primary = true;
        // Not while resigning: the server is draining or gone.
        if (!resigning_.load(std::memory_order_acquire)) {
          if (absl::Status s = server_->Promote(role.epoch); !s.ok()) {
            LOG(ERROR) << "cannot serve as the primary: " << s;
            std::_Exit(1);
          }
          promoted_.store(true, std::memory_order_release);
        }
      } else if (role.kind != localsgd::ElectorRole::kPrimary && was_primary &&
                 !resigning_.load(std::memory_order_acquire)) {
        LOG(ERROR) << "shard " << shard_
                   << ": no longer the primary (the lease in etcd could not "
                      "be renewed in time); exiting without another write so "
                      "that a supervisor restarts this coordinator as a "
                      "standby";
        std::_Exit(kExitDeposed);
      }
      mu_.Lock();
    }
  }

  const uint32_t shard_;
  // Set in Start, before live_.
  std::string advertise_;
  localsgd::CoordinatorServer* server_ = nullptr;
  std::unique_ptr<localsgd::Elector> elector_;
  std::atomic<const localsgd::Elector*> live_{nullptr};
  std::atomic<bool> promoted_{false};
  std::atomic<bool> resigning_{false};
  std::thread thread_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<localsgd::ElectorRole> changes_ ABSL_GUARDED_BY(mu_);
};

// The elector's options from the flags, once the server has its port.
absl::StatusOr<localsgd::ElectorOptions> ElectorOptionsFromFlags(
    const localsgd::ServerOptions& server, int port) {
  localsgd::ElectorOptions o;
  o.group = absl::GetFlag(FLAGS_ha_group);
  o.shard = server.coordinator.shard.index;
  o.advertise = absl::GetFlag(FLAGS_ha_advertise);
  if (o.advertise.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    o.advertise = absl::StrCat(host, ":", port);
  }
  o.lease_ttl = absl::GetFlag(FLAGS_ha_lease_ttl);
  o.etcd.endpoints =
      absl::StrSplit(absl::GetFlag(FLAGS_ha_etcd), ',', absl::SkipWhitespace());
  if (absl::Status s = o.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ha_etcd/--ha_group/--ha_advertise/--ha_lease_ttl: ", s.message()));
  }
  return o;
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
      "environment.\n"
      "Signals: SIGTERM/SIGINT drain and exit (--shutdown_grace); SIGHUP "
      "reloads --token_file.");
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
  if (absl::GetFlag(FLAGS_keep_freed_memory) &&
      !localsgd::KeepFreedMemoryForReuse()) {
    LOG(WARNING) << "--keep_freed_memory: malloc refused the settings "
                    "(not glibc?); running with its defaults";
  }

  // Block the shutdown signals (and SIGHUP, the token reload) in every
  // thread (gRPC's included, which are created below) and take them
  // synchronously in main.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<localsgd::ServerOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 options.status().ToString().c_str());
    return 2;
  }
  const bool ha = !absl::GetFlag(FLAGS_ha_etcd).empty();
  absl::StatusOr<std::unique_ptr<localsgd::UpstreamLinkFactory>> upstream =
      UpstreamFromFlags(ha, options->coordinator.shard.count);
  if (!upstream.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram,
                 std::string(upstream.status().message()).c_str());
    return 2;
  }
  options->coordinator.upstream = upstream->get();
  std::unique_ptr<HaRole> ha_role;
  if (ha) {
    // The advertise address is known only once the port is bound; the gate
    // reads it for messages only.
    ha_role = std::make_unique<HaRole>(options->coordinator.shard.index);
    options->gate = ha_role.get();
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
  const std::string http_port_file = absl::GetFlag(FLAGS_http_port_file);
  if (!http_port_file.empty() &&
      !WritePortFile(http_port_file, (*server)->http_port())) {
    return 1;
  }
  if (ha) {
    absl::StatusOr<localsgd::ElectorOptions> elector =
        ElectorOptionsFromFlags(*options, (*server)->port());
    if (!elector.ok()) {
      std::fprintf(stderr, "%s: %s\n", kProgram,
                   std::string(elector.status().message()).c_str());
      return 2;
    }
    if (absl::Status s = ha_role->Start(*std::move(elector), server->get());
        !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", kProgram, s.ToString().c_str());
      return 1;
    }
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !WritePortFile(port_file, (*server)->port())) {
    ha_role.reset();  // its thread uses the server: before the server goes
    return 1;
  }

  int sig = 0;
  // SIGHUP reloads the token file, here in main: a plain thread, where file
  // I/O is fine (gRPC handlers never wait for it; they see the old tokens or
  // the new ones, whole).
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    LOG(INFO) << "received SIGHUP; reloading --token_file";
    (void)(*server)->ReloadCredentials();  // logs the outcome
  }
  LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
            << "; draining";
  // No promotion once the drain has begun (a standby that wins now must
  // not restore into a server that is stopping).
  if (ha_role != nullptr) ha_role->BeginResign();
  (*server)->Drain(absl::GetFlag(FLAGS_shutdown_grace));
  // After the drain (the checkpoints are written): the key goes, so that a
  // standby takes over at once.
  if (ha_role != nullptr) {
    ha_role->Resign();
    ha_role.reset();  // its thread is done with the server
  }
  return 0;
}
