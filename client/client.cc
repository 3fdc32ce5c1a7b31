#include "client/client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/blocking_stream.h"
#include "client/credentials.h"
#include "client/rejoin_policy.h"
#include "client/retry.h"
#include "glog/logging.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "proto/chunk_wire.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/member_ref.h"
#include "src/settings.h"

namespace localsgd {
namespace {

// Waits for a retry on a channel: until the deadline while the channel is
// READY (the coordinator answered, with an error), else until it connects
// again or the deadline, whichever comes first.
class ChannelWaiter final : public RetryWaiter {
 public:
  explicit ChannelWaiter(grpc::Channel* channel) : channel_(channel) {}
  void WaitUntil(absl::Time wake) override {
    if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
      absl::SleepFor(wake - absl::Now());
    } else {
      channel_->WaitForConnected(absl::ToChronoTime(wake));
    }
  }

 private:
  grpc::Channel* const channel_;
};

// Collects the chunks of one state or result stream where `dest` says, each
// exactly once.
class ChunkReceiver {
 public:
  // `dest(i)`: where chunk i's values go.
  ChunkReceiver(absl::string_view what, const ChunkGeometry& geometry,
                DType wire, std::function<absl::Span<float>(uint32_t)> dest)
      : what_(what),
        wire_(wire),
        dest_(std::move(dest)),
        got_(geometry.num_chunks(), false) {}

  // What the chunks are, once the stream's header said it: values in
  // `wire`; or, with `base`, a delta in `wire` that goes to dest(i) as
  // base(i) + decoded, element by element (a pseudo-gradient job's result).
  void Expect(DType wire,
              std::function<absl::Span<const float>(uint32_t)> base) {
    wire_ = wire;
    base_ = std::move(base);
  }

  // INTERNAL for an index out of range or repeated, or a wrong size;
  // DATA_LOSS (retryable) for data that does not match its CRC32C.
  absl::Status Add(const ChunkView& chunk) {
    const uint32_t i = chunk.index;
    if (i >= got_.size() || got_[i]) {
      return absl::InternalError(
          absl::StrCat(what_, " stream out of order at chunk ", i));
    }
    if (!chunk.has_crc32c) {
      return absl::InternalError(
          absl::StrCat(what_, " chunk ", i, " has no crc32c"));
    }
    const absl::Span<float> dest = dest_(i);
    if (chunk.size != WireBytes(wire_, dest.size())) {
      return absl::InternalError(
          absl::StrCat(what_, " chunk ", i, " has ", chunk.size,
                       " bytes; expected ", WireBytes(wire_, dest.size()), " (",
                       dest.size(), " ", DTypeName(wire_), " values)"));
    }
    if (chunk.ComputeCrc32c() != chunk.crc32c) {
      return absl::DataLossError(absl::StrCat(
          what_, " chunk ", i, " does not match its CRC32C; fetching again"));
    }
    if (base_ == nullptr && wire_ == DType::kFloat32) {
      // The wire bytes are the values' bytes (EncodeValuesTo): straight from
      // gRPC's slices into place.
      chunk.CopyTo(reinterpret_cast<char*>(dest.data()));
    } else {
      // Decoded from the slices in place (an element cut between two is
      // assembled apart; a blockwise payload in several slices is made
      // contiguous first, its scales sitting apart from its codes); a delta
      // onto its base as it is read, in one pass, as the coordinator
      // computed its state.
      absl::Status s =
          base_ == nullptr
              ? DecodeValuesPieces(chunk.pieces, wire_, dest)
              : DecodeOntoPieces(chunk.pieces, wire_, base_(i), dest);
      if (!s.ok()) {
        return absl::InternalError(absl::StrCat(what_, ": ", s.message()));
      }
    }
    got_[i] = true;
    ++received_;
    bytes_ += chunk.size;
    return absl::OkStatus();
  }

  // UNAVAILABLE (retryable) unless every chunk arrived.
  absl::Status CheckComplete() const {
    if (received_ == got_.size()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        what_, " ended after ", received_, " of ", got_.size(), " chunks"));
  }

  uint64_t bytes() const { return bytes_; }
  uint32_t received() const { return received_; }

 private:
  const std::string what_;
  DType wire_;
  const std::function<absl::Span<float>(uint32_t)> dest_;
  std::function<absl::Span<const float>(uint32_t)> base_;
  std::vector<bool> got_;
  uint32_t received_ = 0;
  uint64_t bytes_ = 0;
};

// Reads the messages of a raw stream: a chunk (read in place from gRPC's
// slices when the message is a plain chunk, else parsed by protobuf) or
// another `Message`.
template <typename Message>
class RawReader {
 public:
  // Reads the next message. False at the end of the stream.
  template <typename Stream>
  bool Read(Stream& stream) {
    return stream.Read(&raw_);
  }
  // Where a full-duplex read (BlockingStream::StartRead) puts the message.
  grpc::ByteBuffer* buffer() { return &raw_; }
  // Whether it is a chunk (then chunk() holds it); otherwise message()
  // holds it. INTERNAL if it does not parse.
  absl::StatusOr<bool> Parse(absl::string_view what) {
    if (ParseChunkMessage(raw_, &chunk_) == ChunkParse::kChunk) return true;
    chunk_ = ChunkView();
    if (absl::Status s = ParseMessage(raw_, &message_, what); !s.ok()) {
      return absl::InternalError(s.message());
    }
    if (!message_.has_chunk()) return false;
    chunk_ = ViewOf(message_.chunk());
    return true;
  }
  const ChunkView& chunk() const { return chunk_; }
  const Message& message() const { return message_; }

 private:
  grpc::ByteBuffer raw_;
  ChunkView chunk_;
  Message message_;
};

