// MLX-affine GEMV (4- and 8-bit) and the embedding gather (docs/model.md §3.1, §4.2).
// Layout: the checkpoint's own (codes U32 row-major, bf16 scales/biases per 64-group), so
// fused projections are plain row concatenations. Three kernels, chosen by shape:
//  - quant_stream_gemv_kernel (4-bit, m ≤ 8 — the batched decode's rows: ≤ 32 — cols % 512 ==
//    0: every decode projection of the real model): tensor cores, weights streamed into shared
//    memory by bulk copies; the activations staged per block where a norm or conv is fused, else
//    read in place (direct), or for the batched rows staged once per block (rows, StreamMode);
//  - quant_mma_gemv_kernel (other 4-bit shapes with m ≤ 8): tensor cores, register loads;
//  - quant_gemv_tiled_kernel (m > 1, unless LILY_CUDA_GEMV_ROW_TILES=0): quant_gemv_kernel's
//    arithmetic with each weight group loaded once per 8 token rows (the prefill router);
//  - quant_gemv_kernel (8-bit, or m > 8): CUDA cores. One warp covers 32/L rows at a time (L
//    lanes per row, each lane one 64-group per step); each lane issues the loads of 4 rows
//    before using them. The grid is one wave of resident blocks; each warp walks chunks of
//    contiguous rows. (An L2 bulk prefetch of each warp's next chunks was measured and lost
//    2.5 %: docs/performance/2026-12-01-decode-kernels.md.)
#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/quant_mma.cuh"
#include "backends/cuda/stream_gemv.cuh"

namespace lily::cuda {
namespace {

constexpr int kGemvThreads = 256;

/// Diagnostics (null in production): where later launches of quant_stream_gemv_kernel stamp
/// %globaltimer (ns) at each phase end, uint64 [blocks][kStreamTracePoints]
/// (set_stream_gemv_trace). A kernel parameter, not a __device__ variable: a global load at the
/// kernel's entry would hold thread 0 before it requests the first weight tiles.
uint64_t* g_stream_trace = nullptr;
bool g_stream_trace_advance = false;                 // each launch its own slice (set_stream_gemv_trace)
std::vector<StreamTraceLaunch> g_stream_trace_launches;  // those launches, in enqueue order

/// The streaming GEMV's tile counter on each device: the next tile of the counter's share
/// (below). Each block of a launch that uses it claims tiles until one claim comes back past the
/// last tile, so a launch with D tiles in the counter's share makes D + grid claims; the block
/// whose claim returns D + grid − 1 (the last) puts the counter back to zero, so every launch
/// finds it at zero: its claims come after its PDL wait, when every earlier launch has completed
/// (launch.cuh, rule 2). Requires that no two launches that use it run at once on one device
/// (every GEMV of a backend runs on its one compute stream; the kernel tests launch one at a time).
__device__ unsigned int g_stream_tile_counter;
std::atomic<bool> g_stream_tile_counter_on{true};

/// Warp 0, every lane, with the tile counter: the global tile of this block's request `r` (its
/// tiles in order), or −1 when it has none more. The first `stages` requests take the fixed
/// stride (tiles r·grid + block: they are requested before the PDL wait); later ones the tiles
/// from stages·grid on, in the order the blocks ask for them (`claimed`: lane 0's counter value,
/// fetched one request ahead so that its round trip overlaps a tile). The block that gets the
/// launch's last claim puts the counter back to zero.
__device__ __forceinline__ int stream_tile_of_request(int64_t r, int stages, int tiles, unsigned int claimed) {
  int64_t tile = blockIdx.x + r * gridDim.x;
  if (r >= stages) {
    tile = int64_t{stages} * gridDim.x + __shfl_sync(0xffffffffu, claimed, 0);
    if (tile == tiles + gridDim.x - 1 && threadIdx.x == 0) g_stream_tile_counter = 0;
  }
  return tile < tiles ? static_cast<int>(tile) : -1;
}

/// Warp 0, lane 0 of the block stamps phase `point` in `trace` (null: nothing).
__device__ __forceinline__ void stream_trace_point(uint64_t* trace, int point) {
  if (trace && threadIdx.x == 0) {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    trace[int64_t{blockIdx.x} * kStreamTracePoints + point] = ns;
  }
}
constexpr int kRowsUnroll = 4;  // rows per lane-group per step when there are many rows

/// grid (blocks, m); x [m, cols]; y [m, rows]. With norm.gain non-null (m = 1), x goes through
/// the add + RMSNorm of `norm` first (stage_norm_row); with conv.channels > 0 (m = 1), rows below
/// it also run the GDN conv step (FusedConv), whose window and taps are loaded before the dot.
template <int BITS, int U, class OutT>
__global__ void __launch_bounds__(kGemvThreads, 3) quant_gemv_kernel(DeviceQuant w, const bf16* __restrict__ x,
                                                                  OutT* __restrict__ y, FusedNorm norm,
                                                                  FusedConv conv) {
  extern __shared__ float smem[];
  const int groups = w.cols / kGroup;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  const int lane = threadIdx.x % kWarp, lane_row = lane / L, lane_in = lane % L;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * (kGemvThreads / kWarp) + threadIdx.x / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * (kGemvThreads / kWarp);
  const int64_t step = n_warps * RW * U;
  const int64_t chunk = static_cast<int64_t>(RW) * U;
  pdl_prologue();
  float* xs = smem;
  float* xsum = smem + groups * kGroupStride;
  const int t = blockIdx.y;
  if (norm.gain) stage_norm_row(x, norm, w.cols, blockIdx.x == 0, xs, xsum);
  else stage_row(x + static_cast<int64_t>(t) * w.cols, w.cols, xs, xsum);
  for (int64_t base = warp_id * chunk; base < w.rows; base += step) {
    int64_t row[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t r = base + j * RW + lane_row;
      row[j] = r < w.rows ? r : -1;
    }
    bf16 win[U][3];
    float taps[U][kGdnConvK];
    if (conv.channels > 0 && lane_in == 0) {  // conv inputs do not depend on the dot: load them first
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (row[j] < 0 || row[j] >= conv.channels) continue;
#pragma unroll
        for (int i = 0; i < 3; ++i) win[j][i] = conv.window[row[j] * 3 + i];
#pragma unroll
        for (int i = 0; i < kGdnConvK; ++i) taps[j][i] = conv.taps[row[j] * kGdnConvK + i];
      }
    }
    float acc[U];
    rows_partial<BITS, U>(w, row, xs, xsum, lane_in, L, acc);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float v = group_sum(acc[j], L);
      if (row[j] >= 0 && lane_in == 0) {
        store_out(y, static_cast<int64_t>(t) * w.rows + row[j], v);
        if (row[j] < conv.channels) {  // x = the stored bf16 value, as gdn_conv_decode reads it
          const bf16 xb = to_bf16(v);
          bf16* wr = conv.window + row[j] * 3;
          conv.out[row[j]] = conv_decode_value(win[j][0], win[j][1], win[j][2], xb, taps[j]);
          wr[0] = win[j][1];
          wr[1] = win[j][2];
          wr[2] = xb;
        }
      }
    }
  }
}

/// Token rows per block of quant_gemv_tiled_kernel: each weight group loaded once serves them all.
constexpr int kTiledTokens = 8;
/// Dynamic shared memory of quant_gemv_tiled_kernel: kTiledTokens staged rows (70.6 KB at 2,048
/// columns); wider matrices than kMaxTiledSmem allows keep the per-row kernel.
/// Floats between two staged rows: staged_row_bytes rounded up to 16 bytes, so each row's
/// float4 loads stay aligned when the group count is odd (69 floats per group).
__host__ __device__ inline int tiled_row_floats(int groups) { return (groups * (kGroupStride + 1) + 3) & ~3; }
inline size_t tiled_gemv_smem(int cols) {
  return static_cast<size_t>(kTiledTokens) * tiled_row_floats(cols / kGroup) * sizeof(float);
}
constexpr size_t kMaxTiledSmem = 112 * 1024;  // two blocks per SM

