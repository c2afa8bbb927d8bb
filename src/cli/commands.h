// Subcommands of the single `lily` executable. Each register_* adds its CLI11 subcommand;
// its callback runs the command and stores the process exit code in `exit_code`.
#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "server/http_server.h"
#include "text/chat_template.h"

namespace lily::cli {

/// CLI11 check for an integer option that must be at least `min`: "--threads: must be an integer
/// >= 0, got '-2'". (CLI11 2.1's NonNegativeNumber / PositiveNumber print a range up to DBL_MAX
/// written out in 300 digits, and call 0 "not in range 0 to ..." for PositiveNumber.)
CLI::Validator integer_at_least(long long min);
/// Accepts only a whole decimal integer in [min, max]; the message names what was given
/// ("must be an integer from 0 to 65535, got 'abc'").
CLI::Validator integer_in_range(long long min, long long max);
/// Any whole decimal integer of 64 bits ("must be an integer from -9223372036854775808 to …").
CLI::Validator any_integer();
/// A whole decimal integer from 0 to 2^64 − 1 (seeds): no sign, no wrap of "-1" to 2^64 − 1.
/// These integer checks refuse a leading zero ("010"), which CLI11 would read as octal.
CLI::Validator unsigned_integer();
/// Accepts a byte count as parse_byte_size reads it ("0", "1073741824", "512MiB", "4G"); the
/// message names what was given ("must be a byte count such as 1073741824, 512MiB or 4GiB, got
/// '4 GB'").
CLI::Validator byte_size();

/// Adds `--cuda NAME=VALUE` (repeatable) to `cmd`, into `settings`: one CUDA backend option, NAME
/// as in the bench report's cuda_options (e.g. pdl=0, max-batch=16), over its LILY_CUDA_*
/// variable (CudaOptions::set). Each one is checked as it is parsed, so a misspelt name or a bad
/// value stops the command before any model loads, with a message naming the flag and the
/// setting in CudaOptions::set's words ("--cuda: pdl must be '1' or '0', got '2'"); the
/// command's resolve_cuda_options then sees only good settings.
void add_cuda_settings(CLI::App* cmd, std::vector<std::string>& settings);

/// The JSON text of flag `what` (or of one line of its file), with the server's nesting bound
/// (server/json_depth.h: a deeper document would overflow the stack of what walks it later).
/// Returns a discarded value (is_discarded()) for text that is not JSON; throws lily::Error
/// "<what>: nests arrays and objects deeper than 128 levels".
nlohmann::json parse_json_flag(const std::string& text, const std::string& what);

/// A JSON list of chat messages, each read exactly as the server reads a chat request's message
/// (server::parse_chat_message: roles system, developer, user, assistant, tool; content a
/// string or text parts; name, reasoning_content, tool_calls, tool_call_id). Throws lily::Error
/// "<what>: <parameter>: <the server's message>" naming the first bad entry's field, e.g.
/// "--messages: messages[1].content: …".
std::vector<ChatMessage> parse_message_list(const nlohmann::json& list, const std::string& what);

/// The template variables of `--chat-options JSON`: an object with a chat request's agent
/// fields (tools, tool_choice, parallel_tool_calls, reasoning_effort, chat_template_kwargs),
/// validated as the server does; "" gives the defaults (no tools, thinking off). Throws
/// lily::Error "<what>: …".
ChatTemplateOptions parse_chat_options(const std::string& text, const std::string& what,
                                       bool add_generation_prompt = true);

/// Flushes standard output (std::cout writes through C stdio's stdout) and throws lily::Error
/// "cannot write to standard output: <reason>" when that or an earlier write failed (a full
/// disk, /dev/full, a closed descriptor), so that output that never arrived is not an exit 0.
void flush_stdout();

/// The whole `lily` command line on argv: parses it, runs the subcommand and returns the process
/// exit status (1 after a lily::Error, printed as one line "lily: error: …"; 2 after any other
/// exception; CLI11's own status for a parse error or --help). `serve_hooks` reaches `lily serve`
/// (register_serve).
int run_cli(int argc, char** argv, const server::ServerTestHooks& serve_hooks = {});

void register_generate(CLI::App& app, int& exit_code);
void register_synth(CLI::App& app, int& exit_code);
void register_inspect(CLI::App& app, int& exit_code);
void register_tokenize(CLI::App& app, int& exit_code);
/// `serve_hooks`: the server's test hooks (server::ServerTestHooks); `lily` passes none, the
/// test-only tests/tools/lily_test_server passes what its tests set.
void register_serve(CLI::App& app, int& exit_code, const server::ServerTestHooks& serve_hooks = {});
void register_bench(CLI::App& app, int& exit_code);

}  // namespace lily::cli
