// The client's half of the Sync and FetchState stream protocols as explicit
// state machines, without gRPC: the mirror of the coordinator's
// (server/streams.h). Inputs are the stream's events (a message or chunk
// read, the reads ending, a write done); outputs are actions delivered to a
// sink: write a message, write a chunk, end the writes, read the next
// message, finish. The client's transport (client/replica.cc) only moves
// bytes between gRPC and a machine; tests/client/sync_stream_test.cc and
// the sync_client fuzzer (tests/fuzz) drive the same machines with
// scripted and arbitrary coordinator replies. Internal to the client
// library; not installed.
//
// Sync, from the member's side: the SyncHeader, then every local chunk of
// its contribution (each with its CRC32C; MemberState encodes it), then the
// reads: a SyncResult and every chunk of the result. Full duplex
// (SyncHeader.early_results): the result's chunks may come before the
// SyncResult and while the member still writes; with pacing
// (SyncStreamOptions.max_lead_chunks) chunk c is written only while
// c < result chunks received + lead once the first result chunk is back.
//
//   write side:  kHeader --done--> kChunks (chunk 0 .. n-1, one at a time;
//                kPaced while the lead is used up) --> kWritesDone --> kDone
//                (a failed write: kDone; the reads end with the call)
//   read side:   kAwaitResult --SyncResult--> kReceiving
//                (early chunks are taken in kAwaitResult too)
//   either --refusal--> kFinish(cancel, error)
//   reads end --> kFinish(no cancel); then Conclude(call status)
//
// Every check the member makes of what comes back lives here, each a
// refusal with INTERNAL (the coordinator broke the protocol; not retried)
// unless said otherwise: a chunk before the SyncResult (without early
// results), a second SyncResult, a message with neither, early chunks and
// then a result that is not a delta, a payload that does not fit the job, a
// chunk out of range, repeated, without CRC32C, of the wrong size, or that
// does not decode; DATA_LOSS (retried) for a chunk that fails its CRC32C;
// UNAVAILABLE (retried) for a stream that ends without its result or with
// chunks missing.
//
// Sink contract: actions are delivered synchronously from the input that
// caused them, at most one write and one read outstanding; the sink must
// not call the machine back from inside. kFinish is delivered exactly once
// and nothing follows it; after it the owner ends the call (cancelling it
// when the action says so) and asks Conclude for the Sync's status.
#ifndef LOCALSGD_CLIENT_SYNC_STREAM_H_
#define LOCALSGD_CLIENT_SYNC_STREAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/member_state.h"
#include "localsgd/v1/coordinator.pb.h"
#include "proto/chunk.h"
#include "src/clock.h"
#include "src/layout.h"

namespace localsgd {

struct ClientStreamAction {
  enum class Kind {
    kWriteMessage,  // write `message` (a serialized request)
    kWriteChunk,    // write chunk `index`: `payload` with `crc32c`
    kWritesDone,    // half-close
    kRead,          // read the next message
    kFinish,        // the machine is done; cancel the call if `cancel`
  };
  static ClientStreamAction Of(Kind kind) {
    ClientStreamAction action;
    action.kind = kind;
    return action;
  }
  // kFinish: cancel the call with `error`, or (OK) end it as it ends.
  static ClientStreamAction Finish(absl::Status error) {
    ClientStreamAction action = Of(Kind::kFinish);
    action.cancel = !error.ok();
    action.status = std::move(error);
    return action;
  }

  Kind kind = Kind::kRead;
  std::string message;
  uint32_t index = 0;
  uint32_t crc32c = 0;
  // The payload's bytes; the writer holds it until they are sent.
  std::shared_ptr<std::string> payload;
  // kFinish: a refusal (the error is `status`); the call is to be cancelled.
  bool cancel = false;
  absl::Status status;
};
using ClientStreamSink = std::function<void(ClientStreamAction)>;

// Collects the chunks of one state or result stream where `dest` says, each
// exactly once.
class ChunkReceiver {
 public:
  // `dest(i)`: where chunk i's values go (i < num_chunks).
  ChunkReceiver(absl::string_view what, uint32_t num_chunks, WireCode wire,
                std::function<absl::Span<float>(uint32_t)> dest);

  // What the chunks are: values in `wire`; or, with `base`, a delta in
  // `wire` that goes to dest(i) as base(i) + decoded, element by element.
  void Expect(WireCode wire,
              std::function<absl::Span<const float>(uint32_t)> base);

  // INTERNAL for an index out of range or repeated, a missing CRC32C, a
  // wrong size or a payload that does not decode; DATA_LOSS for data that
  // does not match its CRC32C.
  absl::Status Add(const ChunkPieces& chunk);
  // UNAVAILABLE unless every chunk arrived.
  absl::Status CheckComplete() const;

  uint64_t bytes() const { return bytes_; }
  uint32_t received() const { return received_; }

 private:
  const std::string what_;
  WireCode wire_;
  const std::function<absl::Span<float>(uint32_t)> dest_;
  std::function<absl::Span<const float>(uint32_t)> base_;
  std::vector<bool> got_;
  uint32_t received_ = 0;
  uint64_t bytes_ = 0;
};

// Buffers for chunk payloads on their way out. The writer holds each until
// it has sent it; then it is handed out again, so payloads go through warm
// memory instead of a fresh allocation per message. Used by one thread.
class StagingPool {
 public:
  // A buffer of `bytes` bytes that no writer holds.
  std::shared_ptr<std::string> Get(size_t bytes);

