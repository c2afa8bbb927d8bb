// What the two fused decode MoE kernels share (nvcc only): the one-token block of the
// single-sequence decode (moe_block.cu) and the 1 … 8-row block of the batched decode
// (moe_block_rows.cu). Both run one 512-thread block per SM, all resident at once, with grid
// barriers on counters the caller zeroes, and stream the expert weights into shared-memory
// stages by bulk copies: a gate/up tile is 8 rows of one expert's gate matrix and the same 8
// rows of its up matrix (16 MMA rows), a down tile 16 output rows of one expert.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/kernels.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/quant_mma.cuh"

namespace lily::cuda::moe {

constexpr int kBlockWarps = 16;
constexpr int kBlockThreads = kBlockWarps * kWarp;
constexpr int kTileRows = 16;          // the MMA's M
constexpr int kExpertRowsPerTile = 8;  // a gate/up tile: 8 gate rows and the same 8 up rows
constexpr int kNormThreads = 256;      // launch_add_rmsnorm's element-to-thread mapping
constexpr int64_t kSmemLimit = 226 * 1024;  // dynamic shared memory per block (227 KB less static)

/// Bytes of one gate/up tile (16 code rows of hidden / 2 bytes, then [16][hidden / 64] scales
/// and biases) and of one down tile (16 code rows of ffn / 2 bytes, then scales and biases).
__host__ __device__ inline int gate_up_tile_bytes(int hidden) { return kTileRows * (hidden / 2) + 4 * kTileRows * (hidden / kGroup); }
__host__ __device__ inline int down_tile_bytes(int ffn) { return kTileRows * (ffn / 2) + 4 * kTileRows * (ffn / kGroup); }

/// Waits until all `blocks` blocks of the grid have arrived at `counter` (zero before the
/// launch, one counter per barrier). Release/acquire at GPU scope: every block's global writes
/// before the barrier are visible to every block after it. All threads of the block.
__device__ __forceinline__ void grid_sync(uint32_t* counter, uint32_t blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    uint32_t seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < blocks);
  }
  __syncthreads();
}

/// One warp: requests the gate/up tile of expert rows row0 … row0 + 7 (row0 = expert·ffn + 8·chunk)
/// into `stage`, counted on `bar` (one arrival): the 8 gate code rows, the same 8 up rows, then
/// scales and biases as [16 tile rows][groups] each (tile rows 0–7 gate, 8–15 up), so MMA row
/// slot g is gate row row0 + g and slot g + 8 the same up row (tile_view). Six bulk copies, lanes
/// 0–5: each is one contiguous run of the checkpoint. `reuse`: the stage was read before, by
/// threads that have passed a barrier with this warp (the proxy fence orders their loads before
/// the copies).
__device__ __forceinline__ void request_gate_up_tile(const MoeDecodeArgs& a, int64_t row0, unsigned char* stage,
                                                     uint64_t* bar, bool reuse = false) {
  const int lane = threadIdx.x % kWarp;
  const int hidden = a.gate.cols, row_bytes = hidden / 2, groups = hidden / kGroup;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(gate_up_tile_bytes(hidden)));
  __syncwarp();
  if (reuse) fence_proxy_async_shared();
  if (lane >= 6) return;
  const bool up = lane % 2 == 1;
  const DeviceQuant& w = up ? a.up : a.gate;
  const int half_rows = kTileRows / 2;
  if (lane < 2) {
    bulk_copy_to_shared(stage + (up ? half_rows * row_bytes : 0),
                        reinterpret_cast<const unsigned char*>(w.codes) + row0 * row_bytes,
                        static_cast<uint32_t>(half_rows * row_bytes), bar);
  } else {
    const bf16* src = (lane < 4 ? w.scales : w.biases) + row0 * groups;
    unsigned char* dst = stage + kTileRows * row_bytes + (lane >= 4 ? kTileRows * groups * 2 : 0) +
                         (up ? half_rows * groups * 2 : 0);
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(half_rows * groups * 2), bar);
  }
}

/// One thread's view of a stage (16 code rows, then [16][groups] scales, then biases) for its
/// MMA row slots g and g + 8 (tile rows g and g + 8). The rows are row_bytes apart, a multiple
/// of 128, so the eight rows of a fragment load share banks: 8 shared-memory wavefronts instead
/// of 2, a few cycles per group against the microseconds the tile takes to arrive.
struct TileView {
  const unsigned char* code_lo;  ///< this thread's 8 bytes of group 0, slot g's row
  const unsigned char* code_hi;  ///< same, slot g + 8's row
  const bf16 *s_lo, *s_hi, *b_lo, *b_hi;
};

__device__ __forceinline__ TileView tile_view(const unsigned char* stage, int row_bytes, int groups, int g, int t) {
  TileView v;
  v.code_lo = stage + g * row_bytes + 8 * t;
  v.code_hi = v.code_lo + 8 * row_bytes;
  const bf16* sc = reinterpret_cast<const bf16*>(stage + kTileRows * row_bytes);
  const bf16* bi = sc + kTileRows * groups;
  v.s_lo = sc + g * groups;
  v.s_hi = sc + (g + 8) * groups;
  v.b_lo = bi + g * groups;
  v.b_hi = bi + (g + 8) * groups;
  return v;
}

