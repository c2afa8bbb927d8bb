// libFuzzer target: the ChatML template (src/text/chat_template.h) rendered and encoded with
// the demo tokenizer, on message lists decoded from the input. Input format: records separated
// by the byte 0x1E; each record's first byte picks the role (b % 3: system, user, assistant),
// the rest is the content (arbitrary bytes, possibly invalid UTF-8 or typed control tokens).
// Allowed: lily::Error from render_chat/encode_chat (and then from both). Invariants:
//   - the prompt has exactly messages+1 <|im_start|> and messages <|im_end|> control tokens,
//     whatever the user typed (typed markers stay plain text);
//   - it ends with the generation prefix `<|im_start|>assistant\n<think>\n\n</think>\n\n`;
//   - for well-formed NFC text, decode(encode_chat(m)) == render_chat(m);
//   - the prompt is a token-exact prefix of the next turn's prompt (the same messages, then
//     a plausible assistant answer and a new user message): what the prefix cache relies on.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <utf8proc.h>

#include "base/error.h"
#include "fuzz_support.h"
#include "fuzz_utf8.h"
#include "text/chat_template.h"

namespace {

constexpr char kSeparator = '\x1e';

std::vector<lily::ChatMessage> decode_messages(std::string_view in) {
  std::vector<lily::ChatMessage> messages;
  size_t pos = 0;
  while (pos <= in.size() && messages.size() < 64) {
    size_t end = in.find(kSeparator, pos);
    if (end == std::string_view::npos) end = in.size();
    std::string_view record = in.substr(pos, end - pos);
    if (!record.empty()) {
      static constexpr lily::ChatRole kRoles[] = {lily::ChatRole::kSystem, lily::ChatRole::kUser,
                                                  lily::ChatRole::kAssistant};
      messages.push_back({kRoles[static_cast<uint8_t>(record[0]) % 3], std::string(record.substr(1))});
    }
    pos = end + 1;
  }
  return messages;
}


/// An answer a model could have produced: some visible text, no think block of its own (the
/// template moves a client-supplied think block, so such answers legitimately re-tokenize).
bool plausible_answer(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); }) &&
         s.find("<think>") == std::string_view::npos && s.find("</think>") == std::string_view::npos;
}

void check_prompt(const lily::Tokenizer& tok, const std::vector<lily::ChatMessage>& messages,
                  const std::string& text, const std::vector<int32_t>& ids) {
  const int32_t im_start = *tok.token_id("<|im_start|>");
  const int32_t im_end = *tok.token_id("<|im_end|>");
  const auto n_start = std::count(ids.begin(), ids.end(), im_start);
  const auto n_end = std::count(ids.begin(), ids.end(), im_end);
  FUZZ_ASSERT(n_start == static_cast<long>(messages.size()) + 1, std::to_string(n_start));
  FUZZ_ASSERT(n_end == static_cast<long>(messages.size()), std::to_string(n_end));
  const std::string_view suffix = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
  FUZZ_ASSERT(text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0,
              lily::fuzz::printable(text));
  if (lily::fuzz::utf8_is_nfc(text)) {
    const std::string back = tok.decode(ids, /*skip_special=*/false);
    FUZZ_ASSERT(back == text, "rendered '" + lily::fuzz::printable(text) + "' decoded '" + lily::fuzz::printable(back) + "'");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& tok = lily::fuzz::demo_tokenizer();
  std::vector<lily::ChatMessage> messages =
      decode_messages(std::string_view(reinterpret_cast<const char*>(data), size));
  std::string text;
  try {
    text = lily::render_chat(messages);
  } catch (const lily::Error&) {
    // Rejected: encoding must reject it too.
    try {
      (void)lily::encode_chat(*tok, messages);
    } catch (const lily::Error&) {
      return 0;
    } catch (const std::exception& e) {
      lily::fuzz::unexpected_exception(e);
    }
    lily::fuzz::fail("render_chat threw but encode_chat accepted the messages");
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  try {
    const std::vector<int32_t> ids = lily::encode_chat(*tok, messages);
    check_prompt(*tok, messages, text, ids);
    // Next turn: the answer (the first message's content, if plausible) and a new question.
    const std::string answer = messages.front().content;
    if (plausible_answer(answer)) {
      std::vector<lily::ChatMessage> next = messages;
      next.push_back({lily::ChatRole::kAssistant, answer});
      next.push_back({lily::ChatRole::kUser, "and then?"});
      const std::vector<int32_t> next_ids = lily::encode_chat(*tok, next);
      FUZZ_ASSERT(next_ids.size() > ids.size() && std::equal(ids.begin(), ids.end(), next_ids.begin()),
                  "prompt is not a token prefix of the next turn (answer '" + lily::fuzz::printable(answer) + "')");
    }
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
