// Gated DeltaNet kernels (docs/model.md §3.3, numerics §4.3/§4.4): causal conv (decode
// step and prefill), the fused per-value-head decode step, the chunked (UT/WY) prefill of the
// delta rule, and the gated RMSNorm. Launchers are declared in mixer_kernels.h.
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mixer_kernels.h"

#include <cooperative_groups.h>

namespace lily::cuda {
namespace {

namespace cg = cooperative_groups;

// Key and value head dims are equal (Dk = Dv = D) and a template parameter D ∈ {64, 128}; the
// launchers dispatch on the runtime dims (dispatch_head_dim below).
constexpr int kConvK = 4;      // conv kernel width
constexpr int kHist = kConvK - 1;
constexpr float kL2Eps = 1e-6f;  // HF l2norm epsilon: x·rsqrt(Σx² + 1e-6)

// ---- scalar gate math (docs/model.md §3.3 step 4) -------------------------------------------------

/// softplus with torch's threshold of 20.
__device__ __forceinline__ float softplus20(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/// log α = −exp(A_log)·softplus(a + dt_bias): the log of the decay, fp32.
__device__ __forceinline__ float log_decay(float a, float A_log, float dt_bias) {
  return -expf(A_log) * softplus20(a + dt_bias);
}

/// β = sigmoid(b), fp32 with the precise exp.
__device__ __forceinline__ float beta_gate(float b) { return 1.0f / (1.0f + expf(-b)); }


// ---- causal conv -----------------------------------------------------------------------------

// silu_precise, conv_dot and conv_decode_value live in gdn_conv.cuh (shared with the GEMV's
// conv epilogue, quant_gemv.cu).

/// The conv step of channel c: out[c] = bf16(silu(Σ_t win[c][t]·w[c][t] + x[c]·w[c][K−1])),
/// then window[c] ← (win1, win2, x). Shared by the one-sequence and the batched kernel.
__device__ __forceinline__ void conv_decode_channel(int c, const float* __restrict__ conv_w,
                                                    const bf16* __restrict__ qkv, bf16* __restrict__ window,
                                                    bf16* __restrict__ out) {
  bf16* win = window + int64_t(c) * kHist;
  const float* w = conv_w + int64_t(c) * kConvK;
  const bf16 x = qkv[c];
  const bf16 w0 = win[0], w1 = win[1], w2 = win[2];
  out[c] = conv_decode_value(w0, w1, w2, x, w);
  win[0] = w1;
  win[1] = w2;
  win[2] = x;
}

/// One conv step per channel (conv_decode_channel).
__global__ void conv_decode_kernel(int C, const float* __restrict__ conv_w,
                                   const bf16* __restrict__ qkv, bf16* __restrict__ window,
                                   bf16* __restrict__ out) {
  pdl_prologue();  // before the early return (launch.cuh contract)
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  conv_decode_channel(c, conv_w, qkv, window, out);
}

/// Batched decode: grid (channel blocks, row). Row r's conv input is qkv + r·qkv_stride, its
/// window windows[r] (each sequence its own), its output out + r·C.
__global__ void conv_decode_rows_kernel(int C, const float* __restrict__ conv_w, const bf16* __restrict__ qkv,
                                        int64_t qkv_stride, bf16* const* __restrict__ windows,
                                        bf16* __restrict__ out) {
  pdl_prologue();  // before reading windows[] (written by the step's copy-in) and the early return
  const int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (c >= C) return;
  conv_decode_channel(c, conv_w, qkv + int64_t(r) * qkv_stride, windows[r], out + int64_t(r) * C);
}

/// Raw conv input of channel c at token u (u may be negative: then it comes from the window,
/// whose slot K−1+u holds token u relative to the chunk start).
__device__ __forceinline__ bf16 conv_input(const bf16* qkv, int64_t stride, const bf16* window,
                                           int c, int u) {
  return u >= 0 ? qkv[int64_t(u) * stride + c] : window[int64_t(c) * kHist + (kHist + u)];
}

/// Conv over T tokens: thread per (token, channel). Reads the old window; does not write it.
__global__ void conv_prefill_kernel(int C, int T, const float* __restrict__ conv_w,
                                    const bf16* __restrict__ qkv, int64_t stride,
                                    const bf16* __restrict__ window, bf16* __restrict__ out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int t = blockIdx.y;
  if (c >= C || t >= T) return;
  const float* w = conv_w + int64_t(c) * kConvK;
  float x[kConvK];
#pragma unroll
  for (int j = 0; j < kConvK; ++j) x[j] = to_f32(conv_input(qkv, stride, window, c, t - kHist + j));
  out[int64_t(t) * C + c] = to_bf16(silu_precise(conv_dot(x[0], x[1], x[2], x[3], w)));
}

/// New window after T tokens: the last K−1 raw inputs (mixing in the old window if T < K−1).
__global__ void conv_window_update_kernel(int C, int T, const bf16* __restrict__ qkv,
                                          int64_t stride, bf16* __restrict__ window) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  bf16 next[kHist];
#pragma unroll
  for (int i = 0; i < kHist; ++i) next[i] = conv_input(qkv, stride, window, c, T - kHist + i);
#pragma unroll
  for (int i = 0; i < kHist; ++i) window[int64_t(c) * kHist + i] = next[i];
}

// ---- fused decode step -------------------------------------------------------------------------

/// Gated RMSNorm of one value head, called by threads m < Dv of the block (all threads must
/// call it: it synchronises). `o` is the already bf16-rounded output. Returns y[m] for m < Dv.
template <int kDv>
__device__ __forceinline__ float gated_norm_value(float o, float z, float gain, float eps,
                                                  float* scratch) {
  const bool active = threadIdx.x < kDv;
  const float sq = block_sum(active ? o * o : 0.0f, scratch);
  const float r = 1.0f / sqrtf(sq / float(kDv) + eps);
  return (gain * (o * r)) * silu_precise(z);
}

/// Launch geometry of the fused decode step for head dim D (= Dk = Dv): a cluster of D/32
/// CTAs per value head, each owning 32 value columns, 2·D threads (threads [0, D) load q,
/// [D, 2D) load k), so D/16 key-row parts of 16 rows each. D = 128: 4 CTAs × 256 threads,
/// 8 parts; D = 64: 2 CTAs × 128 threads, 4 parts.
template <int D>
struct DecodeGeom {
  static constexpr int kSliceCols = kWarp;                      // 32 value columns per CTA
  static constexpr int kSlices = D / kSliceCols;                // CTAs (one cluster) per head
  static constexpr int kThreads = 2 * D;
  static constexpr int kParts = kThreads / kSliceCols;          // key-row parts
  static constexpr int kRowsPerPart = D / kParts;               // 16
  static constexpr int kWarpsPerVec = D / kWarp;                // warps holding q (or k)
  static_assert(kRowsPerPart * kParts == D && kSlices * kSliceCols == D, "bad decode geometry");
};

/// A cluster of D/32 CTAs per value head j (compile-time cluster dims); CTA y owns value
/// columns [32y, 32y+32). Each CTA: q̂/k̂ L2 norms and gates (redundantly), the delta-rule step
/// on its D×32 slice of S_j (fp32, in place), bf16 output; the gated RMSNorm's Σo² is summed
/// over the cluster through distributed shared memory. Thread (part, m): column m of the
/// slice, key rows [16·part, +16).
/// The body of gdn_decode_kernel, shared with the batched kernel (gdn_decode_rows_kernel): the
/// caller has run pdl_prologue and passes one sequence's buffers.
template <int D>
__device__ __forceinline__ void gdn_decode_head(int Hk, int Hv, float eps, const float* __restrict__ A_log,
                  const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
                  const bf16* __restrict__ conv_out, const bf16* __restrict__ z,
                  const bf16* __restrict__ a, const bf16* __restrict__ b,
                  float* __restrict__ state, bf16* __restrict__ out) {
  using Geom = DecodeGeom<D>;
  constexpr int kDk = D, kDv = D, kSliceCols = Geom::kSliceCols, kDecodeSlices = Geom::kSlices;
  constexpr int kDecodeParts = Geom::kParts, kRowsPerPart = Geom::kRowsPerPart;
  __shared__ float q_s[kDk], k_s[kDk], part_s[kDecodeParts][kSliceCols];
  __shared__ float scratch[Geom::kThreads / kWarp], gates[2];
  __shared__ float slice_sq;  // Σ o'² over this CTA's columns, read by the whole cluster
  cg::cluster_group cluster = cg::this_cluster();
  const int j = blockIdx.x, kh = j / (Hv / Hk), tid = threadIdx.x;
  const int m = tid % kSliceCols, part = tid / kSliceCols;
  const int col = blockIdx.y * kSliceCols + m;  // value column in the head
  const int key_dim = Hk * kDk;

  // q (threads 0..127) and k (threads 128..255) of key head kh, L2-normalised in fp32.
  const int base = (tid < kDk ? 0 : key_dim) + kh * kDk;
  const float x = to_f32(conv_out[base + tid % kDk]);
  const float sq = warp_sum(x * x);
  if (tid % kWarp == 0) scratch[tid / kWarp] = sq;
  if (tid == 0) {
    gates[0] = expf(log_decay(to_f32(a[j]), A_log[j], dt_bias[j]));
    gates[1] = beta_gate(to_f32(b[j]));
  }
  __syncthreads();
  {
    const int w0 = tid < kDk ? 0 : Geom::kWarpsPerVec;
    float ss = scratch[w0];
#pragma unroll
    for (int w = 1; w < Geom::kWarpsPerVec; ++w) ss += scratch[w0 + w];
    const float r = 1.0f / sqrtf(ss + kL2Eps);
    if (tid < kDk) q_s[tid] = x * r * rsqrtf(float(kDk));
    else k_s[tid - kDk] = x * r;
  }
  __syncthreads();
  const float alpha = gates[0], beta = gates[1];

  // Decay and predict: pred[m] = Σ_i k̂_i·α·S[i][m].
  float* S = state + int64_t(j) * kDk * kDv;
  float s[kRowsPerPart];
  float pred = 0.0f;
#pragma unroll
  for (int r = 0; r < kRowsPerPart; ++r) {
    const int i = part * kRowsPerPart + r;
    s[r] = alpha * S[i * kDv + col];
    pred += k_s[i] * s[r];
  }
  part_s[part][m] = pred;
  __syncthreads();
  pred = 0.0f;
#pragma unroll
  for (int p = 0; p < kDecodeParts; ++p) pred += part_s[p][m];
  const float v = to_f32(conv_out[2 * key_dim + j * kDv + col]);
  const float delta = (v - pred) * beta;
  __syncthreads();  // everyone has read part_s

  // Rank-1 update and output with the updated state.
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < kRowsPerPart; ++r) {
    const int i = part * kRowsPerPart + r;
    s[r] += k_s[i] * delta;
    S[i * kDv + col] = s[r];
    o += q_s[i] * s[r];
  }
  part_s[part][m] = o;
  __syncthreads();
  o = 0.0f;
#pragma unroll
  for (int p = 0; p < kDecodeParts; ++p) o += part_s[p][m];
  o = round_bf16(o);

