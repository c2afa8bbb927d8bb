// The engine thread and its bounded FIFO queue. HTTP threads submit jobs
// (token ids + settings) and read back events; the one engine thread owns the Backend and the
// session cache and runs continuous batching: between two steps it admits waiting jobs (oldest
// first) up to max_batch running ones, and every step (Backend::step) advances each running job
// by one row: one decode token, or the next prefill chunk of its prompt while the step's token
// budget lasts. A job leaves the batch when it finishes or, cancelled, at the next step. Every
// answer is token for token what the same request gives alone (the backend's batch invariance,
// and prefill cuts that depend only on the request). Once nothing runs or waits, the engine lets
// the backend prepare for later requests (Backend::prepare_while_idle), a piece at a time.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <atomic>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/session_cache.h"
#include "text/tokenizer.h"

namespace lily {

/// Thrown by Scheduler::submit when the queue already holds max_queue waiting jobs.
class QueueFullError : public Error {
 public:
  using Error::Error;
};

/// Thrown by Scheduler::submit after stop() began.
class ShuttingDownError : public Error {
 public:
  using Error::Error;
};

/// Thrown by Scheduler::submit once the backend's weights can no longer be used (a memory-mapped
/// safetensors file was truncated, rewritten, replaced or removed: Backend::weights_changed).
/// Permanent until restart. Derives from ShuttingDownError so that a server mapping that to
/// 503 refuses these requests with a 503 too; a server may catch it first for its own code.
class ModelUnavailableError : public ShuttingDownError {
 public:
  using ShuttingDownError::ShuttingDownError;
};

/// What the engine needs to run one request: only token ids and settings.
struct JobRequest {
  std::vector<int32_t> prompt;             ///< whole prompt (template applied)
  int64_t max_tokens = 0;                  ///< ≥ 1; prompt + max_tokens ≤ max_seq
  std::vector<std::string> stop_strings;   ///< OpenAI `stop`
  /// Optional: makes each choice's GenerationParams::stop_after_text (called once per choice, on
  /// the engine thread, so that every choice starts from a fresh state).
  std::function<std::function<bool(std::string_view)>()> stop_after_text;
  std::optional<std::string> cache_key;    ///< OpenAI `prompt_cache_key`
  /// Where the prompt's messages begin (chat prompts: the token positions of each message start
  /// but the first; empty for a plain prompt): strictly increasing, each in [1, prompt size).
  /// The prefill stops at each of them and the prefix cache snapshots some of them (the first,
  /// and the last kMessageSnapshots − 1 beyond the cached part), so that conversations sharing a
  /// system prompt or earlier turns resume there.
  std::vector<int64_t> message_starts;
  /// How tokens are chosen; `sampling.seed` is the seed of choice 0, choice i runs with
  /// choice_seed(sampling.seed, i) (engine/sampler.h).
  SamplingParams sampling;
  int n = 1;                               ///< choices (1 … 8), generated one after another
  int logprobs = -1;                       ///< GenerationParams::logprobs
  std::vector<int32_t> kept_special_ids;  ///< GenerationParams::kept_special_ids of every choice
  int64_t min_tokens = 0;                  ///< GenerationParams::min_tokens of every choice
  bool ignore_eos = false;                 ///< true: the checkpoint's stop tokens (EngineOptions::stop_ids) unused
  std::vector<int32_t> stop_ids;           ///< more stop tokens of this request (kept with ignore_eos)
  std::shared_ptr<const JsonSchema> json_schema;  ///< GenerationParams::json_schema of every choice
  int32_t json_after_id = -1;  ///< GenerationParams::json_after_id of every choice
  std::shared_ptr<const ToolCallGrammar> tool_call;  ///< GenerationParams::tool_call of every choice
};

/// Where the engine spent one choice's time, in seconds (JobEvent::timings of its kDone; the
/// server adds them to its phase metrics). Step times are whole steps: a step that also ran
/// other jobs' rows counts fully for each of them.
struct JobTimings {
  double cache_lookup_seconds = 0;  ///< SessionCache::acquire: the lookup and, on a hit, the state's restore
  double new_state_seconds = 0;     ///< Backend::new_state on a miss
  double snapshot_seconds = 0;      ///< prefix-cache snapshots copied at prompt positions during the prefill
  double prefill_seconds = 0;       ///< steps that ran a prefill chunk of this choice (the last one gives its first token)
  double decode_seconds = 0;        ///< steps that ran a decode row of it
  /// SessionCache::store of its snapshots: each one taken during the prefill as it is taken (so
  /// that requests admitted meanwhile can resume from it), and its final state once it finished.
  double cache_store_seconds = 0;
};

/// One event from the engine to the submitting thread.
struct JobEvent {
  enum class Kind { kToken, kDone, kFailed };
  Kind kind = Kind::kToken;
  int choice = 0;          ///< kToken, kDone: which of the request's n choices
  int32_t token = -1;      ///< kToken: the generated id
  std::string text;        ///< kToken: newly released text; kFailed: the internal error
  /// kFailed: the job failed because the weights changed on disk (the text is
  /// Scheduler::model_unavailable()'s message), not because of an internal error.
  bool model_unavailable = false;
  std::optional<TokenLogprobs> logprobs;  ///< kToken with logprobs asked (never for a stop token)
  /// kDone: one choice's outcome. A job ends after the kDone of choice n − 1, after a kDone
  /// whose finish_reason is kCancelled (the remaining choices are not run), or after kFailed.
  GenerationResult result;
  uint64_t seed = 0;       ///< kDone: the seed this choice ran with
  JobTimings timings;      ///< kDone: where the engine spent this choice's time
  std::chrono::steady_clock::time_point at;  ///< when the engine produced it
};

/// A submitted job: an event channel (engine → HTTP thread) and a cancellation flag
/// (HTTP thread → engine). Thread-safe.
class Job {
 public:
  explicit Job(JobRequest request) : request_(std::move(request)) {}
  const JobRequest& request() const { return request_; }

