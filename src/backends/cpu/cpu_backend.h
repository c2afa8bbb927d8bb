// The CPU reference backend: the forward pass of docs/model.md §3 in fp32 with exactly
// dequantized weights (the HF-float32 variants of docs/model.md §4.5), multi-threaded over matmul
// rows, experts, attention heads and GDN heads. It is the oracle the CUDA backend is diffed against
// through the probe points of engine/backend.h, and it runs the demo model end to end on any
// machine. A step of several sequences (continuous batching) shares each pass over the weights
// between them.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/cpu/thread_pool.h"
#include "base/host_memory.h"
#include "engine/backend.h"

namespace lily::cpu {

/// Per-sequence state of the CPU backend. All fp32. The GDN states are fixed-size; the KV caches
/// of all full-attention layers share one block with room for kv_capacity() positions, which
/// grows with the sequence (doubling, up to max_seq; never reserved for max_seq up front). Its
/// buffers come from the backend's state pool (host_memory.h): one large KV block per state is
/// backed by huge pages and reused whole by the next state of its size class, so copies for the
/// prefix cache fault few pages, or none.
class CpuSequenceState final : public SequenceState {
 public:
  /// fp32 storage whose large arrays come from a BlockPool.
  using Buffer = std::vector<float, PoolAllocator<float>>;
  /// The GDN state of one decoder layer (both empty for a full-attention layer).
  struct LayerState {
    Buffer conv_window;  ///< [conv_channels, conv_kernel−1] raw inputs, oldest first
    Buffer recurrent;    ///< [Hv, Dk, Dv] delta-rule state S[i][m]
  };

  /// Zero state at position 0 for `config`, for sequences of at most max_seq tokens, its large
  /// buffers (and those of its copies) taken from `pool` (nullptr: operator new).
  CpuSequenceState(const ModelConfig& config, int64_t max_seq, std::shared_ptr<BlockPool> pool = nullptr);
  /// A deep copy of `other` whose KV block has room for `capacity` positions (clamped to
  /// [other.position(), other.max_seq()]), from the same pool. A copy of a state that shares its
  /// first KV rows with a base (shares_kv) holds them all itself.
  CpuSequenceState(const CpuSequenceState& other, int64_t capacity);
  /// A copy of `other` that refers to `base` (position M < other's, whose first M KV rows equal
  /// other's) for its first M KV rows and holds only the rows after them (CpuBackend::share_prefix).
  CpuSequenceState(const CpuSequenceState& other, std::shared_ptr<const CpuSequenceState> base);

  int64_t position() const override { return position_; }
  /// Bytes of fp32 storage held: the GDN states and the whole KV block (kv_capacity() positions).
  int64_t bytes() const override;
  int64_t max_seq() const { return max_seq_; }
  /// Positions the KV block has room for (beyond kv_base_rows()).
  int64_t kv_capacity() const { return kv_capacity_; }
  /// True when the first kv_base_rows() KV rows live in a base state (a prefix-cache snapshot
  /// made by share_prefix): keys() and values() then start at that row, and steps refuse it.
  bool shares_kv() const { return kv_base_ != nullptr; }
  /// KV rows read from the base state (0 when shares_kv() is false).
  int64_t kv_base_rows() const { return kv_base_rows_; }
  /// Row `t` (< position()) of KV slot `slot` (2·attention layer index + 0 for K, 1 for V),
  /// wherever it lives: in this state or in its base.
  const float* kv_row(int slot, int64_t t) const;
  /// Full-attention layer `layer`'s keys [kv_capacity, n_kv_heads, head_dim] (post norm + RoPE);
  /// the first position() rows are written.
  float* keys(int layer) { return kv_.data() + kv_offset(layer, 0); }
  const float* keys(int layer) const { return kv_.data() + kv_offset(layer, 0); }
  /// Its values, laid out as keys().
  float* values(int layer) { return kv_.data() + kv_offset(layer, 1); }
  const float* values(int layer) const { return kv_.data() + kv_offset(layer, 1); }
  /// The block every attention layer's K and V live in (its allocator names the pool).
  const Buffer& kv_block() const { return kv_; }

  std::vector<LayerState> layers;  ///< [n_layers]

 private:
  friend class CpuBackend;
  /// Offset of attention layer `layer`'s K (`which` 0) or V (1) in the KV block.
  int64_t kv_offset(int layer, int which) const {
    return (2 * int64_t{attn_slot_[static_cast<size_t>(layer)]} + which) * kv_capacity_ * kv_width_;
  }
  /// Makes room for `rows` positions (at least doubling the capacity, at most max_seq), keeping
  /// the first position() rows of every cache.
  void reserve_kv(int64_t rows);
  /// Moves the KV caches into a block of `capacity` positions (≥ position()).
  void reallocate_kv(int64_t capacity);
  /// Writes KV rows [0, rows) of every slot into `dst` laid out as a block of `dst_capacity`
  /// positions (reading the base's rows from the base).
  void copy_kv_rows(float* dst, int64_t dst_capacity, int64_t rows) const;

