// GPU tests of the Gated DeltaNet kernels (src/backends/cuda/gdn.cu) against fp32 references
// built from the CPU backend's ops (docs/model.md §3.3), at the real shapes: Hk 16, Hv 32,
// Dk = Dv 128, conv channels 8192. Inputs are random; outputs are poisoned (NaN) before launch.
// Tolerances: bf16 outputs within 1e-2 relative, fp32 states within 1e-4 (relative to the
// state's largest magnitude, at least 1); the tensor-core passes against the fp32 ones: see
// expect_tensor_core_pass_matches_fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/ops.h"
#include "backends/cuda/device_buffer.h"
#include "gpu_test_util.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"
#include "base/bf16.h"

namespace lily {
namespace {

using cuda::DeviceBuffer;

using test::bf16_values;
using test::CaseName;
using test::demo_gdn_dims;
using test::download_bf16;
using test::download_f32;
using test::max_abs_scaled;
using test::max_rel;
using test::normal;
using test::poisoned;
using test::rms_rel;
using test::ScopedSwitch;
using test::uniform;
using test::upload_bf16;
using test::upload_f32;

constexpr double kBf16Tol = 1e-2;
constexpr double kStateTol = 1e-4;
constexpr double kFloor = 1e-3;
/// Chunked prefill vs the sequential reference: the two fp32 pre-norm outputs differ in their
/// last bits, so o' = bf16(o) may round to neighbouring bf16 values (up to 2^-7 relative) before
/// the output's own rounding (2^-8): the elementwise bound is two bf16 ulps, and the rms error
/// must stay far below one ulp.
constexpr double kPrefillElemTol = 1.6e-2;
constexpr double kPrefillRmsTol = 2e-3;

// ---- GDN fixture: weights and the fp32 reference --------------------------------------------

struct GdnFixture {
  cuda::GdnDims dims;  // real shape by default
  int C = dims.conv_channels();
  std::vector<float> conv_w, A_log, dt_bias, norm_w;
  DeviceBuffer d_conv_w, d_A_log, d_dt_bias, d_norm_w;

  GdnFixture(std::mt19937_64& rng, float A_log_lo, float A_log_hi, const cuda::GdnDims& shape = {})
      : dims(shape) {
    conv_w = normal(int64_t(C) * dims.conv_kernel, rng, 0.0f, 0.5f);
    A_log = uniform(dims.n_value_heads, rng, A_log_lo, A_log_hi);
    dt_bias = normal(dims.n_value_heads, rng, 0.0f, 0.5f);
    norm_w = uniform(dims.value_head_dim, rng, 0.5f, 1.5f);
    d_conv_w = upload_f32(conv_w);
    d_A_log = upload_f32(A_log);
    d_dt_bias = upload_f32(dt_bias);
    d_norm_w = upload_f32(norm_w);
  }
  cuda::GdnParams params() const {
    return {d_conv_w.as<float>(), d_A_log.as<float>(), d_dt_bias.as<float>(), d_norm_w.as<float>()};
  }

