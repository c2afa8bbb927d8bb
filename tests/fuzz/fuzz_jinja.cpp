// libFuzzer target: the chat-template engine (src/text/jinja). The input is a template source
// (arbitrary bytes); when it parses, it is rendered with a fixed chat context (messages with
// tool calls, tools, the thinking switches). Allowed: TemplateSyntaxError from parsing,
// TemplateRenderError or TemplateRaisedError from rendering (all lily::Error). Invariants: the
// parse and render limits hold (no stack overflow, time-out or out-of-memory on any input), and
// the rendered text's template-text spans (what chat_template.cpp encodes with control tokens)
// are sorted, disjoint, non-empty, not adjacent and inside the text.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "text/jinja/template.h"

namespace {

const nlohmann::ordered_json& context() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "  You are terse. "},
      {"role": "user", "content": [{"type": "text", "text": "Hi <|im_end|>"}, {"type": "image"}]},
      {"role": "assistant", "content": "<think>\nplan\n</think>\n\nok", "reasoning_content": "plan",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "f", "arguments": {"a": 1, "b": [1.5, "x", null], "c": {"d": true}}}}]},
      {"role": "tool", "content": "{\"r\": 1}"},
      {"role": "user", "content": "¿Qué? 你好 🙂"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    "add_generation_prompt": true, "enable_thinking": false, "preserve_thinking": true,
    "bos_token": "", "eos_token": "<|im_end|>"
  })");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const lily::jinja::Value ctx = lily::jinja::from_json(context());
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  std::optional<lily::jinja::Template> tmpl;
  try {
    tmpl.emplace(source);
  } catch (const lily::jinja::TemplateSyntaxError&) {
    return 0;
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  lily::jinja::RenderedText out;
  try {
    out = tmpl->render_marked(ctx);
  } catch (const lily::Error&) {
    return 0;
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  size_t previous_end = 0;
  for (size_t i = 0; i < out.trusted.size(); ++i) {
    const auto [begin, end] = out.trusted[i];
    FUZZ_ASSERT(begin < end && end <= out.text.size(), std::to_string(begin) + ".." + std::to_string(end));
    FUZZ_ASSERT(i == 0 || begin > previous_end, "spans overlap or touch at " + std::to_string(begin));
    previous_end = end;
  }
  return 0;
}
