// The one interface between the engine (generation loop, sessions, scheduler) and a compute
// backend (backends/cpu, backends/cuda). The engine only sees token ids, logits and opaque
// per-sequence states; backends know nothing of HTTP, JSON or text.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"
#include "engine/option_error.h"
#include "engine/sampler.h"
#include "model/weights.h"

namespace lily {

/// Per-sequence decode state: KV cache of the full-attention layers, conv windows and fp32
/// recurrent states of the GDN layers, and the next position. Owned by one sequence at a time;
/// memory grows with the sequence (never reserved for max_seq up front).
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  /// Tokens consumed so far (= the absolute position of the next token).
  virtual int64_t position() const = 0;
  /// Bytes held by this state (KV cache + GDN states), for cache accounting.
  virtual int64_t bytes() const = 0;
};

/// How a backend that samples on its own device (Backend::samples_on_device) picks a row's
/// next token: engine/sampler.h's pipeline with `params` for generated token number `step`,
/// with the step-1 edits of the row's history (penalty_edits). All pointers are the caller's and
/// stay valid for the step.
struct RowSampling {
  const SamplingParams* params = nullptr;  ///< nullptr: the greedy argmax (the default)
  uint64_t step = 0;                       ///< generated token number: the Philox counter
  const PenaltyEdits* edits = nullptr;     ///< penalty_edits(params, history, vocab); nullptr: none
};

/// One row of a batched step (Backend::step): a run of tokens of one sequence.
struct StepRow {
  SequenceState* state = nullptr;    ///< the sequence's slot; at most one row per state in a step
  std::span<const int32_t> tokens;   ///< ≥ 1 token ids, fed at positions position … position + size − 1
  int64_t position = 0;              ///< where the tokens go: must equal state->position()
  /// A generated token (decode) rather than prompt tokens (a prefill chunk). The CPU backend runs
  /// both alike; a backend may run them through different kernels (the CUDA backend does).
  bool decode = false;
  /// Run the LM head on the row's last token: its argmax comes back (false for a prefill chunk
  /// that does not end the prompt, whose logits nobody reads).
  bool want_logits = true;
  /// With want_logits: where the [vocab] fp32 logits of the last token go (nullptr: not copied).
  std::vector<float>* logits = nullptr;
  /// With want_logits, on a backend that samples_on_device(): when sampling.params is set, the
  /// step returns the sampled token instead of the argmax (the logits, when asked, are still the
  /// raw ones). Ignored by other backends.
  RowSampling sampling{};
};

/// Named intermediate tensor emitted by a forward pass, for layer-by-layer backend diffs.
/// `name` is one of: embed, attn_norm, mixer_out, ffn_norm, router_logits, ffn_out, layer_out,
/// final_norm, logits; `layer` is -1 outside layers; `token` is the absolute position.
/// `values` are fp32 (bf16 backends convert).
using ProbeSink = std::function<void(std::string_view name, int layer, int64_t token,
                                     std::span<const float> values)>;

