// The smaller command-line faults. Each case runs the built `lily` (bounded by
// `timeout`, so a run the old code let go on for minutes fails instead of stalling the suite).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace lily {
namespace {

namespace fs = std::filesystem;
using test::CliRun;
using test::run_lily_bounded;

using test::quoted;
const std::string kDemo = quoted(test::demo_model_dir());

bool has(const CliRun& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

TEST(CliInputs, InspectRefusesAMissingOrGarbageTokenizerAsServeDoes) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  fs::remove(dir / "tokenizer.json");
  CliRun r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "cannot open tokenizer file " + (dir / "tokenizer.json").string())) << r.output;
  std::ofstream(dir / "tokenizer.json") << "{ not json";
  r = run_lily_bounded("inspect --json " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, (dir / "tokenizer.json").string() + " is not valid JSON")) << r.output;
  std::ofstream(dir / "tokenizer.json") << "{\"model\": {\"type\": \"Unigram\"}}";
  r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, (dir / "tokenizer.json").string() + ": ")) << r.output;
  // serve refuses the same file.
  r = run_lily_bounded("serve --backend cpu --bind 127.0.0.1:0 --model " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, (dir / "tokenizer.json").string() + ": ")) << r.output;
}

TEST(CliInputs, InspectLabelsBinarySizesAsMiB) {
  const CliRun r = run_lily_bounded("inspect " + kDemo, true);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // models/demo is 11,183,368 bytes = 10.67 MiB (11.18 MB).
  EXPECT_TRUE(has(r, "on disk      10.67 MiB in 1 file(s)")) << r.output;
  EXPECT_FALSE(has(r, " MB ")) << r.output;
  EXPECT_TRUE(has(r, "tokenizer    ")) << r.output;
}

TEST(CliInputs, ContextOfOneIsBlamedOnTheCheckpointField) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  nlohmann::json config;
  std::ifstream(dir / "config.json") >> config;
  ASSERT_TRUE(config["text_config"].contains("max_position_embeddings"));
  config["text_config"]["max_position_embeddings"] = 1;
  std::ofstream(dir / "config.json") << config.dump(2);
  for (const std::string& cmd : {"inspect " + quoted(dir), "serve --backend cpu --bind 127.0.0.1:0 --model " + quoted(dir),
                                "generate --backend cpu --prompt-ids 1 --model " + quoted(dir)}) {
    const CliRun r = run_lily_bounded(cmd, true);
    EXPECT_EQ(r.exit_code, 1) << cmd << "\n" << r.output;
    EXPECT_TRUE(has(r, "config field max_position_embeddings = 1 is too small")) << cmd << "\n" << r.output;
    EXPECT_FALSE(has(r, "--max-seq")) << cmd << "\n" << r.output;
  }
}

