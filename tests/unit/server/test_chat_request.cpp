// Request validation of POST /v1/chat/completions: every accepted field and every rejection,
// with the status, param and code a client sees.
#include <gtest/gtest.h>

#include "request_rejection.h"
#include "server/api_error.h"
#include "server/chat_request.h"

using namespace lily;
using namespace lily::server;
using nlohmann::json;

namespace {

/// The body every case edits by one field (request_rejection.h).
json base() { return lily::server::test::minimal_chat_body(); }

/// base() with `key` set to `value`.
json with(const std::string& key, const json& value) { return lily::server::test::with(base(), key, value); }

ChatRequest parse(const json& j) { return parse_chat_request(j.dump()); }

/// Parses `body` expecting a 400; returns the error.
ApiError rejected(const std::string& body) {
  if (auto e = lily::server::test::rejection_of(parse_chat_request, body)) return *e;
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "", "");
}

std::string param_of(const json& j) { return rejected(j.dump()).param().value_or("<none>"); }

}  // namespace

TEST(ChatRequest, MinimalRequestParses) {
  auto r = parse(base());
  EXPECT_EQ(r.model, "demo");
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, ChatRole::kUser);
  EXPECT_EQ(r.messages[0].content, "hi");
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_TRUE(r.stop.empty());
}

TEST(ChatRequest, AcceptsEveryListedField) {
  json j = base();
  j["messages"] = json::array({{{"role", "system"}, {"content", "be brief"}},
                               {{"role", "user"}, {"content", "a"}},
                               {{"role", "assistant"}, {"content", "b"}},
                               {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "x"}},
                                                                          {{"type", "text"}, {"text", "y"}}})}}});
  j["max_tokens"] = 12;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  j["stop"] = json::array({"a", "b", "c", "d"});
  j["prompt_cache_key"] = "conv-1";
  j["user"] = "someone";
  j["store"] = false;
  j["metadata"] = {{"team", "a"}};
  j["service_tier"] = "auto";
  j["n"] = 1;
  j["temperature"] = 0;
  j["top_p"] = 1;
  j["presence_penalty"] = 0;
  j["frequency_penalty"] = 0.0;
  j["seed"] = 1234;
  j["logprobs"] = false;
  auto r = parse(j);
  EXPECT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[3].content, "x\ny");
  EXPECT_EQ(r.max_tokens, 12);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.stop.size(), 4u);
  EXPECT_EQ(r.prompt_cache_key, "conv-1");
}

TEST(ChatRequest, MaxCompletionTokensIsAnAlias) {
  EXPECT_EQ(parse(with("max_completion_tokens", 7)).max_tokens, 7);
  json both = with("max_tokens", 7);
  both["max_completion_tokens"] = 7;
  EXPECT_EQ(parse(both).max_tokens, 7);
  both["max_completion_tokens"] = 8;
  EXPECT_EQ(param_of(both), "max_completion_tokens");
}

TEST(ChatRequest, StopAsSingleString) {
  EXPECT_EQ(parse(with("stop", "END")).stop, (std::vector<std::string>{"END"}));
}

TEST(ChatRequest, NullMeansAbsentForOptionalFields) {
  json j = base();
  for (const char* k : {"max_tokens", "stream", "stream_options", "stop", "prompt_cache_key", "user", "n",
                        "temperature", "top_p", "seed", "tools", "logprobs", "top_logprobs", "top_k", "min_p",
                        "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty"})
    j[k] = nullptr;
  auto r = parse(j);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens.has_value());
}

TEST(ChatRequest, MalformedJsonAndNonObjects) {
  EXPECT_EQ(rejected("{\"model\": ").code(), "invalid_json");
  EXPECT_EQ(rejected("").code(), "invalid_json");
  EXPECT_EQ(rejected("[1,2]").code(), "invalid_json");
  EXPECT_EQ(rejected("\"text\"").code(), "invalid_json");
  // A number past double's range makes nlohmann throw out_of_range, not parse_error (found by fuzz_request).
  EXPECT_EQ(rejected("{\"messages\":[],\"max_tokens\":-9e99999}").code(), "invalid_json");
}

TEST(ChatRequest, InvalidUtf8IsRejected) {
  const std::string body = "{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}";
  EXPECT_EQ(rejected(body).code(), "invalid_json");
}

