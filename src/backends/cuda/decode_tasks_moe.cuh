// The persistent decode kernel's MoE task bodies (nvcc only): the routing every expert task forms
// itself from the router logits, the gate/up rows of one expert slot with the SwiGLU, and the
// down rows of every slot with the weighted combine (docs/model.md §3.5; numerics of §4.3 item 5).
// decode_program.h names the tasks; decode_tasks_common.cuh states the rules every body follows.
//
// Both bodies compute their rows as one list of "virtual" rows (gate then up rows; or slot after
// slot of down rows), so that every warp has rows whatever the slot count, and the weight loads
// of all of them are in flight together. Per row the arithmetic is gemv_rows's (docs/model.md
// §4.2): the same lanes, the same groups in the same order, the same reduction.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/decode_tasks_common.cuh"
#include "backends/cuda/router_topk.cuh"

namespace lily::cuda {

/// The routing of one token (docs/model.md §3.5 step 2, §4.3 item 5): slots 0 … k − 1 the routed
/// experts in descending weight (ties to the lowest id), weights softmax over the k selected
/// logits (fp32); slot k the shared expert, id E, weight sigmoid(shared gate logit). Lives in
/// shared memory; slot s of ids / weights for s ≤ k.
struct TaskRouting {
  int32_t ids[kMaxTopK + 1];
  float weights[kMaxTopK + 1];
};

/// Bytes at the start of an expert task's shared memory that hold its TaskRouting (16-byte
/// multiple, so that the staged rows after it stay aligned for float4 reads).
constexpr int kTaskRoutingBytes = static_cast<int>((sizeof(TaskRouting) + 15) / 16 * 16);

/// Floats between two slots' staged activation rows in the down task (staged_row_floats of
/// `ffn`, rounded up to a multiple of 4 so that every slot starts 16-byte aligned).
__host__ __device__ constexpr int64_t task_slot_floats(int ffn) { return (staged_row_floats(ffn) + 3) / 4 * 4; }

/// Shared-memory bytes of task_expert_gate_up: the routing, the staged hidden row, then the
/// fp32 gate and up outputs of up to `expert_rows` rows.
__host__ __device__ constexpr int64_t expert_gate_up_smem_bytes(int hidden, int expert_rows) {
  return kTaskRoutingBytes + (staged_row_floats(hidden) + 3) / 4 * 4 * 4 + int64_t{2} * expert_rows * 4;
}

/// Shared-memory bytes of task_expert_down: the routing, the k + 1 staged activation rows of
/// width `ffn`, then the bf16-rounded down outputs, [k + 1][down_rows] fp32.
__host__ __device__ constexpr int64_t expert_down_smem_bytes(int ffn, int top_k, int down_rows) {
  return kTaskRoutingBytes + (top_k + 1) * task_slot_floats(ffn) * 4 + int64_t{top_k + 1} * down_rows * 4;
}

/// The routing by warp 0 (the other warps return at once, so they can start staging): reads
/// p.router_logits (fp32 [E + 1], written by the router tasks: __ldcg) and writes `out`
/// (route_token_keys: bit-identical to the graph decode's routing, router_topk.cuh). No block
/// barrier: the caller's next __syncthreads() publishes `out`. Needs 1 ≤ k ≤ min(E, kMaxTopK)
/// and E ≤ kMaxExperts.
__device__ __forceinline__ void route_warp0(const DecodeStepParams& p, TaskRouting& out) {
  if (threadIdx.x >= kWarp) return;
  if (p.n_experts <= kWarp * kRouteKeysSmall)
    route_token_keys<kRouteKeysSmall>(p.router_logits, p.n_experts, p.top_k, out.ids, out.weights);
  else
    route_token_keys<kRouteKeysLarge>(p.router_logits, p.n_experts, p.top_k, out.ids, out.weights);
  __syncwarp();  // lane 0 may read the other lanes' picks (the routed prefetch)
}

/// The routing of the current token into `out` (shared memory), TaskRouting's meaning. All
/// threads; ends with __syncthreads().
__device__ inline void task_route(const DecodeStepParams& p, TaskRouting& out) {
  route_warp0(p, out);
  __syncthreads();
}

/// One gate/up task's share of the step: slot `slot` (k: the shared expert), rows [first, last)
/// of its width.
struct ExpertSlotRows {
  int slot = 0;
  int64_t first = 0, last = 0;
};

/// Slot and rows of gate/up part `part`, in build_decode_program's enumeration: the slots in
/// order, each cut every grain.expert_rows rows of its width (moe_ffn for slots 0 … k − 1,
/// shared_ffn for slot k).
__device__ __forceinline__ ExpertSlotRows gate_up_part(const DecodeStepParams& p, int part) {
  const int per = p.grain.expert_rows, k = p.top_k;
  const int routed_parts = (p.moe_ffn + per - 1) / per;
  const bool routed = part < k * routed_parts;
  const int slot = routed ? part / routed_parts : k;
  const int in_slot = routed ? part % routed_parts : part - k * routed_parts;
  const RowRange r = part_rows(in_slot, per, routed ? p.moe_ffn : p.shared_ffn);
  return ExpertSlotRows{slot, r.first, r.last};
}

/// Σ over the groups of U rows as rows_partial computes them (the same groups per lane in the
/// same order, acc += s·Σ(q·x) + b·Σx), where row j is row[j] of w1 when second[j], else of w0
/// (same bits and cols), against its own staged row xs[j] (its group sums after the groups).
/// row[j] < 0: no row (acc 0). Weights through the read-only path. Caller reduces with
/// group_sum(·, L).
template <int BITS, int U>
__device__ __forceinline__ void rows_partial_mixed(const DeviceQuant& w0, const DeviceQuant& w1,
                                                   const int64_t (&row)[U], const bool (&second)[U],
                                                   const float* const (&xs)[U], int groups, int lane_in, int L,
                                                   float (&acc)[U]) {
  const int wpr = groups * (kGroup * BITS / 32);
#pragma unroll
  for (int j = 0; j < U; ++j) acc[j] = 0.0f;
  for (int g = lane_in; g < groups; g += L) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (row[j] < 0) continue;
      const DeviceQuant& w = second[j] ? w1 : w0;
      const uint4* gw = reinterpret_cast<const uint4*>(w.codes + row[j] * wpr + g * (kGroup * BITS / 32));
      const int64_t sb = row[j] * groups + g;
      const float s = bits_to_f32(__ldg(reinterpret_cast<const unsigned short*>(w.scales + sb)));
      const float b = bits_to_f32(__ldg(reinterpret_cast<const unsigned short*>(w.biases + sb)));
      acc[j] += s * group_qdot<BITS>(gw, xs[j] + g * kGroupStride) + b * xs[j][groups * kGroupStride + g];
    }
  }
}

