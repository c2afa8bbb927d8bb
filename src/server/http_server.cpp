#include "server/http_server.h"

#include <csignal>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include <httplib.h>

#include "base/build_info.h"
#include "base/error.h"
#include "base/log.h"
#include "engine/generate.h"
#include "engine/scheduler.h"
#include "model/loader.h"
#include "server/api_error.h"
#include "server/chat_request.h"
#include "server/connection.h"
#include "server/metrics.h"
#include "server/openai_json.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace lily::server {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using nlohmann::ordered_json;

// --- small pure helpers (unit-tested) ----------------------------------------------------------

int64_t resolve_max_seq(std::optional<int64_t> requested, int64_t declared) {
  if (requested && *requested > kKernelMaxSeq)
    throw Error("--max-seq " + std::to_string(*requested) + " exceeds the kernel limit of " +
                std::to_string(kKernelMaxSeq) + " tokens");
  int64_t max_seq = requested.value_or(declared > 0 ? declared : kKernelMaxSeq);
  if (declared > 0) max_seq = std::min(max_seq, declared);
  max_seq = std::min(max_seq, kKernelMaxSeq);
  if (max_seq < 2) throw Error("--max-seq must be at least 2 (got " + std::to_string(max_seq) + ")");
  return max_seq;
}

std::string served_model_name(const ModelConfig& config, const std::filesystem::path& model_dir,
                              const std::string& override_name) {
  if (!override_name.empty()) return override_name;
  if (config.is_qwen36_35b_a3b()) return "Qwen3.6-35B-A3B";
  auto dir = std::filesystem::weakly_canonical(model_dir);
  std::string name = dir.filename().string();
  if (name.empty()) name = dir.parent_path().filename().string();
  return name.empty() ? "model" : name;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

void parse_bind(std::string_view bind, std::string& host, int& port) {
  std::string_view port_text;
  if (!bind.empty() && bind.front() == '[') {
    const size_t close = bind.find(']');
    if (close == std::string_view::npos) throw Error("--bind '" + std::string(bind) + "': missing ']'");
    host = std::string(bind.substr(1, close - 1));
    if (close + 1 < bind.size()) {
      if (bind[close + 1] != ':') throw Error("--bind '" + std::string(bind) + "': expected ':' after ']'");
      port_text = bind.substr(close + 2);
    }
  } else {
    const size_t colon = bind.rfind(':');
    if (colon != std::string_view::npos && bind.find(':') == colon) {
      host = std::string(bind.substr(0, colon));
      port_text = bind.substr(colon + 1);
    } else {
      host = std::string(bind);
    }
  }
  if (host.empty()) throw Error("--bind '" + std::string(bind) + "': empty host");
  if (port_text.empty()) return;
  int value = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9' || value > 65535) throw Error("--bind '" + std::string(bind) + "': bad port");
    value = value * 10 + (c - '0');
  }
  if (value > 65535) throw Error("--bind '" + std::string(bind) + "': port above 65535");
  port = value;
}

bool is_loopback_host(std::string_view host) {
  return host == "localhost" || host == "::1" || host.substr(0, 4) == "127.";
}

namespace {
constexpr std::string_view kModelPrefix = "/v1/models/";
bool is_model_lookup(std::string_view path) {
  return path.size() > kModelPrefix.size() && path.substr(0, kModelPrefix.size()) == kModelPrefix;
}
}  // namespace

std::optional<std::string> allowed_methods(std::string_view path) {
  if (path == "/v1/chat/completions") return "POST";
  if (path == "/health" || path == "/metrics" || path == "/v1/models" || is_model_lookup(path)) return "GET, HEAD";
  return std::nullopt;
}

std::string route_label(std::string_view path) {
  if (is_model_lookup(path)) return "/v1/models/{id}";
  return allowed_methods(path) ? std::string(path) : "other";
}