  std::vector<int> attn_slot_;  ///< per layer: its index among the full-attention layers, −1 for GDN
  int n_attn_ = 0;
  int64_t kv_width_ = 0;        ///< n_kv_heads · head_dim
  int64_t kv_capacity_ = 0;
  Buffer kv_;                   ///< [n_attn][K, V][kv_capacity][kv_width], from row kv_base_rows_
  std::shared_ptr<const CpuSequenceState> kv_base_;  ///< holds KV rows [0, kv_base_rows_) (share_prefix)
  int64_t kv_base_rows_ = 0;
  int64_t position_ = 0;
  int64_t max_seq_ = 0;
};

/// Where the CPU backend rounds activations.
///  - kFp32: none; activations, KV cache and states stay fp32 (the HF-float32 forward, docs/model.md
///    §3 and §4.5; what the transformers goldens check).
///  - kBf16Activations: every value the CUDA backend stores as bf16 is rounded to bf16 at the
///    same point (embedding row, norm outputs, residual adds, GEMV outputs other than router /
///    shared gate / LM head, conv output, delta-rule output, gated norm, RoPE'd q/k = KV cache,
///    gated attention output, expert g/u/act/down, the MoE sum; docs/model.md §4.1 and §4.3 decode
///    numerics). Accumulations, GDN states, router and shared-gate logits and the LM head stay
///    fp32. This is the oracle the CUDA kernels are held to: it separates kernel errors from
///    the precision policy, whose own effect is measured against kFp32.
enum class Numerics { kFp32, kBf16Activations };

/// Test hook: may replace the router's top-k choice of one token at one layer. Called with the
/// layer, the token's position, the router logits [n_experts] (fp32) and the k ids the backend
/// chose (descending weight); returns true after writing other ids into `ids` (the weights are
/// then recomputed from these logits, ops.h route_weights). Used to hold two backends to the
/// same routing where a near-tie lets rounding noise pick either expert (tests/gpu).
using RouteOverride =
    std::function<bool(int layer, int64_t position, std::span<const float> logits, std::span<int> ids)>;

/// fp32 reference backend over loaded weights (see file comment). Not thread-safe: one engine
/// thread owns it (it reuses activation buffers between calls).
/// Probes (engine/backend.h): embed, then per layer attn_norm, mixer_out, ffn_norm,
/// router_logits, ffn_out, layer_out for every token fed; final_norm and logits only for the
/// last token of each step row with want_logits (the only one whose logits are computed).
class CpuBackend final : public Backend {
 public:
  /// Longest sequence a state may be created for (the model's context, model/config.h).
  static constexpr int64_t kMaxSeq = kMaxContext;
  /// Default number of prompt tokens per prefill chunk (weights are read once per chunk).
  static constexpr int64_t kDefaultPrefillChunk = 128;
  /// Most rows one step may hold.
  static constexpr int kMaxBatch = 64;
  /// Bytes of state memory the backend keeps idle for reuse (its state pool).
  static constexpr size_t kStatePoolIdleBytes = size_t{512} << 20;

  /// `threads` <= 0 means all hardware threads. Throws lily::Error if `weights` is null.
  explicit CpuBackend(std::shared_ptr<const ModelWeights> weights, int threads = 0);
  ~CpuBackend() override;