  /// The sequential reference of one token (docs/model.md §3.3 steps 3-6) on conv output `x` [C]:
  /// updates `state` [Hv, Dk, Dv] and writes y [Hv·Dv] (fp32 values of the bf16 outputs).
  void reference_token(const float* x, const float* z, const float* a, const float* b,
                       std::vector<float>& state, float* y) const {
    const int Dk = dims.key_head_dim, Dv = dims.value_head_dim;
    const int group = dims.n_value_heads / dims.n_key_heads;
    std::vector<float> q(Dk), k(Dk), o(Dv), yo(Dv);
    for (int j = 0; j < dims.n_value_heads; ++j) {
      const int kh = j / group;
      std::copy(x + kh * Dk, x + (kh + 1) * Dk, q.begin());
      std::copy(x + dims.key_dim() + kh * Dk, x + dims.key_dim() + (kh + 1) * Dk, k.begin());
      cpu::l2_normalize(q.data(), Dk, 1e-6f);
      cpu::l2_normalize(k.data(), Dk, 1e-6f);
      for (auto& e : q) e *= 1.0f / std::sqrt(float(Dk));
      const float alpha = std::exp(-std::exp(A_log[j]) * cpu::softplus(a[j] + dt_bias[j]));
      const float beta = cpu::sigmoid(b[j]);
      const float* v = x + 2 * dims.key_dim() + j * Dv;
      cpu::delta_rule_step(state.data() + int64_t(j) * Dk * Dv, q.data(), k.data(), v, alpha, beta,
                           Dk, Dv, o.data());
      for (auto& e : o) e = round_bf16(e);
      cpu::gated_rms_norm(o.data(), z + j * Dv, norm_w.data(), Dv, dims.norm_eps, yo.data());
      for (int m = 0; m < Dv; ++m) y[j * Dv + m] = yo[m];
    }
  }
};

// ---- conv -----------------------------------------------------------------------------------

TEST(GdnConv, DecodeStepMatchesReferenceAndShiftsWindow) {
  std::mt19937_64 rng(11);
  GdnFixture fx(rng, -2.0f, 1.0f);
  const int C = fx.C, K = fx.dims.conv_kernel;
  std::vector<float> window = bf16_values(normal(int64_t(C) * (K - 1), rng, 0.0f, 1.0f));
  DeviceBuffer d_window = upload_bf16(window);
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> x = bf16_values(normal(C, rng, 0.0f, 1.0f));
    DeviceBuffer d_x = upload_bf16(x), d_out = poisoned(size_t(C) * 2);
    cuda::gdn_conv_decode(fx.dims, fx.params(), d_x.as<__nv_bfloat16>(),
                          d_window.as<__nv_bfloat16>(), d_out.as<__nv_bfloat16>(), nullptr);
    std::vector<float> ref(C);
    cpu::causal_conv_step(fx.conv_w.data(), window.data(), x.data(), C, K, ref.data());
    for (auto& e : ref) e = cpu::silu(e);
    const double err = max_rel(download_bf16(d_out, C), ref, kFloor);
    EXPECT_LT(err, kBf16Tol) << "step " << step;
    EXPECT_EQ(download_bf16(d_window, window.size()), window) << "window after step " << step;
  }
}

/// Prefill conv over T tokens equals T decode steps bit for bit (outputs and final window).
/// Rows of C + `extra` columns (the qkv|z|a|b row: extra columns hold other data); an odd
/// stride takes the kernel's one-channel-per-thread form, an even one the channel pairs.
void expect_conv_prefill_equals_decode(int T, const cuda::GdnDims& shape = {}, int64_t extra = 4160) {
  std::mt19937_64 rng(100 + T);
  GdnFixture fx(rng, -2.0f, 1.0f, shape);
  const int C = fx.C, K = fx.dims.conv_kernel;
  const int64_t stride = C + extra;
  const std::vector<float> rows = bf16_values(normal(T * stride, rng, 0.0f, 1.0f));
  const std::vector<float> window = bf16_values(normal(int64_t(C) * (K - 1), rng, 0.0f, 1.0f));
  DeviceBuffer d_rows = upload_bf16(rows);
  DeviceBuffer d_win_prefill = upload_bf16(window), d_win_decode = upload_bf16(window);
  DeviceBuffer d_out = poisoned(size_t(T) * C * 2), d_step = poisoned(size_t(C) * 2);
  cuda::gdn_conv_prefill(fx.dims, fx.params(), T, d_rows.as<__nv_bfloat16>(), stride,
                         d_win_prefill.as<__nv_bfloat16>(), d_out.as<__nv_bfloat16>(), nullptr);
  const std::vector<float> out = download_bf16(d_out, int64_t(T) * C);
  for (int t = 0; t < T; ++t) {
    cuda::gdn_conv_decode(fx.dims, fx.params(), d_rows.as<__nv_bfloat16>() + t * stride,
                          d_win_decode.as<__nv_bfloat16>(), d_step.as<__nv_bfloat16>(), nullptr);
    const std::vector<float> step = download_bf16(d_step, C);
    for (int c = 0; c < C; ++c)
      ASSERT_EQ(float_to_bf16(out[int64_t(t) * C + c]), float_to_bf16(step[c]))
          << "token " << t << " of " << T << ", channel " << c << ": prefill " << out[int64_t(t) * C + c]
          << " vs decode " << step[c];
  }
  EXPECT_EQ(download_bf16(d_win_prefill, window.size()), download_bf16(d_win_decode, window.size()));
}

/// The demo shape with one key head and three value heads: C = 2·64 + 3·64 = 320, so 160
/// channel pairs, part of one block.
cuda::GdnDims partial_channel_block_dims() {
  cuda::GdnDims d = demo_gdn_dims();
  d.n_key_heads = 1;
  d.n_value_heads = 3;
  return d;
}

/// A conv case: T tokens of shape `dims` in rows of C + `extra` columns; checked by
/// expect_conv_prefill_equals_decode. `label` is the case's test name.
struct ConvCase {
  const char* label;
  int T;
  cuda::GdnDims dims;
  int64_t extra;

