// Host state memory: huge-page-aligned anonymous blocks, their pool, and PoolAllocator's reuse
// of given-back blocks (the CPU backend's states take their large buffers this way).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "base/host_memory.h"

namespace lily {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(HostMemory, BlocksAreZeroedWritableAndLargeOnesHugePageAligned) {
  for (size_t bytes : {size_t{1}, size_t{5000}, kMiB, 2 * kMiB, 3 * kMiB + 123, 16 * kMiB}) {
    auto* p = static_cast<unsigned char*>(map_host_block(bytes));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u) << bytes;
    if (bytes >= 2 * kMiB) EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (2 * kMiB), 0u) << bytes;
    EXPECT_EQ(p[0], 0);
    EXPECT_EQ(p[bytes - 1], 0);
    std::memset(p, 0xab, bytes);  // every byte of it is ours
    EXPECT_EQ(p[bytes / 2], 0xab);
    unmap_host_block(p, bytes);
  }
}

TEST(HostMemory, PoolAllocatorReusesGivenBackBlocksForLargeArraysOnly) {
  auto pool = make_host_block_pool(64 * kMiB);
  const PoolAllocator<float> alloc(pool);
  using Buffer = std::vector<float, PoolAllocator<float>>;
  const float* first = nullptr;
  {
    Buffer a(alloc);
    a.assign(kMiB, 1.0f);  // 4 MiB: from the pool
    first = a.data();
    EXPECT_EQ(pool->allocations(), 1u);
  }
  EXPECT_EQ(pool->idle_bytes(), BlockPool::size_class(4 * kMiB));
  Buffer b(alloc);
  b.assign(kMiB - 100, 2.0f);  // the same size class: the same block, no new mapping
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(pool->allocations(), 1u);
  EXPECT_EQ(b[kMiB - 101], 2.0f);
  Buffer small(alloc);
  small.assign(100, 3.0f);  // below kMinPooledBytes: operator new, the pool untouched
  EXPECT_EQ(pool->allocations(), 1u);
  // Copies share the pool; an allocator without one never touches a pool.
  Buffer copy(b);
  EXPECT_EQ(copy.get_allocator(), alloc);
  EXPECT_EQ(pool->allocations(), 2u);
  std::vector<float, PoolAllocator<float>> plain;
  plain.assign(kMiB, 1.0f);
  EXPECT_EQ(plain.get_allocator().pool(), nullptr);
  EXPECT_FALSE(plain.get_allocator() == alloc);
  EXPECT_EQ(pool->allocations(), 2u);
}

}  // namespace
}  // namespace lily
