// cap_malloc_arenas (what `lily serve --malloc-arenas` calls first thing): with the cap, threads
// that allocate at the same time share at most that many glibc arenas; without it (a forked
// child of this still single-threaded process, so the default is measured on the same machine)
// they get one each. Not built under a sanitizer: its allocator replaces glibc's, which is then
// neither capped nor reported (malloc_info describes glibc's unused arenas).
#include <gtest/gtest.h>

#if !defined(__SANITIZE_ADDRESS__)
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <cstdlib>
#include <thread>
#include <vector>

#include "base/malloc_arenas.h"

namespace lily {
namespace {

/// Arenas in use once `threads` threads each hold an allocation at the same time.
int arenas_with_concurrent_threads(int threads) {
  std::barrier sync(threads + 1);
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&sync] {
      void* p = std::malloc(64 * 1024);
      static_cast<volatile char*>(p)[0] = 1;
      sync.arrive_and_wait();  // all hold theirs
      sync.arrive_and_wait();  // counted
      std::free(p);
    });
  sync.arrive_and_wait();
  const int n = malloc_arena_count();
  sync.arrive_and_wait();
  for (auto& t : pool) t.join();
  return n;
}

// One test per process: glibc fixes its arena limit once, so the uncapped control runs in a
// child forked before this process has started any thread.
TEST(MallocArenas, TheCapBoundsTheArenasOfConcurrentThreads) {
  constexpr int kThreads = 12;
  // glibc reads it at start-up, before this test could undo it: the control would be capped too.
  ASSERT_EQ(std::getenv("MALLOC_ARENA_MAX"), nullptr) << "run without MALLOC_ARENA_MAX: the test measures glibc's default";
  ASSERT_GE(malloc_arena_count(), 1) << "malloc_info gave no arenas";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(arenas_with_concurrent_threads(kThreads));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  const int uncapped = WEXITSTATUS(status);
  EXPECT_GT(uncapped, 2) << "glibc's default gave the threads no arenas of their own";

  ASSERT_TRUE(cap_malloc_arenas(2));
  EXPECT_LE(arenas_with_concurrent_threads(kThreads), 2);
  EXPECT_FALSE(cap_malloc_arenas(0));
}

}  // namespace
}  // namespace lily
#endif