  std::string name() const override { return "cpu"; }
  const ModelConfig& config() const override { return weights_->config; }
  /// weights_changed_on_disk() of the weights this backend reads on every step.
  std::optional<std::string> weights_changed() const override { return weights_changed_on_disk(*weights_); }
  /// Throws lily::Error unless 1 <= max_seq <= kMaxSeq.
  std::unique_ptr<SequenceState> new_state(int64_t max_seq) override;
  /// Deep copy. Throws lily::Error if `state` is not a CpuSequenceState of this model.
  std::unique_ptr<SequenceState> clone_state(const SequenceState& state) override;
  /// Deep copy whose KV caches have room for min(capacity, max_seq) positions (reserved, so the
  /// steps up to there append without reallocating). Throws as clone_state.
  std::unique_ptr<SequenceState> resume_state(const SequenceState& snapshot, int64_t capacity) override;
  /// Backend::share_prefix: compares the first base.position() KV rows bit for bit (a prefill
  /// equals token-by-token decode here, so equal tokens give equal rows whatever the cuts).
  /// Throws as clone_state.
  std::unique_ptr<SequenceState> share_prefix(const SequenceState& state,
                                              std::shared_ptr<const SequenceState> base) override;
  /// True: a host copy is clone_state, which only reads the state and takes memory from the
  /// state pool (thread-safe), so it may run beside the engine thread's calls.
  bool copies_to_host_concurrently() const override { return true; }
  /// Most rows per step.
  int max_batch() const override { return kMaxBatch; }
  /// One spare state block for the sizes recent states took (touched, from the state pool).
  bool prepare_while_idle() override { return state_pool_->refill_one(); }
  /// Backend::step. The rows' tokens go through in passes of at most prefill_chunk() tokens in
  /// all (a longer row spans several passes): every projection, the router, the experts (grouped
  /// by expert across the rows) and the LM head read each weight row once per pass for all its
  /// rows, while the conv windows, delta-rule states and KV caches advance per row, token by token.
  /// Every value is computed by the same fp32 operations whatever the other rows, so each row
  /// equals that row alone, and a prefill equals token-by-token decode, bit for bit.
  std::vector<int32_t> step(std::span<const StepRow> rows) override;
  /// Threads used by parallel ops.
  int threads() const { return pool_.size(); }
  int64_t prefill_chunk() const { return prefill_chunk_; }
  /// Sets the prefill chunk length (>= 1; throws lily::Error otherwise).
  void set_prefill_chunk(int64_t tokens);
  Numerics numerics() const { return numerics_; }
  /// Selects where activations are rounded (see Numerics); applies to the next forward call.
  void set_numerics(Numerics numerics) { numerics_ = numerics; }
  /// Installs (or with nullptr removes) the routing test hook.
  void set_route_override(RouteOverride hook) { route_override_ = std::move(hook); }

 private:
  struct Scratch;  // activation buffers, defined in cpu_backend.cpp

  /// A work item of expert_ffns: `n` rows from `first` of expert `expert` (−1: the shared expert,
  /// whose rows are tokens; a routed expert's are rows of the pairs sorted by expert).
  struct ExpertItem {
    int expert = -1;
    int64_t first = 0;
    int64_t n = 0;
  };

  /// The tokens of one row that go through one forward pass: activation rows
  /// [offset, offset + m) of the pass, at positions first_pos … first_pos + m − 1 of `state`.
  struct Segment {
    CpuSequenceState* state = nullptr;
    int64_t first_pos = 0;
    int64_t offset = 0;
    int64_t m = 0;
  };

  CpuSequenceState& checked_state(SequenceState& state) const;
  /// Runs `tokens` ([total m] ids, segment after segment) through the decoder layers; leaves the
  /// last layer's output in scratch x [m, hidden] and advances every segment's state.
  void forward_pass(std::span<const Segment> segments, std::span<const int32_t> tokens);
  void decoder_layer(int layer, std::span<const Segment> segments, int64_t m);
  void gdn_mixer(const GdnWeights& w, int layer, std::span<const Segment> segments, int64_t m, float* out);
  void attention_mixer(const AttentionWeights& w, int layer, std::span<const Segment> segments, int64_t m,
                       float* out);
  void moe_block(const MoeWeights& w, int layer, std::span<const Segment> segments, int64_t m, float* out);
  void expert_ffns(const MoeWeights& w, int64_t m, float* out);
  /// gate[i] ← silu(gate[i])·up[i] for i < n, with the activation roundings of the experts
  /// (gate and up before, the product after).
  void swiglu(float* gate, float* up, int64_t n) const;
  /// Final norm, LM head and argmax of the activation rows `rows` of scratch x (one per row that
  /// wants logits; positions for the probes): next[i] = argmax of rows[i]; logits_out[i], when
  /// non-null, gets that row's [vocab] logits.
  void lm_head(std::span<const int64_t> rows, std::span<const int64_t> positions, std::span<int32_t> next,
               std::span<std::vector<float>* const> logits_out);
  /// Under Numerics::kBf16Activations rounds data[0, n) to bf16 in place; otherwise nothing.
  void round_activations(float* data, int64_t n) const;
  /// Emits every segment's rows of a [m, width] activation to the probe sink (token = position).
  void probe(const char* name, int layer, std::span<const Segment> segments, const float* data,
             int64_t width) const;

  std::shared_ptr<const ModelWeights> weights_;
  /// Where states take their large buffers (huge-page mappings, reused by size class).
  std::shared_ptr<BlockPool> state_pool_ = make_host_block_pool(kStatePoolIdleBytes);
  mutable ThreadPool pool_;
  std::unique_ptr<Scratch> scratch_;
  int64_t prefill_chunk_ = kDefaultPrefillChunk;
  Numerics numerics_ = Numerics::kFp32;
  RouteOverride route_override_;
};

}  // namespace lily::cpu
