#include "base/byte_size.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace lily {

std::optional<int64_t> parse_byte_size(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  if (number.empty() || number.front() == '.' || number.back() == '.' ||
      number.find('.') != number.rfind('.'))
    return std::nullopt;
  std::string unit;
  for (char c : text.substr(i)) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = 1;
  if (!unit.empty() && unit != "b") {
    const char prefix = unit.front();
    const std::string rest = unit.substr(1);
    if (rest != "" && rest != "b" && rest != "i" && rest != "ib") return std::nullopt;
    switch (prefix) {
      case 'k': scale = 1024.0; break;
      case 'm': scale = 1024.0 * 1024; break;
      case 'g': scale = 1024.0 * 1024 * 1024; break;
      case 't': scale = 1024.0 * 1024 * 1024 * 1024; break;
      default: return std::nullopt;
    }
  }
  const double value = std::stod(number) * scale;
  if (!(value < 9.2e18)) return std::nullopt;
  return static_cast<int64_t>(std::llround(value));
}

std::string format_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024 && bytes > -1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int unit = -1;
  while ((v >= 1024 || v <= -1024) && unit < 3) {
    v /= 1024;
    ++unit;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f %s", unit >= 2 ? 2 : 1, v, kUnits[unit]);
  return buf;
}

HostMemory read_host_memory() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name;
    int64_t kib = 0;
    if (!(fields >> name >> kib)) continue;
    if (name == "MemTotal:") m.total = kib * 1024;
    if (name == "MemAvailable:") m.available = kib * 1024;
  }
  return m;
}

}  // namespace lily
