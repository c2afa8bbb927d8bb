// End to end through the real CPU backend on the demo model: the engine thread with a warm prefix
// cache produces exactly the tokens of an engine without cache — identical retries, next turns,
// a hit followed by exactly one new token, prompts ending around prefill chunk boundaries, and
// chat conversations that share a system prompt (resumed at its message boundary), greedy and
// seeded, also when the snapshots went through the host tier. Under the sanitizers
// (lily::test::kSanitized) each test runs fewer of its cases, all of the same kinds.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "engine/scheduler.h"
#include "model/loader.h"
#include "support/demo_tokenizer.h"
#include "support/test_support.h"
#include "text/chat_template.h"

using namespace lily;
using namespace std::chrono_literals;

namespace {

using Tokens = std::vector<int32_t>;

struct Outcome {
  Tokens tokens;
  int64_t cached = 0;
};

struct ChatOutcome {
  Tokens tokens;
  std::string text;
  int64_t cached = 0;
};

ChatOutcome run_job(Scheduler& s, JobRequest r) {
  auto job = s.submit(std::move(r));
  while (true) {
    auto e = job->next_event(60000ms);
    if (!e) throw std::runtime_error("engine timed out");
    if (e->kind == JobEvent::Kind::kFailed) throw std::runtime_error(e->text);
    if (e->kind == JobEvent::Kind::kDone) return {e->result.token_ids, e->result.text, e->result.cached_tokens};
  }
}

Outcome run(Scheduler& s, const Tokens& prompt, int64_t max_tokens) {
  JobRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  ChatOutcome o = run_job(s, std::move(r));
  return {o.tokens, o.cached};
}

std::unique_ptr<Scheduler> engine(std::shared_ptr<const ModelWeights> weights, SessionCacheOptions cache,
                                  std::shared_ptr<const Tokenizer> tokenizer = nullptr) {
  EngineOptions o;
  o.max_seq = 1024;
  o.max_queue = 4;
  o.cache = cache;
  return std::make_unique<Scheduler>(make_backend(BackendKind::kCpu, weights, 2, CudaOptions{}), std::move(tokenizer), o);
}
std::unique_ptr<Scheduler> engine(std::shared_ptr<const ModelWeights> weights, int64_t cache_bytes) {
  return engine(std::move(weights), SessionCacheOptions{cache_bytes, 0});
}

}  // namespace

