// Gated DeltaNet kernels (docs/model.md §3.3, numerics §4.3/§4.4): causal conv (decode
// step and prefill), the fused per-value-head decode step, the chunked (UT/WY) prefill of the
// delta rule, and the gated RMSNorm. Launchers are declared in mixer_kernels.h.
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/mma.cuh"

#include <cooperative_groups.h>

namespace lily::cuda {
namespace {

namespace cg = cooperative_groups;

// Key and value head dims are equal (Dk = Dv = D) and a template parameter D ∈ {64, 128}; the
// launchers dispatch on the runtime dims (dispatch_head_dim below).
constexpr int kConvK = 4;      // conv kernel width
constexpr int kHist = kConvK - 1;


// ---- causal conv -----------------------------------------------------------------------------

// silu_precise, conv_dot and conv_decode_value live in gdn_conv.cuh (shared with the GEMV's
// conv epilogue, quant_gemv.cu, and the persistent decode kernel's GDN task), with the gate
// math (softplus20, log_decay, beta_gate), kL2Eps and the gated norm's gated_norm_r / _y.

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

// Conv prefill geometry: a thread owns kCh adjacent channels (2 when the rows allow bf16-pair
// loads, else 1) and a run of kConvRun consecutive tokens; adjacent lanes own adjacent channels
// so that a warp's loads of one token are contiguous.
constexpr int kConvRun = 16;
constexpr int kConvThreads = 256;

/// kCh adjacent bf16 channels loaded as one: a bf16 pair or a single bf16.
template <int kCh>
using ConvRaw = std::conditional_t<kCh == 2, __nv_bfloat162, bf16>;

/// Channel i of a raw conv input as fp32 (exact).
__device__ __forceinline__ float conv_raw_f32(bf16 v, int) { return to_f32(v); }
__device__ __forceinline__ float conv_raw_f32(__nv_bfloat162 v, int i) { return to_f32(i == 0 ? v.x : v.y); }

/// Old-window slot k (token k − (K−1) relative to the chunk start) of channels [c, c+kCh).
template <int kCh>
__device__ __forceinline__ ConvRaw<kCh> conv_window_inputs(const bf16* window, int c, int k) {
  const bf16 v = window[int64_t(c) * kHist + k];
  if constexpr (kCh == 2) return __halves2bfloat162(v, window[int64_t(c + 1) * kHist + k]);
  else return v;
}

/// Raw conv inputs of channels [c, c+kCh) at chunk token u ≥ 0: one load (c even when kCh = 2).
template <int kCh>
__device__ __forceinline__ ConvRaw<kCh> conv_row_inputs(const bf16* qkv, int64_t stride, int c, int u) {
  return *reinterpret_cast<const ConvRaw<kCh>*>(qkv + int64_t(u) * stride + c);
}

/// Conv over T tokens as a sliding window: grid (channel groups, token runs), thread per kCh
/// channels × the kConvRun tokens [t0, t0+run). The thread loads the K−1 inputs before its run
/// (the old window's for the first run, as conv_input) and the run's own inputs, each once and
/// all before any arithmetic (so they are in flight together), then steps token by token with
/// conv_decode_value's arithmetic: outputs bit-identical to T decode steps. The K−1 inputs
/// before a run are the previous run's last ones (read twice in all, mostly from L2). Reads
/// the old window; does not write it. kCh = 2 needs C, the stride and qkv/out 2-element
/// aligned (the launcher checks).
template <int kCh>
__global__ void __launch_bounds__(kConvThreads)
conv_prefill_kernel(int C, int T, const float* __restrict__ conv_w, const bf16* __restrict__ qkv, int64_t stride,
                    const bf16* __restrict__ window, bf16* __restrict__ out) {
  static_assert(kConvK == 4 && kConvRun >= kHist, "conv_dot takes 4 taps; the history of a run lies in one place");
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kCh;
  const int t0 = blockIdx.y * kConvRun;
  if (c >= C) return;
  // raw[s] = the inputs at token t0 − (K−1) + s.
  ConvRaw<kCh> raw[kHist + kConvRun];
#pragma unroll
  for (int k = 0; k < kHist; ++k)
    raw[k] = t0 == 0 ? conv_window_inputs<kCh>(window, c, k) : conv_row_inputs<kCh>(qkv, stride, c, t0 - kHist + k);
#pragma unroll
  for (int s = 0; s < kConvRun; ++s)  // tokens past T re-read row T−1 (unpredicated loads; unused)
    raw[kHist + s] = conv_row_inputs<kCh>(qkv, stride, c, min(t0 + s, T - 1));
  float w[kCh][kConvK];
#pragma unroll
  for (int i = 0; i < kCh; ++i)
#pragma unroll
    for (int k = 0; k < kConvK; ++k) w[i][k] = conv_w[int64_t(c + i) * kConvK + k];
  const int run = min(kConvRun, T - t0);
#pragma unroll
  for (int s = 0; s < kConvRun; ++s) {
    if (s >= run) break;
    bf16 y[kCh];
#pragma unroll
    for (int i = 0; i < kCh; ++i)
      y[i] = to_bf16(silu_precise(conv_dot(conv_raw_f32(raw[s], i), conv_raw_f32(raw[s + 1], i),
                                           conv_raw_f32(raw[s + 2], i), conv_raw_f32(raw[s + 3], i), w[i])));
    bf16* o = out + int64_t(t0 + s) * C + c;
    if constexpr (kCh == 2) *reinterpret_cast<__nv_bfloat162*>(o) = __halves2bfloat162(y[0], y[1]);
    else *o = y[0];
  }
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

/// This thread's part of the decode step's state slice: S_j[i][col] (fp32, as stored) for its
/// key rows i = 16·part … 16·part + 15, where j = blockIdx.x is the value head, part = tid / 32
/// and col = 32·blockIdx.y + tid % 32 (gdn_decode_head's mapping). `state`: fp32
/// [Hv, Dk, Dv], one sequence's recurrent state of this layer. The loads bypass L1 (`__ldcg`):
/// the callers issue them before the PDL wait, and L2 holds every completed kernel's stores.
template <int D>
__device__ __forceinline__ void load_state_slice(const float* state, float (&raw)[DecodeGeom<D>::kRowsPerPart]) {
  using Geom = DecodeGeom<D>;
  const int part = threadIdx.x / Geom::kSliceCols;
  const int col = blockIdx.y * Geom::kSliceCols + threadIdx.x % Geom::kSliceCols;
  const float* S = state + int64_t(blockIdx.x) * D * D;
#pragma unroll
  for (int r = 0; r < Geom::kRowsPerPart; ++r) raw[r] = __ldcg(S + (part * Geom::kRowsPerPart + r) * D + col);
}

/// A cluster of D/32 CTAs per value head j (compile-time cluster dims); CTA y owns value
/// columns [32y, 32y+32). Each CTA: q̂/k̂ L2 norms and gates (redundantly), the delta-rule step
/// on its D×32 slice of S_j (fp32, in place), bf16 output; the gated RMSNorm's Σo² is summed
/// over the cluster through distributed shared memory. Thread (part, m): column m of the
/// slice, key rows [16·part, +16).
/// The body of gdn_decode_kernel, shared with the batched kernel (gdn_decode_rows_kernel): the
/// caller has run pdl_prologue, passes one sequence's buffers and has loaded this thread's part
/// of the state slice into `raw` (load_state_slice).
template <int D>
__device__ __forceinline__ void gdn_decode_head(int Hk, int Hv, float eps, const float* __restrict__ A_log,
                  const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
                  const bf16* __restrict__ conv_out, const bf16* __restrict__ z,
                  const bf16* __restrict__ a, const bf16* __restrict__ b,
                  float* __restrict__ state, bf16* __restrict__ out,
                  const float (&raw)[DecodeGeom<D>::kRowsPerPart]) {
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

  // Every input of the step is requested here at once, before the first barrier, so that the
  // step pays one round trip to L2 rather than one per phase (q/k, then v, then z): this
  // thread's element of q or k, its column's v, the gate inputs (thread 0) and its column's z
  // and norm weight (warp 0, which stores the output).
  const int base = (tid < kDk ? 0 : key_dim) + kh * kDk;
  const bf16 x_in = conv_out[base + tid % kDk];
  const bf16 v_in = conv_out[2 * key_dim + j * kDv + col];
  bf16 a_in{}, b_in{}, z_in{};
  float a_log = 0.0f, dt = 0.0f, gain = 0.0f;
  if (tid == 0) {
    a_in = a[j];
    b_in = b[j];
    a_log = A_log[j];
    dt = dt_bias[j];
  }
  if (tid < kWarp) {
    z_in = z[j * kDv + col];
    gain = norm_w[col];
  }

  // q (threads 0..127) and k (threads 128..255) of key head kh, L2-normalised in fp32.
  const float x = to_f32(x_in);
  const float sq = warp_sum(x * x);
  if (tid % kWarp == 0) scratch[tid / kWarp] = sq;
  if (tid == 0) {
    gates[0] = expf(log_decay(to_f32(a_in), a_log, dt));
    gates[1] = beta_gate(to_f32(b_in));
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
    s[r] = alpha * raw[r];
    pred += k_s[i] * s[r];
  }
  part_s[part][m] = pred;
  __syncthreads();
  pred = 0.0f;
#pragma unroll
  for (int p = 0; p < kDecodeParts; ++p) pred += part_s[p][m];
  const float delta = (to_f32(v_in) - pred) * beta;
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
    const float rr = gated_norm_r(head_sq, kDv, eps);
    const float y = gated_norm_y(o, rr, gain, to_f32(z_in));
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
  // The state is requested before the wait (launch.cuh, rule 4): its last writer is this layer's
  // step of the previous token (or a prefill, a copy), never the immediate predecessor (the
  // in-projection or the conv step), so its loads overlap that kernel's tail.
  float raw[DecodeGeom<D>::kRowsPerPart];
  load_state_slice<D>(state, raw);
  pdl_prologue();
  gdn_decode_head<D>(Hk, Hv, eps, A_log, dt_bias, norm_w, conv_out, z, a, b, state, out, raw);
}

/// Batched decode: grid (Hv, D/32, row), the same clusters; row r is gdn_decode_kernel over its
/// own buffers: conv_out + r·C, z/a/b + r·zab_stride, the state states[r], out + r·Hv·Dv. Each
/// cluster works on one row only, so a row's arithmetic is that of the sequence alone. Held to
/// 48 registers, five CTAs an SM (unbounded the row offsets take it to 56, four).
template <int D>
__global__ void __cluster_dims__(1, DecodeGeom<D>::kSlices, 1)
__launch_bounds__(DecodeGeom<D>::kThreads, 5) gdn_decode_rows_kernel(int Hk, int Hv, float eps,
                  const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                  const float* __restrict__ norm_w, const bf16* __restrict__ conv_out,
                  const bf16* __restrict__ z, const bf16* __restrict__ a, const bf16* __restrict__ b,
                  int64_t zab_stride, float* const* __restrict__ states, bf16* __restrict__ out) {
  // states[] (written by the step's copy-in) and the state itself are read before the wait, as
  // in gdn_decode_kernel: neither has the immediate predecessor as its last writer.
  const int64_t r = blockIdx.z;
  float* state = states[r];
  float raw[DecodeGeom<D>::kRowsPerPart];
  load_state_slice<D>(state, raw);
  pdl_prologue();
  const int C = 2 * Hk * D + Hv * D;
  gdn_decode_head<D>(Hk, Hv, eps, A_log, dt_bias, norm_w, conv_out + r * C, z + r * zab_stride,
                     a + r * zab_stride, b + r * zab_stride, state, out + r * Hv * D, raw);
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
/// any of the prefill shared-memory layouts (members q, k, g, beta; kDim = Dk). When `r_out` is
/// given (shared memory, 2·64 floats), r_out[t] and r_out[64 + t] get the factors that took row t
/// of q and of k from its bf16 values to q̂_t / k̂_t.
template <class Smem>
__device__ void load_chunk(Smem& sm, int t0, int L, int j, int kh, int key_dim,
                           int64_t C, const bf16* conv_out, const bf16* a, const bf16* b,
                           int64_t zab_stride, float A_log_j, float dt_bias_j, float* r_out = nullptr) {
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
    if (r_out && lane == 0) r_out[row] = r;
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
// Pass 2 by default runs on tensor cores instead (gdn_chunk_state_mma_kernel below, near-fp32
// split-tf32 products); gdn_chunk_state_kernel, the fp32 walk, stays for LILY_CUDA_GDN_STATE_MMA=0.

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
  float rnorm[2 * kChunk];  // q̂_t = rnorm[t]·q_t, k̂_t = rnorm[64 + t]·k_t (q_t, k_t the bf16 rows)
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

/// Floats of the workspace per (value head, chunk): U and W [64][D], P [64][64], then the row
/// scales SC [4][64] that the tensor-core pass 2 applies to the chunk's bf16 q and k rows:
///   SC[0][t] = γ_t·rq_t                          (γ_t S0ᵀq̂_t = SC[0][t]·S0ᵀq_t)
///   SC[1][t] = rk_t·e^{g_L−g_t} for t < L, else 0 (k̂_t e^{g_L−g_t} = SC[1][t]·k_t)
///   SC[2][t] = γ_L (every t), SC[3][t] = 0
/// with rq_t, rk_t the L2-norm factors of load_chunk (q̂_t = rq_t·q_t, k̂_t = rk_t·k_t).
__host__ __device__ constexpr int64_t local_floats(int D) { return int64_t{kChunk} * (2 * D + kChunk + 4); }

/// Thread t < kChunk: column t of pass 1's per-row scales SC [4][kChunk]: γ_t·rq_t, rk_t·γ_L/γ_t
/// for t < L (0 past L), γ_L and 0, with g the cumulative log decays (γ_L = exp g[L − 1]) and
/// rq, rk the norm factors of q̂ and k̂.
__device__ __forceinline__ void write_chunk_scales(float* SC, const float* g, const float* rq, const float* rk, int L,
                                                   int t) {
  const float g_last = g[L - 1];
  SC[t] = expf(g[t]) * rq[t];
  SC[kChunk + t] = t < L ? rk[t] * expf(g_last - g[t]) : 0.0f;
  SC[2 * kChunk + t] = expf(g_last);
  SC[3 * kChunk + t] = 0.0f;
}

/// Rows and columns of the diagonal blocks that invert_unit_lower inverts by substitution.
constexpr int kInvBlock = 16;

/// One doubling step of invert_unit_lower: for each of the kChunk / (2n) diagonal blocks of
/// size 2n, [[X, 0], [C, Y]] with X⁻¹ and Y⁻¹ already in sm.Ti, writes its lower-left block
/// −Y⁻¹·(C·X⁻¹) into sm.Ti. The product C·X⁻¹ goes first into the block it will be replaced by.
/// X⁻¹ and Y⁻¹ hold explicit zeros above their diagonals, so sums may run over whole rows.
template <int n, class Smem>
__device__ __forceinline__ void merge_inverse_blocks(Smem& sm) {
  constexpr int kOut = (kChunk / (2 * n)) * n * n / kPrefillThreads;  // outputs per thread
  static_assert(kOut * kPrefillThreads == (kChunk / (2 * n)) * n * n && kPrefillThreads % n == 0, "merge tiling");
  // Output e of this thread: block p, row r (of the lower half), column c (the same for every e).
  const int c = threadIdx.x % n;
  int base[kOut], r[kOut];
#pragma unroll
  for (int e = 0; e < kOut; ++e) {
    const int idx = threadIdx.x + e * kPrefillThreads;
    base[e] = 2 * n * (idx / (n * n));
    r[e] = (idx / n) % n;
  }
  float z[kOut] = {};
  for (int k = c; k < n; ++k) {  // Z = C·X⁻¹ (X⁻¹[k][c] = 0 for k < c)
#pragma unroll
    for (int e = 0; e < kOut; ++e) z[e] += sm.A[base[e] + n + r[e]][base[e] + k] * sm.Ti[base[e] + k][base[e] + c];
  }
#pragma unroll
  for (int e = 0; e < kOut; ++e) sm.Ti[base[e] + n + r[e]][base[e] + c] = z[e];
  __syncthreads();
  float t[kOut] = {};
  for (int k = 0; k < n; ++k) {  // −Y⁻¹·Z (Y⁻¹[r][k] = 0 for k > r)
#pragma unroll
    for (int e = 0; e < kOut; ++e)
      t[e] += sm.Ti[base[e] + n + r[e]][base[e] + n + k] * sm.Ti[base[e] + n + k][base[e] + c];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < kOut; ++e) sm.Ti[base[e] + n + r[e]][base[e] + c] = -t[e];
  __syncthreads();
}

/// sm.Ti = (I + sm.A)^{-1}, A strictly lower triangular (only A[t][s] with s < t is read), by
/// blocks: the four 16×16 diagonal blocks by forward substitution (thread c < 64 owns column c
/// of its block in registers, no synchronisation), then two doubling steps 16 → 32 → 64 with
/// [[X, 0], [C, Y]]⁻¹ = [[X⁻¹, 0], [−Y⁻¹·C·X⁻¹, Y⁻¹]]. The chain of dependent steps is 16 rows
/// and four small products long, where a column-by-column substitution over 64 rows is 64 rows
/// long. fp32 throughout; Ti is zero above the diagonal. Ends with __syncthreads.
template <class Smem>
__device__ void invert_unit_lower(Smem& sm) {
  static_assert(kChunk == 4 * kInvBlock, "two doubling steps");
  if (threadIdx.x < kChunk) {
    const int b0 = threadIdx.x - threadIdx.x % kInvBlock, cl = threadIdx.x % kInvBlock;
    float col[kInvBlock];
#pragma unroll
    for (int t = 0; t < kInvBlock; ++t) {
      float acc = 0.0f;
#pragma unroll
      for (int s = 0; s < t; ++s) acc += sm.A[b0 + t][b0 + s] * col[s];
      col[t] = t < cl ? 0.0f : (t == cl ? 1.0f : -acc);
    }
#pragma unroll
    for (int t = 0; t < kInvBlock; ++t) sm.Ti[b0 + t][b0 + cl] = col[t];
  }
  for (int i = threadIdx.x; i < kChunk * kChunk; i += kPrefillThreads) {  // zero above the diagonal blocks
    const int t = i / kChunk, s = i % kChunk;
    if (s / kInvBlock > t / kInvBlock) sm.Ti[t][s] = 0.0f;
  }
  __syncthreads();
  merge_inverse_blocks<kInvBlock>(sm);
  merge_inverse_blocks<2 * kInvBlock>(sm);
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
  load_chunk(sm, t0, L, j, kh, key_dim, C, conv_out, a, b, zab_stride, A_log[j], dt_bias[j], sm.rnorm);
  form_kk_qk(sm);
  __syncthreads();
  float* U = ws + (int64_t(j) * gridDim.y + c) * local_floats(kDk);
  float* W = U + kChunk * kDk;
  float* P = W + kChunk * kDk;
  float* SC = P + kChunk * kChunk;
  if (threadIdx.x < kChunk) write_chunk_scales(SC, sm.g, sm.rnorm, sm.rnorm + kChunk, L, threadIdx.x);
  for (int i = threadIdx.x; i < kChunk * kChunk; i += kPrefillThreads) P[i] = sm.P[i / kChunk][i % kChunk];
  // q̂ is no longer needed: its rows take β_t·v_t.
  for (int i = threadIdx.x; i < kChunk * kDv; i += kPrefillThreads) {
    const int t = i / kDv, m = i % kDv;
    sm.q[t][m] = t < L ? sm.beta[t] * to_f32(conv_out[int64_t(t0 + t) * C + 2 * key_dim + j * kDv + m]) : 0.0f;
  }
  __syncthreads();  // P is out: the inverse may overwrite it
  invert_unit_lower(sm);
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

// ---- pass 1 on tensor cores (LILY_CUDA_GDN_LOCAL_MMA=1, the default) -----------------------
//
// The same U, W, P and row scales as gdn_chunk_local_kernel, formed from the chunk's bf16 rows
// q_t, k_t, v_t (q̂_t = rq_t·q_t, k̂_t = rk_t·k_t with the L2-norm factors of load_chunk):
//   KKᵀ, QKᵀ  (64×64, inner dim Dk): bf16 mma.sync m16n8k16 on the raw rows. A product of two
//             bf16 values is exact in fp32 and the sums are fp32, so these are the fp32 dot
//             products but for the order of the additions. Norms, gates and decays go in the
//             epilogue: A[t][s] = β_t·e^{g_t−g_s}·rk_t·rk_s·(k_t·k_s) for s < t,
//             P[t][s] = e^{g_t−g_s}·rq_t·rk_s·(q_t·k_s) for s ≤ t, zero above.
//   T = (I + A)^{-1}: invert_unit_lower (16×16 diagonal blocks, then two doubling steps), fp32
//             on CUDA cores.
//   U = T·diag(β)·V, W = T·diag(β·γ·rk)·K: tf32 m16n8k8 with the column-scaled T split in two
//             tf32 parts as the A operand (hi + lo: near-fp32 products) and the raw bf16 rows as
//             B (exact in tf32): two MMAs per product.
// The rows arrive by 16-byte cp.async (zero-filled past L) in one round trip, where the fp32
// form loads them row by row and sums the gates on one thread.

/// Shared memory of the tensor-core pass 1 (kDk = Dk = Dv). bf16 rows of kDk + 8 elements
/// (≡ 4 words mod 32): the fragment loads of a warp hit distinct banks. A and Ti have rows of
/// kChunk + 4 floats (≡ 4 mod 32) for the same reason: Ti is read as A fragments when U and W
/// are formed, and A is stored from accumulator fragments.
template <int kDk>
struct LocalMmaSmem {
  static constexpr int kXPad = kDk + 8;
  union {  // the q rows are read only before the inverse is formed
    alignas(16) uint16_t q[kChunk][kXPad];  // bf16 bits of the chunk's rows, zero past L
    float Ti[kChunk][kChunk + 4];           // (I + A)^{-1}
  };
  alignas(16) uint16_t k[kChunk][kXPad];
  uint16_t v[kChunk][kXPad];
  float A[kChunk][kChunk + 4];   // β_t e^{g_t−g_s} k̂_t·k̂_s for s < t (the rest is not read)
  float g[kChunk];               // cumulative log decay
  float beta[kChunk];
  float rq[kChunk];              // q̂_t = rq_t·q_t (1/√Dk included)
  float rk[kChunk];              // k̂_t = rk_t·k_t
};

/// Copies the q, k and v rows of chunk tokens [t0, t0+L) of value head j (key head kh) into sm
/// (rows past L zero-filled) and computes g (inclusive cumulative sum in token order), β and
/// the L2-norm factors rq, rk (load_chunk's formulas). Ends with __syncthreads.
template <int kDk>
__device__ void load_chunk_rows(LocalMmaSmem<kDk>& sm, int t0, int L, int j, int kh, int key_dim, int64_t C,
                                const bf16* conv_out, const bf16* a, const bf16* b, int64_t zab_stride,
                                float A_log_j, float dt_bias_j) {
  constexpr int kPieces = kDk / 8;  // 16-byte pieces per row
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int i = threadIdx.x; i < 3 * kChunk * kPieces; i += kPrefillThreads) {
    const int which = i / (kChunk * kPieces), t = (i / kPieces) % kChunk, e = 8 * (i % kPieces);
    const int64_t col = which == 0 ? int64_t(kh) * kDk
                                   : (which == 1 ? key_dim + int64_t(kh) * kDk : 2 * int64_t(key_dim) + int64_t(j) * kDk);
    uint16_t* dst = which == 0 ? sm.q[t] : (which == 1 ? sm.k[t] : sm.v[t]);
    const bool valid = t < L;
    cp_async16(dst + e, conv_out + (valid ? int64_t(t0 + t) * C + col + e : 0), valid ? 16 : 0);
  }
  cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int t = threadIdx.x;
    const int64_t row = int64_t(t0 + t) * zab_stride;
    sm.g[t] = t < L ? log_decay(to_f32(a[row + j]), A_log_j, dt_bias_j) : 0.0f;
    sm.beta[t] = t < L ? beta_gate(to_f32(b[row + j])) : 0.0f;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp == 0) {  // lane l: tokens 2l, 2l + 1; an inclusive scan of the pair sums, then in order
    const float x0 = sm.g[2 * lane], x1 = sm.g[2 * lane + 1];
    float incl = x0 + x1;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    float before = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) before = 0.0f;
    const float g0 = before + x0;
    sm.g[2 * lane] = g0;
    sm.g[2 * lane + 1] = g0 + x1;
  }
  for (int row = warp; row < 2 * kChunk; row += kPrefillWarps) {  // q rows, then k rows
    const uint16_t* src = row < kChunk ? sm.q[row] : sm.k[row - kChunk];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < kDk / kWarp; ++e) {
      const float x = bits_to_f32(src[lane + e * kWarp]);
      ss += x * x;
    }
    ss = warp_sum(ss);
    if (lane == 0) {
      const float r = 1.0f / sqrtf(ss + kL2Eps);
      if (row < kChunk) sm.rq[row] = r * rsqrtf(float(kDk));
      else sm.rk[row - kChunk] = r;
    }
  }
  __syncthreads();
}

/// The bf16x2 at (row, columns c, c + 1) of a bf16 row tile, as an mma operand register.
template <int kPad>
__device__ __forceinline__ uint32_t bf16_pair(const uint16_t (*rows)[kPad], int row, int c) {
  return *reinterpret_cast<const uint32_t*>(&rows[row][c]);
}

/// KKᵀ and QKᵀ on tensor cores, then A into sm.A and P (64×64 fp32, zero above the diagonal)
/// into global memory. Warp w: rows 16·(w/2) …, columns 32·(w%2) … (four n8 tiles).
template <int kDk>
__device__ void form_kk_qk_mma(LocalMmaSmem<kDk>& sm, float* P) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t4 = lane % 4;
  const int m0 = 16 * (warp / 2), n_base = 32 * (warp % 2);
  float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll
  for (int k0 = 0; k0 < kDk; k0 += 16) {
    const int c = k0 + 2 * t4;
    const uint32_t ak[4] = {bf16_pair(sm.k, m0 + g, c), bf16_pair(sm.k, m0 + g + 8, c), bf16_pair(sm.k, m0 + g, c + 8),
                            bf16_pair(sm.k, m0 + g + 8, c + 8)};
    const uint32_t aq[4] = {bf16_pair(sm.q, m0 + g, c), bf16_pair(sm.q, m0 + g + 8, c), bf16_pair(sm.q, m0 + g, c + 8),
                            bf16_pair(sm.q, m0 + g + 8, c + 8)};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int s = n_base + 8 * nt + g;
      const uint32_t bk[2] = {bf16_pair(sm.k, s, c), bf16_pair(sm.k, s, c + 8)};
      mma_bf16_16816(kk[nt], ak, bk);
      mma_bf16_16816(qk[nt], aq, bk);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
      const int t = m0 + g + 8 * h;
      float p[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = n_base + 8 * nt + 2 * t4 + e;
        const float decay = s <= t ? expf(sm.g[t] - sm.g[s]) : 0.0f;
        sm.A[t][s] = s < t ? sm.beta[t] * decay * (sm.rk[t] * sm.rk[s]) * kk[nt][2 * h + e] : 0.0f;
        p[e] = s <= t ? decay * (sm.rq[t] * sm.rk[s]) * qk[nt][2 * h + e] : 0.0f;
      }
      *reinterpret_cast<float2*>(P + t * kChunk + n_base + 8 * nt + 2 * t4) = make_float2(p[0], p[1]);
    }
}

/// One of U = T·diag(β)·V (kW false) and W = T·diag(β·γ·rk)·K (kW true), 64×Dk fp32, into
/// global memory with split tf32 MMAs. Warp w: rows 16·(w/2) …, columns (Dk/2)·(w%2) … (Dk/16
/// n8 tiles). U and W are formed one after the other to keep the accumulators few (three
/// blocks per SM).
template <bool kW, int kDk>
__device__ void form_u_or_w_mma(LocalMmaSmem<kDk>& sm, float* out) {
  constexpr int kNT = kDk / 16;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t4 = lane % 4;
  const int m0 = 16 * (warp / 2), n_base = (kDk / 2) * (warp % 2);
  const uint16_t(*rows)[LocalMmaSmem<kDk>::kXPad] = kW ? sm.k : sm.v;
  float acc[kNT][4] = {};
#pragma unroll 2
  for (int s0 = 0; s0 < kChunk; s0 += 8) {
    // A fragment: T[row][s]·scale[s] at (g, t4), (g+8, t4), (g, t4+4), (g+8, t4+4), split.
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = m0 + g + 8 * (r % 2), s = s0 + t4 + 4 * (r / 2);
      const float scale = kW ? sm.beta[s] * expf(sm.g[s]) * sm.rk[s] : sm.beta[s];
      split_tf32(sm.Ti[row][s] * scale, a_hi[r], a_lo[r]);
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int col = n_base + 8 * nt + g;
      const uint32_t b[2] = {bf16_bits_to_tf32(rows[s0 + t4][col]), bf16_bits_to_tf32(rows[s0 + t4 + 4][col])};
      mma_tf32_1688(acc[nt], a_hi, b);
      mma_tf32_1688(acc[nt], a_lo, b);
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t at = int64_t(m0 + g + 8 * h) * kDk + n_base + 8 * nt + 2 * t4;
      *reinterpret_cast<float2*>(out + at) = make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
    }
}

/// Block (value head j, chunk c): the workspace of gdn_chunk_local_kernel (U, W, P, SC), on
/// tensor cores. conv_out and ws 16-byte aligned (the launcher checks).
template <int kDk>
__global__ void __launch_bounds__(kPrefillThreads, 3)
gdn_chunk_local_mma_kernel(int Hk, int Hv, int T, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                           const bf16* __restrict__ conv_out, const bf16* __restrict__ a, const bf16* __restrict__ b,
                           int64_t zab_stride, float* __restrict__ ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  LocalMmaSmem<kDk>& sm = *reinterpret_cast<LocalMmaSmem<kDk>*>(smem_raw);
  const int j = blockIdx.x, c = blockIdx.y, kh = j / (Hv / Hk), t0 = c * kChunk;
  const int L = min(kChunk, T - t0);
  const int key_dim = Hk * kDk;
  const int64_t C = 2 * key_dim + int64_t(Hv) * kDk;
  float* U = ws + (int64_t(j) * gridDim.y + c) * local_floats(kDk);
  float* W = U + kChunk * kDk;
  float* P = W + kChunk * kDk;
  float* SC = P + kChunk * kChunk;
  load_chunk_rows(sm, t0, L, j, kh, key_dim, C, conv_out, a, b, zab_stride, A_log[j], dt_bias[j]);
  form_kk_qk_mma(sm, P);
  if (threadIdx.x < kChunk) write_chunk_scales(SC, sm.g, sm.rq, sm.rk, L, threadIdx.x);
  __syncthreads();
  invert_unit_lower(sm);
  form_u_or_w_mma<false>(sm, U);
  form_u_or_w_mma<true>(sm, W);
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

// ---- pass 2 on tensor cores (LILY_CUDA_GDN_STATE_MMA=1, the default) -----------------------
//
// The same walk as gdn_chunk_state_kernel, its four products on mma.sync m16n8k8 with tf32
// inputs and fp32 accumulators. Block (value head j, slice of kMmaBV = 32 value columns),
// 8 warps, per chunk (Δ, O, S of the slice; q_t, k_t the chunk's bf16 rows, SC the row scales
// of pass 1):
//   A  WS = W·S (64×Dk · Dk×32) and QS = Q·S;  Δ = U − WS,  O = SC[0]∘QS,  D = SC[1]∘Δ
//   B  O += P·Δ (64×64 lower triangular · 64×32); o_t written as bf16
//   C  S ← γ_L S + Kᵀ·D (Dk×64 · 64×32)
// Precision. The state is fp32 in registers (its C fragments in phase C) across the chunks and
// its error compounds, so every product keeps near-fp32 accuracy with split tf32 operands:
// x = hi + lo with hi = tf32(x), lo = tf32(x − hi), and a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi
// (the dropped a_lo·b_lo and the truncation of lo are ~2^-22 relative, below fp32's own
// accumulation error over Dk terms). Plain tf32 (2^-11 relative per product) would put an error
// of ~1e-4 relative into the state every chunk. Where one factor is a bf16 row (q_t, k_t: the
// L2-norm factor and the gates are moved onto the other side as the row scales SC), that factor
// is exact in tf32 and two products suffice; W and P (fp32 from pass 1) take three.
// The copy of S in shared memory that phase A reads is kept split (S_hi, S_lo), as are Δ and D.
// Loads (cp.async, one buffer per operand): W, U, q and SC of chunk c+1 are fetched as soon as
// phase A of chunk c is done with them, P and k of chunk c+1 after phases B and C.

constexpr int kMmaBV = 32;             // value columns per block: 4 n8 tiles
constexpr int kMmaNT = kMmaBV / 8;     // n8 tiles per block
constexpr int kColPad = kMmaBV + 8;    // row stride of S, Δ, D, U: B fragments at banks 8t + g

/// Shared memory of the tensor-core pass 2 (kDk = Dk = Dv). Row strides ≡ 4 (mod 32) words for
/// the A-fragment operands (W, P, bf16 q/k) and ≡ 8 for the B-fragment ones: conflict-free.
template <int kDk>
struct MmaStateSmem {
  static constexpr int kWPad = kDk + 4;
  static constexpr int kPPad = kChunk + 4;
  static constexpr int kXPad = kDk + 8;  // bf16 elements per q/k row (a multiple of 8: 16-byte rows)
  alignas(16) float S_hi[kDk][kColPad];  // the state slice split in tf32 parts
  float S_lo[kDk][kColPad];
  float dl_hi[kChunk][kColPad];  // Δ
  float dl_lo[kChunk][kColPad];
  float d_hi[kChunk][kColPad];   // D = SC[1]∘Δ
  float d_lo[kChunk][kColPad];
  float W[kChunk][kWPad];
  float U[kChunk][kColPad];      // the slice's columns of U
  float P[kChunk][kPPad];
  float SC[4][kChunk];
  uint16_t q[kChunk][kXPad];     // bf16 bits of the chunk's q rows (zero rows past L)
  uint16_t k[kChunk][kXPad];
};

/// Issues (without committing) this thread's share of the cp.async copies of W, the slice of
/// U, SC and the bf16 q rows of one chunk (tokens t0 … t0+L−1; rows past L are zero-filled).
template <int kDk>
__device__ __forceinline__ void mma_state_load_wuq(MmaStateSmem<kDk>& sm, const float* U, const float* W,
                                                   const float* SC, const bf16* q_rows, int64_t C, int L, int m0) {
  constexpr int kRowF4 = kDk / 4, kRowX = kDk / 8, kUF4 = kMmaBV / 4;
  for (int i = threadIdx.x; i < kChunk * kRowF4; i += kPrefillThreads) {
    const int t = i / kRowF4, e = 4 * (i % kRowF4);
    cp_async16(&sm.W[t][e], W + t * kDk + e, 16);
  }
  for (int i = threadIdx.x; i < kChunk * kUF4; i += kPrefillThreads) {
    const int t = i / kUF4, e = 4 * (i % kUF4);
    cp_async16(&sm.U[t][e], U + t * kDk + m0 + e, 16);
  }
  for (int i = threadIdx.x; i < kChunk; i += kPrefillThreads) cp_async16(&sm.SC[0][0] + 4 * i, SC + 4 * i, 16);
  for (int i = threadIdx.x; i < kChunk * kRowX; i += kPrefillThreads) {
    const int t = i / kRowX, e = 8 * (i % kRowX);
    const bool valid = t < L;
    cp_async16(&sm.q[t][e], q_rows + (valid ? t : 0) * C + e, valid ? 16 : 0);
  }
}

/// Issues (without committing) this thread's share of the copies of P and the bf16 k rows.
template <int kDk>
__device__ __forceinline__ void mma_state_load_pk(MmaStateSmem<kDk>& sm, const float* P, const bf16* k_rows,
                                                  int64_t C, int L) {
  constexpr int kRowX = kDk / 8, kPF4 = kChunk / 4;
  for (int i = threadIdx.x; i < kChunk * kPF4; i += kPrefillThreads) {
    const int t = i / kPF4, e = 4 * (i % kPF4);
    cp_async16(&sm.P[t][e], P + t * kChunk + e, 16);
  }
  for (int i = threadIdx.x; i < kChunk * kRowX; i += kPrefillThreads) {
    const int t = i / kRowX, e = 8 * (i % kRowX);
    const bool valid = t < L;
    cp_async16(&sm.k[t][e], k_rows + (valid ? t : 0) * C + e, valid ? 16 : 0);
  }
}

/// Stores x at (row, col) of a split pair of arrays (hi, lo), two adjacent columns at once.
__device__ __forceinline__ void store_split2(float* hi_row, float* lo_row, int col, float x0, float x1) {
  uint32_t h0, l0, h1, l1;
  split_tf32(x0, h0, l0);
  split_tf32(x1, h1, l1);
  *reinterpret_cast<float2*>(hi_row + col) = make_float2(__uint_as_float(h0), __uint_as_float(h1));
  *reinterpret_cast<float2*>(lo_row + col) = make_float2(__uint_as_float(l0), __uint_as_float(l1));
}

/// B fragment (k rows k0+t and k0+t+4, column n) of a split [k][kColPad] array pair.
__device__ __forceinline__ void load_b_split(const float (*hi)[kColPad], const float (*lo)[kColPad], int k0, int n,
                                             uint32_t (&b_hi)[2], uint32_t (&b_lo)[2]) {
  const int t = threadIdx.x % 4;
  b_hi[0] = __float_as_uint(hi[k0 + t][n]);
  b_hi[1] = __float_as_uint(hi[k0 + t + 4][n]);
  b_lo[0] = __float_as_uint(lo[k0 + t][n]);
  b_lo[1] = __float_as_uint(lo[k0 + t + 4][n]);
}

/// A fragment (rows r0 and r0+8, columns k0+t and k0+t+4) of an fp32 [rows][N] array, each
/// value split into its tf32 high and low parts.
template <int N>
__device__ __forceinline__ void load_a_split(const float (*a)[N], int r0, int k0, uint32_t (&a_hi)[4],
                                             uint32_t (&a_lo)[4]) {
  const int t = threadIdx.x % 4;
  split_tf32(a[r0][k0 + t], a_hi[0], a_lo[0]);
  split_tf32(a[r0 + 8][k0 + t], a_hi[1], a_lo[1]);
  split_tf32(a[r0][k0 + t + 4], a_hi[2], a_lo[2]);
  split_tf32(a[r0 + 8][k0 + t + 4], a_hi[3], a_lo[3]);
}

/// Block (value head j, slice of kMmaBV value columns): pass 2 on tensor cores (see above).
/// Inputs: conv_out bf16 [T, C] (q ‖ k ‖ v rows, q/k of key head j/(Hv/Hk)), ws fp32 from
/// pass 1 (per value head and chunk: U, W [64][Dk], P [64][64], SC [4][64]); state fp32
/// [Hv, Dk, Dv] in place; out bf16 [T, Hv·Dv] (pre-norm o_t).
template <int kDk>
__global__ void __launch_bounds__(kPrefillThreads, 1)
gdn_chunk_state_mma_kernel(int Hk, int Hv, int T, const bf16* __restrict__ conv_out, const float* __restrict__ ws,
                           float* __restrict__ state, bf16* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kDv = kDk;
  using Smem = MmaStateSmem<kDk>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int j = blockIdx.x, m0 = blockIdx.y * kMmaBV, kh = j / (Hv / Hk);
  const int key_dim = Hk * kDk, chunks = (T + kChunk - 1) / kChunk;
  const int64_t C = 2 * key_dim + int64_t(Hv) * kDv;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t4 = lane % 4;
  const bf16* q_src = conv_out + kh * kDk;
  const bf16* k_src = q_src + key_dim;
  const float* ws_j = ws + int64_t(j) * chunks * local_floats(kDk);
  auto U_of = [&](int c) { return ws_j + int64_t(c) * local_floats(kDk); };

  // Phases A and B: warp → rows [16·am, +16) of the chunk, n8 tiles an0, an0+1 of the slice.
  const int am = warp % 4, an0 = 2 * (warp / 4);
  // Phase C (and the state registers): warp → key rows [16·ci, +16), n8 tiles cn0 … cn0+kCN−1.
  constexpr int kCM = kDk / 16;                    // m16 tiles of key rows
  constexpr int kCN = kMmaNT * kCM / kPrefillWarps;  // n8 tiles per warp: 4 (Dk 128), 2 (Dk 64)
  static_assert(kCN >= 1 && kPrefillWarps % kCM == 0 && kPrefillWarps == 8, "phase C tiling");
  const int ci = warp % kCM, cn0 = (warp / kCM) * kCN;

  // The chunk 0 loads, then the start state: registers (fp32) and its split copy.
  {
    const float* U0 = U_of(0);
    const int L0 = min(kChunk, T);
    mma_state_load_wuq(sm, U0, U0 + kChunk * kDk, U0 + 2 * kChunk * kDk + kChunk * kChunk, q_src, C, L0, m0);
    cp_async_commit();
    mma_state_load_pk(sm, U0 + 2 * kChunk * kDk, k_src, C, L0);
    cp_async_commit();
  }
  float* Sg = state + int64_t(j) * kDk * kDv + m0;
  float s_reg[kCN][4];
#pragma unroll
  for (int n = 0; n < kCN; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * ci + g + 8 * h, col = 8 * (cn0 + n) + 2 * t4;
      const float2 v = *reinterpret_cast<const float2*>(Sg + int64_t(row) * kDv + col);
      s_reg[n][2 * h] = v.x;
      s_reg[n][2 * h + 1] = v.y;
      store_split2(sm.S_hi[row], sm.S_lo[row], col, v.x, v.y);
    }

  for (int c = 0; c < chunks; ++c) {
    const int t0 = c * kChunk, L = min(kChunk, T - t0);
    cp_async_wait<1>();  // W, U, SC, q of chunk c (P and k may still be in flight)
    __syncthreads();

    // Phase A: WS = W·S (3 products), QS = Q·S (2: q is exact in tf32).
    float ws_acc[2][4] = {}, qs_acc[2][4] = {};
    const int r0 = 16 * am + g;
#pragma unroll 4
    for (int k0 = 0; k0 < kDk; k0 += 8) {
      uint32_t w_hi[4], w_lo[4], qa[4];
      load_a_split(sm.W, r0, k0, w_hi, w_lo);
      qa[0] = bf16_bits_to_tf32(sm.q[r0][k0 + t4]);
      qa[1] = bf16_bits_to_tf32(sm.q[r0 + 8][k0 + t4]);
      qa[2] = bf16_bits_to_tf32(sm.q[r0][k0 + t4 + 4]);
      qa[3] = bf16_bits_to_tf32(sm.q[r0 + 8][k0 + t4 + 4]);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t b_hi[2], b_lo[2];
        load_b_split(sm.S_hi, sm.S_lo, k0, 8 * (an0 + n) + g, b_hi, b_lo);
        mma_tf32_1688(ws_acc[n], w_lo, b_hi);
        mma_tf32_1688(ws_acc[n], w_hi, b_lo);
        mma_tf32_1688(ws_acc[n], w_hi, b_hi);
        mma_tf32_1688(qs_acc[n], qa, b_lo);
        mma_tf32_1688(qs_acc[n], qa, b_hi);
      }
    }
    // Δ = U − WS, the output's γ_t S0ᵀq̂_t, D = SC[1]∘Δ (rows past L: SC[1] = 0).
    float o_acc[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + 8 * h, col = 8 * (an0 + n) + 2 * t4;
        const float2 u = *reinterpret_cast<const float2*>(&sm.U[row][col]);
        const float d0 = u.x - ws_acc[n][2 * h], d1 = u.y - ws_acc[n][2 * h + 1];
        const float sq = sm.SC[0][row], sk = sm.SC[1][row];
        o_acc[n][2 * h] = sq * qs_acc[n][2 * h];
        o_acc[n][2 * h + 1] = sq * qs_acc[n][2 * h + 1];
        store_split2(sm.dl_hi[row], sm.dl_lo[row], col, d0, d1);
        store_split2(sm.d_hi[row], sm.d_lo[row], col, sk * d0, sk * d1);
      }
    const float gamma_last = sm.SC[2][0];
    cp_async_wait<0>();  // P and k of chunk c
    __syncthreads();     // Δ, D, P, k visible; W, U, SC, q and S_hi/S_lo free
    if (c + 1 < chunks) {
      const float* Un = U_of(c + 1);
      mma_state_load_wuq(sm, Un, Un + kChunk * kDk, Un + 2 * kChunk * kDk + kChunk * kChunk,
                         q_src + int64_t(t0 + kChunk) * C, C, min(kChunk, T - t0 - kChunk), m0);
    }
    cp_async_commit();

    // Phase B: O += P·Δ over s < 16·(am+1) (P is zero above the diagonal).
    for (int k0 = 0; k0 < 16 * (am + 1); k0 += 8) {
      uint32_t p_hi[4], p_lo[4];
      load_a_split(sm.P, r0, k0, p_hi, p_lo);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t b_hi[2], b_lo[2];
        load_b_split(sm.dl_hi, sm.dl_lo, k0, 8 * (an0 + n) + g, b_hi, b_lo);
        mma_tf32_1688(o_acc[n], p_lo, b_hi);
        mma_tf32_1688(o_acc[n], p_hi, b_lo);
        mma_tf32_1688(o_acc[n], p_hi, b_hi);
      }
    }
    const int64_t out_stride = int64_t(Hv) * kDv;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + 8 * h;
        if (row < L) {
          const int col = j * kDv + m0 + 8 * (an0 + n) + 2 * t4;
          *reinterpret_cast<__nv_bfloat162*>(out + int64_t(t0 + row) * out_stride + col) =
              __floats2bfloat162_rn(o_acc[n][2 * h], o_acc[n][2 * h + 1]);
        }
      }

