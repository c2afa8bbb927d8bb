// The CUDA backend (NVIDIA Hopper, sm_90a): the whole qwen3_5_moe forward pass on one GPU.
// Weights are uploaded once (device_model.h). Prefill runs chunks of up to 4,096 tokens through
// batched kernels, or (CudaOptions::batched_prefill = false) the decode graph per token
// (docs/cuda.md).
//
// Decode graphs. A decode step is one CUDA graph launch: the token id and position travel in a
// 12-byte pinned-memory copy inside the graph, and only the argmax id comes back (plus the
// logits when asked). What differs between two states' steps is only kernel arguments (their
// GDN and KV buffer addresses, the KV capacity) and the attention split count, so the
// instantiated graphs (cudaGraphExec_t) belong to the backend, not to the states:
//  * A state carries a layout id, drawn from a process-wide counter when its KV cache is
//    allocated (creation, clone, restore from host, growth) and never reused.
//  * The backend keeps a small cache of execs keyed by what shapes the graph: greedy or sampled,
//    the attention split count (the KV capacity bucket) and programmatic launch on or off. Each
//    exec records the layout id of the state whose arguments it holds.
//  * A step whose state's layout is recorded for the key launches that exec as it is. Otherwise
//    the step is captured into a cudaGraph_t and handed to an exec: a new instantiation while the
//    key has fewer than CudaOptions::max_batch execs and the cache fewer than its bound
//    (2 × max_batch, at least 8); else the least recently used exec of the key (or, at the bound,
//    of all) takes it by cudaGraphExecUpdate, which is cheap. Where the update is refused
//    (topology, node or attribute changes), a fresh instantiation replaces that exec.
//  * An exec is launched only for the state whose layout it records, and a state's layout
//    changes whenever its buffers do, so an exec never runs with the pointers of a state that
//    has grown or been destroyed; it is updated before it is launched for anyone else. Every
//    step ends with a stream synchronise, so no update or reuse races a launch in flight.
// With one sequence decoding, a new request's first step costs a capture and an update instead
// of an instantiation; with several sequences interleaved, each keeps its own exec.
//
// Batched decode (CudaOptions::batched_decode, the default): a step's one-token decode rows run
// as one forward over B ≤ decode_rows (≤ kMaxDecodeRows = 64) rows instead, which gives every
// row the bits of the one-sequence step (so a lone row takes that step's graph). Each row's
// token, position, length, attention split count and state pointers travel in a pinned exchange
// block that the graph copies in, so a captured batched step holds nothing of any state: its
// execs are keyed by B, the number of sampled rows, the largest split count and PDL, and replay
// for any rows.
#pragma once
#include <memory>

#include "engine/backend.h"

namespace lily {

/// Creates the CUDA backend over loaded weights. Throws lily::Error when there is no CUDA
/// device, its compute capability is below 9.0, the model shape is one the kernels were not
/// written for, or the device has too little free memory (the message says how much is needed).
/// `options` picks the paths (engine/backend.h CudaOptions), as the caller resolved them (the
/// command line: resolve_cuda_options; tests: CudaOptions::from_env); this reads no environment.
/// The backend also sets the kernel layer's process-wide switches from them
/// (apply_kernel_switches, kernel_switches.h): the last backend created decides the paths of
/// every kernel launched afterwards.
std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const ModelWeights> weights,
                                           const CudaOptions& options);

/// Longest sequence (tokens) the CUDA backend creates a state for (its KV cache and kernel
/// limits; new_state refuses more).
int64_t cuda_max_sequence();

}  // namespace lily
