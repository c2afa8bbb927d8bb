// config.json parsing and family-strict validation (docs/model.md §1): the demo config parses to the
// documented values; every other family member, quantization method or inconsistency is named.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <variant>

#include "base/error.h"
#include "model/config.h"
#include "model/config_json.h"
#include "model/loader.h"
#include "model/tensor_table.h"
#include "support/test_support.h"

namespace lily {
namespace {

using nlohmann::json;

json demo_config() {
  std::ifstream in(test::demo_model_dir() / "config.json");
  return json::parse(in);
}

/// The 35B-A3B text config of docs/model.md §1.1 in the MLX wrapper.
json real_config() {
  json text = {{"model_type", "qwen3_5_moe_text"}, {"hidden_size", 2048}, {"num_hidden_layers", 40},
               {"vocab_size", 248320}, {"num_attention_heads", 16}, {"num_key_value_heads", 2},
               {"head_dim", 256}, {"attn_output_gate", true}, {"linear_num_key_heads", 16},
               {"linear_num_value_heads", 32}, {"linear_key_head_dim", 128}, {"linear_value_head_dim", 128},
               {"linear_conv_kernel_dim", 4}, {"num_experts", 256}, {"num_experts_per_tok", 8},
               {"moe_intermediate_size", 512}, {"shared_expert_intermediate_size", 512},
               {"rms_norm_eps", 1e-6}, {"max_position_embeddings", 262144}, {"tie_word_embeddings", false},
               {"eos_token_id", 248044}, {"full_attention_interval", 4},
               {"rope_parameters", {{"rope_theta", 10000000}, {"partial_rotary_factor", 0.25},
                                    {"mrope_section", {11, 11, 10}}}}};
  json types = json::array();
  for (int i = 0; i < 40; ++i) types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  text["layer_types"] = types;
  json q = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
  for (int i = 0; i < 40; ++i) {
    q["language_model.model.layers." + std::to_string(i) + ".mlp.gate"] = {{"group_size", 64}, {"bits", 8}};
    q["language_model.model.layers." + std::to_string(i) + ".mlp.shared_expert_gate"] = {{"group_size", 64}, {"bits", 8}};
  }
  return {{"model_type", "qwen3_5_moe"}, {"text_config", text}, {"quantization", q}, {"quantization_config", q},
          {"tie_word_embeddings", false}, {"eos_token_id", {248046, 248044}}, {"vision_config", {{"depth", 27}}}};
}

/// parse_model_config(doc) throws CheckpointError containing every part.
void expect_rejected(const json& doc, std::initializer_list<std::string> parts) {
  try {
    parse_model_config(doc, "cfg.json");
    FAIL() << "accepted; expected an error mentioning " << *parts.begin();
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("cfg.json: ", 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

TEST(Config, ParsesDemoConfig) {
  ModelConfig c = load_model_config(test::demo_model_dir());
  EXPECT_EQ(c.vocab, 8192);
  EXPECT_EQ(c.hidden, 256);
  EXPECT_EQ(c.n_layers, 8);
  EXPECT_EQ(c.n_full_attention_layers(), 2);
  EXPECT_EQ(c.n_linear_attention_layers(), 6);
  EXPECT_TRUE(c.is_full_attention(3));
  EXPECT_FALSE(c.is_full_attention(4));
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rotary_dim, 16);  // trunc(64 × 0.25)
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.gdn_conv_channels(), 2 * 2 * 64 + 4 * 64);
  EXPECT_EQ(c.n_experts, 16);
  EXPECT_EQ(c.n_experts_per_tok, 4);
  EXPECT_EQ(c.moe_ffn_dim, 128);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{8189, 8187}));  // top level replaces text_config's
  EXPECT_EQ(c.quantization.eight_bit_modules.size(), 16u);
  EXPECT_FALSE(c.is_qwen36_35b_a3b());
  EXPECT_EQ(c.shape_name(), "qwen3_5_moe (H=256, L=8, E=16)");
}

TEST(Config, RecognisesQwen36Shape) {
  ModelConfig c = parse_model_config(real_config(), "cfg.json");
  EXPECT_TRUE(c.is_qwen36_35b_a3b());
  EXPECT_EQ(c.shape_name(), "Qwen3.6-35B-A3B");
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.gdn_conv_channels(), 8192);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{248046, 248044}));
  // About 35B parameters (docs/model.md §1): the table counts embeddings, lm_head and all experts.
  EXPECT_GT(c.parameter_count(), 34'000'000'000);
  EXPECT_LT(c.parameter_count(), 36'000'000'000);
}

TEST(Config, EosFromTextConfigWhenNoTopLevel) {
  json doc = real_config();
  doc.erase("eos_token_id");
  EXPECT_EQ(parse_model_config(doc, "cfg.json").eos_token_ids, (std::vector<int32_t>{248044}));
  doc["text_config"]["eos_token_id"] = {1, 2, 3};
  EXPECT_EQ(parse_model_config(doc, "cfg.json").eos_token_ids, (std::vector<int32_t>{1, 2, 3}));
}

TEST(Config, AcceptsTextOnlyConfig) {
  json doc = real_config()["text_config"];
  doc["quantization"] = real_config()["quantization"];
  ModelConfig c = parse_model_config(doc, "cfg.json");
  EXPECT_TRUE(c.is_qwen36_35b_a3b());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{248044}));
}

