// The persistent decode kernel and its debug form (decode_megakernel.h).
#include "backends/cuda/decode_megakernel.h"

#include <algorithm>
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
__device__ __forceinline__ void run_task(const DecodeStepParams& p, int kind, int layer, int part, int lm_parts,
                                         char* smem) {
  switch (static_cast<DecodeTaskKind>(kind)) {
    case DecodeTaskKind::kEmbed: task_embed(p); break;
    case DecodeTaskKind::kInProj: task_in_proj(p, layer, part, smem); break;
    case DecodeTaskKind::kGdnHeads: task_gdn_heads(p, layer, part, smem); break;
    case DecodeTaskKind::kAttnPrepare: task_attn_prepare(p, layer, part, smem); break;
    case DecodeTaskKind::kAttnSplit: task_attn_split(p, layer, part, smem); break;
    case DecodeTaskKind::kAttnCombine: task_attn_combine(p, layer, part, smem); break;
    case DecodeTaskKind::kOutProj: task_out_proj(p, layer, part, smem); break;
    case DecodeTaskKind::kRouter: task_router(p, layer, part, smem); break;
    case DecodeTaskKind::kExpertGateUp: task_expert_gate_up(p, layer, part, smem); break;
    case DecodeTaskKind::kExpertDown: task_expert_down(p, layer, part, smem); break;
    case DecodeTaskKind::kLmHead: task_lm_head(p, part, smem); break;
    case DecodeTaskKind::kArgmax: task_argmax(p, lm_parts); break;
  }
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

/// The resident kernel: each block takes tasks in list order, one ticket ahead (task_take_next:
/// the next ticket's atomic round trip overlaps the current task), asks L2 for what the
/// task and the task one round of blocks further down the list read from fixed addresses
/// (prefetch_task: so the weight stream runs a round of tasks ahead of the computation, the
/// blocks' next tasks' bytes arriving while they wait or compute), waits for its input counters
/// of this launch, runs it and signals. A launch ends when every block has fetched past the end.
__global__ void __launch_bounds__(kDecodeTaskThreads, 1)
    decode_megakernel(DecodeStepParams p, const Task* __restrict__ tasks, int64_t n_tasks, uint32_t* counters,
                      unsigned long long* next, int lm_parts) {
  extern __shared__ __align__(16) char smem[];
  __shared__ unsigned long long slot;
  unsigned long long ahead_ticket = 0;  // thread 0: the ticket after the current one (task_take_next)
  if (threadIdx.x == 0) ahead_ticket = task_take_next(next);
  for (;;) {
    __syncthreads();  // every thread has read the last ticket
    if (threadIdx.x == 0) slot = ahead_ticket;
    __syncthreads();
    const TaskTicket ticket = task_ticket(slot, n_tasks);
    if (ticket.task >= n_tasks) return;
    if (threadIdx.x == 0) ahead_ticket = task_take_next(next);  // in flight while this task runs
    const Task t = tasks[ticket.task];
    if (threadIdx.x == 0) {
      prefetch_task(p, t.kind, t.layer, t.part);
      if (const int64_t ahead = ticket.task + gridDim.x; ahead < n_tasks) {
        const Task a = tasks[ahead];
        // Not the LM head's rows: a round of its tasks is several times L2, and would evict the
        // last layers' prefetched weights before their tasks read them.
        if (a.kind != static_cast<int32_t>(DecodeTaskKind::kLmHead)) prefetch_task(p, a.kind, a.layer, a.part);
      }
    }
    for (int w = 0; w < DecodeProgramImage::kMaxWaits; ++w)
      if (t.wait_counter[w] >= 0)
        counter_wait(counters + t.wait_counter[w], (ticket.launch + 1) * static_cast<uint32_t>(t.wait_target[w]));
    run_task(p, t.kind, t.layer, t.part, lm_parts, smem);
    if (t.signal >= 0) counter_signal(counters + t.signal);
  }
}

/// The debug form: block b runs task first + b (one stage: no task of it waits on another).
__global__ void __launch_bounds__(kDecodeTaskThreads, 1)
    decode_stage_kernel(DecodeStepParams p, const Task* __restrict__ tasks, int64_t first, int lm_parts) {
  extern __shared__ __align__(16) char smem[];
  const Task t = tasks[first + blockIdx.x];
  run_task(p, t.kind, t.layer, t.part, lm_parts, smem);
}

/// The grain of a program for the device: rows as the task bodies cut them, and a KV capacity
/// (and position) at which every attention split holds keys, so the list has every split task.
DecodeGrain program_grain(const ModelConfig& c, const DecodeTaskGrain& g) {
  DecodeGrain d;
  d.proj_rows = g.proj_rows;
  d.out_rows = g.out_rows;
  d.expert_rows = g.expert_rows;
  d.down_rows = g.down_rows;
  d.lm_rows = g.lm_rows;
  d.router_rows = g.router_rows;
  d.attn_splits = g.attn_splits;
  d.kv_capacity = std::max(g.attn_splits, 1);
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

DecodeMegakernel::DecodeMegakernel(const ModelConfig& c, const DecodeTaskGrain& grain) {
  if (const std::string why = decode_megakernel_unsupported(c); !why.empty())
    throw Error("persistent decode kernel: the model's " + why);
  if (expert_gate_up_smem_bytes(c.hidden, grain.expert_rows) > kDecodeTaskSmemBytes ||
      expert_down_smem_bytes(c.moe_ffn_dim, c.n_experts_per_tok, grain.down_rows) > kDecodeTaskSmemBytes ||
      staged_row_floats(std::max({c.hidden, c.gdn_value_dim(), c.n_heads * c.head_dim})) * 4 > kDecodeTaskSmemBytes)
    throw Error("persistent decode kernel: the model's rows need more shared memory than a task has (" +
                std::to_string(kDecodeTaskSmemBytes) + " bytes)");
  program_ = build_decode_program(c, program_grain(c, grain));
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
  next_ = DeviceBuffer(sizeof(unsigned long long));
  next_.fill_bytes(0);
  blocks_ = sm_count();
  CUDA_CHECK(cudaFuncSetAttribute(decode_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDecodeTaskSmemBytes));
  CUDA_CHECK(cudaFuncSetAttribute(decode_stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDecodeTaskSmemBytes));
}

void DecodeMegakernel::launch(const DecodeStepParams& p, cudaStream_t stream) {
  decode_megakernel<<<blocks_, kDecodeTaskThreads, kDecodeTaskSmemBytes, stream>>>(
      p, tasks_.as<Task>(), n_tasks_, counters_.as<uint32_t>(), next_.as<unsigned long long>(), lm_parts_);
  CUDA_CHECK(cudaGetLastError());
}

void DecodeMegakernel::launch_stages(const DecodeStepParams& p, cudaStream_t stream,
                                     const std::function<void(DecodeTaskKind, int)>& after_stage) {
  for (const Stage& s : stages_) {
    decode_stage_kernel<<<s.count, kDecodeTaskThreads, kDecodeTaskSmemBytes, stream>>>(p, tasks_.as<Task>(), s.first,
                                                                                      lm_parts_);
    CUDA_CHECK(cudaGetLastError());
    if (after_stage) after_stage(s.kind, s.layer);
  }
}

}  // namespace lily::cuda
