#include "src/job.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "src/codec.h"
#include "src/failpoint.h"
#include "src/member_ref.h"
#include "src/observer.h"
#include "src/settings.h"

namespace localsgd {
namespace {

absl::Status Stopping() {
  return absl::UnavailableError(
      "coordinator is shutting down; retry later or against another replica");
}

absl::Status Draining(absl::string_view what) {
  return absl::UnavailableError(
      absl::StrCat("coordinator is draining (shutting down) and ", what,
                   "; retry, it or its replacement will take it"));
}

}  // namespace

Job::Job(std::string job_id, Layout layout, uint64_t num_elements,
         JobSettings settings, JobPolicy policy, Clock* clock, StateSink* sink,
         CoordinatorObserver* observer, Replicator* replicator,
         TickAlarm* alarm)
    : id_(std::move(job_id)),
      layout_(std::move(layout)),
      settings_(settings),
      policy_(policy),
      geometry_(num_elements, settings.chunk_elements),
      clock_(clock),
      sink_(sink),
      observer_(observer),
      replicator_(replicator),
      alarm_(alarm),
      members_(id_, policy.lease_ttl, policy.max_members, clock->Now()),
      commit_(settings, geometry_),
      pacing_(
          id_, settings.rendezvous_members,
          settings.deadline_mode == DeadlineMode::kAdaptive,
          CloseRules{policy.round_deadline, policy.min_quorum,
                     settings.contribution == Contribution::kPseudoGradients &&
                         settings.max_staleness >= 1}),
      guard_(geometry_.num_chunks(),
             settings.contribution == Contribution::kPseudoGradients
                 ? settings.outlier_ratio
                 : 0.0f),
      history_(policy.max_recent_rounds) {}

Job::~Job() = default;

bool Job::RetireIfEmptyFor(absl::Time now, absl::Duration ttl) {
  absl::MutexLock lock(&mu_);
  if (retired_ || stopped_ || !members_.EmptyFor(now, ttl)) return false;
  retired_ = true;
  return true;
}

void Job::RestoreState(RoundId round, std::vector<float> values) {
  RestoreState(round, std::move(values), 0, {}, {});
}

void Job::RestoreState(RoundId round, std::vector<float> values, uint64_t id,
                       std::vector<float> momentum, std::vector<float> residual,
                       std::vector<float> mean_residual,
                       std::vector<uint64_t> ancestors, uint32_t participants) {
  absl::MutexLock lock(&mu_);
  members_.ResetEmptySince(clock_->Now());
  commit_.Restore(round, std::move(values), id, std::move(momentum),
                  std::move(residual), std::move(mean_residual),
                  std::move(ancestors));
  released_state_ = commit_.shared_state();
  state_ticket_ = 0;
  // The members are not checkpointed: give them one lease to come back, so
  // that the first one to return does not close the next round alone; as
  // many as took part in the state's round back end it sooner.
  pacing_.Restored(round, clock_->Now() + policy_.lease_ttl, participants);
}

void Job::RunDeferred(Deferred& deferred) {
  for (auto& fn : deferred) fn();
  deferred.clear();
}

void Job::FailAll(Waiters& waiters, const absl::Status& status,
                  Deferred& deferred) {
  for (auto& [wid, w] : waiters) {
    deferred.push_back([done = std::move(w.done), status] { done(status); });
  }
  waiters.clear();
}

absl::StatusOr<JoinResult> Job::Join(const JoinRequestParams& params) {
  const absl::Time now = clock_->Now();
  Deferred deferred;
  JoinResult result;
  absl::StatusOr<MemberId> id;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckJoinLocked(params); !s.ok()) return s;
    id = JoinLocked(params, now, deferred);
    if (id.ok()) {
      result.member_id = *id;
      result.settings = settings_;
      result.has_state = commit_.state() != nullptr;
      result.state_round = commit_.state_round();
      result.state_id = commit_.state_id();
      result.geometry = geometry_;
    }
  }
  // Also when the Join failed: a replaced incarnation is gone either way.
  RunDeferred(deferred);
  if (!id.ok()) return id.status();
  return result;
}

absl::Status Job::CheckJoinLocked(const JoinRequestParams& params) const {
  if (stopped_) return Stopping();
  if (retired_) {
    return absl::UnavailableError(absl::StrCat(
        "job '", id_,
        "' was just reclaimed (it had no members); retry the Join to create "
        "it anew"));
  }
  if (draining_) return Draining("takes no new members");
  const std::string diff = FirstDifference(layout_, params.layout);
  if (!diff.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layout differs from job '", id_, "': ", diff,
                     "; every member of a job must average the same model"));
  }
  if (const std::string d = FirstDifference(settings_, params.settings);
      !d.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id_, "' ", d));
  }
  return absl::OkStatus();
}

absl::StatusOr<MemberId> Job::JoinLocked(const JoinRequestParams& params,
                                         absl::Time now, Deferred& deferred) {
  absl::StatusOr<Membership::Found> found = members_.FindJoined(params, now);
  if (!found.ok()) return found.status();
  if (!found->retried.empty()) return found->retried;
  if (!found->replaced.empty()) {
    RemoveMemberLocked(found->replaced, "replaced by a new incarnation",
                       deferred);
  }
  // Joining while a round is open: take part from the next one, unless the
  // job is still gathering members; then the open round admits the joiner
  // (it starts from the same state as the rest). (Never once a chunk is
  // final: its result must not change. A Join whose `now` was read before
  // another call's ended the gathering could find it still active.)
  const bool admit = open_ != nullptr && !open_->round.any_final_from_sums() &&
                     pacing_.Gathers(open_->round, now);
  const RoundId first_round = admit                        ? open_->round.id()
                              : commit_.state() == nullptr ? 1
                              : open_ != nullptr ? open_->round.id() + 1
                                                 : commit_.state()->round + 1;
  absl::StatusOr<const MemberInfo*> info =
      members_.Add(params, first_round, now);
  if (!info.ok()) return info.status();
  if (admit) {
    open_->round.AddParticipant(**info);
    open_->round.FitScale();
  }
  return (*info)->id;
}

absl::Status Job::CheckPrincipal(const MemberId& member,
                                 absl::string_view principal) {
  absl::MutexLock lock(&mu_);
  return members_.CheckPrincipal(member, principal);
}

absl::Status Job::Leave(const MemberId& member) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    RemoveMemberLocked(member, "left", deferred);
  }
  RunDeferred(deferred);
  return absl::OkStatus();
}

absl::StatusOr<RoundId> Job::Heartbeat(const MemberId& member) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (members_.Renew(member, now) == nullptr) return members_.NotFound(member);
  return commit_.state_round();
}

absl::StatusOr<std::unique_ptr<SyncSession>> Job::BeginSync(
    const MemberId& member, RoundId round, SyncCallback done, SeedOrigin origin,
    uint64_t anchor, FinalChunksCallback on_final, SyncWork work) {
  const absl::Time now = clock_->Now();
  Deferred deferred;
  std::unique_ptr<SyncSession> session;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return Stopping();
    const MemberInfo* info = members_.Renew(member, now);
    if (info == nullptr) return members_.NotFound(member);
    if (absl::Status s = CheckSyncHeader(id_, info->name, round, origin, anchor,
                                         pseudo_gradients());
        !s.ok()) {
      return s;
    }
    if (work.local_steps > static_cast<int64_t>(kMaxLocalSteps)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Sync header of member ", info->name, " of job '", id_,
                       "' for round ", round, " says local_steps ",
                       work.local_steps, "; at most ", kMaxLocalSteps));
    }
    if (work.weight.has_value() &&
        (round == 0 || !pseudo_gradients() || !std::isfinite(*work.weight) ||
         *work.weight < 1e-6 || *work.weight > 1e6)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Sync header of member ", info->name, " of job '", id_,
          "' for round ", round, " says weight ", *work.weight,
          round == 0 || !pseudo_gradients()
              ? "; only a pseudo-gradient contribution (round >= 1) has one"
              : "; a weight is finite and in [1e-6, 1e6]"));
    }
    if (round == 0) {
      if (commit_.state() == nullptr && seed_ == nullptr && draining_) {
        return Draining("starts no seed");
      }
      if (reseeded_ && !draining_ && seed_ == nullptr &&
          commit_.state() != nullptr && origin.round > commit_.state()->round) {
        SupersedeReseedLocked(*info, origin, deferred);
      }
      session = BeginSeedLocked(*info, origin, std::move(done), deferred);
    } else if (commit_.state() == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id_,
                       "' has no global state yet; seed it with a Sync of "
                       "round 0 (Client::Initialize) before round ",
                       round));
    } else if (round <= commit_.state()->round ||
               (pseudo_gradients() && anchor != commit_.state()->id)) {
      // Late; or, in a pseudo-gradient job, a delta against another state
      // than the job's: merged if it is stale within max_staleness,
      // otherwise never averaged, and the member adopts.
      const int staleness = commit_.Staleness(anchor);
      const RoundId state_round = commit_.state()->round;
      // For the round after its anchor, and not a retry of a contribution
      // that was counted (a delta of one anchor is merged once).
      const bool stale =
          pseudo_gradients() && staleness >= 1 &&
          round + static_cast<RoundId>(staleness) == state_round + 1;
      if (stale && info->stale_anchor == anchor) {
        if (info->stale_counted) {
          session =
              AnswerCountedStaleLocked(*info, round, std::move(done), deferred);
        }
      } else if (stale && round > info->last_counted_round &&
                 sealed_ == nullptr) {
        if (open_ == nullptr && draining_) {
          return Draining("opens no new round");
        }
        session =
            BeginStaleLocked(*info, anchor, static_cast<uint32_t>(staleness),
                             work, done, now, deferred);
      }
      if (session == nullptr) {
        if (round == state_round + 1) {
          LOG(WARNING) << "job " << id_ << ": " << info->name
                       << " contributes to round " << round
                       << " against another state than the job's round "
                       << state_round << "; it adopts the job's state";
        }
        session = BeginLateLocked(*info, round, anchor, work.local_steps,
                                  std::move(done), deferred);
      }
    } else if (round == commit_.state()->round + 1 && sealed_ != nullptr &&
               (!pseudo_gradients() || anchor == commit_.state()->id)) {
      // A regional job's round waiting for its upstream answer: the Sync
      // adopts its result.
      session = WaitSealedLocked(*info, round, std::move(done));
    } else if (round == commit_.state()->round + 1) {
      if (open_ == nullptr && draining_) {
        return Draining("opens no new round");
      }
      session = BeginRoundLocked(*info, round, std::move(done),
                                 std::move(on_final), work, now, deferred);
    } else {
      return absl::FailedPreconditionError(absl::StrCat(
          "member ", info->name, " syncs for round ", round, " but job '", id_,
          "' is at round ", commit_.state()->round, " (next round ",
          commit_.state()->round + 1,
          "); did the coordinator restart without its state? join again"));
    }
  }
  RunDeferred(deferred);
  return session;
}

