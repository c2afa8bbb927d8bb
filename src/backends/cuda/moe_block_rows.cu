// The decode MoE block of the 1 … 64 rows of a batched decode step in one launch (docs/model.md
// §3.5, §4.3 item 5): the post-mixer add + RMSNorm, the router GEMV and top-k, the gate/up
// projections with SwiGLU over the routed experts and the shared one, the down projections and
// the weighted combine. The tokens are the rows of one decode step (one per sequence); each
// row's result is bit-identical whatever the other rows are (batch invariance, below).
//
// Why one launch: as three kernels (router, gate/up, down) each decode layer pays two more
// kernel boundaries, and each kernel's weights can only start streaming once it runs. Here
// every block is resident for the whole block (one block per SM), so the work after a
// grid-wide dependency waits on a counter instead of a launch, and the weights are requested as
// early as their addresses are known:
//  1. before the PDL wait: the block's share of the router rows into registers and its first
//     tiles of the shared expert (gate/up and down), whose addresses do not depend on the routing;
//  2. after the wait: the (token row, router part) units are spread over the blocks (S parts
//     per row, as many as the grid gives each row, router_splits); a unit norms its row alone
//     (the one-token block's norm; part 0 stores x_out, normed_out, the normed row's group sums
//     and the normed row in fragment order, normed_frag) and computes its part of the row's
//     router logits (the one-token block's CUDA-core router rows, held in registers from before
//     the wait); grid barrier 0;
//  3. every block loads the group sums and the logits (one round trip per 32 rows), warp w
//     routes rows w, w + 16, … (route_token_keys); or, from moe_route_once_from_rows() rows on,
//     each row is routed once (by one warp of one block, into the ids and weights in global
//     memory), a third grid barrier, and every block loads the step's routing. Every block then
//     lists the distinct experts of the step (the shared one
//     first, then the routed ones in ascending id) and their column blocks: expert d's (row,
//     slot) pairs in row order, eight at a time (the MMA's N), so an expert routed from n rows
//     is ⌈n / 8⌉ column blocks and the shared expert ⌈rows / 8⌉;
//  4. gate/up on tensor cores (quant_mma.cuh): a tile is 8 rows of one expert (16 MMA rows: the
//     8 gate rows and the same 8 up rows) against one column block, so each expert's weights are
//     read once for every row routed to it (once per column block of eight). Four quads of four
//     warps work on four tiles at once, each quad through its own ring slots and named barrier;
//     a warp sums four of the one-token block's sixteen group ranges, each on its own; the
//     activations come from normed_frag (global memory, already in fragment order: no
//     permutation per tile and group, which had been 5 % of the kernel's instructions at 64
//     rows); SwiGLU, act and its 8-column unit sums to global memory, grid barrier 1;
//  5. down + combine: a block owns 16 output rows; warp w walks the column blocks w, w + W, …
//     through two shared-memory stages of its own (a few requested after the routing, the rest
//     in the gate/up ring's tail once the block's gate/up tiles are done), the act read from
//     global memory, its group sums formed from the unit sums; the block combines each row's
//     slots in slot order.
// The shared expert's gate/up tiles are dealt round-robin over the blocks (known before the
// routing), the routed ones in contiguous chunks (of equal tile counts, or from
// kMoeTileBalanceFromRows rows on of equal cost: moe_tile_balance), so a block's quads work on
// neighbouring tiles of one column block and its activation columns stay in L1 for all of them;
// or, from moe_tile_claims_from_rows() rows on (off by default), claimed by the quads two at a
// time from a counter as they go (MoeDecodeArgs::tile_claims: no block waits for another at
// barrier 2, but the quads' tiles no longer share their columns). A
// tile's code rows are staged padded (moe_block.cuh: no bank conflicts on the fragment loads),
// twenty bulk copies that the quad's four warps share. The ring slots and the down stages are sized
// from the row count at launch (moe_layout). Nothing per row lives in shared memory but the routing
// and the group sums, so 64 rows fit beside a ring of eight gate/up tiles (the router logits are
// staged 32 rows at a time).
//
// Grid barriers are counters in global memory that the caller zeroes before every launch (a
// memset node at the start of the decode graph), so a replay never depends on the last one.
// All blocks are resident at once (one per SM, checked with the occupancy API), and a PDL
// dependent launches only after every block has started, so the spin-waits cannot deadlock.
//
// Numerics: every row gets the one-token block's arithmetic (moe_block.cu), so a row's outputs
// are the same bits as launch_moe_block_decode gives that token alone, and the batched decode
// step is bit-identical to the one-sequence step: the norm is stage_norm_row's with the
// 256-thread element mapping, the router logits RouterRows' (router_rows.cuh: a logit's
// arithmetic does not depend on which warp computes it), the routing route_token_keys'; a
// gate/up row sums the same sixteen ranges of groups (each from zero, in ascending group
// order, acc + (s·D + b·Σx) with explicit roundings), then adds the sixteen partials in range
// order; act = bf16(silu(bf16(g))·bf16(u)); the act group sums are stage_fragment_row's (each
// 16-byte unit ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), then the eight units in its
// shuffle order); a down row sums every group in ascending order, out = bf16(Σ_s w_s·bf16(d_s))
// in slot order.
// Batch invariance follows: an MMA's output column depends only on its own B column (a pair's
// products never depend on the other pairs of its column block, or on which column it is), and
// every sum runs in an order fixed by the shape.
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

