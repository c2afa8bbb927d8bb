// Gated full-attention kernels (docs/model.md §3.4, numerics §4.3/§4.4): q/k RMSNorm +
// partial RoPE + KV append, split-K decode attention with a combine kernel, causal prefill
// attention; the sigmoid output gate is fused into the final write. Launchers are declared in
// mixer_kernels.h.
//
// Decode splits run on tensor cores (decode_split_mma, described at its section). The CUDA-core
// attention core below serves the prefill row kernel (the fallback of the flash prefill):
// a block of 8 warps serves one kv head and all G = nq/nkv query heads of its
// group, so each K/V row is read once for G queries. Warp w takes keys start+w, start+w+8, …;
// a lane holds 8 of the 256 dims. Each warp keeps, per query head, an online-softmax state
// (running max m, sum l, unnormalised accumulator) in fp32, in the log2 domain (scores are
// pre-multiplied by scale·log2 e, so exp2 replaces exp); the 8 warp states are merged in shared
// memory at the end. The head dim D ∈ {64, 128, 256} is a template parameter (a lane holds
// D/32 dims); the launchers dispatch on the runtime head_dim (dispatch_head_dim).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <string>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kMaxD = 256;              // largest head dim the kernels are compiled for
constexpr int kThreads = 256;           // 8 warps (attention core, any D)
constexpr int kWarps = kThreads / kWarp;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxRotaryHalf = kMaxD / 2;

/// Inverse RoPE frequencies, computed on the host exactly as the CPU reference does.
struct RopeFreqs {
  float inv[kMaxRotaryHalf];
};

// ---- q/k norm + RoPE + cache append ----------------------------------------------------------
//
// A block prepares one token (one row): its rotary_dim/2 (cos, sin) pairs are computed once into
// shared memory, then each warp takes whole heads (of the nq query heads and nkv kv heads), a lane
// holding N = D/32 consecutive dims in registers (one vector load), so the RMSNorm sum is a warp
// shuffle and no other block barrier is needed.

constexpr int kPrepMaxWarps = 32;  // heads beyond 32 are taken in rounds
constexpr int kPrepMaxThreads = kPrepMaxWarps * kWarp;

/// The arguments the prepare kernels share; a block's row t is one token.
///   qg     bf16 [rows, nq, 2·D]  row stride qg_stride; a head's query is the first D of its 2·D
///   k, v   bf16 [rows, nkv·D]    row stride kv_stride
///   q_norm, k_norm fp32 [D]      gains
///   q_out  bf16 [rows, nq, D]    contiguous
/// Every bf16 pointer and stride is aligned to N = D/32 elements (checked by prepare_args).
struct PrepareArgs {
  int nq, nkv, rotary_dim;
  float eps;
  RopeFreqs freqs;
  const bf16* qg;
  int64_t qg_stride;
  const bf16* k;
  const bf16* v;
  int64_t kv_stride;
  const float* q_norm;
  const float* k_norm;
  bf16* q_out;
};

/// (cos, sin) of inverse frequency `inv_freq` at position `pos`: cpu::rope_cos_sin's formula
/// (fp32 angle, double-precision cos and sin rounded to fp32), so the tables agree bit for bit.
__device__ __forceinline__ float2 rope_cos_sin(int64_t pos, float inv_freq) {
  const float angle = float(pos) * inv_freq;
  return make_float2(float(cos(double(angle))), float(sin(double(angle))));
}

/// One head's input as loaded by its warp, raw: this lane's N = kD/32 dims of x (the query or
/// the key) and, for a kv head, of the V row.
template <int kD>
struct HeadIn {
  typename Bf16Vec<kD / kWarp>::type x, v;
};

/// Loads head hh (< nq: query head hh, else kv head hh − nq) of row t; lane l takes dims
/// [l·N, l·N + N).
template <int kD>
__device__ __forceinline__ HeadIn<kD> load_head(const PrepareArgs& a, int t, int hh) {
  constexpr int N = kD / kWarp;
  const int d0 = (threadIdx.x % kWarp) * N;
  HeadIn<kD> in{};
  if (hh < a.nq) {
    in.x = load_bf16_raw<N>(a.qg + t * a.qg_stride + int64_t(hh) * 2 * kD + d0);
  } else {
    const int64_t at = t * a.kv_stride + int64_t(hh - a.nq) * kD + d0;
    in.x = load_bf16_raw<N>(a.k + at);
    in.v = load_bf16_raw<N>(a.v + at);
  }
  return in;
}

/// RMSNorm of a warp's head (y: this lane's N dims from d0) with gain, rounded to bf16:
/// y ← round_bf16((y·r)·gain), r = 1/√(Σy²/kD + eps) (the sum over the warp by shuffles).
template <int kD, int N>
__device__ __forceinline__ void rms_norm_head(float (&y)[N], const float* gain, int d0, float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < N; ++e) ss += y[e] * y[e];
  ss = warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(kD) + eps);
#pragma unroll
  for (int e = 0; e < N; ++e) y[e] = round_bf16((y[e] * r) * gain[d0 + e]);
}

/// Rotate-half RoPE of the leading 2·half dims of a warp's head (y: this lane's N dims), with the
/// token's (cos, sin) table cs [half]: y_d ← y_d·c − y_{d+half}·s (d < half), y_d·c + y_{d−half}·s
/// (half ≤ d < 2·half). The partner is half/N lanes away when half is a multiple of N (a
/// shuffle); otherwise it goes through the warp's `stage` row of N·32 floats.
template <int N>
__device__ __forceinline__ void rope_head(float (&y)[N], int half, const float2* cs, float* stage) {
  if (half == 0) return;
  const int lane = threadIdx.x % kWarp, d0 = lane * N;
  float p[N];  // the partners of this lane's dims
  if (half % N == 0) {
    const int q = half / N;  // ≤ 16
    const int src = lane < q ? lane + q : lane < 2 * q ? lane - q : lane;
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = __shfl_sync(0xffffffffu, y[e], src);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) stage[d0 + e] = y[e];
    __syncwarp();
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const int d = d0 + e;
      p[e] = d < 2 * half ? stage[d < half ? d + half : d - half] : 0.0f;
    }
    __syncwarp();  // the row is rewritten by this warp's next head
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const int d = d0 + e;
    if (d < 2 * half) {
      const float2 c = cs[d < half ? d : d - half];
      y[e] = d < half ? y[e] * c.x - p[e] * c.y : y[e] * c.x + p[e] * c.y;
    }
  }
}