/// A compute backend for one loaded model. Not thread-safe: one engine thread owns it.
class Backend {
 public:
  virtual ~Backend() = default;
  /// "cpu" or "cuda".
  virtual std::string name() const = 0;
  virtual const ModelConfig& config() const = 0;
  /// A fresh state (position 0) for sequences of at most max_seq tokens.
  /// Throws lily::Error if max_seq exceeds what the backend supports.
  virtual std::unique_ptr<SequenceState> new_state(int64_t max_seq) = 0;
  /// A deep copy of `state` (used by the prefix cache so that a hit never consumes an entry),
  /// holding only what `state` has consumed (no spare capacity). `state` may also be a host copy
  /// made by copy_to_host; the result is always a state prefill and decode accept. Throws
  /// lily::Error for a state of another backend, or when memory runs out.
  virtual std::unique_ptr<SequenceState> clone_state(const SequenceState& state) = 0;
  /// A runnable deep copy of `snapshot` (a state, or a copy made by copy_to_host) with room for
  /// at least min(capacity, its max_seq) positions, so that the steps that follow need not grow
  /// it: what the prefix cache hands to the request that resumes from a snapshot (clone_state
  /// keeps a snapshot exactly its size, and a copy of it would grow on its first step, copying
  /// its KV cache once more). The default is clone_state. Throws as clone_state.
  virtual std::unique_ptr<SequenceState> resume_state(const SequenceState& snapshot, int64_t capacity) {
    (void)capacity;
    return clone_state(snapshot);
  }
  /// A snapshot of `state` that shares the attention KV rows of `base` instead of copying them,
  /// for the prefix cache: `base` (a snapshot of this backend, not a host copy, position M) must
  /// hold a strict prefix of `state`'s tokens. When the first M KV rows of both are bit-identical,
  /// returns a state that keeps its own GDN states and KV rows [M, position) and refers to `base`
  /// for the rest (keeping it alive); its bytes() counts only what it holds itself. Such a state
  /// is not runnable: resume_state, clone_state and copy_to_host turn it into a whole copy. Returns
  /// nullptr when the rows differ or the backend does not share (the default).
  virtual std::unique_ptr<SequenceState> share_prefix(const SequenceState& state,
                                                      std::shared_ptr<const SequenceState> base) {
    (void)state;
    (void)base;
    return nullptr;
  }
  /// A copy of `state` in host memory, for the prefix cache's second tier: not runnable itself,
  /// but clone_state turns it back into a runnable state. The default is clone_state, for
  /// backends whose own memory is host memory (CPU). Throws as clone_state.
  virtual std::unique_ptr<SequenceState> copy_to_host(const SequenceState& state) { return clone_state(state); }
  /// True when copy_to_host of one of this backend's runnable states may run on one helper thread
  /// while the engine thread goes on making any other call, provided that nothing changes or
  /// frees that state meanwhile (a prefix-cache snapshot): the prefix cache then makes its host
  /// copies in the background, off the engine's path (SessionCache::start_background_host_copies).
  /// The copy must be finished when copy_to_host returns. False by default.
  virtual bool copies_to_host_concurrently() const { return false; }
  /// Told once, before the first request, that the prefix cache keeps up to `bytes` (> 0) of
  /// host copies (its host-tier budget), so that a backend whose copy_to_host writes memory of
  /// its own (CUDA: pinned host memory) can reserve some of it ahead and bound what it ever
  /// holds. Called on the thread that creates the engine. Never throws for want of memory: what
  /// cannot be reserved now is reserved when a copy needs it. The default does nothing.
  virtual void reserve_host_copies(int64_t bytes) { (void)bytes; }
  /// Bytes of the backend's own memory still free (CUDA: device memory after the weights and
  /// buffers), which bounds the prefix cache's default device budget; nullopt for a backend that
  /// uses host memory (CPU).
  virtual std::optional<int64_t> free_memory() const { return std::nullopt; }
  /// Bytes of the backend's own memory one sequence state of `capacity` positions holds (its
  /// recurrent states and KV cache at that length), so that the prefix cache's default device
  /// budget can leave room for a running batch of full-length sequences; 0 for a backend whose
  /// free_memory() is nullopt (its states live in host memory).
  virtual int64_t state_bytes(int64_t capacity) const {
    (void)capacity;
    return 0;
  }
  /// True when step() honours StepRow::sampling: the backend samples on its device and only the
  /// chosen id comes back (CUDA). False: the engine asks for the logits and runs the host
  /// Sampler (CPU, where the logits are host memory already).
  virtual bool samples_on_device() const { return false; }
  /// Most rows one step() may hold (sequences advanced together). 1 by default, for a backend
  /// that advances one sequence per step: the scheduler then runs one sequence at a time.
  virtual int max_batch() const { return 1; }
  /// Rows per step the engine runs by default (EngineOptions::max_batch 0), capped at
  /// max_batch() by the caller: 8 by default; the CUDA backend's batched decode runs up to
  /// CudaOptions::decode_rows decode rows as one forward (each weight read once per 32 of them),
  /// so it prefers that many.
  virtual int preferred_max_batch() const { return 8; }
  /// Prompt tokens per step that keep this backend's prefill efficient: the server's default
  /// token budget of a step (EngineOptions::step_tokens), where prompts are cut when requests
  /// are batched. 256 by default (CPU); the CUDA backend's prefill chunk (4,096), since its prefill runs
  /// several times faster in chunks of thousands of tokens than of 256 on an H200.
  virtual int64_t preferred_step_tokens() const { return 256; }
  /// One batched step: runs every row's tokens, rows of different sequences side by side (decode
  /// rows of many sequences and prefill chunks of others), and advances each row's state.
  /// Batch invariance: each row's outputs are bit-identical to running that row alone (the same
  /// arithmetic in the same order, whatever the other rows). Returns [rows.size()]: per row with
  /// want_logits, the greedy next token after its last token (argmax, ties to the lowest id; the
  /// sampled token for a row with sampling.params on a backend that samples_on_device()), and
  /// its logits in *row.logits when set; −1 for a row without want_logits. Throws lily::Error
  /// before any state changes for: no rows, more than max_batch() rows, a row without tokens, a
  /// token id outside [0, vocab), a state of another backend or twice in one step, a position
  /// other than state->position(), or a sequence that would exceed its max_seq.
  virtual std::vector<int32_t> step(std::span<const StepRow> rows) = 0;
  /// step() over one prefill row: runs `tokens` (non-empty) at positions state.position()… and
  /// returns the greedy next token after the last one; fills `logits` ([vocab] fp32) of the last
  /// token when non-null. Same errors as step().
  int32_t prefill(SequenceState& state, std::span<const int32_t> tokens, std::vector<float>* logits = nullptr) {
    const StepRow row{&state, tokens, state.position(), false, true, logits, {}};
    return step(std::span<const StepRow>(&row, 1)).front();
  }
  /// step() over one decode row: feeds `token` at state.position(), returns the greedy next token.
  int32_t decode(SequenceState& state, int32_t token, std::vector<float>* logits = nullptr) {
    const StepRow row{&state, std::span<const int32_t>(&token, 1), state.position(), true, true, logits, {}};
    return step(std::span<const StepRow>(&row, 1)).front();
  }
  /// For a backend that still reads the host weights (the CPU backend reads the memory-mapped
  /// checkpoint on every step): why they can no longer be trusted, e.g. "DIR/model.safetensors
  /// was truncated from A to B bytes" (reading them could kill the process with SIGBUS); nullopt
  /// when they are fine or the backend no longer reads them. Cheap (one stat(2) per weights
  /// file), never touches the weights; may be called from any thread.
  virtual std::optional<std::string> weights_changed() const { return std::nullopt; }
  /// Whether the backend still reads the host ModelWeights it was created from. The CPU backend
  /// does (it computes from the memory-mapped checkpoint); the CUDA backend copies every weight
  /// into device memory at creation and drops its reference, so once the caller drops its own
  /// the checkpoint's files are unmapped and a truncated or rewritten model.safetensors can no
  /// longer fault the process (SIGBUS).
  virtual bool reads_host_weights() const { return true; }
  /// Does one bounded piece of work that makes later requests faster, while the engine has
  /// nothing to run: the CPU and CUDA backends make spare state blocks of the sizes recent
  /// requests took (BlockPool::refill_one), so that the copies of a conversation's next turn find
  /// memory ready instead of faulting in new pages or pinning host memory (cudaMallocHost takes
  /// about 0.4 ms per MB). Returns true while more remains. Called on the engine thread only,
  /// between its checks for new jobs, so a job that arrives waits for one piece at most. The
  /// default does nothing.
  virtual bool prepare_while_idle() { return false; }
  /// Installs (or clears, with nullptr) a probe sink; costs nothing when unset.
  virtual void set_probe_sink(ProbeSink sink) { probe_sink_ = std::move(sink); }

