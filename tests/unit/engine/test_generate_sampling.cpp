// Sampling inside the generation loop and the scheduler, over the fake backend (whose logits
// are a function of the token history): plain greedy never copies logits, a seed fixes the
// tokens whatever part of the prompt came from a cache, log-probabilities come per token, and
// the n choices of a job each equal a single job with that choice's derived seed.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>

#include "engine/generate.h"
#include "engine/scheduler.h"
#include "fake_backend.h"
#include "support/test_support.h"

using namespace lily;
using namespace std::chrono_literals;
using lily::test::FakeBackend;

namespace {

GenerationParams sampled(uint64_t seed, int64_t max_tokens = 12) {
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.max_seq = 1000;
  p.sampling.temperature = 1.5f;
  p.sampling.seed = seed;
  return p;
}

std::vector<int32_t> run(FakeBackend& b, const GenerationParams& p, const std::vector<int32_t>& prompt,
                         size_t cached = 0) {
  auto s = b.new_state(1000);
  if (cached > 0) b.prefill(*s, std::span<const int32_t>(prompt.data(), cached));
  return generate(b, *s, prompt, p, nullptr).token_ids;
}

/// The tokens and seeds of every choice of a finished job, by choice index.
struct Choices {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<uint64_t> seeds;
};

Choices drain(Job& job, int n) {
  Choices c;
  while (true) {
    auto e = job.next_event(5000ms);
    if (!e) throw std::runtime_error("timed out waiting for the engine");
    if (e->kind == JobEvent::Kind::kFailed) throw std::runtime_error(e->text);
    if (e->kind != JobEvent::Kind::kDone) continue;
    EXPECT_EQ(e->choice, static_cast<int>(c.tokens.size()));
    c.tokens.push_back(e->result.token_ids);
    c.seeds.push_back(e->seed);
    if (e->choice + 1 == n) return c;
  }
}

}  // namespace

TEST(GenerateSampling, PlainGreedyNeverCopiesLogits) {
  FakeBackend b;
  GenerationParams p;
  p.max_tokens = 6;
  p.max_seq = 1000;
  const auto greedy = run(b, p, {1, 2, 3});
  EXPECT_EQ(b.logits_calls, 0);
  // Greedy with log-probabilities copies them but picks the same tokens.
  p.logprobs = 2;
  EXPECT_EQ(run(b, p, {1, 2, 3}), greedy);
  EXPECT_EQ(b.logits_calls, 6);
}

TEST(GenerateSampling, SeedFixesTheTokensAndTheCacheChangesNothing) {
  FakeBackend b;
  const std::vector<int32_t> prompt{4, 8, 15, 16, 23, 42};
  const auto a = run(b, sampled(7), prompt);
  EXPECT_EQ(run(b, sampled(7), prompt), a);
  EXPECT_EQ(run(b, sampled(7), prompt, /*cached=*/4), a);  // state resumed from a "cache hit"
  EXPECT_NE(run(b, sampled(8), prompt), a);
  // Sampling at temperature 1.5 really departs from greedy on these logits.
  GenerationParams greedy = sampled(7);
  greedy.sampling.temperature = 0;
  EXPECT_NE(run(b, greedy, prompt), a);
}

TEST(GenerateSampling, LogprobsPerTokenMatchTheLogits) {
  FakeBackend b;
  GenerationParams p = sampled(3, 5);
  p.logprobs = 3;
  std::vector<TokenLogprobs> seen;
  auto s = b.new_state(1000);
  const std::vector<int32_t> prompt{9, 9, 9};
  const auto r = generate(b, *s, prompt, p, nullptr, {}, {}, [&](const TokenLogprobs& lp) { seen.push_back(lp); });
  ASSERT_EQ(r.logprobs.size(), r.token_ids.size());
  ASSERT_EQ(seen.size(), r.logprobs.size());
  std::vector<int32_t> history = prompt;
  std::vector<float> logits;
  for (size_t i = 0; i < r.token_ids.size(); ++i) {
    EXPECT_EQ(r.logprobs[i].token, r.token_ids[i]);
    EXPECT_EQ(seen[i].logprob, r.logprobs[i].logprob);
    EXPECT_EQ(r.logprobs[i].top.size(), 3u);
    b.fill_logits(history, &logits);  // the logits that token was drawn from
    double m = -INFINITY, z = 0;
    for (float v : logits) m = std::max<double>(m, v);
    for (float v : logits) z += std::exp(v - m);
    EXPECT_NEAR(r.logprobs[i].logprob, logits[r.token_ids[i]] - m - std::log(z), 1e-4);
    history.push_back(r.token_ids[i]);
  }
}

TEST(GenerateSampling, NoLogprobForAStopToken) {
  FakeBackend b;
  GenerationParams p;
  p.max_tokens = 10;
  p.max_seq = 1000;
  p.logprobs = 0;
  b.script = [](const std::vector<int32_t>& h) { return h.size() >= 5 ? 7 : 2; };
  p.stop_ids = {7};
  auto s = b.new_state(1000);
  const auto r = generate(b, *s, std::vector<int32_t>{1, 1, 1}, p, nullptr);
  ASSERT_EQ(r.token_ids, (std::vector<int32_t>{2, 2, 7}));
  EXPECT_EQ(r.logprobs.size(), 2u);
}

