// The persistent kernel's task synchronisation (backends/cuda/task_sync.cuh) on the real decode
// program's structure (backends/cuda/decode_program.h), with synthetic task bodies: every task
// sums the elements it reads and folds the sum into the elements it writes (x ← 31·x + sum +
// element + task). Run by one block per SM on the persistent kernel's static schedule, the arena must end
// bit-identical to the same bodies run one task after another on the host: a read before its
// producer's write, or two writers out of order, changes some sum. Several launches in a row, two
// of them replays of one captured graph, share the counters (nothing is reset between them). The timings (printed, never asserted)
// give the cost of the task machinery alone, the floor a persistent decode kernel starts from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode_program.h"
#include "backends/cuda/device_buffer.h"
#include "backends/cuda/task_sync.cuh"
#include "gpu_test_util.h"
#include "support/test_support.h"

namespace lily {
namespace {

using cuda::DecodeProgramImage;
using cuda::DeviceBuffer;

constexpr int kThreads = 512;

/// The synthetic body of task `i`: s = Σ of every element it reads (mod 2³²), then each element e
/// it writes becomes 31·x + s + e + i. Integer sums: the same for any reduction order.
__device__ void run_synthetic_task(const DecodeProgramImage::Task& t, const DecodeProgramImage::Access* acc,
                                   uint32_t* arena, int64_t i) {
  __shared__ uint32_t warp_sums[kThreads / 32];
  uint32_t s = 0;
  for (int a = t.first_access; a < t.first_access + t.n_accesses; ++a) {
    const int64_t begin = acc[a].begin, end = acc[a].end;
    if (!acc[a].write)
      for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) s += __ldcg(arena + e);
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  s = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += warp_sums[w];
  __syncthreads();  // warp_sums is reused by the next task
  for (int a = t.first_access; a < t.first_access + t.n_accesses; ++a) {
    const int64_t begin = acc[a].begin, end = acc[a].end;
    if (acc[a].write)
      for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x)
        __stcg(arena + e, __ldcg(arena + e) * 31u + s + static_cast<uint32_t>(e) + static_cast<uint32_t>(i));
  }
}

/// One block per SM, block b running tasks b, b + G, … (the persistent kernel's static
/// schedule): wait, run (with_data) and signal. The counters and the per-block epochs are zeroed
/// once before the first launch; each launch finds its number in its block's epoch.
__global__ void __launch_bounds__(kThreads, 1)
    synthetic_program_kernel(const DecodeProgramImage::Task* tasks, int64_t n_tasks,
                             const DecodeProgramImage::Access* acc, uint32_t* arena, uint32_t* counters,
                             uint32_t* epochs, bool with_data) {
  __shared__ uint32_t launch_slot;
  const uint32_t launch = cuda::task_launch_begin(epochs, &launch_slot);
  for (int64_t i = blockIdx.x; i < n_tasks; i += gridDim.x) {
    const DecodeProgramImage::Task t = tasks[i];
    for (int w = 0; w < DecodeProgramImage::kMaxWaits; ++w)
      if (t.wait_counter[w] >= 0)
        cuda::counter_wait(counters + t.wait_counter[w], (launch + 1) * static_cast<uint32_t>(t.wait_target[w]));
    if (with_data) run_synthetic_task(t, acc, arena, i);
    if (t.signal >= 0) cuda::counter_signal(counters + t.signal);
  }
  cuda::task_launch_end(epochs, launch);
}

/// The same bodies, one task after another, on the host.
void run_on_host(const DecodeProgramImage& img, std::vector<uint32_t>& arena) {
  for (size_t i = 0; i < img.tasks.size(); ++i) {
    const DecodeProgramImage::Task& t = img.tasks[i];
    uint32_t s = 0;
    for (int a = t.first_access; a < t.first_access + t.n_accesses; ++a)
      if (!img.accesses[a].write)
        for (int64_t e = img.accesses[a].begin; e < img.accesses[a].end; ++e) s += arena[e];
    for (int a = t.first_access; a < t.first_access + t.n_accesses; ++a)
      if (img.accesses[a].write)
        for (int64_t e = img.accesses[a].begin; e < img.accesses[a].end; ++e)
          arena[e] = arena[e] * 31u + s + static_cast<uint32_t>(e) + static_cast<uint32_t>(i);
  }
}

/// A program on the device: its image, the arena (filled with a pattern), the counters.
struct DeviceProgram {
  DecodeProgramImage img;
  DeviceBuffer tasks, accesses, arena, counters, epochs;
  std::vector<uint32_t> start;
  int blocks = 0;