/// grid (blocks, ceil(m / kTiledTokens)); x [m, cols]; y [m, rows]: the batched CUDA-core GEMV
/// (prefill router, batched projections) with the weights loaded once per tile of kTiledTokens
/// token rows instead of once per row. Each (token, row) output is quant_gemv_kernel<BITS, 1>'s
/// arithmetic exactly: the same lanes over the same groups in the same order
/// (acc += s·Σq·x + b·Σx, then group_sum), so the outputs are bit-identical to it for any m.
template <int BITS, class OutT>
__global__ void __launch_bounds__(kGemvThreads, 2) quant_gemv_tiled_kernel(DeviceQuant w, const bf16* __restrict__ x,
                                                                         int m, OutT* __restrict__ y) {
  extern __shared__ float smem[];
  const int groups = w.cols / kGroup;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  const int lane = threadIdx.x % kWarp, lane_row = lane / L, lane_in = lane % L;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * (kGemvThreads / kWarp) + threadIdx.x / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * (kGemvThreads / kWarp);
  const int t0 = blockIdx.y * kTiledTokens, tokens = min(kTiledTokens, m - t0);
  const int row_floats = tiled_row_floats(groups);  // one staged row, 16-byte aligned
  pdl_prologue();
  for (int i = 0; i < tokens; ++i)
    stage_row(x + static_cast<int64_t>(t0 + i) * w.cols, w.cols, smem + i * row_floats,
              smem + i * row_floats + groups * kGroupStride);
  for (int64_t r = warp_id * RW + lane_row; r - lane_row < w.rows; r += n_warps * RW) {
    const bool live = r < w.rows;
    float acc[kTiledTokens];
#pragma unroll
    for (int i = 0; i < kTiledTokens; ++i) acc[i] = 0.0f;
    for (int g = lane_in; g < groups && live; g += L) {
      uint4 q[kGroupVecs<BITS>];
      float s = 0.0f, b = 0.0f;
      load_group<BITS>(w, r, g, q, s, b);
#pragma unroll
      for (int i = 0; i < kTiledTokens; ++i) {
        if (i >= tokens) break;
        const float* xs = smem + i * row_floats;
        acc[i] += s * group_qdot_regs<BITS>(q, xs + g * kGroupStride) + b * xs[groups * kGroupStride + g];
      }
    }
#pragma unroll
    for (int i = 0; i < kTiledTokens; ++i) {
      if (i >= tokens) break;  // uniform over the block
      const float v = group_sum(acc[i], L);
      if (live && lane_in == 0) store_out(y, static_cast<int64_t>(t0 + i) * w.rows + r, v);
    }
  }
}

// ---- 4-bit GEMV on tensor cores (decode, m ≤ 8 tokens) -----------------------------------------
//
// The CUDA-core kernel above spends about four instructions per weight (unpack, convert, FMA),
// which at batch 1 costs as much time as streaming the weights. Here a warp computes a tile of
// 16 weight rows × 8 token columns with mma.sync m16n8k16 (bf16 × bf16 → fp32): the 4-bit codes
// become exact bf16 values with two instructions per pair (OR into the mantissa of 128, subtract
// 128), and the tensor core does the multiply-adds. Per 64-group the four MMAs of a group start
// from zero, so each group's Σ q·x is an fp32 sum of exact products, and the epilogue applies
// today's formula s·Σ(q·x) + b·Σx in fp32 (docs/model.md §4.2); only the summation order
// inside a group differs from the CUDA-core kernel. Each token column's result depends on that
// token's x alone, so a row's output is the same for any m (batch-invariant). The fragment
// layout, read straight from the checkpoint's code words, is quant_mma.cuh's.

constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = kMmaThreads / kWarp;
static_assert(kMaxStreamGemvRows == 4 * kMmaMaxTokens, "the streaming GEMV's direct and rows modes take up to four column blocks");
constexpr int kMmaBatch = 4;      // groups whose code words a warp has in flight

/// Warps splitting the 64-groups of one tile (k-split): the largest power of two ≤ 8 that
/// leaves each warp ≥ 8 groups (1 for rows of < 16 groups). A function of the shape only, so a
/// row's summation order never depends on the launch.
__host__ __device__ inline int mma_ksplit(int groups) {
  int ks = 1;
  while (ks < kMmaWarps && ks * 2 * 8 <= groups) ks *= 2;
  return ks;
}

/// Dynamic shared memory of the MMA GEMV: fp32 staging of one row (stage_row), Σx per token
/// and group, the permuted bf16 rows of m tokens, and the k-split partial sums.
__host__ __device__ inline int64_t mma_xperm_offset(int groups, int m) {  // floats; 16-byte aligned
  return (static_cast<int64_t>(groups) * (kGroupStride + 1 + m) + 3) & ~int64_t{3};
}
inline size_t mma_smem_bytes(int cols, int m) {
  return static_cast<size_t>(mma_xperm_offset(cols / kGroup, m)) * sizeof(float) +
         static_cast<size_t>(m) * cols * sizeof(bf16) + static_cast<size_t>(kMmaThreads) * 4 * sizeof(float);
}

/// Code words (rows g and g+8), scales and biases of kMmaBatch groups of one thread.
struct MmaBatch {
  uint2 lo[kMmaBatch], hi[kMmaBatch];
  bf16 s_lo[kMmaBatch], b_lo[kMmaBatch], s_hi[kMmaBatch], b_hi[kMmaBatch];
};

/// Loads the thread's share of groups G = first + ks·u (u < kMmaBatch; G ≥ groups or a row
/// past the matrix loads zeros) of rows row_lo and row_lo + 8.
__device__ __forceinline__ void mma_load(const DeviceQuant& w, int64_t row_lo, int first, int ks, int t, MmaBatch& b) {
  const int groups = w.cols / kGroup;
  const int64_t wpr = w.cols / 8;
  const bool ok_lo = row_lo < w.rows, ok_hi = row_lo + 8 < w.rows;
  const uint2* c_lo = reinterpret_cast<const uint2*>(w.codes + (ok_lo ? row_lo : 0) * wpr) + t;
  const uint2* c_hi = reinterpret_cast<const uint2*>(w.codes + (ok_hi ? row_lo + 8 : 0) * wpr) + t;
  const bf16 zero = __float2bfloat16_rn(0.0f);
#pragma unroll
  for (int u = 0; u < kMmaBatch; ++u) {
    const int G = first + ks * u;
    const bool in = G < groups;
    b.lo[u] = in && ok_lo ? __ldg(c_lo + G * 4) : make_uint2(0, 0);
    b.hi[u] = in && ok_hi ? __ldg(c_hi + G * 4) : make_uint2(0, 0);
    b.s_lo[u] = in && ok_lo ? w.scales[row_lo * groups + G] : zero;
    b.b_lo[u] = in && ok_lo ? w.biases[row_lo * groups + G] : zero;
    b.s_hi[u] = in && ok_hi ? w.scales[(row_lo + 8) * groups + G] : zero;
    b.b_hi[u] = in && ok_hi ? w.biases[(row_lo + 8) * groups + G] : zero;
  }
}

/// Stages the m activation rows (x [m, cols], or the add + RMSNorm of `norm` for m = 1) for the
/// MMA kernels: xsum [m][groups] the per-group sums and xperm [m][cols / 2] the bf16 pairs in
/// fragment order (file comment); xs / xsum_row are scratch (stage_row's layout). kFixedNorm:
/// the norm's row is kFixedNormCols on kFixedNormThreads threads (stage_norm_fragments_fixed,
/// the same bits). All threads of the block; ends with __syncthreads().
template <bool kFixedNorm = false>
__device__ __forceinline__ void stage_mma_rows(const bf16* __restrict__ x, int m, int cols, const FusedNorm& norm,
                                               float* xs, float* xsum_row, float* xsum, uint32_t* xperm,
                                               uint64_t* trace = nullptr) {
  const int groups = cols / kGroup;
  for (int n = 0; n < m; ++n) {
    if (norm.gain) {
      uint64_t* row = trace ? trace + int64_t{blockIdx.x} * kStreamTracePoints : nullptr;
      float* sums = xsum + n * groups;
      uint32_t* pairs = xperm + static_cast<int64_t>(n) * cols / 2;
      uint64_t* stamp = row ? row + 7 : nullptr;
      const bool store = blockIdx.x == 0;
      if constexpr (kFixedNorm)
        stage_norm_fragments_fixed<kFixedNormThreads, false, false>(x, norm, store, xs, sums, pairs, stamp);
      else
        stage_norm_fragments_generic(x, norm, cols, store, xs, sums, pairs, 0, stamp);
      stream_trace_point(trace, 8);
      continue;
    }
    stage_row(x + static_cast<int64_t>(n) * cols, cols, xs, xsum_row);
    pack_fragment_pairs(xs, cols, xperm + static_cast<int64_t>(n) * cols / 2);
    for (int G = threadIdx.x; G < groups; G += blockDim.x) xsum[n * groups + G] = xsum_row[G];
    __syncthreads();
  }
}

