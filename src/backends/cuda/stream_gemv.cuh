// The 4-bit streaming GEMV's tile machinery (nvcc only): the stage layout, the bulk-copy
// requests, and one warp's k-slice of a tile with every rounding explicit, so that any kernel
// that runs a tile with these functions gets quant_gemv.cu's bits for it.
//
//
// A register-load GEMV keeps its weight bytes in flight with registers, so the bytes an SM has in
// flight are bounded by its warps × registers and the GEMVs of a decode step stay far below the
// memory bandwidth. Here the weights travel by bulk copies into a ring of shared-memory stages (bulk_copy.cuh):
// one stage is one 16-row tile (its code rows, scales and biases, contiguous in the checkpoint
// layout), and warp 0 of each block keeps `stages` tiles in flight. The first stages are
// requested before the PDL wait (weights are never written), so a small matrix is often on chip
// when the predecessor finishes. Several small blocks per SM (not one big one) keep enough warps
// resident to hide the latency of the per-tile arithmetic.
//
// Arithmetic: the MMA kernel's fragments, with two changes that cut the instructions per weight.
// (1) Codes become bf16 values 128 + q (OR into the mantissa of 128, exact) without subtracting
// 128; the per-group epilogue folds it into the bias: s·Σ(q + 128)·x + (b − 128·s)·Σx. Products
// and per-group sums of at most 64 terms stay exact-ish in fp32 (each term < 2^16·|x|), so the
// result keeps the tolerance of the other kernels. (2) The 8 warps split a tile's groups into
// contiguous ranges (warp w: [w·G/8, (w+1)·G/8)), so scales, biases and Σx come two groups per
// shared load. Warp 0 adds the slices in slice order and stores. Both orders depend on the shape
// alone, so each token's result is the same for any m. No block-wide barrier per tile: mbarriers
// hand over stages (`full`, byte counted), slice partials (`ready`) and the two partial buffers
// (`freed`), so warps 1–7 may run a tile ahead of warp 0.
//
// Bank conflicts: code rows are cols/2 ≡ 0 (mod 128) bytes long, so the four rows an 8-byte
// fragment load of a half-warp touches must come from different 32-byte bank offsets. A tile is
// copied as 4 chunks of 4 consecutive rows, chunk c at c·(4·cols/2 + 32) bytes, and MMA row slot
// g holds matrix row 4·(g mod 4) + g/4: slots 0–3 (one half-warp) are rows 0, 4, 8, 12, one per
// chunk.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/kernels.h"
#include "backends/cuda/quant_mma.cuh"

namespace lily::cuda {

constexpr int kMmaTileRows = 16;  // weight rows of one MMA tile (the MMA's M)
constexpr int kMmaMaxTokens = 8;  // the MMA's N

/// Stores one thread's four results of a 16-row tile (acc as the MMA's D fragment: (slot g, token
/// 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); row_a / row_b the matrix rows of slots g and g+8) into
/// y [m, rows], with the GDN conv step of `conv` on rows below conv.channels (m = 1).
template <class OutT>
__device__ __forceinline__ void store_mma_tile(const float (&acc)[4], int64_t row_a, int64_t row_b, int t, int m,
                                               int64_t rows, OutT* __restrict__ y, const FusedConv& conv) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = i < 2 ? row_a : row_b;
    const int n = 2 * t + (i % 2);
    if (r >= rows || n >= m) continue;
    store_out(y, static_cast<int64_t>(n) * rows + r, acc[i]);
    if (r < conv.channels) {  // m = 1: x = the stored bf16 value, as gdn_conv_decode reads it
      float taps[kGdnConvK];
#pragma unroll
      for (int k = 0; k < kGdnConvK; ++k) taps[k] = conv.taps[r * kGdnConvK + k];
      bf16* wr = conv.window + r * 3;
      const bf16 w0 = wr[0], w1 = wr[1], w2 = wr[2], xb = to_bf16(acc[i]);
      conv.out[r] = conv_decode_value(w0, w1, w2, xb, taps);
      wr[0] = w1;
      wr[1] = w2;
      wr[2] = xb;
    }
  }
}

constexpr int kStreamWarps = 8;  // k-slices of a tile
constexpr int kStreamThreads = kStreamWarps * kWarp;
/// 64-groups of a row that one warp of the streaming kernel sums (groups / kStreamWarps) at most.
constexpr int kStreamMaxGroupsPerWarp = 16;
constexpr int kStreamChunkPad = 32;
constexpr int kStreamMaxStages = 8;
/// How the streaming GEMV gets its activations:
///  - staged: the m ≤ 8 rows staged once per block (with a fused norm or conv), one column block;
///  - direct: each warp reads its groups' fragments from x in global memory for every tile (no
///    block-wide pass over the rows before the first MMA; the one-sequence step's unfused GEMVs);
///  - rows: the m rows (the batched decode's, up to kMaxStreamGemvRows a launch) staged once per block in
///    fragment order with their Σx, one block per SM, so that each 16-row tile reads them from
///    shared memory instead of from L2 (at 32 rows of 2,048 columns 128 KB per tile against its
///    18 KB of weights).
/// All three give a token the same bits (the same fragments, group_sum_x's Σx, one epilogue).
enum class StreamMode : int { staged, direct, rows };

