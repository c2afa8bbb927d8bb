// The engine thread and its bounded FIFO queue over a gated fake backend (also: host-tier copies
// made in the background never hold up a step or the next job).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <tuple>
#include <thread>

#include "engine/option_error.h"
#include "engine/scheduler.h"
#include "fake_backend.h"

using namespace lily;
using namespace std::chrono_literals;
using lily::test::FakeBackend;
using lily::test::StepLog;

namespace {

JobRequest job(std::vector<int32_t> prompt, int64_t max_tokens) {
  JobRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  return r;
}

/// Drains events until kDone/kFailed; returns it and the number of token events seen.
std::pair<JobEvent, int> finish(Job& j) {
  int tokens = 0;
  while (true) {
    auto e = j.next_event(5000ms);
    if (!e) throw std::runtime_error("timed out waiting for the engine");
    if (e->kind == JobEvent::Kind::kToken) {
      ++tokens;
      continue;
    }
    return {std::move(*e), tokens};
  }
}

struct Harness {
  FakeBackend* backend;
  StepLog step_log;  ///< every step's stats (EngineOptions::on_step); outlives the scheduler
  std::unique_ptr<Scheduler> scheduler;
  /// max_batch 1 (one job at a time) unless given.
  explicit Harness(int max_queue, int64_t cache_bytes = 1 << 20, int max_batch = 1, int64_t step_tokens = 256) {
    auto b = std::make_unique<FakeBackend>();
    backend = b.get();
    EngineOptions o;
    o.max_seq = 128;
    o.max_queue = max_queue;
    o.max_batch = max_batch;
    o.step_tokens = step_tokens;
    o.cache = {cache_bytes, 0};
    step_log.attach(o);
    scheduler = std::make_unique<Scheduler>(std::move(b), nullptr, o);
  }
  /// Opens the fake backend's gates before the scheduler stops, so that a test that fails
  /// while the engine waits at a gate ends with its failure instead of hanging in stop().
  ~Harness() {
    backend->open_gate();
    backend->open_copy_gate();
  }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;
  std::vector<StepStats> step_stats() { return step_log.steps(); }
};

/// Waits (up to 30 s: sanitizer builds on busy CI machines are slow) until the engine thread
/// has taken a job; fails the test if it never does.
void wait_until_running(Scheduler& s) {
  for (int i = 0; i < 15000 && s.running() == 0; ++i) std::this_thread::sleep_for(2ms);
  ASSERT_GT(s.running(), 0) << "the engine thread never started the job";
}

/// Closes the fake backend's gate and starts a job of `max_tokens` that blocks the engine
/// thread until the gate opens; returns that running job.
auto occupy_engine(Harness& h, int max_tokens = 2) {
  h.backend->close_gate();
  auto running = h.scheduler->submit(job({1}, max_tokens));
  wait_until_running(*h.scheduler);
  return running;
}

}  // namespace

TEST(Scheduler, RunsAJobAndStreamsEveryToken) {
  Harness h(4);
  auto j = h.scheduler->submit(job({1, 2, 3}, 5));
  auto [done, tokens] = finish(*j);
  ASSERT_EQ(done.kind, JobEvent::Kind::kDone);
  EXPECT_EQ(tokens, 5);
  EXPECT_EQ(done.result.token_ids.size(), 5u);
}

TEST(Scheduler, QueueFullIsRejectedAndFifoOrderKept) {
  Harness h(1);
  auto running = occupy_engine(h);
  auto queued = h.scheduler->submit(job({2}, 2));
  EXPECT_EQ(h.scheduler->queue_depth(), 1);
  EXPECT_THROW(h.scheduler->submit(job({3}, 2)), QueueFullError);
  h.backend->open_gate();
  EXPECT_EQ(finish(*running).first.kind, JobEvent::Kind::kDone);
  EXPECT_EQ(finish(*queued).first.kind, JobEvent::Kind::kDone);
  EXPECT_EQ(h.scheduler->queue_depth(), 0);
  // Room again once the queue drained.
  EXPECT_EQ(finish(*h.scheduler->submit(job({4}, 1))).first.kind, JobEvent::Kind::kDone);
}

