// parse_backend_kind and make_backend (engine/backend.h): the one place that knows which
// backends this build contains. Without LILY_HAVE_CUDA only the CPU backend exists.
#include <algorithm>
#include <memory>
#include <string>

#include "backends/cpu/cpu_backend.h"
#include "base/error.h"
#include "base/log.h"
#include "engine/backend.h"
#ifdef LILY_HAVE_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

namespace lily {

BackendKind parse_backend_kind(std::string_view text) {
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  if (text == "auto") return BackendKind::kAuto;
  throw Error("unknown backend '" + std::string(text) + "'; expected cpu, cuda or auto");
}

int64_t backend_max_sequence(BackendKind kind) {
  const int64_t cpu_limit = cpu::CpuBackend::kMaxSeq;
#ifdef LILY_HAVE_CUDA
  if (kind == BackendKind::kCuda) return cuda_max_sequence();
  if (kind == BackendKind::kAuto) return std::min(cuda_max_sequence(), cpu_limit);
#else
  (void)kind;
#endif
  return cpu_limit;
}

int backend_max_batch(BackendKind kind, const CudaOptions& cuda) {
  const int cpu_limit = cpu::CpuBackend::kMaxBatch;
  if (kind == BackendKind::kCuda) return cuda.max_batch;
#ifdef LILY_HAVE_CUDA
  if (kind == BackendKind::kAuto) return std::min(cuda.max_batch, cpu_limit);
#endif
  return cpu_limit;
}

std::unique_ptr<Backend> make_backend(BackendKind kind, std::shared_ptr<const ModelWeights> weights,
                                      int threads, const CudaOptions& cuda) {
  if (!weights) throw Error("make_backend: no model weights");
  if (threads > kMaxCpuThreads)
    throw Error(std::to_string(threads) + " CPU threads asked for; the limit is " + std::to_string(kMaxCpuThreads));
#ifndef LILY_HAVE_CUDA
  (void)cuda;
#endif
  switch (kind) {
    case BackendKind::kCpu:
      return std::make_unique<cpu::CpuBackend>(std::move(weights), threads);
    case BackendKind::kCuda:
#ifdef LILY_HAVE_CUDA
      return make_cuda_backend(std::move(weights), cuda);
#else
      throw Error("the CUDA backend was asked for, but this build has no CUDA support (nvcc was not found at build time)");
#endif
    case BackendKind::kAuto:
#ifdef LILY_HAVE_CUDA
      try {
        return make_cuda_backend(weights, cuda);
      } catch (const std::exception& e) {
        log_info(std::string("CUDA backend unavailable (") + e.what() + "); using the CPU backend");
      }
#endif
      return std::make_unique<cpu::CpuBackend>(std::move(weights), threads);
  }
  throw Error("make_backend: unknown backend kind");
}

}  // namespace lily
