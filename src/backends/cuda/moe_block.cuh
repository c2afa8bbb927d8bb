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
/// and biases) and of one down tile (16 code rows of ffn / 2 bytes, then scales and biases), as
/// they travel (the bulk copies' byte count).
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

// A staged tile's code rows sit either back to back (slot s at s · row_bytes: the 8 gate rows,
// the 8 up rows or the 16 down rows arrive in one bulk copy each) or padded: in chunks of two
// rows, chunk c at c · (2 · row_bytes + 32), MMA row slot s (0 … 15, matrix row s of the tile)
// in chunk 4·(s / 8) + s mod 4, first or second half by (s mod 8) / 4, one bulk copy per row. A
// half-warp's fragment loads touch slots g = 0 … 3 (or 8 … 11) at once; with rows a multiple of
// 128 bytes long (every real shape) back-to-back rows put all four on the same shared-memory
// banks (a 4-way conflict on every code load), padded ones start 8 banks apart. The padding
// costs 14 more bulk copies a gate/up tile and 15 a down tile (each takes the issuing warp tens
// of cycles), so it pays
// where a block computes many tiles (the rows kernel), not in the one-token block, whose tiles
// are few and whose copies all go out right after the routing. Scales and biases follow the
// codes, unpadded.
constexpr int kCodeChunkPad = 32;
/// Bytes between two chunks of padded code rows (row_bytes: one code row's bytes).
__host__ __device__ inline int code_chunk_pitch(int row_bytes) { return 2 * row_bytes + kCodeChunkPad; }
/// Offset of MMA row slot s (0 … 15) in a staged tile (see above).
template <bool kPadded>
__host__ __device__ inline int code_slot_offset(int row_bytes, int s) {
  if constexpr (kPadded) return (4 * (s / 8) + s % 4) * code_chunk_pitch(row_bytes) + ((s % 8) / 4) * row_bytes;
  return s * row_bytes;
}
/// Bytes of a staged tile's 16 code rows.
template <bool kPadded>
__host__ __device__ inline int tile_codes_bytes(int row_bytes) {
  return kPadded ? 8 * code_chunk_pitch(row_bytes) : kTileRows * row_bytes;
}
/// Bytes of one shared-memory stage of a gate/up tile and of a down tile.
template <bool kPadded>
__host__ __device__ inline int gate_up_stage_bytes(int hidden) {
  return tile_codes_bytes<kPadded>(hidden / 2) + 4 * kTileRows * (hidden / kGroup);
}
template <bool kPadded>
__host__ __device__ inline int down_stage_bytes(int ffn) {
  return tile_codes_bytes<kPadded>(ffn / 2) + 4 * kTileRows * (ffn / kGroup);
}

/// Bulk copies of one gate/up tile: its code rows (two copies of 8 rows, or one per row when
/// padded), then the gate scales, up scales, gate biases, up biases.
template <bool kPadded>
constexpr int kGateUpTileCopies = (kPadded ? kTileRows : 2) + 4;