TEST(Scheduler, ZeroQueueStillAcceptsWhenIdle) {
  Harness h(0);
  auto first = occupy_engine(h);
  EXPECT_THROW(h.scheduler->submit(job({2}, 2)), QueueFullError);
  h.backend->open_gate();
  EXPECT_EQ(finish(*first).first.kind, JobEvent::Kind::kDone);
}

TEST(Scheduler, CancellingARunningJobStopsItWithinOneStep) {
  Harness h(4);
  h.backend->decode_delay = 2ms;
  auto j = h.scheduler->submit(job({1, 2}, 60));
  auto first = j->next_event(5000ms);
  ASSERT_TRUE(first && first->kind == JobEvent::Kind::kToken);
  h.scheduler->cancel(j);
  auto [done, tokens] = finish(*j);
  ASSERT_EQ(done.kind, JobEvent::Kind::kDone);
  EXPECT_EQ(done.result.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(done.result.token_ids.size(), 60u);
}

TEST(Scheduler, CancellingAQueuedJobRemovesIt) {
  Harness h(2);
  auto running = occupy_engine(h);
  auto queued = h.scheduler->submit(job({2}, 2));
  h.scheduler->cancel(queued);
  EXPECT_EQ(h.scheduler->queue_depth(), 0);
  auto [done, tokens] = finish(*queued);
  EXPECT_EQ(done.result.finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(tokens, 0);
  h.backend->open_gate();
  finish(*running);
}

TEST(Scheduler, StartTimeIsSetWhenTheEngineTakesAJob) {
  Harness h(2);
  auto running = occupy_engine(h);
  ASSERT_TRUE(running->started_at().has_value());
  const auto submitted = std::chrono::steady_clock::now();
  auto queued = h.scheduler->submit(job({2}, 2));
  auto cancelled = h.scheduler->submit(job({3}, 2));
  EXPECT_FALSE(queued->started_at().has_value());  // still waiting
  h.scheduler->cancel(cancelled);
  std::this_thread::sleep_for(5ms);
  h.backend->open_gate();
  finish(*running);
  const auto [done, tokens] = finish(*queued);
  ASSERT_TRUE(queued->started_at().has_value());
  EXPECT_GE(*queued->started_at() - submitted, 5ms);  // it waited behind the gated job
  EXPECT_LE(*queued->started_at(), done.at);
  EXPECT_EQ(finish(*cancelled).first.result.finish_reason, FinishReason::kCancelled);
  EXPECT_FALSE(cancelled->started_at().has_value());  // never left the queue for the engine
}

TEST(Scheduler, RejectsRequestsThatDoNotFitMaxSeq) {
  Harness h(2);
  EXPECT_THROW(h.scheduler->submit(job(std::vector<int32_t>(125, 1), 5)), Error);
}

TEST(Scheduler, StopFailsQueuedJobsAndRefusesNewOnes) {
  Harness h(2);
  auto running = occupy_engine(h, 3);
  auto queued = h.scheduler->submit(job({2}, 3));
  std::thread opener([&] {
    std::this_thread::sleep_for(20ms);
    h.backend->open_gate();
  });
  h.scheduler->stop(2000ms);
  opener.join();
  EXPECT_EQ(finish(*queued).first.kind, JobEvent::Kind::kFailed);
  EXPECT_EQ(finish(*running).first.kind, JobEvent::Kind::kDone);
  EXPECT_THROW(h.scheduler->submit(job({3}, 1)), ShuttingDownError);
}

TEST(Scheduler, SecondIdenticalRequestHitsTheCache) {
  Harness h(2);
  auto a = finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3))).first;
  auto b = finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3))).first;
  EXPECT_EQ(a.result.cached_tokens, 0);
  EXPECT_EQ(b.result.cached_tokens, 3);
  EXPECT_EQ(a.result.token_ids, b.result.token_ids);
  EXPECT_EQ(h.scheduler->cache_stats().hits, 1);
}

