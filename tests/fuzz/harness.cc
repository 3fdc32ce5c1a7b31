#include "tests/fuzz/harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/convert.h"
#include "server/protocol.h"
#include "src/codec.h"
#include "src/crc32c.h"
#include "src/layout.h"

namespace localsgd {
namespace fuzz {
namespace {

// Prints the violated invariant and aborts: libFuzzer saves the input.
[[noreturn]] void Violation(const std::string& what) {
  std::fprintf(stderr, "\n*** localsgd fuzz invariant violated: %s\n",
               what.c_str());
  std::fflush(stderr);
  std::abort();
}

void Check(bool ok, const std::string& what) {
  if (!ok) Violation(what);
}

uint32_t Clamp(uint32_t v, uint32_t lo, uint32_t hi, uint32_t if_zero) {
  if (v == 0) return if_zero;
  return std::max(lo, std::min(hi, v));
}

// The codes each RPC documents (proto/localsgd/v1/coordinator.proto), less
// those only the security layer or a shutdown produces, which this harness
// does not exercise (UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE).
void CheckCode(absl::string_view rpc, const absl::Status& status,
               std::initializer_list<absl::StatusCode> allowed) {
  if (status.ok()) return;
  Check(
      !status.message().empty(),
      absl::StrCat(rpc, " failed with an empty message: ", status.ToString()));
  for (absl::StatusCode code : allowed) {
    if (status.code() == code) return;
  }
  Violation(absl::StrCat(
      rpc, " ended with an undocumented status: ", status.ToString()));
}

using C = absl::StatusCode;

// Small values that are exact in bfloat16, for the honest members.
float HonestValue(uint32_t seed, uint32_t member, uint64_t j) {
  const uint64_t h =
      (seed * 2654435761ull + member * 40503ull + j * 97ull) >> 7;
  return static_cast<float>(static_cast<int>(h % 129) - 64) / 8.0f;
}

// The server's message limit the harness reports on Join.
constexpr uint64_t kMaxMessageBytes = 64 << 20;

std::vector<float> Decode(absl::string_view data, DType dtype) {
  std::vector<float> out(data.size() / DTypeSize(dtype));
  if (!DecodeValues(data, dtype, absl::MakeSpan(out)).ok()) out.clear();
  return out;
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

bool SameBits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

// Unit roundoff of the result: fp32 arithmetic, then the wire dtype.
double ResultRoundoff(DType wire) {
  return wire == DType::kBFloat16 ? std::ldexp(1.0, -8) : 0.0;
}

}  // namespace

void InitFuzzing() {
  FLAGS_minloglevel = 3;  // the core logs every Join and round
  FLAGS_stderrthreshold = 3;
  // Protobuf logs every string that is not UTF-8 (the parse fails, as on
  // the server).
  google::protobuf::SetLogHandler(nullptr);
}

Harness::Harness(const Config& config) {
  options_.clock = &clock_;
  options_.observer = &events_;
  options_.policy.lease_ttl =
      absl::Milliseconds(Clamp(config.lease_ttl_ms(), 1, 60000, 10000));
  options_.policy.round_deadline =
      absl::Milliseconds(std::min<uint32_t>(config.round_deadline_ms(), 60000));
  options_.policy.min_quorum = Clamp(config.min_quorum(), 1, 4, 1);
  options_.policy.max_members = Clamp(config.max_members(), 1, 16, 8);
  options_.policy.max_recent_rounds = 8;
  options_.max_jobs = Clamp(config.max_jobs(), 1, 8, 4);
  // Small models: a fuzzed layout must not allocate gigabytes.
  options_.max_model_elements = 4096;
  options_.max_chunk_elements = 4096;
  options_.default_settings.chunk_elements = 64;
  absl::StatusOr<std::unique_ptr<Coordinator>> c =
      Coordinator::Create(options_);
  Check(c.ok(), absl::StrCat("Coordinator::Create: ", c.status().ToString()));
  coordinator_ = *std::move(c);
}

Harness::~Harness() {
  for (auto& s : streams_) s.reset();
  internal_streams_.clear();
  if (coordinator_ != nullptr) coordinator_->Stop();
  jobs_.clear();
  coordinator_.reset();
}

const Harness::Member* Harness::Ref(uint32_t ref) const {
  if (ref == 0 || members_.empty()) return nullptr;
  return &members_[(ref - 1) % members_.size()];
}

Harness::JobModel* Harness::ModelOf(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

std::shared_ptr<Harness::Stream>& Harness::Slot(uint32_t index) {
  return streams_[index % streams_.size()];
}

// ---------------------------------------------------------------------------
// Join, through the service's handler.

absl::Status Harness::DoJoin(const v1::JoinRequest& request,
                             std::string* member_id) {
  v1::JoinResponse response;
  if (absl::Status s = HandleJoin(*coordinator_, request, /*principal=*/"",
                                  kMaxMessageBytes, &response);
      !s.ok()) {
    return s;
  }
  // What must hold of the response, read with the client's own decoder.
  const std::string where = absl::StrCat("Join of '", request.member_name(),
                                         "' to '", request.job_id(), "'");
  absl::StatusOr<JoinInfo> info = JoinInfoFromProto(response);
  Check(info.ok(), absl::StrCat(where, ": the response does not decode: ",
                                info.status().ToString()));
  absl::StatusOr<Layout> requested_layout = LayoutFromProto(request.layout());
  Check(requested_layout.ok(),
        absl::StrCat(where, ": joined with a layout that does not decode"));
  const JobSettings& s = info->settings;
  Check(
      s.chunk_elements >= 1 && s.chunk_elements <= options_.max_chunk_elements,
      absl::StrCat(where, ": chunk_elements ", s.chunk_elements));
  Check(IsWireDType(s.wire_dtype), absl::StrCat(where, ": wire dtype"));
  Check(s.mode == AveragingMode::kMean ||
            s.contribution == Contribution::kPseudoGradients,
        absl::StrCat(where, ": an outer rule in a job of parameters"));
  Check(!IsCodeDType(s.wire_dtype) ||
            s.contribution == Contribution::kPseudoGradients,
        absl::StrCat(where, ": a block or sparse code in a job of parameters"));
  Check(!IsSparseDType(s.wire_dtype) ||
            (ValidateSparseCode(SparseCodeOf(WireCodeOf(s))).ok() &&
             ValidateSparseCode(SparseCodeOf(ResultCodeOf(s))).ok()),
        absl::StrCat(where, ": a sparse code without a valid keep"));
  Check(info->max_message_bytes == kMaxMessageBytes,
        absl::StrCat(where, ": max_message_bytes"));
  const v1::JobSettings& want = request.settings();
  Check(want.chunk_elements() == 0 || want.chunk_elements() == s.chunk_elements,
        absl::StrCat(where, ": got chunks of ", s.chunk_elements,
                     " after asking for ", want.chunk_elements()));
  Check(want.wire_dtype() == 0 ||
            want.wire_dtype() == static_cast<int>(s.wire_dtype),
        absl::StrCat(where, ": got another wire dtype than asked for"));
  Check(want.local_sgd_steps() == 0 ||
            want.local_sgd_steps() == s.local_sgd_steps,
        absl::StrCat(where, ": got another K than asked for"));
  uint64_t elements = 0;
  for (const TensorSpec& t : requested_layout->tensors) {
    elements += NumElements(t);
  }
  Check(info->num_elements == elements,
        absl::StrCat(where, ": ", info->num_elements,
                     " elements for a layout of ", elements));
  Check(
      info->num_chunks == (elements + s.chunk_elements - 1) / s.chunk_elements,
      absl::StrCat(where, ": ", info->num_chunks, " chunks"));
  absl::StatusOr<std::shared_ptr<Job>> job =
      coordinator_->FindJob(request.job_id());
  Check(job.ok(), absl::StrCat(where, ": the joined job is not found"));
  Check(FirstDifference((*job)->layout(), *requested_layout).empty() &&
            (*job)->layout().fingerprint == requested_layout->fingerprint,
        absl::StrCat(where, ": the job averages another layout"));

  JobModel& model = jobs_[request.job_id()];
  if (model.job == nullptr) model.job = *job;
  Check(model.job == *job, absl::StrCat(where, ": the job was replaced"));
  if (!model.has_state && info->has_state) {
    // Cannot happen: the harness sees every seed close.
    Violation(absl::StrCat(where, ": state appeared unseen"));
  }
  const std::string id = info->member_id.str();
  bool known = false;
  for (const Member& m : members_)
    known |= m.job_id == request.job_id() && m.id == id;
  if (!known) {
    Member m;
    m.job_id = request.job_id();
    m.id = id;
    m.name = request.member_name().empty() ? id : request.member_name();
    m.weight = static_cast<float>(request.weight() == 0 ? 1 : request.weight());
    members_.push_back(std::move(m));
  }
  if (member_id != nullptr) *member_id = id;
  return absl::OkStatus();
}

void Harness::ApplyJoin(const JoinStep& step, bool retry) {
  v1::JoinRequest request = step.request();
  if (step.complete()) {
    if (request.job_id().empty()) request.set_job_id("job");
    if (request.layout().tensors_size() == 0) {
      if (JobModel* m = ModelOf(request.job_id()); m != nullptr) {
        LayoutToProto(m->job->layout(), request.mutable_layout());
      }
    }
    if (request.incarnation() == 0) request.set_incarnation(1);
  }
  std::string id;
  const absl::Status status = DoJoin(request, &id);
  CheckCode(
      "Join", status,
      {C::kInvalidArgument, C::kFailedPrecondition, C::kResourceExhausted});
  if (status.ok() && retry && !request.member_name().empty()) {
    std::string again;
    const absl::Status s = DoJoin(request, &again);
    // The join rate limit may refuse the retry; anything else must not.
    CheckCode("Join (retry)", s, {C::kResourceExhausted});
    Check(!s.ok() || again == id,
          absl::StrCat("a retried Join of '", request.member_name(),
                       "' returned another member"));
  }
  ProcessEvents();
}

// ---------------------------------------------------------------------------
// Streams: the server's state machines, driven as a reactor drives them.

std::shared_ptr<Harness::Stream> Harness::NewStream() {
  auto stream = std::make_shared<Stream>();
  Reader* reader = &stream->reader;
  stream->machine = std::make_unique<SyncServerStream>(
      coordinator_.get(), &wires_, /*admit=*/nullptr,
      [this, reader](StreamAction action) { Act(*reader, std::move(action)); });
  stream->machine->Start();
  Check(stream->reader.read_wanted, "a new Sync stream asks for no message");
  return stream;
}

void Harness::Act(Reader& reader, StreamAction action) {
  Check(!reader.finished, "a stream machine acted after it finished");
  switch (action.kind) {
    case StreamAction::Kind::kRead:
      Check(!reader.read_wanted && !reader.write.has_value(),
            "a stream machine asked for a read while one was pending or "
            "while writing");
      reader.read_wanted = true;
      return;
    case StreamAction::Kind::kWriteMessage:
    case StreamAction::Kind::kWriteChunk:
      Check(!reader.write.has_value(),
            "a stream machine wrote while a write was in flight");
      Check(!reader.read_wanted, "a stream machine wrote while reading");
      reader.write = std::move(action);
      return;
    case StreamAction::Kind::kFinish:
      Check(!reader.write.has_value(),
            "a stream machine finished with a write in flight");
      reader.finished = true;
      reader.read_wanted = false;
      reader.status = std::move(action.status);
      return;
  }
}

template <typename Machine>
void Harness::Pump(Reader& reader, Machine& machine, const JobModel* model) {
  while (reader.write.has_value()) {
    CheckWrite(reader, model);
    reader.write.reset();
    machine.OnWriteDone(true);
  }
}

// One write of a Sync or FetchState stream, as the member reads it.
void Harness::CheckWrite(Reader& reader, const JobModel* model) {
  StreamAction& w = *reader.write;
  if (!reader.header_read) {
    Check(w.kind == StreamAction::Kind::kWriteMessage,
          "a stream's first write is not its header");
    Check(reader.fetch ? reader.fetch_header.ParseFromString(w.message)
                       : reader.sync_header.ParseFromString(w.message),
          "a stream's header does not parse");
    reader.header_read = true;
    return;
  }
  Check(w.kind == StreamAction::Kind::kWriteChunk,
        "a stream wrote a message after its header");
  Check(model != nullptr, "a stream sent state of an unknown job");
  Check(w.wire != nullptr && w.wire->state() != nullptr,
        "a chunk without its state");
  if (reader.wire == nullptr) reader.wire = w.wire;
  Check(reader.wire == w.wire, "a stream sent chunks of two states");
  const Job& job = *model->job;
  const ChunkGeometry& g = job.geometry();
  // A job of pseudo-gradients sends its state in float32 and a round's
  // delta in the wire dtype.
  const bool pseudo =
      job.settings().contribution == Contribution::kPseudoGradients;
  const bool delta = w.wire->form() == StateWire::Form::kDelta;
  Check(!delta || pseudo, "a job of parameters sent a delta");
  const WireCode wire = pseudo && !delta ? WireCode(DType::kFloat32)
                                         : ResultCodeOf(job.settings());
  Check(w.index == reader.chunks_read && w.index < g.num_chunks(),
        absl::StrCat("a stream sent chunk ", w.index, " after ",
                     reader.chunks_read, " of ", g.num_chunks()));
  ++reader.chunks_read;
  Check(w.chunk.data.size() == WireBytes(wire, g.Size(w.index)),
        absl::StrCat("streamed chunk ", w.index, " has ", w.chunk.data.size(),
                     " bytes"));
  Check(w.chunk.crc32c == Crc32c(0, w.chunk.data),
        absl::StrCat("streamed chunk ", w.index, " has a wrong CRC32C"));
  const StateSnapshot& state = *w.wire->state();
  Check(state.values.size() == g.num_elements(),
        absl::StrCat("a state of ", state.values.size(), " values for ",
                     g.num_elements(), " elements"));
  // The finite-state guard: whatever members sent, every state and every
  // result streamed is finite (values, momentum, residual, block scales).
  const absl::string_view data = w.chunk.data;
  Check(FirstNonFinitePieces(absl::MakeConstSpan(&data, 1), wire,
                             g.Size(w.index)) < 0,
        absl::StrCat("streamed chunk ", w.index, " holds a non-finite value"));
  for (const std::vector<float>* part :
       {&state.values, &state.momentum, &state.residual}) {
    if (part->empty()) continue;
    for (uint32_t j = 0; j < g.Size(w.index); ++j) {
      Check(std::isfinite((*part)[g.Offset(w.index) + j]),
            absl::StrCat("the state streamed holds a non-finite value at ",
                         g.Offset(w.index) + j));
    }
  }
  if (delta) {
    // What the state was made of, byte for byte.
    Check(w.chunk.data ==
              absl::string_view(state.delta)
                  .substr(WireBytes(wire, g.chunk_elements()) * w.index,
                          w.chunk.data.size()),
          absl::StrCat("streamed delta chunk ", w.index,
                       " is not the round's delta"));
    return;
  }
  // Values travel in float32 or bfloat16 (never a code).
  const std::vector<float> back = Decode(w.chunk.data, wire.dtype);
  for (uint32_t j = 0; j < g.Size(w.index); ++j) {
    // The state holds wire-dtype values: the round trip is exact.
    Check(SameBits(back[j], state.values[g.Offset(w.index) + j]),
          absl::StrCat("streamed state element ", g.Offset(w.index) + j,
                       " is not the state's value"));
  }
}

void Harness::OnSyncMessage(const std::shared_ptr<Stream>& stream,
                            const v1::SyncRequest& request) {
  // A reactor reads only when the machine asks.
  if (!stream->reader.read_wanted) return;
  stream->reader.read_wanted = false;
  SyncServerStream& machine = *stream->machine;
  const bool accepted_before = machine.job() != nullptr;
  JobModel* model = nullptr;
  RoundId round = 0;
  bool open = false;
  if (request.has_chunk() && accepted_before) {
    model = stream->model;
    round = machine.round();
    // Whether this member's data for the chunk could be counted: its round
    // is not closed yet (observed state round, updated after every step).
    open = round == 0 ? !model->has_state
                      : !model->has_state || round > model->state_round;
  }
  machine.OnMessage(request);
  if (request.has_header() && !accepted_before && machine.job() != nullptr) {
    stream->model = ModelOf(request.header().job_id());
    Check(stream->model != nullptr && stream->model->job == machine.job(),
          "Sync: a job the harness never joined");
    stream->member_id = request.header().member_id();
  }
  // A chunk that applied: the machine recorded no error for it.
  if (model != nullptr && open && machine.error().ok()) {
    const v1::Chunk& chunk = request.chunk();
    if (round == 0) {
      model->seed_data[chunk.index()].push_back(chunk.data());
    } else {
      model->first[round][chunk.index()].emplace(stream->member_id,
                                                 chunk.data());
    }
  }
  Pump(stream->reader, machine, stream->model);
  CheckSyncEnd(*stream);
}

void Harness::EndStream(const std::shared_ptr<Stream>& stream) {
  if (stream == nullptr || !stream->reader.read_wanted) return;
  stream->reader.read_wanted = false;
  stream->machine->OnReadsDone();
  Pump(stream->reader, *stream->machine, stream->model);
  CheckSyncEnd(*stream);
}

void Harness::CancelStream(const std::shared_ptr<Stream>& stream) {
  if (stream == nullptr || stream->reader.finished) return;
  stream->machine->OnCancel();
  Pump(stream->reader, *stream->machine, stream->model);
  CheckSyncEnd(*stream);
}

// What a finished Sync stream gave its member.
void Harness::CheckSyncEnd(const Stream& stream) {
  const Reader& r = stream.reader;
  if (!r.finished) return;
  CheckCode("Sync", r.status,
            {C::kInvalidArgument, C::kFailedPrecondition, C::kNotFound,
             C::kAborted, C::kDataLoss, C::kCancelled});
  if (!r.status.ok()) return;
  Check(r.header_read && r.sync_header.has_result(),
        "a Sync ended OK without a result header");
  const RoundOutcome outcome = RoundOutcomeFromProto(r.sync_header.result());
  const JobModel& model = *stream.model;
  Check(r.chunks_read == model.job->geometry().num_chunks(),
        absl::StrCat("a Sync ended OK after ", r.chunks_read, " of ",
                     model.job->geometry().num_chunks(), " result chunks"));
  Check(r.wire->round() == outcome.round,
        absl::StrCat("a Sync result for round ", outcome.round,
                     " carries the state of round ", r.wire->round()));
  Check(outcome.contributors >= (outcome.contributed ? 1u : 0u) &&
            std::isfinite(outcome.contributor_weight) &&
            outcome.contributor_weight >= 0,
        "a Sync result with inconsistent contributors");
  const RoundId asked = stream.machine->round();
  // A member that asked for an older round (late) adopts the latest;
  // otherwise the result is of the round asked for, or earlier.
  Check(
      outcome.round <= asked || asked == 0 || outcome.late,
      absl::StrCat("a Sync for round ", asked,
                   " got the result of later round ", outcome.round, " (late ",
                   outcome.late, ", contributed ", outcome.contributed, ")"));
  // Only a contribution to the round of the result counted in it.
  Check(!outcome.contributed || asked == 0 ||
            (outcome.round == asked && !outcome.late),
        absl::StrCat("a Sync for round ", asked, " counted as contributed to ",
                     outcome.late ? "(late) " : "", "round ", outcome.round));
}

// ---------------------------------------------------------------------------
// Unary calls and FetchState, through the service's handlers and machine.

void Harness::DoLeave(const MemberCall& call) {
  v1::LeaveRequest request;
  request.set_job_id(call.job_id());
  request.set_member_id(call.member_id());
  if (const Member* m = Ref(call.member_ref()); m != nullptr) {
    request.set_member_id(m->id);
    if (request.job_id().empty()) request.set_job_id(m->job_id);
  }
  CheckCode("Leave", HandleLeave(*coordinator_, request),
            {C::kInvalidArgument, C::kNotFound});
  ProcessEvents();
}

void Harness::DoHeartbeat(const MemberCall& call) {
  v1::HeartbeatRequest request;
  request.set_job_id(call.job_id());
  request.set_member_id(call.member_id());
  if (const Member* m = Ref(call.member_ref()); m != nullptr) {
    request.set_member_id(m->id);
    if (request.job_id().empty()) request.set_job_id(m->job_id);
  }
  v1::HeartbeatResponse response;
  const absl::Status status =
      HandleHeartbeat(*coordinator_, request, &response);
  CheckCode("Heartbeat", status, {C::kInvalidArgument, C::kNotFound});
  if (status.ok()) {
    const JobModel* model = ModelOf(request.job_id());
    Check(model != nullptr && response.state_round() == model->state_round,
          absl::StrCat("Heartbeat reports round ", response.state_round()));
  }
}

void Harness::DoFetch(const FetchCall& call) {
  v1::FetchStateRequest request = call.request();
  if (const Member* m = Ref(call.member_ref()); m != nullptr) {
    request.set_member_id(m->id);
    if (request.job_id().empty()) request.set_job_id(m->job_id);
  }
  if (call.fix_fingerprint()) {
    if (const JobModel* model = ModelOf(request.job_id()); model != nullptr) {
      request.set_layout_fingerprint(model->job->layout().fingerprint);
    }
  }
  Reader reader;
  reader.fetch = true;
  FetchStateServerStream machine(
      coordinator_.get(), &wires_, /*admit=*/nullptr,
      [this, &reader](StreamAction action) { Act(reader, std::move(action)); });
  machine.Start(request);
  const JobModel* model = ModelOf(request.job_id());
  Pump(reader, machine, model);
  Check(reader.finished, "a FetchState stream did not finish");
  CheckCode("FetchState", reader.status,
            {C::kInvalidArgument, C::kNotFound, C::kFailedPrecondition});
  if (!reader.status.ok()) return;
  Check(model != nullptr && model->has_state, "FetchState of no state");
  const v1::StateHeader& header = reader.fetch_header.header();
  Check(
      reader.header_read && header.round() == model->state_round,
      absl::StrCat("FetchState returns round ", header.round(),
                   " but the last round that closed is ", model->state_round));
  const ChunkGeometry& g = model->job->geometry();
  Check(header.num_chunks() == g.num_chunks() &&
            reader.chunks_read == g.num_chunks(),
        absl::StrCat("FetchState announced ", header.num_chunks(), " and sent ",
                     reader.chunks_read, " of ", g.num_chunks(), " chunks"));
  Check(reader.wire->round() == header.round(),
        "FetchState sent the chunks of another round than its header says");
  if (model->state_known) {
    const std::vector<float>& values = reader.wire->state()->values;
    Check(values.size() == model->state.size() &&
              std::equal(values.begin(), values.end(), model->state.begin(),
                         SameBits),
          "FetchState returns another state than the round closed with");
  }
}

void Harness::DoStatus(const v1::GetJobStatusRequest& request) {
  const uint32_t max_rounds =
      request.max_rounds() == 0 ? 10 : std::min(request.max_rounds(), 100u);
  v1::GetJobStatusResponse response;
  const absl::Status status = HandleGetJobStatus(
      *coordinator_, request, clock_.Now(), /*may_see=*/nullptr, &response);
  CheckCode("GetJobStatus", status, {C::kInvalidArgument, C::kNotFound});
  if (!status.ok()) return;
  Check(request.job_id().empty()
            ? response.jobs_size() ==
                  static_cast<int>(coordinator_->Jobs().size())
            : response.jobs_size() == 1,
        "GetJobStatus: another number of jobs");
  for (const v1::JobStatus& p : response.jobs()) {
    absl::StatusOr<std::shared_ptr<Job>> job =
        coordinator_->FindJob(p.job_id());
    Check(job.ok(),
          absl::StrCat("GetJobStatus shows unknown job ", p.job_id()));
    Check(p.num_chunks() == (*job)->geometry().num_chunks() &&
              p.num_elements() == (*job)->geometry().num_elements(),
          "GetJobStatus: geometry");
    Check(static_cast<uint32_t>(p.recent_rounds_size()) <= max_rounds,
          "GetJobStatus: more rounds than asked for");
    Check(
        static_cast<uint32_t>(p.members_size()) <= options_.policy.max_members,
        "GetJobStatus: more members than the limit");
    for (const v1::RoundStatus& r : p.recent_rounds()) {
      Check(r.contributors_size() <= r.participants_size(),
            "GetJobStatus: more contributors than participants");
    }
  }
}

// ---------------------------------------------------------------------------
// Honest members.

void Harness::HonestSync(const Member& member, RoundId round, uint32_t seed) {
  JobModel* model = ModelOf(member.job_id);
  if (model == nullptr) return;
  const Job& job = *model->job;
  std::shared_ptr<Stream> stream = NewStream();
  internal_streams_.push_back(stream);
  v1::SyncRequest request;
  v1::SyncHeader* header = request.mutable_header();
  header->set_job_id(member.job_id);
  header->set_member_id(member.id);
  header->set_round(round);
  header->set_layout_fingerprint(job.layout().fingerprint);
  OnSyncMessage(stream, request);
  const ChunkGeometry& g = job.geometry();
  uint32_t index = 0;
  for (const Member& m : members_) {
    if (&m == &member) break;
    ++index;
  }
  std::vector<float> values;
  for (uint32_t c = 0; c < g.num_chunks(); ++c) {
    if (!stream->reader.read_wanted) break;
    values.resize(g.Size(c));
    for (uint32_t j = 0; j < g.Size(c); ++j) {
      values[j] = HonestValue(seed, index, g.Offset(c) + j);
    }
    v1::Chunk* chunk = request.mutable_chunk();
    chunk->set_index(c);
    EncodeValues(values, WireCodeOf(job.settings()), chunk->mutable_data());
    chunk->set_crc32c(Crc32c(0, chunk->data()));
    OnSyncMessage(stream, request);
  }
  // Keep the few streams that still wait for their round.
  internal_streams_.erase(
      std::remove_if(internal_streams_.begin(), internal_streams_.end(),
                     [](const auto& s) { return s->reader.finished; }),
      internal_streams_.end());
  if (internal_streams_.size() > 64) {
    CancelStream(internal_streams_.front());
    internal_streams_.erase(internal_streams_.begin());
  }
}

void Harness::DoRound(const RoundMacro& round) {
  const size_t n = std::min<size_t>(prologue_members_, 4);
  for (size_t i = 0; i < n; ++i) {
    if ((round.members_mask() & (1u << i)) == 0) continue;
    const Member member = members_[i];
    JobModel* model = ModelOf(member.job_id);
    if (model == nullptr) continue;
    HonestSync(member, model->has_state ? model->state_round + 1 : 0,
               round.value_seed());
    ProcessEvents();
  }
}

void Harness::RunPrologue(const Prologue& p) {
  if (p.tensor_sizes_size() == 0) return;
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < std::min(p.tensor_sizes_size(), 4); ++i) {
    tensors.push_back(
        {absl::StrCat("t", i),
         {static_cast<int64_t>(Clamp(p.tensor_sizes(i), 1, 64, 1))},
         DType::kFloat32});
  }
  const Layout layout = MakeLayout(std::move(tensors));
  const uint32_t members = std::min<uint32_t>(p.members(), 4);
  for (uint32_t i = 0; i < members; ++i) {
    v1::JoinRequest request;
    request.set_job_id("job");
    request.set_member_name(absl::StrCat("p", i));
    request.set_incarnation(1000 + i);
    request.set_weight(i < static_cast<uint32_t>(p.weights_size())
                           ? Clamp(p.weights(i), 1, 8, 1)
                           : 1);
    LayoutToProto(layout, request.mutable_layout());
    v1::JobSettings* settings = request.mutable_settings();
    settings->set_chunk_elements(Clamp(p.chunk_elements(), 1, 64, 8));
    settings->set_wire_dtype(p.bfloat16() ? v1::DTYPE_BFLOAT16
                                          : v1::DTYPE_FLOAT32);
    settings->set_rendezvous_members(std::min<uint32_t>(
        p.rendezvous_members(), options_.policy.max_members));
    if (!DoJoin(request, nullptr).ok()) break;
    ++prologue_members_;
  }
  if (p.seed() && prologue_members_ > 0) {
    HonestSync(members_[0], 0, 12345);
    ProcessEvents();
  }
}

// ---------------------------------------------------------------------------
// Steps.

void Harness::Apply(const Step& step) {
  switch (step.kind_case()) {
    case Step::kSync: {
      const SyncMessage& m = step.sync();
      std::shared_ptr<Stream>& slot = Slot(m.stream());
      if (slot == nullptr || slot->reader.finished) slot = NewStream();
      std::shared_ptr<Stream> stream = slot;
      v1::SyncRequest request = m.request();
      if (request.has_header()) {
        v1::SyncHeader* h = request.mutable_header();
        if (const Member* r = Ref(m.member_ref()); r != nullptr) {
          h->set_member_id(r->id);
          if (h->job_id().empty()) h->set_job_id(r->job_id);
        }
        if (const JobModel* model = ModelOf(h->job_id()); model != nullptr) {
          if (m.relative_round()) {
            const int64_t base =
                model->has_state ? static_cast<int64_t>(model->state_round) : 0;
            h->set_round(static_cast<uint64_t>(
                std::max<int64_t>(0, base + m.round_delta())));
          }
          if (m.fix_fingerprint()) {
            h->set_layout_fingerprint(model->job->layout().fingerprint);
          }
          if (m.fix_anchor()) {
            absl::StatusOr<MemberId> id = ParseMemberId(h->member_id());
            if (id.ok()) {
              absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
                  model->job->GetState(*id);
              if (state.ok()) h->set_anchor_state_id((*state)->id);
            }
          }
        }
      } else if (request.has_chunk() && stream->machine->job() != nullptr) {
        v1::Chunk* chunk = request.mutable_chunk();
        const Job& job = *stream->machine->job();
        if (m.fix_size()) {
          const ChunkGeometry& g = job.geometry();
          chunk->set_index(chunk->index() % g.num_chunks());
          const size_t size =
              WireBytes(WireCodeOf(job.settings()), g.Size(chunk->index()));
          std::string data = chunk->data();
          if (data.empty()) data.assign(1, '\0');
          std::string fixed(size, '\0');
          for (size_t i = 0; i < size; ++i) fixed[i] = data[i % data.size()];
          chunk->set_data(std::move(fixed));
        }
        if (m.fix_crc()) chunk->set_crc32c(Crc32c(0, chunk->data()));
      }
      OnSyncMessage(stream, request);
      ProcessEvents();
      break;
    }
    case Step::kEndStream:
      EndStream(Slot(step.end_stream()));
      ProcessEvents();
      break;
    case Step::kCancelStream:
      CancelStream(Slot(step.cancel_stream()));
      ProcessEvents();
      break;
    case Step::kJoin:
      ApplyJoin(step.join(), /*retry=*/false);
      break;
    case Step::kLeave:
      DoLeave(step.leave());
      break;
    case Step::kHeartbeat:
      DoHeartbeat(step.heartbeat());
      break;
    case Step::kAdvanceMs:
      clock_.Advance(absl::Milliseconds(std::min(step.advance_ms(), 60000u)));
      coordinator_->Tick();
      ProcessEvents();
      break;
    case Step::kStatus:
      DoStatus(step.status());
      break;
    case Step::kFetch:
      DoFetch(step.fetch());
      break;
    case Step::kRound:
      DoRound(step.round());
      break;
    case Step::KIND_NOT_SET:
      break;
  }
}

void Harness::Finish() {
  for (auto& s : streams_) CancelStream(s);
  for (auto& s : internal_streams_) CancelStream(s);
  ProcessEvents();
  DoStatus(v1::GetJobStatusRequest());
}

// ---------------------------------------------------------------------------
// Rounds.

void Harness::ProcessEvents() {
  while (!events_.events.empty()) {
    const RoundClosedEvent event = events_.events.front();
    events_.events.erase(events_.events.begin());
    JobModel* model = ModelOf(event.job_id);
    Check(model != nullptr, "a round closed in a job the harness never saw");
    Check(event.contributors + event.dropped + event.timed_out ==
              event.participants,
          absl::StrCat("round ", event.round, ": ", event.contributors,
                       " contributors + ", event.dropped, " dropped + ",
                       event.timed_out, " timed out != ", event.participants,
                       " participants"));
    Check(event.round == 0
              ? !model->has_state
              : model->has_state && event.round == model->state_round + 1,
          absl::StrCat("round ", event.round, " closed after round ",
                       model->state_round));
    // Read the new state as a member would: a probe joins, fetches and
    // leaves. No round is open right after one closed, so the probe takes
    // part in nothing.
    std::vector<float> values;
    bool known = false;
    v1::JoinRequest probe;
    probe.set_job_id(event.job_id);
    probe.set_member_name(absl::StrCat("~probe", probes_++));
    probe.set_incarnation(1);
    LayoutToProto(model->job->layout(), probe.mutable_layout());
    JoinRequestParams params;
    params.member_name = probe.member_name();
    params.incarnation = 1;
    params.layout = model->job->layout();
    absl::StatusOr<JoinResult> joined =
        coordinator_->Join(event.job_id, std::move(params));
    if (joined.ok()) {
      absl::StatusOr<std::shared_ptr<const StateSnapshot>> state =
          model->job->GetState(joined->member_id);
      Check(state.ok(), absl::StrCat("no state after round ", event.round,
                                     " closed: ", state.status().ToString()));
      Check((*state)->round == event.round,
            absl::StrCat("round ", event.round,
                         " closed but the state is of "
                         "round ",
                         (*state)->round));
      values = (*state)->values;
      known = true;
      Check(model->job->Leave(joined->member_id).ok(), "probe Leave");
    }
    if (known) CheckRound(*model, event, values);
    model->has_state = true;
    model->state_round = event.round;
    model->state_known = known;
    model->state = std::move(values);
    model->seed_data.clear();
    model->first.erase(model->first.begin(),
                       model->first.upper_bound(event.round));
  }
}

void Harness::CheckRound(JobModel& model, const RoundClosedEvent& event,
                         const std::vector<float>& values) {
  const Job& job = *model.job;
  // The model below is of parameter averaging. A job of pseudo-gradients
  // (which a fuzzed Join may create) is held to the protocol's invariants
  // only (CheckWrite); its arithmetic is tested in
  // tests/core/pseudo_gradient_test.cc and the integration tests.
  if (job.settings().contribution == Contribution::kPseudoGradients) return;
  const ChunkGeometry& g = job.geometry();
  const DType wire = job.settings().wire_dtype;
  const std::string round =
      absl::StrCat("job ", event.job_id, " round ", event.round);
  Check(values.size() == g.num_elements(),
        absl::StrCat(round, ": ", values.size(), " values"));
  if (event.round == 0) {
    // The seed is exactly one of the payloads sent to seed each chunk.
    for (uint32_t c = 0; c < g.num_chunks(); ++c) {
      std::string bytes;
      EncodeValues(absl::MakeConstSpan(values).subspan(g.Offset(c), g.Size(c)),
                   wire, &bytes);
      const std::vector<std::string>& sent = model.seed_data[c];
      Check(std::find(sent.begin(), sent.end(), bytes) != sent.end(),
            absl::StrCat(round, ": seed chunk ", c,
                         " is none of the payloads sent for it"));
    }
    return;
  }

  const JobStatusSnapshot status = model.job->Status(1);
  Check(!status.recent_rounds.empty() &&
            status.recent_rounds[0].round == event.round,
        absl::StrCat(round, ": not the latest record"));
  const RoundRecord& record = status.recent_rounds[0];
  auto& first = model.first[event.round];

  auto weight_of = [&](const std::string& id) -> double {
    for (const Member& m : members_) {
      if (m.job_id == event.job_id && m.id == id) return m.weight;
    }
    Violation(absl::StrCat(round, ": data from an unknown member"));
  };
  auto name_of = [&](const std::string& id) -> std::string {
    for (const Member& m : members_) {
      if (m.job_id == event.job_id && m.id == id) return m.name;
    }
    return "";
  };

  // Exact check when every participant contributed completely and each
  // contributor name maps to exactly one member that sent every chunk.
  std::vector<std::string> contributor_ids;
  bool exact =
      record.dropped.empty() && record.timed_out.empty() && model.state_known;
  if (exact) {
    std::map<std::string, int> want;
    for (const auto& n : record.contributors) ++want[n];
    std::map<std::string, std::vector<std::string>> complete;
    std::map<std::string, int> chunks_of;
    for (const auto& [c, by_member] : first) {
      for (const auto& [id, data] : by_member) ++chunks_of[id];
    }
    for (const auto& [id, n] : chunks_of) {
      if (n == static_cast<int>(g.num_chunks())) {
        complete[name_of(id)].push_back(id);
      }
    }
    for (const auto& [name, n] : want) {
      const auto it = complete.find(name);
      if (it == complete.end() || static_cast<int>(it->second.size()) != n) {
        // A contributor the harness cannot identify: the record says it
        // sent every chunk; if no member of that name did, that is a bug.
        Check(it != complete.end(), absl::StrCat(round, ": contributor ", name,
                                                 " never sent all chunks"));
        exact = false;
        break;
      }
      for (const auto& id : it->second) contributor_ids.push_back(id);
    }
  }
  if (exact) {
    double total = 0;
    for (const auto& id : contributor_ids) total += weight_of(id);
    Check(std::abs(record.contributor_weight - total) <= 1e-9 * total,
          absl::StrCat(round, ": contributor weight ",
                       record.contributor_weight, ", expected ", total));
  }

  for (uint32_t c = 0; c < g.num_chunks(); ++c) {
    const auto chunk_it = first.find(c);
    std::vector<std::pair<double, std::vector<float>>> given;  // weight, data
    if (chunk_it != first.end()) {
      for (const auto& [id, data] : chunk_it->second) {
        std::vector<float> v = Decode(data, wire);
        if (!v.empty() && AllFinite(v)) given.emplace_back(weight_of(id), v);
      }
    }
    for (uint32_t j = 0; j < g.Size(c); ++j) {
      const uint64_t e = g.Offset(c) + j;
      const float got = values[e];
      const std::string where =
          absl::StrCat(round, " chunk ", c, " element ", e, ": ", got);
      if (exact) {
        double sum = 0, abs_sum = 0, total = 0;
        for (const auto& id : contributor_ids) {
          const std::vector<float> v = Decode(first[c][id], wire);
          const double w = weight_of(id);
          sum += w * v[j];
          abs_sum += std::abs(w * v[j]);
          total += w;
        }
        if (total == 0) {
          Check(SameBits(got, model.state[e]),
                absl::StrCat(where,
                             " without contributions is not the "
                             "previous state"));
          continue;
        }
        // fp32 accumulation overflows where the double one does not; that
        // is the documented fp32 accumulator, not a bug of the decoding.
        if (abs_sum > 1e37) continue;
        const double mean = sum / total;
        const double k = static_cast<double>(contributor_ids.size());
        // fp32 rounding of each product and sum, relative; subnormal
        // products (tiny weights) lose absolute precision, 2^-149 each.
        const double tol = (k + 2) * std::ldexp(1.0, -23) * (abs_sum / total) +
                           (k + 1) * std::ldexp(1.0, -149) / total +
                           ResultRoundoff(wire) * std::abs(mean) + 1e-37;
        Check(std::abs(got - mean) <= tol,
              absl::StrCat(where, " is not the weighted mean ", mean,
                           " of the ", contributor_ids.size(),
                           " contributors (tolerance ", tol, ")"));
      } else {
        // Some participant dropped out: the value is a weighted mean of some
        // of the data given for the chunk, or the previous state's value.
        double lo = std::numeric_limits<double>::infinity();
        double hi = -lo, scale = 0, weights = 0;
        double min_weight = std::numeric_limits<double>::infinity();
        for (const auto& [w, v] : given) {
          if (w > 0) min_weight = std::min(min_weight, w);
          lo = std::min<double>(lo, v[j]);
          hi = std::max<double>(hi, v[j]);
          scale = std::max<double>(scale, std::abs(v[j]));
          weights += w * std::abs(v[j]);
        }
        if (given.empty()) {
          if (model.state_known && chunk_it == first.end()) {
            Check(SameBits(got, model.state[e]),
                  absl::StrCat(where,
                               " without contributions is not the "
                               "previous state"));
          }
          continue;
        }
        if (!model.state_known || weights > 1e37) continue;
        lo = std::min<double>(lo, model.state[e]);
        hi = std::max<double>(hi, model.state[e]);
        scale = std::max<double>(scale, std::abs(model.state[e]));
        const double tol =
            (given.size() + 2) * std::ldexp(1.0, -23) * scale +
            (given.size() + 1) * std::ldexp(1.0, -149) / min_weight +
            ResultRoundoff(wire) * scale + 1e-37;
        Check(got >= lo - tol && got <= hi + tol,
              absl::StrCat(where, " is outside [", lo, ", ", hi,
                           "], the range of what was given"));
      }
    }
  }
}

}  // namespace fuzz
}  // namespace localsgd