TEST(CliInputs, TokenizeDecodeOutsideTheVocabularyIsAnError) {
  const CliRun r = run_lily_bounded("tokenize --model " + kDemo + " --decode 1,99999", true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--decode: token id 99999 is outside the vocabulary (ids 0..")) << r.output;
  const CliRun ok = run_lily_bounded("tokenize --model " + kDemo + " --decode 1,2", true);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST(CliInputs, TokenizeWithNothingToDoIsAnError) {
  const CliRun r = run_lily_bounded("tokenize --model " + kDemo, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "lily tokenize: nothing to do: give TEXT to encode, --decode IDS")) << r.output;
  EXPECT_NE(r.output, "\n");
}

TEST(CliInputs, TokenizeBatchFromADirectoryIsAnError) {
  test::TempDir tmp;
  const CliRun r = run_lily_bounded("tokenize --model " + kDemo + " --batch-jsonl " + quoted(tmp.path()), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--batch-jsonl " + tmp.path().string() + " is a directory")) << r.output;
}

TEST(CliInputs, TokenizeDefaultsToTheDemoModel) {
  const CliRun given = run_lily_bounded("tokenize --model " + kDemo + " 'hello world'", false);
  const CliRun defaulted = run_lily_bounded("tokenize 'hello world'", false);
  ASSERT_EQ(given.exit_code, 0) << given.output;
  EXPECT_EQ(defaulted.exit_code, 0) << defaulted.output;
  EXPECT_EQ(defaulted.output, given.output);
  EXPECT_NE(given.output, "\n");
}

// JSON on the command line nested deeper than the server accepts is refused naming the flag
// (30,000 levels used to overflow the stack converting it for the chat template).
TEST(CliInputs, DeeplyNestedJsonFlagsAreErrors) {
  const std::string deep = std::string(30000, '[') + std::string(30000, ']');
  const std::string messages = "'[{\"role\":\"user\",\"content\":\"hi\"}]'";
  CliRun r = run_lily_bounded("tokenize --model " + kDemo + " --render-messages " + messages +
                                  " --chat-options '{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
                                  "\"parameters\":{\"type\":\"object\",\"x\":" + deep + "}}}]}'",
                              true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--chat-options: nests arrays and objects deeper than 128 levels")) << r.output;
  r = run_lily_bounded("tokenize --model " + kDemo + " --render-messages '[{\"role\":\"assistant\",\"content\":\"\","
                           "\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":" +
                           deep + "}}]}]'",
                       true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--render-messages: nests arrays and objects deeper than 128 levels")) << r.output;
  test::TempDir tmp;
  const fs::path batch = fs::path(tmp.path()) / "batch.jsonl";
  std::ofstream(batch) << "{\"render\":" << deep << "}\n{\"encode\":\"hi\"}\n";
  r = run_lily_bounded("tokenize --model " + kDemo + " --batch-jsonl " + quoted(batch), false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r, "{\"error\":\"--batch-jsonl: nests arrays and objects deeper than 128 levels\"}\n{\"ids\":"))
      << r.output;
}

// A checkpoint's chat template that nests a value without bound, or makes a namespace hold
// itself, fails the render with the template's line, not a crash.
TEST(CliInputs, ChatTemplateNestingTooDeepIsAnError) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const std::string render = "tokenize --model " + quoted(dir) + " --render-messages '[{\"role\":\"user\",\"content\":\"hi\"}]'";
  std::ofstream(dir / "chat_template.jinja")
      << "{% set ns = namespace(v=[]) %}{% for i in range(100000) %}{% set ns.v = [ns.v] %}{% endfor %}x";
  CliRun r = run_lily_bounded(render, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "line 1: value nesting too deep (more than 400 levels)")) << r.output;
  std::ofstream(dir / "chat_template.jinja") << "{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}";
  r = run_lily_bounded(render, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "line 1: a namespace cannot hold itself (a reference cycle)")) << r.output;
}

TEST(CliInputs, GenerateChecksItsArgumentsBeforeLoadingTheWeights) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  fs::resize_file(dir / "model.safetensors", 100);  // loading it would fail
  const std::string model = " --model " + quoted(dir);
  const CliRun load = run_lily_bounded("generate --backend cpu --prompt hi" + model, true);
  EXPECT_EQ(load.exit_code, 1);
  EXPECT_TRUE(has(load, "model.safetensors")) << load.output;  // the load itself is what fails
  struct Case {
    std::string args, expected;
  };
  for (const Case& c : {Case{"--prompt hi --prompt-ids 1", "give exactly one of --prompt, --prompt-ids, --messages"},
                        Case{"", "give exactly one of --prompt, --prompt-ids, --messages"},
                        Case{"--messages '[{\"role\":1}'", "--messages: expected a non-empty JSON array"},
                        Case{"--prompt hi --backend gpu", "unknown backend 'gpu'"},
                        Case{"--prompt-ids 1,x", "--prompt-ids: 'x' is not a token id"},
                        Case{"--prompt hi --temperature nan", "--temperature must be in [0, 2]"},
                        Case{"--prompt hi --temperature 1 --min-p nan", "--min-p must be in [0, 1]"},
                        // Given but empty: named as such, not as missing.
                        Case{"--prompt ''", "--prompt must not be empty"},
                        Case{"--prompt-ids ''", "--prompt-ids: no ids given"},
                        Case{"--prompt hi --stop ''", "--stop: stop strings must not be empty"}}) {
    const CliRun r = run_lily_bounded("generate " + c.args + model, true);
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r, c.expected)) << c.args << "\n" << r.output;
    EXPECT_FALSE(has(r, "model.safetensors")) << c.args << ": reported after loading\n" << r.output;
  }
}

TEST(CliInputs, OutputThatCannotBeWrittenIsAnError) {
  // /dev/full takes every open and fails every write with ENOSPC.
  const std::string model = " --model " + kDemo;
  for (const std::string& args :
       {"inspect " + kDemo, "inspect --json " + kDemo, "tokenize hello" + model,
        "generate --backend cpu --prompt-ids 1,2 --max-tokens 3 --json" + model,
        "generate --backend cpu --prompt hi --max-tokens 3" + model,
        "bench --backend cpu --prompt-len 4 --decode-steps 1 --rounds 1" + model}) {
    const CliRun r = test::run_lily_stdout_to(args, "/dev/full");
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_TRUE(has(r, "lily: error: cannot write to standard output: No space left on device")) << args << "\n"
                                                                                                 << r.output;
  }
  const CliRun r = run_lily_bounded(
      "bench --backend cpu --prompt-len 4 --decode-steps 1 --rounds 1 --json-out /dev/full" + model, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "lily: error: --json-out: cannot write /dev/full: No space left on device")) << r.output;
}

TEST(CliInputs, HelpAndVersionThatCannotBeWrittenAreAnError) {
  // serve's help is longer than stdio's buffer: written before the final flush.
  for (const char* args : {"--help", "--version", "generate --help", "serve --help"}) {
    const CliRun r = test::run_lily_stdout_to(args, "/dev/full");
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_TRUE(has(r, "lily: error: cannot write to standard output: No space left on device")) << args << "\n"
                                                                                                 << r.output;
  }
}

