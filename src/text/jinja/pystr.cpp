// Python str semantics on UTF-8 (see pystr.h).
#include "text/jinja/pystr.h"

#include <utf8proc.h>

#include "base/error.h"
#include "text/utf8.h"

namespace lily::jinja::pystr {
namespace {

// Decodes the code point at s[i]; an invalid byte decodes as itself (0xDC80 + byte would be
// Python's surrogateescape; here it only needs to be distinct from every space character).
uint32_t decode_at(std::string_view s, size_t i, size_t& len) {
  len = utf8::valid_sequence_length(s.substr(i));
  if (len == 0) {
    len = 1;
    return 0xDC00u + static_cast<uint8_t>(s[i]);
  }
  auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
  switch (len) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0, len = 0; i < s.size(); i += len) out.push_back(decode_at(s, i, len));
  return out;
}

template <typename Map>
std::string map_code_points(std::string_view s, Map map) {
  std::string out;
  out.reserve(s.size());
  size_t index = 0;
  for (size_t i = 0, len = 0; i < s.size(); i += len, ++index) {
    uint32_t cp = decode_at(s, i, len);
    if (cp >= 0xDC00 && cp <= 0xDCFF && len == 1) {
      out += s[i];  // an invalid byte stays as it was
      continue;
    }
    utf8::append_code_point(out, map(cp, index));
  }
  return out;
}

bool is_cased_letter(uint32_t cp) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

}  // namespace

std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> out;
  size_t i = 0, len = 0;
  for (; i < s.size(); i += len) {
    out.push_back(i);
    decode_at(s, i, len);
  }
  out.push_back(s.size());
  return out;
}

size_t length(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0, len = 0; i < s.size(); i += len, ++n) decode_at(s, i, len);
  return n;
}

bool is_space(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::pair<size_t, size_t> strip_range(std::string_view s, const std::optional<std::string>& chars, bool left,
                                      bool right) {
  std::vector<uint32_t> set;
  if (chars) set = code_points(*chars);
  auto strippable = [&](uint32_t cp) {
    if (!chars) return is_space(cp);
    for (uint32_t c : set)
      if (c == cp) return true;
    return false;
  };
  std::vector<size_t> offs = code_point_offsets(s);
  size_t b = 0, e = offs.size() - 1;  // code point indices [b, e)
  size_t len = 0;
  while (left && b < e && strippable(decode_at(s, offs[b], len))) ++b;
  while (right && e > b && strippable(decode_at(s, offs[e - 1], len))) --e;
  return {offs[b], offs[e]};
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  auto [b, e] = strip_range(s, chars, left, right);
  return std::string(s.substr(b, e - b));
}

std::vector<std::pair<size_t, size_t>> split_ranges(std::string_view s, const std::optional<std::string>& sep,
                                                    int64_t maxsplit) {
  std::vector<std::pair<size_t, size_t>> out;
  if (sep) {
    if (sep->empty()) throw Error("empty separator");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t hit = s.find(*sep, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(pos, hit);
      pos = hit + sep->size();
    }
    out.emplace_back(pos, s.size());
    return out;
  }
  size_t i = 0, len = 0;
  auto skip_space = [&] {
    while (i < s.size() && is_space(decode_at(s, i, len))) i += len;
  };
  skip_space();
  while (i < s.size()) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.emplace_back(i, s.size());  // the rest, unsplit (as Python)
      return out;
    }
    size_t start = i;
    while (i < s.size() && !is_space(decode_at(s, i, len))) i += len;
    out.emplace_back(start, i);
    skip_space();
  }
  return out;
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  for (auto [b, e] : split_ranges(s, sep, maxsplit)) out.emplace_back(s.substr(b, e - b));
  return out;
}

std::string replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` before every code point and at the end.
    std::vector<size_t> offs = code_point_offsets(s);
    int64_t done = 0;
    for (size_t k = 0; k + 1 <= offs.size(); ++k) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (k + 1 < offs.size()) out += s.substr(offs[k], offs[k + 1] - offs[k]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out += s.substr(pos, hit - pos);
    out += repl;
    pos = hit + old.size();
    ++done;
  }
  out += s.substr(pos);
  return out;
}

std::string upper(std::string_view s) {
  return map_code_points(s, [](uint32_t cp, size_t) {
    return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp)));
  });
}

std::string lower(std::string_view s) {
  return map_code_points(s, [](uint32_t cp, size_t) {
    return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp)));
  });
}

std::string capitalize(std::string_view s) {
  return map_code_points(s, [](uint32_t cp, size_t index) {
    auto c = static_cast<utf8proc_int32_t>(cp);
    return static_cast<uint32_t>(index == 0 ? utf8proc_totitle(c) : utf8proc_tolower(c));
  });
}

std::string title(std::string_view s) {
  bool previous_cased = false;
  return map_code_points(s, [&](uint32_t cp, size_t) {
    auto c = static_cast<utf8proc_int32_t>(cp);
    uint32_t out = static_cast<uint32_t>(previous_cased ? utf8proc_tolower(c) : utf8proc_totitle(c));
    previous_cased = is_cased_letter(cp);
    return out;
  });
}

}  // namespace lily::jinja::pystr