TEST(Config, RotaryDimFallsBackToFlatField) {
  json doc = demo_config();
  doc["text_config"].erase("rope_parameters");
  doc["text_config"]["rope_theta"] = 5000.0;
  doc["text_config"]["partial_rotary_factor"] = 0.5;
  ModelConfig c = parse_model_config(doc, "cfg.json");
  EXPECT_EQ(c.rotary_dim, 32);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5000.0);
}

TEST(Config, RejectsRopeThetaOutsideFp32Range) {
  // 1e-300 was once accepted: 0 in fp32, every angle NaN and every logit NaN.
  for (double theta : {1e-300, 0.5, 1e39}) {
    json doc = demo_config();
    doc["text_config"]["rope_parameters"]["rope_theta"] = theta;
    expect_rejected(doc, {"rope_theta must be in [1, 3.4e38]"});
  }
}

TEST(Config, RejectsMoreLayersThanAnyModelOfTheFamily) {
  json doc = demo_config();
  doc["text_config"]["num_hidden_layers"] = 1000000;
  doc["text_config"].erase("layer_types");
  expect_rejected(doc, {"num_hidden_layers = 1000000 is more than 1024"});
}

TEST(Config, RejectsOtherModelTypes) {
  for (const char* type : {"qwen3_moe", "qwen3_next", "qwen3_5", "qwen3", "llama"}) {
    json doc = demo_config();
    doc["model_type"] = type;
    expect_rejected(doc, {std::string("model_type ") + type, "not supported"});
  }
  json doc = demo_config();
  doc.erase("model_type");
  expect_rejected(doc, {"no model_type"});
  doc = demo_config();
  doc["text_config"]["model_type"] = "qwen3_next";
  expect_rejected(doc, {"qwen3_next"});
  doc = demo_config();
  doc.erase("text_config");
  expect_rejected(doc, {"text_config"});
}

TEST(Config, RejectsForeignQuantizationMethods) {
  for (const char* method : {"awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors"}) {
    json doc = demo_config();
    doc["quantization_config"] = {{"quant_method", method}, {"bits", 4}};
    std::string upper = method;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    expect_rejected(doc, {upper + " checkpoint is not supported", method});
  }
  json doc = demo_config();
  doc.erase("quantization");
  doc["quantization_config"] = {{"quant_method", "gptq"}};
  expect_rejected(doc, {"GPTQ checkpoint"});
}

TEST(Config, RejectsUnquantized) {
  json doc = demo_config();
  doc.erase("quantization");
  doc.erase("quantization_config");
  expect_rejected(doc, {"unquantized checkpoint"});
}

TEST(Config, RejectsEightBitEverywhere) {
  json doc = demo_config();
  doc["quantization"]["bits"] = 8;
  expect_rejected(doc, {"8-bit checkpoint"});
}

