// The persistent decode kernel's MoE task bodies (nvcc only): the routing every expert task forms
// itself from the router logits, the gate/up rows of one expert slot with the SwiGLU, and the
// down rows of every slot with the weighted combine (docs/model.md §3.5; numerics of §4.3 item 5).
// decode_program.h names the tasks; decode_tasks_common.cuh states the rules every body follows.
//
// Both bodies compute their rows as one list (gate then up rows; or slot after slot of down
// rows, gemv_row_refs), so that every warp has rows whatever the slot count, with the arithmetic
// of every other task's GEMV (docs/model.md §4.2).
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
  int32_t ids[routed_plus_shared_slots(kMaxTopK)];
  float weights[routed_plus_shared_slots(kMaxTopK)];
};

/// Bytes at the start of an expert task's shared memory that hold its TaskRouting (16-byte
/// multiple, so that the staged rows after it stay aligned for float4 reads).
constexpr int kTaskRoutingBytes = static_cast<int>((sizeof(TaskRouting) + 15) / 16 * 16);

/// Shared-memory bytes of task_expert_gate_up: the routing, the staged hidden row, then the
/// fp32 gate and up outputs of up to `expert_rows` rows.
__host__ __device__ constexpr int64_t expert_gate_up_smem_bytes(int hidden, int expert_rows) {
  return kTaskRoutingBytes + staged_row_floats_16(hidden) * 4 + int64_t{2} * expert_rows * 4;
}

/// Shared-memory bytes of task_expert_down: the routing, the k + 1 staged activation rows of
/// width `ffn` (staged_row_floats_16(ffn) floats apart, so that every slot's row starts 16-byte
/// aligned), then the bf16-rounded down outputs, [k + 1][down_rows] fp32.
__host__ __device__ constexpr int64_t expert_down_smem_bytes(int ffn, int top_k, int down_rows) {
  const int slots = routed_plus_shared_slots(top_k);
  return kTaskRoutingBytes + slots * staged_row_floats_16(ffn) * 4 + int64_t{slots} * down_rows * 4;
}

