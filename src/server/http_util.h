// Small pure pieces of the HTTP layer of `lily serve`: CORS origin lists and their
// answer headers, request ids, the Date header and request targets. Kept apart from the server
// so that they are unit-tested on their own.
#pragma once
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lily::server {

/// Parses `--allowed-origins`: a comma-separated list of origins (`scheme://host[:port]`, e.g.
/// `http://localhost:3000`) or `*` (any origin). Blanks around items are ignored, and so is a
/// trailing '/' of an item; an empty list means that CORS stays off. Throws OptionError
/// (engine/option_error.h) with field "allowed_origins", quoting the item that is not an origin.
std::vector<std::string> parse_allowed_origins(std::string_view list);

/// The `Access-Control-Allow-Origin` value for a request whose `Origin` header is `origin`:
/// "*" when the list holds `*`, the origin itself when it is in the list (exact, but scheme and
/// host compared without regard to case), nullopt when it is not allowed or absent.
std::optional<std::string> cors_allow_origin(const std::vector<std::string>& allowed, std::string_view origin);

/// The `Access-Control-Allow-Headers` of a preflight answer: the request's
/// `Access-Control-Request-Headers` echoed when it is a well-formed list of header names, else
/// "Authorization, Content-Type".
std::string cors_allow_headers(std::string_view requested);

/// Longest request id accepted from a client's `X-Request-Id`.
inline constexpr size_t kMaxRequestIdLength = 128;

/// True for a client request id this server takes over: 1 to 128 characters out of letters,
/// digits and `-_.:` (safe in a header and in a log line).
bool is_valid_request_id(std::string_view id);

/// The IMF-fixdate of `t` for the `Date` header: "Sun, 06 Nov 1994 08:49:37 GMT".
std::string http_date(std::chrono::system_clock::time_point t);

/// The path of a request target: the query is cut off, and an absolute-form target
/// ("http://host:8000/v1/models?x") loses its scheme and authority ("/v1/models"; "/" when it
/// has no path).
std::string request_path(std::string_view target);

/// A path segment with its percent-escapes decoded (RFC 3986 §2.1: "%2F" → "/", either case of
/// hex digit), or nullopt when a '%' is not followed by two hex digits. Nothing else changes
/// ('+' stays '+': that is a form encoding, not a path one).
std::optional<std::string> percent_decode(std::string_view segment);

/// True when the first line of `head` ends in a well-formed "HTTP/d.d" other than 1.0 and 1.1
/// ("GET / HTTP/9.9"): such a request gets 505, while a malformed version is a 400.
bool has_unsupported_http_version(std::string_view head);

/// The first transfer coding other than a single `chunked` in a Transfer-Encoding value (a
/// comma-separated list, all of a request's Transfer-Encoding fields joined; case, spaces and
/// `;` parameters ignored: "gzip, chunked" → "gzip", "chunked, chunked" → the second "chunked"),
/// or nullopt for "chunked" alone. This server decodes only chunked, so a request naming another
/// coding gets 501 (RFC 9112 §6.1).
std::optional<std::string> unsupported_transfer_coding(std::string_view value);

}  // namespace lily::server
