#include "server/protocol.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "server/convert.h"

namespace localsgd {

absl::Status ResolveMember(Coordinator& coordinator, const std::string& job_id,
                           const std::string& member_hex,
                           std::shared_ptr<Job>* job, MemberId* member) {
  absl::StatusOr<std::shared_ptr<Job>> j = coordinator.FindJob(job_id);
  if (!j.ok()) return j.status();
  absl::StatusOr<MemberId> m = ParseMemberId(member_hex);
  if (!m.ok()) return m.status();
  *job = *std::move(j);
  *member = *std::move(m);
  return absl::OkStatus();
}

absl::Status CheckFingerprint(const Job& job, uint64_t fingerprint,
                              absl::string_view what) {
  if (fingerprint == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " has no layout_fingerprint; send the fingerprint of the "
                     "layout the member joined with"));
  }
  if (fingerprint != job.layout().fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " names layout fingerprint ",
                     absl::Hex(fingerprint, absl::kZeroPad16), " but job '",
                     job.id(), "' averages layout ",
                     absl::Hex(job.layout().fingerprint, absl::kZeroPad16),
                     "; the member's model is not the job's (did it change?)"));
  }
  return absl::OkStatus();
}

absl::Status CheckChunkCrc(const ChunkPieces& chunk, absl::string_view what) {
  if (!chunk.has_crc32c) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " chunk ", chunk.index, " has no crc32c"));
  }
  const uint32_t crc = chunk.ComputeCrc32c();
  if (crc != chunk.crc32c) {
    return absl::DataLossError(absl::StrCat(
        what, " chunk ", chunk.index, " is corrupt: its data has CRC32C ",
        absl::Hex(crc, absl::kZeroPad8), ", the chunk says ",
        absl::Hex(chunk.crc32c, absl::kZeroPad8),
        "; nothing of it was counted, resend it"));
  }
  return absl::OkStatus();
}

absl::Status HandleJoin(Coordinator& coordinator,
                        const v1::JoinRequest& request, std::string principal,
                        uint64_t max_message_bytes,
                        v1::JoinResponse* response) {
  // A client that predates pseudo-gradients says nothing of what it sends
  // (it sends parameters): never let it into a job that reads deltas.
  if (request.settings().contribution() == v1::CONTRIBUTION_UNSPECIFIED) {
    absl::StatusOr<std::shared_ptr<Job>> job =
        coordinator.FindJob(request.job_id());
    const Contribution contribution =
        job.ok() ? (*job)->settings().contribution
                 : coordinator.options().default_settings.contribution;
    if (contribution == Contribution::kPseudoGradients) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", request.job_id(), "' ",
          job.ok() ? "takes" : "would take (the coordinator's default)",
          " pseudo-gradients (JobSettings.contribution), and this Join does "
          "not say what its member sends: it comes from a localsgd client "
          "that predates pseudo-gradients and sends parameters. Upgrade the "
          "client library (it sets JobSettings.contribution), or use a job "
          "of parameters (coordinator --contribution=parameters)"));
    }
  }
  // Before decoding the layout: its cost is its tensor count. (The core
  // checks the same for its direct callers.)
  if (absl::Status s = CheckTensorCount(request.layout().tensors_size(),
                                        coordinator.options().max_tensors);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<JoinRequestParams> params =
      JoinParamsFromProto(request, std::move(principal));
  if (!params.ok()) return params.status();
  absl::StatusOr<JoinResult> result =
      coordinator.Join(request.job_id(), *std::move(params));
  if (!result.ok()) return result.status();
  const CoordinatorOptions& options = coordinator.options();
  JoinInfo info;
  info.member_id = result->member_id;
  info.settings = result->settings;
  info.lease_ttl = options.policy.lease_ttl;
  info.round_deadline = options.policy.round_deadline;
  info.min_quorum = options.policy.min_quorum;
  info.max_message_bytes = max_message_bytes;
  info.paced_uploads = true;  // server/streams.cc SendRestEarlyLocked
  info.has_state = result->has_state;
  info.state_round = result->state_round;
  info.state_id = result->state_id;
  info.num_chunks = result->geometry.num_chunks();
  info.num_elements = result->geometry.num_elements();
  info.shard = options.shard;
  info.epoch = coordinator.epoch();
  JoinInfoToProto(info, response);
  return absl::OkStatus();
}

absl::Status HandleLeave(Coordinator& coordinator,
                         const v1::LeaveRequest& request) {
  std::shared_ptr<Job> job;
  MemberId member;
  absl::Status s = ResolveMember(coordinator, request.job_id(),
                                 request.member_id(), &job, &member);
  return s.ok() ? job->Leave(member) : s;
}

absl::Status HandleHeartbeat(Coordinator& coordinator,
                             const v1::HeartbeatRequest& request,
                             v1::HeartbeatResponse* response) {
  std::shared_ptr<Job> job;
  MemberId member;
  absl::Status s = ResolveMember(coordinator, request.job_id(),
                                 request.member_id(), &job, &member);
  if (!s.ok()) return s;
  absl::StatusOr<RoundId> round = job->Heartbeat(member);
  if (!round.ok()) return round.status();
  response->set_state_round(*round);
  response->set_epoch(coordinator.epoch());
  return absl::OkStatus();
}

absl::Status HandleDeleteJob(Coordinator& coordinator,
                             const v1::DeleteJobRequest& request,
                             v1::DeleteJobResponse* response) {
  absl::StatusOr<RoundId> round = coordinator.DeleteJob(request.job_id());
  if (!round.ok()) return round.status();
  response->set_state_round(*round);
  return absl::OkStatus();
}

absl::Status HandleGetJobStatus(
    Coordinator& coordinator, const v1::GetJobStatusRequest& request,
    absl::Time now, const std::function<bool(const std::string&)>& may_see,
    v1::GetJobStatusResponse* response) {
  const uint32_t max_rounds =
      request.max_rounds() == 0 ? 10 : std::min(request.max_rounds(), 100u);
  response->set_epoch(coordinator.epoch());
  if (Replicator* replicator = coordinator.options().replicator) {
    for (const StandbyStatus& s : replicator->Standbys()) {
      v1::StandbyStatus* p = response->add_standbys();
      p->set_address(s.address);
      p->set_in_sync(s.in_sync);
      p->set_lag(s.lag);
    }
  }
  if (!request.job_id().empty()) {
    absl::StatusOr<std::shared_ptr<Job>> job =
        coordinator.FindJob(request.job_id());
    if (!job.ok()) return job.status();
    JobStatusToProto((*job)->Status(max_rounds), now, response->add_jobs());
    return absl::OkStatus();
  }
  for (const auto& job : coordinator.Jobs()) {
    if (may_see && !may_see(job->id())) continue;
    JobStatusToProto(job->Status(max_rounds), now, response->add_jobs());
  }
  return absl::OkStatus();
}

}  // namespace localsgd