/// Finishes head hh of row t at position `pos` from its loaded input: norm, RoPE, then q_out
/// (query head) or the K and V rows of `cache` at `pos` (kv head). One warp; `stage` is the
/// warp's staging row (rope_head).
template <int kD>
__device__ __forceinline__ void finish_head(const PrepareArgs& a, const HeadIn<kD>& in, int t, int hh, int64_t pos,
                                            const float2* cs, const KvCacheView& cache, float* stage) {
  constexpr int N = kD / kWarp;
  const int d0 = (threadIdx.x % kWarp) * N;
  const bool is_q = hh < a.nq;
  float y[N];
  unpack_bf16<N>(in.x, y);
  rms_norm_head<kD>(y, is_q ? a.q_norm : a.k_norm, d0, a.eps);
  rope_head<N>(y, a.rotary_dim / 2, cs, stage);
  if (is_q) {
    store_bf16_vec<N>(y, a.q_out + (int64_t(t) * a.nq + hh) * kD + d0);
  } else {
    const int64_t slot = (int64_t(hh - a.nq) * cache.capacity + pos) * kD + d0;
    store_bf16_vec<N>(y, cache.k + slot);
    *reinterpret_cast<typename Bf16Vec<N>::type*>(cache.v + slot) = in.v;
  }
}

/// Row t (one token at position `pos`, K/V appended to `cache`) by the whole block (the body of
/// both prepare kernels, so batched decode is bit-identical to T = 1): warp w's first head is
/// loaded, the (cos, sin) table is built (one block barrier), then warp w prepares heads
/// w, w + warps, … of the nq + nkv. Dynamic shared memory: the staging rows [warps, kD] fp32
/// when rope_head needs them (prepare_smem). The caller has run pdl_prologue.
template <int kD>
__device__ __forceinline__ void prepare_token(const PrepareArgs& a, int t, int64_t pos, const KvCacheView& cache) {
  __shared__ float2 cs[kMaxRotaryHalf];
  extern __shared__ float stage_rows[];
  const int warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp, heads = a.nq + a.nkv;
  HeadIn<kD> in{};
  if (warp < heads) in = load_head<kD>(a, t, warp);  // in flight while the table is computed
  for (int j = threadIdx.x; j < a.rotary_dim / 2; j += blockDim.x) cs[j] = rope_cos_sin(pos, a.freqs.inv[j]);
  __syncthreads();
  for (int hh = warp; hh < heads; hh += warps) {
    if (hh != warp) in = load_head<kD>(a, t, hh);
    finish_head<kD>(a, in, t, hh, pos, cs, cache, stage_rows + warp * kD);
  }
}

/// Block t: token t of the chunk, at position pos0 + t (pos0 = *pos_device when non-null).
template <int kD>
__global__ void __launch_bounds__(kPrepMaxThreads)
prepare_kernel(PrepareArgs a, int64_t pos0_host, const int32_t* __restrict__ pos_device, KvCacheView cache) {
  pdl_prologue();  // before reading *pos_device and the projections
  const int t = blockIdx.x;
  const int64_t pos = (pos_device ? int64_t(*pos_device) : pos0_host) + t;
  prepare_token<kD>(a, t, pos, cache);
}

/// Batched decode: block r is row r, one token of its own sequence, at position pos[r],
/// appended to its own cache caches[r].
template <int kD>
__global__ void __launch_bounds__(kPrepMaxThreads)
prepare_rows_kernel(PrepareArgs a, const int32_t* __restrict__ pos, const KvCacheView* __restrict__ caches) {
  pdl_prologue();  // before reading pos[] and caches[] (written by the step's copy-in)
  const int r = blockIdx.x;
  prepare_token<kD>(a, r, int64_t(pos[r]), caches[r]);
}

// ---- attention core ----------------------------------------------------------------------------

/// Per-warp online-softmax state of G query heads (log2 domain), head dim kD.
template <int G, int kD>
struct WarpState {
  static constexpr int kDimsPerLane = kD / kWarp;
  float m[G], l[G], acc[G][kDimsPerLane];
};

/// Loads the G query vectors of kv head `kvh` (row pointer q_row = [nq, D]) pre-scaled by
/// scale·log2 e.
template <int G, int kD, int kDimsPerLane = kD / kWarp>
__device__ __forceinline__ void load_queries(const bf16* q_row, int kvh, float scale,
                                             float (&qr)[G][kDimsPerLane]) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load_bf16_vec(q_row + int64_t(kvh * G + g) * kD + lane * kDimsPerLane, qr[g]);
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) qr[g][e] *= scale * kLog2e;
  }
}

/// Keys whose K and V rows a warp loads before it uses the first of them: one memory round trip
/// per kKeyBatch keys instead of one per key (the keys' arithmetic is unchanged).
constexpr int kKeyBatch = 4;

/// Warp reduce-scatter of N (a power of two ≤ 32) values per lane, active count `n` (template
/// recursion over the butterfly offsets 16, 8, …, 1): afterwards lane l holds, in v[0], the warp
/// sum of value l / (32 / N). Each value is summed over the same butterfly as warp_sum, with the
/// same operands in the same order at every step (own value + partner's), so the result equals
/// warp_sum of that value bit for bit — with N − 1 shuffles for all N values instead of 5·N.
template <int N, int n, int O>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[N], int lane) {
  if constexpr (O > 0) {
    if constexpr (n > 1) {
      constexpr int h = n / 2;
      const bool low = (lane & O) == 0;  // keeps values [0, h), sends [h, n)
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const float send = low ? v[i + h] : v[i];
        const float keep = low ? v[i] : v[i + h];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      reduce_scatter_step<N, h, O / 2>(v, lane);
    } else {
      v[0] = v[0] + __shfl_xor_sync(0xffffffffu, v[0], O);
      reduce_scatter_step<N, 1, O / 2>(v, lane);
    }
  }
}

/// Starts this warp's online-softmax state: m = −inf, l = 0, acc = 0 for each of the G heads.
template <int G, int kD>
__device__ __forceinline__ void init_state(WarpState<G, kD>& st) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st.m[g] = -INFINITY;
    st.l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < WarpState<G, kD>::kDimsPerLane; ++e) st.acc[g][e] = 0.0f;
  }
}

/// One batch of this warp's keys through the online softmax: keys b < n_valid of kr / vr (this
/// lane's kDimsPerLane dims of each K and V row; rows past n_valid are zeros and unused). The
/// kKeyBatch·G partial scores are reduced together (reduce_scatter_step: each score equals
/// warp_sum of its partial) and broadcast back key by key, so every key's update is the same
/// arithmetic, in the same order, as one key at a time. All lanes of the warp.
template <int G, int kD, int kDimsPerLane = kD / kWarp>
__device__ __forceinline__ void attend_batch(const float (&qr)[G][kDimsPerLane],
                                             const typename Bf16Vec<kDimsPerLane>::type (&kr)[kKeyBatch],
                                             const typename Bf16Vec<kDimsPerLane>::type (&vr)[kKeyBatch],
                                             int n_valid, WarpState<G, kD>& st) {
  constexpr int kScores = kKeyBatch * G;  // a power of two ≤ 32 (G ≤ 8)
  static_assert(kScores <= kWarp && (kScores & (kScores - 1)) == 0, "attend_batch: kKeyBatch·G must be 2^k ≤ 32");
  constexpr int kSpread = kWarp / kScores;  // lanes holding each score after the reduce-scatter
  const int lane = threadIdx.x % kWarp;
  float part[kScores];  // this lane's share of score (key b, head g) at b·G + g
#pragma unroll
  for (int b = 0; b < kKeyBatch; ++b) {
    float kx[kDimsPerLane];
    unpack_bf16<kDimsPerLane>(kr[b], kx);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) s += qr[g][e] * kx[e];
      part[b * G + g] = s;
    }
  }
  reduce_scatter_step<kScores, kScores, kWarp / 2>(part, lane);
  const float mine = part[0];
