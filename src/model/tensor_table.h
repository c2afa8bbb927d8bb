// The tensor table: the single list of tensors a ModelConfig implies, in the MLX layout
// (docs/model.md §2.3). The loader validates a checkpoint against it, `lily synth` writes
// it, `lily inspect` and byte accounting iterate it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace lily {

/// Storage kind of one table entry.
enum class TensorKind {
  kQuantized,  ///< an MLX affine triple <base>.weight (U32) / .scales / .biases (BF16)
  kBf16,       ///< a plain BF16 tensor (norm gains, conv1d, dt_bias; linear_attn.norm.weight may also be F32)
  kFloat,      ///< F32 expected, BF16 also accepted (A_log)
};

/// One logical tensor. For kQuantized, `name` is the base name (without .weight) and `shape` is
/// the logical [.., out, in] shape (3-D for stacked experts); the stored shapes follow from `bits`.
struct TensorSpec {
  std::string name;
  TensorKind kind;
  std::vector<int64_t> shape;
  int bits = 0;  ///< 4 or 8 for kQuantized, else 0
  int layer = -1;  ///< decoder layer index, -1 for embed/lm_head/final norm
};

/// All tensors of the model described by `config`, in a stable order (embed, layers, norm, head).
std::vector<TensorSpec> tensor_table(const ModelConfig& config);

/// Stored shape of the U32 codes of a quantized spec: [.., out, in·bits/32].
std::vector<int64_t> packed_codes_shape(const TensorSpec& spec);
/// Stored shape of the BF16 scales/biases of a quantized spec: [.., out, in/64].
std::vector<int64_t> group_params_shape(const TensorSpec& spec, int group_size = 64);
/// Bytes the spec occupies on disk (codes + scales + biases, or the plain tensor as BF16/F32).
int64_t stored_bytes(const TensorSpec& spec, int group_size = 64);

}  // namespace lily
