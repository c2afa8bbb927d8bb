// Chat prompts rendered with the checkpoint's Jinja template (see chat_template.h), encoded so
// that only the template's own text can become control tokens.
#include "text/chat_template.h"

#include <chrono>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "base/log.h"
#include "text/jinja/parser.h"
#include "text/jinja/pystr.h"

namespace lily {
namespace {

// lily's built-in template: byte for byte tests/fixtures/qwen3_6_chat_template.jinja (a unit
// test checks it).
constexpr std::string_view kBuiltinSource = R"lily({#- Text-only ChatML template of the Qwen3.5/3.6 family, written for lily's tests from the
    description in docs/model.md §6.1 (not a copy of the published file): contents trimmed,
    system only first, last_query_index skips <tool_response> blocks, reasoning split at
    </think>, turns after the last query wrapped in a think block, generation prompt with an
    empty think block when enable_thinking is false. lily's nothink rewrite of earlier turns is
    applied to the messages before rendering (tests/node/template.test.mjs). -#}
{%- set ns = namespace(last_query_index=-1) -%}
{%- for m in messages|reverse -%}
  {%- if ns.last_query_index < 0 and m.role == 'user' -%}
    {%- set q = m.content|trim -%}
    {%- if not (q.startswith('<tool_response>') and q.endswith('</tool_response>')) -%}
      {%- set ns.last_query_index = (messages|length) - 1 - loop.index0 -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.last_query_index < 0 -%}
  {{- raise_exception('No user query found in messages.') -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set content = m.content|trim -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first -%}
      {{- raise_exception('System message must be at the beginning.') -}}
    {%- endif -%}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = '' -%}
    {%- if m.reasoning_content is string -%}
      {%- set reasoning = m.reasoning_content -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query_index -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- else -%}
    {{- '<think>\n' -}}
  {%- endif -%}
{%- endif -%}
)lily";

constexpr std::string_view kEmptyThinkBlock = "<think>\n\n</think>\n\n";
// The ChatML markers a template for this model family writes; encode() refuses a tokenizer
// that lacks one the template used (it would silently become plain text).
constexpr std::string_view kMarkers[] = {"<|im_start|>", "<|im_end|>", "<think>", "</think>"};

const char* role_name(ChatRole role) {
  switch (role) {
    case ChatRole::kSystem: return "system";
    case ChatRole::kUser: return "user";
    case ChatRole::kAssistant: return "assistant";
    case ChatRole::kTool: return "tool";
  }
  return "user";
}

bool is_tool_response(std::string_view content) {
  std::string trimmed = jinja::pystr::strip(content, std::nullopt, true, true);
  return std::string_view(trimmed).starts_with("<tool_response>") && std::string_view(trimmed).ends_with("</tool_response>");
}

// Index of the last user message that is not a <tool_response> block, or -1.
long last_query_index(std::span<const ChatMessage> messages) {
  for (size_t i = messages.size(); i-- > 0;)
    if (messages[i].role == ChatRole::kUser && !is_tool_response(messages[i].content)) return static_cast<long>(i);
  return -1;
}

// An earlier assistant turn's content: the empty think block (template text) + the answer.
jinja::Value history_content(const std::string& content) {
  jinja::MarkedText m;
  m.append(kEmptyThinkBlock, /*trusted=*/true);
  m.append(std::string_view(content).starts_with(kEmptyThinkBlock) ? std::string_view(content).substr(kEmptyThinkBlock.size())
                                                                  : std::string_view(content),
           /*trusted=*/false);
  return m.take();
}

// A template file's bytes, read with the shared reader (which never blocks on a FIFO):
// "cannot read PATH: why" on failure (a FIFO or a directory is refused, not skipped).
std::string read_template_file(const std::filesystem::path& path) {
  try {
    return read_regular_file(path);
  } catch (const Error& e) {
    throw Error(std::string("cannot read ") + e.what());
  }
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, std::string origin) : template_([&] {
  try {
    return jinja::Template(source);
  } catch (const jinja::TemplateSyntaxError& e) {
    throw Error(origin + ": " + e.what());
  }
}()), origin_(std::move(origin)) {
  rewrite_history_ = !keeps_prefix(false) && keeps_prefix(true);
  if (!rewrite_history_ && !keeps_prefix(false))
    log_warn("chat template " + origin_ +
             ": a prompt is not a prefix of the next turn's prompt (the session cache will miss on history)");
}

std::shared_ptr<const ChatTemplate> ChatTemplate::builtin() {
  static const auto builtin = std::make_shared<const ChatTemplate>(kBuiltinSource, "built-in");
  return builtin;
}

std::string_view ChatTemplate::builtin_source() { return kBuiltinSource; }

std::shared_ptr<const ChatTemplate> ChatTemplate::for_model(const std::filesystem::path& dir) {
  const auto file = dir / "chat_template.jinja";
  if (optional_file_exists(file)) return std::make_shared<const ChatTemplate>(read_template_file(file), file.string());
  const auto config = dir / "tokenizer_config.json";
  if (optional_file_exists(config)) {
    auto doc = nlohmann::json::parse(read_template_file(config), nullptr, false);
    if (doc.is_object() && doc.contains("chat_template")) {
      const auto& t = doc["chat_template"];
      const std::string origin = config.string() + " (chat_template)";
      if (t.is_string()) return std::make_shared<const ChatTemplate>(t.get<std::string>(), origin);
      if (t.is_array())
        for (const auto& entry : t)
          if (entry.is_object() && entry.contains("name") && entry["name"] == "default" && entry.contains("template") &&
              entry["template"].is_string())
            return std::make_shared<const ChatTemplate>(entry["template"].get<std::string>(), origin);
      if (!t.is_null()) throw Error(origin + ": expected a string or a list with a \"default\" template");
    }
  }
  return builtin();
}

namespace {

// One message as the template reads it (the shape transformers passes).
jinja::Value message_value(const ChatMessage& message, bool history_rewrite) {
  jinja::Value m = jinja::Value::dict();
  auto& d = m.dict_data();
  d.set("role", jinja::Value(role_name(message.role)));
  if (history_rewrite) {
    d.set("content", history_content(message.content));
    d.set("reasoning_content", jinja::Value(""));
  } else {
    d.set("content", jinja::Value(message.content));
    if (message.reasoning_content) d.set("reasoning_content", jinja::Value(*message.reasoning_content));
  }
  if (!message.name.empty()) d.set("name", jinja::Value(message.name));
  if (message.role == ChatRole::kTool) d.set("tool_call_id", jinja::Value(message.tool_call_id));
  if (!message.tool_calls.empty()) {
    jinja::Value calls = jinja::Value::list();
    for (const ChatToolCall& call : message.tool_calls) {
      jinja::Value c = jinja::Value::dict();
      if (!call.id.empty()) c.dict_data().set("id", jinja::Value(call.id));
      c.dict_data().set("type", jinja::Value("function"));
      jinja::Value f = jinja::Value::dict();
      f.dict_data().set("name", jinja::Value(call.name));
      f.dict_data().set("arguments", jinja::from_json(call.arguments));
      c.dict_data().set("function", std::move(f));
      calls.list_data().items.push_back(std::move(c));
    }
    d.set("tool_calls", std::move(calls));
  }
  return m;
}

/// `s` without leading and trailing ASCII whitespace (a view into it).
std::string_view trimmed(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  const size_t lo = s.find_first_not_of(kSpace);
  if (lo == std::string_view::npos) return s.substr(s.size());
  return s.substr(lo, s.find_last_not_of(kSpace) + 1 - lo);
}

/// Throws unless ChatTemplateOptions::continue_final_message's rules hold.
void check_continuable(std::span<const ChatMessage> messages, const ChatTemplateOptions& options) {
  const std::string why = "the final assistant message cannot be continued: ";
  if (options.add_generation_prompt) throw Error(why + "add_generation_prompt must be false");
  if (messages.empty() || messages.back().role != ChatRole::kAssistant)
    throw Error(why + "the last message is not from the assistant");
  if (!messages.back().tool_calls.empty()) throw Error(why + "it has tool calls");
  if (trimmed(messages.back().content).empty()) throw Error(why + "it has no content");
}

// Ends the prompt right after the final assistant message's content: its last occurrence in
// the text (templates write it trimmed), then the trailing whitespace the client wrote.
void cut_after_final_content(jinja::RenderedText& out, const std::string& content) {
  const std::string_view core = trimmed(content);
  const size_t at = out.text.rfind(core);
  if (at == std::string::npos)
    throw Error("the final assistant message cannot be continued: the chat template does not write its content as given");
  const size_t end = at + core.size();
  out.text.resize(end);
  while (!out.trusted.empty() && out.trusted.back().first >= end) out.trusted.pop_back();
  if (!out.trusted.empty()) out.trusted.back().second = std::min(out.trusted.back().second, end);
  const size_t core_end = static_cast<size_t>(core.data() - content.data()) + core.size();
  out.text += content.substr(core_end);  // context text: never encoded with control tokens
}

}  // namespace

jinja::RenderedText ChatTemplate::render_marked(std::span<const ChatMessage> messages, bool rewrite,
                                               const ChatTemplateOptions& options) const {
  // preserve_thinking renders every turn's think block itself; a turn that brings its own
  // reasoning was not generated after an empty think block, and with thinking on no turn was
  // (its generation prompt ended with an open `<think>`), so the template's own history stands.
  if (options.preserve_thinking.value_or(false) || options.enable_thinking) rewrite = false;
  const long last_query = rewrite ? last_query_index(messages) : -1;
  jinja::Value list = jinja::Value::list();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    const bool history = message.role == ChatRole::kAssistant && static_cast<long>(i) <= last_query &&
                         (!message.reasoning_content || message.reasoning_content->empty());
    list.list_data().items.push_back(message_value(message, history));
  }
  jinja::Value context = jinja::Value::dict();
  if (options.extra_variables.is_object())
    for (const auto& [name, value] : options.extra_variables.items()) context.dict_data().set(name, jinja::from_json(value));
  context.dict_data().set("messages", std::move(list));
  if (options.tools.is_array()) context.dict_data().set("tools", jinja::from_json(options.tools));
  context.dict_data().set("add_generation_prompt", jinja::Value(options.add_generation_prompt));
  context.dict_data().set("enable_thinking", jinja::Value(options.enable_thinking));
  if (options.preserve_thinking) context.dict_data().set("preserve_thinking", jinja::Value(*options.preserve_thinking));
  if (options.continue_final_message) check_continuable(messages, options);
  jinja::RenderedText out = template_.render_marked(context);
  if (options.add_generation_prompt &&
      (messages.empty() || (messages.back().role != ChatRole::kUser && messages.back().role != ChatRole::kTool)))
    throw Error("the last message must be from the user");
  if (options.continue_final_message) cut_after_final_content(out, messages.back().content);
  return out;
}

