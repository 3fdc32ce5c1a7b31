#include "ha/etcd_client.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace localsgd {
namespace {

// A transaction whose condition is that `key` was created at `revision` (0:
// that it does not exist); its branches are the caller's.
etcdserverpb::TxnRequest IfCreatedAt(const std::string& key, int64_t revision) {
  etcdserverpb::TxnRequest request;
  etcdserverpb::Compare* compare = request.add_compare();
  compare->set_result(etcdserverpb::Compare::EQUAL);
  compare->set_target(etcdserverpb::Compare::CREATE);
  compare->set_key(key);
  compare->set_create_revision(revision);
  return request;
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded;
}

EtcdKeyValue FromProto(const mvccpb::KeyValue& kv) {
  EtcdKeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.version = kv.version();
  out.lease = kv.lease();
  return out;
}

absl::Status ValidateEndpoint(const std::string& endpoint) {
  size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd endpoint \"", endpoint, "\" is not host:port"));
  }
  int port = 0;
  if (!absl::SimpleAtoi(endpoint.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd endpoint \"", endpoint, "\" has no port in 1..65535"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EtcdClientOptions::Validate() const {
  if (endpoints.empty()) {
    return absl::InvalidArgumentError("etcd endpoints: none given");
  }
  for (const std::string& endpoint : endpoints) {
    if (absl::Status s = ValidateEndpoint(endpoint); !s.ok()) return s;
  }
  if (rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd rpc_timeout must be > 0");
  }
  return absl::OkStatus();
}

void EtcdCancel::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (active_ != nullptr) active_->TryCancel();
}

bool EtcdCancel::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool EtcdCancel::Attach(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  active_ = context;
  return true;
}

void EtcdCancel::Detach(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (active_ == context) active_ = nullptr;
}

struct EtcdClient::Stubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
};

// One etcd member's channel. gRPC's channel can stay failed for seconds
// after etcd comes back (a connection attempt made while etcd was starting
// stalls, whatever the backoff settings); so a channel that is not READY
// after a failed call is replaced, at most once a second.
struct EtcdClient::Endpoint {
  explicit Endpoint(std::string address) : address(std::move(address)) {
    absl::MutexLock lock(&mu);
    Reset();
  }

  std::shared_ptr<Stubs> Current() {
    absl::MutexLock lock(&mu);
    return stubs;
  }

  void ResetIfNotReady(const std::shared_ptr<Stubs>& failed) {
    if (failed->channel->GetState(/*try_to_connect=*/false) ==
        GRPC_CHANNEL_READY) {
      return;  // connected: etcd is slow, not gone
    }
    absl::MutexLock lock(&mu);
    if (stubs != failed || absl::Now() - last_reset < absl::Seconds(1)) {
      return;
    }
    VLOG(1) << "etcd " << address << ": new channel";
    Reset();
  }

  void Reset() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    grpc::ChannelArguments args;
    // Reconnect soon after etcd comes back (gRPC's default backoff grows to
    // 120 s), on a connection of this client's own.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto fresh = std::make_shared<Stubs>();
    fresh->channel = grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args);
    fresh->kv = etcdserverpb::KV::NewStub(fresh->channel);
    fresh->lease = etcdserverpb::Lease::NewStub(fresh->channel);
    fresh->watch = etcdserverpb::Watch::NewStub(fresh->channel);
    stubs = std::move(fresh);
    last_reset = absl::Now();
  }

  const std::string address;
  absl::Mutex mu;
  std::shared_ptr<Stubs> stubs ABSL_GUARDED_BY(mu);
  absl::Time last_reset ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(
    EtcdClientOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(options)));
}

EtcdClient::EtcdClient(EtcdClientOptions options)
    : options_(std::move(options)) {
  for (const std::string& address : options_.endpoints) {
    endpoints_.push_back(std::make_unique<Endpoint>(address));
  }
}

