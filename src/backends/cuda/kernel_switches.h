// The one bridge from CudaOptions (engine/backend.h) to the CUDA kernel layer's process-wide
// switches (kernels.h, mixer_kernels.h, quant_gemm.h). No kernel reads the environment: the
// LILY_CUDA_* variables are read and validated once, by CudaOptions::from_env, and the CUDA
// backend applies its options here when it is created.
#pragma once
#include "engine/backend.h"

namespace lily::cuda {

/// Sets every kernel-level switch from `options`: pdl, stream_gemv, gemv_tile_counter,
/// gemv_blocks_per_sm, gemv_smem_kib, gemv_late_requests, flash_prefill, device_sampler,
/// gemv_row_tiles, gdn_chunk_parallel, gdn_local_mma, gdn_state_mma, gemm_kernel and
/// rows_gemv_from. Process-wide: the last backend created sets them. Throws lily::Error, before
/// setting anything, for a gemm_kernel other than "wgmma-mixed", "wgmma-narrow", "wgmma",
/// "grouped", "all" or "0", a gemv_late_requests other than "none", "staged" or "all", or a
/// rows_gemv_from outside 1 … CudaOptions::kRowsGemvNever (from_env never gives any of them).
void apply_kernel_switches(const CudaOptions& options);

}  // namespace lily::cuda
