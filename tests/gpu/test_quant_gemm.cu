// The tensor-core prefill GEMMs (src/backends/cuda/quant_gemm.cu) against the CPU reference on
// random MLX-affine weights of the real Qwen3.6-35B-A3B shapes: GDN qkv|z|a|b 12352×2048,
// out_proj 2048×4096, attention q|k|v 9216×2048, 256 experts (+ the shared one) × 512×2048
// gate/up and 2048×512 down; m ∈ {1, 7, 64, 100, 200, 256, 300} token rows (every tile shape and
// masked tails), plus 8-bit, odd widths and small (demo-like) expert shapes.
//
// Oracles and tolerances (docs/model.md §4.2: prefill GEMMs round each dequantized weight to bf16,
// accumulate in fp32, round the output once):
//  * "bf16-weight reference": fp64 sums of bf16(w)·x — the kernel's exact target, so only fp32
//    accumulation order and the output rounding differ: bf16 outputs within 1e-2 relative,
//    fp32 outputs within 1e-3, relative error |out − ref| / (|ref| + 1 % of the output RMS);
//  * the CPU backend's cpu::quant_matmul (exact fp32 weights, the CPU oracle of the project): the
//    bf16 weight rounding adds an absolute error of ≈ 0.2 % of the output RMS to every output
//    (so near-zero outputs are off by far more than 1e-2 of themselves); compared as RMS error
//    ≤ 1e-2 and max error ≤ 3e-2, both relative to the output RMS (a host simulation of these
//    random weights gave 0.23 % and 1.2 % over 20K outputs);
//  * expert activations act = bf16(silu(bf16 g)·bf16 u): within 3e-2 (same measure as the first
//    item): g and u are rounded to bf16, and where the fp32 sum sits on a rounding boundary the
//    rounded g flips by one ulp (≤ 0.8 %), which silu amplifies up to ≈ 4× near g ≈ −5; a host
//    simulation with sequential fp32 sums gave a worst case of 1.7 % over 200K activations;
//  * the grouping (counting sort by expert) is checked exactly, the slot-order combine to one
//    bf16 ulp, and the whole grouped MoE against the per-row CUDA expert kernels and a CPU
//    quant_matmul MoE of the same tokens (both with exact weights) with the RMS-relative
//    measure above: RMS error ≤ 1.5e-2, max ≤ 8e-2 (three rounded weight products and the
//    SwiGLU compound: a host simulation of this chain gave ≈ 0.5 % RMS, ≈ 2.6 % max over 8K outputs).
// The GEMMs have two kernels (quant_gemm.cu): register dequantization with a persistent work
// list (LILY_CUDA_GEMM_KERNEL=grouped, the default: the 4-bit grouped GEMMs; =all: the large
// dense ones too) and the shared-tile kernels (=0). Every case checks the selected kernel
// against the references above and the other one against it (grouped: act within 4e-2, expert
// outputs within 2e-2; dense: 2e-2 bf16, 2e-3 fp32, by the first item's measure: two
// independently rounded results, each within the reference tolerance). The regdq_* GEMM cases
// run under "all" so the references check the dense register-dequant kernel;
// the ragged grouped cases give experts 0, 1, 15, 64 and 200 rows (empty experts, single-row
// tiles, masked tails, several row tiles), the real shapes run at 2,048 tokens. Setting the
// variable for the whole run swaps which kernel the references check (the test applies the
// LILY_CUDA_* environment through CudaOptions::from_env before its first test, as the backend
// does; within the run it flips cuda::set_gemm_kernel).
// Outputs are poisoned (NaN) before each launch, so any element the kernels skip fails.
// The GEMM and grouped-MoE checks are case tables (kGemmCases, kGroupedCases: shape × bits ×
// kernel × token counts × seed) run by value-parameterised suites, tests named
// Cases/CudaQuantGemm.MatchesTheReferences/<case> and Cases/CudaGroupedExperts.MatchTheReferences/<case>.
// CudaQuantGemmTiming prints times and TFLOP/s (CUDA events after warm-up; never asserted).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/ops.h"
#include "backends/cuda/kernel_switches.h"
#include "backends/cuda/quant_gemm.h"
#include "gpu_test_util.h"

namespace lily::test {
namespace {

using cuda::DeviceBuffer;
using bf16_t = __nv_bfloat16;

constexpr int kHidden = 2048, kExperts = 256, kTopK = 8, kFfn = 512;

/// The GEMM kernel switch (cuda::gemm_kernel, quant_gemm.h) for the scope, then the one before:
/// kGrouped (default: register dequantization for the grouped GEMMs), kAll (also the large
/// dense ones), kOff (the shared-tile kernels everywhere).
struct ScopedGemmKernel : ScopedSwitch<cuda::GemmKernel> {
  explicit ScopedGemmKernel(cuda::GemmKernel mode) : ScopedSwitch(cuda::gemm_kernel, cuda::set_gemm_kernel, mode) {}
};

/// A case's GEMM kernel: std::nullopt for the switch as the run has it (the default, or
/// LILY_CUDA_GEMM_KERNEL; the references then check that kernel), else the mode the case sets
/// for its duration (ScopedGemmKernel).
using GemmPath = std::optional<cuda::GemmKernel>;

/// The path as the case names write it.
std::string path_name(const GemmPath& p) {
  if (!p) return "switch";
  switch (*p) {
    case cuda::GemmKernel::kGrouped: return "grouped";
    case cuda::GemmKernel::kAll: return "all";
    case cuda::GemmKernel::kOff: return "off";
    case cuda::GemmKernel::kWgmma: return "wgmma";
    case cuda::GemmKernel::kWgmmaNarrow: return "wgmma_narrow";
    case cuda::GemmKernel::kWgmmaMixed: return "wgmma_mixed";
  }
  return "?";
}

/// ScopedGemmKernel for a forced path; nothing for std::nullopt.
class ScopedGemmPath {
 public:
  explicit ScopedGemmPath(const GemmPath& p) {
    if (p) scoped_.emplace(*p);
  }

