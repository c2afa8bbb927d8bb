// Request validation of POST /v1/completions, POST /tokenize and POST /detokenize: what each
// accepts, and the param and code of every rejection.
#include <gtest/gtest.h>

#include "request_rejection.h"
#include "server/api_error.h"
#include "server/chat_request.h"

using namespace lily;
using namespace lily::server;
using nlohmann::json;

namespace {

json base() { return json{{"model", "demo"}, {"prompt", "Once upon a time"}}; }

using lily::server::test::with;

/// Runs `parse` on `body` expecting a 400; returns "param|code".
template <class Parse>
std::string rejection(Parse parse, const json& body) {
  if (auto e = lily::server::test::rejection_of(parse, body.dump())) return lily::server::test::param_and_code(*e);
  ADD_FAILURE() << "accepted: " << body.dump();
  return "";
}

std::string completion_rejection(const json& body) { return rejection(parse_completion_request, body); }

}  // namespace

TEST(CompletionRequest, SamplingFieldsAsInChat) {
  const auto r = parse_completion_request(with(with(base(), "temperature", 0.5), "seed", 3).dump());
  ASSERT_TRUE(r.sampling.temperature.has_value());
  EXPECT_EQ(*r.sampling.temperature, 0.5);
  EXPECT_EQ(r.sampling.seed, 3);
  EXPECT_EQ(r.n, 1);
}

TEST(CompletionRequest, TextPrompt) {
  const auto r = parse_completion_request(base().dump());
  EXPECT_EQ(r.model, "demo");
  EXPECT_EQ(r.prompt_text, "Once upon a time");
  EXPECT_TRUE(r.prompt_ids.empty());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens.has_value());
}

TEST(CompletionRequest, TokenIdPromptsAndOneElementBatches) {
  auto r = parse_completion_request(with(base(), "prompt", {1, 2, 3}).dump());
  EXPECT_FALSE(r.prompt_text.has_value());
  EXPECT_EQ(r.prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.prompt_param, "prompt");
  r = parse_completion_request(with(base(), "prompt", json::array({json::array({4, 5})})).dump());
  EXPECT_EQ(r.prompt_ids, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(r.prompt_param, "prompt[0]");
  r = parse_completion_request(with(base(), "prompt", json::array({"text"})).dump());
  EXPECT_EQ(r.prompt_text, "text");
}

TEST(CompletionRequest, SharedGenerationFields) {
  json j = base();
  j["max_tokens"] = 7;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  j["stop"] = json::array({"\n", "END"});
  j["temperature"] = 0;
  j["top_p"] = 1;
  j["n"] = 1;
  j["seed"] = 3;
  j["user"] = "u";
  j["echo"] = false;
  j["best_of"] = 1;
  j["logprobs"] = nullptr;
  j["suffix"] = nullptr;
  j["presence_penalty"] = nullptr;
  const auto r = parse_completion_request(j.dump());
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "END"}));
}

// The legacy fields vLLM serves: n choices, logprobs as a count of alternatives, echo.
TEST(CompletionRequest, LegacyChoicesLogprobsAndEcho) {
  json j = with(base(), "n", 3);
  j["logprobs"] = 2;
  const auto r = parse_completion_request(j.dump());
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 2);
  const auto zero = parse_completion_request(with(base(), "logprobs", 0).dump());
  EXPECT_TRUE(zero.logprobs);
  EXPECT_EQ(zero.top_logprobs, 0);
  EXPECT_FALSE(parse_completion_request(with(base(), "logprobs", nullptr).dump()).logprobs);
  EXPECT_TRUE(parse_completion_request(with(base(), "echo", true).dump()).echo);
  EXPECT_FALSE(parse_completion_request(base().dump()).echo);
}

TEST(CompletionRequest, RejectionsNameTheField) {
  json echo_logprobs = with(base(), "echo", true);
  echo_logprobs["logprobs"] = 1;
  EXPECT_EQ(completion_rejection(echo_logprobs), "echo|unsupported_value");
  EXPECT_EQ(completion_rejection(with(base(), "echo", 1)), "echo|invalid_type");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({"a", "b"}))), "prompt|unsupported_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({json::array({1}), json::array({2})}))),
            "prompt|unsupported_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({1, -1}))), "prompt[1]|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({1, 1.5}))), "prompt[1]|invalid_type");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({1, 4294967296LL}))), "prompt[1]|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({json::array({1, "x"})}))), "prompt[0][1]|invalid_type");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array())), "prompt|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", "")), "prompt|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::array({""}))), "prompt[0]|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", json::object())), "prompt|invalid_type");
  EXPECT_EQ(completion_rejection(with(base(), "prompt", nullptr)), "prompt|missing_required_parameter");
  EXPECT_EQ(completion_rejection(json{{"prompt", "x"}}), "model|missing_required_parameter");
  EXPECT_EQ(completion_rejection(with(base(), "max_tokens", 0)), "max_tokens|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "max_completion_tokens", 5)), "max_completion_tokens|unknown_parameter");
  EXPECT_EQ(completion_rejection(with(base(), "best_of", 2)), "best_of|unsupported_value");
  EXPECT_EQ(completion_rejection(with(base(), "logprobs", 21)), "logprobs|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "logprobs", -1)), "logprobs|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "logprobs", true)), "logprobs|invalid_type");
  EXPECT_EQ(completion_rejection(with(base(), "suffix", "x")), "suffix|unsupported_parameter");
  EXPECT_EQ(completion_rejection(with(base(), "temperature", 2.5)), "temperature|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "n", 9)), "n|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "top_logprobs", 2)), "top_logprobs|unknown_parameter");
  EXPECT_EQ(completion_rejection(with(base(), "stop", json::array({"a", "b", "c", "d", "e"}))), "stop|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "stream_options", {{"include_usage", true}})), "stream_options|invalid_value");
  EXPECT_EQ(completion_rejection(with(base(), "messages", json::array())), "messages|unknown_parameter");
  EXPECT_EQ(completion_rejection(with(base(), "whatever", nullptr)), "whatever|unknown_parameter");
  try {
    parse_completion_request("[1]");
    ADD_FAILURE();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.code(), "invalid_json");
  }
}

