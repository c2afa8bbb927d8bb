// GPU tests of the gated-attention kernels (src/backends/cuda/attention.cu) against fp32
// references built from the CPU backend's ops (docs/model.md §3.4), at the real shape:
// 16 query heads, 2 kv heads, head_dim 256, rotary 64, θ 1e7; contexts 1, 257, 4096, 40000
// (split-K boundaries); plus the demo model's shape (4 / 2 / 64, rotary 16) and head_dim 128.
// Inputs are random; outputs are poisoned (NaN) before launch.
// Tolerance: bf16 outputs within 1e-2 relative (|out − ref| / (|ref| + 1e-2·rms(ref))).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backends/cpu/ops.h"
#include "backends/cuda/device_buffer.h"
#include "device_io.h"
#include "backends/cuda/mixer_kernels.h"
#include "base/bf16.h"

namespace lily {
namespace {

using cuda::DeviceBuffer;
using bf16_t = __nv_bfloat16;

using test::download_bf16;
using test::max_rel;
using test::normal_bf16;
using test::poisoned;
using test::uniform;
using test::upload_bf16;
using test::upload_f32;

constexpr double kBf16Tol = 1e-2;

cuda::AttnDims real_dims() { return cuda::AttnDims{}; }  // 16 / 2 / 256, rotary 64, θ 1e7

/// The demo model's shape (models/demo): 4 query heads, 2 kv heads, head_dim 64, rotary 16.
cuda::AttnDims demo_dims() {
  cuda::AttnDims d;
  d.n_heads = 4;
  d.n_kv_heads = 2;
  d.head_dim = 64;
  d.rotary_dim = 16;
  return d;
}

/// A head_dim-128 shape with a GQA group of 8 (16 / 2) and rotary 32.
cuda::AttnDims dims_128() {
  cuda::AttnDims d;
  d.head_dim = 128;
  d.rotary_dim = 32;
  return d;
}

/// A KV cache [nkv, capacity, D] with random bf16 content in positions [0, filled) (host copy
/// kept as fp32) and poison beyond.
struct Cache {
  int nkv, D;
  int64_t capacity;
  std::vector<float> k, v;  // host copies [nkv, capacity, D]
  DeviceBuffer dk, dv;
  Cache(const cuda::AttnDims& dims, int64_t capacity_, int64_t filled, std::mt19937_64& rng)
      : nkv(dims.n_kv_heads), D(dims.head_dim), capacity(capacity_) {
    const int64_t n = int64_t(nkv) * capacity * D;
    k = normal_bf16(n, rng, 1.0f);
    v = normal_bf16(n, rng, 1.0f);
    for (int h = 0; h < nkv; ++h)
      for (int64_t p = filled; p < capacity; ++p)
        for (int d = 0; d < D; ++d) k[(h * capacity + p) * D + d] = v[(h * capacity + p) * D + d] = NAN;
    dk = upload_bf16(k);
    dv = upload_bf16(v);
  }
  cuda::KvCacheView view() const { return {dk.as<bf16_t>(), dv.as<bf16_t>(), capacity}; }
  const float* k_at(int h, int64_t p) const { return k.data() + (h * capacity + p) * D; }
  const float* v_at(int h, int64_t p) const { return v.data() + (h * capacity + p) * D; }
};

/// Reference gated attention of one query head h over keys [0, len): softmax(q·k·scale)·V,
/// times sigmoid(gate) when gate is non-null.
std::vector<float> reference_head(const cuda::AttnDims& dims, const Cache& cache, int h,
                                  const float* q, int64_t len, const float* gate) {
  const int D = dims.head_dim, kvh = h / (dims.n_heads / dims.n_kv_heads);
  std::vector<float> scores(len), out(D);
  cpu::attention_head(q, cache.k_at(kvh, 0), cache.v_at(kvh, 0), len, D, D, dims.scale(),
                      scores.data(), out.data());
  if (gate)
    for (int d = 0; d < D; ++d) out[d] *= cpu::sigmoid(gate[d]);
  return out;
}

// ---- prepare: q/k norm + RoPE + append ---------------------------------------------------------

void expect_prepare_matches(int T, int64_t pos0, bool device_pos,
                            const cuda::AttnDims& dims = real_dims()) {
  std::mt19937_64 rng(7 + T);
  const int nq = dims.n_heads, nkv = dims.n_kv_heads, D = dims.head_dim;
  const int64_t qg_stride = int64_t(nq) * 2 * D + 1024 + 8, kv_stride = int64_t(nkv) * D + 8;
  const auto qg = normal_bf16(T * qg_stride, rng, 1.0f);
  const auto kin = normal_bf16(T * kv_stride, rng, 1.0f), vin = normal_bf16(T * kv_stride, rng, 1.0f);
  const auto q_norm = uniform(D, rng, 0.5f, 1.5f), k_norm = uniform(D, rng, 0.5f, 1.5f);
  Cache cache(dims, pos0 + T + 3, pos0, rng);
  DeviceBuffer d_qg = upload_bf16(qg), d_k = upload_bf16(kin), d_v = upload_bf16(vin);
  DeviceBuffer d_qn = upload_f32(q_norm), d_kn = upload_f32(k_norm);
  DeviceBuffer d_q = poisoned(size_t(T) * nq * D * 2);
  DeviceBuffer d_pos(4);
  const int32_t pos32 = int32_t(pos0);
  CUDA_CHECK(cudaMemcpy(d_pos.data(), &pos32, 4, cudaMemcpyHostToDevice));
  cuda::attention_prepare(dims, T, d_qg.as<bf16_t>(), qg_stride, d_k.as<bf16_t>(), d_v.as<bf16_t>(),
                          kv_stride, d_qn.as<float>(), d_kn.as<float>(), device_pos ? 0 : pos0,
                          device_pos ? d_pos.as<int32_t>() : nullptr, cache.view(),
                          d_q.as<bf16_t>(), nullptr);

  // Reference: RMSNorm → bf16 → RoPE (fp32) → bf16.
  auto prep = [&](const float* x, const std::vector<float>& gain, int64_t pos) {
    std::vector<float> y(D), c(dims.rotary_dim / 2), s(dims.rotary_dim / 2);
    cpu::rms_norm(x, gain.data(), D, dims.norm_eps, y.data());
    for (auto& e : y) e = round_bf16(e);
    cpu::rope_cos_sin(pos, dims.rotary_dim, dims.rope_theta, c.data(), s.data());
    cpu::apply_rope(y.data(), dims.rotary_dim, c.data(), s.data());
    for (auto& e : y) e = round_bf16(e);
    return y;
  };
  const auto q_out = download_bf16(d_q.as<bf16_t>(), int64_t(T) * nq * D);
  const auto k_all = download_bf16(cache.dk.as<bf16_t>(), int64_t(nkv) * cache.capacity * D);
  const auto v_all = download_bf16(cache.dv.as<bf16_t>(), int64_t(nkv) * cache.capacity * D);
  std::vector<float> got, ref;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nq; ++h) {
      const auto y = prep(qg.data() + t * qg_stride + int64_t(h) * 2 * D, q_norm, pos0 + t);
      ref.insert(ref.end(), y.begin(), y.end());
      got.insert(got.end(), q_out.begin() + (int64_t(t) * nq + h) * D, q_out.begin() + (int64_t(t) * nq + h + 1) * D);
    }
    for (int h = 0; h < nkv; ++h) {
      const auto y = prep(kin.data() + t * kv_stride + int64_t(h) * D, k_norm, pos0 + t);
      ref.insert(ref.end(), y.begin(), y.end());
      const int64_t slot = (h * cache.capacity + pos0 + t) * D;
      got.insert(got.end(), k_all.begin() + slot, k_all.begin() + slot + D);
      for (int d = 0; d < D; ++d)
        ASSERT_EQ(v_all[slot + d], vin[t * kv_stride + int64_t(h) * D + d]) << "V copy t=" << t;
    }
  }
  const double err = max_rel(got, ref);
  std::printf("[attn prepare] D=%d T=%d pos0=%lld: q/k max rel err %.3g\n", D, T, (long long)pos0, err);
  EXPECT_LT(err, kBf16Tol);
  // Positions before pos0 and after pos0+T are untouched.
  for (int h = 0; h < nkv; ++h) {
    for (int64_t p : {pos0 - 1, pos0 + T}) {
      if (p < 0) continue;
      const int64_t slot = (h * cache.capacity + p) * D;
      for (int d = 0; d < D; ++d) {
        const float want = cache.k[slot + d];
        if (std::isnan(want)) EXPECT_TRUE(std::isnan(k_all[slot + d])) << "position " << p;
        else EXPECT_EQ(k_all[slot + d], want) << "position " << p;
      }
    }
  }
}

