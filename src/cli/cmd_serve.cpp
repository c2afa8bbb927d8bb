// `lily serve`: the OpenAI-compatible chat-completions server (server/http_server.h, docs/server.md).
// --model defaults to the repository's models/demo (found next to the executable).
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "base/byte_size.h"
#include "base/error.h"
#include "base/log.h"
#include "base/malloc_arenas.h"
#include "cli/commands.h"
#include "cli/model_paths.h"
#include "engine/backend.h"
#include "engine/option_error.h"
#include "model/loader.h"
#include "server/http_server.h"
#include "server/http_util.h"

namespace lily::cli {

namespace {

/// glibc gives every thread that allocates an arena of its own (up to 8 per core) and each keeps
/// what was freed in it: with one thread per connection, concurrent large bodies made the
/// resident memory step up for good. Four arenas bound that and leave the engine thread, the CPU
/// backend's workers and the connection threads little contention.
constexpr int kDefaultMallocArenas = 4;

struct ServeFlags {
  std::string model;
  std::string bind = "127.0.0.1:8000";
  std::string host;
  int port = -1;
  int64_t max_seq = -1;
  std::string allowed_origins;  ///< --allowed-origins, parsed by server::parse_allowed_origins
  std::string backend = "auto";
  std::vector<std::string> cuda;  ///< --cuda NAME=VALUE (CudaOptions::set), resolved into options.cuda
  std::string reasoning = "off";  ///< --reasoning on|off
  bool no_mmap = false;  ///< read the weights into memory instead of mapping them
  CLI::Option* api_key = nullptr;  ///< to tell `--api-key ""` from no --api-key
  server::ServerOptions options;
  // Sampling defaults: each counts only when given (else generation_config.json, else greedy).
  double temperature = 0, top_p = 1, min_p = 0;
  int64_t top_k = 0, seed = 0;
  CLI::Option *temperature_opt = nullptr, *top_p_opt = nullptr, *top_k_opt = nullptr, *min_p_opt = nullptr,
              *seed_opt = nullptr;
  bool no_generation_config = false;
  std::string cache_memory, cache_host_memory;  ///< byte counts (parse_byte_size); empty: default
  int malloc_arenas = kDefaultMallocArenas;       ///< --malloc-arenas; 0 = glibc's default
  CLI::Option* malloc_arenas_opt = nullptr;
};

void add_serve_flags(CLI::App* cmd, ServeFlags& f) {
  auto& o = f.options;
  cmd->add_option("--model", f.model, "checkpoint directory (default: the repository's models/demo)");
  cmd->add_option("--bind", f.bind, "listen address HOST:PORT")->capture_default_str();
  cmd->add_option("--host", f.host, "listen host (overrides the host of --bind)");
  cmd->add_option("--port", f.port, "listen port (overrides the port of --bind; 0 = any free port)")
      ->check(integer_in_range(0, 65535));
  cmd->add_option("--max-seq", f.max_seq, "most tokens per sequence, prompt + completion "
                  "(default: the checkpoint's max_position_embeddings; at most " + std::to_string(kMaxContext) + ")")->check(integer_at_least(0));
  f.api_key = cmd->add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' (default: $LILY_API_KEY)");
  cmd->add_flag("--health-requires-key", o.health_requires_key, "with an API key, /health needs it too "
               "(default: /health stays open)");
  cmd->add_option("--backend", f.backend, "cpu | cuda | auto")->capture_default_str();
  cmd->add_flag("--no-mmap", f.no_mmap, "read the weights into memory at start-up instead of memory-mapping "
                "them: resident memory grows by the checkpoint's size, but truncating or rewriting the "
                "files later cannot crash the server (with mmap such a change makes it refuse requests)");
  cmd->add_option("--served-model-name", o.served_model_name, "model name clients must send "
                  "(default: Qwen3.6-35B-A3B for that shape, else the directory name)");
  cmd->add_option("--cache-memory", f.cache_memory, "prefix-cache snapshots in the backend's memory (device memory "
                  "for CUDA), bytes or 512MiB, 4GiB …; 0 with --cache-host-memory 0 disables the cache "
                  "(default: the free device memory after loading, less the running batch at --max-seq and a margin; "
                  "CPU: a quarter of the available memory)")
      ->check(byte_size());
  cmd->add_option("--cache-host-memory", f.cache_host_memory, "prefix-cache second tier in host memory (pinned "
                  "for CUDA), bytes or 512MiB, 4GiB … (default: CUDA a quarter of the available memory, CPU 0)")
      ->check(byte_size());
  cmd->add_option("--max-tokens", o.max_tokens_cap,
                  "most completion tokens per request, and the default when a request omits "
                  "max_tokens; 0 = bounded by --max-seq only")
      ->capture_default_str()
      ->check(integer_at_least(0));
  cmd->add_option("--max-queue", o.max_queue, "waiting requests beyond the batch before answering 503")
      ->capture_default_str()->check(integer_at_least(0));
  // The range any backend allows; run_server refuses what the chosen backend does not
  // (check_server_options) before it binds the port.
  const int cpu_batch = backend_max_batch(BackendKind::kCpu, CudaOptions{});
  cmd->add_option("--max-batch", o.max_batch, "requests decoded together in one step (continuous batching), "
                  "1 … the backend's limit (CPU " + std::to_string(cpu_batch) + ", CUDA LILY_CUDA_MAX_BATCH, " +
                  std::to_string(CudaOptions{}.max_batch) + " by default) (default: CPU 8, CUDA 64, one batched forward)")
      ->check(integer_in_range(1, std::max(cpu_batch, CudaOptions::kMaxBatch)));
  cmd->add_option("--step-tokens", o.step_tokens, "token budget of one engine step: every decoding request's "
                  "token, then prompt chunks (long prompts are cut into chunks of this many tokens so that "
                  "they never stall the decoding requests) (default: CPU 256, CUDA " +
                      std::to_string(CudaOptions{}.prefill_chunk) + ", its prefill chunk)")
      ->check(integer_in_range(1, 1 << 20));
  cmd->add_option("--max-body", o.max_body, "request body limit in bytes (413 above)")
      ->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--max-header-bytes", o.max_header_bytes, "request line + header fields limit in bytes "
                  "(431 above)")
      ->capture_default_str()->check(CLI::Range(int64_t{256}, int64_t{1} << 24));
  cmd->add_option("--max-headers", o.max_headers, "header fields per request (431 above)")
      ->capture_default_str()->check(integer_at_least(1));
  add_cuda_settings(cmd, f.cuda);
  cmd->add_option("--threads", o.threads, "CPU backend threads, 0 = all cores (at most " + std::to_string(kMaxCpuThreads) + ")")
      ->capture_default_str()->check(integer_in_range(0, kMaxCpuThreads));
  cmd->add_option("--max-connections,--http-threads", o.max_connections,
                  "open connections served at once, each on its own thread; more get 503 and are closed")
      ->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--send-buffer", o.send_buffer, "kernel send buffer per connection in bytes, 0 = auto-tuned "
                  "(a small one makes a client that stops reading hit --write-timeout sooner)")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--read-timeout", o.read_timeout_s, "seconds a client may take to send a whole request "
                  "head (408 after), and again its body")
      ->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--write-timeout", o.write_timeout_s, "seconds a client may take to accept response bytes "
                  "(a stream whose client stops reading is cancelled after this)")
      ->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--keep-alive", o.keep_alive_s, "seconds an idle keep-alive connection is kept open")
      ->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--allowed-origins", f.allowed_origins, "CORS: comma-separated origins browsers may call "
                  "the API from (e.g. http://localhost:3000), or * for any (default: none, CORS off)");
  f.temperature_opt = cmd->add_option("--temperature", f.temperature, "default sampling temperature, 0 … 2 "
                                      "(0 = greedy; default: generation_config.json, else 0)");
  f.top_p_opt = cmd->add_option("--top-p", f.top_p, "default top-p, (0, 1] (default: generation_config.json, else 1)");
  f.top_k_opt = cmd->add_option("--top-k", f.top_k, "default top-k, 0 or -1 = off (default: generation_config.json, "
                                "else off)")->check(any_integer());
  f.min_p_opt = cmd->add_option("--min-p", f.min_p, "default min-p, 0 … 1 (default: generation_config.json, else 0)");
  f.seed_opt = cmd->add_option("--seed", f.seed, "seed of requests that send none (default: a fresh one per request)")
                   ->check(any_integer());
  cmd->add_flag("--no-generation-config", f.no_generation_config, "ignore the checkpoint's generation_config.json "
                "(its sampling defaults)");
  cmd->add_option("--reasoning", f.reasoning, "on: chat answers think (<think> text goes to reasoning_content) "
                  "unless a request's reasoning_effort or chat_template_kwargs.enable_thinking says otherwise")
      ->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  f.malloc_arenas_opt = cmd->add_option("--malloc-arenas", f.malloc_arenas, "cap on glibc malloc arenas, set at "
                  "start-up (fewer arenas keep memory freed by one connection's thread usable by the others); "
                  "0 = glibc's default (8 per core, or $MALLOC_ARENA_MAX)")
      ->capture_default_str()->check(integer_in_range(0, 1 << 16));
  cmd->add_option("--shutdown-grace", o.shutdown_grace_s, "seconds running work may finish after SIGINT/SIGTERM")
      ->capture_default_str()->check(integer_at_least(0));
}