#pragma unroll
  for (int b = 0; b < kKeyBatch; ++b) {
    if (b >= n_valid) break;  // uniform over the warp
    float vx[kDimsPerLane];
    unpack_bf16<kDimsPerLane>(vr[b], vx);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float s = __shfl_sync(0xffffffffu, mine, (b * G + g) * kSpread);
      const float m_new = fmaxf(st.m[g], s);
      const float corr = exp2f(st.m[g] - m_new);  // 0 on the first key (m = −inf)
      const float p = exp2f(s - m_new);
      st.l[g] = st.l[g] * corr + p;
      st.m[g] = m_new;
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) st.acc[g][e] = st.acc[g][e] * corr + p * vx[e];
    }
  }
}

/// Loads this lane's dims of the K and V rows row0 + b·kWarps (b < kKeyBatch) below `limit`
/// into kr / vr (zeros past it) and returns how many were below it: one warp's batch of keys.
template <int kD, class Raw, int kDimsPerLane = kD / kWarp>
__device__ __forceinline__ int load_key_batch(const bf16* K, const bf16* V, int64_t row0, int64_t limit,
                                              Raw (&kr)[kKeyBatch], Raw (&vr)[kKeyBatch]) {
  const int lane = threadIdx.x % kWarp;
  int n_valid = 0;
#pragma unroll
  for (int b = 0; b < kKeyBatch; ++b) {
    const int64_t t = row0 + int64_t(b) * kWarps;
    kr[b] = vr[b] = Raw{};
    if (t < limit) {
      kr[b] = load_bf16_raw<kDimsPerLane>(K + t * kD + lane * kDimsPerLane);
      vr[b] = load_bf16_raw<kDimsPerLane>(V + t * kD + lane * kDimsPerLane);
      ++n_valid;
    }
  }
  return n_valid;
}

/// Runs this warp's keys of [start, end) (every kWarps-th key, in increasing order) through the
/// online softmax, kKeyBatch keys a batch (attend_batch), the K/V rows of a batch loaded from
/// global memory before the first is used.
template <int G, int kD, int kDimsPerLane = kD / kWarp>
__device__ __forceinline__ void attend_keys(const float (&qr)[G][kDimsPerLane], const bf16* K,
                                            const bf16* V, int64_t start, int64_t end,
                                            WarpState<G, kD>& st) {
  using Raw = typename Bf16Vec<kDimsPerLane>::type;
  const int warp = threadIdx.x / kWarp;
  init_state(st);
  for (int64_t t0 = start + warp; t0 < end; t0 += int64_t(kWarps) * kKeyBatch) {
    Raw kr[kKeyBatch], vr[kKeyBatch];
    const int n_valid = load_key_batch<kD>(K, V, t0, end, kr, vr);
    attend_batch<G, kD>(qr, kr, vr, n_valid, st);
  }
}

/// Shared memory of the warp-state merge, head dim kD.
template <int kD>
struct MergeSmem {
  float m[kWarps][8];
  float l[kWarps][8];
  float acc[kWarps][kD];
};

/// Merges the 8 warps' states of query head g; thread d < kD gets Σ_w acc·2^{m_w−M} for
/// dim d (threads ≥ kD get 0), and (M, L) for the head. All threads must call it (it
/// synchronises).
template <int G, int kD>
__device__ __forceinline__ void merge_head(const WarpState<G, kD>& st, int g, MergeSmem<kD>& sm,
                                           float& acc_d, float& M, float& L) {
  constexpr int kDimsPerLane = kD / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm.m[w][g]);
  const float f = st.m[g] == -INFINITY ? 0.0f : exp2f(st.m[g] - M);
#pragma unroll
  for (int e = 0; e < kDimsPerLane; ++e) sm.acc[warp][lane * kDimsPerLane + e] = st.acc[g][e] * f;
  __syncthreads();
  acc_d = 0.0f;
  L = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (kD == kThreads || threadIdx.x < kD) acc_d += sm.acc[w][threadIdx.x];
    const float mw = sm.m[w][g];
    L += mw == -INFINITY ? 0.0f : sm.l[w][g] * exp2f(mw - M);
  }
  __syncthreads();  // sm.acc is reused for the next head
}

/// Publishes every warp's (m, l) to shared memory.
template <int G, int kD>
__device__ __forceinline__ void publish_stats(const WarpState<G, kD>& st, MergeSmem<kD>& sm) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sm.m[warp][g] = st.m[g];
      sm.l[warp][g] = st.l[g];
    }
  }
  __syncthreads();
}

/// o·sigmoid(gate) rounded to bf16 (gate may be null: no gate).
__device__ __forceinline__ bf16 gated_output(float o, const bf16* gate) {
  if (gate) o *= 1.0f / (1.0f + expf(-to_f32(*gate)));
  return to_bf16(o);
}

// ---- decode: split-K + combine -------------------------------------------------------------------

// ---- decode split on tensor cores ---------------------------------------------------------------
//
// The G query heads of a kv head are the N dimension of mma.sync m16n8k16 (G ≤ 8; columns ≥ G
// hold zero queries and are never stored), and the keys are its M dimension, so a warp scores
// 16 keys × 8 heads with kD/16 MMAs instead of 16·G dot products on CUDA cores:
//   Sᵀ[key][head] = K[key][:] · Q[head][:]   (A = K rows by ldmatrix, B = Q in registers)
//   Oᵀ[dim][head] += Vᵀ[dim][key] · Pᵀ[key][head]   (A = V rows by transposing ldmatrix)
// Pᵀ comes from the Sᵀ accumulators: a lane holds (key g, heads 2t, 2t+1), which is one row of
// an 8×8 bf16 matrix; movmatrix.trans turns it into (keys 2t, 2t+1, head g), the B fragment. A
// lane keeps heads 2t and 2t+1 in both products, so the online softmax rescale is lane-local.
// Numerics (docs/cuda-mixers.md): scores in fp32 (bf16 products, fp32 sums) times scale·log2 e,
// probabilities rounded to bf16 for the second product and summed as rounded, as in the prefill
// flash attention.
//
// Each split's keys arrive by bulk copies, one per K or V row, into rows padded by 16 bytes (so
// the 8 rows of an ldmatrix fall in 8 different bank groups), kMmaStageKeys keys a stage in a
// ring of kMmaStages, all requested at the start where they fit. Warp w takes keys 16w … 16w + 15
// of every stage; the 4 warps' states merge in shared memory at the end.
constexpr int kMmaAttnThreads = 128;
constexpr int kMmaAttnWarps = kMmaAttnThreads / kWarp;
constexpr int kMmaStageKeys = 16 * kMmaAttnWarps;
constexpr int kMmaStages = 3;