TEST(Config, RejectsOtherBitsModesAndGroupSizes) {
  for (int g : {32, 128}) {
    json doc = demo_config();
    doc["quantization"]["group_size"] = g;
    expect_rejected(doc, {"group size " + std::to_string(g), "expected 64"});
  }
  json doc = demo_config();
  doc["quantization"]["bits"] = 3;
  expect_rejected(doc, {"bits = 3"});
  doc = demo_config();
  doc["quantization"]["mode"] = "mxfp4";
  expect_rejected(doc, {"mode", "mxfp4"});
}

TEST(Config, RejectsOverridesOtherThanRouterAndSharedGate) {
  json doc = demo_config();
  doc["quantization"]["language_model.model.layers.0.mlp.switch_mlp.down_proj"] = {{"group_size", 64}, {"bits", 8}};
  expect_rejected(doc, {"switch_mlp.down_proj", "override"});
  doc = demo_config();
  doc["quantization"]["language_model.model.layers.0.mlp.gate"] = {{"group_size", 32}, {"bits", 8}};
  expect_rejected(doc, {"layers.0.mlp.gate"});
  doc = demo_config();
  doc["quantization"]["language_model.model.layers.0.mlp.gate"] = {{"group_size", 64}, {"bits", 4}};
  expect_rejected(doc, {"layers.0.mlp.gate"});
  doc = demo_config();
  doc["quantization"]["language_model.model.layers.0.xmlp.gate"] = {{"group_size", 64}, {"bits", 8}};
  expect_rejected(doc, {"xmlp.gate"});
}

TEST(Config, RejectsInconsistentLayerTypes) {
  json doc = demo_config();
  doc["text_config"]["layer_types"][2] = "full_attention";
  expect_rejected(doc, {"layer_types[2]", "full_attention_interval 4"});
  doc = demo_config();
  doc["text_config"]["layer_types"].erase(7);
  expect_rejected(doc, {"layer_types has 7 entries for 8 layers"});
  doc = demo_config();
  doc["text_config"]["layer_types"][0] = "sliding_attention";
  expect_rejected(doc, {"sliding_attention"});
  doc = demo_config();
  doc["text_config"]["full_attention_interval"] = 2;
  expect_rejected(doc, {"full_attention_interval 2"});
}

TEST(Config, AcceptsOtherInterval) {
  json doc = demo_config();
  doc["text_config"]["full_attention_interval"] = 2;
  for (int i = 0; i < 8; ++i) doc["text_config"]["layer_types"][i] = i % 2 == 1 ? "full_attention" : "linear_attention";
  ModelConfig c = parse_model_config(doc, "cfg.json");
  EXPECT_EQ(c.n_full_attention_layers(), 4);
}

TEST(Config, RejectsArchitectureFlags) {
  json doc = demo_config();
  doc["text_config"]["attn_output_gate"] = false;
  expect_rejected(doc, {"attn_output_gate must be true"});
  doc = demo_config();
  doc["text_config"]["tie_word_embeddings"] = true;
  expect_rejected(doc, {"tie_word_embeddings must be false"});
  doc = demo_config();
  doc["tie_word_embeddings"] = true;
  expect_rejected(doc, {"tie_word_embeddings must be false"});
  doc = demo_config();
  doc["text_config"]["norm_topk_prob"] = false;
  expect_rejected(doc, {"norm_topk_prob must be true"});
  doc = demo_config();
  doc["text_config"]["hidden_act"] = "gelu";
  expect_rejected(doc, {"hidden_act", "gelu"});
}

TEST(Config, RejectsInconsistentDims) {
  json doc = demo_config();
  doc["text_config"]["linear_num_value_heads"] = 3;  // not a multiple of 2 key heads
  expect_rejected(doc, {"linear_num_value_heads must be a multiple"});
  doc = demo_config();
  doc["text_config"]["num_key_value_heads"] = 3;
  expect_rejected(doc, {"num_key_value_heads"});
  doc = demo_config();
  doc["text_config"]["num_experts_per_tok"] = 17;
  expect_rejected(doc, {"num_experts_per_tok"});
  doc = demo_config();
  doc["text_config"]["hidden_size"] = 200;
  expect_rejected(doc, {"hidden_size = 200", "64"});
  doc = demo_config();
  doc["eos_token_id"] = 9000;
  expect_rejected(doc, {"eos_token_id"});
}