/// `count` virtual rows v, dealt to the warps' row-groups as gemv_rows deals rows (lanes_per_row
/// lanes a row, kTaskGemvUnroll rows a row-group at a time): row_of(v, row, second, xs) names
/// the matrix row (of w1 when second, else w0) and the staged input of v, and store(v, value)
/// takes the fp32 dot product (one lane per row). w0, w1: BITS-bit, `groups` 64-groups a row.
/// All threads (warp-uniform loops).
template <int BITS, class RowOf, class Store>
__device__ __forceinline__ void gemv_virtual_rows(const DeviceQuant& w0, const DeviceQuant& w1, int groups, int count,
                                                  RowOf row_of, Store store) {
  constexpr int U = kTaskGemvUnroll;
  const int L = lanes_per_row(groups), per_warp = kWarp / L;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  const int sub = lane / L, lane_in = lane % L;
  const int per_round = n_warps * per_warp * U;
  const int rounds = (count + per_round - 1) / per_round;
  for (int it = 0; it < rounds; ++it) {  // the same count on every lane: shuffles stay converged
    const int base = it * per_round + (warp * per_warp + sub) * U;
    int64_t row[U];
    bool second[U];
    const float* xs[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      row[j] = -1;
      second[j] = false;
      xs[j] = nullptr;
      if (base + j < count) row_of(base + j, row[j], second[j], xs[j]);
    }
    float acc[U];
    rows_partial_mixed<BITS, U>(w0, w1, row, second, xs, groups, lane_in, L, acc);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float v = group_sum(acc[j], L);
      if (lane_in == 0 && base + j < count) store(base + j, v);
    }
  }
}

