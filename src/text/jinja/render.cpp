// The interpreter of the chat-template engine: statements, expressions, filters, tests, methods
// and globals, with jinja2 3.1's semantics under transformers (see template.h).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>
#include <set>
#include <unordered_map>

#include "text/jinja/ast.h"
#include "text/jinja/parser.h"
#include "text/jinja/pystr.h"
#include "text/jinja/template.h"

namespace lily::jinja {

namespace {

const std::set<std::string, std::less<>> kFilters = {
    "abs",   "capitalize", "count",  "d",       "default", "first", "float",      "indent", "int",
    "items", "join",       "last",   "length",  "list",    "lower", "map",        "rejectattr",
    "replace", "reverse",  "safe",   "selectattr", "string", "title", "tojson",   "trim",   "upper"};
const std::set<std::string, std::less<>> kTests = {
    "boolean", "callable", "defined", "divisibleby", "eq",     "equalto", "even",     "false",
    "float",   "in",       "integer", "iterable",    "mapping", "ne",     "none",     "number",
    "odd",     "sameas",   "sequence", "string",     "true",    "undefined"};
const std::set<std::string, std::less<>> kStringMethods = {
    "capitalize", "endswith", "find", "join", "lower", "lstrip", "replace",
    "rstrip",     "split",    "startswith", "strip", "title", "upper"};
const std::set<std::string, std::less<>> kDictMethods = {"get", "items", "keys", "values"};
const std::set<std::string, std::less<>> kGlobals = {"dict", "namespace", "raise_exception", "range", "strftime_now"};

constexpr int kMaxDepth = 400;                 // nested evaluation (expressions, macro calls)
constexpr uint64_t kMaxSteps = 20'000'000;     // statements + loop iterations per render
constexpr size_t kMaxOutput = size_t{256} << 20;  // bytes of rendered text or of one string

}  // namespace

bool is_known_filter(std::string_view name) { return kFilters.count(name) > 0; }
bool is_known_test(std::string_view name) { return kTests.count(name) > 0; }
bool is_known_method(std::string_view name) { return kStringMethods.count(name) > 0 || kDictMethods.count(name) > 0; }
bool is_known_global(std::string_view name) { return kGlobals.count(name) > 0; }

/// Walks a Program with one context. One Interpreter per render() call.
class Interpreter {
 public:
  explicit Interpreter(const Value& context) {
    root_.parent = nullptr;
    install_globals();
    for (const auto& [k, v] : context.dict_data().items) root_.vars[k] = v;
  }

