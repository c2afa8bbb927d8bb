// The CUDA backend (NVIDIA Hopper, sm_90a): the whole qwen3_5_moe forward pass on one GPU.
// Weights are uploaded once (device_model.h); decode is one CUDA graph per sequence state,
// captured on the state's first decode step and replayed for every token (the token id and
// position travel in a 12-byte pinned-memory copy inside the graph; only the argmax id comes
// back, plus the logits when asked). Prefill runs chunks of up to 2,048 tokens through batched
// kernels, or (CudaOptions::batched_prefill = false) the decode graph per token (docs/cuda.md).
#pragma once
#include <memory>

#include "engine/backend.h"

namespace lily {

/// Creates the CUDA backend over loaded weights. Throws lily::Error when there is no CUDA
/// device, its compute capability is below 9.0, the model shape is one the kernels were not
/// written for, or the device has too little free memory (the message says how much is needed).
/// `options` picks the paths (engine/backend.h CudaOptions); by default the LILY_CUDA_*
/// environment, validated (lily::Error for a bad value).
std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                           const CudaOptions& options = CudaOptions::from_env());

/// Longest sequence (tokens) the CUDA backend creates a state for (its KV cache and kernel
/// limits; new_state refuses more).
int64_t cuda_max_sequence();

}  // namespace lily
