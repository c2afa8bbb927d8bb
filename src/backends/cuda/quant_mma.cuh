// The 4-bit MLX-affine dot product on tensor cores, shared by the decode GEMVs (quant_gemv.cu)
// and the fused decode MoE block (moe_block.cu) (nvcc only).
//
// A warp computes a tile of 16 weight rows × 8 token columns with mma.sync m16n8k16 (bf16 ×
// bf16 → fp32). The 4-bit codes are small exact integers, so they become exact bf16 values by
// OR-ing them into the mantissa of 128. Per 64-group the four MMAs start from zero, so each
// group's Σ q·x is an fp32 sum of exact products, and the caller applies s·Σ(q·x) + b·Σx in
// fp32 (docs/model.md §4.2).
//
// Fragments without repacking the checkpoint layout: the k index inside an MMA may be permuted
// freely as long as A and B use the same permutation. Thread (g = lane/4, t = lane%4) loads the
// 8 bytes at [8t, 8t+8) of a group's 32 bytes for rows g and g+8: words h = 0, 1 holding nibbles
// of k = 16t + 8h + i (i = 0…7). Shifting a word by 4s and masking 0x000F000F gives the pair
// (nibble s, nibble s+4) in one bf16x2; MMA j of the group (h = j/2, s = 2(j%2)) takes pairs s
// and s+1. The activations are staged once in the same order (fragment_pair_column), so each
// thread's B registers are two 16-byte shared loads per group.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/mma.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "model/config.h"

namespace lily::cuda {

/// (128 + nibble 0, 128 + nibble 4) of `w` (the low four bits of each half) as exact bf16 values:
/// nibble_pair_bf16 without the subtraction (the caller folds 128 into the bias:
/// s·Σ(q + 128)·x + (b − 128·s)·Σx). One LOP3 computes (w & mask) | exponent: 0xEA is the truth
/// table of (a & b) | c; the compiler otherwise emits an AND and an OR.
__device__ __forceinline__ uint32_t nibble_pair_bf16_plus128(uint32_t w) {
  uint32_t v;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
  return v;
}

/// Pair (nibble 0, nibble 4) of `w` (the low four bits of each half) as exact bf16 values.
__device__ __forceinline__ uint32_t nibble_pair_bf16(uint32_t w) {
  const uint32_t v = nibble_pair_bf16_plus128(w);  // bf16 128 + q in each half
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

/// D = Σ q·x (kPlus128: Σ (q + 128)·x) of one 64-group for a 16-row × 8-token tile: `lo` / `hi`
/// the thread's code words of rows g and g+8, bw0 / bw1 its staged bf16 activation pairs (file
/// comment); four MMAs from zero.
template <bool kPlus128 = false>
__device__ __forceinline__ void group_mma(const uint2& lo, const uint2& hi, const uint4& bw0, const uint4& bw1,
                                          float (&d)[4]) {
  auto pair = [](uint32_t w) { return kPlus128 ? nibble_pair_bf16_plus128(w) : nibble_pair_bf16(w); };
  d[0] = d[1] = d[2] = d[3] = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int s = 2 * (j % 2);
    const uint32_t wl = j < 2 ? lo.x : lo.y, wh = j < 2 ? hi.x : hi.y;
    const uint32_t a[4] = {pair(wl >> (4 * s)), pair(wh >> (4 * s)), pair(wl >> (4 * s + 4)), pair(wh >> (4 * s + 4))};
    const uint4& bw = j < 2 ? bw0 : bw1;
    const uint32_t b[2] = {s == 0 ? bw.x : bw.z, s == 0 ? bw.y : bw.w};
    mma_bf16_16816(d, a, b);
  }
}

/// group_mma for kBlocks column blocks of eight tokens against the same 16 weight rows: the A
/// fragments are formed once per MMA step and block c's four MMAs (from zero, in group_mma's
/// order) take bw0[c], bw1[c] into d[c]. An MMA's output column depends only on its own B
/// column, so d[c] is the bits group_mma gives block c alone.
template <bool kPlus128, int kBlocks>
__device__ __forceinline__ void group_mma_blocks(const uint2& lo, const uint2& hi, const uint4 (&bw0)[kBlocks],
                                                 const uint4 (&bw1)[kBlocks], float (&d)[kBlocks][4]) {
  auto pair = [](uint32_t w) { return kPlus128 ? nibble_pair_bf16_plus128(w) : nibble_pair_bf16(w); };
#pragma unroll
  for (int c = 0; c < kBlocks; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int s = 2 * (j % 2);
    const uint32_t wl = j < 2 ? lo.x : lo.y, wh = j < 2 ? hi.x : hi.y;
    const uint32_t a[4] = {pair(wl >> (4 * s)), pair(wh >> (4 * s)), pair(wl >> (4 * s + 4)), pair(wh >> (4 * s + 4))};
#pragma unroll
    for (int c = 0; c < kBlocks; ++c) {
      const uint4& bw = j < 2 ? bw0[c] : bw1[c];
      const uint32_t b[2] = {s == 0 ? bw.x : bw.z, s == 0 ? bw.y : bw.w};
      mma_bf16_16816(d[c], a, b);
    }
  }
}

/// acc + (s·D + b·Σx) with every rounding explicit: one 64-group's affine term of a weight row
/// (s, b its scale and bias, D the group's Σ q·x, x its Σx; docs/model.md §4.2). The streaming
/// GEMV and both MoE blocks use it, so a row gets the same bits in whichever kernel or fragment
/// register computes it.
__device__ __forceinline__ float affine_add(float acc, float s, float d, float b, float x) {
  return __fadd_rn(acc, __fmaf_rn(s, d, __fmul_rn(b, x)));
}

/// Code byte `i` (0 … 3) of `w` as an exact fp32 value (0 … 255): the byte placed in the
/// mantissa of 2^23, then 2^23 subtracted.
__device__ __forceinline__ float code_byte_f32(uint32_t w, int i) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | static_cast<uint32_t>(i))) - 8388608.0f;
}