 protected:
  ProbeSink probe_sink_;
};

/// How the CUDA backend runs (docs/cuda.md), one field per path choice; the defaults are the
/// paths verified on an H100/H200. The one place the LILY_CUDA_* variables are read (from_env):
/// the command line resolves one CudaOptions (resolve_cuda_options: the environment, then its
/// `--cuda` settings), validated before any backend is chosen, passes it to make_backend (lily
/// serve through ServerOptions), and the bench writes that same struct into its report. The CUDA
/// backend sets the kernel layer's process-wide switches (pdl … gemm_kernel) from its options
/// when it is created (backends/cuda/kernel_switches.h); no kernel reads the
/// environment itself.
struct CudaOptions {
  bool fuse_decode = true;       ///< LILY_CUDA_FUSE 1|0: add + RMSNorm and the GDN conv folded into GEMVs
  bool pdl = true;               ///< LILY_CUDA_PDL 1|0: programmatic dependent launch
  bool stream_gemv = true;       ///< LILY_CUDA_STREAM_GEMV 1|0: 4-bit GEMV weights by bulk copies, or register loads
  /// LILY_CUDA_GEMV_TILE_COUNTER 1|0: in the streaming GEMV's launches with the norm fused and at
  /// least four tiles a block (the decode step's LM head), the blocks take their tiles past the
  /// first stages from a counter in device memory as they finish, or (0) a fixed share each. The
  /// same bits either way (docs/cuda.md, "Decode GEMV on tensor cores").
  bool gemv_tile_counter = true;
  /// LILY_CUDA_GEMV_BLOCKS_PER_SM 1 … 4 and LILY_CUDA_GEMV_SMEM_KIB 16 … 227: the streaming GEMV's
  /// blocks per SM and the shared memory (KiB) those blocks share for their weight stages, in its
  /// one-row launches (speed settings: the same bits whatever they are; docs/cuda.md, "Decode GEMV
  /// on tensor cores").
  int gemv_blocks_per_sm = 4;
  int gemv_smem_kib = 112;
  /// LILY_CUDA_GEMV_LATE_REQUESTS none|staged|all: which streaming-GEMV launches request their
  /// first weight stages only after the PDL wait and their activations' staging, instead of before
  /// the wait: none, those that stage their activations (the add + RMSNorm or the GDN conv fused:
  /// the one-sequence decode's in-projections and LM head), or all. A speed setting: the same
  /// bits whatever it is (docs/cuda.md, "Decode GEMV on tensor cores").
  std::string gemv_late_requests = "none";
  bool flash_prefill = true;     ///< LILY_CUDA_FLASH_PREFILL 1|0: prefill attention on tensor cores, or the row kernel
  bool device_sampler = true;    ///< LILY_CUDA_DEVICE_SAMPLER 1|0: sampled rows sampled on the GPU, or on the host
  bool gemv_row_tiles = true;    ///< LILY_CUDA_GEMV_ROW_TILES 1|0: batched GEMV weights loaded once per 8 token rows
  bool gdn_chunk_parallel = true;   ///< LILY_CUDA_GDN_CHUNK_PARALLEL 1|0: GDN prefill's chunk solves all at once, then the walk
  /// LILY_CUDA_GDN_LOCAL_MMA 1|0: pass 1 of the two-pass GDN prefill (each chunk's U, W, P) on
  /// tensor cores (bf16 mma for KKᵀ/QKᵀ, split-tf32 mma for U and W), or the fp32 CUDA-core kernel.
  bool gdn_local_mma = true;
  /// LILY_CUDA_GDN_STATE_MMA 1|0: pass 2 of the two-pass GDN prefill (the walk over the chunks) on
  /// tensor cores (tf32 mma with split operands), or the fp32 CUDA-core walk.
  bool gdn_state_mma = true;
  bool batched_prefill = true;   ///< LILY_CUDA_PREFILL batched|per-token
  bool tensor_core_gemm = true;  ///< LILY_CUDA_GEMM tensor-core|gemv: the prefill projections, experts and 8-bit router
  /// LILY_CUDA_FUSED_MOE 1|0: the decode MoE block (router, experts, combine) as one launch with
  /// grid-wide barriers, or as three kernels. Needs fuse=1; shapes it does not support keep three.
  bool fused_moe = true;
  /// LILY_CUDA_MOE_OUT_PROJ 1|0: in the one-sequence decode, each mixer's out-projection runs as
  /// the fused MoE block's first phase (one launch fewer per layer, its weights on chip before the
  /// block's PDL wait), with the separate GEMV's bits; needs fused_moe and stream_gemv, and if the
  /// block refuses any layer's shape every layer keeps the GEMV. Off by default: bit-identical on
  /// an H100, but 5 % slower end to end, as the separate GEMV's early start under PDL is worth
  /// more than its launch (docs/cuda.md, "The out-projection inside the MoE block").
  bool moe_out_proj = false;
  /// LILY_CUDA_MOE_NEXT_NORM 1|0: in the one-sequence decode, the fused MoE block's last block
  /// forms the next layer's input norm (the final norm after the last layer) and leaves the row
  /// staged, so that the in-projection's (the LM head's) blocks copy it instead of each forming
  /// it; the same bits. Needs fused_moe and stream_gemv. Off by default: bit-identical on an
  /// H100, but 3 % slower, as the one block's norm at the MoE block's end is a serial tail
  /// (docs/cuda.md, "The next norm inside the MoE block").
  bool moe_next_norm = false;
  /// LILY_CUDA_MOE_TILE_BALANCE 0 … 1024: how the batched decode's MoE rows kernel splits its
  /// routed gate/up tiles over its blocks in launches of more than 32 rows that take no tile
  /// claims (moe_tile_claims_from; by default every launch of 17 rows or more does): w = 0, equal tile
  /// counts; w > 0, equal cost, a tile costing w + its live columns (the rows routed to its
  /// column block). A speed setting: which block computes a tile never changes a bit
  /// (docs/cuda.md, "Batched steps"). 8 by default: on an H100, 64 sequences decoding in one
  /// step reach 3,120 tok/s in total against 3,056 with 16 (48: 2,818 against 2,784), and 16
  /// had been 3.0 % faster than 0 at 64 rows, 2.7 % at 48.
  int moe_tile_balance = 8;
  /// LILY_CUDA_MOE_TILE_CLAIMS_FROM 1 … 65: the rows from which the batched decode's MoE rows
  /// kernel lets its quads claim the routed gate/up tiles two at a time as they go (so no block
  /// waits long at its grid barrier for one whose share took longer), after the fixed shares of
  /// moe_tile_claims_fixed; 65: never. 17 by default (with 75 % fixed, on an H100 +4.6 % at 32
  /// rows, +1.2 % at 48, +1.5 % at 64). A speed setting: which block computes a tile never
  /// changes a bit (docs/cuda.md, "Batched steps").
  int moe_tile_claims_from = 17;
  /// LILY_CUDA_MOE_TILE_CLAIMS_FIXED 0 … 100: with tile claims (moe_tile_claims_from), the per
  /// cent of the routed gate/up tiles split over the blocks in equal contiguous shares first
  /// (their activation columns shared in L1), only the rest claimed; 0: every routed tile
  /// claimed. 75 by default (the best of 0, 50, 60, 75, 80 and 90 on an H100). A speed setting
  /// (docs/cuda.md, "Batched steps").
  int moe_tile_claims_fixed = 75;
  /// LILY_CUDA_ROWS_GEMV_NORM 1|0: in the batched decode's steps of 2 … 8 rows each layer's
  /// input add + RMSNorm is formed by the in-projection's blocks while they stage the rows
  /// (launch_add_rmsnorm_gemv_rows: one launch fewer a layer, the same bits) instead of by a
  /// launch of its own. Off: on an H100 the same bits but 4–9 % slower at 2–8 rows (docs/cuda.md,
  /// "Batched steps").
  bool rows_gemv_norm = false;
  /// LILY_CUDA_GEMM_KERNEL wgmma-mixed|wgmma-narrow|wgmma|grouped|all|0:
  /// the 4-bit grouped and dense GEMMs of the tensor-core prefill run on Hopper warpgroup MMAs
  /// with 256 weight rows per work item for the dense and down GEMMs and 128 for gate/up
  /// ("wgmma-mixed", the default), 128 everywhere ("wgmma-narrow") or 256 everywhere
  /// ("wgmma"); or the grouped expert GEMMs dequantize in
  /// registers right before mma.sync ("grouped"), so do the dense GEMMs with at least one
  /// 64 × 256 tile per SM ("all"), or every GEMM keeps the shared-tile kernel ("0");
  /// docs/cuda.md.
  std::string gemm_kernel = "wgmma-mixed";
  /// LILY_CUDA_BATCHED_DECODE 1|0: the decode rows of a step run together, through one batched
  /// forward per group of ≤ decode_rows rows that reads each dense weight once per 32 rows (a lone row
  /// through the one-sequence decode graph, whose bits every batched row reproduces); or (0)
  /// each decode row through the one-sequence decode graph in turn (docs/cuda.md, "Batched
  /// steps").
  bool batched_decode = true;
  /// LILY_CUDA_PREFILL_CHUNK 1 … 8192: tokens per prefill chunk. 4,096: on an H200 an 8K prompt
  /// prefills at 37.8K tok/s against 33.8K with 2,048 (each routed expert gets ~128 rows, full
  /// GEMM items) and 40.0K with 8,192, which would hold decoding rows of a batch twice as long.
  int prefill_chunk = 4096;
  /// LILY_CUDA_MAX_BATCH 1 … 64: the most rows (sequences) one step() may hold (every row
  /// bit-identical to the sequence alone, verified on H100 and H200 up to 64). With
  /// batched_decode the decode rows run as forwards of up to decode_rows rows; 64 by
  /// measurement (docs/cuda.md, "Batched steps": 64 served streams on an H100 at 2,552 tok/s in
  /// total as one 64-row forward, 2,085 as two of 32).
  int max_batch = 64;
  /// LILY_CUDA_DECODE_ROWS 1 … 64: the most decode rows one batched forward takes; a step with
  /// more runs several forwards, one after another. The same bits for every row either way.
  /// Above 32 the row GEMVs take two launches and the MoE block routes in two passes, each
  /// distinct expert still read once for all its rows. 64 (the default) is verified on an H100
  /// (the row GEMV, MoE block and end-to-end bit tests at 64 rows) and measured there: 64 served
  /// streams 2,552 tok/s in total against 2,085 with 32-row forwards, 8 and 32 streams the same
  /// or better (docs/cuda.md, "Batched steps").
  int decode_rows = 64;
  /// LILY_CUDA_PREFILL_ROWS 1|0: the prefill rows of a step (one per sequence, each within a
  /// prefill chunk) run as one chunk of all their tokens, so each expert and projection weight is
  /// read once for all of them, the GDN and attention per sequence; or (0) one sequence after
  /// another. The same bits either way; it applies only on the tensor-core prefill with an 8-bit
  /// router and gemm_kernel other than "all", where no kernel choice depends on the chunk's
  /// token count. On by default: on an H200 (35B-A3B shape, 8 streams of 128 tokens) the 8th
  /// request's first text came 0.49 → 0.33 s after the 8 arrived (docs/cuda.md, "Batched steps").
  bool prefill_rows = true;
  /// One more than the rows of a batched decode forward: LILY_CUDA_ROWS_GEMV_FROM's "never".
  static constexpr int kRowsGemvNever = 65;
  /// LILY_CUDA_ROWS_GEMV_FROM 1 … 65: the batched decode's 4-bit GEMVs stage a step's rows once
  /// per block (the streaming GEMV's rows mode) from this many rows on, instead of reading them
  /// from L2 for every 16-row tile (its direct mode); 65: never. A launch takes at most 32 rows,
  /// so 33 … 65 all mean never. The same bits either way. 2 by
  /// measurement on an H200: from 2 rows on a layer's projections take less time in the rows
  /// mode, at 1 row more (docs/cuda.md, "Batched steps").
  int rows_gemv_from = 2;
  /// LILY_CUDA_ROWS_GEMV_SPLIT tiles|all|0: where the rows mode runs on two groups of eight warps
  /// per block: in launches of up to 8 rows, the groups taking turns on the weight tiles (tiles,
  /// the default: faster at 2–8 rows on an H100); besides in launches of 9–16 or 25–32 rows, each
  /// group computing half the column blocks of every tile (all: slower there); or nowhere (0).
  /// The same k-slices and the same bits in every form (docs/cuda.md, "Batched steps").
  std::string rows_gemv_split = "tiles";
  /// LILY_CUDA_ROWS_GEMV_KSPLIT_FROM 1 … 65: from this many rows on, the batched decode's 4-bit
  /// GEMVs of 2,048 or 4,096 columns run all of a step's rows in one launch with the k-slices of
  /// each tile on the CTAs of a cluster (each stages an eighth of the rows' columns), instead of
  /// the rows or direct mode (at most 32 rows a launch, each block staging whole rows); 65: never.
  /// The same bits either way by construction (docs/cuda.md, "Batched steps"); from 9 rows on
  /// by default (below that it gains nothing end to end).
  int rows_gemv_ksplit_from = 9;
  /// LILY_CUDA_PERSISTENT_DECODE 1|debug|trace|0: a one-sequence decode step as one resident
  /// kernel that takes the step's tasks from a list, synchronised by counters in device memory
  /// (1); the same tasks as one launch per stage (debug: what the probes see); the resident
  /// kernel with its timeline recorded and reported in the log now and then (trace: it waits for
  /// each step); or (0, the default) the step's separate kernels. Correct on H100 and H200
  /// (bit-identical to its stages, matching the CPU and the decode graph) but slower than the
  /// separate kernels so far (100 against 399 tok/s at 4K on an H100: docs/cuda.md, "A
  /// persistent decode kernel"), so off by default.
  std::string persistent_decode = "0";

