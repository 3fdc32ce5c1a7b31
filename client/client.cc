#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "src/codec.h"

namespace localsgd {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

bool Retryable(const absl::Status& status) {
  // CANCELLED: a call the server cut off while shutting down (the client's
  // own cancellations return before this is asked).
  return absl::IsUnavailable(status) || absl::IsAborted(status) ||
         absl::IsDeadlineExceeded(status) || absl::IsCancelled(status);
}

// Collects the chunks of one state or result stream into `staging`, each
// exactly once.
class ChunkReceiver {
 public:
  ChunkReceiver(absl::string_view what, const ChunkGeometry& geometry,
                DType wire, absl::Span<float> staging)
      : what_(what),
        geometry_(geometry),
        wire_(wire),
        staging_(staging),
        got_(geometry.num_chunks(), false) {}

  // INTERNAL for an index out of range or repeated, or a wrong size.
  absl::Status Add(const v1::Chunk& chunk) {
    const uint32_t i = chunk.index();
    if (i >= got_.size() || got_[i]) {
      return absl::InternalError(
          absl::StrCat(what_, " stream out of order at chunk ", i));
    }
    absl::Status s =
        DecodeValues(chunk.data(), wire_,
                     staging_.subspan(geometry_.Offset(i), geometry_.Size(i)));
    if (!s.ok())
      return absl::InternalError(absl::StrCat(what_, ": ", s.message()));
    got_[i] = true;
    ++received_;
    bytes_ += chunk.data().size();
    return absl::OkStatus();
  }

  // UNAVAILABLE (retryable) unless every chunk arrived.
  absl::Status CheckComplete() const {
    if (received_ == got_.size()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        what_, " ended after ", received_, " of ", got_.size(), " chunks"));
  }

  uint64_t bytes() const { return bytes_; }

 private:
  const std::string what_;
  const ChunkGeometry& geometry_;
  const DType wire_;
  const absl::Span<float> staging_;
  std::vector<bool> got_;
  uint32_t received_ = 0;
  uint64_t bytes_ = 0;
};

// Ends a client stream: on a local `error` cancels the call and returns the
// error; otherwise returns the call's status.
template <typename Stream>
absl::Status FinishStream(grpc::ClientContext& context, Stream& stream,
                          const absl::Status& error) {
  if (!error.ok()) {
    context.TryCancel();
    stream.Finish();
    return error;
  }
  return FromGrpc(stream.Finish());
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
  if (target.empty()) {
    return absl::InvalidArgumentError("ClientOptions.target is empty");
  }
  if (job_id.empty()) {
    return absl::InvalidArgumentError("ClientOptions.job_id is empty");
  }
  if (!(weight > 0) || weight > 1e6) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.weight must be in (0, 1e6]; got ", weight));
  }
  if (settings.wire_dtype != DType::kUnspecified &&
      !IsWireDType(settings.wire_dtype)) {
    return absl::InvalidArgumentError(
        "ClientOptions.settings.wire_dtype must be float32 or bfloat16");
  }
  if (rpc_timeout <= absl::ZeroDuration() ||
      sync_timeout <= absl::ZeroDuration() ||
      initial_backoff <= absl::ZeroDuration() ||
      max_backoff < initial_backoff) {
    return absl::InvalidArgumentError(
        "ClientOptions timeouts and backoffs must be positive, "
        "max_backoff >= initial_backoff");
  }
  return absl::OkStatus();
}

