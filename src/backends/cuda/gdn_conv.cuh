// The GDN causal-conv decode step of one channel (docs/model.md §3.3 step 2), shared by the
// stand-alone conv kernels (gdn.cu) and the in-projection GEMV's conv epilogue (quant_gemv.cu),
// so that both give bit-identical results (nvcc only).
#pragma once
#include "backends/cuda/common.cuh"

namespace lily::cuda {

/// GDN conv kernel width K (docs/model.md §3.3; gdn_dims() rejects any other).
constexpr int kGdnConvK = 4;

/// silu with the precise exp (matches the CPU reference's std::exp to an ulp).
__device__ __forceinline__ float silu_precise(float x) { return x / (1.0f + expf(-x)); }

/// Σ_t x_t·w[t] in tap order (oldest first) with explicit roundings, so that the decode and
/// prefill kernels give bit-identical results whatever the compiler contracts.
__device__ __forceinline__ float conv_dot(float x0, float x1, float x2, float x3, const float* w) {
  float acc = __fmul_rn(x0, w[0]);
  acc = __fmaf_rn(x1, w[1], acc);
  acc = __fmaf_rn(x2, w[2], acc);
  return __fmaf_rn(x3, w[3], acc);
}

/// One decode step of one channel: window (w0, w1, w2) oldest first, x the current raw input,
/// taps[0..3] (tap 3 multiplies x): bf16(silu(Σ)). The caller shifts the window to (w1, w2, x).
__device__ __forceinline__ bf16 conv_decode_value(bf16 w0, bf16 w1, bf16 w2, bf16 x, const float* taps) {
  return to_bf16(silu_precise(conv_dot(to_f32(w0), to_f32(w1), to_f32(w2), to_f32(x), taps)));
}

}  // namespace lily::cuda