// Buffers for chunk payloads on their way out. gRPC holds each until it has
// sent it (ChunkMessage); then it is handed out again, so payloads go through
// warm memory instead of a fresh allocation per message. Used by one thread.
class StagingPool {
 public:
  // A buffer of at least `bytes` bytes that gRPC no longer reads.
  std::shared_ptr<std::string> Get(size_t bytes) {
    for (std::shared_ptr<std::string>& buffer : buffers_) {
      if (buffer.use_count() == 1) {
        // gRPC's last reference went with a release decrement: pair it, so
        // its reads of the old payload happen before the writes that follow.
        std::atomic_thread_fence(std::memory_order_acquire);
        buffer->resize(bytes);
        return buffer;
      }
    }
    auto buffer = std::make_shared<std::string>(bytes, '\0');
    // All in flight: keep up to kMaxBuffers; beyond that a transient one.
    if (buffers_.size() < kMaxBuffers) buffers_.push_back(buffer);
    return buffer;
  }

 private:
  // More than the chunks one stream's flow-control window holds.
  static constexpr size_t kMaxBuffers = 16;
  std::vector<std::shared_ptr<std::string>> buffers_;
};

// The full name of a Coordinator method ("/localsgd.v1.Coordinator/Sync"),
// read from the generated descriptor.
std::string MethodPath(absl::string_view method) {
  const google::protobuf::ServiceDescriptor* service =
      v1::SyncRequest::descriptor()->file()->FindServiceByName("Coordinator");
  CHECK(service != nullptr && service->FindMethodByName(std::string(method)))
      << "localsgd.v1.Coordinator has no method " << method;
  return absl::StrCat("/", service->full_name(), "/", method);
}

// Ends a client stream: on a local `error` cancels the call and returns the
// error; otherwise returns the call's status.
absl::Status FinishStream(grpc::ClientContext& context, BlockingStream& stream,
                          const absl::Status& error) {
  if (!error.ok()) {
    context.TryCancel();
    stream.Finish();
    return error;
  }
  return FromGrpcStatus(stream.Finish());
}

std::string DefaultMemberName() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat(host[0] ? host : "unknown-host", "/", getpid());
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

absl::Status ClientOptions::Validate() const {
  if (target.empty() && replicas.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.target and ClientOptions.replicas are both empty");
  }
  if (resolve_replicas && !replicas.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.resolve_replicas resolves `target`; it does not go "
        "with an explicit `replicas` list");
  }
  for (const std::string& r : replicas) {
    if (r.empty()) {
      return absl::InvalidArgumentError(
          "ClientOptions.replicas has an empty address");
    }
  }
  if (job_id.empty()) {
    return absl::InvalidArgumentError("ClientOptions.job_id is empty");
  }
  if (!(weight >= 1e-6) || weight > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.weight must be in [1e-6, 1e6]; got ", weight));
  }
  // Only what any coordinator refuses: its own limits it checks at Join.
  SettingsLimits any;
  any.max_chunk_elements = ~uint32_t{0};
  any.max_members = ~uint32_t{0};
  if (absl::Status s =
          ValidateSetFields(settings, any, "ClientOptions.settings: ");
      !s.ok()) {
    return s;
  }
  if (rpc_timeout <= absl::ZeroDuration() ||
      sync_timeout <= absl::ZeroDuration() ||
      initial_backoff <= absl::ZeroDuration() ||
      max_backoff < initial_backoff) {
    return absl::InvalidArgumentError(
        "ClientOptions timeouts and backoffs must be positive, "
        "max_backoff >= initial_backoff");
  }
  return security.Validate("ClientOptions.security.");
}

// One coordinator replica: its channel, this process's membership there
// (member id, heartbeats) and the chunks of the layout it owns. Without
// sharding the client has exactly one, owning every chunk.
//
// Thread-safety: Client drives a replica from one thread at a time (its own
// in ForEachReplica); the heartbeat thread touches only mu_-guarded fields.
class Client::Replica {
 public:
  Replica(const ClientOptions& options, std::string address,
          std::shared_ptr<grpc::Channel> channel, uint64_t incarnation)
      : options_(options),
        address_(std::move(address)),
        channel_(std::move(channel)),
        stub_(v1::Coordinator::NewStub(channel_)),
        generic_(channel_),
        incarnation_(incarnation) {}

  ~Replica() { StopHeartbeats(); }

  const std::string& address() const { return address_; }
  const JoinInfo& info() const { return info_; }
  ShardSpec shard() const { return shard_; }
  RoundId state_round() const { return state_round_; }
  bool joined() const { return !info_.member_id.empty(); }