// True if, rendered this way, a one-question prompt followed by an answer is a prefix of the
// next turn's prompt, with the same bytes counted as template text.
bool ChatTemplate::keeps_prefix(bool rewrite) const {
  try {
    const std::vector<ChatMessage> first = {{ChatRole::kUser, "Q"}};
    const std::vector<ChatMessage> next = {{ChatRole::kUser, "Q"}, {ChatRole::kAssistant, "A"}, {ChatRole::kUser, "R"}};
    const ChatTemplateOptions options;
    jinja::RenderedText a = render_marked(first, rewrite, options), b = render_marked(next, rewrite, options);
    if (!b.text.starts_with(a.text + "A")) return false;
    jinja::TrustSpans clipped;
    for (auto [lo, hi] : b.trusted) {
      if (lo >= a.text.size() + 1) break;
      clipped.emplace_back(lo, std::min(hi, a.text.size()));
    }
    while (!clipped.empty() && clipped.back().first >= clipped.back().second) clipped.pop_back();
    return clipped == a.trusted;
  } catch (const Error&) {
    return false;
  }
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  ChatTemplateOptions options;
  options.add_generation_prompt = add_generation_prompt;
  return render(messages, options);
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, const ChatTemplateOptions& options) const {
  return render_marked(messages, rewrite_history_, options).text;
}

