// The decode step's task list for a persistent kernel (backends/cuda/decode_program.h): the
// lists built for the real and the small shapes pass the deadlock and race check, cover every
// weight row once, and the check finds each kind of broken list. Host code only: no GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "backends/cuda/decode_program.h"
#include "base/error.h"
#include "model/config.h"
#include "support/test_support.h"

namespace lily::cuda {
namespace {


int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Bytes of `rows` rows of a `bits`-bit matrix of `cols` columns with bf16 scales and biases
/// per 64 columns.
int64_t matrix_bytes(int64_t rows, int64_t cols, int bits) { return rows * cols * bits / 8 + rows * (cols / 64) * 4; }

std::map<DecodeTaskKind, int64_t> count_kinds(const DecodeProgram& p) {
  std::map<DecodeTaskKind, int64_t> n;
  for (const DecodeTask& t : p.tasks) ++n[t.kind];
  return n;
}

/// The index of the first task of `kind` (in `layer`, -1: any).
size_t first_task(const DecodeProgram& p, DecodeTaskKind kind, int layer = -1) {
  for (size_t i = 0; i < p.tasks.size(); ++i)
    if (p.tasks[i].kind == kind && (layer < 0 || p.tasks[i].layer == layer)) return i;
  ADD_FAILURE() << "no " << decode_task_kind_name(kind) << " task";
  return 0;
}

void expect_problem(const DecodeProgram& p, std::initializer_list<const char*> words) {
  const std::string why = check_decode_program(p);
  ASSERT_FALSE(why.empty()) << "the check passed a broken list";
  for (const char* w : words) EXPECT_NE(why.find(w), std::string::npos) << "'" << w << "' not in: " << why;
}

TEST(DecodeProgram, TheRealShapeIsSafeAndCoversEveryWeightRowOnce) {
  const ModelConfig c = test::synth_preset_config("35b-a3b");
  ASSERT_TRUE(c.is_qwen36_35b_a3b());
  DecodeGrain g;
  g.position = g.kv_capacity - 1;  // every split holds keys
  const DecodeProgram p = build_decode_program(c, g);
  EXPECT_EQ(check_decode_program(p), "");

  const int64_t H = c.hidden, k = c.n_experts_per_tok, n_gdn = c.n_linear_attention_layers(),
                n_attn = c.n_full_attention_layers();
  const int64_t gdn_in = c.gdn_conv_channels() + c.gdn_value_dim() + 2 * int64_t{c.gdn_n_value_heads};
  const int64_t attn_in = int64_t{c.n_heads} * 2 * c.head_dim + 2 * int64_t{c.n_kv_heads} * c.head_dim;
  std::map<DecodeTaskKind, int64_t> n = count_kinds(p);
  EXPECT_EQ(n[DecodeTaskKind::kEmbed], 1);
  EXPECT_EQ(n[DecodeTaskKind::kInProj], n_gdn * ceil_div(gdn_in, g.proj_rows) + n_attn * ceil_div(attn_in, g.proj_rows));
  EXPECT_EQ(n[DecodeTaskKind::kGdnHeads], n_gdn * c.gdn_n_key_heads);
  EXPECT_EQ(n[DecodeTaskKind::kAttnPrepare], n_attn * c.n_kv_heads);
  EXPECT_EQ(n[DecodeTaskKind::kAttnSplit], n_attn * c.n_kv_heads * g.attn_splits);
  EXPECT_EQ(n[DecodeTaskKind::kAttnCombine], n_attn * c.n_kv_heads);
  EXPECT_EQ(n[DecodeTaskKind::kOutProj], c.n_layers * ceil_div(H, g.out_rows));
  EXPECT_EQ(n[DecodeTaskKind::kRouter], c.n_layers * ceil_div(c.n_experts + 1, g.router_rows));
  EXPECT_EQ(n[DecodeTaskKind::kExpertGateUp],
            c.n_layers * (k * ceil_div(c.moe_ffn_dim, g.expert_rows) + ceil_div(c.shared_ffn_dim, g.expert_rows)));
  EXPECT_EQ(n[DecodeTaskKind::kExpertDown], c.n_layers * ceil_div(H, g.down_rows));
  EXPECT_EQ(n[DecodeTaskKind::kLmHead], ceil_div(c.vocab, g.lm_rows));
  EXPECT_EQ(n[DecodeTaskKind::kArgmax], 1);

  // The weights one token streams: its embedding row; per layer the in- and out-projection, the
  // router and k + 1 experts' gate, up and down; the LM head.
  int64_t want = matrix_bytes(1, H, 4) + matrix_bytes(c.vocab, H, 4);
  for (int l = 0; l < c.n_layers; ++l) {
    const bool gdn = !c.is_full_attention(l);
    const int64_t mix = gdn ? c.gdn_value_dim() : int64_t{c.n_heads} * c.head_dim;
    want += matrix_bytes(gdn ? gdn_in : attn_in, H, 4) + matrix_bytes(H, mix, 4) +
            matrix_bytes(c.n_experts + 1, H, g.router_bits);
    want += k * (2 * matrix_bytes(c.moe_ffn_dim, H, 4) + matrix_bytes(H, c.moe_ffn_dim, 4));
    want += 2 * matrix_bytes(c.shared_ffn_dim, H, 4) + matrix_bytes(H, c.shared_ffn_dim, 4);
  }
  int64_t got = 0;
  for (const DecodeTask& t : p.tasks) got += t.weight_bytes;
  EXPECT_EQ(got, want);
  EXPECT_GT(want, int64_t{1'500'000'000});  // about 1.67 GB a token
  std::printf("[decode program] 35b-a3b: %zu tasks, %zu counters, %.3f GB of weights\n", p.tasks.size(),
              p.counter_names.size(), double(got) / 1e9);
}

TEST(DecodeProgram, OtherShapesAndGrainsAreSafe) {
  const ModelConfig demo = load_model_config(test::demo_model_dir());
  const ModelConfig realdims = test::synth_preset_config("realdims");
  DecodeGrain fine;
  fine.proj_rows = fine.out_rows = fine.expert_rows = fine.down_rows = 16;
  fine.lm_rows = 4096;
  fine.attn_splits = 7;
  fine.kv_capacity = 64;
  fine.position = 63;  // the last position: every split holds keys
  DecodeGrain coarse;
  coarse.proj_rows = coarse.out_rows = coarse.expert_rows = coarse.down_rows = 4096;
  coarse.lm_rows = 1 << 20;
  coarse.attn_splits = 1;
  for (const ModelConfig* c : {&demo, &realdims})
    for (const DecodeGrain& g : {DecodeGrain{}, fine, coarse}) {
      const DecodeProgram p = build_decode_program(*c, g);
      EXPECT_EQ(check_decode_program(p), "") << c->shape_name() << ", splits " << g.attn_splits;
      EXPECT_FALSE(p.tasks.empty());
    }
  // At position 0 a split with no keys is left out: one split task per KV head.
  DecodeGrain first;
  first.attn_splits = 4;
  const DecodeProgram p = build_decode_program(demo, first);
  EXPECT_EQ(count_kinds(p)[DecodeTaskKind::kAttnSplit], int64_t{demo.n_full_attention_layers()} * demo.n_kv_heads);
}

TEST(DecodeProgram, FindsAMissingWait) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  // A GDN head that does not wait for the in-projection reads proj before it is written.
  p.tasks[first_task(p, DecodeTaskKind::kGdnHeads, 0)].waits.clear();
  expect_problem(p, {"gdn_heads", "layer 0", "reads proj", "in_proj", "no chain of waits"});
}

TEST(DecodeProgram, FindsAMissingWaitAcrossLayers) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  // Layer 1's in-projection no longer waits for layer 0's MoE: it reads moe_out while layer
  // 0's down rows may still write it (and its first task stores the residual that layer 0's
  // router may still read).
  for (DecodeTask& t : p.tasks)
    if (t.kind == DecodeTaskKind::kInProj && t.layer == 1) t.waits.clear();
  expect_problem(p, {"in_proj, layer 1, part 0", "writes residual", "no chain of waits"});
}

TEST(DecodeProgram, FindsAWaitBeforeItsProducer) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  // The argmax first: a block that takes it waits for the LM head, which no block may have taken.
  std::rotate(p.tasks.begin(), p.tasks.end() - 1, p.tasks.end());
  expect_problem(p, {"argmax", "before its producer", "lm_head", "wait forever"});
}

TEST(DecodeProgram, FindsAWrongTarget) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  DecodeTask& router = p.tasks[first_task(p, DecodeTaskKind::kRouter, 2)];
  ASSERT_EQ(router.waits.size(), 1u);
  router.waits[0].target -= 1;  // would start once all but one out-projection task are done
  expect_problem(p, {"router", "layer 2", "signals of counter out_proj[2]", "producers"});
  router.waits[0].counter = static_cast<int32_t>(p.counter_names.size());
  expect_problem(p, {"router", "out of range"});
}