/// grid (blocks); block = kMmaWarps warps = (8 / ks) tiles × ks k-slices; tiles of 16 rows
/// strided over the grid. x [m, cols] (m ≤ 8); y [m, rows]. norm / conv as quant_gemv_kernel
/// (m = 1).
template <class OutT>
__global__ void __launch_bounds__(kMmaThreads) quant_mma_gemv_kernel(DeviceQuant w, const bf16* __restrict__ x, int m,
                                                                     OutT* __restrict__ y, FusedNorm norm,
                                                                     FusedConv conv) {
  extern __shared__ float smem[];
  const int cols = w.cols, groups = cols / kGroup;
  const int ks = mma_ksplit(groups), tiles_per_block = kMmaWarps / ks;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int kslice = warp % ks, tile_in_block = warp / ks;
  const int64_t tiles = ceil_div(w.rows, static_cast<int64_t>(kMmaTileRows));
  const int64_t tile_step = static_cast<int64_t>(gridDim.x) * tiles_per_block;
  const int batches = static_cast<int>(ceil_div(ceil_div(groups, ks), kMmaBatch));  // per tile, same for all warps

  // The first batch of weights is read before waiting for the predecessor (no kernel writes them).
  // (Blocks limited to one per SM, so that the next kernel's blocks could be resident and load
  // early, and an L2 prefetch of each warp's next 8 tiles both measured slower: 268 and 286 vs
  // 293 tok/s, docs/performance/2026-12-01-decode-kernels.md.)
  int64_t tile0 = static_cast<int64_t>(blockIdx.x) * tiles_per_block;
  MmaBatch cur;
  mma_load(w, (tile0 + tile_in_block) * kMmaTileRows + g, kslice, ks, t, cur);
  pdl_prologue();

  float* xs = smem;
  float* xsum_row = smem + groups * kGroupStride;
  float* xsum = smem + groups * (kGroupStride + 1);      // [m][groups]
  uint32_t* xperm = reinterpret_cast<uint32_t*>(smem + mma_xperm_offset(groups, m));  // [m][cols / 2] bf16 pairs
  float* partial = reinterpret_cast<float*>(xperm + static_cast<int64_t>(m) * cols / 2);  // [warp][lane][4]
  stage_mma_rows(x, m, cols, norm, xs, xsum_row, xsum, xperm);

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (row g, token 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  for (int64_t tb = tile0; tb < tiles; tb += tile_step) {  // uniform over the block
    const int64_t row_lo = (tb + tile_in_block) * kMmaTileRows + g;
    for (int bi = 0; bi < batches; ++bi) {
      // Issue the next batch (this tile's or the next tile's first) before using this one.
      MmaBatch nxt;
      const bool last_batch = bi + 1 == batches;
      const int64_t next_row = last_batch ? row_lo + tile_step * kMmaTileRows : row_lo;
      const int next_first = last_batch ? kslice : kslice + ks * kMmaBatch * (bi + 1);
      if (!last_batch || tb + tile_step < tiles) mma_load(w, next_row, next_first, ks, t, nxt);
#pragma unroll
      for (int u = 0; u < kMmaBatch; ++u) {
        const int G = kslice + ks * (kMmaBatch * bi + u);
        if (G >= groups) break;  // uniform over the warp
        uint4 bw0 = make_uint4(0, 0, 0, 0), bw1 = make_uint4(0, 0, 0, 0);
        if (g < m) {
          const uint4* bp = reinterpret_cast<const uint4*>(xperm + static_cast<int64_t>(g) * cols / 2 + G * 32 + t * 8);
          bw0 = bp[0];
          bw1 = bp[1];
        }
        float d[4];
        group_mma(cur.lo[u], cur.hi[u], bw0, bw1, d);
        const float x0 = 2 * t < m ? xsum[(2 * t) * groups + G] : 0.0f;
        const float x1 = 2 * t + 1 < m ? xsum[(2 * t + 1) * groups + G] : 0.0f;
        const float sl = to_f32(cur.s_lo[u]), bl = to_f32(cur.b_lo[u]);
        const float sh = to_f32(cur.s_hi[u]), bh = to_f32(cur.b_hi[u]);
        acc[0] += sl * d[0] + bl * x0;
        acc[1] += sl * d[1] + bl * x1;
        acc[2] += sh * d[2] + bh * x0;
        acc[3] += sh * d[3] + bh * x1;
      }
      cur = nxt;
    }
    // k-split: the slices of a tile add up in slice order (fixed by the shape).
    if (ks > 1) {
      float* mine = partial + (static_cast<int>(threadIdx.x)) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) mine[i] = acc[i];
      __syncthreads();
      if (kslice == 0) {
        for (int sl = 1; sl < ks; ++sl) {
          const float* other = partial + (threadIdx.x + sl * kWarp) * 4;
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i] += other[i];
        }
      }
      __syncthreads();
    }
    if (kslice == 0) store_mma_tile(acc, row_lo, row_lo + 8, t, m, w.rows, y, conv);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
  }
}

// ---- 4-bit GEMV on tensor cores, weights streamed by bulk copies (decode, m ≤ 8 tokens) --------
// The tile machinery and its arithmetic are stream_gemv.cuh's.

static_assert(kMaxGemvCols / kGroup / kStreamWarps <= kStreamMaxGroupsPerWarp, "every row width the GEMVs take");
/// Blocks per SM of the streaming kernel for kBlocks column blocks: more accumulators per thread
/// from two blocks on (16 floats at four), so fewer, larger-register blocks.
__host__ __device__ constexpr int stream_blocks_per_sm(int column_blocks) {
  return column_blocks <= 1 ? kStreamBlocksPerSm : 2;
}

/// Blocks per SM of the streaming kernel in `mode` with kBlocks column blocks: the rows mode
/// keeps one block per SM (its staged rows take most of the shared memory).
__host__ __device__ constexpr int stream_mode_blocks_per_sm(StreamMode mode, int column_blocks) {
  return mode == StreamMode::rows ? 1 : stream_blocks_per_sm(column_blocks);
}

