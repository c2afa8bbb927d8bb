// Structured output (engine/json_constraint.h): the schema compiler's refusals, the byte
// matcher on valid and invalid documents, the token mask against a brute-force check of every
// token, and generations over the fake backend that always end as a valid document.
#include <gtest/gtest.h>

#include <algorithm>
#include <bitset>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "engine/generate.h"
#include "engine/json_constraint.h"
#include "fake_backend.h"
#include "support/demo_tokenizer.h"

using namespace lily;
using nlohmann::json;

namespace {

std::shared_ptr<const JsonSchema> schema(const char* text) { return JsonSchema::compile(json::parse(text)); }

/// Whether the whole of `doc` is accepted and completes the document.
bool accepts(const std::shared_ptr<const JsonSchema>& s, std::string_view doc) {
  JsonMatcher m(s);
  return m.feed(doc) && m.complete();
}

/// Whether `doc` is a prefix of a valid document (every byte accepted).
bool prefix_ok(const std::shared_ptr<const JsonSchema>& s, std::string_view doc) {
  JsonMatcher m(s);
  return m.feed(doc);
}

/// The id of a token whose bytes are exactly `c` (−1: none).
int32_t one_byte_token(const JsonVocabIndex& index, char c) {
  for (int32_t id = 0; id < index.vocab(); ++id)
    if (index.bytes()[static_cast<size_t>(id)] == std::string(1, c)) return id;
  return -1;
}

std::string compile_error(const char* text) {
  try {
    JsonSchema::compile(json::parse(text));
  } catch (const Error& e) {
    return e.what();
  }
  return "(compiled)";
}

const char* kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "description": "full name", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "role": {"enum": ["admin", "user", null]},
    "address": {"$ref": "#/$defs/Address"},
    "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]}
  },
  "required": ["name", "age"],
  "additionalProperties": false,
  "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": false}}
})";

}  // namespace

TEST(JsonSchemaCompile, RefusesWhatItDoesNotFollow) {
  EXPECT_EQ(compile_error(R"({"type":"object","allOf":[]})"), "unsupported JSON schema keyword 'allOf' at /");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"not":{}}}})"),
            "unsupported JSON schema keyword 'not' at /properties/a/");
  EXPECT_EQ(compile_error(R"({"type":"string"})"), "the JSON schema's root must be an object schema");
  EXPECT_EQ(compile_error(R"({"type":"object","required":["x"]})"),
            "the required property 'x' is not among the properties at /");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"$ref":"#/nowhere"}}})"),
            "unsupported or unresolved '$ref' \"#/nowhere\" at /properties/a/");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"anyOf":[{"type":"object"},{"type":"object"}]}}})"),
            "unsupported 'anyOf' at /properties/a/: two branches take the same container type");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"type":"decimal"}}})"),
            "unknown JSON schema type 'decimal' at /properties/a/");
  // Schemas with no instance, or with parts the matcher would silently drop, are refused.
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"n":{"$ref":"#"}},"required":["n"]})"),
            "the JSON schema has no finite instance: a required property recurses without end");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"type":"integer","enum":["x"]}}})"),
            "no value of 'enum'/'const' satisfies the rest of the schema at /properties/a/");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/A","type":"string"}},
                              "$defs":{"A":{"type":"integer"}}})"),
            "unsupported JSON schema keyword 'type' beside '$ref' at /properties/a/");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/A"}},
                              "$defs":{"A":{"$ref":"#/$defs/B"},"B":{"$ref":"#/$defs/A"}}})"),
            "the $ref \"#/$defs/B\" at /$defs/A/ comes back to itself with no schema between");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/A"}},
                              "$defs":{"A":{"anyOf":[{"$ref":"#/$defs/A"},{"type":"null"}]}}})"),
            "unsupported 'anyOf' at /$defs/A/: a branch is the schema it is in");
  EXPECT_NO_THROW(JsonSchema::compile(json::parse(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/a~1b"}},
                                                     "$defs":{"a/b":{"type":"integer"}}})")));
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"a":{"oneOf":[{"type":"integer"},{"type":"number"}]}}})"),
            "unsupported 'oneOf' at /properties/a/: two branches take values of the same type, which 'oneOf' would refuse");
  EXPECT_NO_THROW(JsonSchema::compile(json::parse(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/a%20b"}},
                                                     "$defs":{"a b":{"type":"integer"}}})")));
  // type beside anyOf: both hold.
  const auto both = schema(R"({"type":"object","properties":{"a":{"type":["string","null"],
                              "anyOf":[{"type":"string"},{"type":"integer"}]}}})");
  EXPECT_TRUE(accepts(both, R"({"a": "x"})"));
  EXPECT_FALSE(prefix_ok(both, R"({"a": 1)"));
  EXPECT_FALSE(prefix_ok(both, R"({"a": n)"));
  EXPECT_NO_THROW(JsonSchema::compile(json::parse(kPerson)));
}

