// `lily synth`: random-weight checkpoints in the MLX layout (see synth.h).
#include "model/synth.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <exception>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "base/bf16.h"
#include "base/error.h"
#include "base/file_util.h"
#include "base/log.h"
#include "io/safetensors_writer.h"
#include "model/config_json.h"
#include "model/tensor_table.h"

namespace lily {

static_assert(std::endian::native == std::endian::little, "synth writes little-endian data from memory");

namespace {

using ordered_json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Deterministic randomness: splitmix64 for seeding, xoshiro256** for streams.

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

/// xoshiro256** seeded from one 64-bit key through splitmix64.
class Rng {
 public:
  explicit Rng(uint64_t key) {
    for (auto& word : s_) word = splitmix64(key);
  }
  uint64_t next() {
    const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return result;
  }

 private:
  uint64_t s_[4];
};

/// Key of the stream of chunk `chunk` of tensor `name` under `seed`.
uint64_t stream_key(uint64_t seed, std::string_view name, uint64_t chunk) {
  uint64_t state = seed;
  uint64_t a = splitmix64(state);
  uint64_t mix = fnv1a64(name) ^ a;
  uint64_t b = splitmix64(mix);
  uint64_t c = b + chunk * 0xD1B54A32D192ED03ull;
  return splitmix64(c);
}

/// Value distribution of one tensor: normal(mean a, std b) approximated by a sum of four
/// 16-bit uniforms (Irwin–Hall, range ±3.46 std), or uniform on [a, b).
struct InitRule {
  bool normal = true;
  float a = 0, b = 1;
};

class Sampler {
 public:
  explicit Sampler(const InitRule& rule) : rule_(rule) {
    // Sum of four uniforms on {0..65535}: mean 131070, std sqrt((65536²−1)/3) ≈ 37837.23.
    normal_mult_ = rule.b / 37837.227f;
    uniform_mult_ = (rule.b - rule.a) * (1.0f / 16777216.0f);
  }
  float operator()(Rng& rng) const {
    const uint64_t r = rng.next();
    if (rule_.normal) {
      const int32_t sum = static_cast<int32_t>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
      return static_cast<float>(sum - 131070) * normal_mult_ + rule_.a;
    }
    return static_cast<float>(r >> 40) * uniform_mult_ + rule_.a;
  }

