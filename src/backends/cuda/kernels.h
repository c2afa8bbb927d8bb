// Launchers for the CUDA-CORE kernels (everything except the GDN and attention mixers, which
// live in mixer_kernels.h): MLX-affine GEMV, embedding gather, residual-add + RMSNorm, MoE
// routing / experts, argmax. Host-visible (plain C++), so cuda_backend.cpp compiles with g++.
// All launchers are asynchronous on `stream`, allocate nothing and are safe to capture into a
// CUDA graph; scalars that change per token (token id, position) are read from device memory.
// Numerics follow docs/model.md §4.3 (bf16 activations, fp32 accumulation).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace lily::cuda {

/// Dynamic shared memory (bytes) a kernel may use without opting in to more
/// (cudaFuncAttributeMaxDynamicSharedMemorySize).
inline constexpr int kDefaultSmemBytes = 48 * 1024;

/// Widest activation row (values) the decode GEMVs, the router and the MoE kernels take: their
/// per-warp group counts and shared-memory staging are sized for it.
inline constexpr int kMaxGemvCols = 8192;

/// Most routed experts, and the largest top-k, the router and MoE kernels take: the top-k keys
/// are held per warp (kMaxExperts / 32 a lane) and the selections in fixed shared arrays.
inline constexpr int kMaxExperts = 1024;
inline constexpr int kMaxTopK = 32;

/// fp32 values one staged 64-group of an activation row takes in shared memory (quant_dot.cuh):
/// the 64 values padded to kGroupStride = 68, then the group's sum.
inline constexpr int kStagedFloatsPerGroup = 69;

/// Device view of an MLX affine-quantized matrix W[rows, cols] (docs/model.md §2.2), stored on the
/// device exactly in the checkpoint layout: codes U32 [rows, cols·bits/32] (lowest element in
/// the lowest bits), scales and biases bf16 [rows, cols/64]; w = scale·q + bias in fp32.
/// Stacked/fused matrices are row concatenations of such matrices.
struct DeviceQuant {
  const uint32_t* codes = nullptr;
  const __nv_bfloat16* scales = nullptr;
  const __nv_bfloat16* biases = nullptr;
  int64_t rows = 0;
  int cols = 0;   ///< input features; a multiple of 64
  int bits = 4;   ///< 4 or 8

  int words_per_row() const { return cols * bits / 32; }
  int groups_per_row() const { return cols / kQuantGroupSize; }
};

/// y[r] = Σ_c w[r,c]·x[c] for all rows r, per 64-group as s·Σ(q·x) + b·Σx in fp32 (docs/model.md
/// §4.2 GEMV). x: bf16 [cols]. Exactly one of y_bf16 / y_f32 ([rows]) is non-null: bf16 output
/// is rounded once; fp32 output (router, shared-expert gate, lm_head) is not rounded.
/// Throws lily::Error for bits ∉ {4, 8}, cols not a multiple of 64, or cols > 16384.
void launch_quant_gemv(const DeviceQuant& w, const __nv_bfloat16* x, __nv_bfloat16* y_bf16, float* y_f32,
                       cudaStream_t stream);

/// Batched form for prefill: x [m, cols] row-major → y [m, rows]; same numerics per row.
void launch_quant_gemv_batched(const DeviceQuant& w, const __nv_bfloat16* x, int m, __nv_bfloat16* y_bf16,
                               float* y_f32, cudaStream_t stream);

/// The prefill router on tensor cores: y fp32 [m, rows] = x bf16 [m, cols] · Wᵀ for an 8-bit
/// matrix, per 64-group s·Σ(q·x) + b·Σx in fp32 as launch_quant_gemv_batched (the same logits
/// up to the order of the additions inside a group; router_gemm.cu). Throws
/// lily::InternalError when !router_gemm_supported(w), for m ≤ 0 or null pointers.
void launch_router_gemm(const DeviceQuant& w, const __nv_bfloat16* x, int m, float* y, cudaStream_t stream);
/// Whether launch_router_gemm takes `w`: 8-bit codes, cols a positive multiple of 64.
bool router_gemm_supported(const DeviceQuant& w);

/// Most token rows one batched decode forward takes (one per sequence): the mixers' row
/// launches and the MoE block take them all at once, the row GEMVs and the LM head in launches of
/// at most kMaxStreamGemvRows.
inline constexpr int kMaxDecodeRows = 64;
/// Most rows one launch of the streaming GEMV's direct or rows mode takes: four column blocks of
/// eight (the MMA's N). launch_quant_gemv_rows runs more rows as several launches; a row's bits
/// do not depend on its launch.
inline constexpr int kMaxStreamGemvRows = 32;
/// The default of rows_gemv_staging_min_rows() (CudaOptions::rows_gemv_from): on an H200 at the
/// 35B-A3B shapes, from 2 rows on the rows mode takes less time per layer than the direct mode
/// (in-projection + out-projection at 2 rows 19.4 against 20.3 µs, at 32 rows 63.2 against 87.7),
/// at 1 row more (18.6 against 17.7).
inline constexpr int kRowsGemvFromDefault = 2;
/// The default of rows_gemv_ksplit_from() (CudaOptions::rows_gemv_ksplit_from).
/// From 9 rows on (H100, 35b-a3b synth): +1.6 % batched decode throughput at 16 rows, +3.5 % at 32,
/// +8.2 % at 64; at 4–8 rows no faster end to end than the rows mode (docs/cuda.md, "Batched steps").
inline constexpr int kRowsGemvKsplitFromDefault = 9;
/// Matrices with more rows than this take the direct mode at any row count: the LM head (248,320
/// rows) ran slower in the rows mode at every m on an H200 (1 row 193 against 139 µs, 32 rows 484
/// against 374), its long weight stream wanting the direct mode's several blocks per SM more than
/// rows staged once.
inline constexpr int64_t kRowsModeMaxWeightRows = 65536;
/// Most rows one launch_moe_block_rows takes: a batched decode step's rows (kMaxDecodeRows), so
/// that each distinct expert of the step is read once per eight rows routed to it.
inline constexpr int kMaxMoeRows = 64;
/// The rows from which the MoE rows kernel routes each row once (moe_route_once_from_rows): on
/// an H100, 40 chained blocks took 1.4 % less time at 8 rows, 1.5 % at 16, 1.8 % at 32 and 4.9 %
/// at 64 (docs/performance/2026-12-07-split-and-route-once.md).
inline constexpr int kMoeRouteOnceFromDefault = 8;
/// The rows from which the MoE rows kernel's quads claim their routed gate/up tiles as they go
/// (moe_tile_claims_from_rows), after the blocks' fixed shares of kMoeTileClaimsFixedDefault per
/// cent: on an H100, +4.6 % batched throughput at 32 rows, +1.2 % at 48, +1.5 % at 64, and the
/// same at 16 rows with claims from 9 (docs/performance/2026-12-07-rows-norm-and-claims-fixed.md).
/// Claiming every tile had lost at 48 and 64 rows on an H200: a quad's claimed tiles miss the
/// neighbouring column blocks that a fixed share keeps in L1
/// (docs/performance/2026-12-07-h200-tile-claims.md).
inline constexpr int kMoeTileClaimsFromDefault = 17;
/// The per cent of the routed gate/up tiles split in fixed shares before the claims
/// (moe_tile_claims_fixed_percent): 75 beat 0, 50, 60, 80 and 90 at 32, 48 and 64 rows on an H100.
inline constexpr int kMoeTileClaimsFixedDefault = 75;

