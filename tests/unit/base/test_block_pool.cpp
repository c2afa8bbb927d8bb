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

  std::shared_ptr<BlockPool> pool(size_t max_idle, BlockPool::Prepare prepare = {}) {
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
        max_idle, std::move(prepare));
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

TEST(BlockPool, RefillMakesSparesForTheSizesTakenWithinTheIdleBound) {
  FakeAllocator fake;
  std::vector<size_t> prepared;
  auto pool = fake.pool(1000, [&](void*, size_t bytes) { prepared.push_back(bytes); });
  EXPECT_FALSE(pool->refill_one());  // nothing taken: no demand
  // A turn takes three blocks of 100 and one of 300, then gives one of 100 back.
  void* a = pool->take(100);
  void* b = pool->take(100);
  void* c = pool->take(100);
  void* d = pool->take(300);
  pool->give(a, 100);
  EXPECT_EQ(fake.allocations, 4);
  // Spares up to what was taken of each size: two more of 100 (one is idle already), one of 300.
  int pieces = 0;
  while (pool->refill_one()) ++pieces;
  EXPECT_EQ(pieces, 3);
  EXPECT_EQ(fake.allocations, 7);
  EXPECT_EQ(prepared, (std::vector<size_t>{100, 100, 300}));  // each spare prepared once
  EXPECT_EQ(pool->idle_bytes(), 600u);
  EXPECT_FALSE(pool->refill_one());  // the demand is met and forgotten
  // The next turn's takes of those sizes allocate nothing.
  void* e = pool->take(100);
  void* f = pool->take(100);
  void* g = pool->take(300);
  EXPECT_EQ(fake.allocations, 7);
  pool->give(b, 100), pool->give(c, 100), pool->give(d, 300), pool->give(e, 100), pool->give(f, 100);
  EXPECT_EQ(pool->idle_bytes(), 800u);  // with the spare of 100 not taken
  pool->give(g, 300);  // 1100 idle: the least recently given (that spare) is freed
  EXPECT_EQ(pool->idle_bytes(), 1000u);
  void* h = pool->take(300);
  void* i = pool->take(300);
  EXPECT_EQ(fake.allocations, 7);
  EXPECT_EQ(pool->idle_bytes(), 400u);
  void* j = pool->take(300);  // a third: allocated; demand now 3 × 300 with none idle
  EXPECT_EQ(fake.allocations, 8);
  while (pool->refill_one()) {
  }
  EXPECT_EQ(pool->idle_bytes(), 1000u);  // 400 + two spares of 300 fit; a third would not
  EXPECT_EQ(fake.allocations, 10);
  pool->give(h, 300), pool->give(i, 300), pool->give(j, 300);
}

TEST(BlockPool, RefillStopsQuietlyWhenAnAllocationFails) {
  FakeAllocator fake;
  auto pool = fake.pool(1000);
  void* a = pool->take(200);
  fake.cap = 300;  // room for 100 more bytes only
  EXPECT_FALSE(pool->refill_one());  // the spare cannot be allocated: no error, no spare
  EXPECT_EQ(pool->idle_bytes(), 0u);
  EXPECT_FALSE(pool->refill_one());  // and the demand is forgotten
  pool->give(a, 200);
}

}  // namespace
}  // namespace lily
