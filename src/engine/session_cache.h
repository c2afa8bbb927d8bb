// Session prefix cache. It holds decode states ("snapshots", or resume points) keyed by the exact
// tokens fed into them, in a radix tree over token sequences. A new prompt resumes from the
// longest snapshot whose tokens are a strict prefix of it (a snapshot last stored under the
// request's prompt_cache_key is preferred, but never bypasses token equality); a lookup walks
// the prompt once, whatever the number of snapshots. A hit copies the state
// (Backend::resume_state, with room for the request), so the snapshot stays: branches and regenerations of a conversation,
// and every conversation that shares a system prompt, all hit.
//
// A request stores several snapshots: at message boundaries of its prompt (the end of the system
// message, the end of each earlier turn), at the prompt minus its last token (so that the very
// same request hits again) and at its final state (prompt + fed generated tokens, so that the
// next turn hits).
//
// Memory is bounded in bytes, in two tiers: the backend's own memory (device memory for the CUDA
// backend) and host memory (Backend::copy_to_host). Least recently used snapshots of the first
// tier move to the second when it is full, and are dropped from the second when that is full.
// The design keeps snapshots per sequence state, so a batched scheduler can take them for each
// of its rows.
#pragma once
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace lily {

/// Byte budgets of the two tiers. Both 0 disables the cache. device_bytes 0 with host_bytes > 0
/// keeps every snapshot in host memory only. (A server sizes them with resolve_cache_budgets.)
struct SessionCacheOptions {
  int64_t device_bytes = int64_t{256} << 20;  ///< snapshots in the backend's memory (CUDA: device memory), bytes
  int64_t host_bytes = 0;    ///< snapshots in host memory (CUDA: pinned), bytes
};

/// The tiers, in the order a snapshot moves through them.
enum class CacheTier { kDevice = 0, kHost = 1 };

/// "device" | "host" (the /metrics label values).
const char* cache_tier_name(CacheTier tier);

/// Counters and contents of one tier.
struct CacheTierStats {
  int64_t budget = 0;     ///< the byte budget (SessionCacheOptions)
  int64_t bytes = 0;      ///< state bytes now held
  int64_t snapshots = 0;  ///< snapshots now held
  /// Snapshots that left this tier for want of room, cumulative: for the device tier moved to the
  /// host tier or dropped (also a snapshot too large to store at all), for the host tier dropped.
  int64_t evictions = 0;
};

/// Counters for /metrics (cumulative since start, except the tiers' bytes and snapshots).
struct SessionCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t tokens_saved = 0;  ///< prompt tokens resumed from snapshots instead of being prefilled
  CacheTierStats device;
  CacheTierStats host;
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

/// What describe() reports of one snapshot.
struct SnapshotInfo {
  std::vector<int32_t> tokens;
  CacheTier tier = CacheTier::kDevice;
  std::optional<std::string> key;
  int64_t bytes = 0;
};

/// True when `prefix` is strictly shorter than `tokens` and equals its beginning.
bool is_strict_prefix(std::span<const int32_t> prefix, std::span<const int32_t> tokens);

/// The prefix cache. Thread-safe (one mutex); the backend is only called on the caller's thread
/// (the engine thread, which owns it).
class SessionCache {
 public:
  /// Throws OptionError (engine/option_error.h) for a negative budget.
  explicit SessionCache(SessionCacheOptions options);
  ~SessionCache();
  SessionCache(const SessionCache&) = delete;
  SessionCache& operator=(const SessionCache&) = delete;

  /// False when both budgets are 0 (then acquire always misses and store drops).
  bool enabled() const { return options_.device_bytes > 0 || options_.host_bytes > 0; }
  const SessionCacheOptions& options() const { return options_; }

  /// Finds the best snapshot for `prompt` (see the file comment) and returns a runnable deep copy
  /// of its state made with `backend` (from either tier) with room for `capacity` positions
  /// (Backend::resume_state; 0: its own only); the snapshot stays cached and becomes the most
  /// recently used of its tier. Counts a hit (and its tokens) or a miss.
  CacheLookup acquire(Backend& backend, std::span<const int32_t> prompt,
                      const std::optional<std::string>& key, int64_t capacity = 0);

  /// Stores each of `points` (state position == tokens.size(), tokens non-empty; others are
  /// dropped) under `key`, in the device tier (the host tier when the device budget is 0 or the
  /// snapshot is larger than it). A snapshot with exactly the same tokens is replaced. Then moves
  /// or drops least recently used snapshots until both tiers fit their budgets; the snapshots
  /// just stored go last. `backend` (the one that made the states) copies states to the host
  /// tier. A snapshot larger than both budgets is not stored.
  void store(Backend& backend, std::vector<ResumePoint> points, const std::optional<std::string>& key);

  SessionCacheStats stats() const;
  /// Every snapshot, the device tier's first, each tier's most recently used first (for tests
  /// and debugging).
  std::vector<SnapshotInfo> describe() const;

 private:
  struct Node;
  struct Snapshot;
  void insert(Backend& backend, ResumePoint point, const std::optional<std::string>& key);
  void enforce_budgets(Backend& backend);
  void move_to_host(Backend& backend, Node* node);
  void drop(Node* node);
  void prune(Node* node);
  CacheTierStats& tier_stats(CacheTier tier) { return tier == CacheTier::kDevice ? stats_.device : stats_.host; }
  std::list<Node*>& lru(CacheTier tier) { return lru_[static_cast<int>(tier)]; }

  SessionCacheOptions options_;
  mutable std::mutex mutex_;
  std::unique_ptr<Node> root_;
  std::list<Node*> lru_[2];  ///< per tier: nodes holding a snapshot, most recently used first
  SessionCacheStats stats_;
};

/// The budgets a server runs with: `device` and `host` when given (bytes, ≥ 0), else defaults:
/// for a backend that reports its free memory (CUDA), half of it for the device tier and a
/// quarter of the host's available memory for the host tier; for one that does not (the CPU
/// backend, whose memory is host memory), a quarter of the host's available memory for the
/// device tier and no host tier. `host_available` is the host's available memory in bytes.
/// Throws OptionError (engine/option_error.h) naming the field when a given budget is negative
/// or exceeds what there is (device_bytes: the backend's free memory when known, else
/// `host_total`; host_bytes: `host_total`).
SessionCacheOptions resolve_cache_budgets(const Backend& backend, std::optional<int64_t> device,
                                          std::optional<int64_t> host, int64_t host_available,
                                          int64_t host_total);

}  // namespace lily
