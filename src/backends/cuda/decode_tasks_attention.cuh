// The persistent decode kernel's gated-attention task bodies (nvcc only; docs/model.md §3.4,
// numerics §4.3 item 4): per KV head h the prepare (q/k RMSNorm + partial RoPE, K/V appended to
// the cache), the key splits (partial softmax of each split) and the combine (splits merged,
// output gate applied). decode_program.h builds the tasks; decode_tasks_common.cuh states the
// rules every body follows. The arithmetic is that of attention.cu's prepare and combine, and of
// cpu::attention_head for the scores: fp32 scores from bf16 q and k, fp32 probabilities and sums.
//
// Notation: nq query heads, nkv KV heads, G = nq/nkv query heads per KV head (1, 2, 4 or 8),
// head dim D ∈ {64, 128, 256}, S = grain.attn_splits, n = position + 1 keys in the cache.
//
// p.attn_part, fp32 [nkv·S, G, D + 2]: slot h·S + s, query head g of the group holds
// (m, l, o[0 … D)): m the split's largest score (natural-log domain, −inf for an empty split),
// l = Σ exp(score − m), o[d] = Σ exp(score − m)·v[d] (unnormalised).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/decode_tasks_common.cuh"

namespace lily::cuda {
namespace attn_task {

constexpr int kThreads = kDecodeTaskThreads;
constexpr int kWarps = kThreads / kWarp;
constexpr int kMaxHalf = 128;    // rotary_dim/2 ≤ D/2 ≤ 128
constexpr int kMaxGroup = 8;
/// Keys whose scores a split holds in shared memory at once (a longer split runs in chunks).
constexpr int kChunkKeys = 256;
/// Bytes at the front of a split's shared memory: the per-head running (m, l) and rescale factor
/// (3·kMaxGroup fp32), padded so that what follows stays 16-byte aligned.
constexpr int kSplitStatBytes = 3 * kMaxGroup * 4 + 32;

static_assert(kWarps >= kMaxGroup + 1, "prepare: a warp for each query head and one for the key");

/// Shared-memory bytes of split_body: the statistics, the queries [G, D], the chunk's scores
/// [kChunkKeys, G] and the merge area [kWarps, G, D], all fp32.
__host__ __device__ constexpr int split_smem_bytes(int G, int D) {
  return kSplitStatBytes + 4 * (G * D + kChunkKeys * G + kWarps * G * D);
}
static_assert(split_smem_bytes(kMaxGroup, 256) <= kDecodeTaskSmemBytes, "split: must fit the task's shared memory");

/// N = D/32 consecutive bf16 at p (aligned to N elements), raw, read past L1 (written by another
/// block of this launch).
template <int N>
__device__ __forceinline__ typename Bf16Vec<N>::type ld_cg_bf16_raw(const bf16* p) {
  if constexpr (N == 8) return __ldcg(reinterpret_cast<const uint4*>(p));
  else if constexpr (N == 4) return __ldcg(reinterpret_cast<const uint2*>(p));
  else return __ldcg(reinterpret_cast<const unsigned int*>(p));
}

/// Calls f(std::integral_constant<int, D>{}) for the runtime head dim (64, 128 or 256; other
/// values do nothing: the host's attn_dims refuses them).
template <class F>
__device__ __forceinline__ void with_head_dim(int D, F&& f) {
  switch (D) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: break;
  }
}

/// Calls f(std::integral_constant<int, G>{}) for the runtime group size (1, 2, 4 or 8; others
/// do nothing, as with_head_dim).
template <class F>
__device__ __forceinline__ void with_group(int G, F&& f) {
  switch (G) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: break;
  }
}