/// The flag that sets an engine or server option (OptionError::field), so that an option the
/// engine or the server refuses is reported as the flag the user gave; a field no flag sets (a
/// LILY_CUDA_* variable, say) keeps its name.
std::string serve_flag(std::string_view field) {
  static const std::map<std::string, std::string, std::less<>> flags = {
      // engine (EngineOptions, SessionCacheOptions)
      {"max_seq", "--max-seq"},
      {"max_queue", "--max-queue"},
      {"max_batch", "--max-batch"},
      {"step_tokens", "--step-tokens"},
      {"device_bytes", "--cache-memory"},
      {"host_bytes", "--cache-host-memory"},
      // server (ServerOptions, SamplingFlags, parse_bind, parse_allowed_origins)
      {"bind", "--bind"},
      {"allowed_origins", "--allowed-origins"},
      {"max_body", "--max-body"},
      {"max_connections", "--max-connections"},
      {"max_header_bytes", "--max-header-bytes"},
      {"max_headers", "--max-headers"},
      {"read_timeout_s", "--read-timeout"},
      {"write_timeout_s", "--write-timeout"},
      {"keep_alive_s", "--keep-alive"},
      {"send_buffer", "--send-buffer"},
      {"temperature", "--temperature"},
      {"top_p", "--top-p"},
      {"top_k", "--top-k"},
      {"min_p", "--min-p"},
  };
  const auto it = flags.find(field);
  return it != flags.end() ? it->second : std::string(field);
}

