// The internals of `lily serve` (http_server.h), shared by the files that implement them:
// the LilyServer class and the small types its requests pass around (RequestInfo,
// ConnectionSlot, Reply, Exchange, ChatCall). Private to src/server: nothing outside this
// folder includes it. LilyServer's docstring says which file defines what.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include "engine/generate.h"
#include "engine/scheduler.h"
#include "model/config.h"
#include "server/api_error.h"
#include "server/chat_request.h"
#include "server/connection.h"
#include "server/http_server.h"
#include "server/http_util.h"
#include "server/metrics.h"
#include "server/openai_json.h"
#include "server/tool_calls.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace lily::server::detail {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using nlohmann::ordered_json;

namespace beast = boost::beast;
namespace http = beast::http;
using Request = http::request<http::string_body>;

// --- per-request bookkeeping for the log line (one connection's requests run on its thread) --

/// What the log line and /metrics learn about the request being served.
struct RequestInfo {
  Clock::time_point start = Clock::now();
  std::optional<LogTokens> tokens;
  std::string error;
  std::string id;           ///< X-Request-Id: the client's well-formed one, else generated
  bool generation = false;  ///< a job was submitted (its duration goes to the latency histogram)
};
/// The request this thread serves (one connection's requests run on its thread).
inline thread_local RequestInfo t_request;

/// One admitted connection as the accept loop sees it, to pick a connection to evict when all
/// --max-connections slots are taken. The accept loop registers it in LilyServer::slots_ when
/// it admits the connection and the connection thread unregisters it when it ends (both hold it
/// through a shared_ptr); every field is read and written under LilyServer::connections_mutex_ only. While `evictable` is true, the
/// connection thread keeps `fd` open (it clears `evictable`, under the mutex, before it closes
/// the socket), so the accept loop may shut the descriptor down without racing its close.
struct ConnectionSlot {
  int fd = -1;                    ///< the connection's socket (owned by its thread)
  bool evictable = false;         ///< waiting for a request head (fresh, or kept alive between requests)
  bool evicted = false;           ///< the accept loop shut it down to give its slot away
  Clock::time_point idle_since;   ///< when it started waiting for the current head
  std::list<ConnectionSlot*>::iterator at;  ///< its entry in LilyServer::slots_
};

/// `n` random lowercase hex digits (request and completion ids).
inline std::string random_hex(size_t n) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() % 16];
  return s;
}

/// A duration in seconds.
inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// A whole (not streamed) answer: status, content type, body and extra headers.
struct Reply {
  int status = 200;
  std::string content_type = "application/json";  ///< empty: no Content-Type (a 204)
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool close = false;  ///< close the connection after it (the request was not read to its end)
};

/// Makes `res` a JSON answer with `status` and `body`.
inline void set_json(Reply& res, int status, std::string body) {
  res.status = status;
  res.content_type = "application/json";
  res.body = std::move(body);
}

/// Makes `res` the answer for `e` (its status, body and headers) and notes it for the log line.
inline void send_error(Reply& res, const ApiError& e) {
  for (const auto& h : e.headers()) res.headers.push_back(h);
  set_json(res, e.status(), dump(e.body()));
  t_request.error = e.message();  // whole: the log line escapes NULs and control characters
}

/// How the connection goes on after one request.
enum class After { kNext, kClose, kAbort };

/// The status logged and counted (never sent) for a request whose client went away before any
/// answer reached it: nginx's 499 "client closed request", which log tools already know.
inline constexpr int kClientClosedRequest = 499;

/// The answer side of one request on a connection: a whole reply, or a stream of chunks.
class Exchange {
 public:
  /// `version`: the request's HTTP version (10 or 11); `keep_alive`: whether the connection
  /// may serve another request after this one.
  Exchange(DeadlineStream& stream, std::chrono::seconds write_timeout, std::string method, std::string path,
           unsigned version, bool keep_alive)
      : method(std::move(method)), path(std::move(path)), stream_(stream), write_timeout_(write_timeout),
        version_(version), keep_alive_(keep_alive) {}

  const std::string method;  ///< as sent ("-" when the request line was not read)
  const std::string path;    ///< the target without its query ("-" when not read)

  /// Adds a header to every answer this exchange sends (the request id, CORS headers).
  void add_header(std::string name, std::string value) { common_.emplace_back(std::move(name), std::move(value)); }

