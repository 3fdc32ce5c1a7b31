#include "server/replica_applier.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/convert.h"
#include "server/convert.h"
#include "src/codec.h"
#include "src/round.h"
#include "src/settings.h"

namespace localsgd {

absl::Status FloatsFromBytes(const std::string& bytes, absl::string_view what,
                             std::vector<float>* out) {
  if (bytes.size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", bytes.size(), " bytes is not a whole number of float32"));
  }
  out->resize(bytes.size() / sizeof(float));
  if (!bytes.empty()) std::memcpy(out->data(), bytes.data(), bytes.size());
  for (size_t i = 0; i < out->size(); ++i) {
    if (!std::isfinite((*out)[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": a non-finite value at element ", i,
          " (a state is finite; the primary is broken or not one)"));
    }
  }
  return absl::OkStatus();
}

void MembersToProto(
    const std::vector<MemberInfo>& members,
    google::protobuf::RepeatedPtrField<v1::ReplicaMember>* proto) {
  for (const MemberInfo& m : members) {
    v1::ReplicaMember* p = proto->Add();
    p->set_id(m.id.str());
    p->set_name(m.name);
    p->set_weight(m.weight);
    p->set_incarnation(m.incarnation);
    p->set_first_round(m.first_round);
    p->set_missed_rounds(m.missed_rounds);
    p->set_principal(m.principal);
    p->set_joined_at_us(absl::ToUnixMicros(m.joined_at));
  }
}

std::vector<MemberInfo> MembersFromProto(
    const google::protobuf::RepeatedPtrField<v1::ReplicaMember>& proto) {
  std::vector<MemberInfo> members;
  members.reserve(proto.size());
  for (const v1::ReplicaMember& p : proto) {
    MemberInfo m;
    m.id = MemberId(p.id());
    m.name = p.name();
    m.weight = p.weight();
    m.incarnation = p.incarnation();
    m.first_round = p.first_round();
    m.missed_rounds = std::min<uint32_t>(p.missed_rounds(), kStragglerMisses);
    m.principal = p.principal();
    m.joined_at = absl::FromUnixMicros(p.joined_at_us());
    members.push_back(std::move(m));
  }
  return members;
}

ReplicaApplier::ReplicaApplier(Coordinator* coordinator, uint64_t epoch)
    : coordinator_(coordinator), epoch_(epoch) {}

absl::Status ReplicaApplier::Start(const v1::JobReplica& m) {
  assembly_ = Assembly();
  JobReplica& r = assembly_.replica;
  r.job_id = m.job_id();
  absl::StatusOr<Layout> layout = LayoutFromProto(m.layout());
  if (!layout.ok()) return layout.status();
  r.layout = *std::move(layout);
  absl::StatusOr<JobSettings> settings = SettingsFromProto(m.settings());
  if (!settings.ok()) return settings.status();
  // Before anything is sized by them (an open round's delta).
  if (absl::Status s =
          ValidateComplete(*settings, coordinator_->options().settings_limits(),
                           absl::StrCat("replica of job '", m.job_id(), "': "));
      !s.ok()) {
    return s;
  }
  r.settings = *settings;
  r.sequence = m.sequence();
  for (const v1::RoundStatus& s : m.recent_rounds()) {
    r.recent_rounds.push_back(RoundRecordFromProto(s));
  }
  r.members = MembersFromProto(m.members());
  if (m.has_state()) {
    assembly_.state = std::make_shared<StateSnapshot>();
    assembly_.state->round = m.round();
    assembly_.state->id = m.state_id();
  }
  assembly_.finals_left = m.final_chunks();
  return absl::OkStatus();
}

absl::Status ReplicaApplier::Add(const v1::ReplicaStateChunk& m) {
  Assembly* a = &assembly_;
  const std::string what =
      absl::StrCat("replica of job '", m.job_id(), "' chunk ", m.index());
  if (a->state == nullptr || m.job_id() != a->replica.job_id) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not of the job being caught up"));
  }
  std::vector<float> values, momentum, residual;
  for (auto [bytes, out] :
       {std::pair{&m.values(), &values}, std::pair{&m.momentum(), &momentum},
        std::pair{&m.residual(), &residual}}) {
    if (absl::Status s = FloatsFromBytes(*bytes, what, out); !s.ok()) return s;
  }
  StateSnapshot& s = *a->state;
  if (!m.open_round()) {
    if (m.index() != a->sizes.size() || a->partial != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": out of order"));
    }
    if (values.empty() || values.size() > a->replica.settings.chunk_elements ||
        (!momentum.empty() && momentum.size() != values.size()) ||
        (!residual.empty() && residual.size() != values.size())) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": sizes differ"));
    }
    a->offsets.push_back(s.values.size());
    a->sizes.push_back(values.size());
    s.values.insert(s.values.end(), values.begin(), values.end());
    s.momentum.insert(s.momentum.end(), momentum.begin(), momentum.end());
    s.residual.insert(s.residual.end(), residual.begin(), residual.end());
    return absl::OkStatus();
  }
  if (a->finals_left == 0 || m.index() >= a->sizes.size() ||
      values.size() != a->sizes[m.index()]) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a final chunk the header announced"));
  }
  const size_t n = s.values.size();
  if (a->partial == nullptr) {
    a->partial = std::make_shared<StateSnapshot>();
    a->replica.partial_values.assign(n, 0.0f);
    if (!momentum.empty()) a->partial->momentum.assign(n, 0.0f);
    if (!residual.empty()) a->partial->residual.assign(n, 0.0f);
    const WireCode wire = ResultCodeOf(a->replica.settings);
    const size_t last = a->sizes.size() - 1;
    a->partial->delta.assign(
        WireBytes(wire, a->replica.settings.chunk_elements) * last +
            WireBytes(wire, a->sizes[last]),
        '\0');
  }
  StateSnapshot& p = *a->partial;
  const size_t offset = a->offsets[m.index()];
  std::copy(values.begin(), values.end(),
            a->replica.partial_values.begin() + offset);
  if (momentum.size() == values.size() && p.momentum.size() == n) {
    std::copy(momentum.begin(), momentum.end(), p.momentum.begin() + offset);
  }
  if (residual.size() == values.size() && p.residual.size() == n) {
    std::copy(residual.begin(), residual.end(), p.residual.begin() + offset);
  }
  const WireCode wire = ResultCodeOf(a->replica.settings);
  const size_t at =
      WireBytes(wire, a->replica.settings.chunk_elements) * m.index();
  if (m.delta().size() != WireBytes(wire, values.size()) ||
      at + m.delta().size() > p.delta.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": its delta"));
  }
  std::memcpy(p.delta.data() + at, m.delta().data(), m.delta().size());
  a->replica.final_chunks.push_back(m.index());
  --a->finals_left;
  return absl::OkStatus();
}

