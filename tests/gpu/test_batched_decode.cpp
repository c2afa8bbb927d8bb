// The batched decode's kernels (CudaOptions::batched_decode) against the one-sequence kernels,
// bit for bit: each row of a launch over `rows` sequences must equal the same row run alone
// through the one-sequence launcher (the GDN step, attention) or through the same launcher with
// one row (the GEMV), whatever the other rows hold. These isolate a kernel when the end-to-end
// batch-invariance tests (test_cuda_e2e, CudaE2e.BatchedDecode*) fail.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/mixer_kernels.h"
#include "gpu_test_util.h"

namespace lily::test {
namespace {

using cuda::DeviceBuffer;
using bf16 = __nv_bfloat16;

/// A device array holding `v` (pointers or PODs), for the batched launchers' per-row arrays.
template <class T>
DeviceBuffer upload_array(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  CUDA_CHECK(cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// ---- GEMV ------------------------------------------------------------------------------------

/// launch_quant_gemv_rows: token t of m rows equals token t alone (m = 1), for m = 1 … 33 and
/// some m up to kMaxDecodeRows (1 … 4 column blocks of eight in the streaming kernel, 32 rows a
/// launch past that; eight rows a launch in the register-load one); the first and the last token
/// also within the reference tolerance.
void check_gemv_rows(int64_t rows, int cols, int bits, bool f32_out, uint64_t seed) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " " + std::to_string(bits) + "-bit" +
               (f32_out ? " fp32" : " bf16"));
  std::mt19937_64 rng(seed);
  RandomQuant w(rows, cols, bits, rng);
  constexpr int M = cuda::kMaxDecodeRows;
  const std::vector<float> x = normal_bf16(int64_t(M) * cols, rng, 1.0f);
  DeviceBuffer dx = upload_bf16(x);
  auto run = [&](const bf16* xp, int m) {
    DeviceBuffer dy = poisoned(size_t(m) * rows * 4);
    cuda::launch_quant_gemv_rows(w.view(), xp, m, f32_out ? nullptr : dy.as<bf16>(), f32_out ? dy.as<float>() : nullptr,
                                 nullptr);
    return f32_out ? download_f32(dy, int64_t(m) * rows) : download_bf16(dy, int64_t(m) * rows);
  };
  std::vector<std::vector<float>> alone(M);
  for (int t = 0; t < M; ++t) alone[t] = run(dx.as<bf16>() + int64_t(t) * cols, 1);
  std::vector<int> ms;
  for (int m = 1; m <= 33; ++m) ms.push_back(m);
  for (int m : {40, 57, M}) ms.push_back(m);
  for (int m : ms) {
    const std::vector<float> all = run(dx.as<bf16>(), m);
    for (int t = 0; t < m; ++t)
      EXPECT_EQ(bit_differences(std::vector<float>(all.begin() + t * rows, all.begin() + (t + 1) * rows), alone[t]), 0)
          << "token " << t << " of " << m;
  }
  for (int t : {0, M - 1}) {  // the first and the last token against the reference
    std::vector<double> ref(rows);
    for (int64_t r = 0; r < rows; ++r) ref[r] = w.dot(r, x.data() + int64_t(t) * cols);
    EXPECT_LT(worst_rel(alone[t], ref, 0.01 * rms(ref)), f32_out ? 1e-3 : 1e-2) << "token " << t;
  }
}

/// The streaming GEMV's rows-mode thresholds the GEMV tests run (rows_gemv_staging_min_rows):
/// every m in the rows mode; the rows mode from 9 rows (a row alone in the direct mode, so the
/// two modes meet in one comparison); the direct mode for every m.
constexpr int kStagingFrom[] = {1, 9, cuda::kMaxDecodeRows + 1};

TEST(CudaBatchedDecode, GemvRowsAreBitIdenticalForEveryRowCount) {
  const ScopedSwitch stream(cuda::stream_gemv_enabled, cuda::set_stream_gemv_enabled);
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  const ScopedSwitch split(cuda::rows_gemv_split, cuda::set_rows_gemv_split);
  for (bool streaming : {true, false}) {
    SCOPED_TRACE(streaming ? "streaming enabled" : "streaming disabled");
    stream.set(streaming);
    for (int from : kStagingFrom) {
      // The rows mode on two warp groups (all: over the column blocks at 9–16 and 25–32 rows a
      // launch, over the tiles up to 8; tiles: only the latter) and on one; the direct mode has
      // no split.
      for (cuda::RowsGemvSplit form : {cuda::RowsGemvSplit::all, cuda::RowsGemvSplit::tiles, cuda::RowsGemvSplit::none}) {
        if (form != cuda::RowsGemvSplit::all && from > cuda::kMaxDecodeRows) continue;
        SCOPED_TRACE("rows mode from " + std::to_string(from) + " rows, split " + std::to_string(static_cast<int>(form)));
        staging.set(from);
        split.set(form);
        check_gemv_rows(1000, 2048, 4, false, 1);  // the 35B projections' width: streaming kernel
        check_gemv_rows(777, 4096, 4, false, 2);   // out_proj width (rows mode: 16 rows a launch)
        check_gemv_rows(2048, 512, 4, true, 3);    // realdims hidden, fp32 (its lm_head)
        check_gemv_rows(100, 8192, 4, false, 5);   // wide rows (8192 columns; rows mode: 8 a launch)
      }
    }
    check_gemv_rows(300, 256, 4, false, 4);         // demo hidden: cols % 512 ≠ 0, register-load MMA
    check_gemv_rows(257, 2048, 8, true, 6);         // the router: 8-bit, tiled CUDA-core kernel
    check_gemv_rows(17, 256, 8, true, 7);           // demo router
  }
}

/// The k-split GEMV (launch_quant_gemv_ksplit, through launch_quant_gemv_rows from
/// rows_gemv_ksplit_from() rows on) against the streaming GEMV: token t of m rows, for m = 1 … 33
/// and some m up to kMaxDecodeRows (one to eight column blocks, both tile-group shapes), equals
/// token t alone in the direct mode; and all 64 rows equal the rows mode's. Partial last tiles
/// (rows not a multiple of 16) and both slice widths (2,048 and 4,096 columns).
void check_ksplit_rows(int64_t rows, int cols, uint64_t seed) {
  SCOPED_TRACE("k-split " + std::to_string(rows) + "x" + std::to_string(cols));
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  const ScopedSwitch ksplit(cuda::rows_gemv_ksplit_from, cuda::set_rows_gemv_ksplit_from);
  std::mt19937_64 rng(seed);
  RandomQuant w(rows, cols, 4, rng);
  ASSERT_EQ(cuda::ksplit_gemv_problem(w.view(), 1), "");
  constexpr int M = cuda::kMaxDecodeRows;
  DeviceBuffer dx = upload_bf16(normal_bf16(int64_t(M) * cols, rng, 1.0f));
  auto run = [&](const bf16* xp, int m) {
    DeviceBuffer dy = poisoned(size_t(m) * rows * 2);
    cuda::launch_quant_gemv_rows(w.view(), xp, m, dy.as<bf16>(), nullptr, nullptr);
    return download_bf16(dy, int64_t(m) * rows);
  };
  ksplit.set(M + 1);  // the streaming GEMV: each token alone in the direct mode, all in the rows mode
  staging.set(M + 1);
  std::vector<std::vector<float>> alone(M);
  for (int t = 0; t < M; ++t) alone[t] = run(dx.as<bf16>() + int64_t(t) * cols, 1);
  staging.set(1);
  const std::vector<float> rows_mode = run(dx.as<bf16>(), M);
  ksplit.set(1);
  std::vector<int> ms;
  for (int m = 1; m <= 33; ++m) ms.push_back(m);
  for (int m : {40, 41, 48, 57, M}) ms.push_back(m);
  for (int m : ms) {
    const std::vector<float> all = run(dx.as<bf16>(), m);
    for (int t = 0; t < m; ++t)
      EXPECT_EQ(bit_differences(std::vector<float>(all.begin() + t * rows, all.begin() + (t + 1) * rows), alone[t]), 0)
          << "token " << t << " of " << m;
    if (m == M) {
      EXPECT_EQ(bit_differences(all, rows_mode), 0) << "all rows against the rows mode";
    }
  }
}

TEST(CudaBatchedDecode, KsplitGemvGivesTheStreamingBits) {
  check_ksplit_rows(1000, 2048, 31);   // in-projection width, 4 groups a slice, a partial last tile
  check_ksplit_rows(777, 4096, 32);    // out-projection width, 8 groups a slice
  check_ksplit_rows(12352, 2048, 33);  // the GDN in-projection (several tile groups a cluster)
  check_ksplit_rows(2048, 4096, 34);   // the out-projection
}

TEST(CudaBatchedDecode, KsplitGemvNamesWhatItCannotTake) {
  std::mt19937_64 rng(35);
  RandomQuant w4(64, 2048, 4, rng), narrow(64, 512, 4, rng), wide(64, 8192, 4, rng), w8(64, 2048, 8, rng);
  EXPECT_EQ(cuda::ksplit_gemv_problem(w4.view(), cuda::kMaxDecodeRows), "");
  EXPECT_NE(cuda::ksplit_gemv_problem(w4.view(), 0), "");
  EXPECT_NE(cuda::ksplit_gemv_problem(w4.view(), cuda::kMaxDecodeRows + 1), "");
  EXPECT_NE(cuda::ksplit_gemv_problem(narrow.view(), 8), "");
  EXPECT_NE(cuda::ksplit_gemv_problem(wide.view(), 8), "");
  EXPECT_NE(cuda::ksplit_gemv_problem(w8.view(), 8), "");
  DeviceBuffer x = upload_bf16(std::vector<float>(2048, 1.0f)), y(64 * 2);
  EXPECT_THROW(cuda::launch_quant_gemv_ksplit(narrow.view(), x.as<bf16>(), 1, y.as<bf16>(), nullptr), lily::InternalError);
  EXPECT_THROW(cuda::launch_quant_gemv_ksplit(w4.view(), x.as<bf16>() + 1, 1, y.as<bf16>(), nullptr), lily::InternalError);
}

/// The batched decode's norm + GEMV (launch_add_rmsnorm over the rows, then
/// launch_quant_gemv_rows) against the one-sequence step's (launch_add_rmsnorm_gemv, the norm
/// fused into the GEMV's staging), and launch_quant_gemv_rows against launch_quant_gemv without
/// a norm: the same bits for the residual, the normed row and the output, the row alone and as
/// the last of 3 rows.
void check_gemv_rows_vs_one_sequence(int64_t rows, int cols, bool f32_out, uint64_t seed) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + (f32_out ? " fp32" : " bf16"));
  std::mt19937_64 rng(seed);
  RandomQuant w(rows, cols, 4, rng);
  const float eps = 1e-6f;
  const std::vector<float> x = normal_bf16(int64_t(3) * cols, rng, 1.0f), branch = normal_bf16(int64_t(3) * cols, rng, 0.5f);
  DeviceBuffer gain = upload_f32(uniform(cols, rng, 0.5f, 1.5f));
  auto out = [&](DeviceBuffer& y, int64_t n) { return f32_out ? download_f32(y, n) : download_bf16(y, n); };
  auto gemv_rows = [&](const bf16* xp, int m, DeviceBuffer& y) {
    cuda::launch_quant_gemv_rows(w.view(), xp, m, f32_out ? nullptr : y.as<bf16>(), f32_out ? y.as<float>() : nullptr,
                                 nullptr);
  };
  const int64_t last = int64_t(2) * cols;  // the row compared: row 2 of 3
  // One sequence: the fused norm + GEMV on row 2.
  DeviceBuffer x1 = upload_bf16(std::vector<float>(x.begin() + last, x.end()));
  DeviceBuffer b1 = upload_bf16(std::vector<float>(branch.begin() + last, branch.end()));
  DeviceBuffer xo1 = poisoned(size_t(cols) * 2), n1 = poisoned(size_t(cols) * 2), y1 = poisoned(size_t(rows) * 4);
  cuda::FusedNorm fn;
  fn.branch = b1.as<bf16>();
  fn.gain = gain.as<float>();
  fn.eps = eps;
  fn.x_out = xo1.as<bf16>();
  fn.normed_out = n1.as<bf16>();
  cuda::launch_add_rmsnorm_gemv(fn, x1.as<bf16>(), w.view(), f32_out ? nullptr : y1.as<bf16>(),
                                f32_out ? y1.as<float>() : nullptr, nullptr);
  // Batched: the norm over 3 rows in place, then the GEMV over 1 row (row 2) and over all 3.
  DeviceBuffer x3 = upload_bf16(x), b3 = upload_bf16(branch), n3 = poisoned(size_t(3) * cols * 2);
  cuda::launch_add_rmsnorm(x3.as<bf16>(), b3.as<bf16>(), gain.as<float>(), n3.as<bf16>(), 3, cols, eps, nullptr);
  DeviceBuffer ya = poisoned(size_t(rows) * 4), yb = poisoned(size_t(3) * rows * 4);
  gemv_rows(n3.as<bf16>() + last, 1, ya);
  gemv_rows(n3.as<bf16>(), 3, yb);
  const std::vector<float> x_after = download_bf16(x3, int64_t(3) * cols);
  EXPECT_EQ(bit_differences(std::vector<float>(x_after.begin() + last, x_after.end()), download_bf16(xo1, cols)), 0)
      << "the residual";
  const std::vector<float> normed3 = download_bf16(n3, int64_t(3) * cols);
  EXPECT_EQ(bit_differences(std::vector<float>(normed3.begin() + last, normed3.end()), download_bf16(n1, cols)), 0)
      << "the normed row";
  const std::vector<float> one = out(y1, rows), all = out(yb, int64_t(3) * rows);
  EXPECT_EQ(bit_differences(out(ya, rows), one), 0) << "the output, the row alone";
  EXPECT_EQ(bit_differences(std::vector<float>(all.begin() + 2 * rows, all.end()), one), 0) << "the output, row 2 of 3";
  // Without a norm: launch_quant_gemv on row 2 against the rows launcher.
  DeviceBuffer yc = poisoned(size_t(rows) * 4), yd = poisoned(size_t(rows) * 4);
  cuda::launch_quant_gemv(w.view(), x1.as<bf16>(), f32_out ? nullptr : yc.as<bf16>(), f32_out ? yc.as<float>() : nullptr,
                          nullptr);
  gemv_rows(x1.as<bf16>(), 1, yd);
  EXPECT_EQ(bit_differences(out(yd, rows), out(yc, rows)), 0) << "without a norm";
}

