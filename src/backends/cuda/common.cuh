// Device-side helpers shared by every CUDA kernel of lily (nvcc only): bf16 <-> fp32, bf16
// vector loads and stores, alignment checks, activation functions, warp and block reductions.
// Host-side checking lives in cuda_check.h (included here), so a .cu file needs only this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_check.h"
#include "model/config.h"

namespace lily::cuda {

using bf16 = __nv_bfloat16;

constexpr int kWarp = 32;
/// MLX affine quantization group size (docs/model.md §2.2); every kernel assumes it.
constexpr int kGroup = kQuantGroupSize;

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

/// Two bf16 values (one packed pair, lower element in the low half) as fp32, exactly.
__device__ __forceinline__ float2 bf16x2_to_f32(uint32_t x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}

/// Four bf16 values (two packed pairs, lower element in the low half) as fp32, exactly.
__device__ __forceinline__ float4 bf16x4_to_f32(uint32_t lo, uint32_t hi) {
  const float2 a = bf16x2_to_f32(lo), b = bf16x2_to_f32(hi);
  return make_float4(a.x, a.y, b.x, b.y);
}

// ---- bf16 vectors -----------------------------------------------------------------------------
//
// N consecutive bf16 moved as one vector access (N = 8: 16 bytes, 4: 8 bytes, 2: 4 bytes), the
// lower address in the low half of each 32-bit word. Loads are exact; stores round to nearest
// even, as to_bf16.

/// The raw vector type of N ∈ {2, 4, 8} consecutive bf16: one aligned load or store.
template <int N> struct Bf16Vec;
template <> struct Bf16Vec<8> { using type = uint4; };
template <> struct Bf16Vec<4> { using type = uint2; };
template <> struct Bf16Vec<2> { using type = uint32_t; };

/// One vector load of N ∈ {2, 4, 8} consecutive bf16 at p (aligned to N elements), kept raw
/// (unpack_bf16 converts).
template <int N>
__device__ __forceinline__ typename Bf16Vec<N>::type load_bf16_raw(const bf16* p) {
  return *reinterpret_cast<const typename Bf16Vec<N>::type*>(p);
}

/// The N ∈ {2, 4, 8} bf16 of a raw vector as fp32 (exact): x[i] = element i.
template <int N>
__device__ __forceinline__ void unpack_bf16(const typename Bf16Vec<N>::type& raw, float (&x)[N]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

/// x[i] = p[i] for N ∈ {1, 2, 4, 8} consecutive bf16 as fp32 (exact). kVec (the default): one
/// vector load, p aligned to N elements; otherwise, and always for N = 1, N scalar loads.
template <int N, bool kVec = true>
__device__ __forceinline__ void load_bf16_vec(const bf16* p, float (&x)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "load_bf16_vec: N is 1, 2, 4 or 8");
  if constexpr (N == 1 || !kVec) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = to_f32(p[i]);
  } else {
    unpack_bf16<N>(load_bf16_raw<N>(p), x);
  }
}

/// p[i] = bf16(x[i]) for N ∈ {1, 2, 4, 8} consecutive outputs (round to nearest even). kVec (the
/// default): one vector store, p aligned to N elements; otherwise, and always for N = 1, N
/// scalar stores.
template <int N, bool kVec = true>
__device__ __forceinline__ void store_bf16_vec(const float (&x)[N], bf16* p) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "store_bf16_vec: N is 1, 2, 4 or 8");
  if constexpr (N == 1 || !kVec) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = to_bf16(x[i]);
  } else {
    typename Bf16Vec<N>::type raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) h[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    *reinterpret_cast<typename Bf16Vec<N>::type*>(p) = raw;
  }
}

/// Whether p is aligned to `bytes` (a power of two), as a kernel's vector accesses need.
__host__ __device__ inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
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

/// v rounded up to a multiple of 16 (shared-memory offsets of bulk-copy destinations).
__host__ __device__ inline int64_t align16(int64_t v) { return (v + 15) & ~int64_t{15}; }

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
