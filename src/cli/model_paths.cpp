#include "cli/model_paths.h"

#include <system_error>

#include "base/error.h"

namespace lily {

std::optional<std::filesystem::path> find_default_model_dir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return std::nullopt;
  auto dir = exe.parent_path();
  for (int up = 0; up < 4 && !dir.empty(); ++up) {
    auto candidate = dir / "models" / "demo";
    if (std::filesystem::exists(candidate / "config.json", ec)) return candidate;
    if (dir == dir.parent_path()) break;
    dir = dir.parent_path();
  }
  return std::nullopt;
}

std::filesystem::path model_dir_or_default(const std::filesystem::path& given) {
  if (!given.empty()) return given;
  if (auto found = find_default_model_dir()) return *found;
  throw Error("--model DIR is required (no models/demo next to the lily executable)");
}

}  // namespace lily