std::vector<int32_t> ChatTemplate::encode(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                          bool add_generation_prompt) const {
  ChatTemplateOptions options;
  options.add_generation_prompt = add_generation_prompt;
  return encode(tokenizer, messages, options);
}

std::vector<int32_t> ChatTemplate::encode(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                          const ChatTemplateOptions& options, std::vector<int64_t>* message_starts,
                                          ChatEncodeTimings* timings) const {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const jinja::RenderedText r = render_marked(messages, rewrite_history_, options);
  const auto t1 = Clock::now();
  std::vector<int32_t> ids;
  const std::optional<int32_t> im_start = message_starts ? tokenizer.token_id("<|im_start|>") : std::nullopt;
  if (message_starts) message_starts->clear();
  auto add = [&](std::string_view text, bool trusted) {
    if (text.empty()) return;
    if (trusted)
      for (std::string_view marker : kMarkers)
        if (text.find(marker) != std::string_view::npos && !tokenizer.token_id(marker))
          throw Error("the tokenizer has no token for the chat-template marker " + std::string(marker));
    std::vector<int32_t> piece = tokenizer.encode(text, /*allow_special=*/trusted);
    if (trusted && im_start)
      for (size_t i = 0; i < piece.size(); ++i)
        if (piece[i] == *im_start && ids.size() + i > 0) message_starts->push_back(static_cast<int64_t>(ids.size() + i));
    ids.insert(ids.end(), piece.begin(), piece.end());
  };
  const std::string_view text = r.text;
  size_t at = 0;
  for (const auto& [begin, end] : r.trusted) {
    add(text.substr(at, begin - at), false);
    add(text.substr(begin, end - begin), true);
    at = end;
  }
  add(text.substr(at), false);
  if (timings) {
    timings->render_seconds += std::chrono::duration<double>(t1 - t0).count();
    timings->tokenize_seconds += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  return ids;
}

std::string render_chat(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  return ChatTemplate::builtin()->render(messages, add_generation_prompt);
}

std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 bool add_generation_prompt) {
  return ChatTemplate::builtin()->encode(tokenizer, messages, add_generation_prompt);
}

std::optional<ChatRole> chat_role_from_name(std::string_view name) {
  if (name == "system" || name == "developer") return ChatRole::kSystem;
  if (name == "user") return ChatRole::kUser;
  if (name == "assistant") return ChatRole::kAssistant;
  if (name == "tool") return ChatRole::kTool;
  return std::nullopt;
}

bool is_template_builtin(std::string_view name) { return jinja::is_known_global(name); }

}  // namespace lily