constexpr int kMmaCols = 8;                       // the MMA's N: up to 8 (row, slot) pairs of one expert
constexpr int kQuadWarps = 4;                     // a gate/up tile's k-split: 4 warps
constexpr int kQuads = kBlockWarps / kQuadWarps;  // gate/up tiles in progress per block
constexpr int kMaxQuadStages = 2;                 // gate/up ring slots per quad
/// The one-token block's k-split of a gate/up tile is kBlockWarps group ranges; a quad's warp
/// sums kRangesPerWarp of them, each on its own.
constexpr int kRangesPerWarp = kBlockWarps / kQuadWarps;
/// Down stages per warp in phase 4 at most (two: one is computed while the next arrives).
constexpr int kMaxDownStagesPerWarp = 2;
constexpr int kUsedWords = kMaxExperts / 32;  // the routed-expert bitmap
/// Units of 8 act columns (16 bytes) whose sums a gate/up tile writes: one per tile.
static_assert(kExpertRowsPerTile == 8, "a gate/up tile's act is one 16-byte unit of each column");
using RowMask = unsigned long long;  // the rows routed to a distinct expert, a bit each
static_assert(kMaxMoeRows <= 64, "the rows routed to an expert are a 64-bit mask");
/// Routed gate/up tiles a quad claims at once when the tiles are claimed (MoeLayout::claims):
/// two neighbouring tiles, mostly of one column block, so the second finds its activation
/// columns in L1; a claim is one atomic on the launch's counter.
constexpr int kClaimTiles = 2;
static_assert(kClaimTiles >= kMaxQuadStages, "a quad's first requests need one claim at most");
/// Rows whose router logits the routing stages in shared memory at once (the logits of 64 rows
/// would crowd out the gate/up ring's second slot per quad); more rows route in several passes.
constexpr int kRouteRowsPerPass = 32;

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
  int max_items = 0;               ///< column blocks of a step at most (below)
  int quad_stages = 0, dn_stages = 0;  ///< gate/up ring slots per quad; early down stages (≤ one per warp)
  int late_dn = 0;                     ///< down stages in the gate/up ring's tail (phase 4 only)
  int balance = 0;                     ///< moe_tile_balance() at planning (routed_tile_bounds)
  bool route_once = false;             ///< each row routed by one block (moe_route_once_from_rows)
  /// The routed gate/up tiles claimed by the quads as they go (moe_tile_claims_from_rows, on
  /// MoeDecodeArgs::tile_claims) instead of split over the blocks before phase 3.
  bool claims = false;
  /// With claims: the per cent of the routed tiles split over the blocks in equal contiguous
  /// shares first (neighbouring tiles, their columns shared in L1), the rest claimed
  /// (moe_tile_claims_fixed_percent); 0: every routed tile claimed.
  int claims_fixed = 0;
  int64_t bars = 0, sel_ids = 0, sel_w = 0, list = 0, rows_of = 0, pair_start = 0, item_start = 0, item_expert = 0,
          item_span = 0, pair_d = 0, pairs_of = 0, word_prefix = 0;
  int64_t gu_ring = 0, asum = 0, late_ring = 0, dn_ring = 0, xsums = 0, gu_part = 0, dn_part = 0;
  int64_t total = 0;
};

/// Floats between two rows' group sums in xsums: one more than the groups, so the rows that the
/// four lanes t of a group's Σx load touch sit on different banks.
__host__ __device__ inline int xsum_pitch(int groups_h) { return groups_h + 1; }

/// The layout for `rows` rows with quad_stages gate/up ring slots per quad and dn_stages down
/// stages (offsets only; moe_plan picks the slot counts).
__host__ __device__ inline MoeLayout moe_layout(int rows, int hidden, int ffn, int n_experts, int top_k, int quad_stages,
                                                int dn_stages) {
  MoeLayout l;
  l.rows = rows;
  l.hidden = hidden;
  l.ffn = ffn;
  l.n_sel = routed_plus_shared_slots(top_k);
  l.groups_h = hidden / kGroup;
  l.groups_f = ffn / kGroup;
  l.gu_per_slot = ffn / kExpertRowsPerTile;
  l.gu_row_bytes = hidden / 2;
  l.dn_row_bytes = ffn / 2;
  l.dn_bytes = down_tile_bytes(ffn);
  l.gu_stage = gate_up_stage_bytes<true>(hidden);
  l.dn_stage = down_stage_bytes<true>(ffn);
  l.max_distinct = (rows * top_k < n_experts ? rows * top_k : n_experts) + 1;
  const int pairs = rows * l.n_sel;  // (row, slot)
  // An expert's pairs split into blocks of kMmaCols: Σ ⌈n_d / 8⌉ ≤ distinct + pairs / 8.
  l.max_items = l.max_distinct + (pairs + kMmaCols - 1) / kMmaCols;
  l.quad_stages = quad_stages;
  l.dn_stages = dn_stages;
  const int gu_stages = kQuads * quad_stages;
  // Once a block's gate/up tiles are done, the ring's head holds the act group sums of phase 4
  // and its tail more down stages (up to two per warp, at most one per column block).
  const int64_t ring = int64_t{gu_stages} * l.gu_stage;
  const int64_t staging = align16(int64_t{pairs} * l.groups_f * 4);
  const int64_t tail = ring - staging;
  const int most = kMaxDownStagesPerWarp * kBlockWarps;
  const int wanted = (l.max_items < most ? l.max_items : most) - dn_stages;
  l.late_dn = tail > 0 && wanted > 0 ? static_cast<int>(tail / l.dn_stage < wanted ? tail / l.dn_stage : wanted) : 0;
  int64_t o = 0;
  l.bars = o;
  o += align16(int64_t{gu_stages + dn_stages + l.late_dn} * 8);
  l.sel_ids = o;
  o += align16(int64_t{pairs} * 4);
  l.sel_w = o;
  o += align16(int64_t{pairs} * 4);
  l.list = o;  // int32 [max_distinct]: distinct expert d → expert id
  o += align16(int64_t{l.max_distinct} * 4);
  l.rows_of = o;  // RowMask [max_distinct]: the rows routed to d, a bit each
  o += align16(int64_t{l.max_distinct} * 8);
  l.pair_start = o;  // int32 [max_distinct]: d's first entry in pairs_of
  o += align16(int64_t{l.max_distinct} * 4);
  l.item_start = o;  // int32 [max_distinct]: d's first column block
  o += align16(int64_t{l.max_distinct} * 4);
  l.item_expert = o;  // int32 [max_items]: a column block's expert id
  o += align16(int64_t{l.max_items} * 4);
  l.item_span = o;  // int32 [max_items]: its first entry in pairs_of · 256 + its columns (1 … 8)
  o += align16(int64_t{l.max_items} * 4);
  l.pair_d = o;  // int16 [pairs]: a (row, slot) pair's distinct expert
  o += align16(int64_t{pairs} * 2);
  l.pairs_of = o;  // int16 [pairs]: the pairs grouped by distinct expert, in row order
  o += align16(int64_t{pairs} * 2);
  l.word_prefix = o;
  o += align16(int64_t{kUsedWords} * 4);
  // The gate/up ring (phase 3) and the act group sums and late down stages (phase 4) share memory.
  l.gu_ring = o;
  l.asum = o;
  l.late_ring = o + staging;
  o += ring > staging ? ring : staging;
  l.dn_ring = o;
  o += int64_t{dn_stages} * l.dn_stage;
  l.xsums = o;
  o += align16(int64_t{rows} * xsum_pitch(l.groups_h) * 4);
  // fp32 [quad][range][16 tile rows][kMmaCols]; before that (phase 2) the staging of the normed
  // row, xs [groups_h][kGroupStride], then its group sums [groups_h]; then (routing) the logits
  // of up to kRouteRowsPerPass rows, fp32 [rows][n_experts + 1]; after it (phase 4) the down
  // partials dn_part, fp32 [(row, slot)][16 tile rows].
  l.gu_part = o;
  l.dn_part = o;
  const int64_t parts = int64_t{kQuads} * kBlockWarps * kTileRows * kMmaCols * 4;
  const int64_t row_staging = int64_t{l.groups_h} * (kGroupStride + 1) * 4;
  const int64_t logits = int64_t{rows < kRouteRowsPerPass ? rows : kRouteRowsPerPass} * routed_plus_shared_experts(n_experts) * 4;
  const int64_t down_parts = int64_t{pairs} * kTileRows * 4;
  o += align16(std::max({parts, row_staging, logits, down_parts}));
  l.total = o;
  return l;
}