/// The routing by warp 0 (the other warps return at once, so they can start staging): reads
/// p.router_logits (fp32 [E + 1], written by the router tasks: __ldcg) and writes `out`
/// (route_token_keys: bit-identical to the graph decode's routing, router_topk.cuh). No block
/// barrier: the caller's next __syncthreads() publishes `out`. Needs 1 ≤ k ≤ min(E, kMaxTopK)
/// and E ≤ kMaxExperts.
__device__ inline __noinline__ void route_warp0(const DecodeStepParams& p, TaskRouting& out) {
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

/// The slot runs of gate/up task rows sr: the gate rows, then the same rows of the up stack
/// (first rows e·moe_ffn + sr.first for any expert e, so both strides must keep 16-byte bounds).
__device__ __forceinline__ SlotRuns gate_up_slot_runs(const DecodeStepParams& p, const DecodeTaskLayer& lw,
                                                      const ExpertSlotRows& sr) {
  const int n = static_cast<int>(sr.last - sr.first);
  SlotRuns l = slot_runs(lw.gate, 2, n, p.grain.expert_rows);
  l.fits = l.fits && slot_runs(lw.gate, 2, n, p.moe_ffn).fits && lw.up.bits == lw.gate.bits && lw.up.cols == lw.gate.cols &&
           slot_runs(lw.up, 2, n, p.moe_ffn).fits;
  return l;
}

/// Where a gate/up task's two runs of rows come from, in the form slot_issue and
/// fill_gemv_runs take them (matrix_of(j), first_of(j)): run 0 is rows [row0, row0 + n) of the
/// gate stack, run 1 the same rows of the up stack (n: the task's row count).
struct GateUpRuns {
  const DecodeTaskLayer* lw = nullptr;
  int64_t row0 = 0;  ///< expert·moe_ffn + the task's first row of the expert's width
  /// Run j's matrix: the gate stack for j = 0, else the up stack.
  __device__ auto matrix_of() const {
    return [lw = lw](int j) -> const DeviceQuant& { return j == 0 ? lw->gate : lw->up; };
  }
  /// Run j's first row: row0 for both runs.
  __device__ auto first_of() const {
    return [row0 = row0](int) { return row0; };
  }
};

/// The runs of gate/up task rows sr of expert `expert` (a routed id, or E for the shared expert).
__device__ __forceinline__ GateUpRuns gate_up_runs(const DecodeStepParams& p, const DecodeTaskLayer& lw, int expert,
                                                   const ExpertSlotRows& sr) {
  return GateUpRuns{&lw, int64_t{expert} * p.moe_ffn + sr.first};
}

/// The slot runs of down task rows rr: k + 1 runs, one per slot, of rows e_s·hidden + rr.first
/// (both strides must keep 16-byte bounds).
__device__ __forceinline__ SlotRuns down_slot_runs(const DecodeStepParams& p, const DecodeTaskLayer& lw, RowRange rr) {
  const int n = static_cast<int>(rr.last - rr.first);
  const int slots = routed_plus_shared_slots(p.top_k);
  SlotRuns l = slot_runs(lw.down, slots, n, p.grain.down_rows);
  l.fits = l.fits && slot_runs(lw.down, slots, n, p.hidden).fits;
  return l;
}

/// Starts the copy of expert task (kind, part) of layer l into `slot` on `bar`, with the routing
/// `route` (a routed gate/up slot, or the down rows of every slot). Thread 0; the caller has
/// checked that the rows fit (expert_copy_fits).
__device__ inline void issue_expert_copy(const DecodeStepParams& p, int layer, int kind, int part,
                                         const TaskRouting& route, unsigned char* slot, uint64_t* bar) {
  const DecodeTaskLayer& lw = p.layers[layer];
  if (static_cast<DecodeTaskKind>(kind) == DecodeTaskKind::kExpertGateUp) {
    const ExpertSlotRows sr = gate_up_part(p, part);
    const GateUpRuns g = gate_up_runs(p, lw, route.ids[sr.slot], sr);
    slot_issue(gate_up_slot_runs(p, lw, sr), g.matrix_of(), g.first_of(), slot, bar);
  } else {
    const RowRange rr = part_rows(part, p.grain.down_rows, p.hidden);
    slot_issue(down_slot_runs(p, lw, rr), [&](int) -> const DeviceQuant& { return lw.down; },
               [&](int s) { return int64_t{route.ids[s]} * p.hidden + rr.first; }, slot, bar);
  }
}

/// Whether task (kind, part) of layer l needs the routing for its copy (a routed gate/up slot, or
/// the down rows) and its rows fit a slot.
__device__ inline bool expert_copy_fits(const DecodeStepParams& p, int layer, int kind, int part) {
  const DecodeTaskLayer& lw = p.layers[layer];
  if (static_cast<DecodeTaskKind>(kind) == DecodeTaskKind::kExpertGateUp) {
    const ExpertSlotRows sr = gate_up_part(p, part);
    return sr.slot < p.top_k && gate_up_slot_runs(p, lw, sr).fits;
  }
  if (static_cast<DecodeTaskKind>(kind) == DecodeTaskKind::kExpertDown)
    return down_slot_runs(p, lw, part_rows(part, p.grain.down_rows, p.hidden)).fits;
  return false;
}

/// Thread 0 of a task that has just routed layer `layer`: starts the next task's copy when the
/// kernel asked for it (TaskSmem::copy_next).
__device__ __forceinline__ void copy_next_expert(const DecodeStepParams& p, int layer, const TaskRouting& route,
                                                 const TaskSmem& m) {
  if (m.copy_next) issue_expert_copy(p, layer, m.next_kind, m.next_part, route, m.next_slot, m.next_bar);
}

/// Gate/up task `part` of layer l (docs/model.md §3.5 step 3–4, §4.3 item 5): slot s and rows
/// [r0, r1) of its width (gate_up_part); expert e = the slot's routed id (E for the shared slot,
/// which needs no routing). With u = p.moe_normed (bf16 [hidden], staged past L1), g = rows
/// e·moe_ffn + r of the gate stack ([(E + 1)·moe_ffn, hidden]) and v the same rows of the up
/// stack, both fp32 GEMVs; act[r] = bf16(silu(bf16(g))·bf16(v)), as the graph decode's expert
/// kernels, stored into p.act at s·moe_ffn + r. The rows travel through the task's slot where
/// they fit (a routed slot's copy starts once warp 0 has routed, or was started by the block's
/// previous expert task of the layer with its routing; the shared slot's may have been started
/// by the kernel); returns whether they did. m.work: expert_gate_up_smem_bytes(hidden,
/// grain.expert_rows). All threads.
__device__ inline bool task_expert_gate_up(const DecodeStepParams& p, int layer, int part, const TaskSmem& m) {
  const DecodeTaskLayer& lw = p.layers[layer];
  const ExpertSlotRows sr = gate_up_part(p, part);
  const int n = static_cast<int>(sr.last - sr.first);
  const SlotRuns slot = gate_up_slot_runs(p, lw, sr);
  TaskRouting& route = *reinterpret_cast<TaskRouting*>(m.work);
  float* xs = reinterpret_cast<float*>(m.work + kTaskRoutingBytes);
  float* gu = xs + staged_row_floats_16(p.hidden);  // [2][n]: gate outputs, then up outputs
  const bool routed = sr.slot < p.top_k;
  if (routed) route_warp0(p, route);
  if (threadIdx.x == 0) {  // the routed rows are known only now
    const GateUpRuns g = gate_up_runs(p, lw, routed ? route.ids[sr.slot] : p.n_experts, sr);
    if (!m.prefetched) {
      if (slot.fits) {
        slot_issue(slot, g.matrix_of(), g.first_of(), m.slot, m.bar);
      } else {  // towards L2 while the block stages x
        prefetch_rows_l2(lw.gate, g.row0, g.row0 + n);
        prefetch_rows_l2(lw.up, g.row0, g.row0 + n);
      }
    }
    if (routed) copy_next_expert(p, layer, route, m);
    fill_gemv_runs(*m.gemv, slot, m.slot, g.matrix_of(), g.first_of(), xs, 0);  // gu: gate rows, then up rows
  }
  stage_row_cg(p.moe_normed, p.hidden, xs);  // its barriers also publish the routing and m.gemv
  if (slot.fits) task_slot_wait(m);
  task_gemv(*m.gemv, gu);
  __syncthreads();
  task_stamp_gemv(m);
  bf16* act = p.act + int64_t{sr.slot} * p.moe_ffn + sr.first;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    act[i] = to_bf16(__fmul_rn(silu(round_bf16(gu[i])), round_bf16(gu[n + i])));
  return slot.fits;
}

/// Whether the kernel may start gate/up task `part`'s copy before the task: the shared
/// expert's slot (its rows do not depend on the routing), when they fit a slot. The slot layout
/// in `l`, where the rows come from in `g`.
__device__ __forceinline__ bool gate_up_prefetchable(const DecodeStepParams& p, int layer, int part, SlotRuns& l,
                                                     GateUpRuns& g) {
  const ExpertSlotRows sr = gate_up_part(p, part);
  if (sr.slot < p.top_k) return false;
  l = gate_up_slot_runs(p, p.layers[layer], sr);
  g = gate_up_runs(p, p.layers[layer], p.n_experts, sr);
  return l.fits;
}

/// Down task `part` of layer l (docs/model.md §3.5 step 5, §4.3 item 5): hidden rows [r0, r1)
/// (grain.down_rows). Every slot s ≤ k's activation row a_s = p.act[s·moe_ffn …] (bf16 [ffn],
/// staged past L1, all slots at once) times rows e_s·hidden + r of the down stack
/// ([(E + 1)·hidden, ffn]), rounded to bf16: d_s; then out[r] = bf16(Σ_s w_s·d_s), an fp32 fma
/// chain from 0 in slot order (the shared expert last, w_k = sigmoid of its gate logit), as
/// combine_slots (moe_block.cuh) and the CPU reference's routed sum + γ·shared; bf16 into
/// p.moe_out. The shared slot's width must be the stack's ffn (the device model requires
/// shared_ffn == moe_ffn). The k + 1 runs of rows travel through the task's slot where they fit
/// (the copy starts once warp 0 has routed, unless the block's previous task of the layer started
/// it with its routing); returns whether they did. m.work:
/// expert_down_smem_bytes(ffn, k, grain.down_rows). All threads.
__device__ inline bool task_expert_down(const DecodeStepParams& p, int layer, int part, const TaskSmem& m) {
  const DecodeTaskLayer& lw = p.layers[layer];
  const RowRange rr = part_rows(part, p.grain.down_rows, p.hidden);
  const int n = static_cast<int>(rr.last - rr.first), n_sel = routed_plus_shared_slots(p.top_k);
  const int ffn = lw.down.cols, groups = ffn / kGroup;
  const SlotRuns slot = down_slot_runs(p, lw, rr);
  const int64_t stride = staged_row_floats_16(ffn);  // floats from one slot's staged row to the next
  TaskRouting& route = *reinterpret_cast<TaskRouting*>(m.work);
  float* xs = reinterpret_cast<float*>(m.work + kTaskRoutingBytes);  // [n_sel][stride]
  float* part_out = xs + n_sel * stride;                              // [n_sel][n]
  route_warp0(p, route);
  if (threadIdx.x == 0) {
    const auto down = [&](int) -> const DeviceQuant& { return lw.down; };
    const auto first_of = [&](int s) { return int64_t{route.ids[s]} * p.hidden + rr.first; };
    if (!m.prefetched) {
      if (slot.fits)
        slot_issue(slot, down, first_of, m.slot, m.bar);
      else  // the routed rows, towards L2 while the block stages the activations
        for (int s = 0; s < p.top_k; ++s) prefetch_rows_l2(lw.down, first_of(s), first_of(s) + n);
    }
    copy_next_expert(p, layer, route, m);
    fill_gemv_runs(*m.gemv, slot, m.slot, down, first_of, xs, stride);  // part_out: slot after slot
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
  __syncthreads();  // also publishes the routing and m.gemv
  if (slot.fits) task_slot_wait(m);
  task_gemv(*m.gemv, part_out);
  __syncthreads();
  task_stamp_gemv(m);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < n_sel; ++s) o = __fmaf_rn(route.weights[s], round_bf16(part_out[s * n + i]), o);
    p.moe_out[rr.first + i] = to_bf16(o);
  }
  return slot.fits;
}

