// `lily synth` and the safetensors writer: MLX affine quantization of a group, streamed and
// sharded safetensors output read back by lily's own reader, determinism (seed, thread count),
// the written checkpoints loading with load_model, and the bad-input errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/bf16.h"
#include "base/error.h"
#include "base/file_util.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/config_json.h"
#include "model/loader.h"
#include "model/synth.h"
#include "model/tensor_table.h"
#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

namespace fs = std::filesystem;


uint32_t code_at(const uint32_t* packed, int bits, int c) {
  const int per = 32 / bits;
  return (packed[c / per] >> (bits * (c % per))) & ((1u << bits) - 1);
}

// ---- quantize_group_affine (docs/model.md §2.2) ----------------------------------------------------

TEST(SynthQuantize, RampGroupFourBit) {
  float w[64];
  for (int i = 0; i < 64; ++i) w[i] = -1.0f + 2.0f * i / 63.0f;
  uint32_t packed[8];
  uint16_t s, b;
  quantize_group_affine(w, 4, packed, &s, &b);
  EXPECT_EQ(s, float_to_bf16(2.0f / 15.0f));
  EXPECT_EQ(b, float_to_bf16(-1.0f));
  EXPECT_EQ(code_at(packed, 4, 0), 0u);
  EXPECT_EQ(code_at(packed, 4, 63), 15u);
  // Nibble 0 is the lowest bits: element 0 is code 0, element 5 (w ≈ −0.84) is code 1.
  EXPECT_EQ(packed[0] & 0xF, 0u);
  EXPECT_EQ((packed[0] >> 20) & 0xF, code_at(packed, 4, 5));
  const float scale = bf16_to_float(s), bias = bf16_to_float(b);
  for (int i = 0; i < 64; ++i) {
    const float deq = scale * float(code_at(packed, 4, i)) + bias;
    EXPECT_LE(std::fabs(deq - w[i]), 0.5f * scale + 1e-2f) << i;
  }
  // Codes are monotone in w for a ramp.
  for (int i = 1; i < 64; ++i) EXPECT_GE(code_at(packed, 4, i), code_at(packed, 4, i - 1));
}

TEST(SynthQuantize, EightBitAndRoundHalfEven) {
  float w[64];
  // Values at exact half steps of scale 1 from bias 0: 0.5 → 0, 1.5 → 2, 2.5 → 2 (half to even).
  for (int i = 0; i < 64; ++i) w[i] = 0.0f;
  w[63] = 255.0f;  // scale = 255/255 = 1, bias = 0
  w[1] = 0.5f;
  w[2] = 1.5f;
  w[3] = 2.5f;
  w[4] = 3.25f;
  uint32_t packed[16];
  uint16_t s, b;
  quantize_group_affine(w, 8, packed, &s, &b);
  EXPECT_EQ(bf16_to_float(s), 1.0f);
  EXPECT_EQ(bf16_to_float(b), 0.0f);
  EXPECT_EQ(code_at(packed, 8, 1), 0u);
  EXPECT_EQ(code_at(packed, 8, 2), 2u);
  EXPECT_EQ(code_at(packed, 8, 3), 2u);
  EXPECT_EQ(code_at(packed, 8, 4), 3u);
  EXPECT_EQ(code_at(packed, 8, 63), 255u);
  EXPECT_EQ(packed[15] >> 24, 255u);  // element 63 in the top byte of the last word
}

TEST(SynthQuantize, ConstantGroupUsesTinyScale) {
  float w[64];
  for (float& x : w) x = 0.75f;
  uint32_t packed[8];
  uint16_t s, b;
  quantize_group_affine(w, 4, packed, &s, &b);
  EXPECT_EQ(s, float_to_bf16(1e-8f));
  EXPECT_EQ(bf16_to_float(b), 0.75f);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(code_at(packed, 4, i), 0u);
}

// ---- SafetensorsWriter / CheckpointWriter -----------------------------------------------------

