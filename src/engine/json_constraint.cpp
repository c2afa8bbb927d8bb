#include "engine/json_constraint.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "base/error.h"
#include "engine/tokenizer_cache.h"
#include "text/tokenizer.h"

namespace lily {

using ordered_json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Schema compilation

namespace {

/// Keywords that annotate or bound values: accepted, not enforced.
const std::set<std::string, std::less<>>& ignored_keywords() {
  static const std::set<std::string, std::less<>> k = {
      "title", "description", "default", "examples", "$schema", "$id", "$comment", "format", "pattern",
      "minLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
      "minItems", "uniqueItems", "minProperties", "maxProperties", "deprecated", "readOnly",
      "writeOnly", "strict", "propertyOrdering", "contentEncoding", "contentMediaType", "nullable"};
  return k;
}

uint8_t type_bit(const std::string& name, const std::string& at) {
  if (name == "object") return JsonSchema::kObject;
  if (name == "array") return JsonSchema::kArray;
  if (name == "string") return JsonSchema::kString;
  if (name == "number") return JsonSchema::kNumber;
  if (name == "integer") return JsonSchema::kInteger;
  if (name == "boolean") return JsonSchema::kBoolean;
  if (name == "null") return JsonSchema::kNull;
  throw Error("unknown JSON schema type '" + name + "' at " + at);
}

/// The literal texts that a type-only branch of null or boolean stands for.
std::vector<std::string> literals_of_types(uint8_t types) {
  std::vector<std::string> out;
  if (types & JsonSchema::kBoolean) {
    out.push_back("true");
    out.push_back("false");
  }
  if (types & JsonSchema::kNull) out.push_back("null");
  return out;
}

}  // namespace

/// Compiles one schema document into a JsonSchema's nodes (see JsonSchema::compile).
class JsonSchemaCompiler {
 public:
  explicit JsonSchemaCompiler(const ordered_json& doc) : doc_(doc) { out_->nodes_.emplace_back(); }

  std::shared_ptr<JsonSchema> run() {
    int root = compile(doc_, "/");
    JsonSchema::Node r = out_->nodes_[static_cast<size_t>(root)];
    if (!(r.types & JsonSchema::kObject) || !r.literals.empty())
      throw Error("the JSON schema's root must be an object schema");
    r.types = JsonSchema::kObject;
    out_->nodes_.push_back(std::move(r));
    out_->root_ = static_cast<int>(out_->nodes_.size() - 1);
    depths();
    for (auto& n : out_->nodes_) sort_literals(n);
    const int need = out_->nodes_.back().min_depth;
    if (need >= kUnbounded)
      throw Error("the JSON schema has no finite instance: a required property recurses without end");
    if (need > static_cast<int>(kMaxJsonNesting))
      throw Error("the JSON schema needs more than " + std::to_string(kMaxJsonNesting) + " nested objects and arrays");
    return out_;
  }

 private:
  static constexpr int kUnbounded = 1 << 20;

  int add(JsonSchema::Node n) {
    out_->nodes_.push_back(std::move(n));
    return static_cast<int>(out_->nodes_.size() - 1);
  }

  /// Nesting of a JSON value's text: its deepest run of open containers.
  static int nesting_of(const std::string& text) {
    int depth = 0, deepest = 0;
    bool in_string = false, escaped = false;
    for (char c : text) {
      if (in_string) {
        if (escaped) escaped = false;
        else if (c == '\\') escaped = true;
        else if (c == '"') in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        deepest = std::max(deepest, ++depth);
      } else if (c == '}' || c == ']') {
        --depth;
      }
    }
    return deepest;
  }

  /// Node::literals sorted, duplicates dropped. Only once every node is final: anyOf branches,
  /// $ref targets and the root are copied into other nodes while compiling.
  static void sort_literals(JsonSchema::Node& n) {
    std::sort(n.literals.begin(), n.literals.end());
    n.literals.erase(std::unique(n.literals.begin(), n.literals.end()), n.literals.end());
  }

  /// Node::min_depth and object_depth of every node: a fixpoint from "unbounded" down, so that
  /// recursion through required properties stays unbounded.
  void depths() {
    auto& nodes = out_->nodes_;
    for (auto& n : nodes) n.min_depth = n.object_depth = kUnbounded;
    for (bool changed = true; changed;) {
      changed = false;
      for (auto& n : nodes) {
        int object = 1;
        for (size_t i = 0; i < n.property_nodes.size(); ++i)
          if (n.required >> i & 1)
            object = std::max(object, std::min(kUnbounded, 1 + nodes[static_cast<size_t>(n.property_nodes[i])].min_depth));
        int least = kUnbounded;
        if (!n.literals.empty()) {
          for (const std::string& l : n.literals) least = std::min(least, nesting_of(l));
        } else {
          if (n.types & (JsonSchema::kString | JsonSchema::kNumber | JsonSchema::kInteger | JsonSchema::kBoolean |
                         JsonSchema::kNull))
            least = 0;
          if (n.types & JsonSchema::kArray) least = std::min(least, 1);
          if (n.types & JsonSchema::kObject) least = std::min(least, object);
        }
        if (least != n.min_depth || object != n.object_depth) {
          n.min_depth = least;
          n.object_depth = object;
          changed = true;
        }
      }
    }
  }

