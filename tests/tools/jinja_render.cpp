// jinja_render: renders chat templates with lily's engine (src/text/jinja) for the Node tests
// (tests/node/jinja.test.mjs), which compare the output with @huggingface/jinja byte for byte.
// One JSON request per line on stdin, one reply per line on stdout:
//   {"template": PATH, "context": {...}}   or   {"source": TEXT, "context": {...}}
//   -> {"text": RENDERED}  |  {"error": MESSAGE, "kind": "syntax" | "raised" | "render"}
// Parsed templates are cached by path. The context keeps its member order.
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "base/file_util.h"
#include "text/jinja/template.h"

namespace {

using json = nlohmann::ordered_json;

const lily::jinja::Template& load(std::map<std::string, lily::jinja::Template>& cache, const std::string& path) {
  auto it = cache.find(path);
  if (it != cache.end()) return it->second;
  return cache.emplace(path, lily::jinja::Template(lily::read_regular_file(path))).first->second;
}

}  // namespace

int main() {
  std::map<std::string, lily::jinja::Template> cache;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    json reply;
    try {
      json req = json::parse(line);
      json context = req.value("context", json::object());
      if (req.contains("template")) {
        reply["text"] = load(cache, req["template"].get<std::string>()).render(context);
      } else {
        reply["text"] = lily::jinja::Template(req.at("source").get<std::string>()).render(context);
      }
    } catch (const lily::jinja::TemplateSyntaxError& e) {
      reply = {{"error", e.what()}, {"kind", "syntax"}};
    } catch (const lily::jinja::TemplateRaisedError& e) {
      reply = {{"error", e.what()}, {"kind", "raised"}};
    } catch (const lily::jinja::TemplateRenderError& e) {
      reply = {{"error", e.what()}, {"kind", "render"}};
    } catch (const std::exception& e) {
      reply = {{"error", e.what()}, {"kind", "other"}};
    }
    std::cout << reply.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  }
  return 0;
}