TEST(SafetensorsWriter, PiecesFromThreadsReadBackExactly) {
  test::TempDir dir;
  const fs::path path = dir.path() / "a.safetensors";
  std::vector<TensorDecl> decls = {{"odd", DType::kBF16, {3}},  // 6 bytes: placed last
                                   {"codes", DType::kU32, {64, 16}},
                                   {"gain", DType::kF32, {5}},
                                   {"empty", DType::kBF16, {0, 4}}};
  {
    SafetensorsWriter w(path, decls, {{"format", "mlx"}});
    std::vector<uint32_t> codes(64 * 16);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint32_t(i * 2654435761u);
    // Rows written by 4 threads in reverse order.
    std::vector<std::thread> pool;
    for (int t = 3; t >= 0; --t)
      pool.emplace_back([&, t] {
        auto piece = std::as_bytes(std::span<const uint32_t>(codes).subspan(t * 256, 256));
        w.write(w.index_of("codes"), uint64_t(t) * 1024, piece);
      });
    for (auto& th : pool) th.join();
    const uint16_t odd[3] = {1, 2, 3};
    w.write(w.index_of("odd"), 0, std::as_bytes(std::span<const uint16_t>(odd)));
    const float gain[5] = {1.5f, -2.0f, 0.0f, 3.25f, 1e-3f};
    w.write(w.index_of("gain"), 8, std::as_bytes(std::span<const float>(gain + 2, 3)));
    w.write(w.index_of("gain"), 0, std::as_bytes(std::span<const float>(gain, 2)));
    w.finish();
  }
  const std::string raw = read_regular_file(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 4u);
  const TensorInfo* codes = file.find("codes");
  ASSERT_NE(codes, nullptr);
  EXPECT_EQ(codes->dtype, DType::kU32);
  EXPECT_EQ(codes->shape, (std::vector<int64_t>{64, 16}));
  const auto* c = reinterpret_cast<const uint32_t*>(codes->data);
  for (size_t i = 0; i < 64 * 16; ++i) ASSERT_EQ(c[i], uint32_t(i * 2654435761u)) << i;
  const auto* g = reinterpret_cast<const float*>(file.find("gain")->data);
  EXPECT_EQ(g[0], 1.5f);
  EXPECT_EQ(g[4], 1e-3f);
  const auto* o = reinterpret_cast<const uint16_t*>(file.find("odd")->data);
  EXPECT_EQ(o[2], 3);
  EXPECT_EQ(file.find("empty")->nbytes, 0u);
}

TEST(SafetensorsWriter, IncompleteOrOverlongWritesAreRejected) {
  test::TempDir dir;
  const fs::path path = dir.path() / "b.safetensors";
  {
    SafetensorsWriter w(path, {{"x", DType::kF32, {4}}});
    const float v[5] = {};
    EXPECT_THROW(w.write(0, 4, std::as_bytes(std::span<const float>(v, 4))), InternalError);
    w.write(0, 0, std::as_bytes(std::span<const float>(v, 3)));
    EXPECT_THROW(w.finish(), InternalError);
  }
  EXPECT_FALSE(fs::exists(path)) << "an unfinished file must be removed";
  EXPECT_THROW(SafetensorsWriter(dir.path() / "c.safetensors", {{"x", DType::kF32, {1}}, {"x", DType::kF32, {1}}}),
               Error);
  EXPECT_THROW(SafetensorsWriter(dir.path() / "no" / "such" / "dir.safetensors", {{"x", DType::kF32, {1}}}), Error);
}

