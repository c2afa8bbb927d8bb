#include "server/tool_calls.h"

#include <algorithm>
#include <memory>
#include <random>

#include "server/json_depth.h"

namespace lily::server {

namespace {

using nlohmann::ordered_json;

constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t partial_marker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

std::string call_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += digits[rng() % 16];
  return id;
}

/// The schema a local "$ref" ("#/$defs/NAME" or "#/definitions/NAME", with JSON-pointer
/// escapes ~0 and ~1) names in `root`; nullptr for any other reference or a missing target.
const ordered_json* resolve_local_ref(const ordered_json& root, const std::string& ref) {
  for (const char* defs : {"$defs", "definitions"}) {
    const std::string prefix = std::string("#/") + defs + "/";
    if (!ref.starts_with(prefix) || !root.is_object() || !root.contains(defs) || !root[defs].is_object()) continue;
    std::string name;
    for (size_t i = prefix.size(); i < ref.size(); ++i) {
      if (ref[i] == '/') return nullptr;  // deeper pointers are not followed
      if (ref[i] == '~' && i + 1 < ref.size() && (ref[i + 1] == '0' || ref[i + 1] == '1')) {
        name += ref[++i] == '0' ? '~' : '/';
      } else {
        name += ref[i];
      }
    }
    const auto it = root[defs].find(name);
    return it == root[defs].end() ? nullptr : &*it;
  }
  return nullptr;
}

/// A parameter's schema says it may be a string, or says nothing of its type. Without a `type`,
/// a local `$ref` is followed (pydantic writes nested models so), `anyOf`/`oneOf` are raw when a
/// branch is (pydantic's Optional[int] is not), and an `enum`/`const` of no string is not:
/// those values are JSON. `depth` bounds reference chains.
bool schema_is_raw(const ordered_json& schema, const ordered_json& root, int depth = 0) {
  if (!schema.is_object() || depth > 16) return true;
  if (schema.contains("type")) {
    const ordered_json& type = schema["type"];
    if (type.is_string()) return type == "string";
    if (type.is_array())
      for (const auto& t : type)
        if (t == "string") return true;
    return !type.is_array();
  }
  if (schema.contains("$ref") && schema["$ref"].is_string())
    if (const ordered_json* target = resolve_local_ref(root, schema["$ref"].get<std::string>()))
      return schema_is_raw(*target, root, depth + 1);
  for (const char* key : {"anyOf", "oneOf"})
    if (schema.contains(key) && schema[key].is_array() && !schema[key].empty())
      return std::any_of(schema[key].begin(), schema[key].end(),
                         [&](const ordered_json& branch) { return schema_is_raw(branch, root, depth + 1); });
  auto no_string = [](const ordered_json& values) {
    return std::none_of(values.begin(), values.end(), [](const ordered_json& v) { return v.is_string(); });
  };
  if (schema.contains("enum") && schema["enum"].is_array() && !schema["enum"].empty()) return !no_string(schema["enum"]);
  if (schema.contains("const")) return schema["const"].is_string();
  return true;
}

/// A cursor over a tool-call block.
struct Cursor {
  std::string_view s;
  void skip_space() {
    while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  }
  bool eat(std::string_view word) {
    if (!s.starts_with(word)) return false;
    s.remove_prefix(word.size());
    return true;
  }
  /// The text up to `end` (consumed with it), or nullopt.
  std::optional<std::string_view> until(std::string_view end) {
    const size_t at = s.find(end);
    if (at == std::string_view::npos) return std::nullopt;
    std::string_view out = s.substr(0, at);
    s.remove_prefix(at + end.size());
    return out;
  }
};

/// A function or parameter name: non-empty, on one line, no markup.
bool plain_name(std::string_view name) {
  if (name.empty()) return false;
  for (char c : name)
    if (c == '\n' || c == '<' || c == '>') return false;
  return true;
}

}  // namespace

ToolSchemas::ToolSchemas(const ordered_json& tools) {
  if (!tools.is_array()) return;
  for (const auto& tool : tools) {
    if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object()) continue;
    const ordered_json& f = tool["function"];
    if (!f.contains("name") || !f["name"].is_string()) continue;
    auto& params = raw_[f["name"].get<std::string>()];
    if (f.contains("parameters") && f["parameters"].is_object() && f["parameters"].contains("properties") &&
        f["parameters"]["properties"].is_object())
      for (const auto& [name, schema] : f["parameters"]["properties"].items())
        params[name] = schema_is_raw(schema, f["parameters"]);
  }
}

bool ToolSchemas::raw_string(const std::string& function, const std::string& parameter) const {
  const auto f = raw_.find(function);
  if (f == raw_.end()) return true;
  const auto p = f->second.find(parameter);
  return p == f->second.end() || p->second;
}