  // Joins with `layout` (whole model of `total` elements). `expect_shard`:
  // the shard this replica held before (a re-join), to check it still does.
  absl::Status Join(const Layout& layout, uint64_t total,
                    const ShardSpec* expect_shard) {
    StopHeartbeats();
    v1::JoinRequest request;
    request.set_job_id(options_.job_id);
    request.set_member_name(options_.member_name);
    request.set_weight(options_.weight);
    request.set_incarnation(incarnation_);
    LayoutToProto(layout, request.mutable_layout());
    JobSettings settings = options_.settings;
    // A client always says what it sends (CONTRIBUTION_UNSPECIFIED is how
    // a coordinator recognises a client that predates pseudo-gradients).
    if (settings.contribution == Contribution::kUnspecified) {
      settings.contribution = Contribution::kPseudoGradients;
    }
    SettingsToProto(settings, request.mutable_settings());

    v1::JoinResponse response;
    absl::Status status = WithRetries("Join", [&] {
      grpc::ClientContext context;
      SetDeadline(&context, options_.rpc_timeout);
      return FromGrpcStatus(stub_->Join(&context, request, &response));
    });
    if (!status.ok()) return status;

    absl::StatusOr<JoinInfo> parsed = JoinInfoFromProto(response);
    if (!parsed.ok()) {
      return absl::InternalError(absl::StrCat(
          "coordinator ", address_, ": Join response does not parse (",
          parsed.status().message(), "); is it a compatible version?"));
    }
    const JoinInfo info = *std::move(parsed);
    if (!IsWireDType(info.settings.wire_dtype) ||
        info.settings.chunk_elements == 0 || info.num_chunks == 0 ||
        info.lease_ttl <= absl::ZeroDuration()) {
      return absl::InternalError(absl::StrCat(
          "coordinator ", address_,
          ": Join response is malformed (wire dtype, chunk size or lease); "
          "is it a compatible version?"));
    }
    const ShardSpec shard = info.shard;
    if (shard.index >= shard.count) {
      return absl::InternalError(absl::StrCat("coordinator ", address_,
                                              " says it is shard ", shard.index,
                                              " of ", shard.count));
    }
    if (expect_shard != nullptr && !(shard == *expect_shard)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator ", address_, " was shard ", expect_shard->index, " of ",
          expect_shard->count, " and now says it is shard ", shard.index,
          " of ", shard.count,
          "; were the replicas restarted with other "
          "--shard_index/--shard_count?"));
    }
    const uint64_t want =
        ShardElements(total, info.settings.chunk_elements, shard);
    if (info.num_elements != want) {
      return absl::InternalError(absl::StrCat(
          "coordinator ", address_, " (shard ", shard.index, " of ",
          shard.count, ") holds ", info.num_elements, " elements of the ",
          total, "-element layout; its chunks of ",
          info.settings.chunk_elements, " make ", want));
    }
    info_ = info;
    shard_ = shard;
    global_ = ChunkGeometry(total, info.settings.chunk_elements);
    local_ = ChunkGeometry(info.num_elements, info.settings.chunk_elements);
    state_round_ = info.state_round;
    pseudo_gradients_ =
        info.settings.contribution == Contribution::kPseudoGradients;
    if (pseudo_gradients_) {
      anchor_.resize(local_.num_elements());
      next_.resize(local_.num_elements());
      if (info.settings.wire_dtype != DType::kFloat32) {
        residual_.resize(local_.num_elements(), 0.0f);
      }
    }
    StartHeartbeats(info_.member_id, info_.lease_ttl / 3);
    LOG(INFO) << "joined job " << options_.job_id << " at " << address_
              << (shard.count > 1 ? absl::StrCat(" (shard ", shard.index,
                                                 " of ", shard.count, ")")
                                  : std::string())
              << " as " << options_.member_name << " (member_ref "
              << MemberRef(info_.member_id) << "); "
              << (info_.has_state
                      ? absl::StrCat("state at round ", info_.state_round)
                      : std::string("no state yet"));
    return absl::OkStatus();
  }

  // Seeds this replica's chunks of `params` or fetches them.
  absl::Status Initialize(const Layout& layout, absl::Span<float> params) {
    if (info_.has_state) return FetchState(layout, params).status();
    absl::StatusOr<SyncOutcome> outcome = SyncRound(layout, 0, params);
    if (!outcome.ok()) return outcome.status();
    LOG(INFO) << (outcome->contributed ? "seeded" : "adopted the seed of")
              << " job " << options_.job_id << " at " << address_
              << " (state round " << outcome->round << ")";
    return absl::OkStatus();
  }

  absl::StatusOr<RoundId> FetchState(const Layout& layout,
                                     absl::Span<float> params) {
    RoundId round = 0;
    uint64_t state_id = 0;
    absl::Status status = WithRetries("FetchState", [&]() -> absl::Status {
      v1::FetchStateRequest request;
      request.set_job_id(options_.job_id);
      request.set_member_id(info_.member_id.str());
      request.set_layout_fingerprint(layout.fingerprint);
      grpc::ClientContext context;
      SetDeadline(&context, options_.sync_timeout);
      BlockingStream reader(&generic_, &context, fetch_state_path_);
      if (reader.Write(SerializeMessage(request))) reader.WritesDone();
      RawReader<v1::FetchStateResponse> in;
      // A pseudo-gradient job's state goes into next_ and becomes the
      // anchor and the parameters once the fetch succeeded, so a fetch
      // that fails leaves them as they were; a parameter job's straight
      // into `params` (a failed fetch is retried whole).
      ChunkReceiver chunks("FetchState", local_, StateDType(), [&](uint32_t j) {
        return pseudo_gradients_ ? NextSlice(j) : Slice(params, j);
      });
      bool header = false;
      absl::Status error;
      while (error.ok() && in.Read(reader)) {
        absl::StatusOr<bool> is_chunk = in.Parse("FetchState response");
        if (!is_chunk.ok()) {
          error = is_chunk.status();
          break;
        }
        if (*is_chunk) {
          error = header ? chunks.Add(in.chunk())
                         : absl::InternalError(
                               "FetchState sent a chunk before its header");
          continue;
        }
        const v1::FetchStateResponse& response = in.message();
        if (response.has_header()) {
          header = true;
          round = response.header().round();
          state_id = response.header().state_id();
          if (response.header().num_chunks() != local_.num_chunks()) {
            error = absl::InternalError(
                "FetchState header has the wrong chunk count");
          }
        } else {
          error = absl::InternalError(
              "FetchState sent a message with neither header nor chunk");
        }
      }
      if (absl::Status s = FinishStream(context, reader, error); !s.ok()) {
        return s;
      }
      return chunks.CheckComplete();
    });
    if (!status.ok()) return status;
    if (pseudo_gradients_) {
      if (state_id == 0) {
        return absl::InternalError(absl::StrCat(
            "coordinator ", address_,
            ": FetchState of a pseudo-gradient job names no state id"));
      }
      anchor_.swap(next_);
      SetAnchorId(state_id, /*contributed=*/false);
      CopyAnchorTo(params);
    }
    state_round_ = round;
    return round;
  }

  // Client::Sync for this replica's chunks, re-joining if needed.
  absl::StatusOr<SyncOutcome> Sync(const Layout& layout,
                                   absl::Span<float> params) {
    absl::StatusOr<SyncOutcome> outcome =
        SyncRound(layout, state_round_ + 1, params);
    // The coordinator forgot the member or the job, or is behind it
    // (rejoin_policy.h): joining again mends it.
    if (SyncNeedsRejoin(outcome.status())) {
      LOG(WARNING) << "job " << options_.job_id << " at " << address_ << ": "
                   << outcome.status().message() << "; joining again";
      outcome = Rejoin(layout, params);
    }
    return outcome;
  }

  absl::Status Leave() {
    StopHeartbeats();
    if (info_.member_id.empty()) return absl::OkStatus();
    v1::LeaveRequest request;
    request.set_job_id(options_.job_id);
    request.set_member_id(info_.member_id.str());
    v1::LeaveResponse response;
    grpc::ClientContext context;
    SetDeadline(&context, std::min(options_.rpc_timeout, absl::Seconds(5)));
    absl::Status status =
        FromGrpcStatus(stub_->Leave(&context, request, &response));
    info_.member_id = MemberId();
    if (status.ok()) {
      LOG(INFO) << "left job " << options_.job_id << " at " << address_;
    }
    return status;
  }

 private:
  // Elements of `params` that the replica's chunk `j` covers.
  absl::Span<float> Slice(absl::Span<float> params, uint32_t j) const {
    const uint32_t g = j * shard_.count + shard_.index;
    return params.subspan(global_.Offset(g), global_.Size(g));
  }
  absl::StatusOr<SyncOutcome> Rejoin(const Layout& layout,
                                     absl::Span<float> params) {
    const RoundId trained_from = state_round_;
    const uint32_t last_contributors = last_contributors_;
    const ShardSpec shard = shard_;
    if (absl::Status s = Join(layout, global_.num_elements(), &shard);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<SyncOutcome> outcome;
    const RejoinDecision decision =
        DecideRejoin(info_.has_state, info_.state_round, trained_from);
    switch (decision.action) {
      case RejoinAction::kReseedThenContribute:
        // The contributors count goes only with a seed round (a first seed
        // has neither).
        outcome = ReseedThenContribute(
            layout,
            SeedOrigin{trained_from, trained_from > 0 ? last_contributors : 0},
            params);
        break;
      case RejoinAction::kContribute:
        outcome = SyncRound(layout, decision.round, params);
        break;
      case RejoinAction::kAdopt: {
        absl::StatusOr<RoundId> round = FetchState(layout, params);
        if (!round.ok()) return round.status();
        outcome = SyncOutcome();
        outcome->round = *round;
        outcome->late = true;
        break;
      }
    }
    if (outcome.ok()) {
      outcome->rejoined = true;
      LOG(INFO) << "job " << options_.job_id << " at " << address_
                << ": joined again; now at round " << outcome->round
                << (outcome->contributed ? " (contributed)" : " (adopted)");
    } else if (state_round_ < trained_from) {
      // Join set the round to the job's (0 without state); nothing newer
      // arrived: the parameters still grew from `trained_from`, and the
      // next re-join (or re-seed) must say so.
      state_round_ = trained_from;
      last_contributors_ = last_contributors;
    }
    return outcome;
  }

  // The coordinator lost the job: re-seed it at `origin` (the round of the
  // state these parameters grew from, and how many contributed to it), or
  // adopt another member's re-seed, then contribute these parameters to its
  // next round, as the members that re-join after the seed do: so every
  // member takes part in that round and none waits for one that already
  // returned. The seed round keeps the job's numbering in step with the
  // other replicas, and the re-seeded job regathers until the contributors
  // are back or a lease has passed (SyncHeader.seed_round).
  //
  // In a pseudo-gradient job the seed is the anchor (the state the
  // parameters were trained from, which the other members hold too), named
  // by its id, and the parameters then go as a delta against it.
  absl::StatusOr<SyncOutcome> ReseedThenContribute(const Layout& layout,
                                                   SeedOrigin origin,
                                                   absl::Span<float> params) {
    // (A first seed, origin.round 0, seeds the parameters: there is no
    // state they were trained from that another member could hold.)
    if (pseudo_gradients_ && origin.round > 0) origin.state_id = anchor_id_;
    // A pseudo-gradient job's seed result becomes the anchor only; the
    // parameters stay this member's until it is known which they get.
    absl::StatusOr<SyncOutcome> outcome = SyncRound(
        layout, 0, params, origin, /*result_to_params=*/!pseudo_gradients_);
    if (!outcome.ok()) return outcome;
    if (outcome->round > origin.round ||
        (origin.state_id != 0 && outcome->state_id != origin.state_id)) {
      // Another member re-seeded from a newer state than these parameters
      // grew from (or from another state of that round): they are stale;
      // keep the adopted state (as kAdopt does).
      if (pseudo_gradients_) CopyAnchorTo(params);
      outcome->contributed = false;
      outcome->late = true;
      return outcome;
    }
    // A parameter job's seed result overwrote them; SyncRound kept them.
    if (!pseudo_gradients_) PutBackContribution(params);
    return SyncRound(layout, state_round_ + 1, params);
  }

  // Sends the replica's chunks of `params` for `round` (0: seed, continuing
  // `origin`) and stores the result in them.
  //
  // A pseudo-gradient job's result goes into next_ as it arrives and
  // becomes the anchor once the Sync succeeded; only then is it copied into
  // `params`, and not at all with `result_to_params` false (a re-seed, whose
  // caller decides). A parameter job's result goes straight into `params`,
  // each chunk's contribution kept (kept_) just before it is overwritten.
  // Either way a failed Sync leaves `params` as they were: a retry, a
  // re-join or a re-seed then sends this member's contribution, never a mix
  // of it and a result that the coordinator may have lost (a restart after
  // the round closed and before its checkpoint).
  absl::StatusOr<SyncOutcome> SyncRound(const Layout& layout, RoundId round,
                                        absl::Span<float> params,
                                        const SeedOrigin& origin = {},
                                        bool result_to_params = true) {
    const DType wire = info_.settings.wire_dtype;
    // What the chunks sent are: a pseudo-gradient job's seed (its first, or
    // a re-seed of the anchor) travels in float32, a delta in the wire
    // dtype (with this member's error feedback).
    const bool delta = pseudo_gradients_ && round != 0;
    const bool reseed_anchor = pseudo_gradients_ && round == 0 &&
                               origin.round > 0 && origin.state_id != 0;
    const DType send_dtype =
        pseudo_gradients_ && round == 0 ? DType::kFloat32 : wire;
    SyncOutcome outcome;
    if (!pseudo_gradients_) kept_.resize(local_.num_elements());
    kept_chunk_.assign(local_.num_chunks(), false);
    absl::Status status = WithRetries(
        absl::StrCat("Sync of round ", round), [&]() -> absl::Status {
          PutBackContribution(params);
          outcome = SyncOutcome();
          const absl::Time start = absl::Now();
          grpc::ClientContext context;
          SetDeadline(&context, options_.sync_timeout);
          BlockingStream stream(&generic_, &context, sync_path_);
          v1::SyncRequest request;
          v1::SyncHeader* header = request.mutable_header();
          header->set_job_id(options_.job_id);
          header->set_member_id(info_.member_id.str());
          header->set_round(round);
          header->set_seed_round(origin.round);
          header->set_seed_contributors(origin.contributors);
          header->set_layout_fingerprint(layout.fingerprint);
          if (delta) header->set_anchor_state_id(anchor_id_);
          if (reseed_anchor) header->set_seed_state_id(origin.state_id);
          if (delta && !residual_.empty()) residual_next_ = residual_;
          // Full duplex: one write and one read in flight, so that result
          // chunks that are final come back while the contribution still
          // goes out (SyncHeader.early_results).
          const bool early = delta && options_.early_results;
          header->set_early_results(early);
          RawReader<v1::SyncResponse> in;
          ChunkReceiver chunks("Sync result", local_, wire, [&](uint32_t j) {
            if (pseudo_gradients_) return NextSlice(j);
            const absl::Span<float> slice = Slice(params, j);
            if (!kept_chunk_[j]) {
              std::copy(slice.begin(), slice.end(),
                        kept_.begin() + local_.Offset(j));
              kept_chunk_[j] = true;
            }
            return slice;
          });
          if (early) {
            // Early chunks are the round's delta against the anchor.
            chunks.Expect(wire, [this](uint32_t j) { return AnchorSlice(j); });
          }
          bool have_header = false;
          absl::Status error;
          uint32_t next = 0;  // the next chunk to write
          bool writes_done = false;
          // A paced upload (ClientOptions::max_lead_chunks): the next write
          // waits for results; the coordinator sends every result chunk
          // early while this member still writes, also after the round
          // closed without it. Only where the round waits for every
          // participant anyway (no deadline): a paced member completes
          // its upload only as the slowest participant gives its chunks,
          // so a deadline, which needs complete members, could not close
          // the round without a slow or dead one.
          const bool pace =
              early && info_.paced_uploads &&
              info_.round_deadline == absl::ZeroDuration() &&
              info_.settings.deadline_mode != DeadlineMode::kAdaptive;
          const uint64_t lead = pace ? options_.max_lead_chunks : 0;
          bool write_waiting = false;
          auto may_write = [&] {
            return lead == 0 || chunks.received() == 0 ||
                   next == local_.num_chunks() ||
                   next < uint64_t{chunks.received()} + lead;
          };
          // Writes chunk `next` (or the end of the writes).
          auto write_next = [&] {
            if (next == local_.num_chunks()) {
              stream.StartWritesDone();
              writes_done = true;
              return;
            }
            const uint32_t c = next++;
            // A chunk whose result came back early is sent as it was.
            const absl::Span<const float> values =
                reseed_anchor    ? AnchorSlice(c)
                : kept_chunk_[c] ? absl::MakeConstSpan(kept_).subspan(
                                       local_.Offset(c), local_.Size(c))
                                 : Slice(params, c);
            const size_t bytes = WireBytes(send_dtype, values.size());
            std::shared_ptr<std::string> data = staging_.Get(bytes);
            if (delta) {
              EncodeDelta(c, values, wire, data->data());
            } else {
              EncodeValuesTo(values, send_dtype, data->data());
            }
            const uint32_t crc = Crc32c(0, *data);
            outcome.bytes_sent += bytes;
            const absl::string_view payload(*data);
            stream.StartWrite(ChunkMessage(c, crc, payload, std::move(data)));
          };
          // A message read: a result chunk or the result header.
          auto take = [&]() -> absl::Status {
            absl::StatusOr<bool> is_chunk = in.Parse("Sync response");
            if (!is_chunk.ok()) return is_chunk.status();
            if (*is_chunk) {
              if (!have_header && !early) {
                return absl::InternalError(
                    "Sync sent a chunk before its result");
              }
              if (chunks.received() == 0) {
                outcome.first_result_time = absl::Now() - start;
              }
              return chunks.Add(in.chunk());
            }
            const v1::SyncResponse& response = in.message();
            if (!response.has_result() || have_header) {
              return absl::InternalError(
                  have_header
                      ? "Sync sent a second result"
                      : "Sync sent a message with neither result nor chunk");
            }
            have_header = true;
            static_cast<RoundOutcome&>(outcome) =
                RoundOutcomeFromProto(response.result());
            if (chunks.received() > 0 &&
                response.result().payload() != v1::RESULT_PAYLOAD_DELTA) {
              return absl::InternalError(
                  "Sync sent early result chunks and then a result that is "
                  "not a delta");
            }
            return ExpectResult(response.result(), chunks);
          };
          if (stream.started()) {
            stream.StartWrite(SerializeMessage(request));
            stream.StartRead(in.buffer());
          }
          while (error.ok() &&
                 (stream.write_pending() || stream.read_pending())) {
            const BlockingStream::Completion done = stream.Next();
            if (done.op == BlockingStream::Op::kWrite) {
              // A failed write: the call broke; the read ends with it.
              if (done.ok && !writes_done) {
                if (may_write()) {
                  write_next();
                } else {
                  write_waiting = true;
                  ++outcome.paced_writes;
                }
              }
              if (done.ok && writes_done && !stream.write_pending() &&
                  outcome.upload_time == absl::ZeroDuration()) {
                outcome.upload_time = absl::Now() - start;
              }
              continue;
            }
            if (!done.ok) break;  // the end of the responses
            error = take();
            if (!error.ok()) break;
            stream.StartRead(in.buffer());
            if (write_waiting && may_write()) {
              write_waiting = false;
              write_next();
            }
          }
          outcome.bytes_received = chunks.bytes();
          outcome.result_time = absl::Now() - start;
          if (absl::Status s = FinishStream(context, stream, error); !s.ok()) {
            return s;
          }
          if (!have_header) {
            return absl::UnavailableError("Sync ended without its result");
          }
          return chunks.CheckComplete();
        });
    if (!status.ok()) {
      PutBackContribution(params);
      return status;
    }
    state_round_ = outcome.round;
    if (round != 0) last_contributors_ = outcome.contributors;
    if (pseudo_gradients_) {
      anchor_.swap(next_);
      SetAnchorId(outcome.state_id, delta && outcome.contributed);
      if (result_to_params) CopyAnchorTo(params);
    }
    return outcome;
  }

  // The dtype a state travels in (FetchState, a seed, a late result).
  DType StateDType() const {
    return pseudo_gradients_ ? DType::kFloat32 : info_.settings.wire_dtype;
  }

  // Sets `chunks` up for what a Sync result says follows. INTERNAL for a
  // payload that does not fit the job.
  absl::Status ExpectResult(const v1::SyncResult& result,
                            ChunkReceiver& chunks) {
    if (!pseudo_gradients_) {
      if (result.payload() != v1::RESULT_PAYLOAD_UNSPECIFIED) {
        return absl::InternalError(
            "Sync result of a parameter job says it carries a delta or a "
            "float32 state");
      }
      return absl::OkStatus();
    }
    if (result.state_id() == 0) {
      return absl::InternalError(
          "Sync result of a pseudo-gradient job names no state id");
    }
    switch (result.payload()) {
      case v1::RESULT_PAYLOAD_DELTA:
        chunks.Expect(info_.settings.wire_dtype,
                      [this](uint32_t j) { return AnchorSlice(j); });
        return absl::OkStatus();
      case v1::RESULT_PAYLOAD_STATE:
        chunks.Expect(DType::kFloat32, nullptr);
        return absl::OkStatus();
      default:
        return absl::InternalError(absl::StrCat(
            "Sync result of a pseudo-gradient job has payload ",
            result.payload(), "; is the coordinator a compatible version?"));
    }
  }

  // Chunk `j` of the delta params - anchor, encoded in `wire` with this
  // member's error feedback (residual_next_, committed by SetAnchorId if
  // the contribution counts).
  void EncodeDelta(uint32_t j, absl::Span<const float> params, DType wire,
                   char* out) {
    const absl::Span<const float> anchor = AnchorSlice(j);
    if (wire == DType::kFloat32) {
      // Nothing to round and no residual: the difference straight into the
      // payload (one pass; a float32 payload is the values' bytes).
      SubtractTo(params, anchor, out);
      return;
    }
    delta_.resize(params.size());
    SubtractTo(params, anchor, reinterpret_cast<char*>(delta_.data()));
    decoded_.resize(params.size());
    EncodeWithFeedback(delta_,
                       residual_next_.empty()
                           ? absl::Span<float>()
                           : absl::MakeSpan(residual_next_)
                                 .subspan(local_.Offset(j), params.size()),
                       wire, out, absl::MakeSpan(decoded_));
  }

  // The replica's chunk `j` of the anchor, and of the result in progress.
  absl::Span<const float> AnchorSlice(uint32_t j) const {
    return absl::MakeConstSpan(anchor_).subspan(local_.Offset(j),
                                                local_.Size(j));
  }
  absl::Span<float> NextSlice(uint32_t j) {
    return absl::MakeSpan(next_).subspan(local_.Offset(j), local_.Size(j));
  }

  // The replica's chunks of `params` become the anchor's.
  void CopyAnchorTo(absl::Span<float> params) const {
    for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
      const absl::Span<const float> from = AnchorSlice(j);
      std::copy(from.begin(), from.end(), Slice(params, j).begin());
    }
  }

  // The anchor now holds the state `id`. The error feedback carries on if
  // this member's delta was counted, and starts over otherwise (the
  // parameters it was about were replaced).
  void SetAnchorId(uint64_t id, bool contributed) {
    anchor_id_ = id;
    if (residual_.empty()) return;
    if (contributed) {
      residual_.swap(residual_next_);
    } else {
      std::fill(residual_.begin(), residual_.end(), 0.0f);
    }
  }

  // Puts back into `params` the contribution that the last SyncRound's
  // result overwrote (kept_), chunk by chunk.
  void PutBackContribution(absl::Span<float> params) {
    for (uint32_t j = 0; j < local_.num_chunks(); ++j) {
      if (!kept_chunk_[j]) continue;
      const auto from =
          absl::MakeConstSpan(kept_).subspan(local_.Offset(j), local_.Size(j));
      std::copy(from.begin(), from.end(), Slice(params, j).begin());
      kept_chunk_[j] = false;
    }
  }

  // Runs `attempt` with the retry policy of the options (client/retry.h),
  // waiting on the channel: a retry comes as soon as the coordinator is
  // reachable again (a restart), at the latest after the backoff.
  template <typename Fn>
  absl::Status WithRetries(absl::string_view what, Fn attempt) {
    RetryPolicy policy;
    policy.initial_backoff = options_.initial_backoff;
    policy.max_backoff = options_.max_backoff;
    policy.max_retry_time = options_.max_retry_time;
    ChannelWaiter waiter(channel_.get());
    return RunWithRetries(
        policy, *Clock::Real(), waiter,
        [this] {
          absl::MutexLock lock(&mu_);
          return absl::Uniform(gen_, 0.8, 1.2);
        },
        absl::StrCat(what, " at ", address_), attempt);
  }

  void StartHeartbeats(MemberId member, absl::Duration interval) {
    StopHeartbeats();
    {
      absl::MutexLock lock(&mu_);
      stop_ = false;
      member_ = std::move(member);
    }
    heartbeat_ = std::thread([this, interval] { HeartbeatLoop(interval); });
  }

  void StopHeartbeats() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (heartbeat_.joinable()) heartbeat_.join();
  }

  void HeartbeatLoop(absl::Duration interval) {
    absl::MutexLock lock(&mu_);
    while (true) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval);
      if (stop_) return;
      v1::HeartbeatRequest request;
      request.set_job_id(options_.job_id);
      request.set_member_id(member_.str());
      mu_.Unlock();
      v1::HeartbeatResponse response;
      grpc::ClientContext context;
      SetDeadline(&context, std::min(interval, options_.rpc_timeout));
      const grpc::Status status =
          stub_->Heartbeat(&context, request, &response);
      if (!status.ok()) {
        LOG(WARNING) << "heartbeat for job " << options_.job_id << " at "
                     << address_ << " failed: " << status.error_message();
      }
      mu_.Lock();
    }
  }

  const ClientOptions& options_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  // Sync and FetchState are called raw (grpc::ByteBuffer messages) through
  // the generic stub, as the service registers them, so that chunks go
  // without protobuf copies (proto/chunk_wire.h).
  const std::string sync_path_ = MethodPath("Sync");
  const std::string fetch_state_path_ = MethodPath("FetchState");
  grpc::GenericStub generic_;
  StagingPool staging_;
  // SyncRound of a parameter job: this member's contribution to chunks
  // whose result has been written over it in the current Sync (one model's
  // worth, reused; a pseudo-gradient job needs none, its result goes to
  // next_).
  std::vector<float> kept_;
  std::vector<bool> kept_chunk_;
  // Pseudo-gradient jobs: the state the parameters were trained from (this
  // replica's chunks, back to back) and its id; what the encoding of this
  // member's deltas has lost so far, and the same after the Sync in
  // progress (lossy wire dtypes only); scratch for one chunk.
  bool pseudo_gradients_ = false;
  std::vector<float> anchor_;
  // The result of the Sync in progress (this replica's chunks), the next
  // anchor; swapped with anchor_ when the Sync succeeds.
  std::vector<float> next_;
  uint64_t anchor_id_ = 0;
  std::vector<float> residual_;
  std::vector<float> residual_next_;
  std::vector<float> delta_;
  std::vector<float> decoded_;
  const uint64_t incarnation_;
  JoinInfo info_;
  ShardSpec shard_;
  ChunkGeometry global_;  // the whole layout
  ChunkGeometry local_;   // this replica's chunks, back to back
  RoundId state_round_ = 0;
  // Contributors of the last round this member saw close here (a re-seed
  // waits for as many: SeedOrigin).
  uint32_t last_contributors_ = 0;
  std::thread heartbeat_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = true;
  MemberId member_ ABSL_GUARDED_BY(mu_);
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::vector<std::string>> ResolveReplicaAddresses(
    absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", host_port, "' has no port; replicas resolve from host:port"));
  }
  std::string host(host_port.substr(0, colon));
  const std::string port(host_port.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host_port, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr,
                ip, sizeof(ip));
      out.push_back(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6,
                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip,
                sizeof(ip));
      out.push_back(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(result);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) {
    return absl::UnavailableError(
        absl::StrCat("'", host_port, "' resolves to no address"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.member_name.empty()) options.member_name = DefaultMemberName();
  std::vector<std::string> addresses = options.replicas;
  if (options.resolve_replicas) {
    absl::StatusOr<std::vector<std::string>> resolved =
        ResolveReplicaAddresses(options.target);
    if (!resolved.ok()) return resolved.status();
    addresses = *std::move(resolved);
    LOG(INFO) << options.target << " resolves to " << addresses.size()
              << " coordinator replicas: " << absl::StrJoin(addresses, ", ");
  }
  if (addresses.empty()) addresses.push_back(options.target);

  grpc::ChannelArguments args;
  // Results come back in chunks of the job's size; allow the largest the
  // coordinator may use, not INT_MAX.
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // gRPC's default reconnect backoff grows to 120 s, and while it waits every
  // call fails at once: a worker would miss a restarted coordinator by
  // seconds. Reconnect quickly instead; the coordinator is one address.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  uint64_t incarnation = 0;
  {
    absl::BitGen gen;
    while (incarnation == 0) incarnation = absl::Uniform<uint64_t>(gen);
  }
  auto client = std::unique_ptr<Client>(new Client(std::move(options)));
  const ChannelSecurity& security = client->options_.security;
  for (std::string& address : addresses) {
    // TLS, token: credentials.h. With several replicas, one channel (one
    // connection) each: they are different servers.
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        CreateSecureChannel(address, security, args);
    if (!channel.ok()) return channel.status();
    client->replicas_.push_back(
        std::make_unique<Replica>(client->options_, std::move(address),
                                  *std::move(channel), incarnation));
  }
  return client;
}

Client::Client(ClientOptions options) : options_(std::move(options)) {}

Client::~Client() {
  if (joined_) {
    absl::Status s = Leave();
    if (!s.ok()) LOG(WARNING) << "leaving job " << options_.job_id << ": " << s;
  }
}

absl::Status Client::ForEachReplica(
    const std::function<absl::Status(Replica&)>& fn) {
  const size_t n = replicas_.size();
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  for (size_t i = 1; i < n; ++i) {
    threads.emplace_back([&, i] { status[i] = fn(*replicas_[i]); });
  }
  status[0] = fn(*replicas_[0]);
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < n; ++i) {
    if (status[i].ok()) continue;
    if (n == 1) return status[i];
    return absl::Status(
        status[i].code(),
        absl::StrCat("coordinator replica ", replicas_[i]->address(), ": ",
                     status[i].message()));
  }
  return absl::OkStatus();
}