/// One warp's share of a gate/up tile request: the tile of expert rows row0 … row0 + 7 (row0 =
/// expert·ffn + 8·chunk) into `stage`, counted on `bar` (one arrival, from part 0): the 8 gate
/// code rows into slots 0–7, the same 8 up rows into slots 8–15, then scales and biases as [16
/// tile rows][groups] each (tile rows 0–7 gate, 8–15 up), so MMA row slot g is gate row row0 + g
/// and slot g + 8 the same up row (tile_view). The warp issues copies part, part + parts, … of
/// kGateUpTileCopies (each copy takes the issuing warp tens of cycles, so several warps share a
/// padded tile's twenty). The arrival and the copies may land in either order (a transaction
/// count may go below zero until the arrival adds the expected bytes). `reuse`: the stage was
/// read before, by threads that have passed a barrier with this warp (the proxy fence orders
/// their loads before the copies).
template <bool kPadded>
__device__ __forceinline__ void request_gate_up_part(const MoeDecodeArgs& a, int64_t row0, unsigned char* stage,
                                                     uint64_t* bar, int part, int parts, bool reuse = false) {
  const int lane = threadIdx.x % kWarp;
  const int hidden = a.gate.cols, row_bytes = hidden / 2, groups = hidden / kGroup;
  const int half_rows = kTileRows / 2;
  constexpr int code_copies = kGateUpTileCopies<kPadded> - 4;
  if (part == 0 && lane == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(gate_up_tile_bytes(hidden)));
  __syncwarp();
  if (reuse) fence_proxy_async_shared();
  const int c = part + lane * parts;  // this lane's copy
  if (c < code_copies) {
    const int s = kPadded ? c : c * half_rows;  // the first slot of the copy
    const DeviceQuant& w = s < half_rows ? a.gate : a.up;
    bulk_copy_to_shared(stage + code_slot_offset<kPadded>(row_bytes, s),
                        reinterpret_cast<const unsigned char*>(w.codes) + (row0 + s % half_rows) * row_bytes,
                        static_cast<uint32_t>((kPadded ? 1 : half_rows) * row_bytes), bar);
  } else if (c < kGateUpTileCopies<kPadded>) {
    const int q = c - code_copies;
    const bool up = q % 2 == 1;
    const DeviceQuant& w = up ? a.up : a.gate;
    const bf16* src = (q < 2 ? w.scales : w.biases) + row0 * groups;
    unsigned char* dst = stage + tile_codes_bytes<kPadded>(row_bytes) + (q >= 2 ? kTileRows * groups * 2 : 0) +
                         (up ? half_rows * groups * 2 : 0);
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(half_rows * groups * 2), bar);
  }
}

/// One warp requests a whole gate/up tile (request_gate_up_part's only part).
template <bool kPadded>
__device__ __forceinline__ void request_gate_up_tile(const MoeDecodeArgs& a, int64_t row0, unsigned char* stage,
                                                     uint64_t* bar, bool reuse = false) {
  request_gate_up_part<kPadded>(a, row0, stage, bar, 0, 1, reuse);
}

/// Bulk copies of one down tile: its code rows (one copy, or one per row when padded), its
/// scales, its biases.
template <bool kPadded>
constexpr int kDownTileCopies = (kPadded ? kTileRows : 1) + 2;

/// One lane of a warp's down tile request: copy q (0 … kDownTileCopies − 1) of the tile of
/// output rows row0 … row0 + 15 of the stacked down matrix into `stage` (the code rows first,
/// then the scales, then the biases), counted on `bar`.
template <bool kPadded>
__device__ __forceinline__ void copy_down_item(const MoeDecodeArgs& a, int64_t row0, int q, unsigned char* stage,
                                               uint64_t* bar) {
  const int row_bytes = a.ffn / 2, groups = a.ffn / kGroup;
  const int code_copies = kDownTileCopies<kPadded> - 2;
  if (q < code_copies) {
    const int rows = kTileRows / code_copies;
    bulk_copy_to_shared(stage + code_slot_offset<kPadded>(row_bytes, q * rows),
                        reinterpret_cast<const unsigned char*>(a.down.codes) + (row0 + q * rows) * row_bytes,
                        static_cast<uint32_t>(rows * row_bytes), bar);
  } else {
    bulk_copy_to_shared(stage + tile_codes_bytes<kPadded>(row_bytes) + (q - code_copies) * kTileRows * groups * 2,
                        (q == code_copies ? a.down.scales : a.down.biases) + row0 * groups,
                        static_cast<uint32_t>(kTileRows * groups * 2), bar);
  }
}

/// One thread's view of a stage (16 code rows, then [16][groups] scales, then biases) for its
/// MMA row slots g and g + 8 (tile rows g and g + 8).
struct TileView {
  const unsigned char* code_lo;  ///< this thread's 8 bytes of group 0, slot g's row
  const unsigned char* code_hi;  ///< same, slot g + 8's row
  const bf16 *s_lo, *s_hi, *b_lo, *b_hi;
};

