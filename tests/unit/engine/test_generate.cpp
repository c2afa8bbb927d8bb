// The generation loop over a deterministic fake backend (token logic) and the demo model's real
// tokenizer (text, stop strings, stop tokens).
#include <gtest/gtest.h>

#include "engine/generate.h"
#include "fake_backend.h"
#include "model/config.h"
#include "support/demo_tokenizer.h"
#include "support/test_support.h"
#include "text/tokenizer.h"

using namespace lily;
using lily::test::demo_tokenizer;
using lily::test::FakeBackend;

namespace {

GenerationParams params(int64_t max_tokens, int64_t max_seq = 1000) {
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.max_seq = max_seq;
  return p;
}

/// A backend that emits `script` one token after another, then `tail` forever.
void play(FakeBackend& b, std::vector<int32_t> script, size_t prompt_len, int32_t tail = 5) {
  b.script = [script, prompt_len, tail](const std::vector<int32_t>& h) {
    const size_t i = h.size() - prompt_len;
    return i < script.size() ? script[i] : tail;
  };
}

/// A generation's result and the text its callback streamed.
struct Streamed {
  GenerationResult result;
  std::string text;
};

/// Generates from prompt {1} over a backend playing `script`, collecting the streamed text; when
/// `never_streamed` is given, expects it absent from the stream after every piece.
Streamed generate_streamed(const std::vector<int32_t>& script, int64_t state_len, const GenerationParams& p,
                           const Tokenizer& tok, const std::string& never_streamed = "") {
  FakeBackend b;
  play(b, script, 1);
  auto s = b.new_state(state_len);
  Streamed out;
  out.result = generate(b, *s, std::vector<int32_t>{1}, p, &tok, [&](int32_t, std::string_view t) {
    out.text += t;
    if (!never_streamed.empty()) {
      EXPECT_EQ(out.text.find(never_streamed), std::string::npos);
    }
    return true;
  });
  return out;
}

}  // namespace

TEST(Generate, StopsAtMaxTokensWithLength) {
  FakeBackend b;
  auto s = b.new_state(1000);
  const std::vector<int32_t> prompt{1, 2, 3};
  auto r = generate(b, *s, prompt, params(4), nullptr);
  EXPECT_EQ(r.token_ids.size(), 4u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(r.prompt_tokens, 3);
  EXPECT_EQ(r.cached_tokens, 0);
  // The last generated token is never fed: state = prompt + first three generated tokens.
  EXPECT_EQ(r.fed_tokens, 3);
  EXPECT_EQ(s->position(), 6);
  EXPECT_EQ(b.decode_calls, 3);
  EXPECT_EQ(r.timings.prefill_tokens, 3);
  EXPECT_EQ(r.timings.decode_steps, 3);
}

TEST(Generate, GreedyTokensFollowTheBackend) {
  FakeBackend b;
  auto s = b.new_state(1000);
  const std::vector<int32_t> prompt{7, 8, 9, 10};
  auto r = generate(b, *s, prompt, params(6), nullptr);
  std::vector<int32_t> history(prompt);
  for (int32_t t : r.token_ids) {
    EXPECT_EQ(t, b.next_token(history));
    history.push_back(t);
  }
}

TEST(Generate, StopTokenEndsGenerationAndIsCounted) {
  FakeBackend b;
  play(b, {11, 12, 99, 13}, 2);
  auto s = b.new_state(100);
  auto p = params(10);
  p.stop_ids = {99, 100};
  auto r = generate(b, *s, std::vector<int32_t>{1, 2}, p, nullptr);
  EXPECT_EQ(r.token_ids, (std::vector<int32_t>{11, 12, 99}));
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
}

TEST(Generate, StopTokenOnTheLastAllowedStepIsStop) {
  FakeBackend b;
  play(b, {11, 99}, 1);
  auto s = b.new_state(100);
  auto p = params(2);
  p.stop_ids = {99};
  auto r = generate(b, *s, std::vector<int32_t>{1}, p, nullptr);
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.token_ids.size(), 2u);
}

