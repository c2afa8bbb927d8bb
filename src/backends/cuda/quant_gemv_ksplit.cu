// The batched decode's 4-bit GEMV split over K across the CTAs of a cluster (nvcc only): y [m, rows]
// = x [m, cols] · Wᵀ for m = 1 … kMaxDecodeRows rows in one launch, with the streaming GEMV's bits.
//
// Why: the streaming GEMV's rows mode stages all m rows × all columns in every block before its
// first tile, so at many rows a block stages more activation bytes than it reads weights (an
// out-projection at 16 rows: 128 KB of rows for one 18 KB tile), its shared memory caps a launch at
// 16 rows (four launches at 64 rows, each reading the weights again), and the rows come from L2
// once per block. Here the streaming GEMV's eight k-slices (warp w of a tile: groups [w·G/8,
// (w+1)·G/8)) become the eight CTAs of a cluster: CTA s stages only slice s of the m rows, once,
// and computes slice s of every tile its cluster takes; the slices of a tile meet in distributed
// shared memory and are added in slice order there. Per launch the rows are staged once per
// cluster in all (each CTA an eighth), the weights are read once for all m rows, and the dequant
// of a weight fragment is shared by up to four column blocks of eight rows.
//
// Work: a cluster takes groups of T tiles (16 weight rows each) in turn (cluster q: tile groups q,
// q + clusters, …). In a CTA, warp w computes one (tile, column blocks) unit of the group: with
// CB = ⌈m/8⌉ ≤ 4 column blocks T = 8 and warp w takes tile w and all CB blocks; with more, T = 4
// and warp w takes tile w/2 and half the blocks. The warp's codes, scales and biases of the slice
// (16 rows × G/8 groups) go straight from global memory into registers: no shared-memory stage for
// weights, and the next tile group's are requested before the reduction of the current one.
//
// Numerics: every group is stream_group_blocks_codes (the same fragments, +128 form, affine
// epilogue), each slice sums its groups from zero in ascending order, Σx is unit_group_sum (the
// rows mode's, group_sum_x's bits), and the slices are added as the streaming GEMV's warp 0 adds
// them (stream_add_slices: ((p0 + p1) + p2) + … + p7), then rounded to bf16 once. So a token's
// output is bit-identical to the direct, staged and rows modes, for every m and whatever the
// other rows hold.
#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/kernels.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/quant_mma.cuh"
#include "backends/cuda/stream_gemv.cuh"

namespace lily::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kSlices = kStreamWarps;  // CTAs of a cluster: the streaming GEMV's k-slices
constexpr int kKsplitWarps = 8;        // units of a tile group, one per warp
constexpr int kKsplitThreads = kKsplitWarps * kWarp;
constexpr int kMaxUnitBlocks = 4;  // column blocks of eight rows one warp computes at most

/// The tile-group shape for m rows: column blocks CB, blocks per warp (kB), tiles per group (T).
struct KsplitShape {
  int cb = 0, kb = 0, tiles = 0;
};

__host__ __device__ inline KsplitShape ksplit_shape(int m) {
  KsplitShape s;
  s.cb = (m + kMmaMaxTokens - 1) / kMmaMaxTokens;
  if (s.cb <= kMaxUnitBlocks) {
    s.kb = s.cb;
    s.tiles = kKsplitWarps;
  } else {
    s.kb = (s.cb + 1) / 2;
    s.tiles = kKsplitWarps / 2;
  }
  return s;
}

/// Shared memory (bytes) of a CTA for m rows and kGps groups per slice: the staged slice of the
/// rows (uint32 [m][pitch], fragment order), its Σx (float [kGps][8·CB]), the slice partials of a
/// tile group (float [8·CB][T·16 + 4]) and the staging mbarrier.
struct KsplitLayout {
  int pitch = 0;  ///< words between two staged rows: kGps·32 + 4 (a fragment load's 8 lanes on distinct banks)
  int sum_cols = 0;    ///< 8·CB
  int part_pitch = 0;  ///< T·16 + 4 floats between two rows' partials
  int64_t sums = 0, part = 0, bar = 0, total = 0;
};

__host__ __device__ inline KsplitLayout ksplit_layout(int m, int gps) {
  const KsplitShape s = ksplit_shape(m);
  KsplitLayout l;
  l.pitch = gps * 32 + 4;
  l.sum_cols = s.cb * kMmaMaxTokens;
  l.part_pitch = s.tiles * kMmaTileRows + 4;
  l.sums = align16(int64_t{m} * l.pitch * 4);
  l.part = l.sums + align16(int64_t{gps} * l.sum_cols * 4);
  l.bar = l.part + align16(int64_t{l.sum_cols} * l.part_pitch * 4);
  l.total = l.bar + 16;
  return l;
}

