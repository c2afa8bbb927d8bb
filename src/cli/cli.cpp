// The `lily` command line (cli/commands.h run_cli): serve | generate | bench | synth | inspect |
// tokenize. Every user-caused failure (lily::Error) is printed as one line "lily: error: …" and
// exits with status 1. LILY_LOG sets the log level.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "base/build_info.h"
#include "base/error.h"
#include "base/log.h"
#include "cli/commands.h"

namespace lily::cli {

namespace {

/// A first argument that is neither a subcommand nor an option of `lily` itself.
class UnknownArgument : public CLI::ParseError {
 public:
  explicit UnknownArgument(std::string message)
      : CLI::ParseError("UnknownArgument", std::move(message), CLI::ExitCodes::ExtrasError) {}
};

/// Prints `e` as CLI11 does and returns its exit status. CLI11 answers `lily frobnicate` and
/// `lily --bogus` with "A subcommand is required", which blames the user for what they did not
/// type: those name what they typed instead.
int exit_after(const CLI::App& app, const CLI::ParseError& e) {
  const std::vector<std::string> unknown = app.remaining();
  if (dynamic_cast<const CLI::RequiredError*>(&e) == nullptr || !app.get_subcommands().empty() || unknown.empty())
    return app.exit(e);
  std::string names;
  for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
  const std::string& first = unknown.front();
  if (first.starts_with("-"))
    return app.exit(UnknownArgument("unknown option '" + first + "' (options go after the subcommand, one of " +
                                    names + ")"));
  return app.exit(UnknownArgument("unknown subcommand '" + first + "' (expected one of " + names + ")"));
}

/// "cannot write to standard output: <reason>", the reason from `err` (none when 0).
Error unwritable_stdout(int err) {
  return Error(std::string("cannot write to standard output") + (err != 0 ? std::string(": ") + std::strerror(err) : ""));
}

/// Writes `text` to standard output and flushes it (flush_stdout). A text longer than stdio's
/// buffer is written before the flush: its failure is caught here, while errno still says why.
void write_stdout(const std::string& text) {
  errno = 0;
  std::cout.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (!std::cout.good()) throw unwritable_stdout(errno);
  flush_stdout();
}

}  // namespace

void flush_stdout() {
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout) && std::cout.good()) return;
  throw unwritable_stdout(err);
}

int run_cli(int argc, char** argv, const server::ServerTestHooks& serve_hooks) {
  // LILY_LOG=debug|info|warning|error|quiet: the least severe level printed (default info).
  if (const char* env = std::getenv("LILY_LOG"); env != nullptr && *env != '\0') {
    const auto level = lily::parse_log_level(env);
    if (!level) {
      lily::log_error(std::string("LILY_LOG must be debug, info, warning, error or quiet; got '") + env + "'");
      return 1;
    }
    lily::set_log_level(*level);
  }
  CLI::App app{"lily: an inference server for Qwen3.6-35B-A3B (qwen3_5_moe, MLX 4-bit)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("lily ") + lily::build_version() + " (" + lily::build_commit() + ")");
  int exit_code = 0;
  lily::cli::register_serve(app, exit_code, serve_hooks);
  lily::cli::register_generate(app, exit_code);
  lily::cli::register_bench(app, exit_code);
  lily::cli::register_synth(app, exit_code);
  lily::cli::register_inspect(app, exit_code);
  lily::cli::register_tokenize(app, exit_code);
  try {
    app.parse(argc, argv);
    flush_stdout();  // every command's output, before its exit status says it was written
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != static_cast<int>(CLI::ExitCodes::Success)) return exit_after(app, e);
    // --help and --version: exit 0 only once their text was written. Taken as text first: CLI11
    // would write it to std::cout itself (--version with std::endl, a flush) and lose why it failed.
    std::ostringstream text;
    app.exit(e, text);
    try {
      write_stdout(text.str());
    } catch (const lily::Error& w) {
      lily::log_error(w.what());
      return 1;
    }
    return 0;
  } catch (const lily::Error& e) {
    lily::log_error(e.what());
    return 1;
  } catch (const std::exception& e) {
    lily::log_error(std::string("internal error: ") + e.what());
    return 2;
  }
  return exit_code;
}

}  // namespace lily::cli