/// grid (about stream_mode_blocks_per_sm blocks per SM), block kStreamThreads; x [m, cols], y [m,
/// rows]; tiles of 16 rows strided over the grid, `stages` in flight per block, the first
/// min(stages, early_stages) of them requested before the PDL wait and the others once the
/// activations are staged (stream_gemv_late_requests); `pad` the chunk padding (kStreamChunkPad,
/// or 0 for one unpadded copy). norm / conv as quant_gemv_kernel (m = 1). Requires cols % 512 ==
/// 0 and 16-byte aligned codes / scales / biases (stream_gemv_plan).
/// kMode (StreamMode): staged: m ≤ 8, the rows staged in shared memory (with the fused norm).
/// direct (no norm, no conv): m ≤ 8·kBlocks, each warp reads its groups' fragments from x
/// (stream_direct_fragments) and sums their Σx itself, so the first tile's MMAs wait for no
/// block-wide pass over the rows. rows (no norm, no conv; the batched decode's rows): m ≤
/// 8·kBlocks, the rows staged once per block in fragment order with their Σx
/// (stage_rows_fragments: the rows by bulk copies, then put in order in place). direct and
/// rows: the rows are kBlocks column blocks of eight that share each weight fragment. kCounter:
/// the tiles past each block's first stages come from the tile counter (g_stream_tile_counter),
/// each stage's tile index in shared memory; else block b runs tiles b, b + grid, … (the same
/// bits either way). kFixedNorm: in the staged mode the fused norm over kFixedNormCols columns
/// (stage_norm_fragments_fixed), hence m = 1 (stream_tile_slice's kOneToken); in the rows mode
/// the add + RMSNorm of the m rows fused into their staging (stage_rows_norm_fragments,
/// launch_add_rmsnorm_gemv_rows), its own instances so that the others keep their registers. row: with
/// row.pairs (staged mode, m = 1, no norm) the staged row comes by bulk copy from global memory
/// (launch_staged_row_gemv) instead of from stage_mma_rows.
/// kGroups = 2 (rows mode): two warp groups of kStreamWarps per block (block 2·kStreamThreads),
/// each warp on the k-slice its index within the group gives, each group's warp 0 adding its
/// group's slices in slice order, so a row gets the same bits as from one group; twice the
/// warps to hide the tile loop's latency. With an even kBlocks (kSplitColumns) group h computes
/// column blocks h·kBlocks/2 … of every tile from the same stage (half the accumulators a
/// thread: the 32-row launch fits 128 registers), and group 0's warp 0 refills a stage once
/// group 1's warp 0 has seen all of its group's partials (every warp is done with the stage).
/// With one column block (kSplitTiles) the groups take turns on the tiles (group h: the block's
/// tiles h, h + 2, …, in the stages of that parity; `stages` even), each group refilling its own
/// stages and reducing into its own partial buffers.
template <class OutT, StreamMode kMode, int kBlocks, bool kCounter, bool kFixedNorm = false, int kGroups = 1>
__global__ void __launch_bounds__(kStreamThreads * kGroups, stream_mode_blocks_per_sm(kMode, kBlocks))
    quant_stream_gemv_kernel(DeviceQuant w, const bf16* __restrict__ x, int m, OutT* __restrict__ y, FusedNorm norm,
                             FusedConv conv, int stages, int early_stages, int pad, StagedRow row,
                             uint64_t* trace) {
  constexpr bool kDirect = kMode == StreamMode::direct;
  static_assert(kMode != StreamMode::staged || kBlocks == 1, "the staged mode takes one column block");
  static_assert(kGroups == 1 || (kGroups == 2 && kMode == StreamMode::rows && !kCounter && (kBlocks % 2 == 0 || kBlocks == 1)),
                "two warp groups only in the rows mode, with whole column blocks each or one block");
  constexpr bool kSplitColumns = kGroups == 2 && kBlocks % 2 == 0, kSplitTiles = kGroups == 2 && kBlocks == 1;
  constexpr int kGroupBlocks = kSplitColumns ? kBlocks / 2 : kBlocks;  // column blocks of one warp group
  extern __shared__ __align__(16) unsigned char sm[];
  const int cols = w.cols, groups = cols / kGroup, per_warp = groups / kStreamWarps;
  const StreamLayout l = stream_layout(cols, m, stages, pad, kMode, kCounter, kSplitTiles ? 2 : 1);
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* ready = full + kStreamMaxStages;
  uint64_t* freed = ready + 2;
  uint64_t* row_full = freed + 2;  // the staged row's copy (row.pairs non-null), or the rows mode's rows
  int* stage_tile = reinterpret_cast<int*>(sm + l.tile_ids);  // kCounter only
  // warp: the k-slice (the warp within its group); wg: the warp group.
  // With one group wg is a compile-time 0, so the one-group instances keep their registers.
  const int wg = kGroups == 1 ? 0 : static_cast<int>(threadIdx.x / kStreamThreads);
  const int warp = static_cast<int>((kGroups == 1 ? threadIdx.x : threadIdx.x % kStreamThreads) / kWarp);
  const int lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const bool requester = wg == 0 && warp == 0;  // the warp that requests the tiles
  // This group's partial handover (group 1: the two pairs after row_full).
  uint64_t* ready_g = wg == 0 ? ready : row_full + 1;
  uint64_t* freed_g = wg == 0 ? freed : row_full + 3;
  const int64_t tiles = ceil_div(w.rows, static_cast<int64_t>(kMmaTileRows));
  // The fixed stride's tile count of this block (with the counter: an unbounded loop, ended by a
  // stage marked −1).
  const int64_t my_tiles =
      kCounter ? INT64_MAX : blockIdx.x < tiles ? ceil_div(tiles - blockIdx.x, gridDim.x) : 0;
  stream_trace_point(trace, 0);

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(full + s, 1);
    for (int p = 0; p < 2; ++p) {
      // With the columns split, group 0's reducer hears from its other warps and from group 1's.
      mbarrier_init(ready + p, kStreamWarps - 1 + (kSplitColumns ? 1 : 0));
      mbarrier_init(freed + p, 1);
      if (kGroups > 1) {
        mbarrier_init(row_full + 1 + p, kStreamWarps - 1);
        mbarrier_init(row_full + 3 + p, 1);
      }
    }
    if (row.pairs || kMode == StreamMode::rows) mbarrier_init(row_full, 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  // With the counter, warp 0 fills stage s with the tile of request r (stage_tile[s] = its index,
  // read by every warp once the stage is full), or marks it −1 and completes its phase empty.
  auto request = [&](int64_t r, int s, unsigned int claimed) {
    const int tile = stream_tile_of_request(r, stages, static_cast<int>(tiles), claimed);
    if (lane == 0) stage_tile[s] = tile;
    if (tile >= 0) stream_request_tile_at(w, tile, sm + l.ring + s * l.stage_bytes, l, full + s);
    else if (lane == 0) mbarrier_arrive(full + s);
    return tile;
  };
  // The first stages' requests: [0, early_stages) before the PDL wait, the rest once the
  // activations are staged (stream_gemv_late_requests).
  auto request_first = [&](int j0, int j1) {
    if (!requester) return;
    if constexpr (kCounter)
      for (int j = j0; j < j1; ++j) request(j, j, 0);
    else
      for (int64_t j = j0; j < j1 && j < my_tiles; ++j) stream_request_tile(w, j, sm + l.ring + j * l.stage_bytes, l, full + j);
  };
  const int early = min(stages, early_stages);
  request_first(0, early);
  pdl_prologue();
  stream_trace_point(trace, 1);
  // Lane 0 of warp 0: the counter's next tile for request `stages`, fetched now (the counter may
  // only be touched after the PDL wait) and one request ahead from then on.
  unsigned int claimed = 0;
  if (kCounter && threadIdx.x == 0 && int64_t{stages} * gridDim.x < tiles)
    claimed = atomicAdd(&g_stream_tile_counter, 1u);

  uint32_t* xperm = reinterpret_cast<uint32_t*>(sm + l.xperm);
  float* xsum = reinterpret_cast<float*>(sm + l.xsum);
  float* scratch = reinterpret_cast<float*>(sm + l.scratch);
  const int g_begin = warp * per_warp, g_end = g_begin + per_warp;
  if constexpr (kDirect) {
    // Σx of this warp's groups for every token (group_sum_x, as the staged kernel forms them),
    // so that a row here gets the same bits as the staged kernel gives it alone (the batched
    // decode is bit-identical to the one-sequence step). Only this warp reads them.
    stream_direct_group_sums(x, cols, m, g_begin, g_end, xsum);
  } else if constexpr (kMode == StreamMode::rows) {
    if constexpr (kFixedNorm) stage_rows_norm_fragments(x, norm, m, cols, xperm, xsum);  // launch_add_rmsnorm_gemv_rows
    else stage_rows_fragments(x, m, cols, xperm, xsum, row_full);
  } else if (row.pairs) {
    // The row staged once by the kernel before (launch_staged_row_gemv): two bulk copies, the
    // bytes stage_mma_rows would have left here.
    if (threadIdx.x == 0) {
      const uint32_t pair_bytes = static_cast<uint32_t>(cols) * 2, sum_bytes = static_cast<uint32_t>(groups) * 4;
      mbarrier_arrive_expect_tx(row_full, pair_bytes + sum_bytes);
      bulk_copy_to_shared(xperm, row.pairs, pair_bytes, row_full);
      bulk_copy_to_shared(xsum, row.sums, sum_bytes, row_full);
    }
    mbarrier_wait(row_full, 0);
  } else {
    stage_mma_rows<kFixedNorm>(x, m, cols, norm, scratch, scratch + groups * kGroupStride, xsum, xperm, trace);
  }
  const float* xs0 = xsum + (2 * t) * groups;      // Σx of token 2t (read only when 2t < m)
  const float* xs1 = xsum + (2 * t + 1) * groups;  // token 2t + 1
  const bool has0 = 2 * t < m, has1 = 2 * t + 1 < m;
  request_first(early, stages);
  stream_trace_point(trace, 2);

  for (int64_t i = kSplitTiles ? wg : 0; i < my_tiles; i += kSplitTiles ? 2 : 1) {
    const int s = static_cast<int>(i % stages);
    const unsigned char* stage = sm + l.ring + s * l.stage_bytes;
    mbarrier_wait(full + s, static_cast<uint32_t>(i / stages) & 1u);
    if (kCounter && stage_tile[s] < 0) break;  // the same i in every warp
    if (i == 0) stream_trace_point(trace, 3);
    if (kCounter || i + 1 == my_tiles) stream_trace_point(trace, 5);  // (the counter: the last tile's stamp stays)
    const StreamTileView v = stream_tile_view(stage, l, groups, g, t);
    const int c0 = kSplitColumns ? wg * kGroupBlocks : 0;  // this group's first column block
    float acc[kGroupBlocks][4] = {};
    if constexpr (kDirect) stream_tile_slice_direct<kBlocks>(v, x, cols, m, g, t, g_begin, g_end, xsum, acc);
    else if constexpr (kMode == StreamMode::rows)
      stream_tile_slice_rows<kGroupBlocks>(v, xperm, xsum, cols, m, g, t, g_begin, g_end, c0, acc);
    else stream_tile_slice<kFixedNorm>(v, xperm, cols, m, g, t, g_begin, g_end, xs0, xs1, has0, has1, acc[0]);

    // The k-slices add up in slice order: warps 1–7 of a group leave their partials (one float4
    // per lane and column block) in one of two buffers, its warp 0 adds them to its own.
    const int64_t n = kSplitTiles ? i / 2 : i;  // this group's tiles so far
    const int p = static_cast<int>(n & 1);
    const uint32_t round = static_cast<uint32_t>(n >> 1);
    // [group (kSplitTiles)][buffer][block][warp][lane], from this group's first block
    float4* partial = reinterpret_cast<float4*>(scratch) + ((kSplitTiles ? wg * 2 : 0) + p) * kBlocks * kStreamWarps * kWarp +
                      c0 * kStreamWarps * kWarp;
    if (warp != 0) {
      if (n >= 2) mbarrier_wait(freed_g + p, (round - 1) & 1u);
#pragma unroll
      for (int c = 0; c < kGroupBlocks; ++c)
        partial[(c * kStreamWarps + warp) * kWarp + lane] = make_float4(acc[c][0], acc[c][1], acc[c][2], acc[c][3]);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(ready_g + p);
      continue;
    }
    mbarrier_wait(ready_g + p, round & 1u);  // every warp of the group is done with this stage and its slice
    if (kSplitColumns && wg != 0) {
      // Group 1's warps are done with the stage: tell group 0's reducer, which refills it. Not
      // before that reducer has taken the previous round of this buffer (a phase at a time).
      if (n >= 2) mbarrier_wait(freed + p, (round - 1) & 1u);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(ready + p);
    }
    int64_t tile = blockIdx.x + i * gridDim.x;
    if constexpr (kCounter) {
      tile = stage_tile[s];  // read here, not kept through the slice: one register fewer there
      // Request i + stages took the counter's tile (or none was left): fetch the next one.
      if (request(i + stages, s, claimed) >= 0 && lane == 0) claimed = atomicAdd(&g_stream_tile_counter, 1u);
    } else if ((kSplitTiles || wg == 0) && i + stages < my_tiles) {  // kSplitTiles: stages of this group's parity
      stream_request_tile(w, i + stages, sm + l.ring + s * l.stage_bytes, l, full + s);
    }
    stream_add_slices<kGroupBlocks>(partial, lane, acc);
    __syncwarp();
    if (lane == 0) mbarrier_arrive(freed_g + p);
    const int64_t row_a = tile * kMmaTileRows + 4 * (g % 4) + g / 4;
#pragma unroll
    for (int c = 0; c < kGroupBlocks; ++c)
      store_mma_tile(acc[c], row_a, row_a + 2, t, m - (c0 + c) * kMmaMaxTokens, w.rows,
                     y + int64_t{c0 + c} * kMmaMaxTokens * w.rows, conv);
    if (i == 0) stream_trace_point(trace, 4);
  }
  stream_trace_point(trace, 6);
}

struct StreamPlan {
  int stages = 0;  ///< 0: the streaming kernel does not apply
  StreamMode mode = StreamMode::staged;
  int column_blocks = 1;  ///< column blocks of eight tokens (direct and rows: 1 … 4)
  int pad = 0;
  int blocks = 0;
  size_t smem = 0;
  /// Staged mode: the tiles past the first stages from the tile counter (the instance with
  /// kCounter; stream_gemv_tile_counter_enabled).
  bool counter = false;
  /// Rows mode: warp groups per block (quant_stream_gemv_kernel's kGroups): 2 with one column
  /// block and an even number of stages (rows_gemv_split() tiles or all), or an even column-block
  /// count (all); else 1.
  int warp_groups = 1;
};

/// Tiles per block from which a staged launch takes its later tiles from the counter (in the
/// decode step: the LM head, 29 or 30 a block). Below it the blocks have few tiles to even out,
/// and the counter's claims cost more than they save: with the counter on every launch, decode
/// at 4K on an H100 went from 400 to 388 tok/s. The batched decode's GEMVs (rows and direct
/// modes) showed no gain from it (8 to 64 rows, within 0.4 %), so they keep the fixed stride.
constexpr int64_t kCounterMinTilesPerBlock = 4;

/// The streaming kernel's launch for a GEMV in `mode`: 4-bit, m ≤ 8 (direct and rows: m ≤
/// kMaxStreamGemvRows), cols % 512 == 0 (scale rows of whole 16-byte runs, an even split of the
/// groups over 8 warps), 16-byte aligned arrays, and at least one stage within the shared memory
/// the mode's blocks may take (the rows mode: a whole SM's); otherwise stages = 0.
StreamPlan stream_gemv_plan(const DeviceQuant& w, int m, StreamMode mode = StreamMode::staged) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  StreamPlan plan;
  plan.mode = mode;
  const bool blocks_of_eight = mode != StreamMode::staged;
  if (w.bits != 4 || m > (blocks_of_eight ? kMaxStreamGemvRows : kMmaMaxTokens) || w.cols % 512 != 0 || !aligned(w.codes) ||
      !aligned(w.scales) || !aligned(w.biases))
    return plan;
  plan.pad = kStreamChunkPad;
  plan.column_blocks = blocks_of_eight ? stream_column_blocks(m) : 1;
  const int64_t tiles = ceil_div(w.rows, static_cast<int64_t>(kMmaTileRows));
  // The kernel's register budget allows stream_mode_blocks_per_sm blocks; the staged and direct
  // modes with one column block may be sized for fewer (stream_gemv_blocks_per_sm), and share
  // stream_gemv_smem_per_sm() of each SM for their stages (speed settings: a result's bits never
  // depend on them).
  const int most = stream_mode_blocks_per_sm(mode, plan.column_blocks);
  const int per_sm = mode != StreamMode::rows && plan.column_blocks <= 1 ? std::min(most, stream_gemv_blocks_per_sm()) : most;
  plan.blocks = static_cast<int>(std::min<int64_t>(tiles, int64_t{sm_count()} * per_sm));
  const int64_t per_block = ceil_div(tiles, plan.blocks);
  const StreamLayout none = stream_layout(w.cols, m, 0, plan.pad, mode);
  const int64_t budget = mode == StreamMode::rows ? kStreamSmemMax : stream_gemv_smem_per_sm() / per_sm;
  int64_t fit = (budget - none.total) / none.stage_bytes;
  if (mode == StreamMode::rows && fit < 1) return plan;  // the rows take the SM: the caller runs fewer per launch
  fit = std::max<int64_t>(1, std::min<int64_t>({fit, kStreamMaxStages, per_block}));
  plan.counter = mode == StreamMode::staged && stream_gemv_tile_counter_enabled() &&
                 tiles >= kCounterMinTilesPerBlock * plan.blocks;
  // Two warp groups: over the column blocks where they are even; over the tiles with one block,
  // where an even number of stages fits beside the second group's partials.
  const RowsGemvSplit split = mode == StreamMode::rows ? rows_gemv_split() : RowsGemvSplit::none;
  if (split != RowsGemvSplit::none) {
    if (plan.column_blocks % 2 == 0 && split == RowsGemvSplit::all) {
      plan.warp_groups = 2;
    } else if (plan.column_blocks == 1 && fit >= 2) {
      const int64_t even = fit / 2 * 2;
      if (stream_layout(w.cols, m, static_cast<int>(even), plan.pad, mode, false, 2).total <= kStreamSmemMax) {
        plan.warp_groups = 2;
        fit = even;
      }
    }
  }
  const int tile_groups = plan.warp_groups == 2 && plan.column_blocks == 1 ? 2 : 1;
  const StreamLayout l = stream_layout(w.cols, m, static_cast<int>(fit), plan.pad, mode, plan.counter, tile_groups);
  if (l.total > kStreamSmemMax) return plan;
  plan.stages = static_cast<int>(fit);
  plan.smem = static_cast<size_t>(l.total);
  return plan;
}

