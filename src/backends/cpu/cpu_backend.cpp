// CpuBackend: the forward pass of docs/model.md §3, one op per line (ops.h), fp32.
// A step's tokens go through in passes of m tokens, which may belong to several sequences (one
// segment of consecutive tokens per sequence): every projection is one batched matmul per pass
// (each weight row dequantized once for all m tokens; the projections of one input share a
// hand-out to the thread pool), the experts are grouped by expert across the pass, while the
// recurrent parts (causal conv, delta rule, KV-cache appends, attention over the cache) run per
// segment on its own state, token by token. Every value is computed by the same fp32 operations
// whatever m is and whatever the other segments are, so a row of a batched step equals that row
// alone, and prefill equals token-by-token decode, bit for bit.
#include "backends/cpu/cpu_backend.h"

#include "base/bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backends/cpu/ops.h"
#include "base/error.h"

namespace lily::cpu {

namespace {
constexpr float kL2NormEps = 1e-6f;  // HF's l2norm inside the GDN kernel (docs/model.md §4.5)

float* row(std::vector<float>& v, int64_t t, int64_t width) { return v.data() + t * width; }
}  // namespace

// ---- state -------------------------------------------------------------------------------------

CpuSequenceState::CpuSequenceState(const ModelConfig& c, int64_t max_seq, std::shared_ptr<BlockPool> pool)
    : kv_width_(int64_t{c.n_kv_heads} * c.head_dim), kv_(PoolAllocator<float>(pool)), max_seq_(max_seq) {
  const PoolAllocator<float> alloc(std::move(pool));
  layers.reserve(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    layers.push_back(LayerState{Buffer(alloc), Buffer(alloc)});
    if (c.is_full_attention(i)) {  // its KV cache starts empty and grows
      attn_slot_.push_back(n_attn_++);
      continue;
    }
    attn_slot_.push_back(-1);
    layers[i].conv_window.assign(int64_t{c.gdn_conv_channels()} * (c.gdn_conv_kernel - 1), 0.0f);
    layers[i].recurrent.assign(
        int64_t{c.gdn_n_value_heads} * c.gdn_key_head_dim * c.gdn_value_head_dim, 0.0f);
  }
}

CpuSequenceState::CpuSequenceState(const CpuSequenceState& other, int64_t capacity)
    : layers(other.layers),
      attn_slot_(other.attn_slot_),
      n_attn_(other.n_attn_),
      kv_width_(other.kv_width_),
      kv_(other.kv_.get_allocator()),
      position_(other.position_),
      max_seq_(other.max_seq_) {
  const int64_t cap = std::clamp(capacity, position_, max_seq_);
  if (cap == 0) return;
  kv_.resize(static_cast<size_t>(2 * n_attn_ * cap * kv_width_));
  kv_capacity_ = cap;
  other.copy_kv_rows(kv_.data(), cap, position_);
}

CpuSequenceState::CpuSequenceState(const CpuSequenceState& other, std::shared_ptr<const CpuSequenceState> base)
    : layers(other.layers),
      attn_slot_(other.attn_slot_),
      n_attn_(other.n_attn_),
      kv_width_(other.kv_width_),
      kv_(other.kv_.get_allocator()),
      kv_base_(std::move(base)),
      position_(other.position_),
      max_seq_(other.max_seq_) {
  kv_base_rows_ = kv_base_->position();
  LILY_CHECK(kv_base_rows_ < position_);
  kv_capacity_ = position_ - kv_base_rows_;
  kv_.resize(static_cast<size_t>(2 * n_attn_ * kv_capacity_ * kv_width_));
  for (int slot = 0; slot < 2 * n_attn_; ++slot)
    for (int64_t t = kv_base_rows_; t < position_; ++t)
      std::copy_n(other.kv_row(slot, t), kv_width_, kv_.data() + (slot * kv_capacity_ + t - kv_base_rows_) * kv_width_);
}

const float* CpuSequenceState::kv_row(int slot, int64_t t) const {
  if (t < kv_base_rows_) return kv_base_->kv_row(slot, t);
  return kv_.data() + (slot * kv_capacity_ + t - kv_base_rows_) * kv_width_;
}

void CpuSequenceState::copy_kv_rows(float* dst, int64_t dst_capacity, int64_t rows) const {
  const int64_t from_base = std::min(rows, kv_base_rows_);
  if (from_base > 0) kv_base_->copy_kv_rows(dst, dst_capacity, from_base);
  if (rows <= from_base) return;
  const size_t n = static_cast<size_t>((rows - from_base) * kv_width_);
  for (int slot = 0; slot < 2 * n_attn_; ++slot)
    std::copy_n(kv_.data() + slot * kv_capacity_ * kv_width_, n, dst + (slot * dst_capacity + from_base) * kv_width_);
}

int64_t CpuSequenceState::bytes() const {
  int64_t floats = static_cast<int64_t>(kv_.capacity());
  for (const auto& l : layers) floats += l.conv_window.capacity() + l.recurrent.capacity();
  return floats * static_cast<int64_t>(sizeof(float));
}

void CpuSequenceState::reserve_kv(int64_t rows) {
  if (rows <= kv_capacity_) return;
  reallocate_kv(std::min(max_seq_, std::max(rows, 2 * kv_capacity_)));
}

void CpuSequenceState::reallocate_kv(int64_t capacity) {
  LILY_CHECK(capacity >= position_ && !shares_kv());
  Buffer fresh(kv_.get_allocator());
  fresh.resize(static_cast<size_t>(2 * n_attn_ * capacity * kv_width_));
  const size_t rows = static_cast<size_t>(position_ * kv_width_);
  for (int slot = 0; slot < 2 * n_attn_; ++slot)
    std::copy_n(kv_.data() + slot * kv_capacity_ * kv_width_, rows, fresh.data() + slot * capacity * kv_width_);
  kv_.swap(fresh);
  kv_capacity_ = capacity;
}

// ---- activation buffers ------------------------------------------------------------------------

/// Activations of one chunk of m tokens, row-major [m, width]; reused across calls so that the
/// hot loop allocates nothing once the buffers have reached the chunk size.
struct CpuBackend::Scratch {
  std::vector<float> x, normed, branch;               // [m, hidden]: residual, norm output, mixer/MoE output
  std::vector<float> qkv, conv, z, a, b, core;        // GDN: [m, C], [m, C], [m, Vd], [m, Hv]×2, [m, Vd]
  std::vector<float> qg, k, v, attn;                  // attention: [m, nq·2D], [m, nkv·D]×2, [m, nq·D]
  std::vector<float> router_logits, route_weights;    // [m, E], [m, top-k]
  std::vector<int> route_ids;                         // [m, top-k]
  std::vector<int> slot_order, expert_begin, expert_next;  // pairs sorted by expert; [E+1]; [E]
  std::vector<ExpertItem> expert_items;               // work items of expert_ffns
  std::vector<float> rope_cos, rope_sin;              // [rotary_dim/2]
  std::vector<float> expert_in, expert_gate, expert_up, expert_down;  // [n, H], [n, I]×2, [n, H]
  std::vector<float> slot_out;                        // [m·top-k, hidden] expert outputs per slot
  std::vector<float> shared_gate, shared_up, shared_down, shared_gate_logit;  // [m, Is]×2, [m, H], [m]
  std::vector<float> final_normed, logits;            // [r, hidden], [r, vocab] (r rows want logits)
  std::vector<int64_t> row_pos;                       // [m] absolute position of each activation row
  std::vector<int> row_segment;                       // [m] segment of each activation row

