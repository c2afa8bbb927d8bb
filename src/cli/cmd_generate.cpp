// `lily generate` — placeholder until its issue lands; exits with an error saying so.
#include "base/error.h"
#include "cli/commands.h"

namespace lily::cli {

void register_generate(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("generate", "(not available in this build yet)");
  cmd->allow_extras();
  cmd->callback([&exit_code] {
    (void)exit_code;
    throw Error("lily generate is not available in this build yet");
  });
}

}  // namespace lily::cli