  static constexpr int kMaxPrefillChunk = 8192;
  static constexpr int kMaxBatch = 64;
  /// gemv_blocks_per_sm's and gemv_smem_kib's limits (the streaming GEMV's register budget
  /// allows four blocks per SM; a block takes at most 227 KiB of shared memory).
  static constexpr int kMaxGemvBlocksPerSm = 4;
  static constexpr int kMaxGemvSmemKib = 227;
  /// The largest moe_tile_balance.
  static constexpr int kMaxMoeTileBalance = 1024;
  /// The most rows of one batched decode forward (the CUDA kernels' kMaxDecodeRows).
  static constexpr int kMaxDecodeRows = 64;

  /// Reads the LILY_CUDA_* variables (unset or empty: the default). Throws OptionError
  /// (engine/option_error.h) for anything else: its field() is the variable's name
  /// ("LILY_CUDA_FUSE"), its detail() the accepted values and the value given.
  static CudaOptions from_env();
  /// Sets one field from "NAME=VALUE", NAME as in describe() (e.g. "pdl=0", "max-batch=16"), as a
  /// front end's setting gives it (the command line's `--cuda NAME=VALUE`). Changes nothing when
  /// it throws. Its errors name the setting, never how a front end spells it: for a value the
  /// field does not take, OptionError with field() NAME ("pdl must be '1' or '0', got '2'"); for
  /// an unknown NAME or a missing '=', lily::Error beginning with the setting in quotes
  /// ("'foo=1': unknown option 'foo'; the options are fuse, pdl, …", listing names()).
  void set(std::string_view assignment);
  /// from_env(), then set() for each assignment in order (so a setting overrides its variable).
  /// Throws as both.
  static CudaOptions resolve(std::span<const std::string> assignments);
  /// The names set() takes, in describe()'s order, comma-separated ("fuse, pdl, …").
  static std::string names();
  /// "fuse=1 pdl=1 stream-gemv=1 flash-prefill=1 device-sampler=1 gemv-row-tiles=1
  /// gdn-chunk-parallel=1 gdn-local-mma=1 gdn-state-mma=1 prefill=batched gemm=tensor-core
  /// gemm-kernel=wgmma-mixed fused-moe=1 moe-out-proj=0 batched-decode=1 chunk=4096 max-batch=64
  /// decode-rows=64 rows-gemv-from=2 prefill-rows=1 persistent-decode=0", for logs and reports.
  std::string describe() const;
};

