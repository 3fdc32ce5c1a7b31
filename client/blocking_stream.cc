#include "client/blocking_stream.h"

#include "glog/logging.h"

namespace localsgd {
namespace {

// The tag of the operation in flight (there is at most one).
void* const kTag = reinterpret_cast<void*>(1);

}  // namespace

BlockingStream::BlockingStream(grpc::GenericStub* stub,
                               grpc::ClientContext* context,
                               const std::string& method)
    : context_(context), call_(stub->PrepareCall(context, method, &cq_)) {
  call_->StartCall(kTag);
  started_ = Await();
}

BlockingStream::~BlockingStream() {
  if (!finished_) {
    context_->TryCancel();
    Finish();
  }
  cq_.Shutdown();
  void* tag;
  bool ok;
  while (cq_.Next(&tag, &ok)) {
  }
}

bool BlockingStream::Await() {
  void* tag = nullptr;
  bool ok = false;
  CHECK(cq_.Next(&tag, &ok) && tag == kTag)
      << "a BlockingStream's queue ended or gave another tag";
  return ok;
}

bool BlockingStream::Write(const grpc::ByteBuffer& message) {
  if (!started_) return false;
  call_->Write(message, kTag);
  return Await();
}

bool BlockingStream::WritesDone() {
  if (!started_) return false;
  call_->WritesDone(kTag);
  return Await();
}

bool BlockingStream::Read(grpc::ByteBuffer* message) {
  if (!started_) return false;
  call_->Read(message, kTag);
  return Await();
}

grpc::Status BlockingStream::Finish() {
  CHECK(!finished_) << "BlockingStream::Finish called twice";
  finished_ = true;
  grpc::Status status;
  call_->Finish(&status, kTag);
  Await();
  return status;
}

}  // namespace localsgd
