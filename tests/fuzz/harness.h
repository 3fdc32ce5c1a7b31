// The replay engine of the libFuzzer targets: an in-process Coordinator on a
// FakeClock, driven by the steps of tests/fuzz/fuzz_input.proto exactly the
// way server/service.cc decodes and applies the RPCs, with invariants checked
// after every step. Single-threaded: every core callback runs on the calling
// thread, so each step's effects are complete when it returns.
//
// Invariants (a violation prints what and aborts, which libFuzzer reports as
// a crash and saves the input):
//  - every call ends with one of the status codes its RPC documents in
//    proto/localsgd/v1/coordinator.proto, with a non-empty message;
//  - a successful Join answers consistently (well-formed member id, the
//    requested settings, geometry of the layout) and a retried Join (same
//    name and incarnation) returns the same member;
//  - every closed round's state has one finite-or-explained value per
//    element: when every participant contributed completely, each chunk is
//    the weighted mean (double precision, fp32 tolerance) of the first chunk
//    each contributor gave for it; otherwise each value lies in the range of
//    the chunk values members gave for that round and the previous state;
//    the seed is exactly one of the seeding data sent;
//  - Sync results and FetchState streams carry that state, chunk by chunk,
//    in the wire dtype, with the CRC32C of each chunk.
//
// Decode logic that lives inside the reactors of server/service.cc (header
// and chunk order, fingerprint and CRC checks, end of stream) is mirrored
// here; see the comments marked MIRROR.
#ifndef LOCALSGD_TESTS_FUZZ_HARNESS_H_
#define LOCALSGD_TESTS_FUZZ_HARNESS_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fuzz_input.pb.h"
#include "localsgd/v1/coordinator.pb.h"
#include "src/clock.h"
#include "src/coordinator.h"
#include "src/job.h"
#include "src/observer.h"

namespace localsgd {
namespace fuzz {

// Silences the core's logging (a Join logs a line) and the like; call once
// from LLVMFuzzerInitialize.
void InitFuzzing();

class Harness {
 public:
  explicit Harness(const Config& config);
  ~Harness();
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  // Creates job "job" with the prologue's members (and seed). Does nothing
  // for an empty prologue.
  void RunPrologue(const Prologue& prologue);
  void Apply(const Step& step);
  // Applies one Join; if `retry`, repeats a successful one, which must
  // return the same member (named members only).
  void ApplyJoin(const JoinStep& step, bool retry);
  // Cancels the open streams and checks what is left.
  void Finish();

 private:
  struct Member {
    std::string job_id;
    std::string id;
    std::string name;
    float weight = 1;
  };
  struct JobModel {
    std::shared_ptr<Job> job;
    // The state last observed (after the seed or a round closed).
    bool has_state = false;
    RoundId state_round = 0;
    bool state_known = false;
    std::vector<float> state;
    // Round r >= 1: chunk -> member id -> the first data the member's
    // Syncs for r gave for the chunk (accepted, before r closed).
    std::map<RoundId, std::map<uint32_t, std::map<std::string, std::string>>>
        first;
    // Round 0: chunk -> every accepted seed payload.
    std::map<uint32_t, std::vector<std::string>> seed_data;
  };
  // MIRROR of SyncReactor (server/service.cc): its state and transitions.
  struct Stream {
    JobModel* model = nullptr;
    std::string job_id;
    std::string member_id;
    bool header_seen = false;
    std::unique_ptr<SyncSession> session;
    bool callback_pending = false;
    bool reads_done = false;
    bool finished = false;
    absl::Status error;
    std::optional<absl::StatusOr<SyncResult>> result;
  };
  class EventLog : public CoordinatorObserver {
   public:
    void RoundClosed(const RoundClosedEvent& event) override {
      events.push_back(event);
    }
    std::vector<RoundClosedEvent> events;
  };

  const Member* Ref(uint32_t ref) const;
  JobModel* ModelOf(const std::string& job_id);
  std::shared_ptr<Stream>& Slot(uint32_t index);

  absl::Status DoJoin(const v1::JoinRequest& request, std::string* member_id);
  void OnSyncMessage(const std::shared_ptr<Stream>& stream,
                     const v1::SyncRequest& request);
  absl::Status OnHeader(const std::shared_ptr<Stream>& stream,
                        const v1::SyncHeader& header);
  absl::Status OnChunk(Stream& stream, const v1::Chunk& chunk);
  void EndStream(const std::shared_ptr<Stream>& stream);
  void CancelStream(const std::shared_ptr<Stream>& stream);
  void Fail(Stream& stream, absl::Status status);
  void Advance(Stream& stream);
  void FinishStream(Stream& stream, const absl::Status& status);
  void DoLeave(const MemberCall& call);
  void DoHeartbeat(const MemberCall& call);
  void DoFetch(const FetchCall& call);
  void DoStatus(const v1::GetJobStatusRequest& request);
  void DoRound(const RoundMacro& round);
  // A complete, well-formed Sync of `member` for `round` with values from
  // `seed`, on a stream kept in `internal_streams_`.
  void HonestSync(const Member& member, RoundId round, uint32_t seed);

  // Checks the rounds that closed during the last step and updates models.
  void ProcessEvents();
  void CheckRound(JobModel& model, const RoundClosedEvent& event,
                  const std::vector<float>& values);
  // Checks `state` streamed in chunks as FetchState and Sync send it.
  void CheckStreamedState(const JobModel& model, const StateSnapshot& state);

  FakeClock clock_;
  EventLog events_;
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  std::vector<Member> members_;
  std::map<std::string, JobModel> jobs_;
  std::array<std::shared_ptr<Stream>, 8> streams_;
  std::vector<std::shared_ptr<Stream>> internal_streams_;
  int probes_ = 0;
  size_t prologue_members_ = 0;
};

}  // namespace fuzz
}  // namespace localsgd

#endif  // LOCALSGD_TESTS_FUZZ_HARNESS_H_
