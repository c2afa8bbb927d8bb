// Forced tool calls (engine/tool_call_constraint.h): the grammar's fallbacks, the byte matcher on
// valid and invalid calls, the token mask against a brute-force check of every token of the demo
// vocabulary, random walks under the mask that never dead-end and always parse (with the
// server's own answer parser, server/tool_calls.h) into calls whose arguments satisfy the
// schema, and generations over the fake backend.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/generate.h"
#include "engine/tool_call_constraint.h"
#include "fake_backend.h"
#include "server/tool_calls.h"
#include "support/demo_tokenizer.h"

using namespace lily;
using nlohmann::json;
using nlohmann::ordered_json;

namespace {

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"},
    "detail": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
              "required": ["lat", "lon"], "additionalProperties": false}},
    "required": ["city", "unit"]}}},
  {"type": "function", "function": {"name": "add_note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "tag": {"type": ["string", "null"]}, "level": {"enum": ["low", "high"]}},
    "required": ["text"]}}},
  {"type": "function", "function": {"name": "get_time"}}
])";

const ordered_json& tools() {
  static const ordered_json t = ordered_json::parse(kTools);
  return t;
}

/// The grammar for the tools `decl` (typed as the server's parser types them); `named`: the
/// opening already names the first function.
std::shared_ptr<const ToolCallGrammar> grammar(const ordered_json& decl, bool named, bool more_calls) {
  std::vector<ToolCallGrammar::Declaration> functions;
  for (const auto& t : decl) {
    const auto& f = t["function"];
    functions.push_back({f["name"].get<std::string>(), f.contains("parameters") ? json::parse(f["parameters"].dump()) : json()});
  }
  auto schemas = std::make_shared<server::ToolSchemas>(decl);
  auto raw = [schemas](const std::string& f, const std::string& p) { return schemas->raw_string(f, p); };
  return ToolCallGrammar::compile(functions, raw, named ? std::optional<size_t>(0) : std::nullopt, more_calls);
}

ordered_json only(size_t i) { return ordered_json::array({tools()[i]}); }

std::shared_ptr<const ToolCallGrammar> weather() { return grammar(only(0), true, false); }
std::shared_ptr<const ToolCallGrammar> any_tool(bool more_calls) { return grammar(tools(), false, more_calls); }

/// Whether the whole of `text` is taken and closes the call.
bool closes(const std::shared_ptr<const ToolCallGrammar>& g, std::string_view text) {
  ToolCallMatcher m(g);
  return m.feed(text) && m.call_closed();
}

/// Whether every byte of `text` is taken.
bool takes(const std::shared_ptr<const ToolCallGrammar>& g, std::string_view text) {
  ToolCallMatcher m(g);
  return m.feed(text);
}

std::string param(const std::string& name, const std::string& value) {
  return "<parameter=" + name + ">\n" + value + "\n</parameter>\n";
}

const std::string kEnd = "</function>\n</tool_call>";

/// A small validator for the keywords of kTools: type, enum, maxLength, maxItems, items,
/// properties, required, additionalProperties: false.
bool valid(const json& v, const json& s) {
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end()) return false;
  if (s.contains("type")) {
    const json types = s["type"].is_array() ? s["type"] : json::array({s["type"]});
    bool any = false;
    for (const auto& t : types)
      any = any || (t == "string" && v.is_string()) || (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null()) ||
            (t == "number" && v.is_number()) || (t == "array" && v.is_array()) || (t == "object" && v.is_object()) ||
            (t == "integer" && (v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::trunc(v.get<double>()))));
    if (!any) return false;
  }
  if (v.is_string() && s.contains("maxLength")) {
    const std::string& str = v.get_ref<const std::string&>();
    const auto chars = std::count_if(str.begin(), str.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
    if (chars > s["maxLength"].get<int64_t>()) return false;
  }
  if (v.is_array()) {
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    for (const auto& item : v)
      if (s.contains("items") && !valid(item, s["items"])) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const auto& r : s.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [key, value] : v.items()) {
      if (!props.contains(key)) return false;  // undeclared: never written by the constraint
      if (!valid(value, props[key])) return false;
    }
  }
  return true;
}

