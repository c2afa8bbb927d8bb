// The weights of one decoder layer on the device, described once: the device model holds them
// per layer (DeviceLayer, device_model.h) and the persistent decode kernel's per-layer table
// (DecodeTaskLayer, decode_tasks.h) takes them whole, beside the sequence's state of the layer.
// Plain C++ for host and device code.
#pragma once
#include <type_traits>

#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"

namespace lily::cuda {

/// Device-side weights of one decoder layer: views into DeviceModel's buffers, the fused
/// matrices as device_model.h concatenates them (C, Vd, Hv, nq, nkv, D, E, I as in
/// docs/model.md). A layer has one mixer: in_proj and out_proj are the Gated DeltaNet's (beside
/// gdn) or the gated attention's (beside q_norm, k_norm); the other mixer's fields stay null.
/// Trivially copyable: the persistent decode kernel reads a copy of it from device memory.
struct DeviceLayerWeights {
  const float* input_norm = nullptr;  ///< fp32 [hidden]
  const float* post_norm = nullptr;   ///< fp32 [hidden]
  /// The mixer's input projection: GDN in_proj_qkv | in_proj_z | in_proj_a | in_proj_b
  /// [C + Vd + 2·Hv, hidden]; attention q_proj (with the gate) | k_proj | v_proj [nq·2D + 2·nkv·D, hidden].
  DeviceQuant in_proj;
  /// The mixer's output projection: GDN out_proj [hidden, Vd]; attention o_proj [hidden, nq·D].
  DeviceQuant out_proj;
  GdnParams gdn;                  ///< GDN: conv taps [C, K], A_log, dt_bias [Hv], gated-norm gain [Dv] (fp32)
  const float* q_norm = nullptr;  ///< attention: fp32 [D]
  const float* k_norm = nullptr;  ///< attention: fp32 [D]
  // MoE (the shared expert appended as expert E)
  /// 8-bit mlp.gate | shared_expert_gate [E + 1, hidden]: the router's E rows, then the shared expert's gate.
  DeviceQuant router;
  DeviceQuant gate;    ///< [(E + 1)·I, hidden], the shared expert as expert E
  DeviceQuant up;      ///< [(E + 1)·I, hidden]
  DeviceQuant down;    ///< [(E + 1)·hidden, I]
};
static_assert(std::is_trivially_copyable_v<DeviceLayerWeights>);

}  // namespace lily::cuda