TEST(CudaBatchedDecode, GemvRowsGiveTheOneSequenceBits) {
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  for (int from : kStagingFrom) {
    SCOPED_TRACE("rows mode from " + std::to_string(from) + " rows");
    staging.set(from);
    check_gemv_rows_vs_one_sequence(1000, 2048, false, 11);  // the 35B in-projections' width
    check_gemv_rows_vs_one_sequence(777, 4096, false, 12);   // out_proj width
    check_gemv_rows_vs_one_sequence(2048, 512, true, 13);    // realdims hidden, fp32 (its lm_head)
    check_gemv_rows_vs_one_sequence(300, 256, false, 14);    // demo hidden: the register-load MMA kernel
  }
}

/// launch_add_rmsnorm_gemv_rows (the input add + RMSNorm folded into the rows mode's staging)
/// against launch_add_rmsnorm over the m rows followed by launch_quant_gemv_rows: the same bits
/// for the residual, the normed rows and the output, m = 1 … 8, with and without a branch.
void check_rows_norm_gemv(int64_t rows, int cols, uint64_t seed) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
  std::mt19937_64 rng(seed);
  RandomQuant w(rows, cols, 4, rng);
  constexpr int M = 8;
  const float eps = 1e-6f;
  const std::vector<float> x = normal_bf16(int64_t(M) * cols, rng, 2.0f), branch = normal_bf16(int64_t(M) * cols, rng, 0.5f);
  DeviceBuffer gain = upload_f32(uniform(cols, rng, 0.5f, 1.5f)), b = upload_bf16(branch);
  for (int m = 1; m <= M; ++m)
    for (const bool with_branch : {true, false}) {
      SCOPED_TRACE(std::to_string(m) + " rows" + (with_branch ? "" : ", no branch"));
      const std::vector<float> xm(x.begin(), x.begin() + int64_t(m) * cols);
      DeviceBuffer x_sep = upload_bf16(xm), n_sep = poisoned(size_t(m) * cols * 2), y_sep = poisoned(size_t(m) * rows * 2);
      cuda::launch_add_rmsnorm(x_sep.as<bf16>(), with_branch ? b.as<bf16>() : nullptr, gain.as<float>(), n_sep.as<bf16>(),
                               m, cols, eps, nullptr);
      cuda::launch_quant_gemv_rows(w.view(), n_sep.as<bf16>(), m, y_sep.as<bf16>(), nullptr, nullptr);
      DeviceBuffer x_in = upload_bf16(xm), x_out = poisoned(size_t(m) * cols * 2), n_out = poisoned(size_t(m) * cols * 2),
                   y = poisoned(size_t(m) * rows * 2);
      cuda::FusedNorm fn;
      fn.branch = with_branch ? b.as<bf16>() : nullptr;
      fn.gain = gain.as<float>();
      fn.eps = eps;
      fn.x_out = x_out.as<bf16>();
      fn.normed_out = n_out.as<bf16>();
      cuda::launch_add_rmsnorm_gemv_rows(fn, x_in.as<bf16>(), m, w.view(), y.as<bf16>(), nullptr);
      const int64_t n = int64_t(m) * cols;
      EXPECT_EQ(bit_differences(download_bf16(x_out, n), download_bf16(x_sep, n)), 0) << "the residual";
      EXPECT_EQ(bit_differences(download_bf16(n_out, n), download_bf16(n_sep, n)), 0) << "the normed rows";
      EXPECT_EQ(bit_differences(download_bf16(y, int64_t(m) * rows), download_bf16(y_sep, int64_t(m) * rows)), 0)
          << "the output";
      EXPECT_EQ(bit_differences(download_bf16(x_in, n), xm), 0) << "x is only read";
    }
}

