// The device sampler (sampler_kernels.h): engine/sampler.h's contract on the device. Per row:
//   1. scale_kernel   (many blocks): work[i] = logits[i] / T (a copy when greedy); clears the
//                                    row's control block and, for top-p, its histogram;
//   2. edit_kernel    (one block):   work[id] = apply_penalty_edit(logits[id]) / T per edit;
//   3. max_kernel     (many blocks): per-block and per-warp max of the composite key (below);
//   4. weight_kernel  (many blocks): m = the max; greedy: out = its id; else weight[i] =
//                                    fp32 exp(work[i] − m) (exp in fp64, rounded once). With
//                                    top-p and no top-k it also builds a histogram of exact
//                                    mass over d = m − x (2,048 buckets of 1/64); with a small
//                                    top-k it gathers the ids above a bound on the k-th key;
//   5. select_kernel  (one block of 1024 per row): the top-k threshold and, with top-k ≤ 1024,
//      top-p, min-p and the draw over the gathered ids; with top-p and no top-k, the bucket
//      where the top-p mass is crossed; otherwise (rare shapes: top-k > 1024, a crossing bucket
//      of more than 1024 ids) the single-block radix paths: a top-k radix select on the
//      composite key, a top-p radix search on exact mass, and the draw;
//   6. gather_kernel  (many blocks): the ids of the crossing bucket;
//   7. cutoff_kernel  (one block):   the crossing id among them, i.e. the top-p threshold;
//   8. draw_kernel    (many blocks): exact surviving mass per chunk of 256 ids; the last block
//      to finish draws: the first surviving id (ascending) whose cumulative mass exceeds
//      u · total, with u = sample_uniform(seed, step) computed by the same Philox.
// Every pass over the whole vocabulary runs on many blocks; the single blocks read summaries
// (part maxima, 2,048 buckets, ≤ 1,024 gathered ids, per-chunk masses). No sort anywhere.
//
// Order and ties: the CPU sampler orders candidates by descending logit, ties to the lower id.
// The composite key (float_key(x) << 32) | (2^32 − 1 − id) is that order as one unsigned
// 64-bit integer (larger = earlier), so every selection is a threshold on the key, exact.
//
// Mass: the CPU sums fp32 weights in fp64, sequentially. Here every sum is exact: a weight
// w ∈ [0, 1] becomes the integer floor(w · 2^63) and sums are 128-bit integers, so they do
// not depend on the order of the additions (deterministic, batch- and thread-invariant). Where
// the two can differ: the CPU's fp64 rounding (≈ 1e-16 relative per add) and the dropped
// fraction below 2^-63 per weight, i.e. only when u · total (or top_p · total) falls within
// ≈ 1e-13 relative of a boundary between two tokens. The logits themselves (edits, division by
// T: IEEE fp32 operations written with __f*_rn so nothing is contracted) and the fp32 weights
// (exp rounded once from fp64; glibc's expf is correctly rounded in all but rare cases) are the
// CPU's bit for bit.
#include <algorithm>
#include <cfloat>
#include <climits>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/sampler_kernels.h"

