// The pure HTTP pieces of lily serve: --allowed-origins and the CORS answer headers,
// client request ids, the Date header, request targets and HTTP versions.
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine/option_error.h"
#include "server/http_util.h"

using namespace lily;
using namespace lily::server;

TEST(AllowedOrigins, ParsesCommaListsAndStar) {
  EXPECT_TRUE(parse_allowed_origins("").empty());
  EXPECT_TRUE(parse_allowed_origins(" , ").empty());
  EXPECT_EQ(parse_allowed_origins("*"), std::vector<std::string>{"*"});
  EXPECT_EQ(parse_allowed_origins("http://localhost:3000, https://App.Example.com/"),
            (std::vector<std::string>{"http://localhost:3000", "https://app.example.com"}));
  EXPECT_EQ(parse_allowed_origins("http://[::1]:8080"), std::vector<std::string>{"http://[::1]:8080"});
}

TEST(AllowedOrigins, RefusesWhatIsNotAnOrigin) {
  for (const char* bad : {"localhost:3000", "http://", "://x", "http://host:", "http://host:80x", "http://a b",
                          "1http://x", "http://[::1"}) {
    try {
      parse_allowed_origins(std::string("http://ok.example,") + bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const OptionError& e) {  // the option's field, then the item: no flag
      EXPECT_EQ(e.field(), "allowed_origins");
      EXPECT_EQ(std::string(e.what()).rfind(std::string("allowed_origins '") + bad + "' is not an origin", 0), 0u)
          << e.what();
    }
  }
}

TEST(Cors, AllowOriginMatchesExactlyOrStar) {
  const auto list = parse_allowed_origins("http://localhost:3000,https://app.example");
  EXPECT_EQ(cors_allow_origin(list, "http://localhost:3000"), "http://localhost:3000");
  EXPECT_EQ(cors_allow_origin(list, "HTTPS://APP.example"), "HTTPS://APP.example");  // echoed as sent
  EXPECT_FALSE(cors_allow_origin(list, "http://localhost:3001").has_value());
  EXPECT_FALSE(cors_allow_origin(list, "http://localhost:3000.evil.example").has_value());
  EXPECT_FALSE(cors_allow_origin(list, "https://localhost:3000").has_value());
  EXPECT_FALSE(cors_allow_origin(list, "").has_value());
  EXPECT_FALSE(cors_allow_origin(list, "null").has_value());
  EXPECT_FALSE(cors_allow_origin({}, "http://localhost:3000").has_value());
  const auto any = parse_allowed_origins("*");
  EXPECT_EQ(cors_allow_origin(any, "https://anything.example"), "*");
  EXPECT_EQ(cors_allow_origin(any, "null"), "*");
  EXPECT_FALSE(cors_allow_origin(any, "").has_value());
}

TEST(Cors, AllowHeadersEchoesWellFormedLists) {
  EXPECT_EQ(cors_allow_headers("authorization, content-type"), "authorization, content-type");
  EXPECT_EQ(cors_allow_headers(" X-Stainless-OS ,authorization"), "X-Stainless-OS, authorization");
  EXPECT_EQ(cors_allow_headers(""), "Authorization, Content-Type");
  EXPECT_EQ(cors_allow_headers("bad header, x"), "Authorization, Content-Type");
  EXPECT_EQ(cors_allow_headers("a\r\nSet-Cookie: x"), "Authorization, Content-Type");
}

TEST(RequestId, SafeCharactersUpTo128) {
  EXPECT_TRUE(is_valid_request_id(std::string(kMaxRequestIdLength, 'a')));
  EXPECT_FALSE(is_valid_request_id(std::string(kMaxRequestIdLength + 1, 'a')));
  for (const char* id : {"req_0123abcd", "trace-1.2:3_X"}) EXPECT_TRUE(is_valid_request_id(id)) << id;
  for (const char* id : {"", "has space", "quote\"", "new\nline", "caf\xc3\xa9"})
    EXPECT_FALSE(is_valid_request_id(id)) << id;
}

TEST(HttpDate, ImfFixdate) {
  EXPECT_EQ(http_date(std::chrono::system_clock::from_time_t(784111777)), "Sun, 06 Nov 1994 08:49:37 GMT");
  EXPECT_EQ(http_date(std::chrono::system_clock::from_time_t(0)), "Thu, 01 Jan 1970 00:00:00 GMT");
}

TEST(RequestPath, OriginAndAbsoluteForm) {
  EXPECT_EQ(request_path("/v1/models?x=1"), "/v1/models");
  EXPECT_EQ(request_path("/health"), "/health");
  EXPECT_EQ(request_path("http://127.0.0.1:8000/v1/models?x"), "/v1/models");
  EXPECT_EQ(request_path("HTTPS://host/metrics"), "/metrics");
  EXPECT_EQ(request_path("http://host"), "/");
  EXPECT_EQ(request_path("http://host?q"), "/");
  EXPECT_EQ(request_path("*"), "*");
}

TEST(PercentDecode, DecodesEscapesAndRefusesMalformedOnes) {
  EXPECT_EQ(percent_decode("Qwen%2FQwen3"), "Qwen/Qwen3");
  EXPECT_EQ(percent_decode("a%2fb%20c%3A%25"), "a/b c:%");
  EXPECT_EQ(percent_decode("plain-name_1.0+x"), "plain-name_1.0+x");
  EXPECT_EQ(percent_decode(""), "");
  EXPECT_EQ(percent_decode("caf%C3%A9"), "caf\xc3\xa9");
  for (const char* bad : {"%", "a%2", "%zz", "%2g", "50%"}) EXPECT_EQ(percent_decode(bad), std::nullopt) << bad;
}

TEST(HttpVersion, OnlyWellFormedOthersAreUnsupported) {
  for (const char* head : {"GET / HTTP/9.9\r\nHost: x\r\n\r\n", "GET / HTTP/2.0\r\n", "GET / HTTP/0.9\r\n"})
    EXPECT_TRUE(has_unsupported_http_version(head)) << head;
  for (const char* head : {"GET / HTTP/1.1\r\n", "GET / HTTP/1.0\r\n", "GET / HTTP/x.y\r\n", "GET / HTTP/11\r\n",
                           "GET / FTP/9.9\r\n", ""})
    EXPECT_FALSE(has_unsupported_http_version(head)) << head;
}

TEST(TransferCoding, OnlyChunkedIsDecoded) {
  for (const char* ok : {"chunked", "Chunked", " chunked ", "chunked;x=1", ""})
    EXPECT_EQ(unsupported_transfer_coding(ok), std::nullopt) << ok;
  EXPECT_EQ(unsupported_transfer_coding("chunked, Chunked"), "Chunked");  // applied twice
  EXPECT_EQ(unsupported_transfer_coding("gzip, chunked"), "gzip");
  EXPECT_EQ(unsupported_transfer_coding("chunked,deflate ; q=1"), "deflate");
  EXPECT_EQ(unsupported_transfer_coding(" ,x-custom\t, chunked"), "x-custom");
  EXPECT_EQ(unsupported_transfer_coding("identity"), "identity");
}
