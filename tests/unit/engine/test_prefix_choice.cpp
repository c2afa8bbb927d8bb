// The prefix-choice constraint (engine/prefix_choice.h) on hand-made token tables, and inside
// the generation loop over the fake backend with the demo tokenizer: greedy, host-sampled and
// "device"-sampled generations all begin with one of the choices, and are free after it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/generate.h"
#include "engine/prefix_choice.h"
#include "fake_backend.h"
#include "support/demo_tokenizer.h"
#include "support/test_support.h"
#include "text/tokenizer.h"

using namespace lily;
using lily::test::FakeBackend;

namespace {

// A vocabulary where names can be spelled byte by byte or with merged tokens; id 12 adds no
// bytes (a special token).
const std::vector<std::string> kTokens = {
    "g", "e", "t", "_", "time", "get", "_time>", ">", "\n", ">\n", "set", "_counter", "", "get_weather", ">\n\n",
    "s", "_t", "\xc3", "\xa9", "\xc3\xa9>\n", "x"};

PrefixChoiceConstraint table_constraint(std::vector<std::string> choices) {
  return PrefixChoiceConstraint(std::move(choices), static_cast<int32_t>(kTokens.size()),
                                [](int32_t id) { return std::string_view(kTokens.at(static_cast<size_t>(id))); });
}

int32_t id_of(const std::string& bytes) {
  for (size_t i = 0; i < kTokens.size(); ++i)
    if (kTokens[i] == bytes) return static_cast<int32_t>(i);
  throw std::runtime_error("no token " + bytes);
}

std::vector<int32_t> ids_of(const std::vector<std::string>& tokens) {
  std::vector<int32_t> ids;
  for (const auto& t : tokens) ids.push_back(id_of(t));
  return ids;
}

/// The bytes of `ids` (special tokens add none).
std::string text_of(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids)
    if (!tok.is_special(id)) out += tok.token_bytes(id);
  return out;
}

}  // namespace

TEST(PrefixChoice, AllowsOnlyTokensThatKeepTheTextAPrefixOfAChoice) {
  PrefixChoiceConstraint c = table_constraint({"get_time>\n", "set_counter>\n"});
  EXPECT_TRUE(c.active());
  EXPECT_EQ(c.allowed(), ids_of({"g", "get", "set", "s"}));
  EXPECT_FALSE(c.allows(id_of("")));  // adds nothing: never allowed
  EXPECT_FALSE(c.allows(-1));
  EXPECT_FALSE(c.allows(static_cast<int32_t>(kTokens.size())));
  c.push(id_of("get"));
  EXPECT_EQ(c.text(), "get");
  // "_counter" belongs to the other name, "get_weather" is not declared.
  EXPECT_EQ(c.allowed(), ids_of({"_", "_time>", "_t"}));
  c.push(id_of("_"));
  EXPECT_EQ(c.allowed(), ids_of({"t", "time"}));  // "_t" would give "get__t"
  c.push(id_of("time"));
  EXPECT_EQ(c.allowed(), ids_of({">", ">\n"}));  // not ">\n\n", which runs past the choice
  EXPECT_TRUE(c.active());
}

TEST(PrefixChoice, EndsWhenTheTextEqualsAChoiceAndNeverOverrunsIt) {
  PrefixChoiceConstraint c = table_constraint({"get_time>\n", "set_counter>\n"});
  for (const char* t : {"get", "_time>"}) {
    ASSERT_TRUE(c.active()) << t;
    c.push(id_of(t));
  }
  // Only the newline completes it: ">\n\n" would run past the choice.
  EXPECT_EQ(c.allowed(), ids_of({"\n"}));
  c.push(id_of("\n"));
  EXPECT_FALSE(c.active());
  EXPECT_EQ(c.text(), "get_time>\n");
  // Free from here on.
  EXPECT_TRUE(c.allows(id_of("x")));
  EXPECT_EQ(c.allowed().size(), kTokens.size());
  c.push(id_of("x"));
  EXPECT_EQ(c.text(), "get_time>\n");
  std::vector<float> row(kTokens.size(), 1.0f);
  EXPECT_EQ(c.mask(row), kTokens.size());
  EXPECT_EQ(row, std::vector<float>(kTokens.size(), 1.0f));

  // The other name, ending with a merged ">\n".
  PrefixChoiceConstraint d = table_constraint({"get_time>\n", "set_counter>\n"});
  for (const char* t : {"set", "_counter", ">\n"}) d.push(id_of(t));
  EXPECT_FALSE(d.active());
  EXPECT_EQ(d.text(), "set_counter>\n");
}

TEST(PrefixChoice, MaskSetsEveryDisallowedLogitToMinusInfinity) {
  PrefixChoiceConstraint c = table_constraint({"get_time>\n", "set_counter>\n"});
  std::vector<float> row(kTokens.size());
  for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<float>(i);
  EXPECT_EQ(c.mask(row), 4u);
  const std::vector<int32_t> allowed = ids_of({"g", "get", "set", "s"});
  for (size_t i = 0; i < row.size(); ++i) {
    const bool ok = std::find(allowed.begin(), allowed.end(), static_cast<int32_t>(i)) != allowed.end();
    if (ok) {
      EXPECT_EQ(row[i], static_cast<float>(i)) << i;
    } else {
      EXPECT_TRUE(std::isinf(row[i]) && row[i] < 0) << i;
    }
  }
  // Greedy and sampled choices from the masked row are allowed tokens.
  EXPECT_EQ(argmax_token(row), id_of("s"));
  for (double u : {0.0, 0.3, 0.7, 0.999999}) {
    const int32_t t = draw_token(row, {}, u);
    EXPECT_TRUE(c.allows(t)) << u;
  }
}

