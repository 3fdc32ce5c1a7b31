// Conversions between localsgd.v1 messages and core types, and the one place
// where absl::Status becomes grpc::Status.
#ifndef LOCALSGD_SERVER_CONVERT_H_
#define LOCALSGD_SERVER_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "localsgd/v1/coordinator.pb.h"
#include "src/job.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// INVALID_ARGUMENT for values outside the enum. `what` names the field.
absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view what);
v1::DType DTypeToProto(DType dtype);

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto);
void LayoutToProto(const Layout& layout, v1::Layout* proto);

absl::StatusOr<JobSettings> SettingsFromProto(const v1::JobSettings& proto);
void SettingsToProto(const JobSettings& settings, v1::JobSettings* proto);

// INVALID_ARGUMENT unless `hex` is a well-formed member id.
absl::StatusOr<MemberId> ParseMemberId(const std::string& hex);

void JobStatusToProto(const JobStatusSnapshot& status, absl::Time now,
                      v1::JobStatus* proto);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_CONVERT_H_