 private:
  std::optional<ScopedGemmKernel> scoped_;
};

/// The kernel switches as the CUDA backend would set them from the LILY_CUDA_* environment
/// (CudaOptions::from_env, apply_kernel_switches), before the first test: so that
/// LILY_CUDA_GEMM_KERNEL set for the whole run swaps which kernel the references check.
class SwitchesFromEnv : public ::testing::Environment {
 public:
  void SetUp() override { cuda::apply_kernel_switches(CudaOptions::from_env()); }
};
[[maybe_unused]] ::testing::Environment* const g_switches_from_env =
    ::testing::AddGlobalTestEnvironment(new SwitchesFromEnv);

/// Host QuantMatrix view of a RandomQuant (the layout the CPU backend reads).
QuantMatrix host_view(const RandomQuant& w) {
  QuantMatrix q;
  q.codes = w.codes.data();
  q.scales = w.scales.data();
  q.biases = w.biases.data();
  q.rows = w.rows;
  q.cols = w.cols;
  q.bits = w.bits;
  return q;
}

/// Row r of W dequantized exactly and rounded to bf16 (what the tensor-core kernels multiply).
std::vector<float> bf16_weight_row(const RandomQuant& w, int64_t r) {
  std::vector<float> v(w.cols);
  for (int c = 0; c < w.cols; ++c) v[c] = round_bf16(w.weight(r, c));
  return v;
}

double dot_f64(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(a[i]) * b[i];
  return s;
}

/// Expects out ≈ ref up to the bf16 rounding of the weights (see the file comment).
void expect_close_to_exact_weights(const std::vector<float>& out, const std::vector<double>& ref, double rms_tol,
                                   double max_tol, const std::string& what) {
  const auto [rms_err, max_err] = rms_relative_error(out, ref);
  EXPECT_LT(rms_err, rms_tol) << what << " (RMS error / output RMS)";
  EXPECT_LT(max_err, max_tol) << what << " (max error / output RMS)";
}

/// Weight rows checked numerically: both ends, every tile edge of the first 256, a spread.
std::vector<int64_t> rows_to_check(int64_t rows) {
  std::vector<int64_t> v;
  for (int64_t r : {0, 1, 31, 32, 63, 64, 65, 127, 128, 129, 255, 256})
    if (r < rows) v.push_back(r);
  const int64_t stride = std::max<int64_t>(1, rows / 200);
  for (int64_t r = 7; r < rows; r += stride) v.push_back(r);
  for (int64_t r = std::max<int64_t>(0, rows - 3); r < rows; ++r) v.push_back(r);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

/// A dense GEMM case: a random MLX-affine matrix W [rows, cols] of `bits` drawn from `seed`,
/// then for each token count m of `ms` in turn (from the same generator) bf16 activations
/// X [m, cols]; Y [m, rows] = X·Wᵀ in bf16 or (f32_out) fp32 by launch_quant_gemm on `path`.
/// `label` says what the shape stands for.
struct GemmCase {
  const char* label;
  int64_t rows;
  int cols, bits;
  bool f32_out;
  std::vector<int> ms;
  uint64_t seed;
  GemmPath path = std::nullopt;

  std::string name() const {
    std::string n = std::string(label) + "_" + quant_shape(rows, cols, bits) + (f32_out ? "_f32" : "_bf16") + "_m";
    for (size_t i = 0; i < ms.size(); ++i) n += (i ? "_" : "") + std::to_string(ms[i]);
    return n + "_" + path_name(path) + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name(); }
};

/// Dense GEMM of one random rows×cols matrix for each m, against both oracles (and the other
/// kernel against the one the path selects).
void check_gemm(const GemmCase& c) {
  const int64_t rows = c.rows;
  const int cols = c.cols, bits = c.bits;
  const bool f32_out = c.f32_out;
  const std::vector<int>& ms = c.ms;
  ScopedGemmPath path(c.path);
  std::mt19937_64 rng(c.seed);
  RandomQuant w(rows, cols, bits, rng);
  const std::vector<int64_t> check = rows_to_check(rows);
  std::vector<std::vector<float>> wrows;
  for (int64_t r : check) wrows.push_back(bf16_weight_row(w, r));
  const QuantMatrix hq = host_view(w);
  for (int m : ms) {
    SCOPED_TRACE(testing::Message() << rows << "x" << cols << " " << bits << "-bit m=" << m << (f32_out ? " fp32" : " bf16"));
    const std::vector<float> x = normal_bf16(int64_t(m) * cols, rng, 1.0f);
    DeviceBuffer dx = upload_bf16(x);
    DeviceBuffer dy = poisoned(size_t(m) * rows * 4);
    cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, f32_out ? nullptr : dy.as<bf16_t>(),
                            f32_out ? dy.as<float>() : nullptr, nullptr);
    const int64_t n_out = int64_t(m) * rows;
    const std::vector<float> all = f32_out ? download_f32(dy, n_out) : download_bf16(dy, n_out);
    for (int64_t i = 0; i < n_out; ++i) ASSERT_FALSE(std::isnan(all[i])) << "unwritten output at " << i;

    // The other kernel (file comment) on the same input: each within the reference tolerance.
    {
      ScopedGemmKernel other(cuda::gemm_kernel() == cuda::GemmKernel::kAll ? cuda::GemmKernel::kOff : cuda::GemmKernel::kAll);
      DeviceBuffer dy2 = poisoned(size_t(m) * rows * 4);
      cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, f32_out ? nullptr : dy2.as<bf16_t>(),
                              f32_out ? dy2.as<float>() : nullptr, nullptr);
      const std::vector<float> all2 = f32_out ? download_f32(dy2, n_out) : download_bf16(dy2, n_out);
      for (int64_t i = 0; i < n_out; ++i) ASSERT_FALSE(std::isnan(all2[i])) << "unwritten output (other kernel) at " << i;
      const std::vector<double> ref_all(all.begin(), all.end());
      EXPECT_LT(worst_rel(all2, ref_all, 0.01 * rms(ref_all)), f32_out ? 2e-3 : 2e-2) << "the two GEMM kernels disagree";
    }

    // (a) the bf16-weight reference on the checked rows, every token row.
    std::vector<float> out;
    std::vector<double> ref;
    for (int t = 0; t < m; ++t)
      for (size_t j = 0; j < check.size(); ++j) {
        out.push_back(all[int64_t(t) * rows + check[j]]);
        ref.push_back(dot_f64(wrows[j].data(), x.data() + int64_t(t) * cols, cols));
      }
    EXPECT_LT(worst_rel(out, ref, 0.01 * rms(ref)), f32_out ? 1e-3 : 1e-2) << "vs bf16-weight reference";

    // (b) cpu::quant_matmul (exact weights) on the first and the last 128 weight rows.
    const int64_t block = std::min<int64_t>(128, rows);
    for (int64_t first : {int64_t(0), rows - block}) {
      std::vector<float> y(size_t(m) * block);
      cpu::quant_matmul(hq.row_block(first, block), x.data(), m, y.data(), nullptr);
      std::vector<float> o;
      std::vector<double> r;
      for (int t = 0; t < m; ++t)
        for (int64_t i = 0; i < block; ++i) {
          o.push_back(all[int64_t(t) * rows + first + i]);
          r.push_back(y[size_t(t) * block + i]);
        }
      expect_close_to_exact_weights(o, r, 1e-2, 3e-2, "vs cpu::quant_matmul, rows " + std::to_string(first) + "+" +
                                                    std::to_string(block));
    }
    perf_report(c.name() + "_m" + std::to_string(m), quant_bytes(rows, cols, bits), 2.0 * m * double(rows) * cols, [&] {
      cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, f32_out ? nullptr : dy.as<bf16_t>(),
                              f32_out ? dy.as<float>() : nullptr, nullptr);
    });
  }
}

const std::vector<int> kMs = {1, 7, 64, 100, 200, 256, 300};  ///< every tile shape and masked tails

constexpr int64_t kGdnInRows = 8192 + 4096 + 32 + 32;  ///< GDN qkv|z|a|b in-projection rows

