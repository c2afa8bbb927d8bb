// The decode MoE block of one token in one launch (docs/model.md §3.5, §4.3 item 5): the
// post-mixer add + RMSNorm, the router GEMV and top-k, the gate/up projections with SwiGLU over
// the 8 routed experts and the shared one, the down projections and the weighted combine.
// (The batched decode's block over several rows, one arithmetic for every row count, is
// moe_block_rows.cu; the helpers both use are in moe_block.cuh.)
//
// Why one launch: as three kernels (router, gate/up, down) each decode layer pays two more
// kernel boundaries, and each kernel's weights can only start streaming once it runs; the expert
// kernels read their 15 MB per layer at under 1 TB/s. Here every block is resident for the whole
// block (one block per SM), so the work after a grid-wide dependency waits on a counter instead
// of a launch, and the weights are requested as early as their addresses are known:
//  1. before the PDL wait: the router rows of each warp (into registers) and every tile of the
//     shared expert (gate/up and down), whose address does not depend on the routing;
//  2. after the wait: each block computes the normed row itself (4 KB) and a share of the router
//     logits, then grid barrier 1; every block copies the logits into shared memory, routes the
//     token itself (one warp, route_token_keys) and requests its routed gate/up tiles and all
//     its down tiles at once;
//  3. gate/up on tensor cores (quant_mma.cuh), SwiGLU, act to global memory, grid barrier 2;
//  4. down + combine from tiles that arrived during steps 2 and 3.
// Optionally (MoeDecodeArgs::next_norm) the block that finishes last forms the next layer's
// input norm and leaves it staged for the next GEMV (launch_staged_row_gemv), so that its 500-odd
// blocks copy the row instead of each forming it.
// Optionally (MoeDecodeArgs::out_proj, the kOutProj instances) the block first runs the mixer's
// out-projection, whose output is the norm's branch: each block's 16-row tile of it is requested
// before the PDL wait (the router rows then only go to L2, so that they hold no registers through
// this phase), computed after it with the streaming GEMV's direct-mode arithmetic (stream_gemv.cuh:
// the separate GEMV's bits), stored, and followed by grid barrier 0; the norm then reads the
// branch through L2. This saves the out-projection's own launch and lets its weights stream in
// under the mixer's last kernel.
// Work split: gate/up tiles of 8 expert rows (16 MMA rows: the 8 gate rows and the same 8 up
// rows, so each thread holds a row's gate and up values; six bulk copies a tile) are dealt
// round-robin over the blocks;
// down tiles are 16 output rows × every slot, one block each, so the slot-order combine happens
// in one block. Every tile a block owns gets its own shared-memory stage (no ring): at the real
// shape a block holds at most 5 gate/up tiles and one down row tile, about 164 KB.
//
// Grid barriers are counters in global memory that the caller zeroes before every launch (a
// memset node at the start of the decode graph), so a replay never depends on the last one.
// All blocks are resident at once (one per SM, checked with the occupancy API), and a PDL
// dependent launches only after every block has started, so the spin-waits cannot deadlock.
//
// Numerics: the norm is stage_norm_row's with a 256-thread element mapping (bit-identical to
// launch_add_rmsnorm); the router logits are router_rows.cuh's (bit-identical to
// launch_router_fused, so the routing is too); the expert products use the tensor-core
// arithmetic of the MMA GEMV (exact bf16 codes, Σ q·x per group on tensor cores, s·D + b·Σx in
// fp32 as acc + (s·D + b·Σx) with explicit roundings, groups summed in ascending order), then the
// same roundings as the CUDA-core expert kernels: act = bf16(silu(bf16(g))·bf16(u)),
// out = bf16(Σ_s w_s·bf16(d_s)) in slot order. moe_block_rows.cu gives each of its rows exactly
// this arithmetic, so keep the two in step.
#include <algorithm>
#include <string>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe_block.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/quant_mma.cuh"
#include "backends/cuda/router_rows.cuh"
#include "backends/cuda/router_topk.cuh"
#include "backends/cuda/stream_gemv.cuh"

