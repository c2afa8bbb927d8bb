// The device sampler wired into the CUDA backend (Backend::samples_on_device): generate() with
// sampling parameters on the CUDA backend (the sampling decode graph, the sampler after the
// batched prefill's LM head, the penalty edits uploaded per step) gives the tokens that the same
// backend gives when its raw logits are copied to the host and the CPU sampler
// (engine/sampler.h) picks each token, step by step. Float-order near-ties are the only allowed
// difference (docs/cuda.md, "The device sampler"): a divergence is printed and at most one
// sequence may diverge. Also: greedy generation is unchanged by a sampled request on the same
// backend before it (the greedy graph stays what it was).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels.h"
#include "engine/generate.h"
#include "model/loader.h"
#include "model/synth.h"
#include "support/test_support.h"

namespace lily::test {
namespace {

/// The reference: the backend's raw logits on the host and the CPU sampler, with the prompt cut
/// where Generation cuts it (before the last prompt token).
std::vector<int32_t> host_sampled(Backend& b, const std::vector<int32_t>& prompt, const SamplingParams& p, int n) {
  auto state = b.new_state(512);
  TokenHistory history(b.config().vocab);
  if (p.modifies_logits() && p.repetition_penalty != 1.0f) history.add_prompt(prompt);
  Sampler sampler;
  std::vector<float> logits;
  const std::span<const int32_t> all(prompt);
  b.prefill(*state, all.first(all.size() - 1));
  b.prefill(*state, all.last(1), &logits);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    const int32_t t = sampler.sample(logits, p, history, static_cast<uint64_t>(i));
    if (p.modifies_logits()) history.add_generated(t);
    ids.push_back(t);
    if (i + 1 < n) b.decode(*state, t, &logits);
  }
  return ids;
}

GenerationResult device_sampled(Backend& b, const std::vector<int32_t>& prompt, const SamplingParams& p, int n,
                                int logprobs = -1) {
  auto state = b.new_state(512);
  GenerationParams gp;
  gp.max_tokens = n;
  gp.max_seq = 512;
  gp.sampling = p;
  gp.logprobs = logprobs;
  return generate(b, *state, prompt, gp, nullptr);
}

TEST(CudaSamplingE2e, DeviceSamplerMatchesHostSamplerOnTheBackendsLogits) {
  TempDir dir;
  SynthOptions o;
  o.preset = "realdims";
  o.seed = 7;
  o.out = dir.path();
  write_synthetic_checkpoint(o);
  auto w = load_model(dir.path());
  CudaOptions options = CudaOptions::from_env();
  options.device_sampler = true;  // the default; set here so LILY_CUDA_DEVICE_SAMPLER=0 cannot skip it
  auto gpu = make_cuda_backend(w, options);
  ASSERT_TRUE(gpu->samples_on_device());
  const int vocab = w->config.vocab;
  const std::vector<int32_t> prompt = hash_prompt(40, vocab, 5);

  // Greedy before anything is sampled, to compare after.
  const std::vector<int32_t> greedy_before = device_sampled(*gpu, prompt, SamplingParams{}, 12).token_ids;

  std::vector<SamplingParams> sets;
  auto add = [&](float t, int k, float top_p, float min_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = t, p.top_k = k, p.top_p = top_p, p.min_p = min_p, p.seed = seed;
    sets.push_back(p);
    return &sets.back();
  };
  add(0.7f, 20, 0.8f, 0.0f, 1);
  add(1.0f, 0, 1.0f, 0.0f, 2);
  add(1.0f, 0, 0.95f, 0.0f, 3);
  add(1.2f, 0, 1.0f, 0.05f, 4);
  add(0.6f, 200, 0.95f, 0.0f, 5);
  {
    SamplingParams* p = add(0.8f, 50, 0.9f, 0.0f, 6);
    p->repetition_penalty = 1.3f, p->presence_penalty = 0.5f, p->frequency_penalty = 0.3f;
    p->logit_bias = {{prompt[3], 4.0f}, {17, -100.0f}, {prompt[3], 1.0f}};
  }
  {
    SamplingParams* p = add(0.0f, 0, 1.0f, 0.0f, 7);  // greedy with a penalty: the device argmax of the edited row
    p->repetition_penalty = 1.5f;
  }
  const int n = 24;
  int diverged = 0;
  for (size_t c = 0; c < sets.size(); ++c) {
    const SamplingParams& p = sets[c];
    const std::vector<int32_t> want = host_sampled(*gpu, prompt, p, n);
    const GenerationResult got = device_sampled(*gpu, prompt, p, n);
    ASSERT_EQ(got.token_ids.size(), want.size()) << "set " << c;
    size_t same = 0;
    while (same < want.size() && got.token_ids[same] == want[same]) ++same;
    std::printf("[sampling set %zu] T=%g top_k=%d top_p=%g min_p=%g: %zu / %zu tokens equal to the host sampler's\n", c,
                p.temperature, p.top_k, p.top_p, p.min_p, same, want.size());
    if (same < want.size()) {
      ++diverged;
      EXPECT_FALSE(p.greedy()) << "greedy with penalties must match exactly (set " << c << ")";
    }
    // Repeating a seeded request gives the same tokens.
    EXPECT_EQ(device_sampled(*gpu, prompt, p, n).token_ids, got.token_ids) << "set " << c;
  }
  EXPECT_LE(diverged, 1) << "more than one float-order near-tie in " << sets.size() << " sequences";

  // With logprobs the token is still the device's; the log-probabilities come from host logits.
  const GenerationResult lp = device_sampled(*gpu, prompt, sets[0], n, 3);
  EXPECT_EQ(lp.token_ids, device_sampled(*gpu, prompt, sets[0], n).token_ids);
  ASSERT_EQ(lp.logprobs.size(), lp.token_ids.size());
  for (size_t i = 0; i < lp.logprobs.size(); ++i) {
    EXPECT_EQ(lp.logprobs[i].token, lp.token_ids[i]);
    EXPECT_LE(lp.logprobs[i].logprob, 0.0f);
    EXPECT_EQ(lp.logprobs[i].top.size(), 3u);
  }

  // The greedy graph is untouched by the sampled requests.
  EXPECT_EQ(device_sampled(*gpu, prompt, SamplingParams{}, 12).token_ids, greedy_before);
}

}  // namespace
}  // namespace lily::test
