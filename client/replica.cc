#include "client/replica.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/blocking_stream.h"
#include "client/rejoin_policy.h"
#include "client/retry.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "proto/chunk_wire.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "src/codec.h"
#include "src/member_ref.h"

namespace localsgd {
namespace {

// Waits for a retry on a channel: until the deadline while the channel is
// READY (the coordinator answered, with an error), else until it connects
// again or the deadline, whichever comes first; not at all where the call
// is to go to another address.
// Re-joins one Sync may make (Replica::Sync).
constexpr int kMaxRejoinsPerSync = 4;
// The longest retry backoff against a shard with standbys.
constexpr absl::Duration kStandbyMaxBackoff = absl::Milliseconds(200);

class ChannelWaiter final : public RetryWaiter {
 public:
  explicit ChannelWaiter(ShardEndpoints* endpoints) : endpoints_(endpoints) {}
  void WaitUntil(absl::Time wake) override {
    // A call that moved to another address of the shard goes there at once,
    // until it has tried each once: then it backs off, so that a shard
    // whose addresses all refuse (standbys while none has won yet) is not
    // asked in a busy loop.
    if (moved_) {
      moved_ = false;
      if (++moves_ < endpoints_->size()) return;
    }
    moves_ = 0;
    grpc::Channel* channel = endpoints_->current()->channel.get();
    if (channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
      absl::SleepFor(wake - absl::Now());
    } else {
      channel->WaitForConnected(absl::ToChronoTime(wake));
    }
  }
  void set_moved() { moved_ = true; }

