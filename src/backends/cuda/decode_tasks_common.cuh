// Device building blocks of the persistent decode kernel's task bodies (nvcc only): loads that
// see other blocks' writes of the same launch, an activation row staged with or without an
// add + RMSNorm, the MLX-affine GEMV over a task's rows, the weight slots that bulk copies fill,
// and the L2 prefetch of a task's weights.
//
// The rules every body follows (decode_tasks.h):
//  * all kDecodeTaskThreads threads of the block call the body, which may use __syncthreads();
//  * activations and sequence state are read with ld.global.cg (the ld_cg_* helpers, __ldcg):
//    other blocks of the same launch wrote them, and L1 is not coherent across SMs; weights and
//    the model's fp32 vectors never change and take the read-only path (__ldg);
//  * a body leaves its results in global memory by plain stores; the caller's counter_signal
//    orders them before its signal.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/decode_tasks.h"
#include "backends/cuda/quant_dot.cuh"

namespace lily::cuda {

/// bf16 at p as fp32, read past L1 (written by another block of this launch).
__device__ __forceinline__ float ld_cg_bf16(const bf16* p) {
  return bits_to_f32(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
/// fp32 at p, read past L1.
__device__ __forceinline__ float ld_cg_f32(const float* p) { return __ldcg(p); }

/// Rows [first, last) of a stage of `total` rows cut every `per` rows: part p's range.
struct RowRange {
  int64_t first = 0, last = 0;
};
__device__ __forceinline__ RowRange part_rows(int part, int per, int64_t total) {
  const int64_t first = static_cast<int64_t>(part) * per;
  return RowRange{first, first + per < total ? first + per : total};
}

/// Shared-memory floats of a staged activation row of `cols` values: the values (group g at
/// g·kGroupStride, quant_dot.cuh's layout) and then one Σx per group.
__host__ __device__ constexpr int64_t staged_row_floats(int cols) {
  return static_cast<int64_t>(cols / kGroup) * (kGroupStride + 1);
}

/// Floats of a staged row of `cols` values rounded up to a multiple of 4 (what follows it in
/// shared memory stays 16-byte aligned).
__host__ __device__ constexpr int64_t staged_row_floats_16(int cols) { return (staged_row_floats(cols) + 3) / 4 * 4; }

/// Eight bf16 at p (16-byte aligned) as fp32, read past L1 in one load.
__device__ __forceinline__ void ld_cg_bf16x8(const bf16* p, float (&x)[8]) {
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
  const float4 a = bf16x4_to_f32(v.x, v.y), b = bf16x4_to_f32(v.z, v.w);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// The staging functions and the GEMV below are calls, not inlined: every task body runs the one
// copy of them, which keeps the kernel's code a fraction of what inlined bodies made (a weight
// body was 115–185 KB of SASS, now 5–45 KB beside the 50 KB GEMV). On an H100 this changed no
// speed: the bodies do not wait on instruction fetch (docs/cuda.md, "Where it stands").

/// Stages bf16 x [cols] (read past L1, 16-byte aligned, cols a multiple of 64) into xs (fp32,
/// quant_dot.cuh's layout) and its group sums into xsum = xs + (cols / 64)·kGroupStride: thread
/// i takes the eight values 8i … 8i + 7 (one load; every load of the row in flight at once). All
/// threads; ends with __syncthreads().
__device__ inline __noinline__ void stage_row_cg(const bf16* x, int cols, float* xs) {
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {
    float v[8];
    ld_cg_bf16x8(x + c, v);
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;  // 8 values never straddle a group
#pragma unroll
    for (int u = 0; u < 8; ++u) e[u] = v[u];
  }
  __syncthreads();
  stage_group_sums(cols, xs, xs + (cols / kGroup) * kGroupStride);
}

/// The add + RMSNorm of docs/model.md §4.1 staged for a GEMV: h = bf16(x + branch) (x alone
/// when branch is null), y = bf16(h · r · gain) with r = 1 / sqrt(Σh² / cols + eps), y staged
/// into xs as stage_row_cg does (with its group sums). x and branch are read past L1, eight
/// values a load (16-byte aligned, cols a multiple of 64). With h_out / y_out non-null, h and y
/// are also stored (bf16 [cols]). All threads; ends with __syncthreads(). Σh² is summed per
/// thread in element order, then over the block.
__device__ inline __noinline__ void stage_add_norm_cg(const bf16* x, const bf16* branch, const float* gain, int cols,
                                                     float eps, float* xs, bf16* h_out, bf16* y_out) {
  __shared__ float scratch[32];
  float ss = 0.0f;
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {
    float v[8], b[8];
    ld_cg_bf16x8(x + c, v);
    if (branch) ld_cg_bf16x8(branch + c, b);
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const float h = branch ? round_bf16(v[u] + b[u]) : v[u];
      e[u] = h;
      ss += h * h;
    }
  }
  const float total = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {  // each thread revisits its own elements
    float* e = xs + (c / kGroup) * kGroupStride + c % kGroup;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const float h = e[u];
      const bf16 y = to_bf16(h * r * __ldg(gain + c + u));
      e[u] = to_f32(y);
      if (h_out) h_out[c + u] = to_bf16(h);
      if (y_out) y_out[c + u] = y;
    }
  }
  __syncthreads();
  stage_group_sums(cols, xs, xs + (cols / kGroup) * kGroupStride);
}

/// Rows a warp's row-group computes at once in gemv_row_refs when the rows are in global memory
/// (independent loads in flight); rows in shared memory are computed one at a time.
constexpr int kTaskGemvUnroll = 4;

/// One matrix row as a task's GEMV reads it, in global or shared memory: its BITS-bit code words,
/// its per-group scales and biases (bf16), and the staged input row it multiplies (xs: the
/// values in quant_dot.cuh's layout, then one Σx per group). codes == nullptr: no row.
struct QuantRowRef {
  const uint32_t* codes = nullptr;
  const bf16* scales = nullptr;
  const bf16* biases = nullptr;
  const float* xs = nullptr;
};

/// This lane's share of U rows' dot products (docs/model.md §4.2): lanes lane_in of L stride
/// over the `groups` 64-groups, acc[j] += s·Σ(q·x) + b·Σx per group in group order. SHARED: the
/// rows are in shared memory (plain loads), else in global memory (read-only path). Caller
/// reduces acc[j] with group_sum(·, L). Either memory gives the same bits.
///
/// The loops over groups and over a group's 16-byte vectors stay rolled, to keep the one GEMV
/// that every body calls small; rows in shared memory need no independent loads in flight.
template <int BITS, int U, bool SHARED>
__device__ __forceinline__ void rows_partial_refs(const QuantRowRef (&r)[U], int groups, int lane_in, int L,
                                                  float (&acc)[U]) {
  constexpr int kWordsPerGroup = kGroup * BITS / 32;
  constexpr int kVecs = kGroupVecs<BITS>, kPerVec = 4 * 32 / BITS;  // vectors a group, codes a vector
#pragma unroll
  for (int j = 0; j < U; ++j) acc[j] = 0.0f;
#pragma unroll 1
  for (int g = lane_in; g < groups; g += L) {
    float dot[U];
#pragma unroll
    for (int j = 0; j < U; ++j) dot[j] = 0.0f;
#pragma unroll 1
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (!r[j].codes) continue;
        const uint4* gw = reinterpret_cast<const uint4*>(r[j].codes + g * kWordsPerGroup) + v;
        const uint4 q = SHARED ? *gw : __ldg(gw);
        dot[j] = vec_qdot<BITS>(q, r[j].xs + g * kGroupStride + v * kPerVec, dot[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (!r[j].codes) continue;
      float s, b;
      if constexpr (SHARED) {
        s = to_f32(r[j].scales[g]);
        b = to_f32(r[j].biases[g]);
      } else {
        s = bits_to_f32(__ldg(reinterpret_cast<const unsigned short*>(r[j].scales + g)));
        b = bits_to_f32(__ldg(reinterpret_cast<const unsigned short*>(r[j].biases + g)));
      }
      acc[j] += s * dot[j] + b * r[j].xs[groups * kGroupStride + g];
    }
  }
}

/// `count` rows v = 0 … count − 1 of `groups` 64-groups each, dealt to the warps' row-groups
/// (lanes_per_row lanes a row; a row-group takes kTaskGemvUnroll consecutive rows at a time
/// from global memory, one from shared memory):
/// row_of(v) names the row and its input (QuantRowRef), store(v, value) takes the fp32 dot
/// product (one lane per row). A row's arithmetic depends on its width alone, not on where it
/// is dealt or stored. All threads (warp-uniform loops).
template <int BITS, bool SHARED, class RowOf, class Store>
__device__ __forceinline__ void gemv_row_refs(int groups, int count, RowOf row_of, Store store) {
  constexpr int U = SHARED ? 1 : kTaskGemvUnroll;
  const int L = lanes_per_row(groups), per_warp = kWarp / L;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  const int sub = lane / L, lane_in = lane % L;
  const int per_round = n_warps * per_warp * U;
  const int rounds = (count + per_round - 1) / per_round;
#pragma unroll 1
  for (int it = 0; it < rounds; ++it) {  // the same count on every lane: shuffles stay converged
    const int base = it * per_round + (warp * per_warp + sub) * U;
    QuantRowRef r[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j < count) r[j] = row_of(base + j);
    float acc[U];
    rows_partial_refs<BITS, U, SHARED>(r, groups, lane_in, L, acc);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float v = group_sum(acc[j], L);
      if (lane_in == 0 && base + j < count) store(base + j, v);
    }
  }
}

// ---- Weight slots ----------------------------------------------------------------------------
// A task that multiplies weight rows reads them from a slot of shared memory, where the bulk-copy
// engine put them: the codes, scales and biases of each run of consecutive rows are contiguous in
// the checkpoint layout, so a run is three copies, and one thread starts them without waiting.
// For a task whose rows do not depend on the step's data (projections, router, the shared
// expert's gate/up), the persistent kernel starts the copy while the block still runs the task
// before it, so the bytes arrive while the block computes or waits on its counters; a routed
// expert's task starts its copy as soon as it has routed. Rows that a slot cannot take (too many
// bytes, or runs not on 16-byte bounds, as with some rows of small models) are read from global
// memory instead, with the same arithmetic.

/// The rows of one task GEMV (task_gemv), as data rather than code, so that every body runs
/// the same GEMV instructions: `runs` runs of `count` consecutive rows of one matrix shape
/// (groups 64-groups of `bits`-bit codes a row); run j's codes, scales and biases start at
/// codes[j], scales[j] and biases[j] (row strides code_row and sb_row bytes), in a weight slot
/// (in_shared) or in global memory, and its input row is the staged xs + j·xs_stride (floats).
/// Lives in shared memory; thread 0 fills it (fill_gemv_runs).
///
/// Each run keeps its own pointers, not a base and a run stride: in a slot the runs do sit a
/// fixed run_bytes apart, but rows read from global memory (the fallback when they do not fit a
/// slot) start wherever their matrix and expert put them: the gate and up stacks for a gate/up
/// task, each slot's expert in the down stack for a down task.
struct GemvRuns {
  static constexpr int kMaxRuns = kMaxTopK + 1;  ///< the down task's k + 1 slots
  int runs = 0, count = 0, groups = 0, bits = 4;
  bool in_shared = false;
  int64_t code_row = 0, sb_row = 0, xs_stride = 0;
  const float* xs = nullptr;
  const unsigned char* codes[kMaxRuns];
  const unsigned char* scales[kMaxRuns];
  const unsigned char* biases[kMaxRuns];
};

/// What a task body gets of its block's shared memory.
struct TaskSmem {
  char* work = nullptr;           ///< the body's arrays (kTaskWorkBytes beside a slot in use)
  unsigned char* slot = nullptr;  ///< its weight slot (kTaskWeightSlotBytes, 16-byte aligned)
  uint64_t* bar = nullptr;        ///< the slot's mbarrier: a phase completes when a copy has landed
  uint32_t parity = 0;            ///< the parity of the phase this task's copy completes
  bool prefetched = false;        ///< the kernel started this task's copy before the task
  /// The block's next task, when this task's routing is what its copy needs (an expert task of
  /// the same layer whose rows fit a slot; the kernel decided): thread 0 starts that copy into
  /// next_slot on next_bar as soon as it has routed, so it lands while this task computes.
  bool copy_next = false;
  int next_kind = 0, next_part = 0;
  unsigned char* next_slot = nullptr;
  uint64_t* next_bar = nullptr;
  /// Traced launches only (else null): where thread 0 stamps the end of the input staging [0],
  /// the slot's landing [1] and the GEMV's end [2] (DecodeStepParams::trace fields 3 to 5).
  unsigned long long* stamps = nullptr;
  GemvRuns* gemv = nullptr;  ///< the block's GEMV description (shared memory, one per block)
};

/// %globaltimer in ns.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Where runs of `count` consecutive rows of one matrix shape (cols, bits) sit in a slot: run
/// after run, each its codes, then its scales, then its biases. `fits`: the runs fit the slot,
/// and every piece (and every run's source in w, for first rows that are multiples of
/// `align_rows`) is on 16-byte bounds, as bulk copies need.
struct SlotRuns {
  int runs = 0, count = 0, groups = 0;
  int64_t code_row = 0, sb_row = 0, run_bytes = 0;  // bytes
  bool fits = false;
};

/// The SlotRuns of `runs` runs of `count` rows of w's shape (w's bases and the 16-byte bounds
/// of runs starting at multiples of `align_rows` decide `fits`).
__device__ __forceinline__ SlotRuns slot_runs(const DeviceQuant& w, int runs, int count, int64_t align_rows) {
  SlotRuns l;
  l.runs = runs;
  l.count = count;
  l.groups = w.cols / kGroup;
  l.code_row = int64_t{w.cols} * w.bits / 8;
  l.sb_row = int64_t{l.groups} * 2;
  l.run_bytes = count * (l.code_row + 2 * l.sb_row);
  const auto aligned = [](int64_t bytes) { return bytes % 16 == 0; };
  const auto base_aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  l.fits = count > 0 && runs * l.run_bytes <= kTaskWeightSlotBytes && aligned(count * l.sb_row) &&
           aligned(count * l.code_row) && aligned(align_rows * l.sb_row) && aligned(align_rows * l.code_row) &&
           base_aligned(w.codes) && base_aligned(w.scales) && base_aligned(w.biases);
  return l;
}

/// Starts the copies of the runs into `slot`, completing on `bar`: run j is rows
/// [first_of(j), + l.count) of matrix_of(j) (a DeviceQuant of l's shape). One thread, after a
/// block barrier that ordered every earlier read of the slot (fence.proxy.async here).
template <class MatrixOf, class FirstOf>
__device__ __forceinline__ void slot_issue(const SlotRuns& l, MatrixOf matrix_of, FirstOf first_of,
                                           unsigned char* slot, uint64_t* bar) {
  fence_proxy_async_shared();
  mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(l.runs * l.run_bytes));
  for (int j = 0; j < l.runs; ++j) {
    const DeviceQuant& w = matrix_of(j);
    const int64_t first = first_of(j);
    unsigned char* run = slot + j * l.run_bytes;
    const uint32_t codes = static_cast<uint32_t>(l.count * l.code_row), sb = static_cast<uint32_t>(l.count * l.sb_row);
    bulk_copy_to_shared(run, reinterpret_cast<const unsigned char*>(w.codes) + first * l.code_row, codes, bar);
    bulk_copy_to_shared(run + codes, reinterpret_cast<const unsigned char*>(w.scales) + first * l.sb_row, sb, bar);
    bulk_copy_to_shared(run + codes + sb, reinterpret_cast<const unsigned char*>(w.biases) + first * l.sb_row, sb, bar);
  }
}

/// How long slot_wait spins before it traps (a copy that never lands would hang the device).
constexpr uint64_t kSlotWaitTimeoutNs = 5'000'000'000ull;

/// Waits until the slot's copy of this task has landed (phase `parity` of `bar`); traps after
/// kSlotWaitTimeoutNs. All threads (each waits; no block barrier needed after it).
__device__ __forceinline__ void slot_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = shared_addr(bar);
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    uint32_t done = 0;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > kSlotWaitTimeoutNs) __trap();
  }
}

