// The device sampler (sampler_kernels.h): engine/sampler.h's contract on the device. Per row:
//   1. scale_kernel   (many blocks): work[i] = logits[i] / T (a copy when greedy);
//   2. edit_kernel    (one block):   work[id] = apply_penalty_edit(logits[id]) / T per edit;
//   3. max_kernel     (many blocks): per-block max of the composite key (below);
//   4. weight_kernel  (many blocks): m = the max; greedy: out = its id; else weight[i] =
//                                    fp32 exp(work[i] − m) (exp in fp64, rounded once);
//   5. select_kernel  (one block of 1024 per row): top-k threshold by a radix select on the
//      composite key, top-p cutoff by a radix search on exact probability mass, min-p as a
//      floor, then the draw: the first surviving id (ascending) whose cumulative mass exceeds
//      u · total, with u = sample_uniform(seed, step) computed here by the same Philox.
// No sort of the vocabulary anywhere: each radix pass is one histogram of 256 buckets.
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

/// Shared scratch of the select kernel's reductions.
struct Scratch {
  U128 u[kSelectWarps + 1];
  unsigned long long k[kSelectWarps + 1];
  int i[kSelectWarps + 1];
};

__device__ U128 block_sum(U128 v, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = add(v, shfl_xor(v, o));
  if (lane == 0) s.u[warp] = v;
  __syncthreads();
  if (warp == 0) {
    U128 t = lane < kSelectWarps ? s.u[lane] : u128(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = add(t, shfl_xor(t, o));
    if (lane == 0) s.u[kSelectWarps] = t;
  }
  __syncthreads();
  const U128 r = s.u[kSelectWarps];
  __syncthreads();
  return r;
}

/// Exclusive prefix sum over the threads in threadIdx order; *total gets the block's sum.
__device__ U128 block_exclusive_scan(U128 v, Scratch& s, U128* total) {
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
    const U128 t = lane < kSelectWarps ? s.u[lane] : u128(0);
    U128 ti = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const U128 up = shfl_up(ti, o);
      if (lane >= o) ti = add(ti, up);
    }
    // exclusive = inclusive − own (exact 128-bit subtraction)
    if (lane < kSelectWarps) {
      U128 ex;
      ex.lo = ti.lo - t.lo;
      ex.hi = ti.hi - t.hi - (ti.lo < t.lo ? 1ull : 0ull);
      s.u[lane] = ex;
    }
    if (lane == 31) s.u[kSelectWarps] = ti;  // lane 31 ≥ kSelectWarps − 1: the block total
  }
  __syncthreads();
  U128 ex_lane;  // exclusive within the warp
  ex_lane.lo = incl.lo - v.lo;
  ex_lane.hi = incl.hi - v.hi - (incl.lo < v.lo ? 1ull : 0ull);
  const U128 r = add(s.u[warp], ex_lane);
  *total = s.u[kSelectWarps];
  __syncthreads();
  return r;
}

__device__ unsigned long long block_max_key(unsigned long long v, unsigned long long* red, int n_warps) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned long long t = lane < n_warps ? red[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = max(t, __shfl_xor_sync(kFull, t, o));
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const unsigned long long r = red[32];
  __syncthreads();
  return r;
}

__device__ int block_min_int(int v, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFull, v, o));
  if (lane == 0) s.i[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int t = lane < kSelectWarps ? s.i[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(kFull, t, o));
    if (lane == 0) s.i[kSelectWarps] = t;
  }
  __syncthreads();
  const int r = s.i[kSelectWarps];
  __syncthreads();
  return r;
}

__device__ int block_max_int(int v, Scratch& s) { return -block_min_int(-v, s); }

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
  unsigned long long best = 0ull;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads)
    best = max(best, comp_key(a.work[i], i));
  best = block_max_key(best, red, kThreads / 32);
  if (threadIdx.x == 0) a.part_keys[blockIdx.x] = best;
}

/// The row's max composite key from the n_parts per-block maxima of max_kernel (blocks past a
/// row's n_parts do nothing in every kernel; the row's ids are strided over its n_parts blocks).
__device__ unsigned long long row_max_key(const SampleRowArgs& a, unsigned long long* red, int n_warps) {
  unsigned long long k = 0ull;
  for (int j = threadIdx.x; j < a.n_parts; j += n_warps * 32) k = max(k, a.part_keys[j]);
  return block_max_key(k, red, n_warps);
}

