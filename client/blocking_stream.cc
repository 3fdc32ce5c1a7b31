#include "client/blocking_stream.h"

#include "glog/logging.h"

namespace localsgd {
namespace {

// Tags of the operations: a write (or WritesDone), a read, and the call's
// start and finish (waited for alone).
void* const kWriteTag = reinterpret_cast<void*>(1);
void* const kReadTag = reinterpret_cast<void*>(2);
void* const kCallTag = reinterpret_cast<void*>(3);

}  // namespace

BlockingStream::BlockingStream(grpc::GenericStub* stub,
                               grpc::ClientContext* context,
                               const std::string& method)
    : context_(context), call_(stub->PrepareCall(context, method, &cq_)) {
  call_->StartCall(kCallTag);
  started_ = Await(kCallTag);
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

void BlockingStream::Completed(void* tag) {
  if (tag == kWriteTag) {
    write_pending_ = false;
  } else if (tag == kReadTag) {
    read_pending_ = false;
  }
}

bool BlockingStream::Await(void* tag) {
  while (true) {
    void* got = nullptr;
    bool ok = false;
    CHECK(cq_.Next(&got, &ok)) << "a BlockingStream's queue ended";
    CHECK(got == kWriteTag || got == kReadTag || got == kCallTag)
        << "a BlockingStream's queue gave an unknown tag";
    Completed(got);
    if (got == tag) return ok;
  }
}

BlockingStream::Completion BlockingStream::Next() {
  CHECK(write_pending_ || read_pending_)
      << "BlockingStream::Next with nothing in flight";
  void* got = nullptr;
  bool ok = false;
  CHECK(cq_.Next(&got, &ok)) << "a BlockingStream's queue ended";
  CHECK(got == kWriteTag || got == kReadTag)
      << "a BlockingStream's queue gave an unexpected tag";
  Completed(got);
  return {got == kWriteTag ? Op::kWrite : Op::kRead, ok};
}

void BlockingStream::StartWrite(const grpc::ByteBuffer& message) {
  CHECK(started_ && !write_pending_);
  write_pending_ = true;
  call_->Write(message, kWriteTag);
}

void BlockingStream::StartWritesDone() {
  CHECK(started_ && !write_pending_);
  write_pending_ = true;
  call_->WritesDone(kWriteTag);
}

void BlockingStream::StartRead(grpc::ByteBuffer* message) {
  CHECK(started_ && !read_pending_);
  read_pending_ = true;
  call_->Read(message, kReadTag);
}

bool BlockingStream::Write(const grpc::ByteBuffer& message) {
  if (!started_) return false;
  StartWrite(message);
  return Await(kWriteTag);
}

bool BlockingStream::WritesDone() {
  if (!started_) return false;
  StartWritesDone();
  return Await(kWriteTag);
}

bool BlockingStream::Read(grpc::ByteBuffer* message) {
  if (!started_) return false;
  StartRead(message);
  return Await(kReadTag);
}

grpc::Status BlockingStream::Finish() {
  CHECK(!finished_) << "BlockingStream::Finish called twice";
  finished_ = true;
  // Operations in flight complete first (a cancelled call ends them).
  while (write_pending_) Await(kWriteTag);
  while (read_pending_) Await(kReadTag);
  grpc::Status status;
  call_->Finish(&status, kCallTag);
  Await(kCallTag);
  return status;
}

}  // namespace localsgd
