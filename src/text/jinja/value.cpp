// Template values: Python str/repr/json.dumps/== semantics (see value.h).
#include "text/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <new>
#include <unordered_map>
#include <unordered_set>

#include "text/jinja/pystr.h"
#include "text/utf8.h"

namespace lily::jinja {
namespace {

// `levels`: the lists, dicts and namespaces around the value being walked. A walk refuses to go
// deeper than kMaxValueDepth (one native stack frame a level).
void enter_level(int levels) {
  if (levels >= kMaxValueDepth)
    throw ValueNestingError("value nesting too deep (more than " + std::to_string(kMaxValueDepth) + " levels)");
}

bool is_container(const Value& v) { return v.is_list() || v.is_dict() || v.is_namespace(); }

template <typename Json>
Value from_json_impl(const Json& j, int levels) {
  if (j.is_structured()) enter_level(levels);
  switch (j.type()) {
    case nlohmann::json::value_t::null: return nullptr;
    case nlohmann::json::value_t::boolean: return j.template get<bool>();
    case nlohmann::json::value_t::number_integer: return j.template get<int64_t>();
    case nlohmann::json::value_t::number_unsigned: {
      auto u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(u);
      return static_cast<double>(u);
    }
    case nlohmann::json::value_t::number_float: return j.template get<double>();
    case nlohmann::json::value_t::string: return j.template get<std::string>();
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_impl(e, levels + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value d = Value::dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict_data().items.emplace_back(it.key(), from_json_impl(it.value(), levels + 1));
      return d;
    }
    default: return Value();  // binary / discarded: not produced by parsing JSON text
  }
}

// Python repr of a str: single quotes unless the text has ' and no ".
std::string repr_string(std::string_view s) {
  const char quote = (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(quote)) out += std::string("\\") + quote;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else if (c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(s[i + 1]) <= 0x9F) {
      char buf[8];  // C1 controls U+0080..U+009F are not printable
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(s[i + 1]) & 0xFF);
      out += buf;
      ++i;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; ++i; continue;
      case '\\': out += "\\\\"; ++i; continue;
      case '\n': out += "\\n"; ++i; continue;
      case '\r': out += "\\r"; ++i; continue;
      case '\t': out += "\\t"; ++i; continue;
      case '\b': out += "\\b"; ++i; continue;
      case '\f': out += "\\f"; ++i; continue;
      default: break;
    }
    char buf[16];
    if (c < 0x20) {
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
      ++i;
      continue;
    }
    if (c < 0x80 || !ensure_ascii) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    size_t len = utf8::valid_sequence_length(s.substr(i));
    if (len == 0) {  // an invalid byte: not representable in JSON; U+FFFD as Python's 'replace'
      out += "\\ufffd";
      ++i;
      continue;
    }
    std::string_view seq = s.substr(i, len);
    uint32_t cp = 0;
    auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(seq[k])); };
    if (len == 2) cp = ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    else if (len == 3) cp = ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    else cp = ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
    if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
    }
    out += buf;
    i += len;
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  if (v.is_none()) { out += "null"; return; }
  if (v.is_bool()) { out += std::get<bool>(v.v) ? "true" : "false"; return; }
  if (v.is_int()) { out += std::to_string(std::get<int64_t>(v.v)); return; }
  if (v.is_float()) {
    double d = std::get<double>(v.v);
    if (std::isnan(d)) out += "NaN";
    else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
    else out += float_repr(d);
    return;
  }
  if (v.is_string()) { json_string(out, v.str(), o.ensure_ascii); return; }
  enter_level(depth);
  const std::string item_sep = !o.item_separator.empty() ? o.item_separator : (o.indent >= 0 ? "," : ", ");
  const std::string key_sep = !o.key_separator.empty() ? o.key_separator : ": ";
  auto newline = [&](int level) {
    if (o.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(o.indent) * static_cast<size_t>(level), ' ');
  };
  if (v.is_list()) {
    const auto& items = v.list_data().items;
    if (items.empty()) { out += "[]"; return; }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += item_sep;
      newline(depth + 1);
      json_value(out, items[i], o, depth + 1);
    }
    newline(depth);
    out += ']';
    return;
  }
  if (v.is_dict()) {
    std::vector<const std::pair<std::string, Value>*> entries;
    for (const auto& e : v.dict_data().items) entries.push_back(&e);
    if (o.sort_keys) std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
    if (entries.empty()) { out += "{}"; return; }
    out += '{';
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i) out += item_sep;
      newline(depth + 1);
      json_string(out, entries[i]->first, o.ensure_ascii);
      out += key_sep;
      json_value(out, entries[i]->second, o, depth + 1);
    }
    newline(depth);
    out += '}';
    return;
  }
  throw TemplateRenderError("Object of type " + (v.is_undefined() ? std::string("Undefined") : v.type_name()) +
                            " is not JSON serializable");
}

