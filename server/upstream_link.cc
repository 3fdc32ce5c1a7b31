#include "server/upstream_link.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "src/job.h"

namespace localsgd {

struct UpstreamLink::Core {
  Core(std::string job_id, Layout layout, uint64_t num_elements,
       ClientOptions options)
      : job_id(std::move(job_id)),
        layout(std::move(layout)),
        num_elements(num_elements),
        options(std::move(options)) {}

  void Run();
  // The client's early result chunks (ClientOptions::on_early_result),
  // during a round's Sync: each goes to `early_job` as its step.
  void OnEarlyResult(uint64_t offset, absl::Span<const float> values);
  UpstreamAnswer Answer(UpstreamRequest& request);
  UpstreamAnswer Seed(UpstreamRequest& request);
  UpstreamAnswer Round(UpstreamRequest& request);
  // Creates the client and joins the upstream job, once.
  absl::Status Joined();
  // The upstream state whole, as the client holds it.
  UpstreamAnswer State() const;

  const std::string job_id;
  const Layout layout;
  const uint64_t num_elements;
  const ClientOptions options;

  // The thread's own; the early result chunks' (on the Sync's threads)
  // while a round's Sync runs, set before it and cleared after.
  std::weak_ptr<Job> early_job;
  uint64_t early_serial = 0;
  absl::Span<const float> early_base;
  // The thread's own.
  std::unique_ptr<Client> client;
  // The upstream state the client holds (after Initialize or a Sync), if
  // `initialized`.
  std::vector<float> params;
  bool initialized = false;

  mutable absl::Mutex mu;
  struct Pending {
    std::weak_ptr<Job> job;
    UpstreamRequest request;
  };
  std::deque<Pending> queue ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool exited ABSL_GUARDED_BY(mu) = false;
  UpstreamStatus status ABSL_GUARDED_BY(mu);
};

namespace {

bool SameBits(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

UpstreamLink::UpstreamLink(std::string job_id, Layout layout,
                           uint64_t num_elements, ClientOptions options) {
  options.job_id = job_id;
  options.settings.contribution = Contribution::kPseudoGradients;
  core_ = std::make_shared<Core>(std::move(job_id), std::move(layout),
                                 num_elements, std::move(options));
  {
    absl::MutexLock lock(&core_->mu);
    core_->status.target = core_->options.replicas.empty()
                               ? core_->options.target
                               : absl::StrJoin(core_->options.replicas, ",");
    core_->status.member = core_->options.member_name;
  }
  thread_ = std::thread([core = core_] { core->Run(); });
}

UpstreamLink::~UpstreamLink() { Stop(); }

void UpstreamLink::Submit(std::weak_ptr<Job> job, UpstreamRequest request) {
  absl::MutexLock lock(&core_->mu);
  if (core_->stopping) return;
  core_->queue.push_back(Core::Pending{std::move(job), std::move(request)});
}

void UpstreamLink::Stop() {
  if (!thread_.joinable()) return;
  // The thread itself may drop the last reference to its job: it never
  // waits for itself.
  const bool self = thread_.get_id() == std::this_thread::get_id();
  bool exited = false;
  {
    absl::MutexLock lock(&core_->mu);
    core_->stopping = true;
    core_->queue.clear();
    if (!self) {
      exited = core_->mu.AwaitWithTimeout(absl::Condition(&core_->exited),
                                          absl::Seconds(5));
    }
  }
  if (exited) {
    thread_.join();
  } else {
    // Still in a call upstream (or this is the thread itself, dropping the
    // last reference to its job): it ends on its own.
    thread_.detach();
  }
}

UpstreamStatus UpstreamLink::Status() const {
  absl::MutexLock lock(&core_->mu);
  return core_->status;
}

void UpstreamLink::Core::Run() {
  while (true) {
    Pending pending;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](Core* core) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core->mu) {
            return core->stopping || !core->queue.empty();
          },
          this));
      if (stopping) break;
      pending = std::move(queue.front());
      queue.pop_front();
    }
    // Held while the request is answered: the job is dropped here if at
    // all, never on a thread of the client's Sync that hands it a chunk.
    const std::shared_ptr<Job> held = pending.job.lock();
    early_job = pending.job;
    UpstreamAnswer answer = Answer(pending.request);
    early_job.reset();
    {
      absl::MutexLock lock(&mu);
      if (answer.status.ok()) {
        ++status.rounds;
        status.upstream_round = answer.upstream_round;
        status.last_error.clear();
      } else {
        status.last_error = answer.status.ToString();
      }
      if (stopping) break;
    }
    if (!answer.status.ok()) {
      LOG(WARNING) << "job " << job_id << ": upstream request for round "
                   << pending.request.round << " failed: " << answer.status;
    }
    if (held != nullptr) {
      held->CompleteUpstream(pending.request.serial, std::move(answer));
    }
  }
  if (client != nullptr) {
    // Best effort: the upstream job stops waiting for this region now
    // rather than at its lease's end.
    if (absl::Status s = client->Leave(); !s.ok()) {
      LOG(WARNING) << "job " << job_id << ": leaving the upstream job: " << s;
    }
    client.reset();
  }
  absl::MutexLock lock(&mu);
  exited = true;
}