class Client::Impl {
 public:
  Impl(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
      : options_(options),
        channel_(std::move(channel)),
        stub_(v1::Coordinator::NewStub(channel_)) {
    absl::BitGen gen;
    do {
      incarnation_ = absl::Uniform<uint64_t>(gen);
    } while (incarnation_ == 0);
  }

  ~Impl() { StopHeartbeats(); }

  // Runs `attempt` until it succeeds, fails with a code retrying cannot mend,
  // or max_retry_time has passed; exponential backoff with jitter.
  template <typename Fn>
  absl::Status WithRetries(absl::string_view what, Fn attempt) {
    const absl::Time give_up = absl::Now() + options_.max_retry_time;
    absl::Duration backoff = options_.initial_backoff;
    for (int n = 1;; ++n) {
      absl::Status status = attempt();
      if (status.ok() || !Retryable(status)) return status;
      if (absl::Now() + backoff > give_up) {
        return absl::Status(
            status.code(),
            absl::StrCat(what, " failed after ", n, " attempts over ",
                         absl::FormatDuration(options_.max_retry_time), ": ",
                         status.message()));
      }
      double jitter;
      {
        absl::MutexLock lock(&mu_);
        jitter = absl::Uniform(gen_, 0.8, 1.2);
      }
      LOG(WARNING) << what << " attempt " << n << " failed (" << status
                   << "); retrying in "
                   << absl::FormatDuration(backoff * jitter);
      const absl::Time wake = absl::Now() + backoff * jitter;
      if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
        absl::SleepFor(wake - absl::Now());
      } else {
        // Retry as soon as the coordinator is reachable again (a restart),
        // at the latest after the backoff.
        channel_->WaitForConnected(absl::ToChronoTime(wake));
      }
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
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

  v1::Coordinator::Stub* stub() { return stub_.get(); }
  uint64_t incarnation() const { return incarnation_; }

 private:
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
        LOG(WARNING) << "heartbeat for job " << options_.job_id
                     << " failed: " << status.error_message();
      }
      mu_.Lock();
    }
  }

  const ClientOptions& options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  uint64_t incarnation_ = 0;
  std::thread heartbeat_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = true;
  MemberId member_ ABSL_GUARDED_BY(mu_);
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (options.member_name.empty()) options.member_name = DefaultMemberName();
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
  auto channel = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args);
  auto client =
      std::unique_ptr<Client>(new Client(std::move(options), nullptr));
  client->impl_ = std::make_unique<Impl>(client->options_, std::move(channel));
  return client;
}

Client::Client(ClientOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}

Client::~Client() {
  if (!info_.member_id.empty()) {
    absl::Status s = Leave();
    if (!s.ok()) LOG(WARNING) << "leaving job " << options_.job_id << ": " << s;
  }
}

absl::Status Client::Join(const Layout& layout) {
  impl_->StopHeartbeats();
  v1::JoinRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_name(options_.member_name);
  request.set_weight(options_.weight);
  request.set_incarnation(impl_->incarnation());
  v1::Layout* l = request.mutable_layout();
  l->set_fingerprint(layout.fingerprint);
  for (const TensorSpec& spec : layout.tensors) {
    v1::TensorSpec* t = l->add_tensors();
    t->set_name(spec.name);
    for (int64_t d : spec.shape) t->add_shape(d);
    t->set_dtype(static_cast<v1::DType>(static_cast<int>(spec.dtype)));
  }
  v1::JobSettings* s = request.mutable_settings();
  s->set_local_sgd_steps(options_.settings.local_sgd_steps);
  s->set_chunk_elements(options_.settings.chunk_elements);
  s->set_rendezvous_members(options_.settings.rendezvous_members);
  s->set_wire_dtype(
      static_cast<v1::DType>(static_cast<int>(options_.settings.wire_dtype)));
  s->set_mode(
      static_cast<v1::AveragingMode>(static_cast<int>(options_.settings.mode)));

  v1::JoinResponse response;
  absl::Status status = impl_->WithRetries("Join", [&] {
    grpc::ClientContext context;
    SetDeadline(&context, options_.rpc_timeout);
    return FromGrpc(impl_->stub()->Join(&context, request, &response));
  });
  if (!status.ok()) return status;

  JoinInfo info;
  info.member_id = MemberId(response.member_id());
  info.settings.local_sgd_steps = response.settings().local_sgd_steps();
  info.settings.chunk_elements = response.settings().chunk_elements();
  info.settings.rendezvous_members = response.settings().rendezvous_members();
  info.settings.wire_dtype =
      static_cast<DType>(response.settings().wire_dtype());
  info.settings.mode = static_cast<AveragingMode>(response.settings().mode());
  info.lease_ttl = absl::Milliseconds(response.policy().lease_ttl_ms());
  info.has_state = response.has_state();
  info.state_round = response.state_round();
  info.num_chunks = response.num_chunks();
  info.num_elements = response.num_elements();
  if (!IsWireDType(info.settings.wire_dtype) ||
      info.settings.chunk_elements == 0 || info.num_chunks == 0 ||
      info.lease_ttl <= absl::ZeroDuration()) {
    return absl::InternalError(
        "coordinator's Join response is malformed (wire dtype, chunk size or "
        "lease); is it a compatible version?");
  }
  info_ = info;
  state_round_ = info.state_round;
  if (&layout != &layout_) layout_ = layout;
  impl_->StartHeartbeats(info_.member_id, info_.lease_ttl / 3);
  LOG(INFO) << "joined job " << options_.job_id << " as "
            << options_.member_name << " (" << info_.member_id.str() << "); "
            << (info_.has_state
                    ? absl::StrCat("state at round ", info_.state_round)
                    : std::string("no state yet"));
  return absl::OkStatus();
}

