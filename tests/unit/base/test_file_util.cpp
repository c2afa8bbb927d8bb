// base/file_util.h: a checkpoint's small files are read only when they are regular files; a
// FIFO, a directory or a missing path is refused at once with the path and the reason.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "base/error.h"
#include "base/file_util.h"
#include "support/test_support.h"

namespace lily {
namespace {

std::string error_of(const std::filesystem::path& path) {
  try {
    read_regular_file(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(FileUtil, ReadsARegularFileWhole) {
  test::TempDir dir;
  const std::string content("{\"a\":1}\n\0tail", 13);
  std::ofstream(dir.path() / "f.json", std::ios::binary) << content;
  EXPECT_EQ(read_regular_file(dir.path() / "f.json"), content);
}

TEST(FileUtil, FifoIsRefusedWithoutBlocking) {
  test::TempDir dir;
  const auto fifo = dir.path() / "config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer exists: a plain open(2) would block here forever.
  EXPECT_EQ(error_of(fifo), fifo.string() + ": is a FIFO (named pipe), not a regular file");
  EXPECT_THROW(::close(open_regular_file(fifo)), Error);
}

TEST(FileUtil, DirectoryAndMissingFileAreRefusedByName) {
  test::TempDir dir;
  EXPECT_EQ(error_of(dir.path()), dir.path().string() + ": is a directory, not a regular file");
  const std::string missing = error_of(dir.path() / "absent.json");
  EXPECT_NE(missing.find((dir.path() / "absent.json").string() + ": cannot open: "), std::string::npos) << missing;
}

}  // namespace
}  // namespace lily
