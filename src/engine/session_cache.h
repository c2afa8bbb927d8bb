// Session prefix cache (issue 4 item 6; reference/serving.md §3 is Lily's version, which this
// improves on). Entries hold decode states ("resume points") together with the exact tokens
// fed into them. A new prompt reuses the longest resume point whose tokens are a strict prefix
// of it (a matching prompt_cache_key is preferred, but never bypasses token equality). A hit
// clones the state (Backend::clone_state), so the entry stays: branches and regenerations of
// one conversation all hit. Each request stores one entry with up to two resume points: the
// prompt minus its last token (so that the very same request hits again) and the final state
// (prompt + fed generated tokens, so that the next turn hits). Bounded by entry count and by
// bytes; least recently used entries are evicted first.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace lily {

/// Limits of the cache. max_entries 0 disables it; max_bytes 0 means no byte bound.
struct SessionCacheOptions {
  int max_entries = 2;
  int64_t max_bytes = 0;
};

/// Counters for /metrics (cumulative since start, except entries/bytes).
struct SessionCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;  ///< entries dropped for the count or byte bound
  int64_t entries = 0;    ///< entries now held
  int64_t bytes = 0;      ///< state bytes now held
};

/// One decode state and the tokens it has consumed (state->position() == tokens.size()).
struct ResumePoint {
  std::vector<int32_t> tokens;
  std::unique_ptr<SequenceState> state;
};

/// Result of SessionCache::acquire: a private state holding prompt[0, cached_tokens), or a
/// null state (miss).
struct CacheLookup {
  std::unique_ptr<SequenceState> state;
  int64_t cached_tokens = 0;
};

/// True when `prefix` is strictly shorter than `tokens` and equals its beginning.
bool is_strict_prefix(std::span<const int32_t> prefix, std::span<const int32_t> tokens);

/// The prefix cache. Thread-safe (one mutex); states are only touched on the caller's thread.
class SessionCache {
 public:
  explicit SessionCache(SessionCacheOptions options);

  /// False when max_entries is 0 (then acquire always misses and store drops).
  bool enabled() const { return options_.max_entries > 0; }

  /// Finds the best resume point for `prompt` (see the file comment) and returns a deep copy
  /// of its state made with `backend`; the entry stays cached and becomes most recently used.
  /// Counts a hit or a miss.
  CacheLookup acquire(Backend& backend, std::span<const int32_t> prompt,
                      const std::optional<std::string>& key);

  /// Stores one entry made of `points` (each: state position == tokens.size(), tokens
  /// non-empty; others are dropped) under `key`. Resume points of older entries with exactly
  /// the same tokens are replaced. Evicts least recently used entries to fit the bounds; an
  /// entry larger than max_bytes alone is not stored.
  void store(std::vector<ResumePoint> points, const std::optional<std::string>& key);

  SessionCacheStats stats() const;
  /// Token lengths of each entry's resume points, most recently used entry first (for tests
  /// and debugging).
  std::vector<std::vector<int64_t>> describe() const;

 private:
  struct Entry {
    std::vector<ResumePoint> points;
    std::optional<std::string> key;
    uint64_t last_used = 0;
    int64_t bytes = 0;
  };
  void remove_duplicate_points(const std::vector<ResumePoint>& points);
  void evict_to_fit(uint64_t keep_stamp);
  int64_t total_bytes() const;

  SessionCacheOptions options_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  SessionCacheStats stats_;
};

}  // namespace lily
