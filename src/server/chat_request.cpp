#include "server/chat_request.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <initializer_list>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "server/api_error.h"
#include "server/json_depth.h"

namespace lily::server {

namespace {

using nlohmann::json;

/// Fields that OpenAI defines but lily cannot honour, with the reason given to the client.
const std::map<std::string, std::string, std::less<>>& unsupported_fields() {
  static const std::map<std::string, std::string, std::less<>> fields = {
      {"functions", "the legacy function-calling API is not supported: use tools"},
      {"function_call", "the legacy function-calling API is not supported: use tool_choice"},
      {"modalities", "only text output is supported"},
      {"audio", "audio output is not supported"},
      {"prediction", "predicted outputs are not supported"},
      {"web_search_options", "web search is not supported"},
      {"best_of", "best_of is not supported: use n"},
  };
  return fields;
}

std::string require_string(const json& v, const std::string& param) {
  if (!v.is_string()) throw wrong_type(param, "a string", v);
  return v.get<std::string>();
}

/// An integer field. A number written with a fraction part of zero (`5.0`, `1e3`) counts as
/// that integer, as Python clients produce and vLLM accepts; one past int64's range (also when
/// JSON gave it as a float, as for 2^64) is refused as too large rather than as a wrong type.
int64_t require_integer(const json& v, const std::string& param) {
  auto too_large = [&] {
    return invalid_request("'" + param + "' is too large: at most " + std::to_string(INT64_MAX) +
                               " (a signed 64-bit integer), got " + v.dump(),
                           param, "invalid_value");
  };
  if (v.is_number_float()) {
    const double x = v.get<double>();
    if (!std::isfinite(x) || x != std::trunc(x)) throw wrong_type(param, "an integer", v);
    // ±2^63 are exact doubles; everything strictly inside converts exactly.
    if (x >= 9223372036854775808.0) throw too_large();
    if (x < -9223372036854775808.0)
      throw invalid_request("'" + param + "' is too small: at least " + std::to_string(INT64_MIN) +
                                " (a signed 64-bit integer), got " + v.dump(),
                            param, "invalid_value");
    return static_cast<int64_t>(x);
  }
  if (!v.is_number_integer()) throw wrong_type(param, "an integer", v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) throw too_large();
  return v.get<int64_t>();
}

double require_number(const json& v, const std::string& param) {
  if (!v.is_number()) throw wrong_type(param, "a number", v);
  return v.get<double>();
}

/// A number in [lo, hi] (`open_lo`: lo itself excluded); a 400 naming `param` otherwise.
double require_range(const json& v, const std::string& param, double lo, double hi, bool open_lo = false) {
  const double x = require_number(v, param);
  if (x < lo || x > hi || (open_lo && x == lo)) {
    std::string range = (open_lo ? "(" : "[") + json(lo).dump() + ", " + json(hi).dump() + "]";
    throw invalid_request("'" + param + "' must be in " + range + ", got " + v.dump(), param, "invalid_value");
  }
  return x;
}

/// logit_bias: {"<token id>": bias, …}, at most 300 entries, biases in [-100, 100].
void parse_logit_bias(const json& v, GenerationFields& req) {
  const std::string param = "logit_bias";
  if (!v.is_object()) throw wrong_type(param, "an object mapping token ids to biases", v);
  if (v.size() > kMaxLogitBias)
    throw invalid_request("'logit_bias' takes at most " + std::to_string(kMaxLogitBias) + " entries, got " +
                              std::to_string(v.size()),
                          param, "invalid_value");
  for (const auto& [key, value] : v.items()) {
    const bool digits = !key.empty() && key.size() <= 10 &&
                        key.find_first_not_of("0123456789") == std::string::npos;
    if (!digits)
      throw invalid_request("'logit_bias' keys must be token ids (decimal integers below 2^31), got '" + key + "'", param,
                            "invalid_value");
    if (!value.is_number())
      throw invalid_request("'logit_bias' values must be numbers, got " + json_type_name(value) + " for '" + key + "'",
                            param, "invalid_type");
    const double bias = value.get<double>();
    if (bias < -100 || bias > 100)
      throw invalid_request("'logit_bias' values must be in [-100, 100], got " + value.dump() + " for '" + key + "'",
                            param, "invalid_value");
    req.sampling.logit_bias.emplace_back(std::stoll(key), bias);
  }
  std::sort(req.sampling.logit_bias.begin(), req.sampling.logit_bias.end());
  const auto& bias = req.sampling.logit_bias;
  for (size_t i = 1; i < bias.size(); ++i)
    if (bias[i].first == bias[i - 1].first)
      throw invalid_request("'logit_bias' names token id " + std::to_string(bias[i].first) + " twice", param,
                            "invalid_value");
}

ChatRole parse_role(const json& v, const std::string& param) {
  const std::string role = require_string(v, param);
  if (const auto r = chat_role_from_name(role)) return *r;
  if (role == "function")
    throw invalid_request("role 'function' is not supported: use tool", param, "unsupported_value");
  throw invalid_request("invalid role '" + role + "': expected system, developer, user, assistant or tool", param);
}

std::string parse_content_part(const json& part, const std::string& param) {
  if (!part.is_object()) throw wrong_type(param, "an object", part);
  if (!part.contains("type")) throw missing_parameter(param + ".type");
  const std::string type = require_string(part["type"], param + ".type");
  if (type != "text")
    throw invalid_request("content part type '" + type + "' is not supported: the model reads text only",
                          param + ".type", "unsupported_value");
  for (const auto& [key, value] : part.items())
    if (key != "type" && key != "text" && key != "cache_control")  // cache_control: a proxy's caching hint, ignored
      throw invalid_request("unrecognized field '" + key + "' in a text content part", param + "." + key,
                            "unknown_parameter");
  if (!part.contains("text")) throw missing_parameter(param + ".text");
  return require_string(part["text"], param + ".text");
}

std::string parse_content(const json& v, const std::string& param) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) throw wrong_type(param, "a string or an array of text parts", v);
  if (v.empty()) throw invalid_request("'" + param + "' must not be an empty array", param);
  std::string text;
  for (size_t j = 0; j < v.size(); ++j) {
    if (j > 0) text += "\n";
    text += parse_content_part(v[j], param + "[" + std::to_string(j) + "]");
  }
  return text;
}

