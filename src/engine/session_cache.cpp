#include "engine/session_cache.h"

#include <algorithm>

#include "base/byte_size.h"
#include "base/error.h"
#include "base/log.h"
#include "engine/option_error.h"

namespace lily {

/// A snapshot held by a node of the tree.
struct SessionCache::Snapshot {
  /// Its state: in the host tier a host copy, or (while `copy` is set) the state being copied.
  std::shared_ptr<SequenceState> state;
  CacheTier tier = CacheTier::kDevice;
  std::optional<std::string> key;
  int64_t bytes = 0;
  std::list<Node*>::iterator lru_it;  ///< its place in lru(tier)
  std::shared_ptr<HostCopy> copy;     ///< its background host copy, until installed
  /// The device-tier snapshot of a shorter prefix whose KV rows its state shares
  /// (Backend::share_prefix); null when it holds all its rows. Kept more recently used than this
  /// one, so that it never leaves the device tier first.
  Snapshot* base = nullptr;
  std::vector<Snapshot*> sharers;  ///< the snapshots whose `base` this is
};

/// One background host copy. The helper thread reads `source` without the mutex; everything else
/// changes under it. The helper never frees a state: it hands `source` and `result` to the graveyard.
struct SessionCache::HostCopy {
  std::shared_ptr<SequenceState> source;  ///< the state copied (also the snapshot's until installed)
  Snapshot* snap = nullptr;               ///< null once cancelled (the snapshot was dropped or replaced)
  int64_t bytes = 0;                      ///< source->bytes(), counted in backlog_bytes_
  bool started = false;                   ///< taken from the queue by the helper thread
};

/// A node of the radix tree: the tokens from its parent (`edge`, non-empty except at the root)
/// and, optionally, the snapshot of the state after the tokens of the path root → here. A node
/// other than the root has a snapshot or at least two children (pruned and merged otherwise).
struct SessionCache::Node {
  std::vector<int32_t> edge;
  Node* parent = nullptr;
  int64_t depth = 0;  ///< tokens from the root to the end of `edge`
  std::map<int32_t, std::unique_ptr<Node>> children;  ///< by the first token of their edge
  std::unique_ptr<Snapshot> snap;
};

/// Publishes the counters when it goes out of scope: made after the lock on mutex_, so that it
/// runs before the unlock, also when the work under the lock throws.
struct SessionCache::PublishStats {
  SessionCache& cache;
  ~PublishStats() { cache.publish_stats(); }
};

namespace {

std::vector<int32_t> path_tokens(const auto* node) {
  std::vector<const std::vector<int32_t>*> edges;
  for (; node != nullptr; node = node->parent) edges.push_back(&node->edge);
  std::vector<int32_t> out;
  for (auto it = edges.rbegin(); it != edges.rend(); ++it) out.insert(out.end(), (*it)->begin(), (*it)->end());
  return out;
}

}  // namespace

const char* cache_tier_name(CacheTier tier) { return tier == CacheTier::kDevice ? "device" : "host"; }

bool is_strict_prefix(std::span<const int32_t> prefix, std::span<const int32_t> tokens) {
  return prefix.size() < tokens.size() && std::equal(prefix.begin(), prefix.end(), tokens.begin());
}

SessionCache::SessionCache(SessionCacheOptions options) : options_(options), root_(std::make_unique<Node>()) {
  if (options_.device_bytes < 0)
    throw OptionError("device_bytes", "must be ≥ 0 bytes, got " + std::to_string(options_.device_bytes));
  if (options_.host_bytes < 0)
    throw OptionError("host_bytes", "must be ≥ 0 bytes, got " + std::to_string(options_.host_bytes));
  if (options_.copy_backlog_bytes < 0)
    throw OptionError("copy_backlog_bytes", "must be ≥ 0 bytes, got " + std::to_string(options_.copy_backlog_bytes));
  stats_.device.budget = options_.device_bytes;
  stats_.host.budget = options_.host_bytes;
  published_ = stats_;
}

void SessionCache::publish_stats() {
  std::lock_guard lock(published_mutex_);
  published_ = stats_;
}

SessionCache::~SessionCache() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void SessionCache::start_background_host_copies(Backend& backend) {
  if (!backend.copies_to_host_concurrently())
    throw Error("prefix cache: the " + backend.name() + " backend cannot copy states to host memory in the background");
  std::lock_guard lock(mutex_);
  if (copier_ != nullptr) throw Error("prefix cache: background host copies already started");
  copier_ = &backend;
  worker_ = std::thread([this] { copy_loop(); });
}

void SessionCache::reap() {
  std::vector<std::shared_ptr<SequenceState>> dead;
  {
    std::lock_guard lock(mutex_);
    dead.swap(graveyard_);
  }
}  // `dead` is freed here, outside the lock

void SessionCache::wait_for_host_copies() {
  {
    std::unique_lock lock(mutex_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !copy_running_; });
  }
  reap();
}

