// The request surface of POST /v1/chat/completions (issue 4 item 2): strict parsing of the
// OpenAI JSON body into native types. Everything not listed here is rejected with a 400 that
// names the parameter and says why.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/chat_template.h"

namespace lily::server {

/// The sampling fields of a request, each unset when the request does not give it (the
/// server's defaults fill those in). Ranges are checked by parse_chat_request.
struct RequestSampling {
  std::optional<double> temperature;         ///< 0 … 2 (0 = greedy)
  std::optional<double> top_p;               ///< (0, 1]
  std::optional<int64_t> top_k;              ///< ≥ -1 (-1 and 0: off)
  std::optional<double> min_p;               ///< 0 … 1
  std::optional<double> presence_penalty;    ///< -2 … 2
  std::optional<double> frequency_penalty;   ///< -2 … 2
  std::optional<double> repetition_penalty;  ///< (0, 2]
  std::optional<int64_t> seed;               ///< any 64-bit integer
  /// logit_bias: (token id ≥ 0, bias in -100 … 100), at most 300, ascending ids. The ids are
  /// checked against the vocabulary by the server (param "logit_bias").
  std::vector<std::pair<int64_t, double>> logit_bias;
};

/// A validated chat-completions request.
struct ChatRequest {
  std::string model;                        ///< must equal the served name (checked by the caller: 404)
  std::vector<ChatMessage> messages;        ///< non-empty, last one from the user
  std::optional<int64_t> max_tokens;        ///< ≥ 1 when set (max_tokens or max_completion_tokens)
  bool stream = false;
  bool include_usage = false;               ///< stream_options.include_usage
  std::vector<std::string> stop;            ///< 0…4 non-empty stop strings
  std::optional<std::string> prompt_cache_key;
  RequestSampling sampling;
  int n = 1;                                ///< choices, 1 … kMaxChoices
  bool logprobs = false;                    ///< report each token's log-probability
  int top_logprobs = 0;                     ///< 0 … kMaxTopLogprobs alternatives (needs logprobs)
};

/// Most choices per request (`n`).
inline constexpr int kMaxChoices = 8;
/// Most alternatives per token (`top_logprobs`, OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;
/// Most logit_bias entries (OpenAI's limit).
inline constexpr size_t kMaxLogitBias = 300;

/// Most stop strings accepted (OpenAI's limit).
inline constexpr size_t kMaxStopStrings = 4;

/// Parses and validates a request body. Accepted: model, messages (roles system/user/assistant;
/// content a string or an array of {"type":"text","text":…} parts, joined with "\n"),
/// max_tokens / max_completion_tokens (integers ≥ 1; equal when both), stream,
/// stream_options.include_usage (only with stream), stop (string or ≤ 4 strings), prompt_cache_key,
/// user (ignored), the sampling fields of RequestSampling, n (1 … 8), logprobs (boolean) and
/// top_logprobs (0 … 20, only with logprobs true). `null` counts as absent for optional fields. Throws ApiError (400 invalid_request_error) naming the
/// parameter, e.g. param "messages[1].content[0].type".
ChatRequest parse_chat_request(std::string_view body);

}  // namespace lily::server