TEST(CudaBatchedDecode, RowsNormGemvGivesTheSeparateBits) {
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  staging.set(1);  // the separate path's GEMV in the rows mode at every m, as the fused one
  check_rows_norm_gemv(12352, 2048, 21);  // the 35B GDN in-projection
  check_rows_norm_gemv(9216, 2048, 22);   // the 35B attention q|gate ‖ k ‖ v
  check_rows_norm_gemv(1000, 512, 23);    // realdims width
}

TEST(CudaBatchedDecode, RowsNormGemvNamesWhatItCannotTake) {
  std::mt19937_64 rng(25);
  RandomQuant w4(64, 2048, 4, rng), w8(64, 2048, 8, rng), wide(64, 4096, 4, rng), narrow(64, 256, 4, rng);
  EXPECT_EQ(cuda::rows_norm_gemv_problem(w4.view(), 8), "");
  EXPECT_NE(cuda::rows_norm_gemv_problem(w4.view(), 0), "");
  EXPECT_NE(cuda::rows_norm_gemv_problem(w4.view(), 9), "");
  EXPECT_NE(cuda::rows_norm_gemv_problem(w8.view(), 4), "");
  EXPECT_NE(cuda::rows_norm_gemv_problem(wide.view(), 4), "");    // wider than the staging's registers
  EXPECT_NE(cuda::rows_norm_gemv_problem(narrow.view(), 4), "");  // the streaming GEMV takes multiples of 512
  DeviceBuffer x = upload_bf16(normal_bf16(2048, rng, 1.0f)), gain = upload_f32(uniform(2048, rng, 0.5f, 1.5f));
  DeviceBuffer n = poisoned(2048 * 2), y = poisoned(64 * 2);
  cuda::FusedNorm fn;
  fn.gain = gain.as<float>();
  fn.x_out = x.as<bf16>();  // x_out must not be x
  fn.normed_out = n.as<bf16>();
  EXPECT_THROW(cuda::launch_add_rmsnorm_gemv_rows(fn, x.as<bf16>(), 1, w4.view(), y.as<bf16>(), nullptr), lily::InternalError);
  EXPECT_THROW(cuda::launch_add_rmsnorm_gemv_rows(fn, x.as<bf16>(), 9, w4.view(), y.as<bf16>(), nullptr), lily::InternalError);
}