 private:
  ShardEndpoints* const endpoints_;
  bool moved_ = false;
  size_t moves_ = 0;  // moves without a wait since the last wait
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

const std::string& SyncPath() {
  static const std::string* path = new std::string(MethodPath("Sync"));
  return *path;
}
const std::string& FetchStatePath() {
  static const std::string* path = new std::string(MethodPath("FetchState"));
  return *path;
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

grpc::ByteBuffer RawMessage(std::string bytes) {
  grpc::Slice slice(std::move(bytes));
  return grpc::ByteBuffer(&slice, 1);
}

// Hands a message read to a stream machine: a plain chunk read in place
// from gRPC's slices (`scratch` keeps its pieces), else parsed by protobuf.
template <typename Message, typename Machine>
void Feed(const grpc::ByteBuffer& raw, absl::string_view what,
          ChunkView* scratch, Machine& machine) {
  if (ParseChunkMessage(raw, scratch) == ChunkParse::kChunk) {
    machine.OnChunk(*scratch);
    return;
  }
  Message message;
  if (absl::Status s = ParseMessage(raw, &message, what); !s.ok()) {
    machine.OnUnreadable(s);
    return;
  }
  machine.OnMessage(message);
}

// Ends a call after its machine finished with `finish` (none: the call
// ended on its own): cancels it for a refusal; the call's status.
absl::Status EndCall(grpc::ClientContext& context, BlockingStream& stream,
                     const std::optional<ClientStreamAction>& finish) {
  if (finish.has_value() && finish->cancel) {
    context.TryCancel();
    stream.Finish();
    return finish->status;
  }
  return FromGrpcStatus(stream.Finish());
}

// The plan of a contribution to `round` with what `work` says of it.
SyncPlan ContributionPlan(RoundId round, const SyncWork& work) {
  SyncPlan plan;
  plan.round = round;
  plan.local_steps = work.local_steps;
  plan.weight = work.weight;
  plan.last = work.last;
  return plan;
}

}  // namespace

Replica::Replica(const ClientOptions& options,
                 std::unique_ptr<ShardEndpoints> endpoints,
                 uint64_t incarnation)
    : options_(options),
      endpoints_(std::move(endpoints)),
      incarnation_(incarnation) {
  member_.set_error_reset(options_.error_reset);
}

Replica::~Replica() { StopHeartbeats(); }

absl::Status Replica::Join(const Layout& layout, uint64_t total,
                           const ShardSpec* expect_shard) {
  StopHeartbeats();
  v1::JoinRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_name(options_.member_name);
  request.set_weight(options_.weight);
  request.set_incarnation(incarnation_);
  LayoutToProto(layout, request.mutable_layout());
  JobSettings settings = options_.settings;
  // A client always says what it sends (CONTRIBUTION_UNSPECIFIED is how a
  // coordinator recognises a client that predates pseudo-gradients).
  if (settings.contribution == Contribution::kUnspecified) {
    settings.contribution = Contribution::kPseudoGradients;
  }
  SettingsToProto(settings, request.mutable_settings());

  v1::JoinResponse response;
  absl::Status status = WithRetries("Join", [&](Connection& connection) {
    grpc::ClientContext context;
    SetDeadline(&context, options_.rpc_timeout);
    absl::Status s =
        FromGrpcStatus(connection.stub->Join(&context, request, &response));
    return s.ok() ? endpoints_->CheckEpoch(connection, response.epoch()) : s;
  });
  if (!status.ok()) return status;
  absl::StatusOr<JoinInfo> info = JoinInfoFromProto(response);
  if (!info.ok()) {
    return absl::InternalError(absl::StrCat(
        "coordinator ", address(), ": Join response does not parse (",
        info.status().message(), "); is it a compatible version?"));
  }
  if (absl::Status s = CheckJoinInfo(*info, total, expect_shard); !s.ok()) {
    return s;
  }
  info_ = *std::move(info);
  total_ = total;
  member_.OnJoined(info_, total);
  StartHeartbeats(info_.member_id, info_.lease_ttl / 3);
  const ShardSpec shard = info_.shard;
  LOG(INFO) << "joined job " << options_.job_id << " at " << address()
            << (shard.count > 1 ? absl::StrCat(" (shard ", shard.index, " of ",
                                               shard.count, ")")
                                : std::string())
            << " as " << options_.member_name << " (member_ref "
            << MemberRef(info_.member_id) << "); "
            << (info_.has_state
                    ? absl::StrCat("state at round ", info_.state_round)
                    : std::string("no state yet"));
  return absl::OkStatus();
}

absl::Status Replica::CheckJoinInfo(const JoinInfo& info, uint64_t total,
                                    const ShardSpec* expect_shard) const {
  if (!IsWireDType(info.settings.wire_dtype) ||
      (IsSparseDType(info.settings.wire_dtype) &&
       (!ValidateSparseCode(SparseCodeOf(WireCodeOf(info.settings))).ok() ||
        !ValidateSparseCode(SparseCodeOf(ResultCodeOf(info.settings))).ok())) ||
      info.settings.chunk_elements == 0 || info.num_chunks == 0 ||
      info.lease_ttl <= absl::ZeroDuration()) {
    return absl::InternalError(absl::StrCat(
        "coordinator ", address(),
        ": Join response is malformed (wire dtype, sparse keep, chunk size "
        "or lease); "
        "is it a compatible version?"));
  }
  const ShardSpec shard = info.shard;
  if (shard.index >= shard.count) {
    return absl::InternalError(absl::StrCat("coordinator ", address(),
                                            " says it is shard ", shard.index,
                                            " of ", shard.count));
  }
  if (expect_shard != nullptr && !(shard == *expect_shard)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "coordinator ", address(), " was shard ", expect_shard->index, " of ",
        expect_shard->count, " and now says it is shard ", shard.index, " of ",
        shard.count,
        "; were the replicas restarted with other "
        "--shard_index/--shard_count?"));
  }
  const uint64_t want =
      ShardElements(total, info.settings.chunk_elements, shard);
  if (info.num_elements != want) {
    return absl::InternalError(absl::StrCat(
        "coordinator ", address(), " (shard ", shard.index, " of ", shard.count,
        ") holds ", info.num_elements, " elements of the ", total,
        "-element layout; its chunks of ", info.settings.chunk_elements,
        " make ", want));
  }
  return absl::OkStatus();
}

absl::Status Replica::Initialize(const Layout& layout,
                                 absl::Span<float> params) {
  if (info_.has_state) return FetchState(layout, params).status();
  absl::StatusOr<SyncOutcome> outcome = SyncRound(layout, SyncPlan{}, params);
  if (!outcome.ok()) return outcome.status();
  LOG(INFO) << (outcome->contributed ? "seeded" : "adopted the seed of")
            << " job " << options_.job_id << " at " << address()
            << " (state round " << outcome->round << ")";
  return absl::OkStatus();
}

absl::StatusOr<RoundId> Replica::FetchState(const Layout& layout,
                                            absl::Span<float> params) {
  RoundId round = 0;
  uint64_t state_id = 0;
  absl::Status status = WithRetries("FetchState", [&](Connection& connection) {
    return FetchAttempt(connection, layout, params, &round, &state_id);
  });
  if (!status.ok()) return status;
  if (absl::Status s = member_.CommitFetch(round, state_id, params); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("coordinator ", address(), ": ", s.message()));
  }
  return round;
}