/// Bytes of one padded K or V row in a stage.
constexpr int mma_row_bytes(int kD) { return kD * int(sizeof(bf16)) + 16; }
/// Bytes of one stage: kMmaStageKeys K rows, then kMmaStageKeys V rows.
constexpr size_t mma_stage_bytes(int kD) { return size_t(2) * kMmaStageKeys * mma_row_bytes(kD); }
/// Dynamic shared memory of the tensor-core decode split (the ring; its front is reused for the
/// merge of the warps' accumulators, kMmaAttnWarps·8·kD fp32, which is smaller).
constexpr size_t mma_ring_bytes(int kD) { return kMmaStages * mma_stage_bytes(kD); }
static_assert(size_t(kMmaAttnWarps) * 8 * kMaxD * sizeof(float) <= mma_ring_bytes(kMaxD), "merge area must fit the ring");

/// Warp 0 (all lanes): requests stage i of keys [start, end) into ring slot i mod kMmaStages,
/// counted on full[slot]: each K and each V row one bulk copy into its padded row.
template <int kD>
__device__ __forceinline__ void request_mma_stage(const bf16* K, const bf16* V, int64_t start, int64_t end, int64_t i,
                                                  unsigned char* ring, uint64_t* full) {
  const int lane = threadIdx.x % kWarp, slot = int(i % kMmaStages);
  const int64_t first = start + i * kMmaStageKeys;
  const int keys = int(min(int64_t(kMmaStageKeys), end - first));
  constexpr uint32_t kRow = kD * sizeof(bf16);
  if (lane == 0) mbarrier_arrive_expect_tx(full + slot, 2 * kRow * uint32_t(keys));
  __syncwarp();
  unsigned char* stage = ring + slot * mma_stage_bytes(kD);
  for (int q = lane; q < 2 * keys; q += kWarp) {
    const int r = q % keys, is_v = q / keys;
    bulk_copy_to_shared(stage + (is_v * kMmaStageKeys + r) * mma_row_bytes(kD), (is_v ? V : K) + (first + r) * kD,
                        kRow, full + slot);
  }
}

/// movmatrix.trans: this lane's row of an 8×8 bf16 matrix (row lane/4, columns 2·(lane%4) …+1)
/// in, the same fragment of its transpose out.
__device__ __forceinline__ uint32_t transpose_8x8_bf16(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

/// Kv head kvh, split s (the body of decode_split_kernel, shared with the batched
/// decode_split_rows_kernel), on tensor cores: the partial softmax state of keys [s·chunk,
/// min(len, (s+1)·chunk)) for the G query heads → ws_o [nq, n_splits, kD] (unnormalised),
/// ws_ml [nq, n_splits, 2] = (m, l) in the log2 domain; an empty split writes m = −inf, l = 0,
/// acc = 0. Block of kMmaAttnThreads, mma_ring_bytes(kD) of dynamic shared memory. `len` counts
/// the new key at len − 1. It runs pdl_prologue itself (the caller must not): the stages whose
/// keys all precede the new one are requested before the wait, because earlier steps wrote
/// them (launch.cuh, rule 4); the queries and the new key's stage (the prepare kernel's output)
/// come after it.
template <int G, int kD>
__device__ __forceinline__ void decode_split_mma(int kvh, int s, int n_splits, float scale, int64_t len,
                                                 const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                 const bf16* __restrict__ v_cache, int64_t capacity,
                                                 float* __restrict__ ws_o, float* __restrict__ ws_ml) {
  static_assert(G <= 8 && kD % 16 == 0, "decode_split_mma: G ≤ 8 heads, kD a multiple of 16");
  constexpr int kSteps = kD / 16, kRowB = mma_row_bytes(kD);
  __shared__ __align__(8) uint64_t full[kMmaStages];
  __shared__ float m_w[kMmaAttnWarps][8], l_w[kMmaAttnWarps][8];
  extern __shared__ __align__(128) unsigned char ring[];  // mma_ring_bytes(kD)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int64_t chunk = (len + n_splits - 1) / n_splits;
  const int64_t start = min(len, s * chunk), end = min(len, start + chunk);
  const int64_t stages = (end - start + kMmaStageKeys - 1) / kMmaStageKeys;
  const int64_t head_off = int64_t(kvh) * capacity * kD;
  const bf16* K = k_cache + head_off;
  const bf16* V = v_cache + head_off;

  // The V rows past `end` in the last stage are read by the second product (times p = 0): zero
  // them once, before any copy lands in that slot (an earlier stage there leaves finite rows).
  if (stages > 0) {
    const int tail = int(end - (start + (stages - 1) * kMmaStageKeys));
    unsigned char* vrows = ring + int((stages - 1) % kMmaStages) * mma_stage_bytes(kD) + kMmaStageKeys * kRowB;
    for (int i = threadIdx.x; i < (kMmaStageKeys - tail) * kRowB / 16; i += kMmaAttnThreads)
      reinterpret_cast<uint4*>(vrows + tail * kRowB)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int j = 0; j < kMmaStages; ++j) mbarrier_init(full + j, 1);
    mbarrier_init_fence();
  }
  fence_proxy_async_shared();
  __syncthreads();
  // Stage i holds keys [start + 64i, min(end, start + 64(i + 1))): before the wait when they
  // end before the new key.
  auto before_new_key = [&](int64_t i) { return min(end, start + (i + 1) * kMmaStageKeys) <= len - 1; };
  if (warp == 0)
    for (int64_t i = 0; i < stages && i < kMmaStages; ++i)
      if (before_new_key(i)) request_mma_stage<kD>(K, V, start, end, i, ring, full);
  pdl_prologue();
  if (warp == 0)
    for (int64_t i = 0; i < stages && i < kMmaStages; ++i)
      if (!before_new_key(i)) request_mma_stage<kD>(K, V, start, end, i, ring, full);

  // Q as the B operand: head g's dims 16·k + 2t …+1 and +8 …+9 (zero for heads ≥ G).
  uint32_t qb[kSteps][2];
  const bf16* qrow = q + int64_t(kvh * G + min(g, G - 1)) * kD;
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    qb[k][0] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 16 * k + 2 * t) : 0u;
    qb[k][1] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 16 * k + 2 * t + 8) : 0u;
  }
  const float scale_log2 = scale * kLog2e;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // heads 2t, 2t + 1
  float o[kSteps][4];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) o[k][0] = o[k][1] = o[k][2] = o[k][3] = 0.0f;

  for (int64_t i = 0; i < stages; ++i) {  // uniform over the block
    const int slot = int(i % kMmaStages);
    mbarrier_wait(full + slot, uint32_t(i / kMmaStages) & 1u);
    const unsigned char* Ks = ring + slot * mma_stage_bytes(kD) + 16 * warp * kRowB;
    const unsigned char* Vs = Ks + kMmaStageKeys * kRowB;
    const int64_t key0 = start + i * kMmaStageKeys + 16 * warp;
    if (key0 < end) {  // uniform over the warp
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        uint32_t a[4];
        ldmatrix_x4(a, Ks + (lane % 16) * kRowB + (16 * k + (lane / 16) * 8) * int(sizeof(bf16)));
        mma_bf16_16816(sc, a, qb[k]);
      }
      // sc: (key g, head 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
      const bool v0 = key0 + g < end, v1 = key0 + g + 8 < end;
      const float x0 = v0 ? sc[0] * scale_log2 : -INFINITY, x1 = v0 ? sc[1] * scale_log2 : -INFINITY;
      const float x2 = v1 ? sc[2] * scale_log2 : -INFINITY, x3 = v1 ? sc[3] * scale_log2 : -INFINITY;
      float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
      for (int off = 4; off < kWarp; off *= 2) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float n0 = fmaxf(m[0], mx0), n1 = fmaxf(m[1], mx1);  // finite: key0 < end
      const float c0 = exp2f(m[0] - n0), c1 = exp2f(m[1] - n1);   // 0 on the first keys
      m[0] = n0;
      m[1] = n1;
      const uint32_t p_lo = pack_bf16x2(exp2f(x0 - n0), exp2f(x1 - n1));  // keys 0–7 × heads
      const uint32_t p_hi = pack_bf16x2(exp2f(x2 - n0), exp2f(x3 - n1));  // keys 8–15 × heads
      const float2 f_lo = bf16x2_to_f32(p_lo), f_hi = bf16x2_to_f32(p_hi);
      l[0] = l[0] * c0 + (f_lo.x + f_hi.x);  // this lane's keys; summed over the lanes at the end
      l[1] = l[1] * c1 + (f_lo.y + f_hi.y);
      const uint32_t pb[2] = {transpose_8x8_bf16(p_lo), transpose_8x8_bf16(p_hi)};
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        o[k][0] *= c0;
        o[k][1] *= c1;
        o[k][2] *= c0;
        o[k][3] *= c1;
        uint32_t a[4];
        ldmatrix_x4_trans(a, Vs + ((lane % 8) + (lane / 16) * 8) * kRowB + (16 * k + ((lane / 8) % 2) * 8) * int(sizeof(bf16)));
        mma_bf16_16816(o[k], a, pb);
      }
    }
    __syncthreads();  // every warp is done with the slot: it may be refilled
    if (warp == 0 && i + kMmaStages < stages) {
      fence_proxy_async_shared();
      request_mma_stage<kD>(K, V, start, end, i + kMmaStages, ring, full);
    }
  }

  // Merge the warps: each lane's l over the 8 lanes of its heads, then (m, l) per warp and head.
