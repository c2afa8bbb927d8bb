// SlabArena and ArenaBlock (slab_arena.h). The free ranges are one map by address over every
// slab: a block given back finds its neighbours there in O(log n), and a request scans the map
// for the best fit, which is cheap because the arena holds few, large blocks (host copies of
// states, tens to hundreds of megabytes each). Slabs are allocated and freed outside the lock
// (pinning memory takes milliseconds); their bytes are counted as reserved before the call, so
// that two threads reserving at once never pass the cap together.
#include "base/slab_arena.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "base/byte_size.h"
#include "base/error.h"

namespace lily {

namespace {

/// "314572800 bytes (300.0 MiB)".
std::string bytes_text(size_t bytes) {
  std::string s = std::to_string(bytes) + " bytes";
  if (bytes >= 1024 && bytes <= static_cast<size_t>(INT64_MAX)) s += " (" + format_bytes(static_cast<int64_t>(bytes)) + ")";
  return s;
}

}  // namespace

SlabArena::SlabArena(Allocate allocate, Free free, size_t slab_bytes, size_t cap_bytes, std::string name)
    : allocate_(std::move(allocate)), free_(std::move(free)), slab_bytes_(round_up(slab_bytes)), name_(std::move(name)),
      cap_(cap_bytes == kNoCap ? kNoCap : cap_bytes / kAlignment * kAlignment) {
  LILY_CHECK(slab_bytes > 0 && slab_bytes <= SIZE_MAX - kAlignment);
}

SlabArena::~SlabArena() {
  for (const auto& s : slabs_) free_(s->base, s->bytes);
}

void SlabArena::set_cap(size_t cap_bytes) {
  std::lock_guard lock(mutex_);
  cap_ = cap_bytes == kNoCap ? kNoCap : cap_bytes / kAlignment * kAlignment;
}

size_t SlabArena::cap() const {
  std::lock_guard lock(mutex_);
  return cap_;
}

char* SlabArena::take_locked(size_t bytes) {
  auto best = ranges_.end();
  for (auto it = ranges_.begin(); it != ranges_.end(); ++it) {
    if (it->second.bytes >= bytes && (best == ranges_.end() || it->second.bytes < best->second.bytes)) {
      best = it;
      if (best->second.bytes == bytes) break;  // an exact fit: none is better
    }
  }
  if (best == ranges_.end()) return nullptr;
  char* p = best->first;
  const Range range = best->second;
  auto hint = ranges_.erase(best);
  if (range.bytes > bytes) ranges_.emplace_hint(hint, p + bytes, Range{range.bytes - bytes, range.slab});
  taken_.emplace(p, Range{bytes, range.slab});
  range.slab->used += bytes;
  used_ += bytes;
  return p;
}

void SlabArena::add_slab_locked(std::unique_ptr<Slab> slab) {
  ranges_.emplace(slab->base, Range{slab->bytes, slab.get()});
  slabs_.push_back(std::move(slab));
  ++slab_allocations_;
}

std::unique_ptr<SlabArena::Slab> SlabArena::new_slab(size_t bytes) {
  void* p = allocate_(bytes);
  if (reinterpret_cast<uintptr_t>(p) % kAlignment != 0) {
    free_(p, bytes);
    throw InternalError("SlabArena(" + name_ + "): the allocator returned a slab that is not 256-byte aligned");
  }
  return std::make_unique<Slab>(Slab{static_cast<char*>(p), bytes});
}

void SlabArena::grow(size_t slab_bytes) {
  std::unique_ptr<Slab> slab;
  try {
    slab = new_slab(slab_bytes);
  } catch (...) {
    std::lock_guard lock(mutex_);
    reserved_ -= slab_bytes;
    throw;
  }
  std::lock_guard lock(mutex_);
  add_slab_locked(std::move(slab));
}

size_t SlabArena::room_locked() const {
  return cap_ == kNoCap ? SIZE_MAX - reserved_ : (cap_ > reserved_ ? cap_ - reserved_ : 0);
}

size_t SlabArena::largest_free_locked() const {
  size_t largest = 0;
  for (const auto& [start, range] : ranges_) largest = std::max(largest, range.bytes);
  return largest;
}

void* SlabArena::allocate(size_t requested) {
  if (requested == 0) return nullptr;
  if (requested > SIZE_MAX - kAlignment)
    throw Error("SlabArena(" + name_ + "): cannot allocate " + bytes_text(requested) + ": too large");
  const size_t bytes = round_up(requested);
  std::vector<std::unique_ptr<Slab>> unused;  // slabs with nothing taken, freed to make room under the cap
  size_t slab_bytes = 0;
  {
    std::lock_guard lock(mutex_);
    largest_request_ = std::max(largest_request_, bytes);
    if (char* p = take_locked(bytes)) return p;
    size_t room = room_locked();
    if (room < bytes) {
      size_t unused_bytes = 0;
      for (const auto& s : slabs_)
        if (s->used == 0) unused_bytes += s->bytes;
      if (room + unused_bytes < bytes)
        throw Error("SlabArena(" + name_ + "): cannot allocate " + bytes_text(requested) + ": the largest free range has " +
                    bytes_text(largest_free_locked()) + " and " + bytes_text(room + unused_bytes) +
                    " can still be reserved (cap " + bytes_text(cap_) + ", " + bytes_text(reserved_) + " reserved, " +
                    bytes_text(unused_bytes) + " of them in slabs with nothing taken)");
      // Frees just enough of the slabs with nothing taken: each is one free range of its own.
      for (auto it = slabs_.begin(); it != slabs_.end() && room < bytes;) {
        if ((*it)->used != 0) {
          ++it;
          continue;
        }
        const auto range = ranges_.find((*it)->base);
        LILY_CHECK(range != ranges_.end() && range->second.bytes == (*it)->bytes);
        ranges_.erase(range);
        reserved_ -= (*it)->bytes;
        room += (*it)->bytes;
        ++slab_frees_;
        unused.push_back(std::move(*it));
        it = slabs_.erase(it);
      }
    }
    slab_bytes = std::max(bytes, std::min(slab_bytes_, room));
    reserved_ += slab_bytes;
  }
  for (const auto& s : unused) free_(s->base, s->bytes);
  grow(slab_bytes);
  std::lock_guard lock(mutex_);
  char* p = take_locked(bytes);
  LILY_CHECK(p != nullptr);  // the new slab holds it
  return p;
}

void SlabArena::deallocate(void* block) {
  if (block == nullptr) return;
  char* p = static_cast<char*>(block);
  std::lock_guard lock(mutex_);
  const auto taken = taken_.find(p);
  if (taken == taken_.end())
    throw InternalError("SlabArena(" + name_ + "): deallocate of a block the arena did not hand out");
  Range range = taken->second;
  taken_.erase(taken);
  range.slab->used -= range.bytes;
  used_ -= range.bytes;
  // Merges with the free range after it and the one before it, when in the same slab.
  auto next = ranges_.lower_bound(p);
  if (next != ranges_.end() && next->first == p + range.bytes && next->second.slab == range.slab) {
    range.bytes += next->second.bytes;
    next = ranges_.erase(next);
  }
  if (next != ranges_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second.bytes == p && prev->second.slab == range.slab) {
      prev->second.bytes += range.bytes;
      return;
    }
  }
  ranges_.emplace_hint(next, p, range);
}

