// Values of the chat-template engine (src/text/jinja): the Python objects a Jinja template sees
// under transformers (None, bool, int, float, str, list/tuple, dict, namespace, macros and
// bound methods, and jinja2's default Undefined), with Python's str(), repr(), json.dumps and
// comparison semantics. Lists, dicts and namespaces are shared by reference, as in Python.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"

namespace lily::jinja {

/// A template that cannot be parsed or uses a construct the engine does not support. The
/// message starts with "line N: " (1-based line of the template).
class TemplateSyntaxError : public Error {
 public:
  using Error::Error;
};

/// A failure while rendering (a type error, an undefined value used where jinja2 raises, a
/// limit). The message starts with "line N: ", except a ValueNestingError from converting the
/// JSON context (from_json), which has no line.
class TemplateRenderError : public Error {
 public:
  using Error::Error;
};

/// A value nested deeper than kMaxValueDepth, or a namespace that would hold itself: thrown
/// without a line by the walks of values (repr, json.dumps, ==, from_json); the renderer adds
/// the line of the statement.
class ValueNestingError : public TemplateRenderError {
 public:
  using TemplateRenderError::TemplateRenderError;
};

/// Most levels of lists, dicts and namespaces that printing, tojson, comparison and from_json
/// walk (as the renderer's own nesting limit): each level is a native stack frame, and a value
/// deeper than this is refused with ValueNestingError instead of overflowing the stack.
constexpr int kMaxValueDepth = 400;

/// `raise_exception(msg)` called by the template: what() is exactly the template's message
/// (the server answers it with a 400).
class TemplateRaisedError : public Error {
 public:
  using Error::Error;
};

struct Value;
class Interpreter;

/// Positional and keyword arguments of a call.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  /// The keyword argument `name`, or nullptr.
  const Value* kw(std::string_view name) const;
};

struct Function;

/// jinja2's default Undefined: falsy, renders empty, iterates as empty; `hint` is the message of
/// the error raised when it is used where jinja2 raises (attribute access, arithmetic).
struct Undefined {
  std::string hint;
};

struct ListData;
struct DictData;

/// Byte ranges [begin, end) of a string value that came from the template's own text (its
/// literals), sorted, disjoint and not adjacent. Everything else in a string came from the
/// context (message content, tools, ...): chat_template.cpp encodes only the template's own
/// text with control tokens. Propagated by concatenation, output, macros, block set,
/// trim/strip, slicing, split, replace, join and pass-through filters; any other operation
/// yields context text (the safe side: its markers stay plain text).
using TrustSpans = std::vector<std::pair<size_t, size_t>>;

/// One template value. Copies share lists, dicts and namespaces.
struct Value {
  using Storage = std::variant<Undefined, std::nullptr_t, bool, int64_t, double, std::string,
                               std::shared_ptr<ListData>, std::shared_ptr<DictData>,
                               std::shared_ptr<const Function>>;
  Storage v;
  std::shared_ptr<const TrustSpans> trust;  ///< strings only; nullptr: no template text

  Value() : v(Undefined{}) {}
  Value(std::nullptr_t) : v(nullptr) {}
  Value(bool b) : v(b) {}
  Value(int i) : v(static_cast<int64_t>(i)) {}
  Value(int64_t i) : v(i) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(std::shared_ptr<ListData> l) : v(std::move(l)) {}
  Value(std::shared_ptr<DictData> d) : v(std::move(d)) {}
  Value(std::shared_ptr<const Function> f) : v(std::move(f)) {}

  /// An Undefined carrying the error message for its misuse.
  static Value undefined(std::string hint) {
    Value out;
    out.v = Undefined{std::move(hint)};
    return out;
  }
  /// A new list (or tuple) value.
  static Value list(std::vector<Value> items = {}, bool tuple = false);
  /// A new empty dict value.
  static Value dict();
  /// A new namespace() object with these attributes.
  static Value make_namespace(std::vector<std::pair<std::string, Value>> attrs = {});

  bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  bool is_none() const { return std::holds_alternative<std::nullptr_t>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  /// int or float (not bool, unlike Python's Number: the engine follows jinja2 elsewhere).
  bool is_number() const { return is_int() || is_float(); }
  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<ListData>>(v); }
  /// A dict (a namespace is not a mapping, as in jinja2).
  bool is_dict() const;
  bool is_namespace() const;
  bool is_callable() const { return std::holds_alternative<std::shared_ptr<const Function>>(v); }

