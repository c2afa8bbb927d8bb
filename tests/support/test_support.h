// Shared helpers for the GoogleTest suites: repository paths, temporary directories, closeness.
#pragma once
#include <filesystem>
#include <span>
#include <string>

namespace lily::test {

/// Repository root (compile-time LILY_SOURCE_DIR).
std::filesystem::path source_dir();
/// Build directory (compile-time LILY_BINARY_DIR); holds the `lily` executable.
std::filesystem::path binary_dir();
/// The committed demo model (models/demo).
std::filesystem::path demo_model_dir();
/// A fresh empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
 private:
  std::filesystem::path path_;
};
/// Result of running the built `lily` executable.
struct CliRun {
  int exit_code = -1;   ///< -1 if it could not be started or did not exit normally
  std::string output;   ///< stdout, or stdout + stderr when merged
};
/// Runs `<build>/lily <args>` through the shell (args are pasted verbatim: quote paths);
/// stderr is merged into the output or discarded.
CliRun run_lily(const std::string& args, bool merge_stderr);
/// As run_lily, under coreutils `timeout`: a run still going after `seconds` is killed and gets
/// exit code 124 (or 137), so a command that would hang fails the test instead of stalling it.
CliRun run_lily_bounded(const std::string& args, bool merge_stderr, int seconds = 30);
/// Max |a-b| / max(|b|, floor) over the two spans (same length required).
double max_relative_error(std::span<const float> a, std::span<const float> b, double floor = 1e-6);
/// Cosine similarity of two equal-length vectors.
double cosine_similarity(std::span<const float> a, std::span<const float> b);

}  // namespace lily::test