  void ensure(const ModelConfig& c, int64_t m) {
    const int64_t H = c.hidden, E = c.n_experts, pairs = m * c.n_experts_per_tok;
    grow(x, m * H), grow(normed, m * H), grow(branch, m * H);
    grow(qkv, m * c.gdn_conv_channels()), grow(conv, m * c.gdn_conv_channels());
    grow(z, m * c.gdn_value_dim()), grow(core, m * c.gdn_value_dim());
    grow(a, m * c.gdn_n_value_heads), grow(b, m * c.gdn_n_value_heads);
    grow(qg, m * c.n_heads * 2 * c.head_dim), grow(attn, m * c.n_heads * c.head_dim);
    grow(k, m * c.n_kv_heads * c.head_dim), grow(v, m * c.n_kv_heads * c.head_dim);
    grow(router_logits, m * E), grow(route_weights, pairs);
    grow(route_ids, pairs), grow(slot_order, pairs);
    grow(expert_begin, E + 1), grow(expert_next, E);
    // Items of expert_ffns: at most one more than the row chunks (of ≥ 8) per expert.
    expert_items.reserve((m + pairs) / 8 + E + 1);
    grow(rope_cos, c.rotary_dim / 2), grow(rope_sin, c.rotary_dim / 2);
    grow(expert_in, pairs * H), grow(expert_down, pairs * H), grow(slot_out, pairs * H);
    grow(expert_gate, pairs * c.moe_ffn_dim), grow(expert_up, pairs * c.moe_ffn_dim);
    grow(shared_gate, m * c.shared_ffn_dim), grow(shared_up, m * c.shared_ffn_dim);
    grow(shared_down, m * H), grow(shared_gate_logit, m);
    grow(row_pos, m), grow(row_segment, m);
  }
  template <typename T>
  static void grow(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

// ---- construction and states ---------------------------------------------------------------------

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights, int threads)
    : weights_(std::move(weights)), pool_(threads), scratch_(std::make_unique<Scratch>()) {
  if (!weights_) throw Error("cpu backend: no model weights");
  const ModelConfig& c = weights_->config;
  LILY_CHECK(static_cast<int>(weights_->layers.size()) == c.n_layers);
  LILY_CHECK(c.gdn_n_key_heads > 0 && c.gdn_n_value_heads % c.gdn_n_key_heads == 0);
  LILY_CHECK(c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0);
  LILY_CHECK(c.rotary_dim % 2 == 0 && c.rotary_dim <= c.head_dim);
  LILY_CHECK(c.n_experts_per_tok >= 1 && c.n_experts_per_tok <= c.n_experts);
}

CpuBackend::~CpuBackend() = default;

void CpuBackend::set_prefill_chunk(int64_t tokens) {
  if (tokens < 1) throw Error("cpu backend: prefill chunk must be at least 1 token");
  prefill_chunk_ = tokens;
}

std::unique_ptr<SequenceState> CpuBackend::new_state(int64_t max_seq) {
  if (max_seq < 1 || max_seq > kMaxSeq)
    throw Error("max_seq " + std::to_string(max_seq) + " is outside [1, " +
                std::to_string(kMaxSeq) + "]");
  return std::make_unique<CpuSequenceState>(config(), max_seq, state_pool_);
}

std::unique_ptr<SequenceState> CpuBackend::clone_state(const SequenceState& state) {
  const CpuSequenceState& src = checked_state(const_cast<SequenceState&>(state));
  return std::make_unique<CpuSequenceState>(src, src.position());
}

std::unique_ptr<SequenceState> CpuBackend::resume_state(const SequenceState& snapshot, int64_t capacity) {
  return std::make_unique<CpuSequenceState>(checked_state(const_cast<SequenceState&>(snapshot)), capacity);
}

std::unique_ptr<SequenceState> CpuBackend::share_prefix(const SequenceState& state,
                                                        std::shared_ptr<const SequenceState> base) {
  const CpuSequenceState& src = checked_state(const_cast<SequenceState&>(state));
  auto cpu_base = std::dynamic_pointer_cast<const CpuSequenceState>(base);
  if (cpu_base == nullptr) throw Error("cpu backend: the base state was not created by this backend");
  checked_state(const_cast<CpuSequenceState&>(*cpu_base));
  const int64_t rows = cpu_base->position();
  if (rows < 1 || rows >= src.position()) return nullptr;
  const size_t row_bytes = static_cast<size_t>(src.kv_width_) * sizeof(float);
  for (int slot = 0; slot < 2 * src.n_attn_; ++slot)
    for (int64_t t = 0; t < rows; ++t)
      if (std::memcmp(src.kv_row(slot, t), cpu_base->kv_row(slot, t), row_bytes) != 0) return nullptr;
  return std::make_unique<CpuSequenceState>(src, std::move(cpu_base));
}

CpuSequenceState& CpuBackend::checked_state(SequenceState& state) const {
  auto* cpu_state = dynamic_cast<CpuSequenceState*>(&state);
  if (!cpu_state || static_cast<int>(cpu_state->layers.size()) != config().n_layers)
    throw Error("cpu backend: the state was not created by this backend");
  return *cpu_state;
}

// ---- entry points --------------------------------------------------------------------------------

std::vector<int32_t> CpuBackend::step(std::span<const StepRow> rows) {
  if (rows.empty()) throw Error("step: no rows");
  if (static_cast<int64_t>(rows.size()) > kMaxBatch)
    throw Error("step: " + std::to_string(rows.size()) + " rows, more than the cpu backend's " +
                std::to_string(kMaxBatch));
  std::vector<CpuSequenceState*> states;
  for (const StepRow& r : rows) {
    if (r.state == nullptr) throw Error("step: a row without a sequence state");
    CpuSequenceState& state = checked_state(*r.state);
    if (state.shares_kv()) throw Error("step: a prefix-cache snapshot that shares its KV rows is not runnable");
    if (std::find(states.begin(), states.end(), &state) != states.end())
      throw Error("step: one sequence state in two rows");
    states.push_back(&state);
    if (r.tokens.empty()) throw Error("prefill: no tokens");
    if (r.position != state.position_)
      throw Error("step: a row at position " + std::to_string(r.position) + " for a sequence at position " +
                  std::to_string(state.position_));
    for (int32_t token : r.tokens)
      if (token < 0 || token >= config().vocab)
        throw Error("token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                    std::to_string(config().vocab) + ")");
    const int64_t end = state.position_ + static_cast<int64_t>(r.tokens.size());
    if (end > state.max_seq_)
      throw Error("sequence of " + std::to_string(end) + " tokens exceeds max_seq " + std::to_string(state.max_seq_));
  }
  // Passes of at most prefill_chunk_ tokens: each takes the rows' tokens in order, so a row
  // longer than the room left continues in the next pass.
  std::vector<int32_t> next(rows.size(), -1);
  std::vector<Segment> segments;
  std::vector<int32_t> pass_tokens;
  std::vector<int64_t> head_rows, head_positions;
  std::vector<size_t> head_of;  // the step row of each LM-head row
  size_t r = 0;
  int64_t done = 0;  // tokens of rows[r] already run
  while (r < rows.size()) {
    segments.clear(), pass_tokens.clear(), head_rows.clear(), head_positions.clear(), head_of.clear();
    int64_t m = 0;
    while (r < rows.size() && m < prefill_chunk_) {
      const StepRow& row = rows[r];
      const int64_t take = std::min<int64_t>(prefill_chunk_ - m, static_cast<int64_t>(row.tokens.size()) - done);
      segments.push_back({states[r], states[r]->position_, m, take});
      pass_tokens.insert(pass_tokens.end(), row.tokens.begin() + done, row.tokens.begin() + done + take);
      m += take;
      done += take;
      if (done == static_cast<int64_t>(row.tokens.size())) {
        if (row.want_logits) {
          head_rows.push_back(m - 1);
          head_positions.push_back(states[r]->position_ + take - 1);
          head_of.push_back(r);
        }
        ++r, done = 0;
      }
    }
    forward_pass(segments, pass_tokens);
    if (head_rows.empty()) continue;
    std::vector<int32_t> ids(head_rows.size());
    std::vector<std::vector<float>*> outs(head_rows.size());
    for (size_t i = 0; i < head_of.size(); ++i) outs[i] = rows[head_of[i]].logits;
    lm_head(head_rows, head_positions, ids, outs);
    for (size_t i = 0; i < head_of.size(); ++i) next[head_of[i]] = ids[i];
  }
  return next;
}

// ---- forward (docs/model.md §3) -----------------------------------------------------------------------

void CpuBackend::forward_pass(std::span<const Segment> segments, std::span<const int32_t> tokens) {
  const ModelConfig& c = config();
  const int64_t m = static_cast<int64_t>(tokens.size());
  Scratch& s = *scratch_;
  s.ensure(c, m);
  for (size_t g = 0; g < segments.size(); ++g)
    for (int64_t t = 0; t < segments[g].m; ++t) {
      s.row_pos[segments[g].offset + t] = segments[g].first_pos + t;
      s.row_segment[segments[g].offset + t] = static_cast<int>(g);
    }
  for (const Segment& g : segments) g.state->reserve_kv(g.first_pos + g.m);  // the KV rows written below
  for (int64_t t = 0; t < m; ++t) dequantize_row(weights_->embed_tokens, tokens[t], row(s.x, t, c.hidden));
  round_activations(s.x.data(), m * c.hidden);
  probe("embed", -1, segments, s.x.data(), c.hidden);
  for (int i = 0; i < c.n_layers; ++i) decoder_layer(i, segments, m);
  for (const Segment& g : segments) g.state->position_ += g.m;
}

/// h = x + Mixer(RMSNorm(x)); x = h + MoE(RMSNorm(h)) for the m tokens of the pass (docs/model.md §3).
void CpuBackend::decoder_layer(int i, std::span<const Segment> segments, int64_t m) {
  const ModelConfig& c = config();
  const LayerWeights& w = weights_->layers[i];
  Scratch& s = *scratch_;
  const int64_t H = c.hidden;
  for (int64_t t = 0; t < m; ++t)
    rms_norm(row(s.x, t, H), w.input_layernorm.data(), H, c.rms_norm_eps, row(s.normed, t, H));
  round_activations(s.normed.data(), m * H);
  probe("attn_norm", i, segments, s.normed.data(), H);
  if (w.type == LayerType::kFullAttention)
    attention_mixer(w.attention, i, segments, m, s.branch.data());
  else
    gdn_mixer(w.gdn, i, segments, m, s.branch.data());
  probe("mixer_out", i, segments, s.branch.data(), H);
  add_inplace(s.x.data(), s.branch.data(), m * H);
  round_activations(s.x.data(), m * H);
  for (int64_t t = 0; t < m; ++t)
    rms_norm(row(s.x, t, H), w.post_attention_layernorm.data(), H, c.rms_norm_eps, row(s.normed, t, H));
  round_activations(s.normed.data(), m * H);
  probe("ffn_norm", i, segments, s.normed.data(), H);
  moe_block(w.moe, i, segments, m, s.branch.data());
  probe("ffn_out", i, segments, s.branch.data(), H);
  add_inplace(s.x.data(), s.branch.data(), m * H);
  round_activations(s.x.data(), m * H);
  probe("layer_out", i, segments, s.x.data(), H);
}

/// Gated DeltaNet (docs/model.md §3.3, HF fp32 variants): input s.normed [m, H], output out [m, H].
/// The conv and the delta rule of a segment run on its own state, its tokens in order.
void CpuBackend::gdn_mixer(const GdnWeights& w, int layer, std::span<const Segment> segments, int64_t m,
                           float* out) {
  const ModelConfig& c = config();
  Scratch& s = *scratch_;
  const int64_t C = c.gdn_conv_channels(), key_dim = c.gdn_key_dim(), value_dim = c.gdn_value_dim();
  const int Hk = c.gdn_n_key_heads, Hv = c.gdn_n_value_heads;
  const int Dk = c.gdn_key_head_dim, Dv = c.gdn_value_head_dim;
  const float q_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
  const MatmulOutput projections[] = {{&w.in_proj_qkv, s.qkv.data()},
                                      {&w.in_proj_z, s.z.data()},
                                      {&w.in_proj_a, s.a.data()},
                                      {&w.in_proj_b, s.b.data()}};
  quant_matmul_many(projections, s.normed.data(), m, &pool_);
  round_activations(s.qkv.data(), m * C);
  round_activations(s.z.data(), m * value_dim);
  round_activations(s.a.data(), m * Hv);
  round_activations(s.b.data(), m * Hv);
  // Causal conv + SiLU + q/k normalisation, token by token through each segment's conv window.
  for (const Segment& g : segments) {
    float* window = g.state->layers[layer].conv_window.data();
    for (int64_t t = g.offset; t < g.offset + g.m; ++t) {
      float* conv = row(s.conv, t, C);
      causal_conv_step(w.conv1d.data(), window, row(s.qkv, t, C), C, c.gdn_conv_kernel, conv);
      silu_inplace(conv, C);
      round_activations(conv, C);  // q̂ and k̂ below stay fp32 (docs/model.md §4.3)
      float* q = conv;            // [Hk, Dk]
      float* k = conv + key_dim;  // [Hk, Dk]
      for (int h = 0; h < Hk; ++h) {
        l2_normalize(q + h * Dk, Dk, kL2NormEps);
        for (int d = 0; d < Dk; ++d) q[h * Dk + d] *= q_scale;
        l2_normalize(k + h * Dk, Dk, kL2NormEps);
      }
    }
  }
  // Delta rule + gated norm: each (segment, value head) walks its segment's tokens in order.
  auto value_heads = [&](int64_t item0, int64_t item1) {
    for (int64_t item = item0; item < item1; ++item) {
      const Segment& g = segments[item / Hv];
      const int64_t j = item % Hv;
      const int64_t kh = j / (Hv / Hk);  // value heads share key heads (repeat_interleave)
      float* S = g.state->layers[layer].recurrent.data() + j * Dk * Dv;
      for (int64_t t = g.offset; t < g.offset + g.m; ++t) {
        const float* q = row(s.conv, t, C);
        const float* k = q + key_dim;
        const float* v = q + 2 * key_dim;  // [Hv, Dv]
        const float* a = row(s.a, t, Hv);
        const float* b = row(s.b, t, Hv);
        float* core = row(s.core, t, value_dim);
        const float* z = row(s.z, t, value_dim);
        const float decay = -std::exp(w.A_log[j]) * softplus(a[j] + w.dt_bias[j]);
        const float alpha = std::exp(decay);
        const float beta = sigmoid(b[j]);
        delta_rule_step(S, q + kh * Dk, k + kh * Dk, v + j * Dv, alpha, beta, Dk, Dv, core + j * Dv);
        round_activations(core + j * Dv, Dv);
        gated_rms_norm(core + j * Dv, z + j * Dv, w.norm.data(), Dv, c.rms_norm_eps, core + j * Dv);
        round_activations(core + j * Dv, Dv);
      }
    }
  };
  pool_.parallel_for(static_cast<int64_t>(segments.size()) * Hv, std::max<int64_t>(1, 16384 / (int64_t{Dk} * Dv)),
                     value_heads);
  quant_matmul(w.out_proj, s.core.data(), m, out, &pool_);
  round_activations(out, m * c.hidden);
}

/// Gated full attention (docs/model.md §3.4): input s.normed [m, H], output out [m, H]. Each
/// segment appends its keys and values to its own KV cache and attends over it (causally).
void CpuBackend::attention_mixer(const AttentionWeights& w, int layer, std::span<const Segment> segments,
                                 int64_t m, float* out) {
  const ModelConfig& c = config();
  Scratch& s = *scratch_;
  const int D = c.head_dim, nq = c.n_heads, nkv = c.n_kv_heads;
  const int64_t qg_width = int64_t{nq} * 2 * D, kv_width = int64_t{nkv} * D;
  const MatmulOutput projections[] = {{&w.q_proj, s.qg.data()}, {&w.k_proj, s.k.data()}, {&w.v_proj, s.v.data()}};
  quant_matmul_many(projections, s.normed.data(), m, &pool_);
  round_activations(s.qg.data(), m * qg_width);
  round_activations(s.k.data(), m * kv_width);
  round_activations(s.v.data(), m * kv_width);
  for (int64_t t = 0; t < m; ++t) {
    rope_cos_sin(s.row_pos[t], c.rotary_dim, c.rope_theta, s.rope_cos.data(), s.rope_sin.data());
    for (int h = 0; h < nq; ++h) {
      float* q = row(s.qg, t, qg_width) + h * 2 * D;  // query half; the gate half follows
      rms_norm(q, w.q_norm.data(), D, c.rms_norm_eps, q);
      round_activations(q, D);
      apply_rope(q, c.rotary_dim, s.rope_cos.data(), s.rope_sin.data());
      round_activations(q, D);
    }
    for (int h = 0; h < nkv; ++h) {
      float* k = row(s.k, t, kv_width) + h * D;
      rms_norm(k, w.k_norm.data(), D, c.rms_norm_eps, k);
      round_activations(k, D);
      apply_rope(k, c.rotary_dim, s.rope_cos.data(), s.rope_sin.data());
      round_activations(k, D);  // the KV cache holds bf16 keys
    }
  }
  for (const Segment& g : segments) {  // rows first_pos … first_pos + m − 1 (room made by forward_pass)
    std::copy_n(s.k.begin() + g.offset * kv_width, g.m * kv_width, g.state->keys(layer) + g.first_pos * kv_width);
    std::copy_n(s.v.begin() + g.offset * kv_width, g.m * kv_width, g.state->values(layer) + g.first_pos * kv_width);
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto heads = [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / nq, h = th % nq, kv = h / (nq / nkv);
      const CpuSequenceState& state = *segments[s.row_segment[t]].state;
      const int64_t len = s.row_pos[t] + 1;  // causal: positions 0 … row_pos[t]
      if (static_cast<int64_t>(scores.size()) < len) scores.resize(len);
      const float* q = row(s.qg, t, qg_width) + h * 2 * D;
      const float* gate = q + D;
      float* o = row(s.attn, t, int64_t{nq} * D) + h * D;
      attention_head(q, state.keys(layer) + kv * D, state.values(layer) + kv * D, len, kv_width,
                     D, scale, scores.data(), o);
      for (int d = 0; d < D; ++d) o[d] *= sigmoid(gate[d]);
      round_activations(o, D);
    }
  };
  pool_.parallel_for(m * nq, 1, heads);
  quant_matmul(w.o_proj, s.attn.data(), m, out, &pool_);
  round_activations(out, m * c.hidden);
}

/// Sparse MoE block (docs/model.md §3.5): routed top-k SwiGLU experts + gated shared expert.
/// Input s.normed [m, H], output out [m, H].
void CpuBackend::moe_block(const MoeWeights& w, int layer, std::span<const Segment> segments, int64_t m,
                           float* out) {
  const ModelConfig& c = config();
  Scratch& s = *scratch_;
  const int E = c.n_experts, k = c.n_experts_per_tok;
  const MatmulOutput inputs[] = {{&w.router, s.router_logits.data()},
                                 {&w.shared_expert_gate, s.shared_gate_logit.data()},
                                 {&w.shared_gate_proj, s.shared_gate.data()},
                                 {&w.shared_up_proj, s.shared_up.data()}};
  quant_matmul_many(inputs, s.normed.data(), m, &pool_);
  probe("router_logits", layer, segments, s.router_logits.data(), E);
  for (int64_t t = 0; t < m; ++t) {
    const float* logits = row(s.router_logits, t, E);
    int* ids = s.route_ids.data() + t * k;
    route_top_k(logits, E, k, c.norm_topk_prob, ids, row(s.route_weights, t, k));
    if (route_override_ && route_override_(layer, s.row_pos[t], std::span<const float>(logits, E),
                                           std::span<int>(ids, static_cast<size_t>(k))))
      route_weights(logits, E, ids, k, c.norm_topk_prob, row(s.route_weights, t, k));
  }
  expert_ffns(w, m, out);
  const int64_t H = c.hidden;
  for (int64_t t = 0; t < m; ++t) {
    const float gamma = sigmoid(s.shared_gate_logit[t]);
    const float* shared = row(s.shared_down, t, H);
    float* o = out + t * H;
    for (int64_t d = 0; d < H; ++d) o[d] += gamma * shared[d];
  }
  round_activations(out, m * H);  // one rounding of routed sum + gated shared expert
}

/// Routed experts: out[t] = Σ_slot w[t, slot]·Expert_{id[t, slot]}(u_t), summed in slot
/// (descending weight) order; shared expert: s.shared_down [m, H] from its gate and up
/// projections in s.shared_gate / s.shared_up (docs/model.md §3.5 step 4, before its sigmoid
/// gate). The (token, slot) pairs are grouped by expert so that each expert's weights are read
/// once per pass, for the tokens of every sequence in it. The experts are the items of one
/// parallel pass (each item's matmuls on one thread): one hand-out to the pool per layer instead
/// of three per expert. An expert with more rows than a thread's share is split into items of
/// that many rows (each reads its weights again), so that no item holds up the pass.
void CpuBackend::expert_ffns(const MoeWeights& w, int64_t m, float* out) {
  const ModelConfig& c = config();
  Scratch& s = *scratch_;
  const int E = c.n_experts, k = c.n_experts_per_tok;
  const int64_t H = c.hidden, I = c.moe_ffn_dim, Is = c.shared_ffn_dim, pairs = m * k;
  // Counting sort of the (token, slot) pairs by expert id.
  std::fill(s.expert_begin.begin(), s.expert_begin.end(), 0);
  for (int64_t p = 0; p < pairs; ++p) ++s.expert_begin[s.route_ids[p] + 1];
  for (int e = 0; e < E; ++e) s.expert_begin[e + 1] += s.expert_begin[e];
  std::copy_n(s.expert_begin.begin(), E, s.expert_next.begin());
  for (int64_t p = 0; p < pairs; ++p) s.slot_order[s.expert_next[s.route_ids[p]]++] = static_cast<int>(p);
  // Items: the shared expert's rows are the m tokens, routed expert e's the rows
  // [expert_begin[e], expert_begin[e + 1]) of the expert buffers (row r: pair slot_order[r]).
  const int64_t share = std::max<int64_t>(8, (m + pairs + pool_.size() - 1) / pool_.size());
  s.expert_items.clear();
  auto add_items = [&](int expert, int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += share)
      s.expert_items.push_back({expert, first, std::min(share, end - first)});
  };
  add_items(-1, 0, m);
  for (int e = 0; e < E; ++e) add_items(e, s.expert_begin[e], s.expert_begin[e + 1]);
  // Largest first, so that the pool's last blocks are small.
  std::stable_sort(s.expert_items.begin(), s.expert_items.end(),
                   [](const ExpertItem& a, const ExpertItem& b) { return a.n > b.n; });
  auto items = [&](int64_t item0, int64_t item1) {
    for (int64_t i = item0; i < item1; ++i) {
      const auto [e, first, n] = s.expert_items[i];
      if (e < 0) {
        float* gate = row(s.shared_gate, first, Is);
        swiglu(gate, row(s.shared_up, first, Is), n * Is);
        quant_matmul(w.shared_down_proj, gate, n, row(s.shared_down, first, H), nullptr);
        round_activations(row(s.shared_down, first, H), n * H);
        continue;
      }
      float* in = row(s.expert_in, first, H);
      float* gate = row(s.expert_gate, first, I);
      float* up = row(s.expert_up, first, I);
      float* down = row(s.expert_down, first, H);
      for (int64_t r = 0; r < n; ++r) std::copy_n(row(s.normed, s.slot_order[first + r] / k, H), H, in + r * H);
      const QuantMatrix gate_proj = w.experts_gate_proj.row_block(e * I, I);
      const QuantMatrix up_proj = w.experts_up_proj.row_block(e * I, I);
      const MatmulOutput gate_up[] = {{&gate_proj, gate}, {&up_proj, up}};
      quant_matmul_many(gate_up, in, n, nullptr);
      swiglu(gate, up, n * I);
      quant_matmul(w.experts_down_proj.row_block(e * H, H), gate, n, down, nullptr);
      round_activations(down, n * H);
      for (int64_t r = 0; r < n; ++r) std::copy_n(down + r * H, H, row(s.slot_out, s.slot_order[first + r], H));
    }
  };
  pool_.parallel_for(static_cast<int64_t>(s.expert_items.size()), 1, items);
  for (int64_t t = 0; t < m; ++t) {
    float* o = out + t * H;
    std::fill(o, o + H, 0.0f);
    for (int slot = 0; slot < k; ++slot) {
      const float weight = s.route_weights[t * k + slot];
      const float* d = row(s.slot_out, t * k + slot, H);
      for (int64_t j = 0; j < H; ++j) o[j] += weight * d[j];
    }
  }
}

void CpuBackend::swiglu(float* gate, float* up, int64_t n) const {
  round_activations(gate, n);
  round_activations(up, n);
  for (int64_t i = 0; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
  round_activations(gate, n);
}

/// Final norm, fp32 LM head and greedy argmax of the chosen rows (docs/model.md §3.6); the LM
/// head is one batched matmul over them.
void CpuBackend::lm_head(std::span<const int64_t> rows, std::span<const int64_t> positions, std::span<int32_t> next,
                         std::span<std::vector<float>* const> logits_out) {
  const ModelConfig& c = config();
  Scratch& s = *scratch_;
  const int64_t n = static_cast<int64_t>(rows.size()), H = c.hidden, V = c.vocab;
  Scratch::grow(s.final_normed, n * H), Scratch::grow(s.logits, n * V);
  for (int64_t i = 0; i < n; ++i) {
    float* normed = row(s.final_normed, i, H);
    rms_norm(row(s.x, rows[i], H), weights_->final_norm.data(), H, c.rms_norm_eps, normed);
    round_activations(normed, H);
  }
  quant_matmul(weights_->lm_head, s.final_normed.data(), n, s.logits.data(), &pool_);
  for (int64_t i = 0; i < n; ++i) {
    const float* logits = row(s.logits, i, V);
    if (probe_sink_) {
      probe_sink_("final_norm", -1, positions[i], std::span<const float>(row(s.final_normed, i, H), H));
      probe_sink_("logits", -1, positions[i], std::span<const float>(logits, V));
    }
    if (logits_out[i]) logits_out[i]->assign(logits, logits + V);
    next[i] = argmax(logits, V);
  }
}

void CpuBackend::round_activations(float* data, int64_t n) const {
  if (numerics_ != Numerics::kBf16Activations) return;
  for (int64_t i = 0; i < n; ++i) data[i] = round_bf16(data[i]);
}

void CpuBackend::probe(const char* name, int layer, std::span<const Segment> segments, const float* data,
                       int64_t width) const {
  if (!probe_sink_) return;
  for (const Segment& g : segments)
    for (int64_t t = 0; t < g.m; ++t)
      probe_sink_(name, layer, g.first_pos + t,
                  std::span<const float>(data + (g.offset + t) * width, static_cast<size_t>(width)));
}

}  // namespace lily::cpu
