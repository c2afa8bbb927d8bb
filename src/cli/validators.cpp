// Input checks shared by the subcommands (declared in cli/commands.h): CLI11 validators and the
// chat-message lists of `generate --messages` and `tokenize`.
#include <charconv>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>

#include "cli/commands.h"
#include "base/byte_size.h"
#include "base/error.h"
#include "engine/backend.h"
#include "server/api_error.h"
#include "server/chat_agent.h"
#include "server/chat_request.h"
#include "server/json_depth.h"

namespace lily::cli {

namespace {

/// True for text CLI11 2.1 would read as another number than the decimal one: it converts with
/// base 0 ("010" is 8, "0x10" 16) and without a range check, so a leading zero is refused.
bool has_leading_zero(const std::string& text) {
  const size_t digits = !text.empty() && text[0] == '-' ? 1 : 0;
  return text.size() > digits + 1 && text[digits] == '0';
}

/// A CLI11 validator that accepts a whole decimal integer (nothing before or after it, no
/// leading zero) in [min, max]; otherwise the message says "must be <expected>, got '<text>'".
CLI::Validator integer_validator(long long min, long long max, const std::string& expected,
                                 const std::string& description) {
  return CLI::Validator(
      [min, max, expected](const std::string& text) -> std::string {
        long long value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ec != std::errc() || ptr != end || has_leading_zero(text) || value < min || value > max)
          return "must be " + expected + ", got '" + text + "'";
        return {};
      },
      description);
}

}  // namespace

void add_cuda_settings(CLI::App* cmd, std::vector<std::string>& settings) {
  cmd->add_option("--cuda", settings,
                  "CUDA backend option NAME=VALUE, repeatable, over its LILY_CUDA_* variable: " + CudaOptions::names() +
                      " (docs/cuda.md)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            try {
              CudaOptions().set(text);
            } catch (const Error& e) {
              return e.what();  // the setting's words; CLI11 puts "--cuda: " before them
            }
            return {};
          },
          "NAME=VALUE"));
}

CLI::Validator integer_in_range(long long min, long long max) {
  return integer_validator(min, max, "an integer from " + std::to_string(min) + " to " + std::to_string(max),
                           "INT in [" + std::to_string(min) + " - " + std::to_string(max) + "]");
}

CLI::Validator any_integer() {
  return integer_validator(std::numeric_limits<long long>::min(), std::numeric_limits<long long>::max(),
                           "an integer from " + std::to_string(std::numeric_limits<long long>::min()) + " to " +
                               std::to_string(std::numeric_limits<long long>::max()),
                           "INT");
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ec != std::errc() || ptr != end || has_leading_zero(text))
          return "must be an integer from 0 to " + std::to_string(std::numeric_limits<uint64_t>::max()) + ", got '" +
                 text + "'";
        return {};
      },
      "UINT64");
}

CLI::Validator integer_at_least(long long min) {
  return integer_validator(min, std::numeric_limits<long long>::max(), "an integer >= " + std::to_string(min),
                           "INT>=" + std::to_string(min));
}

CLI::Validator byte_size() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (!parse_byte_size(text))
          return "must be a byte count such as 1073741824, 512MiB or 4GiB, got '" + text + "'";
        return {};
      },
      "BYTES");
}

std::vector<ChatMessage> parse_message_list(const nlohmann::json& list, const std::string& what) {
  if (!list.is_array()) throw Error(what + ": messages must be a JSON array of {role, content} objects");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list.size(); ++i) {
    try {
      messages.push_back(server::parse_chat_message(list[i], "messages[" + std::to_string(i) + "]"));
    } catch (const server::ApiError& e) {  // "--messages: messages[1].content: must be …"
      throw Error(what + ": " + (e.param() ? *e.param() + ": " : std::string()) + e.message());
    }
  }
  return messages;
}

nlohmann::json parse_json_flag(const std::string& text, const std::string& what) {
  try {
    return server::parse_json_bounded<nlohmann::json>(text);
  } catch (const server::JsonTooDeep& e) {
    throw Error(what + ": " + e.what());
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

ChatTemplateOptions parse_chat_options(const std::string& text, const std::string& what, bool add_generation_prompt) {
  if (text.empty()) {
    ChatTemplateOptions options;
    options.add_generation_prompt = add_generation_prompt;
    return options;
  }
  const nlohmann::json doc = parse_json_flag(text, what);
  if (doc.is_discarded() || !doc.is_object()) throw Error(what + ": expected a JSON object");
  for (const auto& [key, value] : doc.items())
    if (!server::is_agent_field(key))
      throw Error(what + ": unknown field '" + key +
                  "' (expected tools, tool_choice, parallel_tool_calls, reasoning_effort, chat_template_kwargs)");
  try {
    return server::template_options(server::parse_agent_fields(doc, text), /*server_default=*/false,
                                    add_generation_prompt);
  } catch (const server::ApiError& e) {
    throw Error(what + ": " + e.message());
  }
}

}  // namespace lily::cli
