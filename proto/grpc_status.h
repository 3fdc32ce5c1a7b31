// The one conversion between absl::Status and grpc::Status, both ways. absl
// and gRPC share the canonical code numbering; the message goes as it is.
#ifndef LOCALSGD_PROTO_GRPC_STATUS_H_
#define LOCALSGD_PROTO_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace localsgd {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace localsgd

#endif  // LOCALSGD_PROTO_GRPC_STATUS_H_
