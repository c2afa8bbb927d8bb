// lily_test_server: the `lily` command line with the server's test hooks (server::ServerTestHooks)
// set from the environment, for the Node suites that need a passing state of the server to last
// long enough to be seen (tests/node/limits.test.mjs). `lily` itself reads none of these.
//   LILY_TEST_LOAD_DELAY_MS    the loader waits this long before loading (the "loading" state)
//   LILY_TEST_LISTEN_DELAY_MS  the accept loop waits this long before its first connection
// Milliseconds; unset is 0. A value that is not a whole number ≥ 0 is refused (exit status 2),
// so a typo cannot turn a test's delay off unnoticed.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli/commands.h"

namespace {

/// The value of `name` as milliseconds (0 when unset); false when it is not a whole number ≥ 0.
bool read_delay(const char* name, int64_t& ms) {
  const char* env = std::getenv(name);
  ms = 0;
  if (env == nullptr) return true;
  const std::string text = env;
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > 9) return false;
  ms = std::stoll(text);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  lily::server::ServerTestHooks hooks;
  for (auto [name, ms] : {std::pair{"LILY_TEST_LOAD_DELAY_MS", &hooks.load_delay_ms},
                          std::pair{"LILY_TEST_LISTEN_DELAY_MS", &hooks.listen_delay_ms}}) {
    if (!read_delay(name, *ms)) {
      std::fprintf(stderr, "lily_test_server: %s must be a whole number of milliseconds\n", name);
      return 2;
    }
  }
  return lily::cli::run_cli(argc, argv, hooks);
}