/// Byte offsets of the streaming GEMV's shared memory (host and device compute the same).
struct StreamLayout {
  int row_bytes = 0;        ///< cols / 2
  int chunk_pitch = 0;      ///< bytes from one 4-row chunk of a stage to the next
  int64_t stage_bytes = 0;  ///< one tile: 4 chunks of code rows, then 16 × groups scales, then biases
  int64_t tile_ids = 0;     ///< tile counter only: int32 [kStreamMaxStages], the tile each stage holds (−1: none more)
  int64_t ring = 0;         ///< first stage
  int64_t xperm = 0;        ///< uint32 [m][cols / 2] (rows mode: [m][stream_rows_pitch])
  int64_t xsum = 0;         ///< float [m][groups] (rows mode: [m][stream_rows_sum_pitch])
  int64_t scratch = 0;      ///< staging (float [groups × 69]), later the partials float4 [2][8][32]
  int64_t total = 0;
};

/// Column blocks of eight tokens that the direct and rows modes run for m tokens (1 … 4).
__host__ __device__ inline int stream_column_blocks(int m) { return (m + kMmaMaxTokens - 1) / kMmaMaxTokens; }

/// Rows mode: words between two staged rows, cols / 2 + 4. A 16-byte fragment load of token g
/// and k-thread t reads words 8t … of its group, so the eight lanes of one load phase (tokens
/// g, g + 1) land on distinct banks when the rows are 4 words apart modulo 32.
__host__ __device__ inline int stream_rows_pitch(int cols) { return cols / 2 + 4; }
/// Rows mode: floats between two rows' Σx, groups + 2 (the four k-threads' tokens 2t, 8 bytes
/// apart in a float2-aligned row, on distinct banks).
__host__ __device__ inline int stream_rows_sum_pitch(int groups) { return groups + 2; }

/// The layout for m tokens, `stages` tiles in flight and chunk padding `pad` (with `tile_ids`,
/// room for the tile counter's per-stage tile indices before the ring). direct: no
/// permuted copy and no staging area; Σx for whole column blocks of eight tokens (m ≤
/// kMaxStreamGemvRows). rows: the permuted rows and their Σx at the rows-mode pitches. direct and
/// rows: the k-slice partials hold every column block. tile_groups: warp groups that take turns
/// on the tiles (the rows mode with one column block, quant_stream_gemv_kernel), each with its own
/// partial buffers.
__host__ __device__ inline StreamLayout stream_layout(int cols, int m, int stages, int pad,
                                                      StreamMode mode = StreamMode::staged, bool tile_ids = false,
                                                      int tile_groups = 1) {
  const int groups = cols / kGroup;
  const bool direct = mode == StreamMode::direct, rows = mode == StreamMode::rows;
  const int blocks = mode == StreamMode::staged ? 1 : stream_column_blocks(m);
  StreamLayout l;
  l.row_bytes = cols / 2;
  l.chunk_pitch = 4 * l.row_bytes + pad;
  l.stage_bytes = int64_t{4} * l.chunk_pitch + int64_t{2} * kMmaTileRows * groups * 2;
  // After the mbarriers: full[stages], ready[2], freed[2], row, and in the rows mode its second
  // warp group's ready[2], freed[2] (quant_stream_gemv_kernel's kGroups).
  l.tile_ids = int64_t{kStreamMaxStages + (rows ? 9 : 5)} * 8;
  l.ring = align16(l.tile_ids + (tile_ids ? int64_t{kStreamMaxStages} * 4 : 0));
  l.xperm = l.ring + stages * l.stage_bytes;
  const int64_t xperm_bytes = direct ? 0 : rows ? int64_t{m} * stream_rows_pitch(cols) * 4 : int64_t{m} * cols * 2;
  l.xsum = l.xperm + align16(xperm_bytes);
  const int64_t xsum_floats = direct ? int64_t{blocks} * kMmaMaxTokens * groups
                              : rows ? int64_t{m} * stream_rows_sum_pitch(groups)
                                     : int64_t{m} * groups;
  l.scratch = l.xsum + align16(xsum_floats * 4);
  const int64_t staging = mode == StreamMode::staged ? int64_t{groups} * (kGroupStride + 1) * 4 : 0;
  const int64_t partials = int64_t{2} * tile_groups * blocks * kStreamWarps * kWarp * 16;
  l.total = l.scratch + align16(staging > partials ? staging : partials);
  return l;
}