TEST(Config, RejectsMissingOrMistypedFields) {
  for (const char* field : {"hidden_size", "vocab_size", "num_experts", "head_dim", "linear_conv_kernel_dim",
                            "rms_norm_eps", "layer_types", "tie_word_embeddings"}) {
    json doc = demo_config();
    doc["text_config"].erase(field);
    expect_rejected(doc, {field});
  }
  json doc = demo_config();
  doc["text_config"]["hidden_size"] = "256";
  expect_rejected(doc, {"hidden_size must be an integer"});
  doc = demo_config();
  doc["text_config"]["num_experts"] = -16;
  expect_rejected(doc, {"num_experts"});
  doc = demo_config();
  doc["text_config"]["rope_parameters"].erase("partial_rotary_factor");
  doc["text_config"].erase("partial_rotary_factor");
  expect_rejected(doc, {"partial_rotary_factor"});
}

TEST(Config, LoadRejectsMissingAndInvalidFiles) {
  test::TempDir dir;
  EXPECT_THROW(load_model_config(dir.path()), CheckpointError);
  std::ofstream(dir.path() / "config.json") << "{not json";
  try {
    load_model_config(dir.path());
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos);
  }
}

/// The role a tensor's name implies, worked out from the name alone (the table states it).
TensorRole role_by_name(const std::string& name) {
  using R = TensorRole;
  const std::pair<const char*, R> suffixes[] = {
      {"embed_tokens", R::kEmbedding},
      {"lm_head", R::kOutputHead},
      {"model.norm.weight", R::kFinalNorm},
      {"input_layernorm.weight", R::kInputNorm},
      {"post_attention_layernorm.weight", R::kPostAttentionNorm},
      {"in_proj_qkv", R::kGdnInProj},
      {"in_proj_z", R::kGdnInProj},
      {"in_proj_a", R::kGdnInProj},
      {"in_proj_b", R::kGdnInProj},
      {"conv1d.weight", R::kGdnConv},
      {"A_log", R::kGdnALog},
      {"dt_bias", R::kGdnDtBias},
      {"linear_attn.norm.weight", R::kGdnNorm},
      {"linear_attn.out_proj", R::kGdnOutProj},
      {"q_proj", R::kAttnInProj},
      {"k_proj", R::kAttnInProj},
      {"v_proj", R::kAttnInProj},
      {"q_norm.weight", R::kAttnQNorm},
      {"k_norm.weight", R::kAttnKNorm},
      {"o_proj", R::kAttnOutProj},
      {".mlp.gate", R::kRouter},
      {"shared_expert_gate", R::kSharedExpertGate},
      {"switch_mlp.gate_proj", R::kExpertsGateProj},
      {"switch_mlp.up_proj", R::kExpertsUpProj},
      {"switch_mlp.down_proj", R::kExpertsDownProj},
      {"shared_expert.gate_proj", R::kSharedGateProj},
      {"shared_expert.up_proj", R::kSharedUpProj},
      {"shared_expert.down_proj", R::kSharedDownProj},
  };
  for (const auto& [suffix, role] : suffixes)
    if (name.ends_with(suffix)) return role;
  ADD_FAILURE() << "no role known for " << name;
  return R::kEmbedding;
}