/// One warp's weights of a unit: the codes of rows `lo` and `hi` (slots g and g + 8) for the
/// slice's kGps groups (8 bytes [8t, 8t + 8) of each group, group_mma's fragment), and both rows'
/// scales and biases for those groups (bf16 pairs).
template <int kGps>
struct SliceWeights {
  uint2 code_lo[kGps], code_hi[kGps];
  uint32_t s_lo[kGps / 2], s_hi[kGps / 2], b_lo[kGps / 2], b_hi[kGps / 2];
};

/// kGps / 2 words from p (bf16 [kGps], aligned to its size), read once by the non-coherent path.
template <int kGps>
__device__ __forceinline__ void load_pairs(const bf16* p, uint32_t (&out)[kGps / 2]) {
  static_assert(kGps == 4 || kGps == 8, "4 or 8 groups per slice");
  if constexpr (kGps == 8) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    out[0] = v.x, out[1] = v.y;
  }
}

/// Element G (0 … kGps − 1) of pairs loaded by load_pairs, as fp32 (exact).
template <int kGps>
__device__ __forceinline__ float pair_elem(const uint32_t (&w)[kGps / 2], int G) {
  const uint32_t v = w[G / 2];
  return __uint_as_float(G % 2 ? (v & 0xffff0000u) : (v << 16));
}

/// Requests slice `s`'s weights of weight rows r_lo, r_hi (clamped into the matrix by the caller).
template <int kGps>
__device__ __forceinline__ void load_slice_weights(const DeviceQuant& w, int64_t r_lo, int64_t r_hi, int s, int t,
                                                   SliceWeights<kGps>& sw) {
  const int row_bytes = w.cols / 2, groups = w.cols / kGroup;
  const unsigned char* codes = reinterpret_cast<const unsigned char*>(w.codes);
  const unsigned char* lo = codes + r_lo * row_bytes + s * kGps * 32 + 8 * t;
  const unsigned char* hi = codes + r_hi * row_bytes + s * kGps * 32 + 8 * t;
#pragma unroll
  for (int G = 0; G < kGps; ++G) {
    sw.code_lo[G] = __ldg(reinterpret_cast<const uint2*>(lo + G * 32));
    sw.code_hi[G] = __ldg(reinterpret_cast<const uint2*>(hi + G * 32));
  }
  load_pairs<kGps>(w.scales + r_lo * groups + s * kGps, sw.s_lo);
  load_pairs<kGps>(w.scales + r_hi * groups + s * kGps, sw.s_hi);
  load_pairs<kGps>(w.biases + r_lo * groups + s * kGps, sw.b_lo);
  load_pairs<kGps>(w.biases + r_hi * groups + s * kGps, sw.b_hi);
}

/// The rows of a unit: weight rows of slots g and g + 8 of tile `tile`, clamped to the last row
/// (a partial last tile computes copies of it, never stored).
__device__ __forceinline__ int64_t unit_row(const DeviceQuant& w, int64_t tile, int slot) {
  const int64_t r = tile * kMmaTileRows + slot;
  return r < w.rows ? r : w.rows - 1;
}

/// Stages slice s of the m rows of x: the raw 16-byte units by one bulk copy per row (counted on
/// `bar`), then each (row, group) unit's Σx (unit_group_sum) into sums[G][row] and its words in
/// fragment order in place (stage_rows_fragments' arithmetic). All threads; ends with a barrier.
template <int kGps>
__device__ __forceinline__ void stage_slice(const bf16* __restrict__ x, int m, int cols, int s, const KsplitLayout& l,
                                            uint32_t* xs, float* sums, uint64_t* bar) {
  constexpr uint32_t kSliceBytes = kGps * kGroup * 2;
  if (threadIdx.x < kWarp) {
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(m) * kSliceBytes);
    __syncwarp();
    for (int n = static_cast<int>(threadIdx.x); n < m; n += kWarp)
      bulk_copy_to_shared(xs + int64_t{n} * l.pitch, x + int64_t{n} * cols + s * kGps * kGroup, kSliceBytes, bar);
  }
  mbarrier_wait(bar, 0);
  for (int u = threadIdx.x; u < m * kGps; u += blockDim.x) {
    const int n = u % m, G = u / m;
    uint4* unit = reinterpret_cast<uint4*>(xs + int64_t{n} * l.pitch + G * 32);
    uint4 q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = unit[j];
    sums[G * l.sum_cols + n] = unit_group_sum(q);
#pragma unroll
    for (int j = 0; j < 8; ++j) unit[j] = fragment_order(q[j]);
  }
  __syncthreads();
}