CacheLookup SessionCache::acquire(Backend& backend, std::span<const int32_t> prompt,
                                  const std::optional<std::string>& key, int64_t capacity) {
  std::lock_guard lock(mutex_);
  PublishStats publish{*this};
  // One walk down the prompt's path; every snapshot on it is a prefix. The best is the longest,
  // except that one stored under the request's key beats any without it.
  Node* best = nullptr;
  bool best_keyed = false;
  Node* node = root_.get();
  size_t at = 0;
  while (true) {
    if (node->snap && static_cast<size_t>(node->depth) < prompt.size()) {
      const bool keyed = key.has_value() && node->snap->key == key;
      if (best == nullptr || keyed || !best_keyed) {
        best = node;
        best_keyed = keyed;
      }
    }
    if (at >= prompt.size()) break;
    auto it = node->children.find(prompt[at]);
    if (it == node->children.end()) break;
    Node* child = it->second.get();
    if (child->edge.size() > prompt.size() - at ||
        !std::equal(child->edge.begin(), child->edge.end(), prompt.begin() + static_cast<std::ptrdiff_t>(at)))
      break;
    at += child->edge.size();
    node = child;
  }
  CacheLookup out;
  if (best == nullptr) {
    ++stats_.misses;
    return out;
  }
  Snapshot& snap = *best->snap;
  out.state = backend.resume_state(*snap.state, capacity);
  out.cached_tokens = best->depth;
  LILY_CHECK(out.state->position() == out.cached_tokens);
  ++stats_.hits;
  stats_.tokens_saved += out.cached_tokens;
  touch(snap);
  return out;
}

void SessionCache::touch(Snapshot& snap) {
  auto& list = lru(snap.tier);
  list.splice(list.begin(), list, snap.lru_it);
  // The snapshots whose KV rows it shares stay more recently used than it (all in the device tier).
  for (Snapshot* b = snap.base; b != nullptr; b = b->base) {
    auto& device = lru(b->tier);
    device.splice(device.begin(), device, b->lru_it);
  }
}

void SessionCache::unlink_base(Snapshot& snap) {
  if (snap.base != nullptr) std::erase(snap.base->sharers, &snap);
  snap.base = nullptr;
  // Those sharing its KV rows keep its state alive through their own (rare: a base stays more
  // recently used than its sharers, so it leaves the device tier after them).
  for (Snapshot* sharer : snap.sharers) sharer->base = nullptr;
  snap.sharers.clear();
}

void SessionCache::share_with_ancestor(Backend& backend, Node* node) {
  Snapshot& snap = *node->snap;
  Node* up = node->parent;
  while (up != nullptr && !(up->snap && up->snap->tier == CacheTier::kDevice)) up = up->parent;
  if (up == nullptr) return;
  Snapshot& base = *up->snap;
  std::unique_ptr<SequenceState> shared;
  try {
    shared = backend.share_prefix(*snap.state, base.state);
  } catch (const Error& e) {
    log_warn(std::string("prefix cache: cannot share a snapshot's KV rows: ") + e.what());
    return;
  }
  if (shared == nullptr) return;
  graveyard_.push_back(std::move(snap.state));
  stats_.device.bytes += shared->bytes() - snap.bytes;
  snap.bytes = shared->bytes();
  snap.state = std::move(shared);
  snap.base = &base;
  base.sharers.push_back(&snap);
  ++stats_.kv_shared_snapshots;
}