TEST(TensorTable, DemoTableShapes) {
  ModelConfig c = load_model_config(test::demo_model_dir());
  auto table = tensor_table(c);
  ASSERT_FALSE(table.empty());
  EXPECT_EQ(table.front().name, "language_model.model.embed_tokens");
  EXPECT_EQ(table.back().name, "language_model.lm_head");
  // 6 GDN layers × (9 + 2 + 8) + 2 attention layers × (6 + 2 + 8) + embed, norm, lm_head.
  EXPECT_EQ(table.size(), size_t(6 * 19 + 2 * 16 + 3));
  for (const auto& spec : table) {
    if (spec.name == "language_model.model.layers.0.mlp.switch_mlp.down_proj") {
      EXPECT_EQ(spec.shape, (std::vector<int64_t>{16, 256, 128}));
      EXPECT_EQ(packed_codes_shape(spec), (std::vector<int64_t>{16, 256, 16}));
      EXPECT_EQ(group_params_shape(spec), (std::vector<int64_t>{16, 256, 2}));
      EXPECT_EQ(stored_bytes(spec), 16 * 256 * 16 * 4 + 2 * 16 * 256 * 2 * 2);
    }
    if (spec.name == "language_model.model.layers.5.mlp.gate") {
      EXPECT_EQ(spec.bits, 8);
      EXPECT_EQ(packed_codes_shape(spec), (std::vector<int64_t>{16, 64}));
    }
    if (spec.name == "language_model.model.layers.3.self_attn.q_proj") {
      EXPECT_EQ(spec.shape, (std::vector<int64_t>{4 * 2 * 64, 256}));
    }
    if (spec.name.ends_with("A_log")) {
      EXPECT_EQ(spec.kind, TensorKind::kFloat);
    }
    // The two plain tensors with a second accepted storage; every other spec has none.
    EXPECT_EQ(spec.f32_accepted, spec.name.ends_with("linear_attn.norm.weight")) << spec.name;
    if (spec.name.ends_with("conv1d.weight")) {
      EXPECT_EQ(spec.shape, (std::vector<int64_t>{c.gdn_conv_channels(), c.gdn_conv_kernel, 1}));
      EXPECT_EQ(spec.alt_shape, (std::vector<int64_t>{c.gdn_conv_channels(), 1, c.gdn_conv_kernel}));
    } else {
      EXPECT_TRUE(spec.alt_shape.empty()) << spec.name;
    }
    if (spec.kind == TensorKind::kQuantized && !spec.name.ends_with("mlp.gate") &&
        !spec.name.ends_with("shared_expert_gate")) {
      EXPECT_EQ(spec.bits, 4) << spec.name;
    }
    EXPECT_EQ(spec.role, role_by_name(spec.name)) << spec.name;
  }
}

/// Every role the table uses has its own name, the enumerator's in snake case.
TEST(TensorTable, RoleNamesAreDistinct) {
  std::map<TensorRole, std::string> names;
  for (const auto& spec : tensor_table(parse_model_config(real_config(), "cfg.json")))
    names.emplace(spec.role, role_name(spec.role));
  EXPECT_EQ(names.size(), 23u);
  std::set<std::string> distinct;
  for (const auto& [role, name] : names) {
    EXPECT_FALSE(name.empty());
    EXPECT_TRUE(distinct.insert(name).second) << name << " names two roles";
  }
  EXPECT_STREQ(role_name(TensorRole::kGdnInProj), "gdn_in_proj");
  EXPECT_STREQ(role_name(TensorRole::kRouter), "router");
  EXPECT_STREQ(role_name(TensorRole::kSharedDownProj), "shared_down_proj");
}

/// Address of the field a destination points at.
const void* dest_address(const TensorDest& dest) {
  return std::visit([](auto* field) -> const void* { return field; }, dest);
}