TEST(Scheduler, AHitIsResumedWithRoomForThePromptAndTheAnswer) {
  Harness h(2);  // max_seq 128
  finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3)));
  EXPECT_EQ(h.backend->resumes, 0);  // a miss
  // Resumed where the first request's prompt − 1 was snapshotted, then the second's.
  EXPECT_EQ(finish(*h.scheduler->submit(job({1, 2, 3, 4, 5}, 7))).first.result.cached_tokens, 3);
  EXPECT_EQ(finish(*h.scheduler->submit(job({1, 2, 3, 4, 6, 7}, 122))).first.result.cached_tokens, 4);
  EXPECT_EQ(h.backend->resume_capacities, (std::vector<int64_t>{5 + 7, 6 + 122}));
  JobRequest r = job(std::vector<int32_t>(3000, 1), 5000);
  EXPECT_EQ(resume_capacity(r, 1 << 20), 3000 + kResumeRoom);
  EXPECT_EQ(resume_capacity(r, 3500), 3500);
  r.max_tokens = 10;
  EXPECT_EQ(resume_capacity(r, 1 << 20), 3010);
}

TEST(Scheduler, DoneEventsSayWhereTheEngineSpentTheTime) {
  Harness h(2);
  // A miss that prefills, snapshots and answers one token: no decode step ran.
  const JobTimings a = finish(*h.scheduler->submit(job({1, 2, 3, 4}, 1))).first.timings;
  // The same prompt again: a hit, no fresh state; three tokens, so two decode steps.
  const JobTimings b = finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3))).first.timings;
  // What did not happen is never charged (the durations themselves are printed, not checked).
  EXPECT_EQ(a.decode_seconds, 0.0);
  EXPECT_EQ(b.new_state_seconds, 0.0);
  std::printf("[job timing] miss: lookup %.3f ms, new state %.3f ms, snapshots %.3f ms, prefill %.3f ms, store %.3f ms; "
              "hit: lookup %.3f ms, prefill %.3f ms, decode %.3f ms\n",
              1000 * a.cache_lookup_seconds, 1000 * a.new_state_seconds, 1000 * a.snapshot_seconds,
              1000 * a.prefill_seconds, 1000 * a.cache_store_seconds, 1000 * b.cache_lookup_seconds,
              1000 * b.prefill_seconds, 1000 * b.decode_seconds);
}

TEST(Scheduler, AnIdenticalRetryCopiesItsStateOnceOnly) {
  Harness h(2);
  finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3)));
  EXPECT_EQ(h.backend->clones, 1);  // the snapshot before the last prompt token
  const size_t snapshots = h.scheduler->cache_stats().device.snapshots;
  // A retry resumes at that snapshot: the resumed copy is the only one (the snapshot it came
  // from is not copied back into the cache), and every retry hits it again.
  for (int retry = 1; retry <= 2; ++retry) {
    EXPECT_EQ(finish(*h.scheduler->submit(job({1, 2, 3, 4}, 3))).first.result.cached_tokens, 3);
    EXPECT_EQ(h.backend->clones, 1 + retry);
    EXPECT_EQ(h.backend->resumes, retry);
  }
  EXPECT_EQ(h.scheduler->cache_stats().device.snapshots, static_cast<int64_t>(snapshots));
}

TEST(Scheduler, TellsTheBackendTheHostTierBudgetOnceAtStart) {
  for (const int64_t host : {int64_t{0}, int64_t{3} << 20}) {
    auto owned = std::make_unique<FakeBackend>();
    FakeBackend& b = *owned;
    EngineOptions o;
    o.max_seq = 128;
    o.cache = {1 << 20, host};
    Scheduler s(std::move(owned), nullptr, o);
    finish(*s.submit(job({1, 2, 3}, 2)));
    // Without a host tier there is nothing to reserve for.
    EXPECT_EQ(b.host_reservations, host > 0 ? std::vector<int64_t>{host} : std::vector<int64_t>{});
  }
}