/// Parses `text` (what followed `opening`) as the server does and checks every call: a declared
/// function whose arguments satisfy its schema. Returns the number of calls.
size_t check_calls(const std::string& opening, const std::string& text) {
  server::AnswerFormat format;
  format.tools.emplace(tools());
  format.prefix = opening;
  const server::AssistantMessage m = server::parse_answer(text, format);
  EXPECT_EQ(m.content, "") << opening << text;
  for (const auto& call : m.tool_calls) {
    json schema = json::object();
    for (const auto& t : tools())
      if (t["function"]["name"].get<std::string>() == call.name && t["function"].contains("parameters"))
        schema = json::parse(t["function"]["parameters"].dump());
    const json args = json::parse(call.arguments);
    EXPECT_TRUE(valid(args, schema)) << call.name << " " << call.arguments << "\nfrom: " << opening << text;
  }
  return m.tool_calls.size();
}

/// The id of the token whose bytes are exactly `s` (−1: none); one-byte ones looked up once.
int32_t token_of(const JsonVocabIndex& index, std::string_view s) {
  static const std::vector<int32_t> single = [&index] {
    std::vector<int32_t> ids(256, -1);
    for (int32_t id = 0; id < index.vocab(); ++id)
      if (index.bytes()[static_cast<size_t>(id)].size() == 1)
        ids[static_cast<unsigned char>(index.bytes()[static_cast<size_t>(id)][0])] = id;
    return ids;
  }();
  if (s.size() == 1) return single[static_cast<unsigned char>(s[0])];
  for (int32_t id = 0; id < index.vocab(); ++id)
    if (index.bytes()[static_cast<size_t>(id)] == s) return id;
  return -1;
}

std::shared_ptr<const ToolCallVocab> demo_vocab() {
  const auto& tokenizer = test::demo_tokenizer();
  return ToolCallVocab::for_tokenizer(*tokenizer, tokenizer->vocab_size(), {});
}

int32_t im_end() { return *test::demo_tokenizer()->token_id("<|im_end|>"); }

}  // namespace