// min_tokens: a stop token the backend prefers is masked out of the first min_tokens choices
// (the runner-up, from the copied logits, is taken), and ends the answer once allowed.
TEST(Generate, MinTokensMasksTheStopTokensUntilReached) {
  FakeBackend b;
  play(b, {99, 99, 99, 99, 12}, 1);
  auto s = b.new_state(100);
  auto p = params(10);
  p.stop_ids = {99};
  p.min_tokens = 3;
  auto r = generate(b, *s, std::vector<int32_t>{1}, p, nullptr);
  ASSERT_EQ(r.token_ids.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(r.token_ids[i], 99) << i;
  EXPECT_EQ(r.token_ids[3], 99);  // allowed from the fourth token on: the backend's own choice
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(b.logits_calls, 3);  // plain greedy copies the logits only while the stops are masked

  // Without min_tokens the first token ends it; without stop tokens min_tokens changes nothing.
  FakeBackend b2;
  play(b2, {99, 12}, 1);
  auto s2 = b2.new_state(100);
  EXPECT_EQ(generate(b2, *s2, std::vector<int32_t>{1}, [] {
              auto q = params(10);
              q.stop_ids = {99};
              return q;
            }(), nullptr).token_ids,
            (std::vector<int32_t>{99}));
  FakeBackend b3;
  play(b3, {99, 99}, 1, 7);
  auto s3 = b3.new_state(100);
  auto q = params(4);
  q.min_tokens = 3;
  EXPECT_EQ(generate(b3, *s3, std::vector<int32_t>{1}, q, nullptr).token_ids, (std::vector<int32_t>{99, 99, 7, 7}));
  EXPECT_EQ(b3.logits_calls, 0);
}

TEST(Generate, CallbackReturningFalseCancelsBeforeTheNextDecode) {
  FakeBackend b;
  auto s = b.new_state(100);
  int calls = 0;
  auto r = generate(b, *s, std::vector<int32_t>{1, 2}, params(50), nullptr,
                    [&](int32_t, std::string_view) { return ++calls < 3; });
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(r.token_ids.size(), 3u);
  EXPECT_EQ(r.finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(b.decode_calls, 2);
}

TEST(Generate, StopsAtStateCapacity) {
  FakeBackend b;
  auto s = b.new_state(5);
  auto r = generate(b, *s, std::vector<int32_t>{1, 2, 3}, params(100, 5), nullptr);
  // Positions 0..4 can be fed: prompt 3 + 2 fed generated tokens, 3 generated in all.
  EXPECT_EQ(r.token_ids.size(), 3u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(s->position(), 5);
}

TEST(Generate, PromptPrefixHookSeesAllButTheLastPromptToken) {
  FakeBackend b;
  auto s = b.new_state(100);
  int64_t seen = -1;
  std::vector<int32_t> snapshot;
  generate(b, *s, std::vector<int32_t>{4, 5, 6, 7}, params(2), nullptr, {},
           [&](const SequenceState& st, int64_t n) {
             seen = n;
             snapshot = static_cast<const lily::test::FakeState&>(st).history;
           });
  EXPECT_EQ(seen, 3);
  EXPECT_EQ(snapshot, (std::vector<int32_t>{4, 5, 6}));
}

TEST(Generate, ResumingFromACachedPrefixGivesTheSameTokens) {
  FakeBackend b;
  const std::vector<int32_t> prompt{3, 1, 4, 1, 5, 9, 2, 6};
  auto fresh = b.new_state(100);
  auto a = generate(b, *fresh, prompt, params(8), nullptr);
  auto resumed = b.new_state(100);
  b.prefill(*resumed, std::span(prompt).subspan(0, 5));
  auto r = generate(b, *resumed, prompt, params(8), nullptr);
  EXPECT_EQ(r.cached_tokens, 5);
  EXPECT_EQ(r.timings.prefill_tokens, 3);
  EXPECT_EQ(a.token_ids, r.token_ids);
}

TEST(Generate, RejectsBadInputs) {
  FakeBackend b;
  auto s = b.new_state(4);
  EXPECT_THROW(generate(b, *s, std::vector<int32_t>{}, params(1, 4), nullptr), Error);
  EXPECT_THROW(generate(b, *s, std::vector<int32_t>{1}, params(0, 4), nullptr), Error);
  EXPECT_THROW(generate(b, *s, std::vector<int32_t>{1, 2, 3, 4, 5}, params(1, 4), nullptr), Error);
  auto p = params(1, 4);
  p.stop_strings = {"x"};
  EXPECT_THROW(generate(b, *s, std::vector<int32_t>{1}, p, nullptr), Error);  auto q = params(1, 4);
  q.min_tokens = -1;
  EXPECT_THROW(generate(b, *s, std::vector<int32_t>{1}, q, nullptr), Error);
}

TEST(GenerateText, StopTokenIsNotPartOfTheText) {
  auto tok = demo_tokenizer();
  const std::vector<int32_t> hello = tok->encode("Hello there");
  auto im_end = tok->token_id("<|im_end|>");
  ASSERT_TRUE(im_end.has_value());
  std::vector<int32_t> script = hello;
  script.push_back(*im_end);
  auto p = params(50);
  p.stop_ids = {*im_end};
  const auto [r, streamed] = generate_streamed(script, 100, p, *tok);
  EXPECT_EQ(r.text, "Hello there");
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.token_ids.size(), hello.size() + 1);
  EXPECT_EQ(streamed, r.text.substr(0, streamed.size()));
}

TEST(GenerateText, StopStringTruncatesAndNeverStreamsItsStart) {
  auto tok = demo_tokenizer();
  const std::vector<int32_t> ids = tok->encode("The answer is 42. Done here.");
  auto p = params(100);
  p.stop_strings = {". Done"};
  const auto [r, streamed] = generate_streamed(ids, 200, p, *tok, ". D");
  EXPECT_EQ(r.text, "The answer is 42");
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_LT(r.token_ids.size(), ids.size());
  EXPECT_EQ(streamed, r.text.substr(0, streamed.size()));
}

TEST(GenerateText, HeldBackTextIsReleasedAtTheEnd) {
  auto tok = demo_tokenizer();
  const std::vector<int32_t> ids = tok->encode("abc STO");
  auto p = params(static_cast<int64_t>(ids.size()));
  p.stop_strings = {"STOP"};
  const auto [r, streamed] = generate_streamed(ids, 200, p, *tok);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(r.text, "abc STO");
  EXPECT_EQ(streamed.find("STO"), std::string::npos);  // held until the end
}

TEST(StopTokenIds, ConfigIdsPlusTokenizerConfigEos) {
  auto tok = demo_tokenizer();
  ModelConfig config;
  config.eos_token_ids = {8187};
  auto ids = stop_token_ids(config, lily::test::demo_model_dir(), tok.get());
  EXPECT_EQ(ids, (std::vector<int32_t>{8187, 8189}));  // tokenizer_config eos_token <|im_end|> = 8189
  auto without = stop_token_ids(config, lily::test::demo_model_dir(), nullptr);
  EXPECT_EQ(without, (std::vector<int32_t>{8187}));
}
