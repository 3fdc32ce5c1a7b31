// Standby coordinators through a real etcd and the real coordinator binary
// (--ha_etcd): members go on through failovers, and a deposed primary ends
// itself. Each test starts its own etcd and coordinators on loopback and
// ends on its own; no timed assertion (waits are on conditions, bounded).
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "localsgd/v1/coordinator.grpc.pb.h"
#include "src/codec.h"
#include "tests/ha/etcd_process.h"
#include "tests/security/security_util.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ha_test::EtcdProcess;
using testkit::AwaitCondition;
using testkit::TempDir;

// A loopback port nothing listens on now (the coordinators keep theirs
// across restarts, so the members' address lists stay true).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Occurrences of `text` in `haystack`.
int Count(const std::string& haystack, const std::string& text) {
  int n = 0;
  for (size_t at = haystack.find(text); at != std::string::npos;
       at = haystack.find(text, at + 1)) {
    ++n;
  }
  return n;
}

// One localsgd-coordinator process of shard 0 of group "t", with a
// failpoints file of its own (src/failpoint.h).
class CoordinatorProcess {
 public:
  // `extra`: more flags; `credentials`: of the test's own calls to it.
  CoordinatorProcess(std::string etcd, int port, std::string log,
                     std::string failpoints, std::vector<std::string> extra,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
      : etcd_(std::move(etcd)),
        port_(port),
        log_(std::move(log)),
        failpoints_(std::move(failpoints)),
        extra_(std::move(extra)),
        credentials_(std::move(credentials)) {
    Disarm();
  }
  ~CoordinatorProcess() { Kill(); }

  void Start() {
    ASSERT_LT(pid_, 0);
    std::vector<std::string> args = {LOCALSGD_COORDINATOR,
                                     absl::StrCat("--listen=127.0.0.1:", port_),
                                     absl::StrCat("--ha_etcd=", etcd_),
                                     "--ha_group=t",
                                     absl::StrCat("--ha_advertise=", address()),
                                     "--ha_lease_ttl=2s",
                                     "--lease_ttl=20s",
                                     "--shutdown_grace=1s"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("LOCALSGD_FAILPOINTS=" + failpoints_);
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_ = fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // none outlives a crashed test
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
  }

  // Arms `failpoint` and waits until the process has read it (its tick
  // re-reads the file): from here on it kills itself at the next hit.
  bool Arm(const std::string& failpoint) {
    const std::string armed = absl::StrCat("failpoint ", failpoint, " armed");
    const int before = Count(ReadFile(log_), armed);
    std::ofstream(failpoints_, std::ios::trunc) << failpoint << "\n";
    return AwaitCondition(
        [&] { return Count(ReadFile(log_), armed) > before; });
  }
  void Disarm() { std::ofstream(failpoints_, std::ios::trunc); }

  // SIGKILL (or `signal`), and the exit status once it has ended.
  int Kill(int signal = SIGKILL) {
    if (pid_ < 0) return -1;
    kill(pid_, signal);
    return Wait();
  }
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  void Signal(int signal) { kill(pid_, signal); }
  // Whether it has ended (its status in *status), without waiting.
  bool Exited(int* status) {
    if (pid_ < 0) return true;
    if (waitpid(pid_, status, WNOHANG) != pid_) return false;
    pid_ = -1;
    return true;
  }
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  const std::string& log() const { return log_; }

  // Whether it serves (the primary): GetJobStatus answers within a second,
  // with anything but UNAVAILABLE.
  // `epoch`, if not null: the epoch it answered with.
  bool Serving(uint64_t* epoch = nullptr) const {
    auto stub =
        v1::Coordinator::NewStub(grpc::CreateChannel(address(), credentials_));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::GetJobStatusRequest request;
    v1::GetJobStatusResponse response;
    // A paused one (SIGSTOP) answers nothing: not serving either.
    const grpc::StatusCode code =
        stub->GetJobStatus(&context, request, &response).error_code();
    const bool serving = code != grpc::StatusCode::UNAVAILABLE &&
                         code != grpc::StatusCode::DEADLINE_EXCEEDED;
    if (epoch != nullptr) *epoch = response.epoch();
    return serving;
  }

  // Whether it serves with `n` standbys in sync (each holds every state a
  // member may hold).
  bool StandbyInSync(int n = 1) const {
    auto stub =
        v1::Coordinator::NewStub(grpc::CreateChannel(address(), credentials_));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::GetJobStatusRequest request;
    v1::GetJobStatusResponse response;
    if (!stub->GetJobStatus(&context, request, &response).ok()) return false;
    int in_sync = 0;
    for (const v1::StandbyStatus& s : response.standbys()) {
      if (s.in_sync()) ++in_sync;
    }
    return in_sync >= n;
  }

 private:
  const std::string etcd_;
  const int port_;
  const std::string log_;
  const std::string failpoints_;
  const std::vector<std::string> extra_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  pid_t pid_ = -1;
};

std::string Tail(const std::string& path) {
  const std::string text = ReadFile(path);
  return text.size() > 12000 ? text.substr(text.size() - 12000) : text;
}

struct Members;

class FailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Available()) GTEST_SKIP() << "no /usr/bin/etcd";
    absl::StatusOr<std::unique_ptr<EtcdProcess>> etcd = EtcdProcess::Start();
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    for (int i = 0; i < Coordinators(); ++i) {
      coordinators_.push_back(std::make_unique<CoordinatorProcess>(
          etcd_->endpoint(), FreePort(),
          dir_.File(absl::StrCat("c", i, ".log")),
          dir_.File(absl::StrCat("c", i, ".failpoints")), ExtraFlags(),
          Credentials()));
      coordinators_.back()->Start();
    }
    ASSERT_TRUE(AwaitCondition([&] { return Primary() != nullptr; })) << Logs();
  }

  // How many coordinators the shard has (the primary and its standbys).
  virtual int Coordinators() const { return 2; }
  // Flags of every coordinator beyond the election's, and the credentials
  // of the test's calls to them.
  virtual std::vector<std::string> ExtraFlags() const { return {}; }
  virtual std::shared_ptr<grpc::ChannelCredentials> Credentials() const {
    return grpc::InsecureChannelCredentials();
  }

  // The coordinator that serves; null if none does (now).
  CoordinatorProcess* Primary() {
    for (auto& c : coordinators_) {
      if (c->running() && c->Serving()) return c.get();
    }
    return nullptr;
  }

  std::string Targets() const {
    std::vector<std::string> addresses;
    for (const auto& c : coordinators_) addresses.push_back(c->address());
    return absl::StrJoin(addresses, "|");
  }

  std::string Logs() const {
    std::string out;
    for (size_t i = 0; i < coordinators_.size(); ++i) {
      out += absl::StrCat("--- coordinator ", i, ":\n",
                          Tail(dir_.File(absl::StrCat("c", i, ".log"))));
    }
    return out;
  }

  // Starts the members and waits until they are at round 10 and a standby
  // is in sync; the primary then (null, with a failure, if none).
  CoordinatorProcess* RunToRoundTen(Members& members);

  // Waits for a coordinator to serve (a failover's successor) and checks
  // that it answers at an epoch above `before`.
  void ExpectSuccessorAbove(uint64_t before) {
    ASSERT_TRUE(
        AwaitCondition([&] { return Primary() != nullptr; }, absl::Seconds(30)))
        << Logs();
    uint64_t after = 0;
    CoordinatorProcess* successor = Primary();
    ASSERT_NE(successor, nullptr) << Logs();
    ASSERT_TRUE(successor->Serving(&after));
    EXPECT_GT(after, before) << "the epoch did not grow with a failover";
  }

  // Joins the members and checks what every test checks: no member saw a
  // round go back or skip, and each ended at the last round with the
  // exact state of every member in every round. `rejoins_allowed`: whether
  // a member may have joined again (a standby out of sync took over: it
  // never held their membership); else every member went on under its id.
  void ExpectExactEnd(Members& members, bool rejoins_allowed = false);
  // Kills the primary `kills` times as the members' rounds move on, each
  // once a standby is in sync, and restarts it as a standby; checks that a
  // successor serves at a higher epoch each time.
  void KillPrimaryRepeatedly(Members& members, int kills);

  TempDir dir_;
  std::unique_ptr<EtcdProcess> etcd_;
  std::vector<std::unique_ptr<CoordinatorProcess>> coordinators_;
};

