#include "tests/ha/etcd_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ha/etcd_client.h"

namespace localsgd {
namespace ha_test {
namespace {

// Binds a loopback socket to port 0 and returns it with its port; the
// caller closes it (holding it keeps two picks apart).
absl::StatusOr<std::pair<int, int>> BindFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::string error = strerror(errno);
    close(fd);
    return absl::InternalError(error);
  }
  return std::make_pair(fd, static_cast<int>(ntohs(addr.sin_port)));
}

std::string Url(int port) { return absl::StrCat("http://127.0.0.1:", port); }

}  // namespace

bool EtcdProcess::Available() { return access(kEtcdBinary, X_OK) == 0; }

EtcdProcess::EtcdProcess(EtcdProcessOptions options) : options_(options) {}

absl::StatusOr<std::unique_ptr<EtcdProcess>> EtcdProcess::Start(
    EtcdProcessOptions options) {
  absl::Status last;
  // Another process can take a port between our pick and etcd's bind: then
  // etcd exits, and we pick again.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<EtcdProcess> etcd(new EtcdProcess(options));
    std::string pattern =
        (std::filesystem::temp_directory_path() / "localsgd-etcd-XXXXXX")
            .string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("mkdtemp: ", strerror(errno)));
    }
    etcd->dir_ = pattern;
    auto client = BindFreePort();
    if (!client.ok()) return client.status();
    auto peer = BindFreePort();
    if (!peer.ok()) {
      close(client->first);
      return peer.status();
    }
    etcd->client_port_ = client->second;
    etcd->peer_port_ = peer->second;
    close(client->first);
    close(peer->first);
    last = etcd->Spawn();
    if (last.ok()) last = etcd->WaitReady();
    if (last.ok()) return etcd;
  }
  return last;
}

EtcdProcess::~EtcdProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::string EtcdProcess::endpoint() const {
  return absl::StrCat("127.0.0.1:", client_port_);
}

absl::StatusOr<std::string> EtcdProcess::DeadEndpoint() {
  auto port = BindFreePort();
  if (!port.ok()) return port.status();
  close(port->first);  // bound, never listened on: connections are refused
  return absl::StrCat("127.0.0.1:", port->second);
}

absl::Status EtcdProcess::Spawn() {
  std::vector<std::string> args = {
      kEtcdBinary,
      "--name=n0",
      absl::StrCat("--data-dir=", dir_, "/data"),
      absl::StrCat("--listen-client-urls=", Url(client_port_)),
      absl::StrCat("--advertise-client-urls=", Url(client_port_)),
      absl::StrCat("--listen-peer-urls=", Url(peer_port_)),
      absl::StrCat("--initial-advertise-peer-urls=", Url(peer_port_)),
      absl::StrCat("--initial-cluster=n0=", Url(peer_port_)),
      absl::StrCat("--heartbeat-interval=",
                   absl::ToInt64Milliseconds(options_.heartbeat)),
      absl::StrCat("--election-timeout=",
                   absl::ToInt64Milliseconds(options_.election_timeout)),
      "--logger=zap",
      "--log-outputs=stderr",
  };
  const std::string log = dir_ + "/etcd.log";
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", errno));
  if (pid == 0) {
    // The child: only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // no etcd outlives a crashed test
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    execv(kEtcdBinary, argv.data());
    _exit(127);
  }
  pid_ = pid;
  paused_ = false;
  return absl::OkStatus();
}

absl::Status EtcdProcess::WaitReady() {
  EtcdClientOptions client_options;
  client_options.endpoints = {endpoint()};
  client_options.rpc_timeout = absl::Milliseconds(300);
  auto client = EtcdClient::Create(client_options);
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + options_.ready_timeout;
  absl::Status last;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat("etcd exited (status ", status, "); log:\n", LogTail()));
    }
    last = (*client)->Get("/localsgd-test/ready").status();
    if (last.ok()) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(20));  // polling, not synchronising
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "etcd not ready after ", absl::FormatDuration(options_.ready_timeout),
      ": ", last.ToString(), "; log:\n", LogTail()));
}

absl::Status EtcdProcess::Signal(int signal, bool wait_exit) {
  if (pid_ <= 0) return absl::FailedPreconditionError("etcd is not running");
  if (paused_ && wait_exit) kill(pid_, SIGCONT);  // SIGTERM needs it running
  if (kill(pid_, signal) != 0) {
    return absl::InternalError(absl::StrCat("kill: ", strerror(errno)));
  }
  if (wait_exit) {
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
    paused_ = false;
  }
  return absl::OkStatus();
}

absl::Status EtcdProcess::Stop() { return Signal(SIGTERM, true); }
absl::Status EtcdProcess::Kill() { return Signal(SIGKILL, true); }

absl::Status EtcdProcess::Pause() {
  absl::Status s = Signal(SIGSTOP, false);
  if (!s.ok()) return s;
  paused_ = true;
  // SIGSTOP is delivered asynchronously: until the child is reported
  // stopped, a thread of it may still answer a request.
  int status = 0;
  if (waitpid(pid_, &status, WUNTRACED) != pid_ || !WIFSTOPPED(status)) {
    return absl::InternalError(
        absl::StrCat("etcd (pid ", pid_, ") did not stop; status ", status));
  }
  return absl::OkStatus();
}

absl::Status EtcdProcess::Resume() {
  absl::Status s = Signal(SIGCONT, false);
  if (s.ok()) paused_ = false;
  return s;
}

absl::Status EtcdProcess::Restart() {
  if (pid_ > 0) return absl::FailedPreconditionError("etcd is running");
  if (absl::Status s = Spawn(); !s.ok()) return s;
  return WaitReady();
}

std::string EtcdProcess::LogTail(size_t bytes) const {
  std::ifstream in(dir_ + "/etcd.log");
  std::stringstream all;
  all << in.rdbuf();
  std::string text = all.str();
  return text.size() > bytes ? text.substr(text.size() - bytes) : text;
}

}  // namespace ha_test
}  // namespace localsgd