/// The batched decode's GEMV: x bf16 [m, cols] row-major → y [m, rows] (exactly one of y_bf16 /
/// y_f32 non-null), 1 ≤ m ≤ kMaxDecodeRows. Batch-invariant: the kernel and every summation
/// order are chosen from the matrix alone (never from m), so token row t's output is
/// bit-identical for every m and whatever the other rows hold. 4-bit matrices run on tensor
/// cores (the streaming kernel where it applies, with the rows as 1–4 column blocks of eight
/// that share each weight fragment, kMaxStreamGemvRows rows a launch; else the register-load
/// one, eight rows per launch), 8-bit
/// on CUDA cores (the tiled kernel where its staging fits). Results agree with
/// launch_quant_gemv to its tolerance, not always bit for bit (the m = 1 path may take another
/// kernel). Throws lily::Error as launch_quant_gemv does, lily::InternalError for m outside
/// [1, kMaxDecodeRows] or not exactly one output.
void launch_quant_gemv_rows(const DeviceQuant& w, const __nv_bfloat16* x, int m, __nv_bfloat16* y_bf16,
                            float* y_f32, cudaStream_t stream);

/// Embedding gather (docs/model.md §3.1): out[c] = bf16(s·q + b) of row tokens[t] of the 4-bit
/// table, for t < m; out [m, cols]. Ids outside [0, rows) are clamped (the host validates ids).
void launch_embed(const DeviceQuant& table, const int32_t* tokens, int m, __nv_bfloat16* out,
                  cudaStream_t stream);

/// Residual add fused with RMSNorm (docs/model.md §3.2, §4.3 item 2), over m rows of n values:
/// if `branch` is non-null, x ← bf16(x + branch) (stored back into x); then
/// y = bf16(x · r · gain) with r = 1/sqrt(mean(x²) + eps), fp32. x, branch, y: bf16 [m, n];
/// gain: fp32 [n].
void launch_add_rmsnorm(__nv_bfloat16* x, const __nv_bfloat16* branch, const float* gain, __nv_bfloat16* y,
                        int m, int n, float eps, cudaStream_t stream);

/// Expert slots per token: the top_k routed experts, then the shared expert in slot top_k: the
/// length of a token's expert ids, weights and activation rows.
__host__ __device__ constexpr int routed_plus_shared_slots(int top_k) { return top_k + 1; }

/// Expert ids: the n_experts routed experts, then the shared expert as id n_experts; also the rows
/// of the fused router matrix (router rows, then the shared-expert gate row) and of its logits.
__host__ __device__ constexpr int routed_plus_shared_experts(int n_experts) { return n_experts + 1; }

/// MoE routing (docs/model.md §3.5, norm_topk_prob = true): logits fp32 [m, n_experts + 1] = router
/// logits then the shared-expert gate logit. Picks the top_k largest logits (descending; ties to
/// the lowest id; NaN never wins), weights w_k = softmax over the selected k (fp32). Writes
/// ids [m, top_k + 1] and weights [m, top_k + 1]; slot top_k is the shared expert (id =
/// n_experts) with weight sigmoid(shared gate logit). Requires n_experts ≤ kMaxExperts, top_k ≤ kMaxTopK.
void launch_router_topk(const float* logits, int m, int n_experts, int top_k, int32_t* ids, float* weights,
                        cudaStream_t stream);

/// An add + RMSNorm folded into the input staging of a decode GEMV (one token; docs/model.md §3.2,
/// §4.3 item 2), with exactly launch_add_rmsnorm's numerics: h = bf16(x + branch) (h = x when
/// branch is null), y = bf16(h · r · gain) with r = 1/sqrt(mean(h²) + eps) in fp32; the GEMV then
/// multiplies y. Every block computes the (4 KB) norm itself; block 0 also stores h into x_out
/// and y into normed_out (bf16 [cols]) for later kernels. x_out must not alias x or branch (other
/// blocks are still reading them): the decode step ping-pongs two residual buffers.
struct FusedNorm {
  const __nv_bfloat16* branch = nullptr;  ///< bf16 [cols] or null
  const float* gain = nullptr;            ///< fp32 [cols]; required
  float eps = 1e-6f;
  __nv_bfloat16* x_out = nullptr;         ///< bf16 [cols]: h
  __nv_bfloat16* normed_out = nullptr;    ///< bf16 [cols]: y
};