/// The dense GEMM cases: the real projections, odd widths, fp32 outputs and 8-bit under the
/// kernel switch as set, then the register-dequant ("all") and warpgroup-MMA dense tiles.
const std::vector<GemmCase> kGemmCases = {
    // The real dense projections.
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, kMs, 1},
    {"gdn_out_proj", kHidden, 4096, 4, false, kMs, 2},
    {"attn_in_proj", 9216, kHidden, 4, false, kMs, 3},
    // 20037 rows: odd width (unpaired stores) and ≥ 132 column tiles of 128 at m ≤ 64.
    {"wide_odd", 20037, 256, 4, false, {7, 40}, 4},
    {"wide_odd", 20037, 256, 8, false, {7, 40}, 9},  // the 8-bit tiles of width 128
    {"one_ktile", 333, 64, 4, false, {1, 65}, 5},
    // fp32 outputs and 8-bit.
    {"router", kExperts + 1, kHidden, 8, true, {1, 64, 256}, 6},  // router | shared gate shape
    {"eight_bit", 1024, 512, 8, false, {33, 256}, 7},
    {"fp32_out", 4096, kHidden, 4, true, {200}, 8},
    // Shapes where the register-dequant kernel takes the dense GEMM (≥ one item of 64 tokens ×
    // 256 weight rows per SM on an H200): full and ragged last row tiles (1100 = 17·64 + 12), odd
    // widths (unaligned rows: element stores), fp32 outputs. The references check the register-
    // dequant kernel ("all"), the agreement check the shared-tile one.
    {"regdq_out_proj", kHidden, 4096, 4, false, {2048, 1100}, 10, cuda::GemmKernel::kAll},  // at the default chunk
    {"regdq_col_tiles", 1037, 512, 4, true, {2000}, 11, cuda::GemmKernel::kAll},  // 5 column tiles, the last of 13 rows
    {"regdq_odd", 20037, 256, 4, false, {200}, 12, cuda::GemmKernel::kAll},
    // The warpgroup-MMA kernel ("wgmma": 256 weight rows × 128 tokens per item; "wgmma-narrow":
    // 128 rows) where it takes the dense GEMM (≥ one item per SM): full and ragged token tiles
    // (1100 = 8·128 + 76 and 1110 = 8·128 + 86: a second token block narrowed to 16 and to 32
    // columns), an odd width (element stores) over 8 k-tiles (one block of staged scales). The
    // agreement check compares it with the register-dequant kernel.
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, {2048, 1100, 1110}, 13, cuda::GemmKernel::kWgmma},
    {"odd_8ktiles", 20037, 512, 4, false, {200}, 14, cuda::GemmKernel::kWgmma},
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, {2048, 1100, 1110}, 13, cuda::GemmKernel::kWgmmaNarrow},
    {"odd_8ktiles", 20037, 512, 4, false, {200}, 14, cuda::GemmKernel::kWgmmaNarrow},
};

/// The dense GEMM case table (kGemmCases) against the references.
class CudaQuantGemm : public testing::TestWithParam<GemmCase> {};

TEST_P(CudaQuantGemm, MatchesTheReferences) { check_gemm(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaQuantGemm, testing::ValuesIn(kGemmCases), CaseName());

/// A token row of the dense 4-bit bf16 GEMM gets the same bits at any token count: 300 rows (the
/// wide wgmma items) against their first 1, 22 and 100 rows on their own (the narrow items, one
/// token block of 16, 32 or 64 columns), at the GDN in-projection and out-projection shapes. So
/// a prompt's dense projections do not depend on where it is cut into prefill chunks.
TEST(CudaQuantGemm, RowBitsDoNotDependOnTheTokenCount) {
  for (const auto [rows, cols] : {std::pair<int64_t, int>{12352, 2048}, {2048, 4096}}) {
    SCOPED_TRACE(quant_shape(rows, cols, 4));
    std::mt19937_64 rng(61);
    RandomQuant w(rows, cols, 4, rng);
    constexpr int kAll = 300;
    const std::vector<float> x = normal_bf16(int64_t(kAll) * cols, rng, 1.0f);
    DeviceBuffer dx = upload_bf16(x);
    auto run = [&](int m) {
      DeviceBuffer dy = poisoned(size_t(m) * rows * 2);
      cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, dy.as<bf16_t>(), nullptr, nullptr);
      return download_bf16(dy, int64_t(m) * rows);
    };
    const std::vector<float> all = run(kAll);
    for (int m : {1, 22, 100}) {
      const std::vector<float> part = run(m);
      const int64_t diff = bit_differences(part.data(), all.data(), size_t(m) * rows);
      int64_t unwritten = 0;
      for (int64_t i = 0; i < int64_t(m) * rows; ++i) unwritten += std::isnan(part[i]);
      EXPECT_EQ(unwritten, 0) << "m = " << m << ": outputs left unwritten";
      EXPECT_EQ(diff, 0) << "m = " << m << ": outputs that differ from the same rows among " << kAll;
    }
  }
}

TEST(CudaQuantGemm, RejectsUnsupportedShapes) {
  cuda::DeviceQuant q;
  q.rows = 4;
  q.cols = 100;
  q.bits = 4;
  EXPECT_THROW(cuda::launch_quant_gemm(q, nullptr, 1, nullptr, reinterpret_cast<float*>(16), nullptr), Error);
  q.cols = 128;
  q.bits = 3;
  EXPECT_THROW(cuda::launch_quant_gemm(q, nullptr, 1, nullptr, reinterpret_cast<float*>(16), nullptr), Error);
  q.bits = 4;
  EXPECT_THROW(cuda::launch_quant_gemm(q, nullptr, 0, nullptr, reinterpret_cast<float*>(16), nullptr), InternalError);
  // Misaligned activations / codes / outputs are refused before any launch.
  q.codes = reinterpret_cast<const uint32_t*>(64);
  const auto* x_off = reinterpret_cast<const __nv_bfloat16*>(66);
  EXPECT_THROW(cuda::launch_quant_gemm(q, x_off, 1, nullptr, reinterpret_cast<float*>(16), nullptr), InternalError);
  q.codes = reinterpret_cast<const uint32_t*>(68);
  EXPECT_THROW(cuda::launch_quant_gemm(q, reinterpret_cast<const __nv_bfloat16*>(64), 1, nullptr,
                                       reinterpret_cast<float*>(16), nullptr),
               InternalError);
}

// ---- grouped experts -------------------------------------------------------------------------------

/// Random routing of m tokens: k distinct experts per token (from the first `pool` experts), then
/// the shared expert E in slot k; weights in (0.01, 1).
void random_routing(int E, int k, int m, int pool, std::mt19937_64& rng, std::vector<int32_t>& ids,
                    std::vector<float>& weights) {
  ids.assign(size_t(m) * (k + 1), 0);
  weights.assign(ids.size(), 0.0f);
  std::vector<int> perm(pool);
  std::uniform_real_distribution<float> u01(0.01f, 1.0f);
  for (int t = 0; t < m; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < k; ++s) ids[size_t(t) * (k + 1) + s] = perm[s];
    ids[size_t(t) * (k + 1) + k] = E;
    for (int s = 0; s <= k; ++s) weights[size_t(t) * (k + 1) + s] = u01(rng);
  }
}

