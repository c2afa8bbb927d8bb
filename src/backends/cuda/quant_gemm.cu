// Tensor-core W4A16 / W8A16 GEMM for prefill on MLX affine weights (docs/model.md §2.2,
// §4.2, tensor-core GEMM row): dense projections and grouped
// expert GEMMs; the default prefill path (CudaOptions::tensor_core_gemm). Tests:
// tests/gpu/test_quant_gemm.cu (docs/cuda.md).
//
// Three kernels, chosen by gemm_kernel() (set from CudaOptions::gemm_kernel, LILY_CUDA_GEMM_KERNEL):
//   * wgmma_gemm_kernel (the default, "wgmma-mixed": 256 weight rows per item for the dense and
//     down GEMMs, 128 for gate/up; "wgmma" and "wgmma-narrow" take one width everywhere): the register-
//     dequant kernel's work list on Hopper warpgroup MMAs — the dequantized weights as the
//     register A operand, the token rows read by the tensor cores from shared memory; every
//     4-bit GEMM with bf16 output whose K is a multiple of 512, at any token count, so a token
//     row gets the same bits in a prefill chunk of any length. Short prompts (≤ 32 tokens dense,
//     ≤ 16 rows per expert on average grouped) take items of 32 token rows with four CTAs per
//     SM. See "warpgroup MMA" below.
//   * regdq_gemm_kernel ("grouped", "all"): codes dequantized in registers right before
//     mma.sync, a persistent grid over a flat list of (row tile, column tile) work items — see
//     "register dequantization" below: the 4-bit grouped expert GEMMs; with "all" also the
//     dense GEMMs with at least one 64 × 256 item per SM.
//   * quant_gemm_kernel (8-bit weights, 4-bit GEMMs the wgmma kernel does not take,
//     LILY_CUDA_GEMM_KERNEL=0): the shared-tile kernel described next.
//
// The shared-tile kernel: one template, three modes:
//   kDense  — y[m, N] = x[m, K]·bf16(W)ᵀ, token rows in grid.x, weight-row tiles in grid.y;
//   kGateUp — per expert row tile: gate and up rows interleaved in the weight tile, SwiGLU epilogue;
//   kDown   — per expert row tile: down rows, per-slot bf16 outputs (combined in slot order later).
//
// Block = 8 warps (2 along token rows × 4 along weight rows); CTA tile BM × BN × BK with BK = 64
// = one quantization group, so each weight row has exactly one (scale, bias) per k-tile.
// Per k-tile:
//   1. cp.async (16-byte, zero-fill for masked rows) stages the activation tile [BM, 64] bf16 and
//      the raw code tile [BN, 64·bits/32] u32 into a ring of 3 (BM 128), 4 (BM 64) or 6 (BM 32)
//      stages, so 2–5 tiles are in flight while one is computed; scales/biases of the next tile
//      are prefetched into registers.
//   2. The block dequantizes the code tile once into a bf16 tile [BN, 64] in shared memory:
//      w = bf16(fmaf(s, q, b)) — s·q is exact in fp32 (8 + 8 significant bits), so this is the
//      CPU's fp32 s·q + b rounded once to bf16.
//   3. Each warp runs mma.sync.m16n8k16 (bf16 in, fp32 accumulate) over its (BM/2) × (BN/4)
//      sub-tile, loading fragments with plain 32-bit shared loads in the PTX fragment layout.
// Shared rows are padded to 72 bf16 (144 B): fragment loads of a warp (8 rows × 4 words) then
// hit 32 distinct banks, and 16-byte dequant stores stay aligned.
//
// Tile choice (m = tokens per prefill chunk, up to CudaOptions::prefill_chunk, 4,096 by default; N = weight rows, 512 … 248320):
//   * BK = 64: one group per k-tile (above); K = 2048 / 4096 / 512 → 32 / 64 / 8 k-tiles.
//   * BN = 128 weight rows: a 4-bit code tile is 4 KiB, the dequantized tile 18 KiB; BN = 64 only
//     when 128 would leave SMs idle (e.g. out_proj N = 2048 at m = 256: 2 × 16 = 32 CTAs with
//     BM = 128, BN = 128, but 4 × 32 = 128 with BM = 64, BN = 64).
//   * BM = 128 tokens when the grid still covers the 132 SMs (m = 256 and N ≥ 8448: qkv|z|a|b
//     12352 → 194 CTAs, attention q|k|v 9216 → 144), else 64; m ≤ 32 → 32 (less MMA padding
//     for small tails). Each weight tile is dequantized once per CTA and re-read ceil(m/BM) times
//     from L2 (every projection matrix, ≤ 14 MB, fits the 50 MB L2).
//   * Shared memory: stages·(BM·144 + BN·32·bits/4) + BN·144 bytes: 84 KiB at (128, 128, 4-bit),
//     70 KiB at (32, 128, 4-bit, 6 stages), ≤ 96 KiB for 8-bit: 2 CTAs per SM (also the
//     register limit at BM = 128: 64 fp32 accumulators per thread).
//   * Grouped experts: BN = 128 (gate/up: 64 gate + 64 up rows → 64 act columns per CTA; down:
//     128 hidden columns), BM = 32 when an expert gets < 48 rows on average (m = 256, top-8 of
//     256: ≈ 8 rows per expert), else 64.
#include <algorithm>
#include <atomic>
#include <string>

#include "backends/cuda/common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/quant_gemm.h"
#include "backends/cuda/wgmma.cuh"

namespace lily::cuda {
namespace {

constexpr int kGemmThreads = 256;  // 8 warps: 2 along M (token rows) × 4 along N (weight rows)
constexpr int kBK = kGroup;        // one quantization group per k-tile
constexpr int kLd = kBK + 8;       // padded shared row: 72 bf16 = 144 B
/// cp.async pipeline depth for a row-tile height (tiles in flight: stages − 1). Small BM means
/// little arithmetic per weight byte (m ≤ 32, or experts with a few rows each at m = 256): deeper
/// pipelines keep more weight bytes in flight per SM for the bandwidth-bound cases.
constexpr int stages_for(int bm) { return bm >= 128 ? 3 : (bm >= 64 ? 4 : 6); }
constexpr int kMaxGroups = 2048;   // grouping scan: 1024 threads × 2 experts

enum class Mode { kDense, kGateUp, kDown };

/// Kernel arguments (by value). Grouped modes read `grouping` (quant_gemm.h layout).
struct GemmParams {
  DeviceQuant w0;            ///< dense: W; gate/up: gate stack; down: down stack
  DeviceQuant w1;            ///< gate/up: up stack (unused otherwise)
  const bf16* a = nullptr;   ///< dense / gate-up: x [m, K]; down: act [m·n_sel, K]
  int m = 0;                 ///< token rows
  int K = 0;                 ///< input features (w0.cols)
  int64_t n = 0;             ///< output width: dense: w0.rows; gate/up: ffn; down: hidden
  bf16* y_bf16 = nullptr;    ///< dense (bf16) / act (gate-up) / slot_out (down)
  float* y_f32 = nullptr;    ///< dense fp32 output
  const int32_t* grouping = nullptr;
  int n_groups = 0;
  int n_sel = 1;
  int col_tiles = 0;         ///< register-dequant grouped kernel: column tiles per row tile
};

// ---- PTX wrappers --------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

/// Exact fp32 value of a small unsigned code (q < 2^23) without an int→float instruction.
__device__ __forceinline__ float code_to_f32(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

template <int BITS, int BM, int BN>
constexpr size_t gemm_smem_bytes() {
  constexpr int kStages = stages_for(BM);
  return size_t(kStages) * BM * kLd * sizeof(bf16) + size_t(BN) * kLd * sizeof(bf16) +
         size_t(kStages) * BN * (kBK * BITS / 32) * sizeof(uint32_t);
}

/// Stores output columns col, col+1 of one row (masked at n; paired when aligned).
template <class OutT>
__device__ __forceinline__ void store_pair(OutT* row, int64_t col, int64_t n, float v0, float v1) {
  if (col + 1 < n && (n % 2) == 0) {
    if constexpr (sizeof(OutT) == 4) *reinterpret_cast<float2*>(row + col) = make_float2(v0, v1);
    else *reinterpret_cast<__nv_bfloat162*>(row + col) = __floats2bfloat162_rn(v0, v1);
  } else {
    if (col < n) store_out(row, col, v0);
    if (col + 1 < n) store_out(row, col + 1, v1);
  }
}

/// Zeroes an fp32 accumulator array of any rank, every loop unrolled.
__device__ __forceinline__ void zero_acc(float& v) { v = 0.0f; }
template <class T, int N>
__device__ __forceinline__ void zero_acc(T (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) zero_acc(a[i]);
}

/// Starts a cp.async pipeline: groups 0 … kGroups − 1, group s holding k-tile s in stage s
/// (load_tile(s, s)); groups past k_tiles are empty, so the group count stays uniform.
template <int kGroups, class LoadTile>
__device__ __forceinline__ void prime_pipeline(int k_tiles, LoadTile& load_tile) {
#pragma unroll
  for (int s = 0; s < kGroups; ++s) {
    if (s < k_tiles) load_tile(s, s);
    cp_async_commit();
  }
}

// ---- the GEMM kernel -------------------------------------------------------------------------------

/// grid: dense (ceil(m/BM), ceil(N/BN)); grouped (max row tiles, column tiles). See file comment.
template <int BITS, int BM, int BN, Mode MODE, class OutT>
__global__ void __launch_bounds__(kGemmThreads, 2) quant_gemm_kernel(const GemmParams p) {
  constexpr int WPG = kBK * BITS / 32;           // code words per weight row per k-tile (8 / 16)
  constexpr int PER = 32 / BITS;                 // codes per word (8 / 4)
  constexpr int CPR = WPG / 4;                   // 16-byte code chunks per row per k-tile
  constexpr int WM = BM / 2, WN = BN / 4;        // warp sub-tile
  constexpr int MT = WM / 16, NT = WN / 8;       // m16 / n8 fragments per warp
  constexpr int AJ = BM * (kBK / 8) / kGemmThreads;           // activation chunks per thread
  constexpr int BJ = (BN * CPR + kGemmThreads - 1) / kGemmThreads;  // code chunks per thread (max)
  constexpr int DQ = BN * WPG / kGemmThreads;    // code words dequantized per thread
  constexpr int kStages = stages_for(BM);
  static_assert(BM % 32 == 0 && BN % 64 == 0, "tile shape");
  static_assert(AJ >= 1 && BM * (kBK / 8) % kGemmThreads == 0, "activation chunks per thread");
  static_assert(DQ >= 1 && BN * WPG % kGemmThreads == 0, "dequant words per thread");
  static_assert(MODE != Mode::kGateUp || NT % 2 == 0, "gate/up fragments come in pairs");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);               // [kStages][BM][kLd] activations
  bf16* ws = xs + kStages * BM * kLd;                          // [BN][kLd] dequantized weights
  uint32_t* cs = reinterpret_cast<uint32_t*>(ws + BN * kLd);  // [kStages][BN][WPG] raw codes

  const int tid = threadIdx.x;
  const int groups = p.K / kBK;
  const int k_tiles = groups;
  const int wpr = p.K * BITS / 32;

  // Token rows of this block: positions [row_begin, row_begin + row_count) of the token index
  // (dense) or of the expert-sorted assignment order (grouped); weight rows from w_base.
  int row_begin = 0, row_count = 0;
  int64_t w_base = 0;
  const int32_t* order = nullptr;
  if constexpr (MODE == Mode::kDense) {
    row_begin = blockIdx.x * BM;
    row_count = min(BM, p.m - row_begin);
  } else {
    const int32_t* offsets = p.grouping;
    const int32_t* tiles = p.grouping + p.n_groups + 1;
    order = p.grouping + 2 * (p.n_groups + 1);
    const int tile = blockIdx.x;
    if (tile >= tiles[p.n_groups]) return;  // whole block exits: more tiles launched than exist
    int lo = 0, hi = p.n_groups - 1;        // the largest e with tiles[e] ≤ tile has tile in range
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tiles[mid] <= tile) lo = mid;
      else hi = mid - 1;
    }
    row_begin = offsets[lo] + (tile - tiles[lo]) * BM;
    row_count = min(BM, offsets[lo + 1] - row_begin);
    w_base = static_cast<int64_t>(lo) * p.n;
  }
  // Output columns of this block: dense/down n0…n0+BN−1; gate/up act columns n0…n0+BN/2−1.
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (MODE == Mode::kGateUp ? BN / 2 : BN);