  // Gated RMSNorm: Σo'² of the head = the D/32 slices' sums, added in rank order everywhere.
  if (tid < kWarp) {
    const float slice = warp_sum(o * o);
    if (tid == 0) slice_sq = slice;
  }
  cluster.sync();
  float head_sq = 0.0f;
#pragma unroll
  for (int r = 0; r < kDecodeSlices; ++r) head_sq += *cluster.map_shared_rank(&slice_sq, r);
  cluster.sync();  // no CTA leaves while another still reads its slice_sq
  if (tid < kWarp) {
    const float rr = 1.0f / sqrtf(head_sq / float(kDv) + eps);
    const float y = (norm_w[col] * (o * rr)) * silu_precise(to_f32(z[j * kDv + col]));
    out[j * kDv + col] = to_bf16(y);
  }
}

/// The fused decode step of one sequence: grid (Hv, D/32), gdn_decode_head.
template <int D>
__global__ void __cluster_dims__(1, DecodeGeom<D>::kSlices, 1)
__launch_bounds__(DecodeGeom<D>::kThreads) gdn_decode_kernel(int Hk, int Hv, float eps, const float* __restrict__ A_log,
                  const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
                  const bf16* __restrict__ conv_out, const bf16* __restrict__ z,
                  const bf16* __restrict__ a, const bf16* __restrict__ b,
                  float* __restrict__ state, bf16* __restrict__ out) {
  pdl_prologue();
  gdn_decode_head<D>(Hk, Hv, eps, A_log, dt_bias, norm_w, conv_out, z, a, b, state, out);
}

/// Batched decode: grid (Hv, D/32, row), the same clusters; row r is gdn_decode_kernel over its
/// own buffers: conv_out + r·C, z/a/b + r·zab_stride, the state states[r], out + r·Hv·Dv. Each
/// cluster works on one row only, so a row's arithmetic is that of the sequence alone.
template <int D>
__global__ void __cluster_dims__(1, DecodeGeom<D>::kSlices, 1)
__launch_bounds__(DecodeGeom<D>::kThreads) gdn_decode_rows_kernel(int Hk, int Hv, float eps,
                  const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                  const float* __restrict__ norm_w, const bf16* __restrict__ conv_out,
                  const bf16* __restrict__ z, const bf16* __restrict__ a, const bf16* __restrict__ b,
                  int64_t zab_stride, float* const* __restrict__ states, bf16* __restrict__ out) {
  pdl_prologue();  // before reading states[] (written by the step's copy-in)
  const int64_t r = blockIdx.z;
  const int C = 2 * Hk * D + Hv * D;
  gdn_decode_head<D>(Hk, Hv, eps, A_log, dt_bias, norm_w, conv_out + r * C, z + r * zab_stride,
                     a + r * zab_stride, b + r * zab_stride, states[r], out + r * Hv * D);
}

// ---- chunked prefill (UT/WY form) -------------------------------------------------------------
//
// Per chunk of L ≤ 64 tokens with start state S0, γ_t = Π_{s≤t} α_s = exp(g_t) (g = cumulative
// log decay inside the chunk), the sequential recurrence S_t = α_t(I − β_t k_t k_tᵀ)S_{t−1}
// + β_t k_t v_tᵀ is equivalent to
//   (I + A) Δ = R,  A[t][s] = β_t·e^{g_t−g_s}·(k_t·k_s) (s < t),  R_t = β_t(v_t − γ_t S0ᵀk_t)
//   o_t   = γ_t S0ᵀq_t + Σ_{s≤t} e^{g_t−g_s}(q_t·k_s) Δ_s
//   S_L   = γ_L S0 + Σ_s e^{g_L−g_s} k_s Δ_sᵀ
// (Δ_t is the delta δ_t of the sequential form). Value columns evolve independently, so each
// block owns one value head and a slice of kBV value columns; the 64×64 matrices are formed
// redundantly by the Dv/kBV blocks of a head. Everything is fp32.

constexpr int kChunk = 64;
constexpr int kBV = 32;                 // value columns per block
constexpr int kPrefillThreads = 256;    // 8 warps
constexpr int kPrefillWarps = kPrefillThreads / kWarp;

/// Shared memory of the chunked prefill for head dim kDk (= Dv).
template <int kDk>
struct PrefillSmem {
  static constexpr int kDim = kDk;
  static constexpr int kKPad = kDk + 4;  // row stride of the q/k tiles (float4-conflict-free)
  float q[kChunk][kKPad];     // q̂ (scaled) of the chunk, zero rows past L
  float k[kChunk][kKPad];     // k̂
  float S[kDk][kBV];          // state slice
  float A[kChunk][kChunk];    // β_t e^{g_t−g_s} k_t·k_s, s < t
  float P[kChunk][kChunk];    // e^{g_t−g_s} q_t·k_s, s ≤ t
  float R[kChunk][kBV];       // right-hand side, then Δ
  float QS[kChunk][kBV];      // γ_t S0ᵀq_t
  float D[kChunk][kBV];       // e^{g_L−g_s} Δ_s
  float g[kChunk];            // cumulative log decay
  float beta[kChunk];
  float scratch[kPrefillWarps];
};

/// Loads q̂/k̂ rows (L2-normalised, q scaled) and the gates of chunk tokens [t0, t0+L) into
/// any of the prefill shared-memory layouts (members q, k, g, beta; kDim = Dk).
template <class Smem>
__device__ void load_chunk(Smem& sm, int t0, int L, int j, int kh, int key_dim,
                           int64_t C, const bf16* conv_out, const bf16* a, const bf16* b,
                           int64_t zab_stride, float A_log_j, float dt_bias_j) {
  constexpr int kDk = Smem::kDim;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int row = warp; row < 2 * kChunk; row += kPrefillWarps) {
    const int t = row % kChunk;
    const bool is_q = row < kChunk;
    float* dst = is_q ? sm.q[t] : sm.k[t];
    float x[kDk / kWarp];
    float ss = 0.0f;
    const bf16* src = conv_out + int64_t(t0 + t) * C + (is_q ? 0 : key_dim) + kh * kDk;
#pragma unroll
    for (int e = 0; e < kDk / kWarp; ++e) {
      x[e] = t < L ? to_f32(src[lane + e * kWarp]) : 0.0f;
      ss += x[e] * x[e];
    }
    ss = warp_sum(ss);
    const float r = (1.0f / sqrtf(ss + kL2Eps)) * (is_q ? rsqrtf(float(kDk)) : 1.0f);
#pragma unroll
    for (int e = 0; e < kDk / kWarp; ++e) dst[lane + e * kWarp] = x[e] * r;
  }
  if (threadIdx.x < kChunk) {
    const int t = threadIdx.x;
    const bool valid = t < L;
    const int64_t row = int64_t(t0 + t) * zab_stride;
    sm.g[t] = valid ? log_decay(to_f32(a[row + j]), A_log_j, dt_bias_j) : 0.0f;
    sm.beta[t] = valid ? beta_gate(to_f32(b[row + j])) : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // inclusive cumulative sum, in token order
    float acc = 0.0f;
    for (int t = 0; t < kChunk; ++t) sm.g[t] = (acc += sm.g[t]);
  }
  __syncthreads();
}