 private:
  InitRule rule_;
  float normal_mult_ = 0, uniform_mult_ = 0;
};

/// Initialisation of each tensor of the table, by its role: chosen so that a random model stays
/// finite, has logits that are far from flat (lm_head std 4/√H) and spread routing (router std
/// 2/√H), GDN decays across (0, 1) (A_log, dt_bias non-default), and norm gains 1 ± 0.1 (stored
/// MLX gains = 1 + w_hf; the GDN gated-norm gain is plain). Other projections: std 1/√fan_in.
InitRule init_rule(const TensorSpec& spec) {
  const float inv_sqrt_fan_in = 1.0f / std::sqrt(static_cast<float>(spec.shape.back()));
  switch (spec.role) {
    case TensorRole::kEmbedding: return {true, 0.0f, 1.0f};
    case TensorRole::kOutputHead: return {true, 0.0f, 4.0f * inv_sqrt_fan_in};
    case TensorRole::kRouter: return {true, 0.0f, 2.0f * inv_sqrt_fan_in};
    case TensorRole::kGdnInProj:
    case TensorRole::kGdnOutProj:
    case TensorRole::kAttnInProj:
    case TensorRole::kAttnOutProj:
    case TensorRole::kSharedExpertGate:
    case TensorRole::kExpertsGateProj:
    case TensorRole::kExpertsUpProj:
    case TensorRole::kExpertsDownProj:
    case TensorRole::kSharedGateProj:
    case TensorRole::kSharedUpProj:
    case TensorRole::kSharedDownProj: return {true, 0.0f, inv_sqrt_fan_in};
    case TensorRole::kGdnConv: return {true, 0.0f, 0.5f};
    case TensorRole::kGdnALog: return {false, -1.5f, 0.5f};
    case TensorRole::kGdnDtBias: return {false, -1.0f, 1.0f};
    case TensorRole::kFinalNorm:
    case TensorRole::kInputNorm:
    case TensorRole::kPostAttentionNorm:
    case TensorRole::kGdnNorm:
    case TensorRole::kAttnQNorm:
    case TensorRole::kAttnKNorm: return {false, 0.9f, 1.1f};
  }
  throw InternalError("synth: no initialisation rule for tensor " + spec.name);
}

// ---------------------------------------------------------------------------------------------
// Presets.

struct Shape {
  int vocab, hidden, layers;
  int heads, kv_heads, head_dim;
  int gdn_key_heads, gdn_value_heads, gdn_key_dim, gdn_value_dim;
  int experts, top_k, moe_ffn, shared_ffn;
  int max_positions;
  bool real_extras;  ///< add the published config's informational fields (mtp, dtype, …)
};

ordered_json quantization_block(int layers) {
  ordered_json q;
  q["group_size"] = kQuantGroupSize;
  q["bits"] = 4;
  q["mode"] = "affine";
  const ordered_json eight = {{"group_size", kQuantGroupSize}, {"bits", 8}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = layer_prefix(i);
    for (std::string_view module : kEightBitModules) q[p + std::string(module)] = eight;
  }
  return q;
}

/// config.json in the MLX layout for `s`. eos: [im_end, endoftext] at the top level (the
/// published checkpoint's 248046/248044), endoftext in text_config; small presets put the
/// specials at the top of their vocabulary as the demo model does.
ordered_json make_config(const Shape& s) {
  const bool real = s.vocab == kQwen36Shape.vocab;
  const int endoftext = real ? 248044 : s.vocab - 5;
  const int im_end = real ? 248046 : s.vocab - 3;
  const int rotary_pairs = s.head_dim / 4 / 2;  // partial_rotary_factor 0.25, half-split pairs
  const int third = (rotary_pairs + 2) / 3;

  ordered_json t;
  t["vocab_size"] = s.vocab;
  t["hidden_size"] = s.hidden;
  t["num_hidden_layers"] = s.layers;
  t["num_attention_heads"] = s.heads;
  t["num_key_value_heads"] = s.kv_heads;
  t["hidden_act"] = "silu";
  t["max_position_embeddings"] = s.max_positions;
  t["initializer_range"] = 0.02;
  t["rms_norm_eps"] = 1e-6;
  t["use_cache"] = true;
  t["tie_word_embeddings"] = false;
  t["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", 10000000.0},
                          {"partial_rotary_factor", 0.25},
                          {"mrope_section", {third, third, rotary_pairs - 2 * third}},
                          {"mrope_interleaved", true}};
  t["attention_bias"] = false;
  t["attention_dropout"] = 0.0;
  t["attn_output_gate"] = true;
  t["head_dim"] = s.head_dim;
  t["linear_conv_kernel_dim"] = 4;
  t["linear_key_head_dim"] = s.gdn_key_dim;
  t["linear_value_head_dim"] = s.gdn_value_dim;
  t["linear_num_key_heads"] = s.gdn_key_heads;
  t["linear_num_value_heads"] = s.gdn_value_heads;
  t["moe_intermediate_size"] = s.moe_ffn;
  t["shared_expert_intermediate_size"] = s.shared_ffn;
  t["num_experts_per_tok"] = s.top_k;
  t["num_experts"] = s.experts;
  t["full_attention_interval"] = 4;
  ordered_json types = ordered_json::array();
  for (int i = 0; i < s.layers; ++i) types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  t["layer_types"] = types;
  t["bos_token_id"] = endoftext;
  t["eos_token_id"] = endoftext;
  t["partial_rotary_factor"] = 0.25;
  if (s.real_extras) {
    t["mamba_ssm_dtype"] = "float32";
    t["mtp_num_hidden_layers"] = 1;
    t["mtp_use_dedicated_embeddings"] = false;
    t["router_aux_loss_coef"] = 0.001;
    t["dtype"] = "bfloat16";
  }
  t["model_type"] = "qwen3_5_moe_text";