/// (cos φ_j, sin φ_j) of RoPE pair j at position `pos` (docs/model.md §3.4 step 3) the way
/// cpu::rope_cos_sin computes it: inv_freq = 1/θ^(2j/R) with the exponent and the division in
/// fp32, φ = fp32(pos·inv_freq), cos and sin in double rounded to fp32. The reference's fp32 pow
/// is taken as the double pow rounded to fp32 (the correctly rounded fp32 power but for values
/// within a double rounding error of a halfway point).
__device__ __forceinline__ float2 rope_pair(int64_t pos, int j, int rotary_dim, float theta) {
  const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
  const float inv_freq = 1.0f / static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
  const float angle = static_cast<float>(pos) * inv_freq;
  return make_float2(static_cast<float>(cos(static_cast<double>(angle))),
                     static_cast<float>(sin(static_cast<double>(angle))));
}

/// One head by one warp, lane l holding dims [l·N, l·N + N) of y (fp32, N = kD/32): the per-head
/// RMSNorm (docs/model.md §3.2, §3.4 step 2) y ← bf16((y·r)·gain), r = 1/√(Σy²/kD + eps), then
/// the half-split RoPE of the first 2·half dims (§3.4 step 3) with the (cos, sin) table cs [half],
/// the partner dim read from the warp's `stage` row (kD fp32). The result is left unrounded in y
/// (the caller rounds it once to bf16 as it stores it). attention.cu's rms_norm_head and
/// rope_head, in the same operation order.
template <int kD>
__device__ __forceinline__ void norm_rope_head(float (&y)[kD / kWarp], const float* gain, float eps, int half,
                                               const float2* cs, float* stage) {
  constexpr int N = kD / kWarp;
  const int d0 = (threadIdx.x % kWarp) * N;
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < N; ++e) ss += y[e] * y[e];
  ss = warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(kD) + eps);
#pragma unroll
  for (int e = 0; e < N; ++e) y[e] = round_bf16((y[e] * r) * __ldg(gain + d0 + e));
  if (half == 0) return;  // uniform over the warp
#pragma unroll
  for (int e = 0; e < N; ++e) stage[d0 + e] = y[e];
  __syncwarp();
  float partner[N];
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const int d = d0 + e;
    partner[e] = d < 2 * half ? stage[d < half ? d + half : d - half] : 0.0f;
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const int d = d0 + e;
    if (d < 2 * half) {
      const float2 c = cs[d < half ? d : d - half];
      y[e] = d < half ? y[e] * c.x - partner[e] * c.y : y[e] * c.x + partner[e] * c.y;
    }
  }
}

/// prepare(h) for head dim kD: warp g < G takes query head h·G + g (the first D of its 2·D rows
/// of p.proj), warp G the key of KV head h (p.proj at nq·2D + h·D) and copies its value
/// (at nq·2D + nkv·D + h·D) into the cache. Shared memory: the (cos, sin) table, kMaxHalf
/// float2, then one staging row of kD fp32 per working warp.
template <int kD>
__device__ __forceinline__ void prepare_body(const DecodeStepParams& p, int layer, int h, char* smem) {
  constexpr int N = kD / kWarp;
  using Raw = typename Bf16Vec<N>::type;
  const AttnDims& a = p.attn_dims;
  const DecodeTaskLayer& lw = p.layers[layer];
  const int G = a.n_heads / a.n_kv_heads, half = a.rotary_dim / 2;
  const int warp = threadIdx.x / kWarp, d0 = (threadIdx.x % kWarp) * N;
  const int64_t pos = __ldcg(p.position);
  float2* cs = reinterpret_cast<float2*>(smem);
  float* stage = reinterpret_cast<float*>(smem + kMaxHalf * sizeof(float2)) + warp * kD;

  const int64_t q_rows = static_cast<int64_t>(a.n_heads) * 2 * kD, kv_rows = static_cast<int64_t>(a.n_kv_heads) * kD;
  const bool is_q = warp < G, is_k = warp == G;
  Raw x{}, v{};  // in flight while the table is computed
  if (is_q) x = ld_cg_bf16_raw<N>(p.proj + static_cast<int64_t>(h * G + warp) * 2 * kD + d0);
  if (is_k) {
    x = ld_cg_bf16_raw<N>(p.proj + q_rows + static_cast<int64_t>(h) * kD + d0);
    v = ld_cg_bf16_raw<N>(p.proj + q_rows + kv_rows + static_cast<int64_t>(h) * kD + d0);
  }
  for (int j = threadIdx.x; j < half; j += blockDim.x) cs[j] = rope_pair(pos, j, a.rotary_dim, a.rope_theta);
  __syncthreads();
  if (!is_q && !is_k) return;  // whole warps; no barrier follows

  float y[N];
  unpack_bf16<N>(x, y);
  norm_rope_head<kD>(y, is_q ? lw.q_norm : lw.k_norm, a.norm_eps, half, cs, stage);
  if (is_q) {
    store_bf16_vec<N>(y, p.query + static_cast<int64_t>(h * G + warp) * kD + d0);
  } else {
    const int64_t at = (static_cast<int64_t>(h) * lw.kv.capacity + pos) * kD + d0;
    store_bf16_vec<N>(y, lw.kv.k + at);
    *reinterpret_cast<Raw*>(lw.kv.v + at) = v;  // V is not normed (§3.4 step 4)
  }
}

