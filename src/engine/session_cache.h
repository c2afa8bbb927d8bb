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
// A snapshot stored in the device tier shares the attention KV rows of the nearest shorter
// device-tier snapshot on its path instead of copying them, when the backend can
// (Backend::share_prefix: the rows are compared bit for bit) and then counts only the bytes it
// holds itself; the snapshot it shares is kept more recently used than it, so that it never
// leaves the device tier first. A hit, a move to the host tier and a host copy all hold whole
// copies again.
//
// Memory is bounded in bytes, in two tiers: the backend's own memory (device memory for the CUDA
// backend) and host memory (Backend::copy_to_host). Least recently used snapshots of the first
// tier move to the second when it is full, and are dropped from the second when that is full.
//
// Host copies can be made in the background (start_background_host_copies): a snapshot that goes
// to the host tier joins it at once (its bytes count there from then on) but keeps its own state
// until a helper thread has made the host copy, which then replaces it; lookups meanwhile resume
// from the state itself, which holds the same tokens. So a store never waits for a copy (pinning
// new host memory takes about 0.4 ms per MB with CUDA). States the cache lets go of are freed on
// the engine thread only (reap), never on the helper thread.
// The design keeps snapshots per sequence state, so a batched scheduler can take them for each
// of its rows.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"

namespace lily {

/// Byte budgets of the two tiers. Both 0 disables the cache. device_bytes 0 with host_bytes > 0
/// keeps every snapshot in host memory only. (A server sizes them with resolve_cache_budgets.)
struct SessionCacheOptions {
  int64_t device_bytes = int64_t{256} << 20;  ///< snapshots in the backend's memory (CUDA: device memory), bytes
  int64_t host_bytes = 0;    ///< snapshots in host memory (CUDA: pinned), bytes
  /// With background host copies: most bytes of states waiting for (or in) their host copy, held
  /// in the backend's memory beyond the device budget meanwhile. A move that would exceed it
  /// drops the snapshot instead (counted as a device eviction); one move is always allowed.
  int64_t copy_backlog_bytes = int64_t{2} << 30;
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
  /// Host-tier snapshots whose background host copy is queued or running now (counted in `host`).
  int64_t host_copies_pending = 0;
  /// Snapshots stored sharing the KV rows of a shorter one instead of copying them, cumulative.
  int64_t kv_shared_snapshots = 0;
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
  bool copying = false;  ///< its background host copy is not made yet (it resumes from its own state)
  /// Tokens of the snapshot whose KV rows its state shares (Backend::share_prefix); 0: none.
  int64_t kv_base_tokens = 0;
};

/// True when `prefix` is strictly shorter than `tokens` and equals its beginning.
bool is_strict_prefix(std::span<const int32_t> prefix, std::span<const int32_t> tokens);

/// The prefix cache. Thread-safe: one mutex, held across the backend's work (state copies, KV
/// comparisons, host copies), guards the cache; stats() reads a copy of the counters under a
/// mutex of its own, so that it never waits for that work. The backend is only called on the
/// caller's thread (the engine thread, which owns it), except copy_to_host on the helper thread
/// of start_background_host_copies.
class SessionCache {
 public:
  /// Throws OptionError (engine/option_error.h) for a negative budget or copy backlog.
  explicit SessionCache(SessionCacheOptions options);
  /// Stops the helper thread (after the copy it is making, if any) and frees every snapshot.
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
  /// tier (synchronously, unless start_background_host_copies was called). A snapshot larger
  /// than both budgets is not stored. Never waits for a background copy; frees what it let go
  /// (reap) before it returns.
  void store(Backend& backend, std::vector<ResumePoint> points, const std::optional<std::string>& key);

  /// From now on host copies are made on a helper thread with `backend`, whose
  /// copies_to_host_concurrently() must be true and which must outlive the cache (see the file
  /// comment). Throws lily::Error when that backend does not allow it or when already started.
  void start_background_host_copies(Backend& backend);
  /// Frees, on the calling thread (the engine thread), the states the cache let go of since the
  /// last call: device states whose host copy is done, dropped snapshots. Cheap when there are none.
  void reap();
  /// Waits until no background host copy is queued or running, then reaps (for tests and
  /// benchmarks; the engine never waits for copies).
  void wait_for_host_copies();

  /// The counters as the last acquire, store or background copy left them. Never waits for the
  /// cache's own mutex (held across backend work): /metrics reads it while the engine works.
  SessionCacheStats stats() const;
  /// Every snapshot, the device tier's first, each tier's most recently used first (for tests
  /// and debugging).
  std::vector<SnapshotInfo> describe() const;

