// The decode step as a task list, and its deadlock and race check (decode_program.h).
#include "backends/cuda/decode_program.h"

#include <algorithm>
#include <climits>
#include <map>
#include <utility>

#include "backends/cuda/kernels.h"
#include "base/error.h"

namespace lily::cuda {

const char* decode_task_kind_name(DecodeTaskKind kind) {
  switch (kind) {
    case DecodeTaskKind::kEmbed: return "embed";
    case DecodeTaskKind::kInProj: return "in_proj";
    case DecodeTaskKind::kGdnHeads: return "gdn_heads";
    case DecodeTaskKind::kAttnPrepare: return "attn_prepare";
    case DecodeTaskKind::kAttnSplit: return "attn_split";
    case DecodeTaskKind::kAttnCombine: return "attn_combine";
    case DecodeTaskKind::kOutProj: return "out_proj";
    case DecodeTaskKind::kRouter: return "router";
    case DecodeTaskKind::kExpertGateUp: return "expert_gate_up";
    case DecodeTaskKind::kExpertDown: return "expert_down";
    case DecodeTaskKind::kLmHead: return "lm_head";
    case DecodeTaskKind::kArgmax: return "argmax";
  }
  return "?";
}

const char* decode_buffer_name(DecodeBuffer buffer) {
  switch (buffer) {
    case DecodeBuffer::kResidual: return "residual";
    case DecodeBuffer::kMid: return "mid";
    case DecodeBuffer::kProj: return "proj";
    case DecodeBuffer::kQuery: return "query";
    case DecodeBuffer::kAttnPart: return "attn_part";
    case DecodeBuffer::kMix: return "mix";
    case DecodeBuffer::kMixerOut: return "mixer_out";
    case DecodeBuffer::kMoeNormed: return "moe_normed";
    case DecodeBuffer::kRouterLogits: return "router_logits";
    case DecodeBuffer::kAct: return "act";
    case DecodeBuffer::kMoeOut: return "moe_out";
    case DecodeBuffer::kConvWindow: return "conv_window";
    case DecodeBuffer::kGdnState: return "gdn_state";
    case DecodeBuffer::kKvCache: return "kv_cache";
    case DecodeBuffer::kLogits: return "logits";
    case DecodeBuffer::kNextToken: return "next_token";
  }
  return "?";
}

namespace {

/// Bytes of `rows` rows of a `bits`-bit matrix of `cols` columns: the codes, then a bf16 scale
/// and bias per 64-group.
int64_t quant_bytes(int64_t rows, int64_t cols, int bits) {
  return rows * (cols * bits / 8 + cols / kQuantGroupSize * 4);  // codes, then a bf16 scale and bias a group
}

/// Appends tasks to a program, with one counter per stage.
class ProgramBuilder {
 public:
  /// A new counter named `name`; its producers are the tasks that name it in add().
  int32_t counter(std::string name) {
    program_.counter_names.push_back(std::move(name));
    producers_.push_back(0);
    return static_cast<int32_t>(program_.counter_names.size() - 1);
  }

  /// A wait for every producer added to `c` so far (so all of them, if called after them).
  DecodeWait all_of(int32_t c) const { return DecodeWait{c, producers_[static_cast<size_t>(c)]}; }

  /// Appends a task signalling `signal` (-1: none).
  void add(DecodeTaskKind kind, int layer, int part, std::vector<DecodeWait> waits, int32_t signal,
           std::vector<DecodeAccess> accesses, int64_t weight_bytes, int64_t state_bytes = 0) {
    if (signal >= 0) ++producers_[static_cast<size_t>(signal)];
    program_.tasks.push_back(
        DecodeTask{kind, layer, part, std::move(waits), signal, std::move(accesses), weight_bytes, state_bytes});
  }

  DecodeProgram take() { return std::move(program_); }

