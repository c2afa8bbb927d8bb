// The public entry points of `lily serve` (http_server.h): run_server, and the small pure
// helpers it and the command line use (option resolution, bind parsing, routes, log lines),
// which are unit-tested on their own. The server itself (detail::LilyServer, server_impl.h)
// is defined in server_lifecycle.cpp, connections.cpp, routes.cpp, generation.cpp and answer.cpp.
#include "server/http_server.h"

#include <arpa/inet.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "base/error.h"
#include "engine/generate.h"
#include "engine/option_error.h"
#include "server/server_impl.h"

namespace lily::server {

using nlohmann::json;

// --- small pure helpers (unit-tested) ----------------------------------------------------------

int64_t resolve_max_seq(std::optional<int64_t> requested, int64_t declared, int64_t backend_limit) {
  if (requested && *requested > backend_limit)
    throw OptionError("max_seq", std::to_string(*requested) + " exceeds the backend's limit of " +
                                     std::to_string(backend_limit) + " tokens");
  int64_t max_seq = requested.value_or(context_or_default(declared));
  if (declared > 0) max_seq = std::min(max_seq, declared);
  max_seq = std::min(max_seq, backend_limit);
  if (max_seq < 2) throw OptionError("max_seq", "must be at least 2 (got " + std::to_string(max_seq) + ")");
  return max_seq;
}

SamplingParams resolve_sampling_defaults(const SamplingFlags& flags, const std::filesystem::path& model_dir) {
  SamplingParams p = flags.generation_config ? generation_config_sampling(model_dir) : SamplingParams{};
  auto check = [](const char* field, double v, double lo, double hi, bool open_lo = false) {
    if (!(v >= lo && v <= hi) || (open_lo && v == lo))  // NaN fails too
      throw OptionError(field, std::string("must be in ") + (open_lo ? "(" : "[") + json(lo).dump() + ", " +
                                   json(hi).dump() + "], got " + (std::isfinite(v) ? json(v).dump() : std::to_string(v)));
    return v;
  };
  if (flags.temperature) p.temperature = static_cast<float>(check("temperature", *flags.temperature, 0, 2));
  if (flags.top_p) p.top_p = static_cast<float>(check("top_p", *flags.top_p, 0, 1, true));
  if (flags.top_k) {
    if (*flags.top_k < -1)
      throw OptionError("top_k", "must be -1, 0 (off) or a positive integer, got " + std::to_string(*flags.top_k));
    p.top_k = static_cast<int32_t>(std::clamp<int64_t>(*flags.top_k, 0, INT32_MAX));
  }
  if (flags.min_p) p.min_p = static_cast<float>(check("min_p", *flags.min_p, 0, 1));
  return p;
}

std::string served_model_name(const ModelConfig& config, const std::filesystem::path& model_dir,
                              const std::string& override_name) {
  if (!override_name.empty()) return override_name;
  if (config.is_qwen36_35b_a3b()) return config.shape_name();
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
  const auto refuse = [bind](const char* why) { return OptionError("bind", "'" + std::string(bind) + "': " + why); };
  std::string_view port_text;
  if (!bind.empty() && bind.front() == '[') {
    const size_t close = bind.find(']');
    if (close == std::string_view::npos) throw refuse("missing ']'");
    host = std::string(bind.substr(1, close - 1));
    if (close + 1 < bind.size()) {
      if (bind[close + 1] != ':') throw refuse("expected ':' after ']'");
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
  if (host.empty()) throw refuse("empty host");
  if (port_text.empty()) return;
  int value = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9' || value > 65535) throw refuse("bad port");
    value = value * 10 + (c - '0');
  }
  if (value > 65535) throw refuse("port above 65535");
  port = value;
}

bool is_loopback_host(std::string_view host) {
  if (host == "localhost") return true;
  const std::string text(host);
  unsigned char v4[4];
  if (inet_pton(AF_INET, text.c_str(), v4) == 1) return v4[0] == 127;
  unsigned char v6[16];
  if (inet_pton(AF_INET6, text.c_str(), v6) != 1) return false;
  static const unsigned char loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::equal(v6, v6 + 16, loopback)) return true;
  return std::equal(v6, v6 + 12, mapped) && v6[12] == 127;  // ::ffff:127.x.y.z
}

namespace {
constexpr std::string_view kModelPrefix = "/v1/models/";
bool is_model_lookup(std::string_view path) {
  return path.size() > kModelPrefix.size() && path.substr(0, kModelPrefix.size()) == kModelPrefix;
}
}  // namespace

std::optional<std::string> allowed_methods(std::string_view path) {
  if (path == "/v1/chat/completions" || path == "/v1/completions" || path == "/tokenize" || path == "/detokenize")
    return "POST";
  if (path == "/health" || path == "/metrics" || path == "/v1/models" || path == "/version" || is_model_lookup(path))
    return "GET, HEAD";
  return std::nullopt;
}

bool method_allowed(std::string_view allowed, std::string_view method) {
  while (!allowed.empty()) {
    const size_t comma = allowed.find(',');
    std::string_view item = allowed.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty() && item == method) return true;
    if (comma == std::string_view::npos) break;
    allowed.remove_prefix(comma + 1);
  }
  return false;
}

