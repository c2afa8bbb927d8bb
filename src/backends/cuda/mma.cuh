// The tensor-core and copy instructions shared by the prefill GEMM (quant_gemm.cu), the decode
// GEMV (quant_gemv.cu) and flash attention (flash_prefill.cu): mma.sync m16n8k16 with bf16
// inputs and fp32 accumulation, ldmatrix, cp.async (nvcc only); and mma.sync m16n8k8 with tf32
// inputs plus the split of fp32 into two tf32 parts (the GDN prefill's pass 2, gdn.cu).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace lily::cuda {

/// D = A·B + D for one m16n8k16 tile: bf16 inputs, fp32 accumulators (PTX ISA fragment layout:
/// a[0] = (row g, k 2t..2t+1), a[1] = (g+8, 2t), a[2] = (g, 2t+8), a[3] = (g+8, 2t+8);
/// b[0] = (k 2t..2t+1, col g), b[1] = (k 2t+8.., g); d[0..1] = (g, 2t..2t+1), d[2..3] = (g+8, ..),
/// with g = lane/4, t = lane%4; the lower k/col index in the lower 16 bits).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// D = A·B + D for one m16n8k8 tile: tf32 inputs (32-bit registers in tf32 form, low 13 mantissa
/// bits zero: to_tf32, split_tf32, bf16_bits_to_tf32), fp32 accumulators. PTX ISA fragment layout, g = lane/4,
/// t = lane%4: a[0] = (row g, k t), a[1] = (g+8, t), a[2] = (g, t+4), a[3] = (g+8, t+4);
/// b[0] = (k t, col g), b[1] = (k t+4, col g); d[0..1] = (g, 2t..2t+1), d[2..3] = (g+8, 2t..2t+1).
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// fp32 → tf32 (round to nearest, ties away from zero; the low 13 mantissa bits cleared), as
/// the 32-bit register an mma operand takes.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

/// The split of an fp32 value into two tf32 parts, x ≈ hi + lo: hi = tf32(x), lo = tf32(x − hi)
/// (x − hi is exact in fp32). |x − hi − lo| ≤ 2^-22·|x| or so: products formed as
/// hi·hi' + hi·lo' + lo·hi' keep close to fp32 accuracy (the dropped lo·lo' is ~2^-22 relative).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}

/// A bf16 bit pattern as a tf32 operand register: exact (bf16's 8-bit significand fits tf32's 11).
__device__ __forceinline__ uint32_t bf16_bits_to_tf32(uint16_t bits) { return uint32_t(bits) << 16; }

/// Two fp32 → packed bf16x2 (each rounded to nearest even; `lo` in the low half, the lower k
/// index of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

/// Four 8×8 bf16 matrices from shared memory: lane i gives the address of row i % 8 of matrix
/// i / 8; r[j] is this lane's fragment of matrix j (row lane/4, columns 2·(lane%4) …+1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
/// As ldmatrix_x4, each matrix transposed: r[j] holds (row 2·(lane%4) …+1, column lane/4) of
/// matrix j (the B fragment of a row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}

/// 16-byte global → shared async copy; src_bytes = 0 writes 16 zero bytes (masked rows).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
/// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/// Waits until at most N of this thread's committed cp.async groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace lily::cuda