/// The GDN causal-conv decode step (gdn_conv_decode, docs/model.md §3.3 step 2) folded into the
/// epilogue of the GDN in-projection GEMV, with gdn_conv_decode's exact arithmetic: for each
/// output row r < channels (the q ‖ k ‖ v rows), x = bf16(y[r]) (y[r] is still stored):
/// out[r] = bf16(silu(Σ_t window[r][t]·taps[r][t] + x·taps[r][3])), window[r] ← (w1, w2, x).
struct FusedConv {
  int channels = 0;                  ///< C (0: no conv); ≤ the GEMV's rows
  const float* taps = nullptr;       ///< fp32 [C, 4], channel-major (GdnParams::conv_w)
  __nv_bfloat16* window = nullptr;   ///< bf16 [C, 3], oldest first; shifted in place
  __nv_bfloat16* out = nullptr;      ///< bf16 [C]; must not alias y
};

/// launch_add_rmsnorm(x, branch, gain, …) then launch_quant_gemv(w, y, …) in one launch (decode,
/// m = 1; see FusedNorm), optionally followed by the GDN conv step on the first rows (FusedConv,
/// bf16 output only). x: bf16 [w.cols]. Throws lily::Error as launch_quant_gemv does, and
/// lily::InternalError for a null gain / x_out / normed_out, an x_out aliasing x or branch, or a
/// bad FusedConv (null buffers, channels > rows, fp32 output, out aliasing y).
void launch_add_rmsnorm_gemv(const FusedNorm& norm, const __nv_bfloat16* x, const DeviceQuant& w,
                             __nv_bfloat16* y_bf16, float* y_f32, cudaStream_t stream,
                             const FusedConv& conv = FusedConv{});

/// One row already normed and staged for the tensor-core GEMVs, as stage_mma_rows leaves it in
/// shared memory: the bf16 pairs in fragment order (uint32 [cols / 2], fragment_pair_column) and
/// each 64-group's sum in group_sum_x's order (fp32 [cols / 64]); both 16-byte aligned. The
/// fused MoE block writes one for the next layer's input norm (MoeNextNorm).
struct StagedRow {
  uint32_t* pairs = nullptr;
  float* sums = nullptr;
};

/// Whether launch_staged_row_gemv takes w (the streaming GEMV's staged mode: 4-bit, cols a
/// multiple of 512, 16-byte aligned arrays, one stage within the shared memory). Host only.
bool staged_row_gemv_supported(const DeviceQuant& w);

/// launch_add_rmsnorm_gemv with the normed row taken from `row` (one bulk copy into each
/// block's shared memory) instead of formed by every block: y = W·row with the same bits as
/// launch_add_rmsnorm_gemv gives for the norm that staged `row`; the optional conv as there. The
/// norm's x_out and normed_out are whatever wrote `row` wrote. Throws lily::InternalError when
/// staged_row_gemv_supported(w) is false, `row` has a null or unaligned array, or the outputs
/// or conv are bad (as launch_add_rmsnorm_gemv).
void launch_staged_row_gemv(const StagedRow& row, const DeviceQuant& w, __nv_bfloat16* y_bf16, float* y_f32,
                            cudaStream_t stream, const FusedConv& conv = FusedConv{});

/// Why launch_add_rmsnorm_gemv_rows cannot take `w` at m rows ("" when it can): it needs the
/// streaming GEMV's rows mode for all m rows in one launch with one column block (a 4-bit matrix
/// of at most rows_mode_max_weight_rows() rows, cols a multiple of 512 and at most 2,048,
/// 1 ≤ m ≤ 8). Host only.
std::string rows_norm_gemv_problem(const DeviceQuant& w, int m);

/// The batched decode's input add + RMSNorm and in-projection in one launch, for m rows:
/// h = bf16(x + norm.branch) (x alone without a branch), y = the RMSNorm of h with norm.gain,
/// out = W·y (bf16 [m, w.rows]). Every block forms the m normed rows while staging them (the
/// streaming GEMV's rows mode, stage_rows_norm_fragments), with launch_add_rmsnorm's arithmetic,
/// so h, y and out are the bits of launch_add_rmsnorm over the m rows followed by
/// launch_quant_gemv_rows; block 0 stores h to norm.x_out and y to norm.normed_out (bf16
/// [m, cols] each; x_out must not be x, as every block reads x). x, branch, gain and both outputs
/// 16-byte aligned. Throws lily::InternalError for rows_norm_gemv_problem's reasons, a bad norm
/// (check_fused_norm) or a misaligned array.
void launch_add_rmsnorm_gemv_rows(const FusedNorm& norm, const __nv_bfloat16* x, int m, const DeviceQuant& w,
                                  __nv_bfloat16* out, cudaStream_t stream);

/// Router GEMV fused with routing, for decode (at batch 1 the stand-alone top-k is pure launch latency): one
/// launch computes logits[t] = W x[t] (fp32, exactly launch_quant_gemv's per-row arithmetic; W the
/// 4/8-bit [n_experts + 1, cols] router ‖ shared-expert-gate matrix) and, in the last block to
/// finish a row (atomic counter), the routing of launch_router_topk (same ids, same weights).
/// logits fp32 [m, n_experts + 1] (also written, for probes); ids, weights [m, top_k + 1];
/// `done` uint32 [m], zero before the first launch; the kernel leaves it zero again (so a
/// captured graph can be replayed). Throws lily::Error for an unsupported matrix, rows ≠
/// n_experts + 1, n_experts > kMaxExperts or top_k > kMaxTopK.
void launch_router_fused(const DeviceQuant& w, const __nv_bfloat16* x, int m, int n_experts, int top_k,
                         float* logits, int32_t* ids, float* weights, uint32_t* done, cudaStream_t stream);