std::string request_log_line(std::string_view method, std::string_view path, int status, int64_t ms,
                             const std::optional<LogTokens>& tokens, std::string_view error) {
  std::string line = std::string(method) + " " + std::string(path) + " " + std::to_string(status) + " " +
                     std::to_string(ms) + "ms";
  if (tokens) {
    char rate[32];
    std::snprintf(rate, sizeof rate, "%.1f", tokens->tokens_per_s);
    line += " prompt=" + std::to_string(tokens->prompt) + " cached=" + std::to_string(tokens->cached) +
            " completion=" + std::to_string(tokens->completion) + " tok/s=" + rate;
  }
  if (!error.empty()) line += " error=" + json(std::string(error)).dump(-1, ' ', false, json::error_handler_t::replace);
  return line;
}

namespace {

// --- per-request bookkeeping for the log line (the logger runs on the handler's thread) ------

struct RequestInfo {
  Clock::time_point start = Clock::now();
  std::optional<LogTokens> tokens;
  std::string error;
};
thread_local RequestInfo t_request;

/// True on a thread that serves a connection beyond --max-connections: every request on it is
/// answered 503 and the connection is closed.
thread_local bool t_over_capacity = false;

/// Connections the kernel may hold before the accept loop takes them (listen(2) backlog).
constexpr int kListenBacklog = 512;

/// The task queue httplib hands each accepted connection to. At most `limit` connections are
/// open at a time, each on its own thread at once (no connection waits for a busy thread); a
/// connection beyond the limit goes to a small separate pool that answers 503 and closes it, so
/// it neither queues behind the admitted ones nor takes their threads.
class ConnectionGate : public httplib::TaskQueue {
 public:
  ConnectionGate(int limit, int reject_threads)
      : limit_(limit), admitted_(static_cast<size_t>(limit)), rejecting_(static_cast<size_t>(reject_threads)) {}

  /// Called by httplib's accept loop (one thread) with the job that serves one connection.
  void enqueue(std::function<void()> fn) override {
    if (open_.load() < limit_) {
      ++open_;
      admitted_.enqueue([this, fn = std::move(fn)] {
        fn();
        --open_;
      });
      return;
    }
    rejecting_.enqueue([fn = std::move(fn)] {
      t_over_capacity = true;
      fn();
      t_over_capacity = false;
    });
  }

  void shutdown() override {
    admitted_.shutdown();
    rejecting_.shutdown();
  }

 private:
  const int limit_;
  std::atomic<int> open_{0};
  httplib::ThreadPool admitted_;
  httplib::ThreadPool rejecting_;
};

std::string random_hex(size_t n) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() % 16];
  return s;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void set_json(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  for (const auto& [name, value] : e.headers()) res.set_header(name, value);
  set_json(res, e.status(), dump(e.body()));
  t_request.error = e.what();
}

/// Everything one chat request carries from validation to the response.
struct ChatCall {
  ChatRequest request;
  std::shared_ptr<Job> job;
  CompletionMeta meta;
  std::string request_id;
  Clock::time_point start;
  int64_t prompt_tokens = 0;
};

/// httplib's server with a deeper accept queue: the library listens with a backlog of 5, so a
/// burst of connections waited for SYN retransmissions (1 s, 3 s, …) before it was even accepted.
class HttpServer : public httplib::Server {
 public:
  /// Re-listens on the bound socket with `backlog` (Linux caps it at net.core.somaxconn).
  void deepen_backlog(int backlog) {
    if (svr_sock_ != INVALID_SOCKET) ::listen(svr_sock_, backlog);
  }
};

// --- the server --------------------------------------------------------------------------------

class LilyServer {
 public:
  explicit LilyServer(const ServerOptions& options) : options_(options) {}
  int run();

