// The decode MoE block of the 1 … 8 rows of a batched decode step in one launch (docs/model.md §3.5, §4.3 item 5): the
// post-mixer add + RMSNorm, the router GEMV and top-k, the gate/up projections with SwiGLU over
// the routed experts and the shared one, the down projections and the weighted combine. The
// tokens are the rows of one decode step (one per sequence); each row's result is bit-identical
// whatever the other rows are (batch invariance, below).
//
// Why one launch: as three kernels (router, gate/up, down) each decode layer pays two more
// kernel boundaries, and each kernel's weights can only start streaming once it runs. Here
// every block is resident for the whole block (one block per SM), so the work after a
// grid-wide dependency waits on a counter instead of a launch, and the weights are requested as
// early as their addresses are known:
//  1. before the PDL wait: the block's share of the router rows into registers and its first
//     tiles of the shared expert (gate/up and down), whose addresses do not depend on the routing;
//  2. after the wait: block r mod G norms row r alone (the one-token block's norm), stores x_out
//     and normed_out; after a grid barrier every block stages the normed rows from normed_out
//     (bf16, 16-byte loads through L2, four rows at a time from 6 rows on) and computes, for each
//     row, its share of the router logits (the one-token block's CUDA-core router rows, held in
//     registers from before the wait; row e on block e mod G, so every block holds one or two,
//     each held by eight warps that take a token row each), then grid barrier 1; the logits go
//     to shared memory in one round trip, warp r routes row r (route_token_keys), and every
//     block lists the distinct experts of the step (the shared one first, then the routed ones
//     in ascending id) and requests its first tiles;
//  3. gate/up on tensor cores (quant_mma.cuh): a tile is 8 rows of one expert (16 MMA rows: the
//     8 gate rows and the same 8 up rows), and the MMA's 8 columns are the step's rows, so each
//     expert's weights are read once for every row that routed to it. Four quads of four warps
//     work on four tiles at once, each quad through its own ring slots and named barrier; a warp
//     sums four of the one-token block's sixteen group ranges, each on its own; SwiGLU, act to
//     global memory, grid barrier 2;
//  4. down + combine: a block owns 16 output rows; warp w walks the distinct experts w, w + S,
//     … through its own shared-memory stage (one bulk-copy ring slot per warp: a few requested
//     after the routing, the rest in the gate/up ring's tail once the block's gate/up tiles are
//     done), and the block combines each row's slots in slot order.
// Gate/up tiles are dealt round-robin over the blocks and, within a block, over the quads; a
// tile's code rows are staged padded (moe_block.cuh: no bank conflicts on the fragment loads),
// twenty bulk copies that the quad's four warps share. The ring slots, the down stages and the
// act staging are sized from the row count at launch (moe_layout).
//
// Grid barriers are counters in global memory that the caller zeroes before every launch (a
// memset node at the start of the decode graph), so a replay never depends on the last one.
// The first counter serves two barriers: the norms (G arrivals), then the router (2G).
// All blocks are resident at once (one per SM, checked with the occupancy API), and a PDL
// dependent launches only after every block has started, so the spin-waits cannot deadlock.
//
// Numerics: every row gets the one-token block's arithmetic (moe_block.cu), so a row's outputs
// are the same bits as launch_moe_block_decode gives that token alone, and the batched decode
// step is bit-identical to the one-sequence step: the norm is stage_norm_row's with the
// 256-thread element mapping (and the staged copies hold its bf16 values), the router logits
// RouterRows' (router_rows.cuh), the routing route_token_keys'; a gate/up row sums the same
// sixteen ranges of groups (each from zero, in ascending group order, acc + (s·D + b·Σx) with explicit roundings), then adds the sixteen
// partials in range order; act = bf16(silu(bf16(g))·bf16(u)); a down row sums every group in
// ascending order, out = bf16(Σ_s w_s·bf16(d_s)) in slot order.
// Batch invariance follows: a column's products never depend on the other columns (row r is
// the MMA's column r), and every sum runs in an order fixed by the shape.
#include <algorithm>
#include <string>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe_block.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/quant_mma.cuh"
#include "backends/cuda/router_rows.cuh"
#include "backends/cuda/router_topk.cuh"

