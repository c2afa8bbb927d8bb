// Synthetic checkpoints (`lily synth`): random-weight qwen3_5_moe models written in exactly the
// MLX layout of the real Qwen3.6-35B-A3B checkpoint (docs/model.md §1.1, §2): config.json
// with text_config, top-level eos_token_id list and quantization block (8-bit overrides for every
// mlp.gate and mlp.shared_expert_gate, duplicated as quantization_config); the tensors of
// tensor_table(config), random floats quantized with the MLX affine rule (§2.2); single file or
// shards with model.safetensors.index.json.
//
// Determinism: every value is a pure function of (seed, tensor name, chunk index), drawn from an
// integer PRNG (xoshiro256**, seeded by splitmix64) with normals approximated by a sum of four
// 16-bit uniforms and no libm calls, and chunks are fixed by the shape alone. The bytes written
// are therefore identical for any --threads and, with IEEE binary32 arithmetic without FMA
// contraction (the default on x86-64), on any machine.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace lily {

/// A built-in synthetic shape: the config.json it writes and its default sharding.
struct SynthPreset {
  std::string name;
  std::string description;
  nlohmann::ordered_json config;       ///< the whole config.json document (MLX layout)
  uint64_t default_shard_bytes = 0;    ///< 0 = one model.safetensors
};

/// Names of the built-in presets: tiny, realdims, long, 35b-a3b.
std::vector<std::string> synth_preset_names();

/// The preset called `name`. Throws lily::Error listing the known names otherwise.
SynthPreset synth_preset(std::string_view name);

/// What `lily synth` writes.
struct SynthOptions {
  std::string preset = "tiny";
  uint64_t seed = 0;
  std::filesystem::path out;        ///< created if missing; old weight files in it are replaced
  std::filesystem::path tokenizer;  ///< optional tokenizer.json to copy (with its directory's
                                    ///< tokenizer_config.json / chat_template.jinja if present)
  double shard_mb = -1;             ///< max shard size in MB (10^6 bytes); 0 = single file; < 0 = preset default
  int threads = 0;                  ///< generation threads; <= 0 = all hardware threads
};

/// What was written.
struct SynthResult {
  ModelConfig config;
  std::vector<std::string> files;  ///< safetensors file names in `out`
  uint64_t total_bytes = 0;        ///< bytes of all safetensors files
  int threads = 0;                 ///< threads actually used
  double seconds = 0;              ///< wall time of the whole write
};

/// Writes a random-weight checkpoint (config.json, safetensors, optional tokenizer files) into
/// options.out. Throws lily::Error for an unknown preset, an unreadable or too-large tokenizer
/// (an id ≥ the preset's vocab), or an I/O failure; a failed write leaves no partial
/// safetensors file behind.
SynthResult write_synthetic_checkpoint(const SynthOptions& options);

/// MLX affine quantization of one group of 64 fp32 weights (docs/model.md §2.2, the rule of the demo
/// recipe's mlx_format.py): scale = (max − min)/(2^bits − 1) (1e-8 when max == min),
/// bias = min, both rounded to bf16; q = clip(round_half_even((w − bias)/scale), 0, 2^bits − 1)
/// with the rounded scale/bias; packed 32/bits codes per u32, lowest element in the lowest bits.
/// `packed` receives 64·bits/32 words. bits must be 4 or 8.
void quantize_group_affine(const float* w, int bits, uint32_t* packed, uint16_t* scale_bf16,
                           uint16_t* bias_bf16);

}  // namespace lily