 private:
  // Start-up.
  void configure_http();
  void bind();
  std::string url() const;
  void load_engine();
  // Routing, auth, errors, logging.
  httplib::Server::HandlerResponse pre_route(const httplib::Request& req, httplib::Response& res);
  void on_error(const httplib::Request& req, httplib::Response& res);
  void on_exception(const httplib::Request& req, httplib::Response& res, std::exception_ptr ep);
  void on_logged(const httplib::Request& req, const httplib::Response& res);
  // Endpoints.
  void handle_health(httplib::Response& res);
  void handle_models(httplib::Response& res);
  void handle_model(const httplib::Request& req, httplib::Response& res);
  void handle_metrics(httplib::Response& res);
  void handle_chat(const httplib::Request& req, httplib::Response& res);
  // Chat steps.
  std::vector<int32_t> tokenize(const ChatRequest& request) const;
  int64_t checked_max_tokens(const ChatRequest& request, int64_t prompt_tokens) const;
  std::shared_ptr<Job> submit(ChatCall& call, std::vector<int32_t> prompt, int64_t max_tokens);
  void respond_whole(ChatCall& call, const httplib::Request& req, httplib::Response& res);
  void respond_stream(std::shared_ptr<ChatCall> call, const httplib::Request& req, httplib::Response& res);
  bool stream_events(ChatCall& call, httplib::DataSink& sink, const ConnectionWatch& watch);
  /// Waits for the job's next event, cancelling it once the client has gone away.
  std::optional<JobEvent> next_event(ChatCall& call, const ConnectionWatch& watch, bool& client_gone);
  void observe_token(ChatCall& call, const JobEvent& e, std::optional<Clock::time_point>& last);
  void record_done(const ChatCall& call, const GenerationResult& result);
  ApiError failure(const ChatCall& call, const std::string& detail);
  // Shutdown.
  void wait_for_signal();

  ServerOptions options_;
  HttpServer http_;
  Metrics metrics_;
  std::thread listener_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> shutting_down_{false};
  ModelConfig config_;
  std::string model_name_;
  int64_t max_seq_ = 0;
  int port_ = 0;
  int64_t created_ = 0;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::unique_ptr<Scheduler> scheduler_;
};