  /// Writes a whole reply (only its head for HEAD). False when the write failed.
  bool send(const Reply& r) {
    http::response<http::string_body> res{static_cast<http::status>(r.status), version_};
    if (!r.content_type.empty()) res.set(http::field::content_type, r.content_type);
    set_common(res);
    for (const auto& [name, value] : r.headers) res.set(name, value);
    res.body() = r.body;
    if (r.close) keep_alive_ = false;
    res.keep_alive(keep_alive_);
    res.prepare_payload();
    if (r.status == 204) res.erase(http::field::content_length);  // RFC 9110 §8.6: none on a 204
    status_ = r.status;
    started_ = true;
    stream_.set_write_deadline(DeadlineStream::Clock::now() + write_timeout_);
    error_code ec;
    if (method == "HEAD") {
      http::response_serializer<http::string_body> sr{res};
      http::write_header(stream_, sr, ec);
    } else {
      http::write(stream_, res, ec);
    }
    if (ec) broken_ = true;
    head_sent_ = !ec;
    return !ec;
  }

  /// Writes the head of a streamed 200 answer (chunked; for HTTP/1.0 the body ends with the
  /// connection).
  bool begin_stream(const std::string& content_type, const std::vector<std::pair<std::string, std::string>>& headers) {
    http::response<http::empty_body> res{http::status::ok, version_};
    res.set(http::field::content_type, content_type);
    set_common(res);
    for (const auto& [name, value] : headers) res.set(name, value);
    chunked_ = version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    res.keep_alive(keep_alive_);
    res.chunked(chunked_);
    status_ = 200;
    started_ = streaming_ = true;
    stream_.set_write_deadline(DeadlineStream::Clock::now() + write_timeout_);
    error_code ec;
    http::response_serializer<http::empty_body> sr{res};
    http::write_header(stream_, sr, ec);
    if (ec) broken_ = true;
    head_sent_ = !ec;
    return !ec;
  }

  /// Writes one piece of a streamed body within --write-timeout; false (and the connection is
  /// given up) once the client is gone or too slow.
  bool write_chunk(std::string_view data) {
    if (broken_) return false;
    stream_.set_write_deadline(DeadlineStream::Clock::now() + write_timeout_);
    error_code ec;
    if (chunked_) net::write(stream_, http::make_chunk(net::buffer(data.data(), data.size())), ec);
    else net::write(stream_, net::buffer(data.data(), data.size()), ec);
    if (ec) broken_ = true;
    return !ec;
  }

  /// Ends a streamed body.
  bool end_stream() {
    if (broken_) return false;
    if (!chunked_) return true;
    stream_.set_write_deadline(DeadlineStream::Clock::now() + write_timeout_);
    error_code ec;
    net::write(stream_, http::make_chunk_last(), ec);
    if (ec) broken_ = true;
    return !ec;
  }

  /// Sends something the client ignores, to learn whether a client that shut down its sending
  /// side is still there (a client that closed its socket answers it with a reset): an SSE
  /// comment in a stream, an interim "102 Processing" before a whole HTTP/1.1 answer. False
  /// when the write failed; nothing is sent (true) to an HTTP/1.0 client before its answer.
  bool probe() {
    if (streaming_) return write_chunk(":\n\n");
    if (started_ || version_ < 11) return !broken_;
    static constexpr std::string_view interim = "HTTP/1.1 102 Processing\r\n\r\n";
    stream_.set_write_deadline(DeadlineStream::Clock::now() + write_timeout_);
    error_code ec;
    net::write(stream_, net::buffer(interim.data(), interim.size()), ec);
    if (ec) broken_ = true;
    return !ec;
  }

  /// The client went away before its answer was complete: nothing more is sent and the
  /// connection is dropped. When no response head had reached it, the status logged and counted
  /// is kClientClosedRequest instead of the one the answer would have had (Reply's default 200).
  void client_left() {
    if (!head_sent_) status_ = kClientClosedRequest;
    started_ = broken_ = true;
  }

  /// The socket, for ConnectionWatch.
  int fd() { return stream_.fd(); }
  bool started() const { return started_; }
  /// The status sent (0 before an answer).
  int status() const { return status_; }
  /// How the connection goes on: a failed write aborts it; a closing answer closes it.
  After after() const { return broken_ ? After::kAbort : keep_alive_ ? After::kNext : After::kClose; }

 private:
  /// The headers of every answer: Date, then those of add_header.
  template <class Message>
  void set_common(Message& res) const {
    res.set(http::field::date, http_date(std::chrono::system_clock::now()));
    for (const auto& [name, value] : common_) res.set(name, value);
  }

