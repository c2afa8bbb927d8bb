// bench_device_peaks: the two ceilings the bench matrix (scripts/bench-matrix) compares against,
// measured on the machine at hand rather than taken from a data sheet (docs/benchmark.md §2):
//   copy_bytes_per_s   device-to-device cudaMemcpyAsync of a 2 GiB buffer, counting bytes read
//                      + bytes written (what a decode step's weight stream is limited by);
//   bf16_flop_per_s    cuBLAS GEMM, bf16 inputs and output, fp32 accumulation, 8192³
//                      (what a prefill projection is limited by).
// Each is the median of 10 timed repetitions (CUDA events) after 3 warm-ups. Prints one JSON
// object on stdout. Exit status 1 with a message on any CUDA/cuBLAS error.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_device_peaks: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_device_peaks: %s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

/// Median seconds of `reps` timed calls of `body` (after `warmups` untimed ones) on `stream`.
template <typename Body>
double median_seconds(cudaStream_t stream, int warmups, int reps, Body body) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmups; ++i) body();
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    body();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double copy_bytes_per_s(cudaStream_t stream) {
  const size_t bytes = size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc (copy source)");
  check(cudaMalloc(&b, bytes), "cudaMalloc (copy destination)");
  check(cudaMemsetAsync(a, 1, bytes, stream), "cudaMemset");
  const double s = median_seconds(stream, 3, 10, [&] {
    check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / s;
}

double bf16_flop_per_s(cudaStream_t stream) {
  const int n = 8192;
  const size_t elems = size_t(n) * n;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  check(cudaMalloc(&a, elems * sizeof(*a)), "cudaMalloc (A)");
  check(cudaMalloc(&b, elems * sizeof(*b)), "cudaMalloc (B)");
  check(cudaMalloc(&c, elems * sizeof(*c)), "cudaMalloc (C)");
  check(cudaMemsetAsync(a, 0, elems * sizeof(*a), stream), "cudaMemset");
  check(cudaMemsetAsync(b, 0, elems * sizeof(*b), stream), "cudaMemset");
  cublasHandle_t handle;
  check(cublasCreate(&handle), "cublasCreate");
  check(cublasSetStream(handle, stream), "cublasSetStream");
  const float alpha = 1.0f, beta = 0.0f;
  const double s = median_seconds(stream, 3, 10, [&] {
    check(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                       &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  });
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * double(n) * n * n / s;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  const double copy = copy_bytes_per_s(stream);
  const double gemm = bf16_flop_per_s(stream);
  std::printf("{\"device\": \"%s\", \"copy_bytes_per_s\": %.6e, \"bf16_flop_per_s\": %.6e}\n", prop.name, copy,
              gemm);
  cudaStreamDestroy(stream);
  return 0;
}