/// One warp's unit: slice s (kGps groups, ascending, each from stream_group_blocks_codes) of its
/// tile for column blocks b0 … b0 + kB − 1 (rows past m take row m − 1's values, never stored).
template <int kGps, int kB>
__device__ __forceinline__ void slice_unit(const SliceWeights<kGps>& sw, const uint32_t* xs, const float* sums,
                                           const KsplitLayout& l, int m, int b0, int g, int t,
                                           float (&acc)[kB][4]) {
  auto frag = [&](int c, int G, uint4& bw0, uint4& bw1) {
    const int n = min((b0 + c) * kMmaMaxTokens + g, m - 1);
    const uint4* p = reinterpret_cast<const uint4*>(xs + n * l.pitch + G * 32 + t * 8);
    bw0 = p[0];
    bw1 = p[1];
  };
#pragma unroll
  for (int c = 0; c < kB; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
#pragma unroll
  for (int G = 0; G < kGps; ++G) {
    float x0[kB], x1[kB];
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      const int n0 = (b0 + c) * kMmaMaxTokens + 2 * t;
      x0[c] = sums[G * l.sum_cols + min(n0, m - 1)];
      x1[c] = sums[G * l.sum_cols + min(n0 + 1, m - 1)];
    }
    stream_group_blocks_codes<kB>(sw.code_lo[G], sw.code_hi[G], frag, G, pair_elem<kGps>(sw.s_lo, G),
                                  pair_elem<kGps>(sw.b_lo, G), pair_elem<kGps>(sw.s_hi, G),
                                  pair_elem<kGps>(sw.b_hi, G), x0, x1, acc);
  }
}

/// Grid: clusters of kSlices CTAs (CTA rank s = slice s), kKsplitThreads threads. See the file
/// comment. y bf16 [m, w.rows].
template <int kGps, int kB>
__global__ void __cluster_dims__(kSlices, 1, 1) __launch_bounds__(kKsplitThreads, 2)
    quant_gemv_ksplit_kernel(DeviceQuant w, const bf16* __restrict__ x, int m, bf16* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char sm[];
  cg::cluster_group cluster = cg::this_cluster();
  const int s = static_cast<int>(cluster.block_rank());
  const int q = blockIdx.x / kSlices, clusters = gridDim.x / kSlices;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const KsplitShape shape = ksplit_shape(m);
  const KsplitLayout l = ksplit_layout(m, kGps);
  uint32_t* xs = reinterpret_cast<uint32_t*>(sm);
  float* sums = reinterpret_cast<float*>(sm + l.sums);
  float* part = reinterpret_cast<float*>(sm + l.part);
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + l.bar);
  const int64_t n_tiles = (w.rows + kMmaTileRows - 1) / kMmaTileRows;
  const int64_t n_groups = (n_tiles + shape.tiles - 1) / shape.tiles;
  // This warp's unit of a tile group: local tile `lt`, column blocks b0 … b0 + kB − 1.
  const int lt = shape.cb <= kMaxUnitBlocks ? warp : warp / 2;
  const int b0 = shape.cb <= kMaxUnitBlocks ? 0 : (warp % 2) * kB;
  const bool active = b0 < shape.cb;

  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    mbarrier_init_fence();
  }
  SliceWeights<kGps> sw;
  auto request = [&](int64_t tg) {  // this warp's weights of tile group tg (before they are needed)
    const int64_t tile = tg * shape.tiles + lt;
    if (active && tile < n_tiles) load_slice_weights<kGps>(w, unit_row(w, tile, g), unit_row(w, tile, g + 8), s, t, sw);
  };
  if (q < n_groups) request(q);  // weights are never written: before the PDL wait
  __syncthreads();
  pdl_prologue();
  stage_slice<kGps>(x, m, w.cols, s, l, xs, sums, bar);

  for (int64_t tg = q; tg < n_groups; tg += clusters) {
    const int64_t tile = tg * shape.tiles + lt;
    float acc[kB][4];
    const bool live = active && tile < n_tiles;
    if (live) slice_unit<kGps, kB>(sw, xs, sums, l, m, b0, g, t, acc);
    if (tg + clusters < n_groups) request(tg + clusters);  // the next group's weights fly under the reduction
    if (live) {
#pragma unroll
      for (int c = 0; c < kB; ++c) {
        if (b0 + c >= shape.cb) break;  // the second half's blocks past the last (CB odd)
        const int n0 = (b0 + c) * kMmaMaxTokens + 2 * t;
        float* p0 = part + n0 * l.part_pitch + lt * kMmaTileRows;
        float* p1 = p0 + l.part_pitch;
        p0[g] = acc[c][0];
        p1[g] = acc[c][1];
        p0[g + 8] = acc[c][2];
        p1[g + 8] = acc[c][3];
      }
    }
    cluster.sync();  // every slice's partials of the tile group are in its CTA's shared memory
    // CTA s adds the slices of outputs s, s + kSlices·threads, … (token n, local row r) in slice order.
    const int group_rows = shape.tiles * kMmaTileRows;
    const int64_t row0 = tg * group_rows;
    for (int i = s * kKsplitThreads + threadIdx.x; i < m * group_rows; i += kSlices * kKsplitThreads) {
      const int n = i / group_rows, r = i % group_rows;
      if (row0 + r >= w.rows) continue;
      const int off = n * l.part_pitch + r;
      float v = cluster.map_shared_rank(part, 0)[off];
#pragma unroll
      for (int sl = 1; sl < kSlices; ++sl) v += cluster.map_shared_rank(part, sl)[off];
      y[int64_t{n} * w.rows + row0 + r] = to_bf16(v);
    }
    cluster.sync();  // no CTA overwrites its partials (or leaves) while another still reads them
  }
}

