// The fused decode MoE blocks, one token (launch_moe_block_decode) and the 1 … 64 rows of a
// batched step (launch_moe_block_rows, each row bit-identical to the row launched alone),
// against the separate kernels they replace and against exact reference loops: the norm, the router logits and the routing bit for bit
// (the same arithmetic as launch_add_rmsnorm_router_fused), the expert activations and the
// combined output within bf16 rounding of docs/model.md §4.3's sequence; at the real
// Qwen3.6-35B-A3B shape (hidden 2048, 256 experts top-8, ffn 512) and the demo model's (hidden
// 256, 16 experts top-4, ffn 128), on every SM and on a few blocks (several tiles per block);
// eager, with PDL and replayed from a CUDA graph, bit-identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/cpu/ops.h"
#include "gpu_test_util.h"

namespace lily::test {
namespace {

using cuda::DeviceBuffer;

/// Random weights of one MoE block (8-bit router ‖ shared gate, 4-bit expert stacks with the
/// shared expert last) and the buffers of one fused launch.
struct MoeBlock {
  int E, k, hidden, ffn;
  RandomQuant router, gate, up, down;
  DeviceBuffer gain, logits, ids, weights, act, act_sums, normed_sums, normed_frag, barriers;

  MoeBlock(int E_, int k_, int hidden_, int ffn_, std::mt19937_64& rng)
      : E(E_), k(k_), hidden(hidden_), ffn(ffn_), router(E_ + 1, hidden_, 8, rng),
        gate((E_ + 1) * int64_t(ffn_), hidden_, 4, rng), up((E_ + 1) * int64_t(ffn_), hidden_, 4, rng),
        down((E_ + 1) * int64_t(hidden_), ffn_, 4, rng) {
    std::vector<float> g = normal_bf16(hidden, rng, 0.3f);
    for (auto& v : g) v += 1.0f;
    gain = upload_f32(g);
    constexpr int R = cuda::kMaxMoeRows;  // room for the most rows a launch takes
    logits = poisoned(size_t(R) * (E + 1) * 4);
    ids = poisoned(size_t(R) * (k + 1) * 4);
    weights = poisoned(size_t(R) * (k + 1) * 4);
    act = poisoned(size_t(R) * (k + 1) * ffn * 2);
    act_sums = poisoned(size_t(R) * (k + 1) * (ffn / 8) * 4);
    normed_sums = poisoned(size_t(R) * (hidden / 64) * 4);
    normed_frag = poisoned(size_t(R) * hidden * 2);
    barriers = DeviceBuffer(4 * sizeof(uint32_t));  // the third: the out-projection phase's; the fourth the next norm's
  }

