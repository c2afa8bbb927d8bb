// The fp32 reference ops (backends/cpu/ops.h) against hand-computed values and independently
// written naive formulas in double precision.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "backends/cpu/ops.h"
#include "backends/cpu/thread_pool.h"
#include "base/bf16.h"
#include "base/error.h"
#include "support/test_support.h"

namespace lily::cpu {
namespace {

/// Owns the storage of a random MLX-quantized matrix and exposes it as a QuantMatrix.
struct OwnedQuant {
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;
  QuantMatrix view;

  OwnedQuant(int64_t rows, int64_t cols, int bits, uint32_t seed) {
    std::mt19937 rng(seed);
    codes.resize(rows * cols * bits / 32);
    for (auto& w : codes) w = rng();
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (int64_t i = 0; i < rows * cols / 64; ++i) {
      scales.push_back(float_to_bf16(normal(rng)));  // negative scales included
      biases.push_back(float_to_bf16(normal(rng) * 8));
    }
    view = QuantMatrix{codes.data(), scales.data(), biases.data(), rows, cols, bits, 64};
  }
};

std::vector<float> random_vector(int64_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// ---- dequantization and matmul -------------------------------------------------------------------

TEST(CpuOps, DequantizesTheMlxFixtureWord) {
  // docs/model.md §2.2: the word 0x22111100 decodes to codes 0,0,1,1,1,1,2,2 (lowest nibble first).
  std::vector<uint32_t> codes(8, 0);
  codes[0] = 0x22111100u;
  codes[7] = 0xF0000000u;  // code 15 at column 63
  uint16_t scale = float_to_bf16(2.0f), bias = float_to_bf16(-16.0f);
  QuantMatrix w{codes.data(), &scale, &bias, 1, 64, 4, 64};
  std::vector<float> row(64);
  dequantize_row(w, 0, row.data());
  const float expected_first[8] = {-16, -16, -14, -14, -14, -14, -12, -12};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(row[c], expected_first[c]) << "column " << c;
  for (int c = 8; c < 63; ++c) EXPECT_EQ(row[c], -16.0f) << "column " << c;
  EXPECT_EQ(row[63], 2.0f * 15 - 16);
}

TEST(CpuOps, DequantizesEightBitBytesLowestFirst) {
  std::vector<uint32_t> codes(16, 0);
  codes[0] = 0x04030201u;
  codes[15] = 0xFF000000u;
  uint16_t scale = float_to_bf16(-0.5f), bias = float_to_bf16(3.25f);
  QuantMatrix w{codes.data(), &scale, &bias, 1, 64, 8, 64};
  std::vector<float> row(64);
  dequantize_row(w, 0, row.data());
  EXPECT_EQ(row[0], 2.75f);
  EXPECT_EQ(row[1], 2.25f);
  EXPECT_EQ(row[2], 1.75f);
  EXPECT_EQ(row[3], 1.25f);
  EXPECT_EQ(row[4], 3.25f);
  EXPECT_EQ(row[63], -0.5f * 255 + 3.25f);
}

TEST(CpuOps, QuantMatmulMatchesNaiveDequantizedProduct) {
  ThreadPool pool(3);
  for (int bits : {4, 8}) {
    const int64_t rows = 37, cols = 192, m = 5;
    OwnedQuant w(rows, cols, bits, 7 + bits);
    auto x = random_vector(m * cols, 11);
    std::vector<float> y(m * rows);
    quant_matmul(w.view, x.data(), m, y.data(), &pool);
    for (int64_t t = 0; t < m; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        // Independent decode: shift/mask written out per element, sum in double.
        double expected = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const int per_word = 32 / bits;
          uint32_t q = (w.codes[r * cols / per_word + c / per_word] >> (bits * (c % per_word))) &
                       ((1u << bits) - 1);
          double s = bf16_to_float(w.scales[r * cols / 64 + c / 64]);
          double b = bf16_to_float(w.biases[r * cols / 64 + c / 64]);
          expected += (s * q + b) * x[t * cols + c];
        }
        EXPECT_NEAR(y[t * rows + r], expected, 1e-5 * (1 + std::fabs(expected)))
            << "bits " << bits << " token " << t << " row " << r;
      }
  }
}

TEST(CpuOps, QuantMatmulRowsDoNotDependOnBatchOrThreads) {
  const int64_t rows = 300, cols = 256, m = 9;
  OwnedQuant w(rows, cols, 4, 3);
  auto x = random_vector(m * cols, 5);
  std::vector<float> batched(m * rows), single(rows);
  ThreadPool pool(4);
  quant_matmul(w.view, x.data(), m, batched.data(), &pool);
  for (int64_t t = 0; t < m; ++t) {
    quant_matvec(w.view, x.data() + t * cols, single.data(), nullptr);
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(batched[t * rows + r], single[r]);
  }
}

TEST(CpuOps, EveryDotKernelGivesEveryRowTheBitsOfItsOwnDot) {
  // Batch sizes around each kernel's blocks (4 rows, 4 pairs of rows) and both bit widths; the
  // reference is dot() of the dequantized row, one token at a time.
  std::vector<DotKernel> kernels;
  for (DotKernel k : {DotKernel::kPortable, DotKernel::kAvx, DotKernel::kAvx512})
    if (dot_kernel_available(k)) kernels.push_back(k);
  struct Restore {
    ~Restore() { force_dot_kernel(std::nullopt); }
  } restore;
  ThreadPool pool(3);
  for (int bits : {4, 8})
    for (int64_t cols : {64, 192}) {
      const int64_t rows = 21;
      OwnedQuant w(rows, cols, bits, 17 + bits);
      std::vector<float> weights(rows * cols);
      for (int64_t r = 0; r < rows; ++r) dequantize_row(w.view, r, weights.data() + r * cols);
      for (DotKernel kernel : kernels) {
        force_dot_kernel(kernel);
        for (int64_t m = 1; m <= 19; ++m) {
          auto x = random_vector(m * cols, static_cast<uint32_t>(100 + m));
          std::vector<float> y(m * rows);
          quant_matmul(w.view, x.data(), m, y.data(), &pool);
          for (int64_t t = 0; t < m; ++t)
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(y[t * rows + r], dot(weights.data() + r * cols, x.data() + t * cols, cols))
                  << "kernel " << static_cast<int>(kernel) << " bits " << bits << " cols " << cols << " m " << m
                  << " token " << t << " row " << r;
        }
      }
    }
}

TEST(CpuOps, QuantMatmulManyEqualsOneMatmulPerMatrix) {
  const int64_t cols = 128, m = 6;
  OwnedQuant a(40, cols, 4, 1), b(3, cols, 8, 2), c(70, cols, 4, 3);
  auto x = random_vector(m * cols, 9);
  std::vector<float> ya(m * 40), yb(m * 3), yc(m * 70), ea(ya.size()), eb(yb.size()), ec(yc.size());
  ThreadPool pool(4);
  const MatmulOutput outputs[] = {{&a.view, ya.data()}, {&b.view, yb.data()}, {&c.view, yc.data()}};
  quant_matmul_many(outputs, x.data(), m, &pool);
  quant_matmul(a.view, x.data(), m, ea.data(), nullptr);
  quant_matmul(b.view, x.data(), m, eb.data(), nullptr);
  quant_matmul(c.view, x.data(), m, ec.data(), nullptr);
  EXPECT_EQ(ya, ea);
  EXPECT_EQ(yb, eb);
  EXPECT_EQ(yc, ec);
}

TEST(CpuOps, QuantMatmulRejectsOtherBitWidths) {
  OwnedQuant w(2, 64, 4, 1);
  QuantMatrix bad = w.view;
  bad.bits = 3;
  std::vector<float> x(64, 1.0f), y(2);
  EXPECT_THROW(quant_matvec(bad, x.data(), y.data(), nullptr), InternalError);
}

// ---- elementwise and norms -----------------------------------------------------------------------

TEST(CpuOps, ScalarActivations) {
  EXPECT_FLOAT_EQ(sigmoid(0.0f), 0.5f);
  EXPECT_NEAR(sigmoid(2.0f), 1.0 / (1.0 + std::exp(-2.0)), 1e-7);
  EXPECT_NEAR(silu(-1.5f), -1.5 / (1.0 + std::exp(1.5)), 1e-7);
  EXPECT_FLOAT_EQ(softplus(0.0f), std::log(2.0f));
  EXPECT_NEAR(softplus(19.0f), std::log1p(std::exp(19.0)), 1e-5);
  EXPECT_EQ(softplus(25.0f), 25.0f);  // above the threshold of 20: identity
  EXPECT_NEAR(softplus(-30.0f), std::exp(-30.0), 1e-18);
}

TEST(CpuOps, RmsNormMatchesFormula) {
  const int n = 96;
  auto x = random_vector(n, 1, 3.0f), gain = random_vector(n, 2);
  std::vector<float> y(n);
  rms_norm(x.data(), gain.data(), n, 1e-6f, y.data());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double r = 1.0 / std::sqrt(ss / n + 1e-6);
  for (int j = 0; j < n; ++j) EXPECT_NEAR(y[j], x[j] * r * gain[j], 1e-5 * (1 + std::fabs(y[j])));
  // In place gives the same result.
  rms_norm(x.data(), gain.data(), n, 1e-6f, x.data());
  for (int j = 0; j < n; ++j) EXPECT_EQ(x[j], y[j]);
}

TEST(CpuOps, GatedRmsNormMatchesFormula) {
  const int n = 64;
  auto o = random_vector(n, 3), z = random_vector(n, 4, 2.0f), gain = random_vector(n, 5);
  std::vector<float> y(n);
  gated_rms_norm(o.data(), z.data(), gain.data(), n, 1e-6f, y.data());
  double ss = 0;
  for (float v : o) ss += double(v) * v;
  const double r = 1.0 / std::sqrt(ss / n + 1e-6);
  for (int j = 0; j < n; ++j) {
    const double silu_z = z[j] / (1.0 + std::exp(-double(z[j])));
    EXPECT_NEAR(y[j], gain[j] * o[j] * r * silu_z, 1e-5 * (1 + std::fabs(y[j])));
  }
}

TEST(CpuOps, L2NormalizeUsesRsqrtWithEpsilon) {
  std::vector<float> x = {3.0f, 4.0f};
  l2_normalize(x.data(), 2, 1e-6f);
  const double r = 1.0 / std::sqrt(25.0 + 1e-6);
  EXPECT_NEAR(x[0], 3 * r, 1e-7);
  EXPECT_NEAR(x[1], 4 * r, 1e-7);
  std::vector<float> zeros(8, 0.0f);  // no division by zero
  l2_normalize(zeros.data(), 8, 1e-6f);
  for (float v : zeros) EXPECT_EQ(v, 0.0f);
}

// ---- RoPE ----------------------------------------------------------------------------------------

TEST(CpuOps, RopeRotatesHalfSplitPairsByPositionTimesFrequency) {
  const int head_dim = 12, rotary_dim = 8;
  const double theta = 1e4;
  const int64_t pos = 37;
  auto x = random_vector(head_dim, 9);
  std::vector<float> rotated = x, cos(rotary_dim / 2), sin(rotary_dim / 2);
  rope_cos_sin(pos, rotary_dim, theta, cos.data(), sin.data());
  apply_rope(rotated.data(), rotary_dim, cos.data(), sin.data());
  double norm_before = 0, norm_after = 0;
  for (int j = 0; j < rotary_dim / 2; ++j) {
    const double phi = pos * std::pow(theta, -2.0 * j / rotary_dim);
    const double a = x[j], b = x[j + rotary_dim / 2];
    EXPECT_NEAR(rotated[j], a * std::cos(phi) - b * std::sin(phi), 1e-5) << j;
    EXPECT_NEAR(rotated[j + rotary_dim / 2], b * std::cos(phi) + a * std::sin(phi), 1e-5) << j;
  }
  for (int j = 0; j < head_dim; ++j) {
    norm_before += double(x[j]) * x[j];
    norm_after += double(rotated[j]) * rotated[j];
  }
  EXPECT_NEAR(norm_after, norm_before, 1e-5 * norm_before);
  for (int j = rotary_dim; j < head_dim; ++j) EXPECT_EQ(rotated[j], x[j]);  // pass-through
}

TEST(CpuOps, RopeAtPositionZeroIsIdentity) {
  const int rotary_dim = 16;
  auto x = random_vector(rotary_dim, 10);
  std::vector<float> y = x, cos(8), sin(8);
  rope_cos_sin(0, rotary_dim, 1e7, cos.data(), sin.data());
  apply_rope(y.data(), rotary_dim, cos.data(), sin.data());
  for (int j = 0; j < rotary_dim; ++j) EXPECT_EQ(y[j], x[j]);
}

// ---- Gated DeltaNet ----------------------------------------------------------------------------

TEST(CpuOps, CausalConvStepEqualsZeroPaddedConvolution) {
  const int channels = 5, kernel = 4, steps = 7;
  auto taps = random_vector(channels * kernel, 12);
  auto inputs = random_vector(steps * channels, 13);
  std::vector<float> window(channels * (kernel - 1), 0.0f), y(channels);
  for (int t = 0; t < steps; ++t) {
    causal_conv_step(taps.data(), window.data(), inputs.data() + t * channels, channels, kernel,
                     y.data());
    for (int c = 0; c < channels; ++c) {
      double expected = 0;  // tap kernel-1 multiplies the current input, tap 0 the oldest
      for (int j = 0; j < kernel; ++j) {
        const int src = t - (kernel - 1) + j;
        if (src >= 0) expected += double(taps[c * kernel + j]) * inputs[src * channels + c];
      }
      EXPECT_NEAR(y[c], expected, 1e-5) << "step " << t << " channel " << c;
    }
  }
  // The window holds the last kernel-1 raw inputs, oldest first.
  for (int c = 0; c < channels; ++c)
    for (int j = 0; j < kernel - 1; ++j)
      EXPECT_EQ(window[c * (kernel - 1) + j], inputs[(steps - (kernel - 1) + j) * channels + c]);
}

TEST(CpuOps, DeltaRuleStepMatchesClosedForm) {
  const int dk = 6, dv = 5;
  auto state = random_vector(dk * dv, 14);
  auto q = random_vector(dk, 15), k = random_vector(dk, 16), v = random_vector(dv, 17);
  l2_normalize(k.data(), dk, 1e-6f);
  const float alpha = 0.83f, beta = 0.37f;
  // S_t = α (I − β k kᵀ) S + β k vᵀ, out = S_tᵀ q, in double.
  std::vector<double> expected(dk * dv);
  for (int i = 0; i < dk; ++i)
    for (int m = 0; m < dv; ++m) {
      double projected = 0;
      for (int l = 0; l < dk; ++l)
        projected += ((i == l ? 1.0 : 0.0) - double(beta) * k[i] * k[l]) * state[l * dv + m];
      expected[i * dv + m] = alpha * projected + double(beta) * k[i] * v[m];
    }
  std::vector<float> out(dv);
  delta_rule_step(state.data(), q.data(), k.data(), v.data(), alpha, beta, dk, dv, out.data());
  for (int i = 0; i < dk * dv; ++i) EXPECT_NEAR(state[i], expected[i], 1e-5) << i;
  for (int m = 0; m < dv; ++m) {
    double o = 0;
    for (int i = 0; i < dk; ++i) o += expected[i * dv + m] * q[i];
    EXPECT_NEAR(out[m], o, 1e-5) << m;
  }
}

// ---- attention -----------------------------------------------------------------------------------

TEST(CpuOps, AttentionHeadMatchesNaiveSoftmax) {
  const int head_dim = 8, n_kv = 2, len = 11;
  const int64_t stride = n_kv * head_dim;
  auto q = random_vector(head_dim, 18);
  auto keys = random_vector(len * stride, 19), values = random_vector(len * stride, 20);
  const int kv = 1;  // the second kv head of an interleaved [pos, n_kv, head_dim] cache
  std::vector<float> scores(len), out(head_dim);
  attention_head(q.data(), keys.data() + kv * head_dim, values.data() + kv * head_dim, len, stride,
                 head_dim, 0.35f, scores.data(), out.data());
  std::vector<double> s(len);
  double max_s = -1e300, sum = 0;
  for (int t = 0; t < len; ++t) {
    s[t] = 0;
    for (int d = 0; d < head_dim; ++d) s[t] += double(q[d]) * keys[t * stride + kv * head_dim + d];
    s[t] *= 0.35;
    max_s = std::max(max_s, s[t]);
  }
  for (double& v : s) sum += (v = std::exp(v - max_s));
  for (int d = 0; d < head_dim; ++d) {
    double o = 0;
    for (int t = 0; t < len; ++t) o += s[t] / sum * values[t * stride + kv * head_dim + d];
    EXPECT_NEAR(out[d], o, 1e-5) << d;
  }
  // One position: the output is that position's value.
  attention_head(q.data(), keys.data(), values.data(), 1, stride, head_dim, 0.35f, scores.data(),
                 out.data());
  for (int d = 0; d < head_dim; ++d) EXPECT_EQ(out[d], values[d]);
}

// ---- routing and argmax --------------------------------------------------------------------------

TEST(CpuOps, RouterPicksLargestInDescendingOrderAndRenormalises) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 3.0f, 2.5f, 0.0f};
  int ids[3];
  float weights[3];
  route_top_k(logits.data(), 6, 3, true, ids, weights);
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 4);
  EXPECT_EQ(ids[2], 1);
  const double z = std::exp(3.0) + std::exp(2.5) + std::exp(2.0);
  EXPECT_NEAR(weights[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(weights[1], std::exp(2.5) / z, 1e-6);
  EXPECT_NEAR(weights[2], std::exp(2.0) / z, 1e-6);
  // Without renormalisation the weights are the full-softmax probabilities.
  route_top_k(logits.data(), 6, 3, false, ids, weights);
  double all = 0;
  for (float l : logits) all += std::exp(double(l));
  EXPECT_NEAR(weights[0], std::exp(3.0) / all, 1e-6);
}

TEST(CpuOps, RouteWeightsOfAChosenSetMatchTopK) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 3.0f, 2.5f, 0.0f};
  int ids[3];
  float expected[3], weights[3];
  for (bool renormalize : {true, false}) {
    route_top_k(logits.data(), 6, 3, renormalize, ids, expected);
    route_weights(logits.data(), 6, ids, 3, renormalize, weights);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(weights[i], expected[i], 1e-7) << i;
  }
  // Another set (e.g. adopted from another backend at a near-tie): softmax restricted to it.
  const int other[2] = {0, 5};
  route_weights(logits.data(), 6, other, 2, true, weights);
  EXPECT_NEAR(weights[0], std::exp(0.1) / (std::exp(0.1) + std::exp(0.0)), 1e-6);
  EXPECT_NEAR(weights[1], std::exp(0.0) / (std::exp(0.1) + std::exp(0.0)), 1e-6);
}

