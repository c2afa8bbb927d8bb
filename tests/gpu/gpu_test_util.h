// Helpers shared by the CUDA kernel tests: random inputs, bf16/fp32 uploads and downloads
// (synchronising), NaN-poisoned output buffers, random MLX-affine matrices on host and device
// and their exact reference products (plain loops over the dequantized weights, docs/model.md
// §2.2), the relative-error measures the tolerances are stated in, the bit-for-bit comparison
// of fp32 arrays (bit_differences), graph capture and event
// timing, the names of the case-table (value-parameterised) suites and their perf mode.
#pragma once
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_buffer.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"
#include "base/bf16.h"

namespace lily::test {

// ---- random inputs, uploads and downloads -------------------------------------------------------

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

/// Uploads v as fp32.
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
/// Waits for the device, then copies n int32 values back.
inline std::vector<int32_t> download_i32(const cuda::DeviceBuffer& d, int64_t n) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), d.data(), n * 4, cudaMemcpyDeviceToHost));
  return v;
}
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

// ---- mixer shapes -------------------------------------------------------------------------------

/// Attention dims of nq query heads, nkv kv heads, head_dim D and rotary_dim rotated dims (θ and
/// the norm epsilon as the real model's).
inline cuda::AttnDims attn_dims(int nq, int nkv, int D, int rotary_dim) {
  cuda::AttnDims d;
  d.n_heads = nq;
  d.n_kv_heads = nkv;
  d.head_dim = D;
  d.rotary_dim = rotary_dim;
  return d;
}
/// The demo model's attention shape (models/demo): 4 query heads, 2 kv heads, head_dim 64,
/// rotary 16.
inline cuda::AttnDims demo_attn_dims() { return attn_dims(4, 2, 64, 16); }

/// GDN dims of Hk key heads and Hv value heads of head_dim Dk = Dv (conv kernel 4, the real
/// model's norm epsilon).
inline cuda::GdnDims gdn_dims(int n_key_heads, int n_value_heads, int head_dim) {
  cuda::GdnDims d;
  d.n_key_heads = n_key_heads;
  d.n_value_heads = n_value_heads;
  d.key_head_dim = d.value_head_dim = head_dim;
  return d;
}
/// The demo model's GDN shape (models/demo): Hk 2, Hv 4, Dk = Dv = 64, K 4.
inline cuda::GdnDims demo_gdn_dims() { return gdn_dims(2, 4, 64); }

// ---- quantized matrices, error measures, graphs and timing --------------------------------------

/// A random MLX-affine matrix in host memory plus its device copy.
struct RandomQuant {
  int64_t rows = 0;
  int cols = 0, bits = 4;
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;  // bf16 bits
  cuda::DeviceBuffer d_codes, d_scales, d_biases;

  RandomQuant(int64_t rows_, int cols_, int bits_, std::mt19937_64& rng) : rows(rows_), cols(cols_), bits(bits_) {
    const int64_t wpr = int64_t(cols) * bits / 32, gpr = cols / 64;
    codes.resize(rows * wpr);
    for (auto& w : codes) w = static_cast<uint32_t>(rng());
    scales.resize(rows * gpr);
    biases.resize(rows * gpr);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    const float levels = float((1 << bits) - 1);
    for (int64_t i = 0; i < rows * gpr; ++i) {
      const float s = 0.02f * n01(rng) / levels * 15.0f;  // negative scales occur, as in real files
      scales[i] = float_to_bf16(s);
      biases[i] = float_to_bf16(-0.5f * levels * s + 0.01f * n01(rng));
    }
    d_codes = cuda::DeviceBuffer(codes.size() * 4);
    d_scales = cuda::DeviceBuffer(scales.size() * 2);
    d_biases = cuda::DeviceBuffer(biases.size() * 2);
    cuda::upload(d_codes.as<uint32_t>(), codes.data(), codes.size());
    cuda::upload(d_scales.as<uint16_t>(), scales.data(), scales.size());
    cuda::upload(d_biases.as<uint16_t>(), biases.data(), biases.size());
  }

  cuda::DeviceQuant view() const {
    cuda::DeviceQuant q;
    q.codes = d_codes.as<uint32_t>();
    q.scales = d_scales.as<__nv_bfloat16>();
    q.biases = d_biases.as<__nv_bfloat16>();
    q.rows = rows;
    q.cols = cols;
    q.bits = bits;
    return q;
  }

