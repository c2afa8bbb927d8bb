// Input checks shared by the subcommands (declared in cli/commands.h): CLI11 validators and the
// chat-message lists of `generate --messages` and `tokenize`.
#include <exception>
#include <string>

#include "cli/commands.h"
#include "base/error.h"

namespace lily::cli {

CLI::Validator integer_in_range(long long min, long long max) {
  const std::string expected = "an integer from " + std::to_string(min) + " to " + std::to_string(max);
  return CLI::Validator(
      [min, max, expected](std::string& text) -> std::string {
        size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || value < min || value > max)
          return "must be " + expected + ", got '" + text + "'";
        return {};
      },
      "INT in [" + std::to_string(min) + " - " + std::to_string(max) + "]");
}

CLI::Validator integer_at_least(long long min) {
  const std::string expected = "an integer >= " + std::to_string(min);
  return CLI::Validator(
      [min, expected](std::string& text) -> std::string {
        size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || value < min) return "must be " + expected + ", got '" + text + "'";
        return {};
      },
      "INT>=" + std::to_string(min));
}

std::vector<ChatMessage> parse_message_list(const nlohmann::json& list, const std::string& what) {
  if (!list.is_array()) throw Error(what + ": messages must be a JSON array of {role, content} objects");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& m = list[i];
    const std::string at = what + ": message " + std::to_string(i);
    if (!m.is_object() || !m.contains("role")) throw Error(at + ": needs a role");
    const auto role = m["role"].is_string() ? chat_role_from_name(m["role"].get<std::string>()) : std::nullopt;
    if (!role) throw Error(at + ": role must be system, user or assistant, got " + m["role"].dump());
    if (!m.contains("content") || !m["content"].is_string())
      throw Error(at + ": content must be a string (only text content is supported)");
    messages.push_back({*role, m["content"].get<std::string>()});
  }
  return messages;
}

}  // namespace lily::cli
