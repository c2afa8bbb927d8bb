// The run-time switch of programmatic dependent launch (launch.cuh): environment LILY_CUDA_PDL.
#include <atomic>
#include <cstdlib>
#include <string>

#include "backends/cuda/kernels.h"
#include "base/error.h"

namespace lily::cuda {
namespace {

/// -1: not read yet; 0: off; 1: on.
std::atomic<int> g_pdl{-1};

int pdl_from_env() {
  const char* v = std::getenv("LILY_CUDA_PDL");
  if (!v || !*v || std::string(v) == "1") return 1;  // default on: verified on an H200 (docs/cuda.md)
  if (std::string(v) == "0") return 0;
  throw ::lily::Error(std::string("LILY_CUDA_PDL must be '0' (off) or '1' (on), got '") + v + "'");
}

}  // namespace

bool pdl_enabled() {
  int s = g_pdl.load(std::memory_order_relaxed);
  if (s < 0) {
    s = pdl_from_env();
    int expected = -1;
    if (!g_pdl.compare_exchange_strong(expected, s)) s = expected;
  }
  return s == 1;
}

void set_pdl_enabled(bool on) { g_pdl.store(on ? 1 : 0); }

}  // namespace lily::cuda