    // Phase C: S ← γ_L S + Kᵀ·D over s < L (k is exact in tf32: two products).
#pragma unroll
    for (int n = 0; n < kCN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_reg[n][e] *= gamma_last;
    const int i0 = 16 * ci + g;
    for (int k0 = 0; k0 < L; k0 += 8) {
      uint32_t ka[4];
      ka[0] = bf16_bits_to_tf32(sm.k[k0 + t4][i0]);
      ka[1] = bf16_bits_to_tf32(sm.k[k0 + t4][i0 + 8]);
      ka[2] = bf16_bits_to_tf32(sm.k[k0 + t4 + 4][i0]);
      ka[3] = bf16_bits_to_tf32(sm.k[k0 + t4 + 4][i0 + 8]);
#pragma unroll
      for (int n = 0; n < kCN; ++n) {
        uint32_t b_hi[2], b_lo[2];
        load_b_split(sm.d_hi, sm.d_lo, k0, 8 * (cn0 + n) + g, b_hi, b_lo);
        mma_tf32_1688(s_reg[n], ka, b_lo);
        mma_tf32_1688(s_reg[n], ka, b_hi);
      }
    }
#pragma unroll
    for (int n = 0; n < kCN; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = i0 + 8 * h;
        store_split2(sm.S_hi[row], sm.S_lo[row], 8 * (cn0 + n) + 2 * t4, s_reg[n][2 * h], s_reg[n][2 * h + 1]);
      }
    __syncthreads();  // S_hi/S_lo written; P, k, Δ, D free
    if (c + 1 < chunks) {
      const float* Un = U_of(c + 1);
      mma_state_load_pk(sm, Un + 2 * kChunk * kDk, k_src + int64_t(t0 + kChunk) * C, C,
                        min(kChunk, T - t0 - kChunk));
    }
    cp_async_commit();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int n = 0; n < kCN; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * ci + g + 8 * h, col = 8 * (cn0 + n) + 2 * t4;
      *reinterpret_cast<float2*>(Sg + int64_t(row) * kDv + col) = make_float2(s_reg[n][2 * h], s_reg[n][2 * h + 1]);
    }
}

