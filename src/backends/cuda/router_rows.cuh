// The router GEMV's per-row arithmetic for the decode kernels that compute router logits inside
// a larger launch (router.cu: router + top-k; moe_block.cu: the whole MoE block) (nvcc only).
// Rows are spread over every warp of the grid: with L lanes per row (lanes_per_row), warp w
// takes rows w·RW + lane_row, then steps by n_warps·RW (RW = 32 / L rows per warp pass), and
// each row is launch_quant_gemv's arithmetic exactly (rows_partial<BITS, 1>: groups lane_in,
// lane_in + L, … then group_sum), so the logits are bit-identical to the stand-alone GEMV's.
#pragma once
#include <cstdint>

#include "backends/cuda/quant_dot.cuh"

namespace lily::cuda {

/// One warp's share of the router rows and the first weight group of its first row, loaded
/// into registers before the PDL wait (weights are never written, launch.cuh).
template <int BITS>
struct RouterRows {
  int L = 1, RW = 32, lane_row = 0, lane_in = 0;
  int64_t first = 0;  ///< this warp's first row base (warp_id · RW)
  int64_t step = 0;   ///< n_warps · RW
  uint4 q[kGroupVecs<BITS>];
  float sc = 0.0f, bi = 0.0f;

  /// warp_id / n_warps: this warp's index among the n_warps that share the rows. `load`: fill
  /// the registers now (else prefetch_l2 may ask L2 for them, and compute must be told that the
  /// registers do not hold them).
  __device__ __forceinline__ RouterRows(const DeviceQuant& w, int64_t warp_id, int64_t n_warps, bool load = true) {
    const int groups = w.cols / kGroup;
    const int lane = threadIdx.x % kWarp;
    L = lanes_per_row(groups);
    RW = kWarp / L;
    lane_row = lane / L;
    lane_in = lane % L;
    first = warp_id * RW;
    step = n_warps * RW;
    const int64_t r = first + lane_row;
    if (load) load_group<BITS>(w, r < w.rows ? r : -1, lane_in, q, sc, bi);
  }

  /// Asks L2 for what the constructor would have loaded (this lane's first group: its code
  /// bytes, scale and bias), without holding registers for it.
  __device__ __forceinline__ void prefetch_l2(const DeviceQuant& w) const {
    const int64_t r = first + lane_row;
    if (r >= w.rows) return;
    const int groups = w.cols / kGroup, wpr = w.cols * BITS / 32;
    const uint32_t* codes = w.codes + r * wpr + lane_in * (kGroup * BITS / 32);
    for (int off = 0; off < kGroup * BITS / 8; off += 32)  // every 32-byte sector of the group's codes
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(codes) + off));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w.scales + r * groups + lane_in));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w.biases + r * groups + lane_in));
  }

  /// Whether the registers hold this warp's whole share (one row pass of one group per lane),
  /// so that compute() needs no load for any activation row.
  __device__ __forceinline__ bool holds_all(const DeviceQuant& w) const {
    return L == w.cols / kGroup && first + step >= w.rows;
  }

  /// out[r] = W x for this warp's rows; xs / xsum the staged activation row (stage_row layout).
  /// All lanes of the warp. `first_in_regs`: the registers still hold the first group (true for
  /// the first call only; later calls, for other activation rows, load it again: same values).
  __device__ __forceinline__ void compute(const DeviceQuant& w, const float* xs, const float* xsum,
                                          float* __restrict__ out, bool first_in_regs = true) {
    const int groups = w.cols / kGroup;
    for (int64_t base = first; base < w.rows; base += step) {
      const int64_t r = base + lane_row;
      float acc = 0.0f;  // rows_partial<BITS, 1>'s arithmetic, first group from the registers
      if (r < w.rows) {
        for (int g = lane_in; g < groups; g += L) {
          if (!first_in_regs || base != first || g != lane_in) load_group<BITS>(w, r, g, q, sc, bi);
          acc += sc * group_qdot_regs<BITS>(q, xs + g * kGroupStride) + bi * xsum[g];
        }
      }
      const float v = group_sum(acc, L);
      if (r < w.rows && lane_in == 0) out[r] = v;
    }
  }
};

}  // namespace lily::cuda
