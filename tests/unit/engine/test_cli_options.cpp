// Integer options of the `lily` subcommands: a value below the minimum or not an integer is
// refused before anything runs, with a message that names the option, the rule and the value
// (CLI11 2.1's own NonNegativeNumber / PositiveNumber print "Value 0 not in range 0.000000 to
// 1797693…" with 300 digits), and --threads refuses negative counts.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace lily {
namespace {

using test::quoted;

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
      {"serve --threads -3" + model, "--threads: must be an integer from 0 to 1024, got '-3'"},
      {"serve --threads 100000" + model, "--threads: must be an integer from 0 to 1024, got '100000'"},
      {"serve --max-batch 0" + model, "--max-batch: must be an integer from 1 to 64, got '0'"},
      {"serve --max-batch 65" + model, "--max-batch: must be an integer from 1 to 64, got '65'"},
      {"serve --step-tokens 0" + model, "--step-tokens: must be an integer from 1 to 1048576, got '0'"},
      {"generate --threads -2 --prompt-ids 1" + model, "--threads: must be an integer from 0 to 1024, got '-2'"},
      {"bench --threads 1025" + model, "--threads: must be an integer from 0 to 1024, got '1025'"},
      {"synth --threads -1 --out " + quoted(dir.path() / "synth"), "--threads: must be an integer from 0 to 1024, got '-1'"},
      // Out of range for 64 bits (CLI11 alone saturates), or a seed below 0 (it would wrap).
      {"generate --max-tokens 0 --prompt-ids 1" + model, "--max-tokens: must be an integer >= 1, got '0'"},
      {"generate --max-tokens 99999999999999999999 --prompt-ids 1" + model,
       "--max-tokens: must be an integer >= 1, got '99999999999999999999'"},
      {"generate --seed -1 --prompt-ids 1" + model, "--seed: must be an integer from 0 to 18446744073709551615, got '-1'"},
      {"generate --top-k 1e3 --prompt-ids 1" + model, "--top-k: must be an integer >= -1, got '1e3'"},
      {"generate --seed 010 --prompt-ids 1" + model, "--seed: must be an integer from 0 to 18446744073709551615, got '010'"},
      {"generate --max-tokens 010 --prompt-ids 1" + model, "--max-tokens: must be an integer >= 1, got '010'"},
      {"bench --prompt-len 0" + model, "--prompt-len: must be an integer >= 1, got '0'"},
      {"bench --seed 18446744073709551616" + model, "--seed: must be an integer from 0 to 18446744073709551615"},
      {"serve --seed 99999999999999999999" + model, "--seed: must be an integer from -9223372036854775808"},
      {"serve --top-k 99999999999999999999" + model, "--top-k: must be an integer from -9223372036854775808"},
      {"synth --seed -1 --out " + quoted(dir.path() / "synth"), "--seed: must be an integer from 0 to"},
      {"synth --shard-mb nan --out " + quoted(dir.path() / "synth"), "--shard-mb: must be 0 (one file) or from 1 to 1e9 MB, got 'nan'"},
      {"synth --shard-mb 1e-9 --out " + quoted(dir.path() / "synth"), "--shard-mb: must be 0 (one file) or from 1 to 1e9 MB"},
  };
  for (const BadOption& c : cases) {
    const test::CliRun r = test::run_lily(c.args, true);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("179769"), std::string::npos) << c.args << "\n" << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "synth")) << "a refused synth must write nothing";
}