/// A and P: thread (ty, tx) computes rows 4·ty … 4·ty+3, columns tx + 16·c (c < 4).
template <class Smem>
__device__ void form_kk_qk(Smem& sm) {
  constexpr int kDk = Smem::kDim;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  float kk[4][4] = {}, qk[4][4] = {};
  for (int i = 0; i < kDk; i += 4) {
    float4 kt[4], qt[4], ks[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      kt[r] = *reinterpret_cast<const float4*>(&sm.k[4 * ty + r][i]);
      qt[r] = *reinterpret_cast<const float4*>(&sm.q[4 * ty + r][i]);
      ks[r] = *reinterpret_cast<const float4*>(&sm.k[tx + 16 * r][i]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        kk[r][c] += kt[r].x * ks[c].x + kt[r].y * ks[c].y + kt[r].z * ks[c].z + kt[r].w * ks[c].w;
        qk[r][c] += qt[r].x * ks[c].x + qt[r].y * ks[c].y + qt[r].z * ks[c].z + qt[r].w * ks[c].w;
      }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int t = 4 * ty + r, s = tx + 16 * c;
      const float decay = s <= t ? expf(sm.g[t] - sm.g[s]) : 0.0f;
      sm.A[t][s] = s < t ? sm.beta[t] * decay * kk[r][c] : 0.0f;
      sm.P[t][s] = s <= t ? decay * qk[r][c] : 0.0f;
    }
}

/// R_t = β_t(v_t − γ_t·S0ᵀk_t) and QS_t = γ_t·S0ᵀq_t; warp w rows t ≡ w (mod 8), lane = column.
template <int kDk>
__device__ void form_rhs(PrefillSmem<kDk>& sm, int t0, int L, int64_t C, int v_offset,
                         const bf16* conv_out) {
  const int warp = threadIdx.x / kWarp, m = threadIdx.x % kWarp;
  for (int t = warp; t < kChunk; t += kPrefillWarps) {
    float ks = 0.0f, qs = 0.0f;
#pragma unroll 8
    for (int i = 0; i < kDk; ++i) {
      ks += sm.k[t][i] * sm.S[i][m];
      qs += sm.q[t][i] * sm.S[i][m];
    }
    const float gamma = expf(sm.g[t]);
    const float v = t < L ? to_f32(conv_out[int64_t(t0 + t) * C + v_offset + m]) : 0.0f;
    sm.R[t][m] = sm.beta[t] * (v - gamma * ks);
    sm.QS[t][m] = gamma * qs;
  }
}

/// Solves (I + A)Δ = R in place in sm.R by blocked forward substitution: for each block of 8
/// rows, the 8 warps first subtract the earlier blocks' terms in parallel (one row each), then
/// warp 0 finishes the block sequentially.
template <int kDk>
__device__ void solve_unit_lower(PrefillSmem<kDk>& sm) {
  const int warp = threadIdx.x / kWarp, m = threadIdx.x % kWarp;
  for (int b0 = 0; b0 < kChunk; b0 += kPrefillWarps) {
    const int t = b0 + warp;
    float acc = sm.R[t][m];
    for (int s = 0; s < b0; ++s) acc -= sm.A[t][s] * sm.R[s][m];
    sm.R[t][m] = acc;
    __syncthreads();
    if (warp == 0) {
      for (int r = 1; r < kPrefillWarps; ++r) {
        const int tr = b0 + r;
        float x = sm.R[tr][m];
        for (int s = b0; s < tr; ++s) x -= sm.A[tr][s] * sm.R[s][m];
        sm.R[tr][m] = x;
      }
    }
    __syncthreads();
  }
}

/// Outputs o_t = QS_t + Σ_{s≤t} P[t][s]Δ_s (bf16, pre-norm) and the scaled deltas for the
/// state update.
template <class Smem>
__device__ void chunk_output(Smem& sm, int t0, int L, bf16* out, int64_t out_stride,
                             int o_offset) {
  const int warp = threadIdx.x / kWarp, m = threadIdx.x % kWarp;
  const float g_last = sm.g[L - 1];
  for (int t = warp; t < kChunk; t += kPrefillWarps) {
    float o = sm.QS[t][m];
    for (int s = 0; s <= t; ++s) o += sm.P[t][s] * sm.R[s][m];
    if (t < L) out[int64_t(t0 + t) * out_stride + o_offset + m] = to_bf16(o);
    sm.D[t][m] = t < L ? expf(g_last - sm.g[t]) * sm.R[t][m] : 0.0f;
  }
}

/// S ← γ_L S + Σ_s k_s D_sᵀ; warp w rows i ≡ w (mod 8), lane = column.
template <class Smem>
__device__ void update_state(Smem& sm, int L) {
  constexpr int kDk = Smem::kDim;
  const int warp = threadIdx.x / kWarp, m = threadIdx.x % kWarp;
  const float gamma_last = expf(sm.g[L - 1]);
  for (int i = warp; i < kDk; i += kPrefillWarps) {
    float acc = gamma_last * sm.S[i][m];
    for (int s = 0; s < L; ++s) acc += sm.k[s][i] * sm.D[s][m];
    sm.S[i][m] = acc;
  }
}

/// Block (value head j, column slice): the whole sequence, chunk after chunk. kDk = Dk = Dv.
template <int kDk>
__global__ void __launch_bounds__(kPrefillThreads)
gdn_prefill_chunked_kernel(int Hk, int Hv, int T, const float* __restrict__ A_log,
                           const float* __restrict__ dt_bias, const bf16* __restrict__ conv_out,
                           const bf16* __restrict__ a, const bf16* __restrict__ b,
                           int64_t zab_stride, float* __restrict__ state,
                           bf16* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kDv = kDk;
  PrefillSmem<kDk>& sm = *reinterpret_cast<PrefillSmem<kDk>*>(smem_raw);
  const int j = blockIdx.x, m0 = blockIdx.y * kBV, kh = j / (Hv / Hk);
  const int key_dim = Hk * kDk;
  const int64_t C = 2 * key_dim + int64_t(Hv) * kDv;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* S = state + int64_t(j) * kDk * kDv;
  for (int i = warp; i < kDk; i += kPrefillWarps) sm.S[i][lane] = S[i * kDv + m0 + lane];
  const float A_log_j = A_log[j], dt_bias_j = dt_bias[j];

  for (int t0 = 0; t0 < T; t0 += kChunk) {
    const int L = min(kChunk, T - t0);
    load_chunk(sm, t0, L, j, kh, key_dim, C, conv_out, a, b, zab_stride, A_log_j, dt_bias_j);
    form_kk_qk(sm);
    form_rhs(sm, t0, L, C, 2 * key_dim + j * kDv + m0, conv_out);
    __syncthreads();
    solve_unit_lower(sm);
    chunk_output(sm, t0, L, out, int64_t(Hv) * kDv, j * kDv + m0);
    __syncthreads();
    update_state(sm, L);
    __syncthreads();
  }
  for (int i = warp; i < kDk; i += kPrefillWarps) S[i * kDv + m0 + lane] = sm.S[i][lane];
}

// ---- chunked prefill in two passes (LILY_CUDA_GDN_CHUNK_PARALLEL=1) -----------------------
//
// The one-kernel form above forms A, P and solves (I + A)Δ = R inside the walk over the
// chunks, so 128 blocks do all of it one chunk after the other. But only R depends on the
// state: with T = (I + A)^{-1} (unit lower triangular),
//   Δ = T·R = U − W·S0,   U = T·diag(β)·V,   W = T·diag(β·γ)·K̂,
// and U, W, P depend on the chunk's own tokens alone. So:
//   pass 1 (block per value head × chunk, all chunks at once): A and P, T by forward
//          substitution, then U and W; writes U, W, P to the workspace;
//   pass 2 (block per value head × column slice, chunks in order): Δ = U − W·S, the outputs
//          o_t = γ_t S0ᵀq_t + Σ_{s≤t} P[t][s]Δ_s and the state update, as before.
// Same fp32 arithmetic on CUDA cores; only the order of the solve's operations differs (the
// inverse is formed, then applied), so results agree with the one-kernel form to fp32 rounding.

/// Pass 1's shared memory (kDk = Dv).
template <int kDk>
struct LocalSmem {
  static constexpr int kDim = kDk;
  static constexpr int kKPad = kDk + 4;
  float q[kChunk][kKPad];   // q̂, later β·v (the chunk's values of this head)
  float k[kChunk][kKPad];   // k̂
  float A[kChunk][kChunk];  // β_t e^{g_t−g_s} k_t·k_s, s < t
  union {                   // P is written out before the inverse takes its place
    float P[kChunk][kChunk + 1];   // e^{g_t−g_s} q_t·k_s, s ≤ t
    float Ti[kChunk][kChunk + 1];  // (I + A)^{-1}
  };
  float g[kChunk];
  float beta[kChunk];
};

/// Pass 2's shared memory (kDk = Dv; a slice of kBV value columns).
template <int kDk>
struct StateSmem {
  static constexpr int kDim = kDk;
  static constexpr int kKPad = kDk + 4;
  float q[kChunk][kKPad];
  float k[kChunk][kKPad];
  float W[kChunk][kKPad];
  float S[kDk][kBV];
  float P[kChunk][kChunk];
  float R[kChunk][kBV];  // Δ
  float QS[kChunk][kBV];
  float D[kChunk][kBV];
  float g[kChunk];
  float beta[kChunk];
};

/// Floats of the workspace per (value head, chunk): U and W [64][D], P [64][64].
__host__ __device__ constexpr int64_t local_floats(int D) { return int64_t{kChunk} * (2 * D + kChunk); }

/// sm.Ti = (I + sm.A)^{-1} by forward substitution on the columns: warp w owns columns
/// 8w … 8w+7, four lanes per column split the inner sum (s ≡ r mod 4) and combine it with
/// shuffles; rows in order, one __syncwarp each.
template <class Smem>
__device__ void invert_unit_lower(Smem& sm) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int c = 8 * warp + lane / 4, r = lane % 4;
  for (int t = 0; t < kChunk; ++t) {
    float acc = 0.0f;
    for (int s = c + r; s < t; s += 4) acc += sm.A[t][s] * sm.Ti[s][c];
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (r == 0) sm.Ti[t][c] = t < c ? 0.0f : (t == c ? 1.0f : -acc);
    __syncwarp();
  }
}