RoundId Client::state_round() const {
  RoundId round = replicas_[0]->state_round();
  for (const auto& r : replicas_) round = std::min(round, r->state_round());
  return round;
}

absl::Status Client::Join(const Layout& layout) {
  absl::StatusOr<uint64_t> total = ValidateLayout(layout, ~uint64_t{0});
  if (!total.ok()) return total.status();
  if (absl::Status s = ForEachReplica([&](Replica& r) {
        return r.Join(layout, *total, /*expect_shard=*/nullptr);
      });
      !s.ok()) {
    return s;
  }
  joined_ = true;  // from here on, Leave (or the destructor) leaves
  layout_ = layout;
  if (absl::Status s = CheckReplicaSet(); !s.ok()) {
    Leave().IgnoreError();  // an inconsistent set must not be used
    return s;
  }
  info_ = replicas_[0]->info();
  info_.num_elements = *total;
  info_.num_chunks = static_cast<uint32_t>(
      ChunkGeometry(*total, info_.settings.chunk_elements).num_chunks());
  for (const auto& r : replicas_) {
    info_.lease_ttl = std::min(info_.lease_ttl, r->info().lease_ttl);
    info_.has_state = info_.has_state && r->info().has_state;
    info_.state_round = std::min(info_.state_round, r->info().state_round);
  }
  return absl::OkStatus();
}