absl::Status Replica::FetchAttempt(Connection& connection, const Layout& layout,
                                   absl::Span<float> params, RoundId* round,
                                   uint64_t* state_id) {
  v1::FetchStateRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_id(info_.member_id.str());
  request.set_layout_fingerprint(layout.fingerprint);
  grpc::ClientContext context;
  SetDeadline(&context, options_.sync_timeout);
  BlockingStream stream(&connection.generic, &context, FetchStatePath());
  // Blocking: the request and the end of the writes, then read by read.
  bool writes_ok = true;
  bool want_read = false;
  std::optional<ClientStreamAction> finish;
  FetchStateClientStream machine(
      &member_, params, std::move(request),
      [&](ClientStreamAction a) {
        using Kind = ClientStreamAction::Kind;
        if (a.kind == Kind::kWriteMessage) {
          writes_ok = stream.Write(RawMessage(std::move(a.message)));
        } else if (a.kind == Kind::kWritesDone) {
          if (writes_ok) stream.WritesDone();
        } else if (a.kind == Kind::kRead) {
          want_read = true;
        } else if (a.kind == Kind::kFinish) {
          finish = std::move(a);
        }
      },
      endpoints_->epoch());
  machine.Start();
  grpc::ByteBuffer raw;
  ChunkView scratch;
  while (want_read && !finish.has_value()) {
    want_read = false;
    if (!stream.Read(&raw)) {
      machine.OnReadsDone();
    } else {
      Feed<v1::FetchStateResponse>(raw, "FetchState response", &scratch,
                                   machine);
    }
  }
  const absl::Status s = machine.Conclude(EndCall(context, stream, finish));
  *round = machine.round();
  *state_id = machine.state_id();
  return s.ok() ? endpoints_->CheckEpoch(connection, machine.epoch()) : s;
}

absl::StatusOr<SyncOutcome> Replica::Sync(const Layout& layout,
                                          absl::Span<float> params,
                                          SyncWork work) {
  absl::StatusOr<SyncOutcome> outcome = SyncRound(
      layout, ContributionPlan(member_.state_round() + 1, work), params);
  // The coordinator forgot the member or the job, or is behind it
  // (rejoin_policy.h): joining again mends it. Again if the member is
  // forgotten again (NOT_FOUND): the coordinator that took it back failed
  // over before its round was through, to a standby that has not seen it.
  if (SyncNeedsRejoin(outcome.status())) {
    for (int rejoins = 1;; ++rejoins) {
      LOG(WARNING) << "job " << options_.job_id << " at " << address() << ": "
                   << outcome.status().message() << "; joining again";
      outcome = Rejoin(layout, params, work);
      if (!absl::IsNotFound(outcome.status()) ||
          rejoins == kMaxRejoinsPerSync) {
        break;
      }
    }
  }
  return outcome;
}

absl::StatusOr<SyncOutcome> Replica::Rejoin(const Layout& layout,
                                            absl::Span<float> params,
                                            SyncWork work) {
  const RoundId trained_from = member_.state_round();
  const uint32_t last_contributors = member_.last_contributors();
  const ShardSpec shard = info_.shard;
  if (absl::Status s = Join(layout, total_, &shard); !s.ok()) {
    return s;
  }
  absl::StatusOr<SyncOutcome> outcome;
  const RejoinDecision decision =
      DecideRejoin(info_.has_state, info_.state_round, trained_from,
                   member_.pseudo_gradients());
  switch (decision.action) {
    case RejoinAction::kReseedThenContribute:
      // The contributors count goes only with a seed round (a first seed
      // has neither).
      outcome = ReseedThenContribute(
          layout,
          SeedOrigin{trained_from, trained_from > 0 ? last_contributors : 0},
          params, work);
      break;
    case RejoinAction::kContribute: {
      // Asking for the round it was syncing: the parameters (and anchor)
      // still grew from `trained_from`, not from the round the Join named.
      if (decision.round == info_.state_round) {
        member_.RestoreRound(trained_from, last_contributors);
      }
      outcome =
          SyncRound(layout, ContributionPlan(decision.round, work), params);
      break;
    }
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
    LOG(INFO) << "job " << options_.job_id << " at " << address()
              << ": joined again; now at round " << outcome->round
              << (outcome->contributed ? " (contributed)" : " (adopted)");
  } else if (member_.state_round() < trained_from) {
    // Join set the round to the job's (0 without state); nothing newer
    // arrived: the parameters still grew from `trained_from`, and the next
    // re-join (or re-seed) must say so.
    member_.RestoreRound(trained_from, last_contributors);
  }
  return outcome;
}

