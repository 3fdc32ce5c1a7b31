// What a standby does with the updates of its primary's replication stream
// (proto/localsgd/v1/replication.proto), apart from the stream: assembles
// each job's replica of the catch-up and adopts it
// (Coordinator::AdoptReplica), applies the result chunks and commits that
// follow (Coordinator::ApplyReplicated; those at or below a job's
// catch-up cut are in its replica already), and says what to acknowledge.
//
// No I/O, no threads, no gRPC: ReplicaFollower (server/replication.h) feeds
// it what it reads from one Follow stream (a new stream, a new applier);
// tests/fuzz/replica_fuzzer.cc feeds it anything. The primary is
// authenticated (the group's token), but a malformed or non-finite update
// is refused all the same (INVALID_ARGUMENT, naming what), never applied.
//
// Not thread-safe: one stream's reader owns it.
#ifndef LOCALSGD_SERVER_REPLICA_APPLIER_H_
#define LOCALSGD_SERVER_REPLICA_APPLIER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "localsgd/v1/replication.pb.h"
#include "src/coordinator.h"
#include "src/replicator.h"

namespace localsgd {

class ReplicaApplier {
 public:
  // Applies to `coordinator`'s jobs the stream of a primary of election
  // epoch `epoch` (updates of a lower epoch are refused).
  ReplicaApplier(Coordinator* coordinator, uint64_t epoch);

  struct Applied {
    // Whether to acknowledge the update's sequence (a CaughtUp, a chunk, a
    // commit).
    bool acknowledge = false;
    // CaughtUp: the catch-up is complete; in sync once every update up to
    // `through` is applied.
    bool caught_up = false;
    uint64_t through = 0;
  };
  // One update, in stream order. Errors (after which the stream is no use:
  // a new one, with a new catch-up, follows): FAILED_PRECONDITION for an
  // update of a lower epoch (a deposed primary); ABORTED for Dropped (the
  // primary goes on without this standby); INVALID_ARGUMENT for a
  // malformed update (what and where); what the coordinator says of an
  // update it cannot apply.
  absl::StatusOr<Applied> Apply(const v1::ReplicaUpdate& update);

  // Whether an update of the stream's epoch came (the coordinator was
  // told to follow: Coordinator::BeginFollowing), and whether the primary
  // dropped this standby.
  bool began() const { return began_; }
  bool dropped() const { return dropped_; }

 private:
  // A job's replica as its messages arrive: the header, the state's chunks
  // in order, then the open round's final chunks.
  struct Assembly {
    JobReplica replica;
    std::vector<size_t> offsets;  // of the state's chunks
    std::vector<size_t> sizes;
    uint32_t finals_left = 0;
    std::shared_ptr<StateSnapshot> state;
    std::shared_ptr<StateSnapshot> partial;
  };
  absl::Status Start(const v1::JobReplica& m);
  absl::Status Add(const v1::ReplicaStateChunk& m);
  // Adopts the replica being assembled, if any.
  absl::Status Flush();
  // Whether update `sequence` of `job_id` is in that job's catch-up
  // already (at or below its cut).
  bool InCatchUp(const std::string& job_id, uint64_t sequence) const;
  absl::Status ApplyChunk(const v1::ReplicaUpdate& update);
  absl::Status ApplyCommit(const v1::ReplicaUpdate& update);

  Coordinator* const coordinator_;
  const uint64_t epoch_;
  bool began_ = false;
  bool dropped_ = false;
  // Per job: updates at or below this sequence are in its catch-up.
  absl::flat_hash_map<std::string, uint64_t> cuts_;
  Assembly assembly_;
  bool assembling_ = false;
};

// Float32 little-endian (the wire's, and every host's here): the values
// of `bytes` into `out`. INVALID_ARGUMENT, naming `what`, for a size that
// is not a whole number of floats or a value that is not finite.
absl::Status FloatsFromBytes(const std::string& bytes, absl::string_view what,
                             std::vector<float>* out);

// A job's members on the replication stream, both ways. From proto: as
// given (the job checks them: Membership::CheckReplicated).
void MembersToProto(
    const std::vector<MemberInfo>& members,
    google::protobuf::RepeatedPtrField<v1::ReplicaMember>* proto);
std::vector<MemberInfo> MembersFromProto(
    const google::protobuf::RepeatedPtrField<v1::ReplicaMember>& proto);

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_REPLICA_APPLIER_H_
