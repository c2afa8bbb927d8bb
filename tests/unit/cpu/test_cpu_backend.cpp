// The CPU backend end to end on the committed demo model (models/demo): the transformers-float32
// greedy goldens (tests/fixtures/demo.golden.json) are reproduced id for id; prefill/decode
// consistency, chunking, clone_state, probes and error handling.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/ops.h"
#include "base/bf16.h"
#include "base/error.h"
#include "model/loader.h"
#include "support/route_alignment.h"
#include "support/test_support.h"

namespace lily::cpu {
namespace {

class CpuBackendDemo : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { weights_ = load_model(test::demo_model_dir()); }
  static void TearDownTestSuite() { weights_.reset(); }

  static std::vector<int32_t> stop_ids() { return weights_->config.eos_token_ids; }
  static bool is_stop(int32_t id) {
    for (int32_t s : stop_ids())
      if (s == id) return true;
    return false;
  }
  /// A deterministic in-vocabulary prompt of n ids (the docs/benchmark.md §1.1 pattern).
  static std::vector<int32_t> synthetic_prompt(int n) {
    std::vector<int32_t> ids(n);
    for (int i = 0; i < n; ++i)
      ids[i] = static_cast<int32_t>((uint64_t(i) * 2654435761u % (uint64_t(1) << 32)) %
                                    weights_->config.vocab);
    return ids;
  }