  // Weight row behind shared tile row r (−1 if masked); `up` selects w1 (gate/up mode: tile rows
  // 16j…16j+7 are gate rows n0+8j…, rows 16j+8…16j+15 the up rows of the same columns).
  auto weight_row = [&](int r, bool& up) -> int64_t {
    up = false;
    if constexpr (MODE == Mode::kGateUp) {
      const int64_t i = n0 + (r / 16) * 8 + r % 8;
      up = ((r / 8) & 1) != 0;
      return i < p.n ? w_base + i : -1;
    } else {
      return n0 + r < p.n ? w_base + n0 + r : -1;
    }
  };

  // Per-thread sources, fixed for the whole K loop.
  const bf16* a_src[AJ];
#pragma unroll
  for (int j = 0; j < AJ; ++j) {
    const int c = tid + j * kGemmThreads, r = c / (kBK / 8), ch = c % (kBK / 8);
    a_src[j] = nullptr;
    if (r < row_count) {
      int64_t arow;
      if constexpr (MODE == Mode::kDense) arow = row_begin + r;
      else if constexpr (MODE == Mode::kGateUp) arow = order[row_begin + r] / p.n_sel;
      else arow = order[row_begin + r];
      a_src[j] = p.a + arow * p.K + ch * 8;
    }
  }
  const uint32_t* b_src[BJ];
#pragma unroll
  for (int j = 0; j < BJ; ++j) {
    const int c = tid + j * kGemmThreads, r = c / CPR, ch = c % CPR;
    b_src[j] = nullptr;
    if (c < BN * CPR) {
      bool up;
      const int64_t wr = weight_row(r, up);
      if (wr >= 0) b_src[j] = (up ? p.w1.codes : p.w0.codes) + wr * wpr + ch * 4;
    }
  }
  auto load_tile = [&](int kt, int stage) {
    bf16* xst = xs + stage * BM * kLd;
#pragma unroll
    for (int j = 0; j < AJ; ++j) {
      const int c = tid + j * kGemmThreads, r = c / (kBK / 8), ch = c % (kBK / 8);
      cp_async16(xst + r * kLd + ch * 8, a_src[j] ? a_src[j] + kt * kBK : p.a, a_src[j] ? 16 : 0);
    }
    uint32_t* cst = cs + stage * BN * WPG;
#pragma unroll
    for (int j = 0; j < BJ; ++j) {
      const int c = tid + j * kGemmThreads;
      if (c < BN * CPR)
        cp_async16(cst + c * 4, b_src[j] ? b_src[j] + kt * WPG : p.w0.codes, b_src[j] ? 16 : 0);
    }
  };
  // Scale and bias of tile row r's weight row for k-tile kt, as raw bf16 bits packed
  // (scale low, bias high); 0 (w = 0) for masked rows. Recomputed per k-tile to save registers.
  auto load_scales = [&](int kt, uint32_t (&sb)[DQ]) {
#pragma unroll
    for (int j = 0; j < DQ; ++j) {
      bool up;
      const int64_t wr = weight_row((tid + j * kGemmThreads) / WPG, up);
      sb[j] = 0;
      if (wr >= 0) {
        const int64_t idx = wr * groups + kt;
        const bf16 s = (up ? p.w1.scales : p.w0.scales)[idx], b = (up ? p.w1.biases : p.w0.biases)[idx];
        sb[j] = static_cast<uint32_t>(__bfloat16_as_ushort(s)) | (static_cast<uint32_t>(__bfloat16_as_ushort(b)) << 16);
      }
    }
  };

  float acc[MT][NT][4];
  zero_acc(acc);

  const int warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, t4 = lane % 4;
  const int wm0 = (warp / 4) * WM, wn0 = (warp % 4) * WN;

  // Pipeline: cp.async group i holds k-tile i (empty groups past the end keep the count
  // uniform), in stage i % kStages; kStages − 1 tiles are in flight while one is computed.
  uint32_t sb_cur[DQ];
  prime_pipeline<kStages - 1>(k_tiles, load_tile);
  load_scales(0, sb_cur);
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int stage = kt % kStages;
    cp_async_wait<kStages - 2>();  // groups 0…kt complete: tile kt has landed (for this thread)
    __syncthreads();  // tile kt visible to all; every warp is done with tile kt−1 (ws, its stage)
    if (kt + kStages - 1 < k_tiles) load_tile(kt + kStages - 1, (kt + kStages - 1) % kStages);
    cp_async_commit();
    uint32_t sb_nxt[DQ];
    if (kt + 1 < k_tiles) load_scales(kt + 1, sb_nxt);  // consumed next iteration
    // Dequantize the code tile: word i of the tile = row i / WPG, codes (i % WPG)·PER ….
    const uint32_t* cst = cs + stage * BN * WPG;
#pragma unroll
    for (int j = 0; j < DQ; ++j) {
      const int i = tid + j * kGemmThreads, r = i / WPG, wi = i % WPG;
      const uint32_t word = cst[i];
      const float2 sb = bf16x2_to_f32(sb_cur[j]);  // (scale, bias)
      const float sc = sb.x, bi = sb.y;
      uint32_t packed[PER / 2];
#pragma unroll
      for (int e = 0; e < PER; e += 2) {
        const uint32_t q0 = (word >> (BITS * e)) & ((1u << BITS) - 1u);
        const uint32_t q1 = (word >> (BITS * (e + 1))) & ((1u << BITS) - 1u);
        packed[e / 2] = pack_bf16x2(fmaf(sc, code_to_f32(q0), bi), fmaf(sc, code_to_f32(q1), bi));
      }
      bf16* dst = ws + r * kLd + wi * PER;
      if constexpr (PER == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      else *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
    }
    __syncthreads();  // dequantized tile complete
    const bf16* xst = xs + stage * BM * kLd;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const int k0 = ks * 16 + 2 * t4;
      uint32_t bfr[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const bf16* base = ws + (wn0 + nt * 8 + g) * kLd + k0;
        bfr[nt][0] = lds32(base);
        bfr[nt][1] = lds32(base + 8);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const bf16* base = xst + (wm0 + mt * 16 + g) * kLd + k0;
        const uint32_t af[4] = {lds32(base), lds32(base + 8 * kLd), lds32(base + 8), lds32(base + 8 * kLd + 8)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16_16816(acc[mt][nt], af, bfr[nt]);
      }
    }
    if (kt + 1 < k_tiles) {
#pragma unroll
      for (int j = 0; j < DQ; ++j) sb_cur[j] = sb_nxt[j];
    }
  }

  // Epilogue. Fragment (mt, nt) element v: tile row wm0 + mt·16 + g + 8·(v/2), tile column
  // wn0 + nt·8 + 2·t4 + v%2.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm0 + mt * 16 + g + 8 * h;
      if (r >= row_count) continue;
      if constexpr (MODE == Mode::kDense) {
        OutT* y;
        if constexpr (sizeof(OutT) == 4) y = reinterpret_cast<OutT*>(p.y_f32);
        else y = reinterpret_cast<OutT*>(p.y_bf16);
        OutT* row = y + static_cast<int64_t>(row_begin + r) * p.n;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          store_pair(row, n0 + wn0 + nt * 8 + 2 * t4, p.n, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      } else if constexpr (MODE == Mode::kGateUp) {
        const int64_t a = order[row_begin + r];
        bf16* row = p.y_bf16 + a * p.n;
#pragma unroll
        for (int q = 0; q < NT / 2; ++q) {
          const int64_t i = n0 + wn0 / 2 + q * 8 + 2 * t4;
          float v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float gv = round_bf16(acc[mt][2 * q][2 * h + e]);
            const float uv = round_bf16(acc[mt][2 * q + 1][2 * h + e]);
            v[e] = silu(gv) * uv;
          }
          store_pair(row, i, p.n, v[0], v[1]);
        }
      } else {
        const int64_t a = order[row_begin + r];
        bf16* row = p.y_bf16 + a * p.n;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          store_pair(row, n0 + wn0 + nt * 8 + 2 * t4, p.n, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      }
    }
}

