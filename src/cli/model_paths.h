// Where the CLI finds a model when --model is not given (command-line only: its error names the
// flag, so it lives here rather than in the engine).
#pragma once
#include <filesystem>
#include <optional>

namespace lily {

/// The committed demo model: `models/demo` (holding config.json) in the directory of the
/// running `lily` executable or one of its three parents (so `build/lily` finds the repository's
/// models/demo). nullopt when there is none.
std::optional<std::filesystem::path> find_default_model_dir();

/// `given` when non-empty; otherwise find_default_model_dir(). Throws lily::Error naming the
/// flag when neither exists.
std::filesystem::path model_dir_or_default(const std::filesystem::path& given);

}  // namespace lily