constexpr int kNormWarps = 8;  // (token, value head) pairs per block of the prefill norm

/// Gated RMSNorm in place over rows of bf16 pre-norm outputs io [T, Hv·Dv] (contiguous), gates
/// z [T, Hv·Dv] (row stride z_stride): warp per (token, value head), kNormWarps per block;
/// lane l owns values [l·Dv/32, +Dv/32), Σo² is a warp sum. kVec: io and z rows allow
/// Dv/32-element vector accesses (the launcher checks).
template <int kDv, bool kVec>
__global__ void __launch_bounds__(kNormWarps * kWarp)
gated_norm_kernel(int T, int Hv, float eps, const float* __restrict__ norm_w,
                  const bf16* __restrict__ z, int64_t z_stride, bf16* __restrict__ io) {
  constexpr int kPer = kDv / kWarp;
  const int64_t pair = int64_t(blockIdx.x) * kNormWarps + threadIdx.x / kWarp;  // t·Hv + j
  if (pair >= int64_t(T) * Hv) return;  // warp-uniform: the warp sum below has every lane
  const int64_t t = pair / Hv;
  const int j = static_cast<int>(pair % Hv), m0 = (threadIdx.x % kWarp) * kPer;
  bf16* row = io + pair * kDv + m0;
  float o[kPer], g[kPer], y[kPer];
  load_bf16_vec<kPer, kVec>(row, o);
  load_bf16_vec<kPer, kVec>(z + t * z_stride + j * kDv + m0, g);
  float gain[kPer], sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    gain[i] = norm_w[m0 + i];
    sq += o[i] * o[i];
  }
  const float r = gated_norm_r(warp_sum(sq), kDv, eps);
