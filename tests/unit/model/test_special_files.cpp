// A FIFO (or another non-regular file) given as config.json, model.safetensors, a shard index or
// tokenizer.json would hang `lily inspect`, `generate`, `tokenize` and `serve` in a plain
// open(2) (no writer ever comes). Each must exit 1 at once with an error naming the file. The
// runs are bounded by `timeout`, so a hang fails the test (exit 124) instead of stalling it.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "support/test_support.h"

namespace lily {
namespace {

namespace fs = std::filesystem;

using test::quoted;

/// A copy of models/demo in which `name` is replaced by a FIFO.
fs::path demo_with_fifo(const test::TempDir& tmp, const std::string& name) {
  const fs::path dir = test::copy_demo_model(tmp);
  fs::remove(dir / name);
  EXPECT_EQ(::mkfifo((dir / name).c_str(), 0600), 0);
  return dir;
}

void expect_refused(const test::CliRun& r, const fs::path& fifo, const std::string& what) {
  EXPECT_EQ(r.exit_code, 1) << what << " (124 = it hung)\n" << r.output;
  EXPECT_NE(r.output.find(fifo.string() + ": is a FIFO (named pipe), not a regular file"), std::string::npos)
      << what << "\n" << r.output;
}

/// Expects `lily inspect` to refuse a demo model whose `name` is a FIFO, without hanging.
void expect_inspect_refuses_fifo(const std::string& name) {
  test::TempDir tmp;
  const fs::path dir = demo_with_fifo(tmp, name);
  expect_refused(test::run_lily_bounded("inspect " + quoted(dir), true), dir / name, "inspect");
}

TEST(SpecialFiles, InspectRefusesAFifoConfig) { expect_inspect_refuses_fifo("config.json"); }

TEST(SpecialFiles, InspectRefusesAFifoSafetensors) { expect_inspect_refuses_fifo("model.safetensors"); }

TEST(SpecialFiles, InspectRefusesAFifoShardIndex) { expect_inspect_refuses_fifo("model.safetensors.index.json"); }

// inspect loads the tokenizer as serve does (CliInputs.InspectRefusesAMissingOrGarbageTokenizer…).
TEST(SpecialFiles, InspectRefusesAFifoTokenizer) { expect_inspect_refuses_fifo("tokenizer.json"); }

TEST(SpecialFiles, TokenizeAndGenerateRefuseAFifoTokenizer) {
  test::TempDir tmp;
  const fs::path dir = demo_with_fifo(tmp, "tokenizer.json");
  expect_refused(test::run_lily_bounded("tokenize --model " + quoted(dir) + " hello", true), dir / "tokenizer.json",
                 "tokenize");
  expect_refused(test::run_lily_bounded("generate --backend cpu --max-tokens 1 --prompt hi --model " + quoted(dir), true),
                 dir / "tokenizer.json", "generate");
}

TEST(SpecialFiles, ServeRefusesFifoCheckpointFiles) {
  for (const std::string name : {"config.json", "model.safetensors", "tokenizer.json"}) {
    test::TempDir tmp;
    const fs::path dir = demo_with_fifo(tmp, name);
    expect_refused(test::run_lily_bounded("serve --backend cpu --bind 127.0.0.1:0 --model " + quoted(dir), true),
                   dir / name, "serve with a FIFO " + name);
  }
}

}  // namespace
}  // namespace lily
