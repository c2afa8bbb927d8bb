// The answer parser (server/tool_calls.h): tool-call blocks typed by the tools' schemas,
// reasoning split at </think>, malformed blocks kept as content, and the same result for any
// split of the text into streamed pieces; the message and delta JSON a client receives.
#include <gtest/gtest.h>

#include <random>

#include "server/tool_calls.h"

using namespace lily::server;
using nlohmann::ordered_json;

namespace {

ordered_json tools() {
  return ordered_json::parse(R"([
    {"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{
      "city":{"type":"string"},"days":{"type":"integer"},"units":{"type":["string","null"]},
      "options":{"type":"object"},"flags":{"type":"array"},"exact":{"type":"boolean"}}}}},
    {"type":"function","function":{"name":"noop"}}])");
}

AnswerFormat format(bool thinking, bool with_tools = true) {
  AnswerFormat f;
  f.thinking = thinking;
  if (with_tools) f.tools.emplace(tools());
  return f;
}

const std::string kCall =
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "</function>\n</tool_call>";

/// The message assembled from the parser's deltas with the text cut at the given places.
AssistantMessage streamed(const std::string& text, const AnswerFormat& f, const std::vector<size_t>& cuts) {
  AssistantMessage m;
  if (f.thinking) m.reasoning = "";
  AnswerParser parser(f);
  auto take = [&](std::vector<AnswerDelta> deltas) {
    for (auto& d : deltas) {
      if (d.kind == AnswerDelta::Kind::kReasoning) *m.reasoning += d.text;
      else if (d.kind == AnswerDelta::Kind::kContent) m.content += d.text;
      else {
        EXPECT_EQ(d.index, m.tool_calls.size());
        m.tool_calls.push_back(d.call);
      }
    }
  };
  size_t at = 0;
  for (size_t cut : cuts) {
    take(parser.push(text.substr(at, cut - at)));
    at = cut;
  }
  take(parser.push(text.substr(at)));
  take(parser.finish());
  return m;
}

void expect_same(const AssistantMessage& a, const AssistantMessage& b, const std::string& where) {
  EXPECT_EQ(a.content, b.content) << where;
  EXPECT_EQ(a.reasoning, b.reasoning) << where;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << where;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << where;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << where;
  }
}

}  // namespace

TEST(ToolCalls, ParsesACompleteCall) {
  const AssistantMessage m = parse_answer(kCall, format(false));
  EXPECT_EQ(m.content, "");
  EXPECT_FALSE(m.reasoning);
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].name, "get_weather");
  EXPECT_EQ(m.tool_calls[0].arguments, R"({"city":"Paris","days":3})");
  EXPECT_TRUE(m.tool_calls[0].id.starts_with("call_"));
  EXPECT_EQ(m.tool_calls[0].id.size(), 29u);
  EXPECT_FALSE(m.unfinished_call);
  EXPECT_EQ(answer_finish_reason("stop", m.tool_calls.size(), m.unfinished_call), "tool_calls");
  EXPECT_EQ(answer_finish_reason("length", m.tool_calls.size(), m.unfinished_call), "length");
  EXPECT_EQ(answer_finish_reason("stop", 0, false), "stop");
}

TEST(ToolCalls, ContentBeforeAndSeveralCalls) {
  const std::string text = "Let me look.\n\n" + kCall + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>\n";
  const AssistantMessage m = parse_answer(text, format(false));
  EXPECT_EQ(m.content, "Let me look.");
  ASSERT_EQ(m.tool_calls.size(), 2u);
  EXPECT_EQ(m.tool_calls[1].name, "noop");
  EXPECT_EQ(m.tool_calls[1].arguments, "{}");
  EXPECT_NE(m.tool_calls[0].id, m.tool_calls[1].id);
}

