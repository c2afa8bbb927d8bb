// Host sampler cost per row at the real vocabulary (248,320 ids): the work the CPU does for
// every sampled token when the logits row comes back to the host (LILY_CUDA_DEVICE_SAMPLER=0,
// or the CPU backend). Logits ~ N(0, 2²), fixed seed; one Sampler reused across rows as the
// engine reuses it. Results: docs/performance/2026-12-01-device-sampler.md.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "engine/sampler.h"

namespace {

constexpr int kVocab = 248320;

const std::vector<float>& logits_row() {
  static const std::vector<float> row = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> v(kVocab);
    for (float& x : v) x = normal(rng);
    return v;
  }();
  return row;
}

void run(benchmark::State& state, const lily::SamplingParams& params) {
  const lily::TokenHistory history(kVocab);
  lily::Sampler sampler;
  uint64_t step = 0;
  for (auto _ : state) benchmark::DoNotOptimize(sampler.sample(logits_row(), params, history, step++));
}

lily::SamplingParams with(float temperature, float top_p, int top_k, float min_p) {
  lily::SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.min_p = min_p;
  return p;
}

void BM_QwenDefault(benchmark::State& s) { run(s, with(0.7f, 0.8f, 20, 0.0f)); }
void BM_MinP(benchmark::State& s) { run(s, with(1.0f, 1.0f, 0, 0.05f)); }
void BM_TemperatureOnly(benchmark::State& s) { run(s, with(1.0f, 1.0f, 0, 0.0f)); }
void BM_TopK200TopP(benchmark::State& s) { run(s, with(0.6f, 0.95f, 200, 0.0f)); }
void BM_TopPAlone(benchmark::State& s) { run(s, with(1.0f, 0.95f, 0, 0.0f)); }

}  // namespace

BENCHMARK(BM_QwenDefault)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MinP)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TemperatureOnly)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopK200TopP)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopPAlone)->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