 private:
  // More than the chunks one stream's flow-control window holds.
  static constexpr size_t kMaxBuffers = 16;
  std::vector<std::shared_ptr<std::string>> buffers_;
};

// UNAVAILABLE: the coordinator at `address` ("" if unknown) answered for
// `epoch`, below the epoch `seen` already for its shard (a deposed primary,
// proto: SyncResult.epoch).
absl::Status StaleEpochError(absl::string_view address, uint64_t epoch,
                             uint64_t seen);

// What a Sync stream is asked to do besides its plan.
struct SyncStreamOptions {
  std::string job_id;
  MemberId member_id;
  uint64_t layout_fingerprint = 0;
  // Full duplex (ClientOptions::early_results); only a delta asks for it.
  bool early_results = false;
  // Pacing: 0 for none (ClientOptions::max_lead_chunks, where the job
  // allows it: Replica decides).
  uint64_t max_lead_chunks = 0;
  // The highest epoch seen for the shard: a result of a lower one is
  // refused (UNAVAILABLE, nothing applied). 0 without an election.
  uint64_t min_epoch = 0;
  // Each early result chunk once decoded: its local index and its values
  // (ClientOptions::on_early_result). Null: none.
  std::function<void(uint32_t j, absl::Span<const float> values)> on_early;
};

// One attempt of a Sync. Not thread-safe: one thread feeds it.
class SyncClientStream {
 public:
  enum class WritePhase { kHeader, kChunks, kPaced, kWritesDone, kDone };
  enum class ReadPhase { kAwaitResult, kReceiving, kEnded };

  // `member` (in a Sync: BeginSync and BeginAttempt called), `staging` and
  // `clock` must outlive the machine.
  SyncClientStream(MemberState* member, StagingPool* staging, Clock* clock,
                   SyncStreamOptions options, ClientStreamSink sink);
  SyncClientStream(const SyncClientStream&) = delete;
  SyncClientStream& operator=(const SyncClientStream&) = delete;

  // Writes the header and asks for the first message.
  void Start();
  // A write completed (`ok`) or failed (the call broke).
  void OnWriteDone(bool ok);
  // A chunk message read (in place; the pieces need to stay valid only
  // during the call).
  void OnChunk(const ChunkPieces& chunk);
  // Another message read.
  void OnMessage(const v1::SyncResponse& message);
  // A message that does not parse (`status` says why).
  void OnUnreadable(const absl::Status& status);
  // The reads ended (the end of the stream, or the call broke).
  void OnReadsDone();

  // After kFinish and the end of the call with `call_status`: the Sync's
  // status. OK means the result is complete in the member's state.
  absl::Status Conclude(const absl::Status& call_status);

  // How the round ended and what it cost (valid after an OK Conclude;
  // bytes and times as far as the attempt got).
  const SyncOutcome& outcome() const { return outcome_; }
  WritePhase write_phase() const { return write_phase_; }
  ReadPhase read_phase() const { return read_phase_; }
  bool finished() const { return finished_; }

 private:
  bool MayWrite() const;
  // Writes chunk next_ or ends the writes, or waits for results (paced).
  void WriteNextOrWait();
  void WriteNext();
  absl::Status TakeChunk(const ChunkPieces& chunk);
  absl::Status TakeResult(const v1::SyncResponse& message);
  // Sets up the receiver for what the SyncResult says follows.
  absl::Status ExpectResult(const v1::SyncResult& result);
  // After a message taken: the next read, and a paced write it released.
  void AfterRead(absl::Status taken);
  // A refusal: finishes cancelling the call.
  void Fail(absl::Status error);
  // kFinish with `status` (OK: the reads ended), after the outcome's bytes
  // and time.
  void Finish(absl::Status status);

  MemberState* const member_;
  StagingPool* const staging_;
  Clock* const clock_;
  const SyncStreamOptions options_;
  const ClientStreamSink sink_;
  const bool early_;
  ChunkReceiver chunks_;
  absl::Time start_;
  WritePhase write_phase_ = WritePhase::kHeader;
  ReadPhase read_phase_ = ReadPhase::kAwaitResult;
  uint32_t next_ = 0;  // the next chunk to write
  bool have_result_ = false;
  bool finished_ = false;
  absl::Status error_;
  SyncOutcome outcome_;
};

// One attempt of a FetchState: the request, then a StateHeader and every
// chunk of the shard's state, into MemberState::FetchSlice. Refusals
// (INTERNAL unless said): a chunk before the header, a second header, a
// header with the wrong chunk count, a message with neither, the chunk
// checks of ChunkReceiver (DATA_LOSS for a CRC32C mismatch), and
// UNAVAILABLE for a stream that ends with chunks missing. The same sink
// contract as SyncClientStream. Not thread-safe.
class FetchStateClientStream {
 public:
  // A header of a lower epoch than `min_epoch` is refused as
  // SyncStreamOptions::min_epoch says.
  FetchStateClientStream(MemberState* member, absl::Span<float> params,
                         v1::FetchStateRequest request, ClientStreamSink sink,
                         uint64_t min_epoch = 0);

  void Start();
  void OnChunk(const ChunkPieces& chunk);
  void OnMessage(const v1::FetchStateResponse& message);
  void OnUnreadable(const absl::Status& status);
  void OnReadsDone();
  absl::Status Conclude(const absl::Status& call_status);

  // The state's round and id (valid after an OK Conclude).
  RoundId round() const { return round_; }
  uint64_t state_id() const { return state_id_; }
  // The epoch its header carried.
  uint64_t epoch() const { return epoch_; }
  bool finished() const { return finished_; }

 private:
  void After(absl::Status taken);

  MemberState* const member_;
  const v1::FetchStateRequest request_;
  const ClientStreamSink sink_;
  ChunkReceiver chunks_;
  bool header_ = false;
  bool finished_ = false;
  absl::Status error_;
  RoundId round_ = 0;
  uint64_t state_id_ = 0;
  const uint64_t min_epoch_;
  uint64_t epoch_ = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_SYNC_STREAM_H_