TEST(TokenizeRequest, ContinueFinalMessage) {
  const json messages = json::array({{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}}});
  json j = {{"messages", messages}, {"continue_final_message", true}};
  const auto r = parse_tokenize_request(j.dump());
  EXPECT_TRUE(r.continue_final_message);
  EXPECT_FALSE(r.add_generation_prompt);
  j["add_generation_prompt"] = true;
  try {
    parse_tokenize_request(j.dump());
    ADD_FAILURE() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "add_generation_prompt");
  }
}

TEST(TokenizeRequest, PromptForm) {
  auto r = parse_tokenize_request(R"({"prompt":"hi","add_special_tokens":false,"model":"demo"})");
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_FALSE(r.add_special_tokens);
  EXPECT_EQ(r.model, "demo");
  EXPECT_TRUE(r.messages.empty());
  r = parse_tokenize_request(R"({"prompt":""})");
  EXPECT_EQ(r.prompt, "");
  EXPECT_FALSE(r.model.has_value());
}

TEST(TokenizeRequest, MessagesForm) {
  auto r = parse_tokenize_request(R"({"messages":[{"role":"user","content":"a"}]})");
  EXPECT_FALSE(r.prompt.has_value());
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_TRUE(r.add_generation_prompt);
  // Without the generation prompt, the conversation may end with the assistant.
  r = parse_tokenize_request(
      R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],"add_generation_prompt":false})");
  EXPECT_EQ(r.messages.size(), 2u);
  EXPECT_FALSE(r.add_generation_prompt);
}

TEST(TokenizeRequest, Rejections) {
  auto parse = parse_tokenize_request;
  EXPECT_EQ(rejection(parse, json::object()), "prompt|missing_required_parameter");
  EXPECT_EQ(rejection(parse, json{{"prompt", "a"}, {"messages", json::array()}}), "messages|invalid_value");
  EXPECT_EQ(rejection(parse, json{{"prompt", 1}}), "prompt|invalid_type");
  EXPECT_EQ(rejection(parse, json{{"prompt", "a"}, {"add_special_tokens", "no"}}), "add_special_tokens|invalid_type");
  EXPECT_EQ(rejection(parse, json{{"prompt", "a"}, {"add_generation_prompt", true}}),
            "add_generation_prompt|unknown_parameter");
  EXPECT_EQ(rejection(parse, json{{"prompt", "a"}, {"model", 3}}), "model|invalid_type");
  EXPECT_EQ(rejection(parse, json{{"messages", json::array({{{"role", "user"}, {"content", "a"}},
                                                            {{"role", "assistant"}, {"content", "b"}}})}}),
            "messages[1].role|invalid_value");
  EXPECT_EQ(rejection(parse, json{{"messages", json::array({{{"role", "tool"}, {"content", "a"}}})}}),
            "messages[0].tool_call_id|missing_required_parameter");
  EXPECT_EQ(rejection(parse, json{{"messages", json::array({{{"role", "function"}, {"content", "a"}}})}}),
            "messages[0].role|unsupported_value");
  EXPECT_EQ(rejection(parse, json{{"messages", json::array({{{"role", "user"}, {"content", "a"}}})},
                                  {"tools", json::array({{{"type", "function"}}})}}),
            "tools[0].function|missing_required_parameter");
  EXPECT_EQ(rejection(parse, json{{"messages", "x"}}), "messages|invalid_type");
}

TEST(DetokenizeRequest, TokensAndRejections) {
  const auto r = parse_detokenize_request(R"({"tokens":[0,5,8191],"model":"demo"})");
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{0, 5, 8191}));
  EXPECT_EQ(parse_detokenize_request(R"({"tokens":[]})").tokens.size(), 0u);
  auto parse = parse_detokenize_request;
  EXPECT_EQ(rejection(parse, json::object()), "tokens|missing_required_parameter");
  EXPECT_EQ(rejection(parse, json{{"tokens", "1,2"}}), "tokens|invalid_type");
  EXPECT_EQ(rejection(parse, json{{"tokens", {1, -3}}}), "tokens[1]|invalid_value");
  EXPECT_EQ(rejection(parse, json{{"tokens", {1, true}}}), "tokens[1]|invalid_type");
  EXPECT_EQ(rejection(parse, json{{"tokens", {1}}, {"skip_special_tokens", true}}), "skip_special_tokens|unknown_parameter");
}