/// D = Σ q·x of one 64-group for a 16-row × 8-token tile with 8-bit codes, against the same
/// staged activation pairs as group_mma: `lo` / `hi` the thread's 16 code bytes [16t, 16t + 16)
/// of rows g and g + 8 (byte i of word j is code k = 16t + 4j + i). Activation pair (c, c + 4)
/// meets code pair (q_c, q_{c+4}), bytes i of words j and j + 1, so MMA j of the group takes
/// bytes 2(j mod 2) and 2(j mod 2) + 1 of words 2(j / 2) and 2(j / 2) + 1. Four MMAs from zero;
/// the codes are exact in bf16 (8 significant bits).
__device__ __forceinline__ void group_mma_8bit(const uint4& lo, const uint4& hi, const uint4& bw0, const uint4& bw1,
                                               float (&d)[4]) {
  const uint32_t wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
  auto pair = [](uint32_t w0, uint32_t w1, int i) { return pack_bf16x2(code_byte_f32(w0, i), code_byte_f32(w1, i)); };
  d[0] = d[1] = d[2] = d[3] = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = 2 * (j / 2), i0 = 2 * (j % 2);
    const uint32_t a[4] = {pair(wl[w], wl[w + 1], i0), pair(wh[w], wh[w + 1], i0), pair(wl[w], wl[w + 1], i0 + 1),
                           pair(wh[w], wh[w + 1], i0 + 1)};
    const uint4& bw = j < 2 ? bw0 : bw1;
    const uint32_t b[2] = {j % 2 == 0 ? bw.x : bw.z, j % 2 == 0 ? bw.y : bw.w};
    mma_bf16_16816(d, a, b);
  }
}

/// Column of the lower element of staged activation pair `i` (i < cols / 2) in fragment order:
/// pair i holds columns c and c + 4 (file comment). Group G = i / 32 covers pairs [32G, 32G + 32),
/// and thread t's eight pairs of a group are [32G + 8t, 32G + 8t + 8).
__host__ __device__ inline int fragment_pair_column(int i) {
  const int G = i / 32, tt = (i % 32) / 8, h = (i % 8) / 4, s = i % 4;
  return G * kQuantGroupSize + 16 * tt + 8 * h + s;
}

/// The fragment-order bf16 pairs of one staged row (xs: fp32, group g at xs[g·kGroupStride], as
/// stage_row and stage_norm_row leave it): pairs[i] = (column c, column c + 4) with c =
/// fragment_pair_column(i), for i < cols / 2. The block's threads stride over i; no barrier.
__device__ __forceinline__ void pack_fragment_pairs(const float* xs, int cols, uint32_t* pairs) {
  for (int i = threadIdx.x; i < cols / 2; i += blockDim.x) {
    const int c = fragment_pair_column(i);
    const float* xg = xs + (c / kGroup) * kGroupStride + c % kGroup;
    pairs[i] = pack_bf16x2(xg[0], xg[4]);
  }
}

/// The row shape stage_norm_fragments_fixed is instantiated for: the model's hidden size on
/// 256 threads (launch_add_rmsnorm's element-to-thread mapping).
constexpr int kFixedNormThreads = 256;
constexpr int kFixedNormCols = kStageBatch * kFixedNormThreads;