  /// The launch's arguments for `rows` rows: x (+ branch, when non-null) → x_out, normed;
  /// output `out` (each [rows, hidden]).
  cuda::MoeDecodeArgs args(const DeviceBuffer& x, const __nv_bfloat16* branch, DeviceBuffer& x_out, DeviceBuffer& normed,
                           DeviceBuffer& out, uint32_t* barrier_pair = nullptr, int rows = 1) const {
    cuda::MoeDecodeArgs a;
    a.rows = rows;
    a.router = router.view();
    a.gate = gate.view();
    a.up = up.view();
    a.down = down.view();
    a.n_experts = E;
    a.top_k = k;
    a.ffn = ffn;
    a.norm.branch = branch;
    a.norm.gain = gain.as<float>();
    a.norm.eps = 1e-6f;
    a.norm.x_out = x_out.as<__nv_bfloat16>();
    a.norm.normed_out = normed.as<__nv_bfloat16>();
    a.x = x.as<__nv_bfloat16>();
    a.logits = logits.as<float>();
    a.ids = ids.as<int32_t>();
    a.weights = weights.as<float>();
    a.act = act.as<__nv_bfloat16>();
    a.act_sums = act_sums.as<float>();
    a.normed_sums = normed_sums.as<float>();
    a.normed_frag = normed_frag.as<__nv_bfloat16>();
    a.out = out.as<__nv_bfloat16>();
    a.barriers = barrier_pair ? barrier_pair : barriers.as<uint32_t>();
    return a;
  }
};

/// Launches the one-token kernel (launch_moe_block_decode) or the rows kernel
/// (launch_moe_block_rows), after checking that it supports `a`.
void launch_moe(const cuda::MoeDecodeArgs& a, cudaStream_t stream, int max_blocks, bool rows_kernel) {
  const std::string why = rows_kernel ? cuda::moe_block_rows_unsupported(a, max_blocks) : cuda::moe_block_unsupported(a, max_blocks);
  ASSERT_EQ(why, "");
  if (rows_kernel) cuda::launch_moe_block_rows(a, stream, max_blocks);
  else cuda::launch_moe_block_decode(a, stream, max_blocks);
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

/// One fused launch of `rows` rows on `max_blocks` blocks (0: one per SM) against the fused
/// router kernel on each row's inputs (the one-token block bit for bit; the rows kernel within
/// rounding, its routing exactly that of its own logits) and the reference loops (within bf16
/// rounding).
void check_moe_block(int E, int k, int hidden, int ffn, uint64_t seed, int max_blocks, int rows = 1,
                     bool rows_kernel = false) {
  std::mt19937_64 rng(seed);
  MoeBlock m(E, k, hidden, ffn, rng);
  const int64_t n = int64_t(rows) * hidden;
  const std::vector<float> x = normal_bf16(n, rng, 2.0f), branch = normal_bf16(n, rng, 0.5f);
  DeviceBuffer dx = upload_bf16(x), dbranch = upload_bf16(branch);
  DeviceBuffer x_out = poisoned(size_t(n) * 2), normed = poisoned(size_t(n) * 2);
  DeviceBuffer out = poisoned(size_t(n) * 2);
  const cuda::MoeDecodeArgs a = m.args(dx, dbranch.as<__nv_bfloat16>(), x_out, normed, out, nullptr, rows);
  m.barriers.fill_bytes(0);
  launch_moe(a, nullptr, max_blocks, rows_kernel);
  CUDA_CHECK(cudaDeviceSynchronize());
  const int n_sel = k + 1;
  const std::vector<float> all_xo = download_bf16(x_out, n), all_y = download_bf16(normed, n);
  const std::vector<float> all_logits = download_f32(m.logits, int64_t(rows) * (E + 1));
  const std::vector<int32_t> all_ids = download_i32(m.ids, rows * n_sel);
  const std::vector<float> all_w = download_f32(m.weights, int64_t(rows) * n_sel);
  const std::vector<float> all_act = download_bf16(m.act, int64_t(rows) * n_sel * ffn);
  const std::vector<float> all_out = download_bf16(out, n);
  auto part = [](const auto& v, int r, int64_t len) {
    using V = std::decay_t<decltype(v)>;
    return V(v.begin() + r * len, v.begin() + (r + 1) * len);
  };

  for (int row = 0; row < rows; ++row) {
    // The separate fused router on the row's inputs: norm, logits and routing bit for bit.
    DeviceBuffer rx = upload_bf16(part(x, row, hidden)), rb = upload_bf16(part(branch, row, hidden));
    DeviceBuffer r_xout = poisoned(size_t(hidden) * 2), r_normed = poisoned(size_t(hidden) * 2);
    DeviceBuffer r_logits = poisoned(size_t(E + 1) * 4), r_ids = poisoned(size_t(k + 1) * 4), r_w = poisoned(size_t(k + 1) * 4);
    DeviceBuffer done(4);
    done.fill_bytes(0);
    cuda::FusedNorm rn = a.norm;
    rn.branch = rb.as<__nv_bfloat16>();
    rn.x_out = r_xout.as<__nv_bfloat16>();
    rn.normed_out = r_normed.as<__nv_bfloat16>();
    cuda::launch_add_rmsnorm_router_fused(rn, rx.as<__nv_bfloat16>(), m.router.view(), E, k, r_logits.as<float>(),
                                          r_ids.as<int32_t>(), r_w.as<float>(), done.as<uint32_t>(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(bits_of(part(all_xo, row, hidden)), bits_of(download_bf16(r_xout, hidden))) << "x_out, row " << row;
    const std::vector<float> y = part(all_y, row, hidden);
    const std::vector<float> logits = part(all_logits, row, E + 1);
    const std::vector<int32_t> ids = part(all_ids, row, n_sel);
    const std::vector<float> w = part(all_w, row, n_sel);
    if (!rows_kernel) {  // the one-token block: the fused router's norm, logits and routing, bit for bit
      EXPECT_EQ(bits_of(y), bits_of(download_bf16(r_normed, hidden))) << "normed, row " << row;
      EXPECT_EQ(bits_of(logits), bits_of(download_f32(r_logits, E + 1))) << "router logits, row " << row;
      EXPECT_EQ(ids, download_i32(r_ids, k + 1)) << "routing, row " << row;
      EXPECT_EQ(bits_of(w), bits_of(download_f32(r_w, k + 1))) << "routing weights, row " << row;
    } else {
      // The rows kernel sums Σh² and the router in other orders (tensor cores): the norm within
      // bf16 rounding of the fused router's, the logits against an fp64 reference on the
      // kernel's own normed row, the routing exactly that of its own logits.
      const std::vector<float> ry = download_bf16(r_normed, hidden);
      EXPECT_LT(worst_rel(y, std::vector<double>(ry.begin(), ry.end()), 0.01 * rms(std::vector<double>(ry.begin(), ry.end()))),
                1e-2) << "normed, row " << row;
      std::vector<double> rl(E + 1);
      for (int e = 0; e <= E; ++e) rl[e] = m.router.dot(e, y.data());
      EXPECT_LT(worst_rel(logits, rl, 0.01 * rms(rl)), 1e-3) << "router logits, row " << row;
      std::vector<int> cids(k);
      std::vector<float> cw(k);
      cpu::route_top_k(logits.data(), E, k, true, cids.data(), cw.data());
      for (int s = 0; s < k; ++s) {
        EXPECT_EQ(ids[s], cids[s]) << "routing, row " << row << ", slot " << s;
        EXPECT_NEAR(w[s], cw[s], 1e-6 * std::max(1.0f, std::fabs(cw[s]))) << "routing weight, row " << row << ", slot " << s;
      }
      EXPECT_NEAR(w[k], 1.0 / (1.0 + std::exp(-double(logits[E]))), 1e-5) << "shared-expert gate, row " << row;
    }
    ASSERT_EQ(ids[k], E) << "the shared expert rides in the last slot";

    // act = bf16(silu(bf16(gate·y)) · bf16(up·y)) per slot, against double references.
    const std::vector<float> gact = part(all_act, row, int64_t(n_sel) * ffn);
    std::vector<double> ract(size_t(n_sel) * ffn);
    for (int s = 0; s < n_sel; ++s)
      for (int i = 0; i < ffn; ++i) {
        const int64_t r = int64_t(ids[s]) * ffn + i;
        const float g = round_bf16(float(m.gate.dot(r, y.data()))), u = round_bf16(float(m.up.dot(r, y.data())));
        ract[size_t(s) * ffn + i] = round_bf16(cpu::silu(g) * u);
      }
    EXPECT_LT(worst_rel(gact, ract, 0.01 * rms(ract)), 2e-2) << "gate/up + SwiGLU, row " << row;

    // out = bf16(Σ_s w_s · bf16(down_s · act_s)) from the kernel's own act.
    const std::vector<float> gout = part(all_out, row, hidden);
    std::vector<double> rout(hidden);
    for (int r = 0; r < hidden; ++r) {
      float acc = 0.0f;
      for (int s = 0; s < n_sel; ++s)
        acc += w[s] * round_bf16(float(m.down.dot(int64_t(ids[s]) * hidden + r, gact.data() + size_t(s) * ffn)));
      rout[r] = acc;
    }
    EXPECT_LT(worst_rel(gout, rout, 0.01 * rms(rout)), 2e-2) << "down + combine, row " << row;
  }
}

/// A check_moe_block case: E experts, top-k, hidden, ffn, rng `seed`, `rows` rows on
/// `max_blocks` blocks (0: one per SM), through the rows kernel (rows_kernel) or the one-token
/// block. `label` is the case's test name.
struct MoeBlockCase {
  const char* label;
  int E, k, hidden, ffn;
  uint64_t seed;
  int max_blocks, rows;
  bool rows_kernel;

  std::string name() const { return label; }
  friend void PrintTo(const MoeBlockCase& c, std::ostream* os) { *os << c.name(); }
};

/// The MoE block cases: the one-token block at the real shape, the demo shape and two other
/// shapes, each on every SM and on a few blocks; then the rows kernel (RowsKernel*) at 8, 32 and 1
/// rows of the real shape and 5 rows of the demo shape. The DemoShape, OtherShapes and
/// RowsKernelMatchesTheReference pairs and triple were one test each.
const std::vector<MoeBlockCase> kMoeBlockCases = {
    {"RealShapeOnEverySm", 256, 8, 2048, 512, 61, 0, 1, false},
    {"RealShapeOnFewerBlocks", 256, 8, 2048, 512, 62, 118, 1, false},  // 5 gate/up tiles, 2 down tiles on some
    {"DemoShapeOnEverySm", 16, 4, 256, 128, 63, 0, 1, false},
    {"DemoShapeOn3Blocks", 16, 4, 256, 128, 64, 3, 1, false},     // 27 gate/up tiles and 6 down row tiles per block
    {"OtherShapes13Slots", 64, 12, 512, 192, 65, 0, 1, false},    // 13 slots, 3 groups per down row
    {"OtherShapes300Experts", 300, 2, 256, 64, 66, 5, 1, false},  // E > 256: 32 router keys per lane
    {"RowsKernelRealShape8Rows", 256, 8, 2048, 512, 85, 0, 8, true},
    {"RowsKernelRealShape32Rows", 256, 8, 2048, 512, 88, 0, 32, true},
    {"RowsKernelRealShape1Row", 256, 8, 2048, 512, 86, 0, 1, true},
    {"RowsKernelDemoShape5RowsOn3Blocks", 16, 4, 256, 128, 87, 3, 5, true},
};

/// The MoE block case table (kMoeBlockCases) against the fused router kernel and the reference
/// loops.
class CudaMoeBlock : public testing::TestWithParam<MoeBlockCase> {};

TEST_P(CudaMoeBlock, MatchesTheReference) {
  const MoeBlockCase& c = GetParam();
  check_moe_block(c.E, c.k, c.hidden, c.ffn, c.seed, c.max_blocks, c.rows, c.rows_kernel);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaMoeBlock, testing::ValuesIn(kMoeBlockCases), CaseName());

/// What one launch of `rows` rows wrote: per row x_out, normed, logits, ids, weights, act, out
/// (as raw bits, so rows compare exactly).
struct MoeRowsResult {
  std::vector<std::vector<uint32_t>> x_out, normed, logits, weights, act, out;
  std::vector<std::vector<int32_t>> ids;
};

/// Launches the rows kernel (or, rows_kernel false and rows 1, the one-token block) on rows
/// [first, first + rows) of x / branch ([*, hidden] host rows) and downloads every row's outputs.
MoeRowsResult run_moe_rows(MoeBlock& m, const std::vector<float>& x, const std::vector<float>& branch, int first,
                           int rows, int max_blocks, bool rows_kernel = true) {
  const int h = m.hidden, n_sel = m.k + 1;
  auto slice = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin() + int64_t(first) * h, v.begin() + int64_t(first + rows) * h);
  };
  DeviceBuffer dx = upload_bf16(slice(x)), db = upload_bf16(slice(branch));
  DeviceBuffer xo = poisoned(size_t(rows) * h * 2), nm = poisoned(size_t(rows) * h * 2), out = poisoned(size_t(rows) * h * 2);
  const cuda::MoeDecodeArgs a = m.args(dx, db.as<__nv_bfloat16>(), xo, nm, out, nullptr, rows);
  m.barriers.fill_bytes(0);
  launch_moe(a, nullptr, max_blocks, rows_kernel);
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> vx = download_bf16(xo, int64_t(rows) * h), vn = download_bf16(nm, int64_t(rows) * h);
  const std::vector<float> vo = download_bf16(out, int64_t(rows) * h);
  const std::vector<float> vl = download_f32(m.logits, int64_t(rows) * (m.E + 1));
  const std::vector<float> vw = download_f32(m.weights, int64_t(rows) * n_sel);
  const std::vector<int32_t> vi = download_i32(m.ids, rows * n_sel);
  const std::vector<float> va = download_bf16(m.act, int64_t(rows) * n_sel * m.ffn);
  auto row = [](const std::vector<float>& v, int r, int64_t n) {
    return bits_of(std::vector<float>(v.begin() + r * n, v.begin() + (r + 1) * n));
  };
  MoeRowsResult res;
  for (int r = 0; r < rows; ++r) {
    res.x_out.push_back(row(vx, r, h));
    res.normed.push_back(row(vn, r, h));
    res.out.push_back(row(vo, r, h));
    res.logits.push_back(row(vl, r, m.E + 1));
    res.weights.push_back(row(vw, r, n_sel));
    res.act.push_back(row(va, r, int64_t(n_sel) * m.ffn));
    res.ids.emplace_back(vi.begin() + r * n_sel, vi.begin() + (r + 1) * n_sel);
  }
  return res;
}

/// Batch invariance of the rows kernel: every row of launches of 1 … 33, 40, 63 and 64 rows is
/// bit-identical (norm, logits, routing, act, output) to the same row alone through the one-token
/// block (launch_moe_block_decode), so the batched decode gives each row the one-sequence step's
/// bits.
/// Rows 0 and 1 get the same input, so some experts are shared between rows; the others differ.
void check_moe_rows(int E, int k, int hidden, int ffn, uint64_t seed, int max_blocks) {
  std::mt19937_64 rng(seed);
  MoeBlock m(E, k, hidden, ffn, rng);
  constexpr int R = cuda::kMaxMoeRows;
  std::vector<float> x = normal_bf16(int64_t(R) * hidden, rng, 2.0f), branch = normal_bf16(int64_t(R) * hidden, rng, 0.5f);
  std::copy(x.begin(), x.begin() + hidden, x.begin() + hidden);
  std::copy(branch.begin(), branch.begin() + hidden, branch.begin() + hidden);
  std::vector<MoeRowsResult> alone;
  // The one-token block on every SM (a block's tiles then fit its shared memory; its results do
  // not depend on the block count).
  for (int r = 0; r < R; ++r) alone.push_back(run_moe_rows(m, x, branch, r, 1, 0, /*rows_kernel=*/false));
  std::vector<int> counts;
  for (int rows = 1; rows <= 33; ++rows) counts.push_back(rows);
  for (int rows : {40, R - 1, R}) counts.push_back(rows);
  for (int rows : counts) {
    const MoeRowsResult together = run_moe_rows(m, x, branch, 0, rows, max_blocks);
    for (int r = 0; r < rows; ++r) {
      const MoeRowsResult& a = alone[r];
      EXPECT_EQ(together.x_out[r], a.x_out[0]) << rows << " rows, row " << r << ": x_out";
      EXPECT_EQ(together.normed[r], a.normed[0]) << rows << " rows, row " << r << ": normed";
      EXPECT_EQ(together.logits[r], a.logits[0]) << rows << " rows, row " << r << ": logits";
      EXPECT_EQ(together.ids[r], a.ids[0]) << rows << " rows, row " << r << ": ids";
      EXPECT_EQ(together.weights[r], a.weights[0]) << rows << " rows, row " << r << ": weights";
      EXPECT_EQ(together.act[r], a.act[0]) << rows << " rows, row " << r << ": act";
      EXPECT_EQ(together.out[r], a.out[0]) << rows << " rows, row " << r << ": out";
    }
  }
}

TEST(CudaMoeBlock, RowsAreBitIdenticalToTheOneTokenBlock) {
  check_moe_rows(256, 8, 2048, 512, 81, 0);   // the real shape on every SM
  check_moe_rows(256, 8, 2048, 512, 82, 40);  // several gate/up tiles per stage, 4 row tiles per block
  check_moe_rows(16, 4, 256, 128, 83, 0);     // the demo shape: 8 rows × 4 of 16 experts share most
  check_moe_rows(64, 12, 512, 192, 84, 7);    // 13 slots
}

/// The out-projection as the one-token block's first phase (MoeDecodeArgs::out_proj) against
/// launch_quant_gemv followed by the block: the projection (the branch), the norm's outputs, the
/// routing, act and the block's output, all bit for bit. A `cols`-column out-projection on
/// `max_blocks` blocks (0: one per SM; fewer blocks than 16-row tiles: a block reuses its stage).
void check_out_proj_phase(int E, int k, int hidden, int ffn, int cols, uint64_t seed, int max_blocks) {
  std::mt19937_64 rng(seed);
  MoeBlock m(E, k, hidden, ffn, rng);
  RandomQuant wo(hidden, cols, 4, rng);
  DeviceBuffer dx = upload_bf16(normal_bf16(hidden, rng, 2.0f)), core = upload_bf16(normal_bf16(cols, rng, 1.0f));
  struct Result {
    std::vector<uint32_t> branch, x_out, normed, logits, weights, act, out;
    std::vector<int32_t> ids;
  };
  auto run = [&](bool phase) {
    DeviceBuffer y = poisoned(size_t(hidden) * 2), x_out = poisoned(size_t(hidden) * 2), normed = poisoned(size_t(hidden) * 2),
                 out = poisoned(size_t(hidden) * 2);
    // The block's other outputs too, so that the second run cannot pass on the first one's values.
    const int n_sel = k + 1;
    m.logits = poisoned(size_t(E + 1) * 4);
    m.ids = poisoned(size_t(n_sel) * 4);
    m.weights = poisoned(size_t(n_sel) * 4);
    m.act = poisoned(size_t(n_sel) * ffn * 2);
    cuda::MoeDecodeArgs a = m.args(dx, y.as<__nv_bfloat16>(), x_out, normed, out);
    if (phase) a.out_proj = {wo.view(), core.as<__nv_bfloat16>(), y.as<__nv_bfloat16>()};
    else cuda::launch_quant_gemv(wo.view(), core.as<__nv_bfloat16>(), y.as<__nv_bfloat16>(), nullptr, nullptr);
    m.barriers.fill_bytes(0);
    launch_moe(a, nullptr, max_blocks, false);
    CUDA_CHECK(cudaDeviceSynchronize());
    return Result{bits_of(download_bf16(y, hidden)),          bits_of(download_bf16(x_out, hidden)),
                  bits_of(download_bf16(normed, hidden)),     bits_of(download_f32(m.logits, E + 1)),
                  bits_of(download_f32(m.weights, n_sel)),    bits_of(download_bf16(m.act, int64_t(n_sel) * ffn)),
                  bits_of(download_bf16(out, hidden)),        download_i32(m.ids, n_sel)};
  };
  const Result want = run(false), got = run(true);
  const std::string where = std::to_string(hidden) + "x" + std::to_string(cols) + " on " + std::to_string(max_blocks) + " blocks";
  EXPECT_EQ(got.branch, want.branch) << "out-projection, " << where;
  EXPECT_EQ(got.x_out, want.x_out) << "x_out, " << where;
  EXPECT_EQ(got.normed, want.normed) << "normed, " << where;
  EXPECT_EQ(got.logits, want.logits) << "router logits, " << where;
  EXPECT_EQ(got.ids, want.ids) << "routing, " << where;
  EXPECT_EQ(got.weights, want.weights) << "routing weights, " << where;
  EXPECT_EQ(got.act, want.act) << "act, " << where;
  EXPECT_EQ(got.out, want.out) << "output, " << where;
}

TEST(CudaMoeBlock, OutProjectionPhaseGivesTheSeparateGemvBits) {
  // The real shape: one 16-row tile per block. It needs 128 blocks (fewer would need a second
  // down stage: more than an SM holds), so a GPU with fewer SMs (an H100 PCIe has 114) cannot
  // run it; the backend keeps the separate GEMV there.
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms >= 128) check_out_proj_phase(256, 8, 2048, 512, 4096, 91, 0);
  else std::printf("the real shape's case needs 128 SMs; this GPU has %d\n", sms);
  // Fewer blocks than tiles: each block's tiles pass through its one stage in turn. (The real
  // shape on fewer than 128 blocks would need a second down stage too: more than an SM holds.)
  check_out_proj_phase(64, 4, 1024, 256, 2048, 92, 16);  // 4 tiles per block
  check_out_proj_phase(16, 4, 256, 128, 512, 93, 3);     // the demo's hidden: 16 tiles on 3 blocks
}

/// The next layer's input norm as the one-token block's last phase (MoeDecodeArgs::next_norm)
/// followed by launch_staged_row_gemv, against the block followed by launch_add_rmsnorm_gemv on
/// its outputs: the block's output, the next norm's h and y, and the next GEMV's output (with
/// the GDN conv step on its first `conv_channels` rows: its output and window), all bit for bit.
/// A next GEMV of `next_rows` rows; the block on `max_blocks` blocks (0: one per SM).
void check_next_norm_phase(int E, int k, int hidden, int ffn, int64_t next_rows, int conv_channels, uint64_t seed,
                           int max_blocks) {
  std::mt19937_64 rng(seed);
  MoeBlock m(E, k, hidden, ffn, rng);
  RandomQuant wn(next_rows, hidden, 4, rng);
  std::vector<float> g = normal_bf16(hidden, rng, 0.3f);
  for (auto& v : g) v += 1.0f;
  DeviceBuffer next_gain = upload_f32(g), dx = upload_bf16(normal_bf16(hidden, rng, 2.0f)),
               branch = upload_bf16(normal_bf16(hidden, rng, 0.5f));
  DeviceBuffer taps = upload_f32(normal_bf16(int64_t(std::max(conv_channels, 1)) * 4, rng, 0.5f));
  const std::vector<float> window0 = normal_bf16(int64_t(std::max(conv_channels, 1)) * 3, rng, 1.0f);
  struct Result {
    std::vector<uint32_t> out, h, y, proj, conv_out, window;
  };
  auto run = [&](bool phase) {
    DeviceBuffer x_out = poisoned(size_t(hidden) * 2), normed = poisoned(size_t(hidden) * 2), out = poisoned(size_t(hidden) * 2),
                 h = poisoned(size_t(hidden) * 2), y = poisoned(size_t(hidden) * 2), proj = poisoned(size_t(next_rows) * 2),
                 pairs = poisoned(size_t(hidden) * 2), sums = poisoned(size_t(hidden / 64) * 4),
                 conv_out = poisoned(size_t(std::max(conv_channels, 1)) * 2), window = upload_bf16(window0);
    cuda::MoeDecodeArgs a = m.args(dx, branch.as<__nv_bfloat16>(), x_out, normed, out);
    cuda::FusedConv conv;
    if (conv_channels > 0) {
      conv.channels = conv_channels;
      conv.taps = taps.as<float>();
      conv.window = window.as<__nv_bfloat16>();
      conv.out = conv_out.as<__nv_bfloat16>();
    }
    const cuda::StagedRow row{pairs.as<uint32_t>(), sums.as<float>()};
    if (phase) a.next_norm = {next_gain.as<float>(), 1e-6f, h.as<__nv_bfloat16>(), y.as<__nv_bfloat16>(), row};
    m.barriers.fill_bytes(0);
    launch_moe(a, nullptr, max_blocks, false);
    if (phase) {
      cuda::launch_staged_row_gemv(row, wn.view(), proj.as<__nv_bfloat16>(), nullptr, nullptr, conv);
    } else {
      cuda::FusedNorm n;
      n.branch = out.as<__nv_bfloat16>();
      n.gain = next_gain.as<float>();
      n.eps = 1e-6f;
      n.x_out = h.as<__nv_bfloat16>();
      n.normed_out = y.as<__nv_bfloat16>();
      cuda::launch_add_rmsnorm_gemv(n, x_out.as<__nv_bfloat16>(), wn.view(), proj.as<__nv_bfloat16>(), nullptr, nullptr,
                                    conv);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    const int c = std::max(conv_channels, 1);
    return Result{bits_of(download_bf16(out, hidden)),        bits_of(download_bf16(h, hidden)),
                  bits_of(download_bf16(y, hidden)),          bits_of(download_bf16(proj, next_rows)),
                  bits_of(download_bf16(conv_out, conv_channels > 0 ? c : 0)),
                  bits_of(download_bf16(window, int64_t(conv_channels) * 3))};
  };
  const Result want = run(false), got = run(true);
  const std::string where = std::to_string(hidden) + " → " + std::to_string(next_rows) + " rows on " +
                            std::to_string(max_blocks) + " blocks";
  EXPECT_EQ(got.out, want.out) << "the block's output, " << where;
  EXPECT_EQ(got.h, want.h) << "next h, " << where;
  EXPECT_EQ(got.y, want.y) << "next normed row, " << where;
  EXPECT_EQ(got.proj, want.proj) << "next GEMV, " << where;
  EXPECT_EQ(got.conv_out, want.conv_out) << "conv output, " << where;
  EXPECT_EQ(got.window, want.window) << "conv window, " << where;
}

TEST(CudaMoeBlock, NextNormPhaseGivesTheGemvStagingBits) {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // The real shape into a GDN in-projection with its conv step (as the decode runs it); it needs
  // 128 blocks, as in OutProjectionPhaseGivesTheSeparateGemvBits.
  if (sms >= 128) check_next_norm_phase(256, 8, 2048, 512, 12352, 8192, 94, 0);
  else std::printf("the real shape's case needs 128 SMs; this GPU has %d\n", sms);
  check_next_norm_phase(64, 4, 1024, 256, 3000, 0, 95, 16);  // a tail tile of 8 rows
  check_next_norm_phase(16, 4, 512, 128, 1536, 768, 96, 8);
}

TEST(CudaMoeBlock, RefusesWhatItDoesNotSupport) {
  std::mt19937_64 rng(67);
  MoeBlock tiny(8, 2, 128, 64, rng);  // hidden 128: not a multiple of 256
  DeviceBuffer x = upload_bf16(normal_bf16(128, rng, 1.0f)), xo(256), nm(256), out(256);
  const cuda::MoeDecodeArgs a = tiny.args(x, nullptr, xo, nm, out);
  EXPECT_NE(cuda::moe_block_unsupported(a).find("hidden 128"), std::string::npos);
  EXPECT_THROW(cuda::launch_moe_block_decode(a, nullptr), Error);
  EXPECT_NE(cuda::moe_block_rows_unsupported(a).find("hidden 128"), std::string::npos);
  EXPECT_THROW(cuda::launch_moe_block_rows(a, nullptr), Error);
  std::mt19937_64 rng2(68);
  MoeBlock real(16, 4, 256, 128, rng2);
  constexpr int kTooMany = cuda::kMaxMoeRows + 1;
  DeviceBuffer x2 = upload_bf16(normal_bf16(256 * kTooMany, rng2, 1.0f)), xo2(256 * kTooMany * 2),
               nm2(256 * kTooMany * 2), out2(256 * kTooMany * 2);
  // The out-projection phase: the one-token block's only, of a 4-bit [hidden, k·512] matrix, its
  // output the norm's branch.
  {
    RandomQuant wo(256, 512, 4, rng2), narrow(256, 448, 4, rng2), tall(512, 512, 4, rng2);
    DeviceBuffer core = upload_bf16(normal_bf16(512, rng2, 1.0f)), y(256 * 2);
    cuda::MoeDecodeArgs with = real.args(x2, y.as<__nv_bfloat16>(), xo2, nm2, out2);
    with.out_proj = {wo.view(), core.as<__nv_bfloat16>(), y.as<__nv_bfloat16>()};
    EXPECT_EQ(cuda::moe_block_unsupported(with), "");
    EXPECT_NE(cuda::moe_block_rows_unsupported(with).find("out-projection"), std::string::npos);
    for (const RandomQuant* bad : {&narrow, &tall}) {
      cuda::MoeDecodeArgs b = with;
      b.out_proj.w = bad->view();
      EXPECT_NE(cuda::moe_block_unsupported(b).find("out-projection"), std::string::npos);
    }
    cuda::MoeDecodeArgs elsewhere = with;
    elsewhere.out_proj.y = out2.as<__nv_bfloat16>();  // not the branch
    EXPECT_THROW(cuda::launch_moe_block_decode(elsewhere, nullptr), InternalError);
  }
  // The next-norm phase: the one-token block's only; its outputs must not alias the block's.
  {
    DeviceBuffer pairs(256 * 2), sums(4 * 4), h(256 * 2), y(256 * 2);
    cuda::MoeDecodeArgs with = real.args(x2, nullptr, xo2, nm2, out2);
    with.next_norm = {real.gain.as<float>(), 1e-6f, h.as<__nv_bfloat16>(), y.as<__nv_bfloat16>(),
                      {pairs.as<uint32_t>(), sums.as<float>()}};
    EXPECT_EQ(cuda::moe_block_unsupported(with), "");
    EXPECT_NE(cuda::moe_block_rows_unsupported(with).find("next-norm"), std::string::npos);
    cuda::MoeDecodeArgs aliased = with;
    aliased.next_norm.x_out = out2.as<__nv_bfloat16>();
    EXPECT_THROW(cuda::launch_moe_block_decode(aliased, nullptr), InternalError);
    cuda::MoeDecodeArgs no_sums = with;
    no_sums.next_norm.row.sums = nullptr;
    EXPECT_THROW(cuda::launch_moe_block_decode(no_sums, nullptr), InternalError);
  }
  cuda::MoeDecodeArgs two = real.args(x2, nullptr, xo2, nm2, out2, nullptr, 2);
  EXPECT_NE(cuda::moe_block_unsupported(two).find("2 rows"), std::string::npos);  // one token only
  EXPECT_EQ(cuda::moe_block_rows_unsupported(two), "");
  cuda::MoeDecodeArgs too_many = real.args(x2, nullptr, xo2, nm2, out2, nullptr, kTooMany);
  EXPECT_NE(cuda::moe_block_rows_unsupported(too_many).find(std::to_string(kTooMany) + " rows"), std::string::npos);
  cuda::MoeDecodeArgs no_sums = real.args(x2, nullptr, xo2, nm2, out2, nullptr, 2);
  no_sums.act_sums = nullptr;
  EXPECT_THROW(cuda::launch_moe_block_rows(no_sums, nullptr), InternalError);
  cuda::MoeDecodeArgs no_frag = real.args(x2, nullptr, xo2, nm2, out2, nullptr, 2);
  no_frag.normed_frag = nullptr;
  EXPECT_THROW(cuda::launch_moe_block_rows(no_frag, nullptr), InternalError);
  no_frag.normed_frag = real.normed_frag.as<__nv_bfloat16>() + 1;  // not 16-byte aligned
  EXPECT_THROW(cuda::launch_moe_block_rows(no_frag, nullptr), InternalError);
}

/// A stack of fused MoE blocks, each reading the last one's output as the branch of its add
/// (ping-pong buffers), with four counters per block (the rows kernel's three grid barriers and
/// its tile claims, MoeDecodeArgs::tile_claims) zeroed by a memset in front.
struct MoeBlockChain {
  MoeBlock m;
  std::vector<float> x0;
  DeviceBuffer xr[2], out[2], normed, barriers;
  int blocks;
  int rows;                    ///< tokens per launch
  bool rows_kernel;            ///< launch_moe_block_rows (else launch_moe_block_decode, one row)
  int traced = -1;             ///< the block whose launch records MoeDecodeArgs::trace
  uint64_t* trace = nullptr;

  MoeBlockChain(int E, int k, int hidden, int ffn, int blocks_, std::mt19937_64& rng, int rows_ = 1)
      : m(E, k, hidden, ffn, rng), blocks(blocks_), rows(rows_), rows_kernel(rows_ > 1) {
    x0 = normal_bf16(int64_t(rows) * hidden, rng, 2.0f);
    for (auto& b : xr) b = DeviceBuffer(size_t(rows) * hidden * 2);
    for (auto& b : out) b = DeviceBuffer(size_t(rows) * hidden * 2);
    normed = DeviceBuffer(size_t(rows) * hidden * 2);
    barriers = DeviceBuffer(size_t(blocks) * 4 * sizeof(uint32_t));
    reset();
  }
  void reset() {
    std::vector<uint16_t> bits(x0.size());
    for (size_t i = 0; i < x0.size(); ++i) bits[i] = float_to_bf16(x0[i]);
    cuda::upload(xr[0].as<uint16_t>(), bits.data(), bits.size());
    for (auto& b : out) b.fill_bytes(0);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  void enqueue(cudaStream_t stream) {
    CUDA_CHECK(cudaMemsetAsync(barriers.data(), 0, barriers.bytes(), stream));
    for (int l = 0; l < blocks; ++l) {
      cuda::MoeDecodeArgs a = m.args(xr[l % 2], l == 0 ? nullptr : out[(l + 1) % 2].as<__nv_bfloat16>(),
                                     xr[(l + 1) % 2], normed, out[l % 2], barriers.as<uint32_t>() + 4 * l, rows);
      a.tile_claims = barriers.as<uint32_t>() + 4 * l + 3;  // used from moe_tile_claims_from_rows() rows on
      if (l == traced) a.trace = trace;
      if (rows_kernel) cuda::launch_moe_block_rows(a, stream);
      else cuda::launch_moe_block_decode(a, stream);
    }
  }
  std::vector<float> result() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> r = download_bf16(xr[blocks % 2], int64_t(rows) * m.hidden);
    const std::vector<float> o = download_bf16(out[(blocks - 1) % 2], int64_t(rows) * m.hidden);
    r.insert(r.end(), o.begin(), o.end());
    return r;
  }
};

void check_chain(int E, int k, int hidden, int ffn, uint64_t seed, int rows = 1) {
  const PdlSetting keep;
  std::mt19937_64 rng(seed);
  MoeBlockChain chain(E, k, hidden, ffn, 8, rng, rows);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  keep.set(false);
  chain.enqueue(stream);
  const std::vector<uint32_t> want = bits_of(chain.result());
  for (float v : chain.result()) ASSERT_FALSE(std::isnan(v)) << "NaN in the plain chain";
  keep.set(true);
  chain.reset();
  chain.enqueue(stream);
  EXPECT_EQ(bits_of(chain.result()), want) << "eager PDL launches differ from plain launches";
  cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) { chain.enqueue(st); });
  for (int replay = 0; replay < 3; ++replay) {
    chain.reset();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(bits_of(chain.result()), want) << "graph replay " << replay;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaMoeBlock, ChainWithPdlAndGraphReplaysMatchesPlainLaunches) {
  check_chain(256, 8, 2048, 512, 71);
  check_chain(16, 4, 256, 128, 72);
  check_chain(256, 8, 2048, 512, 75, 8);
}

// The rows kernel's split of the routed gate/up tiles by cost (cuda::moe_tile_balance, which
// launches of at least cuda::kMoeTileBalanceFromRows rows take) only moves tiles between blocks:
// 33-, 48- and 64-row chains of 4 layers give the bits of the equal split for every weight, the
// largest giving every tile nearly the same cost.
TEST(CudaMoeBlock, RowsKernelTileBalanceKeepsTheBits) {
  const PdlSetting keep;
  keep.set(true);
  const ScopedSwitch<int> balance(cuda::moe_tile_balance, cuda::set_moe_tile_balance);
  // The cost split is the one without tile claims (claims take their own fixed shares).
  const ScopedSwitch<int> claims(cuda::moe_tile_claims_from_rows, cuda::set_moe_tile_claims_from_rows);
  claims.set(cuda::kMaxMoeRows + 1);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  static_assert(cuda::kMoeTileBalanceFromRows <= 33, "every chain below splits by cost");
  for (int rows : {33, 48, 64}) {
    std::mt19937_64 rng(76);
    MoeBlockChain chain(256, 8, 2048, 512, 4, rng, rows);
    std::vector<uint32_t> want;
    for (int w : {0, 1, 4, 16, 1024}) {
      balance.set(w);
      chain.reset();
      chain.enqueue(stream);
      const std::vector<float> got = chain.result();
      for (float v : got) ASSERT_FALSE(std::isnan(v)) << rows << " rows, balance " << w;
      if (want.empty()) want = bits_of(got);
      else EXPECT_EQ(bits_of(got), want) << rows << " rows, balance " << w;
    }
  }
  EXPECT_THROW(cuda::set_moe_tile_balance(-1), Error);
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// The rows kernel's routing once per row (cuda::moe_route_once_from_rows: one warp of one block
// routes a row, then a third grid barrier) against every block routing every row: the same
// outputs, ids and weights, for 2-, 8-, 33- and 64-row chains of 4 layers.
TEST(CudaMoeBlock, RowsKernelRouteOnceKeepsTheBits) {
  const PdlSetting keep;
  keep.set(true);
  const ScopedSwitch<int> once(cuda::moe_route_once_from_rows, cuda::set_moe_route_once_from_rows);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int rows : {2, 8, 33, 64}) {
    std::mt19937_64 rng(77);
    MoeBlockChain chain(256, 8, 2048, 512, 4, rng, rows);
    chain.rows_kernel = true;
    std::vector<uint32_t> want, want_ids, want_w;
    for (int from : {cuda::kMaxMoeRows + 1, 1}) {  // never, then always
      once.set(from);
      chain.reset();
      chain.m.ids.fill_bytes(0xff);
      chain.m.weights.fill_bytes(0xff);
      chain.enqueue(stream);
      const std::vector<float> got = chain.result();
      for (float v : got) ASSERT_FALSE(std::isnan(v)) << rows << " rows, route once from " << from;
      const int64_t n = int64_t(rows) * 9;  // the last layer's (row, slot) routing
      std::vector<uint32_t> ids(n);
      CUDA_CHECK(cudaMemcpy(ids.data(), chain.m.ids.data(), n * 4, cudaMemcpyDeviceToHost));
      const std::vector<uint32_t> w = bits_of(download_f32(chain.m.weights, n));
      if (want.empty()) {
        want = bits_of(got), want_ids = ids, want_w = w;
      } else {
        EXPECT_EQ(bits_of(got), want) << rows << " rows: outputs";
        EXPECT_EQ(ids, want_ids) << rows << " rows: ids";
        EXPECT_EQ(w, want_w) << rows << " rows: weights";
      }
    }
  }
  EXPECT_THROW(cuda::set_moe_route_once_from_rows(0), Error);
  EXPECT_THROW(cuda::set_moe_route_once_from_rows(cuda::kMaxMoeRows + 2), Error);
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// The rows kernel's quads claiming their routed gate/up tiles as they go (MoeDecodeArgs::
// tile_claims, from cuda::moe_tile_claims_from_rows rows on), all of them or the tail after the
// blocks' equal fixed shares (cuda::moe_tile_claims_fixed_percent), against the blocks' fixed
// shares alone (by count below kMoeTileBalanceFromRows rows, else by cost): the same outputs for
// 2-, 8-, 33- and 64-row chains of 4 layers, every layer a different claim order. The act is
// poisoned before every run, so a tile no quad computes shows as NaN.
TEST(CudaMoeBlock, RowsKernelTileClaimsKeepTheBits) {
  const PdlSetting keep;
  keep.set(true);
  const ScopedSwitch<int> claims(cuda::moe_tile_claims_from_rows, cuda::set_moe_tile_claims_from_rows);
  const ScopedSwitch<int> fixed(cuda::moe_tile_claims_fixed_percent, cuda::set_moe_tile_claims_fixed_percent);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int blocks = 0, dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev));
  struct Split {
    int from, percent;  ///< claims from `from` rows, `percent` of the routed tiles in fixed shares first
  };
  const Split never{cuda::kMaxMoeRows + 1, 0};
  for (int rows : {2, 8, 33, 64}) {
    std::mt19937_64 rng(78);
    MoeBlockChain chain(256, 8, 2048, 512, 4, rng, rows);
    chain.rows_kernel = true;
    std::vector<uint32_t> want;
    for (const Split split : {never, Split{1, 0}, never, Split{1, 75}, Split{1, 100}, Split{1, 0}}) {
      claims.set(split.from);
      fixed.set(split.percent);
      const std::string what = std::to_string(rows) + " rows, claims from " + std::to_string(split.from) + ", " +
                               std::to_string(split.percent) + " % fixed";
      chain.m.act.fill_bytes(0xFF);
      chain.reset();
      chain.enqueue(stream);
      const std::vector<float> got = chain.result();
      for (float v : got) ASSERT_FALSE(std::isnan(v)) << what;
      if (want.empty()) want = bits_of(got);
      else EXPECT_EQ(bits_of(got), want) << what;
      if (split.from > rows) continue;
      // Every routed tile once: the last layer's counter ends past the claimed tail (the routed
      // tiles beyond the blocks' equal fixed shares), by less than one claim per quad of the grid.
      std::vector<uint32_t> counters(size_t(chain.blocks) * 4);
      CUDA_CHECK(cudaMemcpy(counters.data(), chain.barriers.data(), counters.size() * 4, cudaMemcpyDeviceToHost));
      const std::vector<int32_t> ids = download_i32(chain.m.ids, int64_t(rows) * 9);  // the last layer's routing
      std::vector<int> routed(256, 0);
      for (int r = 0; r < rows; ++r)
        for (int slot = 0; slot < 8; ++slot) ++routed.at(size_t(ids[size_t(r) * 9 + slot]));
      int64_t routed_tiles = 0;
      for (int n : routed) routed_tiles += (n + 7) / 8 * (512 / 8);
      const int64_t tail = routed_tiles - routed_tiles * split.percent / 100 / blocks * blocks;
      const int64_t claimed = counters[size_t(chain.blocks - 1) * 4 + 3];
      EXPECT_GE(claimed, tail) << what << ": the last layer's claims";
      EXPECT_LT(claimed, tail + int64_t(blocks) * 4 * 2 + 1) << what << ": the last layer's claims";
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Per-layer time of the decode MoE block, fused vs the three kernels it replaces, as a chain of
// 40 blocks replayed from a CUDA graph with PDL (printed for docs/performance, never asserted).
TEST(CudaTiming, PrintsMoeBlockTimes) {
  const PdlSetting keep;
  keep.set(true);
  std::mt19937_64 rng(73);
  constexpr int kLayers = 40, kReps = 20;
  MoeBlockChain chain(256, 8, 2048, 512, kLayers, rng);
  DeviceBuffer done(4), ids(9 * 4), w(9 * 4);
  done.fill_bytes(0);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto separate = [&](cudaStream_t s) {
    MoeBlock& m = chain.m;
    for (int l = 0; l < kLayers; ++l) {
      cuda::FusedNorm n;
      n.branch = l == 0 ? nullptr : chain.out[(l + 1) % 2].as<__nv_bfloat16>();
      n.gain = m.gain.as<float>();
      n.x_out = chain.xr[(l + 1) % 2].as<__nv_bfloat16>();
      n.normed_out = chain.normed.as<__nv_bfloat16>();
      cuda::launch_add_rmsnorm_router_fused(n, chain.xr[l % 2].as<__nv_bfloat16>(), m.router.view(), m.E, m.k,
                                            m.logits.as<float>(), ids.as<int32_t>(), w.as<float>(), done.as<uint32_t>(), s);
      cuda::launch_expert_gate_up(m.gate.view(), m.up.view(), m.ffn, ids.as<int32_t>(), m.k + 1,
                                  chain.normed.as<__nv_bfloat16>(), 1, m.act.as<__nv_bfloat16>(), s);
      cuda::launch_expert_down_combine(m.down.view(), m.hidden, ids.as<int32_t>(), w.as<float>(), m.k + 1,
                                       m.act.as<__nv_bfloat16>(), 1, chain.out[l % 2].as<__nv_bfloat16>(), s);
    }
  };
  for (bool fused : {false, true}) {
    cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) {
      if (fused) chain.enqueue(st);
      else separate(st);
    });
    std::printf("[timing] moe block x%d graph+PDL, %-14s %8.2f us per layer\n", kLayers,
                fused ? "fused" : "three kernels", graph_replay_us(exec, stream, kReps) / kLayers);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  // The rows kernel over the rows of a batched step.
  for (int rows : {1, 2, 4, 8, 16, 32, 48, 64}) {
    MoeBlockChain rchain(256, 8, 2048, 512, kLayers, rng, rows);
    rchain.rows_kernel = true;
    cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) { rchain.enqueue(st); });
    std::printf("[timing] moe block x%d graph+PDL, rows kernel, %d rows %8.2f us per layer\n", kLayers, rows,
                graph_replay_us(exec, stream, kReps) / kLayers);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  // Settings of one chain compared: one graph per setting, replayed in kRounds rounds that
  // visit every setting in turn, so drift between replays (clocks, L2) spreads over all of them;
  // per setting the median round and the spread of its rounds, µs a layer.
  constexpr int kRounds = 7;
  auto compare = [&](MoeBlockChain& rchain, int n, const std::function<std::string(int)>& set) {
    std::vector<cudaGraphExec_t> execs;
    std::vector<std::string> labels;
    for (int i = 0; i < n; ++i) {
      labels.push_back(set(i));
      execs.push_back(capture_graph(stream, [&](cudaStream_t st) { rchain.enqueue(st); }));
    }
    std::vector<std::vector<double>> us(execs.size());
    for (int round = 0; round < kRounds; ++round)
      for (size_t i = 0; i < execs.size(); ++i) us[i].push_back(graph_replay_us(execs[i], stream, kReps) / kLayers);
    for (size_t i = 0; i < execs.size(); ++i) {
      std::sort(us[i].begin(), us[i].end());
      std::printf("[timing] moe block x%d graph+PDL, rows kernel, %d rows, %-20s median %8.2f us per layer"
                  "  (rounds %.2f … %.2f)\n",
                  kLayers, rchain.rows, labels[i].c_str(), us[i][kRounds / 2], us[i].front(), us[i].back());
      CUDA_CHECK(cudaGraphExecDestroy(execs[i]));
    }
  };
  {  // routing once per row (moe_route_once_from_rows) or in every block
    const ScopedSwitch<int> once(cuda::moe_route_once_from_rows, cuda::set_moe_route_once_from_rows);
    for (int rows : {8, 16, 32, 64}) {
      MoeBlockChain rchain(256, 8, 2048, 512, kLayers, rng, rows);
      rchain.rows_kernel = true;
      compare(rchain, 2, [&](int i) {
        once.set(i == 0 ? cuda::kMaxMoeRows + 1 : 1);
        return std::string(i == 0 ? "every block routes" : "route once");
      });
    }
  }
  {  // the routed tiles claimed by the quads as they go (moe_tile_claims_from_rows), all of them or
     // after fixed shares (moe_tile_claims_fixed_percent), or fixed shares alone
    const ScopedSwitch<int> claims(cuda::moe_tile_claims_from_rows, cuda::set_moe_tile_claims_from_rows);
    const ScopedSwitch<int> fixed(cuda::moe_tile_claims_fixed_percent, cuda::set_moe_tile_claims_fixed_percent);
    for (int rows : {8, 16, 32, 48, 64}) {
      MoeBlockChain rchain(256, 8, 2048, 512, kLayers, rng, rows);
      rchain.rows_kernel = true;
      const int percents[] = {-1, 0, 50, 75, 90};  // -1: fixed shares alone
      compare(rchain, static_cast<int>(std::size(percents)), [&](int i) {
        claims.set(percents[i] < 0 ? cuda::kMaxMoeRows + 1 : 1);
        fixed.set(std::max(percents[i], 0));
        return percents[i] < 0 ? std::string("fixed shares") : "tiles claimed after " + std::to_string(percents[i]) + " % fixed";
      });
    }
  }
  // The routed tiles split by cost (moe_tile_balance w: a tile costs w + its live columns; 0:
  // equal tile counts), the same chain for every w; launches of fewer than
  // kMoeTileBalanceFromRows rows split by count. Without tile claims, which take their own shares.
  const ScopedSwitch<int> balance(cuda::moe_tile_balance, cuda::set_moe_tile_balance);
  const ScopedSwitch<int> no_claims(cuda::moe_tile_claims_from_rows, cuda::set_moe_tile_claims_from_rows);
  no_claims.set(cuda::kMaxMoeRows + 1);
  const int weights[] = {0, 8, 16};
  for (int rows : {48, 64}) {
    MoeBlockChain rchain(256, 8, 2048, 512, kLayers, rng, rows);
    compare(rchain, static_cast<int>(std::size(weights)), [&](int i) {
      balance.set(weights[i]);
      return "tile balance " + std::to_string(weights[i]);
    });
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Per-layer time of the out-projection (4,096 → 2,048) and the one-token MoE block, as a GEMV
// followed by the block or as the block's first phase (MoeDecodeArgs::out_proj): chains of 40
// layers replayed from a CUDA graph with PDL, the out-projection's weights rotating over enough
// copies that they come from HBM. Asserts that both chains give the same bits; the times are
// printed, never asserted.
TEST(CudaTiming, PrintsMoeOutProjectionTimes) {
  const PdlSetting keep;
  keep.set(true);
  std::mt19937_64 rng(94);
  constexpr int kLayers = 40, kReps = 20, kCopies = 24, kCols = 4096;
  MoeBlockChain chain(256, 8, 2048, 512, kLayers, rng);
  std::vector<std::unique_ptr<RandomQuant>> wo;
  for (int c = 0; c < kCopies; ++c) wo.push_back(std::make_unique<RandomQuant>(2048, kCols, 4, rng));
  DeviceBuffer core = upload_bf16(normal_bf16(kCols, rng, 1.0f)), y(2048 * 2), barriers(size_t(kLayers) * 3 * 4);
  auto enqueue = [&](cudaStream_t s, bool phase) {
    CUDA_CHECK(cudaMemsetAsync(barriers.data(), 0, barriers.bytes(), s));
    for (int l = 0; l < kLayers; ++l) {
      cuda::MoeDecodeArgs a = chain.m.args(chain.xr[l % 2], y.as<__nv_bfloat16>(), chain.xr[(l + 1) % 2], chain.normed,
                                           chain.out[l % 2], barriers.as<uint32_t>() + 3 * l);
      const cuda::DeviceQuant w = wo[l % kCopies]->view();
      if (phase) a.out_proj = {w, core.as<__nv_bfloat16>(), y.as<__nv_bfloat16>()};
      else cuda::launch_quant_gemv(w, core.as<__nv_bfloat16>(), y.as<__nv_bfloat16>(), nullptr, s);
      cuda::launch_moe_block_decode(a, s);
    }
  };
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<uint32_t> want;
  for (bool phase : {false, true}) {
    cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) { enqueue(st, phase); });
    chain.reset();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint32_t> got = bits_of(chain.result());
    if (want.empty()) want = got;
    else EXPECT_EQ(got, want) << "the chain with the out-projection phase differs from GEMV + block";
    std::printf("[timing] out-projection + moe block x%d graph+PDL, %-22s %8.2f us per layer\n", kLayers,
                phase ? "phase of the block" : "GEMV, then the block", graph_replay_us(exec, stream, kReps) / kLayers);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Where one fused MoE block's time goes, for 1, 8, 32 and 64 rows: the %globaltimer phase stamps of
// every block of the last layer of the 40-layer graph chain (whose routing stays in the chain's
// ids buffer), relative to the first block's entry; per phase the earliest, median and latest
// block (printed, never asserted).
void print_moe_phases(int rows, bool claims = false, int fixed_percent = 0, bool route_in_every_block = false) {
  const PdlSetting keep;
  keep.set(true);
  const ScopedSwitch<int> once_switch(cuda::moe_route_once_from_rows, cuda::set_moe_route_once_from_rows);
  if (route_in_every_block) once_switch.set(cuda::kMaxMoeRows + 1);
  const ScopedSwitch<int> claim_switch(cuda::moe_tile_claims_from_rows, cuda::set_moe_tile_claims_from_rows);
  claim_switch.set(claims ? 1 : cuda::kMaxMoeRows + 1);
  const ScopedSwitch<int> fixed_switch(cuda::moe_tile_claims_fixed_percent, cuda::set_moe_tile_claims_fixed_percent);
  fixed_switch.set(fixed_percent);
  std::mt19937_64 rng(74);
  MoeBlockChain chain(256, 8, 2048, 512, 40, rng, rows);
  int blocks = 0, dev = 0;  // the kernel runs one block per SM
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev));
  constexpr int S = cuda::kMoeTraceSlots;
  DeviceBuffer trace(size_t(blocks) * S * 8);
  trace.fill_bytes(0);
  chain.traced = chain.blocks - 1;
  chain.trace = trace.as<uint64_t>();
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = capture_graph(stream, [&](cudaStream_t st) { chain.enqueue(st); });
  for (int i = 0; i < 4; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint64_t> t(size_t(blocks) * S);
  cuda::download(t.data(), trace.as<uint64_t>(), t.size());
  auto at = [&](int b, int p) { return t[size_t(b) * S + p]; };
  uint64_t t0 = UINT64_MAX;
  for (int b = 0; b < blocks; ++b) t0 = std::min(t0, at(b, 0));
  // The rows kernel norms and computes the router logits in one phase (stamps 2 and 3), and
  // stamp 10 follows its act group sums.
  // Stamps 12 and 13 detail the rows kernel's routing (kMoeTraceRouted, kMoeTraceIds); a
  // point that no block stamped (0) is left out.
  static const char* kPhase[cuda::kMoeTracePoints] = {"entry",   "PDL wait", "norm",       "router", "barrier 1",
                                                     "routing", "requests", "gate/up",    "SwiGLU", "barrier 2",
                                                     "act staged", "down", "rows routed", "ids read"};
  const std::string how = std::string(claims ? " (tiles claimed after " + std::to_string(fixed_percent) + " % fixed)" : "") +
                          (route_in_every_block ? " (every block routes)" : "");
  for (int p : {0, 1, 2, 3, 4, cuda::kMoeTraceRouted, cuda::kMoeTraceIds, 5, 6, 7, 8, 9, 10, 11}) {
    std::vector<double> us;
    for (int b = 0; b < blocks; ++b)
      if (at(b, p) != 0) us.push_back((at(b, p) - t0) / 1000.0);
    if (us.empty()) continue;
    std::sort(us.begin(), us.end());
    std::printf("[timing] moe block %d rows%s, phase %-11s  first %6.2f  median %6.2f  last %6.2f us\n", rows,
                how.c_str(), kPhase[p], us.front(), us[us.size() / 2], us.back());
  }
  // The gate/up phase's slowest blocks (from its requests to its last tile): the tail. The rows
  // kernel also says what each block worked on (kMoeTraceWork): its SM, its gate/up tiles (the
  // shared expert's among them) and the column blocks its routed tiles span (ffn / 8 tiles each),
  // so that a slow block can be told apart by its SM or by its work.
  std::vector<std::pair<double, int>> gate_up;
  for (int b = 0; b < blocks; ++b) gate_up.emplace_back((at(b, 7) - at(b, 6)) / 1000.0, b);
  std::sort(gate_up.rbegin(), gate_up.rend());
  std::printf("[timing] moe block %d rows, gate/up per block: median %.2f us, slowest", rows, gate_up[gate_up.size() / 2].first);
  for (int i = 0; i < 6; ++i) std::printf(" b%d %.2f", gate_up[i].second, gate_up[i].first);
  std::printf("\n");
  if (chain.rows_kernel && !claims) {  // (claimed tiles are not listed per block)
    const int tiles_per_item = chain.m.ffn / 8;
    // The live columns of every column block (the rows routed to its expert, ≤ 8 a block), in the
    // kernel's order: the shared expert's blocks, then the routed experts' in ascending id. A
    // tile's B fragments load one activation row per live column, so a block whose tiles sit in
    // full column blocks loads more than one with the same tile count.
    const int n_sel = chain.m.k + 1;
    const std::vector<int32_t> ids = download_i32(chain.m.ids, int64_t(rows) * n_sel);
    std::vector<int> live, routed_rows(size_t(chain.m.E), 0);
    auto add_blocks = [&](int n) {
      for (int c = 0; c < n; c += 8) live.push_back(std::min(8, n - c));
    };
    add_blocks(rows);
    for (int r = 0; r < rows; ++r)
      for (int s = 0; s < chain.m.k; ++s) ++routed_rows.at(size_t(ids[size_t(r) * n_sel + s]));
    for (int n : routed_rows)
      if (n > 0) add_blocks(n);
    auto live_of_tile = [&](int j) { return size_t(j / tiles_per_item) < live.size() ? live[size_t(j / tiles_per_item)] : 0; };
    auto work = [&](const char* what, int i) {
      const auto [us, b] = gate_up[i];
      const uint64_t w = at(b, cuda::kMoeTraceWork);
      const int sm = int(w >> 48), tiles = int(w >> 32 & 0xffff), shared = int(w >> 16 & 0xffff), first = int(w & 0xffff);
      const int routed = tiles - shared;
      int live_sum = 0;
      for (int s = 0; s < shared; ++s) live_sum += live_of_tile(b + s * blocks);
      for (int j = first; j < first + routed; ++j) live_sum += live_of_tile(j);
      std::printf("[timing] moe block %d rows, %-7s b%-3d %7.2f us  SM %3d  tiles %3d (shared %d)  column blocks %d … %d"
                  "  live columns %d (%.2f a tile)\n",
                  rows, what, b, us, sm, tiles, shared, first / tiles_per_item,
                  routed > 0 ? (first + routed - 1) / tiles_per_item : first / tiles_per_item, live_sum,
                  tiles > 0 ? double(live_sum) / tiles : 0.0);
    };
    for (int i = 0; i < 6; ++i) work("slowest", i);
    work("median", blocks / 2);
    for (int i = blocks - 3; i < blocks; ++i) work("fastest", i);
    // Over every block: the least-squares line gate/up µs = a + b·tiles + c·live columns, so the
    // cost of a live column against a tile can be read off (a block split by both would balance).
    double s[3][3] = {}, y[3] = {};
    for (const auto& [us, b] : gate_up) {
      const uint64_t w = at(b, cuda::kMoeTraceWork);
      const int tiles = int(w >> 32 & 0xffff), shared = int(w >> 16 & 0xffff), first = int(w & 0xffff);
      int live_sum = 0;
      for (int i = 0; i < shared; ++i) live_sum += live_of_tile(b + i * blocks);
      for (int j = first; j < first + tiles - shared; ++j) live_sum += live_of_tile(j);
      const double v[3] = {1.0, double(tiles), double(live_sum)};
      for (int r = 0; r < 3; ++r) {
        y[r] += v[r] * us;
        for (int c = 0; c < 3; ++c) s[r][c] += v[r] * v[c];
      }
    }
    // Gaussian elimination on the 3×3 normal equations (printed only; a singular system prints NaN).
    for (int p = 0; p < 3; ++p)
      for (int r = p + 1; r < 3; ++r) {
        const double f = s[r][p] / s[p][p];
        for (int c = p; c < 3; ++c) s[r][c] -= f * s[p][c];
        y[r] -= f * y[p];
      }
    double coef[3];
    for (int r = 2; r >= 0; --r) {
      double acc = y[r];
      for (int c = r + 1; c < 3; ++c) acc -= s[r][c] * coef[c];
      coef[r] = acc / s[r][r];
    }
    std::printf("[timing] moe block %d rows, gate/up per block ≈ %.2f + %.3f·tiles + %.3f·live columns us (%zu column blocks, "
                "%zu of them full)\n",
                rows, coef[0], coef[1], coef[2], live.size(),
                size_t(std::count(live.begin(), live.end(), 8)));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaTiming, PrintsMoeBlockPhases) {
  print_moe_phases(1);
  print_moe_phases(8);
  print_moe_phases(32);
  print_moe_phases(64);
  print_moe_phases(32, true);
  print_moe_phases(64, true);
  print_moe_phases(32, true, 75);
  print_moe_phases(64, true, 75);
  print_moe_phases(8, false, 0, true);
  print_moe_phases(32, false, 0, true);
}

}  // namespace
}  // namespace lily::test
