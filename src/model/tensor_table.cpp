// The tensor table of docs/model.md §2.3: for_each_tensor names every tensor once, with its
// shape, storage, role and destination in ModelWeights.
#include "model/tensor_table.h"

#include <type_traits>

#include "base/error.h"

namespace lily {
namespace {

/// Hands each tensor to the visitor: quantized() takes a QuantMatrix destination, bf16() and
/// float32() an fp32 vector, so a spec's kind and its destination cannot disagree. `Weights` is
/// ModelWeights (the loader's walk) or const ModelWeights (the read-only walk); the destinations
/// carry its constness.
template <class Weights, class Visitor>
class TableBuilder {
 public:
  /// T, const when the walked weights are.
  template <class T>
  using Field = std::conditional_t<std::is_const_v<Weights>, const T, T>;

  explicit TableBuilder(const Visitor& visit) : visit_(visit) {}
  /// A quantized tensor; its code bits come from its name (quantized_bits).
  void quantized(std::string name, TensorRole role, std::vector<int64_t> shape, int layer, Field<QuantMatrix>& dest) {
    const int bits = quantized_bits(name);
    visit_(spec(std::move(name), TensorKind::kQuantized, role, std::move(shape), bits, layer), &dest);
  }
  /// A BF16 tensor; `f32_accepted`: F32 is fine too; `alt_shape`: a second accepted layout.
  void bf16(std::string name, TensorRole role, std::vector<int64_t> shape, int layer, Field<std::vector<float>>& dest,
            bool f32_accepted = false, std::vector<int64_t> alt_shape = {}) {
    TensorSpec s = spec(std::move(name), TensorKind::kBf16, role, std::move(shape), 0, layer);
    s.f32_accepted = f32_accepted;
    s.alt_shape = std::move(alt_shape);
    visit_(s, &dest);
  }
  void float32(std::string name, TensorRole role, std::vector<int64_t> shape, int layer,
               Field<std::vector<float>>& dest) {
    visit_(spec(std::move(name), TensorKind::kFloat, role, std::move(shape), 0, layer), &dest);
  }

 private:
  static TensorSpec spec(std::string name, TensorKind kind, TensorRole role, std::vector<int64_t> shape, int bits,
                         int layer) {
    TensorSpec s;
    s.name = std::move(name);
    s.kind = kind;
    s.role = role;
    s.shape = std::move(shape);
    s.bits = bits;
    s.layer = layer;
    return s;
  }

