// fp32 reference ops (see ops.h for the formulas and their sources).
#include "backends/cpu/ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
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

// ---- dot-product kernels -----------------------------------------------------------------------
// Every kernel computes dot()'s exact sequence of fp32 operations for each row: lane l sums the
// products at indices i ≡ l (mod 8) in increasing i (each product rounded, then added), then the
// lanes are added in a fixed order. They differ only in how many rows share one load of the
// weights and in the vector width: two 4-lane vectors (portable), one 8-lane AVX register per
// row, or one 16-lane AVX-512 register per pair of rows. None of this changes a rounding, so a
// row's result depends neither on the batch nor on the CPU.

namespace {
using Lanes4 = float __attribute__((vector_size(16)));
using Lanes8 = float __attribute__((vector_size(32)));
using Lanes16 = float __attribute__((vector_size(64)));

/// The lane sum of a dot product, in its fixed order.
[[gnu::always_inline]] inline float sum_lanes(const float* v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/// Adds the products at [i, n) (fewer than 8) to their lanes v[8] and returns the lane sum.
[[gnu::always_inline]] inline float finish_lanes(float* v, const float* w, const float* x, int64_t i, int64_t n) {
  for (int64_t j = i; j < n; ++j) v[j % 8] += w[j] * x[j];
  return sum_lanes(v);
}

/// y[t·y_stride] = dot(w, x + t·x_stride, n) for t < T: w is loaded once for the T rows, whose
/// 2T independent accumulator chains keep the FP units busy.
template <int T>
[[gnu::always_inline]] inline void dot_rows(const float* w, const float* x, int64_t x_stride, int64_t n, float* y,
                                            int64_t y_stride) {
  Lanes4 lo[T], hi[T];
  for (int t = 0; t < T; ++t) lo[t] = hi[t] = Lanes4{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Lanes4 w_lo, w_hi;
    std::memcpy(&w_lo, w + i, sizeof w_lo);
    std::memcpy(&w_hi, w + i + 4, sizeof w_hi);
    for (int t = 0; t < T; ++t) {
      Lanes4 x_lo, x_hi;
      std::memcpy(&x_lo, x + t * x_stride + i, sizeof x_lo);
      std::memcpy(&x_hi, x + t * x_stride + i + 4, sizeof x_hi);
      lo[t] += w_lo * x_lo;
      hi[t] += w_hi * x_hi;
    }
  }
  for (int t = 0; t < T; ++t) {
    float v[8];
    std::memcpy(v, &lo[t], sizeof lo[t]);
    std::memcpy(v + 4, &hi[t], sizeof hi[t]);
    y[t * y_stride] = finish_lanes(v, w, x + t * x_stride, i, n);
  }
}

/// y[t·y_stride] = dot(w, x + t·cols, cols) for t < m, four rows per pass over w.
void dots_portable(const float* w, const float* x, int64_t m, int64_t cols, float* y, int64_t y_stride) {
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) dot_rows<4>(w, x + t * cols, cols, cols, y + t * y_stride, y_stride);
  const float* xt = x + t * cols;
  float* yt = y + t * y_stride;
  switch (m - t) {
    case 3: dot_rows<3>(w, xt, cols, cols, yt, y_stride); break;
    case 2: dot_rows<2>(w, xt, cols, cols, yt, y_stride); break;
    case 1: dot_rows<1>(w, xt, cols, cols, yt, y_stride); break;
    default: break;
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define LILY_CPU_X86_DOTS 1

/// dot_rows with one 8-lane AVX register per row (AVX has no fused multiply-add to fuse into).
template <int T>
[[gnu::target("avx"), gnu::always_inline]] inline void dot_rows_avx(const float* w, const float* x, int64_t x_stride,
                                                                    int64_t n, float* y, int64_t y_stride) {
  Lanes8 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = Lanes8{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Lanes8 wv;
    std::memcpy(&wv, w + i, sizeof wv);
    for (int t = 0; t < T; ++t) {
      Lanes8 xv;
      std::memcpy(&xv, x + t * x_stride + i, sizeof xv);
      acc[t] += wv * xv;
    }
  }
  for (int t = 0; t < T; ++t) {
    float v[8];
    std::memcpy(v, &acc[t], sizeof acc[t]);
    y[t * y_stride] = finish_lanes(v, w, x + t * x_stride, i, n);
  }
}

/// dots_portable with AVX registers.
[[gnu::target("avx")]] void dots_avx(const float* w, const float* x, int64_t m, int64_t cols, float* y,
                                     int64_t y_stride) {
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) dot_rows_avx<4>(w, x + t * cols, cols, cols, y + t * y_stride, y_stride);
  const float* xt = x + t * cols;
  float* yt = y + t * y_stride;
  switch (m - t) {
    case 3: dot_rows_avx<3>(w, xt, cols, cols, yt, y_stride); break;
    case 2: dot_rows_avx<2>(w, xt, cols, cols, yt, y_stride); break;
    case 1: dot_rows_avx<1>(w, xt, cols, cols, yt, y_stride); break;
    default: break;
  }
}

/// The AVX-512 layout of x [m, cols] (cols a multiple of 8): rows in pairs, each pair a block of
/// [cols/8][16] floats holding columns 8c … 8c+7 of its first row, then of its second (zeros past
/// the last row), so one 16-lane register carries the eight lanes of two rows.
void pack_row_pairs(const float* x, int64_t m, int64_t cols, float* out) {
  for (int64_t t = 0; t < m; t += 2) {
    float* pair = out + t * cols;
    for (int64_t c = 0; c < cols; c += 8) {
      std::memcpy(pair + 2 * c, x + t * cols + c, 8 * sizeof(float));
      if (t + 1 < m)
        std::memcpy(pair + 2 * c + 8, x + (t + 1) * cols + c, 8 * sizeof(float));
      else
        std::fill_n(pair + 2 * c + 8, 8, 0.0f);
    }
  }
}

/// The dots of P row pairs of x (laid out by pack_row_pairs) with w; writes the first `valid`
/// (2P − 1 or 2P) of y[t·y_stride].
template <int P>
[[gnu::target("avx512f"), gnu::always_inline]] inline void dot_pairs_avx512(const float* w, const float* pairs,
                                                                            int64_t cols, int valid, float* y,
                                                                            int64_t y_stride) {
  Lanes16 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = Lanes16{};
  for (int64_t i = 0; i < cols; i += 8) {
    Lanes8 w8;
    std::memcpy(&w8, w + i, sizeof w8);
    const Lanes16 wv = __builtin_shufflevector(w8, w8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int p = 0; p < P; ++p) {
      Lanes16 xv;
      std::memcpy(&xv, pairs + p * 2 * cols + 2 * i, sizeof xv);
      Lanes16 product = wv * xv;
      __asm__("" : "+v"(product));  // AVX-512 has FMA: keep the product rounded before the add
      acc[p] += product;
    }
  }
  for (int p = 0; p < P; ++p) {
    float v[16];
    std::memcpy(v, &acc[p], sizeof acc[p]);
    y[2 * p * y_stride] = sum_lanes(v);
    if (2 * p + 1 < valid) y[(2 * p + 1) * y_stride] = sum_lanes(v + 8);
  }
}

/// dots_portable over x laid out by pack_row_pairs, four pairs per pass over w.
[[gnu::target("avx512f")]] void dots_avx512(const float* w, const float* pairs, int64_t m, int64_t cols, float* y,
                                            int64_t y_stride) {
  int64_t t = 0;
  for (; t + 8 <= m; t += 8) dot_pairs_avx512<4>(w, pairs + t * cols, cols, 8, y + t * y_stride, y_stride);
  const float* pt = pairs + t * cols;
  float* yt = y + t * y_stride;
  const int rest = static_cast<int>(m - t);
  switch ((rest + 1) / 2) {
    case 4: dot_pairs_avx512<4>(w, pt, cols, rest, yt, y_stride); break;
    case 3: dot_pairs_avx512<3>(w, pt, cols, rest, yt, y_stride); break;
    case 2: dot_pairs_avx512<2>(w, pt, cols, rest, yt, y_stride); break;
    case 1: dot_pairs_avx512<1>(w, pt, cols, rest, yt, y_stride); break;
    default: break;
  }
}
#else
#define LILY_CPU_X86_DOTS 0
#endif

/// A dot-product kernel of quant_matmul: the layout it reads the activations in, and its dots.
struct Kernel {
  /// Lays x [m, cols] out for `dots` into out[m_even·cols] (m rounded up to even); nullptr:
  /// dots reads x as it is.
  void (*pack)(const float* x, int64_t m, int64_t cols, float* out) = nullptr;
  /// y[t·y_stride] = dot(w, row t of x, cols) for t < m, x laid out by `pack`.
  void (*dots)(const float* w, const float* x, int64_t m, int64_t cols, float* y, int64_t y_stride) = nullptr;
};

/// force_dot_kernel's choice, −1 for none.
std::atomic<int> g_forced_kernel{-1};

/// The kernel quant_matmul uses for matrices of `cols` columns: the forced one, else the widest
/// available (AVX-512 wants cols a multiple of 8, which every group size is; AVX is there too).
Kernel kernel_for(int64_t cols) {
#if LILY_CPU_X86_DOTS
  const int forced = g_forced_kernel.load(std::memory_order_relaxed);
  const bool avx512 = forced >= 0 ? forced == static_cast<int>(DotKernel::kAvx512)
                                  : dot_kernel_available(DotKernel::kAvx512);
  const bool avx = forced >= 0 ? forced != static_cast<int>(DotKernel::kPortable)
                               : dot_kernel_available(DotKernel::kAvx);
  if (avx512 && cols % 8 == 0) return {&pack_row_pairs, &dots_avx512};
  if (avx) return {nullptr, &dots_avx};
#else
  (void)cols;
#endif
  return {nullptr, &dots_portable};
}
}  // namespace

bool dot_kernel_available(DotKernel kernel) {
#if LILY_CPU_X86_DOTS
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") != 0);
  static const bool avx = (__builtin_cpu_init(), __builtin_cpu_supports("avx") != 0);
  switch (kernel) {
    case DotKernel::kPortable: return true;
    case DotKernel::kAvx: return avx;
    case DotKernel::kAvx512: return avx512;
  }
  return false;
#else
  return kernel == DotKernel::kPortable;
#endif
}

void force_dot_kernel(std::optional<DotKernel> kernel) {
  LILY_CHECK(!kernel || dot_kernel_available(*kernel));
  g_forced_kernel.store(kernel ? static_cast<int>(*kernel) : -1, std::memory_order_relaxed);
}

float dot(const float* a, const float* b, int64_t n) {
  float y;
  dot_rows<1>(a, b, 0, n, &y, 0);
  return y;
}

// ---- quantized matmul --------------------------------------------------------------------------

namespace {
void check_matmul(const QuantMatrix& w) {
  if (w.bits != 4 && w.bits != 8)
    throw InternalError("quant_matmul: unsupported bit width " + std::to_string(w.bits));
  LILY_CHECK(w.cols % w.group_size == 0);
}
}  // namespace

void quant_matmul_many(std::span<const MatmulOutput> outputs, const float* x, int64_t m, ThreadPool* pool) {
  if (outputs.empty()) return;
  const int64_t cols = outputs[0].w->cols;
  int64_t total_rows = 0;
  for (const MatmulOutput& o : outputs) {
    check_matmul(*o.w);
    LILY_CHECK(o.w->cols == cols);
    total_rows += o.w->rows;
  }
  if (m <= 0) return;
  const Kernel kernel = kernel_for(cols);
  const float* xk = x;
  if (kernel.pack) {  // laid out once here, read by every block
    thread_local std::vector<float> packed;
    const int64_t size = (m + 1) / 2 * 2 * cols;
    if (static_cast<int64_t>(packed.size()) < size) packed.resize(size);
    kernel.pack(x, m, cols, packed.data());
    xk = packed.data();
  }
  // Rows [begin, end) of the outputs' concatenated rows: each weight row is dequantized once
  // and dotted with all m tokens.
  auto block = [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row_weights;
    if (static_cast<int64_t>(row_weights.size()) < cols) row_weights.resize(cols);
    int64_t first = 0;  // the first concatenated row of o
    for (const MatmulOutput& o : outputs) {
      const int64_t rows = o.w->rows;
      for (int64_t r = std::max(begin, first); r < std::min(end, first + rows); ++r) {
        dequantize_row(*o.w, r - first, row_weights.data());
        kernel.dots(row_weights.data(), xk, m, cols, o.y + (r - first), rows);
      }
      first += rows;
    }
  };
  // Blocks of at least ~64K multiply-adds keep the hand-out overhead small on tiny matrices.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols * m));
  if (pool)
    pool->parallel_for(total_rows, grain, block);
  else
    block(0, total_rows);
}

void quant_matmul(const QuantMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool) {
  const MatmulOutput output{&w, y};
  quant_matmul_many(std::span<const MatmulOutput>(&output, 1), x, m, pool);
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
