// `lily synth --preset tiny|realdims|long|35b-a3b --seed N --out DIR [--tokenizer FILE]
// [--shard-mb N] [--threads N]`: writes a random-weight checkpoint in the MLX layout
// (model/synth.h) and prints one summary line.
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "base/error.h"
#include "cli/commands.h"
#include "engine/backend.h"
#include "model/synth.h"

namespace lily::cli {

void register_synth(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<SynthOptions>();
  auto* cmd = app.add_subcommand("synth", "Write a random-weight qwen3_5_moe checkpoint in the MLX 4-bit layout");
  std::string presets;
  for (const auto& name : synth_preset_names()) presets += (presets.empty() ? "" : "|") + name;
  cmd->add_option("--preset", options->preset, "Shape: " + presets)->capture_default_str();
  cmd->add_option("--seed", options->seed, "Random seed (the output is a pure function of preset and seed)")
      ->capture_default_str()->check(unsigned_integer());
  cmd->add_option("--out", options->out, "Output directory (created if missing)")->required();
  cmd->add_option("--tokenizer", options->tokenizer,
                  "tokenizer.json to copy into the checkpoint (its ids must fit the preset's vocabulary)");
  cmd->add_option("--shard-mb", options->shard_mb,
                  "Maximum shard size in MB (10^6 bytes); 0 = one model.safetensors; default: the preset's")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double mb = 0;
            try {
              size_t used = 0;
              mb = std::stod(text, &used);
              if (used != text.size()) mb = -1;
            } catch (const std::exception&) {
              mb = -1;
            }
            if (!(mb == 0 || (mb >= 1 && mb <= 1e9))) return "must be 0 (one file) or from 1 to 1e9 MB, got '" + text + "'";
            return {};
          },
          "MB"));
  cmd->add_option("--threads", options->threads,
                  "Generation threads (default: all cores; at most " + std::to_string(kMaxCpuThreads) + ")")
      ->check(integer_in_range(0, kMaxCpuThreads));
  cmd->callback([options, &exit_code] {
    const SynthResult r = write_synthetic_checkpoint(*options);
    std::printf("wrote %s: %s, seed %llu, %zu file(s), %.3f GB in %.1f s (%d threads)\n",
                options->out.string().c_str(), r.config.shape_name().c_str(),
                static_cast<unsigned long long>(options->seed), r.files.size(), r.total_bytes / 1e9, r.seconds,
                r.threads);
    exit_code = 0;
  });
}

}  // namespace lily::cli
