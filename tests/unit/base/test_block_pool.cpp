// BlockPool: reuse by exact size, the bound on idle bytes, the retry after a failed allocation,
// and PooledBlock's give-back; over a counting fake allocator.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>

#include "base/block_pool.h"
#include "base/error.h"

namespace lily {
namespace {

/// malloc / free with counters, and a cap on the bytes out at once (an allocation past it throws,
/// as cudaMalloc fails when the device is full).
struct FakeAllocator {
  size_t cap = SIZE_MAX;
  size_t out_bytes = 0;
  int allocations = 0, frees = 0;
  std::set<void*> live;

  std::shared_ptr<BlockPool> pool(size_t max_idle) {
    return std::make_shared<BlockPool>(
        [this](size_t bytes) -> void* {
          if (out_bytes + bytes > cap) throw Error("fake: out of memory");
          void* p = std::malloc(bytes);
          out_bytes += bytes;
          ++allocations;
          live.insert(p);
          sizes[p] = bytes;
          return p;
        },
        [this](void* p, size_t bytes) {
          EXPECT_EQ(bytes, sizes[p]);  // the size it was allocated with
          out_bytes -= sizes[p];
          ++frees;
          live.erase(p);
          std::free(p);
        },
        max_idle);
  }
  std::map<void*, size_t> sizes;
};

TEST(BlockPool, ReusesAGivenBlockOfTheSameSizeOnly) {
  FakeAllocator fake;
  auto pool = fake.pool(1000);
  void* a = pool->take(100);
  EXPECT_EQ(fake.allocations, 1);
  pool->give(a, 100);
  EXPECT_EQ(pool->idle_bytes(), 100u);
  void* b = pool->take(200);  // another size: a new block
  EXPECT_NE(b, a);
  EXPECT_EQ(fake.allocations, 2);
  void* c = pool->take(100);  // the idle one
  EXPECT_EQ(c, a);
  EXPECT_EQ(fake.allocations, 2);
  EXPECT_EQ(pool->allocations(), 2u);
  EXPECT_EQ(pool->idle_bytes(), 0u);
  EXPECT_EQ(pool->take(0), nullptr);
  EXPECT_EQ(fake.allocations, 2);
  pool->give(b, 200);
  pool->give(c, 100);
  pool->give(nullptr, 0);
  EXPECT_EQ(fake.frees, 0);
  pool.reset();  // frees the idle blocks
  EXPECT_EQ(fake.frees, 2);
  EXPECT_TRUE(fake.live.empty());
}

TEST(BlockPool, KeepsAtMostItsBoundIdleFreeingTheLeastRecentlyGiven) {
  FakeAllocator fake;
  auto pool = fake.pool(250);
  void* a = pool->take(100);
  void* b = pool->take(100);
  void* c = pool->take(100);
  void* big = pool->take(300);
  pool->give(a, 100);
  pool->give(b, 100);
  EXPECT_EQ(fake.frees, 0);
  pool->give(c, 100);  // 300 idle > 250: a, the least recently given, goes
  EXPECT_EQ(fake.frees, 1);
  EXPECT_EQ(fake.live.count(a), 0u);
  EXPECT_EQ(pool->idle_bytes(), 200u);
  pool->give(big, 300);  // larger than the bound: freed at once, the others stay
  EXPECT_EQ(fake.frees, 2);
  EXPECT_EQ(pool->idle_bytes(), 200u);
  EXPECT_EQ(pool->take(100), c);  // the most recently given first
  pool->give(c, 100);
  pool->release_idle();
  EXPECT_EQ(pool->idle_bytes(), 0u);
  EXPECT_TRUE(fake.live.empty());
}

TEST(BlockPool, FreesIdleBlocksAndRetriesWhenAnAllocationFails) {
  FakeAllocator fake;
  fake.cap = 300;
  auto pool = fake.pool(1000);
  void* a = pool->take(100);
  void* b = pool->take(100);
  pool->give(a, 100);
  pool->give(b, 100);
  void* c = pool->take(250);  // 200 idle + 250 > 300: the idle blocks are freed, then it fits
  EXPECT_NE(c, nullptr);
  EXPECT_EQ(pool->idle_bytes(), 0u);
  EXPECT_EQ(fake.frees, 2);
  EXPECT_THROW(pool->take(100), Error);  // nothing idle to free: the failure stands
  pool->give(c, 250);
}

TEST(BlockPool, PooledBlockGivesBackAndKeepsThePoolAlive) {
  FakeAllocator fake;
  auto pool = fake.pool(1000);
  void* first = nullptr;
  {
    PooledBlock x(pool, 64);
    first = x.data();
    EXPECT_EQ(x.bytes(), 64u);
    EXPECT_EQ(x.as<char>(), static_cast<char*>(first));
    PooledBlock y(std::move(x));
    EXPECT_EQ(x.data(), nullptr);
    EXPECT_EQ(y.data(), first);
    PooledBlock z;
    z = std::move(y);
    EXPECT_EQ(z.bytes(), 64u);
  }
  EXPECT_EQ(pool->idle_bytes(), 64u);
  PooledBlock again(pool, 64);
  EXPECT_EQ(again.data(), first);
  PooledBlock empty(pool, 0);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.bytes(), 0u);
  pool.reset();  // `again` still holds the pool
  EXPECT_EQ(fake.frees, 0);
  again.reset();
  empty.reset();
  EXPECT_EQ(fake.frees, 1);  // the last handle gone: the pool and its idle block with it
  EXPECT_TRUE(fake.live.empty());
}

TEST(BlockPool, LargeBlocksAreReusedWithinTheirSizeClass) {
  EXPECT_EQ(BlockPool::size_class(1000), 1000u);  // small sizes are exact
  EXPECT_EQ(BlockPool::size_class(size_t{64} << 10), size_t{64} << 10);
  const size_t mib = size_t{1} << 20;
  EXPECT_EQ(BlockPool::size_class(64 * mib), 64 * mib);
  EXPECT_EQ(BlockPool::size_class(64 * mib + 1), 72 * mib);  // eighths of the power of two below
  EXPECT_EQ(BlockPool::size_class(100 * mib), 104 * mib);
  for (size_t b : {size_t{70000}, 3 * mib + 5, 150 * mib + 77}) {
    EXPECT_GE(BlockPool::size_class(b), b);
    EXPECT_LE(BlockPool::size_class(b), b + b / 8);
  }
  FakeAllocator fake;
  auto pool = fake.pool(SIZE_MAX);
  void* turn1 = pool->take(100 * mib + 4096);  // a state's KV, then a slightly longer one
  EXPECT_EQ(fake.sizes[turn1], 104 * mib);
  pool->give(turn1, 100 * mib + 4096);
  EXPECT_EQ(pool->idle_bytes(), 104 * mib);
  EXPECT_EQ(pool->take(101 * mib), turn1);  // the same class: no new allocation
  EXPECT_EQ(fake.allocations, 1);
  void* other = pool->take(120 * mib);  // another class
  EXPECT_NE(other, turn1);
  EXPECT_EQ(fake.allocations, 2);
  pool->give(turn1, 101 * mib);
  pool->give(other, 120 * mib);
}

}  // namespace
}  // namespace lily
