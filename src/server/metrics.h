// Server metrics in the Prometheus text exposition format (GET /metrics): request counts by
// route and status, token counters, latency histograms (end to end, queued, running, time to
// first token, between tokens), cancelled generations, the process's own resources (from
// /proc/self) and the build; gauges (queue depth, cache) are passed in at render time.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/session_cache.h"

namespace lily::server {

/// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  /// Appends the `_bucket`, `_sum` and `_count` lines of metric `name`.
  void render(const std::string& name, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  ///< [bounds + 1], last is +Inf; not cumulative
  double sum_ = 0;
  int64_t count_ = 0;
};

/// Seconds one generating request spent in each phase, from its body to its last token
/// (Metrics::record_phases; the label values of lily_request_phase_seconds_total).
struct RequestPhases {
  double parse = 0;            ///< the JSON body into a request
  double template_render = 0;  ///< the chat template rendered (chat only; label "template")
  double tokenize = 0;         ///< the prompt text into token ids
  double queue = 0;            ///< waiting for the engine
  double cache_lookup = 0;     ///< the prefix-cache lookup, with the restore of a hit's state
  double new_state = 0;        ///< a fresh decode state on a miss
  double snapshot = 0;         ///< prefix-cache snapshots copied during the prefill
  double prefill = 0;          ///< engine steps that ran its prompt (the last one gives the first token)
  double decode = 0;           ///< engine steps that ran its generated tokens
  double cache_store = 0;      ///< its snapshots stored into the prefix cache at its end
  /// Every phase with its label value, in the order a request goes through them.
  std::vector<std::pair<const char*, double>> named() const;
  /// Adds `o`'s seconds phase by phase.
  RequestPhases& operator+=(const RequestPhases& o);
};

/// Point-in-time values read from the engine when /metrics is scraped.
struct EngineGauges {
  int queue_depth = 0;  ///< requests waiting for a batch slot
  int running = 0;      ///< requests in the batch
  int batch_size = 0;   ///< rows of the engine step running now or last run (0 when idle)
  int max_batch = 0;    ///< the engine's --max-batch
  SessionCacheStats cache;
  bool ready = false;
};

/// The process's own resources, as /proc/self reports them.
struct ProcessStats {
  double cpu_seconds = 0;       ///< user + system CPU time
  int64_t virtual_bytes = 0;
  int64_t resident_bytes = 0;
  int64_t threads = 0;
  int64_t open_fds = 0;         ///< -1 when /proc/self/fd cannot be read
  int64_t max_fds = 0;          ///< RLIMIT_NOFILE (soft)
};

/// Reads one line of /proc/<pid>/stat into `out` (cpu_seconds, virtual_bytes, resident_bytes,
/// threads); `ticks_per_second` and `page_bytes` convert its units. The command name in
/// parentheses may hold spaces and parentheses itself. False when the line has too few fields.
bool parse_proc_stat(std::string_view line, double ticks_per_second, int64_t page_bytes, ProcessStats& out);

/// This process's stats now (fields that cannot be read stay 0, open_fds -1).
ProcessStats read_process_stats();

/// Escapes a Prometheus label value (backslash, double quote and newline).
std::string escape_label_value(std::string_view value);

/// All counters of one server. Thread-safe.
class Metrics {
 public:
  Metrics();
  /// Counts one finished HTTP request. `route` is a known path or "other".
  void record_request(const std::string& route, int status);
  /// Adds one successful completion's token counts.
  void record_tokens(int64_t prompt, int64_t cached, int64_t completion);
  void observe_ttft(double seconds);
  void observe_inter_token(double seconds);
  /// One generating request from its arrival to the end of its answer.
  void observe_request_duration(double seconds);
  /// One job's time in the engine's queue (submitted → taken by the engine).
  void observe_queue_time(double seconds);
  /// One job's time in the engine (taken → finished).
  void observe_running_time(double seconds);
  void record_cancelled();
  /// Counts one idle connection closed to give its slot to a new one (--max-connections).
  void record_connection_evicted();
  /// Adds one generating request's phase times (lily_request_phase_seconds_total).
  void record_phases(const RequestPhases& phases);
  /// One engine step: its rows (sequences advanced together) and its wall time.
  void observe_step(int rows, double seconds);
  /// The whole exposition text.
  std::string render(const EngineGauges& gauges) const;

 private:
  /// Observes `value` in `histogram` under the lock.
  void observe_locked(Histogram& histogram, double value);

  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, completion_tokens_ = 0, cancelled_ = 0, evicted_ = 0;
  Histogram ttft_;
  Histogram inter_token_;
  Histogram request_duration_;
  Histogram queue_time_;
  Histogram running_time_;
  Histogram step_time_;
  Histogram step_rows_;
  RequestPhases phases_;  ///< cumulative
};

}  // namespace lily::server
