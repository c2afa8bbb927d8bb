// The persistent decode kernel and its debug form (decode_megakernel.h).
#include "backends/cuda/decode_megakernel.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "backends/cuda/common.cuh"
#include "backends/cuda/decode_tasks_attention.cuh"
#include "backends/cuda/decode_tasks_gdn.cuh"
#include "backends/cuda/decode_tasks_moe.cuh"
#include "backends/cuda/decode_tasks_proj.cuh"
#include "backends/cuda/task_sync.cuh"
#include "base/error.h"

namespace lily::cuda {
namespace {

using Task = DecodeProgramImage::Task;

/// Runs the body of a task of kind `kind` (DecodeTaskKind) on (layer, part). All threads.
/// Returns whether the task read its weights from its slot (m.slot), which used a phase of m.bar.
/// A task without weight rows gets the larger work area `wide` (kDecodeTaskSmemBytes, over its
/// slot: the slot's phase is not used).
/// `early`: the task's reads that the kernel started before its wait (a GDN task's states).
__device__ __forceinline__ bool run_task(const DecodeStepParams& p, int kind, int layer, int part, int lm_parts,
                                         const TaskSmem& m, char* wide, bool early) {
  switch (static_cast<DecodeTaskKind>(kind)) {
    case DecodeTaskKind::kEmbed: task_embed(p); return false;
    case DecodeTaskKind::kInProj: return task_in_proj(p, layer, part, m);
    case DecodeTaskKind::kGdnHeads: task_gdn_heads(p, layer, part, wide, early); return false;
    case DecodeTaskKind::kAttnPrepare: task_attn_prepare(p, layer, part, wide); return false;
    case DecodeTaskKind::kAttnSplit: task_attn_split(p, layer, part, wide); return false;
    case DecodeTaskKind::kAttnCombine: task_attn_combine(p, layer, part, wide); return false;
    case DecodeTaskKind::kOutProj: return task_out_proj(p, layer, part, m);
    case DecodeTaskKind::kRouter: return task_router(p, layer, part, m);
    case DecodeTaskKind::kExpertGateUp: return task_expert_gate_up(p, layer, part, m);
    case DecodeTaskKind::kExpertDown: return task_expert_down(p, layer, part, m);
    case DecodeTaskKind::kLmHead: task_lm_head(p, part, m); return false;
    case DecodeTaskKind::kArgmax: task_argmax(p, lm_parts); return false;
  }
  return false;
}

/// Whether the kernel may start the copy of a task's weight rows into a slot before the task
/// runs (rows that never depend on the step's data, and fit a slot): the projections, the router
/// and the shared expert's gate/up. With `issue`, thread 0 starts it into `slot` on `bar`. The
/// body then finds m.prefetched set and only waits. Every thread computes the same answer.
__device__ __forceinline__ bool task_prefetch_weights(const DecodeStepParams& p, int kind, int layer, int part,
                                                      bool issue, unsigned char* slot, uint64_t* bar) {
  const auto k = static_cast<DecodeTaskKind>(kind);
  if (k == DecodeTaskKind::kExpertGateUp) {
    SlotRuns l;
    GateUpRuns g;
    if (!gate_up_prefetchable(p, layer, part, l, g)) return false;
    if (issue) slot_issue(l, g.matrix_of(), g.first_of(), slot, bar);
    return true;
  }
  const DeviceQuant* w = nullptr;
  RowRange r;
  const SlotRuns l = projection_slot_runs(p, k, layer, part, w, r);
  if (!l.fits) return false;
  if (issue) slot_issue(l, [&](int) -> const DeviceQuant& { return *w; }, [&](int) { return r.first; }, slot, bar);
  return true;
}

/// Whether task (kind, part) routes its layer's token itself (a routed gate/up slot, or the down
/// rows), so that it can start the copy of a next expert task of the same layer (TaskSmem::copy_next).
__device__ __forceinline__ bool routes_in_task(const DecodeStepParams& p, int kind, int part) {
  const auto k = static_cast<DecodeTaskKind>(kind);
  return k == DecodeTaskKind::kExpertDown || (k == DecodeTaskKind::kExpertGateUp && gate_up_part(p, part).slot < p.top_k);
}

/// The block's shared memory, [slot 0 | work | slot 1] (kDecodeKernelSmemBytes): what task body
/// with slot s gets.
__device__ __forceinline__ TaskSmem task_smem(char* smem, int s, uint64_t* bars, uint32_t parity, bool prefetched) {
  TaskSmem m;
  m.work = smem + kTaskWeightSlotBytes;
  m.slot = reinterpret_cast<unsigned char*>(smem + (s == 0 ? 0 : kTaskWeightSlotBytes + kTaskWorkBytes));
  m.bar = bars + s;
  m.parity = parity;
  m.prefetched = prefetched;
  return m;
}
/// The wide work area of a task on slot s: the slot and the work part, contiguous.
__device__ __forceinline__ char* task_wide(char* smem, int s) { return smem + (s == 0 ? 0 : kTaskWeightSlotBytes); }

/// Initialises the two slots' mbarriers (one arrival a phase: the issuing thread's). All threads.
__device__ __forceinline__ void init_slot_bars(uint64_t* bars) {
  if (threadIdx.x == 0) {
    mbarrier_init(bars, 1);
    mbarrier_init(bars + 1, 1);
    mbarrier_init_fence();
  }
  __syncthreads();
}

/// run_task as a call from the resident loop: the bodies get registers of their own instead of
/// sharing them with the loop's state (inlined, they spilled 1.4 KB; as a call 0.5 KB. On an
/// H100, 98.7 against 96.6 tok/s at 4K: docs/performance/2026-12-05-persistent-slots-and-64-rows.md).
__device__ __noinline__ bool run_task_call(const DecodeStepParams& p, int kind, int layer, int part, int lm_parts,
                                           const TaskSmem& m, char* wide, bool early) {
  return run_task(p, kind, layer, part, lm_parts, m, wide, early);
}

/// The recurrent states of a GDN task's value heads into L2 (no task of this launch before it
/// writes them).
__device__ __forceinline__ void prefetch_gdn_state(const DecodeStepParams& p, int layer, int part) {
  const GdnDims& g = p.gdn_dims;
  const int per_key = g.n_value_heads / g.n_key_heads;
  const int64_t head = int64_t{g.key_head_dim} * g.value_head_dim;
  prefetch_l2(p.layers[layer].gdn_state + int64_t{part} * per_key * head, per_key * head * sizeof(float));
}

/// The K and V rows of an attention split's keys into L2, but the newest (its prepare task of
/// this launch writes it).
__device__ __forceinline__ void prefetch_split_keys(const DecodeStepParams& p, int layer, int part) {
  const AttnDims& a = p.attn_dims;
  const int S = p.grain.attn_splits, h = part / S, s = part % S;
  const int64_t n = int64_t{*p.position} + 1, k0 = n * s / S, k1 = std::min(n * (s + 1) / S, n - 1);
  if (k1 <= k0) return;
  const KvCacheView& kv = p.layers[layer].kv;
  const int64_t first = (int64_t{h} * kv.capacity + k0) * a.head_dim, bytes = (k1 - k0) * a.head_dim * 2;
  prefetch_l2(kv.k + first, bytes);
  prefetch_l2(kv.v + first, bytes);
}

/// Asks L2 for what a task reads that does not depend on the step's data (one thread, before
/// the task's waits): the weights of the projections, the router, the LM head and the shared
/// expert slot; a GDN task's recurrent states; an attention split's older keys and values.
__device__ __forceinline__ void prefetch_task(const DecodeStepParams& p, int kind, int layer, int part) {
  switch (static_cast<DecodeTaskKind>(kind)) {
    case DecodeTaskKind::kInProj: prefetch_in_proj(p, layer, part); break;
    case DecodeTaskKind::kOutProj: prefetch_out_proj(p, layer, part); break;
    case DecodeTaskKind::kRouter: prefetch_router(p, layer, part); break;
    case DecodeTaskKind::kExpertGateUp: prefetch_expert_gate_up(p, layer, part); break;
    case DecodeTaskKind::kExpertDown: prefetch_expert_down(p, layer, part); break;
    case DecodeTaskKind::kLmHead: prefetch_lm_head(p, part); break;
    case DecodeTaskKind::kGdnHeads: prefetch_gdn_state(p, layer, part); break;
    case DecodeTaskKind::kAttnSplit: prefetch_split_keys(p, layer, part); break;
    default: break;
  }
}

/// The resident kernel: block b runs tasks b, b + G, b + 2G, … of the list (task_sync.cuh's
/// static schedule). While it runs a task, the weight rows of its next task are copied into its
/// other slot (task_prefetch_weights; a routed expert task's rows once the current task, an
/// expert task of the same layer, has routed), and thread 0 asks L2 for what the current task
/// (unless its copy was started before it: `prefetched`) and the task after the next read from
/// fixed addresses (prefetch_task). Then the block waits for the task's input counters of this
/// launch, runs it and signals. Slots alternate task by task (the block's task j uses slot
/// j mod 2), and each slot's phases are counted in `parity`.
__global__ void __launch_bounds__(kDecodeTaskThreads, 1)
    decode_megakernel(DecodeStepParams p, const Task* __restrict__ tasks, int64_t n_tasks, uint32_t* counters,
                      uint32_t* epochs, int lm_parts) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ uint32_t launch_slot;
  __shared__ GemvRuns gemv;
  init_slot_bars(bars);
  const uint32_t launch = task_launch_begin(epochs, &launch_slot);
  const int64_t G = gridDim.x;
  int s = 0;             // this task's slot
  uint32_t parity = 0;   // bit b: the parity of slot b's next phase
  bool prefetched = false;  // the block's first task starts its own copy
  for (int64_t i = blockIdx.x; i < n_tasks; i += G) {
    __syncthreads();  // every thread is done with the last task's slot, the next task's target
    const Task t = tasks[i];
    const unsigned long long taken = p.trace && threadIdx.x == 0 ? global_ns() : 0;
    TaskSmem m = task_smem(smem, s, bars, (parity >> s) & 1u, prefetched);
    m.gemv = &gemv;
    bool next_prefetched = false;
    if (i + G < n_tasks) {  // the next task's weights into the other slot: now, or once this task has routed
      const Task a = tasks[i + G];
      m.next_slot = task_smem(smem, s ^ 1, bars, 0, false).slot;
      m.next_bar = bars + (s ^ 1);
      next_prefetched = task_prefetch_weights(p, a.kind, a.layer, a.part, threadIdx.x == 0, m.next_slot, m.next_bar);
      m.copy_next = !next_prefetched && a.layer == t.layer && routes_in_task(p, t.kind, t.part) &&
                    expert_copy_fits(p, a.layer, a.kind, a.part);
      m.next_kind = a.kind;
      m.next_part = a.part;
      next_prefetched = next_prefetched || m.copy_next;
    }
    if (threadIdx.x == 0) {
      // A task whose copy into its slot is under way (prefetched: a projection, router or expert
      // task) needs no L2 prefetch: all prefetch_task asks for of such a task is rows the copy reads.
      if (!prefetched) prefetch_task(p, t.kind, t.layer, t.part);
      if (i + 2 * G < n_tasks) {  // the next task's rows are already on their way into a slot
        const Task a = tasks[i + 2 * G];
        // Not the LM head's rows: a round of its tasks is several times L2, and would evict the
        // last layers' prefetched weights before their tasks read them.
        if (a.kind != static_cast<int32_t>(DecodeTaskKind::kLmHead)) prefetch_task(p, a.kind, a.layer, a.part);
      }
    }
    // A GDN task's states come into its work area while it waits (only its own task writes them).
    const bool early = t.kind == static_cast<int32_t>(DecodeTaskKind::kGdnHeads);
    if (early) gdn_task_issue_states(p, t.layer, t.part, task_wide(smem, s));
    for (int w = 0; w < DecodeProgramImage::kMaxWaits; ++w)
      if (t.wait_counter[w] >= 0)
        counter_wait(counters + t.wait_counter[w], (launch + 1) * static_cast<uint32_t>(t.wait_target[w]));
    const unsigned long long ready = p.trace && threadIdx.x == 0 ? global_ns() : 0;
    if (p.trace) {
      m.stamps = p.trace + kDecodeTraceFields * i + 3;
      if (threadIdx.x == 0) m.stamps[0] = m.stamps[1] = m.stamps[2] = 0;
    }
    const bool used = run_task_call(p, t.kind, t.layer, t.part, lm_parts, m, task_wide(smem, s), early);
    if (used) parity ^= 1u << s;
    if (t.signal >= 0) counter_signal(counters + t.signal);
    if (p.trace && threadIdx.x == 0) {
      unsigned long long* r = p.trace + kDecodeTraceFields * i;
      r[0] = blockIdx.x, r[1] = taken, r[2] = ready, r[6] = global_ns();
    }
    s ^= 1;
    prefetched = next_prefetched;
  }
  task_launch_end(epochs, launch);
}

/// The debug form: block b runs task first + b (one stage: no task of it waits on another),
/// with the resident kernel's bodies and slot 0.
__global__ void __launch_bounds__(kDecodeTaskThreads, 1)
    decode_stage_kernel(DecodeStepParams p, const Task* __restrict__ tasks, int64_t first, int lm_parts) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ GemvRuns gemv;
  init_slot_bars(bars);
  const Task t = tasks[first + blockIdx.x];
  TaskSmem m = task_smem(smem, 0, bars, 0, false);
  m.gemv = &gemv;
  run_task(p, t.kind, t.layer, t.part, lm_parts, m, task_wide(smem, 0), false);
}