TEST(ToolCalls, ValuesAreTypedByTheSchema) {
  const std::string text =
      "<tool_call>\n<function=get_weather>\n"
      "<parameter=city>\n42\n</parameter>\n"           // string: stays raw
      "<parameter=days>\nsoon\n</parameter>\n"         // integer that is not JSON: the string
      "<parameter=units>\nnull\n</parameter>\n"        // a type list with string: raw
      "<parameter=options>\n{\"a\": [1, 2]}\n</parameter>\n"
      "<parameter=flags>\n[true]\n</parameter>\n"
      "<parameter=exact>\nfalse\n</parameter>\n"
      "<parameter=extra>\n7\n</parameter>\n"           // not in the schema: a string
      "<parameter=city2>\nline one\nline two\n</parameter>\n"
      "</function>\n</tool_call>";
  const AssistantMessage m = parse_answer(text, format(false));
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments,
            R"({"city":"42","days":"soon","units":"null","options":{"a":[1,2]},"flags":[true],"exact":false,)"
            R"("extra":"7","city2":"line one\nline two"})");
}

/// Schemas without a `type` as pydantic writes them: a nested model is a local $ref (followed,
/// through ~0/~1 escapes), Optional[int] an anyOf of integer and null (JSON), Optional[str] an
/// anyOf with a string branch (raw), an enum of numbers (JSON) or of strings (raw); a $ref that
/// leads nowhere, or a chain that comes back to itself, says nothing: raw.
TEST(ToolCalls, UntypedSchemasAreTypedByWhatTheyReferTo) {
  const ToolSchemas schemas(nlohmann::ordered_json::parse(R"([{"type":"function","function":{"name":"f",
    "parameters":{"type":"object","properties":{
      "model":{"$ref":"#/$defs/Point"}, "slashed":{"$ref":"#/definitions/a~1b"},
      "count":{"anyOf":[{"type":"integer"},{"type":"null"}]}, "label":{"anyOf":[{"type":"string"},{"type":"null"}]},
      "level":{"enum":[1,2,3]}, "mode":{"enum":["fast","slow"]}, "fixed":{"const":4},
      "lost":{"$ref":"#/$defs/Missing"}, "loop":{"$ref":"#/$defs/Loop"}, "name":{"$ref":"#/$defs/Name"}},
    "$defs":{"Point":{"type":"object","properties":{"x":{"type":"number"}}}, "Loop":{"$ref":"#/$defs/Loop"},
             "Name":{"type":"string"}},
    "definitions":{"a/b":{"type":"array"}}}}}])"));
  for (const char* json_typed : {"model", "slashed", "count", "level", "fixed"})
    EXPECT_FALSE(schemas.raw_string("f", json_typed)) << json_typed;
  for (const char* raw : {"label", "mode", "lost", "loop", "name", "undeclared"})
    EXPECT_TRUE(schemas.raw_string("f", raw)) << raw;

  AnswerFormat f;
  f.tools.emplace(nlohmann::ordered_json::parse(R"([{"type":"function","function":{"name":"f","parameters":{
    "type":"object","properties":{"p":{"$ref":"#/$defs/P"},"n":{"anyOf":[{"type":"integer"},{"type":"null"}]}},
    "$defs":{"P":{"type":"object","properties":{"x":{"type":"integer"}}}}}}}])"));
  const AssistantMessage m = parse_answer(
      "<tool_call>\n<function=f>\n<parameter=p>\n{\"x\": 1}\n</parameter>\n<parameter=n>\nnull\n</parameter>\n"
      "</function>\n</tool_call>", f);
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, R"({"p":{"x":1},"n":null})");
}

TEST(ToolCalls, MalformedBlocksAreContent) {
  const std::vector<std::string> bad = {
      "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",                     // undeclared
      "<tool_call>\nget_weather(city=Paris)\n</tool_call>",                              // not the format
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>",      // unclosed parameter
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
      "</function>\n</tool_call>",                                                       // a parameter twice
      "<tool_call>\n<function=get_weather>\n</function>\ntrailing</tool_call>",
  };
  for (const std::string& block : bad) {
    const AssistantMessage m = parse_answer("Answer: " + block, format(false));
    EXPECT_EQ(m.content, "Answer:" + block) << block;  // the space before a block is dropped
    EXPECT_TRUE(m.tool_calls.empty()) << block;
  }
  // An unfinished block (cut by max_tokens) is content too.
  const std::string cut = kCall.substr(0, 40);
  EXPECT_EQ(parse_answer(cut, format(false)).content, cut);
  EXPECT_TRUE(parse_answer(cut, format(false)).tool_calls.empty());
  // Without tools nothing is parsed.
  EXPECT_EQ(parse_answer(kCall, format(false, false)).content, kCall);
  EXPECT_EQ(parse_answer("Hello \n", format(false)).content, "Hello \n");
}