/// "user" → "a 'user'", "assistant" → "an 'assistant'" (for errors naming a message's role).
std::string with_article(const std::string& role) {
  const bool vowel = !role.empty() && std::string_view("aeiou").find(role[0]) != std::string_view::npos;
  return std::string(vowel ? "an '" : "a '") + role + "'";
}

/// The fields a message of `role` may carry besides role and content. An assistant message may
/// also carry the fields of OpenAI's own answers that clients send back in the history
/// (refusal, annotations, and function_call / audio when null; see parse_chat_message), and
/// `reasoning`, the name newer vLLM servers give the thinking text (= reasoning_content).
bool message_field_allowed(ChatRole role, const std::string& key) {
  if (key == "name") return true;
  if (role == ChatRole::kAssistant)
    return key == "tool_calls" || key == "reasoning_content" || key == "reasoning" || key == "refusal" || key == "annotations" ||
           key == "function_call" || key == "audio" || key == "parsed";
  if (role == ChatRole::kTool) return key == "tool_call_id";
  return false;
}

}  // namespace

ChatMessage parse_chat_message(const json& m, const std::string& param) {
  if (!m.is_object()) throw wrong_type(param, "an object", m);
  if (!m.contains("role"))
    throw missing_parameter(param + ".role");
  ChatMessage msg;
  msg.role = parse_role(m["role"], param + ".role");
  for (const auto& [key, value] : m.items())
    if (key != "role" && key != "content" && !message_field_allowed(msg.role, key))
      throw invalid_request("unrecognized field '" + key + "' in " + param + " (" +
                                with_article(m["role"].get<std::string>()) + " message)",
                            param + "." + key, "unknown_parameter");
  auto given = [&](const char* key) { return m.contains(key) && !m[key].is_null(); };
  // An assistant turn may have no content (one that only calls tools).
  if (!given("content") && msg.role != ChatRole::kAssistant)
    throw missing_parameter(param + ".content");
  if (given("content")) msg.content = parse_content(m["content"], param + ".content");
  if (given("refusal")) {  // a refused turn: its text is what the assistant said
    const std::string refusal = require_string(m["refusal"], param + ".refusal");
    if (!given("content")) msg.content = refusal;
  }
  if (given("annotations") && !m["annotations"].is_array())
    throw wrong_type(param + ".annotations", "an array", m["annotations"]);  // ignored (citations)
  // "parsed": what the openai client's parse helpers put beside the content of an answer they
  // return (the structured output, or null); the content holds the same text, so it is ignored.
  for (const char* key : {"function_call", "audio"})
    if (given(key))
      throw invalid_request("'" + param + "." + key + "' is not supported (only null): use tool_calls" +
                                (std::string(key) == "audio" ? " and text content" : ""),
                            param + "." + key, "unsupported_parameter");
  if (given("name")) msg.name = require_string(m["name"], param + ".name");
  if (given("reasoning_content")) msg.reasoning_content = require_string(m["reasoning_content"], param + ".reasoning_content");
  if (given("reasoning")) {
    const std::string reasoning = require_string(m["reasoning"], param + ".reasoning");
    if (msg.reasoning_content && *msg.reasoning_content != reasoning)
      throw invalid_request("'" + param + ".reasoning' and '" + param +
                                ".reasoning_content' differ; they name the same text, send one of them",
                            param + ".reasoning");
    msg.reasoning_content = reasoning;
  }
  if (given("tool_calls")) msg.tool_calls = parse_message_tool_calls(m["tool_calls"], param + ".tool_calls");
  if (msg.role == ChatRole::kTool) {
    if (!given("tool_call_id"))
      throw missing_parameter(param + ".tool_call_id");
    msg.tool_call_id = require_string(m["tool_call_id"], param + ".tool_call_id");
  }
  return msg;
}