TEST(AttentionPrepare, NormRopeAppendAtStart) { expect_prepare_matches(3, 0, false); }
TEST(AttentionPrepare, NormRopeAppendAtLongPosition) { expect_prepare_matches(5, 39995, false); }
TEST(AttentionPrepare, DevicePositionForDecodeGraphs) { expect_prepare_matches(1, 4095, true); }
TEST(AttentionPrepare, DemoDims) { expect_prepare_matches(7, 300, false, demo_dims()); }
TEST(AttentionPrepare, DemoDimsDevicePosition) { expect_prepare_matches(1, 40, true, demo_dims()); }
TEST(AttentionPrepare, HeadDim128) { expect_prepare_matches(3, 1000, false, dims_128()); }

// ---- decode --------------------------------------------------------------------------------------

void expect_decode_matches(int64_t len, int n_splits, bool device_len,
                           const cuda::AttnDims& dims = real_dims()) {
  std::mt19937_64 rng(1000 + len + n_splits);
  const int nq = dims.n_heads, D = dims.head_dim;
  Cache cache(dims, len + 5, len, rng);
  const auto q = normal_bf16(int64_t(nq) * D, rng, 1.0f);
  const auto qg_row = normal_bf16(int64_t(nq) * 2 * D, rng, 1.0f);  // gates at [h·2D + D, …)
  DeviceBuffer d_q = upload_bf16(q), d_gate = upload_bf16(qg_row);
  DeviceBuffer d_out = poisoned(size_t(nq) * D * 2);
  const size_t ws_bytes = cuda::attention_decode_workspace_bytes(dims, n_splits);
  DeviceBuffer d_ws = poisoned(ws_bytes);
  DeviceBuffer d_len(4);
  const int32_t len32 = int32_t(len);
  CUDA_CHECK(cudaMemcpy(d_len.data(), &len32, 4, cudaMemcpyHostToDevice));
  cuda::attention_decode(dims, d_q.as<bf16_t>(), d_gate.as<bf16_t>(), cache.view(),
                         device_len ? 0 : len, device_len ? d_len.as<int32_t>() : nullptr, n_splits,
                         d_ws.as<float>(), ws_bytes, d_out.as<bf16_t>(), nullptr);
  std::vector<float> ref;
  for (int h = 0; h < nq; ++h) {
    const auto o = reference_head(dims, cache, h, q.data() + int64_t(h) * D, len,
                                  qg_row.data() + int64_t(h) * 2 * D + D);
    ref.insert(ref.end(), o.begin(), o.end());
  }
  const double err = max_rel(download_bf16(d_out.as<bf16_t>(), int64_t(nq) * D), ref);
  std::printf("[attn decode] D=%d len=%lld splits=%d%s: max rel err %.3g\n", D, (long long)len, n_splits,
              device_len ? " (device len)" : "", err);
  EXPECT_LT(err, kBf16Tol);
}

