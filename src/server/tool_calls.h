// The assistant's answer in OpenAI's shape: generated `<think>…</think>` text split
// off as reasoning_content when thinking is on, and the model's tool-call blocks
//   <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>
// parsed into tool_calls. One incremental parser serves streams and whole answers alike, so that
// the deltas a client assembles equal the whole message. Text that may still become a marker is
// held back (as stop strings are); a malformed block, or one left unfinished, is content.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily::server {

/// The declared tools as the parser needs them: which functions exist, and which parameters
/// keep their raw text (JSON-schema type "string", or no type known).
class ToolSchemas {
 public:
  /// `tools`: the request's validated tools array.
  explicit ToolSchemas(const nlohmann::ordered_json& tools);
  /// True if a function of this name is declared.
  bool declared(const std::string& function) const { return raw_.count(function) > 0; }
  /// True if the parameter's value stays a string (schema type "string" or one including it,
  /// a parameter the schema does not list, or one whose schema says nothing of its type);
  /// false: parsed as JSON. Without a `type`, a local $ref ("#/$defs/…", "#/definitions/…") is
  /// followed, anyOf/oneOf count as raw when a branch does, and an enum/const of no string is JSON.
  bool raw_string(const std::string& function, const std::string& parameter) const;

 private:
  std::map<std::string, std::map<std::string, bool>> raw_;  ///< function → parameter → raw
};

/// How an answer is read: with thinking, it starts inside the think block; with tools, tool
/// calls are parsed (tool_choice "none" and no tools: never).
struct AnswerFormat {
  bool thinking = false;
  std::optional<ToolSchemas> tools;
  /// Text the server wrote at the start of the answer on the model's behalf (the forced opening
  /// of a tool call, forced_answer_prefix in server/chat_agent.h): the parser reads it before
  /// the generated text, as if the model had written it.
  std::string prefix;
  /// `parallel_tool_calls: false`: the answer ends with its first tool call; whatever follows
  /// it is dropped (the engine also stops generating there, see first_tool_call_stop).
  bool single_call = false;
  /// false (`include_reasoning: false`): the thinking text is dropped from the answer, whole or
  /// streamed (no reasoning_content at all).
  bool include_reasoning = true;
};

/// One parsed tool call.
struct ParsedToolCall {
  std::string id;         ///< "call_" + 24 hex digits
  std::string name;       ///< a declared function
  std::string arguments;  ///< a JSON object as compact text, parameters in the model's order
};

/// A piece of the answer, in order.
struct AnswerDelta {
  enum class Kind { kReasoning, kContent, kToolCall };
  Kind kind = Kind::kContent;
  std::string text;     ///< kReasoning, kContent
  ParsedToolCall call;  ///< kToolCall
  size_t index = 0;     ///< kToolCall: its place among the answer's calls (0, 1, …)
};

/// Parses one tool-call block (from "<tool_call>" through "</tool_call>", surrounding
/// whitespace allowed inside). nullopt when it is malformed or calls an undeclared function.
/// Values are typed by `tools`: raw strings keep their text (one leading and one trailing
/// newline dropped), others are parsed as JSON, falling back to the string.
std::optional<ParsedToolCall> parse_tool_call_block(std::string_view block, const ToolSchemas& tools);

/// The marker texts an AnswerParser with `format` splits the answer at: "</think>" when thinking,
/// "<tool_call>" and "</tool_call>" with tools (none for a plain answer). A tokenizer that marks
/// one of them special must still write its text (GenerationParams::kept_special_ids).
std::vector<std::string_view> answer_markers(const AnswerFormat& format);

/// The incremental answer parser. Feed it the generated text piece by piece; each call returns
/// the deltas that are now certain. Reasoning excludes the newlines next to its markers, and
/// content drops the newlines that follow "</think>"; with tools, trailing whitespace of content
/// is held until more content comes (it is dropped before a tool call).
class AnswerParser {
 public:
  /// A parser at the start of an answer; `format.prefix` is read before the first piece.
  explicit AnswerParser(AnswerFormat format);
  /// Appends generated text; returns the deltas it completes.
  std::vector<AnswerDelta> push(std::string_view piece);
  /// End of the answer: returns what was held back (an unfinished tool-call block as content).
  std::vector<AnswerDelta> finish();
  /// Tool calls returned so far.
  size_t tool_calls() const { return calls_; }
  /// True once finish() returned an unfinished tool-call block as content (cut by max_tokens
  /// or a stop string): the answer holds a call it did not complete.
  bool unfinished_call() const { return unfinished_call_; }

 private:
  enum class Mode { kReasoning, kContent, kToolCall, kEnded };
  std::vector<AnswerDelta> drain(bool final);

  AnswerFormat format_;
  Mode mode_;
  std::string buf_;
  bool strip_newlines_ = false;  ///< drop newlines at the start of what comes next
  size_t calls_ = 0;
  bool unfinished_call_ = false;
};

/// For GenerationParams::stop_after_text: a predicate fed the generated text piece by piece that
/// becomes true with the piece completing the answer's first tool call (as AnswerParser reads it
/// with `format`: calls inside reasoning or malformed blocks do not count). Each call of the
/// returned factory gives a fresh parser (one per choice).
std::function<std::function<bool(std::string_view)>()> first_tool_call_stop(const AnswerFormat& format);

/// A whole answer.
struct AssistantMessage {
  std::string content;
  std::optional<std::string> reasoning;  ///< set when thinking is on
  std::vector<ParsedToolCall> tool_calls;
  bool unfinished_call = false;  ///< content ends with a tool-call block that was cut off
};

/// Runs AnswerParser over a whole generated text and joins its deltas.
AssistantMessage parse_answer(std::string_view text, const AnswerFormat& format);

/// {"role":"assistant","content":…,"reasoning_content"?:…,"tool_calls"?:[{"id","type":"function",
/// "function":{"name","arguments"}}]}; content is null when the answer is only tool calls.
nlohmann::ordered_json assistant_message_json(const AssistantMessage& message);

/// The streamed `delta` objects of one AnswerDelta, in order: {"reasoning_content": text},
/// {"content": text}, or for a tool call first {"tool_calls":[{"index","id","type":"function",
/// "function":{"name","arguments":""}}]} and then argument fragments
/// {"tool_calls":[{"index","function":{"arguments": piece}}]} (one per parameter, "{" and "}"
/// included) whose concatenation is the arguments text.
std::vector<nlohmann::ordered_json> delta_json(const AnswerDelta& delta);

/// "tool_calls" when the answer called tools, stopped ("stop") and left no cut-off call in its
/// content (`unfinished_call`, AnswerParser::unfinished_call); else `finish`. A call cut by a
/// stop string is no call, so its answer finishes "stop", as one cut by max_tokens keeps "length".
std::string answer_finish_reason(const std::string& finish, size_t tool_calls, bool unfinished_call);

}  // namespace lily::server
