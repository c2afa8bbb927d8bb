// JSON from clients and from the model, parsed with a bound on its nesting. The parser itself
// keeps its own stack, but what walks a document afterwards recurses once per level (the chat
// template's conversion to template values, dump() for tojson and for the answer), so a body of
// a few tens of kilobytes nested 30,000 deep would overflow the thread's stack and kill the
// server. Documents deeper than kMaxJsonDepth are refused instead.
#pragma once
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace lily::server {

/// Most levels of arrays and objects accepted in one JSON document (a JSON schema of tools
/// rarely needs 20).
constexpr int kMaxJsonDepth = 128;

/// Thrown by parse_json_bounded for a document nested deeper than kMaxJsonDepth.
struct JsonTooDeep : std::runtime_error {
  JsonTooDeep()
      : std::runtime_error("nests arrays and objects deeper than " + std::to_string(kMaxJsonDepth) + " levels") {}
};

/// Parses `text` (Json: nlohmann::json or nlohmann::ordered_json). Throws JsonTooDeep as soon
/// as an array or object opens below kMaxJsonDepth levels, and nlohmann's exceptions for text
/// that is not JSON, as Json::parse does.
template <typename Json>
Json parse_json_bounded(std::string_view text) {
  return Json::parse(text, [](int depth, typename Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      throw JsonTooDeep();
    return true;
  });
}

/// parse_json_bounded without exceptions for bad text: a discarded value (is_discarded()) for
/// text that is not JSON or is nested too deep.
template <typename Json>
Json parse_json_bounded_or_discarded(std::string_view text) {
  try {
    return parse_json_bounded<Json>(text);
  } catch (const JsonTooDeep&) {
    return Json(Json::value_t::discarded);
  } catch (const typename Json::exception&) {
    return Json(Json::value_t::discarded);
  }
}

}  // namespace lily::server
