// The agent fields of a chat request (server/chat_agent.h): tools, tool_choice,
// parallel_tool_calls, reasoning_effort, chat_template_kwargs, and the tool-calling message
// fields. Every invalid combination is a 400 naming the field.
#include <gtest/gtest.h>

#include "request_rejection.h"
#include "server/api_error.h"
#include "server/chat_request.h"

using namespace lily;
using namespace lily::server;
using nlohmann::json;

namespace {

json weather_tool() {
  return json{{"type", "function"},
              {"function",
               {{"name", "get_weather"},
                {"description", "Weather of a city"},
                {"parameters",
                 {{"type", "object"},
                  {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
                  {"required", json::array({"city"})}}}}}};
}

/// The minimal chat body (request_rejection.h) offering the weather tool: every case edits it.
json base() {
  return lily::server::test::with(lily::server::test::minimal_chat_body(), "tools", json::array({weather_tool()}));
}

/// base() with `key` set to `value`.
json with(const std::string& key, const json& value) { return lily::server::test::with(base(), key, value); }

/// "param|code" of the 400 the body gets, or "accepted".
std::string rejection(const json& body) {
  const auto e = lily::server::test::rejection_of(parse_chat_request, body.dump());
  return e ? lily::server::test::param_and_code(*e) : "accepted";
}

json tool_with(const std::string& pointer, const json& value) {
  json t = weather_tool();
  t[json::json_pointer(pointer)] = value;
  return with("tools", json::array({t}));
}

json conversation(json messages) { return with("messages", std::move(messages)); }

/// The agent fields parsed from base() with the top-level members of `extra` set over it.
ChatAgentFields agent_fields(const json& extra) {
  json j = base();
  for (const auto& [k, v] : extra.items()) j[k] = v;
  return parse_chat_request(j.dump()).agent;
}

json call_message(const json& arguments) {
  return json{{"role", "assistant"},
              {"content", nullptr},
              {"tool_calls", json::array({{{"id", "call_1"},
                                           {"type", "function"},
                                           {"function", {{"name", "get_weather"}, {"arguments", arguments}}}}})}};
}

}  // namespace

TEST(ChatAgent, AcceptsAToolConversation) {
  json body = conversation(json::array({{{"role", "developer"}, {"content", "be brief"}},
                                        {{"role", "user"}, {"content", "weather?"}, {"name", "ann"}},
                                        call_message(R"({"city": "Paris", "days": 2})"),
                                        {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}}}));
  body["tool_choice"] = "auto";
  body["parallel_tool_calls"] = false;
  const ChatRequest r = parse_chat_request(body.dump());
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, ChatRole::kSystem);  // developer is a system message
  EXPECT_EQ(r.messages[1].name, "ann");
  ASSERT_EQ(r.messages[2].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.messages[2].tool_calls[0].id, "call_1");
  EXPECT_EQ(r.messages[2].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[2].tool_calls[0].arguments.dump(), R"({"city":"Paris","days":2})");  // the client's order
  EXPECT_EQ(r.messages[3].role, ChatRole::kTool);
  EXPECT_EQ(r.messages[3].tool_call_id, "call_1");
  EXPECT_TRUE(r.agent.tools_active());
  EXPECT_EQ(r.agent.parallel_tool_calls, false);
}

TEST(ChatAgent, ToolsKeepTheClientsKeyOrder) {
  // The template prints them with tojson: the prompt shows them as the client wrote them.
  const ChatRequest r = parse_chat_request(
      R"({"model":"demo","messages":[{"role":"user","content":"q"}],)"
      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}}}}]})");
  EXPECT_EQ(r.agent.tools.dump(),
            R"([{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}}}}])");
}

