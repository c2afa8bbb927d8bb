// LilyServer's connections: the accept loop, admission within --max-connections (and eviction
// of the connection idle longest when every slot is taken), one thread per connection serving
// its keep-alive and pipelined requests, reading each request within its limits (head, body,
// timeouts, Expect), refusals, and the per-request log line. Everything about sockets and HTTP
// framing lives here; what a request means is routes.cpp's and generation.cpp's.
#include "server/server_impl.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/log.h"

namespace lily::server::detail {

namespace {

/// Connections beyond --max-connections that are answered 503 at the same time (each on a
/// short-lived thread of its own); further ones are closed without an answer.
constexpr int kMaxRejecting = 4;
/// How long a connection beyond the cap may take to send its request head before its 503.
constexpr auto kRejectHeadTime = std::chrono::seconds(2);
/// How long a connection that is closed after its answer is drained (DeadlineStream::close_gracefully).
constexpr auto kLinger = std::chrono::milliseconds(2000);
/// At most one eviction log line per this interval (the others are counted into the next line).
constexpr auto kEvictLogInterval = std::chrono::seconds(1);
/// How long the accept loop waits for evicted connections to finish closing before it refuses.
constexpr auto kEvictedDrainWait = std::chrono::milliseconds(500);

/// Whether the header value `value` holds `token` as one of its comma-separated items (any case).
bool has_token(std::string_view value, std::string_view token) {
  while (!value.empty()) {
    const size_t comma = value.find(',');
    std::string_view item = value.substr(0, comma);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    if (item.size() == token.size() &&
        std::equal(item.begin(), item.end(), token.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
        }))
      return true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

/// Whether a failed read of a request (head or body) means the client closed or reset the
/// connection, or shutdown aborted the read: nothing can be answered then, so the connection is
/// dropped without a refusal.
bool peer_went_away(const error_code& ec) {
  return ec == http::error::end_of_stream || ec == http::error::partial_message || ec == net::error::operation_aborted ||
         ec == net::error::eof || ec == net::error::connection_reset;
}

/// Empty lines skipped before a request line at most (a bound, so a client sending only CRLFs
/// still gets its 400).
constexpr int kMaxLeadingEmptyLines = 8;

/// RFC 9112 §2.2: a server should ignore at least one empty line received before a request
/// line (clients have sent a CRLF after a request body). Consumes up to kMaxLeadingEmptyLines
/// CRLFs or bare LFs from the front of `buffer`, reading from `stream` while what is buffered
/// could still be one; whatever else is left for the parser. A read error is left in `ec`.
void skip_leading_empty_lines(DeadlineStream& stream, beast::flat_buffer& buffer, error_code& ec) {
  for (int skipped = 0; skipped < kMaxLeadingEmptyLines;) {
    const auto* p = static_cast<const char*>(buffer.data().data());
    const std::size_t n = buffer.size();
    if (n == 0 || (n == 1 && p[0] == '\r')) {
      buffer.commit(stream.read_some(buffer.prepare(1024), ec));
      if (ec) return;
      continue;
    }
    if (p[0] == '\n') buffer.consume(1);
    else if (p[0] == '\r' && p[1] == '\n') buffer.consume(2);
    else return;
    ++skipped;
  }
}

}  // namespace

void LilyServer::accept_loop() {
  // ServerTestHooks::listen_delay_ms: tests only.
  if (options_.test_hooks.listen_delay_ms != 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.test_hooks.listen_delay_ms));
  while (!stopping_) {
    pollfd fds[2] = {{acceptor_.native_handle(), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log_error(std::string("the accept loop failed: ") + std::strerror(errno));
      return;
    }
    if (fds[1].revents & POLLIN) return;
    error_code ec;
    tcp::socket socket = acceptor_.accept(ec);
    if (ec == net::error::would_block || ec == net::error::try_again || ec == net::error::connection_aborted) continue;
    if (ec) {
      // Out of descriptors or memory: back off instead of spinning; the kernel keeps the queue.
      log_warn("accepting a connection failed: " + ec.message());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    start_connection(std::move(socket));
  }
}

void LilyServer::start_connection(tcp::socket socket) {
  const auto accepted = Clock::now();
  error_code ec;
  socket.set_option(tcp::no_delay(true), ec);  // SSE chunks go out at once
  if (options_.send_buffer > 0) {
    const int bytes = static_cast<int>(options_.send_buffer);
    setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  }
  // The thread owns the descriptor; its asio socket lives (and dies) inside serve_connection.
  const int fd = socket.release(ec);
  if (ec) return;  // still the socket's: its destructor closes it
  auto slot = std::make_shared<ConnectionSlot>();
  bool over_capacity = false;
  {
    std::unique_lock lock(connections_mutex_);
    // A slot is free, or one is freed by evicting the connection idle longest. The evicted
    // connections still closing are bounded (at most --max-connections of them) so that a
    // flood cannot pile up threads faster than they end. When that bound is what stands in the
    // way, the accept loop waits a moment for those threads (they end as soon as they run)
    // rather than refusing a client that an eviction would admit.
    if (open_ - evicted_open_ >= options_.max_connections && evicted_open_ >= options_.max_connections)
      connections_done_.wait_for(lock, kEvictedDrainWait,
                                 [this] { return evicted_open_ < options_.max_connections; });
    if (open_ - evicted_open_ < options_.max_connections ||
        (evicted_open_ < options_.max_connections && evict_idle_locked(accepted))) {
      ++open_;
      // Evictable from now on: a new connection waits for its first request head.
      slot->fd = fd;
      slot->evictable = true;
      slot->idle_since = accepted;
      slot->at = slots_.insert(slots_.end(), slot.get());
    } else if (rejecting_ < kMaxRejecting) {
      ++rejecting_;
      over_capacity = true;
    } else {
      slot.reset();  // a flood beyond the cap: closed without an answer
    }
  }
  if (!slot) {
    ::close(fd);
    return;
  }
  try {
    std::thread([this, fd, over_capacity, accepted, slot] {
      serve_connection(fd, over_capacity, accepted, over_capacity ? nullptr : slot.get());
      std::lock_guard lock(connections_mutex_);
      release_slot_locked(*slot, over_capacity);
    }).detach();
  } catch (const std::system_error& e) {
    log_warn(std::string("cannot start a connection thread: ") + e.what());
    {
      std::lock_guard lock(connections_mutex_);
      release_slot_locked(*slot, over_capacity);
    }
    ::close(fd);  // unregistered first: an eviction can no longer reach it
  }
}

void LilyServer::release_slot_locked(ConnectionSlot& slot, bool over_capacity) {
  if (over_capacity) {
    --rejecting_;
  } else {
    slot.evictable = false;
    slots_.erase(slot.at);
    if (slot.evicted) --evicted_open_;
    --open_;
  }
  connections_done_.notify_all();
}

void LilyServer::mark_idle(ConnectionSlot& slot, Clock::time_point since) {
  std::lock_guard lock(connections_mutex_);
  if (slot.evicted) return;
  slot.evictable = true;
  slot.idle_since = since;
}

bool LilyServer::mark_busy(ConnectionSlot& slot) {
  std::lock_guard lock(connections_mutex_);
  slot.evictable = false;
  return slot.evicted;
}

bool LilyServer::evict_idle_locked(Clock::time_point now) {
  ConnectionSlot* oldest = nullptr;
  for (ConnectionSlot* s : slots_)
    if (s->evictable && (oldest == nullptr || s->idle_since < oldest->idle_since)) oldest = s;
  if (oldest == nullptr) return false;
  // The descriptor is open: its thread clears `evictable` under this mutex before closing it.
  // Shutting it down (not closing it) ends the thread's blocked poll/read at once; the thread
  // then closes the socket itself.
  ::shutdown(oldest->fd, SHUT_RDWR);
  oldest->evictable = false;
  oldest->evicted = true;
  ++evicted_open_;
  metrics_.record_connection_evicted();
  ++evictions_unlogged_;
  if (now - last_evict_log_ >= kEvictLogInterval) {
    const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - oldest->idle_since).count();
    std::string line = "closed a connection idle for " + std::to_string(idle_ms) +
                       " ms (waiting for a request head) to admit a new one (connection limit " +
                       std::to_string(options_.max_connections) + " reached)";
    if (evictions_unlogged_ > 1) line += "; " + std::to_string(evictions_unlogged_ - 1) + " more since the last such line";
    log_info(line);
    last_evict_log_ = now;
    evictions_unlogged_ = 0;
  }
  return true;
}

void LilyServer::serve_connection(int fd, bool over_capacity, Clock::time_point accepted, ConnectionSlot* slot) {
  error_code ec;
  tcp::socket socket(io_);
  socket.assign(protocol_, fd, ec);
  if (ec) {
    if (slot != nullptr) mark_busy(*slot);  // before the close: an eviction must not reach a reused fd
    ::close(fd);
    return;
  }
  DeadlineStream stream(std::move(socket), stop_fd_);
  // Declared after the stream, so the slot is busy (no longer evictable) before the stream's
  // destructor closes the socket, also when an exception unwinds this frame.
  struct BusyOnExit {
    LilyServer& server;
    ConnectionSlot* slot;
    ~BusyOnExit() {
      if (slot != nullptr) server.mark_busy(*slot);
    }
  } busy_on_exit{*this, slot};
  // Beast reads at most 64 KiB at a time, and the parser stops at --max-header-bytes: the
  // buffer never holds much more than one head.
  beast::flat_buffer buffer(static_cast<size_t>(options_.max_header_bytes) + 65536);
  const auto read_timeout = std::chrono::seconds(options_.read_timeout_s);
  // A new connection must send its whole first head within --read-timeout of being accepted.
  if (over_capacity) {
    const auto deadline = accepted + std::min<Clock::duration>(read_timeout, kRejectHeadTime);
    serve_request(stream, buffer, deadline, true);
    stream.close_gracefully(kLinger);
    return;
  }
  Clock::time_point head_deadline = accepted + read_timeout;
  bool first = true;
  while (!stopping_) {
    // Until its head has been read, the connection may be evicted for a new one (its socket
    // shut down, so the wait or the read below ends at once).
    mark_idle(*slot, first ? accepted : Clock::now());
    if (buffer.size() == 0) {
      // Nothing of the next request yet: wait for its first byte (a kept-alive connection
      // within --keep-alive), then the whole head must come within --read-timeout.
      if (!stream.wait_readable(first ? head_deadline : Clock::now() + std::chrono::seconds(options_.keep_alive_s))) {
        mark_busy(*slot);
        stream.close();
        return;
      }
      if (!first) head_deadline = Clock::now() + read_timeout;
    } else if (!first) {
      head_deadline = Clock::now() + read_timeout;  // a pipelined request is already here
    }
    first = false;
    const After after = serve_request(stream, buffer, head_deadline, false, slot);
    if (after == After::kAbort) {
      mark_busy(*slot);
      stream.close();
      return;
    }
    if (after == After::kClose) break;
  }
  if (mark_busy(*slot)) {  // evicted while the server stopped: the socket is shut down already
    stream.close();
    return;
  }
  stream.close_gracefully(kLinger);
}

After LilyServer::refuse(DeadlineStream& stream, const http::request_parser<http::string_body>& parser,
                         const ApiError& e) {
  // What the parser got of the request line names the request in the log, if anything.
  const auto& partial = parser.get();
  std::string method(partial.method_string());
  std::string path = request_path(partial.target());
  Exchange ex(stream, std::chrono::seconds(options_.write_timeout_s), method.empty() ? "-" : method,
              path.empty() ? "-" : path, 11, false);
  if (t_request.id.empty()) t_request.id = "req_" + random_hex(16);
  add_common_headers(ex, partial);
  Reply res;
  send_error(res, e);
  res.close = true;
  ex.send(res);
  finish(ex);
  return After::kClose;
}

After LilyServer::serve_request(DeadlineStream& stream, beast::flat_buffer& buffer, Clock::time_point head_deadline,
                                bool over_capacity, ConnectionSlot* slot) {
  t_request = RequestInfo{};
  http::request_parser<http::string_body> parser;
  parser.header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
  parser.body_limit(static_cast<std::uint64_t>(options_.max_body));
  const std::string body_limit_text = "request body exceeds the limit of " + std::to_string(options_.max_body) + " bytes";
  stream.set_read_deadline(head_deadline);
  error_code ec;
  skip_leading_empty_lines(stream, buffer, ec);
  if (!ec) http::read_header(stream, buffer, parser, ec);
  // From here on the connection is busy with this request (or its refusal) and is not evicted.
  // One evicted while the head arrived has its socket shut down: nothing can be answered.
  if (slot != nullptr && mark_busy(*slot)) return After::kAbort;
  if (ec) {
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
      return refuse(stream, parser, ApiError(431, "invalid_request_error",
                                             "request head exceeds the limit of " +
                                                 std::to_string(options_.max_header_bytes) + " bytes",
                                             std::nullopt, "request_header_too_large"));
    if (ec == http::error::body_limit)  // a declared Content-Length above --max-body
      return refuse(stream, parser, ApiError(413, "invalid_request_error", body_limit_text, std::nullopt, "request_too_large"));
    if (ec == beast::error::timeout) {
      if (!parser.got_some() && buffer.size() == 0) return After::kAbort;  // silent: just closed
      return refuse(stream, parser, ApiError(408, "invalid_request_error",
                                             "the request head did not arrive within the read timeout of " +
                                                 std::to_string(options_.read_timeout_s) + " s",
                                             std::nullopt, "request_timeout"));
    }
    if (peer_went_away(ec)) return After::kAbort;
    // The parser refuses every version but 1.0 and 1.1; a well-formed other one is a 505.
    if (ec == http::error::bad_version &&
        has_unsupported_http_version(std::string_view(static_cast<const char*>(buffer.data().data()), buffer.size())))
      return refuse(stream, parser, ApiError(505, "invalid_request_error",
                                             "HTTP version not supported: this server speaks HTTP/1.0 and HTTP/1.1",
                                             std::nullopt, "http_version_not_supported"));
    return refuse(stream, parser, ApiError(400, "invalid_request_error", "malformed HTTP request: " + ec.message(),
                                           std::nullopt, "bad_request"));
  }
  const auto& head = parser.get();
  // The request id is known from here on: every answer and log line about the request has it.
  const std::string client_id(head["X-Request-Id"]);
  t_request.id = is_valid_request_id(client_id) ? client_id : "req_" + random_hex(16);
  if (static_cast<int64_t>(std::distance(head.begin(), head.end())) > options_.max_headers)
    return refuse(stream, parser, ApiError(431, "invalid_request_error",
                                           "the request has more header fields than the limit of " +
                                               std::to_string(options_.max_headers),
                                           std::nullopt, "request_header_too_large"));
  // RFC 9112 §6.3: a request whose Transfer-Encoding does not end in chunked has no knowable
  // length. Answering it and reading on would let its body pass as the next request (request
  // smuggling), so it is refused and the connection closed.
  if (head.count(http::field::transfer_encoding) > 0 && !parser.chunked())
    return refuse(stream, parser, ApiError(400, "invalid_request_error",
                                           "Transfer-Encoding must end in 'chunked', got '" +
                                               std::string(head[http::field::transfer_encoding]) + "'",
                                           std::nullopt, "bad_request"));
  // RFC 9112 §6.1: a transfer coding the server does not decode (gzip before the chunked
  // framing) is a 501; reading the body as plain JSON would misread it.
  std::string codings;  // every Transfer-Encoding field, joined as one list
  for (auto [it, end] = head.equal_range(http::field::transfer_encoding); it != end; ++it)
    codings += std::string(codings.empty() ? "" : ", ") + std::string(it->value());
  if (const auto coding = unsupported_transfer_coding(codings))
    return refuse(stream, parser, ApiError(501, "invalid_request_error",
                                           "unsupported transfer coding '" + *coding +
                                               "': this server decodes only a single 'chunked'",
                                           std::nullopt, "not_implemented"));
  // RFC 9112 §3.2: an HTTP/1.1 request carries exactly one Host field (a 400 otherwise).
  if (head.version() >= 11 && head.count(http::field::host) != 1)
    return refuse(stream, parser, ApiError(400, "invalid_request_error",
                                           head.count(http::field::host) == 0
                                               ? "an HTTP/1.1 request needs a Host header field"
                                               : "the request has more than one Host header field",
                                           std::nullopt, "bad_request"));
  // A compressed body would be parsed as plain JSON: say so instead (RFC 9110 §15.5.16).
  if (head.count(http::field::content_encoding) > 0 && !beast::iequals(head[http::field::content_encoding], "identity"))
    return refuse(stream, parser, ApiError(415, "invalid_request_error",
                                           "unsupported Content-Encoding '" +
                                               std::string(head[http::field::content_encoding]) +
                                               "': send the body uncompressed",
                                           std::nullopt, "unsupported_media_type"));
  if (over_capacity)
    return refuse(stream, parser, ApiError(503, "server_error",
                                           "too many open connections (limit " +
                                               std::to_string(options_.max_connections) + "); retry later",
                                           std::nullopt, "too_many_connections")
                                      .with_header("Retry-After", "1"));
  // Expect: only 100-continue is known (RFC 9110 §10.1.1: 417 for anything else). "100
  // Continue" goes out only once the request would be served (route, method and API key are
  // right); otherwise the error is the answer and the body is never read.
  const bool expects = head.count(http::field::expect) > 0;
  if (expects && !has_token(head[http::field::expect], "100-continue"))
    return refuse(stream, parser, ApiError(417, "invalid_request_error",
                                           "unsupported Expect header '" + std::string(head[http::field::expect]) +
                                               "' (only 100-continue is supported)",
                                           std::nullopt, "expectation_failed"));
  if (!parser.is_done()) {
    if (expects && head.version() >= 11) {
      if (auto e = gate(head.method_string(), request_path(head.target()), head)) return refuse(stream, parser, *e);
      static constexpr std::string_view go_on = "HTTP/1.1 100 Continue\r\n\r\n";
      stream.set_write_deadline(Clock::now() + std::chrono::seconds(options_.write_timeout_s));
      net::write(stream, net::buffer(go_on.data(), go_on.size()), ec);
      if (ec) return After::kAbort;
    }
    // The body, too, must come within --read-timeout; --max-body is enforced as it arrives.
    stream.set_read_deadline(Clock::now() + std::chrono::seconds(options_.read_timeout_s));
    http::read(stream, buffer, parser, ec);
    if (ec) {
      if (ec == http::error::body_limit)
        return refuse(stream, parser, ApiError(413, "invalid_request_error", body_limit_text, std::nullopt, "request_too_large"));
      if (ec == beast::error::timeout)
        return refuse(stream, parser, ApiError(408, "invalid_request_error",
                                               "the request body did not arrive within the read timeout of " +
                                                   std::to_string(options_.read_timeout_s) + " s",
                                               std::nullopt, "request_timeout"));
      if (peer_went_away(ec)) return After::kAbort;
      return refuse(stream, parser, ApiError(400, "invalid_request_error", "malformed HTTP request body: " + ec.message(),
                                             std::nullopt, "bad_request"));
    }
  }
  const Request req = parser.release();
  Exchange ex(stream, std::chrono::seconds(options_.write_timeout_s), std::string(req.method_string()),
              request_path(req.target()), req.version(), req.keep_alive() && !stopping_);
  add_common_headers(ex, req);
  handle(ex, req);
  finish(ex);
  return ex.after();
}

void LilyServer::finish(const Exchange& ex) {
  const auto elapsed = Clock::now() - t_request.start;
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count();
  metrics_.record_request(route_label(ex.path), ex.status());
  if (t_request.generation) metrics_.observe_request_duration(seconds(elapsed));
  if (ex.path == "/health" || ex.path == "/metrics") {
    log_debug(request_log_line(ex.method, ex.path, ex.status(), ms, std::nullopt, t_request.error, t_request.id));
    return;
  }
  log_info(request_log_line(ex.method, ex.path, ex.status(), ms, t_request.tokens, t_request.error, t_request.id));
}

void LilyServer::add_common_headers(Exchange& ex, const http::fields& head) const {
  ex.add_header("X-Request-Id", t_request.id);
  if (options_.allowed_origins.empty()) return;
  const auto& allowed = options_.allowed_origins;
  const bool any = std::find(allowed.begin(), allowed.end(), "*") != allowed.end();
  if (!any) ex.add_header("Vary", "Origin");  // the answer depends on Origin (caches must know)
  if (const auto origin = cors_allow_origin(options_.allowed_origins, head[http::field::origin])) {
    ex.add_header("Access-Control-Allow-Origin", *origin);
    ex.add_header("Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
  }
}

}  // namespace lily::server::detail
