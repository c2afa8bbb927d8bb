#include "server/chat_agent.h"

#include <algorithm>
#include <array>
#include <set>

#include "server/api_error.h"
#include "server/json_depth.h"
#include "server/tool_calls.h"

namespace lily::server {

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

ApiError unknown(const std::string& param) {
  return invalid_request("unrecognized field '" + param + "'", param, "unknown_parameter");
}

const std::string& require_string(const json& v, const std::string& param) {
  if (!v.is_string()) throw wrong_type(param, "a string", v);
  return v.get_ref<const std::string&>();
}

/// OpenAI's rule for function names: 1 to 64 letters, digits, '_' and '-'.
bool valid_function_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
      return false;
  return true;
}

/// `parameters` of a function: a JSON schema for an object (type "object" when given; properties
/// an object of schemas).
void check_parameters(const json& p, const std::string& param) {
  if (!p.is_object()) throw wrong_type(param, "a JSON schema object", p);
  if (p.contains("type") && p["type"] != "object")
    throw invalid_request("'" + param + ".type' must be \"object\": a function takes an object of arguments",
                          param + ".type");
  if (p.contains("properties")) {
    const json& props = p["properties"];
    if (!props.is_object()) throw wrong_type(param + ".properties", "an object", props);
    for (const auto& [name, schema] : props.items())
      if (!schema.is_object() && !schema.is_boolean())
        throw wrong_type(param + ".properties." + name, "a JSON schema", schema);
  }
  if (p.contains("required") && !p["required"].is_array())
    throw wrong_type(param + ".required", "an array", p["required"]);
}

/// Checks `obj`'s "type" (the path `at` + ".type") before its other keys: another kind of tool,
/// choice or call ("custom", "allowed_tools") carries keys of its own, which are not the mistake.
/// `required`: a missing (or, when not required, null) type is an error; else it means "function".
/// Throws the 400 that names the key.
void require_function_type(const json& obj, const std::string& at, bool required) {
  const std::string key = at + ".type";
  if (!obj.contains("type") || (!required && obj["type"].is_null())) {
    if (required) throw missing_parameter(key);
    return;
  }
  if (require_string(obj["type"], key) != "function")
    throw invalid_request("'" + key + "' must be \"function\"", key, "unsupported_value");
}

/// Validates `tools`; returns the declared function names.
std::set<std::string> check_tools(const json& tools) {
  if (!tools.is_array()) throw wrong_type("tools", "an array", tools);
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string at = "tools[" + std::to_string(i) + "]";
    const json& t = tools[i];
    if (!t.is_object()) throw wrong_type(at, "an object", t);
    require_function_type(t, at, /*required=*/true);
    for (const auto& [key, value] : t.items())
      if (key != "type" && key != "function") throw unknown(at + "." + key);
    if (!t.contains("function")) throw missing_parameter(at + ".function");
    const json& f = t["function"];
    const std::string fat = at + ".function";
    if (!f.is_object()) throw wrong_type(fat, "an object", f);
    for (const auto& [key, value] : f.items()) {
      if (key == "name") continue;
      if (value.is_null()) continue;
      if (key == "description") require_string(value, fat + ".description");
      else if (key == "parameters") check_parameters(value, fat + ".parameters");
      else if (key == "strict") {
        if (!value.is_boolean()) throw wrong_type(fat + ".strict", "a boolean", value);
      } else throw unknown(fat + "." + key);
    }
    if (!f.contains("name")) throw missing_parameter(fat + ".name");
    const std::string& name = require_string(f["name"], fat + ".name");
    if (!valid_function_name(name))
      throw invalid_request("'" + fat + ".name' must be 1 to 64 letters, digits, '_' or '-', got '" + name + "'",
                            fat + ".name");
    if (!names.insert(name).second)
      throw invalid_request("the function '" + name + "' is declared twice", fat + ".name");
  }
  return names;
}

