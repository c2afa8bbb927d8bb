// Launchers for the tensor-core prefill GEMMs on MLX affine 4/8-bit weights (W4A16 / W8A16):
// a dense GEMM for the projections and a grouped GEMM for the MoE experts, whose token rows are
// grouped by expert on the device. Host-visible (plain C++), like kernels.h. Numerics: the
// tensor-core GEMM row of docs/model.md §4.2 — each dequantized weight w = s·q + b (fp32) is
// rounded once to bf16, products of bf16 × bf16 are accumulated in fp32, the output is rounded
// once (bf16 outputs). Asynchronous on `stream`; they allocate nothing. See docs/cuda.md
// ("Tensor-core prefill GEMM") for tiles and status. The 4-bit kernels that dequantize in
// registers (the warpgroup-MMA kernel, the default, and the mma.sync one; LILY_CUDA_GEMM_KERNEL)
// round the exact s·q + b once to bf16 (the shared-tile kernel rounds its fp32 value: the same
// bf16 except where that fp32 rounding lands on a bf16 tie) and sum the products in other
// orders; all stay within the tests' tolerances. The grouped GEMMs read only `offsets` and
// `order` of the grouping on those paths (their work lists use row tiles of 64 or 128 whatever
// `tiles` holds).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels.h"

namespace lily::cuda {

/// Where the 4-bit tensor-core GEMMs dequantize in registers right before the MMAs
/// (regdq_gemm_kernel) instead of through a shared-memory tile: CudaOptions::gemm_kernel
/// (LILY_CUDA_GEMM_KERNEL), docs/cuda.md.
enum class GemmKernel {
  kGrouped,  ///< "grouped": the grouped expert GEMMs; the dense ones keep the shared tile
  kAll,      ///< "all": also the dense GEMMs with at least one 64 × 256 tile per SM (for an A/B)
  kOff,      ///< "0": the shared-tile kernels everywhere
  kWgmma,    ///< "wgmma": the 4-bit GEMMs with bf16 output (grouped, and dense with ≥ 1 item per SM) on
             ///< warpgroup MMAs, 256 weight rows × 128 tokens per item; the rest as kGrouped
  kWgmmaNarrow,  ///< "wgmma-narrow": as kWgmma with 128 weight rows per item (2 CTAs per SM)
  /// "wgmma-mixed" (the default): the wide items (256 weight rows, 4 warpgroups) for the dense
  /// GEMMs and the grouped down GEMM, the narrow ones for the grouped gate/up GEMM: the faster
  /// width of each on an H200 at 2,048 tokens (docs/cuda.md).
  kWgmmaMixed,
};
/// The process-wide choice the GEMM launchers read at every launch: kWgmmaMixed until set (the
/// CUDA backend sets it from its CudaOptions when created; kernel_switches.h).
GemmKernel gemm_kernel();
/// Sets gemm_kernel() for the launches that follow (the backend at creation; tests comparing paths).
void set_gemm_kernel(GemmKernel mode);

/// y[m, w.rows] = x[m, w.cols] · bf16(W)ᵀ on tensor cores (wgmma or mma.sync with bf16 inputs,
/// fp32 accumulation; gemm_kernel() picks the kernel). x: bf16 row-major [m, cols]; exactly one of y_bf16 / y_f32 ([m, rows],
/// row-major) is non-null (bf16 rounded once; fp32 not rounded). Any m ≥ 1 (tail rows masked),
/// any rows ≥ 1 (tail columns masked). x and w.codes must be 16-byte aligned (cp.async), as
/// device allocations are; y 8-byte aligned. Throws lily::Error for bits ∉ {4, 8} or cols not a
/// positive multiple of 64; lily::InternalError for m ≤ 0 or a wrong output choice.
void launch_quant_gemm(const DeviceQuant& w, const __nv_bfloat16* x, int m, __nv_bfloat16* y_bf16, float* y_f32,
                       cudaStream_t stream);

/// Int32 elements of the grouping scratch for m token rows × n_sel expert slots over n_groups
/// experts (routed experts + the shared one). Layout, in this order:
///   offsets [n_groups + 1]  first position of expert e's assignments in `order` (offsets[n_groups] = m·n_sel);
///   tiles   [n_groups + 1]  first row tile of expert e (tiles[n_groups] = number of row tiles);
///   order   [m·n_sel]       assignment indices a = t·n_sel + slot, grouped by expert, ascending a within an expert.
int64_t expert_grouping_ints(int n_groups, int m, int n_sel);

/// Groups the (token, slot) assignments of ids [m, n_sel] (expert ids in [0, n_groups); values
/// outside are clamped) by expert into `grouping` (layout above; deterministic: a counting sort,
/// ascending assignment index inside each expert). The row-tile height used for `tiles` is
/// fixed by (m, n_sel, n_groups), so the grouped GEMMs below must be called with the same
/// three values. Throws lily::Error for n_groups > 2048, lily::InternalError for m, n_sel ≤ 0.
void launch_expert_grouping(const int32_t* ids, int m, int n_sel, int n_groups, int32_t* grouping,
                            cudaStream_t stream);

/// Grouped expert gate/up with the SwiGLU epilogue (docs/model.md §4.3 item 5 with §4.2's bf16
/// weights): for each assignment a = t·n_sel + slot with expert e,
///   g = bf16(bf16(W_gate[e]) x[t]), u = bf16(bf16(W_up[e]) x[t]), act[a, i] = bf16(silu(g_i)·u_i).
/// gate/up: stacks of n_groups·ffn rows × hidden (expert e at rows e·ffn…). x bf16 [m, hidden];
/// act bf16 [m·n_sel, ffn] (the layout launch_expert_down_combine reads). grouping from
/// launch_expert_grouping with the same (m, n_sel, n_groups).
void launch_quant_gemm_grouped_gate_up(const DeviceQuant& gate, const DeviceQuant& up, int ffn, const int32_t* grouping,
                                       int n_groups, const __nv_bfloat16* x, int m, int n_sel, __nv_bfloat16* act,
                                       cudaStream_t stream);

/// Grouped expert down projection: slot_out[a, r] = bf16(bf16(W_down[e]) act[a])[r] for every
/// assignment a with expert e. down: stack of n_groups·hidden rows × ffn; act bf16 [m·n_sel,
/// ffn]; slot_out bf16 [m·n_sel, hidden]. Combine with launch_expert_combine.
void launch_quant_gemm_grouped_down(const DeviceQuant& down, int hidden, const int32_t* grouping, int n_groups,
                                    const __nv_bfloat16* act, int m, int n_sel, __nv_bfloat16* slot_out,
                                    cudaStream_t stream);

/// Weighted combine of the per-slot expert outputs (docs/model.md §4.3 item 5, same numerics as
/// launch_expert_down_combine): out[t, r] = bf16(Σ_s weights[t, s]·slot_out[t·n_sel + s, r]),
/// summed in fp32 in slot order (deterministic). out bf16 [m, hidden].
void launch_expert_combine(const __nv_bfloat16* slot_out, const float* weights, int m, int n_sel, int hidden,
                           __nv_bfloat16* out, cudaStream_t stream);

}  // namespace lily::cuda
