// CUDA mixer kernels of the two token mixers: Gated DeltaNet (docs/model.md §3.3) and
// gated full attention (docs/model.md §3.4), decode and prefill. Every function here is a host-side
// launcher: it validates its shapes (throwing lily::Error naming what was wrong), enqueues one
// or more kernels on `stream` and returns at once (no synchronisation, no allocation, so all
// of them can be captured into a CUDA graph). Launch failures throw lily::InternalError.
//
// Conventions (all launchers):
//  - bf16 = __nv_bfloat16 in device memory; fp32 = float. "Row" = one token.
//  - Row strides are given in elements, so callers can pass slices of fused projection
//    outputs (e.g. the qkv|z|a|b GEMV row) without copying.
//  - Numerics follow docs/model.md §4.3/§4.4: fp32 arithmetic, one bf16 rounding per output.
//  - Decode kernels that depend on the position can read it from device memory (pointer
//    argument non-null) so that a captured decode graph can be replayed at every position.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "model/config.h"

namespace lily::cuda {

// =============================================================================================
// Gated DeltaNet (docs/model.md §3.3)
// =============================================================================================

/// GDN dimensions. The kernels are compiled for Dk = Dv ∈ {64, 128} (128: the Qwen3.6 family;
/// 64: the demo model) and conv kernel K = 4; Hk, Hv (a multiple of Hk) are runtime values.
struct GdnDims {
  int n_key_heads = 16;     ///< Hk
  int n_value_heads = 32;   ///< Hv; value head j uses key head j / (Hv/Hk)
  int key_head_dim = 128;   ///< Dk (64 or 128)
  int value_head_dim = 128; ///< Dv (must equal Dk)
  int conv_kernel = 4;      ///< K (must be 4)
  float norm_eps = 1e-6f;   ///< gated RMSNorm epsilon

