// SlabArena: memory reserved in large slabs and handed out in blocks carved from them, so that
// after a slab exists, taking and giving back blocks calls no allocator at all. The CUDA
// backend keeps the host copies of its states (the prefix cache's second tier) in one over
// pinned host memory: pinning memory (cudaMallocHost) takes about 0.4 ms per MB and holds the
// driver meanwhile, stalling every launch of the engine, whereas carving a block from a slab
// pinned earlier costs a few list operations. The arena knows nothing of what the memory is:
// it is given an allocate and a free function, like BlockPool (block_pool.h).
#pragma once
#include "base/held_block.h"
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace lily {

/// Blocks sub-allocated from slabs of one allocator. A slab is reserved when no free range
/// holds a request (slab_bytes, or the request's size when larger; never past the cap) and is
/// then kept until the arena is destroyed, except that a request which would pass the cap first
/// frees the slabs that have nothing taken from them. Within the slabs a request takes the
/// smallest free range that holds it (the lowest address among equals), and a block given back
/// merges with the free ranges beside it in its slab, so that a run of blocks given back is one
/// range again. Every block starts on a 256-byte boundary and takes a multiple of 256 bytes.
/// Thread-safe: blocks may be taken and given back from any thread; slabs are allocated and
/// freed outside the arena's lock.
class SlabArena {
 public:
  /// Allocates a slab of `bytes` (> 0, a multiple of 256) bytes, aligned to 256 bytes (as
  /// cudaMallocHost and std::aligned_alloc(256, …) are); throws lily::Error when it cannot.
  using Allocate = std::function<void*(size_t bytes)>;
  /// Frees a slab that Allocate returned, with the size it was allocated with; must not throw.
  using Free = std::function<void(void* slab, size_t bytes)>;

  /// Alignment of every block, and the granule of block sizes, in bytes.
  static constexpr size_t kAlignment = 256;
  /// No cap (the default): slabs are reserved as long as the allocator gives memory.
  static constexpr size_t kNoCap = SIZE_MAX;

  /// Byte accounting of an arena (stats()).
  struct Stats {
    size_t reserved_bytes = 0;    ///< bytes of the slabs held (what Allocate was asked for)
    size_t used_bytes = 0;        ///< bytes of the blocks taken, each rounded up to 256 bytes
    size_t largest_free = 0;      ///< bytes of the largest free range (the largest block served without a new slab)
    size_t slabs = 0;             ///< slabs held
    size_t slab_allocations = 0;  ///< Allocate calls that succeeded so far
    size_t slab_frees = 0;        ///< Free calls so far, before the destructor's
    size_t blocks = 0;            ///< blocks taken and not given back
  };

  /// An arena over `allocate` and `free` whose slabs are `slab_bytes` (> 0; rounded up to 256)
  /// bytes each, and which holds at most `cap_bytes` bytes of slabs (kNoCap: no bound). `name`
  /// says what the memory is in error messages ("pinned host memory"). Reserves nothing yet.
  SlabArena(Allocate allocate, Free free, size_t slab_bytes, size_t cap_bytes = kNoCap,
            std::string name = "arena memory");
  /// Frees every slab. Blocks still taken are not the arena's any more (ArenaBlock keeps its
  /// arena alive, so with ArenaBlock there are none).
  ~SlabArena();
  SlabArena(const SlabArena&) = delete;
  SlabArena& operator=(const SlabArena&) = delete;

  /// A block of at least `bytes` bytes, 256-byte aligned; nullptr for 0 bytes. Served from the
  /// free ranges when one holds it, else from a new slab (see the class comment). Throws
  /// lily::Error naming the requested bytes, the largest free range, the bytes that could still
  /// be reserved and the cap when a new slab would pass the cap, and what Allocate throws when
  /// the slab cannot be allocated (either way the blocks taken and the free ranges of the slabs
  /// kept are as before).
  void* allocate(size_t bytes);
  /// Gives back a block that allocate() returned; nothing may use it any more. Its bytes join
  /// the free ranges beside it at once; the slab stays reserved. nullptr is ignored. Throws
  /// lily::InternalError for a pointer the arena did not hand out (or gave back already).
  void deallocate(void* block);
  /// allocate(), under the name HeldBlock takes blocks by.
  void* take(size_t bytes) { return allocate(bytes); }
  /// deallocate() for HeldBlock; a block this arena handed out is never refused (a foreign one
  /// would terminate: noexcept).
  void give(void* block, size_t /*bytes*/) noexcept { deallocate(block); }
  /// Reserves slabs until at least min(`bytes`, cap) bytes are reserved (those held included),
  /// in slabs of slab_bytes (the last one smaller where the cap says so). Throws what Allocate
  /// throws; the slabs reserved before the failure stay.
  void reserve(size_t bytes);
  /// Reserves at most one slab so that the largest block taken so far would be served without
  /// a new slab, unless the cap says no: true when it reserved one, false when it was not needed
  /// or not allowed, or the allocation failed (swallowed: the slab is optional). For idle time,
  /// so that the next copies of that size find memory ready.
  bool reserve_spare() noexcept;
  /// Sets the most bytes of slabs the arena may hold from now on (kNoCap: no bound). Slabs
  /// already held are kept, even beyond it.
  void set_cap(size_t cap_bytes);
  /// The current cap in bytes (kNoCap: none).
  size_t cap() const;
  /// Byte accounting now.
  Stats stats() const;
  /// `bytes` rounded up to a multiple of 256 (what a block of `bytes` takes).
  static size_t round_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  struct Slab {
    char* base;       ///< what Allocate returned (256-byte aligned)
    size_t bytes;     ///< what Allocate was asked for (a multiple of 256)
    size_t used = 0;  ///< bytes of blocks taken from it
  };
  struct Range {
    size_t bytes;
    Slab* slab;
  };

  /// Takes `bytes` (a multiple of 256) from the best free range; nullptr when none holds it.
  /// Under mutex_.
  char* take_locked(size_t bytes);
  /// Adds `slab` to slabs_ and its bytes to the free ranges. Under mutex_.
  void add_slab_locked(std::unique_ptr<Slab> slab);
  /// Allocates a slab of `bytes` (outside the lock; the bytes were counted in reserved_ first).
  /// Throws what Allocate throws, or lily::InternalError for a slab that is not 256-byte aligned.
  std::unique_ptr<Slab> new_slab(size_t bytes);
  /// new_slab(slab_bytes) then add_slab_locked, the bytes already counted in reserved_ (taken
  /// back out if the allocation throws, then rethrown). Takes mutex_ itself.
  void grow(size_t slab_bytes);
  /// Bytes that may still be reserved under the cap. Under mutex_.
  size_t room_locked() const;
  /// The largest free range. Under mutex_.
  size_t largest_free_locked() const;

  Allocate allocate_;
  Free free_;
  const size_t slab_bytes_;
  const std::string name_;
  mutable std::mutex mutex_;
  size_t cap_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::map<char*, Range> ranges_;           ///< free ranges by start address (every slab's)
  std::unordered_map<char*, Range> taken_;  ///< blocks taken, by start address
  size_t reserved_ = 0;                     ///< bytes of slabs held or being allocated
  size_t used_ = 0;                         ///< bytes of the blocks taken (rounded)
  size_t largest_request_ = 0;              ///< largest block asked for so far (rounded)
  size_t slab_allocations_ = 0;
  size_t slab_frees_ = 0;
};

/// A block of a shared SlabArena, given back to it on destruction (256-byte aligned; the arena
/// may hold up to 255 bytes more than asked).
using ArenaBlock = HeldBlock<SlabArena>;

}  // namespace lily