namespace lily::cuda {
namespace {

constexpr int kThreads = 256;          // scale / max / weight kernels
constexpr int kSelectThreads = 1024;   // select kernel
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kMaxParts = 128;
constexpr int kPerThread = 8;          // draw: consecutive ids per thread per tile
constexpr int kTile = kSelectThreads * kPerThread;
constexpr int kMaxTiles = 64;  // per-tile sums for rows of up to 64 tiles (524,288 ids)
constexpr int kCompactMax = kSelectThreads;  // top-k ≤ this: top-p and the draw run on the k ids in shared memory
constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpsPerPart = kThreads / 32;
constexpr int kMaxWarpKeys = kMaxParts * kWarpsPerPart;  // per-warp maxima of max_kernel
constexpr int kBuckets = 2048;            // top-p histogram over d = m − x ...
constexpr float kBucketsPerUnit = 64.0f;  // ... in steps of 1/64 (d ≥ 32: the last bucket)

/// Per-row state passed between the kernels, at the start of the row's scratch. Cleared by
/// scale_kernel (list_n, draw_done, pending, bucket); the rest is written before it is read.
struct Control {
  unsigned long long thr;               ///< the draw's key threshold (S = {key ≥ thr} ∩ {x ≥ floor})
  unsigned long long best;              ///< the row's max composite key (argmax fallback)
  unsigned long long base_lo, base_hi;  ///< top-p: mass above the crossing bucket (128-bit)
  double floor_x;                       ///< min-p floor (−inf without min-p)
  double target;                        ///< top-p: top_p · total mass
  float m;                              ///< the row's max logit after temperature
  int bucket;                           ///< top-p crossing bucket for gather/cutoff; −1: none
  int pending;                          ///< 1: the draw is left to draw_kernel
  unsigned int list_n;                  ///< ids gathered into the list (may exceed kCompactMax)
  unsigned int draw_done;               ///< draw_kernel blocks finished; the last one draws
};
constexpr int kControlSlots = 16;
static_assert(sizeof(Control) <= kControlSlots * sizeof(unsigned long long));

__host__ __device__ constexpr int chunks_for(int vocab) { return (vocab + kThreads - 1) / kThreads; }
__host__ __device__ constexpr int64_t scratch_slots_for(int vocab) {
  return kControlSlots + kMaxParts + kMaxWarpKeys + 2 * kMaxParts + 3 * kBuckets + 3 * kCompactMax +
         3 * static_cast<int64_t>(chunks_for(vocab));
}

/// The row's scratch (SampleRowArgs::scratch, scratch_slots_for(vocab) 64-bit slots) carved up.
struct RowScratch {
  Control* ctl;
  unsigned long long* part_keys;  ///< [n_parts] max composite key per block of max_kernel
  unsigned long long* warp_keys;  ///< [n_parts · 8] max composite key per warp
  unsigned long long *part_slo, *part_shi;  ///< [n_parts] all ids' mass per block, split sums (below)
  unsigned long long *hist_cnt, *hist_slo, *hist_shi;  ///< [kBuckets] count and mass of C per bucket
  unsigned long long *list_key, *list_f, *list_idok;  ///< [kCompactMax] gathered ids: key, mass, id | ok << 32
  unsigned long long *chunk_slo, *chunk_shi;  ///< [chunks] surviving mass per chunk of 256 ids
  long long* chunk_last;                      ///< [chunks] last surviving id of the chunk, −1: none
};
__device__ __forceinline__ RowScratch scratch_of(const SampleRowArgs& a) {
  unsigned long long* p = a.scratch;
  RowScratch r;
  r.ctl = reinterpret_cast<Control*>(p);
  r.part_keys = p + kControlSlots;
  r.warp_keys = r.part_keys + kMaxParts;
  r.part_slo = r.warp_keys + kMaxWarpKeys;
  r.part_shi = r.part_slo + kMaxParts;
  r.hist_cnt = r.part_shi + kMaxParts;  // hist_cnt, hist_slo, hist_shi are contiguous (cleared as one)
  r.hist_slo = r.hist_cnt + kBuckets;
  r.hist_shi = r.hist_slo + kBuckets;
  r.list_key = r.hist_shi + kBuckets;
  r.list_f = r.list_key + kCompactMax;
  r.list_idok = r.list_f + kCompactMax;
  const int nc = chunks_for(a.vocab);
  r.chunk_slo = r.list_idok + kCompactMax;
  r.chunk_shi = r.chunk_slo + nc;
  r.chunk_last = reinterpret_cast<long long*>(r.chunk_shi + nc);
  return r;
}

__device__ __forceinline__ bool uses_top_k(const SampleRowArgs& a) { return a.top_k > 0 && a.top_k < a.vocab; }
/// Top-p without top-k: the histogram path (weight_kernel, select_kernel, gather, cutoff).
__device__ __forceinline__ bool histogram_path(const SampleRowArgs& a) {
  return !a.greedy && !uses_top_k(a) && a.top_p < 1.0f;
}
/// Top-k ≤ kCompactMax and ≤ the number of per-warp maxima: weight_kernel gathers the ids with
/// a key ≥ the k-th largest warp maximum (a lower bound of the k-th largest key).
__device__ __forceinline__ bool prefilter_path(const SampleRowArgs& a) {
  return !a.greedy && uses_top_k(a) && a.top_k <= kCompactMax && a.top_k <= a.n_parts * kWarpsPerPart;
}
/// The histogram bucket of x: floor(64 · (m − x)), the last bucket for d ≥ 32 or NaN. Non-
/// decreasing as x decreases (fp32 subtraction rounds monotonically), so every bucket is a
/// contiguous range of the composite-key order and equal logits share a bucket.
__device__ __forceinline__ int bucket_of(float x, float m) {
  const float d = __fsub_rn(m, x);
  if (!(d < static_cast<float>(kBuckets) / kBucketsPerUnit)) return kBuckets - 1;
  return min(kBuckets - 1, static_cast<int>(__fmul_rn(d, kBucketsPerUnit)));
}

// ---- keys ----------------------------------------------------------------------------------

/// Order-preserving map of a float to uint32 (larger float → larger key); −0 counts as +0 and
/// NaN as the smallest key (the CPU's comparisons never pick a NaN over a number).
__device__ __forceinline__ uint32_t float_key(float x) {
  if (x != x) return 0u;  // NaN
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
/// Descending logit, ties to the lower id, as one integer: larger = earlier.
__device__ __forceinline__ unsigned long long comp_key(float x, int i) {
  return (static_cast<unsigned long long>(float_key(x)) << 32) | static_cast<unsigned long long>(0xffffffffu - static_cast<uint32_t>(i));
}
__device__ __forceinline__ int key_id(unsigned long long k) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(k & 0xffffffffull));
}

// ---- exact 128-bit mass ----------------------------------------------------------------------

struct U128 {
  unsigned long long lo, hi;
};
__device__ __forceinline__ U128 u128(unsigned long long v) { return U128{v, 0ull}; }
__device__ __forceinline__ U128 add(U128 a, U128 b) {
  U128 r;
  r.lo = a.lo + b.lo;
  r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
  return r;
}
/// The mass as a real number (units of 2^-63), rounded to double.
__device__ __forceinline__ double to_double(U128 a) {
  return (static_cast<double>(a.hi) * 0x1p64 + static_cast<double>(a.lo)) * 0x1p-63;
}
/// floor(w · 2^63) for w ∈ (0, 1]; 0 for w ≤ 0 or NaN.
__device__ __forceinline__ unsigned long long fixed_weight(float w) {
  if (!(w > 0.0f)) return 0ull;
  return static_cast<unsigned long long>(static_cast<double>(fminf(w, 1.0f)) * 0x1p63);
}
/// A mass kept as two 64-bit sums of 32-bit halves (Σ f mod 2^32 pieces and Σ f >> 32): sums
/// of fewer than 2^31 weights cannot overflow either, and plain 64-bit atomics add them.
__device__ __forceinline__ U128 from_split(unsigned long long lo_sum, unsigned long long hi_sum) {
  return add(U128{hi_sum << 32, hi_sum >> 32}, u128(lo_sum));
}
__device__ __forceinline__ U128 shfl_xor(U128 v, int o) {
  v.lo = __shfl_xor_sync(kFull, v.lo, o);
  v.hi = __shfl_xor_sync(kFull, v.hi, o);
  return v;
}
__device__ __forceinline__ U128 shfl_up(U128 v, int o) {
  v.lo = __shfl_up_sync(kFull, v.lo, o);
  v.hi = __shfl_up_sync(kFull, v.hi, o);
  return v;
}

// ---- block reductions (every thread of the block must call; all get the result) -----------

/// Shared scratch of the block reductions of a block of W warps.
template <int W>
struct Scratch {
  U128 u[W + 1];
  unsigned long long k[W + 1];
  int i[W + 1];
};

__device__ __forceinline__ unsigned long long shfl_xor(unsigned long long v, int o) {
  return __shfl_xor_sync(kFull, v, o);
}
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(kFull, v, o); }

/// `op` (associative and commutative, exact) over the values of a block of n_warps warps: each
/// warp by shuffles, then warp 0 over the warps' results (its lanes ≥ n_warps add `identity`).
/// `red`: n_warps + 1 values of shared memory, the last one the result. Three barriers.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* red, int n_warps) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T t = lane < n_warps ? red[lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = op(t, shfl_xor(t, o));
    if (lane == 0) red[n_warps] = t;
  }
  __syncthreads();
  const T r = red[n_warps];
  __syncthreads();
  return r;
}

/// Exact 128-bit sum over the block.
template <int W>
__device__ U128 block_sum(U128 v, Scratch<W>& s) {
  return block_reduce(v, [](U128 a, U128 b) { return add(a, b); }, u128(0), s.u, W);
}

/// Exclusive prefix sum over the threads in threadIdx order; *total gets the block's sum.
template <int W>
__device__ U128 block_exclusive_scan(U128 v, Scratch<W>& s, U128* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  U128 incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const U128 up = shfl_up(incl, o);
    if (lane >= o) incl = add(incl, up);
  }
  if (lane == 31) s.u[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const U128 t = lane < W ? s.u[lane] : u128(0);
    U128 ti = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const U128 up = shfl_up(ti, o);
      if (lane >= o) ti = add(ti, up);
    }
    // exclusive = inclusive − own (exact 128-bit subtraction)
    if (lane < W) {
      U128 ex;
      ex.lo = ti.lo - t.lo;
      ex.hi = ti.hi - t.hi - (ti.lo < t.lo ? 1ull : 0ull);
      s.u[lane] = ex;
    }
    if (lane == 31) s.u[W] = ti;  // lane 31 ≥ W − 1: the block total
  }
  __syncthreads();
  U128 ex_lane;  // exclusive within the warp
  ex_lane.lo = incl.lo - v.lo;
  ex_lane.hi = incl.hi - v.hi - (incl.lo < v.lo ? 1ull : 0ull);
  const U128 r = add(s.u[warp], ex_lane);
  *total = s.u[W];
  __syncthreads();
  return r;
}

