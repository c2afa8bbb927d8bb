// Sampling of the next token from one row of logits, and the log-probabilities reported to
// clients. Everything here works on one row ([vocab] fp32 logits of one sequence), so
// a batched decode step samples each row on its own and a device sampler can replace this one
// row for row: the definitions below (order of the steps, tie rules, the draw) are the contract.
//
// The pipeline for one row, in the order transformers and vLLM use:
//   1. logit_bias is added, then the repetition penalty, then the frequency and presence
//      penalties (apply_penalties);
//   2. temperature: logits / T (T = 0, or T < kGreedyBelowTemperature, means greedy: argmax,
//      ties to the lowest id);
//   3. top-k, top-p and min-p select the surviving tokens (surviving_tokens);
//   4. a draw from the softmax of the survivors with one counter-based uniform (draw_token).
// Log-probabilities are a log-softmax of the raw logits, before any of these steps (that is
// what OpenAI reports), computed by token_logprobs.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace lily {

/// Temperatures below this are greedy (argmax): at T = 1e-5 only logits within about 1e-4 of the
/// largest keep any weight, and much smaller values would overflow logits / T in fp32 (vLLM
/// draws the same line).
inline constexpr float kGreedyBelowTemperature = 1e-5f;

/// How one sequence picks its tokens. The defaults are greedy decoding with nothing applied.
struct SamplingParams {
  float temperature = 0.0f;         ///< < kGreedyBelowTemperature = greedy; else logits are divided by it (≤ 2)
  float top_p = 1.0f;               ///< keep the most likely tokens whose mass reaches top_p (0 < p ≤ 1; 1 = off)
  int32_t top_k = 0;                ///< keep the k most likely tokens (0 = off)
  float min_p = 0.0f;               ///< keep tokens with p ≥ min_p · p_max (0 ≤ min_p ≤ 1; 0 = off)
  float presence_penalty = 0.0f;    ///< subtracted once from every token already generated (−2 … 2)
  float frequency_penalty = 0.0f;   ///< subtracted per occurrence among the generated tokens (−2 … 2)
  float repetition_penalty = 1.0f;  ///< divides positive / multiplies negative logits of tokens in the
                                    ///< prompt or generated so far (> 0; 1 = off)
  std::vector<std::pair<int32_t, float>> logit_bias;  ///< (token id, added to its logit)
  uint64_t seed = 0;                ///< keys the random numbers (see sample_uniform)

  /// True at temperature 0 (or below kGreedyBelowTemperature): the next token is the argmax
  /// (after penalties and bias, if any).
  bool greedy() const { return temperature < kGreedyBelowTemperature; }
  /// True when bias or a penalty changes the logits before selection.
  bool modifies_logits() const;
  /// True when greedy and nothing changes the logits: the backend's own argmax is the answer
  /// (the bit-exact path of the goldens, which never needs the logits on the host).
  bool plain_greedy() const { return greedy() && !modifies_logits(); }
};

/// The tokens a sequence has seen, for the penalties: which ids are in the prompt (repetition
/// penalty) and how often each id was generated (all three penalties). Generated tokens count
/// from the first token after the prompt, so a prefix-cache hit never changes them.
class TokenHistory {
 public:
  /// An empty history over a vocabulary of `vocab` ids.
  explicit TokenHistory(int32_t vocab = 0) : vocab_(vocab) {}
  /// Marks the prompt's ids (ids outside [0, vocab) are ignored).
  void add_prompt(std::span<const int32_t> ids);
  /// Counts one generated id.
  void add_generated(int32_t id);
  /// Times `id` was generated.
  int32_t generated_count(int32_t id) const;
  /// Whether `id` is in the prompt or was generated.
  bool seen(int32_t id) const;
  /// Distinct ids seen (prompt ∪ generated), ascending.
  std::vector<int32_t> seen_ids() const;

 private:
  int32_t vocab_;
  std::vector<uint8_t> in_prompt_;  ///< [vocab] or empty
  std::vector<int32_t> counts_;     ///< [vocab] generated counts, or empty
  std::vector<int32_t> touched_;    ///< ids with in_prompt_ or counts_ set, unsorted, unique
};

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
/// counter-based generator. The same (counter, key) always gives the same four 32-bit words, on
/// any thread or device, so a draw depends only on what it is keyed by.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

/// The uniform number in [0, 1) used for the draw of generated token number `step` (0 = the
/// first token after the prompt) of a sequence seeded with `seed`: Philox4x32-10 with key =
/// (low, high 32 bits of seed) and counter = (low, high 32 bits of step, 0, 0); the first two
/// output words form a 53-bit fraction (w0 · 2^21 + (w1 >> 11)) · 2^−53. Independent of
/// threads, batching, the backend and the prefix cache.
double sample_uniform(uint64_t seed, uint64_t step);

/// Step 1: adds logit_bias, then the repetition penalty (positive logits divided by it,
/// negative ones multiplied, for every id in the prompt or generated), then subtracts
/// frequency_penalty · count + presence_penalty · [count > 0] for every generated id.
/// `logits` is [vocab] fp32, changed in place; ids outside it are ignored.
void apply_penalties(std::span<float> logits, const SamplingParams& params, const TokenHistory& history);

