// Hopper warpgroup MMA (wgmma, sm_90a) for the prefill GEMM (quant_gemm.cu): the A operand
// (64 rows × 16 k, bf16) from registers, the B operand (16 k × N, bf16) from shared memory
// through a matrix descriptor, fp32 accumulators in registers. nvcc only.
//
// Rules these helpers rely on (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply"):
//  * the four warps of a warpgroup (128 consecutive threads, the first a multiple of 128) issue
//    each wgmma together; it runs asynchronously until a wgmma_wait that covers its group;
//  * wgmma_fence() comes before the first wgmma that reads registers (A fragments,
//    accumulators) written by ordinary instructions;
//  * the A registers and accumulators of an in-flight wgmma are not touched until a
//    wgmma_wait retires its group (ptxas keeps them live);
//  * wgmma reads shared memory through the async proxy: data written there by st.shared or
//    cp.async needs fence_proxy_async() by the writing thread, then a barrier, before a wgmma
//    reads it.
#pragma once
#include <cstdint>

namespace lily::cuda {

/// Matrix descriptor of a K-major bf16 tile in shared memory with the 128-byte swizzle: rows of
/// 64 bf16 (128 bytes) one after another, 16-byte chunk c of row r stored at chunk c ^ (r mod 8),
/// groups of 8 rows 1,024 bytes apart, the tile's base 1,024-byte aligned. `smem_addr` is the
/// shared-window byte address of the wgmma's first row and k offset (base + row·128 + k·2, k a
/// multiple of 16: the hardware applies the swizzle to the computed address, so a k step inside
/// the 128-byte row is a plain offset of the start address).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t smem_addr) {
  uint64_t d = (smem_addr >> 4) & 0x3FFFu;  // start address, 16-byte units
  d |= uint64_t(1) << 16;                   // leading byte offset: unused for swizzled K-major
  d |= uint64_t(1024 >> 4) << 32;           // stride byte offset: 8 rows × 128 bytes
  d |= uint64_t(1) << 62;                   // layout: 128-byte swizzle
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/// Waits until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Orders this thread's earlier generic-proxy shared-memory writes (st.shared, cp.async once
/// waited for) before later async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/// Tells the compiler the accumulators may have changed (after a wgmma_wait): no read of them
/// is moved above this point.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// d[64 × 64] += A[64 × 16] · B[16 × 64], fp32 accumulators, bf16 inputs. A from registers in
/// the m16n8k16 A layout per warp (warp w of the warpgroup holds rows 16w … 16w + 15: a[0] =
/// (row g, k 2t, 2t+1), a[1] = (g + 8, 2t), a[2] = (g, 2t + 8), a[3] = (g + 8, 2t + 8); g = lane/4,
/// t = lane%4); B by `desc_b` (K-major: 64 rows of N, each 16 k). d[4j + v] = (row 16w + g +
/// 8·(v/2), column 8j + 2t + v%2), as eight m16n8 accumulators side by side.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

/// wgmma_m64n64k16_rs over the first N columns only (N = 16, 32, 48 or 64): d[4j + v] for
/// j < N/8, the later accumulators untouched. The token blocks of a grouped GEMM are rarely
/// full; this computes what a partial block needs, rounded up to 16.
template <int N>
__device__ __forceinline__ void wgmma_m64nk16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 16 || N == 32 || N == 48 || N == 64, "wgmma_m64nk16_rs: N is 16, 32, 48 or 64");
  if constexpr (N == 64) {
    wgmma_m64n64k16_rs(d, a, desc_b);
  } else if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else if constexpr (N == 32) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
}

}  // namespace lily::cuda
