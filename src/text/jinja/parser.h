// Parser of the chat-template engine: tokens (lexer.h) to a syntax tree (ast.h), with jinja2's
// operator precedence. Everything outside the supported subset (tags such as include, extends,
// call or raw; unknown filters, tests, methods or global functions) is refused here, with the
// construct and its line, so that a template is accepted or refused once, at load.
#pragma once
#include <string_view>

#include "text/jinja/ast.h"

namespace lily::jinja {

/// The parsed template: the top-level statements.
struct Program {
  Body body;
};

/// Parses a template. Throws TemplateSyntaxError ("line N: ...").
Program parse(std::string_view source);

/// Filters, tests, methods and global functions the engine implements (render.cpp); the parser
/// refuses any other name.
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
bool is_known_method(std::string_view name);
bool is_known_global(std::string_view name);

}  // namespace lily::jinja
