// The task list of one batch-1 decode step, for a persistent decode kernel (docs/cuda.md, "A
// persistent decode kernel"), and the check that makes such a list safe to run.
//
// A decode program is the step cut into tasks that one block each can run: rows of a
// projection, the GDN heads of one key head, an attention split, the gate/up rows of one expert
// slot, and so on. Tasks synchronise through counters in global memory: a task waits until each
// of its counters has been signalled by every one of the counter's producers, and when it is done
// it signals its own counter once. The blocks of the persistent kernel take tasks in list order.
//
// check_decode_program proves two things about a list before any GPU runs it:
//  * it cannot deadlock: every producer of a counter stands before every task that waits on it,
//    so the task a block waits for has always been taken by a block that is running;
//  * it has no data race: of two tasks that touch overlapping elements of a buffer, one of them
//    writing, the later one in the list waits, through a chain of counters, for the earlier one.
// The program is plain data built on the host (no CUDA), so both run in the CPU tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace lily::cuda {

/// What a task computes (one block's share of one stage of the step).
enum class DecodeTaskKind : uint8_t {
  kEmbed,         ///< the token's embedding row into the residual
  kInProj,        ///< rows of a layer's in-projection, the input norm computed by the task itself
  kGdnHeads,      ///< the conv step, delta rule and gated norm of one GDN key head's value heads
  kAttnPrepare,   ///< q/k norm + RoPE of one KV head's query heads and key, its K/V appended
  kAttnSplit,     ///< one split of one KV head's keys: partial softmax and values
  kAttnCombine,   ///< one KV head's splits combined, the output gate applied
  kOutProj,       ///< rows of a layer's out-projection
  kRouter,        ///< the post-mixer add + RMSNorm (computed by each task) and rows of the router logits
  kExpertGateUp,  ///< the top-k (from the logits), rows of one slot's gate/up projections, SwiGLU
  kExpertDown,    ///< the top-k, rows of every slot's down projection and the weighted combine
  kLmHead,        ///< the final norm and rows of the LM head
  kArgmax,        ///< the next token from the logits
};

/// Name of a task kind ("in_proj", "gdn_heads", …), for messages.
const char* decode_task_kind_name(DecodeTaskKind kind);

/// The buffers tasks read and write. Per-layer state (the GDN conv window and recurrent state,
/// the KV cache) is told apart by DecodeAccess::instance (the layer); the activations are one
/// buffer each, reused by every layer.
enum class DecodeBuffer : uint8_t {
  kResidual,    ///< bf16 [hidden]: the layer's input residual
  kMid,         ///< bf16 [hidden]: the residual after the mixer (input to the MoE's add)
  kProj,        ///< bf16 [in-projection rows]
  kQuery,       ///< bf16 [query heads · head_dim]: normed, rotated queries
  kAttnPart,    ///< fp32 [KV heads][splits]: the splits' partial results
  kMix,         ///< bf16 [mixer width]: the mixer core's output
  kMixerOut,    ///< bf16 [hidden]: the out-projection
  kMoeNormed,   ///< bf16 [hidden]: the post-mixer norm
  kRouterLogits,  ///< fp32 [experts + 1]: the router's logits and the shared expert's gate
  kAct,         ///< bf16 [k + 1][ffn]: the slots' SwiGLU activations
  kMoeOut,      ///< bf16 [hidden]: the combined experts
  kConvWindow,  ///< a GDN layer's conv window, by channel
  kGdnState,    ///< a GDN layer's recurrent state, by value head
  kKvCache,     ///< an attention layer's K/V cache, by (KV head, position)
  kLogits,      ///< fp32 [vocab]
  kNextToken,   ///< int32: the step's result
};

/// Name of a buffer ("proj", "gdn_state", …), for messages.
const char* decode_buffer_name(DecodeBuffer buffer);

/// Elements [begin, end) of a buffer (instance: the layer for per-layer state, else 0), read or
/// written by a task.
struct DecodeAccess {
  DecodeBuffer buffer;
  int32_t instance = 0;
  int64_t begin = 0, end = 0;
  bool write = false;
};

