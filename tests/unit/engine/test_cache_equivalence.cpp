// End to end through the real CPU backend on the demo model: the engine thread with a warm prefix
// cache produces exactly the tokens of an engine without cache — identical retries, next turns,
// a hit followed by exactly one new token, and prompts ending around prefill chunk boundaries.
#include <gtest/gtest.h>

#include <chrono>

#include "engine/scheduler.h"
#include "model/loader.h"
#include "support/test_support.h"

using namespace lily;
using namespace std::chrono_literals;

namespace {

using Tokens = std::vector<int32_t>;

struct Outcome {
  Tokens tokens;
  int64_t cached = 0;
};

Outcome run(Scheduler& s, const Tokens& prompt, int64_t max_tokens) {
  JobRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  auto job = s.submit(std::move(r));
  while (true) {
    auto e = job->next_event(60000ms);
    if (!e) throw std::runtime_error("engine timed out");
    if (e->kind == JobEvent::Kind::kFailed) throw std::runtime_error(e->text);
    if (e->kind == JobEvent::Kind::kDone) return {e->result.token_ids, e->result.cached_tokens};
  }
}

std::unique_ptr<Scheduler> engine(std::shared_ptr<const ModelWeights> weights, int cache_entries) {
  EngineOptions o;
  o.max_seq = 1024;
  o.max_queue = 4;
  o.cache = {cache_entries, 0};
  return std::make_unique<Scheduler>(make_backend(BackendKind::kCpu, weights, 2), nullptr, o);
}

/// Ordinary (non-special) demo-model ids, spread over the vocabulary.
Tokens synthetic_prompt(size_t n) {
  Tokens t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 2654435761u) % 8000u);
  return t;
}

}  // namespace

TEST(CacheEquivalence, WarmCacheGivesTheTokensOfNoCacheAroundChunkBoundaries) {
  auto weights = load_model(lily::test::demo_model_dir());
  auto warm = engine(weights, 4);
  auto cold = engine(weights, 0);
  for (size_t n : {127u, 128u, 129u, 257u}) {
    SCOPED_TRACE("prompt length " + std::to_string(n));
    const Tokens prompt = synthetic_prompt(n);
    const Outcome first = run(*warm, prompt, 4);
    const Outcome reference = run(*cold, prompt, 4);
    EXPECT_EQ(first.tokens, reference.tokens);
    EXPECT_EQ(reference.cached, 0);

    const Outcome retry = run(*warm, prompt, 4);
    EXPECT_EQ(retry.cached, static_cast<int64_t>(n) - 1);
    EXPECT_EQ(retry.tokens, reference.tokens);

    Tokens next = prompt;
    next.insert(next.end(), first.tokens.begin(), first.tokens.end());
    next.insert(next.end(), {11, 12, 13});
    const Outcome turn2 = run(*warm, next, 3);
    EXPECT_EQ(turn2.cached, static_cast<int64_t>(n + first.tokens.size()) - 1);
    EXPECT_EQ(turn2.tokens, run(*cold, next, 3).tokens);

    next.push_back(14);
    const Outcome one = run(*warm, next, 1);
    EXPECT_GT(one.cached, 0);
    EXPECT_EQ(one.tokens, run(*cold, next, 1).tokens);
  }
}