#pragma unroll
  for (int i = 0; i < kPer; ++i) y[i] = gated_norm_y(o[i], r, gain[i], g[i]);
  store_bf16_vec<kPer, kVec>(y, row);
}

/// gdn_state_mma_enabled() and gdn_local_mma_enabled(): on (the verified default) until set
/// (the CUDA backend sets them from CudaOptions::gdn_state_mma / gdn_local_mma).
std::atomic<bool> g_state_mma{true};
std::atomic<bool> g_local_mma{true};

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

/// Launches the prefill gated norm for head dim D: vector accesses when z (its rows and the
/// start) and out are aligned to D/32 elements (the backend's always are), else scalar ones.
template <int D>
void launch_gated_norm(const GdnDims& dims, const GdnParams& params, int T, const bf16* z, int64_t z_stride,
                       bf16* out, cudaStream_t stream) {
  constexpr int kPer = D / kWarp;
  const bool vec = z_stride % kPer == 0 && is_aligned(z, 2 * kPer) && is_aligned(out, 2 * kPer);
  const int Hv = dims.n_value_heads;
  const unsigned blocks = static_cast<unsigned>(ceil_div(int64_t(T) * Hv, kNormWarps));
  if (vec)
    gated_norm_kernel<D, true><<<blocks, kNormWarps * kWarp, 0, stream>>>(T, Hv, dims.norm_eps, params.norm_w, z,
                                                                          z_stride, out);
  else
    gated_norm_kernel<D, false><<<blocks, kNormWarps * kWarp, 0, stream>>>(T, Hv, dims.norm_eps, params.norm_w, z,
                                                                           z_stride, out);
  LILY_CUDA_CHECK_LAUNCH();
}