/// Rows of weight tile `tile` that exist: kMmaTileRows, fewer in the last tile of the matrix.
__device__ __forceinline__ int stream_tile_rows(const DeviceQuant& w, int64_t tile) {
  const int64_t left = w.rows - tile * kMmaTileRows;
  return static_cast<int>(left < kMmaTileRows ? left : kMmaTileRows);
}

/// Warp 0: requests global tile `tile` (rows 16·tile …) into `stage`, completing on `full`.
/// Lane 0 announces the bytes; lanes 0–3 copy one 4-row chunk each (one copy of all rows when the
/// chunks are not padded), lanes 4 and 5 the tile's scales and biases. Rows past the matrix are
/// not copied.
__device__ __forceinline__ void stream_request_tile_at(const DeviceQuant& w, int64_t tile, unsigned char* stage,
                                                       const StreamLayout& l, uint64_t* full) {
  const int lane = threadIdx.x % kWarp, groups = w.cols / kGroup;
  const int64_t row0 = tile * kMmaTileRows;
  const int valid = stream_tile_rows(w, tile);
  const uint32_t sb_bytes = static_cast<uint32_t>(valid) * groups * 2;
  if (lane == 0) mbarrier_arrive_expect_tx(full, valid * l.row_bytes + 2 * sb_bytes);
  __syncwarp();
  fence_proxy_async_shared();
  const unsigned char* codes = reinterpret_cast<const unsigned char*>(w.codes) + row0 * l.row_bytes;
  const bool padded = l.chunk_pitch != 4 * l.row_bytes;
  if (lane < 4) {
    const int first = 4 * lane, rows = valid - first < 4 ? valid - first : 4;
    if (padded && rows > 0)
      bulk_copy_to_shared(stage + lane * l.chunk_pitch, codes + first * l.row_bytes, rows * l.row_bytes, full);
    else if (!padded && lane == 0)
      bulk_copy_to_shared(stage, codes, valid * l.row_bytes, full);
  } else if (lane == 4 || lane == 5) {
    const bf16* src = (lane == 4 ? w.scales : w.biases) + row0 * groups;
    bulk_copy_to_shared(stage + 4 * l.chunk_pitch + (lane - 4) * kMmaTileRows * groups * 2, src, sb_bytes, full);
  }
}

/// Warp 0: requests local tile `j` of this block (global tile blockIdx.x + j·gridDim.x, the
/// fixed-stride deal) into `stage`, as stream_request_tile_at.
__device__ __forceinline__ void stream_request_tile(const DeviceQuant& w, int64_t j, unsigned char* stage,
                                                    const StreamLayout& l, uint64_t* full) {
  stream_request_tile_at(w, blockIdx.x + j * gridDim.x, stage, l, full);
}

/// One thread's view of a stage for its fragment rows (slot g → row 4·(g mod 4) + g/4, slot
/// g + 8 → that row + 2).
struct StreamTileView {
  const unsigned char* code_lo;  ///< this thread's 8 bytes of group 0, row of slot g
  const unsigned char* code_hi;  ///< same, row of slot g + 8
  const bf16* s_lo;              ///< scales of the slot-g row [groups]
  const bf16* s_hi;
  const bf16* b_lo;              ///< biases of the slot-g row [groups]
  const bf16* b_hi;
};

__device__ __forceinline__ StreamTileView stream_tile_view(const unsigned char* stage, const StreamLayout& l, int groups,
                                                           int g, int t) {
  const int r_lo = 4 * (g % 4) + g / 4;
  StreamTileView v;
  v.code_lo = stage + (g % 4) * l.chunk_pitch + (g / 4) * l.row_bytes + 8 * t;
  v.code_hi = v.code_lo + 2 * l.row_bytes;
  const bf16* sc = reinterpret_cast<const bf16*>(stage + 4 * l.chunk_pitch);
  const bf16* bi = sc + kMmaTileRows * groups;
  v.s_lo = sc + r_lo * groups;
  v.s_hi = sc + (r_lo + 2) * groups;
  v.b_lo = bi + r_lo * groups;
  v.b_hi = bi + (r_lo + 2) * groups;
  return v;
}

/// Token g's activation fragments of group G (group_mma's B registers; zeros for g ≥ m) read
/// straight from x [m, cols] in global memory: the 16 values [64G + 16t, +16) in two 16-byte
/// loads, paired (c, c + 4) with byte permutes into fragment_pair_column's order.
__device__ __forceinline__ void stream_direct_fragments(const bf16* __restrict__ x, int cols, int m, int g, int t, int G,
                                                        uint4& bw0, uint4& bw1) {
  bw0 = bw1 = make_uint4(0, 0, 0, 0);
  if (g >= m) return;
  const uint4* p = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(g) * cols + G * kGroup + 16 * t);
  const uint4 lo = p[0], hi = p[1];  // (x0, x1), (x2, x3), (x4, x5), (x6, x7) of each half
  bw0 = make_uint4(__byte_perm(lo.x, lo.z, 0x5410), __byte_perm(lo.x, lo.z, 0x7632), __byte_perm(lo.y, lo.w, 0x5410),
                   __byte_perm(lo.y, lo.w, 0x7632));
  bw1 = make_uint4(__byte_perm(hi.x, hi.z, 0x5410), __byte_perm(hi.x, hi.z, 0x7632), __byte_perm(hi.y, hi.w, 0x5410),
                   __byte_perm(hi.y, hi.w, 0x7632));
}

