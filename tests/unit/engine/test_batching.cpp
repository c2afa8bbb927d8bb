// Continuous batching end to end through the real CPU backend on the demo model: requests served
// together (up to eight per step, prefill chunks next to decode rows) give, token for token, what
// each gives alone on a one-at-a-time engine — greedy and seeded sampling, several choices, with
// and without the prefix cache; a request cancelled inside a batch leaves it without disturbing
// the others; a long prompt admitted while others decode is prefilled in chunks that share their
// steps. The last test prints (does not assert) the throughput of eight concurrent streams
// against the same eight served one after another; it is built in Release only, since a
// sanitizer build's timings mean nothing. Under the sanitizers (lily::test::kSanitized) the
// mixed batch is four of the eight requests, with fewer tokens, keeping every kind among them.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "engine/scheduler.h"
#include "fake_backend.h"
#include "model/loader.h"
#include "support/test_support.h"

using namespace lily;
using namespace std::chrono_literals;

namespace {

using Tokens = std::vector<int32_t>;
using Clock = std::chrono::steady_clock;

std::shared_ptr<const ModelWeights> demo_weights() {
  static std::shared_ptr<const ModelWeights> weights = load_model(lily::test::demo_model_dir());
  return weights;
}

/// n ordinary demo-model ids (test::hash_prompt); each `salt` starts 31 places further along the
/// same sequence, so the prompts of different salts share no prefix.
Tokens synthetic_prompt(size_t n, uint32_t salt) {
  return test::hash_prompt(static_cast<int>(n), test::kDemoOrdinaryIds, 31u * salt);
}

struct Engine {
  test::StepLog step_log;
  std::unique_ptr<Scheduler> scheduler;
  Engine(int max_batch, int64_t cache_bytes, int64_t step_tokens = kDefaultStepTokens) {
    EngineOptions o;
    o.max_seq = 2048;
    o.max_queue = 16;
    o.max_batch = max_batch;
    o.step_tokens = step_tokens;
    o.cache = {cache_bytes, 0};
    step_log.attach(o);
    scheduler = std::make_unique<Scheduler>(make_backend(BackendKind::kCpu, demo_weights(), 2, CudaOptions{}), nullptr, o);
  }
  std::vector<StepStats> step_stats() { return step_log.steps(); }
};

/// One request's outcome: per choice, its tokens; and when its first token came.
struct Answer {
  std::vector<Tokens> choices;
  std::vector<FinishReason> reasons;
  Clock::time_point first_token;
  Clock::time_point done;
};

Answer collect(Job& job) {
  Answer a;
  bool seen = false;
  while (true) {
    auto e = job.next_event(120000ms);
    if (!e) throw std::runtime_error("the engine timed out");
    if (e->kind == JobEvent::Kind::kFailed) throw std::runtime_error(e->text);
    if (e->kind == JobEvent::Kind::kToken && !seen) {
      seen = true;
      a.first_token = e->at;
    }
    if (e->kind != JobEvent::Kind::kDone) continue;
    a.choices.push_back(e->result.token_ids);
    a.reasons.push_back(e->result.finish_reason);
    a.done = e->at;
    if (e->result.finish_reason == FinishReason::kCancelled || e->choice + 1 >= job.request().n) return a;
  }
}

JobRequest request(Tokens prompt, int64_t max_tokens) {
  JobRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  return r;
}

/// Eight different requests: prompt lengths from 1 to 200 (several prefill chunks), greedy
/// and seeded sampling, one with two choices, one with message starts. Under the sanitizers
/// four of them with 4 … 9 tokens each: a one-token prompt, a seeded one, the one with two
/// choices (64 prompt tokens instead of 200) and the seeded one with message starts (129).
std::vector<JobRequest> mixed_requests() {
  std::vector<JobRequest> reqs;
  const size_t lengths[] = {1, 12, 40, 200, 7, 129, 25, 64};
  for (uint32_t i = 0; i < 8; ++i) {
    if (lily::test::kSanitized && i != 0 && i != 1 && i != 3 && i != 5) continue;
    const size_t length = lily::test::kSanitized && i == 3 ? 64 : lengths[i];
    JobRequest r = request(synthetic_prompt(length, i), lily::test::kSanitized ? 4 + i : 6 + 2 * i);
    if (i % 2 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.9f;
      r.sampling.seed = 1000 + i;
    }
    if (i == 3) r.n = 2;
    if (i == 5) r.message_starts = {50, 100};
    reqs.push_back(std::move(r));
  }
  return reqs;
}

/// Every request of `reqs` on `engine`, all submitted at once.
std::vector<Answer> serve_together(Engine& engine, const std::vector<JobRequest>& reqs) {
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& r : reqs) jobs.push_back(engine.scheduler->submit(r));
  std::vector<Answer> out;
  for (auto& j : jobs) out.push_back(collect(*j));
  return out;
}

/// Each request alone on a fresh one-at-a-time engine without cache.
std::vector<Answer> serve_alone(const std::vector<JobRequest>& reqs) {
  std::vector<Answer> out;
  for (const auto& r : reqs) {
    Engine engine(1, 0);
    out.push_back(collect(*engine.scheduler->submit(r)));
  }
  return out;
}

}  // namespace

