// MLX-affine GEMV (4- and 8-bit) and the embedding gather (reference/model.md §3.1, §4.2).
// Layout: the checkpoint's own (codes U32 row-major, bf16 scales/biases per 64-group), so
// fused projections are plain row concatenations. One warp covers 32/L rows at a time (L lanes
// per row, each lane one 64-group per step); each lane issues the loads of 4 rows before using
// them, for memory-level parallelism. The grid is one wave of resident blocks; each warp walks
// chunks of contiguous rows and asks for the chunk two steps ahead in L2 (bulk prefetch), the
// first two before it waits for its predecessor.
#include <algorithm>
#include <string>

#include "backends/cuda/gdn_conv.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/quant_dot.cuh"

namespace lily::cuda {
namespace {

constexpr int kGemvThreads = 256;
constexpr int kRowsUnroll = 4;  // rows per lane-group per step when there are many rows
constexpr int kMaxCols = 8192;

template <class OutT>
__device__ __forceinline__ void store_out(OutT* y, int64_t i, float v);
template <>
__device__ __forceinline__ void store_out<float>(float* y, int64_t i, float v) { y[i] = v; }
template <>
__device__ __forceinline__ void store_out<bf16>(bf16* y, int64_t i, float v) { y[i] = to_bf16(v); }

/// grid (blocks, m); x [m, cols]; y [m, rows]. With norm.gain non-null (m = 1), x goes through
/// the add + RMSNorm of `norm` first (stage_norm_row); with conv.channels > 0 (m = 1), rows below
/// it also run the GDN conv step (FusedConv), whose window and taps are loaded before the dot.
template <int BITS, int U, class OutT>
__global__ void __launch_bounds__(kGemvThreads, 3) quant_gemv_kernel(DeviceQuant w, const bf16* __restrict__ x,
                                                                  OutT* __restrict__ y, FusedNorm norm,
                                                                  FusedConv conv) {
  extern __shared__ float smem[];
  const int groups = w.cols / kGroup;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  const int lane = threadIdx.x % kWarp, lane_row = lane / L, lane_in = lane % L;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * (kGemvThreads / kWarp) + threadIdx.x / kWarp;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * (kGemvThreads / kWarp);
  const int64_t step = n_warps * RW * U;
  // Read-only weights: each warp's first two row chunks (RW·U contiguous rows each) go to L2
  // before waiting for the predecessor, so the weight stream overlaps its tail (launch.cuh);
  // inside the loop, the chunk two steps ahead.
  const int64_t chunk = static_cast<int64_t>(RW) * U;
  if (blockIdx.y == 0 && lane == 0) {
    prefetch_rows_l2(w, warp_id * chunk, chunk);
    prefetch_rows_l2(w, warp_id * chunk + step, chunk);
  }
  pdl_prologue();
  float* xs = smem;
  float* xsum = smem + groups * kGroupStride;
  const int t = blockIdx.y;
  if (norm.gain) stage_norm_row(x, norm, w.cols, blockIdx.x == 0, xs, xsum);
  else stage_row(x + static_cast<int64_t>(t) * w.cols, w.cols, xs, xsum);
  for (int64_t base = warp_id * chunk; base < w.rows; base += step) {
    if (blockIdx.y == 0 && lane == 0) prefetch_rows_l2(w, base + 2 * step, chunk);
    int64_t row[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t r = base + j * RW + lane_row;
      row[j] = r < w.rows ? r : -1;
    }
    bf16 win[U][3];
    float taps[U][kGdnConvK];
    if (conv.channels > 0 && lane_in == 0) {  // conv inputs do not depend on the dot: load them first
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (row[j] < 0 || row[j] >= conv.channels) continue;
#pragma unroll
        for (int i = 0; i < 3; ++i) win[j][i] = conv.window[row[j] * 3 + i];
#pragma unroll
        for (int i = 0; i < kGdnConvK; ++i) taps[j][i] = conv.taps[row[j] * kGdnConvK + i];
      }
    }
    float acc[U];
    rows_partial<BITS, U>(w, row, xs, xsum, lane_in, L, acc);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float v = group_sum(acc[j], L);
      if (row[j] >= 0 && lane_in == 0) {
        store_out(y, static_cast<int64_t>(t) * w.rows + row[j], v);
        if (row[j] < conv.channels) {  // x = the stored bf16 value, as gdn_conv_decode reads it
          const bf16 xb = to_bf16(v);
          bf16* wr = conv.window + row[j] * 3;
          conv.out[row[j]] = conv_decode_value(win[j][0], win[j][1], win[j][2], xb, taps[j]);
          wr[0] = win[j][1];
          wr[1] = win[j][2];
          wr[2] = xb;
        }
      }
    }
  }
}

