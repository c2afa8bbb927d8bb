// Minimal stderr logging with a level set once at startup from the environment (LILY_LOG).
#pragma once
#include <optional>
#include <string_view>

namespace lily {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kQuiet = 4 };

/// Sets the minimum level printed (default kInfo).
void set_log_level(LogLevel level);
LogLevel log_level();
/// The level named `name`: debug, info, warning (or warn), error, quiet; nullopt for anything else.
std::optional<LogLevel> parse_log_level(std::string_view name);
/// Writes one line "lily: <level>: <message>" to stderr if level >= the set level. Thread-safe.
void log_line(LogLevel level, std::string_view message);

inline void log_debug(std::string_view m) { log_line(LogLevel::kDebug, m); }
inline void log_info(std::string_view m) { log_line(LogLevel::kInfo, m); }
inline void log_warn(std::string_view m) { log_line(LogLevel::kWarn, m); }
inline void log_error(std::string_view m) { log_line(LogLevel::kError, m); }

}  // namespace lily