TEST(PrefixChoice, SpellsMultiByteCharactersAcrossTokens) {
  PrefixChoiceConstraint c = table_constraint({"\xc3\xa9>\n"});
  EXPECT_EQ(c.allowed(), ids_of({"\xc3", "\xc3\xa9>\n"}));
  c.push(id_of("\xc3"));
  EXPECT_EQ(c.allowed(), ids_of({"\xa9"}));
  c.push(id_of("\xa9"));
  c.push(id_of(">\n"));
  EXPECT_FALSE(c.active());
}

TEST(PrefixChoice, GivesUpWhenNoTokenCanContinue) {
  PrefixChoiceConstraint c = table_constraint({"zzz>\n"});
  std::vector<float> row(kTokens.size(), 0.5f);
  EXPECT_EQ(c.mask(row), kTokens.size());
  EXPECT_EQ(row, std::vector<float>(kTokens.size(), 0.5f));
  EXPECT_FALSE(c.active());
  // A token the constraint refuses ends it as well.
  PrefixChoiceConstraint d = table_constraint({"get>\n"});
  d.push(id_of("x"));
  EXPECT_FALSE(d.active());
}

TEST(PrefixChoice, RefusesEmptyChoices) {
  auto bytes = [](int32_t) { return std::string_view("a"); };
  EXPECT_THROW(PrefixChoiceConstraint({}, 4, bytes), Error);
  EXPECT_THROW(PrefixChoiceConstraint({"a", ""}, 4, bytes), Error);
  EXPECT_THROW(PrefixChoiceConstraint({"a"}, 0, bytes), Error);
}

// The generation loop: the fake backend's own answer (a hash of the history) would not spell a
// name; with prefix_choices every generation starts with one, greedy or sampled, with the host
// sampler or the backend's "device" sampler, and is the backend's own choice afterwards.
TEST(PrefixChoice, GenerationsBeginWithAChoiceGreedyAndSampled) {
  const auto tokenizer = test::demo_tokenizer();
  const std::vector<std::string> choices = {"get_time>\n", "set_counter>\n", "set_alarm>\n"};
  const std::vector<int32_t> prompt = {101, 202, 303};
  auto starts_with_choice = [&](const std::string& text) {
    for (const auto& c : choices)
      if (text.starts_with(c)) return true;
    return false;
  };
  auto run = [&](FakeBackend& b, float temperature, uint64_t seed) {
    GenerationParams p;
    p.max_tokens = 24;
    p.max_seq = 1000;
    p.sampling.temperature = temperature;
    p.sampling.seed = seed;
    p.prefix_choices = choices;
    auto s = b.new_state(1000);
    return generate(b, *s, prompt, p, tokenizer.get()).token_ids;
  };

  {  // Unconstrained, the backend writes no name.
    FakeBackend b(tokenizer->vocab_size());
    auto s = b.new_state(1000);
    GenerationParams p;
    p.max_tokens = 24;
    p.max_seq = 1000;
    EXPECT_FALSE(starts_with_choice(text_of(*tokenizer, generate(b, *s, prompt, p, tokenizer.get()).token_ids)));
  }
  FakeBackend greedy_backend(tokenizer->vocab_size());
  const std::vector<int32_t> greedy = run(greedy_backend, 0.0f, 0);
  const std::string text = text_of(*tokenizer, greedy);
  ASSERT_TRUE(starts_with_choice(text)) << text;
  EXPECT_GT(greedy_backend.logits_calls, 0);  // plain greedy copies the logits while constrained
  // Free once the name is written: every later token is the backend's own argmax.
  size_t k = 0;
  for (std::string written; k < greedy.size() && !starts_with_choice(written); ++k)
    written += tokenizer->token_bytes(greedy[k]);
  ASSERT_LT(k, greedy.size());
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), greedy.begin(), greedy.begin() + static_cast<std::ptrdiff_t>(k));
  for (size_t i = k; i < greedy.size(); ++i) {
    EXPECT_EQ(greedy[i], greedy_backend.next_token(history)) << i;
    history.push_back(greedy[i]);
  }
  EXPECT_EQ(greedy_backend.logits_calls, static_cast<int>(k));  // no logits once free

  std::set<std::string> names;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    FakeBackend host(tokenizer->vocab_size());
    const std::vector<int32_t> sampled = run(host, 1.0f, seed);
    const std::string t = text_of(*tokenizer, sampled);
    EXPECT_TRUE(starts_with_choice(t)) << seed << ": " << t;
    names.insert(t.substr(0, t.find('>')));
    // A backend that samples on its device: constrained steps are sampled on the host from the
    // masked logits, the rest on the "device", with the same draws.
    FakeBackend device(tokenizer->vocab_size());
    device.device_sampling = true;
    const std::vector<int32_t> on_device = run(device, 1.0f, seed);
    EXPECT_EQ(on_device, sampled) << seed;
    size_t constrained = 0;
    for (std::string written; !starts_with_choice(written); ++constrained)
      written += tokenizer->token_bytes(on_device[constrained]);
    EXPECT_EQ(device.device_sampled_rows, static_cast<int>(on_device.size() - constrained)) << seed;
  }
  EXPECT_GT(names.size(), 1u);  // sampling reaches different names
}

TEST(PrefixChoice, GenerationNeedsATokenizer) {
  FakeBackend b(64);
  auto s = b.new_state(100);
  GenerationParams p;
  p.max_tokens = 4;
  p.max_seq = 100;
  p.prefix_choices = {"a>\n"};
  const std::vector<int32_t> prompt = {1, 2};
  EXPECT_THROW(generate(b, *s, prompt, p, nullptr), Error);
}