/// Adds group G's contribution to acc (rows of slots g, g+8 × tokens 2t, 2t+1), the activation
/// fragments from the staged permuted rows xperm [m][cols / 2]. A lane with g ≥ m loads row m − 1
/// again instead of zeros: an MMA's output column depends only on its own B column, so the
/// columns of real tokens keep their bits, the extra columns are never stored (store_mma_tile),
/// and the loads need no branch. kOneToken (m = 1): token 2t + 1 is never stored, so acc[1] and
/// acc[3] are left at zero.
template <bool kOneToken>
__device__ __forceinline__ void stream_group(const StreamTileView& v, const uint32_t* xperm, int cols, int m, int g,
                                             int t, int G, float sl, float bl, float sh, float bh, float x0, float x1,
                                             float (&acc)[4]) {
  const uint4* bp = reinterpret_cast<const uint4*>(xperm + min(g, m - 1) * (cols / 2) + G * 32 + t * 8);
  const uint4 bw0 = bp[0], bw1 = bp[1];
  float d[4];
  group_mma<true>(*reinterpret_cast<const uint2*>(v.code_lo + G * 32), *reinterpret_cast<const uint2*>(v.code_hi + G * 32),
                   bw0, bw1, d);
  // Every rounding explicit, so that every kernel that inlines this gets the same bits.
  const float cl = __fmaf_rn(-128.0f, sl, bl), ch = __fmaf_rn(-128.0f, sh, bh);
  acc[0] = affine_add(acc[0], sl, d[0], cl, x0);
  if constexpr (!kOneToken) acc[1] = affine_add(acc[1], sl, d[1], cl, x1);
  acc[2] = affine_add(acc[2], sh, d[2], ch, x0);
  if constexpr (!kOneToken) acc[3] = affine_add(acc[3], sh, d[3], ch, x1);
}

/// One warp's k-slice of a 16-row tile: adds groups [g_begin, g_end) to acc (zero on entry) in
/// ascending order, two groups per load of scales, biases and Σx. xs0 / xs1 are Σx of tokens 2t
/// and 2t + 1 ([groups], read only when has0 / has1). The order depends on the shape alone.
/// kOneToken: m = 1 (stream_group).
template <bool kOneToken = false>
__device__ __forceinline__ void stream_tile_slice(const StreamTileView& v, const uint32_t* xperm, int cols, int m,
                                                  int g, int t, int g_begin, int g_end, const float* xs0,
                                                  const float* xs1, bool has0, bool has1, float (&acc)[4]) {
  int G = g_begin;
#pragma unroll 2
  for (; G + 2 <= g_end; G += 2) {  // two groups per load of scales, biases and Σx
    const __nv_bfloat162 sl = *reinterpret_cast<const __nv_bfloat162*>(v.s_lo + G);
    const __nv_bfloat162 bl = *reinterpret_cast<const __nv_bfloat162*>(v.b_lo + G);
    const __nv_bfloat162 sh = *reinterpret_cast<const __nv_bfloat162*>(v.s_hi + G);
    const __nv_bfloat162 bh = *reinterpret_cast<const __nv_bfloat162*>(v.b_hi + G);
    const float2 x0 = has0 ? *reinterpret_cast<const float2*>(xs0 + G) : make_float2(0.0f, 0.0f);
    const float2 x1 = has1 ? *reinterpret_cast<const float2*>(xs1 + G) : make_float2(0.0f, 0.0f);
    stream_group<kOneToken>(v, xperm, cols, m, g, t, G, __low2float(sl), __low2float(bl), __low2float(sh),
                            __low2float(bh), x0.x, x1.x, acc);
    stream_group<kOneToken>(v, xperm, cols, m, g, t, G + 1, __high2float(sl), __high2float(bl), __high2float(sh),
                            __high2float(bh), x0.y, x1.y, acc);
  }
  if (G < g_end)  // an odd group count per warp
    stream_group<kOneToken>(v, xperm, cols, m, g, t, G, to_f32(v.s_lo[G]), to_f32(v.b_lo[G]), to_f32(v.s_hi[G]),
                            to_f32(v.b_hi[G]), has0 ? xs0[G] : 0.0f, has1 ? xs1[G] : 0.0f, acc);
}