template <int BITS, int BM, int BN, Mode MODE, class OutT>
void launch_tile(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = gemm_smem_bytes<BITS, BM, BN>();
  raise_smem_limit(quant_gemm_kernel<BITS, BM, BN, MODE, OutT>, smem);
  quant_gemm_kernel<BITS, BM, BN, MODE, OutT><<<grid, kGemmThreads, smem, stream>>>(p);
  LILY_CUDA_CHECK_LAUNCH();
}

void check_gemm_weights(const DeviceQuant& w, const char* what) {
  if ((w.bits != 4 && w.bits != 8) || w.cols <= 0 || w.cols % kBK != 0 || w.rows <= 0)
    throw ::lily::Error(std::string(what) + ": the tensor-core GEMM supports 4/8-bit matrices with cols a positive "
                        "multiple of " + std::to_string(kBK) + "; got bits=" + std::to_string(w.bits) + " rows=" + std::to_string(w.rows) +
                        " cols=" + std::to_string(w.cols));
}

void check_grid_y(int64_t tiles, const char* what) {
  if (tiles > 65535) throw ::lily::Error(std::string(what) + ": output too wide for the GEMM grid");
}

// ---- register dequantization ("grouped", "all"; the 4-bit grouped GEMMs the wgmma kernel does not take) --
//
// Work item = (expert, row tile of ≤ 64 assignments, column tile of 256 weight rows). The grid
// is persistent (CTAs resident at once, capped by an upper bound of the item count); CTA b takes
// items b, b + gridDim.x, … of one flat list ordered by row tile, then column tile, with the
// last group (the shared expert: every token) first. Each CTA builds the list's row-tile prefix
// from the grouping's offsets in shared memory, so experts with no rows take no item and no CTA
// exits idle while work remains.
//
// Per item, per k-tile of 64 (one quantization group): cp.async stages the activation tile
// [64 tokens][64] bf16 (natural order, rows padded to 144 B) and the raw code tile [256 rows][32 B]
// into a ring of kRdStages. Warp w owns weight rows [32w, 32w + 32) as the MMA's A operand (two
// m16 tiles) and all 64 tokens as B (eight n8 tiles, the ones past the item's rows skipped).
// The k index inside a group is permuted: thread t (= lane % 4) reads the 8 code bytes
// [8t, 8t + 8) of its rows g and g + 8 (g = lane / 4); byte j of word h holds columns
// c = 16t + 8h + 2j and c + 1 (low and high nibble), and becomes one bf16x2 A register (the
// logical k pair 2t, 2t + 1 for j even, 2t + 8, 2t + 9 for j odd, MMA 2h + j / 2). The matching
// B register is then the natural activation pair (c, c + 1): thread t reads its 32 contiguous
// bytes [32t, 32t + 32) of a token row as two 16-byte shared loads, no shuffle.
// Dequantization (same weights as the shared-tile kernel): the byte's two nibbles go into the
// mantissas of 128 (one byte_perm, one lop3), minus 128 gives the exact codes, and one bf16x2
// fma gives bf16(s·q + b) rounded once from the exact value (the shared-tile kernel rounds the
// fp32 fmaf result to bf16; the two differ only where the fp32 rounding lands exactly on a bf16
// tie). Then mma.sync m16n8k16 accumulates in fp32 as before.
// Epilogue: the fp32 tile goes through shared memory (bf16, SwiGLU for gate/up) so each token
// row is written with 16-byte stores.
// Shared memory: kRdStages·(64·144 + 256·32) + 4·(kMaxGroups + 1) = 77,828 B: 2 CTAs per SM.

/// Row-tile prefix of the grouped work list in schedule order (the last group, the shared expert,
/// first): tpre[q] = Σ_{q' < q} ceil(rows of group_at(q') / tile_rows), tpre[G] the total. All
/// threads of the block call it; `scan_tot` holds blockDim.x / 32 ints.
__device__ void build_row_tile_prefix(const int32_t* offsets, int G, int tile_rows, int* tpre, int* scan_tot) {
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, threads = blockDim.x;
  auto group_at = [G](int q) { return q == 0 ? G - 1 : q - 1; };
  const int per = (G + threads - 1) / threads;
  const int q0 = min(tid * per, G), q1 = min(q0 + per, G);
  int local = 0;
  for (int q = q0; q < q1; ++q) {
    const int e = group_at(q);
    local += (offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows;
  }
  int incl = local;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == kWarp - 1) scan_tot[warp] = incl;
  __syncthreads();
  int run = incl - local;
  for (int w = 0; w < warp; ++w) run += scan_tot[w];
  for (int q = q0; q < q1; ++q) {
    tpre[q] = run;
    const int e = group_at(q);
    run += (offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows;
  }
  if (tid == threads - 1) tpre[G] = run;  // the last thread's range ends at G (or is empty)
  __syncthreads();
}

/// The group (expert) of row tile `tile` of the list build_row_tile_prefix made, and the tile's
/// assignment range [row_begin, row_begin + rows) (1 ≤ rows ≤ tile_rows).
__device__ __forceinline__ int locate_row_tile(const int32_t* offsets, const int* tpre, int G, int tile_rows,
                                               int tile, int& row_begin, int& rows) {
  int lo = 0, hi = G - 1;  // the largest q with tpre[q] ≤ tile (never an empty group)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tpre[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo == 0 ? G - 1 : lo - 1;
  row_begin = offsets[e] + (tile - tpre[lo]) * tile_rows;
  rows = min(tile_rows, offsets[e + 1] - row_begin);
  return e;
}

constexpr int kRdBM = 64;        // assignments (token rows) per work item
constexpr int kRdBN = 256;       // weight rows per work item: 8 warps × 32
constexpr int kRdStages = 4;     // cp.async ring depth
constexpr int kRdXLd = kBK + 8;  // staged activation row: 72 bf16 = 144 B (conflict-free 16-byte reads)
constexpr int kRdCW = kBK / 8;   // 4-bit code words per weight row per k-tile
constexpr size_t kRdPipeBytes = size_t(kRdStages) * (kRdBM * kRdXLd * sizeof(bf16) + kRdBN * kRdCW * sizeof(uint32_t));
constexpr size_t kRdSmem = kRdPipeBytes + (kMaxGroups + 1) * sizeof(int);
/// Epilogue tile row length (elements of OutT): dense / down 256 weight rows, gate/up 128 act
/// columns, padded so a warp's fragment stores hit distinct banks and rows stay 16-byte aligned.
template <Mode MODE, class OutT>
constexpr int rd_out_ld() {
  return MODE == Mode::kGateUp ? kRdBN / 2 + 8 : (sizeof(OutT) == 4 ? kRdBN + 4 : kRdBN + 8);
}
static_assert(size_t(kRdBM) * rd_out_ld<Mode::kDense, float>() * sizeof(float) <= kRdPipeBytes &&
                  size_t(kRdBM) * rd_out_ld<Mode::kDown, bf16>() * sizeof(bf16) <= kRdPipeBytes,
              "epilogue tile fits the ring");

/// bf16x2 (bf16(s·q_lo + b), bf16(s·q_hi + b)) of byte `j` of code word `w` (q_lo its low
/// nibble, q_hi its high nibble); `w4` = w >> 4; s2 / b2 the row's scale and bias in both halves.
__device__ __forceinline__ uint32_t dequant_byte_pair(uint32_t w, uint32_t w4, int j, uint32_t s2, uint32_t b2) {
  const uint32_t v = (__byte_perm(w, w4, static_cast<unsigned>(j | ((j + 4) << 8))) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  const __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2), *reinterpret_cast<const __nv_bfloat162*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}

/// 4-bit GEMM with register dequantization (see above). grid: persistent, ≤ the item count;
/// block kGemmThreads; dynamic shared memory kRdSmem. Grouped modes: bf16 output; kDense: the
/// items are (row tile of 64 tokens, column tile of 256 weight rows), no grouping.
template <Mode MODE, class OutT>
__global__ void __launch_bounds__(kGemmThreads, 2) regdq_gemm_kernel(const GemmParams p) {
  constexpr bool kGU = MODE == Mode::kGateUp, kDense = MODE == Mode::kDense;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);                                                 // [stages][64][72]
  uint32_t* cs = reinterpret_cast<uint32_t*>(smem_raw + kRdStages * kRdBM * kRdXLd * sizeof(bf16));  // [stages][256][8]
  int* tpre = reinterpret_cast<int*>(smem_raw + kRdPipeBytes);                                  // [n_groups + 1]
  __shared__ int scan_tot[kGemmThreads / kWarp];

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, t4 = lane % 4;
  const int G = p.n_groups;
  const int32_t* offsets = p.grouping;                              // grouped modes only
  const int32_t* order = kDense ? nullptr : p.grouping + 2 * (G + 1);

  if constexpr (!kDense) build_row_tile_prefix(offsets, G, kRdBM, tpre, scan_tot);
  const int col_tiles = p.col_tiles;
  const int n_items = (kDense ? (p.m + kRdBM - 1) / kRdBM : tpre[G]) * col_tiles;
  const int k_tiles = p.K / kBK;
  const int64_t wpr = p.K / 8;  // code words per weight row

  for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
    const int tile = item / col_tiles, ct = item - tile * col_tiles;
    int row_begin, rc;  // positions [row_begin, row_begin + rc) of the token index / assignment order
    int64_t w_base = 0;
    if constexpr (kDense) {
      row_begin = tile * kRdBM;
      rc = min(kRdBM, p.m - row_begin);
    } else {
      const int e = locate_row_tile(offsets, tpre, G, kRdBM, tile, row_begin, rc);  // rc: 1 … 64
      w_base = static_cast<int64_t>(e) * p.n;
    }
    const int rc8 = (rc + 7) & ~7;  // staged rows (the n8 tiles in use)
    const int64_t n0 = static_cast<int64_t>(ct) * (kGU ? kRdBN / 2 : kRdBN);  // first output column

    // Weight row behind tile row R (−1 past the output width); gate/up: rows 16j…16j+7 are gate
    // rows of act columns n0 + 8j …, rows 16j+8 … 16j+15 the up rows of the same columns.
    auto weight_row = [&](int R) -> int64_t {
      if constexpr (kGU) {
        const int64_t i = n0 + (R / 16) * 8 + R % 8;
        return i < p.n ? w_base + i : -1;
      } else {
        return n0 + R < p.n ? w_base + n0 + R : -1;
      }
    };

    // Copy sources as element offsets (−1: masked; 32 bits suffice: x / act and one expert
    // stack hold < 2^31 elements / code words): chunk c = tid + 256j; activations (row c / 8,
    // 16-byte chunk c % 8), codes (tile row c / 2, half c % 2).
    int a_off[2], c_off[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = tid + j * kGemmThreads;
      const int T = c / 8, ch = c % 8;
      a_off[j] = -1;
      if (T < rc) {
        const int arow = kDense ? row_begin + T : (kGU ? order[row_begin + T] / p.n_sel : order[row_begin + T]);
        a_off[j] = arow * p.K + ch * 8;
      }
      const int64_t wr = weight_row(c / 2);
      c_off[j] = wr >= 0 ? static_cast<int>(wr * wpr) + (c % 2) * 4 : -1;
    }
    // Code source of chunk j: gate/up tile rows with (R / 8) odd (R = c / 2) are up rows.
    auto codes_of = [&](int j) -> const uint32_t* {
      return (kGU && (((tid + j * kGemmThreads) / 16) & 1)) ? p.w1.codes : p.w0.codes;
    };
    auto load_tile = [&](int kt, int stage) {
      bf16* xst = xs + stage * kRdBM * kRdXLd;
      uint32_t* cst = cs + stage * kRdBN * kRdCW;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = tid + j * kGemmThreads;
        const int T = c / 8, ch = c % 8;
        if (T < rc8) cp_async16(xst + T * kRdXLd + ch * 8, a_off[j] >= 0 ? p.a + a_off[j] + kt * kBK : p.a, a_off[j] >= 0 ? 16 : 0);
        cp_async16(cst + c * 4, c_off[j] >= 0 ? codes_of(j) + c_off[j] + kt * kRdCW : p.w0.codes, c_off[j] >= 0 ? 16 : 0);
      }
    };
    // This thread's A rows: tile row warp·32 + 16·mi + 8·h + g (gate/up: h = 1 are the up rows);
    // weight row (−1: masked).
    int srow[2][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) srow[mi][h] = static_cast<int>(weight_row(warp * 32 + mi * 16 + h * 8 + g));
    // Scale (low 16 bits) and bias (high) of each A row for k-tile kt; 0 (w = 0) when masked.
    auto load_scales = [&](int kt, uint32_t (&sb)[2][2]) {
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sb[mi][h] = 0;
          if (srow[mi][h] >= 0) {
            const DeviceQuant& w = (kGU && h == 1) ? p.w1 : p.w0;
            const int64_t idx = static_cast<int64_t>(srow[mi][h]) * k_tiles + kt;
            sb[mi][h] = static_cast<uint32_t>(__bfloat16_as_ushort(w.scales[idx])) |
                        (static_cast<uint32_t>(__bfloat16_as_ushort(w.biases[idx])) << 16);
          }
        }
    };

    float acc[2][8][4];
    zero_acc(acc);

    // Pipeline: cp.async group i holds k-tile i (empty groups past the end keep the count uniform).
    prime_pipeline<kRdStages - 1>(k_tiles, load_tile);
    uint32_t sb_cur[2][2];
    load_scales(0, sb_cur);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int stage = kt % kRdStages;
      cp_async_wait<kRdStages - 2>();  // groups 0…kt complete: tile kt has landed (this thread's copies)
      __syncthreads();                 // … for every thread; every warp is done with tile kt − 1
      if (kt + kRdStages - 1 < k_tiles) load_tile(kt + kRdStages - 1, (kt + kRdStages - 1) % kRdStages);
      cp_async_commit();
      uint32_t sb_nxt[2][2];
      if (kt + 1 < k_tiles) load_scales(kt + 1, sb_nxt);  // consumed next iteration

      const uint32_t* cst = cs + stage * kRdBN * kRdCW;
      const bf16* xst = xs + stage * kRdBM * kRdXLd;
      uint2 cw[2][2];  // code words [8t, 8t + 8) of A rows (mi, h)
      uint32_t s2[2][2], b2[2][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cw[mi][h] = *reinterpret_cast<const uint2*>(cst + (warp * 32 + mi * 16 + h * 8 + g) * kRdCW + 2 * t4);
          s2[mi][h] = __byte_perm(sb_cur[mi][h], 0, 0x1010);
          b2[mi][h] = __byte_perm(sb_cur[mi][h], 0, 0x3232);
        }
