// glibc malloc arenas: each thread that allocates gets an arena of its own (up to 8 per core), and
// an arena keeps what was freed in it, so concurrent large request bodies on many connection
// threads make the resident memory step up and stay up. `lily serve` caps them at
// start-up (--malloc-arenas, docs/server.md).
#pragma once

namespace lily {

/// Caps glibc's malloc arenas at `n` ≥ 1 (mallopt(M_ARENA_MAX)). Takes effect only when called
/// before other threads allocate (glibc fixes its limit when the first extra arena is needed),
/// so call it first thing. Returns false where the allocator ignores it (a sanitizer's
/// allocator, a libc other than glibc).
bool cap_malloc_arenas(int n);

/// The number of arenas glibc's malloc has created so far (its malloc_info report), or -1 when
/// unknown. Under a sanitizer the report describes glibc's allocator, which is not the one in use.
int malloc_arena_count();

}  // namespace lily