// enum/const values are kept only where the schema's other keywords allow them, and const
// beside enum is their intersection; none left is a schema with no instance.
TEST(JsonSchemaCompile, LiteralsSatisfyTheRestOfTheSchema) {
  auto literals = [](const char* property) {
    const auto s = JsonSchema::compile(json::parse(std::string(R"({"type":"object","properties":{"p":)") + property + "}}"));
    return s->node(s->node(s->root()).property_nodes[0]).literals;
  };
  using Texts = std::vector<std::string>;
  EXPECT_EQ(literals(R"({"type":"string","maxLength":2,"enum":["S","M","XXL"]})"), (Texts{"\"M\"", "\"S\""}));
  EXPECT_EQ(literals(R"({"type":"string","maxLength":1,"enum":["\u00e9","ab"]})"), (Texts{"\"\u00e9\""}));
  EXPECT_EQ(literals(R"({"type":"array","maxItems":1,"enum":[[1,2],[3]]})"), (Texts{"[3]"}));
  EXPECT_EQ(literals(R"({"type":"array","items":{"type":"integer","enum":[1]},"enum":[[1,1],[2]]})"), (Texts{"[1,1]"}));
  EXPECT_EQ(literals(R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],
                         "additionalProperties":false,"enum":[{},{"a":1},{"a":"x"},{"a":1,"b":2}]})"),
            (Texts{"{\"a\":1}"}));
  EXPECT_EQ(literals(R"({"type":"object","additionalProperties":{"type":"string"},"enum":[{"a":1},{"a":"x"}]})"),
            (Texts{"{\"a\":\"x\"}"}));
  EXPECT_EQ(literals(R"({"type":"integer","const":5,"enum":[4,5.0]})"), (Texts{"5"}));
  EXPECT_EQ(literals(R"({"enum":[6,7],"const":7})"), (Texts{"7"}));
  EXPECT_EQ(literals(R"({"anyOf":[{"type":"string","maxLength":1,"enum":["a","bb"]},{"type":"null"}]})"),
            (Texts{"\"a\"", "null"}));
  EXPECT_EQ(literals(R"({"$ref":"#/$defs/S"}},"$defs":{"S":{"type":"string","maxLength":1,"enum":["a","bb"]})"),
            (Texts{"\"a\""}));
  const auto matcher = schema(R"({"type":"object","properties":{"s":{"type":"string","maxLength":2,"enum":["S","XXL"]}}})");
  EXPECT_TRUE(accepts(matcher, R"({"s": "S"})"));
  EXPECT_FALSE(prefix_ok(matcher, R"({"s": "X)"));
  // No value left: refused, as any schema with no instance.
  for (const char* none : {R"({"type":"array","maxItems":1,"const":[1,2]})",
                           R"({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":false,"const":{"b":1}})",
                           R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"enum":[{}]})",
                           R"({"type":"string","maxLength":2,"const":"XXL"})"})
    EXPECT_EQ(compile_error((std::string(R"({"type":"object","properties":{"p":)") + none + "}}").c_str()),
              "no value of 'enum'/'const' satisfies the rest of the schema at /properties/p/")
        << none;
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"p":{"type":"integer","const":5,"enum":[6,7]}}})"),
            "the 'const' value is not in the 'enum' at /properties/p/");
  EXPECT_EQ(compile_error(R"({"type":"object","properties":{"p":{"type":"string","const":"x","enum":["y","z"]}}})"),
            "the 'const' value is not in the 'enum' at /properties/p/");
}