TEST(AttentionDecode, Context1) { expect_decode_matches(1, cuda::attention_decode_splits(1), false); }
TEST(AttentionDecode, Context257) { expect_decode_matches(257, cuda::attention_decode_splits(257), false); }
TEST(AttentionDecode, Context4096) { expect_decode_matches(4096, cuda::attention_decode_splits(4096), false); }
TEST(AttentionDecode, Context40000) { expect_decode_matches(40000, cuda::attention_decode_splits(40000), false); }
TEST(AttentionDecode, OddSplitCountWithEmptySplits) { expect_decode_matches(5, 7, false); }
TEST(AttentionDecode, SingleSplitLongContext) { expect_decode_matches(4096, 1, false); }
TEST(AttentionDecode, DeviceLengthWithGraphSplitCount) { expect_decode_matches(300, 128, true); }
TEST(AttentionDecode, DemoDimsContext1) { expect_decode_matches(1, 1, false, demo_dims()); }
TEST(AttentionDecode, DemoDimsContext257) {
  expect_decode_matches(257, cuda::attention_decode_splits(257), false, demo_dims());
}
TEST(AttentionDecode, DemoDimsContext4096) {
  expect_decode_matches(4096, cuda::attention_decode_splits(4096), false, demo_dims());
}
TEST(AttentionDecode, DemoDimsEmptySplits) { expect_decode_matches(5, 7, false, demo_dims()); }
TEST(AttentionDecode, DemoDimsDeviceLength) { expect_decode_matches(300, 128, true, demo_dims()); }
TEST(AttentionDecode, HeadDim128Context4096) {
  expect_decode_matches(4096, cuda::attention_decode_splits(4096), false, dims_128());
}

