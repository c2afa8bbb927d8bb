// Encoding speed of lily's tokenizer on ~1 MiB of mixed text with the real Qwen3 tokenizer
// (tests/node/.cache/qwen3-tokenizer.json, from tests/node/fetch-qwen3-tokenizer.sh). The text
// is built exactly as bench/tokenizer_bench.mjs builds it for the Hugging Face binding:
// rounds "round R\n" + the corpus texts (except the two long-run items) of tests/fixtures/tokenizer_corpus.jsonl joined by
// "\n" + "\n", until at least 1 MiB. Results: docs/performance/tokenizer.md.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

namespace {

std::string source_dir() {
  const char* env = std::getenv("LILY_SOURCE_DIR");
  return env ? env : LILY_SOURCE_DIR;
}

// Items made of one very long run (thousands of spaces or one repeated letter) are left out:
// they measure the worst case of the split regex and BPE, not typical text.
bool is_pathological(const std::string& name) { return name == "long_space_run" || name == "repeated_chars"; }

const std::string& bench_text() {
  static const std::string text = [] {
    std::ifstream in(source_dir() + "/tests/fixtures/tokenizer_corpus.jsonl");
    std::string joined, line;
    bool first = true;
    while (std::getline(in, line)) {
      auto item = nlohmann::json::parse(line);
      if (!item.contains("text") || is_pathological(item["name"].get<std::string>())) continue;
      joined += (first ? "" : "\n") + item["text"].get<std::string>();
      first = false;
    }
    std::string out;
    for (int round = 0; out.size() < (1u << 20); ++round) out += "round " + std::to_string(round) + "\n" + joined + "\n";
    return out;
  }();
  return text;
}

std::shared_ptr<const lily::Tokenizer> qwen3() {
  static auto tok = lily::Tokenizer::from_file(source_dir() + "/tests/node/.cache/qwen3-tokenizer.json");
  return tok;
}

void BM_EncodeQwen3(benchmark::State& state) {
  auto tok = qwen3();
  const std::string& text = bench_text();
  bool allow_special = state.range(0) != 0;
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = tok->encode(text, allow_special);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["bytes"] = static_cast<double>(text.size());
}
BENCHMARK(BM_EncodeQwen3)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_DecodeQwen3(benchmark::State& state) {
  auto tok = qwen3();
  auto ids = tok->encode(bench_text(), true);
  for (auto _ : state) benchmark::DoNotOptimize(tok->decode(ids, true));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bench_text().size()));
}
BENCHMARK(BM_DecodeQwen3)->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