/// Largest key over the block of n_warps warps; `red`: n_warps + 1 values of shared memory.
__device__ unsigned long long block_max_key(unsigned long long v, unsigned long long* red, int n_warps) {
  return block_reduce(v, [](unsigned long long a, unsigned long long b) { return max(a, b); }, 0ull, red, n_warps);
}

/// Smallest value over the block.
template <int W>
__device__ int block_min_int(int v, Scratch<W>& s) {
  return block_reduce(v, [](int a, int b) { return min(a, b); }, INT_MAX, s.i, W);
}

template <int W>
__device__ int block_max_int(int v, Scratch<W>& s) { return -block_min_int(-v, s); }

// ---- Philox (engine/sampler.cpp philox4x32_10, sample_uniform) ------------------------------

__host__ __device__ inline double philox_uniform(unsigned long long seed, unsigned long long step) {
  uint32_t c0 = static_cast<uint32_t>(step), c1 = static_cast<uint32_t>(step >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = static_cast<unsigned long long>(0xD2511F53u) * c0;
    const unsigned long long p1 = static_cast<unsigned long long>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
  }
  const unsigned long long bits = (static_cast<unsigned long long>(c0) << 21) | (c1 >> 11);
  return static_cast<double>(bits) * 0x1p-53;
}

// ---- kernels 1–4 ---------------------------------------------------------------------------

__device__ __forceinline__ float scale(float v, const SampleRowArgs& a) {
  return a.greedy ? v : __fdiv_rn(v, a.temperature);
}

__global__ void __launch_bounds__(kThreads) scale_kernel(const SampleRowArgs* rows) {
  const SampleRowArgs a = rows[blockIdx.y];  // a copy: no aliasing with the rows it writes
  if (static_cast<int>(blockIdx.x) >= a.n_parts) return;
  const RowScratch r = scratch_of(a);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    r.ctl->list_n = 0u;
    r.ctl->draw_done = 0u;
    r.ctl->pending = 0;
    r.ctl->bucket = -1;
  }
  if (histogram_path(a))
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < 3 * kBuckets; i += a.n_parts * kThreads) r.hist_cnt[i] = 0ull;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads)
    a.work[i] = scale(a.logits[i], a);
}

/// One thread per edit; the edits hold distinct ids, so no two threads write the same entry.
__global__ void __launch_bounds__(kThreads) edit_kernel(const SampleRowArgs* rows) {
  const SampleRowArgs a = rows[blockIdx.x];
  for (int e = threadIdx.x; e < a.n_edits; e += kThreads) {
    const PenaltyEdit ed = a.edits[e];
    if (ed.id < 0 || ed.id >= a.vocab) continue;
    float l = a.logits[ed.id];
    for (int j = 0; j < ed.bias_count; ++j) l = __fadd_rn(l, a.biases[ed.bias_begin + j]);
    if (ed.seen) {
      if (a.repetition_penalty != 1.0f)
        l = l > 0.0f ? __fdiv_rn(l, a.repetition_penalty) : __fmul_rn(l, a.repetition_penalty);
      if (ed.count > 0)
        l = __fsub_rn(l, __fadd_rn(__fmul_rn(a.frequency_penalty, static_cast<float>(ed.count)), a.presence_penalty));
    }
    a.work[ed.id] = scale(l, a);
  }
}

__global__ void __launch_bounds__(kThreads) max_kernel(const SampleRowArgs* rows) {
  __shared__ unsigned long long red[33];
  const SampleRowArgs a = rows[blockIdx.y];  // a copy: no aliasing with the rows it writes
  if (static_cast<int>(blockIdx.x) >= a.n_parts) return;  // block-uniform
  const RowScratch r = scratch_of(a);
  unsigned long long best = 0ull;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads)
    best = max(best, comp_key(a.work[i], i));
  unsigned long long warp_best = best;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) warp_best = max(warp_best, __shfl_xor_sync(kFull, warp_best, o));
  if (threadIdx.x % 32 == 0) r.warp_keys[blockIdx.x * kWarpsPerPart + threadIdx.x / 32] = warp_best;
  best = block_max_key(best, red, kWarpsPerPart);
  if (threadIdx.x == 0) r.part_keys[blockIdx.x] = best;
}

/// The row's max composite key from the n_parts per-block maxima of max_kernel (blocks past a
/// row's n_parts do nothing in every kernel; the row's ids are strided over its n_parts blocks).
__device__ unsigned long long row_max_key(const SampleRowArgs& a, unsigned long long* red, int n_warps) {
  const RowScratch r = scratch_of(a);
  unsigned long long k = 0ull;
  for (int j = threadIdx.x; j < a.n_parts; j += n_warps * 32) k = max(k, r.part_keys[j]);
  return block_max_key(k, red, n_warps);
}

/// Sum over the block of kThreads threads (every thread must call; all get the result).
__device__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* red) {
  return block_reduce(v, [](unsigned long long a, unsigned long long b) { return a + b; }, 0ull, red, kWarpsPerPart);
}

/// Shared memory of weight_kernel: the block's histogram, or the per-warp maxima.
union WeightShared {
  struct {
    unsigned int cnt[kBuckets];
    unsigned long long slo[kBuckets], shi[kBuckets];
  } hist;
  unsigned long long warp_keys[kMaxWarpKeys];
};

/// weight_kernel, small top-k: every id of this block's part whose key reaches the k-th largest
/// of the per-warp maxima (k distinct ids reach it, so the top-k set does) goes to the list.
__device__ void prefilter_part(const SampleRowArgs& a, const RowScratch& r, double floor_x, WeightShared& sh,
                               unsigned long long* red) {
  const int n_keys = a.n_parts * kWarpsPerPart;
  for (int j = threadIdx.x; j < n_keys; j += kThreads) sh.warp_keys[j] = r.warp_keys[j];
  __syncthreads();
  unsigned long long kth = 0ull;  // ties (only empty warps' 0 keys) leave it 0: everything gathered
  for (int t = threadIdx.x; t < n_keys; t += kThreads) {
    const unsigned long long mine = sh.warp_keys[t];
    int rank = 0;
    for (int j = 0; j < n_keys; ++j) rank += sh.warp_keys[j] > mine ? 1 : 0;
    if (rank == a.top_k - 1) kth = max(kth, mine);
  }
  const unsigned long long bound = block_max_key(kth, red, kWarpsPerPart);
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads) {
    const float x = a.work[i];
    const unsigned long long key = comp_key(x, i);
    if (key < bound) continue;
    const unsigned slot = atomicAdd(&r.ctl->list_n, 1u);
    if (slot >= static_cast<unsigned>(kCompactMax)) continue;  // too many: select_kernel's radix select
    const float w = a.weight[i];
    const unsigned long long ok = (static_cast<double>(x) >= floor_x ? 1ull : 0ull) | (w > 0.0f ? 2ull : 0ull);
    r.list_key[slot] = key;
    r.list_f[slot] = fixed_weight(w);
    r.list_idok[slot] = static_cast<unsigned long long>(static_cast<uint32_t>(i)) | (ok << 32);
  }
}