TEST(CliInputs, GenerateRefusesMoreTokensThanTheContextHolds) {
  // models/demo declares max_position_embeddings 4096.
  CliRun r = run_lily_bounded("generate --backend cpu --prompt-ids 1,2,3 --max-tokens 5000 --model " + kDemo, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--max-tokens 5000: the prompt (3 tokens) + 5000 exceeds the checkpoint's context of 4096 "
                     "tokens (max_position_embeddings)")) << r.output;
  r = run_lily_bounded("generate --backend cpu --prompt-ids 1,2,3 --max-tokens 8 --max-seq 6 --model " + kDemo, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--max-tokens 8: the prompt (3 tokens) + 8 exceeds --max-seq 6")) << r.output;
  r = run_lily_bounded("generate --backend cpu --prompt-ids 1,2,3 --max-seq 5000 --model " + kDemo, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--max-seq 5000 exceeds the checkpoint's context of 4096 tokens")) << r.output;
  // Right at the limit is fine.
  r = run_lily_bounded("generate --backend cpu --prompt-ids 1,2,3 --max-tokens 2 --max-seq 5 --json --model " + kDemo,
                       false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(CliInputs, BenchRefusesAJsonOutThatIsAFifo) {
  test::TempDir tmp;
  const fs::path fifo = tmp.path() / "report.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Opened for writing, a FIFO would block the bench forever after its run.
  const CliRun r = run_lily_bounded(
      "bench --backend cpu --prompt-len 4 --decode-steps 1 --rounds 1 --json-out " + quoted(fifo) + " --model " + kDemo, true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--json-out " + fifo.string() + " is a FIFO (named pipe)")) << r.output;
}

// Optional checkpoint files that exist but cannot be used are errors, not silently absent.
TEST(CliInputs, InspectRefusesUnusableOptionalFiles) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  const fs::path tpl = dir / "chat_template.jinja";
  fs::remove(tpl);
  fs::create_symlink("chat_template.jinja", tpl);  // a link to itself
  CliRun r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, tpl.string() + ": Too many levels of symbolic links")) << r.output;
  fs::remove(tpl);
  ASSERT_EQ(::mkfifo(tpl.c_str(), 0600), 0);
  r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "cannot read " + tpl.string() + ": is a FIFO")) << r.output;
  // A template list entry whose name is not a string is skipped, not an internal error.
  fs::remove(tpl);
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"eos_token": "<|im_end|>", "chat_template": [{"name": 5, "template": "x"}]})";
  r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "expected a string or a list with a \"default\" template")) << r.output;
}

TEST(CliInputs, InspectRefusesATokenizerBeyondTheModelVocabulary) {
  test::TempDir tmp;
  const fs::path dir = test::copy_demo_model(tmp);
  nlohmann::json tok;
  std::ifstream(dir / "tokenizer.json") >> tok;
  tok["added_tokens"].push_back({{"id", 8192}, {"content", "<x>"}, {"single_word", false}, {"lstrip", false},
                                 {"rstrip", false}, {"normalized", false}, {"special", true}});
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  const CliRun r = run_lily_bounded("inspect " + quoted(dir), true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "tokenizer.json has ids up to 8192, beyond the model's vocabulary of 8192")) << r.output;
}

TEST(CliInputs, BenchRefusesAPromptBeyondTheContext) {
  const CliRun r = run_lily_bounded("bench --backend cpu --prompt-len 5000 --decode-steps 1 --rounds 1 --model " + kDemo,
                                    true);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r, "--prompt-len 5000 + --decode-steps 1 + 1 positions exceed the checkpoint's context of 4096"))
      << r.output;
  EXPECT_FALSE(has(r, "round 0")) << r.output;
}

TEST(CliInputs, StreamedGenerateEndsWithTheWholeTextAndANewline) {
  const std::string base = "generate --backend cpu --prompt-ids 1,2,3 --max-tokens 8 --model " + kDemo;
  const CliRun json = run_lily_bounded(base + " --json", false);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const std::string text = nlohmann::json::parse(json.output)["text"];
  ASSERT_GE(text.size(), 2u);
  const CliRun plain = run_lily_bounded(base, false);
  EXPECT_EQ(plain.exit_code, 0);
  EXPECT_EQ(plain.output, text + "\n");
  // A stop string that the text's last two bytes begin holds them back until the end, and they
  // must then still reach the streamed output.
  const std::string tail = text.substr(text.size() - 2);
  ASSERT_EQ(tail.find('\''), std::string::npos);
  ASSERT_EQ(text.find(tail + "QQQZ"), std::string::npos);
  const CliRun held = run_lily_bounded(base + " --stop '" + tail + "QQQZ'", false);
  EXPECT_EQ(held.exit_code, 0);
  EXPECT_EQ(held.output, text + "\n");
}

}  // namespace
}  // namespace lily