TEST(CudaBatchedDecode, RowsGemvStagingThresholdRefusesZeroRows) {
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  EXPECT_THROW(staging.set(0), lily::Error);
  staging.set(5);
  EXPECT_EQ(cuda::rows_gemv_staging_min_rows(), 5);
}

/// The batched decode's 4-bit GEMVs at the 35B-A3B shapes for m = 1 … 64 rows, in the streaming
/// kernel's direct mode, its rows mode on one warp group and on two (rows_gemv_split all;
/// not at 17–24 rows), and the k-split GEMV (where it takes the matrix; the LM head's fp32 output
/// it does not, so its column repeats the rows mode): µs per launch (events, after a warm-up) and
/// the k-split's rate in weight bytes. Printed, never asserted. The LM head's shape too in the rows mode
/// (rows_mode_max_weight_rows raised: by default it stays direct), to see whether two groups
/// change the choice.
TEST(CudaTiming, PrintsGemvRowsTimes) {
  struct Shape {
    const char* name;
    int64_t rows;
    int cols;
    bool f32_out;
  };
  const Shape shapes[] = {{"gdn in_proj", 12352, 2048, false},
                          {"attn q|k|v", 9216, 2048, false},
                          {"out_proj", 2048, 4096, false},
                          {"lm_head", 248320, 2048, true}};
  const ScopedSwitch staging(cuda::rows_gemv_staging_min_rows, cuda::set_rows_gemv_staging_min_rows);
  const ScopedSwitch split(cuda::rows_gemv_split, cuda::set_rows_gemv_split);
  const ScopedSwitch ksplit(cuda::rows_gemv_ksplit_from, cuda::set_rows_gemv_ksplit_from);
  // The LM head too in the rows mode (it takes the direct mode by default).
  const ScopedSwitch<int64_t> largest(cuda::rows_mode_max_weight_rows, cuda::set_rows_mode_max_weight_rows);
  largest.set(int64_t{1} << 40);
  constexpr int M = cuda::kMaxDecodeRows;
  for (const Shape& s : shapes) {
    std::mt19937_64 rng(21);
    RandomQuant w(s.rows, s.cols, 4, rng);
    DeviceBuffer dx = upload_bf16(normal_bf16(int64_t(M) * s.cols, rng, 1.0f));
    DeviceBuffer dy(size_t(M) * s.rows * 4);
    const double bytes = double(s.rows) * (s.cols / 2 + s.cols / 64 * 4);
    for (int m : {1, 2, 4, 8, 16, 24, 32, 48, 64}) {
      double us[4];
      for (int mode = 0; mode < 4; ++mode) {  // direct, rows on one group, rows on two, k-split
        staging.set(mode == 0 ? M + 1 : 1);
        split.set(mode == 2 ? cuda::RowsGemvSplit::all : cuda::RowsGemvSplit::none);
        ksplit.set(mode == 3 ? 1 : M + 1);
        us[mode] = time_us([&] {
          cuda::launch_quant_gemv_rows(w.view(), dx.as<bf16>(), m, s.f32_out ? nullptr : dy.as<bf16>(),
                                       s.f32_out ? dy.as<float>() : nullptr, nullptr);
        });
      }
      std::printf("[timing] gemv rows %-11s %6lldx%-5d m=%2d  direct %8.2f us  rows mode %8.2f us  two groups %8.2f us  "
                  "k-split %8.2f us (%6.0f GB/s)\n",
                  s.name, static_cast<long long>(s.rows), s.cols, m, us[0], us[1], us[2], us[3], bytes / us[3] / 1e3);
    }
  }
}