  DeadlineStream& stream_;
  std::vector<std::pair<std::string, std::string>> common_;
  std::chrono::seconds write_timeout_;
  unsigned version_;
  bool keep_alive_;
  bool chunked_ = false;
  bool started_ = false;
  bool streaming_ = false;
  bool broken_ = false;
  bool head_sent_ = false;  ///< a response head was written (the client got a status)
  int status_ = 0;
};

/// Everything one generating request (chat, or a legacy completion) carries from validation
/// to the response.
struct ChatCall {
  GenerationFields request;     ///< max_tokens, stream, include_usage, stop, prompt_cache_key
  bool text_completion = false; ///< POST /v1/completions: text_completion objects, no role chunk
  std::string echo;             ///< legacy completion with echo: the prompt's text, which begins each choice
  std::string prompt_param = "messages";  ///< the field a too-long prompt is blamed on
  std::shared_ptr<Job> job;
  CompletionMeta meta;
  std::string request_id;
  Clock::time_point start;
  Clock::time_point submitted;  ///< when the job was queued (time queued = engine start − this)
  int64_t prompt_tokens = 0;
  std::vector<int64_t> message_starts;  ///< chat: where each message but the first begins (cache resume points)
  bool probed = false;  ///< the half-closed connection was probed once (Exchange::probe)
  uint64_t seed = 0;    ///< the seed of choice 0 (choice i: choice_seed(seed, i))
  AnswerFormat answer;  ///< chat: how the generated text becomes reasoning, content and tool calls
  RequestPhases phases;  ///< where its time went (the engine's part added from each choice's kDone)
  /// chat, tool_choice "required" or a named function: what holds the rest of the forced call
  /// to the declared tools (forced_call_grammar; JobRequest::tool_call); null otherwise.
  std::shared_ptr<const ToolCallGrammar> tool_call;
  /// chat, response_format with thinking: the "</think>" token, after which the JSON document
  /// starts (JobRequest::json_after_id); −1 otherwise.
  int32_t json_after_id = -1;
};

/// Where one request's engine events go, in order. LilyServer::drain_events runs the one event
/// loop and decides what happens in every case (answer.cpp says what a client sees); its sinks
/// only shape the answer: the whole JSON answer collects the events, the stream sends them as
/// SSE. The calls that write return false once the client is gone; none comes after that.
class AnswerSink {
 public:
  virtual ~AnswerSink() = default;
  /// Choice `choice` begins: choice 0 first, each next one after the on_finish of the one before.
  virtual bool on_begin(int choice) = 0;
  /// A piece of the choice's text as decoded, with the log-probabilities of the token that
  /// made it (when asked for). Empty text: the engine holds it back (a stop string may begin).
  virtual bool on_text(int choice, const std::string& text, std::optional<TokenLogprobs> logprobs) = 0;
  /// The choice's text is complete; `rest` is what the engine held back until its end.
  virtual bool on_text_end(int choice, const std::string& rest) = 0;
  /// The choice finished (stop, length, or its tool calls; never a cancelled one).
  virtual bool on_finish(int choice, const GenerationResult& result) = 0;
  /// Every choice finished: `results` in choice order (texts, finish reasons, usage).
  virtual void on_complete(const std::vector<GenerationResult>& results) = 0;
  /// The request failed (an engine error or cancel): `error` is what the client is told.
  virtual void on_error(const ApiError& error) = 0;
};

// --- the server --------------------------------------------------------------------------------

/// The running server: a listener thread, a thread per open connection, the engine
/// (Scheduler) and the counters of /metrics. Its members are defined by concern:
/// server_lifecycle.cpp (start-up, shutdown), connections.cpp (accepting, reading requests,
/// eviction, refusals), routes.cpp (routing, auth, the endpoints that do not generate),
/// generation.cpp (chat and legacy completions, up to the engine job), answer.cpp (from the
/// job's events to the answer, whole or streamed).
class LilyServer {
 public:
  explicit LilyServer(const ServerOptions& options) : options_(options) {}
  /// Serves until SIGINT/SIGTERM (run_server); the process exit code.
  int run();