 private:
  DecodeProgram program_;
  std::vector<int32_t> producers_;
};

DecodeAccess reads(DecodeBuffer b, int64_t begin, int64_t end, int instance = 0) {
  return DecodeAccess{b, instance, begin, end, false};
}
DecodeAccess writes(DecodeBuffer b, int64_t begin, int64_t end, int instance = 0) {
  return DecodeAccess{b, instance, begin, end, true};
}

void check_grain(const DecodeGrain& g) {
  for (const auto& [name, rows] : {std::pair{"proj_rows", g.proj_rows}, std::pair{"out_rows", g.out_rows},
                                   std::pair{"expert_rows", g.expert_rows}, std::pair{"down_rows", g.down_rows},
                                   std::pair{"lm_rows", g.lm_rows}, std::pair{"router_rows", g.router_rows}})
    if (rows <= 0 || rows % 16 != 0)
      throw Error(std::string("decode program: ") + name + " " + std::to_string(rows) +
                  " must be a positive multiple of 16 (the MMA tile's rows)");
  if (g.attn_splits <= 0) throw Error("decode program: attn_splits must be positive");
  if (g.router_bits != 4 && g.router_bits != 8) throw Error("decode program: router_bits must be 4 or 8");
  if (g.kv_capacity <= 0 || g.position < 0 || g.position >= g.kv_capacity)
    throw Error("decode program: position " + std::to_string(g.position) + " outside the KV capacity " +
                std::to_string(g.kv_capacity));
}

/// Calls f(part, begin, end) for the row ranges of `rows` rows cut every `per`.
template <class F>
void for_row_ranges(int64_t rows, int64_t per, F f) {
  for (int64_t b = 0, part = 0; b < rows; b += per, ++part) f(static_cast<int>(part), b, std::min(rows, b + per));
}

}  // namespace

DecodeProgram build_decode_program(const ModelConfig& c, const DecodeGrain& g) {
  check_grain(g);
  ProgramBuilder pb;
  const int64_t H = c.hidden, k = c.n_experts_per_tok, ffn = c.moe_ffn_dim;
  const int64_t slots = routed_plus_shared_slots(static_cast<int>(k));  // the k routed experts, then the shared expert
  const int64_t act_width = k * ffn + c.shared_ffn_dim;
  const int64_t mix_gdn = c.gdn_value_dim(), mix_attn = int64_t{c.n_heads} * c.head_dim;
  const int64_t gdn_in_rows = c.gdn_conv_channels() + c.gdn_value_dim() + 2 * int64_t{c.gdn_n_value_heads};
  const int64_t attn_q_rows = int64_t{c.n_heads} * 2 * c.head_dim, kv_rows = int64_t{c.n_kv_heads} * c.head_dim;
  const int64_t attn_in_rows = attn_q_rows + 2 * kv_rows;
  const int64_t len = g.position + 1;
  using K = DecodeTaskKind;
  using B = DecodeBuffer;

  const int32_t embedded = pb.counter("embed");
  pb.add(K::kEmbed, -1, 0, {}, embedded, {writes(B::kResidual, 0, H)}, quant_bytes(1, H, 4));
  // The counter that orders a layer's first stage after the last layer: its MoE output (the
  // down rows), which every chain of the layer before ends in.
  int32_t layer_input = embedded;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string at = "[" + std::to_string(l) + "]";
    const bool gdn = !c.is_full_attention(l);
    const int64_t in_rows = gdn ? gdn_in_rows : attn_in_rows, mix = gdn ? mix_gdn : mix_attn;
    // In-projection rows: each task norms the layer input itself (the residual after the last
    // layer's MoE: mid + moe_out, or the embedding); the first task stores it for the router.
    const int32_t projected = pb.counter("in_proj" + at);
    const DecodeWait input = pb.all_of(layer_input);
    for_row_ranges(in_rows, g.proj_rows, [&](int part, int64_t r0, int64_t r1) {
      std::vector<DecodeAccess> acc = {writes(B::kProj, r0, r1)};
      if (l == 0) acc.push_back(reads(B::kResidual, 0, H));
      else acc.insert(acc.end(), {reads(B::kMid, 0, H), reads(B::kMoeOut, 0, H)});
      if (part == 0 && l > 0) acc.push_back(writes(B::kResidual, 0, H));
      pb.add(K::kInProj, l, part, {input}, projected, std::move(acc), quant_bytes(r1 - r0, H, 4));
    });
    const int32_t mixed = pb.counter("mix" + at);
    if (gdn) {
      // One task per key head: its q and k conv channels are shared by its value heads, so the
      // conv window's update of those channels has one writer.
      const int64_t Dk = c.gdn_key_head_dim, Dv = c.gdn_value_head_dim, Hk = c.gdn_n_key_heads;
      const int64_t per_key = c.gdn_n_value_heads / Hk, state = Dk * Dv;
      // Read and written: the value heads' fp32 states, the bf16 conv window (K − 1 taps) of
      // the key head's q and k channels and of the value heads' v channels.
      const int64_t state_bytes =
          2 * (per_key * state * 4 + int64_t{c.gdn_conv_kernel - 1} * (2 * Dk + per_key * Dv) * 2);
      for (int64_t kh = 0; kh < Hk; ++kh) {
        const int64_t v0 = kh * per_key, v1 = v0 + per_key, key_dim = Hk * Dk;
        pb.add(K::kGdnHeads, l, static_cast<int>(kh), {pb.all_of(projected)}, mixed,
               {reads(B::kProj, 0, in_rows), writes(B::kConvWindow, kh * Dk, (kh + 1) * Dk, l),
                writes(B::kConvWindow, key_dim + kh * Dk, key_dim + (kh + 1) * Dk, l),
                writes(B::kConvWindow, 2 * key_dim + v0 * Dv, 2 * key_dim + v1 * Dv, l),
                writes(B::kGdnState, v0 * state, v1 * state, l), writes(B::kMix, v0 * Dv, v1 * Dv)},
               0, state_bytes);
      }
    } else {
      // Per KV head: prepare (its query heads and its key; K/V appended at the position), the
      // splits of its keys, the combine (with the output gate from the projection).
      const int64_t D = c.head_dim, q_per_kv = c.n_heads / c.n_kv_heads, cap = g.kv_capacity;
      const int32_t prepared = pb.counter("attn_prepare" + at), split = pb.counter("attn_split" + at);
      for (int64_t h = 0; h < c.n_kv_heads; ++h)
        pb.add(K::kAttnPrepare, l, static_cast<int>(h), {pb.all_of(projected)}, prepared,
               {reads(B::kProj, 0, in_rows), writes(B::kQuery, h * q_per_kv * D, (h + 1) * q_per_kv * D),
                writes(B::kKvCache, h * cap + g.position, h * cap + g.position + 1, l)},
               0, 2 * D * 2);  // the new K and V rows
      for (int64_t h = 0; h < c.n_kv_heads; ++h)
        for (int s = 0; s < g.attn_splits; ++s) {
          const int64_t k0 = len * s / g.attn_splits, k1 = len * (s + 1) / g.attn_splits;
          if (k0 == k1) continue;  // fewer keys than splits
          const int64_t slot = h * g.attn_splits + s;
          pb.add(K::kAttnSplit, l, static_cast<int>(slot), {pb.all_of(prepared)}, split,
                 {reads(B::kQuery, h * q_per_kv * D, (h + 1) * q_per_kv * D),
                  reads(B::kKvCache, h * cap + k0, h * cap + k1, l), writes(B::kAttnPart, slot, slot + 1)},
                 0, 2 * (k1 - k0) * D * 2);  // its keys' K and V rows
        }
      for (int64_t h = 0; h < c.n_kv_heads; ++h)
        pb.add(K::kAttnCombine, l, static_cast<int>(h), {pb.all_of(split)}, mixed,
               {reads(B::kAttnPart, h * g.attn_splits, (h + 1) * g.attn_splits), reads(B::kProj, 0, attn_q_rows),
                writes(B::kMix, h * q_per_kv * D, (h + 1) * q_per_kv * D)},
               0);
    }
    const int32_t out = pb.counter("out_proj" + at);
    for_row_ranges(H, g.out_rows, [&](int part, int64_t r0, int64_t r1) {
      pb.add(K::kOutProj, l, part, {pb.all_of(mixed)}, out, {reads(B::kMix, 0, mix), writes(B::kMixerOut, r0, r1)},
             quant_bytes(r1 - r0, mix, 4));
    });
    // The MoE: the router rows (each task forms mid = residual + mixer out and its norm; the
    // first stores both), the slots' gate/up rows, the down rows of every slot combined; the
    // expert tasks take the top-k from the logits themselves.
    const int32_t routed = pb.counter("router" + at);
    const int64_t router_rows = routed_plus_shared_experts(c.n_experts);  // the router's E rows, then the shared expert's gate
    for_row_ranges(router_rows, g.router_rows, [&](int part, int64_t r0, int64_t r1) {
      std::vector<DecodeAccess> acc = {reads(B::kResidual, 0, H), reads(B::kMixerOut, 0, H),
                                       writes(B::kRouterLogits, r0, r1)};
      if (part == 0) acc.insert(acc.end(), {writes(B::kMid, 0, H), writes(B::kMoeNormed, 0, H)});
      pb.add(K::kRouter, l, part, {pb.all_of(out)}, routed, std::move(acc), quant_bytes(r1 - r0, H, g.router_bits));
    });
    const int32_t gated = pb.counter("expert_gate_up" + at);
    int gate_up_part = 0;  // the layer's gate/up tasks, slot after slot
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t width = s < k ? ffn : c.shared_ffn_dim, first = s * ffn;
      for_row_ranges(width, g.expert_rows, [&](int, int64_t r0, int64_t r1) {
        pb.add(K::kExpertGateUp, l, gate_up_part++, {pb.all_of(routed)}, gated,
               {reads(B::kRouterLogits, 0, router_rows), reads(B::kMoeNormed, 0, H),
                writes(B::kAct, first + r0, first + r1)},
               2 * quant_bytes(r1 - r0, H, 4));
      });
    }
    const int32_t down = pb.counter("expert_down" + at);
    for_row_ranges(H, g.down_rows, [&](int part, int64_t r0, int64_t r1) {
      pb.add(K::kExpertDown, l, part, {pb.all_of(gated)}, down,
             {reads(B::kRouterLogits, 0, router_rows), reads(B::kAct, 0, act_width), writes(B::kMoeOut, r0, r1)},
             k * quant_bytes(r1 - r0, ffn, 4) + quant_bytes(r1 - r0, c.shared_ffn_dim, 4));
    });
    layer_input = down;
  }
  // The head: every task norms mid + moe_out itself; the argmax over all the logits.
  const int32_t logits = pb.counter("lm_head");
  const DecodeWait last = pb.all_of(layer_input);
  for_row_ranges(c.vocab, g.lm_rows, [&](int part, int64_t r0, int64_t r1) {
    pb.add(K::kLmHead, -1, part, {last}, logits,
           {reads(B::kMid, 0, H), reads(B::kMoeOut, 0, H), writes(B::kLogits, r0, r1)}, quant_bytes(r1 - r0, H, 4));
  });
  const int32_t done = pb.counter("argmax");
  pb.add(K::kArgmax, -1, 0, {pb.all_of(logits)}, done, {reads(B::kLogits, 0, c.vocab), writes(B::kNextToken, 0, 1)}, 0);
  return pb.take();
}