  int compile(const ordered_json& s, const std::string& at) {
    if (++depth_ > 64) throw Error("the JSON schema nests deeper than 64 levels at " + at);
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    if (s.is_boolean()) {
      if (!s.get<bool>()) throw Error("the JSON schema 'false' (no value allowed) at " + at);
      return 0;
    }
    if (!s.is_object()) throw Error("a JSON schema must be an object or a boolean at " + at);
    if (s.contains("$ref")) {
      for (const auto& [k, v] : s.items())
        if (k != "$ref" && k != "$defs" && k != "definitions" && !ignored_keywords().count(k))
          throw Error("unsupported JSON schema keyword '" + k + "' beside '$ref' at " + at);
      return reference(s["$ref"], at);
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) return any_of(s, key, at);
    JsonSchema::Node n;
    bool no_literal_left = false;  // const outside enum: no value at all
    for (const auto& [key, value] : s.items()) {
      if (key == "type") {
        n.types = 0;
        if (value.is_string()) {
          n.types = type_bit(value.get<std::string>(), at);
        } else if (value.is_array() && !value.empty()) {
          for (const auto& t : value) {
            if (!t.is_string()) throw Error("'type' must name types at " + at);
            n.types |= type_bit(t.get<std::string>(), at);
          }
        } else {
          throw Error("'type' must be a type name or a list of them at " + at);
        }
      } else if (key == "enum") {
        if (!value.is_array() || value.empty()) throw Error("'enum' must be a non-empty list at " + at);
        if (s.contains("const")) continue;  // const beside enum: read with const, below
        for (const auto& v : value) n.literals.push_back(v.dump());
      } else if (key == "maxLength" || key == "maxItems") {
        if (!value.is_number_unsigned()) throw Error("'" + key + "' must be a non-negative integer at " + at);
        (key == "maxLength" ? n.max_length : n.max_items) = static_cast<int64_t>(value.get<uint64_t>());
      } else if (key == "const") {
        if (const_allowed_by_enum(s, at)) n.literals.push_back(value.dump());
        else no_literal_left = true;
      } else if (key == "items") {
        if (value.is_array()) throw Error("unsupported JSON schema keyword 'items' as a list (tuples) at " + at);
        n.items = compile(value, at + "items/");
      } else if (key == "additionalProperties") {
        if (value.is_boolean()) {
          n.additional = value.get<bool>();
        } else {
          n.additional_node = compile(value, at + "additionalProperties/");
        }
      } else if (key == "properties") {
        if (!value.is_object()) throw Error("'properties' must be an object at " + at);
        if (value.size() > kMaxSchemaProperties)
          throw Error("an object schema lists more than " + std::to_string(kMaxSchemaProperties) +
                      " properties at " + at);
        for (const auto& [name, sub] : value.items()) {
          if (name.find_first_of("\"\\") != std::string::npos || std::any_of(name.begin(), name.end(), [](char c) {
                return static_cast<unsigned char>(c) < 0x20;
              }))
            throw Error("the property name " + ordered_json(name).dump() +
                        " needs escaping in JSON, which the constraint does not write, at " + at);
          n.property_names.push_back(name);
          n.property_nodes.push_back(compile(sub, at + "properties/" + name + "/"));
        }
      } else if (key == "required" || key == "$defs" || key == "definitions") {
        // required: read below, once the properties are known; $defs: compiled when referenced.
      } else if (!ignored_keywords().count(key)) {
        throw Error("unsupported JSON schema keyword '" + key + "' at " + at);
      }
    }
    if (s.contains("required")) {
      const ordered_json& req = s["required"];
      if (!req.is_array()) throw Error("'required' must be a list of property names at " + at);
      for (const auto& r : req) {
        if (!r.is_string()) throw Error("'required' must be a list of property names at " + at);
        const auto it = std::find(n.property_names.begin(), n.property_names.end(), r.get<std::string>());
        if (it == n.property_names.end())
          throw Error("the required property '" + r.get<std::string>() + "' is not among the properties at " + at);
        n.required |= uint64_t{1} << (it - n.property_names.begin());
      }
    }
    if (no_literal_left) throw Error("the 'const' value is not in the 'enum' at " + at);
    if (!n.literals.empty()) keep_satisfying_literals(n, at);
    return add(std::move(n));
  }

  /// The type bits a JSON value has (an integral number is an integer and a number).
  template <class Json>
  static uint8_t literal_type(const Json& v) {
    if (v.is_object()) return JsonSchema::kObject;
    if (v.is_array()) return JsonSchema::kArray;
    if (v.is_string()) return JsonSchema::kString;
    if (v.is_boolean()) return JsonSchema::kBoolean;
    if (v.is_null()) return JsonSchema::kNull;
    if (v.is_number_integer()) return JsonSchema::kInteger | JsonSchema::kNumber;
    const double d = v.template get<double>();
    if (d == std::trunc(d)) return JsonSchema::kInteger | JsonSchema::kNumber;
    return JsonSchema::kNumber;
  }

