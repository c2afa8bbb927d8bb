// load_model on the committed demo model and on hand-corrupted copies of it (docs/model.md §2).
#include <gtest/gtest.h>

#include <cmath>

#include "base/bf16.h"
#include "base/error.h"
#include "io/checkpoint.h"
#include "model/loader.h"
#include "model/tensor_table.h"
#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

using test::SafetensorsBuilder;

TEST(Loader, LoadsDemoModel) {
  auto w = load_model(test::demo_model_dir());
  const ModelConfig& c = w->config;
  EXPECT_EQ(c.hidden, 256);
  EXPECT_EQ(c.n_layers, 8);
  EXPECT_EQ(c.n_experts, 16);
  ASSERT_EQ(w->layers.size(), 8u);
  EXPECT_EQ(w->skipped_tensors, 0);
  EXPECT_EQ(w->embed_tokens.rows, c.vocab);
  EXPECT_EQ(w->embed_tokens.cols, c.hidden);
  EXPECT_EQ(w->embed_tokens.bits, 4);
  EXPECT_EQ(w->final_norm.size(), size_t(c.hidden));
  for (int i = 0; i < c.n_layers; ++i) {
    const auto& l = w->layers[i];
    EXPECT_EQ(l.type == LayerType::kFullAttention, i % 4 == 3) << i;
    EXPECT_EQ(l.moe.router.bits, 8);
    EXPECT_EQ(l.moe.router.rows, c.n_experts);
    EXPECT_EQ(l.moe.shared_expert_gate.bits, 8);
    EXPECT_EQ(l.moe.shared_expert_gate.rows, 1);
    EXPECT_EQ(l.moe.experts_gate_proj.rows, int64_t(c.n_experts) * c.moe_ffn_dim);
    EXPECT_EQ(l.moe.experts_down_proj.rows, int64_t(c.n_experts) * c.hidden);
    EXPECT_EQ(l.moe.experts_down_proj.cols, c.moe_ffn_dim);
    if (l.type == LayerType::kLinearAttention) {
      EXPECT_EQ(l.gdn.conv1d.size(), size_t(c.gdn_conv_channels()) * c.gdn_conv_kernel);
      EXPECT_EQ(l.gdn.A_log.size(), size_t(c.gdn_n_value_heads));
      EXPECT_EQ(l.gdn.norm.size(), size_t(c.gdn_value_head_dim));
      EXPECT_EQ(l.gdn.in_proj_qkv.rows, c.gdn_conv_channels());
    } else {
      EXPECT_EQ(l.attention.q_proj.rows, int64_t(c.n_heads) * 2 * c.head_dim);
      EXPECT_EQ(l.attention.q_norm.size(), size_t(c.head_dim));
    }
  }
}

// The fp32 copies and the quantized views must show the bytes of the file itself.
TEST(Loader, DemoValuesMatchTheFile) {
  auto w = load_model(test::demo_model_dir());
  auto file = SafetensorsBuilder::from_file(test::demo_model_dir() / "model.safetensors");
  const auto* norm = file.find("language_model.model.layers.0.input_layernorm.weight");
  ASSERT_NE(norm, nullptr);
  for (size_t i = 0; i < 4; ++i) {
    uint16_t bits;
    std::memcpy(&bits, norm->bytes.data() + 2 * i, 2);
    EXPECT_EQ(w->layers[0].input_layernorm[i], bf16_to_float(bits));
  }
  const auto* alog = file.find("language_model.model.layers.0.linear_attn.A_log");
  ASSERT_NE(alog, nullptr);
  float a0;
  std::memcpy(&a0, alog->bytes.data(), 4);
  EXPECT_EQ(w->layers[0].gdn.A_log[0], a0);
  // conv1d stored [C, K, 1]: channel c, tap t at c·K + t.
  const auto* conv = file.find("language_model.model.layers.0.linear_attn.conv1d.weight");
  ASSERT_NE(conv, nullptr);
  const int K = w->config.gdn_conv_kernel;
  uint16_t c1t2;
  std::memcpy(&c1t2, conv->bytes.data() + 2 * (1 * K + 2), 2);
  EXPECT_EQ(w->layers[0].gdn.conv1d[1 * K + 2], bf16_to_float(c1t2));
  // Dequantized weight from the view equals scale·q + bias computed from the file bytes.
  const auto* codes = file.find("language_model.lm_head.weight");
  const auto* scales = file.find("language_model.lm_head.scales");
  const auto* biases = file.find("language_model.lm_head.biases");
  ASSERT_TRUE(codes && scales && biases);
  const int64_t r = 5, c = 77, words = w->lm_head.words_per_row(), groups = w->lm_head.groups_per_row();
  uint32_t word;
  std::memcpy(&word, codes->bytes.data() + 4 * (r * words + c / 8), 4);
  uint16_t s, b;
  std::memcpy(&s, scales->bytes.data() + 2 * (r * groups + c / 64), 2);
  std::memcpy(&b, biases->bytes.data() + 2 * (r * groups + c / 64), 2);
  const uint32_t q = (word >> (4 * (c % 8))) & 0xF;
  EXPECT_EQ(w->lm_head.code(r, c), q);
  EXPECT_EQ(w->lm_head.weight(r, c), bf16_to_float(s) * float(q) + bf16_to_float(b));
}

