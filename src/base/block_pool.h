// BlockPool: idle memory blocks kept for reuse by size class. A caller that allocates and frees
// the same sizes again and again pays each allocation once; the CUDA backend's sequence states
// and their host copies come from two of them, because cudaMalloc and cudaMallocHost of tens of
// megabytes take milliseconds and cudaFree synchronises the device, and the CPU backend's states
// from one over huge-page host mappings (host_memory.h), whose reused blocks are already touched
// (no page faults). The pool knows nothing of what the memory is: it is given an allocate and a
// free function.
#pragma once
#include "base/held_block.h"
#include <cstddef>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>

namespace lily {

/// A cache of idle blocks of one allocator, reused by size class and bounded by the bytes it
/// keeps idle. Sizes up to 64 KiB are their own class; larger ones are rounded up to one of 8
/// classes per power of two (at most 12.5 % more memory), so that states of similar lengths (a
/// conversation's turn 1 and turn 2) share blocks. It also remembers the classes recently taken
/// (the demand), and refill_one() makes spare blocks of them ahead of need, so that work done
/// while nothing else runs saves the next takes an allocation (a conversation's next turn takes
/// blocks of nearly the same sizes as its last). Thread-safe: blocks may be taken and given back
/// from any thread.
class BlockPool {
 public:
  /// Allocates `bytes` (> 0) bytes; throws lily::Error when it cannot.
  using Allocate = std::function<void*(size_t bytes)>;
  /// Frees a block that Allocate returned, with the size it was allocated with; must not throw.
  using Free = std::function<void(void* block, size_t bytes)>;
  /// Readies a block refill_one() just allocated (e.g. touches its pages); may throw.
  using Prepare = std::function<void(void* block, size_t bytes)>;

  /// Most takes the demand remembers (the oldest are forgotten first).
  static constexpr size_t kDemandTakes = 64;

  /// A pool over `allocate` and `free` that keeps at most `max_idle_bytes` bytes idle; blocks
  /// made by refill_one() go through `prepare` first when it is set.
  BlockPool(Allocate allocate, Free free, size_t max_idle_bytes, Prepare prepare = {});
  /// Frees every idle block. Blocks still taken are not the pool's any more (PooledBlock keeps
  /// its pool alive, so with PooledBlock there are none).
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  /// A block of at least `bytes` bytes (size_class(bytes)): the most recently given idle block of
  /// that class, else a new allocation. When the allocation fails, every idle block is freed and it is tried once
  /// more, so memory held idle never makes an allocation fail. nullptr for 0 bytes. Throws what
  /// Allocate throws.
  void* take(size_t bytes);
  /// Gives back a block of `bytes` bytes that take() returned; nothing may use it any more. It
  /// stays idle for reuse; while more than max_idle_bytes are idle, the least recently given
  /// blocks are freed (a block larger than the bound is freed at once). nullptr is ignored.
  void give(void* block, size_t bytes) noexcept;
  /// Frees every idle block.
  void release_idle() noexcept;
  /// Makes at most one spare block for the demand: for the first size class taken since the
  /// demand was last met that has fewer idle blocks than it was taken times, allocates (and
  /// prepares) one and keeps it idle, unless that would keep more than max_idle_bytes idle.
  /// Returns true while the demand is not met yet (call again), false once it is (the demand is
  /// then forgotten) or when an allocation fails (its error is swallowed: spares are optional).
  bool refill_one() noexcept;
  /// The bytes a block taken for `bytes` really has: `bytes` up to 64 KiB, else `bytes` rounded
  /// up to a multiple of 2^(⌊log2 bytes⌋ − 3).
  static size_t size_class(size_t bytes);
  /// Bytes held idle now.
  size_t idle_bytes() const;
  /// Blocks allocated so far (takes served from the idle blocks are not counted).
  size_t allocations() const;

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  Allocate allocate_;
  Free free_;
  const size_t max_idle_bytes_;
  Prepare prepare_;
  mutable std::mutex mutex_;
  std::list<Block> idle_;  ///< most recently given first
  size_t idle_bytes_ = 0;
  size_t allocations_ = 0;
  std::deque<size_t> demand_;  ///< size classes of the takes since the demand was last met, oldest first
};

/// A block of a shared BlockPool, given back to it on destruction.
using PooledBlock = HeldBlock<BlockPool>;

}  // namespace lily
