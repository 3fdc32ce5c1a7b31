// A streaming call of raw messages (grpc::ByteBuffer) through gRPC's public
// generic stub, driven synchronously on its own completion queue: one
// operation at a time, each waited for. The client's Sync and FetchState
// use it (their chunk messages are written and read without protobuf copies,
// proto/chunk_wire.h), instead of gRPC's internal call factories. Internal to
// the client library; not installed.
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
  // Starts `method` ("/package.Service/Method") with `context`, which must
  // outlive the stream. Any streaming method: a server-streaming call is
  // its one request written, then WritesDone.
  BlockingStream(grpc::GenericStub* stub, grpc::ClientContext* context,
                 const std::string& method);
  // Cancels the call if Finish was not called, and waits for it to end.
  ~BlockingStream();
  BlockingStream(const BlockingStream&) = delete;
  BlockingStream& operator=(const BlockingStream&) = delete;

  // False once the call is broken (Finish tells why). The message is
  // serialized (its slices referenced) before Write returns.
  bool Write(const grpc::ByteBuffer& message);
  bool WritesDone();
  // The next message; false at the end of the stream or when it broke.
  bool Read(grpc::ByteBuffer* message);
  // The call's status (after reading to the end, or to end it early after
  // a TryCancel of the context). Once.
  grpc::Status Finish();

 private:
  // Waits for the completion of the one operation in flight.
  bool Await();

  grpc::ClientContext* const context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
};

}  // namespace localsgd

#endif  // LOCALSGD_CLIENT_BLOCKING_STREAM_H_
