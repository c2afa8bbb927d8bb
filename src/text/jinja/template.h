// The chat-template engine's entry point: a Jinja template (the subset chat templates use, as
// transformers' apply_chat_template configures jinja2: trim_blocks, lstrip_blocks, the
// loopcontrols extension, `raise_exception`, `strftime_now` and a `tojson` that is Python's
// json.dumps with ensure_ascii=False) parsed once and rendered many times.
//
// Semantics follow jinja2 3.1 under transformers (Python str(), repr(), ==, truthiness and
// str methods; default Undefined); @huggingface/jinja agrees on everything the tests compare.
// Known differences from @huggingface/jinja, where lily follows jinja2: `{{ true }}` renders
// "True" and `{{ none }}` "None"; printed lists and dicts use Python repr; `x.items` on a dict
// is the method even if the dict has a key "items"; `strip('x')` strips the given characters;
// attribute access on an undefined value is an error; `undefined|trim` is "".
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "text/jinja/value.h"

namespace lily::jinja {

struct Program;

/// Rendered text with the byte ranges that came from the template's own text (see TrustSpans).
struct RenderedText {
  std::string text;
  TrustSpans trusted;
};

/// A parsed template. Immutable; render() may be called from several threads at once.
class Template {
 public:
  /// Parses `source`. Throws TemplateSyntaxError ("line N: ...") for a syntax error or a
  /// construct outside the supported subset.
  explicit Template(std::string_view source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  /// Renders with the members of `context` (a dict) as variables. Throws TemplateRaisedError
  /// (raise_exception) or TemplateRenderError.
  std::string render(const Value& context) const;
  /// As above with a JSON object (member order kept); a context nested deeper than
  /// kMaxValueDepth throws ValueNestingError (no line).
  std::string render(const nlohmann::ordered_json& context) const;
  /// As render(), with the provenance of every byte: what the template wrote itself (its
  /// literals, kept through concatenation, trim, slicing, ...) versus what came from `context`.
  RenderedText render_marked(const Value& context) const;

 private:
  std::unique_ptr<const Program> program_;
};

}  // namespace lily::jinja