void SlabArena::reserve(size_t bytes) {
  while (true) {
    size_t slab_bytes = 0;
    {
      std::lock_guard lock(mutex_);
      const size_t target = std::min(bytes, cap_);
      if (reserved_ >= target) return;
      slab_bytes = std::min(slab_bytes_, room_locked());
      reserved_ += slab_bytes;
    }
    grow(slab_bytes);
  }
}

bool SlabArena::reserve_spare() noexcept {
  size_t slab_bytes = 0;
  {
    std::lock_guard lock(mutex_);
    if (largest_request_ == 0 || largest_free_locked() >= largest_request_) return false;
    const size_t room = room_locked();
    if (room < largest_request_) return false;
    slab_bytes = std::max(largest_request_, std::min(slab_bytes_, room));
    reserved_ += slab_bytes;
  }
  try {
    grow(slab_bytes);
  } catch (...) {
    return false;
  }
  return true;
}

SlabArena::Stats SlabArena::stats() const {
  std::lock_guard lock(mutex_);
  Stats s;
  for (const auto& slab : slabs_) s.reserved_bytes += slab->bytes;  // not the slabs still being allocated
  s.used_bytes = used_;
  s.largest_free = largest_free_locked();
  s.slabs = slabs_.size();
  s.slab_allocations = slab_allocations_;
  s.slab_frees = slab_frees_;
  s.blocks = taken_.size();
  return s;
}

}  // namespace lily
