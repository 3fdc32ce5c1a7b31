// A real etcd (/usr/bin/etcd) for tests: one member on free loopback ports
// with a fresh data directory, which the test can stop, kill, pause, resume
// and restart. Not thread-safe.
#ifndef LOCALSGD_TESTS_HA_ETCD_PROCESS_H_
#define LOCALSGD_TESTS_HA_ETCD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace localsgd {
namespace ha_test {

inline constexpr char kEtcdBinary[] = "/usr/bin/etcd";

struct EtcdProcessOptions {
  // Raft timing. etcd's minimum lease TTL is 1.5 election timeouts rounded
  // up to whole seconds: 1 s with these (2 s with etcd's 100/1000 ms).
  absl::Duration heartbeat = absl::Milliseconds(50);
  absl::Duration election_timeout = absl::Milliseconds(500);
  // How long Start and Restart wait for etcd to answer.
  absl::Duration ready_timeout = absl::Seconds(15);
};

class EtcdProcess {
 public:
  // Whether /usr/bin/etcd is there (tests skip if not).
  static bool Available();
  // Starts etcd and returns once it answers a read.
  static absl::StatusOr<std::unique_ptr<EtcdProcess>> Start(
      EtcdProcessOptions options = {});
  // Kills etcd (SIGKILL) if running and removes its directory.
  ~EtcdProcess();
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  // host:port of its client URL.
  std::string endpoint() const;
  // A loopback host:port on which nothing listens (for failover tests).
  static absl::StatusOr<std::string> DeadEndpoint();

  // SIGTERM and wait for it to exit.
  absl::Status Stop();
  // SIGKILL and wait for it to exit.
  absl::Status Kill();
  // SIGSTOP / SIGCONT.
  absl::Status Pause();
  absl::Status Resume();
  // After Stop or Kill: starts it again on the same data directory and
  // ports, and returns once it answers.
  absl::Status Restart();
  // The tail of etcd's log (for failure messages).
  std::string LogTail(size_t bytes = 4000) const;

 private:
  explicit EtcdProcess(EtcdProcessOptions options);
  absl::Status Spawn();
  absl::Status WaitReady();
  absl::Status Signal(int signal, bool wait_exit);

  EtcdProcessOptions options_;
  std::string dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
  bool paused_ = false;
};

}  // namespace ha_test
}  // namespace localsgd

#endif  // LOCALSGD_TESTS_HA_ETCD_PROCESS_H_
