// Regression tests for findings of the fuzz targets on src/io and src/model
// (tests/fuzz/fuzz_safetensors.cpp, fuzz_config.cpp). Each test is the minimized input that
// crashed, with the behaviour now expected.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "base/error.h"
#include "base/file_util.h"
#include "io/safetensors.h"
#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

// fuzz_safetensors: a zero-element tensor whose other dimensions multiply past INT64_MAX
// ([2^62, 3, 0] of U8) is a valid header; TensorInfo::numel() overflowed int64 (UBSan) while
// multiplying out the leading dimensions. It must be 0.
TEST(FuzzRegressionSafetensors, ZeroDimWithHugeOtherDimsHasZeroElements) {
  test::TempDir dir;
  const auto path = dir.path() / "z.safetensors";
  test::write_file(path, read_regular_file(test::source_dir() /
                                         "tests/fuzz/regressions/fuzz_safetensors/numel_overflow_zero_dim"));
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 1u);
  const TensorInfo& t = file.tensors()[0];
  EXPECT_EQ(t.shape_string(), "[4611686018427387904, 3, 0]");
  EXPECT_EQ(t.nbytes, 0u);
  EXPECT_EQ(t.numel(), 0);
}

}  // namespace
}  // namespace lily
