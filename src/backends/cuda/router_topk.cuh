// MoE routing of one token by one warp (top-k logits, softmax renormalised over them): the
// stand-alone top-k kernel (moe.cu) uses route_token_warp, the fused router GEMV + top-k
// (router.cu) route_token_keys; both give bit-identical ids and weights (nvcc only).
#pragma once
#include <cfloat>
#include <climits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/kernels.h"

namespace lily::cuda {

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

/// Order-preserving key of a router logit for route_token_keys: a larger logit has a larger
/// key, −0 and +0 get the same key (they compare equal, as in route_token_warp), every NaN gets
/// 1 (below −inf, so NaN never wins while a number is left), and 0 is left for "taken".
__device__ __forceinline__ uint32_t route_key(float v) {
  if (isnan(v)) return 1u;
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) + 1u;  // −inf → 0x00800000, +inf → 0xFF800001
}

/// The same routing as route_token_warp (bit-identical ids and weights, NaN and ties included),
/// in about k rounds of two warp-reduce instructions instead of k rounds of five shuffle pairs:
/// lane l holds the keys of experts e = l + 32c (c < N, E ≤ 32·N); each round every lane offers
/// its best remaining key (ties to the lowest c, hence the lowest id), the warp takes the
/// largest key and, among the lanes offering it, the lowest id, and the winner marks it taken.
/// (key descending, id ascending) is route_token_warp's order: a strict order where NaN ties
/// with NaN and loses to every number, so "only NaN left → the lowest id not taken" follows.
/// Called by all 32 lanes of one warp; `logits` [E + 1]: global memory read through L2 with
/// __ldcg (another block wrote it), or shared memory with kShared. ids, weights: [k + 1], k ≤ 32.
template <int N, bool kShared = false>
__device__ __forceinline__ void route_token_keys(const float* logits, int E, int k, int32_t* __restrict__ ids,
                                                 float* __restrict__ weights) {
  const int lane = threadIdx.x % kWarp;
  auto load = [logits](int e) { return kShared ? logits[e] : __ldcg(logits + e); };
  uint32_t key[N];
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const int e = lane + kWarp * c;
    key[c] = e < E ? route_key(load(e)) : 0u;
  }
  int mine = 0;  // lane s keeps the id of pick s
  for (int s = 0; s < k; ++s) {
    uint32_t best = 0u;
    int best_c = 0;
#pragma unroll
    for (int c = 0; c < N; ++c)
      if (key[c] > best) { best = key[c]; best_c = c; }
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);  // ≥ 1: k ≤ E, so a key is left
    const uint32_t id = __reduce_min_sync(0xffffffffu, best == top ? static_cast<uint32_t>(lane + kWarp * best_c) : ~0u);
#pragma unroll
    for (int c = 0; c < N; ++c)
      if (static_cast<uint32_t>(lane + kWarp * c) == id) key[c] = 0u;
    if (lane == s) mine = static_cast<int>(id);
  }
  // Weights exactly as route_token_warp: expf(l_s − l_0), summed in pick order.
  const float l0 = load(__shfl_sync(0xffffffffu, mine, 0));
  const float ex = lane < k ? expf(load(mine) - l0) : 0.0f;
  float denom = 0.0f;
  for (int s = 0; s < k; ++s) denom += __shfl_sync(0xffffffffu, ex, s);
  if (lane < k) {
    ids[lane] = mine;
    weights[lane] = ex / denom;
  }
  if (lane == 0) {
    ids[k] = E;
    weights[k] = 1.0f / (1.0f + expf(-load(E)));
  }
}

/// Experts per lane that route_token_keys is instantiated for: E ≤ 256 (the real model) uses 8.
constexpr int kRouteKeysSmall = 8, kRouteKeysLarge = kMaxExperts / kWarp;

}  // namespace lily::cuda
