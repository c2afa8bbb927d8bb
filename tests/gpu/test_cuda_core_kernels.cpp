// CUDA-CORE kernels against exact reference loops, on random inputs of the real
// Qwen3.6-35B-A3B shapes (hidden 2048, 256 experts, I 512, vocab 248320) and of the small
// synthetic shapes (hidden 256/128). Tolerances: bf16 outputs within 1e-2 relative (floor: 1 %
// of the output RMS), fp32 outputs within 1e-3 (docs/model.md §4.3 and §4.5).
// The GEMV, router, FusedNorm / FusedConv and MoE expert checks are case tables run by
// value-parameterised suites (shape × bits × path × tokens × seed; tests named
// Cases/<suite>.<test>/<case name>, gpu_test_util.h); with LILY_GPU_PERF=1 the GEMV table also
// times every case (perf_report).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "backends/cpu/ops.h"
#include "backends/cuda/mixer_kernels.h"
#include "gpu_test_util.h"

namespace lily::test {
namespace {

using cuda::DeviceBuffer;

constexpr int kHidden = 2048, kExperts = 256, kTopK = 8, kFfn = 512, kVocab = 248320;

// ---- GEMV paths and the GEMV case table ---------------------------------------------------------

/// Which GEMV kernels a case runs on, through the process-wide switches (kernels.h):
/// kDefault: both at their defaults (the streaming GEMV for 4-bit widths it takes, token-row
/// tiles for m > 1 where no fused norm); kRegisterLoads: the streaming GEMV off (the register-load
/// MMA GEMV takes the 4-bit cases it supports); kPerRow: token-row tiles off (the per-row CUDA-core kernel,
/// one grid row per token, for the m > 1 cases the streaming and MMA GEMVs do not take).
enum class GemvPath { kDefault, kRegisterLoads, kPerRow };

/// The path as the case names write it.
const char* path_name(GemvPath p) {
  switch (p) {
    case GemvPath::kDefault: return "default";
    case GemvPath::kRegisterLoads: return "regload";
    case GemvPath::kPerRow: return "perrow";
  }
  return "?";
}

/// Sets the GEMV switches (cuda::set_stream_gemv_enabled, cuda::set_gemv_row_tiles_enabled) for
/// `path` for the scope, then restores the settings it found.
class ScopedGemvPath {
 public:
  explicit ScopedGemvPath(GemvPath path)
      : stream_(cuda::stream_gemv_enabled, cuda::set_stream_gemv_enabled, path != GemvPath::kRegisterLoads),
        row_tiles_(cuda::gemv_row_tiles_enabled, cuda::set_gemv_row_tiles_enabled, path != GemvPath::kPerRow) {}

  /// The row-tiles switch alone, within the scope.
  void set_row_tiles(bool on) const { row_tiles_.set(on); }

 private:
  ScopedSwitch<bool> stream_, row_tiles_;
};

/// One GEMV case: a random MLX-affine matrix W [rows, cols] of `bits` (4 or 8) and m bf16
/// activation rows X [m, cols] drawn from `seed`; Y [m, rows] = X·Wᵀ in bf16 or (f32_out) fp32,
/// computed by launch_quant_gemv_batched on `path`. `label` says what the shape stands for.
struct GemvCase {
  const char* label;
  int64_t rows;
  int cols, bits;
  bool f32_out;
  int m;
  uint64_t seed;
  GemvPath path = GemvPath::kDefault;

  std::string name() const {
    return std::string(label) + "_" + quant_shape(rows, cols, bits) + (f32_out ? "_f32" : "_bf16") + "_m" +
           std::to_string(m) + "_" + path_name(path) + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const GemvCase& c, std::ostream* os) { *os << c.name(); }
};

constexpr int64_t kGdnInRows = 8192 + 4096 + 32 + 32;  ///< GDN qkv|z|a|b in-projection rows

/// The GEMV cases. The last column is the path; the default path is written out where the case
/// is one of the streaming / register-load pairs.
const std::vector<GemvCase> kGemvCases = {
    // Decode shapes of Qwen3.6-35B-A3B.
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, 1, 1},
    {"out_proj", kHidden, 4096, 4, false, 1, 2},
    {"expert_down", kHidden, kFfn, 4, false, 1, 3},
    // Small widths.
    {"small_width", 1000, 256, 4, false, 1, 4},
    {"small_width", 777, 128, 4, false, 1, 5},
    {"small_width", 333, 64, 4, false, 1, 6},
    {"groups48", 129, 3072, 4, false, 1, 7},  // 48 groups: not a power of two
    {"router", kExperts + 1, kHidden, 8, true, 1, 8},
    {"batched", 1500, kHidden, 4, false, 3, 9},
    {"eight_bit_small", 257, 256, 8, true, 2, 10},
    // The MMA GEMV: m ≤ 8, rows not a multiple of 16.
    {"mma", 1000, kHidden, 4, false, 8, 11},
    {"mma", 250, 4096, 4, true, 2, 12},
    {"mma_one_kslice", 100, 192, 4, false, 5, 13},  // 3 groups: one k-slice
    {"mma", 17, 64, 4, true, 1, 14},
    // The bulk-copy streaming GEMV (default for cols % 512 == 0) and the register-load MMA GEMV
    // (its fallback) on the same cases: the decode shapes, ragged row counts, blocks with fewer
    // tiles than stages, and rings that wrap many times (the lm_head-like 20000 rows).
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, 1, 71, GemvPath::kDefault},
    {"out_proj", kHidden, 4096, 4, false, 1, 72, GemvPath::kDefault},
    {"ragged_tiles", 277, kHidden, 4, true, 1, 73, GemvPath::kDefault},  // 18 tiles, the last of 5 rows
    {"ring_wraps", 20000, kHidden, 4, true, 1, 74, GemvPath::kDefault},  // ~150 tiles per block
    {"mma", 1000, kHidden, 4, false, 8, 75, GemvPath::kDefault},
    {"one_group_per_warp", 777, 512, 4, false, 3, 76, GemvPath::kDefault},
    {"groups48", 129, 3072, 4, true, 2, 77, GemvPath::kDefault},
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, 1, 71, GemvPath::kRegisterLoads},
    {"out_proj", kHidden, 4096, 4, false, 1, 72, GemvPath::kRegisterLoads},
    {"ragged_tiles", 277, kHidden, 4, true, 1, 73, GemvPath::kRegisterLoads},
    {"ring_wraps", 20000, kHidden, 4, true, 1, 74, GemvPath::kRegisterLoads},
    {"mma", 1000, kHidden, 4, false, 8, 75, GemvPath::kRegisterLoads},
    {"one_group_per_warp", 777, 512, 4, false, 3, 76, GemvPath::kRegisterLoads},
    {"groups48", 129, 3072, 4, true, 2, 77, GemvPath::kRegisterLoads},
    // The token-tiled 8-bit kernel (token-row tiles on) against the reference.
    {"router_row_tiles", 257, kHidden, 8, true, 40, 95},
};

/// Runs the GEMV case c on its path and checks every output for having been written (no NaN) and
/// a spread of at most `check_rows` rows (plus the last) of every token against double loops
/// (RandomQuant::dot): bf16 outputs within 1e-2, fp32 within 1e-3 (worst_rel, floor 1 % of the RMS).
void check_gemv(const GemvCase& c, int check_rows = 4096) {
  const int64_t rows = c.rows;
  const int cols = c.cols, bits = c.bits, m = c.m;
  const bool f32_out = c.f32_out;
  ScopedGemvPath path(c.path);
  std::mt19937_64 rng(c.seed);
  RandomQuant w(rows, cols, bits, rng);
  const std::vector<float> x = normal_bf16(int64_t(m) * cols, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x);
  DeviceBuffer dy = poisoned(size_t(m) * rows * 4);
  cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), m, f32_out ? nullptr : dy.as<__nv_bfloat16>(),
                                  f32_out ? dy.as<float>() : nullptr, nullptr);
  const std::vector<float> all = f32_out ? download_f32(dy, int64_t(m) * rows) : download_bf16(dy, int64_t(m) * rows);
  // Every row is checked for having been written; a spread subset is checked numerically.
  for (float v : all) ASSERT_FALSE(std::isnan(v)) << "unwritten output";
  const int64_t stride = std::max<int64_t>(1, rows / check_rows);
  for (int t = 0; t < m; ++t) {
    std::vector<float> out;
    std::vector<double> ref;
    for (int64_t r = 0; r < rows; r += stride) {
      out.push_back(all[t * rows + r]);
      ref.push_back(w.dot(r, x.data() + int64_t(t) * cols));
    }
    out.push_back(all[t * rows + rows - 1]);
    ref.push_back(w.dot(rows - 1, x.data() + int64_t(t) * cols));
    const double err = worst_rel(out, ref, 0.01 * rms(ref));
    EXPECT_LT(err, f32_out ? 1e-3 : 1e-2) << rows << "x" << cols << " " << bits << "-bit row " << t;
  }
  perf_report(c.name(), quant_bytes(rows, cols, bits), 2.0 * m * double(rows) * cols, [&] {
    cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), m, f32_out ? nullptr : dy.as<__nv_bfloat16>(),
                                    f32_out ? dy.as<float>() : nullptr, nullptr);
  });
}

/// The GEMV case table (kGemvCases) against the reference.
class CudaGemv : public testing::TestWithParam<GemvCase> {};

TEST_P(CudaGemv, MatchesTheReference) { check_gemv(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaGemv, testing::ValuesIn(kGemvCases), CaseName());

/// Batch invariance (continuous batching relies on it): each token's outputs are bit-identical
/// whether it is multiplied alone or among m = 2 … 8 tokens.
TEST(CudaGemv, RowResultsDoNotDependOnTheTokenCount) {
  ScopedGemvPath path(GemvPath::kDefault);
  for (int cols : {kHidden, 4096}) {
    std::mt19937_64 rng(15 + cols);
    const int64_t rows = 777;
    RandomQuant w(rows, cols, 4, rng);
    const std::vector<float> x = normal_bf16(int64_t(8) * cols, rng, 1.0f);
    DeviceBuffer dx = upload_bf16(x);
    std::vector<std::vector<float>> alone(8);
    for (int t = 0; t < 8; ++t) {
      DeviceBuffer dy = poisoned(size_t(rows) * 4);
      cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>() + int64_t(t) * cols, 1, nullptr, dy.as<float>(),
                                      nullptr);
      alone[t] = download_f32(dy, rows);
    }
    for (int m = 2; m <= 8; ++m) {
      DeviceBuffer dy = poisoned(size_t(m) * rows * 4);
      cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), m, nullptr, dy.as<float>(), nullptr);
      const std::vector<float> all = download_f32(dy, int64_t(m) * rows);
      for (int t = 0; t < m; ++t)
        EXPECT_EQ(std::vector<float>(all.begin() + t * rows, all.begin() + (t + 1) * rows), alone[t])
            << "cols " << cols << ", token " << t << " of " << m;
    }
  }
}

/// A batched-GEMV case of the token-tiled kernel: a random 8- or 4-bit matrix W [rows, cols] and
/// m bf16 activation rows X [m, cols] drawn from `seed`; fp32 outputs Y [m, rows].
struct RowTilesCase {
  int64_t rows;
  int cols, bits, m;
  uint64_t seed;