/// Warp reduce-scatter of NV values per lane (NV a power of two ≤ 32), by halving exchanges over
/// the butterfly offsets O = 16, 8, …, 1: while more than one value is left, a lane keeps the
/// half its bit O selects and adds the partner's copy of it; afterwards the remaining offsets
/// sum the single value. Returns, on lane l, the warp sum of value l / (32/NV), with NV − 1 +
/// (5 − log2 NV) shuffles instead of 5·NV.
template <int NV, int O = kWarp / 2>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[NV], int lane) {
  static_assert(NV >= 1 && NV <= kWarp && (NV & (NV - 1)) == 0, "warp_reduce_scatter: NV a power of two ≤ 32");
  if constexpr (NV == 1) {
    float s = v[0];
#pragma unroll
    for (int o = O; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
  } else {
    constexpr int H = NV / 2;
    const bool upper = (lane & O) != 0;
    float kept[H];
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = upper ? v[i] : v[i + H];
      const float keep = upper ? v[i + H] : v[i];
      kept[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    return warp_reduce_scatter<H, O / 2>(kept, lane);
  }
}

/// Keys of a split's chunk scored together by one warp (one load round trip per batch): B·G
/// scores are reduced at once (B·G ≤ 32; 2 keys at G = 8 keep the registers under 128).
template <int G>
constexpr int score_batch() {
  return G >= 8 ? 2 : 4;
}
/// Keys whose V rows a warp loads before using the first of them.
constexpr int kValueBatch = 4;

/// split(h, s) for group G and head dim kD over keys [k0, k1) of KV head h (docs/model.md §3.4
/// step 5, split-K). The G queries are staged once (fp32 [G, kD] in shared memory); the keys run
/// in chunks of kChunkKeys, and per chunk:
///  1. scores: warp w takes batches of B consecutive keys (the w-th, then every kWarps-th batch);
///     lane l holds dims [l·N, l·N + N) (N = kD/32) of the G queries and of the key, and the B·G
///     dot products are reduced together (warp_reduce_scatter); score = (q·k)·scale into
///     sc[key][g] (fp32);
///  2. softmax statistics: warp g < G takes head g: the chunk's max, the new running max m', the
///     factor c = exp(m − m') for the keys before, p = exp(score − m') in place of the score, and
///     l ← l·c + Σp;
///  3. values: each warp takes batches of kValueBatch consecutive keys (as in 1) and forms, for
///     this lane's dims, acc[g][d] = c·acc[g][d] + Σ p[key][g]·v[key][d]; its accumulators live
///     in its own row of the merge area between chunks, so that the queries (phase 1) and the
///     accumulators (phase 3) are never in registers together (G·N each: 64 at G = 8, D = 256).
/// Finally the kWarps rows are summed in warp order and written with (m, l) to slot `part` of
/// p.attn_part. Shared memory (split_smem_bytes): the per-head statistics, the queries, the
/// chunk's scores [kChunkKeys, G] fp32, the merge area [kWarps, G, kD] fp32.
template <int G, int kD>
__device__ __forceinline__ void split_body(const DecodeStepParams& p, int layer, int part, char* smem) {
  constexpr int N = kD / kWarp;
  constexpr int B = score_batch<G>();
  constexpr int BV = kValueBatch;
  using Raw = typename Bf16Vec<N>::type;
  const KvCacheView kv = p.layers[layer].kv;
  const int S = p.grain.attn_splits, h = part / S, s = part % S;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, d0 = lane * N;
  const int64_t n = static_cast<int64_t>(__ldcg(p.position)) + 1;
  const int64_t k0 = n * s / S, k1 = n * (s + 1) / S;
  const bf16* K = kv.k + static_cast<int64_t>(h) * kv.capacity * kD;
  const bf16* V = kv.v + static_cast<int64_t>(h) * kv.capacity * kD;
  const float scale = 1.0f / sqrtf(static_cast<float>(kD));  // AttnDims::scale()

  float* m_s = reinterpret_cast<float*>(smem);  // running max per head
  float* l_s = m_s + kMaxGroup;                  // running sum per head
  float* c_s = l_s + kMaxGroup;                  // this chunk's rescale factor per head
  float* q_s = reinterpret_cast<float*>(smem + kSplitStatBytes);  // [G, kD]
  float* sc = q_s + G * kD;                                       // [kChunkKeys, G]
  float* merge = sc + kChunkKeys * G;                             // [kWarps, G, kD]
  float* acc_row = merge + warp * G * kD + d0;                    // this lane's dims of its warp's row

  if (threadIdx.x == 0 && k1 > k0) {  // the split's K and V rows towards L2 while the queries load
    prefetch_l2(K + k0 * kD, (k1 - k0) * kD * static_cast<int64_t>(sizeof(bf16)));
    prefetch_l2(V + k0 * kD, (k1 - k0) * kD * static_cast<int64_t>(sizeof(bf16)));
  }
  if (threadIdx.x < G) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.0f;
  }
  for (int i = threadIdx.x; i < G * kD; i += blockDim.x) q_s[i] = ld_cg_bf16(p.query + static_cast<int64_t>(h * G) * kD + i);
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < N; ++e) acc_row[g * kD + e] = 0.0f;  // an empty split writes zeros
  __syncthreads();

  for (int64_t c0 = k0; c0 < k1; c0 += kChunkKeys) {  // uniform over the block
    const int cn = static_cast<int>(k1 - c0 < kChunkKeys ? k1 - c0 : kChunkKeys);

    // 1. Scores.
    {
      float q[G][N];
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < N; ++e) q[g][e] = q_s[g * kD + d0 + e];
      for (int b0 = warp * B; b0 < cn; b0 += kWarps * B) {  // uniform over the warp
        Raw kr[B];
#pragma unroll
        for (int b = 0; b < B; ++b) kr[b] = b0 + b < cn ? ld_cg_bf16_raw<N>(K + (c0 + b0 + b) * kD + d0) : Raw{};
        float part_dot[B * G];
#pragma unroll
        for (int b = 0; b < B; ++b) {
          float kx[N];
          unpack_bf16<N>(kr[b], kx);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < N; ++e) d += q[g][e] * kx[e];
            part_dot[b * G + g] = d;
          }
        }
        constexpr int kSpread = kWarp / (B * G);  // lanes holding each reduced dot product
        const float dot = warp_reduce_scatter<B * G>(part_dot, lane);
        const int idx = lane / kSpread, b = idx / G;
        if (lane % kSpread == 0 && b0 + b < cn) sc[(b0 + b) * G + idx % G] = dot * scale;
      }
    }
    __syncthreads();

    // 2. Softmax statistics of the chunk, head by head.
    if (warp < G) {
      const int g = warp;
      float mx = -INFINITY;
      for (int i = lane; i < cn; i += kWarp) mx = fmaxf(mx, sc[i * G + g]);
      mx = warp_max(mx);
      const float m_old = m_s[g], m_new = fmaxf(m_old, mx);  // finite: the chunk has a key
      float sum = 0.0f;
      for (int i = lane; i < cn; i += kWarp) {
        const float pr = expf(sc[i * G + g] - m_new);
        sc[i * G + g] = pr;
        sum += pr;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float c = expf(m_old - m_new);  // 0 on the first chunk (m_old = −inf)
        c_s[g] = c;
        l_s[g] = l_s[g] * c + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // 3. Probability-weighted values.
    {
      float acc[G][N];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float c = c_s[g];
#pragma unroll
        for (int e = 0; e < N; ++e) acc[g][e] = c0 == k0 ? 0.0f : acc_row[g * kD + e] * c;
      }
      for (int b0 = warp * BV; b0 < cn; b0 += kWarps * BV) {  // uniform over the warp
        Raw vr[BV];
#pragma unroll
        for (int b = 0; b < BV; ++b) vr[b] = b0 + b < cn ? ld_cg_bf16_raw<N>(V + (c0 + b0 + b) * kD + d0) : Raw{};
#pragma unroll
        for (int b = 0; b < BV; ++b) {
          if (b0 + b >= cn) break;  // uniform over the warp
          float vx[N];
          unpack_bf16<N>(vr[b], vx);
          const float* pr = sc + (b0 + b) * G;
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float pg = pr[g];
#pragma unroll
            for (int e = 0; e < N; ++e) acc[g][e] += pg * vx[e];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < N; ++e) acc_row[g * kD + e] = acc[g][e];
    }
    __syncthreads();  // sc is rewritten by the next chunk; the rows are summed below
  }

  // Sum the warps' rows (in warp order) and write the slot.
  float* out = p.attn_part + static_cast<int64_t>(part) * G * (kD + 2);
  for (int i = threadIdx.x; i < G * kD; i += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += merge[w * G * kD + i];
    out[(i / kD) * (kD + 2) + 2 + i % kD] = sum;
  }
  if (threadIdx.x < G) {
    out[threadIdx.x * (kD + 2)] = m_s[threadIdx.x];
    out[threadIdx.x * (kD + 2) + 1] = l_s[threadIdx.x];
  }
}

}  // namespace attn_task