// Four members of a DiLoCo job (outer Nesterov, lr 1, momentum 1/2, float32
// deltas) that add 1/4, 1/2, 3/4 and 5/2 to every parameter per round: the
// mean delta of all four is exactly 1 and that of any other set of them is
// not, and the outer momentum carries every round into the next. So each
// member's state after round r equals Reference(r) bit for bit only if
// every round counted every member and the momentum survived every
// failover (a standby that lost it, or a round, takes another path).
//
// With `wire_mean`: the bfloat16 wire and mean encoding wire. The deltas
// and their mean are exact in bfloat16 (the mean's encoding loses nothing),
// the steps (2 - 2^-k) are not after a few rounds: the coordinator's step
// residual carries what they lose. A standby gets only the encoded means
// and must reproduce momentum, step residual and the steps members get.
struct Members {
  static constexpr int kMembers = 4;

  // `step_time`: the local training between two Syncs.
  Members(const std::string& targets, int rounds,
          absl::Duration step_time = absl::ZeroDuration(),
          bool wire_mean = false)
      : rounds(rounds), step_time(step_time) {
    for (int i = 0; i < kMembers; ++i) {
      ClientOptions o;
      o.target = targets;
      o.job_id = "ha";
      o.member_name = absl::StrCat("m", i);
      o.max_retry_time = absl::Seconds(30);
      o.rpc_timeout = absl::Seconds(5);
      o.sync_timeout = absl::Seconds(30);
      o.max_backoff = absl::Milliseconds(200);
      // The first rounds wait for all of them: a round closed before the
      // last one joined would hold a mean of fewer.
      o.settings.rendezvous_members = kMembers;
      o.settings.contribution = Contribution::kPseudoGradients;
      o.settings.mode = AveragingMode::kOuterNesterov;
      o.settings.wire_dtype = wire_mean ? DType::kBFloat16 : DType::kFloat32;
      if (wire_mean) o.settings.mean_encoding = MeanEncoding::kWire;
      o.settings.outer_lr = 1.0f;
      o.settings.outer_momentum = 0.5f;
      options.push_back(o);
    }
    // torch.optim.SGD(lr=1, momentum=0.5, nesterov=True) on g = -1 (the
    // mean delta), in float32 in the coordinator's order of operations
    // (src/averaging.cc), from zeros; with `wire_mean`, each step sent as
    // bfloat16 with error feedback (src/codec.h).
    float value = 0.0f, b = 0.0f, residual = 0.0f;
    reference.push_back(value);
    for (int r = 1; r <= rounds; ++r) {
      const float g = -1.0f;
      b = b * 0.5f + g;
      float step = -1.0f * (g + 0.5f * b);
      if (wire_mean) {
        char bytes[2];
        EncodeWithFeedback(absl::MakeConstSpan(&step, 1),
                           absl::MakeSpan(&residual, 1), DType::kBFloat16,
                           bytes, absl::MakeSpan(&step, 1));
      }
      value = step + value;
      reference.push_back(value);
    }
  }

