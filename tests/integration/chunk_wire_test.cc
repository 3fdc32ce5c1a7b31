// Chunk messages without protobuf copies (proto/chunk_wire.h): what
// ChunkMessage writes is what protobuf reads, what protobuf writes is what
// ParseChunkMessage reads (however gRPC slices it), anything else is left to
// protobuf; and the service, which registers Sync and FetchState raw, still
// implements every method of localsgd.v1.Coordinator.
#include "proto/chunk_wire.h"

#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/generic_stub.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.pb.h"
#include "server/server.h"
#include "src/crc32c.h"

namespace localsgd {
namespace {

std::string Bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

// The whole buffer as one string.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// `bytes` cut into slices at `cuts` random places (empty slices included),
// as gRPC's transport hands over a message read in many pieces.
grpc::ByteBuffer Sliced(const std::string& bytes, int cuts, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<size_t> at = {0, bytes.size()};
  for (int i = 0; i < cuts; ++i) {
    at.push_back(bytes.empty() ? 0 : gen() % (bytes.size() + 1));
  }
  std::sort(at.begin(), at.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    slices.emplace_back(bytes.data() + at[i], at[i + 1] - at[i]);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const ChunkView& view) {
  std::string out(view.size, '\0');
  view.CopyTo(out.data());
  return out;
}

struct Shape {
  uint32_t index;
  size_t size;
};

class ChunkWireTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ChunkWireTest, ChunkMessage_ProtobufReadsTheSameChunk) {
  const Shape shape = GetParam();
  const std::string data = Bytes(shape.size, shape.index);
  const uint32_t crc = Crc32c(0, data);
  auto owner = std::make_shared<std::string>(data);
  const grpc::ByteBuffer buffer = ChunkMessage(shape.index, crc, *owner, owner);
  const std::string wire = Flatten(buffer);