  static std::shared_ptr<const ModelWeights> weights_;
};
std::shared_ptr<const ModelWeights> CpuBackendDemo::weights_;

/// Top-1 minus top-2 logit.
double top2_margin(const std::vector<float>& logits) {
  float first = -std::numeric_limits<float>::infinity(), second = first;
  for (float v : logits) {
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return double(first) - second;
}

TEST_F(CpuBackendDemo, ReproducesTransformersGreedyGoldens) {
  std::ifstream in(test::source_dir() / "tests" / "fixtures" / "demo.golden.json");
  ASSERT_TRUE(in) << "missing tests/fixtures/demo.golden.json";
  const auto golden = nlohmann::json::parse(in);
  ASSERT_EQ(golden["goldens"].size(), 5u);
  CpuBackend backend(weights_, 2);
  int index = 0;
  for (const auto& g : golden["goldens"]) {
    const auto prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    const auto expected = g["token_ids"].get<std::vector<int32_t>>();
    const auto margins = g["margins"].get<std::vector<double>>();
    // Greedy generation: at most 64 ids, ending with (and including) a stop id, like the goldens.
    // Along the way, a logit-level check: transformers' fp32 top-2 margins are reproduced
    // (measured: within 4e-5 of logits of size ~20; a wrong op moves them by far more).
    auto state = backend.new_state(4096);
    std::vector<float> logits;
    int32_t next = backend.prefill(*state, prompt, &logits);
    std::vector<int32_t> generated;
    while (true) {
      const size_t step = generated.size();
      if (step < margins.size()) {
        EXPECT_NEAR(top2_margin(logits), margins[step], 5e-4) << "golden " << index << " step " << step;
      }
      generated.push_back(next);
      if (is_stop(next) || generated.size() == 64) break;
      next = backend.decode(*state, next, &logits);
    }
    EXPECT_EQ(generated, expected) << "golden " << index;
    ++index;
  }
}

TEST_F(CpuBackendDemo, Bf16NumericsKeepsTheGoldenIdsWhileTheMarginIsLarge) {
  // The bf16-activation policy (what the CUDA backend computes) must not change a greedy choice
  // that transformers made with a top-2 margin ≥ 0.5 (the end-to-end criterion of docs/model.md §4.5).
  std::ifstream in(test::source_dir() / "tests" / "fixtures" / "demo.golden.json");
  ASSERT_TRUE(in) << "missing tests/fixtures/demo.golden.json";
  const auto golden = nlohmann::json::parse(in);
  CpuBackend backend(weights_, 2);
  backend.set_numerics(Numerics::kBf16Activations);
  int index = 0, compared = 0;
  for (const auto& g : golden["goldens"]) {
    const auto prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    const auto expected = g["token_ids"].get<std::vector<int32_t>>();
    const auto margins = g["margins"].get<std::vector<double>>();
    auto state = backend.new_state(4096);
    int32_t next = backend.prefill(*state, prompt);
    for (size_t step = 0; step < expected.size() && step < margins.size() && margins[step] >= 0.5; ++step) {
      ASSERT_EQ(next, expected[step]) << "golden " << index << " step " << step;
      ++compared;
      if (step + 1 < expected.size()) next = backend.decode(*state, next);
    }
    ++index;
  }
  EXPECT_GE(compared, 20);  // 25 leading large-margin steps over the 5 goldens: not vacuous
}

TEST_F(CpuBackendDemo, PrefillThenDecodeEqualsFullRecompute) {
  CpuBackend backend(weights_, 2);
  const auto prompt = synthetic_prompt(40);
  auto state = backend.new_state(256);
  const int32_t next = backend.prefill(*state, prompt);
  std::vector<float> decoded;
  const int32_t after = backend.decode(*state, next, &decoded);
  auto extended = prompt;
  extended.push_back(next);
  auto fresh = backend.new_state(256);
  std::vector<float> recomputed;
  EXPECT_EQ(backend.prefill(*fresh, extended, &recomputed), after);
  ASSERT_EQ(decoded.size(), static_cast<size_t>(weights_->config.vocab));
  EXPECT_EQ(decoded, recomputed);  // bit for bit: same fp32 operations per token
  EXPECT_EQ(state->position(), 41);
  EXPECT_EQ(fresh->position(), 41);
}

TEST_F(CpuBackendDemo, ChunkedPrefillEqualsTokenByTokenDecode) {
  CpuBackend backend(weights_, 2);
  const auto prompt = synthetic_prompt(300);  // 3 chunks of the default 128
  auto chunked = backend.new_state(512);
  std::vector<float> chunked_logits;
  const int32_t chunked_next = backend.prefill(*chunked, prompt, &chunked_logits);

  auto stepped = backend.new_state(512);
  std::vector<float> stepped_logits;
  int32_t stepped_next = -1;
  for (int32_t id : prompt) stepped_next = backend.decode(*stepped, id, &stepped_logits);
  EXPECT_EQ(chunked_next, stepped_next);
  EXPECT_EQ(chunked_logits, stepped_logits);

  backend.set_prefill_chunk(7);  // chunk boundaries in odd places give the same result
  auto odd = backend.new_state(512);
  std::vector<float> odd_logits;
  EXPECT_EQ(backend.prefill(*odd, prompt, &odd_logits), chunked_next);
  EXPECT_EQ(odd_logits, chunked_logits);
}

TEST_F(CpuBackendDemo, ResultsDoNotDependOnThreadCount) {
  const auto prompt = synthetic_prompt(70);
  std::vector<float> one, four;
  CpuBackend single(weights_, 1), multi(weights_, 4);
  auto a = single.new_state(128), b = multi.new_state(128);
  EXPECT_EQ(single.prefill(*a, prompt, &one), multi.prefill(*b, prompt, &four));
  EXPECT_EQ(one, four);
}

TEST_F(CpuBackendDemo, CloneStateGivesIdenticalContinuations) {
  CpuBackend backend(weights_, 2);
  auto original = backend.new_state(256);
  int32_t next = backend.prefill(*original, synthetic_prompt(33));
  auto copy = backend.clone_state(*original);
  EXPECT_EQ(copy->position(), original->position());
  EXPECT_EQ(copy->bytes(), original->bytes());
  // Advance the copy first: the original must not see any of it.
  std::vector<int32_t> from_copy, from_original;
  int32_t a = next, b = next;
  std::vector<float> logits_copy, logits_original;
  for (int i = 0; i < 6; ++i) from_copy.push_back(a = backend.decode(*copy, a, &logits_copy));
  for (int i = 0; i < 6; ++i)
    from_original.push_back(b = backend.decode(*original, b, &logits_original));
  EXPECT_EQ(from_copy, from_original);
  EXPECT_EQ(logits_copy, logits_original);
}

TEST_F(CpuBackendDemo, KvCacheGrowsWithTheSequence) {
  CpuBackend backend(weights_, 2);
  auto state = backend.new_state(4096);
  const int64_t empty = state->bytes();
  const auto& c = weights_->config;
  const int64_t gdn_bytes = int64_t{c.n_linear_attention_layers()} * 4 *
                            (int64_t{c.gdn_conv_channels()} * (c.gdn_conv_kernel - 1) +
                             int64_t{c.gdn_n_value_heads} * c.gdn_key_head_dim * c.gdn_value_head_dim);
  EXPECT_EQ(empty, gdn_bytes);  // nothing reserved for max_seq
  backend.prefill(*state, synthetic_prompt(10));
  const int64_t kv_per_token = int64_t{c.n_full_attention_layers()} * 2 * c.n_kv_heads * c.head_dim * 4;
  EXPECT_GE(state->bytes(), empty + 10 * kv_per_token);
  EXPECT_LT(state->bytes(), empty + 4096 * kv_per_token / 4);
}

TEST_F(CpuBackendDemo, ProbesCoverEveryLayerAndMatchTheResult) {
  CpuBackend backend(weights_, 2);
  const auto& c = weights_->config;
  auto state = backend.new_state(64);
  backend.prefill(*state, synthetic_prompt(3));
  std::map<std::string, int> counts;
  std::vector<float> last_layer_out, final_norm, probed_logits;
  backend.set_probe_sink([&](std::string_view name, int layer, int64_t token,
                             std::span<const float> values) {
    EXPECT_EQ(token, 3);
    counts[std::string(name)]++;
    if (name == "layer_out" && layer == c.n_layers - 1) last_layer_out.assign(values.begin(), values.end());
    if (name == "final_norm") final_norm.assign(values.begin(), values.end());
    if (name == "logits") probed_logits.assign(values.begin(), values.end());
    if (name == "router_logits") {
      EXPECT_EQ(values.size(), static_cast<size_t>(c.n_experts));
    }
  });
  std::vector<float> logits;
  backend.decode(*state, 42, &logits);
  EXPECT_EQ(counts["embed"], 1);
  for (const char* name : {"attn_norm", "mixer_out", "ffn_norm", "router_logits", "ffn_out", "layer_out"})
    EXPECT_EQ(counts[name], c.n_layers) << name;
  EXPECT_EQ(counts["final_norm"], 1);
  EXPECT_EQ(counts["logits"], 1);
  EXPECT_EQ(probed_logits, logits);
  std::vector<float> expected(c.hidden);
  rms_norm(last_layer_out.data(), weights_->final_norm.data(), c.hidden, c.rms_norm_eps, expected.data());
  EXPECT_EQ(final_norm, expected);

  backend.set_probe_sink(nullptr);
  counts.clear();
  backend.decode(*state, 7);
  EXPECT_TRUE(counts.empty());
}

TEST_F(CpuBackendDemo, Bf16NumericsRoundsEveryStoredActivation) {
  CpuBackend backend(weights_, 2);
  backend.set_numerics(Numerics::kBf16Activations);
  auto state = backend.new_state(64);
  backend.prefill(*state, synthetic_prompt(5));
  int checked = 0;
  backend.set_probe_sink([&](std::string_view name, int layer, int64_t, std::span<const float> values) {
    if (name == "router_logits" || name == "logits") return;  // fp32 by design (docs/model.md §4.1)
    for (float v : values) {
      ASSERT_EQ(v, round_bf16(v)) << name << " layer " << layer << " is not bf16-representable";
    }
    ++checked;
  });
  backend.decode(*state, 42);
  EXPECT_EQ(checked, 2 + 5 * weights_->config.n_layers);  // embed, final_norm, 5 probes per layer
}

TEST_F(CpuBackendDemo, Bf16NumericsChangesLogitsSlightlyAndKeepsPrefillEqualToDecode) {
  const auto prompt = synthetic_prompt(150);
  CpuBackend fp32(weights_, 2), bf16(weights_, 2);
  bf16.set_numerics(Numerics::kBf16Activations);
  auto s32 = fp32.new_state(256), s16 = bf16.new_state(256);
  std::vector<float> l32, l16;
  fp32.prefill(*s32, prompt, &l32);
  bf16.prefill(*s16, prompt, &l16);
  EXPECT_NE(l32, l16);  // the roundings are applied
  // Measured ≈ 0.9999 on the demo model; bf16 activations are a small perturbation.
  EXPECT_GT(test::cosine_similarity(l32, l16), 0.99);

  auto stepped = bf16.new_state(256);
  std::vector<float> stepped_logits;
  for (int32_t id : prompt) bf16.decode(*stepped, id, &stepped_logits);
  EXPECT_EQ(stepped_logits, l16);  // chunked prefill = token-by-token decode, bit for bit
}

TEST_F(CpuBackendDemo, Bf16NumericsDiffersFromFp32OnlyThroughNearTiedRouting) {
  // fp32 and bf16 activations are both correct computations of the model; where the router's
  // k-th and (k+1)-th experts are near-tied, rounding decides which one runs, and that token's
  // logits move by up to ~2 % (measured: cosine 0.980 at golden 3 step 39). Adopting the fp32
  // run's expert set at those near-ties (within 0.05 standard deviations of the router logits;
  // the widest measured is 0.018) must leave only rounding noise: cosine ≥ 0.999 at every step.
  // This is the comparison rule of the CUDA end-to-end tests (tests/support/route_alignment.h).
  std::ifstream in(test::source_dir() / "tests" / "fixtures" / "demo.golden.json");
  ASSERT_TRUE(in) << "missing tests/fixtures/demo.golden.json";
  const auto golden = nlohmann::json::parse(in);
  CpuBackend fp32(weights_, 2), bf16(weights_, 2);
  bf16.set_numerics(Numerics::kBf16Activations);
  test::RouterLog log;
  fp32.set_probe_sink(log.recorder());
  bf16.set_route_override(log.adopter(0.05f));
  int index = 0;
  for (const auto& g : golden["goldens"]) {
    const auto prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    const auto ids = g["token_ids"].get<std::vector<int32_t>>();
    auto s32 = fp32.new_state(4096), s16 = bf16.new_state(4096);
    std::vector<float> l32, l16;
    fp32.prefill(*s32, prompt, &l32);  // the recorded run goes first at every step
    bf16.prefill(*s16, prompt, &l16);
    for (size_t step = 0; step < ids.size(); ++step) {
      EXPECT_GE(test::cosine_similarity(l32, l16), 0.999) << "golden " << index << " step " << step;
      if (step + 1 == ids.size()) break;
      fp32.decode(*s32, ids[step], &l32);
      bf16.decode(*s16, ids[step], &l16);
    }
    log.clear();
    ++index;
  }
  EXPECT_GT(log.adopted(), 0);  // the near-ties exist on this model (27 measured)
  EXPECT_EQ(log.refused(), 0) << "a routing difference beyond a near-tie, gap " << log.widest_refused_gap();
}

TEST_F(CpuBackendDemo, RejectsBadStatesAndTokens) {
  CpuBackend backend(weights_, 1);
  EXPECT_THROW(backend.new_state(0), Error);
  EXPECT_THROW(backend.new_state(CpuBackend::kMaxSeq + 1), Error);
  EXPECT_NO_THROW(backend.new_state(CpuBackend::kMaxSeq));
  auto state = backend.new_state(4);
  EXPECT_THROW(backend.prefill(*state, std::vector<int32_t>{}), Error);
  EXPECT_THROW(backend.prefill(*state, std::vector<int32_t>{1, weights_->config.vocab}), Error);
  EXPECT_THROW(backend.decode(*state, -1), Error);
  EXPECT_THROW(backend.prefill(*state, std::vector<int32_t>{1, 2, 3, 4, 5}), Error);
  EXPECT_EQ(state->position(), 0);  // nothing consumed by a rejected call
  backend.prefill(*state, std::vector<int32_t>{1, 2, 3});
  backend.decode(*state, 4);
  EXPECT_EQ(state->position(), 4);
  EXPECT_THROW(backend.decode(*state, 5), Error);
  EXPECT_THROW(backend.set_prefill_chunk(0), Error);

  struct Foreign : SequenceState {
    int64_t position() const override { return 0; }
    int64_t bytes() const override { return 0; }
  } foreign;
  EXPECT_THROW(backend.decode(foreign, 1), Error);
  EXPECT_THROW(backend.clone_state(foreign), Error);
}

}  // namespace
}  // namespace lily::cpu
