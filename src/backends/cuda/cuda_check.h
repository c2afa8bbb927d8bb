// Host-side CUDA error checking, usable from .cpp (g++) and .cu (nvcc) files alike.
// Every CUDA runtime call in the backend goes through CUDA_CHECK; every kernel launch is
// followed by LILY_CUDA_CHECK_LAUNCH(); launchers check their arguments with LILY_CUDA_REQUIRE.
// Failures become lily::Error (never abort).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "base/error.h"

namespace lily::cuda {

/// Throws lily::Error "CUDA error at FILE:LINE: EXPR: <cudaGetErrorString>" when `status` is
/// not cudaSuccess.
inline void check_cuda(cudaError_t status, const char* expr, const char* file, int line) {
  if (status == cudaSuccess) return;
  throw ::lily::Error(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " +
                      expr + ": " + cudaGetErrorName(status) + " (" +
                      cudaGetErrorString(status) + ")");
}

/// Throws lily::Error "<where>: <message>" (the failure of a LILY_CUDA_REQUIRE).
[[noreturn]] inline void fail_requirement(const char* where, const std::string& message) {
  throw ::lily::Error(std::string(where) + ": " + message);
}

}  // namespace lily::cuda

/// Throws lily::Error "<where>: <message>" unless `ok`; the message (the rest of the arguments, a
/// std::string expression) is only built on failure, so a check costs nothing on a launch path.
#define LILY_CUDA_REQUIRE(ok, where, ...)                              \
  do {                                                                 \
    if (!(ok)) ::lily::cuda::fail_requirement((where), (__VA_ARGS__)); \
  } while (0)

/// Checks a CUDA runtime call; throws lily::Error with file:line and the CUDA error string.
#define CUDA_CHECK(expr) ::lily::cuda::check_cuda((expr), #expr, __FILE__, __LINE__)
/// Checks the last kernel launch (configuration errors; asynchronous faults surface later).
#define LILY_CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
