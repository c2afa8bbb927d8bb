#include "text/utf8.h"

#include <cstdlib>
#include <unordered_map>

#include <utf8proc.h>

#include "base/error.h"

namespace lily::utf8 {
namespace {

// Expected total length of a sequence with this lead byte (0: never a lead byte).
size_t sequence_length_for_lead(uint8_t b) {
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

// Allowed range of the second byte after lead byte b (Unicode Table 3-7).
bool second_byte_ok(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
  }
}

bool is_continuation(uint8_t b) { return b >= 0x80 && b <= 0xBF; }

// Number of leading bytes of s that are a (possibly complete) well-formed prefix of one
// sequence; the maximal subpart when the sequence is incomplete.
size_t well_formed_prefix(std::string_view s, size_t& needed) {
  auto lead = static_cast<uint8_t>(s[0]);
  needed = sequence_length_for_lead(lead);
  if (needed <= 1) return needed;
  size_t n = 1;
  while (n < needed && n < s.size()) {
    auto b = static_cast<uint8_t>(s[n]);
    if (n == 1 ? !second_byte_ok(lead, b) : !is_continuation(b)) break;
    ++n;
  }
  return n;
}

}  // namespace

size_t valid_sequence_length(std::string_view s) {
  if (s.empty()) return 0;
  size_t needed = 0;
  size_t n = well_formed_prefix(s, needed);
  return (needed != 0 && n == needed) ? n : 0;
}

bool is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t n = valid_sequence_length(s.substr(i));
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string to_valid_lossy(std::string_view s) {
  if (is_valid(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 16);
  size_t i = 0;
  while (i < s.size()) {
    size_t needed = 0;
    size_t n = well_formed_prefix(s.substr(i), needed);
    if (needed != 0 && n == needed) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += (n == 0 ? 1 : n);
    }
  }
  return out;
}

size_t incomplete_tail_length(std::string_view s) {
  // A proper prefix is at most 3 bytes long: look for its lead byte among the last 3 bytes.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    std::string_view tail = s.substr(s.size() - back);
    auto b = static_cast<uint8_t>(tail[0]);
    if (is_continuation(b)) continue;
    size_t needed = 0;
    size_t n = well_formed_prefix(tail, needed);
    return (needed > back && n == back) ? back : 0;
  }
  return 0;
}

void append_code_point(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string nfc(std::string_view s) {
  // Code points below U+0300 have no decomposition, combining class 0 and never compose with
  // a following code point below U+0300; their UTF-8 lead bytes are < 0xCC.
  bool trivial = true;
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0xCC) {
      trivial = false;
      break;
    }
  }
  if (trivial) return std::string(s);
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw Error(std::string("NFC normalisation failed: ") + utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

const std::array<uint32_t, 256>& byte_to_code_point() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 0x100;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  const auto& table = byte_to_code_point();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_code_point(out, table[static_cast<uint8_t>(c)]);
  return out;
}

std::string byte_level_to_bytes(std::string_view token) {
  static const std::unordered_map<uint32_t, uint8_t> inverse = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    const auto& table = byte_to_code_point();
    for (int b = 0; b < 256; ++b) m[table[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    size_t n = valid_sequence_length(token.substr(i));
    if (n == 0) return std::string(token);
    int32_t cp = 0;
    utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(token.data() + i),
                     static_cast<utf8proc_ssize_t>(n), &cp);
    auto it = inverse.find(static_cast<uint32_t>(cp));
    if (it == inverse.end()) return std::string(token);
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return out;
}

}  // namespace lily::utf8
