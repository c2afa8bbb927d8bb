// Unit tests of the byte-level BPE tokenizer (docs/model.md §5) on tiny hand-made
// tokenizer.json files and on the demo model's tokenizer. The goldens against Hugging Face
// tokenizers live in tests/node/tokenizer.test.mjs.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "support/test_support.h"
#include "text/bpe.h"
#include "text/split_regex.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace lily {
namespace {

using json = nlohmann::json;

constexpr const char* kQwen35Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The byte-level symbol of one byte, as a UTF-8 string.
std::string sym(uint8_t b) {
  std::string s;
  utf8::append_code_point(s, utf8::byte_to_code_point()[b]);
  return s;
}

// A tokenizer.json with the 256 byte symbols (ids 0..255), the given merges (string form
// "a b"; merged tokens get ids from 256 on) and the Qwen3.6 control tokens.
json tiny_tokenizer(const std::vector<std::string>& merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[sym(static_cast<uint8_t>(b))] = b;
  int next = 256;
  for (const std::string& m : merges) {
    std::string merged = m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1);
    if (!vocab.contains(merged)) vocab[merged] = next++;
  }
  json added = json::array();
  auto add = [&](int id, const char* content, bool special) {
    vocab[content] = id;  // in the vocabulary, so that the sparse ids are what HF would assign
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", special}});
  };
  add(248044, "<|endoftext|>", true);
  add(248045, "<|im_start|>", true);
  add(248046, "<|im_end|>", true);
  add(248068, "<think>", false);
  add(248069, "</think>", false);
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", kQwen35Regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"byte_fallback", false},
            {"ignore_merges", false}, {"vocab", vocab}, {"merges", merges}}}};
}

class TinyTokenizer : public ::testing::Test {
 protected:
  std::shared_ptr<const Tokenizer> load(const json& j) {
    auto path = dir_.path() / ("tok" + std::to_string(count_++) + ".json");
    std::ofstream(path) << j.dump();
    return Tokenizer::from_file(path);
  }
  test::TempDir dir_;
  int count_ = 0;
};

TEST_F(TinyTokenizer, MergesApplyByRank) {
  auto tok = load(tiny_tokenizer({"h e", "l l", "he ll", "hell o", sym(' ') + " w"}));
  int32_t hello = *tok->token_id("hello");
  EXPECT_EQ(tok->encode("hello"), std::vector<int32_t>{hello});
  // " world": the space merges with w only ("Ġw"), the rest stays bytes.
  EXPECT_EQ(tok->encode(" wo"), (std::vector<int32_t>{*tok->token_id(sym(' ') + "w"), 'o'}));
  // Rank decides between overlapping merges: "a b" before "b c" gives [ab, c]; reversed gives [a, bc].
  auto ab_first = load(tiny_tokenizer({"a b", "b c"}));
  EXPECT_EQ(ab_first->encode("abc"), (std::vector<int32_t>{*ab_first->token_id("ab"), 'c'}));
  auto bc_first = load(tiny_tokenizer({"b c", "a b"}));
  EXPECT_EQ(bc_first->encode("abc"), (std::vector<int32_t>{'a', *bc_first->token_id("bc")}));
}

TEST_F(TinyTokenizer, PairFormMergesEqualStringForm) {
  json strings = tiny_tokenizer({"h e", "l l", "he ll", "hell o"});
  json pairs = strings;
  pairs["model"]["merges"] = json::array({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}});
  auto a = load(strings);
  auto b = load(pairs);
  for (const char* text : {"hello hello", "hell", "shellfish", "h e l l o"}) EXPECT_EQ(a->encode(text), b->encode(text)) << text;
}

TEST_F(TinyTokenizer, NfcNormalisesBeforeSplitting) {
  auto tok = load(tiny_tokenizer({}));
  EXPECT_EQ(tok->encode("e\xCC\x81"), tok->encode("\xC3\xA9"));  // e + U+0301 == é
  json no_nfc = tiny_tokenizer({});
  no_nfc["normalizer"] = nullptr;
  EXPECT_NE(load(no_nfc)->encode("e\xCC\x81"), tok->encode("\xC3\xA9"));
}

TEST_F(TinyTokenizer, AddedTokensOnlyWithAllowSpecial) {
  auto tok = load(tiny_tokenizer({}));
  EXPECT_EQ(tok->encode("<|im_start|>user", true).front(), 248045);
  std::vector<int32_t> plain = tok->encode("<|im_start|>user", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 248045), 0);
  EXPECT_EQ(tok->decode(plain), "<|im_start|>user");
  // Leftmost-longest: "<think>" inside "</think>" is not matched first.
  EXPECT_EQ(tok->encode("</think><think>", true), (std::vector<int32_t>{248069, 248068}));
}

