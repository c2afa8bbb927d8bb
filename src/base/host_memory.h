// Host memory for large, long-lived buffers such as decode states and their prefix-cache
// copies. Blocks come from a BlockPool over anonymous mappings: from 2 MiB on a block is aligned
// to 2 MiB and advised for transparent huge pages, so that first touching it costs one page
// fault per 2 MiB instead of one per 4 KiB (copying a fresh 8 MiB state took 25 ms with 4 KiB
// faults on a virtual machine, 1.2 ms with huge pages), and a block given back stays idle and
// touched for the next buffer of its size class, which then costs no fault at all.
// PoolAllocator lets a std::vector take its storage from such a pool.
#pragma once
#include <cstddef>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "base/block_pool.h"

namespace lily {

/// `bytes` (> 0) of zeroed anonymous memory: page-aligned, and from 2 MiB on 2 MiB-aligned and
/// advised for transparent huge pages (MADV_HUGEPAGE: used where the kernel's setting is
/// `always` or `madvise`). Throws lily::Error when the mapping fails.
void* map_host_block(size_t bytes);
/// Unmaps a block that map_host_block(bytes) returned.
void unmap_host_block(void* block, size_t bytes) noexcept;
/// A BlockPool over map_host_block / unmap_host_block keeping at most `max_idle_bytes` idle; the
/// spare blocks its refill_one() makes are touched (every page faulted in) before they are kept.
std::shared_ptr<BlockPool> make_host_block_pool(size_t max_idle_bytes);

/// A std::allocator-compatible allocator: arrays of at least kMinPooledBytes come from a
/// BlockPool (given back to it when freed), smaller ones, and every one when it has no pool,
/// from operator new. Copies share the pool; two allocators are equal when they share it.
template <class T>
class PoolAllocator {
 public:
  using value_type = T;
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  /// Smaller arrays are not worth a pool's block (nor its lock).
  static constexpr size_t kMinPooledBytes = size_t{64} << 10;

  /// An allocator without a pool: operator new for everything.
  PoolAllocator() noexcept = default;
  /// An allocator taking large arrays from `pool` (nullptr: none).
  explicit PoolAllocator(std::shared_ptr<BlockPool> pool) noexcept : pool_(std::move(pool)) {}
  /// The same pool, for another element type.
  template <class U>
  PoolAllocator(const PoolAllocator<U>& other) noexcept : pool_(other.pool()) {}

  /// Room for `n` elements. Throws std::bad_array_new_length past the largest array, and what
  /// BlockPool::take or operator new throws.
  T* allocate(size_t n) {
    if (n > std::numeric_limits<size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
    if (pooled(n)) return static_cast<T*>(pool_->take(n * sizeof(T)));
    return std::allocator<T>{}.allocate(n);
  }
  /// Frees what allocate(n) returned.
  void deallocate(T* p, size_t n) noexcept {
    if (pooled(n)) pool_->give(p, n * sizeof(T));
    else std::allocator<T>{}.deallocate(p, n);
  }
  /// The pool (nullptr when none).
  const std::shared_ptr<BlockPool>& pool() const noexcept { return pool_; }

  friend bool operator==(const PoolAllocator& a, const PoolAllocator& b) noexcept { return a.pool_ == b.pool_; }

 private:
  bool pooled(size_t n) const noexcept { return pool_ != nullptr && n * sizeof(T) >= kMinPooledBytes; }
  std::shared_ptr<BlockPool> pool_;
};

}  // namespace lily