  int key_dim() const { return n_key_heads * key_head_dim; }
  int value_dim() const { return n_value_heads * value_head_dim; }
  /// Conv channels C = 2·Hk·Dk + Hv·Dv, laid out q ‖ k ‖ v, head-major.
  int conv_channels() const { return 2 * key_dim() + value_dim(); }
  /// Floats of one layer's recurrent state [Hv, Dk, Dv].
  int64_t state_elems() const { return int64_t(n_value_heads) * key_head_dim * value_head_dim; }
  /// bf16 elements of one layer's conv window [C, K-1].
  int64_t window_elems() const { return int64_t(conv_channels()) * (conv_kernel - 1); }
};

/// The GDN dims of a model config. Throws lily::Error if the kernels were not written for it
/// (Dk ≠ Dv, Dk ∉ {64, 128}, K ≠ 4, Hv not a multiple of Hk).
GdnDims gdn_dims(const ModelConfig& config);

/// Per-layer GDN parameters in device memory (fp32 copies of GdnWeights' vectors).
struct GdnParams {
  const float* conv_w = nullptr;   ///< [C, K] channel-major; tap K-1 multiplies the current token
  const float* A_log = nullptr;    ///< [Hv]
  const float* dt_bias = nullptr;  ///< [Hv]
  const float* norm_w = nullptr;   ///< [Dv] plain gain of the gated RMSNorm
};

/// GDN decode, step 1: causal depthwise conv of one token + SiLU (docs/model.md §3.3 step 2).
///   qkv    bf16 [C]          raw projection output (q ‖ k ‖ v) of the current token
///   window bf16 [C, K-1]     channel-major, oldest first; the previous K-1 RAW inputs of each
///                            channel (zero at sequence start); shifted in place
///   out    bf16 [C]          silu(Σ_t window[c][t]·w[c][t] + qkv[c]·w[c][K-1]), fp32 sum in tap order
/// `out` must not alias `qkv`.
void gdn_conv_decode(const GdnDims& dims, const GdnParams& params, const __nv_bfloat16* qkv,
                     __nv_bfloat16* window, __nv_bfloat16* out, cudaStream_t stream);

/// GDN decode, step 2: one fused kernel, a cluster of Dv/32 CTAs per value head (4 at Dv = 128,
/// 2 at Dv = 64), each owning 32 value columns of the state (docs/model.md §3.3 steps 3-6, §4.3):
/// L2-normalise q, k (HF form x·rsqrt(Σx²+1e-6), fp32, not rounded), q scale 1/√Dk,
/// α = exp(−exp(A_log)·softplus(a+dt_bias)) (softplus threshold 20), β = sigmoid(b),
/// delta-rule update of the fp32 state (decay, predict, delta, rank-1 update), output with the
/// updated state, rounded to bf16, then gated RMSNorm y = bf16(w·o'·rsqrt(mean o'²+eps)·silu(z)).
///   conv_out bf16 [C]         output of gdn_conv_decode (q ‖ k ‖ v)
///   z        bf16 [Hv·Dv]     gate projection
///   a, b     bf16 [Hv]        decay / beta projections
///   state    fp32 [Hv, Dk, Dv] updated in place (S[j][i][m], i = key dim, m = value dim)
///   out      bf16 [Hv·Dv]     head-major, the input of out_proj
void gdn_decode(const GdnDims& dims, const GdnParams& params, const __nv_bfloat16* conv_out,
                const __nv_bfloat16* z, const __nv_bfloat16* a, const __nv_bfloat16* b,
                float* state, __nv_bfloat16* out, cudaStream_t stream);

/// Batched GDN decode, step 1: gdn_conv_decode for `rows` (1 … kMaxDecodeRows) tokens, each of its own
/// sequence, in one launch; row r's result is bit-identical to gdn_conv_decode on that row.
///   qkv     bf16 [rows, C]   row stride `qkv_stride` (≥ C) elements (the in-projection rows)
///   windows device array [rows] of bf16* [C, K-1]: row r's window (its sequence's, this layer's);
///           the array itself is read on the device after the launch's PDL wait, so a captured
///           graph can be replayed with other sequences' windows
///   out     bf16 [rows, C]   contiguous; must not overlap qkv
/// Throws lily::Error on bad dims, rows, strides or null buffers.
void gdn_conv_decode_rows(const GdnDims& dims, const GdnParams& params, int rows, const __nv_bfloat16* qkv,
                          int64_t qkv_stride, __nv_bfloat16* const* windows, __nv_bfloat16* out,
                          cudaStream_t stream);

/// Batched GDN decode, step 2: gdn_decode for `rows` (1 … kMaxDecodeRows) tokens, each of its own sequence,
/// in one launch (grid: value head × cluster slice × row); row r's arithmetic is gdn_decode's on
/// that row alone, so its output and new state are bit-identical to it.
///   conv_out bf16 [rows, C]        gdn_conv_decode_rows's output
///   z        bf16 [rows, Hv·Dv]    row stride `zab_stride`
///   a, b     bf16 [rows, Hv]       row stride `zab_stride`
///   states   device array [rows] of fp32* [Hv, Dk, Dv]: row r's recurrent state, updated in place
///   out      bf16 [rows, Hv·Dv]    contiguous
/// Throws lily::Error on bad dims, rows, strides or null buffers.
void gdn_decode_rows(const GdnDims& dims, const GdnParams& params, int rows, const __nv_bfloat16* conv_out,
                     const __nv_bfloat16* z, const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t zab_stride,
                     float* const* states, __nv_bfloat16* out, cudaStream_t stream);

/// GDN prefill, step 1: the causal conv + SiLU over T tokens, continuing from `window`.
///   qkv    bf16 [T, C], row stride `qkv_stride` (≥ C) elements
///   window bf16 [C, K-1]  as in gdn_conv_decode; on return holds the last K-1 raw inputs
///   out    bf16 [T, C] contiguous
/// Equal, token by token, to T calls of gdn_conv_decode. T ≥ 1.
void gdn_conv_prefill(const GdnDims& dims, const GdnParams& params, int T,
                      const __nv_bfloat16* qkv, int64_t qkv_stride, __nv_bfloat16* window,
                      __nv_bfloat16* out, cudaStream_t stream);

/// GDN prefill, step 2: the CHUNKED delta rule (chunk 64, UT/WY form, fp32 throughout, fp32
/// state) over T tokens, equal up to fp32 rounding to the sequential recurrence of gdn_decode,
/// then the gated RMSNorm per token and head.
///   conv_out bf16 [T, C]        output of gdn_conv_prefill
///   z        bf16 [T, Hv·Dv]    row stride `zab_stride`
///   a, b     bf16 [T, Hv]       row stride `zab_stride` (so a, b, z may point into the fused
///                               qkv|z|a|b projection rows: stride 12352 for the real model)
///   state    fp32 [Hv, Dk, Dv]  the state before the first token; on return, after the last
///   out      bf16 [T, Hv·Dv]    contiguous
///   workspace fp32, ≥ gdn_prefill_workspace_bytes(dims, T) bytes, or null
/// With a workspace and gdn_chunk_parallel_enabled() (LILY_CUDA_GDN_CHUNK_PARALLEL), two
/// passes: every chunk's state-independent part (the 64×64 solve, as U, W and P) at once, then
/// the walk over the chunks with Δ = U − W·S; else one kernel walks the chunks doing all of it.
/// The walk (pass 2) runs on tensor cores (tf32 mma with split operands, near-fp32 products;
/// gdn.cu, "pass 2 on tensor cores") unless gdn_state_mma_enabled() is off.
/// T ≥ 1 (≤ 65535). Throws lily::Error on bad dims, T, null buffers or a short workspace.
void gdn_prefill(const GdnDims& dims, const GdnParams& params, int T,
                 const __nv_bfloat16* conv_out, const __nv_bfloat16* z,
                 const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t zab_stride,
                 float* state, __nv_bfloat16* out, cudaStream_t stream, float* workspace = nullptr,
                 size_t workspace_bytes = 0);

/// The gated RMSNorm that ends gdn_prefill, alone (for timing it): in place over io, per token
/// and value head, y = (gain·(o·r))·silu(z) with r = 1/√(Σo²/Dv + ε) over the head.
///   z   bf16 [T, Hv·Dv]  row stride `z_stride`
///   io  bf16 [T, Hv·Dv]  contiguous: the pre-norm outputs, replaced by y
/// T ≥ 1 (≤ 65535). Throws lily::Error on bad dims, T, stride or null buffers.
void gdn_gated_norm(const GdnDims& dims, const GdnParams& params, int T, const __nv_bfloat16* z, int64_t z_stride,
                    __nv_bfloat16* io, cudaStream_t stream);

/// Bytes of gdn_prefill's two-pass workspace for T tokens: Hv · ceil(T/64) · 64·(2·D + 68)
/// floats (U and W [64, D], P [64, 64] and four row scales [4, 64] per value head and chunk;
/// 85 MB at T = 2048 for the 35B shape). Throws lily::Error on bad dims or T outside [1, 65535].
size_t gdn_prefill_workspace_bytes(const GdnDims& dims, int T);

/// Whether pass 2 of the two-pass gdn_prefill (the walk over the chunks) runs on tensor cores
/// (mma.sync tf32 with split-precision operands) or as the fp32 CUDA-core walk it replaced (for
/// an A/B): CudaOptions::gdn_state_mma (LILY_CUDA_GDN_STATE_MMA), set by the CUDA backend when
/// created (kernel_switches.h); on by default. Never read from the environment here.
bool gdn_state_mma_enabled();
/// Sets gdn_state_mma_enabled() for the rest of the process (the backend; tests comparing both paths).
void set_gdn_state_mma_enabled(bool on);

/// Whether pass 1 of the two-pass gdn_prefill (each chunk's U, W, P) runs on tensor cores (bf16
/// mma for KKᵀ/QKᵀ, split-tf32 mma for U and W; gdn.cu, "pass 1 on tensor cores") or as the
/// fp32 CUDA-core kernel: CudaOptions::gdn_local_mma (LILY_CUDA_GDN_LOCAL_MMA), set by the CUDA
/// backend when created (kernel_switches.h); on by default. Never read from the environment here.
bool gdn_local_mma_enabled();
/// Sets gdn_local_mma_enabled() for the rest of the process (the backend; tests comparing both paths).
void set_gdn_local_mma_enabled(bool on);

// =============================================================================================
// Gated full attention (docs/model.md §3.4)
// =============================================================================================

/// Attention dimensions. Kernels are compiled for head_dim ∈ {64, 128, 256}, GQA group
/// nq/nkv ∈ {1, 2, 4, 8} and rotary_dim ≤ head_dim, even.
struct AttnDims {
  int n_heads = 16;       ///< query heads nq
  int n_kv_heads = 2;     ///< kv heads (nq a multiple of it; group nq/nkv)
  int head_dim = 256;     ///< D (64, 128 or 256)
  int rotary_dim = 64;    ///< leading dims rotated, NeoX half-split
  float rope_theta = 1.0e7f;
  float norm_eps = 1e-6f; ///< q/k RMSNorm epsilon
  float scale() const;    ///< softmax scale 1/√D
};

/// The attention dims of a model config. Throws lily::Error if the kernels were not written
/// for it (head_dim ∉ {64, 128, 256}, odd or too large rotary dim, n_heads not a multiple of
/// n_kv_heads, group not 1, 2, 4 or 8).
AttnDims attn_dims(const ModelConfig& config);

/// One attention layer's KV cache in device memory: K and V, each bf16
/// [n_kv_heads, capacity, head_dim] (head-major, then position, then dim). K is stored after
/// RMSNorm and RoPE, V raw. Positions ≥ the sequence length are never read.
struct KvCacheView {
  __nv_bfloat16* k = nullptr;
  __nv_bfloat16* v = nullptr;
  int64_t capacity = 0;  ///< positions per head (row stride of a head = capacity·head_dim)
};

/// q/k preparation for T tokens at positions pos0 … pos0+T−1 (docs/model.md §3.4 steps 1-4):
/// per-head RMSNorm (stored gain, eps) → bf16 → partial half-split RoPE on the first
/// rotary_dim dims in fp32 (f_j = θ^(−2j/rotary_dim), φ = p·f_j) → bf16. Writes q into `q_out`
/// and appends K (normed+roped) and V (raw copy) to the cache at positions pos.
///   qg     bf16 [T, nq, 2·D]  row stride `qg_stride`; per head: query [0,D) then gate [D,2D)
///   k, v   bf16 [T, nkv·D]    row stride `kv_stride`
///   q_norm, k_norm fp32 [D]   stored gains
///   q_out  bf16 [T, nq, D]    contiguous
/// pos0 is `*pos_device` when pos_device is non-null (decode graphs), else `pos0_host`.
/// Requires pos0 + T ≤ cache.capacity (checked on the host side against pos0_host; with a
/// device position the caller guarantees it), and qg, k, v, q_out, the cache and both row
/// strides aligned to D/32 elements (vector loads; checked).
void attention_prepare(const AttnDims& dims, int T, const __nv_bfloat16* qg, int64_t qg_stride,
                       const __nv_bfloat16* k, const __nv_bfloat16* v, int64_t kv_stride,
                       const float* q_norm, const float* k_norm, int64_t pos0_host,
                       const int32_t* pos_device, const KvCacheView& cache,
                       __nv_bfloat16* q_out, cudaStream_t stream);

/// Maximum number of key splits of attention_decode.
constexpr int kMaxDecodeSplits = 256;
/// A good split count for a context of `len` keys (1 for ≤ 128 keys, then ~128-key splits,
/// at most 64). For a captured graph, use the count of the largest length it will serve
/// (any count is correct for any length).
int attention_decode_splits(int64_t len);
/// Workspace bytes attention_decode needs for `n_splits` (fp32 partial outputs and stats).
size_t attention_decode_workspace_bytes(const AttnDims& dims, int n_splits);

/// Decode attention for one token (docs/model.md §3.4 steps 5-6) with split-K over the keys:
/// grid (kv head, split); each CTA scores its key range for all nq/nkv query heads of the
/// group, keeps fp32 running max/sum, writes partials to `workspace`; a combine kernel merges
/// the splits and applies the sigmoid output gate.
///   q      bf16 [nq, D]     output of attention_prepare (T = 1)
///   gate   bf16 [nq, 2·D]   the qg row; the gate of head h is gate[h·2D + D …]; nullptr = no gate
///   cache  keys/values at positions [0, len)
///   out    bf16 [nq·D]      o_h · sigmoid(gate_h)
/// len (= position + 1) is `*len_device` when len_device is non-null, else `len_host`.
/// `n_splits` in [1, kMaxDecodeSplits]; each split covers ceil(len / n_splits) keys, so any
/// len works with any count (splits past the end write empty partials).
void attention_decode(const AttnDims& dims, const __nv_bfloat16* q, const __nv_bfloat16* gate,
                      const KvCacheView& cache, int64_t len_host, const int32_t* len_device,
                      int n_splits, float* workspace, size_t workspace_bytes,
                      __nv_bfloat16* out, cudaStream_t stream);

/// Batched decode, q/k preparation: attention_prepare of one token for each of `rows` (1 … kMaxDecodeRows)
/// sequences in one launch; row r's token is at position pos[r] and its K/V go to caches[r]
/// (row r's arithmetic is attention_prepare's with T = 1 at that position).
///   qg     bf16 [rows, nq, 2·D]  row stride `qg_stride`
///   k, v   bf16 [rows, nkv·D]    row stride `kv_stride`
///   pos    device int32 [rows]   positions (pos[r] < caches[r].capacity: the caller's guarantee)
///   caches device KvCacheView [rows]: each row's cache of this layer
///   q_out  bf16 [rows, nq, D]    contiguous
/// pos and caches are read on the device after the launch's PDL wait (a captured graph replays
/// with whatever they then hold). Throws lily::Error on bad dims, rows, strides or null buffers,
/// or on qg, k, v, q_out or a stride not aligned to D/32 elements (the caches' alignment, like
/// their capacity, is the caller's guarantee).
void attention_prepare_rows(const AttnDims& dims, int rows, const __nv_bfloat16* qg, int64_t qg_stride,
                            const __nv_bfloat16* k, const __nv_bfloat16* v, int64_t kv_stride,
                            const float* q_norm, const float* k_norm, const int32_t* pos,
                            const KvCacheView* caches, __nv_bfloat16* q_out, cudaStream_t stream);

/// Workspace bytes of attention_decode_rows for `rows` rows: each row's region holds
/// attention_decode_workspace_bytes(dims, kMaxDecodeSplits).
size_t attention_decode_rows_workspace_bytes(const AttnDims& dims, int rows);

/// Batched decode attention: attention_decode for one token of each of `rows` (1 … kMaxDecodeRows)
/// sequences of different lengths and caches, in one split launch and one combine launch
/// (grids: kv head × split × row and query head × row). Row r uses its own length len[r], cache
/// caches[r] and split count min(splits[r], max_splits), with partials in its own workspace
/// region, so its output is bit-identical to attention_decode with that split count on that
/// row alone (the backend takes the count from the row's KV capacity, as the one-sequence step
/// does). Split blocks past a row's count return at once; max_splits (the grid) is the largest
/// count of the rows.
///   q       bf16 [rows, nq, D]       attention_prepare_rows's q_out
///   gate    bf16 [rows, nq, 2·D]     row stride `gate_stride` (the qg rows); nullptr = no gate
///   caches  device KvCacheView [rows]
///   len     device int32 [rows]      keys per row (position + 1), in [1, capacity]
///   splits  device int32 [rows]      in [1, max_splits]
///   out     bf16 [rows, nq·D]
/// Throws lily::Error on bad dims, rows, max_splits, a short workspace or null buffers.
void attention_decode_rows(const AttnDims& dims, int rows, const __nv_bfloat16* q, const __nv_bfloat16* gate,
                           int64_t gate_stride, const KvCacheView* caches, const int32_t* len,
                           const int32_t* splits, int max_splits, float* workspace, size_t workspace_bytes,
                           __nv_bfloat16* out, cudaStream_t stream);

/// Causal attention for a prefill chunk of T query rows at positions base … base+T−1
/// (docs/model.md §4.4), GQA, online fp32 softmax; key t is visible to row r iff t ≤ base + r.
/// The chunk's K/V must already be in the cache (attention_prepare).
///   q      bf16 [T, nq, D]    contiguous (attention_prepare's q_out)
///   gate   bf16 [T, nq, 2·D]  row stride `gate_stride` (the qg rows); nullptr = no gate
///   out    bf16 [T, nq·D]     o · sigmoid(gate)
void attention_prefill(const AttnDims& dims, int T, int64_t base, const __nv_bfloat16* q,
                       const __nv_bfloat16* gate, int64_t gate_stride, const KvCacheView& cache,
                       __nv_bfloat16* out, cudaStream_t stream);

/// The tensor-core path of attention_prefill (flash_prefill.cu, FlashAttention-2 structure): the
/// same contract, without attention_prefill's argument checks. attention_prefill takes it when
/// flash_prefill_enabled() (kernels.h); the probabilities multiply V as bf16, so it agrees with
/// the fp32-probability row kernel to bf16 rounding, not bit for bit.
void attention_prefill_flash(const AttnDims& dims, int T, int64_t base, const __nv_bfloat16* q,
                             const __nv_bfloat16* gate, int64_t gate_stride, const KvCacheView& cache,
                             __nv_bfloat16* out, cudaStream_t stream);

}  // namespace lily::cuda
