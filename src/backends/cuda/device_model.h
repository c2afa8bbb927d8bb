// The model's weights in device memory (uploaded once at backend creation).
//
// Layout decision: the MLX checkpoint layout is kept as is (U32 codes row-major, bf16 scales
// and biases per 64-group), not repacked. Reasons: (1) a decode GEMV reads each row's codes
// contiguously, which is already the coalesced order (a lane reads one 64-group = 32 bytes of
// 4-bit codes); (2) the bytes on the device are the checkpoint's bytes, so the CPU reference
// (which reads the same layout) and the GPU share one definition of the format; (3) upload is a
// plain copy, no transform to get wrong or to time. What IS done at load is row concatenation:
// fused projections become one matrix each (GDN qkv|z|a|b, attention q|k|v, router|shared
// gate), and the shared expert is appended to the expert stacks as expert n_experts, so one
// launch covers all 8 routed experts plus the shared one.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/device_buffer.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/layer_weights.h"
#include "backends/cuda/mixer_kernels.h"
#include "model/weights.h"

namespace lily::cuda {

/// One decoder layer of the device model: its weights (DeviceLayerWeights) and its mixer's kind,
/// which says whether in_proj and out_proj are the Gated DeltaNet's or the attention's.
struct DeviceLayer : DeviceLayerWeights {
  LayerType type = LayerType::kLinearAttention;
};

/// All weights on the device. Not copyable.
class DeviceModel {
 public:
  /// Checks the shapes the kernels support and the free device memory, then uploads.
  /// Throws lily::Error naming the unsupported shape, or "needs X GiB, Y GiB free".
  explicit DeviceModel(const ModelWeights& weights);

  /// Bytes of device memory `weights` need in this layout.
  static int64_t required_bytes(const ModelWeights& weights);

  DeviceQuant embed;
  DeviceQuant lm_head;
  const float* final_norm = nullptr;
  std::vector<DeviceLayer> layers;
  int64_t bytes = 0;  ///< device bytes held

 private:
  DeviceQuant upload_concat(const std::vector<const QuantMatrix*>& parts);
  const float* upload_floats(const std::vector<float>& v);
  std::vector<DeviceBuffer> buffers_;
};

}  // namespace lily::cuda