UpstreamAnswer UpstreamLink::Core::Answer(UpstreamRequest& request) {
  if (request.values.size() != num_elements) {
    UpstreamAnswer answer;
    answer.status = absl::InternalError(
        absl::StrCat("an upstream request of ", request.values.size(),
                     " values for a job of ", num_elements));
    return answer;
  }
  if (absl::Status s = Joined(); !s.ok()) {
    UpstreamAnswer answer;
    answer.status = s;
    return answer;
  }
  UpstreamAnswer answer = request.kind == UpstreamRequest::Kind::kSeed
                              ? Seed(request)
                              : Round(request);
  if (!answer.status.ok()) {
    // Whatever went wrong (the upstream restarted without its members, a
    // sharded upstream's shards went different ways), the next request
    // starts over: a new member (same name: it takes the old one's place),
    // joined, and the upstream state fetched.
    client.reset();
    initialized = false;
  }
  return answer;
}

void UpstreamLink::Core::OnEarlyResult(uint64_t offset,
                                       absl::Span<const float> values) {
  if (early_serial == 0 || offset > early_base.size() ||
      values.size() > early_base.size() - offset) {
    return;
  }
  std::shared_ptr<Job> job = early_job.lock();
  if (job == nullptr) return;
  // The step, kept only if base + step is the new state bit for bit, as
  // Round's answer.
  const absl::Span<const float> base =
      early_base.subspan(offset, values.size());
  std::vector<float> step(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    step[i] = values[i] - base[i];
    if (absl::bit_cast<uint32_t>(base[i] + step[i]) !=
        absl::bit_cast<uint32_t>(values[i])) {
      return;
    }
  }
  job->UpstreamChunk(early_serial, offset, step);
}

absl::Status UpstreamLink::Core::Joined() {
  if (client != nullptr) return absl::OkStatus();
  ClientOptions with_early = options;
  with_early.on_early_result = [this](uint64_t offset,
                                      absl::Span<const float> values) {
    OnEarlyResult(offset, values);
  };
  absl::StatusOr<std::unique_ptr<Client>> created =
      Client::Create(std::move(with_early));
  if (!created.ok()) return created.status();
  if (absl::Status s = (*created)->Join(layout); !s.ok()) return s;
  if ((*created)->info().num_elements != num_elements) {
    return absl::FailedPreconditionError(
        absl::StrCat("the upstream job has ", (*created)->info().num_elements,
                     " elements; this job ", num_elements));
  }
  client = *std::move(created);
  LOG(INFO) << "job " << job_id << ": joined the upstream job at "
            << (options.replicas.empty() ? options.target
                                         : absl::StrJoin(options.replicas, ","))
            << " as " << options.member_name;
  return absl::OkStatus();
}