__global__ void __launch_bounds__(kThreads) weight_kernel(const SampleRowArgs* rows) {
  __shared__ unsigned long long red[33];
  const SampleRowArgs a = rows[blockIdx.y];  // a copy: no aliasing with the rows it writes
  if (static_cast<int>(blockIdx.x) >= a.n_parts) return;  // block-uniform
  const unsigned long long best = row_max_key(a, red, kThreads / 32);
  if (a.greedy) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.out_id = best == 0ull ? 0 : key_id(best);
    return;
  }
  const float m = key_float(static_cast<uint32_t>(best >> 32));
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.vocab; i += a.n_parts * kThreads)
    a.weight[i] = static_cast<float>(exp(static_cast<double>(__fsub_rn(a.work[i], m))));
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

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const SampleRowArgs* rows) {
  __shared__ Hist h;
  __shared__ Scratch s;
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
  const unsigned long long best = row_max_key(a, red, kSelectWarps);
  const float m = key_float(static_cast<uint32_t>(best >> 32));
  const bool use_k = a.top_k > 0 && a.top_k < V;
  const bool use_p = a.top_p < 1.0f;
  const double floor_x = a.use_min_p ? static_cast<double>(m) + a.log_min_p : -INFINITY;

  // Top-k: the key of the k-th best id (radix select, 8 bits a pass, stops once the bucket is
  // taken whole). Members: key ≥ thr.
  unsigned long long thr = 0ull;
  const bool small_k = use_k && a.top_k <= kCompactMax;
  bool compacted = false;  // c_* hold every id with key ≥ the top-k threshold (and maybe more)
  if (small_k && a.top_k <= a.n_parts) {
    // Pre-filter: the k-th largest of the per-block maxima (max_kernel's parts, k distinct ids)
    // bounds the k-th largest key from below, so {key ≥ it} holds the top-k set and, on real
    // rows, few more ids. Gather them; if they fit, select the k-th key among them exactly.
    unsigned long long lk = 0ull;
    if (static_cast<int>(threadIdx.x) < a.n_parts) {
      const unsigned long long mine_k = a.part_keys[threadIdx.x];
      int rank = 0;
      for (int j = 0; j < a.n_parts; ++j) rank += a.part_keys[j] > mine_k ? 1 : 0;
      if (rank == a.top_k - 1) lk = mine_k;
    }
    const unsigned long long bound = block_max_key(lk, red, kSelectWarps);
    if (threadIdx.x == 0) c_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += kSelectThreads) {
      const unsigned long long key = comp_key(x[i], i);
      if (key < bound) continue;
      const int slot = atomicAdd(&c_n, 1);
      if (slot >= kCompactMax) continue;  // too many: the radix select below instead
      c_id[slot] = i;
      c_key[slot] = key;
      c_f[slot] = fixed_weight(w[i]);
      c_ok[slot] = static_cast<unsigned char>((static_cast<double>(x[i]) >= floor_x ? 1 : 0) | (w[i] > 0.0f ? 2 : 0));
    }
    __syncthreads();
    const int n = c_n;  // ≥ top_k: the k block maxima are in
    if (n <= kCompactMax) {
      compacted = true;
      unsigned long long kth = 0ull;
      const int t = threadIdx.x;
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
          const int n = min(c_n, kCompactMax);
          const int t = threadIdx.x;
          unsigned long long hit = 0ull;
          if (t < n) {
            U128 incl = base;
            for (int j = 0; j < n; ++j)
              if (c_key[j] >= c_key[t]) incl = add(incl, u128(c_f[j]));
            if (to_double(incl) >= target) hit = c_key[t];
          }
          prefix = block_max_key(hit, red, kSelectWarps);  // the crossing id's key
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

void launch_sample_rows(const SampleRowArgs* d_rows, int n_rows, int64_t max_vocab, cudaStream_t stream) {
  if (n_rows <= 0 || n_rows > 65535 || max_vocab <= 0 || max_vocab > INT_MAX / 2)
    throw ::lily::InternalError("launch_sample_rows: bad shape");
  const int parts = parts_for(max_vocab);
  const dim3 wide(parts, n_rows);
  scale_kernel<<<wide, kThreads, 0, stream>>>(d_rows);
  LILY_CUDA_CHECK_LAUNCH();
  edit_kernel<<<n_rows, kThreads, 0, stream>>>(d_rows);
  LILY_CUDA_CHECK_LAUNCH();
  max_kernel<<<wide, kThreads, 0, stream>>>(d_rows);
  LILY_CUDA_CHECK_LAUNCH();
  weight_kernel<<<wide, kThreads, 0, stream>>>(d_rows);
  LILY_CUDA_CHECK_LAUNCH();
  select_kernel<<<n_rows, kSelectThreads, 0, stream>>>(d_rows);
  LILY_CUDA_CHECK_LAUNCH();
}

void launch_sample_uniforms(uint64_t seed, const unsigned long long* steps, int n, double* out, cudaStream_t stream) {
  if (n <= 0) return;
  uniform_kernel<<<(n + 255) / 256, 256, 0, stream>>>(seed, steps, n, out);
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