TEST(ChatAgent, ToolChoiceForms) {
  EXPECT_EQ(parse_chat_request(with("tool_choice", "none").dump()).agent.tool_choice, ToolChoice::kNone);
  EXPECT_FALSE(parse_chat_request(with("tool_choice", "none").dump()).agent.tools_active());
  EXPECT_EQ(parse_chat_request(with("tool_choice", "required").dump()).agent.tool_choice, ToolChoice::kRequired);
  const auto named = parse_chat_request(
      with("tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}).dump());
  EXPECT_EQ(named.agent.tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(named.agent.tool_choice_name, "get_weather");
}

TEST(ChatAgent, InvalidToolsNameTheField) {
  EXPECT_EQ(rejection(with("tools", json::object())), "tools|invalid_type");
  EXPECT_EQ(rejection(with("tools", json::array({"x"}))), "tools[0]|invalid_type");
  EXPECT_EQ(rejection(tool_with("/type", "retrieval")), "tools[0].type|unsupported_value");
  EXPECT_EQ(rejection(tool_with("/extra", 1)), "tools[0].extra|unknown_parameter");
  EXPECT_EQ(rejection(with("tools", json::array({{{"type", "function"}}}))), "tools[0].function|missing_required_parameter");
  EXPECT_EQ(rejection(tool_with("/function/name", 3)), "tools[0].function.name|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/name", "get weather")), "tools[0].function.name|invalid_value");
  EXPECT_EQ(rejection(tool_with("/function/description", 3)), "tools[0].function.description|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/parameters", "object")), "tools[0].function.parameters|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/parameters/type", "array")), "tools[0].function.parameters.type|invalid_value");
  EXPECT_EQ(rejection(tool_with("/function/parameters/properties", json::array())),
            "tools[0].function.parameters.properties|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/parameters/properties/city", 1)),
            "tools[0].function.parameters.properties.city|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/strict", "yes")), "tools[0].function.strict|invalid_type");
  EXPECT_EQ(rejection(tool_with("/function/returns", 1)), "tools[0].function.returns|unknown_parameter");
  EXPECT_EQ(rejection(with("tools", json::array({weather_tool(), weather_tool()}))), "tools[1].function.name|invalid_value");
}

TEST(ChatAgent, InvalidToolChoiceNamesTheField) {
  EXPECT_EQ(rejection(with("tool_choice", "sometimes")), "tool_choice|invalid_value");
  EXPECT_EQ(rejection(with("tool_choice", 1)), "tool_choice|invalid_type");
  EXPECT_EQ(rejection(with("tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}})),
            "tool_choice.function.name|invalid_value");
  EXPECT_EQ(rejection(with("tool_choice", {{"type", "function"}})), "tool_choice.function|missing_required_parameter");
  EXPECT_EQ(rejection(with("tool_choice", {{"type", "other"}, {"function", {{"name", "get_weather"}}}})),
            "tool_choice.type|unsupported_value");
  json no_tools = base();
  no_tools.erase("tools");
  no_tools["tool_choice"] = "required";
  EXPECT_EQ(rejection(no_tools), "tool_choice|invalid_value");
  no_tools["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  EXPECT_EQ(rejection(no_tools), "tool_choice.function.name|invalid_value");
  EXPECT_EQ(rejection(with("parallel_tool_calls", "yes")), "parallel_tool_calls|invalid_type");
}

TEST(ChatAgent, OtherKindsOfToolAreRefusedByTheirType) {
  // OpenAI's newer tool kinds carry a key named after their type ("custom", "allowed_tools"):
  // the error names the type, which is what the server cannot take, not that key.
  EXPECT_EQ(rejection(with("tools", json::array({{{"type", "custom"}, {"custom", {{"name", "grammar"}}}}}))),
            "tools[0].type|unsupported_value");
  EXPECT_EQ(rejection(with("tool_choice", {{"type", "allowed_tools"},
                                           {"allowed_tools", {{"mode", "auto"}, {"tools", json::array()}}}})),
            "tool_choice.type|unsupported_value");
  EXPECT_EQ(rejection(with("tool_choice", {{"type", "custom"}, {"custom", {{"name", "grammar"}}}})),
            "tool_choice.type|unsupported_value");
  const json custom_call = {{"role", "assistant"},
                            {"content", nullptr},
                            {"tool_calls", json::array({{{"id", "call_1"},
                                                         {"type", "custom"},
                                                         {"custom", {{"name", "grammar"}, {"input", "x"}}}}})}};
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, custom_call,
                                                {{"role", "user"}, {"content", "q"}}}))),
            "messages[1].tool_calls[0].type|unsupported_value");
}