TEST(GenerateSampling, PenaltiesReachTheSampler) {
  // A huge presence penalty forbids repeating any generated token, even greedily.
  FakeBackend b;
  b.script = [](const std::vector<int32_t>&) { return 5; };
  GenerationParams p;
  p.max_tokens = 8;
  p.max_seq = 1000;
  p.sampling.presence_penalty = 2.0f;
  p.sampling.logit_bias = {{5, 100.0f}};
  auto s = b.new_state(1000);
  const auto r = generate(b, *s, std::vector<int32_t>{1}, p, nullptr);
  EXPECT_EQ(r.token_ids.front(), 5);  // bias makes 5 the first choice …
  EXPECT_EQ(r.token_ids[1], 5);       // … and 100 outweighs a presence penalty of 2
  p.sampling.logit_bias.clear();
  p.sampling.presence_penalty = 0;
  p.sampling.frequency_penalty = 2.0f;
  p.sampling.repetition_penalty = 2.0f;
  auto s2 = b.new_state(1000);
  const auto r2 = generate(b, *s2, std::vector<int32_t>{1}, p, nullptr);
  EXPECT_EQ(r2.token_ids[0], 5);
  EXPECT_NE(r2.token_ids[1], 5);  // 5 was generated: its +3 margin is gone after the penalties
}

TEST(SchedulerSampling, EachOfNChoicesEqualsASingleJobWithItsSeed) {
  auto backend = std::make_unique<FakeBackend>();
  EngineOptions o;
  o.max_seq = 64;
  o.cache = {2, 0};
  Scheduler scheduler(std::move(backend), nullptr, o);
  JobRequest r;
  r.prompt = {3, 1, 4, 1, 5};
  r.max_tokens = 8;
  r.sampling.temperature = 1.5f;
  r.sampling.seed = 1234;
  r.n = 3;
  r.logprobs = 1;
  auto job = scheduler.submit(r);
  const Choices all = drain(*job, 3);
  ASSERT_EQ(all.tokens.size(), 3u);
  EXPECT_NE(all.tokens[0], all.tokens[1]);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(all.seeds[i], choice_seed(1234, i));
    JobRequest single = r;
    single.n = 1;
    single.sampling.seed = choice_seed(1234, i);
    auto one = scheduler.submit(single);
    EXPECT_EQ(drain(*one, 1).tokens[0], all.tokens[i]) << "choice " << i;
  }
}

TEST(SchedulerSampling, TokenEventsCarryTheirChoiceAndLogprobs) {
  auto backend = std::make_unique<FakeBackend>();
  EngineOptions o;
  o.max_seq = 64;
  Scheduler scheduler(std::move(backend), nullptr, o);
  JobRequest r;
  r.prompt = {2, 7};
  r.max_tokens = 3;
  r.n = 2;
  r.logprobs = 0;
  auto job = scheduler.submit(r);
  std::vector<int> choices;
  while (true) {
    auto e = job->next_event(5000ms);
    ASSERT_TRUE(e);
    if (e->kind == JobEvent::Kind::kToken) {
      choices.push_back(e->choice);
      EXPECT_TRUE(e->logprobs.has_value());
    }
    if (e->kind == JobEvent::Kind::kDone && e->choice == 1) break;
  }
  EXPECT_EQ(choices, (std::vector<int>{0, 0, 0, 1, 1, 1}));
}

namespace {

/// generation_config_sampling of a directory holding only `text` as generation_config.json.
SamplingParams from_config(const std::string& text) {
  lily::test::TempDir dir;
  std::ofstream(dir.path() / "generation_config.json") << text;
  return generation_config_sampling(dir.path());
}

}  // namespace

TEST(GenerationConfig, ReadAsTransformersDoes) {
  lily::test::TempDir empty;
  EXPECT_TRUE(generation_config_sampling(empty.path()).plain_greedy());  // no file: greedy
  // Without do_sample the temperature is ignored (greedy), the repetition penalty is not.
  const auto greedy = from_config(R"({"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1})");
  EXPECT_TRUE(greedy.greedy());
  EXPECT_FLOAT_EQ(greedy.repetition_penalty, 1.1f);
  // do_sample: the given values, transformers' defaults for the rest (temperature 1, top_k 50).
  const auto qwen = from_config(R"({"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20})");
  EXPECT_FLOAT_EQ(qwen.temperature, 0.6f);
  EXPECT_FLOAT_EQ(qwen.top_p, 0.95f);
  EXPECT_EQ(qwen.top_k, 20);
  EXPECT_FLOAT_EQ(qwen.min_p, 0.0f);
  const auto bare = from_config(R"({"do_sample": true})");
  EXPECT_FLOAT_EQ(bare.temperature, 1.0f);
  EXPECT_EQ(bare.top_k, 50);
  EXPECT_FLOAT_EQ(bare.top_p, 1.0f);
  EXPECT_THROW(from_config("[1]"), Error);
  EXPECT_THROW(from_config(R"({"do_sample": "yes"})"), Error);
  EXPECT_THROW(from_config(R"({"do_sample": true, "top_p": 3})"), Error);
}