#pragma unroll
  for (int off = 4; off < kWarp; off *= 2) {
    l[0] += __shfl_xor_sync(0xffffffffu, l[0], off);
    l[1] += __shfl_xor_sync(0xffffffffu, l[1], off);
  }
  if (g == 0) {
    m_w[warp][2 * t] = m[0];
    m_w[warp][2 * t + 1] = m[1];
    l_w[warp][2 * t] = l[0];
    l_w[warp][2 * t + 1] = l[1];
  }
  __syncthreads();  // also: the ring is free (every stage consumed), its front holds the merge
  float M[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int w = 0; w < kMmaAttnWarps; ++w) {
    M[0] = fmaxf(M[0], m_w[w][2 * t]);
    M[1] = fmaxf(M[1], m_w[w][2 * t + 1]);
  }
  const float f0 = m[0] == -INFINITY ? 0.0f : exp2f(m[0] - M[0]);
  const float f1 = m[1] == -INFINITY ? 0.0f : exp2f(m[1] - M[1]);
  float* acc = reinterpret_cast<float*>(ring);  // [warp][head 8][kD]
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    float* a0 = acc + (warp * 8 + 2 * t) * kD + 16 * k + g;  // head 2t, dim 16k + g
    a0[0] = o[k][0] * f0;
    a0[kD] = o[k][1] * f1;
    a0[8] = o[k][2] * f0;
    a0[kD + 8] = o[k][3] * f1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * kD; i += kMmaAttnThreads) {
    const int h = i / kD, d = i % kD;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaAttnWarps; ++w) sum += acc[(w * 8 + h) * kD + d];
    ws_o[(int64_t(kvh * G + h) * n_splits + s) * kD + d] = sum;
  }
  if (threadIdx.x < G) {
    const int h = threadIdx.x;
    float Mh = -INFINITY, L = 0.0f;
    for (int w = 0; w < kMmaAttnWarps; ++w) Mh = fmaxf(Mh, m_w[w][h]);
    for (int w = 0; w < kMmaAttnWarps; ++w) L += m_w[w][h] == -INFINITY ? 0.0f : l_w[w][h] * exp2f(m_w[w][h] - Mh);
    const int64_t slot = int64_t(kvh * G + h) * n_splits + s;
    ws_ml[2 * slot] = Mh;
    ws_ml[2 * slot + 1] = L;
  }
}

/// Block (kv head, split): decode_split_mma.
template <int G, int kD>
__global__ void __launch_bounds__(kMmaAttnThreads)
decode_split_kernel(int n_splits, float scale, int64_t len_host, const int32_t* __restrict__ len_device,
                    const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                    const bf16* __restrict__ v_cache, int64_t capacity, float* __restrict__ ws_o,
                    float* __restrict__ ws_ml) {
  // len_device is the step's copy-in (launch.cuh, rule 4); decode_split_mma runs the PDL wait.
  const int64_t len = len_device ? int64_t(*len_device) : len_host;
  decode_split_mma<G, kD>(blockIdx.x, blockIdx.y, n_splits, scale, len, q, k_cache, v_cache, capacity, ws_o, ws_ml);
}

/// The splits of row r of a batched decode: splits[r] (its own sequence's count), never more
/// than the launch's grid holds.
__device__ __forceinline__ int row_splits(const int32_t* splits, int r, int max_splits) {
  return min(max(splits[r], 1), max_splits);
}

/// Batched decode: block (kv head, split, row r); row r is decode_split_kernel over its own
/// sequence (query q + r·nq·D, cache caches[r], length len[r], row_splits(r) splits, partials in
/// the row's workspace region ws + r·ws_row_floats, laid out as the one-sequence workspace).
/// Blocks of splits the row does not have return at once.
template <int G, int kD>
__global__ void __launch_bounds__(kMmaAttnThreads)
decode_split_rows_kernel(int nq, int max_splits, float scale, const int32_t* __restrict__ len,
                         const int32_t* __restrict__ splits, const bf16* __restrict__ q,
                         const KvCacheView* __restrict__ caches, float* __restrict__ ws, int64_t ws_row_floats) {
  // len[], splits[] and caches[] are the step's copy-in (launch.cuh, rule 4); decode_split_mma
  // runs the PDL wait, and a block without a split runs it before it returns (rule 1).
  const int r = blockIdx.z, s = blockIdx.y;
  const int n_splits = row_splits(splits, r, max_splits);
  if (s >= n_splits) {  // uniform over the block
    pdl_prologue();
    return;
  }
  const KvCacheView c = caches[r];
  float* ws_o = ws + r * ws_row_floats;
  float* ws_ml = ws_o + int64_t(nq) * n_splits * kD;
  decode_split_mma<G, kD>(blockIdx.x, s, n_splits, scale, int64_t(len[r]), q + int64_t(r) * nq * kD, c.k, c.v,
                          c.capacity, ws_o, ws_ml);
}