  void Run() {
    for (int i = 0; i < kMembers; ++i) {
      threads.emplace_back([this, i] { RunMember(i); });
    }
  }
  // A test that ends early (a failed ASSERT) stops the members at their
  // next round.
  ~Members() {
    stop.store(true);
    Join();
  }

  void Join() {
    for (std::thread& t : threads) {
      if (t.joinable()) t.join();
    }
  }

  void RunMember(int i) {
    auto client = Client::Create(options[i]);
    if (!client.ok()) return Fail(i, client.status());
    std::vector<float> params(testkit::kElements, 0.0f);
    if (absl::Status s = (*client)->Join(testkit::TestLayout()); !s.ok()) {
      return Fail(i, s);
    }
    if (absl::Status s = (*client)->Initialize(absl::MakeSpan(params));
        !s.ok()) {
      return Fail(i, s);
    }
    RoundId last = (*client)->state_round();
    while (last < static_cast<RoundId>(rounds) && !stop.load()) {
      static constexpr float kAdd[kMembers] = {0.25f, 0.5f, 0.75f, 2.5f};
      for (float& p : params) p += kAdd[i];
      absl::SleepFor(step_time);  // training, not synchronisation
      absl::StatusOr<SyncOutcome> out = (*client)->Sync(absl::MakeSpan(params));
      if (!out.ok()) return Fail(i, out.status());
      absl::MutexLock lock(&mu);
      // Every Sync ends with the round after the last: never one back, none
      // skipped. (A member whose result the dead primary did not send gets
      // that round's state from the new one: late, yet the round it asked
      // for, its contribution in it.)
      if (out->round != last + 1) {
        errors.push_back(
            absl::StrCat("m", i, ": round ", out->round, " after round ", last,
                         out->rejoined ? " (after a rejoin)" : ""));
      }
      if (out->rejoined) ++rejoins;
      if (params !=
          std::vector<float>(testkit::kElements, reference[out->round])) {
        errors.push_back(absl::StrCat("m", i, ": state of round ", out->round,
                                      " is ", params[0], ", not ",
                                      reference[out->round]));
      }
      if (!out->contributed) {
        not_counted.push_back(absl::StrCat("m", i, " round ", out->round,
                                           out->late ? " late" : "",
                                           out->rejoined ? " rejoined" : ""));
      }
      last = out->round;
      progress = std::max<int>(progress, static_cast<int>(last));
      finals[i] = params;
      final_rounds[i] = last;
    }
    (*client)->Leave().IgnoreError();
  }

