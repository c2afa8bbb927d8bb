// Device building blocks of every MLX-affine matrix-vector product (nvcc only): staging an
// activation row into shared memory (fp32, padded per 64-group, with per-group sums) and the
// per-group dot product s·Σ(q·x) + b·Σx (docs/model.md §4.2).
#pragma once
#include <string>

#include "backends/cuda/common.cuh"
#include "backends/cuda/kernels.h"

namespace lily::cuda {

/// Floats per staged 64-group in shared memory: 64 + 4 padding, so that 16-byte reads of eight
/// consecutive lanes (one per group) hit distinct banks.
constexpr int kGroupStride = 68;
static_assert(kGroupStride + 1 == kStagedFloatsPerGroup, "kernels.h describes this layout to host code");

/// Shared-memory bytes to stage an activation row of `cols` values (plus its group sums).
inline size_t staged_row_bytes(int cols) {
  const int groups = cols / kGroup;
  return static_cast<size_t>(groups) * (kGroupStride + 1) * sizeof(float);
}

/// Values each thread loads before it stores any (staging): the loads of one batch are all in
/// flight at once instead of one round trip per element.
constexpr int kStageBatch = 8;

/// Σx of one 64-group in the order every kernel that forms it follows (a row's bits depend on
/// it, and the batched decode must give a row the one-sequence bits): lane l adds the group's
/// columns l and l + 32 (x_l, x_l32), then the warp's butterfly. The sum, on every lane.
__device__ __forceinline__ float group_sum_x(float x_l, float x_l32) { return warp_sum(x_l + x_l32); }

/// xsum[g] = Σ xs over staged group g (group_sum_x), one warp per group. All threads of the
/// block; ends with __syncthreads().
__device__ __forceinline__ void stage_group_sums(int cols, const float* xs, float* xsum) {
  const int groups = cols / kGroup;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  for (int g = warp; g < groups; g += n_warps) {
    const float* xg = xs + g * kGroupStride;
    float s = group_sum_x(xg[lane], xg[lane + 32]);
    if (lane == 0) xsum[g] = s;
  }
  __syncthreads();
}

/// Stages bf16 x [cols] into xs (fp32, group g at xs[g·68]) and xsum[g] = Σ x over group g.
/// Thread i stages elements i, i + blockDim.x, …, kStageBatch loads at a time.
/// All threads of the block take part; ends with __syncthreads().
__device__ __forceinline__ void stage_row(const bf16* __restrict__ x, int cols, float* xs, float* xsum) {
  const int stride = blockDim.x;
  for (int c0 = threadIdx.x; c0 < cols; c0 += kStageBatch * stride) {
    float v[kStageBatch];
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {
      const int c = c0 + i * stride;
      v[i] = c < cols ? to_f32(x[c]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {
      const int c = c0 + i * stride;
      if (c < cols) xs[(c / kGroup) * kGroupStride + c % kGroup] = v[i];
    }
  }
  __syncthreads();
  stage_group_sums(cols, xs, xsum);
}

/// Host check of a FusedNorm launch: throws lily::InternalError (a caller bug) for missing
/// buffers, or for x_out / normed_out aliasing an input or each other (block 0 writes them while
/// the other blocks still read x and branch).
inline void check_fused_norm(const FusedNorm& norm, const bf16* x, const char* what) {
  if (!norm.gain || !norm.x_out || !norm.normed_out || !x)
    throw ::lily::InternalError(std::string(what) + ": FusedNorm needs x, gain, x_out and normed_out");
  if (norm.x_out == x || norm.x_out == norm.branch)
    throw ::lily::InternalError(std::string(what) + ": FusedNorm x_out must not alias x or branch");
  if (norm.normed_out == x || norm.normed_out == norm.branch || norm.normed_out == norm.x_out)
    throw ::lily::InternalError(std::string(what) + ": FusedNorm normed_out must not alias x, branch or x_out");
}

/// One thread's elements of a row held in registers for the add + RMSNorm (launch_add_rmsnorm's
/// arithmetic): element c = i + u·stride for u < kStageBatch, h = bf16(x + branch) (x alone
/// without a branch) and its gain.
struct NormRowRegs {
  float h[kStageBatch], gain[kStageBatch];
};

/// The branch element c of a fused norm: through L2 (kL2: the branch was written in this launch
/// by other blocks, behind a grid barrier), else a plain load.
template <bool kL2>
__device__ __forceinline__ float load_branch(const bf16* branch, int c) {
  if constexpr (kL2) return to_f32(__ldcg(branch + c));
  return to_f32(branch[c]);
}

/// Loads this thread's elements of row x (i: its index among `stride` threads; inactive: none)
/// into r and returns its Σh² in element order. Every load is issued before any is used.
/// kL2Branch: the branch is read through L2 (load_branch); kL2X: x too.
template <bool kL2Branch = false, bool kL2X = false>
__device__ __forceinline__ float norm_row_load(const bf16* __restrict__ x, const bf16* branch, const float* gain,
                                               int cols, int i, int stride, bool active, NormRowRegs& r) {
#pragma unroll
  for (int u = 0; u < kStageBatch; ++u) {
    const int c = active ? i + u * stride : cols;
    const float v = c < cols ? (kL2X ? to_f32(__ldcg(x + c)) : to_f32(x[c])) : 0.0f;
    const float b = (c < cols && branch) ? load_branch<kL2Branch>(branch, c) : 0.0f;
    r.gain[u] = c < cols ? gain[c] : 0.0f;
    r.h[u] = branch ? round_bf16(v + b) : v;
  }
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < kStageBatch; ++u)
    if (active && i + u * stride < cols) ss += r.h[u] * r.h[u];
  return ss;
}

/// Stages this thread's normed elements y = bf16(h·rs·gain) into xs (fp32, group g at xs[g·68])
/// with rs = 1 / sqrt(Σh² / cols + eps); with x_out / normed_out non-null, also stores h and y.
__device__ __forceinline__ void norm_row_store(const NormRowRegs& r, float sum_sq, float eps, int cols, int i,
                                               int stride, bool active, float* xs, bf16* x_out, bf16* normed_out) {
  if (!active) return;
  const float rs = 1.0f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
#pragma unroll
  for (int u = 0; u < kStageBatch; ++u) {
    const int c = i + u * stride;
    if (c >= cols) continue;
    const bf16 y = to_bf16(r.h[u] * rs * r.gain[u]);
    xs[(c / kGroup) * kGroupStride + c % kGroup] = to_f32(y);
    if (x_out) {
      x_out[c] = to_bf16(r.h[u]);
      normed_out[c] = y;
    }
  }
}

/// stage_row with an add + RMSNorm in front (kernels.h FusedNorm; launch_add_rmsnorm's exact
/// arithmetic, same element-to-thread mapping for blockDim.x = 256): stages y = bf16(h·r·gain)
/// of h = bf16(x + branch) as fp32 and its group sums; when `store`, also writes h to
/// norm.x_out and y to norm.normed_out. A row of ≤ kStageBatch·blockDim.x values (hidden 2048
/// on 256 threads) is held in registers with its gains, so x, branch and gain are fetched in
/// one round trip; longer rows take a second pass over shared memory. Same values either way.
/// All threads of the block; ends with __syncthreads(). `threads` (≤ blockDim.x, a multiple of
/// 32; 0 = blockDim.x) is how many threads hold elements: a larger block with threads = 256 gives
/// the same values as a 256-thread block (the other warps add zeros to the block sum).
/// kL2Branch: norm.branch is read through L2 (written in this launch, behind a grid barrier);
/// kL2X: x too. stamp (diagnostics, null in production): thread 0 writes %globaltimer there once
/// it holds its elements of the row (the one-batch path only).
template <bool kL2Branch = false, bool kL2X = false>
__device__ __forceinline__ void stage_norm_row(const bf16* __restrict__ x, const FusedNorm& norm, int cols,
                                               bool store, float* xs, float* xsum, int threads = 0,
                                               uint64_t* stamp = nullptr) {
  __shared__ float scratch[32];
  const int stride = threads > 0 ? threads : static_cast<int>(blockDim.x);
  const bool holds = static_cast<int>(threadIdx.x) < stride;
  float ss = 0.0f;
  if (cols <= kStageBatch * stride) {  // one batch: every load in flight at once
    NormRowRegs regs;
    const int i = threadIdx.x;
    ss = norm_row_load<kL2Branch, kL2X>(x, norm.branch, norm.gain, cols, i, stride, holds, regs);
    if (stamp && threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(*stamp) : "f"(ss));
    norm_row_store(regs, block_sum(ss, scratch), norm.eps, cols, i, stride, holds, xs, store ? norm.x_out : nullptr,
                   norm.normed_out);
    __syncthreads();
    stage_group_sums(cols, xs, xsum);
    return;
  }
  for (int c0 = holds ? threadIdx.x : cols; c0 < cols; c0 += kStageBatch * stride) {  // loads of a batch first
    float v[kStageBatch], b[kStageBatch];
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {
      const int c = c0 + i * stride;
      v[i] = c < cols ? (kL2X ? to_f32(__ldcg(x + c)) : to_f32(x[c])) : 0.0f;
      b[i] = (c < cols && norm.branch) ? load_branch<kL2Branch>(norm.branch, c) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {  // then the arithmetic, in element order
      const int c = c0 + i * stride;
      if (c >= cols) continue;
      const float h = norm.branch ? round_bf16(v[i] + b[i]) : v[i];
      xs[(c / kGroup) * kGroupStride + c % kGroup] = h;
      ss += h * h;
    }
  }
  const float total = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(total / static_cast<float>(cols) + norm.eps);
  for (int c = holds ? threadIdx.x : cols; c < cols; c += stride) {  // each thread revisits its own elements
    float* p = xs + (c / kGroup) * kGroupStride + c % kGroup;
    const float h = *p;
    const bf16 y = to_bf16(h * r * norm.gain[c]);
    *p = to_f32(y);
    if (store) {
      norm.x_out[c] = to_bf16(h);
      norm.normed_out[c] = y;
    }
  }
  __syncthreads();
  stage_group_sums(cols, xs, xsum);
}

/// Lanes per matrix row for a row of `groups` 64-groups: the largest power of two ≤ min(32, groups).
__host__ __device__ inline int lanes_per_row(int groups) {
  int l = 1;
  while (l * 2 <= groups && l * 2 <= 32) l *= 2;
  return l;
}

/// uint4 loads per group of kGroup codes: 2 (4-bit) or 4 (8-bit).
template <int BITS>
constexpr int kGroupVecs = kGroup * BITS / 32 / 4;

/// The code in the low bits of `w` (under `mask`, ≤ 8 bits) as an exact fp32 value, without an
/// integer-to-float convert (a quarter-rate instruction): OR-ing q into the mantissa of 2^23
/// gives the float 2^23 + q exactly, and subtracting 2^23 leaves q exactly. Same value as
/// static_cast<float>(w & mask), so every dot product keeps its bits.
__device__ __forceinline__ float code_f32(uint32_t w, uint32_t mask) {
  return __uint_as_float((w & mask) | 0x4B000000u) - 8388608.0f;
}

/// acc + Σ q·x over the 4·(32 / BITS) codes of one 16-byte vector of code words q, against the
/// staged fp32 values x (16-byte aligned), one fma a code in element order. Continued over a
/// group's vectors in order it is group_qdot_regs, whatever unrolls the loop around it.
template <int BITS>
__device__ __forceinline__ float vec_qdot(uint4 q, const float* __restrict__ x, float acc) {
  constexpr int kPer = 32 / BITS;  // codes per word
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4* xv = reinterpret_cast<const float4*>(x + j * kPer);
#pragma unroll
    for (int e4 = 0; e4 < kPer / 4; ++e4) {
      const float4 xx = xv[e4];
      const uint32_t w = words[j] >> (BITS * 4 * e4);
      acc = fmaf(code_f32(w, kMask), xx.x, acc);
      acc = fmaf(code_f32(w >> BITS, kMask), xx.y, acc);
      acc = fmaf(code_f32(w >> (2 * BITS), kMask), xx.z, acc);
      acc = fmaf(code_f32(w >> (3 * BITS), kMask), xx.w, acc);
    }
  }
  return acc;
}

/// Σ_i q_i·x_i over one 64-group whose code words are already in registers (`q`, loaded from
/// the group's 16-byte aligned words), `xg` the staged fp32 activations of that group.
template <int BITS>
__device__ __forceinline__ float group_qdot_regs(const uint4 (&q)[kGroupVecs<BITS>], const float* __restrict__ xg) {
  float acc = 0.0f;
#pragma unroll
  for (int v = 0; v < kGroupVecs<BITS>; ++v) acc = vec_qdot<BITS>(q[v], xg + v * 4 * (32 / BITS), acc);
  return acc;
}

/// Σ_i q_i·x_i over one 64-group: `gw` the group's 64·BITS/32 code words (16-byte aligned),
/// `xg` the staged fp32 activations of that group.
template <int BITS>
__device__ __forceinline__ float group_qdot(const uint4* __restrict__ gw, const float* __restrict__ xg) {
  uint4 q[kGroupVecs<BITS>];
#pragma unroll
  for (int v = 0; v < kGroupVecs<BITS>; ++v) q[v] = __ldg(gw + v);
  return group_qdot_regs<BITS>(q, xg);
}

/// Loads (code words, scale, bias) of 64-group g of matrix row `row` into registers; row < 0
/// loads nothing (the registers keep their values).
template <int BITS>
__device__ __forceinline__ void load_group(const DeviceQuant& w, int64_t row, int g, uint4 (&q)[kGroupVecs<BITS>],
                                           float& scale, float& bias) {
  if (row < 0) return;
  const int groups = w.cols / kGroup, wpr = w.cols * BITS / 32;
  const uint4* gw = reinterpret_cast<const uint4*>(w.codes + row * wpr + g * (kGroup * BITS / 32));
#pragma unroll
  for (int v = 0; v < kGroupVecs<BITS>; ++v) q[v] = __ldg(gw + v);
  const int64_t sb = row * groups + g;
  scale = to_f32(w.scales[sb]);
  bias = to_f32(w.biases[sb]);
}

/// This lane's share of the dot products of U matrix rows with the staged x: lanes of one
/// row-group (L lanes, lane_in ∈ [0, L)) stride over the row's groups. row[j] < 0 means "no row"
/// (contributes 0). Caller reduces acc[j] with group_sum(·, L).
template <int BITS, int U>
__device__ __forceinline__ void rows_partial(const DeviceQuant& w, const int64_t (&row)[U], const float* xs,
                                             const float* xsum, int lane_in, int L, float (&acc)[U]) {
  const int groups = w.cols / kGroup;
  const int wpr = w.cols * BITS / 32;
#pragma unroll
  for (int j = 0; j < U; ++j) acc[j] = 0.0f;
  for (int g = lane_in; g < groups; g += L) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (row[j] < 0) continue;
      const uint4* gw = reinterpret_cast<const uint4*>(w.codes + row[j] * wpr + g * (kGroup * BITS / 32));
      const int64_t sb = row[j] * groups + g;
      const float s = to_f32(w.scales[sb]), b = to_f32(w.biases[sb]);
      acc[j] += s * group_qdot<BITS>(gw, xs + g * kGroupStride) + b * xsum[g];
    }
  }
}

}  // namespace lily::cuda
