// `lily serve --write-timeout` against a client that stops reading. Starts the built `lily serve`
// on the demo model as a child process (support/serve_process.h) and talks raw TCP to it. The
// stalled client fixes a small receive buffer before it connects (SO_RCVBUF, which also stops the
// kernel's auto-tuning), and the server a small send buffer (--send-buffer): together they hold
// a few KB, so the stream stalls after some dozens of tokens whatever the kernel or the speed of
// the build (Node cannot set SO_RCVBUF, hence a C++ test). Runs under ASan in scripts/test.sh.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/serve_process.h"

using namespace lily::test;
using Clock = std::chrono::steady_clock;

namespace {

/// A TCP connection to 127.0.0.1:port; `recv_buffer` > 0 sets SO_RCVBUF before connecting.
int connect_to(int port, int recv_buffer = 0) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (recv_buffer > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &recv_buffer, sizeof recv_buffer);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    throw std::runtime_error("cannot connect to port " + std::to_string(port));
  }
  return fd;
}

void send_all(int fd, const std::string& text) {
  size_t sent = 0;
  while (sent < text.size()) {
    const ssize_t n = send(fd, text.data() + sent, text.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) throw std::runtime_error("send failed");
    sent += static_cast<size_t>(n);
  }
}

/// Reads until the peer closes (or resets) the connection; false if it is still open after `timeout`.
bool read_until_closed(int fd, std::chrono::seconds timeout, std::string* out = nullptr) {
  const auto deadline = Clock::now() + timeout;
  char buf[65536];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
    if (out) out->append(buf, static_cast<size_t>(n));
  }
  return false;
}

/// One GET over a fresh connection ("Connection: close"); the whole raw response.
std::string http_get(int port, const std::string& path) {
  const int fd = connect_to(port);
  send_all(fd, "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string response;
  read_until_closed(fd, std::chrono::seconds(30), &response);
  close(fd);
  return response;
}

/// The value of one unlabelled Prometheus series from GET /metrics (-1 when absent).
double metric(int port, const std::string& name) {
  const std::string text = http_get(port, "/metrics");
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("\n" + name + " ([0-9.e+]+)\n"))) return -1;
  return std::stod(m[1]);
}

}  // namespace

TEST(ServeSlowReader, StalledStreamIsCancelledAfterWriteTimeoutAndClosed) {
  ServeProcess server({"--write-timeout", "2", "--send-buffer", "4096"});
  ASSERT_EQ(metric(server.port(), "lily_generations_cancelled_total"), 0);

  // A long streamed answer (the demo model writes over 1,000 tokens for this prompt, ≈ 200 B of
  // SSE each): far more than the few KB the two buffers hold.
  std::string prompt = "Request 5:";
  const char* vocab[] = {"cmake", "target", "library", "python", "file", "module", "install", "package", "build", "path"};
  for (int i = 0; i < 50; ++i) prompt += std::string(" ") + vocab[(i * 7 + 5 * 13) % 10];
  const std::string body = R"({"model":"demo","stream":true,"max_tokens":3000,"messages":[{"role":"user","content":")" +
                           prompt + R"("}]})";
  const int stalled = connect_to(server.port(), 4096);
  send_all(stalled, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  // Never read. The server's write blocks once the buffers are full; after --write-timeout it
  // must give the stream up and cancel the generation.
  double cancelled = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(300);
  while (Clock::now() < deadline && (cancelled = metric(server.port(), "lily_generations_cancelled_total")) < 1)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cancelled, 1) << "the stalled stream was never given up";
  EXPECT_LT(metric(server.port(), "lily_completion_tokens_total"), 3000);
  EXPECT_EQ(metric(server.port(), "lily_requests_running"), 0);
  EXPECT_TRUE(std::regex_search(server.log(), std::regex(R"(POST /v1/chat/completions 200 \d+ms .*error="cancelled")")))
      << server.log();

  // The server has closed the stalled connection: draining it ends in EOF or a reset.
  EXPECT_TRUE(read_until_closed(stalled, std::chrono::seconds(30))) << "the stalled connection is still open";
  close(stalled);

  // Other clients are served.
  EXPECT_EQ(http_get(server.port(), "/health").rfind("HTTP/1.1 200 ", 0), 0u);

  const int status = server.stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status << "\n" << server.log();
  EXPECT_EQ(server.log().find("ERROR: AddressSanitizer"), std::string::npos) << server.log();
  EXPECT_EQ(server.log().find("runtime error:"), std::string::npos) << server.log();
}