TEST(DecodeProgram, FindsTwoWritersOfOneElement) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  // Key head 1's task also updates key head 0's conv channels: two writers, neither waiting.
  const size_t h0 = first_task(p, DecodeTaskKind::kGdnHeads, 0);
  ASSERT_EQ(p.tasks[h0 + 1].kind, DecodeTaskKind::kGdnHeads);
  p.tasks[h0 + 1].accesses.push_back(p.tasks[h0].accesses[1]);
  expect_problem(p, {"writes conv_window of layer 0", "gdn_heads", "part 0", "part 1"});
}

TEST(DecodeProgram, FindsAnEmptyRangeAndAnUnsignalledCounter) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeProgram p = build_decode_program(c);
  p.tasks[0].accesses[0].end = p.tasks[0].accesses[0].begin;
  expect_problem(p, {"embed", "empty"});
  p = build_decode_program(c);
  p.counter_names.push_back("spare");
  p.tasks.back().waits.push_back(DecodeWait{static_cast<int32_t>(p.counter_names.size() - 1), 1});
  expect_problem(p, {"argmax", "spare", "no task signals"});
}

TEST(DecodeProgram, FlattensForTheDevice) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  const DecodeProgram p = build_decode_program(c);
  const DecodeProgramImage img = flatten_decode_program(p);
  ASSERT_EQ(img.tasks.size(), p.tasks.size());
  EXPECT_EQ(img.n_counters, static_cast<int32_t>(p.counter_names.size()));
  // Every task's waits, signal, kind, layer and part; its accesses in order, each as long as before.
  std::map<std::pair<int, int32_t>, int64_t> base;  // (buffer, instance) → arena offset, from the image
  size_t n_accesses = 0;
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const DecodeTask& t = p.tasks[i];
    const DecodeProgramImage::Task& d = img.tasks[i];
    for (int w = 0; w < DecodeProgramImage::kMaxWaits; ++w) {
      const bool has = w < static_cast<int>(t.waits.size());
      EXPECT_EQ(d.wait_counter[w], has ? t.waits[w].counter : -1) << i;
      EXPECT_EQ(d.wait_target[w], has ? t.waits[w].target : 0) << i;
    }
    EXPECT_EQ(d.signal, t.signal);
    EXPECT_EQ(d.kind, static_cast<int32_t>(t.kind));
    EXPECT_EQ(d.layer, t.layer);
    EXPECT_EQ(d.part, t.part);
    ASSERT_EQ(d.n_accesses, static_cast<int32_t>(t.accesses.size()));
    ASSERT_EQ(d.first_access, static_cast<int32_t>(n_accesses));
    for (int a = 0; a < d.n_accesses; ++a) {
      const DecodeAccess& from = t.accesses[a];
      const DecodeProgramImage::Access& to = img.accesses[n_accesses + a];
      EXPECT_EQ(to.end - to.begin, from.end - from.begin);
      EXPECT_EQ(to.write, from.write ? 1 : 0);
      // One offset per (buffer, instance): the same for all its accesses.
      const auto [it, fresh] = base.try_emplace({static_cast<int>(from.buffer), from.instance}, to.begin - from.begin);
      EXPECT_EQ(it->second, to.begin - from.begin) << "task " << i << " access " << a;
      EXPECT_LE(to.end, img.arena_elements);
    }
    n_accesses += t.accesses.size();
  }
  EXPECT_EQ(img.accesses.size(), n_accesses);
  // The spans do not overlap: sorted by offset, each ends before the next begins.
  std::map<int64_t, int64_t> spans;  // offset → largest end
  for (const DecodeProgramImage::Access& a : img.accesses) {
    int64_t start = -1;
    for (const auto& [key, off] : base)
      if (off <= a.begin && (start < 0 || off > start)) start = off;
    spans[start] = std::max(spans[start], a.end);
  }
  int64_t end = 0;
  for (const auto& [off, last] : spans) {
    EXPECT_GE(off, end);
    end = last;
  }
  // More waits than the device takes.
  DecodeProgram three = p;
  three.tasks.back().waits.resize(DecodeProgramImage::kMaxWaits + 1, three.tasks.back().waits[0]);
  EXPECT_THROW(flatten_decode_program(three), Error);
  DecodeProgram negative = p;
  negative.tasks[0].accesses[0].begin = -1;
  EXPECT_THROW(flatten_decode_program(negative), Error);
}