namespace lily::cuda {
namespace {

using namespace moe;

/// Shapes and shared-memory offsets (bytes) of the kernel; host and device compute the same.
struct MoeLayout {
  int hidden = 0, ffn = 0, n_sel = 0;
  int groups_h = 0, groups_f = 0;  ///< 64-groups per gate/up row, per down row
  int gu_per_slot = 0;             ///< gate/up tiles per expert: ffn / 8
  int gu_row_bytes = 0, dn_row_bytes = 0;  ///< a gate/up / down code row's bytes
  int dn_bytes = 0;                        ///< a down tile's bytes as copied (down_tile_bytes)
  int64_t gu_stage = 0, dn_stage = 0;  ///< one gate/up tile; one down tile of one slot
  int gu_max = 0, dn_max = 0;          ///< tiles per block at most
  int64_t bars = 0, gu_ring = 0, dn_ring = 0, xs = 0, xperm = 0, logits = 0, aperm = 0, asum = 0;
  int64_t gu_part = 0, dn_part = 0;
  /// The out-projection phase (MoeDecodeArgs::out_proj; op_cols = 0: none): its 16-row tiles
  /// (at most op_max a block) pass through one stage of op_stage bytes (the streaming GEMV's
  /// direct-mode stage for op_cols columns); op_xsum: the input's group sums, op_part: the
  /// k-slice partials of warps 1 … 7. Each lies inside a region first written after the
  /// routing where it fits (moe_layout), else after the others.
  int op_cols = 0, op_max = 0;
  int64_t op_stage = 0, op_ring = 0, op_xsum = 0, op_part = 0;
  int64_t total = 0;
};

/// The streaming GEMV's tile layout of the out-projection phase: one row, one stage, padded
/// chunks, direct mode (only its row_bytes, chunk_pitch and stage_bytes are used).
__host__ __device__ inline StreamLayout out_proj_layout(int cols) {
  return stream_layout(cols, 1, 1, kStreamChunkPad, StreamMode::direct);
}

__host__ __device__ inline MoeLayout moe_layout(int hidden, int ffn, int n_experts, int n_sel, int blocks,
                                                int op_cols = 0) {
  MoeLayout l;
  l.hidden = hidden;
  l.ffn = ffn;
  l.n_sel = n_sel;
  l.groups_h = hidden / kGroup;
  l.groups_f = ffn / kGroup;
  l.gu_per_slot = ffn / kExpertRowsPerTile;
  l.gu_row_bytes = hidden / 2;
  l.gu_stage = gate_up_stage_bytes<false>(hidden);
  l.dn_row_bytes = ffn / 2;
  l.dn_bytes = down_tile_bytes(ffn);
  l.dn_stage = down_stage_bytes<false>(ffn);
  l.gu_max = static_cast<int>(ceil_div(int64_t{n_sel} * l.gu_per_slot, blocks));
  l.dn_max = static_cast<int>(ceil_div(hidden / kTileRows, blocks));
  int64_t o = 0;
  l.op_cols = op_cols;
  l.op_max = op_cols > 0 ? static_cast<int>(ceil_div(int64_t{hidden} / kTileRows, blocks)) : 0;
  l.bars = o;
  o += align16(int64_t{l.gu_max + l.dn_max + (op_cols > 0 ? 1 : 0)} * 8);  // then the out-projection stage's
  l.gu_ring = o;
  o += l.gu_max * l.gu_stage;
  l.dn_ring = o;
  o += int64_t{l.dn_max} * n_sel * l.dn_stage;
  l.xs = o;
  o += align16(int64_t{l.groups_h} * kStagedFloatsPerGroup * 4);
  l.xperm = o;
  o += align16(int64_t{hidden} / 2 * 4);
  l.logits = o;
  o += align16(int64_t{routed_plus_shared_experts(n_experts)} * 4);
  l.aperm = o;
  o += align16(int64_t{n_sel} * ffn / 2 * 4);
  l.asum = o;
  o += align16(int64_t{n_sel} * l.groups_f * 4);
  l.gu_part = o;
  o += align16(int64_t{l.gu_max} * kBlockWarps * kTileRows * 4);
  l.dn_part = o;
  o += align16(int64_t{n_sel} * kTileRows * 4);
  if (op_cols > 0) {
    // The phase ends (grid barrier 0) before the routing, so its stage and scratch go where
    // nothing is written before the routing when they fit: the first gate/up stages (those
    // whose tiles b + i·G are routed ones in every block, i·G + G ≤ top_k · gu_per_slot: the
    // shared expert's tiles are the last, requested before the wait), the gate/up partials and
    // the logits. The block then takes the shared memory of the kernel without the phase,
    // which leaves room on the SM for the next kernel's blocks under PDL.
    auto place = [&o](int64_t bytes, int64_t free_at, int64_t free_bytes) {
      if (bytes <= free_bytes) return free_at;
      const int64_t at = o;
      o += align16(bytes);
      return at;
    };
    l.op_stage = out_proj_layout(op_cols).stage_bytes;
    const int routed_per_block = (n_sel - 1) * l.gu_per_slot / blocks;  // routed gate/up tiles every block has
    const int routed_gu_stages = routed_per_block < l.gu_max ? routed_per_block : l.gu_max;
    l.op_ring = place(l.op_stage, l.gu_ring, int64_t{routed_gu_stages} * l.gu_stage);
    l.op_xsum = place(int64_t{op_cols} / kGroup * 4, l.logits, l.aperm - l.logits);
    l.op_part = place(int64_t{kStreamWarps} * kWarp * 16, l.gu_part, l.dn_part - l.gu_part);
  }
  l.total = o;
  return l;
}

/// The first expert row of gate/up tile j (rows 8·(j mod gu_per_slot) … of `expert`).
__device__ __forceinline__ int64_t gate_up_row0(const MoeLayout& l, int j, int expert) {
  return int64_t{expert} * l.ffn + (j % l.gu_per_slot) * kExpertRowsPerTile;
}

/// Warp 0: requests down row tile `rt` (output rows 16·rt … + 16) of slots [s_begin, s_end)
/// into stages[s] (expert ids[s], or the shared expert when ids is null), counted on `bar`
/// (one arrival for the whole range): per slot its 16 code rows, scales and biases
/// (copy_down_item).
__device__ __forceinline__ void request_down_slots(const MoeDecodeArgs& a, const MoeLayout& l, int rt, int s_begin,
                                                   int s_end, const int32_t* ids, unsigned char* stages,
                                                   uint64_t* bar) {
  const int lane = threadIdx.x % kWarp;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>((s_end - s_begin) * l.dn_bytes));
  __syncwarp();
  for (int q = lane; q < (s_end - s_begin) * kDownTileCopies<false>; q += kWarp) {
    const int s = s_begin + q / kDownTileCopies<false>;
    const int64_t row0 = int64_t{ids ? ids[s] : a.n_experts} * l.hidden + int64_t{rt} * kTileRows;
    copy_down_item<false>(a, row0, q % kDownTileCopies<false>, stages + s * l.dn_stage, bar);
  }
}

/// Adds 64-group G of one token to acc_lo (slot g) and acc_hi (slot g + 8): perm the token's
/// bf16 pairs in fragment order, sums its per-group Σx. Only lanes with t = 0 end up with the
/// token's values (the MMA's column 0). Every lane loads the token's fragments (no branch):
/// columns 1 … 7 repeat column 0, whose bits depend on its own B column alone.
__device__ __forceinline__ void group_one_token(const TileView& v, const uint32_t* perm, const float* sums, int t, int G,
                                                float& acc_lo, float& acc_hi) {
  const uint4* bp = reinterpret_cast<const uint4*>(perm + G * 32 + t * 8);
  const uint4 bw0 = bp[0], bw1 = bp[1];
  float d[4];
  group_mma(*reinterpret_cast<const uint2*>(v.code_lo + G * 32), *reinterpret_cast<const uint2*>(v.code_hi + G * 32), bw0,
            bw1, d);
  const float x = sums[G];
  acc_lo = affine_add(acc_lo, to_f32(v.s_lo[G]), d[0], to_f32(v.b_lo[G]), x);
  acc_hi = affine_add(acc_hi, to_f32(v.s_hi[G]), d[2], to_f32(v.b_hi[G]), x);
}

/// Step 0 (MoeDecodeArgs::out_proj): this block's 16-row tiles b, b + G, … of y = W·x through
/// the one stage at `stage` (the first requested before the PDL wait, each later one once the
/// last is read), on `full`. Warps 0–7 are the streaming GEMV's k-slices (groups [w·G/8,
/// (w+1)·G/8) each, stream_tile_slice_direct), warp 0 adds the others' partials in slice order
/// and stores the tile (store_mma_tile): launch_quant_gemv's bits for every row. Warps 8–15 wait
/// at the block barriers. All threads of the block; the caller's grid barrier follows.
__device__ __forceinline__ void out_projection_phase(const MoeOutProjection& op, const MoeLayout& l, unsigned char* sm,
                                                     uint64_t* full, int my_op) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int cols = op.w.cols, groups = cols / kGroup, per_warp = groups / kStreamWarps;
  const int g_begin = warp * per_warp, g_end = g_begin + per_warp;
  const StreamLayout sl = out_proj_layout(cols);
  unsigned char* stage = sm + l.op_ring;
  float* xsum = reinterpret_cast<float*>(sm + l.op_xsum);
  float4* partial = reinterpret_cast<float4*>(sm + l.op_part);  // [warp][lane]
  if (warp < kStreamWarps) stream_direct_group_sums(op.x, cols, 1, g_begin, g_end, xsum);
  for (int i = 0; i < my_op; ++i) {
    float acc[1][4] = {};
    if (warp < kStreamWarps) {
      mbarrier_wait(full, static_cast<uint32_t>(i) & 1u);
      const StreamTileView v = stream_tile_view(stage, sl, groups, g, t);
      stream_tile_slice_direct<1>(v, op.x, cols, 1, g, t, g_begin, g_end, xsum, acc);
      if (warp != 0) partial[warp * kWarp + lane] = make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
    }
    __syncthreads();  // the partials are in, and every warp is done with the stage
    if (warp == 0) {
      if (i + 1 < my_op) stream_request_tile(op.w, i + 1, stage, sl, full);
      stream_add_slices<1>(partial, lane, acc);
      const int64_t row_a = (blockIdx.x + int64_t{i} * gridDim.x) * kMmaTileRows + 4 * (g % 4) + g / 4;
      store_mma_tile(acc[0], row_a, row_a + 2, t, 1, op.w.rows, op.y, FusedConv{});
    }
    __syncthreads();  // the partials are read before the next tile's are written
  }
}