std::unique_ptr<SyncSession> Job::BeginStaleLocked(
    const MemberInfo& member, uint64_t anchor, uint32_t staleness,
    const SyncWork& work, SyncCallback& done, absl::Time now,
    Deferred& deferred) {
  const int64_t steps = work.local_steps;
  const RoundId next = commit_.state()->round + 1;
  if (open_ != nullptr && open_->round.Banked(member.id, anchor)) {
    // A retry of a contribution banked in the open round: counted.
    return AnswerCountedStaleLocked(member, open_->round.id(), std::move(done),
                                    deferred);
  }
  if (open_ == nullptr) {
    // Only a member that takes part in the next round opens it.
    if (member.first_round > next) return nullptr;
    OpenRoundLocked(next, now);
    // The members in step set the round's pace, not this one.
    open_->round.HoldClock();
  }
  // Its staleness as of the open round's previous state, which is the
  // job's current one.
  if (!open_->round.BeginContribution(member.id, steps, anchor, staleness,
                                      StepWeight(steps, settings_), now,
                                      work.weight.value_or(0))) {
    return nullptr;
  }
  const Participant* p = open_->round.Find(member.id);
  LOG(INFO) << "job " << id_ << ": " << member.name << "'s delta against round "
            << next - 1 - staleness << " (" << staleness
            << " rounds stale) goes into round " << next << " with weight "
            << p->weight;
  const uint64_t waiter_id = next_waiter_id_++;
  Waiter waiter{member.id, std::move(done), /*participant=*/true, nullptr};
  waiter.staleness = staleness;
  open_->waiters.emplace(waiter_id, std::move(waiter));
  return NewSession(member.id, open_->round.id(),
                    p->complete() ? SyncSession::Role::kAdopt
                                  : SyncSession::Role::kContribute,
                    waiter_id);
}

std::unique_ptr<SyncSession> Job::AnswerCountedStaleLocked(
    const MemberInfo& member, RoundId round, SyncCallback done,
    Deferred& deferred) {
  ReleaseCountedStateLocked(member, /*staleness=*/0, std::move(done), deferred);
  return NewSession(member.id, round, SyncSession::Role::kAdopt, 0);
}

void Job::ReleaseCountedStateLocked(const MemberInfo& member,
                                    uint32_t staleness, SyncCallback done,
                                    Deferred& deferred) {
  SyncResult result = LatestResult(history_, commit_.shared_state(), member.id,
                                   commit_.state()->round, 0, member.name);
  result.local_steps_budget =
      HandResultLocked(member.id, clock_->Now(), WorkMediansLocked());
  result.contributed = true;
  result.late = false;
  result.delta = false;
  result.staleness = staleness;
  ReleaseLocked(
      state_ticket_,
      [done = std::move(done), result = std::move(result)] { done(result); },
      deferred);
}

std::unique_ptr<SyncSession> Job::NewSession(const MemberId& member,
                                             RoundId round,
                                             SyncSession::Role role,
                                             uint64_t waiter_id) {
  return std::unique_ptr<SyncSession>(
      new SyncSession(shared_from_this(), member, round, role, waiter_id,
                      geometry_.num_chunks()));
}

std::unique_ptr<SyncSession> Job::BeginSeedLocked(const MemberInfo& member,
                                                  const SeedOrigin& origin,
                                                  SyncCallback done,
                                                  Deferred& deferred) {
  if (commit_.state() != nullptr) {
    SyncResult result = LatestResult(history_, commit_.shared_state(),
                                     member.id, 0, 0, member.name);
    result.local_steps_budget =
        HandResultLocked(member.id, clock_->Now(), WorkMediansLocked());
    ReleaseLocked(
        state_ticket_,
        [done = std::move(done), result = std::move(result)] { done(result); },
        deferred);
    return NewSession(member.id, 0, SyncSession::Role::kAdopt, 0);
  }
  if (seed_ == nullptr) {
    // A pseudo-gradient job's seed is float32 (one per element).
    seed_ = std::make_unique<Seed>(
        SeedState(member.id, origin, commit_.TakeBuffer(), geometry_));
    LOG(INFO) << "job " << id_ << ": " << member.name << " "
              << seed_->state.Describe();
  }
  const bool owner = seed_->state.owner() == member.id;
  const uint64_t waiter_id = next_waiter_id_++;
  seed_->waiters.emplace(waiter_id,
                         Waiter{member.id, std::move(done), owner, nullptr});
  return NewSession(
      member.id, 0,
      owner ? SyncSession::Role::kSeed : SyncSession::Role::kAdopt, waiter_id);
}

std::unique_ptr<SyncSession> Job::BeginLateLocked(
    const MemberInfo& member, RoundId round, uint64_t anchor, int64_t steps,
    SyncCallback done, Deferred& deferred) {
  // A straggler (or a retry after its round closed): adopt the latest.
  SyncResult result = LatestResult(history_, commit_.shared_state(), member.id,
                                   round, anchor, member.name);
  result.local_steps_budget =
      HandResultLocked(member.id, clock_->Now(), WorkMediansLocked());
  if (!result.contributed) {
    const uint64_t late_steps = steps > 0 ? static_cast<uint64_t>(steps) : 0;
    history_.MarkLate(round, member.name, late_steps);
    steps_.late += late_steps;
    LOG(INFO) << "job " << id_ << ": " << member.name << " is late for round "
              << round << "; adopts round " << commit_.state()->round;
    if (observer_ != nullptr) {
      deferred.push_back([observer = observer_, id = id_, round, late_steps] {
        observer->LateContribution(id, round);
        if (late_steps > 0) observer->LateSteps(id, late_steps);
      });
    }
  }
  ReleaseLocked(
      state_ticket_,
      [done = std::move(done), result = std::move(result)] { done(result); },
      deferred);
  return NewSession(member.id, round, SyncSession::Role::kAdopt, 0);
}

std::unique_ptr<SyncSession> Job::BeginRoundLocked(
    const MemberInfo& member, RoundId round, SyncCallback done,
    FinalChunksCallback on_final, const SyncWork& work, absl::Time now,
    Deferred& deferred) {
  const int64_t steps = work.local_steps;
  if (open_ == nullptr) OpenRoundLocked(round, now);
  const bool participant = open_->round.Find(member.id) != nullptr;
  if (participant) {
    open_->round.BeginContribution(member.id, steps, 0, 0,
                                   StepWeight(steps, settings_), now,
                                   work.weight.value_or(0));
  }
  // A fresh contribution starts the clock of a round a stale one opened.
  open_->round.StartClock(now);
  const uint64_t waiter_id = next_waiter_id_++;
  if (on_final != nullptr && open_->next != nullptr) {
    // Chunks released before this stream came (a retry, an adopting
    // member).
    std::vector<uint32_t> indices = ReleasedChunksLocked();
    if (!indices.empty()) {
      deferred.push_back(
          [on_final, indices = std::move(indices),
           next = std::shared_ptr<const StateSnapshot>(open_->next)]() mutable {
            on_final(std::move(indices), std::move(next));
          });
    }
  }
  open_->waiters.emplace(waiter_id, Waiter{member.id, std::move(done),
                                           participant, std::move(on_final)});
  return NewSession(
      member.id, round,
      participant ? SyncSession::Role::kContribute : SyncSession::Role::kAdopt,
      waiter_id);
}