TEST(ChatRequest, MissingRequiredFields) {
  json j = base();
  j.erase("model");
  auto e = rejected(j.dump());
  EXPECT_EQ(e.param(), "model");
  EXPECT_EQ(e.code(), "missing_required_parameter");
  j = base();
  j.erase("messages");
  EXPECT_EQ(param_of(j), "messages");
}

TEST(ChatRequest, WrongTypes) {
  EXPECT_EQ(param_of(with("model", 3)), "model");
  EXPECT_EQ(param_of(with("messages", "hi")), "messages");
  EXPECT_EQ(param_of(with("max_tokens", "10")), "max_tokens");
  EXPECT_EQ(param_of(with("max_tokens", 10.5)), "max_tokens");
  EXPECT_EQ(param_of(with("stream", "yes")), "stream");
  EXPECT_EQ(param_of(with("stop", 5)), "stop");
  EXPECT_EQ(param_of(with("stop", json::array({"a", 1}))), "stop[1]");
  EXPECT_EQ(param_of(with("prompt_cache_key", 5)), "prompt_cache_key");
  EXPECT_EQ(param_of(with("user", json::object())), "user");
  EXPECT_EQ(param_of(with("seed", 1.5)), "seed");
  EXPECT_EQ(param_of(with("temperature", "0")), "temperature");
  EXPECT_EQ(rejected(with("stream", 1).dump()).code(), "invalid_type");
}

// Integers written as floats with no fraction count (Python clients send 5.0); past int64 is
// "too large", not a wrong type, whichever way JSON spelled it.
TEST(ChatRequest, IntegerValuedNumbersCountAsIntegers) {
  EXPECT_EQ(*parse(with("max_tokens", 5.0)).max_tokens, 5);
  EXPECT_EQ(*parse(with("seed", 1e3)).sampling.seed, 1000);
  EXPECT_EQ(*parse(with("seed", -7.0)).sampling.seed, -7);
  EXPECT_EQ(parse(with("n", 2.0)).n, 2);
  const auto huge = rejected(R"({"model":"demo","messages":[{"role":"user","content":"hi"}],"seed":18446744073709551616})");
  EXPECT_EQ(huge.param(), "seed");
  EXPECT_NE(huge.message().find("too large"), std::string::npos) << huge.message();
  const auto big_float = rejected(with("seed", 1e19).dump());
  EXPECT_NE(big_float.message().find("too large"), std::string::npos) << big_float.message();
  const auto tiny = rejected(with("seed", -1e30).dump());
  EXPECT_NE(tiny.message().find("too small"), std::string::npos) << tiny.message();
  EXPECT_EQ(rejected(with("max_tokens", 5.5).dump()).code(), "invalid_type");
}

TEST(ChatRequest, VllmGenerationExtras) {
  json j = with("min_tokens", 4);
  j["ignore_eos"] = true;
  j["max_tokens"] = 4;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}, {"continuous_usage_stats", true}};
  const ChatRequest r = parse(j);
  EXPECT_EQ(r.min_tokens, 4);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_TRUE(r.continuous_usage);
  EXPECT_EQ(parse(base()).min_tokens, 0);
  EXPECT_FALSE(parse(base()).ignore_eos);
  // min_tokens above max_tokens cannot be honoured; negative is out of range.
  json over = with("min_tokens", 5);
  over["max_tokens"] = 4;
  EXPECT_EQ(param_of(over), "min_tokens");
  EXPECT_EQ(param_of(with("min_tokens", -1)), "min_tokens");
  EXPECT_EQ(param_of(with("ignore_eos", 1)), "ignore_eos");
  json bad = with("stream", true);
  bad["stream_options"] = {{"continuous_usage_stats", "yes"}};
  EXPECT_EQ(param_of(bad), "stream_options.continuous_usage_stats");
}

TEST(ChatRequest, AssistantReasoningIsReasoningContent) {
  json j = base();
  j["messages"] = json::array({{{"role", "user"}, {"content", "a"}},
                               {{"role", "assistant"}, {"content", "b"}, {"reasoning", "thought"}},
                               {{"role", "user"}, {"content", "c"}}});
  EXPECT_EQ(parse(j).messages[1].reasoning_content, "thought");
  j["messages"][1]["reasoning_content"] = "thought";
  EXPECT_EQ(parse(j).messages[1].reasoning_content, "thought");
  j["messages"][1]["reasoning_content"] = "other";
  EXPECT_EQ(param_of(j), "messages[1].reasoning");
  // The message naming an unknown field names its role with the right article.
  j["messages"][1].erase("reasoning_content");
  j["messages"][1]["mood"] = 1;
  const auto e = rejected(j.dump());
  EXPECT_NE(e.message().find("(an 'assistant' message)"), std::string::npos) << e.message();
}