// --- hand-corrupted copies of the demo model -------------------------------------------------

const std::string P0 = "language_model.model.layers.0.";
const std::string P3 = "language_model.model.layers.3.";

/// A copy of models/demo in a temp dir whose tensors can be edited before writing.
struct DemoCopy {
  test::TempDir dir;
  SafetensorsBuilder st;
  DemoCopy() {
    test::copy_dir(test::demo_model_dir(), dir.path());
    st = SafetensorsBuilder::from_file(dir.path() / "model.safetensors");
  }
  void write() const { st.write(dir.path() / "model.safetensors"); }
  /// Writes, loads, and expects a one-line CheckpointError containing every part.
  void expect_rejected(std::initializer_list<std::string> parts) const {
    write();
    try {
      load_model(dir.path());
      FAIL() << "loaded a corrupted checkpoint; expected an error mentioning " << *parts.begin();
    } catch (const CheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    }
  }
  void set_u16(const std::string& name, size_t index, uint16_t value) {
    auto* t = st.find(name);
    ASSERT_NE(t, nullptr) << name;
    std::memcpy(&t->bytes[2 * index], &value, 2);
  }
};

TEST(LoaderRejects, MissingTensorNamed) {
  DemoCopy d;
  ASSERT_TRUE(d.st.remove("language_model.model.layers.2.linear_attn.dt_bias"));
  d.expect_rejected({"missing tensor language_model.model.layers.2.linear_attn.dt_bias"});
}

TEST(LoaderRejects, MissingHalfOfATriple) {
  DemoCopy d;
  ASSERT_TRUE(d.st.remove(P0 + "linear_attn.in_proj_z.biases"));
  d.expect_rejected({"missing tensor " + P0 + "linear_attn.in_proj_z.biases"});
  DemoCopy e;
  ASSERT_TRUE(e.st.remove(P0 + "linear_attn.in_proj_z.scales"));
  e.expect_rejected({P0 + "linear_attn.in_proj_z", "no .scales"});
}

TEST(LoaderRejects, ExtraTensorNamed) {
  DemoCopy d;
  d.st.add(P0 + "mlp.experts.gate_up_proj", "BF16", {4}, test::bf16_bytes(4, 1.0f));
  d.expect_rejected({"1 unexpected tensor", P0 + "mlp.experts.gate_up_proj"});
}

TEST(LoaderRejects, MisShapedPlainTensorNamed) {
  DemoCopy d;
  d.st.add("language_model.model.layers.1.linear_attn.norm.weight", "BF16", {32}, test::bf16_bytes(32, 1.0f));
  d.expect_rejected({"language_model.model.layers.1.linear_attn.norm.weight", "[32]", "expected [64]"});
}

/// Gives tensor `name` of a demo copy the 2-D shape {rows, cols} (bytes resized to match) and
/// expects the load to be refused with a message naming it, the shape found and the one expected.
void expect_reshaped_rejected(const std::string& name, int64_t rows, int64_t cols, size_t element_bytes,
                              const std::string& expected) {
  DemoCopy d;
  auto* t = d.st.find(name);
  ASSERT_NE(t, nullptr) << name;
  t->shape = {rows, cols};
  t->bytes.resize(rows * cols * element_bytes);
  d.expect_rejected({name, "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]", expected});
}