  /// const beside enum: true when the const value is one of the enum's (as JSON values: key
  /// order and 1 versus 1.0 do not matter). Checks the enum's shape, as its own branch would.
  static bool const_allowed_by_enum(const ordered_json& s, const std::string& at) {
    if (!s.contains("enum")) return true;
    const ordered_json& values = s["enum"];
    if (!values.is_array() || values.empty()) throw Error("'enum' must be a non-empty list at " + at);
    const nlohmann::json wanted = nlohmann::json::parse(s["const"].dump());
    return std::any_of(values.begin(), values.end(),
                       [&](const ordered_json& v) { return nlohmann::json::parse(v.dump()) == wanted; });
  }

  /// Characters of a UTF-8 string (JSON's maxLength counts code points).
  static int64_t utf8_chars(const std::string& text) {
    return std::count_if(text.begin(), text.end(),
                         [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  }

  /// True when `v` is a value of node `index` (its literals, when it has them, included).
  bool satisfies(const nlohmann::json& v, int index) const {
    const JsonSchema::Node& n = out_->nodes_[static_cast<size_t>(index)];
    if (!n.literals.empty() && !parsed_literals(index).contains(v)) return false;
    return satisfies_keywords(v, n);
  }

  /// Node `index`'s literals as JSON values, parsed on the first call and kept (a schema checks
  /// thousands of values against one enum). Ordered by JSON's operator<, under which 1 and 1.0
  /// are one value and objects compare whatever their key order, as JSON equality does.
  const std::set<nlohmann::json>& parsed_literals(int index) const {
    auto [it, fresh] = parsed_.try_emplace(index);
    if (fresh)
      for (const std::string& l : out_->nodes_[static_cast<size_t>(index)].literals)
        it->second.insert(nlohmann::json::parse(l));
    return it->second;
  }

  /// True when `v` satisfies the node's keywords other than enum/const: type, maxLength,
  /// maxItems, items, properties, required and additionalProperties (nested schemas in full).
  bool satisfies_keywords(const nlohmann::json& v, const JsonSchema::Node& n) const {
    if (!(literal_type(v) & n.types)) return false;
    if (v.is_string()) return n.max_length < 0 || utf8_chars(v.get<std::string>()) <= n.max_length;
    if (v.is_array()) {
      if (n.max_items >= 0 && static_cast<int64_t>(v.size()) > n.max_items) return false;
      return std::all_of(v.begin(), v.end(), [&](const nlohmann::json& item) { return satisfies(item, n.items); });
    }
    if (!v.is_object()) return true;
    for (size_t i = 0; i < n.property_names.size(); ++i)
      if ((n.required >> i & 1) && !v.contains(n.property_names[i])) return false;
    for (const auto& [key, value] : v.items()) {
      const auto it = std::find(n.property_names.begin(), n.property_names.end(), key);
      if (it != n.property_names.end()) {
        if (!satisfies(value, n.property_nodes[static_cast<size_t>(it - n.property_names.begin())])) return false;
      } else if (!n.additional || !satisfies(value, n.additional_node)) {
        return false;
      }
    }
    return true;
  }

  /// enum/const: only the values that satisfy the schema's other keywords stay, so the matcher
  /// never offers one the schema refuses (none left: the schema has no instance, an error).
  void keep_satisfying_literals(JsonSchema::Node& n, const std::string& at) const {
    std::vector<std::string> kept;
    for (const std::string& l : n.literals)
      if (satisfies_keywords(nlohmann::json::parse(l), n)) kept.push_back(l);
    if (kept.empty()) throw Error("no value of 'enum'/'const' satisfies the rest of the schema at " + at);
    n.literals = std::move(kept);
  }

  int reference(const ordered_json& ref, const std::string& at) {
    if (!ref.is_string()) throw Error("'$ref' must be a string at " + at);
    const std::string r = ref.get<std::string>();
    if (const auto it = refs_.find(r); it != refs_.end()) return it->second;
    const ordered_json* target = nullptr;
    for (const char* defs : {"#/$defs/", "#/definitions/"}) {
      const std::string prefix = defs;
      if (r.starts_with(prefix)) {
        const std::string name = unescape_pointer(r.substr(prefix.size()));
        const std::string key = prefix.substr(2, prefix.size() - 3);
        if (doc_.contains(key) && doc_[key].is_object() && doc_[key].contains(name)) target = &doc_[key][name];
      }
    }
    if (r == "#") target = &doc_;
    if (target == nullptr) throw Error("unsupported or unresolved '$ref' " + ordered_json(r).dump() + " at " + at);
    // A placeholder first, so that a recursive reference finds its node (a property or item may
    // point at it); a chain of $refs that comes back to it with no schema between has none.
    const int slot = add(JsonSchema::Node{});
    refs_[r] = slot;
    pending_.insert(slot);
    const int compiled = compile(*target, r.substr(1) + "/");
    if (pending_.count(compiled))
      throw Error("the $ref " + ordered_json(r).dump() + " at " + at + " comes back to itself with no schema between");
    out_->nodes_[static_cast<size_t>(slot)] = out_->nodes_[static_cast<size_t>(compiled)];
    pending_.erase(slot);
    return slot;
  }

  // Branches of different JSON types merge into one node: each type from at most one branch.
  int any_of(const ordered_json& s, const char* key, const std::string& at) {
    const ordered_json& branches = s[key];
    if (!branches.is_array() || branches.empty()) throw Error(std::string("'") + key + "' must be a non-empty list at " + at);
    for (const auto& [k, v] : s.items())
      if (k != key && k != "$defs" && k != "definitions" && k != "type" && !ignored_keywords().count(k))
        throw Error(std::string("unsupported JSON schema keyword '") + k + "' beside '" + key + "' at " + at);
    JsonSchema::Node merged;
    merged.types = 0;
    bool literal_branch = false;
    const bool one_of = std::string(key) == "oneOf";
    uint8_t taken = 0;  // oneOf: the types the branches so far take (integer and number overlap)
    for (size_t i = 0; i < branches.size(); ++i) {
      const std::string why = std::string("unsupported '") + key + "' at " + at + ": ";
      const int index = compile(branches[i], at + key + "/" + std::to_string(i) + "/");
      if (pending_.count(index)) throw Error(why + "a branch is the schema it is in");
      const JsonSchema::Node b = out_->nodes_[static_cast<size_t>(index)];
      if (one_of) {
        uint8_t footprint = b.literals.empty() ? b.types : 0;
        for (const std::string& l : b.literals) footprint |= literal_type(ordered_json::parse(l));
        if (footprint & (JsonSchema::kNumber | JsonSchema::kInteger)) footprint |= JsonSchema::kNumber | JsonSchema::kInteger;
        if (footprint & taken) throw Error(why + "two branches take values of the same type, which 'oneOf' would refuse");
        taken |= footprint;
      }
      if (!b.literals.empty()) {
        literal_branch = true;
        merged.literals.insert(merged.literals.end(), b.literals.begin(), b.literals.end());
        continue;
      }
      const uint8_t structural = JsonSchema::kObject | JsonSchema::kArray;
      if (merged.types & b.types & structural) throw Error(why + "two branches take the same container type");
      if (b.types & JsonSchema::kObject) {
        merged.property_names = b.property_names;
        merged.property_nodes = b.property_nodes;
        merged.required = b.required;
        merged.additional = b.additional;
        merged.additional_node = b.additional_node;
      }
      if (b.types & JsonSchema::kArray) {
        merged.items = b.items;
        merged.max_items = b.max_items;
      }
      if (b.types & JsonSchema::kString) merged.max_length = b.max_length;
      merged.types |= b.types;
    }
    if (literal_branch) {
      // Literals merge with type-only branches of null and booleans, which are literals too.
      if (merged.types & ~(JsonSchema::kNull | JsonSchema::kBoolean))
        throw Error(std::string("unsupported '") + key + "' at " + at + ": enum values beside other types");
      for (std::string& l : literals_of_types(merged.types)) merged.literals.push_back(std::move(l));
    }
    if (s.contains("type")) {  // type beside anyOf/oneOf: both hold
      uint8_t mask = 0;
      const ordered_json& t = s["type"];
      if (t.is_string()) mask = type_bit(t.get<std::string>(), at);
      else if (t.is_array()) for (const auto& x : t) mask |= x.is_string() ? type_bit(x.get<std::string>(), at) : 0;
      if (mask == 0) throw Error("'type' must be a type name or a list of them at " + at);
      if (mask & JsonSchema::kNumber) mask |= JsonSchema::kInteger;
      if (!merged.literals.empty()) {
        merged.types = mask;
        keep_satisfying_literals(merged, at);
      } else {
        merged.types &= mask;
        if (merged.types == 0) throw Error("no branch of '" + std::string(key) + "' has the schema's 'type' at " + at);
      }
    }
    return add(std::move(merged));
  }

  const ordered_json& doc_;
  std::shared_ptr<JsonSchema> out_ = std::make_shared<JsonSchema>();
  std::map<std::string, int> refs_;
  std::set<int> pending_;  ///< $ref placeholders still being compiled
  /// parsed_literals, by node. A node is not changed once added, but for a $ref placeholder,
  /// which has no literals until then (so none parsed).
  mutable std::map<int, std::set<nlohmann::json>> parsed_;
  int depth_ = 0;

  /// A JSON pointer segment of a URI fragment: %XX decoded, then ~1 and ~0 undone.
  static std::string unescape_pointer(const std::string& raw) {
    std::string s;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '%' && i + 2 < raw.size() && std::isxdigit(static_cast<unsigned char>(raw[i + 1])) &&
          std::isxdigit(static_cast<unsigned char>(raw[i + 2]))) {
        s += static_cast<char>(std::stoi(raw.substr(i + 1, 2), nullptr, 16));
        i += 2;
      } else {
        s += raw[i];
      }
    }
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '~' && i + 1 < s.size() && (s[i + 1] == '0' || s[i + 1] == '1')) {
        out += s[i + 1] == '0' ? '~' : '/';
        ++i;
      } else {
        out += s[i];
      }
    }
    return out;
  }
};