TEST(AttentionDecode, RejectsTooSmallWorkspace) {
  const auto dims = real_dims();
  std::mt19937_64 rng(5);
  Cache cache(dims, 16, 16, rng);
  DeviceBuffer d_q(size_t(dims.n_heads) * dims.head_dim * 2), d_out(d_q.bytes()), d_ws(64);
  EXPECT_THROW(cuda::attention_decode(dims, d_q.as<bf16_t>(), nullptr, cache.view(), 8, nullptr, 2,
                                      d_ws.as<float>(), d_ws.bytes(), d_out.as<bf16_t>(), nullptr),
               Error);
}

// ---- prefill -------------------------------------------------------------------------------------

void expect_prefill_matches(int T, int64_t base, const cuda::AttnDims& dims = real_dims()) {
  std::mt19937_64 rng(2000 + T + base);
  const int nq = dims.n_heads, D = dims.head_dim;
  const int64_t gate_stride = int64_t(nq) * 2 * D + 64;
  Cache cache(dims, base + T + 9, base + T, rng);
  const auto q = normal_bf16(int64_t(T) * nq * D, rng, 1.0f);
  const auto gate = normal_bf16(T * gate_stride, rng, 1.0f);
  DeviceBuffer d_q = upload_bf16(q), d_gate = upload_bf16(gate);
  DeviceBuffer d_out = poisoned(size_t(T) * nq * D * 2);
  cuda::attention_prefill(dims, T, base, d_q.as<bf16_t>(), d_gate.as<bf16_t>(), gate_stride,
                          cache.view(), d_out.as<bf16_t>(), nullptr);
  std::vector<float> ref;
  for (int r = 0; r < T; ++r)
    for (int h = 0; h < nq; ++h) {
      const auto o = reference_head(dims, cache, h, q.data() + (int64_t(r) * nq + h) * D, base + r + 1,
                                    gate.data() + r * gate_stride + int64_t(h) * 2 * D + D);
      ref.insert(ref.end(), o.begin(), o.end());
    }
  const double err = max_rel(download_bf16(d_out.as<bf16_t>(), int64_t(T) * nq * D), ref);
  std::printf("[attn prefill] D=%d T=%d base=%lld: max rel err %.3g\n", D, T, (long long)base, err);
  EXPECT_LT(err, kBf16Tol);
}