  void Fail(int i, const absl::Status& s) {
    absl::MutexLock lock(&mu);
    errors.push_back(absl::StrCat("m", i, ": ", s.ToString()));
  }

  int Progress() {
    absl::MutexLock lock(&mu);
    return progress;
  }

  const int rounds;
  const absl::Duration step_time;
  std::vector<float> reference;  // the state after round r
  std::vector<ClientOptions> options;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  int progress ABSL_GUARDED_BY(mu) = 0;
  int rejoins ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  // Results that did not count the member's contribution (for messages).
  std::vector<std::string> not_counted ABSL_GUARDED_BY(mu);
  std::vector<float> finals[kMembers];
  RoundId final_rounds[kMembers] = {};
};

CoordinatorProcess* FailoverTest::RunToRoundTen(Members& members) {
  members.Run();
  const bool moved_on = AwaitCondition([&] { return members.Progress() >= 10; },
                                       absl::Seconds(60));
  EXPECT_TRUE(moved_on) << "rounds stuck at " << members.Progress() << "\n"
                        << Logs();
  CoordinatorProcess* primary = moved_on ? Primary() : nullptr;
  if (primary == nullptr) return nullptr;
  const bool in_sync = AwaitCondition([&] { return primary->StandbyInSync(); });
  EXPECT_TRUE(in_sync) << "no standby in sync\n" << Logs();
  return in_sync ? primary : nullptr;
}

void FailoverTest::ExpectExactEnd(Members& members, bool rejoins_allowed) {
  members.Join();
  absl::MutexLock lock(&members.mu);
  if (!rejoins_allowed) {
    // The standby held every member (replicated with each state).
    EXPECT_EQ(members.rejoins, 0) << "members joined again after a failover\n"
                                  << Logs();
  }
  EXPECT_TRUE(members.errors.empty())
      << absl::StrJoin(members.errors, "\n") << "\n"
      << Logs();
  for (int i = 0; i < Members::kMembers; ++i) {
    EXPECT_EQ(members.final_rounds[i], static_cast<RoundId>(members.rounds))
        << "member " << i;
    EXPECT_EQ(members.finals[i],
              std::vector<float>(testkit::kElements,
                                 members.reference[members.rounds]))
        << "member " << i << "\n"
        << (i == 0 ? Logs() : "");
  }
  // No member adopted a state or lost its contribution for a failover.
  EXPECT_TRUE(members.not_counted.empty())
      << "not counted: " << absl::StrJoin(members.not_counted, ", ") << "\n"
      << Logs();
}

void FailoverTest::KillPrimaryRepeatedly(Members& members, int kills) {
  members.Run();
  for (int k = 0; k < kills; ++k) {
    // Kill the primary once the rounds have moved on since the last kill.
    const int at = (k + 1) * members.rounds / (kills + 2);
    ASSERT_TRUE(AwaitCondition([&] { return members.Progress() >= at; },
                               absl::Seconds(60)))
        << "rounds stuck at " << members.Progress() << "\n"
        << Logs();
    CoordinatorProcess* primary = Primary();
    ASSERT_NE(primary, nullptr) << Logs();
    // The restarted one has caught up: it holds every state members hold.
    ASSERT_TRUE(AwaitCondition([&] { return primary->StandbyInSync(); },
                               absl::Seconds(30)))
        << "no standby in sync\n"
        << Logs();
    uint64_t before = 0;
    primary->Serving(&before);
    primary->Kill();
    primary->Start();  // back as a standby
    EXPECT_GT(before, 0u);
    ASSERT_NO_FATAL_FAILURE(ExpectSuccessorAbove(before));
  }
}