TEST(CpuOps, RouterTiesGoToLowestIds) {
  std::vector<float> logits(16, 0.5f);
  int ids[4];
  float weights[4];
  route_top_k(logits.data(), 16, 4, true, ids, weights);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(ids[i], i);
    EXPECT_FLOAT_EQ(weights[i], 0.25f);
  }
  logits[9] = 1.0f;  // one winner, then the tie among the rest
  logits[12] = 1.0f;
  route_top_k(logits.data(), 16, 4, true, ids, weights);
  EXPECT_EQ(ids[0], 9);
  EXPECT_EQ(ids[1], 12);
  EXPECT_EQ(ids[2], 0);
  EXPECT_EQ(ids[3], 1);
}

TEST(CpuOps, RouterHandlesMinusInfinityLogits) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = {-inf, 1.0f, -inf, -inf, 0.0f};
  int ids[2];
  float weights[2];
  route_top_k(logits.data(), 5, 2, true, ids, weights);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 4);
  EXPECT_NEAR(weights[0] + weights[1], 1.0f, 1e-6);
}

TEST(CpuOps, ArgmaxTiesLowestAndIgnoresNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(4000, -1.0f);
  x[513] = 7.0f;
  x[3501] = 7.0f;
  EXPECT_EQ(argmax(x.data(), 4000), 513);
  x[100] = nan;
  EXPECT_EQ(argmax(x.data(), 4000), 513);
  std::vector<float> lead_nan = {nan, 1.0f, 2.0f, 2.0f};
  EXPECT_EQ(argmax(lead_nan.data(), 4), 2);
  std::vector<float> all_nan(5, nan);
  EXPECT_EQ(argmax(all_nan.data(), 5), 0);
}