  std::string name() const { return quant_shape(rows, cols, bits) + "_m" + std::to_string(m) + "_s" + std::to_string(seed); }
  friend void PrintTo(const RowTilesCase& c, std::ostream* os) { *os << c.name(); }
};

/// The prefill router's shape (8-bit, 257 rows: a whole 2,048-token chunk and ragged token
/// counts), a 4-bit batched projection and one group per lane. Seeds 90 + m + bits.
const std::vector<RowTilesCase> kRowTilesCases = {
    {257, kHidden, 8, 2048, 2146}, {257, kHidden, 8, 13, 111}, {257, kHidden, 8, 2, 100},
    {1500, kHidden, 4, 21, 115},   {100, 64, 8, 9, 107},
};

/// The token-tiled batched GEMV (LILY_CUDA_GEMV_ROW_TILES) against the per-row kernel it
/// replaces, bit for bit, over kRowTilesCases (the streaming GEMV on, as by default); its outputs
/// against the reference are the GEMV table's case router_row_tiles.
class CudaGemvRowTiles : public testing::TestWithParam<RowTilesCase> {};

TEST_P(CudaGemvRowTiles, BitIdenticalToPerRow) {
  const RowTilesCase& c = GetParam();
  ScopedGemvPath path(GemvPath::kDefault);
  std::mt19937_64 rng(c.seed);
  RandomQuant w(c.rows, c.cols, c.bits, rng);
  DeviceBuffer dx = upload_bf16(normal_bf16(int64_t(c.m) * c.cols, rng, 1.0f));
  std::vector<float> out[2];
  for (int tiled = 0; tiled < 2; ++tiled) {
    path.set_row_tiles(tiled == 1);
    DeviceBuffer dy = poisoned(size_t(c.m) * c.rows * 4);
    cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), c.m, nullptr, dy.as<float>(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    out[tiled] = download_f32(dy, int64_t(c.m) * c.rows);
  }
  const int64_t differ = bit_differences(out[0], out[1]);
  EXPECT_EQ(differ, 0) << "of " << out[0].size();
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGemvRowTiles, testing::ValuesIn(kRowTilesCases), CaseName());

/// A prefill router GEMM case: a random 8-bit router matrix W [rows, cols] and m bf16 activation
/// rows X [m, cols] drawn from `seed`; fp32 logits Y [m, rows].
struct RouterGemmCase {
  int64_t rows;
  int cols, m;
  uint64_t seed;

  std::string name() const { return quant_shape(rows, cols, 8) + "_m" + std::to_string(m) + "_s" + std::to_string(seed); }
  friend void PrintTo(const RouterGemmCase& c, std::ostream* os) { *os << c.name(); }
};

/// The real router shape (8-bit, 257 × 2048) for a whole chunk with a ragged tail and small
/// token counts, the demo model's shape (17 × 256), one group per row. Seeds 300 + m + rows.
const std::vector<RouterGemmCase> kRouterGemmCases = {
    {257, kHidden, 2048 + 37, 2642}, {257, kHidden, 1, 558}, {257, kHidden, 12, 569}, {257, kHidden, 22, 579},
    {257, kHidden, 63, 620}, {17, 256, 100, 417}, {65, 64, 9, 374},
};

/// The prefill router GEMM (tensor cores) against the fp64 reference, and against the batched
/// GEMV it replaces on every output (the same affine formula; only the order of the additions
/// inside a group differs). That GEMV runs with token-row tiles off (the per-row kernel), the
/// setting these cases have always been checked with.
class CudaRouterGemm : public testing::TestWithParam<RouterGemmCase> {};

TEST_P(CudaRouterGemm, MatchesTheReferenceAndTheGemv) {
  const RouterGemmCase& c = GetParam();
  ScopedGemvPath path(GemvPath::kPerRow);
  std::mt19937_64 rng(c.seed);
  RandomQuant w(c.rows, c.cols, 8, rng);
  const std::vector<float> x = normal_bf16(int64_t(c.m) * c.cols, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x);
  const size_t n = size_t(c.m) * c.rows;
  DeviceBuffer dy = poisoned(n * 4), dg = poisoned(n * 4);
  ASSERT_TRUE(cuda::router_gemm_supported(w.view()));
  cuda::launch_router_gemm(w.view(), dx.as<__nv_bfloat16>(), c.m, dy.as<float>(), nullptr);
  cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), c.m, nullptr, dg.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> y = download_f32(dy, int64_t(n)), gemv = download_f32(dg, int64_t(n));
  for (float v : y) ASSERT_FALSE(std::isnan(v)) << "unwritten output";
  std::vector<float> out;
  std::vector<double> ref;
  std::vector<int> tokens;  // a spread of tokens and the last one, every row of each
  for (int t = 0; t < c.m; t += std::max(1, c.m / 64)) tokens.push_back(t);
  if (tokens.back() != c.m - 1) tokens.push_back(c.m - 1);
  for (int t : tokens) {
    for (int64_t r = 0; r < c.rows; ++r) {
      out.push_back(y[size_t(t) * c.rows + r]);
      ref.push_back(w.dot(r, x.data() + int64_t(t) * c.cols));
    }
  }
  EXPECT_LT(worst_rel(out, ref, 0.01 * rms(ref)), 1e-3) << "against the fp64 reference";
  const std::vector<double> gemv_ref(gemv.begin(), gemv.end());
  EXPECT_LT(worst_rel(y, gemv_ref, 0.01 * rms(gemv_ref)), 1e-4) << "against the batched GEMV";
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaRouterGemm, testing::ValuesIn(kRouterGemmCases), CaseName());

/// A token's router logits are the same bits at any token count (each token count range has its
/// own tile and ring shape): 300 rows against their first 1, 5, 12, 22 and 40 rows alone, at the
/// real router shape. So a prompt's routing does not depend on where it is cut into chunks.
TEST(CudaRouterGemm, TokenBitsDoNotDependOnTheTokenCount) {
  std::mt19937_64 rng(63);
  RandomQuant w(257, kHidden, 8, rng);
  constexpr int kAll = 300;
  const std::vector<float> x = normal_bf16(int64_t(kAll) * kHidden, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x);
  auto run = [&](int m) {
    DeviceBuffer dy = poisoned(size_t(m) * 257 * 4);
    cuda::launch_router_gemm(w.view(), dx.as<__nv_bfloat16>(), m, dy.as<float>(), nullptr);
    return download_f32(dy, int64_t(m) * 257);
  };
  const std::vector<float> all = run(kAll);
  for (int m : {1, 5, 12, 22, 40}) {
    const std::vector<float> part = run(m);
    const int64_t diff = bit_differences(part.data(), all.data(), size_t(m) * 257);
    int64_t unwritten = 0;
    for (int64_t i = 0; i < int64_t(m) * 257; ++i) unwritten += std::isnan(part[i]);
    EXPECT_EQ(unwritten, 0) << "m = " << m << ": logits left unwritten";
    EXPECT_EQ(diff, 0) << "m = " << m << ": logits that differ from the same rows among " << kAll;
  }
}

TEST(CudaRouterGemm, RejectsUnsupportedShapes) {
  std::mt19937_64 rng(7);
  RandomQuant w4(257, kHidden, 4, rng);
  EXPECT_FALSE(cuda::router_gemm_supported(w4.view()));
  DeviceBuffer dx(size_t(kHidden) * 2), dy(257 * 4);
  EXPECT_THROW(cuda::launch_router_gemm(w4.view(), dx.as<__nv_bfloat16>(), 1, dy.as<float>(), nullptr), InternalError);
  RandomQuant w8(257, kHidden, 8, rng);
  EXPECT_THROW(cuda::launch_router_gemm(w8.view(), dx.as<__nv_bfloat16>(), 0, dy.as<float>(), nullptr), InternalError);
  cuda::DeviceQuant odd = w8.view();
  odd.cols = 100;
  EXPECT_FALSE(cuda::router_gemm_supported(odd));
}

TEST(CudaGemv, RejectsUnsupportedShapes) {
  cuda::DeviceQuant q;
  q.rows = 4;
  q.cols = 100;
  q.bits = 4;
  EXPECT_THROW(cuda::launch_quant_gemv(q, nullptr, nullptr, reinterpret_cast<float*>(16), nullptr), Error);
  q.cols = 128;
  q.bits = 3;
  EXPECT_THROW(cuda::launch_quant_gemv(q, nullptr, nullptr, reinterpret_cast<float*>(16), nullptr), Error);
}

TEST(CudaLmHead, GemvFp32AndArgmaxOnRealVocab) {
  std::mt19937_64 rng(11);
  RandomQuant w(kVocab, kHidden, 4, rng);
  const std::vector<float> x = normal_bf16(kHidden, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x), logits = poisoned(size_t(kVocab) * 4);
  const int slots = cuda::argmax_scratch_slots(kVocab);
  DeviceBuffer sv(slots * 4), si(slots * 4), id = poisoned(4);
  cuda::launch_quant_gemv(w.view(), dx.as<__nv_bfloat16>(), nullptr, logits.as<float>(), nullptr);
  cuda::launch_argmax(logits.as<float>(), kVocab, sv.as<float>(), si.as<int32_t>(), id.as<int32_t>(), nullptr);
  const std::vector<float> out = download_f32(logits, kVocab);
  int32_t got = -1;
  cuda::download(&got, id.as<int32_t>(), 1);
  EXPECT_EQ(got, cpu::argmax(out.data(), kVocab));
  std::vector<float> sub;
  std::vector<double> ref;
  for (int64_t r = 0; r < kVocab; r += 61) {
    sub.push_back(out[r]);
    ref.push_back(w.dot(r, x.data()));
  }
  EXPECT_LT(worst_rel(sub, ref, 0.01 * rms(ref)), 1e-3);
  // The GPU argmax must be the true argmax of the exact logits unless the top two are within
  // fp32 accumulation noise.
  for (float v : out) ASSERT_FALSE(std::isnan(v));
}

int32_t gpu_argmax(const std::vector<float>& v) {
  DeviceBuffer d = upload_f32(v);
  const int slots = cuda::argmax_scratch_slots(int64_t(v.size()));
  DeviceBuffer sv(slots * 4), si(slots * 4), id = poisoned(4);
  cuda::launch_argmax(d.as<float>(), int64_t(v.size()), sv.as<float>(), si.as<int32_t>(), id.as<int32_t>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  int32_t got = -1;
  cuda::download(&got, id.as<int32_t>(), 1);
  return got;
}

TEST(CudaArgmax, TiesGoToLowestIndexAndNanNeverWins) {
  std::mt19937_64 rng(12);
  std::vector<float> v = normal_bf16(kVocab, rng, 1.0f);
  v[200000] = 50.0f;
  v[100001] = 50.0f;
  v[7] = NAN;
  v[kVocab - 1] = NAN;
  EXPECT_EQ(gpu_argmax(v), 100001);
  v[3] = 50.0f;
  EXPECT_EQ(gpu_argmax(v), 3);
  std::vector<float> nan(1000, NAN);
  EXPECT_EQ(gpu_argmax(nan), 0);
  nan[999] = -INFINITY;
  EXPECT_EQ(gpu_argmax(nan), 999);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<float> r = normal_bf16(kVocab, rng, 1.0f);
    EXPECT_EQ(gpu_argmax(r), cpu::argmax(r.data(), kVocab));
  }
}