TEST_F(FailoverTest, PrimaryKilledRepeatedly_MembersGoOnWithExactState) {
  Members members(Targets(), /*rounds=*/60);
  ASSERT_NO_FATAL_FAILURE(KillPrimaryRepeatedly(members, /*kills=*/5));
  ExpectExactEnd(members);
}

// The same with the rule on the encoded mean (mean encoding wire): the
// standbys get each round's mean as the wire encodes it, not in float32.
TEST_F(FailoverTest, WireMeanEncoding_PrimaryKilled_MembersGoOnWithExactState) {
  Members members(Targets(), /*rounds=*/40, absl::ZeroDuration(),
                  /*wire_mean=*/true);
  // The steps lose to bfloat16 what the step residual carries.
  ASSERT_NE(members.reference, Members(Targets(), 40).reference);
  ASSERT_NO_FATAL_FAILURE(KillPrimaryRepeatedly(members, /*kills=*/3));
  ExpectExactEnd(members);
}

// A primary and two standbys; the primary killed at chosen moments through
// its failpoints (src/failpoint.h), each killed one restarted as a standby:
// while members upload, between the chunks of a round's result (a member
// holds part of it), right after a close (its result released or not),
// during a standby's catch-up (the standby in sync takes over, the one
// catching up starts again from it), and by a SIGKILL from outside. Rounds
// of three chunks, so that a result has chunks to be between.
class FailoverMomentsTest : public FailoverTest {
 protected:
  int Coordinators() const override { return 3; }
};

TEST_F(FailoverMomentsTest, PrimaryKilledAtChosenMoments_NothingIsLost) {
  // Enough rounds that the last kill finds them still running (a restart
  // and a catch-up between two kills take a few of them).
  constexpr int kRounds = 100;
  // "" is a SIGKILL from outside, at whatever moment it lands.
  const std::vector<std::string> moments = {"contribution_chunk",
                                            "result_chunk_sent", "round_closed",
                                            "catch_up_sent", ""};
  // 50 ms of training a round: the rounds move on between two kills (a
  // failpoint is armed within a tick) and do not run out before the last.
  Members members(Targets(), kRounds, absl::Milliseconds(50));
  for (ClientOptions& o : members.options) {
    o.settings.chunk_elements = testkit::kChunk;  // 3 chunks of 40
  }
  members.Run();
  for (size_t k = 0; k < moments.size(); ++k) {
    const std::string& moment = moments[k];
    SCOPED_TRACE("kill " + std::to_string(k) + " at " +
                 (moment.empty() ? "a SIGKILL from outside" : moment));
    const int at = static_cast<int>((k + 1) * kRounds / (moments.size() + 2));
    ASSERT_TRUE(AwaitCondition([&] { return members.Progress() >= at; },
                               absl::Seconds(60)))
        << "rounds stuck at " << members.Progress() << "\n"
        << Logs();
    CoordinatorProcess* primary = Primary();
    ASSERT_NE(primary, nullptr) << Logs();
    // Both standbys hold every state members hold.
    ASSERT_TRUE(AwaitCondition([&] { return primary->StandbyInSync(2); },
                               absl::Seconds(30)))
        << "not every standby in sync\n"
        << Logs();
    uint64_t before = 0;
    primary->Serving(&before);
    int status = 0;
    if (moment.empty()) {
      status = primary->Kill();
    } else {
      CoordinatorProcess* restarted = nullptr;
      if (moment == "catch_up_sent") {
        // A standby restarted: its catch-up from the primary begins once
        // the failpoint is armed, and the primary dies in the middle of it.
        for (auto& c : coordinators_) {
          if (c.get() != primary) restarted = c.get();
        }
        restarted->Kill();
      }
      ASSERT_TRUE(primary->Arm(moment)) << Logs();
      if (restarted != nullptr) restarted->Start();
      ASSERT_TRUE(AwaitCondition([&] { return primary->Exited(&status); },
                                 absl::Seconds(30)))
          << "the failpoint " << moment << " was not hit\n"
          << Logs();
      primary->Disarm();
    }
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "status " << status << "\n"
        << Logs();
    primary->Start();  // back as a standby
    ASSERT_NO_FATAL_FAILURE(ExpectSuccessorAbove(before));
  }
  ExpectExactEnd(members);
}

