// The agent fields of a chat request: tools, tool_choice, parallel_tool_calls,
// reasoning_effort and chat_template_kwargs, and the message fields of tool-calling
// conversations (tool_calls on assistant turns, tool_call_id on tool results). Kept apart from
// chat_request.cpp, which calls in here for these keys.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/tool_call_constraint.h"
#include "text/chat_template.h"

namespace lily::server {

/// `tool_choice`.
enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

/// The validated agent fields of a chat (or /tokenize messages) request.
struct ChatAgentFields {
  nlohmann::ordered_json tools;               ///< null, or the declared tools in the client's key order
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;               ///< kNamed: the function (a declared tool)
  std::optional<bool> parallel_tool_calls;    ///< false: at most one tool call per answer (AnswerFormat::single_call)
  /// none | minimal | low | medium | high | xhigh: "none" disables thinking, the others enable it
  /// (the model has one depth of thinking).
  std::optional<std::string> reasoning_effort;
  /// include_reasoning (vLLM's): false leaves the thinking text out of the answer (it is still
  /// generated and counted in completion tokens).
  bool include_reasoning = true;
  std::optional<bool> enable_thinking;        ///< chat_template_kwargs.enable_thinking
  std::optional<bool> preserve_thinking;      ///< chat_template_kwargs.preserve_thinking
  /// The other chat_template_kwargs (as vLLM passes them): template variables of those names,
  /// any JSON value; messages, tools, add_generation_prompt and documents are refused.
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();

  /// True when tools are declared and tool_choice is not "none": they reach the template and
  /// the answer is parsed for tool calls.
  bool tools_active() const { return tools.is_array() && !tools.empty() && tool_choice != ToolChoice::kNone; }
};

/// True for the top-level keys parse_agent_fields handles.
bool is_agent_field(std::string_view key);

/// Parses and validates the agent fields of request `doc` (`body` is its text, re-read to keep
/// the client's key order in `tools`). Throws ApiError 400 naming the field: "tools[0].type",
/// "tools[1].function.parameters", "tool_choice" (an unknown function, or "required"/named
/// without tools), "chat_template_kwargs.enable_thinking", ...
ChatAgentFields parse_agent_fields(const nlohmann::json& doc, std::string_view body);

/// The tool calls of an assistant history message (`v` is its "tool_calls"; `param` names it,
/// "messages[2].tool_calls"). Arguments are a JSON string holding an object (as OpenAI sends
/// them; an object is accepted too), parsed into a dict for the template.
std::vector<ChatToolCall> parse_message_tool_calls(const nlohmann::json& v, const std::string& param);

/// Whether the answer thinks: chat_template_kwargs.enable_thinking, else reasoning_effort
/// (anything but "none" enables), else the server's default (`lily serve --reasoning`).
bool thinking_enabled(const ChatAgentFields& fields, bool server_default);

/// The opening the server writes into the answer on the model's behalf so that tool_choice
/// "required" or a named function yields a call (empty for "auto", "none" and no tools). The
/// text is the start of the model's own tool-call format (server/tool_calls.h):
///   named, or "required" with one tool declared: "<tool_call>\n<function=NAME>\n"
///   "required" with several tools:                "<tool_call>\n<function="  (the model names one,
///                                                 held to the declared names: forced_call_grammar)
/// With thinking on, the answer starts inside the think block, so the opening first closes it
/// as a turn without thinking would read ("\n</think>\n\n"): a forced call skips the reasoning.
/// The server appends its tokens to the prompt and the answer parser reads it as answer text.
std::string forced_answer_prefix(const ChatAgentFields& fields, bool thinking);

/// What holds the rest of a forced call to the declared tools (engine/tool_call_constraint.h),
/// for GenerationParams::tool_call; null when forced_answer_prefix forces nothing. A named
/// function, or "required" with one tool: that function's parameters from right after its
/// opening. "required" with several tools: first the name (one of the declared ones, each
/// followed by ">\n"), then that function's parameters. With "required" and parallel_tool_calls
/// not false, further calls (of any declared tool) may follow the first. Parameter values are
/// typed as the answer parser types them (ToolSchemas::raw_string). A function whose
/// `parameters` the constraint cannot follow is unfollowed: after its name the model is free (as
/// before this constraint); when that is the named or single function, nothing is constrained
/// and the result is null.
std::shared_ptr<const ToolCallGrammar> forced_call_grammar(const ChatAgentFields& fields);

/// The template variables of a request: tools when active, thinking, preserve_thinking.
ChatTemplateOptions template_options(const ChatAgentFields& fields, bool server_default,
                                     bool add_generation_prompt = true);

}  // namespace lily::server
