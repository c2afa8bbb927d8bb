// fp32 reference ops of the CPU backend, one per function, written as plain loops that read
// like the formulas of docs/model.md §3 (the HF-float32 variants of §4.5 where lily and
// transformers differ). Activations are fp32 throughout; quantized weights are dequantized
// exactly (w = scale·q + bias per group of 64, docs/model.md §2.2). These ops are the oracle the
// CUDA kernels are checked against, so clarity comes before speed; the only concessions to
// speed are multi-threading over output rows, dequantizing each weight row once per batch, and
// matmul dot products that reuse each load of a weight row for several tokens in vector
// registers (the same fp32 operations per token as dot()).
//
// Determinism: every output element is computed by the same sequence of fp32 operations
// whatever the thread count, the batch size m and the CPU's vector width, so a batched prefill
// equals token-by-token decode bit for bit.
#pragma once
#include <cstdint>
#include <optional>
#include <span>

#include "backends/cpu/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

// ---- quantized linear algebra ------------------------------------------------------------------

/// Exact fp32 dequantization of row `row` of `w` into out[w.cols] (docs/model.md §2.2):
/// out[c] = scale[row, c/64]·q[row, c] + bias[row, c/64], q read from the packed U32 codes
/// (4-bit: nibble c mod 8 of word c/8; 8-bit: byte c mod 4 of word c/4). Requires bits ∈ {4, 8}.
void dequantize_row(const QuantMatrix& w, int64_t row, float* out);

/// Dot product Σ a[i]·b[i] over n fp32 values, accumulated in fp32 over 8 interleaved partial
/// sums that are added in a fixed order (deterministic, vectorisable).
float dot(const float* a, const float* b, int64_t n);

/// Batched quantized matmul Y = X·Wᵀ: x [m, w.cols] row-major (one token per row),
/// y [m, w.rows]. Each weight row is dequantized once per call and dotted with all m tokens;
/// output rows are split across `pool` (nullptr = single-threaded). y[t, r] is dot() of weight
/// row r and token t: it depends neither on m, nor on the thread count, nor on the DotKernel.
/// Throws lily::InternalError for bits ∉ {4, 8}.
void quant_matmul(const QuantMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool);

/// One product of quant_matmul_many: y [m, w->rows] = X·Wᵀ.
struct MatmulOutput {
  const QuantMatrix* w = nullptr;
  float* y = nullptr;
};

/// quant_matmul of several matrices with the same cols on the same x [m, cols], run as one
/// parallel pass over their rows (one hand-out to the pool instead of one per matrix). Each
/// output equals what quant_matmul gives it. Throws as quant_matmul.
void quant_matmul_many(std::span<const MatmulOutput> outputs, const float* x, int64_t m, ThreadPool* pool);

/// The dot-product kernels of quant_matmul. Each gives every row dot()'s bits; they differ in
/// vector width and in how many rows share a load of the weights: two 4-lane vectors per row
/// (any CPU), one 8-lane AVX register per row, one 16-lane AVX-512 register per two rows.
enum class DotKernel { kPortable, kAvx, kAvx512 };

/// Whether this build and CPU run `kernel`. quant_matmul uses the widest one that does.
bool dot_kernel_available(DotKernel kernel);

/// Test hook: quant_matmul uses `kernel` (which must be available) from now on; std::nullopt
/// restores the default. Not synchronised with matmuls running on other threads.
void force_dot_kernel(std::optional<DotKernel> kernel);

/// Quantized matrix-vector product y[w.rows] = W·x[w.cols] (quant_matmul with m = 1).
void quant_matvec(const QuantMatrix& w, const float* x, float* y, ThreadPool* pool);

// ---- elementwise -------------------------------------------------------------------------------

/// sigmoid(x) = 1 / (1 + e^{−x}).
float sigmoid(float x);
/// silu(x) = x / (1 + e^{−x}) (torch's formula).
float silu(float x);
/// softplus(x) = x if x > 20, else ln(1 + e^x) (torch's default threshold of 20).
float softplus(float x);
/// x[i] ← silu(x[i]) for i < n.
void silu_inplace(float* x, int64_t n);
/// y[i] ← y[i] + x[i] for i < n (residual add).
void add_inplace(float* y, const float* x, int64_t n);

// ---- normalisation -----------------------------------------------------------------------------

/// RMSNorm (docs/model.md §3.2): y[j] = (x[j]·r)·gain[j] with r = 1/sqrt(Σx²/n + eps).
/// `gain` is the stored MLX weight (= 1 + w_hf). x, y: [n]; y may alias x.
void rms_norm(const float* x, const float* gain, int64_t n, float eps, float* y);