/// Attention prepare of layer `layer`, KV head h = part (docs/model.md §3.4 steps 2-4, numerics
/// §4.3 item 4; attention_prepare's arithmetic): for the G query heads h·G … h·G + G − 1,
/// q = bf16(RoPE(bf16(RMSNorm(q_raw)·q_norm))) into p.query [nq, D]; for KV head h,
/// k = bf16(RoPE(bf16(RMSNorm(k_raw)·k_norm))) into kv.k [nkv, capacity, D] at (h, position) and
/// the raw v into kv.v at (h, position). Reads p.proj (bf16: per query head [query D | gate D],
/// then K [nkv·D], then V [nkv·D]). RoPE: first rotary_dim dims, half-split, inv_freq_j =
/// 1/θ^(2j/rotary_dim), φ = position·inv_freq_j. Shared memory: ≤ 1 KB + (G + 1)·D·4 bytes.
__device__ inline void task_attn_prepare(const DecodeStepParams& p, int layer, int part, char* smem) {
  attn_task::with_head_dim(p.attn_dims.head_dim, [&](auto d) {
    attn_task::prepare_body<decltype(d)::value>(p, layer, part, smem);
  });
}

/// Attention split `part` = h·S + s of layer `layer` (docs/model.md §3.4 step 5, split-K):
/// keys [n·s/S, n·(s+1)/S) of KV head h (n = position + 1; empty when n < S for some s) against
/// the G queries of the group (p.query, bf16 [nq, D]) from the KV cache (bf16 [nkv, capacity,
/// D], rows appended by this launch's prepare tasks, read past L1). Per query head g: scores
/// s_t = (q·k_t)·(1/√D) in fp32, m = max_t s_t, l = Σ_t exp(s_t − m), o[d] = Σ_t exp(s_t − m)·v_t[d],
/// all fp32, into p.attn_part slot `part`, head g (layout at the top of this file); an empty
/// split writes m = −inf, l = 0, o = 0. Shared memory: split_smem_bytes(G, D) (144 KB at G = 8,
/// D = 256).
__device__ inline void task_attn_split(const DecodeStepParams& p, int layer, int part, char* smem) {
  const int G = p.attn_dims.n_heads / p.attn_dims.n_kv_heads;
  attn_task::with_head_dim(p.attn_dims.head_dim, [&](auto d) {
    attn_task::with_group(G, [&](auto g) {
      attn_task::split_body<decltype(g)::value, decltype(d)::value>(p, layer, part, smem);
    });
  });
}