/// Block (value head j, chunk c): writes U = T·diag(β)V, W = T·diag(βγ)K̂ and P of the chunk.
template <int kDk>
__global__ void __launch_bounds__(kPrefillThreads)
gdn_chunk_local_kernel(int Hk, int Hv, int T, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                       const bf16* __restrict__ conv_out, const bf16* __restrict__ a, const bf16* __restrict__ b,
                       int64_t zab_stride, float* __restrict__ ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kDv = kDk;
  LocalSmem<kDk>& sm = *reinterpret_cast<LocalSmem<kDk>*>(smem_raw);
  const int j = blockIdx.x, c = blockIdx.y, kh = j / (Hv / Hk), t0 = c * kChunk;
  const int L = min(kChunk, T - t0);
  const int key_dim = Hk * kDk;
  const int64_t C = 2 * key_dim + int64_t(Hv) * kDv;
  load_chunk(sm, t0, L, j, kh, key_dim, C, conv_out, a, b, zab_stride, A_log[j], dt_bias[j]);
  form_kk_qk(sm);
  __syncthreads();
  float* U = ws + (int64_t(j) * gridDim.y + c) * local_floats(kDk);
  float* W = U + kChunk * kDk;
  float* P = W + kChunk * kDk;
  for (int i = threadIdx.x; i < kChunk * kChunk; i += kPrefillThreads) P[i] = sm.P[i / kChunk][i % kChunk];
  // q̂ is no longer needed: its rows take β_t·v_t.
  for (int i = threadIdx.x; i < kChunk * kDv; i += kPrefillThreads) {
    const int t = i / kDv, m = i % kDv;
    sm.q[t][m] = t < L ? sm.beta[t] * to_f32(conv_out[int64_t(t0 + t) * C + 2 * key_dim + j * kDv + m]) : 0.0f;
  }
  __syncthreads();  // P is out: the inverse may overwrite it
  invert_unit_lower(sm);
  __syncthreads();
  // U and W: thread (ty, tx) rows 4·ty … 4·ty+3, columns tx + 16·e.
  constexpr int kCols = kDk / 16;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  float u[4][kCols] = {}, w[4][kCols] = {};
  for (int s = 0; s < kChunk; ++s) {
    const float bg = sm.beta[s] * expf(sm.g[s]);
    float ti[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) ti[rr] = sm.Ti[4 * ty + rr][s];
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      const float v = sm.q[s][tx + 16 * e], kk = bg * sm.k[s][tx + 16 * e];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        u[rr][e] += ti[rr] * v;
        w[rr][e] += ti[rr] * kk;
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < 4; ++rr)
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      U[(4 * ty + rr) * kDk + tx + 16 * e] = u[rr][e];
      W[(4 * ty + rr) * kDk + tx + 16 * e] = w[rr][e];
    }
}