DecodeProgramImage flatten_decode_program(const DecodeProgram& p) {
  DecodeProgramImage img;
  img.n_counters = static_cast<int32_t>(p.counter_names.size());
  // Each (buffer, instance)'s span: as long as its largest end, in order of first use.
  std::map<std::pair<int, int32_t>, int64_t> extent, base;
  std::vector<std::pair<int, int32_t>> order;
  for (const DecodeTask& t : p.tasks)
    for (const DecodeAccess& a : t.accesses) {
      const std::pair<int, int32_t> key{static_cast<int>(a.buffer), a.instance};
      auto [it, fresh] = extent.try_emplace(key, 0);
      if (fresh) order.push_back(key);
      it->second = std::max(it->second, a.end);
    }
  for (const auto& key : order) {
    base[key] = img.arena_elements;
    img.arena_elements += extent[key];
  }
  for (const DecodeTask& t : p.tasks) {
    if (t.waits.size() > static_cast<size_t>(DecodeProgramImage::kMaxWaits))
      throw Error(std::string("decode program: a ") + decode_task_kind_name(t.kind) + " task waits on " +
                  std::to_string(t.waits.size()) + " counters; the device takes " +
                  std::to_string(DecodeProgramImage::kMaxWaits));
    if (img.accesses.size() + t.accesses.size() > static_cast<size_t>(INT32_MAX))
      throw Error("decode program: too many accesses");
    DecodeProgramImage::Task d{};
    for (int w = 0; w < DecodeProgramImage::kMaxWaits; ++w) {
      const bool has = w < static_cast<int>(t.waits.size());
      d.wait_counter[w] = has ? t.waits[static_cast<size_t>(w)].counter : -1;
      d.wait_target[w] = has ? t.waits[static_cast<size_t>(w)].target : 0;
    }
    d.signal = t.signal;
    d.first_access = static_cast<int32_t>(img.accesses.size());
    d.n_accesses = static_cast<int32_t>(t.accesses.size());
    d.kind = static_cast<int32_t>(t.kind);
    d.layer = t.layer;
    d.part = t.part;
    for (const DecodeAccess& a : t.accesses) {
      if (a.begin < 0 || a.end <= a.begin)
        throw Error(std::string("decode program: a ") + decode_task_kind_name(t.kind) + " task touches the empty or "
                    "negative range [" + std::to_string(a.begin) + ", " + std::to_string(a.end) + ") of " +
                    decode_buffer_name(a.buffer));
      const int64_t b = base[{static_cast<int>(a.buffer), a.instance}];
      img.accesses.push_back({b + a.begin, b + a.end, a.write ? 1 : 0, 0});
    }
    img.tasks.push_back(d);
  }
  return img;
}

