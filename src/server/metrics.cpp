#include "server/metrics.h"

#include <cstdio>

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

}  // namespace

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
      inter_token_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}) {}

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

void Metrics::observe_ttft(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void Metrics::observe_inter_token(double seconds) {
  std::lock_guard lock(mutex_);
  inter_token_.observe(seconds);
}

void Metrics::record_cancelled() {
  std::lock_guard lock(mutex_);
  ++cancelled_;
}

std::string Metrics::render(const EngineGauges& g) const {
  std::lock_guard lock(mutex_);
  std::string out;
  header(out, "lily_http_requests_total", "counter", "HTTP requests by route and status.");
  for (const auto& [key, count] : requests_)
    out += "lily_http_requests_total{route=\"" + key.first + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(count) + "\n";
  scalar(out, "lily_prompt_tokens_total", "counter", "Prompt tokens of completed requests.", prompt_tokens_);
  scalar(out, "lily_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
         cached_tokens_);
  scalar(out, "lily_completion_tokens_total", "counter", "Generated tokens of completed requests.",
         completion_tokens_);
  scalar(out, "lily_generations_cancelled_total", "counter",
         "Generations stopped because the client went away or the server shut down.", cancelled_);
  header(out, "lily_time_to_first_token_seconds", "histogram", "Request arrival to first generated token.");
  ttft_.render("lily_time_to_first_token_seconds", out);
  header(out, "lily_inter_token_latency_seconds", "histogram", "Time between consecutive generated tokens.");
  inter_token_.render("lily_inter_token_latency_seconds", out);
  scalar(out, "lily_model_ready", "gauge", "1 once the model is loaded.", g.ready ? 1 : 0);
  scalar(out, "lily_queue_depth", "gauge", "Requests waiting for the engine.", g.queue_depth);
  scalar(out, "lily_requests_running", "gauge", "Requests the engine is running.", g.running);
  scalar(out, "lily_cache_hits_total", "counter", "Prefix cache hits.", static_cast<double>(g.cache.hits));
  scalar(out, "lily_cache_misses_total", "counter", "Prefix cache misses.", static_cast<double>(g.cache.misses));
  scalar(out, "lily_cache_evictions_total", "counter", "Prefix cache entries evicted.",
         static_cast<double>(g.cache.evictions));
  scalar(out, "lily_cache_entries", "gauge", "Prefix cache entries held.", static_cast<double>(g.cache.entries));
  scalar(out, "lily_cache_bytes", "gauge", "Bytes of decode state held by the prefix cache.",
         static_cast<double>(g.cache.bytes));
  return out;
}

}  // namespace lily::server