// One launch pair over several rows gives each row the id of the one-row argmax: rows with ties,
// NaNs, an all-NaN row and random rows, at the vocabulary's length.
TEST(CudaArgmax, RowsGiveEachRowItsOwnArgmax) {
  std::mt19937_64 rng(14);
  constexpr int kRows = 5;
  std::vector<float> all;
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < kRows; ++r) rows.push_back(normal_bf16(kVocab, rng, 1.0f));
  rows[0][200000] = rows[0][100001] = 50.0f;  // a tie: the lower id
  rows[1][7] = NAN;
  rows[1][kVocab - 1] = 60.0f;
  rows[2].assign(kVocab, NAN);  // all NaN: id 0
  rows[3][0] = 70.0f;
  for (const auto& r : rows) all.insert(all.end(), r.begin(), r.end());
  DeviceBuffer d = upload_f32(all);
  const int slots = cuda::argmax_scratch_slots(kVocab);
  DeviceBuffer sv(kRows * slots * 4), si(kRows * slots * 4), ids = poisoned(kRows * 4);
  cuda::launch_argmax_rows(d.as<float>(), kRows, kVocab, sv.as<float>(), si.as<int32_t>(), ids.as<int32_t>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> got(kRows, -1);
  cuda::download(got.data(), ids.as<int32_t>(), kRows);
  for (int r = 0; r < kRows; ++r) EXPECT_EQ(got[r], gpu_argmax(rows[r])) << "row " << r;
  EXPECT_EQ(got[0], 100001);
  EXPECT_EQ(got[1], kVocab - 1);
  EXPECT_EQ(got[2], 0);
  EXPECT_EQ(got[3], 0);
  EXPECT_EQ(got[4], cpu::argmax(rows[4].data(), kVocab));
}

TEST(CudaEmbed, GathersAndDequantizesRows) {
  std::mt19937_64 rng(13);
  RandomQuant table(kVocab, kHidden, 4, rng);
  const std::vector<int32_t> ids = {0, 248319, 123457, 5};
  DeviceBuffer dids(ids.size() * 4), out = poisoned(ids.size() * kHidden * 2);
  cuda::upload(dids.as<int32_t>(), ids.data(), ids.size());
  cuda::launch_embed(table.view(), dids.as<int32_t>(), int(ids.size()), out.as<__nv_bfloat16>(), nullptr);
  const std::vector<float> got = download_bf16(out, int64_t(ids.size()) * kHidden);
  for (size_t t = 0; t < ids.size(); ++t)
    for (int c = 0; c < kHidden; ++c)
      ASSERT_EQ(got[t * kHidden + c], round_bf16(table.weight(ids[t], c))) << "token " << ids[t] << " col " << c;
}

TEST(CudaRmsNorm, FusedResidualAddMatchesReference) {
  std::mt19937_64 rng(14);
  for (int n : {kHidden, 256, 128}) {
    const int m = 3;
    const std::vector<float> x = normal_bf16(int64_t(m) * n, rng, 2.0f);
    const std::vector<float> br = normal_bf16(int64_t(m) * n, rng, 0.5f);
    std::vector<float> gain = normal_bf16(n, rng, 0.3f);
    for (auto& g : gain) g += 1.0f;
    for (bool with_branch : {false, true}) {
      DeviceBuffer dx = upload_bf16(x), db = upload_bf16(br), dg = upload_f32(gain);
      DeviceBuffer dy = poisoned(size_t(m) * n * 2);
      cuda::launch_add_rmsnorm(dx.as<__nv_bfloat16>(), with_branch ? db.as<__nv_bfloat16>() : nullptr, dg.as<float>(),
                               dy.as<__nv_bfloat16>(), m, n, 1e-6f, nullptr);
      const std::vector<float> gx = download_bf16(dx, int64_t(m) * n), gy = download_bf16(dy, int64_t(m) * n);
      for (int t = 0; t < m; ++t) {
        std::vector<float> h(n), y(n);
        for (int i = 0; i < n; ++i) h[i] = with_branch ? round_bf16(x[t * n + i] + br[t * n + i]) : x[t * n + i];
        cpu::rms_norm(h.data(), gain.data(), n, 1e-6f, y.data());
        std::vector<double> ref(y.begin(), y.end());
        std::vector<float> out(gy.begin() + t * n, gy.begin() + (t + 1) * n);
        for (int i = 0; i < n; ++i) ASSERT_EQ(gx[t * n + i], h[i]) << "residual not bf16(x + branch)";
        EXPECT_LT(worst_rel(out, ref, 1e-3), 8e-3) << "n=" << n;
      }
    }
  }
}

/// Reference routing (docs/model.md §3.5): top-k logits, ties to the lowest id, softmax over them.
void reference_topk(const float* logits, int E, int k, std::vector<int>& ids, std::vector<double>& w) {
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  ids.assign(order.begin(), order.begin() + k);
  w.assign(k, 0);
  double denom = 0;
  for (int s = 0; s < k; ++s) denom += std::exp(double(logits[ids[s]]) - logits[ids[0]]);
  for (int s = 0; s < k; ++s) w[s] = std::exp(double(logits[ids[s]]) - logits[ids[0]]) / denom;
}

/// A router top-k case: fp32 logits [m, E + 1] (E routed experts, then the shared expert's gate
/// logit) ~ N(0, 2²), bf16-exact, drawn from `seed`; with_ties sets a three-way tie at the top
/// and a pair below it in every row. Top k of E.
struct RouterTopKCase {
  int E, k, m;
  uint64_t seed;
  bool with_ties;

  std::string name() const {
    return "E" + std::to_string(E) + "_top" + std::to_string(k) + "_m" + std::to_string(m) +
           (with_ties ? "_ties" : "_noties") + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const RouterTopKCase& c, std::ostream* os) { *os << c.name(); }
};

