// The request surfaces of the generating and tokenizing endpoints:
// strict parsing of the OpenAI JSON bodies of POST /v1/chat/completions and POST
// /v1/completions, and of vLLM's POST /tokenize and POST /detokenize, into native types.
// Everything not listed here is rejected with a 400 that names the parameter and says why.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/json_constraint.h"
#include "server/chat_agent.h"
#include "text/chat_template.h"

namespace lily::server {

/// The sampling fields of a request, each unset when the request does not give it (the
/// server's defaults fill those in). Ranges are checked by the parsers.
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

/// The generation settings the chat and the legacy completions endpoints share.
struct GenerationFields {
  std::optional<int64_t> max_tokens;        ///< ≥ 1 when set (max_tokens or max_completion_tokens)
  bool stream = false;
  bool include_usage = false;               ///< stream_options.include_usage
  /// stream_options.continuous_usage_stats (vLLM's): with include_usage, every chunk carries the
  /// usage so far instead of null.
  bool continuous_usage = false;
  /// min_tokens (vLLM's): the stop tokens (EOS) cannot be chosen before this many tokens were
  /// generated; stop strings still end the answer. ≥ 0, at most max_tokens when that is given.
  int64_t min_tokens = 0;
  bool ignore_eos = false;                  ///< ignore_eos (vLLM's): the stop tokens do not end the answer
  /// stop_token_ids (vLLM's): more tokens that end the answer (ids ≥ 0, checked against the
  /// vocabulary by the server; at most kMaxStopTokenIds), beside the checkpoint's own.
  std::vector<int64_t> stop_token_ids;
  /// response_format json_object / json_schema: the answer is a JSON object of this schema
  /// (null: free text).
  std::shared_ptr<const JsonSchema> json_schema;
  std::vector<std::string> stop;            ///< 0…4 non-empty stop strings
  std::optional<std::string> prompt_cache_key;
  RequestSampling sampling;
  int n = 1;                                ///< choices, 1 … kMaxChoices (chat; 1 for completions)
  bool logprobs = false;                    ///< report each token's log-probability (chat)
  int top_logprobs = 0;                     ///< 0 … kMaxTopLogprobs alternatives (needs logprobs)
};

/// max_tokens of a legacy completion that gives none (OpenAI's and vLLM's default); the chat
/// endpoint's default is the rest of the context window.
inline constexpr int64_t kCompletionDefaultMaxTokens = 16;

/// Most choices per request (`n`).
inline constexpr int kMaxChoices = 8;
/// Most alternatives per token (`top_logprobs`, OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;
/// Most stop_token_ids of one request.
inline constexpr size_t kMaxStopTokenIds = 64;
/// Most logit_bias entries (OpenAI's limit).
inline constexpr size_t kMaxLogitBias = 300;

/// A validated chat-completions request.
struct ChatRequest : GenerationFields {
  std::string model;                        ///< must equal the served name (checked by the caller: 404)
  std::vector<ChatMessage> messages;        ///< non-empty, last one from the user (or a tool result;
                                            ///< the assistant with continue_final_message)
  ChatAgentFields agent;                    ///< tools, tool_choice, thinking (server/chat_agent.h)
  /// continue_final_message (vLLM's): the last message is the assistant's, and the answer goes on
  /// from its content (ChatTemplateOptions::continue_final_message); its text is content.
  bool continue_final_message = false;
};

/// A validated legacy completions request (POST /v1/completions): one prompt, given as text or
/// as token ids.
struct CompletionRequest : GenerationFields {
  std::string model;                        ///< must equal the served name (checked by the caller: 404)
  std::optional<std::string> prompt_text;   ///< the prompt as text (set, or prompt_ids is)
  std::vector<int64_t> prompt_ids;          ///< the prompt as token ids (≥ 0; the vocabulary is
                                            ///< checked by the caller, param "prompt[i]")
  std::string prompt_param = "prompt";      ///< where the ids were: "prompt" or "prompt[0]"
  bool echo = false;                        ///< echo: each choice's text begins with the prompt's
};

/// A validated POST /tokenize request: a text prompt, or chat messages rendered with the chat
/// template.
struct TokenizeRequest {
  std::optional<std::string> model;         ///< when given, must equal the served name
  std::optional<std::string> prompt;        ///< set, or messages is non-empty
  std::vector<ChatMessage> messages;
  bool add_special_tokens = true;           ///< prompt form only (this tokenizer adds none)
  bool add_generation_prompt = true;        ///< messages form only (false with continue_final_message)
  bool continue_final_message = false;      ///< messages form only: as in chat (the last assistant turn continued)
  ChatAgentFields agent;                    ///< messages form only: tools and thinking, as in chat
};

/// A validated POST /detokenize request.
struct DetokenizeRequest {
  std::optional<std::string> model;         ///< when given, must equal the served name
  std::vector<int64_t> tokens;              ///< ≥ 0; the vocabulary is checked by the caller
};

/// Most stop strings accepted (OpenAI's limit).
inline constexpr size_t kMaxStopStrings = 4;

/// Parses and validates a request body. Accepted: model, messages (roles system, developer (as
/// system), user, assistant, tool; content a string or an array of {"type":"text","text":…}
/// parts, joined with "\n"; `name`; assistant `tool_calls` and `reasoning_content` (or vLLM's `reasoning`), content then
/// optional; tool `tool_call_id`, required), the agent fields of server/chat_agent.h,
/// max_tokens / max_completion_tokens (integers ≥ 1; equal when both), stream,
/// stream_options.include_usage, .continuous_usage_stats and .include_obfuscation (only with
/// stream; the last changes nothing), min_tokens (≥ 0, ≤ max_tokens), ignore_eos (boolean), stop (string or ≤ 4 strings), prompt_cache_key, user, safety_identifier,
/// service_tier, prompt_cache_retention, store, metadata (checked, ignored), response_format
/// {"type":"text"}, modalities ["text"] and verbosity "medium" (the defaults; other values are
/// refused as unsupported), the sampling fields of RequestSampling, n (1 … 8), logprobs (boolean) and
/// top_logprobs (0 … 20, only with logprobs true), continue_final_message (vLLM's; a
/// boolean: the last message is then the assistant's, continued; not with a forced tool call) and
/// add_generation_prompt (false only with continue_final_message, true not with it). `null` counts as absent for optional fields. Throws ApiError (400 invalid_request_error) naming the
/// parameter, e.g. param "messages[1].content[0].type".
ChatRequest parse_chat_request(std::string_view body);

/// One chat message as parse_chat_request accepts it (role, content as a string or text parts,
/// and the fields its role may carry); `param` names it in errors, e.g. "messages[2]". Does
/// not check where in the conversation it stands. The command line's message lists use it, so a
/// message means the same to `lily generate --messages` and `lily tokenize` as to the server.
/// Throws ApiError 400 naming the parameter, e.g. "messages[2].content".
ChatMessage parse_chat_message(const nlohmann::json& m, const std::string& param);

/// Parses a legacy completions body. `prompt` is required: a string, an array of token ids, or
/// an array holding exactly one of these (a batch of several prompts is a 400 naming "prompt").
/// The generation fields are those of parse_chat_request (no max_completion_tokens, no
/// top_logprobs), with the legacy `logprobs` (an integer 0 … 20: each token's log-probability and
/// that many alternatives; sets logprobs and top_logprobs), `echo` (a boolean; not with logprobs),
/// best_of = 1 and suffix = null; other values and unknown fields are a 400 naming the parameter.
CompletionRequest parse_completion_request(std::string_view body);

/// Parses a /tokenize body: {"prompt": string, "add_special_tokens": bool} or {"messages": […],
/// "add_generation_prompt": bool} (messages and agent fields as in chat, but the last message
/// may be from the assistant when add_generation_prompt is false), each with an optional "model". Exactly one of
/// prompt and messages. Throws ApiError 400 naming the parameter.
TokenizeRequest parse_tokenize_request(std::string_view body);

/// Parses a /detokenize body: {"tokens": [ids ≥ 0], "model"?: string}. Throws ApiError 400
/// naming the parameter ("tokens[2]").
DetokenizeRequest parse_detokenize_request(std::string_view body);

}  // namespace lily::server
