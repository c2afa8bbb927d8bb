// The prefix cache's logic over a fake backend: strict prefixes, key preference, non-consuming
// hits, identical retries, branches, LRU eviction, byte bound, and output equality with and
// without the cache through the real generation loop.
#include <gtest/gtest.h>

#include "engine/generate.h"
#include "engine/session_cache.h"
#include "fake_backend.h"

using namespace lily;
using lily::test::FakeBackend;
using lily::test::FakeState;

namespace {

using Tokens = std::vector<int32_t>;

ResumePoint point(FakeBackend& b, const Tokens& tokens) {
  auto s = b.new_state(1000);
  b.prefill(*s, tokens);
  return ResumePoint{tokens, std::move(s)};
}

void store(SessionCache& c, FakeBackend& b, std::vector<Tokens> point_tokens,
           std::optional<std::string> key = std::nullopt) {
  std::vector<ResumePoint> points;
  for (auto& t : point_tokens) points.push_back(point(b, t));
  c.store(std::move(points), key);
}

/// One request through cache + generate, as the scheduler does it.
struct Outcome {
  Tokens tokens;
  int64_t cached = 0;
};
Outcome request(SessionCache& c, FakeBackend& b, const Tokens& prompt, int64_t max_tokens,
                std::optional<std::string> key = std::nullopt) {
  auto hit = c.acquire(b, prompt, key);
  auto state = hit.state ? std::move(hit.state) : b.new_state(1000);
  std::vector<ResumePoint> points;
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.max_seq = 1000;
  auto r = generate(b, *state, prompt, p, nullptr, {}, [&](const SequenceState& s, int64_t n) {
    points.push_back({Tokens(prompt.begin(), prompt.begin() + n), b.clone_state(s)});
  });
  Tokens fed(prompt);
  fed.insert(fed.end(), r.token_ids.begin(), r.token_ids.begin() + r.fed_tokens);
  points.push_back({fed, std::move(state)});
  c.store(std::move(points), key);
  return {r.token_ids, r.cached_tokens};
}

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(StrictPrefix, OnlyShorterEqualBeginnings) {
  EXPECT_TRUE(is_strict_prefix(Tokens{1, 2}, Tokens{1, 2, 3}));
  EXPECT_FALSE(is_strict_prefix(Tokens{1, 2}, Tokens{1, 2}));
  EXPECT_FALSE(is_strict_prefix(Tokens{1, 9}, Tokens{1, 2, 3}));
  EXPECT_TRUE(is_strict_prefix(Tokens{}, Tokens{1}));
}

TEST(SessionCache, MissOnEmptyCacheAndHitOnLongestPrefix) {
  FakeBackend b;
  SessionCache c({4, 0});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
  store(c, b, {{1, 2}});
  store(c, b, {{1, 2, 3, 4}});
  store(c, b, {{1, 7, 7}});
  auto hit = c.acquire(b, Tokens{1, 2, 3, 4, 5}, std::nullopt);
  ASSERT_NE(hit.state, nullptr);
  EXPECT_EQ(hit.cached_tokens, 4);
  EXPECT_EQ(static_cast<FakeState&>(*hit.state).history, (Tokens{1, 2, 3, 4}));
  auto st = c.stats();
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.misses, 1);
  EXPECT_EQ(st.entries, 3);
}

TEST(SessionCache, EqualLengthIsNotAHit) {
  FakeBackend b;
  SessionCache c({2, 0});
  store(c, b, {{1, 2, 3}});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
}

TEST(SessionCache, HitDoesNotConsumeTheEntry) {
  FakeBackend b;
  SessionCache c({2, 0});
  store(c, b, {{1, 2}});
  auto first = c.acquire(b, Tokens{1, 2, 3}, std::nullopt);
  ASSERT_NE(first.state, nullptr);
  b.prefill(*first.state, Tokens{3});  // mutate the clone
  auto second = c.acquire(b, Tokens{1, 2, 4}, std::nullopt);
  ASSERT_NE(second.state, nullptr);
  EXPECT_EQ(static_cast<FakeState&>(*second.state).history, (Tokens{1, 2}));
}

TEST(SessionCache, KeyPrefersItsEntryOverALongerOneButNeverBypassesTokens) {
  FakeBackend b;
  SessionCache c({4, 0});
  store(c, b, {{1, 2}}, "conv-a");
  store(c, b, {{1, 2, 3}}, "conv-b");
  store(c, b, {{9, 9}}, "conv-c");
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("conv-a")).cached_tokens, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::nullopt).cached_tokens, 3);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("other")).cached_tokens, 3);
  // conv-c's tokens do not match: the key does not force a hit.
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("conv-c")).cached_tokens, 3);
}

