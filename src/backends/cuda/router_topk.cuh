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

/// (value descending, id ascending): the order of route_token_warp's selection (NaN excluded).
__device__ __forceinline__ bool route_beats(float v, int i, float u, int j) { return v > u || (v == u && i < j); }

/// k rounds of a warp arg-max over the candidate ids the lanes hold (N each; INT_MAX = none):
/// lane 0 writes the k best in order to out[0 … k), or fewer when the warp holds fewer. Called
/// by all 32 lanes of a warp; no NaN among the candidates' logits.
template <int N>
__device__ __forceinline__ void warp_select(const float* logits, const int (&ids)[N], int k, int* out) {
  unsigned taken = 0;
  for (int s = 0; s < k; ++s) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int c = 0; c < N; ++c) {  // this lane's best not yet taken
      if (ids[c] == INT_MAX || (taken >> c) & 1u) continue;
      const float v = logits[ids[c]];
      if (bi == INT_MAX || route_beats(v, ids[c], bv, bi)) { bv = v; bi = ids[c]; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi != INT_MAX && (bi == INT_MAX || route_beats(ov, oi, bv, bi))) { bv = ov; bi = oi; }
    }
    if (bi == INT_MAX) break;  // uniform: every lane saw the same reduction
#pragma unroll
    for (int c = 0; c < N; ++c)
      if (ids[c] == bi) taken |= 1u << c;
    if (threadIdx.x % kWarp == 0) out[s] = bi;
  }
}

/// Experts per lane in route_token_block's first level, and its candidates per lane in the second.
constexpr int kRoutePerLane = 4, kRoutePicksPerLane = 8;

/// The same routing (bit-identical ids and weights) by a whole block (all threads call it after
/// `rs.logits[0 … E]` holds the token's logits and a __syncthreads()). Without NaN, (value
/// descending, id ascending) is a strict total order, so a two-level selection gives
/// route_token_warp's k picks in its order: each warp picks its top k of the experts it holds
/// (e = lane + 32·(warp + n_warps·c), c < 4), then warp 0 picks the top k of those ≤ 256 picks:
/// about 2k warp arg-max rounds instead of an O(E²) rank count. The weights use the same expf
/// values summed in the same order. If any router logit is NaN, or the block is too small for
/// E (E > 4·blockDim.x or n_warps·k > 256), warp 0 runs route_token_warp.
__device__ __forceinline__ void route_token_block(RouteScratch& rs, int E, int k, int32_t* __restrict__ ids,
                                                  float* __restrict__ weights) {
  __shared__ int picks[kWarp * kRoutePicksPerLane];  // [warp][k]: the second level's candidates
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  bool nan = false;
  for (int e = threadIdx.x; e < E; e += blockDim.x) nan |= isnan(rs.logits[e]);
  const bool too_small = E > kRoutePerLane * static_cast<int>(blockDim.x) || n_warps * k > kWarp * kRoutePicksPerLane;
  if (__syncthreads_or(nan) || too_small) {
    if (threadIdx.x < kWarp) route_token_warp(rs, E, k, ids, weights);
    return;
  }
  {
    int mine[kRoutePerLane];
#pragma unroll
    for (int c = 0; c < kRoutePerLane; ++c) {
      const int e = lane + kWarp * (warp + n_warps * c);
      mine[c] = e < E ? e : INT_MAX;
    }
    for (int s = lane; s < k; s += kWarp) picks[warp * k + s] = INT_MAX;
    __syncwarp();
    warp_select<kRoutePerLane>(rs.logits, mine, k, picks + warp * k);
  }
  __syncthreads();
  if (warp == 0) {
    int cand[kRoutePicksPerLane];
#pragma unroll
    for (int c = 0; c < kRoutePicksPerLane; ++c) {
      const int j = lane + kWarp * c;
      cand[c] = j < n_warps * k ? picks[j] : INT_MAX;
    }
    warp_select<kRoutePicksPerLane>(rs.logits, cand, k, rs.sel);
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