// The coordinator lost the job: re-seed it at `origin` (the round of the
// state these parameters grew from, and how many contributed to it), or
// adopt another member's re-seed, then contribute these parameters to its
// next round, as the members that re-join after the seed do: so every
// member takes part in that round and none waits for one that already
// returned. The seed round keeps the job's numbering in step with the other
// replicas, and the re-seeded job regathers until the contributors are back
// or a lease has passed (SyncHeader.seed_round).
//
// In a pseudo-gradient job the seed is the anchor (the state the parameters
// were trained from, which the other members hold too), named by its id,
// and the parameters then go as a delta against it.
absl::StatusOr<SyncOutcome> Replica::ReseedThenContribute(
    const Layout& layout, SeedOrigin origin, absl::Span<float> params,
    const SyncWork& work) {
  const bool pseudo_gradients = member_.pseudo_gradients();
  // (A first seed, origin.round 0, seeds the parameters: there is no state
  // they were trained from that another member could hold.)
  if (pseudo_gradients && origin.round > 0) {
    origin.state_id = member_.anchor_id();
  }
  // A pseudo-gradient job's seed result becomes the anchor only; the
  // parameters stay this member's until it is known which they get.
  SyncPlan seed;
  seed.origin = origin;
  seed.result_to_params = !pseudo_gradients;
  absl::StatusOr<SyncOutcome> outcome = SyncRound(layout, seed, params);
  if (!outcome.ok()) return outcome;
  if (outcome->round > origin.round ||
      (origin.state_id != 0 && outcome->state_id != origin.state_id)) {
    // Another member re-seeded from a newer state than these parameters
    // grew from (or from another state of that round): they are stale;
    // keep the adopted state (as kAdopt does).
    if (pseudo_gradients) member_.CopyAnchorTo(params);
    outcome->contributed = false;
    outcome->late = true;
    return outcome;
  }
  // A parameter job's seed result overwrote them; the seed kept them.
  if (!pseudo_gradients) member_.RestoreContribution();
  return SyncRound(layout, ContributionPlan(member_.state_round() + 1, work),
                   params);
}

absl::StatusOr<SyncOutcome> Replica::SyncRound(const Layout& layout,
                                               const SyncPlan& plan,
                                               absl::Span<float> params) {
  member_.BeginSync(plan, params);
  SyncOutcome outcome;
  absl::Status status = WithRetries(
      absl::StrCat("Sync of round ", plan.round), [&](Connection& connection) {
        member_.BeginAttempt();
        return SyncAttempt(connection, layout, &outcome);
      });
  if (!status.ok()) {
    member_.RollBack();
    return status;
  }
  member_.CommitSync(outcome);
  return outcome;
}

SyncStreamOptions Replica::StreamOptions(const Layout& layout) const {
  SyncStreamOptions o;
  o.job_id = options_.job_id;
  o.member_id = info_.member_id;
  o.layout_fingerprint = layout.fingerprint;
  // Full duplex: one write and one read in flight, so that result chunks
  // that are final come back while the contribution still goes out
  // (SyncHeader.early_results).
  o.early_results = member_.SendsDelta() && options_.early_results;
  // A paced upload (ClientOptions::max_lead_chunks) only where the round
  // waits for every participant anyway (no deadline): a paced member
  // completes its upload only as the slowest participant gives its chunks,
  // so a deadline, which needs complete members, could not close the round
  // without a slow or dead one.
  const bool pace = o.early_results && info_.paced_uploads &&
                    info_.round_deadline == absl::ZeroDuration() &&
                    info_.settings.deadline_mode != DeadlineMode::kAdaptive;
  o.max_lead_chunks = pace ? options_.max_lead_chunks : 0;
  o.min_epoch = endpoints_->epoch();
  if (o.early_results && options_.on_early_result != nullptr) {
    o.on_early = [this](uint32_t j, absl::Span<const float> values) {
      options_.on_early_result(member_.GlobalOffset(j), values);
    };
  }
  return o;
}