/// Step 5 (MoeDecodeArgs::next_norm): each block counts itself done on barriers[3] once its
/// outputs are stored (release: a fence, then the count); the block whose count is the grid's
/// last (acquire: a fence after it) then holds every row of `out` and norm.x_out in memory and
/// forms the next norm of h = bf16(norm.x_out + out) with stage_norm_row's arithmetic on the
/// 256-thread element mapping (the bits the next GEMV's own staging would give), both read
/// through L2; it stores h and y (x_out, normed_out) and y staged (MoeNextNorm::row: the pairs in
/// fragment order, the group sums). All threads of the block; the other blocks return at once.
__device__ __forceinline__ void next_norm_phase(const MoeDecodeArgs& a, const MoeLayout& l, unsigned char* sm) {
  __shared__ bool last;
  __syncthreads();  // this block's stores of out are issued
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.barriers + 3, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  const MoeNextNorm& nn = a.next_norm;
  const FusedNorm norm{a.out, nn.gain, nn.eps, nn.x_out, nn.normed_out};
  float* xs = reinterpret_cast<float*>(sm + l.xs);  // free since the block's own norm was staged
  float* xsum = xs + l.groups_h * kGroupStride;
  stage_norm_row<true, true>(a.norm.x_out, norm, l.hidden, true, xs, xsum, kNormThreads);
  pack_fragment_pairs(xs, l.hidden, nn.row.pairs);
  for (int G = threadIdx.x; G < l.groups_h; G += blockDim.x) nn.row.sums[G] = xsum[G];
}