TEST(ToolCallGrammar, UnfollowedAndLeftOut) {
  // The parameters the parser keeps raw: strings (a type list with "string" too, no type at all).
  const auto g = any_tool(true);
  const auto& w = g->functions()[0];
  ASSERT_TRUE(w.schema);
  auto parameter = [&](size_t function, const std::string& name) {
    for (const auto& p : g->functions()[function].parameters)
      if (p.name == name) return p;
    ADD_FAILURE() << name;
    return ToolCallGrammar::Parameter{};
  };
  EXPECT_EQ(w.parameters.size(), 6u);
  EXPECT_EQ(std::popcount(w.required), 2);
  EXPECT_TRUE(parameter(0, "city").raw);
  EXPECT_EQ(parameter(0, "city").max_chars, 12);
  EXPECT_EQ(parameter(0, "unit").texts.texts,
            (std::vector<std::string>{"celsius\n</parameter>\n", "fahrenheit\n</parameter>\n"}));
  EXPECT_FALSE(parameter(0, "days").raw);
  EXPECT_FALSE(parameter(0, "where").raw);
  EXPECT_TRUE(parameter(1, "tag").raw);
  EXPECT_TRUE(parameter(1, "level").raw);  // no type: raw, held to its strings
  EXPECT_TRUE(g->functions()[2].schema);             // no parameters: an empty call
  EXPECT_TRUE(g->functions()[2].parameters.empty());

  auto one = [](const char* parameters) {
    ordered_json t = only(2);
    t[0]["function"]["parameters"] = ordered_json::parse(parameters);
    return grammar(t, true, false);
  };
  // What JsonSchema::compile refuses, a required parameter that cannot be written, a marker the
  // matcher would have to refuse: the function is unfollowed; named alone, nothing is held.
  for (const char* refused : {
           R"({"type":"object","properties":{"a":{"type":"string"}},"allOf":[{}]})",
           R"({"type":"object","properties":{"a<b":{"type":"string"}},"required":["a<b"]})",
           R"({"type":"object","properties":{"n":{"type":["string","integer"],"enum":[1,2]}},"required":["n"]})",
           R"({"type":"object","properties":{"e":{"type":"string","enum":["x</parameter>"]}}})",
           R"({"type":"object","properties":{"o":{"type":"object","properties":{"</tool_call>":{"type":"integer"}}}}})"}) {
    const auto g1 = one(refused);
    EXPECT_FALSE(g1->functions()[0].schema) << refused;
    EXPECT_FALSE(g1->functions()[0].unfollowed.empty()) << refused;
    EXPECT_FALSE(g1->constrains()) << refused;
    EXPECT_TRUE(ToolCallMatcher(g1).free());
  }
  // The same parameters optional are only left out.
  const auto g2 = one(R"({"type":"object","properties":{"a<b":{"type":"string"},"n":{"type":["string","integer"],"enum":[1]},
                          "ok":{"type":"string"}}})");
  ASSERT_TRUE(g2->functions()[0].schema);
  ASSERT_EQ(g2->functions()[0].parameters.size(), 1u);
  EXPECT_EQ(g2->functions()[0].parameters[0].name, "ok");
  // Among several tools an unfollowed one still has its name held; after it the text is free.
  ordered_json two = tools();
  two[2]["function"]["parameters"] = ordered_json::parse(R"({"type":"object","not":{}})");
  const auto g3 = grammar(two, false, true);
  EXPECT_TRUE(g3->constrains());
  ToolCallMatcher m(g3);
  EXPECT_FALSE(ToolCallMatcher(g3).feed("lookup>"));
  ASSERT_TRUE(m.feed("get_time>\n"));
  EXPECT_TRUE(m.free());
  EXPECT_TRUE(m.feed("anything at all </tool_call> \xff"));
  EXPECT_THROW(ToolCallGrammar::compile({}, nullptr, std::nullopt, false), Error);
}

// Pydantic's untyped schemas: a nested model as a local $ref and Optional[int] as anyOf are JSON
// values the parser types by what they refer to, so required ones are followed, not unfollowed.
TEST(ToolCallGrammar, RefAndAnyOfParametersAreFollowedAsJson) {
  ordered_json t = only(2);
  t[0]["function"]["parameters"] = ordered_json::parse(R"({"type":"object","properties":{
      "p":{"$ref":"#/$defs/P"},"n":{"anyOf":[{"type":"integer"},{"type":"null"}]}},"required":["p","n"],
      "$defs":{"P":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"],"additionalProperties":false}}})");
  const auto g = grammar(t, true, false);
  ASSERT_TRUE(g->functions()[0].schema) << g->functions()[0].unfollowed;
  for (const auto& p : g->functions()[0].parameters) EXPECT_FALSE(p.raw) << p.name;
  EXPECT_TRUE(closes(g, param("p", R"({"x":1})") + param("n", "null") + kEnd));
  EXPECT_TRUE(closes(g, param("n", "7") + param("p", R"({"x":-2})") + kEnd));
  EXPECT_FALSE(takes(g, param("p", R"({"y":1})")));
  EXPECT_FALSE(takes(g, param("n", "\"7\"")));
  EXPECT_FALSE(closes(g, param("n", "7") + kEnd));  // p is required
}

namespace {

/// The grammar of one function whose parameters are `parameters` (JSON text), named.
std::shared_ptr<const ToolCallGrammar> one_function(const std::string& parameters) {
  ordered_json t = only(2);
  t[0]["function"]["parameters"] = ordered_json::parse(parameters);
  return grammar(t, true, false);
}

/// The names of the function's writable parameters.
std::vector<std::string> parameter_names(const std::shared_ptr<const ToolCallGrammar>& g) {
  std::vector<std::string> names;
  for (const auto& p : g->functions()[0].parameters) names.push_back(p.name);
  return names;
}

}  // namespace