TEST(LoaderRejects, MisShapedQuantizedTensorNamed) {
  expect_reshaped_rejected(P0 + "linear_attn.in_proj_z.weight", 128, 32, 4, "expected [256, 32]");
}

TEST(LoaderRejects, MisShapedScalesNamed) {
  expect_reshaped_rejected(P3 + "self_attn.k_proj.biases", 64, 4, 2, "expected [128, 4]");
}

TEST(LoaderRejects, WrongDtype) {
  DemoCopy d;
  d.st.add(P0 + "linear_attn.dt_bias", "F32", {4}, test::f32_bytes({1, 1, 1, 1}));
  d.expect_rejected({P0 + "linear_attn.dt_bias", "is F32; expected BF16"});
  DemoCopy e;
  e.st.find(P0 + "mlp.gate.scales")->dtype = "F16";
  e.expect_rejected({P0 + "mlp.gate.scales", "is F16; expected BF16"});
  DemoCopy f;
  f.st.find(P0 + "mlp.gate.weight")->dtype = "I32";
  f.expect_rejected({P0 + "mlp.gate.weight", "is I32; expected U32"});
}

TEST(LoaderRejects, NanInAScale) {
  DemoCopy d;
  d.set_u16("language_model.model.layers.4.mlp.switch_mlp.up_proj.scales", 1000, 0x7fc0);  // bf16 NaN
  d.expect_rejected({"language_model.model.layers.4.mlp.switch_mlp.up_proj.scales", "NaN or Inf", "element 1000"});
}

TEST(LoaderRejects, InfInABiasAndANorm) {
  DemoCopy d;
  d.set_u16("language_model.lm_head.biases", 7, 0xff80);  // bf16 −Inf
  d.expect_rejected({"language_model.lm_head.biases", "NaN or Inf"});
  DemoCopy e;
  e.set_u16(P3 + "self_attn.q_norm.weight", 0, 0x7f80);
  e.expect_rejected({P3 + "self_attn.q_norm.weight", "NaN or Inf"});
  DemoCopy f;
  f.set_u16(P0 + "linear_attn.conv1d.weight", 3, 0x7f81);
  f.expect_rejected({P0 + "linear_attn.conv1d.weight", "NaN or Inf"});
}

TEST(LoaderRejects, NanInAnF32ALog) {
  DemoCopy d;
  d.st.add(P0 + "linear_attn.A_log", "F32", {4}, test::f32_bytes({0.f, std::nanf(""), 0.f, 0.f}));
  d.expect_rejected({P0 + "linear_attn.A_log", "NaN or Inf"});
}

TEST(Loader, FiniteCheckCanBeSkipped) {
  DemoCopy d;
  d.set_u16("language_model.lm_head.scales", 0, 0x7fc0);
  d.write();
  LoadOptions options;
  options.check_finite = false;
  EXPECT_NO_THROW(load_model(d.dir.path(), options));
}

TEST(Loader, MtpAndVisionTensorsAreSkippedAndCounted) {
  DemoCopy d;
  d.st.add("mtp.fc.weight", "BF16", {2, 4}, test::bf16_bytes(8, 1.0f));
  d.st.add("mtp.layers.0.input_layernorm.weight", "BF16", {4}, test::bf16_bytes(4, 1.0f));
  d.st.add("vision_tower.blocks.0.attn.qkv.weight", "F32", {2}, test::f32_bytes({1, 2}));
  d.write();
  auto w = load_model(d.dir.path());
  EXPECT_EQ(w->skipped_tensors, 3);
}

TEST(LoaderRejects, Bf16WeightInsteadOfQuantizedTriple) {
  DemoCopy d;
  const std::string q = P3 + "self_attn.q_proj";
  d.st.remove(q + ".scales");
  d.st.remove(q + ".biases");
  d.st.add(q + ".weight", "BF16", {512, 256}, test::bf16_bytes(512 * 256, 0.01f));
  d.expect_rejected({"unquantized BF16 checkpoint", q + ".weight"});
}

TEST(LoaderRejects, Fp8Tensor) {
  DemoCopy d;
  const std::string up = P0 + "mlp.shared_expert.up_proj";
  d.st.remove(up + ".scales");
  d.st.remove(up + ".biases");
  d.st.add(up + ".weight", "F8_E4M3", {128, 256}, std::string(128 * 256, '\x01'));
  d.st.add(up + ".weight_scale_inv", "F32", {1, 2}, test::f32_bytes({1, 1}));
  d.expect_rejected({"fp8 checkpoint", up + ".weight", "F8_E4M3"});
}

