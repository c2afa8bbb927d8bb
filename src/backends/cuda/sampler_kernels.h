// The device sampler: engine/sampler.h's pipeline (penalties and bias, temperature, top-k, top-p,
// min-p, the Philox draw) on rows of fp32 logits that stay on the device; only the chosen id
// comes back. Each row is described by one SampleRowArgs in device memory, so a batched step
// samples many rows with one set of launches (grid dimension = row). docs/cuda.md, "The device
// sampler", describes the kernels and where the device may differ from the CPU sampler.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "engine/sampler.h"

namespace lily::cuda {

/// One row to sample, in device memory (all pointers are device pointers). POD: the backend
/// fills it on the host (fill_sample_row) and copies it up before the step.
struct SampleRowArgs {
  const float* logits = nullptr;             ///< [vocab] raw logits (not changed)
  float* work = nullptr;                     ///< [vocab] scratch: logits after step 1 and temperature
  float* weight = nullptr;                   ///< [vocab] scratch: exp(x − max) in fp32
  unsigned long long* scratch = nullptr;     ///< [sample_scratch_slots(vocab)] per-row scratch of the kernels
  int32_t* out_id = nullptr;                 ///< where the chosen id goes
  const PenaltyEdit* edits = nullptr;        ///< [n_edits] (engine/sampler.h penalty_edits)
  const float* biases = nullptr;             ///< PenaltyEdits::biases
  int32_t n_edits = 0;
  int32_t vocab = 0;
  int32_t n_parts = 0;                       ///< sample_partial_slots(vocab)
  int32_t greedy = 0;                        ///< 1: argmax of the edited logits (temperature 0)
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  int32_t use_min_p = 0;
  double log_min_p = 0.0;                    ///< std::log(double(min_p)), computed on the host
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  unsigned long long seed = 0;               ///< Philox key (sample_uniform)
  unsigned long long step = 0;               ///< Philox counter: generated token number
};

/// Blocks per row (SampleRowArgs::n_parts) for launch_sample_rows over a row of `vocab` logits.
int sample_partial_slots(int64_t vocab);
/// 64-bit slots of SampleRowArgs::scratch for a row of `vocab` logits (about 100 KB at vocab
/// 248,320). Throws lily::InternalError for vocab ≤ 0 or > INT_MAX / 2.
int64_t sample_scratch_slots(int64_t vocab);

/// Fills the parameter fields of `row` from `params` for generated token number `step` (the
/// pointers, vocab, n_parts and n_edits are the caller's).
inline void fill_sample_params(SampleRowArgs& row, const SamplingParams& params, uint64_t step) {
  row.greedy = params.greedy() ? 1 : 0;
  row.temperature = params.temperature;
  row.top_k = params.top_k;
  row.top_p = params.top_p;
  row.use_min_p = params.min_p > 0.0f ? 1 : 0;
  row.log_min_p = row.use_min_p ? std::log(static_cast<double>(params.min_p)) : 0.0;
  row.repetition_penalty = params.repetition_penalty;
  row.frequency_penalty = params.frequency_penalty;
  row.presence_penalty = params.presence_penalty;
  row.seed = params.seed;
  row.step = step;
}

/// Samples `n_rows` rows (d_rows: [n_rows] SampleRowArgs in device memory) on `stream`: eight
/// launches whatever the row count (grid.y or grid.x = row). Each row's chosen id is written to
/// its out_id; nothing is synchronised. `max_vocab` bounds every row's vocab (the grid size).
/// Can be captured in a CUDA graph: nothing but the device memory it points at changes between
/// launches. Throws lily::Error on a launch error.
void launch_sample_rows(const SampleRowArgs* d_rows, int n_rows, int64_t max_vocab, cudaStream_t stream);

/// The device's sample_uniform (Philox4x32-10), for the tests: writes sample_uniform(seed,
/// steps[i]) to out[i] for i < n (device pointers).
void launch_sample_uniforms(uint64_t seed, const unsigned long long* steps, int n, double* out, cudaStream_t stream);

}  // namespace lily::cuda