#pragma unroll
      for (int hw = 0; hw < 2; ++hw) {  // code word hw: columns 16t + 8hw … + 7, MMAs 2hw and 2hw + 1
        uint32_t af[2][2][4];            // [mi][MMA 2hw + jj][A register]
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const uint32_t wl = hw ? cw[mi][0].y : cw[mi][0].x, wh = hw ? cw[mi][1].y : cw[mi][1].x;
          const uint32_t wl4 = wl >> 4, wh4 = wh >> 4;
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            af[mi][jj][0] = dequant_byte_pair(wl, wl4, 2 * jj, s2[mi][0], b2[mi][0]);      // row g, k 2t…
            af[mi][jj][1] = dequant_byte_pair(wh, wh4, 2 * jj, s2[mi][1], b2[mi][1]);      // row g+8, k 2t…
            af[mi][jj][2] = dequant_byte_pair(wl, wl4, 2 * jj + 1, s2[mi][0], b2[mi][0]);  // row g, k 2t+8…
            af[mi][jj][3] = dequant_byte_pair(wh, wh4, 2 * jj + 1, s2[mi][1], b2[mi][1]);  // row g+8, k 2t+8…
          }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          if (nt * 8 >= rc) break;  // uniform over the block
          // Columns 16t + 8hw … + 7 of token nt·8 + g: activation pairs (c, c + 1) for the bytes 0…3.
          const uint4 bw = *reinterpret_cast<const uint4*>(xst + (nt * 8 + g) * kRdXLd + 16 * t4 + 8 * hw);
          const uint32_t b01[2] = {bw.x, bw.y}, b23[2] = {bw.z, bw.w};
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_bf16_16816(acc[mi][nt], af[mi][0], b01);
            mma_bf16_16816(acc[mi][nt], af[mi][1], b23);
          }
        }
      }
      if (kt + 1 < k_tiles) {
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) sb_cur[mi][h] = sb_nxt[mi][h];
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it becomes the output tile

    // Fragment (mi, nt) element v: weight tile row warp·32 + 16·mi + g + 8·(v / 2), token nt·8 + 2t + v % 2.
    OutT* ob = reinterpret_cast<OutT*>(smem_raw);
    constexpr int kOutLd = rd_out_ld<MODE, OutT>();
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt * 8 >= rc) break;
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int T = nt * 8 + 2 * t4 + e2;
          if constexpr (kGU) {  // v = e2: gate row (act column), v = 2 + e2: the up row of the same column
            const float gv = round_bf16(acc[mi][nt][e2]), uv = round_bf16(acc[mi][nt][2 + e2]);
            store_out(ob, T * kOutLd + (warp * 2 + mi) * 8 + g, silu(gv) * uv);
          } else {
            store_out(ob, T * kOutLd + warp * 32 + mi * 16 + g, acc[mi][nt][e2]);
            store_out(ob, T * kOutLd + warp * 32 + mi * 16 + g + 8, acc[mi][nt][2 + e2]);
          }
        }
      }
    __syncthreads();
    constexpr int kEpc = 16 / static_cast<int>(sizeof(OutT));        // elements per 16-byte chunk
    constexpr int kChunks = (kGU ? kRdBN / 2 : kRdBN) / kEpc;       // chunks per output row
    OutT* y;
    if constexpr (sizeof(OutT) == 4) y = reinterpret_cast<OutT*>(p.y_f32);
    else y = reinterpret_cast<OutT*>(p.y_bf16);
    for (int c = tid; c < rc * kChunks; c += kGemmThreads) {
      const int T = c / kChunks, ch = c % kChunks;
      const int64_t orow = kDense ? row_begin + T : order[row_begin + T];
      const int64_t col = n0 + ch * kEpc;
      if (col >= p.n) continue;
      OutT* dst = y + orow * p.n + col;
      const OutT* src = ob + T * kOutLd + ch * kEpc;
      if (col + kEpc <= p.n && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int i = 0; i < kEpc && col + i < p.n; ++i) dst[i] = src[i];
      }
    }
    __syncthreads();  // the output tile is the next item's ring
  }
}

/// Launches the register-dequant kernel: as many CTAs as fit at once, at most one per possible
/// item (dense: ceil(m / 64) row tiles; grouped: Σ_e ceil(n_e / 64) ≤ ceil(m·n_sel / 64) +
/// n_groups row tiles; × col_tiles).
template <Mode MODE, class OutT>
void regdq_launch(GemmParams p, int64_t col_tiles, cudaStream_t stream) {
  auto kernel = regdq_gemm_kernel<MODE, OutT>;
  raise_smem_limit(kernel, kRdSmem);
  p.col_tiles = static_cast<int>(col_tiles);
  const int per_sm = std::max(1, blocks_per_sm(kernel, kGemmThreads, kRdSmem));
  const int64_t row_tiles = MODE == Mode::kDense ? ceil_div(p.m, kRdBM)
                                                 : ceil_div(static_cast<int64_t>(p.m) * p.n_sel, kRdBM) + p.n_groups;
  const int64_t max_items = col_tiles * row_tiles;
  const int64_t grid = std::min<int64_t>(max_items, static_cast<int64_t>(per_sm) * sm_count());
  kernel<<<static_cast<unsigned>(grid), kGemmThreads, kRdSmem, stream>>>(p);
  LILY_CUDA_CHECK_LAUNCH();
}