// ---- GDN ---------------------------------------------------------------------------------------

/// gdn_conv_decode_rows + gdn_decode_rows over `rows` sequences against gdn_conv_decode +
/// gdn_decode on each row alone (copies of the same windows and states): outputs, windows and
/// states bit-identical, over three consecutive steps.
void check_gdn_rows(const cuda::GdnDims& d, int rows, uint64_t seed) {
  SCOPED_TRACE("GDN Hk " + std::to_string(d.n_key_heads) + " Hv " + std::to_string(d.n_value_heads) + " D " +
               std::to_string(d.key_head_dim) + ", rows " + std::to_string(rows));
  std::mt19937_64 rng(seed);
  const int C = d.conv_channels(), Vd = d.value_dim(), Hv = d.n_value_heads;
  const int64_t R = C + Vd + 2 * Hv + 32;  // a projection row with some padding after b
  DeviceBuffer conv_w = upload_f32(normal(int64_t(C) * 4, rng, 0.0f, 0.5f));
  DeviceBuffer A_log = upload_f32(uniform(Hv, rng, -2.0f, 1.0f)), dt_bias = upload_f32(normal(Hv, rng, 0.0f, 0.5f));
  DeviceBuffer norm_w = upload_f32(uniform(d.value_head_dim, rng, 0.5f, 1.5f));
  const cuda::GdnParams p{conv_w.as<float>(), A_log.as<float>(), dt_bias.as<float>(), norm_w.as<float>()};
  // Each row's window and state twice: one set for the alone runs, one for the batched.
  std::vector<DeviceBuffer> win[2], st[2];
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> w0 = normal_bf16(d.window_elems(), rng, 1.0f);
    const std::vector<float> s0 = normal(d.state_elems(), rng, 0.0f, 0.3f);
    for (int k = 0; k < 2; ++k) {
      win[k].push_back(upload_bf16(w0));
      st[k].push_back(upload_f32(s0));
    }
  }
  std::vector<bf16*> win_ptrs;
  std::vector<float*> st_ptrs;
  for (int r = 0; r < rows; ++r) {
    win_ptrs.push_back(win[1][r].as<bf16>());
    st_ptrs.push_back(st[1][r].as<float>());
  }
  DeviceBuffer d_win = upload_array(win_ptrs), d_st = upload_array(st_ptrs);
  for (int step = 0; step < 3; ++step) {
    DeviceBuffer proj = upload_bf16(normal(int64_t(rows) * R, rng, 0.0f, 1.0f));
    const bf16* pr = proj.as<bf16>();
    DeviceBuffer conv_a = poisoned(size_t(C) * 2), out_a = poisoned(size_t(rows) * Vd * 2);
    for (int r = 0; r < rows; ++r) {
      const bf16* row = pr + r * R;
      cuda::gdn_conv_decode(d, p, row, win[0][r].as<bf16>(), conv_a.as<bf16>(), nullptr);
      cuda::gdn_decode(d, p, conv_a.as<bf16>(), row + C, row + C + Vd, row + C + Vd + Hv, st[0][r].as<float>(),
                       out_a.as<bf16>() + int64_t(r) * Vd, nullptr);
    }
    DeviceBuffer conv_b = poisoned(size_t(rows) * C * 2), out_b = poisoned(size_t(rows) * Vd * 2);
    cuda::gdn_conv_decode_rows(d, p, rows, pr, R, d_win.as<bf16* const>(), conv_b.as<bf16>(), nullptr);
    cuda::gdn_decode_rows(d, p, rows, conv_b.as<bf16>(), pr + C, pr + C + Vd, pr + C + Vd + Hv, R,
                          d_st.as<float* const>(), out_b.as<bf16>(), nullptr);
    EXPECT_EQ(bit_differences(download_bf16(out_a, int64_t(rows) * Vd), download_bf16(out_b, int64_t(rows) * Vd)), 0)
        << "outputs, step " << step;
    for (int r = 0; r < rows; ++r) {
      EXPECT_EQ(bit_differences(download_bf16(win[0][r], d.window_elems()), download_bf16(win[1][r], d.window_elems())), 0)
          << "window of row " << r << ", step " << step;
      EXPECT_EQ(bit_differences(download_f32(st[0][r], d.state_elems()), download_f32(st[1][r], d.state_elems())), 0)
          << "state of row " << r << ", step " << step;
    }
  }
}