  std::string name() const { return label; }
  friend void PrintTo(const ConvCase& c, std::ostream* os) { *os << c.name(); }
};

/// The conv cases: a short and a long chunk and the demo shape (even stride: channel pairs), an
/// odd stride (one channel per thread), and a channel count that fills part of one block.
const std::vector<ConvCase> kConvCases = {
    {"ShortChunk", 2, cuda::GdnDims{}, 4160},
    {"LongChunk", 257, cuda::GdnDims{}, 4160},
    {"DemoDims", 70, demo_gdn_dims(), 4160},
    {"OddStride", 37, cuda::GdnDims{}, 4161},
    {"PartialChannelBlock", 21, partial_channel_block_dims(), 4160},
};

/// The conv case table (kConvCases): prefill equals decode steps bit for bit.
class GdnConv : public testing::TestWithParam<ConvCase> {};

TEST_P(GdnConv, PrefillEqualsDecodeSteps) {
  const ConvCase& c = GetParam();
  expect_conv_prefill_equals_decode(c.T, c.dims, c.extra);
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnConv, testing::ValuesIn(kConvCases), CaseName());

// ---- decode step ------------------------------------------------------------------------------

/// Three fused decode steps of the given shape against the sequential reference.
void expect_decode_matches(const cuda::GdnDims& shape) {
  std::mt19937_64 rng(21);
  GdnFixture fx(rng, -2.0f, 1.0f, shape);
  const auto& d = fx.dims;
  const int C = fx.C, V = d.value_dim(), Hv = d.n_value_heads;
  std::vector<float> state = normal(d.state_elems(), rng, 0.0f, 0.3f);
  DeviceBuffer d_state = upload_f32(state);
  for (int step = 0; step < 3; ++step) {
    const auto x = bf16_values(normal(C, rng, 0.0f, 1.0f));
    const auto z = bf16_values(normal(V, rng, 0.0f, 1.0f));
    const auto a = bf16_values(normal(Hv, rng, 0.0f, 1.5f));
    const auto b = bf16_values(normal(Hv, rng, 0.0f, 1.5f));
    DeviceBuffer d_x = upload_bf16(x), d_z = upload_bf16(z), d_a = upload_bf16(a), d_b = upload_bf16(b);
    DeviceBuffer d_out = poisoned(size_t(V) * 2);
    cuda::gdn_decode(d, fx.params(), d_x.as<__nv_bfloat16>(), d_z.as<__nv_bfloat16>(),
                     d_a.as<__nv_bfloat16>(), d_b.as<__nv_bfloat16>(), d_state.as<float>(),
                     d_out.as<__nv_bfloat16>(), nullptr);
    std::vector<float> ref(V);
    fx.reference_token(x.data(), z.data(), a.data(), b.data(), state, ref.data());
    const double out_err = max_rel(download_bf16(d_out, V), ref, kFloor);
    const double state_err = max_abs_scaled(download_f32(d_state, d.state_elems()), state);
    std::printf("[gdn decode] D=%d step %d: output max rel err %.3g, state max err %.3g\n",
                d.key_head_dim, step, out_err, state_err);
    EXPECT_LT(out_err, kBf16Tol) << "step " << step;
    EXPECT_LT(state_err, kStateTol) << "step " << step;
  }
}

TEST(GdnDecode, FusedStepMatchesSequentialReference) { expect_decode_matches(cuda::GdnDims{}); }
TEST(GdnDecode, FusedStepMatchesSequentialReferenceDemoDims) { expect_decode_matches(demo_gdn_dims()); }

// ---- chunked prefill ------------------------------------------------------------------------------

/// Turns the two-pass GDN prefill on or off for one scope (the process-wide switch is restored).
struct ScopedTwoPass : ScopedSwitch<bool> {
  explicit ScopedTwoPass(bool on) : ScopedSwitch(cuda::gdn_chunk_parallel_enabled, cuda::set_gdn_chunk_parallel_enabled, on) {}
};

/// gdn_prefill with a workspace of the size it asks for (so the two-pass form runs when the
/// switch is on); arguments as gdn_prefill's.
void prefill_with_workspace(const cuda::GdnDims& d, const cuda::GdnParams& params, int T, const __nv_bfloat16* x,
                            const __nv_bfloat16* zp, int64_t zab_stride, float* state, __nv_bfloat16* out) {
  const int V = d.value_dim(), Hv = d.n_value_heads;
  const size_t bytes = cuda::gdn_prefill_workspace_bytes(d, T);
  DeviceBuffer ws = poisoned(bytes);
  cuda::gdn_prefill(d, params, T, x, zp, zp + V, zp + V + Hv, zab_stride, state, out, nullptr, ws.as<float>(), bytes);
  CUDA_CHECK(cudaDeviceSynchronize());
}

/// Chunked prefill of T tokens (z/a/b inside fused rows of V + 2·Hv + `zab_pad` columns)
/// against the sequential reference: outputs per token and the final state; `two_pass` selects
/// the two-pass form. A stride that is not a multiple of Dv/32 makes the gated norm use scalar
/// loads.
void expect_chunked_prefill_matches(int T, float A_log_lo, float A_log_hi, uint64_t seed,
                                    const cuda::GdnDims& shape = {}, bool two_pass = false, int zab_pad = 40) {
  std::mt19937_64 rng(seed);
  GdnFixture fx(rng, A_log_lo, A_log_hi, shape);
  const auto& d = fx.dims;
  const int C = fx.C, V = d.value_dim(), Hv = d.n_value_heads;
  const int64_t zab_stride = V + 2 * Hv + zab_pad;  // z | a | b | unused
  const auto x = bf16_values(normal(int64_t(T) * C, rng, 0.0f, 1.0f));
  auto zab = bf16_values(normal(T * zab_stride, rng, 0.0f, 1.0f));
  for (int t = 0; t < T; ++t)  // a, b with a wider spread (decays from ~0 to ~1), still bf16
    for (int j = 0; j < 2 * Hv; ++j) zab[t * zab_stride + V + j] = round_bf16(1.5f * zab[t * zab_stride + V + j]);
  std::vector<float> state = normal(d.state_elems(), rng, 0.0f, 0.3f);
  DeviceBuffer d_x = upload_bf16(x), d_zab = upload_bf16(zab), d_state = upload_f32(state);
  DeviceBuffer d_out = poisoned(size_t(T) * V * 2);
  const __nv_bfloat16* zp = d_zab.as<__nv_bfloat16>();
  {
    ScopedTwoPass mode(two_pass);
    prefill_with_workspace(d, fx.params(), T, d_x.as<__nv_bfloat16>(), zp, zab_stride, d_state.as<float>(),
                           d_out.as<__nv_bfloat16>());
  }
  std::vector<float> ref(int64_t(T) * V);
  for (int t = 0; t < T; ++t) {
    const float* row = zab.data() + t * zab_stride;
    fx.reference_token(x.data() + int64_t(t) * C, row, row + V, row + V + Hv, state,
                       ref.data() + int64_t(t) * V);
  }
  const auto out = download_bf16(d_out, int64_t(T) * V);
  const double out_err = max_rel(out, ref, kFloor), out_rms = rms_rel(out, ref);
  const double state_err = max_abs_scaled(download_f32(d_state, d.state_elems()), state);
  std::printf("[gdn chunked prefill%s] D=%d T=%d A_log in [%g, %g]: output max rel err %.3g, rms rel err %.3g, "
              "final state max err %.3g\n", two_pass ? ", two passes" : "", d.key_head_dim, T, A_log_lo, A_log_hi, out_err, out_rms, state_err);
  EXPECT_LT(out_err, kPrefillElemTol);
  EXPECT_LT(out_rms, kPrefillRmsTol);
  EXPECT_LT(state_err, kStateTol);
}

/// A chunked-prefill case: T tokens from rng `seed`, A_log drawn from [A_log_lo, A_log_hi], shape
/// `dims`, z/a/b rows padded by `zab_pad` columns; checked by expect_chunked_prefill_matches in
/// one kernel (kChunkedCases) or in two passes (kTwoPassCases). `label` is the case's test name.
struct ChunkedPrefillCase {
  const char* label;
  int T;
  float A_log_lo, A_log_hi;
  uint64_t seed;
  cuda::GdnDims dims;
  int zab_pad;

