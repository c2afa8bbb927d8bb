// libFuzzer target: the request parsers and validators (src/server/chat_request.h) of chat,
// legacy completions, /tokenize and /detokenize on arbitrary bodies, followed by what the server
// does next with a request: render the chat template, or serialize the error response. Allowed:
// server::ApiError from a parser (its JSON body must then serialize: the server sends it),
// lily::Error from the template. Invariants for accepted requests (the documented contract):
// chat messages non-empty and the last from the user (or the assistant with
// continue_final_message), min_tokens within max_tokens, a structured-output schema whose matcher
// takes any bytes, a forced tool call's grammar built from any tool schemas (never an error)
// whose matcher takes any text, max_tokens ≥ 1 when set, at most 4
// non-empty stop strings, include_usage only with stream; a completion has exactly one
// non-empty prompt (text or ids in [0, 2^31)); a tokenize request has a prompt or messages
// (the last from the user, or also the assistant without the generation prompt); detokenize
// ids lie in [0, 2^31).
#include <cstdint>
#include <type_traits>
#include <vector>
#include <string>
#include <string_view>

#include "base/error.h"
#include "fuzz_support.h"
#include "server/api_error.h"
#include "server/chat_agent.h"
#include "server/chat_request.h"
#include "server/openai_json.h"
#include "server/tool_calls.h"
#include "text/chat_template.h"

namespace {

/// A structured-output schema compiled from the request: the matcher takes any bytes (here the
/// body itself) without throwing, and stops at the first refused one or a complete document.
void check_schema(const lily::server::GenerationFields& req, std::string_view bytes) {
  if (!req.json_schema) return;
  lily::JsonMatcher m(req.json_schema);
  for (char c : bytes)
    if (!m.feed(static_cast<unsigned char>(c))) break;
}

/// A forced tool call's grammar from the request's tools (a schema the constraint cannot follow
/// leaves that tool unfollowed, never an error): its matcher takes any bytes (here the last
/// message's text, which a seed writes as a call) without throwing, and stops at the first
/// refused one.
void check_forced_call(const lily::server::ChatRequest& req) {
  const auto grammar = lily::server::forced_call_grammar(req.agent);
  if (!grammar) return;
  lily::ToolCallMatcher m(grammar);
  for (char c : req.messages.back().content)
    if (!m.feed(static_cast<unsigned char>(c))) break;
}

void check_accepted(const lily::server::ChatRequest& req) {
  FUZZ_ASSERT(!req.messages.empty(), "");
  FUZZ_ASSERT(req.messages.back().role == lily::ChatRole::kUser || req.messages.back().role == lily::ChatRole::kTool ||
                  (req.continue_final_message && req.messages.back().role == lily::ChatRole::kAssistant), "");
  FUZZ_ASSERT(req.min_tokens >= 0 && (!req.max_tokens || req.min_tokens <= *req.max_tokens), "");
  FUZZ_ASSERT(!req.max_tokens || *req.max_tokens >= 1, "");
  FUZZ_ASSERT(req.stop.size() <= lily::server::kMaxStopStrings, "");
  for (const std::string& s : req.stop) FUZZ_ASSERT(!s.empty(), "");
  FUZZ_ASSERT(!req.include_usage || req.stream, "");
  try {
    (void)lily::render_chat(req.messages);
  } catch (const lily::Error&) {
    // e.g. only <tool_response> user messages: the server answers 400 with this message.
  }
}

void check_generation_fields(const lily::server::GenerationFields& req) {
  FUZZ_ASSERT(!req.max_tokens || *req.max_tokens >= 1, "");
  FUZZ_ASSERT(req.stop.size() <= lily::server::kMaxStopStrings, "");
  for (const std::string& s : req.stop) FUZZ_ASSERT(!s.empty(), "");
  FUZZ_ASSERT(!req.include_usage || req.stream, "");
}

void check_ids(const std::vector<int64_t>& ids) {
  for (int64_t id : ids) FUZZ_ASSERT(id >= 0 && id <= INT32_MAX, std::to_string(id));
}

void check_accepted(const lily::server::CompletionRequest& req) {
  check_generation_fields(req);
  FUZZ_ASSERT(req.prompt_text.has_value() != !req.prompt_ids.empty(), "exactly one prompt form");
  FUZZ_ASSERT(!req.prompt_text || !req.prompt_text->empty(), "");
  FUZZ_ASSERT(req.prompt_param == "prompt" || req.prompt_param == "prompt[0]", req.prompt_param);
  check_ids(req.prompt_ids);
}

void check_accepted(const lily::server::TokenizeRequest& req) {
  FUZZ_ASSERT(req.prompt.has_value() != !req.messages.empty(), "exactly one of prompt and messages");
  if (req.prompt) return;
  const lily::ChatRole last = req.messages.back().role;
  FUZZ_ASSERT(last == lily::ChatRole::kUser || last == lily::ChatRole::kTool ||
                  (!req.add_generation_prompt && last == lily::ChatRole::kAssistant), "");
  try {
    (void)lily::render_chat(req.messages, req.add_generation_prompt);
  } catch (const lily::Error&) {
    // e.g. a system message after the first: the server answers 400 with this message.
  }
}

void check_accepted(const lily::server::DetokenizeRequest& req) { check_ids(req.tokens); }

void check_rejected(const lily::server::ApiError& e) {
  FUZZ_ASSERT(e.status() == 400, std::to_string(e.status()));
  FUZZ_ASSERT(std::string_view(e.what()).size() > 0, "");
  // The server sends this body (serialized as send_error in server/server_impl.h does, invalid UTF-8 replaced).
  const std::string body = lily::server::dump(e.body());
  FUZZ_ASSERT(body.find("\"invalid_request_error\"") != std::string::npos, body);
}

/// Runs one parser on `body` and checks what it accepts or how it refuses.
template <class Parse>
void run(Parse parse, std::string_view body) {
  try {
    const auto req = parse(body);
    check_accepted(req);
    if constexpr (std::is_base_of_v<lily::server::GenerationFields, std::decay_t<decltype(req)>>) check_schema(req, body);
    if constexpr (std::is_same_v<lily::server::ChatRequest, std::decay_t<decltype(req)>>) check_forced_call(req);
  } catch (const lily::server::ApiError& e) {
    try {
      check_rejected(e);
    } catch (const std::exception& inner) {
      lily::fuzz::fail("serializing the error response threw:", std::string(inner.what()) + " for error '" +
                                                                   lily::fuzz::printable(e.what()) + "'");
    }
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  run(lily::server::parse_chat_request, body);
  run(lily::server::parse_completion_request, body);
  run(lily::server::parse_tokenize_request, body);
  run(lily::server::parse_detokenize_request, body);
  // The same bytes as a model's answer: the answer parser never throws, for any text.
  try {
    lily::server::AnswerFormat format;
    format.thinking = size % 2 == 1;
    format.tools.emplace(nlohmann::ordered_json::parse(
        R"([{"type":"function","function":{"name":"f","parameters":{"properties":{"n":{"type":"integer"}}}}}])"));
    const auto message = lily::server::parse_answer(body, format);
    (void)lily::server::dump(lily::server::assistant_message_json(message));
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