TEST(CudaBatchedDecode, GdnRowsAreBitIdenticalToEachSequenceAlone) {
  const cuda::GdnDims real;  // 35B-A3B: Hk 16, Hv 32, D 128
  const cuda::GdnDims realdims = gdn_dims(2, 4, 128);
  const cuda::GdnDims demo = demo_gdn_dims();
  check_gdn_rows(real, cuda::kMaxDecodeRows, 100 + cuda::kMaxDecodeRows);
  for (int rows : {1, 3, 8}) {
    check_gdn_rows(real, rows, 100 + rows);
    check_gdn_rows(realdims, rows, 200 + rows);
    check_gdn_rows(demo, rows, 300 + rows);
  }
}

/// The batched GDN step (35B-A3B shape: 32 value heads of 128 × 128 fp32 states, 2 MiB a row,
/// read and written) at 1 … 64 rows, beside a device copy of the same bytes: µs per launch
/// (events, after a warm-up) and GB/s of state read + written. The launches rotate over three
/// disjoint sets of states (384 MiB in all), so that the states come from HBM as in a decode
/// step, where a layer's weights pass through L2 between two uses of a state. Printed, never
/// asserted.
TEST(CudaTiming, PrintsGdnRowsTimes) {
  const cuda::GdnDims d;
  std::mt19937_64 rng(31);
  constexpr int M = cuda::kMaxDecodeRows, kSets = 3;
  const int C = d.conv_channels(), Vd = d.value_dim(), Hv = d.n_value_heads;
  const int64_t R = C + Vd + 2 * Hv;
  DeviceBuffer conv_w = upload_f32(normal(int64_t(C) * 4, rng, 0.0f, 0.5f));
  DeviceBuffer A_log = upload_f32(uniform(Hv, rng, -2.0f, 1.0f)), dt_bias = upload_f32(normal(Hv, rng, 0.0f, 0.5f));
  DeviceBuffer norm_w = upload_f32(uniform(d.value_head_dim, rng, 0.5f, 1.5f));
  const cuda::GdnParams p{conv_w.as<float>(), A_log.as<float>(), dt_bias.as<float>(), norm_w.as<float>()};
  const int64_t state_bytes = d.state_elems() * 4;
  DeviceBuffer pool(size_t(kSets) * M * state_bytes), copy_dst(size_t(M) * state_bytes);
  CUDA_CHECK(cudaMemset(pool.data(), 0, pool.bytes()));
  std::vector<DeviceBuffer> sets;
  for (int k = 0; k < kSets; ++k) {
    std::vector<float*> ptrs;
    for (int r = 0; r < M; ++r) ptrs.push_back(pool.as<float>() + (int64_t(k) * M + r) * d.state_elems());
    sets.push_back(upload_array(ptrs));
  }
  DeviceBuffer proj = upload_bf16(normal(int64_t(M) * R, rng, 0.0f, 1.0f));
  DeviceBuffer conv = upload_bf16(normal(int64_t(M) * C, rng, 0.0f, 1.0f)), out(size_t(M) * Vd * 2);
  const bf16* pr = proj.as<bf16>();
  for (int rows : {1, 2, 4, 8, 16, 32, 48, 64}) {
    const double bytes = 2.0 * rows * state_bytes;
    int k = 0;
    const double copy_us = time_us([&] {
      const char* src = static_cast<const char*>(pool.data()) + int64_t(k++ % kSets) * M * state_bytes;
      CUDA_CHECK(cudaMemcpyAsync(copy_dst.data(), src, size_t(rows) * state_bytes, cudaMemcpyDeviceToDevice, nullptr));
    });
    std::printf("[timing] gdn decode rows %2d  copy of the states %8.2f us (%5.0f GB/s)", rows, copy_us,
                bytes / copy_us / 1e3);
    const double us = time_us([&] {
      cuda::gdn_decode_rows(d, p, rows, conv.as<bf16>(), pr + C, pr + C + Vd, pr + C + Vd + Hv, R,
                            sets[k++ % kSets].as<float* const>(), out.as<bf16>(), nullptr);
    });
    std::printf("  gdn_decode_rows %8.2f us (%5.0f GB/s)\n", us, bytes / us / 1e3);
  }
}

