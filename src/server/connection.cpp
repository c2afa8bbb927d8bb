#include "server/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace lily::server {

DeadlineStream::DeadlineStream(tcp::socket socket, int stop_fd) : socket_(std::move(socket)), stop_fd_(stop_fd) {
  error_code ec;
  socket_.non_blocking(true, ec);
}

bool DeadlineStream::wait(bool reading, Clock::time_point deadline, error_code& ec) {
  while (true) {
    const auto now = Clock::now();
    if (now >= deadline) {
      ec = boost::beast::error::timeout;
      return false;
    }
    // Whole milliseconds, rounded up, so a deadline 0.3 ms away does not spin.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + std::chrono::milliseconds(1);
    const int ms = static_cast<int>(std::min<long long>(left.count(), 60000));
    pollfd fds[2] = {{socket_.native_handle(), static_cast<short>(reading ? POLLIN : POLLOUT), 0},
                     {stop_fd_, POLLIN, 0}};
    const nfds_t n = reading && stop_fd_ >= 0 ? 2 : 1;
    const int r = ::poll(fds, n, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      ec = error_code(errno, boost::system::system_category());
      return false;
    }
    if (n == 2 && (fds[1].revents & POLLIN)) {
      ec = net::error::operation_aborted;
      return false;
    }
    if (fds[0].revents != 0) return true;  // ready, or an error the next call reports
  }
}

bool DeadlineStream::wait_readable(Clock::time_point t) {
  error_code ec;
  return wait(true, t, ec);
}

void DeadlineStream::close_gracefully(std::chrono::milliseconds linger) {
  error_code ec;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (!ec) {
    set_read_deadline(Clock::now() + linger);
    char scratch[65536];
    while (true) {
      read_some(net::buffer(scratch), ec);
      if (ec) break;
    }
  }
  close();
}

void DeadlineStream::close() {
  error_code ec;
  socket_.close(ec);
}

bool ConnectionWatch::gone() const {
  pollfd p{fd_, 0, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool ConnectionWatch::read_closed() const {
  pollfd p{fd_, static_cast<short>(POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace lily::server