absl::Status Client::Initialize(absl::Span<float> params) {
  if (info_.member_id.empty()) {
    return absl::FailedPreconditionError("Initialize before Join");
  }
  if (info_.has_state) return FetchState(params).status();
  // Seed; if another member seeded first, this adopts its seed.
  absl::StatusOr<SyncOutcome> outcome = SyncRound(0, params);
  if (!outcome.ok()) return outcome.status();
  LOG(INFO) << (outcome->contributed ? "seeded" : "adopted the seed of")
            << " job " << options_.job_id << " (state round " << outcome->round
            << ")";
  return absl::OkStatus();
}

absl::StatusOr<RoundId> Client::FetchState(absl::Span<float> params) {
  if (info_.member_id.empty()) {
    return absl::FailedPreconditionError("FetchState before Join");
  }
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  const ChunkGeometry geometry(info_.num_elements,
                               info_.settings.chunk_elements);
  const DType wire = info_.settings.wire_dtype;
  std::vector<float>& staging = staging_;
  staging.resize(params.size());
  RoundId round = 0;
  absl::Status status = impl_->WithRetries("FetchState", [&]() -> absl::Status {
    v1::FetchStateRequest request;
    request.set_job_id(options_.job_id);
    request.set_member_id(info_.member_id.str());
    grpc::ClientContext context;
    SetDeadline(&context, options_.sync_timeout);
    auto reader = impl_->stub()->FetchState(&context, request);
    v1::FetchStateResponse response;
    ChunkReceiver chunks("FetchState", geometry, wire, absl::MakeSpan(staging));
    bool header = false;
    absl::Status error;
    while (error.ok() && reader->Read(&response)) {
      if (response.has_header()) {
        header = true;
        round = response.header().round();
        if (response.header().num_chunks() != geometry.num_chunks()) {
          error = absl::InternalError(
              "FetchState header has the wrong chunk count");
        }
      } else if (!header) {
        error =
            absl::InternalError("FetchState sent a chunk before its header");
      } else {
        error = chunks.Add(response.chunk());
      }
    }
    if (absl::Status s = FinishStream(context, *reader, error); !s.ok()) {
      return s;
    }
    return chunks.CheckComplete();
  });
  if (!status.ok()) return status;
  std::copy(staging.begin(), staging.end(), params.begin());
  state_round_ = round;
  return round;
}

absl::StatusOr<SyncOutcome> Client::Sync(absl::Span<float> params) {
  if (info_.member_id.empty()) {
    return absl::FailedPreconditionError("Sync before Join");
  }
  absl::StatusOr<SyncOutcome> outcome = SyncRound(state_round_ + 1, params);
  // NOT_FOUND: the coordinator forgot the member (lease, restart) or the job
  // (restart without state). FAILED_PRECONDITION: the job has no state or is
  // behind this member. Joining again mends both.
  if (absl::IsNotFound(outcome.status()) ||
      absl::IsFailedPrecondition(outcome.status())) {
    LOG(WARNING) << "job " << options_.job_id << ": "
                 << outcome.status().message() << "; joining again";
    outcome = Rejoin(params);
  }
  return outcome;
}