// enum/const values are held to the schema's other keywords, for raw and JSON parameters alike;
// none left: a required parameter makes the function unfollowed, an optional one is left out.
TEST(ToolCallGrammar, LiteralsSatisfyTheRestOfTheSchema) {
  const auto g = one_function(R"({"type":"object","properties":{
      "size":{"type":"string","maxLength":2,"enum":["S","M","XXL"]},
      "pair":{"type":"array","maxItems":1,"enum":[[1,2],[3]]},
      "gone":{"type":"integer","const":5,"enum":[6,7]},
      "none":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"enum":[{}]}},
      "required":["size","pair"]})");
  ASSERT_TRUE(g->functions()[0].schema) << g->functions()[0].unfollowed;
  EXPECT_EQ(parameter_names(g), (std::vector<std::string>{"pair", "size"}));
  EXPECT_EQ(g->functions()[0].parameters[1].texts.texts, (std::vector<std::string>{"M\n</parameter>\n", "S\n</parameter>\n"}));
  EXPECT_TRUE(closes(g, param("size", "M") + param("pair", "[3]") + kEnd));
  EXPECT_FALSE(takes(g, "<parameter=size>\nX"));
  EXPECT_FALSE(takes(g, "<parameter=pair>\n[1"));
  for (const char* required : {R"({"type":"integer","const":5,"enum":[6,7]})", R"({"type":"string","const":"x","enum":["y","z"]})",
                               R"({"type":"array","maxItems":1,"const":[1,2]})",
                               R"({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":false,"const":{"b":1}})"}) {
    const auto u = one_function(std::string(R"({"type":"object","properties":{"p":)") + required + R"(},"required":["p"]})");
    EXPECT_FALSE(u->functions()[0].schema) << required;
    EXPECT_FALSE(u->functions()[0].unfollowed.empty()) << required;
  }
}

// A string enum of many values (with repeats) builds quickly (no quadratic dedup) and keeps
// each value once, sorted.
TEST(ToolCallGrammar, ALargeStringEnum) {
  constexpr int kValues = 50000;
  json values = json::array();
  for (int i = 0; i < kValues; ++i) values.push_back("v" + std::to_string(i));
  for (int i = 0; i < 100; ++i) values.push_back("v" + std::to_string(i));  // repeats
  json parameters = {{"type", "object"}, {"properties", {{"e", {{"type", "string"}, {"enum", values}}}}}, {"required", {"e"}}};
  const auto g = one_function(parameters.dump());
  ASSERT_TRUE(g->functions()[0].schema) << g->functions()[0].unfollowed;
  const auto& texts = g->functions()[0].parameters[0].texts.texts;
  ASSERT_EQ(texts.size(), static_cast<size_t>(kValues));
  EXPECT_TRUE(std::is_sorted(texts.begin(), texts.end()));
  EXPECT_TRUE(std::adjacent_find(texts.begin(), texts.end()) == texts.end());
  EXPECT_TRUE(closes(g, param("e", "v49999") + kEnd));
  EXPECT_FALSE(takes(g, param("e", "v50000")));
}

// A parameter name that needs JSON escaping or cannot be read back: optional, it is only left
// out (the function is still followed); required, the function is unfollowed.
TEST(ToolCallGrammar, UnwritableOptionalNamesAreLeftOut) {
  for (const std::string name : {"a\nb", "a\"b", "a\\b", "a\tb", "a\rb", "a<b", "a>b"}) {
    json parameters = {{"type", "object"}, {"properties", {{name, {{"type", "integer"}}}, {"ok", {{"type", "string"}}}}}};
    const auto optional = one_function(parameters.dump());
    ASSERT_TRUE(optional->functions()[0].schema) << json(name) << optional->functions()[0].unfollowed;
    EXPECT_EQ(parameter_names(optional), std::vector<std::string>{"ok"}) << json(name);
    parameters["required"] = {name};
    EXPECT_FALSE(one_function(parameters.dump())->functions()[0].schema) << json(name);
  }
  // An optional parameter whose own schema the JSON compiler refuses is left out as well.
  const auto refused = one_function(R"({"type":"object","properties":{"x":{"not":{}},"ok":{"type":"string"}},"required":["ok"]})");
  ASSERT_TRUE(refused->functions()[0].schema) << refused->functions()[0].unfollowed;
  EXPECT_EQ(parameter_names(refused), std::vector<std::string>{"ok"});
}

