// A deterministic stand-in Backend for unit tests of the engine's own logic (generation loop,
// prefix cache, scheduler). The next token is a pure function of the whole token history, so a
// state that resumed from a cache snapshot produces exactly what a fresh one would, and a state
// that was wrongly shared or rewound produces something else. End-to-end tests with the real
// CPU backend live in tests/node/server.test.mjs. StepLog records a scheduler's steps.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <thread>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <span>
#include <vector>

#include "base/error.h"
#include "engine/backend.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

namespace lily::test {

class FakeState final : public SequenceState {
 public:
  explicit FakeState(int64_t max_seq) : max_seq(max_seq) {}
  int64_t position() const override { return static_cast<int64_t>(history.size()); }
  /// 1000 + 4 per token it holds itself (not those of its shared base).
  int64_t bytes() const override {
    return 1000 + 4 * (static_cast<int64_t>(history.size()) - (base ? base->position() : 0));
  }
  std::vector<int32_t> history;
  int64_t max_seq;
  bool host = false;  ///< a copy_to_host copy: prefill and decode refuse it
  /// share_prefix: the state whose "KV rows" (its tokens) this one shares; steps refuse it.
  std::shared_ptr<const SequenceState> base;
};

class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(int32_t vocab = 1000) : vocab_(vocab) { config_.vocab = vocab; }
  std::string name() const override { return "fake"; }
  const ModelConfig& config() const override { return config_; }
  std::unique_ptr<SequenceState> new_state(int64_t max_seq) override {
    ++states_created;
    return std::make_unique<FakeState>(max_seq);
  }
  std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override {
    ++clones;
    if (static_cast<const FakeState&>(s).host) ++host_restores;
    auto copy = std::make_unique<FakeState>(static_cast<const FakeState&>(s));
    copy->host = false;
    copy->base.reset();
    return copy;
  }
  /// With share_kv: shares `base`'s tokens when they are a strict prefix of `s`'s (counted in
  /// shares); nullptr otherwise.
  std::unique_ptr<SequenceState> share_prefix(const SequenceState& s, std::shared_ptr<const SequenceState> base) override {
    if (!share_kv) return nullptr;
    const auto& from = static_cast<const FakeState&>(s);
    const auto& b = static_cast<const FakeState&>(*base);
    if (b.host) throw Error("fake backend: a host copy as a base");
    if (b.history.size() >= from.history.size() ||
        !std::equal(b.history.begin(), b.history.end(), from.history.begin()))
      return nullptr;
    ++shares;
    auto shared = std::make_unique<FakeState>(from);
    shared->base = std::move(base);
    return shared;
  }
  /// clone_state, counted in resumes, with `capacity` recorded in resume_capacities.
  std::unique_ptr<SequenceState> resume_state(const SequenceState& s, int64_t capacity) override {
    ++resumes;
    resume_capacities.push_back(capacity);
    return clone_state(s);
  }
  /// A host copy (not runnable); waits at the copy gate first (close_copy_gate) and throws when
  /// fail_host_copies is set. Safe on a helper thread: it only reads `s`.
  std::unique_ptr<SequenceState> copy_to_host(const SequenceState& s) override {
    {
      std::unique_lock l(m_);
      ++copies_at_gate_;
      cv_.notify_all();
      cv_.wait(l, [&] { return copy_gate_open_; });
      --copies_at_gate_;
    }
    ++host_copies;
    if (fail_host_copies) throw Error("fake backend: no host memory");
    auto copy = std::make_unique<FakeState>(static_cast<const FakeState&>(s));
    copy->host = true;
    copy->base.reset();
    return copy;
  }
  bool copies_to_host_concurrently() const override { return concurrent_host_copies; }
  /// device_free when set (a backend with memory of its own, as CUDA), else nullopt (as the CPU).
  std::optional<int64_t> free_memory() const override { return device_free; }
  /// With device_free set: FakeState::bytes of a state of `capacity` tokens.
  int64_t state_bytes(int64_t capacity) const override { return device_free ? 1000 + 4 * capacity : 0; }
  /// Records the host tier's budget (host_reservations).
  void reserve_host_copies(int64_t bytes) override { host_reservations.push_back(bytes); }
  /// Blocks copy_to_host until open_copy_gate().
  void close_copy_gate() {
    std::lock_guard l(m_);
    copy_gate_open_ = false;
  }
  void open_copy_gate() {
    {
      std::lock_guard l(m_);
      copy_gate_open_ = true;
    }
    cv_.notify_all();
  }
  /// Waits (up to `timeout`) until a copy_to_host is blocked at the closed copy gate.
  bool wait_until_copy_at_gate(std::chrono::milliseconds timeout) {
    std::unique_lock l(m_);
    return cv_.wait_for(l, timeout, [&] { return copies_at_gate_ > 0; });
  }
  int max_batch() const override { return max_rows; }
  /// Counts its calls (idle_calls); true for the first idle_pieces − 1 of them.
  bool prepare_while_idle() override {
    std::lock_guard l(m_);
    ++idle_calls;
    return idle_calls < idle_pieces;
  }
  /// idle_calls, read under the lock (the engine thread writes it).
  int idle_calls_now() const {
    std::lock_guard l(m_);
    return idle_calls;
  }
  /// Each row as a prefill (counted in prefill_calls, prefill_sizes) or a decode (decode_calls);
  /// waits at the gate once per step and sleeps decode_delay once per step with a decode row.
  std::vector<int32_t> step(std::span<const StepRow> rows) override {
    wait_gate();
    if (rows.empty() || static_cast<int>(rows.size()) > max_rows) throw Error("fake backend: bad row count");
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].tokens.empty()) throw Error("fake backend: a row without tokens");
      if (rows[i].position != rows[i].state->position()) throw Error("fake backend: wrong position");
      if (static_cast<const FakeState&>(*rows[i].state).base) throw Error("fake backend: a shared snapshot in a step");
      for (size_t j = 0; j < i; ++j)
        if (rows[j].state == rows[i].state) throw Error("fake backend: one state twice");
    }
    ++steps;
    step_rows.push_back(static_cast<int>(rows.size()));
    std::vector<int32_t> next(rows.size(), -1);
    bool decoded = false;
    for (size_t i = 0; i < rows.size(); ++i) {
      const StepRow& r = rows[i];
      auto& st = static_cast<FakeState&>(*r.state);
      if (r.decode) {
        ++decode_calls;
        decoded = true;
      } else {
        ++prefill_calls;
        prefilled_tokens += static_cast<int64_t>(r.tokens.size());
        prefill_sizes.push_back(static_cast<int64_t>(r.tokens.size()));
      }
      for (int32_t t : r.tokens) feed(st, t);
      if (!r.want_logits) continue;
      fill_logits(st.history, r.logits);
      next[i] = next_token(st.history);
      if (device_sampling && r.sampling.params != nullptr) next[i] = device_sample(st.history, r.sampling);
    }
    if (decoded && decode_delay.count() > 0) std::this_thread::sleep_for(decode_delay);
    return next;
  }
  /// Logits [vocab] that are a function of the history too: values in [0, 2) from a hash, plus
  /// 3 at next_token (so their argmax is the greedy answer). Counted in logits_calls.
  void fill_logits(const std::vector<int32_t>& history, std::vector<float>* logits) {
    if (logits == nullptr) return;
    ++logits_calls;
    logits->resize(static_cast<size_t>(vocab_));
    uint64_t h = 88172645463325252ull;
    for (int32_t t : history) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
    for (int32_t i = 0; i < vocab_; ++i) {
      h ^= h << 13, h ^= h >> 7, h ^= h << 17;  // xorshift64
      (*logits)[i] = static_cast<float>(h % 2000) / 1000.0f;
    }
    (*logits)[next_token(history)] += 3.0f;
  }
  /// What a device sampler returns for a row (engine/sampler.h's pipeline on this backend's
  /// logits with the row's edits and Philox counter). Counted in device_sampled_rows.
  int32_t device_sample(const std::vector<int32_t>& history, const RowSampling& rs) {
    ++device_sampled_rows;
    std::vector<float> x;
    const int calls = logits_calls;
    fill_logits(history, &x);
    logits_calls = calls;
    if (rs.edits != nullptr) apply_penalty_edits(x, *rs.edits, *rs.params);
    if (rs.params->greedy()) return argmax_token(x);
    for (float& v : x) v /= rs.params->temperature;
    return draw_token(x, surviving_tokens(x, *rs.params), sample_uniform(rs.params->seed, rs.step));
  }
  bool samples_on_device() const override { return device_sampling; }
  /// Deterministic function of the history: a rolling hash mod vocab.
  int32_t next_token(const std::vector<int32_t>& history) const {
    if (script) return script(history);
    uint64_t h = 1469598103934665603ull;
    for (int32_t t : history) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
    return static_cast<int32_t>(h % static_cast<uint64_t>(vocab_));
  }
  /// Blocks step() until open_gate() (for scheduler tests).
  void close_gate() {
    std::lock_guard l(m_);
    gate_open_ = false;
  }
  /// Waits (up to `timeout`) until a step() is blocked at the closed gate; false on time-out.
  bool wait_until_at_gate(std::chrono::milliseconds timeout) {
    std::unique_lock l(m_);
    return cv_.wait_for(l, timeout, [&] { return at_gate_ > 0; });
  }
  void open_gate() {
    {
      std::lock_guard l(m_);
      gate_open_ = true;
    }
    cv_.notify_all();
  }

  /// What weights_changed() reports (a stand-in for a truncated checkpoint); thread-safe.
  void set_weights_problem(std::optional<std::string> problem) {
    std::lock_guard l(m_);
    weights_problem_ = std::move(problem);
  }
  std::optional<std::string> weights_changed() const override {
    std::lock_guard l(m_);
    return weights_problem_;
  }

  std::function<int32_t(const std::vector<int32_t>&)> script;  ///< overrides next_token when set
  bool device_sampling = false;  ///< samples_on_device(): rows with sampling.params get device_sample
  int device_sampled_rows = 0;   ///< rows sampled "on the device"
  std::chrono::milliseconds decode_delay{0};
  int max_rows = 64;  ///< max_batch()
  int idle_pieces = 0;  ///< prepare_while_idle() calls that count as work (set before the engine starts)
  int idle_calls = 0;   ///< prepare_while_idle() calls so far (idle_calls_now() from other threads)
  int steps = 0;                ///< step() calls
  std::vector<int> step_rows;   ///< rows of each step, in order
  int prefill_calls = 0, decode_calls = 0, clones = 0, states_created = 0, logits_calls = 0;
  std::atomic<int> host_copies = 0;  ///< copy_to_host calls (made on the cache's helper thread too)
  int host_restores = 0;             ///< clone_state calls on host copies
  bool concurrent_host_copies = false;   ///< copies_to_host_concurrently() (set before use)
  std::optional<int64_t> device_free;  ///< free_memory(); set it to act as a device backend
  std::vector<int64_t> host_reservations;  ///< the bytes of each reserve_host_copies call, in order
  std::atomic<bool> fail_host_copies = false;  ///< copy_to_host throws
  int resumes = 0;                         ///< resume_state calls (each also counted as a clone)
  bool share_kv = false;                   ///< share_prefix shares (set before use)
  int shares = 0;                          ///< share_prefix calls that shared
  std::vector<int64_t> resume_capacities;  ///< the capacity of each resume_state call, in order
  std::vector<int64_t> prefill_sizes;      ///< tokens of each prefill call, in order
  int64_t prefilled_tokens = 0;

 private:
  void feed(FakeState& st, int32_t t) {
    if (st.host) throw Error("fake backend: a host copy is not runnable");
    if (st.position() >= st.max_seq) throw Error("sequence full");
    st.history.push_back(t);
  }
  void wait_gate() {
    std::unique_lock l(m_);
    ++at_gate_;
    cv_.notify_all();
    cv_.wait(l, [&] { return gate_open_; });
    --at_gate_;
  }
  int32_t vocab_;
  ModelConfig config_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool gate_open_ = true;
  int at_gate_ = 0;  ///< step() calls waiting at the gate now
  bool copy_gate_open_ = true;
  int copies_at_gate_ = 0;  ///< copy_to_host calls waiting at the copy gate now
  std::optional<std::string> weights_problem_;
};

/// Every step's stats of a scheduler, recorded through EngineOptions::on_step (thread-safe).
class StepLog {
 public:
  /// Points o.on_step at this log, which must outlive the scheduler made with `o`.
  void attach(EngineOptions& o) {
    o.on_step = [this](const StepStats& st) {
      std::lock_guard l(mutex_);
      steps_.push_back(st);
    };
  }
  /// The steps recorded so far.
  std::vector<StepStats> steps() {
    std::lock_guard l(mutex_);
    return steps_;
  }

 private:
  std::mutex mutex_;
  std::vector<StepStats> steps_;
};

}  // namespace lily::test
