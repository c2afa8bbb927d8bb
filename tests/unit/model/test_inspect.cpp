// `lily inspect` end to end: the built binary on models/demo and on a corrupted copy.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

using test::CliRun;
using test::run_lily;

std::string quoted(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

TEST(Inspect, DemoModelSummary) {
  CliRun r = run_lily("inspect " + quoted(test::demo_model_dir()), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("qwen3_5_moe (H=256, L=8, E=16)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("8: 6 Gated DeltaNet (linear attention) + 2 gated full attention"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("16 routed, top-4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("mlp.gate "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("q8"), std::string::npos) << r.output;
}

TEST(Inspect, DemoModelJson) {
  CliRun r = run_lily("inspect --json " + quoted(test::demo_model_dir()), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["layers"]["total"], 8);
  EXPECT_EQ(j["layers"]["linear_attention"], 6);
  EXPECT_EQ(j["layers"]["full_attention"], 2);
  EXPECT_EQ(j["experts"]["count"], 16);
  EXPECT_EQ(j["experts"]["top_k"], 4);
  EXPECT_EQ(j["skipped_tensors"], 0);
  EXPECT_EQ(j["bytes_on_disk"], std::filesystem::file_size(test::demo_model_dir() / "model.safetensors"));
  EXPECT_GT(j["parameters"].get<int64_t>(), 19'000'000);
  bool saw_router = false;
  for (const auto& k : j["tensor_kinds"]) {
    if (k["kind"] == "mlp.gate") {
      saw_router = true;
      EXPECT_EQ(k["storage"], "q8");
      EXPECT_EQ(k["count"], 8);
    }
    if (k["kind"] == "mlp.switch_mlp.up_proj") {
      EXPECT_EQ(k["storage"], "q4");
    }
    if (k["kind"] == "linear_attn.A_log") {
      EXPECT_EQ(k["storage"], "F32");
    }
  }
  EXPECT_TRUE(saw_router);
}

TEST(Inspect, CorruptedCheckpointFailsWithOneLine) {
  test::TempDir dir;
  test::copy_dir(test::demo_model_dir(), dir.path());
  auto st = test::SafetensorsBuilder::from_file(dir.path() / "model.safetensors");
  ASSERT_TRUE(st.remove("language_model.model.layers.5.mlp.shared_expert_gate.scales"));
  st.write(dir.path() / "model.safetensors");
  CliRun r = run_lily("inspect " + quoted(dir.path()), true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("lily: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("layers.5.mlp.shared_expert_gate"), std::string::npos) << r.output;
  // Exactly one line of output.
  ASSERT_FALSE(r.output.empty());
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
}

TEST(Inspect, UnsupportedChatTemplateFailsWithItsLine) {
  test::TempDir dir;
  test::copy_dir(test::demo_model_dir(), dir.path());
  std::ofstream(dir.path() / "chat_template.jinja") << "{{ messages | length }}\n{% for m in messages %}{{ m | xmlattr }}{% endfor %}\n";
  CliRun r = run_lily("inspect " + quoted(dir.path()), true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("chat_template.jinja: line 2: unsupported filter 'xmlattr'"), std::string::npos) << r.output;
}

TEST(Inspect, MissingDirectoryFails) {
  CliRun r = run_lily("inspect /nonexistent/lily-checkpoint", true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("lily: error: "), std::string::npos) << r.output;
}

}  // namespace
}  // namespace lily