TEST(AttentionPrefill, CausalFromStart) { expect_prefill_matches(257, 0); }
TEST(AttentionPrefill, ContinuesAfterCachedPrefix) { expect_prefill_matches(64, 4000); }
TEST(AttentionPrefill, SingleRowAfterLongPrefix) { expect_prefill_matches(1, 40000); }
TEST(AttentionPrefill, DemoDimsCausalFromStart) { expect_prefill_matches(257, 0, demo_dims()); }
TEST(AttentionPrefill, DemoDimsContinuesAfterCachedPrefix) { expect_prefill_matches(64, 4000, demo_dims()); }
TEST(AttentionPrefill, HeadDim128CausalFromStart) { expect_prefill_matches(130, 0, dims_128()); }

TEST(AttentionDims, RejectsShapesTheKernelsWereNotWrittenFor) {
  ModelConfig cfg;
  cfg.n_heads = 16;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 96;  // no kernel for it
  cfg.rotary_dim = 32;
  cfg.rope_theta = 1e7;
  EXPECT_THROW(cuda::attn_dims(cfg), Error);
  cfg.head_dim = 64;
  cfg.rotary_dim = 80;  // rotary dim larger than the head
  EXPECT_THROW(cuda::attn_dims(cfg), Error);
  cfg.rotary_dim = 16;  // the demo model's shape
  EXPECT_EQ(cuda::attn_dims(cfg).head_dim, 64);
  cfg.head_dim = 128;
  EXPECT_EQ(cuda::attn_dims(cfg).head_dim, 128);
  cfg.rotary_dim = 32;
  cfg.head_dim = 256;
  EXPECT_EQ(cuda::attn_dims(cfg).rotary_dim, 32);
  cfg.n_kv_heads = 3;
  EXPECT_THROW(cuda::attn_dims(cfg), Error);
}

/// Timing printout (timings are never assertions) of decode at 40000 keys and a 4096-row
/// prefill; outputs must be finite.
TEST(AttentionTiming, PrintsKernelTimes) {
  const auto dims = real_dims();
  const int nq = dims.n_heads, D = dims.head_dim, T = 4096;
  const int64_t len = 40000;
  std::mt19937_64 rng(9);
  Cache cache(dims, len, len, rng);
  DeviceBuffer d_q = upload_bf16(normal_bf16(int64_t(T) * nq * D, rng, 1.0f));
  DeviceBuffer d_out(size_t(T) * nq * D * 2);
  const int splits = cuda::attention_decode_splits(len);
  const size_t ws_bytes = cuda::attention_decode_workspace_bytes(dims, splits);
  DeviceBuffer d_ws(ws_bytes);
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  auto time_ms = [&](auto&& fn, int reps) {
    fn();
    CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) fn();
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / reps;
  };
  const float decode_us = 1000 * time_ms([&] {
    cuda::attention_decode(dims, d_q.as<bf16_t>(), nullptr, cache.view(), len, nullptr, splits,
                           d_ws.as<float>(), ws_bytes, d_out.as<bf16_t>(), nullptr);
  }, 50);
  const float prefill_ms = time_ms([&] {
    cuda::attention_prefill(dims, T, 0, d_q.as<bf16_t>(), nullptr, 0, cache.view(), d_out.as<bf16_t>(),
                            nullptr);
  }, 3);
  std::printf("[attn timing] decode len=%lld (%d splits): %.2f us/layer; prefill T=%d: %.3f ms/layer\n",
              (long long)len, splits, decode_us, T, prefill_ms);
  for (float v : download_bf16(d_out.as<bf16_t>(), int64_t(T) * nq * D)) ASSERT_TRUE(std::isfinite(v));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
}

}  // namespace
}  // namespace lily
