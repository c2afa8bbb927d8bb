// The persistent decode kernel's weight-streaming task bodies (nvcc only): the embedding, the
// in- and out-projections, the router, the LM head and the argmax (decode_program.h names the
// tasks; decode_tasks_common.cuh states the rules every body follows). Each projection task
// stages its input row once (with the add + RMSNorm where the step has one in front of the
// projection, docs/model.md §4.3) and computes its rows with gemv_row_refs, from its weight slot
// where the rows fit one.
#pragma once
#include <cuda_bf16.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "backends/cuda/argmax.cuh"
#include "backends/cuda/decode_tasks_common.cuh"

namespace lily::cuda {

/// The embedding (docs/model.md §3.1): row `token` of the 4- or 8-bit table dequantized,
/// bf16(s·q + b), into p.residual [hidden]. Token ids outside the table are clamped (the host
/// refuses them before any step). All threads.
__device__ inline void task_embed(const DecodeStepParams& p) {
  const DeviceQuant& t = p.embed;
  int64_t id = __ldcg(p.token);
  id = id < 0 ? 0 : (id >= t.rows ? t.rows - 1 : id);
  const int per = 32 / t.bits, wpr = t.cols / per, groups = t.cols / kGroup;
  const uint32_t mask = (1u << t.bits) - 1u;
  for (int wi = threadIdx.x; wi < wpr; wi += blockDim.x) {
    const uint32_t word = __ldg(t.codes + id * wpr + wi);
    const int c0 = wi * per, g = c0 / kGroup;
    const float s = to_f32(t.scales[id * groups + g]), b = to_f32(t.biases[id * groups + g]);
    for (int e = 0; e < per; ++e)
      p.residual[c0 + e] = to_bf16(s * static_cast<float>((word >> (t.bits * e)) & mask) + b);
  }
}

/// In-projection rows of layer l, part `part` (grain.proj_rows rows): the layer input h (the
/// embedding for layer 0, else bf16(mid + moe_out)) normed with the input norm, times rows of
/// the layer's in-projection, bf16 into p.proj. Part 0 of a layer after the first also stores h
/// into p.residual (the router's add reads it). Weights through the task's slot where they fit;
/// returns whether they did (the slot's phase was used). `m.work`: the staged row.
__device__ inline bool task_in_proj(const DecodeStepParams& p, int l, int part, const TaskSmem& m) {
  const DecodeTaskLayer& lw = p.layers[l];
  const RowRange r = part_rows(part, p.grain.proj_rows, lw.in_proj.rows);
  float* xs = reinterpret_cast<float*>(m.work);
  const SlotRuns slot = task_copy_rows_fill_gemv(lw.in_proj, r, p.grain.proj_rows, m, xs);
  const bool first = l == 0;
  stage_add_norm_cg(first ? p.residual : p.mid, first ? nullptr : p.moe_out, lw.input_norm, p.hidden, p.eps, xs,
                    !first && part == 0 ? p.residual : nullptr, nullptr);
  bf16* y = p.proj;
  task_gemv_rows(lw.in_proj, r, slot, xs, m, [&](int64_t row, float v) { y[row] = to_bf16(v); });
  return slot.fits;
}

/// Out-projection rows of layer l, part `part` (grain.out_rows rows of hidden): the mixer's
/// output p.mix times rows of the out-projection, bf16 into p.mixer_out. Weights and the return
/// value as task_in_proj.
__device__ inline bool task_out_proj(const DecodeStepParams& p, int l, int part, const TaskSmem& m) {
  const DecodeTaskLayer& lw = p.layers[l];
  const RowRange r = part_rows(part, p.grain.out_rows, lw.out_proj.rows);
  float* xs = reinterpret_cast<float*>(m.work);
  const SlotRuns slot = task_copy_rows_fill_gemv(lw.out_proj, r, p.grain.out_rows, m, xs);
  stage_row_cg(p.mix, lw.out_proj.cols, xs);
  bf16* y = p.mixer_out;
  task_gemv_rows(lw.out_proj, r, slot, xs, m, [&](int64_t row, float v) { y[row] = to_bf16(v); });
  return slot.fits;
}

/// Router rows of layer l, part `part` (grain.router_rows of the E + 1 rows: the router's
/// logits, then the shared expert's gate): mid = bf16(residual + mixer_out) normed with the
/// post norm, times the 8-bit rows, fp32 into p.router_logits. Part 0 stores mid into p.mid and
/// the normed row into p.moe_normed (the expert tasks read them). Weights and the return value
/// as task_in_proj.
__device__ inline bool task_router(const DecodeStepParams& p, int l, int part, const TaskSmem& m) {
  const DecodeTaskLayer& lw = p.layers[l];
  const RowRange r = part_rows(part, p.grain.router_rows, lw.router.rows);
  float* xs = reinterpret_cast<float*>(m.work);
  const SlotRuns slot = task_copy_rows_fill_gemv(lw.router, r, p.grain.router_rows, m, xs);
  stage_add_norm_cg(p.residual, p.mixer_out, lw.post_norm, p.hidden, p.eps, xs, part == 0 ? p.mid : nullptr,
                    part == 0 ? p.moe_normed : nullptr);
  float* y = p.router_logits;
  task_gemv_rows(lw.router, r, slot, xs, m, [&](int64_t row, float v) { y[row] = v; });
  return slot.fits;
}

/// The slot runs of a projection or router task whose copy the kernel may start before the
/// task (its rows never depend on the step's data): `fits` false for other kinds.
__device__ inline SlotRuns projection_slot_runs(const DecodeStepParams& p, DecodeTaskKind kind, int l, int part,
                                                const DeviceQuant*& w, RowRange& r) {
  int per = 0;
  switch (kind) {
    case DecodeTaskKind::kInProj: w = &p.layers[l].in_proj, per = p.grain.proj_rows; break;
    case DecodeTaskKind::kOutProj: w = &p.layers[l].out_proj, per = p.grain.out_rows; break;
    case DecodeTaskKind::kRouter: w = &p.layers[l].router, per = p.grain.router_rows; break;
    default: return SlotRuns{};
  }
  r = part_rows(part, per, w->rows);
  return slot_runs(*w, 1, static_cast<int>(r.last - r.first), per);
}

/// LM head rows, part `part` (grain.lm_rows of vocab): the final norm of bf16(mid + moe_out)
/// times the rows (read from global memory: 1,024 rows are far more than a slot), fp32 into
/// p.logits, and the part's best (logit, id) into p.head_best_value / p.head_best_id [part] for
/// the argmax task. m.work: the staged row, then the part's logits.
__device__ inline void task_lm_head(const DecodeStepParams& p, int part, const TaskSmem& m) {
  float* xs = reinterpret_cast<float*>(m.work);
  const DeviceQuant& w = p.lm_head;
  const RowRange r = part_rows(part, p.grain.lm_rows, w.rows);
  if (threadIdx.x == 0) {
    SlotRuns global;  // not in a slot
    global.runs = 1, global.count = static_cast<int>(r.last - r.first);
    fill_gemv_runs(*m.gemv, global, nullptr, [&](int) -> const DeviceQuant& { return w; }, [&](int) { return r.first; },
                   xs, 0);
  }
  stage_add_norm_cg(p.mid, p.moe_out, p.final_norm, p.hidden, p.eps, xs, nullptr, nullptr);
  float* out = xs + staged_row_floats_16(p.hidden);
  task_gemv(*m.gemv, out);
  __syncthreads();
  float best = -INFINITY;
  int best_id = INT_MAX;
  for (int v = threadIdx.x; v < r.last - r.first; v += blockDim.x) {
    const int row = static_cast<int>(r.first + v);
    p.logits[row] = out[v];
    if (argmax_beats(out[v], row, best, best_id)) best = out[v], best_id = row;
  }
  block_argmax(best, best_id);
  if (threadIdx.x == 0) {
    p.head_best_value[part] = best;
    p.head_best_id[part] = best_id;
  }
}

/// The next token: the best of the LM head parts' bests (`parts` of them), ties to the lowest
/// id, id 0 when every logit is NaN, into p.next_token.
__device__ inline void task_argmax(const DecodeStepParams& p, int parts) {
  float best = -INFINITY;
  int best_id = INT_MAX;
  for (int k = threadIdx.x; k < parts; k += blockDim.x) {
    const float v = __ldcg(p.head_best_value + k);
    const int i = __ldcg(p.head_best_id + k);
    if (argmax_beats(v, i, best, best_id)) best = v, best_id = i;
  }
  block_argmax(best, best_id);
  if (threadIdx.x == 0) *p.next_token = best_id == INT_MAX ? 0 : best_id;
}

/// L2 prefetch of a projection task's weight rows (one thread, before its input wait: weights
/// never depend on the step's data).
__device__ inline void prefetch_in_proj(const DecodeStepParams& p, int l, int part) {
  const DeviceQuant& w = p.layers[l].in_proj;
  const RowRange r = part_rows(part, p.grain.proj_rows, w.rows);
  prefetch_rows_l2(w, r.first, r.last);
}
__device__ inline void prefetch_out_proj(const DecodeStepParams& p, int l, int part) {
  const DeviceQuant& w = p.layers[l].out_proj;
  const RowRange r = part_rows(part, p.grain.out_rows, w.rows);
  prefetch_rows_l2(w, r.first, r.last);
}
__device__ inline void prefetch_router(const DecodeStepParams& p, int l, int part) {
  const DeviceQuant& w = p.layers[l].router;
  const RowRange r = part_rows(part, p.grain.router_rows, w.rows);
  prefetch_rows_l2(w, r.first, r.last);
}
__device__ inline void prefetch_lm_head(const DecodeStepParams& p, int part) {
  const RowRange r = part_rows(part, p.grain.lm_rows, p.lm_head.rows);
  prefetch_rows_l2(p.lm_head, r.first, r.last);
}

}  // namespace lily::cuda
