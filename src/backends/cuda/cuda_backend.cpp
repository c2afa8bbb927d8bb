// CudaBackend: the qwen3_5_moe forward pass (docs/model.md §3, numerics §4.3) on one
// Hopper GPU. See cuda_backend.h for the decode-graph scheme and device_model.h for the weight
// layout.
//
// Memory: weights and activation scratch are allocated once; a state's GDN buffers and KV
// cache come from the backend's device pool (BlockPool: blocks reused by size class, so a new state
// or a prefix-cache copy seldom calls cudaMalloc), its host copies from a pinned arena (SlabArena:
// blocks carved from slabs pinned once, so a copy to the host tier pins no new memory). The KV
// cache of a state starts at min(max_seq, 1024) positions and doubles (up to max_seq) when a
// step needs more room. Growth happens between steps, outside any graph, and gives the state a
// new layout id, so its next step is captured again and an exec updated to it (~log2(max_seq/1024)
// times over a whole sequence). Trade-off: memory follows the sequence, at the price of an
// occasional copy of the cache and a graph update, instead of reserving 20 KiB per position up
// to max_seq for every state held by the prefix cache.
#include "backends/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/cuda/decode_megakernel.h"
#include "backends/cuda/device_buffer.h"
#include "backends/cuda/device_model.h"
#include "backends/cuda/kernel_switches.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/quant_gemm.h"
#include "backends/cuda/sampler_kernels.h"
#include "base/bf16.h"
#include "base/block_pool.h"
#include "base/byte_size.h"
#include "base/error.h"
#include "base/log.h"
#include "base/slab_arena.h"

namespace lily {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int64_t kMaxSeq = ::lily::kMaxContext;  // model/config.h; reported by cuda_max_sequence()
constexpr int64_t kInitialKvCapacity = 1024;

/// Per-token host<->device exchange, in pinned memory: the graph copies the first three fields
/// in and next_id out.
struct StepIo {
  int32_t token = 0;
  int32_t pos = 0;      ///< position of `token`
  int32_t len = 0;      ///< pos + 1 (attention length)
  int32_t next_id = 0;  ///< greedy next token (written back by the graph)
};

/// StepIo's fields as int32_t indices into its device copy (io_dev_).
constexpr int kIoToken = offsetof(StepIo, token) / sizeof(int32_t);
constexpr int kIoPos = offsetof(StepIo, pos) / sizeof(int32_t);
constexpr int kIoLen = offsetof(StepIo, len) / sizeof(int32_t);
constexpr int kIoNextId = offsetof(StepIo, next_id) / sizeof(int32_t);
/// Bytes copied in before a step: the fields before next_id.
constexpr size_t kIoInBytes = offsetof(StepIo, next_id);

/// Idle bytes the backend's device pool keeps for reuse (sequence states). About seven 35B-A3B
/// states of a 4K-token history (63 MB of GDN state + 80 MB of KV cache); an allocation that
/// fails frees the idle blocks and tries again, so the bound only limits what stays held
/// between requests.
constexpr size_t kPoolIdleBytes = size_t{1} << 30;

/// Bytes of each slab of the pinned arena: pinning one takes about 0.1 s (0.4 ms per MB), and
/// it holds a few host copies of 35B-A3B states of a 4K-token history (a 63 MB GDN block and an
/// 80 MB KV block each). A larger copy gets a slab of its own size.
constexpr size_t kPinnedSlabBytes = size_t{256} << 20;

/// Most bytes reserve_host_copies pins at once, at start-up (1.4 s on an H200 machine): room for
/// the host copies of the first few long conversations (each request stores about 0.9 GB of
/// snapshots at a 7.7K-token history), which would otherwise pin new slabs on the engine
/// thread, during the requests. The rest of the host tier's budget is pinned as copies need it,
/// or while the engine is idle.
constexpr size_t kPinnedStartBytes = size_t{4} << 30;

/// The block pool of device memory (cudaMalloc / cudaFree) for sequence states. Throws
/// lily::Error naming the size when an allocation fails.
std::shared_ptr<BlockPool> make_device_pool() {
  return std::make_shared<BlockPool>(
      [](size_t bytes) {
        void* p = nullptr;
        const cudaError_t st = cudaMalloc(&p, bytes);
        if (st != cudaSuccess) {
          (void)cudaGetLastError();  // not an error of the next launch
          throw ::lily::Error("CUDA: cannot allocate " + std::to_string(bytes) + " bytes of device memory (" +
                              cudaGetErrorString(st) + ")");
        }
        return p;
      },
      [](void* p, size_t) { cudaFree(p); }, kPoolIdleBytes);
}

/// The arena of pinned (page-locked) host memory for host copies of states, so that copies to
/// and from the device run at full speed on a stream: slabs of kPinnedSlabBytes from
/// cudaMallocHost (page-aligned, so 256-byte aligned as SlabArena needs), freed with
/// cudaFreeHost only when the backend and its last host copy are gone. No cap until
/// reserve_host_copies sets one. A slab allocation that fails throws lily::Error naming the size.
std::shared_ptr<SlabArena> make_pinned_arena() {
  return std::make_shared<SlabArena>(
      [](size_t bytes) {
        void* p = nullptr;
        const cudaError_t st = cudaMallocHost(&p, bytes);
        if (st != cudaSuccess) {
          (void)cudaGetLastError();
          throw ::lily::Error("CUDA: cannot allocate " + std::to_string(bytes) + " bytes of pinned host memory (" +
                              cudaGetErrorString(st) + ")");
        }
        return p;
      },
      [](void* p, size_t) { cudaFreeHost(p); }, kPinnedSlabBytes, SlabArena::kNoCap, "pinned host memory");
}

/// A host copy of a CudaState (the prefix cache's second tier, Backend::copy_to_host), in two
/// blocks of the pinned arena: the GDN conv windows then the GDN recurrent states (the same size
/// for every state of a model), and K and V of each attention layer compacted to [n_kv_heads,
/// position, head_dim]. Not runnable; the backend's clone_state copies it back into a device state.
class CudaHostState final : public SequenceState {
 public:
  CudaHostState(const void* owner, const std::shared_ptr<SlabArena>& pinned, int64_t max_seq, int64_t pos,
                size_t window_bytes, size_t state_bytes, size_t kv_bytes, int n_attn)
      : owner(owner), max_seq(max_seq), pos(pos), window_bytes(window_bytes), state_bytes(state_bytes),
        kv_bytes(kv_bytes), gdn_block(pinned, window_bytes + state_bytes),
        kv_block(pinned, 2 * kv_bytes * static_cast<size_t>(n_attn)) {}
  int64_t position() const override { return pos; }
  int64_t bytes() const override { return static_cast<int64_t>(gdn_block.bytes() + kv_block.bytes()); }
  char* windows() const { return gdn_block.as<char>(); }
  char* states() const { return gdn_block.as<char>() + window_bytes; }
  char* keys(int i) const { return kv_block.as<char>() + 2 * kv_bytes * static_cast<size_t>(i); }
  char* values(int i) const { return keys(i) + kv_bytes; }

