// The structured-output mask per decode step with an enum property, on the real Qwen3
// vocabulary (tests/node/.cache/qwen3-tokenizer.json, from tests/node/fetch-qwen3-tokenizer.sh).
// Schema: {"type":"object","properties":{"choice":{"type":"string","enum":[N words]}},
// "required":["choice"]}; the words are lower-case pseudo-words of 3 to 12 letters (fixed seed,
// so prefix-sharing ones are common). Timed: JsonConstraint::mask over one fp32 row after a
// document prefix (pushed as the tokenizer encodes it). Args: N, then the position (0: before
// the value, 1: after its opening quote, 2: three letters into a word, 3: after the closing
// quote). Results: docs/performance/2026-12-07-enum-lookup.md.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/json_constraint.h"
#include "text/tokenizer.h"

namespace {

std::string source_dir() {
  const char* env = std::getenv("LILY_SOURCE_DIR");
  return env ? env : LILY_SOURCE_DIR;
}

std::shared_ptr<const lily::Tokenizer> qwen3() {
  static auto tok = lily::Tokenizer::from_file(source_dir() + "/tests/node/.cache/qwen3-tokenizer.json");
  return tok;
}

/// `n` distinct pseudo-words; mt19937's raw output is fixed by the standard, so every build
/// gets the same list.
std::vector<std::string> words(size_t n) {
  std::mt19937 rng(7);
  std::set<std::string> seen;
  std::vector<std::string> out;
  while (out.size() < n) {
    std::string w(3 + rng() % 10, 'a');
    for (char& c : w) c = static_cast<char>('a' + rng() % 26);
    if (seen.insert(w).second) out.push_back(w);
  }
  return out;
}

/// The document prefix for position `pos` (see the file comment), around word `w`.
std::string prefix(int pos, const std::string& w) {
  const std::string head = "{\"choice\": ";
  if (pos == 0) return head;
  if (pos == 1) return head + "\"";
  if (pos == 2) return head + "\"" + w.substr(0, 3);
  return head + "\"" + w + "\"";
}

void BM_EnumMask(benchmark::State& state) {
  const auto tok = qwen3();
  const int32_t vocab = tok->vocab_size();
  const auto list = words(static_cast<size_t>(state.range(0)));
  const nlohmann::json schema{{"type", "object"},
                              {"properties", {{"choice", {{"type", "string"}, {"enum", list}}}}},
                              {"required", {"choice"}}};
  lily::JsonConstraint c(lily::JsonSchema::compile(schema), lily::JsonVocabIndex::for_tokenizer(*tok, vocab), {});
  for (int32_t id : tok->encode(prefix(static_cast<int>(state.range(1)), list[list.size() / 2]))) c.push(id);
  if (!c.active()) state.SkipWithError("the prefix was refused");
  std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
  size_t left = 0;
  for (auto _ : state) {
    left = c.mask(row);
    benchmark::DoNotOptimize(row.data());
  }
  state.counters["tokens_left"] = static_cast<double>(left);
}

}  // namespace

BENCHMARK(BM_EnumMask)->ArgsProduct({{10, 3000}, {0, 1, 2, 3}})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