/// for_each_tensor visits exactly the specs of tensor_table, in its order, each once, with a
/// destination of the spec's kind that is a distinct field of the walked weights (inside its own
/// layer for a per-layer spec).
void expect_one_description(const ModelConfig& c) {
  const auto table = tensor_table(c);
  ModelWeights w;
  std::vector<TensorSpec> visited;
  std::set<const void*> dests;
  for_each_tensor(c, w, [&](const TensorSpec& spec, TensorDest dest) {
    visited.push_back(spec);
    ASSERT_NE(dest_address(dest), nullptr) << spec.name;
    EXPECT_TRUE(dests.insert(dest_address(dest)).second) << spec.name << " shares a destination";
    EXPECT_EQ(std::holds_alternative<QuantMatrix*>(dest), spec.kind == TensorKind::kQuantized) << spec.name;
    const auto* p = static_cast<const char*>(dest_address(dest));
    if (spec.layer >= 0) {
      ASSERT_LT(spec.layer, static_cast<int>(w.layers.size())) << spec.name;
      const auto* l = reinterpret_cast<const char*>(&w.layers[spec.layer]);
      EXPECT_TRUE(p >= l && p < l + sizeof(LayerWeights)) << spec.name << " lands outside layer " << spec.layer;
    } else {
      const auto* top = reinterpret_cast<const char*>(&w);
      EXPECT_TRUE(p >= top && p < top + sizeof(ModelWeights)) << spec.name << " lands outside ModelWeights";
    }
  });
  ASSERT_EQ(visited.size(), table.size());
  std::set<std::string> names;
  for (size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(visited[i].name, table[i].name);
    EXPECT_EQ(visited[i].shape, table[i].shape) << table[i].name;
    EXPECT_EQ(visited[i].kind, table[i].kind) << table[i].name;
    EXPECT_EQ(visited[i].bits, table[i].bits) << table[i].name;
    EXPECT_EQ(visited[i].layer, table[i].layer) << table[i].name;
    EXPECT_EQ(visited[i].role, table[i].role) << table[i].name;
    EXPECT_TRUE(names.insert(table[i].name).second) << table[i].name << " named twice";
  }
  ASSERT_EQ(w.layers.size(), static_cast<size_t>(c.n_layers));
  for (int i = 0; i < c.n_layers; ++i) EXPECT_EQ(w.layers[i].type, c.layer_types[i]);
}

TEST(TensorTable, ForEachTensorVisitsEverySpecOnceIntoDistinctFields) {
  expect_one_description(load_model_config(test::demo_model_dir()));
  expect_one_description(parse_model_config(real_config(), "cfg.json"));
}

TEST(TensorTable, LoadedWeightsFillEveryDestination) {
  const auto w = load_model(test::demo_model_dir());
  size_t visited = 0;
  for_each_tensor(*w, [&](const TensorSpec& spec, ConstTensorDest dest) {
    ++visited;
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    if (auto* q = std::get_if<const QuantMatrix*>(&dest)) {
      EXPECT_NE((*q)->codes, nullptr) << spec.name;
      EXPECT_EQ((*q)->rows * (*q)->cols, numel) << spec.name;
      EXPECT_EQ((*q)->bits, spec.bits) << spec.name;
    } else {
      EXPECT_EQ(std::get<const std::vector<float>*>(dest)->size(), static_cast<size_t>(numel)) << spec.name;
    }
  });
  EXPECT_EQ(visited, tensor_table(w->config).size());
}

/// The read-only walk hands out the same fields, in the same order, as the loader's walk.
TEST(TensorTable, ConstWalkVisitsTheLoadersFields) {
  ModelWeights w;
  w.config = load_model_config(test::demo_model_dir());
  std::vector<const void*> filled;
  for_each_tensor(w.config, w, [&](const TensorSpec&, TensorDest dest) { filled.push_back(dest_address(dest)); });
  std::vector<const void*> read;
  for_each_tensor(std::as_const(w), [&](const TensorSpec& spec, ConstTensorDest dest) {
    read.push_back(std::visit([](auto* field) -> const void* { return field; }, dest));
    EXPECT_EQ(std::holds_alternative<const QuantMatrix*>(dest), spec.kind == TensorKind::kQuantized) << spec.name;
  });
  EXPECT_EQ(read, filled);
}

TEST(TensorTable, ConstWalkRefusesLayersThatDisagreeWithTheConfig) {
  ModelWeights w;
  w.config = load_model_config(test::demo_model_dir());
  auto visit = [](const TensorSpec&, ConstTensorDest) {};
  EXPECT_THROW(for_each_tensor(std::as_const(w), visit), InternalError);  // no layers yet
  for_each_tensor(w.config, w, [](const TensorSpec&, TensorDest) {});
  EXPECT_NO_THROW(for_each_tensor(std::as_const(w), visit));
  w.layers[0].type = w.layers[0].type == LayerType::kFullAttention ? LayerType::kLinearAttention
                                                                   : LayerType::kFullAttention;
  EXPECT_THROW(for_each_tensor(std::as_const(w), visit), InternalError);
}

}  // namespace
}  // namespace lily