server::ServerOptions resolve(ServeFlags& f) {
  server::ServerOptions o = f.options;
  o.allowed_origins = server::parse_allowed_origins(f.allowed_origins);
  o.model_dir = model_dir_or_default(f.model);
  server::parse_bind(f.bind, o.host, o.port);
  if (!f.host.empty()) o.host = f.host;
  if (f.port >= 0) o.port = f.port;
  if (f.max_seq >= 0) o.max_seq = f.max_seq;
  o.backend = parse_backend_kind(f.backend);
  o.cuda = resolve_cuda_options(o.backend, f.cuda);  // a bad LILY_CUDA_* value stops the start here
  o.reasoning = f.reasoning == "on";
  // Checked here, before the port is bound, where the limit is known without a backend: the
  // host tier's, and the CPU backend's own tier (in host memory). A CUDA tier's limit is the
  // device memory left after the weights load, so the server checks it then.
  const HostMemory host = read_host_memory();
  const auto check_host_bytes = [&](const char* flag, int64_t bytes) {
    if (host.total > 0 && bytes > host.total)
      throw Error(std::string(flag) + " " + format_bytes(bytes) + " is more than this machine's memory (" +
                  format_bytes(host.total) + ")");
  };
  if (!f.cache_memory.empty()) {
    o.cache_memory = parse_byte_size(f.cache_memory);
    if (o.backend == BackendKind::kCpu) check_host_bytes("--cache-memory", *o.cache_memory);
  }
  if (!f.cache_host_memory.empty()) {
    o.cache_host_memory = parse_byte_size(f.cache_host_memory);
    check_host_bytes("--cache-host-memory", *o.cache_host_memory);
  }
  // An empty key would silently mean "no authentication": refuse it instead.
  if (f.api_key->count() > 0 && o.api_key.empty()) throw Error("--api-key must not be empty");
  if (o.api_key.empty()) {
    if (const char* env = std::getenv("LILY_API_KEY")) {
      if (*env == '\0') throw Error("LILY_API_KEY must not be empty (unset it to serve without a key)");
      o.api_key = env;
    }
  }
  if (f.temperature_opt->count() > 0) o.sampling.temperature = f.temperature;
  if (f.top_p_opt->count() > 0) o.sampling.top_p = f.top_p;
  if (f.top_k_opt->count() > 0) o.sampling.top_k = f.top_k;
  if (f.min_p_opt->count() > 0) o.sampling.min_p = f.min_p;
  if (f.seed_opt->count() > 0) o.sampling.seed = f.seed;
  o.sampling.generation_config = !f.no_generation_config;
  o.option_name = serve_flag;
  // The server loads the model itself; the process-wide default reaches its load_model call.
  set_default_weights_mmap(!f.no_mmap);
  return o;
}

}  // namespace

void register_serve(CLI::App& app, int& exit_code, const server::ServerTestHooks& serve_hooks) {
  auto* cmd = app.add_subcommand("serve", "serve the model over an OpenAI-compatible HTTP API");
  auto flags = std::make_shared<ServeFlags>();
  add_serve_flags(cmd, *flags);
  cmd->callback([flags, &exit_code, serve_hooks] {
    // First, before any thread allocates: glibc fixes its arena limit when it first needs one.
    // $MALLOC_ARENA_MAX (glibc's own setting) is kept unless the flag is given.
    const int arenas = flags->malloc_arenas;
    if (arenas > 0 && (flags->malloc_arenas_opt->count() > 0 || std::getenv("MALLOC_ARENA_MAX") == nullptr)) {
      if (!cap_malloc_arenas(arenas)) log_debug("--malloc-arenas: this allocator ignores the cap");
    }
    try {
      server::ServerOptions options = resolve(*flags);
      options.test_hooks = serve_hooks;
      // Said here, where the flags are known (the server itself names no flag).
      if (options.api_key.empty() && !server::is_loopback_host(options.host))
        log_warn("binding to " + options.host + " without an API key: anyone who can reach it can use it "
                 "(set --api-key or LILY_API_KEY)");
      exit_code = server::run_server(options);
    } catch (const OptionError& e) {  // the server's or the engine's words for an option: the flag's
      throw Error(e.message_naming(serve_flag(e.field())));
    }
  });
}

}  // namespace lily::cli
