// map_host_block: anonymous mappings, trimmed to a 2 MiB boundary for the large ones so that
// transparent huge pages can back them whole. Under AddressSanitizer the blocks come from the
// (instrumented) heap instead, so that an access past a state buffer is still reported.
#include "base/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "base/error.h"

#if defined(__SANITIZE_ADDRESS__)
#define LILY_HOST_MEMORY_FROM_HEAP 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LILY_HOST_MEMORY_FROM_HEAP 1
#endif
#endif

#ifdef LILY_HOST_MEMORY_FROM_HEAP
#include <cstdlib>
#endif

namespace lily {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t page_size() {
  static const size_t page = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return page;
}

size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

}  // namespace

void* map_host_block(size_t bytes) {
#ifdef LILY_HOST_MEMORY_FROM_HEAP
  void* block = std::aligned_alloc(bytes >= kHugePage ? kHugePage : page_size(),
                                   round_up(bytes, bytes >= kHugePage ? kHugePage : page_size()));
  if (block == nullptr) throw Error("cannot allocate " + std::to_string(bytes) + " bytes of host memory");
  return std::memset(block, 0, bytes);
#else
  const size_t length = round_up(bytes, page_size());
  const bool huge = length >= kHugePage;
  // A huge-page block is mapped one huge page longer, then cut to start on a 2 MiB boundary.
  const size_t mapped = huge ? length + kHugePage : length;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error("cannot map " + std::to_string(bytes) + " bytes of host memory: " + std::strerror(errno));
  if (!huge) return p;
  const auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = round_up(base, kHugePage);
  if (aligned > base) munmap(p, aligned - base);
  const size_t tail = base + mapped - (aligned + length);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + length), tail);
#ifdef MADV_HUGEPAGE
  (void)madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);  // a hint: its failure changes nothing
#endif
  return reinterpret_cast<void*>(aligned);
#endif
}

void unmap_host_block(void* block, size_t bytes) noexcept {
#ifdef LILY_HOST_MEMORY_FROM_HEAP
  (void)bytes;
  std::free(block);
#else
  if (block != nullptr) munmap(block, round_up(bytes, page_size()));
#endif
}

std::shared_ptr<BlockPool> make_host_block_pool(size_t max_idle_bytes) {
  // A spare block's pages are touched when it is made, so that its first use faults nothing.
  return std::make_shared<BlockPool>(map_host_block, unmap_host_block, max_idle_bytes,
                                     [](void* block, size_t bytes) { std::memset(block, 0, bytes); });
}

}  // namespace lily