/// The first expert row of gate/up tile j: rows 8·(j mod gu_per_slot) … of the expert of column
/// block j / gu_per_slot (item_expert: column block → expert id).
__device__ __forceinline__ int64_t gate_up_row0(const MoeLayout& l, int j, const int32_t* item_expert) {
  return int64_t{item_expert[j / l.gu_per_slot]} * l.ffn + int64_t{j % l.gu_per_slot} * kExpertRowsPerTile;
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

/// One 64-group G of a 16-row tile against 8 columns: `col` is this thread's 32 bytes of group 0
/// of its B column (bf16, written by other blocks of this launch before a grid barrier, whose
/// acquire makes them visible; in natural order, put in fragment order here, or with kFragOrder
/// already in it), sum0 / sum1 the Σx of its output columns 2t and 2t + 1. kL1: the loads may
/// hit in L1 (columns that the block reads again soon), else they go to L2. acc[0], acc[1]:
/// rows g of columns 2t, 2t + 1; acc[2], acc[3]: rows g + 8. A column
/// the caller does not use may hold any pair's values: an MMA's output column depends only on
/// its own B column, so it changes no other column's bits (and is never read), and no column is
/// zeroed.
template <bool kL1, bool kFragOrder = false>
__device__ __forceinline__ void group_columns(const TileView& v, const uint4* col, int G, float sum0, float sum1,
                                              float (&acc)[4]) {
  const uint4 w0 = kL1 ? col[G * 8] : __ldcg(col + G * 8), w1 = kL1 ? col[G * 8 + 1] : __ldcg(col + G * 8 + 1);
  const uint4 bw0 = kFragOrder ? w0 : fragment_order(w0), bw1 = kFragOrder ? w1 : fragment_order(w1);
  float d[4];
  group_mma(*reinterpret_cast<const uint2*>(v.code_lo + G * 32), *reinterpret_cast<const uint2*>(v.code_hi + G * 32), bw0,
            bw1, d);
  const float s_lo = to_f32(v.s_lo[G]), b_lo = to_f32(v.b_lo[G]), s_hi = to_f32(v.s_hi[G]), b_hi = to_f32(v.b_hi[G]);
  acc[0] = affine_add(acc[0], s_lo, d[0], b_lo, sum0);
  acc[1] = affine_add(acc[1], s_lo, d[1], b_lo, sum1);
  acc[2] = affine_add(acc[2], s_hi, d[2], b_hi, sum0);
  acc[3] = affine_add(acc[3], s_hi, d[3], b_hi, sum1);
}

/// Stores one thread's MMA D fragment of a 16-row × 8-column partial tile p [16][8] (acc: rows
/// g, g + 8 × columns 2t, 2t + 1).
__device__ __forceinline__ void store_tile_partial(float* p, const float (&acc)[4], int g, int t) {
  const int c0 = 2 * t, c1 = 2 * t + 1;
  p[g * kMmaCols + c0] = acc[0];
  p[(g + 8) * kMmaCols + c0] = acc[2];
  p[g * kMmaCols + c1] = acc[1];
  p[(g + 8) * kMmaCols + c1] = acc[3];
}

/// Barrier of the four warps of quad `quad` (named barrier 1 + quad, 128 threads).
__device__ __forceinline__ void quad_sync(int quad) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + quad), "r"(kQuadWarps * kWarp) : "memory");
}

/// A column block's pair at column c: its pairs_of entries first … first + n − 1, c clamped to
/// n − 1 (an unused column takes the last pair's values).
__device__ __forceinline__ int block_pair(const int16_t* pairs_of, int span, int c) {
  const int n = span & 0xff;
  return pairs_of[(span >> 8) + (c < n ? c : n - 1)];
}

/// Parts phase 2 splits each token row's router logits into: as many as G blocks give every row
/// (at least 1), and no more than give each warp a router row (E + 1 rows).
__host__ __device__ inline int router_splits(int rows, int blocks, int n_experts) {
  const int most = (routed_plus_shared_experts(n_experts) + kBlockWarps - 1) / kBlockWarps;
  const int fit = blocks / rows;
  return fit < 1 ? 1 : (fit < most ? fit : most);
}

/// Warp 0 of a block: the first routed gate/up tile of each of blocks b and b + 1 when the routed
/// tiles are split over G blocks by cost, a tile of column block i costing w + its live columns
/// (item_span's low byte), in every lane: {first, end}. Not inlined, so that the kernel's
/// registers stay those of the equal split (which needs none of this). Routed tile r (0 … n_routed − 1)
/// is tile r mod tiles_per_item of column block shared_items + r / tiles_per_item. A block's
/// share starts at the first tile whose cost prefix reaches b·C / G (C the total), so the shares
/// of blocks 0 … G − 1 are disjoint, in order, and cover every routed tile; every block computes
/// the same bounds from the same routing.
__device__ __noinline__ longlong2 routed_tile_bounds(const int32_t* item_span, int shared_items, int n_items,
                                                    int tiles_per_item, int w, int b, int G) {
  const int lane = threadIdx.x % kWarp;
  const int n = n_items - shared_items;  // routed column blocks
  const int per = (n + kWarp - 1) / kWarp, i0 = min(lane * per, n), i1 = min(i0 + per, n);
  auto cost = [&](int i) { return int64_t{w + (item_span[shared_items + i] & 0xff)}; };  // per tile
  int64_t mine = 0;
  for (int i = i0; i < i1; ++i) mine += cost(i) * tiles_per_item;
  int64_t prefix = mine;  // inclusive scan over the lanes
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int64_t v = __shfl_up_sync(0xffffffffu, prefix, o);
    if (lane >= o) prefix += v;
  }
  const int64_t total = __shfl_sync(0xffffffffu, prefix, kWarp - 1);
  prefix -= mine;  // this lane's first column block's cost prefix
  auto bound = [&](int64_t target) {
    // The smallest routed tile whose cost prefix is ≥ target: in the first column block whose
    // last tile's prefix reaches it (the lowest lane holding one), else n_routed.
    int64_t r = int64_t{n} * tiles_per_item, p = prefix;
    bool hit = false;
    for (int i = i0; i < i1 && !hit; ++i) {
      const int64_t c = cost(i);
      if (p + (tiles_per_item - 1) * c >= target) {
        const int64_t k = target <= p ? 0 : (target - p + c - 1) / c;
        r = int64_t{i} * tiles_per_item + k;
        hit = true;
      }
      p += c * tiles_per_item;
    }
    const uint32_t hits = __ballot_sync(0xffffffffu, hit);
    return hits ? __shfl_sync(0xffffffffu, r, __ffs(hits) - 1) : int64_t{n} * tiles_per_item;
  };
  const int64_t first = bound(int64_t{b} * total / G);
  const int64_t end = b + 1 == G ? int64_t{n} * tiles_per_item : bound(int64_t{b + 1} * total / G);
  return make_longlong2(first, end);
}