/// Clusters of `kernel` (kKsplitThreads threads, `smem` bytes of dynamic shared memory a CTA) that
/// can be resident at once, asked of the driver once per (kernel, smem) and remembered; at least
/// 1. Throws lily::Error on a CUDA error.
int resident_clusters(const void* kernel, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, size_t>, int> known;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find({kernel, smem}); it != known.end()) return it->second;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kSlices);
  config.blockDim = dim3(kKsplitThreads);
  config.dynamicSmemBytes = smem;
  int clusters = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return known[{kernel, smem}] = std::max(clusters, 1);
}

/// Groups per slice that have an instance: the matrix's columns are 8 · 64 · kGps.
int slice_groups(const DeviceQuant& w) { return w.cols / kGroup / kSlices; }

template <int kGps, int kB>
void launch_ksplit(const DeviceQuant& w, const bf16* x, int m, bf16* y, cudaStream_t stream) {
  auto kernel = quant_gemv_ksplit_kernel<kGps, kB>;
  const size_t smem = static_cast<size_t>(ksplit_layout(m, kGps).total);
  raise_smem_limit(kernel, smem);
  const KsplitShape shape = ksplit_shape(m);
  const int64_t n_tiles = (w.rows + kMmaTileRows - 1) / kMmaTileRows;
  const int64_t n_groups = (n_tiles + shape.tiles - 1) / shape.tiles;
  // One wave of clusters: as many as can be resident at once (each then takes several tile groups).
  const int64_t clusters = std::min<int64_t>(n_groups, resident_clusters(reinterpret_cast<const void*>(kernel), smem));
  launch_pdl(kernel, dim3(static_cast<unsigned>(clusters * kSlices)), dim3(kKsplitThreads), smem, stream, w, x, m, y);
}

template <int kGps>
void launch_ksplit_gps(const DeviceQuant& w, const bf16* x, int m, bf16* y, cudaStream_t stream) {
  switch (ksplit_shape(m).kb) {
    case 1: return launch_ksplit<kGps, 1>(w, x, m, y, stream);
    case 2: return launch_ksplit<kGps, 2>(w, x, m, y, stream);
    case 3: return launch_ksplit<kGps, 3>(w, x, m, y, stream);
    default: return launch_ksplit<kGps, 4>(w, x, m, y, stream);
  }
}

}  // namespace

std::string ksplit_gemv_problem(const DeviceQuant& w, int m) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (w.bits != 4) return "not a 4-bit matrix";
  if (m < 1 || m > kMaxDecodeRows) return std::to_string(m) + " rows (1 … " + std::to_string(kMaxDecodeRows) + ")";
  if (w.cols % (kSlices * kGroup) != 0 || (slice_groups(w) != 4 && slice_groups(w) != 8))
    return std::to_string(w.cols) + " columns (2,048 or 4,096: 4 or 8 groups per k-slice)";
  if (!aligned(w.codes) || !aligned(w.scales) || !aligned(w.biases)) return "the matrix's arrays are not 16-byte aligned";
  return "";
}

void launch_quant_gemv_ksplit(const DeviceQuant& w, const bf16* x, int m, bf16* y, cudaStream_t stream) {
  if (std::string why = ksplit_gemv_problem(w, m); !why.empty())
    throw ::lily::InternalError("launch_quant_gemv_ksplit: " + why);
  if (!x || !y || reinterpret_cast<uintptr_t>(x) % 16 != 0)
    throw ::lily::InternalError("launch_quant_gemv_ksplit: x (16-byte aligned) and y are required");
  if (slice_groups(w) == 8) launch_ksplit_gps<8>(w, x, m, y, stream);
  else launch_ksplit_gps<4>(w, x, m, y, stream);
}

}  // namespace lily::cuda
