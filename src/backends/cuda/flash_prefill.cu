// Causal prefill attention on tensor cores, in the FlashAttention-2 structure (Dao, 2023):
// softmax(q·kᵀ·scale)·V per query head, GQA, the sigmoid output gate fused into the store
// (docs/model.md §3.4; numerics docs/cuda.md).
//
// One CTA of 8 warps serves one kv head and a tile of 128 (query row, head) pairs: the G query
// heads of the kv head times 128/G consecutive tokens (16 tokens for the 35B-A3B's G = 8), so
// each K/V tile streamed into shared memory is used by every query head that reads it.
// M row m of the tile is head m / (128/G), token m % (128/G); warp w owns M rows 16w … 16w+15
// (one head, 16 consecutive tokens).
//
// Per tile of 64 keys (K and V double-buffered by cp.async, the next tile's copies in flight
// while this one is used):
//   1. S = Q·Kᵀ with mma.sync m16n8k16 (bf16 in, fp32 out): Q and K fragments by ldmatrix from
//      XOR-swizzled tiles (16-byte chunk c of row r stored at c ^ (r mod 8): conflict-free);
//   2. the causal mask (key > position, or past the keys this CTA needs) only on the tiles that
//      cross the diagonal;
//   3. online softmax in fp32 in the log2 domain: a row's running max m and sum l; the
//      probabilities are rounded to bf16 (they are the A operand of the next product), and l sums
//      the rounded values, so the output is exactly the weighted mean of the weights used;
//   4. O += P·V, P straight from the S accumulators (the m16n8 C layout of two n-blocks is the
//      A layout of one k-step), V fragments by transposing ldmatrix.
// Key tiles start at absolute key 0 and run in increasing order for every row, and a masked key
// adds exactly nothing, so a row's result does not depend on how the prompt was cut into
// chunks. Tiles past a warp's last row are skipped; CTAs run the longest query tiles first.
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kFlashThreads = 256;                    // 8 warps
constexpr int kFlashWarps = kFlashThreads / kWarp;
constexpr int kBlockM = kFlashWarps * 16;             // (row, head) pairs per CTA
constexpr int kBlockN = 64;                           // keys per K/V tile
constexpr int kScoreBlocks = kBlockN / 8;             // m16n8 accumulators of one S row block
constexpr float kLog2e = 1.4426950408889634f;

/// Element offset of 16-byte chunk `c` of row `r` in a swizzled [rows][kD] bf16 tile.
template <int kD>
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * kD + ((c ^ (r & 7)) << 3);
}

/// Dynamic shared memory of one CTA: Q [kBlockM][kD], K and V [2][kBlockN][kD], bf16.
template <int kD>
constexpr size_t flash_smem_bytes() {
  return size_t(kBlockM + 4 * kBlockN) * kD * sizeof(bf16);
}