/// The grain of a program for the device: the cut the task bodies use, and a KV capacity (and
/// position) at which every attention split holds keys, so the list has every split task.
DecodeGrain program_grain(const DecodeCut& cut) {
  DecodeGrain d;
  static_cast<DecodeCut&>(d) = cut;
  d.kv_capacity = std::max(cut.attn_splits, 1);
  d.position = d.kv_capacity - 1;
  return d;
}

}  // namespace

std::string decode_megakernel_unsupported(const ModelConfig& c) {
  const int dk = c.gdn_key_head_dim, d = c.head_dim, q_per_kv = c.n_kv_heads > 0 ? c.n_heads / c.n_kv_heads : 0;
  if (c.n_linear_attention_layers() > 0 && (dk != 64 && dk != 128))
    return "GDN key head dim " + std::to_string(dk) + " (the task bodies take 64 or 128)";
  if (c.n_linear_attention_layers() > 0 && c.gdn_n_key_heads > 0 &&
      (c.gdn_n_value_heads % c.gdn_n_key_heads != 0 || c.gdn_n_value_heads / c.gdn_n_key_heads > 4))
    return "GDN value heads per key head " + std::to_string(c.gdn_n_value_heads) + "/" +
           std::to_string(c.gdn_n_key_heads) + " (the task bodies take a whole number up to 4)";
  if (c.n_linear_attention_layers() > 0 && c.gdn_value_head_dim != dk)
    return "GDN value head dim " + std::to_string(c.gdn_value_head_dim) + " differs from the key head dim";
  if (c.n_full_attention_layers() > 0 && d != 64 && d != 128 && d != 256)
    return "attention head dim " + std::to_string(d) + " (the task bodies take 64, 128 or 256)";
  if (c.n_full_attention_layers() > 0 && q_per_kv != 1 && q_per_kv != 2 && q_per_kv != 4 && q_per_kv != 8)
    return "query heads per KV head " + std::to_string(q_per_kv) + " (the task bodies take 1, 2, 4 or 8)";
  if (c.n_experts > kMaxExperts || c.n_experts_per_tok < 1 || c.n_experts_per_tok > std::min(c.n_experts, kMaxTopK))
    return std::to_string(c.n_experts) + " experts, top-k " + std::to_string(c.n_experts_per_tok) +
           " (the task bodies take up to " + std::to_string(kMaxExperts) + " experts and a top-k of 1 … " +
           std::to_string(kMaxTopK) + ")";
  if (c.shared_ffn_dim != c.moe_ffn_dim) return "a shared expert of another width than the routed ones";
  return "";
}

