// CLI11 validators shared by the subcommands (declared in cli/commands.h).
#include <exception>
#include <string>

#include "cli/commands.h"

namespace lily::cli {

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

}  // namespace lily::cli