  std::string name() const { return label; }
  friend void PrintTo(const ChunkedPrefillCase& c, std::ostream* os) { *os << c.name(); }
};

/// The one-kernel cases: one token, one full chunk, a partial last chunk, strong and weak decay
/// (real and demo shapes), and z strides that are not a multiple of the vector width, with which
/// the gated norm uses scalar loads: ≡ 2 (mod 4) at the real shape, then odd at the demo shape
/// (these two were one test, ChunkedEqualsSequentialZStrideNotVectorAligned).
const std::vector<ChunkedPrefillCase> kChunkedCases = {
    {"OneToken", 1, -2.0f, 1.0f, 31, cuda::GdnDims{}, 40},
    {"OneFullChunk", 64, -2.0f, 1.0f, 32, cuda::GdnDims{}, 40},
    {"PartialLastChunk", 257, -2.0f, 1.0f, 33, cuda::GdnDims{}, 40},
    {"StrongDecay", 130, 1.0f, 3.0f, 34, cuda::GdnDims{}, 40},
    {"WeakDecay", 200, -6.0f, -3.0f, 35, cuda::GdnDims{}, 40},
    {"DemoDimsOneToken", 1, -2.0f, 1.0f, 36, demo_gdn_dims(), 40},
    {"DemoDimsPartialLastChunk", 257, -2.0f, 1.0f, 37, demo_gdn_dims(), 40},
    {"DemoDimsStrongDecay", 130, 1.0f, 3.0f, 38, demo_gdn_dims(), 40},
    {"ZStrideNotVectorAligned", 70, -2.0f, 1.0f, 39, cuda::GdnDims{}, 42},
    {"DemoDimsZStrideNotVectorAligned", 70, -2.0f, 1.0f, 39, demo_gdn_dims(), 41},
};

/// The one-kernel case table (kChunkedCases) against the sequential reference.
class GdnPrefillChunked : public testing::TestWithParam<ChunkedPrefillCase> {};

TEST_P(GdnPrefillChunked, EqualsSequential) {
  const ChunkedPrefillCase& c = GetParam();
  expect_chunked_prefill_matches(c.T, c.A_log_lo, c.A_log_hi, c.seed, c.dims, false, c.zab_pad);
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnPrefillChunked, testing::ValuesIn(kChunkedCases), CaseName());

/// Random inputs of a T-token prefill (z|a|b rows of stride V + 2·Hv), uploaded, with two copies
/// of the start state and two output buffers on the device: for comparing two ways to run it.
struct TwoPrefills {
  TwoPrefills(const GdnFixture& fx, std::mt19937_64& rng, int T)
      : V(fx.dims.value_dim()), Hv(fx.dims.n_value_heads), zab_stride(V + 2 * Hv),
        d_x(upload_bf16(bf16_values(normal(int64_t(T) * fx.C, rng, 0.0f, 1.0f)))),
        d_zab(upload_bf16(bf16_values(normal(T * zab_stride, rng, 0.0f, 1.0f)))) {
    const auto state0 = normal(fx.dims.state_elems(), rng, 0.0f, 0.3f);
    d_s1 = upload_f32(state0);
    d_s2 = upload_f32(state0);
    d_o1 = poisoned(size_t(T) * V * 2);
    d_o2 = poisoned(size_t(T) * V * 2);
  }
  const __nv_bfloat16* x() const { return d_x.as<__nv_bfloat16>(); }
  const __nv_bfloat16* zab() const { return d_zab.as<__nv_bfloat16>(); }
  int V, Hv;
  int64_t zab_stride;
  DeviceBuffer d_x, d_zab, d_s1, d_s2, d_o1, d_o2;
};

/// The two-pass cases (LILY_CUDA_GDN_CHUNK_PARALLEL), against the same reference and bounds:
/// the one-kernel cases with the same arguments, less the demo shape's one token and the z
/// strides.
const std::vector<ChunkedPrefillCase> kTwoPassCases = {
    {"OneToken", 1, -2.0f, 1.0f, 31, cuda::GdnDims{}, 40},
    {"OneFullChunk", 64, -2.0f, 1.0f, 32, cuda::GdnDims{}, 40},
    {"PartialLastChunk", 257, -2.0f, 1.0f, 33, cuda::GdnDims{}, 40},
    {"StrongDecay", 130, 1.0f, 3.0f, 34, cuda::GdnDims{}, 40},
    {"WeakDecay", 200, -6.0f, -3.0f, 35, cuda::GdnDims{}, 40},
    {"DemoDimsPartialLastChunk", 257, -2.0f, 1.0f, 37, demo_gdn_dims(), 40},
    {"DemoDimsStrongDecay", 130, 1.0f, 3.0f, 38, demo_gdn_dims(), 40},
};

/// The two-pass case table (kTwoPassCases) against the sequential reference.
class GdnPrefillTwoPass : public testing::TestWithParam<ChunkedPrefillCase> {};

TEST_P(GdnPrefillTwoPass, EqualsSequential) {
  const ChunkedPrefillCase& c = GetParam();
  expect_chunked_prefill_matches(c.T, c.A_log_lo, c.A_log_hi, c.seed, c.dims, true, c.zab_pad);
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnPrefillTwoPass, testing::ValuesIn(kTwoPassCases), CaseName());

/// The two passes against the one-kernel form at 2,048 tokens (the backend's chunk): the same
/// fp32 arithmetic but for the order of the solve, so much closer than either is to the
/// sequential reference. A short workspace is refused before anything runs.
TEST(GdnPrefill, TwoPassMatchesOneKernelAtTheBackendsChunk) {
  std::mt19937_64 rng(61);
  GdnFixture fx(rng, -2.0f, 1.0f);
  const auto& d = fx.dims;
  const int T = 2048;
  TwoPrefills io(fx, rng, T);
  const __nv_bfloat16* zp = io.zab();
  {
    ScopedTwoPass mode(false);
    prefill_with_workspace(d, fx.params(), T, io.x(), zp, io.zab_stride, io.d_s1.as<float>(),
                           io.d_o1.as<__nv_bfloat16>());
  }
  {
    ScopedTwoPass mode(true);
    prefill_with_workspace(d, fx.params(), T, io.x(), zp, io.zab_stride, io.d_s2.as<float>(),
                           io.d_o2.as<__nv_bfloat16>());
    DeviceBuffer small(cuda::gdn_prefill_workspace_bytes(d, T) - 4);
    EXPECT_THROW(cuda::gdn_prefill(d, fx.params(), T, io.x(), zp, zp + io.V, zp + io.V + io.Hv, io.zab_stride,
                                   io.d_s2.as<float>(), io.d_o2.as<__nv_bfloat16>(), nullptr, small.as<float>(),
                                   small.bytes()),
                 Error);
  }
  const auto s1 = download_f32(io.d_s1, d.state_elems());
  const double state_err = max_abs_scaled(download_f32(io.d_s2, d.state_elems()), s1);
  const double out_err =
      max_rel(download_bf16(io.d_o2, int64_t(T) * io.V), download_bf16(io.d_o1, int64_t(T) * io.V), kFloor);
  std::printf("[gdn two passes vs one kernel] T=%d: output max rel %.3g, state max %.3g\n", T, out_err, state_err);
  EXPECT_LT(state_err, kStateTol);
  EXPECT_LT(out_err, kPrefillElemTol);
}

/// Selects pass 2 of the two-pass prefill for one scope: tensor cores (true) or the fp32 walk.
struct ScopedStateMma : ScopedSwitch<bool> {
  explicit ScopedStateMma(bool on) : ScopedSwitch(cuda::gdn_state_mma_enabled, cuda::set_gdn_state_mma_enabled, on) {}
};

/// The tensor-core pass 2 (split tf32 products) against the fp32 walk it replaced, both after
/// the same pass 1, over T tokens from a non-zero start state. Each split product is within
/// ~2^-21 relative of the exact one (fp32's own rounding is 2^-24) and the sums run in another
/// order (and the tensor cores' fp32 adds need not round to nearest), so the two final states
/// differ by fp32-level rounding carried through the chunks: expected ~1e-6 … 1e-5 of the
/// state's scale. The bound is the one both fp32 forms meet against the sequential recurrence
/// (kStateTol, 1e-4): the new pass must be no worse than that, and what it is there to catch
/// sits orders above it (a wrong fragment index or barrier: errors of the state's own size;
/// plain one-part tf32: ~2^-11 per product, ~1e-3 after a few dozen chunks). Outputs: a pre-norm
/// o next to a bf16 rounding boundary may round to the neighbour in one of the two (one ulp,
/// 2^-8 … 2^-7 relative), and the gated norm's rounding can add one more: the elementwise bound
/// is the chunked forms' (two ulps); such flips are rare, so the rms bound is half of theirs.
/// The measured values are printed. The tensor-core pass 1 (bf16 KKᵀ/QKᵀ with exact products,
/// split-tf32 U and W) against the fp32 pass 1 is held to the same bounds for the same reasons.
/// `Scope` selects the pass under test (ScopedStateMma or ScopedLocalMma): constructed with
/// false for the fp32 run, true for the tensor-core run.
template <class Scope>
void expect_tensor_core_pass_matches_fp32(const char* what, int T, uint64_t seed, const cuda::GdnDims& shape = {}) {
  std::mt19937_64 rng(seed);
  GdnFixture fx(rng, -2.0f, 1.0f, shape);
  const auto& d = fx.dims;
  TwoPrefills io(fx, rng, T);
  const __nv_bfloat16* zp = io.zab();
  ScopedTwoPass two_pass(true);
  {
    Scope mode(false);
    prefill_with_workspace(d, fx.params(), T, io.x(), zp, io.zab_stride, io.d_s1.as<float>(),
                           io.d_o1.as<__nv_bfloat16>());
  }
  {
    Scope mode(true);
    prefill_with_workspace(d, fx.params(), T, io.x(), zp, io.zab_stride, io.d_s2.as<float>(),
                           io.d_o2.as<__nv_bfloat16>());
  }
  const auto s1 = download_f32(io.d_s1, d.state_elems());
  const double state_err = max_abs_scaled(download_f32(io.d_s2, d.state_elems()), s1);
  const auto o1 = download_bf16(io.d_o1, int64_t(T) * io.V), o2 = download_bf16(io.d_o2, int64_t(T) * io.V);
  const double out_err = max_rel(o2, o1, kFloor), out_rms = rms_rel(o2, o1);
  std::printf("[gdn %s tensor cores vs fp32] D=%d T=%d: output max rel %.3g, rms rel %.3g, state max %.3g\n", what,
              d.key_head_dim, T, out_err, out_rms, state_err);
  EXPECT_LT(state_err, kStateTol);
  EXPECT_LT(out_err, kPrefillElemTol);
  EXPECT_LT(out_rms, kPrefillRmsTol / 2);
}

/// Selects pass 1 of the two-pass prefill for one scope: tensor cores (true) or fp32.
struct ScopedLocalMma : ScopedSwitch<bool> {
  explicit ScopedLocalMma(bool on) : ScopedSwitch(cuda::gdn_local_mma_enabled, cuda::set_gdn_local_mma_enabled, on) {}
};

/// A tensor-core pass case: T tokens from rng `seed`, shape `dims`; checked by
/// expect_tensor_core_pass_matches_fp32 for pass 2 (kStateMmaCases) or pass 1 (kLocalMmaCases).
/// `label` is the case's test name.
struct TensorCorePassCase {
  const char* label;
  int T;
  uint64_t seed;
  cuda::GdnDims dims;