TEST(Scheduler, WhatMetricsReadsAnswersWhileTheEngineWorksUnderTheCacheLock) {
  // A 1010-byte device tier holds one 2-token snapshot: the job's other snapshots go to the host
  // tier through copy_to_host, made on the engine thread under the cache's lock.
  auto owned = std::make_unique<FakeBackend>();
  FakeBackend& b = *owned;
  EngineOptions o;
  o.max_seq = 128;
  o.cache = {1010, 1 << 20};
  Scheduler s(std::move(owned), nullptr, o);
  b.close_copy_gate();
  auto j = s.submit(job({1, 2, 3}, 2));
  const bool at_gate = b.wait_until_copy_at_gate(30000ms);
  // The gauges /metrics reads, from another thread. One that waited for the engine would wait
  // for the gate: after 20 s the gate opens and the test fails instead of hanging.
  auto gauges = std::async(std::launch::async, [&] {
    const SessionCacheStats cache = s.cache_stats();
    return std::tuple{s.queue_depth(), s.running(), s.batch_size(), cache};
  });
  const bool answered = gauges.wait_for(20s) == std::future_status::ready;
  b.open_copy_gate();
  const auto [queued, running, batch, cache] = gauges.get();
  finish(*j);
  ASSERT_TRUE(at_gate) << "the engine never made a host copy";
  EXPECT_TRUE(answered) << "a gauge waited for the engine's host copy";
  EXPECT_EQ(queued, 0);
  EXPECT_EQ(running, 1);
  EXPECT_EQ(cache.host.snapshots, 0);  // read before the copy that was under way
  EXPECT_GE(s.cache_stats().host.snapshots, 1);
}

TEST(Scheduler, PreparesWhileIdleAPieceAtATimeUntilTheBackendIsDone) {
  Harness h(2);
  h.backend->idle_pieces = 3;  // read by the engine thread only after the job below was submitted
  auto calls_reach = [&](int n) {
    for (int i = 0; i < 2500 && h.backend->idle_calls_now() < n; ++i) std::this_thread::sleep_for(2ms);
    return h.backend->idle_calls_now();
  };
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(h.backend->idle_calls_now(), 0);  // nothing ran yet: nothing to prepare for
  finish(*h.scheduler->submit(job({1, 2, 3}, 2)));
  EXPECT_EQ(calls_reach(3), 3);  // after the job: pieces until the backend says it is done
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(h.backend->idle_calls_now(), 3);  // then it waits for work
  finish(*h.scheduler->submit(job({4, 5, 6}, 2)));
  EXPECT_EQ(calls_reach(4), 4);  // one more idle spell: one more call, done at once
}