/// launch_add_rmsnorm + launch_router_fused in one launch (decode, m = 1; see FusedNorm): the
/// routed input is the normed y, also stored to norm.normed_out for the expert kernels.
void launch_add_rmsnorm_router_fused(const FusedNorm& norm, const __nv_bfloat16* x, const DeviceQuant& w,
                                     int n_experts, int top_k, float* logits, int32_t* ids, float* weights,
                                     uint32_t* done, cudaStream_t stream);

// Run-time kernel switches (launch.cu). Process-wide values that no kernel reads from the
// environment: each starts at the path verified on an H200 (on), the CUDA backend sets every one
// from its CudaOptions when created (kernel_switches.h; the LILY_CUDA_* variables are read and
// validated once, by CudaOptions::from_env), and tests comparing both paths use the setters.

/// Whether decode-path kernels launch with programmatic dependent launch (launch.cuh):
/// CudaOptions::pdl (LILY_CUDA_PDL); on by default.
bool pdl_enabled();
/// Sets pdl_enabled() for the rest of the process (the backend; tests and benchmarks comparing both).
void set_pdl_enabled(bool on);

/// Whether 4-bit GEMVs with cols % 512 == 0 and m ≤ 8 stream their weights by bulk copies
/// (quant_gemv.cu) instead of register loads: CudaOptions::stream_gemv (LILY_CUDA_STREAM_GEMV);
/// on by default.
bool stream_gemv_enabled();
/// Sets stream_gemv_enabled() for the rest of the process (the backend; tests comparing both paths).
void set_stream_gemv_enabled(bool on);

/// Whether prefill attention runs on tensor cores (flash_prefill.cu) instead of the CUDA-core
/// row kernel (attention.cu): CudaOptions::flash_prefill (LILY_CUDA_FLASH_PREFILL); on by default.
bool flash_prefill_enabled();
/// Sets flash_prefill_enabled() for the rest of the process (the backend; tests comparing both paths).
void set_flash_prefill_enabled(bool on);

/// Whether sampled rows are sampled on the device (sampler.cu) instead of on the host from
/// copied logits: CudaOptions::device_sampler (LILY_CUDA_DEVICE_SAMPLER); on by default (its
/// kernels and its end-to-end test agree with the host sampler on an H200).
bool device_sampler_enabled();
/// Sets device_sampler_enabled() for the rest of the process (the backend; tests of both paths).
void set_device_sampler_enabled(bool on);

/// Whether gdn_prefill runs in two passes (all chunks' local solves at once, then the walk over
/// the chunks) when given a workspace, or the one-kernel walk: CudaOptions::gdn_chunk_parallel
/// (LILY_CUDA_GDN_CHUNK_PARALLEL); on by default (verified on an H200).
bool gdn_chunk_parallel_enabled();
/// Sets gdn_chunk_parallel_enabled() for the rest of the process (the backend; tests of both paths).
void set_gdn_chunk_parallel_enabled(bool on);

/// Whether the batched CUDA-core GEMV (m > 1: the prefill router, LILY_CUDA_GEMM=gemv) loads each
/// weight group once per 8 token rows (quant_gemv_tiled_kernel, bit-identical outputs by
/// construction) instead of once per row: CudaOptions::gemv_row_tiles (LILY_CUDA_GEMV_ROW_TILES);
/// on by default (verified on an H200).
bool gemv_row_tiles_enabled();
/// Sets gemv_row_tiles_enabled() for the rest of the process (the backend; tests of both paths).
void set_gemv_row_tiles_enabled(bool on);

/// Rows from which launch_quant_gemv_rows runs the streaming GEMV in its rows mode (the rows
/// staged once per block) instead of its direct mode (each tile reading them from L2), for
/// matrices of at most kRowsModeMaxWeightRows rows. Both give a row the same bits, so this is a
/// speed setting only: CudaOptions::rows_gemv_from (LILY_CUDA_ROWS_GEMV_FROM), by default
/// kRowsGemvFromDefault; kMaxDecodeRows + 1 means never.
int rows_gemv_staging_min_rows();
/// Sets rows_gemv_staging_min_rows() for the rest of the process (tests and timings of both
/// modes; kMaxDecodeRows + 1 keeps the direct mode for every m). Throws lily::Error for n < 1.
void set_rows_gemv_staging_min_rows(int n);

/// Rows from which launch_quant_gemv_rows runs a 4-bit matrix of 2,048 or 4,096 columns (at
/// most kRowsModeMaxWeightRows rows, bf16 out) through the k-split GEMV (launch_quant_gemv_ksplit:
/// all the rows in one launch, the k-slices on the CTAs of a cluster) instead of the streaming
/// GEMV's rows or direct mode. The same bits every way, so a speed setting only:
/// CudaOptions::rows_gemv_ksplit_from (LILY_CUDA_ROWS_GEMV_KSPLIT_FROM), by default
/// kRowsGemvKsplitFromDefault; kMaxDecodeRows + 1 means never.
int rows_gemv_ksplit_from();
/// Sets rows_gemv_ksplit_from() for the rest of the process (tests and timings of every mode).
/// Throws lily::Error for n < 1.
void set_rows_gemv_ksplit_from(int n);

/// y bf16 [m, w.rows] = x bf16 [m, w.cols] · Wᵀ for 1 ≤ m ≤ kMaxDecodeRows rows in one launch:
/// the streaming GEMV's eight k-slices of a tile computed by the eight CTAs of a cluster, each
/// staging only its slice of the rows, and added in slice order through distributed shared memory
/// (quant_gemv_ksplit.cu). A token's output is bit-identical to the streaming GEMV's (every mode)
/// whatever m and the other rows are. Throws lily::InternalError when ksplit_gemv_problem(w, m) is
/// not empty, x is null or not 16-byte aligned, or y is null.
void launch_quant_gemv_ksplit(const DeviceQuant& w, const __nv_bfloat16* x, int m, __nv_bfloat16* y,
                              cudaStream_t stream);
