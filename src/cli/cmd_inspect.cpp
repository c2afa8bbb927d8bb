// `lily inspect DIR [--json]`: loads and validates a checkpoint (model/loader.h) and prints its
// summary: shape name, layers by type, experts, the tensors by role (one walk of the tensor
// description, model/tensor_table.h: storage, count, parameters, bytes), parameters, bytes on
// disk, skipped tensors. A checkpoint that fails validation exits 1 with the loader's one-line error;
// so does one whose tokenizer.json, tokenizer_config.json or chat template `lily serve` would
// refuse.
// Sizes are binary (KiB, MiB, GiB: powers of 1024).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "cli/commands.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "model/loader.h"
#include "model/tensor_table.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace lily::cli {
namespace {

/// The tensors of one role (model/tensor_table.h), as found in the validated checkpoint.
struct RoleSummary {
  TensorRole role;
  std::string storage;     ///< "q4", "q8", "BF16", "F32"; "BF16/F32" when its tensors differ
  int count = 0;           ///< tensors of this role
  int64_t parameters = 0;  ///< logical elements, summed
  uint64_t bytes = 0;      ///< bytes stored in the checkpoint (codes + scales + biases for q*)
  std::string first;       ///< name of its first tensor in table order, e.g. "…layers.0.mlp.gate"
};

/// One summary per role, in the order the one tensor description (for_each_tensor over the
/// loaded weights) first meets each role. Quantized storage is the loaded matrix's bit width,
/// plain storage the checkpoint's dtype.
std::vector<RoleSummary> summarize_roles(const ModelWeights& w) {
  std::vector<RoleSummary> roles;
  for_each_tensor(w, [&](const TensorSpec& spec, ConstTensorDest dest) {
    std::string storage;
    uint64_t bytes = 0;
    if (const auto* q = std::get_if<const QuantMatrix*>(&dest)) {
      storage = "q" + std::to_string((*q)->bits);
      const QuantizedNames names = quantized_names(spec.name);
      for (const std::string* part : {&names.weight, &names.scales, &names.biases})
        bytes += w.storage->get(*part).nbytes;
    } else {
      const TensorInfo& info = w.storage->get(spec.name);
      storage = dtype_name(info.dtype);
      bytes = info.nbytes;
    }
    auto it = std::find_if(roles.begin(), roles.end(), [&](const RoleSummary& r) { return r.role == spec.role; });
    if (it == roles.end()) it = roles.insert(roles.end(), RoleSummary{spec.role, storage, 0, 0, 0, spec.name});
    if (it->storage != storage && it->storage.find(storage) == std::string::npos) it->storage += "/" + storage;
    ++it->count;
    it->parameters += shape_numel(spec.shape);
    it->bytes += bytes;
  });
  return roles;
}

/// The whole summary as JSON (what --json prints and print_text formats).
nlohmann::json summary_json(const std::string& dir, const ModelWeights& w, const Tokenizer& tok) {
  const ModelConfig& c = w.config;
  nlohmann::json roles = nlohmann::json::array();
  for (const RoleSummary& r : summarize_roles(w))
    roles.push_back({{"role", role_name(r.role)},
                     {"storage", r.storage},
                     {"count", r.count},
                     {"parameters", r.parameters},
                     {"bytes", r.bytes},
                     {"first", r.first}});
  return {
      {"path", dir},
      {"shape_name", c.shape_name()},
      {"is_qwen36_35b_a3b", c.is_qwen36_35b_a3b()},
      {"hidden", c.hidden},
      {"vocab", c.vocab},
      {"layers",
       {{"total", c.n_layers},
        {"linear_attention", c.n_linear_attention_layers()},
        {"full_attention", c.n_full_attention_layers()},
        {"full_attention_interval", c.full_attention_interval}}},
      {"attention",
       {{"heads", c.n_heads}, {"kv_heads", c.n_kv_heads}, {"head_dim", c.head_dim},
        {"rotary_dim", c.rotary_dim}, {"rope_theta", c.rope_theta}}},
      {"gdn",
       {{"key_heads", c.gdn_n_key_heads}, {"value_heads", c.gdn_n_value_heads},
        {"key_head_dim", c.gdn_key_head_dim}, {"value_head_dim", c.gdn_value_head_dim},
        {"conv_kernel", c.gdn_conv_kernel}}},
      {"experts",
       {{"count", c.n_experts}, {"top_k", c.n_experts_per_tok}, {"moe_ffn_dim", c.moe_ffn_dim},
        {"shared_ffn_dim", c.shared_ffn_dim}}},
      {"quantization", {{"mode", "affine"}, {"bits", c.quantization.bits}, {"group_size", c.quantization.group_size}}},
      {"tensor_roles", roles},
      {"parameters", c.parameter_count()},
      {"max_position_embeddings", c.max_position_embeddings},
      {"eos_token_ids", c.eos_token_ids},
      {"files", w.storage->files().size()},
      {"tensors", w.storage->tensor_count()},
      {"bytes_on_disk", w.storage->bytes_on_disk()},
      {"skipped_tensors", w.skipped_tensors},
      {"tokenizer_vocab", tok.vocab_size()},
  };
}

/// `v` scaled by `base` into the largest unit of `units` it reaches, e.g. "1.50 MiB".
std::string human(double v, const char* const units[], int n_units, double base) {
  int u = 0;
  while (v >= base && u + 1 < n_units) v /= base, ++u;
  char buf[48];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f%s", v, units[u]);
  return buf;
}

/// The summary as aligned text, one topic a line.
void print_text(const nlohmann::json& j) {
  static const char* const kCount[] = {"", "K", "M", "B"};
  static const char* const kBytes[] = {" B", "KiB", "MiB", "GiB", "TiB"};  // base 1024
  const auto& layers = j["layers"];
  const auto& attention = j["attention"];
  const auto& gdn = j["gdn"];
  const auto& experts = j["experts"];
  std::printf("checkpoint   %s\n", j["path"].get<std::string>().c_str());
  std::printf("shape        %s\n", j["shape_name"].get<std::string>().c_str());
  std::printf("layers       %d: %d Gated DeltaNet (linear attention) + %d gated full attention (every %d)\n",
              layers["total"].get<int>(), layers["linear_attention"].get<int>(), layers["full_attention"].get<int>(),
              layers["full_attention_interval"].get<int>());
  std::printf("hidden       %d, vocab %d, context %d\n", j["hidden"].get<int>(), j["vocab"].get<int>(),
              j["max_position_embeddings"].get<int>());
  std::printf("attention    %d query heads, %d kv heads, head_dim %d, rotary %d, theta %g\n",
              attention["heads"].get<int>(), attention["kv_heads"].get<int>(), attention["head_dim"].get<int>(),
              attention["rotary_dim"].get<int>(), attention["rope_theta"].get<double>());
  std::printf("gdn          %d key heads, %d value heads, Dk %d, Dv %d, conv %d\n", gdn["key_heads"].get<int>(),
              gdn["value_heads"].get<int>(), gdn["key_head_dim"].get<int>(), gdn["value_head_dim"].get<int>(),
              gdn["conv_kernel"].get<int>());
  std::printf("experts      %d routed, top-%d, expert I %d, + 1 shared expert (I %d)\n", experts["count"].get<int>(),
              experts["top_k"].get<int>(), experts["moe_ffn_dim"].get<int>(), experts["shared_ffn_dim"].get<int>());
  std::printf("quantization MLX affine, group size %d (q4 = 4-bit, q8 = 8-bit)\n",
              j["quantization"]["group_size"].get<int>());
  std::printf("tensors      by role: storage, count, parameters, bytes on disk, first tensor\n");
  for (const auto& r : j["tensor_roles"])
    std::printf("  %-20s %-8s x%-4d %9s %11s  %s\n", r["role"].get<std::string>().c_str(),
                r["storage"].get<std::string>().c_str(), r["count"].get<int>(),
                human(r["parameters"].get<double>(), kCount, 4, 1000).c_str(),
                human(r["bytes"].get<double>(), kBytes, 5, 1024).c_str(), r["first"].get<std::string>().c_str());
  std::printf("parameters   %s\n", human(j["parameters"].get<double>(), kCount, 4, 1000).c_str());
  std::printf("on disk      %s in %zu file(s), %zu tensors\n",
              human(j["bytes_on_disk"].get<double>(), kBytes, 5, 1024).c_str(), j["files"].get<size_t>(),
              j["tensors"].get<size_t>());
  std::printf("skipped      %lld tensors (vision_tower.*, mtp.*)\n", j["skipped_tensors"].get<long long>());
  std::string eos;
  for (const auto& id : j["eos_token_ids"]) eos += (eos.empty() ? "" : ", ") + std::to_string(id.get<int>());
  std::printf("eos ids      %s\n", eos.c_str());
  std::printf("tokenizer    %d ids\n", j["tokenizer_vocab"].get<int>());
}

}  // namespace

void register_inspect(CLI::App& app, int& exit_code) {
  auto dir = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("inspect", "Validate a checkpoint directory and print its summary");
  cmd->add_option("dir", *dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_flag("--json", *as_json, "Print the summary as one JSON object");
  cmd->callback([dir, as_json, &exit_code] {
    LoadOptions options;
    options.show_progress = true;
    auto weights = load_model(*dir, options);
    // The same checks `lily serve` makes before it serves: tokenizer.json must load,
    // tokenizer_config.json (when present) must be a JSON object, and the chat template must parse.
    auto tokenizer = Tokenizer::from_file(std::filesystem::path(*dir) / "tokenizer.json");
    check_tokenizer_vocab(weights->config, *tokenizer);
    ChatTemplate::for_model(*dir);
    stop_token_ids(weights->config, *dir, tokenizer.get());
    const auto summary = summary_json(*dir, *weights, *tokenizer);
    if (*as_json) std::printf("%s\n", summary.dump().c_str());
    else print_text(summary);
    exit_code = 0;
  });
}

}  // namespace lily::cli
