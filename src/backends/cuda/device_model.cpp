// Upload of ModelWeights into the device layout described in device_model.h.
#include "backends/cuda/device_model.h"

#include <string>

namespace lily::cuda {
namespace {

int64_t quant_bytes(const QuantMatrix& m) {
  return m.rows * m.words_per_row() * 4 + 2 * m.rows * m.groups_per_row() * 2;
}

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

int64_t DeviceModel::required_bytes(const ModelWeights& w) {
  int64_t total = quant_bytes(w.embed_tokens) + quant_bytes(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    const MoeWeights& m = l.moe;
    total += quant_bytes(m.router) + quant_bytes(m.shared_expert_gate) + quant_bytes(m.experts_gate_proj) +
             quant_bytes(m.experts_up_proj) + quant_bytes(m.experts_down_proj) + quant_bytes(m.shared_gate_proj) +
             quant_bytes(m.shared_up_proj) + quant_bytes(m.shared_down_proj);
    if (l.type == LayerType::kLinearAttention) {
      const GdnWeights& g = l.gdn;
      total += quant_bytes(g.in_proj_qkv) + quant_bytes(g.in_proj_z) + quant_bytes(g.in_proj_a) +
               quant_bytes(g.in_proj_b) + quant_bytes(g.out_proj) +
               4 * int64_t(g.conv1d.size() + g.A_log.size() + g.dt_bias.size() + g.norm.size());
    } else {
      const AttentionWeights& a = l.attention;
      total += quant_bytes(a.q_proj) + quant_bytes(a.k_proj) + quant_bytes(a.v_proj) + quant_bytes(a.o_proj) +
               4 * int64_t(a.q_norm.size() + a.k_norm.size());
    }
    total += 4 * int64_t(l.input_layernorm.size() + l.post_attention_layernorm.size());
  }
  return total + 4 * int64_t(w.final_norm.size());
}

DeviceQuant DeviceModel::upload_concat(const std::vector<const QuantMatrix*>& parts) {
  int64_t rows = 0;
  const QuantMatrix& first = *parts.front();
  for (const QuantMatrix* p : parts) {
    if (p->cols != first.cols || p->bits != first.bits || p->group_size != ::lily::kQuantGroupSize)
      throw ::lily::Error("CUDA upload: fused projection parts differ in width or bit width (" +
                          std::to_string(p->cols) + " vs " + std::to_string(first.cols) + ")");
    rows += p->rows;
  }
  const int64_t wpr = first.words_per_row(), gpr = first.groups_per_row();
  DeviceBuffer codes(rows * wpr * 4), scales(rows * gpr * 2), biases(rows * gpr * 2);
  int64_t at = 0;
  for (const QuantMatrix* p : parts) {
    upload(codes.as<uint32_t>() + at * wpr, p->codes, p->rows * wpr);
    upload(scales.as<uint16_t>() + at * gpr, p->scales, p->rows * gpr);
    upload(biases.as<uint16_t>() + at * gpr, p->biases, p->rows * gpr);
    at += p->rows;
  }
  DeviceQuant q;
  q.codes = codes.as<uint32_t>();
  q.scales = scales.as<__nv_bfloat16>();
  q.biases = biases.as<__nv_bfloat16>();
  q.rows = rows;
  q.cols = static_cast<int>(first.cols);
  q.bits = first.bits;
  bytes += codes.bytes() + scales.bytes() + biases.bytes();
  buffers_.push_back(std::move(codes));
  buffers_.push_back(std::move(scales));
  buffers_.push_back(std::move(biases));
  return q;
}

const float* DeviceModel::upload_floats(const std::vector<float>& v) {
  if (v.empty()) return nullptr;
  DeviceBuffer b(v.size() * sizeof(float));
  upload(b.as<float>(), v.data(), v.size());
  bytes += b.bytes();
  const float* p = b.as<float>();
  buffers_.push_back(std::move(b));
  return p;
}

DeviceModel::DeviceModel(const ModelWeights& w) {
  const ModelConfig& c = w.config;
  if (c.shared_ffn_dim != c.moe_ffn_dim)
    throw ::lily::Error("CUDA backend: shared expert width " + std::to_string(c.shared_ffn_dim) +
                        " differs from the routed expert width " + std::to_string(c.moe_ffn_dim) +
                        "; the fused MoE kernels need them equal");
  const int64_t need = required_bytes(w);
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t margin = 512ll << 20;  // activations, states, workspace
  if (need + margin > static_cast<int64_t>(free_b))
    throw ::lily::Error("CUDA backend: the weights need " + gib(need) + " of device memory (+ " + gib(margin) +
                        " working space) but only " + gib(static_cast<int64_t>(free_b)) + " of " +
                        gib(static_cast<int64_t>(total_b)) + " is free");

  embed = upload_concat({&w.embed_tokens});
  lm_head = upload_concat({&w.lm_head});
  final_norm = upload_floats(w.final_norm);
  layers.resize(w.layers.size());
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& src = w.layers[i];
    DeviceLayer& d = layers[i];
    d.type = src.type;
    d.input_norm = upload_floats(src.input_layernorm);
    d.post_norm = upload_floats(src.post_attention_layernorm);
    if (src.type == LayerType::kLinearAttention) {
      const GdnWeights& g = src.gdn;
      d.gdn_in = upload_concat({&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_a, &g.in_proj_b});
      d.gdn_out = upload_concat({&g.out_proj});
      d.gdn.conv_w = upload_floats(g.conv1d);
      d.gdn.A_log = upload_floats(g.A_log);
      d.gdn.dt_bias = upload_floats(g.dt_bias);
      d.gdn.norm_w = upload_floats(g.norm);
    } else {
      const AttentionWeights& a = src.attention;
      d.attn_in = upload_concat({&a.q_proj, &a.k_proj, &a.v_proj});
      d.attn_out = upload_concat({&a.o_proj});
      d.q_norm = upload_floats(a.q_norm);
      d.k_norm = upload_floats(a.k_norm);
    }
    const MoeWeights& m = src.moe;
    d.router = upload_concat({&m.router, &m.shared_expert_gate});
    d.gate = upload_concat({&m.experts_gate_proj, &m.shared_gate_proj});
    d.up = upload_concat({&m.experts_up_proj, &m.shared_up_proj});
    d.down = upload_concat({&m.experts_down_proj, &m.shared_down_proj});
  }
}

}  // namespace lily::cuda