/// The direct mode's Σx, before any tile: each of m tokens' groups [g_begin, g_end) of x [m, cols]
/// (bf16, in global memory) summed by the warp that owns them, with group_sum_x's bits (the staged
/// mode's), into xsum[n·groups + G] (lane 0 stores). All loads of a token are issued before its
/// shuffles. One warp; ends with __syncwarp() (only this warp reads its groups' sums).
__device__ __forceinline__ void stream_direct_group_sums(const bf16* __restrict__ x, int cols, int m, int g_begin,
                                                         int g_end, float* xsum) {
  const int lane = threadIdx.x % kWarp, groups = cols / kGroup;
  for (int n = 0; n < m; ++n) {
    const bf16* xr = x + static_cast<int64_t>(n) * cols + lane;
    float v[kStreamMaxGroupsPerWarp], v32[kStreamMaxGroupsPerWarp];
#pragma unroll
    for (int j = 0; j < kStreamMaxGroupsPerWarp; ++j) {
      const int G = g_begin + j;
      v[j] = G < g_end ? to_f32(xr[G * kGroup]) : 0.0f;
      v32[j] = G < g_end ? to_f32(xr[G * kGroup + 32]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kStreamMaxGroupsPerWarp; ++j) {
      const int G = g_begin + j;
      if (G >= g_end) break;  // warp-uniform
      const float sum = group_sum_x(v[j], v32[j]);
      if (lane == 0) xsum[n * groups + G] = sum;
    }
  }
  __syncwarp();
}

/// Warp 0's reduction of a tile: adds the k-slice partials of warps 1 … kStreamWarps − 1
/// (partial: float4 [column block][kStreamWarps][lane], as those warps stored their acc) to its
/// own acc, in slice order, so a row's sum depends on the shape alone.
template <int kBlocks>
__device__ __forceinline__ void stream_add_slices(const float4* partial, int lane, float (&acc)[kBlocks][4]) {
  for (int sl = 1; sl < kStreamWarps; ++sl) {
#pragma unroll
    for (int c = 0; c < kBlocks; ++c) {
      const float4 o = partial[(c * kStreamWarps + sl) * kWarp + lane];
      acc[c][0] += o.x;
      acc[c][1] += o.y;
      acc[c][2] += o.z;
      acc[c][3] += o.w;
    }
  }
}

/// stream_group_blocks with the thread's code words of group G given (`lo`, `hi`: rows of slots g
/// and g + 8, as group_mma takes them) instead of read from a stage: the one arithmetic of every
/// streaming mode, so a kernel that keeps its codes in registers gets the same bits.
template <int kBlocks, class Frag>
__device__ __forceinline__ void stream_group_blocks_codes(const uint2& lo, const uint2& hi, const Frag& frag, int G,
                                                          float sl, float bl, float sh, float bh,
                                                          const float (&x0)[kBlocks], const float (&x1)[kBlocks],
                                                          float (&acc)[kBlocks][4]) {
  uint4 bw0[kBlocks], bw1[kBlocks];
#pragma unroll
  for (int c = 0; c < kBlocks; ++c) frag(c, G, bw0[c], bw1[c]);
  float d[kBlocks][4];
  group_mma_blocks<true, kBlocks>(lo, hi, bw0, bw1, d);
  const float cl = __fmaf_rn(-128.0f, sl, bl), ch = __fmaf_rn(-128.0f, sh, bh);
#pragma unroll
  for (int c = 0; c < kBlocks; ++c) {
    acc[c][0] = affine_add(acc[c][0], sl, d[c][0], cl, x0[c]);
    acc[c][1] = affine_add(acc[c][1], sl, d[c][1], cl, x1[c]);
    acc[c][2] = affine_add(acc[c][2], sh, d[c][2], ch, x0[c]);
    acc[c][3] = affine_add(acc[c][3], sh, d[c][3], ch, x1[c]);
  }
}

/// Group G for kBlocks column blocks (block c: tokens 8c …): frag(c, G, bw0, bw1) gives block
/// c's activation fragments, the weight fragment is formed once for all blocks
/// (group_mma_blocks), then stream_group's epilogue per block (x0[c], x1[c]: Σx of tokens 8c + 2t
/// and 8c + 2t + 1). A token's bits do not depend on its block or on where its fragments come
/// from.
template <int kBlocks, class Frag>
__device__ __forceinline__ void stream_group_blocks(const StreamTileView& v, const Frag& frag, int G, float sl, float bl,
                                                    float sh, float bh, const float (&x0)[kBlocks],
                                                    const float (&x1)[kBlocks], float (&acc)[kBlocks][4]) {
  stream_group_blocks_codes<kBlocks>(*reinterpret_cast<const uint2*>(v.code_lo + G * 32),
                                     *reinterpret_cast<const uint2*>(v.code_hi + G * 32), frag, G, sl, bl, sh, bh, x0,
                                     x1, acc);
}

/// The k-slice of kBlocks column blocks in stream_tile_slice's order (groups [g_begin, g_end)
/// ascending, two per load of scales and biases): frag as for stream_group_blocks, sums(c, G,
/// x0, x1) sets x0[c], x1[c] to the Σx of block c's tokens 2t and 2t + 1 in group G.
template <int kBlocks, class Frag, class Sums>
__device__ __forceinline__ void stream_tile_slice_blocks(const StreamTileView& v, const Frag& frag, const Sums& sums,
                                                         int g_begin, int g_end, float (&acc)[kBlocks][4]) {
  int G = g_begin;
#pragma unroll 2
  for (; G + 2 <= g_end; G += 2) {
    const __nv_bfloat162 sl = *reinterpret_cast<const __nv_bfloat162*>(v.s_lo + G);
    const __nv_bfloat162 bl = *reinterpret_cast<const __nv_bfloat162*>(v.b_lo + G);
    const __nv_bfloat162 sh = *reinterpret_cast<const __nv_bfloat162*>(v.s_hi + G);
    const __nv_bfloat162 bh = *reinterpret_cast<const __nv_bfloat162*>(v.b_hi + G);
    float x0[kBlocks], x1[kBlocks], y0[kBlocks], y1[kBlocks];
#pragma unroll
    for (int c = 0; c < kBlocks; ++c) {
      sums(c, G, x0, x1);
      sums(c, G + 1, y0, y1);
    }
    stream_group_blocks<kBlocks>(v, frag, G, __low2float(sl), __low2float(bl), __low2float(sh), __low2float(bh), x0, x1,
                                 acc);
    stream_group_blocks<kBlocks>(v, frag, G + 1, __high2float(sl), __high2float(bl), __high2float(sh),
                                 __high2float(bh), y0, y1, acc);
  }
  if (G < g_end) {  // an odd group count per warp
    float x0[kBlocks], x1[kBlocks];
#pragma unroll
    for (int c = 0; c < kBlocks; ++c) sums(c, G, x0, x1);
    stream_group_blocks<kBlocks>(v, frag, G, to_f32(v.s_lo[G]), to_f32(v.b_lo[G]), to_f32(v.s_hi[G]),
                                 to_f32(v.b_hi[G]), x0, x1, acc);
  }
}

/// The direct mode's k-slice: each block's fragments read from x [m, cols] in global memory
/// (stream_direct_fragments, zeros past m); xsum [m][groups] the tokens' Σx (0 past m).
template <int kBlocks>
__device__ __forceinline__ void stream_tile_slice_direct(const StreamTileView& v, const bf16* x, int cols, int m,
                                                         int g, int t, int g_begin, int g_end, const float* xsum,
                                                         float (&acc)[kBlocks][4]) {
  const int groups = cols / kGroup;
  auto frag = [&](int c, int G, uint4& bw0, uint4& bw1) {
    stream_direct_fragments(x + int64_t{c} * kMmaMaxTokens * cols, cols, m - c * kMmaMaxTokens, g, t, G, bw0, bw1);
  };
  auto sums = [&](int c, int G, float (&x0)[kBlocks], float (&x1)[kBlocks]) {
    const int n0 = c * kMmaMaxTokens + 2 * t;
    x0[c] = n0 < m ? xsum[n0 * groups + G] : 0.0f;
    x1[c] = n0 + 1 < m ? xsum[(n0 + 1) * groups + G] : 0.0f;
  };
  stream_tile_slice_blocks<kBlocks>(v, frag, sums, g_begin, g_end, acc);
}

/// Σx of one 64-group held as 8 × 16 bytes of bf16 (q[j]: columns 8j … 8j + 7), with
/// group_sum_x's bits: x_l + x_{l+32}, then the butterfly's pairs l, l + o for o = 16 … 1 (the
/// value every lane of that butterfly ends with).
__device__ __forceinline__ float unit_group_sum(const uint4 (&q)[8]) {
  auto lo = [](uint32_t w) { return __uint_as_float(w << 16); };         // bf16 element 2e of a word
  auto hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };  // element 2e + 1
  float a[32];  // a[l] = x_l + x_{l+32}
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t p[4] = {q[j].x, q[j].y, q[j].z, q[j].w}, r[4] = {q[j + 4].x, q[j + 4].y, q[j + 4].z, q[j + 4].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a[8 * j + 2 * e] = __fadd_rn(lo(p[e]), lo(r[e]));
      a[8 * j + 2 * e + 1] = __fadd_rn(hi(p[e]), hi(r[e]));
    }
  }
  // The butterfly's levels, written out so that a[] stays in registers.