__global__ void __launch_bounds__(kThreads) weight_kernel(const SampleRowArgs* rows) {
  __shared__ unsigned long long red[33];
  __shared__ WeightShared sh;
  const SampleRowArgs a = rows[blockIdx.y];  // a copy: no aliasing with the rows it writes
  if (static_cast<int>(blockIdx.x) >= a.n_parts) return;  // block-uniform
  const unsigned long long best = row_max_key(a, red, kWarpsPerPart);
  if (a.greedy) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.out_id = best == 0ull ? 0 : key_id(best);
    return;
  }
  const RowScratch r = scratch_of(a);
  const float m = key_float(static_cast<uint32_t>(best >> 32));
  const double floor_x = a.use_min_p ? static_cast<double>(m) + a.log_min_p : -INFINITY;
  const bool hist = histogram_path(a);  // row-uniform
  if (hist) {
    for (int b = threadIdx.x; b < kBuckets; b += kThreads) sh.hist.cnt[b] = 0u, sh.hist.slo[b] = 0ull, sh.hist.shi[b] = 0ull;
    __syncthreads();
  }
  unsigned long long all_lo = 0ull, all_hi = 0ull;  // this part's mass over every id, split
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads) {
    const float x = a.work[i];
    const float w = static_cast<float>(exp(static_cast<double>(__fsub_rn(x, m))));
    a.weight[i] = w;
    if (hist) {
      const unsigned long long f = fixed_weight(w);
      all_lo += f & 0xffffffffull;
      all_hi += f >> 32;
      if (static_cast<double>(x) >= floor_x) {  // C: the top-p candidates
        const int b = bucket_of(x, m);
        atomicAdd(&sh.hist.cnt[b], 1u);
        if (f) {
          atomicAdd(&sh.hist.slo[b], f & 0xffffffffull);
          atomicAdd(&sh.hist.shi[b], f >> 32);
        }
      }
    }
  }
  if (hist) {
    all_lo = block_sum_u64(all_lo, red);  // its barriers also publish the shared histogram
    all_hi = block_sum_u64(all_hi, red);
    if (threadIdx.x == 0) r.part_slo[blockIdx.x] = all_lo, r.part_shi[blockIdx.x] = all_hi;
    for (int b = threadIdx.x; b < kBuckets; b += kThreads) {
      if (sh.hist.cnt[b] == 0u) continue;
      atomicAdd(&r.hist_cnt[b], static_cast<unsigned long long>(sh.hist.cnt[b]));
      if (sh.hist.slo[b]) atomicAdd(&r.hist_slo[b], sh.hist.slo[b]);
      if (sh.hist.shi[b]) atomicAdd(&r.hist_shi[b], sh.hist.shi[b]);
    }
  } else if (prefilter_path(a)) {
    __syncthreads();  // the weights of this block are written (prefilter reads them back)
    prefilter_part(a, r, floor_x, sh, red);
  }
}

// ---- kernel 5: selection and the draw -------------------------------------------------------

struct Hist {
  unsigned int count[256];
  unsigned long long lo[256], hi[256];
};

namespace cg = cooperative_groups;

/// Adds every lane's element to bucket d (d = 256: none) of h, with one shared atomic per
/// distinct bucket and warp: the first radix passes put most of a row into a few buckets, where
/// one atomic per element would serialise. With `mass`, the bucket's mass grows by f (exact:
/// 32-bit halves are summed in 64 bits, then added as 128 bits). Every lane of the warp must
/// call it (the callers' loops have warp-uniform trip counts).
__device__ __forceinline__ void hist_add(Hist& h, unsigned d, unsigned long long f, bool mass) {
  if (__all_sync(kFull, d >= 256u)) return;
  const cg::coalesced_group warp = cg::coalesced_threads();
  const cg::coalesced_group g = cg::labeled_partition(warp, d);
  unsigned long long lo = 0ull, hi = 0ull;
  if (mass) {
    lo = cg::reduce(g, f & 0xffffffffull, cg::plus<unsigned long long>());
    hi = cg::reduce(g, f >> 32, cg::plus<unsigned long long>());
  }
  if (d < 256u && g.thread_rank() == 0) {
    atomicAdd(&h.count[d], g.size());
    if (mass) {
      const U128 sum = add(U128{hi << 32, hi >> 32}, u128(lo));
      if (sum.lo) {
        const unsigned long long old = atomicAdd(&h.lo[d], sum.lo);
        if (old + sum.lo < old) atomicAdd(&h.hi[d], 1ull);
      }
      if (sum.hi) atomicAdd(&h.hi[d], sum.hi);
    }
  }
}

/// Warp 0 finds the bucket (scanning from 255 down) where the running count reaches `need`
/// (by_mass = false) or where base + running mass reaches `target` (by_mass = true), and
/// writes it to *bin, the count still needed inside it to *need_out, the mass above it to
/// *base_out and the bucket's count to *bin_count. The caller syncs before and after.
__device__ void find_bucket(const Hist& h, bool by_mass, unsigned need, U128 base, double target, int* bin,
                            unsigned* need_out, U128* base_out, unsigned* bin_count) {
  const int lane = threadIdx.x % 32;
  // Lane l owns buckets 255 − 8l … 248 − 8l (descending).
  unsigned c = 0;
  U128 mass = u128(0);
  for (int j = 0; j < 8; ++j) {
    const int b = 255 - (8 * lane + j);
    c += h.count[b];
    mass = add(mass, U128{h.lo[b], h.hi[b]});
  }
  unsigned ci = c;
  U128 mi = mass;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned cu = __shfl_up_sync(kFull, ci, o);
    const U128 mu = shfl_up(mi, o);
    if (lane >= o) {
      ci += cu;
      mi = add(mi, mu);
    }
  }
  const bool reached = by_mass ? to_double(add(base, mi)) >= target : ci >= need;
  const unsigned ballot = __ballot_sync(kFull, reached);
  // The caller guarantees that the last lane reaches it; fall back to lane 31 regardless.
  const int first = ballot ? __ffs(ballot) - 1 : 31;
  if (lane == first) {
    unsigned cc = ci - c;  // count above this lane's buckets
    U128 mm;               // mass above this lane's buckets
    mm.lo = mi.lo - mass.lo;
    mm.hi = mi.hi - mass.hi - (mi.lo < mass.lo ? 1ull : 0ull);
    mm = add(base, mm);
    int chosen = 255 - (8 * lane + 7);
    for (int j = 0; j < 8; ++j) {
      const int b = 255 - (8 * lane + j);
      const U128 mb = U128{h.lo[b], h.hi[b]};
      const bool hit = by_mass ? to_double(add(mm, mb)) >= target : cc + h.count[b] >= need;
      if (hit || j == 7) {
        chosen = b;
        break;
      }
      cc += h.count[b];
      mm = add(mm, mb);
    }
    *bin = chosen;
    *need_out = need - cc;
    *base_out = mm;
    *bin_count = h.count[chosen];
  }
}