template <int BITS, class OutT>
void gemv_dispatch(const DeviceQuant& w, const bf16* x, int m, OutT* y, cudaStream_t stream,
                   const FusedNorm& norm = FusedNorm{}, const FusedConv& conv = FusedConv{}) {
  const int groups = w.cols / kGroup;
  const int L = lanes_per_row(groups), RW = kWarp / L;
  // Few rows (router, small projections): one row per lane-group, for more warps in flight.
  // Many rows: 4 rows per lane-group step, for more loads in flight per warp. Same arithmetic.
  const int64_t warps_u4 = ceil_div(w.rows, static_cast<int64_t>(RW) * kRowsUnroll);
  const bool few_rows = ceil_div(warps_u4, kGemvThreads / kWarp) < 2 * sm_count();
  const int U = few_rows ? 1 : kRowsUnroll;
  const int64_t warps_needed = ceil_div(w.rows, static_cast<int64_t>(RW) * U);
  const int64_t blocks_needed = ceil_div(warps_needed, kGemvThreads / kWarp);
  const size_t smem = staged_row_bytes(w.cols);
  // One wave: as many blocks as can be resident at once (each warp then loops over row chunks,
  // prefetching ahead), so no block waits for a second wave to start its weight stream.
  auto kernel = few_rows ? quant_gemv_kernel<BITS, 1, OutT> : quant_gemv_kernel<BITS, kRowsUnroll, OutT>;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvThreads, smem));
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  const int blocks = static_cast<int>(std::min(blocks_needed, resident));
  launch_pdl(kernel, dim3(blocks, m), dim3(kGemvThreads), smem, stream, w, x, y, norm, conv);
}

void check_quant(const DeviceQuant& w, const char* what) {
  if ((w.bits != 4 && w.bits != 8) || w.cols <= 0 || w.cols % kGroup != 0 || w.cols > kMaxCols || w.rows <= 0)
    throw ::lily::Error(std::string(what) + ": CUDA kernels support 4/8-bit matrices with cols a multiple of 64 and ≤ " +
                        std::to_string(kMaxCols) + "; got bits=" + std::to_string(w.bits) +
                        " rows=" + std::to_string(w.rows) + " cols=" + std::to_string(w.cols));
}

template <int BITS>
__global__ void embed_kernel(DeviceQuant table, const int32_t* __restrict__ tokens, bf16* __restrict__ out) {
  constexpr int kPer = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int t = blockIdx.x;
  int64_t id = tokens[t];
  id = id < 0 ? 0 : (id >= table.rows ? table.rows - 1 : id);
  const int wpr = table.cols / kPer, groups = table.cols / kGroup;
  const uint32_t* codes = table.codes + id * wpr;
  for (int wi = threadIdx.x; wi < wpr; wi += blockDim.x) {
    const uint32_t word = codes[wi];
    const int c0 = wi * kPer, g = c0 / kGroup;
    const float s = to_f32(table.scales[id * groups + g]), b = to_f32(table.biases[id * groups + g]);
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      out[static_cast<int64_t>(t) * table.cols + c0 + e] = to_bf16(s * static_cast<float>((word >> (BITS * e)) & kMask) + b);
  }
}

}  // namespace

void launch_quant_gemv_batched(const DeviceQuant& w, const bf16* x, int m, bf16* y_bf16, float* y_f32,
                               cudaStream_t stream) {
  check_quant(w, "quant_gemv");
  if ((y_bf16 == nullptr) == (y_f32 == nullptr) || m <= 0 || m > 65535)
    throw ::lily::InternalError("launch_quant_gemv: exactly one output and 0 < m ≤ 65535 required");
  if (w.bits == 4) {
    if (y_f32) gemv_dispatch<4>(w, x, m, y_f32, stream); else gemv_dispatch<4>(w, x, m, y_bf16, stream);
  } else {
    if (y_f32) gemv_dispatch<8>(w, x, m, y_f32, stream); else gemv_dispatch<8>(w, x, m, y_bf16, stream);
  }
}

void launch_quant_gemv(const DeviceQuant& w, const bf16* x, bf16* y_bf16, float* y_f32, cudaStream_t stream) {
  launch_quant_gemv_batched(w, x, 1, y_bf16, y_f32, stream);
}

void launch_add_rmsnorm_gemv(const FusedNorm& norm, const bf16* x, const DeviceQuant& w, bf16* y_bf16, float* y_f32,
                             cudaStream_t stream, const FusedConv& conv) {
  check_quant(w, "quant_gemv");
  check_fused_norm(norm, x, "launch_add_rmsnorm_gemv");
  if ((y_bf16 == nullptr) == (y_f32 == nullptr))
    throw ::lily::InternalError("launch_add_rmsnorm_gemv: exactly one output required");
  if (conv.channels != 0 &&
      (conv.channels < 0 || conv.channels > w.rows || !conv.taps || !conv.window || !conv.out || !y_bf16 ||
       conv.out == y_bf16))
    throw ::lily::InternalError("launch_add_rmsnorm_gemv: bad FusedConv (channels " + std::to_string(conv.channels) +
                                ", rows " + std::to_string(w.rows) + "; needs taps, window, out ≠ y, bf16 output)");
  if (w.bits == 4) {
    if (y_f32) gemv_dispatch<4>(w, x, 1, y_f32, stream, norm, conv);
    else gemv_dispatch<4>(w, x, 1, y_bf16, stream, norm, conv);
  } else {
    if (y_f32) gemv_dispatch<8>(w, x, 1, y_f32, stream, norm, conv);
    else gemv_dispatch<8>(w, x, 1, y_bf16, stream, norm, conv);
  }
}

void launch_embed(const DeviceQuant& table, const int32_t* tokens, int m, bf16* out, cudaStream_t stream) {
  check_quant(table, "embed_tokens");
  if (m <= 0) throw ::lily::InternalError("launch_embed: m must be positive");
  if (table.bits == 4) embed_kernel<4><<<m, 256, 0, stream>>>(table, tokens, out);
  else embed_kernel<8><<<m, 256, 0, stream>>>(table, tokens, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
