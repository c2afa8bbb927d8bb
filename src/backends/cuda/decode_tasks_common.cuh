// Device building blocks of the persistent decode kernel's task bodies (nvcc only): loads that
// see other blocks' writes of the same launch, an activation row staged with or without an
// add + RMSNorm, the MLX-affine GEMV over a task's rows, and the L2 prefetch of a task's weights.
//
// The rules every body follows (decode_tasks.h):
//  * all kDecodeTaskThreads threads of the block call the body, which may use __syncthreads();
//  * activations and sequence state are read with ld.global.cg (the ld_cg_* helpers, __ldcg):
//    other blocks of the same launch wrote them, and L1 is not coherent across SMs; weights and
//    the model's fp32 vectors never change and take the read-only path (__ldg);
//  * a body leaves its results in global memory by plain stores; the caller's counter_signal
//    orders them before its signal.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "backends/cuda/decode_tasks.h"
#include "backends/cuda/quant_dot.cuh"

namespace lily::cuda {

/// bf16 at p as fp32, read past L1 (written by another block of this launch).
__device__ __forceinline__ float ld_cg_bf16(const bf16* p) {
  return bits_to_f32(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
/// fp32 at p, read past L1.
__device__ __forceinline__ float ld_cg_f32(const float* p) { return __ldcg(p); }

/// Rows [first, last) of a stage of `total` rows cut every `per` rows: part p's range.
struct RowRange {
  int64_t first = 0, last = 0;
};
__device__ __forceinline__ RowRange part_rows(int part, int per, int64_t total) {
  const int64_t first = static_cast<int64_t>(part) * per;
  return RowRange{first, first + per < total ? first + per : total};
}

/// Shared-memory floats of a staged activation row of `cols` values: the values (group g at
/// g·kGroupStride, quant_dot.cuh's layout) and then one Σx per group.
__host__ __device__ constexpr int64_t staged_row_floats(int cols) {
  return static_cast<int64_t>(cols / kGroup) * (kGroupStride + 1);
}

/// Eight bf16 at p (16-byte aligned) as fp32, read past L1 in one load.
__device__ __forceinline__ void ld_cg_bf16x8(const bf16* p, float (&x)[8]) {
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
  const float4 a = bf16x4_to_f32(v.x, v.y), b = bf16x4_to_f32(v.z, v.w);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

/// Stages bf16 x [cols] (read past L1, 16-byte aligned, cols a multiple of 64) into xs (fp32,
/// quant_dot.cuh's layout) and its group sums into xsum = xs + (cols / 64)·kGroupStride: thread
/// i takes the eight values 8i … 8i + 7 (one load; every load of the row in flight at once). All
/// threads; ends with __syncthreads().
__device__ __forceinline__ void stage_row_cg(const bf16* x, int cols, float* xs) {
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {
    float v[8];
    ld_cg_bf16x8(x + c, v);
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;  // 8 values never straddle a group
#pragma unroll
    for (int u = 0; u < 8; ++u) e[u] = v[u];
  }
  __syncthreads();
  stage_group_sums(cols, xs, xs + (cols / kGroup) * kGroupStride);
}

/// The add + RMSNorm of docs/model.md §4.1 staged for a GEMV: h = bf16(x + branch) (x alone
/// when branch is null), y = bf16(h · r · gain) with r = 1 / sqrt(Σh² / cols + eps), y staged
/// into xs as stage_row_cg does (with its group sums). x and branch are read past L1, eight
/// values a load (16-byte aligned, cols a multiple of 64). With h_out / y_out non-null, h and y
/// are also stored (bf16 [cols]). All threads; ends with __syncthreads(). Σh² is summed per
/// thread in element order, then over the block.
__device__ __forceinline__ void stage_add_norm_cg(const bf16* x, const bf16* branch, const float* gain, int cols,
                                                  float eps, float* xs, bf16* h_out, bf16* y_out) {
  __shared__ float scratch[32];
  float ss = 0.0f;
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {
    float v[8], b[8];
    ld_cg_bf16x8(x + c, v);
    if (branch) ld_cg_bf16x8(branch + c, b);
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const float h = branch ? round_bf16(v[u] + b[u]) : v[u];
      e[u] = h;
      ss += h * h;
    }
  }
  const float total = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {  // each thread revisits its own elements
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const float h = e[u];
      const bf16 y = to_bf16(h * r * __ldg(gain + c + u));
      e[u] = to_f32(y);
      if (h_out) h_out[c + u] = to_bf16(h);
      if (y_out) y_out[c + u] = y;
    }
  }
  __syncthreads();
  stage_group_sums(cols, xs, xs + (cols / kGroup) * kGroupStride);
}

/// Rows a warp's row-group computes at once in gemv_rows (independent loads in flight).
constexpr int kTaskGemvUnroll = 4;

/// y[r] = Σ_c w[r, c]·x[c] for rows r ∈ [first, last) of the BITS-bit matrix w, x staged in xs
/// (stage_row_cg / stage_add_norm_cg), per 64-group s·Σ(q·x) + b·Σx in fp32 (docs/model.md
/// §4.2), then `store(r, value)` by one lane per row. Rows are dealt to the warps' row-groups
/// (lanes_per_row lanes each) kTaskGemvUnroll at a time. All threads (warp-uniform loops).
template <int BITS, class Store>
__device__ __forceinline__ void gemv_rows(const DeviceQuant& w, int64_t first, int64_t last, const float* xs,
                                          Store store) {
  constexpr int U = kTaskGemvUnroll;
  const int groups = w.cols / kGroup, L = lanes_per_row(groups), per_warp = kWarp / L;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  const int sub = lane / L, lane_in = lane % L;
  const float* xsum = xs + static_cast<int64_t>(groups) * kGroupStride;
  const int64_t per_round = static_cast<int64_t>(n_warps) * per_warp * U;
  const int64_t rounds = (last - first + per_round - 1) / per_round;
  for (int64_t it = 0; it < rounds; ++it) {  // the same count on every lane: shuffles stay converged
    const int64_t base = first + it * per_round + (static_cast<int64_t>(warp) * per_warp + sub) * U;
    int64_t row[U];
#pragma unroll
    for (int j = 0; j < U; ++j) row[j] = base + j < last ? base + j : -1;
    float acc[U];
    rows_partial<BITS, U>(w, row, xs, xsum, lane_in, L, acc);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float v = group_sum(acc[j], L);
      if (lane_in == 0 && row[j] >= 0) store(row[j], v);
    }
  }
}

/// gemv_rows for a matrix of either bit width (4 or 8).
template <class Store>
__device__ __forceinline__ void gemv_rows_any(const DeviceQuant& w, int64_t first, int64_t last, const float* xs,
                                              Store store) {
  if (w.bits == 8) gemv_rows<8>(w, first, last, xs, store);
  else gemv_rows<4>(w, first, last, xs, store);
}

/// Asks L2 to fetch `bytes` from `p` (rounded out to 16-byte bounds) without waiting: one
/// cp.async.bulk.prefetch per call, issued by the calling thread. A hint: no result, no fault
/// beyond what a load of the same bytes would raise.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{15};
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) + 15) & ~uintptr_t{15};
  constexpr uintptr_t kMaxChunk = uintptr_t{1} << 20;  // well inside the instruction's 32-bit size
  for (; a < end; a += kMaxChunk) {
    const uint32_t n = static_cast<uint32_t>(end - a < kMaxChunk ? end - a : kMaxChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
  }
}

/// Prefetches rows [first, last) of w (codes, scales, biases) into L2. One thread.
__device__ __forceinline__ void prefetch_rows_l2(const DeviceQuant& w, int64_t first, int64_t last) {
  if (last <= first) return;
  const int64_t wpr = w.cols * w.bits / 32, groups = w.cols / kGroup;
  prefetch_l2(w.codes + first * wpr, (last - first) * wpr * 4);
  prefetch_l2(w.scales + first * groups, (last - first) * groups * 2);
  prefetch_l2(w.biases + first * groups, (last - first) * groups * 2);
}

}  // namespace lily::cuda