TEST(ToolCallMatcher, FollowsTheFormatAndTheSchema) {
  const auto g = weather();
  const std::string city = param("city", "Paris"), unit = param("unit", "celsius");
  EXPECT_TRUE(closes(g, city + unit + kEnd));
  EXPECT_TRUE(closes(g, unit + city + param("days", "3") + param("detail", "true") + param("hours", "[1,2,3]") +
                            param("where", R"({"lat": 48.8, "lon": 2.35})") + kEnd));
  EXPECT_TRUE(closes(g, param("city", "") + unit + kEnd));                 // an empty string
  EXPECT_TRUE(closes(g, param("city", "a\nb<c></x") + unit + kEnd));       // newlines and markup
  EXPECT_TRUE(closes(g, param("city", "Zürich 東京") + unit + kEnd));       // characters, not bytes
  EXPECT_TRUE(closes(g, param("city", "123456789012") + unit + kEnd));     // maxLength 12
  // Refused: a missing required parameter, an undeclared or repeated one, values of the wrong
  // type or outside the enum, a marker inside a value, whitespace around a JSON value, broken
  // UTF-8, a value past maxLength, anything after the call when no further call may follow.
  EXPECT_FALSE(takes(g, city + kEnd));
  EXPECT_FALSE(takes(g, "<parameter=country>"));
  EXPECT_FALSE(takes(g, city + city));
  EXPECT_FALSE(takes(g, param("days", "3.5")));
  EXPECT_FALSE(takes(g, param("days", "\"3\"")));
  EXPECT_FALSE(takes(g, param("detail", "yes")));
  EXPECT_FALSE(takes(g, param("unit", "kelvin")));
  EXPECT_FALSE(takes(g, param("hours", "[1,2,3,4]")));
  EXPECT_FALSE(takes(g, param("where", R"({"lat": 1})")));
  EXPECT_FALSE(takes(g, param("where", R"({"lat": 1, "lon": 2, "alt": 3})")));
  EXPECT_FALSE(takes(g, "<parameter=city>\nParis</parameter>"));
  EXPECT_FALSE(takes(g, "<parameter=city>\nPa</tool_call>"));
  EXPECT_FALSE(takes(g, "<parameter=where>\n{\"lat\": 1, \"lon\": 2, \"x</parameter>"));
  EXPECT_FALSE(takes(g, "<parameter=days>\n 3"));
  EXPECT_FALSE(takes(g, "<parameter=days>\n3 "));
  EXPECT_FALSE(takes(g, "<parameter=city>\nPa\xff"));
  EXPECT_FALSE(takes(g, "<parameter=city>\n\xe6\x9d\n"));  // a character cut short
  EXPECT_FALSE(takes(g, param("city", "1234567890123")));
  EXPECT_FALSE(takes(g, "<parameter=city>\n123456789012\n<x"));  // "\n<x" would be the value's
  EXPECT_FALSE(takes(g, city + unit + kEnd + "\n"));
  EXPECT_TRUE(takes(g, "<parameter=city>\n123456789012\n</para"));

  // Several tools: the name first; with more_calls a further call, as the template writes it.
  const auto several = any_tool(true);
  EXPECT_TRUE(closes(several, "get_time>\n" + kEnd));
  EXPECT_TRUE(closes(several, "get_time>\n" + kEnd + "\n<tool_call>\n<function=add_note>\n" + param("text", "x") + kEnd));
  EXPECT_TRUE(closes(several, "add_note>\n" + param("level", "high") + param("text", "") + kEnd));
  EXPECT_FALSE(takes(several, "add_note>\n" + param("level", "medium")));
  EXPECT_FALSE(takes(several, "get_times>"));
  EXPECT_FALSE(takes(several, "get_time>\n" + kEnd + "\n\n"));
  EXPECT_FALSE(takes(any_tool(false), "get_time>\n" + kEnd + "\n"));
  EXPECT_FALSE(ToolCallMatcher(several, /*more_calls=*/false).feed("get_time>\n" + kEnd + "\n"));
}

