// The Gated DeltaNet task body of the persistent decode kernel (nvcc only): one key head's share
// of a GDN layer's decode step, i.e. the conv step of its channels, the delta-rule step of the
// value heads that use it and their gated RMSNorm (docs/model.md §3.3 steps 2–6, numerics §4.3
// item 3). The arithmetic is gdn.cu's decode path (conv_decode_channel, gdn_decode_head) term
// for term, with the same summation orders, so mix and the new state are bit-identical to
// gdn_conv_decode + gdn_decode.
//
// Geometry (head dim D = Dk = Dv ∈ {64, 128}): the state of a value head is cut as in
// gdn_decode_head into D/16 key-row parts of 16 rows; thread (column m, group g) of a head owns
// column m of parts [g·P, (g+1)·P). D = 128: the 512 threads take one head at a time (4 groups
// of 2 parts); D = 64: two heads at once, 256 threads each (4 groups of 1 part). The heads'
// states are copied into shared memory with cp.async (through L2, not L1) at the start of the
// task, so that their load overlaps the conv step and the q/k normalisation.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "backends/cuda/decode_tasks.h"
#include "backends/cuda/decode_tasks_common.cuh"
#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/mma.cuh"

namespace lily::cuda {
namespace gdn_task {

// kL2Eps, softplus20, log_decay, beta_gate and gated_norm_r / _y are gdn_conv.cuh's (shared
// with gdn.cu, so the arithmetic is the same functions, not copies).

/// The bf16 at p read past L1, as a bf16 (the conv window and raw input keep their bits).
__device__ __forceinline__ bf16 ld_cg_bf16_raw(const bf16* p) {
  return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}

/// Waits until at most n (0 … 3) of this thread's cp.async groups are pending.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

/// The task's cut of head dim D (see the file comment). Parts of 16 key rows and their summation
/// order are gdn_decode_head's (DecodeGeom in gdn.cu), which makes the sums bit-identical.
template <int D>
struct Geom {
  static constexpr int kThreads = kDecodeTaskThreads;
  static constexpr int kRowsPerPart = 16;
  static constexpr int kParts = D / kRowsPerPart;                                       // 8 | 4
  static constexpr int kHeadThreads = D * kParts < kThreads ? D * kParts : kThreads;    // 512 | 256
  static constexpr int kHeadsAtOnce = kThreads / kHeadThreads;                          // 1 | 2
  static constexpr int kGroups = kHeadThreads / D;                                      // 4 | 4
  static constexpr int kPartsPerThread = kParts / kGroups;                              // 2 | 1
  static constexpr int kRows = kPartsPerThread * kRowsPerPart;                          // 32 | 16
  static constexpr int kSlices = D / kWarp;  // 32-column slices: gdn_decode_head's Σo² order
  static constexpr int kMaxPerKey = 4;       // value heads per key head the layout is sized for
  static constexpr int kHeadFloats = D * D;
  /// Floats of the small arrays at kMaxPerKey (see task_gdn_heads_d's layout).
  static constexpr int kSmallFloats =
      2 * D + 2 * kMaxPerKey * D + 2 * kMaxPerKey + 2 * kHeadsAtOnce * kParts * D + 2 * D / kWarp + kHeadsAtOnce * kSlices;
  /// Head states that fit in shared memory at once (a ring when per_key exceeds it).
  static constexpr int kMaxSlots0 = (kDecodeTaskSmemBytes / 4 - kSmallFloats) / kHeadFloats;
  static constexpr int kMaxSlots = kMaxSlots0 < kMaxPerKey ? kMaxSlots0 : kMaxPerKey;  // 2 | 4
  static_assert(kParts % kGroups == 0 && kHeadThreads * kHeadsAtOnce == kThreads, "bad GDN task geometry");
  static_assert(kHeadsAtOnce == 1 || kMaxSlots >= kMaxPerKey, "heads processed together need their own slots");
  static_assert((D * D / 4) % kThreads == 0, "every thread issues the same number of state copies");
};

/// Starts the copy of one head's state (fp32 [D, D], 16-byte aligned) into shared memory: 16-byte
/// cp.async.cg (L2, not L1: another launch wrote it) spread over all threads, one commit group
/// per thread.
template <int D>
__device__ __forceinline__ void issue_state_copy(const float* src, float* dst) {
  constexpr int kChunks = D * D / 4;
#pragma unroll
  for (int q = threadIdx.x; q < kChunks; q += kDecodeTaskThreads) cp_async16(dst + 4 * q, src + 4 * q, 16);
  cp_async_commit();
}

/// task_gdn_heads for head dim D (= Dk = Dv). Shared memory (fp32, from `smem`):
///   slot   [n_slots, D, D]       head states as copied in (n_slots = min(per_key, kMaxSlots))
///   qk     [2D]                  conv output of q then k, replaced by q̂ (scaled) and k̂
///   vs, zs [per_key·D]           conv output v and the gate z of the task's value heads
///   gates  [per_key, 2]          α, β
///   pred_s, out_s [kHeadsAtOnce, D/16, D]  per-part sums of pred and of o
///   l2_s   [2D/32]               per-warp Σx² of q and k
///   sq_s   [kHeadsAtOnce, D/32]  per-slice Σo²
/// Starts the copies of the first min(per_key, kMaxSlots) head states of key head kh into the
/// task's shared memory (one cp.async group per head, in head order): the body's first step,
/// which the persistent kernel may take before the task's counter wait (no task of the step
/// writes a state before its own GDN task).
template <int D>
__device__ __forceinline__ void gdn_issue_states(const DecodeStepParams& p, int layer, int kh, char* smem) {
  using G = Geom<D>;
  const int per_key = p.gdn_dims.n_value_heads / p.gdn_dims.n_key_heads, v0 = kh * per_key;
  const int n_slots = per_key < G::kMaxSlots ? per_key : G::kMaxSlots;
  float* slot = reinterpret_cast<float*>(smem);
  for (int h = 0; h < n_slots; ++h)
    issue_state_copy<D>(p.layers[layer].gdn_state + int64_t(v0 + h) * G::kHeadFloats, slot + h * G::kHeadFloats);
}

template <int D>
__device__ __forceinline__ void task_gdn_heads_d(const DecodeStepParams& p, int layer, int kh, char* smem,
                                                 bool states_issued) {
  using G = Geom<D>;
  constexpr int kParts = G::kParts, kPPT = G::kPartsPerThread, kRowsPerPart = G::kRowsPerPart;
  const DecodeTaskLayer& lw = p.layers[layer];
  const GdnDims& dims = p.gdn_dims;
  const int Hk = dims.n_key_heads, Hv = dims.n_value_heads, per_key = Hv / Hk;
  const int key_dim = Hk * D, value_dim = Hv * D, C = 2 * key_dim + value_dim, v0 = kh * per_key;
  const int tid = threadIdx.x;
  const int n_slots = per_key < G::kMaxSlots ? per_key : G::kMaxSlots;
  float* state = lw.gdn_state;

  float* slot = reinterpret_cast<float*>(smem);
  float* qk = slot + n_slots * G::kHeadFloats;
  float* vs = qk + 2 * D;
  float* zs = vs + per_key * D;
  float* gates = zs + per_key * D;
  float* pred_s = gates + 2 * per_key;
  float* out_s = pred_s + G::kHeadsAtOnce * kParts * D;
  float* l2_s = out_s + G::kHeadsAtOnce * kParts * D;
  float* sq_s = l2_s + 2 * D / kWarp;

  // The largest reads first: the states of the first n_slots heads, one group per head.
  if (!states_issued) gdn_issue_states<D>(p, layer, kh, smem);

  // Conv step (gdn.cu conv_decode_channel): local channel u < D is q channel kh·D + u, then k
  // (key_dim + kh·D + u − D), then v (2·key_dim + v0·D + u − 2D); the window shifts in place.
  const bf16* proj = p.proj;
  const float* conv_w = lw.gdn.conv_w;
  bf16* window = lw.conv_window;
  const int n_ch = (2 + per_key) * D;
  for (int u = tid; u < n_ch; u += kDecodeTaskThreads) {
    const int c = u < D ? kh * D + u : u < 2 * D ? key_dim + kh * D + (u - D) : 2 * key_dim + v0 * D + (u - 2 * D);
    bf16* win = window + int64_t(c) * (kGdnConvK - 1);
    const bf16 x = ld_cg_bf16_raw(proj + c);
    const bf16 w0 = ld_cg_bf16_raw(win), w1 = ld_cg_bf16_raw(win + 1), w2 = ld_cg_bf16_raw(win + 2);
    float taps[kGdnConvK];
#pragma unroll
    for (int t = 0; t < kGdnConvK; ++t) taps[t] = __ldg(conv_w + int64_t(c) * kGdnConvK + t);
    const float y = to_f32(conv_decode_value(w0, w1, w2, x, taps));
    win[0] = w1;
    win[1] = w2;
    win[2] = x;
    if (u < 2 * D) qk[u] = y;
    else vs[u - 2 * D] = y;
  }
  // z of the task's heads, and their gates (proj rows C + Vd + j for a, C + Vd + Hv + j for b).
  for (int u = tid; u < per_key * D; u += kDecodeTaskThreads) zs[u] = ld_cg_bf16(proj + C + v0 * D + u);
  if (tid >= kDecodeTaskThreads - per_key) {
    const int jl = kDecodeTaskThreads - 1 - tid, j = v0 + jl;
    const float a = ld_cg_bf16(proj + C + value_dim + j), b = ld_cg_bf16(proj + C + value_dim + Hv + j);
    gates[2 * jl] = expf(log_decay(a, __ldg(lw.gdn.A_log + j), __ldg(lw.gdn.dt_bias + j)));
    gates[2 * jl + 1] = beta_gate(b);
  }
  __syncthreads();

  // q̂ (threads [0, D)) and k̂ ([D, 2D)), L2-normalised in fp32 as gdn_decode_head: Σx² per
  // warp by shuffles, then the warps of the vector in order.
  float x = 0.0f;
  if (tid < 2 * D) {
    x = qk[tid];
    const float sq = warp_sum(x * x);
    if (tid % kWarp == 0) l2_s[tid / kWarp] = sq;
  }
  __syncthreads();
  if (tid < 2 * D) {
    const int w0 = tid < D ? 0 : D / kWarp;
    float ss = l2_s[w0];
#pragma unroll
    for (int w = 1; w < D / kWarp; ++w) ss += l2_s[w0 + w];
    const float r = 1.0f / sqrtf(ss + kL2Eps);
    qk[tid] = tid < D ? x * r * rsqrtf(float(D)) : x * r;
  }
  const float* q_s = qk;
  const float* k_s = qk + D;

  // Thread → (head of the round hs, column m, group g); group g owns parts [g·P, (g+1)·P).
  const int hs = tid / G::kHeadThreads, m = tid % D, g = (tid % G::kHeadThreads) / D;
  const float eps = dims.norm_eps;
  for (int h0 = 0; h0 < per_key; h0 += G::kHeadsAtOnce) {
    // This round's states have landed once the groups issued after them are the only ones left.
    const int issued = per_key < h0 + n_slots ? per_key : h0 + n_slots;
    const int needed = per_key < h0 + G::kHeadsAtOnce ? per_key : h0 + G::kHeadsAtOnce;
    cp_async_wait_pending(issued - needed);
    __syncthreads();  // every thread's copies (and, in round 0, q̂ and k̂) are visible

    const int jl = h0 + hs, j = v0 + jl;
    const bool active = jl < per_key;
    float s[G::kRows];
    if (active) {
      // Decay and predict (docs/model.md §3.3 step 5.1–5.2): pred[m] = Σ_i k̂_i·α·S[i][m].
      const float alpha = gates[2 * jl];
      const float* S = slot + (jl % n_slots) * G::kHeadFloats;
#pragma unroll
      for (int e = 0; e < kPPT; ++e) {
        float pred = 0.0f;
#pragma unroll
        for (int r = 0; r < kRowsPerPart; ++r) {
          const int i = (g * kPPT + e) * kRowsPerPart + r;
          s[e * kRowsPerPart + r] = alpha * S[i * D + m];
          pred += k_s[i] * s[e * kRowsPerPart + r];
        }
        pred_s[(hs * kParts + g * kPPT + e) * D + m] = pred;
      }
    }
    __syncthreads();  // pred parts written; this round's slots are read

    // Refill the slots this round has finished reading (per_key > kMaxSlots only), in head order.
    for (int h = h0; h < needed; ++h)
      if (h + n_slots < per_key)
        issue_state_copy<D>(state + int64_t(v0 + h + n_slots) * G::kHeadFloats, slot + (h % n_slots) * G::kHeadFloats);

    float o = 0.0f;
    if (active) {
      float pred = 0.0f;
#pragma unroll
      for (int q = 0; q < kParts; ++q) pred += pred_s[(hs * kParts + q) * D + m];
      const float delta = (vs[jl * D + m] - pred) * gates[2 * jl + 1];  // §3.3 step 5.3
      // Rank-1 update and output with the updated state (§3.3 steps 5.4–5.5).
      float* Sg = state + int64_t(j) * G::kHeadFloats;
#pragma unroll
      for (int e = 0; e < kPPT; ++e) {
        float oe = 0.0f;
#pragma unroll
        for (int r = 0; r < kRowsPerPart; ++r) {
          const int i = (g * kPPT + e) * kRowsPerPart + r;
          s[e * kRowsPerPart + r] += k_s[i] * delta;
          Sg[i * D + m] = s[e * kRowsPerPart + r];
          oe += q_s[i] * s[e * kRowsPerPart + r];
        }
        out_s[(hs * kParts + g * kPPT + e) * D + m] = oe;
      }
    }
    __syncthreads();  // o parts written
    // Group 0 (whole warps) finishes the head: o = Σ parts in order, bf16, then Σo² per
    // 32-column slice by shuffles, the slices in order (gdn_decode_head's cluster sum).
    const bool finisher = active && g == 0;
    if (finisher) {
#pragma unroll
      for (int q = 0; q < kParts; ++q) o += out_s[(hs * kParts + q) * D + m];
      o = round_bf16(o);
      const float slice = warp_sum(o * o);
      if (m % kWarp == 0) sq_s[hs * G::kSlices + m / kWarp] = slice;
    }
    __syncthreads();  // slice sums written
    if (finisher) {
      float head_sq = 0.0f;
#pragma unroll
      for (int sl = 0; sl < G::kSlices; ++sl) head_sq += sq_s[hs * G::kSlices + sl];
      const float rr = gated_norm_r(head_sq, D, eps);
      const float y = gated_norm_y(o, rr, __ldg(lw.gdn.norm_w + m), zs[jl * D + m]);
      p.mix[int64_t(j) * D + m] = to_bf16(y);
    }
  }
}

}  // namespace gdn_task

/// Task kGdnHeads, part = key head kh, of GDN layer `layer` (docs/model.md §3.3 steps 2–6,
/// numerics §4.3 item 3), bit-identical to gdn_conv_decode + gdn_decode on these channels/heads:
///  * conv step + SiLU → bf16 of q channels [kh·Dk, (kh+1)·Dk), k channels key_dim + the same
///    and v channels 2·key_dim + [v0·Dv, (v0 + per_key)·Dv), v0 = kh·per_key, from the raw
///    in-projection p.proj (bf16: q‖k‖v [C], z [Hv·Dv], a [Hv], b [Hv]); their windows of
///    layer.conv_window (bf16 [C, K−1]) shift in place;
///  * per value head j ∈ [v0, v0 + per_key): q̂/k̂ L2 norms, α, β, the fp32 delta-rule step on
///    layer.gdn_state (fp32 [Hv, Dk, Dv], updated in place), o rounded to bf16, the gated
///    RMSNorm with z_j → p.mix[j·Dv, (j+1)·Dv) (bf16).
/// Needs Dk = Dv ∈ {64, 128}, K = 4, per_key = Hv/Hk ≤ 4, kDecodeTaskThreads threads, `smem`
/// 16-byte aligned with kDecodeTaskSmemBytes bytes, gdn_state 16-byte aligned. All threads;
/// contains __syncthreads() and waits for all of its cp.async copies before returning.
/// With states_issued, gdn_task_issue_states(p, layer, part, smem) ran before (and no other
/// cp.async group was committed since).
__device__ __forceinline__ void task_gdn_heads(const DecodeStepParams& p, int layer, int part, char* smem,
                                               bool states_issued = false) {
  if (p.gdn_dims.key_head_dim == 128) gdn_task::task_gdn_heads_d<128>(p, layer, part, smem, states_issued);
  else gdn_task::task_gdn_heads_d<64>(p, layer, part, smem, states_issued);
}

/// The state copies of GDN task `part` of layer `layer` into `smem` (its work area), started
/// before the task's counter wait. All threads.
__device__ __forceinline__ void gdn_task_issue_states(const DecodeStepParams& p, int layer, int part, char* smem) {
  if (p.gdn_dims.key_head_dim == 128) gdn_task::gdn_issue_states<128>(p, layer, part, smem);
  else gdn_task::gdn_issue_states<64>(p, layer, part, smem);
}

}  // namespace lily::cuda