/// Routing with prescribed row counts: counts[e] assignments of routed expert e (Σ counts = m·k,
/// each ≤ m), laid out expert by expert over the slot-major positions s·m + t, so a run of ≤ m
/// positions never gives one token the same expert twice; the shared expert E in slot k;
/// weights in (0.01, 1).
void counted_routing(int E, int k, int m, const std::vector<int>& counts, std::mt19937_64& rng,
                     std::vector<int32_t>& ids, std::vector<float>& weights) {
  ASSERT_EQ(int(counts.size()), E);
  ASSERT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t(0)), int64_t(m) * k);
  ids.assign(size_t(m) * (k + 1), E);
  int64_t pos = 0;
  for (int e = 0; e < E; ++e) {
    ASSERT_LE(counts[e], m);
    for (int i = 0; i < counts[e]; ++i, ++pos) ids[size_t(pos % m) * (k + 1) + pos / m] = e;
  }
  std::uniform_real_distribution<float> u01(0.01f, 1.0f);
  weights.resize(ids.size());
  for (float& w : weights) w = u01(rng);
}

struct ExpertWeights {
  RandomQuant gate, up, down;
  ExpertWeights(int E, int hidden, int ffn, std::mt19937_64& rng)
      : gate((E + 1) * int64_t(ffn), hidden, 4, rng),
        up((E + 1) * int64_t(ffn), hidden, 4, rng),
        down((E + 1) * int64_t(hidden), ffn, 4, rng) {}
};

/// Checks the grouping scratch exactly against a host counting sort.
void check_grouping(const DeviceBuffer& grouping, const std::vector<int32_t>& ids, int n_groups, int m, int n_sel) {
  const int64_t n = cuda::expert_grouping_ints(n_groups, m, n_sel);
  ASSERT_EQ(n, 2 * (n_groups + 1) + int64_t(m) * n_sel);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> got(n);
  cuda::download(got.data(), grouping.as<int32_t>(), n);
  std::vector<int32_t> count(n_groups, 0);
  for (int32_t e : ids) ++count[e];
  std::vector<int32_t> offsets(n_groups + 1, 0), order;
  for (int e = 0; e < n_groups; ++e) offsets[e + 1] = offsets[e] + count[e];
  for (int e = 0; e < n_groups; ++e)
    for (size_t a = 0; a < ids.size(); ++a)
      if (ids[a] == e) order.push_back(int32_t(a));
  for (int e = 0; e <= n_groups; ++e) ASSERT_EQ(got[e], offsets[e]) << "offsets[" << e << "]";
  for (size_t i = 0; i < order.size(); ++i) ASSERT_EQ(got[2 * (n_groups + 1) + i], order[i]) << "order[" << i << "]";
  // Tile offsets: ceil(count / BM) per expert for one row-tile height BM ∈ {32, 64}.
  bool some_bm = false;
  for (int bm : {32, 64}) {
    bool ok = got[n_groups + 1] == 0;
    for (int e = 0; e < n_groups && ok; ++e)
      ok = got[n_groups + 1 + e + 1] - got[n_groups + 1 + e] == (count[e] + bm - 1) / bm;
    some_bm = some_bm || ok;
  }
  EXPECT_TRUE(some_bm) << "tile offsets are not ceil(count / BM) for BM 32 or 64";
}

/// Row counts cycling 0, 1, 15, 64, 200 over E experts (experts E − E % 5 … get 0 … as well).
std::vector<int> ragged_counts(int E) {
  static const int kPattern[5] = {0, 1, 15, 64, 200};
  std::vector<int> c(E);
  for (int e = 0; e < E; ++e) c[e] = kPattern[e % 5];
  return c;
}

/// A grouped-MoE case: E routed experts plus the shared one (ExpertWeights(E, hidden, ffn), 4-bit),
/// m tokens of bf16 activations [m, hidden], top k routed experts per token (routing: ids int32
/// and weights fp32 [m, k + 1]), all drawn from the generator seeded with `seed`, or where
/// draw ≥ 0 with the draw-th (from 0) output of std::mt19937_64(seed). Routing: uniform over the
/// first `pool` experts (random_routing), or (ragged) ragged_counts(E) rows per routed expert
/// (counted_routing; then m·k = Σ counts). `path`: the GEMM kernel.
struct GroupedCase {
  const char* label;
  int E, k, hidden, ffn, m, pool;
  uint64_t seed;
  int draw = -1;
  bool ragged = false;
  GemmPath path = std::nullopt;

  /// The seed check_grouped's generator starts from.
  uint64_t rng_seed() const {
    if (draw < 0) return seed;
    std::mt19937_64 seeds(seed);
    uint64_t s = 0;
    for (int i = 0; i <= draw; ++i) s = seeds();
    return s;
  }
  std::string name() const {
    return std::string(label) + "_E" + std::to_string(E) + "_top" + std::to_string(k) + "_h" + std::to_string(hidden) +
           "_ffn" + std::to_string(ffn) + "_m" + std::to_string(m) + (ragged ? "_ragged" : "_pool" + std::to_string(pool)) +
           "_" + path_name(path) + "_s" + std::to_string(seed) + (draw >= 0 ? "d" + std::to_string(draw) : "");
  }
  friend void PrintTo(const GroupedCase& c, std::ostream* os) { *os << c.name(); }
};

/// The device side of one grouped gate/up + down run (launch_grouped): the uploaded inputs, the
/// grouping scratch and the two outputs.
struct GroupedRun {
  DeviceBuffer dx;        // x as bf16 [m, hidden]
  DeviceBuffer did;       // routing ids int32 [m, k + 1]
  DeviceBuffer grouping;  // the grouping scratch, cuda::expert_grouping_ints(E + 1, m, k + 1) int32
  DeviceBuffer act;       // SwiGLU activations bf16 [m·(k + 1), ffn]
  DeviceBuffer slot;      // expert outputs bf16 [m·(k + 1), hidden]
};

/// Uploads x (bf16 values [m, hidden]) and the routing ids ([m, k + 1]), then launches on the
/// default stream the expert grouping, the grouped gate/up + SwiGLU and the grouped down on W
/// (E routed experts plus the shared one), and returns their buffers without waiting (the scratch
/// and both outputs NaN-poisoned before the launches). The one launch sequence of check_grouped
/// and grouped_outputs.
GroupedRun launch_grouped(const ExpertWeights& W, int E, int k, int hidden, int ffn, const std::vector<float>& x,
                          const std::vector<int32_t>& ids, int m) {
  const int n_sel = k + 1, n_groups = E + 1;
  const int64_t A = int64_t(m) * n_sel;
  GroupedRun r{upload_bf16(x), DeviceBuffer(ids.size() * 4),
               poisoned(size_t(cuda::expert_grouping_ints(n_groups, m, n_sel)) * 4), poisoned(size_t(A) * ffn * 2),
               poisoned(size_t(A) * hidden * 2)};
  cuda::upload(r.did.as<int32_t>(), ids.data(), ids.size());
  cuda::launch_expert_grouping(r.did.as<int32_t>(), m, n_sel, n_groups, r.grouping.as<int32_t>(), nullptr);
  cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), ffn, r.grouping.as<int32_t>(), n_groups,
                                          r.dx.as<bf16_t>(), m, n_sel, r.act.as<bf16_t>(), nullptr);
  cuda::launch_quant_gemm_grouped_down(W.down.view(), hidden, r.grouping.as<int32_t>(), n_groups, r.act.as<bf16_t>(),
                                       m, n_sel, r.slot.as<bf16_t>(), nullptr);
  return r;
}