absl::Status Client::CheckReplicaSet() const {
  // The replicas must be the shards 0..S-1 of S, and agree on the settings.
  const size_t n = replicas_.size();
  std::vector<std::string> owner(n);
  for (const auto& r : replicas_) {
    const ShardSpec shard = r->shard();
    if (shard.count != n) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator ", r->address(), " is shard ", shard.index, " of ",
          shard.count, " but the client was given ", n,
          " replica(s); list every replica (--shard_count says how many)"));
    }
    if (!owner[shard.index].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("coordinators ", owner[shard.index], " and ",
                       r->address(), " are both shard ", shard.index, " of ", n,
                       "; give each replica its own --shard_index"));
    }
    owner[shard.index] = r->address();
    const JobSettings& a = r->info().settings;
    const JobSettings& b = replicas_[0]->info().settings;
    if (a.chunk_elements != b.chunk_elements || a.wire_dtype != b.wire_dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "coordinator replicas ", replicas_[0]->address(), " and ",
          r->address(), " hold job ", options_.job_id,
          " with different chunk sizes or wire dtypes; start the replicas "
          "with the same settings"));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Initialize(absl::Span<float> params) {
  if (!joined_) return absl::FailedPreconditionError("Initialize before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  // Seed or fetch each replica's chunks (a replica that lost its state is
  // re-seeded with these parameters while the others fetch theirs).
  return ForEachReplica(
      [&](Replica& r) { return r.Initialize(layout_, params); });
}

absl::StatusOr<RoundId> Client::FetchState(absl::Span<float> params) {
  if (!joined_) return absl::FailedPreconditionError("FetchState before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  if (absl::Status s = ForEachReplica(
          [&](Replica& r) { return r.FetchState(layout_, params).status(); });
      !s.ok()) {
    return s;
  }
  return state_round();
}

