// Template parser (see parser.h). Precedence, lowest first, as jinja2's parser: conditional
// expression, or, and, not, comparisons / in / not in, + -, ~, * / // %, **, unary - +, then
// postfix (. [] ()) and filters / tests (`|`, `is`) binding tighter than any binary operator.
#include "text/jinja/parser.h"

#include <set>

#include "text/jinja/lexer.h"

namespace lily::jinja {
namespace {

using K = Token::Kind;

const std::set<std::string, std::less<>> kUnsupportedTags = {
    "include", "extends", "block",   "endblock", "import", "from", "call",  "endcall", "filter", "endfilter",
    "with",    "endwith", "autoescape", "endautoescape", "raw", "endraw", "do", "trans", "endtrans", "pluralize"};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Program run() {
    Program p;
    std::string found;
    p.body = parse_body({}, found, 0, "");
    for (const auto& [name, line] : called_names_)
      if (!is_known_global(name) && !macros_.count(name))
        fail(line, "unsupported function '" + name + "' (not a macro of the template nor a supported global)");
    return p;
  }

 private:
  [[noreturn]] void fail(int line, const std::string& message) const {
    throw TemplateSyntaxError("line " + std::to_string(line) + ": " + message);
  }

  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool is_op(std::string_view op, size_t k = 0) const { return peek(k).kind == K::kOp && peek(k).text == op; }
  bool is_name(std::string_view n, size_t k = 0) const { return peek(k).kind == K::kName && peek(k).text == n; }
  std::string describe(const Token& t) const {
    switch (t.kind) {
      case K::kEof: return "end of template";
      case K::kBlockEnd: return "end of tag '%}'";
      case K::kVarEnd: return "end of expression '}}'";
      case K::kText: return "text";
      case K::kString: return "string literal";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) fail(peek().line, "expected '" + std::string(op) + "', found " + describe(peek()));
    next();
  }
  void expect_block_end(const char* tag) {
    if (peek().kind != K::kBlockEnd)
      fail(peek().line, std::string("unexpected ") + describe(peek()) + " in '" + tag + "' tag (expected '%}')");
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().kind != K::kName) fail(peek().line, std::string("expected ") + what + ", found " + describe(peek()));
    return next().text;
  }

  // --- statements ---------------------------------------------------------------------------

