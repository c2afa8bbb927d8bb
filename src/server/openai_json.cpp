#include "server/openai_json.h"

namespace lily::server {

using nlohmann::ordered_json;

namespace {

ordered_json header(const CompletionMeta& meta, const char* object) {
  return ordered_json{{"id", meta.id},
                      {"object", object},
                      {"created", meta.created},
                      {"model", meta.model},
                      {"system_fingerprint", meta.system_fingerprint}};
}

}  // namespace

ordered_json usage_json(const Usage& u) {
  return ordered_json{{"prompt_tokens", u.prompt_tokens},
                      {"completion_tokens", u.completion_tokens},
                      {"total_tokens", u.prompt_tokens + u.completion_tokens},
                      {"prompt_tokens_details", ordered_json{{"cached_tokens", u.cached_tokens}}}};
}

ordered_json completion_json(const CompletionMeta& meta, const std::string& content,
                             const std::string& finish_reason, const Usage& usage) {
  ordered_json doc = header(meta, "chat.completion");
  ordered_json choice{{"index", 0},
                      {"message", ordered_json{{"role", "assistant"}, {"content", content}}},
                      {"logprobs", nullptr},
                      {"finish_reason", finish_reason}};
  doc["choices"] = ordered_json::array({choice});
  doc["usage"] = usage_json(usage);
  return doc;
}

ordered_json chunk_json(const CompletionMeta& meta, const ordered_json& delta,
                        const std::optional<std::string>& finish_reason, bool with_usage_field) {
  ordered_json doc = header(meta, "chat.completion.chunk");
  ordered_json choice{{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (finish_reason) choice["finish_reason"] = *finish_reason;
  doc["choices"] = ordered_json::array({choice});
  if (with_usage_field) doc["usage"] = nullptr;
  return doc;
}

ordered_json choice_json(int index, const std::string& content, const std::string& finish_reason,
                         const ordered_json& logprobs, std::optional<int64_t> seed) {
  ordered_json choice{{"index", index},
                      {"message", ordered_json{{"role", "assistant"}, {"content", content}}},
                      {"logprobs", logprobs},
                      {"finish_reason", finish_reason}};
  if (seed) choice["seed"] = *seed;
  return choice;
}

ordered_json completion_json(const CompletionMeta& meta, const ordered_json& choices, const Usage& usage) {
  ordered_json doc = header(meta, "chat.completion");
  doc["choices"] = choices;
  doc["usage"] = usage_json(usage);
  return doc;
}

ordered_json chunk_json(const CompletionMeta& meta, int index, const ordered_json& delta, const ordered_json& logprobs,
                        const std::optional<std::string>& finish_reason, bool with_usage_field,
                        std::optional<int64_t> seed) {
  ordered_json doc = header(meta, "chat.completion.chunk");
  ordered_json choice{{"index", index}, {"delta", delta}, {"logprobs", logprobs}, {"finish_reason", nullptr}};
  if (finish_reason) choice["finish_reason"] = *finish_reason;
  if (seed) choice["seed"] = *seed;
  doc["choices"] = ordered_json::array({choice});
  if (with_usage_field) doc["usage"] = nullptr;
  return doc;
}

namespace {

ordered_json bytes_of(const std::string& token) {
  ordered_json bytes = ordered_json::array();
  for (unsigned char c : token) bytes.push_back(static_cast<int>(c));
  return bytes;
}

}  // namespace

ordered_json logprobs_json(const std::vector<LogprobEntry>& entries) {
  ordered_json content = ordered_json::array();
  for (const auto& e : entries) {
    ordered_json top = ordered_json::array();
    for (const auto& t : e.top)
      top.push_back(ordered_json{{"token", t.token}, {"logprob", t.logprob}, {"bytes", bytes_of(t.token)}});
    content.push_back(
        ordered_json{{"token", e.token}, {"logprob", e.logprob}, {"bytes", bytes_of(e.token)}, {"top_logprobs", top}});
  }
  return ordered_json{{"content", content}, {"refusal", nullptr}};
}

ordered_json usage_chunk_json(const CompletionMeta& meta, const Usage& usage, const char* object) {
  ordered_json doc = header(meta, object);
  doc["choices"] = ordered_json::array();
  doc["usage"] = usage_json(usage);
  return doc;
}

ordered_json text_completion_json(const CompletionMeta& meta, const std::string& text,
                                  const std::string& finish_reason, const Usage& usage) {
  ordered_json doc = header(meta, "text_completion");
  ordered_json choice{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  doc["choices"] = ordered_json::array({choice});
  doc["usage"] = usage_json(usage);
  return doc;
}

ordered_json text_completion_json(const CompletionMeta& meta, const ordered_json& choices, const Usage& usage) {
  ordered_json doc = header(meta, "text_completion");
  doc["choices"] = choices;
  doc["usage"] = usage_json(usage);
  return doc;
}

ordered_json text_choice_json(int index, const std::string& text, const std::string& finish_reason,
                              const ordered_json& logprobs) {
  return ordered_json{{"text", text}, {"index", index}, {"logprobs", logprobs}, {"finish_reason", finish_reason}};
}

ordered_json legacy_logprobs_json(const std::vector<LogprobEntry>& entries, int64_t& offset) {
  ordered_json tokens = ordered_json::array(), logprobs = ordered_json::array(), top = ordered_json::array(),
               offsets = ordered_json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(e.token);
    logprobs.push_back(e.logprob);
    ordered_json alternatives = ordered_json::object();
    for (const LogprobEntry& t : e.top) alternatives[t.token] = t.logprob;
    top.push_back(std::move(alternatives));
    offsets.push_back(offset);
    // Characters: every byte that is not a UTF-8 continuation byte starts one.
    for (char c : e.token) offset += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }
  return ordered_json{{"tokens", tokens}, {"token_logprobs", logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

ordered_json text_chunk_json(const CompletionMeta& meta, const std::string& text,
                             const std::optional<std::string>& finish_reason, bool with_usage_field, int index,
                             const ordered_json& logprobs) {
  ordered_json doc = header(meta, "text_completion");
  ordered_json choice{{"text", text}, {"index", index}, {"logprobs", logprobs}, {"finish_reason", nullptr}};
  if (finish_reason) choice["finish_reason"] = *finish_reason;
  doc["choices"] = ordered_json::array({choice});
  if (with_usage_field) doc["usage"] = nullptr;
  return doc;
}

ordered_json model_json(const std::string& model, int64_t created) {
  return ordered_json{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "lily"}};
}

ordered_json models_json(const std::string& model, int64_t created) {
  return ordered_json{{"object", "list"}, {"data", ordered_json::array({model_json(model, created)})}};
}

std::string dump(const ordered_json& doc) {
  return doc.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

std::string dump(const nlohmann::json& doc) {
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string sse_event(const std::string& data) { return "data: " + data + "\n\n"; }

}  // namespace lily::server
