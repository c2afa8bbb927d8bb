// bfloat16 <-> float conversions (round-to-nearest-even), used for checkpoint storage
// (scales, biases, norm weights are BF16 in MLX files) and for GPU-side comparisons.
#pragma once
#include <cstdint>
#include <cstring>

namespace lily {

/// bf16 bits -> float (exact).
inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float -> bf16 bits, round to nearest even; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// Rounds a float to the nearest bf16 value and back (what storing in bf16 does).
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace lily