TEST(SafetensorsWriter, ShardPlanRespectsTheLimit) {
  std::vector<TensorDecl> decls;
  for (int i = 0; i < 10; ++i) decls.push_back({"t" + std::to_string(i), DType::kF32, {25}});  // 100 bytes each
  decls.push_back({"big", DType::kF32, {1000}});
  const ShardPlan single = plan_shards(decls, 0);
  ASSERT_EQ(single.file_names, std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(single.shards[0].size(), decls.size());
  const ShardPlan plan = plan_shards(decls, 350);
  ASSERT_EQ(plan.shards.size(), 5u);  // 3+3+3+1, then "big" alone
  EXPECT_EQ(plan.file_names.front(), "model-00001-of-00005.safetensors");
  EXPECT_EQ(plan.file_names.back(), "model-00005-of-00005.safetensors");
  EXPECT_EQ(plan.shards[3].size(), 1u);
  EXPECT_EQ(plan.shards[4][0].name, "big");
  size_t total = 0;
  for (const auto& s : plan.shards) total += s.size();
  EXPECT_EQ(total, decls.size());
}

// ---- presets ----------------------------------------------------------------------------------

TEST(SynthPresets, ConfigsParseAndTheBigOneIsTheRealShape) {
  for (const auto& name : synth_preset_names()) {
    SynthPreset p = synth_preset(name);
    const ModelConfig c = parse_model_config(nlohmann::json::parse(p.config.dump()), name);
    EXPECT_EQ(p.config["model_type"], "qwen3_5_moe") << name;
    EXPECT_TRUE(p.config["eos_token_id"].is_array()) << name;
    EXPECT_EQ(p.config["quantization"], p.config["quantization_config"]) << name;
    EXPECT_EQ(p.config["quantization"].size(), 3u + 2u * c.n_layers) << name;
    for (int i = 0; i < c.n_layers; ++i) {
      const std::string key = "language_model.model.layers." + std::to_string(i) + ".mlp.shared_expert_gate";
      EXPECT_EQ(p.config["quantization"][key]["bits"], 8) << name << " " << key;
    }
    EXPECT_EQ(c.quantization.eight_bit_modules.size(), size_t(2 * c.n_layers)) << name;
  }
  const ModelConfig big = test::synth_preset_config("35b-a3b");
  EXPECT_TRUE(big.is_qwen36_35b_a3b());
  EXPECT_EQ(big.eos_token_ids, (std::vector<int32_t>{248046, 248044}));
  int64_t bytes = 0;
  for (const auto& spec : tensor_table(big)) bytes += stored_bytes(spec);
  EXPECT_GT(bytes, 19'000'000'000);
  EXPECT_LT(bytes, 20'500'000'000);
  const ModelConfig real = test::synth_preset_config("realdims");
  EXPECT_EQ(real.head_dim, 256);
  EXPECT_EQ(real.gdn_key_head_dim, 128);
  EXPECT_EQ(real.gdn_value_head_dim, 128);
  EXPECT_LT(real.gdn_n_key_heads, real.gdn_n_value_heads);
  EXPECT_EQ(real.n_experts_per_tok, 8);
  EXPECT_GE(real.n_experts, 32);
  EXPECT_THROW(synth_preset("huge"), Error);
}

// ---- whole checkpoints ------------------------------------------------------------------------

SynthResult synth(const fs::path& out, const std::string& preset, uint64_t seed, int threads, double shard_mb = -1) {
  SynthOptions o;
  o.preset = preset;
  o.seed = seed;
  o.out = out;
  o.threads = threads;
  o.shard_mb = shard_mb;
  return write_synthetic_checkpoint(o);
}

TEST(Synth, SameSeedSameBytesWhateverTheThreads) {
  test::TempDir dir;
  synth(dir.path() / "a", "tiny", 7, 1);
  synth(dir.path() / "b", "tiny", 7, 3);
  synth(dir.path() / "c", "tiny", 8, 2);
  const std::string a = read_regular_file(dir.path() / "a" / "model.safetensors");
  EXPECT_GT(a.size(), 500'000u);
  EXPECT_EQ(a, read_regular_file(dir.path() / "b" / "model.safetensors"));
  EXPECT_EQ(read_regular_file(dir.path() / "a" / "config.json"), read_regular_file(dir.path() / "b" / "config.json"));
  const std::string c = read_regular_file(dir.path() / "c" / "model.safetensors");
  ASSERT_EQ(a.size(), c.size());
  EXPECT_NE(a, c);
  // Not just a different header: most data bytes differ.
  size_t same = 0;
  for (size_t i = a.size() / 2; i < a.size(); ++i) same += a[i] == c[i];
  EXPECT_LT(same, a.size() / 4);
}

TEST(Synth, RealdimsIsThreadIndependentToo) {
  test::TempDir dir;
  synth(dir.path() / "a", "realdims", 3, 1);
  synth(dir.path() / "b", "realdims", 3, 4);
  EXPECT_EQ(read_regular_file(dir.path() / "a" / "model.safetensors"), read_regular_file(dir.path() / "b" / "model.safetensors"));
}

TEST(Synth, TinyLoadsWithNonDefaultValues) {
  test::TempDir dir;
  const SynthResult r = synth(dir.path(), "tiny", 1, 2);
  EXPECT_EQ(r.files, std::vector<std::string>{"model.safetensors"});
  auto w = load_model(dir.path());
  const ModelConfig& c = w->config;
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.n_layers, 4);
  EXPECT_EQ(c.n_full_attention_layers(), 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{c.vocab - 3, c.vocab - 5}));
  EXPECT_EQ(w->skipped_tensors, 0);
  for (float g : w->final_norm) {
    EXPECT_GE(g, 0.89f);
    EXPECT_LE(g, 1.11f);
  }
  std::set<float> distinct(w->final_norm.begin(), w->final_norm.end());
  EXPECT_GT(distinct.size(), 10u) << "norm gains must not all be 1";
  const GdnWeights& gdn = w->layers[0].gdn;
  for (float a : gdn.A_log) {
    EXPECT_GE(a, -1.5f);
    EXPECT_LT(a, 0.5f);
  }
  for (float d : gdn.dt_bias) {
    EXPECT_GE(d, -1.01f);
    EXPECT_LE(d, 1.01f);
  }
  EXPECT_NE(gdn.A_log[0], gdn.A_log[1]);
  // Dequantized lm_head rows have the intended spread (std 4/√H = 0.354).
  double sum2 = 0;
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t col = 0; col < c.hidden; ++col) sum2 += std::pow(w->lm_head.weight(r, col), 2);
  const double rms = std::sqrt(sum2 / (64.0 * c.hidden));
  EXPECT_NEAR(rms, 4.0 / std::sqrt(double(c.hidden)), 0.05);
}

// Routing is spread: over the normalized embedding rows of the first 256 tokens, the layer-0
// router's top-k picks use most experts, and no expert takes more than half the picks.
TEST(Synth, RoutingIsSpread) {
  test::TempDir dir;
  synth(dir.path(), "realdims", 5, 2);
  auto w = load_model(dir.path());
  const ModelConfig& c = w->config;
  const QuantMatrix& router = w->layers[0].moe.router;
  std::vector<int> picks(c.n_experts, 0);
  for (int64_t tok = 0; tok < 256; ++tok) {
    std::vector<float> x(c.hidden);
    double ss = 0;
    for (int j = 0; j < c.hidden; ++j) ss += std::pow(x[j] = w->embed_tokens.weight(tok, j), 2);
    const float r = float(1.0 / std::sqrt(ss / c.hidden + 1e-6));
    std::vector<std::pair<float, int>> logits;
    for (int e = 0; e < c.n_experts; ++e) {
      double acc = 0;
      for (int j = 0; j < c.hidden; ++j) acc += double(router.weight(e, j)) * x[j] * r;
      logits.push_back({float(acc), e});
    }
    std::partial_sort(logits.begin(), logits.begin() + c.n_experts_per_tok, logits.end(),
                      [](auto a, auto b) { return a.first > b.first; });
    for (int k = 0; k < c.n_experts_per_tok; ++k) ++picks[logits[k].second];
  }
  const int used = int(std::count_if(picks.begin(), picks.end(), [](int p) { return p > 0; }));
  EXPECT_GE(used, c.n_experts * 3 / 4);
  EXPECT_LT(*std::max_element(picks.begin(), picks.end()), 256 / 2);
}

TEST(Synth, ShardedIndexIsCorrectAndHoldsTheSameTensors) {
  test::TempDir dir;
  const SynthResult sharded = synth(dir.path() / "s", "tiny", 11, 2, 0.2);
  synth(dir.path() / "one", "tiny", 11, 2, 0);
  ASSERT_GE(sharded.files.size(), 2u);
  EXPECT_FALSE(fs::exists(dir.path() / "s" / "model.safetensors"));
  std::ifstream in(dir.path() / "s" / "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(in);
  const auto& weight_map = index.at("weight_map");
  SafetensorsFile single(dir.path() / "one" / "model.safetensors");
  EXPECT_EQ(weight_map.size(), single.tensors().size());
  uint64_t total = 0;
  std::set<std::string> seen_files;
  for (const auto& file_name : sharded.files) {
    SafetensorsFile shard(dir.path() / "s" / file_name);
    EXPECT_LE(shard.file_size(), 200'000u + 40'000u) << file_name;  // limit + header + one tensor slack
    for (const TensorInfo& t : shard.tensors()) {
      total += t.nbytes;
      EXPECT_EQ(weight_map.at(t.name), file_name) << t.name;
      const TensorInfo* same = single.find(t.name);
      ASSERT_NE(same, nullptr) << t.name;
      ASSERT_EQ(same->nbytes, t.nbytes) << t.name;
      EXPECT_EQ(std::memcmp(same->data, t.data, t.nbytes), 0) << t.name;
      seen_files.insert(file_name);
    }
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
  EXPECT_EQ(seen_files.size(), sharded.files.size());
  auto w = load_model(dir.path() / "s");
  EXPECT_EQ(w->config.n_layers, 4);
  // Rewriting the same directory unsharded removes the stale shards and index.
  synth(dir.path() / "s", "tiny", 11, 1, 0);
  EXPECT_FALSE(fs::exists(dir.path() / "s" / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir.path() / "s" / sharded.files[0]));
  load_model(dir.path() / "s");
}

TEST(Synth, TokenizerIsCopiedAndSetsTheStopIds) {
  test::TempDir dir;
  const fs::path tok = dir.path() / "src" / "tokenizer.json";
  fs::create_directories(tok.parent_path());
  nlohmann::json t = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}}}, {"merges", nlohmann::json::array()}}},
                      {"added_tokens",
                       {{{"id", 1019}, {"content", "<|endoftext|>"}, {"special", true}},
                        {{"id", 1021}, {"content", "<|im_end|>"}, {"special", true}}}}};
  std::ofstream(tok) << t.dump();
  SynthOptions o;
  o.preset = "tiny";
  o.out = dir.path() / "out";
  o.tokenizer = tok;
  write_synthetic_checkpoint(o);
  EXPECT_EQ(read_regular_file(dir.path() / "out" / "tokenizer.json"), t.dump());
  const auto tc = nlohmann::json::parse(read_regular_file(dir.path() / "out" / "tokenizer_config.json"));
  EXPECT_EQ(tc.at("eos_token"), "<|im_end|>");
  auto w = load_model(dir.path() / "out");
  EXPECT_EQ(w->config.eos_token_ids, (std::vector<int32_t>{1021, 1019}));

  t["added_tokens"].push_back({{"id", 1024}, {"content", "<x>"}});
  std::ofstream(tok) << t.dump();
  try {
    write_synthetic_checkpoint(o);
    FAIL() << "a tokenizer id outside the vocabulary must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1024"), std::string::npos) << e.what();
  }
  o.tokenizer = dir.path() / "missing.json";
  EXPECT_THROW(write_synthetic_checkpoint(o), Error);
}