  /// Next event, waiting at most `timeout`; nullopt on time-out.
  std::optional<JobEvent> next_event(std::chrono::milliseconds timeout);
  /// Asks the engine to stop this job: it leaves the batch before the next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  /// When the engine took the job from the queue; nullopt while it waits (or when it was
  /// cancelled in the queue). The time queued and the time running are measured from it.
  std::optional<std::chrono::steady_clock::time_point> started_at() const {
    const auto ticks = started_.load();
    if (ticks == kNotStarted) return std::nullopt;
    return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(ticks));
  }

  /// Engine side: posts an event.
  void post(JobEvent event);
  /// Engine side: records that the job leaves the queue now.
  void mark_started() { started_.store(std::chrono::steady_clock::now().time_since_epoch().count()); }

 private:
  static constexpr std::chrono::steady_clock::rep kNotStarted = std::numeric_limits<std::chrono::steady_clock::rep>::min();
  JobRequest request_;
  std::atomic<bool> cancelled_{false};
  std::atomic<std::chrono::steady_clock::rep> started_{kNotStarted};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<JobEvent> events_;
};

/// Generated tokens a state resumed from the prefix cache gets room for beyond its prompt (at
/// most the request's max_tokens; Backend::resume_state): answers up to this long never grow
/// the resumed state's KV cache, and longer ones grow it as a fresh state grows.
inline constexpr int64_t kResumeRoom = 1024;

/// The positions a state resumed for `request` gets room for: its prompt and
/// min(max_tokens, kResumeRoom) generated tokens, at most `max_seq`.
int64_t resume_capacity(const JobRequest& request, int64_t max_seq);

/// Most message-boundary snapshots one request stores (JobRequest::message_starts).
inline constexpr int kMessageSnapshots = 8;

/// The message starts of `request` the prefix cache snapshots when `cached_tokens` came from the
/// cache: those beyond it and before the prompt's last token, at most kMessageSnapshots (the
/// first of them and the last kMessageSnapshots − 1), ascending.
std::vector<int64_t> message_snapshots(const JobRequest& request, int64_t cached_tokens);

/// What one engine step did, for metrics (EngineOptions::on_step).
struct StepStats {
  int rows = 0;                ///< sequences in the step (the batch size)
  int decode_rows = 0;         ///< of which decode rows (one generated token each)
  int64_t prefill_tokens = 0;  ///< prompt tokens the step's prefill chunks ran
  double seconds = 0;          ///< wall time of Backend::step
};

/// Default token budget of one step (EngineOptions::step_tokens).
inline constexpr int64_t kDefaultStepTokens = 256;

/// Engine settings fixed at start-up.
struct EngineOptions {
  int64_t max_seq = 0;             ///< capacity of every sequence (tokens)
  int max_queue = 16;              ///< waiting jobs allowed (not counting the running ones)
  /// Most jobs running at once (rows of one step), 1 … Backend::max_batch(); 0 = the default,
  /// min(Backend::preferred_max_batch(), Backend::max_batch()).
  int max_batch = 0;
  /// Token budget of one step (≥ 1): every decode row, then prefill chunks oldest job first
  /// while the step stays within it (the oldest prefilling job's chunk always goes in). With
  /// max_batch > 1 prompts are also cut at multiples of it (GenerationParams::prefill_chunk).
  int64_t step_tokens = kDefaultStepTokens;
  std::vector<int32_t> stop_ids;   ///< stop tokens
  SessionCacheOptions cache;
  /// Called on the engine thread after every step (may be empty); must be quick and not throw.
  std::function<void(const StepStats&)> on_step;
};

