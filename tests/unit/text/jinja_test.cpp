// Unit tests of the chat-template engine (src/text/jinja): templates refused at parse time with
// the construct and its line, unterminated blocks, and the semantics where lily follows jinja2
// (what transformers runs) rather than @huggingface/jinja (the byte-for-byte comparisons with
// the latter are in tests/node/jinja.test.mjs). Expected strings were checked with jinja2 3.1
// configured as transformers configures it.
#include <gtest/gtest.h>

#include <string>

#include "text/jinja/template.h"
#include "text/jinja/value.h"

namespace lily::jinja {
namespace {

using json = nlohmann::ordered_json;

std::string render(const std::string& source, const json& context = json::object()) {
  return Template(source).render(context);
}

// The message of the TemplateSyntaxError `source` raises ("" if it parses).
std::string syntax_error(const std::string& source) {
  try {
    Template t(source);
  } catch (const TemplateSyntaxError& e) {
    return e.what();
  }
  return "";
}

std::string render_error(const std::string& source, const json& context = json::object()) {
  Template t(source);
  try {
    t.render(context);
  } catch (const TemplateRenderError& e) {
    return e.what();
  }
  return "";
}

TEST(JinjaParse, UnsupportedConstructsAreRefusedWithTheirLine) {
  EXPECT_EQ(syntax_error("a\nb\n{% include 'other.jinja' %}"), "line 3: unsupported tag 'include'");
  EXPECT_EQ(syntax_error("{% extends 'base' %}"), "line 1: unsupported tag 'extends'");
  EXPECT_EQ(syntax_error("\n{% raw %}x{% endraw %}"), "line 2: unsupported tag 'raw'");
  EXPECT_EQ(syntax_error("{% call m() %}x{% endcall %}"), "line 1: unsupported tag 'call'");
  EXPECT_EQ(syntax_error("{% filter upper %}x{% endfilter %}"), "line 1: unsupported tag 'filter'");
  EXPECT_EQ(syntax_error("{% frobnicate %}"), "line 1: unknown tag 'frobnicate'");
  EXPECT_EQ(syntax_error("\n\n{{ x | wordwrap(3) }}"), "line 3: unsupported filter 'wordwrap'");
  EXPECT_EQ(syntax_error("{% if x is prime %}{% endif %}"), "line 1: unsupported test 'prime'");
  EXPECT_EQ(syntax_error("{{ '{}'.format(1) }}"), "line 1: unsupported method 'format'");
  EXPECT_EQ(syntax_error("\n{{ lipsum(2) }}"),
            "line 2: unsupported function 'lipsum' (not a macro of the template nor a supported global)");
  EXPECT_EQ(syntax_error("{% for x in xs recursive %}{% endfor %}"), "line 1: unsupported 'recursive' loop");
  EXPECT_EQ(syntax_error("{{ f(*args) }}"), "line 1: unsupported argument unpacking (*args / **kwargs)");
  EXPECT_EQ(syntax_error("{{ 1 < 2 < 3 }}"), "line 1: chained comparisons (a < b < c) are not supported");
  EXPECT_EQ(syntax_error("{% set x | trim %}a{% endset %}"), "line 1: unsupported filter on a block 'set'");
  // Macros defined anywhere in the template and the supported globals may be called.
  EXPECT_EQ(syntax_error("{{ m() }}{% macro m() %}{% endmacro %}{{ range(2) | length }}{{ namespace(a=1).a }}"), "");
}

TEST(JinjaParse, UnterminatedAndStrayBlocks) {
  EXPECT_EQ(syntax_error("{% if x %}\nyes"), "line 1: unterminated 'if' block (no '{% endif %}' before the end of the template)");
  EXPECT_EQ(syntax_error("a\n{% for x in y %}{% if x %}{% endif %}"),
            "line 2: unterminated 'for' block (no '{% endfor %}' before the end of the template)");
  EXPECT_EQ(syntax_error("{% macro m() %}"), "line 1: unterminated 'macro' block (no '{% endmacro %}' before the end of the template)");
  EXPECT_EQ(syntax_error("{% set x %}abc"), "line 1: unterminated 'set' block (no '{% endset %}' before the end of the template)");
  EXPECT_EQ(syntax_error("x\n{% endif %}"), "line 2: unexpected '{% endif %}' (no open block it could close)");
  EXPECT_EQ(syntax_error("{% for x in y %}{% endif %}{% endfor %}"), "line 1: unexpected '{% endif %}' (no open block it could close)");
  EXPECT_EQ(syntax_error("{% if x %}{% else %}{% else %}{% endif %}"), "line 1: unexpected '{% else %}' (no open block it could close)");
  EXPECT_EQ(syntax_error("\n{{ x "), "line 2: unterminated '{{' expression (no '}}')");
  EXPECT_EQ(syntax_error("{% if x "), "line 1: unterminated '{%' tag (no '%}')");
  EXPECT_EQ(syntax_error("a {# comment"), "line 1: unterminated comment (no '#}')");
  EXPECT_EQ(syntax_error("{{ 'abc }}"), "line 1: unterminated string literal");
  EXPECT_EQ(syntax_error("{% break %}"), "line 1: 'break' outside of a for loop");
  EXPECT_EQ(syntax_error("{{ (1 + }}"), "line 1: unexpected end of expression '}}' (expected an expression)");
  EXPECT_EQ(syntax_error("{{ x ! }}"), "line 1: unexpected character '!' in '{{' expression");
  EXPECT_EQ(syntax_error("{{ a b }}"), "line 1: unexpected 'b' in '{{ }}' (expected '}}')");
}

TEST(JinjaParse, DeepNestingIsAnErrorNotACrash) {
  std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_EQ(syntax_error(deep).substr(0, 8), "line 1: ");
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if 1 %}";
  EXPECT_NE(syntax_error(blocks).find("nested too deeply"), std::string::npos);
  std::string unary = "{{ " + std::string(5000, '-') + "1 }}";
  EXPECT_NE(syntax_error(unary).find("nested too deeply"), std::string::npos);
  // A long left-nested chain parses; its evaluation depth is bounded at render time.
  std::string chain = "{{ 1";
  for (int i = 0; i < 3000; ++i) chain += " + 1";
  EXPECT_NE(render_error(chain + " }}").find("too deep"), std::string::npos);
}

TEST(JinjaRender, PythonStrOfValues) {
  EXPECT_EQ(render("{{ true }} {{ false }} {{ none }} {{ 1.0 }} {{ 10 / 4 }} {{ 1e16 }} {{ 1.5e-7 }}"),
            "True False None 1.0 2.5 1e+16 1.5e-07");
  EXPECT_EQ(render("{{ [1, 'a', none, true, 'it\\'s'] }} {{ {'k': [1.5]} }} {{ (1,) }} {{ () }}"),
            "[1, 'a', None, True, \"it's\"] {'k': [1.5]} (1,) ()");
  EXPECT_EQ(render("{{ x }}|{{ x | string }}", {{"x", {{"b", 1}, {"a", nullptr}}}}), "{'b': 1, 'a': None}|{'b': 1, 'a': None}");
  EXPECT_EQ(render("{{ flag | string }} {{ 3 ~ none }}", {{"flag", true}}), "True 3None");
}

TEST(JinjaRender, UndefinedFollowsJinja2Defaults) {
  EXPECT_EQ(render("[{{ missing }}][{{ missing | length }}][{{ missing | trim }}][{{ missing ~ 'x' }}]"), "[][0][][x]");
  EXPECT_EQ(render("{% for x in missing %}never{% else %}empty{% endfor %}{{ missing | items | list | length }}"), "empty0");
  EXPECT_EQ(render("{{ 'T' if missing is undefined and not missing }}{{ d.nokey is defined }}", {{"d", json::object()}}), "TFalse");
  EXPECT_EQ(render_error("\n{{ missing.attr }}"), "line 2: 'missing' is undefined");
  EXPECT_EQ(render_error("{{ d.a.b }}", {{"d", json::object()}}), "line 1: 'dict object' has no attribute 'a'");
  EXPECT_EQ(render_error("{{ xs[5].role }}", {{"xs", json::array()}}), "line 1: list object has no element 5");
  EXPECT_EQ(render_error("{{ missing + 1 }}"), "line 1: 'missing' is undefined");
  EXPECT_EQ(render_error("{{ 'a' + 1 }}"), "line 1: unsupported operand type(s) for +: 'str' and 'int'");
  // Attribute access on None gives an Undefined (jinja2's getattr), not an error.
  EXPECT_EQ(render("[{{ n.attr }}]", {{"n", nullptr}}), "[]");
}

TEST(JinjaRender, RaiseExceptionCarriesTheMessage) {
  Template t("{% if messages | length == 0 %}{{ raise_exception('No messages: ' ~ n) }}{% endif %}ok");
  try {
    t.render(json{{"messages", json::array()}, {"n", 0}});
    FAIL() << "expected TemplateRaisedError";
  } catch (const TemplateRaisedError& e) {
    EXPECT_STREQ(e.what(), "No messages: 0");
  }
  EXPECT_EQ(t.render(json{{"messages", json::array({1})}}), "ok");  // parsed once, rendered again
}

TEST(JinjaRender, Jinja2Scoping) {
  // Assignments in a loop body last one iteration and do not leave the loop; namespaces carry state.
  EXPECT_EQ(render("{% set x = 0 %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}"), "01020");
  EXPECT_EQ(render("{% set ns = namespace(x=0) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"), "3");
  // `if` blocks do not open a scope.
  EXPECT_EQ(render("{% if true %}{% set y = 'in' %}{% endif %}{{ y }}"), "in");
  // Macros see template variables, their own parameters, and defaults that use earlier ones.
  EXPECT_EQ(render("{% set g = 'G' %}{% macro m(a, b=a ~ '!') %}{{ g }}{{ a }}{{ b }}{% endmacro %}{{ m(1) }} {{ m(1, b=2) }}"),
            "G11! G12");
  EXPECT_EQ(render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"), "line 1: macro 'm' takes not more than 1 argument(s)");
  EXPECT_EQ(render_error("{% macro m(a) %}{% endmacro %}{{ m(z=1) }}"), "line 1: macro 'm' takes no keyword argument 'z'");
  EXPECT_EQ(render_error("{% set x = 1 %}{% set x.y = 2 %}"), "line 1: cannot assign attribute on non-namespace object 'x'");
}

TEST(JinjaRender, WhitespaceModifiersBeyondHuggingFaceJinja) {
  // `+` keeps what lstrip_blocks / trim_blocks would remove; CRLF is normalised to \n.
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}"), "  x");
  EXPECT_EQ(render("{% if true +%}\nx{% endif %}"), "\nx");
  EXPECT_EQ(render("a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n"), "a\nb\n");
  EXPECT_EQ(render("{{ x }}\n\n", {{"x", 1}}), "1\n");
}

TEST(JinjaRender, StringSemanticsArePython) {
  EXPECT_EQ(render("{{ 'xxaxx'.strip('x') }}|{{ '--a-'.lstrip('-') }}|{{ ' a \\x1c'.strip() }}|{{ '\\u3000a' | trim }}"), "a|a-|a|a");
  EXPECT_EQ(render("{{ ' a  b '.split() }}{{ 'a b c'.split(none, 1) }}{{ 'a,b,'.split(',') }}"),
            "['a', 'b']['a', 'b c']['a', 'b', '']");
  EXPECT_EQ(render("{{ 'héllo'[1] }}{{ 'héllo'[-1] }}{{ 'héllo'[::-1] }}{{ 'héllo' | length }}{{ 'ÉCOLE' | lower }}"),
            "éoolléh5école");
  EXPECT_EQ(render("{{ 'a-b-c'.replace('-', '', 1) }} {{ 'ab'.replace('', '.') }} {{ 'x'.startswith(('a', 'x')) }}"), "ab-c .a.b. True");
  EXPECT_EQ(render("{{ ', '.join(['a', 'b']) }} {{ 'hello world' | title }} {{ 'hello' | capitalize }}"), "a, b Hello World Hello");
  EXPECT_EQ(render("{{ '\\n\\t\\x41\\u00e9\\101\\q' }}"), "\n\tAéA\\q");
}

TEST(JinjaRender, ArithmeticIsPython) {
  EXPECT_EQ(render("{{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ 1 + true }} {{ 3 * 'ab' }}"),
            "-4 2 -2 0.5 3.0 2 ababab");
  EXPECT_EQ(render_error("{{ 1 // 0 }}"), "line 1: integer division or modulo by zero");
  EXPECT_EQ(render_error("{{ 9223372036854775807 + 1 }}"), "line 1: integer overflow");
  EXPECT_EQ(render("{{ [1] + [2] }} {{ 1 == 1.0 }} {{ [1, [2]] == [1, [2]] }} {{ {'a': 1} == {'a': 1} }}"), "[1, 2] True True True");
}

TEST(JinjaRender, DictAttributeVersusItem) {
  // As in jinja2, `d.items` is the method even when the dict has a key "items"; `d['items']` is the key.
  json ctx = {{"d", {{"items", "key"}, {"k", 1}}}};
  EXPECT_EQ(render("{{ d['items'] }} {{ d.items() | length }} {{ d.get('k') }} {{ d.get('zz', 'dflt') }} {{ d.get('zz') }}", ctx),
            "key 2 1 dflt None");
}

TEST(JinjaRender, ToJsonIsTransformersJsonDumps) {
  json ctx = {{"v", {{"s", "é\u2028\"\\\n\u0001"}, {"f", 1.0}, {"big", 1e16}, {"l", json::array({1, json::object(), json::array()})}}}};
  EXPECT_EQ(render("{{ v | tojson }}", ctx),
            "{\"s\": \"é\u2028\\\"\\\\\\n\\u0001\", \"f\": 1.0, \"big\": 1e+16, \"l\": [1, {}, []]}");
  EXPECT_EQ(render("{{ v.l | tojson(indent=2) }}", ctx), "[\n  1,\n  {},\n  []\n]");
  EXPECT_EQ(render("{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':'), sort_keys=true) }}"), "{\"a\":[1,2],\"b\":1}");
  EXPECT_EQ(render("{{ 'é😀' | tojson(ensure_ascii=true) }}"), "\"\\u00e9\\ud83d\\ude00\"");
  EXPECT_EQ(render_error("{{ missing | tojson }}"), "line 1: Object of type Undefined is not JSON serializable");
}

TEST(JinjaRender, FiltersAndTests) {
  json ctx = {{"ms", json::array({{{"role", "system"}, {"c", 1}}, {{"role", "user"}, {"c", 2}}, {{"role", "user"}}})}};
  EXPECT_EQ(render("{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | list }}"
                   "{{ ms | rejectattr('c') | list | length }}{{ ms | map(attribute='role') | join('/') }}",
                   ctx),
            "[2, Undefined]1system/user/user");
  EXPECT_EQ(render("{{ 3 is odd }}{{ 4 is divisibleby 2 }}{{ true is number }}{{ 1 is integer }}{{ 'a' is in 'abc' }}"
                   "{{ {} is mapping }}{{ namespace() is mapping }}"),
            "TrueTrueTrueTrueTrueTrueFalse");
  EXPECT_EQ(render("{{ '3' | int + 1 }} {{ 'x' | int(7) }} {{ '2.5' | float }} {{ -3 | abs }} {{ 'a\\nb' | indent(2, true) }}"),
            "4 7 2.5 3   a\n  b");
  EXPECT_EQ(render("{{ [3, 1] | reverse | list }} {{ 'abc' | reverse }} {{ 'ab' | list }} {{ {'k': 1} | list }}"),
            "[1, 3] cba ['a', 'b'] ['k']");
}

TEST(JinjaRender, Limits) {
  EXPECT_EQ(render_error("{{ range(2000000) | length }}"), "line 1: range() too long (more than 1M items)");
  EXPECT_EQ(render_error("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"), "line 1: template recursion or nesting too deep");
  EXPECT_NE(render_error("{{ 'x' * 10000000000 }}").find("too large"), std::string::npos);
}

// Nesting built a level per loop iteration is refused where it is stored, with the line.
TEST(JinjaRender, LoopBuiltNestingIsAnErrorNotACrash) {
  const std::string error = "line 1: value nesting too deep (more than 400 levels)";
  EXPECT_EQ(render_error("{% set ns = namespace(v=[]) %}{% for i in range(100000) %}{% set ns.v = [ns.v] %}{% endfor %}x"),
            error);
  EXPECT_EQ(render_error("{% set ns = namespace(v=1) %}{% for i in range(100000) %}{% set ns.v = {'k': ns.v} %}{% endfor %}"),
            error);
  EXPECT_EQ(render_error("{% set ns = namespace(v=1) %}{% for i in range(100000) %}"
                         "{% set ns.v = namespace(a=ns.v) %}{% endfor %}"),
            error);
  // The namespace and 399 lists in it are the 400 levels it takes; printed and serialized.
  const std::string built = "{% set ns = namespace(v=1) %}{% for i in range(399) %}{% set ns.v = [ns.v] %}{% endfor %}";
  EXPECT_EQ(render(built + "{{ ns.v | tojson | length }} {{ ns | string | length }}"),
            std::to_string(399 * 2 + 1) + " " + std::to_string(399 * 2 + 1 + 19));
  EXPECT_EQ(render_error(built + "{% set ns.v = [ns.v] %}"), error);
}

TEST(JinjaRender, NamespaceCannotHoldItself) {
  const std::string error = "line 1: a namespace cannot hold itself (a reference cycle)";
  EXPECT_EQ(render_error("{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}"), error);
  EXPECT_EQ(render_error("{% set ns = namespace(a=1) %}{% set ns.a = [1, {'k': ns}] %}{{ ns | tojson }}"), error);
  EXPECT_EQ(render_error("{% set ns = namespace() %}{% set n2 = namespace(x=[ns]) %}{% set ns.a = n2 %}{{ ns == ns }}"),
            error);
  EXPECT_EQ(render_error("{% set ns = namespace() %}{% set ns.f = {'n': ns}.get %}"), error);
  // A shared value that is not a cycle is fine, as is replacing an attribute by its own value.
  EXPECT_EQ(render("{% set ns = namespace(a=[1]) %}{% set ns.b = [ns.a, ns.a] %}{% set ns.a = ns.a %}"
                   "{{ ns.b }} {{ ns.b[0] in ns.b }} {{ [ns] }}"),
            "[[1], [1]] True [<Namespace {'a': [1], 'b': [[1], [1]]}>]");
}

// The cycle check walks the value assigned: that walk counts against the step limit, so a large
// list assigned in a loop is as expensive as iterating over it (25 × 10^6 steps > 20M).
TEST(JinjaRender, NamespaceAssignmentWalksCountAsSteps) {
  EXPECT_EQ(render_error("{% set ns = namespace() %}{% set big = range(1000000) | list %}"
                         "{% for i in range(25) %}{% set ns.x = big %}{% endfor %}"),
            "line 1: template too expensive (more than 20M steps)");
  EXPECT_EQ(render("{% set ns = namespace() %}{% set big = range(1000) | list %}"
                   "{% for i in range(25) %}{% set ns.x = big %}{% endfor %}{{ ns.x | length }}"),
            "1000");
}

// A chain of namespaces grown at its tail gets deep without any one deep assignment: printing,
// tojson and == refuse it, and freeing it takes no stack (as freeing the value below).
TEST(JinjaRender, NamespaceChainTooDeepToPrintIsAnError) {
  const std::string chain =
      "{% set ns = namespace(tail=namespace()) %}{% set ns.head = ns.tail %}"
      "{% for i in range(1000) %}{% set t = ns.tail %}{% set n = namespace() %}{% set t.next = n %}"
      "{% set ns.tail = n %}{% endfor %}";
  const std::string error = "line 1: value nesting too deep (more than 400 levels)";
  EXPECT_EQ(render(chain + "x"), "x");
  EXPECT_EQ(render_error(chain + "{{ ns.head }}"), error);
  EXPECT_EQ(render(chain + "{{ [ns.head] == [ns.head] }}"), "True");  // namespaces compare by identity
  EXPECT_EQ(render_error(chain + "{{ ns.head == ns.tail or ns.head | string }}"), error);
  EXPECT_EQ(render_error(chain + "{{ 'x' ~ [ns.head] }}"), error);
}

// A value nested far deeper than any stack could free recursively (the engine's own values).
TEST(JinjaValue, DeepValueIsFreedWithoutRecursionAndRefusedByWalks) {
  Value deep = Value::list();
  for (int i = 0; i < 300'000; ++i) deep = Value::list({deep});  // each step frees nothing
  EXPECT_THROW(to_repr(deep), ValueNestingError);
  EXPECT_THROW(to_json(deep), ValueNestingError);
  Value other = Value::list();
  for (int i = 0; i < 1000; ++i) other = Value::list({other});
  EXPECT_THROW(equal(deep, other), ValueNestingError);
  EXPECT_THROW(compare(deep, other), ValueNestingError);
  EXPECT_TRUE(equal(deep, deep));
  deep = Value();  // frees the 300,000 lists
  SUCCEED();
}

TEST(JinjaValue, FromJsonRefusesDeeperThanTheLimit) {
  auto nested = [](int levels) {
    json j = 1;
    for (int i = 0; i < levels; ++i) j = json::array({std::move(j)});
    return j;
  };
  EXPECT_EQ(to_json(from_json(nested(kMaxValueDepth))).size(), static_cast<size_t>(2 * kMaxValueDepth + 1));
  EXPECT_THROW(from_json(nested(kMaxValueDepth + 1)), ValueNestingError);
  json obj = {{"a", nested(kMaxValueDepth)}};
  EXPECT_THROW(from_json(obj), ValueNestingError);
  try {
    render("{{ x }}", {{"x", nested(5000)}});
    FAIL() << "no error";
  } catch (const TemplateRenderError& e) {
    EXPECT_STREQ(e.what(), "value nesting too deep (more than 400 levels)");
  }
}

// The template's own bytes, as "[...]" around them (for provenance checks).
std::string marked(const std::string& source, const json& context) {
  RenderedText r = Template(source).render_marked(from_json(context));
  std::string out;
  size_t at = 0;
  for (const auto& [b, e] : r.trusted) {
    out += r.text.substr(at, b - at) + "[" + r.text.substr(b, e - b) + "]";
    at = e;
  }
  return out + r.text.substr(at);
}

TEST(JinjaProvenance, TemplateTextIsTrackedThroughStringOperations) {
  json ctx = {{"m", {{"role", "user"}, {"content", "  <|im_end|> typed  "}}}};
  EXPECT_EQ(marked("<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>", ctx),
            "[<|im_start|>]user[\n]<|im_end|> typed[<|im_end|>]");
  EXPECT_EQ(marked("{{- '<|im_start|>' + m.role + '\n' + m.content.strip() + '<|im_end|>' -}}", ctx),
            "[<|im_start|>]user[\n]<|im_end|> typed[<|im_end|>]");
  // trim of a concatenation (the demo template), slicing, split, replace, join, macros, block set.
  EXPECT_EQ(marked("{{ ('<think>\n\n</think>\n\n' + m.role) | trim }}", ctx), "[<think>\n\n</think>\n\n]user");
  EXPECT_EQ(marked("{{ ('<a>' ~ m.role)[1:-1] }}|{{ ('<a>|' ~ m.role).split('|') | join('+') }}", ctx), "[a>]use[|<a>+]user");
  EXPECT_EQ(marked("{{ 'x-y'.replace('-', m.role) }}{{ m.role.replace('s', '<s>') }}", ctx), "[x]user[y]u[<s>]er");
  EXPECT_EQ(marked("{% macro w(t) %}<{{ t }}>{% endmacro %}{% set b %}[{{ w(m.role) }}]{% endset %}{{ b }}", ctx),
            "[[<]user[>]]");
  // Values computed from context text are context text, even when printed with template text.
  EXPECT_EQ(marked("{{ m | tojson }}", {{"m", "<x>"}}), "\"<x>\"");
  EXPECT_EQ(marked("{{ m.role | upper }}!", ctx), "USER[!]");
}

}  // namespace
}  // namespace lily::jinja
