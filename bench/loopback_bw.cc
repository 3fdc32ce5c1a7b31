// loopback_bw: TCP bandwidth over 127.0.0.1, the denominator of
// bench/sync_round.sh's lower bound.
//
// Moves --bytes in total over --streams parallel TCP connections (each carries
// bytes / streams), one sending and one receiving thread per connection, with
// large reused buffers (--buffer). Time runs from the first send to the last
// byte received. Prints one line on stdout:
//   RESULT streams=S bytes=B seconds=T GBps=G
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"

ABSL_FLAG(int64_t, bytes, int64_t{4} << 30, "Total bytes to move.");
ABSL_FLAG(int32_t, streams, 1, "Parallel TCP connections.");
ABSL_FLAG(int64_t, buffer, int64_t{4} << 20,
          "Bytes per send()/recv() buffer (reused).");

namespace {

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "loopback_bw: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Measures TCP bandwidth over 127.0.0.1:\n"
      "  loopback_bw --bytes=4294967296 --streams=1");
  absl::ParseCommandLine(argc, argv);
  const int64_t total = absl::GetFlag(FLAGS_bytes);
  const int streams = absl::GetFlag(FLAGS_streams);
  const int64_t buffer = absl::GetFlag(FLAGS_buffer);
  if (total < 1 || streams < 1 || streams > 1024 || buffer < 1) {
    std::fprintf(stderr,
                 "loopback_bw: need --bytes >= 1, --streams in "
                 "1..1024, --buffer >= 1\n");
    return 2;
  }

  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) Die("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Die("bind");
  }
  if (listen(listener, streams) != 0) Die("listen");
  socklen_t len = sizeof(addr);
  if (getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die("getsockname");
  }

  std::vector<int> senders(streams), receivers(streams);
  for (int s = 0; s < streams; ++s) {
    senders[s] = socket(AF_INET, SOCK_STREAM, 0);
    if (senders[s] < 0) Die("socket");
    if (connect(senders[s], reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
        0) {
      Die("connect");
    }
    receivers[s] = accept(listener, nullptr, nullptr);
    if (receivers[s] < 0) Die("accept");
  }
  close(listener);

  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  std::vector<int64_t> received(streams, 0);
  for (int s = 0; s < streams; ++s) {
    const int64_t share = total / streams + (s < total % streams ? 1 : 0);
    threads.emplace_back([&, s, share] {
      std::vector<char> data(static_cast<size_t>(buffer), 'x');
      ++ready;
      while (!go.load()) std::this_thread::yield();
      int64_t left = share;
      while (left > 0) {
        const ssize_t n = send(senders[s], data.data(),
                               static_cast<size_t>(std::min(left, buffer)), 0);
        if (n < 0) {
          if (errno == EINTR) continue;
          Die("send");
        }
        left -= n;
      }
      shutdown(senders[s], SHUT_WR);
    });
    threads.emplace_back([&, s] {
      std::vector<char> data(static_cast<size_t>(buffer));
      ++ready;
      while (!go.load()) std::this_thread::yield();
      for (;;) {
        const ssize_t n = recv(receivers[s], data.data(), data.size(), 0);
        if (n < 0) {
          if (errno == EINTR) continue;
          Die("recv");
        }
        if (n == 0) break;
        received[s] += n;
      }
    });
  }
  while (ready.load() < 2 * streams) std::this_thread::yield();
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true);
  for (std::thread& t : threads) t.join();
  const auto t1 = std::chrono::steady_clock::now();
  int64_t got = 0;
  for (int s = 0; s < streams; ++s) {
    got += received[s];
    close(senders[s]);
    close(receivers[s]);
  }
  if (got != total) {
    std::fprintf(stderr, "loopback_bw: received %lld of %lld bytes\n",
                 static_cast<long long>(got), static_cast<long long>(total));
    return 1;
  }
  const double seconds = std::chrono::duration<double>(t1 - t0).count();
  std::printf("RESULT streams=%d bytes=%lld seconds=%.6f GBps=%.4f\n", streams,
              static_cast<long long>(total), seconds, total / seconds / 1e9);
  return 0;
}
