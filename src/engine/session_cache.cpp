#include "engine/session_cache.h"

#include <algorithm>

#include "base/error.h"

namespace lily {

bool is_strict_prefix(std::span<const int32_t> prefix, std::span<const int32_t> tokens) {
  return prefix.size() < tokens.size() && std::equal(prefix.begin(), prefix.end(), tokens.begin());
}

SessionCache::SessionCache(SessionCacheOptions options) : options_(options) {
  if (options_.max_entries < 0) throw Error("--cache-entries must be ≥ 0");
  if (options_.max_bytes < 0) throw Error("--cache-bytes must be ≥ 0");
}

CacheLookup SessionCache::acquire(Backend& backend, std::span<const int32_t> prompt,
                                  const std::optional<std::string>& key) {
  std::lock_guard lock(mutex_);
  Entry* best_entry = nullptr;
  const ResumePoint* best_point = nullptr;
  auto score = [&](const Entry& e, const ResumePoint& p) {
    return std::tuple(key.has_value() && e.key == key, p.tokens.size(), e.last_used);
  };
  for (auto& entry : entries_) {
    for (const auto& point : entry.points) {
      if (!is_strict_prefix(point.tokens, prompt)) continue;
      if (best_point == nullptr || score(entry, point) > score(*best_entry, *best_point)) {
        best_entry = &entry;
        best_point = &point;
      }
    }
  }
  CacheLookup out;
  if (best_point == nullptr) {
    ++stats_.misses;
    return out;
  }
  ++stats_.hits;
  best_entry->last_used = ++clock_;
  out.state = backend.clone_state(*best_point->state);
  out.cached_tokens = static_cast<int64_t>(best_point->tokens.size());
  LILY_CHECK(out.state->position() == out.cached_tokens);
  return out;
}

void SessionCache::store(std::vector<ResumePoint> points, const std::optional<std::string>& key) {
  std::lock_guard lock(mutex_);
  if (!enabled()) return;
  std::erase_if(points, [](const ResumePoint& p) {
    return p.state == nullptr || p.tokens.empty() ||
           p.state->position() != static_cast<int64_t>(p.tokens.size());
  });
  if (points.empty()) return;
  remove_duplicate_points(points);
  Entry entry;
  entry.key = key;
  entry.last_used = ++clock_;
  for (const auto& p : points) entry.bytes += p.state->bytes();
  entry.points = std::move(points);
  if (options_.max_bytes > 0 && entry.bytes > options_.max_bytes) {
    ++stats_.evictions;
    return;
  }
  entries_.push_back(std::move(entry));
  evict_to_fit(entries_.back().last_used);
}

void SessionCache::remove_duplicate_points(const std::vector<ResumePoint>& points) {
  for (auto& entry : entries_) {
    std::erase_if(entry.points, [&](const ResumePoint& old) {
      return std::any_of(points.begin(), points.end(),
                         [&](const ResumePoint& p) { return p.tokens == old.tokens; });
    });
    entry.bytes = 0;
    for (const auto& p : entry.points) entry.bytes += p.state->bytes();
  }
  std::erase_if(entries_, [](const Entry& e) { return e.points.empty(); });
}

void SessionCache::evict_to_fit(uint64_t keep_stamp) {
  auto over = [&] {
    return static_cast<int64_t>(entries_.size()) > options_.max_entries ||
           (options_.max_bytes > 0 && total_bytes() > options_.max_bytes);
  };
  while (over()) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->last_used == keep_stamp) continue;
      if (victim == entries_.end() || it->last_used < victim->last_used) victim = it;
    }
    if (victim == entries_.end()) break;
    entries_.erase(victim);
    ++stats_.evictions;
  }
}

int64_t SessionCache::total_bytes() const {
  int64_t total = 0;
  for (const auto& e : entries_) total += e.bytes;
  return total;
}

SessionCacheStats SessionCache::stats() const {
  std::lock_guard lock(mutex_);
  SessionCacheStats s = stats_;
  s.entries = static_cast<int64_t>(entries_.size());
  s.bytes = total_bytes();
  return s;
}

std::vector<std::vector<int64_t>> SessionCache::describe() const {
  std::lock_guard lock(mutex_);
  std::vector<const Entry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->last_used > b->last_used; });
  std::vector<std::vector<int64_t>> out;
  for (const auto* e : order) {
    std::vector<int64_t> lens;
    for (const auto& p : e->points) lens.push_back(static_cast<int64_t>(p.tokens.size()));
    out.push_back(lens);
  }
  return out;
}

}  // namespace lily