// The synchronous standbys in etcd: a standby the primary dropped (paused
// past the ack timeout) leaves the list before anything it lacks reaches a
// member. With the primary dead and the standby in sync paused, the
// dropped one, resumed, does not take over (it would serve an older state
// and lose the outer momentum of the rounds it missed); the synchronous
// one, resumed, does, and the members' states stay exact.
TEST_F(FailoverMomentsTest, DroppedStandbyWaitsForTheSynchronousOne) {
  constexpr int kRounds = 300;
  Members members(Targets(), kRounds, absl::Milliseconds(50));
  CoordinatorProcess* primary = RunToRoundTen(members);
  ASSERT_NE(primary, nullptr);
  ASSERT_TRUE(AwaitCondition([&] { return primary->StandbyInSync(2); },
                             absl::Seconds(30)))
      << Logs();
  std::vector<CoordinatorProcess*> standbys;
  for (auto& c : coordinators_) {
    if (c.get() != primary) standbys.push_back(c.get());
  }
  CoordinatorProcess* dropped = standbys[0];
  CoordinatorProcess* synchronous = standbys[1];
  dropped->Signal(SIGSTOP);
  // The primary drops it (no ack for 5 s) and the rounds go on without it.
  ASSERT_TRUE(AwaitCondition(
      [&] { return !primary->StandbyInSync(2) && primary->StandbyInSync(1); },
      absl::Seconds(30)))
      << Logs();
  const int dropped_at = members.Progress();
  ASSERT_TRUE(AwaitCondition(
      [&] { return members.Progress() > dropped_at + 3; }, absl::Seconds(30)))
      << Logs();
  synchronous->Signal(SIGSTOP);
  primary->Kill();
  dropped->Signal(SIGCONT);
  // Two leases and more: the dropped one does not campaign.
  EXPECT_FALSE(
      AwaitCondition([&] { return Primary() != nullptr; }, absl::Seconds(6)))
      << "a standby not in the synchronous list took over\n"
      << Logs();
  EXPECT_NE(ReadFile(dropped->log()).find("not campaigning"), std::string::npos)
      << Logs();
  synchronous->Signal(SIGCONT);
  primary->Start();
  ASSERT_TRUE(
      AwaitCondition([&] { return synchronous->Serving(); }, absl::Seconds(30)))
      << Logs();
  ExpectExactEnd(members);
}

// Everything over mutual TLS: the members to the coordinators, and each
// standby to its primary: the replication stream checks the primary's
// certificate against the CA (--tls_client_ca, which --ha_tls_ca defaults
// to) and presents the standby's own. A failover keeps the state exact as
// it does in plaintext.
class FailoverTlsTest : public FailoverTest {
 protected:
  void SetUp() override {
    ASSERT_EQ(Certs().error(), "");
    FailoverTest::SetUp();
  }
  static const security_test::Certs& Certs() {
    return security_test::Certs::Get();
  }
  std::vector<std::string> ExtraFlags() const override {
    return {"--tls_cert=" + Certs().Path("coordinator.pem"),
            "--tls_key=" + Certs().Path("coordinator.key"),
            "--tls_client_ca=" + Certs().Path("ca.pem")};
  }
  std::shared_ptr<grpc::ChannelCredentials> Credentials() const override {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(Certs().Path("ca.pem"));
    ssl.pem_cert_chain = ReadFile(Certs().Path("client_a.pem"));
    ssl.pem_private_key = ReadFile(Certs().Path("client_a.key"));
    return grpc::SslCredentials(ssl);
  }
  static void Secure(Members& members) {
    for (ClientOptions& o : members.options) {
      o.security.tls_ca_file = Certs().Path("ca.pem");
      o.security.tls_cert_file = Certs().Path("client_a.pem");
      o.security.tls_key_file = Certs().Path("client_a.key");
    }
  }
};

TEST_F(FailoverTlsTest, MutualTls_StandbyFollowsAndTakesOver) {
  // Far from the job's end when the primary dies (as above).
  constexpr int kRounds = 100;
  Members members(Targets(), kRounds, absl::Milliseconds(20));
  Secure(members);
  // A standby in sync: it follows over TLS.
  CoordinatorProcess* primary = RunToRoundTen(members);
  ASSERT_NE(primary, nullptr);
  primary->Kill();
  primary->Start();
  ExpectExactEnd(members);
}

