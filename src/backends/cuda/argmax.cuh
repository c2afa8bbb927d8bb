// The greedy pick's order and its block reduction (docs/model.md §3.6; nvcc only), shared by the
// argmax kernels (norm_argmax.cu) and the persistent decode kernel's LM head and argmax tasks
// (decode_tasks_proj.cuh), so both pick the same id.
#pragma once
#include <climits>
#include <cmath>

#include "backends/cuda/common.cuh"

namespace lily::cuda {

/// (v, i) comes before (bv, bi) in the greedy order: larger value, or equal value and lower
/// index. NaN never comes first.
__device__ __forceinline__ bool argmax_beats(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

/// The block's first (v, i) in the greedy order, on the lanes of warp 0 (the other threads keep
/// partial results). All threads of the block (blockDim.x a multiple of 32); safe to call again
/// right after (it starts with a barrier).
__device__ __forceinline__ void block_argmax(float& v, int& i) {
  __shared__ float sv[32];
  __shared__ int si[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (argmax_beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();  // sv / si may still be read by a previous call
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / kWarp;
    v = lane < n_warps ? sv[lane] : -INFINITY;
    i = lane < n_warps ? si[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (argmax_beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
  }
}

}  // namespace lily::cuda