namespace lily::cuda {
namespace {

using namespace moe;

constexpr int kMmaCols = 8;            // the MMA's N: the step's rows
constexpr int kQuadWarps = 4;                    // a gate/up tile's k-split: 4 warps
constexpr int kQuads = kBlockWarps / kQuadWarps;  // gate/up tiles in progress per block
constexpr int kMaxQuadStages = 2;                 // gate/up ring slots per quad
/// The one-token block's k-split of a gate/up tile is kBlockWarps group ranges; a quad's warp
/// sums kRangesPerWarp of them, each on its own.
constexpr int kRangesPerWarp = kBlockWarps / kQuadWarps;
/// Normed rows phase 2 stages at once: 2 up to kStageFourFrom − 1 rows, else 4. The larger
/// staging is taken only where it costs no co-residency: below 6 rows the block's shared memory
/// leaves room for a block of the next GEMV, and the 4-row staging would take it.
constexpr int kStageFourFrom = 6;
constexpr int kMaxStageRows = 4;
/// Phase 2's router split: kRouterRowWarps warps of a block hold distinct router rows, and each
/// row is held by kRouterTokenWarps warps, warp w computing the token rows ≡ w / kRouterRowWarps
/// (mod kRouterTokenWarps).
constexpr int kRouterRowWarps = 2;
constexpr int kRouterTokenWarps = kBlockWarps / kRouterRowWarps;
constexpr int kUsedWords = kMaxExperts / 32;  // the routed-expert bitmap
static_assert(kMaxMoeRows <= kMmaCols, "a step's rows are the MMA's columns");

/// Shapes and shared-memory offsets (bytes) of the kernel; host and device compute the same.
struct MoeLayout {
  int rows = 1;                    ///< the step's rows (tokens), 1 … kMaxMoeRows
  int hidden = 0, ffn = 0, n_sel = 0;
  int groups_h = 0, groups_f = 0;  ///< 64-groups per gate/up row, per down row
  int gu_per_slot = 0;             ///< gate/up tiles per expert: ffn / 8
  int gu_row_bytes = 0, dn_row_bytes = 0;  ///< a gate/up / down code row's bytes
  int dn_bytes = 0;                        ///< a down tile's bytes as copied (down_tile_bytes)
  int gu_stage = 0, dn_stage = 0;      ///< a gate/up / down tile's stage (codes padded)
  int max_distinct = 0;            ///< distinct experts of a step at most: min(rows·k, E) + 1
  int quad_stages = 0, dn_stages = 0;  ///< gate/up ring slots per quad; down stages (one per warp)
  int late_dn = 0;                     ///< down stages in the gate/up ring's tail (phase 4 only)
  int norm_rows = 2;                   ///< normed rows phase 2 stages at once (2 or kMaxStageRows)
  int64_t bars = 0, sel_ids = 0, sel_w = 0, list = 0, slot_of = 0, word_prefix = 0;
  int64_t gu_ring = 0, aperm = 0, asum = 0, late_ring = 0, dn_ring = 0, xperm = 0, xsums = 0, gu_part = 0, dn_part = 0;
  int64_t total = 0;
};

/// Floats between two rows' group sums in xsums: one more than the groups, so the rows 2t that
/// the four lanes t of a group's Σx load touch sit on different banks.
__host__ __device__ inline int xsum_pitch(int groups_h) { return groups_h + 1; }

/// Word of pair i (0 … hidden / 2 − 1) of row r in xperm, within the row: the 16-byte units of
/// odd rows are swapped in pairs (unit u at u xor 1), so the two rows g, g + 1 that a
/// quarter-warp's 16-byte B loads touch use different banks (rows are a multiple of 128 bytes
/// long, so unswizzled they would share them).
__host__ __device__ inline int xperm_word(int r, int i) { return i ^ ((r & 1) << 2); }

/// The layout for `rows` rows with quad_stages gate/up ring slots per quad and dn_stages down
/// stages (offsets only; moe_plan picks the slot counts).
__host__ __device__ inline MoeLayout moe_layout(int rows, int hidden, int ffn, int n_experts, int top_k, int quad_stages,
                                                int dn_stages) {
  MoeLayout l;
  l.rows = rows;
  l.hidden = hidden;
  l.ffn = ffn;
  l.n_sel = top_k + 1;
  l.groups_h = hidden / kGroup;
  l.groups_f = ffn / kGroup;
  l.gu_per_slot = ffn / kExpertRowsPerTile;
  l.gu_row_bytes = hidden / 2;
  l.dn_row_bytes = ffn / 2;
  l.dn_bytes = down_tile_bytes(ffn);
  l.gu_stage = gate_up_stage_bytes<true>(hidden);
  l.dn_stage = down_stage_bytes<true>(ffn);
  l.max_distinct = (rows * top_k < n_experts ? rows * top_k : n_experts) + 1;
  l.quad_stages = quad_stages;
  l.dn_stages = dn_stages;
  l.norm_rows = rows >= kStageFourFrom ? kMaxStageRows : 2;
  const int gu_stages = kQuads * quad_stages;
  const int pairs = rows * l.n_sel;  // (row, slot)
  // Once a block's gate/up tiles are done, the ring's tail past the act staging holds more down
  // stages (one per warp, up to a warp per distinct expert).
  const int64_t ring = int64_t{gu_stages} * l.gu_stage;
  const int64_t staging = align16(int64_t{pairs} * ffn / 2 * 4) + align16(int64_t{pairs} * l.groups_f * 4);
  const int64_t tail = ring - align16(staging);
  const int wanted = (l.max_distinct < kBlockWarps ? l.max_distinct : kBlockWarps) - dn_stages;
  l.late_dn = tail > 0 && wanted > 0 ? static_cast<int>(tail / l.dn_stage < wanted ? tail / l.dn_stage : wanted) : 0;
  int64_t o = 0;
  l.bars = o;
  o += align16(int64_t{gu_stages + dn_stages + l.late_dn} * 8);
  l.sel_ids = o;
  o += align16(int64_t{pairs} * 4);
  l.sel_w = o;
  o += align16(int64_t{pairs} * 4);
  l.list = o;
  o += align16(int64_t{l.max_distinct} * 4);
  l.slot_of = o;  // int8 [max_distinct][kMmaCols]: the slot of distinct expert d in row r, or −1
  o += align16(int64_t{l.max_distinct} * kMmaCols);
  l.word_prefix = o;
  o += align16(int64_t{kUsedWords} * 4);
  // The gate/up ring (phase 3) and the act staging and late down stages (phase 4) share memory.
  l.gu_ring = o;
  l.aperm = o;
  l.asum = o + align16(int64_t{pairs} * ffn / 2 * 4);
  l.late_ring = o + align16(staging);
  o += ring > staging ? ring : staging;
  l.dn_ring = o;
  o += int64_t{dn_stages} * l.dn_stage;
  l.xperm = o;
  o += align16(int64_t{rows} * hidden / 2 * 4);
  l.xsums = o;
  o += align16(int64_t{rows} * xsum_pitch(l.groups_h) * 4);
  // fp32 [quad][range][16 tile rows][rows]; before that (phase 2) the staging of norm_rows rows,
  // each xs [groups_h][kGroupStride], then its group sums [groups_h]; then (routing) every row's
  // logits, fp32 [rows][n_experts + 1]; after it (phase 4) the down partials dn_part, fp32
  // [(row, slot)][16 tile rows].
  l.gu_part = o;
  l.dn_part = o;
  const int64_t parts = int64_t{kQuads} * kBlockWarps * kTileRows * rows * 4;
  const int64_t row_staging = int64_t{l.norm_rows} * l.groups_h * (kGroupStride + 1) * 4;
  const int64_t logits = int64_t{rows} * (n_experts + 1) * 4;
  const int64_t down_parts = int64_t{pairs} * kTileRows * 4;
  o += align16(std::max({parts, row_staging, logits, down_parts}));
  l.total = o;
  return l;
}

/// The first expert row of gate/up tile j: rows 8·(j mod gu_per_slot) … of distinct expert
/// j / gu_per_slot (list: distinct expert → expert id).
__device__ __forceinline__ int64_t gate_up_row0(const MoeLayout& l, int j, const int32_t* list) {
  return int64_t{list[j / l.gu_per_slot]} * l.ffn + int64_t{j % l.gu_per_slot} * kExpertRowsPerTile;
}

/// One warp: requests the down tile of output rows 16·rt … + 16 of `expert` into `stage`,
/// counted on `bar` (one arrival): its 16 code rows, scales and biases (copy_down_item).
/// `reuse` as for request_gate_up_tile (here the readers are this warp).
__device__ __forceinline__ void request_down_tile(const MoeDecodeArgs& a, const MoeLayout& l, int rt, int expert,
                                                  unsigned char* stage, uint64_t* bar, bool reuse = false) {
  const int lane = threadIdx.x % kWarp;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(l.dn_bytes));
  __syncwarp();
  if (reuse) fence_proxy_async_shared();
  if (lane < kDownTileCopies<true>) copy_down_item<true>(a, int64_t{expert} * l.hidden + int64_t{rt} * kTileRows, lane, stage, bar);
}

/// One 64-group G of a 16-row tile against 8 columns: `col` is this thread's B column (g's
/// activation pairs in fragment order), `swap` 1 when its 16-byte units are swapped in pairs
/// (xperm_word), sum0 / sum1 the Σx of its output columns 2t and 2t + 1. acc[0], acc[1]: rows g
/// of columns 2t, 2t + 1; acc[2], acc[3]: rows g + 8. A column the caller does not use may hold
/// any row's values: an MMA's output column depends only on its own B column, so it changes no
/// other column's bits (and is never read), and no column is zeroed.
__device__ __forceinline__ void group_columns(const TileView& v, const uint32_t* col, int swap, int t, int G,
                                              float sum0, float sum1, float (&acc)[4]) {
  const uint4* bp = reinterpret_cast<const uint4*>(col + G * 32 + t * 8);
  const uint4 bw0 = bp[swap], bw1 = bp[swap ^ 1];
  float d[4];
  group_mma(*reinterpret_cast<const uint2*>(v.code_lo + G * 32), *reinterpret_cast<const uint2*>(v.code_hi + G * 32), bw0,
            bw1, d);
  const float s_lo = to_f32(v.s_lo[G]), b_lo = to_f32(v.b_lo[G]), s_hi = to_f32(v.s_hi[G]), b_hi = to_f32(v.b_hi[G]);
  acc[0] = affine_add(acc[0], s_lo, d[0], b_lo, sum0);
  acc[1] = affine_add(acc[1], s_lo, d[1], b_lo, sum1);
  acc[2] = affine_add(acc[2], s_hi, d[2], b_hi, sum0);
  acc[3] = affine_add(acc[3], s_hi, d[3], b_hi, sum1);
}

/// Stores one thread's MMA D fragment of a 16-row × m-column partial tile p [16][m] (acc: rows
/// g, g + 8 × columns 2t, 2t + 1; columns ≥ m dropped).
__device__ __forceinline__ void store_tile_partial(float* p, const float (&acc)[4], int g, int t, int m) {
  const int c0 = 2 * t, c1 = 2 * t + 1;
  if (c0 < m) {
    p[g * m + c0] = acc[0];
    p[(g + 8) * m + c0] = acc[2];
  }
  if (c1 < m) {
    p[g * m + c1] = acc[1];
    p[(g + 8) * m + c1] = acc[3];
  }
}

/// Phase 2's staging of normed rows 0 … nr − 1 of `normed` (bf16 [nr][cols], written by other
/// blocks of this launch before a grid barrier, so read through L2): row q as fp32 at
/// xs0 + q·stride ([groups][kGroupStride], then its group sums [groups], stage_group_sums'
/// arithmetic). The values are the bf16 normed values the norming block staged, so the staging
/// is the same bits as that block's own. All threads; ends with __syncthreads.
__device__ __forceinline__ void stage_normed_rows(const bf16* normed, int nr, int cols, float* xs0, int stride) {
  constexpr int kInFlight = 4;  // 16-byte loads per thread issued before any is used
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, groups = cols / kGroup;
  const int vecs = cols / 8, total = nr * vecs;
  const uint4* src = reinterpret_cast<const uint4*>(normed);
  for (int i0 = threadIdx.x; i0 < total; i0 += kInFlight * blockDim.x) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total) v[u] = __ldcg(src + i);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i >= total) continue;
      const int c = (i % vecs) * 8;
      float* dst = xs0 + (i / vecs) * stride + (c / kGroup) * kGroupStride + c % kGroup;
      const float4 lo = bf16x4_to_f32(v[u].x, v[u].y), hi = bf16x4_to_f32(v[u].z, v[u].w);
      dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
      dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
    }
  }
  __syncthreads();
  for (int p = warp; p < nr * groups; p += kBlockWarps) {  // warp-uniform
    const float* xg = xs0 + (p / groups) * stride + (p % groups) * kGroupStride;
    const float sum = group_sum_x(xg[lane], xg[lane + 32]);
    if (lane == 0) xs0[(p / groups) * stride + groups * kGroupStride + p % groups] = sum;
  }
  __syncthreads();
}

