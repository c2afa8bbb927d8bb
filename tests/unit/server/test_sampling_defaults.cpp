// The server's sampling defaults (flags over generation_config.json) and the JSON shapes of
// choices with seeds and logprobs.
#include <gtest/gtest.h>

#include <fstream>

#include "base/error.h"
#include "engine/option_error.h"
#include "server/http_server.h"
#include "server/openai_json.h"
#include "support/test_support.h"

using namespace lily;
using namespace lily::server;

TEST(SamplingDefaults, FlagsOverrideTheGenerationConfig) {
  lily::test::TempDir dir;
  std::ofstream(dir.path() / "generation_config.json")
      << R"({"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20})";
  SamplingFlags flags;
  const auto from_file = resolve_sampling_defaults(flags, dir.path());
  EXPECT_FLOAT_EQ(from_file.temperature, 0.6f);
  EXPECT_EQ(from_file.top_k, 20);
  flags.temperature = 1.2;
  flags.top_k = -1;
  flags.min_p = 0.1;
  const auto flagged = resolve_sampling_defaults(flags, dir.path());
  EXPECT_FLOAT_EQ(flagged.temperature, 1.2f);
  EXPECT_EQ(flagged.top_k, 0);  // -1: off
  EXPECT_FLOAT_EQ(flagged.top_p, 0.95f);  // still the file's
  EXPECT_FLOAT_EQ(flagged.min_p, 0.1f);
  flags = SamplingFlags{};
  flags.generation_config = false;
  EXPECT_TRUE(resolve_sampling_defaults(flags, dir.path()).plain_greedy());
}

TEST(SamplingDefaults, OutOfRangeValuesAreOptionErrorsNamingTheField) {
  lily::test::TempDir dir;
  auto refusal = [&](SamplingFlags f) {
    try {
      resolve_sampling_defaults(f, dir.path());
    } catch (const OptionError& e) {
      return e.field() + " | " + e.what();
    }
    return std::string("accepted");
  };
  SamplingFlags f;
  f.temperature = 2.5;
  EXPECT_EQ(refusal(f), "temperature | temperature must be in [0.0, 2.0], got 2.5");
  f = {};
  f.top_p = 0;
  EXPECT_EQ(refusal(f), "top_p | top_p must be in (0.0, 1.0], got 0.0");
  f = {};
  f.top_k = -3;
  EXPECT_EQ(refusal(f), "top_k | top_k must be -1, 0 (off) or a positive integer, got -3");
  f = {};
  f.min_p = 1.5;
  EXPECT_EQ(refusal(f), "min_p | min_p must be in [0.0, 1.0], got 1.5");
}

TEST(SamplingJson, ChoicesCarrySeedsAndLogprobsInOpenAIsShape) {
  const auto lp = logprobs_json({LogprobEntry{"hi", -0.5, {LogprobEntry{"hi", -0.5, {}}, LogprobEntry{"\xe6", -2, {}}}}});
  ASSERT_EQ(lp["content"].size(), 1u);
  EXPECT_EQ(lp["content"][0]["token"], "hi");
  EXPECT_EQ(lp["content"][0]["bytes"], nlohmann::ordered_json::array({104, 105}));
  EXPECT_EQ(lp["content"][0]["top_logprobs"][1]["bytes"], nlohmann::ordered_json::array({0xe6}));
  EXPECT_FALSE(lp["content"][0]["top_logprobs"][1].contains("top_logprobs"));
  EXPECT_TRUE(lp["refusal"].is_null());
  const auto c = choice_json(2, "text", "stop", lp, 77);
  EXPECT_EQ(c["index"], 2);
  EXPECT_EQ(c["seed"], 77);
  EXPECT_EQ(c["logprobs"], lp);
  EXPECT_FALSE(choice_json(0, "t", "length", nullptr, std::nullopt).contains("seed"));
  const auto chunk = chunk_json(CompletionMeta{"id", 1, "m", "fp"}, 1, {{"content", "x"}}, nullptr, std::nullopt, false);
  EXPECT_EQ(chunk["choices"][0]["index"], 1);
  EXPECT_TRUE(chunk["choices"][0]["logprobs"].is_null());
  // Invalid UTF-8 in a token is replaced when serialized, never an exception.
  EXPECT_NO_THROW(dump(lp));
}