// ---- warpgroup MMA with register dequantization (wgmma; LILY_CUDA_GEMM_KERNEL=wgmma) -----------------
//
// The same work list as the register-dequant kernel, on Hopper's asynchronous warpgroup MMA:
// work item = (row tile of ≤ 128 token rows / assignments, column tile of 128 or 256 weight rows).
// The dequantized weights are the A operand (64 weight rows × 16 k per wgmma, from registers);
// the token rows are the B operand, read by the tensor cores straight from shared memory (no
// fragment loads), 64 tokens per wgmma (m64n64k16). Each weight is dequantized once per 128
// tokens and feeds up to two wgmmas, against once per 64 tokens and eight mma.syncs of 8 tokens.
//
// Block = kWG warpgroups (4 for "wgmma": 256 weight rows per item; 2 for "wgmma-narrow": 128);
// warpgroup wg owns weight rows [wg·64·kMB, (wg + 1)·64·kMB) of the item as kMB m64 blocks,
// and every token of the item (one or two token blocks, as many as the item's rows need; a block
// of fewer than 64 rows runs its wgmma narrowed to the rows rounded up to 16 when that is 16 or
// 32, a compile-time N per shape; an output column's bits do not depend on N). Per
// k-tile of 64 (one quantization group), cp.async stages
//   * the activation tile [item tokens (128 or 32)][64] bf16 in the 128-byte swizzle that wgmma's descriptor
//     reads (16-byte chunk c of row T at chunk c ^ (T mod 8), tile base 1,024-byte aligned), and
//   * the raw code tile [rows][8 words],
// into a ring of kStages, and with every 8th k-tile the next 8 k-tiles' scales and biases of
// each row (one 16-byte copy per row and array, two slots). Copies run kStages − 2 tiles ahead,
// so a stage is refilled only after the wgmmas that read it have retired (each thread waits for
// all but its latest wgmma group before the barrier that precedes the refill).
// Per k16 step s the A fragment of thread (g = lane/4, t = lane%4) is rows g and g + 8 of its
// warp's 16, k pairs (2t, 2t+1) and (2t+8, 2t+9): byte t of code words 2s and 2s + 1 of each row
// (low nibble, high nibble), dequantized as in the register-dequant kernel (exact codes, one
// bf16x2 fma: bf16(s·q + b) rounded once). The fragments are double-buffered across steps: the
// next step's dequantization overlaps the current step's wgmmas.
// Epilogue as in the register-dequant kernel: the accumulators through shared memory (bf16,
// SwiGLU for gate/up), then 16-byte stores of each token row.

constexpr int kWgTok = 128;                     // token rows per item
constexpr int kWgTokSmall = 32;                 // token rows per item of the short-prompt shape
constexpr int kShortRowsPerExpert = 16;         // grouped GEMMs with ≤ this many rows per expert on average take it
constexpr int kWgNb = 64;                       // tokens per wgmma (the N of m64n64k16)
constexpr int kScaleBlock = 8;                  // k-tiles per staged block of scales / biases (16 bytes a row)

/// Tile shape of the wgmma kernel: kWG warpgroups of kMB m64 blocks each, items of kTok token
/// rows. The activation tile is re-read from L2 for every column tile, so more weight rows per
/// item (more warpgroups) means less L2 traffic per FLOP; kMB = 1 keeps the accumulators within
/// 128 registers. kTok = kWgTokSmall is the short-prompt shape: when an expert gets a few rows
/// (or a dense GEMM has ≤ 32 tokens) a stage is mostly weights, and the bytes in flight, not the
/// tensor cores, bound the GEMM, so its smaller activation tiles buy a deeper ring.
template <int kWG, int kMB, int kTok = kWgTok>
struct WgShape {
  static_assert(kTok == kWgTok || kTok == kWgTokSmall, "items of 128 or 32 token rows");
  static constexpr int kThreads = 128 * kWG;
  static_assert(kTok * 8 % kThreads == 0, "whole activation chunks per thread");
  /// CTAs per SM the registers allow: a short-prompt item's accumulators (≤ 32 columns) fit 64
  /// registers a thread, so four CTAs share an SM and hide each other's k-tile latency.
  static constexpr int kMinBlocks = kTok == kWgTokSmall ? 4 : (kWG == 2 && kMB == 1 ? 2 : 1);
  static constexpr int kRows = kWG * 64 * kMB;               // weight rows per item
  /// Ring depth: kStages − 2 tiles ahead, fewer than kScaleBlock (so a scale block's slot is free
  /// when its copy is issued, see load_tile).
  static constexpr int kStages = kMinBlocks == 1 ? 6 : 4;
  static_assert(kStages - 2 < kScaleBlock, "a scale block is copied fewer than 8 k-tiles ahead");
  static constexpr int kTokBlocks = kTok > kWgNb ? kTok / kWgNb : 1;  // n64 token blocks per item
  static constexpr int kActBytes = kTok * kBK * 2;           // one stage's activation tile
  static constexpr int kCodeBytes = kRows * kBK / 2;         // one stage's 4-bit code tile
  static constexpr size_t kPipeBytes = size_t(kStages) * (kActBytes + kCodeBytes);
  /// Scale and bias blocks: [2 slots][scales, biases][kRows][8 k-tiles] bf16.
  static constexpr size_t kScaleBytes = size_t(2) * 2 * kRows * kScaleBlock * 2;
  /// Dynamic shared memory: 1,024 bytes of alignment slack, the ring, the scale blocks, the
  /// row-tile prefix and the scan's warp totals.
  static constexpr size_t kSmem = 1024 + kPipeBytes + kScaleBytes + (kMaxGroups + 1 + kThreads / kWarp) * sizeof(int);
  static constexpr int kOutLdGateUp = kRows / 2 + 8;         // epilogue row (bf16): act columns
  static constexpr int kOutLd = kRows + 8;                   // epilogue row (bf16): output columns
  static_assert(size_t(kTok) * kOutLd * 2 <= kPipeBytes, "epilogue tile fits the ring");
};

/// bf16x2 (bf16(s·q_lo + b), bf16(s·q_hi + b)) of the byte that `sel` (= t | (t + 4) << 8) picks
/// from code word `w` (q_lo its low nibble, q_hi its high one); s2 / b2 the row's scale and bias
/// in both halves. As dequant_byte_pair with a run-time byte.
__device__ __forceinline__ uint32_t dequant_selected_byte(uint32_t w, uint32_t sel, uint32_t s2, uint32_t b2) {
  const uint32_t v = (__byte_perm(w, w >> 4, sel) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  const __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2), *reinterpret_cast<const __nv_bfloat162*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}

/// 4-bit GEMM on warpgroup MMAs (see above), bf16 output. grid: persistent, ≤ the item count;
/// block WgShape::kThreads; dynamic shared memory WgShape::kSmem.
template <Mode MODE, int kWG, int kMB, int kTok>
__global__ void __launch_bounds__(WgShape<kWG, kMB, kTok>::kThreads, WgShape<kWG, kMB, kTok>::kMinBlocks)
    wgmma_gemm_kernel(const GemmParams p) {
  using S = WgShape<kWG, kMB, kTok>;
  constexpr int kActBytes = S::kActBytes;
  constexpr int kWgThreads = S::kThreads;
  constexpr bool kGU = MODE == Mode::kGateUp, kDense = MODE == Mode::kDense;
  constexpr int kRows = S::kRows, kStages = S::kStages;
  extern __shared__ unsigned char wg_smem_raw[];
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
  unsigned char* smem = wg_smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);  // 1,024-byte aligned
  const uint32_t act_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));  // [stages][kTok][128 B]
  uint32_t* cs = reinterpret_cast<uint32_t*>(smem + kStages * kActBytes);         // [stages][kRows][8]
  uint16_t* sc = reinterpret_cast<uint16_t*>(smem + S::kPipeBytes);                 // [2][2][kRows][8]
  int* tpre = reinterpret_cast<int*>(smem + S::kPipeBytes + S::kScaleBytes);        // [G + 1]
  int* scan_tot = tpre + kMaxGroups + 1;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / kWarp) % 4, lane = tid % kWarp;
  const int g = lane / 4, t4 = lane % 4;
  const int G = p.n_groups;
  const int32_t* offsets = p.grouping;
  const int32_t* order = kDense ? nullptr : p.grouping + 2 * (G + 1);
  if constexpr (!kDense) build_row_tile_prefix(offsets, G, kTok, tpre, scan_tot);
  const int col_tiles = p.col_tiles;
  const int n_items = (kDense ? (p.m + kTok - 1) / kTok : tpre[G]) * col_tiles;
  const int k_tiles = p.K / kBK;
  const int64_t wpr = p.K / 8;                       // code words per weight row
  const uint32_t sel = t4 | ((t4 + 4) << 8);         // byte t of a code word
  // Scales and biases ride the copy ring in blocks of 8 k-tiles, one 16-byte copy per row and
  // array (wgmma_fits: K a multiple of 512, 16-byte aligned arrays): a load per row and k-tile
  // from global memory, one k-tile ahead, would put an L2 round trip on every k-tile's path.
  const int wrow0 = wg * 64 * kMB + warp * 16;       // this warp's first A row in m64 block 0

  for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
    const int tile = item / col_tiles, ct = item - tile * col_tiles;
    int row_begin, rc;
    int64_t w_base = 0;
    if constexpr (kDense) {
      row_begin = tile * kTok;
      rc = min(kTok, p.m - row_begin);
    } else {
      const int e = locate_row_tile(offsets, tpre, G, kTok, tile, row_begin, rc);
      w_base = static_cast<int64_t>(e) * p.n;
    }
    // The wgmma columns of the two token blocks: the first block's the item's rows rounded up
    // to 16 when that is 16 or 32 (the routed experts of a short prompt get one or two rows
    // each), else 64; the second block's the rows past 64 rounded up the same way (about half of
    // the grouped items of a prefill chunk: ~64 rows per routed expert), else 64. A column's
    // result does not depend on N, so a token gets the same bits in a block of any width.
    const int w0 = rc <= 16 ? 16 : (rc <= 32 ? 32 : kWgNb);
    const int rest = rc - kWgNb;
    const int w1 = rest <= 0 ? 0 : (rest <= 32 ? (rest + 15) / 16 * 16 : kWgNb);
    const int staged = w0 + w1;                      // token rows staged (zeros past rc)
    const int64_t n0 = static_cast<int64_t>(ct) * (kGU ? kRows / 2 : kRows);

    auto weight_row = [&](int R) -> int64_t {  // as in the register-dequant kernel
      if constexpr (kGU) {
        const int64_t i = n0 + (R / 16) * 8 + R % 8;
        return i < p.n ? w_base + i : -1;
      } else {
        return n0 + R < p.n ? w_base + n0 + R : -1;
      }
    };
    // Copy sources: activation chunk c = tid + 256j (token c / 8, 16-byte chunk c % 8), code
    // chunk c = tid + 256j (tile row c / 2, half c % 2); element offsets, −1 masked.
    constexpr int kActChunks = kTok * 8 / kWgThreads, kCodeChunks = kRows * 2 / kWgThreads;
    int a_off[kActChunks], c_off[kCodeChunks];
