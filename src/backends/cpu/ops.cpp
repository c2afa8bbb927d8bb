// fp32 reference ops (see ops.h for the formulas and their sources).
#include "backends/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "base/bf16.h"
#include "base/error.h"

namespace lily::cpu {

// ---- quantized linear algebra ------------------------------------------------------------------

namespace {
/// dequantize_row for a fixed bit width: per group, scale and bias are read once and each U32
/// word yields 32/kBits codes, lowest bits first.
template <int kBits>
void dequantize_row_bits(const QuantMatrix& w, int64_t row, float* out) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int64_t words_per_group = w.group_size / kPerWord;
  const uint32_t* codes = w.codes + row * w.words_per_row();
  const uint16_t* scales = w.scales + row * w.groups_per_row();
  const uint16_t* biases = w.biases + row * w.groups_per_row();
  for (int64_t g = 0; g < w.groups_per_row(); ++g) {
    const float scale = bf16_to_float(scales[g]);
    const float bias = bf16_to_float(biases[g]);
    const uint32_t* words = codes + g * words_per_group;
    float* group_out = out + g * w.group_size;
    for (int64_t i = 0; i < words_per_group; ++i) {
      const uint32_t word = words[i];
      for (int j = 0; j < kPerWord; ++j) {
        const uint32_t q = (word >> (kBits * j)) & kMask;
        group_out[i * kPerWord + j] = scale * static_cast<float>(q) + bias;
      }
    }
  }
}
}  // namespace

void dequantize_row(const QuantMatrix& w, int64_t row, float* out) {
  if (w.bits == 4)
    dequantize_row_bits<4>(w, row, out);
  else if (w.bits == 8)
    dequantize_row_bits<8>(w, row, out);
  else
    throw InternalError("dequantize_row: unsupported bit width " + std::to_string(w.bits));
}

float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) lanes[i % 8] += a[i] * b[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

void quant_matmul(const QuantMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool) {
  if (w.bits != 4 && w.bits != 8)
    throw InternalError("quant_matmul: unsupported bit width " + std::to_string(w.bits));
  LILY_CHECK(w.cols % w.group_size == 0);
  const int64_t rows = w.rows, cols = w.cols;
  auto block = [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row_weights;
    if (static_cast<int64_t>(row_weights.size()) < cols) row_weights.resize(cols);
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row(w, r, row_weights.data());
      for (int64_t t = 0; t < m; ++t) y[t * rows + r] = dot(row_weights.data(), x + t * cols, cols);
    }
  };
  // Blocks of at least ~64K multiply-adds keep the hand-out overhead small on tiny matrices.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols * m));
  if (pool)
    pool->parallel_for(rows, grain, block);
  else
    block(0, rows);
}

void quant_matvec(const QuantMatrix& w, const float* x, float* y, ThreadPool* pool) {
  quant_matmul(w, x, 1, y, pool);
}

// ---- elementwise -------------------------------------------------------------------------------

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float silu(float x) { return x / (1.0f + std::exp(-x)); }

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void silu_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = silu(x[i]);
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// ---- normalisation -----------------------------------------------------------------------------

namespace {
/// 1/sqrt(Σx²/n + eps), the RMSNorm scale.
float rms_scale(const float* x, int64_t n, float eps) {
  const float mean_square = dot(x, x, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean_square + eps);
}
}  // namespace

void rms_norm(const float* x, const float* gain, int64_t n, float eps, float* y) {
  const float r = rms_scale(x, n, eps);
  for (int64_t j = 0; j < n; ++j) y[j] = (x[j] * r) * gain[j];
}

void gated_rms_norm(const float* o, const float* z, const float* gain, int64_t n, float eps,
                    float* y) {
  const float r = rms_scale(o, n, eps);
  for (int64_t j = 0; j < n; ++j) y[j] = (gain[j] * (o[j] * r)) * silu(z[j]);
}

void l2_normalize(float* x, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) + eps);
  for (int64_t j = 0; j < n; ++j) x[j] *= r;
}

// ---- rotary position embedding -----------------------------------------------------------------