/// gemv_virtual_rows for matrices of either bit width (4 or 8; w0 and w1 alike).
template <class RowOf, class Store>
__device__ __forceinline__ void gemv_virtual_rows_any(const DeviceQuant& w0, const DeviceQuant& w1, int groups,
                                                      int count, RowOf row_of, Store store) {
  if (w0.bits == 8) gemv_virtual_rows<8>(w0, w1, groups, count, row_of, store);
  else gemv_virtual_rows<4>(w0, w1, groups, count, row_of, store);
}

/// Gate/up task `part` of layer l (docs/model.md §3.5 step 3–4, §4.3 item 5): slot s and rows
/// [r0, r1) of its width (gate_up_part); expert e = the slot's routed id (E for the shared slot,
/// which needs no routing). With u = p.moe_normed (bf16 [hidden], staged past L1), g = rows
/// e·moe_ffn + r of the gate stack ([(E + 1)·moe_ffn, hidden]) and v the same rows of the up
/// stack, both fp32 GEMVs; act[r] = bf16(silu(bf16(g))·bf16(v)), as the graph decode's expert
/// kernels, stored into p.act at s·moe_ffn + r. smem: expert_gate_up_smem_bytes(hidden,
/// grain.expert_rows). All threads.
__device__ inline void task_expert_gate_up(const DecodeStepParams& p, int layer, int part, char* smem) {
  const DecodeTaskLayer& L = p.layers[layer];
  const ExpertSlotRows sr = gate_up_part(p, part);
  const int n = static_cast<int>(sr.last - sr.first);
  TaskRouting& route = *reinterpret_cast<TaskRouting*>(smem);
  float* xs = reinterpret_cast<float*>(smem + kTaskRoutingBytes);
  float* gu = xs + (staged_row_floats(p.hidden) + 3) / 4 * 4;  // [2][n]: gate outputs, then up outputs
  const bool routed = sr.slot < p.top_k;
  if (routed) {
    route_warp0(p, route);
    // The routed rows are known only now: start them towards L2 while the block stages x.
    if (threadIdx.x == 0) {
      const int64_t row0 = int64_t{route.ids[sr.slot]} * p.moe_ffn + sr.first;
      prefetch_rows_l2(L.gate, row0, row0 + n);
      prefetch_rows_l2(L.up, row0, row0 + n);
    }
  }
  stage_row_cg(p.moe_normed, p.hidden, xs);  // its barriers also publish the routing
  const int64_t row0 = int64_t{routed ? route.ids[sr.slot] : p.n_experts} * p.moe_ffn + sr.first;
  gemv_virtual_rows_any(
      L.gate, L.up, p.hidden / kGroup, 2 * n,
      [&](int v, int64_t& row, bool& second, const float*& x) {
        second = v >= n;
        row = row0 + (second ? v - n : v);
        x = xs;
      },
      [&](int v, float value) { gu[v] = value; });
  __syncthreads();
  bf16* act = p.act + int64_t{sr.slot} * p.moe_ffn + sr.first;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    act[i] = to_bf16(__fmul_rn(silu(round_bf16(gu[i])), round_bf16(gu[n + i])));
}

