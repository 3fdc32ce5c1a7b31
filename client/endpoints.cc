#include "client/endpoints.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/credentials.h"
#include "client/sync_stream.h"
#include "glog/logging.h"

namespace localsgd {

Connection::Connection(std::string address_in,
                       std::shared_ptr<grpc::Channel> channel_in)
    : address(std::move(address_in)),
      channel(std::move(channel_in)),
      stub(v1::Coordinator::NewStub(channel)),
      generic(channel) {}

absl::StatusOr<std::unique_ptr<ShardEndpoints>> ShardEndpoints::Create(
    std::vector<std::string> addresses, const ChannelSecurity& security,
    const grpc::ChannelArguments& args) {
  if (addresses.empty()) {
    return absl::InvalidArgumentError("a shard needs at least one address");
  }
  std::vector<std::shared_ptr<Connection>> connections;
  for (std::string& address : addresses) {
    // One channel (one connection) per address: they are different servers.
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        CreateSecureChannel(address, security, args);
    if (!channel.ok()) return channel.status();
    connections.push_back(
        std::make_shared<Connection>(std::move(address), *std::move(channel)));
  }
  return std::unique_ptr<ShardEndpoints>(
      new ShardEndpoints(std::move(connections)));
}

std::shared_ptr<Connection> ShardEndpoints::current() const {
  absl::MutexLock lock(&mu_);
  return connections_[in_use_];
}

std::string ShardEndpoints::address() const { return current()->address; }

bool ShardEndpoints::OnCallFailed(const Connection& used,
                                  const absl::Status& status) {
  if (status.code() != absl::StatusCode::kUnavailable ||
      connections_.size() < 2) {
    return false;
  }
  absl::MutexLock lock(&mu_);
  if (connections_[in_use_].get() != &used) return true;  // moved already
  in_use_ = (in_use_ + 1) % connections_.size();
  LOG(WARNING) << "coordinator " << used.address << " is unavailable ("
               << status.message() << "); trying "
               << connections_[in_use_]->address;
  return true;
}

uint64_t ShardEndpoints::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Status ShardEndpoints::CheckEpoch(const Connection& used,
                                        uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (epoch < epoch_) {
    return StaleEpochError(used.address, epoch, epoch_);
  }
  if (epoch > epoch_ && epoch_ != 0) {
    LOG(INFO) << "coordinator " << used.address << " serves at epoch " << epoch
              << " (after " << epoch_ << "): a failover";
  }
  epoch_ = epoch;
  return absl::OkStatus();
}

}  // namespace localsgd
