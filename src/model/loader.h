// Loads and validates a checkpoint directory into ModelWeights (docs/model.md §2):
// config.json, model.safetensors or model.safetensors.index.json + shards, memory-mapped.
#pragma once
#include <filesystem>
#include <memory>

#include "model/weights.h"

namespace lily {

/// The process-wide default of LoadOptions::mmap (true until changed). `lily serve --no-mmap`
/// sets it to false before the server loads the model, so every load_model call that does not
/// say otherwise reads the weights into memory. Thread-safe.
void set_default_weights_mmap(bool mmap);
/// The current process-wide default of LoadOptions::mmap.
bool default_weights_mmap();

struct LoadOptions {
  bool show_progress = false;  ///< progress on stderr when it is a terminal
  bool check_finite = true;    ///< reject NaN/Inf in scales, biases and norm weights
  /// true: memory-map the safetensors files (pages load lazily from the page cache, shared with
  /// other processes; truncating or rewriting a file while it is mapped can kill the process
  /// with SIGBUS, see Checkpoint::changed_on_disk). false (`--no-mmap`): read them whole into
  /// private memory at load (resident = the checkpoint's size, the load reads every byte, and
  /// later changes to the files cannot affect the loaded weights).
  bool mmap = default_weights_mmap();
};

/// Loads `dir`. Everything in the tensor table must be present with the exact dtype/shape/bit
/// width; nothing may be left over except vision_tower.* and mtp.* (counted). Throws
/// CheckpointError with one line that names what was found (GGUF file, AWQ/GPTQ, unquantized,
/// fp8, group size, model_type, missing/extra/mis-shaped tensor, NaN scale, …); nothing is
/// half-loaded.
std::shared_ptr<const ModelWeights> load_model(const std::filesystem::path& dir,
                                               const LoadOptions& options = {});

}  // namespace lily