std::vector<std::string_view> answer_markers(const AnswerFormat& format) {
  std::vector<std::string_view> markers;
  if (format.thinking) markers.push_back(kThinkEnd);
  if (format.tools) {
    markers.push_back(kCallOpen);
    markers.push_back(kCallClose);
  }
  return markers;
}

std::optional<ParsedToolCall> parse_tool_call_block(std::string_view block, const ToolSchemas& tools) {
  Cursor c{block};
  if (!c.eat(kCallOpen)) return std::nullopt;
  c.skip_space();
  if (!c.eat("<function=")) return std::nullopt;
  const auto name = c.until(">");
  if (!name || !plain_name(*name) || !tools.declared(std::string(*name))) return std::nullopt;
  ParsedToolCall call;
  call.name = std::string(*name);
  ordered_json args = ordered_json::object();
  while (true) {
    c.skip_space();
    if (c.eat("</function>")) break;
    if (!c.eat("<parameter=")) return std::nullopt;
    const auto param = c.until(">");
    if (!param || !plain_name(*param)) return std::nullopt;
    auto value = c.until("</parameter>");
    if (!value) return std::nullopt;
    std::string_view v = *value;
    if (v.starts_with('\n')) v.remove_prefix(1);
    if (v.ends_with('\n')) v.remove_suffix(1);
    const std::string key(*param);
    if (args.contains(key)) return std::nullopt;  // a parameter given twice
    if (tools.raw_string(call.name, key)) {
      args[key] = std::string(v);
    } else {
      ordered_json parsed = parse_json_bounded_or_discarded<ordered_json>(v);  // too deep: kept as text
      args[key] = parsed.is_discarded() ? ordered_json(std::string(v)) : std::move(parsed);
    }
  }
  c.skip_space();
  if (!c.eat(kCallClose)) return std::nullopt;
  if (!c.s.empty()) return std::nullopt;
  call.arguments = args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  call.id = call_id();
  return call;
}

AnswerParser::AnswerParser(AnswerFormat format)
    : format_(std::move(format)), mode_(format_.thinking ? Mode::kReasoning : Mode::kContent),
      buf_(format_.prefix), strip_newlines_(format_.thinking) {}

std::vector<AnswerDelta> AnswerParser::push(std::string_view piece) {
  buf_.append(piece);
  return drain(false);
}

std::vector<AnswerDelta> AnswerParser::finish() { return drain(true); }

std::vector<AnswerDelta> AnswerParser::drain(bool final) {
  std::vector<AnswerDelta> out;
  auto emit = [&](AnswerDelta::Kind kind, std::string text) {
    if (text.empty() || (kind == AnswerDelta::Kind::kReasoning && !format_.include_reasoning)) return;
    if (!out.empty() && out.back().kind == kind) out.back().text += text;
    else out.push_back(AnswerDelta{kind, std::move(text), {}, 0});
  };
  while (true) {
    if (mode_ == Mode::kEnded) {  // single_call: nothing after the first call
      buf_.clear();
      break;
    }
    if (strip_newlines_) {
      const size_t n = buf_.find_first_not_of('\n');
      buf_.erase(0, n == std::string::npos ? buf_.size() : n);
      if (buf_.empty()) break;
      strip_newlines_ = false;
    }
    if (mode_ == Mode::kReasoning) {
      const size_t end = buf_.find(kThinkEnd);
      size_t cut;
      if (end != std::string::npos) {
        cut = end;
      } else if (final) {
        cut = buf_.size();
      } else {
        cut = buf_.size() - partial_marker(buf_, kThinkEnd);
      }
      size_t keep = cut;  // newlines just before </think> are not reasoning
      while (keep > 0 && buf_[keep - 1] == '\n') --keep;
      if (end == std::string::npos && !final) {
        emit(AnswerDelta::Kind::kReasoning, buf_.substr(0, keep));
        buf_.erase(0, keep);
        break;
      }
      emit(AnswerDelta::Kind::kReasoning, buf_.substr(0, keep));
      if (end == std::string::npos) {
        buf_.clear();
        break;
      }
      buf_.erase(0, end + kThinkEnd.size());
      mode_ = Mode::kContent;
      strip_newlines_ = true;
      continue;
    }
    if (mode_ == Mode::kContent) {
      if (!format_.tools) {
        emit(AnswerDelta::Kind::kContent, std::move(buf_));
        buf_.clear();
        break;
      }
      const size_t open = buf_.find(kCallOpen);
      if (open != std::string::npos) {
        size_t keep = open;  // whitespace before a call is not content
        while (keep > 0 && is_space(buf_[keep - 1])) --keep;
        emit(AnswerDelta::Kind::kContent, buf_.substr(0, keep));
        buf_.erase(0, open);
        mode_ = Mode::kToolCall;
        continue;
      }
      if (final) {
        // Whitespace after the last call is not content either.
        if (!(calls_ > 0 && buf_.find_first_not_of(" \n\t\r") == std::string::npos))
          emit(AnswerDelta::Kind::kContent, std::move(buf_));
        buf_.clear();
        break;
      }
      size_t keep = buf_.size() - partial_marker(buf_, kCallOpen);
      while (keep > 0 && is_space(buf_[keep - 1])) --keep;
      emit(AnswerDelta::Kind::kContent, buf_.substr(0, keep));
      buf_.erase(0, keep);
      break;
    }
    // Mode::kToolCall: buf_ starts with "<tool_call>".
    const size_t close = buf_.find(kCallClose);
    if (close == std::string::npos) {
      if (final) {  // cut off (max_tokens, a stop): the block is content
        emit(AnswerDelta::Kind::kContent, std::move(buf_));
        buf_.clear();
        unfinished_call_ = true;
      }
      break;
    }
    const size_t end = close + kCallClose.size();
    if (auto call = parse_tool_call_block(std::string_view(buf_).substr(0, end), *format_.tools)) {
      out.push_back(AnswerDelta{AnswerDelta::Kind::kToolCall, {}, std::move(*call), calls_++});
      if (format_.single_call) {
        buf_.clear();
        mode_ = Mode::kEnded;
        break;
      }
    } else {
      emit(AnswerDelta::Kind::kContent, buf_.substr(0, end));
    }
    buf_.erase(0, end);
    mode_ = Mode::kContent;
  }
  return out;
}