  const Visitor& visit_;
};

using R = TensorRole;

template <class Builder>
void add_gdn(Builder& t, const ModelConfig& c, const std::string& p, int i,
             typename Builder::template Field<GdnWeights>& g) {
  const int64_t H = c.hidden, hv = c.gdn_n_value_heads;
  t.quantized(p + "linear_attn.in_proj_qkv", R::kGdnInProj, {c.gdn_conv_channels(), H}, i, g.in_proj_qkv);
  t.quantized(p + "linear_attn.in_proj_z", R::kGdnInProj, {c.gdn_value_dim(), H}, i, g.in_proj_z);
  t.quantized(p + "linear_attn.in_proj_a", R::kGdnInProj, {hv, H}, i, g.in_proj_a);
  t.quantized(p + "linear_attn.in_proj_b", R::kGdnInProj, {hv, H}, i, g.in_proj_b);
  t.bf16(p + "linear_attn.conv1d.weight", R::kGdnConv, {c.gdn_conv_channels(), c.gdn_conv_kernel, 1}, i, g.conv1d,
         /*f32_accepted=*/false, /*alt_shape=*/{c.gdn_conv_channels(), 1, c.gdn_conv_kernel});
  t.float32(p + "linear_attn.A_log", R::kGdnALog, {hv}, i, g.A_log);
  t.bf16(p + "linear_attn.dt_bias", R::kGdnDtBias, {hv}, i, g.dt_bias);
  t.bf16(p + "linear_attn.norm.weight", R::kGdnNorm, {c.gdn_value_head_dim}, i, g.norm, /*f32_accepted=*/true);
  t.quantized(p + "linear_attn.out_proj", R::kGdnOutProj, {H, c.gdn_value_dim()}, i, g.out_proj);
}

template <class Builder>
void add_attention(Builder& t, const ModelConfig& c, const std::string& p, int i,
                   typename Builder::template Field<AttentionWeights>& a) {
  const int64_t H = c.hidden, D = c.head_dim;
  t.quantized(p + "self_attn.q_proj", R::kAttnInProj, {int64_t(c.n_heads) * 2 * D, H}, i, a.q_proj);
  t.quantized(p + "self_attn.k_proj", R::kAttnInProj, {int64_t(c.n_kv_heads) * D, H}, i, a.k_proj);
  t.quantized(p + "self_attn.v_proj", R::kAttnInProj, {int64_t(c.n_kv_heads) * D, H}, i, a.v_proj);
  t.quantized(p + "self_attn.o_proj", R::kAttnOutProj, {H, int64_t(c.n_heads) * D}, i, a.o_proj);
  t.bf16(p + "self_attn.q_norm.weight", R::kAttnQNorm, {D}, i, a.q_norm);
  t.bf16(p + "self_attn.k_norm.weight", R::kAttnKNorm, {D}, i, a.k_norm);
}

template <class Builder>
void add_moe(Builder& t, const ModelConfig& c, const std::string& p, int i,
             typename Builder::template Field<MoeWeights>& m) {
  const int64_t H = c.hidden, E = c.n_experts, I = c.moe_ffn_dim, S = c.shared_ffn_dim;
  t.quantized(p + "mlp.gate", R::kRouter, {E, H}, i, m.router);
  t.quantized(p + "mlp.switch_mlp.gate_proj", R::kExpertsGateProj, {E, I, H}, i, m.experts_gate_proj);
  t.quantized(p + "mlp.switch_mlp.up_proj", R::kExpertsUpProj, {E, I, H}, i, m.experts_up_proj);
  t.quantized(p + "mlp.switch_mlp.down_proj", R::kExpertsDownProj, {E, H, I}, i, m.experts_down_proj);
  t.quantized(p + "mlp.shared_expert.gate_proj", R::kSharedGateProj, {S, H}, i, m.shared_gate_proj);
  t.quantized(p + "mlp.shared_expert.up_proj", R::kSharedUpProj, {S, H}, i, m.shared_up_proj);
  t.quantized(p + "mlp.shared_expert.down_proj", R::kSharedDownProj, {H, S}, i, m.shared_down_proj);
  t.quantized(p + "mlp.shared_expert_gate", R::kSharedExpertGate, {1, H}, i, m.shared_expert_gate);
}

/// The walk both for_each_tensor overloads share; `weights.layers` already has its entries.
template <class Weights, class Visitor>
void walk(const ModelConfig& config, Weights& weights, const Visitor& visit) {
  TableBuilder<Weights, Visitor> t(visit);
  const int64_t V = config.vocab, H = config.hidden;
  t.quantized("language_model.model.embed_tokens", R::kEmbedding, {V, H}, -1, weights.embed_tokens);
  for (int i = 0; i < config.n_layers; ++i) {
    const std::string p = layer_prefix(i);
    auto& l = weights.layers[i];
    t.bf16(p + "input_layernorm.weight", R::kInputNorm, {H}, i, l.input_layernorm);
    if (config.is_full_attention(i)) add_attention(t, config, p, i, l.attention);
    else add_gdn(t, config, p, i, l.gdn);
    t.bf16(p + "post_attention_layernorm.weight", R::kPostAttentionNorm, {H}, i, l.post_attention_layernorm);
    add_moe(t, config, p, i, l.moe);
  }
  t.bf16("language_model.model.norm.weight", R::kFinalNorm, {H}, -1, weights.final_norm);
  t.quantized("language_model.lm_head", R::kOutputHead, {V, H}, -1, weights.lm_head);
}

}  // namespace

void for_each_tensor(const ModelConfig& config, ModelWeights& weights, const TensorVisitor& visit) {
  LILY_CHECK(static_cast<int>(config.layer_types.size()) == config.n_layers);
  weights.layers.resize(static_cast<size_t>(config.n_layers));
  for (int i = 0; i < config.n_layers; ++i) weights.layers[i].type = config.layer_types[i];
  walk(config, weights, visit);
}

void for_each_tensor(const ModelWeights& weights, const ConstTensorVisitor& visit) {
  const ModelConfig& config = weights.config;
  LILY_CHECK(static_cast<int>(config.layer_types.size()) == config.n_layers);
  LILY_CHECK(weights.layers.size() == static_cast<size_t>(config.n_layers));
  for (int i = 0; i < config.n_layers; ++i) LILY_CHECK(weights.layers[i].type == config.layer_types[i]);
  walk(config, weights, visit);
}

const char* role_name(TensorRole role) {
  switch (role) {
    case R::kEmbedding: return "embedding";
    case R::kOutputHead: return "output_head";
    case R::kFinalNorm: return "final_norm";
    case R::kInputNorm: return "input_norm";
    case R::kPostAttentionNorm: return "post_attention_norm";
    case R::kGdnInProj: return "gdn_in_proj";
    case R::kGdnConv: return "gdn_conv";
    case R::kGdnALog: return "gdn_a_log";
    case R::kGdnDtBias: return "gdn_dt_bias";
    case R::kGdnNorm: return "gdn_norm";
    case R::kGdnOutProj: return "gdn_out_proj";
    case R::kAttnInProj: return "attn_in_proj";
    case R::kAttnQNorm: return "attn_q_norm";
    case R::kAttnKNorm: return "attn_k_norm";
    case R::kAttnOutProj: return "attn_out_proj";
    case R::kRouter: return "router";
    case R::kSharedExpertGate: return "shared_expert_gate";
    case R::kExpertsGateProj: return "experts_gate_proj";
    case R::kExpertsUpProj: return "experts_up_proj";
    case R::kExpertsDownProj: return "experts_down_proj";
    case R::kSharedGateProj: return "shared_gate_proj";
    case R::kSharedUpProj: return "shared_up_proj";
    case R::kSharedDownProj: return "shared_down_proj";
  }
  throw InternalError("role_name: unknown tensor role " + std::to_string(static_cast<int>(role)));
}

std::vector<TensorSpec> tensor_table(const ModelConfig& config) {
  std::vector<TensorSpec> specs;
  ModelWeights scratch;  // only its (empty) fields are pointed at; nothing is filled
  for_each_tensor(config, scratch, [&](const TensorSpec& spec, TensorDest) { specs.push_back(spec); });
  return specs;
}

std::vector<int64_t> packed_codes_shape(const TensorSpec& spec) {
  LILY_CHECK(spec.kind == TensorKind::kQuantized && !spec.shape.empty());
  std::vector<int64_t> shape = spec.shape;
  shape.back() = shape.back() * spec.bits / 32;
  return shape;
}

std::vector<int64_t> group_params_shape(const TensorSpec& spec, int group_size) {
  LILY_CHECK(spec.kind == TensorKind::kQuantized && !spec.shape.empty() && group_size > 0);
  std::vector<int64_t> shape = spec.shape;
  shape.back() = shape.back() / group_size;
  return shape;
}

bool is_eight_bit_module(std::string_view path) {
  for (std::string_view module : kEightBitModules) {
    if (path.size() < module.size() || path.substr(path.size() - module.size()) != module) continue;
    if (path.size() == module.size() || path[path.size() - module.size() - 1] == '.') return true;
  }
  return false;
}

int quantized_bits(std::string_view name) { return is_eight_bit_module(name) ? 8 : 4; }

std::string layer_prefix(int layer) { return "language_model.model.layers." + std::to_string(layer) + "."; }

int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t stored_bytes(const TensorSpec& spec, int group_size) {
  switch (spec.kind) {
    case TensorKind::kQuantized:
      return shape_numel(packed_codes_shape(spec)) * 4 + 2 * shape_numel(group_params_shape(spec, group_size)) * 2;
    case TensorKind::kBf16: return shape_numel(spec.shape) * 2;
    case TensorKind::kFloat: return shape_numel(spec.shape) * 4;
  }
  return 0;
}

}  // namespace lily