TEST(ChatRequest, ContinueFinalMessageRules) {
  json j = base();
  j["messages"] = json::array({{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}}});
  EXPECT_EQ(param_of(j), "messages[1].role");  // an assistant turn last needs the flag
  j["continue_final_message"] = true;
  EXPECT_TRUE(parse(j).continue_final_message);
  j["add_generation_prompt"] = false;
  EXPECT_TRUE(parse(j).continue_final_message);
  j["add_generation_prompt"] = true;
  EXPECT_EQ(param_of(j), "add_generation_prompt");
  j.erase("add_generation_prompt");
  j["continue_final_message"] = "yes";
  EXPECT_EQ(param_of(j), "continue_final_message");
  EXPECT_EQ(param_of(with("add_generation_prompt", false)), "add_generation_prompt");
  EXPECT_FALSE(parse(with("add_generation_prompt", true)).continue_final_message);
  // A forced tool call cannot continue the assistant's text.
  j["continue_final_message"] = true;
  j["tools"] = json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}});
  j["tool_choice"] = "required";
  EXPECT_EQ(param_of(j), "continue_final_message");
  j["tool_choice"] = "auto";
  EXPECT_TRUE(parse(j).continue_final_message);
}

TEST(ChatRequest, MessageRules) {
  EXPECT_EQ(param_of(with("messages", json::array())), "messages");
  EXPECT_EQ(param_of(with("messages", json::array({"hi"}))), "messages[0]");
  EXPECT_EQ(param_of(with("messages", json::array({{{"content", "hi"}}}))), "messages[0].role");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}}}))), "messages[0].content");
  for (const char* role : {"function", "User", "bot"})
    EXPECT_EQ(param_of(with("messages", json::array({{{"role", role}, {"content", "x"}}}))), "messages[0].role") << role;
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", nullptr}}}))), "messages[0].content");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", 5}}}))), "messages[0].content");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", json::array()}}}))),
            "messages[0].content");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", "x"}, {"name", 5}}}))),
            "messages[0].name");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", "x"}, {"tool_call_id", "c"}}}))),
            "messages[0].tool_call_id");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", "x"}, {"tool_calls", json::array()}}}))),
            "messages[0].tool_calls");
}

TEST(ChatRequest, LastMessageMustBeFromTheUser) {
  auto j = with("messages", json::array({{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}}}));
  EXPECT_EQ(param_of(j), "messages[1].role");
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "system"}, {"content", "a"}}}))), "messages[0].role");
}

TEST(ChatRequest, NonTextContentPartsAreRejected) {
  auto part = [](json p) { return with("messages", json::array({{{"role", "user"}, {"content", json::array({p})}}})); };
  EXPECT_EQ(param_of(part({{"type", "image_url"}, {"image_url", {{"url", "http://x"}}}})), "messages[0].content[0].type");
  EXPECT_EQ(param_of(part({{"type", "input_audio"}, {"input_audio", json::object()}})), "messages[0].content[0].type");
  EXPECT_EQ(param_of(part({{"text", "x"}})), "messages[0].content[0].type");
  EXPECT_EQ(param_of(part({{"type", "text"}})), "messages[0].content[0].text");
  EXPECT_EQ(param_of(part({{"type", "text"}, {"text", 3}})), "messages[0].content[0].text");
  EXPECT_EQ(param_of(part({{"type", "text"}, {"text", "x"}, {"extra", 1}})), "messages[0].content[0].extra");
  EXPECT_EQ(param_of(part("just a string")), "messages[0].content[0]");
}

TEST(ChatRequest, MaxTokensMustBePositive) {
  EXPECT_EQ(param_of(with("max_tokens", 0)), "max_tokens");
  EXPECT_EQ(param_of(with("max_tokens", -3)), "max_tokens");
  EXPECT_EQ(param_of(with("max_completion_tokens", 0)), "max_completion_tokens");
  EXPECT_EQ(param_of(with("max_tokens", 18446744073709551615ull)), "max_tokens");
}