 private:
  struct Node;
  struct Snapshot;
  struct HostCopy;
  struct PublishStats;
  /// Copies stats_ to what stats() reads; under mutex_.
  void publish_stats();
  void insert(Backend& backend, ResumePoint point, const std::optional<std::string>& key);
  /// Makes `snap` the most recently used of its tier, and the snapshots whose KV rows it shares
  /// more recently used still.
  void touch(Snapshot& snap);
  /// Replaces the state of `node`'s device-tier snapshot by one that shares the KV rows of the
  /// nearest shorter device-tier snapshot on its path (Backend::share_prefix), when the backend can.
  void share_with_ancestor(Backend& backend, Node* node);
  /// Ends `snap`'s sharing of its base's KV rows and that of its sharers' (their states may still
  /// hold the base's state).
  void unlink_base(Snapshot& snap);
  /// The snapshot `point` makes in the host tier (copied now, or queued); null when it cannot.
  std::unique_ptr<Snapshot> host_snapshot(Backend& backend, ResumePoint& point, const std::optional<std::string>& key);
  void enforce_budgets(Backend& backend);
  void enforce_host_budget();
  void move_to_host(Backend& backend, Node* node);
  /// Queues a background host copy of `snap`'s state; false when the backlog has no room.
  bool queue_copy(Snapshot& snap);
  /// Cancels `snap`'s background copy (if any) and hands its state to the graveyard.
  void retire(Snapshot& snap);
  void drop(Node* node);
  void prune(Node* node);
  /// Helper thread: makes the queued host copies one at a time.
  void copy_loop();
  /// Installs (or, when cancelled or failed, discards) a finished copy; under mutex_.
  void finish_copy(HostCopy& job, std::unique_ptr<SequenceState> host, const std::string& error);
  CacheTierStats& tier_stats(CacheTier tier) { return tier == CacheTier::kDevice ? stats_.device : stats_.host; }
  std::list<Node*>& lru(CacheTier tier) { return lru_[static_cast<int>(tier)]; }

  SessionCacheOptions options_;
  mutable std::mutex mutex_;
  std::unique_ptr<Node> root_;
  std::list<Node*> lru_[2];  ///< per tier: nodes holding a snapshot, most recently used first
  SessionCacheStats stats_;
  /// The copy of stats_ that stats() reads: guarded by published_mutex_ alone, which is held for
  /// nothing but copying it (taken after mutex_, never before it).
  mutable std::mutex published_mutex_;
  SessionCacheStats published_;
  /// States to free on the engine thread (reap): never freed under mutex_ or on the helper thread.
  std::vector<std::shared_ptr<SequenceState>> graveyard_;

  // Background host copies (start_background_host_copies); all under mutex_.
  Backend* copier_ = nullptr;                    ///< null: host copies are made in store()
  std::deque<std::shared_ptr<HostCopy>> queue_;  ///< not started yet, oldest first
  int64_t backlog_bytes_ = 0;                    ///< bytes of the sources queued or being copied
  bool copy_running_ = false;                    ///< the helper thread is making a copy
  bool stopping_ = false;
  std::condition_variable work_cv_;  ///< helper: queue_ or stopping_ changed
  std::condition_variable idle_cv_;  ///< wait_for_host_copies: a copy finished
  std::thread worker_;
};

/// What the running batch may hold at once: `sequences` states of up to `max_seq` positions.
struct RunningBatch {
  int sequences = 0;
  int64_t max_seq = 0;
};

/// Device memory kept free beside the running batch at least (the margin is the larger of this
/// and 5 % of the free memory): room for the allocator's rounding and the backend's scratch.
inline constexpr int64_t kDeviceBudgetMinMargin = int64_t{1} << 30;

/// The default device-tier budget of a backend with `free` bytes of its own memory when a
/// running batch of full-length sequences needs `running_batch` bytes: free − running_batch −
/// max(kDeviceBudgetMinMargin, free / 20), at least 0 (then snapshots live in the host tier only).
int64_t default_device_budget(int64_t free, int64_t running_batch);

/// The budgets a server runs with: `device` and `host` when given (bytes, ≥ 0), else defaults:
/// for a backend that reports its free memory (CUDA), what is left of it after `batch`
/// (batch.sequences × Backend::state_bytes(batch.max_seq)) and a margin (default_device_budget)
/// for the device tier, and a quarter of the host's available memory for the host tier; for one
/// that does not (the CPU backend, whose memory is host memory), a quarter of the host's
/// available memory for the device tier and no host tier. `host_available` is the host's
/// available memory in bytes. Throws OptionError (engine/option_error.h) naming the field when
/// a given budget is negative or exceeds what there is (device_bytes: the backend's free memory
/// when known, else `host_total`; host_bytes: `host_total`).
SessionCacheOptions resolve_cache_budgets(const Backend& backend, std::optional<int64_t> device,
                                          std::optional<int64_t> host, int64_t host_available,
                                          int64_t host_total, const RunningBatch& batch = {});

}  // namespace lily