 private:
  // Start-up.
  void bind();
  std::string url() const;
  void load_engine();
  // Connections.
  /// Accepts connections until stopping_ (the listener thread).
  void accept_loop();
  /// Admits a connection onto a thread of its own, or one beyond the cap onto a refusing one.
  void start_connection(tcp::socket socket);
  /// Serves one connection's requests (keep-alive, pipelined) until it closes or times out.
  /// `slot` (not for a refusal, `over_capacity`) is registered as evictable while the
  /// connection waits for a request head.
  void serve_connection(int fd, bool over_capacity, Clock::time_point accepted, ConnectionSlot* slot);
  /// Reads one request within its limits and answers it. `slot`: the connection's slot, made
  /// unevictable once the head has been read (nullptr for a refusal).
  After serve_request(DeadlineStream& stream, beast::flat_buffer& buffer, Clock::time_point head_deadline,
                      bool over_capacity, ConnectionSlot* slot = nullptr);
  /// Marks `slot` as waiting for a request head since `since` (evictable).
  void mark_idle(ConnectionSlot& slot, Clock::time_point since);
  /// Marks `slot` as busy (not evictable); true when it was evicted before that, in which
  /// case its socket has been shut down and the connection must just close.
  bool mark_busy(ConnectionSlot& slot);
  /// With connections_mutex_ held and every slot taken: shuts down the connection that has
  /// waited longest for a request head and returns true, or returns false when none waits.
  bool evict_idle_locked(Clock::time_point now);
  /// With connections_mutex_ held: a connection thread has ended (or never started); frees its
  /// slot (unregisters it) or its refusal place.
  void release_slot_locked(ConnectionSlot& slot, bool over_capacity);
  /// Answers a request that broke a limit (or came beyond the cap) with `e`; the connection closes.
  After refuse(DeadlineStream& stream, const http::request_parser<http::string_body>& parser, const ApiError& e);
  /// Counts the answered request in /metrics and logs its line.
  void finish(const Exchange& ex);
  /// The headers of every answer to this request: X-Request-Id, and the CORS ones for an
  /// allowed Origin (`Vary: Origin` whenever the allowed list is not just `*`).
  void add_common_headers(Exchange& ex, const http::fields& head) const;
  // Routing, auth, errors.
  /// Routes and answers one request; an exception becomes a 500 with a request id.
  void handle(Exchange& ex, const Request& req);
  /// 404/405, a CORS preflight, the API key, then the endpoint.
  void route(Exchange& ex, const Request& req, Reply& res);
  /// The error a request gets before its endpoint runs (404 unknown route, 405 method, 401
  /// key), or nullopt. OPTIONS on a known route passes without a key (browsers send none on a
  /// preflight).
  std::optional<ApiError> gate(std::string_view method, std::string_view path, const http::fields& head) const;
  /// OPTIONS on a known route: 204 with Allow, and the CORS preflight headers for an allowed origin.
  void handle_options(Exchange& ex, const Request& req, Reply& res);
  /// A 500 for an unexpected exception, its detail only in the log.
  void on_exception(Reply& res, std::exception_ptr ep);
  // Endpoints.
  void handle_health(Reply& res);
  void handle_models(Reply& res);
  void handle_model(const std::string& id, Reply& res);
  void handle_metrics(Reply& res);
  /// GET /version: the build (as lily_build_info).
  void handle_version(Reply& res);
  /// POST /v1/chat/completions.
  void handle_chat(Exchange& ex, const Request& req, Reply& res);
  /// POST /v1/completions: the legacy text completion, on the chat endpoint's engine path.
  void handle_completion(Exchange& ex, const Request& req, Reply& res);
  /// POST /tokenize (vLLM's shape): a prompt's or chat messages' token ids.
  void handle_tokenize(const Request& req, Reply& res);
  /// POST /detokenize (vLLM's shape): the text of token ids, special tokens kept.
  void handle_detokenize(const Request& req, Reply& res);
  // Generation steps (chat and legacy completions share them).
  /// 404 model_not_found unless `model` is the served name.
  void check_model(const std::string& model) const;
  /// 503 server_not_ready while the model loads or the server shuts down.
  void check_ready() const;
  /// Checks every id against the vocabulary: 400 naming `param`[i] otherwise.
  std::vector<int32_t> checked_ids(const std::vector<int64_t>& ids, const std::string& param) const;
  /// The chat prompt's tokens; with `message_starts`, also where its messages begin
  /// (ChatTemplate::encode). Throws ApiError 400 when the template refuses the messages.
  /// With `timings`, adds the rendering and tokenizing times to it.
  std::vector<int32_t> tokenize(const ChatRequest& request, std::vector<int64_t>* message_starts = nullptr,
                                ChatEncodeTimings* timings = nullptr) const;
  /// The request's max_tokens, or its default (the room left by the prompt, at most
  /// --max-tokens; for a legacy completion also at most max(16, min_tokens)); throws ApiError 400
  /// when the prompt leaves no room, max_tokens is too big or min_tokens cannot be honoured.
  int64_t checked_max_tokens(const ChatCall& call, int64_t prompt_tokens) const;
  /// Queues the prompt and answers the request (whole or streamed) from the job's events.
  void generate_and_respond(ChatCall& call, std::vector<int32_t> prompt, Exchange& ex, Reply& res);
  /// Queues the job; throws ApiError 503 when the queue is full, the weights changed on disk or
  /// the server is shutting down.
  std::shared_ptr<Job> submit(ChatCall& call, std::vector<int32_t> prompt, int64_t max_tokens);
  // From the job's events to the answer (answer.cpp).
  class EventLoop;
  class WholeAnswer;
  class StreamAnswer;
  /// Answers with one JSON document (into `res`) once every choice has finished.
  void respond_whole(ChatCall& call, Exchange& ex, Reply& res);
  /// Answers with an SSE stream (`res` holds the headers to send with it).
  void respond_stream(ChatCall& call, Exchange& ex, const Reply& res);
  /// Runs the job's events to their end through `sink` (EventLoop); `client_gone`: the client
  /// is already known to be gone (the job is cancelled and nothing is sent).
  void drain_events(ChatCall& call, Exchange& ex, AnswerSink& sink, bool client_gone);
  /// Waits for the job's next event, cancelling it once the client has gone away.
  std::optional<JobEvent> next_event(ChatCall& call, Exchange& ex, const ConnectionWatch& watch, bool& client_gone);
  /// Counts a token's latency in /metrics: the first one's from the request's start (time to
  /// first token), the others' from `last` (the token before; updated).
  void observe_token(ChatCall& call, const JobEvent& e, std::optional<Clock::time_point>& last);
  /// Counts a finished request (all its choices) in /metrics (its phases too, the queue's
  /// added here) and its log line; `done_at` is when the engine finished it (time running =
  /// done_at − start).
  void record_done(ChatCall& call, const std::vector<GenerationResult>& results, Clock::time_point done_at);
  /// The request's sampling parameters over the server's defaults; checks logit_bias ids.
  SamplingParams request_sampling(ChatCall& call) const;
  /// A token's log-probabilities in the response's shape (token text from the tokenizer).
  LogprobEntry logprob_entry(const TokenLogprobs& lp) const;
  /// choice.logprobs of a whole answer or a chunk: null unless the request asked for them; chat's
  /// shape, or for a legacy completion the legacy one, whose text offsets start at
  /// `*text_offset` (0 when null) and advance it.
  ordered_json logprobs_field(const ChatCall& call, const std::vector<TokenLogprobs>& lps,
                              int64_t* text_offset = nullptr) const;
  /// The answer to a job that failed in the engine: 503 model_unavailable when the weights
  /// changed on disk (`model_unavailable`: JobEvent::model_unavailable), 503
  /// server_shutting_down during shutdown, else a 500 naming the request id (`detail` goes to
  /// the log only).
  ApiError failure(const ChatCall& call, const std::string& detail, bool model_unavailable = false);
  // Shutdown.
  void wait_for_signal();