/// A hand-made program: n tasks of `bytes` weight bytes each; task i waits on task i − 1's counter
/// when `chain`, else none waits.
DecodeProgram toy_program(int n, int64_t bytes, bool chain) {
  DecodeProgram p;
  for (int i = 0; i < n; ++i) {
    std::string name = "c";
    name += std::to_string(i);  // (not "c" + …: GCC 12 warns falsely on that under -O2)
    p.counter_names.push_back(name);
    DecodeTask t;
    t.kind = DecodeTaskKind::kInProj;
    t.part = i;
    t.signal = i;
    if (chain && i > 0) t.waits.push_back(DecodeWait{i - 1, 1});
    t.weight_bytes = bytes;
    p.tasks.push_back(t);
  }
  return p;
}

TEST(DecodeProgram, EstimatesByListScheduling) {
  DecodeCostModel m;
  m.blocks = 2;
  m.bytes_per_us = 1000;  // 1,000 bytes: 1 µs
  m.task_overhead_us = 0.5;
  m.sync_latency_us = 1.0;
  // A chain of three on two blocks. Without prefetch each task streams after its wait:
  // 0 → 1.5; ready 2.5 → 4.0; ready 5.0 → 6.5.
  m.prefetch_weights = false;
  DecodeEstimate e = estimate_decode_program(toy_program(3, 1000, true), m);
  EXPECT_DOUBLE_EQ(e.step_us, 6.5);
  EXPECT_DOUBLE_EQ(e.busy_us, 4.5);
  // With prefetch a task's weights arrive while it waits: 0 → 1.5; max(1, 2.5) + 0.5 = 3.0;
  // taken at 1.5, max(2.5, 4.0) + 0.5 = 4.5.
  m.prefetch_weights = true;
  e = estimate_decode_program(toy_program(3, 1000, true), m);
  EXPECT_DOUBLE_EQ(e.step_us, 4.5);
  // Four independent tasks on two blocks: two rounds of 1.5 µs.
  e = estimate_decode_program(toy_program(4, 1000, false), m);
  EXPECT_DOUBLE_EQ(e.step_us, 3.0);
  EXPECT_DOUBLE_EQ(e.busy_us, 6.0);
  ASSERT_EQ(e.busy_by_kind.size(), 1u);
  EXPECT_EQ(e.busy_by_kind[0].first, DecodeTaskKind::kInProj);
  // Lookahead: one block, two independent tasks of 2 µs. Alone each waits for its own weights
  // (2.5, then 5.0); with one task ahead the second's weights stream during the first's overhead
  // (taken at 2: 4.0, then + 0.5).
  m.blocks = 1;
  e = estimate_decode_program(toy_program(2, 2000, false), m);
  EXPECT_DOUBLE_EQ(e.step_us, 5.0);
  m.lookahead = 1;
  e = estimate_decode_program(toy_program(2, 2000, false), m);
  EXPECT_DOUBLE_EQ(e.step_us, 4.5);
  m.lookahead = -1;
  EXPECT_THROW(estimate_decode_program(toy_program(1, 1, false), m), Error);
  m.lookahead = 0;
  m.blocks = 2;
  // A program the check refuses, and a model without blocks.
  DecodeProgram bad = toy_program(3, 1000, true);
  bad.tasks[2].waits[0].target = 2;
  EXPECT_THROW(estimate_decode_program(bad, m), Error);
  m.blocks = 0;
  EXPECT_THROW(estimate_decode_program(toy_program(1, 1, false), m), Error);
}