/// launch_router_topk against reference_topk and cpu::route_top_k on every token: the k ids
/// (int32 [m, k + 1], the shared expert E last) and weights (fp32 [m, k + 1]: softmax over the
/// selected logits within 1e-6, the CPU op's within 1e-5; the shared slot sigmoid(logit E)).
void check_router(const RouterTopKCase& c) {
  const int E = c.E, k = c.k, m = c.m;
  const bool with_ties = c.with_ties;
  std::mt19937_64 rng(c.seed);
  std::vector<float> logits = normal_bf16(int64_t(m) * (E + 1), rng, 2.0f);
  if (with_ties)
    for (int t = 0; t < m; ++t) {
      float* row = logits.data() + int64_t(t) * (E + 1);
      row[E - 1] = row[3] = row[E / 2] = 9.0f;  // a three-way tie at the top
      row[1] = row[E - 2] = 7.5f;
    }
  DeviceBuffer dl = upload_f32(logits), ids = poisoned(size_t(m) * (k + 1) * 4), w = poisoned(size_t(m) * (k + 1) * 4);
  cuda::launch_router_topk(dl.as<float>(), m, E, k, ids.as<int32_t>(), w.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> gid(size_t(m) * (k + 1));
  std::vector<float> gw(size_t(m) * (k + 1));
  cuda::download(gid.data(), ids.as<int32_t>(), gid.size());
  cuda::download(gw.data(), w.as<float>(), gw.size());
  for (int t = 0; t < m; ++t) {
    const float* row = logits.data() + int64_t(t) * (E + 1);
    std::vector<int> rid;
    std::vector<double> rw;
    reference_topk(row, E, k, rid, rw);
    for (int s = 0; s < k; ++s) {
      EXPECT_EQ(gid[t * (k + 1) + s], rid[s]) << "token " << t << " slot " << s;
      EXPECT_NEAR(gw[t * (k + 1) + s], rw[s], 1e-6);
    }
    EXPECT_EQ(gid[t * (k + 1) + k], E);
    EXPECT_NEAR(gw[t * (k + 1) + k], 1.0 / (1.0 + std::exp(-double(row[E]))), 1e-6);
    // Same selection as the CPU reference op (full softmax, then top-k, renormalised).
    std::vector<int> cid(k);
    std::vector<float> cw(k);
    cpu::route_top_k(row, E, k, true, cid.data(), cw.data());
    for (int s = 0; s < k; ++s) {
      EXPECT_EQ(gid[t * (k + 1) + s], cid[s]);
      EXPECT_NEAR(gw[t * (k + 1) + s], cw[s], 1e-5);
    }
  }
}

/// The real shape (256 experts, top 8), ties going to the lowest expert id, small shapes.
const std::vector<RouterTopKCase> kRouterTopKCases = {
    {kExperts, kTopK, 4, 15, false},
    {kExperts, kTopK, 2, 16, true},
    {16, 4, 3, 17, true},
    {8, 2, 1, 18, false},
};

/// The router top-k case table (kRouterTopKCases) against the references.
class CudaRouter : public testing::TestWithParam<RouterTopKCase> {};

TEST_P(CudaRouter, TopKMatchesTheReference) { check_router(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaRouter, testing::ValuesIn(kRouterTopKCases), CaseName());

// ---- fused router GEMV + top-k (launch_router_fused) -------------------------------------------

/// Copies row `from` of w over row `to` (codes, scales, biases; host and device), so that both
/// rows give bit-identical GEMV outputs on the GPU and on the CPU: an exact tie.
void copy_row(RandomQuant& w, int64_t from, int64_t to) {
  const int64_t wpr = int64_t(w.cols) * w.bits / 32, gpr = w.cols / 64;
  std::copy_n(w.codes.begin() + from * wpr, wpr, w.codes.begin() + to * wpr);
  std::copy_n(w.scales.begin() + from * gpr, gpr, w.scales.begin() + to * gpr);
  std::copy_n(w.biases.begin() + from * gpr, gpr, w.biases.begin() + to * gpr);
  cuda::upload(w.d_codes.as<uint32_t>(), w.codes.data(), w.codes.size());
  cuda::upload(w.d_scales.as<uint16_t>(), w.scales.data(), w.scales.size());
  cuda::upload(w.d_biases.as<uint16_t>(), w.biases.data(), w.biases.size());
}

/// CPU router logits of one token: float(Σ w·x) over all rows (double loops).
std::vector<float> cpu_router_logits(const RandomQuant& w, const float* x) {
  std::vector<float> l(w.rows);
  for (int64_t r = 0; r < w.rows; ++r) l[r] = float(w.dot(r, x));
  return l;
}

/// Expert ids of the first E logits by descending value, ties to the lowest id.
std::vector<int> ranking(const std::vector<float>& logits, int E) {
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  return order;
}

/// What a fused-router case does to the router matrix before the launch: nothing; duplicate
/// rows so that three experts tie exactly at the top (kThreeWayTop) or the last selected expert
/// ties with the lowest id outside the top k (kAtTheCut); NaN scales for experts 2 and E − 3
/// (kNanLogits); zero scales and biases, so that every logit is 0 (kAllZero).
enum class RouterTies { kNone, kThreeWayTop, kAtTheCut, kNanLogits, kAllZero };

/// The ties as the case names write them.
const char* ties_name(RouterTies t) {
  switch (t) {
    case RouterTies::kNone: return "noties";
    case RouterTies::kThreeWayTop: return "threewaytop";
    case RouterTies::kAtTheCut: return "tieatcut";
    case RouterTies::kNanLogits: return "nanlogits";
    case RouterTies::kAllZero: return "allzero";
  }
  return "?";
}

/// A fused-router case: a random router matrix W [E + 1, hidden] of `bits` (E routed experts,
/// then the shared expert's gate row) and m bf16 activation rows X [m, hidden] drawn from `seed`;
/// top k of E; W altered as `ties` says.
struct RouterFusedCase {
  int E, k, hidden, bits, m;
  uint64_t seed;
  RouterTies ties;

  std::string name() const {
    return "E" + std::to_string(E) + "_top" + std::to_string(k) + "_h" + std::to_string(hidden) + "_q" +
           std::to_string(bits) + "_m" + std::to_string(m) + "_" + ties_name(ties) + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const RouterFusedCase& c, std::ostream* os) { *os << c.name(); }
};

/// Fused router vs (a) the unfused launch_quant_gemv + launch_router_topk pair and (b) the CPU
/// reference (cpu::route_top_k on CPU-computed logits). Ties are made exact by duplicating
/// matrix rows, chosen from token 0's CPU ranking. Outputs: fp32 logits [m, E + 1], int32 ids
/// and fp32 weights [m, k + 1] (the shared expert last).
void check_router_fused(const RouterFusedCase& c) {
  const int E = c.E, k = c.k, hidden = c.hidden, bits = c.bits, m = c.m;
  const RouterTies ties = c.ties;
  std::mt19937_64 rng(c.seed);
  RandomQuant w(E + 1, hidden, bits, rng);
  const std::vector<float> x = normal_bf16(int64_t(m) * hidden, rng, 1.0f);
  std::vector<int> tied;  // expert ids that must tie exactly (token 0)
  if (ties == RouterTies::kNanLogits) {  // NaN scales: NaN logits for experts 2 and E − 3
    for (int row : {2, E - 3}) {
      for (int g = 0; g < hidden / 64; ++g) w.scales[size_t(row) * (hidden / 64) + g] = 0x7FC0;
    }
    cuda::upload(w.d_scales.as<uint16_t>(), w.scales.data(), w.scales.size());
  } else if (ties == RouterTies::kAllZero) {  // zero scales and biases: every logit is 0, all tie
    std::fill(w.scales.begin(), w.scales.end(), uint16_t{0});
    std::fill(w.biases.begin(), w.biases.end(), uint16_t{0});
    cuda::upload(w.d_scales.as<uint16_t>(), w.scales.data(), w.scales.size());
    cuda::upload(w.d_biases.as<uint16_t>(), w.biases.data(), w.biases.size());
    for (int e = 0; e < k; ++e) tied.push_back(e);
  } else if (ties != RouterTies::kNone) {
    const std::vector<int> order = ranking(cpu_router_logits(w, x.data()), E);
    if (ties == RouterTies::kThreeWayTop) {
      const int top = order[0], a = top == 0 ? 1 : 0, b = top == E - 1 ? E - 2 : E - 1;
      copy_row(w, top, a);
      copy_row(w, top, b);
      tied = {a, top, b};
    } else {  // the last selected expert ties with the lowest id outside the top k
      const int cut = order[k - 1];
      int u = 0;
      while (std::find(order.begin(), order.begin() + k, u) != order.begin() + k) ++u;
      copy_row(w, cut, u);
      tied = {cut, u};
    }
  }
  DeviceBuffer dx = upload_bf16(x);
  const size_t n_log = size_t(m) * (E + 1), n_sel = size_t(m) * (k + 1);
  DeviceBuffer f_log = poisoned(n_log * 4), f_ids = poisoned(n_sel * 4), f_w = poisoned(n_sel * 4);
  DeviceBuffer u_log = poisoned(n_log * 4), u_ids = poisoned(n_sel * 4), u_w = poisoned(n_sel * 4);
  DeviceBuffer done(size_t(m) * 4);
  done.fill_bytes(0);
  cuda::launch_quant_gemv_batched(w.view(), dx.as<__nv_bfloat16>(), m, nullptr, u_log.as<float>(), nullptr);
  cuda::launch_router_topk(u_log.as<float>(), m, E, k, u_ids.as<int32_t>(), u_w.as<float>(), nullptr);

  const std::vector<float> ul = download_f32(u_log, n_log), uw = download_f32(u_w, n_sel);
  const std::vector<int32_t> uid = download_i32(u_ids, n_sel);
  // Twice: the second launch checks that the block counters were reset (graph replay).
  for (int launch = 0; launch < 2; ++launch) {
    cuda::launch_router_fused(w.view(), dx.as<__nv_bfloat16>(), m, E, k, f_log.as<float>(), f_ids.as<int32_t>(),
                              f_w.as<float>(), done.as<uint32_t>(), nullptr);
    const std::vector<float> fl = download_f32(f_log, n_log), fw = download_f32(f_w, n_sel);
    const std::vector<int32_t> fid = download_i32(f_ids, n_sel), cnt = download_i32(done, size_t(m));
    for (int t = 0; t < m; ++t) {
      SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) + " hidden=" + std::to_string(hidden) +
                   " bits=" + std::to_string(bits) + " token " + std::to_string(t) + " launch " + std::to_string(launch));
      EXPECT_EQ(cnt[t], 0) << "block counter not reset";
      const float* frow = fl.data() + size_t(t) * (E + 1);
      const float* urow = ul.data() + size_t(t) * (E + 1);
      std::vector<double> uref;
      for (int e = 0; e <= E; ++e)
        if (!std::isnan(urow[e])) uref.push_back(urow[e]);
      const double floor = rms(uref);
      for (int e = 0; e <= E; ++e) {
        if (std::isnan(urow[e])) {
          ASSERT_TRUE(std::isnan(frow[e])) << "logit " << e;
          continue;
        }
        ASSERT_NEAR(frow[e], urow[e], 1e-6 * (std::fabs(urow[e]) + floor)) << "logit " << e;
      }
      if (t == 0) {
        for (int id : tied) EXPECT_EQ(frow[id], frow[tied[0]]) << "duplicated rows must tie exactly";
      }
      // (a) the unfused pair: identical ids, weights within 1e-6.
      for (int s = 0; s <= k; ++s) {
        EXPECT_EQ(fid[t * (k + 1) + s], uid[t * (k + 1) + s]) << "slot " << s;
        EXPECT_NEAR(fw[t * (k + 1) + s], uw[t * (k + 1) + s], 1e-6) << "slot " << s;
      }
      if (ties == RouterTies::kNanLogits) {  // NaN never wins
        for (int s = 0; s < k; ++s) EXPECT_TRUE(fid[t * (k + 1) + s] != 2 && fid[t * (k + 1) + s] != E - 3);
        continue;  // with NaN logits the unfused warp routine (a) is the reference
      }
      // (b) the CPU reference on CPU logits.
      const std::vector<float> cl = cpu_router_logits(w, x.data() + size_t(t) * hidden);
      std::vector<int> cid(k);
      std::vector<float> cw(k);
      cpu::route_top_k(cl.data(), E, k, true, cid.data(), cw.data());
      for (int s = 0; s < k; ++s) {
        EXPECT_EQ(fid[t * (k + 1) + s], cid[s]) << "slot " << s;
        EXPECT_NEAR(fw[t * (k + 1) + s], cw[s], 1e-5) << "slot " << s;
      }
      EXPECT_EQ(fid[t * (k + 1) + k], E);
      EXPECT_NEAR(fw[t * (k + 1) + k], 1.0 / (1.0 + std::exp(-double(cl[E]))), 1e-5);
      if (t == 0 && ties == RouterTies::kThreeWayTop) {
        std::vector<int> want = tied;
        std::sort(want.begin(), want.end());
        for (int s = 0; s < std::min<int>(k, 3); ++s) EXPECT_EQ(fid[s], want[s]) << "tie order, slot " << s;
      }
      if (t == 0 && ties == RouterTies::kAtTheCut) {
        const int lo = std::min(tied[0], tied[1]), hi = std::max(tied[0], tied[1]);
        const int32_t* sel = fid.data();
        EXPECT_NE(std::find(sel, sel + k, lo), sel + k) << "the lower id of a tie at the cut is selected";
        EXPECT_EQ(std::find(sel, sel + k, hi), sel + k) << "the higher id of a tie at the cut is dropped";
      }
    }
  }
}

/// The fused-router cases: the real shape, ties, NaN logits, all-zero logits, many experts and
/// the demo model's shapes.
const std::vector<RouterFusedCase> kRouterFusedCases = {
    // The real shape: 256 experts, top 8, hidden 2048, an 8-bit router; one and several tokens.
    {kExperts, kTopK, kHidden, 8, 1, 31, RouterTies::kNone},
    {kExperts, kTopK, kHidden, 8, 3, 32, RouterTies::kNone},
    {kExperts, kTopK, kHidden, 8, 1, 33, RouterTies::kThreeWayTop},
    {kExperts, kTopK, kHidden, 8, 2, 34, RouterTies::kAtTheCut},
    // NaN logits never win (the key routine vs the stand-alone warp routine).
    {kExperts, kTopK, kHidden, 8, 1, 43, RouterTies::kNanLogits},
    {16, 4, 256, 8, 2, 44, RouterTies::kNanLogits},
    // All logits tie at zero: the lowest ids, in order, weights 1/k.
    {kExperts, kTopK, kHidden, 8, 1, 48, RouterTies::kAllZero},
    {16, 4, 256, 8, 1, 49, RouterTies::kAllZero},
    // Many experts (E > 256: 32 keys per lane).
    {512, 8, 256, 8, 1, 45, RouterTies::kNone},
    {1000, 32, 128, 8, 1, 46, RouterTies::kAtTheCut},
    {600, 8, 256, 8, 2, 47, RouterTies::kNanLogits},
    // The demo model's shapes (hidden 256, 16 experts, top 4), a 4-bit router, hidden 128.
    {16, 4, 256, 8, 1, 35, RouterTies::kNone},
    {16, 4, 256, 8, 2, 36, RouterTies::kThreeWayTop},
    {16, 4, 256, 8, 1, 37, RouterTies::kAtTheCut},
    {16, 4, 256, 4, 1, 38, RouterTies::kNone},
    {8, 2, 128, 8, 1, 39, RouterTies::kThreeWayTop},
};

/// The fused-router case table (kRouterFusedCases). The unfused GEMV of (a) runs with token-row
/// tiles off (the per-row kernel for m > 1), the setting these cases have always been checked with.
class CudaRouterFused : public testing::TestWithParam<RouterFusedCase> {};