// A hostile schema: enums of thousands of arrays' and objects' values whose items and properties
// have enums of thousands of strings themselves (each literal checked against those, also inside
// an anyOf branch). Every value the inner enums allow is kept, every other one dropped.
TEST(JsonSchemaCompile, LargeNestedEnums) {
  const size_t n = 3000;
  json strings = json::array(), pairs = json::array(), singles = json::array();
  for (size_t i = 0; i < n; ++i) strings.push_back(std::string("v").append(std::to_string(i)));
  for (size_t i = 0; i < n; ++i) {
    pairs.push_back({{"a", strings[i]}, {"b", strings[n - 1 - i]}});
    singles.push_back({{"a", strings[n - 1 - i]}});
  }
  pairs.push_back({{"a", "v1"}, {"b", "nope"}});
  singles.push_back({{"a", "nope"}});
  const json string_enum{{"type", "string"}, {"enum", strings}};
  const json root{
      {"type", "object"},
      {"properties",
       {{"list", {{"type", "array"}, {"items", string_enum}, {"enum", {strings, json::array({"v1", "nope"})}}}},
        {"pair",
         {{"type", "object"},
          {"properties", {{"a", string_enum}, {"b", string_enum}}},
          {"required", {"a", "b"}},
          {"enum", pairs}}},
        {"single",
         {{"anyOf", {{{"type", "object"}, {"properties", {{"a", string_enum}}}, {"enum", singles}}, {{"type", "null"}}}}}}}}};
  const auto s = JsonSchema::compile(root);
  const auto& props = s->node(s->root());
  ASSERT_EQ(props.property_names, (std::vector<std::string>{"list", "pair", "single"}));
  auto literals = [&](size_t i) { return s->node(props.property_nodes[i]).literals; };
  EXPECT_EQ(literals(0), (std::vector<std::string>{strings.dump()}));
  EXPECT_EQ(literals(1).size(), n);
  EXPECT_EQ(literals(1).front(), pairs[0].dump());  // the least by bytes ("v0")
  EXPECT_EQ(literals(2).size(), n + 1);  // the objects whose "a" the enum allows, and null
  EXPECT_EQ(literals(2).front(), "null");  // 'n' sorts before '{'
  EXPECT_TRUE(accepts(s, R"({"pair": {"a":"v2","b":"v2997"}, "single": {"a":"v0"}})"));
  EXPECT_FALSE(prefix_ok(s, R"({"pair": {"a":"v1","b":"n)"));
  EXPECT_FALSE(prefix_ok(s, R"({"single": {"a":"n)"));
  EXPECT_FALSE(prefix_ok(s, R"({"list": ["v1","n)"));
}

TEST(JsonMatcher, AnyObject) {
  const auto s = JsonSchema::any_object();
  EXPECT_TRUE(accepts(s, R"({})"));
  EXPECT_TRUE(accepts(s, R"( {"a": [1, -2.5e3, true, null, {"b": "x\"\u00e9\n"}], "c": {}})"));
  EXPECT_FALSE(accepts(s, R"([1])"));         // the root is an object
  EXPECT_FALSE(prefix_ok(s, R"({"a": 01})"));  // no leading zeros
  EXPECT_TRUE(prefix_ok(s, R"({"a": tru)"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": trux)"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": 1,})"));
  EXPECT_FALSE(prefix_ok(s, R"({"a" 1})"));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": \"x\ny\"}"));  // a raw control byte in a string
  EXPECT_FALSE(prefix_ok(s, R"({"a": "\x"})"));
  EXPECT_FALSE(prefix_ok(s, R"({} )"));  // nothing after the document
  // Strings are well-formed UTF-8: no stray continuation byte, no cut character.
  EXPECT_TRUE(accepts(s, "{\"a\": \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}"));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": \"\xb1"));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": \"\xc3\""));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": \"\xed\xa0\x80"));  // a surrogate
  EXPECT_FALSE(prefix_ok(s, "{\"\xc3\": 1"));               // keys too
  // \u escapes: a high surrogate only with its low one after it; never a lone low one.
  EXPECT_TRUE(accepts(s, R"({"a": "\ud83d\ude00 \u00e9"})"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": "\udddd)"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": "\ud83d")"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": "\ud83d\u0041)"));
  // Exponents of at most two digits: every number is a finite double.
  EXPECT_TRUE(accepts(s, R"({"a": 1e99, "b": -2.5E-12})"));
  EXPECT_FALSE(prefix_ok(s, R"({"a": 1e119)"));
  // A key of an object that takes any key, once.
  EXPECT_FALSE(prefix_ok(s, R"({"k": 1, "k")"));
  EXPECT_TRUE(prefix_ok(s, R"({"k": 1, "k2")"));
  // A number always has room to end: 31 digits cannot take a point that needs one more.
  EXPECT_TRUE(prefix_ok(s, "{\"a\": " + std::string(30, '1') + "e"));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": " + std::string(31, '1') + "."));
  // Nesting is bounded.
  EXPECT_TRUE(prefix_ok(s, "{\"a\": " + std::string(20, '[')));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": " + std::string(kMaxJsonNesting + 8, '[')));
  // Whitespace between tokens: compact or pretty-printed, no runs of blanks or blank lines.
  EXPECT_TRUE(prefix_ok(s, "{ \"a\": 1,\t\"b\""));
  EXPECT_TRUE(prefix_ok(s, "\n{\n" + std::string(kMaxIndentPerLevel, ' ') + "\"a\":\r\n\t1"));
  EXPECT_FALSE(prefix_ok(s, "{\n" + std::string(kMaxIndentPerLevel + 1, ' ')));  // one level deep
  EXPECT_TRUE(prefix_ok(s, "{\"a\": [\n" + std::string(2 * kMaxIndentPerLevel, ' ') + "1"));
  // Closed containers give their indentation back.
  EXPECT_TRUE(prefix_ok(s, "{\"a\": [{}, [],\n" + std::string(2 * kMaxIndentPerLevel, ' ') + "1"));
  EXPECT_FALSE(prefix_ok(s, "{\"a\": [{}, []],\n" + std::string(kMaxIndentPerLevel + 1, ' ')));
  EXPECT_FALSE(prefix_ok(s, "\n "));  // no indentation outside every container
  EXPECT_FALSE(prefix_ok(s, "{\n\n"));
  EXPECT_FALSE(prefix_ok(s, "{  "));
  EXPECT_FALSE(prefix_ok(s, "{ \n"));
  EXPECT_FALSE(prefix_ok(s, "{\r "));
  EXPECT_FALSE(prefix_ok(s, "\n\n{"));
  EXPECT_TRUE(accepts(s, "{\n  \"a\": [\n    1,\n    2\n  ]\n}"));
  EXPECT_TRUE(prefix_ok(s, "{\"" + std::string(200, ' ')));  // inside a key: text, not a run
}