/// Why launch_quant_gemv_ksplit cannot take `w` at m rows ("" when it can): 4-bit codes, 2,048 or
/// 4,096 columns (4 or 8 groups a k-slice), 16-byte aligned arrays, 1 ≤ m ≤ kMaxDecodeRows.
std::string ksplit_gemv_problem(const DeviceQuant& w, int m);

/// Where the streaming GEMV's rows mode runs two warp groups of eight warps per block instead of
/// one (twice the warps per SM to hide the tile loop's latency; the same k-slices, the same bits):
/// never (none); in launches of up to 8 rows (one column block), the two groups taking turns on
/// the tiles (tiles, the default: 4–12 % less time per in-projection at 2–8 rows on an H100);
/// or besides in launches of 2 or 4 column blocks (9–16 or 25–32 rows), each group computing half
/// the column blocks of every tile (all: no faster there, 0–10 % slower).
enum class RowsGemvSplit { none, tiles, all };
/// The rows mode's warp-group split: CudaOptions::rows_gemv_split (LILY_CUDA_ROWS_GEMV_SPLIT);
/// read when a launch is planned.
RowsGemvSplit rows_gemv_split();
/// Sets rows_gemv_split() for the rest of the process (tests and timings of every form).
void set_rows_gemv_split(RowsGemvSplit split);

/// Matrices with more rows than this take launch_quant_gemv_rows's direct mode at any row count
/// (kRowsModeMaxWeightRows by default: the LM head stays direct). A speed setting only, for
/// timings of the LM head in the rows mode.
int64_t rows_mode_max_weight_rows();
/// Sets rows_mode_max_weight_rows() for the rest of the process. Throws lily::Error for n < 1.
void set_rows_mode_max_weight_rows(int64_t n);

/// How the MoE rows kernel (launch_moe_block_rows) splits the routed gate/up tiles over its
/// blocks in launches of at least kMoeTileBalanceFromRows rows: 0, equal tile counts; w > 0
/// (8 by default), equal cost, a tile costing w + its live columns (the rows routed to its
/// column block, 1 … 8, each of which the tile's fragment loads read on their own). Which tiles a
/// block computes never changes a result's bits. Process-wide (apply_kernel_switches:
/// CudaOptions::moe_tile_balance); read when a launch is planned.
int moe_tile_balance();
/// The fewest rows whose launches split by cost (moe_tile_balance): at 8 and 16 rows the split's
/// extra scan cost more than the imbalance it removes, and at 32 no weight was faster beyond the
/// noise (docs/performance/2026-12-05-rows-gemv-and-prefill-rows.md).
inline constexpr int kMoeTileBalanceFromRows = 33;
/// Sets moe_tile_balance() for the rest of the process (tests and timings). Throws lily::Error
/// for w < 0 or w > 1024.
void set_moe_tile_balance(int w);
/// Rows from which the MoE rows kernel routes each row once (one warp of one block, then a
/// third grid barrier, and every block reads the step's routing) instead of every block routing
/// every row; kMaxMoeRows + 1: never. The same ids and weights either way (route_token_keys on
/// the same logits), so a speed setting only; read when a launch is planned. By default
/// kMoeRouteOnceFromDefault.
int moe_route_once_from_rows();
/// Sets moe_route_once_from_rows() for the rest of the process (tests and timings). Throws
/// lily::Error for n < 1 or n > kMaxMoeRows + 1.
void set_moe_route_once_from_rows(int n);
/// Rows from which the MoE rows kernel's quads claim the routed gate/up tiles two at a time from
/// a counter (MoeDecodeArgs::tile_claims) as they go, instead of each block taking a share fixed
/// before phase 3 (moe_tile_balance), so that a block whose tiles arrive sooner takes more and no
/// block waits long at grid barrier 2 for another. Which block computes a tile never changes its
/// bits, so a speed setting only; launches without tile_claims keep the fixed shares.
/// Process-wide (CudaOptions::moe_tile_claims_from); read when a launch is planned. By default
/// kMoeTileClaimsFromDefault.
int moe_tile_claims_from_rows();
/// Sets moe_tile_claims_from_rows() for the rest of the process. Throws lily::Error for n < 1 or
/// n > kMaxMoeRows + 1.
void set_moe_tile_claims_from_rows(int n);
/// With tile claims (moe_tile_claims_from_rows): the per cent (0 … 100) of the routed gate/up
/// tiles that the blocks split in equal contiguous shares before claiming the rest, so that most
/// tiles keep their neighbours' activation columns in L1 and only the tail is balanced by claims.
/// 0: every routed tile is claimed; by default kMoeTileClaimsFixedDefault. A speed setting only (a
/// tile's bits never depend on its block). Process-wide (CudaOptions::moe_tile_claims_fixed).
int moe_tile_claims_fixed_percent();
/// Sets moe_tile_claims_fixed_percent(). Throws lily::Error outside 0 … 100.
void set_moe_tile_claims_fixed_percent(int percent);

/// Blocks per SM the streaming GEMV (quant_gemv.cu) is compiled for in its staged and direct
/// modes with one column block (the decode projections and the LM head): its register budget,
/// 64 per thread. Enough warps to hide the arithmetic's latency (LM head alone: 264, 159, 127 µs
/// with 1, 2, 4 blocks per SM; decode in the graph 339, 352, 390 tok/s).
inline constexpr int kStreamBlocksPerSm = 4;
/// Shared memory of one SM that the streaming GEMV's blocks share for their weight stages (staged
/// and direct modes), by default; the rest stays free for blocks of the next kernels, which then
/// start their own loads early under PDL. Measured in the decode graph (4 blocks per SM): 220 KB
/// 387.0, 160 KB 386.8, 112 KB 389.5 tok/s. At 112 KB a 2048-column tile (18.1 KiB) gets one
/// stage per block, four per SM; twice or more the stages per SM left the LM head within 3 % and
/// the projections unchanged (CudaTiming.PrintsStreamGemvStageSweep,
/// docs/performance/2026-12-05-decode-loads-before-the-wait.md).
inline constexpr int64_t kStreamSmemPerSm = 112 * 1024;
/// The most dynamic shared memory one block of the streaming GEMV may take (the SM's 227 KB).
inline constexpr int64_t kStreamSmemMax = 227 * 1024;