/// Waits for the task's slot (slot_wait), stamping a traced task's staged input and landed
/// weights (TaskSmem::stamps). All threads, after the body's input staging.
__device__ __forceinline__ void task_slot_wait(const TaskSmem& m) {
  if (m.stamps && threadIdx.x == 0) m.stamps[0] = global_ns();
  slot_wait(m.bar, m.parity);
  if (m.stamps && threadIdx.x == 0) m.stamps[1] = global_ns();
}

/// Fills d with `runs` runs of l.count rows: run j is rows [first_of(j), + l.count) of
/// matrix_of(j) (DeviceQuants of one shape), in the slot `slot` laid out as l when l.fits, else
/// in global memory; run j's input row at xs + j·xs_stride. Thread 0; a block barrier must
/// follow before task_gemv reads d.
template <class MatrixOf, class FirstOf>
__device__ __forceinline__ void fill_gemv_runs(GemvRuns& d, const SlotRuns& l, const unsigned char* slot,
                                               MatrixOf matrix_of, FirstOf first_of, const float* xs,
                                               int64_t xs_stride) {
  const DeviceQuant& w0 = matrix_of(0);
  d.runs = l.runs, d.count = l.count, d.groups = w0.cols / kGroup, d.bits = w0.bits;
  d.in_shared = l.fits;
  d.code_row = int64_t{w0.cols} * w0.bits / 8, d.sb_row = int64_t{d.groups} * 2;
  d.xs = xs, d.xs_stride = xs_stride;
  for (int j = 0; j < l.runs; ++j) {
    if (l.fits) {
      d.codes[j] = slot + j * l.run_bytes;
      d.scales[j] = d.codes[j] + l.count * d.code_row;
      d.biases[j] = d.scales[j] + l.count * d.sb_row;
    } else {
      const DeviceQuant& w = matrix_of(j);
      const int64_t first = first_of(j);
      d.codes[j] = reinterpret_cast<const unsigned char*>(w.codes) + first * d.code_row;
      d.scales[j] = reinterpret_cast<const unsigned char*>(w.scales) + first * d.sb_row;
      d.biases[j] = reinterpret_cast<const unsigned char*>(w.biases) + first * d.sb_row;
    }
  }
}

