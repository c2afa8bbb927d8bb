// SlabArena: blocks carved from slabs and merged back when given back, 256-byte alignment, the
// reuse of holes, the cap and its error, reserve / reserve_spare, ArenaBlock, and a two-thread
// smoke test; over a fake allocator that hands out slabs one after another from one buffer (so
// that two slabs may touch, and must still never merge) and counts its calls.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/slab_arena.h"

namespace lily {
namespace {

/// Slabs bumped from one 256-byte aligned buffer (a freed slab's bytes are not handed out
/// again), with counters; an allocation past the buffer, or any while `fail` is set, throws.
struct FakeSlabs {
  static constexpr size_t kBufferBytes = size_t{4} << 20;
  std::unique_ptr<char[]> storage = std::make_unique<char[]>(kBufferBytes + SlabArena::kAlignment);
  char* buffer = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(storage.get()) + SlabArena::kAlignment - 1) / SlabArena::kAlignment *
      SlabArena::kAlignment);
  size_t next = 0;
  int allocations = 0, frees = 0;
  size_t freed_bytes = 0;
  bool fail = false;

  std::shared_ptr<SlabArena> arena(size_t slab_bytes, size_t cap = SlabArena::kNoCap) {
    return std::make_shared<SlabArena>(
        [this](size_t bytes) -> void* {
          if (fail || next + bytes > kBufferBytes) throw Error("fake: out of memory");
          void* p = buffer + next;
          next += bytes;
          ++allocations;
          return p;
        },
        [this](void*, size_t bytes) {
          ++frees;
          freed_bytes += bytes;
        },
        slab_bytes, cap, "test memory");
  }
  /// Offset of `p` from the start of the first slab.
  size_t at(const void* p) const { return static_cast<size_t>(static_cast<const char*>(p) - buffer); }
};

TEST(SlabArena, CarvesBlocksFromOneSlabAndMergesThemBackWhenGivenBack) {
  FakeSlabs fake;
  auto arena = fake.arena(4096);
  void* a = arena->allocate(1000);
  void* b = arena->allocate(1024);
  void* c = arena->allocate(1000);
  EXPECT_EQ(fake.allocations, 1);
  EXPECT_EQ(fake.at(a), 0u);
  EXPECT_EQ(fake.at(b), 1024u);
  EXPECT_EQ(fake.at(c), 2048u);
  SlabArena::Stats s = arena->stats();
  EXPECT_EQ(s.reserved_bytes, 4096u);
  EXPECT_EQ(s.used_bytes, 3072u);
  EXPECT_EQ(s.largest_free, 1024u);
  EXPECT_EQ(s.blocks, 3u);

  arena->deallocate(b);  // a hole between a and c
  EXPECT_EQ(arena->stats().largest_free, 1024u);
  arena->deallocate(a);  // merges with the hole after it
  EXPECT_EQ(arena->stats().largest_free, 2048u);
  arena->deallocate(c);  // merges with the ranges before and after it: the whole slab again
  s = arena->stats();
  EXPECT_EQ(s.largest_free, 4096u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.slabs, 1u);  // kept

  void* whole = arena->allocate(4096);
  EXPECT_EQ(fake.at(whole), 0u);
  EXPECT_EQ(fake.allocations, 1);
  EXPECT_EQ(arena->allocate(0), nullptr);
  arena->deallocate(nullptr);
  arena->deallocate(whole);
  EXPECT_EQ(fake.frees, 0);
  arena.reset();  // frees the slab
  EXPECT_EQ(fake.frees, 1);
  EXPECT_EQ(fake.freed_bytes, 4096u);
}

