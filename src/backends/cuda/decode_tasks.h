// What the persistent decode kernel's task bodies read and write (host and device): the step's
// buffers, the sequence state and the weights of every layer, and how finely the step is cut.
// The host fills one DecodeStepParams per (sequence state, capacity) and the task list of
// decode_program.h says which body runs on which part (docs/cuda.md, "A persistent decode
// kernel").
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/decode_program.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/layer_weights.h"
#include "backends/cuda/mixer_kernels.h"

namespace lily::cuda {

/// One decoder layer as the task bodies see it: its weights (DeviceLayerWeights, the device
/// model's layer taken whole) and this sequence's state of the layer. Trivially copyable: the
/// host fills an array of them and copies it to device memory (DecodeStepParams::layers).
struct DecodeTaskLayer : DeviceLayerWeights {
  __nv_bfloat16* conv_window = nullptr;  ///< GDN state: bf16 [C, K − 1], oldest first
  float* gdn_state = nullptr;            ///< GDN state: fp32 [Hv, Dk, Dv]
  KvCacheView kv;                        ///< attention state: K and V [nkv, capacity, D]
};
static_assert(std::is_trivially_copyable_v<DecodeTaskLayer>);

/// Everything the task bodies of one decode step use. Device pointers; POD, passed by value to
/// the kernel (`layers` points to device memory).
///
/// Activations (one token; every layer reuses them):
///   residual    bf16 [hidden]            the layer input h (in-projection part 0 stores it)
///   mid         bf16 [hidden]            h + mixer out (router part 0 stores it)
///   proj        bf16 [in-projection rows] the raw in-projection of the current layer
///   query       bf16 [nq, D]             normed, rotated queries (attention prepare)
///   attn_part   fp32 [nkv · splits, nq/nkv, D + 2]  per split and query head: (max, sum, Σ p·v)
///   mix         bf16 [mixer width]       the mixer core's output (GDN Hv·Dv, attention nq·D)
///   mixer_out   bf16 [hidden]            the out-projection
///   moe_normed  bf16 [hidden]            RMSNorm(mid)·post_norm (router part 0 stores it)
///   router_logits fp32 [E + 1]           the router's logits, then the shared expert's gate logit
///   act         bf16 [k · I + I_shared]  the slots' SwiGLU activations, slot after slot
///   moe_out     bf16 [hidden]            the experts combined
///   logits      fp32 [vocab]
///   head_best_value fp32, head_best_id int32 [LM head parts]  each LM head part's best logit and id
///   next_token  int32 [1]                the argmax (ties to the lowest id)
/// `position` (device int32) is the token's position; the sequence length is position + 1.
struct DecodeStepParams {
  int32_t hidden = 0, vocab = 0, n_layers = 0;
  int32_t n_experts = 0, top_k = 0, moe_ffn = 0, shared_ffn = 0;
  float eps = 1e-6f;  ///< the RMSNorms' epsilon
  GdnDims gdn_dims;
  AttnDims attn_dims;
  DecodeCut grain;  ///< the cut of the task list the kernel runs

  DeviceQuant embed;
  DeviceQuant lm_head;
  const float* final_norm = nullptr;
  const DecodeTaskLayer* layers = nullptr;  ///< device [n_layers]

  const int32_t* token = nullptr;     ///< device int32: this step's input token
  const int32_t* position = nullptr;  ///< device int32: its position

  __nv_bfloat16 *residual = nullptr, *mid = nullptr, *proj = nullptr, *query = nullptr, *mix = nullptr,
                *mixer_out = nullptr, *moe_normed = nullptr, *act = nullptr, *moe_out = nullptr;
  float *attn_part = nullptr, *router_logits = nullptr, *logits = nullptr, *head_best_value = nullptr;
  int32_t *head_best_id = nullptr, *next_token = nullptr;
  /// Optional (null: off): the resident kernel's timeline, uint64 [tasks][kDecodeTraceFields] by
  /// list position: the block that ran the task, then %globaltimer (ns) when it took it up, when
  /// its waits were over, when its input was staged, when its weight slot had landed and when
  /// its GEMV's results were in shared memory (0: the body has no such step), and when it had
  /// signalled (DecodeMegakernel::summarize_trace).
  unsigned long long* trace = nullptr;
};

/// Values per task of DecodeStepParams::trace.
constexpr int kDecodeTraceFields = 7;

/// Threads of a task body's block (the persistent kernel runs one such block per SM).
constexpr int kDecodeTaskThreads = 512;
/// Shared memory of one task's weights (bytes): its rows' codes, scales and biases, copied in
/// by the bulk-copy engine (decode_tasks_common.cuh, "weight slots"); DecodeCut's defaults fit it.
constexpr int kTaskWeightSlotBytes = 72 * 1024;
/// Shared memory a task body may use for its own arrays (bytes), on top of its small static
/// ones. A body that reads its weights from a slot has kTaskWorkBytes of it, beside the slot.
constexpr int kDecodeTaskSmemBytes = 150 * 1024;
/// The part of a task's work area that does not overlap a weight slot.
constexpr int kTaskWorkBytes = kDecodeTaskSmemBytes - kTaskWeightSlotBytes;
/// Dynamic shared memory of a block of the persistent kernel: [slot 0 | work | slot 1]. A task
/// whose weights sit in slot s computes with the work part; a task without weights uses its slot
/// and the work part as one area of kDecodeTaskSmemBytes; the other slot meanwhile receives the
/// next task's weights.
constexpr int kDecodeKernelSmemBytes = 2 * kTaskWeightSlotBytes + kTaskWorkBytes;

}  // namespace lily::cuda