/// Query head h (the body of decode_combine_kernel, shared with decode_combine_rows_kernel),
/// thread per dim: merges the splits, divides by the total sum, applies the sigmoid gate,
/// writes bf16 (kD threads). The caller has run pdl_prologue.
template <int kD>
__device__ __forceinline__ void decode_combine(int h, int n_splits, const float* __restrict__ ws_o,
                                               const float* __restrict__ ws_ml, const bf16* __restrict__ gate,
                                               bf16* __restrict__ out) {
  __shared__ float ml_s[2 * kMaxDecodeSplits];
  const int d = threadIdx.x;
  const float* ml = ws_ml + int64_t(h) * n_splits * 2;
  for (int i = d; i < 2 * n_splits; i += kD) ml_s[i] = ml[i];  // every split's (m, l) in one round trip
  __syncthreads();
  float M = -INFINITY;
  for (int s = 0; s < n_splits; ++s) M = fmaxf(M, ml_s[2 * s]);
  float acc = 0.0f, L = 0.0f;
  const float* o = ws_o + int64_t(h) * n_splits * kD + d;
#pragma unroll 8
  for (int s = 0; s < n_splits; ++s) {  // unrolled: 8 splits' ws_o loads in flight, summed in order
    const float m = ml_s[2 * s];
    const float v = o[int64_t(s) * kD];
    if (m == -INFINITY) continue;
    const float f = exp2f(m - M);
    L += ml_s[2 * s + 1] * f;
    acc += v * f;
  }
  const bf16* g = gate ? gate + int64_t(h) * 2 * kD + kD + d : nullptr;
  out[int64_t(h) * kD + d] = gated_output(acc / L, g);
}

/// Block per query head: decode_combine.
template <int kD>
__global__ void __launch_bounds__(kD)
decode_combine_kernel(int n_splits, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                      const bf16* __restrict__ gate, bf16* __restrict__ out) {
  pdl_prologue();
  decode_combine<kD>(blockIdx.x, n_splits, ws_o, ws_ml, gate, out);
}

/// Batched decode: block (query head, row r): decode_combine over row r's workspace region,
/// gate row gate + r·gate_stride, output out + r·nq·D.
template <int kD>
__global__ void __launch_bounds__(kD)
decode_combine_rows_kernel(int nq, int max_splits, const int32_t* __restrict__ splits, const float* __restrict__ ws,
                           int64_t ws_row_floats, const bf16* __restrict__ gate, int64_t gate_stride,
                           bf16* __restrict__ out) {
  pdl_prologue();  // before reading splits[]
  const int r = blockIdx.y;
  const int n_splits = row_splits(splits, r, max_splits);
  const float* ws_o = ws + r * ws_row_floats;
  const float* ws_ml = ws_o + int64_t(nq) * n_splits * kD;
  decode_combine<kD>(blockIdx.x, n_splits, ws_o, ws_ml, gate ? gate + r * gate_stride : nullptr,
                     out + int64_t(r) * nq * kD);
}

// ---- prefill -------------------------------------------------------------------------------------

/// Block (row r, kv head): causal attention of row r (keys [0, base + r]) for the G query heads
/// of the group, written normalised and gated.
template <int G, int kD>
__global__ void __launch_bounds__(kThreads)
prefill_row_kernel(int nq, float scale, int64_t base, const bf16* __restrict__ q,
                   const bf16* __restrict__ gate, int64_t gate_stride,
                   const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                   int64_t capacity, bf16* __restrict__ out) {
  constexpr int kDimsPerLane = kD / kWarp;
  __shared__ MergeSmem<kD> sm;
  const int r = blockIdx.x, kvh = blockIdx.y;
  float qr[G][kDimsPerLane];
  load_queries<G, kD>(q + int64_t(r) * nq * kD, kvh, scale, qr);
  WarpState<G, kD> st;
  const int64_t head_off = int64_t(kvh) * capacity * kD;
  attend_keys<G, kD>(qr, k_cache + head_off, v_cache + head_off, 0, base + r + 1, st);
  publish_stats<G, kD>(st, sm);
  for (int g = 0; g < G; ++g) {
    float acc_d, M, L;
    merge_head<G, kD>(st, g, sm, acc_d, M, L);
    if (kD != kThreads && threadIdx.x >= kD) continue;  // uniform per warp (kD multiple of 32)
    const int h = kvh * G + g;
    const bf16* gp = gate ? gate + int64_t(r) * gate_stride + int64_t(h) * 2 * kD + kD + threadIdx.x
                          : nullptr;
    out[(int64_t(r) * nq + h) * kD + threadIdx.x] = gated_output(acc_d / L, gp);
  }
}

/// LILY_CUDA_REQUIRE with this file's prefix.
#define MIXER_REQUIRE(ok, ...) LILY_CUDA_REQUIRE(ok, "attention kernels", __VA_ARGS__)

void check_dims(const AttnDims& d) {
  MIXER_REQUIRE(d.head_dim == 64 || d.head_dim == 128 || d.head_dim == 256,
          "head_dim " + std::to_string(d.head_dim) + " unsupported (kernels are compiled for 64, 128, 256)");
  MIXER_REQUIRE(d.rotary_dim >= 0 && d.rotary_dim <= d.head_dim && d.rotary_dim % 2 == 0,
          "rotary_dim " + std::to_string(d.rotary_dim) + " must be even and in [0, head_dim " +
              std::to_string(d.head_dim) + "]");
  MIXER_REQUIRE(d.n_kv_heads > 0 && d.n_heads > 0 && d.n_heads % d.n_kv_heads == 0,
          "query heads (" + std::to_string(d.n_heads) + ") must be a positive multiple of kv heads (" +
              std::to_string(d.n_kv_heads) + ")");
  const int G = d.n_heads / d.n_kv_heads;
  MIXER_REQUIRE(G == 1 || G == 2 || G == 4 || G == 8,
          "GQA group " + std::to_string(G) + " unsupported (1, 2, 4 or 8)");
}

void check_cache(const KvCacheView& c) {
  MIXER_REQUIRE(c.k && c.v && c.capacity > 0, "KV cache view is empty");
}

