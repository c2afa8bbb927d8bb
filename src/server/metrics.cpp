#include "server/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "base/build_info.h"

namespace lily::server {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void header(std::string& out, const std::string& name, const std::string& type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void scalar(std::string& out, const std::string& name, const std::string& type, const std::string& help,
            double value) {
  header(out, name, type, help);
  out += name + " " + number(value) + "\n";
}

/// A histogram family: its header, then its series.
void histogram(std::string& out, const std::string& name, const std::string& help, const Histogram& h) {
  header(out, name, "histogram", help);
  h.render(name, out);
}

}  // namespace

bool parse_proc_stat(std::string_view line, double ticks_per_second, int64_t page_bytes, ProcessStats& out) {
  // "pid (comm) state ppid …": the name may hold anything, so fields are counted after the
  // last ')'. After it, field 3 (state) comes first; utime is field 14, stime 15,
  // num_threads 20, vsize 23, rss 24 (proc(5)).
  const size_t close = line.rfind(')');
  if (close == std::string_view::npos) return false;
  std::istringstream in{std::string(line.substr(close + 1))};
  std::vector<std::string> fields;
  for (std::string f; in >> f;) fields.push_back(f);
  auto field = [&](int n) { return fields[static_cast<size_t>(n - 3)]; };
  if (fields.size() < 22) return false;
  try {
    out.cpu_seconds = (std::stod(field(14)) + std::stod(field(15))) / ticks_per_second;
    out.threads = std::stoll(field(20));
    out.virtual_bytes = std::stoll(field(23));
    out.resident_bytes = std::stoll(field(24)) * page_bytes;
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

ProcessStats read_process_stats() {
  ProcessStats s;
  std::ifstream stat("/proc/self/stat");
  std::string line;
  if (std::getline(stat, line)) {
    const long ticks = sysconf(_SC_CLK_TCK);
    const long page = sysconf(_SC_PAGESIZE);
    parse_proc_stat(line, ticks > 0 ? static_cast<double>(ticks) : 100.0, page > 0 ? page : 4096, s);
  }
  std::error_code ec;
  int64_t fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) ++fds;
  s.open_fds = ec ? -1 : fds - 1;  // minus the descriptor of the listing itself
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) s.max_fds = static_cast<int64_t>(limit.rlim_cur);
  return s;
}

std::string escape_label_value(std::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::vector<std::pair<const char*, double>> RequestPhases::named() const {
  return {{"parse", parse},         {"template", template_render}, {"tokenize", tokenize},
          {"queue", queue},         {"cache_lookup", cache_lookup}, {"new_state", new_state},
          {"snapshot", snapshot},   {"prefill", prefill},           {"decode", decode},
          {"cache_store", cache_store}};
}

RequestPhases& RequestPhases::operator+=(const RequestPhases& o) {
  parse += o.parse;
  template_render += o.template_render;
  tokenize += o.tokenize;
  queue += o.queue;
  cache_lookup += o.cache_lookup;
  new_state += o.new_state;
  snapshot += o.snapshot;
  prefill += o.prefill;
  decode += o.decode;
  cache_store += o.cache_store;
  return *this;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(const std::string& name, std::string& out) const {
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{le=\"" + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  cumulative += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  out += name + "_sum " + number(sum_) + "\n";
  out += name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      inter_token_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      request_duration_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}),
      queue_time_({0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      running_time_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}),
      step_time_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      step_rows_({1, 2, 4, 8, 16, 32, 64}) {}

void Metrics::record_request(const std::string& route, int status) {
  std::lock_guard lock(mutex_);
  ++requests_[{route, status}];
}

void Metrics::record_tokens(int64_t prompt, int64_t cached, int64_t completion) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += prompt;
  cached_tokens_ += cached;
  completion_tokens_ += completion;
}

void Metrics::observe_locked(Histogram& histogram, double value) {
  std::lock_guard lock(mutex_);
  histogram.observe(value);
}

void Metrics::observe_ttft(double seconds) { observe_locked(ttft_, seconds); }
void Metrics::observe_inter_token(double seconds) { observe_locked(inter_token_, seconds); }
void Metrics::observe_request_duration(double seconds) { observe_locked(request_duration_, seconds); }
void Metrics::observe_queue_time(double seconds) { observe_locked(queue_time_, seconds); }
void Metrics::observe_running_time(double seconds) { observe_locked(running_time_, seconds); }

void Metrics::observe_step(int rows, double seconds) {
  std::lock_guard lock(mutex_);
  step_time_.observe(seconds);
  step_rows_.observe(rows);
}

void Metrics::record_phases(const RequestPhases& phases) {
  std::lock_guard lock(mutex_);
  phases_ += phases;
}

void Metrics::record_cancelled() {
  std::lock_guard lock(mutex_);
  ++cancelled_;
}

void Metrics::record_connection_evicted() {
  std::lock_guard lock(mutex_);
  ++evicted_;
}

std::string Metrics::render(const EngineGauges& g) const {
  std::lock_guard lock(mutex_);
  std::string out;
  header(out, "lily_http_requests_total", "counter", "HTTP requests by route and status.");
  for (const auto& [key, count] : requests_)
    out += "lily_http_requests_total{route=\"" + key.first + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(count) + "\n";
  scalar(out, "lily_prompt_tokens_total", "counter", "Prompt tokens of ended generations (cancelled ones included).", prompt_tokens_);
  scalar(out, "lily_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
         cached_tokens_);
  scalar(out, "lily_completion_tokens_total", "counter", "Generated tokens of ended generations (cancelled ones included: the tokens made before the cancel).",
         completion_tokens_);
  scalar(out, "lily_generations_cancelled_total", "counter",
         "Generations stopped because the client went away or the server shut down.", cancelled_);
  scalar(out, "lily_http_connections_evicted_total", "counter",
         "Idle connections (waiting for a request head) closed to admit a new one at the connection limit.",
         evicted_);
  histogram(out, "lily_time_to_first_token_seconds", "Request arrival to first generated token.", ttft_);
  histogram(out, "lily_inter_token_latency_seconds", "Time between consecutive generated tokens.", inter_token_);
  histogram(out, "lily_request_duration_seconds",
            "Generating requests (chat and completions), arrival to the end of the answer.", request_duration_);
  histogram(out, "lily_request_queue_seconds", "Time a generation waited in the engine's queue.", queue_time_);
  histogram(out, "lily_request_running_seconds", "Time a generation ran in the engine.", running_time_);
  header(out, "lily_request_phase_seconds_total", "counter",
         "Seconds generating requests spent per phase, from parsing the body to the last token.");
  for (const auto& [phase, total] : phases_.named())
    out += std::string("lily_request_phase_seconds_total{phase=\"") + phase + "\"} " + number(total) + "\n";
  histogram(out, "lily_step_seconds", "Wall time of one engine step (one batched forward pass).", step_time_);
  histogram(out, "lily_step_batch_size", "Sequences advanced together in one engine step.", step_rows_);
  scalar(out, "lily_model_ready", "gauge", "1 once the model is loaded.", g.ready ? 1 : 0);
  scalar(out, "lily_queue_depth", "gauge", "Requests waiting for the engine (= lily_requests_waiting).",
         g.queue_depth);
  scalar(out, "lily_requests_waiting", "gauge", "Requests waiting for a batch slot.", g.queue_depth);
  scalar(out, "lily_requests_running", "gauge", "Requests in the engine's batch.", g.running);
  scalar(out, "lily_batch_size", "gauge", "Sequences in the engine step running now or last run (0 when idle).",
         g.batch_size);
  scalar(out, "lily_max_batch", "gauge", "Most requests one engine step holds.", g.max_batch);
  scalar(out, "lily_cache_hits_total", "counter", "Prefix cache hits.", static_cast<double>(g.cache.hits));
  scalar(out, "lily_cache_misses_total", "counter", "Prefix cache misses.", static_cast<double>(g.cache.misses));
  scalar(out, "lily_cache_tokens_saved_total", "counter",
         "Prompt tokens resumed from prefix-cache snapshots instead of being prefilled.",
         static_cast<double>(g.cache.tokens_saved));
  auto per_tier = [&](const char* name, const char* type, const char* help, auto field) {
    header(out, name, type, help);
    for (const auto& [tier, stats] : {std::pair{cache_tier_name(CacheTier::kDevice), &g.cache.device},
                                      std::pair{cache_tier_name(CacheTier::kHost), &g.cache.host}})
      out += std::string(name) + "{tier=\"" + tier + "\"} " + std::to_string(stats->*field) + "\n";
  };
  per_tier("lily_cache_evictions_total", "counter",
           "Prefix-cache snapshots that left a tier for want of room (device: moved to host or dropped).",
           &CacheTierStats::evictions);
  per_tier("lily_cache_snapshots", "gauge", "Prefix-cache snapshots held, per tier.", &CacheTierStats::snapshots);
  per_tier("lily_cache_bytes", "gauge", "Bytes of decode state held by the prefix cache, per tier.",
           &CacheTierStats::bytes);
  per_tier("lily_cache_budget_bytes", "gauge", "Byte budget of each prefix-cache tier.", &CacheTierStats::budget);
  scalar(out, "lily_cache_kv_shared_total", "counter",
         "Prefix-cache snapshots stored sharing the attention KV rows of a shorter one instead of copying them.",
         static_cast<double>(g.cache.kv_shared_snapshots));
  scalar(out, "lily_cache_host_copies_pending", "gauge",
         "Host-tier snapshots whose background copy to host memory is not made yet.",
         static_cast<double>(g.cache.host_copies_pending));
  const ProcessStats p = read_process_stats();
  scalar(out, "process_cpu_seconds_total", "counter", "User and system CPU time of the process.", p.cpu_seconds);
  scalar(out, "process_resident_memory_bytes", "gauge", "Resident memory of the process.",
         static_cast<double>(p.resident_bytes));
  scalar(out, "process_virtual_memory_bytes", "gauge", "Virtual memory of the process.",
         static_cast<double>(p.virtual_bytes));
  scalar(out, "process_open_fds", "gauge", "Open file descriptors of the process.", static_cast<double>(p.open_fds));
  scalar(out, "process_max_fds", "gauge", "Most file descriptors the process may open.",
         static_cast<double>(p.max_fds));
  scalar(out, "process_threads", "gauge", "Threads of the process.", static_cast<double>(p.threads));
  header(out, "lily_build_info", "gauge", "The build of this server (always 1; the labels tell).");
  out += std::string("lily_build_info{version=\"") + escape_label_value(build_version()) + "\",commit=\"" +
         escape_label_value(build_commit()) + "\",build_type=\"" + escape_label_value(build_type()) +
         "\",compiler=\"" + escape_label_value(build_compiler()) + "\",cuda=\"" +
         (build_has_cuda() ? "true" : "false") + "\"} 1\n";
  return out;
}

}  // namespace lily::server