TEST(JsonMatcher, FollowsTheSchema) {
  const auto s = schema(kPerson);
  EXPECT_TRUE(accepts(s, R"({"name": "Ada", "age": 36})"));
  EXPECT_TRUE(accepts(s, R"({"age": 36, "name": "Ada", "score": 1.5, "tags": ["a", "b"], "role": "admin",
  "address": {"city": "London"}, "nick": null})"));
  EXPECT_TRUE(accepts(s, R"({"name": "Ada", "age": 36, "role": null, "nick": "A"})"));
  EXPECT_FALSE(accepts(s, R"({"name": "Ada"})"));               // age is required
  EXPECT_FALSE(prefix_ok(s, R"({"name": "Ada"})"));             // ... so the object cannot close
  EXPECT_FALSE(prefix_ok(s, R"({"name": "Ada", "age": 3.5)"));  // an integer
  EXPECT_FALSE(prefix_ok(s, R"({"name": 5)"));
  EXPECT_FALSE(prefix_ok(s, R"({"email)"));                     // not a declared property
  EXPECT_TRUE(prefix_ok(s, R"({"na)"));
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "name")"));         // a key twice
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "age": 1, "role": "root")"));
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "age": 1, "address": {})"));  // city is required
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "age": 1, "tags": [1)"));
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "age": 1, "nick": 3)"));
  // Every declared key written: no comma can follow.
  EXPECT_FALSE(prefix_ok(s, R"({"name": "A", "age": 1, "score": 1, "tags": [], "role": null, "address": {"city": "x"},
                              "nick": null,)"));
  // maxLength counts characters (an escape or a multi-byte character is one); maxItems items.
  const auto bounded = schema(R"({"type":"object","properties":{"s":{"type":"string","maxLength":3},
                                  "a":{"type":"array","items":{"type":"integer"},"maxItems":2}}})");
  EXPECT_TRUE(accepts(bounded, "{\"s\": \"a\\n\xc3\xa9\", \"a\": [1, 2]}"));
  EXPECT_FALSE(prefix_ok(bounded, R"({"s": "abcd)"));
  EXPECT_FALSE(prefix_ok(bounded, R"({"a": [1, 2,)"));
  EXPECT_TRUE(accepts(bounded, R"({"a": []})"));
  // An object that takes no key: only {}.
  const auto empty = schema(R"({"type":"object","properties":{"e":{"type":"object","additionalProperties":false}},
                                "additionalProperties":false})");
  EXPECT_TRUE(accepts(empty, R"({"e": {}})"));
  EXPECT_FALSE(prefix_ok(empty, R"({"e": {")"));
  EXPECT_FALSE(prefix_ok(empty, R"({"e": {},)"));  // every key written: no comma
  // Recursive references.
  const auto tree = schema(R"({"type":"object","properties":{"v":{"type":"integer"},
                               "kids":{"type":"array","items":{"$ref":"#"}}},"required":["v"],"additionalProperties":false})");
  EXPECT_TRUE(accepts(tree, R"({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]})"));
  EXPECT_FALSE(prefix_ok(tree, R"({"v": 1, "kids": [{"kids": []})"));
}

