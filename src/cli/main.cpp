// `lily`: the one executable (cli/commands.h run_cli).
#include "cli/commands.h"

int main(int argc, char** argv) { return lily::cli::run_cli(argc, argv); }