TEST(Batching, ConcurrentRequestsAnswerTokenForTokenAsEachAlone) {
  const std::vector<JobRequest> reqs = mixed_requests();
  const std::vector<Answer> reference = serve_alone(reqs);
  for (int64_t cache : {int64_t{0}, int64_t{64} << 20}) {
    SCOPED_TRACE(cache ? "with the prefix cache" : "without the prefix cache");
    Engine engine(8, cache);
    // Twice: with a cache, the second round resumes from the snapshots of the first.
    for (int round = 0; round < 2; ++round) {
      const std::vector<Answer> together = serve_together(engine, reqs);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(together[i].choices, reference[i].choices) << "request " << i << " round " << round;
        EXPECT_EQ(together[i].choices.size(), static_cast<size_t>(reqs[i].n));
      }
    }
    int widest = 0;
    for (const StepStats& s : engine.step_stats()) widest = std::max(widest, s.rows);
    EXPECT_GE(widest, 2) << "the requests never shared a step";
  }
}

TEST(Batching, ACancelledRequestLeavesTheBatchAndTheOthersAnswerAsAlone) {
  std::vector<JobRequest> reqs;
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back(request(synthetic_prompt(10 + i, 50 + i), 60));
  const std::vector<Answer> reference = serve_alone({reqs[0], reqs[2], reqs[3]});
  Engine engine(8, int64_t{16} << 20);
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& r : reqs) jobs.push_back(engine.scheduler->submit(r));
  for (int i = 0; i < 5; ++i) {
    auto e = jobs[1]->next_event(60000ms);
    ASSERT_TRUE(e && e->kind == JobEvent::Kind::kToken);
  }
  engine.scheduler->cancel(jobs[1]);
  const Answer cancelled = collect(*jobs[1]);
  ASSERT_EQ(cancelled.reasons.size(), 1u);
  EXPECT_EQ(cancelled.reasons[0], FinishReason::kCancelled);
  EXPECT_LT(cancelled.choices[0].size(), 60u);
  const size_t others[] = {0, 2, 3};
  for (size_t k = 0; k < 3; ++k) {
    const Answer a = collect(*jobs[others[k]]);
    EXPECT_EQ(a.choices, reference[k].choices) << "request " << others[k];
    EXPECT_EQ(a.reasons[0], FinishReason::kLength);
  }
  // The engine drops finished jobs from its count right after their last step.
  for (int i = 0; i < 3000 && engine.scheduler->running() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(engine.scheduler->running(), 0);
}

TEST(Batching, ALongPromptAdmittedWhileOthersDecodeSharesTheirSteps) {
  std::vector<JobRequest> short_reqs;
  for (uint32_t i = 0; i < 3; ++i) short_reqs.push_back(request(synthetic_prompt(6, 70 + i), 40));
  const JobRequest long_req = request(synthetic_prompt(400, 80), 4);
  std::vector<JobRequest> all = short_reqs;
  all.push_back(long_req);
  const std::vector<Answer> reference = serve_alone(all);

  Engine engine(8, 0, 64);
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& r : short_reqs) jobs.push_back(engine.scheduler->submit(r));
  for (auto& j : jobs) {
    auto e = j->next_event(60000ms);  // each is decoding
    ASSERT_TRUE(e && e->kind == JobEvent::Kind::kToken);
  }
  jobs.push_back(engine.scheduler->submit(long_req));
  for (size_t i = 0; i < jobs.size(); ++i) {
    Answer a = collect(*jobs[i]);
    EXPECT_EQ(a.choices, reference[i].choices) << "request " << i;
  }
  // The 400-token prompt went in chunks of at most 64 tokens (seven), each in a step with the
  // three decode rows.
  int shared = 0;
  for (const StepStats& s : engine.step_stats()) {
    EXPECT_LE(s.prefill_tokens, 64);
    if (s.prefill_tokens > 0 && s.decode_rows == 3) ++shared;
  }
  EXPECT_GE(shared, 7) << "the long prompt did not share its steps with the decoding requests";
}

#if !LILY_TEST_SANITIZED
// Printed, not asserted (timings depend on the machine): eight concurrent greedy streams against
// the same eight served one after another, all submitted at once. Release builds only (the
// token-for-token equality it also checks is ConcurrentRequestsAnswerTokenForTokenAsEachAlone's).
TEST(Batching, EightConcurrentStreamsAgainstServedOneAfterAnother) {
  constexpr int kTokens = 48;
  std::vector<JobRequest> reqs;
  for (uint32_t i = 0; i < 8; ++i) reqs.push_back(request(synthetic_prompt(32, 90 + i), kTokens));
  auto measure = [&](int max_batch, std::vector<Answer>& answers) {
    Engine engine(max_batch, 0);
    engine.scheduler->submit(request(synthetic_prompt(8, 99), 4));  // warm-up
    std::this_thread::sleep_for(200ms);
    const auto t0 = Clock::now();
    answers = serve_together(engine, reqs);
    Clock::time_point last_first = t0, end = t0;
    int64_t tokens = 0;
    for (const Answer& a : answers) {
      last_first = std::max(last_first, a.first_token);
      end = std::max(end, a.done);
      tokens += static_cast<int64_t>(a.choices[0].size());
    }
    const double wall = std::chrono::duration<double>(end - t0).count();
    return std::pair{tokens / wall, std::chrono::duration<double>(last_first - t0).count()};
  };
  std::vector<Answer> serial_answers, batched_answers;
  const auto [serial_rate, serial_last_first] = measure(1, serial_answers);
  const auto [batched_rate, batched_last_first] = measure(8, batched_answers);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(batched_answers[i].choices, serial_answers[i].choices) << i;
  std::printf(
      "[ batching ] 8 streams x %d tokens (32-token prompts), demo model, 2 threads: serial %.1f tok/s, last first token %.3f s; "
      "batched %.1f tok/s, last first token %.3f s; aggregate ratio %.2fx, first-token ratio %.2f\n",
      kTokens, serial_rate, serial_last_first, batched_rate, batched_last_first, batched_rate / serial_rate,
      batched_last_first / serial_last_first);
}
#endif