TEST(SlabArena, AlignsEveryBlockTo256BytesAndCountsRoundedBytes) {
  FakeSlabs fake;
  auto arena = fake.arena(size_t{64} << 10);
  size_t expected_used = 0;
  for (size_t bytes : {1, 255, 256, 257, 1000, 3, 4097}) {
    void* p = arena->allocate(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u) << bytes << " bytes";
    std::memset(p, 0xab, bytes);
    expected_used += SlabArena::round_up(bytes);
  }
  EXPECT_EQ(arena->stats().used_bytes, expected_used);
  EXPECT_EQ(SlabArena::round_up(1), 256u);
  EXPECT_EQ(SlabArena::round_up(512), 512u);
  EXPECT_EQ(SlabArena::round_up(513), 768u);
  // The slab size is rounded up too, and a block larger than a slab gets a slab of its size.
  FakeSlabs fake2;
  auto odd = fake2.arena(1000);
  void* small = odd->allocate(10);
  void* big = odd->allocate(5000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big) % 256, 0u);
  EXPECT_EQ(fake2.allocations, 2);
  EXPECT_EQ(odd->stats().reserved_bytes, 1024u + 5120u);
  odd->deallocate(small);
  odd->deallocate(big);
}

TEST(SlabArena, ReusesHolesAfterFragmentationAndNeverMergesTwoSlabs) {
  FakeSlabs fake;
  auto arena = fake.arena(8192);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(arena->allocate(1024));
  EXPECT_EQ(fake.allocations, 1);
  for (int i = 0; i < 8; i += 2) arena->deallocate(blocks[i]);  // four holes of 1 KiB, none touching
  EXPECT_EQ(arena->stats().largest_free, 1024u);
  EXPECT_EQ(arena->stats().used_bytes, 4096u);

  void* wide = arena->allocate(2048);  // no hole holds it: a second slab, right after the first
  EXPECT_EQ(fake.allocations, 2);
  EXPECT_EQ(fake.at(wide), 8192u);
  void* hole = arena->allocate(1000);  // the best fit is a hole, not the second slab's rest
  EXPECT_EQ(fake.at(hole), 0u);
  EXPECT_EQ(fake.allocations, 2);

  // The last block of the first slab and the first of the second touch in memory but belong to
  // different slabs: given back, they stay two ranges.
  arena->deallocate(blocks[7]);
  arena->deallocate(wide);
  EXPECT_EQ(arena->stats().largest_free, 8192u);  // the second slab alone, whole again

  for (int i = 1; i < 7; i += 2) arena->deallocate(blocks[i]);
  arena->deallocate(hole);  // the first slab is whole again too
  const SlabArena::Stats s = arena->stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.largest_free, 8192u);
  void* again = arena->allocate(8192);  // the first slab, the lowest address among equal fits
  EXPECT_EQ(fake.at(again), 0u);
  EXPECT_EQ(fake.allocations, 2);
  arena->deallocate(again);
}

TEST(SlabArena, NoAllocatorCallOnceTheSlabHoldsTheWorkingSet) {
  FakeSlabs fake;
  auto arena = fake.arena(size_t{1} << 20);
  // A conversation's pattern: a fixed-size block and a growing one per copy, the oldest freed.
  std::vector<void*> live;
  for (int turn = 0; turn < 200; ++turn) {
    live.push_back(arena->allocate(63 * 1024));
    live.push_back(arena->allocate(static_cast<size_t>(1000 + 37 * (turn % 50))));
    if (live.size() > 6) {
      arena->deallocate(live[0]);
      arena->deallocate(live[1]);
      live.erase(live.begin(), live.begin() + 2);
    }
  }
  EXPECT_EQ(fake.allocations, 1);
  EXPECT_EQ(fake.frees, 0);
  for (void* p : live) arena->deallocate(p);
  EXPECT_EQ(arena->stats().largest_free, size_t{1} << 20);
}