// The vocabulary is built once per tokenizer and set of kept special ids (in any order) and
// kept while no constraint holds it; the cache stays bounded.
TEST(ToolCallConstraint, VocabOutlivesItsConstraints) {
  const auto& tokenizer = test::demo_tokenizer();
  const int32_t vocab = tokenizer->vocab_size();
  const std::vector<int32_t> kept = {im_end(), 0}, reversed = {0, im_end()};
  const std::weak_ptr<const ToolCallVocab> first = ToolCallVocab::for_tokenizer(*tokenizer, vocab, kept);
  EXPECT_FALSE(first.expired());
  EXPECT_EQ(ToolCallVocab::for_tokenizer(*tokenizer, vocab, reversed), first.lock());
  const auto plain = demo_vocab();  // no kept special ids: another vocabulary
  EXPECT_NE(plain, first.lock());
  EXPECT_EQ(plain->index().bytes()[static_cast<size_t>(im_end())], "");
  EXPECT_EQ(first.lock()->index().bytes()[static_cast<size_t>(im_end())], "<|im_end|>");
  for (int32_t skip = 1; skip <= 8; ++skip) ToolCallVocab::for_tokenizer(*tokenizer, vocab - skip, kept);
  EXPECT_TRUE(first.expired());
}

// The mask at sampled states (prefixes of calls, as one-byte tokens would write them) equals a
// brute-force check of every token's bytes on a copy of the matcher.
TEST(ToolCallConstraint, MaskEqualsBruteForce) {
  const auto vocab = demo_vocab();
  const JsonVocabIndex& index = vocab->index();
  EXPECT_EQ(vocab.get(), demo_vocab().get());  // built once while in use
  struct Case {
    std::shared_ptr<const ToolCallGrammar> g;
    std::string text;
  };
  const std::vector<Case> cases = {
      {weather(), param("city", "ü\n</p</to x") + param("where", R"({"lat": -1.5e3, "lon": 2})") +
                      param("hours", "[7]") + param("unit", "fahrenheit") + kEnd},
      {any_tool(true), "add_note>\n" + param("text", "<tool_call>\n</parameter") + param("tag", "null") + kEnd +
                           "\n<tool_call>\n<function=get_time>\n" + kEnd},
  };
  for (const Case& c : cases) {
    for (size_t i = 0; i <= c.text.size(); i += (i % 7 == 0 ? 1 : 3)) {
      ToolCallMatcher base(c.g);
      ASSERT_TRUE(base.feed(std::string_view(c.text).substr(0, i))) << c.text.substr(0, i);
      ToolCallConstraint same(c.g, vocab, {im_end()});
      for (size_t k = 0; k < i; ++k) {  // the same state: the prefix as one-byte tokens
        const int32_t id = token_of(index, c.text.substr(k, 1));
        ASSERT_GE(id, 0) << "the demo vocabulary has a token for every byte";
        same.push(id);
      }
      ASSERT_TRUE(same.active()) << c.text.substr(0, i);
      std::vector<float> row(static_cast<size_t>(index.vocab()), 0.0f);
      std::vector<char> ok(static_cast<size_t>(index.vocab()), 0);
      size_t expected = 0;
      for (int32_t id = 0; id < index.vocab(); ++id) {
        const std::string& b = index.bytes()[static_cast<size_t>(id)];
        ToolCallMatcher m = base;
        ok[static_cast<size_t>(id)] = (base.call_closed() && id == im_end()) || (!b.empty() && m.feed(b));
        expected += ok[static_cast<size_t>(id)];
      }
      ASSERT_EQ(same.mask(row), expected) << "after " << c.text.substr(0, i);
      for (int32_t id = 0; id < index.vocab(); ++id) {
        ASSERT_EQ(std::isfinite(row[static_cast<size_t>(id)]), ok[static_cast<size_t>(id)] != 0)
            << "token " << id << " '" << index.bytes()[static_cast<size_t>(id)] << "' after " << c.text.substr(0, i);
        ASSERT_EQ(same.allows(id), ok[static_cast<size_t>(id)] != 0) << id;
      }
    }
  }
}