  /// Renders a body into `out`.
  void run(const Body& body, MarkedText& out) {
    if (exec(body, out, root_) != Flow::kNormal) fail(0, "'break' or 'continue' outside of a loop");
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  struct Scope {
    std::unordered_map<std::string, Value> vars;
    Scope* parent = nullptr;
  };

  struct DepthGuard {
    Interpreter& in;
    DepthGuard(Interpreter& i, int line) : in(i) {
      if (++in.depth_ > kMaxDepth) in.fail(line, "template recursion or nesting too deep");
    }
    ~DepthGuard() { --in.depth_; }
  };

  [[noreturn]] void fail(int line, const std::string& message) const {
    throw TemplateRenderError("line " + std::to_string(line) + ": " + message);
  }

  void step(int line) {
    if (++steps_ > kMaxSteps) fail(line, "template too expensive (more than 20M steps)");
  }

  void check_size(size_t n, int line) const {
    if (n > kMaxOutput) fail(line, "rendered text too large (more than 256 MiB)");
  }

  static std::shared_ptr<const Function> make_function(std::string name,
                                                       std::function<Value(Interpreter&, CallArgs&&)> fn,
                                                       Value bound = Value()) {
    return std::make_shared<const Function>(Function{std::move(name), std::move(fn), std::move(bound)});
  }

  // --- scopes -------------------------------------------------------------------------------

  static Value lookup(const Scope& scope, const std::string& name) {
    for (const Scope* s = &scope; s; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  // --- statements ---------------------------------------------------------------------------

  Flow exec(const Body& body, MarkedText& out, Scope& scope) {
    for (const StmtPtr& s : body) {
      Flow f = exec(*s, out, scope);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, MarkedText& out, Scope& scope) {
    try {
      return exec_statement(s, out, scope);
    } catch (const ValueNestingError& e) {  // thrown by a walk of a value, which knows no line
      fail(s.line, e.what());
    }
  }

  Flow exec_statement(const Stmt& s, MarkedText& out, Scope& scope) {
    step(s.line);
    switch (s.kind) {
      case Stmt::Kind::kText:
        out.append(s.text, /*trusted=*/true);
        check_size(out.size(), s.line);
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        out.append(eval(*s.expr, scope));
        check_size(out.size(), s.line);
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.conditions.size(); ++i)
          if (eval(*s.conditions[i], scope).truthy()) return exec(s.bodies[i], out, scope);
        if (s.bodies.size() > s.conditions.size()) return exec(s.bodies.back(), out, scope);
        return Flow::kNormal;
      case Stmt::Kind::kFor: exec_for(s, out, scope); return Flow::kNormal;
      case Stmt::Kind::kSet: exec_set(s, scope); return Flow::kNormal;
      case Stmt::Kind::kMacro: define_macro(s, scope); return Flow::kNormal;
      case Stmt::Kind::kBreak: return Flow::kBreak;
      case Stmt::Kind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  std::vector<Value> iterate(const Value& v, int line) {
    if (v.is_list()) return v.list_data().items;
    if (v.is_dict()) {
      std::vector<Value> keys;
      for (const auto& [k, e] : v.dict_data().items) keys.emplace_back(k);
      return keys;
    }
    if (v.is_string()) {
      std::vector<Value> chars;
      const std::string& s = v.str();
      std::vector<size_t> offs = pystr::code_point_offsets(s);
      for (size_t i = 0; i + 1 < offs.size(); ++i) chars.push_back(substring(v, offs[i], offs[i + 1]));
      return chars;
    }
    if (v.is_undefined()) return {};
    fail(line, "'" + v.type_name() + "' object is not iterable");
  }

  void bind_targets(Scope& scope, const std::vector<std::string>& targets, const Value& v, int line) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return;
    }
    std::vector<Value> items = iterate(v, line);
    if (items.size() != targets.size())
      fail(line, std::string(items.size() < targets.size() ? "not enough" : "too many") + " values to unpack (expected " +
                     std::to_string(targets.size()) + ", got " + std::to_string(items.size()) + ")");
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = items[i];
  }

  void exec_for(const Stmt& s, MarkedText& out, Scope& scope) {
    std::vector<Value> items = iterate(eval(*s.expr, scope), s.line);
    if (s.cond) {  // `for x in xs if cond`: the filter sees the loop variables, not `loop`
      std::vector<Value> kept;
      for (const Value& item : items) {
        Scope probe;
        probe.parent = &scope;
        bind_targets(probe, s.targets, item, s.line);
        if (eval(*s.cond, probe).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    bool iterated = false;
    for (int64_t i = 0; i < n; ++i) {
      step(s.line);
      Scope iteration;  // jinja2: assignments in the body last one iteration
      iteration.parent = &scope;
      Value loop = Value::dict();
      DictData& d = loop.dict_data();
      d.items = {{"index", i + 1},
                 {"index0", i},
                 {"revindex", n - i},
                 {"revindex0", n - i - 1},
                 {"first", i == 0},
                 {"last", i == n - 1},
                 {"length", n},
                 {"previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item")},
                 {"nextitem", i + 1 < n ? items[i + 1] : Value::undefined("there is no next item")}};
      iteration.vars["loop"] = loop;
      bind_targets(iteration, s.targets, items[i], s.line);
      iterated = true;
      Flow f = exec(s.bodies[0], out, iteration);
      if (f == Flow::kBreak) break;
    }
    if (!iterated && s.bodies.size() > 1) {
      Scope empty;
      empty.parent = &scope;
      exec(s.bodies[1], out, empty);
    }
  }

  void exec_set(const Stmt& s, Scope& scope) {
    Value v;
    if (s.expr) {
      v = eval(*s.expr, scope);
    } else {
      MarkedText body;
      Scope inner;
      inner.parent = &scope;
      exec(s.bodies[0], body, inner);
      v = body.take();
    }
    if (!s.target_object.empty()) {
      Value ns = lookup(scope, s.target_object);
      if (!ns.is_namespace()) fail(s.line, "cannot assign attribute on non-namespace object '" + s.target_object + "'");
      // The one place a template changes a value it already holds: refuse a cycle, and a value
      // grown (one loop iteration at a time) past the depth the walks of values accept.
      steps_ += check_namespace_member(ns, v);
      if (steps_ > kMaxSteps) fail(s.line, "template too expensive (more than 20M steps)");
      ns.dict_data().set(s.targets[0], std::move(v));
      return;
    }
    bind_targets(scope, s.targets, v, s.line);
  }

  void define_macro(const Stmt& s, Scope& scope) {
    const Stmt* macro = &s;
    scope.vars[s.name] = Value(make_function(s.name, [macro](Interpreter& in, CallArgs&& args) {
      return in.call_macro(*macro, std::move(args));
    }));
  }

  Value call_macro(const Stmt& m, CallArgs&& args) {
    DepthGuard guard(*this, m.line);
    if (args.positional.size() > m.targets.size())
      fail(m.line, "macro '" + m.name + "' takes not more than " + std::to_string(m.targets.size()) + " argument(s)");
    Scope scope;
    scope.parent = &root_;
    std::vector<bool> given(m.targets.size(), false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      scope.vars[m.targets[i]] = std::move(args.positional[i]);
      given[i] = true;
    }
    for (auto& [k, v] : args.keyword) {
      auto it = std::find(m.targets.begin(), m.targets.end(), k);
      if (it == m.targets.end()) fail(m.line, "macro '" + m.name + "' takes no keyword argument '" + k + "'");
      size_t i = static_cast<size_t>(it - m.targets.begin());
      if (given[i]) fail(m.line, "macro '" + m.name + "' got multiple values for argument '" + k + "'");
      scope.vars[k] = std::move(v);
      given[i] = true;
    }
    for (size_t i = 0; i < m.targets.size(); ++i) {
      if (given[i]) continue;
      scope.vars[m.targets[i]] =
          m.defaults[i] ? eval(*m.defaults[i], scope)
                        : Value::undefined("parameter '" + m.targets[i] + "' was not provided");
    }
    MarkedText out;
    exec(m.bodies[0], out, scope);
    return out.take();
  }

  // --- expressions --------------------------------------------------------------------------

  [[noreturn]] void undefined_error(const Value& v, int line) const {
    const std::string& hint = std::get<Undefined>(v.v).hint;
    fail(line, hint.empty() ? "undefined value" : hint);
  }

  Value eval(const Expr& e, Scope& scope) {
    DepthGuard guard(*this, e.line);
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.literal;
      case Expr::Kind::kName: return lookup(scope, e.name);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const auto& a : e.args) items.push_back(eval(*a, scope));
        return Value::list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        Value d = Value::dict();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], scope);
          if (!k.is_string()) fail(e.line, "dict keys must be strings in chat templates");
          d.dict_data().set(k.str(), eval(*e.args[i + 1], scope));
        }
        return d;
      }
      case Expr::Kind::kAttr: return get_attr(eval(*e.args[0], scope), e.name, e.line);
      case Expr::Kind::kItem: return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope), e.line);
      case Expr::Kind::kSlice: return eval_slice(e, scope);
      case Expr::Kind::kCall: return eval_call(e, scope);
      case Expr::Kind::kFilter: {
        Value operand = eval(*e.args[0], scope);
        return apply_filter(e.name, std::move(operand), eval_args(e, scope, 1), e.line);
      }
      case Expr::Kind::kTest: {
        Value operand = eval(*e.args[0], scope);
        bool r = apply_test(e.name, operand, eval_args(e, scope, 1), e.line);
        return e.negate ? !r : r;
      }
      case Expr::Kind::kUnary: {
        Value v = eval(*e.args[0], scope);
        if (e.name == "not") return !v.truthy();
        if (v.is_undefined()) undefined_error(v, e.line);
        if (v.is_int() || v.is_bool()) {
          int64_t i = v.is_bool() ? int64_t{std::get<bool>(v.v)} : std::get<int64_t>(v.v);
          if (e.name == "-") {
            if (i == INT64_MIN) fail(e.line, "integer overflow");
            return -i;
          }
          return i;
        }
        if (v.is_float()) return e.name == "-" ? -std::get<double>(v.v) : std::get<double>(v.v);
        fail(e.line, "bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
      }
      case Expr::Kind::kBinary: return eval_binary(e, scope);
      case Expr::Kind::kCondition:
        if (eval(*e.args[0], scope).truthy()) return eval(*e.args[1], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the conditional expression had no else");
    }
    return Value();
  }