DecodeEstimate estimate_decode_program(const DecodeProgram& p, const DecodeCostModel& m) {
  if (m.blocks <= 0 || m.bytes_per_us <= 0 || m.task_overhead_us < 0 || m.sync_latency_us < 0 || m.lookahead < 0)
    throw Error("decode program estimate: blocks and bandwidth must be positive, overhead, latency and lookahead not "
                "negative");
  if (const std::string why = check_decode_program(p); !why.empty())
    throw Error("decode program estimate: the program is not safe to run: " + why);
  const size_t held = static_cast<size_t>(m.prefetch_weights ? 1 + m.lookahead : 1);
  struct Block {
    double loads_free = 0;        // when its last task's weights have streamed
    std::vector<double> finishes;  // its tasks' finish times, in order
  };
  std::vector<Block> blocks(static_cast<size_t>(m.blocks));
  // When block b can take a task: its loads are done and it holds fewer than `held` tasks.
  auto take_time = [&](const Block& b) {
    const double freed = b.finishes.size() >= held ? b.finishes[b.finishes.size() - held] : 0.0;
    return std::max(b.loads_free, freed);
  };
  std::vector<double> counter_ready(p.counter_names.size(), 0.0);  // last producer's finish + latency
  std::map<DecodeTaskKind, double> by_kind;
  DecodeEstimate e;
  for (const DecodeTask& t : p.tasks) {
    // The block that can take it first (the lowest index among equals).
    size_t bi = 0;
    for (size_t i = 1; i < blocks.size(); ++i)
      if (take_time(blocks[i]) < take_time(blocks[bi])) bi = i;
    Block& b = blocks[bi];
    const double taken = take_time(b);
    const double previous = b.finishes.empty() ? 0.0 : b.finishes.back();
    double ready = taken;
    for (const DecodeWait& w : t.waits) ready = std::max(ready, counter_ready[static_cast<size_t>(w.counter)]);
    const double weights = static_cast<double>(t.weight_bytes) / m.bytes_per_us;
    const double state = static_cast<double>(t.state_bytes) / m.bytes_per_us;
    double finish = 0;
    if (m.prefetch_weights) {
      b.loads_free = taken + weights;
      finish = std::max({b.loads_free, ready, previous}) + state + m.task_overhead_us;
    } else {
      finish = std::max(ready, previous) + weights + state + m.task_overhead_us;
      b.loads_free = finish;
    }
    b.finishes.push_back(finish);
    if (t.signal >= 0) {
      double& c = counter_ready[static_cast<size_t>(t.signal)];
      c = std::max(c, finish + m.sync_latency_us);
    }
    const double busy = weights + state + m.task_overhead_us;
    e.busy_us += busy;
    by_kind[t.kind] += busy;
    e.step_us = std::max(e.step_us, finish);
  }
  for (const auto& [kind, us] : by_kind) e.busy_by_kind.emplace_back(kind, us);
  return e;
}