/// Owns the engine thread, the Backend and the session cache.
class Scheduler {
 public:
  /// Starts the engine thread (and, with a host tier and a backend that allows it, the cache's
  /// background host copies: SessionCache::start_background_host_copies). `tokenizer` may be
  /// null (no text, no stop strings). Throws OptionError (engine/option_error.h) for
  /// max_seq < 1, max_queue < 0, step_tokens < 1, or max_batch outside
  /// [0, backend->max_batch()] (naming the backend's limit).
  Scheduler(std::unique_ptr<Backend> backend, std::shared_ptr<const Tokenizer> tokenizer,
            EngineOptions options);
  /// Calls stop(0).
  ~Scheduler();

  /// Queues a job (FIFO). Throws QueueFullError when max_queue jobs are waiting beyond the free
  /// batch slots,
  /// ShuttingDownError after stop(), lily::Error for a request that cannot fit max_seq or has
  /// message_starts out of order or outside the prompt or a token id outside the vocabulary, and
  /// ModelUnavailableError once model_unavailable() is set. A queued job that reaches the
  /// engine after the weights changed fails (kFailed with JobEvent::model_unavailable) with the
  /// same message, untouched; so does a running job at its next step (model_unavailable() is
  /// checked before every step, so that a change between two steps never reaches the backend).
  std::shared_ptr<Job> submit(JobRequest request);
  /// Checks Backend::weights_changed() (one stat(2) per weights file) and remembers the first
  /// problem for good, logging it once as an error: "the model's weights changed on disk after
  /// loading (<why>); this server refuses all further requests: restart lily serve to load the
  /// new weights". Returns that message, or nullopt. Thread-safe.
  std::optional<std::string> model_unavailable();
  /// Removes a queued job (it gets a kDone event with FinishReason::kCancelled and no tokens)
  /// or, when running, cancels it; returns at once.
  void cancel(const std::shared_ptr<Job>& job);

  /// Stops accepting jobs, fails the queued ones, lets the running jobs finish for at most
  /// `grace`, then cancels them, and joins the engine thread. Idempotent.
  void stop(std::chrono::milliseconds grace);

  /// Jobs waiting (not counting the running ones).
  int queue_depth() const;
  /// Jobs running (admitted into the batch and not finished).
  int running() const;
  /// Rows of the step running now or last run; 0 when no job runs.
  int batch_size() const;
  /// The resolved EngineOptions::max_batch.
  int max_batch() const { return max_batch_; }
  /// The prefix cache's counters (SessionCache::stats: never waits for the engine thread's work).
  SessionCacheStats cache_stats() const { return cache_.stats(); }
  const EngineOptions& options() const { return options_; }
  const Backend& backend() const { return *backend_; }

 private:
  struct Running;  // one admitted job: its state, its Generation, its snapshots
  void engine_loop();
  /// Starts choice `choice` of r's job (cache lookup, state, Generation); false when the job
  /// ended instead (cancelled before it, or failed: its events are posted).
  bool start_choice(Running& r, int choice);
  /// Stores the finished choice's final state and posts its kDone; then starts the next choice.
  /// False when the job is over.
  bool finish_choice(Running& r);
  /// Builds and runs one step over the batch, advances every row and drops finished jobs.
  void run_step();
  /// Posts kFailed with `why` (and JobEvent::model_unavailable = `unavailable`) and drops the
  /// job's generation and state.
  void fail(Running& r, const std::string& why, bool unavailable = false);
  /// Backend::prepare_while_idle, false (done) when it throws.
  bool prepare_while_idle();

  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  EngineOptions options_;
  int max_batch_ = 1;
  int64_t prefill_chunk_ = 0;  ///< GenerationParams::prefill_chunk of every job
  SessionCache cache_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> running_;  ///< the batch's jobs (mutex_)
  int batch_size_ = 0;                         ///< rows of the current or last step (mutex_)
  std::vector<std::unique_ptr<Running>> batch_;  ///< engine thread only, admission order
  bool stopping_ = false;
  bool idle_work_ = false;  ///< engine thread only: Backend::prepare_while_idle has more to do
  std::mutex unavailable_mutex_;
  std::optional<std::string> unavailable_;  ///< set once, never cleared
  std::thread thread_;
  std::mutex stop_mutex_;
};

}  // namespace lily