absl::Status ReplicaApplier::Flush() {
  if (!assembling_) return absl::OkStatus();
  assembling_ = false;
  if (assembly_.finals_left != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica of job '", assembly_.replica.job_id,
        "': ", assembly_.finals_left, " final chunks announced are missing"));
  }
  assembly_.replica.state = assembly_.state;
  assembly_.replica.partial = assembly_.partial;
  cuts_[assembly_.replica.job_id] = assembly_.replica.sequence;
  return coordinator_->AdoptReplica(assembly_.replica);
}

bool ReplicaApplier::InCatchUp(const std::string& job_id,
                               uint64_t sequence) const {
  auto cut = cuts_.find(job_id);
  return cut != cuts_.end() && sequence <= cut->second;
}

absl::Status ReplicaApplier::ApplyChunk(const v1::ReplicaUpdate& update) {
  const v1::ChunkFinal& m = update.chunk();
  if (InCatchUp(m.job_id(), update.sequence())) return absl::OkStatus();
  ReplicatedChunk c;
  c.job_id = m.job_id();
  c.round = m.round();
  c.chunk = m.index();
  c.contributed = m.contributed();
  if (absl::Status s =
          FloatsFromBytes(m.mean(), "a replicated chunk's mean", &c.mean);
      !s.ok()) {
    return s;
  }
  c.encoded_mean = m.encoded_mean();
  return coordinator_->ApplyReplicated(c);
}

absl::Status ReplicaApplier::ApplyCommit(const v1::ReplicaUpdate& update) {
  const v1::StateCommit& m = update.commit();
  if (InCatchUp(m.job_id(), update.sequence())) return absl::OkStatus();
  ReplicatedCommit c;
  c.job_id = m.job_id();
  c.round = m.round();
  c.state_id = m.state_id();
  c.previous_id = m.previous_id();
  c.record = RoundRecordFromProto(m.record());
  c.record.contributor_weight = m.contributor_weight();
  c.members = MembersFromProto(m.members());
  if (m.seed()) {
    auto seed = std::make_shared<StateSnapshot>();
    if (absl::Status s = FloatsFromBytes(m.seed_values(), "a replicated seed",
                                         &seed->values);
        !s.ok()) {
      return s;
    }
    c.seed = std::move(seed);
    absl::StatusOr<Layout> layout = LayoutFromProto(m.layout());
    if (!layout.ok()) return layout.status();
    absl::StatusOr<JobSettings> settings = SettingsFromProto(m.settings());
    if (!settings.ok()) return settings.status();
    c.layout = *std::move(layout);
    c.settings = *settings;
  }
  if (absl::Status s = coordinator_->ApplyReplicated(c); !s.ok()) return s;
  cuts_.erase(m.job_id());
  return absl::OkStatus();
}

absl::StatusOr<ReplicaApplier::Applied> ReplicaApplier::Apply(
    const v1::ReplicaUpdate& update) {
  if (update.epoch() < epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "an update of epoch ", update.epoch(), "; this standby has seen epoch ",
        epoch_, " (a deposed primary)"));
  }
  if (!began_) {
    began_ = true;
    coordinator_->BeginFollowing();
  }
  Applied applied;
  absl::Status status;
  switch (update.kind_case()) {
    case v1::ReplicaUpdate::kJob:
      status = Flush();
      if (status.ok()) status = Start(update.job());
      assembling_ = status.ok();
      break;
    case v1::ReplicaUpdate::kStateChunk:
      status = assembling_ ? Add(update.state_chunk())
                           : absl::InvalidArgumentError(
                                 "a state chunk outside a job's replica");
      break;
    case v1::ReplicaUpdate::kCaughtUp:
      status = Flush();
      applied.caught_up = true;
      applied.through = update.caught_up().through();
      applied.acknowledge = true;
      break;
    case v1::ReplicaUpdate::kDropped:
      dropped_ = true;
      status = absl::AbortedError(
          absl::StrCat("the primary goes on without this standby: ",
                       update.dropped().why()));
      break;
    case v1::ReplicaUpdate::kChunk:
      status = Flush();
      if (status.ok()) status = ApplyChunk(update);
      applied.acknowledge = true;
      break;
    case v1::ReplicaUpdate::kCommit:
      status = Flush();
      if (status.ok()) status = ApplyCommit(update);
      applied.acknowledge = true;
      break;
    default:
      status = absl::InvalidArgumentError("an update of no known kind");
  }
  if (!status.ok()) return status;
  return applied;
}

}  // namespace localsgd
