// Run-time kernel switches, read once from the environment: programmatic dependent launch
// (launch.cuh, LILY_CUDA_PDL), the bulk-copy streaming GEMV (quant_gemv.cu, LILY_CUDA_STREAM_GEMV)
// tensor-core prefill attention (flash_prefill.cu, LILY_CUDA_FLASH_PREFILL) and the device
// sampler (sampler.cu, LILY_CUDA_DEVICE_SAMPLER), the token-tiled batched GEMV (quant_gemv.cu,
// LILY_CUDA_GEMV_ROW_TILES) and the two-pass GDN prefill (gdn.cu, LILY_CUDA_GDN_CHUNK_PARALLEL),
// all verified on an H200 and on by default ("0" turns one off for a same-machine comparison).
// Also the launch-fact cache behind raise_smem_limit and blocks_per_sm (launch.cuh).
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "backends/cuda/kernels.h"
#include "backends/cuda/launch.cuh"
#include "base/error.h"

namespace lily::cuda {
namespace {

/// -1: not read yet; 0: off; 1: on.
std::atomic<int> g_pdl{-1};
std::atomic<int> g_stream_gemv{-1};
std::atomic<int> g_flash_prefill{-1};
std::atomic<int> g_device_sampler{-1};
std::atomic<int> g_gemv_row_tiles{-1};
std::atomic<int> g_gdn_chunk_parallel{-1};

/// `dflt` for unset or empty, 1 for "1", 0 for "0"; throws lily::Error naming the variable
/// otherwise.
int switch_from_env(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  if (std::string(v) == "1") return 1;
  if (std::string(v) == "0") return 0;
  throw ::lily::Error(std::string(name) + " must be '0' (off) or '1' (on), got '" + v + "'");
}

bool read_switch(std::atomic<int>& state, const char* name, int dflt = 1) {
  int s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    s = switch_from_env(name, dflt);
    int expected = -1;
    if (!state.compare_exchange_strong(expected, s)) s = expected;
  }
  return s == 1;
}

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

bool pdl_enabled() { return read_switch(g_pdl, "LILY_CUDA_PDL"); }
void set_pdl_enabled(bool on) { g_pdl.store(on ? 1 : 0); }

bool stream_gemv_enabled() { return read_switch(g_stream_gemv, "LILY_CUDA_STREAM_GEMV"); }
void set_stream_gemv_enabled(bool on) { g_stream_gemv.store(on ? 1 : 0); }

bool flash_prefill_enabled() { return read_switch(g_flash_prefill, "LILY_CUDA_FLASH_PREFILL"); }
void set_flash_prefill_enabled(bool on) { g_flash_prefill.store(on ? 1 : 0); }

bool device_sampler_enabled() { return read_switch(g_device_sampler, "LILY_CUDA_DEVICE_SAMPLER", 1); }
void set_device_sampler_enabled(bool on) { g_device_sampler.store(on ? 1 : 0); }

bool gemv_row_tiles_enabled() { return read_switch(g_gemv_row_tiles, "LILY_CUDA_GEMV_ROW_TILES", 1); }
void set_gemv_row_tiles_enabled(bool on) { g_gemv_row_tiles.store(on ? 1 : 0); }

bool gdn_chunk_parallel_enabled() { return read_switch(g_gdn_chunk_parallel, "LILY_CUDA_GDN_CHUNK_PARALLEL", 1); }
void set_gdn_chunk_parallel_enabled(bool on) { g_gdn_chunk_parallel.store(on ? 1 : 0); }

}  // namespace lily::cuda
