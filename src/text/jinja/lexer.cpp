// Template lexer (see lexer.h). Whitespace rules follow jinja2's lexer: `{%-`/`{{-`/`{#-` strip
// all whitespace before the tag, `-%}`/`-}}`/`-#}` all after; with lstrip_blocks, spaces and
// tabs between the start of a line and a block or comment tag are removed (not before `{{`, not
// with `{%+`); with trim_blocks, one newline right after a block or comment tag is removed.
#include "text/jinja/lexer.h"

#include <charconv>
#include <cstring>

#include "text/jinja/pystr.h"
#include "text/jinja/value.h"
#include "text/utf8.h"

namespace lily::jinja {
namespace {

[[noreturn]] void fail(int line, const std::string& message) {
  throw TemplateSyntaxError("line " + std::to_string(line) + ": " + message);
}

std::string normalize_newlines(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t open = find_tag_open(pos_);
      std::string text = src_.substr(pos_, open - pos_);
      const int text_line = line_;
      advance_to(open);
      if (open == src_.size()) {
        push_text(std::move(text), text_line);
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char modifier = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (modifier == '-') {
        text = pystr::strip(text, std::nullopt, false, true);
      } else if (kind != '{' && modifier != '+') {  // lstrip_blocks
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
            text.find_first_not_of(" \t\f\v", l_pos) == std::string::npos)
          text.erase(l_pos);
      }
      push_text(std::move(text), text_line);
      const size_t tag_start = open;
      const int tag_line = line_;
      advance_to(open + 2 + ((modifier == '-' || (modifier == '+' && kind != '{')) ? 1 : 0));
      bool strip_after = false, keep_newline = false;
      if (kind == '#') {
        size_t close = src_.find("#}", pos_);
        if (close == std::string::npos) fail(tag_line, "unterminated comment (no '#}')");
        strip_after = close > pos_ && src_[close - 1] == '-';
        keep_newline = close > pos_ && src_[close - 1] == '+';
        advance_to(close + 2);
      } else {
        lex_tag(kind == '%', tag_line, strip_after, keep_newline);
      }
      if (strip_after) {
        while (pos_ < src_.size() && is_blank(src_[pos_])) advance_to(pos_ + 1);
      } else if (kind != '{' && !keep_newline && pos_ < src_.size() && src_[pos_] == '\n') {
        advance_to(pos_ + 1);  // trim_blocks
      }
      line_starting = pos_ > tag_start && src_[pos_ - 1] == '\n';
    }
    tokens_.push_back({Token::Kind::kEof, "", 0, 0, line_});
    return std::move(tokens_);
  }

 private:
  size_t find_tag_open(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return src_.size();
  }

  void advance_to(size_t p) {
    for (; pos_ < p; ++pos_)
      if (src_[pos_] == '\n') ++line_;
  }

  void push_text(std::string text, int line) {
    if (!text.empty()) tokens_.push_back({Token::Kind::kText, std::move(text), 0, 0, line});
  }

  void push(Token::Kind kind, std::string text, int line) { tokens_.push_back({kind, std::move(text), 0, 0, line}); }

  bool at(std::string_view s) const { return src_.compare(pos_, s.size(), s) == 0; }