/// Top-p's crossing id among n gathered ids of one bucket (keys and exact masses in shared
/// memory, any order), for a block of kSelectThreads: the largest key whose inclusive most-
/// likely-first mass (`base`, the mass above the bucket, plus the ids with a key ≥ its own)
/// reaches `target`; 0 when none does. Every thread must call; all get the key.
__device__ unsigned long long crossing_key(const unsigned long long* keys, const unsigned long long* mass, int n,
                                           U128 base, double target, unsigned long long* red) {
  const int t = threadIdx.x;
  unsigned long long hit = 0ull;
  if (t < n) {
    U128 incl = base;
    for (int j = 0; j < n; ++j)
      if (keys[j] >= keys[t]) incl = add(incl, u128(mass[j]));
    if (to_double(incl) >= target) hit = keys[t];
  }
  return block_max_key(hit, red, kSelectWarps);
}

static_assert(kBuckets == 2 * kSelectThreads, "top_p_bucket: two buckets per thread");

/// select_kernel, top-p without top-k: from the per-part totals and the histogram of C, the
/// bucket where C's most-likely-first mass first reaches top_p · total. Returns true when the
/// rest is left to gather_kernel / cutoff_kernel / draw_kernel: the control block then holds
/// the bucket, the exact mass above it and the target (or no bucket when C's whole mass stays
/// below the target: no cut). Returns false when that bucket holds more than kCompactMax ids,
/// for the caller's single-block radix search. The sums and comparisons are those of the
/// radix search, so both find the same crossing id.
__device__ bool top_p_bucket(const SampleRowArgs& a, const RowScratch& r, Scratch<kSelectWarps>& s, U128* sh_base) {
  unsigned long long lo = 0ull, hi = 0ull;
  for (int j = threadIdx.x; j < a.n_parts; j += kSelectThreads) lo += r.part_slo[j], hi += r.part_shi[j];
  const U128 lo_sum = block_sum(u128(lo), s), hi_sum = block_sum(u128(hi), s);  // each < 2^63
  const U128 total = from_split(lo_sum.lo, hi_sum.lo);
  const int b0 = 2 * static_cast<int>(threadIdx.x);
  const U128 m0 = from_split(r.hist_slo[b0], r.hist_shi[b0]);
  const U128 m1 = from_split(r.hist_slo[b0 + 1], r.hist_shi[b0 + 1]);
  const U128 pair = add(m0, m1);
  U128 cand;
  const U128 above = block_exclusive_scan(pair, s, &cand);
  const double target = static_cast<double>(a.top_p) * to_double(total);
  if (!(to_double(cand) >= target)) return true;  // the CPU keeps every candidate
  int mine = INT_MAX;
  U128 base = above;
  if (to_double(add(above, m0)) >= target) {
    mine = b0;
  } else if (to_double(add(above, pair)) >= target) {
    mine = b0 + 1;
    base = add(above, m0);
  }
  const int bucket = block_min_int(mine, s);
  if (mine != INT_MAX && mine == bucket) *sh_base = base;
  __syncthreads();
  if (bucket == INT_MAX || r.hist_cnt[bucket] > static_cast<unsigned long long>(kCompactMax)) return false;
  if (threadIdx.x == 0) {
    r.ctl->bucket = bucket;
    r.ctl->base_lo = sh_base->lo;
    r.ctl->base_hi = sh_base->hi;
    r.ctl->target = target;
  }
  return true;
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const SampleRowArgs* rows) {
  __shared__ Hist h;
  __shared__ Scratch<kSelectWarps> s;
  __shared__ unsigned long long red[33];
  __shared__ int sh_bin;
  __shared__ unsigned sh_need, sh_count;
  __shared__ U128 sh_base;
  __shared__ unsigned long long t_lo[kMaxTiles], t_hi[kMaxTiles];  // the draw's mass per tile
  __shared__ int sh_tile;
  __shared__ int c_n;                        // compacted top-k set (top_k ≤ kCompactMax)
  __shared__ int c_id[kCompactMax];
  __shared__ unsigned long long c_key[kCompactMax], c_f[kCompactMax];
  __shared__ unsigned char c_ok[kCompactMax];  // bit 0: x ≥ floor (min-p); bit 1: weight > 0

  const SampleRowArgs a = rows[blockIdx.x];
  if (a.greedy) return;  // weight_kernel wrote the argmax
  const int V = a.vocab;
  const float* x = a.work;
  const float* w = a.weight;
  const RowScratch r = scratch_of(a);
  const unsigned long long best = row_max_key(a, red, kSelectWarps);
  const float m = key_float(static_cast<uint32_t>(best >> 32));
  const bool use_k = uses_top_k(a);
  const bool use_p = a.top_p < 1.0f;
  const double floor_x = a.use_min_p ? static_cast<double>(m) + a.log_min_p : -INFINITY;

  // No top-k: the draw (and top-p's crossing bucket, when it holds few enough ids) is left to
  // the kernels after this one; they read the threshold and the floor from the control block.
  if (!use_k) {
    bool leave = !use_p;
    if (use_p) leave = top_p_bucket(a, r, s, &sh_base);
    if (leave) {
      if (threadIdx.x == 0) {
        r.ctl->thr = 0ull;
        r.ctl->best = best;
        r.ctl->floor_x = floor_x;
        r.ctl->m = m;
        r.ctl->pending = 1;
      }
      return;
    }
  }

  // Top-k: the key of the k-th best id (radix select, 8 bits a pass, stops once the bucket is
  // taken whole). Members: key ≥ thr.
  unsigned long long thr = 0ull;
  const bool small_k = use_k && a.top_k <= kCompactMax;
  bool compacted = false;  // c_* hold every id with key ≥ the top-k threshold (and maybe more)
  if (prefilter_path(a)) {
    // weight_kernel gathered every id whose key reaches the k-th largest per-warp maximum (a
    // lower bound of the k-th largest key): the top-k set and, on real rows, few more ids. If
    // they fit, select the k-th key among them exactly.
    const int n = static_cast<int>(r.ctl->list_n);  // ≥ top_k: the k warp maxima are in
    if (n <= kCompactMax) {
      const int t = threadIdx.x;
      if (t < n) {
        const unsigned long long idok = r.list_idok[t];
        c_id[t] = static_cast<int>(static_cast<uint32_t>(idok));
        c_key[t] = r.list_key[t];
        c_f[t] = r.list_f[t];
        c_ok[t] = static_cast<unsigned char>(idok >> 32);
      }
      if (t == 0) c_n = n;
      __syncthreads();
      compacted = true;
      unsigned long long kth = 0ull;
      if (t < n) {
        int rank = 0;
        for (int j = 0; j < n; ++j) rank += c_key[j] > c_key[t] ? 1 : 0;
        if (rank == a.top_k - 1) kth = c_key[t];  // keys are distinct (they hold the id)
      }
      thr = block_max_key(kth, red, kSelectWarps);
    }
    __syncthreads();
  }
  if (use_k && !compacted) {
    unsigned long long prefix = 0ull, mask = 0ull;
    unsigned need = static_cast<unsigned>(a.top_k);
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += kSelectThreads) h.count[b] = 0u, h.lo[b] = 0ull, h.hi[b] = 0ull;
      __syncthreads();
      for (int row0 = 0; row0 < V; row0 += kSelectThreads) {  // warp-uniform trip count
        const int i = row0 + static_cast<int>(threadIdx.x);
        unsigned d = 256u;
        if (i < V) {
          const unsigned long long key = comp_key(x[i], i);
          if ((key & mask) == prefix) d = static_cast<unsigned>((key >> shift) & 255u);
        }
        hist_add(h, d, 0ull, false);
      }
      __syncthreads();
      if (threadIdx.x < 32) find_bucket(h, false, need, u128(0), 0.0, &sh_bin, &sh_need, &sh_base, &sh_count);
      __syncthreads();
      const int bin = sh_bin;
      need = sh_need;
      const unsigned in_bin = sh_count;
      __syncthreads();
      prefix |= static_cast<unsigned long long>(bin) << shift;
      mask |= 255ull << shift;
      if (in_bin == need) break;  // every id in the bucket is in: keys ≥ prefix
    }
    thr = prefix;
  }

  if (small_k) {
    // The ids with key ≥ thr in shared memory (any order: every sum below is exact, every
    // choice a max / min), then top-p and the draw over them alone, with the same integer sums
    // and comparisons as the general path below, so both give the same id. Entries with a key
    // below thr (left by the pre-filter) are skipped.
    if (!compacted) {
    if (threadIdx.x == 0) c_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += kSelectThreads) {
      const unsigned long long key = comp_key(x[i], i);
      if (key < thr) continue;
      const int slot = atomicAdd(&c_n, 1);
      if (slot >= kCompactMax) continue;  // cannot happen: exactly top_k keys are ≥ thr
      c_id[slot] = i;
      c_key[slot] = key;
      c_f[slot] = fixed_weight(w[i]);
      c_ok[slot] = static_cast<unsigned char>((static_cast<double>(x[i]) >= floor_x ? 1 : 0) | (w[i] > 0.0f ? 2 : 0));
    }
    __syncthreads();
    }
    const int n = min(c_n, kCompactMax);
    const int t = threadIdx.x;
    const bool mine = t < n && c_key[t] >= thr;  // in the top-k set
    unsigned long long thr_c = thr;
    if (use_p) {
      const U128 total = block_sum(u128(mine ? c_f[t] : 0ull), s);
      const U128 cand = block_sum(u128(mine && (c_ok[t] & 1) ? c_f[t] : 0ull), s);
      const double target = static_cast<double>(a.top_p) * to_double(total);
      if (to_double(cand) >= target) {
        // The crossing id: the largest key whose inclusive most-likely-first mass reaches target.
        unsigned long long hit = 0ull;
        if (mine && (c_ok[t] & 1)) {
          U128 incl = u128(0);
          for (int j = 0; j < n; ++j)
            if ((c_ok[j] & 1) && c_key[j] >= c_key[t]) incl = add(incl, u128(c_f[j]));
          if (to_double(incl) >= target) hit = c_key[t];
        }
        thr_c = max(thr_c, block_max_key(hit, red, kSelectWarps));
      }
    }
    const bool surv = mine && c_key[t] >= thr_c && (c_ok[t] & 3) == 3;
    const U128 total = block_sum(u128(surv ? c_f[t] : 0ull), s);
    const int last = block_max_int(surv ? c_id[t] : -1, s);
    const double target = philox_uniform(a.seed, a.step) * to_double(total);
    int cand = INT_MAX;
    if (surv) {
      U128 incl = u128(0);
      for (int j = 0; j < n; ++j)
        if (c_key[j] >= thr_c && (c_ok[j] & 3) == 3 && c_id[j] <= c_id[t]) incl = add(incl, u128(c_f[j]));
      if (to_double(incl) > target) cand = c_id[t];
    }
    const int found = block_min_int(cand, s);
    if (threadIdx.x == 0) {
      int id = found != INT_MAX ? found : last;
      if (id < 0) id = best == 0ull ? 0 : key_id(best);
      *a.out_id = id;
    }
    return;
  }

  // Top-p over C = {key ≥ thr} ∩ {x ≥ floor}: the shortest most-likely-first prefix whose mass
  // reaches top_p · mass({key ≥ thr}). Radix search on the key with bucket masses.
  if (use_p) {
    U128 total = u128(0), cand = u128(0);
    for (int i = threadIdx.x; i < V; i += kSelectThreads) {
      if (comp_key(x[i], i) < thr) continue;
      const U128 f = u128(fixed_weight(w[i]));
      total = add(total, f);
      if (static_cast<double>(x[i]) >= floor_x) cand = add(cand, f);
    }
    total = block_sum(total, s);
    cand = block_sum(cand, s);
    const double target = static_cast<double>(a.top_p) * to_double(total);
    if (to_double(cand) >= target) {  // else the CPU keeps every candidate
      const unsigned long long thr_k = thr;
      unsigned long long prefix = 0ull, mask = 0ull;
      U128 base = u128(0);
      for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += kSelectThreads) h.count[b] = 0u, h.lo[b] = 0ull, h.hi[b] = 0ull;
        __syncthreads();
        for (int row0 = 0; row0 < V; row0 += kSelectThreads) {  // warp-uniform trip count
          const int i = row0 + static_cast<int>(threadIdx.x);
          unsigned d = 256u;
          unsigned long long f = 0ull;
          if (i < V) {
            const unsigned long long key = comp_key(x[i], i);
            if (key >= thr_k && (key & mask) == prefix && static_cast<double>(x[i]) >= floor_x) {
              d = static_cast<unsigned>((key >> shift) & 255u);
              f = fixed_weight(w[i]);
            }
          }
          hist_add(h, d, f, true);
        }
        __syncthreads();
        if (threadIdx.x < 32) find_bucket(h, true, 0u, base, target, &sh_bin, &sh_need, &sh_base, &sh_count);
        __syncthreads();
        const int bin = sh_bin;
        const unsigned in_bin = sh_count;
        base = sh_base;
        __syncthreads();
        prefix |= static_cast<unsigned long long>(bin) << shift;
        mask |= 255ull << shift;
        if (in_bin <= 1u) break;  // the crossing id is alone in its bucket: keys ≥ prefix
        if (in_bin <= static_cast<unsigned>(kCompactMax)) {
          // Few enough ids left in the bucket: gather them and find the crossing one directly,
          // with the same exact sums (base + the bucket's ids with a key ≥ its own).
          if (threadIdx.x == 0) c_n = 0;
          __syncthreads();
          for (int i = threadIdx.x; i < V; i += kSelectThreads) {
            const unsigned long long key = comp_key(x[i], i);
            if (key < thr_k || (key & mask) != prefix || !(static_cast<double>(x[i]) >= floor_x)) continue;
            const int slot = atomicAdd(&c_n, 1);
            if (slot >= kCompactMax) continue;  // cannot happen: in_bin ids match
            c_key[slot] = key;
            c_f[slot] = fixed_weight(w[i]);
          }
          __syncthreads();
          prefix = crossing_key(c_key, c_f, min(c_n, kCompactMax), base, target, red);
          break;
        }
      }
      thr = max(thr, prefix);
    }
  }

  // The draw over S = {key ≥ thr} ∩ {x ≥ floor}, ascending ids: the first with positive weight
  // whose cumulative mass exceeds u · mass(S); the last such id if rounding never gets there.
  // One coalesced pass sums the mass per tile of kTile ids (exact, so in any order), then only
  // the tile where the cumulative mass crosses u · total is scanned id by id.
  const int n_tiles = (V + kTile - 1) / kTile;
  const bool tiled = n_tiles <= kMaxTiles;
  for (int b = threadIdx.x; b < kMaxTiles; b += kSelectThreads) t_lo[b] = 0ull, t_hi[b] = 0ull;
  __syncthreads();
  U128 total = u128(0);
  int last = -1;
  for (int tile = 0; tile < n_tiles; ++tile) {  // block-uniform trip count
    U128 tl = u128(0);
    for (int j = 0; j < kPerThread; ++j) {
      const int i = tile * kTile + j * kSelectThreads + static_cast<int>(threadIdx.x);
      if (i >= V || comp_key(x[i], i) < thr || !(static_cast<double>(x[i]) >= floor_x) || !(w[i] > 0.0f)) continue;
      tl = add(tl, u128(fixed_weight(w[i])));
      last = max(last, i);
    }
    total = add(total, tl);
    if (tiled) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) tl = add(tl, shfl_xor(tl, o));
      if (threadIdx.x % 32 == 0 && (tl.lo | tl.hi)) {
        const unsigned long long old = atomicAdd(&t_lo[tile], tl.lo);
        atomicAdd(&t_hi[tile], tl.hi + (old + tl.lo < old ? 1ull : 0ull));
      }
    }
  }
  total = block_sum(total, s);  // its barriers also publish t_lo / t_hi
  last = block_max_int(last, s);
  const double target = philox_uniform(a.seed, a.step) * to_double(total);
  U128 running = u128(0);
  int start = 0;
  if (tiled) {
    if (threadIdx.x == 0) {
      U128 r = u128(0);
      int k = 0;
      for (; k < n_tiles; ++k) {
        const U128 next = add(r, U128{t_lo[k], t_hi[k]});
        if (to_double(next) > target) break;
        r = next;
      }
      sh_tile = k;
      sh_base = r;
    }
    __syncthreads();
    start = sh_tile;
    running = sh_base;
    __syncthreads();
  }
  int found = INT_MAX;
  for (int tile0 = start * kTile; tile0 < V; tile0 += kTile) {
    const int first = tile0 + static_cast<int>(threadIdx.x) * kPerThread;
    U128 local = u128(0);
    for (int j = 0; j < kPerThread; ++j) {
      const int i = first + j;
      if (i < V && comp_key(x[i], i) >= thr && static_cast<double>(x[i]) >= floor_x && w[i] > 0.0f)
        local = add(local, u128(fixed_weight(w[i])));
    }
    U128 tile_total;
    const U128 before = add(running, block_exclusive_scan(local, s, &tile_total));
    const U128 after = add(running, tile_total);
    if (to_double(after) > target) {  // block-uniform: the crossing is in this tile
      U128 c = before;
      int cand = INT_MAX;
      for (int j = 0; j < kPerThread; ++j) {
        const int i = first + j;
        if (i < V && comp_key(x[i], i) >= thr && static_cast<double>(x[i]) >= floor_x && w[i] > 0.0f) {
          c = add(c, u128(fixed_weight(w[i])));
          if (to_double(c) > target) {
            cand = i;
            break;
          }
        }
      }
      found = block_min_int(cand, s);
      break;
    }
    running = after;
  }
  if (threadIdx.x == 0) {
    int id = found != INT_MAX ? found : last;
    if (id < 0) id = best == 0ull ? 0 : key_id(best);  // nothing with weight: the argmax
    *a.out_id = id;
  }
}