EtcdClient::~EtcdClient() = default;

template <typename Attempt>
absl::Status EtcdClient::RunWithFailover(const char* call, absl::Time deadline,
                                         absl::Duration attempt_timeout,
                                         Attempt attempt) {
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = preferred_;
  }
  std::vector<std::string> errors;
  absl::StatusCode last_code = absl::StatusCode::kUnavailable;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const size_t index = (start + i) % endpoints_.size();
    Endpoint& endpoint = *endpoints_[index];
    const absl::Time begin = absl::Now();
    if (begin >= deadline) {
      last_code = absl::StatusCode::kDeadlineExceeded;
      errors.push_back(absl::StrCat("etcd ", endpoint.address, ": ", call,
                                    ": deadline passed before the call"));
      break;
    }
    const absl::Time attempt_deadline =
        std::min(begin + attempt_timeout, deadline);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(attempt_deadline));
    // Served only by a member with a leader (etcd's clientv3 sends the same).
    context.AddMetadata("hasleader", "true");
    std::shared_ptr<Stubs> stubs = endpoint.Current();
    absl::Status status = attempt(*stubs, &context);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      preferred_ = index;
      return status;
    }
    last_code = status.code();
    std::string what =
        status.code() == absl::StatusCode::kDeadlineExceeded
            ? absl::StrCat("deadline exceeded after ",
                           absl::FormatDuration(attempt_deadline - begin))
            : std::string(status.message());
    if (what.empty()) what = absl::StatusCodeToString(status.code());
    errors.push_back(
        absl::StrCat("etcd ", endpoint.address, ": ", call, ": ", what));
    VLOG(1) << errors.back();
    if (!Retryable(status.code())) break;
    endpoint.ResetIfNotReady(stubs);
  }
  return absl::Status(last_code, absl::StrJoin(errors, "; "));
}

template <typename Attempt>
absl::Status EtcdClient::RunWithFailover(const char* call, absl::Time deadline,
                                         Attempt attempt) {
  return RunWithFailover(call, deadline, options_.rpc_timeout, attempt);
}