void Job::OpenRoundLocked(RoundId round, absl::Time now) {
  // What the outlier guard held belonged to a round that is gone without
  // closing (a re-seed superseded it): never judged into this one.
  guard_.DropHeld();
  open_ = std::make_unique<OpenRound>(RoundState(
      round, now, geometry_, commit_.TakeBuffer(), pseudo_gradients(),
      settings_.deadline_mode == DeadlineMode::kAdaptive));
  open_->serial = ++round_serial_;
  if (pseudo_gradients()) {
    open_->released.assign(geometry_.num_chunks(), false);
    if (mirror_ != nullptr && mirror_->round == round &&
        mirror_->num_final > 0) {
      // Promoted: the chunks the primary finalized (and may have sent)
      // stay as they are.
      open_->next = std::move(mirror_->next);
      open_->prefinal_values = std::move(mirror_->values);
      for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
        if (!mirror_->final[c]) continue;
        open_->round.MarkPrefinal(c);
        open_->released[c] = true;
      }
      LOG(INFO) << "job " << id_ << ": round " << round << " opens with "
                << mirror_->num_final
                << " chunks final, as its former primary computed them";
    } else {
      open_->next = commit_.NewNext();
    }
    mirror_.reset();
  }
  for (const MemberInfo* m : members_.TakingPartIn(round)) {
    open_->round.AddParticipant(*m);
  }
  open_->round.FitScale();
  VLOG(1) << "job " << id_ << ": round " << round << " opened with "
          << open_->round.participants().size() << " participants";
}

absl::Status Job::AddChunk(SyncSession& session, uint32_t index,
                           absl::Span<const absl::string_view> pieces,
                           ChunkMagnitude magnitude) {
  // SyncSession::AddChunk checked it.
  if (session.got_[index]) return absl::OkStatus();
  const absl::Time now = clock_->Now();
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return Stopping();
    if (members_.Renew(session.member_, now) == nullptr) {
      return members_.NotFound(session.member_);
    }
    bool handled = false;
    if (session.role_ == SyncSession::Role::kContribute && open_ != nullptr &&
        open_->next != nullptr && open_->round.id() == session.round_ &&
        !open_->round.IsFinal(index)) {
      // The finite-state guard: a delta that could make the next state
      // non-finite is refused, and the round goes on without it.
      if (absl::Status headroom =
              commit_.CheckHeadroom(index, magnitude.max_abs);
          !headroom.ok()) {
        RejectLocked(session.member_, session.round_, index, headroom.message(),
                     now, deferred);
        handled = true;
      } else if (guard_.enabled()) {
        GuardContributionLocked(session.member_, session.round_, index, pieces,
                                std::sqrt(magnitude.sum_of_squares), now,
                                deferred);
        handled = true;
      }
    }
    if (!handled) {
      if (absl::Status s =
              ApplyChunkLocked(session, index, pieces, now, deferred);
          !s.ok()) {
        return s;
      }
    } else if (open_ != nullptr && guard_.any_held()) {
      // Held by the outlier guard: judged at the deadline at the latest.
      ArmAlarmLocked(pacing_.Decide(open_->round, now), now);
    }
  }
  // Also a refused chunk: the stream goes on and completes, and gets the
  // round's result (contributed = false).
  session.Delivered(index);
  RunDeferred(deferred);
  return absl::OkStatus();
}

absl::Status Job::ApplyChunkLocked(const SyncSession& session, uint32_t index,
                                   absl::Span<const absl::string_view> pieces,
                                   absl::Time now, Deferred& deferred) {
  switch (session.role_) {
    case SyncSession::Role::kSeed: {
      if (seed_ == nullptr || seed_->state.owner() != session.member_) {
        return absl::OkStatus();
      }
      absl::StatusOr<bool> complete =
          seed_->state.Add(index, pieces, ChunkCode(session));
      if (!complete.ok()) return complete.status();
      // A regional job's seed gone up waits for its answer.
      if (*complete && seed_->upstream_serial == 0) {
        CompleteSeedLocked(now, deferred);
      }
      return absl::OkStatus();
    }
    case SyncSession::Role::kContribute:
      ApplyContributionLocked(session.member_, session.round_, index, pieces,
                              ChunkCode(session), now, deferred);
      return absl::OkStatus();
    case SyncSession::Role::kAdopt:
      break;
  }
  return absl::OkStatus();
}

void Job::ApplyContributionLocked(const MemberId& member, RoundId round,
                                  uint32_t index,
                                  absl::Span<const absl::string_view> pieces,
                                  WireCode code, absl::Time now,
                                  Deferred& deferred) {
  if (open_ == nullptr || open_->round.id() != round) return;
  // The whole chunk goes in under the lock: simple and, at a few hundred
  // KiB per chunk and ~17 GB/s, short.
  const RoundState::Added added =
      open_->round.Add(member, index, pieces, code, now);
  if (added == RoundState::Added::kIgnored) return;
  if (added == RoundState::Added::kCompleted &&
      BankStaleLocked(member, deferred)) {
    return;
  }
  if (open_->next != nullptr) MaybeFinalizeChunkLocked(index, now, deferred);
  if (added == RoundState::Added::kCompleted) {
    MaybeCloseRoundLocked(now, deferred);
  }
}

bool Job::BankStaleLocked(const MemberId& member, Deferred& deferred) {
  const Participant* p = open_->round.Find(member);
  if (p == nullptr || p->staleness == 0) return false;
  // The last of the participants: the round closes now, and answers it.
  bool others = false;
  for (const auto& [id, q] : open_->round.participants()) {
    if (id != member && !q.complete() && !q.gone) others = true;
  }
  const MemberInfo* info = members_.Get(member);
  if (!others || info == nullptr || !open_->round.Bank(*info)) return false;
  auto waiter = std::find_if(
      open_->waiters.begin(), open_->waiters.end(), [&](const auto& entry) {
        return entry.second.member == member && entry.second.staleness > 0;
      });
  if (waiter == open_->waiters.end()) return true;  // cancelled: counted
  const uint32_t staleness = waiter->second.staleness;
  SyncCallback done = std::move(waiter->second.done);
  open_->waiters.erase(waiter);
  VLOG(1) << "job " << id_ << ": " << info->name << "'s stale delta is banked "
          << "in round " << open_->round.id() << "; it goes on from round "
          << commit_.state()->round;
  ReleaseCountedStateLocked(*info, staleness, std::move(done), deferred);
  return true;
}

void Job::GuardContributionLocked(const MemberId& member, RoundId round,
                                  uint32_t index,
                                  absl::Span<const absl::string_view> pieces,
                                  double norm, absl::Time now,
                                  Deferred& deferred) {
  const Participant* p = open_->round.Find(member);
  // Not a participant that can still give it: ignored, as RoundState::Add
  // ignores it.
  if (p == nullptr || p->gone || p->got[index] || guard_.Holds(index, member)) {
    return;
  }
  std::string why;
  switch (guard_.Judge(index, norm, &why)) {
    case OutlierGuard::Verdict::kAccept: {
      guard_.Accept(index, norm);
      const uint64_t serial = open_->serial;
      ApplyContributionLocked(member, round, index, pieces,
                              WireCodeOf(settings_), now, deferred);
      // A zero delta, accepted at once, may be the last that others' held
      // ones of the chunk waited for.
      if (open_ != nullptr && open_->serial == serial &&
          guard_.HoldsChunk(index) && NoneOweLocked(index)) {
        JudgeHeldLocked(index, now, deferred);
      }
      return;
    }
    case OutlierGuard::Verdict::kReject:
      // Counted first: the refusal may close the round.
      ++open_->outlier_refused;
      if (!RejectLocked(member, round, index, why, now, deferred)) {
        --open_->outlier_refused;  // nothing changed
      }
      return;
    case OutlierGuard::Verdict::kHold:
      guard_.Hold(index, member, pieces, norm);
      if (guard_.Due(index) || NoneOweLocked(index)) {
        JudgeHeldLocked(index, now, deferred);
      }
      return;
  }
}

bool Job::NoneOweLocked(uint32_t c) const {
  if (open_ == nullptr) return true;
  for (const auto& [id, p] : open_->round.participants()) {
    if (!p.gone && !p.got[c] && !guard_.Holds(c, id)) return false;
  }
  return true;
}

void Job::JudgeHeldLocked(uint32_t c, absl::Time now, Deferred& deferred) {
  if (open_ == nullptr) {
    guard_.Release(c);
    return;
  }
  const RoundId round = open_->round.id();
  const uint64_t serial = open_->serial;
  // The round closes after all of them are in (an accepted chunk may
  // complete a participant, and a deadline close it with the others'
  // chunks still in this loop).
  ++judging_;
  for (OutlierGuard::Judged& j : guard_.Release(c)) {
    if (open_ == nullptr || open_->serial != serial) break;
    if (j.accepted) {
      const absl::string_view bytes = j.bytes;
      ApplyContributionLocked(j.member, round, c,
                              absl::MakeConstSpan(&bytes, 1),
                              WireCodeOf(settings_), now, deferred);
    } else {
      // Counted first: the refusal may close the round.
      ++open_->outlier_refused;
      if (!RejectLocked(j.member, round, c, j.why, now, deferred)) {
        --open_->outlier_refused;  // nothing changed
      }
    }
  }
  if (--judging_ == 0) MaybeCloseRoundLocked(now, deferred);
}

void Job::JudgeDueHeldLocked(absl::Time now, Deferred& deferred) {
  ++judging_;
  for (uint32_t c : guard_.HeldChunks()) {
    if (guard_.Due(c) || NoneOweLocked(c)) JudgeHeldLocked(c, now, deferred);
  }
  if (--judging_ == 0) MaybeCloseRoundLocked(now, deferred);
}

void Job::JudgeAllHeldLocked(absl::Time now, Deferred& deferred) {
  ++judging_;
  for (uint32_t c : guard_.HeldChunks()) JudgeHeldLocked(c, now, deferred);
  if (--judging_ == 0) MaybeCloseRoundLocked(now, deferred);
}

