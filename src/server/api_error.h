// An HTTP API error in OpenAI's shape: {"error":{"message","type","param","code"}}.
#pragma once
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily::server {

/// `text` with every NUL byte written as the six characters `\u0000`, so that a C string of it
/// (what(), a log line) shows the whole text instead of stopping at the first NUL.
inline std::string escape_nul(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\0')
      out += "\\u0000";
    else
      out += c;
  }
  return out;
}

/// A request failure with its HTTP status, OpenAI error `type`, offending `param` and `code`,
/// plus extra response headers (Allow, Retry-After). The message is shown to the client as is, whole:
/// body() and the server's log line use message(); what() is the message with NULs escaped
/// (escape_nul), since a C string stops at the first NUL byte (a request's model name "a\0b"
/// would otherwise come back, and be logged, as "the model 'a").
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::optional<std::string> param = {},
           std::optional<std::string> code = {})
      : std::runtime_error(escape_nul(message)), message_(std::move(message)), status_(status),
        type_(std::move(type)), param_(std::move(param)), code_(std::move(code)) {}

  /// The whole message, NUL bytes included.
  const std::string& message() const { return message_; }
  /// The HTTP status (400, 404, 503, …).
  int status() const { return status_; }
  /// OpenAI's error `type` (invalid_request_error, server_error, …).
  const std::string& type() const { return type_; }
  /// The offending request field, if any.
  const std::optional<std::string>& param() const { return param_; }
  /// The machine-readable `code` (model_not_found, model_unavailable, …), if any.
  const std::optional<std::string>& code() const { return code_; }
  /// Extra response headers (Allow, Retry-After).
  const std::vector<std::pair<std::string, std::string>>& headers() const { return headers_; }
  /// Adds a response header; returns *this for chaining.
  ApiError& with_header(std::string name, std::string value) {
    headers_.emplace_back(std::move(name), std::move(value));
    return *this;
  }

  /// The JSON body {"error":{"message","type","param","code"}} (null for absent param/code).
  nlohmann::ordered_json body() const {
    nlohmann::ordered_json e = {{"message", message_}, {"type", type_}, {"param", nullptr}, {"code", nullptr}};
    if (param_) e["param"] = *param_;
    if (code_) e["code"] = *code_;
    return {{"error", e}};
  }

 private:
  std::string message_;
  int status_;
  std::string type_;
  std::optional<std::string> param_;
  std::optional<std::string> code_;
  std::vector<std::pair<std::string, std::string>> headers_;
};

/// 400 invalid_request_error naming `param` (code defaults to "invalid_value").
inline ApiError invalid_request(std::string message, std::optional<std::string> param,
                                std::string code = "invalid_value") {
  return ApiError(400, "invalid_request_error", std::move(message), std::move(param), std::move(code));
}

/// 400 missing_required_parameter: "missing required parameter 'PARAM'".
inline ApiError missing_parameter(const std::string& param) {
  return invalid_request("missing required parameter '" + param + "'", param, "missing_required_parameter");
}

/// A JSON value's type as a client would say it: "integer" and "number" apart (nlohmann calls
/// both "number"), otherwise nlohmann's name ("string", "array", "object", "boolean", "null").
inline std::string json_type_name(const nlohmann::json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

/// 400 invalid_type for a request field of the wrong JSON type: "'PARAM' must be EXPECTED, got TYPE".
inline ApiError wrong_type(const std::string& param, const std::string& expected, const nlohmann::json& got) {
  return invalid_request("'" + param + "' must be " + expected + ", got " + json_type_name(got), param,
                         "invalid_type");
}

}  // namespace lily::server