#pragma unroll
  for (int l = 0; l < 16; ++l) a[l] = __fadd_rn(a[l], a[l + 16]);
#pragma unroll
  for (int l = 0; l < 8; ++l) a[l] = __fadd_rn(a[l], a[l + 8]);
#pragma unroll
  for (int l = 0; l < 4; ++l) a[l] = __fadd_rn(a[l], a[l + 4]);
  a[0] = __fadd_rn(a[0], a[2]);
  a[1] = __fadd_rn(a[1], a[3]);
  return __fadd_rn(a[0], a[1]);
}

/// The rows mode's pass over the m raw rows staged in xperm (natural order, row n at
/// n·stream_rows_pitch(cols)): each (row, group) unit is read from shared memory, its Σx formed
/// into xsum (row n at n·stream_rows_sum_pitch(groups), group_sum_x's bits: unit_group_sum), and
/// its words put in fragment order in place (a unit's 16-byte pieces permute among themselves, so
/// no thread touches another's unit). All threads of the block; ends with __syncthreads().
__device__ __forceinline__ void rows_to_fragments(int m, int cols, uint32_t* xperm, float* xsum) {
  const int groups = cols / kGroup, pitch = stream_rows_pitch(cols), sum_pitch = stream_rows_sum_pitch(groups);
  for (int u = threadIdx.x; u < m * groups; u += blockDim.x) {
    const int n = u % m, G = u / m;
    uint4* unit = reinterpret_cast<uint4*>(xperm + int64_t{n} * pitch + G * 32);
    uint4 q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = unit[j];
    xsum[n * sum_pitch + G] = unit_group_sum(q);
#pragma unroll
    for (int j = 0; j < 8; ++j) unit[j] = fragment_order(q[j]);
  }
  __syncthreads();
}