// ---- kernels 6–8: the top-p cutoff and the draw on many blocks ----------------------------

/// The ids of C in the crossing bucket (select_kernel's top_p_bucket), gathered into the list.
__global__ void __launch_bounds__(kThreads) gather_kernel(const SampleRowArgs* rows) {
  const SampleRowArgs a = rows[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= a.n_parts || a.greedy) return;
  const RowScratch r = scratch_of(a);
  if (!r.ctl->pending || r.ctl->bucket < 0) return;  // row-uniform
  const int bucket = r.ctl->bucket;
  const float m = r.ctl->m;
  const double floor_x = r.ctl->floor_x;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads) {
    const float x = a.work[i];
    if (!(static_cast<double>(x) >= floor_x) || bucket_of(x, m) != bucket) continue;
    const unsigned slot = atomicAdd(&r.ctl->list_n, 1u);
    if (slot >= static_cast<unsigned>(kCompactMax)) continue;  // cannot happen: the bucket's count fits
    r.list_key[slot] = comp_key(x, i);
    r.list_f[slot] = fixed_weight(a.weight[i]);
  }
}

/// The top-p threshold: the largest key of the gathered bucket whose inclusive most-likely-
/// first mass (the mass above the bucket plus the bucket's ids with a key ≥ its own) reaches
/// the target.
__global__ void __launch_bounds__(kSelectThreads) cutoff_kernel(const SampleRowArgs* rows) {
  __shared__ unsigned long long c_key[kCompactMax], c_f[kCompactMax];
  __shared__ unsigned long long red[33];
  const SampleRowArgs a = rows[blockIdx.x];
  if (a.greedy) return;
  const RowScratch r = scratch_of(a);
  if (!r.ctl->pending || r.ctl->bucket < 0) return;  // block-uniform
  const int n = min(static_cast<int>(r.ctl->list_n), kCompactMax);
  const U128 base{r.ctl->base_lo, r.ctl->base_hi};
  const double target = r.ctl->target;
  const int t = threadIdx.x;
  if (t < n) c_key[t] = r.list_key[t], c_f[t] = r.list_f[t];
  __syncthreads();
  const unsigned long long crossing = crossing_key(c_key, c_f, n, base, target, red);
  if (t == 0) r.ctl->thr = crossing;  // no top-k on this path: the threshold is the crossing key
}

