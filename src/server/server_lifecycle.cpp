// LilyServer's start-up and shutdown: run() (checkpoint config, the listening socket, the
// loader thread, then the wait for SIGINT/SIGTERM and the graceful stop), bind(), url(),
// load_engine() (tokenizer, chat template, weights, backend, scheduler) and wait_for_signal().
// Kept apart from the request path: this code runs once per process.
#include "server/server_impl.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "base/byte_size.h"
#include "base/error.h"
#include "base/log.h"
#include "engine/option_error.h"
#include "model/loader.h"

namespace lily::server::detail {

namespace {

/// Connections the kernel may hold before the accept loop takes them (listen(2) backlog).
constexpr int kListenBacklog = 512;

/// A socket error in the words of "cannot bind HOST:PORT: …".
std::string describe_bind_error(const error_code& ec) {
  if (ec == net::error::address_in_use) return "address already in use";
  if (ec == boost::system::errc::address_not_available) return "not an address of this machine";
  if (ec == net::error::access_denied) return "permission denied";
  std::string text = ec.message();
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

/// ServerTestHooks::load_delay_ms: the loader waits in steps of 20 ms, so a signal still stops it.
void test_load_delay(int64_t delay_ms, const std::atomic<bool>& shutting_down) {
  const auto until = Clock::now() + std::chrono::milliseconds(delay_ms);
  while (Clock::now() < until && !shutting_down) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

/// What the log says about a failed load: an engine option's error in the words of
/// `option_name` (ServerOptions::option_name) when given, else the error's own message.
std::string load_error_message(const std::exception& e,
                               const std::function<std::string(std::string_view)>& option_name) {
  const auto* option = dynamic_cast<const OptionError*>(&e);
  if (option && option_name) return option->message_naming(option_name(option->field()));
  return e.what();
}

}  // namespace

int LilyServer::run() {
  config_ = load_model_config(options_.model_dir);
  max_seq_ = resolve_max_seq(options_.max_seq, config_.max_position_embeddings, backend_max_sequence(options_.backend));
  sampling_defaults_ = resolve_sampling_defaults(options_.sampling, options_.model_dir);
  if (!sampling_defaults_.plain_greedy()) {
    const SamplingParams& d = sampling_defaults_;
    char line[256];
    std::snprintf(line, sizeof line,
                  "sampling defaults (server options over generation_config.json): temperature %g, top_p %g, top_k %d, "
                  "min_p %g, repetition_penalty %g; requests may override them",
                  d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty);
    log_info(line);
  }
  model_name_ = served_model_name(config_, options_.model_dir, options_.served_model_name);
  created_ = std::chrono::duration_cast<std::chrono::seconds>(
                 std::chrono::system_clock::now().time_since_epoch()).count();
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) throw Error("cannot create an eventfd for shutdown");
  bind();
  listener_ = std::thread([this] { accept_loop(); });
  // Requests are answered from here on (the kernel queues connections until the accept loop
  // takes them): /health and chat say 503 "loading" until the model is in.
  log_info("listening on " + url() + "; loading " + options_.model_dir.string());
  std::thread loader([this] {
    try {
      load_engine();
    } catch (const std::exception& e) {
      log_error("loading the model failed: " + load_error_message(e, options_.option_name));
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
  // No new connections; idle ones and ones still sending a request are closed (their reads end
  // on the eventfd); answers being written go on.
  stopping_ = true;
  const uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof one) != static_cast<ssize_t>(sizeof one)) log_warn("cannot signal the connections to stop");
  listener_.join();
  error_code ec;
  acceptor_.close(ec);
  loader.join();
  if (scheduler_) scheduler_->stop(std::chrono::seconds(options_.shutdown_grace_s));
  {
    std::unique_lock lock(connections_mutex_);
    connections_done_.wait(lock, [this] { return open_ == 0 && rejecting_ == 0; });
  }
  scheduler_.reset();
  ::close(stop_fd_);
  return failed ? 1 : 0;
}

void LilyServer::bind() {
  const std::string host = options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host;
  const std::string where = host + ":" + std::to_string(options_.port);
  error_code ec;
  tcp::resolver resolver(io_);
  const auto results = resolver.resolve(options_.host, std::to_string(options_.port),
                                        tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty())
    throw Error("cannot bind " + where + ": cannot resolve the host" + (ec ? " (" + ec.message() + ")" : ""));
  const tcp::endpoint endpoint = results.begin()->endpoint();
  protocol_ = endpoint.protocol();
  acceptor_.open(protocol_, ec);
  if (ec) throw Error("cannot bind " + where + ": " + describe_bind_error(ec));
  // SO_REUSEADDR lets a restarted server bind while its old connections linger in TIME_WAIT;
  // on Linux it never lets a second server bind a port that one listens on (SO_REUSEPORT
  // would, and is deliberately not set).
  acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(kListenBacklog, ec);
  if (ec) throw Error("cannot bind " + where + ": " + describe_bind_error(ec));
  acceptor_.non_blocking(true, ec);
  port_ = acceptor_.local_endpoint(ec).port();
}

std::string LilyServer::url() const {
  const std::string host = options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host;
  return "http://" + host + ":" + std::to_string(port_);
}

void LilyServer::load_engine() {
  const auto t0 = Clock::now();
  test_load_delay(options_.test_hooks.load_delay_ms, shutting_down_);
  // Parsed before the weights load: a template the engine refuses fails the start at once.
  chat_template_ = ChatTemplate::for_model(options_.model_dir);
  log_info("chat template: " + chat_template_->origin());
  auto weights = load_model(options_.model_dir, LoadOptions{.show_progress = true});
  if (shutting_down_) return;
  tokenizer_ = Tokenizer::from_file(options_.model_dir / "tokenizer.json");
  check_tokenizer_vocab(weights->config, *tokenizer_);
  auto backend = make_backend(options_.backend, weights, options_.threads, options_.cuda);
  if (!backend->reads_host_weights()) {
    // The weights are in the backend's own memory: drop the host copy so that the checkpoint's
    // files are unmapped (a truncated or rewritten model.safetensors cannot fault the server).
    const std::weak_ptr<const ModelWeights> host = weights;
    weights.reset();
    if (host.expired())
      log_info("weights: copied to " + backend->name() + " memory; the checkpoint files are no longer mapped");
  }
  EngineOptions engine;
  engine.max_seq = max_seq_;
  engine.max_queue = options_.max_queue;
  engine.max_batch = options_.max_batch;
  engine.step_tokens = options_.step_tokens > 0 ? options_.step_tokens : backend->preferred_step_tokens();
  engine.on_step = [this](const StepStats& s) { metrics_.observe_step(s.rows, s.seconds); };
  engine.stop_ids = stop_token_ids(config_, options_.model_dir, tokenizer_.get());
  const HostMemory host = read_host_memory();
  const int batch_limit = std::max(1, backend->max_batch());  // the scheduler's rule for max_batch 0
  const RunningBatch running{engine.max_batch > 0 ? std::min(engine.max_batch, batch_limit)
                                                  : std::min(backend->preferred_max_batch(), batch_limit),
                             engine.max_seq};
  engine.cache = resolve_cache_budgets(*backend, options_.cache_memory, options_.cache_host_memory, host.available,
                                       host.total, running);
  log_info("prefix cache: " + format_bytes(engine.cache.device_bytes) + " of " + backend->name() + " memory, " +
           format_bytes(engine.cache.host_bytes) + " of host memory");
  const std::string backend_name = backend->name();
  scheduler_ = std::make_unique<Scheduler>(std::move(backend), tokenizer_, engine);
  log_info("continuous batching: at most " + std::to_string(scheduler_->max_batch()) + " requests per step, " +
           std::to_string(engine.step_tokens) + " tokens per step");
  ready_ = true;
  char load_s[32];
  std::snprintf(load_s, sizeof load_s, "%.1f", seconds(Clock::now() - t0));
  log_info("serving " + model_name_ + " on " + url() + " (backend " +
           backend_name + ", max-seq " + std::to_string(max_seq_) + ", loaded in " + load_s + " s)");
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

}  // namespace lily::server::detail