std::string repr_value(const Value& v, int levels);

// The members of a dict or namespace as Python's repr writes them between the braces:
// "'k': v, 'k2': v2" in insertion order.
std::string repr_members(const DictData& d, int levels) {
  std::string out;
  for (const auto& [k, e] : d.items) {
    if (!out.empty()) out += ", ";
    out += repr_string(k) + ": " + repr_value(e, levels);
  }
  return out;
}

std::string repr_value(const Value& v, int levels) {
  if (is_container(v)) enter_level(levels);
  if (v.is_undefined()) return "Undefined";
  if (v.is_string()) return repr_string(v.str());
  if (v.is_list()) {
    const ListData& l = v.list_data();
    std::string out = l.tuple ? "(" : "[";
    for (size_t i = 0; i < l.items.size(); ++i) {
      if (i) out += ", ";
      out += repr_value(l.items[i], levels + 1);
    }
    if (l.tuple && l.items.size() == 1) out += ",";
    out += l.tuple ? ")" : "]";
    return out;
  }
  if (v.is_dict()) return "{" + repr_members(v.dict_data(), levels + 1) + "}";
  if (v.is_namespace()) return "<Namespace {" + repr_members(v.dict_data(), levels + 1) + "}>";
  return to_str(v);
}

bool equal_at(const Value& a, const Value& b, int levels) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  const bool a_num = a.is_number() || a.is_bool(), b_num = b.is_number() || b.is_bool();
  if (a_num || b_num) {
    if (!(a_num && b_num)) return false;
    if (!a.is_float() && !b.is_float()) {
      auto as_int = [](const Value& x) { return x.is_bool() ? int64_t{std::get<bool>(x.v)} : std::get<int64_t>(x.v); };
      return as_int(a) == as_int(b);
    }
    return a.as_double() == b.as_double();
  }
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_string() || b.is_string()) return a.is_string() && b.is_string() && a.str() == b.str();
  if (a.is_list() || b.is_list()) {
    if (!(a.is_list() && b.is_list())) return false;
    const auto &x = a.list_data(), &y = b.list_data();
    if (&x == &y) return true;  // Python's identity shortcut: no walk of a shared value
    enter_level(levels);
    if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i)
      if (!equal_at(x.items[i], y.items[i], levels + 1)) return false;
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    auto &x = a.dict_data(), &y = b.dict_data();
    if (&x == &y) return true;
    enter_level(levels);
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [k, e] : x.items) {
      const Value* other = y.find(k);
      if (!other || !equal_at(e, *other, levels + 1)) return false;
    }
    return true;
  }
  // Namespaces and functions: identity.
  if (a.v.index() != b.v.index()) return false;
  if (a.is_callable()) return &a.function() == &b.function();
  return &a.dict_data() == &b.dict_data();
}

