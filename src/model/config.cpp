// config.json parsing and family-strict validation (docs/model.md §1.1–1.2).
#include "model/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <fstream>
#include <sstream>

#include "base/error.h"
#include "base/file_util.h"
#include "model/config_json.h"
#include "model/tensor_table.h"

namespace lily {
namespace {

using nlohmann::json;

/// Context for error messages: "<source>: <what>".
struct Ctx {
  const std::string& source;
  [[noreturn]] void fail(const std::string& what) const { throw CheckpointError(source + ": " + what); }
};

const json* find_field(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

int require_int(const Ctx& ctx, const json& obj, const char* key) {
  const json* v = find_field(obj, key);
  if (!v) ctx.fail(std::string("config field ") + key + " is missing");
  if (!v->is_number_integer()) ctx.fail(std::string("config field ") + key + " must be an integer, got " + v->dump());
  int64_t x = v->get<int64_t>();
  if (x <= 0 || x > (int64_t(1) << 30)) ctx.fail(std::string("config field ") + key + " = " + std::to_string(x) + " is out of range");
  return static_cast<int>(x);
}

int optional_int(const Ctx& ctx, const json& obj, const char* key, int fallback) {
  return find_field(obj, key) ? require_int(ctx, obj, key) : fallback;
}

double require_number(const Ctx& ctx, const json& obj, const char* key) {
  const json* v = find_field(obj, key);
  if (!v) ctx.fail(std::string("config field ") + key + " is missing");
  if (!v->is_number()) ctx.fail(std::string("config field ") + key + " must be a number, got " + v->dump());
  return v->get<double>();
}

bool require_bool(const Ctx& ctx, const json& obj, const char* key) {
  const json* v = find_field(obj, key);
  if (!v) ctx.fail(std::string("config field ") + key + " is missing");
  if (!v->is_boolean()) ctx.fail(std::string("config field ") + key + " must be true or false, got " + v->dump());
  return v->get<bool>();
}

std::vector<int32_t> parse_eos(const Ctx& ctx, const json& v) {
  std::vector<int32_t> ids;
  auto add = [&](const json& x) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
      ctx.fail("eos_token_id must be a token id or a list of them, got " + v.dump());
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
  };
  if (v.is_array()) for (const auto& x : v) add(x);
  else add(v);
  if (ids.empty()) ctx.fail("eos_token_id is an empty list");
  return ids;
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

/// model_type check: returns the object holding the text-model fields.
const json& select_text_config(const Ctx& ctx, const json& doc) {
  const json* mt = find_field(doc, "model_type");
  if (!mt || !mt->is_string()) ctx.fail("config has no model_type; expected qwen3_5_moe");
  const std::string type = mt->get<std::string>();
  if (type == "qwen3_5_moe") {
    const json* text = find_field(doc, "text_config");
    if (!text || !text->is_object()) ctx.fail("model_type qwen3_5_moe but no text_config object");
    if (const json* inner = find_field(*text, "model_type"))
      if (!inner->is_string() || inner->get<std::string>() != "qwen3_5_moe_text")
        ctx.fail("text_config.model_type is " + inner->dump() + "; expected qwen3_5_moe_text");
    return *text;
  }
  if (type == "qwen3_5_moe_text") return doc;
  std::string what = "model_type " + type + " is not supported";
  if (type == "qwen3_moe") what += " (Qwen3 MoE without Gated DeltaNet)";
  else if (type == "qwen3_next") what += " (Qwen3-Next)";
  else if (type == "qwen3_5" || type == "qwen3_5_text") what += " (dense Qwen3.5, no experts)";
  ctx.fail(what + "; lily supports only the qwen3_5_moe family (Qwen3.6-35B-A3B)");
}

/// quantization_config with a quant_method (AWQ, GPTQ, FP8, bitsandbytes, …) is foreign.
void reject_foreign_quantization(const Ctx& ctx, const json& doc, const json& text) {
  for (const json* obj : {&doc, &text}) {
    const json* qc = find_field(*obj, "quantization_config");
    if (!qc || !qc->is_object()) continue;
    const json* method = find_field(*qc, "quant_method");
    if (!method) continue;
    std::string name = method->is_string() ? method->get<std::string>() : method->dump();
    ctx.fail(upper(name) + " checkpoint is not supported (quantization_config.quant_method = " + name +
             "); lily needs " + supported_checkpoint_kind());
  }
}

QuantizationConfig parse_quantization(const Ctx& ctx, const json& doc) {
  const json* q = find_field(doc, "quantization");
  if (!q)
    ctx.fail("unquantized checkpoint (config.json has no MLX quantization block); lily needs " +
             supported_checkpoint_kind());
  if (!q->is_object()) ctx.fail("quantization must be an object, got " + q->dump());
  QuantizationConfig out;
  if (const json* mode = find_field(*q, "mode"))
    if (!mode->is_string() || mode->get<std::string>() != "affine")
      ctx.fail("quantization mode " + mode->dump() + " is not supported; expected affine (MLX 4-bit)");
  const json* bits = find_field(*q, "bits");
  const json* group = find_field(*q, "group_size");
  if (!bits || !bits->is_number_integer()) ctx.fail("quantization.bits is missing or not an integer");
  if (!group || !group->is_number_integer()) ctx.fail("quantization.group_size is missing or not an integer");
  if (bits->get<int64_t>() == 8)
    ctx.fail("8-bit checkpoint (quantization.bits = 8 everywhere) is not supported; lily needs MLX affine 4-bit");
  if (bits->get<int64_t>() != 4)
    ctx.fail("quantization.bits = " + bits->dump() + " is not supported; lily needs MLX affine 4-bit");
  if (group->get<int64_t>() != kQuantGroupSize)
    ctx.fail("quantization group size " + group->dump() + " is not supported; expected " +
             std::to_string(kQuantGroupSize));
  for (const auto& [key, value] : q->items()) {
    if (key == "mode" || key == "bits" || key == "group_size") continue;
    if (!value.is_object())
      ctx.fail("unexpected quantization field " + key + " = " + value.dump());
    if (!is_eight_bit_module(key))
      ctx.fail("quantization override for " + key + " is not supported; only mlp.gate and "
               "mlp.shared_expert_gate may be overridden (to 8 bits)");
    const json* b = find_field(value, "bits");
    const json* g = find_field(value, "group_size");
    if (!b || !g || *b != 8 || *g != kQuantGroupSize || value.size() != 2)
      ctx.fail("quantization override for " + key + " is " + value.dump() +
               "; expected {\"group_size\": " + std::to_string(kQuantGroupSize) + ", \"bits\": 8}");
    out.eight_bit_modules.push_back(key);
  }
  return out;
}

std::vector<LayerType> parse_layer_types(const Ctx& ctx, const json& text, int n_layers, int interval) {
  const json* lt = find_field(text, "layer_types");
  if (!lt || !lt->is_array()) ctx.fail("config field layer_types is missing");
  if (static_cast<int>(lt->size()) != n_layers)
    ctx.fail("layer_types has " + std::to_string(lt->size()) + " entries for " + std::to_string(n_layers) + " layers");
  std::vector<LayerType> types;
  for (int i = 0; i < n_layers; ++i) {
    const json& v = (*lt)[i];
    std::string s = v.is_string() ? v.get<std::string>() : v.dump();
    LayerType t;
    if (s == "linear_attention") t = LayerType::kLinearAttention;
    else if (s == "full_attention") t = LayerType::kFullAttention;
    else ctx.fail("layer_types[" + std::to_string(i) + "] = " + s + "; expected linear_attention or full_attention");
    bool want_full = i % interval == interval - 1;
    if ((t == LayerType::kFullAttention) != want_full)
      ctx.fail("layer_types[" + std::to_string(i) + "] = " + s + " is inconsistent with full_attention_interval " +
               std::to_string(interval) + " (layer i is full attention iff i % " + std::to_string(interval) +
               " == " + std::to_string(interval - 1) + ")");
    types.push_back(t);
  }
  return types;
}

/// rope_theta and rotary_dim from rope_parameters, falling back to the flat fields.
void parse_rope(const Ctx& ctx, const json& text, ModelConfig& c) {
  const json* rp = find_field(text, "rope_parameters");
  auto pick = [&](const char* key) -> double {
    if (rp && rp->is_object() && find_field(*rp, key)) return require_number(ctx, *rp, key);
    if (find_field(text, key)) return require_number(ctx, text, key);
    ctx.fail(std::string("config field rope_parameters.") + key + " is missing");
  };
  c.rope_theta = pick("rope_theta");
  double factor = pick("partial_rotary_factor");
  // The inverse frequencies theta^(−2i/rotary_dim) are computed in fp32: below 1 they grow
  // without bound (a theta under fp32's smallest normal is 0 there, and every angle NaN).
  if (!(c.rope_theta >= 1 && c.rope_theta <= std::numeric_limits<float>::max()))
    ctx.fail("rope_theta must be in [1, 3.4e38] (got " + json(c.rope_theta).dump() + ")");
  if (!(factor > 0 && factor <= 1)) ctx.fail("partial_rotary_factor must be in (0, 1]");
  c.rotary_dim = static_cast<int>(std::trunc(c.head_dim * factor));
  if (c.rotary_dim < 2 || c.rotary_dim % 2 != 0)
    ctx.fail("rotary dim " + std::to_string(c.rotary_dim) + " (head_dim × partial_rotary_factor) must be even and ≥ 2");
}

void check_flags(const Ctx& ctx, const json& doc, const json& text, ModelConfig& c) {
  // Absent in transformers' own configs (the gate is part of the architecture): default true.
  if (find_field(text, "attn_output_gate") && !require_bool(ctx, text, "attn_output_gate"))
    ctx.fail("attn_output_gate must be true (the qwen3_5_moe attention has an output gate)");
  if (require_bool(ctx, text, "tie_word_embeddings"))
    ctx.fail("tie_word_embeddings must be false (qwen3_5_moe has a separate lm_head)");
  if (const json* top = find_field(doc, "tie_word_embeddings"); top && *top != false)
    ctx.fail("tie_word_embeddings must be false (qwen3_5_moe has a separate lm_head)");
  if (find_field(text, "norm_topk_prob")) c.norm_topk_prob = require_bool(ctx, text, "norm_topk_prob");
  if (!c.norm_topk_prob) ctx.fail("norm_topk_prob must be true");
  if (const json* act = find_field(text, "hidden_act"))
    if (*act != "silu") ctx.fail("hidden_act " + act->dump() + " is not supported; expected silu");
}

constexpr int kMaxLayers = 1024;  ///< num_hidden_layers accepted (see parse_model_config)

/// Dimensions must be self-consistent for the forward pass and the 64-wide quantization groups.
void check_dims(const Ctx& ctx, const ModelConfig& c) {
  auto need = [&](bool ok, const std::string& what) { if (!ok) ctx.fail(what); };
  auto multiple_of_group = [&](int64_t v, const std::string& what) {
    need(v % kQuantGroupSize == 0, what + " = " + std::to_string(v) +
                                       " is not a multiple of the quantization group size " +
                                       std::to_string(kQuantGroupSize));
  };
  // Products of two fields (each ≤ 2^30) must fit the int-typed derived sizes, conv channels
  // 2·key_dim + value_dim included (found by tests/fuzz/fuzz_config: signed overflow).
  auto fits = [&](int64_t v, const std::string& what) {
    need(v <= (int64_t(1) << 28), what + " = " + std::to_string(v) + " is out of range");
  };
  fits(int64_t(c.n_heads) * c.head_dim, "num_attention_heads × head_dim");
  fits(int64_t(c.gdn_n_key_heads) * c.gdn_key_head_dim, "linear_num_key_heads × linear_key_head_dim");
  fits(int64_t(c.gdn_n_value_heads) * c.gdn_value_head_dim, "linear_num_value_heads × linear_value_head_dim");
  need(c.n_heads % c.n_kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads");
  need(c.gdn_n_value_heads % c.gdn_n_key_heads == 0,
       "linear_num_value_heads must be a multiple of linear_num_key_heads");
  need(c.n_experts_per_tok <= c.n_experts, "num_experts_per_tok exceeds num_experts");
  multiple_of_group(c.hidden, "hidden_size");
  multiple_of_group(c.moe_ffn_dim, "moe_intermediate_size");
  multiple_of_group(c.shared_ffn_dim, "shared_expert_intermediate_size");
  multiple_of_group(int64_t(c.n_heads) * c.head_dim, "num_attention_heads × head_dim");
  multiple_of_group(c.gdn_value_dim(), "linear_num_value_heads × linear_value_head_dim");
  need(!c.eos_token_ids.empty() && std::all_of(c.eos_token_ids.begin(), c.eos_token_ids.end(),
                                               [&](int32_t id) { return id < c.vocab; }),
       "eos_token_id is outside the vocabulary");
}

}  // namespace

ModelConfig parse_model_config(const json& doc, const std::string& source) {
  const Ctx ctx{source};
  if (!doc.is_object()) ctx.fail("config is not a JSON object");
  const json& text = select_text_config(ctx, doc);
  reject_foreign_quantization(ctx, doc, text);
  ModelConfig c;
  c.quantization = parse_quantization(ctx, doc);
  c.vocab = require_int(ctx, text, "vocab_size");
  c.hidden = require_int(ctx, text, "hidden_size");
  c.n_layers = require_int(ctx, text, "num_hidden_layers");
  // The loader lists every layer's tensors before it reads the checkpoint (hundreds of bytes a
  // layer): a million layers took 6 GB before "missing tensor" could be said. Models of this
  // family have 24 to 64.
  if (c.n_layers > kMaxLayers)
    ctx.fail("num_hidden_layers = " + std::to_string(c.n_layers) + " is more than " + std::to_string(kMaxLayers));
  c.full_attention_interval = optional_int(ctx, text, "full_attention_interval", 4);
  c.layer_types = parse_layer_types(ctx, text, c.n_layers, c.full_attention_interval);
  c.n_heads = require_int(ctx, text, "num_attention_heads");
  c.n_kv_heads = require_int(ctx, text, "num_key_value_heads");
  c.head_dim = require_int(ctx, text, "head_dim");
  c.gdn_n_key_heads = require_int(ctx, text, "linear_num_key_heads");
  c.gdn_n_value_heads = require_int(ctx, text, "linear_num_value_heads");
  c.gdn_key_head_dim = require_int(ctx, text, "linear_key_head_dim");
  c.gdn_value_head_dim = require_int(ctx, text, "linear_value_head_dim");
  c.gdn_conv_kernel = require_int(ctx, text, "linear_conv_kernel_dim");
  c.n_experts = require_int(ctx, text, "num_experts");
  c.n_experts_per_tok = require_int(ctx, text, "num_experts_per_tok");
  c.moe_ffn_dim = require_int(ctx, text, "moe_intermediate_size");
  c.shared_ffn_dim = require_int(ctx, text, "shared_expert_intermediate_size");
  double eps = require_number(ctx, text, "rms_norm_eps");
  if (!(eps > 0 && eps < 1)) ctx.fail("rms_norm_eps must be in (0, 1)");
  c.rms_norm_eps = static_cast<float>(eps);
  if (find_field(text, "max_position_embeddings")) {
    c.max_position_embeddings = require_int(ctx, text, "max_position_embeddings");
    // Blamed on the checkpoint here: later a value of 1 surfaced as "--max-seq must be at
    // least 2" although no --max-seq was given.
    if (c.max_position_embeddings < 2)
      ctx.fail("config field max_position_embeddings = " + std::to_string(c.max_position_embeddings) +
               " is too small: a sequence needs at least 2 positions (a prompt token and one generated token)");
  }
  parse_rope(ctx, text, c);
  check_flags(ctx, doc, text, c);
  const json* eos = find_field(doc, "eos_token_id");  // top level replaces text_config's
  if (!eos) eos = find_field(text, "eos_token_id");
  if (!eos) ctx.fail("config field eos_token_id is missing");
  c.eos_token_ids = parse_eos(ctx, *eos);
  check_dims(ctx, c);
  return c;
}

ModelConfig load_model_config(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw CheckpointError(dir.string() + ": not a checkpoint directory");
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec)))
    throw CheckpointError(path.string() + ": cannot open (no config.json in the checkpoint directory)");
  std::string text;
  try {
    text = read_regular_file(path);  // a FIFO is refused here instead of blocking in open(2)
  } catch (const Error& e) {
    throw CheckpointError(e.what());
  }
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw CheckpointError(path.string() + ": not valid JSON: " + e.what());
  }
  return parse_model_config(doc, path.string());
}