TEST(ChatRequest, SamplingFieldsParse) {
  json j = base();
  j["temperature"] = 0.7;
  j["top_p"] = 0.8;
  j["top_k"] = 20;
  j["min_p"] = 0.05;
  j["presence_penalty"] = 1.5;
  j["frequency_penalty"] = -0.5;
  j["repetition_penalty"] = 1.1;
  j["seed"] = -3;
  j["n"] = 3;
  j["logprobs"] = true;
  j["top_logprobs"] = 5;
  j["logit_bias"] = {{"17", -100}, {"3", 2.5}};
  const auto r = parse(j);
  EXPECT_DOUBLE_EQ(*r.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(*r.sampling.top_p, 0.8);
  EXPECT_EQ(*r.sampling.top_k, 20);
  EXPECT_DOUBLE_EQ(*r.sampling.min_p, 0.05);
  EXPECT_DOUBLE_EQ(*r.sampling.presence_penalty, 1.5);
  EXPECT_DOUBLE_EQ(*r.sampling.frequency_penalty, -0.5);
  EXPECT_DOUBLE_EQ(*r.sampling.repetition_penalty, 1.1);
  EXPECT_EQ(*r.sampling.seed, -3);
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 5);
  EXPECT_EQ(r.sampling.logit_bias, (std::vector<std::pair<int64_t, double>>{{3, 2.5}, {17, -100}}));
  // Absent fields stay unset (the server's defaults fill them in).
  const auto d = parse(base());
  EXPECT_FALSE(d.sampling.temperature || d.sampling.top_p || d.sampling.top_k || d.sampling.seed);
  EXPECT_EQ(d.n, 1);
  EXPECT_FALSE(d.logprobs);
}

TEST(ChatRequest, SamplingRangeEdgesAreAccepted) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"temperature", 0}, {"temperature", 2}, {"top_p", 1}, {"top_p", 1e-6}, {"top_k", -1}, {"top_k", 0},
           {"min_p", 0}, {"min_p", 1}, {"presence_penalty", -2}, {"frequency_penalty", 2},
           {"repetition_penalty", 1e-6}, {"repetition_penalty", 2}, {"temperature", 1e-38}, {"n", 1}, {"n", 8}})
    EXPECT_NO_THROW(parse(with(key, value))) << key << "=" << value;
  json j = with("logprobs", true);
  j["top_logprobs"] = 20;
  EXPECT_EQ(parse(j).top_logprobs, 20);
  json bias = json::object();
  for (int i = 0; i < 300; ++i) bias[std::to_string(i)] = 100;
  EXPECT_EQ(parse(with("logit_bias", bias)).sampling.logit_bias.size(), 300u);
}

TEST(ChatRequest, OutOfRangeSamplingValuesNameTheField) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"temperature", -0.1}, {"temperature", 2.01}, {"temperature", "0.7"}, {"top_p", 0}, {"top_p", 1.5},
           {"top_k", -2}, {"top_k", 2.5}, {"min_p", -0.1}, {"min_p", 1.1}, {"presence_penalty", 2.5},
           {"frequency_penalty", -3}, {"repetition_penalty", 0}, {"repetition_penalty", 1e-38}, {"repetition_penalty", 2.5}, {"n", 0},
           {"n", 9}, {"n", 1.5}, {"seed", 1.5}, {"seed", "7"}, {"logprobs", 1}, {"top_logprobs", 21},
           {"top_logprobs", -1}, {"logit_bias", json::array()}, {"logit_bias", json{{"x", 1}}},
           {"logit_bias", json{{"-1", 1}}}, {"logit_bias", json{{"5", 101}}}, {"logit_bias", json{{"5", "1"}}},
           {"logit_bias", json{{"5", 1}, {"05", 2}}}, {"logit_bias", json{{"99999999999", 1}}}}) {
    const auto e = rejected(with(key, value).dump());
    EXPECT_EQ(e.param(), key) << key << "=" << value;
  }
  json bias = json::object();
  for (int i = 0; i < 301; ++i) bias[std::to_string(i)] = 1;
  EXPECT_EQ(param_of(with("logit_bias", bias)), "logit_bias");
  // top_logprobs needs logprobs: true.
  EXPECT_EQ(param_of(with("top_logprobs", 2)), "top_logprobs");
  json off = with("top_logprobs", 2);
  off["logprobs"] = false;
  EXPECT_EQ(param_of(off), "top_logprobs");
}