TEST(LoaderRejects, WrongBitWidthFromPackedShape) {
  DemoCopy d;  // in_proj_a stored at 8 bits: [4, 2048·8/32 = 64]
  auto* t = d.st.find(P0 + "linear_attn.in_proj_a.weight");
  t->shape = {4, 64};
  t->bytes.resize(4 * 64 * 4);
  d.expect_rejected({P0 + "linear_attn.in_proj_a", "uses 8-bit storage", "expected 4-bit"});
  DemoCopy e;  // router stored at 4 bits
  auto* r = e.st.find(P0 + "mlp.gate.weight");
  r->shape = {16, 32};
  r->bytes.resize(16 * 32 * 4);
  e.expect_rejected({P0 + "mlp.gate", "uses 4-bit storage", "expected 8-bit"});
}

TEST(LoaderRejects, GroupSizeOtherThan64FromScalesShape) {
  DemoCopy d;  // group size 32: scales and biases [8192, 256/32 = 8]
  for (const char* part : {".scales", ".biases"}) {
    auto* t = d.st.find(std::string("language_model.lm_head") + part);
    t->shape = {8192, 8};
    t->bytes = test::bf16_bytes(8192 * 8, 0.01f);
  }
  d.expect_rejected({"language_model.lm_head", "group size 32", "64"});
}

TEST(LoaderRejects, HuggingFaceNames) {
  DemoCopy d;
  auto* t = d.st.find("language_model.model.embed_tokens.weight");
  t->name = "model.language_model.embed_tokens.weight";
  d.expect_rejected({"Hugging Face names"});
}

TEST(LoaderRejects, GgufInsteadOfSafetensors) {
  DemoCopy d;
  test::write_file(d.dir.path() / "model.safetensors", std::string("GGUF\x03\0\0\0", 8) + std::string(100, '\0'));
  try {
    load_model(d.dir.path());
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("GGUF"), std::string::npos) << e.what();
  }
}

TEST(Loader, AcceptsHfConvLayoutAndBf16ALog) {
  DemoCopy d;
  auto* conv = d.st.find(P0 + "linear_attn.conv1d.weight");
  conv->shape = {512, 1, 4};  // same bytes: [C, 1, K] and [C, K, 1] share the memory order
  auto* alog = d.st.find(P0 + "linear_attn.A_log");
  float a[4];
  std::memcpy(a, alog->bytes.data(), 16);
  std::string bf;
  for (float x : a) bf += test::bf16_bytes(1, round_bf16(x));
  d.st.add(P0 + "linear_attn.A_log", "BF16", {4}, bf);
  d.write();
  auto w = load_model(d.dir.path());
  auto ref = load_model(test::demo_model_dir());
  EXPECT_EQ(w->layers[0].gdn.conv1d, ref->layers[0].gdn.conv1d);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(w->layers[0].gdn.A_log[i], round_bf16(a[i]));
}

// The second storages a spec accepts (F32 for the GDN gated-norm gain, [C, 1, K] for conv1d)
// are that spec's alone: the same storage elsewhere is refused, naming what is accepted.
TEST(Loader, AcceptsF32GdnNormOnly) {
  DemoCopy d;
  const std::vector<float> gains(64, 1.25f);
  d.st.add(P0 + "linear_attn.norm.weight", "F32", {64}, test::f32_bytes(gains));
  d.write();
  auto w = load_model(d.dir.path());
  EXPECT_EQ(w->layers[0].gdn.norm, gains);

  DemoCopy e;
  e.st.add(P0 + "input_layernorm.weight", "F32", {256}, test::f32_bytes(std::vector<float>(256, 1.0f)));
  e.expect_rejected({P0 + "input_layernorm.weight", "is F32; expected BF16"});
  DemoCopy f;
  f.st.add(P0 + "linear_attn.norm.weight", "F16", {64}, test::bf16_bytes(64, 1.0f));
  f.expect_rejected({P0 + "linear_attn.norm.weight", "is F16; expected BF16 (or F32)"});
  DemoCopy g;
  auto* conv = g.st.find(P0 + "linear_attn.conv1d.weight");
  ASSERT_NE(conv, nullptr);
  conv->shape = {512, 4};
  g.expect_rejected({P0 + "linear_attn.conv1d.weight", "expected [512, 4, 1] (or [512, 1, 4])"});
  DemoCopy h;
  auto* dt = h.st.find(P0 + "linear_attn.dt_bias");
  ASSERT_NE(dt, nullptr);
  dt->shape = {4, 1};
  h.expect_rejected({P0 + "linear_attn.dt_bias", "expected [4]"});
}

