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

}  // namespace lily::cuda
