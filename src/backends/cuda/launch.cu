// Run-time kernel switches: programmatic dependent launch (launch.cuh), the bulk-copy streaming
// GEMV (quant_gemv.cu), tensor-core prefill attention (flash_prefill.cu), the device sampler
// (sampler.cu), the token-tiled batched GEMV (quant_gemv.cu) and the two-pass GDN prefill
// (gdn.cu), all verified on an H200 and on by default. Process-wide values, not read from the
// environment: the CUDA backend sets them from its CudaOptions (LILY_CUDA_PDL, …;
// kernel_switches.h), tests through the setters. Also the launch-fact cache behind
// raise_smem_limit and blocks_per_sm (launch.cuh).
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "backends/cuda/kernels.h"
#include "backends/cuda/launch.cuh"

namespace lily::cuda {
namespace {

/// The switches' values: on (the verified default) until a setter says otherwise.
std::atomic<bool> g_pdl{true};
std::atomic<bool> g_stream_gemv{true};
std::atomic<bool> g_flash_prefill{true};
std::atomic<bool> g_device_sampler{true};
std::atomic<bool> g_gemv_row_tiles{true};
std::atomic<bool> g_gdn_chunk_parallel{true};
/// The batched GEMV's rows-mode threshold (rows_gemv_staging_min_rows, CudaOptions::rows_gemv_from).
std::atomic<int> g_rows_gemv_staging_min_rows{kRowsGemvFromDefault};
/// The batched GEMV's k-split threshold (rows_gemv_ksplit_from, CudaOptions::rows_gemv_ksplit_from).
std::atomic<int> g_rows_gemv_ksplit_from{kRowsGemvKsplitFromDefault};
/// The rows mode's two warp groups (rows_gemv_split, CudaOptions::rows_gemv_split).
std::atomic<RowsGemvSplit> g_rows_gemv_split{RowsGemvSplit::tiles};
/// The rows mode's largest matrix (rows_mode_max_weight_rows).
std::atomic<int64_t> g_rows_mode_max_weight_rows{kRowsModeMaxWeightRows};
/// The MoE rows kernel's tile split (moe_tile_balance).
std::atomic<int> g_moe_tile_balance{8};
/// Rows from which the MoE rows kernel routes each row once (moe_route_once_from_rows).
std::atomic<int> g_moe_route_once_from_rows{kMoeRouteOnceFromDefault};
/// Rows from which the MoE rows kernel's quads claim their routed gate/up tiles (moe_tile_claims_from_rows).
std::atomic<int> g_moe_tile_claims_from_rows{kMoeTileClaimsFromDefault};
/// The fixed share of the routed tiles under claims (moe_tile_claims_fixed_percent).
std::atomic<int> g_moe_tile_claims_fixed_percent{kMoeTileClaimsFixedDefault};
/// The streaming GEMV's stage budget (stream_gemv_smem_per_sm, stream_gemv_blocks_per_sm).
std::atomic<int64_t> g_stream_smem_per_sm{kStreamSmemPerSm};
std::atomic<int> g_stream_blocks_per_sm{kStreamBlocksPerSm};
std::atomic<StreamLateRequests> g_stream_late_requests{StreamLateRequests::none};

/// What the driver was told and answered per kernel; guarded by `mutex`.
struct LaunchFacts {
  std::mutex mutex;
  std::unordered_map<const void*, size_t> smem_limit;                 ///< the largest limit set
  std::map<std::tuple<const void*, int, size_t>, int> blocks_per_sm;  ///< (kernel, threads, smem)
};

/// The process's one LaunchFacts.
LaunchFacts& launch_facts() {
  static LaunchFacts facts;
  return facts;
}

}  // namespace

namespace detail {

void raise_smem_limit(const void* kernel, size_t smem) {
  LaunchFacts& f = launch_facts();
  const std::lock_guard<std::mutex> lock(f.mutex);
  if (auto it = f.smem_limit.find(kernel); it != f.smem_limit.end() && smem <= it->second) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  f.smem_limit[kernel] = smem;
}

int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  LaunchFacts& f = launch_facts();
  const std::lock_guard<std::mutex> lock(f.mutex);
  const auto key = std::make_tuple(kernel, threads, smem);
  if (auto it = f.blocks_per_sm.find(key); it != f.blocks_per_sm.end()) return it->second;
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  f.blocks_per_sm.emplace(key, n);
  return n;
}

}  // namespace detail

bool pdl_enabled() { return g_pdl.load(std::memory_order_relaxed); }
void set_pdl_enabled(bool on) { g_pdl.store(on, std::memory_order_relaxed); }

bool stream_gemv_enabled() { return g_stream_gemv.load(std::memory_order_relaxed); }
void set_stream_gemv_enabled(bool on) { g_stream_gemv.store(on, std::memory_order_relaxed); }

bool flash_prefill_enabled() { return g_flash_prefill.load(std::memory_order_relaxed); }
void set_flash_prefill_enabled(bool on) { g_flash_prefill.store(on, std::memory_order_relaxed); }

bool device_sampler_enabled() { return g_device_sampler.load(std::memory_order_relaxed); }
void set_device_sampler_enabled(bool on) { g_device_sampler.store(on, std::memory_order_relaxed); }