namespace {

/// A set of task indices as bits.
class TaskSet {
 public:
  explicit TaskSet(size_t n = 0) : words_((n + 63) / 64, 0) {}
  void insert(size_t i) { words_[i / 64] |= uint64_t{1} << (i % 64); }
  bool contains(size_t i) const { return (words_[i / 64] >> (i % 64)) & 1u; }
  void merge(const TaskSet& o) {
    for (size_t w = 0; w < words_.size(); ++w) words_[w] |= o.words_[w];
  }

 private:
  std::vector<uint64_t> words_;
};

std::string describe(const DecodeProgram& p, size_t i) {
  const DecodeTask& t = p.tasks[i];
  std::string s = "task " + std::to_string(i) + " (" + decode_task_kind_name(t.kind);
  if (t.layer >= 0) s += ", layer " + std::to_string(t.layer);
  return s + ", part " + std::to_string(t.part) + ")";
}

std::string describe(const DecodeAccess& a) {
  const bool per_layer = a.buffer == DecodeBuffer::kConvWindow || a.buffer == DecodeBuffer::kGdnState ||
                         a.buffer == DecodeBuffer::kKvCache;
  return std::string(decode_buffer_name(a.buffer)) + (per_layer ? " of layer " + std::to_string(a.instance) : "") +
         "[" + std::to_string(a.begin) + ", " + std::to_string(a.end) + ")";
}

}  // namespace