void parse_tool_choice(const json& v, ChatAgentFields& out) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "none") out.tool_choice = ToolChoice::kNone;
    else if (s == "auto") out.tool_choice = ToolChoice::kAuto;
    else if (s == "required") out.tool_choice = ToolChoice::kRequired;
    else
      throw invalid_request("'tool_choice' must be \"none\", \"auto\", \"required\" or a function, got '" + s + "'",
                            "tool_choice");
    return;
  }
  if (!v.is_object()) throw wrong_type("tool_choice", "a string or an object", v);
  require_function_type(v, "tool_choice", /*required=*/true);
  for (const auto& [key, value] : v.items())
    if (key != "type" && key != "function") throw unknown("tool_choice." + key);
  if (!v.contains("function")) throw missing_parameter("tool_choice.function");
  const json& f = v["function"];
  if (!f.is_object()) throw wrong_type("tool_choice.function", "an object", f);
  for (const auto& [key, value] : f.items())
    if (key != "name") throw unknown("tool_choice.function." + key);
  if (!f.contains("name")) throw missing_parameter("tool_choice.function.name");
  out.tool_choice = ToolChoice::kNamed;
  out.tool_choice_name = require_string(f["name"], "tool_choice.function.name");
}

void parse_kwargs(const json& v, ChatAgentFields& out) {
  if (!v.is_object()) throw wrong_type("chat_template_kwargs", "an object", v);
  for (const auto& [key, value] : v.items()) {
    const std::string at = "chat_template_kwargs." + key;
    if (key == "messages" || key == "tools" || key == "add_generation_prompt" || key == "documents")
      throw invalid_request("template argument '" + key + "' is set by the server from the request",
                            at, "invalid_value");
    if (is_template_builtin(key))  // the template would find the variable where it calls the function
      throw invalid_request("template argument '" + key + "' would hide the chat template's built-in function of that name",
                            at, "invalid_value");
    if (key != "enable_thinking" && key != "preserve_thinking") {
      out.template_kwargs[key] = nlohmann::ordered_json::parse(value.dump());  // a variable of the template
      continue;
    }
    if (value.is_null()) continue;
    if (!value.is_boolean()) throw wrong_type(at, "a boolean", value);
    (key == "enable_thinking" ? out.enable_thinking : out.preserve_thinking) = value.get<bool>();
  }
}

}  // namespace

bool is_agent_field(std::string_view key) {
  return key == "tools" || key == "tool_choice" || key == "parallel_tool_calls" || key == "reasoning_effort" ||
         key == "chat_template_kwargs" || key == "include_reasoning";
}

ChatAgentFields parse_agent_fields(const json& doc, std::string_view body) {
  ChatAgentFields out;
  auto given = [&](const char* key) { return doc.contains(key) && !doc[key].is_null(); };
  std::set<std::string> names;
  if (given("tools")) {
    names = check_tools(doc["tools"]);
    // The template prints the tools with tojson: keep the client's key order.
    out.tools = ordered_json::parse(body)["tools"];
  }
  if (given("tool_choice")) parse_tool_choice(doc["tool_choice"], out);
  if (given("parallel_tool_calls")) {
    if (!doc["parallel_tool_calls"].is_boolean())
      throw wrong_type("parallel_tool_calls", "a boolean", doc["parallel_tool_calls"]);
    out.parallel_tool_calls = doc["parallel_tool_calls"].get<bool>();
  }
  if (given("reasoning_effort")) {
    out.reasoning_effort = require_string(doc["reasoning_effort"], "reasoning_effort");
    static constexpr std::array<std::string_view, 6> kEfforts = {"none", "minimal", "low", "medium", "high", "xhigh"};
    if (std::find(kEfforts.begin(), kEfforts.end(), *out.reasoning_effort) == kEfforts.end())
      throw invalid_request("'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh; got " +
                                doc["reasoning_effort"].dump(),
                            "reasoning_effort", "invalid_value");
  }
  if (given("include_reasoning")) {
    if (!doc["include_reasoning"].is_boolean())
      throw wrong_type("include_reasoning", "a boolean", doc["include_reasoning"]);
    out.include_reasoning = doc["include_reasoning"].get<bool>();
  }
  if (given("chat_template_kwargs")) parse_kwargs(doc["chat_template_kwargs"], out);
  if (out.tool_choice == ToolChoice::kRequired && names.empty())
    throw invalid_request("'tool_choice' is \"required\" but no tools are declared", "tool_choice");
  if (out.tool_choice == ToolChoice::kNamed && !names.count(out.tool_choice_name))
    throw invalid_request("'tool_choice' names the function '" + out.tool_choice_name +
                              "', which is not among the declared tools",
                          "tool_choice.function.name");
  return out;
}