TEST(Scheduler, MessageStartsSplitThePrefillAndBecomeResumePoints) {
  Harness h(2);
  JobRequest a = job({1, 2, 3, 4, 5, 6, 7, 8}, 2);
  a.message_starts = {3, 6};
  EXPECT_EQ(finish(*h.scheduler->submit(a)).first.result.cached_tokens, 0);
  EXPECT_EQ(h.backend->prefill_sizes, (std::vector<int64_t>{3, 3, 1, 1}));
  // Another conversation that shares the first three tokens (its "system message") resumes there.
  JobRequest b = job({1, 2, 3, 9, 9, 9, 9}, 2);
  b.message_starts = {3};
  EXPECT_EQ(finish(*h.scheduler->submit(b)).first.result.cached_tokens, 3);
  // Out of order or outside the prompt: refused with the reason.
  for (std::vector<int64_t> bad : {std::vector<int64_t>{0}, {5, 5}, {6, 3}, {8}}) {
    JobRequest r = job({1, 2, 3, 4, 5, 6, 7, 8}, 1);
    r.message_starts = bad;
    try {
      h.scheduler->submit(r);
      ADD_FAILURE() << "accepted " << bad.front();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("message_starts must be strictly increasing positions in [1, 8)"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Scheduler, AtMostEightMessageSnapshotsBeyondTheCachedPart) {
  JobRequest r;
  r.prompt.assign(100, 1);
  for (int64_t p = 5; p <= 99; p += 5) r.message_starts.push_back(p);  // 5, 10, …, 95 (and not 99)
  EXPECT_EQ(message_snapshots(r, 0), (std::vector<int64_t>{5, 65, 70, 75, 80, 85, 90, 95}));
  EXPECT_EQ(message_snapshots(r, 70), (std::vector<int64_t>{75, 80, 85, 90, 95}));
  r.message_starts = {10, 99};  // 99 = prompt − 1: the usual resume point, not taken twice
  EXPECT_EQ(message_snapshots(r, 0), (std::vector<int64_t>{10}));
}

// Once the backend reports that its memory-mapped weights changed on disk, the
// scheduler refuses every further request (ModelUnavailableError, a ShuttingDownError, which the
// server answers with 503) instead of running the engine over pages that may fault with SIGBUS.
TEST(Scheduler, ChangedWeightsRefuseNewRequestsForGood) {
  Harness h(4);
  EXPECT_EQ(finish(*h.scheduler->submit(job({1}, 1))).first.kind, JobEvent::Kind::kDone);
  EXPECT_FALSE(h.scheduler->model_unavailable());
  const int prefills = h.backend->prefill_calls;
  h.backend->set_weights_problem("/m/model.safetensors was truncated from 100 to 8 bytes");
  try {
    h.scheduler->submit(job({2}, 1));
    FAIL() << "submit accepted a request over changed weights";
  } catch (const ModelUnavailableError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("/m/model.safetensors was truncated from 100 to 8 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("restart lily serve"), std::string::npos) << what;
  }
  // A 503-class error: the server maps ShuttingDownError to 503.
  EXPECT_THROW(h.scheduler->submit(job({2}, 1)), ShuttingDownError);
  // Sticky: the mapping may already have been read in part, so a restored file does not help.
  h.backend->set_weights_problem(std::nullopt);
  EXPECT_THROW(h.scheduler->submit(job({3}, 1)), ModelUnavailableError);
  EXPECT_TRUE(h.scheduler->model_unavailable());
  EXPECT_EQ(h.backend->prefill_calls, prefills) << "the engine ran over changed weights";
}

TEST(Scheduler, AQueuedJobFailsWhenTheWeightsChangedWhileItWaited) {
  Harness h(4);
  auto running = occupy_engine(h);
  auto queued = h.scheduler->submit(job({2}, 1));
  h.backend->set_weights_problem("/m/model.safetensors was modified (its mtime changed)");
  h.backend->open_gate();
  finish(*running);  // the running job fails at its next step (below)
  const int prefills = h.backend->prefill_calls;
  auto [event, tokens] = finish(*queued);
  EXPECT_EQ(event.kind, JobEvent::Kind::kFailed);
  EXPECT_TRUE(event.model_unavailable) << "a changed file is not an internal error";
  EXPECT_EQ(tokens, 0);
  EXPECT_NE(event.text.find("was modified"), std::string::npos) << event.text;
  EXPECT_EQ(h.backend->prefill_calls, prefills);
}

// A change while a job runs: the step already inside the backend finishes (its first token),
// then the job fails before the next step instead of running the backend over the changed
// mapping (where a truncated file faults with SIGBUS). One stat(2) per file between two steps.
TEST(Scheduler, ARunningJobFailsAtItsNextStepOnceTheWeightsChanged) {
  Harness h(4);
  auto running = occupy_engine(h, 50);
  ASSERT_TRUE(h.backend->wait_until_at_gate(30000ms)) << "the first step (the prefill) never began";
  h.backend->set_weights_problem("/m/model.safetensors was truncated from 100 to 8 bytes");
  h.backend->open_gate();
  auto [event, tokens] = finish(*running);
  EXPECT_EQ(event.kind, JobEvent::Kind::kFailed);
  EXPECT_TRUE(event.model_unavailable);
  EXPECT_NE(event.text.find("was truncated from 100 to 8 bytes"), std::string::npos) << event.text;
  EXPECT_NE(event.text.find("restart lily serve"), std::string::npos) << event.text;
  EXPECT_EQ(tokens, 1) << "only the step that was running when the file changed";
  EXPECT_EQ(h.backend->steps, 1) << "the backend stepped over changed weights";
  EXPECT_EQ(h.backend->decode_calls, 0);
  // Later requests are refused at submit.
  EXPECT_THROW(h.scheduler->submit(job({2}, 1)), ModelUnavailableError);
}

// ---- continuous batching ------------------------------------------------------------------------

namespace {

/// The tokens `r` gives alone on a fresh one-job engine.
std::vector<int32_t> alone(const JobRequest& r) {
  Harness h(4, 0);
  auto [done, tokens] = finish(*h.scheduler->submit(r));
  EXPECT_EQ(done.kind, JobEvent::Kind::kDone);
  return done.result.token_ids;
}

std::vector<int32_t> count_up(int n, int32_t from) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

}  // namespace

TEST(SchedulerBatching, JobsWaitingTogetherShareEveryStepAndAnswerAsAlone) {
  Harness h(8, 1 << 20, 4);
  auto first = occupy_engine(h, 6);
  std::vector<JobRequest> reqs = {job({7, 8, 9}, 6), job(count_up(20, 100), 5), job({3}, 7)};
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& r : reqs) jobs.push_back(h.scheduler->submit(r));
  h.backend->open_gate();
  EXPECT_EQ(finish(*first).first.result.token_ids, alone(job({1}, 6)));
  for (size_t i = 0; i < jobs.size(); ++i) EXPECT_EQ(finish(*jobs[i]).first.result.token_ids, alone(reqs[i])) << i;
  int widest = 0;
  for (const StepStats& st : h.step_stats()) widest = std::max(widest, st.rows);
  EXPECT_EQ(widest, 4);
  EXPECT_EQ(h.scheduler->running(), 0);
  EXPECT_EQ(h.scheduler->batch_size(), 0);
}

TEST(SchedulerBatching, JobsAdmittedWhileAnotherDecodesResumeFromItsPromptSnapshots) {
  // A conversation is still decoding when two more requests arrive: another conversation with
  // the same first message and the very same request again. Both resume from the snapshots it
  // took during its prefill (stored then, not when it ends), and every answer is the one it
  // gives alone.
  Harness h(8, 1 << 20, 4);
  h.backend->decode_delay = 10ms;  // a's 40 tokens take 0.4 s: it still decodes below
  JobRequest a = job({1, 2, 3, 4, 5, 6}, 40);
  a.message_starts = {3};
  auto ja = h.scheduler->submit(a);
  auto first = ja->next_event(5000ms);  // a's prefill is over: its snapshots are taken
  ASSERT_TRUE(first && first->kind == JobEvent::Kind::kToken);
  h.backend->close_gate();
  ASSERT_TRUE(h.backend->wait_until_at_gate(5000ms));  // a is in the middle of its answer
  JobRequest b = job({1, 2, 3, 9, 9}, 4);
  b.message_starts = {3};
  auto jb = h.scheduler->submit(b);
  JobRequest again = a;
  again.max_tokens = 4;
  auto jsame = h.scheduler->submit(again);
  h.backend->open_gate();
  const JobEvent done_b = finish(*jb).first, done_same = finish(*jsame).first;
  const JobEvent done_a = finish(*ja).first;
  EXPECT_EQ(done_b.result.cached_tokens, 3);
  EXPECT_EQ(done_same.result.cached_tokens, 5);
  EXPECT_EQ(done_a.result.cached_tokens, 0);
  // a was still running when they were admitted: they finished first.
  EXPECT_LT(done_b.at, done_a.at);
  EXPECT_LT(done_same.at, done_a.at);
  EXPECT_EQ(done_b.result.token_ids, alone(b));
  ASSERT_EQ(done_a.result.token_ids.size(), 40u);
  EXPECT_EQ(done_same.result.token_ids, std::vector<int32_t>(done_a.result.token_ids.begin(),
                                                             done_a.result.token_ids.begin() + 4));
  EXPECT_EQ(done_a.result.token_ids, alone(a));
  EXPECT_GT(done_a.timings.cache_store_seconds, 0.0);
}

TEST(SchedulerBatching, AdmitsOldestFirstAndNeverMoreThanMaxBatch) {
  Harness h(8, 0, 2);
  auto first = occupy_engine(h, 3);
  std::vector<std::shared_ptr<Job>> jobs;
  for (int32_t i = 0; i < 4; ++i) jobs.push_back(h.scheduler->submit(job({10 + i}, 3 + i)));
  EXPECT_EQ(h.scheduler->queue_depth(), 4);
  h.backend->open_gate();
  finish(*first);
  for (auto& j : jobs) EXPECT_EQ(finish(*j).first.kind, JobEvent::Kind::kDone);
  for (size_t i = 1; i < jobs.size(); ++i) EXPECT_LE(*jobs[i - 1]->started_at(), *jobs[i]->started_at()) << i;
  for (const StepStats& st : h.step_stats()) EXPECT_LE(st.rows, 2);
}

TEST(SchedulerBatching, FreeBatchSlotsDoNotCountAgainstTheQueue) {
  Harness h(1, 0, 3);
  auto first = occupy_engine(h);  // one slot taken, two free: 1 + 2 may wait
  std::vector<std::shared_ptr<Job>> jobs;
  for (int i = 0; i < 3; ++i) jobs.push_back(h.scheduler->submit(job({2}, 2)));
  EXPECT_THROW(h.scheduler->submit(job({3}, 2)), QueueFullError);
  h.backend->open_gate();
  finish(*first);
  for (auto& j : jobs) EXPECT_EQ(finish(*j).first.kind, JobEvent::Kind::kDone);
}

TEST(SchedulerBatching, ACancelledJobLeavesTheBatchAndTheOthersAnswerAsAlone) {
  Harness h(8, 1 << 20, 4);
  h.backend->decode_delay = 1ms;
  std::vector<JobRequest> reqs = {job({1, 2}, 40), job({5, 6, 7}, 40), job({9}, 40)};
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& r : reqs) jobs.push_back(h.scheduler->submit(r));
  auto first = jobs[1]->next_event(5000ms);
  ASSERT_TRUE(first && first->kind == JobEvent::Kind::kToken);
  h.scheduler->cancel(jobs[1]);
  auto [cancelled, seen] = finish(*jobs[1]);
  EXPECT_EQ(cancelled.result.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(cancelled.result.token_ids.size(), 40u);
  for (size_t i : {0u, 2u}) {
    auto [done, tokens] = finish(*jobs[i]);
    EXPECT_EQ(done.result.finish_reason, FinishReason::kLength);
    EXPECT_EQ(done.result.token_ids, alone(reqs[i])) << i;
  }
}

TEST(SchedulerBatching, ALongPromptIsPrefilledInChunksWhileOthersDecode) {
  Harness h(8, 0, 2, 8);
  h.backend->decode_delay = 1ms;
  auto decoding = h.scheduler->submit(job({4, 5}, 100));
  auto e = decoding->next_event(5000ms);
  ASSERT_TRUE(e && e->kind == JobEvent::Kind::kToken);
  const JobRequest long_request = job(count_up(61, 200), 3);
  auto long_job = h.scheduler->submit(long_request);
  auto [long_done, n] = finish(*long_job);
  EXPECT_EQ(long_done.result.token_ids, alone(long_request));
  finish(*decoding);
  // Cut at multiples of 8 (and before the last token): 8 × 7, then 4, then 1.
  std::vector<int64_t> sizes(h.backend->prefill_sizes.end() - 9, h.backend->prefill_sizes.end());
  EXPECT_EQ(sizes, (std::vector<int64_t>{8, 8, 8, 8, 8, 8, 8, 4, 1}));
  int shared = 0;
  for (const StepStats& st : h.step_stats()) {
    if (st.decode_rows == 1 && st.prefill_tokens > 0) ++shared;
    EXPECT_LE(st.prefill_tokens, 8);
  }
  EXPECT_EQ(shared, 9) << "the decoding job did not advance in every step of the long prefill";
}

TEST(SchedulerBatching, MaxBatchAndStepTokensAreValidated) {
  for (int bad : {-1, 65}) {
    EngineOptions o;
    o.max_seq = 16;
    o.max_batch = bad;
    try {
      Scheduler s(std::make_unique<FakeBackend>(), nullptr, o);
      ADD_FAILURE() << "accepted max_batch " << bad;
    } catch (const OptionError& e) {
      // The engine's terms: the field, not a command-line flag (the CLI renames it).
      EXPECT_EQ(e.field(), "max_batch");
      EXPECT_EQ(std::string(e.what()), "max_batch " + std::to_string(bad) +
                                           " is outside [1, 64]: the fake backend runs at most 64 sequences per step");
    }
  }
  EngineOptions o;
  o.max_seq = 16;
  o.step_tokens = 0;
  try {
    Scheduler s(std::make_unique<FakeBackend>(), nullptr, o);
    ADD_FAILURE() << "accepted step_tokens 0";
  } catch (const OptionError& e) {
    EXPECT_EQ(std::string(e.what()), "step_tokens must be at least 1, got 0");
    EXPECT_EQ(e.message_naming("--step-tokens"), "--step-tokens must be at least 1, got 0");
  }
  o.step_tokens = 1;
  Scheduler defaults(std::make_unique<FakeBackend>(), nullptr, o);
  EXPECT_EQ(defaults.max_batch(), 8);  // the base Backend's preferred_max_batch()
  auto one = std::make_unique<FakeBackend>();
  one->max_rows = 1;
  Scheduler single(std::move(one), nullptr, o);
  EXPECT_EQ(single.max_batch(), 1);
}

TEST(SchedulerBatching, PromptTokensOutsideTheVocabularyAreRefused) {
  Harness h(2);
  try {
    h.scheduler->submit(job({1, 1000}, 1));
    FAIL() << "accepted token 1000";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("prompt token 1 is 1000, outside the vocabulary [0, 1000)"),
              std::string::npos)
        << e.what();
  }
}

TEST(SchedulerBatching, HostTierCopiesNeverHoldUpTheBatchOrTheNextJob) {
  auto owned = std::make_unique<FakeBackend>();
  FakeBackend& b = *owned;
  b.concurrent_host_copies = true;  // the scheduler makes the cache copy in the background
  b.close_copy_gate();              // every host copy waits until the gate opens
  EngineOptions o;
  o.max_seq = 128;
  o.max_queue = 4;
  o.max_batch = 2;
  o.cache = {0, 1 << 20};  // every snapshot goes to the host tier
  Scheduler s(std::move(owned), nullptr, o);
  struct OpenAtExit {  // a failing test must not leave the helper thread at the gate
    FakeBackend& b;
    ~OpenAtExit() { b.open_copy_gate(); }
  } open_at_exit{b};
  const JobRequest a = job({1, 2, 3, 4, 5}, 2), other = job({7, 8, 9}, 8);
  auto ja = s.submit(a);
  auto jo = s.submit(other);
  const JobEvent done_a = finish(*ja).first;
  ASSERT_TRUE(b.wait_until_copy_at_gate(5000ms));  // a's snapshots wait for their copies,
  const JobEvent done_other = finish(*jo).first;   // while the other row runs to its end
  EXPECT_EQ(done_other.result.token_ids, alone(other));
  // A new job that resumes from a snapshot still being copied runs too, and answers as alone.
  const JobEvent again = finish(*s.submit(a)).first;
  EXPECT_EQ(again.result.cached_tokens, 4);
  EXPECT_EQ(again.result.token_ids, done_a.result.token_ids);
  EXPECT_EQ(b.host_copies.load(), 0);
  EXPECT_GT(s.cache_stats().host_copies_pending, 0);
  b.open_copy_gate();
  for (int i = 0; i < 15000 && s.cache_stats().host_copies_pending > 0; ++i) std::this_thread::sleep_for(2ms);
  ASSERT_EQ(s.cache_stats().host_copies_pending, 0);
  // Once copied, the job resumes from the host copy, with the same answer.
  const JobEvent copied = finish(*s.submit(a)).first;
  EXPECT_EQ(copied.result.cached_tokens, 4);
  EXPECT_EQ(copied.result.token_ids, done_a.result.token_ids);
  EXPECT_GT(b.host_restores, 0);
  EXPECT_EQ(done_a.result.token_ids, alone(a));
  EXPECT_LE(s.cache_stats().host.bytes, s.cache_stats().host.budget);
}
