// ShardEndpoints (client/endpoints.h): which address of a shard calls go
// to, the move on UNAVAILABLE, and the epoch fence against a deposed
// primary; ClientOptions' address lists. No server: channels connect lazily
// and nothing here calls them.
#include "client/endpoints.h"

#include <memory>

#include "absl/status/status.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<ShardEndpoints> Two() {
  absl::StatusOr<std::unique_ptr<ShardEndpoints>> e =
      ShardEndpoints::Create({"127.0.0.1:1", "127.0.0.1:2"}, ChannelSecurity{},
                             grpc::ChannelArguments());
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

TEST(ShardEndpointsTest, Unavailable_MovesToTheNextInTurn) {
  auto e = Two();
  ASSERT_NE(e, nullptr);
  const std::shared_ptr<Connection> first = e->current();
  EXPECT_EQ(first->address, "127.0.0.1:1");
  EXPECT_FALSE(e->OnCallFailed(*first, absl::NotFoundError("job")));
  EXPECT_EQ(e->address(), "127.0.0.1:1");
  EXPECT_TRUE(e->OnCallFailed(*first, absl::UnavailableError("standby")));
  EXPECT_EQ(e->address(), "127.0.0.1:2");
  // A concurrent call on the old connection finds it moved already.
  EXPECT_TRUE(e->OnCallFailed(*first, absl::UnavailableError("gone")));
  EXPECT_EQ(e->address(), "127.0.0.1:2");
  EXPECT_TRUE(e->OnCallFailed(*e->current(), absl::UnavailableError("x")));
  EXPECT_EQ(e->address(), "127.0.0.1:1");
}

TEST(ShardEndpointsTest, OneAddress_NeverMoves) {
  absl::StatusOr<std::unique_ptr<ShardEndpoints>> e = ShardEndpoints::Create(
      {"127.0.0.1:1"}, ChannelSecurity{}, grpc::ChannelArguments());
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(
      (*e)->OnCallFailed(*(*e)->current(), absl::UnavailableError("down")));
}

TEST(ShardEndpointsTest, Epoch_OnlyGrows_ALowerOneIsRefused) {
  auto e = Two();
  ASSERT_NE(e, nullptr);
  const std::shared_ptr<Connection> c = e->current();
  EXPECT_EQ(e->epoch(), 0u);
  EXPECT_TRUE(e->CheckEpoch(*c, 0).ok());  // no election
  EXPECT_TRUE(e->CheckEpoch(*c, 12).ok());
  EXPECT_EQ(e->epoch(), 12u);
  EXPECT_TRUE(e->CheckEpoch(*c, 12).ok());
  const absl::Status stale = e->CheckEpoch(*c, 7);
  EXPECT_EQ(stale.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(stale.message()),
              HasSubstr("127.0.0.1:1 answered for epoch 7, older than epoch "
                        "12"));
  EXPECT_EQ(e->epoch(), 12u);
  EXPECT_TRUE(e->CheckEpoch(*c, 20).ok());
  EXPECT_EQ(e->epoch(), 20u);
}

TEST(ClientOptionsTest, ShardWithStandbys_IsOneReplica) {
  ClientOptions o;
  o.target = "127.0.0.1:1|127.0.0.1:2";
  o.job_id = "j";
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->num_replicas(), 1u);
  o.target.clear();
  o.replicas = {"127.0.0.1:1|127.0.0.1:2", "127.0.0.1:3"};
  c = Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->num_replicas(), 2u);
}

TEST(ClientOptionsTest, EmptyAddressInAList_IsInvalidArgument) {
  ClientOptions o;
  o.job_id = "j";
  o.target = "127.0.0.1:1||127.0.0.1:2";
  EXPECT_THAT(std::string(o.Validate().message()),
              HasSubstr("target has an empty address in '127.0.0.1:1||"));
  o.target.clear();
  o.replicas = {"127.0.0.1:1|"};
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.Validate().message()),
              HasSubstr("replicas has an empty address in '127.0.0.1:1|'"));
}

}  // namespace
}  // namespace localsgd
