#include "server/http_util.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <ctime>

#include "base/error.h"
#include "engine/option_error.h"

namespace lily::server {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool is_token_char(char c) {  // RFC 9110 tchar
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

/// `scheme://host[:port]` with a letter-led scheme, a non-empty host of URL-safe characters
/// (an IPv6 literal in brackets), and digits after a ':'.
bool is_origin(std::string_view s) {
  const size_t sep = s.find("://");
  if (sep == std::string_view::npos || sep == 0) return false;
  const std::string_view scheme = s.substr(0, sep);
  if (!std::isalpha(static_cast<unsigned char>(scheme[0]))) return false;
  for (char c : scheme)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') return false;
  std::string_view rest = s.substr(sep + 3);
  std::string_view host = rest, port;
  if (!rest.empty() && rest.front() == '[') {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos) return false;
    host = rest.substr(0, close + 1);
    std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return false;
      port = after.substr(1);
      if (port.empty()) return false;
    }
  } else if (const size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
    if (port.empty()) return false;
  }
  if (host.empty()) return false;
  for (char c : host)
    if (!std::isalnum(static_cast<unsigned char>(c)) && std::string_view("-._~[]:").find(c) == std::string_view::npos)
      return false;
  return std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) && port.size() <= 5;
}

/// The origin with scheme and host in lower case (the port is digits anyway).
std::string normalize_origin(std::string_view origin) { return lower(origin); }

}  // namespace

std::vector<std::string> parse_allowed_origins(std::string_view list) {
  std::vector<std::string> out;
  while (true) {
    const size_t comma = list.find(',');
    std::string_view item = trim(list.substr(0, comma));
    if (item.size() > 1 && item.back() == '/' && !item.ends_with("://")) item.remove_suffix(1);
    if (!item.empty()) {
      if (item != "*" && !is_origin(item))
        throw OptionError("allowed_origins", "'" + std::string(item) +
                                                 "' is not an origin (expected scheme://host[:port], e.g. "
                                                 "http://localhost:3000, or *)");
      out.push_back(item == "*" ? "*" : normalize_origin(item));
    }
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return out;
}

std::optional<std::string> cors_allow_origin(const std::vector<std::string>& allowed, std::string_view origin) {
  if (allowed.empty() || origin.empty()) return std::nullopt;
  if (std::find(allowed.begin(), allowed.end(), "*") != allowed.end()) return "*";
  if (!is_origin(origin)) return std::nullopt;
  if (std::find(allowed.begin(), allowed.end(), normalize_origin(origin)) == allowed.end()) return std::nullopt;
  return std::string(origin);
}

std::string cors_allow_headers(std::string_view requested) {
  const std::string fallback = "Authorization, Content-Type";
  std::string out;
  std::string_view rest = requested;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    if (!item.empty()) {
      if (!std::all_of(item.begin(), item.end(), is_token_char)) return fallback;
      if (!out.empty()) out += ", ";
      out += item;
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out.empty() || out.size() > 1024 ? fallback : out;
}

bool is_valid_request_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxRequestIdLength) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':';
  });
}

std::string http_date(std::chrono::system_clock::time_point t) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  static const char* days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static const char* months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s, %02d %s %04d %02d:%02d:%02d GMT", days[tm.tm_wday], tm.tm_mday,
                months[tm.tm_mon], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
  return buf;
}

std::optional<std::string> percent_decode(std::string_view segment) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != '%') {
      out += segment[i];
      continue;
    }
    if (i + 2 >= segment.size()) return std::nullopt;  // a '%' needs two characters after it
    const int hi = hex(segment[i + 1]), lo = hex(segment[i + 2]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

std::string request_path(std::string_view target) {
  target = target.substr(0, target.find('?'));
  const std::string head = lower(target.substr(0, 8));
  size_t skip = 0;
  if (head.starts_with("http://")) skip = 7;
  else if (head.starts_with("https://")) skip = 8;
  if (skip == 0) return std::string(target);
  const size_t slash = target.find('/', skip);
  return slash == std::string_view::npos ? "/" : std::string(target.substr(slash));
}

bool has_unsupported_http_version(std::string_view head) {
  std::string_view line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.size() < 9) return false;
  const std::string_view v = line.substr(line.size() - 9);  // " HTTP/d.d"
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (v.substr(0, 6) != " HTTP/" || !digit(v[6]) || v[7] != '.' || !digit(v[8])) return false;
  return !(v[6] == '1' && (v[8] == '0' || v[8] == '1'));
}

std::optional<std::string> unsupported_transfer_coding(std::string_view value) {
  const auto trim = [](std::string_view t) {
    while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.remove_suffix(1);
    return t;
  };
  bool chunked = false;
  while (!value.empty()) {
    const size_t comma = value.find(',');
    std::string_view coding = value.substr(0, comma);
    coding = trim(coding.substr(0, coding.find(';')));
    if (!coding.empty()) {
      if (lower(coding) != "chunked" || chunked) return std::string(coding);  // chunked only once (RFC 9112 §7)
      chunked = true;
    }
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return std::nullopt;
}

}  // namespace lily::server