/// The grouped MoE path: grouping, gate/up + SwiGLU, down, combine — each stage against its
/// own reference from the GPU's previous stage, then the whole against the per-row CUDA expert
/// kernels and against a CPU quant_matmul MoE.
/// `counts` (optional): the rows of each routed expert (counted_routing) instead of uniform
/// routing over the first `pool` experts.
void check_grouped(int E, int k, int hidden, int ffn, int m, int pool, uint64_t seed,
                   const std::vector<int>* counts = nullptr) {
  std::mt19937_64 rng(seed);
  ExpertWeights W(E, hidden, ffn, rng);
  const int n_sel = k + 1, n_groups = E + 1;
  const int64_t A = int64_t(m) * n_sel;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  if (counts) counted_routing(E, k, m, *counts, rng, ids, wts);
  else random_routing(E, k, m, pool, rng, ids, wts);
  if (testing::Test::HasFatalFailure()) return;
  const std::vector<float> x = normal_bf16(int64_t(m) * hidden, rng, 1.0f);

  DeviceBuffer dw = upload_f32(wts), out = poisoned(size_t(m) * hidden * 2);
  auto [dx, did, grouping, act, slot] = launch_grouped(W, E, k, hidden, ffn, x, ids, m);
  cuda::launch_expert_combine(slot.as<bf16_t>(), dw.as<float>(), m, n_sel, hidden, out.as<bf16_t>(), nullptr);
  // Perf mode: the two grouped GEMMs (gate/up + SwiGLU, down) on this routing, 2 · 3 · ffn ·
  // hidden flops per (token, slot).
  const std::string perf_name = "grouped_E" + std::to_string(E) + "_top" + std::to_string(k) + "_h" +
                                std::to_string(hidden) + "_ffn" + std::to_string(ffn) + "_m" + std::to_string(m) + "_" +
                                (counts ? "counted" : "pool" + std::to_string(pool));
  perf_report(perf_name, 0.0, 6.0 * double(A) * ffn * hidden, [&] {
    cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), ffn, grouping.as<int32_t>(), n_groups,
                                            dx.as<bf16_t>(), m, n_sel, act.as<bf16_t>(), nullptr);
    cuda::launch_quant_gemm_grouped_down(W.down.view(), hidden, grouping.as<int32_t>(), n_groups, act.as<bf16_t>(), m,
                                         n_sel, slot.as<bf16_t>(), nullptr);
  });

  check_grouping(grouping, ids, n_groups, m, n_sel);
  const std::vector<float> gact = download_bf16(act, A * ffn);
  const std::vector<float> gslot = download_bf16(slot, A * hidden);
  const std::vector<float> gout = download_bf16(out, int64_t(m) * hidden);
  for (float v : gact) ASSERT_FALSE(std::isnan(v)) << "unwritten activation";
  for (float v : gslot) ASSERT_FALSE(std::isnan(v)) << "unwritten expert output";
  for (float v : gout) ASSERT_FALSE(std::isnan(v)) << "unwritten MoE output";

  // The other grouped kernel (shared tile if the default ran, see the file comment) on the same
  // inputs: gate/up from x, down from the default's activations.
  {
    ScopedGemmKernel other(cuda::gemm_kernel() == cuda::GemmKernel::kOff ? cuda::GemmKernel::kGrouped : cuda::GemmKernel::kOff);
    DeviceBuffer act_o = poisoned(size_t(A) * ffn * 2), slot_o = poisoned(size_t(A) * hidden * 2);
    cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), ffn, grouping.as<int32_t>(), n_groups,
                                            dx.as<bf16_t>(), m, n_sel, act_o.as<bf16_t>(), nullptr);
    cuda::launch_quant_gemm_grouped_down(W.down.view(), hidden, grouping.as<int32_t>(), n_groups, act.as<bf16_t>(), m,
                                         n_sel, slot_o.as<bf16_t>(), nullptr);
    const std::vector<float> oact = download_bf16(act_o, A * ffn);
    const std::vector<float> oslot = download_bf16(slot_o, A * hidden);
    for (float v : oact) ASSERT_FALSE(std::isnan(v)) << "unwritten activation (other grouped kernel)";
    for (float v : oslot) ASSERT_FALSE(std::isnan(v)) << "unwritten expert output (other grouped kernel)";
    const std::vector<double> ract(gact.begin(), gact.end()), rslot(gslot.begin(), gslot.end());
    EXPECT_LT(worst_rel(oact, ract, 0.01 * rms(ract)), 4e-2) << "grouped gate/up: the two kernels disagree";
    EXPECT_LT(worst_rel(oslot, rslot, 0.01 * rms(rslot)), 2e-2) << "grouped down: the two kernels disagree";
  }

  // Assignments of each expert (to dequantize each checked weight row once).
  std::vector<std::vector<int64_t>> by_expert(n_groups);
  for (int64_t a = 0; a < A; ++a) by_expert[ids[a]].push_back(a);

  // gate/up + SwiGLU on a spread of activation columns, every assignment.
  {
    std::vector<float> o;
    std::vector<double> r;
    for (int e = 0; e < n_groups; ++e) {
      if (by_expert[e].empty()) continue;
      for (int i = 0; i < ffn; i += std::max(1, ffn / 24)) {
        const std::vector<float> wg = bf16_weight_row(W.gate, int64_t(e) * ffn + i);
        const std::vector<float> wu = bf16_weight_row(W.up, int64_t(e) * ffn + i);
        for (int64_t a : by_expert[e]) {
          const float* xt = x.data() + (a / n_sel) * hidden;
          const float g = round_bf16(float(dot_f64(wg.data(), xt, hidden)));
          const float u = round_bf16(float(dot_f64(wu.data(), xt, hidden)));
          o.push_back(gact[a * ffn + i]);
          r.push_back(round_bf16(cpu::silu(g) * u));
        }
      }
    }
    EXPECT_LT(worst_rel(o, r, 0.01 * rms(r)), 3e-2) << "grouped gate/up + SwiGLU";
  }
  // down on a spread of output columns, every assignment, from the GPU's activations.
  {
    std::vector<float> o;
    std::vector<double> r;
    for (int e = 0; e < n_groups; ++e) {
      if (by_expert[e].empty()) continue;
      for (int c = 0; c < hidden; c += std::max(1, hidden / 24)) {
        const std::vector<float> wd = bf16_weight_row(W.down, int64_t(e) * hidden + c);
        for (int64_t a : by_expert[e]) {
          o.push_back(gslot[a * hidden + c]);
          r.push_back(dot_f64(wd.data(), gact.data() + a * ffn, ffn));
        }
      }
    }
    EXPECT_LT(worst_rel(o, r, 0.01 * rms(r)), 1e-2) << "grouped down";
  }
  // combine: fp32 slot-order sum of the GPU's slot outputs, one bf16 rounding (≤ 1 ulp apart).
  {
    std::vector<double> r(size_t(m) * hidden);
    for (int t = 0; t < m; ++t)
      for (int c = 0; c < hidden; ++c) {
        float acc = 0.0f;
        for (int s = 0; s < n_sel; ++s) {
          const int64_t a = int64_t(t) * n_sel + s;
          acc += wts[a] * gslot[a * hidden + c];
        }
        r[size_t(t) * hidden + c] = acc;
      }
    // One bf16 ulp is at most 2^-7 ≈ 0.78 % of the value (the host sum may skip the GPU's FMA).
    EXPECT_LT(worst_rel(gout, r, 1e-3 * rms(r)), 1e-2) << "slot-order combine";
  }
  // The whole MoE vs the per-row CUDA expert kernels (exact-weight GEMVs, docs/model.md §4.3).
  {
    DeviceBuffer act2 = poisoned(size_t(A) * ffn * 2), out2 = poisoned(size_t(m) * hidden * 2);
    cuda::launch_expert_gate_up(W.gate.view(), W.up.view(), ffn, did.as<int32_t>(), n_sel, dx.as<bf16_t>(), m,
                                act2.as<bf16_t>(), nullptr);
    cuda::launch_expert_down_combine(W.down.view(), hidden, did.as<int32_t>(), dw.as<float>(), n_sel,
                                     act2.as<bf16_t>(), m, out2.as<bf16_t>(), nullptr);
    const std::vector<float> rowwise = download_bf16(out2, int64_t(m) * hidden);
    std::vector<double> r(rowwise.begin(), rowwise.end());
    expect_close_to_exact_weights(gout, r, 1.5e-2, 8e-2, "grouped vs per-row CUDA experts");
  }
  // The whole MoE vs a CPU quant_matmul MoE (exact weights, §4.3 roundings) for a few tokens.
  {
    const QuantMatrix hg = host_view(W.gate), hu = host_view(W.up), hd = host_view(W.down);
    std::vector<float> o;
    std::vector<double> r;
    for (int t : {0, m / 2, m - 1}) {
      std::vector<float> acc(hidden, 0.0f), g(ffn), u(ffn), a(ffn), d(hidden);
      for (int s = 0; s < n_sel; ++s) {
        const int e = ids[size_t(t) * n_sel + s];
        cpu::quant_matmul(hg.row_block(int64_t(e) * ffn, ffn), x.data() + int64_t(t) * hidden, 1, g.data(), nullptr);
        cpu::quant_matmul(hu.row_block(int64_t(e) * ffn, ffn), x.data() + int64_t(t) * hidden, 1, u.data(), nullptr);
        for (int i = 0; i < ffn; ++i) a[i] = round_bf16(cpu::silu(round_bf16(g[i])) * round_bf16(u[i]));
        cpu::quant_matmul(hd.row_block(int64_t(e) * hidden, hidden), a.data(), 1, d.data(), nullptr);
        for (int c = 0; c < hidden; ++c) acc[c] += wts[size_t(t) * n_sel + s] * round_bf16(d[c]);
      }
      for (int c = 0; c < hidden; ++c) {
        o.push_back(gout[size_t(t) * hidden + c]);
        r.push_back(acc[c]);
      }
    }
    expect_close_to_exact_weights(o, r, 1.5e-2, 8e-2, "grouped vs CPU quant_matmul MoE");
  }
}