/// stage_norm_row for a row of exactly kStageBatch·kThreads columns held by threads 0 …
/// kThreads − 1 (hidden 2048 on 256 threads), with the shape known at compile time: no bounds
/// checks, constant staging addresses, and the group sums and fragment-order pairs formed in one
/// pass (a warp per group) instead of stage_group_sums followed by pack_fragment_pairs. Every
/// value is computed by the same expression in the same order as there (the same bits). In the
/// streaming GEMV the generic path's staging executed 767 instructions a warp, mostly index
/// arithmetic, compares and branches. Ends with __syncthreads().
template <int kThreads, bool kL2Branch, bool kL2X>
__device__ __forceinline__ void stage_norm_fragments_fixed(const bf16* __restrict__ x, const FusedNorm& norm, bool store,
                                                           float* xs, float* xsum, uint32_t* pairs, uint64_t* stamp) {
  constexpr int kCols = kStageBatch * kThreads;
  static_assert(kThreads % kGroup == 0, "a thread's elements keep its column within the group");
  __shared__ float scratch[32];
  const int i = threadIdx.x;
  const bool holds = i < kThreads;
  NormRowRegs r;
  float ss = 0.0f;
  if (holds) {  // norm_row_load's loads and Σh², every load issued before any is used
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int c = i + u * kThreads;
      const float v = kL2X ? to_f32(__ldcg(x + c)) : to_f32(x[c]);
      const float b = norm.branch ? load_branch<kL2Branch>(norm.branch, c) : 0.0f;
      r.gain[u] = norm.gain[c];
      r.h[u] = norm.branch ? round_bf16(v + b) : v;
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) ss += r.h[u] * r.h[u];
  }
  if (stamp && i == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(*stamp) : "f"(ss));
  const float total = block_sum(ss, scratch);
  if (holds) {  // norm_row_store
    const float rs = 1.0f / sqrtf(total / static_cast<float>(kCols) + norm.eps);
    float* xi = xs + (i / kGroup) * kGroupStride + i % kGroup;
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const bf16 y = to_bf16(r.h[u] * rs * r.gain[u]);
      xi[u * (kThreads / kGroup) * kGroupStride] = to_f32(y);
      if (store) {
        norm.x_out[i + u * kThreads] = to_bf16(r.h[u]);
        norm.normed_out[i + u * kThreads] = y;
      }
    }
  }
  __syncthreads();
  // Warp w: groups w, w + warps, …; lane l forms the group's sum (group_sum_x) and its pair
  // 32·G + l (fragment_pair_column).
  const int lane = i % kWarp, n_warps = static_cast<int>(blockDim.x) / kWarp;
  const int pc = 16 * (lane / 8) + 8 * (lane % 8 / 4) + lane % 4;
  for (int G = i / kWarp; G < kCols / kGroup; G += n_warps) {
    const float* xg = xs + G * kGroupStride;
    const float sum = group_sum_x(xg[lane], xg[lane + 32]);
    if (lane == 0) xsum[G] = sum;
    pairs[G * 32 + lane] = pack_bf16x2(xg[pc], xg[pc + 4]);
  }
  __syncthreads();
}

/// stage_norm_fragments for any row shape: stage_norm_row, then pack_fragment_pairs, then a
/// barrier.
template <bool kL2Branch = false, bool kL2X = false>
__device__ __forceinline__ void stage_norm_fragments_generic(const bf16* __restrict__ x, const FusedNorm& norm, int cols,
                                                             bool store, float* xs, float* xsum, uint32_t* pairs,
                                                             int threads = 0, uint64_t* stamp = nullptr) {
  stage_norm_row<kL2Branch, kL2X>(x, norm, cols, store, xs, xsum, threads, stamp);
  pack_fragment_pairs(xs, cols, pairs);
  __syncthreads();
}

/// stage_norm_row, then the row's fragment-order pairs (pack_fragment_pairs): xs (fp32, group
/// g at xs[g·kGroupStride]), xsum [cols / 64] and pairs [cols / 2] in shared memory, the same
/// bits on either path. `threads`, `store`, `stamp`, kL2Branch, kL2X as stage_norm_row. A row
/// of kFixedNormCols on kFixedNormThreads takes stage_norm_fragments_fixed (a kernel that only
/// ever sees that shape calls it directly: the two paths inlined together cost the streaming
/// GEMV registers and spills). All threads of the block; ends with __syncthreads().
template <bool kL2Branch = false, bool kL2X = false>
__device__ __forceinline__ void stage_norm_fragments(const bf16* __restrict__ x, const FusedNorm& norm, int cols,
                                                     bool store, float* xs, float* xsum, uint32_t* pairs,
                                                     int threads = 0, uint64_t* stamp = nullptr) {
  const int stride = threads > 0 ? threads : static_cast<int>(blockDim.x);
  if (stride == kFixedNormThreads && cols == kFixedNormCols) {
    stage_norm_fragments_fixed<kFixedNormThreads, kL2Branch, kL2X>(x, norm, store, xs, xsum, pairs, stamp);
    return;
  }
  stage_norm_fragments_generic<kL2Branch, kL2X>(x, norm, cols, store, xs, xsum, pairs, threads, stamp);
}

/// Eight bf16 columns c0 … c0 + 7 (c0 a multiple of 8, as loaded: 16 bytes) in fragment order:
/// the pairs (c0 + s, c0 + s + 4), s < 4, which are fragment pairs c0 / 2 … c0 / 2 + 3
/// (fragment_pair_column).
__device__ __forceinline__ uint4 fragment_order(const uint4& w) {
  return make_uint4(__byte_perm(w.x, w.z, 0x5410), __byte_perm(w.x, w.z, 0x7632), __byte_perm(w.y, w.w, 0x5410),
                    __byte_perm(w.y, w.w, 0x7632));
}

}  // namespace lily::cuda