/// Attention combine of layer `layer`, KV head h = part (docs/model.md §3.4 steps 5-6, §4.3
/// item 4; attention.cu's decode_combine): for each query head q = h·G + g, over the splits s
/// holding keys, M = max_s m_s, f_s = exp(m_s − M), L = Σ_s l_s·f_s, o[d] = (Σ_s o_s[d]·f_s)/L
/// (fp32, splits in order), then y[d] = bf16(o[d]·sigmoid(gate[d])), rounded once as
/// cpu_backend's attention_mixer does, with gate the query head's rows [D, 2D) of p.proj (bf16),
/// into p.mix [nq·D] at q·D + d. Splits without keys (n·s/S = n·(s+1)/S) are skipped whatever
/// their slot holds. Warp g < G first computes head g's f_s and L into shared memory (G·S + G
/// fp32); then thread i takes outputs (g, d) = (j / D, j % D) for j = i, i + 512, … < G·D.
__device__ inline void task_attn_combine(const DecodeStepParams& p, int layer, int part, char* smem) {
  (void)layer;  // p.attn_part and p.proj hold the current layer's values
  const AttnDims& a = p.attn_dims;
  const int G = a.n_heads / a.n_kv_heads, D = a.head_dim, S = p.grain.attn_splits, h = part;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t n = static_cast<int64_t>(__ldcg(p.position)) + 1;
  const float* slots = p.attn_part + static_cast<int64_t>(h) * S * G * (D + 2);  // [S, G, D + 2]
  float* f_s = reinterpret_cast<float*>(smem);  // [G, S]: each split's factor f_s (0: skipped)
  float* L_s = f_s + G * S;                     // [G]

  if (warp < G) {
    const int g = warp;
    float M = -INFINITY;
    for (int s = lane; s < S; s += kWarp) {
      const bool keys = n * s / S != n * (s + 1) / S;
      const float m = keys ? ld_cg_f32(slots + (static_cast<int64_t>(s) * G + g) * (D + 2)) : -INFINITY;
      f_s[g * S + s] = m;  // the max for now; its factor below (same lane)
      M = fmaxf(M, m);
    }
    M = warp_max(M);  // finite: split S − 1 always holds key n − 1
    float L = 0.0f;
    for (int s = lane; s < S; s += kWarp) {
      const float m = f_s[g * S + s];
      float f = 0.0f;
      if (m != -INFINITY) {
        f = expf(m - M);
        L += ld_cg_f32(slots + (static_cast<int64_t>(s) * G + g) * (D + 2) + 1) * f;
      }
      f_s[g * S + s] = f;
    }
    L = warp_sum(L);
    if (lane == 0) L_s[g] = L;
  }
  __syncthreads();

  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    const float* o = slots + static_cast<int64_t>(g) * (D + 2) + 2 + d;
    const float* f = f_s + g * S;
    float acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < S; ++s) {  // unrolled: several splits' loads in flight, summed in order
      const float v = ld_cg_f32(o + static_cast<int64_t>(s) * G * (D + 2));
      if (f[s] != 0.0f) acc += v * f[s];  // skipped splits may hold anything
    }
    const int qh = h * G + g;
    const float gate = ld_cg_bf16(p.proj + static_cast<int64_t>(qh) * 2 * D + D + d);
    const float y = (acc / L_s[g]) * (1.0f / (1.0f + expf(-gate)));
    p.mix[static_cast<int64_t>(qh) * D + d] = to_bf16(y);
  }
}

}  // namespace lily::cuda
