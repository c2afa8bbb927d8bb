#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "base/error.h"

namespace lily {

namespace {

/// Descending logit, ties to the lower id: the one order every selection below uses.
struct ByLogitDesc {
  std::span<const float> x;
  bool operator()(int32_t a, int32_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

float max_of(std::span<const float> x) {
  float m = -std::numeric_limits<float>::infinity();
  for (float v : x) m = std::max(m, v);
  return m;
}

/// The ids of the `k` (≤ x.size()) largest entries of x in ByLogitDesc order. One pass with a
/// bounded heap for small k (the usual top-k of 20 … 100 costs little more than reading the
/// row), partial selection (nth_element) for large k.
std::vector<int32_t> top_ids(std::span<const float> x, size_t k) {
  const ByLogitDesc better{x};
  std::vector<int32_t> ids;
  if (k == 0) return ids;
  if (k <= 4096 && k * 16 <= x.size()) {
    // Max-heap under `better`: its front is the worst id kept so far.
    ids.reserve(k);
    for (size_t i = 0; i < k; ++i) ids.push_back(static_cast<int32_t>(i));
    std::make_heap(ids.begin(), ids.end(), better);
    for (size_t i = k; i < x.size(); ++i) {
      const auto id = static_cast<int32_t>(i);
      if (!better(id, ids.front())) continue;
      std::pop_heap(ids.begin(), ids.end(), better);
      ids.back() = id;
      std::push_heap(ids.begin(), ids.end(), better);
    }
  } else {
    ids.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) ids[i] = static_cast<int32_t>(i);
    if (k < ids.size())
      std::nth_element(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), better);
    ids.resize(k);
  }
  std::sort(ids.begin(), ids.end(), better);
  return ids;
}

}  // namespace

bool SamplingParams::modifies_logits() const {
  return !logit_bias.empty() || repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
}

// --- history -----------------------------------------------------------------------------------

void TokenHistory::add_prompt(std::span<const int32_t> ids) {
  if (in_prompt_.empty()) in_prompt_.assign(static_cast<size_t>(vocab_), 0);
  if (counts_.empty()) counts_.assign(static_cast<size_t>(vocab_), 0);
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_ || in_prompt_[id]) continue;
    if (counts_[id] == 0) touched_.push_back(id);
    in_prompt_[id] = 1;
  }
}

void TokenHistory::add_generated(int32_t id) {
  if (id < 0 || id >= vocab_) return;
  if (in_prompt_.empty()) in_prompt_.assign(static_cast<size_t>(vocab_), 0);
  if (counts_.empty()) counts_.assign(static_cast<size_t>(vocab_), 0);
  if (counts_[id] == 0 && !in_prompt_[id]) touched_.push_back(id);
  ++counts_[id];
}

int32_t TokenHistory::generated_count(int32_t id) const {
  return (id < 0 || id >= vocab_ || counts_.empty()) ? 0 : counts_[id];
}

bool TokenHistory::seen(int32_t id) const {
  if (id < 0 || id >= vocab_ || counts_.empty()) return false;
  return in_prompt_[id] != 0 || counts_[id] > 0;
}

std::vector<int32_t> TokenHistory::seen_ids() const {
  std::vector<int32_t> ids = touched_;
  std::sort(ids.begin(), ids.end());
  return ids;
}

// --- random numbers ----------------------------------------------------------------------------

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (golden ratio, sqrt(3) - 1)
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