void Job::DropNonFinite(SyncSession& session, uint32_t index, int64_t bad) {
  const absl::Time now = clock_->Now();
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    RejectLocked(session.member_, session.round_, index,
                 absl::StrCat("a non-finite value at element ", bad,
                              " of chunk ", index, " (policy drop)"),
                 now, deferred);
  }
  // Its stream goes on; mark the chunk delivered so that the stream
  // completes and gets the round's result (contributed = false).
  session.Delivered(index);
  RunDeferred(deferred);
}

bool Job::RejectLocked(const MemberId& member, RoundId round, uint32_t index,
                       absl::string_view why, absl::Time now,
                       Deferred& deferred) {
  const Participant* p = open_ != nullptr && open_->round.id() == round
                             ? open_->round.Find(member)
                             : nullptr;
  if (p == nullptr || p->complete() || p->gone) return false;
  LOG(WARNING) << "job " << id_ << ": member " << p->name
               << "'s contribution to round " << round << " refused at chunk "
               << index << ": " << why << "; dropped from the round, its "
               << p->received << " chunks so far stay counted";
  if (observer_ != nullptr) {
    deferred.push_back([observer = observer_, id = id_] {
      observer->ContributionRejected(id);
    });
  }
  // As if it had left: the round stops waiting for it, its complete chunks
  // count, and the rest of its stream is ignored.
  DropFromRoundLocked(member, why, now, deferred);
  return true;
}

bool Job::CancelWaiter(const SyncSession& session) {
  if (session.waiter_id_ == 0) return false;
  Deferred deferred;
  bool removed = false;
  {
    absl::MutexLock lock(&mu_);
    if (open_ != nullptr && open_->round.id() == session.round_ &&
        session.round_ != 0) {
      removed = open_->waiters.erase(session.waiter_id_) > 0;
    }
    if (sealed_ != nullptr && sealed_->round.id() == session.round_ &&
        session.round_ != 0) {
      removed = sealed_->waiters.erase(session.waiter_id_) > 0 || removed;
    }
    if (session.round_ == 0 && seed_ != nullptr) {
      removed = seed_->waiters.erase(session.waiter_id_) > 0;
      if (session.role_ == SyncSession::Role::kSeed &&
          seed_->state.owner() == session.member_ && !session.complete()) {
        AbortSeedLocked("its stream ended before all chunks arrived", deferred);
      }
    }
  }
  RunDeferred(deferred);
  return removed;
}

void Job::RemoveMemberLocked(const MemberId& member, absl::string_view why,
                             Deferred& deferred) {
  if (!members_.Remove(member, why, clock_->Now())) return;
  if (seed_ != nullptr && seed_->state.owner() == member) {
    AbortSeedLocked(why, deferred);
  }
  DropFromRoundLocked(member, /*rejected=*/{}, clock_->Now(), deferred);
}

void Job::DropFromRoundLocked(const MemberId& member,
                              absl::string_view rejected, absl::Time now,
                              Deferred& deferred) {
  if (open_ == nullptr || !open_->round.MarkGone(member, rejected)) return;
  const RoundId round = open_->round.id();
  const uint64_t serial = open_->serial;
  // What the outlier guard holds of it is not judged; what it holds of
  // the others may be due now that it owes nothing.
  guard_.Forget(member);
  JudgeDueHeldLocked(now, deferred);
  if (open_ == nullptr || open_->serial != serial) return;
  MaybeCloseRoundLocked(now, deferred);
  // Chunks only it had not given are final now.
  if (open_ != nullptr && open_->round.id() == round) {
    FinalizeGivenChunksLocked(now, deferred);
  }
}

void Job::MaybeCloseRoundLocked(absl::Time now, Deferred& deferred) {
  // The outlier guard judges held chunks: it decides once they are all in.
  if (open_ == nullptr || judging_ > 0) return;
  CloseDecision decision = pacing_.Decide(open_->round, now);
  if (decision.close && guard_.any_held()) {
    // What the outlier guard holds was given in time: judged, it counts
    // (or is refused) before the round closes.
    const uint64_t serial = open_->serial;
    JudgeAllHeldLocked(now, deferred);
    if (open_ == nullptr || open_->serial != serial) return;
    decision = pacing_.Decide(open_->round, now);
  }
  if (decision.close) {
    CloseRoundLocked(decision.reason, now, deferred);
  } else {
    ArmAlarmLocked(decision, now);
  }
}

void Job::ArmAlarmLocked(const CloseDecision& decision, absl::Time now) {
  if (alarm_ != nullptr && !decision.close &&
      decision.deadline != absl::InfiniteFuture()) {
    alarm_->After(decision.deadline - now);
  }
}

void Job::CloseRoundLocked(CloseReason reason, absl::Time now,
                           Deferred& deferred) {
  if (upstream_ != nullptr && pseudo_gradients()) {
    SealRoundLocked(reason, now, deferred);
    return;
  }
  std::unique_ptr<OpenRound> round = std::move(open_);
  std::shared_ptr<StateSnapshot> state;
  if (pseudo_gradients()) {
    for (uint32_t c : round->round.PendingChunks()) {
      FinalizeChunkLocked(*round, c);
    }
    if (!round->prefinal_values.empty()) {
      for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
        if (!round->round.IsPrefinal(c)) continue;
        absl::Span<float> to = round->round.sums().scaled_sums(c);
        std::copy_n(round->prefinal_values.begin() + geometry_.Offset(c),
                    to.size(), to.begin());
      }
      commit_.GiveBack(std::move(round->prefinal_values));
    }
    state = commit_.FinishNext(std::move(round->round.sums()), {},
                               std::move(round->next));
  } else {
    state = commit_.Mean(std::move(round->round.sums()));
    if (replicator_ != nullptr) {
      // A parameter job's chunks are its new values (what members get).
      for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
        ReplicatedChunk update;
        update.job_id = id_;
        update.round = round->round.id();
        update.chunk = c;
        update.contributed = true;
        const auto values =
            absl::MakeConstSpan(state->values)
                .subspan(geometry_.Offset(c), geometry_.Size(c));
        update.mean.assign(values.begin(), values.end());
        replicator_->Chunk(std::move(update));
      }
    }
  }
  RoundClosure closure = AccountCloseLocked(*round, reason, now);
  CommitLocked(std::move(closure.record), std::move(state),
               std::move(round->waiters), closure.refused, deferred);
}

RoundClosure Job::AccountCloseLocked(OpenRound& open, CloseReason reason,
                                     absl::Time now) {
  RoundClosure closure = open.round.Close(reason, now);
  ApplyClosureLocked(open, closure);
  return closure;
}

void Job::ApplyClosureLocked(OpenRound& open, const RoundClosure& closure) {
  OpenRound* round = &open;
  if (guard_.RoundClosed(round->outlier_refused,
                         static_cast<uint32_t>(closure.contributed.size()))) {
    LOG(WARNING) << "job " << id_ << ": round " << round->round.id()
                 << ": the outlier guard refused " << round->outlier_refused
                 << " participants and counted " << closure.contributed.size()
                 << ": the scale of the contributions changed; it learns "
                    "it anew from the next round";
  }
  for (const MemberId& id : closure.contributed) {
    members_.CountRound(id, /*contributed=*/true, round->round.id());
  }
  for (const MemberId& id : closure.timed_out) {
    members_.CountRound(id, /*contributed=*/false);
  }
  for (const RoundClosure::Stale& st : closure.stale) {
    members_.NoteStale(st.member, st.anchor, st.counted);
  }
  // Step rates and uploads, for budgets (and, with fixed ones, the phase
  // correction of a member handed its result late).
  for (const RoundClosure::Work& w : closure.work) {
    MemberInfo* m = members_.Mutable(w.member);
    // Its compute began when it was handed its last result.
    if (m == nullptr || m->result_at == absl::InfinitePast()) continue;
    m->work.Add(w.steps, w.began - m->result_at, w.completed - w.began);
  }
  steps_.Add(closure.record.steps);
  pacing_.Closed(closure);
}

void Job::SetUpstream(std::unique_ptr<Upstream> upstream) {
  upstream_ = std::move(upstream);
}

void Job::SealRoundLocked(CloseReason reason, absl::Time now,
                          Deferred& deferred) {
  std::unique_ptr<OpenRound> round = std::move(open_);
  // The weighted mean delta of each chunk (zeros where no one gave it),
  // the sums kept for the commit.
  RoundAccumulator& sums = round->round.sums();
  std::vector<float> mean(geometry_.num_elements(), 0.0f);
  for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
    if (sums.chunk_weight(c) <= 0) continue;
    const absl::Span<const float> sum = sums.scaled_sums(c);
    const absl::Span<float> to =
        absl::MakeSpan(mean).subspan(geometry_.Offset(c), sum.size());
    std::copy(sum.begin(), sum.end(), to.begin());
    DivideInPlace(to, sums.scaled_weight(c));
  }
  // What the close tells the members' records, the guard, the pacing and
  // the step counts waits for the answer: a round that fails upstream is
  // given again.
  round->closure = round->round.Close(reason, now);
  UpstreamRequest request;
  request.kind = UpstreamRequest::Kind::kRound;
  request.serial = ++upstream_serial_;
  request.round = round->round.id();
  request.base = commit_.shared_state();
  request.values = std::move(mean);
  request.weight = round->closure.contributed.empty()
                       ? 0
                       : round->closure.record.contributor_weight;
  // What a Sync may say (the limits of SyncHeader.weight and local_steps):
  // a region heavier than a member may be goes up as heavy as one may.
  if (request.weight > 0 && (request.weight < 1e-6 || request.weight > 1e6)) {
    const double clamped = std::clamp(request.weight, 1e-6, 1e6);
    LOG(WARNING) << "job " << id_ << ": round " << round->round.id()
                 << "'s weight " << request.weight << " goes up as " << clamped
                 << ", within what a contribution may weigh";
    request.weight = clamped;
  }
  const StepCounts& steps = round->closure.record.steps;
  if (steps.merged > 0) {
    request.local_steps =
        static_cast<int64_t>(std::min<uint64_t>(steps.merged, kMaxLocalSteps));
  }
  round->upstream_serial = request.serial;
  LOG(INFO) << "job " << id_ << ": round " << request.round << " ("
            << round->closure.contributed.size() << " contributors, weight "
            << request.weight << ") goes to the upstream job";
  sealed_ = std::move(round);
  deferred.push_back([upstream = upstream_.get(),
                      job = std::weak_ptr<Job>(shared_from_this()),
                      request = std::move(request)]() mutable {
    upstream->Submit(job, std::move(request));
  });
}