int compare_at(const Value& a, const Value& b, int levels) {
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    if (!a.is_float() && !b.is_float() && a.is_int() && b.is_int()) {
      int64_t x = std::get<int64_t>(a.v), y = std::get<int64_t>(b.v);
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list()) {
    enter_level(levels);
    const auto &x = a.list_data().items, &y = b.list_data().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equal_at(x[i], y[i], levels + 1)) continue;
      return compare_at(x[i], y[i], levels + 1);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  throw TemplateRenderError("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

// Values whose last reference went while a list or dict was being freed. The outermost
// ~ListData/~DictData frees them one at a time in a loop, so a value nested 100,000 deep (a
// chain a namespace can grow without any single assignment being deep) is freed in constant
// stack instead of one destructor frame per level. Per thread: renders run on several.
// A value that outlives the queue (a static one, destroyed after the thread's thread_local
// objects at exit) is freed the plain, recursive way: `release_queue_gone` is trivially
// destructible, so it can still be read then.
thread_local bool release_queue_gone = false;
struct PendingRelease {
  std::vector<Value> values;
  bool draining = false;
  ~PendingRelease() { release_queue_gone = true; }
};
thread_local PendingRelease pending_release;

// Only a child this reference owns alone is queued (a shared one is not freed here at all). If
// the queue cannot grow, the child is left to be freed the plain way (a destructor must not throw).
template <typename T>
bool sole_owner(const Value& v) {
  const auto* p = std::get_if<std::shared_ptr<T>>(&v.v);
  return p && p->use_count() == 1;
}

void defer_release(Value& v) {
  if (release_queue_gone) return;
  if (sole_owner<ListData>(v) || sole_owner<DictData>(v) || sole_owner<const Function>(v)) {
    try {
      pending_release.values.push_back(std::move(v));
    } catch (const std::bad_alloc&) {
    }
  }
}

void drain_releases() {
  if (release_queue_gone || pending_release.draining) return;  // an outer destructor's loop frees what was deferred
  pending_release.draining = true;
  while (!pending_release.values.empty()) {
    Value last = std::move(pending_release.values.back());
    pending_release.values.pop_back();
  }  // `last` freed here: its own children are deferred, not freed recursively
  // A huge value's queue is not kept for the thread's life (a connection thread lives long).
  if (pending_release.values.capacity() > 4096) std::vector<Value>().swap(pending_release.values);
  pending_release.draining = false;
}

// The identity of a list, dict, namespace or function (nullptr for other values) and its i-th
// child value (nullptr past the last): the graph check_namespace_member walks.
const void* node_of(const Value& v) {
  if (auto* l = std::get_if<std::shared_ptr<ListData>>(&v.v)) return l->get();
  if (auto* d = std::get_if<std::shared_ptr<DictData>>(&v.v)) return d->get();
  if (auto* f = std::get_if<std::shared_ptr<const Function>>(&v.v)) return f->get();
  return nullptr;
}

const Value* child_of(const Value& v, size_t i) {
  if (v.is_list()) return i < v.list_data().items.size() ? &v.list_data().items[i] : nullptr;
  if (v.is_dict() || v.is_namespace()) return i < v.dict_data().items.size() ? &v.dict_data().items[i].second : nullptr;
  if (v.is_callable()) return i == 0 && !v.function().bound.is_undefined() ? &v.function().bound : nullptr;
  return nullptr;
}

}  // namespace

const Value* CallArgs::kw(std::string_view name) const {
  for (const auto& [k, v] : keyword)
    if (k == name) return &v;
  return nullptr;
}

Value Value::list(std::vector<Value> items, bool tuple) {
  auto d = std::make_shared<ListData>();
  d->items = std::move(items);
  d->tuple = tuple;
  return Value(std::move(d));
}

Value Value::dict() { return Value(std::make_shared<DictData>()); }

Value Value::make_namespace(std::vector<std::pair<std::string, Value>> attrs) {
  auto d = std::make_shared<DictData>();
  d->is_namespace = true;
  for (auto& [k, v] : attrs) d->set(k, std::move(v));
  return Value(std::move(d));
}

bool Value::is_dict() const {
  auto* p = std::get_if<std::shared_ptr<DictData>>(&v);
  return p && !(*p)->is_namespace;
}

bool Value::is_namespace() const {
  auto* p = std::get_if<std::shared_ptr<DictData>>(&v);
  return p && (*p)->is_namespace;
}

double Value::as_double() const {
  if (is_int()) return static_cast<double>(std::get<int64_t>(v));
  if (is_float()) return std::get<double>(v);
  if (is_bool()) return std::get<bool>(v) ? 1.0 : 0.0;
  return 0.0;
}

bool Value::truthy() const {
  return std::visit(
      [](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Undefined> || std::is_same_v<T, std::nullptr_t>) return false;
        else if constexpr (std::is_same_v<T, bool>) return x;
        else if constexpr (std::is_same_v<T, int64_t>) return x != 0;
        else if constexpr (std::is_same_v<T, double>) return x != 0.0;
        else if constexpr (std::is_same_v<T, std::string>) return !x.empty();
        else if constexpr (std::is_same_v<T, std::shared_ptr<ListData>>) return !x->items.empty();
        else if constexpr (std::is_same_v<T, std::shared_ptr<DictData>>) return x->is_namespace || !x->items.empty();
        else return true;
      },
      v);
}

std::string Value::type_name() const {
  if (is_undefined()) return "undefined";
  if (is_none()) return "NoneType";
  if (is_bool()) return "bool";
  if (is_int()) return "int";
  if (is_float()) return "float";
  if (is_string()) return "str";
  if (is_list()) return list_data().tuple ? "tuple" : "list";
  if (is_dict()) return "dict";
  if (is_namespace()) return "Namespace";
  return "function";
}

Value* DictData::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void DictData::set(const std::string& key, Value value) {
  if (Value* slot = find(key)) {
    *slot = std::move(value);
  } else {
    items.emplace_back(key, std::move(value));
  }
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e_pos = sci.find('e');
  std::string digits = sci.substr(0, e_pos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = std::stoi(sci.substr(e_pos + 1));
  if (exp >= -4 && exp < 16) {
    std::string out;
    if (exp >= 0) {
      std::string int_part = digits.substr(0, std::min(digits.size(), static_cast<size_t>(exp + 1)));
      while (int_part.size() < static_cast<size_t>(exp + 1)) int_part += '0';
      std::string frac = digits.size() > static_cast<size_t>(exp + 1) ? digits.substr(exp + 1) : "0";
      out = int_part + "." + frac;
    } else {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
    return sign + out;
  }
  std::string mantissa = digits.substr(0, 1);
  if (digits.size() > 1) mantissa += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  return sign + mantissa + ebuf;
}

std::string to_repr(const Value& v) { return repr_value(v, 0); }

std::string to_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_none()) return "None";
  if (v.is_bool()) return std::get<bool>(v.v) ? "True" : "False";
  if (v.is_int()) return std::to_string(std::get<int64_t>(v.v));
  if (v.is_float()) return float_repr(std::get<double>(v.v));
  if (v.is_string()) return v.str();
  if (v.is_callable()) return "<function " + v.function().name + ">";
  return to_repr(v);
}

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