/// Rows mode: stages x [m, cols] (bf16, rows 16-byte aligned, cols a multiple of 8) into xperm
/// (uint32 words, row n at n·stream_rows_pitch(cols), group G's 32 words in fragment order at 32G:
/// fragment_order of each 16-byte unit) and xsum (row n at n·stream_rows_sum_pitch(groups): each
/// group's Σx with group_sum_x's bits). The m raw rows arrive first by bulk copies, one per row
/// into its pitched place, counted on `bar` (an initialised mbarrier of this block, phase 0);
/// then rows_to_fragments. Why bulk copies: with each thread loading its units into registers,
/// it waited out one round trip to L2 per unit (four at 32 rows), each behind the weight tiles
/// the block had requested before its wait; here the rows come in one wave (an in-projection at
/// 24–32 rows 5–10 % faster on an H100). All threads of the block; ends with __syncthreads().
__device__ __forceinline__ void stage_rows_fragments(const bf16* __restrict__ x, int m, int cols, uint32_t* xperm,
                                                     float* xsum, uint64_t* bar) {
  const int pitch = stream_rows_pitch(cols);
  if (threadIdx.x < kWarp) {
    const uint32_t row_bytes = static_cast<uint32_t>(cols) * 2;
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(m) * row_bytes);
    __syncwarp();
    for (int n = static_cast<int>(threadIdx.x); n < m; n += kWarp)
      bulk_copy_to_shared(xperm + int64_t{n} * pitch, x + int64_t{n} * cols, row_bytes, bar);
  }
  mbarrier_wait(bar, 0);
  rows_to_fragments(m, cols, xperm, xsum);
}

/// Threads of the block in whose element-to-thread mapping the stand-alone add + RMSNorm
/// (launch_add_rmsnorm) sums Σh²: thread i sums h[i + 256·k] over k in order, then block_sum adds
/// the threads per warp and then the warps.
constexpr int kRowsNormThreads = 256;
/// The widest row stage_rows_norm_fragments takes (its per-lane registers are sized for it).
constexpr int kRowsNormMaxCols = 2048;