/// Barrier of the four warps of quad `quad` (named barrier 1 + quad, 128 threads).
__device__ __forceinline__ void quad_sync(int quad) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + quad), "r"(kQuadWarps * kWarp) : "memory");
}

/// grid: blocks ≤ one per SM (all resident), block kBlockThreads. See the file comment.
template <int RBITS>
__global__ void __launch_bounds__(kBlockThreads, 1) moe_rows_kernel(MoeDecodeArgs a, MoeLayout l) {
  extern __shared__ __align__(16) unsigned char sm[];
  __shared__ uint32_t used[kUsedWords];
  __shared__ int n_distinct_s;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int G = gridDim.x, b = blockIdx.x, m = l.rows, k = a.top_k, n_sel = l.n_sel, E = a.n_experts;
  const int n_rt = l.hidden / kTileRows;
  const int my_rt = b < n_rt ? (n_rt - 1 - b) / G + 1 : 0;  // row tiles b, b + G, …
  uint64_t* gu_full = reinterpret_cast<uint64_t*>(sm + l.bars);
  const int QS = l.quad_stages, gu_stages = kQuads * QS;
  const int quad = warp / kQuadWarps, wq = warp % kQuadWarps;
  uint64_t* dn_full = gu_full + gu_stages;
  int32_t* sel_ids = reinterpret_cast<int32_t*>(sm + l.sel_ids);  // [row][slot]
  float* sel_w = reinterpret_cast<float*>(sm + l.sel_w);
  int32_t* list = reinterpret_cast<int32_t*>(sm + l.list);        // distinct expert d → expert id
  int8_t* slot_of = reinterpret_cast<int8_t*>(sm + l.slot_of);    // [d][kMmaCols]
  int32_t* word_prefix = reinterpret_cast<int32_t*>(sm + l.word_prefix);
  unsigned char* gu_ring = sm + l.gu_ring;
  unsigned char* dn_ring = sm + l.dn_ring;
  const int n_dn = l.dn_stages + l.late_dn;  // down stages in phase 4: warp w < n_dn owns stage w
  auto dn_stage_of = [&](int w) {
    return w < l.dn_stages ? dn_ring + w * l.dn_stage : sm + l.late_ring + (w - l.dn_stages) * l.dn_stage;
  };
  const int half_h = l.hidden / 2, half_f = l.ffn / 2;

  trace_point(a, 0);
  if (threadIdx.x == 0) {
    for (int i = 0; i < gu_stages + l.dn_stages + l.late_dn; ++i) mbarrier_init(gu_full + i, 1);
    mbarrier_init_fence();
  }
  for (int i = threadIdx.x; i < l.max_distinct * kMmaCols; i += blockDim.x) slot_of[i] = -1;
  for (int i = threadIdx.x; i < kUsedWords; i += blockDim.x) used[i] = 0;
  __syncthreads();

  // 1. Weights whose addresses need no routing, before the wait (launch.cuh): the shared expert
  // is distinct expert 0, so gate/up tiles j < gu_per_slot and warp 0's first down item are its.
  // Quad q's n-th gate/up tile is the block's tile i = q + 4n (global j = b + i·G), in its
  // stage q·QS + n mod QS; the quad's first warp requests its tiles.
  // This block's share of the router rows, into registers (the one-token block's split).
  // Router row e goes to block e mod G, where the warps w ≡ e / G (mod kRouterRowWarps) all hold
  // it, each for its own token rows (below): a row's dot products for eight token rows run on
  // eight warps at once, and no block holds more rows than another.
  RouterRows<RBITS> router(a.router, int64_t{warp % kRouterRowWarps} * G + b, int64_t{G} * kRouterRowWarps);
  for (int n = 0; n < QS; ++n) {  // the quad's four warps share each tile's copies
    const int j = b + (quad + kQuads * n) * G;
    if (j < l.gu_per_slot)
      request_gate_up_part<true>(a, int64_t{E} * l.ffn + int64_t{j} * kExpertRowsPerTile,
                                 gu_ring + (quad * QS + n) * l.gu_stage, gu_full + quad * QS + n, wq, kQuadWarps);
  }
  if (warp == 0 && my_rt > 0) request_down_tile(a, l, b, E, dn_ring, dn_full);
  pdl_prologue();
  trace_point(a, 1);

  // 2. Block b norms rows b, b + G, … alone (the one-token block's stage_norm_row: the same bits) and
  // stores x_out and normed_out; after grid barrier 0 every block stages the m normed rows from
  // normed_out, their fragment-order copy and group sums for the gate/up phase, and its share of
  // every row's router logits; then grid barrier 1 (the same counter, its second round).
  uint32_t* xperm = reinterpret_cast<uint32_t*>(sm + l.xperm);  // [row][hidden / 2]
  float* xsums = reinterpret_cast<float*>(sm + l.xsums);         // [row][groups_h]
  float* xs = reinterpret_cast<float*>(sm + l.gu_part);  // l.norm_rows rows' staging
  const int stride = l.groups_h * (kGroupStride + 1);     // floats: a row's xs, then its group sums
  const bool router_in_regs = router.holds_all(a.router);
  bool router_fresh = true;  // the registers still hold the first group loaded before the wait
  for (int r = b; r < m; r += G) {  // row r on block r mod G
    const int64_t off = int64_t{r} * l.hidden;
    FusedNorm norm = a.norm;
    if (norm.branch) norm.branch += off;
    norm.x_out += off;
    norm.normed_out += off;
    stage_norm_row(a.x + off, norm, l.hidden, true, xs, xs + l.groups_h * kGroupStride, kNormThreads);
  }
  trace_point(a, 2);
  grid_sync(a.barriers, G);
  for (int r0 = 0; r0 < m; r0 += l.norm_rows) {
    const int nr = min(l.norm_rows, m - r0);
    stage_normed_rows(a.norm.normed_out + int64_t{r0} * l.hidden, nr, l.hidden, xs, stride);
    for (int q = 0; q < nr; ++q) {
      const int r = r0 + q;
      const float* xs_r = xs + q * stride;
      const float* xsum_r = xs_r + l.groups_h * kGroupStride;
      for (int i = threadIdx.x; i < half_h; i += blockDim.x) {
        const int c = fragment_pair_column(i);
        const float* xg = xs_r + (c / kGroup) * kGroupStride + c % kGroup;
        xperm[int64_t{r} * half_h + xperm_word(r, i)] = pack_bf16x2(xg[0], xg[4]);
      }
      for (int i = threadIdx.x; i < l.groups_h; i += blockDim.x) xsums[r * xsum_pitch(l.groups_h) + i] = xsum_r[i];
      if (r % kRouterTokenWarps == warp / kRouterRowWarps) {  // this warp's token rows
        router.compute(a.router, xs_r, xsum_r, a.logits + int64_t{r} * (E + 1), router_fresh || router_in_regs);
        router_fresh = false;
      }
    }
    __syncthreads();  // the staging is reused by the next rows
  }
  trace_point(a, 3);
  grid_sync(a.barriers, 2 * G);
  trace_point(a, 4);
  // Every row's logits into shared memory in one round trip (the row staging is free until the
  // gate/up partials use it, and the layout makes it large enough), then warp r routes row r.
#pragma unroll 4
  for (int i = threadIdx.x; i < m * (E + 1); i += blockDim.x) xs[i] = __ldcg(a.logits + i);
  __syncthreads();
  if (warp < m) {
    const float* logits = xs + warp * (E + 1);
    int32_t* ids = sel_ids + warp * n_sel;
    float* w = sel_w + warp * n_sel;
    if (E <= kWarp * kRouteKeysSmall) route_token_keys<kRouteKeysSmall, true>(logits, E, k, ids, w);
    else route_token_keys<kRouteKeysLarge, true>(logits, E, k, ids, w);
  }
  __syncthreads();
  // The distinct experts: 0 the shared one, then the routed ones in ascending id (a bitmap and
  // its prefix counts); slot_of[d][r] is the slot of expert d in row r.
  for (int i = threadIdx.x; i < m * k; i += blockDim.x) {
    const int e = sel_ids[(i / k) * n_sel + i % k];
    atomicOr(&used[e / 32], 1u << (e % 32));
  }
  __syncthreads();
  if (warp == 0) {
    const int c = __popc(used[lane]);
    int incl = c;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    word_prefix[lane] = incl - c;
    if (lane == kWarp - 1) n_distinct_s = incl + 1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < m * n_sel; i += blockDim.x) {
    const int r = i / n_sel, s = i % n_sel, e = sel_ids[i];
    const int d = s == k ? 0 : 1 + word_prefix[e / 32] + __popc(used[e / 32] & ((1u << (e % 32)) - 1u));
    list[d] = s == k ? E : e;  // rows that share an expert write the same value
    slot_of[d * kMmaCols + r] = static_cast<int8_t>(s);
    if (b == 0) {
      a.ids[i] = e;
      a.weights[i] = sel_w[i];
    }
  }
  __syncthreads();
  const int nd = n_distinct_s;
  const int n_gu = nd * l.gu_per_slot;
  const int my_gu = b < n_gu ? (n_gu - 1 - b) / G + 1 : 0;  // gate/up tiles b, b + G, …
  const int dn_items = my_rt * nd;                           // (row tile, distinct expert), flattened
  trace_point(a, 5);
  for (int n = 0; n < QS && quad + kQuads * n < my_gu; ++n) {
    const int j = b + (quad + kQuads * n) * G;
    if (j >= l.gu_per_slot)
      request_gate_up_part<true>(a, gate_up_row0(l, j, list), gu_ring + (quad * QS + n) * l.gu_stage,
                                 gu_full + quad * QS + n, wq, kQuadWarps);
  }
  if (warp > 0 && warp < l.dn_stages && warp < dn_items)
    request_down_tile(a, l, b + (warp / nd) * G, list[warp % nd], dn_ring + warp * l.dn_stage, dn_full + warp);
  trace_point(a, 6);

  // 3. Gate/up: the four quads work on four tiles at once; in a quad, warp w sums the one-token
  // block's group ranges 4w … 4w + 3 for every column, each from zero, and the sixteen partials
  // add up in range order. Column c of the MMA is row c for every tile (the last row past the
  // step's rows); only the columns whose row routed to the tile's expert are read.
  const int per_range = (l.groups_h + kBlockWarps - 1) / kBlockWarps;
  float* gu_part = reinterpret_cast<float*>(sm + l.gu_part) + quad * kBlockWarps * kTileRows * m;  // [range][16][m]
  const int qt = threadIdx.x % (kQuadWarps * kWarp);
  for (int n = 0, i = quad; i < my_gu; ++n, i += kQuads) {
    const int st = quad * QS + n % QS, j = b + i * G, d = j / l.gu_per_slot;
    mbarrier_wait(gu_full + st, (n / QS) & 1);
    const TileView v = tile_view<true>(gu_ring + st * l.gu_stage, l.gu_row_bytes, l.groups_h, g, t);
    const int xg = min(g, m - 1);
    const uint32_t* col = xperm + xg * half_h;
    const float* sum0 = xsums + min(2 * t, m - 1) * xsum_pitch(l.groups_h);
    const float* sum1 = xsums + min(2 * t + 1, m - 1) * xsum_pitch(l.groups_h);
    // The warp's ranges are independent sums, so their groups interleave (group `step` of every
    // range, then the next): four MMA chains in flight instead of one, and each range still
    // adds its own groups from zero in ascending order.
    float acc[kRangesPerWarp][4] = {};
    for (int step = 0; step < per_range; ++step) {
#pragma unroll
      for (int rg = 0; rg < kRangesPerWarp; ++rg) {
        const int range = wq * kRangesPerWarp + rg;
        const int Gi = range * per_range + step;
        if (Gi < l.groups_h) group_columns(v, col, xg & 1, t, Gi, sum0[Gi], sum1[Gi], acc[rg]);
      }
    }
#pragma unroll
    for (int rg = 0; rg < kRangesPerWarp; ++rg)
      store_tile_partial(gu_part + (wq * kRangesPerWarp + rg) * kTileRows * m, acc[rg], g, t, m);
    quad_sync(quad);  // the tile's partials are complete and its stage is free
    if (i + kQuads * QS < my_gu) {  // the refill, its copies shared by the quad's warps
      const int jn = j + kQuads * QS * G;
      request_gate_up_part<true>(a, gate_up_row0(l, jn, list), gu_ring + st * l.gu_stage, gu_full + st, wq, kQuadWarps,
                                 true);
    }
    if (qt < kExpertRowsPerTile * m) {
      const int row8 = qt / m, c = qt % m, s = slot_of[d * kMmaCols + c];
      if (s >= 0) {
        float gate = 0.0f, up = 0.0f;
        for (int range = 0; range < kBlockWarps; ++range) {
          gate = __fadd_rn(gate, gu_part[(range * kTileRows + row8) * m + c]);
          up = __fadd_rn(up, gu_part[(range * kTileRows + 8 + row8) * m + c]);
        }
        const int row = (j % l.gu_per_slot) * kExpertRowsPerTile + row8;
        a.act[(int64_t{c} * n_sel + s) * l.ffn + row] = to_bf16(__fmul_rn(silu(round_bf16(gate)), round_bf16(up)));
      }
    }
    quad_sync(quad);  // the partials are read before the quad's next tile overwrites them
  }
  trace_point(a, 7);
  // The ring's tail is free once every quad is done: the late down stages' first tiles.
  __syncthreads();
  if (warp >= l.dn_stages && warp < n_dn && warp < dn_items)
    request_down_tile(a, l, b + (warp / nd) * G, list[warp % nd], dn_stage_of(warp), dn_full + warp, true);
  trace_point(a, 8);
  grid_sync(a.barriers + 1, G);
  trace_point(a, 9);

  // 4. Down + combine: every (row, slot)'s act (written by other blocks: read through L2, 16
  // bytes a load), put in fragment order with its group sums; then warp w computes the distinct
  // experts w, w + S, … of each of the block's row tiles from its own stage, refilled as it goes.
  uint32_t* aperm = reinterpret_cast<uint32_t*>(sm + l.aperm);  // [(row, slot)][ffn / 2]
  float* asum = reinterpret_cast<float*>(sm + l.asum);          // [(row, slot)][groups_f]
  // The (row, slot) pairs are contiguous, so their act is one row of m · n_sel · ffn columns.
  stage_fragment_row<true>(a.act, m * n_sel * l.ffn, aperm, asum);
  __syncthreads();
  trace_point(a, 10);
  float* dn_part = reinterpret_cast<float*>(sm + l.dn_part);  // [(row, slot)][16 rows]
  int used_items = 0;  // this warp's items so far (its stage's phase parity)
  for (int i = 0; i < my_rt; ++i) {
    const int rt = b + i * G;
    if (warp < n_dn) {
      const int first = i * nd, start = first + ((warp - first) % n_dn + n_dn) % n_dn;
      for (int q = start; q < first + nd; q += n_dn, ++used_items) {
        const int d = q - first;
        mbarrier_wait(dn_full + warp, used_items & 1);
        const TileView v = tile_view<true>(dn_stage_of(warp), l.dn_row_bytes, l.groups_f, g, t);
        const int sg = g < m ? slot_of[d * kMmaCols + g] : -1;
        const uint32_t* col = aperm + (sg >= 0 ? (g * n_sel + sg) * half_f : 0);  // unused columns: any pair
        const int c0 = 2 * t, c1 = 2 * t + 1;
        const int s0 = c0 < m ? slot_of[d * kMmaCols + c0] : -1, s1 = c1 < m ? slot_of[d * kMmaCols + c1] : -1;
        const float* sum0 = asum + (s0 >= 0 ? (c0 * n_sel + s0) * l.groups_f : 0);
        const float* sum1 = asum + (s1 >= 0 ? (c1 * n_sel + s1) * l.groups_f : 0);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        // Unrolled so that the next groups' loads and MMAs issue while this one's finish (only
        // the affine adds are a chain; they stay in ascending group order).
#pragma unroll 4
        for (int Gi = 0; Gi < l.groups_f; ++Gi)
          group_columns(v, col, 0, t, Gi, sum0[Gi], sum1[Gi], acc);
        if (s0 >= 0) {
          dn_part[(c0 * n_sel + s0) * kTileRows + g] = round_bf16(acc[0]);
          dn_part[(c0 * n_sel + s0) * kTileRows + g + 8] = round_bf16(acc[2]);
        }
        if (s1 >= 0) {
          dn_part[(c1 * n_sel + s1) * kTileRows + g] = round_bf16(acc[1]);
          dn_part[(c1 * n_sel + s1) * kTileRows + g + 8] = round_bf16(acc[3]);
        }
        __syncwarp();  // every lane is done with the stage
        const int qn = q + n_dn;
        if (qn < dn_items) request_down_tile(a, l, b + (qn / nd) * G, list[qn % nd], dn_stage_of(warp),
                                             dn_full + warp, true);
      }
    }
    __syncthreads();
    if (threadIdx.x < m * kTileRows) {
      const int r = threadIdx.x / kTileRows, row = threadIdx.x % kTileRows;
      float o = 0.0f;
      for (int s = 0; s < n_sel; ++s)
        o = __fmaf_rn(sel_w[r * n_sel + s], dn_part[(r * n_sel + s) * kTileRows + row], o);
      a.out[int64_t{r} * l.hidden + int64_t{rt} * kTileRows + row] = to_bf16(o);
    }
    __syncthreads();  // dn_part is reused by the next row tile
  }
  trace_point(a, 11);
}