/// The shared memory (bytes) one SM's streaming-GEMV blocks share for their weight stages in the
/// staged and direct modes: kStreamSmemPerSm by default. A block takes this divided by its blocks
/// per SM and holds as many 16-row stages as fit (at least one). Stages never change a result's
/// bits, so this is a speed setting, for timings (CudaTiming.PrintsStreamGemvStageSweep). Read
/// when a launch is planned.
int64_t stream_gemv_smem_per_sm();
/// Sets stream_gemv_smem_per_sm() for the rest of the process. Throws lily::Error outside
/// [16 KiB, kStreamSmemMax].
void set_stream_gemv_smem_per_sm(int64_t bytes);
/// Blocks per SM the streaming GEMV's grid is sized for in its staged and direct modes with one
/// column block: 1 … kStreamBlocksPerSm, kStreamBlocksPerSm by default. Speed only, as above.
int stream_gemv_blocks_per_sm();
/// Sets stream_gemv_blocks_per_sm() for the rest of the process. Throws lily::Error outside
/// [1, kStreamBlocksPerSm].
void set_stream_gemv_blocks_per_sm(int n);

/// Which streaming-GEMV launches request their first weight stages only after the PDL wait and
/// the activations' staging, instead of before the wait: none (the default), the staged launches
/// (those with the add + RMSNorm or the GDN conv fused: the decode's in-projections and LM head),
/// or all. Requests made before the wait stream weights under the previous kernel when the
/// blocks fit beside it; when they cannot (most of the in-projection's blocks behind the MoE
/// block's 164 KB ones) the weight stream is already in flight when the wait returns, and the
/// activations' loads wait behind it (on an H100 about 1.4 µs of the in-projection's staging;
/// decode within ±1 % either way). Speed only (the same bits); read when a launch is planned.
enum class StreamLateRequests { none, staged, all };
/// The current StreamLateRequests (process-wide; apply_kernel_switches). Throws nothing.
StreamLateRequests stream_gemv_late_requests();
/// Sets stream_gemv_late_requests(). Throws nothing.
void set_stream_gemv_late_requests(StreamLateRequests which);


/// Phase stamps per block of the streaming GEMV's trace (set_stream_gemv_trace): entry, PDL wait,
/// activations staged, first tile on chip, first tile stored, last tile on chip, exit; with the
/// norm fused also thread 0 holding its row elements (7) and the normed row staged (8). A block
/// with one tile stamps 3 and 5 at once; one with none leaves 3–5 as they were.
inline constexpr int kStreamTracePoints = 9;
/// Diagnostics: every later launch of the streaming GEMV (quant_gemv.cu) stamps %globaltimer (ns)
/// at its phase ends into `trace`, uint64 [blocks][kStreamTracePoints], until this is called with
/// null (the default); a graph keeps the pointer its capture saw. Without `advance` every launch
/// writes the same slice (one launch at a time, `trace` large enough for its grid); with it each
/// launch enqueued from now on takes the next slice, [its blocks][kStreamTracePoints] after the
/// last, and is listed in stream_gemv_trace_launches(), so a decode graph captured meanwhile
/// stamps every GEMV of a step in its own slice (`trace` must hold them all: the caller sizes
/// it). Clears the list. Host-side only (the pointer is a kernel argument); throws nothing.
void set_stream_gemv_trace(uint64_t* trace, bool advance = false);

/// One streaming-GEMV launch enqueued while tracing with `advance`, in enqueue order: its matrix,
/// token rows, grid and the offset of its slice in the trace (uint64 elements).
struct StreamTraceLaunch {
  int64_t rows = 0;
  int cols = 0, m = 0, blocks = 0;
  int64_t offset = 0;
};
/// The launches enqueued since set_stream_gemv_trace(…, true). Throws nothing but std::bad_alloc.
std::vector<StreamTraceLaunch> stream_gemv_trace_launches();

/// Whether the streaming GEMV deals its tiles past each block's first stages from a counter in
/// device memory, in the order the blocks ask for them (true, the default), or in a fixed stride
/// over the blocks (false), in launches with the norm fused and at least four tiles per block
/// (the decode step's LM head); other launches keep the fixed stride, the counter's claims
/// costing them more than it evens out. With the fixed stride a block's share is fixed before it
/// starts, so the blocks of slower SMs set the launch's end (the LM head's blocks ended between
/// 93 and 138 µs on an H100, each with 29 or 30 tiles; with the counter between 121 and 127). A
/// tile's arithmetic does not depend on the block that runs it, so the two give the same bits.
/// Process-wide (apply_kernel_switches); read when a launch is enqueued (a graph keeps what its
/// capture saw). Throws nothing.
bool stream_gemv_tile_counter_enabled();
/// Sets stream_gemv_tile_counter_enabled(). Throws nothing.
void set_stream_gemv_tile_counter_enabled(bool on);

/// Fused gate/up + SwiGLU for the selected experts (docs/model.md §4.3 item 5): for each slot
/// k < n_sel of token row t, expert e = ids[t·n_sel + k]: g = bf16(W_gate[e] x), u = bf16(W_up[e] x),
/// act[t, k, i] = bf16(silu(g_i)·u_i). gate/up: stacks of (n_experts + 1)·ffn rows (shared expert
/// last). x bf16 [m, hidden]; act bf16 [m, n_sel, ffn].
void launch_expert_gate_up(const DeviceQuant& gate, const DeviceQuant& up, int ffn, const int32_t* ids, int n_sel,
                           const __nv_bfloat16* x, int m, __nv_bfloat16* act, cudaStream_t stream);

