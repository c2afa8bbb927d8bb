// BlockPool and PooledBlock (block_pool.h). The free lists are one list in least-recently-given
// order, searched linearly: the pool holds a few large blocks (tens of megabytes each, bounded in
// bytes), so a map by size would buy nothing.
#include "base/block_pool.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace lily {

BlockPool::BlockPool(Allocate allocate, Free free, size_t max_idle_bytes, Prepare prepare)
    : allocate_(std::move(allocate)), free_(std::move(free)), max_idle_bytes_(max_idle_bytes),
      prepare_(std::move(prepare)) {}

BlockPool::~BlockPool() { release_idle(); }

size_t BlockPool::size_class(size_t bytes) {
  constexpr size_t kExactUpTo = size_t{64} << 10;
  if (bytes <= kExactUpTo) return bytes;
  size_t top = 1;
  while (top <= bytes / 2) top *= 2;  // the largest power of two ≤ bytes
  const size_t granule = top / 8;
  return (bytes + granule - 1) / granule * granule;
}

void* BlockPool::take(size_t requested) {
  if (requested == 0) return nullptr;
  const size_t bytes = size_class(requested);
  {
    std::lock_guard lock(mutex_);
    demand_.push_back(bytes);
    if (demand_.size() > kDemandTakes) demand_.pop_front();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->bytes != bytes) continue;
      void* p = it->ptr;
      idle_bytes_ -= bytes;
      idle_.erase(it);
      return p;
    }
  }
  void* p = nullptr;
  try {
    p = allocate_(bytes);
  } catch (...) {
    if (idle_bytes() == 0) throw;
    release_idle();
    p = allocate_(bytes);
  }
  std::lock_guard lock(mutex_);
  ++allocations_;
  return p;
}

void BlockPool::give(void* block, size_t requested) noexcept {
  if (block == nullptr) return;
  const size_t bytes = size_class(requested);
  if (bytes > max_idle_bytes_) {
    free_(block, bytes);
    return;
  }
  std::vector<Block> drop;  // freed outside the lock: a free may take milliseconds
  {
    std::lock_guard lock(mutex_);
    idle_.push_front(Block{block, bytes});
    idle_bytes_ += bytes;
    while (idle_bytes_ > max_idle_bytes_) {
      drop.push_back(idle_.back());
      idle_bytes_ -= idle_.back().bytes;
      idle_.pop_back();
    }
  }
  for (const Block& b : drop) free_(b.ptr, b.bytes);
}

void BlockPool::release_idle() noexcept {
  std::list<Block> drop;
  {
    std::lock_guard lock(mutex_);
    drop.swap(idle_);
    idle_bytes_ = 0;
  }
  for (const Block& b : drop) free_(b.ptr, b.bytes);
}

bool BlockPool::refill_one() noexcept {
  size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < demand_.size() && bytes == 0; ++i) {
      const size_t c = demand_[i];
      const auto wanted = std::count(demand_.begin(), demand_.end(), c);
      const auto idle = std::count_if(idle_.begin(), idle_.end(), [&](const Block& b) { return b.bytes == c; });
      if (idle < wanted && idle_bytes_ + c <= max_idle_bytes_) bytes = c;
    }
    if (bytes == 0) {
      demand_.clear();
      return false;
    }
  }
  void* p = nullptr;
  try {
    p = allocate_(bytes);
    if (prepare_) prepare_(p, bytes);
  } catch (...) {
    if (p != nullptr) free_(p, bytes);
    std::lock_guard lock(mutex_);
    demand_.clear();
    return false;
  }
  std::lock_guard lock(mutex_);
  ++allocations_;
  idle_.push_back(Block{p, bytes});  // the least recently given: taken after the blocks given back
  idle_bytes_ += bytes;
  return true;
}

size_t BlockPool::idle_bytes() const {
  std::lock_guard lock(mutex_);
  return idle_bytes_;
}

size_t BlockPool::allocations() const {
  std::lock_guard lock(mutex_);
  return allocations_;
}

}  // namespace lily