/// Launches the chunked prefill (two passes when `ws` is given, else one kernel) and the gated
/// norm for head dim D.
template <int D>
void launch_prefill(const GdnDims& dims, const GdnParams& params, int T, const bf16* conv_out,
                    const bf16* z, const bf16* a, const bf16* b, int64_t zab_stride, float* state,
                    bf16* out, float* ws, cudaStream_t stream) {
  const dim3 grid(dims.n_value_heads, D / kBV);
  if (ws) {
    // The tensor-core passes copy 16-byte pieces of conv_out and ws and store bf16 pairs and
    // float2s: buffers not aligned for that (never the backend's) take the fp32 kernels.
    const dim3 local_grid(dims.n_value_heads, static_cast<unsigned>(ceil_div(T, kChunk)));
    if (gdn_local_mma_enabled() && is_aligned(conv_out, 16) && is_aligned(ws, 16)) {
      const size_t local_smem = sizeof(LocalMmaSmem<D>);
      raise_smem_limit(gdn_chunk_local_mma_kernel<D>, local_smem);
      gdn_chunk_local_mma_kernel<D><<<local_grid, kPrefillThreads, local_smem, stream>>>(
          dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b, zab_stride, ws);
    } else {
      const size_t local_smem = sizeof(LocalSmem<D>);
      raise_smem_limit(gdn_chunk_local_kernel<D>, local_smem);
      gdn_chunk_local_kernel<D><<<local_grid, kPrefillThreads, local_smem, stream>>>(
          dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b, zab_stride, ws);
    }
    LILY_CUDA_CHECK_LAUNCH();
    if (gdn_state_mma_enabled() && is_aligned(conv_out, 16) && is_aligned(ws, 16) && is_aligned(out, 4) &&
        is_aligned(state, 8)) {
      const size_t mma_smem = sizeof(MmaStateSmem<D>);
      raise_smem_limit(gdn_chunk_state_mma_kernel<D>, mma_smem);
      gdn_chunk_state_mma_kernel<D><<<dim3(dims.n_value_heads, D / kMmaBV), kPrefillThreads, mma_smem, stream>>>(
          dims.n_key_heads, dims.n_value_heads, T, conv_out, ws, state, out);
    } else {
      const size_t state_smem = sizeof(StateSmem<D>);
      raise_smem_limit(gdn_chunk_state_kernel<D>, state_smem);
      gdn_chunk_state_kernel<D><<<grid, kPrefillThreads, state_smem, stream>>>(
          dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b, zab_stride, ws,
          state, out);
    }
    LILY_CUDA_CHECK_LAUNCH();
  } else {
    const size_t smem = sizeof(PrefillSmem<D>);
    raise_smem_limit(gdn_prefill_chunked_kernel<D>, smem);
    gdn_prefill_chunked_kernel<D><<<grid, kPrefillThreads, smem, stream>>>(
        dims.n_key_heads, dims.n_value_heads, T, params.A_log, params.dt_bias, conv_out, a, b,
        zab_stride, state, out);
    LILY_CUDA_CHECK_LAUNCH();
  }
  launch_gated_norm<D>(dims, params, T, z, zab_stride, out, stream);
}

