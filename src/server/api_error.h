// An HTTP API error in OpenAI's shape: {"error":{"message","type","param","code"}}.
#pragma once
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily::server {

/// A request failure with its HTTP status, OpenAI error `type`, offending `param` and `code`,
/// plus extra response headers (Allow, Retry-After). The message is shown to the client as is, whole:
/// body() uses message(), not what(), which stops at the first NUL byte (a request's model name
/// "a\0b" used to come back as "the model 'a").
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::optional<std::string> param = {},
           std::optional<std::string> code = {})
      : std::runtime_error(message), message_(message), status_(status), type_(std::move(type)),
        param_(std::move(param)), code_(std::move(code)) {}

  /// The whole message, NUL bytes included.
  const std::string& message() const { return message_; }
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::optional<std::string>& param() const { return param_; }
  const std::optional<std::string>& code() const { return code_; }
  const std::vector<std::pair<std::string, std::string>>& headers() const { return headers_; }
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

}  // namespace lily::server