  std::string name() const { return label; }
  friend void PrintTo(const TensorCorePassCase& c, std::ostream* os) { *os << c.name(); }
};

/// The pass-2 cases: a ragged chunk past the backend's 2,048 tokens, one token, the demo shape.
const std::vector<TensorCorePassCase> kStateMmaCases = {
    {"RaggedLongChunk", 2048 + 37, 71, cuda::GdnDims{}},
    {"OneToken", 1, 72, cuda::GdnDims{}},
    {"DemoDims", 300, 73, demo_gdn_dims()},
};

/// The pass-2 case table (kStateMmaCases): tensor cores (ScopedStateMma) against the fp32 walk.
class GdnPrefillStateMma : public testing::TestWithParam<TensorCorePassCase> {};

TEST_P(GdnPrefillStateMma, MatchesFp32Walk) {
  const TensorCorePassCase& c = GetParam();
  expect_tensor_core_pass_matches_fp32<ScopedStateMma>("pass 2", c.T, c.seed, c.dims);
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnPrefillStateMma, testing::ValuesIn(kStateMmaCases), CaseName());

/// The pass-1 cases: the same shapes as the pass-2 cases, other seeds.
const std::vector<TensorCorePassCase> kLocalMmaCases = {
    {"RaggedLongChunk", 2048 + 37, 81, cuda::GdnDims{}},
    {"OneToken", 1, 82, cuda::GdnDims{}},
    {"DemoDims", 300, 83, demo_gdn_dims()},
};

/// The pass-1 case table (kLocalMmaCases): tensor cores (ScopedLocalMma) against fp32.
class GdnPrefillLocalMma : public testing::TestWithParam<TensorCorePassCase> {};

TEST_P(GdnPrefillLocalMma, MatchesFp32) {
  const TensorCorePassCase& c = GetParam();
  expect_tensor_core_pass_matches_fp32<ScopedLocalMma>("pass 1", c.T, c.seed, c.dims);
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnPrefillLocalMma, testing::ValuesIn(kLocalMmaCases), CaseName());

/// Prefill of a sequence in two pieces equals one piece (the state carries over).
TEST(GdnPrefill, SplitSequenceEqualsOnePass) {
  std::mt19937_64 rng(41);
  GdnFixture fx(rng, -2.0f, 1.0f);
  const auto& d = fx.dims;
  const int C = fx.C, T = 150, T1 = 70;
  TwoPrefills io(fx, rng, T);
  const int V = io.V, Hv = io.Hv;
  const int64_t zab_stride = io.zab_stride;
  DeviceBuffer &d_s1 = io.d_s1, &d_s2 = io.d_s2, &d_o1 = io.d_o1, &d_o2 = io.d_o2;
  const __nv_bfloat16* xp = io.x();
  const __nv_bfloat16* zp = io.zab();
  __nv_bfloat16* o2 = d_o2.as<__nv_bfloat16>();
  cuda::gdn_prefill(d, fx.params(), T, xp, zp, zp + V, zp + V + Hv, zab_stride, d_s1.as<float>(),
                    d_o1.as<__nv_bfloat16>(), nullptr);
  cuda::gdn_prefill(d, fx.params(), T1, xp, zp, zp + V, zp + V + Hv, zab_stride, d_s2.as<float>(),
                    o2, nullptr);
  const int64_t off = int64_t(T1) * zab_stride;
  cuda::gdn_prefill(d, fx.params(), T - T1, xp + int64_t(T1) * C, zp + off, zp + off + V,
                    zp + off + V + Hv, zab_stride, d_s2.as<float>(), o2 + int64_t(T1) * V, nullptr);
  const auto s1 = download_f32(d_s1, d.state_elems());
  EXPECT_LT(max_abs_scaled(download_f32(d_s2, d.state_elems()), s1), kStateTol);
  EXPECT_LT(max_rel(download_bf16(d_o2, int64_t(T) * V), download_bf16(d_o1, int64_t(T) * V), kFloor),
            kPrefillElemTol);
}

TEST(GdnDims, RejectsShapesTheKernelsWereNotWrittenFor) {
  ModelConfig cfg;
  cfg.gdn_n_key_heads = 16;
  cfg.gdn_n_value_heads = 32;
  cfg.gdn_key_head_dim = 64;
  cfg.gdn_value_head_dim = 128;
  cfg.gdn_conv_kernel = 4;
  EXPECT_THROW(cuda::gdn_dims(cfg), Error);
  cfg.gdn_key_head_dim = 128;
  EXPECT_EQ(cuda::gdn_dims(cfg).conv_channels(), 8192);
  cfg.gdn_key_head_dim = 64;  // the demo model: Dk = Dv = 64
  cfg.gdn_value_head_dim = 64;
  EXPECT_EQ(cuda::gdn_dims(cfg).conv_channels(), 4096);
  cfg.gdn_key_head_dim = 96;  // no kernel for other equal dims
  cfg.gdn_value_head_dim = 96;
  EXPECT_THROW(cuda::gdn_dims(cfg), Error);
  cfg.gdn_key_head_dim = 128;
  cfg.gdn_value_head_dim = 128;
  cfg.gdn_n_value_heads = 24;
  cfg.gdn_n_key_heads = 16;
  EXPECT_THROW(cuda::gdn_dims(cfg), Error);
}

/// Timing printout (timings are never assertions) of a 4096-token chunked prefill, the conv and
/// the gated norm at 2,048 tokens, and a decode step, after which outputs and the state must
/// still be finite.
TEST(GdnTiming, PrintsKernelTimes) {
  std::mt19937_64 rng(51);
  GdnFixture fx(rng, -2.0f, 1.0f);
  const auto& d = fx.dims;
  const int C = fx.C, V = d.value_dim(), Hv = d.n_value_heads, T = 4096;
  const int64_t zab_stride = V + 2 * Hv;
  DeviceBuffer d_x = upload_bf16(normal(int64_t(T) * C, rng, 0.0f, 1.0f));
  DeviceBuffer d_zab = upload_bf16(normal(T * zab_stride, rng, 0.0f, 1.0f));
  DeviceBuffer d_state = upload_f32(normal(d.state_elems(), rng, 0.0f, 0.3f));
  DeviceBuffer d_out(size_t(T) * V * 2);
  const __nv_bfloat16* zp = d_zab.as<__nv_bfloat16>();
  // Mean ms of one call over `reps` after one warm-up (events on the default stream).
  auto time_ms = [](auto&& fn, int reps) { return static_cast<float>(test::events_us(nullptr, 1, reps, fn) / 1000.0); };
  const float prefill_ms = time_ms([&] {
    cuda::gdn_prefill(d, fx.params(), T, d_x.as<__nv_bfloat16>(), zp, zp + V, zp + V + Hv, zab_stride,
                      d_state.as<float>(), d_out.as<__nv_bfloat16>(), nullptr);
  }, 5);
  float two_pass_ms = 0;
  {
    ScopedTwoPass mode(true);
    const size_t bytes = cuda::gdn_prefill_workspace_bytes(d, T);
    DeviceBuffer ws(bytes);
    two_pass_ms = time_ms([&] {
      cuda::gdn_prefill(d, fx.params(), T, d_x.as<__nv_bfloat16>(), zp, zp + V, zp + V + Hv, zab_stride,
                        d_state.as<float>(), d_out.as<__nv_bfloat16>(), nullptr, ws.as<float>(), bytes);
    }, 5);
  }
  std::printf("[gdn timing] chunked prefill T=%d in two passes: %.3f ms/layer\n", T, two_pass_ms);
  {  // the same at the backend's chunk (2,048), pass 2 on tensor cores and as the fp32 walk
    ScopedTwoPass mode(true);
    const int T2 = 2048;
    const size_t bytes = cuda::gdn_prefill_workspace_bytes(d, T2);
    DeviceBuffer ws(bytes);
    float ms[3] = {};  // pass 1 / pass 2 on tensor cores: 0 neither, 1 pass 2, 2 both
    for (int mode = 0; mode < 3; ++mode) {
      ScopedStateMma state_mode(mode >= 1);
      ScopedLocalMma local_mode(mode == 2);
      ms[mode] = time_ms([&] {
        cuda::gdn_prefill(d, fx.params(), T2, d_x.as<__nv_bfloat16>(), zp, zp + V, zp + V + Hv, zab_stride,
                          d_state.as<float>(), d_out.as<__nv_bfloat16>(), nullptr, ws.as<float>(), bytes);
      }, 10);
    }
    std::printf("[gdn timing] two passes T=%d: %.3f ms/layer with both passes on tensor cores, %.3f with pass 2 "
                "only, %.3f with neither\n", T2, ms[2], ms[1], ms[0]);
  }
  {  // the two memory-bound prefill kernels at the backend's chunk, in its layout: the conv reads
     // and the norm's z sits in qkv|z|a|b rows of C + V + 2·Hv columns (12352 for the 35B shape)
    const int T2 = 2048;
    const int64_t R = C + V + 2 * Hv;
    DeviceBuffer rows = upload_bf16(normal(T2 * R, rng, 0.0f, 1.0f));
    DeviceBuffer window = upload_bf16(normal(int64_t(C) * (d.conv_kernel - 1), rng, 0.0f, 1.0f));
    DeviceBuffer conv(size_t(T2) * C * 2);
    const __nv_bfloat16* rp = rows.as<__nv_bfloat16>();
    const float conv_us = 1000 * time_ms([&] {
      cuda::gdn_conv_prefill(d, fx.params(), T2, rp, R, window.as<__nv_bfloat16>(), conv.as<__nv_bfloat16>(),
                             nullptr);
    }, 20);
    const float norm_us = 1000 * time_ms([&] {
      cuda::gdn_gated_norm(d, fx.params(), T2, rp + C, R, d_out.as<__nv_bfloat16>(), nullptr);
    }, 20);
    std::printf("[gdn timing] T=%d, rows of %lld: conv prefill (with the window update) %.1f us/layer, gated "
                "norm %.1f us/layer\n", T2, static_cast<long long>(R), conv_us, norm_us);
  }
  const float decode_us = 1000 * time_ms([&] {
    cuda::gdn_decode(d, fx.params(), d_x.as<__nv_bfloat16>(), zp, zp + V, zp + V + Hv,
                     d_state.as<float>(), d_out.as<__nv_bfloat16>(), nullptr);
  }, 100);
  std::printf("[gdn timing] chunked prefill T=%d: %.3f ms/layer; decode step: %.2f us/layer\n", T,
              prefill_ms, decode_us);
  for (float v : download_bf16(d_out, V)) ASSERT_TRUE(std::isfinite(v));
  for (float v : download_f32(d_state, d.state_elems())) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace lily
