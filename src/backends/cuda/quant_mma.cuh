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

/// Eight bf16 columns c0 … c0 + 7 (c0 a multiple of 8, as loaded: 16 bytes) in fragment order:
/// the pairs (c0 + s, c0 + s + 4), s < 4, which are fragment pairs c0 / 2 … c0 / 2 + 3
/// (fragment_pair_column).
__device__ __forceinline__ uint4 fragment_order(const uint4& w) {
  return make_uint4(__byte_perm(w.x, w.z, 0x5410), __byte_perm(w.x, w.z, 0x7632), __byte_perm(w.y, w.w, 0x5410),
                    __byte_perm(w.y, w.w, 0x7632));
}

}  // namespace lily::cuda
