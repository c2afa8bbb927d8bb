// The request surface of POST /v1/chat/completions (issue 4 item 2): strict parsing of the
// OpenAI JSON body into native types. Everything not listed here is rejected with a 400 that
// names the parameter and says why.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/chat_template.h"

namespace lily::server {

/// A validated chat-completions request.
struct ChatRequest {
  std::string model;                        ///< must equal the served name (checked by the caller: 404)
  std::vector<ChatMessage> messages;        ///< non-empty, last one from the user
  std::optional<int64_t> max_tokens;        ///< ≥ 1 when set (max_tokens or max_completion_tokens)
  bool stream = false;
  bool include_usage = false;               ///< stream_options.include_usage
  std::vector<std::string> stop;            ///< 0…4 non-empty stop strings
  std::optional<std::string> prompt_cache_key;
};

/// Most stop strings accepted (OpenAI's limit).
inline constexpr size_t kMaxStopStrings = 4;

/// Parses and validates a request body. Accepted: model, messages (roles system/user/assistant;
/// content a string or an array of {"type":"text","text":…} parts, joined with "\n"),
/// max_tokens / max_completion_tokens (integers ≥ 1; equal when both), stream,
/// stream_options.include_usage (only with stream), stop (string or ≤ 4 strings), prompt_cache_key,
/// user (ignored), and the greedy-equivalent n = 1, temperature = 0, top_p = 1,
/// presence_penalty = 0, frequency_penalty = 0, seed (any integer), logprobs = false. `null`
/// counts as absent for optional fields. Throws ApiError (400 invalid_request_error) naming the
/// parameter, e.g. param "messages[1].content[0].type".
ChatRequest parse_chat_request(std::string_view body);

}  // namespace lily::server