/// Down projection fused with the weighted combine (docs/model.md §4.3 item 5): out[t, r] =
/// bf16( Σ_k weights[t,k] · bf16(W_down[e_k] act[t,k])[r] ), accumulated in fp32 in slot order
/// (the shared expert, slot n_sel−1, last). down: stack of (n_experts + 1)·hidden rows × ffn.
void launch_expert_down_combine(const DeviceQuant& down, int hidden, const int32_t* ids, const float* weights,
                                int n_sel, const __nv_bfloat16* act, int m, __nv_bfloat16* out,
                                cudaStream_t stream);

/// A mixer's out-projection run by the one-token MoE block as its first phase (MoeDecodeArgs::
/// out_proj), so that the layer saves the separate GEMV's launch and its weights stream in before
/// the block's PDL wait: y = W·x with the bits launch_quant_gemv gives it (the streaming GEMV's
/// direct-mode tiles, k-slices and epilogue), then a grid barrier, then the block's add + RMSNorm
/// reads y as its branch.
struct MoeOutProjection {
  DeviceQuant w;                    ///< 4-bit [hidden, cols], cols a multiple of 512; codes null: no phase
  const __nv_bfloat16* x = nullptr; ///< bf16 [cols]: the mixer's core output (written by an earlier launch)
  __nv_bfloat16* y = nullptr;       ///< bf16 [hidden]: the result; must be MoeDecodeArgs::norm.branch
};

/// The next layer's input add + RMSNorm (or the final norm) as the one-token MoE block's last
/// phase: the block that finishes last forms h = bf16(norm.x_out + out) and y = the norm of h
/// with `gain` (stage_norm_row's arithmetic, the bits launch_add_rmsnorm_gemv's staging gives),
/// stores h to x_out and y to normed_out, and leaves y staged in `row` for
/// launch_staged_row_gemv, so that the next GEMV's blocks copy the row instead of each forming
/// it. Off (row.pairs null) by default.
struct MoeNextNorm {
  const float* gain = nullptr;          ///< fp32 [hidden]
  float eps = 1e-6f;
  __nv_bfloat16* x_out = nullptr;       ///< bf16 [hidden]: h (the residual for the layer after)
  __nv_bfloat16* normed_out = nullptr;  ///< bf16 [hidden]: y
  StagedRow row;                        ///< y staged; pairs null: no phase
};

/// Everything the fused decode MoE block (launch_moe_block_decode) reads and writes, for the
/// `rows` tokens of one decode step (1 … kMaxMoeRows, one per sequence). Weights as for
/// launch_add_rmsnorm_router_fused, launch_expert_gate_up and launch_expert_down_combine (the
/// shared expert appended as expert n_experts). Row-major activations, row r at r·width.
struct MoeDecodeArgs {
  DeviceQuant router;  ///< 4/8-bit [n_experts + 1, hidden]: router rows, then the shared-expert gate row
  DeviceQuant gate;    ///< 4-bit [(n_experts + 1)·ffn, hidden]
  DeviceQuant up;      ///< 4-bit [(n_experts + 1)·ffn, hidden]
  DeviceQuant down;    ///< 4-bit [(n_experts + 1)·hidden, ffn]
  int n_experts = 0, top_k = 0, ffn = 0;
  int rows = 1;                        ///< tokens of the step, 1 … kMaxMoeRows
  FusedNorm norm;                      ///< the post-mixer add + RMSNorm (branch: the mixer output) [rows, hidden]
  const __nv_bfloat16* x = nullptr;    ///< bf16 [rows, hidden]: the residual before the add (≠ norm.x_out)
  float* logits = nullptr;             ///< fp32 [rows, n_experts + 1] (written, for probes)
  int32_t* ids = nullptr;              ///< [rows, top_k + 1] (written, for probes)
  float* weights = nullptr;            ///< [rows, top_k + 1] (written, for probes)
  __nv_bfloat16* act = nullptr;        ///< bf16 [rows, top_k + 1, ffn]: scratch between the two grid phases
  /// fp32 [rows, top_k + 1, ffn / 8]: the sums of act's 8-column units, scratch of the rows
  /// kernel (launch_moe_block_rows) between its two grid phases; unused by the one-token block.
  float* act_sums = nullptr;
  /// fp32 [rows, hidden / 64]: the normed rows' group sums, scratch of the rows kernel between
  /// its norm and its gate/up phase; unused by the one-token block.
  float* normed_sums = nullptr;
  /// bf16 [rows, hidden], 16-byte aligned: the normed rows with each 16-byte unit in MMA fragment
  /// order (pack_fragment_pairs), scratch of the rows kernel between its norm and its gate/up
  /// phase, whose fragment loads then take them as they are; unused by the one-token block.
  __nv_bfloat16* normed_frag = nullptr;
  __nv_bfloat16* out = nullptr;        ///< bf16 [rows, hidden]: the MoE output
  /// uint32 [2] (with out_proj: [3]; with next_norm: [4]; the rows kernel: [3]), zero before
  /// every launch (a memset in the graph).
  uint32_t* barriers = nullptr;
  /// uint32 [1], zero before every launch (a memset in the graph): the rows kernel's gate/up tile
  /// claims (moe_tile_claims_from_rows); null: the blocks' shares are fixed. Unused by the
  /// one-token block.
  uint32_t* tile_claims = nullptr;
  /// The mixer's out-projection as the one-token block's first phase (rows = 1 only; the rows
  /// kernel refuses it). Off (w.codes null) by default: norm.branch is then an input.
  MoeOutProjection out_proj;
  /// The next norm as the one-token block's last phase (rows = 1 only; the rows kernel refuses
  /// it). Off (row.pairs null) by default.
  MoeNextNorm next_norm;
  /// Diagnostics, null in production: per block, %globaltimer (ns) at each of the
  /// kMoeTracePoints phase ends (entry, PDL wait, norm, router (the rows kernel: both its norm
  /// and router units, stamped twice), barrier 1, routing, requests, gate/up + SwiGLU, (same),
  /// barrier 2, act staged (the rows kernel: the act group sums), down), then (the rows kernel)
  /// what the block worked on in slot kMoeTraceWork (moe_trace_work) → uint64 [blocks][kMoeTraceSlots].
  uint64_t* trace = nullptr;
};

