// Chat prompts: a checkpoint's Jinja chat template (chat_template.jinja, or `chat_template` in
// tokenizer_config.json) rendered with lily's engine (text/jinja), thinking disabled, and its
// encoding with control tokens only where the template itself writes markers. Checkpoints
// without a template, and the tokenizer-only tools, use lily's built-in Qwen3.5/3.6 ChatML text
// template (docs/model.md §6.1).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja/template.h"
#include "text/tokenizer.h"

namespace lily {

enum class ChatRole { kSystem, kUser, kAssistant, kTool };

/// "system" | "developer" (a system message) | "user" | "assistant" | "tool" → the role; nullopt
/// for any other name. The one place that maps role names (the server's request parser and the
/// CLI's message lists use it).
std::optional<ChatRole> chat_role_from_name(std::string_view name);

/// A tool call of an earlier assistant turn, as the template reads it.
struct ChatToolCall {
  std::string id;                     ///< "call_…" (may be empty)
  std::string name;                   ///< the function's name
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();  ///< the arguments as a dict
};

struct ChatMessage {
  ChatRole role;
  std::string content;  ///< plain text (never parsed for special tokens)
  std::vector<ChatToolCall> tool_calls = {};          ///< assistant turns only
  std::string tool_call_id = {};                      ///< tool messages: the call answered
  std::optional<std::string> reasoning_content = {};  ///< assistant turns: their thinking
  std::string name = {};                              ///< the optional participant name
};

/// Where ChatTemplate::encode spent its time, in seconds (for the server's phase metrics).
struct ChatEncodeTimings {
  double render_seconds = 0;    ///< the Jinja template rendered into text
  double tokenize_seconds = 0;  ///< that text encoded into token ids
};

/// The template variables besides `messages`.
struct ChatTemplateOptions {
  bool add_generation_prompt = true;      ///< the template variable of that name
  bool enable_thinking = false;           ///< the template variable of that name
  std::optional<bool> preserve_thinking;  ///< passed only when set
  nlohmann::ordered_json tools;           ///< null (absent) or the request's list of tools
  /// null or an object: more template variables (a request's chat_template_kwargs), set before
  /// the ones above, which win over a variable of the same name.
  nlohmann::ordered_json extra_variables;
  /// The last message is an assistant turn to continue (vLLM's continue_final_message): the
  /// prompt ends right after its content, as the client wrote it (whitespace the template trims
  /// off its end is put back), so the answer goes on from there. Needs add_generation_prompt
  /// false, and a last assistant message with content and no tool calls.
  bool continue_final_message = false;
};

/// Whether `name` is a function the template engine gives every template (range, namespace,
/// raise_exception, ...): an extra variable of that name would hide it from the template.
bool is_template_builtin(std::string_view name);

/// A parsed chat template. Immutable; thread-safe.
///
/// Rendering passes `messages` (role, content, and when set name, tool_call_id,
/// reasoning_content and tool_calls as {id, type: "function", function: {name, arguments}}),
/// `add_generation_prompt`, `enable_thinking` (false unless asked), `preserve_thinking` and
/// `tools` when given. Message content is context text: whatever it contains, only the
/// bytes the template writes itself (its literals) are encoded with control tokens. So that each
/// prompt is a token-exact prefix of the next turn's (the session cache relies on it), earlier
/// assistant turns are rendered with the empty think block the generation prompt ended with:
/// when the template drops it from history (as Qwen3.5/3.6's does), lily passes those turns as
/// `<think>\n\n</think>\n\n` + content with `reasoning_content: ""`, the block counted as template
/// text; a load-time probe decides whether the template needs this (the demo template does not).
/// With thinking on (or `preserve_thinking`) no turn is rewritten: its generation prompt ended
/// with an open `<think>`, not an empty block, so the template's own history is the prompt.
class ChatTemplate {
 public:
  /// Parses `source`. Throws lily::Error "ORIGIN: line N: ..." for a syntax error or a construct
  /// the engine does not support.
  ChatTemplate(std::string_view source, std::string origin);

  /// lily's built-in Qwen3.5/3.6 ChatML text template (docs/model.md §6.1; the same text
  /// as tests/fixtures/qwen3_6_chat_template.jinja).
  static std::shared_ptr<const ChatTemplate> builtin();
  /// The source of the built-in template.
  static std::string_view builtin_source();
  /// The template of checkpoint directory `dir`: chat_template.jinja, else tokenizer_config.json's
  /// `chat_template` (a string, or the entry named "default" of a list), else builtin().
  /// Throws lily::Error for an unreadable file or a template the engine refuses.
  static std::shared_ptr<const ChatTemplate> for_model(const std::filesystem::path& dir);

  /// Where the template came from (a file name, or "built-in").
  const std::string& origin() const { return origin_; }
  /// True if, with thinking off, earlier assistant turns get the empty think block (see the class
  /// comment).
  bool rewrites_history() const { return rewrite_history_; }

  /// The prompt text. Throws lily::Error: the template's own errors (raise_exception, e.g.
  /// "System message must be at the beginning.", "No user query found in messages.") and
  /// "the last message must be from the user" (a tool result may be last too). Without
  /// `add_generation_prompt` (the template variable of that name is false) the last message may
  /// also be from the assistant: what a
  /// client counting a whole conversation's tokens asks for. With
  /// ChatTemplateOptions::continue_final_message, "the final assistant message cannot be
  /// continued: …" when it breaks that option's rules or the template does not write its content
  /// as given.
  std::string render(std::span<const ChatMessage> messages, bool add_generation_prompt = true) const;
  /// The same with every template variable given (tools, thinking).
  std::string render(std::span<const ChatMessage> messages, const ChatTemplateOptions& options) const;
  /// The prompt's token ids: the template's text encoded with special tokens, context text
  /// without (a `<|im_start|>` typed by a user stays plain text). Throws lily::Error as render,
  /// or if the tokenizer lacks one of the ChatML markers the template writes.
  std::vector<int32_t> encode(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                              bool add_generation_prompt = true) const;
  /// The same with every template variable given (tools, thinking). With `message_starts`, also
  /// fills in where each message but the first begins: the token position of every
  /// `<|im_start|>` the template writes itself (not one inside message content), except at 0,
  /// ascending. These are the resume points the prefix cache snapshots: the prompt up to such a
  /// position is a token-exact prefix of every prompt that repeats the messages before it.
  /// With `timings`, also adds the time spent rendering and tokenizing to it.
  std::vector<int32_t> encode(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                              const ChatTemplateOptions& options, std::vector<int64_t>* message_starts = nullptr,
                              ChatEncodeTimings* timings = nullptr) const;

 private:
  jinja::RenderedText render_marked(std::span<const ChatMessage> messages, bool rewrite,
                                    const ChatTemplateOptions& options) const;
  bool keeps_prefix(bool rewrite) const;

  jinja::Template template_;
  std::string origin_;
  bool rewrite_history_ = false;
};

/// builtin()->render(messages, add_generation_prompt).
std::string render_chat(std::span<const ChatMessage> messages, bool add_generation_prompt = true);

/// builtin()->encode(tokenizer, messages, add_generation_prompt).
std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 bool add_generation_prompt = true);

}  // namespace lily
