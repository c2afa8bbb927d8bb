// QuantMatrix accessors: MLX affine dequantization (docs/model.md §2.2).
#include "model/weights.h"

#include "base/bf16.h"
#include "base/error.h"
#include "io/checkpoint.h"

namespace lily {

QuantMatrix QuantMatrix::row_block(int64_t first, int64_t count) const {
  LILY_CHECK(first >= 0 && count >= 0 && first + count <= rows);
  QuantMatrix block = *this;
  block.codes = codes + first * words_per_row();
  block.scales = scales + first * groups_per_row();
  block.biases = biases + first * groups_per_row();
  block.rows = count;
  return block;
}

uint32_t QuantMatrix::code(int64_t r, int64_t c) const {
  const int per_word = 32 / bits;
  const uint32_t word = codes[r * words_per_row() + c / per_word];
  const uint32_t mask = (1u << bits) - 1u;
  return (word >> (bits * (c % per_word))) & mask;
}

float QuantMatrix::weight(int64_t r, int64_t c) const {
  const int64_t g = r * groups_per_row() + c / group_size;
  return bf16_to_float(scales[g]) * static_cast<float>(code(r, c)) + bf16_to_float(biases[g]);
}

std::optional<std::string> weights_changed_on_disk(const ModelWeights& weights) {
  if (!weights.storage) return std::nullopt;
  return weights.storage->changed_on_disk();
}

}  // namespace lily