  /// Exact fp32 weight w[r, c].
  float weight(int64_t r, int c) const {
    const int per = 32 / bits;
    const uint32_t word = codes[r * (int64_t(cols) / per) + c / per];
    const uint32_t q = (word >> (bits * (c % per))) & ((1u << bits) - 1u);
    const int64_t g = r * (cols / 64) + c / 64;
    return bf16_to_float(scales[g]) * float(q) + bf16_to_float(biases[g]);
  }
  /// Σ_c w[r, c]·x[c] in double (the exact product the kernels approximate in fp32).
  double dot(int64_t r, const float* x) const {
    double acc = 0;
    for (int c = 0; c < cols; ++c) acc += double(weight(r, c)) * x[c];
    return acc;
  }
};

/// Max over i of |out − ref| / (|ref| + floor); NaN counts as infinite error.
inline double worst_rel(const std::vector<float>& out, const std::vector<double>& ref, double floor) {
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double e = std::fabs(double(out[i]) - ref[i]) / (std::fabs(ref[i]) + floor);
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}
/// rms(out − ref) / rms(ref) over n values (normwise relative error); NaN → infinity.
inline double rms_rel(const float* out, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  const double e = std::sqrt(num / std::max(den, 1e-30));
  return std::isnan(e) ? INFINITY : e;
}
/// rms_rel over the values out and ref both have.
inline double rms_rel(const std::vector<float>& out, const std::vector<float>& ref) {
  return rms_rel(out.data(), ref.data(), std::min(out.size(), ref.size()));
}
/// Root mean square of ref.
inline double rms(const std::vector<double>& ref) {
  double s = 0;
  for (double r : ref) s += r * r;
  return std::sqrt(s / double(ref.size()));
}
/// Error of `out` against `ref` relative to the RMS of ref: {RMS error, max error}; NaN → infinity.
inline std::pair<double, double> rms_relative_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double se = 0, mx = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double e = std::fabs(double(out[i]) - ref[i]);
    se += e * e;
    mx = (e <= mx) ? mx : (std::isnan(e) ? INFINITY : e);
  }
  const double r = rms(ref);
  return {std::sqrt(se / double(out.size())) / r, mx / r};
}
/// max_i |out_i − ref_i| / max(1, max_i |ref_i|) (fp32 states); NaN → infinity.
inline double max_abs_scaled(const std::vector<float>& out, const std::vector<float>& ref) {
  double scale = 1, worst = 0;
  for (float r : ref) scale = std::max(scale, double(std::fabs(r)));
  for (size_t i = 0; i < out.size() && i < ref.size(); ++i) {
    const double e = std::fabs(double(out[i]) - ref[i]) / scale;
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}

/// Number of positions i < n where a[i] and b[i] differ in their bits (compared as memcmp does:
/// -0 ≠ +0, NaNs of different payloads differ, NaNs of equal bits are equal); 0 when the first n
/// values of a and b are bit-identical.
inline int64_t bit_differences(const float* a, const float* b, size_t n) {
  int64_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return differ;
}
/// bit_differences over all of `a` and `b`; −1 when their sizes differ (so EXPECT_EQ(…, 0) fails).
inline int64_t bit_differences(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  return bit_differences(a.data(), b.data(), a.size());
}

/// A process-wide kernel switch (a getter and setter pair such as cuda::pdl_enabled /
/// cuda::set_pdl_enabled) for one scope: saves the value it finds, optionally sets `value`,
/// `set` changes it within the scope, and the destructor restores the saved value, also when a
/// fatal assertion leaves the test early. The one helper the kernel tests flip switches with.
///   ScopedSwitch pdl(cuda::pdl_enabled, cuda::set_pdl_enabled, false);
template <class T>
class ScopedSwitch {
 public:
  ScopedSwitch(T (*get)(), void (*set)(T)) : set_(set), saved_(get()) {}
  ScopedSwitch(T (*get)(), void (*set)(T), T value) : ScopedSwitch(get, set) { set_(value); }
  ~ScopedSwitch() { set_(saved_); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;

  /// Sets the switch to `value` (until the scope ends or the next set).
  void set(T value) const { set_(value); }

 private:
  void (*set_)(T);
  T saved_;
};

/// The PDL switch (cuda::set_pdl_enabled) for one scope, restored at its end.
struct PdlSetting : ScopedSwitch<bool> {
  PdlSetting() : ScopedSwitch(cuda::pdl_enabled, cuda::set_pdl_enabled) {}
};

/// What `enqueue(stream)` launches on `stream`, captured (thread-local mode) and instantiated
/// as a graph; the caller destroys it with cudaGraphExecDestroy.
template <class F>
cudaGraphExec_t capture_graph(cudaStream_t stream, F&& enqueue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return exec;
}

/// Mean time of one `launch()` on `stream` over `reps` back-to-back calls after `warmup` ones
/// (µs, CUDA events on `stream`).
template <class F>
double events_us(cudaStream_t stream, int warmup, int reps, F&& launch) {
  for (int i = 0; i < warmup; ++i) launch();
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaEventRecord(a, stream));
  for (int i = 0; i < reps; ++i) launch();
  CUDA_CHECK(cudaEventRecord(b, stream));
  CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1000.0 * ms / reps;
}

/// Mean time of one replay of `exec` on `stream` over `reps` replays after 3 warm-up ones (µs).
inline double graph_replay_us(cudaGraphExec_t exec, cudaStream_t stream, int reps) {
  return events_us(stream, 3, reps, [&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
}

/// Mean time of `launch` over `reps` back-to-back launches on the default stream (µs).
template <class F>
double time_us(F&& launch, int reps = 200) {
  return events_us(nullptr, 5, reps, launch);
}

// ---- case tables ---------------------------------------------------------------------------------
//
// A kernel suite is a table of cases (a struct with named fields: shape, bits, path, token count,
// seed) run by one TEST_P and INSTANTIATE_TEST_SUITE_P(Cases, Suite, testing::ValuesIn(table),
// CaseName()). Every case struct has `std::string name() const` that says its shape and the rest,
// e.g. "gdn_in_proj_12352x2048_q4_bf16_m1_default_s1" (the test is then named
// Cases/Suite.Test/<that name>), and a friend PrintTo that prints the name, so that a failure
// says "where GetParam() = <name>".

/// `s` with every character outside [A-Za-z0-9_] replaced by '_' (all a test name may hold).
inline std::string test_name(std::string s) {
  for (char& ch : s)
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9'))) ch = '_';
  return s;
}

/// The name generator of a case table: test_name(case.name()).
struct CaseName {
  template <class Case>
  std::string operator()(const testing::TestParamInfo<Case>& info) const {
    return test_name(info.param.name());
  }
};

/// "<rows>x<cols>_q<bits>": a quantized matrix's shape and width, as the case names write them.
inline std::string quant_shape(int64_t rows, int cols, int bits) {
  return std::to_string(rows) + "x" + std::to_string(cols) + "_q" + std::to_string(bits);
}

/// Bytes of an MLX-affine matrix of `rows` × `cols` at `bits`: the codes, then a bf16 scale and
/// bias per group of kQuantGroupSize columns.
inline double quant_bytes(int64_t rows, int cols, int bits) {
  return double(rows) * (double(cols) * bits / 8 + double(cols / kQuantGroupSize) * 4);
}

// ---- perf mode -------------------------------------------------------------------------------------
//
// With LILY_GPU_PERF=1 the case-table suites also time each case's kernel after checking it and
// print one line per case, "[perf] <case name>: <µs> us, <GB/s> GB/s, <TFLOP/s> TFLOP/s", so one
// run of a test binary gives the correctness and the speed of every shape it covers (for example
// `LILY_GPU_PERF=1 build/tests/test_quant_gemm --gtest_filter='Cases/*'`). Off by default: the
// suites' run time and results are then unchanged. The figures are benchmarks, never asserted.

/// Whether LILY_GPU_PERF is "1".
inline bool perf_mode() {
  const char* v = std::getenv("LILY_GPU_PERF");
  return v != nullptr && std::string_view(v) == "1";
}

/// In perf mode: the mean time of `launch` (CUDA events on the default stream, after 3 warm-up
/// launches, over `reps`) as a [perf] line for `name`, with the rate of `bytes` moved and
/// `flops` done per launch (each left out when 0). Nothing outside perf mode.
template <class F>
void perf_report(const std::string& name, double bytes, double flops, F&& launch, int reps = 50) {
  if (!perf_mode()) return;
  const double us = events_us(nullptr, 3, reps, launch);
  std::printf("[perf] %s: %.2f us", name.c_str(), us);
  if (bytes > 0) std::printf(", %.0f GB/s", bytes / us / 1e3);
  if (flops > 0) std::printf(", %.1f TFLOP/s", flops / us / 1e6);
  std::printf("\n");
}

}  // namespace lily::test