#pragma unroll
    for (int j = 0; j < kActChunks; ++j) {
      const int c = tid + j * kWgThreads, T = c / 8;
      a_off[j] = -1;
      if (T < rc) {
        const int arow = kDense ? row_begin + T : (kGU ? order[row_begin + T] / p.n_sel : order[row_begin + T]);
        a_off[j] = arow * p.K + (c % 8) * 8;
      }
    }
#pragma unroll
    for (int j = 0; j < kCodeChunks; ++j) {
      const int c = tid + j * kWgThreads;
      const int64_t wr = weight_row(c / 2);
      c_off[j] = wr >= 0 ? static_cast<int>(wr * wpr) + (c % 2) * 4 : -1;
    }
    auto load_tile = [&](int kt, int stage) {
      unsigned char* ast = smem + stage * kActBytes;
#pragma unroll
      for (int j = 0; j < kActChunks; ++j) {
        const int c = tid + j * kWgThreads, T = c / 8, ch = c % 8;
        if (T < staged)
          cp_async16(ast + T * 128 + ((ch ^ (T & 7)) << 4), a_off[j] >= 0 ? p.a + a_off[j] + kt * kBK : p.a,
                     a_off[j] >= 0 ? 16 : 0);
      }
      uint32_t* cst = cs + stage * kRows * 8;
#pragma unroll
      for (int j = 0; j < kCodeChunks; ++j) {
        const int c = tid + j * kWgThreads;
        const bool up = kGU && ((c / 16) & 1);
        cp_async16(cst + c * 4, c_off[j] >= 0 ? (up ? p.w1.codes : p.w0.codes) + c_off[j] + kt * 8 : p.w0.codes,
                   c_off[j] >= 0 ? 16 : 0);
      }
      // With k-tile 8b, the scale block b into slot b & 1. Its last readers (block b − 2) are
      // done: this copy is issued kStages − 2 < 8 k-tiles ahead, after a barrier.
      if (kt % kScaleBlock == 0) {
        const int slot = (kt / kScaleBlock) & 1;
        for (int c = tid; c < 2 * kRows; c += kWgThreads) {
          const int arr = c / kRows, R = c % kRows;  // arr 0: scales, 1: biases
          const int64_t wr = weight_row(R);
          const DeviceQuant& w = (kGU && ((R / 8) & 1)) ? p.w1 : p.w0;
          const bf16* src = arr ? w.biases : w.scales;
          cp_async16(sc + ((slot * 2 + arr) * kRows + R) * kScaleBlock, wr >= 0 ? src + wr * k_tiles + kt : p.w0.scales,
                     wr >= 0 ? 16 : 0);
        }
      }
    };
    // One item for token blocks of kW0 and kW1 columns (kW1 = 0: one block): every wgmma has a
    // static N, and the loop and the epilogue touch only the accumulators that exist (with a
    // run-time N, or accumulators left for the epilogue to read, ptxas serializes the wgmmas;
    // the six shapes of the 128-row items spill a few registers outside the k-loop, measured as
    // no slower at 4K tokens than four).
    bf16* ob = reinterpret_cast<bf16*>(smem);  // the epilogue's output tile (over the ring)
    constexpr int kOutLd = kGU ? S::kOutLdGateUp : S::kOutLd;
    auto run_item = [&](auto w0, auto w1) {
      constexpr int kW0 = decltype(w0)::value, kW1 = decltype(w1)::value;
      float acc[kMB][S::kTokBlocks][32];
      zero_acc(acc);

      // cp.async group i holds k-tile i (empty groups past the end keep the count uniform).
      prime_pipeline<kStages - 2>(k_tiles, load_tile);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int stage = kt % kStages;
        cp_async_wait<kStages - 3>();  // k-tile kt has landed (this thread's copies) …
        fence_proxy_async();           // … is visible to the async proxy (wgmma) …
        __syncthreads();               // … for every thread; the wgmmas of k-tile kt − 2 have retired
        if (kt + kStages - 2 < k_tiles) load_tile(kt + kStages - 2, (kt + kStages - 2) % kStages);
        cp_async_commit();
        // Scale (low 16 bits) and bias (high) of this thread's A rows wrow0 + 64·mb + 8h + g (0 for
        // masked rows: w = 0) for k-tile kt.
        uint32_t sb_cur[kMB][2];
        const uint16_t* blk = sc + ((kt / kScaleBlock) & 1) * 2 * kRows * kScaleBlock + kt % kScaleBlock;
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int R = wrow0 + 64 * mb + 8 * h + g;
            sb_cur[mb][h] = uint32_t(blk[R * kScaleBlock]) | (uint32_t(blk[(kRows + R) * kScaleBlock]) << 16);
          }

        const uint32_t* cst = cs + stage * kRows * 8;
        const uint32_t ast = act_addr + stage * kActBytes;
        uint32_t s2[kMB][2], b2[kMB][2];
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            s2[mb][h] = __byte_perm(sb_cur[mb][h], 0, 0x1010);
            b2[mb][h] = __byte_perm(sb_cur[mb][h], 0, 0x3232);
          }
        uint32_t af[2][kMB][4];  // double-buffered A fragments: step s uses af[s & 1]
#pragma unroll
        for (int s = 0; s < kBK / 16; ++s) {
#pragma unroll
          for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint2 w = *reinterpret_cast<const uint2*>(cst + (wrow0 + 64 * mb + 8 * h + g) * 8 + 2 * s);
              af[s & 1][mb][h] = dequant_selected_byte(w.x, sel, s2[mb][h], b2[mb][h]);      // k 2t, 2t + 1
              af[s & 1][mb][2 + h] = dequant_selected_byte(w.y, sel, s2[mb][h], b2[mb][h]);  // k 2t + 8, 2t + 9
            }
          wgmma_fence();
#pragma unroll
          for (int mb = 0; mb < kMB; ++mb) {
            wgmma_m64nk16_rs<kW0>(acc[mb][0], af[s & 1][mb], smem_desc_sw128(ast + s * 32));
            if constexpr (kW1 > 0)
              wgmma_m64nk16_rs<kW1>(acc[mb][1], af[s & 1][mb], smem_desc_sw128(ast + kWgNb * 128 + s * 32));
          }
          wgmma_commit();
          wgmma_wait<1>();  // the previous step's wgmmas have retired: af[(s + 1) & 1] may be rewritten
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
        for (int nb = 0; nb < (kW1 > 0 ? 2 : 1); ++nb) wgmma_fence_operands(acc[mb][nb]);
      cp_async_wait<0>();
      __syncthreads();  // every warp is done with the ring: it becomes the output tile

      // acc[mb][nb][4j + v]: A row wrow0 + 64·mb + g + 8·(v / 2), token 64·nb + 8j + 2t + v % 2.
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
        for (int nb = 0; nb < (kW1 > 0 ? 2 : 1); ++nb) {
          const int R0 = wrow0 + 64 * mb;
#pragma unroll
          for (int j = 0; j < (nb == 0 ? kW0 : kW1) / 8; ++j)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              const int T = nb * kWgNb + 8 * j + 2 * t4 + e2;
              if constexpr (kGU) {  // row g: the gate row of act column (R0 / 16)·8 + g; row g + 8: its up row
                const float gv = round_bf16(acc[mb][nb][4 * j + e2]), uv = round_bf16(acc[mb][nb][4 * j + 2 + e2]);
                ob[T * kOutLd + (R0 / 16) * 8 + g] = to_bf16(silu(gv) * uv);
              } else {
                ob[T * kOutLd + R0 + g] = to_bf16(acc[mb][nb][4 * j + e2]);
                ob[T * kOutLd + R0 + g + 8] = to_bf16(acc[mb][nb][4 * j + 2 + e2]);
              }
            }
        }
    };
    using std::integral_constant;
    if constexpr (kTok == kWgTokSmall) {  // rc ≤ 32: one block of 16 or 32 columns
      if (w0 == 16) run_item(integral_constant<int, 16>{}, integral_constant<int, 0>{});
      else run_item(integral_constant<int, 32>{}, integral_constant<int, 0>{});
    } else {
      switch (w0 < kWgNb ? -w0 : w1) {
        case -16: run_item(integral_constant<int, 16>{}, integral_constant<int, 0>{}); break;
        case -32: run_item(integral_constant<int, 32>{}, integral_constant<int, 0>{}); break;
        case 0: run_item(integral_constant<int, 64>{}, integral_constant<int, 0>{}); break;
        case 16: run_item(integral_constant<int, 64>{}, integral_constant<int, 16>{}); break;
        case 32: run_item(integral_constant<int, 64>{}, integral_constant<int, 32>{}); break;
        default: run_item(integral_constant<int, 64>{}, integral_constant<int, 64>{}); break;
      }
    }
    __syncthreads();
    constexpr int kChunks = (kGU ? kRows / 2 : kRows) / 8;  // 16-byte chunks per output row
    for (int c = tid; c < rc * kChunks; c += kWgThreads) {
      const int T = c / kChunks, ch = c % kChunks;
      const int64_t orow = kDense ? row_begin + T : order[row_begin + T];
      const int64_t col = n0 + ch * 8;
      if (col >= p.n) continue;
      bf16* dst = p.y_bf16 + orow * p.n + col;
      const bf16* src = ob + T * kOutLd + ch * 8;
      if (col + 8 <= p.n && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int i = 0; i < 8 && col + i < p.n; ++i) dst[i] = src[i];
      }
    }
    __syncthreads();  // the output tile is the next item's ring
  }
}

/// Launches the wgmma kernel: as many CTAs as fit at once, at most one per possible item.
template <Mode MODE, int kWG, int kMB, int kTok = kWgTok>
void wgmma_launch(GemmParams p, cudaStream_t stream) {
  using S = WgShape<kWG, kMB, kTok>;
  auto kernel = wgmma_gemm_kernel<MODE, kWG, kMB, kTok>;
  constexpr int kWgThreads = S::kThreads;
  raise_smem_limit(kernel, S::kSmem);
  const int64_t col_tiles = ceil_div(p.n, MODE == Mode::kGateUp ? S::kRows / 2 : S::kRows);
  p.col_tiles = static_cast<int>(col_tiles);
  const int per_sm = std::max(1, blocks_per_sm(kernel, kWgThreads, S::kSmem));
  const int64_t row_tiles = MODE == Mode::kDense ? ceil_div(p.m, kTok)
                                                 : ceil_div(static_cast<int64_t>(p.m) * p.n_sel, kTok) + p.n_groups;
  const int64_t grid = std::min<int64_t>(col_tiles * row_tiles, static_cast<int64_t>(per_sm) * sm_count());
  kernel<<<static_cast<unsigned>(grid), kWgThreads, S::kSmem, stream>>>(p);
  LILY_CUDA_CHECK_LAUNCH();
}