/// Gated RMSNorm of a GDN value head (docs/model.md §3.3 step 6, HF Qwen3_5MoeRMSNormGated):
/// y[j] = gain[j]·(o[j]·r)·silu(z[j]) with r = 1/sqrt(Σo²/n + eps); `gain` is the plain gain.
/// o, z, y: [n]; y may alias o.
void gated_rms_norm(const float* o, const float* z, const float* gain, int64_t n, float eps,
                    float* y);

/// In-place L2 normalisation as in HF's GDN (docs/model.md §4.5): x ← x·(1/sqrt(Σx² + eps)),
/// eps = 1e-6 in the model.
void l2_normalize(float* x, int64_t n, float eps);

// ---- rotary position embedding -----------------------------------------------------------------

/// RoPE angles at position `pos` for the half-split (NeoX) convention on `rotary_dim` dims,
/// computed in fp32 the way transformers does: inv_freq_j = 1/θ^(2j/rotary_dim) (fp32 pow),
/// φ_j = fp32(pos·inv_freq_j); cos[j] = cos φ_j, sin[j] = sin φ_j for j < rotary_dim/2.
void rope_cos_sin(int64_t pos, int rotary_dim, double theta, float* cos, float* sin);

/// Rotates the first rotary_dim dims of one head in place (docs/model.md §3.4 step 3), half-split:
/// for j < rotary_dim/2, with h = rotary_dim/2:
///   x'[j] = x[j]·cos[j] − x[j+h]·sin[j],   x'[j+h] = x[j+h]·cos[j] + x[j]·sin[j].
/// Dims ≥ rotary_dim are untouched.
void apply_rope(float* x, int rotary_dim, const float* cos, const float* sin);

// ---- Gated DeltaNet ----------------------------------------------------------------------------

/// One step of the causal depthwise conv (docs/model.md §3.3 step 2), before the SiLU.
/// taps: [channels, kernel] channel-major, tap kernel−1 multiplies the current input;
/// window: [channels, kernel−1], the previous raw inputs, oldest first (zeros at the start);
/// x: [channels] current raw input; y: [channels] output
///   y[c] = Σ_{t<kernel−1} window[c][t]·taps[c][t] + x[c]·taps[c][kernel−1].
/// Then shifts the window by one (drops the oldest, appends x). y must not alias x.
void causal_conv_step(const float* taps, float* window, const float* x, int64_t channels,
                      int kernel, float* y);

/// One delta-rule step of one value head (docs/model.md §3.3 step 5), fp32 state S [dk, dv]
/// (S[i][m], i = key dim, m = value dim), in this order:
///   S ← α·S;  pred[m] = Σ_i k[i]·S[i][m];  δ[m] = (v[m] − pred[m])·β;
///   S[i][m] ← S[i][m] + k[i]·δ[m];  out[m] = Σ_i q[i]·S[i][m].
/// Closed form: S_t = α(I − β k kᵀ)S_{t−1} + β k vᵀ, out = S_tᵀ q.
/// q, k: [dk] (already normalised and, for q, scaled); v, out: [dv].
void delta_rule_step(float* state, const float* q, const float* k, const float* v, float alpha,
                     float beta, int dk, int dv, float* out);

// ---- attention -----------------------------------------------------------------------------------

/// Causal softmax attention of one query head over `len` cached positions (docs/model.md §3.4 step 5):
/// s_t = (q·k_t)·scale, a = softmax(s) (max-subtracted, fp32), out = Σ_t a_t·v_t.
/// k_cache / v_cache point at position 0 of this head's key / value; consecutive positions are
/// `stride` floats apart. q, out: [head_dim]; scores: scratch of at least `len` floats.
void attention_head(const float* q, const float* k_cache, const float* v_cache, int64_t len,
                    int64_t stride, int head_dim, float scale, float* scores, float* out);

// ---- MoE routing and selection -------------------------------------------------------------------

/// Router top-k (docs/model.md §3.5, HF): p = softmax(logits) over all n_experts in fp32, pick the k
/// largest p in descending order (ties go to the lowest expert id; NaN never wins), then
/// weights[i] = p[ids[i]] / Σ_selected p when `renormalize`, else p[ids[i]].
/// logits: [n_experts]; ids, weights: [k]. Requires 1 ≤ k ≤ n_experts.
void route_top_k(const float* logits, int n_experts, int k, bool renormalize, int* ids,
                 float* weights);

/// The routing weights route_top_k gives a chosen expert set: weights[i] = p[ids[i]]
/// (/ Σ_i p[ids[i]] when `renormalize`), p = softmax(logits) in fp32. logits: [n_experts];
/// ids (each in [0, n_experts)), weights: [k].
void route_weights(const float* logits, int n_experts, const int* ids, int k, bool renormalize,
                   float* weights);

/// Index of the largest value (greedy selection, docs/model.md §3.6): ties go to the lowest index,
/// NaN never wins, an all-NaN (or empty) input returns 0.
int32_t argmax(const float* x, int64_t n);

}  // namespace lily::cpu
