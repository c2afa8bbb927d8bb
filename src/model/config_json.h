// parse_model_config: a config.json document already parsed by nlohmann/json -> ModelConfig.
// Apart from config.h so that the hyper-parameters, which the kernels' headers include, do not
// bring nlohmann/json into every translation unit; only code that holds a JSON document (the
// config parser, lily synth, their tests) includes this.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace lily {

/// Parses and validates a config.json document (a `qwen3_5_moe` wrapper with `text_config`,
/// or a text-only `qwen3_5_moe_text` config). `source` names the file in error messages.
/// Throws CheckpointError with one line saying what was found (other model_type, other
/// quantization method, missing/inconsistent fields, group size ≠ 64, …).
ModelConfig parse_model_config(const nlohmann::json& doc, const std::string& source);

}  // namespace lily