std::shared_ptr<const JsonSchema> JsonSchema::compile(const nlohmann::json& schema) {
  const ordered_json doc = ordered_json::parse(schema.dump());
  return JsonSchemaCompiler(doc).run();
}

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  static const std::shared_ptr<const JsonSchema> s = compile(nlohmann::json{{"type", "object"}});
  return s;
}

// ---------------------------------------------------------------------------------------------
// The matcher

namespace {

bool is_ws(unsigned char b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }
bool is_digit(unsigned char b) { return b >= '0' && b <= '9'; }

/// true/false/null as a literal set (sorted, as JsonSchema::Node::literals).
const std::vector<std::string>& bool_null_literals(uint8_t set) {
  static const std::vector<std::string> t = {"false", "true"}, n = {"null"}, all = {"false", "null", "true"};
  if (set == JsonSchema::kBoolean) return t;
  if (set == JsonSchema::kNull) return n;
  return all;
}

/// Whether `literal` sorts before `prefix` followed by `byte`, in std::string's (unsigned) byte
/// order, without building that text.
bool sorts_before(std::string_view literal, std::string_view prefix, unsigned char byte) {
  const std::string_view head = literal.substr(0, prefix.size());
  if (head != prefix) return head < prefix;
  return literal.size() == prefix.size() || static_cast<unsigned char>(literal[prefix.size()]) < byte;
}

/// Whether a literal of `sorted` (Node::literals) begins with `prefix` followed by `byte`: those
/// that do come first among the literals not before that text.
bool continues_literal(const std::vector<std::string>& sorted, std::string_view prefix, unsigned char byte) {
  const auto it = std::lower_bound(sorted.begin(), sorted.end(), byte, [prefix](const std::string& l, unsigned char b) {
    return sorts_before(l, prefix, b);
  });
  return it != sorted.end() && it->size() > prefix.size() && static_cast<unsigned char>((*it)[prefix.size()]) == byte &&
         std::string_view(*it).starts_with(prefix);
}

/// Whether `text` is one of `sorted`'s literals.
bool is_literal(const std::vector<std::string>& sorted, std::string_view text) {
  return std::binary_search(sorted.begin(), sorted.end(), text, std::less<std::string_view>());
}

// Number grammar states (kNumber frames).
enum NumberState : uint8_t { kSign, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits };
bool number_can_end(uint8_t s) { return s == kZero || s == kInt || s == kFrac || s == kExpDigits; }

}  // namespace

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonSchema> schema) : schema_(std::move(schema)) {
  Frame root;
  root.kind = Frame::kValue;
  root.node = schema_->root();
  stack_.push_back(std::move(root));
}

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonSchema> schema, int node) : schema_(std::move(schema)) {
  Frame root;
  root.kind = Frame::kValue;
  root.node = node;
  stack_.push_back(std::move(root));
}