TEST(SlabArena, RefusesPastTheCapNamingTheBytesAndStaysUsable) {
  FakeSlabs fake;
  auto arena = fake.arena(4096, 4096);
  void* a = arena->allocate(3000);
  try {
    arena->allocate(2000);
    FAIL() << "no error past the cap";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("test memory"), std::string::npos) << m;
    EXPECT_NE(m.find("cannot allocate 2000 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("largest free range has 1024 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("0 bytes can still be reserved"), std::string::npos) << m;
    EXPECT_NE(m.find("cap 4096 bytes"), std::string::npos) << m;
  }
  const SlabArena::Stats s = arena->stats();
  EXPECT_EQ(s.reserved_bytes, 4096u);
  EXPECT_EQ(s.used_bytes, 3072u);
  EXPECT_EQ(fake.allocations, 1);
  void* b = arena->allocate(1024);  // what is left still serves
  EXPECT_NE(b, nullptr);
  arena->deallocate(a);
  arena->deallocate(b);

  // A raised cap lets it reserve again; a lowered one keeps the slabs held.
  arena->set_cap(4096 + 8192);
  void* c = arena->allocate(8192);
  EXPECT_EQ(fake.allocations, 2);
  arena->set_cap(1024);
  EXPECT_EQ(arena->cap(), 1024u);
  EXPECT_EQ(arena->stats().reserved_bytes, 4096u + 8192u);
  arena->deallocate(c);
}

TEST(SlabArena, FreesSlabsWithNothingTakenToMakeRoomUnderTheCap) {
  FakeSlabs fake;
  auto arena = fake.arena(2048, 4096);
  void* a = arena->allocate(2048);
  void* b = arena->allocate(2048);
  EXPECT_EQ(fake.allocations, 2);
  arena->deallocate(a);
  arena->deallocate(b);
  // Neither 2 KiB slab holds 4 KiB, and a third slab would pass the cap: both go.
  void* big = arena->allocate(4096);
  EXPECT_EQ(fake.frees, 2);
  EXPECT_EQ(fake.allocations, 3);
  SlabArena::Stats s = arena->stats();
  EXPECT_EQ(s.slabs, 1u);
  EXPECT_EQ(s.reserved_bytes, 4096u);
  EXPECT_EQ(s.slab_frees, 2u);
  // A slab with a block taken is never freed: then it is an error.
  try {
    arena->allocate(256);
    FAIL() << "no error past the cap";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0 bytes of them in slabs with nothing taken"), std::string::npos) << e.what();
  }
  arena->deallocate(big);
}

TEST(SlabArena, AFailedSlabAllocationLeavesTheAccountingAsItWas) {
  FakeSlabs fake;
  auto arena = fake.arena(4096, 8192);
  fake.fail = true;
  EXPECT_THROW(arena->allocate(100), Error);
  EXPECT_THROW(arena->reserve(4096), Error);
  EXPECT_FALSE(arena->reserve_spare());
  EXPECT_EQ(arena->stats().reserved_bytes, 0u);
  fake.fail = false;
  void* a = arena->allocate(4096);  // the whole cap is still there to reserve
  void* b = arena->allocate(4096);
  EXPECT_EQ(fake.allocations, 2);
  arena->deallocate(a);
  arena->deallocate(b);
}

TEST(SlabArena, RefusesToGiveBackABlockItDidNotHandOut) {
  FakeSlabs fake;
  auto arena = fake.arena(4096);
  void* a = arena->allocate(512);
  int local = 0;
  EXPECT_THROW(arena->deallocate(&local), InternalError);
  EXPECT_THROW(arena->deallocate(static_cast<char*>(a) + 256), InternalError);
  arena->deallocate(a);
  EXPECT_THROW(arena->deallocate(a), InternalError);  // twice
  EXPECT_EQ(arena->stats().largest_free, 4096u);
}

