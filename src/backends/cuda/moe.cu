// MoE block kernels (docs/model.md §3.5, §4.3 item 5): router top-k with renormalised
// softmax weights, fused gate/up + SwiGLU over the selected experts (the shared expert rides
// along as expert n_experts), and the down projection fused with the weighted combine.
#include <cfloat>
#include <climits>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/quant_dot.cuh"
#include "backends/cuda/router_topk.cuh"

namespace lily::cuda {
namespace {

/// One warp per token row. logits [m, E+1]; ids/weights [m, k+1].
__global__ void router_topk_kernel(const float* __restrict__ logits, int E, int k, int32_t* __restrict__ ids,
                                   float* __restrict__ weights) {
  pdl_prologue();
  __shared__ RouteScratch rs;
  const int t = blockIdx.x;
  const float* row = logits + static_cast<int64_t>(t) * routed_plus_shared_experts(E);
  for (int e = threadIdx.x; e <= E; e += kWarp) rs.logits[e] = row[e];
  __syncwarp();
  route_token_warp(rs, E, k, ids + static_cast<int64_t>(t) * routed_plus_shared_slots(k),
                   weights + static_cast<int64_t>(t) * routed_plus_shared_slots(k));
}

/// Floats per staged activation row in the down kernel, rounded up to 16 bytes so that every
/// slot's float4 reads stay aligned.
__host__ __device__ inline int slot_stride_floats(int ffn) { return ((ffn / kGroup) * (kGroupStride + 1) + 3) & ~3; }

constexpr int kMoeThreads = 256;
constexpr int kMoeWarps = kMoeThreads / kWarp;

/// grid (row blocks, n_sel, m): rows i of expert ids[t, k]; writes act[t, k, i]. The expert id
/// and the lane's first gate/up groups are loaded before the activation row is staged, so the
/// weight fetch overlaps the staging. Per row: rows_partial's arithmetic (groups g = lane_in,
/// lane_in + L, … accumulated in order from 0).
template <int BITS>
__global__ void __launch_bounds__(kMoeThreads, 3) expert_gate_up_kernel(DeviceQuant gate, DeviceQuant up, int ffn,
                                                                     const int32_t* __restrict__ ids, int n_sel,
                                                                     const bf16* __restrict__ x, bf16* __restrict__ act) {
  constexpr int kVecs = kGroupVecs<BITS>;
  pdl_prologue();
  extern __shared__ float smem[];
  const int groups = gate.cols / kGroup;
  float* xs = smem;
  float* xsum = smem + groups * kGroupStride;
  const int t = blockIdx.z, slot = blockIdx.y;
  const int64_t e = ids[static_cast<int64_t>(t) * n_sel + slot];
  const int L = lanes_per_row(groups), RW = kWarp / L;
  const int lane = threadIdx.x % kWarp, lane_row = lane / L, lane_in = lane % L;
  const int rows_per_block = kMoeWarps * RW;
  const int i = blockIdx.x * rows_per_block + (threadIdx.x / kWarp) * RW + lane_row;
  const bool valid = i < ffn;
  const int64_t r = valid && lane_in < groups ? e * ffn + i : -1;
  uint4 qg[kVecs], qu[kVecs];
  float sg = 0.0f, bg = 0.0f, su = 0.0f, bu = 0.0f;
  load_group<BITS>(gate, r, lane_in, qg, sg, bg);
  load_group<BITS>(up, r, lane_in, qu, su, bu);
  stage_row(x + static_cast<int64_t>(t) * gate.cols, gate.cols, xs, xsum);
  float ga = 0.0f, ua = 0.0f;
  if (r >= 0) {
    ga += sg * group_qdot_regs<BITS>(qg, xs + lane_in * kGroupStride) + bg * xsum[lane_in];
    ua += su * group_qdot_regs<BITS>(qu, xs + lane_in * kGroupStride) + bu * xsum[lane_in];
    for (int g = lane_in + L; g < groups; g += L) {
      load_group<BITS>(gate, r, g, qg, sg, bg);
      load_group<BITS>(up, r, g, qu, su, bu);
      ga += sg * group_qdot_regs<BITS>(qg, xs + g * kGroupStride) + bg * xsum[g];
      ua += su * group_qdot_regs<BITS>(qu, xs + g * kGroupStride) + bu * xsum[g];
    }
  }
  const float gv = round_bf16(group_sum(ga, L));
  const float uv = round_bf16(group_sum(ua, L));
  if (valid && lane_in == 0)
    act[(static_cast<int64_t>(t) * n_sel + slot) * ffn + i] = to_bf16(silu(gv) * uv);
}

/// The down kernel's block: kDownRowWarps warps over output rows (4 rows each at ffn 512) times
/// kDownSlotWarps warps over the selected experts, so that the 9 slots' weight streams of a row
/// run in 3 warps at once instead of one after the other in a single warp (which left 4 warps
/// per SM at 190 registers issuing one dependent instruction every 6–7 cycles).
constexpr int kDownRowWarps = 4;
constexpr int kDownSlotWarps = 3;
constexpr int kDownThreads = kWarp * kDownRowWarps * kDownSlotWarps;  // 384

/// Shared-memory floats of the down kernel: n_sel staged activation rows, then one partial
/// result per (block row, slot).
__host__ __device__ inline int64_t down_smem_floats(int ffn, int n_sel, int rows_per_block) {
  return static_cast<int64_t>(slot_stride_floats(ffn)) * n_sel + static_cast<int64_t>(rows_per_block) * n_sel;
}

/// grid (row blocks, m): output rows r of token t. All slots' activation rows are staged in one
/// pass; warp (row warp, slot warp j) computes slots j, j + 3, … of its rows in chunks whose
/// weight loads are all issued before the first is used (the first chunk's before the staging),
/// d_s = bf16(W_down[e_s] act_s) per (row, slot), rows_partial's arithmetic; then one thread per
/// row combines them in slot order (the shared expert, slot n_sel − 1, last):
/// out = bf16(Σ_s w_s · d_s), fp32, the same operations in the same order as a single warp.
template <int BITS>
__global__ void __launch_bounds__(kDownThreads) expert_down_combine_kernel(DeviceQuant down, int hidden,
                                                                           const int32_t* __restrict__ ids,
                                                                           const float* __restrict__ weights, int n_sel,
                                                                           const bf16* __restrict__ act,
                                                                           bf16* __restrict__ out) {
  constexpr int kInFlight = BITS == 4 ? 3 : 2;  // slots per chunk: 3 chunks of 3 = top-8 + shared
  constexpr int kVecs = kGroupVecs<BITS>;
  pdl_prologue();
  extern __shared__ float smem[];
  const int ffn = down.cols, groups = ffn / kGroup;
  const int t = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int row_warp = warp % kDownRowWarps, slot_warp = warp / kDownRowWarps;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  const int lane_row = lane / L, lane_in = lane % L;
  const int rows_per_block = kDownRowWarps * RW;
  const int r_local = row_warp * RW + lane_row;
  const int r = blockIdx.x * rows_per_block + r_local;
  const bool valid = r < hidden;
  const int32_t* tok_ids = ids + static_cast<int64_t>(t) * n_sel;
  const float* tok_w = weights + static_cast<int64_t>(t) * n_sel;
  // Slot of chunk c, entry j for this warp (≥ n_sel: none).
  auto slot_of = [&](int c, int j) { return slot_warp + kDownSlotWarps * (c * kInFlight + j); };
  auto row_of = [&](int s) {
    return (valid && s < n_sel && lane_in < groups) ? static_cast<int64_t>(tok_ids[s]) * hidden + r : int64_t{-1};
  };
  // The first chunk's rows and this lane's first group of each, fetched before the staging.
  int64_t row[kInFlight];
  uint4 q[kInFlight][kVecs];
  float sc[kInFlight], bi[kInFlight];
#pragma unroll
  for (int j = 0; j < kInFlight; ++j) {
    row[j] = row_of(slot_of(0, j));
    load_group<BITS>(down, row[j], lane_in, q[j], sc[j], bi[j]);
  }
  // Slot s: staged fp32 row at smem + s·per_slot (group g at g·kGroupStride), group sums after it.
  const int per_slot = slot_stride_floats(ffn);
  float* partial = smem + static_cast<int64_t>(per_slot) * n_sel;  // [rows_per_block][n_sel]
  const bf16* a = act + static_cast<int64_t>(t) * n_sel * ffn;
  // 16-byte loads (8 bf16), kStageBatch of them in flight per thread before any store; the 8
  // threads holding one 64-group (consecutive chunks, aligned lanes) add its sum by shuffles.
  const int chunks = n_sel * ffn / 8;  // a multiple of 8: ffn is a multiple of 64
  const uint4* a8 = reinterpret_cast<const uint4*>(a);
  for (int i0 = threadIdx.x; i0 - lane < chunks; i0 += kStageBatch * kDownThreads) {  // warp-uniform
    uint4 v[kStageBatch];
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {
      const int idx = i0 + i * kDownThreads;
      if (idx < chunks) v[i] = a8[idx];
    }
#pragma unroll
    for (int i = 0; i < kStageBatch; ++i) {
      const int idx = i0 + i * kDownThreads;
      float part = 0.0f;
      const int s = idx * 8 / ffn, c = idx * 8 % ffn;
      if (idx < chunks) {
        const float4 lo = bf16x4_to_f32(v[i].x, v[i].y), hi = bf16x4_to_f32(v[i].z, v[i].w);
        float4* dst = reinterpret_cast<float4*>(smem + s * per_slot + (c / kGroup) * kGroupStride + c % kGroup);
        dst[0] = lo;
        dst[1] = hi;
        part = ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
      }
      part = group_sum(part, 8);  // every lane takes part (idx ≥ chunks adds 0)
      if (idx < chunks && lane % 8 == 0) smem[s * per_slot + groups * kGroupStride + c / kGroup] = part;
    }
  }
  __syncthreads();

  for (int c = 0; slot_of(c, 0) < n_sel; ++c) {  // warp-uniform
    float d[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      if (c > 0) row[j] = row_of(slot_of(c, j));
      d[j] = 0.0f;
    }
    for (int g = lane_in; g < groups; g += L) {
      if (c > 0 || g != lane_in) {  // chunk 0's first group is already in registers
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) load_group<BITS>(down, row[j], g, q[j], sc[j], bi[j]);  // all loads first ...
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {  // ... then the arithmetic (as rows_partial)
        if (row[j] < 0) continue;
        const float* xs = smem + slot_of(c, j) * per_slot;
        d[j] += sc[j] * group_qdot_regs<BITS>(q[j], xs + g * kGroupStride) + bi[j] * xs[groups * kGroupStride + g];
      }
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int s = slot_of(c, j);
      if (s >= n_sel) break;  // uniform over the warp
      const float dv = round_bf16(group_sum(d[j], L));
      if (lane_in == 0) partial[r_local * n_sel + s] = dv;
    }
  }
  __syncthreads();
  if (slot_warp == 0 && lane_in == 0 && valid) {
    float acc = 0.0f;
    for (int s = 0; s < n_sel; ++s) acc += tok_w[s] * partial[r_local * n_sel + s];
    out[static_cast<int64_t>(t) * hidden + r] = to_bf16(acc);
  }
}

void check_expert_matrix(const DeviceQuant& w, const char* what) {
  if ((w.bits != 4 && w.bits != 8) || w.cols % kGroup != 0 || w.cols <= 0 || w.cols > kMaxGemvCols)
    throw ::lily::Error(std::string(what) + ": unsupported expert matrix (bits " + std::to_string(w.bits) +
                        ", cols " + std::to_string(w.cols) + ")");
}

}  // namespace

void launch_router_topk(const float* logits, int m, int n_experts, int top_k, int32_t* ids, float* weights,
                        cudaStream_t stream) {
  if (n_experts < 1 || n_experts > kMaxExperts || top_k < 1 || top_k > kMaxTopK || top_k > n_experts || m <= 0)
    throw ::lily::Error("MoE router: CUDA kernel supports ≤ " + std::to_string(kMaxExperts) + " experts and top-k ≤ " +
                        std::to_string(kMaxTopK) + "; got " + std::to_string(n_experts) + " experts, top-k " +
                        std::to_string(top_k));
  launch_pdl(router_topk_kernel, dim3(m), dim3(kWarp), 0, stream, logits, n_experts, top_k, ids, weights);
}

void launch_expert_gate_up(const DeviceQuant& gate, const DeviceQuant& up, int ffn, const int32_t* ids, int n_sel,
                           const bf16* x, int m, bf16* act, cudaStream_t stream) {
  check_expert_matrix(gate, "expert gate_proj");
  check_expert_matrix(up, "expert up_proj");
  if (gate.bits != up.bits || gate.cols != up.cols || m <= 0 || n_sel <= 0 || ffn <= 0)
    throw ::lily::InternalError("launch_expert_gate_up: mismatched gate/up matrices or empty launch");
  const int L = lanes_per_row(gate.groups_per_row());
  const int rows_per_block = kMoeWarps * (kWarp / L);
  const dim3 grid(static_cast<unsigned>(ceil_div(ffn, rows_per_block)), n_sel, m);
  const size_t smem = staged_row_bytes(gate.cols);
  launch_pdl(gate.bits == 4 ? expert_gate_up_kernel<4> : expert_gate_up_kernel<8>, grid, dim3(kMoeThreads), smem, stream,
             gate, up, ffn, ids, n_sel, x, act);
}

void launch_expert_down_combine(const DeviceQuant& down, int hidden, const int32_t* ids, const float* weights,
                                int n_sel, const bf16* act, int m, bf16* out, cudaStream_t stream) {
  check_expert_matrix(down, "expert down_proj");
  const int L = lanes_per_row(down.groups_per_row());
  const int rows_per_block = kDownRowWarps * (kWarp / L);
  const size_t smem = static_cast<size_t>(down_smem_floats(down.cols, n_sel, rows_per_block)) * sizeof(float);
  if (smem > kDefaultSmemBytes || m <= 0 || n_sel <= 0 || hidden <= 0)
    throw ::lily::Error("expert down_proj: " + std::to_string(n_sel) + " experts × ffn " + std::to_string(down.cols) +
                        " exceed the kernel's shared-memory staging");
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, rows_per_block)), m);
  launch_pdl(down.bits == 4 ? expert_down_combine_kernel<4> : expert_down_combine_kernel<8>, grid, dim3(kDownThreads),
             smem, stream, down, hidden, ids, weights, n_sel, act, out);
}

}  // namespace lily::cuda
