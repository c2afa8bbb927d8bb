// Programmatic dependent launch (PDL, Hopper): the one place where decode-path kernels are
// launched (nvcc only). A kernel launched with launch_pdl may be scheduled while its predecessor
// in the stream is still running, so its launch latency and block set-up overlap the
// predecessor's tail; it must not touch global memory before pdl_prologue() returns.
//
// The contract, which keeps every launch correct by construction:
//  1. Every kernel launched through launch_pdl calls pdl_prologue() in every thread before any
//     global store, before any load of data that its immediate predecessor may write, and before
//     any early return. Only index arithmetic, loads of weights (which no kernel writes) and the
//     loads of rule 4 may come before it.
//  2. pdl_prologue() = griddepcontrol.wait (returns once every predecessor grid has COMPLETED and
//     its memory is visible) followed by griddepcontrol.launch_dependents (lets the next grid be
//     scheduled now). Because each grid waits for its predecessor before it can complete,
//     completion is transitive: when the wait of kernel n returns, kernels 0 … n−1 have all
//     completed, so a kernel may read the output of any earlier kernel, not only the last one.
//     At most one dependent grid is resident and waiting at a time.
//  3. Kernels launched without the attribute (plain <<<>>>) are unaffected; the wait is a no-op
//     for them. So PDL can be switched off (LILY_CUDA_PDL=0) without touching any kernel.
//  4. A kernel starts only once its immediate predecessor P has run launch_dependents, which P
//     does after its own wait, when everything before P in the stream has completed (a kernel
//     that never runs it, or a copy, lets its dependent start only when it completes). So data
//     whose last writer comes before P in the stream may be loaded before the wait: the GDN
//     decode step reads its recurrent state there, which only the same layer's step of the
//     previous token (or a prefill or a copy, all long before) writes, and the decode
//     attention's splits read the step's lengths (the graph's copy-in) and request the cached
//     keys of earlier tokens (not the new one: P, the prepare kernel, appends it).
// Works in stream capture: the captured graph gets programmatic edges between kernel nodes.
//
// Launch facts asked of the driver once: raise_smem_limit and blocks_per_sm remember, per kernel,
// the dynamic shared-memory limit already set and the occupancy per block size and shared memory,
// so a launcher may call them on every launch (and every graph capture) at the cost of a lookup.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels.h"

namespace lily::cuda {

namespace detail {
/// raise_smem_limit for a kernel's entry pointer (launch.cu).
void raise_smem_limit(const void* kernel, size_t smem);
/// blocks_per_sm for a kernel's entry pointer (launch.cu).
int blocks_per_sm(const void* kernel, int threads, size_t smem);
}  // namespace detail

/// Makes `kernel`'s cudaFuncAttributeMaxDynamicSharedMemorySize at least `smem` bytes: the first
/// request above every limit set before for this kernel sets it to `smem`; any other returns
/// without a driver call. The limit never goes down, so a launch that fitted stays valid. One
/// device per process (as sm_count() assumes); thread-safe. Throws lily::Error on a CUDA error.
template <class... KernelArgs>
void raise_smem_limit(void (*kernel)(KernelArgs...), size_t smem) {
  detail::raise_smem_limit(reinterpret_cast<const void*>(kernel), smem);
}

/// cudaOccupancyMaxActiveBlocksPerMultiprocessor for `kernel` at `threads` threads per block and
/// `smem` bytes of dynamic shared memory, asked once per (kernel, threads, smem) and remembered.
/// Raise the kernel's limit to `smem` first (raise_smem_limit) when it exceeds the default 48 KB.
/// Thread-safe; throws lily::Error on a CUDA error.
template <class... KernelArgs>
int blocks_per_sm(void (*kernel)(KernelArgs...), int threads, size_t smem) {
  return detail::blocks_per_sm(reinterpret_cast<const void*>(kernel), threads, smem);
}

/// Device side of PDL; run at the top of every kernel launched with launch_pdl (see file comment).
/// A no-op when the kernel was launched without the PDL attribute.
__device__ __forceinline__ void pdl_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Launches kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, with
/// cudaLaunchAttributeProgrammaticStreamSerialization when pdl_enabled() and `stream` is an
/// explicitly created stream (the legacy default stream, used by some tests, gets a plain launch).
/// The kernel must start with pdl_prologue(). Throws lily::Error on a launch error.
template <class... KernelArgs, class... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
  config.attrs = attr;
  config.numAttrs = (pdl_enabled() && !legacy) ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace lily::cuda