/// out[v] = the fp32 dot product of row v = j·count + r (row r of run j) with run j's input row,
/// for every row of d (gemv_row_refs: the same arithmetic in either memory).
template <int BITS, bool SHARED>
__device__ __forceinline__ void gemv_runs(const GemvRuns& d, float* out) {
  const int count = d.count;
  gemv_row_refs<BITS, SHARED>(
      d.groups, d.runs * count,
      [&](int v) {
        const int j = v / count, r = v - j * count;
        return QuantRowRef{reinterpret_cast<const uint32_t*>(d.codes[j] + r * d.code_row),
                           reinterpret_cast<const bf16*>(d.scales[j] + r * d.sb_row),
                           reinterpret_cast<const bf16*>(d.biases[j] + r * d.sb_row), d.xs + j * d.xs_stride};
      },
      [&](int v, float value) { out[v] = value; });
}

/// The task GEMV: gemv_runs over d (shared memory, filled and published), out fp32 [runs·count]
/// in shared memory. One out-of-line copy for every body. All threads; the caller's barrier
/// publishes `out`.
__device__ inline __noinline__ void task_gemv(const GemvRuns& d, float* out) {
  if (d.in_shared) {
    if (d.bits == 8) gemv_runs<8, true>(d, out);
    else gemv_runs<4, true>(d, out);
  } else {
    if (d.bits == 8) gemv_runs<8, false>(d, out);
    else gemv_runs<4, false>(d, out);
  }
}