DecodeMegakernel::DecodeMegakernel(const ModelConfig& c, const DecodeCut& grain) {
  if (const std::string why = decode_megakernel_unsupported(c); !why.empty())
    throw Error("persistent decode kernel: the model's " + why);
  if (expert_gate_up_smem_bytes(c.hidden, grain.expert_rows) > kTaskWorkBytes ||
      expert_down_smem_bytes(c.moe_ffn_dim, c.n_experts_per_tok, grain.down_rows) > kTaskWorkBytes ||
      (staged_row_floats_16(std::max({c.hidden, c.gdn_value_dim(), c.n_heads * c.head_dim})) +
       std::max({grain.proj_rows, grain.out_rows, grain.router_rows, grain.lm_rows})) * 4 > kTaskWorkBytes)
    throw Error("persistent decode kernel: the model's rows (staged inputs and a task's outputs) need more shared "
                "memory than a task has beside its weight slot (" + std::to_string(kTaskWorkBytes) + " bytes)");
  program_ = build_decode_program(c, program_grain(grain));
  if (const std::string why = check_decode_program(program_); !why.empty())
    throw InternalError("persistent decode kernel: the task list is not safe to run: " + why);
  const DecodeProgramImage img = flatten_decode_program(program_);
  n_tasks_ = static_cast<int64_t>(img.tasks.size());
  for (int64_t i = 0; i < n_tasks_; ++i) {
    const DecodeTask& t = program_.tasks[static_cast<size_t>(i)];
    if (t.kind == DecodeTaskKind::kLmHead) ++lm_parts_;
    if (stages_.empty() || program_.tasks[static_cast<size_t>(stages_.back().first)].signal != t.signal)
      stages_.push_back(Stage{i, 0, t.kind, t.layer});
    ++stages_.back().count;
  }
  const int64_t q_per_kv = c.n_kv_heads > 0 ? c.n_heads / c.n_kv_heads : 0;
  attn_part_floats_ = std::max<int64_t>(1, int64_t{c.n_kv_heads} * grain.attn_splits * q_per_kv * (c.head_dim + 2));
  tasks_ = DeviceBuffer(img.tasks.size() * sizeof(Task));
  CUDA_CHECK(cudaMemcpy(tasks_.data(), img.tasks.data(), img.tasks.size() * sizeof(Task), cudaMemcpyHostToDevice));
  counters_ = DeviceBuffer(std::max<size_t>(static_cast<size_t>(img.n_counters), 1) * sizeof(uint32_t));
  counters_.fill_bytes(0);
  blocks_ = sm_count();
  epochs_ = DeviceBuffer(static_cast<size_t>(blocks_) * sizeof(uint32_t));
  epochs_.fill_bytes(0);
  CUDA_CHECK(cudaFuncSetAttribute(decode_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDecodeKernelSmemBytes));
  CUDA_CHECK(cudaFuncSetAttribute(decode_stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDecodeKernelSmemBytes));
  // The static schedule needs every block resident at once (task_sync.cuh): one per SM.
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_megakernel, kDecodeTaskThreads,
                                                           kDecodeKernelSmemBytes));
  if (per_sm < 1) throw Error("persistent decode kernel: a block does not fit on an SM");
}

