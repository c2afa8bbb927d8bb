// Weights changed on disk, backend side: the CPU backend reads the memory-mapped checkpoint on every
// step, so it reports a truncated file (Backend::weights_changed) before anything reads it; with
// the weights read into memory (--no-mmap) the same truncation changes nothing and generation
// still gives the tokens it gave before.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "model/loader.h"
#include "support/test_support.h"

namespace lily {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> greedy(cpu::CpuBackend& b, int steps) {
  auto state = b.new_state(16);
  std::vector<int32_t> out{b.prefill(*state, std::vector<int32_t>{1, 2, 3})};
  for (int i = 1; i < steps; ++i) out.push_back(b.decode(*state, out.back()));
  return out;
}

TEST(CpuWeightsOnDisk, MappedBackendReportsATruncatedCheckpoint) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  cpu::CpuBackend backend(load_model(dir, LoadOptions{.mmap = true}), 1);
  greedy(backend, 2);
  EXPECT_EQ(backend.weights_changed(), std::nullopt);
  fs::resize_file(dir / "model.safetensors", 1000);
  const auto why = backend.weights_changed();
  ASSERT_TRUE(why);  // (and nothing may read the weights now: that would be SIGBUS)
  EXPECT_NE(why->find("model.safetensors was truncated"), std::string::npos) << *why;
}

TEST(CpuWeightsOnDisk, InMemoryBackendKeepsWorkingAfterTruncation) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  cpu::CpuBackend backend(load_model(dir, LoadOptions{.mmap = false}), 1);
  const auto before = greedy(backend, 3);
  fs::resize_file(dir / "model.safetensors", 0);
  EXPECT_EQ(backend.weights_changed(), std::nullopt);
  EXPECT_EQ(greedy(backend, 3), before);
}

}  // namespace
}  // namespace lily
