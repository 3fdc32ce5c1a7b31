// The coordinator's side of localsgd.v1, without gRPC: what each call does
// with its decoded request. The gRPC service (server/service.h) adds the
// security checks (server/auth.h) and moves bytes; the stream protocols of
// Sync and FetchState are state machines in server/streams.h. The fuzz
// harness (tests/fuzz) drives these same functions and machines.
#ifndef LOCALSGD_SERVER_PROTOCOL_H_
#define LOCALSGD_SERVER_PROTOCOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "localsgd/v1/coordinator.pb.h"
#include "proto/chunk.h"
#include "src/coordinator.h"
#include "src/job.h"

namespace localsgd {

// --- Checks every call or stream makes.

// The job and member a request names: NOT_FOUND for an unknown job,
// INVALID_ARGUMENT for a malformed member id (an unknown one is the call's
// to report).
absl::Status ResolveMember(Coordinator& coordinator, const std::string& job_id,
                           const std::string& member_hex,
                           std::shared_ptr<Job>* job, MemberId* member);

// The layout fingerprint a Sync header or FetchState request names must be
// the job's: a member whose model changed under it must not mix it in.
// INVALID_ARGUMENT when absent (0), FAILED_PRECONDITION when another; the
// message starts with `what`.
absl::Status CheckFingerprint(const Job& job, uint64_t fingerprint,
                              absl::string_view what);

// A chunk's checksum, checked before its data goes anywhere:
// INVALID_ARGUMENT without one, DATA_LOSS when the data does not match.
absl::Status CheckChunkCrc(const ChunkPieces& chunk, absl::string_view what);

// --- Unary calls. Each fills its response only when it returns OK.

// Join for a caller bound to `principal` (server/auth.h BindingKey; empty
// without tokens or client certificates). `max_message_bytes`: the server's
// message limit, reported to the member.
absl::Status HandleJoin(Coordinator& coordinator,
                        const v1::JoinRequest& request, std::string principal,
                        uint64_t max_message_bytes, v1::JoinResponse* response);

absl::Status HandleLeave(Coordinator& coordinator,
                         const v1::LeaveRequest& request);

absl::Status HandleHeartbeat(Coordinator& coordinator,
                             const v1::HeartbeatRequest& request,
                             v1::HeartbeatResponse* response);

// GetJobStatus at `now`. With a job id: that job (NOT_FOUND if none);
// without: every job for which `may_see(job_id)` holds (null: every job).
// max_rounds 0 means 10; at most 100 rounds per job.
// DeleteJob (Coordinator::DeleteJob).
absl::Status HandleDeleteJob(Coordinator& coordinator,
                             const v1::DeleteJobRequest& request,
                             v1::DeleteJobResponse* response);

absl::Status HandleGetJobStatus(
    Coordinator& coordinator, const v1::GetJobStatusRequest& request,
    absl::Time now, const std::function<bool(const std::string&)>& may_see,
    v1::GetJobStatusResponse* response);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_PROTOCOL_H_