std::vector<ChatToolCall> parse_message_tool_calls(const json& v, const std::string& param) {
  if (!v.is_array()) throw wrong_type(param, "an array", v);
  std::vector<ChatToolCall> calls;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = param + "[" + std::to_string(i) + "]";
    const json& c = v[i];
    if (!c.is_object()) throw wrong_type(at, "an object", c);
    require_function_type(c, at, /*required=*/false);
    for (const auto& [key, value] : c.items())
      if (key != "id" && key != "type" && key != "function") throw unknown(at + "." + key);
    ChatToolCall call;
    if (c.contains("id") && !c["id"].is_null()) call.id = require_string(c["id"], at + ".id");
    if (!c.contains("function")) throw missing_parameter(at + ".function");
    const json& f = c["function"];
    if (!f.is_object()) throw wrong_type(at + ".function", "an object", f);
    for (const auto& [key, value] : f.items())
      if (key != "name" && key != "arguments") throw unknown(at + ".function." + key);
    if (!f.contains("name")) throw missing_parameter(at + ".function.name");
    call.name = require_string(f["name"], at + ".function.name");
    if (f.contains("arguments") && !f["arguments"].is_null()) {
      const std::string aat = at + ".function.arguments";
      const json& a = f["arguments"];
      if (a.is_object()) {
        call.arguments = ordered_json::parse(a.dump());
      } else {
        const std::string& text = require_string(a, aat);
        ordered_json parsed;
        try {
          parsed = parse_json_bounded<ordered_json>(text);
        } catch (const JsonTooDeep& e) {
          throw invalid_request("'" + aat + "' " + e.what(), aat);
        } catch (const ordered_json::exception&) {
          parsed = ordered_json(ordered_json::value_t::discarded);
        }
        if (parsed.is_discarded() || !parsed.is_object())
          throw invalid_request("'" + aat + "' must be a JSON object in a string, got '" + text + "'", aat);
        call.arguments = std::move(parsed);
      }
    }
    calls.push_back(std::move(call));
  }
  return calls;
}

bool thinking_enabled(const ChatAgentFields& fields, bool server_default) {
  if (fields.enable_thinking) return *fields.enable_thinking;
  if (fields.reasoning_effort) return *fields.reasoning_effort != "none";
  return server_default;
}

std::string forced_answer_prefix(const ChatAgentFields& fields, bool thinking) {
  if (!fields.tools_active()) return "";
  std::string name;
  if (fields.tool_choice == ToolChoice::kNamed) {
    name = fields.tool_choice_name;
  } else if (fields.tool_choice == ToolChoice::kRequired) {
    if (fields.tools.size() == 1) name = fields.tools[0]["function"]["name"].get<std::string>();
  } else {
    return "";
  }
  std::string prefix = thinking ? "\n</think>\n\n" : "";
  prefix += "<tool_call>\n<function=";
  if (!name.empty()) prefix += name + ">\n";
  return prefix;
}

std::shared_ptr<const ToolCallGrammar> forced_call_grammar(const ChatAgentFields& fields) {
  if (!fields.tools_active()) return nullptr;
  const bool named = fields.tool_choice == ToolChoice::kNamed;
  if (!named && fields.tool_choice != ToolChoice::kRequired) return nullptr;
  std::vector<ToolCallGrammar::Declaration> functions;
  for (const auto& tool : fields.tools) {
    const auto& f = tool["function"];
    const std::string name = f["name"].get<std::string>();
    if (named && name != fields.tool_choice_name) continue;
    const auto parameters = f.find("parameters");
    functions.push_back({name, parameters == f.end() ? json() : json::parse(parameters->dump())});
  }
  const ToolSchemas schemas(fields.tools);
  auto raw = [&schemas](const std::string& function, const std::string& parameter) {
    return schemas.raw_string(function, parameter);
  };
  // The opening names the function unless "required" leaves the choice among several.
  const std::optional<size_t> opened = functions.size() == 1 ? std::optional<size_t>(0) : std::nullopt;
  const bool more_calls = !named && fields.parallel_tool_calls != false;
  auto grammar = ToolCallGrammar::compile(functions, raw, opened, more_calls);
  return grammar->constrains() ? grammar : nullptr;
}

ChatTemplateOptions template_options(const ChatAgentFields& fields, bool server_default, bool add_generation_prompt) {
  ChatTemplateOptions options;
  options.add_generation_prompt = add_generation_prompt;
  options.enable_thinking = thinking_enabled(fields, server_default);
  options.preserve_thinking = fields.preserve_thinking;
  options.extra_variables = fields.template_kwargs;
  if (fields.tools_active()) options.tools = fields.tools;
  return options;
}

}  // namespace lily::server