/// The launch of `a`, or why it cannot run (see moe_block_rows_unsupported). The ring slots: per quad
/// as many gate/up stages as it has tiles (≤ kMaxQuadStages), and a down stage per warp (≤ the
/// distinct experts); fewer where shared memory runs out: the down stages first, to 2 (in phase 4
/// the gate/up ring's tail holds more: MoeLayout::late_dn), then the gate/up ones, to 1 per quad.
/// Two gate/up tiles in flight per quad matter most: with one, each tile waits out a whole
/// memory round trip.
MoePlan<MoeLayout> moe_plan(const MoeDecodeArgs& a, int max_blocks) {
  MoePlan<MoeLayout> p;
  const int hidden = a.gate.cols, ffn = a.ffn, E = a.n_experts, k = a.top_k;
  auto no = [&](std::string why) {
    p.why = "fused MoE block (rows): " + why;
    return p;
  };
  if (a.rows < 1 || a.rows > kMaxMoeRows)
    return no(std::to_string(a.rows) + " rows (1 … " + std::to_string(kMaxMoeRows) + " supported)");
  if (std::string why = shape_problem(a); !why.empty()) return no(why);
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!aligned(a.x) || !aligned(a.norm.branch) || !aligned(a.norm.gain) || !aligned(a.norm.x_out) ||
      !aligned(a.norm.normed_out) || !aligned(a.router.codes))
    return no("the residual, branch, gain, x_out, normed_out and router codes must be 16-byte aligned");
  p.blocks = plan_blocks(max_blocks);
  const int max_distinct = std::min(a.rows * k, E) + 1;
  const int gu_tiles = static_cast<int>(ceil_div(int64_t{max_distinct} * (ffn / kExpertRowsPerTile), p.blocks));
  int qs = static_cast<int>(std::min<int64_t>(ceil_div(gu_tiles, kQuads), kMaxQuadStages));
  int dn = std::min(kBlockWarps, max_distinct);
  p.layout = moe_layout(a.rows, hidden, ffn, E, k, qs, dn);
  while (p.layout.total > kSmemLimit && (qs > 1 || dn > 2)) {
    if (dn > 2) --dn;
    else --qs;
    p.layout = moe_layout(a.rows, hidden, ffn, E, k, qs, dn);
  }
  p.kernel = a.router.bits == 8 ? moe_rows_kernel<8> : moe_rows_kernel<4>;
  if (std::string why = fit_problem(p.kernel, p.layout.total); !why.empty()) return no(why);
  return p;
}

}  // namespace

std::string moe_block_rows_unsupported(const MoeDecodeArgs& args, int max_blocks) {
  return moe_plan(args, max_blocks).why;
}

void launch_moe_block_rows(const MoeDecodeArgs& a, cudaStream_t stream, int max_blocks) {
  launch_plan(moe_plan(a, max_blocks), a, stream, "launch_moe_block_rows");
}

}  // namespace lily::cuda