/// Stamps the end of a traced task's GEMV (TaskSmem::stamps[2]). Thread 0 acts; all may call.
__device__ __forceinline__ void task_stamp_gemv(const TaskSmem& m) {
  if (m.stamps && threadIdx.x == 0) m.stamps[2] = global_ns();
}

/// Rows [r.first, r.last) of w as one slot run (first rows of that stage are multiples of
/// `per`): returns the layout, and whether the task reads them from its slot (`fits`). Does two
/// things, both by thread 0: starts the rows' copy into the slot (when they fit, unless the kernel
/// already started it), and fills m.gemv (one run, input xs) for task_gemv_rows. Call before the
/// body's first block barrier of the task (the kernel's loop barrier orders the slot's earlier
/// reads).
__device__ __forceinline__ SlotRuns task_copy_rows_fill_gemv(const DeviceQuant& w, RowRange r, int per,
                                                             const TaskSmem& m, const float* xs) {
  const SlotRuns l = slot_runs(w, 1, static_cast<int>(r.last - r.first), per);
  if (threadIdx.x == 0) {
    const auto matrix = [&](int) -> const DeviceQuant& { return w; };
    const auto first = [&](int) { return r.first; };
    if (l.fits && !m.prefetched) slot_issue(l, matrix, first, m.slot, m.bar);
    fill_gemv_runs(*m.gemv, l, m.slot, matrix, first, xs, 0);
  }
  return l;
}

