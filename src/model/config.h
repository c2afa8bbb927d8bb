// ModelConfig: the qwen3_5_moe text-model hyper-parameters, parsed from a checkpoint's
// config.json and validated family-strictly (docs/model.md §1). Free of JSON types: parsing an
// in-memory document is model/config_json.h's parse_model_config. Dimension names follow
// one glossary: hidden, vocab, n_layers, n_heads / n_kv_heads / head_dim (gated attention),
// gdn_* (Gated DeltaNet), n_experts / n_experts_per_tok / moe_ffn_dim / shared_ffn_dim (MoE).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace lily {

/// Longest sequence (tokens) any backend creates a state for: Qwen3.6-35B-A3B's 262,144-token
/// context. Also the context assumed for a checkpoint that declares no max_position_embeddings.
inline constexpr int64_t kMaxContext = 262144;

/// The context (tokens) of a checkpoint that declares `declared` positions
/// (max_position_embeddings; 0 = none declared): `declared`, else kMaxContext.
inline int64_t context_or_default(int64_t declared) { return declared > 0 ? declared : kMaxContext; }

/// Mixer kind of one decoder layer.
enum class LayerType { kLinearAttention, kFullAttention };

/// Elements per MLX affine (scale, bias) group along a quantized weight's input dim: the only
/// group size lily.cpp reads or writes (docs/model.md §2.2; the CUDA kernels' kGroup).
inline constexpr int kQuantGroupSize = 64;

/// The one kind of checkpoint lily loads, as error messages name it: "an MLX affine 4-bit,
/// group-size-64 checkpoint" (the group size from kQuantGroupSize).
std::string supported_checkpoint_kind();

/// MLX affine quantization settings declared in config.json's `quantization` block.
struct QuantizationConfig {
  int bits = 4;                       ///< default bit width (must be 4)
  int group_size = kQuantGroupSize;   ///< elements per (scale, bias) group along the input dim (must be 64)
  /// Module paths overridden to 8 bits (must end in `mlp.gate` or `mlp.shared_expert_gate`).
  std::vector<std::string> eight_bit_modules;
};

/// The Qwen3.6-35B-A3B shape, the "must be" values of docs/model.md §1.1: what
/// ModelConfig::is_qwen36_35b_a3b recognises and `lily synth --preset 35b-a3b` writes.
struct Qwen36Shape {
  static constexpr const char* kName = "Qwen3.6-35B-A3B";  ///< the model's published name
  int vocab = 248320;
  int hidden = 2048;
  int n_layers = 40;
  int full_attention_interval = 4;
  int n_heads = 16;
  int n_kv_heads = 2;
  int head_dim = 256;
  int gdn_n_key_heads = 16;
  int gdn_n_value_heads = 32;
  int gdn_key_head_dim = 128;
  int gdn_value_head_dim = 128;
  int gdn_conv_kernel = 4;
  int n_experts = 256;
  int n_experts_per_tok = 8;
  int moe_ffn_dim = 512;
  int shared_ffn_dim = 512;
};

/// The one Qwen3.6-35B-A3B shape.
inline constexpr Qwen36Shape kQwen36Shape{};

/// Hyper-parameters of a qwen3_5_moe text model (docs/model.md §1.1, §1.3).
struct ModelConfig {
  int vocab = 0;     ///< rows of embed_tokens / lm_head
  int hidden = 0;    ///< residual width H
  int n_layers = 0;  ///< decoder layers
  std::vector<LayerType> layer_types;  ///< [n_layers]
  int full_attention_interval = 4;     ///< every interval-th layer (i % interval == interval-1) is full attention

  // Gated full attention.
  int n_heads = 0;        ///< query heads
  int n_kv_heads = 0;     ///< key/value heads (GQA)
  int head_dim = 0;       ///< per-head dim D
  int rotary_dim = 0;     ///< leading dims of each head rotated by RoPE = trunc(head_dim * partial_rotary_factor)
  double rope_theta = 0;  ///< RoPE base θ

  // Gated DeltaNet (linear attention).
  int gdn_n_key_heads = 0;    ///< Hk
  int gdn_n_value_heads = 0;  ///< Hv (a multiple of Hk)
  int gdn_key_head_dim = 0;   ///< Dk
  int gdn_value_head_dim = 0; ///< Dv
  int gdn_conv_kernel = 0;    ///< causal depthwise conv width K

  // Mixture of experts.
  int n_experts = 0;          ///< E
  int n_experts_per_tok = 0;  ///< top-k
  int moe_ffn_dim = 0;        ///< expert intermediate size I
  int shared_ffn_dim = 0;     ///< shared expert intermediate size
  bool norm_topk_prob = true; ///< renormalise the top-k routing weights (must be true)

  float rms_norm_eps = 1e-6f;
  int max_position_embeddings = 0;  ///< 0 = unspecified; otherwise at least 2 (parse refuses 1)
  std::vector<int32_t> eos_token_ids;  ///< top-level eos_token_id overrides text_config's
  QuantizationConfig quantization;

  // Derived sizes.
  int gdn_key_dim() const { return gdn_n_key_heads * gdn_key_head_dim; }
  int gdn_value_dim() const { return gdn_n_value_heads * gdn_value_head_dim; }
  /// Conv channels C = 2·key_dim + value_dim (q ‖ k ‖ v).
  int gdn_conv_channels() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  int n_full_attention_layers() const;
  int n_linear_attention_layers() const;
  bool is_full_attention(int layer) const { return layer_types[layer] == LayerType::kFullAttention; }
  /// The context (tokens) this checkpoint allows: context_or_default(max_position_embeddings).
  int64_t context_length() const { return context_or_default(max_position_embeddings); }

  /// True for exactly the Qwen3.6-35B-A3B shape (H 2048, 40 layers, 256 experts, …).
  bool is_qwen36_35b_a3b() const;
  /// "Qwen3.6-35B-A3B" when recognised, else a descriptive name such as "qwen3_5_moe (H=256, L=8, E=16)".
  std::string shape_name() const;
  /// Total parameter count (logical, unquantized), counting embeddings and lm_head.
  int64_t parameter_count() const;
};

/// Reads `dir/config.json` and validates it as parse_model_config (model/config_json.h) does.
/// Throws CheckpointError.
ModelConfig load_model_config(const std::filesystem::path& dir);

}  // namespace lily
