// JSON documents of the OpenAI API as this server writes them: the
// chat completion object and its streaming chunks, the legacy text_completion object and its
// chunks, and the model list. Keys keep OpenAI's order.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily::server {

/// Fields shared by a completion and all its chunks.
struct CompletionMeta {
  std::string id;                  ///< "chatcmpl-…"
  int64_t created = 0;             ///< Unix seconds
  std::string model;               ///< served model name
  std::string system_fingerprint;  ///< build id
};

/// Token counts of one request.
struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};

/// {"prompt_tokens","completion_tokens","total_tokens","prompt_tokens_details":{"cached_tokens"}}.
nlohmann::ordered_json usage_json(const Usage& usage);

/// A whole non-streaming chat.completion object with one choice.
nlohmann::ordered_json completion_json(const CompletionMeta& meta, const std::string& content,
                                       const std::string& finish_reason, const Usage& usage);

/// One chat.completion.chunk with one choice whose delta is `delta`; finish_reason null unless
/// given; "usage": null is added when `with_usage_field` (include_usage streams).
nlohmann::ordered_json chunk_json(const CompletionMeta& meta, const nlohmann::ordered_json& delta,
                                  const std::optional<std::string>& finish_reason, bool with_usage_field);

/// The final usage chunk of an include_usage stream: empty choices and the usage. `object` is
/// "chat.completion.chunk" or, for a legacy completions stream, "text_completion".
nlohmann::ordered_json usage_chunk_json(const CompletionMeta& meta, const Usage& usage,
                                        const char* object = "chat.completion.chunk");

/// A whole legacy completion (POST /v1/completions): object "text_completion", one choice
/// {"text","index":0,"logprobs":null,"finish_reason"} and the usage.
nlohmann::ordered_json text_completion_json(const CompletionMeta& meta, const std::string& text,
                                            const std::string& finish_reason, const Usage& usage);

/// A whole legacy completion with several choices (each text_choice_json).
nlohmann::ordered_json text_completion_json(const CompletionMeta& meta, const nlohmann::ordered_json& choices,
                                            const Usage& usage);

/// One choice of a legacy completion: {"text","index","logprobs","finish_reason"}; `logprobs`
/// null or legacy_logprobs_json.
nlohmann::ordered_json text_choice_json(int index, const std::string& text, const std::string& finish_reason,
                                        const nlohmann::ordered_json& logprobs);

/// One chunk of a legacy completions stream: the same object with `text` as choice `index`'s
/// text and `logprobs` (null or legacy_logprobs_json) those of its tokens; finish_reason null
/// unless given; "usage": null is added when `with_usage_field`.
nlohmann::ordered_json text_chunk_json(const CompletionMeta& meta, const std::string& text,
                                       const std::optional<std::string>& finish_reason, bool with_usage_field,
                                       int index = 0, const nlohmann::ordered_json& logprobs = nullptr);

/// One choice of a whole completion: {"index","message":{"role","content"},"logprobs",
/// "finish_reason"} plus "seed" (the seed the choice ran with, lily's own field) when given.
/// `logprobs` is null or {"content":[…],"refusal":null} (logprobs_json).
nlohmann::ordered_json choice_json(int index, const std::string& content, const std::string& finish_reason,
                                   const nlohmann::ordered_json& logprobs, std::optional<int64_t> seed);

/// A whole chat.completion object with the given choices (choice_json).
nlohmann::ordered_json completion_json(const CompletionMeta& meta, const nlohmann::ordered_json& choices,
                                       const Usage& usage);

/// A chat.completion.chunk for choice `index`: delta, logprobs (null or logprobs_json),
/// finish_reason (null unless given), "seed" in the choice when given, "usage": null when
/// `with_usage_field`.
nlohmann::ordered_json chunk_json(const CompletionMeta& meta, int index, const nlohmann::ordered_json& delta,
                                  const nlohmann::ordered_json& logprobs,
                                  const std::optional<std::string>& finish_reason, bool with_usage_field,
                                  std::optional<int64_t> seed = std::nullopt);

/// One logprobs.content entry (and the same shape, without top_logprobs, for its alternatives).
struct LogprobEntry {
  std::string token;           ///< the token's bytes (invalid UTF-8 becomes U+FFFD when serialized)
  double logprob = 0;          ///< natural log, ≤ 0
  std::vector<LogprobEntry> top;  ///< most likely first
};

/// {"content":[{"token","logprob","bytes":[…],"top_logprobs":[{"token","logprob","bytes"}…]}…],
/// "refusal":null}: OpenAI's choice.logprobs.
nlohmann::ordered_json logprobs_json(const std::vector<LogprobEntry>& entries);

/// The legacy completions' logprobs: {"tokens":[…],"token_logprobs":[…],"top_logprobs":[{token:
/// logprob,…}…],"text_offset":[…]}. `offset` is where the first token's text begins in the
/// choice's text, in characters (code points); it is advanced past every token.
nlohmann::ordered_json legacy_logprobs_json(const std::vector<LogprobEntry>& entries, int64_t& offset);

/// {"object":"list","data":[{"id","object":"model","created","owned_by":"lily"}]}.
nlohmann::ordered_json models_json(const std::string& model, int64_t created);

/// One model object {"id","object":"model","created","owned_by":"lily"} (GET /v1/models/{id}).
nlohmann::ordered_json model_json(const std::string& model, int64_t created);

/// Serializes compactly; invalid UTF-8 is replaced by U+FFFD instead of throwing.
std::string dump(const nlohmann::ordered_json& doc);
/// The same for the unordered json type.
std::string dump(const nlohmann::json& doc);

/// One server-sent event: "data: <json>\n\n".
std::string sse_event(const std::string& data);

}  // namespace lily::server