/// L2 prefetch for gate/up task `part` of layer l, before its wait: the shared expert slot's
/// gate and up rows (they do not depend on the routing); nothing for a routed slot (the body
/// prefetches those once it has routed). One thread.
__device__ inline void prefetch_expert_gate_up(const DecodeStepParams& p, int layer, int part) {
  const ExpertSlotRows sr = gate_up_part(p, part);
  if (sr.slot < p.top_k) return;
  const DecodeTaskLayer& lw = p.layers[layer];
  const GateUpRuns g = gate_up_runs(p, lw, p.n_experts, sr);
  const int64_t n = sr.last - sr.first;
  prefetch_rows_l2(lw.gate, g.row0, g.row0 + n);
  prefetch_rows_l2(lw.up, g.row0, g.row0 + n);
}

/// L2 prefetch for down task `part` of layer l, before its wait: the shared expert's down rows
/// E·hidden + [r0, r1). One thread.
__device__ inline void prefetch_expert_down(const DecodeStepParams& p, int layer, int part) {
  const RowRange rr = part_rows(part, p.grain.down_rows, p.hidden);
  const int64_t row0 = int64_t{p.n_experts} * p.hidden;
  prefetch_rows_l2(p.layers[layer].down, row0 + rr.first, row0 + rr.last);
}

}  // namespace lily::cuda
