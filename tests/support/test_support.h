// Shared helpers for the GoogleTest suites: repository paths, temporary directories, closeness.
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"

// LILY_TEST_SANITIZED: 1 when compiled with AddressSanitizer (the -DLILY_SANITIZE=ON build of
// scripts/test.sh, and the fuzz build), read from the compiler's own macro (gcc) or feature
// test (clang), else 0.
#if defined(__SANITIZE_ADDRESS__)
#define LILY_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LILY_TEST_SANITIZED 1
#endif
#endif
#ifndef LILY_TEST_SANITIZED
#define LILY_TEST_SANITIZED 0
#endif

namespace lily::test {

/// True in a sanitizer build: tests that check one property over many cases run fewer of the
/// cases there (never none, and the same assertions), and timing printouts are left out.
inline constexpr bool kSanitized = LILY_TEST_SANITIZED != 0;

/// Repository root (compile-time LILY_SOURCE_DIR).
std::filesystem::path source_dir();
/// Build directory (compile-time LILY_BINARY_DIR); holds the `lily` executable.
std::filesystem::path binary_dir();
/// The committed demo model (models/demo).
std::filesystem::path demo_model_dir();
/// The ModelConfig of `lily synth`'s preset `name` ("35b-a3b", "realdims", …), parsed as a
/// checkpoint's config.json is. Throws lily::Error for an unknown name.
ModelConfig synth_preset_config(const std::string& name);
/// A fresh empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
 private:
  std::filesystem::path path_;
};
/// Writes a string to a file (binary); throws std::runtime_error when it cannot.
void write_file(const std::filesystem::path& path, const std::string& bytes);
/// Copies every regular file of `from` into `to` (created if needed); not recursive.
void copy_dir(const std::filesystem::path& from, const std::filesystem::path& to);
/// A copy of the demo model in `tmp` (at tmp/m), for tests that change or break its files.
std::filesystem::path copy_demo_model(const TempDir& tmp);
/// How many mappings of `file` the process holds: the lines of /proc/self/maps that end with its
/// path (pass the canonical path, as the kernel writes it).
int mappings_of(const std::filesystem::path& file);
/// A path in single quotes, for the command lines run_lily pastes into the shell.
inline std::string quoted(const std::filesystem::path& p) { return "'" + p.string() + "'"; }
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
/// As run_lily_bounded, with lily's stdout sent to `stdout_path` (e.g. /dev/full); the output is
/// its stderr alone.
CliRun run_lily_stdout_to(const std::string& args, const std::string& stdout_path, int seconds = 30);
/// A deterministic in-vocabulary prompt of n ids: id i = (((i + salt)·2654435761) mod 2^32) mod
/// vocab. Salt 0 is the `lily bench` prompt (docs/benchmark.md §1.1); other salts give other
/// prompts of the same spread.
inline std::vector<int32_t> hash_prompt(int n, int vocab, uint64_t salt = 0) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] =
        static_cast<int32_t>(((uint64_t(i) + salt) * 2654435761ull % 4294967296ull) % uint64_t(vocab));
  return ids;
}
/// Demo-model ids below this are ordinary tokens (its five special tokens are 8187 … 8191):
/// hash_prompt(n, kDemoOrdinaryIds, salt) is a demo prompt without special tokens.
inline constexpr int kDemoOrdinaryIds = 8000;
/// Cosine similarity of two equal-length vectors.
double cosine_similarity(std::span<const float> a, std::span<const float> b);

}  // namespace lily::test
