// libFuzzer target: the config.json validator (src/model/config.h) and the tensor table it
// implies (src/model/tensor_table.h) on arbitrary JSON text. Allowed: lily::Error from
// parse_model_config. For every accepted config, the derived sizes, the tensor table and its
// byte accounting must be computable without overflow or exception (UBSan checks the integer
// arithmetic), and the table must be consistent with the config.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "fuzz_support.h"
#include "model/config.h"
#include "model/config_json.h"
#include "model/tensor_table.h"

namespace {

void check_accepted(const lily::ModelConfig& c) {
  FUZZ_ASSERT(c.vocab > 0 && c.hidden > 0 && c.n_layers > 0, "");
  FUZZ_ASSERT(static_cast<int>(c.layer_types.size()) == c.n_layers, "");
  FUZZ_ASSERT(c.n_experts_per_tok >= 1 && c.n_experts_per_tok <= c.n_experts, "");
  FUZZ_ASSERT(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0, "");
  FUZZ_ASSERT(c.gdn_n_key_heads > 0 && c.gdn_n_value_heads % c.gdn_n_key_heads == 0, "");
  (void)c.gdn_conv_channels();
  (void)c.n_full_attention_layers();
  (void)c.n_linear_attention_layers();
  (void)c.is_qwen36_35b_a3b();
  FUZZ_ASSERT(!c.shape_name().empty(), "");
  FUZZ_ASSERT(c.parameter_count() > 0, "");
  const auto table = lily::tensor_table(c);
  FUZZ_ASSERT(!table.empty(), "");
  int64_t total = 0;
  for (const lily::TensorSpec& spec : table) {
    FUZZ_ASSERT(spec.layer >= -1 && spec.layer < c.n_layers, spec.name);
    for (int64_t d : spec.shape) FUZZ_ASSERT(d > 0, spec.name);
    if (spec.kind == lily::TensorKind::kQuantized) {
      FUZZ_ASSERT(spec.bits == 4 || spec.bits == 8, spec.name);
      (void)lily::packed_codes_shape(spec);
      (void)lily::group_params_shape(spec, c.quantization.group_size);
    }
    const int64_t bytes = lily::stored_bytes(spec, c.quantization.group_size);
    FUZZ_ASSERT(bytes > 0, spec.name);
    FUZZ_ASSERT(total <= INT64_MAX - bytes, "total checkpoint bytes overflow int64");
    total += bytes;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json doc =
      nlohmann::json::parse(data, data + size, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return 0;  // not JSON: the file reader reports that, not the validator
  try {
    const lily::ModelConfig config = lily::parse_model_config(doc, "config.json");
    check_accepted(config);
  } catch (const lily::Error&) {
    // Rejected with a message.
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
