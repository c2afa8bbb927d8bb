// Hopper bulk copies (the TMA unit's 1-D form) and the shared-memory barriers they complete on
// (nvcc only, sm_90). A bulk copy moves a contiguous run of global memory into shared memory
// without registers or per-thread load instructions; its completion is counted in bytes on an
// mbarrier, so a consumer waits for "these N bytes have landed" instead of for its own loads.
// That decouples the bytes in flight from the registers and warps a kernel has: a ring of a few
// 16–40 KB stages keeps an SM's share of the memory bandwidth busy with one thread issuing.
//
// Rules the helpers rely on (PTX ISA, mbarrier and cp.async.bulk):
//  - source and destination 16-byte aligned, sizes a multiple of 16 bytes;
//  - a barrier's phase completes when its pending arrivals reach zero and its transaction count
//    is back to zero; the count may go negative while bytes land before the arrival that
//    announces them;
//  - a waiter names the phase by its parity, so it must never fall two phases behind;
//  - shared memory that was read by ordinary loads is refilled by a bulk copy only after a
//    barrier orders those loads before the copy, plus fence.proxy.async (the copy engine is a
//    different memory proxy).
#pragma once
#include <cstdint>

namespace lily::cuda {

/// The shared-state-space address of a pointer into this block's shared memory.
__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Initialises the mbarrier at `bar` (8 bytes of shared memory, 8-byte aligned) so that each
/// phase completes after `arrivals` arrivals and all expected transaction bytes.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(bar)), "r"(arrivals) : "memory");
}

/// Makes barrier initialisation visible to the copy engine; a __syncthreads() must follow before
/// other threads use the barriers.
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

/// One arrival (release: this thread's earlier memory accesses happen before the phase completes).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_addr(bar)) : "memory");
}

/// One arrival that also announces `bytes` more transaction bytes for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)), "r"(bytes)
               : "memory");
}

/// Blocks until the phase of parity `parity` (0 for the first phase, then alternating) of `bar`
/// has completed (acquire: what the arrivals released is visible afterwards).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = shared_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

/// Orders this thread's (and, after a barrier, other threads') ordinary shared-memory accesses
/// before later bulk copies into the same memory.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/// Starts a bulk copy of `bytes` (a multiple of 16) from global `src` to shared `dst` (both
/// 16-byte aligned); its bytes count against the current phase of `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_addr(dst)),
               "l"(src), "r"(bytes), "r"(shared_addr(bar))
               : "memory");
}

}  // namespace lily::cuda