/// The kernels' body: grid blocks ≤ one per SM (all resident), block kBlockThreads. See the
/// file comment. kOutProj: with the out-projection phase (l.op_cols > 0); the router rows then
/// go to L2 before the wait and into registers after the phase, so that they hold no registers
/// through it.
template <int RBITS, bool kOutProj>
__device__ __forceinline__ void moe_block_body(const MoeDecodeArgs& a, const MoeLayout& l) {
  extern __shared__ __align__(16) unsigned char sm[];
  __shared__ int32_t sel_ids[kMaxTopK + 1];
  __shared__ float sel_w[kMaxTopK + 1];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int G = gridDim.x, b = blockIdx.x;
  const int shared_slot = a.top_k;
  const int n_gu = l.n_sel * l.gu_per_slot, n_rt = l.hidden / kTileRows;
  const int my_gu = b < n_gu ? (n_gu - 1 - b) / G + 1 : 0;  // tiles b, b + G, …
  const int my_rt = b < n_rt ? (n_rt - 1 - b) / G + 1 : 0;
  uint64_t* gu_full = reinterpret_cast<uint64_t*>(sm + l.bars);
  uint64_t* dn_full = gu_full + l.gu_max;
  uint64_t* op_full = dn_full + l.dn_max;
  const int n_op = kOutProj ? l.hidden / kTileRows : 0;
  const int my_op = b < n_op ? (n_op - 1 - b) / G + 1 : 0;  // out-projection tiles b, b + G, …
  unsigned char* gu_ring = sm + l.gu_ring;
  unsigned char* dn_ring = sm + l.dn_ring;
  auto dn_stages = [&](int i) { return dn_ring + int64_t{i} * l.n_sel * l.dn_stage; };

  trace_point(a, 0);
  if (threadIdx.x == 0) {
    for (int i = 0; i < my_gu; ++i) mbarrier_init(gu_full + i, 1);
    for (int i = 0; i < my_rt; ++i) mbarrier_init(dn_full + i, 2);  // shared slot, then the routed ones
    if (kOutProj) mbarrier_init(op_full, 1);
    mbarrier_init_fence();
  }
  __syncthreads();

  // 1. Weights whose addresses need no routing, before the wait (launch.cuh): the first
  // out-projection tile (needed first), the router rows, the shared expert's tiles.
  if (kOutProj && warp == 0 && my_op > 0)
    stream_request_tile(a.out_proj.w, 0, sm + l.op_ring, out_proj_layout(l.op_cols), op_full);
  RouterRows<RBITS> router(a.router, int64_t{b} * kBlockWarps + warp, int64_t{G} * kBlockWarps, !kOutProj);
  if (kOutProj) router.prefetch_l2(a.router);
  if (warp == 0) {
    for (int i = 0; i < my_gu; ++i) {
      const int j = b + i * G;
      if (j / l.gu_per_slot == shared_slot)
        request_gate_up_tile<false>(a, gate_up_row0(l, j, a.n_experts), gu_ring + i * l.gu_stage, gu_full + i);
    }
    for (int i = 0; i < my_rt; ++i)
      request_down_slots(a, l, b + i * G, shared_slot, l.n_sel, nullptr, dn_stages(i), dn_full + i);
  }
  pdl_prologue();
  trace_point(a, 1);

  // 2. With the out-projection phase its tiles, then grid barrier 0 (the branch is the whole
  // y). The normed row (block 0 also stores x_out and normed_out), its fragment-order copy, a
  // share of the router logits; then every block routes the token.
  float* xs = reinterpret_cast<float*>(sm + l.xs);
  float* xsum = xs + l.groups_h * kGroupStride;
  uint32_t* xperm = reinterpret_cast<uint32_t*>(sm + l.xperm);
  if constexpr (kOutProj) {
    out_projection_phase(a.out_proj, l, sm, op_full, my_op);
    grid_sync(a.barriers + 2, G);
    // y from other blocks: via L2
    stage_norm_fragments<true>(a.x, a.norm, l.hidden, b == 0, xs, xsum, xperm, kNormThreads);
  } else {
    stage_norm_fragments(a.x, a.norm, l.hidden, b == 0, xs, xsum, xperm, kNormThreads);
  }
  trace_point(a, 2);
  router.compute(a.router, xs, xsum, a.logits, !kOutProj);
  trace_point(a, 3);
  grid_sync(a.barriers, G);
  trace_point(a, 4);
  float* logits = reinterpret_cast<float*>(sm + l.logits);  // one round trip to L2, then shared reads
  for (int e = threadIdx.x; e <= a.n_experts; e += blockDim.x) logits[e] = __ldcg(a.logits + e);
  __syncthreads();
  if (warp == 0) {
    if (a.n_experts <= kWarp * kRouteKeysSmall)
      route_token_keys<kRouteKeysSmall, true>(logits, a.n_experts, a.top_k, sel_ids, sel_w);
    else
      route_token_keys<kRouteKeysLarge, true>(logits, a.n_experts, a.top_k, sel_ids, sel_w);
  }
  __syncthreads();
  trace_point(a, 5);
  if (b == 0 && threadIdx.x < l.n_sel) {
    a.ids[threadIdx.x] = sel_ids[threadIdx.x];
    a.weights[threadIdx.x] = sel_w[threadIdx.x];
  }
  if (warp == 0) {
    for (int i = 0; i < my_gu; ++i) {
      const int j = b + i * G, slot = j / l.gu_per_slot;
      if (slot != shared_slot) request_gate_up_tile<false>(a, gate_up_row0(l, j, sel_ids[slot]), gu_ring + i * l.gu_stage, gu_full + i);
    }
    for (int i = 0; i < my_rt; ++i) request_down_slots(a, l, b + i * G, 0, shared_slot, sel_ids, dn_stages(i), dn_full + i);
  }
  trace_point(a, 6);

  // 3. Gate/up: warp w sums its range of groups of every tile; the ranges add up in warp order.
  const int per_warp = (l.groups_h + kBlockWarps - 1) / kBlockWarps;
  const int g_begin = min(l.groups_h, warp * per_warp), g_end = min(l.groups_h, g_begin + per_warp);
  float* gu_part = reinterpret_cast<float*>(sm + l.gu_part);  // [tile][warp][16 slots]
  for (int i = 0; i < my_gu; ++i) {
    mbarrier_wait(gu_full + i, 0);
    const TileView v = tile_view<false>(gu_ring + i * l.gu_stage, l.gu_row_bytes, l.groups_h, g, t);
    float gate = 0.0f, up = 0.0f;
    for (int Gi = g_begin; Gi < g_end; ++Gi) group_one_token(v, xperm, xsum, t, Gi, gate, up);
    if (t == 0) {
      float* p = gu_part + (i * kBlockWarps + warp) * kTileRows;
      p[g] = gate;
      p[g + 8] = up;
    }
  }
  trace_point(a, 7);
  __syncthreads();
  for (int idx = threadIdx.x; idx < my_gu * kExpertRowsPerTile; idx += blockDim.x) {
    const int i = idx / kExpertRowsPerTile, slot8 = idx % kExpertRowsPerTile;
    const float* p = gu_part + i * kBlockWarps * kTileRows;
    float gate = 0.0f, up = 0.0f;
    for (int w = 0; w < kBlockWarps; ++w) {
      gate = __fadd_rn(gate, p[w * kTileRows + slot8]);
      up = __fadd_rn(up, p[w * kTileRows + 8 + slot8]);
    }
    const int j = b + i * G, slot = j / l.gu_per_slot;
    const int row = (j % l.gu_per_slot) * kExpertRowsPerTile + slot8;
    a.act[int64_t{slot} * l.ffn + row] = to_bf16(__fmul_rn(silu(round_bf16(gate)), round_bf16(up)));
  }
  trace_point(a, 8);
  grid_sync(a.barriers + 1, G);
  trace_point(a, 9);

  // 4. Down + combine: every slot's act (written by other blocks: read through L2), put in
  // fragment order with its group sums (the slots are contiguous, so one row of n_sel · ffn);
  // then warp s computes slot s of the block's row tiles.
  const int half = l.ffn / 2;
  uint32_t* aperm = reinterpret_cast<uint32_t*>(sm + l.aperm);  // [slot][ffn / 2]
  float* asum = reinterpret_cast<float*>(sm + l.asum);          // [slot][groups_f]
  stage_fragment_row<true>(a.act, l.n_sel * l.ffn, aperm, asum);
  __syncthreads();
  trace_point(a, 10);
  float* dn_part = reinterpret_cast<float*>(sm + l.dn_part);  // [slot][16 rows]
  for (int i = 0; i < my_rt; ++i) {
    mbarrier_wait(dn_full + i, 0);
    const int rt = b + i * G;
    for (int s = warp; s < l.n_sel; s += kBlockWarps) {
      const TileView v = tile_view<false>(dn_stages(i) + s * l.dn_stage, l.dn_row_bytes, l.groups_f, g, t);
      float lo = 0.0f, hi = 0.0f;
      for (int Gi = 0; Gi < l.groups_f; ++Gi) group_one_token(v, aperm + s * half, asum + s * l.groups_f, t, Gi, lo, hi);
      if (t == 0) {
        dn_part[s * kTileRows + g] = round_bf16(lo);
        dn_part[s * kTileRows + g + 8] = round_bf16(hi);
      }
    }
    __syncthreads();
    if (threadIdx.x < kTileRows)
      a.out[int64_t{rt} * kTileRows + threadIdx.x] = to_bf16(combine_slots(sel_w, dn_part + threadIdx.x, l.n_sel));
    __syncthreads();  // dn_part is reused by the next row tile
  }
  trace_point(a, 11);
  if (a.next_norm.row.pairs) next_norm_phase(a, l, sm);
}