TEST_F(TinyTokenizer, DecodeSkipsSpecialAndDropsUnknownIds) {
  auto tok = load(tiny_tokenizer({}));
  std::vector<int32_t> ids = {248045, 'h', 'i', 248068, 1000000, 248046, -3};
  EXPECT_EQ(tok->decode(ids, true), "hi<think>");
  EXPECT_EQ(tok->decode(ids, false), "<|im_start|>hi<think><|im_end|>");
  EXPECT_TRUE(tok->is_special(248045));
  EXPECT_FALSE(tok->is_special(248068));
  EXPECT_EQ(tok->vocab_size(), 248070);
  EXPECT_EQ(tok->token_bytes(' '), " ");  // id 32 is the byte-level symbol of the space
  EXPECT_EQ(tok->token_bytes(248046), "<|im_end|>");
  EXPECT_EQ(tok->token_view(' '), " ");  // the same bytes, without a copy
  EXPECT_EQ(tok->token_view(248046), "<|im_end|>");
  EXPECT_EQ(tok->token_view(1000000), "");
  EXPECT_EQ(tok->token_view(-3), "");
  // A lone lead byte decodes to U+FFFD.
  EXPECT_EQ(tok->decode(std::vector<int32_t>{0xE4, 'x'}), "\xEF\xBF\xBDx");
}

TEST_F(TinyTokenizer, InvalidUtf8InputBecomesReplacementCharacter) {
  auto tok = load(tiny_tokenizer({}));
  EXPECT_EQ(tok->encode("a\xFF" "b"), tok->encode("a\xEF\xBF\xBD" "b"));
  EXPECT_EQ(tok->encode("\xE2\x82"), tok->encode("\xEF\xBF\xBD"));  // one U+FFFD for a truncated sequence
}

TEST_F(TinyTokenizer, IncrementalDecoderNeverSplitsACharacter) {
  auto tok = load(tiny_tokenizer({}));  // no merges: one token per byte
  std::string text = "a\xC3\xA9\xF0\x9F\x98\x80\xE4\xB8\xAD!";  // a é 😀 中 !
  std::vector<int32_t> ids = tok->encode(text);
  ASSERT_EQ(ids.size(), text.size());
  IncrementalDecoder dec(tok);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(dec.push(id));
  EXPECT_EQ(pieces, (std::vector<std::string>{"a", "", "\xC3\xA9", "", "", "", "\xF0\x9F\x98\x80", "", "",
                                              "\xE4\xB8\xAD", "!"}));
  EXPECT_EQ(dec.flush(), "");
  // An incomplete tail is held back and flushed as U+FFFD.
  EXPECT_EQ(dec.push(0xF0), "");
  EXPECT_EQ(dec.push(0x9F), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");
  // An impossible continuation is emitted at once, like decode() would.
  EXPECT_EQ(dec.push(0xE4), "");
  EXPECT_EQ(dec.push('x'), "\xEF\xBF\xBDx");
  // Special tokens are skipped by default and kept on request.
  EXPECT_EQ(dec.push(248046), "");
  IncrementalDecoder keep(tok, false);
  EXPECT_EQ(keep.push(248046), "<|im_end|>");
  // A kept special token writes its text while the others stay skipped.
  IncrementalDecoder some(tok, true, {248046});
  EXPECT_EQ(some.push(248045), "");
  EXPECT_EQ(some.push(248046), "<|im_end|>");
  EXPECT_EQ(some.push(248044), "");
}

TEST_F(TinyTokenizer, RejectsUnsupportedParts) {
  auto expect_rejected = [&](const char* name, auto edit, const char* needle) {
    json j = tiny_tokenizer({});
    edit(j);
    try {
      load(j);
      ADD_FAILURE() << name << ": not rejected";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << name << ": " << e.what();
    }
  };
  expect_rejected("NFKC", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "NFKC");
  expect_rejected("WordPiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, "WordPiece");
  // An id is a table size: one past 2^22 − 1 (or near INT32_MAX, once a crash) is refused.
  expect_rejected("huge vocab id", [](json& j) { j["model"]["vocab"]["zzzq"] = 2147483647; }, "above the largest accepted");
  expect_rejected("large vocab id", [](json& j) { j["model"]["vocab"]["zzzq"] = 4194304; }, "id 4194304");
  expect_rejected("huge added id", [](json& j) { j["added_tokens"][0]["id"] = 2147483646; }, "above the largest accepted");
  expect_rejected("Split Removed", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }, "Isolated");
  expect_rejected("Split string", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}}; }, "Regex");
  expect_rejected("prefix space", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }, "add_prefix_space");
  expect_rejected("decoder", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder");
  expect_rejected("byte fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback");
  expect_rejected("rstrip", [](json& j) { j["added_tokens"][0]["rstrip"] = true; }, "rstrip");
  expect_rejected("template", [](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; }, "post_processor");
  expect_rejected("bad merge", [](json& j) { j["model"]["merges"] = {"x yz"}; }, "yz");
  expect_rejected("added id", [](json& j) { j["model"]["vocab"].erase("<|endoftext|>"); }, "would give it id");
  expect_rejected("bad regex", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; }, "regex");
  EXPECT_THROW(Tokenizer::from_file(dir_.path() / "missing.json"), Error);
}

