#include "base/malloc_arenas.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace lily {

bool cap_malloc_arenas(int n) {
#if defined(__GLIBC__) && defined(M_ARENA_MAX)
  if (n < 1) return false;
  return ::mallopt(M_ARENA_MAX, n) == 1;
#else
  (void)n;
  return false;
#endif
}

int malloc_arena_count() {
#if defined(__GLIBC__)
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = ::open_memstream(&buf, &len);
  if (f == nullptr) return -1;
  const int rc = ::malloc_info(0, f);
  std::fclose(f);
  int count = -1;
  if (rc == 0 && buf != nullptr) {
    count = 0;
    // One <heap nr="…"> element per arena.
    for (const char* p = buf; (p = std::strstr(p, "<heap nr=")) != nullptr; p += 9) ++count;
  }
  std::free(buf);
  return count;
#else
  return -1;
#endif
}

}  // namespace lily