/// The one-token block (moe_block_body without the out-projection phase).
template <int RBITS>
__global__ void __launch_bounds__(kBlockThreads, 1) moe_block_kernel(MoeDecodeArgs a, MoeLayout l) {
  moe_block_body<RBITS, false>(a, l);
}

/// Registers a thread of the out-projection instance may take: 16 warps of 96 leave 16,384 of
/// the SM's 65,536, one block of the streaming GEMV (8 warps of 64), so that the next layer's
/// in-projection can start its weight copies under this block's tail, as it can under the
/// instance without the phase (95 registers). Unbounded the phase's instance takes 104, and the
/// in-projection then waits for the whole block to leave the SM. (On an H100 the cap and the
/// shared layout of moe_layout together moved decode by under 1 %.)
constexpr int kOutProjMaxRegisters = 96;

/// The one-token block with the out-projection phase first (moe_block_body<RBITS, true>).
template <int RBITS>
__global__ void __maxnreg__(kOutProjMaxRegisters)
    moe_block_out_proj_kernel(MoeDecodeArgs a, MoeLayout l) {
  moe_block_body<RBITS, true>(a, l);
}


/// Why the one-token block cannot run a.out_proj ("" when it can, or when there is none): a
/// 4-bit [hidden, cols] matrix with cols a multiple of 512 (≤ kMaxGemvCols; the streaming GEMV's
/// even split of the groups over its 8 k-slices), 16-byte aligned arrays and input, an output
/// that is the norm's branch.
std::string out_proj_problem(const MoeDecodeArgs& a) {
  const MoeOutProjection& op = a.out_proj;
  if (!op.w.codes) return "";
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (op.w.bits != 4 || op.w.rows != a.gate.cols || op.w.cols <= 0 || op.w.cols % 512 != 0 || op.w.cols > kMaxGemvCols)
    return "the out-projection is not a 4-bit [hidden, k·512] matrix (" + std::to_string(op.w.rows) + " × " +
           std::to_string(op.w.cols) + ", " + std::to_string(op.w.bits) + "-bit)";
  if (!aligned(op.w.codes) || !aligned(op.w.scales) || !aligned(op.w.biases) || !aligned(op.x))
    return "the out-projection's arrays and input are not 16-byte aligned";
  return "";
}

