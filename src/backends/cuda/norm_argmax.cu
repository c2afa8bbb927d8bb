// Residual add + RMSNorm (docs/model.md §3.2, §4.3 item 2) and the greedy argmax over the
// fp32 lm_head logits (docs/model.md §3.6), two stages: per-block best, then one block over those.
#include <cfloat>
#include <climits>

#include "backends/cuda/argmax.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/kernels.h"

namespace lily::cuda {
namespace {

constexpr int kNormThreads = 256;

constexpr int kNormBatch = 8;  // elements per thread held in registers (hidden ≤ 2,048 on 256 threads)

/// Row blockIdx.x of x [m, n] (bf16): h = bf16(x + branch) written back to x when branch is
/// non-null, y = bf16(h · r · gain) with r = 1/sqrt(mean(h²) + eps). Thread i owns elements
/// i, i + 256, …, summed in that order, then block_sum: the mapping and order stage_norm_row
/// (the fused decode norm) repeats, so both give the same bits. Rows of ≤ kNormBatch·256
/// elements stay in registers (every load in flight at once); longer rows take a second pass.
__global__ void __launch_bounds__(kNormThreads) add_rmsnorm_kernel(bf16* __restrict__ x, const bf16* __restrict__ branch,
                                                                   const float* __restrict__ gain, bf16* __restrict__ y,
                                                                   int n, float eps) {
  pdl_prologue();
  __shared__ float scratch[32];
  const int64_t off = static_cast<int64_t>(blockIdx.x) * n;
  bf16* xr = x + off;
  const bf16* br = branch ? branch + off : nullptr;
  bf16* yr = y + off;
  auto residual = [&](int i) {  // h of element i (and stores it when there is a branch)
    float v = to_f32(xr[i]);
    if (br) {
      const bf16 h = to_bf16(v + to_f32(br[i]));
      xr[i] = h;
      v = to_f32(h);
    }
    return v;
  };
  float ss = 0.0f;
  if (n <= kNormBatch * kNormThreads) {
    float h[kNormBatch];
#pragma unroll
    for (int k = 0; k < kNormBatch; ++k) {
      const int i = threadIdx.x + k * kNormThreads;
      h[k] = i < n ? residual(i) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kNormBatch; ++k) ss += h[k] * h[k];  // zeros past n add nothing
    const float r = 1.0f / sqrtf(block_sum(ss, scratch) / static_cast<float>(n) + eps);
#pragma unroll
    for (int k = 0; k < kNormBatch; ++k) {
      const int i = threadIdx.x + k * kNormThreads;
      if (i < n) yr[i] = to_bf16(h[k] * r * gain[i]);
    }
    return;
  }
  for (int i = threadIdx.x; i < n; i += kNormThreads) {
    const float v = residual(i);
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(block_sum(ss, scratch) / static_cast<float>(n) + eps);
  for (int i = threadIdx.x; i < n; i += kNormThreads) yr[i] = to_bf16(to_f32(xr[i]) * r * gain[i]);
}

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxMaxBlocks = 1024;

/// Block b of row blockIdx.y: the best (value, index) of its share of logits [n] (row r at
/// logits + r·n), into part_v / part_i [r·gridDim.x + b].
__global__ void argmax_partial_kernel(const float* __restrict__ logits, int64_t n, float* part_v, int32_t* part_i) {
  pdl_prologue();
  logits += static_cast<int64_t>(blockIdx.y) * n;
  part_v += static_cast<int64_t>(blockIdx.y) * gridDim.x;
  part_i += static_cast<int64_t>(blockIdx.y) * gridDim.x;
  float v = -INFINITY;
  int i = INT_MAX;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = logits[k];
    if (argmax_beats(x, static_cast<int>(k), v, i)) { v = x; i = static_cast<int>(k); }
  }
  block_argmax(v, i);
  if (threadIdx.x == 0) { part_v[blockIdx.x] = v; part_i[blockIdx.x] = i; }
}

/// Row blockIdx.x: the best of its `parts` partials, into out_id[blockIdx.x].
__global__ void argmax_final_kernel(const float* part_v, const int32_t* part_i, int parts, int32_t* out_id) {
  pdl_prologue();
  part_v += static_cast<int64_t>(blockIdx.x) * parts;
  part_i += static_cast<int64_t>(blockIdx.x) * parts;
  out_id += blockIdx.x;
  float v = -INFINITY;
  int i = INT_MAX;
  for (int k = threadIdx.x; k < parts; k += blockDim.x)
    if (argmax_beats(part_v[k], part_i[k], v, i)) { v = part_v[k]; i = part_i[k]; }
  block_argmax(v, i);
  if (threadIdx.x == 0) *out_id = (i == INT_MAX) ? 0 : i;  // all NaN: id 0
}

int argmax_blocks(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kArgmaxMaxBlocks, ceil_div(n, kArgmaxThreads * 16))));
}

}  // namespace

void launch_add_rmsnorm(bf16* x, const bf16* branch, const float* gain, bf16* y, int m, int n, float eps,
                        cudaStream_t stream) {
  if (m <= 0 || n <= 0) throw ::lily::InternalError("launch_add_rmsnorm: empty input");
  launch_pdl(add_rmsnorm_kernel, dim3(m), dim3(kNormThreads), 0, stream, x, branch, gain, y, n, eps);
}

int argmax_scratch_slots(int64_t n) { return argmax_blocks(n); }

void launch_argmax(const float* logits, int64_t n, float* scratch_val, int32_t* scratch_idx, int32_t* out_id,
                   cudaStream_t stream) {
  launch_argmax_rows(logits, 1, n, scratch_val, scratch_idx, out_id, stream);
}

void launch_argmax_rows(const float* logits, int rows, int64_t n, float* scratch_val, int32_t* scratch_idx,
                        int32_t* out_ids, cudaStream_t stream) {
  if (n <= 0 || n > INT_MAX) throw ::lily::InternalError("launch_argmax: bad length");
  if (rows <= 0 || rows > 65535) throw ::lily::InternalError("launch_argmax_rows: rows must be 1 … 65535");
  const int blocks = argmax_blocks(n);
  launch_pdl(argmax_partial_kernel, dim3(blocks, rows), dim3(kArgmaxThreads), 0, stream, logits, n, scratch_val,
             scratch_idx);
  launch_pdl(argmax_final_kernel, dim3(rows), dim3(kArgmaxMaxBlocks), 0, stream, scratch_val, scratch_idx, blocks,
             out_ids);
}

}  // namespace lily::cuda