// ---- thread pool ---------------------------------------------------------------------------------

TEST(CpuThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.size(), 4);
  for (int64_t n : {1, 7, 1000, 12345}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, 3, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " i " << i;
  }
}

TEST(CpuThreadPool, RethrowsAndRunsNestedCallsInline) {
  ThreadPool pool(3);
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [](int64_t b, int64_t) {
                                   if (b >= 50) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  std::atomic<int64_t> total{0};
  pool.parallel_for(8, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
  });
  EXPECT_EQ(total.load(), 80);
  // Still usable after an exception.
  std::atomic<int> count{0};
  pool.parallel_for(64, 1, [&](int64_t b, int64_t e) { count += static_cast<int>(e - b); });
  EXPECT_EQ(count.load(), 64);
}

// Regression (CI segfault): after a job ended by an exception, a worker that woke late for it
// found blocks left and called the dropped body. Many short throwing jobs make late wake-ups
// likely; every job after them must still see each index exactly once.
TEST(CpuThreadPool, LateWorkersNeverRunAFinishedJob) {
  ThreadPool pool(4);
  for (int round = 0; round < 3000; ++round) {
    EXPECT_THROW(pool.parallel_for(64, 1,
                                   [](int64_t b, int64_t) {
                                     if (b == 0) throw std::runtime_error("first block fails");
                                   }),
                 std::runtime_error);
    std::atomic<int64_t> covered{0};
    pool.parallel_for(16, 1, [&](int64_t b, int64_t e) { covered += e - b; });
    ASSERT_EQ(covered.load(), 16) << "round " << round;
  }
}

}  // namespace
}  // namespace lily::cpu