template <class OutT>
void stream_gemv_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, const StreamPlan& plan,
                          cudaStream_t stream, const FusedNorm& norm, const FusedConv& conv,
                          const StagedRow& row = StagedRow{}) {
  auto launch = [&](auto kernel, int warp_groups = 1) {
    raise_smem_limit(kernel, plan.smem);
    uint64_t* trace = g_stream_trace;
    if (trace && g_stream_trace_advance) {
      const int64_t offset = g_stream_trace_launches.empty()
                                 ? 0
                                 : g_stream_trace_launches.back().offset +
                                       int64_t{g_stream_trace_launches.back().blocks} * kStreamTracePoints;
      g_stream_trace_launches.push_back({w.rows, w.cols, m, plan.blocks, offset});
      trace += offset;
    }
    const StreamLateRequests late = stream_gemv_late_requests();
    const bool request_late =
        late == StreamLateRequests::all || (late == StreamLateRequests::staged && plan.mode == StreamMode::staged);
    launch_pdl(kernel, dim3(plan.blocks), dim3(kStreamThreads * warp_groups), plan.smem, stream, w, x, m, y, norm, conv,
               plan.stages, request_late ? 0 : plan.stages, plan.pad, row, trace);
  };
  // The direct and rows modes' instances, one per column-block count.
  auto launch_blocks = [&](auto mode) {
    constexpr StreamMode kMode = decltype(mode)::value;
    switch (plan.column_blocks) {
      case 1: return launch(quant_stream_gemv_kernel<OutT, kMode, 1, false>);
      case 2: return launch(quant_stream_gemv_kernel<OutT, kMode, 2, false>);
      case 3: return launch(quant_stream_gemv_kernel<OutT, kMode, 3, false>);
      default: return launch(quant_stream_gemv_kernel<OutT, kMode, 4, false>);
    }
  };
  switch (plan.mode) {
    case StreamMode::staged:
      if (norm.gain && m == 1 && w.cols == kFixedNormCols && kStreamThreads == kFixedNormThreads)
        return plan.counter ? launch(quant_stream_gemv_kernel<OutT, StreamMode::staged, 1, true, true>)
                            : launch(quant_stream_gemv_kernel<OutT, StreamMode::staged, 1, false, true>);
      return plan.counter ? launch(quant_stream_gemv_kernel<OutT, StreamMode::staged, 1, true>)
                          : launch(quant_stream_gemv_kernel<OutT, StreamMode::staged, 1, false>);
    case StreamMode::direct: return launch_blocks(std::integral_constant<StreamMode, StreamMode::direct>{});
    case StreamMode::rows:
      if (norm.gain) {  // launch_add_rmsnorm_gemv_rows: one column block (rows_norm_gemv_problem)
        if (plan.warp_groups == 2) return launch(quant_stream_gemv_kernel<OutT, StreamMode::rows, 1, false, true, 2>, 2);
        return launch(quant_stream_gemv_kernel<OutT, StreamMode::rows, 1, false, true>);
      }
      if (plan.warp_groups == 2) {  // one or an even number of column blocks (stream_gemv_plan)
        if (plan.column_blocks == 1) return launch(quant_stream_gemv_kernel<OutT, StreamMode::rows, 1, false, false, 2>, 2);
        if (plan.column_blocks == 2) return launch(quant_stream_gemv_kernel<OutT, StreamMode::rows, 2, false, false, 2>, 2);
        return launch(quant_stream_gemv_kernel<OutT, StreamMode::rows, 4, false, false, 2>, 2);
      }
      return launch_blocks(std::integral_constant<StreamMode, StreamMode::rows>{});
  }
}

