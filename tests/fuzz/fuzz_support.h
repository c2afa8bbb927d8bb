// Shared helpers of the libFuzzer targets (docs/robustness.md). A target may let lily::Error
// (or server::ApiError) escape its code under test only where the API documents it; anything
// else — another exception, a sanitizer report, a broken invariant checked with FUZZ_ASSERT —
// is a finding: the process aborts and libFuzzer saves the input as crash-<sha1>.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "support/demo_tokenizer.h"

namespace lily::fuzz {

/// Prints `what` (file:line and the failed condition) and aborts, so libFuzzer records a crash.
[[noreturn]] inline void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "FUZZ INVARIANT BROKEN: %s %s\n", what, detail.c_str());
  std::abort();
}

/// Aborts with a message unless `cond` holds.
#define FUZZ_ASSERT(cond, detail)                                                   \
  do {                                                                              \
    if (!(cond)) ::lily::fuzz::fail(__FILE__ ":" LILY_FUZZ_STR(__LINE__) ": " #cond, \
                                    (detail));                                      \
  } while (0)
#define LILY_FUZZ_STR2(x) #x
#define LILY_FUZZ_STR(x) LILY_FUZZ_STR2(x)

/// Reports an exception that escaped although the API does not allow it, then aborts.
[[noreturn]] inline void unexpected_exception(const std::exception& e) {
  fail("unexpected exception escaped:", e.what());
}

/// The committed demo tokenizer, loaded once per process (tests/support/demo_tokenizer.h).
using lily::test::demo_tokenizer;

/// Escapes bytes for a readable assertion message ("\xNN" for non-printable bytes).
inline std::string printable(std::string_view s, size_t max_len = 200) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_len; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > max_len) out += "...";
  return out;
}

}  // namespace lily::fuzz