TEST(ChatRequest, ResponseFormat) {
  EXPECT_EQ(parse(with("response_format", {{"type", "text"}})).json_schema, nullptr);
  EXPECT_EQ(parse(with("response_format", {{"type", "json_object"}})).json_schema, JsonSchema::any_object());
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}};
  const ChatRequest r = parse(with("response_format", {{"type", "json_schema"},
                                                       {"json_schema", {{"name", "thing"}, {"schema", schema}, {"strict", true}}}}));
  ASSERT_NE(r.json_schema, nullptr);
  JsonMatcher m(r.json_schema);
  EXPECT_TRUE(m.feed(R"({"a": 1})") && m.complete());
  EXPECT_EQ(parse(with("response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}})).json_schema,
            JsonSchema::any_object());
  auto code_of = [&](const json& body) {
    const ApiError e = rejected(body.dump());
    return e.param().value_or("") + "|" + e.code().value_or("");
  };
  EXPECT_EQ(code_of(with("response_format", "json")), "response_format|invalid_type");
  EXPECT_EQ(code_of(with("response_format", {{"type", "xml"}})), "response_format.type|invalid_value");
  EXPECT_EQ(code_of(with("response_format", {{"type", "text"}, {"x", 1}})), "response_format.x|unknown_parameter");
  EXPECT_EQ(code_of(with("response_format", {{"type", "json_schema"}})), "response_format.json_schema|missing_required_parameter");
  EXPECT_EQ(code_of(with("response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}})),
            "response_format.json_schema.name|missing_required_parameter");
  const json bad = {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", {{"type", "object"}, {"allOf", json::array()}}}}}};
  EXPECT_EQ(code_of(with("response_format", bad)), "response_format.json_schema.schema|invalid_value");
  EXPECT_NE(rejected(with("response_format", bad).dump()).message().find("unsupported JSON schema keyword 'allOf'"),
            std::string::npos);
  EXPECT_EQ(parse(with("response_format", nullptr)).json_schema, nullptr);  // null is absent
  EXPECT_EQ(code_of(with("response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "a b"}}}})),
            "response_format.json_schema.name|invalid_value");
  EXPECT_EQ(code_of(with("response_format", {{"type", "json_schema"}, {"json_schema", {{"name", ""}}}})),
            "response_format.json_schema.name|invalid_value");
  json stopped = with("response_format", {{"type", "json_object"}});
  stopped["stop"] = "}";
  EXPECT_EQ(code_of(stopped), "stop|unsupported_value");
  stopped.erase("stop");
  stopped["stop_token_ids"] = json::array({5});
  EXPECT_EQ(code_of(stopped), "stop_token_ids|unsupported_value");
  // With thinking asked for (the document then follows the think block), not with a forced
  // tool call or a continued turn.
  json thinking = with("response_format", {{"type", "json_object"}});
  thinking["chat_template_kwargs"] = {{"enable_thinking", true}};
  EXPECT_NE(parse(thinking).json_schema, nullptr);
  thinking.erase("chat_template_kwargs");
  thinking["reasoning_effort"] = "high";
  EXPECT_NE(parse(thinking).json_schema, nullptr);
  thinking["reasoning_effort"] = "none";
  EXPECT_NE(parse(thinking).json_schema, nullptr);
  json forced = with("response_format", {{"type", "json_object"}});
  forced["tools"] = json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}});
  forced["tool_choice"] = "required";
  EXPECT_EQ(code_of(forced), "response_format|invalid_value");
}

TEST(ChatRequest, UnsupportedAndUnknownParameters) {
  for (const char* k : {"functions", "best_of", "modalities"}) {
    auto e = rejected(with(k, json::array()).dump());
    EXPECT_EQ(e.param(), k);
    EXPECT_EQ(e.code(), "unsupported_parameter") << k;
  }
  // What every answer is anyway (plain text) is served; anything else is refused.
  EXPECT_NO_THROW(parse(with("modalities", json::array({"text"}))));
  for (const json& v : {json::array({"text", "audio"}), json::array({"audio"}), json("text")})
    EXPECT_EQ(rejected(with("modalities", v).dump()).code(), "unsupported_parameter") << v;
  auto e = rejected(with("speculative_decoding", true).dump());
  EXPECT_EQ(e.param(), "speculative_decoding");
  EXPECT_EQ(e.code(), "unknown_parameter");
}

TEST(ChatRequest, StopRules) {
  EXPECT_EQ(param_of(with("stop", json::array({"a", "b", "c", "d", "e"}))), "stop");
  EXPECT_EQ(param_of(with("stop", "")), "stop");
  EXPECT_EQ(param_of(with("stop", json::array({"a", ""}))), "stop");
}

TEST(ChatRequest, StreamOptionsRules) {
  EXPECT_EQ(param_of(with("stream_options", {{"include_usage", true}})), "stream_options");  // without stream
  json j = with("stream", true);
  j["stream_options"] = {{"include_usage", "yes"}};
  EXPECT_EQ(param_of(j), "stream_options.include_usage");
  j["stream_options"] = {{"other", true}};
  EXPECT_EQ(param_of(j), "stream_options.other");
  // include_obfuscation: checked, and there is no padding to switch either way.
  j["stream_options"] = {{"include_usage", true}, {"include_obfuscation", false}};
  EXPECT_TRUE(parse(j).include_usage);
  j["stream_options"] = {{"include_obfuscation", "no"}};
  EXPECT_EQ(param_of(j), "stream_options.include_obfuscation");
  j["stream_options"] = 5;
  EXPECT_EQ(param_of(j), "stream_options");
}

TEST(ApiErrorShape, HasMessageTypeParamAndCode) {
  auto body = invalid_request("bad", "max_tokens").body();
  EXPECT_EQ(body["error"]["message"], "bad");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "max_tokens");
  EXPECT_EQ(body["error"]["code"], "invalid_value");
  auto plain = ApiError(500, "server_error", "internal").body();
  EXPECT_TRUE(plain["error"]["param"].is_null());
  EXPECT_TRUE(plain["error"]["code"].is_null());
}

// A NUL byte in a request's model name cut the 404 message at the NUL, since
// body() used what() (a C string). The whole message comes back now.
TEST(ApiErrorShape, MessageKeepsBytesAfterANul) {
  const std::string message = std::string("the model 'a") + '\0' + "b' does not exist; this server serves 'demo'";
  const ApiError e(404, "invalid_request_error", message, "model", "model_not_found");
  EXPECT_EQ(e.message(), message);
  EXPECT_EQ(e.body()["error"]["message"].get<std::string>(), message);
  EXPECT_NE(e.body().dump().find("a\\u0000b' does not exist"), std::string::npos) << e.body().dump();
  // what() (a C string, for code that logs it) shows the NUL instead of stopping there.
  EXPECT_STREQ(e.what(), "the model 'a\\u0000b' does not exist; this server serves 'demo'");
}

// Nesting beyond kMaxJsonDepth (128 levels) is refused with a 400 before anything walks the
// document recursively (a body nested 30,000 deep once overflowed the stack in the chat
// template's conversion of the tools); 128 levels are accepted.
TEST(ChatRequest, NestingDeeperThanTheLimitIsRefused) {
  auto nested_enum = [](int depth) {
    return json::parse("{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"tools\":[{\"type\":"
                       "\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\",\"properties\":"
                       "{\"x\":{\"enum\":" + std::string(depth, '[') + std::string(depth, ']') + "}}}}}]}",
                       nullptr, true, false)
        .dump();
  };
  // The tools array sits 7 levels down (body, tools, tool, function, parameters, properties, x).
  EXPECT_NO_THROW(parse_chat_request(nested_enum(128 - 7)));
  EXPECT_EQ(rejected(nested_enum(128 - 6)).code(), "invalid_json");
  const std::string deep = "{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"tools\":[{"
                           "\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"enum\":" +
                           std::string(30000, '[') + std::string(30000, ']') + "}}}]}";
  const ApiError e = rejected(deep);
  EXPECT_EQ(e.code(), "invalid_json");
  EXPECT_NE(std::string(e.what()).find("deeper than 128 levels"), std::string::npos) << e.what();

  // The arguments of an earlier tool call are JSON in a string: the same bound, naming the field.
  std::string args;
  for (int i = 0; i < 200; ++i) args += "{\"a\":";
  args += "1" + std::string(200, '}');
  json j = base();
  j["messages"] = json::array({{{"role", "user"}, {"content", "a"}},
                               {{"role", "assistant"},
                                {"tool_calls", json::array({{{"id", "c"}, {"type", "function"},
                                                             {"function", {{"name", "f"}, {"arguments", args}}}}})}},
                               {{"role", "tool"}, {"tool_call_id", "c"}, {"content", "ok"}}});
  EXPECT_EQ(param_of(j), "messages[1].tool_calls[0].function.arguments");
}

// Assistant messages as OpenAI's own answers carry them, sent back in the history: refusal,
// annotations, and function_call / audio as null are accepted (a refusal's text is the turn's
// content); function_call or audio with a value are refused, naming the field. A text part may
// carry a proxy's cache_control hint.
TEST(ChatRequest, OpenAiAnswerFieldsInTheHistoryAreAccepted) {
  auto history = [](json assistant) {
    return with("messages", json::array({{{"role", "user"}, {"content", "a"}}, assistant,
                                         {{"role", "user"}, {"content", "b"}}}));
  };
  const ChatRequest r = parse(history({{"role", "assistant"}, {"content", "ok"}, {"refusal", nullptr},
                                       {"function_call", nullptr}, {"audio", nullptr}, {"annotations", json::array()},
                                       {"parsed", nullptr}}));
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1].content, "ok");
  const ChatRequest refused = parse(history({{"role", "assistant"}, {"content", nullptr}, {"refusal", "I can't help."}}));
  EXPECT_EQ(refused.messages[1].content, "I can't help.");
  // The openai client's parse helpers return the answer with its structured output as "parsed".
  const ChatRequest structured = parse(history({{"role", "assistant"}, {"content", "{\"a\":1}"}, {"parsed", {{"a", 1}}}}));
  EXPECT_EQ(structured.messages[1].content, "{\"a\":1}");
  EXPECT_EQ(param_of(history({{"role", "assistant"}, {"content", "ok"}, {"function_call", {{"name", "f"}}}})),
            "messages[1].function_call");
  EXPECT_EQ(param_of(history({{"role", "assistant"}, {"content", "ok"}, {"audio", {{"id", "x"}}}})), "messages[1].audio");
  EXPECT_EQ(param_of(history({{"role", "assistant"}, {"content", "ok"}, {"refusal", 3}})), "messages[1].refusal");
  EXPECT_EQ(param_of(history({{"role", "assistant"}, {"content", "ok"}, {"annotations", "x"}})), "messages[1].annotations");
  // Only assistant messages: a user message with refusal is still an unknown field.
  EXPECT_EQ(param_of(with("messages", json::array({{{"role", "user"}, {"content", "a"}, {"refusal", nullptr}}}))),
            "messages[0].refusal");
  const ChatRequest cached = parse(with(
      "messages", json::array({{{"role", "user"},
                                {"content", json::array({{{"type", "text"}, {"text", "x"},
                                                          {"cache_control", {{"type", "ephemeral"}}}}})}}})));
  EXPECT_EQ(cached.messages[0].content, "x");
}