  ordered_json doc;
  doc["architectures"] = {"Qwen3_5MoeForConditionalGeneration"};
  doc["model_type"] = "qwen3_5_moe";
  doc["text_config"] = t;
  doc["tie_word_embeddings"] = false;
  doc["eos_token_id"] = {im_end, endoftext};
  doc["quantization"] = quantization_block(s.layers);
  doc["quantization_config"] = quantization_block(s.layers);
  return doc;
}

struct PresetDef {
  const char* name;
  const char* description;
  Shape shape;
  uint64_t default_shard_bytes;
};

const std::vector<PresetDef>& preset_defs() {
  static const std::vector<PresetDef> defs = {
      {"tiny", "H=128, 4 layers (3 GDN + 1 attention), head_dim 64, GDN 2/4 heads of 64, 8 experts top-2, vocab 1024",
       {1024, 128, 4, 4, 2, 64, 2, 4, 64, 64, 8, 2, 64, 64, 4096, false}, 0},
      {"realdims",
       "real head dims: H=512, 4 layers, head_dim 256 (4 q / 2 kv heads), GDN Dk=Dv=128 with 2/4 heads, "
       "32 experts top-8 (I=128), vocab 2048",
       {2048, 512, 4, 4, 2, 256, 2, 4, 128, 128, 32, 8, 128, 128, 8192, false}, 0},
      {"long", "for long prompts: H=128, 8 layers (2 attention), head_dim 64, 16 experts top-4, vocab 1024, 32K positions",
       {1024, 128, 8, 4, 2, 64, 2, 4, 64, 64, 16, 4, 64, 64, 32768, false}, 0},
      {"35b-a3b", "the exact Qwen3.6-35B-A3B shape (docs/model.md §1.1), about 19.5 GB in 5 GB shards",
       {kQwen36Shape.vocab, kQwen36Shape.hidden, kQwen36Shape.n_layers, kQwen36Shape.n_heads,
        kQwen36Shape.n_kv_heads, kQwen36Shape.head_dim, kQwen36Shape.gdn_n_key_heads,
        kQwen36Shape.gdn_n_value_heads, kQwen36Shape.gdn_key_head_dim, kQwen36Shape.gdn_value_head_dim,
        kQwen36Shape.n_experts, kQwen36Shape.n_experts_per_tok, kQwen36Shape.moe_ffn_dim,
        kQwen36Shape.shared_ffn_dim, static_cast<int>(kMaxContext), true},
       5'000'000'000ull},
  };
  return defs;
}

// ---------------------------------------------------------------------------------------------
// Tensor declarations and work items.

/// The stored tensors of the table: a quantized spec becomes .weight (U32) / .scales / .biases
/// (BF16); A_log (kFloat) is written as F32, every other plain tensor as BF16.
std::vector<TensorDecl> declare_tensors(const std::vector<TensorSpec>& table) {
  std::vector<TensorDecl> decls;
  for (const TensorSpec& spec : table) {
    switch (spec.kind) {
      case TensorKind::kQuantized: {
        const QuantizedNames names = quantized_names(spec.name);
        decls.push_back({names.weight, DType::kU32, packed_codes_shape(spec)});
        decls.push_back({names.scales, DType::kBF16, group_params_shape(spec)});
        decls.push_back({names.biases, DType::kBF16, group_params_shape(spec)});
        break;
      }
      case TensorKind::kBf16: decls.push_back({spec.name, DType::kBF16, spec.shape}); break;
      case TensorKind::kFloat: decls.push_back({spec.name, DType::kF32, spec.shape}); break;
    }
  }
  return decls;
}

/// One unit of generation: rows [row_begin, row_end) of a quantized tensor (chunk `chunk`), or a
/// whole plain tensor. Chunks depend on the shape only, never on the thread count.
struct WorkItem {
  size_t spec = 0;
  int64_t row_begin = 0, row_end = 0;
  uint64_t chunk = 0;
};

constexpr int64_t kChunkElements = int64_t(1) << 22;

std::vector<WorkItem> plan_work(const std::vector<TensorSpec>& table) {
  std::vector<WorkItem> items;
  for (size_t i = 0; i < table.size(); ++i) {
    const TensorSpec& spec = table[i];
    if (spec.kind != TensorKind::kQuantized) {
      items.push_back({i, 0, 1, 0});
      continue;
    }
    const int64_t cols = spec.shape.back();
    const int64_t rows = shape_numel(spec.shape) / cols;
    const int64_t per_chunk = std::max<int64_t>(1, kChunkElements / cols);
    uint64_t chunk = 0;
    for (int64_t r = 0; r < rows; r += per_chunk) items.push_back({i, r, std::min(rows, r + per_chunk), chunk++});
  }
  return items;
}

template <class T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

/// Generates and writes one work item; `codes`/`scales`/`biases`/`floats` are reusable buffers.
class ItemWriter {
 public:
  ItemWriter(const std::vector<TensorSpec>& table, uint64_t seed, CheckpointWriter& out)
      : table_(table), seed_(seed), out_(out) {}

  void run(const WorkItem& item) {
    const TensorSpec& spec = table_[item.spec];
    if (spec.kind == TensorKind::kQuantized) run_quantized(spec, item);
    else run_plain(spec);
  }

 private:
  void run_quantized(const TensorSpec& spec, const WorkItem& item) {
    const int64_t cols = spec.shape.back();
    const int64_t words = cols * spec.bits / 32, groups = cols / kQuantGroupSize, rows = item.row_end - item.row_begin;
    codes_.resize(static_cast<size_t>(rows * words));
    scales_.resize(static_cast<size_t>(rows * groups));
    biases_.resize(static_cast<size_t>(rows * groups));
    Rng rng(stream_key(seed_, spec.name, item.chunk));
    const Sampler sample(init_rule(spec));
    const int64_t words_per_group = kQuantGroupSize * spec.bits / 32;
    float w[kQuantGroupSize];
    for (int64_t g = 0; g < rows * groups; ++g) {
      for (float& x : w) x = sample(rng);
      quantize_group_affine(w, spec.bits, &codes_[g * words_per_group], &scales_[g], &biases_[g]);
    }
    const uint64_t r0 = static_cast<uint64_t>(item.row_begin);
    const QuantizedNames names = quantized_names(spec.name);
    CheckpointWriter::write(out_.target(names.weight), r0 * words * 4, as_bytes_of(codes_));
    CheckpointWriter::write(out_.target(names.scales), r0 * groups * 2, as_bytes_of(scales_));
    CheckpointWriter::write(out_.target(names.biases), r0 * groups * 2, as_bytes_of(biases_));
  }

  void run_plain(const TensorSpec& spec) {
    const int64_t n = shape_numel(spec.shape);
    Rng rng(stream_key(seed_, spec.name, 0));
    const Sampler sample(init_rule(spec));
    floats_.resize(static_cast<size_t>(n));
    for (float& x : floats_) x = sample(rng);
    const auto target = out_.target(spec.name);
    if (spec.kind == TensorKind::kFloat) {
      CheckpointWriter::write(target, 0, as_bytes_of(floats_));
      return;
    }
    scales_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) scales_[i] = float_to_bf16(floats_[i]);
    CheckpointWriter::write(target, 0, as_bytes_of(scales_));
  }

  const std::vector<TensorSpec>& table_;
  uint64_t seed_;
  CheckpointWriter& out_;
  std::vector<uint32_t> codes_;
  std::vector<uint16_t> scales_, biases_;
  std::vector<float> floats_;
};

/// Runs every item on `threads` threads (items taken in order from a shared counter); the
/// first exception stops the others and is rethrown.
void run_items(const std::vector<TensorSpec>& table, const std::vector<WorkItem>& items, uint64_t seed,
               CheckpointWriter& out, int threads) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    ItemWriter writer(table, seed, out);
    try {
      for (size_t i = next++; i < items.size() && !failed; i = next++) writer.run(items[i]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// ---------------------------------------------------------------------------------------------
// Files around the weights.

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw Error("cannot write " + path.string());
}

/// Removes weight files a previous run may have left (a stale index would shadow a new file).
void remove_old_weights(const std::filesystem::path& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool shard = name.starts_with("model-") && name.find("-of-") != std::string::npos &&
                       name.ends_with(".safetensors");
    if (shard || name == "model.safetensors" || name == "model.safetensors.index.json")
      std::filesystem::remove(entry.path());
  }
}

/// The stop-token ids a `--tokenizer` file names (-1: absent).
struct TokenizerStopIds {
  int64_t im_end = -1;     ///< id of <|im_end|>
  int64_t endoftext = -1;  ///< id of <|endoftext|>
};

/// Reads the tokenizer file and checks its ids against the preset's vocabulary. Writes nothing, so a
/// bad file is refused before the output directory is created or its old weights are removed.
TokenizerStopIds check_tokenizer(const std::filesystem::path& file, const ordered_json& config) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(file, ec)))
    throw Error("tokenizer file " + file.string() + ": no such file");
  std::string text;
  try {
    text = read_regular_file(file);  // a FIFO is refused instead of blocking in open(2)
  } catch (const Error& e) {
    throw Error(std::string("tokenizer file: ") + e.what());
  }
  nlohmann::json tok;
  try {
    tok = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error("tokenizer file " + file.string() + ": not valid JSON: " + e.what());
  }
  const int vocab = config["text_config"]["vocab_size"].get<int>();
  int64_t max_id = -1;
  int64_t im_end = -1, endoftext = -1;
  if (tok.contains("model") && tok["model"].contains("vocab") && tok["model"]["vocab"].is_object())
    for (const auto& [piece, id] : tok["model"]["vocab"].items())
      if (id.is_number_integer()) max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array())
    for (const auto& t : tok["added_tokens"]) {
      if (!t.contains("id") || !t["id"].is_number_integer()) continue;
      const int64_t id = t["id"].get<int64_t>();
      max_id = std::max(max_id, id);
      const std::string content = t.value("content", "");
      if (content == "<|im_end|>") im_end = id;
      if (content == "<|endoftext|>") endoftext = id;
    }
  if (max_id >= vocab)
    throw Error("tokenizer file " + file.string() + " has token id " + std::to_string(max_id) +
                ", outside this preset's vocabulary of " + std::to_string(vocab));
  return {im_end, endoftext};
}

