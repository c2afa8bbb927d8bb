// The Qwen3.5/3.6 ChatML template with thinking disabled (reference/model.md §6.1), rendered
// natively, and its encoding with control tokens only where the template puts markers.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace lily {

enum class ChatRole { kSystem, kUser, kAssistant };

/// "system" | "user" | "assistant" → the role; nullopt for any other name. The one place that
/// maps role names (the server's request parser and the CLI's message lists use it).
std::optional<ChatRole> chat_role_from_name(std::string_view name);

struct ChatMessage {
  ChatRole role;
  std::string content;  ///< plain text (never parsed for special tokens)
};

/// Renders messages to the template's exact text (content trimmed; system only first; earlier
/// assistant turns rewritten with an empty think block so each prompt is a token-exact prefix
/// of the next turn's; generation suffix `<|im_start|>assistant\n<think>\n\n</think>\n\n`).
/// Throws lily::Error: "System message must be at the beginning.", "No user query found in
/// messages.", "the last message must be from the user". Without `add_generation_prompt` the
/// generation suffix is left out and the last message may also be from the assistant (what a
/// client counting a whole conversation's tokens asks for).
std::string render_chat(std::span<const ChatMessage> messages, bool add_generation_prompt = true);

/// Renders and encodes: template markers become control tokens, message content is encoded
/// with special tokens disabled (so `<|im_start|>` typed by a user stays plain text).
/// Throws lily::Error as render_chat, or if the tokenizer lacks a marker token.
std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 bool add_generation_prompt = true);

}  // namespace lily