/// gemm_kernel()'s value: kWgmmaMixed until set_gemm_kernel.
std::atomic<GemmKernel> g_gemm_kernel{GemmKernel::kWgmmaMixed};

/// gemm_kernel(): kGrouped → the register-dequant kernel for the 4-bit grouped
/// GEMMs (the dense ones keep the shared-tile kernel, which already reaches ≈ 230 TFLOP/s at
/// 2,048 tokens with its 128-token tiles); kAll → also for the dense GEMMs with ≥ one item per
/// SM (for an A/B); kOff → the shared-tile kernels everywhere. Read at every launch (a test flips
/// it between launches). Returns whether the register-dequant kernel is selected for a dense
/// (`dense`) or a grouped GEMM.
bool regdq_enabled(bool dense) {
  switch (gemm_kernel()) {
    case GemmKernel::kGrouped: return !dense;
    case GemmKernel::kAll: return true;
    case GemmKernel::kOff: return false;
    case GemmKernel::kWgmma:
    case GemmKernel::kWgmmaNarrow:
    case GemmKernel::kWgmmaMixed: return !dense;  // where the wgmma kernel does not apply
  }
  return !dense;
}

/// Whether the wgmma kernel takes a GEMM over K input features with these weights: K a multiple
/// of 512 (whole blocks of 8 scale groups) and 16-byte aligned scale and bias arrays (one copy
/// per row and block).
bool wgmma_fits(const GemmParams& p) {
  auto aligned16 = [](const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return p.K % (kBK * kScaleBlock) == 0 && aligned16(p.w0.scales) && aligned16(p.w0.biases) &&
         aligned16(p.w1.scales) && aligned16(p.w1.biases);
}

/// Warpgroups per CTA of the wgmma kernel that gemm_kernel() selects for a 4-bit GEMM of `mode`
/// with bf16 output: 4 (256 weight rows per item), 2 (128), 0 (not selected). kWgmmaMixed takes
/// the wide items except for the grouped gate/up GEMM, whose narrow items were faster.
int wgmma_groups(Mode mode) {
  switch (gemm_kernel()) {
    case GemmKernel::kWgmma: return 4;
    case GemmKernel::kWgmmaNarrow: return 2;
    case GemmKernel::kWgmmaMixed: return mode == Mode::kGateUp ? 2 : 4;
    default: return 0;
  }
}

/// Whether the register-dequant kernel's 32-bit element offsets cover `a_rows` activation rows
/// and weight matrices of `w_rows` rows, K columns.
bool regdq_fits(int64_t a_rows, int64_t w_rows, int K) {
  return a_rows * K < (int64_t(1) << 31) && w_rows * (K / 8) < (int64_t(1) << 31);
}

template <int BITS, class OutT>
void dense_dispatch(const GemmParams& p, cudaStream_t stream) {
  const int sms = sm_count();
  const int64_t n = p.n;
  if constexpr (BITS == 4 && sizeof(OutT) == 2) {
    // Every token count on the wgmma kernel, so a token row gets the same bits in a prefill
    // chunk of any length: the short-prompt items for ≤ 32 tokens, the wide items where they
    // still give every SM one, else the narrow ones.
    const int wg = wgmma_groups(Mode::kDense);
    const int64_t row_tiles = ceil_div(p.m, kWgTok);
    if (wg > 0 && regdq_fits(p.m, p.w0.rows, p.K) && wgmma_fits(p)) {
      if (p.m <= kWgTokSmall) wgmma_launch<Mode::kDense, 2, 1, kWgTokSmall>(p, stream);
      else if (wg == 4 && row_tiles * ceil_div(n, 256) >= sms) wgmma_launch<Mode::kDense, 4, 1>(p, stream);
      else wgmma_launch<Mode::kDense, 2, 1>(p, stream);
      return;
    }
  }
  if (BITS == 4 && ceil_div(p.m, kRdBM) * ceil_div(n, kRdBN) >= sms && regdq_fits(p.m, p.w0.rows, p.K) &&
      regdq_enabled(true)) {
    regdq_launch<Mode::kDense, OutT>(p, ceil_div(n, kRdBN), stream);
    return;
  }
  int bm = p.m <= 32 ? 32 : (p.m <= 64 ? 64 : 128);
  if (bm == 128 && ceil_div(p.m, 128) * ceil_div(n, 128) < sms) bm = 64;
  const int bn = ceil_div(p.m, bm) * ceil_div(n, 128) >= sms ? 128 : 64;
  check_grid_y(ceil_div(n, bn), "quant_gemm");
  const dim3 grid(static_cast<unsigned>(ceil_div(p.m, bm)), static_cast<unsigned>(ceil_div(n, bn)));
  if (bm == 128) launch_tile<BITS, 128, 128, Mode::kDense, OutT>(p, grid, stream);
  else if (bm == 64 && bn == 128) launch_tile<BITS, 64, 128, Mode::kDense, OutT>(p, grid, stream);
  else if (bm == 64) launch_tile<BITS, 64, 64, Mode::kDense, OutT>(p, grid, stream);
  else if (bn == 128) launch_tile<BITS, 32, 128, Mode::kDense, OutT>(p, grid, stream);
  else launch_tile<BITS, 32, 64, Mode::kDense, OutT>(p, grid, stream);
}

/// Row-tile height of the grouped GEMMs (and of the grouping's tile offsets).
int grouped_tile_rows(int m, int n_sel, int n_groups) {
  return static_cast<int64_t>(m) * n_sel >= 48LL * n_groups ? 64 : 32;
}
/// Upper bound of the number of row tiles: Σ_e ceil(n_e / BM) < Σ n_e / BM + n_groups.
int64_t grouped_max_tiles(int m, int n_sel, int n_groups) {
  return ceil_div(static_cast<int64_t>(m) * n_sel, grouped_tile_rows(m, n_sel, n_groups)) + n_groups;
}

template <Mode MODE>
void grouped_dispatch(const GemmParams& p, int64_t col_tiles, cudaStream_t stream) {
  const bool fits = regdq_fits(static_cast<int64_t>(p.m) * p.n_sel, std::max(p.w0.rows, p.w1.rows), p.K);
  if (p.w0.bits == 4 && fits && wgmma_groups(MODE) > 0 && wgmma_fits(p)) {
    // A short prompt's experts get a few rows each: the short-prompt items.
    if (static_cast<int64_t>(p.m) * p.n_sel <= int64_t{kShortRowsPerExpert} * p.n_groups) wgmma_launch<MODE, 2, 1, kWgTokSmall>(p, stream);
    else if (wgmma_groups(MODE) == 4) wgmma_launch<MODE, 4, 1>(p, stream);
    else wgmma_launch<MODE, 2, 1>(p, stream);
    return;
  }
  if (p.w0.bits == 4 && fits && regdq_enabled(false)) {
    regdq_launch<MODE, bf16>(p, MODE == Mode::kGateUp ? ceil_div(p.n, kRdBN / 2) : ceil_div(p.n, kRdBN), stream);
    return;
  }
  const int bm = grouped_tile_rows(p.m, p.n_sel, p.n_groups);
  check_grid_y(col_tiles, "grouped expert GEMM");
  const dim3 grid(static_cast<unsigned>(grouped_max_tiles(p.m, p.n_sel, p.n_groups)), static_cast<unsigned>(col_tiles));
  if (p.w0.bits == 4) {
    if (bm == 64) launch_tile<4, 64, 128, MODE, bf16>(p, grid, stream);
    else launch_tile<4, 32, 128, MODE, bf16>(p, grid, stream);
  } else {
    if (bm == 64) launch_tile<8, 64, 128, MODE, bf16>(p, grid, stream);
    else launch_tile<8, 32, 128, MODE, bf16>(p, grid, stream);
  }
}

// ---- grouping (counting sort of the assignments by expert) ------------------------------------------

constexpr int kScanThreads = 1024;

/// Inclusive prefix sum over the 1024 threads of the block; `warp_tot` ≥ 32 ints of shared memory.
__device__ int block_inclusive_scan(int v, int* warp_tot) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  __syncthreads();  // warp_tot may still be read by a previous call
  if (lane == kWarp - 1) warp_tot[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = warp_tot[lane];
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += u;
    }
    warp_tot[lane] = w;
  }
  __syncthreads();
  return v + (warp > 0 ? warp_tot[warp - 1] : 0);
}

__device__ __forceinline__ int clamp_group(int32_t id, int n_groups) { return id < 0 ? 0 : (id >= n_groups ? n_groups - 1 : id); }

/// One block of 1024 threads: per-expert counts, then offsets and tile offsets (exclusive scans).
__global__ void __launch_bounds__(kScanThreads) grouping_count_kernel(const int32_t* __restrict__ ids, int n_assign,
                                                                      int n_groups, int tile_rows,
                                                                      int32_t* __restrict__ grouping) {
  __shared__ int cnt[kMaxGroups];
  __shared__ int warp_tot[kWarp];
  for (int e = threadIdx.x; e < kMaxGroups; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < n_assign; a += blockDim.x) atomicAdd(&cnt[clamp_group(ids[a], n_groups)], 1);
  __syncthreads();
  const int e0 = 2 * threadIdx.x, e1 = e0 + 1;
  const int c0 = cnt[e0], c1 = cnt[e1];  // entries ≥ n_groups are 0
  const int t0 = (c0 + tile_rows - 1) / tile_rows, t1 = (c1 + tile_rows - 1) / tile_rows;
  const int rows_incl = block_inclusive_scan(c0 + c1, warp_tot);
  const int tiles_incl = block_inclusive_scan(t0 + t1, warp_tot);
  int32_t* offsets = grouping;
  int32_t* tiles = grouping + n_groups + 1;
  // Entry e's inclusive prefix is the exclusive offset of e + 1.
  if (e0 < n_groups) { offsets[e0 + 1] = rows_incl - c1; tiles[e0 + 1] = tiles_incl - t1; }
  if (e1 < n_groups) { offsets[e1 + 1] = rows_incl; tiles[e1 + 1] = tiles_incl; }
  if (threadIdx.x == 0) { offsets[0] = 0; tiles[0] = 0; }
}

