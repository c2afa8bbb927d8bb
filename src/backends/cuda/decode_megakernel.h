// The persistent decode kernel (docs/cuda.md, "A persistent decode kernel"): a one-sequence
// decode step as one resident launch of one block per SM; block b runs tasks b, b + G, b + 2G, …
// of the step's list (decode_program.h) in order, waits on counters in device memory for their inputs,
// runs the task's body (decode_tasks_*.cuh) and signals. The debug form runs the same bodies
// one launch per stage in list order, with no counters, so the host can look at every stage.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backends/cuda/decode_program.h"
#include "backends/cuda/decode_tasks.h"
#include "backends/cuda/device_buffer.h"
#include "model/config.h"

namespace lily::cuda {

/// The task list of one model's decode step on the device, its counters, and the launches that
/// run it. One step runs at a time per instance (its launches follow each other on one stream,
/// without programmatic dependent launch between them). Not copyable.
class DecodeMegakernel {
 public:
  /// Builds the program of `config` cut by `grain` (every attention split present: a split with
  /// no keys at a short length writes an empty partial), checks it (check_decode_program) and
  /// uploads it; the counters start at zero. Throws lily::Error for a grain the program builder
  /// refuses, a program that fails its check, or a shape the task bodies do not take
  /// (decode_megakernel_unsupported).
  DecodeMegakernel(const ModelConfig& config, const DecodeCut& grain);

  /// One decode step: the resident kernel, one block of kDecodeTaskThreads threads per SM, on
  /// `stream`. `p` must name buffers as decode_tasks.h describes (attn_part of attn_part_floats(),
  /// head_best_* of lm_parts() entries). Throws lily::Error on a launch error.
  void launch(const DecodeStepParams& p, cudaStream_t stream);

  /// The same step as one launch per stage (the tasks that signal one counter), in list order,
  /// no counters. `after_stage(kind, layer)` runs on the host after each stage's launch is
  /// enqueued (probes copy what the stage wrote). Throws lily::Error on a launch error.
  void launch_stages(const DecodeStepParams& p, cudaStream_t stream,
                     const std::function<void(DecodeTaskKind, int)>& after_stage = {});

  /// A report of one traced launch (DecodeStepParams::trace, copied to the host:
  /// kDecodeTraceFields values a task): per task kind the time its stages add to the step's
  /// chain, its tasks' mean and longest body and mean wait, and for tasks that read their rows
  /// from a weight slot the mean input staging, slot wait, GEMV and stores + signal; then the
  /// stages of the first layers and the last, each with its first task's start and its last
  /// task's end. Throws lily::InternalError for a trace of another size.
  std::string summarize_trace(const std::vector<unsigned long long>& trace) const;
  /// Tasks of the list (DecodeStepParams::trace holds kDecodeTraceFields values per task).
  int64_t n_tasks() const { return n_tasks_; }

  /// LM head tasks (entries of DecodeStepParams::head_best_value / head_best_id).
  int lm_parts() const { return lm_parts_; }
  /// Floats of DecodeStepParams::attn_part: nkv · splits · (nq / nkv) · (head_dim + 2).
  int64_t attn_part_floats() const { return attn_part_floats_; }
  const DecodeProgram& program() const { return program_; }

 private:
  /// A run of tasks that signal one counter: [first, first + count).
  struct Stage {
    int64_t first = 0;
    int count = 0;
    DecodeTaskKind kind = DecodeTaskKind::kEmbed;
    int layer = -1;
  };

  DecodeProgram program_;
  std::vector<Stage> stages_;
  DeviceBuffer tasks_;     ///< DecodeProgramImage::Task [n]
  DeviceBuffer counters_;  ///< uint32 [counters]
  DeviceBuffer epochs_;    ///< uint32 [blocks]: each block's launch number (task_sync.cuh)
  int64_t n_tasks_ = 0;
  int lm_parts_ = 0;
  int64_t attn_part_floats_ = 0;
  int blocks_ = 0;
};

/// Why the task bodies cannot run `config`'s decode step ("" when they can): the head and
/// state dimensions each body was written for.
std::string decode_megakernel_unsupported(const ModelConfig& config);

}  // namespace lily::cuda
