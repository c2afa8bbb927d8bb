// The CPU sampler (engine/sampler.h): Philox known answers, the draw's distribution (chi-square
// against the softmax), that top-k / top-p / min-p never draw outside their sets, the penalty
// formulas, and log-probabilities against a direct log-softmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "engine/sampler.h"

using namespace lily;

namespace {

/// softmax(x / t) in fp64, the reference the draws are compared with.
std::vector<double> softmax(const std::vector<float>& x, double t = 1.0) {
  double m = -INFINITY;
  for (float v : x) m = std::max(m, v / t);
  std::vector<double> p(x.size());
  double z = 0;
  for (size_t i = 0; i < x.size(); ++i) z += p[i] = std::exp(x[i] / t - m);
  for (double& v : p) v /= z;
  return p;
}

SamplingParams at_temperature(float t, uint64_t seed = 12345) {
  SamplingParams p;
  p.temperature = t;
  p.seed = seed;
  return p;
}

/// Pearson's chi-square statistic of observed counts against expected probabilities.
double chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int draws) {
  double chi2 = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * draws;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi2;
}

/// A synthetic row: `n` logits with a mix of large, small, tied and negative values.
std::vector<float> synthetic_logits(int n) {
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = static_cast<float>(std::sin(i * 1.7) * 3.0 + (i % 7 == 0 ? 2.0 : 0.0));
  return x;
}

}  // namespace