/// Phase stamps per block of MoeDecodeArgs::trace: the twelve above, then the rows kernel's
/// routing in detail (kMoeTraceRouted, kMoeTraceIds; 0 where the kernel has no such point).
inline constexpr int kMoeTracePoints = 14;
/// The rows kernel routing each row once: its rows routed, before the grid barrier that
/// publishes them.
inline constexpr int kMoeTraceRouted = 12;
/// The rows kernel: the step's ids and weights in shared memory (routed in the block, or read
/// after that barrier), before the distinct experts are listed.
inline constexpr int kMoeTraceIds = 13;
/// The trace slot after the stamps: the rows kernel's SM and gate/up work (moe_trace_work).
inline constexpr int kMoeTraceWork = kMoeTracePoints;
/// uint64 slots per block of MoeDecodeArgs::trace.
inline constexpr int kMoeTraceSlots = kMoeTracePoints + 1;

/// A block's kMoeTraceWork slot: its SM (%smid, bits 48–63), its gate/up tiles (bits 32–47), of
/// them the shared expert's (16–31), and the step's index of its first routed tile (0–15; tile j
/// is column block j / (ffn / 8)).
__host__ __device__ constexpr uint64_t moe_trace_work(uint32_t sm, uint32_t tiles, uint32_t shared, uint32_t first_tile) {
  return uint64_t{sm & 0xffffu} << 48 | uint64_t{tiles & 0xffffu} << 32 | uint64_t{shared & 0xffffu} << 16 |
         (first_tile & 0xffffu);
}

/// Why launch_moe_block_decode cannot run `args` on this device ("" when it can): it needs
/// rows = 1, 4-bit experts, hidden a multiple of 256, ffn a multiple of 64, 16-byte aligned
/// expert arrays, top-k ≤ 32, and every block's expert tiles within one SM's shared memory with
/// all blocks resident at once (`max_blocks` > 0 caps the grid, for tests).
std::string moe_block_unsupported(const MoeDecodeArgs& args, int max_blocks = 0);

/// The whole decode MoE block of one token (args.rows = 1) in one launch, with
/// launch_add_rmsnorm_router_fused + launch_expert_gate_up + launch_expert_down_combine's results
/// (docs/model.md §3.5, §4.3 item 5): x_out = bf16(x + branch), normed = the RMSNorm (both
/// bit-identical to the separate kernels), router logits and routing bit-identical to
/// launch_router_fused, act = bf16(silu(bf16(W_gate x)) · bf16(W_up x)) and out =
/// bf16(Σ_s w_s·bf16(W_down act_s)) in slot order, the 4-bit products on tensor cores
/// (quant_mma.cuh; sums in another order than the CUDA-core expert kernels, so within bf16
/// rounding of them). One block per SM; two grid-wide barriers on `barriers` (after the router
/// logits, after act). The expert weights travel by bulk copies into shared memory: the shared
/// expert's before the PDL wait, the routed ones as soon as the routing is known, the down
/// projection's during the gate/up phase. With args.out_proj the mixer's out-projection runs
/// first (a third barrier); with args.next_norm the block that finishes last forms the next
/// norm (a fourth counter). Throws lily::Error with moe_block_unsupported's reason,
/// lily::InternalError for bad buffers.
void launch_moe_block_decode(const MoeDecodeArgs& args, cudaStream_t stream, int max_blocks = 0);

/// Why launch_moe_block_rows cannot run `args` ("" when it can): as moe_block_unsupported, with
/// 1 … kMaxMoeRows rows, and the stages for that many rows within one SM's shared memory.
std::string moe_block_rows_unsupported(const MoeDecodeArgs& args, int max_blocks = 0);

/// The decode MoE block of the args.rows (1 … kMaxMoeRows) rows of a batched decode step in
/// one launch, each row's outputs (x_out, normed, logits, routing, act, out) bit-identical to
/// launch_moe_block_decode's for that token alone, whatever the other rows are: a row's every
/// sum runs in the one-token block's order, and the rows routed to an expert are the columns of
/// its MMAs (an output column depends only on its own input column), so each distinct expert's
/// weights are read once per eight rows routed to it. Same barriers, buffers and errors as
/// launch_moe_block_decode (with moe_block_rows_unsupported's reason), and act_sums,
/// normed_sums and a 16-byte aligned normed_frag are required (lily::InternalError).
void launch_moe_block_rows(const MoeDecodeArgs& args, cudaStream_t stream, int max_blocks = 0);

/// Number of fp32 + int32 scratch slots launch_argmax needs for n values.
int argmax_scratch_slots(int64_t n);
/// Greedy pick (docs/model.md §3.6): out_id[0] = argmax of logits fp32 [n], ties to the lowest index,
/// NaN never wins, an all-NaN row gives 0. scratch_val / scratch_idx: argmax_scratch_slots(n).
void launch_argmax(const float* logits, int64_t n, float* scratch_val, int32_t* scratch_idx, int32_t* out_id,
                   cudaStream_t stream);
/// launch_argmax over `rows` rows of logits fp32 [rows, n] in two launches: out_ids[r] = row r's
/// greedy pick, the id launch_argmax gives that row alone. scratch_val / scratch_idx: rows ·
/// argmax_scratch_slots(n). Throws lily::InternalError for n or rows outside 1 … INT_MAX / 65535.
void launch_argmax_rows(const float* logits, int rows, int64_t n, float* scratch_val, int32_t* scratch_idx,
                        int32_t* out_ids, cudaStream_t stream);

}  // namespace lily::cuda
