// `lily inspect` end to end: the built binary on models/demo and on a corrupted copy.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

using test::CliRun;
using test::run_lily;

using test::quoted;

/// The JSON header length a safetensors file starts with (its first 8 bytes, little-endian).
uint64_t safetensors_header_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::array<unsigned char, 8> b{};
  in.read(reinterpret_cast<char*>(b.data()), b.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | b[i];
  return n;
}

TEST(Inspect, DemoModelSummary) {
  CliRun r = run_lily("inspect " + quoted(test::demo_model_dir()), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("qwen3_5_moe (H=256, L=8, E=16)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("8: 6 Gated DeltaNet (linear attention) + 2 gated full attention"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("16 routed, top-4"), std::string::npos) << r.output;
  // The router's line: role, storage, one tensor per layer, its first tensor's name.
  const size_t router = r.output.find("\n  router ");
  ASSERT_NE(router, std::string::npos) << r.output;
  const std::string line = r.output.substr(router + 1, r.output.find('\n', router + 1) - router - 1);
  EXPECT_NE(line.find(" q8 "), std::string::npos) << line;
  EXPECT_NE(line.find(" x8 "), std::string::npos) << line;
  EXPECT_NE(line.find("language_model.model.layers.0.mlp.gate"), std::string::npos) << line;
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
  const auto file_bytes = std::filesystem::file_size(test::demo_model_dir() / "model.safetensors");
  EXPECT_EQ(j["bytes_on_disk"], file_bytes);
  EXPECT_GT(j["parameters"].get<int64_t>(), 19'000'000);

  std::map<std::string, nlohmann::json> by_role;
  int64_t parameters = 0, stored_tensors = 0;
  uint64_t bytes = 0;
  for (const auto& role : j["tensor_roles"]) {
    EXPECT_TRUE(by_role.emplace(role["role"].get<std::string>(), role).second) << role["role"] << " twice";
    parameters += role["parameters"].get<int64_t>();
    bytes += role["bytes"].get<uint64_t>();
    const bool quantized = role["storage"].get<std::string>()[0] == 'q';
    stored_tensors += (quantized ? 3 : 1) * role["count"].get<int64_t>();  // .weight/.scales/.biases
  }
  // Every role of the family occurs in the demo (it has both layer types), and together the roles
  // account for every parameter and every stored tensor; their bytes are the file less its header
// (a little-endian u64 length, then that many bytes of JSON).
  EXPECT_EQ(by_role.size(), 23u);
  EXPECT_EQ(parameters, j["parameters"].get<int64_t>());
  EXPECT_EQ(stored_tensors, j["tensors"].get<int64_t>());
  EXPECT_EQ(bytes, file_bytes - 8 - safetensors_header_bytes(test::demo_model_dir() / "model.safetensors"));

  const auto& router = by_role["router"];
  EXPECT_EQ(router["storage"], "q8");
  EXPECT_EQ(router["count"], 8);
  EXPECT_EQ(router["first"], "language_model.model.layers.0.mlp.gate");
  EXPECT_EQ(by_role["experts_up_proj"]["storage"], "q4");
  EXPECT_EQ(by_role["gdn_a_log"]["storage"], "F32");
  EXPECT_EQ(by_role["gdn_a_log"]["count"], 6);
  EXPECT_EQ(by_role["gdn_in_proj"]["count"], 6 * 4);  // qkv, z, a, b per GDN layer
  EXPECT_EQ(by_role["attn_in_proj"]["count"], 2 * 3);  // q, k, v per attention layer
  EXPECT_EQ(by_role["embedding"]["count"], 1);
  EXPECT_EQ(by_role["embedding"]["parameters"], j["vocab"].get<int64_t>() * j["hidden"].get<int64_t>());
  // The table's order: the embedding first, the output head last.
  EXPECT_EQ(j["tensor_roles"].front()["role"], "embedding");
  EXPECT_EQ(j["tensor_roles"].back()["role"], "output_head");
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