std::unique_ptr<SyncSession> Job::WaitSealedLocked(const MemberInfo& member,
                                                   RoundId round,
                                                   SyncCallback done) {
  const uint64_t waiter_id = next_waiter_id_++;
  sealed_->waiters.emplace(waiter_id,
                           Waiter{member.id, std::move(done), false, nullptr});
  return NewSession(member.id, round, SyncSession::Role::kAdopt, waiter_id);
}

void Job::CompleteUpstream(uint64_t serial, UpstreamAnswer answer) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    if (answer.status.ok() &&
        answer.values.size() != geometry_.num_elements()) {
      answer.status = absl::InternalError(
          absl::StrCat("the upstream answer has ", answer.values.size(),
                       " values; the job has ", geometry_.num_elements()));
    }
    for (size_t i = 0; answer.status.ok() && i < answer.values.size(); ++i) {
      if (!std::isfinite(answer.values[i])) {
        answer.status = absl::DataLossError(absl::StrCat(
            "the upstream answer holds a non-finite value at element ", i));
      }
    }
    if (seed_ != nullptr && seed_->upstream_serial == serial) {
      if (!answer.status.ok()) {
        AbortSeedLocked(
            absl::StrCat("its upstream: ", answer.status.ToString()), deferred);
      } else {
        // The state the upstream job holds (this seed, if it had none).
        seed_->state.TakeUpstream(answer.values);
        LOG(INFO) << "job " << id_ << ": the upstream job's state of round "
                  << answer.upstream_round << " seeds it";
        CompleteSeedLocked(clock_->Now(), deferred);
      }
    } else if (sealed_ != nullptr && sealed_->upstream_serial == serial) {
      CommitSealedLocked(std::move(answer), deferred);
    }
  }
  RunDeferred(deferred);
}

void Job::UpstreamChunk(uint64_t serial, uint64_t offset,
                        absl::Span<const float> step) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_ || sealed_ == nullptr || sealed_->upstream_serial != serial ||
        sealed_->next == nullptr || replicator_ != nullptr ||
        settings_.wire_dtype != DType::kFloat32) {
      return;
    }
    const uint64_t c64 = offset / geometry_.chunk_elements();
    if (c64 >= geometry_.num_chunks()) return;
    const uint32_t c = static_cast<uint32_t>(c64);
    OpenRound& round = *sealed_;
    if (round.released[c]) return;  // sent already
    if (geometry_.Offset(c) != offset || geometry_.Size(c) != step.size()) {
      if (!upstream_geometry_warned_) {
        upstream_geometry_warned_ = true;
        LOG(WARNING) << "job " << id_ << ": the upstream job's chunks ("
                     << step.size() << " elements at " << offset
                     << ") are not this job's (chunk_elements "
                     << geometry_.chunk_elements()
                     << "): its rounds' results reach its members only with "
                        "the upstream's whole answer; give both jobs the "
                        "same chunk_elements to pass them on as they come";
      }
      return;
    }
    for (float v : step) {
      if (!std::isfinite(v)) return;  // the whole answer says what
    }
    // As CommitSealedLocked does for every chunk: the step onto the state.
    const absl::Span<float> chunk = round.round.sums().scaled_sums(c);
    std::copy(step.begin(), step.end(), chunk.begin());
    if (!commit_.FinalizeMean(chunk, /*contributed=*/true, c, *round.next)) {
      return;  // not finite on the state: the whole answer's commit says so
    }
    round.released[c] = true;
    std::shared_ptr<const StateSnapshot> next = round.next;
    bool told = false;
    for (const auto& [wid, w] : round.waiters) {
      if (w.on_final == nullptr) continue;
      told = true;
      deferred.push_back([on_final = w.on_final, c, next] {
        on_final(std::vector<uint32_t>{c}, next);
      });
    }
    if (told) ++upstream_early_chunks_;
  }
  RunDeferred(deferred);
}

void Job::CommitSealedLocked(UpstreamAnswer answer, Deferred& deferred) {
  std::unique_ptr<OpenRound> round = std::move(sealed_);
  const RoundId id = round->round.id();
  if (answer.status.ok()) {
    // Chunks its members already got (UpstreamChunk): the answer must take
    // the same steps, or they would hold another state than the job's.
    const size_t stride =
        WireBytes(DType::kFloat32, geometry_.chunk_elements());
    for (uint32_t c = 0; c < round->released.size(); ++c) {
      if (!round->released[c]) continue;
      const size_t bytes = geometry_.Size(c) * sizeof(float);
      if (!answer.delta ||
          std::memcmp(answer.values.data() + geometry_.Offset(c),
                      round->next->delta.data() + stride * c, bytes) != 0) {
        answer.status = absl::AbortedError(absl::StrCat(
            "its upstream answer ",
            answer.delta ? absl::StrCat("differs at chunk ", c, " from")
                         : "is the upstream state whole, not",
            " the step its members got early"));
        break;
      }
    }
  }
  if (!answer.status.ok()) {
    LOG(WARNING) << "job " << id_ << ": round " << id
                 << " failed upstream; its members retry it: " << answer.status;
    // UNAVAILABLE whatever the upstream said: the members retry the round
    // (a FAILED_PRECONDITION or NOT_FOUND of the upstream's is not theirs
    // to mend by joining again here).
    FailAll(
        round->waiters,
        absl::UnavailableError(absl::StrCat(
            "round ", id, " of job '", id_, "' failed at its upstream job (",
            answer.status.ToString(), "); retry")),
        deferred);
    return;
  }
  RoundClosure& closure = round->closure;
  // What the round's members gave did not count upstream: their steps were
  // thrown away there, as a late member's are.
  auto not_counted = [&closure] {
    closure.record.contributors.clear();
    closure.record.contributor_ids.clear();
    closure.record.contributor_weight = 0;
    StepCounts& steps = closure.record.steps;
    steps.late += steps.merged;
    steps.merged = 0;
    steps.merged_stale = 0;
  };
  std::shared_ptr<StateSnapshot> state;
  if (answer.delta) {
    // The upstream round's step onto the state, as every member adds it
    // (the chunks sent early have it already).
    RoundAccumulator& sums = round->round.sums();
    for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
      if (!round->released.empty() && round->released[c]) continue;
      const absl::Span<float> chunk = sums.scaled_sums(c);
      const auto step = absl::MakeConstSpan(answer.values)
                            .subspan(geometry_.Offset(c), chunk.size());
      std::copy(step.begin(), step.end(), chunk.begin());
      if (!commit_.FinalizeMean(chunk, /*contributed=*/true, c, *round->next)) {
        LOG(ERROR) << "job " << id_ << ": chunk " << c << " of round " << id
                   << "'s upstream step was not finite; it keeps its state";
      }
    }
    state = commit_.FinishNext(std::move(sums), {}, std::move(round->next));
    if (!answer.counted) {
      LOG(WARNING) << "job " << id_ << ": round " << id
                   << " takes the upstream round " << answer.upstream_round
                   << "'s step; its contributions did not count there";
      not_counted();
    }
  } else {
    // The upstream state whole: what the round's members gave did not
    // count there; they adopt it.
    state = std::make_shared<StateSnapshot>();
    state->values = commit_.TakeBuffer();
    std::copy(answer.values.begin(), answer.values.end(),
              state->values.begin());
    LOG(WARNING) << "job " << id_ << ": round " << id
                 << " takes the upstream job's state of round "
                 << answer.upstream_round
                 << " whole; its contributions did not count there";
    not_counted();
  }
  ApplyClosureLocked(*round, closure);
  CommitLocked(std::move(closure.record), std::move(state),
               std::move(round->waiters), closure.refused, deferred);
}

void Job::FinalizeChunkLocked(OpenRound& round, uint32_t c) {
  RoundAccumulator& sums = round.round.sums();
  const bool contributed = sums.chunk_weight(c) > 0;
  const absl::Span<float> chunk = sums.scaled_sums(c);
  if (contributed) DivideInPlace(chunk, sums.scaled_weight(c));
  // What a standby gets: the mean as computed or as encoded.
  ReplicatedChunk update;
  std::string encoded_mean;
  if (contributed && commit_.encodes_mean()) {
    commit_.EncodeMean(chunk, c, *round.next, &encoded_mean);
  } else if (contributed && replicator_ != nullptr) {
    update.mean.assign(chunk.begin(), chunk.end());
  }
  if (!commit_.FinalizeMean(chunk, contributed, c, *round.next, encoded_mean)) {
    LOG(ERROR) << "job " << id_ << ": chunk " << c << " of round "
               << round.round.id()
               << "'s result was not finite; it keeps its state";
  }
  if (replicator_ != nullptr) {
    update.job_id = id_;
    update.round = round.round.id();
    update.chunk = c;
    update.contributed = contributed;
    update.encoded_mean = std::move(encoded_mean);
    round.chunk_ticket = replicator_->Chunk(std::move(update));
  }
  round.round.MarkFinal(c);
}