// ---- attention ---------------------------------------------------------------------------------

/// attention_prepare_rows + attention_decode_rows over sequences of different capacities and
/// lengths against attention_prepare (T = 1) + attention_decode on each alone, with each row's
/// split count from its capacity (as the backend does): q, the appended K/V, and the gated
/// outputs bit-identical.
void check_attention_rows(const cuda::AttnDims& d, const std::vector<std::pair<int64_t, int64_t>>& cap_len,
                          uint64_t seed) {
  const int rows = static_cast<int>(cap_len.size());
  SCOPED_TRACE("attention nq " + std::to_string(d.n_heads) + " nkv " + std::to_string(d.n_kv_heads) + " D " +
               std::to_string(d.head_dim) + ", rows " + std::to_string(rows));
  std::mt19937_64 rng(seed);
  const int D = d.head_dim, nq = d.n_heads;
  const int64_t qg = int64_t(nq) * 2 * D, kvw = int64_t(d.n_kv_heads) * D, R = qg + 2 * kvw + 16;
  DeviceBuffer q_norm = upload_f32(uniform(D, rng, 0.5f, 1.5f)), k_norm = upload_f32(uniform(D, rng, 0.5f, 1.5f));
  DeviceBuffer proj = upload_bf16(normal(int64_t(rows) * R, rng, 0.0f, 1.0f));
  const bf16* pr = proj.as<bf16>();
  std::vector<DeviceBuffer> k[2], v[2];
  std::vector<cuda::KvCacheView> views;
  std::vector<int32_t> pos, len, splits;
  int max_splits = 1;
  for (int r = 0; r < rows; ++r) {
    const auto [cap, n] = cap_len[r];  // n = the length after this token (position n − 1)
    const std::vector<float> k0 = normal_bf16(kvw * cap, rng, 1.0f), v0 = normal_bf16(kvw * cap, rng, 1.0f);
    for (int c = 0; c < 2; ++c) {
      k[c].push_back(upload_bf16(k0));
      v[c].push_back(upload_bf16(v0));
    }
    views.push_back({k[1][r].as<bf16>(), v[1][r].as<bf16>(), cap});
    pos.push_back(static_cast<int32_t>(n - 1));
    len.push_back(static_cast<int32_t>(n));
    splits.push_back(cuda::attention_decode_splits(cap));
    max_splits = std::max(max_splits, splits.back());
  }
  // Alone: one sequence at a time through the one-sequence launchers.
  DeviceBuffer ws(cuda::attention_decode_workspace_bytes(d, cuda::kMaxDecodeSplits));
  DeviceBuffer q_a = poisoned(size_t(rows) * nq * D * 2), out_a = poisoned(size_t(rows) * nq * D * 2);
  for (int r = 0; r < rows; ++r) {
    const bf16* row = pr + r * R;
    const cuda::KvCacheView kv{k[0][r].as<bf16>(), v[0][r].as<bf16>(), cap_len[r].first};
    bf16* q = q_a.as<bf16>() + int64_t(r) * nq * D;
    cuda::attention_prepare(d, 1, row, R, row + qg, row + qg + kvw, R, q_norm.as<float>(), k_norm.as<float>(), pos[r],
                            nullptr, kv, q, nullptr);
    cuda::attention_decode(d, q, row, kv, len[r], nullptr, splits[r], ws.as<float>(), ws.bytes(),
                           out_a.as<bf16>() + int64_t(r) * nq * D, nullptr);
  }
  // Together.
  DeviceBuffer d_pos = upload_array(pos), d_len = upload_array(len), d_splits = upload_array(splits);
  DeviceBuffer d_views = upload_array(views);
  DeviceBuffer ws_rows(cuda::attention_decode_rows_workspace_bytes(d, rows));
  DeviceBuffer q_b = poisoned(size_t(rows) * nq * D * 2), out_b = poisoned(size_t(rows) * nq * D * 2);
  cuda::attention_prepare_rows(d, rows, pr, R, pr + qg, pr + qg + kvw, R, q_norm.as<float>(), k_norm.as<float>(),
                               d_pos.as<int32_t>(), d_views.as<cuda::KvCacheView>(), q_b.as<bf16>(), nullptr);
  cuda::attention_decode_rows(d, rows, q_b.as<bf16>(), pr, R, d_views.as<cuda::KvCacheView>(), d_len.as<int32_t>(),
                              d_splits.as<int32_t>(), max_splits, ws_rows.as<float>(), ws_rows.bytes(), out_b.as<bf16>(),
                              nullptr);
  const int64_t n_out = int64_t(rows) * nq * D;
  EXPECT_EQ(bit_differences(download_bf16(q_a, n_out), download_bf16(q_b, n_out)), 0) << "q";
  EXPECT_EQ(bit_differences(download_bf16(out_a, n_out), download_bf16(out_b, n_out)), 0) << "outputs";
  for (int r = 0; r < rows; ++r) {
    const int64_t n = kvw * cap_len[r].first;
    EXPECT_EQ(bit_differences(download_bf16(k[0][r], n), download_bf16(k[1][r], n)), 0) << "K cache of row " << r;
    EXPECT_EQ(bit_differences(download_bf16(v[0][r], n), download_bf16(v[1][r], n)), 0) << "V cache of row " << r;
  }
}

