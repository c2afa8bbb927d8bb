#include "engine/stop_strings.h"

#include <algorithm>

#include "base/error.h"

namespace lily {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_)
    if (s.empty()) throw Error("stop strings must not be empty");
}

std::string StopStringMatcher::push(std::string_view piece) {
  if (stopped_) return {};
  if (stops_.empty()) return std::string(piece);
  held_.append(piece);
  // Earliest occurrence of any stop string wins (ties: the first position found).
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  size_t keep = held_prefix_length();
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::finish() {
  if (stopped_) return {};
  std::string out;
  out.swap(held_);
  return out;
}

size_t StopStringMatcher::held_prefix_length() const {
  size_t best = 0;
  for (const auto& s : stops_) {
    size_t max_len = std::min(held_.size(), s.size() - 1);
    for (size_t len = max_len; len > best; --len) {
      if (std::string_view(held_).substr(held_.size() - len) == std::string_view(s).substr(0, len)) {
        best = len;
        break;
      }
    }
  }
  return best;
}

}  // namespace lily