/// Block (value head j, column slice): the walk over the chunks with Δ = U − W·S from pass 1.
template <int kDk>
__global__ void __launch_bounds__(kPrefillThreads)
gdn_chunk_state_kernel(int Hk, int Hv, int T, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                       const bf16* __restrict__ conv_out, const bf16* __restrict__ a, const bf16* __restrict__ b,
                       int64_t zab_stride, const float* __restrict__ ws, float* __restrict__ state,
                       bf16* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kDv = kDk;
  StateSmem<kDk>& sm = *reinterpret_cast<StateSmem<kDk>*>(smem_raw);
  const int j = blockIdx.x, m0 = blockIdx.y * kBV, kh = j / (Hv / Hk);
  const int key_dim = Hk * kDk, chunks = (T + kChunk - 1) / kChunk;
  const int64_t C = 2 * key_dim + int64_t(Hv) * kDv;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* S = state + int64_t(j) * kDk * kDv;
  for (int i = warp; i < kDk; i += kPrefillWarps) sm.S[i][lane] = S[i * kDv + m0 + lane];
  const float A_log_j = A_log[j], dt_bias_j = dt_bias[j];

  for (int c = 0; c < chunks; ++c) {
    const int t0 = c * kChunk, L = min(kChunk, T - t0);
    const float* U = ws + (int64_t(j) * chunks + c) * local_floats(kDk);
    const float* W = U + kChunk * kDk;
    const float* P = W + kChunk * kDk;
    load_chunk(sm, t0, L, j, kh, key_dim, C, conv_out, a, b, zab_stride, A_log_j, dt_bias_j);
    for (int i = threadIdx.x; i < kChunk * kDk / 4; i += kPrefillThreads) {
      const int t = i / (kDk / 4), e = 4 * (i % (kDk / 4));
      *reinterpret_cast<float4*>(&sm.W[t][e]) = *reinterpret_cast<const float4*>(W + t * kDk + e);
    }
    for (int i = threadIdx.x; i < kChunk * kChunk; i += kPrefillThreads) sm.P[i / kChunk][i % kChunk] = P[i];
    __syncthreads();
    // Δ_t = U_t − W_tᵀS and QS_t = γ_t·S0ᵀq_t; warp w rows t ≡ w (mod 8), lane = column.
    for (int t = warp; t < kChunk; t += kPrefillWarps) {
      float ws_acc = 0.0f, qs = 0.0f;
#pragma unroll 8
      for (int i = 0; i < kDk; ++i) {
        ws_acc += sm.W[t][i] * sm.S[i][lane];
        qs += sm.q[t][i] * sm.S[i][lane];
      }
      sm.R[t][lane] = U[t * kDk + m0 + lane] - ws_acc;
      sm.QS[t][lane] = expf(sm.g[t]) * qs;
    }
    __syncthreads();
    chunk_output(sm, t0, L, out, int64_t(Hv) * kDv, j * kDv + m0);
    __syncthreads();
    update_state(sm, L);
    __syncthreads();
  }
  for (int i = warp; i < kDk; i += kPrefillWarps) S[i * kDv + m0 + lane] = sm.S[i][lane];
}