/// The launch of `a`, or why it cannot run (see moe_block_unsupported).
MoePlan<MoeLayout> moe_plan(const MoeDecodeArgs& a, int max_blocks) {
  constexpr const char* kLabel = "fused MoE block: ";
  const std::string rows_problem =
      a.rows == 1 ? "" : std::to_string(a.rows) + " rows (the one-token block takes 1; launch_moe_block_rows takes more)";
  MoePlan<MoeLayout> p = start_plan<MoeLayout>(kLabel, a, rows_problem, max_blocks);
  if (!p.why.empty()) return p;
  if (std::string why = out_proj_problem(a); !why.empty()) {
    p.why = kLabel + why;
    return p;
  }
  const int op_cols = a.out_proj.w.codes ? a.out_proj.w.cols : 0;
  p.layout = moe_layout(a.gate.cols, a.ffn, a.n_experts, routed_plus_shared_slots(a.top_k), p.blocks, op_cols);
  if (op_cols > 0) return finish_plan(p, kLabel, a, moe_block_out_proj_kernel<8>, moe_block_out_proj_kernel<4>);
  return finish_plan(p, kLabel, a, moe_block_kernel<8>, moe_block_kernel<4>);
}

}  // namespace

std::string moe_block_unsupported(const MoeDecodeArgs& args, int max_blocks) { return moe_plan(args, max_blocks).why; }