/// Grid (query tile, kv head); T rows at positions base …; see the file comment.
///   q [T, nq, kD] bf16; gate row t at gate + t·gate_stride, head h's gate at h·2kD + kD (null:
///   no gate); K/V cache [nkv, capacity, kD] bf16; out [T, nq, kD] bf16.
template <int G, int kD>
__global__ void __launch_bounds__(kFlashThreads, 1)
flash_prefill_kernel(int T, int nq, float scale_log2, int64_t base, const bf16* __restrict__ q,
                     const bf16* __restrict__ gate, int64_t gate_stride,
                     const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                     int64_t capacity, bf16* __restrict__ out) {
  constexpr int kTq = kBlockM / G;  // tokens per CTA
  constexpr int kChunks = kD / 8;   // 16-byte chunks per row
  constexpr int kDn = kD / 8;       // m16n8 accumulators of one O row block
  static_assert(kTq % 16 == 0, "a warp's 16 rows must share one head");
  extern __shared__ __align__(128) unsigned char flash_smem[];
  bf16* qs = reinterpret_cast<bf16*>(flash_smem);
  bf16* ks = qs + kBlockM * kD;
  bf16* vs = ks + 2 * kBlockN * kD;

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int r0 = (int(gridDim.x) - 1 - int(blockIdx.x)) * kTq;  // longest tiles first
  const int kvh = blockIdx.y;
  // Positions are below the cache capacity (< 2^31), so 32-bit key arithmetic is exact.
  const int kv_end = int(base) + min(T, r0 + kTq);  // keys [0, kv_end) are needed
  const int n_tiles = (kv_end + kBlockN - 1) / kBlockN;
  const bf16* K = k_cache + int64_t(kvh) * capacity * kD;
  const bf16* V = v_cache + int64_t(kvh) * capacity * kD;

  for (int i = tid; i < kBlockM * kChunks; i += kFlashThreads) {
    const int m = i / kChunks, c = i % kChunks;
    const int tok = r0 + m % kTq, h = kvh * G + m / kTq;
    const bool ok = tok < T;
    cp_async16(qs + swizzled<kD>(m, c), ok ? q + (int64_t(tok) * nq + h) * kD + c * 8 : q, ok ? 16 : 0);
  }
  auto load_kv = [&](int j) {
    const int n0 = j * kBlockN;
    bf16* kt = ks + (j & 1) * kBlockN * kD;
    bf16* vt = vs + (j & 1) * kBlockN * kD;
    for (int i = tid; i < kBlockN * kChunks; i += kFlashThreads) {
      const int n = i / kChunks, c = i % kChunks;
      const bool ok = n0 + n < kv_end;  // rows past it are zeros (the cache there may be garbage)
      const int64_t off = ok ? int64_t(n0 + n) * kD + c * 8 : 0;
      cp_async16(kt + swizzled<kD>(n, c), K + off, ok ? 16 : 0);
      cp_async16(vt + swizzled<kD>(n, c), V + off, ok ? 16 : 0);
    }
  };
  load_kv(0);
  cp_async_commit();  // group 0: Q and the first K/V tile

  const int m0 = warp * 16;
  const int head = kvh * G + m0 / kTq;
  const int tok_a = r0 + m0 % kTq + lane / 4, tok_b = tok_a + 8;  // this lane's two rows
  const int pos_a = int(base) + tok_a, pos_b = int(base) + tok_b;
  const int warp_first = int(base) + r0 + m0 % kTq, warp_last = warp_first + 15;
  float o[kDn][4];
#pragma unroll
  for (int dn = 0; dn < kDn; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) load_kv(j + 1);
    cp_async_commit();
    cp_async_wait<1>();  // tile j (and Q) have landed for this thread …
    __syncthreads();     // … and for every thread
    const int n0 = j * kBlockN;
    if (n0 <= warp_last) {  // warp-uniform: some key of the tile is visible to a row of the warp
      const bf16* kt = ks + (j & 1) * kBlockN * kD;
      const bf16* vt = vs + (j & 1) * kBlockN * kD;
      float s[kScoreBlocks][4];
#pragma unroll
      for (int nb = 0; nb < kScoreBlocks; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
      for (int kd = 0; kd < kD / 16; ++kd) {
        uint32_t a[4];
        ldmatrix_x4(a, qs + swizzled<kD>(m0 + lane % 16, 2 * kd + lane / 16));
#pragma unroll
        for (int nb = 0; nb < kScoreBlocks; nb += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, kt + swizzled<kD>(nb * 8 + lane % 8 + (lane / 16) * 8, 2 * kd + (lane / 8) % 2));
          const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
          mma_bf16_16816(s[nb], a, b_lo);
          mma_bf16_16816(s[nb + 1], a, b_hi);
        }
      }
      if (n0 + kBlockN - 1 > warp_first || n0 + kBlockN > kv_end) {  // the tile crosses the diagonal
#pragma unroll
        for (int nb = 0; nb < kScoreBlocks; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n0 + nb * 8 + 2 * (lane % 4) + (e & 1);
            if (key > (e < 2 ? pos_a : pos_b) || key >= kv_end) s[nb][e] = -INFINITY;
          }
      }
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < kScoreBlocks; ++nb) {
        mx_a = fmaxf(mx_a, fmaxf(s[nb][0], s[nb][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[nb][2], s[nb][3]));
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {  // the 4 lanes of a quad hold one row
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
      }
      // Key 0 is in the first tile and visible to every row, so m is finite from then on.
      const float new_a = fmaxf(m_a, mx_a * scale_log2), new_b = fmaxf(m_b, mx_b * scale_log2);
      const float corr_a = exp2f(m_a - new_a), corr_b = exp2f(m_b - new_b);  // 0 on the first tile
      m_a = new_a;
      m_b = new_b;
      l_a *= corr_a;
      l_b *= corr_b;
#pragma unroll
      for (int dn = 0; dn < kDn; ++dn) {
        o[dn][0] *= corr_a;
        o[dn][1] *= corr_a;
        o[dn][2] *= corr_b;
        o[dn][3] *= corr_b;
      }
      uint32_t p[kScoreBlocks][2];  // bf16x2 probabilities: (row a), (row b) per n-block
#pragma unroll
      for (int nb = 0; nb < kScoreBlocks; ++nb) {
        const float pa0 = round_bf16(exp2f(fmaf(s[nb][0], scale_log2, -m_a)));
        const float pa1 = round_bf16(exp2f(fmaf(s[nb][1], scale_log2, -m_a)));
        const float pb0 = round_bf16(exp2f(fmaf(s[nb][2], scale_log2, -m_b)));
        const float pb1 = round_bf16(exp2f(fmaf(s[nb][3], scale_log2, -m_b)));
        l_a += pa0 + pa1;
        l_b += pb0 + pb1;
        p[nb][0] = pack_bf16x2(pa0, pa1);
        p[nb][1] = pack_bf16x2(pb0, pb1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t a[4] = {p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]};
#pragma unroll
        for (int dn = 0; dn < kDn; dn += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vt + swizzled<kD>(16 * kk + lane % 8 + ((lane / 8) % 2) * 8, dn + lane / 16));
          const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
          mma_bf16_16816(o[dn], a, b_lo);
          mma_bf16_16816(o[dn + 1], a, b_hi);
        }
      }
    }
    __syncthreads();  // buffer j & 1 is refilled by the copies issued in iteration j + 1
  }