/// Gated RMSNorm in place over rows of bf16 pre-norm outputs: block (token, value head),
/// thread per value dim (kDv threads).
template <int kDv>
__global__ void __launch_bounds__(kDv)
gated_norm_kernel(int Hv, float eps, const float* __restrict__ norm_w,
                  const bf16* __restrict__ z, int64_t z_stride, bf16* __restrict__ io) {
  __shared__ float scratch[32];
  const int t = blockIdx.x, j = blockIdx.y, m = threadIdx.x;
  bf16* row = io + int64_t(t) * Hv * kDv + j * kDv;
  const float o = to_f32(row[m]);
  const float y = gated_norm_value<kDv>(o, to_f32(z[int64_t(t) * z_stride + j * kDv + m]), norm_w[m],
                                   eps, scratch);
  row[m] = to_bf16(y);
}

/// LILY_CUDA_REQUIRE with this file's prefix.
#define MIXER_REQUIRE(ok, ...) LILY_CUDA_REQUIRE(ok, "GDN kernels", __VA_ARGS__)

void check_dims(const GdnDims& d) {
  MIXER_REQUIRE(d.key_head_dim == d.value_head_dim && (d.key_head_dim == 64 || d.key_head_dim == 128),
          "head dims Dk=" + std::to_string(d.key_head_dim) + " Dv=" +
              std::to_string(d.value_head_dim) + " unsupported (kernels are compiled for Dk = Dv = 64 or 128)");
  MIXER_REQUIRE(d.conv_kernel == kConvK,
          "conv kernel " + std::to_string(d.conv_kernel) + " unsupported (compiled for 4)");
  MIXER_REQUIRE(d.n_key_heads > 0 && d.n_value_heads > 0 && d.n_value_heads % d.n_key_heads == 0,
          "value heads (" + std::to_string(d.n_value_heads) + ") must be a positive multiple of key heads (" +
              std::to_string(d.n_key_heads) + ")");
}