/// Rows per launch of the rows mode for m rows of `w`: all of them where they fit beside one
/// stage, else the most in whole column blocks of eight (the 4,096-column out-projections take
/// 16 of 32); 0 where not even eight (or m) fit.
int rows_mode_rows_per_launch(const DeviceQuant& w, int m) {
  for (int r = m; r > 0; r = r > kMmaMaxTokens ? (r - 1) / kMmaMaxTokens * kMmaMaxTokens : 0)
    if (stream_gemv_plan(w, r, StreamMode::rows).stages > 0) return r;
  return 0;
}

/// Whether launch_quant_gemv takes the tensor-core kernel: 4-bit and m ≤ 8 (its staging then
/// needs ≤ 171 KB of shared memory at cols ≤ 8192, opted in above 48 KB).
bool use_mma_gemv(const DeviceQuant& w, int m) { return w.bits == 4 && m <= kMmaMaxTokens; }

template <class OutT>
void mma_gemv_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, cudaStream_t stream, const FusedNorm& norm,
                       const FusedConv& conv) {
  const int groups = w.cols / kGroup;
  const int tiles_per_block = kMmaWarps / mma_ksplit(groups);
  const int64_t blocks_needed = ceil_div(ceil_div(w.rows, static_cast<int64_t>(kMmaTileRows)), tiles_per_block);
  const size_t smem = mma_smem_bytes(w.cols, m);
  if (smem > kDefaultSmemBytes) raise_smem_limit(quant_mma_gemv_kernel<OutT>, smem);
  const int per_sm = blocks_per_sm(quant_mma_gemv_kernel<OutT>, kMmaThreads, smem);
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  const int blocks = static_cast<int>(std::min(blocks_needed, resident));
  launch_pdl(quant_mma_gemv_kernel<OutT>, dim3(blocks), dim3(kMmaThreads), smem, stream, w, x, m, y, norm, conv);
}

template <int BITS, class OutT>
void tiled_gemv_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, cudaStream_t stream) {
  const size_t smem = tiled_gemv_smem(w.cols);
  if (smem > kDefaultSmemBytes) raise_smem_limit(quant_gemv_tiled_kernel<BITS, OutT>, smem);
  const int L = lanes_per_row(w.cols / kGroup), RW = kWarp / L;
  const int64_t blocks_needed = ceil_div(ceil_div(w.rows, static_cast<int64_t>(RW)), kGemvThreads / kWarp);
  const int token_tiles = static_cast<int>(ceil_div(static_cast<int64_t>(m), static_cast<int64_t>(kTiledTokens)));
  launch_pdl(quant_gemv_tiled_kernel<BITS, OutT>, dim3(static_cast<unsigned>(blocks_needed), token_tiles),
             dim3(kGemvThreads), smem, stream, w, x, m, y);
}