TEST(CudaBatchedDecode, AttentionRowsAreBitIdenticalToEachSequenceAlone) {
  const cuda::AttnDims real;  // 35B-A3B: 16 q / 2 kv heads, D 256, rotary 64
  const cuda::AttnDims demo = demo_attn_dims();
  // 36 heads (the prepare kernel's warps take them in rounds), RoPE partner via shared memory
  const cuda::AttnDims wide = attn_dims(32, 4, 64, 6);
  // (capacity, length): one split (capacity ≤ 64), 16 and 32 splits, a full cache, a first token.
  const std::vector<std::pair<int64_t, int64_t>> mixed = {{1024, 37}, {64, 64}, {2048, 1500}, {1024, 1},
                                                          {100, 70},  {4096, 4000}, {1024, 1024}, {2048, 1025}};
  // kMaxDecodeRows rows: the mixed set eight times over, each copy its own cache.
  std::vector<std::pair<int64_t, int64_t>> most;
  while (static_cast<int>(most.size()) < cuda::kMaxDecodeRows) most.push_back(mixed[most.size() % mixed.size()]);
  for (const cuda::AttnDims& d : {real, demo, wide}) {
    check_attention_rows(d, {mixed[0]}, 400);
    check_attention_rows(d, {mixed[2], mixed[1]}, 401);
    check_attention_rows(d, mixed, 402);
  }
  check_attention_rows(real, most, 403);
}

}  // namespace
}  // namespace lily::test