/// draw_kernel's last block: the draw from the per-chunk masses. The first chunk (ascending)
/// where the cumulative mass exceeds u · total, then, in it, the first surviving id where it
/// does, with the same exact sums and comparisons as the single-block draw.
__device__ void draw_from_chunks(const SampleRowArgs& a, const RowScratch& r, unsigned long long thr, double floor_x,
                                 Scratch<kWarpsPerPart>& s, U128* sh_base) {
  const int nc = chunks_for(a.vocab);
  const int per = (nc + kThreads - 1) / kThreads;
  const int c0 = static_cast<int>(threadIdx.x) * per;
  U128 local = u128(0);
  int last = -1;
  for (int k = 0; k < per; ++k) {
    const int c = c0 + k;
    if (c >= nc) break;
    local = add(local, from_split(__ldcg(&r.chunk_slo[c]), __ldcg(&r.chunk_shi[c])));
    last = max(last, static_cast<int>(__ldcg(&r.chunk_last[c])));
  }
  U128 total;
  const U128 before = block_exclusive_scan(local, s, &total);
  last = block_max_int(last, s);
  const double target = philox_uniform(a.seed, a.step) * to_double(total);
  int mine = INT_MAX;
  U128 run = before;
  for (int k = 0; k < per; ++k) {
    const int c = c0 + k;
    if (c >= nc) break;
    const U128 next = add(run, from_split(__ldcg(&r.chunk_slo[c]), __ldcg(&r.chunk_shi[c])));
    if (to_double(next) > target) {
      mine = c;
      break;
    }
    run = next;
  }
  const int chunk = block_min_int(mine, s);
  if (mine != INT_MAX && mine == chunk) *sh_base = run;
  __syncthreads();
  int found = INT_MAX;
  if (chunk != INT_MAX && threadIdx.x < 32) {
    // One warp over the chunk's 256 ids, 8 consecutive ids a lane.
    const int lane = threadIdx.x;
    const int first = chunk * kThreads + lane * 8;
    unsigned long long f[8];
    bool in[8];
    U128 lane_sum = u128(0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = first + j;
      in[j] = false;
      f[j] = 0ull;
      if (i < a.vocab) {
        const float x = a.work[i], w = a.weight[i];
        in[j] = comp_key(x, i) >= thr && static_cast<double>(x) >= floor_x && w > 0.0f;
        if (in[j]) f[j] = fixed_weight(w);
      }
      lane_sum = add(lane_sum, u128(f[j]));
    }
    U128 incl = lane_sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const U128 up = shfl_up(incl, o);
      if (lane >= o) incl = add(incl, up);
    }
    U128 c;  // the mass before this lane's ids: base + (inclusive − own)
    c.lo = incl.lo - lane_sum.lo;
    c.hi = incl.hi - lane_sum.hi - (incl.lo < lane_sum.lo ? 1ull : 0ull);
    c = add(*sh_base, c);
    int cand = INT_MAX;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (in[j] && cand == INT_MAX) {
        c = add(c, u128(f[j]));
        if (to_double(c) > target) cand = first + j;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(kFull, cand, o));
    found = cand;
  }
  if (threadIdx.x == 0) {
    int id = found != INT_MAX ? found : last;
    const unsigned long long best = r.ctl->best;
    if (id < 0) id = best == 0ull ? 0 : key_id(best);  // nothing with weight: the argmax
    *a.out_id = id;
  }
}