/// Test hook: LILY_TEST_LISTEN_DELAY_MS holds the listener thread back that long before it
/// starts listening, which makes a signal that arrives before then reproducible.
void test_listen_delay() {
  if (const char* env = std::getenv("LILY_TEST_LISTEN_DELAY_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(env)));
}

int LilyServer::run() {
  config_ = load_model_config(options_.model_dir);
  max_seq_ = resolve_max_seq(options_.max_seq, config_.max_position_embeddings);
  model_name_ = served_model_name(config_, options_.model_dir, options_.served_model_name);
  created_ = std::chrono::duration_cast<std::chrono::seconds>(
                 std::chrono::system_clock::now().time_since_epoch()).count();
  if (options_.api_key.empty() && !is_loopback_host(options_.host))
    log_warn("binding to " + options_.host + " without an API key: anyone who can reach it can use it "
             "(set --api-key or LILY_API_KEY)");
  configure_http();
  bind();
  std::atomic<bool> listener_returned{false};
  listener_ = std::thread([this, &listener_returned] {
    test_listen_delay();
    http_.listen_after_bind();
    listener_returned = true;
  });
  // httplib's stop() does nothing until listen_after_bind() has begun: a signal (or a failed
  // load) before then would be lost and shutdown would hang until the deadline below. A listener
  // that returned at once (its socket failed) must not leave us waiting forever either.
  while (!http_.is_running() && !listener_returned) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (listener_returned) {
    listener_.join();
    throw Error("the HTTP listener on " + url() + " stopped before it started serving");
  }
  // Requests are answered from here on: /health and chat say 503 "loading" until the model is in.
  log_info("listening on " + url() + "; loading " + options_.model_dir.string());
  std::thread loader([this] {
    try {
      load_engine();
    } catch (const std::exception& e) {
      log_error(std::string("loading the model failed: ") + e.what());
      shutting_down_ = true;
      kill(getpid(), SIGTERM);
    }
  });
  wait_for_signal();
  const bool failed = shutting_down_.exchange(true) && !ready_;
  log_info("shutting down");
  std::thread([grace = options_.shutdown_grace_s, failed] {
    std::this_thread::sleep_for(std::chrono::seconds(grace + 5));
    log_warn("shutdown deadline passed; exiting now");
    std::_Exit(failed ? 1 : 0);  // a failed load is a failure even when shutdown hangs
  }).detach();
  http_.stop();
  loader.join();
  if (scheduler_) scheduler_->stop(std::chrono::seconds(options_.shutdown_grace_s));
  listener_.join();
  scheduler_.reset();
  return failed ? 1 : 0;
}

void LilyServer::configure_http() {
  const int limit = options_.max_connections;
  http_.new_task_queue = [limit] { return new ConnectionGate(limit, 2); };
  if (options_.send_buffer > 0) {
    // Set on the listening socket; Linux copies it to every accepted connection.
    const int bytes = static_cast<int>(options_.send_buffer);
    http_.set_socket_options([bytes](socket_t sock) {
      httplib::default_socket_options(sock);
      setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    });
  }
  http_.set_read_timeout(options_.read_timeout_s, 0);
  http_.set_write_timeout(options_.write_timeout_s, 0);
  http_.set_keep_alive_timeout(options_.keep_alive_s);
  http_.set_payload_max_length(static_cast<size_t>(options_.max_body));
  http_.set_pre_routing_handler([this](const auto& req, auto& res) { return pre_route(req, res); });
  http_.set_error_handler([this](const auto& req, auto& res) { on_error(req, res); });
  http_.set_exception_handler([this](const auto& req, auto& res, std::exception_ptr ep) { on_exception(req, res, ep); });
  http_.set_logger([this](const auto& req, const auto& res) { on_logged(req, res); });
  http_.Get("/health", [this](const auto&, auto& res) { handle_health(res); });
  http_.Get("/v1/models", [this](const auto&, auto& res) { handle_models(res); });
  http_.Get("/v1/models/(.+)", [this](const auto& req, auto& res) { handle_model(req, res); });
  http_.Get("/metrics", [this](const auto&, auto& res) { handle_metrics(res); });
  http_.Post("/v1/chat/completions", [this](const auto& req, auto& res) { handle_chat(req, res); });
}

void LilyServer::bind() {
  if (options_.port == 0) {
    port_ = http_.bind_to_any_port(options_.host);
    if (port_ <= 0) throw Error("cannot bind " + options_.host + " on any port");
  } else {
    if (!http_.bind_to_port(options_.host, options_.port))
      throw Error("cannot bind " + options_.host + ":" + std::to_string(options_.port) +
                  " (address in use, or not an address of this machine)");
    port_ = options_.port;
  }
  http_.deepen_backlog(kListenBacklog);
}

std::string LilyServer::url() const {
  const std::string host = options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host;
  return "http://" + host + ":" + std::to_string(port_);
}

/// Test hook: LILY_TEST_LOAD_DELAY_MS holds the loader back that long (in steps, so a signal
/// still stops the server), which makes the "loading" state observable on the small demo model.
void test_load_delay(const std::atomic<bool>& shutting_down) {
  const char* env = std::getenv("LILY_TEST_LOAD_DELAY_MS");
  if (env == nullptr) return;
  const auto until = Clock::now() + std::chrono::milliseconds(std::atoll(env));
  while (Clock::now() < until && !shutting_down) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

void LilyServer::load_engine() {
  const auto t0 = Clock::now();
  test_load_delay(shutting_down_);
  auto weights = load_model(options_.model_dir, LoadOptions{.show_progress = true});
  if (shutting_down_) return;
  tokenizer_ = Tokenizer::from_file(options_.model_dir / "tokenizer.json");
  auto backend = make_backend(options_.backend, weights, options_.threads);
  EngineOptions engine;
  engine.max_seq = max_seq_;
  engine.max_queue = options_.max_queue;
  engine.stop_ids = stop_token_ids(config_, options_.model_dir, tokenizer_.get());
  engine.cache = SessionCacheOptions{options_.cache_entries, options_.cache_bytes};
  const std::string backend_name = backend->name();
  scheduler_ = std::make_unique<Scheduler>(std::move(backend), tokenizer_, engine);
  ready_ = true;
  char load_s[32];
  std::snprintf(load_s, sizeof load_s, "%.1f", seconds(Clock::now() - t0));
  log_info("serving " + model_name_ + " on " + url() + " (backend " +
           backend_name + ", max-seq " + std::to_string(max_seq_) + ", loaded in " + load_s + " s)");
}

httplib::Server::HandlerResponse LilyServer::pre_route(const httplib::Request& req, httplib::Response& res) {
  t_request = RequestInfo{};
  if (t_over_capacity) {
    // httplib adds the header itself when the client asked for close; otherwise on_logged
    // shuts the connection down once this answer is written.
    if (req.get_header_value("Connection") != "close") res.set_header("Connection", "close");
    send_error(res, ApiError(503, "server_error",
                             "too many open connections (--max-connections " +
                                 std::to_string(options_.max_connections) + "); retry later",
                             std::nullopt, "too_many_connections")
                        .with_header("Retry-After", "1"));
    return httplib::Server::HandlerResponse::Handled;
  }
  const auto allowed = allowed_methods(req.path);
  if (!allowed) {
    send_error(res, ApiError(404, "invalid_request_error", "unknown route: " + req.method + " " + req.path,
                             std::nullopt, "not_found"));
    return httplib::Server::HandlerResponse::Handled;
  }
  if (allowed->find(req.method) == std::string::npos) {
    send_error(res, ApiError(405, "invalid_request_error",
                             "method " + req.method + " is not allowed on " + req.path + " (allowed: " + *allowed + ")",
                             std::nullopt, "method_not_allowed")
                        .with_header("Allow", *allowed));
    return httplib::Server::HandlerResponse::Handled;
  }
  if (!options_.api_key.empty() && (req.path != "/health" || options_.health_requires_key)) {
    const std::string auth = req.get_header_value("Authorization");
    // The scheme is case-insensitive (RFC 9110 §11.1): "bearer KEY" is as good as "Bearer KEY".
    const std::string prefix = "bearer ";
    bool scheme_ok = auth.size() > prefix.size();
    for (size_t i = 0; scheme_ok && i < prefix.size(); ++i)
      scheme_ok = std::tolower(static_cast<unsigned char>(auth[i])) == prefix[i];
    const bool ok = scheme_ok && constant_time_equal(std::string_view(auth).substr(prefix.size()), options_.api_key);
    if (!ok) {
      send_error(res, ApiError(401, "invalid_request_error",
                               auth.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                                            : "invalid API key",
                               std::nullopt, "invalid_api_key")
                          .with_header("WWW-Authenticate", "Bearer"));
      return httplib::Server::HandlerResponse::Handled;
    }
  }
  return httplib::Server::HandlerResponse::Unhandled;
}

void LilyServer::on_error(const httplib::Request&, httplib::Response& res) {
  if (!res.body.empty() || res.is_chunked_content_provider_) return;
  if (res.status == 413) {
    send_error(res, ApiError(413, "invalid_request_error",
                             "request body exceeds the limit of " + std::to_string(options_.max_body) + " bytes",
                             std::nullopt, "request_too_large"));
  } else if (res.status == 404) {
    send_error(res, ApiError(404, "invalid_request_error", "not found", std::nullopt, "not_found"));
  } else {
    send_error(res, ApiError(res.status, res.status >= 500 ? "server_error" : "invalid_request_error",
                             "request failed with HTTP status " + std::to_string(res.status)));
  }
}

void LilyServer::on_exception(const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
  const std::string id = "req_" + random_hex(16);
  try {
    if (ep) std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    log_error("request failed (" + id + "): " + e.what());
  } catch (...) {
    log_error("request failed (" + id + "): unknown exception");
  }
  res.set_header("X-Request-Id", id);
  send_error(res, ApiError(500, "server_error", "internal server error (request id " + id + ")"));
}

void LilyServer::on_logged(const httplib::Request& req, const httplib::Response& res) {
  // httplib calls the logger after writing the response. A connection over --max-connections
  // must not stay for keep-alive (httplib only honours the client's "Connection: close").
  if (t_over_capacity) ConnectionWatch(req.remote_addr, req.remote_port, req.local_port).shut_down();
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t_request.start).count();
  metrics_.record_request(route_label(req.path), res.status);
  if (req.path == "/health" || req.path == "/metrics") {
    log_debug(request_log_line(req.method, req.path, res.status, ms, std::nullopt, t_request.error));
    return;
  }
  log_info(request_log_line(req.method, req.path, res.status, ms, t_request.tokens, t_request.error));
}

void LilyServer::handle_health(httplib::Response& res) {
  if (shutting_down_) return set_json(res, 503, R"({"status":"shutting_down"})");
  if (!ready_) {
    res.set_header("Retry-After", "1");
    return set_json(res, 503, R"({"status":"loading"})");
  }
  set_json(res, 200, R"({"status":"ok"})");
}

void LilyServer::handle_models(httplib::Response& res) { set_json(res, 200, dump(models_json(model_name_, created_))); }

void LilyServer::handle_model(const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches[1];
  if (id != model_name_)
    return send_error(res, ApiError(404, "invalid_request_error",
                                    "the model '" + id + "' does not exist; this server serves '" + model_name_ + "'",
                                    "model", "model_not_found"));
  set_json(res, 200, dump(model_json(model_name_, created_)));
}

void LilyServer::handle_metrics(httplib::Response& res) {
  EngineGauges g;
  g.ready = ready_;
  if (ready_) {
    g.queue_depth = scheduler_->queue_depth();
    g.running = scheduler_->running();
    g.cache = scheduler_->cache_stats();
  }
  res.status = 200;
  res.set_content(metrics_.render(g), "text/plain; version=0.0.4; charset=utf-8");
}

std::vector<int32_t> LilyServer::tokenize(const ChatRequest& request) const {
  try {
    return encode_chat(*tokenizer_, request.messages);
  } catch (const Error& e) {
    throw invalid_request(std::string("messages cannot be rendered with the chat template: ") + e.what(),
                          "messages");
  }
}

int64_t LilyServer::checked_max_tokens(const ChatRequest& request, int64_t prompt_tokens) const {
  const int64_t room = max_seq_ - prompt_tokens;
  if (room < 1)
    throw invalid_request("the prompt has " + std::to_string(prompt_tokens) + " tokens but --max-seq is " +
                              std::to_string(max_seq_) + ", which leaves no room for a completion",
                          "messages", "context_length_exceeded");
  const int64_t cap = options_.max_tokens_cap;
  if (!request.max_tokens) return cap > 0 ? std::min(room, cap) : room;
  if (cap > 0 && *request.max_tokens > cap)
    throw invalid_request("max_tokens (" + std::to_string(*request.max_tokens) + ") exceeds this server's cap of " +
                              std::to_string(cap) + " (--max-tokens)",
                          "max_tokens", "max_tokens_exceeded");
  if (*request.max_tokens > room)
    throw invalid_request("prompt (" + std::to_string(prompt_tokens) + " tokens) + max_tokens (" +
                              std::to_string(*request.max_tokens) + ") exceeds --max-seq " +
                              std::to_string(max_seq_),
                          "max_tokens", "context_length_exceeded");
  return *request.max_tokens;
}

std::shared_ptr<Job> LilyServer::submit(ChatCall& call, std::vector<int32_t> prompt, int64_t max_tokens) {
  JobRequest job;
  job.prompt = std::move(prompt);
  job.max_tokens = max_tokens;
  job.stop_strings = call.request.stop;
  job.cache_key = call.request.prompt_cache_key;
  try {
    return scheduler_->submit(std::move(job));
  } catch (const QueueFullError& e) {
    throw ApiError(503, "server_error", std::string(e.what()) + "; retry later", std::nullopt, "server_overloaded")
        .with_header("Retry-After", "1");
  } catch (const ShuttingDownError& e) {
    throw ApiError(503, "server_error", e.what(), std::nullopt, "server_shutting_down").with_header("Retry-After", "5");
  }
}

void LilyServer::handle_chat(const httplib::Request& req, httplib::Response& res) {
  auto call = std::make_shared<ChatCall>();
  call->start = t_request.start;
  call->request_id = "req_" + random_hex(16);
  res.set_header("X-Request-Id", call->request_id);
  try {
    // httplib enforces the limit on Content-Length bodies only; chunked bodies are checked here.
    if (static_cast<int64_t>(req.body.size()) > options_.max_body)
      throw ApiError(413, "invalid_request_error",
                     "request body exceeds the limit of " + std::to_string(options_.max_body) + " bytes",
                     std::nullopt, "request_too_large");
    call->request = parse_chat_request(req.body);
    if (call->request.model != model_name_)
      throw ApiError(404, "invalid_request_error",
                     "the model '" + call->request.model + "' does not exist; this server serves '" + model_name_ + "'",
                     "model", "model_not_found");
    if (!ready_ || shutting_down_)
      throw ApiError(503, "server_error", shutting_down_ ? "the server is shutting down" : "the model is still loading",
                     std::nullopt, "server_not_ready")
          .with_header("Retry-After", "1");
    std::vector<int32_t> prompt = tokenize(call->request);
    call->prompt_tokens = static_cast<int64_t>(prompt.size());
    const int64_t max_tokens = checked_max_tokens(call->request, call->prompt_tokens);
    call->job = submit(*call, std::move(prompt), max_tokens);
    call->meta = CompletionMeta{"chatcmpl-" + random_hex(24),
                                std::chrono::duration_cast<std::chrono::seconds>(
                                    std::chrono::system_clock::now().time_since_epoch()).count(),
                                model_name_, std::string("lily-") + lily::build_commit()};
    if (call->request.stream) return respond_stream(call, req, res);
    respond_whole(*call, req, res);
  } catch (const ApiError& e) {
    send_error(res, e);
  }
}

std::optional<JobEvent> LilyServer::next_event(ChatCall& call, const ConnectionWatch& watch, bool& client_gone) {
  // The connection is checked before every wait, not only when a wait times out: a decode faster
  // than the wait (tokens every few ms) would otherwise never look, and a whole (non-streamed)
  // answer whose client left ran to its end.
  while (true) {
    if (!client_gone && watch.closed()) {
      client_gone = true;
      scheduler_->cancel(call.job);
    }
    if (auto e = call.job->next_event(std::chrono::milliseconds(20))) return e;
  }
}

void LilyServer::observe_token(ChatCall& call, const JobEvent& e, std::optional<Clock::time_point>& last) {
  if (!last) metrics_.observe_ttft(seconds(e.at - call.start));
  else metrics_.observe_inter_token(seconds(e.at - *last));
  last = e.at;
}

void LilyServer::record_done(const ChatCall& call, const GenerationResult& r) {
  if (r.finish_reason == FinishReason::kCancelled) metrics_.record_cancelled();
  const int64_t completion = static_cast<int64_t>(r.token_ids.size());
  metrics_.record_tokens(r.prompt_tokens, r.cached_tokens, completion);
  const double elapsed = std::max(seconds(Clock::now() - call.start), 1e-3);
  t_request.tokens = LogTokens{r.prompt_tokens, r.cached_tokens, completion, completion / elapsed};
  if (r.finish_reason == FinishReason::kCancelled) t_request.error = "cancelled";
}

ApiError LilyServer::failure(const ChatCall& call, const std::string& detail) {
  if (shutting_down_)
    return ApiError(503, "server_error", "the server is shutting down", std::nullopt, "server_shutting_down")
        .with_header("Retry-After", "5");
  log_error("request failed (" + call.request_id + "): " + detail);
  return ApiError(500, "server_error", "internal server error (request id " + call.request_id + ")");
}

void LilyServer::respond_whole(ChatCall& call, const httplib::Request& req, httplib::Response& res) {
  ConnectionWatch watch(req.remote_addr, req.remote_port, req.local_port);
  bool client_gone = false;
  std::optional<Clock::time_point> last;
  while (true) {
    JobEvent e = *next_event(call, watch, client_gone);
    if (e.kind == JobEvent::Kind::kToken) {
      observe_token(call, e, last);
      continue;
    }
    if (e.kind == JobEvent::Kind::kFailed) throw failure(call, e.text);
    const GenerationResult& r = e.result;
    record_done(call, r);
    if (r.finish_reason == FinishReason::kCancelled && !client_gone) throw failure(call, "generation was cancelled");
    const Usage usage{r.prompt_tokens, static_cast<int64_t>(r.token_ids.size()), r.cached_tokens};
    set_json(res, 200, dump(completion_json(call.meta, r.text, std::string(finish_reason_name(r.finish_reason)), usage)));
    return;
  }
}

void LilyServer::respond_stream(std::shared_ptr<ChatCall> call, const httplib::Request& req, httplib::Response& res) {
  auto watch = std::make_shared<ConnectionWatch>(req.remote_addr, req.remote_port, req.local_port);
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, call, watch](size_t, httplib::DataSink& sink) {
        // One call streams the whole answer; false (client gone) makes httplib drop the connection.
        if (!stream_events(*call, sink, *watch)) return false;
        sink.done();
        return true;
      },
      [this, call](bool) {
        // Whatever happened to the connection, the job must not outlive its request.
        if (call->job) scheduler_->cancel(call->job);
      });
}

