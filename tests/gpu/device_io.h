// Host/device plumbing shared by the CUDA kernel tests: random inputs, bf16/fp32 uploads and
// downloads (synchronising), NaN-poisoned output buffers, and the relative-error measure the
// tolerances are stated in.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_buffer.h"
#include "base/bf16.h"

namespace lily::test {

/// n values ~ N(mean, sigma).
inline std::vector<float> normal(int64_t n, std::mt19937_64& rng, float mean, float sigma) {
  std::normal_distribution<float> d(mean, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
/// Rounds every value to bf16 (so host references see exactly what the device sees).
inline std::vector<float> bf16_values(std::vector<float> v) {
  for (auto& x : v) x = round_bf16(x);
  return v;
}
/// n bf16-exact values ~ N(0, sigma).
inline std::vector<float> normal_bf16(int64_t n, std::mt19937_64& rng, float sigma) {
  return bf16_values(normal(n, rng, 0.0f, sigma));
}
/// n values ~ U[lo, hi).
inline std::vector<float> uniform(int64_t n, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline cuda::DeviceBuffer upload_f32(const std::vector<float>& v) {
  cuda::DeviceBuffer d(v.size() * 4);
  CUDA_CHECK(cudaMemcpy(d.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}
/// Uploads v rounded to bf16.
inline cuda::DeviceBuffer upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16(v[i]);
  cuda::DeviceBuffer d(bits.size() * 2);
  CUDA_CHECK(cudaMemcpy(d.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return d;
}
/// Waits for the device, then copies n fp32 values back.
inline std::vector<float> download_f32(const void* p, int64_t n) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return v;
}
inline std::vector<float> download_f32(const cuda::DeviceBuffer& d, int64_t n) { return download_f32(d.data(), n); }
/// Waits for the device, then copies n bf16 values back as floats.
inline std::vector<float> download_bf16(const void* p, int64_t n) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> bits(n);
  CUDA_CHECK(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = bf16_to_float(bits[i]);
  return v;
}
inline std::vector<float> download_bf16(const cuda::DeviceBuffer& d, int64_t n) { return download_bf16(d.data(), n); }
/// A device buffer filled with 0xFF bytes: NaN in bf16 and fp32, so unwritten outputs show.
inline cuda::DeviceBuffer poisoned(size_t bytes) {
  cuda::DeviceBuffer d(bytes);
  d.fill_bytes(0xFF);
  return d;
}

/// max_i |out_i − ref_i| / (|ref_i| + floor), NaN → infinity; floor < 0 means 1e-2·rms(ref).
inline double max_rel(const std::vector<float>& out, const std::vector<float>& ref, double floor = -1.0) {
  if (out.size() != ref.size()) return INFINITY;
  if (floor < 0) {
    double ss = 0;
    for (float r : ref) ss += double(r) * r;
    floor = 1e-2 * std::sqrt(ss / double(std::max<size_t>(1, ref.size()))) + 1e-30;
  }
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double e = std::fabs(double(out[i]) - ref[i]) / (std::fabs(double(ref[i])) + floor);
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}

}  // namespace lily::test