int ModelConfig::n_full_attention_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::kFullAttention));
}

int ModelConfig::n_linear_attention_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::kLinearAttention));
}

bool ModelConfig::is_qwen36_35b_a3b() const {
  const Qwen36Shape& q = kQwen36Shape;
  return hidden == q.hidden && n_layers == q.n_layers && full_attention_interval == q.full_attention_interval &&
         vocab == q.vocab && n_heads == q.n_heads && n_kv_heads == q.n_kv_heads && head_dim == q.head_dim &&
         gdn_n_key_heads == q.gdn_n_key_heads && gdn_n_value_heads == q.gdn_n_value_heads &&
         gdn_key_head_dim == q.gdn_key_head_dim && gdn_value_head_dim == q.gdn_value_head_dim &&
         gdn_conv_kernel == q.gdn_conv_kernel && n_experts == q.n_experts &&
         n_experts_per_tok == q.n_experts_per_tok && moe_ffn_dim == q.moe_ffn_dim &&
         shared_ffn_dim == q.shared_ffn_dim;
}

std::string supported_checkpoint_kind() {
  return "an MLX affine 4-bit, group-size-" + std::to_string(kQuantGroupSize) + " checkpoint";
}

std::string ModelConfig::shape_name() const {
  if (is_qwen36_35b_a3b()) return Qwen36Shape::kName;
  return "qwen3_5_moe (H=" + std::to_string(hidden) + ", L=" + std::to_string(n_layers) +
         ", E=" + std::to_string(n_experts) + ")";
}

int64_t ModelConfig::parameter_count() const {
  int64_t total = 0;
  for (const auto& spec : tensor_table(*this)) total += shape_numel(spec.shape);
  return total;
}

}  // namespace lily