// Known answers published with Random123 (Salmon et al., SC 2011), counter then key.
TEST(Philox, KnownAnswerVectors) {
  using W4 = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (W4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (W4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (W4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, UniformIsAPureFunctionOfSeedAndStep) {
  const double a = sample_uniform(7, 3);
  EXPECT_EQ(a, sample_uniform(7, 3));
  EXPECT_NE(a, sample_uniform(7, 4));
  EXPECT_NE(a, sample_uniform(8, 3));
  EXPECT_NE(sample_uniform(1ull << 32, 0), sample_uniform(1, 0));  // both halves of the seed count
  double lo = 1, hi = 0, sum = 0;
  for (uint64_t s = 0; s < 20000; ++s) {
    const double u = sample_uniform(99, s);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    lo = std::min(lo, u), hi = std::max(hi, u), sum += u;
  }
  EXPECT_LT(lo, 0.001);
  EXPECT_GT(hi, 0.999);
  EXPECT_NEAR(sum / 20000, 0.5, 0.01);
}

TEST(Sampler, TemperatureOneMatchesSoftmaxChiSquare) {
  const std::vector<float> x{2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 1.5f, 0.25f};
  const auto probs = softmax(x);
  Sampler sampler;
  TokenHistory history(static_cast<int32_t>(x.size()));
  const int draws = 4000;
  std::vector<int> counts(x.size(), 0);
  for (int step = 0; step < draws; ++step) ++counts[sampler.sample(x, at_temperature(1.0f), history, step)];
  // 7 degrees of freedom: P(chi2 > 24.3) = 0.001. The seed is fixed, so this never flakes;
  // the bound is loose on purpose and still fails for a wrong distribution (see below).
  EXPECT_LT(chi_square(counts, probs, draws), 30.0);
  // The same draws against the softmax at temperature 2 fail the test: it has power.
  EXPECT_GT(chi_square(counts, softmax(x, 2.0), draws), 100.0);
}

TEST(Sampler, TemperatureScalesTheDistribution) {
  const std::vector<float> x{2.0f, 1.0f, 0.0f, -1.0f, 0.5f};
  Sampler sampler;
  TokenHistory history(5);
  const int draws = 4000;
  for (float t : {0.5f, 1.7f}) {
    std::vector<int> counts(x.size(), 0);
    for (int step = 0; step < draws; ++step) ++counts[sampler.sample(x, at_temperature(t, 777), history, step)];
    EXPECT_LT(chi_square(counts, softmax(x, t), draws), 25.0) << "t=" << t;  // 4 dof: P(>18.5) = 0.001
  }
}

TEST(Sampler, GreedyIsArgmaxTiesToLowestId) {
  const std::vector<float> x{1.0f, 3.0f, -2.0f, 3.0f};
  Sampler sampler;
  TokenHistory history(4);
  EXPECT_EQ(sampler.sample(x, SamplingParams{}, history, 0), 1);
  EXPECT_EQ(argmax_token(x), 1);
  EXPECT_TRUE(SamplingParams{}.plain_greedy());
  SamplingParams biased;
  biased.logit_bias = {{2, 10.0f}};
  EXPECT_FALSE(biased.plain_greedy());
  EXPECT_EQ(sampler.sample(x, biased, history, 0), 2);
}

// A temperature so small that logits / T leaves fp32 used to give NaN weights, and the draw
// then fell through to the last id of the vocabulary: below kGreedyBelowTemperature it is the
// argmax; above it, a row past fp32's range after the division saturates instead of drawing NaN.
TEST(Sampler, TinyTemperaturesAreGreedyAndHugeLogitsSaturate) {
  const auto x = synthetic_logits(300);
  Sampler sampler;
  TokenHistory history(300);
  const int32_t best = argmax_token(x);
  ASSERT_NE(best, 299);
  for (float t : {1e-38f, 1e-45f, 1e-6f, 9.9e-6f}) {
    EXPECT_TRUE(at_temperature(t).greedy()) << t;
    for (int step = 0; step < 20; ++step) EXPECT_EQ(sampler.sample(x, at_temperature(t), history, step), best) << t;
  }
  EXPECT_FALSE(at_temperature(kGreedyBelowTemperature).greedy());
  // Logits whose quotient by T overflows: the two largest (equal after saturation) share the
  // draws, no other token is ever drawn.
  std::vector<float> huge(8, 0.0f);
  huge[3] = 3e38f;
  huge[6] = 2e38f;
  std::vector<int> counts(huge.size(), 0);
  for (int step = 0; step < 400; ++step) ++counts[sampler.sample(huge, at_temperature(0.5f, 9), history, step)];
  EXPECT_EQ(counts[3] + counts[6], 400);
  EXPECT_GT(counts[3], 100);
  EXPECT_GT(counts[6], 100);
}

TEST(Sampler, SameSeedAndStepSameToken) {
  const auto x = synthetic_logits(500);
  Sampler a, b;
  TokenHistory history(500);
  std::vector<int32_t> first, second, other;
  for (int step = 0; step < 50; ++step) {
    first.push_back(a.sample(x, at_temperature(1.0f, 5), history, step));
    second.push_back(b.sample(x, at_temperature(1.0f, 5), history, step));
    other.push_back(a.sample(x, at_temperature(1.0f, 6), history, step));
  }
  EXPECT_EQ(first, second);
  EXPECT_NE(first, other);
}

TEST(Sampler, TopKNeverDrawsOutsideTheKLargest) {
  const auto x = synthetic_logits(300);
  std::vector<int32_t> order(x.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  const std::set<int32_t> top5(order.begin(), order.begin() + 5);
  SamplingParams p = at_temperature(2.0f, 1);
  p.top_k = 5;
  auto survivors = surviving_tokens(x, p);
  EXPECT_EQ(std::set<int32_t>(survivors.begin(), survivors.end()), top5);
  Sampler sampler;
  TokenHistory history(300);
  std::set<int32_t> drawn;
  for (int step = 0; step < 2000; ++step) drawn.insert(sampler.sample(x, p, history, step));
  EXPECT_TRUE(std::includes(top5.begin(), top5.end(), drawn.begin(), drawn.end()));
  EXPECT_EQ(drawn.size(), 5u);  // at temperature 2 all five come up in 2000 draws
}

TEST(Sampler, TopPKeepsTheShortestPrefixReachingP) {
  // Probabilities about 0.5, 0.25, 0.125, …: top_p 0.7 keeps {0, 1} (0.75 ≥ 0.7), 0.76 adds
  // token 2, 0.1 keeps the top token alone.
  std::vector<float> x;
  for (int i = 0; i < 12; ++i) x.push_back(static_cast<float>(-i * std::log(2.0)));
  SamplingParams p = at_temperature(1.0f);
  p.top_p = 0.7f;
  EXPECT_EQ(surviving_tokens(x, p), (std::vector<int32_t>{0, 1}));
  p.top_p = 0.76f;
  EXPECT_EQ(surviving_tokens(x, p), (std::vector<int32_t>{0, 1, 2}));
  p.top_p = 0.1f;
  EXPECT_EQ(surviving_tokens(x, p), (std::vector<int32_t>{0}));
  // Never outside the set over many draws, and the two kept tokens in ratio 2:1.
  p.top_p = 0.7f;
  Sampler sampler;
  TokenHistory history(12);
  int c0 = 0, c1 = 0;
  for (int step = 0; step < 3000; ++step) {
    const int32_t t = sampler.sample(x, p, history, step);
    ASSERT_TRUE(t == 0 || t == 1) << t;
    (t == 0 ? c0 : c1)++;
  }
  EXPECT_NEAR(static_cast<double>(c0) / 3000, 2.0 / 3.0, 0.04);
}

TEST(Sampler, TopPOnAFlatLargeRowGrowsItsCandidateBlock) {
  // 5000 equal logits: top_p 0.5 needs 2500 of them, more than the first blocks hold.
  const std::vector<float> x(5000, 0.25f);
  SamplingParams p = at_temperature(1.0f);
  p.top_p = 0.5f;
  const auto kept = surviving_tokens(x, p);
  ASSERT_EQ(kept.size(), 2500u);
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i], static_cast<int32_t>(i));  // ties: lower ids first
}

TEST(Sampler, TopPIsAppliedToTheTopKDistribution) {
  // top_k 2 leaves {0: 2/3, 1: 1/3} after renormalization; top_p 0.6 then keeps only token 0
  // (over the full row, 0.5 < 0.6 would have kept token 1 too).
  std::vector<float> x;
  for (int i = 0; i < 12; ++i) x.push_back(static_cast<float>(-i * std::log(2.0)));
  SamplingParams p = at_temperature(1.0f);
  p.top_k = 2;
  p.top_p = 0.6f;
  EXPECT_EQ(surviving_tokens(x, p), (std::vector<int32_t>{0}));
  p.top_k = 0;
  EXPECT_EQ(surviving_tokens(x, p), (std::vector<int32_t>{0, 1}));
}

TEST(Sampler, MinPKeepsTokensAboveAFractionOfTheMax) {
  const auto x = synthetic_logits(400);
  SamplingParams p = at_temperature(1.0f, 3);
  p.min_p = 0.2f;
  const auto probs = softmax(x);
  const double pmax = *std::max_element(probs.begin(), probs.end());
  std::set<int32_t> allowed;
  for (size_t i = 0; i < probs.size(); ++i)
    if (probs[i] >= 0.2 * pmax) allowed.insert(static_cast<int32_t>(i));
  const auto kept = surviving_tokens(x, p);
  EXPECT_EQ(std::set<int32_t>(kept.begin(), kept.end()), allowed);
  ASSERT_GT(allowed.size(), 1u);
  Sampler sampler;
  TokenHistory history(400);
  for (int step = 0; step < 2000; ++step) ASSERT_TRUE(allowed.count(sampler.sample(x, p, history, step)));
}

TEST(Sampler, NoFilterMeansEveryTokenSurvives) {
  const auto x = synthetic_logits(50);
  EXPECT_TRUE(surviving_tokens(x, at_temperature(1.0f)).empty());
  SamplingParams p = at_temperature(1.0f);
  p.top_k = 50;  // k ≥ vocab is no filter
  EXPECT_TRUE(surviving_tokens(x, p).empty());
}

TEST(Sampler, DrawInvertsTheCdfInIdOrder) {
  const std::vector<float> x{0.0f, 0.0f, 0.0f, 0.0f};  // 0.25 each
  EXPECT_EQ(draw_token(x, {}, 0.0), 0);
  EXPECT_EQ(draw_token(x, {}, 0.24), 0);
  EXPECT_EQ(draw_token(x, {}, 0.26), 1);
  EXPECT_EQ(draw_token(x, {}, 0.99), 3);
  const std::vector<int32_t> survivors{1, 3};  // renormalized: 0.5 each, walked 1 then 3
  EXPECT_EQ(draw_token(x, survivors, 0.49), 1);
  EXPECT_EQ(draw_token(x, survivors, 0.51), 3);
  // Survivors come in ascending id order from surviving_tokens.
  SamplingParams p = at_temperature(1.0f);
  p.top_k = 3;
  const std::vector<float> y{0.5f, 3.0f, -1.0f, 2.0f, 1.0f};
  EXPECT_EQ(surviving_tokens(y, p), (std::vector<int32_t>{1, 3, 4}));
}

TEST(Penalties, FormulasOnTheLogits) {
  std::vector<float> x{2.0f, -2.0f, 1.0f, 4.0f, -1.0f};
  TokenHistory h(5);
  const std::vector<int32_t> prompt{0, 1};
  h.add_prompt(prompt);
  h.add_generated(2);
  h.add_generated(2);
  h.add_generated(1);
  EXPECT_EQ(h.generated_count(2), 2);
  EXPECT_EQ(h.generated_count(0), 0);
  EXPECT_TRUE(h.seen(0));
  EXPECT_FALSE(h.seen(3));
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.logit_bias = {{3, -1.5f}, {4, 3.0f}};
  apply_penalties(x, p, h);
  EXPECT_FLOAT_EQ(x[0], 2.0f / 2.0f);                        // prompt, positive: divided
  EXPECT_FLOAT_EQ(x[1], -2.0f * 2.0f - 0.5f * 1 - 0.25f);    // prompt + generated once, negative: multiplied
  EXPECT_FLOAT_EQ(x[2], 1.0f / 2.0f - 0.5f * 2 - 0.25f);     // generated twice
  EXPECT_FLOAT_EQ(x[3], 4.0f - 1.5f);                        // bias only
  EXPECT_FLOAT_EQ(x[4], -1.0f + 3.0f);                       // bias first, never seen: no penalty
}

TEST(Penalties, BiasIsAddedBeforeTheRepetitionPenalty) {
  std::vector<float> x{-1.0f, 0.0f};
  TokenHistory h(2);
  h.add_generated(0);
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.logit_bias = {{0, 3.0f}};
  apply_penalties(x, p, h);
  EXPECT_FLOAT_EQ(x[0], (-1.0f + 3.0f) / 2.0f);
}

TEST(Penalties, ChangeWhatIsSampled) {
  // A strong presence penalty on an already generated favourite makes greedy pick the runner-up.
  const std::vector<float> x{5.0f, 4.0f, 0.0f};
  TokenHistory h(3);
  h.add_generated(0);
  SamplingParams p;
  p.presence_penalty = 2.0f;
  Sampler sampler;
  EXPECT_EQ(sampler.sample(x, p, h, 0), 1);
  p.presence_penalty = 0.5f;
  EXPECT_EQ(sampler.sample(x, p, h, 0), 0);
}

TEST(Logprobs, MatchADirectLogSoftmax) {
  const auto x = synthetic_logits(1000);
  double m = -INFINITY;
  for (float v : x) m = std::max<double>(m, v);
  double z = 0;
  for (float v : x) z += std::exp(v - m);
  const TokenLogprobs lp = token_logprobs(x, 17, 20);
  EXPECT_EQ(lp.token, 17);
  EXPECT_NEAR(lp.logprob, x[17] - m - std::log(z), 1e-4);
  ASSERT_EQ(lp.top.size(), 20u);
  for (size_t i = 0; i < lp.top.size(); ++i) {
    EXPECT_LE(lp.top[i].logprob, 0.0f);
    EXPECT_NEAR(lp.top[i].logprob, x[lp.top[i].token] - m - std::log(z), 1e-4);
    if (i > 0) EXPECT_GE(lp.top[i - 1].logprob, lp.top[i].logprob);
  }
  // The first entry is the argmax; nothing outside the list is more likely than its last entry.
  EXPECT_EQ(lp.top[0].token, argmax_token(x));
  std::set<int32_t> listed;
  for (const auto& t : lp.top) listed.insert(t.token);
  for (size_t i = 0; i < x.size(); ++i)
    if (!listed.count(static_cast<int32_t>(i))) EXPECT_LE(x[i], x[lp.top.back().token]);
  EXPECT_TRUE(token_logprobs(x, 3, 0).top.empty());
}

TEST(Logprobs, SumToOneAndIgnoreTemperature) {
  const std::vector<float> x{1.0f, 2.0f, 3.0f};
  double total = 0;
  for (int32_t id = 0; id < 3; ++id) total += std::exp(token_logprobs(x, id, 0).logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  const auto lp = token_logprobs(x, 2, 3);
  EXPECT_EQ(lp.top[0].token, 2);
  EXPECT_EQ(lp.top[2].token, 0);
}

TEST(ChoiceSeed, IndexZeroIsTheSeedOthersAreDistinct53BitValues) {
  EXPECT_EQ(choice_seed(42, 0), 42u);
  std::set<uint64_t> seen{42};
  for (int i = 1; i < 8; ++i) {
    const uint64_t s = choice_seed(42, i);
    EXPECT_LT(s, uint64_t{1} << 53);
    EXPECT_TRUE(seen.insert(s).second);
    EXPECT_EQ(s, choice_seed(42, i));
  }
  EXPECT_NE(choice_seed(42, 1), choice_seed(43, 1));
  EXPECT_LT(fresh_seed(), uint64_t{1} << 53);
}

namespace {

/// surviving_tokens by the book: a full sort, then top-k, top-p over the renormalized top-k
/// set, min-p; ascending ids. Slow and obvious, the reference for the fast selection.
std::vector<int32_t> survivors_by_full_sort(const std::vector<float>& x, const SamplingParams& p) {
  std::vector<int32_t> order(x.size());
  for (size_t i = 0; i < x.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < order.size()) order.resize(p.top_k);
  const float m = x[order[0]];
  if (p.top_p < 1.0f) {
    double total = 0, cum = 0;
    for (int32_t id : order) total += std::exp(x[id] - m);
    size_t keep = 0;
    while (keep < order.size() && cum < p.top_p * total) cum += std::exp(x[order[keep++]] - m);
    order.resize(std::max<size_t>(keep, 1));
  }
  if (p.min_p > 0.0f) {
    size_t keep = 1;
    while (keep < order.size() && x[order[keep]] >= m + std::log(static_cast<double>(p.min_p))) ++keep;
    order.resize(keep);
  }
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace

TEST(Sampler, FastSelectionEqualsAFullSort) {
  // Random rows (with ties: values on a coarse grid) and random filters, small and large k
  // (the heap and the partial-selection paths), peaked and flat rows (one or many top-p blocks).
  uint64_t state = 2463534242ull;
  auto next = [&] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  for (int round = 0; round < 60; ++round) {
    const int vocab = round % 3 == 0 ? 5000 : 700;
    const double spread = round % 2 == 0 ? 8.0 : 0.5;
    std::vector<float> x(vocab);
    for (float& v : x) v = static_cast<float>(std::round((next() % 10000) / 10000.0 * spread * 20) / 20);
    SamplingParams p = at_temperature(1.0f);
    const int k_choice = static_cast<int>(next() % 4);
    p.top_k = k_choice == 0 ? 0 : k_choice == 1 ? 5 : k_choice == 2 ? 100 : 600;
    p.top_p = next() % 3 == 0 ? 1.0f : static_cast<float>(0.05 + (next() % 95) / 100.0);
    p.min_p = next() % 3 == 0 ? static_cast<float>((next() % 50) / 100.0) : 0.0f;
    const auto fast = surviving_tokens(x, p);
    const bool no_filter = (p.top_k == 0 || p.top_k >= vocab) && p.top_p >= 1.0f && p.min_p <= 0.0f;
    if (no_filter) {
      EXPECT_TRUE(fast.empty());
      continue;
    }
    EXPECT_EQ(fast, survivors_by_full_sort(x, p))
        << "round " << round << " k=" << p.top_k << " p=" << p.top_p << " min_p=" << p.min_p;
  }
}

// penalty_edits + apply_penalty_edits (the flat form a device sampler applies per id) equal
// apply_penalties bit for bit, including duplicate logit_bias ids, ids outside the vocabulary,
// greedy parameters and histories with prompt-only, generated-only and both kinds of ids.
TEST(PenaltyEdits, EqualApplyPenaltiesBitForBit) {
  std::mt19937_64 rng(77);
  std::normal_distribution<float> n01(0.0f, 3.0f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (int c = 0; c < 200; ++c) {
    const int vocab = c % 3 == 0 ? 50 : 2000;
    std::vector<float> x(vocab);
    for (float& v : x) v = n01(rng);
    x[static_cast<size_t>(c) % vocab] = 0.0f;
    SamplingParams p;
    p.temperature = c % 4 == 0 ? 0.0f : 0.9f;
    if (c % 2 == 0) p.repetition_penalty = 0.7f + u01(rng);
    if (c % 3 != 2) p.frequency_penalty = -2.0f + 4.0f * u01(rng);
    if (c % 5 != 1) p.presence_penalty = -2.0f + 4.0f * u01(rng);
    const int n_bias = static_cast<int>(rng() % 8);
    for (int j = 0; j < n_bias; ++j) p.logit_bias.push_back({static_cast<int32_t>(rng() % (vocab + 5)) - 2, -3.0f + 6.0f * u01(rng)});
    if (n_bias > 1) p.logit_bias.push_back(p.logit_bias.front());  // a duplicate id, applied twice
    TokenHistory h(vocab);
    std::vector<int32_t> prompt(static_cast<size_t>(rng() % 40));
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    h.add_prompt(prompt);
    const int gen = static_cast<int>(rng() % 30);
    for (int j = 0; j < gen; ++j) h.add_generated(static_cast<int32_t>(rng() % (j % 2 ? 10 : vocab)));

    std::vector<float> want = x, got = x;
    apply_penalties(want, p, h);
    const PenaltyEdits edits = penalty_edits(p, h, vocab);
    apply_penalty_edits(got, edits, p);
    for (int i = 0; i < vocab; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << "case " << c << " id " << i;
    // Ascending distinct ids inside the vocabulary; bias ranges inside biases.
    for (size_t j = 0; j < edits.edits.size(); ++j) {
      const PenaltyEdit& e = edits.edits[j];
      EXPECT_GE(e.id, 0);
      EXPECT_LT(e.id, vocab);
      if (j > 0) {
        EXPECT_LT(edits.edits[j - 1].id, e.id);
      }
      EXPECT_LE(static_cast<size_t>(e.bias_begin + e.bias_count), edits.biases.size());
      EXPECT_EQ(e.count, h.generated_count(e.id));
    }
    if (!p.modifies_logits()) {
      EXPECT_TRUE(edits.edits.empty());
    }
  }
}

TEST(PenaltyEdits, NothingActiveMeansNoEdits) {
  TokenHistory h(100);
  const std::vector<int32_t> prompt = {1, 2, 3};
  h.add_prompt(prompt);
  h.add_generated(5);
  SamplingParams p;
  p.temperature = 0.7f;
  EXPECT_TRUE(penalty_edits(p, h, 100).edits.empty());
  p.logit_bias = {{7, 1.0f}};
  const PenaltyEdits e = penalty_edits(p, h, 100);
  ASSERT_EQ(e.edits.size(), 1u);  // the history does not matter without a penalty
  EXPECT_EQ(e.edits[0].id, 7);
  EXPECT_EQ(e.edits[0].seen, 0);
  EXPECT_EQ(e.biases, std::vector<float>({1.0f}));
}