namespace cuda_options_detail {

/// The value of environment variable `name`, or "" when unset.
inline std::string env_value(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

/// A two-way switch: `on` → true, `off` → false; anything else throws OptionError with field
/// `label` (the variable's name, or the setting's NAME, that gave the value).
inline bool parse_choice(const std::string& label, const std::string& v, const char* on, const char* off) {
  if (v == on) return true;
  if (v == off) return false;
  throw OptionError(label, std::string("must be '") + on + "' or '" + off + "', got '" + v + "'");
}

/// An integer in [lo, hi]; anything else (not a whole number, out of range) throws OptionError
/// with field `label`.
inline int parse_int(const std::string& label, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || n < lo || n > hi)
    throw OptionError(label, "must be an integer in " + std::to_string(lo) + "…" + std::to_string(hi) + ", got '" + v +
                                 "'");
  return static_cast<int>(n);
}

/// One field of CudaOptions: its name (as in describe() and set()'s NAME=VALUE), its LILY_CUDA_*
/// variable, and how a value sets it (throwing OptionError with field `label`, the variable or
/// the NAME, for a value it does not take).
struct Field {
  const char* name;
  const char* env;
  void (*set)(CudaOptions& o, const std::string& label, const std::string& value);
};

/// Every field, in describe()'s order.
inline std::span<const Field> fields() {
  static const Field table[] = {
      {"fuse", "LILY_CUDA_FUSE", [](CudaOptions& o, const std::string& l, const std::string& v) { o.fuse_decode = parse_choice(l, v, "1", "0"); }},
      {"pdl", "LILY_CUDA_PDL", [](CudaOptions& o, const std::string& l, const std::string& v) { o.pdl = parse_choice(l, v, "1", "0"); }},
      {"stream-gemv", "LILY_CUDA_STREAM_GEMV", [](CudaOptions& o, const std::string& l, const std::string& v) { o.stream_gemv = parse_choice(l, v, "1", "0"); }},
      {"gemv-tile-counter", "LILY_CUDA_GEMV_TILE_COUNTER", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gemv_tile_counter = parse_choice(l, v, "1", "0"); }},
      {"gemv-blocks-per-sm", "LILY_CUDA_GEMV_BLOCKS_PER_SM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gemv_blocks_per_sm = parse_int(l, v, 1, CudaOptions::kMaxGemvBlocksPerSm); }},
      {"gemv-smem-kib", "LILY_CUDA_GEMV_SMEM_KIB", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gemv_smem_kib = parse_int(l, v, 16, CudaOptions::kMaxGemvSmemKib); }},
      {"gemv-late-requests", "LILY_CUDA_GEMV_LATE_REQUESTS", [](CudaOptions& o, const std::string& l, const std::string& v) {
         if (v != "none" && v != "staged" && v != "all")
           throw OptionError(l, "must be 'none', 'staged' or 'all', got '" + v + "'");
         o.gemv_late_requests = v;
       }},
      {"flash-prefill", "LILY_CUDA_FLASH_PREFILL", [](CudaOptions& o, const std::string& l, const std::string& v) { o.flash_prefill = parse_choice(l, v, "1", "0"); }},
      {"device-sampler", "LILY_CUDA_DEVICE_SAMPLER", [](CudaOptions& o, const std::string& l, const std::string& v) { o.device_sampler = parse_choice(l, v, "1", "0"); }},
      {"gemv-row-tiles", "LILY_CUDA_GEMV_ROW_TILES", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gemv_row_tiles = parse_choice(l, v, "1", "0"); }},
      {"gdn-chunk-parallel", "LILY_CUDA_GDN_CHUNK_PARALLEL", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gdn_chunk_parallel = parse_choice(l, v, "1", "0"); }},
      {"gdn-local-mma", "LILY_CUDA_GDN_LOCAL_MMA", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gdn_local_mma = parse_choice(l, v, "1", "0"); }},
      {"gdn-state-mma", "LILY_CUDA_GDN_STATE_MMA", [](CudaOptions& o, const std::string& l, const std::string& v) { o.gdn_state_mma = parse_choice(l, v, "1", "0"); }},
      {"prefill", "LILY_CUDA_PREFILL", [](CudaOptions& o, const std::string& l, const std::string& v) { o.batched_prefill = parse_choice(l, v, "batched", "per-token"); }},
      {"gemm", "LILY_CUDA_GEMM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.tensor_core_gemm = parse_choice(l, v, "tensor-core", "gemv"); }},
      {"gemm-kernel", "LILY_CUDA_GEMM_KERNEL", [](CudaOptions& o, const std::string& l, const std::string& v) {
         if (v != "grouped" && v != "all" && v != "0" && v != "wgmma" && v != "wgmma-narrow" && v != "wgmma-mixed")
           throw OptionError(l, "must be 'grouped', 'all', '0', 'wgmma', 'wgmma-narrow' or 'wgmma-mixed', got '" + v + "'");
         o.gemm_kernel = v;
       }},
      {"fused-moe", "LILY_CUDA_FUSED_MOE", [](CudaOptions& o, const std::string& l, const std::string& v) { o.fused_moe = parse_choice(l, v, "1", "0"); }},
      {"moe-out-proj", "LILY_CUDA_MOE_OUT_PROJ", [](CudaOptions& o, const std::string& l, const std::string& v) { o.moe_out_proj = parse_choice(l, v, "1", "0"); }},
      {"moe-next-norm", "LILY_CUDA_MOE_NEXT_NORM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.moe_next_norm = parse_choice(l, v, "1", "0"); }},
      {"batched-decode", "LILY_CUDA_BATCHED_DECODE", [](CudaOptions& o, const std::string& l, const std::string& v) { o.batched_decode = parse_choice(l, v, "1", "0"); }},
      {"chunk", "LILY_CUDA_PREFILL_CHUNK", [](CudaOptions& o, const std::string& l, const std::string& v) { o.prefill_chunk = parse_int(l, v, 1, CudaOptions::kMaxPrefillChunk); }},
      {"max-batch", "LILY_CUDA_MAX_BATCH", [](CudaOptions& o, const std::string& l, const std::string& v) { o.max_batch = parse_int(l, v, 1, CudaOptions::kMaxBatch); }},
      {"decode-rows", "LILY_CUDA_DECODE_ROWS", [](CudaOptions& o, const std::string& l, const std::string& v) { o.decode_rows = parse_int(l, v, 1, CudaOptions::kMaxDecodeRows); }},
      {"moe-tile-balance", "LILY_CUDA_MOE_TILE_BALANCE", [](CudaOptions& o, const std::string& l, const std::string& v) { o.moe_tile_balance = parse_int(l, v, 0, CudaOptions::kMaxMoeTileBalance); }},
      {"rows-gemv-norm", "LILY_CUDA_ROWS_GEMV_NORM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.rows_gemv_norm = parse_choice(l, v, "1", "0"); }},
      {"moe-tile-claims-from", "LILY_CUDA_MOE_TILE_CLAIMS_FROM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.moe_tile_claims_from = parse_int(l, v, 1, CudaOptions::kRowsGemvNever); }},
      {"moe-tile-claims-fixed", "LILY_CUDA_MOE_TILE_CLAIMS_FIXED", [](CudaOptions& o, const std::string& l, const std::string& v) { o.moe_tile_claims_fixed = parse_int(l, v, 0, 100); }},
      {"rows-gemv-from", "LILY_CUDA_ROWS_GEMV_FROM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.rows_gemv_from = parse_int(l, v, 1, CudaOptions::kRowsGemvNever); }},
      {"rows-gemv-ksplit-from", "LILY_CUDA_ROWS_GEMV_KSPLIT_FROM", [](CudaOptions& o, const std::string& l, const std::string& v) { o.rows_gemv_ksplit_from = parse_int(l, v, 1, CudaOptions::kRowsGemvNever); }},
      {"rows-gemv-split", "LILY_CUDA_ROWS_GEMV_SPLIT", [](CudaOptions& o, const std::string& l, const std::string& v) {
         if (v != "tiles" && v != "all" && v != "0") throw OptionError(l, "must be 'tiles', 'all' or '0', got '" + v + "'");
         o.rows_gemv_split = v;
       }},
      {"prefill-rows", "LILY_CUDA_PREFILL_ROWS", [](CudaOptions& o, const std::string& l, const std::string& v) { o.prefill_rows = parse_choice(l, v, "1", "0"); }},
      {"persistent-decode", "LILY_CUDA_PERSISTENT_DECODE", [](CudaOptions& o, const std::string& l, const std::string& v) {
         if (v != "1" && v != "debug" && v != "trace" && v != "0")
           throw OptionError(l, "must be '1', 'debug', 'trace' or '0', got '" + v + "'");
         o.persistent_decode = v;
       }},
  };
  return table;
}

}  // namespace cuda_options_detail

inline CudaOptions CudaOptions::from_env() {
  using namespace cuda_options_detail;
  CudaOptions o;
  for (const Field& f : fields())
    if (const std::string v = env_value(f.env); !v.empty()) f.set(o, f.env, v);
  return o;
}

inline void CudaOptions::set(std::string_view assignment) {
  using namespace cuda_options_detail;
  const size_t eq = assignment.find('=');
  const std::string name(assignment.substr(0, eq));
  for (const Field& f : fields()) {
    if (name == f.name) {
      if (eq == std::string_view::npos)
        throw Error("'" + name + "': expected NAME=VALUE, e.g. " + name + "=<value>");
      f.set(*this, name, std::string(assignment.substr(eq + 1)));
      return;
    }
  }
  throw Error("'" + std::string(assignment) + "': unknown option '" + name + "'; the options are " + names());
}

inline std::string CudaOptions::names() {
  std::string out;
  for (const cuda_options_detail::Field& f : cuda_options_detail::fields()) out += (out.empty() ? "" : ", ") + std::string(f.name);
  return out;
}

inline CudaOptions CudaOptions::resolve(std::span<const std::string> assignments) {
  CudaOptions o = from_env();
  for (const std::string& a : assignments) o.set(a);
  return o;
}

inline std::string CudaOptions::describe() const {
  return std::string("fuse=") + (fuse_decode ? "1" : "0") + " pdl=" + (pdl ? "1" : "0") +
         " stream-gemv=" + (stream_gemv ? "1" : "0") + " gemv-tile-counter=" + (gemv_tile_counter ? "1" : "0") +
         " gemv-blocks-per-sm=" + std::to_string(gemv_blocks_per_sm) + " gemv-smem-kib=" + std::to_string(gemv_smem_kib) +
         " gemv-late-requests=" + gemv_late_requests +
         " flash-prefill=" + (flash_prefill ? "1" : "0") +
         " device-sampler=" + (device_sampler ? "1" : "0") + " gemv-row-tiles=" + (gemv_row_tiles ? "1" : "0") +
         " gdn-chunk-parallel=" + (gdn_chunk_parallel ? "1" : "0") + " gdn-local-mma=" + (gdn_local_mma ? "1" : "0") +
         " gdn-state-mma=" + (gdn_state_mma ? "1" : "0") + " prefill=" + (batched_prefill ? "batched" : "per-token") +
         " gemm=" + (tensor_core_gemm ? "tensor-core" : "gemv") + " gemm-kernel=" + gemm_kernel +
         " fused-moe=" + (fused_moe ? "1" : "0") + " moe-out-proj=" + (moe_out_proj ? "1" : "0") +
         " moe-next-norm=" + (moe_next_norm ? "1" : "0") + " moe-tile-balance=" + std::to_string(moe_tile_balance) +
         " moe-tile-claims-from=" + std::to_string(moe_tile_claims_from) +
         " moe-tile-claims-fixed=" + std::to_string(moe_tile_claims_fixed) +
         " batched-decode=" + (batched_decode ? "1" : "0") + " chunk=" + std::to_string(prefill_chunk) +
         " max-batch=" + std::to_string(max_batch) + " decode-rows=" + std::to_string(decode_rows) +
         " rows-gemv-from=" + std::to_string(rows_gemv_from) + " rows-gemv-split=" + rows_gemv_split +
         " rows-gemv-ksplit-from=" + std::to_string(rows_gemv_ksplit_from) +
         " rows-gemv-norm=" + (rows_gemv_norm ? "1" : "0") +
         " prefill-rows=" + (prefill_rows ? "1" : "0") + " persistent-decode=" + persistent_decode;
}

/// Which backend to create. kAuto picks CUDA when built with it and a usable GPU is present.
enum class BackendKind { kCpu, kCuda, kAuto };

/// Parses "cpu" | "cuda" | "auto"; throws lily::Error otherwise.
BackendKind parse_backend_kind(std::string_view text);

/// The longest sequence (tokens) a backend of `kind` creates a state for: its kernels' limit,
/// known before any backend is made (the server resolves --max-seq against it while the model
/// loads). kAuto: the smaller of the limits of the backends this build may pick. A kind this
/// build lacks (cuda without CUDA support) reports the CPU backend's limit; make_backend
/// refuses it anyway.
int64_t backend_max_sequence(BackendKind kind);

/// The most sequences one step of a backend of `kind` holds (Backend::max_batch), known before
/// any backend is made, so that a front end refuses a batch size before it loads anything:
/// the CPU backend's fixed limit; for kCuda `cuda.max_batch` (LILY_CUDA_MAX_BATCH), also in a
/// build without CUDA (make_backend refuses that kind anyway); kAuto: the smaller of the limits
/// of the backends this build may pick.
int backend_max_batch(BackendKind kind, const CudaOptions& cuda);

/// The CUDA options a backend of `kind` is made with, from a front end's NAME=VALUE settings
/// (`settings`, CudaOptions::set; the command line's `--cuda`) applied over the LILY_CUDA_*
/// variables. For kCuda and kAuto the variables are read and everything is validated
/// (CudaOptions::resolve), so a bad value is an error even where auto would fall back to the
/// CPU; for kCpu only the settings are checked (a misspelt one is still an error), the variables
/// are not read, and the result is the defaults with the settings applied. Throws as
/// CudaOptions::from_env for a bad LILY_CUDA_* value and as CudaOptions::set for a bad setting.
inline CudaOptions resolve_cuda_options(BackendKind kind, std::span<const std::string> settings) {
  if (kind != BackendKind::kCpu) return CudaOptions::resolve(settings);
  CudaOptions o;
  for (const std::string& s : settings) o.set(s);  // checked; the CPU backend does not use them
  return o;
}

/// The most CPU backend threads a front end may ask for: more than any machine's cores, few
/// enough that the threads can always be created (a request for 100,000 once exhausted the
/// process limit and left the server loading forever).
inline constexpr int kMaxCpuThreads = 1024;

/// Creates a backend over loaded weights. `threads` <= 0 means all cores (CPU backend); more
/// than kMaxCpuThreads is an Error naming the limit. `cuda`:
/// the CUDA backend's options (kCuda, and kAuto when it picks CUDA), as the caller resolved them
/// (resolve_cuda_options; make_backend reads no environment); the CPU backend ignores them.
/// Throws lily::Error (e.g. "the CUDA backend was asked for, but this build has no CUDA
/// support …", no GPU, not enough device memory).
std::unique_ptr<Backend> make_backend(BackendKind kind, std::shared_ptr<const ModelWeights> weights, int threads,
                                      const CudaOptions& cuda);

}  // namespace lily