std::string check_decode_program(const DecodeProgram& p) {
  const size_t n = p.tasks.size(), n_counters = p.counter_names.size();
  // Producers per counter, and the position of the last one.
  std::vector<int32_t> producers(n_counters, 0);
  std::vector<size_t> last_producer(n_counters, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t c = p.tasks[i].signal;
    if (c < -1 || c >= static_cast<int32_t>(n_counters)) return describe(p, i) + " signals counter " + std::to_string(c) + ", out of range";
    if (c >= 0) ++producers[static_cast<size_t>(c)], last_producer[static_cast<size_t>(c)] = i;
  }
  // Waits: in range, on every producer, after the last one in list order (no deadlock). The
  // tasks that happen before task i: the producers of its counters and what happens before them.
  std::vector<TaskSet> before(n, TaskSet(n));
  std::vector<TaskSet> through(n_counters, TaskSet(n));  // a counter's producers and their pasts
  for (size_t i = 0; i < n; ++i) {
    for (const DecodeWait& w : p.tasks[i].waits) {
      if (w.counter < 0 || w.counter >= static_cast<int32_t>(n_counters))
        return describe(p, i) + " waits on counter " + std::to_string(w.counter) + ", out of range";
      const size_t c = static_cast<size_t>(w.counter);
      const std::string name = "counter " + p.counter_names[c];
      if (producers[c] == 0) return describe(p, i) + " waits on " + name + ", which no task signals";
      if (w.target != producers[c])
        return describe(p, i) + " waits for " + std::to_string(w.target) + " signals of " + name + ", which has " +
               std::to_string(producers[c]) + " producers";
      if (last_producer[c] >= i)
        return describe(p, i) + " waits on " + name + " before its producer " + describe(p, last_producer[c]) +
               " in the list: a block holding it could wait forever";
      before[i].merge(through[c]);
    }
    for (const DecodeAccess& a : p.tasks[i].accesses)
      if (a.begin < 0 || a.end <= a.begin) return describe(p, i) + " touches an empty or negative range " + describe(a);
    if (const int32_t c = p.tasks[i].signal; c >= 0) {
      through[static_cast<size_t>(c)].merge(before[i]);
      through[static_cast<size_t>(c)].insert(i);
    }
  }
  // Races: per buffer instance, each pair of overlapping accesses with a write, in list order.
  struct Use {
    size_t task;
    const DecodeAccess* access;
  };
  std::map<std::pair<int, int32_t>, std::vector<Use>> uses;
  for (size_t i = 0; i < n; ++i)
    for (const DecodeAccess& a : p.tasks[i].accesses) uses[{static_cast<int>(a.buffer), a.instance}].push_back({i, &a});
  // Of all racing pairs, the one whose later task comes first in the list (then the earlier
  // one first): a missing wait also leaves the tasks after it unordered, and this names the
  // first of them rather than one of its consequences.
  std::pair<Use, Use> race{{n, nullptr}, {n, nullptr}};
  for (auto& [key, list] : uses) {
    // By range start, so that a use meets only the uses that start before it ends.
    std::sort(list.begin(), list.end(), [](const Use& x, const Use& y) { return x.access->begin < y.access->begin; });
    for (size_t x = 0; x < list.size(); ++x)
      for (size_t y = x + 1; y < list.size() && list[y].access->begin < list[x].access->end; ++y) {
        const Use& a = list[x];
        const Use& b = list[y];
        if (a.task == b.task || (!a.access->write && !b.access->write)) continue;
        const Use& first = a.task < b.task ? a : b;
        const Use& second = a.task < b.task ? b : a;
        if (!before[second.task].contains(first.task) &&
            std::pair(second.task, first.task) < std::pair(race.second.task, race.first.task))
          race = {first, second};
      }
  }
  if (race.second.access == nullptr) return "";
  const auto& [first, second] = race;
  return describe(p, second.task) + (second.access->write ? " writes " : " reads ") + describe(*second.access) +
         ", which " + describe(p, first.task) + (first.access->write ? " writes" : " reads") +
         ", with no chain of waits from the earlier to the later";
}

}  // namespace lily::cuda