absl::Status Replica::SyncAttempt(Connection& connection, const Layout& layout,
                                  SyncOutcome* outcome) {
  grpc::ClientContext context;
  SetDeadline(&context, options_.sync_timeout);
  BlockingStream stream(&connection.generic, &context, SyncPath());
  grpc::ByteBuffer raw;
  std::optional<ClientStreamAction> finish;
  SyncClientStream machine(
      &member_, &staging_, Clock::Real(), StreamOptions(layout),
      [&](ClientStreamAction a) {
        using Kind = ClientStreamAction::Kind;
        switch (a.kind) {
          case Kind::kWriteMessage:
            stream.StartWrite(RawMessage(std::move(a.message)));
            return;
          case Kind::kWriteChunk: {
            const absl::string_view payload(*a.payload);
            stream.StartWrite(
                ChunkMessage(a.index, a.crc32c, payload, std::move(a.payload)));
            return;
          }
          case Kind::kWritesDone:
            stream.StartWritesDone();
            return;
          case Kind::kRead:
            stream.StartRead(&raw);
            return;
          case Kind::kFinish:
            finish = std::move(a);
            return;
        }
      });
  if (stream.started()) machine.Start();
  ChunkView scratch;
  while (!finish.has_value() &&
         (stream.write_pending() || stream.read_pending())) {
    const BlockingStream::Completion done = stream.Next();
    if (done.op == BlockingStream::Op::kWrite) {
      machine.OnWriteDone(done.ok);
    } else if (!done.ok) {
      machine.OnReadsDone();
    } else {
      Feed<v1::SyncResponse>(raw, "Sync response", &scratch, machine);
    }
  }
  const absl::Status s = machine.Conclude(EndCall(context, stream, finish));
  *outcome = machine.outcome();
  // The machine refused a result below the epoch it was given; this raises
  // the shard's epoch to the result's.
  return s.ok() ? endpoints_->CheckEpoch(connection, outcome->epoch) : s;
}

absl::Status Replica::WithRetries(
    absl::string_view what,
    const std::function<absl::Status(Connection&)>& attempt) {
  RetryPolicy policy;
  policy.initial_backoff = options_.initial_backoff;
  policy.max_backoff = options_.max_backoff;
  if (endpoints_->size() > 1) {
    // A shard with standbys: while they elect, every address refuses at
    // once and cheaply; ask often, so that the member is back within a
    // fraction of a second of the new primary serving.
    policy.max_backoff = std::min(policy.max_backoff, kStandbyMaxBackoff);
  }
  policy.max_retry_time = options_.max_retry_time;
  ChannelWaiter waiter(endpoints_.get());
  return RunWithRetries(
      policy, *Clock::Real(), waiter,
      [this] {
        absl::MutexLock lock(&mu_);
        return absl::Uniform(gen_, 0.8, 1.2);
      },
      absl::StrCat(what, " at ", address()),
      [&]() -> absl::Status {
        const std::shared_ptr<Connection> connection = endpoints_->current();
        absl::Status s = attempt(*connection);
        if (!s.ok() && endpoints_->OnCallFailed(*connection, s)) {
          waiter.set_moved();
        }
        return s;
      });
}

absl::Status Replica::Leave() {
  StopHeartbeats();
  if (info_.member_id.empty()) return absl::OkStatus();
  v1::LeaveRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_id(info_.member_id.str());
  v1::LeaveResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, std::min(options_.rpc_timeout, absl::Seconds(5)));
  absl::Status status = FromGrpcStatus(
      endpoints_->current()->stub->Leave(&context, request, &response));
  info_.member_id = MemberId();
  if (status.ok()) {
    LOG(INFO) << "left job " << options_.job_id << " at " << address();
  }
  return status;
}

void Replica::StartHeartbeats(MemberId member, absl::Duration interval) {
  StopHeartbeats();
  {
    absl::MutexLock lock(&mu_);
    stop_ = false;
    member_id_ = std::move(member);
  }
  heartbeat_ = std::thread([this, interval] { HeartbeatLoop(interval); });
}

void Replica::StopHeartbeats() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
}

void Replica::HeartbeatLoop(absl::Duration interval) {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), interval);
    if (stop_) return;
    v1::HeartbeatRequest request;
    request.set_job_id(options_.job_id);
    request.set_member_id(member_id_.str());
    mu_.Unlock();
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    SetDeadline(&context, std::min(interval, options_.rpc_timeout));
    const std::shared_ptr<Connection> connection = endpoints_->current();
    absl::Status status = FromGrpcStatus(
        connection->stub->Heartbeat(&context, request, &response));
    if (status.ok()) {
      status = endpoints_->CheckEpoch(*connection, response.epoch());
    }
    if (!status.ok()) {
      LOG(WARNING) << "heartbeat for job " << options_.job_id << " at "
                   << connection->address << " failed: " << status.message();
      // A standby or a deposed primary: the shard's next address.
      endpoints_->OnCallFailed(*connection, status);
    }
    mu_.Lock();
  }
}

}  // namespace localsgd
