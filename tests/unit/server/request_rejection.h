// What the request-validation tests share: the bodies they start from, the one-field edits they
// make to them, and the 400 a request parser throws for a body.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "server/api_error.h"

namespace lily::server::test {

/// The smallest chat request every parser accepts: model "demo", one user message "hi". The
/// chat tests build each case from it by one edit, so a rejection names the edited field.
inline nlohmann::json minimal_chat_body() {
  return nlohmann::json{{"model", "demo"}, {"messages", nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}})}};
}

/// `body` with its top-level member `key` set to `value` (added, or replacing the one there);
/// the argument is a copy, so callers can pass the same base body to every case.
inline nlohmann::json with(nlohmann::json body, const std::string& key, const nlohmann::json& value) {
  body[key] = value;
  return body;
}

/// The ApiError that `parse(body)` throws, checked to be a 400 invalid_request_error (every
/// validation failure a client can cause); nullopt when the parser accepts the body.
template <class Parse>
std::optional<ApiError> rejection_of(Parse&& parse, const std::string& body) {
  try {
    parse(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.type(), "invalid_request_error");
    return e;
  }
  return std::nullopt;
}

/// "param|code" of a rejection, "<none>" for either when absent: one string to compare.
inline std::string param_and_code(const ApiError& e) {
  return e.param().value_or("<none>") + "|" + e.code().value_or("<none>");
}

}  // namespace lily::server::test