namespace {

/// A root object schema whose one property "p" (required, nothing else allowed) has schema `p`.
std::shared_ptr<const JsonSchema> one_property(const json& p) {
  return JsonSchema::compile(
      json{{"type", "object"}, {"properties", {{"p", p}}}, {"required", {"p"}}, {"additionalProperties", false}});
}

/// The bytes that continue `prefix` towards one of `literals`: a scan of the whole list.
std::bitset<256> bytes_after(const std::vector<std::string>& literals, const std::string& prefix) {
  std::bitset<256> out;
  for (const std::string& l : literals)
    if (l.size() > prefix.size() && l.starts_with(prefix)) out.set(static_cast<unsigned char>(l[prefix.size()]));
  return out;
}

/// The bytes a copy of `m` takes next, of all 256.
std::bitset<256> bytes_taken(const JsonMatcher& m) {
  std::bitset<256> out;
  for (int b = 0; b < 256; ++b) {
    JsonMatcher probe = m;
    out.set(static_cast<size_t>(b), probe.feed(static_cast<unsigned char>(b)));
  }
  return out;
}

/// At every position of every one of `literals` (the values "p" of `s` allows, as compact JSON),
/// the matcher agrees with a scan of the list: alone on p's node, the bytes it takes and whether
/// the value may end; inside {"p":…}, the bytes it takes, whitespace and '}' where a value ended.
void expect_literals_by_scan(const std::shared_ptr<const JsonSchema>& s, const std::vector<std::string>& literals) {
  const int node = s->node(s->root()).property_nodes[0];
  std::bitset<256> space;
  for (unsigned char b : std::string(" \t\n\r")) space.set(b);
  const std::bitset<256> after_value = std::bitset<256>(space).set('}');  // then the object may close
  for (const std::string& l : literals) {
    JsonMatcher alone(s, node), inside(s);
    ASSERT_TRUE(inside.feed("{\"p\":"));
    for (size_t k = 0; k <= l.size(); ++k) {
      const std::string prefix = l.substr(0, k);
      const bool whole = std::find(literals.begin(), literals.end(), prefix) != literals.end();
      // Before the value whitespace may come too; inside, after a whole value, what follows it.
      const std::bitset<256> next = bytes_after(literals, prefix) | (k == 0 ? space : std::bitset<256>());
      ASSERT_EQ(bytes_taken(alone), next) << "after " << prefix;
      ASSERT_EQ(alone.can_end(), whole) << "after " << prefix;
      ASSERT_EQ(bytes_taken(inside), whole ? next | after_value : next) << "after {\"p\":" << prefix;
      if (k == l.size()) break;
      ASSERT_TRUE(alone.feed(static_cast<unsigned char>(l[k])));
      ASSERT_TRUE(inside.feed(static_cast<unsigned char>(l[k])));
    }
  }
}

}  // namespace

