// `lily serve`: the OpenAI-compatible HTTP server (HTTP/1.1 on Boost.Beast and
// Boost.Asio; docs/server.md). One thread per open connection parses, validates, tokenizes and
// serializes; one engine thread (engine/scheduler.h) generates. /health, /v1/models and
// /metrics never wait for the engine, and the engine never waits for a socket.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/config.h"

namespace lily::server {

/// Server-wide sampling defaults from the command line; each unset one comes from the
/// checkpoint's generation_config.json (when used), else greedy. Request fields override them.
struct SamplingFlags {
  std::optional<double> temperature;  ///< --temperature, 0 … 2
  std::optional<double> top_p;        ///< --top-p, (0, 1]
  std::optional<int64_t> top_k;       ///< --top-k, ≥ -1 (-1 and 0: off)
  std::optional<double> min_p;        ///< --min-p, 0 … 1
  std::optional<int64_t> seed;        ///< --seed: the seed of requests without one (else a fresh one each)
  bool generation_config = true;      ///< read generation_config.json (--no-generation-config: no)
};

/// The sampling defaults of a server: generation_config.json of `model_dir` when
/// `flags.generation_config` (generation_config_sampling), then each flag that is set. Throws
/// OptionError (engine/option_error.h) naming the field ("temperature", "top_p", "top_k",
/// "min_p") for an out-of-range value, and lily::Error for an unreadable file.
SamplingParams resolve_sampling_defaults(const SamplingFlags& flags, const std::filesystem::path& model_dir);

/// Delays that only tests set, to make a passing state of the server observable from outside: the
/// Node suites reach them through the test-only tests/tools/lily_test_server, which reads
/// LILY_TEST_LOAD_DELAY_MS and LILY_TEST_LISTEN_DELAY_MS and passes them to cli::run_cli; `lily`
/// passes none, and the server reads no environment for them. All zero, which changes nothing,
/// in real use.
struct ServerTestHooks {
  /// The loader waits this long before loading (in steps, so a signal still stops the server):
  /// the "loading" state lasts long enough to be seen on the small demo model.
  int64_t load_delay_ms = 0;
  /// The accept loop waits this long before its first connection, so a signal that arrives
  /// before then is reproducible.
  int64_t listen_delay_ms = 0;
};

/// Everything `lily serve` is configured with.
struct ServerOptions {
  std::filesystem::path model_dir;
  std::string host = "127.0.0.1";
  int port = 8000;                       ///< 0 picks a free port (printed in the startup line)
  std::optional<int64_t> max_seq;        ///< default: the checkpoint's max_position_embeddings
  std::string api_key;                   ///< empty: no authentication
  BackendKind backend = BackendKind::kAuto;
  int threads = 0;                       ///< CPU backend threads (0 = all cores)
  CudaOptions cuda;                      ///< CUDA backend options (make_backend), resolved by the CLI
                                         ///< (resolve_cuda_options: LILY_CUDA_*, then `--cuda`)
  std::string served_model_name;         ///< empty: derived (see served_model_name())
  std::optional<int64_t> cache_memory;   ///< prefix cache, backend-memory tier, bytes (default:
                                         ///< resolve_cache_budgets; 0 with cache_host_memory 0 disables)
  std::optional<int64_t> cache_host_memory;  ///< prefix cache, host-memory tier, bytes (default:
                                         ///< resolve_cache_budgets)
  int max_queue = 16;                    ///< waiting requests before 503
  int max_batch = 0;                     ///< requests decoded together in one step (continuous
                                         ///< batching); 0 = the backend's preferred_max_batch()
                                         ///< (CPU 8, CUDA 64), or its limit where that is lower
  /// Token budget of one engine step (prefill chunks); 0: the backend's preferred_step_tokens().
  int64_t step_tokens = 0;
  int64_t max_tokens_cap = 0;            ///< most completion tokens per request (0 = only the
                                         ///< context bounds it); also the default max_tokens
  int64_t max_body = 1 << 20;            ///< request body limit in bytes (413 as soon as the
                                         ///< declared or received length passes it)
  int64_t max_header_bytes = 16384;      ///< request line + header fields, bytes (431 above)
  int max_headers = 100;                 ///< header fields per request (431 above)
  int max_connections = 64;              ///< open connections served at once, each on its own
                                         ///< thread; more get 503 + `Connection: close` at once
  int64_t send_buffer = 0;               ///< kernel send buffer per connection in bytes (SO_SNDBUF;
                                         ///< 0 = the kernel's auto-tuned default)
  bool health_requires_key = false;      ///< with an API key: /health needs it too
  int read_timeout_s = 30;               ///< a client must send a whole request head within
                                         ///< this (408 after), and then its body within this
  int write_timeout_s = 30;              ///< a client must accept response bytes within this
  int keep_alive_s = 5;                  ///< idle keep-alive connections are closed after this
  int shutdown_grace_s = 10;             ///< SIGINT/SIGTERM: running work may finish within this
  bool reasoning = false;                ///< --reasoning on: chat answers think unless a request
                                         ///< says otherwise (reasoning_effort, chat_template_kwargs)
  std::vector<std::string> allowed_origins;  ///< CORS: origins (or "*") browsers may call from
                                         ///< (parse_allowed_origins); empty = CORS off
  SamplingFlags sampling;                ///< sampling defaults (docs/server.md)
  /// How the user set an engine option (OptionError::field, e.g. "max_batch") that the engine
  /// refuses while loading, to name it in the error logged then: `lily serve` gives the flag
  /// ("--max-batch"). Unset: the engine's own message. (An option run_server refuses before it
  /// serves is thrown as OptionError, for the caller to word.)
  std::function<std::string(std::string_view field)> option_name;
  ServerTestHooks test_hooks;            ///< tests only; none in real use
};

/// Checks the server's own limits (max_body, max_connections, max_header_bytes, max_headers,
/// read_timeout_s, write_timeout_s, keep_alive_s, send_buffer) and max_batch against the limit of
/// its backend (backend_max_batch: the scheduler's rule, checked before anything starts). Throws OptionError
/// (engine/option_error.h) naming the first field out of range by its ServerOptions name, e.g.
/// "max_body must be at least 1 byte, got 0".
void check_server_options(const ServerOptions& options);

/// Runs the server until SIGINT/SIGTERM; returns the process exit code (0 after a graceful
/// shutdown). Throws OptionError (engine/option_error.h), naming the ServerOptions field, for an
/// option out of range (check_server_options, resolve_max_seq, resolve_sampling_defaults), and
/// lily::Error for an unusable checkpoint or an address that cannot be bound.
int run_server(const ServerOptions& options);

/// The effective max_seq (docs/server.md, `--max-seq`): the requested value or, by default, the
/// checkpoint's max_position_embeddings (or kMaxContext, model/config.h, when it declares none),
/// clamped to the declared value and to `backend_limit` (backend_max_sequence of the chosen
/// backend). Throws OptionError (engine/option_error.h) with field "max_seq" when the result is
/// < 2 or a request exceeds backend_limit.
int64_t resolve_max_seq(std::optional<int64_t> requested, int64_t declared, int64_t backend_limit = kMaxContext);

/// `--served-model-name` when given; "Qwen3.6-35B-A3B" for that exact shape; else the
/// checkpoint directory's name.
std::string served_model_name(const ModelConfig& config, const std::filesystem::path& model_dir,
                              const std::string& override_name);

/// Compares two secrets in time independent of where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

/// Parses "HOST:PORT", "[V6]:PORT" or "HOST" (port unchanged) into host/port. Throws OptionError
/// (engine/option_error.h) with field "bind" and a detail that quotes `bind` and says what is
/// wrong ("'[::1': missing ']'"); host and port may then be changed.
void parse_bind(std::string_view bind, std::string& host, int& port);

/// True for "localhost", 127.0.0.0/8, ::1 and IPv4-mapped 127.0.0.0/8 (::ffff:127.x.y.z), in
/// any spelling that inet_pton accepts.
bool is_loopback_host(std::string_view host);

/// Methods allowed on a known route ("GET, HEAD" / "POST"); nullopt for an unknown path.
/// "/v1/models/{id}" (any non-empty id) is a known route.
std::optional<std::string> allowed_methods(std::string_view path);

/// True when `method` is one of the comma-separated methods in `allowed` (exact match:
/// "GE" is not "GET").
bool method_allowed(std::string_view allowed, std::string_view method);

/// The route a path is counted under in /metrics: the path itself for a fixed route,
/// "/v1/models/{id}" for a model lookup, "other" for an unknown path (bounded label values).
std::string route_label(std::string_view path);

/// Token part of a request log line.
struct LogTokens {
  int64_t prompt = 0, cached = 0, completion = 0;
  double tokens_per_s = 0;  ///< decode rate: tokens after the first per second of decoding (no queueing, no prefill)
};

/// One request log line: `<METHOD> <path> <status> <ms>ms[ prompt=… cached=… completion=…
/// tok/s=…][ error="…"][ id=<request id>]`.
std::string request_log_line(std::string_view method, std::string_view path, int status, int64_t ms,
                             const std::optional<LogTokens>& tokens, std::string_view error,
                             std::string_view request_id = {});

}  // namespace lily::server