// The estimate for the real shape at the default costs, printed (an estimate, not a timing),
// and held to its lower bound: the blocks cannot be busier than the step is long.
TEST(DecodeProgram, EstimatesTheRealShape) {
  const ModelConfig c = test::synth_preset_config("35b-a3b");
  DecodeGrain g;
  g.position = g.kv_capacity - 1;
  const DecodeProgram p = build_decode_program(c, g);
  struct Case {
    bool prefetch;
    double latency;
    int lookahead;
  };
  for (const Case& k : {Case{true, 0.5, 0}, Case{true, 1.0, 0}, Case{true, 2.0, 0}, Case{true, 1.0, 1},
                        Case{true, 1.0, 2}, Case{false, 1.0, 0}}) {
    {
      DecodeCostModel m;
      m.prefetch_weights = k.prefetch;
      m.sync_latency_us = k.latency;
      m.lookahead = k.lookahead;
      const DecodeEstimate e = estimate_decode_program(p, m);
      double by_kind = 0;
      for (const auto& [kind, us] : e.busy_by_kind) by_kind += us;
      EXPECT_NEAR(by_kind, e.busy_us, 1e-6 * e.busy_us);
      EXPECT_GE(e.step_us * m.blocks, e.busy_us * (1 - 1e-9));
      std::printf("[decode program estimate] 35b-a3b at 4K, %s, lookahead %d, sync %.1f us: step %.0f us "
                  "(%.0f tok/s), blocks busy %.0f %%\n",
                  k.prefetch ? "weights prefetched" : "no prefetch", k.lookahead, k.latency, e.step_us, 1e6 / e.step_us,
                  100.0 * e.busy_us / (e.step_us * m.blocks));
    }
  }
}

TEST(DecodeProgram, RefusesABadGrain) {
  const ModelConfig c = load_model_config(test::demo_model_dir());
  DecodeGrain g;
  g.proj_rows = 100;
  EXPECT_THROW(build_decode_program(c, g), Error);
  g = DecodeGrain{};
  g.attn_splits = 0;
  EXPECT_THROW(build_decode_program(c, g), Error);
  g = DecodeGrain{};
  g.position = g.kv_capacity;
  try {
    build_decode_program(c, g);
    ADD_FAILURE() << "a position past the KV capacity was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the KV capacity"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lily::cuda
