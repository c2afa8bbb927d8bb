// The tensor-core instruction shared by the prefill GEMM (quant_gemm.cu) and the decode GEMV
// (quant_gemv.cu): mma.sync m16n8k16, bf16 inputs, fp32 accumulation (nvcc only).
#pragma once
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

}  // namespace lily::cuda