namespace {

/// A message list; the last message must be from the user (or a tool result) unless
/// `last_may_be_assistant`.
std::vector<ChatMessage> parse_messages(const json& v, bool last_may_be_assistant = false) {
  if (!v.is_array()) throw wrong_type("messages", "an array", v);
  if (v.empty()) throw invalid_request("'messages' must contain at least one message", "messages");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < v.size(); ++i)
    messages.push_back(parse_chat_message(v[i], "messages[" + std::to_string(i) + "]"));
  const ChatRole last = messages.back().role;
  if (last != ChatRole::kUser && last != ChatRole::kTool && !(last_may_be_assistant && last == ChatRole::kAssistant))
    throw invalid_request(last_may_be_assistant ? "the last message must have role 'user', 'tool' or 'assistant'"
                                                : "the last message must have role 'user' or 'tool'",
                          "messages[" + std::to_string(v.size() - 1) + "].role");
  return messages;
}

void parse_stop(const json& v, GenerationFields& req) {
  if (v.is_string()) {
    req.stop.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    if (v.size() > kMaxStopStrings)
      throw invalid_request("'stop' takes at most 4 strings, got " + std::to_string(v.size()), "stop");
    for (size_t i = 0; i < v.size(); ++i) req.stop.push_back(require_string(v[i], "stop[" + std::to_string(i) + "]"));
  } else {
    throw wrong_type("stop", "a string or an array of strings", v);
  }
  for (const auto& s : req.stop)
    if (s.empty()) throw invalid_request("stop strings must not be empty", "stop");
}

void parse_stream_options(const json& v, GenerationFields& req) {
  if (!v.is_object()) throw wrong_type("stream_options", "an object", v);
  for (const auto& [key, value] : v.items()) {
    if (key != "include_usage" && key != "include_obfuscation" && key != "continuous_usage_stats")
      throw invalid_request("unrecognized field '" + key + "' in stream_options", "stream_options." + key,
                            "unknown_parameter");
    if (value.is_null()) continue;
    if (!value.is_boolean()) throw wrong_type("stream_options." + key, "a boolean", value);
    // include_obfuscation: OpenAI pads stream events against side channels; lily adds no padding
    // either way, so the setting is checked and changes nothing.
    if (key == "include_usage") req.include_usage = value.get<bool>();
    if (key == "continuous_usage_stats") req.continuous_usage = value.get<bool>();
  }
}

/// Whether a modalities value asks for what every answer is anyway: plain text (["text"]).
/// Such a request is served; any other value is refused.
bool asks_for_plain_text(const std::string& key, const json& v) {
  if (key == "modalities") return v.is_array() && v.size() == 1 && v[0] == "text";
  return false;
}

/// Refuses any key of object `v` (named `param`) not in `allowed`.
void only_keys(const json& v, const std::string& param, std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : v.items())
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      throw invalid_request("unrecognized field '" + key + "' in " + param, param + "." + key, "unknown_parameter");
}