  const void* owner;
  int64_t max_seq;
  int64_t pos;
  size_t window_bytes, state_bytes, kv_bytes;  ///< all GDN windows, all GDN states, one layer's K (or V)
  ArenaBlock gdn_block, kv_block;
};

/// Sequence state on the device (docs/model.md §4.1): per GDN layer a bf16 conv window [C, K−1] and
/// an fp32 recurrent state [Hv, Dk, Dv]; per attention layer bf16 K and V caches
/// [n_kv_heads, capacity, head_dim]. Three blocks of the backend's device pool: all windows, all
/// recurrent states, and all K and V caches (layer i's K, then its V, each at a 256-byte aligned
/// offset), so a copy allocates at most three times, and the two GDN blocks, whose size is the
/// same for every state, are nearly always reused ones. Every use of a block, device or pinned,
/// is work on the backend's stream, so the work of a block's next owner runs after that of its
/// last one, even where a failed call left work queued (and normally each call has finished its
/// work before it returns); except copy_to_host of a device state, on the copy stream, which
/// has finished its work when it returns or throws.
class CudaState final : public SequenceState {
 public:
  /// A zero state at position 0 with room for min(max_seq, kInitialKvCapacity) positions, in
  /// blocks of `pool`; the zeros are written on `stream` (a reused block holds an old state) and
  /// finished on return.
  static std::unique_ptr<CudaState> zero(const void* owner, std::shared_ptr<BlockPool> pool, const GdnDims& g,
                                         const AttnDims& a, int n_gdn, int n_attn, int64_t max_seq,
                                         cudaStream_t stream) {
    auto s = std::make_unique<CudaState>(owner, std::move(pool), g, a, n_gdn, n_attn, max_seq,
                                         std::min(max_seq, kInitialKvCapacity));
    if (n_gdn > 0) {
      CUDA_CHECK(cudaMemsetAsync(s->windows.data(), 0, s->windows.bytes(), stream));
      CUDA_CHECK(cudaMemsetAsync(s->states.data(), 0, s->states.bytes(), stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    return s;
  }
  /// Uninitialised buffers with room for `kv_capacity` (≥ 1) positions, at position 0: for copies.
  CudaState(const void* owner, std::shared_ptr<BlockPool> pool, const GdnDims& g, const AttnDims& a, int n_gdn,
            int n_attn, int64_t max_seq, int64_t kv_capacity)
      : owner(owner), max_seq(max_seq), pool(std::move(pool)), gdn(g), attn(a), n_gdn(n_gdn), n_attn(n_attn) {
    window_elems = g.window_elems();
    state_elems = g.state_elems();
    if (n_gdn > 0) {
      windows = PooledBlock(this->pool, windows_bytes(g, n_gdn));
      states = PooledBlock(this->pool, states_bytes(g, n_gdn));
    }
    allocate_kv(std::max<int64_t>(kv_capacity, 1));
  }
  /// Bytes of the blocks of a state of these dimensions with room for `capacity` positions, as
  /// the constructor and allocate_kv lay them out: all GDN windows, all GDN recurrent states, and
  /// 2·n_attn K/V caches, each rounded up to 256 bytes (Backend::state_bytes).
  static size_t layout_bytes(const GdnDims& g, const AttnDims& a, int n_gdn, int n_attn, int64_t capacity) {
    return windows_bytes(g, n_gdn) + states_bytes(g, n_gdn) + 2 * static_cast<size_t>(n_attn) * kv_stride(a, capacity);
  }
  int64_t position() const override { return pos; }
  /// The GDN buffers and n_attn K and V caches of `capacity` positions (the alignment padding
  /// between caches is not counted).
  int64_t bytes() const override {
    return static_cast<int64_t>(windows.bytes() + states.bytes() +
                                2 * static_cast<size_t>(n_attn) * layer_bytes(attn, capacity));
  }

  bf16* window(int gdn_index) const { return windows.as<bf16>() + gdn_index * window_elems; }
  float* state(int gdn_index) const { return states.as<float>() + gdn_index * state_elems; }
  KvCacheView kv(int attn_index) const {
    return KvCacheView{cache(kv_block, capacity, 2 * attn_index), cache(kv_block, capacity, 2 * attn_index + 1),
                       capacity};
  }

  /// Makes room for `needed` positions (doubling), keeping the first `pos` positions. The copy
  /// runs on `stream` (the backend's, which wrote the cache), after the work already queued
  /// there, and is finished before the old block is given back; a state with pos = 0 copies nothing.
  void reserve(int64_t needed, cudaStream_t stream) {
    if (needed <= capacity) return;
    int64_t cap = capacity;
    while (cap < needed) cap *= 2;
    cap = std::min(cap, max_seq);
    PooledBlock old = std::move(kv_block);
    const int64_t old_cap = capacity;
    allocate_kv(cap);
    const size_t row = static_cast<size_t>(attn.head_dim) * sizeof(bf16);
    for (int c = 0; c < 2 * n_attn && pos > 0; ++c) {
      CUDA_CHECK(cudaMemcpy2DAsync(cache(kv_block, cap, c), cap * row, cache(old, old_cap, c), old_cap * row, pos * row,
                                   attn.n_kv_heads, cudaMemcpyDeviceToDevice, stream));
    }
    if (n_attn > 0 && pos > 0) CUDA_CHECK(cudaStreamSynchronize(stream));  // `old` is given back below
  }

  /// Deep copy with room for `room` positions, clamped to [pos, max_seq] (at least 1): exactly
  /// `pos` by default, since a prefix-cache snapshot holds no spare capacity; a state resumed
  /// for a request gets room for it (Backend::resume_state), so its next steps need not grow it.
  /// The copies run on `stream` (the backend's, which wrote this state) and are finished on return.
  std::unique_ptr<CudaState> clone(cudaStream_t stream, int64_t room = 0) const {
    auto c = std::make_unique<CudaState>(owner, pool, gdn, attn, n_gdn, n_attn, max_seq,
                                         std::clamp<int64_t>(room, pos, max_seq));
    if (n_gdn > 0) {
      CUDA_CHECK(cudaMemcpyAsync(c->windows.data(), windows.data(), windows.bytes(), cudaMemcpyDeviceToDevice, stream));
      CUDA_CHECK(cudaMemcpyAsync(c->states.data(), states.data(), states.bytes(), cudaMemcpyDeviceToDevice, stream));
    }
    const size_t row = static_cast<size_t>(attn.head_dim) * sizeof(bf16);
    for (int k = 0; k < 2 * n_attn && pos > 0; ++k) {
      CUDA_CHECK(cudaMemcpy2DAsync(cache(c->kv_block, c->capacity, k), c->capacity * row, cache(kv_block, capacity, k),
                                   capacity * row, pos * row, attn.n_kv_heads, cudaMemcpyDeviceToDevice, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    c->pos = pos;
    return c;
  }

  /// A host copy (see CudaHostState) in blocks of `pinned`, copied on `stream` and finished on
  /// return, also when a copy fails (the pinned blocks go back to the arena).
  std::unique_ptr<CudaHostState> to_host(const std::shared_ptr<SlabArena>& pinned, cudaStream_t stream) const {
    const size_t row = static_cast<size_t>(attn.head_dim) * sizeof(bf16);
    const size_t kv_bytes = static_cast<size_t>(attn.n_kv_heads) * static_cast<size_t>(pos) * row;
    auto h = std::make_unique<CudaHostState>(owner, pinned, max_seq, pos, windows.bytes(), states.bytes(), kv_bytes,
                                             n_attn);
    // Destroyed before `h`: on an error, the copies already queued end before h's blocks are
    // given back (`stream` may be one other than the blocks' next owner uses).
    struct FinishOnError {
      cudaStream_t stream;
      ~FinishOnError() {
        if (std::uncaught_exceptions() > 0) (void)cudaStreamSynchronize(stream);
      }
    } finish_on_error{stream};
    if (n_gdn > 0) {
      CUDA_CHECK(cudaMemcpyAsync(h->windows(), windows.data(), windows.bytes(), cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaMemcpyAsync(h->states(), states.data(), states.bytes(), cudaMemcpyDeviceToHost, stream));
    }
    for (int i = 0; i < n_attn && pos > 0; ++i) {
      CUDA_CHECK(cudaMemcpy2DAsync(h->keys(i), pos * row, cache(kv_block, capacity, 2 * i), capacity * row, pos * row,
                                   attn.n_kv_heads, cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaMemcpy2DAsync(h->values(i), pos * row, cache(kv_block, capacity, 2 * i + 1), capacity * row,
                                   pos * row, attn.n_kv_heads, cudaMemcpyDeviceToHost, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return h;
  }

  /// A device state in blocks of `pool` made from host copy `h` (of a state with these
  /// dimensions), with room for `room` positions clamped to [its positions, its max_seq] (by
  /// default exactly its positions); copied on `stream` and finished on return.
  static std::unique_ptr<CudaState> from_host(const CudaHostState& h, std::shared_ptr<BlockPool> pool,
                                              const GdnDims& g, const AttnDims& a, int n_gdn, int n_attn,
                                              cudaStream_t stream, int64_t room = 0) {
    auto c = std::make_unique<CudaState>(h.owner, std::move(pool), g, a, n_gdn, n_attn, h.max_seq,
                                         std::clamp<int64_t>(room, h.pos, h.max_seq));
    if (c->windows.bytes() != h.window_bytes || c->states.bytes() != h.state_bytes)
      throw ::lily::Error("CUDA backend: the host state does not match this model's dimensions");
    if (n_gdn > 0) {
      CUDA_CHECK(cudaMemcpyAsync(c->windows.data(), h.windows(), h.window_bytes, cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaMemcpyAsync(c->states.data(), h.states(), h.state_bytes, cudaMemcpyHostToDevice, stream));
    }
    const size_t row = static_cast<size_t>(a.head_dim) * sizeof(bf16);
    for (int i = 0; i < n_attn && h.pos > 0; ++i) {
      CUDA_CHECK(cudaMemcpy2DAsync(c->cache(c->kv_block, c->capacity, 2 * i), c->capacity * row, h.keys(i), h.pos * row,
                                   h.pos * row, a.n_kv_heads, cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaMemcpy2DAsync(c->cache(c->kv_block, c->capacity, 2 * i + 1), c->capacity * row, h.values(i),
                                   h.pos * row, h.pos * row, a.n_kv_heads, cudaMemcpyHostToDevice, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    c->pos = h.pos;
    return c;
  }

  const void* owner;
  int64_t max_seq;
  int64_t pos = 0;
  int64_t capacity = 0;
  /// Names this state's device buffers and KV capacity, everything of the state that a captured
  /// decode step bakes in (DecodeGraphs). Taken from a process-wide counter whenever the KV cache
  /// is (re)allocated, and never reused, so a decode graph last updated for a state that has
  /// since grown or been destroyed can never match a live state, even one whose blocks are the
  /// same reused addresses.
  uint64_t layout = 0;

 private:
  /// Bytes of all `n_gdn` GDN conv windows (bf16).
  static size_t windows_bytes(const GdnDims& g, int n_gdn) { return n_gdn * g.window_elems() * sizeof(bf16); }
  /// Bytes of all `n_gdn` GDN recurrent states (fp32).
  static size_t states_bytes(const GdnDims& g, int n_gdn) { return n_gdn * g.state_elems() * sizeof(float); }
  /// Bytes of one layer's K (or V) cache for `cap` positions.
  static size_t layer_bytes(const AttnDims& a, int64_t cap) {
    return static_cast<size_t>(a.n_kv_heads) * static_cast<size_t>(cap) * a.head_dim * sizeof(bf16);
  }
  /// The distance between consecutive caches of a KV block of `cap` positions: layer_bytes
  /// rounded up to 256, so each cache starts on a 256-byte boundary, as a cudaMalloc of its own would.
  static size_t kv_stride(const AttnDims& a, int64_t cap) { return (layer_bytes(a, cap) + 255) / 256 * 256; }
  /// Cache `c` (2·i: layer i's K, 2·i + 1: its V) in a KV block of `cap` positions.
  bf16* cache(const PooledBlock& block, int64_t cap, int c) const {
    return reinterpret_cast<bf16*>(block.as<char>() + kv_stride(attn, cap) * static_cast<size_t>(c));
  }
  void allocate_kv(int64_t cap) {
    kv_block.reset();
    kv_block = PooledBlock(pool, kv_stride(attn, cap) * 2 * static_cast<size_t>(n_attn));
    capacity = cap;
    layout = next_layout_.fetch_add(1, std::memory_order_relaxed);
  }

  static inline std::atomic<uint64_t> next_layout_{1};  ///< 0 means "no state" in DecodeGraphs

  std::shared_ptr<BlockPool> pool;  ///< the backend's device pool (outlives the backend if need be)
  GdnDims gdn;
  AttnDims attn;
  int n_gdn, n_attn;
  int64_t window_elems = 0, state_elems = 0;
  PooledBlock windows, states, kv_block;
};

/// Pinned host memory for StepIo.
class PinnedIo {
 public:
  PinnedIo() { CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&io_), sizeof(StepIo))); }
  ~PinnedIo() { cudaFreeHost(io_); }
  PinnedIo(const PinnedIo&) = delete;
  PinnedIo& operator=(const PinnedIo&) = delete;
  StepIo* get() const { return io_; }

 private:
  StepIo* io_ = nullptr;
};

/// An owned block of pinned host memory (cudaMallocHost), zero-filled: the batched decode's
/// host side of its per-step exchange with the device.
class PinnedBytes {
 public:
  explicit PinnedBytes(size_t bytes) : bytes_(bytes) {
    CUDA_CHECK(cudaMallocHost(&ptr_, bytes));
    std::memset(ptr_, 0, bytes);
  }
  ~PinnedBytes() { cudaFreeHost(ptr_); }
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Owns a captured cudaGraph_t (destroyed with the handle).
struct GraphDeleter {
  void operator()(cudaGraph_t g) const { cudaGraphDestroy(g); }
};
using CapturedGraph = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, GraphDeleter>;

/// The backend's instantiated decode graphs, shared by all of its states (cuda_backend.h
/// describes the scheme). Each exec remembers the layout (CudaState::layout) of the state whose
/// parameters it holds; find() hands it out only to that state, and bind() moves an exec to a
/// new state by cudaGraphExecUpdate from that state's freshly captured graph, instantiating only
/// when there is no exec to reuse or the update is refused. Used by the backend's one engine
/// thread; every launch is finished (stream synchronised) before the next find() or bind().
class DecodeGraphs {
 public:
  /// What decides a captured step's node set and launch shapes, apart from the state's buffer
  /// addresses: the kind of step, the attention split count (the split kernel's grid, from the
  /// KV capacity) and whether the kernels were captured with programmatic edges.
  struct Key {
    bool sampled = false;  ///< the device sampler follows the argmax
    int splits = 0;        ///< attention_decode_splits(capacity); batched: the largest of the rows'
    bool pdl = false;      ///< pdl_enabled() at capture
    int rows = 0;          ///< batched decode: the rows of the step (0: the one-sequence step)
    int sampled_rows = 0;  ///< batched decode: how many of them the device sampler draws
    bool operator==(const Key&) const = default;
  };

  /// At most `per_key` execs of one key (the rows that one step interleaves: each keeps its own)
  /// and `limit` (≥ per_key) in all.
  DecodeGraphs(int per_key, int limit) : per_key_(std::max(per_key, 1)), limit_(std::max(limit, per_key_)) {}
  ~DecodeGraphs() {
    for (const Entry& e : entries_) cudaGraphExecDestroy(e.exec);
  }
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  /// The exec that holds the parameters of the state with `layout` for `key`, ready to launch;
  /// nullptr when none does (then capture the step and call bind).
  cudaGraphExec_t find(const Key& key, uint64_t layout) {
    for (Entry& e : entries_) {
      if (e.layout == layout && e.key == key) {
        e.used = ++clock_;
        return e.exec;
      }
    }
    return nullptr;
  }

  /// Makes an exec hold `graph`, the step just captured for the state with `layout` under `key`,
  /// and returns it. Reuses the least recently used exec of `key` when there are per_key of them,
  /// else the least recently used of all when there are `limit`, else instantiates a new one. A
  /// reused exec is updated in place (cudaGraphExecUpdate); where the update is refused
  /// (cudaErrorGraphExecUpdateFailure: topology, node type, function or attributes changed), it
  /// is replaced by a fresh instantiation. Any other CUDA error throws lily::Error, leaving the
  /// exec bound to no state.
  cudaGraphExec_t bind(const Key& key, uint64_t layout, cudaGraph_t graph) {
    Entry* lru_key = nullptr;
    Entry* lru_all = nullptr;
    int same_key = 0;
    for (Entry& e : entries_) {
      if (!lru_all || e.used < lru_all->used) lru_all = &e;
      if (e.key == key) {
        ++same_key;
        if (!lru_key || e.used < lru_key->used) lru_key = &e;
      }
    }
    Entry* reuse = same_key >= per_key_ ? lru_key : static_cast<int>(entries_.size()) >= limit_ ? lru_all : nullptr;
    if (!reuse) {
      entries_.reserve(entries_.size() + 1);  // so that the push cannot throw after the instantiation
      entries_.push_back(Entry{key, layout, ++clock_, instantiate(graph)});
      return entries_.back().exec;
    }
    reuse->layout = 0;  // holds no state's parameters until the update below has succeeded
    cudaGraphExecUpdateResultInfo info{};
    const cudaError_t st = cudaGraphExecUpdate(reuse->exec, graph, &info);
    if (st == cudaErrorGraphExecUpdateFailure) {
      (void)cudaGetLastError();  // the refusal is not an error of the next launch
      cudaGraphExec_t fresh = instantiate(graph);
      const cudaError_t destroyed = cudaGraphExecDestroy(reuse->exec);
      reuse->exec = fresh;
      CUDA_CHECK(destroyed);
    } else {
      CUDA_CHECK(st);
    }
    reuse->key = key;
    reuse->layout = layout;
    reuse->used = ++clock_;
    return reuse->exec;
  }

 private:
  struct Entry {
    Key key;
    uint64_t layout = 0;  ///< the state whose parameters the exec holds; 0: none
    uint64_t used = 0;    ///< clock_ at the last find or bind (least recently used goes first)
    cudaGraphExec_t exec = nullptr;
  };

  static cudaGraphExec_t instantiate(cudaGraph_t graph) {
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    return exec;
  }

  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  int per_key_, limit_;
};

/// Where the batched decode's per-step inputs sit in its exchange block (one pinned host copy,
/// one device copy, the same offsets): int32 [kMaxDecodeRows] tokens, positions, lengths
/// (position + 1) and attention split counts, then per attention layer the rows' KvCacheViews
/// [n_attn][kMaxDecodeRows], per GDN layer the rows' conv windows [n_gdn][kMaxDecodeRows] (bf16*)
/// and recurrent states [n_gdn][kMaxDecodeRows] (float*). The graph copies the whole block in
/// at its start, so nothing of the rows' sequences is baked into a captured batched step.
struct BatchLayout {
  static constexpr size_t kInts = sizeof(int32_t) * kMaxDecodeRows;
  size_t token = 0, pos = kInts, len = 2 * kInts, splits = 3 * kInts;
  size_t kv = 4 * kInts, windows = 0, states = 0, bytes = 0;
  BatchLayout(int n_attn, int n_gdn) {
    windows = kv + sizeof(KvCacheView) * kMaxDecodeRows * static_cast<size_t>(n_attn);
    states = windows + sizeof(bf16*) * kMaxDecodeRows * static_cast<size_t>(n_gdn);
    bytes = states + sizeof(float*) * kMaxDecodeRows * static_cast<size_t>(n_gdn);
  }
  /// Offset of layer `slot`'s KV views (row r at + r · sizeof(KvCacheView)).
  size_t kv_of(int slot) const { return kv + sizeof(KvCacheView) * kMaxDecodeRows * static_cast<size_t>(slot); }
  size_t windows_of(int slot) const { return windows + sizeof(bf16*) * kMaxDecodeRows * static_cast<size_t>(slot); }
  size_t states_of(int slot) const { return states + sizeof(float*) * kMaxDecodeRows * static_cast<size_t>(slot); }
};

/// The layout value the batched decode's graphs record (DecodeGraphs): they hold no state's
/// buffers (every row's pointers travel in the exchange block), so one exec per key serves any
/// rows, and a constant stands for "every state".
constexpr uint64_t kBatchGraphLayout = 1;

void check_device() {
  int count = 0;
  const cudaError_t st = cudaGetDeviceCount(&count);
  if (st != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw ::lily::Error(std::string("CUDA backend: no usable CUDA device (") +
                        (st != cudaSuccess ? cudaGetErrorString(st) : "no device found") + ")");
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9)
    throw ::lily::Error("CUDA backend: needs compute capability 9.0 or newer (Hopper, sm_90a); device 0 '" +
                        std::string(prop.name) + "' is " + std::to_string(prop.major) + "." +
                        std::to_string(prop.minor));
}

/// Grid barriers of one launch_moe_block_decode (MoeDecodeArgs::barriers; the third for its
/// out-projection phase, the fourth the next-norm phase's count of finished blocks). The rows
/// kernel takes the first three and the fourth as its tile-claim counter (MoeDecodeArgs::tile_claims).
constexpr int kMoeBarriersPerLayer = 4;
constexpr int kMoeTileClaimsSlot = 3;
static_assert(kMaxMoeRows >= kMaxDecodeRows, "one launch_moe_block_rows per layer takes a batched step's rows");

void check_shapes(const ModelConfig& c) {
  auto bad = [&](const std::string& what) {
    throw ::lily::Error("CUDA backend: the kernels were not written for this model shape (" + c.shape_name() +
                        "): " + what);
  };
  const std::string max_cols = std::to_string(kMaxGemvCols);
  if (c.hidden % kQuantGroupSize != 0 || c.hidden > kMaxGemvCols)
    bad("hidden " + std::to_string(c.hidden) + " (need a multiple of " + std::to_string(kQuantGroupSize) + ", ≤ " +
        max_cols + ")");
  if (c.moe_ffn_dim % kQuantGroupSize != 0 || c.moe_ffn_dim > kMaxGemvCols)
    bad("moe_intermediate_size " + std::to_string(c.moe_ffn_dim) + " (need a multiple of " +
        std::to_string(kQuantGroupSize) + ", ≤ " + max_cols + ")");
  if (c.n_experts > kMaxExperts || c.n_experts_per_tok > kMaxTopK)
    bad("more than " + std::to_string(kMaxExperts) + " experts or top-k above " + std::to_string(kMaxTopK));
  // The expert down kernel stages every slot's activation row (moe_ffn_dim values, staged per
  // 64-group) in shared memory, within the default limit.
  if (routed_plus_shared_slots(c.n_experts_per_tok) * c.moe_ffn_dim / kQuantGroupSize * kStagedFloatsPerGroup * int(sizeof(float)) >
      kDefaultSmemBytes)
    bad("top-k × moe_intermediate_size too large");
}

}  // namespace

/// The CUDA backend (see file comment).
class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<const ModelWeights> weights, const CudaOptions& options) : options_(options) {
    if (!weights) throw ::lily::Error("CUDA backend: no model weights");
    if (options_.max_batch < 1 || options_.max_batch > CudaOptions::kMaxBatch)
      throw ::lily::Error("CudaOptions::max_batch (LILY_CUDA_MAX_BATCH) must be 1 … " +
                          std::to_string(CudaOptions::kMaxBatch) + ", got " + std::to_string(options_.max_batch));
    if (options_.decode_rows < 1 || options_.decode_rows > kMaxDecodeRows)
      throw ::lily::Error("CudaOptions::decode_rows (LILY_CUDA_DECODE_ROWS) must be 1 … " +
                          std::to_string(kMaxDecodeRows) + ", got " + std::to_string(options_.decode_rows));
    config_ = weights->config;
    check_device();
    const ModelConfig& c = config_;
    check_shapes(c);
    io_ = std::make_unique<PinnedIo>();
    try {
      gdn_ = gdn_dims(c);
      attn_ = attn_dims(c);
    } catch (const ::lily::Error& e) {
      throw ::lily::Error("CUDA backend: the kernels were not written for this model shape (" + c.shape_name() +
                          "): " + e.what());
    }
    gdn_.norm_eps = c.rms_norm_eps;
    attn_.norm_eps = c.rms_norm_eps;
    for (int i = 0; i < c.n_layers; ++i) {
      layer_slot_.push_back(c.is_full_attention(i) ? n_attn_++ : n_gdn_++);
    }
    // Every weight is copied to the device here (the norms and gains too); nothing keeps a
    // pointer into the host weights, so `weights` is dropped when the constructor returns and the
    // checkpoint's mapping goes with the caller's last reference (reads_host_weights()).
    model_ = std::make_unique<DeviceModel>(*weights);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    allocate_scratch();
    fused_moe_ = options_.fused_moe && fuse_decode_ && fused_moe_supported();
    // The rows kernel at the most rows of a batched forward (≥ 2: a lone row takes the
    // one-sequence graph).
    batched_fused_moe_ = fused_moe_ && fused_moe_supported(std::max(2, options_.decode_rows));
    // The phase runs the streaming GEMV's arithmetic, which the separate out-projection has only
    // with stream_gemv (else the register-load MMA GEMV's): without it the bits would differ.
    moe_out_proj_ = options_.moe_out_proj && options_.stream_gemv && fused_moe_ && moe_out_proj_supported();
    if (moe_out_proj_) log_info("CUDA backend: decode out-projections inside the fused MoE block (moe-out-proj=1)");
    // The staged row is the streaming GEMV's staging; without stream_gemv the norm + GEMV take
    // another kernel's arithmetic, so the bits would differ.
    moe_next_norm_ = options_.moe_next_norm && options_.stream_gemv && fused_moe_ && moe_next_norm_supported();
    if (moe_next_norm_) log_info("CUDA backend: decode input norms staged once by the fused MoE block (moe-next-norm=1)");
    // The fused rows norm is the streaming GEMV's rows mode (launch_add_rmsnorm_gemv_rows).
    rows_gemv_norm_ = options_.rows_gemv_norm && options_.stream_gemv;
    if (rows_gemv_norm_) log_info("CUDA backend: batched input norms inside the in-projections (rows-gemv-norm=1)");
    if (options_.persistent_decode != "0") create_persistent_decode();
    routers_on_gemm_ = true;
    for (const auto& lw : model_->layers) routers_on_gemm_ = routers_on_gemm_ && router_gemm_supported(lw.router);
    // The kernel layer's switches (kernels.h, mixer_kernels.h, quant_gemm.h) are process-wide:
    // set here from this backend's options, every one of them, so the environment is read and
    // validated once, by CudaOptions::from_env. The last backend constructed sets them.
    apply_kernel_switches(options_);
  }
  ~CudaBackend() override {
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  /// By default (CudaOptions::device_sampler) sampled rows run the device sampler
  /// (sampler_kernels.h) after the LM head and only the id comes back; with
  /// LILY_CUDA_DEVICE_SAMPLER=0 the engine samples the copied logits on the host.
  bool samples_on_device() const override { return device_sampler_enabled(); }
  const ModelConfig& config() const override { return config_; }
  bool reads_host_weights() const override { return false; }

  std::unique_ptr<SequenceState> new_state(int64_t max_seq) override {
    if (max_seq < 1 || max_seq > kMaxSeq)
      throw ::lily::Error("max_seq " + std::to_string(max_seq) + " is outside [1, " + std::to_string(kMaxSeq) + "]");
    return CudaState::zero(this, device_pool_, gdn_, attn_, n_gdn_, n_attn_, max_seq, stream_);
  }

  /// Compact device copy of a device state, or a device state made from a copy_to_host copy; the
  /// copies run on the backend's stream.
  std::unique_ptr<SequenceState> clone_state(const SequenceState& state) override {
    if (const auto* h = dynamic_cast<const CudaHostState*>(&state)) {
      if (h->owner != this) throw ::lily::Error("CUDA backend: the sequence state belongs to another backend");
      return CudaState::from_host(*h, device_pool_, gdn_, attn_, n_gdn_, n_attn_, stream_);
    }
    return checked(const_cast<SequenceState&>(state)).clone(stream_);
  }

  // Backend::resume_state stays the default (clone_state, room for exactly the snapshot): a
  // decode step's attention split count comes from the state's KV capacity
  // (attention_decode_splits), so a resumed state with more room could decode other bits than
  // the same request without the cache. CudaState::clone / from_host take a room for when the
  // split count no longer depends on the capacity (or room is chosen as a cold state's).

  /// Pinned host copy (CudaHostState). A device state is copied on the copy stream, which only
  /// this call uses: it reads the state's blocks and writes pinned blocks (the arena is
  /// thread-safe), so it may run on a helper thread beside the engine thread's calls
  /// (copies_to_host_concurrently), whose captures are thread-local. Its source needs no
  /// ordering with the backend's stream: every call that writes a state has finished that work
  /// before it returns. A host copy is copied again through a device state on the backend's
  /// stream (engine thread only).
  std::unique_ptr<SequenceState> copy_to_host(const SequenceState& state) override {
    if (const auto* h = dynamic_cast<const CudaHostState*>(&state)) {
      if (h->owner != this) throw ::lily::Error("CUDA backend: the sequence state belongs to another backend");
      return CudaState::from_host(*h, device_pool_, gdn_, attn_, n_gdn_, n_attn_, stream_)
          ->to_host(pinned_arena_, stream_);
    }
    return checked(const_cast<SequenceState&>(state)).to_host(pinned_arena_, copy_stream_);
  }
  /// False, although copy_to_host is safe on a helper thread (CudaE2e.HostCopiesOnAHelperThread-
  /// BesideDecodeSteps): on an H200 the prefix cache's background copies slowed the engine thread
  /// far more than they saved (pinning new host memory holds the driver while the engine's
  /// launches and allocations wait: a turn 2 from the host tier took 679 ms to its first token
  /// instead of about 190 ms with the copies on the engine thread; docs/server.md). So the cache
  /// copies on the engine thread. Host copies now come from the pinned arena, whose slabs are
  /// pinned once (reserve_host_copies, prepare_while_idle) and then reused without a CUDA call,
  /// which removes that cause once the slabs exist (with the copies still here, a host-tier
  /// turn 2 now takes 172 ms to its first token on an H100). This stays false until background
  /// copies from the arena have been measured; a copy that must pin a new slab still would.
  bool copies_to_host_concurrently() const override { return false; }

  /// Caps the pinned arena at twice the host tier's `bytes` and pins min(`bytes`, 4 GiB) of it
  /// now. Twice: the cache copies a store's snapshots to the host tier before it evicts older
  /// ones to fit the budget, and frees the evicted ones later (between steps), so the host
  /// copies alive at once pass the budget by a store's snapshots. A failure to pin now is only
  /// logged: the copies pin what they need later.
  void reserve_host_copies(int64_t bytes) override {
    if (bytes <= 0) return;
    const size_t budget = static_cast<size_t>(bytes);
    pinned_arena_->set_cap(budget > SIZE_MAX / 2 ? SlabArena::kNoCap : 2 * budget);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      pinned_arena_->reserve(std::min(budget, kPinnedStartBytes));
    } catch (const ::lily::Error& e) {
      log_warn(std::string("CUDA backend: cannot pin host memory for the prefix cache's host tier now: ") + e.what());
      return;
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    log_info("CUDA backend: pinned " + format_bytes(static_cast<int64_t>(pinned_arena_->stats().reserved_bytes)) +
             " of host memory for host-tier copies in " + std::to_string(static_cast<int64_t>(ms)) + " ms (at most " +
             format_bytes(static_cast<int64_t>(std::min<size_t>(pinned_arena_->cap(), INT64_MAX))) + ")");
  }

  /// One spare block for the sizes recent states took (device memory), then one slab of pinned
  /// host memory when the arena has no free range for the largest host copy made so far
  /// (pinning, about 0.4 ms per MB, would otherwise fall on the next copy to the host tier).
  /// The engine is idle: no work of this backend is in flight.
  bool prepare_while_idle() override { return device_pool_->refill_one() || pinned_arena_->reserve_spare(); }

  /// Free device memory now (cudaMemGetInfo), plus what the state pool holds idle: the pool lets
  /// that go whenever an allocation would otherwise fail.
  std::optional<int64_t> free_memory() const override {
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free + device_pool_->idle_bytes());
  }

  /// The GDN windows and states, plus 2·n_attn K/V caches of `capacity` positions, each rounded
  /// up to 256 bytes as CudaState lays them out.
  int64_t state_bytes(int64_t capacity) const override {
    return static_cast<int64_t>(CudaState::layout_bytes(gdn_, attn_, n_gdn_, n_attn_, capacity));
  }

  /// CudaOptions::max_batch (LILY_CUDA_MAX_BATCH, 64 by default): with CudaOptions::batched_decode
  /// (the default) a step's decode rows run together (decode_batch), else one after another
  /// through the per-sequence paths below; each row is bit-identical to the sequence alone.
  int max_batch() const override { return options_.max_batch; }
  /// With the batched decode, CudaOptions::decode_rows: one batched forward runs that many
  /// decode rows, each weight read once per 32 of them; otherwise the base default.
  int preferred_max_batch() const override {
    return batched_decode_ ? options_.decode_rows : Backend::preferred_max_batch();
  }
  int64_t preferred_step_tokens() const override { return options_.prefill_chunk; }

  /// Backend::step: prefill rows through the batched prefill one after another (with
  /// CudaOptions::prefill_rows, several sequences' rows in one chunk: prefill_rows); with
  /// CudaOptions::batched_decode the one-token decode rows in batched forwards of ≤
  /// CudaOptions::decode_rows rows (a group of one through the decode graph), else each through
  /// the decode graph. Validates every row first.
  std::vector<int32_t> step(std::span<const StepRow> rows) override {
    if (rows.empty()) throw ::lily::Error("step: no rows");
    if (static_cast<int>(rows.size()) > max_batch())
      throw ::lily::Error("step: " + std::to_string(rows.size()) + " rows, more than the cuda backend's " +
                          std::to_string(max_batch()));
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].state == nullptr) throw ::lily::Error("step: a row without a sequence state");
      const CudaState& s = checked(*rows[i].state);
      validate(s, rows[i].tokens);
      if (rows[i].position != s.pos)
        throw ::lily::Error("step: a row at position " + std::to_string(rows[i].position) +
                            " for a sequence at position " + std::to_string(s.pos));
      for (size_t j = 0; j < i; ++j)
        if (rows[j].state == rows[i].state) throw ::lily::Error("step: one sequence state in two rows");
    }
    std::vector<int32_t> next(rows.size(), -1);
    // CudaOptions::batched_decode: the one-token decode rows run after the others, through one
    // batched forward per group of ≤ CudaOptions::decode_rows (decode_batch); every row touches only its
    // own state, so the order does not change any result. Probes keep the per-row path.
    const bool batched = batched_decode_ && !probe_sink_;
    // Row i alone, through the per-sequence paths.
    auto run_alone = [&](size_t i) {
      const StepRow& r = rows[i];
      CudaState& s = checked(*r.state);
      std::vector<float>* logits = r.want_logits ? r.logits : nullptr;
      const RowSampling* sampling = r.want_logits && r.sampling.params ? &r.sampling : nullptr;
      const int32_t id = r.decode && r.tokens.size() == 1 ? decode_one(s, r.tokens[0], logits, sampling)
                                                          : prefill_sequence(s, r.tokens, logits, sampling);
      if (r.want_logits) next[i] = id;
    };
    // CudaOptions::prefill_rows: prefill (not decode) rows that fit one chunk run in groups whose
    // tokens fill at most one chunk (prefill_rows), in row order; a group of one takes its own
    // path. Only where every prefill kernel's choice is independent of the chunk's token count
    // (prefill_rows_keep_bits), so that a sequence gets its bits alone.
    const bool grouped_prefill = options_.prefill_rows && batched_prefill_ && !probe_sink_ && prefill_rows_keep_bits();
    std::vector<size_t> batch_rows, prefill_group;
    int group_tokens = 0;
    auto flush_prefill_group = [&] {
      if (prefill_group.size() == 1) run_alone(prefill_group[0]);
      else if (prefill_group.size() > 1) prefill_rows(rows, prefill_group, next);
      prefill_group.clear();
      group_tokens = 0;
    };
    for (size_t i = 0; i < rows.size(); ++i) {
      const int n = static_cast<int>(rows[i].tokens.size());
      if (batched && rows[i].decode && n == 1) {
        batch_rows.push_back(i);
      } else if (grouped_prefill && !rows[i].decode && n <= prefill_chunk_) {
        if (group_tokens + n > prefill_chunk_) flush_prefill_group();
        prefill_group.push_back(i);
        group_tokens += n;
      } else {
        run_alone(i);
      }
    }
    flush_prefill_group();
    // A group of one row takes the one-sequence decode graph: the batched forward gives every
    // row the same bits as that step (CudaE2e.BatchedDecodeMatchesPerSequenceDecode), and the
    // one-sequence step is the faster of the two for a lone row.
    const size_t per_forward = static_cast<size_t>(options_.decode_rows);
    for (size_t first = 0; first < batch_rows.size(); first += per_forward) {
      const size_t n = std::min(per_forward, batch_rows.size() - first);
      if (n == 1) run_alone(batch_rows[first]);
      else decode_batch(rows, std::span<const size_t>(batch_rows).subspan(first, n), next);
    }
    return next;
  }

 private:
  int32_t prefill_sequence(CudaState& s, std::span<const int32_t> tokens, std::vector<float>* logits,
                           const RowSampling* sampling) {
    if (batched_prefill_ && !probe_sink_) return prefill_batched(s, tokens, logits, sampling);
    int32_t next = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const bool last = i + 1 == tokens.size();
      next = step(s, tokens[i], last ? logits : nullptr, last ? sampling : nullptr);
    }
    return next;
  }

  int32_t decode_one(CudaState& s, int32_t token, std::vector<float>* logits, const RowSampling* sampling) {
    return step(s, token, logits, sampling);
  }

  // ---- the device sampler ----------------------------------------------------------------------

  /// Copies the sampler's row arguments (and the row's penalty edits) to the device, on stream_
  /// before the step's kernels; the sampler then writes its id over the argmax in io_dev_[kIoNextId].
  /// Outside any graph: the graph's kernels only read sample_args_, whose address is fixed.
  void upload_sampling(const RowSampling& r) {
    const ModelConfig& c = config();
    const PenaltyEdits* pe = r.edits;
    const size_t n_edits = pe ? pe->edits.size() : 0, n_biases = pe ? pe->biases.size() : 0;
    if (n_edits > sample_edits_cap_) {
      sample_edits_cap_ = std::max(n_edits, 2 * sample_edits_cap_);
      sample_edits_ = DeviceBuffer(sample_edits_cap_ * sizeof(PenaltyEdit));
    }
    if (n_biases > sample_biases_cap_) {
      sample_biases_cap_ = std::max(n_biases, 2 * sample_biases_cap_);
      sample_biases_ = DeviceBuffer(sample_biases_cap_ * sizeof(float));
    }
    if (n_edits > 0)
      CUDA_CHECK(cudaMemcpyAsync(sample_edits_.data(), pe->edits.data(), n_edits * sizeof(PenaltyEdit),
                                 cudaMemcpyHostToDevice, stream_));
    if (n_biases > 0)
      CUDA_CHECK(cudaMemcpyAsync(sample_biases_.data(), pe->biases.data(), n_biases * sizeof(float),
                                 cudaMemcpyHostToDevice, stream_));
    SampleRowArgs& a = sample_host_;
    a = SampleRowArgs{};
    a.logits = logits_.as<float>();
    a.work = sample_work_.as<float>();
    a.weight = sample_weight_.as<float>();
    a.scratch = sample_parts_.as<unsigned long long>();
    a.out_id = io_dev_.as<int32_t>() + kIoNextId;
    a.edits = n_edits > 0 ? sample_edits_.as<PenaltyEdit>() : nullptr;
    a.biases = n_biases > 0 ? sample_biases_.as<float>() : nullptr;
    a.n_edits = static_cast<int32_t>(n_edits);
    a.vocab = c.vocab;
    a.n_parts = sample_partial_slots(c.vocab);
    fill_sample_params(a, *r.params, r.step);
    CUDA_CHECK(cudaMemcpyAsync(sample_args_.data(), &a, sizeof(SampleRowArgs), cudaMemcpyHostToDevice, stream_));
  }

  /// The device sampler over logits_ (one row), after the argmax.
  void enqueue_sampler() {
    launch_sample_rows(sample_args_.as<SampleRowArgs>(), 1, config().vocab, stream_);
  }

  CudaState& checked(SequenceState& state) const {
    auto* s = dynamic_cast<CudaState*>(&state);
    if (!s || s->owner != this) throw ::lily::Error("CUDA backend: the sequence state belongs to another backend");
    return *s;
  }

  void validate(const CudaState& s, std::span<const int32_t> tokens) const {
    if (tokens.empty()) throw ::lily::Error("prefill: no tokens");
    for (int32_t t : tokens)
      if (t < 0 || t >= config().vocab)
        throw ::lily::Error("token id " + std::to_string(t) + " is outside [0, " + std::to_string(config().vocab) +
                            ")");
    if (s.pos + static_cast<int64_t>(tokens.size()) > s.max_seq)
      throw ::lily::Error("sequence of " + std::to_string(s.pos + tokens.size()) + " tokens exceeds max_seq " +
                          std::to_string(s.max_seq));
  }

  void allocate_scratch() {
    const ModelConfig& c = config();
    int64_t proj_rows = 0;
    for (const DeviceLayer& l : model_->layers)
      proj_rows = std::max<int64_t>(proj_rows, l.in_proj.rows);
    const int64_t mix = std::max<int64_t>(n_gdn_ ? gdn_.value_dim() : 0, int64_t(attn_.n_heads) * attn_.head_dim);
    auto bf = [](int64_t n) { return DeviceBuffer(std::max<int64_t>(n, 1) * sizeof(bf16)); };
    x_ = bf(c.hidden);
    x_alt_ = bf(c.hidden);
    normed_ = bf(c.hidden);
    mixer_out_ = bf(c.hidden);
    moe_out_ = bf(c.hidden);
    proj_ = bf(proj_rows);
    conv_out_ = bf(n_gdn_ ? gdn_.conv_channels() : 1);
    mixer_core_out_ = bf(mix);
    q_out_ = bf(int64_t(attn_.n_heads) * attn_.head_dim);
    act_ = bf(int64_t(routed_plus_shared_slots(c.n_experts_per_tok)) * c.moe_ffn_dim);
    router_logits_ = DeviceBuffer(routed_plus_shared_experts(c.n_experts) * sizeof(float));
    expert_ids_ = DeviceBuffer(routed_plus_shared_slots(c.n_experts_per_tok) * sizeof(int32_t));
    expert_w_ = DeviceBuffer(routed_plus_shared_slots(c.n_experts_per_tok) * sizeof(float));
    router_done_ = DeviceBuffer(sizeof(uint32_t));
    router_done_.fill_bytes(0);  // launch_router_fused leaves it zero after every launch
    moe_barriers_ = DeviceBuffer(static_cast<size_t>(c.n_layers) * kMoeBarriersPerLayer * sizeof(uint32_t));
    staged_pairs_ = DeviceBuffer(static_cast<size_t>(c.hidden / 2) * sizeof(uint32_t));
    staged_sums_ = DeviceBuffer(static_cast<size_t>(std::max(c.hidden / kQuantGroupSize, 1)) * sizeof(float));
    logits_ = DeviceBuffer(static_cast<size_t>(c.vocab) * sizeof(float));
    const int slots = argmax_scratch_slots(c.vocab);
    argmax_v_ = DeviceBuffer(slots * sizeof(float));
    argmax_i_ = DeviceBuffer(slots * sizeof(int32_t));
    io_dev_ = DeviceBuffer(sizeof(StepIo));
    sample_work_ = DeviceBuffer(static_cast<size_t>(c.vocab) * sizeof(float));
    sample_weight_ = DeviceBuffer(static_cast<size_t>(c.vocab) * sizeof(float));
    sample_parts_ = DeviceBuffer(static_cast<size_t>(sample_scratch_slots(c.vocab)) * sizeof(unsigned long long));
    sample_args_ = DeviceBuffer(sizeof(SampleRowArgs));
    attn_ws_bytes_ = attention_decode_workspace_bytes(attn_, kMaxDecodeSplits);
    attn_ws_ = DeviceBuffer(std::max<size_t>(attn_ws_bytes_, 4));
  }

  /// One token through the whole model; advances the state. With `sampling`, the device
  /// sampler picks the returned token (the sampling graph); else the argmax (the greedy graph,
  /// unchanged).
  int32_t step(CudaState& s, int32_t token, std::vector<float>* logits, const RowSampling* sampling = nullptr) {
    s.reserve(s.pos + 1, stream_);
    StepIo* io = io_->get();
    io->token = token;
    io->pos = static_cast<int32_t>(s.pos);
    io->len = static_cast<int32_t>(s.pos + 1);
    if (sampling) upload_sampling(*sampling);
    if (persistent_) {
      persistent_step(s);
      if (sampling) enqueue_sampler();
      copy_io_out();
    } else if (probe_sink_) {
      copy_io_in();
      enqueue_forward(s, true);
      if (sampling) enqueue_sampler();
      copy_io_out();
    } else {
      const DecodeGraphs::Key key{sampling != nullptr, attention_decode_splits(s.capacity), pdl_enabled()};
      cudaGraphExec_t exec = graphs_.find(key, s.layout);
      if (!exec) exec = graphs_.bind(key, s.layout, capture(s, sampling != nullptr).get());
      CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (logits) {
      logits->resize(config().vocab);
      download(logits->data(), logits_.as<float>(), logits->size());
    }
    ++s.pos;
    return io->next_id;
  }

  void copy_io_in() {
    CUDA_CHECK(cudaMemcpyAsync(io_dev_.data(), io_->get(), kIoInBytes, cudaMemcpyHostToDevice, stream_));
  }
  void copy_io_out() {
    CUDA_CHECK(cudaMemcpyAsync(&io_->get()->next_id, io_dev_.as<int32_t>() + kIoNextId, sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_));
  }

  // ---- the persistent decode kernel (CudaOptions::persistent_decode) ---------------------------

  /// The task list, its counters and the buffers only its bodies use (the others are the
  /// decode graph's own scratch, which the step's tasks use in the same roles).
  void create_persistent_decode() {
    const ModelConfig& c = config();
    persistent_ = std::make_unique<DecodeMegakernel>(c, persistent_grain_);
    persistent_attn_part_ = DeviceBuffer(static_cast<size_t>(persistent_->attn_part_floats()) * sizeof(float));
    persistent_best_value_ = DeviceBuffer(static_cast<size_t>(persistent_->lm_parts()) * sizeof(float));
    persistent_best_id_ = DeviceBuffer(static_cast<size_t>(persistent_->lm_parts()) * sizeof(int32_t));
    persistent_layers_ = DeviceBuffer(static_cast<size_t>(c.n_layers) * sizeof(DecodeTaskLayer));
  }

  /// The step's arguments: the backend's decode buffers in the roles decode_tasks.h names, the
  /// layers of the last upload_task_layers.
  DecodeStepParams persistent_params() {
    const ModelConfig& c = config();
    DecodeStepParams p;
    p.hidden = c.hidden;
    p.vocab = c.vocab;
    p.n_layers = c.n_layers;
    p.n_experts = c.n_experts;
    p.top_k = c.n_experts_per_tok;
    p.moe_ffn = c.moe_ffn_dim;
    p.shared_ffn = c.shared_ffn_dim;
    p.eps = c.rms_norm_eps;
    p.gdn_dims = gdn_;
    p.attn_dims = attn_;
    p.grain = persistent_grain_;
    p.embed = model_->embed;
    p.lm_head = model_->lm_head;
    p.final_norm = model_->final_norm;
    p.layers = persistent_layers_.as<DecodeTaskLayer>();
    p.token = io_dev_.as<int32_t>() + kIoToken;
    p.position = io_dev_.as<int32_t>() + kIoPos;
    p.residual = x_.as<bf16>();
    p.mid = x_alt_.as<bf16>();
    p.proj = proj_.as<bf16>();
    p.query = q_out_.as<bf16>();
    p.mix = mixer_core_out_.as<bf16>();
    p.mixer_out = mixer_out_.as<bf16>();
    p.moe_normed = normed_.as<bf16>();
    p.act = act_.as<bf16>();
    p.moe_out = moe_out_.as<bf16>();
    p.attn_part = persistent_attn_part_.as<float>();
    p.router_logits = router_logits_.as<float>();
    p.logits = logits_.as<float>();
    p.head_best_value = persistent_best_value_.as<float>();
    p.head_best_id = persistent_best_id_.as<int32_t>();
    p.next_token = io_dev_.as<int32_t>() + kIoNextId;
    return p;
  }

  /// Copies the layers' weights and `s`'s state of each layer to the device (on stream_), unless
  /// the last copy named the same state blocks.
  void upload_task_layers(const CudaState& s) {
    const ModelConfig& c = config();
    // The state's buffers name the upload: most steps find it unchanged and copy nothing.
    std::vector<const void*> key;
    for (int l = 0; l < c.n_layers; ++l) {
      const int slot = layer_slot_[static_cast<size_t>(l)];
      if (model_->layers[static_cast<size_t>(l)].type == LayerType::kFullAttention) {
        const KvCacheView kv = s.kv(slot);
        key.insert(key.end(), {kv.k, kv.v, reinterpret_cast<const void*>(kv.capacity)});
      } else {
        key.insert(key.end(), {s.window(slot), s.state(slot)});
      }
    }
    if (key == persistent_layers_key_) return;
    std::vector<DecodeTaskLayer> layers(static_cast<size_t>(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      const DeviceLayer& lw = model_->layers[static_cast<size_t>(l)];
      const int slot = layer_slot_[static_cast<size_t>(l)];
      DecodeTaskLayer& t = layers[static_cast<size_t>(l)];
      static_cast<DeviceLayerWeights&>(t) = lw;  // the layer's weights, whole
      if (lw.type == LayerType::kFullAttention) {
        t.kv = s.kv(slot);
      } else {
        t.conv_window = s.window(slot);
        t.gdn_state = s.state(slot);
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(persistent_layers_.data(), layers.data(), layers.size() * sizeof(DecodeTaskLayer),
                               cudaMemcpyHostToDevice, stream_));
    // No synchronize: a copy from pageable memory has read `layers` when cudaMemcpyAsync returns.
    persistent_layers_key_ = std::move(key);
  }

  /// The resident kernel with its timeline recorded (persistent_decode "trace"): waits for the
  /// step, and logs the report of every 64th traced step (the first at the 16th, warm).
  void traced_persistent_launch(DecodeStepParams p) {
    const size_t n = static_cast<size_t>(kDecodeTraceFields * persistent_->n_tasks());
    if (persistent_trace_.bytes() < n * sizeof(unsigned long long))
      persistent_trace_ = DeviceBuffer(n * sizeof(unsigned long long));
    p.trace = persistent_trace_.as<unsigned long long>();
    persistent_->launch(p, stream_);
    if (++persistent_traced_steps_ % 64 != 16) return;
    std::vector<unsigned long long> host(n);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), p.trace, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    log_info(persistent_->summarize_trace(host));
  }

  /// One decode step of `s` through the persistent kernel (io already in host memory): copies
  /// io in and runs the resident kernel, or, with probes or persistent_decode "debug", its
  /// stages one launch each with the probes between them.
  void persistent_step(CudaState& s) {
    upload_task_layers(s);
    copy_io_in();
    const DecodeStepParams p = persistent_params();
    if (!probe_sink_ && options_.persistent_decode == "1") return persistent_->launch(p, stream_);
    if (!probe_sink_ && options_.persistent_decode == "trace") return traced_persistent_launch(p);
    const ModelConfig& c = config();
    const int64_t pos = s.pos;
    persistent_->launch_stages(p, stream_, [&](DecodeTaskKind kind, int layer) {
      if (!probe_sink_) return;
      switch (kind) {
        case DecodeTaskKind::kEmbed: emit("embed", -1, pos, x_.as<bf16>(), c.hidden); break;
        case DecodeTaskKind::kInProj:
          if (layer > 0) emit("layer_out", layer - 1, pos, x_.as<bf16>(), c.hidden);
          break;
        case DecodeTaskKind::kOutProj: emit("mixer_out", layer, pos, mixer_out_.as<bf16>(), c.hidden); break;
        case DecodeTaskKind::kRouter:
          emit("ffn_norm", layer, pos, normed_.as<bf16>(), c.hidden);
          emit_f32("router_logits", layer, pos, router_logits_.as<float>(), c.n_experts);
          break;
        case DecodeTaskKind::kExpertDown: emit("ffn_out", layer, pos, moe_out_.as<bf16>(), c.hidden); break;
        case DecodeTaskKind::kArgmax: emit_f32("logits", -1, pos, logits_.as<float>(), c.vocab); break;
        default: break;
      }
    });
  }

  /// Captures the decode step of `s` (not instantiated): with `sampled`, the device sampler
  /// follows the argmax and overwrites its id.
  CapturedGraph capture(CudaState& s, bool sampled) {
    return capture_on_stream([&] {
      copy_io_in();
      enqueue_forward(s, false);
      if (sampled) enqueue_sampler();
      copy_io_out();
    });
  }

  /// What `enqueue()` launches on stream_, captured (thread-local mode; not instantiated). A
  /// throw from `enqueue` ends the capture and discards the partial graph.
  template <class F>
  CapturedGraph capture_on_stream(F&& enqueue) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    return CapturedGraph(graph);
  }

  // ---- the forward pass of one token (docs/model.md §3, §4.3) ----------------------------------

  void enqueue_forward(CudaState& s, bool probing) {
    const ModelConfig& c = config();
    const int32_t* d_io = io_dev_.as<int32_t>();
    const int32_t* d_token = d_io + kIoToken;
    const int32_t* d_pos = d_io + kIoPos;
    const int32_t* d_len = d_io + kIoLen;
    const int64_t pos = s.pos;
    // The fused MoE block's grid barriers count up from zero in every step (a memset node in
    // the graph), so a replay never depends on how the last one ended.
    if (fused_moe_) CUDA_CHECK(cudaMemsetAsync(moe_barriers_.data(), 0, moe_barriers_.bytes(), stream_));
    launch_embed(model_->embed, d_token, 1, x_.as<bf16>(), stream_);
    if (probing) emit("embed", -1, pos, x_.as<bf16>(), c.hidden);
    // Every add + RMSNorm is folded into the GEMV that consumes it (FusedNorm): the residual
    // stream ping-pongs x_ → x_alt_ (input norm, in the mixer's first GEMV) → x_ (post norm, in the
    // router); normed_ holds the latest normed row (the expert kernels read it).
    // With LILY_CUDA_FUSE=0 the residual stays in x_ and the norms are separate kernels.
    const DeviceBuffer& resid = fuse_decode_ ? x_alt_ : x_;  // the residual right after an input/final norm's add
    for (int l = 0; l < c.n_layers; ++l) {
      const DeviceLayer& lw = model_->layers[l];  // the layer's device weights
      const FusedNorm in_norm = fused_norm(l == 0 ? nullptr : moe_out_.as<bf16>(), lw.input_norm, x_alt_);
      if (!fuse_decode_) separate_norm(in_norm);
      // With moe_out_proj_ the MoE block runs the mixer's out-projection (the probes, which read
      // the mixer's output before the block, take the separate GEMV). With moe_next_norm_ the
      // MoE block before this layer staged its input norm (not while probing: the probes read
      // each block's own normed row after it).
      const bool out_proj_in_moe = moe_out_proj_ && !probing;
      const bool next_norm = moe_next_norm_ && !probing;
      const bool staged_in = next_norm && l > 0;
      if (lw.type == LayerType::kLinearAttention) gdn_mixer(lw, s, layer_slot_[l], in_norm, staged_in, !out_proj_in_moe);
      else attention_mixer(lw, s, layer_slot_[l], d_pos, d_len, in_norm, staged_in, !out_proj_in_moe);
      if (probing) {
        if (l > 0) emit("layer_out", l - 1, pos, resid.as<bf16>(), c.hidden);
        emit("attn_norm", l, pos, normed_.as<bf16>(), c.hidden);
        emit("mixer_out", l, pos, mixer_out_.as<bf16>(), c.hidden);
      }
      moe_block(lw, l, out_proj_in_moe, next_norm);
      if (probing) {
        emit("ffn_norm", l, pos, normed_.as<bf16>(), c.hidden);
        emit_f32("router_logits", l, pos, router_logits_.as<float>(), c.n_experts);
        emit("ffn_out", l, pos, moe_out_.as<bf16>(), c.hidden);
      }
    }
    const FusedNorm final_norm = fused_norm(moe_out_.as<bf16>(), model_->final_norm, x_alt_);
    if (moe_next_norm_ && !probing) {
      launch_staged_row_gemv(staged_row(), model_->lm_head, nullptr, logits_.as<float>(), stream_);
    } else if (fuse_decode_) {
      launch_add_rmsnorm_gemv(final_norm, x_.as<bf16>(), model_->lm_head, nullptr, logits_.as<float>(), stream_);
    } else {
      separate_norm(final_norm);
      launch_quant_gemv(model_->lm_head, normed_.as<bf16>(), nullptr, logits_.as<float>(), stream_);
    }
    if (probing) {
      emit("layer_out", c.n_layers - 1, pos, resid.as<bf16>(), c.hidden);
      emit("final_norm", -1, pos, normed_.as<bf16>(), c.hidden);
    }
    launch_argmax(logits_.as<float>(), c.vocab, argmax_v_.as<float>(), argmax_i_.as<int32_t>(),
                  io_dev_.as<int32_t>() + kIoNextId, stream_);
    if (probing) emit_f32("logits", -1, pos, logits_.as<float>(), c.vocab);
  }

  /// The unfused form of a FusedNorm (LILY_CUDA_FUSE=0): add + RMSNorm in place on x_.
  void separate_norm(const FusedNorm& n) {
    launch_add_rmsnorm(x_.as<bf16>(), n.branch, n.gain, normed_.as<bf16>(), 1, config().hidden, n.eps, stream_);
  }

  /// The FusedNorm of a decode step: x ← (x + branch) into x_out, normed into normed_.
  FusedNorm fused_norm(const bf16* branch, const float* gain, DeviceBuffer& x_out) {
    FusedNorm n;
    n.branch = branch;
    n.gain = gain;
    n.eps = config().rms_norm_eps;
    n.x_out = x_out.as<bf16>();
    n.normed_out = normed_.as<bf16>();
    return n;
  }

  /// The row the fused MoE block stages for the next GEMV (moe_next_norm_).
  StagedRow staged_row() { return {staged_pairs_.as<uint32_t>(), staged_sums_.as<float>()}; }

  /// The GDN mixer of one token; `staged_in`: its input norm is in staged_row() (else in_norm
  /// runs in the in-projection); `out_proj`: also its out-projection (else the MoE block runs it).
  void gdn_mixer(const DeviceLayer& lw, CudaState& s, int slot, const FusedNorm& in_norm, bool staged_in,
                 bool out_proj) {
    bf16* proj = proj_.as<bf16>();
    const int C = gdn_.conv_channels(), Vd = gdn_.value_dim(), Hv = gdn_.n_value_heads;
    // Input norm + in-projection + causal conv step (on the q|k|v rows) in one launch.
    FusedConv conv;
    conv.channels = C;
    conv.taps = lw.gdn.conv_w;
    conv.window = s.window(slot);
    conv.out = conv_out_.as<bf16>();
    if (staged_in) {
      launch_staged_row_gemv(staged_row(), lw.in_proj, proj, nullptr, stream_, conv);
    } else if (fuse_decode_) {
      launch_add_rmsnorm_gemv(in_norm, x_.as<bf16>(), lw.in_proj, proj, nullptr, stream_, conv);
    } else {
      launch_quant_gemv(lw.in_proj, normed_.as<bf16>(), proj, nullptr, stream_);
      gdn_conv_decode(gdn_, lw.gdn, proj, s.window(slot), conv_out_.as<bf16>(), stream_);
    }
    gdn_decode(gdn_, lw.gdn, conv_out_.as<bf16>(), proj + C, proj + C + Vd, proj + C + Vd + Hv, s.state(slot),
               mixer_core_out_.as<bf16>(), stream_);
    if (out_proj) launch_quant_gemv(lw.out_proj, mixer_core_out_.as<bf16>(), mixer_out_.as<bf16>(), nullptr, stream_);
  }

  /// The attention mixer of one token; `staged_in` and `out_proj` as gdn_mixer's.
  void attention_mixer(const DeviceLayer& lw, CudaState& s, int slot, const int32_t* d_pos, const int32_t* d_len,
                       const FusedNorm& in_norm, bool staged_in, bool out_proj) {
    bf16* proj = proj_.as<bf16>();
    const int64_t qg = int64_t(attn_.n_heads) * 2 * attn_.head_dim, kvw = int64_t(attn_.n_kv_heads) * attn_.head_dim;
    if (staged_in) launch_staged_row_gemv(staged_row(), lw.in_proj, proj, nullptr, stream_);
    else if (fuse_decode_) launch_add_rmsnorm_gemv(in_norm, x_.as<bf16>(), lw.in_proj, proj, nullptr, stream_);
    else launch_quant_gemv(lw.in_proj, normed_.as<bf16>(), proj, nullptr, stream_);
    const KvCacheView kv = s.kv(slot);
    attention_prepare(attn_, 1, proj, lw.in_proj.rows, proj + qg, proj + qg + kvw, lw.in_proj.rows, lw.q_norm,
                      lw.k_norm, 0, d_pos, kv, q_out_.as<bf16>(), stream_);
    const int splits = attention_decode_splits(s.capacity);
    attention_decode(attn_, q_out_.as<bf16>(), proj, kv, 1, d_len, splits, attn_ws_.as<float>(), attn_ws_bytes_,
                     mixer_core_out_.as<bf16>(), stream_);
    if (out_proj) launch_quant_gemv(lw.out_proj, mixer_core_out_.as<bf16>(), mixer_out_.as<bf16>(), nullptr, stream_);
  }

  /// The fused MoE block's arguments for layer `layer` (the post norm's add reads x_alt_ and
  /// mixer_out_, writes x_ and normed_; the output goes to moe_out_).
  MoeDecodeArgs moe_args(const DeviceLayer& lw, int layer) {
    const ModelConfig& c = config();
    MoeDecodeArgs a;
    a.router = lw.router;
    a.gate = lw.gate;
    a.up = lw.up;
    a.down = lw.down;
    a.n_experts = c.n_experts;
    a.top_k = c.n_experts_per_tok;
    a.ffn = c.moe_ffn_dim;
    a.norm = fused_norm(mixer_out_.as<bf16>(), lw.post_norm, x_);
    a.x = x_alt_.as<bf16>();
    a.logits = router_logits_.as<float>();
    a.ids = expert_ids_.as<int32_t>();
    a.weights = expert_w_.as<float>();
    a.act = act_.as<bf16>();
    a.out = moe_out_.as<bf16>();
    a.barriers = moe_barriers_.as<uint32_t>() + static_cast<int64_t>(layer) * kMoeBarriersPerLayer;
    return a;
  }

  /// Whether every layer's MoE block fits the fused kernel at `rows` rows
  /// (moe_block_unsupported); the reason of the first that does not goes to the log once.
  bool fused_moe_supported(int rows = 1) {
    for (int l = 0; l < config().n_layers; ++l) {
      MoeDecodeArgs a = moe_args(model_->layers[l], l);
      a.rows = rows;
      const std::string why = rows == 1 ? moe_block_unsupported(a) : moe_block_rows_unsupported(a);
      if (!why.empty()) {
        log_info("CUDA backend: " + std::string(rows == 1 ? "decode" : "batched decode") + " MoE as three kernels (" +
                 why + ")");
        return false;
      }
    }
    return true;
  }

  /// The fused MoE block's arguments with the layer's out-projection as its first phase (reading
  /// mixer_core_out_, writing mixer_out_, the post norm's branch).
  MoeDecodeArgs moe_args_with_out_proj(const DeviceLayer& lw, int layer) {
    MoeDecodeArgs a = moe_args(lw, layer);
    a.out_proj.w = lw.out_proj;
    a.out_proj.x = mixer_core_out_.as<bf16>();
    a.out_proj.y = mixer_out_.as<bf16>();
    return a;
  }

  /// Whether every layer's MoE block takes its out-projection (moe_block_unsupported with
  /// MoeDecodeArgs::out_proj); the reason of the first that does not goes to the log once.
  bool moe_out_proj_supported() {
    for (int l = 0; l < config().n_layers; ++l) {
      const std::string why = moe_block_unsupported(moe_args_with_out_proj(model_->layers[l], l));
      if (!why.empty()) {
        log_info("CUDA backend: decode out-projections as separate GEMVs (" + why + ")");
        return false;
      }
    }
    return true;
  }

  /// The fused MoE block's next-norm phase for layer `layer`: the input norm of the layer after
  /// it, or the final norm after the last (x_ + moe_out_ → x_alt_, normed_ and staged_row(), as
  /// the in-projection's or the LM head's FusedNorm would have them).
  MoeNextNorm next_norm_args(int layer) {
    MoeNextNorm n;
    const bool last = layer + 1 == config().n_layers;
    n.gain = last ? model_->final_norm : model_->layers[layer + 1].input_norm;
    n.eps = config().rms_norm_eps;
    n.x_out = x_alt_.as<bf16>();
    n.normed_out = normed_.as<bf16>();
    n.row = staged_row();
    return n;
  }

  /// Whether every layer's MoE block takes the next-norm phase (with the out-projection phase
  /// when moe_out_proj_) and every GEMV after one takes a staged row (the in-projections of layers
  /// 1 … and the LM head); the reason of the first that does not goes to the log once.
  bool moe_next_norm_supported() {
    const ModelConfig& c = config();
    for (int l = 0; l < c.n_layers; ++l) {
      const DeviceLayer& lw = model_->layers[l];
      MoeDecodeArgs a = moe_out_proj_ ? moe_args_with_out_proj(lw, l) : moe_args(lw, l);
      a.next_norm = next_norm_args(l);
      std::string why = moe_block_unsupported(a);
      const DeviceQuant& next = l + 1 < c.n_layers ? model_->layers[l + 1].in_proj : model_->lm_head;
      if (why.empty() && !staged_row_gemv_supported(next))
        why = "the GEMV after layer " + std::to_string(l) + " does not take a staged row";
      if (!why.empty()) {
        log_info("CUDA backend: decode input norms inside the GEMVs (" + why + ")");
        return false;
      }
    }
    return true;
  }

  /// The MoE half of a layer for one token; `out_proj`: the fused block runs the mixer's
  /// out-projection first (moe_out_proj_); `next_norm`: and stages the next input norm last
  /// (moe_next_norm_).
  void moe_block(const DeviceLayer& lw, int layer, bool out_proj, bool next_norm) {
    const ModelConfig& c = config();
    const int k = c.n_experts_per_tok;
    if (fused_moe_) {
      MoeDecodeArgs a = out_proj ? moe_args_with_out_proj(lw, layer) : moe_args(lw, layer);
      if (next_norm) a.next_norm = next_norm_args(layer);
      return launch_moe_block_decode(a, stream_);
    }
    // Post norm (x_alt_ + mixer_out_ → x_, normed_) + router GEMV + top-k in one launch (the logits
    // are still written, for the probes).
    if (fuse_decode_) {
      launch_add_rmsnorm_router_fused(fused_norm(mixer_out_.as<bf16>(), lw.post_norm, x_), x_alt_.as<bf16>(), lw.router,
                                      c.n_experts, k, router_logits_.as<float>(), expert_ids_.as<int32_t>(),
                                      expert_w_.as<float>(), router_done_.as<uint32_t>(), stream_);
    } else {
      separate_norm(fused_norm(mixer_out_.as<bf16>(), lw.post_norm, x_));
      launch_quant_gemv(lw.router, normed_.as<bf16>(), nullptr, router_logits_.as<float>(), stream_);
      launch_router_topk(router_logits_.as<float>(), 1, c.n_experts, k, expert_ids_.as<int32_t>(),
                         expert_w_.as<float>(), stream_);
    }
    const int n_sel = routed_plus_shared_slots(c.n_experts_per_tok);
    launch_expert_gate_up(lw.gate, lw.up, c.moe_ffn_dim, expert_ids_.as<int32_t>(), n_sel, normed_.as<bf16>(), 1,
                          act_.as<bf16>(), stream_);
    launch_expert_down_combine(lw.down, c.hidden, expert_ids_.as<int32_t>(), expert_w_.as<float>(), n_sel,
                               act_.as<bf16>(), 1, moe_out_.as<bf16>(), stream_);
  }

  // ---- batched decode (CudaOptions::batched_decode, LILY_CUDA_BATCHED_DECODE=1) ----------------
  //
  // One forward over the B ≤ CudaOptions::decode_rows decode rows of a step, each a token of its
  // own sequence: every projection reads its weights once per 32 rows (launch_quant_gemv_rows),
  // the mixers run one launch over the rows with each row's state, KV cache, position, length
  // and split count taken from the exchange block (BatchLayout), the MoE block runs as one
  // launch over the B rows (launch_moe_block_rows: post norm, router, top-k, each distinct
  // expert's weights read once per eight rows that route to it, combine), then the LM head over
  // B rows and an argmax per row. Where the fused block does not fit the shape at decode_rows
  // rows, the MoE is the three kernels over B rows (each row's experts on its own).
  // Batch invariance: every launch computes a row from that row's inputs alone, with tile shapes,
  // split counts and summation orders fixed by the weights' shape or by the row's own sequence
  // (its KV capacity), never by B or by the other rows; and every launch gives a row the bits
  // the one-sequence step gives it (the norms are launch_add_rmsnorm's, which the fused norms
  // equal; the GEMV's direct mode sums Σx as the staged one does; the MoE rows kernel runs the
  // one-token block's arithmetic), so a lone decode row takes the one-sequence decode graph and
  // a sequence's answer is the same bits whatever else the step holds.
  // The input and final add + RMSNorms are separate launches (launch_add_rmsnorm over B rows),
  // or with rows_gemv_norm_ the input ones inside the in-projections' staging at 2 … 8 rows
  // (launch_add_rmsnorm_gemv_rows, the same bits).

  /// The batched decode's device buffers and pinned exchange (allocated at its first step).
  struct BatchScratch {
    explicit BatchScratch(const BatchLayout& l)
        : layout(l), in_host(l.bytes), next_host(kMaxDecodeRows * sizeof(int32_t)) {}
    BatchLayout layout;
    PinnedBytes in_host;    ///< the exchange block (BatchLayout), written before each launch
    PinnedBytes next_host;  ///< int32 [kMaxDecodeRows]: each row's next token, copied back by the graph
    DeviceBuffer in_dev, next_dev;
    /// Activations of up to kMaxDecodeRows rows: x, normed, mixer_out, moe [rows, hidden]; proj
    /// [rows, largest in-projection]; conv [rows, C]; mix [rows, mixer core]; q [rows, nq·D];
    /// router fp32 [rows, E + 1]; ids, weights [rows, k + 1]; act [rows, k + 1, ffn]; act_sums
    /// fp32 [rows, k + 1, ffn / 8], normed_sums fp32 [rows, hidden / 64] and normed_frag
    /// [rows, hidden] (the MoE rows kernel's).
    DeviceBuffer x, normed, mixer_out, moe, proj, conv, mix, q, router, ids, weights, act, act_sums, normed_sums,
        normed_frag;
    DeviceBuffer x_alt;        ///< [rows, hidden]: the fused MoE block's residual output (x and x_alt alternate)
    DeviceBuffer router_done;  ///< uint32 [kMaxDecodeRows], zero between launches (launch_router_fused)
    /// The MoE rows kernel's grid barriers: uint32 [n_layers][kMoeBarriersPerLayer],
    /// zeroed at the start of every step (a memset node in the graph).
    DeviceBuffer moe_barriers;
    DeviceBuffer logits;       ///< fp32 [kMaxDecodeRows, vocab]
    DeviceBuffer argmax_v, argmax_i;  ///< [kMaxDecodeRows][argmax_scratch_slots(vocab)]
    DeviceBuffer attn_ws;
    size_t attn_ws_bytes = 0;
    /// The device sampler: per sampled row (in the order of the step's sampled rows) its
    /// work / weight [vocab] fp32 and scratch; the rows' SampleRowArgs; their penalty edits.
    DeviceBuffer sample_work, sample_weight, sample_parts, sample_args;
    std::array<DeviceBuffer, kMaxDecodeRows> edits, biases;
    std::array<size_t, kMaxDecodeRows> edits_cap{}, biases_cap{};
    std::vector<SampleRowArgs> sample_host;
  };

  void allocate_batch_scratch() {
    if (batch_) return;
    const ModelConfig& c = config();
    const int64_t rows = options_.decode_rows;  // the most rows of one batched forward
    // Per-row widths as the one-token buffers have them (allocate_scratch; the prefill scratch
    // sizes its rows the same way).
    const int64_t proj_rows = static_cast<int64_t>(proj_.bytes() / sizeof(bf16));
    const int64_t mix = static_cast<int64_t>(mixer_core_out_.bytes() / sizeof(bf16));
    const int64_t n_sel = routed_plus_shared_slots(c.n_experts_per_tok);
    auto bf = [](int64_t n) { return DeviceBuffer(std::max<int64_t>(n, 1) * sizeof(bf16)); };
    auto b = std::make_unique<BatchScratch>(BatchLayout(n_attn_, n_gdn_));
    b->in_dev = DeviceBuffer(b->layout.bytes);
    b->next_dev = DeviceBuffer(rows * sizeof(int32_t));
    b->x = bf(rows * c.hidden);
    b->x_alt = bf(rows * c.hidden);
    b->normed = bf(rows * c.hidden);
    b->mixer_out = bf(rows * c.hidden);
    b->moe = bf(rows * c.hidden);
    b->proj = bf(rows * proj_rows);
    b->conv = bf(rows * (n_gdn_ ? gdn_.conv_channels() : 1));
    b->mix = bf(rows * mix);
    b->q = bf(rows * attn_.n_heads * attn_.head_dim);
    b->router = DeviceBuffer(rows * routed_plus_shared_experts(c.n_experts) * sizeof(float));
    b->ids = DeviceBuffer(rows * n_sel * sizeof(int32_t));
    b->weights = DeviceBuffer(rows * n_sel * sizeof(float));
    b->act = bf(rows * n_sel * c.moe_ffn_dim);
    b->act_sums = DeviceBuffer(std::max<int64_t>(rows * n_sel * c.moe_ffn_dim / 8, 1) * sizeof(float));
    b->normed_sums = DeviceBuffer(std::max<int64_t>(rows * c.hidden / kQuantGroupSize, 1) * sizeof(float));
    b->normed_frag = bf(rows * c.hidden);
    b->router_done = DeviceBuffer(rows * sizeof(uint32_t));
    b->router_done.fill_bytes(0);
    b->moe_barriers = DeviceBuffer(static_cast<size_t>(c.n_layers) * kMoeBarriersPerLayer * sizeof(uint32_t));
    b->logits = DeviceBuffer(rows * c.vocab * sizeof(float));
    const int64_t slots = argmax_scratch_slots(c.vocab);
    b->argmax_v = DeviceBuffer(rows * slots * sizeof(float));
    b->argmax_i = DeviceBuffer(rows * slots * sizeof(int32_t));
    b->attn_ws_bytes = attention_decode_rows_workspace_bytes(attn_, static_cast<int>(rows));
    b->attn_ws = DeviceBuffer(b->attn_ws_bytes);
    b->sample_work = DeviceBuffer(rows * c.vocab * sizeof(float));
    b->sample_weight = DeviceBuffer(rows * c.vocab * sizeof(float));
    b->sample_parts = DeviceBuffer(rows * sample_scratch_slots(c.vocab) * sizeof(unsigned long long));
    b->sample_args = DeviceBuffer(rows * sizeof(SampleRowArgs));
    batch_ = std::move(b);
  }

  /// Device pointer at byte offset `off` of the exchange block.
  template <class T>
  T* batch_dev(size_t off) const { return reinterpret_cast<T*>(batch_->in_dev.as<char>() + off); }
  /// Host (pinned) pointer at byte offset `off` of the exchange block.
  template <class T>
  T* batch_host(size_t off) const { return reinterpret_cast<T*>(batch_->in_host.as<char>() + off); }

  /// One decode step of the rows `which` (indices into `rows`, 1 … kMaxDecodeRows of them, each a
  /// validated one-token decode row of its own state) as one batched forward; writes each row's
  /// next token into `next` (rows with want_logits) and its logits where asked, and advances
  /// every state by one position.
  void decode_batch(std::span<const StepRow> rows, std::span<const size_t> which, std::vector<int32_t>& next) {
    allocate_batch_scratch();
    BatchScratch& b = *batch_;
    const BatchLayout& lay = b.layout;
    const ModelConfig& c = config();
    const int B = static_cast<int>(which.size());
    std::vector<CudaState*> states(B);
    int max_splits = 1;
    for (int r = 0; r < B; ++r) {
      const StepRow& row = rows[which[r]];
      CudaState& s = checked(*row.state);
      s.reserve(s.pos + 1, stream_);  // growth happens here, outside the graph
      states[r] = &s;
      const int splits = attention_decode_splits(s.capacity);  // the row's own, as in the one-sequence step
      max_splits = std::max(max_splits, splits);
      batch_host<int32_t>(lay.token)[r] = row.tokens[0];
      batch_host<int32_t>(lay.pos)[r] = static_cast<int32_t>(s.pos);
      batch_host<int32_t>(lay.len)[r] = static_cast<int32_t>(s.pos + 1);
      batch_host<int32_t>(lay.splits)[r] = splits;
      for (int i = 0; i < n_attn_; ++i) batch_host<KvCacheView>(lay.kv_of(i))[r] = s.kv(i);
      for (int i = 0; i < n_gdn_; ++i) {
        batch_host<bf16*>(lay.windows_of(i))[r] = s.window(i);
        batch_host<float*>(lay.states_of(i))[r] = s.state(i);
      }
    }
    // Sampled rows: their SampleRowArgs go up now (outside the graph, whose sampler launch reads
    // them at fixed addresses), in the order of the rows.
    b.sample_host.clear();
    for (int r = 0; r < B; ++r) {
      const StepRow& row = rows[which[r]];
      if (row.want_logits && row.sampling.params) add_batch_sampling(row.sampling, r);
    }
    const int n_sampled = static_cast<int>(b.sample_host.size());
    if (n_sampled > 0)
      CUDA_CHECK(cudaMemcpyAsync(b.sample_args.data(), b.sample_host.data(), n_sampled * sizeof(SampleRowArgs),
                                 cudaMemcpyHostToDevice, stream_));
    DecodeGraphs::Key key{n_sampled > 0, max_splits, pdl_enabled(), B, n_sampled};
    cudaGraphExec_t exec = batch_graphs_.find(key, kBatchGraphLayout);
    if (!exec) exec = batch_graphs_.bind(key, kBatchGraphLayout, capture_batch(B, max_splits, n_sampled).get());
    CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int r = 0; r < B; ++r) {
      const StepRow& row = rows[which[r]];
      if (row.want_logits) {
        next[which[r]] = b.next_host.as<int32_t>()[r];
        if (row.logits) {
          row.logits->resize(c.vocab);
          download(row.logits->data(), b.logits.as<float>() + static_cast<int64_t>(r) * c.vocab, row.logits->size());
        }
      }
      ++states[r]->pos;
    }
  }

  /// The fused MoE block's arguments for layer `layer` of a batched step of n rows (n ≤
  /// kMaxMoeRows): the post norm adds the mixer output to x (the residual) into x_out and
  /// normed; the output goes to moe.
  MoeDecodeArgs batch_moe_args(const DeviceLayer& lw, int layer, int n, const bf16* x, bf16* x_out) {
    BatchScratch& b = *batch_;
    MoeDecodeArgs a = moe_args(lw, layer);
    a.rows = n;
    a.norm.branch = b.mixer_out.as<bf16>();
    a.norm.x_out = x_out;
    a.norm.normed_out = b.normed.as<bf16>();
    a.x = x;
    a.logits = b.router.as<float>();
    a.ids = b.ids.as<int32_t>();
    a.weights = b.weights.as<float>();
    a.act = b.act.as<bf16>();
    a.act_sums = b.act_sums.as<float>();
    a.normed_sums = b.normed_sums.as<float>();
    a.normed_frag = b.normed_frag.as<bf16>();
    a.out = b.moe.as<bf16>();
    a.barriers = b.moe_barriers.as<uint32_t>() + int64_t{layer} * kMoeBarriersPerLayer;
    a.tile_claims = a.barriers + kMoeTileClaimsSlot;
    return a;
  }

  /// Appends the SampleRowArgs of batch row `r` (sampled) to the host list, with its scratch
  /// taken from slot = its index among the step's sampled rows; its penalty edits are copied to
  /// that slot's device buffers now. The sampler overwrites the row's argmax id.
  void add_batch_sampling(const RowSampling& rs, int r) {
    BatchScratch& b = *batch_;
    const ModelConfig& c = config();
    const int slot = static_cast<int>(b.sample_host.size());
    const PenaltyEdits* pe = rs.edits;
    const size_t n_edits = pe ? pe->edits.size() : 0, n_biases = pe ? pe->biases.size() : 0;
    if (n_edits > b.edits_cap[slot]) {
      b.edits_cap[slot] = std::max(n_edits, 2 * b.edits_cap[slot]);
      b.edits[slot] = DeviceBuffer(b.edits_cap[slot] * sizeof(PenaltyEdit));
    }
    if (n_biases > b.biases_cap[slot]) {
      b.biases_cap[slot] = std::max(n_biases, 2 * b.biases_cap[slot]);
      b.biases[slot] = DeviceBuffer(b.biases_cap[slot] * sizeof(float));
    }
    if (n_edits > 0)
      CUDA_CHECK(cudaMemcpyAsync(b.edits[slot].data(), pe->edits.data(), n_edits * sizeof(PenaltyEdit),
                                 cudaMemcpyHostToDevice, stream_));
    if (n_biases > 0)
      CUDA_CHECK(cudaMemcpyAsync(b.biases[slot].data(), pe->biases.data(), n_biases * sizeof(float),
                                 cudaMemcpyHostToDevice, stream_));
    SampleRowArgs a{};
    a.logits = b.logits.as<float>() + static_cast<int64_t>(r) * c.vocab;
    a.work = b.sample_work.as<float>() + static_cast<int64_t>(slot) * c.vocab;
    a.weight = b.sample_weight.as<float>() + static_cast<int64_t>(slot) * c.vocab;
    a.scratch = b.sample_parts.as<unsigned long long>() + static_cast<int64_t>(slot) * sample_scratch_slots(c.vocab);
    a.out_id = b.next_dev.as<int32_t>() + r;
    a.edits = n_edits > 0 ? b.edits[slot].as<PenaltyEdit>() : nullptr;
    a.biases = n_biases > 0 ? b.biases[slot].as<float>() : nullptr;
    a.n_edits = static_cast<int32_t>(n_edits);
    a.vocab = c.vocab;
    a.n_parts = sample_partial_slots(c.vocab);
    fill_sample_params(a, *rs.params, rs.step);
    b.sample_host.push_back(a);
  }

  /// Captures the batched step of B rows (not instantiated): the exchange block in, the forward,
  /// the argmax per row, the sampler over the first n_sampled SampleRowArgs, the ids out.
  CapturedGraph capture_batch(int B, int max_splits, int n_sampled) {
    BatchScratch& b = *batch_;
    return capture_on_stream([&] {
      CUDA_CHECK(cudaMemcpyAsync(b.in_dev.data(), b.in_host.as<void>(), b.layout.bytes, cudaMemcpyHostToDevice,
                                 stream_));
      enqueue_batch_forward(B, max_splits);
      if (n_sampled > 0) launch_sample_rows(b.sample_args.as<SampleRowArgs>(), n_sampled, config().vocab, stream_);
      CUDA_CHECK(cudaMemcpyAsync(b.next_host.as<void>(), b.next_dev.data(), B * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream_));
    });
  }

  /// The forward of B rows (batched decode, see above), ending with each row's argmax in
  /// next_dev[r]. `max_splits`: the largest attention split count of the rows (the grid).
  void enqueue_batch_forward(int B, int max_splits) {
    const ModelConfig& c = config();
    BatchScratch& b = *batch_;
    const BatchLayout& lay = b.layout;
    const float eps = c.rms_norm_eps;
    bf16 *x = b.x.as<bf16>(), *normed = b.normed.as<bf16>(), *mixer_out = b.mixer_out.as<bf16>();
    bf16 *moe = b.moe.as<bf16>(), *proj = b.proj.as<bf16>(), *mix = b.mix.as<bf16>(), *x_alt = b.x_alt.as<bf16>();
    if (batched_fused_moe_) CUDA_CHECK(cudaMemsetAsync(b.moe_barriers.data(), 0, b.moe_barriers.bytes(), stream_));
    launch_embed(model_->embed, batch_dev<int32_t>(lay.token), B, x, stream_);
    for (int l = 0; l < c.n_layers; ++l) {
      const DeviceLayer& lw = model_->layers[l];  // the layer's device weights
      const int slot = layer_slot_[l];
      // x ← x + the previous layer's MoE output; normed = RMSNorm(x) · input gain; proj = the
      // in-projection of normed. With rows_gemv_norm_ the in-projection's blocks form the norm
      // (the new residual goes to the other buffer, as every block reads x).
      if (l > 0 && rows_gemv_norm_ && rows_norm_gemv_problem(lw.in_proj, B).empty() &&
          reinterpret_cast<uintptr_t>(lw.input_norm) % 16 == 0) {
        FusedNorm norm;
        norm.branch = moe;
        norm.gain = lw.input_norm;
        norm.eps = eps;
        norm.x_out = x_alt;
        norm.normed_out = normed;
        launch_add_rmsnorm_gemv_rows(norm, x, B, lw.in_proj, proj, stream_);
        std::swap(x, x_alt);
      } else {
        launch_add_rmsnorm(x, l == 0 ? nullptr : moe, lw.input_norm, normed, B, c.hidden, eps, stream_);
        launch_quant_gemv_rows(lw.in_proj, normed, B, proj, nullptr, stream_);
      }
      if (lw.type == LayerType::kLinearAttention) {
        const int C = gdn_.conv_channels(), Vd = gdn_.value_dim(), Hv = gdn_.n_value_heads;
        const int64_t proj_stride = lw.in_proj.rows;  // proj row stride: q ‖ k ‖ v ‖ z ‖ a ‖ b
        gdn_conv_decode_rows(gdn_, lw.gdn, B, proj, proj_stride, batch_dev<bf16* const>(lay.windows_of(slot)),
                             b.conv.as<bf16>(), stream_);
        gdn_decode_rows(gdn_, lw.gdn, B, b.conv.as<bf16>(), proj + C, proj + C + Vd, proj + C + Vd + Hv, proj_stride,
                        batch_dev<float* const>(lay.states_of(slot)), mix, stream_);
        launch_quant_gemv_rows(lw.out_proj, mix, B, mixer_out, nullptr, stream_);
      } else {
        const int64_t proj_stride = lw.in_proj.rows;  // proj row stride: q|gate ‖ k ‖ v
        const int64_t qg = int64_t(attn_.n_heads) * 2 * attn_.head_dim,
                      kvw = int64_t(attn_.n_kv_heads) * attn_.head_dim;
        const KvCacheView* caches = batch_dev<const KvCacheView>(lay.kv_of(slot));
        attention_prepare_rows(attn_, B, proj, proj_stride, proj + qg, proj + qg + kvw, proj_stride, lw.q_norm,
                               lw.k_norm, batch_dev<const int32_t>(lay.pos), caches, b.q.as<bf16>(), stream_);
        attention_decode_rows(attn_, B, b.q.as<bf16>(), proj, proj_stride, caches, batch_dev<const int32_t>(lay.len),
                              batch_dev<const int32_t>(lay.splits), max_splits, b.attn_ws.as<float>(), b.attn_ws_bytes,
                              mix, stream_);
        launch_quant_gemv_rows(lw.out_proj, mix, B, mixer_out, nullptr, stream_);
      }
      // MoE: x ← x + mixer output, normed = post norm; router + top-k; experts; combine → moe.
      // The fused block writes the new residual to the other buffer (its blocks all read x).
      if (batched_fused_moe_) {
        launch_moe_block_rows(batch_moe_args(lw, l, B, x, x_alt), stream_);
        std::swap(x, x_alt);
        continue;
      }
      const int k = c.n_experts_per_tok, n_sel = routed_plus_shared_slots(c.n_experts_per_tok);
      launch_add_rmsnorm(x, mixer_out, lw.post_norm, normed, B, c.hidden, eps, stream_);
      launch_router_fused(lw.router, normed, B, c.n_experts, k, b.router.as<float>(), b.ids.as<int32_t>(),
                          b.weights.as<float>(), b.router_done.as<uint32_t>(), stream_);
      launch_expert_gate_up(lw.gate, lw.up, c.moe_ffn_dim, b.ids.as<int32_t>(), n_sel, normed, B, b.act.as<bf16>(),
                            stream_);
      launch_expert_down_combine(lw.down, c.hidden, b.ids.as<int32_t>(), b.weights.as<float>(), n_sel,
                                 b.act.as<bf16>(), B, moe, stream_);
    }
    launch_add_rmsnorm(x, moe, model_->final_norm, normed, B, c.hidden, eps, stream_);
    float* logits = b.logits.as<float>();
    launch_quant_gemv_rows(model_->lm_head, normed, B, nullptr, logits, stream_);
    launch_argmax_rows(logits, B, c.vocab, b.argmax_v.as<float>(), b.argmax_i.as<int32_t>(), b.next_dev.as<int32_t>(),
                       stream_);
  }

  // ---- batched prefill (default; LILY_CUDA_PREFILL=per-token replays the decode graph) ---------

  // Chunks of up to prefill_chunk_ tokens; every layer runs over all rows of a chunk: the
  // projections as tensor-core GEMMs (prefill_project), the mixer's chunked GDN prefill and
  // causal flash attention, the router GEMM and the grouped expert GEMMs. Only the last prompt
  // row goes through the final norm, lm_head and argmax (docs/model.md §4.4). A test that
  // installs a probe sink selects the per-token path instead (docs/cuda.md).

  /// Prefill projection y[T, w.rows] = x[T, w.cols]·Wᵀ (bf16 out) on the selected path.
  void prefill_project(const DeviceQuant& w, const bf16* x, int T, bf16* y) {
    if (tensor_core_gemm_) launch_quant_gemm(w, x, T, y, nullptr, stream_);
    else launch_quant_gemv_batched(w, x, T, y, nullptr, stream_);
  }

  /// Routed + shared experts of a chunk (ids/weights from the router already in p): per-row
  /// kernels, or with the tensor-core path: group the assignments by expert, grouped gate/up +
  /// SwiGLU, grouped down into per-slot rows, slot-order fp32 combine (deterministic).
  void prefill_experts(const DeviceLayer& lw, int T) {
    const ModelConfig& c = config();
    PrefillScratch& p = *prefill_scratch_;
    const int n_sel = routed_plus_shared_slots(c.n_experts_per_tok), n_groups = routed_plus_shared_experts(c.n_experts);
    if (!tensor_core_gemm_) {
      launch_expert_gate_up(lw.gate, lw.up, c.moe_ffn_dim, p.ids.as<int32_t>(), n_sel, p.normed.as<bf16>(), T,
                            p.act.as<bf16>(), stream_);
      launch_expert_down_combine(lw.down, c.hidden, p.ids.as<int32_t>(), p.weights.as<float>(), n_sel,
                                 p.act.as<bf16>(), T, p.moe.as<bf16>(), stream_);
      return;
    }
    int32_t* grouping = p.grouping.as<int32_t>();
    launch_expert_grouping(p.ids.as<int32_t>(), T, n_sel, n_groups, grouping, stream_);
    launch_quant_gemm_grouped_gate_up(lw.gate, lw.up, c.moe_ffn_dim, grouping, n_groups, p.normed.as<bf16>(), T, n_sel,
                                      p.act.as<bf16>(), stream_);
    launch_quant_gemm_grouped_down(lw.down, c.hidden, grouping, n_groups, p.act.as<bf16>(), T, n_sel,
                                   p.slot_out.as<bf16>(), stream_);
    launch_expert_combine(p.slot_out.as<bf16>(), p.weights.as<float>(), T, n_sel, c.hidden, p.moe.as<bf16>(), stream_);
  }

  struct PrefillScratch {
    DeviceBuffer tokens, x, normed, branch, moe, proj, conv, mix, q, router, ids, weights, act;
    DeviceBuffer grouping, slot_out;  ///< tensor-core MoE only: expert grouping, per-slot down outputs
    DeviceBuffer gdn_ws;              ///< two-pass GDN prefill only (LILY_CUDA_GDN_CHUNK_PARALLEL)
  };

  void allocate_prefill_scratch() {
    if (prefill_scratch_) return;
    const ModelConfig& c = config();
    const int64_t T = prefill_chunk_;
    auto bf = [](int64_t n) { return DeviceBuffer(std::max<int64_t>(n, 1) * sizeof(bf16)); };
    prefill_scratch_ = std::make_unique<PrefillScratch>();
    prefill_scratch_->tokens = DeviceBuffer(T * sizeof(int32_t));
    prefill_scratch_->x = bf(T * c.hidden);
    prefill_scratch_->normed = bf(T * c.hidden);
    prefill_scratch_->branch = bf(T * c.hidden);
    prefill_scratch_->moe = bf(T * c.hidden);
    prefill_scratch_->proj = bf(T * static_cast<int64_t>(proj_.bytes() / sizeof(bf16)));
    prefill_scratch_->conv = bf(T * (n_gdn_ ? gdn_.conv_channels() : 1));
    prefill_scratch_->mix = bf(T * static_cast<int64_t>(mixer_core_out_.bytes() / sizeof(bf16)));
    prefill_scratch_->q = bf(T * int64_t(attn_.n_heads) * attn_.head_dim);
    prefill_scratch_->router = DeviceBuffer(T * routed_plus_shared_experts(c.n_experts) * sizeof(float));
    prefill_scratch_->ids = DeviceBuffer(T * routed_plus_shared_slots(c.n_experts_per_tok) * sizeof(int32_t));
    prefill_scratch_->weights = DeviceBuffer(T * routed_plus_shared_slots(c.n_experts_per_tok) * sizeof(float));
    prefill_scratch_->act = bf(T * int64_t(routed_plus_shared_slots(c.n_experts_per_tok)) * c.moe_ffn_dim);
    if (tensor_core_gemm_) {
      const int n_sel = routed_plus_shared_slots(c.n_experts_per_tok);
      prefill_scratch_->grouping =
          DeviceBuffer(expert_grouping_ints(routed_plus_shared_experts(c.n_experts), prefill_chunk_, n_sel) * sizeof(int32_t));
      prefill_scratch_->slot_out = bf(T * int64_t(n_sel) * c.hidden);
    }
    if (n_gdn_ && options_.gdn_chunk_parallel)
      prefill_scratch_->gdn_ws = DeviceBuffer(gdn_prefill_workspace_bytes(gdn_, static_cast<int>(T)));
  }

  int32_t prefill_batched(CudaState& s, std::span<const int32_t> tokens, std::vector<float>* logits,
                          const RowSampling* sampling) {
    allocate_prefill_scratch();
    s.reserve(s.pos + static_cast<int64_t>(tokens.size()), stream_);
    int T = 0;
    for (size_t first = 0; first < tokens.size(); first += prefill_chunk_) {
      T = static_cast<int>(std::min<size_t>(prefill_chunk_, tokens.size() - first));
      CUDA_CHECK(cudaMemcpyAsync(prefill_scratch_->tokens.data(), tokens.data() + first, T * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream_));
      const PrefillSlice whole{&s, 0, T};
      prefill_chunk(std::span<const PrefillSlice>(&whole, 1), T);
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host token buffer may go away
      s.pos += T;
    }
    return prefill_head(T - 1, logits, sampling);
  }

  /// The prefill rows `group` of `rows` (one each of ≥ 2 sequences, Σ tokens ≤ prefill_chunk_)
  /// as one chunk (CudaOptions::prefill_rows): their tokens side by side, so the projections,
  /// the router and the experts run once over all of them (each expert's weights read once for
  /// the rows of every sequence routed to it), and each sequence's GDN and attention run over its
  /// own slice with its own state. Every prefill kernel computes a token row from that row alone,
  /// in an order fixed by the shape, so each sequence gets the bits of its prefill alone. Then
  /// the head of each row that wants logits, into next.
  void prefill_rows(std::span<const StepRow> rows, std::span<const size_t> group, std::vector<int32_t>& next) {
    allocate_prefill_scratch();
    std::vector<PrefillSlice> slices;
    int T = 0;
    for (size_t i : group) {
      CudaState& s = checked(*rows[i].state);
      const int n = static_cast<int>(rows[i].tokens.size());
      s.reserve(s.pos + n, stream_);
      CUDA_CHECK(cudaMemcpyAsync(prefill_scratch_->tokens.as<int32_t>() + T, rows[i].tokens.data(),
                                 n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
      slices.push_back({&s, T, n});
      T += n;
    }
    prefill_chunk(slices, T);
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host token buffers may go away
    // Every position first: a head that throws leaves no state ahead of its position.
    for (const PrefillSlice& q : slices) q.state->pos += q.tokens;
    for (size_t k = 0; k < group.size(); ++k) {
      const StepRow& r = rows[group[k]];
      if (!r.want_logits) continue;
      const RowSampling* sampling = r.sampling.params ? &r.sampling : nullptr;
      next[group[k]] = prefill_head(slices[k].first + slices[k].tokens - 1, r.logits, sampling);
    }
  }

  /// Whether a token's prefill bits are the same in a chunk of any token count, which prefill_rows
  /// needs: the tensor-core GEMMs (their items' widths never change a column's bits) with an 8-bit
  /// router on its GEMM in every layer, and not LILY_CUDA_GEMM_KERNEL=all (its dense GEMMs take
  /// the register-dequant or the shared-tile kernel by the token count, which round differently).
  /// The GEMV path (LILY_CUDA_GEMM=gemv) picks its kernel by the token count too.
  bool prefill_rows_keep_bits() const {
    return tensor_core_gemm_ && routers_on_gemm_ && gemm_kernel() != GemmKernel::kAll;
  }

  /// The LM head on row `row` of the last prefill chunk, with decode numerics: final norm, logits,
  /// argmax (or the device sampler); the next token, and the logits into `logits` when non-null.
  int32_t prefill_head(int64_t row, std::vector<float>* logits, const RowSampling* sampling) {
    const ModelConfig& c = config();
    const int64_t at = row * c.hidden;
    launch_add_rmsnorm(prefill_scratch_->x.as<bf16>() + at, prefill_scratch_->moe.as<bf16>() + at,
                       model_->final_norm, normed_.as<bf16>(), 1, c.hidden, c.rms_norm_eps, stream_);
    launch_quant_gemv(model_->lm_head, normed_.as<bf16>(), nullptr, logits_.as<float>(), stream_);
    launch_argmax(logits_.as<float>(), c.vocab, argmax_v_.as<float>(), argmax_i_.as<int32_t>(),
                  io_dev_.as<int32_t>() + kIoNextId, stream_);
    if (sampling) {
      upload_sampling(*sampling);
      enqueue_sampler();
    }
    int32_t next = 0;
    CUDA_CHECK(cudaMemcpyAsync(&next, io_dev_.as<int32_t>() + kIoNextId, sizeof(int32_t), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (logits) {
      logits->resize(c.vocab);
      download(logits->data(), logits_.as<float>(), logits->size());
    }
    return next;
  }

  /// One sequence's rows in a prefill chunk: rows [first, first + tokens) of the chunk's
  /// buffers, at the sequence's position state->pos.
  struct PrefillSlice {
    CudaState* state = nullptr;
    int first = 0, tokens = 0;
  };

  /// One prefill chunk of T token rows (≤ prefill_chunk_, tokens already in the scratch), the
  /// slices' sequences side by side: the row-wise parts over all T rows, the mixers per slice.
  /// Leaves each token's last residual and MoE output in x and moe; the caller advances the
  /// positions.
  void prefill_chunk(std::span<const PrefillSlice> slices, int T) {
    const ModelConfig& c = config();
    PrefillScratch& p = *prefill_scratch_;
    const int k = c.n_experts_per_tok;
    launch_embed(model_->embed, p.tokens.as<int32_t>(), T, p.x.as<bf16>(), stream_);
    for (int l = 0; l < c.n_layers; ++l) {
      const DeviceLayer& lw = model_->layers[l];  // the layer's device weights
      launch_add_rmsnorm(p.x.as<bf16>(), l == 0 ? nullptr : p.moe.as<bf16>(), lw.input_norm, p.normed.as<bf16>(), T,
                         c.hidden, c.rms_norm_eps, stream_);
      bf16* proj = p.proj.as<bf16>();
      if (lw.type == LayerType::kLinearAttention) {
        const int slot = layer_slot_[l];
        const int C = gdn_.conv_channels(), Vd = gdn_.value_dim(), Hv = gdn_.n_value_heads;
        const int64_t proj_stride = lw.in_proj.rows;
        prefill_project(lw.in_proj, p.normed.as<bf16>(), T, proj);
        for (const PrefillSlice& q : slices) {
          bf16* pj = proj + q.first * proj_stride;
          bf16* conv = p.conv.as<bf16>() + int64_t{q.first} * C;
          gdn_conv_prefill(gdn_, lw.gdn, q.tokens, pj, proj_stride, q.state->window(slot), conv, stream_);
          gdn_prefill(gdn_, lw.gdn, q.tokens, conv, pj + C, pj + C + Vd, pj + C + Vd + Hv, proj_stride,
                      q.state->state(slot), p.mix.as<bf16>() + int64_t{q.first} * Vd, stream_,
                      p.gdn_ws.bytes() ? p.gdn_ws.as<float>() : nullptr, p.gdn_ws.bytes());
        }
        prefill_project(lw.out_proj, p.mix.as<bf16>(), T, p.branch.as<bf16>());
      } else {
        const int64_t proj_stride = lw.in_proj.rows;
        const int64_t qg = int64_t(attn_.n_heads) * 2 * attn_.head_dim,
                      kvw = int64_t(attn_.n_kv_heads) * attn_.head_dim, qw = int64_t(attn_.n_heads) * attn_.head_dim;
        prefill_project(lw.in_proj, p.normed.as<bf16>(), T, proj);
        for (const PrefillSlice& q : slices) {
          const KvCacheView kv = q.state->kv(layer_slot_[l]);
          bf16* pj = proj + q.first * proj_stride;
          bf16* qs = p.q.as<bf16>() + q.first * qw;
          attention_prepare(attn_, q.tokens, pj, proj_stride, pj + qg, pj + qg + kvw, proj_stride, lw.q_norm,
                            lw.k_norm, q.state->pos, nullptr, kv, qs, stream_);
          attention_prefill(attn_, q.tokens, q.state->pos, qs, pj, proj_stride, kv, p.mix.as<bf16>() + q.first * qw,
                            stream_);
        }
        prefill_project(lw.out_proj, p.mix.as<bf16>(), T, p.branch.as<bf16>());
      }
      launch_add_rmsnorm(p.x.as<bf16>(), p.branch.as<bf16>(), lw.post_norm, p.normed.as<bf16>(), T, c.hidden,
                         c.rms_norm_eps, stream_);
      // fp32 router logits with the GEMV's affine formula on both paths; on the tensor-core path
      // (8-bit router) as a GEMM over the chunk's tokens, else as the token-tiled GEMV.
      if (tensor_core_gemm_ && router_gemm_supported(lw.router))
        launch_router_gemm(lw.router, p.normed.as<bf16>(), T, p.router.as<float>(), stream_);
      else
        launch_quant_gemv_batched(lw.router, p.normed.as<bf16>(), T, nullptr, p.router.as<float>(), stream_);
      launch_router_topk(p.router.as<float>(), T, c.n_experts, k, p.ids.as<int32_t>(), p.weights.as<float>(), stream_);
      prefill_experts(lw, T);
    }
  }

  // ---- probes --------------------------------------------------------------------------------

  void emit(const char* name, int layer, int64_t token, const bf16* d, int64_t n) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<uint16_t> raw(n);
    download(raw.data(), reinterpret_cast<const uint16_t*>(d), n);
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = bf16_to_float(raw[i]);
    probe_sink_(name, layer, token, v);
  }
  void emit_f32(const char* name, int layer, int64_t token, const float* d, int64_t n) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<float> v(n);
    download(v.data(), d, n);
    probe_sink_(name, layer, token, v);
  }

  ModelConfig config_;            ///< a copy: the host weights are not kept after the upload
  const CudaOptions options_;  ///< the paths this backend runs (engine/backend.h)
  GdnDims gdn_;
  AttnDims attn_;
  int n_gdn_ = 0, n_attn_ = 0;
  std::vector<int> layer_slot_;  ///< per layer: index among GDN layers or among attention layers
  std::unique_ptr<DeviceModel> model_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  ///< copy_to_host of device states only (a helper thread's)
  std::unique_ptr<PinnedIo> io_;  ///< created after the device check
  /// Where sequence states (device) and their host copies (pinned) take their memory; shared
  /// with the states, which may outlive the backend.
  std::shared_ptr<BlockPool> device_pool_ = make_device_pool();
  std::shared_ptr<SlabArena> pinned_arena_ = make_pinned_arena();
  /// The decode graphs of all states: one exec per key per row that a step may hold, and a
  /// few keys (KV capacity buckets, greedy / sampled) besides.
  DecodeGraphs graphs_{options_.max_batch, std::max(8, 2 * options_.max_batch)};
  DeviceBuffer x_alt_;  ///< the decode step's second residual buffer (FusedNorm ping-pong with x_)
  /// mixer_core_out_: the mixer's output before its out projection (GDN: gated-normed values
  /// [value_dim]; attention: gated heads [n_heads · head_dim]).
  DeviceBuffer x_, normed_, mixer_out_, moe_out_, proj_, conv_out_, mixer_core_out_, q_out_, act_;
  DeviceBuffer router_done_;  ///< launch_router_fused's block counter (uint32, kept zero between launches)
  /// launch_moe_block_decode's grid barriers: uint32 [n_layers][kMoeBarriersPerLayer], zeroed at
  /// the start of every decode step.
  DeviceBuffer moe_barriers_;
  DeviceBuffer router_logits_, expert_ids_, expert_w_, logits_, argmax_v_, argmax_i_, io_dev_, attn_ws_;
  /// The device sampler's scratch (work / weight: [vocab] fp32), its one row of arguments, and
  /// the row's penalty edits (grown on demand; capacities in elements).
  DeviceBuffer sample_work_, sample_weight_, sample_parts_, sample_args_, sample_edits_, sample_biases_;
  size_t sample_edits_cap_ = 0, sample_biases_cap_ = 0;
  SampleRowArgs sample_host_;
  size_t attn_ws_bytes_ = 0;
  bool batched_prefill_ = options_.batched_prefill;    ///< false: the decode graph per prompt token
  bool fuse_decode_ = options_.fuse_decode;            ///< false: separate norm / conv / top-k kernels
  bool fused_moe_ = false;  ///< the decode MoE block in one launch (options_.fused_moe, when supported)
  /// The batched decode's MoE block in one launch (launch_moe_block_rows): fused_moe_ and
  /// supported at kMaxMoeRows rows (decided once, so every batch size, 1 included, takes the
  /// same arithmetic).
  bool batched_fused_moe_ = false;
  /// The one-sequence decode's out-projections inside the fused MoE block (options_.moe_out_proj,
  /// when every layer's shape allows it).
  bool moe_out_proj_ = false;
  /// The one-sequence decode's input norms staged once by the fused MoE block before them
  /// (options_.moe_next_norm, when every layer's shapes allow it).
  bool moe_next_norm_ = false;
  /// CudaOptions::rows_gemv_norm (with stream_gemv): the batched step's input norms fused into
  /// the in-projections where launch_add_rmsnorm_gemv_rows takes the rows.
  bool rows_gemv_norm_ = false;
  /// The row the MoE block stages for the next GEMV (staged_row()): uint32 [hidden / 2], fp32
  /// [hidden / 64].
  DeviceBuffer staged_pairs_, staged_sums_;
  /// Every layer's router runs on its GEMM in prefill (router_gemm_supported; decided once, at
  /// construction, for prefill_rows_keep_bits).
  bool routers_on_gemm_ = false;
  std::unique_ptr<PrefillScratch> prefill_scratch_;                ///< allocated at the first batched prefill
  bool tensor_core_gemm_ = options_.tensor_core_gemm;  ///< prefill projections and experts (prefill_project)
  int prefill_chunk_ = options_.prefill_chunk;         ///< tokens per prefill chunk
  bool batched_decode_ = options_.batched_decode;      ///< decode rows through decode_batch
  std::unique_ptr<BatchScratch> batch_;                ///< allocated at the first batched step
  /// The batched steps' graphs: one exec per key (rows, sampled rows, largest split count, PDL),
  /// shared by all rows (kBatchGraphLayout); the least recently used is updated past the bound.
  DecodeGraphs batch_graphs_{1, 4 * kMaxDecodeRows};
  /// The persistent decode kernel (options_.persistent_decode "1" or "debug"), its grain, its
  /// own buffers (the splits' partials, the LM head parts' bests, the layers' weights and state
  /// as DecodeTaskLayer [n_layers]) and the state blocks the last layer upload named.
  std::unique_ptr<DecodeMegakernel> persistent_;
  DecodeCut persistent_grain_;
  DeviceBuffer persistent_trace_;  ///< persistent_decode "trace": uint64 [tasks][kDecodeTraceFields]
  int64_t persistent_traced_steps_ = 0;
  DeviceBuffer persistent_attn_part_, persistent_best_value_, persistent_best_id_, persistent_layers_;
  std::vector<const void*> persistent_layers_key_;
};

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const ModelWeights> weights, const CudaOptions& options) {
  return std::make_unique<cuda::CudaBackend>(std::move(weights), options);
}

int64_t cuda_max_sequence() { return cuda::kMaxSeq; }

}  // namespace lily