/// grid: blocks ≤ one per SM (all resident), block kBlockThreads. See the file comment.
template <int RBITS>
__global__ void __launch_bounds__(kBlockThreads, 1) moe_rows_kernel(MoeDecodeArgs a, MoeLayout l) {
  extern __shared__ __align__(16) unsigned char sm[];
  __shared__ uint32_t used[kUsedWords];
  __shared__ int n_distinct_s, n_items_s;
  __shared__ int64_t routed_first_s, routed_end_s;
  __shared__ int claim_s[kQuads];  // each quad's latest claim (its first routed tile)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int G = gridDim.x, b = blockIdx.x, m = l.rows, k = a.top_k, n_sel = l.n_sel, E = a.n_experts;
  const int pairs = m * n_sel;
  const int n_rt = l.hidden / kTileRows;
  const int my_rt = b < n_rt ? (n_rt - 1 - b) / G + 1 : 0;  // row tiles b, b + G, …
  uint64_t* gu_full = reinterpret_cast<uint64_t*>(sm + l.bars);
  const int QS = l.quad_stages, gu_stages = kQuads * QS;
  const int quad = warp / kQuadWarps, wq = warp % kQuadWarps;
  uint64_t* dn_full = gu_full + gu_stages;
  int32_t* sel_ids = reinterpret_cast<int32_t*>(sm + l.sel_ids);  // [row][slot]
  float* sel_w = reinterpret_cast<float*>(sm + l.sel_w);
  int32_t* list = reinterpret_cast<int32_t*>(sm + l.list);
  RowMask* rows_of = reinterpret_cast<RowMask*>(sm + l.rows_of);
  int32_t* pair_start = reinterpret_cast<int32_t*>(sm + l.pair_start);
  int32_t* item_start = reinterpret_cast<int32_t*>(sm + l.item_start);
  int32_t* item_expert = reinterpret_cast<int32_t*>(sm + l.item_expert);
  int32_t* item_span = reinterpret_cast<int32_t*>(sm + l.item_span);
  int16_t* pair_d = reinterpret_cast<int16_t*>(sm + l.pair_d);
  int16_t* pairs_of = reinterpret_cast<int16_t*>(sm + l.pairs_of);
  int32_t* word_prefix = reinterpret_cast<int32_t*>(sm + l.word_prefix);
  unsigned char* gu_ring = sm + l.gu_ring;
  unsigned char* dn_ring = sm + l.dn_ring;
  const int n_dn = l.dn_stages + l.late_dn;  // down stages in phase 4 (owned by the warps < dn_warps, below)
  auto dn_stage_of = [&](int w) {
    return w < l.dn_stages ? dn_ring + w * l.dn_stage : sm + l.late_ring + (w - l.dn_stages) * l.dn_stage;
  };
  // The shared expert is distinct expert 0 and its column blocks are the first ones (every row
  // routes to it), so its gate/up tiles j < shared_tiles are known before the routing.
  const int shared_tiles = (m + kMmaCols - 1) / kMmaCols * l.gu_per_slot;

  trace_point(a, 0);
  if (threadIdx.x == 0) {
    for (int i = 0; i < gu_stages + l.dn_stages + l.late_dn; ++i) mbarrier_init(gu_full + i, 1);
    mbarrier_init_fence();
  }
  for (int i = threadIdx.x; i < l.max_distinct; i += blockDim.x) rows_of[i] = 0;
  for (int i = threadIdx.x; i < kUsedWords; i += blockDim.x) used[i] = 0;
  __syncthreads();

  // Gate/up tiles: the shared expert's (j < shared_tiles) round-robin over the blocks (block b
  // takes b, b + G, …, known before the routing), then the routed ones in contiguous chunks, so
  // the quads of a block work on neighbouring tiles of the same column block and its activation
  // columns are read once into L1 for all of them. Quad q takes the block's tiles q, q + 4, …,
  // its n-th in stage q·QS + n mod QS; the quad's warps share each tile's copies.
  const int my_shared = b < shared_tiles ? (shared_tiles - 1 - b) / G + 1 : 0;
  int64_t chunk0 = 0;  // the block's first routed tile, set once the routing is known
  auto tile_of = [&](int i) {
    return i < my_shared ? b + i * G : shared_tiles + static_cast<int>(chunk0) + (i - my_shared);
  };
  // With claims (MoeLayout::claims) a quad takes its shared-expert tiles as above, then claims
  // the routed ones kClaimTiles at a time from the launch's counter as it goes (a quad that
  // finds its tiles quicker takes more), so no block waits at grid barrier 2 on another whose
  // share of the tiles took longer. Which block computes a tile never changes its bits.
  const int quad_shared = my_shared > quad ? (my_shared - 1 - quad) / kQuads + 1 : 0;  // the quad's shared tiles

  // 1. Weights whose addresses need no routing, before the wait (launch.cuh): the block's first
  // shared-expert gate/up tiles and warp 0's first down item; and this block's router rows.
  // Phase 2 splits the (token row, router rows) work into S = router_splits(m, G) parts: unit
  // u = b, b + G, … < S·m is token row u mod m with part u / m, whose 16 warps take the router
  // rows ≡ their index (mod 16·S) (RouterRows: each logit is the stand-alone GEMV's arithmetic
  // whoever computes it).
  const int S = router_splits(m, G, E);
  const int part = S > 1 ? b / m : 0;  // S > 1: S·m ≤ G, one unit per block at most
  RouterRows<RBITS> router(a.router, b < S * m ? int64_t{part} * kBlockWarps + warp : int64_t{routed_plus_shared_experts(E)},
                           int64_t{S} * kBlockWarps);
  for (int n = 0; n < QS; ++n) {
    const int i = quad + kQuads * n;
    if (i < my_shared)
      request_gate_up_part<true>(a, int64_t{E} * l.ffn + int64_t{tile_of(i) % l.gu_per_slot} * kExpertRowsPerTile,
                                 gu_ring + (quad * QS + n) * l.gu_stage, gu_full + quad * QS + n, wq, kQuadWarps);
  }
  if (warp == 0 && my_rt > 0) request_down_tile(a, l, b, E, dn_ring, dn_full);
  pdl_prologue();
  trace_point(a, 1);

  // 2. Unit u (above) norms token row r = u mod m alone (the one-token block's stage_norm_row:
  // the same bits; part 0 stores x_out, normed_out and the row's group sums) and computes its
  // part of the row's router logits; then grid barrier 0.
  float* xsums = reinterpret_cast<float*>(sm + l.xsums);  // [row][xsum_pitch]
  float* xs = reinterpret_cast<float*>(sm + l.gu_part);    // the normed row's staging
  const bool router_in_regs = router.holds_all(a.router);
  bool router_fresh = true;  // the registers still hold the first group loaded before the wait
  for (int u = b; u < S * m; u += G) {
    const int r = u % m;
    const bool store = u < m;
    const int64_t off = int64_t{r} * l.hidden;
    FusedNorm norm = a.norm;
    if (norm.branch) norm.branch += off;
    norm.x_out += off;
    norm.normed_out += off;
    float* xsum = xs + l.groups_h * kGroupStride;
    stage_norm_row(a.x + off, norm, l.hidden, store, xs, xsum, kNormThreads);
    if (store) {
      for (int i = threadIdx.x; i < l.groups_h; i += blockDim.x) a.normed_sums[int64_t{r} * l.groups_h + i] = xsum[i];
      pack_fragment_pairs(xs, l.hidden, reinterpret_cast<uint32_t*>(a.normed_frag + off));
    }
    router.compute(a.router, xs, xsum, a.logits + int64_t{r} * routed_plus_shared_experts(E), router_fresh || router_in_regs);
    router_fresh = false;
    __syncthreads();  // the staging is reused by the next unit
  }
  trace_point(a, 2);
  trace_point(a, 3);
  grid_sync(a.barriers, G);
  trace_point(a, 4);
  // The first claim of each quad whose first QS tiles reach the routed ones, its round trip under
  // the routing (kept in a register until the column blocks are listed; the counter was zeroed
  // before the launch).
  const bool first_claim = l.claims && l.claims_fixed == 0 && wq == 0 && lane == 0 && quad_shared < QS;
  const int first_claimed = first_claim ? static_cast<int>(atomicAdd(a.tile_claims, kClaimTiles)) : 0;
  // The normed rows' group sums, and the logits of kRouteRowsPerPass rows at a time into shared
  // memory, each pass in one round trip (the row staging is free until the gate/up partials use
  // it, and the layout makes it large enough); warp w routes the pass's rows w, w + 16, ….
  for (int i = threadIdx.x; i < m * l.groups_h; i += blockDim.x)
    xsums[(i / l.groups_h) * xsum_pitch(l.groups_h) + i % l.groups_h] = __ldcg(a.normed_sums + i);
  if (l.route_once) {
    // Each row routed once, by warp j of block r mod G for row r = b + j·G, straight from the
    // logits in L2 into a.ids / a.weights; a third grid barrier; then every block reads the
    // step's routing (m·(k + 1) ids and weights) instead of routing every row itself.
    for (int r = b + warp * G; r < m; r += kBlockWarps * G) {
      const float* logits = a.logits + int64_t{r} * routed_plus_shared_experts(E);
      if (E <= kWarp * kRouteKeysSmall) route_token_keys<kRouteKeysSmall>(logits, E, k, a.ids + r * n_sel, a.weights + r * n_sel);
      else route_token_keys<kRouteKeysLarge>(logits, E, k, a.ids + r * n_sel, a.weights + r * n_sel);
    }
    trace_point(a, kMoeTraceRouted);
    grid_sync(a.barriers + 2, G);
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
      sel_ids[i] = __ldcg(a.ids + i);
      sel_w[i] = __ldcg(a.weights + i);
    }
    __syncthreads();
  }
  for (int r0 = 0; r0 < (l.route_once ? 0 : m); r0 += kRouteRowsPerPass) {
    const int n = min(kRouteRowsPerPass, m - r0);
#pragma unroll 4
    for (int i = threadIdx.x; i < n * routed_plus_shared_experts(E); i += blockDim.x)
      xs[i] = __ldcg(a.logits + int64_t{r0} * routed_plus_shared_experts(E) + i);
    __syncthreads();
    for (int r = warp; r < n; r += kBlockWarps) {
      const float* logits = xs + r * routed_plus_shared_experts(E);
      int32_t* ids = sel_ids + (r0 + r) * n_sel;
      float* w = sel_w + (r0 + r) * n_sel;
      if (E <= kWarp * kRouteKeysSmall) route_token_keys<kRouteKeysSmall, true>(logits, E, k, ids, w);
      else route_token_keys<kRouteKeysLarge, true>(logits, E, k, ids, w);
    }
    __syncthreads();  // the pass's logits are read before the next pass overwrites them
  }
  trace_point(a, kMoeTraceIds);
  // The distinct experts: 0 the shared one, then the routed ones in ascending id (a bitmap and
  // its prefix counts); rows_of[d] the rows routed to d.
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
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int r = i / n_sel, s = i % n_sel, e = sel_ids[i];
    const int d = s == k ? 0 : 1 + word_prefix[e / 32] + __popc(used[e / 32] & ((1u << (e % 32)) - 1u));
    list[d] = s == k ? E : e;  // rows that share an expert write the same value
    pair_d[i] = static_cast<int16_t>(d);
    // Every row takes the shared expert (d = 0): its mask is set once below, not by m atomics on
    // one word.
    if (s != k) atomicOr(&rows_of[d], RowMask{1} << r);
    else if (r == 0) rows_of[0] = m == kMaxMoeRows ? ~RowMask{0} : (RowMask{1} << m) - 1;
    if (b == 0 && !l.route_once) {
      a.ids[i] = e;
      a.weights[i] = sel_w[i];
    }
  }
  __syncthreads();
  const int nd = n_distinct_s;
  // Column blocks: expert d's pairs, in row order, split into ⌈n_d / 8⌉ blocks of ≤ 8 (the
  // MMA's columns); the blocks in distinct-expert order. Warp 0 scans the counts: lane i takes
  // the distinct experts [i·per, (i + 1)·per).
  if (warp == 0) {
    const int per = (nd + kWarp - 1) / kWarp, d0 = min(lane * per, nd), d1 = min(d0 + per, nd);
    int n_pairs = 0, n_blocks = 0;
    for (int d = d0; d < d1; ++d) {
      const int c = __popcll(rows_of[d]);
      n_pairs += c;
      n_blocks += (c + kMmaCols - 1) / kMmaCols;
    }
    int pi = n_pairs, bi = n_blocks;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const int vp = __shfl_up_sync(0xffffffffu, pi, o), vb = __shfl_up_sync(0xffffffffu, bi, o);
      if (lane >= o) pi += vp, bi += vb;
    }
    pi -= n_pairs;
    bi -= n_blocks;
    for (int d = d0; d < d1; ++d) {
      const int c = __popcll(rows_of[d]);
      pair_start[d] = pi;
      item_start[d] = bi;
      pi += c;
      bi += (c + kMmaCols - 1) / kMmaCols;
    }
    if (lane == kWarp - 1) n_items_s = bi;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int r = i / n_sel, d = pair_d[i];
    pairs_of[pair_start[d] + __popcll(rows_of[d] & ((RowMask{1} << r) - 1))] = static_cast<int16_t>(i);
  }
  for (int d = threadIdx.x; d < nd; d += blockDim.x) {
    const int c = __popcll(rows_of[d]);
    for (int cb = 0; cb * kMmaCols < c; ++cb) {
      item_expert[item_start[d] + cb] = list[d];
      item_span[item_start[d] + cb] = (pair_start[d] + cb * kMmaCols) << 8 | min(kMmaCols, c - cb * kMmaCols);
    }
  }
  if (first_claim) claim_s[quad] = first_claimed;
  __syncthreads();
  const int n_items = n_items_s;
  const int64_t n_routed = int64_t{n_items} * l.gu_per_slot - shared_tiles;  // routed gate/up tiles
  int64_t routed_end = (b + 1) * n_routed / G;
  chunk0 = b * n_routed / G;
  if (l.balance > 0 && !l.claims) {  // by cost instead of count (moe_tile_balance)
    if (warp == 0) {
      const longlong2 r = routed_tile_bounds(item_span, shared_tiles / l.gu_per_slot, n_items, l.gu_per_slot, l.balance, b, G);
      if (lane == 0) routed_first_s = r.x, routed_end_s = r.y;
    }
    __syncthreads();
    chunk0 = routed_first_s;
    routed_end = routed_end_s;
  }
  // With claims and a fixed share (MoeLayout::claims_fixed): block b first takes routed tiles
  // [b·F, (b + 1)·F) (F the same for every block), and the claims count from G·F.
  int64_t claim_offset = 0;
  if (l.claims) {
    const int64_t fixed = n_routed * l.claims_fixed / 100 / G;
    chunk0 = b * fixed;
    routed_end = chunk0 + fixed;
    claim_offset = fixed * G;
  }
  const int my_gu = my_shared + static_cast<int>(routed_end - chunk0);
  // The quad's tiles of the block's fixed share (q, q + 4, … < my_gu); with claims, its claimed
  // tiles follow them.
  const int quad_fixed = my_gu > quad ? (my_gu - 1 - quad) / kQuads + 1 : 0;
  if (l.claims && l.claims_fixed > 0) {  // the first claim, once the fixed share is known
    if (wq == 0 && lane == 0 && quad_fixed < QS) claim_s[quad] = static_cast<int>(atomicAdd(a.tile_claims, kClaimTiles));
    __syncthreads();
  }
  // The quad's n-th gate/up tile (-1: none), asked for once per n in ascending order by every
  // warp of the quad; with claims, at n = quad_fixed + c·kClaimTiles after claim c was written to
  // claim_s[quad] by the quad's lane 0 (needs_claim) and a quad barrier.
  int claim_base = 0;
  auto needs_claim = [&](int n) { return l.claims && n >= quad_fixed && (n - quad_fixed) % kClaimTiles == 0; };
  auto quad_tile = [&](int n) {
    if (n < quad_fixed) return tile_of(quad + kQuads * n);
    if (!l.claims) return -1;
    const int u = n - quad_fixed;
    if (u % kClaimTiles == 0) claim_base = *reinterpret_cast<volatile int*>(claim_s + quad);
    const int64_t r = claim_offset + claim_base + u % kClaimTiles;
    return r < n_routed ? shared_tiles + static_cast<int>(r) : -1;
  };
  const int dn_items = my_rt * n_items;  // (row tile, column block), flattened
  // Phase 4's down stages: warp w < dn_warps computes items w, w + dn_warps, … and owns stages w,
  // w + dn_warps, … (dn_per_warp of them); stage s first holds item s; the other warps request
  // and compute no down tile. Two stages a warp wherever the stages give at least
  // kBlockWarps − 2 warps two each (at 61–64 rows the ring's tail leaves 30 or 31 stages: 15
  // warps with two tiles in flight rather than 16 with one), else one.
  const int dn_per_warp = n_dn >= kMaxDownStagesPerWarp * (kBlockWarps - 2) ? kMaxDownStagesPerWarp : 1;
  const int dn_warps = min(n_dn / dn_per_warp, kBlockWarps);
  const int dn_used = dn_warps * dn_per_warp;
  trace_point(a, 5);
  if (a.trace && threadIdx.x == 0) {
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    a.trace[int64_t{b} * kMoeTraceSlots + kMoeTraceWork] =
        moe_trace_work(smid, l.claims ? 0 : my_gu, my_shared, shared_tiles + static_cast<uint32_t>(chunk0));
  }
  int slot_tile0 = -1, slot_tile1 = -1;  // the tiles in the quad's ring slots 0 and 1 (QS ≤ 2)
  static_assert(kMaxQuadStages == 2, "slot_tile0 and slot_tile1 are the quad's ring slots");
  for (int n = 0; n < QS; ++n) {
    const int j = quad_tile(n);
    (n == 0 ? slot_tile0 : slot_tile1) = j;
    if (j >= 0 && n >= quad_shared)  // the shared expert's were requested before the PDL wait
      request_gate_up_part<true>(a, gate_up_row0(l, j, item_expert), gu_ring + (quad * QS + n) * l.gu_stage,
                                 gu_full + quad * QS + n, wq, kQuadWarps);
  }
  for (int st = warp; warp < dn_warps && st < min(l.dn_stages, dn_used) && st < dn_items; st += dn_warps)
    if (st > 0)
      request_down_tile(a, l, b + (st / n_items) * G, item_expert[st % n_items], dn_stage_of(st), dn_full + st);
  trace_point(a, 6);

  // 3. Gate/up: the four quads work on four tiles at once; in a quad, warp w sums the one-token
  // block's group ranges 4w … 4w + 3 for every column, each from zero, and the sixteen partials
  // add up in range order. Column c of the MMA is the column block's pair c, whose normed row
  // is read from normed_frag (L1/L2) by the fragment loads.
  const int per_range = (l.groups_h + kBlockWarps - 1) / kBlockWarps;
  float* gu_part = reinterpret_cast<float*>(sm + l.gu_part) + quad * kBlockWarps * kTileRows * kMmaCols;  // [range][16][8]
  const int qt = threadIdx.x % (kQuadWarps * kWarp);
  for (int n = 0;; ++n) {
    const int j = n % QS == 0 ? slot_tile0 : slot_tile1;
    if (j < 0) break;
    const int st = quad * QS + n % QS, span = item_span[j / l.gu_per_slot];
    // The claim for the tile this iteration requests, issued now so that its round trip
    // overlaps the tile's wait and arithmetic.
    const bool claim_now = wq == 0 && lane == 0 && needs_claim(n + QS);
    const int claimed = claim_now ? static_cast<int>(atomicAdd(a.tile_claims, kClaimTiles)) : 0;
    mbarrier_wait(gu_full + st, (n / QS) & 1);
    const TileView v = tile_view<true>(gu_ring + st * l.gu_stage, l.gu_row_bytes, l.groups_h, g, t);
    const uint4* col = reinterpret_cast<const uint4*>(a.normed_frag + int64_t{block_pair(pairs_of, span, g) / n_sel} * l.hidden) + 2 * t;
    const float* sum0 = xsums + block_pair(pairs_of, span, 2 * t) / n_sel * xsum_pitch(l.groups_h);
    const float* sum1 = xsums + block_pair(pairs_of, span, 2 * t + 1) / n_sel * xsum_pitch(l.groups_h);
    // The warp's ranges are independent sums, so their groups interleave (group `step` of every
    // range, then the next): four MMA chains in flight instead of one, and each range still
    // adds its own groups from zero in ascending order.
    float acc[kRangesPerWarp][4] = {};
    for (int step = 0; step < per_range; ++step) {
#pragma unroll
      for (int rg = 0; rg < kRangesPerWarp; ++rg) {
        const int range = wq * kRangesPerWarp + rg;
        const int Gi = range * per_range + step;
        if (Gi < l.groups_h) group_columns<true, true>(v, col, Gi, sum0[Gi], sum1[Gi], acc[rg]);
      }
    }
#pragma unroll
    for (int rg = 0; rg < kRangesPerWarp; ++rg)
      store_tile_partial(gu_part + (wq * kRangesPerWarp + rg) * kTileRows * kMmaCols, acc[rg], g, t);
    if (claim_now) claim_s[quad] = claimed;
    quad_sync(quad);  // the tile's partials are complete, its stage is free, the claim is visible
    const int jn = quad_tile(n + QS);
    (n % QS == 0 ? slot_tile0 : slot_tile1) = jn;
    if (jn >= 0)  // the refill, its copies shared by the quad's warps
      request_gate_up_part<true>(a, gate_up_row0(l, jn, item_expert), gu_ring + st * l.gu_stage, gu_full + st, wq,
                                 kQuadWarps, true);
    // SwiGLU: thread qt = 8c + r8 of the quad's first two warps takes column c, tile row r8; the
    // eight rows of a column are eight consecutive lanes, which also add up the column's act unit
    // (these 8 act values, one 16-byte unit) as the down phase's group sums need it.
    if (wq < 2) {
      const int c = qt / kExpertRowsPerTile, row8 = qt % kExpertRowsPerTile;
      const bool live = c < (span & 0xff);
      const int p = live ? block_pair(pairs_of, span, c) : 0;
      float h = 0.0f;
      if (live) {
        float gate = 0.0f, up = 0.0f;
        for (int range = 0; range < kBlockWarps; ++range) {
          gate = __fadd_rn(gate, gu_part[(range * kTileRows + row8) * kMmaCols + c]);
          up = __fadd_rn(up, gu_part[(range * kTileRows + 8 + row8) * kMmaCols + c]);
        }
        const int row = (j % l.gu_per_slot) * kExpertRowsPerTile + row8;
        const bf16 y = to_bf16(__fmul_rn(silu(round_bf16(gate)), round_bf16(up)));
        a.act[int64_t{p} * l.ffn + row] = y;
        h = to_f32(y);
      }
      // stage_fragment_row's 16-byte unit sum: ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)).
      h = __fadd_rn(h, __shfl_xor_sync(0xffffffffu, h, 1));
      h = __fadd_rn(h, __shfl_xor_sync(0xffffffffu, h, 2));
      h = __fadd_rn(h, __shfl_xor_sync(0xffffffffu, h, 4));
      if (live && row8 == 0) a.act_sums[int64_t{p} * l.gu_per_slot + j % l.gu_per_slot] = h;
    }
    quad_sync(quad);  // the partials are read before the quad's next tile overwrites them
  }
  trace_point(a, 7);
  // The ring's tail is free once every quad is done: the late down stages' first tiles.
  __syncthreads();
  for (int st = warp; warp < dn_warps && st < dn_used && st < dn_items; st += dn_warps)
    if (st >= l.dn_stages)
      request_down_tile(a, l, b + (st / n_items) * G, item_expert[st % n_items], dn_stage_of(st), dn_full + st, true);
  trace_point(a, 8);
  grid_sync(a.barriers + 1, G);
  trace_point(a, 9);

  // 4. Down + combine: every (row, slot)'s act group sums from the unit sums (stage_fragment_row's
  // group_sum order: ((u0 + u4) + (u2 + u6)) + ((u1 + u5) + (u3 + u7))); then warp w computes
  // the column blocks w, w + dn_warps, … of each of the block's row tiles from its own stages
  // (computing one while the next arrives), refilled as it goes, the act read from global
  // memory (L2) by the fragment loads.
  float* asum = reinterpret_cast<float*>(sm + l.asum);  // [(row, slot)][groups_f]
  {
    // kAsumBatch sums a thread, their loads issued together: one L2 round trip per batch, not per sum.
    constexpr int kAsumBatch = 4;
    const int n_sums = pairs * l.groups_f;
    for (int i0 = threadIdx.x; i0 < n_sums; i0 += kAsumBatch * blockDim.x) {
      float4 lo[kAsumBatch], hi[kAsumBatch];
#pragma unroll
      for (int q = 0; q < kAsumBatch; ++q) {
        const int i = min(i0 + q * static_cast<int>(blockDim.x), n_sums - 1);
        const float4* u = reinterpret_cast<const float4*>(a.act_sums + int64_t{i / l.groups_f} * l.gu_per_slot) + 2 * (i % l.groups_f);
        lo[q] = __ldcg(u);
        hi[q] = __ldcg(u + 1);
      }
#pragma unroll
      for (int q = 0; q < kAsumBatch; ++q) {
        const int i = i0 + q * static_cast<int>(blockDim.x);
        if (i < n_sums)
          asum[i] = __fadd_rn(__fadd_rn(__fadd_rn(lo[q].x, hi[q].x), __fadd_rn(lo[q].z, hi[q].z)),
                              __fadd_rn(__fadd_rn(lo[q].y, hi[q].y), __fadd_rn(lo[q].w, hi[q].w)));
      }
    }
  }
  __syncthreads();
  trace_point(a, 10);
  float* dn_part = reinterpret_cast<float*>(sm + l.dn_part);  // [(row, slot)][16 rows]
  int used_items = 0;  // this warp's items so far (its stages' phase parity)
  for (int i = 0; i < my_rt; ++i) {
    const int rt = b + i * G;
    if (warp < dn_warps) {
      const int first = i * n_items, start = first + ((warp - first) % dn_warps + dn_warps) % dn_warps;
      for (int q = start; q < first + n_items; q += dn_warps, ++used_items) {
        const int span = item_span[q - first], n = span & 0xff;
        const int st = warp + dn_warps * (used_items % dn_per_warp);
        mbarrier_wait(dn_full + st, (used_items / dn_per_warp) & 1);
        const TileView v = tile_view<true>(dn_stage_of(st), l.dn_row_bytes, l.groups_f, g, t);
        const uint4* col = reinterpret_cast<const uint4*>(a.act + int64_t{block_pair(pairs_of, span, g)} * l.ffn) + 2 * t;
        const int p0 = block_pair(pairs_of, span, 2 * t), p1 = block_pair(pairs_of, span, 2 * t + 1);
        const float* sum0 = asum + p0 * l.groups_f;
        const float* sum1 = asum + p1 * l.groups_f;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        // Unrolled so that the next groups' loads and MMAs issue while this one's finish (only
        // the affine adds are a chain; they stay in ascending group order).
#pragma unroll 4
        for (int Gi = 0; Gi < l.groups_f; ++Gi) group_columns<false>(v, col, Gi, sum0[Gi], sum1[Gi], acc);
        if (2 * t < n) {
          dn_part[p0 * kTileRows + g] = round_bf16(acc[0]);
          dn_part[p0 * kTileRows + g + 8] = round_bf16(acc[2]);
        }
        if (2 * t + 1 < n) {
          dn_part[p1 * kTileRows + g] = round_bf16(acc[1]);
          dn_part[p1 * kTileRows + g + 8] = round_bf16(acc[3]);
        }
        __syncwarp();  // every lane is done with the stage
        const int qn = q + dn_used;
        if (qn < dn_items)
          request_down_tile(a, l, b + (qn / n_items) * G, item_expert[qn % n_items], dn_stage_of(st), dn_full + st, true);
      }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < m * kTileRows; j += blockDim.x) {  // a thread per (row, output row)
      const int r = j / kTileRows, row = j % kTileRows;
      const float o = combine_slots(sel_w + r * n_sel, dn_part + r * n_sel * kTileRows + row, n_sel);
      a.out[int64_t{r} * l.hidden + int64_t{rt} * kTileRows + row] = to_bf16(o);
    }
    __syncthreads();  // dn_part is reused by the next row tile
  }
  trace_point(a, 11);
}