  explicit DeviceProgram(const cuda::DecodeProgram& p) : img(cuda::flatten_decode_program(p)) {
    tasks = DeviceBuffer(img.tasks.size() * sizeof(DecodeProgramImage::Task));
    accesses = DeviceBuffer(std::max<size_t>(img.accesses.size(), 1) * sizeof(DecodeProgramImage::Access));
    arena = DeviceBuffer(static_cast<size_t>(img.arena_elements) * 4);
    counters = DeviceBuffer(std::max<size_t>(static_cast<size_t>(img.n_counters), 1) * 4);
    CUDA_CHECK(cudaMemcpy(tasks.data(), img.tasks.data(), img.tasks.size() * sizeof(DecodeProgramImage::Task),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(accesses.data(), img.accesses.data(),
                          img.accesses.size() * sizeof(DecodeProgramImage::Access), cudaMemcpyHostToDevice));
    start.resize(static_cast<size_t>(img.arena_elements));
    for (size_t e = 0; e < start.size(); ++e) start[e] = static_cast<uint32_t>(e * 2654435761u);
    CUDA_CHECK(cudaMemcpy(arena.data(), start.data(), start.size() * 4, cudaMemcpyHostToDevice));
    counters.fill_bytes(0);
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev));
    epochs = DeviceBuffer(static_cast<size_t>(blocks) * 4);
    epochs.fill_bytes(0);
  }

  void launch(bool with_data, cudaStream_t stream = nullptr) {
    synthetic_program_kernel<<<blocks, kThreads, 0, stream>>>(
        tasks.as<DecodeProgramImage::Task>(), static_cast<int64_t>(img.tasks.size()),
        accesses.as<DecodeProgramImage::Access>(), arena.as<uint32_t>(), counters.as<uint32_t>(),
        epochs.as<uint32_t>(), with_data);
    CUDA_CHECK(cudaGetLastError());
  }

  std::vector<uint32_t> arena_now() {
    std::vector<uint32_t> out(start.size());
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(out.data(), arena.data(), out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
  }
};


cuda::DecodeProgram program_of(const ModelConfig& c) {
  cuda::DecodeGrain g;
  g.position = g.kv_capacity - 1;  // every attention split holds keys
  cuda::DecodeProgram p = cuda::build_decode_program(c, g);
  EXPECT_EQ(cuda::check_decode_program(p), "");
  return p;
}

/// Three launches in a row against the host, bit for bit; the third replays a captured graph of
/// the launch (fixed arguments: the launch number comes from the per-block epochs).
void expect_matches_host(const ModelConfig& c) {
  DeviceProgram d(program_of(c));
  std::vector<uint32_t> host = d.start;
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graph = test::capture_graph(stream, [&](cudaStream_t s) { d.launch(true, s); });
  for (int launch = 0; launch < 4; ++launch) {
    if (launch < 2) d.launch(true, stream);
    else CUDA_CHECK(cudaGraphLaunch(graph, stream));
    run_on_host(d.img, host);
    const std::vector<uint32_t> got = d.arena_now();
    int64_t differ = 0, first = -1;
    for (size_t e = 0; e < got.size(); ++e)
      if (got[e] != host[e]) {
        if (first < 0) first = static_cast<int64_t>(e);
        ++differ;
      }
    EXPECT_EQ(differ, 0) << c.shape_name() << ", launch " << launch << ": first differing element " << first;
  }
  CUDA_CHECK(cudaGraphExecDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(TaskSync, TheDemoProgramRunsAsOnTheHost) { expect_matches_host(load_model_config(test::demo_model_dir())); }

TEST(TaskSync, TheRealProgramRunsAsOnTheHost) { expect_matches_host(test::synth_preset_config("35b-a3b")); }

// The task machinery's cost on the 35B-A3B program: empty bodies (waits and signals only)
// and the synthetic bodies, µs per launch (events, after a warm-up). Printed, never asserted.
TEST(TaskSyncTiming, PrintsTheProgramsOverhead) {
  const cuda::DecodeProgram p = program_of(test::synth_preset_config("35b-a3b"));
  DeviceProgram d(p);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (bool with_data : {false, true}) {
    const double us = test::events_us(stream, 3, 20, [&] { d.launch(with_data, stream); });
    std::printf("[timing] decode program 35b-a3b: %zu tasks, %zu counters, %s bodies: %.1f us per step "
                "(%.2f us per counter in the chain)\n",
                p.tasks.size(), p.counter_names.size(), with_data ? "synthetic" : "empty", us,
                us / static_cast<double>(p.counter_names.size()));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace lily
