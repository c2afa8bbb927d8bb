// Upload of ModelWeights into the device layout described in device_model.h: one read-only walk
// of the tensor description (for_each_tensor), each tensor placed by its role (slot_of).
#include "backends/cuda/device_model.h"

#include <algorithm>
#include <string>
#include <utility>
#include <variant>

#include "base/error.h"
#include "model/tensor_table.h"

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

/// Where a tensor goes on the device: a part of a fused matrix (parts concatenated in table
/// order) for a quantized tensor, or an fp32 vector. Exactly one is set.
struct DeviceSlot {
  DeviceQuant* matrix = nullptr;
  const float** vector = nullptr;
};

/// The device layout of device_model.h, role by role. `layer` is the tensor's layer (null for
/// the embedding, the head and the final norm). The fused matrices follow from the table's order:
/// GDN qkv|z|a|b, attention q|k|v, router then shared-expert gate, and each expert stack then the
/// shared expert's projection (so the shared expert is expert n_experts).
DeviceSlot slot_of(TensorRole role, DeviceModel& model, DeviceLayer* layer) {
  using R = TensorRole;
  auto per_layer = [&] {
    LILY_CHECK(layer != nullptr);
    return layer;
  };
  switch (role) {
    case R::kEmbedding: return {&model.embed, nullptr};
    case R::kOutputHead: return {&model.lm_head, nullptr};
    case R::kFinalNorm: return {nullptr, &model.final_norm};
    case R::kInputNorm: return {nullptr, &per_layer()->input_norm};
    case R::kPostAttentionNorm: return {nullptr, &per_layer()->post_norm};
    case R::kGdnInProj: return {&per_layer()->in_proj, nullptr};
    case R::kGdnConv: return {nullptr, &per_layer()->gdn.conv_w};
    case R::kGdnALog: return {nullptr, &per_layer()->gdn.A_log};
    case R::kGdnDtBias: return {nullptr, &per_layer()->gdn.dt_bias};
    case R::kGdnNorm: return {nullptr, &per_layer()->gdn.norm_w};
    case R::kGdnOutProj: return {&per_layer()->out_proj, nullptr};
    case R::kAttnInProj: return {&per_layer()->in_proj, nullptr};
    case R::kAttnQNorm: return {nullptr, &per_layer()->q_norm};
    case R::kAttnKNorm: return {nullptr, &per_layer()->k_norm};
    case R::kAttnOutProj: return {&per_layer()->out_proj, nullptr};
    case R::kRouter:
    case R::kSharedExpertGate: return {&per_layer()->router, nullptr};
    case R::kExpertsGateProj:
    case R::kSharedGateProj: return {&per_layer()->gate, nullptr};
    case R::kExpertsUpProj:
    case R::kSharedUpProj: return {&per_layer()->up, nullptr};
    case R::kExpertsDownProj:
    case R::kSharedDownProj: return {&per_layer()->down, nullptr};
  }
  throw ::lily::InternalError("CUDA upload: no device slot for tensor role " + std::to_string(static_cast<int>(role)));
}

}  // namespace

int64_t DeviceModel::required_bytes(const ModelWeights& w) {
  int64_t total = 0;
  for_each_tensor(w, [&](const TensorSpec&, ConstTensorDest src) {
    if (const auto* q = std::get_if<const QuantMatrix*>(&src)) total += quant_bytes(**q);
    else total += 4 * static_cast<int64_t>(std::get<const std::vector<float>*>(src)->size());
  });
  return total;
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

  layers.resize(w.layers.size());
  for (size_t i = 0; i < w.layers.size(); ++i) layers[i].type = w.layers[i].type;
  // Vectors are uploaded as the walk meets them; a fused matrix once all its parts are known,
  // in the order the walk first meets it.
  std::vector<std::pair<DeviceQuant*, std::vector<const QuantMatrix*>>> matrices;
  for_each_tensor(w, [&](const TensorSpec& spec, ConstTensorDest src) {
    DeviceLayer* layer = spec.layer >= 0 ? &layers[static_cast<size_t>(spec.layer)] : nullptr;
    const DeviceSlot slot = slot_of(spec.role, *this, layer);
    if (const auto* q = std::get_if<const QuantMatrix*>(&src)) {
      LILY_CHECK(slot.matrix != nullptr);
      auto it = std::find_if(matrices.begin(), matrices.end(), [&](const auto& m) { return m.first == slot.matrix; });
      if (it == matrices.end()) it = matrices.insert(matrices.end(), {slot.matrix, {}});
      it->second.push_back(*q);
    } else {
      LILY_CHECK(slot.vector != nullptr);
      *slot.vector = upload_floats(*std::get<const std::vector<float>*>(src));
    }
  });
  for (const auto& [matrix, parts] : matrices) *matrix = upload_concat(parts);
}

}  // namespace lily::cuda