template <bool kPadded>
__device__ __forceinline__ TileView tile_view(const unsigned char* stage, int row_bytes, int groups, int g, int t) {
  TileView v;
  v.code_lo = stage + code_slot_offset<kPadded>(row_bytes, g) + 8 * t;
  v.code_hi = stage + code_slot_offset<kPadded>(row_bytes, g + 8) + 8 * t;
  const bf16* sc = reinterpret_cast<const bf16*>(stage + tile_codes_bytes<kPadded>(row_bytes));
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
        *reinterpret_cast<uint4*>(perm + idx * 4) = fragment_order(w);
        const float4 lo = bf16x4_to_f32(w.x, w.y), hi = bf16x4_to_f32(w.z, w.w);
        part = ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
      }
      part = group_sum(part, 8);
      if (idx < n16 && lane % 8 == 0) sums[idx / 8] = part;
    }
  }
}

/// The weighted combine of one output row of a down tile: Σ_s w[s] · part[s · kTileRows] over
/// the n_sel slots in slot order, an fp32 fma chain from zero (part: the slots' bf16-rounded down
/// outputs for this row, a tile's kTileRows rows apart). Both kernels combine with it, so a row's
/// output has the same bits in either.
__device__ __forceinline__ float combine_slots(const float* w, const float* part, int n_sel) {
  float o = 0.0f;
  for (int s = 0; s < n_sel; ++s) o = __fmaf_rn(w[s], part[s * kTileRows], o);
  return o;
}

/// Records phase `point` of this block in a.trace (diagnostics; no-op when a.trace is null).
__device__ __forceinline__ void trace_point(const MoeDecodeArgs& a, int point) {
  if (a.trace && threadIdx.x == 0) {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    a.trace[int64_t{blockIdx.x} * kMoeTraceSlots + point] = ns;
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
/// at least `smem` (which it is made, when smem ≤ kSmemLimit). Host only.
template <class Layout>
std::string fit_problem(void (*kernel)(MoeDecodeArgs, Layout), int64_t smem) {
  if (smem > kSmemLimit) return "a block's expert tiles need " + std::to_string(smem) + " bytes of shared memory";
  // Raised, never lowered: one kernel may take layouts of several sizes in one step (a model
  // whose GDN and attention out-projections differ in width), and a captured launch of the
  // larger must stay valid after a plan of the smaller.
  raise_smem_limit(kernel, static_cast<size_t>(smem));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, smem));
  if (per_sm < 1) return "a block does not fit on an SM";
  return "";
}

/// The checks both moe_plans start with: why `a` cannot run, each reason after `label` ("fused
/// MoE block: "): `rows_problem` (the kernel's own limit on a.rows, "" when it takes them), then
/// shape_problem; else an empty `why` and the grid (plan_blocks). Host only.
template <class Layout>
MoePlan<Layout> start_plan(const char* label, const MoeDecodeArgs& a, const std::string& rows_problem, int max_blocks) {
  MoePlan<Layout> p;
  if (!rows_problem.empty()) p.why = label + rows_problem;
  else if (std::string why = shape_problem(a); !why.empty()) p.why = label + why;
  else p.blocks = plan_blocks(max_blocks);
  return p;
}

/// The end of both moe_plans: the instance for a's router width (kernel8 for 8-bit, else
/// kernel4), or why no block of p.layout fits an SM (after `label`). Host only.
template <class Layout>
MoePlan<Layout> finish_plan(MoePlan<Layout> p, const char* label, const MoeDecodeArgs& a,
                            void (*kernel8)(MoeDecodeArgs, Layout), void (*kernel4)(MoeDecodeArgs, Layout)) {
  p.kernel = a.router.bits == 8 ? kernel8 : kernel4;
  if (std::string why = fit_problem(p.kernel, p.layout.total); !why.empty()) p.why = label + why;
  return p;
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
