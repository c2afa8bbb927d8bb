#include "base/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace lily {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kInfo};
std::mutex g_mutex;
const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warning";
    case LogLevel::kError: return "error";
    default: return "";
  }
}
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }
LogLevel log_level() { return g_level; }

std::optional<LogLevel> parse_log_level(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning" || name == "warn") return LogLevel::kWarn;
  if (name == "error") return LogLevel::kError;
  if (name == "quiet") return LogLevel::kQuiet;
  return std::nullopt;
}

void log_line(LogLevel level, std::string_view message) {
  if (level < g_level.load()) return;
  std::string line = std::string("lily: ") + level_name(level) + ": " + std::string(message) + "\n";
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace lily
