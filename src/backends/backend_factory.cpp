// parse_backend_kind and make_backend (engine/backend.h): the one place that knows which
// backends this build contains. Without LILY_HAVE_CUDA only the CPU backend exists.
#include <cerrno>
#include <cstdlib>
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

namespace {

/// The value of environment variable `name`, or "" when unset.
std::string env_value(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

/// A two-way switch: "" → dflt, `on` → true, `off` → false; anything else throws.
bool env_choice(const char* name, const char* on, const char* off, bool dflt) {
  const std::string v = env_value(name);
  if (v.empty()) return dflt;
  if (v == on) return true;
  if (v == off) return false;
  throw Error(std::string(name) + " must be '" + on + "' or '" + off + "', got '" + v + "'");
}

}  // namespace

CudaOptions CudaOptions::from_env() {
  CudaOptions o;
  o.fuse_decode = env_choice("LILY_CUDA_FUSE", "1", "0", o.fuse_decode);
  o.pdl = env_choice("LILY_CUDA_PDL", "1", "0", o.pdl);
  o.batched_prefill = env_choice("LILY_CUDA_PREFILL", "batched", "per-token", o.batched_prefill);
  o.tensor_core_gemm = env_choice("LILY_CUDA_GEMM", "tensor-core", "gemv", o.tensor_core_gemm);
  const std::string chunk = env_value("LILY_CUDA_PREFILL_CHUNK");
  if (!chunk.empty()) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(chunk.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || n < 1 || n > kMaxPrefillChunk)
      throw Error("LILY_CUDA_PREFILL_CHUNK must be an integer in 1…" + std::to_string(kMaxPrefillChunk) + ", got '" +
                  chunk + "'");
    o.prefill_chunk = static_cast<int>(n);
  }
  return o;
}

std::string CudaOptions::describe() const {
  return std::string("fuse=") + (fuse_decode ? "1" : "0") + " pdl=" + (pdl ? "1" : "0") +
         " prefill=" + (batched_prefill ? "batched" : "per-token") + " gemm=" + (tensor_core_gemm ? "tensor-core" : "gemv") +
         " chunk=" + std::to_string(prefill_chunk);
}

BackendKind parse_backend_kind(std::string_view text) {
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  if (text == "auto") return BackendKind::kAuto;
  throw Error("unknown backend '" + std::string(text) + "'; expected cpu, cuda or auto");
}

std::unique_ptr<Backend> make_backend(BackendKind kind, std::shared_ptr<const ModelWeights> weights,
                                      int threads) {
  if (!weights) throw Error("make_backend: no model weights");
  CudaOptions cuda;
  if (kind != BackendKind::kCpu) cuda = CudaOptions::from_env();  // a bad value fails even under auto
  switch (kind) {
    case BackendKind::kCpu:
      return std::make_unique<cpu::CpuBackend>(std::move(weights), threads);
    case BackendKind::kCuda:
#ifdef LILY_HAVE_CUDA
      return make_cuda_backend(std::move(weights), cuda);
#else
      throw Error("--backend cuda: this build has no CUDA support");
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