std::function<std::function<bool(std::string_view)>()> first_tool_call_stop(const AnswerFormat& format) {
  return [format] {
    auto parser = std::make_shared<AnswerParser>(format);
    return std::function<bool(std::string_view)>([parser](std::string_view piece) {
      for (const AnswerDelta& d : parser->push(piece))
        if (d.kind == AnswerDelta::Kind::kToolCall) return true;
      return false;
    });
  };
}

AssistantMessage parse_answer(std::string_view text, const AnswerFormat& format) {
  AssistantMessage message;
  if (format.thinking && format.include_reasoning) message.reasoning = "";
  AnswerParser parser(format);
  auto take = [&](std::vector<AnswerDelta> deltas) {
    for (auto& d : deltas) {
      if (d.kind == AnswerDelta::Kind::kReasoning) *message.reasoning += d.text;
      else if (d.kind == AnswerDelta::Kind::kContent) message.content += d.text;
      else message.tool_calls.push_back(std::move(d.call));
    }
  };
  take(parser.push(text));
  take(parser.finish());
  message.unfinished_call = parser.unfinished_call();
  return message;
}

ordered_json assistant_message_json(const AssistantMessage& message) {
  ordered_json m{{"role", "assistant"}, {"content", message.content}};
  if (message.content.empty() && !message.tool_calls.empty()) m["content"] = nullptr;
  if (message.reasoning) m["reasoning_content"] = *message.reasoning;
  if (!message.tool_calls.empty()) {
    ordered_json calls = ordered_json::array();
    for (const auto& c : message.tool_calls)
      calls.push_back(ordered_json{{"id", c.id},
                                   {"type", "function"},
                                   {"function", ordered_json{{"name", c.name}, {"arguments", c.arguments}}}});
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

std::vector<ordered_json> delta_json(const AnswerDelta& delta) {
  if (delta.kind == AnswerDelta::Kind::kReasoning) return {ordered_json{{"reasoning_content", delta.text}}};
  if (delta.kind == AnswerDelta::Kind::kContent) return {ordered_json{{"content", delta.text}}};
  const ParsedToolCall& c = delta.call;
  const auto index = static_cast<int64_t>(delta.index);
  std::vector<ordered_json> out;
  out.push_back(ordered_json{
      {"tool_calls", ordered_json::array({ordered_json{{"index", index},
                                                       {"id", c.id},
                                                       {"type", "function"},
                                                       {"function", ordered_json{{"name", c.name}, {"arguments", ""}}}}})}});
  auto fragment = [&](std::string text) {
    out.push_back(ordered_json{
        {"tool_calls",
         ordered_json::array({ordered_json{{"index", index}, {"function", ordered_json{{"arguments", std::move(text)}}}}})}});
  };
  const ordered_json args = parse_json_bounded_or_discarded<ordered_json>(c.arguments);
  if (!args.is_object() || args.empty()) {
    fragment(c.arguments);
    return out;
  }
  bool first = true;
  for (const auto& [key, value] : args.items()) {
    fragment(std::string(first ? "{" : ",") + ordered_json(key).dump(-1, ' ', false, ordered_json::error_handler_t::replace) + ":" +
             value.dump(-1, ' ', false, ordered_json::error_handler_t::replace));
    first = false;
  }
  fragment("}");
  return out;
}

std::string answer_finish_reason(const std::string& finish, size_t tool_calls, bool unfinished_call) {
  return tool_calls > 0 && !unfinished_call && finish == "stop" ? "tool_calls" : finish;
}

}  // namespace lily::server