TEST(ToolCalls, ReasoningIsSplitAtTheThinkEnd) {
  const AssistantMessage m = parse_answer("I should check.\n</think>\n\nChecking.\n\n" + kCall, format(true));
  EXPECT_EQ(m.reasoning, "I should check.");
  EXPECT_EQ(m.content, "Checking.");
  EXPECT_EQ(m.tool_calls.size(), 1u);
  // A tool call inside the reasoning is not a call.
  const AssistantMessage inside = parse_answer(kCall + "\n</think>\n\nDone.", format(true));
  EXPECT_EQ(inside.reasoning, kCall);
  EXPECT_EQ(inside.content, "Done.");
  EXPECT_TRUE(inside.tool_calls.empty());
  // Cut before </think>: all of it is reasoning.
  const AssistantMessage unfinished = parse_answer("still thinking\n", format(true, false));
  EXPECT_EQ(unfinished.reasoning, "still thinking");
  EXPECT_EQ(unfinished.content, "");
}

// include_reasoning false: the thinking is dropped, whole or streamed; the rest is unchanged.
TEST(ToolCalls, ReasoningCanBeLeftOut) {
  AnswerFormat f = format(true);
  f.include_reasoning = false;
  const std::string text = "I should check.\n</think>\n\nChecking.\n\n" + kCall;
  const AssistantMessage m = parse_answer(text, f);
  EXPECT_FALSE(m.reasoning.has_value());
  EXPECT_EQ(m.content, "Checking.");
  EXPECT_EQ(m.tool_calls.size(), 1u);
  EXPECT_FALSE(assistant_message_json(m).contains("reasoning_content"));
  AnswerParser parser(f);
  std::vector<AnswerDelta> deltas;
  for (char c : text)
    for (auto& d : parser.push(std::string(1, c))) deltas.push_back(std::move(d));
  for (auto& d : parser.finish()) deltas.push_back(std::move(d));
  for (const AnswerDelta& d : deltas) EXPECT_NE(d.kind, AnswerDelta::Kind::kReasoning);
  EXPECT_FALSE(deltas.empty());
}

TEST(ToolCalls, AnySplitOfTheStreamGivesTheWholeAnswer) {
  const std::vector<std::pair<std::string, AnswerFormat>> cases = {
      {"Reason <tool_call> here\n\n</think>\n\nText <tool\n" + kCall + "\n" + kCall + " tail </think>", format(true)},
      {"a <tool_call>\n<function=noop>\n</function>\n</tool_call>\n\n" + kCall, format(false)},
      {"<tool_call>\n<function=bad>\n</function>\n</tool_call>x " + kCall.substr(0, 30), format(false)},
      {"plain text\n\n with spaces  ", format(false, false)},
  };
  std::mt19937 rng(7);
  for (const auto& [text, f] : cases) {
    const AssistantMessage whole = parse_answer(text, f);
    // Every single cut, then random multi-cut splits (down to one byte per piece).
    for (size_t cut = 0; cut <= text.size(); ++cut) expect_same(streamed(text, f, {cut}), whole, text + " @" + std::to_string(cut));
    for (int round = 0; round < 50; ++round) {
      std::vector<size_t> cuts;
      for (size_t i = 1; i < text.size(); ++i)
        if (rng() % 4 == 0) cuts.push_back(i);
      expect_same(streamed(text, f, cuts), whole, text);
    }
    std::vector<size_t> bytes;
    for (size_t i = 1; i < text.size(); ++i) bytes.push_back(i);
    expect_same(streamed(text, f, bytes), whole, text);
  }
}