// Enum/const values are looked up in a sorted list: at every position of every value the
// matcher takes exactly the bytes, and ends exactly where, a scan of the values says. Values that
// share prefixes ("a", "ab", "abc"; 1, 10, 100, 1.5; "w1", "w10", "w100"), duplicates, an empty
// string, escapes and UTF-8, arrays and nested objects as const, merged in an anyOf with null and
// booleans; and the true/false/null of a type-only schema.
TEST(JsonMatcher, EnumLookupEqualsScan) {
  std::vector<std::string> values = {R"("a")", R"("ab")", R"("abc")", R"("b")", R"("")", R"("q\"uote")",
                                     "\"\xc3\xa9t\xc3\xa9\"", "1", "10", "100", "1.5", "-1", "[1]", "[1,2]",
                                     R"({"a":1})", R"({"a":{"b":[1,2]}})"};
  for (int i = 0; i < 1000; ++i) values.push_back(std::to_string(i * 7));                // shared digits
  for (int i = 0; i < 1000; ++i) values.push_back("\"w" + std::to_string(i) + "\"");  // "w1", "w10", …
  json enum_values = json::array();
  for (const std::string& v : values) enum_values.push_back(json::parse(v));
  enum_values.push_back("ab");  // a duplicate
  const json nested = json::parse(R"({"a":{"b":[1]}})");
  const json p = {{"anyOf",
                   {{{"enum", enum_values}},
                    {{"const", nested}},
                    {{"const", json::parse(R"({"a":{"b":[1,2]}})")}},  // also in the enum
                    {{"type", "null"}},
                    {{"type", "boolean"}}}}};
  for (const char* v : {"true", "false", "null"}) values.push_back(v);
  values.push_back(nested.dump());
  ASSERT_NO_FATAL_FAILURE(expect_literals_by_scan(one_property(p), values));
  ASSERT_NO_FATAL_FAILURE(
      expect_literals_by_scan(one_property(json{{"type", json{"boolean", "null"}}}), {"true", "false", "null"}));
}

// The vocabulary index is built once per tokenizer and kept while no constraint holds it (the
// next request does not rebuild it); the cache stays bounded: once enough other tokenizers
// asked, the first one's index is let go.
TEST(JsonConstraint, VocabIndexOutlivesItsConstraints) {
  const auto tokenizer = test::demo_tokenizer();
  const int32_t vocab = tokenizer->vocab_size();
  std::weak_ptr<const JsonVocabIndex> first;
  {
    JsonConstraint c(JsonSchema::any_object(), JsonVocabIndex::for_tokenizer(*tokenizer, vocab), {0});
    first = JsonVocabIndex::for_tokenizer(*tokenizer, vocab);
  }
  EXPECT_FALSE(first.expired());
  EXPECT_EQ(JsonVocabIndex::for_tokenizer(*tokenizer, vocab), first.lock());
  const auto other = JsonVocabIndex::for_tokenizer(*tokenizer, vocab - 1);  // another row length
  EXPECT_NE(other, first.lock());
  EXPECT_EQ(other->vocab(), vocab - 1);
  for (int i = 0; i < 8; ++i) {
    const auto fresh = Tokenizer::from_file(std::string(LILY_SOURCE_DIR) + "/models/demo/tokenizer.json");
    EXPECT_NE(JsonVocabIndex::for_tokenizer(*fresh, vocab), first.lock());
  }
  EXPECT_TRUE(first.expired());
}

// The mask allows exactly the tokens a byte-by-byte check accepts, at every step of a document,
// over the demo tokenizer's whole vocabulary (the trie walk and the string fast path agree with
// brute force).
TEST(JsonConstraint, MaskEqualsBruteForce) {
  const auto tokenizer = test::demo_tokenizer();
  const int32_t vocab = tokenizer->vocab_size();
  const auto index = JsonVocabIndex::for_tokenizer(*tokenizer, vocab);
  EXPECT_EQ(index.get(), JsonVocabIndex::for_tokenizer(*tokenizer, vocab).get());  // built once
  const auto s = schema(kPerson);
  const std::string doc = R"({"name": "A \"q\" b", "age": 12, "tags": ["x"], "role": "user"})";
  // Follow the document byte by byte as one-byte tokens would, checking the mask at each prefix.
  for (size_t i = 0; i < doc.size(); i += 3) {
    JsonMatcher base(s);
    ASSERT_TRUE(base.feed(std::string_view(doc).substr(0, i)));
    // The constraint in the same state, by pushing the prefix as one-byte tokens.
    JsonConstraint same(s, index, {0});
    bool replayed = true;
    for (size_t k = 0; k < i && replayed; ++k) {
      const int32_t id = one_byte_token(*index, doc[k]);
      if (id < 0) replayed = false;
      else same.push(id);
    }
    ASSERT_TRUE(replayed) << "the demo vocabulary has every ASCII byte as a token";
    std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
    size_t expected = 0;
    std::vector<char> ok(static_cast<size_t>(vocab), 0);
    for (int32_t id = 0; id < vocab; ++id) {
      const std::string& b = index->bytes()[static_cast<size_t>(id)];
      JsonMatcher m = base;
      ok[static_cast<size_t>(id)] = !b.empty() && m.feed(b);
      expected += ok[static_cast<size_t>(id)];
    }
    EXPECT_EQ(same.mask(row), expected) << "after " << doc.substr(0, i);
    for (int32_t id = 0; id < vocab; ++id) {
      ASSERT_EQ(std::isfinite(row[static_cast<size_t>(id)]), ok[static_cast<size_t>(id)] != 0)
          << "token " << id << " after " << doc.substr(0, i);
      ASSERT_EQ(same.allows(id), ok[static_cast<size_t>(id)] != 0) << id;
    }
  }
  // Once complete, only the stop tokens.
  JsonConstraint done(JsonSchema::any_object(), index, {0, 1});
  for (char ch : std::string("{}")) done.push(one_byte_token(*index, ch));
  EXPECT_TRUE(done.complete());
  std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
  EXPECT_EQ(done.mask(row), 2u);
  EXPECT_TRUE(std::isfinite(row[0]) && std::isfinite(row[1]) && !std::isfinite(row[2]));
}