/// The draw over S = {key ≥ thr} ∩ {x ≥ floor} ∩ {weight > 0} (thresholds from the control
/// block): each block sums the exact mass and the last id of S per chunk of 256 consecutive
/// ids (chunk c belongs to block c mod n_parts, as the ids of every other kernel do), and the
/// last block to finish draws from the chunk sums.
__global__ void __launch_bounds__(kThreads) draw_kernel(const SampleRowArgs* rows) {
  __shared__ Scratch<kWarpsPerPart> s;
  __shared__ unsigned long long red[33];
  __shared__ U128 sh_base;
  __shared__ bool is_last;
  const SampleRowArgs a = rows[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= a.n_parts || a.greedy) return;
  const RowScratch r = scratch_of(a);
  if (!r.ctl->pending) return;  // row-uniform: select_kernel drew already
  const unsigned long long thr = r.ctl->thr;
  const double floor_x = r.ctl->floor_x;
  const int nc = chunks_for(a.vocab);
  for (int c = blockIdx.x; c < nc; c += a.n_parts) {  // block-uniform
    const int i = c * kThreads + static_cast<int>(threadIdx.x);
    unsigned long long f = 0ull;
    int last = -1;
    if (i < a.vocab) {
      const float x = a.work[i], w = a.weight[i];
      if (comp_key(x, i) >= thr && static_cast<double>(x) >= floor_x && w > 0.0f) {
        f = fixed_weight(w);
        last = i;
      }
    }
    const unsigned long long lo = block_sum_u64(f & 0xffffffffull, red);
    const unsigned long long hi = block_sum_u64(f >> 32, red);
    last = block_max_int(last, s);
    if (threadIdx.x == 0) {
      r.chunk_slo[c] = lo;
      r.chunk_shi[c] = hi;
      r.chunk_last[c] = last;
    }
  }
  // The last block to get here reads every chunk (threadfence before counting, L2 reads after).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&r.ctl->draw_done, 1u) == static_cast<unsigned>(a.n_parts - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  draw_from_chunks(a, r, thr, floor_x, s, &sh_base);
}

__global__ void uniform_kernel(unsigned long long seed, const unsigned long long* steps, int n, double* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = philox_uniform(seed, steps[i]);
}

int parts_for(int64_t vocab) {
  const int64_t per_block = int64_t(kThreads) * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxParts, (vocab + per_block - 1) / per_block)));
}

}  // namespace

int sample_partial_slots(int64_t vocab) { return parts_for(vocab); }

int64_t sample_scratch_slots(int64_t vocab) {
  if (vocab <= 0 || vocab > INT_MAX / 2) throw ::lily::InternalError("sample_scratch_slots: bad vocab");
  return scratch_slots_for(static_cast<int>(vocab));
}

void launch_sample_rows(const SampleRowArgs* d_rows, int n_rows, int64_t max_vocab, cudaStream_t stream) {
  if (n_rows <= 0 || n_rows > 65535 || max_vocab <= 0 || max_vocab > INT_MAX / 2)
    throw ::lily::InternalError("launch_sample_rows: bad shape");
  const int parts = parts_for(max_vocab);
  const dim3 wide(parts, n_rows);
  const auto step = [&](void (*kernel)(const SampleRowArgs*), dim3 grid, int threads) {
    kernel<<<grid, threads, 0, stream>>>(d_rows);
    LILY_CUDA_CHECK_LAUNCH();
  };
  step(scale_kernel, wide, kThreads);
  step(edit_kernel, n_rows, kThreads);
  step(max_kernel, wide, kThreads);
  step(weight_kernel, wide, kThreads);
  step(select_kernel, n_rows, kSelectThreads);
  step(gather_kernel, wide, kThreads);
  step(cutoff_kernel, n_rows, kSelectThreads);
  step(draw_kernel, wide, kThreads);
}

void launch_sample_uniforms(uint64_t seed, const unsigned long long* steps, int n, double* out, cudaStream_t stream) {
  if (n <= 0) return;
  uniform_kernel<<<(n + 255) / 256, 256, 0, stream>>>(seed, steps, n, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
