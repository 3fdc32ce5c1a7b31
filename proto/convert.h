// The protocol layer's conversions between localsgd.v1 messages and the
// value types of src/types.h and src/layout.h, written once for the server,
// the client, localsgdctl and the tests. No gRPC.
//
// FromProto functions check what the message cannot (enum values in range,
// well-formed ids) and return INVALID_ARGUMENT naming the field; they do not
// check limits or consistency, which are the receiver's rules (layouts:
// ValidateLayout; settings: src/settings.h).
#ifndef LOCALSGD_PROTO_CONVERT_H_
#define LOCALSGD_PROTO_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "localsgd/v1/coordinator.pb.h"
#include "src/layout.h"
#include "src/types.h"

namespace localsgd {

// INVALID_ARGUMENT for values outside the enum. `what` names the field.
absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view what);
v1::DType DTypeToProto(DType dtype);

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto);
void LayoutToProto(const Layout& layout, v1::Layout* proto);
v1::Layout LayoutToProto(const Layout& layout);

absl::StatusOr<JobSettings> SettingsFromProto(const v1::JobSettings& proto);
void SettingsToProto(const JobSettings& settings, v1::JobSettings* proto);

// INVALID_ARGUMENT unless `hex` is a well-formed member id.
absl::StatusOr<MemberId> ParseMemberId(const std::string& hex);

// JoinResponse <-> JoinInfo. FromProto: INVALID_ARGUMENT for unknown enum
// values or a malformed member id; a shard_count of 0 reads as 1.
void JoinInfoToProto(const JoinInfo& info, v1::JoinResponse* proto);
absl::StatusOr<JoinInfo> JoinInfoFromProto(const v1::JoinResponse& proto);

// SyncResult (the result header of a Sync) <-> RoundOutcome.
void RoundOutcomeToProto(const RoundOutcome& outcome, v1::SyncResult* proto);
RoundOutcome RoundOutcomeFromProto(const v1::SyncResult& proto);

}  // namespace localsgd

#endif  // LOCALSGD_PROTO_CONVERT_H_