bool gemv_row_tiles_enabled() { return g_gemv_row_tiles.load(std::memory_order_relaxed); }
void set_gemv_row_tiles_enabled(bool on) { g_gemv_row_tiles.store(on, std::memory_order_relaxed); }

int rows_gemv_staging_min_rows() { return g_rows_gemv_staging_min_rows.load(std::memory_order_relaxed); }
void set_rows_gemv_staging_min_rows(int n) {
  if (n < 1) throw ::lily::Error("set_rows_gemv_staging_min_rows: " + std::to_string(n) + " rows (at least 1)");
  g_rows_gemv_staging_min_rows.store(n, std::memory_order_relaxed);
}

int rows_gemv_ksplit_from() { return g_rows_gemv_ksplit_from.load(std::memory_order_relaxed); }
void set_rows_gemv_ksplit_from(int n) {
  if (n < 1) throw ::lily::Error("set_rows_gemv_ksplit_from: " + std::to_string(n) + " rows (at least 1)");
  g_rows_gemv_ksplit_from.store(n, std::memory_order_relaxed);
}

RowsGemvSplit rows_gemv_split() { return g_rows_gemv_split.load(std::memory_order_relaxed); }
void set_rows_gemv_split(RowsGemvSplit split) { g_rows_gemv_split.store(split, std::memory_order_relaxed); }

int64_t rows_mode_max_weight_rows() { return g_rows_mode_max_weight_rows.load(std::memory_order_relaxed); }
void set_rows_mode_max_weight_rows(int64_t n) {
  if (n < 1) throw ::lily::Error("set_rows_mode_max_weight_rows: " + std::to_string(n) + " rows (at least 1)");
  g_rows_mode_max_weight_rows.store(n, std::memory_order_relaxed);
}

int moe_tile_balance() { return g_moe_tile_balance.load(std::memory_order_relaxed); }
void set_moe_tile_balance(int w) {
  if (w < 0 || w > 1024) throw ::lily::Error("set_moe_tile_balance: " + std::to_string(w) + " (0 … 1024)");
  g_moe_tile_balance.store(w, std::memory_order_relaxed);
}

int moe_route_once_from_rows() { return g_moe_route_once_from_rows.load(std::memory_order_relaxed); }
void set_moe_route_once_from_rows(int n) {
  if (n < 1 || n > kMaxMoeRows + 1)
    throw ::lily::Error("set_moe_route_once_from_rows: " + std::to_string(n) + " (1 … " + std::to_string(kMaxMoeRows + 1) + ")");
  g_moe_route_once_from_rows.store(n, std::memory_order_relaxed);
}
int moe_tile_claims_from_rows() { return g_moe_tile_claims_from_rows.load(std::memory_order_relaxed); }
void set_moe_tile_claims_from_rows(int n) {
  if (n < 1 || n > kMaxMoeRows + 1)
    throw ::lily::Error("CudaOptions::moe_tile_claims_from (LILY_CUDA_MOE_TILE_CLAIMS_FROM) must be 1 … " +
                        std::to_string(kMaxMoeRows + 1) + ", got " + std::to_string(n));
  g_moe_tile_claims_from_rows.store(n, std::memory_order_relaxed);
}
int moe_tile_claims_fixed_percent() { return g_moe_tile_claims_fixed_percent.load(std::memory_order_relaxed); }
void set_moe_tile_claims_fixed_percent(int percent) {
  if (percent < 0 || percent > 100)
    throw ::lily::Error("CudaOptions::moe_tile_claims_fixed (LILY_CUDA_MOE_TILE_CLAIMS_FIXED) must be 0 … 100 (per cent), got " +
                        std::to_string(percent));
  g_moe_tile_claims_fixed_percent.store(percent, std::memory_order_relaxed);
}

int64_t stream_gemv_smem_per_sm() { return g_stream_smem_per_sm.load(std::memory_order_relaxed); }
void set_stream_gemv_smem_per_sm(int64_t bytes) {
  if (bytes < 16 * 1024 || bytes > kStreamSmemMax)
    throw ::lily::Error("set_stream_gemv_smem_per_sm: " + std::to_string(bytes) + " bytes (16 KiB … " +
                        std::to_string(kStreamSmemMax) + ")");
  g_stream_smem_per_sm.store(bytes, std::memory_order_relaxed);
}

int stream_gemv_blocks_per_sm() { return g_stream_blocks_per_sm.load(std::memory_order_relaxed); }
void set_stream_gemv_blocks_per_sm(int n) {
  if (n < 1 || n > kStreamBlocksPerSm)
    throw ::lily::Error("set_stream_gemv_blocks_per_sm: " + std::to_string(n) + " (1 … " +
                        std::to_string(kStreamBlocksPerSm) + ")");
  g_stream_blocks_per_sm.store(n, std::memory_order_relaxed);
}

StreamLateRequests stream_gemv_late_requests() { return g_stream_late_requests.load(std::memory_order_relaxed); }
void set_stream_gemv_late_requests(StreamLateRequests which) { g_stream_late_requests.store(which, std::memory_order_relaxed); }

bool gdn_chunk_parallel_enabled() { return g_gdn_chunk_parallel.load(std::memory_order_relaxed); }
void set_gdn_chunk_parallel_enabled(bool on) { g_gdn_chunk_parallel.store(on, std::memory_order_relaxed); }

}  // namespace lily::cuda