#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int tok = half ? tok_b : tok_a;
    if (tok >= T) continue;
    const float inv = 1.0f / (half ? l_b : l_a);
    const bf16* g = gate ? gate + int64_t(tok) * gate_stride + int64_t(head) * 2 * kD + kD : nullptr;
    bf16* dst = out + (int64_t(tok) * nq + head) * kD;
#pragma unroll
    for (int dn = 0; dn < kDn; ++dn) {
      const int d = dn * 8 + 2 * (lane % 4);
      float v0 = o[dn][2 * half] * inv, v1 = o[dn][2 * half + 1] * inv;
      if (g) {
        v0 *= 1.0f / (1.0f + expf(-to_f32(g[d])));
        v1 *= 1.0f / (1.0f + expf(-to_f32(g[d + 1])));
      }
      *reinterpret_cast<uint32_t*>(dst + d) = pack_bf16x2(v0, v1);
    }
  }
}

/// Launches flash_prefill_kernel<G, kD> (its shared memory limit raised on the first launch).
template <int G, int kD>
void launch_flash(const AttnDims& dims, int T, int64_t base, const bf16* q, const bf16* gate,
                  int64_t gate_stride, const KvCacheView& cache, bf16* out, cudaStream_t stream) {
  constexpr size_t smem = flash_smem_bytes<kD>();
  raise_smem_limit(flash_prefill_kernel<G, kD>, smem);
  constexpr int kTq = kBlockM / G;
  const dim3 grid((T + kTq - 1) / kTq, dims.n_kv_heads);
  flash_prefill_kernel<G, kD><<<grid, kFlashThreads, smem, stream>>>(
      T, dims.n_heads, dims.scale() * kLog2e, base, q, gate, gate_stride, cache.k, cache.v, cache.capacity, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_prefill_flash(const AttnDims& dims, int T, int64_t base, const bf16* q, const bf16* gate,
                             int64_t gate_stride, const KvCacheView& cache, bf16* out, cudaStream_t stream) {
  if (base + T > INT32_MAX) throw Error("attention_prefill_flash: positions past 2^31 − 1");
  const int G = dims.n_heads / dims.n_kv_heads;
  auto with_group = [&](auto d) {
    constexpr int kD = decltype(d)::value;
    switch (G) {
      case 1: launch_flash<1, kD>(dims, T, base, q, gate, gate_stride, cache, out, stream); break;
      case 2: launch_flash<2, kD>(dims, T, base, q, gate, gate_stride, cache, out, stream); break;
      case 4: launch_flash<4, kD>(dims, T, base, q, gate, gate_stride, cache, out, stream); break;
      case 8: launch_flash<8, kD>(dims, T, base, q, gate, gate_stride, cache, out, stream); break;
      default: throw Error("attention_prefill_flash: GQA group " + std::to_string(G) + " unsupported");
    }
  };
  switch (dims.head_dim) {
    case 256: with_group(std::integral_constant<int, 256>{}); break;
    case 128: with_group(std::integral_constant<int, 128>{}); break;
    case 64: with_group(std::integral_constant<int, 64>{}); break;
    default: throw Error("attention_prefill_flash: head_dim " + std::to_string(dims.head_dim) + " unsupported");
  }
}

}  // namespace lily::cuda
