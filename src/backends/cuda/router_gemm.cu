// The prefill router as a tensor-core GEMM with fp32 logits: y[m, rows] = x[m, cols]·Wᵀ for
// the 8-bit router ‖ shared-expert-gate matrix (257 × 2048 in Qwen3.6-35B-A3B), every token of a
// prefill chunk at once.
//
// Why a GEMM: the batched CUDA-core GEMV spends about four instructions per weight per token,
// which at 2,048 tokens is half a millisecond per layer for a 0.56 MB matrix. Here the tensor
// cores do the multiply-adds and each code is unpacked once per 32 tokens.
//
// Numerics: the affine formula of the GEMV, per 64-group: y += s·Σ(q·x) + b·Σx in fp32. The
// 8-bit codes are exact small integers, so as bf16 they multiply x exactly; each group's Σ q·x
// and Σ x are fp32 sums from zero over four mma.sync m16n8k16 (Σ x from a ones matrix as the A
// operand). Only the order of the additions inside a group differs from the GEMV, so the logits
// agree with it to fp32 rounding (the tests hold both to an fp64 reference).
//
// Tiles: a block of 4 warps covers 64 weight rows × 32 tokens; warp w owns weight rows
// [16w, 16w + 16) of the tile (the MMA's M) and all 32 tokens as 4 column tiles (the MMA's N)
// (a 2,048-token chunk is 325 blocks: several per SM to hide the loads' latency).
// Fragments straight from the checkpoint layout: inside an MMA the k index may be permuted as long
// as A and B agree. Thread (g = lane/4, t = lane%4) reads the 16 code bytes [16t, 16t + 16) of a
// group for weight rows g and g + 8 (one 16-byte load each), and the 16 bf16 activations of the
// same k for token g of each column tile (two 16-byte loads); MMA j of the group takes k
// 16t + 4j + {0, 1} in its first register pair and 16t + 4j + {2, 3} in its second, on both sides.
#include <string>

#include "backends/cuda/common.cuh"
#include "backends/cuda/kernels.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/quant_mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kRouterWarps = 4;
constexpr int kRouterThreads = kRouterWarps * 32;
constexpr int kRowsPerBlock = 16 * kRouterWarps;  // weight rows
constexpr int kTokenTiles = 4;                    // column tiles of 8 tokens per warp (at most)
constexpr uint32_t kOnesBf16x2 = 0x3F803F80u;     // (1.0, 1.0) as bf16x2

/// The two A registers of one MMA from one code word (codes k, k+1 | k+2, k+3 as exact bf16 pairs).
__device__ __forceinline__ void code_word_pairs(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = pack_bf16x2(code_byte_f32(w, 0), code_byte_f32(w, 1));
  hi = pack_bf16x2(code_byte_f32(w, 2), code_byte_f32(w, 3));
}

/// grid (ceil(m / (8·kTiles)), ceil(rows / 64)), block 128. x bf16 [m, cols], y fp32 [m, rows].
/// See the file comment for the tiling and the numerics. A warp owns kTiles column tiles of 8
/// tokens and keeps kDepth groups' loads in flight: a short prompt gives the GPU only a few warps
/// (5 blocks for 257 rows), each walking all 32 groups, so their load latency is the kernel's
/// time unless several groups are in flight. A token's logits are the same bits for any kTiles
/// and kDepth (its MMA column never meets another token's, the groups add in ascending order).
template <int kTiles, int kDepth>
__global__ void __launch_bounds__(kRouterThreads) router_gemm_kernel(const DeviceQuant w, const bf16* __restrict__ x,
                                                                     int m, float* __restrict__ y) {
  pdl_prologue();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int groups = w.cols / kGroup;
  const int64_t row_lo = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock + warp * 16 + g, row_hi = row_lo + 8;
  // Rows and tokens past the end load a valid neighbour's data and store nothing.
  const int64_t load_lo = min(row_lo, w.rows - 1), load_hi = min(row_hi, w.rows - 1);
  const int tok0 = blockIdx.x * 8 * kTiles;
  const int64_t row_bytes = w.cols;  // 8-bit codes
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w.codes);
  const uint4* c_lo = reinterpret_cast<const uint4*>(codes + load_lo * row_bytes) + t;
  const uint4* c_hi = reinterpret_cast<const uint4*>(codes + load_hi * row_bytes) + t;
  const uint4* x_tok[kTiles];
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    const int tok = min(tok0 + n * 8 + g, m - 1);
    x_tok[n] = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(tok) * w.cols) + 2 * t;
  }

  float acc[kTiles][4];
