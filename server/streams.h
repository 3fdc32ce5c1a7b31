// The Sync and FetchState stream protocols of the coordinator as explicit
// state machines, without gRPC. Inputs are the stream's events (a message
// read, the reads ending, a write done, a cancel, the round's result from
// the core); outputs are actions delivered to a sink: read the next message,
// write a message, write a chunk of the state, finish with a status. A gRPC
// reactor (server/service.cc) only moves bytes between gRPC and a machine;
// the fuzz harness (tests/fuzz) drives the same machines directly.
//
// Sync, from the member's side: a SyncHeader {job, member, round,
// layout_fingerprint}, then every chunk of its contribution (each with its
// CRC32C), then it reads the result: a SyncResult header and every chunk of
// the new state. The machine:
//
//   kAwaitHeader --header--> kOpening (checks; Job::BeginSync) --> kReceiving
//   kReceiving --chunk--> kReceiving | (all chunks in) kAwaitResult
//   kAwaitResult --result--> kSending (result header, chunk 0 .. n-1)
//   any --error--> kDraining (the core's callback or a write is still due)
//                  --> kFinished
//   kSending --last write done--> kFinished (OK)
//
// The round's result may come at any time after BeginSync (a late member's
// at once); it is sent only once every chunk has been read, as the protocol
// says. Full duplex (SyncHeader.early_results, pseudo-gradient jobs): from
// kOpening on, the chunks of the round's result that the core says are
// final (Job::BeginSync's on_final) are written as they come, one write at
// a time, while the member's chunks are still read; the result header then
// waits for the write in flight, and kSending sends the chunks not sent
// yet. The first error (a bad message, a chunk that does not apply, the
// client leaving or cancelling) ends the stream with that status once no
// callback of the core is pending; a result that is an error ends it with
// that. Every check the coordinator makes of a stream lives here: the
// member's admission (credentials, stream limit, through StreamAdmission),
// the job and member, the layout fingerprint, each chunk's CRC32C, the
// chunk itself (SyncSession::AddChunk).
//
// Sink contract (both machines): kRead, kWriteMessage and kWriteChunk are
// delivered while the machine's lock is held, and the sink must not call the
// machine back from inside (start the read or write, return). kFinish is
// delivered exactly once, without the lock, and is the machine's last act on
// that thread: the sink may destroy the machine (and its owner) in it.
// Nothing is delivered after kFinish.
#ifndef LOCALSGD_SERVER_STREAMS_H_
#define LOCALSGD_SERVER_STREAMS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "localsgd/v1/coordinator.pb.h"
#include "proto/chunk.h"
#include "server/state_wire.h"
#include "src/coordinator.h"
#include "src/job.h"

namespace localsgd {

struct StreamAction {
  enum class Kind {
    kRead,          // read the next message
    kWriteMessage,  // write `message` (a serialized response)
    kWriteChunk,    // write chunk `index` of `wire`: `chunk` (data, CRC32C)
    kFinish,        // finish the call with `status`
  };
  Kind kind = Kind::kRead;
  std::string message;
  uint32_t index = 0;
  StateWire::Chunk chunk;
  // Owns `chunk.data`; hold it until the bytes are sent.
  std::shared_ptr<const StateWire> wire;
  absl::Status status;
};
using StreamSink = std::function<void(StreamAction)>;

// Admits a stream of member `member_hex` of job `job_id` (the security
// layer: credentials, the member's binding, the per-member stream limit).
// What it returns is held while the stream lives and dropped just before
// kFinish is delivered. Null: every stream is admitted.
using StreamAdmission = std::function<absl::StatusOr<std::shared_ptr<void>>(
    const std::string& job_id, const std::string& member_hex)>;

// One Sync stream. Thread-safe: gRPC's reactions and the core's callback
// arrive on different threads; reads are sequential, writes are sequential.
class SyncServerStream {
 public:
  enum class Phase {
    kAwaitHeader,
    kOpening,
    kReceiving,
    kAwaitResult,
    kSending,
    kDraining,
    kFinished,
  };

  // `coordinator` and `wires` must outlive the machine.
  SyncServerStream(Coordinator* coordinator, WireCache* wires,
                   StreamAdmission admit, StreamSink sink);
  SyncServerStream(const SyncServerStream&) = delete;
  SyncServerStream& operator=(const SyncServerStream&) = delete;

  // Asks for the first message (kRead).
  void Start() ABSL_LOCKS_EXCLUDED(mu_);