/// Launches conv_prefill_kernel: channel pairs when C, the row stride and both buffers allow
/// bf16-pair accesses (the backend's always do), else single channels.
void launch_conv_prefill(int C, int T, const float* conv_w, const bf16* qkv, int64_t stride, const bf16* window,
                         bf16* out, cudaStream_t stream) {
  const bool pairs = C % 2 == 0 && stride % 2 == 0 && is_aligned(qkv, 4) && is_aligned(out, 4);
  const int ch = pairs ? 2 : 1;
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(C, ch), kConvThreads)),
                  static_cast<unsigned>(ceil_div(T, kConvRun)));
  if (pairs)
    conv_prefill_kernel<2><<<grid, kConvThreads, 0, stream>>>(C, T, conv_w, qkv, stride, window, out);
  else
    conv_prefill_kernel<1><<<grid, kConvThreads, 0, stream>>>(C, T, conv_w, qkv, stride, window, out);
  LILY_CUDA_CHECK_LAUNCH();
}

void check_params(const GdnParams& p) {
  MIXER_REQUIRE(p.conv_w && p.A_log && p.dt_bias && p.norm_w, "a GdnParams pointer is null");
}

}  // namespace

bool gdn_state_mma_enabled() { return g_state_mma.load(std::memory_order_relaxed); }
void set_gdn_state_mma_enabled(bool on) { g_state_mma.store(on, std::memory_order_relaxed); }

