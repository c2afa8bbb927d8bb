// The GDN decode step's scalar math (docs/model.md §3.3): the causal-conv step of one channel
// (step 2), the gates (step 4), the q/k l2norm epsilon and the gated RMSNorm (step 6), shared by
// the stand-alone GDN kernels (gdn.cu), the in-projection GEMV's conv epilogue (quant_gemv.cu)
// and the persistent decode kernel's GDN task (decode_tasks_gdn.cuh), so that all give
// bit-identical results (nvcc only).
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

/// HF l2norm epsilon of q and k: x·(1/sqrt(Σx² + 1e-6)) (docs/model.md §3.3 step 4).
constexpr float kL2Eps = 1e-6f;

/// softplus with torch's threshold of 20 (docs/model.md §3.3 step 4).
__device__ __forceinline__ float softplus20(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/// log α = −exp(A_log)·softplus(a + dt_bias): the log of the decay, fp32.
__device__ __forceinline__ float log_decay(float a, float A_log, float dt_bias) {
  return -expf(A_log) * softplus20(a + dt_bias);
}

/// β = sigmoid(b), fp32 with the precise exp.
__device__ __forceinline__ float beta_gate(float b) { return 1.0f / (1.0f + expf(-b)); }

/// r = 1/√(Σo²/Dv + ε): the RMS scale of one value head from its sum of squares (step 6).
__device__ __forceinline__ float gated_norm_r(float sum_sq, int Dv, float eps) {
  return 1.0f / sqrtf(sum_sq / float(Dv) + eps);
}

/// y = (gain·(o·r))·silu(z) of one value; the decode step and the prefill norm share it.
__device__ __forceinline__ float gated_norm_y(float o, float r, float gain, float z) {
  return (gain * (o * r)) * silu_precise(z);
}

}  // namespace lily::cuda