// Liveness: along random walks through the mask (any allowed token, seeded), the mask is never
// empty before the document is complete, and what was written stays a valid prefix; at the end
// only the stop token is left. Schemas that corner the matcher: an object that takes no key,
// maxLength 0, maxItems 0, optional recursion down to the nesting limit, long numbers.
TEST(JsonConstraint, RandomWalksNeverDeadEnd) {
  const auto tokenizer = test::demo_tokenizer();
  const int32_t vocab = tokenizer->vocab_size();
  const auto index = JsonVocabIndex::for_tokenizer(*tokenizer, vocab);
  const char* schemas[] = {
      R"({"type":"object","properties":{"e":{"type":"object","additionalProperties":false},
          "s":{"type":"string","maxLength":0},"a":{"type":"array","items":{"type":"number"},"maxItems":0}},
          "additionalProperties":false})",
      R"({"$defs":{"N":{"type":"object","properties":{"n":{"$ref":"#/$defs/N"},"v":{"type":"integer"}},
          "additionalProperties":false}},"type":"object","properties":{"r":{"$ref":"#/$defs/N"},
          "l":{"type":"array","items":{"type":"array","items":{"$ref":"#/$defs/N"}}}},"required":["r"],
          "additionalProperties":false})",
      R"({"type":"object"})",
      kPerson};
  std::mt19937 rng(11);
  for (const char* text : schemas) {
    const auto s = schema(text);
    for (int walk = 0; walk < 8; ++walk) {
      JsonConstraint c(s, index, {0});
      JsonMatcher m(s);
      std::string written;
      for (int step = 0; step < 600 && !c.complete(); ++step) {
        std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
        ASSERT_GT(c.mask(row), 0u) << text << " after " << written;
        ASSERT_TRUE(c.active());
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab; ++id)
          if (std::isfinite(row[static_cast<size_t>(id)])) allowed.push_back(id);
        // Lean towards closing bytes half the time, so that walks also finish.
        int32_t id = allowed[rng() % allowed.size()];
        if (rng() % 2 == 0)
          for (int32_t a : allowed) {
            const std::string& b = index->bytes()[static_cast<size_t>(a)];
            if (!b.empty() && (b.back() == '}' || b.back() == ']' || b.back() == '"' || b.back() == ',')) {
              id = a;
              if (rng() % 3 == 0) break;
            }
          }
        c.push(id);
        written += index->bytes()[static_cast<size_t>(id)];
        ASSERT_TRUE(m.feed(index->bytes()[static_cast<size_t>(id)])) << written;
      }
      if (c.complete()) {
        EXPECT_TRUE(m.complete());
        EXPECT_TRUE(json::accept(written)) << written;
        std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
        EXPECT_EQ(c.mask(row), 1u);
      }
    }
  }
}

