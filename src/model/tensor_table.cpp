// The tensor table of docs/model.md §2.3.
#include "model/tensor_table.h"

#include "base/error.h"

namespace lily {
namespace {

class TableBuilder {
 public:
  explicit TableBuilder(std::vector<TensorSpec>& out) : out_(out) {}
  void quantized(std::string name, std::vector<int64_t> shape, int bits, int layer) {
    out_.push_back({std::move(name), TensorKind::kQuantized, std::move(shape), bits, layer});
  }
  void bf16(std::string name, std::vector<int64_t> shape, int layer) {
    out_.push_back({std::move(name), TensorKind::kBf16, std::move(shape), 0, layer});
  }
  void float32(std::string name, std::vector<int64_t> shape, int layer) {
    out_.push_back({std::move(name), TensorKind::kFloat, std::move(shape), 0, layer});
  }

 private:
  std::vector<TensorSpec>& out_;
};

void add_gdn(TableBuilder& t, const ModelConfig& c, const std::string& p, int i) {
  const int64_t H = c.hidden, hv = c.gdn_n_value_heads;
  t.quantized(p + "linear_attn.in_proj_qkv", {c.gdn_conv_channels(), H}, 4, i);
  t.quantized(p + "linear_attn.in_proj_z", {c.gdn_value_dim(), H}, 4, i);
  t.quantized(p + "linear_attn.in_proj_a", {hv, H}, 4, i);
  t.quantized(p + "linear_attn.in_proj_b", {hv, H}, 4, i);
  t.bf16(p + "linear_attn.conv1d.weight", {c.gdn_conv_channels(), c.gdn_conv_kernel, 1}, i);
  t.float32(p + "linear_attn.A_log", {hv}, i);
  t.bf16(p + "linear_attn.dt_bias", {hv}, i);
  t.bf16(p + "linear_attn.norm.weight", {c.gdn_value_head_dim}, i);
  t.quantized(p + "linear_attn.out_proj", {H, c.gdn_value_dim()}, 4, i);
}

void add_attention(TableBuilder& t, const ModelConfig& c, const std::string& p, int i) {
  const int64_t H = c.hidden, D = c.head_dim;
  t.quantized(p + "self_attn.q_proj", {int64_t(c.n_heads) * 2 * D, H}, 4, i);
  t.quantized(p + "self_attn.k_proj", {int64_t(c.n_kv_heads) * D, H}, 4, i);
  t.quantized(p + "self_attn.v_proj", {int64_t(c.n_kv_heads) * D, H}, 4, i);
  t.quantized(p + "self_attn.o_proj", {H, int64_t(c.n_heads) * D}, 4, i);
  t.bf16(p + "self_attn.q_norm.weight", {D}, i);
  t.bf16(p + "self_attn.k_norm.weight", {D}, i);
}

void add_moe(TableBuilder& t, const ModelConfig& c, const std::string& p, int i) {
  const int64_t H = c.hidden, E = c.n_experts, I = c.moe_ffn_dim, S = c.shared_ffn_dim;
  t.quantized(p + "mlp.gate", {E, H}, 8, i);
  t.quantized(p + "mlp.switch_mlp.gate_proj", {E, I, H}, 4, i);
  t.quantized(p + "mlp.switch_mlp.up_proj", {E, I, H}, 4, i);
  t.quantized(p + "mlp.switch_mlp.down_proj", {E, H, I}, 4, i);
  t.quantized(p + "mlp.shared_expert.gate_proj", {S, H}, 4, i);
  t.quantized(p + "mlp.shared_expert.up_proj", {S, H}, 4, i);
  t.quantized(p + "mlp.shared_expert.down_proj", {H, S}, 4, i);
  t.quantized(p + "mlp.shared_expert_gate", {1, H}, 8, i);
}

}  // namespace

std::vector<TensorSpec> tensor_table(const ModelConfig& config) {
  LILY_CHECK(static_cast<int>(config.layer_types.size()) == config.n_layers);
  std::vector<TensorSpec> specs;
  TableBuilder t(specs);
  const int64_t V = config.vocab, H = config.hidden;
  t.quantized("language_model.model.embed_tokens", {V, H}, 4, -1);
  for (int i = 0; i < config.n_layers; ++i) {
    const std::string p = "language_model.model.layers." + std::to_string(i) + ".";
    t.bf16(p + "input_layernorm.weight", {H}, i);
    if (config.is_full_attention(i)) add_attention(t, config, p, i);
    else add_gdn(t, config, p, i);
    t.bf16(p + "post_attention_layernorm.weight", {H}, i);
    add_moe(t, config, p, i);
  }
  t.bf16("language_model.model.norm.weight", {H}, -1);
  t.quantized("language_model.lm_head", {V, H}, 4, -1);
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

int64_t stored_bytes(const TensorSpec& spec, int group_size) {
  auto numel = [](const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  };
  switch (spec.kind) {
    case TensorKind::kQuantized:
      return numel(packed_codes_shape(spec)) * 4 + 2 * numel(group_params_shape(spec, group_size)) * 2;
    case TensorKind::kBf16: return numel(spec.shape) * 2;
    case TensorKind::kFloat: return numel(spec.shape) * 4;
  }
  return 0;
}

}  // namespace lily