template <int BITS, class OutT>
void gemv_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, cudaStream_t stream,
                   const FusedNorm& norm = FusedNorm{}, const FusedConv& conv = FusedConv{}) {
  if constexpr (BITS == 4) {
    // Without a fused norm or conv the activations need no staging: the direct mode reads them
    // where they are (for every m, so a token's result still does not depend on m).
    const bool direct = !norm.gain && conv.channels == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    if (stream_gemv_enabled() && m <= kMmaMaxTokens)  // more rows: launch_quant_gemv_rows's column blocks
      if (const StreamPlan plan = stream_gemv_plan(w, m, direct ? StreamMode::direct : StreamMode::staged);
          plan.stages > 0)
        return stream_gemv_dispatch(w, x, m, y, plan, stream, norm, conv);
    if (use_mma_gemv(w, m)) return mma_gemv_dispatch(w, x, m, y, stream, norm, conv);
  }
  if (m > 1 && !norm.gain && conv.channels == 0 && tiled_gemv_smem(w.cols) <= kMaxTiledSmem &&
      gemv_row_tiles_enabled())
    return tiled_gemv_dispatch<BITS>(w, x, m, y, stream);
  const int groups = w.cols / kGroup;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  // Few rows (router, small projections): one row per lane-group, for more warps in flight.
  // Many rows: 4 rows per lane-group step, for more loads in flight per warp. Same arithmetic.
  const int64_t warps_u4 = ceil_div(w.rows, static_cast<int64_t>(RW) * kRowsUnroll);
  const bool few_rows = ceil_div(warps_u4, kGemvThreads / kWarp) < 2 * sm_count();
  const int U = few_rows ? 1 : kRowsUnroll;
  const int64_t warps_needed = ceil_div(w.rows, static_cast<int64_t>(RW) * U);
  const int64_t blocks_needed = ceil_div(warps_needed, kGemvThreads / kWarp);
  const size_t smem = staged_row_bytes(w.cols);
  // One wave: as many blocks as can be resident at once (each warp then loops over row chunks),
  // so no block waits for a second wave to start its weight stream.
  auto kernel = few_rows ? quant_gemv_kernel<BITS, 1, OutT> : quant_gemv_kernel<BITS, kRowsUnroll, OutT>;
  const int per_sm = blocks_per_sm(kernel, kGemvThreads, smem);
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  const int blocks = static_cast<int>(std::min(blocks_needed, resident));
  launch_pdl(kernel, dim3(blocks, m), dim3(kGemvThreads), smem, stream, w, x, y, norm, conv);
}

/// The batched decode's GEMV (launch_quant_gemv_rows): a kernel chosen by the matrix alone, so
/// that a token row's result never depends on m. 4-bit with bf16 out, from rows_gemv_ksplit_from()
/// rows on: the k-split GEMV over all m rows where it takes the matrix. Else 4-bit: the streaming kernel when it applies at
/// kMaxStreamGemvRows rows, its rows mode (the rows staged once per block) from
/// rows_gemv_staging_min_rows() rows on for matrices of at most rows_mode_max_weight_rows() rows, as
/// many launches as its shared memory needs, else its
/// direct mode (activation fragments read from global memory by the warps that use them); the
/// rows as column blocks of eight sharing each weight fragment; every mode gives a row the same
/// bits. Else the register-load MMA kernel, eight rows a launch; each computes a token column
/// from that token's x alone, in an order fixed by the shape. 8-bit: the tiled CUDA-core kernel,
/// also at m = 1 (its per-token arithmetic ignores the other tokens of the tile), or where its
/// staging does not fit, the per-row CUDA-core kernel (grid.y = token) for every m.
template <class OutT>
void gemv_rows_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, cudaStream_t stream) {
  if constexpr (std::is_same_v<OutT, bf16>) {  // all m rows in one k-split launch
    if (w.bits == 4 && stream_gemv_enabled() && m >= rows_gemv_ksplit_from() && w.rows <= rows_mode_max_weight_rows() &&
        reinterpret_cast<uintptr_t>(x) % 16 == 0 && ksplit_gemv_problem(w, m).empty())
      return launch_quant_gemv_ksplit(w, x, m, y, stream);
  }
  if (m > kMaxStreamGemvRows) {  // launches of kMaxStreamGemvRows rows (a row's bits are its own)
    for (int r0 = 0; r0 < m; r0 += kMaxStreamGemvRows)
      gemv_rows_dispatch(w, x + int64_t{r0} * w.cols, std::min(kMaxStreamGemvRows, m - r0), y + int64_t{r0} * w.rows,
                         stream);
    return;
  }
  if (w.bits == 4) {
    if (stream_gemv_enabled() && stream_gemv_plan(w, kMaxStreamGemvRows, StreamMode::direct).stages > 0 &&
        reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      const bool rows_mode = m >= rows_gemv_staging_min_rows() && w.rows <= rows_mode_max_weight_rows();
      if (const int per = rows_mode ? rows_mode_rows_per_launch(w, m) : 0; per > 0) {
        for (int r0 = 0; r0 < m; r0 += per) {
          const int n = std::min(per, m - r0);
          stream_gemv_dispatch(w, x + int64_t{r0} * w.cols, n, y + int64_t{r0} * w.rows,
                               stream_gemv_plan(w, n, StreamMode::rows), stream, FusedNorm{}, FusedConv{});
        }
        return;
      }
      return stream_gemv_dispatch(w, x, m, y, stream_gemv_plan(w, m, StreamMode::direct), stream, FusedNorm{},
                                  FusedConv{});
    }
    // The register-load kernel takes eight rows a launch (each row's bits are its own).
    for (int r0 = 0; r0 < m; r0 += kMmaMaxTokens)
      mma_gemv_dispatch(w, x + int64_t{r0} * w.cols, std::min(kMmaMaxTokens, m - r0), y + int64_t{r0} * w.rows, stream,
                        FusedNorm{}, FusedConv{});
    return;
  }
  if (tiled_gemv_smem(w.cols) <= kMaxTiledSmem) return tiled_gemv_dispatch<8>(w, x, m, y, stream);
  gemv_dispatch<8>(w, x, m, y, stream);  // the tiled kernel does not fit: quant_gemv_kernel for any m
}

void check_quant(const DeviceQuant& w, const char* what) {
  if ((w.bits != 4 && w.bits != 8) || w.cols <= 0 || w.cols % kGroup != 0 || w.cols > kMaxGemvCols || w.rows <= 0)
    throw ::lily::Error(std::string(what) + ": CUDA kernels support 4/8-bit matrices with cols a multiple of " +
                        std::to_string(kGroup) + " and ≤ " + std::to_string(kMaxGemvCols) + "; got bits=" + std::to_string(w.bits) +
                        " rows=" + std::to_string(w.rows) + " cols=" + std::to_string(w.cols));
}

template <int BITS>
__global__ void embed_kernel(DeviceQuant table, const int32_t* __restrict__ tokens, bf16* __restrict__ out) {
  constexpr int kPer = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int t = blockIdx.x;
  int64_t id = tokens[t];
  id = id < 0 ? 0 : (id >= table.rows ? table.rows - 1 : id);
  const int wpr = table.cols / kPer, groups = table.cols / kGroup;
  const uint32_t* codes = table.codes + id * wpr;
  for (int wi = threadIdx.x; wi < wpr; wi += blockDim.x) {
    const uint32_t word = codes[wi];
    const int c0 = wi * kPer, g = c0 / kGroup;
    const float s = to_f32(table.scales[id * groups + g]), b = to_f32(table.biases[id * groups + g]);
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      out[static_cast<int64_t>(t) * table.cols + c0 + e] = to_bf16(s * static_cast<float>((word >> (BITS * e)) & kMask) + b);
  }
}

}  // namespace