namespace {

/// A token that brings the text nearer an end: the stop token when allowed, else the allowed
/// token that goes furthest into one of a few closing texts from where the text leaves off
/// (−1: none helps).
int32_t closing_token(const std::vector<int32_t>& allowed, const std::string& written, const JsonVocabIndex& index) {
  static const std::vector<std::string> goals = {"\n</parameter>\n", kEnd, "\"", "}", "]", "0"};
  if (std::find(allowed.begin(), allowed.end(), im_end()) != allowed.end()) return im_end();
  int32_t best = -1;
  size_t best_score = 0;
  for (const std::string& goal : goals) {
    size_t k = std::min(goal.size() - 1, written.size());
    while (k > 0 && !written.ends_with(goal.substr(0, k))) --k;
    const std::string_view rest = std::string_view(goal).substr(k);
    for (int32_t id : allowed) {
      const std::string& b = index.bytes()[static_cast<size_t>(id)];
      if (!b.empty() && rest.starts_with(b) && k + b.size() > best_score) {
        best = id;
        best_score = k + b.size();
      }
    }
  }
  return best;
}

}  // namespace

// Liveness and validity: along random walks through the mask (any allowed token, seeded, leaning
// towards closing texts later on), the mask is never empty before the stop token, and the text
// always parses into calls of declared functions whose arguments satisfy their schemas.
// Without stop tokens nothing may follow the call, not even inside the token that closes it.
TEST(ToolCallConstraint, WithoutStopTokensTheCallIsTheEnd) {
  const auto vocab = demo_vocab();
  const JsonVocabIndex& index = vocab->index();
  ToolCallConstraint c(any_tool(true), vocab, {});
  for (char ch : "get_time>\n" + kEnd.substr(0, kEnd.size() - 1)) c.push(token_of(index, std::string(1, ch)));
  ASSERT_TRUE(c.active());
  size_t longer = 0;
  for (int32_t id = 0; id < index.vocab(); ++id) {
    const std::string& b = index.bytes()[static_cast<size_t>(id)];
    if (b.starts_with(">") && b.size() > 1) {
      ++longer;
      EXPECT_FALSE(c.allows(id)) << b;
    }
  }
  EXPECT_GT(longer, 0u);
  c.push(token_of(index, ">"));
  EXPECT_TRUE(c.complete());
  EXPECT_FALSE(c.active());
}