void Job::MaybeFinalizeChunkLocked(uint32_t c, absl::Time now,
                                   Deferred& deferred) {
  // A regional job's chunks are final only with the upstream's answer.
  if (upstream_ != nullptr) return;
  OpenRound& round = *open_;
  if (!round.round.ChunkReady(c, pacing_.Gathers(round.round, now))) return;
  FinalizeChunkLocked(round, c);
  TellFinalLocked({c}, deferred);
}

void Job::FinalizeHeldChunksLocked(absl::Time now, Deferred& deferred) {
  if (open_ == nullptr || !open_->round.held()) return;
  FinalizeGivenChunksLocked(now, deferred);
}

void Job::FinalizeGivenChunksLocked(absl::Time now, Deferred& deferred) {
  if (open_ == nullptr || open_->next == nullptr || upstream_ != nullptr) {
    return;
  }
  const std::vector<uint32_t> ready =
      open_->round.ReadyChunks(pacing_.Gathers(open_->round, now));
  for (uint32_t c : ready) FinalizeChunkLocked(*open_, c);
  if (!ready.empty()) TellFinalLocked(ready, deferred);
}

void Job::TellFinalLocked(const std::vector<uint32_t>& indices,
                          Deferred& deferred) {
  if (replicator_ != nullptr) {
    ReleaseLocked(
        open_->chunk_ticket,
        [self = shared_from_this(), serial = open_->serial, indices] {
          self->ReleaseFinal(serial, indices);
        },
        deferred);
    return;
  }
  for (uint32_t c : indices) open_->released[c] = true;
  std::shared_ptr<const StateSnapshot> next = open_->next;
  for (const auto& [wid, w] : open_->waiters) {
    if (w.on_final == nullptr) continue;
    deferred.push_back(
        [on_final = w.on_final, indices, next] { on_final(indices, next); });
  }
}

void Job::ReleaseLocked(uint64_t ticket, std::function<void()> release,
                        Deferred& deferred) {
  if (replicator_ == nullptr || ticket == 0) {
    deferred.push_back(std::move(release));
    return;
  }
  deferred.push_back(
      [replicator = replicator_, ticket, release = std::move(release)] {
        replicator->WhenAcked(ticket, release);
      });
}

void Job::ReleaseFinal(uint64_t serial, std::vector<uint32_t> indices) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    // Closed (or dropped, and another of the same number opened since).
    if (open_ == nullptr || open_->serial != serial) return;
    std::vector<uint32_t> fresh;
    for (uint32_t c : indices) {
      if (!open_->released[c]) {
        open_->released[c] = true;
        fresh.push_back(c);
      }
    }
    if (fresh.empty()) return;
    std::shared_ptr<const StateSnapshot> next = open_->next;
    for (const auto& [wid, w] : open_->waiters) {
      if (w.on_final == nullptr) continue;
      deferred.push_back(
          [on_final = w.on_final, fresh, next] { on_final(fresh, next); });
    }
  }
  RunDeferred(deferred);
}

std::vector<uint32_t> Job::ReleasedChunksLocked() const {
  std::vector<uint32_t> indices;
  for (uint32_t c = 0; c < open_->released.size(); ++c) {
    if (open_->released[c]) indices.push_back(c);
  }
  return indices;
}

WireCode Job::ChunkCode(const SyncSession& session) const {
  return pseudo_gradients() && session.round_ == 0 ? WireCode(DType::kFloat32)
                                                   : WireCodeOf(settings_);
}

void Job::AbortSeedLocked(absl::string_view why, Deferred& deferred) {
  std::unique_ptr<Seed> seed = std::move(seed_);
  const absl::Status status = absl::AbortedError(absl::StrCat(
      "the member seeding job '", id_,
      "' stopped before the seed was complete (", why, "); retry"));
  LOG(WARNING) << "job " << id_ << ": seed by "
               << MemberRef(seed->state.owner()) << " abandoned: " << why;
  FailAll(seed->waiters, status, deferred);
  commit_.GiveBack(seed->state.TakeValues());
}

void Job::CompleteSeedLocked(absl::Time now, Deferred& deferred) {
  if (upstream_ != nullptr && pseudo_gradients() &&
      seed_->upstream_serial == 0) {
    // A regional job's seed: the upstream job's state is what it commits
    // (this seed, if that job has none).
    UpstreamRequest request;
    request.kind = UpstreamRequest::Kind::kSeed;
    request.serial = ++upstream_serial_;
    request.values = seed_->state.values();
    seed_->upstream_serial = request.serial;
    LOG(INFO) << "job " << id_ << ": its seed goes to the upstream job";
    deferred.push_back([upstream = upstream_.get(),
                        job = std::weak_ptr<Job>(shared_from_this()),
                        request = std::move(request)]() mutable {
      upstream->Submit(job, std::move(request));
    });
    return;
  }
  std::unique_ptr<Seed> seed = std::move(seed_);
  // A new state: what the outlier guard learned was of the old one.
  guard_.Reset();
  const MemberId& owner = seed->state.owner();
  const SeedOrigin origin = seed->state.origin();
  const MemberInfo* member = members_.Get(owner);
  SeedState::Completed done = seed->state.Complete(
      member != nullptr ? member->name
                        : absl::StrCat("member-", MemberRef(owner)),
      member != nullptr ? member->weight : 1, now);
  CommitLocked(std::move(done.record), std::move(done.state),
               std::move(seed->waiters), /*refused=*/{}, deferred);
  reseeded_ = origin.round > 0;
  if (origin.round > 0) {
    // A re-seed of a job its coordinator lost: its members come back one by
    // one, as after a restore (RestoreState), and the re-seeder says how
    // many to wait for.
    pacing_.Reseeded(now + policy_.lease_ttl, origin.contributors);
  }
}

void Job::SupersedeReseedLocked(const MemberInfo& member,
                                const SeedOrigin& origin, Deferred& deferred) {
  LOG(WARNING) << "job " << id_ << ": " << member.name
               << " re-seeds it from round " << origin.round
               << ", newer than its re-seeded state of round "
               << commit_.state()->round
               << " (no round has closed since): the newer state replaces it";
  if (open_ != nullptr) {
    FailAll(open_->waiters,
            absl::AbortedError(absl::StrCat(
                "job '", id_, "' was re-seeded from a newer state (round ",
                origin.round, ") while round ", open_->round.id(),
                " was open; retry")),
            deferred);
    open_.reset();
  }
  if (sealed_ != nullptr) {
    // Its upstream answer is ignored when it comes (its serial is gone).
    FailAll(sealed_->waiters,
            absl::AbortedError(absl::StrCat(
                "job '", id_, "' was re-seeded from a newer state (round ",
                origin.round, ") while round ", sealed_->round.id(),
                " waited for its upstream job; retry")),
            deferred);
    sealed_.reset();
  }
  commit_.Drop();
  released_state_.reset();
  reseeded_ = false;
}

void Job::CommitLocked(RoundRecord record, std::shared_ptr<StateSnapshot> state,
                       Waiters waiters,
                       const absl::flat_hash_set<MemberId>& refused,
                       Deferred& deferred) {
  const absl::Time now = clock_->Now();
  state_at_ = now;
  const WorkMedians medians = WorkMediansLocked();
  const uint64_t previous_id = commit_.state_id();
  // A job restored from this state waits for as many (a seed's one member
  // does not say how many will come).
  if (record.reason != CloseReason::kSeed) {
    state->participants = static_cast<uint32_t>(record.participants.size());
  }
  std::shared_ptr<const StateSnapshot> committed =
      commit_.Commit(std::move(state), record.round);
  reseeded_ = false;  // CompleteSeedLocked sets it for a re-seed
  NotifySinkLocked(committed, deferred);

  ReportCommitLocked(record, deferred);

  state_ticket_ = 0;
  if (replicator_ != nullptr) {
    ReplicatedCommit update;
    update.job_id = id_;
    update.round = record.round;
    update.state_id = committed->id;
    update.record = record;
    update.members = members_.SortedByName();
    if (record.reason == CloseReason::kSeed) {
      update.seed = committed;
      update.layout = layout_;
      update.settings = settings_;
    } else {
      update.previous_id = previous_id;
    }
    state_ticket_ = replicator_->Commit(std::move(update));
    ReleaseLocked(
        state_ticket_,
        [self = shared_from_this(), committed, ticket = state_ticket_] {
          absl::MutexLock lock(&self->mu_);
          // Releases may run out of order on different threads.
          if (ticket > self->released_ticket_) {
            self->released_ticket_ = ticket;
            self->released_state_ = committed;
          }
        },
        deferred);
  }
  for (auto& [wid, w] : waiters) {
    SyncResult result = CommittedResult(record, committed, w.member,
                                        refused.contains(w.member));
    result.local_steps_budget = HandResultLocked(w.member, now, medians);
    if (w.staleness > 0) {
      // Its anchor is older than the state this round's delta applies to.
      result.delta = false;
      if (result.contributed) result.staleness = w.staleness;
    }
    ReleaseLocked(
        state_ticket_,
        [done = std::move(w.done), result = std::move(result)] {
          done(result);
        },
        deferred);
  }
  history_.Add(std::move(record));
}