// OpenAI's store / metadata / service_tier are accepted and ignored, with their types checked.
TEST(ChatRequest, StoreMetadataAndServiceTierAreCheckedThenIgnored) {
  EXPECT_NO_THROW(parse(with("store", true)));
  EXPECT_EQ(param_of(with("store", "yes")), "store");
  EXPECT_EQ(param_of(with("metadata", "x")), "metadata");
  EXPECT_EQ(param_of(with("metadata", {{"a", 1}})), "metadata.a");
  json many = json::object();
  for (int i = 0; i < 17; ++i) many["k" + std::to_string(i)] = "v";
  EXPECT_EQ(param_of(with("metadata", many)), "metadata");
  EXPECT_EQ(param_of(with("service_tier", 3)), "service_tier");
}

// Newer OpenAI fields that change nothing here: safety_identifier (user's successor) and
// prompt_cache_retention are checked and ignored; verbosity is served at its default only.
TEST(ChatRequest, SafetyIdentifierCacheRetentionAndVerbosity) {
  EXPECT_NO_THROW(parse(with("safety_identifier", "user-123")));
  EXPECT_NO_THROW(parse(with("prompt_cache_retention", "24h")));
  EXPECT_NO_THROW(parse(with("verbosity", "medium")));
  EXPECT_EQ(param_of(with("safety_identifier", 5)), "safety_identifier");
  EXPECT_EQ(param_of(with("prompt_cache_retention", true)), "prompt_cache_retention");
  const ApiError terse = rejected(with("verbosity", "low").dump());
  EXPECT_EQ(terse.param(), "verbosity");
  EXPECT_EQ(terse.code(), "unsupported_value");
  EXPECT_EQ(param_of(with("verbosity", 1)), "verbosity");
  for (const char* k : {"safety_identifier", "prompt_cache_retention", "verbosity"}) EXPECT_NO_THROW(parse(with(k, nullptr))) << k;
}