TEST(SlabArena, ReserveAndReserveSpareMakeSlabsAheadWithinTheCap) {
  FakeSlabs fake;
  auto arena = fake.arena(4096, 3 * 4096 + 1000);  // the cap is rounded down to 256 bytes
  EXPECT_EQ(arena->cap(), 3u * 4096 + 768);
  arena->reserve(10000);
  EXPECT_EQ(fake.allocations, 3);
  EXPECT_EQ(arena->stats().reserved_bytes, 3u * 4096);
  arena->reserve(10000);  // held already
  EXPECT_EQ(fake.allocations, 3);
  arena->reserve(size_t{1} << 30);  // only up to the cap: a last slab of 768 bytes
  EXPECT_EQ(fake.allocations, 4);
  EXPECT_EQ(arena->stats().reserved_bytes, 3u * 4096 + 768);

  FakeSlabs fake2;
  auto spare = fake2.arena(4096);
  EXPECT_FALSE(spare->reserve_spare());  // nothing taken yet: no size to reserve for
  void* a = spare->allocate(4096);
  EXPECT_TRUE(spare->reserve_spare());  // the one slab is full: a second
  EXPECT_FALSE(spare->reserve_spare());  // now a 4 KiB block fits
  EXPECT_EQ(fake2.allocations, 2);
  void* b = spare->allocate(4096);
  EXPECT_EQ(fake2.allocations, 2);
  spare->set_cap(8192);
  EXPECT_FALSE(spare->reserve_spare());  // full again, and the cap allows no third
  EXPECT_EQ(fake2.allocations, 2);
  spare->deallocate(a);
  spare->deallocate(b);
}

TEST(SlabArena, ArenaBlockGivesItsBlockBackAndKeepsTheArenaAlive) {
  FakeSlabs fake;
  auto arena = fake.arena(4096);
  ArenaBlock a(arena, 1000);
  EXPECT_EQ(a.bytes(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 256, 0u);
  EXPECT_EQ(a.as<char>(), static_cast<char*>(a.data()));
  ArenaBlock empty(arena, 0);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.bytes(), 0u);
  ArenaBlock b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.bytes(), 1000u);
  EXPECT_EQ(arena->stats().blocks, 1u);
  ArenaBlock c(arena, 2000);
  b = std::move(c);  // b's old block goes back
  EXPECT_EQ(arena->stats().blocks, 1u);
  EXPECT_EQ(arena->stats().used_bytes, 2048u);
  empty.reset();
  arena.reset();  // b still holds the arena
  EXPECT_EQ(fake.frees, 0);
  b.reset();
  EXPECT_EQ(fake.frees, 1);
}

TEST(SlabArena, TwoThreadsTakeAndGiveBackAtOnce) {
  FakeSlabs fake;
  auto arena = fake.arena(size_t{256} << 10);
  // The first slab before the threads start: two first allocations at once would each find the
  // arena empty and each grow it (slabs are allocated outside the lock), a second slab this test
  // is not about.
  arena->deallocate(arena->allocate(1));
  std::atomic<int> corrupted{0};
  auto work = [&](unsigned char tag) {
    std::vector<std::pair<unsigned char*, size_t>> held;
    for (int i = 0; i < 3000; ++i) {
      const size_t bytes = 200 + static_cast<size_t>((i * 7919 + tag * 131) % 6000);
      auto* p = static_cast<unsigned char*>(arena->allocate(bytes));
      std::memset(p, tag, bytes);
      held.emplace_back(p, bytes);
      if (held.size() > 8 || i % 5 == 0) {
        auto [q, n] = held[static_cast<size_t>(i) % held.size()];
        for (size_t k = 0; k < n; k += 97)
          if (q[k] != tag) ++corrupted;  // another thread wrote into this block
        arena->deallocate(q);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(i) % held.size()));
      }
    }
    for (auto [q, n] : held) arena->deallocate(q);
  };
  std::thread t1(work, static_cast<unsigned char>(1)), t2(work, static_cast<unsigned char>(2));
  t1.join();
  t2.join();
  EXPECT_EQ(corrupted.load(), 0);
  const SlabArena::Stats s = arena->stats();
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.slabs, 1u);  // 2 × 9 blocks of < 6.2 KiB never need a second 256 KiB slab
  EXPECT_EQ(s.largest_free, size_t{256} << 10);
}

}  // namespace
}  // namespace lily