/// The rows mode's staging with the add + RMSNorm fused (launch_add_rmsnorm_gemv_rows): warp
/// n < m forms row n, h = bf16(x + branch) (x itself without a branch) and y = bf16(h·r·gain) with
/// r = 1 / sqrt(Σh² / cols + eps), into row n of xperm in natural order; then rows_to_fragments,
/// as after stage_rows_fragments' copies. Σh² runs in launch_add_rmsnorm's order, so a row gets
/// its bits: lane l plays thread 32·v + l of each of that kernel's eight warps v in turn (its sum
/// over k in order, warp_sum per warp, then warp_sum of the eight warp sums on lanes < 8, the other
/// lanes zero, as block_sum adds them). Block 0 stores h to norm.x_out (not x: every block reads
/// x) and y to norm.normed_out. x, the branch and both outputs are [m, cols] row-major
/// and 16-byte aligned; cols a multiple of 512, at most kRowsNormMaxCols; m ≤ the block's warps
/// (the launcher checks). All threads of the block; ends with __syncthreads().
__device__ __forceinline__ void stage_rows_norm_fragments(const bf16* __restrict__ x, const FusedNorm& norm, int m,
                                                          int cols, uint32_t* xperm, float* xsum) {
  constexpr int kUnits = kRowsNormMaxCols / (8 * kWarp);  // 16-byte units of a row per lane at most
  const int warp = static_cast<int>(threadIdx.x / kWarp), lane = static_cast<int>(threadIdx.x % kWarp);
  const int units = cols / (8 * kWarp);  // this row's 16-byte units per lane
  if (warp < m) {
    const int64_t off = int64_t{warp} * cols;
    uint4* row = reinterpret_cast<uint4*>(xperm + int64_t{warp} * stream_rows_pitch(cols));
    const uint4* xr = reinterpret_cast<const uint4*>(x + off);
    const uint4* br = norm.branch ? reinterpret_cast<const uint4*>(norm.branch + off) : nullptr;
    uint4 xv[kUnits], bv[kUnits];
#pragma unroll
    for (int q = 0; q < kUnits; ++q)  // every load in flight before any is used
      if (q < units) {
        xv[q] = xr[lane + q * kWarp];
        bv[q] = br ? br[lane + q * kWarp] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int q = 0; q < kUnits; ++q)
      if (q < units) {
        uint4 h = xv[q];
        if (br) {
          const bf16* xe = reinterpret_cast<const bf16*>(&xv[q]);
          const bf16* be = reinterpret_cast<const bf16*>(&bv[q]);
          bf16* he = reinterpret_cast<bf16*>(&h);
#pragma unroll
          for (int e = 0; e < 8; ++e) he[e] = to_bf16(to_f32(xe[e]) + to_f32(be[e]));
        }
        row[lane + q * kWarp] = h;
      }
    __syncwarp();
    const bf16* hs = reinterpret_cast<const bf16*>(row);
    float warp_sums = 0.0f;  // lane v < 8: that warp's sum
    for (int v = 0; v < kRowsNormThreads / kWarp; ++v) {
      float ss = 0.0f;
      for (int e = v * kWarp + lane; e < cols; e += kRowsNormThreads) {
        const float h = to_f32(hs[e]);
        ss += h * h;
      }
      const float total = warp_sum(ss);
      if (lane == v) warp_sums = total;
    }
    const float r = 1.0f / sqrtf(warp_sum(warp_sums) / static_cast<float>(cols) + norm.eps);
    const bool store = blockIdx.x == 0;
#pragma unroll
    for (int q = 0; q < kUnits; ++q)
      if (q < units) {
        const int unit = lane + q * kWarp;
        const uint4 h = row[unit];
        const bf16* he = reinterpret_cast<const bf16*>(&h);
        const float4 g0 = __ldg(reinterpret_cast<const float4*>(norm.gain) + 2 * unit);
        const float4 g1 = __ldg(reinterpret_cast<const float4*>(norm.gain) + 2 * unit + 1);
        const float gain[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        uint4 y;
        bf16* ye = reinterpret_cast<bf16*>(&y);
#pragma unroll
        for (int e = 0; e < 8; ++e) ye[e] = to_bf16(to_f32(he[e]) * r * gain[e]);
        row[unit] = y;
        if (store) {
          reinterpret_cast<uint4*>(norm.x_out + off)[unit] = h;
          reinterpret_cast<uint4*>(norm.normed_out + off)[unit] = y;
        }
      }
  }
  __syncthreads();
  rows_to_fragments(m, cols, xperm, xsum);
}

/// The rows mode's k-slice of column blocks c0 … c0 + kBlocks − 1: block c's fragments from the
/// staged rows (stage_rows_fragments), its Σx from the staged sums. A column past m takes row
/// m − 1's values: an MMA's output column depends only on its own B column, and that column is
/// never stored.
template <int kBlocks>
__device__ __forceinline__ void stream_tile_slice_rows(const StreamTileView& v, const uint32_t* xperm, const float* xsum,
                                                       int cols, int m, int g, int t, int g_begin, int g_end, int c0,
                                                       float (&acc)[kBlocks][4]) {
  const int pitch = stream_rows_pitch(cols), sum_pitch = stream_rows_sum_pitch(cols / kGroup);
  auto frag = [&](int c, int G, uint4& bw0, uint4& bw1) {
    const int n = min((c0 + c) * kMmaMaxTokens + g, m - 1);
    const uint4* p = reinterpret_cast<const uint4*>(xperm + n * pitch + G * 32 + t * 8);
    bw0 = p[0];
    bw1 = p[1];
  };
  auto sums = [&](int c, int G, float (&x0)[kBlocks], float (&x1)[kBlocks]) {
    const int n0 = min((c0 + c) * kMmaMaxTokens + 2 * t, m - 1), n1 = min((c0 + c) * kMmaMaxTokens + 2 * t + 1, m - 1);
    x0[c] = xsum[n0 * sum_pitch + G];
    x1[c] = xsum[n1 * sum_pitch + G];
  };
  stream_tile_slice_blocks<kBlocks>(v, frag, sums, g_begin, g_end, acc);
}

}  // namespace lily::cuda
