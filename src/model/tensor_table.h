// The tensor table: the one description of the tensors a ModelConfig implies, in the MLX layout
// (docs/model.md §2.3), each with its role and the field of ModelWeights it lands in.
// for_each_tensor is that description; the loader fills ModelWeights by walking it, the CUDA
// upload and `lily inspect` walk the loaded weights (the const overload) by role, and
// tensor_table (its specs without destinations) is what `lily synth` writes and byte accounting
// iterates.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace lily {

/// Storage kind of one table entry.
enum class TensorKind {
  kQuantized,  ///< an MLX affine triple <base>.weight (U32) / .scales / .biases (BF16)
  kBf16,       ///< a plain BF16 tensor (norm gains, conv1d, dt_bias); F32 too where f32_accepted
  kFloat,      ///< F32 expected, BF16 also accepted (A_log)
};

/// What a tensor is for, whatever its name: consumers that treat tensors alike by purpose (synth's
/// initialisation, the CUDA upload's fused matrices) decide by role, so a new tensor of an
/// existing role needs no change outside the table. Where several tensors of a layer share a
/// role (the parts of a fused projection), the table's order is their order.
enum class TensorRole {
  kEmbedding,          ///< embed_tokens
  kOutputHead,         ///< lm_head
  kFinalNorm,          ///< the final RMSNorm gain (stored = 1 + w)
  kInputNorm,          ///< a layer's input RMSNorm gain (stored = 1 + w)
  kPostAttentionNorm,  ///< a layer's post-mixer RMSNorm gain (stored = 1 + w)
  kGdnInProj,          ///< a part of the GDN input projection: qkv, z, a, b in table order
  kGdnConv,            ///< GDN causal conv1d taps
  kGdnALog,            ///< GDN A_log (log of the decay rate)
  kGdnDtBias,          ///< GDN dt_bias
  kGdnNorm,            ///< GDN gated-RMSNorm gain (a plain gain)
  kGdnOutProj,         ///< GDN out_proj
  kAttnInProj,         ///< a part of the attention input projection: q (with gate), k, v in table order
  kAttnQNorm,          ///< attention per-head query RMSNorm gain (stored = 1 + w)
  kAttnKNorm,          ///< attention per-head key RMSNorm gain (stored = 1 + w)
  kAttnOutProj,        ///< attention o_proj
  kRouter,             ///< mlp.gate, the router's logits
  kSharedExpertGate,   ///< mlp.shared_expert_gate, the shared expert's sigmoid gate
  kExpertsGateProj,    ///< the routed experts' stacked gate_proj
  kExpertsUpProj,      ///< the routed experts' stacked up_proj
  kExpertsDownProj,    ///< the routed experts' stacked down_proj
  kSharedGateProj,     ///< the shared expert's gate_proj
  kSharedUpProj,       ///< the shared expert's up_proj
  kSharedDownProj,     ///< the shared expert's down_proj
};

/// The role's name: its enumerator in snake case without the k ("gdn_in_proj" for kGdnInProj),
/// distinct per role; what `lily inspect` groups tensors under.
const char* role_name(TensorRole role);

/// The modules the checkpoint stores with 8-bit codes, by the end of their name (each layer's
/// router and shared-expert gate); every other quantized tensor has 4-bit codes. The one list:
/// the table takes each quantized spec's bits from it (quantized_bits), config.json's
/// quantization block may override exactly these modules (model/config.cpp), and `lily synth`
/// writes those overrides.
inline constexpr std::array<std::string_view, 2> kEightBitModules = {"mlp.gate", "mlp.shared_expert_gate"};

/// True when `path` (a tensor's base name, or a module path of config.json's quantization block)
/// is one of kEightBitModules: equal to it, or ending with "." and it.
bool is_eight_bit_module(std::string_view path);

/// Code bits of the quantized tensor `name` (a base name): 8 for kEightBitModules, else 4.
int quantized_bits(std::string_view name);

