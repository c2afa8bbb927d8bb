// Holding the CPU reference to another run's MoE routing where the router is near-tied.
//
// Why: two correct implementations that round differently (fp32 vs bf16 activations, or two
// summation orders) produce router logits that differ in the third or fourth digit. Where the
// k-th and (k+1)-th expert are that close, each picks a different expert set, and one token's
// hidden state then moves by a few percent (measured on the demo model: fp32 vs bf16 CPU runs,
// logits cosine down to 0.98 at steps whose greedy id still agrees). Comparing two backends
// token by token therefore needs the same routing decisions wherever the decision is within
// noise; every other difference (a wrong kernel, a wrong expert far from the boundary) still
// shows. RouterLog records the router logits of the run under test through its probe sink and
// hands the CPU a cpu::RouteOverride that adopts that run's expert set only at near-ties.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "engine/backend.h"

namespace lily::test {

/// Expert ids of the k largest logits, in descending order (ties to the lowest id, as the
/// router top-k of docs/model.md §3.5).
inline std::vector<int> top_k_ids(std::span<const float> logits, int k) {
  std::vector<int> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  ids.resize(static_cast<size_t>(k));
  return ids;
}

/// Router logits of a run, keyed by (layer, position), and the adoption rule above.
class RouterLog {
 public:
  /// A probe sink recording every "router_logits" probe (a later probe of the same key wins).
  ProbeSink recorder() {
    return [this](std::string_view name, int layer, int64_t position, std::span<const float> values) {
      if (name == "router_logits") logits_[{layer, position}].assign(values.begin(), values.end());
    };
  }

  /// A routing hook for the CPU backend: where the recorded run chose a different top-k set for
  /// (layer, position), adopt it iff, under the CPU's own logits, the recorded set's weakest
  /// expert is within `tie_tolerance` standard deviations of those logits (over the experts)
  /// below the CPU's k-th choice. Adoptions and refusals are counted; a refused difference is
  /// left to fail the comparison.
  cpu::RouteOverride adopter(float tie_tolerance) {
    return [this, tie_tolerance](int layer, int64_t position, std::span<const float> logits, std::span<int> ids) {
      auto it = logits_.find({layer, position});
      if (it == logits_.end()) return false;
      const std::vector<int> theirs = top_k_ids(it->second, static_cast<int>(ids.size()));
      std::vector<int> a(ids.begin(), ids.end()), b = theirs;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a == b) return false;
      float own_kth = logits[ids[0]], their_weakest = logits[theirs[0]];
      for (int e : ids) own_kth = std::min(own_kth, logits[e]);
      for (int e : theirs) their_weakest = std::min(their_weakest, logits[e]);
      const float gap = (own_kth - their_weakest) / standard_deviation(logits);
      if (gap > tie_tolerance) {
        ++refused_;
        widest_refused_gap_ = std::max(widest_refused_gap_, gap);
        return false;
      }
      ++adopted_;
      widest_adopted_gap_ = std::max(widest_adopted_gap_, gap);
      std::copy(theirs.begin(), theirs.end(), ids.begin());
      return true;
    };
  }

  void clear() { logits_.clear(); }
  int adopted() const { return adopted_; }
  int refused() const { return refused_; }
  float widest_adopted_gap() const { return widest_adopted_gap_; }
  float widest_refused_gap() const { return widest_refused_gap_; }

 private:
  static float standard_deviation(std::span<const float> v) {
    double sum = 0, sum_sq = 0;
    for (float x : v) {
      sum += x;
      sum_sq += double(x) * x;
    }
    const double mean = sum / double(v.size());
    return static_cast<float>(std::sqrt(std::max(1e-30, sum_sq / double(v.size()) - mean * mean)));
  }

  std::map<std::pair<int, int64_t>, std::vector<float>> logits_;
  int adopted_ = 0, refused_ = 0;
  float widest_adopted_gap_ = 0.0f, widest_refused_gap_ = 0.0f;
};

}  // namespace lily::test