TEST(ToolCallConstraint, RandomWalksNeverDeadEndAndParse) {
  const auto vocab = demo_vocab();
  const JsonVocabIndex& index = vocab->index();
  struct Start {
    std::shared_ptr<const ToolCallGrammar> g;
    std::string opening;
  };
  const std::vector<Start> starts = {{weather(), "<tool_call>\n<function=get_weather>\n"},
                                     {grammar(only(1), true, false), "<tool_call>\n<function=add_note>\n"},
                                     {any_tool(true), "<tool_call>\n<function="},
                                     {any_tool(false), "<tool_call>\n<function="}};
  std::mt19937 rng(7);
  size_t calls = 0;
  for (const Start& s : starts) {
    for (int walk = 0; walk < 6; ++walk) {
      ToolCallConstraint c(s.g, vocab, {im_end()});
      std::string written;
      bool stopped = false;
      for (int step = 0; step < 1500 && !stopped; ++step) {
        std::vector<float> row(static_cast<size_t>(index.vocab()), 0.0f);
        ASSERT_GT(c.mask(row), 0u) << s.opening << written;
        ASSERT_TRUE(c.active());
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < index.vocab(); ++id)
          if (std::isfinite(row[static_cast<size_t>(id)])) allowed.push_back(id);
        int32_t id = allowed[rng() % allowed.size()];
        if (step > 60 || rng() % 3 == 0)
          if (const int32_t closer = closing_token(allowed, written, index); closer >= 0) id = closer;
        c.push(id);
        stopped = id == im_end();
        if (!stopped) written += index.bytes()[static_cast<size_t>(id)];
      }
      ASSERT_TRUE(stopped) << s.opening << written;
      EXPECT_FALSE(c.active());
      calls += check_calls(s.opening, written);
    }
  }
  EXPECT_GE(calls, 24u);
}

// Generations over the fake backend (its tokens are noise, leaning towards "\n</parameter>\n"
// and the end of the call): greedy and sampled, for one named function and for several, every
// answer is calls that parse and validate, ended by the stop token; without stop tokens the
// answer ends right after "</tool_call>".
TEST(ToolCallConstraint, GenerationsAreValidCalls) {
  const auto& tokenizer = test::demo_tokenizer();
  const std::string goal = "\n</parameter>\n</function>\n</tool_call>";
  const ordered_json bounded = ordered_json::parse(R"([{"type": "function", "function": {"name": "set", "parameters": {
      "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "mode": {"enum": ["on", "off"]},
      "count": {"type": "integer"}, "flag": {"type": "boolean"}}, "required": ["name", "count", "flag"]}}}])");
  for (const bool named : {true, false}) {
    for (uint64_t seed = 0; seed < 4; ++seed) {
      test::FakeBackend b(tokenizer->vocab_size());
      b.script = [&](const std::vector<int32_t>& h) {
        const std::string text = tokenizer->decode(h);
        if (text.ends_with("</tool_call>")) return im_end();
        size_t k = std::min(goal.size() - 1, text.size());
        while (k > 0 && !text.ends_with(goal.substr(0, k))) --k;
        return token_of(demo_vocab()->index(), goal.substr(k, 1));
      };
      auto state = b.new_state(4000);
      GenerationParams p;
      p.max_tokens = 1500;
      p.max_seq = 4000;
      p.stop_ids = seed == 3 ? std::vector<int32_t>{} : std::vector<int32_t>{im_end()};
      p.tool_call = grammar(bounded, named, !named);
      if (seed % 2 == 1) {
        p.sampling.temperature = 0.5f;
        p.sampling.seed = seed;
      }
      const std::string opening = named ? "<tool_call>\n<function=set>\n" : "<tool_call>\n<function=";
      const std::vector<int32_t> prompt = tokenizer->encode(opening, true);
      const GenerationResult r = generate(b, *state, prompt, p, tokenizer.get());
      ASSERT_EQ(r.finish_reason, FinishReason::kStop) << seed << ": " << r.text;
      if (seed == 3) EXPECT_TRUE(r.text.ends_with("</tool_call>")) << r.text;
      else EXPECT_EQ(r.token_ids.back(), im_end());
      server::AnswerFormat format;
      format.tools.emplace(bounded);
      format.prefix = opening;
      const server::AssistantMessage m = server::parse_answer(r.text, format);
      ASSERT_GE(m.tool_calls.size(), 1u) << r.text;
      EXPECT_EQ(m.content, "");
      for (const auto& call : m.tool_calls)
        EXPECT_TRUE(valid(json::parse(call.arguments), json::parse(bounded[0]["function"]["parameters"].dump())))
            << call.arguments;
    }
  }
}