void SessionCache::store(Backend& backend, std::vector<ResumePoint> points, const std::optional<std::string>& key) {
  {
    std::lock_guard lock(mutex_);
    PublishStats publish{*this};
    if (!enabled()) return;
    for (ResumePoint& p : points) {
      if (p.state == nullptr || p.tokens.empty() || p.state->position() != static_cast<int64_t>(p.tokens.size()))
        continue;
      insert(backend, std::move(p), key);
    }
    enforce_budgets(backend);
  }
  points.clear();  // the points not stored, outside the lock
  reap();
}

std::unique_ptr<SessionCache::Snapshot> SessionCache::host_snapshot(Backend& backend, ResumePoint& point,
                                                                     const std::optional<std::string>& key) {
  auto snap = std::make_unique<Snapshot>();
  snap->key = key;
  snap->tier = CacheTier::kHost;
  if (copier_ != nullptr) {
    snap->bytes = point.state->bytes();
    snap->state = std::move(point.state);
    if (queue_copy(*snap)) return snap;
    graveyard_.push_back(std::move(snap->state));
    return nullptr;
  }
  try {
    snap->state = backend.copy_to_host(*point.state);
  } catch (const Error& e) {
    log_warn(std::string("prefix cache: cannot copy a snapshot to host memory: ") + e.what());
    return nullptr;
  }
  graveyard_.push_back(std::move(point.state));
  snap->bytes = snap->state->bytes();
  return snap;
}

bool SessionCache::queue_copy(Snapshot& snap) {
  if (backlog_bytes_ > 0 && backlog_bytes_ + snap.bytes > options_.copy_backlog_bytes) return false;
  auto job = std::make_shared<HostCopy>();
  job->source = snap.state;
  job->snap = &snap;
  job->bytes = snap.bytes;
  backlog_bytes_ += job->bytes;
  snap.copy = job;
  queue_.push_back(std::move(job));
  ++stats_.host_copies_pending;
  work_cv_.notify_one();
  return true;
}

void SessionCache::retire(Snapshot& snap) {
  unlink_base(snap);
  if (snap.copy) {
    HostCopy& job = *snap.copy;
    job.snap = nullptr;
    --stats_.host_copies_pending;
    if (!job.started) {  // never started: its source can go now
      std::erase(queue_, snap.copy);
      backlog_bytes_ -= job.bytes;
      graveyard_.push_back(std::move(job.source));
      idle_cv_.notify_all();
    }
    snap.copy.reset();
  }
  if (snap.state) graveyard_.push_back(std::move(snap.state));
}

void SessionCache::insert(Backend& backend, ResumePoint point, const std::optional<std::string>& key) {
  // The tier is chosen before the tree changes, so that a snapshot that fits nowhere leaves the
  // one it would have replaced in place.
  std::unique_ptr<Snapshot> snap;
  const int64_t bytes = point.state->bytes();
  if (bytes <= options_.device_bytes) {
    snap = std::make_unique<Snapshot>();
    snap->key = key;
    snap->bytes = bytes;
    snap->state = std::move(point.state);
  } else if (bytes <= options_.host_bytes) {
    snap = host_snapshot(backend, point, key);
  }
  if (snap == nullptr) {
    ++stats_.device.evictions;
    return;
  }

  const std::vector<int32_t>& tokens = point.tokens;
  Node* node = root_.get();
  size_t at = 0;
  while (at < tokens.size()) {
    auto it = node->children.find(tokens[at]);
    if (it == node->children.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->edge.assign(tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens.end());
      leaf->parent = node;
      leaf->depth = static_cast<int64_t>(tokens.size());
      Node* raw = leaf.get();
      node->children.emplace(tokens[at], std::move(leaf));
      node = raw;
      break;
    }
    Node* child = it->second.get();
    const auto mismatch = std::mismatch(child->edge.begin(), child->edge.end(),
                                        tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens.end());
    const size_t common = static_cast<size_t>(mismatch.first - child->edge.begin());
    if (common == child->edge.size()) {
      node = child;
      at += common;
      continue;
    }
    // Split the child's edge after `common` tokens (≥ 1: children are keyed by their first).
    auto mid = std::make_unique<Node>();
    mid->edge.assign(child->edge.begin(), child->edge.begin() + static_cast<std::ptrdiff_t>(common));
    mid->parent = node;
    mid->depth = node->depth + static_cast<int64_t>(common);
    std::unique_ptr<Node> lower = std::move(it->second);
    lower->edge.erase(lower->edge.begin(), lower->edge.begin() + static_cast<std::ptrdiff_t>(common));
    lower->parent = mid.get();
    mid->children.emplace(lower->edge.front(), std::move(lower));
    Node* raw = mid.get();
    it->second = std::move(mid);
    node = raw;
    at += common;
  }
  LILY_CHECK(node->depth == static_cast<int64_t>(tokens.size()));
  if (node->snap && !node->snap->sharers.empty()) {
    // Others share its KV rows: it stays (its state holds the very same tokens), under the new key.
    node->snap->key = key;
    retire(*snap);
    touch(*node->snap);
    return;
  }
  if (node->snap) {
    CacheTierStats& old = tier_stats(node->snap->tier);
    old.bytes -= node->snap->bytes;
    --old.snapshots;
    lru(node->snap->tier).erase(node->snap->lru_it);
    retire(*node->snap);
  }
  CacheTierStats& t = tier_stats(snap->tier);
  t.bytes += snap->bytes;
  ++t.snapshots;
  auto& list = lru(snap->tier);
  list.push_front(node);
  snap->lru_it = list.begin();
  node->snap = std::move(snap);
  if (node->snap->tier == CacheTier::kDevice) {
    share_with_ancestor(backend, node);
    touch(*node->snap);
  }
}

