// Subcommands of the single `lily` executable. Each register_* adds its CLI11 subcommand;
// its callback runs the command and stores the process exit code in `exit_code`.
#pragma once
#include <CLI/CLI.hpp>

namespace lily::cli {

void register_generate(CLI::App& app, int& exit_code);
void register_synth(CLI::App& app, int& exit_code);
void register_inspect(CLI::App& app, int& exit_code);
void register_tokenize(CLI::App& app, int& exit_code);
void register_serve(CLI::App& app, int& exit_code);
void register_bench(CLI::App& app, int& exit_code);

}  // namespace lily::cli
