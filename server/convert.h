// The server's own conversions: a job's status (core) to localsgd.v1, a
// Join request to the core's parameters. Part of the server's gRPC-free
// protocol layer (server/protocol.h); the conversions of the value types
// both sides share live in proto/convert.h.
#ifndef LOCALSGD_SERVER_CONVERT_H_
#define LOCALSGD_SERVER_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "localsgd/v1/coordinator.pb.h"
#include "proto/convert.h"
#include "src/job_types.h"

namespace localsgd {

void JobStatusToProto(const JobStatusSnapshot& status, absl::Time now,
                      v1::JobStatus* proto);

// A closed round's record, both ways (status; replication). From proto:
// names sorted; contributor ids and weight are not carried.
void RoundRecordToProto(const RoundRecord& record, v1::RoundStatus* proto);
void StepCountsToProto(const StepCounts& counts, v1::StepCounts* proto);
StepCounts StepCountsFromProto(const v1::StepCounts& proto);
RoundRecord RoundRecordFromProto(const v1::RoundStatus& proto);

// A Join request as the core takes it, for a caller bound to `principal`
// (server/auth.h Principal::BindingKey). INVALID_ARGUMENT for an unknown
// dtype, mode or policy; limits are the coordinator's to check.
absl::StatusOr<JoinRequestParams> JoinParamsFromProto(
    const v1::JoinRequest& request, std::string principal);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_CONVERT_H_