bool JsonMatcher::can_end() const {
  if (stack_.empty()) return true;
  if (stack_.size() != 1) return false;
  const Frame& f = stack_.back();
  if (f.kind == Frame::kNumber) return number_can_end(f.state);
  return f.kind == Frame::kLiteral && is_literal(literals_of(f), f.text);
}

bool JsonMatcher::in_free_text() const {
  if (stack_.empty()) return false;
  const Frame& f = stack_.back();
  if (f.utf8.need != 0) return false;
  if (f.kind == Frame::kString) return f.state == 0 && schema_->node(f.node).max_length < 0;
  return f.kind == Frame::kKey && key_available(stack_[stack_.size() - 2], -1);
}

bool JsonMatcher::fits(int node) const {
  return containers() + static_cast<size_t>(schema_->node(node).min_depth) <= kMaxJsonNesting;
}

bool JsonMatcher::key_available(const Frame& object, int property) const {
  const JsonSchema::Node& n = schema_->node(object.node);
  if (property < 0) return n.additional && fits(n.additional_node);
  return !(object.seen >> property & 1) && fits(n.property_nodes[static_cast<size_t>(property)]);
}

bool JsonMatcher::any_key_available(const Frame& object) const {
  const size_t count = schema_->node(object.node).property_names.size();
  for (size_t i = 0; i < count; ++i)
    if (key_available(object, static_cast<int>(i))) return true;
  return key_available(object, -1);
}

bool JsonMatcher::item_available(const Frame& array) const {
  const JsonSchema::Node& n = schema_->node(array.node);
  return (n.max_items < 0 || array.count < n.max_items) && fits(n.items);
}

bool Utf8Check::step(unsigned char byte) {
  if (need > 0) {
    if (byte < lo || byte > hi) return false;
    --need;
    lo = 0x80;
    hi = 0xBF;
    return true;
  }
  if (byte < 0x80) return true;
  if (byte >= 0xC2 && byte <= 0xDF) {
    need = 1;
  } else if (byte >= 0xE0 && byte <= 0xEF) {
    need = 2;
    if (byte == 0xE0) lo = 0xA0;
    if (byte == 0xED) hi = 0x9F;
  } else if (byte >= 0xF0 && byte <= 0xF4) {
    need = 3;
    if (byte == 0xF0) lo = 0x90;
    if (byte == 0xF4) hi = 0x8F;
  } else {
    return false;
  }
  return true;
}

bool JsonMatcher::feed(std::string_view bytes) {
  for (char c : bytes)
    if (!feed(static_cast<unsigned char>(c))) return false;
  return true;
}