void launch_quant_gemv_batched(const DeviceQuant& w, const bf16* x, int m, bf16* y_bf16, float* y_f32,
                               cudaStream_t stream) {
  check_quant(w, "quant_gemv");
  if ((y_bf16 == nullptr) == (y_f32 == nullptr) || m <= 0 || m > 65535)
    throw ::lily::InternalError("launch_quant_gemv: exactly one output and 0 < m ≤ 65535 required");
  if (w.bits == 4) {
    if (y_f32) gemv_dispatch<4>(w, x, m, y_f32, stream); else gemv_dispatch<4>(w, x, m, y_bf16, stream);
  } else {
    if (y_f32) gemv_dispatch<8>(w, x, m, y_f32, stream); else gemv_dispatch<8>(w, x, m, y_bf16, stream);
  }
}

void set_stream_gemv_trace(uint64_t* trace, bool advance) {
  g_stream_trace = trace;
  g_stream_trace_advance = advance;
  g_stream_trace_launches.clear();
}

std::vector<StreamTraceLaunch> stream_gemv_trace_launches() { return g_stream_trace_launches; }

bool stream_gemv_tile_counter_enabled() { return g_stream_tile_counter_on.load(std::memory_order_relaxed); }
void set_stream_gemv_tile_counter_enabled(bool on) { g_stream_tile_counter_on.store(on, std::memory_order_relaxed); }

void launch_quant_gemv(const DeviceQuant& w, const bf16* x, bf16* y_bf16, float* y_f32, cudaStream_t stream) {
  launch_quant_gemv_batched(w, x, 1, y_bf16, y_f32, stream);
}

void launch_quant_gemv_rows(const DeviceQuant& w, const bf16* x, int m, bf16* y_bf16, float* y_f32,
                            cudaStream_t stream) {
  check_quant(w, "quant_gemv_rows");
  if ((y_bf16 == nullptr) == (y_f32 == nullptr) || m <= 0 || m > kMaxDecodeRows)
    throw ::lily::InternalError("launch_quant_gemv_rows: exactly one output and 0 < m ≤ " +
                                std::to_string(kMaxDecodeRows) + " required");
  if (y_f32) gemv_rows_dispatch(w, x, m, y_f32, stream);
  else gemv_rows_dispatch(w, x, m, y_bf16, stream);
}

namespace {

/// The output checks of the GEMVs with a fused norm (`what`: the launcher): exactly one output,
/// and a FusedConv with its buffers, at most w.rows channels, a bf16 output it does not alias.
/// Throws lily::InternalError.
void check_norm_gemv_outputs(const DeviceQuant& w, const bf16* y_bf16, const float* y_f32, const FusedConv& conv,
                             const char* what) {
  if ((y_bf16 == nullptr) == (y_f32 == nullptr)) throw ::lily::InternalError(std::string(what) + ": exactly one output required");
  if (conv.channels != 0 &&
      (conv.channels < 0 || conv.channels > w.rows || !conv.taps || !conv.window || !conv.out || !y_bf16 ||
       conv.out == y_bf16))
    throw ::lily::InternalError(std::string(what) + ": bad FusedConv (channels " + std::to_string(conv.channels) +
                                ", rows " + std::to_string(w.rows) + "; needs taps, window, out ≠ y, bf16 output)");
}

}  // namespace

void launch_add_rmsnorm_gemv(const FusedNorm& norm, const bf16* x, const DeviceQuant& w, bf16* y_bf16, float* y_f32,
                             cudaStream_t stream, const FusedConv& conv) {
  check_quant(w, "quant_gemv");
  check_fused_norm(norm, x, "launch_add_rmsnorm_gemv");
  check_norm_gemv_outputs(w, y_bf16, y_f32, conv, "launch_add_rmsnorm_gemv");
  if (w.bits == 4) {
    if (y_f32) gemv_dispatch<4>(w, x, 1, y_f32, stream, norm, conv);
    else gemv_dispatch<4>(w, x, 1, y_bf16, stream, norm, conv);
  } else {
    if (y_f32) gemv_dispatch<8>(w, x, 1, y_f32, stream, norm, conv);
    else gemv_dispatch<8>(w, x, 1, y_bf16, stream, norm, conv);
  }
}

std::string rows_norm_gemv_problem(const DeviceQuant& w, int m) {
  auto shape = [&] {  // formed only for a refusal
    return " (" + std::to_string(w.rows) + " × " + std::to_string(w.cols) + ", " + std::to_string(w.bits) + "-bit, " +
           std::to_string(m) + " rows)";
  };
  if (m < 1 || m > kMmaMaxTokens) return "the fused rows norm takes 1 … " + std::to_string(kMmaMaxTokens) + " rows" + shape();
  if (!w.codes || w.bits != 4 || !stream_gemv_enabled() || w.rows > rows_mode_max_weight_rows() ||
      w.cols > kRowsNormMaxCols || w.cols % 512 != 0)
    return "the fused rows norm needs a 4-bit matrix the streaming GEMV's rows mode takes (columns a multiple of "
           "512), at most " + std::to_string(kRowsNormMaxCols) + " columns" + shape();
  if (rows_mode_rows_per_launch(w, m) != m) return "the rows mode does not take all rows in one launch" + shape();
  return "";
}

void launch_add_rmsnorm_gemv_rows(const FusedNorm& norm, const bf16* x, int m, const DeviceQuant& w, bf16* out,
                                  cudaStream_t stream) {
  check_quant(w, "quant_gemv");
  if (const std::string why = rows_norm_gemv_problem(w, m); !why.empty())
    throw ::lily::InternalError("launch_add_rmsnorm_gemv_rows: " + why);
  check_fused_norm(norm, x, "launch_add_rmsnorm_gemv_rows");
  if (!out || !is_aligned(x, 16) || !is_aligned(norm.x_out, 16) || !is_aligned(norm.normed_out, 16) ||
      (norm.branch && !is_aligned(norm.branch, 16)) || !is_aligned(norm.gain, 16))
    throw ::lily::InternalError("launch_add_rmsnorm_gemv_rows: x, branch, gain, x_out and normed_out must be 16-byte "
                                "aligned, and out given");
  stream_gemv_dispatch(w, x, m, out, stream_gemv_plan(w, m, StreamMode::rows), stream, norm, FusedConv{});
}

bool staged_row_gemv_supported(const DeviceQuant& w) {
  return w.codes && w.bits == 4 && stream_gemv_plan(w, 1, StreamMode::staged).stages > 0;
}

void launch_staged_row_gemv(const StagedRow& row, const DeviceQuant& w, bf16* y_bf16, float* y_f32, cudaStream_t stream,
                            const FusedConv& conv) {
  check_quant(w, "staged_row_gemv");
  if (!row.pairs || !row.sums || !is_aligned(row.pairs, 16) || !is_aligned(row.sums, 16))
    throw ::lily::InternalError("launch_staged_row_gemv: the staged row needs 16-byte aligned pairs and sums");
  check_norm_gemv_outputs(w, y_bf16, y_f32, conv, "launch_staged_row_gemv");
  const StreamPlan plan = stream_gemv_plan(w, 1, StreamMode::staged);
  if (w.bits != 4 || plan.stages == 0)
    throw ::lily::InternalError("launch_staged_row_gemv: the streaming GEMV does not take this matrix (" +
                                std::to_string(w.rows) + " × " + std::to_string(w.cols) + ", " +
                                std::to_string(w.bits) + "-bit)");
  if (y_f32) stream_gemv_dispatch(w, nullptr, 1, y_f32, plan, stream, FusedNorm{}, conv, row);
  else stream_gemv_dispatch(w, nullptr, 1, y_bf16, plan, stream, FusedNorm{}, conv, row);
}

void launch_embed(const DeviceQuant& table, const int32_t* tokens, int m, bf16* out, cudaStream_t stream) {
  check_quant(table, "embed_tokens");
  if (m <= 0) throw ::lily::InternalError("launch_embed: m must be positive");
  if (table.bits == 4) embed_kernel<4><<<m, 256, 0, stream>>>(table, tokens, out);
  else embed_kernel<8><<<m, 256, 0, stream>>>(table, tokens, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