TEST(SessionCache, EvictsLeastRecentlyUsedFirst) {
  FakeBackend b;
  SessionCache c({2, 0});
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  ASSERT_NE(c.acquire(b, Tokens{1, 1, 5}, std::nullopt).state, nullptr);  // {1,1} is now newer
  store(c, b, {{3, 3}});                                                  // evicts {2,2}
  EXPECT_EQ(c.acquire(b, Tokens{2, 2, 5}, std::nullopt).state, nullptr);
  EXPECT_NE(c.acquire(b, Tokens{1, 1, 5}, std::nullopt).state, nullptr);
  EXPECT_NE(c.acquire(b, Tokens{3, 3, 5}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.stats().evictions, 1);
  EXPECT_EQ(c.stats().entries, 2);
}

TEST(SessionCache, ByteBoundEvictsAndRefusesOversizedEntries) {
  FakeBackend b;
  // FakeState bytes = 1000 + 4·tokens: two 2-token states fit in 2100, three do not.
  SessionCache c({10, 2100});
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  EXPECT_EQ(c.stats().entries, 2);
  store(c, b, {{3, 3}});
  EXPECT_EQ(c.stats().entries, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 1, 5}, std::nullopt).state, nullptr);
  EXPECT_LE(c.stats().bytes, 2100);
  store(c, b, {{4, 4}, Tokens(30, 4)});  // 1008 + 1120 > 2100 alone: not stored
  EXPECT_EQ(c.acquire(b, Tokens(31, 4), std::nullopt).state, nullptr);
  EXPECT_EQ(c.stats().entries, 2);
}

TEST(SessionCache, DisabledCacheNeverHitsOrStores) {
  FakeBackend b;
  SessionCache c({0, 0});
  EXPECT_FALSE(c.enabled());
  store(c, b, {{1, 2}});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.stats().entries, 0);
}

TEST(SessionCache, InconsistentPointsAreDropped) {
  FakeBackend b;
  SessionCache c({2, 0});
  std::vector<ResumePoint> points;
  points.push_back(point(b, {1, 2, 3}));
  points[0].tokens = {1, 2};  // state position 3 ≠ 2 tokens
  c.store(std::move(points), std::nullopt);
  EXPECT_EQ(c.stats().entries, 0);
}

TEST(SessionCacheFlow, IdenticalRetryHitsAndGivesTheSameOutput) {
  FakeBackend b;
  SessionCache c({2, 0});
  const Tokens prompt{5, 6, 7, 8, 9};
  auto first = request(c, b, prompt, 6);
  auto retry = request(c, b, prompt, 6);
  EXPECT_EQ(first.cached, 0);
  EXPECT_EQ(retry.cached, 4);  // resumes one token before the end of the prompt
  EXPECT_EQ(first.tokens, retry.tokens);
  // The retry replaced the first request's resume points instead of piling up copies.
  EXPECT_EQ(c.stats().entries, 1);
}

TEST(SessionCacheFlow, NextTurnHitsTheFinalState) {
  FakeBackend b;
  SessionCache c({2, 0});
  const Tokens turn1{5, 6, 7};
  auto a = request(c, b, turn1, 4);
  const Tokens turn2 = concat(concat(turn1, a.tokens), {42, 43});
  auto r = request(c, b, turn2, 4);
  EXPECT_EQ(r.cached, static_cast<int64_t>(turn1.size() + a.tokens.size() - 1));
}

TEST(SessionCacheFlow, TwoBranchesOfOneConversationBothHit) {
  FakeBackend b;
  SessionCache c({2, 0});
  const Tokens turn1{5, 6, 7};
  auto a = request(c, b, turn1, 4);
  const int64_t reuse = static_cast<int64_t>(turn1.size() + a.tokens.size() - 1);
  auto branch1 = request(c, b, concat(concat(turn1, a.tokens), {100}), 3);
  auto branch2 = request(c, b, concat(concat(turn1, a.tokens), {200}), 3);
  EXPECT_EQ(branch1.cached, reuse);
  // Branch 1's prompt snapshot (turn 1 + answer, without its new user token) is even longer.
  EXPECT_GE(branch2.cached, reuse);
  // And the first turn's entry still serves a third branch.
  auto branch3 = request(c, b, concat(concat(turn1, a.tokens), {300}), 3);
  EXPECT_GE(branch3.cached, reuse);
}

TEST(SessionCacheFlow, OutputsAreIdenticalWithAndWithoutCache) {
  FakeBackend warm_backend, cold_backend;
  SessionCache warm({4, 0}), cold({0, 0});
  Tokens convo{1, 2, 3};
  for (int turn = 0; turn < 4; ++turn) {
    auto w = request(warm, warm_backend, convo, 5);
    auto k = request(cold, cold_backend, convo, 5);
    EXPECT_EQ(w.tokens, k.tokens) << "turn " << turn;
    EXPECT_EQ(k.cached, 0);
    if (turn > 0) {
      EXPECT_GT(w.cached, 0) << "turn " << turn;
    }
    convo = concat(concat(convo, w.tokens), {static_cast<int32_t>(50 + turn)});
  }
  // A hit followed by exactly one new token.
  auto w = request(warm, warm_backend, convo, 1);
  auto k = request(cold, cold_backend, convo, 1);
  EXPECT_EQ(w.tokens, k.tokens);
  EXPECT_EQ(w.tokens.size(), 1u);
  EXPECT_GT(w.cached, 0);
}
