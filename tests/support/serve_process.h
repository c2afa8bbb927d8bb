// A `lily serve` child process for C++ tests that talk to the server over raw sockets (what the
// Node harness, tests/node/server_harness.mjs, cannot do: set SO_RCVBUF, for one).
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

namespace lily::test {

/// A `lily serve` child process on the demo model, on the CPU backend, at an ephemeral port of
/// 127.0.0.1; its stderr is collected (`log`), its stdout discarded. The destructor SIGKILLs it
/// if it has not exited (stop() is the clean way out).
class ServeProcess {
 public:
  /// Starts `<build>/lily serve --model models/demo --bind 127.0.0.1:0 --backend cpu <extra>` and
  /// waits (up to 120 s) for its "serving NAME on http://127.0.0.1:PORT" line. Throws
  /// std::runtime_error when the pipe cannot be made or that line does not come (with the log).
  explicit ServeProcess(const std::vector<std::string>& extra);
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  /// The port the server listens on.
  int port() const { return port_; }
  /// Everything the server has written to stderr so far.
  const std::string& log();
  /// SIGTERM, then waits (up to 60 s) for the exit; returns the raw wait status (-1: no exit).
  int stop();

 private:
  /// Appends available stderr bytes; false when none came within `wait_ms` or the pipe closed.
  bool read_some(int wait_ms);

  pid_t pid_ = -1;
  int err_fd_ = -1;
  int port_ = 0;
  bool exited_ = false;
  std::string log_;
};

}  // namespace lily::test