/// Wait until counter `counter` has been signalled `target` times (by all its producers).
struct DecodeWait {
  int32_t counter = 0;
  int32_t target = 0;
};

/// One task: what it computes (kind, layer, part: its index among the layer's tasks of that
/// kind), the counters it waits on, the counter it signals once done (-1: none), the elements it
/// touches, the weight bytes it streams (4-bit codes with their bf16 scales and biases) and the
/// bytes of sequence state it reads and writes (GDN recurrent state and conv window, K/V cache).
struct DecodeTask {
  DecodeTaskKind kind = DecodeTaskKind::kEmbed;
  int32_t layer = -1;  ///< -1 for the embedding, the LM head and the argmax
  int32_t part = 0;
  std::vector<DecodeWait> waits;
  int32_t signal = -1;
  std::vector<DecodeAccess> accesses;
  int64_t weight_bytes = 0;
  int64_t state_bytes = 0;
};

/// A decode step as a task list, in the order the blocks take the tasks.
struct DecodeProgram {
  std::vector<DecodeTask> tasks;
  std::vector<std::string> counter_names;  ///< one per counter, e.g. "in_proj[3]"
};

/// How finely a decode step is cut into tasks: weight rows per task (multiples of 16, the MMA
/// tile's rows) and attention key splits per KV head. Part p of a stage covers rows
/// [p·rows, min((p + 1)·rows, total)). The persistent kernel's task bodies read the same numbers.
/// Two limits set the defaults. Every stage is on the step's critical path (the next one waits
/// for all of its tasks), so a stage's tasks should cover the SMs (measured on an H200: the 2,048
/// out-projection rows as 16 tasks of 128 rows took 32 µs, each task one SM's stream). And a
/// task's weights travel into one shared-memory slot of 72 KB: 64 rows of 2,048 4-bit columns,
/// 32 of 4,096, 32 gate and 32 up rows of an expert, and 16 down rows of nine slots of 512
/// columns each fill at most that.
struct DecodeCut {
  int proj_rows = 64;     ///< in-projection rows per task
  int out_rows = 32;      ///< out-projection rows per task
  int expert_rows = 32;   ///< gate/up rows (of ffn) per task and slot
  int down_rows = 16;     ///< down rows (of hidden) per task, all slots
  int lm_rows = 1024;     ///< LM head rows per task
  int router_rows = 16;   ///< router rows (of experts + 1) per task
  int attn_splits = 32;   ///< key splits per KV head; split s of a length-n cache: keys [n·s/S, n·(s+1)/S)
};

/// A cut plus what the task list's byte accounting needs: the router's weight bits, the KV cache
/// capacity and the token's position.
struct DecodeGrain : DecodeCut {
  int router_bits = 8;         ///< bits of the router's codes (weight bytes only)
  int64_t kv_capacity = 4096;  ///< KV cache positions per KV head
  int64_t position = 0;        ///< the token's position (< kv_capacity)
};

/// The task list of one batch-1 decode step of model `c` cut by `g`: the embedding; per layer the
/// in-projection rows (the first task also stores the layer's input residual), the GDN key heads
/// or the attention prepare / splits / combine, the out-projection rows, the router rows (the first
/// task also stores the post-mixer residual and norm), the gate/up rows of each of the top-k + 1
/// slots and the down rows (each task routes from the logits itself, as every block of the fused
/// MoE kernel does); then the LM head rows and the argmax. Each
/// stage waits on the counters of the stages whose outputs it reads (docs/cuda.md). Throws
/// lily::Error for a grain that is not positive, rows not a multiple of 16, or a position outside
/// the KV capacity.
DecodeProgram build_decode_program(const ModelConfig& c, const DecodeGrain& g = DecodeGrain{});