void rope_cos_sin(int64_t pos, int rotary_dim, double theta, float* cos, float* sin) {
  const float base = static_cast<float>(theta);
  for (int j = 0; j < rotary_dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    const float inv_freq = 1.0f / std::pow(base, exponent);
    const float angle = static_cast<float>(pos) * inv_freq;
    cos[j] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin[j] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void apply_rope(float* x, int rotary_dim, const float* cos, const float* sin) {
  const int half = rotary_dim / 2;
  for (int j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] - b * sin[j];
    x[j + half] = b * cos[j] + a * sin[j];
  }
}

// ---- Gated DeltaNet ----------------------------------------------------------------------------

void causal_conv_step(const float* taps, float* window, const float* x, int64_t channels,
                      int kernel, float* y) {
  const int history = kernel - 1;
  for (int64_t c = 0; c < channels; ++c) {
    const float* w = taps + c * kernel;
    float* win = window + c * history;
    float acc = 0.0f;
    for (int t = 0; t < history; ++t) acc += win[t] * w[t];
    acc += x[c] * w[history];
    y[c] = acc;
    for (int t = 0; t + 1 < history; ++t) win[t] = win[t + 1];
    if (history > 0) win[history - 1] = x[c];
  }
}

void delta_rule_step(float* state, const float* q, const float* k, const float* v, float alpha,
                     float beta, int dk, int dv, float* out) {
  thread_local std::vector<float> delta;
  delta.assign(dv, 0.0f);  // first pred, then δ
  for (int i = 0; i < dk; ++i) {
    float* s = state + static_cast<int64_t>(i) * dv;
    for (int m = 0; m < dv; ++m) {
      s[m] *= alpha;
      delta[m] += k[i] * s[m];
    }
  }
  for (int m = 0; m < dv; ++m) delta[m] = (v[m] - delta[m]) * beta;
  std::fill(out, out + dv, 0.0f);
  for (int i = 0; i < dk; ++i) {
    float* s = state + static_cast<int64_t>(i) * dv;
    for (int m = 0; m < dv; ++m) {
      s[m] += k[i] * delta[m];
      out[m] += q[i] * s[m];
    }
  }
}

// ---- attention -----------------------------------------------------------------------------------

void attention_head(const float* q, const float* k_cache, const float* v_cache, int64_t len,
                    int64_t stride, int head_dim, float scale, float* scores, float* out) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = dot(q, k_cache + t * stride, head_dim) * scale;
    max_score = std::max(max_score, scores[t]);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    sum += scores[t];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const float a = scores[t] / sum;
    const float* v = v_cache + t * stride;
    for (int d = 0; d < head_dim; ++d) out[d] += a * v[d];
  }
}

// ---- MoE routing and selection -------------------------------------------------------------------

void route_weights(const float* logits, int n_experts, const int* ids, int k, bool renormalize,
                   float* weights) {
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < n_experts; ++e)
    if (logits[e] > max_logit) max_logit = logits[e];
  float sum = 0.0f;
  for (int e = 0; e < n_experts; ++e) sum += std::exp(logits[e] - max_logit);
  float selected_sum = 0.0f;
  for (int slot = 0; slot < k; ++slot) {
    LILY_CHECK(ids[slot] >= 0 && ids[slot] < n_experts);
    weights[slot] = std::exp(logits[ids[slot]] - max_logit) / sum;
    selected_sum += weights[slot];
  }
  if (renormalize)
    for (int slot = 0; slot < k; ++slot) weights[slot] /= selected_sum;
}

void route_top_k(const float* logits, int n_experts, int k, bool renormalize, int* ids,
                 float* weights) {
  LILY_CHECK(k >= 1 && k <= n_experts);
  thread_local std::vector<float> probs;
  thread_local std::vector<char> taken;
  probs.resize(n_experts);
  taken.assign(n_experts, 0);
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < n_experts; ++e)
    if (logits[e] > max_logit) max_logit = logits[e];
  float sum = 0.0f;
  for (int e = 0; e < n_experts; ++e) {
    probs[e] = std::exp(logits[e] - max_logit);
    sum += probs[e];
  }
  // Select on the probabilities (not the logits): logits whose exp underflows to the same p
  // tie, and ties go to the lowest id, as in HF.
  for (int e = 0; e < n_experts; ++e) probs[e] /= sum;
  for (int slot = 0; slot < k; ++slot) {
    int best = -1;
    for (int e = 0; e < n_experts; ++e) {
      if (taken[e]) continue;
      if (best < 0 || probs[e] > probs[best] || (std::isnan(probs[best]) && !std::isnan(probs[e])))
        best = e;
    }
    taken[best] = 1;
    ids[slot] = best;
  }
  // The same exp(l − max) / Σ per chosen expert as probs[], so the weights are bit-identical.
  route_weights(logits, n_experts, ids, k, renormalize, weights);
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) continue;
    if (best < 0 || x[i] > x[best]) best = i;
  }
  return best < 0 ? 0 : static_cast<int32_t>(best);
}

}  // namespace lily::cpu