/// The grouped-MoE cases: the real shape with uniform, skewed and ragged routing, small shapes
/// (both row-tile heights), the prefill chunk, then the warpgroup-MMA kernels of both widths.
const std::vector<GroupedCase> kGroupedCases = {
    // The real shape, uniform routing; seeds drawn in turn from std::mt19937_64(40).
    {"real_uniform", kExperts, kTopK, kHidden, kFfn, 1, kExperts, 40, 0},
    {"real_uniform", kExperts, kTopK, kHidden, kFfn, 7, kExperts, 40, 1},
    {"real_uniform", kExperts, kTopK, kHidden, kFfn, 64, kExperts, 40, 2},
    {"real_uniform", kExperts, kTopK, kHidden, kFfn, 200, kExperts, 40, 3},
    {"real_uniform", kExperts, kTopK, kHidden, kFfn, 256, kExperts, 40, 4},
    // 256 tokens over 12 experts: ~170 rows per expert, several row tiles each with a masked tail.
    {"real_skewed", kExperts, kTopK, kHidden, kFfn, 256, 12, 41},
    // 1400 tokens × 9 slots = 12,600 assignments ≥ 48 × 257 groups: the row tile of 64.
    {"real_row_tile64", kExperts, kTopK, kHidden, kFfn, 1400, kExperts, 43},
    // Small shapes, both tile heights.
    {"small", 16, 4, 256, 128, 7, 16, 42},    // row tile 32
    {"small", 16, 4, 256, 128, 200, 16, 43},  // 1000 assignments over 17 experts → row tile 64
    {"small", 32, 8, 512, 128, 130, 32, 44},
    // 256 experts with 0 / 1 / 15 / 64 / 200 rows: Σ = 51 · 280 = 14,280 = 1,785 tokens × top-8;
    // the shared expert gets all 1,785 rows (28 row tiles of 64, the last one of 57 rows).
    {"real", kExperts, kTopK, kHidden, kFfn, 1785, kExperts, 45, -1, true},
    // 16 experts, top-4, Σ = 3 · 280 = 840 = 210 tokens × 4; hidden 320 (down: a column tile of
    // 256 plus a masked one), ffn 192 (gate/up: a column tile of 128 plus a half-masked one).
    {"odd_widths", 16, 4, 320, 192, 210, 16, 46, -1, true},
    // The prefill chunk of the default configuration: ≈ 64 rows per routed expert, 2,048 shared.
    {"real_chunk", kExperts, kTopK, kHidden, kFfn, 2048, kExperts, 47},
    // The grouped GEMMs on warpgroup MMAs (both item widths; they take K a multiple of 512): the
    // real shape at the prefill chunk, ragged experts (0 / 1 / 15 / 64 / 200 rows: one or two n64
    // blocks, several token tiles), 16 experts with hidden = ffn = 512, few tokens. The agreement
    // check compares each with the shared-tile kernel.
    {"real_chunk", kExperts, kTopK, kHidden, kFfn, 2048, kExperts, 50, -1, false, cuda::GemmKernel::kWgmma},
    {"real", kExperts, kTopK, kHidden, kFfn, 1785, kExperts, 51, -1, true, cuda::GemmKernel::kWgmma},
    {"small512", 16, 4, 512, 512, 210, 16, 52, -1, true, cuda::GemmKernel::kWgmma},
    {"real_few_tokens", kExperts, kTopK, kHidden, kFfn, 7, kExperts, 53, -1, false, cuda::GemmKernel::kWgmma},
    {"real_chunk", kExperts, kTopK, kHidden, kFfn, 2048, kExperts, 50, -1, false, cuda::GemmKernel::kWgmmaNarrow},
    {"real", kExperts, kTopK, kHidden, kFfn, 1785, kExperts, 51, -1, true, cuda::GemmKernel::kWgmmaNarrow},
    {"small512", 16, 4, 512, 512, 210, 16, 52, -1, true, cuda::GemmKernel::kWgmmaNarrow},
    {"real_few_tokens", kExperts, kTopK, kHidden, kFfn, 7, kExperts, 53, -1, false, cuda::GemmKernel::kWgmmaNarrow},
};