/// Calls f(std::integral_constant<int, D>{}) for the runtime head dim D = Dk = Dv (checked by
/// check_dims first).
template <typename F>
void dispatch_head_dim(const GdnDims& d, F&& f) {
  switch (d.key_head_dim) {
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    default: MIXER_REQUIRE(false, "head dim " + std::to_string(d.key_head_dim) + " unsupported");
  }
}

/// Launches the fused decode step for head dim D: grid (Hv, D/32), clusters of (1, D/32, 1).
template <int D>
void launch_decode(const GdnDims& dims, const GdnParams& params, const bf16* conv_out,
                   const bf16* z, const bf16* a, const bf16* b, float* state, bf16* out,
                   cudaStream_t stream) {
  using Geom = DecodeGeom<D>;
  // Compile-time cluster dims (__cluster_dims__) carry over to cudaLaunchKernelEx.
  launch_pdl(gdn_decode_kernel<D>, dim3(dims.n_value_heads, Geom::kSlices), dim3(Geom::kThreads), 0, stream,
      dims.n_key_heads, dims.n_value_heads, dims.norm_eps, params.A_log, params.dt_bias,
      params.norm_w, conv_out, z, a, b, state, out);
}

/// Launches the batched decode step for head dim D: grid (Hv, D/32, rows), clusters of (1, D/32, 1).
template <int D>
void launch_decode_rows(const GdnDims& dims, const GdnParams& params, int rows, const bf16* conv_out,
                        const bf16* z, const bf16* a, const bf16* b, int64_t zab_stride, float* const* states,
                        bf16* out, cudaStream_t stream) {
  using Geom = DecodeGeom<D>;
  launch_pdl(gdn_decode_rows_kernel<D>, dim3(dims.n_value_heads, Geom::kSlices, rows), dim3(Geom::kThreads), 0,
             stream, dims.n_key_heads, dims.n_value_heads, dims.norm_eps, params.A_log, params.dt_bias,
             params.norm_w, conv_out, z, a, b, zab_stride, states, out);
}

/// Launches the chunked prefill (two passes when `ws` is given, else one kernel) and the gated
/// norm for head dim D.
template <int D>
void launch_prefill(const GdnDims& dims, const GdnParams& params, int T, const bf16* conv_out,
                    const bf16* z, const bf16* a, const bf16* b, int64_t zab_stride, float* state,
                    bf16* out, float* ws, cudaStream_t stream) {
  const dim3 grid(dims.n_value_heads, D / kBV);
  if (ws) {
    const size_t local_smem = sizeof(LocalSmem<D>), state_smem = sizeof(StateSmem<D>);
    raise_smem_limit(gdn_chunk_local_kernel<D>, local_smem);
    raise_smem_limit(gdn_chunk_state_kernel<D>, state_smem);
    const dim3 local_grid(dims.n_value_heads, static_cast<unsigned>(ceil_div(T, kChunk)));
    gdn_chunk_local_kernel<D><<<local_grid, kPrefillThreads, local_smem, stream>>>(
        dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b, zab_stride, ws);
    LILY_CUDA_CHECK_LAUNCH();
    gdn_chunk_state_kernel<D><<<grid, kPrefillThreads, state_smem, stream>>>(
        dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b, zab_stride, ws,
        state, out);
    LILY_CUDA_CHECK_LAUNCH();
  } else {
    const size_t smem = sizeof(PrefillSmem<D>);
    raise_smem_limit(gdn_prefill_chunked_kernel<D>, smem);
    gdn_prefill_chunked_kernel<D><<<grid, kPrefillThreads, smem, stream>>>(
        dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b,
        zab_stride, state, out);
    LILY_CUDA_CHECK_LAUNCH();
  }
  gated_norm_kernel<D><<<dim3(T, dims.n_value_heads), D, 0, stream>>>(
      dims.n_value_heads, dims.norm_eps, params.norm_w, z, zab_stride, out);
  LILY_CUDA_CHECK_LAUNCH();
}

void check_params(const GdnParams& p) {
  MIXER_REQUIRE(p.conv_w && p.A_log && p.dt_bias && p.norm_w, "a GdnParams pointer is null");
}

}  // namespace

GdnDims gdn_dims(const ModelConfig& config) {
  GdnDims d;
  d.n_key_heads = config.gdn_n_key_heads;
  d.n_value_heads = config.gdn_n_value_heads;
  d.key_head_dim = config.gdn_key_head_dim;
  d.value_head_dim = config.gdn_value_head_dim;
  d.conv_kernel = config.gdn_conv_kernel;
  d.norm_eps = config.rms_norm_eps;
  check_dims(d);
  return d;
}

