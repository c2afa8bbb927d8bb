// Loads and validates a checkpoint directory into ModelWeights (reference/model.md §2):
// config.json, model.safetensors or model.safetensors.index.json + shards, memory-mapped.
#pragma once
#include <filesystem>
#include <memory>

#include "model/weights.h"

namespace lily {

struct LoadOptions {
  bool show_progress = false;  ///< progress on stderr when it is a terminal
  bool check_finite = true;    ///< reject NaN/Inf in scales, biases and norm weights
};

/// Loads `dir`. Everything in the tensor table must be present with the exact dtype/shape/bit
/// width; nothing may be left over except vision_tower.* and mtp.* (counted). Throws
/// CheckpointError with one line that names what was found (GGUF file, AWQ/GPTQ, unquantized,
/// fp8, group size, model_type, missing/extra/mis-shaped tensor, NaN scale, …); nothing is
/// half-loaded.
std::shared_ptr<const ModelWeights> load_model(const std::filesystem::path& dir,
                                               const LoadOptions& options = {});

}  // namespace lily
