// What the request-validation tests share: the 400 a request parser throws for a body.
#pragma once
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "server/api_error.h"

namespace lily::server::test {

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