  // Parses statements until a block tag whose keyword is one of `ends` (consumed with its
  // keyword; stored in `found`). `opener`/`open_line` name the enclosing block for errors.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string& found, int open_line, const char* opener) {
    DepthGuard guard(*this);
    Body body;
    for (;;) {
      const Token& t = peek();
      if (t.kind == K::kEof) {
        if (ends.size() == 0) return body;
        fail(open_line, std::string("unterminated '") + opener + "' block (no '{% " + std::string(*ends.begin()) +
                            " %}' before the end of the template)");
      }
      if (t.kind == K::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.kind == K::kVarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        next();
        s->expr = parse_tuple(true);
        if (peek().kind != K::kVarEnd) fail(peek().line, "unexpected " + describe(peek()) + " in '{{ }}' (expected '}}')");
        next();
        body.push_back(std::move(s));
      } else if (t.kind == K::kBlockBegin) {
        const int line = t.line;
        if (peek(1).kind != K::kName) fail(line, "expected a tag name after '{%', found " + describe(peek(1)));
        const std::string keyword = peek(1).text;
        for (std::string_view e : ends)
          if (keyword == e) {
            next();
            next();
            found = keyword;
            return body;
          }
        next();
        next();
        if (StmtPtr s = parse_statement(keyword, line)) body.push_back(std::move(s));
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement(const std::string& keyword, int line) {
    if (keyword == "if") return parse_if(line);
    if (keyword == "for") return parse_for(line);
    if (keyword == "set") return parse_set(line);
    if (keyword == "macro") return parse_macro(line);
    if (keyword == "break" || keyword == "continue") {
      if (loop_depth_ == 0) fail(line, "'" + keyword + "' outside of a for loop");
      expect_block_end(keyword.c_str());
      auto s = std::make_unique<Stmt>();
      s->kind = keyword == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      s->line = line;
      return s;
    }
    if (keyword == "generation" || keyword == "endgeneration") {  // transformers' AssistantTracker: no output
      expect_block_end(keyword.c_str());
      return nullptr;
    }
    if (keyword == "elif" || keyword == "else" || keyword.starts_with("end"))
      fail(line, "unexpected '{% " + keyword + " %}' (no open block it could close)");
    if (kUnsupportedTags.count(keyword)) fail(line, "unsupported tag '" + keyword + "'");
    fail(line, "unknown tag '" + keyword + "'");
  }

  StmtPtr parse_if(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = Stmt::Kind::kIf;
    s->line = line;
    std::string found = "if";
    while (found == "if" || found == "elif") {
      s->conditions.push_back(parse_tuple(false));
      expect_block_end(found.c_str());
      s->bodies.push_back(parse_body({"endif", "elif", "else"}, found, line, "if"));
    }
    if (found == "else") {
      expect_block_end("else");
      s->bodies.push_back(parse_body({"endif"}, found, line, "if"));
    }
    expect_block_end("endif");
    return s;
  }

  std::vector<std::string> parse_targets(const char* tag) {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) next();
    do {
      if (!names.empty()) next();  // ','
      names.push_back(expect_name(tag[0] == 'f' ? "a loop variable" : "a variable name"));
    } while (is_op(","));
    if (paren) expect_op(")");
    return names;
  }

  StmtPtr parse_for(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = Stmt::Kind::kFor;
    s->line = line;
    s->targets = parse_targets("for");
    if (!is_name("in")) fail(peek().line, "expected 'in' in 'for' tag, found " + describe(peek()));
    next();
    s->expr = parse_tuple(false);
    if (is_name("if")) {
      next();
      s->cond = parse_expression(true);
    }
    if (is_name("recursive")) fail(peek().line, "unsupported 'recursive' loop");
    expect_block_end("for");
    ++loop_depth_;
    std::string found;
    s->bodies.push_back(parse_body({"endfor", "else"}, found, line, "for"));
    --loop_depth_;
    if (found == "else") {
      expect_block_end("else");
      s->bodies.push_back(parse_body({"endfor"}, found, line, "for"));
    }
    expect_block_end("endfor");
    return s;
  }

  StmtPtr parse_set(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = Stmt::Kind::kSet;
    s->line = line;
    if (peek().kind == K::kName && is_op(".", 1)) {
      s->target_object = next().text;
      next();
      s->targets.push_back(expect_name("an attribute name"));
    } else {
      s->targets = parse_targets("set");
    }
    if (is_op("=")) {
      next();
      s->expr = parse_tuple(true);
      expect_block_end("set");
      return s;
    }
    if (is_op("|")) fail(peek().line, "unsupported filter on a block 'set'");
    if (s->targets.size() != 1 || !s->target_object.empty()) fail(line, "a block 'set' assigns one variable");
    expect_block_end("set");
    std::string found;
    s->bodies.push_back(parse_body({"endset"}, found, line, "set"));
    expect_block_end("endset");
    return s;
  }

  StmtPtr parse_macro(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = Stmt::Kind::kMacro;
    s->line = line;
    s->name = expect_name("a macro name");
    expect_op("(");
    while (!is_op(")")) {
      if (!s->targets.empty()) expect_op(",");
      if (is_op(")")) break;
      s->targets.push_back(expect_name("a parameter name"));
      if (is_op("=")) {
        next();
        s->defaults.push_back(parse_expression(true));
      } else {
        s->defaults.push_back(nullptr);
      }
    }
    next();
    expect_block_end("macro");
    macros_.insert(s->name);
    const int saved_depth = loop_depth_;
    loop_depth_ = 0;
    std::string found;
    s->bodies.push_back(parse_body({"endmacro"}, found, line, "macro"));
    loop_depth_ = saved_depth;
    expect_block_end("endmacro");
    return s;
  }

  // --- expressions --------------------------------------------------------------------------

  ExprPtr node(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  bool at_expression_end() const {
    const Token& t = peek();
    return t.kind == K::kBlockEnd || t.kind == K::kVarEnd || t.kind == K::kEof ||
           (t.kind == K::kOp && (t.text == ")" || t.text == "]" || t.text == "}"));
  }

  // `a, b, c` (a tuple) or one expression.
  ExprPtr parse_tuple(bool allow_cond) {
    const int line = peek().line;
    ExprPtr first = parse_expression(allow_cond);
    if (!is_op(",")) return first;
    ExprPtr t = node(Expr::Kind::kTuple, line);
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (at_expression_end() || is_name("if")) break;
      t->args.push_back(parse_expression(allow_cond));
    }
    return t;
  }

  // Bounds the parser's recursion (nested parentheses, unary operators, blocks).
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.fail(p.peek().line, "template nested too deeply");
    }
    ~DepthGuard() { --p.depth_; }
  };

  ExprPtr parse_expression(bool allow_cond) {
    DepthGuard guard(*this);
    ExprPtr e = parse_or();
    if (!allow_cond || !is_name("if")) return e;
    const int line = peek().line;
    next();
    ExprPtr c = node(Expr::Kind::kCondition, line);
    c->args.push_back(parse_or());
    c->args.push_back(std::move(e));
    if (is_name("else")) {
      next();
      c->args.push_back(parse_expression(true));
    } else {
      c->args.push_back(nullptr);
    }
    return c;
  }

  ExprPtr binary(std::string op, ExprPtr l, ExprPtr r, int line) {
    ExprPtr b = node(Expr::Kind::kBinary, line);
    b->name = std::move(op);
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      int line = next().line;
      l = binary("or", std::move(l), parse_and(), line);
    }
    return l;
  }

  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      int line = next().line;
      l = binary("and", std::move(l), parse_not(), line);
    }
    return l;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      ExprPtr u = node(Expr::Kind::kUnary, next().line);
      u->name = "not";
      u->args.push_back(parse_not());
      return u;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr l = parse_math1();
    ExprPtr result;
    for (;;) {
      std::string op;
      const int line = peek().line;
      if (peek().kind == K::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                    peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (result) fail(line, "chained comparisons (a < b < c) are not supported");
      result = binary(op, std::move(l), parse_math1(), line);
      l = nullptr;
    }
    return result ? std::move(result) : std::move(l);
  }

  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      l = binary(t.text, std::move(l), parse_concat(), t.line);
    }
    return l;
  }

  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      int line = next().line;
      l = binary("~", std::move(l), parse_math2(), line);
    }
    return l;
  }

  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      l = binary(t.text, std::move(l), parse_pow(), t.line);
    }
    return l;
  }

  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      int line = next().line;
      l = binary("**", std::move(l), parse_unary(true), line);
    }
    return l;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = node(Expr::Kind::kUnary, t.line);
      e->name = t.text;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    const int line = t.line;
    switch (t.kind) {
      case K::kName: {
        next();
        ExprPtr e = node(Expr::Kind::kLiteral, line);
        if (t.text == "true" || t.text == "True") e->literal = true;
        else if (t.text == "false" || t.text == "False") e->literal = false;
        else if (t.text == "none" || t.text == "None") e->literal = nullptr;
        else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case K::kString: {
        ExprPtr e = node(Expr::Kind::kLiteral, line);
        std::string s;
        while (peek().kind == K::kString) s += next().text;  // adjacent literals concatenate
        e->literal = trusted_string(std::move(s));
        return e;
      }
      case K::kInt: {
        ExprPtr e = node(Expr::Kind::kLiteral, line);
        e->literal = next().int_value;
        return e;
      }
      case K::kFloat: {
        ExprPtr e = node(Expr::Kind::kLiteral, line);
        e->literal = next().float_value;
        return e;
      }
      case K::kOp:
        if (t.text == "(") {
          next();
          if (is_op(")")) {
            next();
            return node(Expr::Kind::kTuple, line);
          }
          ExprPtr e = parse_expression(true);
          if (is_op(",")) {
            ExprPtr tup = node(Expr::Kind::kTuple, line);
            tup->args.push_back(std::move(e));
            while (is_op(",")) {
              next();
              if (is_op(")")) break;
              tup->args.push_back(parse_expression(true));
            }
            e = std::move(tup);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          ExprPtr e = node(Expr::Kind::kList, line);
          while (!is_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("]")) break;
            e->args.push_back(parse_expression(true));
          }
          next();
          return e;
        }
        if (t.text == "{") {
          next();
          ExprPtr e = node(Expr::Kind::kDict, line);
          while (!is_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("}")) break;
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
          }
          next();
          return e;
        }
        break;
      default: break;
    }
    fail(line, "unexpected " + describe(t) + " (expected an expression)");
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail(peek().line, "unsupported argument unpacking (*args / **kwargs)");
      if (peek().kind == K::kName && is_op("=", 1)) {
        call.kwnames.push_back(next().text);
        next();
        call.kwargs.push_back(parse_expression(true));
      } else {
        if (!call.kwnames.empty()) fail(peek().line, "positional argument after a keyword argument");
        call.args.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_postfix(ExprPtr e) {
    for (;;) {
      const int line = peek().line;
      if (is_op(".")) {
        next();
        if (peek().kind == K::kInt) {
          ExprPtr item = node(Expr::Kind::kItem, line);
          ExprPtr index = node(Expr::Kind::kLiteral, line);
          index->literal = next().int_value;
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
          continue;
        }
        ExprPtr attr = node(Expr::Kind::kAttr, line);
        attr->name = expect_name("an attribute name after '.'");
        attr->args.push_back(std::move(e));
        e = std::move(attr);
      } else if (is_op("[")) {
        next();
        ExprPtr start;
        if (!is_op(":")) start = parse_expression(true);
        if (is_op(":")) {
          next();
          ExprPtr slice = node(Expr::Kind::kSlice, line);
          slice->args.push_back(std::move(e));
          slice->args.push_back(std::move(start));
          slice->args.push_back(is_op("]") || is_op(":") ? nullptr : parse_expression(true));
          ExprPtr step;
          if (is_op(":")) {
            next();
            if (!is_op("]")) step = parse_expression(true);
          }
          slice->args.push_back(std::move(step));
          e = std::move(slice);
        } else {
          ExprPtr item = node(Expr::Kind::kItem, line);
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(start));
          e = std::move(item);
        }
        expect_op("]");
      } else if (is_op("(")) {
        if (e->kind == Expr::Kind::kAttr && !is_known_method(e->name))
          fail(line, "unsupported method '" + e->name + "'");
        if (e->kind == Expr::Kind::kName) called_names_.emplace_back(e->name, line);
        if (e->kind != Expr::Kind::kAttr && e->kind != Expr::Kind::kName)
          fail(line, "only functions, macros and methods can be called");
        ExprPtr call = node(Expr::Kind::kCall, line);
        call->args.push_back(std::move(e));
        parse_call_args(*call);
        e = std::move(call);
      } else {
        return e;
      }
    }
  }

  bool starts_bare_test_argument() const {
    const Token& t = peek();
    if (t.kind == K::kName) return t.text != "else" && t.text != "or" && t.text != "and" && t.text != "if";
    return t.kind == K::kString || t.kind == K::kInt || t.kind == K::kFloat ||
           (t.kind == K::kOp && (t.text == "[" || t.text == "{"));
  }

  ExprPtr parse_filters(ExprPtr e) {
    for (;;) {
      const int line = peek().line;
      if (is_op("|")) {
        next();
        ExprPtr f = node(Expr::Kind::kFilter, line);
        f->name = expect_name("a filter name after '|'");
        if (!is_known_filter(f->name)) fail(line, "unsupported filter '" + f->name + "'");
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        next();
        ExprPtr t = node(Expr::Kind::kTest, line);
        if (is_name("not")) {
          next();
          t->negate = true;
        }
        const Token& n = peek();
        if (n.kind != K::kName) fail(line, "expected a test name after 'is', found " + describe(n));
        t->name = next().text;
        if (!is_known_test(t->name)) fail(line, "unsupported test '" + t->name + "'");
        t->args.push_back(std::move(e));
        static const std::set<std::string, std::less<>> kTestsWithArgument = {
            "divisibleby", "equalto", "eq", "ne", "sameas", "lt", "le", "gt", "ge", "in"};
        if (is_op("(")) {
          parse_call_args(*t);
        } else if (kTestsWithArgument.count(t->name) && starts_bare_test_argument()) {
          t->args.push_back(parse_unary(false));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  static constexpr int kMaxDepth = 200;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::set<std::string, std::less<>> macros_;
  std::vector<std::pair<std::string, int>> called_names_;
};

}  // namespace

Program parse(std::string_view source) { return Parser(tokenize(source)).run(); }

}  // namespace lily::jinja
