// libFuzzer target: the chat-completion request parser and validator (src/server/chat_request.h)
// on arbitrary bodies, followed by what the server does next with a request: render the chat
// template, or serialize the error response. Allowed: server::ApiError from the parser (its
// JSON body must then serialize: the server sends it), lily::Error from the template.
// Invariants for accepted requests (the documented contract): messages non-empty and the last
// from the user, max_tokens ≥ 1 when set, at most 4 non-empty stop strings, include_usage only
// with stream.
#include <cstdint>
#include <string>
#include <string_view>

#include "base/error.h"
#include "fuzz_support.h"
#include "server/api_error.h"
#include "server/chat_request.h"
#include "server/openai_json.h"
#include "text/chat_template.h"

namespace {

void check_accepted(const lily::server::ChatRequest& req) {
  FUZZ_ASSERT(!req.messages.empty(), "");
  FUZZ_ASSERT(req.messages.back().role == lily::ChatRole::kUser, "");
  FUZZ_ASSERT(!req.max_tokens || *req.max_tokens >= 1, "");
  FUZZ_ASSERT(req.stop.size() <= lily::server::kMaxStopStrings, "");
  for (const std::string& s : req.stop) FUZZ_ASSERT(!s.empty(), "");
  FUZZ_ASSERT(!req.include_usage || req.stream, "");
  try {
    (void)lily::render_chat(req.messages);
  } catch (const lily::Error&) {
    // e.g. only <tool_response> user messages: the server answers 400 with this message.
  }
}

void check_rejected(const lily::server::ApiError& e) {
  FUZZ_ASSERT(e.status() == 400, std::to_string(e.status()));
  FUZZ_ASSERT(std::string_view(e.what()).size() > 0, "");
  // The server sends this body (serialized as http_server.cpp does, invalid UTF-8 replaced).
  const std::string body = lily::server::dump(e.body());
  FUZZ_ASSERT(body.find("\"invalid_request_error\"") != std::string::npos, body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    check_accepted(lily::server::parse_chat_request(body));
  } catch (const lily::server::ApiError& e) {
    try {
      check_rejected(e);
    } catch (const std::exception& inner) {
      lily::fuzz::fail("serializing the error response threw:", std::string(inner.what()) + " for error '" +
                                                                   lily::fuzz::printable(e.what()) + "'");
    }
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