void launch_moe_block_decode(const MoeDecodeArgs& a, cudaStream_t stream, int max_blocks) {
  launch_plan(moe_plan(a, max_blocks), a, stream, "launch_moe_block_decode");
}

namespace moe {

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool quant_aligned(const DeviceQuant& w) { return aligned16(w.codes) && aligned16(w.scales) && aligned16(w.biases); }
}  // namespace

std::string shape_problem(const MoeDecodeArgs& a) {
  const int hidden = a.gate.cols, ffn = a.ffn, E = a.n_experts, k = a.top_k;
  if (a.gate.bits != 4 || a.up.bits != 4 || a.down.bits != 4) return "the expert matrices are not 4-bit";
  if (a.router.bits != 4 && a.router.bits != 8) return "the router is not 4- or 8-bit";
  if (E < 1 || E > kMaxExperts || k < 1 || k > kMaxTopK || k > E) return "unsupported expert count or top-k";
  if (hidden <= 0 || hidden % 256 != 0 || hidden > kMaxGemvCols)
    return "hidden " + std::to_string(hidden) + " is not a multiple of 256 (≤ " + std::to_string(kMaxGemvCols) + ")";
  if (ffn <= 0 || ffn % kGroup != 0) return "ffn " + std::to_string(ffn) + " is not a multiple of " + std::to_string(kGroup);
  const int64_t experts = routed_plus_shared_experts(E);
  if (a.up.cols != hidden || a.router.cols != hidden || a.down.cols != ffn || a.router.rows != experts ||
      a.gate.rows != experts * ffn || a.up.rows != a.gate.rows || a.down.rows != experts * hidden)
    return "the router and expert matrices do not have the stacked shapes";
  if (!quant_aligned(a.gate) || !quant_aligned(a.up) || !quant_aligned(a.down)) return "the expert arrays are not 16-byte aligned";
  return "";
}