Job::WorkMedians Job::WorkMediansLocked() const {
  WorkMedians medians;
  if (!adaptive_budgets()) return medians;
  std::vector<double> rates;
  std::vector<double> uploads;
  for (const MemberInfo* other :
       members_.TakingPartIn(std::numeric_limits<RoundId>::max())) {
    if (!other->work.known()) continue;
    rates.push_back(other->work.steps_per_second());
    uploads.push_back(absl::ToDoubleSeconds(other->work.upload()));
  }
  medians.steps_per_second = Median(rates);
  medians.upload = absl::Seconds(Median(uploads));
  return medians;
}

uint32_t Job::HandResultLocked(const MemberId& member, absl::Time now,
                               const WorkMedians& medians) {
  MemberInfo* m = members_.Mutable(member);
  if (m == nullptr) return 0;
  m->result_at = now;
  m->budget = 0;
  // Handed later than the members the last close answered (banked, or a
  // late Sync that adopts): fewer steps, so that it contributes with them
  // instead of staying out of phase and missing every round.
  const absl::Duration behind =
      state_at_ == absl::InfinitePast()
          ? absl::ZeroDuration()
          : std::max(absl::ZeroDuration(), now - state_at_);
  if (adaptive_budgets() && m->work.known() && medians.steps_per_second > 0) {
    m->budget = StepBudgetFor(m->work.steps_per_second(), m->work.upload(),
                              medians.steps_per_second, medians.upload,
                              settings_.local_sgd_steps,
                              BudgetBounds(settings_), behind);
  } else if (!adaptive_budgets() && settings_.local_sgd_steps > 0) {
    const uint32_t k = settings_.local_sgd_steps;
    const uint32_t phase =
        PhaseBudgetFor(m->work.steps_per_second(), k, behind);
    if (phase != k) m->budget = phase;  // 0 says K
  }
  // Handed while a round it takes part in is open (banked, or late): when
  // that round may expect it.
  if (open_ != nullptr) open_->round.Expect(*m);
  return m->budget;
}

void Job::ReportCommitLocked(const RoundRecord& record, Deferred& deferred) {
  LOG(INFO) << "job " << id_ << ": " << DescribeCommit(record);
  // Once the locks are let go: a test may crash the process here.
  deferred.push_back([] { HitFailpoint(Failpoint::kRoundClosed); });
  if (observer_ == nullptr) return;
  deferred.push_back([observer = observer_, event = ClosedEvent(id_, record)] {
    observer->RoundClosed(event);
  });
}

void Job::NotifySinkLocked(std::shared_ptr<const StateSnapshot> state,
                           Deferred& deferred) {
  if (sink_ == nullptr) return;
  // Counted until the sink has it, so that Stop and AwaitIdle can wait for
  // it: a round is not closed for a shutdown until its state is queued for
  // the checkpoint.
  ++sink_calls_pending_;
  deferred.push_back(
      [this, self = shared_from_this(), state = std::move(state)] {
        sink_->StateChanged(self, state);
        absl::MutexLock lock(&mu_);
        --sink_calls_pending_;
      });
}

absl::StatusOr<std::shared_ptr<const StateSnapshot>> Job::GetState(
    const MemberId& member) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (stopped_) return Stopping();
  if (members_.Renew(member, now) == nullptr) return members_.NotFound(member);
  if (commit_.state() == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id_, "' has no global state yet; the first member seeds it"));
  }
  // Its compute starts from this state (step budgets).
  if (MemberInfo* m = members_.Mutable(member)) m->result_at = now;
  if (replicator_ != nullptr) {
    // The newest state its standbys have: one a member may hold.
    if (released_state_ == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "job '", id_,
          "' has a state its standby has not acknowledged yet; retry"));
    }
    return released_state_;
  }
  return commit_.shared_state();
}

void Job::Tick() {
  const absl::Time now = clock_->Now();
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    for (const MemberId& id : members_.Expired(now)) {
      if (observer_ != nullptr) {
        deferred.push_back(
            [observer = observer_, job = id_, name = members_.Get(id)->name] {
              observer->LeaseExpired(job, name);
            });
      }
      RemoveMemberLocked(
          id,
          absl::StrCat("lost its lease (no call for ",
                       absl::FormatDuration(policy_.lease_ttl), ")"),
          deferred);
    }
    FinalizeHeldChunksLocked(now, deferred);
    // At the round's deadline (fixed or learned) the outlier guard judges
    // what it holds: the close decision counts only what it accepted.
    if (open_ != nullptr && guard_.any_held() &&
        now >= pacing_.Decide(open_->round, now).deadline) {
      JudgeAllHeldLocked(now, deferred);
    }
    MaybeCloseRoundLocked(now, deferred);
  }
  RunDeferred(deferred);
}

void Job::BeginDrain() {
  absl::MutexLock lock(&mu_);
  if (draining_ || stopped_) return;
  draining_ = true;
  if (open_ != nullptr || seed_ != nullptr) {
    LOG(INFO) << "job " << id_ << ": draining; waiting for "
              << (open_ != nullptr ? absl::StrCat("round ", open_->round.id())
                                   : std::string("the seed"))
              << " to close";
  }
}

bool Job::AwaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(
      absl::Condition(
          +[](Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job->mu_) {
            return job->sink_calls_pending_ == 0 &&
                   (job->stopped_ ||
                    (job->open_ == nullptr && job->sealed_ == nullptr &&
                     job->seed_ == nullptr));
          },
          this),
      deadline);
  return open_ == nullptr && sealed_ == nullptr && seed_ == nullptr &&
         sink_calls_pending_ == 0;
}

void Job::Stop() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    if (open_ != nullptr) FailAll(open_->waiters, Stopping(), deferred);
    if (sealed_ != nullptr) FailAll(sealed_->waiters, Stopping(), deferred);
    if (seed_ != nullptr) FailAll(seed_->waiters, Stopping(), deferred);
    // A state that another thread is handing to the sink right now (a round
    // that closed just before) must reach it before the caller stops the
    // sink. The wait is short: the sink does not block.
    mu_.Await(absl::Condition(
        +[](Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job->mu_) {
          return job->sink_calls_pending_ == 0;
        },
        this));
  }
  RunDeferred(deferred);
  // A regional job's link answers nothing from now on.
  if (upstream_ != nullptr) upstream_->Stop();
}

LearnedDeadline Job::learned_deadline() {
  absl::MutexLock lock(&mu_);
  return pacing_.learned();
}

size_t Job::num_members() {
  absl::MutexLock lock(&mu_);
  return members_.size();
}

namespace {

absl::Status CheckFiniteValues(absl::Span<const float> values,
                               absl::string_view what) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a non-finite value at element ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Job::ApplyReplicated(const ReplicatedChunk& update) {
  absl::MutexLock lock(&mu_);
  const std::string what =
      absl::StrCat("replicated chunk ", update.chunk, " of round ",
                   update.round, " of job '", id_, "'");
  if (commit_.state() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the standby has no state of the job"));
  }
  const RoundId next_round = commit_.state()->round + 1;
  if (update.round != next_round) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the standby's state is of round ", commit_.state()->round,
        ", so it takes round ", next_round));
  }
  if (update.chunk >= geometry_.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the job has ", geometry_.num_chunks(), " chunks"));
  }
  const size_t offset = geometry_.Offset(update.chunk);
  const size_t len = geometry_.Size(update.chunk);
  const bool carries = update.contributed || !pseudo_gradients();
  // With encodes_mean(), a chunk someone gave carries its encoded mean
  // instead of the float32 one.
  const bool encoded = update.contributed && commit_.encodes_mean();
  if (carries && !encoded ? update.mean.size() != len : !update.mean.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", update.mean.size(), " values; expected ",
                     carries && !encoded ? len : 0));
  }
  if (!encoded && !update.encoded_mean.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has an encoded mean, but the job ",
        commit_.encodes_mean() ? "takes none for a chunk no one gave"
                               : "has mean encoding float32"));
  }
  if (absl::Status s = CheckFiniteValues(update.mean, what); !s.ok()) return s;
  if (mirror_ != nullptr && mirror_->round != next_round) mirror_.reset();
  if (mirror_ != nullptr && mirror_->final[update.chunk]) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": that chunk is final already"));
  }
  const bool fresh = mirror_ == nullptr;
  if (fresh) {
    mirror_ = std::make_unique<Mirror>();
    mirror_->round = next_round;
    mirror_->next = pseudo_gradients() ? commit_.NewNext()
                                       : std::make_shared<StateSnapshot>();
    mirror_->values = commit_.TakeBuffer();
    mirror_->final.assign(geometry_.num_chunks(), false);
  }
  const absl::Span<float> chunk =
      absl::MakeSpan(mirror_->values).subspan(offset, len);
  if (encoded) {
    if (absl::Status s = commit_.DecodeMean(update.encoded_mean, update.chunk,
                                            *mirror_->next, chunk, what);
        !s.ok()) {
      if (fresh) mirror_.reset();
      return s;
    }
  } else if (carries) {
    std::copy(update.mean.begin(), update.mean.end(), chunk.begin());
  }
  if (pseudo_gradients()) {
    // What the primary computed from the same mean, bit for bit.
    commit_.FinalizeMean(chunk, update.contributed, update.chunk,
                         *mirror_->next, update.encoded_mean);
  }
  mirror_->final[update.chunk] = true;
  ++mirror_->num_final;
  return absl::OkStatus();
}