void SessionCache::enforce_budgets(Backend& backend) {
  while (stats_.device.bytes > options_.device_bytes && !lru(CacheTier::kDevice).empty()) {
    Node* victim = lru(CacheTier::kDevice).back();
    ++stats_.device.evictions;
    if (victim->snap->bytes <= options_.host_bytes)
      move_to_host(backend, victim);
    else
      drop(victim);
  }
  enforce_host_budget();
}

void SessionCache::enforce_host_budget() {
  while (stats_.host.bytes > options_.host_bytes && !lru(CacheTier::kHost).empty()) {
    ++stats_.host.evictions;
    drop(lru(CacheTier::kHost).back());
  }
}

void SessionCache::move_to_host(Backend& backend, Node* node) {
  Snapshot& snap = *node->snap;
  // Its host copy holds all its KV rows (copy_to_host copies shared rows too); until a background
  // copy is made, its state keeps the base's state alive by itself.
  unlink_base(snap);
  std::shared_ptr<SequenceState> host;
  if (copier_ != nullptr) {
    if (!queue_copy(snap)) {  // the backlog is full: dropped rather than waited for
      log_debug("prefix cache: the host copy backlog is full; a snapshot is dropped instead of moved");
      drop(node);
      return;
    }
    host = snap.state;  // replaced once the copy is made (finish_copy)
  } else {
    try {
      host = backend.copy_to_host(*snap.state);
    } catch (const Error& e) {
      log_warn(std::string("prefix cache: cannot copy a snapshot to host memory: ") + e.what());
      drop(node);
      return;
    }
    graveyard_.push_back(std::move(snap.state));
  }
  stats_.device.bytes -= snap.bytes;
  --stats_.device.snapshots;
  lru(CacheTier::kDevice).erase(snap.lru_it);
  snap.state = std::move(host);
  snap.tier = CacheTier::kHost;
  snap.bytes = snap.state->bytes();
  ++stats_.host.snapshots;
  stats_.host.bytes += snap.bytes;
  auto& list = lru(CacheTier::kHost);
  list.push_front(node);
  snap.lru_it = list.begin();
}

void SessionCache::drop(Node* node) {
  Snapshot& snap = *node->snap;
  CacheTierStats& t = tier_stats(snap.tier);
  t.bytes -= snap.bytes;
  --t.snapshots;
  lru(snap.tier).erase(snap.lru_it);
  retire(snap);
  node->snap.reset();
  prune(node);
}