/// The launch of `a`, or why it cannot run (see moe_block_rows_unsupported). The ring slots: per quad
/// as many gate/up stages as it has tiles (≤ kMaxQuadStages), and up to one early down stage per
/// warp (≤ the distinct experts); fewer where shared memory runs out: the early down stages first,
/// to 2 (in phase 4 the gate/up ring's tail holds the rest, up to two per warp: MoeLayout::late_dn),
/// then the gate/up ones, to 1 per quad.
/// Two gate/up tiles in flight per quad matter most: with one, each tile waits out a whole
/// memory round trip.
MoePlan<MoeLayout> moe_plan(const MoeDecodeArgs& a, int max_blocks) {
  constexpr const char* kLabel = "fused MoE block (rows): ";
  const int hidden = a.gate.cols, ffn = a.ffn, E = a.n_experts, k = a.top_k;
  const std::string rows_problem =
      a.out_proj.w.codes ? "the out-projection phase (MoeDecodeArgs::out_proj) is the one-token block's"
      : a.next_norm.row.pairs ? "the next-norm phase (MoeDecodeArgs::next_norm) is the one-token block's"
      : a.rows >= 1 && a.rows <= kMaxMoeRows ? ""
                                             : std::to_string(a.rows) + " rows (1 … " + std::to_string(kMaxMoeRows) + " supported)";
  MoePlan<MoeLayout> p = start_plan<MoeLayout>(kLabel, a, rows_problem, max_blocks);
  if (!p.why.empty()) return p;
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!aligned(a.x) || !aligned(a.norm.branch) || !aligned(a.norm.gain) || !aligned(a.norm.x_out) ||
      !aligned(a.norm.normed_out) || !aligned(a.router.codes)) {
    p.why = std::string(kLabel) + "the residual, branch, gain, x_out, normed_out and router codes must be 16-byte aligned";
    return p;
  }
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
  p.layout.balance = a.rows >= kMoeTileBalanceFromRows ? moe_tile_balance() : 0;
  p.layout.route_once = a.rows >= moe_route_once_from_rows();
  p.layout.claims = a.tile_claims != nullptr && a.rows >= moe_tile_claims_from_rows();
  p.layout.claims_fixed = p.layout.claims ? moe_tile_claims_fixed_percent() : 0;
  return finish_plan(p, kLabel, a, moe_rows_kernel<8>, moe_rows_kernel<4>);
}

}  // namespace

std::string moe_block_rows_unsupported(const MoeDecodeArgs& args, int max_blocks) {
  return moe_plan(args, max_blocks).why;
}

void launch_moe_block_rows(const MoeDecodeArgs& a, cudaStream_t stream, int max_blocks) {
  if (!a.act_sums || !a.normed_sums || !a.normed_frag || reinterpret_cast<uintptr_t>(a.normed_frag) % 16 != 0)
    throw ::lily::InternalError("launch_moe_block_rows: act_sums, normed_sums and a 16-byte aligned normed_frag are required");
  launch_plan(moe_plan(a, max_blocks), a, stream, "launch_moe_block_rows");
}

}  // namespace lily::cuda