/// The prepare kernels' PrepareArgs after the checks both launchers share (`who` names the
/// launcher in errors): strides wide enough, and bf16 pointers and strides aligned to N = D/32
/// elements, as the lanes' vector loads need. The inverse frequencies as cpu::rope_cos_sin.
PrepareArgs prepare_args(const AttnDims& dims, const bf16* qg, int64_t qg_stride, const bf16* k, const bf16* v,
                         int64_t kv_stride, const float* q_norm, const float* k_norm, bf16* q_out,
                         const std::string& who) {
  const int D = dims.head_dim, N = D / kWarp;
  MIXER_REQUIRE(qg_stride >= int64_t(dims.n_heads) * 2 * D, who + ": qg row stride too small");
  MIXER_REQUIRE(kv_stride >= int64_t(dims.n_kv_heads) * D, who + ": k/v row stride too small");
  const size_t vec = size_t(N) * sizeof(bf16);  // bytes of one lane's vector
  MIXER_REQUIRE(is_aligned(qg, vec) && is_aligned(k, vec) && is_aligned(v, vec) && is_aligned(q_out, vec) &&
                    qg_stride % N == 0 && kv_stride % N == 0,
                who + ": qg, k, v, q_out and the row strides must be aligned to head_dim/32 elements");
  PrepareArgs a{dims.n_heads, dims.n_kv_heads, dims.rotary_dim, dims.norm_eps, RopeFreqs{}, qg, qg_stride, k, v,
                kv_stride, q_norm, k_norm, q_out};
  const float base = dims.rope_theta;
  for (int j = 0; j < dims.rotary_dim / 2; ++j)  // as cpu::rope_cos_sin
    a.freqs.inv[j] = 1.0f / std::pow(base, float(2 * j) / float(dims.rotary_dim));
  return a;
}

/// Warps per block of the prepare kernels: one per head of the nq + nkv, or past kPrepMaxWarps
/// heads the fewest that take them in equal rounds (72 heads: 24 warps, 3 rounds).
int prepare_warps(const AttnDims& dims) {
  const int heads = dims.n_heads + dims.n_kv_heads;
  const int rounds = (heads + kPrepMaxWarps - 1) / kPrepMaxWarps;
  return (heads + rounds - 1) / rounds;
}

/// Dynamic shared memory of the prepare kernels: rope_head's staging rows [warps, D] fp32 when
/// rotary_dim/2 is not a multiple of D/32 (the partner is not a whole number of lanes away),
/// else none. At most 32 KB.
size_t prepare_smem(const AttnDims& dims, int warps) {
  const bool shuffle = (dims.rotary_dim / 2) % (dims.head_dim / kWarp) == 0;
  return shuffle ? 0 : size_t(warps) * dims.head_dim * sizeof(float);
}

/// Calls f(std::integral_constant<int, G>{}) for the runtime group size G.
template <typename F>
void dispatch_group(int G, F&& f) {
  switch (G) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: MIXER_REQUIRE(false, "GQA group " + std::to_string(G) + " unsupported");
  }
}

/// Calls f(std::integral_constant<int, D>{}) for the runtime head dim D (checked by
/// check_dims first).
template <typename F>
void dispatch_head_dim(int D, F&& f) {
  switch (D) {
    case 256: f(std::integral_constant<int, 256>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    default: MIXER_REQUIRE(false, "head_dim " + std::to_string(D) + " unsupported");
  }
}

}  // namespace

float AttnDims::scale() const { return 1.0f / std::sqrt(float(head_dim)); }

AttnDims attn_dims(const ModelConfig& config) {
  AttnDims d;
  d.n_heads = config.n_heads;
  d.n_kv_heads = config.n_kv_heads;
  d.head_dim = config.head_dim;
  d.rotary_dim = config.rotary_dim;
  d.rope_theta = float(config.rope_theta);
  d.norm_eps = config.rms_norm_eps;
  check_dims(d);
  return d;
}

void attention_prepare(const AttnDims& dims, int T, const bf16* qg, int64_t qg_stride,
                       const bf16* k, const bf16* v, int64_t kv_stride, const float* q_norm,
                       const float* k_norm, int64_t pos0_host, const int32_t* pos_device,
                       const KvCacheView& cache, bf16* q_out, cudaStream_t stream) {
  check_dims(dims);
  check_cache(cache);
  MIXER_REQUIRE(T >= 1 && T <= 65535, "attention_prepare: T=" + std::to_string(T) + " outside [1, 65535]");
  MIXER_REQUIRE(qg && k && v && q_norm && k_norm && q_out, "attention_prepare: null buffer");
  const PrepareArgs a = prepare_args(dims, qg, qg_stride, k, v, kv_stride, q_norm, k_norm, q_out, "attention_prepare");
  const size_t vec = size_t(dims.head_dim / kWarp) * sizeof(bf16);  // bytes of one lane's vector
  MIXER_REQUIRE(is_aligned(cache.k, vec) && is_aligned(cache.v, vec),
                "attention_prepare: KV cache not aligned to head_dim/32 elements");
  MIXER_REQUIRE(pos0_host >= 0 && pos0_host + T <= cache.capacity,
          "attention_prepare: positions [" + std::to_string(pos0_host) + ", " +
              std::to_string(pos0_host + T) + ") exceed the KV cache capacity " +
              std::to_string(cache.capacity));
  const int warps = prepare_warps(dims);
  dispatch_head_dim(dims.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    launch_pdl(prepare_kernel<kD>, dim3(T), dim3(warps * kWarp), prepare_smem(dims, warps), stream, a, pos0_host,
               pos_device, cache);
  });
  LILY_CUDA_CHECK_LAUNCH();
}

int attention_decode_splits(int64_t len) {
  // 128 keys per split, at most 64 splits. Decode on an H200 (35b-a3b shape,
  // docs/performance/2026-12-03-decode-attention-splits.md) against the earlier 64 keys and 128
  // splits: 4K context +2.8 % (33 splits), 32K +3.3 % (64 splits); 32 or 256 keys per split at
  // 4K and 128 splits at 32K were slower. Each split's merge of its warps is a fixed cost, so
  // fewer, longer splits win once every SM has one.
  constexpr int64_t kKeysPerSplit = 128, kMaxSplits = 64;
  if (len <= kKeysPerSplit) return 1;
  return int(std::min<int64_t>(kMaxSplits, (len + kKeysPerSplit - 1) / kKeysPerSplit));
}

size_t attention_decode_workspace_bytes(const AttnDims& dims, int n_splits) {
  return size_t(dims.n_heads) * size_t(n_splits) * (size_t(dims.head_dim) + 2) * sizeof(float);
}