void DecodeMegakernel::launch(const DecodeStepParams& p, cudaStream_t stream) {
  decode_megakernel<<<blocks_, kDecodeTaskThreads, kDecodeKernelSmemBytes, stream>>>(
      p, tasks_.as<Task>(), n_tasks_, counters_.as<uint32_t>(), epochs_.as<uint32_t>(), lm_parts_);
  CUDA_CHECK(cudaGetLastError());
}

std::string DecodeMegakernel::summarize_trace(const std::vector<unsigned long long>& trace) const {
  constexpr int F = kDecodeTraceFields;
  if (trace.size() != static_cast<size_t>(F * n_tasks_)) throw InternalError("summarize_trace: wrong trace size");
  const auto at = [&](int64_t i, int f) { return trace[static_cast<size_t>(F * i + f)]; };
  unsigned long long t0 = ~0ull, t_end = 0;
  for (int64_t i = 0; i < n_tasks_; ++i) t0 = std::min(t0, at(i, 1)), t_end = std::max(t_end, at(i, 6));
  struct KindSum {
    int64_t tasks = 0, slot_tasks = 0;
    double body_us = 0, wait_us = 0, max_body_us = 0, chain_us = 0, stage_us = 0, slot_us = 0, gemv_us = 0, tail_us = 0;
    int stages = 0;
  };
  std::map<std::string, KindSum> kinds;
  int last_layer = 0;
  for (const Stage& st : stages_) last_layer = std::max(last_layer, st.layer);
  std::string timeline;
  double prev_end = 0;
  char line[256];
  for (size_t k = 0; k < stages_.size(); ++k) {
    const Stage& st = stages_[k];
    double start = 1e30, end = 0, body = 0;
    KindSum& ks = kinds[decode_task_kind_name(st.kind)];
    for (int64_t i = st.first; i < st.first + st.count; ++i) {
      const double ready = (at(i, 2) - t0) / 1e3, done = (at(i, 6) - t0) / 1e3, b = done - ready;
      start = std::min(start, ready), end = std::max(end, done), body = std::max(body, b);
      ks.body_us += b, ks.wait_us += (at(i, 2) - at(i, 1)) / 1e3, ks.max_body_us = std::max(ks.max_body_us, b);
      ++ks.tasks;
      if (at(i, 3) != 0 && at(i, 4) != 0 && at(i, 5) != 0) {  // a slot task: staging, slot, GEMV, the rest
        ks.stage_us += (at(i, 3) - at(i, 2)) / 1e3, ks.slot_us += (at(i, 4) - at(i, 3)) / 1e3;
        ks.gemv_us += (at(i, 5) - at(i, 4)) / 1e3, ks.tail_us += (at(i, 6) - at(i, 5)) / 1e3;
        ++ks.slot_tasks;
      }
    }
    ++ks.stages;
    ks.chain_us += end - prev_end;
    if (st.layer <= 3 || st.layer >= last_layer || st.layer < 0) {
      std::snprintf(line, sizeof line, "  %-16s layer %2d  %4d tasks  first ready %8.2f  last done %8.2f us  (+%6.2f, longest body %6.2f)\n",
                    decode_task_kind_name(st.kind), st.layer, st.count, start, end, end - prev_end, body);
      timeline += line;
    }
    prev_end = end;
  }
  std::string out;
  std::snprintf(line, sizeof line, "persistent decode trace: %lld tasks on %d blocks, %.1f us from the first take to the last signal\n",
                static_cast<long long>(n_tasks_), blocks_, (t_end - t0) / 1e3);
  out += line;
  out += "  kind             stages   tasks  us on the chain  mean body us  max body us  mean wait us"
         "  (GEMV tasks: staging us, slot wait us, GEMV us, stores + signal us)\n";
  for (const auto& [name, ks] : kinds) {
    std::snprintf(line, sizeof line, "  %-16s %6d %7lld %16.1f %13.2f %12.2f %13.2f", name.c_str(), ks.stages,
                  static_cast<long long>(ks.tasks), ks.chain_us, ks.body_us / ks.tasks, ks.max_body_us,
                  ks.wait_us / ks.tasks);
    out += line;
    if (ks.slot_tasks > 0) {
      std::snprintf(line, sizeof line, "  %17.2f %16.2f %8.2f %20.2f", ks.stage_us / ks.slot_tasks,
                    ks.slot_us / ks.slot_tasks, ks.gemv_us / ks.slot_tasks, ks.tail_us / ks.slot_tasks);
      out += line;
    }
    out += "\n";
  }
  return out + "  stages (first layers and the last; times from the first take):\n" + timeline;
}

void DecodeMegakernel::launch_stages(const DecodeStepParams& p, cudaStream_t stream,
                                     const std::function<void(DecodeTaskKind, int)>& after_stage) {
  for (const Stage& s : stages_) {
    decode_stage_kernel<<<s.count, kDecodeTaskThreads, kDecodeKernelSmemBytes, stream>>>(p, tasks_.as<Task>(), s.first,
                                                                                      lm_parts_);
    CUDA_CHECK(cudaGetLastError());
    if (after_stage) after_stage(s.kind, s.layer);
  }
}

}  // namespace lily::cuda