  const std::string& str() const { return std::get<std::string>(v); }
  ListData& list_data() const { return *std::get<std::shared_ptr<ListData>>(v); }
  /// The dict or namespace storage.
  DictData& dict_data() const { return *std::get<std::shared_ptr<DictData>>(v); }
  const Function& function() const { return *std::get<std::shared_ptr<const Function>>(v); }
  /// int, float or bool as a double.
  double as_double() const;

  /// Python truthiness (Undefined is false).
  bool truthy() const;
  /// jinja2's type name for messages: "str", "int", "list", "dict", "undefined", ...
  std::string type_name() const;
};

/// A macro, global function or bound method.
struct Function {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&&)> call;
  /// A bound method's object (also held by `call`), for the namespace cycle check; else Undefined.
  Value bound;
};

/// Elements of a list or tuple.
struct ListData {
  std::vector<Value> items;
  bool tuple = false;
  ListData() = default;
  ListData(const ListData&) = default;
  ListData& operator=(const ListData&) = default;
  /// Frees nested lists, dicts and functions one at a time (defer_release in value.cpp).
  ~ListData();
};

/// Entries of a dict or namespace, in insertion order (keys are strings).
struct DictData {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;
  DictData() = default;
  DictData(const DictData&) = default;
  DictData& operator=(const DictData&) = default;
  /// As ~ListData.
  ~DictData();
  /// The value of `key`, or nullptr.
  Value* find(std::string_view key);
  /// Sets `key` (replaces in place, else appends).
  void set(const std::string& key, Value value);
};

/// A string value whose bytes all came from the template's own text.
Value trusted_string(std::string s);

/// A string being built from pieces of known provenance (the renderer's output, concatenations).
class MarkedText {
 public:
  /// Appends a value: a string with its trust spans, anything else as to_str() (context text).
  void append(const Value& v);
  /// Appends raw text, all template text or all context text.
  void append(std::string_view s, bool trusted);
  /// Appends bytes [begin, end) of string value `v` with their trust spans.
  void append_range(const Value& v, size_t begin, size_t end);
  const std::string& text() const { return text_; }
  const TrustSpans& trusted() const { return trusted_; }
  size_t size() const { return text_.size(); }
  /// The string value built so far (the builder is left empty).
  Value take();

 private:
  void add_span(size_t begin, size_t end);
  std::string text_;
  TrustSpans trusted_;
};

/// Bytes [begin, end) of string value `v`, keeping their trust spans.
Value substring(const Value& v, size_t begin, size_t end);

/// Python str(value): "None", "True", repr of lists and dicts; Undefined is "". Throws
/// ValueNestingError for a value nested deeper than kMaxValueDepth (as to_repr, to_json, equal
/// and compare).
std::string to_str(const Value& v);
/// Python repr(value) (strings quoted as Python does).
std::string to_repr(const Value& v);
/// Python float repr: shortest round-trip digits, "1.0", "1e+16", "inf", "nan".
std::string float_repr(double d);

/// json.dumps options (transformers' tojson: ensure_ascii=False by default).
struct JsonOptions {
  int indent = -1;  ///< < 0: no newlines; else spaces per level (separators become "," and ": ")
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator;  ///< empty: the json.dumps default for `indent`
  std::string key_separator;   ///< empty: ": "
};
/// Python json.dumps of a value; throws TemplateRenderError (without a line) for an Undefined,
/// a namespace or a function (Python's TypeError), ValueNestingError for too deep a value.
std::string to_json(const Value& v, const JsonOptions& options = {});

/// Python ==, deep (a list or dict equals itself without a walk); Undefined equals only Undefined.
bool equal(const Value& a, const Value& b);
/// Python <: -1, 0, 1 for numbers, strings and lists; throws TemplateRenderError otherwise.
int compare(const Value& a, const Value& b);

/// Throws ValueNestingError if storing `value` in namespace `ns` would make a reference cycle
/// (`value` reaches `ns` through lists, dicts, namespaces or a bound method's object) or a
/// namespace nested deeper than kMaxValueDepth. Returns how many steps the walk of `value` took
/// (the renderer counts them against its step limit: a large value assigned in a loop is work).
uint64_t check_namespace_member(const Value& ns, const Value& value);

/// A JSON document as a template value: objects keep their member order (dicts), integers
/// stay ints, other numbers floats. Throws ValueNestingError for a document nested deeper than
/// kMaxValueDepth.
Value from_json(const nlohmann::ordered_json& j);
/// As above for a key-sorted nlohmann::json.
Value from_json(const nlohmann::json& j);

}  // namespace lily::jinja
