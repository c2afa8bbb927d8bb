// Lexer of the chat-template engine: splits a template into text and tag tokens with jinja2's
// whitespace handling as transformers configures it (trim_blocks and lstrip_blocks on,
// keep_trailing_newline off, `-` and `+` modifiers), and tokenizes the inside of tags.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lily::jinja {

/// One token. `line` is the 1-based line it starts on.
struct Token {
  enum class Kind { kText, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Kind kind;
  std::string text;  ///< text, name, decoded string literal or operator
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
};

/// Tokenizes a whole template (newlines normalised to \n, one trailing newline dropped, comments
/// removed). Throws TemplateSyntaxError ("line N: ...") on an unterminated tag, comment or
/// string, or a character that starts no token.
std::vector<Token> tokenize(std::string_view source);

}  // namespace lily::jinja