double sample_uniform(uint64_t seed, uint64_t step) {
  const auto w = philox4x32_10({static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u},
                               {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  const uint64_t bits = (static_cast<uint64_t>(w[0]) << 21) | (w[1] >> 11);  // 53 bits
  return static_cast<double>(bits) * 0x1.0p-53;
}

uint64_t choice_seed(uint64_t seed, int index) {
  if (index == 0) return seed;
  uint64_t z = seed + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z & ((uint64_t{1} << 53) - 1);
}

uint64_t fresh_seed() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v & ((uint64_t{1} << 53) - 1);
}

// --- the steps ---------------------------------------------------------------------------------

void apply_penalties(std::span<float> logits, const SamplingParams& p, const TokenHistory& history) {
  const auto vocab = static_cast<int64_t>(logits.size());
  for (const auto& [id, bias] : p.logit_bias)
    if (id >= 0 && id < vocab) logits[id] += bias;
  const bool repetition = p.repetition_penalty != 1.0f;
  const bool additive = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  if (!repetition && !additive) return;
  for (int32_t id : history.seen_ids()) {
    if (id >= vocab) continue;
    float& l = logits[id];
    if (repetition) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    const int32_t count = history.generated_count(id);
    if (count > 0) l -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
  }
}

PenaltyEdits penalty_edits(const SamplingParams& p, const TokenHistory& history, int32_t vocab) {
  PenaltyEdits out;
  const bool penalties = p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  std::vector<int32_t> ids;
  for (const auto& [id, bias] : p.logit_bias)
    if (id >= 0 && id < vocab) ids.push_back(id);
  std::vector<int32_t> seen;
  if (penalties) seen = history.seen_ids();  // ascending
  for (int32_t id : seen)
    if (id >= 0 && id < vocab) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  out.edits.reserve(ids.size());
  for (int32_t id : ids) {
    PenaltyEdit e;
    e.id = id;
    e.count = history.generated_count(id);
    e.seen = penalties && std::binary_search(seen.begin(), seen.end(), id) ? 1 : 0;
    e.bias_begin = static_cast<int32_t>(out.biases.size());
    for (const auto& [bid, bias] : p.logit_bias)
      if (bid == id) out.biases.push_back(bias);
    e.bias_count = static_cast<int32_t>(out.biases.size()) - e.bias_begin;
    out.edits.push_back(e);
  }
  return out;
}

float apply_penalty_edit(float raw, const PenaltyEdit& e, std::span<const float> biases, const SamplingParams& p) {
  float l = raw;
  for (int32_t j = 0; j < e.bias_count; ++j) l += biases[static_cast<size_t>(e.bias_begin + j)];
  if (!e.seen) return l;
  if (p.repetition_penalty != 1.0f) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
  if (e.count > 0) l -= p.frequency_penalty * static_cast<float>(e.count) + p.presence_penalty;
  return l;
}

void apply_penalty_edits(std::span<float> logits, const PenaltyEdits& edits, const SamplingParams& p) {
  for (const PenaltyEdit& e : edits.edits)
    if (e.id >= 0 && static_cast<size_t>(e.id) < logits.size())
      logits[static_cast<size_t>(e.id)] = apply_penalty_edit(logits[static_cast<size_t>(e.id)], e, edits.biases, p);
}

int32_t argmax_token(std::span<const float> logits) {
  if (logits.empty()) throw InternalError("argmax_token: empty logits");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  return best;
}

std::vector<int32_t> surviving_tokens(std::span<const float> x, const SamplingParams& p) {
  const auto vocab = static_cast<int64_t>(x.size());
  if (vocab == 0) throw InternalError("surviving_tokens: empty logits");
  const bool use_k = p.top_k > 0 && p.top_k < vocab;
  const bool use_p = p.top_p < 1.0f;
  const bool use_min_p = p.min_p > 0.0f;
  if (!use_k && !use_p && !use_min_p) return {};
  const float m = max_of(x);
  // p_i ≥ min_p · p_max ⇔ x_i ≥ x_max + log(min_p); the max always passes.
  const double floor = use_min_p ? static_cast<double>(m) + std::log(static_cast<double>(p.min_p))
                                 : -std::numeric_limits<double>::infinity();
  auto weight = [&](int32_t id) { return static_cast<double>(std::exp(x[id] - m)); };

  std::vector<int32_t> ids;  // candidates, most likely first once sorted
  double total = 0;          // probability mass (unnormalized) of the top-k set, for top-p
  if (use_k) {
    ids = top_ids(x, static_cast<size_t>(p.top_k));
    if (use_p)
      for (int32_t id : ids) total += weight(id);
    // Both filters below keep a most-likely-first prefix of this sorted list.
    size_t keep = 1;
    while (keep < ids.size() && static_cast<double>(x[ids[keep]]) >= floor) ++keep;
    ids.resize(keep);
  } else {
    // Every id is a candidate; only those passing min-p matter for the walk below, but the
    // top-p mass counts them all.
    for (int64_t i = 0; i < vocab; ++i) {
      if (use_p) total += weight(static_cast<int32_t>(i));
      if (static_cast<double>(x[i]) >= floor) ids.push_back(static_cast<int32_t>(i));
    }
  }
  if (use_p) {
    // The shortest most-likely-first prefix whose mass reaches top_p of the top-k set. The
    // candidates are ordered in growing blocks (64, 256, …) instead of all at once: a peaked
    // distribution reaches top_p within the first block.
    const double target = static_cast<double>(p.top_p) * total;
    const ByLogitDesc better{x};
    size_t block = std::min<size_t>(use_k ? ids.size() : 64, ids.size());
    size_t sorted = use_k ? ids.size() : 0;  // the top-k list is already sorted
    double cum = 0;
    size_t keep = 0;
    while (true) {
      if (sorted < block) {
        if (block < ids.size())
          std::nth_element(ids.begin() + static_cast<std::ptrdiff_t>(sorted),
                           ids.begin() + static_cast<std::ptrdiff_t>(block), ids.end(), better);
        std::sort(ids.begin() + static_cast<std::ptrdiff_t>(sorted), ids.begin() + static_cast<std::ptrdiff_t>(block),
                  better);
        sorted = block;
      }
      while (keep < block && cum < target) cum += weight(ids[keep++]);
      if (cum >= target || block == ids.size()) break;
      block = std::min(block * 4, ids.size());
    }
    ids.resize(std::max<size_t>(keep, 1));
  }
  if (!std::is_sorted(ids.begin(), ids.end())) std::sort(ids.begin(), ids.end());
  return ids;
}

int32_t draw_token(std::span<const float> x, std::span<const int32_t> survivors, double u) {
  const bool all = survivors.empty();
  const size_t n = all ? x.size() : survivors.size();
  auto id_at = [&](size_t i) { return all ? static_cast<int32_t>(i) : survivors[i]; };
  float m = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) m = std::max(m, x[id_at(i)]);
  auto weight = [&](int32_t id) { return static_cast<double>(std::exp(x[id] - m)); };
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += weight(id_at(i));
  const double target = u * total;
  double cum = 0;
  int32_t last = -1;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = id_at(i);
    const double w = weight(id);
    if (w <= 0) continue;  // exp underflow or -inf: never drawn
    cum += w;
    last = id;
    if (cum > target) return id;
  }
  if (last < 0) throw InternalError("draw_token: no token with positive probability");
  return last;  // rounding left target at the very top: the last token with weight
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t chosen, int top_n) {
  const auto vocab = static_cast<int64_t>(logits.size());
  if (chosen < 0 || chosen >= vocab) throw InternalError("token_logprobs: chosen id out of range");
  const float m = max_of(logits);
  double sum = 0;
  for (float v : logits) sum += static_cast<double>(std::exp(v - m));
  const double log_z = static_cast<double>(m) + std::log(sum);
  auto logprob = [&](int32_t id) { return static_cast<float>(std::min(0.0, static_cast<double>(logits[id]) - log_z)); };
  TokenLogprobs out;
  out.token = chosen;
  out.logprob = logprob(chosen);
  for (int32_t id : top_ids(logits, static_cast<size_t>(std::clamp<int64_t>(top_n, 0, vocab))))
    out.top.push_back({id, logprob(id)});
  return out;
}

int32_t Sampler::sample(std::span<const float> logits, const SamplingParams& p, const TokenHistory& history,
                        uint64_t step) {
  work_.assign(logits.begin(), logits.end());
  apply_penalties(work_, p, history);
  if (p.greedy()) return argmax_token(work_);
  // Saturated, not infinite: a logit past fp32's range after the division (only a pathological
  // row gets there) draws like the largest finite value instead of turning the softmax into NaN.
  constexpr float kMax = std::numeric_limits<float>::max();
  for (float& v : work_) v = std::clamp(v / p.temperature, -kMax, kMax);
  const std::vector<int32_t> survivors = surviving_tokens(work_, p);
  return draw_token(work_, survivors, sample_uniform(p.seed, step));
}

}  // namespace lily
