// Which coordinator endpoint serves one shard: the addresses that can (in
// order of preference), the one in use, its channel and stubs, and what a
// call that found it UNAVAILABLE does next. The one place that decides
// where a shard's calls go: a standby to fail over to is one more address
// here. Internal to the client library; not installed.
//
// Thread-safety: thread-safe. The heartbeat thread and the calls of the
// shard take the connection in use (current()) and keep it for the call; a
// switch replaces it for the calls that follow and never pulls one from
// under a call in flight.
#ifndef LOCALSGD_CLIENT_ENDPOINTS_H_
#define LOCALSGD_CLIENT_ENDPOINTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/channel_security.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/channel_arguments.h"
#include "localsgd/v1/coordinator.grpc.pb.h"

namespace localsgd {

// One address's channel and stubs.
struct Connection {
  Connection(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string address;
  const std::shared_ptr<grpc::Channel> channel;
  const std::unique_ptr<v1::Coordinator::Stub> stub;
  // Sync and FetchState are called raw (grpc::ByteBuffer messages) through
  // the generic stub, as the service registers them, so that chunks go
  // without protobuf copies (proto/chunk_wire.h).
  grpc::GenericStub generic;
};

class ShardEndpoints {
 public:
  // A channel per address (connected lazily). INVALID_ARGUMENT for no
  // address; the errors of CreateSecureChannel (credentials.h).
  static absl::StatusOr<std::unique_ptr<ShardEndpoints>> Create(
      std::vector<std::string> addresses, const ChannelSecurity& security,
      const grpc::ChannelArguments& args);

  // The connection calls go to now.
  std::shared_ptr<Connection> current() const ABSL_LOCKS_EXCLUDED(mu_);
  // Its address, for messages.
  std::string address() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const { return connections_.size(); }

  // A call on `used` ended with `status`. UNAVAILABLE (nobody there, or a
  // coordinator that is not serving) moves the shard to the next address
  // in turn, if there is another and `used` is still the one in use (a
  // concurrent call may have moved it already); returns whether a call
  // should go to a new address. Any other status changes nothing.
  bool OnCallFailed(const Connection& used, const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The highest epoch (proto: the answering primary's election revision)
  // any answer of this shard carried; 0 without an election.
  uint64_t epoch() const ABSL_LOCKS_EXCLUDED(mu_);
  // An answer of `used` carried `epoch`. UNAVAILABLE if it is lower than
  // epoch() (a deposed primary: apply nothing of it; OnCallFailed then
  // moves on); else raises epoch() to it and returns OK.
  absl::Status CheckEpoch(const Connection& used, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit ShardEndpoints(std::vector<std::shared_ptr<Connection>> c)
      : connections_(std::move(c)) {}

  const std::vector<std::shared_ptr<Connection>> connections_;
  mutable absl::Mutex mu_;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_ENDPOINTS_H_