/// response_format: {"type": "text"} (the default), {"type": "json_object"} (any JSON object),
/// or {"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}
/// (an object of that schema; without one, any object). The schema is compiled here, so one the
/// constraint cannot follow is a 400 naming response_format.json_schema.schema.
void parse_response_format(const json& v, GenerationFields& req) {
  if (!v.is_object()) throw wrong_type("response_format", "an object", v);
  if (!v.contains("type")) throw missing_parameter("response_format.type");
  const std::string type = require_string(v["type"], "response_format.type");
  if (type == "text" || type == "json_object") {
    only_keys(v, "response_format", {"type"});
    if (type == "json_object") req.json_schema = JsonSchema::any_object();
    return;
  }
  if (type != "json_schema")
    throw invalid_request("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got " +
                              v["type"].dump(),
                          "response_format.type", "invalid_value");
  only_keys(v, "response_format", {"type", "json_schema"});
  if (!v.contains("json_schema")) throw missing_parameter("response_format.json_schema");
  const json& js = v["json_schema"];
  const std::string at = "response_format.json_schema";
  if (!js.is_object()) throw wrong_type(at, "an object", js);
  only_keys(js, at, {"name", "description", "schema", "strict"});
  if (!js.contains("name")) throw missing_parameter(at + ".name");
  const std::string name = require_string(js["name"], at + ".name");
  // OpenAI's rule for the name: 1 to 64 letters, digits, '_' and '-'.
  if (name.empty() || name.size() > 64 || !std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
      }))
    throw invalid_request("'" + at + ".name' must be 1 to 64 letters, digits, '_' or '-', got " + js["name"].dump(),
                          at + ".name", "invalid_value");
  if (js.contains("description") && !js["description"].is_null()) require_string(js["description"], at + ".description");
  if (js.contains("strict") && !js["strict"].is_null() && !js["strict"].is_boolean())
    throw wrong_type(at + ".strict", "a boolean", js["strict"]);
  if (!js.contains("schema") || js["schema"].is_null()) {
    req.json_schema = JsonSchema::any_object();
    return;
  }
  try {
    req.json_schema = JsonSchema::compile(js["schema"]);
  } catch (const Error& e) {
    throw invalid_request("'" + at + ".schema': " + e.what(), at + ".schema", "invalid_value");
  }
}

/// A token id list: integers in [0, 2^31). `param` names the list ("prompt", "tokens").
std::vector<int64_t> parse_token_ids(const json& v, const std::string& param) {
  if (!v.is_array()) throw wrong_type(param, "an array of token ids", v);
  std::vector<int64_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = param + "[" + std::to_string(i) + "]";
    const int64_t id = require_integer(v[i], at);
    if (id < 0 || id > INT32_MAX)
      throw invalid_request("'" + at + "' is not a token id: " + std::to_string(id), at);
    ids.push_back(id);
  }
  return ids;
}

std::optional<int64_t> parse_max_tokens(const json& v, const std::string& param) {
  const int64_t n = require_integer(v, param);
  if (n < 1) throw invalid_request("'" + param + "' must be at least 1, got " + std::to_string(n), param);
  return n;
}

/// Optional top-level fields of the chat endpoint; `null` stands for absent for each of them.
bool is_known_chat_field(const std::string& key) {
  static const std::set<std::string, std::less<>> known = {
      "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "prompt_cache_key",
      "prompt_cache_retention", "user", "safety_identifier", "verbosity", "store", "metadata", "service_tier", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
      "repetition_penalty", "logit_bias", "seed", "logprobs", "top_logprobs", "min_tokens", "ignore_eos",
      "stop_token_ids", "response_format"};
  return known.count(key) > 0 || unsupported_fields().count(key) > 0;
}

