// `lily bench` end to end on the demo model (CPU): the docs/benchmark.md §1 contract's report — rounds,
// per-step times, a digest that repeats across rounds and equals the FNV-1a of the ids that
// `lily generate` produces for the same synthetic prompt — and its option errors.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace lily {
namespace {

using test::quoted;

/// docs/benchmark.md §1.1 prompt ids.
std::vector<int32_t> contract_prompt(int n, int vocab) { return test::hash_prompt(n, vocab); }

/// 64-bit FNV-1a over whole u32 ids, as 16 hex digits (docs/benchmark.md §1.3 item 4).
std::string fnv1a_hex(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    h ^= uint32_t(id);
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}

TEST(BenchCli, ReportFollowsTheContractAndMatchesGenerate) {
  test::TempDir dir;
  const auto report_path = dir.path() / "bench.json";
  const int prompt_len = 24, steps = 6;
  const test::CliRun bench =
      test::run_lily("bench --backend cpu --threads 2 --model " + quoted(test::demo_model_dir()) + " --prompt-len " +
                         std::to_string(prompt_len) + " --decode-steps " + std::to_string(steps) +
                         " --rounds 2 --json-out " + quoted(report_path),
                     true);
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  std::ifstream in(report_path);
  ASSERT_TRUE(in) << "no report written";
  const auto report = nlohmann::json::parse(in);
  EXPECT_EQ(report["schema_version"], 1);
  EXPECT_EQ(report["meta"]["backend"], "cpu");
  EXPECT_FALSE(report["meta"]["commit"].get<std::string>().empty());
  EXPECT_EQ(report["workload"]["prompt_len"], prompt_len);
  EXPECT_EQ(report["workload"]["prompt_kind"], "u32_golden_ratio_hash_mod_vocab");
  ASSERT_EQ(report["rounds"].size(), 2u);
  for (const auto& round : report["rounds"]) {
    EXPECT_EQ(round["step_secs"].size(), size_t(steps));
    EXPECT_GT(round["prefill_secs"].get<double>(), 0.0);
    EXPECT_EQ(round["digest"], report["rounds"][0]["digest"]);
  }
  EXPECT_GT(report["results"]["decode_tok_s_median"].get<double>(), 0.0);

  // The same greedy trajectory through `lily generate`: first token = bench's prefill token,
  // the next `steps` ids hash to the digest.
  const auto config = nlohmann::json::parse(std::ifstream(test::demo_model_dir() / "config.json"));
  const int vocab = config["text_config"]["vocab_size"];
  std::string ids;
  for (int32_t id : contract_prompt(prompt_len, vocab)) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const test::CliRun gen = test::run_lily("generate --backend cpu --threads 2 --json --model " +
                                              quoted(test::demo_model_dir()) + " --prompt-ids " + ids +
                                              " --max-tokens " + std::to_string(steps + 1),
                                          false);
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  const auto generated = nlohmann::json::parse(gen.output)["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(generated.size(), size_t(steps + 1)) << "generate stopped early: " << gen.output;
  EXPECT_EQ(report["rounds"][0]["first_token_id"], generated[0]);
  EXPECT_EQ(report["rounds"][0]["digest"], fnv1a_hex({generated.begin() + 1, generated.end()}));
}

// --temperature: the rounds sample through generate(); the seed fixes the draws, so the digest
// repeats and equals that of `lily generate` with the same sampling flags and seed.
TEST(BenchCli, SampledRoundsRepeatAndMatchGenerateWithTheSameSeed) {
  test::TempDir dir;
  const auto report_path = dir.path() / "bench.json";
  const int prompt_len = 16, steps = 8;
  const std::string sampling = " --temperature 0.9 --top-p 0.9 --top-k 40 --seed 7";
  const test::CliRun bench =
      test::run_lily("bench --backend cpu --threads 2 --model " + quoted(test::demo_model_dir()) + " --prompt-len " +
                         std::to_string(prompt_len) + " --decode-steps " + std::to_string(steps) +
                         " --rounds 2 --json-out " + quoted(report_path) + sampling,
                     true);
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  EXPECT_NE(bench.output.find("| sampled T=0.9 top-p=0.9 top-k=40 min-p=0 seed=7"), std::string::npos) << bench.output;
  const auto report = nlohmann::json::parse(std::ifstream(report_path));
  EXPECT_EQ(report["workload"]["sampling"]["seed"], 7);
  ASSERT_EQ(report["rounds"].size(), 2u);
  EXPECT_EQ(report["rounds"][1]["digest"], report["rounds"][0]["digest"]);
  EXPECT_EQ(report["rounds"][0]["step_secs"].size(), size_t(steps));

  const auto config = nlohmann::json::parse(std::ifstream(test::demo_model_dir() / "config.json"));
  std::string ids;
  for (int32_t id : contract_prompt(prompt_len, config["text_config"]["vocab_size"]))
    ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const test::CliRun gen = test::run_lily("generate --backend cpu --threads 2 --json --model " +
                                              quoted(test::demo_model_dir()) + " --prompt-ids " + ids +
                                              " --max-tokens " + std::to_string(steps + 1) + sampling,
                                          false);
  ASSERT_EQ(gen.exit_code, 0) << gen.output;
  const auto generated = nlohmann::json::parse(gen.output)["token_ids"].get<std::vector<int32_t>>();
  if (generated.size() == size_t(steps + 1)) {  // bench has no stop token; generate stops at EOS
    EXPECT_EQ(report["rounds"][0]["first_token_id"], generated[0]);
    EXPECT_EQ(report["rounds"][0]["digest"], fnv1a_hex({generated.begin() + 1, generated.end()}));
  } else {
    ASSERT_FALSE(generated.empty());
    EXPECT_EQ(report["rounds"][0]["first_token_id"], generated[0]);
  }
  // Without --temperature the bench keeps the greedy contract (no sampling label).
  const test::CliRun greedy = test::run_lily("bench --backend cpu --threads 2 --model " + quoted(test::demo_model_dir()) +
                                                 " --prompt-len " + std::to_string(prompt_len) + " --decode-steps " +
                                                 std::to_string(steps) + " --rounds 1",
                                             true);
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  EXPECT_EQ(greedy.output.find("sampled"), std::string::npos);
}

// Without --model, bench finds the repository's models/demo next to its executable, as serve and
// generate do, whatever the working directory (a relative ./models/demo would fail with
// "models/demo: not a checkpoint directory" anywhere but the repository root). A copy of the
// executable beside a models/demo link stands for a build inside the repository.
TEST(BenchCli, WithoutModelUsesTheDemoModelNextToTheExecutable) {
  test::TempDir dir;
  std::filesystem::copy_file(test::binary_dir() / "lily", dir.path() / "lily");
  std::filesystem::create_directory(dir.path() / "models");
  std::filesystem::create_directory_symlink(test::demo_model_dir(), dir.path() / "models" / "demo");
  std::filesystem::create_directory(dir.path() / "elsewhere");
  const auto report_path = dir.path() / "bench.json";
  const std::string cmd = "cd " + quoted(dir.path() / "elsewhere") + " && " + quoted(dir.path() / "lily") +
                          " bench --backend cpu --threads 2 --prompt-len 4 --decode-steps 2 --rounds 1 --json-out " +
                          quoted(report_path) + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output.append(buf, n);
  const int status = ::pclose(p);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  const auto report = nlohmann::json::parse(std::ifstream(report_path));
  EXPECT_EQ(std::filesystem::path(report["meta"]["model"].get<std::string>()), dir.path() / "models" / "demo");
}

TEST(BenchCli, BadOptionsAreRefused) {
  for (const std::string args : {"--backend cpu --prompt-len 0", "--backend cpu --decode-steps 0",
                                 "--backend cpu --rounds 0", "--backend metal", "--backend cpu --temperature 3",
                                 "--backend cpu --top-p 0.9", "--backend cpu --temperature 1 --top-p 0",
                                 "--backend cpu --temperature 1 --top-k -2", "--backend cpu --temperature 1 --min-p 2",
                                 "--backend cpu --cuda bogus=1", "--backend cpu --cuda pdl=on", "--cuda max-batch=0"}) {
    const test::CliRun r = test::run_lily("bench --model " + quoted(test::demo_model_dir()) + " " + args, true);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_FALSE(r.output.empty()) << args;
  }
  // A bad --cuda setting is named, and refused before the model loads (even for the CPU backend).
  const test::CliRun cuda = test::run_lily("bench --backend cpu --cuda pdl=on --model " + quoted(test::demo_model_dir()), true);
  EXPECT_NE(cuda.output.find("--cuda: pdl must be '1' or '0', got 'on'"), std::string::npos) << cuda.output;
  EXPECT_EQ(cuda.output.find("loaded"), std::string::npos) << cuda.output;
  // An unknown name: the flag, the setting as given, and the names there are.
  const test::CliRun unknown = test::run_lily("bench --backend cpu --cuda foo=1 --model " + quoted(test::demo_model_dir()), true);
  EXPECT_NE(unknown.exit_code, 0) << unknown.output;
  EXPECT_NE(unknown.output.find("--cuda: 'foo=1': unknown option 'foo'; the options are fuse, pdl, stream-gemv"),
            std::string::npos) << unknown.output;
  EXPECT_NE(unknown.output.find("persistent-decode"), std::string::npos) << unknown.output;
  // A bad variable is named as the variable, not as a flag.
  ASSERT_EQ(std::getenv("LILY_CUDA_FUSE"), nullptr) << "the test sets LILY_CUDA_FUSE itself";
  ::setenv("LILY_CUDA_FUSE", "yes", 1);
  const test::CliRun variable = test::run_lily("bench --backend cuda --model " + quoted(test::demo_model_dir()), true);
  ::unsetenv("LILY_CUDA_FUSE");
  EXPECT_NE(variable.exit_code, 0) << variable.output;
  EXPECT_NE(variable.output.find("lily: error: LILY_CUDA_FUSE must be '1' or '0', got 'yes'"), std::string::npos)
      << variable.output;
  EXPECT_EQ(variable.output.find("--cuda"), std::string::npos) << variable.output;
  // An unwritable report path is refused before the run, not after every round has run.
  test::TempDir dir;
  for (const std::filesystem::path& out : {dir.path() / "missing" / "bench.json", dir.path()}) {
    const test::CliRun r = test::run_lily("bench --backend cpu --threads 2 --prompt-len 4 --decode-steps 1 "
                                          "--rounds 1 --model " + quoted(test::demo_model_dir()) +
                                              " --json-out " + quoted(out),
                                          true);
    EXPECT_NE(r.exit_code, 0) << out;
    EXPECT_NE(r.output.find("--json-out"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("round 0"), std::string::npos) << "the benchmark ran first:\n" << r.output;
  }
}

}  // namespace
}  // namespace lily