TEST(ToolCalls, NoPartialMarkerIsEverSent) {
  AnswerParser parser(format(false));
  EXPECT_EQ(parser.push("Hi <tool").size(), 1u);  // "Hi" goes, " <tool" is held
  auto d = parser.push("_cal");
  EXPECT_TRUE(d.empty());
  d = parser.push("l>\n<function=noop>\n</function>\n</tool_call>");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind, AnswerDelta::Kind::kToolCall);
  d = parser.push(" <tooltip>");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, " <tooltip>");
}

TEST(ToolCalls, MessageAndDeltaJson) {
  AssistantMessage m = parse_answer(kCall, format(false));
  const ordered_json msg = assistant_message_json(m);
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_FALSE(msg.contains("reasoning_content"));
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris","days":3})");
  const AssistantMessage thought = parse_answer("r</think>c", format(true, false));
  EXPECT_EQ(assistant_message_json(thought).dump(), R"({"role":"assistant","content":"c","reasoning_content":"r"})");

  AnswerDelta call{AnswerDelta::Kind::kToolCall, {}, m.tool_calls[0], 2};
  const auto deltas = delta_json(call);
  ASSERT_EQ(deltas.size(), 4u);
  EXPECT_EQ(deltas[0].dump(), R"({"tool_calls":[{"index":2,"id":")" + m.tool_calls[0].id +
                                  R"(","type":"function","function":{"name":"get_weather","arguments":""}}]})");
  std::string args;
  for (size_t i = 1; i < deltas.size(); ++i) {
    EXPECT_EQ(deltas[i]["tool_calls"][0]["index"], 2);
    EXPECT_FALSE(deltas[i]["tool_calls"][0].contains("id"));
    args += deltas[i]["tool_calls"][0]["function"]["arguments"].get<std::string>();
  }
  EXPECT_EQ(args, m.tool_calls[0].arguments);
  EXPECT_EQ(delta_json(AnswerDelta{AnswerDelta::Kind::kReasoning, "x", {}, 0})[0].dump(), R"({"reasoning_content":"x"})");
  EXPECT_EQ(delta_json(AnswerDelta{AnswerDelta::Kind::kContent, "x", {}, 0})[0].dump(), R"({"content":"x"})");
}

TEST(ToolCalls, AForcedPrefixIsReadAsTheAnswersStart) {
  // The server forced "<tool_call>\n<function=" and the model wrote the rest.
  AnswerFormat f = format(false);
  f.prefix = "<tool_call>\n<function=";
  const std::string rest = kCall.substr(f.prefix.size());
  const AssistantMessage whole = parse_answer(rest, f);
  ASSERT_EQ(whole.tool_calls.size(), 1u);
  EXPECT_EQ(whole.tool_calls[0].name, "get_weather");
  EXPECT_EQ(whole.tool_calls[0].arguments, R"({"city":"Paris","days":3})");
  EXPECT_EQ(whole.content, "");
  for (size_t cut = 0; cut <= rest.size(); ++cut) expect_same(streamed(rest, f, {cut}), whole, "cut " + std::to_string(cut));
  // With thinking, the forced opening closes the think block: the reasoning is empty.
  AnswerFormat t = format(true);
  t.prefix = "\n</think>\n\n<tool_call>\n<function=get_weather>\n";
  const AssistantMessage thought = parse_answer(kCall.substr(std::string("<tool_call>\n<function=get_weather>\n").size()), t);
  ASSERT_EQ(thought.tool_calls.size(), 1u);
  EXPECT_EQ(thought.reasoning, "");
  EXPECT_EQ(thought.content, "");
  // Nothing generated at all (a cancelled answer): the prefix alone is an unfinished block.
  EXPECT_EQ(parse_answer("", f).content, f.prefix);
}