TEST(ChatAgent, InvalidMessagesNameTheField) {
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, {{"role", "tool"}, {"content", "r"}}}))),
            "messages[1].tool_call_id|missing_required_parameter");
  EXPECT_EQ(rejection(conversation(json::array(
                {{{"role", "user"}, {"content", "q"}}, {{"role", "tool"}, {"content", "r"}, {"tool_call_id", 1}}}))),
            "messages[1].tool_call_id|invalid_type");
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, call_message("{not json"),
                                                {{"role", "user"}, {"content", "q"}}}))),
            "messages[1].tool_calls[0].function.arguments|invalid_value");
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, call_message("[1]"),
                                                {{"role", "user"}, {"content", "q"}}}))),
            "messages[1].tool_calls[0].function.arguments|invalid_value");
  json no_name = call_message("{}");
  no_name["tool_calls"][0]["function"].erase("name");
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, no_name, {{"role", "user"}, {"content", "q"}}}))),
            "messages[1].tool_calls[0].function.name|missing_required_parameter");
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}, {"reasoning_content", "r"}}}))),
            "messages[0].reasoning_content|unknown_parameter");
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}},
                                                {{"role", "assistant"}, {"content", "a"}, {"reasoning_content", 1}},
                                                {{"role", "user"}, {"content", "q"}}}))),
            "messages[1].reasoning_content|invalid_type");
  // The last message may be a tool result, but not an assistant turn.
  EXPECT_EQ(rejection(conversation(json::array({{{"role", "user"}, {"content", "q"}}, call_message("{}")}))),
            "messages[1].role|invalid_value");
}

TEST(ChatAgent, ThinkingSwitches) {
  EXPECT_FALSE(thinking_enabled(agent_fields(json::object()), false));
  EXPECT_TRUE(thinking_enabled(agent_fields(json::object()), true));
  EXPECT_TRUE(thinking_enabled(agent_fields({{"reasoning_effort", "low"}}), false));
  EXPECT_FALSE(thinking_enabled(agent_fields({{"reasoning_effort", "none"}}), true));
  EXPECT_FALSE(thinking_enabled(agent_fields({{"reasoning_effort", "high"}, {"chat_template_kwargs", {{"enable_thinking", false}}}}), true));
  EXPECT_TRUE(thinking_enabled(agent_fields({{"chat_template_kwargs", {{"enable_thinking", true}}}}), false));
  const auto options = template_options(agent_fields({{"chat_template_kwargs", {{"preserve_thinking", true}}}}), false);
  EXPECT_EQ(options.preserve_thinking, true);
  EXPECT_TRUE(options.tools.is_array());
  EXPECT_TRUE(template_options(agent_fields({{"tool_choice", "none"}}), false).tools.is_null());
  EXPECT_EQ(rejection(with("reasoning_effort", 3)), "reasoning_effort|invalid_type");
  EXPECT_EQ(rejection(with("reasoning_effort", "bogus")), "reasoning_effort|invalid_value");
  for (const char* effort : {"minimal", "medium", "xhigh"})
    EXPECT_TRUE(thinking_enabled(agent_fields({{"reasoning_effort", effort}}), false)) << effort;
  EXPECT_TRUE(agent_fields(json::object()).include_reasoning);
  EXPECT_FALSE(agent_fields({{"include_reasoning", false}}).include_reasoning);
  EXPECT_EQ(rejection(with("include_reasoning", "no")), "include_reasoning|invalid_type");
  EXPECT_EQ(rejection(with("chat_template_kwargs", "x")), "chat_template_kwargs|invalid_type");
  EXPECT_EQ(rejection(with("chat_template_kwargs", {{"enable_thinking", "yes"}})),
            "chat_template_kwargs.enable_thinking|invalid_type");
  // Other keys are template variables (as vLLM passes them), but not the ones the server sets.
  const ChatAgentFields custom = agent_fields({{"chat_template_kwargs", {{"custom", {{"a", 1}}}, {"enable_thinking", true}}}});
  EXPECT_EQ(custom.template_kwargs, nlohmann::ordered_json({{"custom", {{"a", 1}}}}));
  EXPECT_EQ(template_options(custom, false).extra_variables, custom.template_kwargs);
  for (const char* reserved : {"messages", "tools", "add_generation_prompt", "documents"})
    EXPECT_EQ(rejection(with("chat_template_kwargs", {{reserved, 1}})),
              std::string("chat_template_kwargs.") + reserved + "|invalid_value");
  // Nor the names of the template engine's functions, which a variable would hide.
  for (const char* builtin : {"namespace", "range", "raise_exception", "strftime_now", "dict"})
    EXPECT_EQ(rejection(with("chat_template_kwargs", {{builtin, 1}})),
              std::string("chat_template_kwargs.") + builtin + "|invalid_value");
}