/// Handles one optional top-level field (value not null).
void parse_optional_field(const std::string& key, const json& value, GenerationFields& req,
                          std::optional<int64_t>& max_completion_tokens, bool& stream_options_set,
                          bool& top_logprobs_set) {
  if (key == "max_tokens") {
    req.max_tokens = parse_max_tokens(value, key);
  } else if (key == "max_completion_tokens") {
    max_completion_tokens = parse_max_tokens(value, key);
  } else if (key == "stream") {
    if (!value.is_boolean()) throw wrong_type(key, "a boolean", value);
    req.stream = value.get<bool>();
  } else if (key == "stream_options") {
    parse_stream_options(value, req);
    stream_options_set = true;
  } else if (key == "stop") {
    parse_stop(value, req);
  } else if (key == "prompt_cache_key") {
    req.prompt_cache_key = require_string(value, key);
  } else if (key == "user" || key == "safety_identifier" || key == "service_tier" || key == "prompt_cache_retention") {
    // Ignored: one tier, no per-user policy, and the prefix cache keeps what memory allows.
    require_string(value, key);
  } else if (key == "verbosity") {
    // The answer's length is the model's own; only the default ("medium") can be honoured.
    if (require_string(value, key) != "medium")
      throw invalid_request("'verbosity' must be 'medium' (the model's own length), got " + value.dump(), key,
                            "unsupported_value");
  } else if (key == "response_format") {
    parse_response_format(value, req);
  } else if (asks_for_plain_text(key, value)) {
    // modalities ["text"]: the default, what lily answers.
  } else if (key == "store") {
    if (!value.is_boolean()) throw wrong_type(key, "a boolean", value);  // ignored: nothing is stored
  } else if (key == "metadata") {
    // OpenAI's tags for stored completions (at most 16 string values); checked, then ignored.
    if (!value.is_object()) throw wrong_type(key, "an object of strings", value);
    if (value.size() > 16) throw invalid_request("'metadata' takes at most 16 entries, got " + std::to_string(value.size()), key);
    for (const auto& [k, v] : value.items())
      if (!v.is_string()) throw wrong_type(key + "." + k, "a string", v);
  } else if (key == "n") {
    const int64_t n = require_integer(value, key);
    if (n < 1 || n > kMaxChoices)
      throw invalid_request("'n' must be in [1, " + std::to_string(kMaxChoices) + "], got " + std::to_string(n), key,
                            "invalid_value");
    req.n = static_cast<int>(n);
  } else if (key == "temperature") {
    req.sampling.temperature = require_range(value, key, 0, 2);
  } else if (key == "top_p") {
    req.sampling.top_p = require_range(value, key, 0, 1, /*open_lo=*/true);
  } else if (key == "top_k") {
    const int64_t k = require_integer(value, key);
    if (k < -1) throw invalid_request("'top_k' must be -1, 0 (off) or a positive integer, got " + std::to_string(k),
                                      key, "invalid_value");
    req.sampling.top_k = k;
  } else if (key == "min_p") {
    req.sampling.min_p = require_range(value, key, 0, 1);
  } else if (key == "presence_penalty") {
    req.sampling.presence_penalty = require_range(value, key, -2, 2);
  } else if (key == "frequency_penalty") {
    req.sampling.frequency_penalty = require_range(value, key, -2, 2);
  } else if (key == "repetition_penalty") {
    // From 1e-6 (as generation_config.json's bound): a smaller penalty divides a logit past fp32's range.
    req.sampling.repetition_penalty = require_range(value, key, 1e-6, 2);
  } else if (key == "logit_bias") {
    parse_logit_bias(value, req);
  } else if (key == "seed") {
    req.sampling.seed = require_integer(value, key);
  } else if (key == "min_tokens") {
    const int64_t n = require_integer(value, key);
    if (n < 0) throw invalid_request("'min_tokens' must be at least 0, got " + std::to_string(n), key, "invalid_value");
    req.min_tokens = n;
  } else if (key == "ignore_eos") {
    if (!value.is_boolean()) throw wrong_type(key, "a boolean", value);
    req.ignore_eos = value.get<bool>();
  } else if (key == "stop_token_ids") {
    req.stop_token_ids = parse_token_ids(value, key);
    if (req.stop_token_ids.size() > kMaxStopTokenIds)
      throw invalid_request("'stop_token_ids' takes at most " + std::to_string(kMaxStopTokenIds) + " ids, got " +
                                std::to_string(req.stop_token_ids.size()),
                            key, "invalid_value");
  } else if (key == "logprobs") {
    if (!value.is_boolean()) throw wrong_type(key, "a boolean", value);
    req.logprobs = value.get<bool>();
  } else if (key == "top_logprobs") {
    const int64_t n = require_integer(value, key);
    if (n < 0 || n > kMaxTopLogprobs)
      throw invalid_request("'top_logprobs' must be in [0, " + std::to_string(kMaxTopLogprobs) + "], got " +
                                std::to_string(n),
                            key, "invalid_value");
    req.top_logprobs = static_cast<int>(n);
    top_logprobs_set = true;
  } else if (auto it = unsupported_fields().find(key); it != unsupported_fields().end()) {
    throw invalid_request("unsupported parameter '" + key + "': " + it->second, key, "unsupported_parameter");
  } else {
    throw invalid_request("unrecognized request argument supplied: '" + key + "'", key, "unknown_parameter");
  }
}