TEST_P(CudaRouterFused, MatchesTheUnfusedPairAndTheCpu) {
  ScopedGemvPath path(GemvPath::kPerRow);
  check_router_fused(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaRouterFused, testing::ValuesIn(kRouterFusedCases), CaseName());

TEST(CudaRouterFused, RejectsBadShapes) {
  std::mt19937_64 rng(40);
  RandomQuant w(17, 256, 8, rng);
  EXPECT_THROW(cuda::launch_router_fused(w.view(), nullptr, 1, 15, 4, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::launch_router_fused(w.view(), nullptr, 1, 16, 33, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
}

// ---- add + RMSNorm folded into the next GEMV (FusedNorm) ----------------------------------------

/// Inputs of a FusedNorm test: residual x, branch, gain (host and device) and output buffers.
struct NormInputs {
  std::vector<float> x, branch, gain;
  DeviceBuffer dx, dbranch, dgain, x_out, normed;
  NormInputs(int cols, std::mt19937_64& rng) {
    x = normal_bf16(cols, rng, 2.0f);
    branch = normal_bf16(cols, rng, 0.5f);
    gain = normal_bf16(cols, rng, 0.3f);
    for (auto& g : gain) g += 1.0f;
    dx = upload_bf16(x);
    dbranch = upload_bf16(branch);
    dgain = upload_f32(gain);
    x_out = poisoned(size_t(cols) * 2);
    normed = poisoned(size_t(cols) * 2);
  }
  cuda::FusedNorm norm(bool with_branch) const {
    cuda::FusedNorm n;
    n.branch = with_branch ? dbranch.as<__nv_bfloat16>() : nullptr;
    n.gain = dgain.as<float>();
    n.eps = 1e-6f;
    n.x_out = x_out.as<__nv_bfloat16>();
    n.normed_out = normed.as<__nv_bfloat16>();
    return n;
  }
  /// Checks x_out (exactly h = bf16(x + branch)) and normed (vs launch_add_rmsnorm within one
  /// bf16 rounding, and vs cpu::rms_norm) after a fused launch.
  void check_norm_outputs(bool with_branch) const {
    const int n = int(x.size());
    std::vector<float> h(n), y(n);
    for (int i = 0; i < n; ++i) h[i] = with_branch ? round_bf16(x[i] + branch[i]) : x[i];
    EXPECT_EQ(download_bf16(x_out, n), h) << "x_out must be bf16(x + branch)";
    DeviceBuffer ux = upload_bf16(x), uy = poisoned(size_t(n) * 2);
    cuda::launch_add_rmsnorm(ux.as<__nv_bfloat16>(), with_branch ? dbranch.as<__nv_bfloat16>() : nullptr,
                             dgain.as<float>(), uy.as<__nv_bfloat16>(), 1, n, 1e-6f, nullptr);
    const std::vector<float> got = download_bf16(normed, n), unfused = download_bf16(uy, n);
    EXPECT_LT(worst_rel(got, std::vector<double>(unfused.begin(), unfused.end()), 1e-3), 8e-3) << "vs launch_add_rmsnorm";
    cpu::rms_norm(h.data(), gain.data(), n, 1e-6f, y.data());
    EXPECT_LT(worst_rel(got, std::vector<double>(y.begin(), y.end()), 1e-3), 8e-3) << "vs cpu::rms_norm";
  }
};

/// A FusedNorm GEMV case: a random matrix W [rows, cols] of `bits`, then NormInputs(cols) (one
/// token: residual, branch, gain) drawn from `seed`; Y [rows] in bf16 or (f32_out) fp32; the
/// branch added first or not (with_branch). `label` says what the shape stands for.
struct NormGemvCase {
  const char* label;
  int64_t rows;
  int cols, bits;
  bool f32_out, with_branch;
  uint64_t seed;

  std::string name() const {
    return std::string(label) + "_" + quant_shape(rows, cols, bits) + (f32_out ? "_f32" : "_bf16") +
           (with_branch ? "_branch" : "_nobranch") + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const NormGemvCase& c, std::ostream* os) { *os << c.name(); }
};

/// launch_add_rmsnorm_gemv: norm outputs as above; the GEMV output is bit-identical to
/// launch_quant_gemv of the stored normed row (the kernel multiplies exactly what it stores).
void check_norm_gemv(const NormGemvCase& c) {
  const int64_t rows = c.rows;
  const int cols = c.cols, bits = c.bits;
  const bool f32_out = c.f32_out, with_branch = c.with_branch;
  std::mt19937_64 rng(c.seed);
  RandomQuant w(rows, cols, bits, rng);
  NormInputs in(cols, rng);
  DeviceBuffer y = poisoned(size_t(rows) * 4), ref = poisoned(size_t(rows) * 4);
  cuda::launch_add_rmsnorm_gemv(in.norm(with_branch), in.dx.as<__nv_bfloat16>(), w.view(),
                                f32_out ? nullptr : y.as<__nv_bfloat16>(), f32_out ? y.as<float>() : nullptr, nullptr);
  cuda::launch_quant_gemv(w.view(), in.normed.as<__nv_bfloat16>(), f32_out ? nullptr : ref.as<__nv_bfloat16>(),
                          f32_out ? ref.as<float>() : nullptr, nullptr);
  in.check_norm_outputs(with_branch);
  if (f32_out) EXPECT_EQ(download_f32(y, rows), download_f32(ref, rows));
  else EXPECT_EQ(download_bf16(y, rows), download_bf16(ref, rows));
  const std::vector<float> x_in = download_bf16(in.dx, cols);
  EXPECT_EQ(x_in, in.x) << "the input residual must not be modified";
}

/// The real shapes (GDN in-projection; attention q|k|v of layer 0, which has no branch; an
/// lm_head-like fp32 output) and the demo model's widths.
const std::vector<NormGemvCase> kNormGemvCases = {
    {"gdn_in_proj", kGdnInRows, kHidden, 4, false, true, 51},
    {"attn_qkv_layer0", 9216, kHidden, 4, false, false, 52},
    {"lm_head_like", 20000, kHidden, 4, true, true, 53},
    {"demo", 1000, 256, 4, false, true, 54},
    {"demo", 8192, 256, 4, true, true, 55},
    {"demo", 300, 128, 4, false, false, 56},
};

/// The FusedNorm GEMV case table (kNormGemvCases), on the default GEMV path.
class CudaFusedNormGemv : public testing::TestWithParam<NormGemvCase> {};

TEST_P(CudaFusedNormGemv, MatchesTheUnfusedLaunches) {
  ScopedGemvPath path(GemvPath::kDefault);
  check_norm_gemv(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaFusedNormGemv, testing::ValuesIn(kNormGemvCases), CaseName());

/// A FusedNorm router case: a random 8-bit router matrix W [E + 1, hidden], then
/// NormInputs(hidden) (one token, with a branch) drawn from `seed`; top k of E.
struct NormRouterCase {
  int E, k, hidden;
  uint64_t seed;

  std::string name() const {
    return "E" + std::to_string(E) + "_top" + std::to_string(k) + "_h" + std::to_string(hidden) + "_q8_s" +
           std::to_string(seed);
  }
  friend void PrintTo(const NormRouterCase& c, std::ostream* os) { *os << c.name(); }
};

/// launch_add_rmsnorm_router_fused vs launch_router_fused on the stored normed row: identical
/// logits (fp32 [E + 1]), ids (int32 [k + 1]) and weights (fp32 [k + 1]).
void check_norm_router(const NormRouterCase& c) {
  const int E = c.E, k = c.k, hidden = c.hidden;
  std::mt19937_64 rng(c.seed);
  RandomQuant w(E + 1, hidden, 8, rng);
  NormInputs in(hidden, rng);
  DeviceBuffer fl = poisoned(size_t(E + 1) * 4), fid = poisoned(size_t(k + 1) * 4), fw = poisoned(size_t(k + 1) * 4);
  DeviceBuffer ul = poisoned(size_t(E + 1) * 4), uid = poisoned(size_t(k + 1) * 4), uw = poisoned(size_t(k + 1) * 4);
  DeviceBuffer done(4);
  done.fill_bytes(0);
  cuda::launch_add_rmsnorm_router_fused(in.norm(true), in.dx.as<__nv_bfloat16>(), w.view(), E, k, fl.as<float>(),
                                        fid.as<int32_t>(), fw.as<float>(), done.as<uint32_t>(), nullptr);
  cuda::launch_router_fused(w.view(), in.normed.as<__nv_bfloat16>(), 1, E, k, ul.as<float>(), uid.as<int32_t>(),
                            uw.as<float>(), done.as<uint32_t>(), nullptr);
  in.check_norm_outputs(true);
  EXPECT_EQ(download_f32(fl, E + 1), download_f32(ul, E + 1));
  EXPECT_EQ(download_f32(fw, k + 1), download_f32(uw, k + 1));
  std::vector<int32_t> a(k + 1), b(k + 1);
  CUDA_CHECK(cudaDeviceSynchronize());
  cuda::download(a.data(), fid.as<int32_t>(), a.size());
  cuda::download(b.data(), uid.as<int32_t>(), b.size());
  EXPECT_EQ(a, b);
}

/// The real router shape and the demo model's.
const std::vector<NormRouterCase> kNormRouterCases = {
    {kExperts, kTopK, kHidden, 57},
    {16, 4, 256, 58},
};

/// The FusedNorm router case table (kNormRouterCases).
class CudaFusedNormRouter : public testing::TestWithParam<NormRouterCase> {};

TEST_P(CudaFusedNormRouter, MatchesTheUnfusedRouter) { check_norm_router(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaFusedNormRouter, testing::ValuesIn(kNormRouterCases), CaseName());

/// A FusedConv case: a GDN layer of n_key_heads key heads and n_value_heads value heads of
/// head_dim (gdn_dims; C = conv_channels() conv channels) whose 4-bit in-projection W
/// [C + value_dim + 2·n_value_heads, hidden] and conv taps fp32 [C, 4], window bf16 [3, C] and
/// three tokens' NormInputs(hidden) are drawn from `seed`.
struct NormConvCase {
  const char* label;
  int n_key_heads, n_value_heads, head_dim, hidden;
  uint64_t seed;

  std::string name() const {
    const cuda::GdnDims dims = gdn_dims(n_key_heads, n_value_heads, head_dim);
    const int64_t rows = int64_t(dims.conv_channels()) + dims.value_dim() + 2 * n_value_heads;
    return std::string(label) + "_Hk" + std::to_string(n_key_heads) + "_Hv" + std::to_string(n_value_heads) + "_D" +
           std::to_string(head_dim) + "_C" + std::to_string(dims.conv_channels()) + "_" + quant_shape(rows, hidden, 4) +
           "_s" + std::to_string(seed);
  }
  friend void PrintTo(const NormConvCase& c, std::ostream* os) { *os << c.name(); }
};

/// The GDN in-projection with the conv step in its epilogue (FusedConv) against the in-projection
/// alone followed by gdn_conv_decode: projection, conv output and shifted window bit-identical,
/// over three consecutive tokens (the window carries state).
void check_norm_gemv_conv(const NormConvCase& c) {
  const int hidden = c.hidden, n_value_heads = c.n_value_heads;
  const cuda::GdnDims dims = gdn_dims(c.n_key_heads, n_value_heads, c.head_dim);
  const int C = dims.conv_channels();
  const int64_t rows = int64_t(C) + dims.value_dim() + 2 * n_value_heads;
  std::mt19937_64 rng(c.seed);
  RandomQuant w(rows, hidden, 4, rng);
  const std::vector<float> taps = normal_bf16(int64_t(C) * 4, rng, 0.5f);
  const std::vector<float> window0 = normal_bf16(int64_t(C) * 3, rng, 1.0f);
  DeviceBuffer dtaps = upload_f32(taps);
  DeviceBuffer win_a = upload_bf16(window0), win_b = upload_bf16(window0);
  DeviceBuffer proj_a = poisoned(size_t(rows) * 2), proj_b = poisoned(size_t(rows) * 2);
  DeviceBuffer out_a = poisoned(size_t(C) * 2), out_b = poisoned(size_t(C) * 2);
  cuda::GdnParams params;
  params.conv_w = params.A_log = params.dt_bias = params.norm_w = dtaps.as<float>();  // only conv_w is read
  for (int step = 0; step < 3; ++step) {
    NormInputs in(hidden, rng);
    cuda::FusedConv conv;
    conv.channels = C;
    conv.taps = dtaps.as<float>();
    conv.window = win_a.as<__nv_bfloat16>();
    conv.out = out_a.as<__nv_bfloat16>();
    cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), w.view(), proj_a.as<__nv_bfloat16>(), nullptr,
                                  nullptr, conv);
    cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), w.view(), proj_b.as<__nv_bfloat16>(), nullptr,
                                  nullptr);
    cuda::gdn_conv_decode(dims, params, proj_b.as<__nv_bfloat16>(), win_b.as<__nv_bfloat16>(), out_b.as<__nv_bfloat16>(),
                          nullptr);
    EXPECT_EQ(download_bf16(proj_a, rows), download_bf16(proj_b, rows)) << "step " << step;
    EXPECT_EQ(download_bf16(out_a, C), download_bf16(out_b, C)) << "step " << step;
    EXPECT_EQ(download_bf16(win_a, int64_t(C) * 3), download_bf16(win_b, int64_t(C) * 3)) << "step " << step;
  }
}

/// The Qwen3.6 GDN shape and the demo model's.
const std::vector<NormConvCase> kNormConvCases = {
    {"qwen36", 16, 32, 128, kHidden, 60},  // C 8192, rows 12352
    {"demo", 2, 4, 64, 256, 61},           // C 512, rows 776
};

/// The FusedConv case table (kNormConvCases), on the default GEMV path.
class CudaFusedConv : public testing::TestWithParam<NormConvCase> {};

TEST_P(CudaFusedConv, GdnInProjectionWithConvMatchesConvDecode) {
  ScopedGemvPath path(GemvPath::kDefault);
  check_norm_gemv_conv(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaFusedConv, testing::ValuesIn(kNormConvCases), CaseName());

TEST(CudaFusedNorm, RejectsAliasedResidual) {
  std::mt19937_64 rng(59);
  RandomQuant w(64, 256, 4, rng);
  NormInputs in(256, rng);
  cuda::FusedNorm n = in.norm(true);
  n.x_out = const_cast<__nv_bfloat16*>(in.dx.as<__nv_bfloat16>());
  DeviceBuffer y(64 * 2);
  EXPECT_THROW(cuda::launch_add_rmsnorm_gemv(n, in.dx.as<__nv_bfloat16>(), w.view(), y.as<__nv_bfloat16>(), nullptr, nullptr),
               InternalError);
}

// ---- programmatic dependent launch ---------------------------------------------------------------

/// A stack of MoE decode blocks (add + RMSNorm → fused router → gate/up + SwiGLU → down +
/// combine, the decode step's MoE half) that reuse one set of random weights; every block reads
/// the previous block's output, so a missing dependency changes the result.
struct MoeChain {
  int E, k, hidden, ffn;
  RandomQuant router, gate, up, down;
  DeviceBuffer x, moe, normed, gain, logits, ids, weights, act, done;
  std::vector<float> x0;

  MoeChain(int E_, int k_, int hidden_, int ffn_, std::mt19937_64& rng)
      : E(E_), k(k_), hidden(hidden_), ffn(ffn_), router(E_ + 1, hidden_, 8, rng),
        gate((E_ + 1) * int64_t(ffn_), hidden_, 4, rng), up((E_ + 1) * int64_t(ffn_), hidden_, 4, rng),
        down((E_ + 1) * int64_t(hidden_), ffn_, 4, rng) {
    x0 = normal_bf16(hidden, rng, 2.0f);
    std::vector<float> g = normal_bf16(hidden, rng, 0.3f);
    for (auto& v : g) v += 1.0f;
    gain = upload_f32(g);
    moe = DeviceBuffer(size_t(hidden) * 2);
    normed = DeviceBuffer(size_t(hidden) * 2);
    logits = DeviceBuffer(size_t(E + 1) * 4);
    ids = DeviceBuffer(size_t(k + 1) * 4);
    weights = DeviceBuffer(size_t(k + 1) * 4);
    act = DeviceBuffer(size_t(k + 1) * ffn * 2);
    done = DeviceBuffer(4);
    done.fill_bytes(0);
    x = DeviceBuffer(size_t(hidden) * 2);
    reset();
  }
  /// Restores the initial residual stream (x = x0, no pending branch) in place (a captured graph
  /// keeps the buffer addresses) and waits for the device.
  void reset() {
    std::vector<uint16_t> bits(x0.size());
    for (size_t i = 0; i < x0.size(); ++i) bits[i] = float_to_bf16(x0[i]);
    cuda::upload(x.as<uint16_t>(), bits.data(), bits.size());
    moe.fill_bytes(0);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  void enqueue(int blocks, cudaStream_t stream) {
    for (int b = 0; b < blocks; ++b) {
      cuda::launch_add_rmsnorm(x.as<__nv_bfloat16>(), b == 0 ? nullptr : moe.as<__nv_bfloat16>(), gain.as<float>(),
                               normed.as<__nv_bfloat16>(), 1, hidden, 1e-6f, stream);
      cuda::launch_router_fused(router.view(), normed.as<__nv_bfloat16>(), 1, E, k, logits.as<float>(), ids.as<int32_t>(),
                                weights.as<float>(), done.as<uint32_t>(), stream);
      cuda::launch_expert_gate_up(gate.view(), up.view(), ffn, ids.as<int32_t>(), k + 1, normed.as<__nv_bfloat16>(), 1,
                                  act.as<__nv_bfloat16>(), stream);
      cuda::launch_expert_down_combine(down.view(), hidden, ids.as<int32_t>(), weights.as<float>(), k + 1,
                                       act.as<__nv_bfloat16>(), 1, moe.as<__nv_bfloat16>(), stream);
    }
  }
  /// The residual stream and the last block's output, as raw bf16 bits.
  std::vector<uint16_t> result() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> r(size_t(2) * hidden);
    cuda::download(r.data(), x.as<uint16_t>(), hidden);
    cuda::download(r.data() + hidden, moe.as<uint16_t>(), hidden);
    return r;
  }
};

/// Captures `chain.enqueue(blocks)` into a graph on `stream` (current PDL setting).
cudaGraphExec_t capture_chain(MoeChain& chain, int blocks, cudaStream_t stream) {
  return capture_graph(stream, [&](cudaStream_t st) { chain.enqueue(blocks, st); });
}

// PDL on (eager and under a CUDA graph, replayed) must give bit-identical results to plain
// launches: the kernels are deterministic, so any difference is a broken dependency.
void check_pdl_chain(int E, int k, int hidden, int ffn, uint64_t seed) {
  const PdlSetting keep;
  std::mt19937_64 rng(seed);
  MoeChain chain(E, k, hidden, ffn, rng);
  constexpr int kBlocks = 12;
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  keep.set(false);
  chain.enqueue(kBlocks, stream);
  const std::vector<uint16_t> want = chain.result();
  for (uint16_t b : want) ASSERT_FALSE((b & 0x7F80) == 0x7F80 && (b & 0x7F)) << "NaN in the reference chain";

  keep.set(true);
  chain.reset();
  chain.enqueue(kBlocks, stream);
  EXPECT_EQ(chain.result(), want) << "eager PDL launches differ from plain launches";
  cudaGraphExec_t exec = capture_chain(chain, kBlocks, stream);
  for (int replay = 0; replay < 3; ++replay) {
    chain.reset();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(chain.result(), want) << "graph replay " << replay << " with PDL differs from plain launches";
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaPdl, MoeChainMatchesPlainLaunchesRealShape) { check_pdl_chain(kExperts, kTopK, kHidden, kFfn, 41); }
TEST(CudaPdl, MoeChainMatchesPlainLaunchesDemoShape) { check_pdl_chain(16, 4, 256, 128, 42); }

/// An MoE expert case: E routed experts plus the shared one (expert E), each a gate and an up
/// matrix [ffn, hidden] and a down matrix [hidden, ffn] of `bits` (stacked: gate/up
/// [(E + 1)·ffn, hidden], down [(E + 1)·hidden, ffn]); k routed experts chosen at random, one
/// token's bf16 activations [hidden] and fp32 slot weights [k + 1], all drawn from `seed`.
struct ExpertCase {
  int E, k, hidden, ffn;
  uint64_t seed;
  int bits = 4;

  std::string name() const {
    return "E" + std::to_string(E) + "_top" + std::to_string(k) + "_h" + std::to_string(hidden) + "_ffn" +
           std::to_string(ffn) + "_q" + std::to_string(bits) + "_s" + std::to_string(seed);
  }
  friend void PrintTo(const ExpertCase& c, std::ostream* os) { *os << c.name(); }
};

/// The MoE expert path: gate/up + SwiGLU over the k routed experts + the shared one (bf16
/// activations [k + 1, ffn]), then the down projection with the weighted combine (bf16
/// [hidden]), against docs/model.md §4.3's rounding sequence.
void check_experts(const ExpertCase& c) {
  const int E = c.E, k = c.k, hidden = c.hidden, ffn = c.ffn, bits = c.bits;
  std::mt19937_64 rng(c.seed);
  RandomQuant gate((E + 1) * int64_t(ffn), hidden, bits, rng), up((E + 1) * int64_t(ffn), hidden, bits, rng);
  RandomQuant down((E + 1) * int64_t(hidden), ffn, bits, rng);
  const int n_sel = k + 1;
  std::vector<int32_t> ids(n_sel);
  std::vector<float> w(n_sel);
  std::vector<int> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int s = 0; s < k; ++s) ids[s] = perm[s];
  ids[k] = E;
  std::uniform_real_distribution<float> u01(0.01f, 1.0f);
  for (auto& v : w) v = u01(rng);
  const std::vector<float> x = normal_bf16(hidden, rng, 1.0f);

  DeviceBuffer dx = upload_bf16(x), did(n_sel * 4), dw = upload_f32(w);
  cuda::upload(did.as<int32_t>(), ids.data(), ids.size());
  DeviceBuffer act = poisoned(size_t(n_sel) * ffn * 2), out = poisoned(size_t(hidden) * 2);
  cuda::launch_expert_gate_up(gate.view(), up.view(), ffn, did.as<int32_t>(), n_sel, dx.as<__nv_bfloat16>(), 1,
                              act.as<__nv_bfloat16>(), nullptr);
  const std::vector<float> gact = download_bf16(act, int64_t(n_sel) * ffn);
  std::vector<double> ract(size_t(n_sel) * ffn);
  for (int s = 0; s < n_sel; ++s)
    for (int i = 0; i < ffn; ++i) {
      const int64_t r = int64_t(ids[s]) * ffn + i;
      const float g = round_bf16(float(gate.dot(r, x.data()))), uu = round_bf16(float(up.dot(r, x.data())));
      ract[size_t(s) * ffn + i] = round_bf16(cpu::silu(g) * uu);
    }
  EXPECT_LT(worst_rel(gact, ract, 0.01 * rms(ract)), 2e-2) << "gate/up + SwiGLU";

  // Down + combine from the GPU's own activations (isolates this kernel's error).
  cuda::launch_expert_down_combine(down.view(), hidden, did.as<int32_t>(), dw.as<float>(), n_sel,
                                   act.as<__nv_bfloat16>(), 1, out.as<__nv_bfloat16>(), nullptr);
  const std::vector<float> gout = download_bf16(out, hidden);
  std::vector<double> rout(hidden, 0.0);
  for (int r = 0; r < hidden; ++r) {
    float acc = 0.0f;
    for (int s = 0; s < n_sel; ++s) {
      const float d = round_bf16(float(down.dot(int64_t(ids[s]) * hidden + r, gact.data() + size_t(s) * ffn)));
      acc += w[s] * d;
    }
    rout[r] = acc;
  }
  EXPECT_LT(worst_rel(gout, rout, 0.01 * rms(rout)), 2e-2) << "down + combine";
}

/// The real shape (256 experts, top 8, hidden 2048, ffn 512) and small ones.
const std::vector<ExpertCase> kExpertCases = {
    {kExperts, kTopK, kHidden, kFfn, 19},
    {16, 4, 256, 128, 20},
    {32, 8, 512, 128, 21},
    {16, 4, 256, 128, 22, 8},  // 8-bit experts: the down kernel's 4-slot chunks (5 slots)
    {64, 12, 256, 192, 23},    // 13 slots: chunks of 9 + 4 at 4-bit; 3 groups per row
};

/// The MoE expert case table (kExpertCases).
class CudaMoeExperts : public testing::TestWithParam<ExpertCase> {};

TEST_P(CudaMoeExperts, MatchTheReference) { check_experts(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CudaMoeExperts, testing::ValuesIn(kExpertCases), CaseName());


// Per-kernel decode times at the 35B-A3B shapes, printed for docs/performance (never asserted).
// Weights larger than L2 (50 MB) stream from HBM; smaller ones (router) may stay in L2.
TEST(CudaTiming, PrintsKernelTimes) {
  std::mt19937_64 rng(99);
  const std::vector<float> x = normal_bf16(4096, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x), y(size_t(kVocab) * 4);
  auto gemv = [&](const char* name, int64_t rows, int cols, int bits, bool f32) {
    RandomQuant w(rows, cols, bits, rng);
    const cuda::DeviceQuant v = w.view();
    const double us = time_us([&] {
      cuda::launch_quant_gemv(v, dx.as<__nv_bfloat16>(), f32 ? nullptr : y.as<__nv_bfloat16>(), f32 ? y.as<float>() : nullptr,
                              nullptr);
    });
    const double bytes = quant_bytes(w.rows, w.cols, w.bits);
    std::printf("[timing] %-28s %8.2f us  %7.2f MB  %7.1f GB/s\n", name, us, bytes / 1e6, bytes / us / 1e3);
  };
  gemv("gemv gdn qkv|z|a|b 12352x2048", 12352, kHidden, 4, false);
  gemv("gemv gdn out_proj 2048x4096", kHidden, 4096, 4, false);
  gemv("gemv attn q|k|v 9216x2048", 9216, kHidden, 4, false);
  gemv("gemv router+gate 257x2048 q8", kExperts + 1, kHidden, 8, true);
  gemv("gemv lm_head 248320x2048 f32", kVocab, kHidden, 4, true);

  // The prefill router: 257x2048 q8 over a 2,048-token chunk, per-row and token-tiled.
  {
    ScopedGemvPath keep(GemvPath::kDefault);  // the switches as found, after the block
    RandomQuant router(kExperts + 1, kHidden, 8, rng);
    constexpr int kChunk = 2048;
    DeviceBuffer xc = upload_bf16(normal_bf16(int64_t(kChunk) * kHidden, rng, 1.0f)), yc(size_t(kChunk) * (kExperts + 1) * 4);
    for (bool tiled : {false, true}) {
      keep.set_row_tiles(tiled);
      const double us = time_us([&] {
        cuda::launch_quant_gemv_batched(router.view(), xc.as<__nv_bfloat16>(), kChunk, nullptr, yc.as<float>(), nullptr);
      });
      std::printf("[timing] prefill router 2048 rows, %-9s %8.2f us\n", tiled ? "tiled" : "per-row", us);
    }
    keep.set_row_tiles(false);
    const double us = time_us([&] {
      cuda::launch_router_gemm(router.view(), xc.as<__nv_bfloat16>(), kChunk, yc.as<float>(), nullptr);
    });
    std::printf("[timing] prefill router 2048 rows, %-9s %8.2f us\n", "GEMM", us);
  }

  // MoE experts (8 routed + shared) at the real shape.
  RandomQuant gate((kExperts + 1) * int64_t(kFfn), kHidden, 4, rng), up((kExperts + 1) * int64_t(kFfn), kHidden, 4, rng);
  RandomQuant down((kExperts + 1) * int64_t(kHidden), kFfn, 4, rng);
  std::vector<int32_t> ids = {3, 77, 140, 9, 201, 255, 18, 100, kExperts};
  std::vector<float> w(9, 0.1f);
  DeviceBuffer did(9 * 4), dw = upload_f32(w), act(9 * kFfn * 2), out(kHidden * 2);
  cuda::upload(did.as<int32_t>(), ids.data(), ids.size());
  const double gu = time_us([&] {
    cuda::launch_expert_gate_up(gate.view(), up.view(), kFfn, did.as<int32_t>(), 9, dx.as<__nv_bfloat16>(), 1,
                                act.as<__nv_bfloat16>(), nullptr);
  });
  const double gu_mb = 2.0 * 9 * kFfn * (kHidden / 2 + kHidden / 64 * 4) / 1e6;
  std::printf("[timing] %-28s %8.2f us  %7.2f MB  %7.1f GB/s\n", "experts gate/up+SwiGLU x9", gu, gu_mb, gu_mb / gu * 1e3);
  const double dn = time_us([&] {
    cuda::launch_expert_down_combine(down.view(), kHidden, did.as<int32_t>(), dw.as<float>(), 9, act.as<__nv_bfloat16>(),
                                     1, out.as<__nv_bfloat16>(), nullptr);
  });
  const double dn_mb = 9.0 * kHidden * (kFfn / 2 + kFfn / 64 * 4) / 1e6;
  std::printf("[timing] %-28s %8.2f us  %7.2f MB  %7.1f GB/s\n", "experts down+combine x9", dn, dn_mb, dn_mb / dn * 1e3);

  std::vector<float> logits = normal_bf16(kExperts + 1, rng, 1.0f);
  DeviceBuffer dl = upload_f32(logits), tid(9 * 4), tw(9 * 4);
  std::printf("[timing] %-28s %8.2f us\n", "router top-k",
              time_us([&] { cuda::launch_router_topk(dl.as<float>(), 1, kExperts, kTopK, tid.as<int32_t>(), tw.as<float>(), nullptr); }));
  {
    RandomQuant rw(kExperts + 1, kHidden, 8, rng);
    DeviceBuffer fl(size_t(kExperts + 1) * 4), done(4);
    done.fill_bytes(0);
    std::printf("[timing] %-28s %8.2f us\n", "router gemv+top-k fused q8",
                time_us([&] { cuda::launch_router_fused(rw.view(), dx.as<__nv_bfloat16>(), 1, kExperts, kTopK, fl.as<float>(),
                                                        tid.as<int32_t>(), tw.as<float>(), done.as<uint32_t>(), nullptr); }));
    NormInputs in(kHidden, rng);
    std::printf("[timing] %-28s %8.2f us\n", "add+norm+router+top-k fused",
                time_us([&] { cuda::launch_add_rmsnorm_router_fused(in.norm(true), in.dx.as<__nv_bfloat16>(), rw.view(), kExperts,
                                                                    kTopK, fl.as<float>(), tid.as<int32_t>(), tw.as<float>(),
                                                                    done.as<uint32_t>(), nullptr); }));
    RandomQuant gw(12352, kHidden, 4, rng);
    std::printf("[timing] %-28s %8.2f us\n", "add+norm+gemv gdn in fused",
                time_us([&] { cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), gw.view(),
                                                            y.as<__nv_bfloat16>(), nullptr, nullptr); }));
  }
  std::vector<float> g(kHidden, 1.0f);
  DeviceBuffer res = upload_bf16(x), dg = upload_f32(g), nrm(kHidden * 2);
  std::printf("[timing] %-28s %8.2f us\n", "add+rmsnorm 2048",
              time_us([&] { cuda::launch_add_rmsnorm(res.as<__nv_bfloat16>(), dx.as<__nv_bfloat16>(), dg.as<float>(),
                                                     nrm.as<__nv_bfloat16>(), 1, kHidden, 1e-6f, nullptr); }));
  const int slots = cuda::argmax_scratch_slots(kVocab);
  DeviceBuffer sv(slots * 4), si(slots * 4), id(4);
  std::printf("[timing] %-28s %8.2f us\n", "argmax 248320",
              time_us([&] { cuda::launch_argmax(y.as<float>(), kVocab, sv.as<float>(), si.as<int32_t>(), id.as<int32_t>(), nullptr); }));
}

// The MoE half of 40 decode layers (160 kernels) as one CUDA graph, PDL off vs on: the per-kernel
// figure is what one launch costs inside the decode graph (printed, never asserted).
/// A one-row GEMV of the decode step at its real shape, for the streaming GEMV's timings: the
/// name, the matrix, whether its output is fp32 (the LM head) and whether the add + RMSNorm is
/// fused in front (the staged mode; else the direct mode), and how many copies of the matrix a
/// timing rotates over so that its weights come from HBM (copies × bytes > L2's 50 MB).
struct DecodeGemvShape {
  const char* name;
  int64_t rows;
  int cols;
  bool f32_out, fused_norm;
  int copies;
};
constexpr DecodeGemvShape kDecodeLmHead{"lm_head", kVocab, 2048, true, true, 1};
constexpr DecodeGemvShape kDecodeGdnInProj{"gdn in_proj", 12352, 2048, false, true, 8};
constexpr DecodeGemvShape kDecodeAttnInProj{"attn q|k|v", 9216, 2048, false, true, 8};
constexpr DecodeGemvShape kDecodeOutProj{"out_proj", 2048, 4096, false, false, 24};

/// The copies of a DecodeGemvShape's random matrix, its inputs and its output buffer.
struct DecodeGemvCase {
  const DecodeGemvShape& s;
  std::vector<std::unique_ptr<RandomQuant>> w;
  NormInputs in;
  DeviceBuffer y;

  DecodeGemvCase(const DecodeGemvShape& shape, std::mt19937_64& rng) : s(shape), in(shape.cols, rng), y(size_t(shape.rows) * 4) {
    for (int c = 0; c < s.copies; ++c) w.push_back(std::make_unique<RandomQuant>(s.rows, s.cols, 4, rng));
  }
  /// One launch on copy c (launch_add_rmsnorm_gemv or launch_quant_gemv), on the default stream.
  void launch(int c) {
    __nv_bfloat16* yb = s.f32_out ? nullptr : y.as<__nv_bfloat16>();
    float* yf = s.f32_out ? y.as<float>() : nullptr;
    if (s.fused_norm) cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), w[c]->view(), yb, yf, nullptr);
    else cuda::launch_quant_gemv(w[c]->view(), in.dx.as<__nv_bfloat16>(), yb, yf, nullptr);
  }
  /// The last launch's output, once the device is idle.
  std::vector<float> output() {
    CUDA_CHECK(cudaDeviceSynchronize());
    return s.f32_out ? download_f32(y, s.rows) : download_bf16(y, s.rows);
  }
};