void SessionCache::copy_loop() {
  std::unique_lock lock(mutex_);
  while (true) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    std::shared_ptr<HostCopy> job = std::move(queue_.front());
    queue_.pop_front();
    job->started = true;
    copy_running_ = true;
    lock.unlock();
    std::unique_ptr<SequenceState> host;
    std::string error;
    try {
      host = copier_->copy_to_host(*job->source);
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    finish_copy(*job, std::move(host), error);
    publish_stats();
    copy_running_ = false;
    idle_cv_.notify_all();
  }
}

void SessionCache::finish_copy(HostCopy& job, std::unique_ptr<SequenceState> host, const std::string& error) {
  backlog_bytes_ -= job.bytes;
  graveyard_.push_back(std::move(job.source));
  Snapshot* snap = job.snap;
  if (snap == nullptr) {  // dropped or replaced meanwhile (retire counted it)
    if (host) graveyard_.push_back(std::move(host));
    return;
  }
  --stats_.host_copies_pending;
  snap->copy.reset();
  Node* node = *snap->lru_it;
  if (host == nullptr) {
    log_warn("prefix cache: cannot copy a snapshot to host memory: " + error);
    drop(node);
    return;
  }
  graveyard_.push_back(std::move(snap->state));
  snap->state = std::move(host);
  stats_.host.bytes += snap->state->bytes() - snap->bytes;
  snap->bytes = snap->state->bytes();
  enforce_host_budget();
}

void SessionCache::prune(Node* node) {
  while (node != root_.get() && !node->snap) {
    if (node->children.empty()) {
      Node* parent = node->parent;
      parent->children.erase(node->edge.front());  // frees `node`
      node = parent;
      continue;
    }
    if (node->children.size() == 1) {  // merge the only child into this node
      std::unique_ptr<Node> child = std::move(node->children.begin()->second);
      node->children.clear();
      node->edge.insert(node->edge.end(), child->edge.begin(), child->edge.end());
      node->depth = child->depth;
      node->children = std::move(child->children);
      for (auto& [first, grandchild] : node->children) grandchild->parent = node;
      node->snap = std::move(child->snap);
      if (node->snap) *node->snap->lru_it = node;
    }
    return;
  }
}

SessionCacheStats SessionCache::stats() const {
  std::lock_guard lock(published_mutex_);
  return published_;
}

std::vector<SnapshotInfo> SessionCache::describe() const {
  std::lock_guard lock(mutex_);
  std::vector<SnapshotInfo> out;
  for (const auto& list : lru_)
    for (const Node* node : list)
      out.push_back({path_tokens(node), node->snap->tier, node->snap->key, node->snap->bytes,
                     node->snap->copy != nullptr, node->snap->base ? (*node->snap->base->lru_it)->depth : 0});
  return out;
}

int64_t default_device_budget(int64_t free, int64_t running_batch) {
  const int64_t margin = std::max<int64_t>(kDeviceBudgetMinMargin, free / 20);
  return std::max<int64_t>(0, free - running_batch - margin);
}

SessionCacheOptions resolve_cache_budgets(const Backend& backend, std::optional<int64_t> device,
                                          std::optional<int64_t> host, int64_t host_available,
                                          int64_t host_total, const RunningBatch& batch) {
  const std::optional<int64_t> free = backend.free_memory();
  auto check = [](const char* field, int64_t value, int64_t limit, const char* what) {
    if (value < 0) throw OptionError(field, "must be ≥ 0 bytes, got " + std::to_string(value));
    if (value > limit)
      throw OptionError(field, format_bytes(value) + " is more than " + what + " (" + format_bytes(limit) + ")");
  };
  SessionCacheOptions o;
  if (device) {
    check("device_bytes", *device, free ? *free : host_total,
          free ? "the backend's free memory" : "this machine's memory");
    o.device_bytes = *device;
  } else {
    o.device_bytes = free ? default_device_budget(*free, int64_t{std::max(batch.sequences, 0)} *
                                                            backend.state_bytes(std::max<int64_t>(batch.max_seq, 1)))
                          : std::max<int64_t>(host_available, 0) / 4;
  }
  if (host) {
    check("host_bytes", *host, host_total, "this machine's memory");
    o.host_bytes = *host;
  } else {
    o.host_bytes = free ? std::max<int64_t>(host_available, 0) / 4 : 0;
  }
  return o;
}

}  // namespace lily