/// Parses a request body that must be one JSON object.
json parse_object(std::string_view body) {
  json doc;
  try {
    doc = parse_json_bounded<json>(body);
  } catch (const JsonTooDeep& e) {
    throw invalid_request(std::string("the request body ") + e.what(), std::nullopt, "invalid_json");
  } catch (const json::exception& e) {
    // parse_error for malformed text; out_of_range.406 for a number past double's range
    // ("-1e99999"). Both are the client's mistake, so both are 400.
    std::string detail = e.what();  // "[json.exception.parse_error.101] parse error at …"
    if (const size_t cut = detail.find("] "); cut != std::string::npos) detail.erase(0, cut + 2);
    throw invalid_request("the request body is not valid JSON: " + detail, std::nullopt, "invalid_json");
  }
  if (!doc.is_object())
    throw invalid_request("the request body must be a JSON object, got " + json_type_name(doc), std::nullopt,
                          "invalid_json");
  return doc;
}


/// The `prompt` of a legacy completion: one string or one token-id list, either bare or as the
/// only element of an array.
void parse_prompt(const json& v, CompletionRequest& req) {
  const std::string expected = "a string or an array of token ids";
  if (v.is_string()) {
    req.prompt_text = v.get<std::string>();
    if (req.prompt_text->empty()) throw invalid_request("'prompt' must not be empty", "prompt");
    return;
  }
  if (!v.is_array()) throw wrong_type("prompt", expected, v);
  if (v.empty()) throw invalid_request("'prompt' must not be empty", "prompt");
  if (v[0].is_string() || v[0].is_array()) {  // a batch: an array of prompts
    if (v.size() > 1)
      throw invalid_request("'prompt' holds " + std::to_string(v.size()) +
                                " prompts; this server takes one prompt per request",
                            "prompt", "unsupported_value");
    if (v[0].is_string()) {
      req.prompt_text = v[0].get<std::string>();
      if (req.prompt_text->empty()) throw invalid_request("'prompt[0]' must not be empty", "prompt[0]");
      return;
    }
    req.prompt_param = "prompt[0]";
    req.prompt_ids = parse_token_ids(v[0], "prompt[0]");
    if (req.prompt_ids.empty()) throw invalid_request("'prompt[0]' must not be empty", "prompt[0]");
    return;
  }
  req.prompt_ids = parse_token_ids(v, "prompt");
}

/// A boolean field, `null` meaning absent (the default stays).
void optional_bool(const json& doc, const std::string& key, bool& out) {
  if (!doc.contains(key) || doc[key].is_null()) return;
  if (!doc[key].is_boolean()) throw wrong_type(key, "a boolean", doc[key]);
  out = doc[key].get<bool>();
}

/// The optional `model` of /tokenize and /detokenize.
std::optional<std::string> optional_model(const json& doc) {
  if (!doc.contains("model") || doc["model"].is_null()) return std::nullopt;
  return require_string(doc["model"], "model");
}

/// The required `model` of /v1/chat/completions and /v1/completions.
std::string required_model(const json& doc) {
  if (!doc.contains("model"))
    throw missing_parameter("model");
  return require_string(doc["model"], "model");
}

/// Refuses `stream_options` sent without `"stream": true`.
void check_stream_options(bool stream_options_set, bool stream) {
  if (stream_options_set && !stream)
    throw invalid_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
}

