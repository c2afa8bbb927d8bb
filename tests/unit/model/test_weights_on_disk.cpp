// Weights changed on disk, checkpoint side: a memory-mapped safetensors file that is truncated,
// rewritten, replaced or removed after loading is reported by Checkpoint::changed_on_disk (one
// stat(2), never touching the mapped pages), and a checkpoint read with mmap off holds its own
// copy that such changes cannot affect.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/file_util.h"
#include "io/checkpoint.h"
#include "model/loader.h"
#include "support/test_support.h"

namespace lily {
namespace {

namespace fs = std::filesystem;

TEST(WeightsOnDisk, UnchangedFileIsNotReported) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  Checkpoint ckpt(dir);
  EXPECT_TRUE(ckpt.mapped());
  EXPECT_EQ(ckpt.changed_on_disk(), std::nullopt);
}

TEST(WeightsOnDisk, TruncationIsReportedWithBothSizes) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path file = dir / "model.safetensors";
  const auto size = fs::file_size(file);
  Checkpoint ckpt(dir);
  fs::resize_file(file, 4096);
  const auto why = ckpt.changed_on_disk();
  ASSERT_TRUE(why);
  EXPECT_EQ(*why, file.string() + " was truncated from " + std::to_string(size) + " to 4096 bytes");
}

TEST(WeightsOnDisk, InPlaceRewriteOfTheSameSizeIsReported) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path file = dir / "model.safetensors";
  Checkpoint ckpt(dir);
  // Same inode, same size, other bytes (and a later mtime, set explicitly so that a coarse
  // file-system clock cannot hide the write).
  {
    std::fstream out(file, std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(-16, std::ios::end);
    out.write("0123456789abcdef", 16);
  }
  fs::last_write_time(file, fs::last_write_time(file) + std::chrono::seconds(5));
  EXPECT_EQ(fs::file_size(file), ckpt.bytes_on_disk());
  const auto why = ckpt.changed_on_disk();
  ASSERT_TRUE(why);
  EXPECT_EQ(*why, file.string() + " was modified (its mtime changed)");
}

TEST(WeightsOnDisk, ReplacementAndRemovalAreReported) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path file = dir / "model.safetensors";
  Checkpoint ckpt(dir);
  fs::copy_file(file, tmp.path() / "new.safetensors");
  fs::rename(tmp.path() / "new.safetensors", file);  // an atomic replace: another inode
  auto why = ckpt.changed_on_disk();
  ASSERT_TRUE(why);
  EXPECT_EQ(*why, file.string() + " was replaced by another file");
  fs::remove(file);
  why = ckpt.changed_on_disk();
  ASSERT_TRUE(why);
  EXPECT_NE(why->find(file.string() + " was removed or cannot be read"), std::string::npos) << *why;
}

TEST(WeightsOnDisk, ReadIntoMemoryIsImmuneToTruncation) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path file = dir / "model.safetensors";
  const std::string original = read_regular_file(file);
  Checkpoint ckpt(dir, /*map=*/false);
  EXPECT_FALSE(ckpt.mapped());
  fs::resize_file(file, 0);
  EXPECT_EQ(ckpt.changed_on_disk(), std::nullopt);
  // Every tensor's bytes are still those the file held when it was opened (a mapping of the
  // truncated file would fault with SIGBUS here).
  const uint64_t header = 8 + *reinterpret_cast<const uint64_t*>(original.data());
  ASSERT_GT(ckpt.tensor_count(), 0u);
  for (const TensorInfo* t : ckpt.tensors()) {
    ASSERT_EQ(reinterpret_cast<uintptr_t>(t->data) % dtype_size(t->dtype), 0u) << t->name;
    const std::string bytes(reinterpret_cast<const char*>(t->data), t->nbytes);
    EXPECT_NE(original.find(bytes, header), std::string::npos) << t->name;
  }
}

TEST(WeightsOnDisk, LoadOptionsFollowTheProcessDefault) {
  EXPECT_TRUE(default_weights_mmap());
  EXPECT_TRUE(LoadOptions{}.mmap);
  set_default_weights_mmap(false);
  const LoadOptions off{.show_progress = true};  // as `lily serve` builds its options
  set_default_weights_mmap(true);
  EXPECT_FALSE(off.mmap);
  EXPECT_TRUE(LoadOptions{}.mmap);

  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  auto mapped = load_model(dir);
  auto copied = load_model(dir, LoadOptions{.mmap = false});
  EXPECT_TRUE(mapped->storage->mapped());
  EXPECT_FALSE(copied->storage->mapped());
  // The same weights either way.
  const auto& a = mapped->embed_tokens;
  const auto& b = copied->embed_tokens;
  ASSERT_EQ(a.rows, b.rows);
  EXPECT_EQ(0, std::memcmp(a.codes, b.codes, a.rows * a.words_per_row() * sizeof(uint32_t)));
  EXPECT_EQ(weights_changed_on_disk(*copied), std::nullopt);
  fs::resize_file(dir / "model.safetensors", 100);
  EXPECT_TRUE(weights_changed_on_disk(*mapped));
  EXPECT_EQ(weights_changed_on_disk(*copied), std::nullopt);
}


// What `lily serve` relies on to release the mapping after a backend copied the weights into its
// own memory (Backend::reads_host_weights, the CUDA backend): the mapping lives exactly as long
// as the last reference to the ModelWeights.
TEST(WeightsOnDisk, DroppingTheLastReferenceUnmapsTheFiles) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path file = fs::canonical(dir / "model.safetensors");
  auto weights = load_model(dir, LoadOptions{.mmap = true});
  EXPECT_GE(test::mappings_of(file), 1);
  std::shared_ptr<const ModelWeights> other = weights;
  weights.reset();
  EXPECT_GE(test::mappings_of(file), 1) << "unmapped while still referenced";
  other.reset();
  EXPECT_EQ(test::mappings_of(file), 0);
  // Nothing left to fault on: truncating the file now is harmless.
  fs::resize_file(file, 4096);
  EXPECT_EQ(test::mappings_of(file), 0);
}

}  // namespace
}  // namespace lily