/// y[row] for rows [r.first, r.last) of w times the staged xs (m.gemv, filled by
/// task_copy_rows_fill_gemv), from the slot when l.fits (after waiting for its copy), else from
/// global memory; store(row, value) from the fp32 results, which wait in shared memory after xs.
/// All threads.
template <class Store>
__device__ __forceinline__ void task_gemv_rows(const DeviceQuant& w, RowRange r, const SlotRuns& l, float* xs,
                                               const TaskSmem& m, Store store) {
  float* out = xs + staged_row_floats_16(w.cols);
  if (l.fits) task_slot_wait(m);
  task_gemv(*m.gemv, out);
  __syncthreads();
  task_stamp_gemv(m);
  const int count = static_cast<int>(r.last - r.first);
  for (int v = threadIdx.x; v < count; v += blockDim.x) store(r.first + v, out[v]);
}

/// Asks L2 to fetch `bytes` from `p` (rounded out to 16-byte bounds) without waiting: one
/// cp.async.bulk.prefetch per call, issued by the calling thread. A hint: no result, no fault
/// beyond what a load of the same bytes would raise.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{15};
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) + 15) & ~uintptr_t{15};
  constexpr uintptr_t kMaxChunk = uintptr_t{1} << 20;  // well inside the instruction's 32-bit size
  for (; a < end; a += kMaxChunk) {
    const uint32_t n = static_cast<uint32_t>(end - a < kMaxChunk ? end - a : kMaxChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
  }
}

/// Prefetches rows [first, last) of w (codes, scales, biases) into L2. One thread.
__device__ __forceinline__ void prefetch_rows_l2(const DeviceQuant& w, int64_t first, int64_t last) {
  if (last <= first) return;
  const int64_t wpr = w.cols * w.bits / 32, groups = w.cols / kGroup;
  prefetch_l2(w.codes + first * wpr, (last - first) * wpr * 4);
  prefetch_l2(w.scales + first * groups, (last - first) * groups * 2);
  prefetch_l2(w.biases + first * groups, (last - first) * groups * 2);
}

}  // namespace lily::cuda