/// vLLM's continue_final_message (the last message, from the assistant, is continued) and
/// add_generation_prompt (false only with it: a prompt that ends after a finished turn is not
/// something to answer).
void parse_continuation(const json& doc, ChatRequest& req) {
  optional_bool(doc, "continue_final_message", req.continue_final_message);
  // Its default follows continue_final_message, so only a value sent can break the rules.
  bool add_generation_prompt = !req.continue_final_message;
  optional_bool(doc, "add_generation_prompt", add_generation_prompt);
  if (req.continue_final_message && add_generation_prompt)
    throw invalid_request("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                          "add_generation_prompt");
  if (!req.continue_final_message && !add_generation_prompt)
    throw invalid_request("'add_generation_prompt' may be false only with 'continue_final_message': true (the "
                          "assistant's last turn continued)",
                          "add_generation_prompt", "unsupported_value");
}

/// Structured output constrains the answer's content (after the think block when there is one),
/// so it cannot follow a forced tool call or a continued assistant turn.
void check_structured_output(const ChatRequest& req) {
  if (!req.json_schema) return;
  const ChatAgentFields& a = req.agent;
  if (a.tools_active() && (a.tool_choice == ToolChoice::kRequired || a.tool_choice == ToolChoice::kNamed))
    throw invalid_request("'response_format' asks for a JSON answer, which a forced tool call ('tool_choice') cannot be",
                          "response_format");
  if (req.continue_final_message)
    throw invalid_request("'response_format' cannot be combined with 'continue_final_message'", "response_format");
}

/// Refuses stop strings and stop_token_ids beside response_format: one would cut the document
/// short.
void check_stop_with_json(const GenerationFields& req) {
  if (!req.json_schema) return;
  for (const auto& [present, field] : {std::pair{!req.stop.empty(), "stop"}, std::pair{!req.stop_token_ids.empty(), "stop_token_ids"}})
    if (present)
      throw invalid_request(std::string("'") + field + "' cannot be combined with 'response_format': it would cut the "
                                "JSON document short (the answer ends when the document is complete)",
                            field, "unsupported_value");
}

/// Refuses min_tokens above an explicit max_tokens (the answer could not honour both).
void check_min_tokens(const GenerationFields& req) {
  if (req.max_tokens && req.min_tokens > *req.max_tokens)
    throw invalid_request("'min_tokens' (" + std::to_string(req.min_tokens) + ") must not exceed 'max_tokens' (" +
                              std::to_string(*req.max_tokens) + ")",
                          "min_tokens", "invalid_value");
}

/// Refuses a field sent as `null` unless it is one of the chat request's fields.
void check_null_field(const std::string& key) {
  if (!is_known_chat_field(key))
    throw invalid_request("unrecognized request argument supplied: '" + key + "'", key, "unknown_parameter");
}

/// Rejects any top-level field not in `allowed`.
void only_fields(const json& doc, std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : doc.items())
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      throw invalid_request("unrecognized request argument supplied: '" + key + "'", key, "unknown_parameter");
}

}  // namespace

ChatRequest parse_chat_request(std::string_view body) {
  const json doc = parse_object(body);
  ChatRequest req;
  std::optional<int64_t> max_completion_tokens;
  bool stream_options_set = false;
  bool top_logprobs_set = false;
  for (const auto& [key, value] : doc.items()) {
    if (key == "model" || key == "messages" || is_agent_field(key) || key == "continue_final_message" ||
        key == "add_generation_prompt")
      continue;
    if (value.is_null()) {
      check_null_field(key);
      continue;
    }
    parse_optional_field(key, value, req, max_completion_tokens, stream_options_set, top_logprobs_set);
  }
  req.model = required_model(doc);
  parse_continuation(doc, req);
  if (!doc.contains("messages"))
    throw missing_parameter("messages");
  req.messages = parse_messages(doc["messages"], req.continue_final_message);
  req.agent = parse_agent_fields(doc, body);
  if (req.continue_final_message && (req.agent.tool_choice == ToolChoice::kRequired ||
                                     req.agent.tool_choice == ToolChoice::kNamed) && req.agent.tools_active())
    throw invalid_request("'continue_final_message' continues the assistant's text, which a forced tool call "
                          "('tool_choice' \"required\" or a named function) cannot",
                          "continue_final_message");
  if (max_completion_tokens) {
    if (req.max_tokens && *req.max_tokens != *max_completion_tokens)
      throw invalid_request("'max_tokens' and 'max_completion_tokens' differ; send one of them",
                            "max_completion_tokens");
    req.max_tokens = max_completion_tokens;
  }
  check_stream_options(stream_options_set, req.stream);
  check_min_tokens(req);
  check_stop_with_json(req);
  check_structured_output(req);
  if (top_logprobs_set && !req.logprobs)
    throw invalid_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  return req;
}