/// Down task `part` of layer l (docs/model.md §3.5 step 5, §4.3 item 5): hidden rows [r0, r1)
/// (grain.down_rows). Every slot s ≤ k's activation row a_s = p.act[s·moe_ffn …] (bf16 [ffn],
/// staged past L1, all slots at once) times rows e_s·hidden + r of the down stack
/// ([(E + 1)·hidden, ffn]), rounded to bf16: d_s; then out[r] = bf16(Σ_s w_s·d_s), an fp32 fma
/// chain from 0 in slot order (the shared expert last, w_k = sigmoid of its gate logit), as
/// combine_slots (moe_block.cuh) and the CPU reference's routed sum + γ·shared; bf16 into
/// p.moe_out. The shared slot's width must be the stack's ffn (the device model requires
/// shared_ffn == moe_ffn). smem: expert_down_smem_bytes(ffn, k, grain.down_rows). All threads.
__device__ inline void task_expert_down(const DecodeStepParams& p, int layer, int part, char* smem) {
  const DecodeTaskLayer& L = p.layers[layer];
  const RowRange rr = part_rows(part, p.grain.down_rows, p.hidden);
  const int n = static_cast<int>(rr.last - rr.first), n_sel = p.top_k + 1;
  const int ffn = L.down.cols, groups = ffn / kGroup;
  const int64_t stride = task_slot_floats(ffn);
  TaskRouting& route = *reinterpret_cast<TaskRouting*>(smem);
  float* xs = reinterpret_cast<float*>(smem + kTaskRoutingBytes);  // [n_sel][stride]
  float* part_out = xs + n_sel * stride;                            // [n_sel][n]
  route_warp0(p, route);
  if (threadIdx.x == 0)  // the routed rows, towards L2 while the block stages the activations
    for (int s = 0; s < p.top_k; ++s) {
      const int64_t row0 = int64_t{route.ids[s]} * p.hidden + rr.first;
      prefetch_rows_l2(L.down, row0, row0 + n);
    }
  // All slots' activations: 8 bf16 a 16-byte load (ffn and the slot offsets are multiples of 64),
  // each to its slot's group layout.
  const int chunks = n_sel * ffn / 8;
  const uint4* a8 = reinterpret_cast<const uint4*>(p.act);
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
    const uint4 v = __ldcg(a8 + i);
    const int s = i * 8 / ffn, c = i * 8 % ffn;
    float4* dst = reinterpret_cast<float4*>(xs + s * stride + (c / kGroup) * kGroupStride + c % kGroup);
    dst[0] = bf16x4_to_f32(v.x, v.y);
    dst[1] = bf16x4_to_f32(v.z, v.w);
  }
  __syncthreads();
  // Group sums, one warp per (slot, group), in stage_group_sums's order (group_sum_x).
  {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
    for (int sg = warp; sg < n_sel * groups; sg += n_warps) {
      const int s = sg / groups, g = sg % groups;
      const float* xg = xs + s * stride + g * kGroupStride;
      const float sum = group_sum_x(xg[lane], xg[lane + 32]);
      if (lane == 0) xs[s * stride + groups * kGroupStride + g] = sum;
    }
  }
  __syncthreads();  // also publishes the routing
  gemv_virtual_rows_any(
      L.down, L.down, groups, n_sel * n,
      [&](int v, int64_t& row, bool& second, const float*& x) {
        const int s = v / n;
        row = int64_t{route.ids[s]} * p.hidden + rr.first + (v - s * n);
        second = false;
        x = xs + s * stride;
      },
      [&](int v, float value) { part_out[v] = round_bf16(value); });
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < n_sel; ++s) o = __fmaf_rn(route.weights[s], part_out[s * n + i], o);
    p.moe_out[rr.first + i] = to_bf16(o);
  }
}

/// L2 prefetch for gate/up task `part` of layer l, before its wait: the shared expert slot's
/// gate and up rows (they do not depend on the routing); nothing for a routed slot (the body
/// prefetches those once it has routed). One thread.
__device__ inline void prefetch_expert_gate_up(const DecodeStepParams& p, int layer, int part) {
  const ExpertSlotRows sr = gate_up_part(p, part);
  if (sr.slot < p.top_k) return;
  const DecodeTaskLayer& L = p.layers[layer];
  const int64_t row0 = int64_t{p.n_experts} * p.moe_ffn;
  prefetch_rows_l2(L.gate, row0 + sr.first, row0 + sr.last);
  prefetch_rows_l2(L.up, row0 + sr.first, row0 + sr.last);
}

/// L2 prefetch for down task `part` of layer l, before its wait: the shared expert's down rows
/// E·hidden + [r0, r1). One thread.
__device__ inline void prefetch_expert_down(const DecodeStepParams& p, int layer, int part) {
  const RowRange rr = part_rows(part, p.grain.down_rows, p.hidden);
  const int64_t row0 = int64_t{p.n_experts} * p.hidden;
  prefetch_rows_l2(p.layers[layer].down, row0 + rr.first, row0 + rr.last);
}

}  // namespace lily::cuda
