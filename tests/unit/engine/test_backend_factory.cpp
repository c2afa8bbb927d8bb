// parse_backend_kind and make_backend (engine/backend.h, backends/backend_factory.cpp).
#include <gtest/gtest.h>

#include <string>

#include "base/error.h"
#include "engine/backend.h"
#include "model/loader.h"
#include "support/test_support.h"

namespace lily {
namespace {

TEST(BackendFactory, ParsesTheThreeKinds) {
  EXPECT_EQ(parse_backend_kind("cpu"), BackendKind::kCpu);
  EXPECT_EQ(parse_backend_kind("cuda"), BackendKind::kCuda);
  EXPECT_EQ(parse_backend_kind("auto"), BackendKind::kAuto);
  try {
    parse_backend_kind("gpu");
    FAIL() << "expected lily::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gpu'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_backend_kind(""), Error);
}

TEST(BackendFactory, RejectsMissingWeights) {
  EXPECT_THROW(make_backend(BackendKind::kCpu, nullptr), Error);
}

TEST(BackendFactory, CpuAndAutoWithoutCuda) {
  auto weights = load_model(test::demo_model_dir());
  auto cpu = make_backend(BackendKind::kCpu, weights, 1);
  EXPECT_EQ(cpu->name(), "cpu");
  EXPECT_EQ(cpu->config().vocab, weights->config.vocab);
#ifdef LILY_HAVE_CUDA
  // A CUDA build: on a machine without a usable GPU (CI), --backend cuda is a clear error and
  // auto falls back to the CPU; on the H200 both give the CUDA backend.
  std::unique_ptr<Backend> cuda;
  try {
    cuda = make_backend(BackendKind::kCuda, weights);
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("no usable CUDA device") != std::string::npos ||
                what.find("compute capability") != std::string::npos)
        << what;
    EXPECT_EQ(make_backend(BackendKind::kAuto, weights)->name(), "cpu");
    return;
  }
  EXPECT_EQ(cuda->name(), "cuda");
  cuda.reset();
  EXPECT_EQ(make_backend(BackendKind::kAuto, weights)->name(), "cuda");
#else
  try {
    make_backend(BackendKind::kCuda, weights);
    FAIL() << "expected lily::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--backend cuda: this build has no CUDA support");
  }
  EXPECT_EQ(make_backend(BackendKind::kAuto, weights)->name(), "cpu");
#endif
}

}  // namespace
}  // namespace lily