CompletionRequest parse_completion_request(std::string_view body) {
  const json doc = parse_object(body);
  CompletionRequest req;
  std::optional<int64_t> unused_max_completion_tokens;
  bool stream_options_set = false;
  for (const auto& [key, value] : doc.items()) {
    if (key == "model" || key == "prompt") continue;
    // Fields of the legacy endpoint only, or with another meaning there.
    if (key == "max_completion_tokens") {
      throw invalid_request("unrecognized request argument supplied: 'max_completion_tokens' (the completions "
                            "endpoint takes max_tokens)",
                            key, "unknown_parameter");
    } else if (key == "echo") {
      if (value.is_null()) continue;
      if (!value.is_boolean()) throw wrong_type(key, "a boolean", value);
      req.echo = value.get<bool>();
    } else if (key == "best_of") {
      if (value.is_null()) continue;
      if (require_integer(value, key) != 1)
        throw invalid_request("'best_of' must be 1: one sample per completion", key, "unsupported_value");
    } else if (key == "logprobs") {
      // The legacy form: an integer, the alternatives listed beside each token (0: none).
      if (value.is_null()) continue;
      const int64_t k = require_integer(value, key);
      if (k < 0 || k > kMaxTopLogprobs)
        throw invalid_request("'logprobs' must be in [0, " + std::to_string(kMaxTopLogprobs) + "], got " + std::to_string(k),
                              key, "invalid_value");
      req.logprobs = true;
      req.top_logprobs = static_cast<int>(k);
    } else if (key == "suffix") {
      if (value.is_null()) continue;
      require_string(value, key);
      throw invalid_request("unsupported parameter 'suffix': insertion is not supported", key,
                            "unsupported_parameter");
    } else if (key == "top_logprobs") {
      throw invalid_request("unrecognized request argument supplied: 'top_logprobs' (chat only)", key,
                            "unknown_parameter");
    } else if (value.is_null()) {
      check_null_field(key);
    } else {
      bool unused_top_logprobs = false;
      parse_optional_field(key, value, req, unused_max_completion_tokens, stream_options_set, unused_top_logprobs);
    }
  }
  req.model = required_model(doc);
  if (!doc.contains("prompt") || doc["prompt"].is_null())
    throw missing_parameter("prompt");
  parse_prompt(doc["prompt"], req);
  if (req.echo && req.logprobs)
    throw invalid_request("'echo' with 'logprobs' would need the prompt tokens' log-probabilities, which are not "
                          "computed; send one of them",
                          "echo", "unsupported_value");
  check_stream_options(stream_options_set, req.stream);
  check_min_tokens(req);
  check_stop_with_json(req);
  return req;
}

TokenizeRequest parse_tokenize_request(std::string_view body) {
  const json doc = parse_object(body);
  TokenizeRequest req;
  req.model = optional_model(doc);
  const bool has_prompt = doc.contains("prompt") && !doc["prompt"].is_null();
  const bool has_messages = doc.contains("messages") && !doc["messages"].is_null();
  if (has_prompt && has_messages)
    throw invalid_request("send either 'prompt' or 'messages', not both", "messages");
  if (!has_prompt && !has_messages)
    throw invalid_request("missing required parameter 'prompt' (or 'messages')", "prompt",
                          "missing_required_parameter");
  if (has_prompt) {
    only_fields(doc, {"model", "prompt", "add_special_tokens", "messages"});
    req.prompt = require_string(doc["prompt"], "prompt");
    optional_bool(doc, "add_special_tokens", req.add_special_tokens);
    return req;
  }
  only_fields(doc, {"model", "messages", "add_generation_prompt", "prompt", "tools", "tool_choice",
                    "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs", "continue_final_message"});
  optional_bool(doc, "continue_final_message", req.continue_final_message);
  // Continuing the last turn means no generation prompt (vLLM's rule): false unless sent true.
  if (req.continue_final_message) req.add_generation_prompt = false;
  optional_bool(doc, "add_generation_prompt", req.add_generation_prompt);
  if (req.continue_final_message && req.add_generation_prompt)
    throw invalid_request("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                          "add_generation_prompt");
  req.messages = parse_messages(doc["messages"], !req.add_generation_prompt);
  req.agent = parse_agent_fields(doc, body);
  return req;
}

DetokenizeRequest parse_detokenize_request(std::string_view body) {
  const json doc = parse_object(body);
  only_fields(doc, {"model", "tokens"});
  DetokenizeRequest req;
  req.model = optional_model(doc);
  if (!doc.contains("tokens") || doc["tokens"].is_null())
    throw missing_parameter("tokens");
  req.tokens = parse_token_ids(doc["tokens"], "tokens");
  return req;
}

}  // namespace lily::server