void check_buffers(const MoeDecodeArgs& a, const char* what) {
  check_fused_norm(a.norm, a.x, what);
  if (!a.logits || !a.ids || !a.weights || !a.act || !a.out || !a.barriers)
    throw ::lily::InternalError(std::string(what) + ": logits, ids, weights, act, out and barriers are required");
  if (a.out == a.x || a.out == a.norm.branch || a.out == a.norm.x_out || a.out == a.norm.normed_out || a.norm.x_out == a.x)
    throw ::lily::InternalError(std::string(what) + ": out and x_out must not alias the norm's inputs");
  const MoeNextNorm& nn = a.next_norm;
  if (nn.row.pairs && (!nn.row.sums || !nn.gain || !nn.x_out || !nn.normed_out || !is_aligned(nn.row.pairs, 16) ||
                       !is_aligned(nn.row.sums, 16) || nn.x_out == a.out || nn.x_out == a.norm.x_out ||
                       nn.normed_out == a.out || nn.normed_out == a.norm.x_out || nn.normed_out == nn.x_out ||
                       nn.x_out == a.norm.normed_out))
    throw ::lily::InternalError(std::string(what) + ": the next norm needs a gain, x_out, normed_out and an aligned "
                                "staged row, its outputs aliasing neither out, nor norm.x_out, nor each other, nor "
                                "the block's own normed_out (x_out)");
  if (a.out_proj.w.codes && (!a.out_proj.x || !a.out_proj.y || a.out_proj.y != a.norm.branch ||
                             a.out_proj.x == a.out_proj.y || a.out_proj.y == a.x || a.out_proj.y == a.out))
    throw ::lily::InternalError(std::string(what) + ": the out-projection needs an input and an output that is the "
                                "norm's branch, aliasing neither the input nor the residual nor out");
}

}  // namespace moe
}  // namespace lily::cuda