bool equal(const Value& a, const Value& b) { return equal_at(a, b, 0); }

int compare(const Value& a, const Value& b) { return compare_at(a, b, 0); }

ListData::~ListData() {
  for (Value& v : items) defer_release(v);
  drain_releases();
}

DictData::~DictData() {
  for (auto& [k, v] : items) defer_release(v);
  drain_releases();
}

uint64_t check_namespace_member(const Value& ns, const Value& value) {
  const void* target = node_of(ns);
  if (!node_of(value)) return 0;  // a scalar or string: nothing to walk
  uint64_t visited = 0;
  // Iterative depth-first walk (the value may be too deep for recursion): `levels[n]` is the
  // longest chain of nodes from n down, known once all of n's children are done.
  std::unordered_map<const void*, int> levels;
  std::unordered_set<const void*> on_path;
  struct Frame {
    const Value* v;
    size_t next = 0;
    int deepest = 0;
  };
  std::vector<Frame> stack{{&value}};
  on_path.insert(node_of(value));
  if (node_of(value) == target) throw ValueNestingError("a namespace cannot hold itself (a reference cycle)");
  while (!stack.empty()) {
    ++visited;
    Frame& f = stack.back();
    if (const Value* c = child_of(*f.v, f.next++)) {
      const void* n = node_of(*c);
      if (!n) continue;
      if (n == target || on_path.count(n)) throw ValueNestingError("a namespace cannot hold itself (a reference cycle)");
      if (auto it = levels.find(n); it != levels.end()) {
        f.deepest = std::max(f.deepest, it->second);
        continue;
      }
      on_path.insert(n);
      stack.push_back({c});
      continue;
    }
    const void* n = node_of(*f.v);
    const int depth = f.deepest + 1;
    // The namespace adds one level above `value`.
    if (depth + 1 > kMaxValueDepth)
      throw ValueNestingError("value nesting too deep (more than " + std::to_string(kMaxValueDepth) + " levels)");
    levels[n] = depth;
    on_path.erase(n);
    stack.pop_back();
    if (!stack.empty()) stack.back().deepest = std::max(stack.back().deepest, depth);
  }
  return visited;
}

Value trusted_string(std::string s) {
  Value v(std::move(s));
  if (!v.str().empty()) v.trust = std::make_shared<const TrustSpans>(TrustSpans{{0, v.str().size()}});
  return v;
}

void MarkedText::add_span(size_t begin, size_t end) {
  if (begin >= end) return;
  if (!trusted_.empty() && trusted_.back().second == begin) {
    trusted_.back().second = end;
  } else {
    trusted_.emplace_back(begin, end);
  }
}

void MarkedText::append(std::string_view s, bool trusted) {
  const size_t at = text_.size();
  text_ += s;
  if (trusted) add_span(at, text_.size());
}

void MarkedText::append(const Value& v) {
  if (!v.is_string()) {
    append(to_str(v), false);
    return;
  }
  append_range(v, 0, v.str().size());
}

void MarkedText::append_range(const Value& v, size_t begin, size_t end) {
  const std::string& s = v.str();
  end = std::min(end, s.size());
  if (begin >= end) return;
  const size_t at = text_.size();
  text_.append(s, begin, end - begin);
  if (!v.trust) return;
  for (const auto& [b, e] : *v.trust) {
    const size_t lo = std::max(b, begin), hi = std::min(e, end);
    if (lo < hi) add_span(at + lo - begin, at + hi - begin);
  }
}

Value MarkedText::take() {
  Value v(std::move(text_));
  if (!trusted_.empty()) v.trust = std::make_shared<const TrustSpans>(std::move(trusted_));
  text_.clear();
  trusted_.clear();
  return v;
}

Value substring(const Value& v, size_t begin, size_t end) {
  if (!v.trust) return Value(v.str().substr(begin, end > begin ? end - begin : 0));
  MarkedText m;
  m.append_range(v, begin, end);
  return m.take();
}

Value from_json(const nlohmann::ordered_json& j) { return from_json_impl(j, 0); }
Value from_json(const nlohmann::json& j) { return from_json_impl(j, 0); }

}  // namespace lily::jinja