TEST(ChatAgent, ForcedAnswerPrefix) {
  const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  // auto, none and no tools leave the answer to the model.
  EXPECT_EQ(forced_answer_prefix(agent_fields(json::object()), false), "");
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tool_choice", "auto"}}), false), "");
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tool_choice", "none"}}), false), "");
  // A named function: its opening, name included.
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tool_choice", named}}), false), "<tool_call>\n<function=get_weather>\n");
  // "required" with one tool declared is that tool; with several, the model picks the name (held to the declared ones: ForcedCallGrammar).
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tool_choice", "required"}}), false), "<tool_call>\n<function=get_weather>\n");
  json time_tool = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  const json two = json::array({weather_tool(), time_tool});
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tools", two}, {"tool_choice", "required"}}), false), "<tool_call>\n<function=");
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tools", two}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}}}}), false),
            "<tool_call>\n<function=get_time>\n");
  // With thinking on, the think block is closed first.
  EXPECT_EQ(forced_answer_prefix(agent_fields({{"tool_choice", named}}), true),
            "\n</think>\n\n<tool_call>\n<function=get_weather>\n");
}

TEST(ChatAgent, ForcedCallGrammar) {
  const json time_tool = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  const json alarm_tool = {{"type", "function"}, {"function", {{"name", "set-alarm_2"}}}};
  const json three = json::array({weather_tool(), time_tool, alarm_tool});
  // "required" with several tools: the name first, every declared one closed as the model writes
  // it; further calls may follow unless parallel_tool_calls is false.
  const auto several = forced_call_grammar(agent_fields({{"tools", three}, {"tool_choice", "required"}}));
  ASSERT_TRUE(several);
  EXPECT_FALSE(several->named());
  EXPECT_TRUE(several->more_calls());
  EXPECT_EQ(several->function_names().texts,
            (std::vector<std::string>{"get_time>\n", "get_weather>\n", "set-alarm_2>\n"}));
  EXPECT_FALSE(forced_call_grammar(agent_fields({{"tools", three}, {"tool_choice", "required"}, {"parallel_tool_calls", false}}))
                   ->more_calls());
  // One tool, or a named one: from after its opening, one call only when named. The parameters are
  // typed as the parser types them: "city" raw text, "days" JSON; "city" required.
  const auto single = forced_call_grammar(agent_fields({{"tool_choice", "required"}}));
  ASSERT_TRUE(single);
  EXPECT_EQ(single->named(), std::optional<size_t>(0));
  const auto& weather = single->functions()[0];
  ASSERT_EQ(weather.parameters.size(), 2u);
  EXPECT_EQ(weather.parameters[0].name, "city");
  EXPECT_TRUE(weather.parameters[0].raw);
  EXPECT_FALSE(weather.parameters[1].raw);
  EXPECT_EQ(weather.required, 1u);
  const auto named = forced_call_grammar(agent_fields(
      {{"tools", three}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}}}}));
  ASSERT_TRUE(named);
  EXPECT_FALSE(named->more_calls());
  ASSERT_EQ(named->functions().size(), 1u);
  EXPECT_EQ(named->functions()[0].name, "get_time");
  // Nothing forced: nothing to hold.
  for (const char* choice : {"auto", "none"})
    EXPECT_FALSE(forced_call_grammar(agent_fields({{"tools", three}, {"tool_choice", choice}}))) << choice;
  EXPECT_FALSE(forced_call_grammar(agent_fields(json::object())));
  // A schema the constraint cannot follow: a named tool falls back to its opening alone (null);
  // among several it is unfollowed (free after its name) while the names are still held.
  json odd = weather_tool();
  odd["function"]["parameters"]["allOf"] = json::array({json::object()});
  EXPECT_FALSE(forced_call_grammar(agent_fields({{"tools", json::array({odd})}, {"tool_choice", "required"}})));
  const auto mixed = forced_call_grammar(agent_fields({{"tools", json::array({odd, time_tool})}, {"tool_choice", "required"}}));
  ASSERT_TRUE(mixed);
  EXPECT_FALSE(mixed->functions()[0].schema);
  EXPECT_NE(mixed->functions()[0].unfollowed.find("allOf"), std::string::npos) << mixed->functions()[0].unfollowed;
  EXPECT_TRUE(mixed->functions()[1].schema);
}
