// Integer options of the `lily` subcommands: a value below the minimum or not an integer is
// refused before anything runs, with a message that names the option, the rule and the value
// (CLI11 2.1's own NonNegativeNumber / PositiveNumber printed "Value 0 not in range 0.000000 to
// 1797693…" with 300 digits), and --threads no longer takes negative counts silently.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace lily {
namespace {

std::string quoted(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

struct BadOption {
  std::string args;      ///< subcommand and options
  std::string expected;  ///< text the error must hold
};

TEST(CliOptions, BadIntegersAreRefusedWithAClearMessage) {
  test::TempDir dir;
  const std::string model = " --model " + quoted(test::demo_model_dir());
  const std::vector<BadOption> cases = {
      {"serve --max-body 0" + model, "--max-body: must be an integer >= 1, got '0'"},
      {"serve --max-body x" + model, "--max-body: must be an integer >= 1, got 'x'"},
      {"serve --max-queue 1.5" + model, "--max-queue: must be an integer >= 0, got '1.5'"},
      {"serve --max-seq -1" + model, "--max-seq: must be an integer >= 0, got '-1'"},
      {"serve --read-timeout 0" + model, "--read-timeout: must be an integer >= 1, got '0'"},
      {"serve --threads -3" + model, "--threads: must be an integer >= 0, got '-3'"},
      {"generate --threads -2 --prompt-ids 1" + model, "--threads: must be an integer >= 0, got '-2'"},
      {"bench --threads -1" + model, "--threads: must be an integer >= 0, got '-1'"},
      {"synth --threads -1 --out " + quoted(dir.path() / "synth"), "--threads: must be an integer >= 0, got '-1'"},
  };
  for (const BadOption& c : cases) {
    const test::CliRun r = test::run_lily(c.args, true);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("179769"), std::string::npos) << c.args << "\n" << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "synth")) << "a refused synth must write nothing";
}

TEST(CliOptions, ValidThreadCountsStillWork) {
  const test::CliRun r = test::run_lily(
      "generate --backend cpu --threads 1 --prompt-ids 1,2 --max-tokens 1 --json --model " +
          quoted(test::demo_model_dir()),
      false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"completion_tokens\":1"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace lily