TEST(Loader, ShardedCopyLoadsTheSameWeights) {
  test::TempDir dir;
  test::copy_dir(test::demo_model_dir(), dir.path());
  std::filesystem::remove(dir.path() / "model.safetensors");
  auto all = SafetensorsBuilder::from_file(test::demo_model_dir() / "model.safetensors");
  SafetensorsBuilder a, b;
  nlohmann::json map;
  for (size_t i = 0; i < all.tensors().size(); ++i) {
    const auto& t = all.tensors()[i];
    const char* shard = i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    (i % 2 ? b : a).add(t.name, t.dtype, t.shape, t.bytes);
    map[t.name] = shard;
  }
  a.write(dir.path() / "model-00001-of-00002.safetensors");
  b.write(dir.path() / "model-00002-of-00002.safetensors");
  test::write_file(dir.path() / "model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  auto w = load_model(dir.path());
  auto ref = load_model(test::demo_model_dir());
  EXPECT_EQ(w->storage->files().size(), 2u);
  EXPECT_EQ(w->final_norm, ref->final_norm);
  for (int64_t r : {0, 100, 8191})
    for (int64_t c : {0, 63, 64, 255}) EXPECT_EQ(w->lm_head.weight(r, c), ref->lm_head.weight(r, c));
}

TEST(QuantMatrix, RowBlockSelectsOneExpert) {
  auto w = load_model(test::demo_model_dir());
  const auto& stack = w->layers[0].moe.experts_down_proj;  // E × [hidden, I]
  const int64_t rows = w->config.hidden;
  QuantMatrix e5 = stack.row_block(5 * rows, rows);
  EXPECT_EQ(e5.rows, rows);
  EXPECT_EQ(e5.cols, stack.cols);
  for (int64_t r : {0, 17, 255})
    for (int64_t c : {0, 64, 127}) EXPECT_EQ(e5.weight(r, c), stack.weight(5 * rows + r, c));
  EXPECT_THROW(stack.row_block(15 * rows, rows + 1), InternalError);
}

TEST(QuantMatrix, DecodesEightBitCodes) {
  uint32_t codes[2] = {0x04030201u, 0xff00fe10u};
  uint16_t scales[1] = {float_to_bf16(0.5f)};
  uint16_t biases[1] = {float_to_bf16(-1.0f)};
  QuantMatrix m{codes, scales, biases, 1, 64, 8, 64};
  // 8 bits: element c of word c/4 at bits 8·(c mod 4). Only the first 8 elements are backed here.
  m.cols = 64;
  EXPECT_EQ(m.code(0, 0), 1u);
  EXPECT_EQ(m.code(0, 3), 4u);
  EXPECT_EQ(m.code(0, 4), 0x10u);
  EXPECT_EQ(m.code(0, 5), 0xfeu);
  EXPECT_EQ(m.code(0, 7), 0xffu);
  EXPECT_EQ(m.weight(0, 7), 0.5f * 255 - 1.0f);
}

TEST(QuantMatrix, DecodesFourBitCodesLowestNibbleFirst) {
  // docs/model.md §2.2: word 0x22111100 decodes to codes 0,0,1,1,1,1,2,2.
  uint32_t codes[8] = {0x22111100u};
  uint16_t scales[1] = {float_to_bf16(-0.25f)};
  uint16_t biases[1] = {float_to_bf16(2.0f)};
  QuantMatrix m{codes, scales, biases, 1, 64, 4, 64};
  const uint32_t want[8] = {0, 0, 1, 1, 1, 1, 2, 2};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(m.code(0, c), want[c]) << c;
  EXPECT_EQ(m.weight(0, 6), -0.25f * 2 + 2.0f);
}

}  // namespace
}  // namespace lily