  v1::SyncRequest request;
  ASSERT_TRUE(request.ParseFromString(wire));
  ASSERT_TRUE(request.has_chunk());
  EXPECT_EQ(request.chunk().index(), shape.index);
  EXPECT_EQ(request.chunk().data(), data);
  ASSERT_TRUE(request.chunk().has_crc32c());
  EXPECT_EQ(request.chunk().crc32c(), crc);
  v1::SyncResponse response;
  ASSERT_TRUE(response.ParseFromString(wire));
  EXPECT_EQ(response.chunk().data(), data);
  v1::FetchStateResponse state;
  ASSERT_TRUE(state.ParseFromString(wire));
  EXPECT_EQ(state.chunk().index(), shape.index);
  EXPECT_EQ(state.chunk().crc32c(), crc);
}

TEST_P(ChunkWireTest, Parse_ProtobufSerializedInManySlices_SameChunkInPlace) {
  const Shape shape = GetParam();
  v1::SyncResponse response;
  response.mutable_chunk()->set_index(shape.index);
  response.mutable_chunk()->set_data(Bytes(shape.size, shape.index + 7));
  response.mutable_chunk()->set_crc32c(0xDEADBEEF);
  const std::string wire = response.SerializeAsString();
  for (int cuts : {0, 1, 5, 200}) {
    for (uint32_t seed = 0; seed < 4; ++seed) {
      const grpc::ByteBuffer buffer = Sliced(wire, cuts, seed);
      ChunkView view;
      ASSERT_EQ(ParseChunkMessage(buffer, &view), ChunkParse::kChunk)
          << cuts << " cuts, seed " << seed;
      EXPECT_EQ(view.index, shape.index);
      ASSERT_TRUE(view.has_crc32c);
      EXPECT_EQ(view.crc32c, 0xDEADBEEFu);
      EXPECT_EQ(view.size, shape.size);
      EXPECT_EQ(Joined(view), response.chunk().data());
      EXPECT_EQ(view.ComputeCrc32c(), Crc32c(0, response.chunk().data()));
    }
  }
}

TEST_P(ChunkWireTest, RoundTrip_ChunkMessageThenParse) {
  const Shape shape = GetParam();
  auto owner = std::make_shared<std::string>(Bytes(shape.size, 99));
  const grpc::ByteBuffer buffer = ChunkMessage(shape.index, 42, *owner, owner);
  ChunkView view;
  ASSERT_EQ(ParseChunkMessage(buffer, &view), ChunkParse::kChunk);
  EXPECT_EQ(view.index, shape.index);
  EXPECT_EQ(view.crc32c, 42u);
  EXPECT_EQ(Joined(view), *owner);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChunkWireTest,
    ::testing::Values(Shape{0, 1}, Shape{1, 127}, Shape{127, 128},
                      Shape{128, 300}, Shape{16383, 16384},
                      Shape{16384, 1 << 20}, Shape{UINT32_MAX, 4}),
    [](const ::testing::TestParamInfo<Shape>& info) {
      return absl::StrCat("index", info.param.index, "_bytes", info.param.size);
    });

TEST(ChunkWireTest, ChunkMessage_OwnerLivesUntilGrpcDropsTheSlice) {
  auto owner = std::make_shared<std::string>(Bytes(1000, 1));
  std::weak_ptr<std::string> watch = owner;
  const absl::string_view data = *owner;
  {
    grpc::ByteBuffer buffer = ChunkMessage(3, 0, data, std::move(owner));
    grpc::ByteBuffer copy = buffer;  // gRPC shares slices the same way
    buffer.Clear();
    EXPECT_FALSE(watch.expired());
    EXPECT_EQ(Flatten(copy).substr(Flatten(copy).size() - 1000),
              std::string(data));
  }
  EXPECT_TRUE(watch.expired());
}

// Messages protobuf reads differently or that are not a chunk: the caller
// must parse them with protobuf (and gets what protobuf says).
TEST(ChunkWireTest, Parse_NotPlain_LeftToProtobuf) {
  std::vector<std::pair<std::string, std::string>> cases;
  {
    v1::SyncRequest header;
    header.mutable_header()->set_job_id("j");
    cases.emplace_back("header", header.SerializeAsString());
  }
  cases.emplace_back("empty message", "");
  v1::SyncRequest plain;
  plain.mutable_chunk()->set_index(5);
  plain.mutable_chunk()->set_data("abcd");
  plain.mutable_chunk()->set_crc32c(7);
  const std::string chunk_body = plain.chunk().SerializeAsString();
  auto wrap = [](const std::string& body) {
    return absl::StrCat("\x12", std::string(1, static_cast<char>(body.size())),
                        body);
  };
  // Repeated scalar: protobuf keeps the last.
  cases.emplace_back("index twice", wrap(chunk_body + std::string("\x08\x06")));
  // Unknown field inside the chunk.
  cases.emplace_back("unknown field",
                     wrap(chunk_body + std::string("\x20\x01", 2)));
  // An index varint beyond 32 bits (protobuf truncates it).
  cases.emplace_back("64-bit index",
                     wrap(std::string("\x08\x80\x80\x80\x80\x10\x12\x01x", 9)));
  // The chunk field twice at the top level (protobuf merges them).
  cases.emplace_back("chunk twice", wrap(chunk_body) + wrap(chunk_body));
  // A length beyond the message.
  cases.emplace_back("truncated", wrap(chunk_body).substr(0, 6));
  cases.emplace_back("data length beyond chunk", wrap(std::string("\x12\x09"
                                                                  "abc",
                                                                  5)));
  // Overlong varints (found by chunk_wire_fuzzer): protobuf refuses a size
  // varint of more than 5 bytes, and decides the rest itself.
  cases.emplace_back(
      "overlong chunk size",
      std::string("\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x00", 11));
  cases.emplace_back("overlong index",
                     wrap(std::string("\x08\x85\x00\x12\x01x", 6)));
  for (const auto& [name, wire] : cases) {
    for (int cuts : {0, 3}) {
      ChunkView view;
      EXPECT_EQ(ParseChunkMessage(Sliced(wire, cuts, 1), &view),
                ChunkParse::kNotPlain)
          << name;
    }
  }
}

TEST(ChunkWireTest, Parse_ChunkWithoutCrcOrData_IsPlainAndSaysSo) {
  v1::SyncResponse response;
  response.mutable_chunk()->set_index(9);
  ChunkView view;
  ASSERT_EQ(
      ParseChunkMessage(Sliced(response.SerializeAsString(), 0, 0), &view),
      ChunkParse::kChunk);
  EXPECT_EQ(view.index, 9u);
  EXPECT_FALSE(view.has_crc32c);
  EXPECT_EQ(view.size, 0u);
}

TEST(ChunkWireTest, ParseMessage_Garbage_InvalidArgumentNamingIt) {
  const grpc::ByteBuffer garbage = Sliced(std::string("\x0a\xff\xff", 3), 0, 0);
  v1::SyncRequest request;
  const absl::Status s = ParseMessage(garbage, &request, "Sync message");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("Sync message of 3 bytes does not parse as "
                             "localsgd.v1.SyncRequest"),
            std::string::npos)
      << s;
}

// One message through a generic (raw) call of `method`; the call's status.
grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& channel,
                     const std::string& method) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(20));
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t id) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), id);
    return ok;
  };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, method, &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(1)) {
    // An empty message (zero bytes; a default ByteBuffer is no message).
    grpc::Slice empty;
    call->Write(grpc::ByteBuffer(&empty, 1), reinterpret_cast<void*>(2));
    if (step(2)) {
      call->WritesDone(reinterpret_cast<void*>(3));
      step(3);
    }
  }
  grpc::ByteBuffer response;
  for (;;) {
    call->Read(&response, reinterpret_cast<void*>(4));
    if (!step(4)) break;
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

TEST(CoordinatorServiceTest, EveryMethodOfTheProto_IsImplemented) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials());
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "localsgd.v1.Coordinator");
  ASSERT_NE(service, nullptr);
  ASSERT_GE(service->method_count(), 6);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string method = absl::StrCat("/", service->full_name(), "/",
                                            service->method(i)->name());
    const grpc::Status status = CallRaw(channel, method);
    // An empty request is refused one way or another, but not as unknown.
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << method << ": " << status.error_message();
  }
  // What a missing method looks like.
  EXPECT_EQ(
      CallRaw(channel, "/localsgd.v1.Coordinator/NoSuchMethod").error_code(),
      grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace localsgd