UpstreamAnswer UpstreamLink::Core::State() const {
  UpstreamAnswer answer;
  answer.delta = false;
  answer.values = params;
  answer.upstream_round = client->state_round();
  return answer;
}

UpstreamAnswer UpstreamLink::Core::Seed(UpstreamRequest& request) {
  params = std::move(request.values);
  initialized = false;
  if (absl::Status s = client->Initialize(absl::MakeSpan(params)); !s.ok()) {
    UpstreamAnswer answer;
    answer.status = s;
    return answer;
  }
  initialized = true;
  return State();
}

UpstreamAnswer UpstreamLink::Core::Round(UpstreamRequest& request) {
  const absl::Span<const float> base =
      request.base != nullptr ? absl::MakeConstSpan(request.base->values)
                              : absl::Span<const float>();
  if (!initialized) {
    // A link that has not synced yet (the regional coordinator restarted
    // from its checkpoint): the upstream job's state, or this base as its
    // seed if it has none.
    params.assign(base.begin(), base.end());
    if (absl::Status s = client->Initialize(absl::MakeSpan(params)); !s.ok()) {
      UpstreamAnswer answer;
      answer.status = s;
      return answer;
    }
    initialized = true;
  }
  if (!SameBits(base, params)) {
    // The regional state is not the upstream's (the upstream went on
    // without this region): the regional job takes it whole.
    LOG(WARNING) << "job " << job_id << ": round " << request.round
                 << "'s state is not the upstream job's (round "
                 << client->state_round()
                 << "); the region adopts it without contributing";
    return State();
  }
  if (request.weight <= 0) {
    // No whole contribution in the round: nothing goes up; the upstream
    // state, if it moved.
    absl::StatusOr<RoundId> fetched =
        client->FetchState(absl::MakeSpan(params));
    if (!fetched.ok()) {
      UpstreamAnswer answer;
      answer.status = fetched.status();
      return answer;
    }
    if (!SameBits(base, params)) return State();
    UpstreamAnswer answer;
    answer.delta = true;
    answer.values.assign(num_elements, 0.0f);
    answer.upstream_round = *fetched;
    return answer;
  }
  // base + mean: the client sends it minus its anchor (base).
  std::vector<float>& mean = request.values;
  for (size_t i = 0; i < num_elements; ++i) params[i] = base[i] + mean[i];
  SyncWork work;
  work.local_steps = request.local_steps;
  work.weight = request.weight;
  early_serial = request.serial;
  early_base = base;
  absl::StatusOr<SyncOutcome> outcome =
      client->Sync(absl::MakeSpan(params), work);
  early_serial = 0;
  early_base = {};
  if (!outcome.ok()) {
    UpstreamAnswer answer;
    answer.status = outcome.status();
    return answer;
  }
  // The step, reusing the mean's buffer: exact if base + step is the new
  // state in every element. A contribution that did not count upstream
  // (late there) gets the step all the same, marked: the regional round's
  // members adopt it, their steps thrown away.
  UpstreamAnswer answer;
  answer.delta = true;
  answer.counted = outcome->contributed;
  answer.upstream_round = outcome->round;
  for (size_t i = 0; i < num_elements; ++i) {
    mean[i] = params[i] - base[i];
    if (absl::bit_cast<uint32_t>(base[i] + mean[i]) !=
        absl::bit_cast<uint32_t>(params[i])) {
      return State();
    }
  }
  answer.values = std::move(mean);
  return answer;
}

std::unique_ptr<Upstream> UpstreamLinkFactory::ForJob(const std::string& job_id,
                                                      const Layout& layout,
                                                      uint64_t num_elements) {
  return std::make_unique<UpstreamLink>(job_id, layout, num_elements, options_);
}

std::string UpstreamLinkFactory::target() const {
  return options_.replicas.empty() ? options_.target
                                   : absl::StrJoin(options_.replicas, ",");
}

}  // namespace localsgd