/// A program flattened for the device: fixed-size task records, one array of accesses, and every
/// (buffer, instance) given its own span of one element arena (a test's synthetic memory, or a
/// map from spans to real buffers). Counters keep their indices.
struct DecodeProgramImage {
  static constexpr int kMaxWaits = 2;  ///< waits per task on the device
  /// One task: up to kMaxWaits waits (counter −1: none), its signal (−1: none), its accesses
  /// accesses[first_access, first_access + n_accesses), and what it computes (kind, layer, part,
  /// as DecodeTask).
  struct Task {
    int32_t wait_counter[kMaxWaits];
    int32_t wait_target[kMaxWaits];
    int32_t signal;
    int32_t first_access, n_accesses;
    int32_t kind;  ///< DecodeTaskKind
    int32_t layer, part;
  };
  /// Elements [begin, end) of the arena; write: 1 when the task writes them.
  struct Access {
    int64_t begin, end;
    int32_t write;
    int32_t pad;
  };
  std::vector<Task> tasks;
  std::vector<Access> accesses;
  int32_t n_counters = 0;
  int64_t arena_elements = 0;  ///< one past the last span's end
};

// The device reads these records as the host lays them out.
static_assert(sizeof(DecodeProgramImage::Task) == 40 && sizeof(DecodeProgramImage::Access) == 24,
              "DecodeProgramImage records: no padding the device would not expect");

/// `p` flattened (DecodeProgramImage): each (buffer, instance) gets the span of arena elements
/// [base, base + its largest end), in order of first use. Throws lily::Error for a task with
/// more than kMaxWaits waits, an empty or negative range, or more accesses than an int32 counts.
DecodeProgramImage flatten_decode_program(const DecodeProgram& p);

/// The costs a step-time estimate of a program assumes (estimate_decode_program). Defaults: an
/// H200's 132 SMs sharing about 3.3 TB/s, a microsecond from a signal to a waiter seeing it.
struct DecodeCostModel {
  int blocks = 132;                  ///< resident blocks taking tasks (one per SM)
  double bytes_per_us = 25'000;      ///< one block's share of the memory bandwidth (bytes / µs)
  double task_overhead_us = 0.5;     ///< per task: fetch, barriers, epilogue
  double sync_latency_us = 1.0;      ///< from a producer's signal to a waiter seeing it
  bool prefetch_weights = true;      ///< weights stream from the moment a block takes the task
  /// With prefetch: tasks a block takes beyond the one it computes, whose weights stream (one
  /// task after another, at the block's bandwidth) while it waits or computes.
  int lookahead = 0;
};

/// What estimate_decode_program found: the step's length, the blocks' busy time (the sum of
/// the task durations, waiting excluded) and the step's time by task kind (busy time of that kind
/// over the blocks, µs).
struct DecodeEstimate {
  double step_us = 0;
  double busy_us = 0;
  std::vector<std::pair<DecodeTaskKind, double>> busy_by_kind;
};

/// The step time of `p` on the model `m`, by list scheduling as the blocks take tasks: each task
/// goes to the block that can take one first (in list order: a block takes a task once its last
/// task's weights have streamed and it holds fewer than 1 + lookahead unfinished tasks); it is
/// ready once every counter it waits on has had all its producers finish, plus the sync latency;
/// it streams its weight bytes at one block's bandwidth (from the moment it is taken with
/// prefetch, else once it is ready), then, in the block's task order and once ready, its state
/// bytes, plus the task overhead. Shared-memory capacity is not modelled: prefetched weights are
/// taken to wait where they arrive. An estimate from assumed costs, not a measurement: it says how
/// the cut and the synchronisation bound the step. Throws lily::Error for a non-positive block
/// count or bandwidth, a negative lookahead, or a program check_decode_program refuses.
DecodeEstimate estimate_decode_program(const DecodeProgram& p, const DecodeCostModel& m = DecodeCostModel{});

/// Why `p` is not safe to run on a persistent kernel that takes tasks in list order ("" when it
/// is): a counter waited on before all its producers, a target other than its producer count, a
/// counter out of range or never signalled, an empty access range, or two tasks that
/// touch overlapping elements (one writing) with no chain of waits from the earlier to the later.
/// The message names the tasks, the buffer and the elements.
std::string check_decode_program(const DecodeProgram& p);

}  // namespace lily::cuda