// The streaming GEMV's stage budget swept at the decode's one-row shapes: the final norm + LM
// head and the input norm + GDN in-projection (staged mode, the norm fused) and the
// out-projection (direct mode), for blocks per SM × shared memory per SM
// (cuda::set_stream_gemv_blocks_per_sm, cuda::set_stream_gemv_smem_per_sm). Asserts that every
// setting gives the default's bits (stages and grid size never change a row's arithmetic);
// prints µs and GB/s a launch, rotating over enough copies of a matrix that its weights come
// from HBM, not from L2.
TEST(CudaTiming, PrintsStreamGemvStageSweep) {
  const DecodeGemvShape shapes[] = {kDecodeLmHead, kDecodeGdnInProj, kDecodeOutProj};
  const ScopedSwitch<int64_t> smem(cuda::stream_gemv_smem_per_sm, cuda::set_stream_gemv_smem_per_sm);
  const ScopedSwitch<int> blocks(cuda::stream_gemv_blocks_per_sm, cuda::set_stream_gemv_blocks_per_sm);
  for (const DecodeGemvShape& s : shapes) {
    std::mt19937_64 rng(17);
    DecodeGemvCase gemv(s, rng);
    auto launch = [&](int c) { gemv.launch(c); };
    auto output = [&] {
      gemv.launch(0);
      return gemv.output();
    };
    blocks.set(cuda::kStreamBlocksPerSm);
    smem.set(cuda::kStreamSmemPerSm);
    const std::vector<float> reference = output();
    const double bytes = double(s.rows) * (s.cols / 2 + s.cols / 64 * 4);
    for (int b : {cuda::kStreamBlocksPerSm, 2}) {
      for (int64_t kib : {64, 112, 168, 224}) {
        blocks.set(b);
        smem.set(kib * 1024);
        EXPECT_EQ(bit_differences(output(), reference), 0) << s.name << ", " << b << " blocks per SM, " << kib << " KiB";
        int c = 0;
        const double us = time_us([&] {
          launch(c);
          c = (c + 1) % s.copies;
        }, 48);
        std::printf("[timing] stream gemv %-11s %6lldx%-5d %d blocks/SM, %3lld KiB/SM: %8.2f us (%5.0f GB/s)\n", s.name,
                    static_cast<long long>(s.rows), s.cols, b, static_cast<long long>(kib), us, bytes / us / 1e3);
      }
    }
  }
}

