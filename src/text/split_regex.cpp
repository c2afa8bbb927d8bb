#include "text/split_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include "base/error.h"

namespace lily {
namespace {

// Unicode White_Space (PropList.txt), as a PCRE2 class body.
constexpr std::string_view kWhiteSpaceBody =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}"
    "\\x{202f}\\x{205f}\\x{3000}";

struct TranslateState {
  std::string out;
  bool in_class = false;
  // For each open group: whether it is a case-insensitive (?i: group.
  std::vector<bool> groups;
  int caseless_depth = 0;
};

void append_letter(TranslateState& st, char c) {
  bool letter = std::isalpha(static_cast<unsigned char>(c)) != 0;
  if (st.caseless_depth == 0 || !letter) {
    st.out.push_back(c);
    return;
  }
  char lo = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  char up = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (st.in_class) {
    st.out.push_back(lo);
    st.out.push_back(up);
  } else {
    st.out += std::string("[") + lo + up + "]";
  }
}

// Handles the escape at p[i] == '\\'; returns the number of pattern bytes consumed.
size_t translate_escape(TranslateState& st, std::string_view p, size_t i) {
  if (i + 1 >= p.size()) throw Error("split regex ends with a lone backslash");
  char e = p[i + 1];
  if (e == 's') {
    st.out += st.in_class ? std::string(kWhiteSpaceBody) : "[" + std::string(kWhiteSpaceBody) + "]";
    return 2;
  }
  if (e == 'S') {
    if (st.in_class) throw Error("split regex: \\S inside a character class is not supported");
    st.out += "[^" + std::string(kWhiteSpaceBody) + "]";
    return 2;
  }
  size_t n = 2;
  if ((e == 'p' || e == 'P' || e == 'x') && i + 2 < p.size() && p[i + 2] == '{') {
    size_t close = p.find('}', i + 2);
    if (close == std::string_view::npos) throw Error("split regex: unterminated \\" + std::string(1, e) + "{");
    n = close - i + 1;
  }
  st.out.append(p.substr(i, n));
  return n;
}

// Handles '(' at p[i]; returns the number of pattern bytes consumed.
size_t translate_group_open(TranslateState& st, std::string_view p, size_t i) {
  std::string_view rest = p.substr(i);
  if (rest.starts_with("(?i:")) {
    st.groups.push_back(true);
    ++st.caseless_depth;
    st.out += "(?:";
    return 4;
  }
  if (rest.starts_with("(?") && !rest.starts_with("(?:") && !rest.starts_with("(?=") &&
      !rest.starts_with("(?!") && !rest.starts_with("(?<=") && !rest.starts_with("(?<!")) {
    throw Error("split regex: unsupported group syntax at '" + std::string(rest.substr(0, 6)) + "'");
  }
  st.groups.push_back(false);
  st.out.push_back('(');
  return 1;
}

}  // namespace

std::string translate_pattern(std::string_view p) {
  TranslateState st;
  size_t i = 0;
  while (i < p.size()) {
    char c = p[i];
    if (c == '\\') {
      i += translate_escape(st, p, i);
    } else if (st.in_class) {
      if (c == ']') st.in_class = false;
      append_letter(st, c);
      ++i;
    } else if (c == '[') {
      st.in_class = true;
      st.out.push_back(c);
      ++i;
      if (i < p.size() && p[i] == '^') st.out.push_back(p[i++]);
      if (i < p.size() && p[i] == ']') st.out.push_back(p[i++]);  // literal ']' first in class
    } else if (c == '(') {
      i += translate_group_open(st, p, i);
    } else if (c == ')') {
      if (st.groups.empty()) throw Error("split regex: unbalanced ')'");
      if (st.groups.back()) --st.caseless_depth;
      st.groups.pop_back();
      st.out.push_back(c);
      ++i;
    } else {
      append_letter(st, c);
      ++i;
    }
  }
  if (st.in_class || !st.groups.empty()) throw Error("split regex: unterminated class or group");
  return st.out;
}

struct SplitRegex::Compiled {
  pcre2_code* code = nullptr;
  ~Compiled() { pcre2_code_free(code); }
};

SplitRegex::SplitRegex(std::string_view onig_pattern) : compiled_(std::make_unique<Compiled>()) {
  std::string pattern = translate_pattern(onig_pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (compiled_->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw Error("split regex does not compile (PCRE2, offset " + std::to_string(offset) +
                "): " + reinterpret_cast<const char*>(msg));
  }
  // JIT is an optimisation: if it is unavailable, pcre2_match interprets the pattern.
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);
}

SplitRegex::~SplitRegex() = default;

void SplitRegex::split(std::string_view text, std::vector<std::pair<size_t, size_t>>& pieces) const {
  pieces.clear();
  struct MatchData {
    pcre2_match_data* md;
    ~MatchData() { pcre2_match_data_free(md); }
  } data{pcre2_match_data_create_from_pattern(compiled_->code, nullptr)};
  if (data.md == nullptr) throw std::bad_alloc();
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  size_t gap_start = 0;
  while (pos < text.size()) {
    int rc = pcre2_match(compiled_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, data.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw Error("split regex failed to run (PCRE2 error " + std::to_string(rc) + ")");
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
    size_t begin = ov[0], end = ov[1];
    if (end == begin) {
      // An empty match yields no piece: step over one code point and search again.
      pos = begin + 1;
      while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (begin > gap_start) pieces.emplace_back(gap_start, begin);
    pieces.emplace_back(begin, end);
    pos = gap_start = end;
  }
  if (gap_start < text.size()) pieces.emplace_back(gap_start, text.size());
}

}  // namespace lily