/// Stages row x[0, cols) (bf16, 16-byte aligned, cols a multiple of 64) for group_one_token's
/// tensor-core products: perm[cols / 2] gets the bf16 pairs in fragment order, sums[cols / 64]
/// each group's Σx. 16 bytes (8 columns c0 … c0 + 7, c0 a multiple of 8) are exactly the
/// fragment-order pairs (c0 + s, c0 + s + 4), s < 4, at pair index c0 / 2
/// (fragment_pair_column): each load is permuted in registers and stored as one 16-byte word.
/// The 8 chunks of a 64-group sit in 8 consecutive lanes, which add up its Σx (so the sum order
/// depends on cols alone). kL2: x was written in this launch by other blocks, so it is read
/// through L2 (ld.global.cg). All threads of the block; no barrier at the end.
template <bool kL2>
__device__ __forceinline__ void stage_fragment_row(const bf16* x, int cols, uint32_t* perm, float* sums) {
  const int lane = threadIdx.x % kWarp, n16 = cols / 8;
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  for (int i0 = threadIdx.x; i0 - lane < n16; i0 += kStageBatch * blockDim.x) {  // warp-uniform
    uint4 v[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u)  // every load in flight first
      if (i0 + u * static_cast<int>(blockDim.x) < n16) v[u] = kL2 ? __ldcg(x16 + i0 + u * blockDim.x) : x16[i0 + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int idx = i0 + u * static_cast<int>(blockDim.x);
      if (idx - lane >= n16) break;  // warp-uniform
      float part = 0.0f;
      if (idx < n16) {
        const uint4 w = v[u];
        *reinterpret_cast<uint4*>(perm + idx * 4) =
            make_uint4(__byte_perm(w.x, w.z, 0x5410), __byte_perm(w.x, w.z, 0x7632), __byte_perm(w.y, w.w, 0x5410),
                       __byte_perm(w.y, w.w, 0x7632));
        const float4 lo = bf16x4_to_f32(w.x, w.y), hi = bf16x4_to_f32(w.z, w.w);
        part = ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
      }
      part = group_sum(part, 8);
      if (idx < n16 && lane % 8 == 0) sums[idx / 8] = part;
    }
  }
}

/// Records phase `point` of this block in a.trace (diagnostics; no-op when a.trace is null).
__device__ __forceinline__ void trace_point(const MoeDecodeArgs& a, int point) {
  if (a.trace && threadIdx.x == 0) {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    a.trace[int64_t{blockIdx.x} * kMoeTracePoints + point] = ns;
  }
}

/// Why neither fused kernel can run `a`'s matrices ("" when they can): 4-bit experts, a 4/8-bit
/// router, 1 ≤ top-k ≤ min(kMaxTopK, E), E ≤ kMaxExperts, hidden a multiple of 256 (≤ kMaxGemvCols), ffn a
/// multiple of 64, the stacked shapes, 16-byte aligned expert arrays. Host only.
std::string shape_problem(const MoeDecodeArgs& a);

/// Throws lily::InternalError when a's buffers are missing or alias (both kernels). Host only.
void check_buffers(const MoeDecodeArgs& a, const char* what);

/// A fused kernel's launch as its moe_plan works it out: the grid, the kernel's shared-memory
/// layout and the instance for the router's width, or why it cannot run. Host only.
template <class Layout>
struct MoePlan {
  std::string why;  ///< "" when the kernel applies
  int blocks = 0;
  Layout layout;
  void (*kernel)(MoeDecodeArgs, Layout) = nullptr;  ///< set once the shape checks pass
};

/// The grid of either fused kernel: one block per SM, at most max_blocks when that is > 0.
/// Host only.
inline int plan_blocks(int max_blocks) {
  int blocks = sm_count();
  if (max_blocks > 0) blocks = std::min(blocks, max_blocks);
  return blocks;
}

/// Why `kernel` cannot run one kBlockThreads block per SM with `smem` bytes of dynamic shared
/// memory ("" when it can): more than kSmemLimit, or no block fits once the kernel's limit is
/// set to `smem` (which it is, when smem ≤ kSmemLimit). Host only.
template <class Layout>
std::string fit_problem(void (*kernel)(MoeDecodeArgs, Layout), int64_t smem) {
  if (smem > kSmemLimit) return "a block's expert tiles need " + std::to_string(smem) + " bytes of shared memory";
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, smem));
  if (per_sm < 1) return "a block does not fit on an SM";
  return "";
}

/// Launches plan p on a's buffers: throws lily::Error with p.why when it cannot run, and
/// lily::InternalError when the buffers are missing or alias (check_buffers, `what` naming the
/// launcher). Host only.
template <class Layout>
void launch_plan(const MoePlan<Layout>& p, const MoeDecodeArgs& a, cudaStream_t stream, const char* what) {
  if (!p.why.empty()) throw ::lily::Error(p.why);
  check_buffers(a, what);
  launch_pdl(p.kernel, dim3(p.blocks), dim3(kBlockThreads), static_cast<size_t>(p.layout.total), stream, a, p.layout);
}

}  // namespace lily::cuda::moe