// Where one launch of the streaming GEMV spends its time, at the decode's one-row shapes (as in
// the stage sweep): %globaltimer stamps of every block (cuda::set_stream_gemv_trace), printed as
// µs after the first block's entry for the first, median and last block of each phase end. The
// traced launch reads a copy of the matrix that the launches before it evicted from L2. Asserts
// only that tracing leaves the output's bits alone.
TEST(CudaTiming, PrintsStreamGemvPhases) {
  const DecodeGemvShape shapes[] = {kDecodeLmHead, kDecodeGdnInProj, kDecodeAttnInProj, kDecodeOutProj};
  const char* phase[cuda::kStreamTracePoints] = {"entry",       "PDL wait",         "activations staged", "first tile on chip",
                                                 "first tile stored", "last tile on chip", "exit",
                                                 "row loads returned", "normed row staged"};
  constexpr int kMaxBlocks = 8192;
  DeviceBuffer trace(size_t(kMaxBlocks) * cuda::kStreamTracePoints * 8);
  for (const DecodeGemvShape& s : shapes) {
    std::mt19937_64 rng(23);
    DecodeGemvCase gemv(s, rng);
    auto launch = [&](int c) {
      gemv.launch(c);
      CUDA_CHECK(cudaGetLastError());
    };
    launch(0);
    const std::vector<float> reference = gemv.output();
    for (int r = 0; r < 2; ++r)
      for (int c = 1; c < s.copies; ++c) launch(c);  // copy 0 leaves L2 (one copy: it is larger than L2)
    trace.fill_bytes(0);
    cuda::set_stream_gemv_trace(trace.as<uint64_t>());
    launch(0);
    const std::vector<float> traced = gemv.output();
    cuda::set_stream_gemv_trace(nullptr);
    EXPECT_EQ(bit_differences(traced, reference), 0) << s.name;
    std::vector<uint64_t> t(size_t(kMaxBlocks) * cuda::kStreamTracePoints);
    CUDA_CHECK(cudaMemcpy(t.data(), trace.as<uint64_t>(), t.size() * 8, cudaMemcpyDeviceToHost));
    int blocks = 0;
    while (blocks < kMaxBlocks && t[size_t(blocks) * cuda::kStreamTracePoints] != 0) ++blocks;
    ASSERT_GT(blocks, 0) << s.name;
    uint64_t start = UINT64_MAX;
    for (int b = 0; b < blocks; ++b) start = std::min(start, t[size_t(b) * cuda::kStreamTracePoints]);
    std::printf("[timing] stream gemv phases %-11s %6lldx%-5d %d blocks (µs after the first entry: first / median / last block)\n",
                s.name, static_cast<long long>(s.rows), s.cols, blocks);
    for (int p = 0; p < cuda::kStreamTracePoints; ++p) {
      std::vector<double> us;
      for (int b = 0; b < blocks; ++b) {
        const uint64_t v = t[size_t(b) * cuda::kStreamTracePoints + p];
        if (v != 0) us.push_back((v - start) / 1e3);
      }
      if (us.empty()) continue;
      std::sort(us.begin(), us.end());
      std::printf("[timing]   %-20s %8.2f %8.2f %8.2f  (%zu blocks)\n", phase[p], us.front(), us[us.size() / 2], us.back(),
                  us.size());
    }
  }
}

