// The decode router: MLX-affine router GEMV (router ‖ shared-expert gate rows, fp32 logits) fused
// with the top-k routing (docs/model.md §3.5; one launch instead of two, docs/benchmark.md §3.3).
// Every block computes a share of the logit rows with exactly the per-row arithmetic of
// quant_gemv.cu (router_rows.cuh), stores them, and counts itself done on a
// per-token atomic counter; the last block to finish a token row routes it with one warp
// (route_token_keys: two warp-reduce instructions per pick, bit-identical to the warp routine of
// the stand-alone top-k kernel, NaN and ties included; router_topk.cuh). Each warp's first
// weights are read before the PDL wait, so the DRAM round trip overlaps the predecessor.
// One launch instead of two, and no second launch latency on the decode critical path.
#include <algorithm>
#include <string>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/router_rows.cuh"
#include "backends/cuda/router_topk.cuh"

namespace lily::cuda {
namespace {

constexpr int kRouterThreads = 256;
constexpr int kRouterWarps = kRouterThreads / kWarp;

/// grid (blocks, m). w: [E + 1, cols]; x [m, cols]; logits [m, E + 1]; ids, weights [m, k + 1];
/// done [m] counters (zero on entry, zero again on exit).
template <int BITS>
__global__ void __launch_bounds__(kRouterThreads)
    router_fused_kernel(DeviceQuant w, const bf16* __restrict__ x, int E, int k, float* __restrict__ logits,
                        int32_t* __restrict__ ids, float* __restrict__ weights, uint32_t* __restrict__ done,
                        FusedNorm norm) {
  extern __shared__ float smem[];
  __shared__ bool last;
  const int groups = w.cols / kGroup;
  const int t = blockIdx.y;
  // GEMV share of this block's warps (router_rows.cuh), first weights before the PDL wait.
  RouterRows<BITS> rows(w, static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp,
                        static_cast<int64_t>(gridDim.x) * kRouterWarps);
  pdl_prologue();
  float* xs = smem;
  float* xsum = smem + groups * kGroupStride;
  if (norm.gain) stage_norm_row(x, norm, w.cols, blockIdx.x == 0, xs, xsum);  // m = 1
  else stage_row(x + static_cast<int64_t>(t) * w.cols, w.cols, xs, xsum);
  float* out = logits + static_cast<int64_t>(t) * w.rows;
  rows.compute(w, xs, xsum, out);

  // Last-block-done: publish this block's logits, count it, and let the last block route.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(&done[t], 1u);
    last = prev == gridDim.x - 1;
    if (last) done[t] = 0;  // every block of this row has counted: reset for the next launch
  }
  __syncthreads();
  if (!last || threadIdx.x >= kWarp) return;
  __threadfence();
  int32_t* tok_ids = ids + static_cast<int64_t>(t) * routed_plus_shared_slots(k);
  float* tok_w = weights + static_cast<int64_t>(t) * routed_plus_shared_slots(k);
  if (E <= kWarp * kRouteKeysSmall) route_token_keys<kRouteKeysSmall>(out, E, k, tok_ids, tok_w);
  else route_token_keys<kRouteKeysLarge>(out, E, k, tok_ids, tok_w);
}

void router_dispatch(const DeviceQuant& w, const bf16* x, int m, int n_experts, int top_k, float* logits,
                     int32_t* ids, float* weights, uint32_t* done, cudaStream_t stream, const FusedNorm& norm) {
  if ((w.bits != 4 && w.bits != 8) || w.cols <= 0 || w.cols % kGroup != 0 || w.cols > kMaxGemvCols)
    throw ::lily::Error("MoE router: the fused CUDA router supports 4/8-bit matrices with cols a multiple of " +
                        std::to_string(kGroup) + " and ≤ " + std::to_string(kMaxGemvCols) + "; got bits=" + std::to_string(w.bits) + " cols=" + std::to_string(w.cols));
  if (n_experts < 1 || n_experts > kMaxExperts || top_k < 1 || top_k > kMaxTopK || top_k > n_experts)
    throw ::lily::Error("MoE router: CUDA kernel supports ≤ " + std::to_string(kMaxExperts) + " experts and top-k ≤ " +
                        std::to_string(kMaxTopK) + "; got " + std::to_string(n_experts) + " experts, top-k " +
                        std::to_string(top_k));
  if (w.rows != routed_plus_shared_experts(n_experts))
    throw ::lily::Error("MoE router: the router matrix has " + std::to_string(w.rows) + " rows, expected n_experts + 1 = " +
                        std::to_string(routed_plus_shared_experts(n_experts)) +
                        " (router rows then the shared-expert gate row)");
  if (m <= 0 || m > 65535) throw ::lily::InternalError("launch_router_fused: need 0 < m ≤ 65535");
  const int L = lanes_per_row(w.cols / kGroup);
  const int64_t rows_per_block = static_cast<int64_t>(kRouterWarps) * (kWarp / L);
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(w.rows, rows_per_block), 4LL * sm_count()));
  const size_t smem = staged_row_bytes(w.cols);
  launch_pdl(w.bits == 4 ? router_fused_kernel<4> : router_fused_kernel<8>, dim3(blocks, m), dim3(kRouterThreads), smem,
             stream, w, x, n_experts, top_k, logits, ids, weights, done, norm);
}

}  // namespace

void launch_router_fused(const DeviceQuant& w, const bf16* x, int m, int n_experts, int top_k, float* logits,
                         int32_t* ids, float* weights, uint32_t* done, cudaStream_t stream) {
  router_dispatch(w, x, m, n_experts, top_k, logits, ids, weights, done, stream, FusedNorm{});
}

void launch_add_rmsnorm_router_fused(const FusedNorm& norm, const bf16* x, const DeviceQuant& w, int n_experts,
                                     int top_k, float* logits, int32_t* ids, float* weights, uint32_t* done,
                                     cudaStream_t stream) {
  check_fused_norm(norm, x, "launch_add_rmsnorm_router_fused");
  router_dispatch(w, x, 1, n_experts, top_k, logits, ids, weights, done, stream, norm);
}

}  // namespace lily::cuda