  // Tokens of one `{% %}` (block) or `{{ }}` tag, through its closing delimiter.
  void lex_tag(bool block, int tag_line, bool& strip_after, bool& keep_newline) {
    push(block ? Token::Kind::kBlockBegin : Token::Kind::kVarBegin, "", tag_line);
    int brace_depth = 0;
    const char* what = block ? "'{%' tag" : "'{{' expression";
    for (;;) {
      while (pos_ < src_.size() && is_blank(src_[pos_])) advance_to(pos_ + 1);
      if (pos_ >= src_.size()) fail(tag_line, std::string("unterminated ") + what + " (no '" + (block ? "%}" : "}}") + "')");
      const std::string_view close = block ? "%}" : "}}";
      if (!block && brace_depth > 0 && at("}")) {
        // inside a dict literal '}}' closes braces, not the tag
      } else if (at(close) || ((src_[pos_] == '-' || (block && src_[pos_] == '+')) &&
                               src_.compare(pos_ + 1, close.size(), close) == 0)) {
        strip_after = src_[pos_] == '-';
        keep_newline = src_[pos_] == '+';
        push(block ? Token::Kind::kBlockEnd : Token::Kind::kVarEnd, "", line_);
        advance_to(pos_ + close.size() + ((strip_after || keep_newline) ? 1 : 0));
        return;
      }
      const char c = src_[pos_];
      const int line = line_;
      if (is_name_start(c)) {
        size_t e = pos_;
        while (e < src_.size() && is_name_char(src_[e])) ++e;
        push(Token::Kind::kName, src_.substr(pos_, e - pos_), line);
        advance_to(e);
      } else if (is_digit(c)) {
        lex_number(line);
      } else if (c == '\'' || c == '"') {
        lex_string(line);
      } else {
        static constexpr const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                               ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        const char* found = nullptr;
        for (const char* op : kOps)
          if (at(op)) {
            found = op;
            break;
          }
        if (!found) fail(line, std::string("unexpected character '") + c + "' in " + what);
        if (std::strcmp(found, "{") == 0) ++brace_depth;
        if (std::strcmp(found, "}") == 0 && brace_depth > 0) --brace_depth;
        push(Token::Kind::kOp, found, line);
        advance_to(pos_ + std::strlen(found));
      }
    }
  }

  void lex_number(int line) {
    size_t e = pos_;
    std::string digits;
    auto take_digits = [&] {
      while (e < src_.size() && (is_digit(src_[e]) || (src_[e] == '_' && e + 1 < src_.size() && is_digit(src_[e + 1])))) {
        if (src_[e] != '_') digits += src_[e];
        ++e;
      }
    };
    take_digits();
    bool is_float = false;
    const bool after_dot = !tokens_.empty() && tokens_.back().kind == Token::Kind::kOp && tokens_.back().text == ".";
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      is_float = true;
      digits += '.';
      ++e;
      take_digits();
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t k = e + 1;
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < src_.size() && is_digit(src_[k])) {
        is_float = true;
        digits += 'e';
        digits.append(src_, e + 1, k - e - 1);
        e = k;
        take_digits();
      }
    }
    Token t{is_float ? Token::Kind::kFloat : Token::Kind::kInt, digits, 0, 0, line};
    if (is_float) {
      t.float_value = std::strtod(digits.c_str(), nullptr);
    } else {
      auto r = std::from_chars(digits.data(), digits.data() + digits.size(), t.int_value);
      if (r.ec != std::errc()) fail(line, "integer literal " + digits + " is too large");
    }
    tokens_.push_back(std::move(t));
    advance_to(e);
  }

  // A quoted string with Python escapes (unknown escapes keep their backslash, as Python).
  void lex_string(int line) {
    const char quote = src_[pos_];
    size_t i = pos_ + 1;
    std::string out;
    for (;;) {
      if (i >= src_.size()) fail(line, "unterminated string literal");
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= src_.size()) fail(line, "unterminated string literal");
      char e = src_[i + 1];
      i += 2;
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': case 'u': case 'U': {
          const int n = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          uint32_t cp = 0;
          for (int k = 0; k < n; ++k) {
            int h = i < src_.size() ? hex_value(src_[i]) : -1;
            if (h < 0) fail(line, std::string("truncated \\") + e + " escape in a string literal");
            cp = cp * 16 + static_cast<uint32_t>(h);
            ++i;
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            fail(line, "escape of an invalid code point in a string literal");
          utf8::append_code_point(out, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k, ++i)
              cp = cp * 8 + static_cast<uint32_t>(src_[i] - '0');
            utf8::append_code_point(out, cp);
          } else if (e == 'N') {
            fail(line, "\\N{...} escapes are not supported");
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    push(Token::Kind::kString, std::move(out), line);
    advance_to(i + 1);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) { return Lexer(source).run(); }

}  // namespace lily::jinja