/// Four one-row GEMVs enqueued back to back (under PDL each may start while its predecessor
/// runs): a 40,000-row matrix with the norm fused (the tile counter's launch, about five tiles a
/// block), the 12,352-row in-projection, a 2,048 × 4,096 out-projection (direct mode), then the
/// first again.
struct FourGemvChain {
  static constexpr int64_t kBig = 40000, kInRows = 12352;
  std::mt19937_64 rng{37};
  RandomQuant big{kBig, kHidden, 4, rng}, in_proj{kInRows, kHidden, 4, rng}, out_proj{kHidden, 4096, 4, rng};
  NormInputs in{kHidden, rng};
  DeviceBuffer dwide = upload_bf16(normal_bf16(4096, rng, 1.0f));
  DeviceBuffer y1 = poisoned(size_t(kBig) * 4), y2 = poisoned(size_t(kInRows) * 2), y3 = poisoned(size_t(kHidden) * 2),
               y4 = poisoned(size_t(kBig) * 4);

  void enqueue(cudaStream_t st) {
    cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), big.view(), nullptr, y1.as<float>(), st);
    cuda::launch_quant_gemv(in_proj.view(), in.dx.as<__nv_bfloat16>(), y2.as<__nv_bfloat16>(), nullptr, st);
    cuda::launch_quant_gemv(out_proj.view(), dwide.as<__nv_bfloat16>(), y3.as<__nv_bfloat16>(), nullptr, st);
    cuda::launch_add_rmsnorm_gemv(in.norm(true), in.dx.as<__nv_bfloat16>(), big.view(), nullptr, y4.as<float>(), st);
  }
  /// The chain enqueued once on a fresh stream (no graph), its outputs.
  std::vector<std::vector<float>> run() {
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    enqueue(stream);
    std::vector<std::vector<float>> got = outputs();
    CUDA_CHECK(cudaStreamDestroy(stream));
    return got;
  }
  std::vector<std::vector<float>> outputs() {
    CUDA_CHECK(cudaDeviceSynchronize());
    return {download_f32(y1, kBig), download_bf16(y2, kInRows), download_bf16(y3, kHidden), download_f32(y4, kBig)};
  }
  /// Captures the chain as a graph (with the switches as they are now) and replays it three
  /// times, every output poisoned before each replay; expects `reference`'s bits each time.
  void expect_graph_bits(const std::vector<std::vector<float>>& reference, const std::string& what) {
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) { enqueue(st); });
    for (int r = 0; r < 3; ++r) {
      for (DeviceBuffer* y : {&y1, &y2, &y3, &y4}) y->fill_bytes(0xff);  // NaN: an unwritten row differs
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      const std::vector<std::vector<float>> got = outputs();
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(bit_differences(got[i], reference[i]), 0) << what << ": GEMV " << i << ", replay " << r;
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaStreamDestroy(stream));
  }
};

// The streaming GEMV's tile counter (cuda::set_stream_gemv_tile_counter_enabled) against the
// fixed-stride deal, bit for bit: the decode's one-row shapes (the LM head with the norm fused
// takes the counter; the GDN in-projection and the out-projection, with under four tiles a block,
// keep the stride), three launches each (the counter must be back at zero after every launch);
// and FourGemvChain as a graph under PDL, replayed three times.
TEST(CudaGemv, TileCounterGivesTheFixedStrideBits) {
  const ScopedSwitch<bool> counter(cuda::stream_gemv_tile_counter_enabled, cuda::set_stream_gemv_tile_counter_enabled);
  const PdlSetting pdl;
  pdl.set(true);
  for (const DecodeGemvShape* shape : {&kDecodeLmHead, &kDecodeGdnInProj, &kDecodeOutProj}) {
    DecodeGemvShape one = *shape;
    one.copies = 1;
    std::mt19937_64 rng(31);
    DecodeGemvCase gemv(one, rng);
    counter.set(false);
    gemv.launch(0);
    const std::vector<float> reference = gemv.output();
    counter.set(true);
    for (int r = 0; r < 3; ++r) {
      gemv.launch(0);
      EXPECT_EQ(bit_differences(gemv.output(), reference), 0) << one.name << ", launch " << r;
    }
  }

  FourGemvChain chain;
  counter.set(false);
  const std::vector<std::vector<float>> reference = chain.run();
  EXPECT_EQ(bit_differences(reference[0], reference[3]), 0);
  counter.set(true);
  chain.expect_graph_bits(reference, "tile counter");
}

// Where the streaming GEMV requests its first weight stages (cuda::set_stream_gemv_late_requests:
// before the PDL wait, or after the activations are staged, for the staged launches or all)
// changes no bit: FourGemvChain as a graph under PDL with each setting, against the chain run
// with requests before the wait.
TEST(CudaGemv, LateRequestsGiveTheSameBits) {
  const ScopedSwitch<cuda::StreamLateRequests> late(cuda::stream_gemv_late_requests, cuda::set_stream_gemv_late_requests);
  const PdlSetting pdl;
  pdl.set(true);
  FourGemvChain chain;
  late.set(cuda::StreamLateRequests::none);
  const std::vector<std::vector<float>> reference = chain.run();
  for (auto [which, name] : {std::pair{cuda::StreamLateRequests::staged, "staged"}, std::pair{cuda::StreamLateRequests::all, "all"}}) {
    late.set(which);
    chain.expect_graph_bits(reference, std::string("late requests: ") + name);
  }
}

TEST(CudaTiming, PrintsGraphChainTimesWithAndWithoutPdl) {
  const PdlSetting keep;
  std::mt19937_64 rng(98);
  MoeChain chain(kExperts, kTopK, kHidden, kFfn, rng);
  constexpr int kBlocks = 40, kReps = 50;
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (bool pdl : {false, true}) {
    keep.set(pdl);
    cudaGraphExec_t exec = capture_chain(chain, kBlocks, stream);
    const double us = graph_replay_us(exec, stream, kReps);
    std::printf("[timing] moe chain x%d graph, PDL %-3s %8.2f us/graph  %6.2f us/kernel\n", kBlocks, pdl ? "on" : "off", us,
                us / (4 * kBlocks));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace lily::test
