// One accepted TCP connection of `lily serve`: a Boost.Asio socket in non-blocking
// mode whose every read and write ends at a deadline, so that Boost.Beast's synchronous parser
// and serializer run on it without a client being able to hold a thread past the limits
// (--read-timeout for a whole request head or body, --write-timeout for each write, --keep-alive
// between requests). Reads also end when the server shuts down (an eventfd in every poll).
#pragma once
#include <chrono>
#include <cstddef>

#include <boost/asio/buffer.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/error.hpp>

namespace lily::server {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

/// A connected socket with deadlines: a Beast SyncReadStream and SyncWriteStream. A read or
/// write that cannot make progress before its deadline fails with beast::error::timeout; a
/// read fails with net::error::operation_aborted once `stop_fd` is readable (shutdown).
class DeadlineStream {
 public:
  using Clock = std::chrono::steady_clock;
  using executor_type = tcp::socket::executor_type;

  /// Takes the accepted socket (switched to non-blocking mode). `stop_fd`: an eventfd that
  /// becomes readable when the server stops; -1 for none.
  DeadlineStream(tcp::socket socket, int stop_fd);

  /// The socket's executor (Beast's stream concepts ask for it; all I/O here is synchronous).
  executor_type get_executor() { return socket_.get_executor(); }
  /// The native descriptor (for ConnectionWatch).
  int fd() { return socket_.native_handle(); }

  /// Reads from here on must make progress by `t`.
  void set_read_deadline(Clock::time_point t) { read_deadline_ = t; }
  /// Writes from here on must make progress by `t`.
  void set_write_deadline(Clock::time_point t) { write_deadline_ = t; }

  /// Waits until bytes (or an end of stream) can be read, at most until `t`; false on a
  /// timeout, an error or shutdown.
  bool wait_readable(Clock::time_point t);

  /// Reads some bytes (SyncReadStream), waiting at most until the read deadline.
  template <class MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers, error_code& ec) {
    while (true) {
      const std::size_t n = socket_.read_some(buffers, ec);
      if (ec != net::error::would_block && ec != net::error::try_again) return n;
      if (!wait(true, read_deadline_, ec)) return 0;
    }
  }
  /// Throwing form of read_some (the concept needs both).
  template <class MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers) {
    error_code ec;
    const std::size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  /// Writes some bytes (SyncWriteStream), waiting at most until the write deadline.
  template <class ConstBufferSequence>
  std::size_t write_some(const ConstBufferSequence& buffers, error_code& ec) {
    while (true) {
      const std::size_t n = socket_.write_some(buffers, ec);
      if (ec != net::error::would_block && ec != net::error::try_again) return n;
      if (!wait(false, write_deadline_, ec)) return 0;
    }
  }
  /// Throwing form of write_some.
  template <class ConstBufferSequence>
  std::size_t write_some(const ConstBufferSequence& buffers) {
    error_code ec;
    const std::size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  /// Ends the connection politely: no more sends (FIN after what was written), then reads and
  /// discards what the client still sends for at most `linger` (so that an answer sent before
  /// the request was fully read reaches the client instead of being lost to a reset), then
  /// closes.
  void close_gracefully(std::chrono::milliseconds linger);
  /// Closes at once.
  void close();

 private:
  /// Polls for readability (`reading`) or writability until `deadline`; sets `ec` and returns
  /// false on timeout (beast::error::timeout), shutdown (reads only) or a poll failure.
  bool wait(bool reading, Clock::time_point deadline, error_code& ec);

  tcp::socket socket_;
  int stop_fd_;
  Clock::time_point read_deadline_ = Clock::time_point::max();
  Clock::time_point write_deadline_ = Clock::time_point::max();
};

/// Watches a connection, while its request is generated, for the client having gone away.
class ConnectionWatch {
 public:
  /// Watches the socket `fd` (not owned).
  explicit ConnectionWatch(int fd) : fd_(fd) {}
  /// True once the connection is reset or fully shut down (a write to a client that closed
  /// its socket draws a reset): the client is gone.
  bool gone() const;
  /// True once the client has shut down its sending side. That alone does not mean it is gone:
  /// a client may send its request, shutdown(SHUT_WR) and still read the answer.
  bool read_closed() const;

 private:
  int fd_;
};

}  // namespace lily::server
