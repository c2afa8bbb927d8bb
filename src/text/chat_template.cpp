// Native rendering of the Qwen3.5/3.6 ChatML template with thinking disabled
// (reference/model.md §6.1), as a list of parts so that encoding can keep template markers
// (control tokens) apart from message content (always plain text).
#include "text/chat_template.h"

#include <utf8proc.h>

#include "base/error.h"
#include "text/utf8.h"

namespace lily {
namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kThink = "<think>";
constexpr std::string_view kEndThink = "</think>";
constexpr std::string_view kEmptyThinkBlock = "<think>\n\n</think>\n\n";

enum class PartKind { kMarker, kLiteral, kContent };

struct Part {
  PartKind kind;
  std::string text;
};

// Unicode White_Space, the set Jinja's `trim` strips in minijinja (Rust str::trim).
bool is_white_space(int32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Decodes the code point at s[i] (s is well-formed UTF-8); sets len to its byte length.
int32_t code_point_at(std::string_view s, size_t i, size_t& len) {
  utf8proc_int32_t cp = 0;
  auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                            static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  len = n > 0 ? static_cast<size_t>(n) : 1;
  return cp;
}

// Length of the UTF-8 code point that ends at s[end - 1].
size_t last_code_point_length(std::string_view s, size_t end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
  return end - start;
}

std::string trim(std::string_view input) {
  std::string valid = utf8::to_valid_lossy(input);
  std::string_view s = valid;
  size_t begin = 0, end = s.size(), len = 0;
  while (begin < end && is_white_space(code_point_at(s, begin, len))) begin += len;
  while (end > begin) {
    size_t n = last_code_point_length(s, end);
    if (!is_white_space(code_point_at(s, end - n, len))) break;
    end -= n;
  }
  return std::string(s.substr(begin, end - begin));
}

std::string strip_newlines(std::string_view s, bool left, bool right) {
  size_t b = 0, e = s.size();
  while (left && b < e && s[b] == '\n') ++b;
  while (right && e > b && s[e - 1] == '\n') --e;
  return std::string(s.substr(b, e - b));
}

class PartList {
 public:
  void marker(std::string_view m) { parts_.push_back({PartKind::kMarker, std::string(m)}); }
  void literal(std::string_view text) {
    if (text.empty()) return;
    if (!parts_.empty() && parts_.back().kind == PartKind::kLiteral) {
      parts_.back().text += text;  // adjacent literals encode as one string
    } else {
      parts_.push_back({PartKind::kLiteral, std::string(text)});
    }
  }
  void content(std::string_view text) {
    if (!text.empty()) parts_.push_back({PartKind::kContent, std::string(text)});
  }
  const std::vector<Part>& parts() const { return parts_; }

 private:
  std::vector<Part> parts_;
};

bool is_tool_response(std::string_view trimmed) {
  return trimmed.starts_with("<tool_response>") && trimmed.ends_with("</tool_response>");
}

// Index of the last user message that is not a <tool_response> block (model.md §6.1).
size_t last_query_index(std::span<const ChatMessage> messages) {
  for (size_t i = messages.size(); i-- > 0;)
    if (messages[i].role == ChatRole::kUser && !is_tool_response(trim(messages[i].content))) return i;
  throw Error("No user query found in messages.");
}

void validate(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  last_query_index(messages);
  for (size_t i = 1; i < messages.size(); ++i)
    if (messages[i].role == ChatRole::kSystem) throw Error("System message must be at the beginning.");
  if (add_generation_prompt && messages.back().role != ChatRole::kUser)
    throw Error("the last message must be from the user");
}

// `<think>\n\n</think>\n\n…` with the block as markers; `text` starts with the empty block,
// or is exactly "<think>\n\n</think>" when the trimmed answer was empty.
void emit_rewritten_answer(PartList& out, std::string_view text) {
  out.marker(kThink);
  out.literal("\n\n");
  out.marker(kEndThink);
  std::string_view rest = text.substr(std::min(text.size(), kEmptyThinkBlock.size() - 2));
  if (rest.starts_with("\n\n")) {
    out.literal("\n\n");
    rest.remove_prefix(2);
  }
  out.content(rest);
}

// An assistant turn at or before the last query: lily's nothink rewrite (model.md §6.1).
void emit_history_answer(PartList& out, const std::string& content) {
  std::string with_block =
      std::string_view(content).starts_with(kEmptyThinkBlock) ? content : std::string(kEmptyThinkBlock) + content;
  emit_rewritten_answer(out, trim(with_block));
}

// An assistant turn after the last query: the template's native path, reasoning split out
// of the content at `</think>` (Qwen3-family string operations).
void emit_native_answer(PartList& out, const std::string& content) {
  std::string c = trim(content);
  std::string reasoning;
  size_t close = c.find(kEndThink);
  if (close != std::string::npos) {
    std::string before = strip_newlines(std::string_view(c).substr(0, close), false, true);
    size_t open = before.rfind(kThink);
    reasoning = strip_newlines(open == std::string::npos ? before : before.substr(open + kThink.size()), true, false);
    c = strip_newlines(std::string_view(c).substr(c.rfind(kEndThink) + kEndThink.size()), true, false);
  }
  out.marker(kThink);
  out.literal("\n");
  out.content(strip_newlines(reasoning, true, true));
  out.literal("\n");
  out.marker(kEndThink);
  out.literal("\n\n");
  out.content(c);
}

std::vector<Part> render_parts(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  validate(messages, add_generation_prompt);
  size_t last_query = last_query_index(messages);
  PartList out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out.marker(kImStart);
    if (m.role == ChatRole::kAssistant) {
      out.literal("assistant\n");
      if (i <= last_query) {
        emit_history_answer(out, m.content);
      } else {
        emit_native_answer(out, m.content);
      }
    } else {
      out.literal(m.role == ChatRole::kSystem ? "system\n" : "user\n");
      out.content(trim(m.content));
    }
    out.marker(kImEnd);
    out.literal("\n");
  }
  if (!add_generation_prompt) return out.parts();
  out.marker(kImStart);
  out.literal("assistant\n");
  out.marker(kThink);
  out.literal("\n\n");
  out.marker(kEndThink);
  out.literal("\n\n");
  return out.parts();
}

}  // namespace

std::string render_chat(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  std::string text;
  for (const Part& p : render_parts(messages, add_generation_prompt)) text += p.text;
  return text;
}

std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 bool add_generation_prompt) {
  std::vector<int32_t> ids;
  for (const Part& p : render_parts(messages, add_generation_prompt)) {
    if (p.kind == PartKind::kMarker) {
      std::optional<int32_t> id = tokenizer.token_id(p.text);
      if (!id) throw Error("the tokenizer has no token for the chat-template marker " + p.text);
      ids.push_back(*id);
    } else {
      std::vector<int32_t> piece = tokenizer.encode(p.text, /*allow_special=*/false);
      ids.insert(ids.end(), piece.begin(), piece.end());
    }
  }
  return ids;
}

std::optional<ChatRole> chat_role_from_name(std::string_view name) {
  if (name == "system") return ChatRole::kSystem;
  if (name == "user") return ChatRole::kUser;
  if (name == "assistant") return ChatRole::kAssistant;
  return std::nullopt;
}

}  // namespace lily
