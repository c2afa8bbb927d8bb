// CudaOptions → the kernel layer's switches (kernel_switches.h).
#include "backends/cuda/kernel_switches.h"

#include <string>

#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/quant_gemm.h"
#include "base/error.h"

namespace lily::cuda {
namespace {

static_assert(CudaOptions::kMaxDecodeRows == kMaxDecodeRows, "LILY_CUDA_DECODE_ROWS' limit: the rows a forward holds");
static_assert(CudaOptions::kRowsGemvNever == kMaxDecodeRows + 1, "LILY_CUDA_ROWS_GEMV_FROM's never: more rows than a forward holds");
static_assert(CudaOptions{}.rows_gemv_from == kRowsGemvFromDefault, "one default for the rows mode's threshold");
static_assert(CudaOptions{}.rows_gemv_ksplit_from == kRowsGemvKsplitFromDefault, "one default for the k-split's threshold");
static_assert(CudaOptions{}.moe_tile_claims_from == kMoeTileClaimsFromDefault, "one default for the MoE tile claims' threshold");
static_assert(CudaOptions{}.moe_tile_claims_fixed == kMoeTileClaimsFixedDefault, "one default for the MoE tile claims' fixed share");
static_assert(CudaOptions::kRowsGemvNever == kMaxMoeRows + 1, "LILY_CUDA_MOE_TILE_CLAIMS_FROM's never: more rows than a MoE launch takes");
static_assert(CudaOptions{}.gemv_blocks_per_sm == kStreamBlocksPerSm, "one default for the streaming GEMV's blocks per SM");
static_assert(CudaOptions::kMaxGemvBlocksPerSm == kStreamBlocksPerSm, "LILY_CUDA_GEMV_BLOCKS_PER_SM's limit: the kernel's register budget");
static_assert(int64_t{CudaOptions{}.gemv_smem_kib} * 1024 == kStreamSmemPerSm, "one default for its stage memory");
static_assert(int64_t{CudaOptions::kMaxGemvSmemKib} * 1024 == kStreamSmemMax, "LILY_CUDA_GEMV_SMEM_KIB's limit: a block's shared memory at most");

GemmKernel parse_gemm_kernel(const std::string& v) {
  if (v == "grouped") return GemmKernel::kGrouped;
  if (v == "all") return GemmKernel::kAll;
  if (v == "0") return GemmKernel::kOff;
  if (v == "wgmma") return GemmKernel::kWgmma;
  if (v == "wgmma-narrow") return GemmKernel::kWgmmaNarrow;
  if (v == "wgmma-mixed") return GemmKernel::kWgmmaMixed;
  throw ::lily::Error("CudaOptions::gemm_kernel (LILY_CUDA_GEMM_KERNEL) must be 'grouped', 'all', '0', 'wgmma', "
                      "'wgmma-narrow' or 'wgmma-mixed', got '" + v + "'");
}

StreamLateRequests parse_late_requests(const std::string& v) {
  if (v == "none") return StreamLateRequests::none;
  if (v == "staged") return StreamLateRequests::staged;
  if (v == "all") return StreamLateRequests::all;
  throw ::lily::Error("CudaOptions::gemv_late_requests (LILY_CUDA_GEMV_LATE_REQUESTS) must be 'none', 'staged' or "
                      "'all', got '" + v + "'");
}

RowsGemvSplit parse_rows_gemv_split(const std::string& v) {
  if (v == "tiles") return RowsGemvSplit::tiles;
  if (v == "all") return RowsGemvSplit::all;
  if (v == "0") return RowsGemvSplit::none;
  throw ::lily::Error("CudaOptions::rows_gemv_split (LILY_CUDA_ROWS_GEMV_SPLIT) must be 'tiles', 'all' or '0', got '" + v + "'");
}

/// A row-count threshold (1 … kRowsGemvNever, the last meaning never), checked before any switch
/// is set. Throws lily::Error naming the field and its variable.
void check_rows_threshold(int value, const char* field, const char* variable) {
  if (value < 1 || value > CudaOptions::kRowsGemvNever)
    throw ::lily::Error(std::string("CudaOptions::") + field + " (" + variable + ") must be 1 … " +
                        std::to_string(CudaOptions::kRowsGemvNever) + ", got " + std::to_string(value));
}

}  // namespace

void apply_kernel_switches(const CudaOptions& options) {
  const GemmKernel gemm = parse_gemm_kernel(options.gemm_kernel);
  const StreamLateRequests late = parse_late_requests(options.gemv_late_requests);
  const RowsGemvSplit split = parse_rows_gemv_split(options.rows_gemv_split);
  check_rows_threshold(options.rows_gemv_from, "rows_gemv_from", "LILY_CUDA_ROWS_GEMV_FROM");
  check_rows_threshold(options.rows_gemv_ksplit_from, "rows_gemv_ksplit_from", "LILY_CUDA_ROWS_GEMV_KSPLIT_FROM");
  check_rows_threshold(options.moe_tile_claims_from, "moe_tile_claims_from", "LILY_CUDA_MOE_TILE_CLAIMS_FROM");
  if (options.moe_tile_claims_fixed < 0 || options.moe_tile_claims_fixed > 100)
    throw ::lily::Error("CudaOptions::moe_tile_claims_fixed (LILY_CUDA_MOE_TILE_CLAIMS_FIXED) must be 0 … 100 (per cent), got " +
                        std::to_string(options.moe_tile_claims_fixed));
  set_pdl_enabled(options.pdl);
  set_stream_gemv_enabled(options.stream_gemv);
  set_stream_gemv_tile_counter_enabled(options.gemv_tile_counter);
  set_stream_gemv_blocks_per_sm(options.gemv_blocks_per_sm);
  set_stream_gemv_smem_per_sm(int64_t{options.gemv_smem_kib} * 1024);
  set_stream_gemv_late_requests(late);
  set_flash_prefill_enabled(options.flash_prefill);
  set_device_sampler_enabled(options.device_sampler);
  set_gemv_row_tiles_enabled(options.gemv_row_tiles);
  set_gdn_chunk_parallel_enabled(options.gdn_chunk_parallel);
  set_gdn_local_mma_enabled(options.gdn_local_mma);
  set_gdn_state_mma_enabled(options.gdn_state_mma);
  set_gemm_kernel(gemm);
  set_rows_gemv_staging_min_rows(options.rows_gemv_from);
  set_moe_tile_balance(options.moe_tile_balance);
  set_moe_tile_claims_from_rows(options.moe_tile_claims_from);
  set_moe_tile_claims_fixed_percent(options.moe_tile_claims_fixed);
  set_rows_gemv_split(split);
  set_rows_gemv_ksplit_from(options.rows_gemv_ksplit_from);
}

}  // namespace lily::cuda