/// Step 1 in a flat form that a device sampler applies in parallel: one entry per distinct id
/// whose logit step 1 may change, ascending ids. An entry's new logit depends only on its own
/// raw logit: x += biases[bias_begin … bias_begin + bias_count) in logit_bias order; then, when
/// `seen`, the repetition penalty (when it is not 1) and, when count > 0,
/// x −= frequency_penalty · count + presence_penalty. Exactly apply_penalties, id by id.
struct PenaltyEdit {
  int32_t id = 0;
  int32_t count = 0;       ///< times the id was generated
  int32_t seen = 0;        ///< 1: in the prompt or generated, and a penalty is active
  int32_t bias_begin = 0;  ///< first of its logit_bias values in PenaltyEdits::biases
  int32_t bias_count = 0;  ///< number of logit_bias entries for this id (in request order)
};

/// The edits of one step (penalty_edits).
struct PenaltyEdits {
  std::vector<PenaltyEdit> edits;  ///< ascending ids, each once
  std::vector<float> biases;       ///< logit_bias values, grouped per edit
};

/// The edits apply_penalties(·, params, history) makes on a row of `vocab` logits: the
/// logit_bias ids plus, when a penalty is active, every id of history.seen_ids(). Ids outside
/// [0, vocab) are dropped. Cost: O(edits · log edits), independent of the vocabulary.
PenaltyEdits penalty_edits(const SamplingParams& params, const TokenHistory& history, int32_t vocab);

/// The new logit of one edit (the host form of what the device sampler computes per entry):
/// `raw` is the entry's logit before step 1.
float apply_penalty_edit(float raw, const PenaltyEdit& edit, std::span<const float> biases,
                         const SamplingParams& params);

/// apply_penalties through penalty_edits: every edit's logit replaced by apply_penalty_edit.
/// Equals apply_penalties bit for bit (tests/unit/engine/test_sampler.cpp checks it).
void apply_penalty_edits(std::span<float> logits, const PenaltyEdits& edits, const SamplingParams& params);

/// Argmax of `logits` ([vocab] fp32), ties to the lowest id (as the backends' greedy path).
int32_t argmax_token(std::span<const float> logits);

/// Step 3 on logits already divided by the temperature: the ids that survive top-k, then top-p
/// (on the distribution renormalized over the top-k set), then min-p, in ascending id order.
/// Each filter keeps a prefix of the ids in descending logit order (ties: lower id first):
/// top-k exactly k ids; top-p the shortest prefix whose probability reaches top_p (the token
/// that crosses it included); min-p the ids with p ≥ min_p · p_max. At least one id survives.
/// Returns an empty vector when no filter is active (every id survives). Never sorts the whole
/// row: top-k keeps a bounded heap (or partial selection for a large k), top-p orders growing
/// blocks of the most likely candidates (the whole row only for a nearly flat distribution).
std::vector<int32_t> surviving_tokens(std::span<const float> scaled, const SamplingParams& params);

/// Step 4: inverts the cumulative distribution of softmax(scaled) restricted to `survivors`
/// (ascending ids as surviving_tokens returns them; all ids when empty), walking them in that
/// order, at `u` ∈ [0, 1): the first id whose cumulative weight exceeds u · total. Weights are
/// exp(x − max) in fp32, summed in fp64.
int32_t draw_token(std::span<const float> scaled, std::span<const int32_t> survivors, double u);

/// One alternative in a top-log-probability list.
struct TopLogprob {
  int32_t token = 0;
  float logprob = 0.0f;  ///< natural log of the probability, ≤ 0
};

/// The log-probability of one generated token and the most likely alternatives, from the raw
/// logits of that step (before penalties and temperature).
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TopLogprob> top;  ///< most likely first (ties: lower id first), size top_n
};

/// Log-softmax of `logits` ([vocab] fp32; exp in fp32, the normalizer summed in fp64) at
/// `chosen`, plus the `top_n` (0 … vocab) most likely ids (ties: lower id first), found by a
/// bounded heap.
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t chosen, int top_n);

/// Chooses one token for one row. Reuses its scratch buffers between calls; one per sequence
/// (or per engine thread). Not thread-safe.
class Sampler {
 public:
  /// Runs steps 1–4 on `logits` ([vocab] fp32, not changed) for generated token number `step`.
  /// Greedy parameters give argmax_token of the penalized logits.
  int32_t sample(std::span<const float> logits, const SamplingParams& params, const TokenHistory& history,
                 uint64_t step);

 private:
  std::vector<float> work_;
};

/// The seed of choice `index` of a request seeded with `seed`: the seed itself for index 0,
/// else splitmix64(seed + index · 0x9E3779B97F4A7C15) masked to 53 bits (an integer that a
/// JSON client can send back exactly). A request with that seed and n = 1 produces exactly
/// choice `index`.
uint64_t choice_seed(uint64_t seed, int index);

/// A fresh seed in [0, 2^53) from the operating system's random source.
uint64_t fresh_seed();

}  // namespace lily
