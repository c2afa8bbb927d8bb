// The launch-fact cache of launch.cuh (raise_smem_limit, blocks_per_sm) against the driver's own
// answers: the shared-memory limit it sets is what cudaFuncGetAttributes reports, it only ever
// goes up, a launch at the limit runs, and the remembered occupancy equals a fresh query.
#include <gtest/gtest.h>

#include <cstddef>

#include "backends/cuda/common.cuh"
#include "backends/cuda/device_buffer.h"
#include "backends/cuda/launch.cuh"

namespace lily::test {
namespace {

/// Writes the block's dynamic shared-memory size (bytes) into out[0], touching its last float.
__global__ void smem_probe_kernel(float* out, int floats) {
  extern __shared__ float smem[];
  if (threadIdx.x == 0) {
    smem[floats - 1] = static_cast<float>(floats);
    out[0] = smem[floats - 1] * sizeof(float);
  }
}

/// A second kernel, so that limits are checked to be kept per kernel.
__global__ void other_probe_kernel(float* out) {
  extern __shared__ float smem[];
  if (threadIdx.x == 0) out[0] = smem[0] = 1.0f;
}

/// The dynamic shared-memory limit the driver reports for `kernel` (bytes).
int max_dynamic_smem(const void* kernel) {
  cudaFuncAttributes attr{};
  CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.maxDynamicSharedSizeBytes;
}

TEST(CudaLaunchFacts, SmemLimitIsSetOnceAndNeverLowered) {
  const void* probe = reinterpret_cast<const void*>(smem_probe_kernel);
  const void* other = reinterpret_cast<const void*>(other_probe_kernel);
  const int other_before = max_dynamic_smem(other);

  cuda::raise_smem_limit(smem_probe_kernel, 100 * 1024);
  EXPECT_EQ(max_dynamic_smem(probe), 100 * 1024);
  cuda::raise_smem_limit(smem_probe_kernel, 64 * 1024);  // smaller: the limit stays
  EXPECT_EQ(max_dynamic_smem(probe), 100 * 1024);
  cuda::raise_smem_limit(smem_probe_kernel, 120 * 1024);  // larger: raised
  EXPECT_EQ(max_dynamic_smem(probe), 120 * 1024);
  EXPECT_EQ(max_dynamic_smem(other), other_before);

  // A launch above the default 48 KB needs the raised limit; one below it still runs.
  cuda::DeviceBuffer out(sizeof(float));
  for (const int bytes : {120 * 1024, 64 * 1024, 1024}) {
    smem_probe_kernel<<<1, 32, bytes, nullptr>>>(out.as<float>(), bytes / 4);
    LILY_CUDA_CHECK_LAUNCH();
    float got = 0;
    CUDA_CHECK(cudaMemcpy(&got, out.as<float>(), sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, static_cast<float>(bytes));
  }
}

TEST(CudaLaunchFacts, BlocksPerSmMatchesTheDriver) {
  cuda::raise_smem_limit(other_probe_kernel, 96 * 1024);
  for (const int threads : {32, 256})
    for (const size_t smem : {size_t{0}, size_t{16 * 1024}, size_t{96 * 1024}}) {
      int direct = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&direct, other_probe_kernel, threads, smem));
      EXPECT_EQ(cuda::blocks_per_sm(other_probe_kernel, threads, smem), direct) << threads << " " << smem;
      EXPECT_EQ(cuda::blocks_per_sm(other_probe_kernel, threads, smem), direct) << "remembered";
    }
  // Less shared memory per block never fits fewer blocks.
  EXPECT_GE(cuda::blocks_per_sm(other_probe_kernel, 256, 16 * 1024),
            cuda::blocks_per_sm(other_probe_kernel, 256, 96 * 1024));
  EXPECT_GE(cuda::blocks_per_sm(other_probe_kernel, 256, 96 * 1024), 1);
}

}  // namespace
}  // namespace lily::test