absl::StatusOr<EtcdLease> EtcdClient::GrantLease(absl::Duration ttl,
                                                 absl::Time deadline) {
  int64_t seconds = std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(ttl))));
  EtcdLease lease;
  absl::Status status = RunWithFailover(
      "LeaseGrant", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::LeaseGrantRequest request;
        request.set_ttl(seconds);
        etcdserverpb::LeaseGrantResponse response;
        absl::Status s =
            FromGrpc(endpoint.lease->LeaseGrant(context, request, &response));
        if (!s.ok()) return s;
        if (!response.error().empty()) {
          return absl::FailedPreconditionError(response.error());
        }
        lease.id = response.id();
        lease.ttl = absl::Seconds(response.ttl());
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return lease;
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAliveOnce(int64_t lease,
                                                         absl::Time deadline) {
  absl::Duration ttl;
  absl::Status status = RunWithFailover(
      "LeaseKeepAlive", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        auto stream = endpoint.lease->LeaseKeepAlive(context);
        etcdserverpb::LeaseKeepAliveRequest request;
        request.set_id(lease);
        etcdserverpb::LeaseKeepAliveResponse response;
        if (!stream->Write(request) || !stream->Read(&response)) {
          return FromGrpc(stream->Finish());
        }
        // Done with the stream: end it at once rather than wait for etcd to
        // close its side.
        context->TryCancel();
        stream->Finish().IgnoreError();
        if (response.ttl() <= 0) {
          return absl::NotFoundError(absl::StrFormat(
              "lease %x not found (expired or revoked)", lease));
        }
        ttl = absl::Seconds(response.ttl());
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return ttl;
}

absl::Status EtcdClient::RevokeLease(int64_t lease, absl::Time deadline) {
  return RunWithFailover(
      "LeaseRevoke", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::LeaseRevokeRequest request;
        request.set_id(lease);
        etcdserverpb::LeaseRevokeResponse response;
        absl::Status s =
            FromGrpc(endpoint.lease->LeaseRevoke(context, request, &response));
        // Already gone (expired, or an earlier attempt revoked it).
        if (s.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
        return s;
      });
}

absl::StatusOr<EtcdCampaign> EtcdClient::CreateIfAbsent(
    const std::string& key, const std::string& value, int64_t lease,
    absl::Time deadline) {
  EtcdCampaign campaign;
  absl::Status status = RunWithFailover(
      "Txn(CreateIfAbsent)", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::TxnRequest request = IfCreatedAt(key, 0);
        etcdserverpb::PutRequest* put =
            request.add_success()->mutable_request_put();
        put->set_key(key);
        put->set_value(value);
        put->set_lease(lease);
        request.add_failure()->mutable_request_range()->set_key(key);
        etcdserverpb::TxnResponse response;
        absl::Status s =
            FromGrpc(endpoint.kv->Txn(context, request, &response));
        if (!s.ok()) return s;
        campaign = EtcdCampaign();
        campaign.revision = response.header().revision();
        if (response.succeeded()) {
          campaign.won = true;
          // The put's revision: the key's create revision.
          campaign.create_revision = response.header().revision();
          campaign.holder = value;
          campaign.holder_lease = lease;
          return absl::OkStatus();
        }
        if (response.responses_size() != 1 ||
            response.responses(0).response_range().kvs_size() != 1) {
          return absl::InternalError(
              "transaction failed but read no holder of the key");
        }
        const mvccpb::KeyValue& kv =
            response.responses(0).response_range().kvs(0);
        campaign.create_revision = kv.create_revision();
        campaign.holder = kv.value();
        campaign.holder_lease = kv.lease();
        // An earlier attempt of this call created it; its answer was lost.
        campaign.won = lease != 0 && kv.lease() == lease;
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return campaign;
}

absl::StatusOr<EtcdGetResult> EtcdClient::Get(const std::string& key,
                                              absl::Time deadline) {
  EtcdGetResult result;
  absl::Status status = RunWithFailover(
      "Range", deadline, [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::RangeRequest request;
        request.set_key(key);
        etcdserverpb::RangeResponse response;
        absl::Status s =
            FromGrpc(endpoint.kv->Range(context, request, &response));
        if (!s.ok()) return s;
        result = EtcdGetResult();
        result.revision = response.header().revision();
        if (response.kvs_size() > 0) result.kv = FromProto(response.kvs(0));
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<bool> EtcdClient::DeleteIfCreated(const std::string& key,
                                                 int64_t create_revision,
                                                 absl::Time deadline) {
  bool deleted = false;
  absl::Status status = RunWithFailover(
      "Txn(DeleteIfCreated)", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::TxnRequest request = IfCreatedAt(key, create_revision);
        request.add_success()->mutable_request_delete_range()->set_key(key);
        etcdserverpb::TxnResponse response;
        absl::Status s =
            FromGrpc(endpoint.kv->Txn(context, request, &response));
        if (!s.ok()) return s;
        deleted = response.succeeded();
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return deleted;
}

absl::StatusOr<int64_t> EtcdClient::PutIfCreated(const std::string& key,
                                                 const std::string& value,
                                                 const std::string& guard,
                                                 int64_t guard_create_revision,
                                                 int64_t key_mod_revision,
                                                 absl::Time deadline) {
  int64_t revision = 0;
  absl::Status status = RunWithFailover(
      "Txn(PutIfCreated)", deadline,
      [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::TxnRequest request =
            IfCreatedAt(guard, guard_create_revision);
        if (key_mod_revision >= 0) {
          etcdserverpb::Compare* compare = request.add_compare();
          compare->set_result(etcdserverpb::Compare::EQUAL);
          compare->set_target(etcdserverpb::Compare::MOD);
          compare->set_key(key);
          compare->set_mod_revision(key_mod_revision);
        }
        etcdserverpb::PutRequest* p =
            request.add_success()->mutable_request_put();
        p->set_key(key);
        p->set_value(value);
        etcdserverpb::TxnResponse response;
        absl::Status s =
            FromGrpc(endpoint.kv->Txn(context, request, &response));
        if (!s.ok()) return s;
        revision = response.succeeded() ? response.header().revision() : 0;
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return revision;
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key,
                                        const std::string& value,
                                        absl::Time deadline) {
  int64_t revision = 0;
  absl::Status status = RunWithFailover(
      "Put", deadline, [&](Stubs& endpoint, grpc::ClientContext* context) {
        etcdserverpb::PutRequest request;
        request.set_key(key);
        request.set_value(value);
        etcdserverpb::PutResponse response;
        absl::Status s =
            FromGrpc(endpoint.kv->Put(context, request, &response));
        if (!s.ok()) return s;
        revision = response.header().revision();
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return revision;
}

absl::StatusOr<EtcdChange> EtcdClient::WaitForChange(const std::string& key,
                                                     int64_t after_revision,
                                                     absl::Duration timeout,
                                                     EtcdCancel* cancel) {
  EtcdChange change;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status status = RunWithFailover(
      "Watch", deadline, timeout,
      [&](Stubs& endpoint, grpc::ClientContext* context) -> absl::Status {
        if (cancel != nullptr && !cancel->Attach(context)) {
          return absl::CancelledError("cancelled");
        }
        struct Detach {
          EtcdCancel* cancel;
          grpc::ClientContext* context;
          ~Detach() {
            if (cancel != nullptr) cancel->Detach(context);
          }
        } detach{cancel, context};
        auto stream = endpoint.watch->Watch(context);
        etcdserverpb::WatchRequest request;
        etcdserverpb::WatchCreateRequest* create =
            request.mutable_create_request();
        create->set_key(key);
        create->set_start_revision(after_revision + 1);
        bool created = false;
        etcdserverpb::WatchResponse response;
        auto end = [&](absl::Status s) {
          context->TryCancel();
          stream->Finish().IgnoreError();
          return s;
        };
        if (stream->Write(request)) {
          while (stream->Read(&response)) {
            if (response.compact_revision() > 0) {
              return end(absl::OutOfRangeError(absl::StrCat(
                  "revision ", after_revision + 1,
                  " compacted; oldest kept is ", response.compact_revision())));
            }
            if (response.canceled()) {
              return end(absl::UnavailableError(absl::StrCat(
                  "watch cancelled by etcd: ", response.cancel_reason())));
            }
            if (response.created()) created = true;
            for (const mvccpb::Event& event : response.events()) {
              if (event.kv().key() != key) continue;
              change.revision = event.kv().mod_revision();
              if (event.type() == mvccpb::Event::DELETE) {
                change.kind = EtcdChange::kDelete;
              } else {
                change.kind = EtcdChange::kPut;
                change.kv = FromProto(event.kv());
              }
              return end(absl::OkStatus());
            }
          }
        }
        absl::Status s = FromGrpc(stream->Finish());
        if (cancel != nullptr && cancel->cancelled()) {
          return absl::CancelledError("cancelled");
        }
        // A created watch that ended at its deadline saw no event: a
        // timeout, whether gRPC says DEADLINE_EXCEEDED or etcd's handler
        // ended it first with its own "context deadline exceeded"
        // (UNKNOWN).
        if (created && (s.code() == absl::StatusCode::kDeadlineExceeded ||
                        absl::Now() >= deadline)) {
          change.kind = EtcdChange::kTimeout;
          return absl::OkStatus();
        }
        if (s.ok()) {
          return absl::UnavailableError("watch stream ended by etcd");
        }
        return s;
      });
  if (!status.ok()) return status;
  return change;
}

}  // namespace localsgd
