// libFuzzer target: the chat-template engine (src/text/jinja). The input is a template source
// (arbitrary bytes); when it parses, it is rendered twice with a fixed chat context (messages
// with tool calls, tools, the thinking switches). Allowed: TemplateSyntaxError from parsing,
// TemplateRenderError or TemplateRaisedError from rendering (all lily::Error). Invariants:
// rendering is deterministic (both renders agree, unless the template reads the clock), and
// the parse / render limits hold (no stack overflow, time-out or out-of-memory on any input).
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
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  std::optional<lily::jinja::Template> tmpl;
  try {
    tmpl.emplace(source);
  } catch (const lily::jinja::TemplateSyntaxError&) {
    return 0;
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  std::string first, second;
  bool failed_first = false, failed_second = false;
  try {
    first = tmpl->render(context());
  } catch (const lily::Error&) {
    failed_first = true;
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  try {
    second = tmpl->render(context());
  } catch (const lily::Error&) {
    failed_second = true;
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  if (source.find("strftime_now") == std::string_view::npos) {
    FUZZ_ASSERT(failed_first == failed_second, "one render failed, the other did not");
    FUZZ_ASSERT(first == second, "two renders of one template differ");
  }
  return 0;
}
