// The synchronisation of a persistent kernel's task list (decode_program.h): blocks take tasks in
// list order from one fetch counter, wait on counters that earlier tasks signal, and signal their
// own when done. Counters only grow: in launch e (0, 1, …) a task waits for (e + 1) · its target,
// so nothing is reset between launches or graph replays.
//
// Memory ordering, at GPU scope: a signal is a fence followed by an atomic add by one thread after
// a block barrier, so every global write of the block before it is visible to a block that sees
// the count; a wait is an acquire load by one thread followed by a block barrier. Data written by
// other blocks must then be read past L1 (ld.global.cg, bulk copies), which is not coherent.
#pragma once
#include <cstdint>

namespace lily::cuda {

/// This block's next task: thread 0 takes it with one atomic add on `next`, which counts every
/// fetch since the counter was zeroed; `base` is its value when this launch began (launch e of a
/// list of n tasks on G blocks: e · (n + G), every block fetching once past the end). `slot` is a
/// __shared__ int64_t. All threads of the block call it and get the same index.
__device__ __forceinline__ int64_t task_fetch(unsigned long long* next, unsigned long long base, int64_t* slot) {
  __syncthreads();  // every thread has read the last index
  if (threadIdx.x == 0) *slot = static_cast<int64_t>(atomicAdd(next, 1ull) - base);
  __syncthreads();
  return *slot;
}

/// Waits until counter `c` has reached `target` (compared modulo 2³², so counters may wrap).
/// Acquire: what the signalling blocks wrote before their signals is visible to this block
/// afterwards. All threads of the block.
__device__ __forceinline__ void counter_wait(const uint32_t* c, uint32_t target) {
  if (threadIdx.x == 0) {
    uint32_t seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
    } while (static_cast<int32_t>(seen - target) < 0);
  }
  __syncthreads();
}

/// Adds this block's one signal to counter `c`. Release: every global write the block made
/// before the call is visible to a block whose counter_wait sees the signal. All threads.
__device__ __forceinline__ void counter_signal(uint32_t* c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1u);
  }
}

}  // namespace lily::cuda