/// The grouped-MoE case table (kGroupedCases) against the references.
class CudaGroupedExperts : public testing::TestWithParam<GroupedCase> {};

TEST_P(CudaGroupedExperts, MatchTheReferences) {
  const GroupedCase& c = GetParam();
  ScopedGemmPath path(c.path);
  if (!c.ragged) {
    check_grouped(c.E, c.k, c.hidden, c.ffn, c.m, c.pool, c.rng_seed());
    return;
  }
  const std::vector<int> counts = ragged_counts(c.E);
  const int sum = std::accumulate(counts.begin(), counts.end(), 0);
  ASSERT_EQ(sum % c.k, 0);
  ASSERT_EQ(sum / c.k, c.m) << "the case's token count";
  check_grouped(c.E, c.k, c.hidden, c.ffn, c.m, c.pool, c.rng_seed(), &counts);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedExperts, testing::ValuesIn(kGroupedCases), CaseName());

/// The grouped gate/up + down of m tokens (x bf16 values [m, hidden], routing ids [m, k + 1]) on W:
/// act [m·(k + 1), ffn] and the expert outputs [m·(k + 1), hidden], as floats of their bf16 bits.
std::pair<std::vector<float>, std::vector<float>> grouped_outputs(const ExpertWeights& W, int E, int k, int hidden,
                                                                  int ffn, const std::vector<float>& x,
                                                                  const std::vector<int32_t>& ids, int m) {
  const int64_t A = int64_t(m) * (k + 1);
  const GroupedRun run = launch_grouped(W, E, k, hidden, ffn, x, ids, m);
  CUDA_CHECK(cudaDeviceSynchronize());
  return {download_bf16(run.act, A * ffn), download_bf16(run.slot, A * hidden)};
}

/// A token's grouped gate/up and down outputs are the same bits whatever else its experts get:
/// 600 tokens (the items of 128 rows: token blocks of 64 + 64, 64 + 16, …, 32, 16 columns) over
/// 12 experts (≈ 400 rows each) and over all 256 (≈ 19 rows each), against the same tokens alone
/// (one row per expert: the short-prompt items, 16 columns), in groups of 20 and of 60 (the
/// short-prompt items with 16 or 32 columns, an expert's rows split into items of 32). So a
/// prompt's MoE bits do not depend on where it is cut into prefill chunks. The real shape, on
/// each wgmma item width.
TEST(CudaGroupedExperts, TokenBitsDoNotDependOnTheOtherRowsOfItsExperts) {
  constexpr int m = 600;
  std::mt19937_64 rng(60);
  const ExpertWeights W(kExperts, kHidden, kFfn, rng);
  const std::vector<float> x = normal_bf16(int64_t(m) * kHidden, rng, 1.0f);
  const int n_sel = kTopK + 1;
  for (int pool : {12, kExperts}) {
    std::vector<int32_t> ids;
    std::vector<float> wts;
    random_routing(kExperts, kTopK, m, pool, rng, ids, wts);
    for (GemmPath path : {GemmPath{}, GemmPath{cuda::GemmKernel::kWgmma}, GemmPath{cuda::GemmKernel::kWgmmaNarrow}}) {
      SCOPED_TRACE("pool " + std::to_string(pool) + ", path " + path_name(path));
      ScopedGemmPath scoped(path);
      const auto [act, out] = grouped_outputs(W, kExperts, kTopK, kHidden, kFfn, x, ids, m);
      // Tokens [t0, t0 + n) on their own, compared with their rows of the full run.
      auto check_tokens = [&](int t0, int n) {
        const std::vector<float> xs(x.begin() + int64_t(t0) * kHidden, x.begin() + int64_t(t0 + n) * kHidden);
        const std::vector<int32_t> is(ids.begin() + int64_t(t0) * n_sel, ids.begin() + int64_t(t0 + n) * n_sel);
        const auto [sub_act, sub_out] = grouped_outputs(W, kExperts, kTopK, kHidden, kFfn, xs, is, n);
        const int64_t n_act = int64_t(n) * n_sel * kFfn, act0 = int64_t(t0) * n_sel * kFfn;
        const int64_t n_out = int64_t(n) * n_sel * kHidden, out0 = int64_t(t0) * n_sel * kHidden;
        const int64_t act_diff = bit_differences(sub_act.data(), act.data() + act0, size_t(n_act));
        const int64_t out_diff = bit_differences(sub_out.data(), out.data() + out0, size_t(n_out));
        int64_t unwritten = 0;
        for (int64_t i = 0; i < n_act; ++i) unwritten += std::isnan(sub_act[i]) + std::isnan(act[act0 + i]);
        for (int64_t i = 0; i < n_out; ++i) unwritten += std::isnan(sub_out[i]) + std::isnan(out[out0 + i]);
        EXPECT_EQ(unwritten, 0) << "tokens " << t0 << " … " << t0 + n - 1 << ": outputs left unwritten";
        EXPECT_EQ(act_diff, 0) << "tokens " << t0 << " … " << t0 + n - 1 << ": activations that differ from the full run";
        EXPECT_EQ(out_diff, 0) << "tokens " << t0 << " … " << t0 + n - 1 << ": expert outputs that differ from the full run";
      };
      for (int t : {0, 317, m - 1}) check_tokens(t, 1);
      check_tokens(20, 20);
      check_tokens(540, 60);
    }
  }
}

