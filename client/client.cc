#include "client/client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/endpoints.h"
#include "client/replica.h"
#include "glog/logging.h"
#include "grpcpp/support/channel_arguments.h"
#include "src/settings.h"

namespace localsgd {
namespace {

std::string DefaultMemberName() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat(host[0] ? host : "unknown-host", "/", getpid());
}

}  // namespace

absl::Status ClientOptions::Validate() const {
  if (target.empty() && replicas.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.target and ClientOptions.replicas are both empty");
  }
  if (resolve_replicas && !replicas.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.resolve_replicas resolves `target`; it does not go "
        "with an explicit `replicas` list");
  }
  for (const std::string& r : replicas) {
    for (absl::string_view a : absl::StrSplit(r, '|')) {
      if (a.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ClientOptions.replicas has an empty address in '", r, "'"));
      }
    }
  }
  if (replicas.empty() && !resolve_replicas) {
    for (absl::string_view a : absl::StrSplit(target, '|')) {
      if (a.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ClientOptions.target has an empty address in '", target, "'"));
      }
    }
  }
  if (job_id.empty()) {
    return absl::InvalidArgumentError("ClientOptions.job_id is empty");
  }
  if (!(weight >= 1e-6) || weight > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.weight must be in [1e-6, 1e6]; got ", weight));
  }
  // Only what any coordinator refuses: its own limits it checks at Join.
  SettingsLimits any;
  any.max_chunk_elements = ~uint32_t{0};
  any.max_members = ~uint32_t{0};
  if (absl::Status s =
          ValidateSetFields(settings, any, "ClientOptions.settings: ");
      !s.ok()) {
    return s;
  }
  if (rpc_timeout <= absl::ZeroDuration() ||
      sync_timeout <= absl::ZeroDuration() ||
      initial_backoff <= absl::ZeroDuration() ||
      max_backoff < initial_backoff) {
    return absl::InvalidArgumentError(
        "ClientOptions timeouts and backoffs must be positive, "
        "max_backoff >= initial_backoff");
  }
  return security.Validate("ClientOptions.security.");
}

absl::StatusOr<std::vector<std::string>> ResolveReplicaAddresses(
    absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", host_port, "' has no port; replicas resolve from host:port"));
  }
  std::string host(host_port.substr(0, colon));
  const std::string port(host_port.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host_port, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr,
                ip, sizeof(ip));
      out.push_back(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6,
                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip,
                sizeof(ip));
      out.push_back(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(result);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) {
    return absl::UnavailableError(
        absl::StrCat("'", host_port, "' resolves to no address"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.member_name.empty()) options.member_name = DefaultMemberName();
  std::vector<std::string> addresses = options.replicas;
  if (options.resolve_replicas) {
    absl::StatusOr<std::vector<std::string>> resolved =
        ResolveReplicaAddresses(options.target);
    if (!resolved.ok()) return resolved.status();
    addresses = *std::move(resolved);
    LOG(INFO) << options.target << " resolves to " << addresses.size()
              << " coordinator replicas: " << absl::StrJoin(addresses, ", ");
  }
  if (addresses.empty()) addresses.push_back(options.target);

  grpc::ChannelArguments args;
  // Results come back in chunks of the job's size; allow the largest the
  // coordinator may use, not INT_MAX.
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // gRPC's default reconnect backoff grows to 120 s, and while it waits every
  // call fails at once: a worker would miss a restarted coordinator by
  // seconds. Reconnect quickly instead; the coordinator is one address.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A shard with standbys: a primary that hangs (paused, cut off) must
  // fail the calls waiting on it so that they move to the next address, as
  // a dead one's do at once. HTTP/2 pings every second find it within 3 s
  // (the coordinator accepts them at that rate when it has an election).
  for (const std::string& address : addresses) {
    if (address.find('|') == std::string::npos) continue;
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    break;
  }
  uint64_t incarnation = 0;
  {
    absl::BitGen gen;
    while (incarnation == 0) incarnation = absl::Uniform<uint64_t>(gen);
  }
  auto client = std::unique_ptr<Client>(new Client(std::move(options)));
  const ChannelSecurity& security = client->options_.security;
  for (const std::string& address : addresses) {
    // TLS, token: credentials.h. One shard per entry (ClientOptions::
    // replicas), its primary and standbys separated by '|'.
    absl::StatusOr<std::unique_ptr<ShardEndpoints>> endpoints =
        ShardEndpoints::Create(absl::StrSplit(address, '|'), security, args);
    if (!endpoints.ok()) return endpoints.status();
    client->replicas_.push_back(std::make_unique<Replica>(
        client->options_, *std::move(endpoints), incarnation));
  }
  return client;
}

Client::Client(ClientOptions options) : options_(std::move(options)) {}

Client::~Client() {
  if (joined_) {
    absl::Status s = Leave();
    if (!s.ok()) LOG(WARNING) << "leaving job " << options_.job_id << ": " << s;
  }
}

absl::Status Client::ForEachReplica(
    const std::function<absl::Status(Replica&)>& fn) {
  const size_t n = replicas_.size();
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  for (size_t i = 1; i < n; ++i) {
    threads.emplace_back([&, i] { status[i] = fn(*replicas_[i]); });
  }
  status[0] = fn(*replicas_[0]);
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < n; ++i) {
    if (status[i].ok()) continue;
    if (n == 1) return status[i];
    return absl::Status(
        status[i].code(),
        absl::StrCat("coordinator replica ", replicas_[i]->address(), ": ",
                     status[i].message()));
  }
  return absl::OkStatus();
}