/// One logical tensor. For kQuantized, `name` is the base name (without .weight) and `shape` is
/// the logical [.., out, in] shape (3-D for stacked experts); the stored shapes follow from `bits`.
struct TensorSpec {
  std::string name;            ///< safetensors name (the base name for kQuantized)
  TensorKind kind;             ///< storage kind; decides the TensorDest alternative
  TensorRole role;             ///< what the tensor is for
  std::vector<int64_t> shape;  ///< logical shape, e.g. [E, I, hidden] for an expert stack
  int bits = 0;  ///< 4 or 8 for kQuantized, else 0
  int layer = -1;  ///< decoder layer index, -1 for embed/lm_head/final norm
  bool f32_accepted = false;  ///< kBf16 only: an F32 tensor is accepted too (linear_attn.norm.weight)
  /// Plain specs: a second stored shape accepted for the same row-major data, empty if none
  /// (conv1d.weight: [C, 1, K] besides [C, K, 1]).
  std::vector<int64_t> alt_shape;
};

/// The stored names of a quantized spec's MLX affine triple (TensorKind::kQuantized).
struct QuantizedNames {
  std::string weight;  ///< <base>.weight, the U32 codes
  std::string scales;  ///< <base>.scales, BF16, one per group
  std::string biases;  ///< <base>.biases, BF16, one per group
};

/// The triple's names for the base name `base` (a kQuantized TensorSpec::name).
inline QuantizedNames quantized_names(const std::string& base) {
  return {base + ".weight", base + ".scales", base + ".biases"};
}

/// Where a spec lands in ModelWeights: the QuantMatrix view of a kQuantized spec, or the fp32
/// vector (row-major, numel(shape) floats) of a kBf16/kFloat spec. Never null.
using TensorDest = std::variant<QuantMatrix*, std::vector<float>*>;

/// Called once per tensor with its spec and its destination inside the walked ModelWeights.
using TensorVisitor = std::function<void(const TensorSpec& spec, TensorDest dest)>;

/// TensorDest of a const walk: the field a spec was loaded into, read-only.
using ConstTensorDest = std::variant<const QuantMatrix*, const std::vector<float>*>;

/// Called once per tensor of a const walk with its spec and the field holding it.
using ConstTensorVisitor = std::function<void(const TensorSpec& spec, ConstTensorDest dest)>;

/// The description itself: calls `visit` once for every tensor of the model described by
/// `config`, in the stable order of tensor_table, with a pointer to the field of `weights` the
/// tensor fills (a distinct field per spec; kQuantized specs get a QuantMatrix*, the others a
/// std::vector<float>*). First makes `weights.layers` config.n_layers entries with the types of
/// config.layer_types (entries already there keep their contents); touches nothing else, in
/// particular not `weights.config`. Exceptions from `visit` propagate, leaving the fields visited
/// so far as `visit` left them. Throws InternalError when config.layer_types does not have
/// config.n_layers entries.
void for_each_tensor(const ModelConfig& config, ModelWeights& weights, const TensorVisitor& visit);

/// The same description over weights already filled (by the loader): calls `visit` once for
/// every tensor of the model described by `weights.config`, in the same order and with the same
/// fields as the walk above, read-only. Throws InternalError when `weights.layers` does not match
/// config.layer_types (count or types).
void for_each_tensor(const ModelWeights& weights, const ConstTensorVisitor& visit);

/// All tensors of the model described by `config`, in a stable order (embed, layers, norm, head):
/// the specs for_each_tensor visits, without their destinations. Throws InternalError as
/// for_each_tensor does.
std::vector<TensorSpec> tensor_table(const ModelConfig& config);

/// The checkpoint-name prefix of decoder layer `layer`: "language_model.model.layers.<layer>.".
std::string layer_prefix(int layer);

/// Elements of a shape (the product of its dimensions; 1 for []). For a spec's logical shape,
/// its parameter count.
int64_t shape_numel(const std::vector<int64_t>& shape);
/// Stored shape of the U32 codes of a quantized spec: [.., out, in·bits/32].
std::vector<int64_t> packed_codes_shape(const TensorSpec& spec);
/// Stored shape of the BF16 scales/biases of a quantized spec: [.., out, in/group_size].
std::vector<int64_t> group_params_shape(const TensorSpec& spec, int group_size = kQuantGroupSize);
/// Bytes the spec occupies on disk (codes + scales + biases, or the plain tensor as BF16/F32).
int64_t stored_bytes(const TensorSpec& spec, int group_size = kQuantGroupSize);

}  // namespace lily