TEST(ToolCalls, AnUnparsableForcedCallIsContent) {
  AnswerFormat f = format(false);
  f.prefix = "<tool_call>\n<function=";
  // An undeclared function, and a block cut off before its end.
  const AssistantMessage undeclared = parse_answer("get_time>\n</function>\n</tool_call>", f);
  EXPECT_TRUE(undeclared.tool_calls.empty());
  EXPECT_EQ(undeclared.content, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>");
  EXPECT_EQ(answer_finish_reason("stop", undeclared.tool_calls.size(), undeclared.unfinished_call), "stop");
  const AssistantMessage cut = parse_answer("get_weather>\n<parameter=city>\nPar", f);
  EXPECT_TRUE(cut.tool_calls.empty());
  EXPECT_EQ(cut.content, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
}

// A second call cut off (a stop string ended the answer inside it) is content, and the answer
// does not finish "tool_calls" although its first call is complete: whole and streamed alike.
TEST(ToolCalls, ACutSecondCallFinishesAsStop) {
  AnswerFormat f = format(false);
  f.prefix = "<tool_call>\n<function=";
  const std::string text = "noop>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<param";
  const AssistantMessage whole = parse_answer(text, f);
  ASSERT_EQ(whole.tool_calls.size(), 1u);
  EXPECT_EQ(whole.content, "<tool_call>\n<function=get_weather>\n<param");
  EXPECT_TRUE(whole.unfinished_call);
  EXPECT_EQ(answer_finish_reason("stop", whole.tool_calls.size(), whole.unfinished_call), "stop");
  EXPECT_EQ(answer_finish_reason("length", whole.tool_calls.size(), whole.unfinished_call), "length");
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    AnswerParser parser(f);
    parser.push(text.substr(0, cut));
    parser.push(text.substr(cut));
    EXPECT_FALSE(parser.unfinished_call()) << cut;  // only the end of the answer decides
    parser.finish();
    EXPECT_EQ(parser.tool_calls(), 1u) << cut;
    EXPECT_TRUE(parser.unfinished_call()) << cut;
  }
  // Complete calls, text after them, or a malformed but closed block leave nothing unfinished.
  EXPECT_FALSE(parse_answer(kCall + "\nDone.", format(false)).unfinished_call);
  EXPECT_FALSE(parse_answer(kCall + "<tool_call>\nbad\n</tool_call>", format(false)).unfinished_call);
}

// parallel_tool_calls false: the answer ends with its first valid call, whatever follows (more
// calls, text); a malformed block or a call inside the reasoning does not count, and
// first_tool_call_stop (the engine's stop) turns true at exactly the piece that completes it.
TEST(ToolCalls, SingleCallEndsTheAnswerAtTheFirstValidCall) {
  AnswerFormat f = format(/*thinking=*/true);
  f.single_call = true;
  const std::string bad = "<tool_call>\n<function=unknown>\n</function>\n</tool_call>";
  const std::string text = "mentions " + kCall + " while thinking\n</think>\n\nSure. " + bad + " " + kCall +
                           "\n<tool_call>\n<function=noop>\n</function>\n</tool_call> and more";
  const AssistantMessage m = parse_answer(text, f);
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].name, "get_weather");
  EXPECT_EQ(m.content, "Sure." + bad);  // whitespace next to a block is dropped
  EXPECT_EQ(*m.reasoning, "mentions " + kCall + " while thinking");
  for (size_t cut = 1; cut < text.size(); cut += 7) expect_same(streamed(text, f, {cut}), m, "cut " + std::to_string(cut));

  // The stop predicate, fed one character at a time, fires with the '>' closing that call.
  const auto stop = first_tool_call_stop(f)();
  const size_t end = text.rfind(kCall) + kCall.size();
  for (size_t i = 0; i < text.size(); ++i) {
    const bool fired = stop(std::string_view(text).substr(i, 1));
    EXPECT_EQ(fired, i + 1 == end) << "at " << i;
    if (fired) break;
  }
  // Each call of the factory starts fresh; without single_call nothing is cut.
  EXPECT_TRUE(first_tool_call_stop(f)()(text.substr(0, end)));
  f.single_call = false;
  EXPECT_EQ(parse_answer(text, f).tool_calls.size(), 2u);
}