  CallArgs eval_args(const Expr& e, Scope& scope, size_t first) {
    CallArgs args;
    for (size_t i = first; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i], scope));
    for (size_t i = 0; i < e.kwnames.size(); ++i) args.keyword.emplace_back(e.kwnames[i], eval(*e.kwargs[i], scope));
    return args;
  }

  Value get_attr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) undefined_error(obj, line);
    if (obj.is_dict()) {
      if (kDictMethods.count(name)) return bound_method(obj, name);
      if (Value* v = obj.dict_data().find(name)) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    if (obj.is_namespace()) {
      if (Value* v = obj.dict_data().find(name)) return *v;
      return Value::undefined("'Namespace' object has no attribute '" + name + "'");
    }
    if (obj.is_string() && kStringMethods.count(name)) return bound_method(obj, name);
    if (obj.is_none()) return Value::undefined("'None' has no attribute '" + name + "'");
    return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'");
  }

  Value bound_method(const Value& obj, const std::string& name) {
    return Value(make_function(
        name, [obj, name](Interpreter& in, CallArgs&& args) { return in.call_method(obj, name, std::move(args), 0); },
        obj));
  }

  static int64_t normalize_index(int64_t i, size_t size) { return i < 0 ? i + static_cast<int64_t>(size) : i; }

  Value get_item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) undefined_error(obj, line);
    if (obj.is_dict() || obj.is_namespace()) {
      if (key.is_string())
        if (Value* v = obj.dict_data().find(key.str())) return *v;
      return Value::undefined("'" + obj.type_name() + " object' has no attribute " + to_repr(key));
    }
    if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
      int64_t raw = key.is_bool() ? int64_t{std::get<bool>(key.v)} : std::get<int64_t>(key.v);
      if (obj.is_list()) {
        const auto& items = obj.list_data().items;
        int64_t i = normalize_index(raw, items.size());
        if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[static_cast<size_t>(i)];
      } else {
        std::vector<size_t> offs = pystr::code_point_offsets(obj.str());
        int64_t i = normalize_index(raw, offs.size() - 1);
        if (i >= 0 && i + 1 < static_cast<int64_t>(offs.size()))
          return substring(obj, offs[static_cast<size_t>(i)], offs[static_cast<size_t>(i) + 1]);
      }
      return Value::undefined(obj.type_name() + " object has no element " + std::to_string(raw));
    }
    if (key.is_string()) return get_attr(obj, key.str(), line);
    return Value::undefined("'" + obj.type_name() + " object' has no element " + to_repr(key));
  }

  std::optional<int64_t> slice_bound(const Expr* e, Scope& scope, int line) {
    if (!e) return std::nullopt;
    Value v = eval(*e, scope);
    if (v.is_none()) return std::nullopt;
    if (v.is_int()) return std::get<int64_t>(v.v);
    if (v.is_bool()) return int64_t{std::get<bool>(v.v)};
    fail(line, "slice indices must be integers or None");
  }

  // Python slice semantics (list.__getitem__(slice)).
  static std::vector<size_t> slice_indices(size_t size, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) {
    const int64_t n = static_cast<int64_t>(size);
    auto clamp = [&](std::optional<int64_t> v, int64_t def, int64_t lo, int64_t hi) {
      if (!v) return def;
      int64_t x = *v < 0 ? *v + n : *v;
      return std::clamp(x, lo, hi);
    };
    std::vector<size_t> out;
    if (step > 0) {
      int64_t b = clamp(start, 0, 0, n), e = clamp(stop, n, 0, n);
      for (int64_t i = b; i < e; i += step) out.push_back(static_cast<size_t>(i));
    } else {
      int64_t b = clamp(start, n - 1, -1, n - 1), e = clamp(stop, -1, -1, n - 1);
      for (int64_t i = b; i > e; i += step) out.push_back(static_cast<size_t>(i));
    }
    return out;
  }

  Value eval_slice(const Expr& e, Scope& scope) {
    Value obj = eval(*e.args[0], scope);
    auto start = slice_bound(e.args[1].get(), scope, e.line);
    auto stop = slice_bound(e.args[2].get(), scope, e.line);
    auto step = slice_bound(e.args[3].get(), scope, e.line);
    if (step && *step == 0) fail(e.line, "slice step cannot be zero");
    if (obj.is_undefined()) undefined_error(obj, e.line);
    if (obj.is_list()) {
      const auto& items = obj.list_data().items;
      std::vector<Value> out;
      for (size_t i : slice_indices(items.size(), start, stop, step.value_or(1))) out.push_back(items[i]);
      return Value::list(std::move(out), obj.list_data().tuple);
    }
    if (obj.is_string()) {
      const std::string& s = obj.str();
      std::vector<size_t> offs = pystr::code_point_offsets(s);
      MarkedText out;
      for (size_t i : slice_indices(offs.size() - 1, start, stop, step.value_or(1))) out.append_range(obj, offs[i], offs[i + 1]);
      return out.take();
    }
    fail(e.line, "'" + obj.type_name() + "' object is not subscriptable");
  }

  Value eval_call(const Expr& e, Scope& scope) {
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Kind::kAttr) {
      Value obj = eval(*callee.args[0], scope);
      if (obj.is_undefined()) undefined_error(obj, e.line);
      if ((obj.is_dict() && !kDictMethods.count(callee.name)) || obj.is_namespace()) {
        Value fn = get_attr(obj, callee.name, e.line);
        if (fn.is_callable()) return fn.function().call(*this, eval_args(e, scope, 1));
        fail(e.line, "'" + obj.type_name() + " object' has no method '" + callee.name + "'");
      }
      return call_method(obj, callee.name, eval_args(e, scope, 1), e.line);
    }
    Value fn = eval(callee, scope);
    if (fn.is_undefined()) undefined_error(fn, e.line);
    if (!fn.is_callable()) fail(e.line, "'" + fn.type_name() + "' object is not callable");
    CallArgs args = eval_args(e, scope, 1);
    call_line_ = e.line;
    return fn.function().call(*this, std::move(args));
  }

  static std::optional<std::string> optional_string(const CallArgs& a, size_t i, const char* kw) {
    const Value* v = i < a.positional.size() ? &a.positional[i] : a.kw(kw);
    if (!v || v->is_none()) return std::nullopt;
    return to_str(*v);
  }

  const Value* arg(const CallArgs& a, size_t i, const char* kw) const {
    return i < a.positional.size() ? &a.positional[i] : a.kw(kw);
  }

  int64_t int_arg(const CallArgs& a, size_t i, const char* kw, int64_t def, int line) const {
    const Value* v = arg(a, i, kw);
    if (!v || v->is_none()) return def;
    if (v->is_int()) return std::get<int64_t>(v->v);
    if (v->is_bool()) return std::get<bool>(v->v);
    fail(line, std::string("argument '") + kw + "' must be an integer");
  }

  const std::string& string_arg(const CallArgs& a, size_t i, const char* kw, const char* method, int line) const {
    const Value* v = arg(a, i, kw);
    if (!v || !v->is_string()) fail(line, std::string(method) + "() argument '" + kw + "' must be a string");
    return v->str();
  }

  Value call_method(const Value& obj, const std::string& name, CallArgs&& a, int line) {
    if (obj.is_string()) {
      const std::string& s = obj.str();
      if (name == "startswith" || name == "endswith") {
        const Value* p = arg(a, 0, "prefix");
        if (!p) fail(line, name + "() takes at least 1 argument");
        auto test = [&](const Value& x) {
          if (!x.is_string()) fail(line, name + "() argument must be str or a tuple of str");
          return name == "startswith" ? s.starts_with(x.str()) : s.ends_with(x.str());
        };
        if (p->is_list()) {
          for (const Value& x : p->list_data().items)
            if (test(x)) return true;
          return false;
        }
        return test(*p);
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        auto [b, e] = pystr::strip_range(s, optional_string(a, 0, "chars"), name != "rstrip", name != "lstrip");
        return substring(obj, b, e);
      }
      if (name == "split") {
        std::vector<Value> parts;
        try {
          for (auto [b, e] : pystr::split_ranges(s, optional_string(a, 0, "sep"), int_arg(a, 1, "maxsplit", -1, line)))
            parts.push_back(substring(obj, b, e));
        } catch (const Error& err) {
          fail(line, err.what());
        }
        return Value::list(std::move(parts));
      }
      if (name == "upper") return pystr::upper(s);
      if (name == "lower") return pystr::lower(s);
      if (name == "title") return pystr::title(s);
      if (name == "capitalize") return pystr::capitalize(s);
      if (name == "replace") {
        string_arg(a, 0, "old", "replace", line);
        string_arg(a, 1, "new", "replace", line);
        return replace(obj, a.positional.size() > 0 ? a.positional[0] : *a.kw("old"),
                       a.positional.size() > 1 ? a.positional[1] : *a.kw("new"), int_arg(a, 2, "count", -1, line), line);
      }
      if (name == "find") {
        size_t at = s.find(string_arg(a, 0, "sub", "find", line));
        return at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(pystr::length(s.substr(0, at)));
      }
      if (name == "join") {
        const Value* it = arg(a, 0, "iterable");
        if (!it) fail(line, "join() takes exactly one argument");
        MarkedText out;
        bool first = true;
        for (const Value& x : iterate(*it, line)) {
          if (!x.is_string()) fail(line, "sequence item: expected str instance, " + x.type_name() + " found");
          if (!first) out.append(obj);
          first = false;
          out.append(x);
          check_size(out.size(), line);
        }
        return out.take();
      }
    }
    if (obj.is_dict()) {
      DictData& d = obj.dict_data();
      if (name == "get") {
        const Value* k = arg(a, 0, "key");
        if (!k) fail(line, "get() takes at least 1 argument");
        if (k->is_string())
          if (Value* v = d.find(k->str())) return *v;
        const Value* def = arg(a, 1, "default");
        return def ? *def : Value(nullptr);
      }
      if (name == "items") return items_of(obj);
      if (name == "keys") {
        std::vector<Value> keys;
        for (const auto& [k, v] : d.items) keys.emplace_back(k);
        return Value::list(std::move(keys));
      }
      if (name == "values") {
        std::vector<Value> values;
        for (const auto& [k, v] : d.items) values.push_back(v);
        return Value::list(std::move(values));
      }
    }
    fail(line, "'" + obj.type_name() + " object' has no method '" + name + "'");
  }

  // str.replace keeping provenance: unchanged parts keep theirs, inserted parts `repl`'s.
  Value replace(const Value& s, const Value& old, const Value& repl, int64_t count, int line) {
    const std::string& text = s.str();
    const std::string& o = old.str();
    MarkedText out;
    int64_t done = 0;
    if (o.empty()) {
      std::vector<size_t> offs = pystr::code_point_offsets(text);
      for (size_t k = 0; k < offs.size(); ++k) {
        if (count < 0 || done < count) {
          out.append(repl);
          ++done;
        }
        if (k + 1 < offs.size()) out.append_range(s, offs[k], offs[k + 1]);
        check_size(out.size(), line);
      }
      return out.take();
    }
    size_t pos = 0;
    while (count < 0 || done < count) {
      size_t hit = text.find(o, pos);
      if (hit == std::string::npos) break;
      out.append_range(s, pos, hit);
      out.append(repl);
      check_size(out.size(), line);
      pos = hit + o.size();
      ++done;
    }
    out.append_range(s, pos, text.size());
    return out.take();
  }

  static Value items_of(const Value& dict) {
    std::vector<Value> pairs;
    for (const auto& [k, v] : dict.dict_data().items) pairs.push_back(Value::list({Value(k), v}, true));
    return Value::list(std::move(pairs));
  }

  // --- operators ----------------------------------------------------------------------------

  static bool numeric(const Value& v) { return v.is_int() || v.is_float() || v.is_bool(); }
  static int64_t as_int(const Value& v) { return v.is_bool() ? int64_t{std::get<bool>(v.v)} : std::get<int64_t>(v.v); }

  bool contains(const Value& container, const Value& item, int line) {
    if (container.is_undefined()) return false;
    if (container.is_string()) {
      if (!item.is_string()) fail(line, "'in <string>' requires string as left operand, not " + item.type_name());
      return container.str().find(item.str()) != std::string::npos;
    }
    if (container.is_list()) {
      for (const Value& x : container.list_data().items)
        if (equal(x, item)) return true;
      return false;
    }
    if (container.is_dict()) return item.is_string() && container.dict_data().find(item.str()) != nullptr;
    fail(line, "argument of type '" + container.type_name() + "' is not iterable");
  }

  Value eval_binary(const Expr& e, Scope& scope) {
    const std::string& op = e.name;
    Value l = eval(*e.args[0], scope);
    if (op == "and") return l.truthy() ? eval(*e.args[1], scope) : l;
    if (op == "or") return l.truthy() ? l : eval(*e.args[1], scope);
    Value r = eval(*e.args[1], scope);
    if (op == "==") return equal(l, r);
    if (op == "!=") return !equal(l, r);
    if (op == "in") return contains(r, l, e.line);
    if (op == "not in") return !contains(r, l, e.line);
    if (op == "~") {
      MarkedText m;
      m.append(l);
      m.append(r);
      check_size(m.size(), e.line);
      return m.take();
    }
    if (l.is_undefined()) undefined_error(l, e.line);
    if (r.is_undefined()) undefined_error(r, e.line);
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c = 0;
      try {
        c = compare(l, r);
      } catch (const TemplateRenderError& err) {
        fail(e.line, err.what());
      }
      if (op == "<") return c < 0;
      if (op == ">") return c > 0;
      if (op == "<=") return c <= 0;
      return c >= 0;
    }
    auto type_error = [&]() -> Value {
      fail(e.line, "unsupported operand type(s) for " + op + ": '" + l.type_name() + "' and '" + r.type_name() + "'");
    };
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        check_size(l.str().size() + r.str().size(), e.line);
        MarkedText m;
        m.append(l);
        m.append(r);
        return m.take();
      }
      if (l.is_list() && r.is_list()) {
        std::vector<Value> items = l.list_data().items;
        items.insert(items.end(), r.list_data().items.begin(), r.list_data().items.end());
        return Value::list(std::move(items), l.list_data().tuple && r.list_data().tuple);
      }
    }
    if (op == "*" && ((l.is_string() || l.is_list()) != (r.is_string() || r.is_list()))) {
      const Value& seq = (l.is_string() || l.is_list()) ? l : r;
      const Value& count = (l.is_string() || l.is_list()) ? r : l;
      if (!(count.is_int() || count.is_bool())) return type_error();
      int64_t n = std::max<int64_t>(0, as_int(count));
      size_t unit = seq.is_string() ? seq.str().size() : seq.list_data().items.size() * 16;
      if (unit > 0 && static_cast<uint64_t>(n) > kMaxOutput / unit) fail(e.line, "repetition result too large");
      if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.str();
        return out;
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) items.insert(items.end(), seq.list_data().items.begin(), seq.list_data().items.end());
      return Value::list(std::move(items));
    }
    if (!numeric(l) || !numeric(r)) return type_error();
    const bool ints = !l.is_float() && !r.is_float();
    if (op == "/") {
      if (r.as_double() == 0) fail(e.line, "division by zero");
      return l.as_double() / r.as_double();
    }
    if (ints) {
      int64_t a = as_int(l), b = as_int(r), out = 0;
      if (op == "+" && !__builtin_add_overflow(a, b, &out)) return out;
      if (op == "-" && !__builtin_sub_overflow(a, b, &out)) return out;
      if (op == "*" && !__builtin_mul_overflow(a, b, &out)) return out;
      if (op == "//" || op == "%") {
        if (b == 0) fail(e.line, "integer division or modulo by zero");
        if (a == INT64_MIN && b == -1) fail(e.line, "integer overflow");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          --q;
          m += b;
        }
        return op == "//" ? q : m;
      }
      if (op == "**") {
        if (b < 0) return std::pow(static_cast<double>(a), static_cast<double>(b));
        int64_t result = 1;
        for (int64_t i = 0; i < b; ++i)
          if (__builtin_mul_overflow(result, a, &result)) fail(e.line, "integer overflow");
        return result;
      }
      fail(e.line, "integer overflow");
    }
    double a = l.as_double(), b = r.as_double();
    if (op == "+") return a + b;
    if (op == "-") return a - b;
    if (op == "*") return a * b;
    if (op == "**") return std::pow(a, b);
    if (b == 0) fail(e.line, "float division by zero");
    if (op == "//") return std::floor(a / b);
    double m = std::fmod(a, b);
    if (m != 0 && ((m < 0) != (b < 0))) m += b;
    return m;
  }

  // --- filters ------------------------------------------------------------------------------

  Value apply_filter(const std::string& name, Value v, CallArgs&& a, int line) {
    if (name == "safe") return v;
    if (name == "tojson") {
      JsonOptions o;
      // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      if (const Value* x = arg(a, 0, "ensure_ascii")) o.ensure_ascii = x->truthy();
      if (const Value* x = arg(a, 1, "indent"); x && !x->is_none()) {
        if (x->is_int()) o.indent = static_cast<int>(std::clamp<int64_t>(std::get<int64_t>(x->v), 0, 64));
        else if (x->is_string() && x->str().empty()) o.indent = 0;
        else fail(line, "tojson indent must be an integer");
      }
      if (const Value* x = arg(a, 2, "separators"); x && !x->is_none()) {
        if (!x->is_list() || x->list_data().items.size() != 2 || !x->list_data().items[0].is_string() ||
            !x->list_data().items[1].is_string())
          fail(line, "tojson separators must be a pair of strings");
        o.item_separator = x->list_data().items[0].str();
        o.key_separator = x->list_data().items[1].str();
        if (o.item_separator.empty() || o.key_separator.empty()) fail(line, "empty tojson separators are not supported");
      }
      if (const Value* x = arg(a, 3, "sort_keys")) o.sort_keys = x->truthy();
      try {
        return to_json(v, o);
      } catch (const TemplateRenderError& err) {
        fail(line, err.what());
      }
    }
    if (name == "string") return v.is_string() ? v : Value(to_str(v));
    if (name == "trim") {
      Value str = v.is_string() ? v : Value(to_str(v));
      auto [b, e] = pystr::strip_range(str.str(), optional_string(a, 0, "chars"), true, true);
      return substring(str, b, e);
    }
    if (name == "upper") return pystr::upper(to_str(v));
    if (name == "lower") return pystr::lower(to_str(v));
    if (name == "capitalize") return pystr::capitalize(to_str(v));
    if (name == "title") return pystr::title(to_str(v));
    if (name == "replace") {
      const Value* old_v = arg(a, 0, "old");
      const Value* new_v = arg(a, 1, "new");
      if (!old_v || !new_v) fail(line, "replace filter needs old and new strings");
      auto as_string = [](const Value& x) { return x.is_string() ? x : Value(to_str(x)); };
      return replace(as_string(v), as_string(*old_v), as_string(*new_v), int_arg(a, 2, "count", -1, line), line);
    }
    if (name == "default" || name == "d") {
      const Value* def = arg(a, 0, "default_value");
      const Value* boolean = arg(a, 1, "boolean");
      if (v.is_undefined() || (boolean && boolean->truthy() && !v.truthy())) return def ? *def : Value("");
      return v;
    }
    if (name == "length" || name == "count") {
      if (v.is_string()) return static_cast<int64_t>(pystr::length(v.str()));
      if (v.is_list()) return static_cast<int64_t>(v.list_data().items.size());
      if (v.is_dict()) return static_cast<int64_t>(v.dict_data().items.size());
      if (v.is_undefined()) return int64_t{0};
      fail(line, "object of type '" + v.type_name() + "' has no len()");
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::list();
      if (!v.is_dict()) fail(line, "items filter: expected a mapping, got " + v.type_name());
      return items_of(v);
    }
    if (name == "list") return Value::list(iterate(v, line));
    if (name == "first" || name == "last") {
      std::vector<Value> items = iterate(v, line);
      if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<Value> chars = iterate(v, line);
        MarkedText out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out.append(*it);
        return out.take();
      }
      std::vector<Value> items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "join") {
      const Value* sep_arg = arg(a, 0, "d");
      const Value sep = sep_arg && sep_arg->is_string() ? *sep_arg : Value(sep_arg ? to_str(*sep_arg) : std::string());
      const Value* attribute = arg(a, 1, "attribute");
      MarkedText out;
      bool first = true;
      for (const Value& x : iterate(v, line)) {
        if (!first) out.append(sep);
        first = false;
        out.append(attribute && !attribute->is_none() ? attribute_path(x, to_str(*attribute), line) : x);
        check_size(out.size(), line);
      }
      return out.take();
    }
    if (name == "int") {
      if (v.is_int()) return v;
      if (v.is_bool()) return as_int(v);
      if (v.is_float() && std::isfinite(std::get<double>(v.v)) && std::fabs(std::get<double>(v.v)) < 9e18)
        return static_cast<int64_t>(std::get<double>(v.v));
      if (v.is_string()) {
        std::string s = pystr::strip(v.str(), std::nullopt, true, true);
        try {
          size_t used = 0;
          long long x = std::stoll(s, &used, 10);
          if (used == s.size()) return static_cast<int64_t>(x);
        } catch (const std::exception&) {
        }
      }
      const Value* def = arg(a, 0, "default");
      return def ? *def : Value(int64_t{0});
    }
    if (name == "float") {
      if (v.is_float()) return v;
      if (v.is_int() || v.is_bool()) return v.as_double();
      if (v.is_string()) {
        std::string s = pystr::strip(v.str(), std::nullopt, true, true);
        char* end = nullptr;
        double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size()) return d;
      }
      const Value* def = arg(a, 0, "default");
      return def ? *def : Value(0.0);
    }
    if (name == "abs") {
      if (v.is_int() || v.is_bool()) {
        int64_t i = as_int(v);
        if (i == INT64_MIN) fail(line, "integer overflow");
        return i < 0 ? -i : i;
      }
      if (v.is_float()) return std::fabs(std::get<double>(v.v));
      fail(line, "bad operand type for abs(): '" + v.type_name() + "'");
    }
    if (name == "indent") {
      const Value* width = arg(a, 0, "width");
      std::string pad = width ? (width->is_string() ? width->str() : std::string(static_cast<size_t>(std::clamp<int64_t>(
                                                                                     int_arg(a, 0, "width", 4, line), 0, 256)),
                                                                                 ' '))
                              : std::string(4, ' ');
      const Value* first = arg(a, 1, "first");
      const Value* blank = arg(a, 2, "blank");
      std::vector<std::string> lines = pystr::split(to_str(v), std::string("\n"), -1);
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) out += '\n';
        bool indent = (i > 0 || (first && first->truthy())) && (!lines[i].empty() || (blank && blank->truthy()));
        if (indent) out += pad;
        out += lines[i];
      }
      return out;
    }
    if (name == "map") {
      std::vector<Value> out;
      if (const Value* attribute = a.kw("attribute")) {
        const Value* def = a.kw("default");
        for (const Value& x : iterate(v, line)) {
          Value got = attribute_path(x, to_str(*attribute), line);
          out.push_back(got.is_undefined() && def ? *def : got);
        }
        return Value::list(std::move(out));
      }
      if (a.positional.empty() || !a.positional[0].is_string()) fail(line, "map needs a filter name or attribute=");
      std::string filter = a.positional[0].str();
      if (!is_known_filter(filter) || filter == "map") fail(line, "map: unsupported filter '" + filter + "'");
      for (const Value& x : iterate(v, line)) {
        CallArgs rest;
        rest.positional.assign(a.positional.begin() + 1, a.positional.end());
        rest.keyword = a.keyword;
        out.push_back(apply_filter(filter, x, std::move(rest), line));
      }
      return Value::list(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr") {
      if (a.positional.empty()) fail(line, name + " needs an attribute name");
      const std::string attribute = to_str(a.positional[0]);
      std::vector<Value> out;
      for (const Value& x : iterate(v, line)) {
        Value got = attribute_path(x, attribute, line);
        bool ok;
        if (a.positional.size() < 2) {
          ok = got.truthy();
        } else {
          CallArgs rest;
          rest.positional.assign(a.positional.begin() + 2, a.positional.end());
          std::string test = to_str(a.positional[1]);
          if (!is_known_test(test)) fail(line, name + ": unsupported test '" + test + "'");
          ok = apply_test(test, got, std::move(rest), line);
        }
        if (ok == (name == "selectattr")) out.push_back(x);
      }
      return Value::list(std::move(out));
    }
    fail(line, "unsupported filter '" + name + "'");
  }

  // jinja2's attribute getter for map/selectattr/join: "a.b.0" looked up item by item.
  Value attribute_path(const Value& v, const std::string& path, int line) {
    Value cur = v;
    for (const std::string& part : pystr::split(path, std::string("."), -1)) {
      if (cur.is_undefined()) return cur;
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      cur = digits && cur.is_list() ? get_item(cur, Value(static_cast<int64_t>(std::stoll(part))), line)
                                    : get_item(cur, Value(part), line);
    }
    return cur;
  }

  // --- tests --------------------------------------------------------------------------------

  bool apply_test(const std::string& name, const Value& v, CallArgs&& a, int line) {
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    if (name == "sequence") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    if (name == "number") return v.is_int() || v.is_float() || v.is_bool();
    if (name == "integer") return v.is_int();
    if (name == "float") return v.is_float();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && std::get<bool>(v.v);
    if (name == "false") return v.is_bool() && !std::get<bool>(v.v);
    if (name == "callable") return v.is_callable();
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (!(v.is_int() || v.is_bool())) fail(line, "'" + name + "' test needs an integer");
      int64_t i = as_int(v);
      if (name == "odd") return i % 2 != 0;
      if (name == "even") return i % 2 == 0;
      int64_t d = int_arg(a, 0, "num", 0, line);
      if (d == 0) fail(line, "integer division or modulo by zero");
      return d == -1 || i % d == 0;
    }
    const Value* other = arg(a, 0, "other");
    if (!other) fail(line, "'" + name + "' test needs an argument");
    if (name == "eq" || name == "equalto") return equal(v, *other);
    if (name == "ne") return !equal(v, *other);
    if (name == "in") return contains(*other, v, line);
    if (name == "sameas") {
      if (v.v.index() != other->v.index()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.is_bool()) return std::get<bool>(v.v) == std::get<bool>(other->v);
      if (v.is_list()) return &v.list_data() == &other->list_data();
      if (v.is_dict() || v.is_namespace()) return &v.dict_data() == &other->dict_data();
      return equal(v, *other);
    }
    fail(line, "unsupported test '" + name + "'");
  }

  // --- globals ------------------------------------------------------------------------------

  // namespace(...) and dict(...): `out` (an empty namespace or dict) given the members of each
  // dict argument, then the keyword arguments, later ones replacing earlier ones; `fn` names the
  // global in the error for an argument that is not a dict.
  Value fill_members(Value out, CallArgs&& a, const char* fn) const {
    for (const Value& p : a.positional) {
      if (!p.is_dict()) fail(call_line_, std::string(fn) + "() takes a dict or keyword arguments");
      for (const auto& [k, v] : p.dict_data().items) out.dict_data().set(k, v);
    }
    for (auto& [k, v] : a.keyword) out.dict_data().set(k, std::move(v));
    return out;
  }

  void install_globals() {
    root_.vars["raise_exception"] = Value(make_function("raise_exception", [](Interpreter&, CallArgs&& a) -> Value {
      throw TemplateRaisedError(a.positional.empty() ? std::string() : to_str(a.positional[0]));
    }));
    root_.vars["namespace"] = Value(make_function("namespace", [](Interpreter& in, CallArgs&& a) {
      return in.fill_members(Value::make_namespace(), std::move(a), "namespace");
    }));
    root_.vars["dict"] = Value(make_function("dict", [](Interpreter& in, CallArgs&& a) {
      return in.fill_members(Value::dict(), std::move(a), "dict");
    }));
    root_.vars["range"] = Value(make_function("range", [](Interpreter& in, CallArgs&& a) {
      const int line = in.call_line_;
      std::vector<int64_t> n;
      for (const Value& x : a.positional) {
        if (!(x.is_int() || x.is_bool())) in.fail(line, "range() arguments must be integers");
        n.push_back(as_int(x));
      }
      if (n.empty() || n.size() > 3) in.fail(line, "range expected 1 to 3 arguments");
      int64_t start = n.size() == 1 ? 0 : n[0], stop = n.size() == 1 ? n[0] : n[1], step = n.size() == 3 ? n[2] : 1;
      if (step == 0) in.fail(line, "range() arg 3 must not be zero");
      std::vector<Value> out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= 1'000'000) in.fail(line, "range() too long (more than 1M items)");
        out.emplace_back(i);
      }
      return Value::list(std::move(out));
    }));
    root_.vars["strftime_now"] = Value(make_function("strftime_now", [](Interpreter& in, CallArgs&& a) {
      if (a.positional.empty() || !a.positional[0].is_string()) in.fail(in.call_line_, "strftime_now(format) needs a string");
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof buf, a.positional[0].str().c_str(), &tm);
      return std::string(buf, n);
    }));
  }

  Scope root_;
  int depth_ = 0;
  uint64_t steps_ = 0;
  int call_line_ = 0;
};

Template::Template(std::string_view source) : program_(std::make_unique<const Program>(parse(source))) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

RenderedText Template::render_marked(const Value& context) const {
  if (!context.is_dict()) throw TemplateRenderError("line 0: the template context must be a dict");
  Interpreter in(context);
  MarkedText out;
  in.run(program_->body, out);
  return {out.text(), out.trusted()};
}

std::string Template::render(const Value& context) const { return render_marked(context).text; }

std::string Template::render(const nlohmann::ordered_json& context) const { return render(from_json(context)); }

}  // namespace lily::jinja