// A bad --tokenizer is refused before anything is written: an existing checkpoint in --out keeps
// its weights (not removed first and then left behind by the failed tokenizer check), and a
// missing --out is not created.
TEST(Synth, BadTokenizerChangesNothing) {
  test::TempDir dir;
  SynthOptions o;
  o.preset = "tiny";
  o.seed = 3;
  o.out = dir.path() / "out";
  write_synthetic_checkpoint(o);
  const std::string weights = read_regular_file(o.out / "model.safetensors");
  const std::string config = read_regular_file(o.out / "config.json");
  ASSERT_FALSE(weights.empty());

  std::ofstream(dir.path() / "not_json.json") << "{\"model\":";
  nlohmann::json too_big = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 5000}}}}}};
  std::ofstream(dir.path() / "too_big.json") << too_big.dump();
  for (const char* bad : {"missing.json", "not_json.json", "too_big.json"}) {
    o.tokenizer = dir.path() / bad;
    o.seed = 4;
    o.out = dir.path() / "out";
    EXPECT_THROW(write_synthetic_checkpoint(o), Error) << bad;
    EXPECT_EQ(read_regular_file(o.out / "model.safetensors"), weights) << bad;
    EXPECT_EQ(read_regular_file(o.out / "config.json"), config) << bad;
    EXPECT_FALSE(fs::exists(o.out / "tokenizer.json")) << bad;
    o.out = dir.path() / "new";
    EXPECT_THROW(write_synthetic_checkpoint(o), Error) << bad;
    EXPECT_FALSE(fs::exists(o.out)) << bad;
  }
}