absl::StatusOr<SyncOutcome> Client::Rejoin(absl::Span<float> params) {
  const RoundId trained_from = state_round_;
  if (absl::Status s = Join(layout_); !s.ok()) return s;
  absl::StatusOr<SyncOutcome> outcome;
  if (!info_.has_state) {
    // The coordinator lost the job: re-seed it with these parameters (or
    // adopt another member's re-seed).
    outcome = SyncRound(0, params);
  } else if (info_.state_round <= trained_from) {
    // The job's state is not newer than the one `params` grew from: they are
    // a valid contribution to its next round.
    outcome = SyncRound(info_.state_round + 1, params);
  } else {
    absl::StatusOr<RoundId> round = FetchState(params);
    if (!round.ok()) return round.status();
    outcome = SyncOutcome();
    outcome->round = *round;
    outcome->late = true;
  }
  if (outcome.ok()) {
    outcome->rejoined = true;
    LOG(INFO) << "job " << options_.job_id << ": joined again; now at round "
              << outcome->round
              << (outcome->contributed ? " (contributed)" : " (adopted)");
  }
  return outcome;
}

absl::StatusOr<SyncOutcome> Client::SyncRound(RoundId round,
                                              absl::Span<float> params) {
  if (params.size() != info_.num_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", params.size(),
                     " elements; the job's layout has ", info_.num_elements));
  }
  const ChunkGeometry geometry(info_.num_elements,
                               info_.settings.chunk_elements);
  const DType wire = info_.settings.wire_dtype;
  // The result lands in a staging buffer and is copied into `params` only
  // when complete: a retry must resend the member's own parameters.
  std::vector<float>& staging = staging_;
  staging.resize(params.size());
  SyncOutcome outcome;
  absl::Status status = impl_->WithRetries(
      absl::StrCat("Sync of round ", round), [&]() -> absl::Status {
        outcome = SyncOutcome();
        grpc::ClientContext context;
        SetDeadline(&context, options_.sync_timeout);
        auto stream = impl_->stub()->Sync(&context);
        v1::SyncRequest request;
        v1::SyncHeader* header = request.mutable_header();
        header->set_job_id(options_.job_id);
        header->set_member_id(info_.member_id.str());
        header->set_round(round);
        bool writing = stream->Write(request);
        for (uint32_t c = 0; writing && c < geometry.num_chunks(); ++c) {
          v1::Chunk* chunk = request.mutable_chunk();
          chunk->set_index(c);
          const auto values =
              absl::MakeConstSpan(params.data(), params.size())
                  .subspan(geometry.Offset(c), geometry.Size(c));
          std::string* data = chunk->mutable_data();
          data->resize(WireBytes(wire, values.size()));
          EncodeValuesTo(values, wire, data->data());
          outcome.bytes_sent += data->size();
          writing = stream->Write(request);
        }
        if (writing) stream->WritesDone();

        v1::SyncResponse response;
        ChunkReceiver chunks("Sync result", geometry, wire,
                             absl::MakeSpan(staging));
        bool have_header = false;
        absl::Status error;
        while (error.ok() && stream->Read(&response)) {
          if (response.has_result()) {
            const v1::SyncResult& r = response.result();
            have_header = true;
            outcome.round = r.round();
            outcome.contributed = r.contributed();
            outcome.late = r.late();
            outcome.contributors = r.contributors();
            outcome.contributor_weight = r.contributor_weight();
          } else if (!have_header) {
            error = absl::InternalError("Sync sent a chunk before its result");
          } else {
            error = chunks.Add(response.chunk());
          }
        }
        outcome.bytes_received = chunks.bytes();
        if (absl::Status s = FinishStream(context, *stream, error); !s.ok()) {
          return s;
        }
        return chunks.CheckComplete();
      });
  if (!status.ok()) return status;
  std::copy(staging.begin(), staging.end(), params.begin());
  state_round_ = outcome.round;
  return outcome;
}

absl::Status Client::Leave() {
  impl_->StopHeartbeats();
  if (info_.member_id.empty()) return absl::OkStatus();
  v1::LeaveRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_id(info_.member_id.str());
  v1::LeaveResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, std::min(options_.rpc_timeout, absl::Seconds(5)));
  absl::Status status =
      FromGrpc(impl_->stub()->Leave(&context, request, &response));
  info_.member_id = MemberId();
  if (status.ok()) LOG(INFO) << "left job " << options_.job_id;
  return status;
}

}  // namespace localsgd