bool gdn_local_mma_enabled() { return g_local_mma.load(std::memory_order_relaxed); }
void set_gdn_local_mma_enabled(bool on) { g_local_mma.store(on, std::memory_order_relaxed); }

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
                "gdn_conv_decode_rows: rows=" + std::to_string(rows) + " outside [1, " + std::to_string(kMaxDecodeRows) + "]");
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
                "gdn_decode_rows: rows=" + std::to_string(rows) + " outside [1, " + std::to_string(kMaxDecodeRows) + "]");
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
  launch_conv_prefill(C, T, params.conv_w, qkv, qkv_stride, window, out, stream);
  conv_window_update_kernel<<<ceil_div(C, 256), 256, 0, stream>>>(C, T, qkv, qkv_stride, window);
  LILY_CUDA_CHECK_LAUNCH();
}

void gdn_gated_norm(const GdnDims& dims, const GdnParams& params, int T, const bf16* z, int64_t z_stride, bf16* io,
                    cudaStream_t stream) {
  check_dims(dims);
  check_params(params);
  MIXER_REQUIRE(T >= 1 && T <= 65535, "gdn_gated_norm: T=" + std::to_string(T) + " outside [1, 65535]");
  MIXER_REQUIRE(z && io, "gdn_gated_norm: null buffer");
  MIXER_REQUIRE(z_stride >= dims.value_dim(), "gdn_gated_norm: z row stride below Hv·Dv");
  dispatch_head_dim(dims, [&](auto d) {
    launch_gated_norm<decltype(d)::value>(dims, params, T, z, z_stride, io, stream);
  });
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
