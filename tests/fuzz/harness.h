// The replay engine of the libFuzzer targets: an in-process Coordinator on a
// FakeClock, driven by the steps of tests/fuzz/fuzz_input.proto through the
// server's protocol layer, with invariants checked after every step.
// Single-threaded: every core callback runs on the calling thread, so each
// step's effects are complete when it returns.
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
// Every call goes through the server's own protocol layer, the code the
// gRPC service runs: the unary handlers of server/protocol.h and the Sync and
// FetchState state machines of server/streams.h, whose actions the harness
// carries out as a gRPC reactor would (a read only when the machine asks for
// one, one write at a time, nothing after the finish). It checks the bytes
// the machines write: the result header, then every chunk of the state in
// order, each the wire form of the state with its CRC32C.
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
#include "server/state_wire.h"
#include "server/streams.h"
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
  // What a member reads from a stream: the machine's actions, carried out
  // as a reactor would, and checked.
  struct Reader {
    bool fetch = false;                 // a FetchState stream (else Sync)
    bool read_wanted = false;           // the machine asked for a message
    std::optional<StreamAction> write;  // the write in flight
    bool finished = false;
    absl::Status status;
    bool header_read = false;
    v1::SyncResponse sync_header;         // Sync
    v1::FetchStateResponse fetch_header;  // FetchState
    uint32_t chunks_read = 0;
    std::shared_ptr<const StateWire> wire;  // of the chunks read
  };
  struct Stream {
    JobModel* model = nullptr;  // once the machine accepted the header
    std::string member_id;
    Reader reader;
    std::unique_ptr<SyncServerStream> machine;
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
  std::shared_ptr<Stream> NewStream();
  // Feeds a message to the stream, if its machine asked for one.
  void OnSyncMessage(const std::shared_ptr<Stream>& stream,
                     const v1::SyncRequest& request);
  void EndStream(const std::shared_ptr<Stream>& stream);
  void CancelStream(const std::shared_ptr<Stream>& stream);
  // A machine's action: checked and recorded.
  void Act(Reader& reader, StreamAction action);
  // Completes the writes in flight until the machine stops writing,
  // checking each (CheckWrite).
  template <typename Machine>
  void Pump(Reader& reader, Machine& machine, const JobModel* model);
  void CheckWrite(Reader& reader, const JobModel* model);
  void CheckSyncEnd(const Stream& stream);
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

  FakeClock clock_;
  EventLog events_;
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  WireCache wires_;
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