RoundId Client::state_round() const {
  RoundId round = replicas_[0]->state_round();
  for (const auto& r : replicas_) round = std::min(round, r->state_round());
  return round;
}

absl::Status Client::Join(const Layout& layout) {
  absl::StatusOr<uint64_t> total = ValidateLayout(layout, ~uint64_t{0});
  if (!total.ok()) return total.status();
  if (absl::Status s = ForEachReplica([&](Replica& r) {
        return r.Join(layout, *total, /*expect_shard=*/nullptr);
      });
      !s.ok()) {
    return s;
  }
  joined_ = true;  // from here on, Leave (or the destructor) leaves
  layout_ = layout;
  if (absl::Status s = CheckReplicaSet(); !s.ok()) {
    Leave().IgnoreError();  // an inconsistent set must not be used
    return s;
  }
  info_ = replicas_[0]->info();
  info_.num_elements = *total;
  info_.num_chunks = static_cast<uint32_t>(
      ChunkGeometry(*total, info_.settings.chunk_elements).num_chunks());
  for (const auto& r : replicas_) {
    info_.lease_ttl = std::min(info_.lease_ttl, r->info().lease_ttl);
    info_.has_state = info_.has_state && r->info().has_state;
    info_.state_round = std::min(info_.state_round, r->info().state_round);
  }
  return absl::OkStatus();
}

absl::Status Client::CheckReplicaSet() const {
  // The replicas must be the shards 0..S-1 of S, and agree on the settings.
  const size_t n = replicas_.size();
  std::vector<std::string> owner(n);
  for (const auto& r : replicas_) {
    const ShardSpec shard = r->shard();
    if (shard.count != n) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator ", r->address(), " is shard ", shard.index, " of ",
          shard.count, " but the client was given ", n,
          " replica(s); list every replica (--shard_count says how many)"));
    }
    if (!owner[shard.index].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("coordinators ", owner[shard.index], " and ",
                       r->address(), " are both shard ", shard.index, " of ", n,
                       "; give each replica its own --shard_index"));
    }
    owner[shard.index] = r->address();
    const JobSettings& a = r->info().settings;
    const JobSettings& b = replicas_[0]->info().settings;
    if (a.chunk_elements != b.chunk_elements ||
        WireCodeOf(a) != WireCodeOf(b) || ResultCodeOf(a) != ResultCodeOf(b)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator replicas ", replicas_[0]->address(), " and ",
          r->address(), " hold job ", options_.job_id,
          " with different chunk sizes or wire dtypes; start the replicas "
          "with the same settings"));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Initialize(absl::Span<float> params) {
  if (!joined_) return absl::FailedPreconditionError("Initialize before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  // Seed or fetch each replica's chunks (a replica that lost its state is
  // re-seeded with these parameters while the others fetch theirs).
  return ForEachReplica(
      [&](Replica& r) { return r.Initialize(layout_, params); });
}

absl::StatusOr<RoundId> Client::FetchState(absl::Span<float> params) {
  if (!joined_) return absl::FailedPreconditionError("FetchState before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  if (absl::Status s = ForEachReplica(
          [&](Replica& r) { return r.FetchState(layout_, params).status(); });
      !s.ok()) {
    return s;
  }
  return state_round();
}

absl::StatusOr<SyncOutcome> Client::Sync(absl::Span<float> params,
                                         SyncWork work) {
  if (!joined_) return absl::FailedPreconditionError("Sync before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  std::vector<SyncOutcome> outcomes(replicas_.size());
  std::vector<Replica*> index;
  for (const auto& r : replicas_) index.push_back(r.get());
  if (absl::Status s = ForEachReplica([&](Replica& r) -> absl::Status {
        const size_t i =
            std::find(index.begin(), index.end(), &r) - index.begin();
        absl::StatusOr<SyncOutcome> o = r.Sync(layout_, params, work);
        if (!o.ok()) return o.status();
        outcomes[i] = *o;
        return absl::OkStatus();
      });
      !s.ok()) {
    return s;
  }
  // A replica may have re-joined under a new member id.
  info_.member_id = replicas_[0]->info().member_id;
  // One outcome for the whole model: replicas agree unless one restarted.
  SyncOutcome all = outcomes[0];
  for (size_t i = 1; i < outcomes.size(); ++i) {
    const SyncOutcome& o = outcomes[i];
    all.round = std::min(all.round, o.round);
    all.contributed = all.contributed && o.contributed;
    all.late = all.late || o.late;
    all.contributors = std::min(all.contributors, o.contributors);
    all.contributor_weight =
        std::min(all.contributor_weight, o.contributor_weight);
    all.bytes_sent += o.bytes_sent;
    all.bytes_received += o.bytes_received;
    all.rejoined = all.rejoined || o.rejoined;
    all.upload_time = std::max(all.upload_time, o.upload_time);
    all.first_result_time =
        std::max(all.first_result_time, o.first_result_time);
    all.result_time = std::max(all.result_time, o.result_time);
    all.paced_writes += o.paced_writes;
    all.staleness = std::max(all.staleness, o.staleness);
    // Shards' budgets differ only by their own learning: the fewest.
    if (o.local_steps_budget > 0 &&
        (all.local_steps_budget == 0 ||
         o.local_steps_budget < all.local_steps_budget)) {
      all.local_steps_budget = o.local_steps_budget;
    }
  }
  return all;
}

absl::Status Client::Leave() {
  absl::Status first;
  for (const auto& r : replicas_) {
    absl::Status s = r->Leave();
    if (first.ok() && !s.ok()) first = s;
  }
  joined_ = false;
  return first;
}

}  // namespace localsgd