bool JsonMatcher::whitespace(unsigned char byte) {
  if (!is_ws(byte)) return false;
  took_whitespace_ = true;
  const bool blank = byte == ' ' || byte == '\t';
  switch (ws_run_) {
    case Run::kNone:
      ws_run_ = blank ? Run::kBlank : byte == '\r' ? Run::kReturn : Run::kLine;
      return true;
    case Run::kReturn:
      if (byte != '\n') return false;
      ws_run_ = Run::kLine;
      return true;
    case Run::kLine:
      return blank && static_cast<size_t>(++ws_indent_) <= kMaxIndentPerLevel * containers();
    case Run::kBlank:
      return false;
  }
  return false;
}

const std::vector<std::string>& JsonMatcher::literals_of(const Frame& f) const {
  if (f.literal_set != 0) return bool_null_literals(f.literal_set);
  return schema_->node(f.node).literals;
}

// A literal frame takes `byte`: true when the literal so far plus the byte begins one of the
// allowed literals; `done` when instead the literal so far is complete and the byte belongs to
// what follows. Both by binary search, with no text built: the mask tries a byte per trie branch,
// hundreds per step, and enums may hold thousands of values.
bool JsonMatcher::literal_step(Frame& f, unsigned char byte, bool& done) const {
  const auto& literals = literals_of(f);
  if (continues_literal(literals, f.text, byte)) {
    done = false;
    f.text.push_back(static_cast<char>(byte));
    return true;
  }
  done = is_literal(literals, f.text);
  return false;
}

bool JsonMatcher::start_value(Frame& f, unsigned char byte) {
  const JsonSchema::Node& n = schema_->node(f.node);
  if (!n.literals.empty()) {
    if (!continues_literal(n.literals, {}, byte)) return false;
    f.kind = Frame::kLiteral;
    f.literal_set = 0;
    f.text.assign(1, static_cast<char>(byte));
    return true;
  }
  // A container opens only when its smallest value closes within the nesting limit.
  const size_t open = containers();
  if (byte == '{' && (n.types & JsonSchema::kObject) && open + static_cast<size_t>(n.object_depth) <= kMaxJsonNesting) {
    f.kind = Frame::kObject;
    f.state = 0;
    ++open_;
    return true;
  }
  if (byte == '[' && (n.types & JsonSchema::kArray) && open + 1 <= kMaxJsonNesting) {
    f.kind = Frame::kArray;
    f.state = 0;
    ++open_;
    return true;
  }
  if (byte == '"' && (n.types & JsonSchema::kString)) {
    f.kind = Frame::kString;
    f.state = 0;
    return true;
  }
  if ((byte == '-' || is_digit(byte)) && (n.types & (JsonSchema::kNumber | JsonSchema::kInteger))) {
    f.kind = Frame::kNumber;
    f.state = byte == '-' ? kSign : byte == '0' ? kZero : kInt;
    f.text = std::string(1, static_cast<char>(byte));  // only its length matters
    return true;
  }
  const uint8_t set = n.types & (JsonSchema::kBoolean | JsonSchema::kNull);
  if (set != 0 && (byte == 't' || byte == 'f' || byte == 'n')) {
    f.kind = Frame::kLiteral;
    f.literal_set = set;
    f.text.clear();
    bool done = false;
    return literal_step(f, byte, done);
  }
  return false;
}

bool JsonMatcher::feed(unsigned char byte) {
  if (stack_.empty()) return false;  // the document is complete
  took_whitespace_ = false;
  const bool ok = feed_top(byte);
  if (!took_whitespace_) {  // a run is whitespace between tokens only
    ws_run_ = Run::kNone;
    ws_indent_ = 0;
  }
  return ok;
}