absl::StatusOr<SyncOutcome> Client::Sync(absl::Span<float> params) {
  if (!joined_) return absl::FailedPreconditionError("Sync before Join");
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  std::vector<SyncOutcome> outcomes(replicas_.size());
  std::vector<Replica*> index;
  for (const auto& r : replicas_) index.push_back(r.get());
  if (absl::Status s = ForEachReplica([&](Replica& r) -> absl::Status {
        const size_t i =
            std::find(index.begin(), index.end(), &r) - index.begin();
        absl::StatusOr<SyncOutcome> o = r.Sync(layout_, params);
        if (!o.ok()) return o.status();
        outcomes[i] = *o;
        return absl::OkStatus();
      });
      !s.ok()) {
    return s;
  }
  // A replica may have re-joined under a new member id.
  info_.member_id = replicas_[0]->info().member_id;
  // One outcome for the whole model: replicas agree unless one restarted.
  SyncOutcome all = outcomes[0];
  for (size_t i = 1; i < outcomes.size(); ++i) {
    const SyncOutcome& o = outcomes[i];
    all.round = std::min(all.round, o.round);
    all.contributed = all.contributed && o.contributed;
    all.late = all.late || o.late;
    all.contributors = std::min(all.contributors, o.contributors);
    all.contributor_weight =
        std::min(all.contributor_weight, o.contributor_weight);
    all.bytes_sent += o.bytes_sent;
    all.bytes_received += o.bytes_received;
    all.rejoined = all.rejoined || o.rejoined;
    all.upload_time = std::max(all.upload_time, o.upload_time);
    all.first_result_time =
        std::max(all.first_result_time, o.first_result_time);
    all.result_time = std::max(all.result_time, o.result_time);
    all.paced_writes += o.paced_writes;
  }
  return all;
}

absl::Status Client::Leave() {
  absl::Status first;
  for (const auto& r : replicas_) {
    absl::Status s = r->Leave();
    if (first.ok() && !s.ok()) first = s;
  }
  joined_ = false;
  return first;
}

}  // namespace localsgd
