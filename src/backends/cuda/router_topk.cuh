// MoE routing of one token by one warp (reference/model.md §3.5, norm_topk_prob = true), shared
// by the stand-alone top-k kernel (moe.cu) and the fused router GEMV + top-k (router.cu), so both
// give bit-identical ids and weights (nvcc only).
#pragma once
#include <cfloat>
#include <climits>

#include "backends/cuda/common.cuh"

namespace lily::cuda {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

/// Shared-memory scratch of route_token_warp.
struct RouteScratch {
  float logits[kMaxExperts + 1];  ///< the token's logits: E router logits, then the shared gate
  unsigned char taken[kMaxExperts];
  int sel[kMaxTopK];
  float ex[kMaxTopK];  ///< exp(l_s − l_0) of the selected (route_token_block)
  float denom;
};

/// Called by all 32 lanes of one warp after `rs.logits[0 … E]` holds the token's logits (and a
/// __syncwarp()). Picks the k largest of the E router logits in descending order (ties to the
/// lowest id; NaN never wins; if only NaN are left, the lowest id not yet taken), weights
/// w_s = exp(l_s − l_0) / Σ exp(l_j − l_0) over the selected (fp32), and slot k = the shared
/// expert: id E, weight sigmoid(shared gate logit). ids, weights: [k + 1] (written by lane 0).
__device__ __forceinline__ void route_token_warp(RouteScratch& rs, int E, int k, int32_t* __restrict__ ids,
                                                 float* __restrict__ weights) {
  const int lane = threadIdx.x % kWarp;
  const float* sl = rs.logits;
  for (int e = lane; e < E; e += kWarp) rs.taken[e] = 0;
  __syncwarp();
  for (int s = 0; s < k; ++s) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int e = lane; e < E; e += kWarp) {
      const float v = sl[e];
      if (!rs.taken[e] && (v > bv || (v == bv && e < bi))) { bv = v; bi = e; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (bi == INT_MAX) {  // only NaN left: lowest id not yet taken
      bi = E;
      for (int e = 0; e < E; ++e)
        if (!rs.taken[e]) { bi = e; break; }
    }
    if (lane == 0) { rs.sel[s] = bi; rs.taken[bi] = 1; }
    __syncwarp();
  }
  if (lane == 0) {
    const float top = sl[rs.sel[0]];
    float denom = 0.0f;
    for (int s = 0; s < k; ++s) denom += expf(sl[rs.sel[s]] - top);
    for (int s = 0; s < k; ++s) {
      ids[s] = rs.sel[s];
      weights[s] = expf(sl[rs.sel[s]] - top) / denom;
    }
    ids[k] = E;
    weights[k] = 1.0f / (1.0f + expf(-sl[E]));
  }
}

/// The same routing (bit-identical ids and weights) by a whole block (blockDim.x ≥ 32, all
/// threads call it after `rs.logits[0 … E]` holds the token's logits and a __syncthreads()):
/// without NaN, (value descending, id ascending) is a strict total order, so every expert
/// counts the experts that beat it in parallel and the k with rank < k go to slot = rank — the
/// order route_token_warp's k passes produce; the weights use the same expf values summed in the
/// same order. If any router logit is NaN, warp 0 runs route_token_warp (its NaN rule).
__device__ __forceinline__ void route_token_block(RouteScratch& rs, int E, int k, int32_t* __restrict__ ids,
                                                  float* __restrict__ weights) {
  bool nan = false;
  for (int e = threadIdx.x; e < E; e += blockDim.x) nan |= isnan(rs.logits[e]);
  if (__syncthreads_or(nan)) {
    if (threadIdx.x < kWarp) route_token_warp(rs, E, k, ids, weights);
    return;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = rs.logits[e];
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < E; ++j) {
      const float u = rs.logits[j];
      rank += (u > v || (u == v && j < e)) ? 1 : 0;
    }
    if (rank < k) rs.sel[rank] = e;
  }
  __syncthreads();
  const float top = rs.logits[rs.sel[0]];
  if (threadIdx.x < k) rs.ex[threadIdx.x] = expf(rs.logits[rs.sel[threadIdx.x]] - top);
  __syncthreads();
  if (threadIdx.x == 0) {
    float denom = 0.0f;
    for (int s = 0; s < k; ++s) denom += rs.ex[s];
    rs.denom = denom;
  }
  __syncthreads();
  if (threadIdx.x < k) {
    ids[threadIdx.x] = rs.sel[threadIdx.x];
    weights[threadIdx.x] = rs.ex[threadIdx.x] / rs.denom;
  }
  if (threadIdx.x == 0) {
    ids[k] = E;
    weights[k] = 1.0f / (1.0f + expf(-rs.logits[E]));
  }
}

}  // namespace lily::cuda