TEST(CudaGroupedExperts, RejectsBadArguments) {
  cuda::DeviceQuant q;
  q.rows = 4;
  q.cols = 96;
  q.bits = 4;
  int32_t* g = reinterpret_cast<int32_t*>(256);  // never dereferenced: the checks run before any launch
  EXPECT_THROW(cuda::launch_quant_gemm_grouped_down(q, 4, g, 1, nullptr, 1, 1, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::launch_expert_grouping(nullptr, 1, 1, 5000, g, nullptr), Error);
  EXPECT_THROW(cuda::launch_expert_grouping(nullptr, 0, 9, 257, g, nullptr), InternalError);
}

// ---- timing (printed, never asserted) -----------------------------------------------------------

constexpr int kTimingReps = 50;  // fewer than the core kernels' 200: these launches are long

TEST(CudaQuantGemmTiming, PrintsTimes) {
  std::mt19937_64 rng(99);
  const int max_m = 2048;
  const std::vector<float> x = normal_bf16(int64_t(max_m) * 4096, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x), y(size_t(max_m) * 12352 * 2);
  struct Shape { const char* name; int64_t rows; int cols; };
  for (const Shape& s : {Shape{"gdn qkv|z|a|b 12352x2048", 12352, kHidden}, Shape{"gdn out_proj 2048x4096", kHidden, 4096},
                         Shape{"attn q|k|v 9216x2048", 9216, kHidden}}) {
    RandomQuant w(s.rows, s.cols, 4, rng);
    for (int m : {256, 2048}) {
      const double tc = time_us([&] { cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, y.as<bf16_t>(), nullptr, nullptr); }, kTimingReps);
      const double gv = time_us([&] { cuda::launch_quant_gemv_batched(w.view(), dx.as<bf16_t>(), std::min(m, 256), y.as<bf16_t>(), nullptr, nullptr); }, 10);
      double rd = 0;
      {
        ScopedGemmKernel all(cuda::GemmKernel::kAll);
        rd = time_us([&] { cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, y.as<bf16_t>(), nullptr, nullptr); }, kTimingReps);
      }
      double wg[2] = {0, 0};
      for (int i = 0; i < 2; ++i) {
        ScopedGemmKernel wgmma(i == 0 ? cuda::GemmKernel::kWgmma : cuda::GemmKernel::kWgmmaNarrow);
        wg[i] = time_us([&] { cuda::launch_quant_gemm(w.view(), dx.as<bf16_t>(), m, y.as<bf16_t>(), nullptr, nullptr); }, kTimingReps);
      }
      const double flop = 2.0 * m * s.rows * s.cols;
      std::printf("[timing] %-26s m=%4d  tensor-core %9.1f us %6.1f TFLOP/s | gemm-kernel=all %9.1f us %6.1f TFLOP/s | "
                  "wgmma %9.1f us %6.1f TFLOP/s | wgmma-narrow %9.1f us %6.1f TFLOP/s | batched GEMV (m=%d) %9.1f us\n",
                  s.name, m, tc, flop / tc / 1e6, rd, flop / rd / 1e6, wg[0], flop / wg[0] / 1e6, wg[1], flop / wg[1] / 1e6,
                  std::min(m, 256), gv);
    }
  }
  // Grouped MoE (256 experts top-8 + shared, uniform routing) at m = 256 and 2048 tokens.
  ExpertWeights W(kExperts, kHidden, kFfn, rng);
  for (int m : {256, 2048}) {
    const int n_sel = kTopK + 1, n_groups = kExperts + 1;
    std::vector<int32_t> ids;
    std::vector<float> wts;
    random_routing(kExperts, kTopK, m, kExperts, rng, ids, wts);
    DeviceBuffer did(ids.size() * 4), dw = upload_f32(wts);
    cuda::upload(did.as<int32_t>(), ids.data(), ids.size());
    DeviceBuffer grouping(size_t(cuda::expert_grouping_ints(n_groups, m, n_sel)) * 4);
    DeviceBuffer act(size_t(m) * n_sel * kFfn * 2), slot(size_t(m) * n_sel * kHidden * 2), out(size_t(m) * kHidden * 2);
    const double grp = time_us([&] { cuda::launch_expert_grouping(did.as<int32_t>(), m, n_sel, n_groups, grouping.as<int32_t>(), nullptr); }, kTimingReps);
    const double gu = time_us([&] {
      cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), kFfn, grouping.as<int32_t>(), n_groups,
                                              dx.as<bf16_t>(), m, n_sel, act.as<bf16_t>(), nullptr);
    }, kTimingReps);
    const double dn = time_us([&] {
      cuda::launch_quant_gemm_grouped_down(W.down.view(), kHidden, grouping.as<int32_t>(), n_groups, act.as<bf16_t>(), m,
                                           n_sel, slot.as<bf16_t>(), nullptr);
    }, kTimingReps);
    double gu_old = 0, dn_old = 0;  // the shared-tile kernels (the defaults above use the switch as set)
    {
      ScopedGemmKernel shared_tile(cuda::GemmKernel::kOff);
      gu_old = time_us([&] {
        cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), kFfn, grouping.as<int32_t>(), n_groups,
                                                dx.as<bf16_t>(), m, n_sel, act.as<bf16_t>(), nullptr);
      }, kTimingReps);
      dn_old = time_us([&] {
        cuda::launch_quant_gemm_grouped_down(W.down.view(), kHidden, grouping.as<int32_t>(), n_groups,
                                             act.as<bf16_t>(), m, n_sel, slot.as<bf16_t>(), nullptr);
      }, kTimingReps);
    }
    const double flop_gu = 2.0 * m * n_sel * 2.0 * kFfn * kHidden, flop_dn = 2.0 * m * n_sel * kFfn * kHidden;
    for (cuda::GemmKernel mode : {cuda::GemmKernel::kWgmma, cuda::GemmKernel::kWgmmaNarrow}) {
      ScopedGemmKernel wgmma(mode);
      const double gu_w = time_us([&] {
        cuda::launch_quant_gemm_grouped_gate_up(W.gate.view(), W.up.view(), kFfn, grouping.as<int32_t>(), n_groups,
                                                dx.as<bf16_t>(), m, n_sel, act.as<bf16_t>(), nullptr);
      }, kTimingReps);
      const double dn_w = time_us([&] {
        cuda::launch_quant_gemm_grouped_down(W.down.view(), kHidden, grouping.as<int32_t>(), n_groups,
                                             act.as<bf16_t>(), m, n_sel, slot.as<bf16_t>(), nullptr);
      }, kTimingReps);
      std::printf("[timing] grouped m=%4d %-12s gate/up %.1f us (%.1f TFLOP/s); down %.1f us (%.1f TFLOP/s)\n", m,
                  mode == cuda::GemmKernel::kWgmma ? "wgmma" : "wgmma-narrow", gu_w, flop_gu / gu_w / 1e6, dn_w,
                  flop_dn / dn_w / 1e6);
    }
    std::printf("[timing] grouped m=%4d gate/up: default %.1f us (%.1f TFLOP/s), shared-tile %.1f us (%.1f TFLOP/s); "
                "down: default %.1f us (%.1f TFLOP/s), shared-tile %.1f us (%.1f TFLOP/s)\n",
                m, gu, flop_gu / gu / 1e6, gu_old, flop_gu / gu_old / 1e6, dn, flop_dn / dn / 1e6, dn_old,
                flop_dn / dn_old / 1e6);
    const double cb = time_us([&] { cuda::launch_expert_combine(slot.as<bf16_t>(), dw.as<float>(), m, n_sel, kHidden, out.as<bf16_t>(), nullptr); }, kTimingReps);
    const double rowwise = time_us([&] {
      cuda::launch_expert_gate_up(W.gate.view(), W.up.view(), kFfn, did.as<int32_t>(), n_sel, dx.as<bf16_t>(), m,
                                  act.as<bf16_t>(), nullptr);
      cuda::launch_expert_down_combine(W.down.view(), kHidden, did.as<int32_t>(), dw.as<float>(), n_sel, act.as<bf16_t>(),
                                       m, out.as<bf16_t>(), nullptr);
    }, 5);
    const double flop = 2.0 * m * n_sel * 3.0 * kFfn * kHidden;
    std::printf("[timing] grouped MoE m=%4d: grouping %.1f us, gate/up %.1f us, down %.1f us, combine %.1f us = %.1f us "
                "(%.1f TFLOP/s) | per-row kernels %.1f us\n",
                m, grp, gu, dn, cb, grp + gu + dn + cb, flop / (grp + gu + dn + cb) / 1e6, rowwise);
  }
}

}  // namespace
}  // namespace lily::test