// TLS without a CA to check the primary's certificate with: the coordinator
// does not start, and says which flag is missing.
TEST_F(FailoverTlsTest, TlsWithoutACaForTheStandby_RefusedAtStart) {
  const std::string log = dir_.File("no_ca.log");
  const std::string command = absl::StrCat(
      LOCALSGD_COORDINATOR,
      " --listen=127.0.0.1:0 --ha_etcd=", etcd_->endpoint(),
      " --ha_group=t --tls_cert=", Certs().Path("coordinator.pem"),
      " --tls_key=", Certs().Path("coordinator.key"), " > ", log, " 2>&1");
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0)
      << "status " << status;
  EXPECT_NE(ReadFile(log).find("--ha_tls_ca"), std::string::npos)
      << ReadFile(log);
}

// The primary paused for longer than its lease: the standby takes over and
// the rounds go on there; the old primary, resumed, refuses everything and
// ends itself (status 3) instead of serving under its old epoch.
TEST_F(FailoverTest, PrimaryPausedPastItsLease_StandbyServesAndOldOneExits) {
  // Rounds of 20 ms of training at least, enough of them that the job is
  // far from its end when the primary is paused (rounds of a model this
  // small take a millisecond: 30 of them could all close before the pause).
  constexpr int kRounds = 200;
  Members members(Targets(), kRounds, absl::Milliseconds(20));
  CoordinatorProcess* old = RunToRoundTen(members);
  ASSERT_NE(old, nullptr);
  CoordinatorProcess* other = old == coordinators_[0].get()
                                  ? coordinators_[1].get()
                                  : coordinators_[0].get();
  old->Signal(SIGSTOP);
  ASSERT_TRUE(
      AwaitCondition([&] { return other->Serving(); }, absl::Seconds(30)))
      << Logs();
  const int before = members.Progress();
  ASSERT_TRUE(AwaitCondition([&] { return members.Progress() > before + 3; },
                             absl::Seconds(60)))
      << "no round closed at the new primary\n"
      << Logs();
  old->Signal(SIGCONT);
  const int status = old->Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3)
      << "status " << status << "\n"
      << Logs();
  ExpectExactEnd(members);
}

// SIGTERM: the primary drains, exits 0 and gives up its key, so that the
// standby takes over without waiting for the lease to run out.
TEST_F(FailoverTest, PrimaryTerminated_ExitsCleanlyAndTheStandbyTakesOver) {
  // Far from the job's end when the primary stops (as above).
  constexpr int kRounds = 100;
  Members members(Targets(), kRounds, absl::Milliseconds(20));
  CoordinatorProcess* old = RunToRoundTen(members);
  ASSERT_NE(old, nullptr);
  const int status = old->Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << "\n"
      << Logs();
  ExpectExactEnd(members);
}

// etcd stops under load: the primary cannot renew its lease, stops serving
// before it runs out and ends itself (status 3); nobody can win while etcd
// is down, so the job pauses. Its supervisor (here, the test) starts it
// again; etcd comes back; a coordinator wins and the members go on, their
// state exact.
TEST_F(FailoverTest, EtcdStoppedUnderLoad_JobPausesAndResumes) {
  // Rounds of 20 ms of training at least, enough of them that the job is
  // far from its end when etcd stops (the primary serves for up to a lease
  // after that).
  constexpr int kRounds = 300;
  Members members(Targets(), kRounds, absl::Milliseconds(20));
  CoordinatorProcess* old = RunToRoundTen(members);
  ASSERT_NE(old, nullptr);
  ASSERT_TRUE(etcd_->Stop().ok());
  int status = 0;
  ASSERT_TRUE(
      AwaitCondition([&] { return old->Exited(&status); }, absl::Seconds(30)))
      << "the primary still runs with etcd down\n"
      << Logs();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3)
      << "status " << status << "\n"
      << Logs();
  EXPECT_EQ(Primary(), nullptr) << "a coordinator serves with etcd down";
  const int paused_at = members.Progress();
  old->Start();
  ASSERT_TRUE(etcd_->Restart().ok()) << etcd_->LogTail();
  ASSERT_TRUE(
      AwaitCondition([&] { return Primary() != nullptr; }, absl::Seconds(30)))
      << Logs();
  // The restarted one may win (it waits a lease first): it holds no member.
  ExpectExactEnd(members, /*rejoins_allowed=*/true);
  absl::MutexLock lock(&members.mu);
  EXPECT_GT(members.progress, paused_at);
}

}  // namespace
}  // namespace localsgd