#pragma unroll
  for (int n = 0; n < kTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const uint32_t ones[4] = {kOnesBf16x2, kOnesBf16x2, kOnesBf16x2, kOnesBf16x2};

  // One group's operands, loaded kDepth − 1 groups ahead of their MMAs so that the latency of
  // the next loads overlaps this group's arithmetic.
  struct GroupLoads {
    uint4 q_lo, q_hi;           // 16 code bytes of rows g and g + 8
    float s_lo, b_lo, s_hi, b_hi;
    uint4 x[kTiles][2];         // k 16t … 16t+15 of token g of each column tile
  };
  auto load_group = [&](int G, GroupLoads& loads) {
    loads.q_lo = __ldg(c_lo + G * 4);  // 64 bytes per group = 4 uint4
    loads.q_hi = __ldg(c_hi + G * 4);
    loads.s_lo = __bfloat162float(w.scales[load_lo * groups + G]);
    loads.b_lo = __bfloat162float(w.biases[load_lo * groups + G]);
    loads.s_hi = __bfloat162float(w.scales[load_hi * groups + G]);
    loads.b_hi = __bfloat162float(w.biases[load_hi * groups + G]);
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      loads.x[n][0] = __ldg(x_tok[n] + G * 8);
      loads.x[n][1] = __ldg(x_tok[n] + G * 8 + 1);
    }
  };

  auto consume = [&](const GroupLoads& loads) {
    uint32_t a[4][4];  // [MMA j][register]
    const uint32_t wl[4] = {loads.q_lo.x, loads.q_lo.y, loads.q_lo.z, loads.q_lo.w};
    const uint32_t wh[4] = {loads.q_hi.x, loads.q_hi.y, loads.q_hi.z, loads.q_hi.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      code_word_pairs(wl[j], a[j][0], a[j][2]);
      code_word_pairs(wh[j], a[j][1], a[j][3]);
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      const uint4 x0 = loads.x[n][0], x1 = loads.x[n][1];
      const uint32_t bw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      float dq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b[2] = {bw[2 * j], bw[2 * j + 1]};
        mma_bf16_16816(dq, a[j], b);
        mma_bf16_16816(dx, ones, b);
      }
      // dq: (row g, tokens 2t, 2t+1), (row g+8, same); dx[0], dx[1]: Σx of tokens 2t, 2t+1.
      acc[n][0] += __fmaf_rn(loads.s_lo, dq[0], __fmul_rn(loads.b_lo, dx[0]));
      acc[n][1] += __fmaf_rn(loads.s_lo, dq[1], __fmul_rn(loads.b_lo, dx[1]));
      acc[n][2] += __fmaf_rn(loads.s_hi, dq[2], __fmul_rn(loads.b_hi, dx[0]));
      acc[n][3] += __fmaf_rn(loads.s_hi, dq[3], __fmul_rn(loads.b_hi, dx[1]));
    }
  };

  // A ring of kDepth groups' loads: group G's slot is refilled with group G + kDepth as soon as
  // its MMAs have read it.
  GroupLoads ring[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    if (d < groups) load_group(d, ring[d]);
  for (int G0 = 0; G0 < groups; G0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (G0 + d >= groups) break;
      consume(ring[d]);
      if (G0 + d + kDepth < groups) load_group(G0 + d + kDepth, ring[d]);
    }
  }


#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = i < 2 ? row_lo : row_hi;
      const int tok = tok0 + n * 8 + 2 * t + (i & 1);
      if (row < w.rows && tok < m) y[static_cast<int64_t>(tok) * w.rows + row] = acc[n][i];
    }
  }
}

}  // namespace

bool router_gemm_supported(const DeviceQuant& w) {
  return w.bits == 8 && w.cols > 0 && w.cols % kGroup == 0 && w.rows > 0 && w.rows <= int64_t(65535) * kRowsPerBlock;
}

void launch_router_gemm(const DeviceQuant& w, const bf16* x, int m, float* y, cudaStream_t stream) {
  if (!router_gemm_supported(w))
    throw ::lily::InternalError("launch_router_gemm: needs 8-bit codes, cols a positive multiple of " +
                                std::to_string(kGroup) + " and 1 … 4,194,240 rows; got bits " +
                                std::to_string(w.bits) + ", cols " + std::to_string(w.cols) + ", rows " +
                                std::to_string(w.rows));
  if (m <= 0 || x == nullptr || y == nullptr)
    throw ::lily::InternalError("launch_router_gemm: needs m > 0 and non-null x, y");
  // Column tiles per warp and groups in flight: the full 32-token blocks with two groups in
  // flight for a prefill chunk (several blocks per SM hide the latency), fewer tiles and deeper
  // rings for a short prompt's few blocks.
  const unsigned row_blocks = static_cast<unsigned>(ceil_div(w.rows, static_cast<int64_t>(kRowsPerBlock)));
  auto launch = [&](auto kernel, int tiles) {
    const dim3 grid(static_cast<unsigned>(ceil_div(m, 8 * tiles)), row_blocks);
    launch_pdl(kernel, grid, dim3(kRouterThreads), 0, stream, w, x, m, y);
  };
  if (m <= 8) launch(router_gemm_kernel<1, 8>, 1);
  else if (m <= 16) launch(router_gemm_kernel<2, 6>, 2);
  else if (m <= 24) launch(router_gemm_kernel<3, 4>, 3);
  else launch(router_gemm_kernel<kTokenTiles, 2>, kTokenTiles);
}

}  // namespace lily::cuda