absl::Status Job::ApplyReplicated(const ReplicatedCommit& update) {
  absl::MutexLock lock(&mu_);
  const std::string what = absl::StrCat("replicated commit of round ",
                                        update.round, " of job '", id_, "'");
  if (update.state_id == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " names no state id"));
  }
  if (absl::Status s = Membership::CheckReplicated(update.members,
                                                   policy_.max_members, what);
      !s.ok()) {
    return s;
  }
  if (update.seed != nullptr) {
    if (update.seed->values.size() != geometry_.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a seed of ", update.seed->values.size(),
                       " values; the job has ", geometry_.num_elements()));
    }
    if (absl::Status s = CheckFiniteValues(update.seed->values, what);
        !s.ok()) {
      return s;
    }
    mirror_.reset();
    auto state = std::make_shared<StateSnapshot>();
    state->values = update.seed->values;
    state->id = update.state_id;
    commit_.Commit(std::move(state), update.round);
  } else {
    if (commit_.state() == nullptr ||
        update.round != commit_.state()->round + 1 ||
        update.previous_id != commit_.state()->id) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " follows state ", absl::Hex(update.previous_id),
          " but the standby holds ",
          commit_.state() == nullptr
              ? std::string("none")
              : absl::StrCat("round ", commit_.state()->round, " (",
                             absl::Hex(commit_.state()->id), ")")));
    }
    if (mirror_ == nullptr || mirror_->round != update.round ||
        mirror_->num_final != geometry_.num_chunks()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " before every chunk of it: ",
                       mirror_ == nullptr || mirror_->round != update.round
                           ? 0
                           : mirror_->num_final,
                       " of ", geometry_.num_chunks()));
    }
    std::shared_ptr<StateSnapshot> next = std::move(mirror_->next);
    next->values = std::move(mirror_->values);
    next->id = update.state_id;
    mirror_.reset();
    commit_.Commit(std::move(next), update.round);
  }
  RoundRecord record = update.record;
  record.round = update.round;
  record.replicated = true;
  history_.Add(std::move(record));
  members_.Restore(update.members, clock_->Now());
  return absl::OkStatus();
}

JobReplica Job::ExportReplica() {
  JobReplica replica;
  replica.job_id = id_;
  replica.layout = layout_;
  replica.settings = settings_;
  absl::MutexLock lock(&mu_);
  // Under the lock: every later update of this job has a higher ticket.
  replica.sequence = replicator_ != nullptr ? replicator_->LastTicket() : 0;
  replica.state = commit_.shared_state();
  replica.recent_rounds = history_.Recent(policy_.max_recent_rounds);
  replica.members = members_.SortedByName();
  if (open_ != nullptr && open_->next != nullptr &&
      open_->round.num_final() > 0) {
    replica.final_chunks = open_->round.FinalChunks();
    replica.partial = open_->next;
    // A final chunk's new values are in the round's sums (FinalizeMean
    // writes them there) or, prefinal, in prefinal_values.
    replica.partial_values.assign(geometry_.num_elements(), 0.0f);
    for (uint32_t c : replica.final_chunks) {
      const absl::Span<const float> from =
          open_->round.IsPrefinal(c)
              ? absl::MakeConstSpan(open_->prefinal_values)
                    .subspan(geometry_.Offset(c), geometry_.Size(c))
              : absl::Span<const float>(open_->round.sums().scaled_sums(c));
      std::copy(from.begin(), from.end(),
                replica.partial_values.begin() + geometry_.Offset(c));
    }
  } else if (open_ == nullptr && mirror_ != nullptr && mirror_->num_final > 0) {
    // Promoted, and the round in flight not open again yet: the chunks its
    // members may hold are in the mirror (Promote).
    for (uint32_t c = 0; c < geometry_.num_chunks(); ++c) {
      if (mirror_->final[c]) replica.final_chunks.push_back(c);
    }
    replica.partial = mirror_->next;
    replica.partial_values = mirror_->values;
  }
  return replica;
}

absl::Status Job::ImportReplica(const JobReplica& replica) {
  absl::MutexLock lock(&mu_);
  const std::string what = absl::StrCat("replica of job '", id_, "'");
  if (replica.state == nullptr) return absl::OkStatus();
  const StateSnapshot& s = *replica.state;
  const size_t n = geometry_.num_elements();
  if (s.values.size() != n || !(s.momentum.empty() || s.momentum.size() == n) ||
      !(s.residual.empty() || s.residual.size() == n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": a state of ", s.values.size(), " values; the job has ", n));
  }
  for (const std::vector<float>* part : {&s.values, &s.momentum, &s.residual}) {
    if (absl::Status st = CheckFiniteValues(*part, what); !st.ok()) return st;
  }
  if (absl::Status st = Membership::CheckReplicated(replica.members,
                                                    policy_.max_members, what);
      !st.ok()) {
    return st;
  }
  commit_.Restore(s.round, s.values, s.id, s.momentum, s.residual, {},
                  s.ancestors);
  members_.Restore(replica.members, clock_->Now());
  for (auto it = replica.recent_rounds.rbegin();
       it != replica.recent_rounds.rend(); ++it) {
    RoundRecord record = *it;
    record.replicated = true;
    history_.Add(std::move(record));
  }
  mirror_.reset();
  if (replica.final_chunks.empty() || !pseudo_gradients()) {
    return absl::OkStatus();
  }
  if (replica.partial == nullptr || replica.partial_values.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": final chunks without their values"));
  }
  auto mirror = std::make_unique<Mirror>();
  mirror->round = s.round + 1;
  mirror->next = commit_.NewNext();
  mirror->values = commit_.TakeBuffer();
  mirror->final.assign(geometry_.num_chunks(), false);
  StateSnapshot& next = *mirror->next;
  const StateSnapshot& from = *replica.partial;
  const WireCode wire = ResultCodeOf(settings_);
  for (uint32_t c : replica.final_chunks) {
    if (c >= geometry_.num_chunks() || mirror->final[c]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": final chunk ", c, " out of range or twice"));
    }
    const size_t offset = geometry_.Offset(c);
    const size_t len = geometry_.Size(c);
    std::copy_n(replica.partial_values.begin() + offset, len,
                mirror->values.begin() + offset);
    if (!next.momentum.empty() && from.momentum.size() == n) {
      std::copy_n(from.momentum.begin() + offset, len,
                  next.momentum.begin() + offset);
    }
    if (!next.residual.empty() && from.residual.size() == n) {
      std::copy_n(from.residual.begin() + offset, len,
                  next.residual.begin() + offset);
    }
    // The primary's mean residual is its own (DecodeMean): none here.
    if (!next.mean_residual.empty()) {
      std::fill_n(next.mean_residual.begin() + offset, len, 0.0f);
    }
    const size_t at = WireBytes(wire, geometry_.chunk_elements()) * c;
    const size_t bytes = WireBytes(wire, len);
    if (from.delta.size() < at + bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": final chunk ", c, " without its delta"));
    }
    std::copy_n(from.delta.data() + at, bytes, next.delta.data() + at);
    mirror->final[c] = true;
    ++mirror->num_final;
  }
  mirror_ = std::move(mirror);
  return absl::OkStatus();
}

void Job::Promote() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  members_.ResetEmptySince(now);
  // The replicated members go on under their ids; their leases start now
  // (they had no coordinator to call meanwhile). Those that joined after
  // the last commit join again. The next round waits for as many as took
  // part in the last one, or one lease, as after a re-seed.
  members_.RenewAll(now);
  const std::vector<RoundRecord> last = history_.Recent(1);
  pacing_.Reseeded(
      now + policy_.lease_ttl,
      last.empty() ? 0 : static_cast<uint32_t>(last[0].participants.size()));
  // Only a pseudo-gradient round tells members chunks before its close; a
  // parameter round's partial result no member can hold.
  if (mirror_ != nullptr && (!pseudo_gradients() || mirror_->num_final == 0)) {
    mirror_.reset();
  }
  // A standby that was out of sync holds an older state than some member:
  // that member's newer state replaces it (as a re-seed's would).
  reseeded_ = commit_.state() != nullptr;
  released_state_ = commit_.shared_state();
  state_ticket_ = 0;
}

JobStatusSnapshot Job::Status(uint32_t max_rounds) {
  JobStatusSnapshot s;
  s.job_id = id_;
  s.settings = settings_;
  s.layout = layout_;
  s.geometry = geometry_;
  absl::MutexLock lock(&mu_);
  s.members = members_.SortedByName();
  s.has_state = commit_.state() != nullptr;
  s.state_round = commit_.state_round();
  if (open_ != nullptr) {
    DescribeOpenRound(open_->round, pacing_.Decide(open_->round, clock_->Now()),
                      s, &guard_);
  } else if (sealed_ != nullptr) {
    CloseDecision waiting;
    waiting.why_open =
        "closed here; waiting for the upstream job's round (its result is "
        "this round's)";
    DescribeOpenRound(sealed_->round, std::move(waiting), s, nullptr);
  }
  s.recent_rounds = history_.Recent(max_rounds);
  s.steps = steps_;
  if (upstream_ != nullptr) {
    s.upstream = upstream_->Status();
    s.upstream->early_chunks = upstream_early_chunks_;
  }
  if (settings_.deadline_mode == DeadlineMode::kAdaptive) {
    s.learned_deadline = pacing_.learned();
    s.stragglers = Stragglers(s.members);
  }
  return s;
}

}  // namespace localsgd