bool JsonMatcher::feed_top(unsigned char byte) {
  while (true) {
    if (stack_.empty()) return false;
    Frame& f = stack_.back();
    switch (f.kind) {
      case Frame::kValue:
        if (whitespace(byte)) return true;
        return start_value(f, byte);
      case Frame::kString:
        if (f.state == 0) {
          if (f.utf8.need > 0) return f.utf8.step(byte);  // inside a character
          if (byte == '"') {
            stack_.pop_back();
            return true;
          }
          if (byte < 0x20 || !f.utf8.step(byte)) return false;
          // A character starts here (an escape counts as one).
          const int64_t max = schema_->node(f.node).max_length;
          if (max >= 0 && ++f.count > max) return false;
          if (byte == '\\') f.state = 1;
          return true;
        }
        if (f.state == 1) {
          if (byte == 'u') {
            f.state = 2;
            return true;
          }
          if (std::string_view("\"\\/bfnrt").find(static_cast<char>(byte)) == std::string_view::npos) return false;
          f.state = 0;
          return true;
        }
        if (f.state == 6 || f.state == 7) {  // after a high surrogate: its low one, "\\u…"
          if (byte != (f.state == 6 ? '\\' : 'u')) return false;
          if (f.state == 7) f.low_phase = true;
          f.state = f.state == 6 ? 7 : 2;
          return true;
        }
        {  // \u: four hex digits (states 2 … 5); surrogates only as a high one then a low one
          if (!std::isxdigit(byte)) return false;
          const char h = static_cast<char>(std::tolower(byte));
          if (f.state == 2) {
            if (f.low_phase && h != 'd') return false;
            f.hex_first = h;
          } else if (f.state == 3 && f.hex_first == 'd') {
            const bool low = h >= 'c' && h <= 'f';
            const bool high = h >= '8' && h <= 'b';
            if (f.low_phase != low) return false;  // a lone low surrogate, or no low one after a high
            f.high_surrogate = high;
          } else if (f.state == 3 && f.low_phase) {
            return false;
          }
          if (f.state < 5) {
            ++f.state;
          } else {
            f.state = f.high_surrogate ? 6 : 0;
            f.high_surrogate = false;
            f.low_phase = false;
          }
          return true;
        }
      case Frame::kNumber: {
        const bool integer = !(schema_->node(f.node).types & JsonSchema::kNumber);
        uint8_t next = 0xff;
        switch (f.state) {
          case kSign: next = byte == '0' ? kZero : is_digit(byte) ? kInt : 0xff; break;
          case kZero: next = byte == '.' ? kDot : (byte == 'e' || byte == 'E') ? kExp : 0xff; break;
          case kInt: next = is_digit(byte) ? kInt : byte == '.' ? kDot : (byte == 'e' || byte == 'E') ? kExp : 0xff; break;
          case kDot: next = is_digit(byte) ? kFrac : 0xff; break;
          case kFrac: next = is_digit(byte) ? kFrac : (byte == 'e' || byte == 'E') ? kExp : 0xff; break;
          case kExp: next = (byte == '+' || byte == '-') ? kExpSign : is_digit(byte) ? kExpDigits : 0xff; break;
          case kExpSign:
          case kExpDigits: next = is_digit(byte) ? kExpDigits : 0xff; break;
        }
        if (integer && (next == kDot || next == kExp)) next = 0xff;
        if (next == kExpDigits && ++f.count > kMaxExponentDigits) return false;
        if (next != 0xff) {
          // Room for the byte and for what the number then needs to end (a digit after a sign,
          // a point or an exponent mark).
          const size_t needs = (next == kSign || next == kDot || next == kExp || next == kExpSign) ? 1 : 0;
          if (f.text.size() + 1 + needs > static_cast<size_t>(kMaxNumberBytes)) return false;
          f.state = next;
          f.text.push_back(static_cast<char>(byte));
          return true;
        }
        if (!number_can_end(f.state)) return false;
        stack_.pop_back();  // the number ended; the byte belongs to its container
        continue;
      }
      case Frame::kLiteral: {
        bool done = false;
        if (literal_step(f, byte, done)) {
          return true;
        }
        if (!done) return false;
        stack_.pop_back();
        continue;
      }
      case Frame::kKey: {
        const Frame& object = stack_[stack_.size() - 2];
        const JsonSchema::Node& n = schema_->node(object.node);
        if (byte == '"' && f.utf8.need == 0) {
          int prop = -1;
          for (size_t i = 0; i < n.property_names.size(); ++i)
            if (n.property_names[i] == f.text) prop = static_cast<int>(i);
          // A declared key once (and only when its value fits), another key when allowed, once.
          if (!key_available(object, prop)) return false;
          if (prop < 0 && std::find(object.keys.begin(), object.keys.end(), f.text) != object.keys.end()) return false;
          std::string key = std::move(f.text);
          stack_.pop_back();
          Frame& o = stack_.back();
          o.key = prop;
          o.state = 1;
          if (prop < 0) o.keys.push_back(std::move(key));
          return true;
        }
        if (byte < 0x20 || byte == '\\' || byte == '"' || !f.utf8.step(byte)) return false;
        f.text.push_back(static_cast<char>(byte));
        if (key_available(object, -1)) return true;
        for (size_t i = 0; i < n.property_names.size(); ++i)
          if (key_available(object, static_cast<int>(i)) && n.property_names[i].starts_with(f.text)) return true;
        return false;
      }
      case Frame::kObject: {
        const JsonSchema::Node& n = schema_->node(f.node);
        if (whitespace(byte)) return true;
        const bool all_required = (f.seen & n.required) == n.required;
        if (f.state == 0 || f.state == 3) {
          if (byte == '}' && f.state == 0 && all_required) {
            stack_.pop_back();
            --open_;
            return true;
          }
          if (byte != '"' || !any_key_available(f)) return false;
          Frame key;
          key.kind = Frame::kKey;
          key.node = f.node;
          stack_.push_back(std::move(key));
          return true;
        }
        if (f.state == 1) {
          if (byte != ':') return false;
          Frame value;
          value.kind = Frame::kValue;
          value.node = f.key >= 0 ? n.property_nodes[static_cast<size_t>(f.key)] : n.additional_node;
          if (f.key >= 0) f.seen |= uint64_t{1} << f.key;
          f.state = 2;
          stack_.push_back(std::move(value));
          return true;
        }
        // After a value: ',' while another key may come, '}' once the required ones are there.
        if (byte == '}' && all_required) {
          stack_.pop_back();
          --open_;
          return true;
        }
        if (byte == ',' && any_key_available(f)) {
          f.state = 3;
          return true;
        }
        return false;
      }
      case Frame::kArray: {
        const int items = schema_->node(f.node).items;
        if (whitespace(byte)) return true;
        if (f.state == 2) {
          if (byte == ']') {
            stack_.pop_back();
            --open_;
            return true;
          }
          if (byte != ',' || !item_available(f)) return false;
          f.state = 3;
          return true;
        }
        if (byte == ']' && f.state == 0) {
          stack_.pop_back();
          --open_;
          return true;
        }
        if (!item_available(f)) return false;
        ++f.count;
        f.state = 2;
        Frame value;
        value.kind = Frame::kValue;
        value.node = items;
        stack_.push_back(std::move(value));
        continue;  // the byte starts the item
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The vocabulary index and the constraint

JsonVocabIndex::JsonVocabIndex(int32_t vocab, const TokenBytesFn& token_bytes) : vocab_(vocab) {
  if (vocab <= 0) throw Error("json constraint: the vocabulary is empty");
  bytes_.resize(static_cast<size_t>(vocab));
  // A matcher inside a free string: a token is plain when it leaves one there.
  JsonMatcher in_string(JsonSchema::any_object());
  in_string.feed("{\"\": \"");
  for (int32_t id = 0; id < vocab; ++id) {
    bytes_[static_cast<size_t>(id)] = std::string(token_bytes(id));
    const std::string& b = bytes_[static_cast<size_t>(id)];
    if (b.empty()) continue;
    sorted_.push_back(id);
    // Plain: free text can take it whole from any character boundary (no quote, backslash or
    // control byte, and whole UTF-8 characters only).
    JsonMatcher probe = in_string;
    const bool plain = std::none_of(b.begin(), b.end(), [](char c) {
      const auto u = static_cast<unsigned char>(c);
      return u == '"' || u == '\\' || u < 0x20;
    }) && probe.feed(b) && probe.in_free_text();
    (plain ? plain_ : special_).push_back(id);
  }
  std::sort(sorted_.begin(), sorted_.end(), [this](int32_t a, int32_t b) {
    return bytes_[static_cast<size_t>(a)] < bytes_[static_cast<size_t>(b)] ||
           (bytes_[static_cast<size_t>(a)] == bytes_[static_cast<size_t>(b)] && a < b);
  });
}

std::shared_ptr<const JsonVocabIndex> JsonVocabIndex::for_tokenizer(const Tokenizer& tokenizer, int32_t vocab) {
  // A server has one tokenizer and one row length: a few entries cover tests' tokenizers too.
  static TokenizerCache<int32_t, JsonVocabIndex> cache(4);
  return cache.get(tokenizer, vocab, [&] {
    return std::make_shared<const JsonVocabIndex>(vocab, [&tokenizer](int32_t id) {
      return tokenizer.is_special(id) ? std::string_view() : tokenizer.token_view(id);
    });
  });
}

JsonConstraint::JsonConstraint(std::shared_ptr<const JsonSchema> schema, std::shared_ptr<const JsonVocabIndex> vocab,
                               std::vector<int32_t> stop_ids)
    : vocab_(std::move(vocab)), stop_ids_(std::move(stop_ids)), matcher_(std::move(schema)) {
  if (!vocab_) throw Error("json constraint: no vocabulary index");
}

std::vector<char> JsonConstraint::allowed_mask() const {
  std::vector<char> ok(static_cast<size_t>(vocab_->vocab()), 0);
  if (matcher_.complete()) {
    for (int32_t id : stop_ids_)
      if (id >= 0 && id < vocab_->vocab()) ok[static_cast<size_t>(id)] = 1;
    return ok;
  }
  if (matcher_.in_free_text()) {
    for (int32_t id : vocab_->plain()) ok[static_cast<size_t>(id)] = 1;
    for (int32_t id : vocab_->special_bytes()) {
      JsonMatcher m = matcher_;
      if (m.feed(vocab_->bytes()[static_cast<size_t>(id)])) ok[static_cast<size_t>(id)] = 1;
    }
    return ok;
  }
  mark_taken_tokens(*vocab_, matcher_, ok);
  return ok;
}

bool JsonConstraint::allows(int32_t id) const {
  if (!active_) return true;
  if (id < 0 || id >= vocab_->vocab()) return false;
  if (matcher_.complete()) return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
  const std::string& b = vocab_->bytes()[static_cast<size_t>(id)];
  JsonMatcher m = matcher_;
  return !b.empty() && m.feed(b);
}

size_t apply_token_mask(std::span<float> logits, const std::vector<char>& ok) {
  const size_t n = std::min(logits.size(), ok.size());
  size_t left = 0;
  for (size_t i = 0; i < n; ++i) left += ok[i] != 0;
  if (left == 0) return 0;
  for (size_t i = 0; i < logits.size(); ++i)
    if (i >= n || !ok[i]) logits[i] = -std::numeric_limits<float>::infinity();
  return left;
}

size_t JsonConstraint::mask(std::span<float> logits) {
  if (!active_) return logits.size();
  const size_t left = apply_token_mask(logits, allowed_mask());
  if (left > 0) return left;
  active_ = false;  // nothing can continue (no stop token to end with): give up, leave the row
  return logits.size();
}

void JsonConstraint::push(int32_t id) {
  if (!active_) return;
  if (matcher_.complete() || id < 0 || id >= vocab_->vocab()) {
    active_ = false;  // a stop token after the document (or a refused id): the constraint is over
    return;
  }
  if (!matcher_.feed(vocab_->bytes()[static_cast<size_t>(id)])) active_ = false;
  if (active_ && matcher_.complete() && stop_ids_.empty()) active_ = false;
}

}  // namespace lily