void gdn_conv_decode(const GdnDims& dims, const GdnParams& params, const bf16* qkv, bf16* window,
                     bf16* out, cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  MIXER_REQUIRE(qkv && window && out, "gdn_conv_decode: null buffer");
  MIXER_REQUIRE(qkv != out, "gdn_conv_decode: out must not alias qkv");
  const int C = dims.conv_channels();
  launch_pdl(conv_decode_kernel, dim3(static_cast<unsigned>(ceil_div(C, 256))), dim3(256), 0, stream, C, params.conv_w,
             qkv, window, out);
}

void gdn_decode(const GdnDims& dims, const GdnParams& params, const bf16* conv_out, const bf16* z,
                const bf16* a, const bf16* b, float* state, bf16* out, cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  MIXER_REQUIRE(conv_out && z && a && b && state && out, "gdn_decode: null buffer");
  dispatch_head_dim(dims, [&](auto d) {
    launch_decode<decltype(d)::value>(dims, params, conv_out, z, a, b, state, out, stream);
  });
  LILY_CUDA_CHECK_LAUNCH();
}

void gdn_conv_decode_rows(const GdnDims& dims, const GdnParams& params, int rows, const bf16* qkv,
                          int64_t qkv_stride, bf16* const* windows, bf16* out, cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  const int C = dims.conv_channels();
  MIXER_REQUIRE(rows >= 1 && rows <= kMaxDecodeRows,
                "gdn_conv_decode_rows: rows=" + std::to_string(rows) + " outside [1, 8]");
  MIXER_REQUIRE(qkv && windows && out, "gdn_conv_decode_rows: null buffer");
  MIXER_REQUIRE(qkv_stride >= C, "gdn_conv_decode_rows: qkv row stride too small");
  MIXER_REQUIRE(qkv + (rows - 1) * qkv_stride + C <= out || out + int64_t(rows) * C <= qkv,
                "gdn_conv_decode_rows: out must not overlap qkv");
  launch_pdl(conv_decode_rows_kernel, dim3(static_cast<unsigned>(ceil_div(C, 256)), rows), dim3(256), 0, stream, C,
             params.conv_w, qkv, qkv_stride, windows, out);
}

void gdn_decode_rows(const GdnDims& dims, const GdnParams& params, int rows, const bf16* conv_out, const bf16* z,
                     const bf16* a, const bf16* b, int64_t zab_stride, float* const* states, bf16* out,
                     cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  MIXER_REQUIRE(rows >= 1 && rows <= kMaxDecodeRows,
                "gdn_decode_rows: rows=" + std::to_string(rows) + " outside [1, 8]");
  MIXER_REQUIRE(conv_out && z && a && b && states && out, "gdn_decode_rows: null buffer");
  MIXER_REQUIRE(zab_stride >= dims.value_dim(), "gdn_decode_rows: z/a/b row stride below Hv·Dv");
  dispatch_head_dim(dims, [&](auto d) {
    launch_decode_rows<decltype(d)::value>(dims, params, rows, conv_out, z, a, b, zab_stride, states, out, stream);
  });
  LILY_CUDA_CHECK_LAUNCH();
}

void gdn_conv_prefill(const GdnDims& dims, const GdnParams& params, int T, const bf16* qkv,
                      int64_t qkv_stride, bf16* window, bf16* out, cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  const int C = dims.conv_channels();
  MIXER_REQUIRE(T >= 1 && T <= 65535, "gdn_conv_prefill: T=" + std::to_string(T) + " outside [1, 65535]");
  MIXER_REQUIRE(qkv_stride >= C, "gdn_conv_prefill: qkv row stride " + std::to_string(qkv_stride) +
                               " < conv channels " + std::to_string(C));
  MIXER_REQUIRE(qkv && window && out, "gdn_conv_prefill: null buffer");
  conv_prefill_kernel<<<dim3(ceil_div(C, 256), T), 256, 0, stream>>>(C, T, params.conv_w, qkv,
                                                                      qkv_stride, window, out);
  LILY_CUDA_CHECK_LAUNCH();
  conv_window_update_kernel<<<ceil_div(C, 256), 256, 0, stream>>>(C, T, qkv, qkv_stride, window);
  LILY_CUDA_CHECK_LAUNCH();
}

size_t gdn_prefill_workspace_bytes(const GdnDims& dims, int T) {
  check_dims(dims);
  MIXER_REQUIRE(T >= 1 && T <= 65535, "gdn_prefill_workspace_bytes: T=" + std::to_string(T) + " outside [1, 65535]");
  return static_cast<size_t>(dims.n_value_heads) * static_cast<size_t>(ceil_div(T, kChunk)) *
         static_cast<size_t>(local_floats(dims.key_head_dim)) * sizeof(float);
}

void gdn_prefill(const GdnDims& dims, const GdnParams& params, int T, const bf16* conv_out,
                 const bf16* z, const bf16* a, const bf16* b, int64_t zab_stride, float* state,
                 bf16* out, cudaStream_t stream, float* workspace, size_t workspace_bytes) {
  check_dims(dims);
  check_params(params);
  MIXER_REQUIRE(T >= 1 && T <= 65535, "gdn_prefill: T=" + std::to_string(T) + " outside [1, 65535]");
  MIXER_REQUIRE(conv_out && z && a && b && state && out, "gdn_prefill: null buffer");
  MIXER_REQUIRE(zab_stride >= dims.n_value_heads,
          "gdn_prefill: z/a/b row stride " + std::to_string(zab_stride) + " too small");
  // The two-pass form when it is switched on and the caller gave it room; else one kernel.
  float* ws = nullptr;
  if (workspace && gdn_chunk_parallel_enabled()) {
    MIXER_REQUIRE(workspace_bytes >= gdn_prefill_workspace_bytes(dims, T),
                  "gdn_prefill: workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                      std::to_string(gdn_prefill_workspace_bytes(dims, T)) + " needed for T=" + std::to_string(T));
    ws = workspace;
  }
  dispatch_head_dim(dims, [&](auto d) {
    launch_prefill<decltype(d)::value>(dims, params, T, conv_out, z, a, b, zab_stride, state,
                                       out, ws, stream);
  });
}

}  // namespace lily::cuda