void attention_decode(const AttnDims& dims, const bf16* q, const bf16* gate,
                      const KvCacheView& cache, int64_t len_host, const int32_t* len_device,
                      int n_splits, float* workspace, size_t workspace_bytes, bf16* out,
                      cudaStream_t stream) {
  check_dims(dims);
  check_cache(cache);
  MIXER_REQUIRE(q && out && workspace, "attention_decode: null buffer");
  MIXER_REQUIRE(n_splits >= 1 && n_splits <= kMaxDecodeSplits,
          "attention_decode: n_splits " + std::to_string(n_splits) + " outside [1, 256]");
  MIXER_REQUIRE(workspace_bytes >= attention_decode_workspace_bytes(dims, n_splits),
          "attention_decode: workspace of " + std::to_string(workspace_bytes) + " bytes < " +
              std::to_string(attention_decode_workspace_bytes(dims, n_splits)));
  MIXER_REQUIRE(len_device || (len_host >= 1 && len_host <= cache.capacity),
          "attention_decode: length " + std::to_string(len_host) + " outside [1, capacity " +
              std::to_string(cache.capacity) + "]");
  float* ws_o = workspace;
  float* ws_ml = workspace + size_t(dims.n_heads) * n_splits * dims.head_dim;
  const int G = dims.n_heads / dims.n_kv_heads;
  dispatch_head_dim(dims.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    dispatch_group(G, [&](auto g) {
      auto kernel = decode_split_kernel<decltype(g)::value, kD>;
      raise_smem_limit(kernel, mma_ring_bytes(kD));
      launch_pdl(kernel, dim3(dims.n_kv_heads, n_splits), dim3(kMmaAttnThreads), mma_ring_bytes(kD), stream, n_splits,
                 dims.scale(), len_host, len_device, q, cache.k, cache.v, cache.capacity, ws_o, ws_ml);
    });
    LILY_CUDA_CHECK_LAUNCH();
    launch_pdl(decode_combine_kernel<kD>, dim3(dims.n_heads), dim3(kD), 0, stream, n_splits, ws_o, ws_ml, gate, out);
  });
}

void attention_prepare_rows(const AttnDims& dims, int rows, const bf16* qg, int64_t qg_stride, const bf16* k,
                            const bf16* v, int64_t kv_stride, const float* q_norm, const float* k_norm,
                            const int32_t* pos, const KvCacheView* caches, bf16* q_out, cudaStream_t stream) {
  check_dims(dims);
  MIXER_REQUIRE(rows >= 1 && rows <= kMaxDecodeRows,
                "attention_prepare_rows: rows=" + std::to_string(rows) + " outside [1, " + std::to_string(kMaxDecodeRows) + "]");
  MIXER_REQUIRE(qg && k && v && q_norm && k_norm && pos && caches && q_out, "attention_prepare_rows: null buffer");
  const PrepareArgs a =
      prepare_args(dims, qg, qg_stride, k, v, kv_stride, q_norm, k_norm, q_out, "attention_prepare_rows");
  const int warps = prepare_warps(dims);
  dispatch_head_dim(dims.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    launch_pdl(prepare_rows_kernel<kD>, dim3(rows), dim3(warps * kWarp), prepare_smem(dims, warps), stream, a, pos,
               caches);
  });
  LILY_CUDA_CHECK_LAUNCH();
}

size_t attention_decode_rows_workspace_bytes(const AttnDims& dims, int rows) {
  return size_t(rows) * attention_decode_workspace_bytes(dims, kMaxDecodeSplits);
}

void attention_decode_rows(const AttnDims& dims, int rows, const bf16* q, const bf16* gate, int64_t gate_stride,
                           const KvCacheView* caches, const int32_t* len, const int32_t* splits, int max_splits,
                           float* workspace, size_t workspace_bytes, bf16* out, cudaStream_t stream) {
  check_dims(dims);
  MIXER_REQUIRE(rows >= 1 && rows <= kMaxDecodeRows,
                "attention_decode_rows: rows=" + std::to_string(rows) + " outside [1, " + std::to_string(kMaxDecodeRows) + "]");
  MIXER_REQUIRE(q && caches && len && splits && workspace && out, "attention_decode_rows: null buffer");
  MIXER_REQUIRE(max_splits >= 1 && max_splits <= kMaxDecodeSplits,
                "attention_decode_rows: max_splits " + std::to_string(max_splits) + " outside [1, 256]");
  MIXER_REQUIRE(workspace_bytes >= attention_decode_rows_workspace_bytes(dims, rows),
                "attention_decode_rows: workspace of " + std::to_string(workspace_bytes) + " bytes < " +
                    std::to_string(attention_decode_rows_workspace_bytes(dims, rows)));
  MIXER_REQUIRE(!gate || gate_stride >= int64_t(dims.n_heads) * 2 * dims.head_dim,
                "attention_decode_rows: gate row stride too small");
  // Each row's region holds the partials of kMaxDecodeSplits splits, laid out as attention_decode's.
  const int64_t ws_row_floats = int64_t(attention_decode_workspace_bytes(dims, kMaxDecodeSplits) / sizeof(float));
  const int G = dims.n_heads / dims.n_kv_heads;
  dispatch_head_dim(dims.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    dispatch_group(G, [&](auto g) {
      auto kernel = decode_split_rows_kernel<decltype(g)::value, kD>;
      raise_smem_limit(kernel, mma_ring_bytes(kD));
      launch_pdl(kernel, dim3(dims.n_kv_heads, max_splits, rows), dim3(kMmaAttnThreads), mma_ring_bytes(kD), stream,
                 dims.n_heads, max_splits, dims.scale(), len, splits, q, caches, workspace, ws_row_floats);
    });
    LILY_CUDA_CHECK_LAUNCH();
    launch_pdl(decode_combine_rows_kernel<kD>, dim3(dims.n_heads, rows), dim3(kD), 0, stream, dims.n_heads,
               max_splits, splits, workspace, ws_row_floats, gate, gate_stride, out);
  });
}

void attention_prefill(const AttnDims& dims, int T, int64_t base, const bf16* q, const bf16* gate,
                       int64_t gate_stride, const KvCacheView& cache, bf16* out,
                       cudaStream_t stream) {
  check_dims(dims);
  check_cache(cache);
  MIXER_REQUIRE(T >= 1 && T <= 65535, "attention_prefill: T=" + std::to_string(T) + " outside [1, 65535]");
  MIXER_REQUIRE(q && out, "attention_prefill: null buffer");
  MIXER_REQUIRE(base >= 0 && base + T <= cache.capacity,
          "attention_prefill: keys [0, " + std::to_string(base + T) +
              ") exceed the KV cache capacity " + std::to_string(cache.capacity));
  MIXER_REQUIRE(!gate || gate_stride >= int64_t(dims.n_heads) * 2 * dims.head_dim,
          "attention_prefill: gate row stride too small");
  if (flash_prefill_enabled()) {
    attention_prefill_flash(dims, T, base, q, gate, gate_stride, cache, out, stream);
    return;
  }
  const int G = dims.n_heads / dims.n_kv_heads;
  dispatch_head_dim(dims.head_dim, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    dispatch_group(G, [&](auto g) {
      prefill_row_kernel<decltype(g)::value, kD><<<dim3(T, dims.n_kv_heads), kThreads, 0, stream>>>(
          dims.n_heads, dims.scale(), base, q, gate, gate_stride, cache.k, cache.v,
          cache.capacity, out);
    });
  });
  LILY_CUDA_CHECK_LAUNCH();
}

}  // namespace lily::cuda