TEST(CliOptions, BadCacheSizesAndBatchLimitsAreRefusedWithAClearMessage) {
  const std::string model = " --model " + quoted(test::demo_model_dir());
  const std::string rule = "must be a byte count such as 1073741824, 512MiB or 4GiB, got ";
  const std::vector<BadOption> cases = {
      {"serve --cache-memory 4XB" + model, "--cache-memory: " + rule + "'4XB'"},
      {"serve --cache-memory ''" + model, "--cache-memory: " + rule + "''"},
      {"serve --cache-host-memory 1.5.2G" + model, "--cache-host-memory: " + rule + "'1.5.2G'"},
      {"serve --cache-host-memory '4 GiB'" + model, "--cache-host-memory: " + rule + "'4 GiB'"},
      {"serve --cache-host-memory 1000TiB" + model, "--cache-host-memory 1000.00 TiB is more than this machine's memory"},
      // Within the range of every backend, but not of the one chosen: refused by the server,
      // which names its own field; the CLI names the flag.
      {"serve --backend cuda --cuda max-batch=16 --max-batch 32" + model,
       "--max-batch 32 is outside [1, 16]: the cuda backend runs at most 16 sequences per step"},
      {"serve --backend cpu --cache-memory 1000TiB" + model,
       "--cache-memory 1000.00 TiB is more than this machine's memory"},
  };
  for (const BadOption& c : cases) {
    // Bounded: a value wrongly accepted would start the server instead of failing.
    const test::CliRun r = test::run_lily_bounded(c.args + " --port 0", true, 30);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.exit_code, 124) << c.args << ": the server started";
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
    // Refused before the port is bound and the model loads, not after.
    EXPECT_EQ(r.output.find("listening on"), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(CliOptions, ServeHelpGivesTheRealBatchRange) {
  const test::CliRun r = test::run_lily("serve --help", false);
  EXPECT_EQ(r.exit_code, 0);
  const size_t at = r.output.find("--max-batch");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string entry = r.output.substr(at, r.output.find("--step-tokens") - at);
  EXPECT_NE(entry.find("INT in [1 - 64]"), std::string::npos) << entry;
  EXPECT_NE(entry.find("CPU 64"), std::string::npos) << entry;
  EXPECT_EQ(entry.find("4096"), std::string::npos) << entry;
}

TEST(CliOptions, AnUnknownSubcommandOrOptionIsNamed) {
  struct Case {
    std::string args, expected;
  };
  for (const Case& c :
       {Case{"frobnicate", "unknown subcommand 'frobnicate' (expected one of serve, generate, bench, synth, inspect, "
                           "tokenize)"},
        Case{"--bogus", "unknown option '--bogus' (options go after the subcommand, one of serve, generate,"},
        Case{"generate --bogus", "The following argument was not expected: --bogus"}}) {
    const test::CliRun r = test::run_lily(c.args, true);
    EXPECT_EQ(r.exit_code, 109) << c.args;  // CLI11's status for an argument it did not expect
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("A subcommand is required"), std::string::npos) << c.args << "\n" << r.output;
  }
  // With nothing at all, that is the right message.
  const test::CliRun none = test::run_lily("", true);
  EXPECT_NE(none.output.find("A subcommand is required"), std::string::npos) << none.output;
}

TEST(CliOptions, OptionsTheServerRefusesAreNamedAsTheirFlags) {
  const std::string model = " --model " + quoted(test::demo_model_dir());
  // The server names its own fields (max_seq, bind, …); `lily serve` says which flag set them.
  const std::vector<BadOption> cases = {
      {"serve --backend cpu --max-seq 1 --port 0" + model, "lily: error: --max-seq must be at least 2 (got 1)"},
      {"serve --backend cpu --bind '[::1'" + model, "lily: error: --bind '[::1': missing ']'"},
      {"serve --backend cpu --bind 'localhost:8x'" + model, "lily: error: --bind 'localhost:8x': bad port"},
      {"serve --backend cpu --temperature 3 --port 0" + model,
       "lily: error: --temperature must be in [0.0, 2.0], got 3.0"},
      {"serve --backend cpu --top-k -2 --port 0" + model,
       "lily: error: --top-k must be -1, 0 (off) or a positive integer, got -2"},
      {"serve --backend cpu --temperature nan --port 0" + model, "lily: error: --temperature must be in [0.0, 2.0], got nan"},
      {"serve --backend cpu --top-p nan --port 0" + model, "lily: error: --top-p must be in (0.0, 1.0], got nan"},
      {"serve --backend cpu --allowed-origins localhost:3000 --port 0" + model,
       "lily: error: --allowed-origins 'localhost:3000' is not an origin"},
  };
  for (const BadOption& c : cases) {
    const test::CliRun r = test::run_lily_bounded(c.args, true, 30);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.exit_code, 124) << c.args << ": the server started";
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
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
