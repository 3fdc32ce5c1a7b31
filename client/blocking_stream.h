// A streaming call of raw messages (grpc::ByteBuffer) through gRPC's public
// generic stub, driven on its own completion queue. The client's Sync and
// FetchState use it (their chunk messages are written and read without
// protobuf copies, proto/chunk_wire.h), instead of gRPC's internal call
// factories. Internal to the client library; not installed.
//
// Two ways to drive it, not to be mixed within one phase of a call:
//  - blocking: Write / WritesDone / Read, each waited for, one at a time;
//  - full duplex: at most one write (StartWrite or StartWritesDone) and one
//    read (StartRead) in flight at once, and Next() says which completed.
#ifndef LOCALSGD_CLIENT_BLOCKING_STREAM_H_
#define LOCALSGD_CLIENT_BLOCKING_STREAM_H_

#include <memory>
#include <string>

#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"

namespace localsgd {

class BlockingStream {
 public:
  enum class Op { kWrite, kRead };
  struct Completion {
    Op op = Op::kWrite;
    // False for a write: the call is broken; for a read: the end of the
    // stream, or it broke (Finish tells which).
    bool ok = false;
  };

  // Starts `method` ("/package.Service/Method") with `context`, which must
  // outlive the stream. Any streaming method: a server-streaming call is
  // its one request written, then WritesDone.
  BlockingStream(grpc::GenericStub* stub, grpc::ClientContext* context,
                 const std::string& method);
  // Cancels the call if Finish was not called, and waits for it to end.
  ~BlockingStream();
  BlockingStream(const BlockingStream&) = delete;
  BlockingStream& operator=(const BlockingStream&) = delete;

  // Blocking. False once the call is broken (Finish tells why). The message
  // is serialized (its slices referenced) before Write returns.
  bool Write(const grpc::ByteBuffer& message);
  bool WritesDone();
  // The next message; false at the end of the stream or when it broke.
  bool Read(grpc::ByteBuffer* message);

  // Full duplex. Whether the call started (false: every Start is refused
  // and Finish tells why).
  bool started() const { return started_; }
  // Starts a write of `message` (serialized before it returns) or the end
  // of the writes; requires no write in flight.
  void StartWrite(const grpc::ByteBuffer& message);
  void StartWritesDone();
  // Starts a read into `message`, which must stay put until its
  // completion; requires no read in flight.
  void StartRead(grpc::ByteBuffer* message);
  bool write_pending() const { return write_pending_; }
  bool read_pending() const { return read_pending_; }
  // Waits for the next operation in flight to complete. Requires one.
  Completion Next();

  // The call's status (after reading to the end, or to end it early after
  // a TryCancel of the context); operations still in flight complete first.
  // Once.
  grpc::Status Finish();

 private:
  // Waits for the completion of `tag`, absorbing the completions of any
  // other operation in flight.
  bool Await(void* tag);
  void Completed(void* tag);

  grpc::ClientContext* const context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
  bool write_pending_ = false;
  bool read_pending_ = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_BLOCKING_STREAM_H_