  ServerOptions options_;
  net::io_context io_;
  tcp::acceptor acceptor_{io_};
  tcp protocol_ = tcp::v4();         ///< of the bound address (accepted sockets share it)
  int stop_fd_ = -1;                 ///< eventfd, readable once stopping_ is set
  std::atomic<bool> stopping_{false};
  std::mutex connections_mutex_;
  std::condition_variable connections_done_;
  int open_ = 0;                     ///< admitted connection threads (at most --max-connections
                                     ///< plus the evicted ones still closing)
  int evicted_open_ = 0;             ///< of open_: evicted ones whose thread has not ended yet
                                     ///< (their slots already belong to new connections)
  int rejecting_ = 0;                ///< connections being answered 503 (at most kMaxRejecting)
  std::list<ConnectionSlot*> slots_;  ///< the admitted connections' slots (connections_mutex_)
  Clock::time_point last_evict_log_{};  ///< when an eviction was last logged (connections_mutex_)
  int64_t evictions_unlogged_ = 0;   ///< evictions since that line (connections_mutex_)
  Metrics metrics_;
  std::thread listener_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> shutting_down_{false};
  ModelConfig config_;
  std::string model_name_;
  int64_t max_seq_ = 0;
  SamplingParams sampling_defaults_;  ///< generation_config.json + --temperature … (resolve_sampling_defaults)
  int port_ = 0;
  int64_t created_ = 0;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::shared_ptr<const ChatTemplate> chat_template_;  ///< the checkpoint's (or the built-in) template
  std::unique_ptr<Scheduler> scheduler_;
};

}  // namespace lily::server::detail