bool LilyServer::stream_events(ChatCall& call, httplib::DataSink& sink, const ConnectionWatch& watch) {
  const bool usage_field = call.request.include_usage;
  auto send = [&](const ordered_json& doc) {
    const std::string event = sse_event(dump(doc));
    return sink.write(event.data(), event.size());
  };
  bool client_gone = !send(chunk_json(call.meta, ordered_json{{"role", "assistant"}, {"content", ""}}, std::nullopt, usage_field));
  if (client_gone) scheduler_->cancel(call.job);
  std::optional<Clock::time_point> last;
  size_t sent = 0;
  while (true) {
    JobEvent e = *next_event(call, watch, client_gone);
    if (e.kind == JobEvent::Kind::kToken) {
      observe_token(call, e, last);
      if (e.text.empty() || client_gone) continue;
      sent += e.text.size();
      if (!send(chunk_json(call.meta, ordered_json{{"content", e.text}}, std::nullopt, usage_field))) {
        client_gone = true;
        scheduler_->cancel(call.job);
      }
      continue;
    }
    if (client_gone) {
      if (e.kind == JobEvent::Kind::kDone) record_done(call, e.result);
      return false;
    }
    if (e.kind == JobEvent::Kind::kFailed) {
      const ApiError err = failure(call, e.text);
      t_request.error = err.what();
      send(ordered_json(err.body()));
      sink.write("data: [DONE]\n\n", 14);
      return true;
    }
    const GenerationResult& r = e.result;
    record_done(call, r);
    if (r.text.size() > sent) send(chunk_json(call.meta, ordered_json{{"content", r.text.substr(sent)}}, std::nullopt, usage_field));
    const std::string reason = r.finish_reason == FinishReason::kCancelled ? "length" : std::string(finish_reason_name(r.finish_reason));
    send(chunk_json(call.meta, ordered_json::object(), reason, usage_field));
    if (usage_field)
      send(usage_chunk_json(call.meta, Usage{r.prompt_tokens, static_cast<int64_t>(r.token_ids.size()), r.cached_tokens}));
    sink.write("data: [DONE]\n\n", 14);
    return true;
  }
}

void LilyServer::wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  if (!shutting_down_) log_info(std::string("received ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"));
}

}  // namespace

int run_server(const ServerOptions& options) {
  if (options.max_body < 1) throw Error("--max-body must be at least 1 byte");
  if (options.max_connections < 1) throw Error("--max-connections must be at least 1");
  if (options.send_buffer < 0 || options.send_buffer > (1 << 30))
    throw Error("--send-buffer must be between 0 and 2^30 bytes");
  // SIGINT/SIGTERM are taken by sigwait in the main thread; every thread started from here on
  // inherits the blocked mask. SIGPIPE from a vanished client must not kill the process.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  LilyServer server(options);
  return server.run();
}

}  // namespace lily::server