// With json_after_id (a think block's end), the tokens before it are the backend's own (no
// JSON), and the document starts after it; when it never comes, nothing is constrained.
TEST(JsonConstraint, DocumentStartsAfterTheThinkEnd) {
  const auto tokenizer = test::demo_tokenizer();
  const auto s = schema(kPerson);
  const int32_t stop = *tokenizer->token_id("<|im_end|>");
  const int32_t think_end = *tokenizer->token_id("</think>");
  const int32_t word = tokenizer->encode("Hmm", false).front();  // no JSON document starts with it
  const std::string word_text = tokenizer->decode(std::vector<int32_t>{word});
  const std::vector<int32_t> closers = {*tokenizer->token_id("\""), *tokenizer->token_id("}"),
                                        *tokenizer->token_id("]"), *tokenizer->token_id(",")};
  const std::vector<int32_t> prompt = {1, 2, 3};
  GenerationParams p;
  p.max_tokens = 2000;
  p.max_seq = 4000;
  p.stop_ids = {stop};
  p.json_schema = s;
  p.json_after_id = think_end;
  for (int think_tokens : {0, 5}) {
    test::FakeBackend b(tokenizer->vocab_size());
    // think_tokens words, then "</think>", then the closing bytes the other test leans on.
    b.script = [&](const std::vector<int32_t>& h) {
      const int64_t n = static_cast<int64_t>(h.size() - prompt.size());
      if (n < think_tokens) return word;
      if (n == think_tokens) return think_end;
      return closers[h.size() % closers.size()];
    };
    auto state = b.new_state(4000);
    const GenerationResult r = generate(b, *state, prompt, p, tokenizer.get());
    ASSERT_EQ(r.finish_reason, FinishReason::kStop) << think_tokens << ": " << r.text;
    ASSERT_GT(r.token_ids.size(), static_cast<size_t>(think_tokens + 1));
    for (int i = 0; i < think_tokens; ++i) EXPECT_EQ(r.token_ids[static_cast<size_t>(i)], word) << i;
    EXPECT_EQ(r.token_ids[static_cast<size_t>(think_tokens)], think_end);
    // The special "</think>" writes no text: the text is the words, then the document.
    std::string words;
    for (int i = 0; i < think_tokens; ++i) words += word_text;
    ASSERT_TRUE(r.text.starts_with(words)) << r.text;
    const std::string document = r.text.substr(words.size());
    EXPECT_TRUE(accepts(s, document)) << think_tokens << ": " << document;
    EXPECT_EQ(r.token_ids.back(), stop);
  }
  // "</think>" never comes: every token is the backend's own, up to max_tokens.
  test::FakeBackend b(tokenizer->vocab_size());
  b.script = [&](const std::vector<int32_t>&) { return word; };
  auto state = b.new_state(4000);
  p.max_tokens = 12;
  const GenerationResult r = generate(b, *state, prompt, p, tokenizer.get());
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(r.token_ids, std::vector<int32_t>(12, word));
}

// Generations over the fake backend (whose own tokens are noise): greedy and sampled, every
// answer is a valid document of the schema, ended by the stop token.
TEST(JsonConstraint, GenerationsAreValidDocuments) {
  const auto tokenizer = test::demo_tokenizer();
  const auto s = schema(kPerson);
  const int32_t stop = *tokenizer->token_id("<|im_end|>");
  for (uint64_t seed = 0; seed < 6; ++seed) {
    test::FakeBackend b(tokenizer->vocab_size());
    // The backend leans to closing bytes in turn (its other logits are noise), so that strings,
    // numbers and objects end; the constraint decides what is valid.
    const std::vector<int32_t> closers = {*tokenizer->token_id("\""), *tokenizer->token_id("}"),
                                          *tokenizer->token_id("]"), *tokenizer->token_id(",")};
    b.script = [closers](const std::vector<int32_t>& h) { return closers[h.size() % closers.size()]; };
    auto state = b.new_state(4000);
    GenerationParams p;
    p.max_tokens = 2000;
    p.max_seq = 4000;
    p.stop_ids = {stop};
    p.json_schema = s;
    if (seed > 0) {
      p.sampling.temperature = 0.2f;
      p.sampling.seed = seed;
    }
    const std::vector<int32_t> prompt = {1, 2, 3};
    const GenerationResult r = generate(b, *state, prompt, p, tokenizer.get());
    ASSERT_EQ(r.finish_reason, FinishReason::kStop) << seed << ": " << r.text;
    EXPECT_EQ(r.token_ids.back(), stop);
    EXPECT_TRUE(accepts(s, r.text)) << seed << ": " << r.text;
    const json parsed = json::parse(r.text);
    EXPECT_TRUE(parsed.contains("name") && parsed["name"].is_string()) << r.text;
    EXPECT_TRUE(parsed.contains("age") && parsed["age"].is_number_integer()) << r.text;
  }
}