/// Copies a checked `--tokenizer` (and the tokenizer_config.json / chat_template.jinja beside it,
/// if any) into `out`, and points the config's eos ids at its <|im_end|> / <|endoftext|> tokens
/// when it has them.
void install_tokenizer(const std::filesystem::path& file, const TokenizerStopIds& ids,
                       const std::filesystem::path& out, ordered_json& config) {
  const int64_t im_end = ids.im_end, endoftext = ids.endoftext;
  ordered_json eos = ordered_json::array();
  if (im_end >= 0) eos.push_back(im_end);
  if (endoftext >= 0) eos.push_back(endoftext);
  if (!eos.empty()) {
    config["eos_token_id"] = eos;
    config["text_config"]["eos_token_id"] = eos.back();
    config["text_config"]["bos_token_id"] = eos.back();
  }
  const auto dir = file.parent_path();
  auto copy = [&](const std::filesystem::path& from, const char* name) {
    std::error_code ec;
    if (std::filesystem::equivalent(from, out / name, ec)) return;
    std::filesystem::copy_file(from, out / name, std::filesystem::copy_options::overwrite_existing);
  };
  copy(file, "tokenizer.json");
  if (std::filesystem::is_regular_file(dir / "chat_template.jinja")) copy(dir / "chat_template.jinja", "chat_template.jinja");
  if (std::filesystem::is_regular_file(dir / "tokenizer_config.json")) {
    copy(dir / "tokenizer_config.json", "tokenizer_config.json");
    return;
  }
  ordered_json tc;
  tc["tokenizer_class"] = "Qwen2Tokenizer";
  if (im_end >= 0) tc["eos_token"] = "<|im_end|>";
  if (endoftext >= 0) tc["pad_token"] = "<|endoftext|>";
  tc["bos_token"] = nullptr;
  tc["add_bos_token"] = false;
  tc["model_max_length"] = config["text_config"]["max_position_embeddings"];
  write_text(out / "tokenizer_config.json", tc.dump(2) + "\n");
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void quantize_group_affine(const float* w, int bits, uint32_t* packed, uint16_t* scale_bf16, uint16_t* bias_bf16) {
  LILY_CHECK(bits == 4 || bits == 8);
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kQuantGroupSize; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  float scale = (hi - lo) / levels;
  if (scale == 0.0f) scale = 1e-8f;
  *scale_bf16 = float_to_bf16(scale);
  *bias_bf16 = float_to_bf16(lo);
  const float s = bf16_to_float(*scale_bf16), b = bf16_to_float(*bias_bf16);
  const int per_word = 32 / bits;
  for (int word = 0; word < kQuantGroupSize / per_word; ++word) {
    uint32_t packed_word = 0;
    for (int i = 0; i < per_word; ++i) {
      float t = (w[word * per_word + i] - b) / s;
      t = std::min(std::max(t, 0.0f), levels);
      // Round half to even without libm: adding 2^23 leaves no fraction bits (0 <= t <= 255).
      const float rounded = (t + 8388608.0f) - 8388608.0f;
      packed_word |= static_cast<uint32_t>(rounded) << (bits * i);
    }
    packed[word] = packed_word;
  }
}

std::vector<std::string> synth_preset_names() {
  std::vector<std::string> names;
  for (const auto& d : preset_defs()) names.push_back(d.name);
  return names;
}

SynthPreset synth_preset(std::string_view name) {
  for (const auto& d : preset_defs())
    if (name == d.name) return {d.name, d.description, make_config(d.shape), d.default_shard_bytes};
  std::string known;
  for (const auto& n : synth_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error("unknown synth preset '" + std::string(name) + "' (known: " + known + ")");
}

SynthResult write_synthetic_checkpoint(const SynthOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  SynthPreset preset = synth_preset(options.preset);
  if (options.out.empty()) throw Error("synth: no output directory given");
  std::error_code ec;
  if (std::filesystem::exists(options.out, ec) && !std::filesystem::is_directory(options.out, ec))
    throw Error("output directory " + options.out.string() + " exists and is not a directory");
  std::optional<TokenizerStopIds> tokenizer_ids;
  if (!options.tokenizer.empty()) tokenizer_ids = check_tokenizer(options.tokenizer, preset.config);
  std::filesystem::create_directories(options.out, ec);
  if (ec) throw Error("cannot create " + options.out.string() + ": " + ec.message());
  remove_old_weights(options.out);
  if (tokenizer_ids) install_tokenizer(options.tokenizer, *tokenizer_ids, options.out, preset.config);

  SynthResult result;
  result.config = parse_model_config(nlohmann::json::parse(preset.config.dump()), "synth preset " + preset.name);
  write_text(options.out / "config.json", preset.config.dump(2) + "\n");

  const std::vector<TensorSpec> table = tensor_table(result.config);
  const uint64_t shard_bytes = options.shard_mb < 0 ? preset.default_shard_bytes
                                                    : static_cast<uint64_t>(options.shard_mb * 1e6);
  CheckpointWriter out(options.out, declare_tensors(table), shard_bytes, {{"format", "mlx"}});
  const std::vector<WorkItem> items = plan_work(table);
  int threads = options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp<int>(threads, 1, static_cast<int>(std::max<size_t>(1, items.size())));
  run_items(table, items, options.seed, out, threads);
  out.finish();

  result.files = out.file_names();
  result.total_bytes = out.total_file_bytes();
  result.threads = threads;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace lily
