// The synchronisation of a persistent kernel's task list (decode_program.h). The schedule is
// static: block b of G runs tasks b, b + G, b + 2G, … of the list, in that order, so a stage's
// tasks sit on distinct blocks and each block knows its future tasks (their weights can be
// copied in early). Tasks wait on counters that earlier tasks signal, and signal their own when
// done. Counters only grow: launch e waits for (e + 1) · a counter's producer count, and each
// block keeps its launch number e in a per-block epoch in device memory, which it reads at the
// start of a launch and advances at its end. Nothing is reset between launches, and a captured
// graph replays correctly with fixed arguments. One instance of a program runs at a time on one
// set of counters: launches of it follow each other on one stream, without programmatic
// dependent launch between them.
//
// Deadlock freedom: the list is a topological order of the waits (check_decode_program), and
// all G blocks are resident at once (one per SM). Take the lowest unfinished task: its
// producers are earlier in the list, so finished; its block's earlier tasks are lower, so
// finished; so its block is running it, and it finishes.
//
// Memory ordering, at GPU scope: a signal is a block barrier and a release reduction by one
// thread, so every global write of the block before it is visible to a block that sees the count;
// a wait is an acquire load by one thread followed by a block barrier. Data written by other
// blocks must then be read past L1 (ld.global.cg, bulk copies), which is not coherent.
#pragma once
#include <cstdint>

namespace lily::cuda {

/// This block's launch number (its epoch in `epochs`, uint32 [gridDim.x], zero before the first
/// launch, never reset): thread 0 reads it, every thread of the block gets it through `slot` (a
/// __shared__ uint32_t). All threads. The previous launch's task_launch_end wrote it, and kernel
/// boundaries order that write before this read.
__device__ __forceinline__ uint32_t task_launch_begin(const uint32_t* epochs, uint32_t* slot) {
  if (threadIdx.x == 0) *slot = epochs[blockIdx.x];
  __syncthreads();
  return *slot;
}

/// Advances this block's epoch past `launch` (task_launch_begin's value). All threads, after the
/// block's last task; thread 0 writes.
__device__ __forceinline__ void task_launch_end(uint32_t* epochs, uint32_t launch) {
  if (threadIdx.x == 0) epochs[blockIdx.x] = launch + 1;
}

/// How long counter_wait spins before it gives up with a trap (a missing producer would
/// otherwise hang the device): 5 s, far above any decode step.
constexpr uint64_t kCounterWaitTimeoutNs = 5'000'000'000ull;

/// Waits until counter `c` has reached `target` (compared modulo 2³², so counters may wrap).
/// Acquire: what the signalling blocks wrote before their signals is visible to this block
/// afterwards. Traps after kCounterWaitTimeoutNs. All threads of the block.
__device__ __forceinline__ void counter_wait(const uint32_t* c, uint32_t target) {
  if (threadIdx.x == 0) {
    uint32_t seen = 0;
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
      if (static_cast<int32_t>(seen - target) >= 0) break;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > kCounterWaitTimeoutNs) __trap();
    }
  }
  __syncthreads();
}

/// Adds this block's one signal to counter `c`. Release: every global write the block made
/// before the call is visible to a block whose counter_wait sees the signal (the barrier orders
/// the block's writes before thread 0's release reduction, which is cumulative). All threads;
/// thread 0 does not wait for the reduction to complete.
__device__ __forceinline__ void counter_signal(uint32_t* c) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}

}  // namespace lily::cuda
