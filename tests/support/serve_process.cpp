#include "support/serve_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <stdexcept>

#include "support/test_support.h"

namespace lily::test {

using Clock = std::chrono::steady_clock;

ServeProcess::ServeProcess(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {(binary_dir() / "lily").string(), "serve", "--model",
                                   demo_model_dir().string(), "--bind", "127.0.0.1:0", "--backend", "cpu"};
  args.insert(args.end(), extra.begin(), extra.end());
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  pid_ = fork();
  if (pid_ == 0) {
    dup2(fds[1], 2);
    const int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    close(fds[0]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  err_fd_ = fds[0];
  const std::regex serving(R"(serving \S+ on http://127\.0\.0\.1:(\d+))");
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  std::smatch m;
  while (Clock::now() < deadline && !std::regex_search(log_, m, serving)) {
    if (!read_some(500)) break;
  }
  if (!std::regex_search(log_, m, serving)) throw std::runtime_error("lily serve did not start:\n" + log_);
  port_ = std::stoi(m[1]);
}

ServeProcess::~ServeProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (err_fd_ >= 0) close(err_fd_);
}

const std::string& ServeProcess::log() {
  while (read_some(0)) {
  }
  return log_;
}

int ServeProcess::stop() {
  kill(pid_, SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (Clock::now() < deadline) {
    read_some(50);
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      while (read_some(0)) {
      }
      return status;
    }
  }
  return -1;
}

bool ServeProcess::read_some(int wait_ms) {
  pollfd p{err_fd_, POLLIN, 0};
  if (poll(&p, 1, wait_ms) <= 0) return false;
  char buf[4096];
  const ssize_t n = read(err_fd_, buf, sizeof buf);
  if (n <= 0) return false;
  log_.append(buf, static_cast<size_t>(n));
  return true;
}

}  // namespace lily::test
