// Server metrics in the Prometheus text exposition format (GET /metrics): request counts by
// route and status, token counters, time-to-first-token and inter-token latency histograms,
// cancelled generations; gauges (queue depth, cache) are passed in at render time.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
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

/// Point-in-time values read from the engine when /metrics is scraped.
struct EngineGauges {
  int queue_depth = 0;
  int running = 0;
  SessionCacheStats cache;
  bool ready = false;
};

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
  void record_cancelled();
  /// The whole exposition text.
  std::string render(const EngineGauges& gauges) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, completion_tokens_ = 0, cancelled_ = 0;
  Histogram ttft_;
  Histogram inter_token_;
};

}  // namespace lily::server