TEST(SplitRegex, MatchesOnigurumaWhitespaceAndCaseRules) {
  SplitRegex re(kQwen35Regex);
  auto pieces = [&](std::string_view text) {
    std::vector<std::pair<size_t, size_t>> ranges;
    re.split(text, ranges);
    std::vector<std::string> out;
    for (auto [b, e] : ranges) out.emplace_back(text.substr(b, e - b));
    return out;
  };
  EXPECT_EQ(pieces("I'M here"), (std::vector<std::string>{"I", "'M", " here"}));
  EXPECT_EQ(pieces("a 123"), (std::vector<std::string>{"a", " ", "1", "2", "3"}));
  // U+017F (long s) after an apostrophe is not the contraction 's (PCRE2's caseless folding
  // would split "'ſ" + "t"); the apostrophe joins the letter run instead.
  EXPECT_EQ(pieces("'\xC5\xBFt"), (std::vector<std::string>{"'\xC5\xBFt"}));
  // U+180E is not White_Space: it joins the punctuation run.
  EXPECT_EQ(pieces("a\xE1\xA0\x8E."), (std::vector<std::string>{"a", "\xE1\xA0\x8E."}));
  // Combining marks belong to the letter run (Qwen3.5 regex).
  EXPECT_EQ(pieces("e\xCC\x81t\xC3\xA9"), (std::vector<std::string>{"e\xCC\x81t\xC3\xA9"}));
  EXPECT_EQ(pieces("x   \n\ny"), (std::vector<std::string>{"x", "   \n\n", "y"}));
  EXPECT_THROW(translate_pattern("(?x)a"), Error);
}

TEST(Utf8, LossyConversionAndIncompleteTails) {
  EXPECT_EQ(utf8::to_valid_lossy("ok"), "ok");
  EXPECT_EQ(utf8::to_valid_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");  // one maximal subpart
  EXPECT_EQ(utf8::to_valid_lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: two
  EXPECT_EQ(utf8::to_valid_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8::incomplete_tail_length("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(utf8::incomplete_tail_length("ab\xE4"), 1u);
  EXPECT_EQ(utf8::incomplete_tail_length("ab\xED\xA0"), 0u);  // can never complete
  EXPECT_EQ(utf8::incomplete_tail_length("\xE4\xB8\xAD"), 0u);
  EXPECT_EQ(utf8::nfc("A\xCC\x8A"), "\xC3\x85");
}

// The demo model's vocabulary and merges, loaded straight into a BpeModel.
BpeModel demo_bpe() {
  std::ifstream in(test::demo_model_dir() / "tokenizer.json");
  json j = json::parse(in);
  std::unordered_map<std::string, int32_t> vocab;
  for (const auto& [k, v] : j["model"]["vocab"].items()) vocab[k] = v.get<int32_t>();
  std::vector<std::pair<std::string, std::string>> merges;
  for (const json& m : j["model"]["merges"]) merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
  return BpeModel(std::move(vocab), merges, false);
}

TEST(Bpe, LinearAndHeapMergeAgree) {
  BpeModel bpe = demo_bpe();
  std::mt19937 gen(7);
  const std::string alphabet = "etaoin shrdlu the and of ing ion";
  for (int trial = 0; trial < 300; ++trial) {
    std::string word;
    int n = 1 + static_cast<int>(gen() % 90);
    for (int i = 0; i < n; ++i) word.push_back(alphabet[gen() % alphabet.size()]);
    std::vector<int32_t> symbols;
    for (char c : word) symbols.push_back(bpe.vocab().at(utf8::bytes_to_byte_level(std::string(1, c))));
    std::vector<int32_t> a = symbols, b = symbols;
    bpe.merge_linear(a);
    bpe.merge_heap(b);
    ASSERT_EQ(a, b) << word;
  }
}

TEST(DemoTokenizer, RoundTripsAndIsThreadSafe) {
  auto tok = Tokenizer::from_file(test::demo_model_dir() / "tokenizer.json");
  std::vector<std::string> texts = {"The capital of France is Paris.", "lily serve --model models/demo",
                                    "中文 and emoji 😀 and tabs\t\tand   spaces", "x = f(1, 2) + 3"};
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) {
    expected.push_back(tok->encode(t));
    EXPECT_EQ(tok->decode(expected.back()), t);
  }
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 200; ++round)
        for (size_t i = 0; i < texts.size(); ++i)
          if (tok->encode(texts[i]) != expected[i]) ++failures;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace lily