TEST(Synth, BadOptionsAreErrors) {
  test::TempDir dir;
  SynthOptions o;
  o.preset = "nope";
  o.out = dir.path();
  try {
    write_synthetic_checkpoint(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tiny"), std::string::npos) << "should list the presets: " << e.what();
  }
  o.preset = "tiny";
  std::ofstream(dir.path() / "file") << "x";
  o.out = dir.path() / "file";
  EXPECT_THROW(write_synthetic_checkpoint(o), Error);
}

TEST(Synth, CommandLineWritesTheCheckpoint) {
  test::TempDir dir;
  const std::string cmd = (test::binary_dir() / "lily").string() + " synth --preset tiny --seed 7 --threads 2 --out " +
                          (dir.path() / "cli").string() + " > " + (dir.path() / "log").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_regular_file(dir.path() / "log");
  synth(dir.path() / "lib", "tiny", 7, 1);
  EXPECT_EQ(read_regular_file(dir.path() / "cli" / "model.safetensors"), read_regular_file(dir.path() / "lib" / "model.safetensors"));
  const std::string bad = (test::binary_dir() / "lily").string() + " synth --preset nope --out " +
                          (dir.path() / "x").string() + " > " + (dir.path() / "log2").string() + " 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
  EXPECT_NE(read_regular_file(dir.path() / "log2").find("unknown synth preset"), std::string::npos);
}

}  // namespace
}  // namespace lily