  // A message read: a header or a chunk, parsed by protobuf.
  void OnMessage(const v1::SyncRequest& message) ABSL_LOCKS_EXCLUDED(mu_);
  // A chunk message read in place (proto/chunk_wire.h); the pieces need to
  // stay valid only during the call.
  void OnChunk(const ChunkPieces& chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // A message that does not parse (INVALID_ARGUMENT saying so).
  void OnUnreadable(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // The client half-closed, or a read failed.
  void OnReadsDone() ABSL_LOCKS_EXCLUDED(mu_);
  // The last write completed (`ok`) or failed (the client went away).
  void OnWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // The client cancelled the call.
  void OnCancel() ABSL_LOCKS_EXCLUDED(mu_);
  // The core: chunks `indices` of the round's result are final in `next`
  // (with early results only).
  void OnFinalChunks(std::vector<uint32_t> indices,
                     std::shared_ptr<const StateSnapshot> next)
      ABSL_LOCKS_EXCLUDED(mu_);

  Phase phase() const ABSL_LOCKS_EXCLUDED(mu_);
  // The job, once the header was accepted; else null.
  std::shared_ptr<Job> job() const ABSL_LOCKS_EXCLUDED(mu_);
  // The round the header named, once accepted; else 0.
  RoundId round() const ABSL_LOCKS_EXCLUDED(mu_);
  // The first error of the stream (OK if none so far).
  absl::Status error() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Finish {
    absl::Status status;
    std::shared_ptr<void> admission;
  };
  // How the core's on_final calls reach the machine: detached (stream
  // null) before kFinish, waiting for a call under way.
  struct FinalLink {
    absl::Mutex mu;
    SyncServerStream* stream ABSL_GUARDED_BY(mu) = nullptr;
  };

  void OnHeader(const v1::SyncHeader& header) ABSL_LOCKS_EXCLUDED(mu_);
  void OnResult(absl::StatusOr<SyncResult> result) ABSL_LOCKS_EXCLUDED(mu_);
  // Records the first error and withdraws the core's callback if it can.
  void FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next step after any event; a Finish when it is time to finish.
  std::optional<Finish> AdvanceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<Finish> FinishLocked(absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteChunkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the next final chunk queued and not sent, if any.
  void WriteEarlyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round's result is in while the member still writes: every chunk
  // not sent yet goes out early (a delta result of the early chunks' state).
  void SendRestEarlyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The early chunks (wire_, not null) are of the result (result_, OK).
  bool EarlyWireFitsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INTERNAL, and a DFATAL log: they are not.
  absl::Status EarlyMismatchLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool result_ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return phase_ == Phase::kAwaitResult && result_.has_value();
  }
  // Delivers kFinish: the last use of `this`.
  void Deliver(std::optional<Finish> finish) ABSL_LOCKS_EXCLUDED(mu_);

  Coordinator* const coordinator_;
  WireCache* const wires_;
  const StreamAdmission admit_;
  const StreamSink sink_;

  mutable absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kAwaitHeader;
  std::shared_ptr<void> admission_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Job> job_ ABSL_GUARDED_BY(mu_);
  // Used by the read path outside mu_ (reads are sequential); set and
  // cancelled under it.
  std::unique_ptr<SyncSession> session_ ABSL_GUARDED_BY(mu_);
  bool callback_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::StatusOr<SyncResult>> result_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const StateWire> wire_ ABSL_GUARDED_BY(mu_);
  uint32_t next_chunk_ ABSL_GUARDED_BY(mu_) = 0;
  // A write is in flight (one at a time).
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Full duplex: the link the core's on_final calls come through, the final
  // chunks not written yet, and which chunks of wire_ went out.
  std::shared_ptr<FinalLink> link_ ABSL_GUARDED_BY(mu_);
  std::deque<uint32_t> final_queue_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> sent_ ABSL_GUARDED_BY(mu_);
  // SendRestEarlyLocked queued every chunk not sent.
  bool rest_queued_ ABSL_GUARDED_BY(mu_) = false;
};

// One FetchState stream: the request, then a StateHeader and every chunk of
// the job's current state. Not thread-safe (gRPC's write reactions are
// sequential).
class FetchStateServerStream {
 public:
  enum class Phase { kAwaitRequest, kSending, kFinished };

  // `coordinator` and `wires` must outlive the machine.
  FetchStateServerStream(Coordinator* coordinator, WireCache* wires,
                         StreamAdmission admit, StreamSink sink);

  // The request: admission, job, member, fingerprint; then the header.
  void Start(const v1::FetchStateRequest& request);
  // The request does not parse.
  void OnUnreadable(absl::Status status);
  void OnWriteDone(bool ok);

  Phase phase() const { return phase_; }
  std::shared_ptr<Job> job() const { return job_; }

 private:
  void Finish(absl::Status status);

  Coordinator* const coordinator_;
  WireCache* const wires_;
  const StreamAdmission admit_;
  const StreamSink sink_;
  Phase phase_ = Phase::kAwaitRequest;
  std::shared_ptr<void> admission_;
  std::shared_ptr<Job> job_;
  std::shared_ptr<const StateWire> wire_;
  uint32_t next_chunk_ = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_STREAMS_H_
