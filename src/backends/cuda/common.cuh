// Device-side helpers shared by every CUDA kernel of lily (nvcc only): bf16 <-> fp32,
// activation functions, warp and block reductions. Host-side checking lives in cuda_check.h
// (included here), so a .cu file needs only this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/cuda_check.h"

namespace lily::cuda {

using bf16 = __nv_bfloat16;

constexpr int kWarp = 32;
/// MLX affine quantization group size (docs/model.md §2.2); every kernel assumes it.
constexpr int kGroup = 64;

/// bf16 -> fp32 (exact).
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
/// fp32 -> bf16, round to nearest even (what `bf16(x)` means in docs/model.md).
__device__ __forceinline__ bf16 to_bf16(float v) { return __float2bfloat16_rn(v); }
/// Rounds an fp32 value through bf16 and back.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
/// Raw bf16 bits (as stored in checkpoints) -> fp32.
__device__ __forceinline__ float bits_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

/// Four bf16 values (two packed pairs, lower element in the low half) as fp32, exactly.
__device__ __forceinline__ float4 bf16x4_to_f32(uint32_t lo, uint32_t hi) {
  return make_float4(__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u), __uint_as_float(hi << 16),
                     __uint_as_float(hi & 0xFFFF0000u));
}

/// x[i] = p[i] for N consecutive bf16 as fp32 (N = 8: one 16-byte load, p 16-byte aligned;
/// N = 1: one scalar load).
template <int N>
__device__ __forceinline__ void load_bf16_vec(const bf16* p, float (&x)[N]) {
  static_assert(N == 1 || N == 8, "load_bf16_vec: N is 1 or 8");
  if constexpr (N == 1) {
    x[0] = to_f32(*p);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const float4 a = bf16x4_to_f32(raw.x, raw.y), b = bf16x4_to_f32(raw.z, raw.w);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
}

/// p[i] = bf16(x[i]) for N consecutive outputs (N = 8: one 16-byte store, p 16-byte aligned).
template <int N>
__device__ __forceinline__ void store_bf16_vec(const float (&x)[N], bf16* p) {
  static_assert(N == 1 || N == 8, "store_bf16_vec: N is 1 or 8");
  if constexpr (N == 1) {
    *p = to_bf16(x[0]);
  } else {
    __nv_bfloat162 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(h);
  }
}

/// silu(x) = x / (1 + e^-x), fp32.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
/// sigmoid(x) = 1 / (1 + e^-x), fp32.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

/// y[i] = v: as it is for fp32 outputs, rounded once for bf16 ones.
template <class OutT>
__device__ __forceinline__ void store_out(OutT* y, int64_t i, float v);
template <>
__device__ __forceinline__ void store_out<float>(float* y, int64_t i, float v) { y[i] = v; }
template <>
__device__ __forceinline__ void store_out<bf16>(bf16* y, int64_t i, float v) { y[i] = to_bf16(v); }

/// Sum over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/// Sum over aligned groups of `width` lanes (width a power of two ≤ 32).
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/// Max over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over all threads of a block (blockDim.x a multiple of 32, ≤ 1024). `scratch` holds
/// ≥ 32 floats of shared memory. Every thread gets the result. Contains __syncthreads().
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int n_warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < n_warps ? scratch[lane] : 0.0f;
  return warp_sum(t);
}

/// Ceil-div for launch sizes.
__host__ __device__ constexpr inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Streaming multiprocessors of the current device (queried once per process; host only).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

}  // namespace lily::cuda