constexpr int kFillThreads = 1024;
constexpr int kFillWarps = kFillThreads / kWarp;
constexpr int kFillUnroll = 6;

/// Block e: writes expert e's assignment indices, ascending, at order[offsets[e] …]. Warp w owns
/// one contiguous span of the assignments, so one block barrier orders the spans: pass 1 counts
/// the warp's matches (ballots), pass 2 writes them after the earlier warps' counts. The passes'
/// loads are unrolled so that many are in flight (the ids come from L2).
__global__ void __launch_bounds__(kFillThreads) grouping_fill_kernel(const int32_t* __restrict__ ids, int n_assign,
                                                                     int n_groups, int32_t* __restrict__ grouping) {
  __shared__ int warp_cnt[kFillWarps];
  const int e = blockIdx.x;
  const int32_t* offsets = grouping;
  int32_t* order = grouping + 2 * (n_groups + 1);
  const int base = offsets[e];
  if (offsets[e + 1] == base) return;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int span = ceil_div(ceil_div(n_assign, kFillWarps), kWarp) * kWarp;
  const int begin = min(n_assign, warp * span), end = min(n_assign, begin + span);
  auto match = [&](int a) { return a < end && clamp_group(ids[a], n_groups) == e; };
  int count = 0;
#pragma unroll kFillUnroll
  for (int a0 = begin; a0 < end; a0 += kWarp) count += __popc(__ballot_sync(0xffffffffu, match(a0 + lane)));
  if (lane == 0) warp_cnt[warp] = count;
  __syncthreads();
  int pos = base;
  for (int w = 0; w < warp; ++w) pos += warp_cnt[w];
  const unsigned below = (1u << lane) - 1u;
#pragma unroll kFillUnroll
  for (int a0 = begin; a0 < end; a0 += kWarp) {
    const bool mine = match(a0 + lane);
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (mine) order[pos + __popc(ballot & below)] = a0 + lane;
    pos += __popc(ballot);
  }
}

constexpr int kCombineVec = 8;  // bf16 per thread (one 16-byte load per slot row)

/// out[t, r] = Σ_s weights[t·n_sel + s] · slot_out[t·n_sel + s, r], s ascending, fp32. Grid
/// (ceil(hidden / (256·kVec)), m), block 256; thread: kVec consecutive r (kVec = 8 needs hidden a
/// multiple of 8 and 16-byte-aligned rows; kVec = 1 takes any shape). Same sum either way.
template <int kVec>
__global__ void expert_combine_kernel(const bf16* __restrict__ slot_out, const float* __restrict__ weights, int n_sel,
                                      int hidden, bf16* __restrict__ out) {
  const int t = blockIdx.y;
  const int r0 = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (r0 >= hidden) return;
  float acc[kVec] = {};
  for (int s = 0; s < n_sel; ++s) {
    const int64_t a = static_cast<int64_t>(t) * n_sel + s;
    const float wt = weights[a];
    float x[kVec];
    load_bf16_vec<kVec>(slot_out + a * hidden + r0, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += wt * x[i];
  }
  store_bf16_vec<kVec>(acc, out + static_cast<int64_t>(t) * hidden + r0);
}

void check_grouped(int m, int n_sel, int n_groups, const int32_t* grouping, const char* what) {
  if (n_groups > kMaxGroups)
    throw ::lily::Error(std::string(what) + ": the grouped expert GEMM supports at most " + std::to_string(kMaxGroups) +
                        " experts (routed + shared); got " + std::to_string(n_groups));
  if (m <= 0 || n_sel <= 0 || n_groups <= 0 || grouping == nullptr)
    throw ::lily::InternalError(std::string(what) + ": need m > 0, n_sel > 0, n_groups > 0 and a grouping buffer");
}

/// The kernels stage activations and codes with 16-byte cp.async and store output pairs: throws
/// lily::InternalError (a caller bug) for a pointer that breaks that alignment, rather than
/// letting the launch fail asynchronously with "misaligned address" (which poisons the context).
void check_alignment(const GemmParams& p, const char* what) {
  auto misaligned = [](const void* ptr, uintptr_t a) { return ptr && reinterpret_cast<uintptr_t>(ptr) % a != 0; };
  if (misaligned(p.a, 16) || misaligned(p.w0.codes, 16) || misaligned(p.w1.codes, 16) || misaligned(p.y_f32, 8) ||
      misaligned(p.y_bf16, 4))
    throw ::lily::InternalError(std::string(what) +
                                ": activations and codes must be 16-byte aligned, outputs 8 (fp32) or 4 (bf16)");
}

/// The parameters of a grouped expert GEMM: w0 the stacked weights, a the input rows (tokens
/// for gate/up, assignment slots for down), n the output width per expert, y the bf16 output.
GemmParams grouped_params(const DeviceQuant& w0, const bf16* a, int m, int n, bf16* y, const int32_t* grouping,
                          int n_groups, int n_sel) {
  GemmParams p;
  p.w0 = w0;
  p.a = a;
  p.m = m;
  p.K = w0.cols;
  p.n = n;
  p.y_bf16 = y;
  p.grouping = grouping;
  p.n_groups = n_groups;
  p.n_sel = n_sel;
  return p;
}

}  // namespace

GemmKernel gemm_kernel() { return g_gemm_kernel.load(std::memory_order_relaxed); }
void set_gemm_kernel(GemmKernel mode) { g_gemm_kernel.store(mode, std::memory_order_relaxed); }

void launch_quant_gemm(const DeviceQuant& w, const bf16* x, int m, bf16* y_bf16, float* y_f32, cudaStream_t stream) {
  check_gemm_weights(w, "quant_gemm");
  if ((y_bf16 == nullptr) == (y_f32 == nullptr) || m <= 0)
    throw ::lily::InternalError("launch_quant_gemm: exactly one output and m > 0 required");
  GemmParams p;
  p.w0 = w;
  p.a = x;
  p.m = m;
  p.K = w.cols;
  p.n = w.rows;
  p.y_bf16 = y_bf16;
  p.y_f32 = y_f32;
  check_alignment(p, "launch_quant_gemm");
  if (w.bits == 4) {
    if (y_f32) dense_dispatch<4, float>(p, stream); else dense_dispatch<4, bf16>(p, stream);
  } else {
    if (y_f32) dense_dispatch<8, float>(p, stream); else dense_dispatch<8, bf16>(p, stream);
  }
}

int64_t expert_grouping_ints(int n_groups, int m, int n_sel) {
  return 2 * (static_cast<int64_t>(n_groups) + 1) + static_cast<int64_t>(m) * n_sel;
}

void launch_expert_grouping(const int32_t* ids, int m, int n_sel, int n_groups, int32_t* grouping,
                            cudaStream_t stream) {
  check_grouped(m, n_sel, n_groups, grouping, "launch_expert_grouping");
  const int n_assign = m * n_sel;
  grouping_count_kernel<<<1, kScanThreads, 0, stream>>>(ids, n_assign, n_groups, grouped_tile_rows(m, n_sel, n_groups),
                                                        grouping);
  LILY_CUDA_CHECK_LAUNCH();
  grouping_fill_kernel<<<n_groups, kFillThreads, 0, stream>>>(ids, n_assign, n_groups, grouping);
  LILY_CUDA_CHECK_LAUNCH();
}

void launch_quant_gemm_grouped_gate_up(const DeviceQuant& gate, const DeviceQuant& up, int ffn, const int32_t* grouping,
                                       int n_groups, const bf16* x, int m, int n_sel, bf16* act, cudaStream_t stream) {
  check_gemm_weights(gate, "expert gate_proj");
  check_gemm_weights(up, "expert up_proj");
  check_grouped(m, n_sel, n_groups, grouping, "launch_quant_gemm_grouped_gate_up");
  if (gate.bits != up.bits || gate.cols != up.cols || ffn <= 0 || gate.rows < int64_t(n_groups) * ffn ||
      up.rows < int64_t(n_groups) * ffn)
    throw ::lily::InternalError("launch_quant_gemm_grouped_gate_up: gate/up stacks do not match n_groups × ffn");
  GemmParams p = grouped_params(gate, x, m, ffn, act, grouping, n_groups, n_sel);
  p.w1 = up;
  check_alignment(p, "launch_quant_gemm_grouped_gate_up");
  grouped_dispatch<Mode::kGateUp>(p, ceil_div(ffn, 64), stream);
}

void launch_quant_gemm_grouped_down(const DeviceQuant& down, int hidden, const int32_t* grouping, int n_groups,
                                    const bf16* act, int m, int n_sel, bf16* slot_out, cudaStream_t stream) {
  check_gemm_weights(down, "expert down_proj");
  check_grouped(m, n_sel, n_groups, grouping, "launch_quant_gemm_grouped_down");
  if (hidden <= 0 || down.rows < int64_t(n_groups) * hidden)
    throw ::lily::InternalError("launch_quant_gemm_grouped_down: down stack does not match n_groups × hidden");
  const GemmParams p = grouped_params(down, act, m, hidden, slot_out, grouping, n_groups, n_sel);
  check_alignment(p, "launch_quant_gemm_grouped_down");
  grouped_dispatch<Mode::kDown>(p, ceil_div(hidden, 128), stream);
}

void launch_expert_combine(const bf16* slot_out, const float* weights, int m, int n_sel, int hidden, bf16* out,
                           cudaStream_t stream) {
  if (m <= 0 || n_sel <= 0 || hidden <= 0 || m > 65535)
    throw ::lily::InternalError("launch_expert_combine: need 0 < m ≤ 65535, n_sel > 0, hidden > 0");
  const bool vec = hidden % kCombineVec == 0 && reinterpret_cast<uintptr_t>(slot_out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int per_thread = vec ? kCombineVec : 1;
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, 256 * per_thread)), static_cast<unsigned>(m));
  if (vec)
    expert_combine_kernel<kCombineVec><<<grid, 256, 0, stream>>>(slot_out, weights, n_sel, hidden, out);
  else
    expert_combine_kernel<1><<<grid, 256, 0, stream>>>(slot_out, weights, n_sel, hidden, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