std::string route_label(std::string_view path) {
  if (is_model_lookup(path)) return "/v1/models/{id}";
  return allowed_methods(path) ? std::string(path) : "other";
}

std::string request_log_line(std::string_view method, std::string_view path, int status, int64_t ms,
                             const std::optional<LogTokens>& tokens, std::string_view error,
                             std::string_view request_id) {
  std::string line = std::string(method) + " " + std::string(path) + " " + std::to_string(status) + " " +
                     std::to_string(ms) + "ms";
  if (tokens) {
    char rate[32];
    std::snprintf(rate, sizeof rate, "%.1f", tokens->tokens_per_s);
    line += " prompt=" + std::to_string(tokens->prompt) + " cached=" + std::to_string(tokens->cached) +
            " completion=" + std::to_string(tokens->completion) + " tok/s=" + rate;
  }
  if (!error.empty()) line += " error=" + json(std::string(error)).dump(-1, ' ', false, json::error_handler_t::replace);
  if (!request_id.empty()) line += " id=" + std::string(request_id);
  return line;
}

namespace {

/// max_batch against the limit of the backend it will run on (backend_max_batch), refused here
/// and not by the scheduler so that it stops the start before the port is bound and the model
/// loads. Worded as the scheduler words it.
void check_max_batch(const ServerOptions& options) {
  const int limit = std::max(1, backend_max_batch(options.backend, options.cuda));
  if (options.max_batch >= 0 && options.max_batch <= limit) return;
  const std::string backend = options.backend == BackendKind::kCpu    ? "the cpu backend runs"
                              : options.backend == BackendKind::kCuda ? "the cuda backend runs"
                                                                      : "the backends this build may pick run";
  throw OptionError("max_batch", std::to_string(options.max_batch) + " is outside [1, " + std::to_string(limit) +
                                     "]: " + backend + " at most " + std::to_string(limit) +
                                     (limit == 1 ? " sequence" : " sequences") + " per step");
}

}  // namespace

void check_server_options(const ServerOptions& options) {
  const auto at_least = [](const char* field, int64_t value, int64_t min, const char* unit) {
    if (value < min)
      throw OptionError(field, "must be at least " + std::to_string(min) + unit + ", got " + std::to_string(value));
  };
  at_least("max_body", options.max_body, 1, " byte");
  at_least("max_connections", options.max_connections, 1, "");
  if (options.max_header_bytes < 256 || options.max_header_bytes > (1 << 24))
    throw OptionError("max_header_bytes", "must be between 256 and 2^24, got " + std::to_string(options.max_header_bytes));
  at_least("max_headers", options.max_headers, 1, "");
  at_least("read_timeout_s", options.read_timeout_s, 1, " s");
  at_least("write_timeout_s", options.write_timeout_s, 1, " s");
  at_least("keep_alive_s", options.keep_alive_s, 1, " s");
  if (options.send_buffer < 0 || options.send_buffer > (1 << 30))
    throw OptionError("send_buffer", "must be between 0 and 2^30 bytes, got " + std::to_string(options.send_buffer));
  check_max_batch(options);
}

int run_server(const ServerOptions& options) {
  check_server_options(options);
  // SIGINT/SIGTERM are taken by sigwait in the main thread; every thread started from here on
  // inherits the blocked mask. SIGPIPE from a vanished client must not kill the process.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  detail::LilyServer server(options);
  return server.run();
}

}  // namespace lily::server