TEST(CacheEquivalence, WarmCacheGivesTheTokensOfNoCacheAroundChunkBoundaries) {
  auto weights = load_model(lily::test::demo_model_dir());
  auto warm = engine(weights, int64_t{64} << 20);
  auto cold = engine(weights, 0);
  // 127 … 129 sat around the 128-token prefill chunk of the time this test was written; with
  // today's 256-token chunk (kDefaultStepTokens) 257 is the prompt that crosses one. Sanitizers:
  // 129 and 257.
  const std::vector<size_t> lengths =
      lily::test::kSanitized ? std::vector<size_t>{129, 257} : std::vector<size_t>{127, 128, 129, 257};
  for (size_t n : lengths) {
    SCOPED_TRACE("prompt length " + std::to_string(n));
    const Tokens prompt = lily::test::hash_prompt(static_cast<int>(n), lily::test::kDemoOrdinaryIds);
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

TEST(CacheEquivalence, ConversationsSharingASystemPromptResumeAfterItWithIdenticalAnswers) {
  auto weights = load_model(lily::test::demo_model_dir());
  auto tokenizer = lily::test::demo_tokenizer();
  auto tmpl = ChatTemplate::for_model(lily::test::demo_model_dir());
  std::string system = "You are the support assistant of a build tool company.";
  for (int i = 0; i < 6; ++i) system += " Rule " + std::to_string(i) + ": answer briefly and cite the manual.";
  // Cold and warm: one engine with a cache (the first conversation misses, the others hit);
  // disabled: an engine without one. A third engine keeps only 2 MiB on the "device" (about one snapshot), so the
  // shared system prompt's snapshot travels through the host tier.
  auto warm = engine(weights, SessionCacheOptions{int64_t{64} << 20, 0}, tokenizer);
  auto disabled = engine(weights, SessionCacheOptions{0, 0}, tokenizer);
  auto tiered = engine(weights, SessionCacheOptions{int64_t{2} << 20, int64_t{16} << 20}, tokenizer);
  // The first conversation misses, the others hit (sanitizers: one other).
  std::vector<std::string> questions = {"How do I install it?", "Why is my build slow?", "Can I cache builds?"};
  if (lily::test::kSanitized) questions.pop_back();
  int64_t system_tokens = 0;
  for (bool seeded : {false, true}) {
    SCOPED_TRACE(seeded ? "seeded sampling" : "greedy");
    for (size_t i = 0; i < questions.size(); ++i) {
      SCOPED_TRACE(questions[i]);
      // A different system prompt per mode, so that the seeded round starts cold too.
      const std::string sys_text = system + (seeded ? " Be friendly." : "");
      std::vector<ChatMessage> messages = {{ChatRole::kSystem, sys_text}, {ChatRole::kUser, questions[i]}};
      JobRequest r;
      r.prompt = tmpl->encode(*tokenizer, messages, ChatTemplateOptions{}, &r.message_starts);
      ASSERT_EQ(r.message_starts.size(), 2u);
      system_tokens = r.message_starts[0];
      ASSERT_GE(system_tokens, 100);
      r.max_tokens = 6;
      if (seeded) {
        r.sampling.temperature = 0.9f;
        r.sampling.seed = 1234 + i;
      }
      const ChatOutcome w = run_job(*warm, r), d = run_job(*disabled, r), t = run_job(*tiered, r);
      EXPECT_EQ(w.tokens, d.tokens);
      EXPECT_EQ(t.tokens, d.tokens);
      EXPECT_EQ(d.cached, 0);
      if (i == 0) {
        EXPECT_EQ(w.cached, 0);
      } else {
        EXPECT_GE(w.cached, system_tokens);
        EXPECT_GE(t.cached, system_tokens);
      }
      if (seeded) continue;
      // Turn 2 of this conversation resumes at least after turn 1's prompt and answers the same.
      messages.push_back({ChatRole::kAssistant, w.text});
      messages.push_back({ChatRole::kUser, "Thanks, and then?"});
      JobRequest r2 = r;
      r2.prompt = tmpl->encode(*tokenizer, messages, ChatTemplateOptions{}, &r2.message_starts);
      const ChatOutcome w2 = run_job(*warm, r2), d2 = run_job(*disabled, r2);
      EXPECT_EQ(w2.tokens, d2.tokens);
      EXPECT_GE(w2.cached, static_cast<int64_t>(r.prompt.size()));
    }
  }
  const SessionCacheStats st = tiered->cache_stats();
  EXPECT_GT(st.device.evictions, 0);
  EXPECT_GT(st.host.snapshots, 0);
  EXPECT_LE(st.device.bytes, st.device.budget);
  EXPECT_LE(st.host.bytes, st.host.budget);
  EXPECT_GE(warm->cache_stats().tokens_saved, 4 * system_tokens);
}

TEST(CacheEquivalence, TurnsAfterIdleSparesResumeWholeHistoriesWithIdenticalAnswers) {
  // Each turn comes after a pause in which the engine made spare state blocks (the copies of the
  // next turn land in them) and resumes from the previous turn's final state, which has room for
  // the new prompt: every answer is still the one an engine without a cache gives.
  auto weights = load_model(lily::test::demo_model_dir());
  auto tokenizer = lily::test::demo_tokenizer();
  auto tmpl = ChatTemplate::for_model(lily::test::demo_model_dir());
  auto warm = engine(weights, SessionCacheOptions{int64_t{64} << 20, 0}, tokenizer);
  auto tiered = engine(weights, SessionCacheOptions{int64_t{1} << 20, int64_t{64} << 20}, tokenizer);
  auto disabled = engine(weights, SessionCacheOptions{0, 0}, tokenizer);
  std::string system = "You explain build systems.";
  for (int i = 0; i < 20; ++i) system += " Fact " + std::to_string(i) + ": incremental builds reuse outputs.";
  std::vector<ChatMessage> messages = {{ChatRole::kSystem, system}};
  const int turns = lily::test::kSanitized ? 2 : 3;
  int64_t history = 0;
  for (int turn = 0; turn < turns; ++turn) {
    SCOPED_TRACE("turn " + std::to_string(turn + 1));
    messages.push_back({ChatRole::kUser, "Question " + std::to_string(turn) + ": what is a build graph?"});
    JobRequest r;
    r.prompt = tmpl->encode(*tokenizer, messages, ChatTemplateOptions{}, &r.message_starts);
    r.max_tokens = 12;
    std::this_thread::sleep_for(200ms);  // the engines are idle: spare blocks are made
    const ChatOutcome w = run_job(*warm, r), t = run_job(*tiered, r), d = run_job(*disabled, r);
    EXPECT_EQ(w.tokens, d.tokens);
    EXPECT_EQ(t.tokens, d.tokens);
    if (turn > 0) {
      EXPECT_GE(w.cached, history);  // at least the whole earlier conversation
      EXPECT_GE(t.cached, history);
    }
    messages.push_back({ChatRole::kAssistant, w.text});
    history = static_cast<int64_t>(r.prompt.size());
  }
}

