// Per-layer weight structs: non-owning views into the memory-mapped checkpoint (quantized
// matrices in the MLX layout) plus small fp32 copies of vectors (norms, conv taps, GDN gates).
// Both backends read from these; the CUDA backend uploads them once.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"

namespace lily {

class Checkpoint;  // io/checkpoint.h

/// An MLX affine-quantized matrix W[rows, cols] (docs/model.md §2.2):
/// codes U32 [rows, cols·bits/32] (element c of a row at bits (c mod (32/bits))·bits of word
/// c/(32/bits), lowest element in the lowest bits); scales and biases BF16 [rows, cols/64];
/// w[r,c] = scale[r, c/64]·q[r,c] + bias[r, c/64] in fp32. Stacked experts are flattened:
/// expert e owns rows [e·rows_per_expert, (e+1)·rows_per_expert).
struct QuantMatrix {
  const uint32_t* codes = nullptr;  ///< [rows, cols·bits/32]
  const uint16_t* scales = nullptr; ///< bf16 [rows, cols/group]
  const uint16_t* biases = nullptr; ///< bf16 [rows, cols/group]
  int64_t rows = 0;                 ///< output features (all experts for a stack)
  int64_t cols = 0;                 ///< input features
  int bits = 4;                     ///< 4 or 8
  int group_size = kQuantGroupSize;

  int64_t words_per_row() const { return cols * bits / 32; }
  int64_t groups_per_row() const { return cols / group_size; }
  /// Rows [first, first + count) as a matrix of their own (e.g. one expert of a stack).
  QuantMatrix row_block(int64_t first, int64_t count) const;
  /// Dequantized code q[r, c] (0…2^bits−1).
  uint32_t code(int64_t r, int64_t c) const;
  /// Exact fp32 dequantized weight w[r, c].
  float weight(int64_t r, int64_t c) const;
};

/// Gated DeltaNet mixer weights (docs/model.md §3.3, §2.3).
struct GdnWeights {
  QuantMatrix in_proj_qkv;  ///< [conv_channels, hidden]
  QuantMatrix in_proj_z;    ///< [value_dim, hidden]
  QuantMatrix in_proj_a;    ///< [Hv, hidden]
  QuantMatrix in_proj_b;    ///< [Hv, hidden]
  QuantMatrix out_proj;     ///< [hidden, value_dim]
  std::vector<float> conv1d;   ///< [conv_channels, K] channel-major; tap K-1 multiplies the current token
  std::vector<float> A_log;    ///< [Hv]
  std::vector<float> dt_bias;  ///< [Hv]
  std::vector<float> norm;     ///< [Dv] plain gain of the gated RMSNorm
};

/// Gated full-attention mixer weights (docs/model.md §3.4).
struct AttentionWeights {
  QuantMatrix q_proj;  ///< [n_heads·2·head_dim, hidden]; per head: query then gate
  QuantMatrix k_proj;  ///< [n_kv_heads·head_dim, hidden]
  QuantMatrix v_proj;  ///< [n_kv_heads·head_dim, hidden]
  QuantMatrix o_proj;  ///< [hidden, n_heads·head_dim]
  std::vector<float> q_norm;  ///< [head_dim] gain (stored MLX weight = 1 + w_hf)
  std::vector<float> k_norm;  ///< [head_dim]
};

/// Sparse MoE block weights (docs/model.md §3.5).
struct MoeWeights {
  QuantMatrix router;              ///< mlp.gate, 8-bit [E, hidden]
  QuantMatrix experts_gate_proj;   ///< switch_mlp.gate_proj [E·I, hidden]
  QuantMatrix experts_up_proj;     ///< switch_mlp.up_proj [E·I, hidden]
  QuantMatrix experts_down_proj;   ///< switch_mlp.down_proj [E·hidden, I]
  QuantMatrix shared_gate_proj;    ///< [shared_I, hidden]
  QuantMatrix shared_up_proj;      ///< [shared_I, hidden]
  QuantMatrix shared_down_proj;    ///< [hidden, shared_I]
  QuantMatrix shared_expert_gate;  ///< 8-bit [1, hidden]
};

/// One decoder layer. Exactly one of `gdn` / `attention` is populated, per `type`.
struct LayerWeights {
  LayerType type = LayerType::kLinearAttention;
  std::vector<float> input_layernorm;           ///< [hidden] gain (stored = 1 + w_hf)
  std::vector<float> post_attention_layernorm;  ///< [hidden]
  GdnWeights gdn;
  AttentionWeights attention;
  MoeWeights moe;
};

/// All weights of a loaded checkpoint. Keeps the mapped files alive.
struct ModelWeights {
  ModelConfig config;
  QuantMatrix embed_tokens;        ///< 4-bit [vocab, hidden]
  QuantMatrix lm_head;             ///< 4-bit [vocab, hidden] (untied)
  std::vector<float> final_norm;   ///< [hidden]
  std::vector<LayerWeights> layers;
  std::shared_ptr<const Checkpoint> storage;  ///< owner of the memory the QuantMatrix views point into
  int64_t skipped_tensors = 0;     ///< vision_tower.* / mtp.* tensors present and ignored
};

/// Why the memory-mapped checkpoint behind `weights` can no longer be trusted (a safetensors
/// file truncated, modified, replaced or removed since the load; see
/// Checkpoint::changed_on_disk), or nullopt: unchanged, read into memory (--no-mmap), or no
/// storage. One stat(2) per file; never reads the weights, so it cannot fault. Thread-safe.
std::optional<std::string> weights_changed_on_disk(const ModelWeights& weights);

}  // namespace lily
