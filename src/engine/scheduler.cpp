#include "engine/scheduler.h"

#include <algorithm>

#include "base/log.h"
#include "engine/option_error.h"

namespace lily {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

JobEvent make_event(JobEvent::Kind kind) {
  JobEvent e;
  e.kind = kind;
  e.at = std::chrono::steady_clock::now();
  return e;
}

}  // namespace

std::vector<int64_t> message_snapshots(const JobRequest& request, int64_t cached_tokens) {
  std::vector<int64_t> beyond;
  for (int64_t start : request.message_starts)
    if (start > cached_tokens && start < static_cast<int64_t>(request.prompt.size()) - 1) beyond.push_back(start);
  if (static_cast<int>(beyond.size()) <= kMessageSnapshots) return beyond;
  std::vector<int64_t> out = {beyond.front()};
  out.insert(out.end(), beyond.end() - (kMessageSnapshots - 1), beyond.end());
  return out;
}

int64_t resume_capacity(const JobRequest& request, int64_t max_seq) {
  const int64_t room = std::clamp<int64_t>(request.max_tokens, 0, kResumeRoom);
  return std::min(max_seq, static_cast<int64_t>(request.prompt.size()) + room);
}

std::optional<JobEvent> Job::next_event(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  JobEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void Job::post(JobEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

Scheduler::Scheduler(std::unique_ptr<Backend> backend, std::shared_ptr<const Tokenizer> tokenizer,
                     EngineOptions options)
    : backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      options_(std::move(options)),
      cache_(options_.cache) {
  if (options_.max_seq < 1)
    throw OptionError("max_seq", "must be at least 1, got " + std::to_string(options_.max_seq));
  if (options_.max_queue < 0)
    throw OptionError("max_queue", "must be ≥ 0, got " + std::to_string(options_.max_queue));
  if (options_.step_tokens < 1)
    throw OptionError("step_tokens", "must be at least 1, got " + std::to_string(options_.step_tokens));
  const int limit = std::max(1, backend_->max_batch());
  if (options_.max_batch < 0 || options_.max_batch > limit)
    throw OptionError("max_batch", std::to_string(options_.max_batch) + " is outside [1, " + std::to_string(limit) +
                                       "]: the " + backend_->name() + " backend runs at most " +
                                       std::to_string(limit) + (limit == 1 ? " sequence" : " sequences") +
                                       " per step");
  max_batch_ = options_.max_batch == 0 ? std::min(backend_->preferred_max_batch(), limit) : options_.max_batch;
  // A lone sequence shares its steps with nothing: its prompt is only cut where it always is.
  prefill_chunk_ = max_batch_ > 1 ? options_.step_tokens : 0;
  // The backend sizes the memory of its host copies from the host tier's budget.
  if (options_.cache.host_bytes > 0) backend_->reserve_host_copies(options_.cache.host_bytes);
  // Snapshots bound for the host tier are copied on the cache's helper thread, so that a copy
  // (with CUDA, pinning new host memory) never holds up a step or the next job.
  if (options_.cache.host_bytes > 0 && backend_->copies_to_host_concurrently())
    cache_.start_background_host_copies(*backend_);
  thread_ = std::thread([this] { engine_loop(); });
}

Scheduler::~Scheduler() { stop(std::chrono::milliseconds(0)); }

std::shared_ptr<Job> Scheduler::submit(JobRequest request) {
  const int64_t need = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  if (request.prompt.empty() || request.max_tokens < 1 || need > options_.max_seq)
    throw Error("request needs " + std::to_string(need) + " tokens but max_seq is " +
                std::to_string(options_.max_seq));
  const auto& starts = request.message_starts;
  for (size_t i = 0; i < starts.size(); ++i)
    if (starts[i] < 1 || starts[i] >= static_cast<int64_t>(request.prompt.size()) ||
        (i > 0 && starts[i] <= starts[i - 1]))
      throw Error("message_starts must be strictly increasing positions in [1, " +
                  std::to_string(request.prompt.size()) + "), got " + std::to_string(starts[i]) + " at index " +
                  std::to_string(i));
  const int32_t vocab = backend_->config().vocab;
  for (size_t i = 0; i < request.prompt.size(); ++i)
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab)
      throw Error("prompt token " + std::to_string(i) + " is " + std::to_string(request.prompt[i]) +
                  ", outside the vocabulary [0, " + std::to_string(vocab) + ")");
  if (auto why = model_unavailable()) throw ModelUnavailableError(*why);
  auto job = std::make_shared<Job>(std::move(request));
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw ShuttingDownError("the server is shutting down");
    // Jobs beyond the free batch slots wait; max_queue of them may.
    const int free_slots = std::max(0, max_batch_ - static_cast<int>(running_.size()));
    if (static_cast<int>(queue_.size()) >= options_.max_queue + free_slots)
      throw QueueFullError("the request queue is full (" + std::to_string(options_.max_queue) +
                           " waiting)");
    queue_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

void Scheduler::cancel(const std::shared_ptr<Job>& job) {
  job->cancel();
  bool removed = false;
  {
    std::lock_guard lock(mutex_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) {
      queue_.erase(it);
      removed = true;
    }
  }
  if (removed) {
    JobEvent e = make_event(JobEvent::Kind::kDone);
    e.result.finish_reason = FinishReason::kCancelled;
    e.result.prompt_tokens = static_cast<int64_t>(job->request().prompt.size());
    job->post(std::move(e));
  }
}

void Scheduler::stop(std::chrono::milliseconds grace) {
  std::lock_guard stop_lock(stop_mutex_);
  std::deque<std::shared_ptr<Job>> dropped;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  for (auto& job : dropped) {
    JobEvent e = make_event(JobEvent::Kind::kFailed);
    e.text = "the server is shutting down";
    job->post(std::move(e));
  }
  if (!thread_.joinable()) return;
  {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, grace, [&] { return running_.empty(); });
    for (auto& job : running_) job->cancel();
  }
  thread_.join();
}

std::optional<std::string> Scheduler::model_unavailable() {
  std::lock_guard lock(unavailable_mutex_);
  if (!unavailable_) {
    if (auto why = backend_->weights_changed()) {
      unavailable_ = "the model's weights changed on disk after loading (" + *why +
                     "); this server refuses all further requests: restart lily serve to load the new weights";
      log_error(*unavailable_);
    }
  }
  return unavailable_;
}

int Scheduler::queue_depth() const {
  std::lock_guard lock(mutex_);
  return static_cast<int>(queue_.size());
}

int Scheduler::running() const {
  std::lock_guard lock(mutex_);
  return static_cast<int>(running_.size());
}

int Scheduler::batch_size() const {
  std::lock_guard lock(mutex_);
  return batch_size_;
}

struct Scheduler::Running {
  std::shared_ptr<Job> job;
  int choice = 0;
  uint64_t seed = 0;
  std::unique_ptr<SequenceState> state;
  std::optional<TokenLogprobs> pending_logprobs;
  std::unique_ptr<Generation> gen;  ///< null once the job is over
  JobTimings timings;               ///< of the current choice
};

void Scheduler::engine_loop() {
  while (true) {
    cache_.reap();  // states whose host copy is done, freed here on the engine thread
    std::vector<std::shared_ptr<Job>> admitted;
    {
      std::unique_lock lock(mutex_);
      auto has_work = [&] { return stopping_ || !queue_.empty() || !batch_.empty(); };
      // Idle: the backend prepares for later requests, one bounded piece at a time, looking for
      // new work between the pieces.
      while (!has_work() && idle_work_) {
        lock.unlock();
        idle_work_ = prepare_while_idle();
        cache_.reap();
        lock.lock();
      }
      cv_.wait(lock, has_work);
      if (batch_.empty() && queue_.empty()) return;  // stopping
      // Admission between steps, oldest first, up to max_batch running jobs.
      while (static_cast<int>(batch_.size() + admitted.size()) < max_batch_ && !queue_.empty()) {
        queue_.front()->mark_started();  // before running() counts it: a running job has a start time
        admitted.push_back(queue_.front());
        running_.push_back(queue_.front());
        queue_.pop_front();
      }
    }
    for (auto& job : admitted) {
      auto r = std::make_unique<Running>();
      r->job = job;
      if (start_choice(*r, 0)) batch_.push_back(std::move(r));
    }
    // A cancelled job leaves the batch before the step.
    for (auto& r : batch_)
      if (r->gen && r->job->cancelled()) {
        r->gen->cancel();
        if (!finish_choice(*r)) r->gen.reset();
      }
    std::erase_if(batch_, [](const std::unique_ptr<Running>& r) { return r->gen == nullptr; });
    if (!batch_.empty()) {
      run_step();
      idle_work_ = true;
    }
    {
      std::lock_guard lock(mutex_);
      std::erase_if(running_, [&](const std::shared_ptr<Job>& job) {
        return std::none_of(batch_.begin(), batch_.end(), [&](const auto& r) { return r->job == job; });
      });
      if (batch_.empty()) batch_size_ = 0;
    }
    cv_.notify_all();
  }
}

bool Scheduler::prepare_while_idle() {
  try {
    return backend_->prepare_while_idle();
  } catch (const std::exception& e) {
    log_debug(std::string("engine: preparing while idle failed: ") + e.what());
    return false;
  }
}

void Scheduler::fail(Running& r, const std::string& why, bool unavailable) {
  JobEvent failed = make_event(JobEvent::Kind::kFailed);
  failed.text = why;
  failed.model_unavailable = unavailable;
  r.job->post(std::move(failed));
  r.gen.reset();
  r.state.reset();
}

bool Scheduler::start_choice(Running& r, int choice) {
  const JobRequest& req = r.job->request();
  try {
    // Checked again here: the job may have waited in the queue while a file changed.
    if (choice == 0)
      if (auto why = model_unavailable()) throw ModelUnavailableError(*why);
    r.choice = choice;
    r.seed = choice_seed(req.sampling.seed, choice);
    if (r.job->cancelled()) {
      JobEvent done = make_event(JobEvent::Kind::kDone);
      done.choice = choice;
      done.seed = r.seed;
      done.result.finish_reason = FinishReason::kCancelled;
      done.result.prompt_tokens = static_cast<int64_t>(req.prompt.size());
      r.job->post(std::move(done));
      return false;
    }
    // Every choice looks the prompt up again: the ones after the first hit the entry the
    // first one stored, which changes nothing in what they generate.
    r.timings = JobTimings{};
    auto t0 = std::chrono::steady_clock::now();
    CacheLookup hit = cache_.acquire(*backend_, req.prompt, req.cache_key, resume_capacity(req, options_.max_seq));
    r.timings.cache_lookup_seconds = seconds_since(t0);
    if (hit.state) {
      r.state = std::move(hit.state);
    } else {
      t0 = std::chrono::steady_clock::now();
      r.state = backend_->new_state(options_.max_seq);
      r.timings.new_state_seconds = seconds_since(t0);
    }
    r.pending_logprobs.reset();
    PromptPrefixHook snapshot;
    if (cache_.enabled()) {
      const std::vector<int64_t> wanted = message_snapshots(req, hit.cached_tokens);
      const int64_t last_prefix = static_cast<int64_t>(req.prompt.size()) - 1;
      // A state resumed right before the last prompt token is the snapshot it came from: not
      // copied again (the snapshot keeps the key it was stored with).
      const int64_t resumed_at = hit.cached_tokens;
      // Each snapshot is stored as soon as it is taken, not when the job ends: a request
      // admitted while this one still runs (another conversation with the same system prompt,
      // the same request sent again) resumes from it.
      snapshot = [this, &r, wanted, last_prefix, resumed_at](const SequenceState& s, int64_t n) {
        if (n == resumed_at) return;
        if (n != last_prefix && !std::binary_search(wanted.begin(), wanted.end(), n)) return;
        const JobRequest& q = r.job->request();
        auto t = std::chrono::steady_clock::now();
        std::vector<ResumePoint> point;
        point.push_back({std::vector<int32_t>(q.prompt.begin(), q.prompt.begin() + n), backend_->clone_state(s)});
        r.timings.snapshot_seconds += seconds_since(t);
        t = std::chrono::steady_clock::now();
        cache_.store(*backend_, std::move(point), q.cache_key);
        r.timings.cache_store_seconds += seconds_since(t);
      };
    }
    LogprobsCallback on_logprobs = [&r](const TokenLogprobs& lp) { r.pending_logprobs = lp; };
    TokenCallback on_token = [&r, choice](int32_t token, std::string_view text) {
      JobEvent e = make_event(JobEvent::Kind::kToken);
      e.choice = choice;
      e.token = token;
      e.text = std::string(text);
      e.logprobs = std::move(r.pending_logprobs);
      r.pending_logprobs.reset();
      r.job->post(std::move(e));
      return !r.job->cancelled();
    };
    GenerationParams params;
    params.max_tokens = req.max_tokens;
    params.max_seq = options_.max_seq;
    if (!req.ignore_eos) params.stop_ids = options_.stop_ids;
    params.stop_ids.insert(params.stop_ids.end(), req.stop_ids.begin(), req.stop_ids.end());
    params.min_tokens = req.min_tokens;
    params.json_schema = req.json_schema;
    params.json_after_id = req.json_after_id;
    params.tool_call = req.tool_call;
    params.stop_strings = req.stop_strings;
    if (req.stop_after_text) params.stop_after_text = req.stop_after_text();
    params.sampling = req.sampling;
    params.sampling.seed = r.seed;
    params.logprobs = req.logprobs;
    params.prompt_splits = req.message_starts;
    params.prefill_chunk = prefill_chunk_;
    params.kept_special_ids = req.kept_special_ids;
    r.gen = std::make_unique<Generation>(*backend_, *r.state, req.prompt, params, tokenizer_.get(), on_token,
                                         snapshot, on_logprobs);
    return true;
  } catch (const ModelUnavailableError& e) {
    fail(r, e.what(), true);
    return false;
  } catch (const std::exception& e) {
    fail(r, e.what());
    return false;
  }
}

bool Scheduler::finish_choice(Running& r) {
  const JobRequest& req = r.job->request();
  GenerationResult result = r.gen->take_result();
  r.gen.reset();
  try {
    if (cache_.enabled()) {
      // The state holds the first position() tokens of prompt + generated tokens (a job
      // cancelled in its prefill holds part of the prompt only).
      std::vector<int32_t> fed(req.prompt.begin(), req.prompt.end());
      fed.insert(fed.end(), result.token_ids.begin(), result.token_ids.end());
      fed.resize(static_cast<size_t>(std::min<int64_t>(r.state->position(), static_cast<int64_t>(fed.size()))));
      std::vector<ResumePoint> points;
      points.push_back({std::move(fed), std::move(r.state)});
      const auto t0 = std::chrono::steady_clock::now();
      cache_.store(*backend_, std::move(points), req.cache_key);
      r.timings.cache_store_seconds += seconds_since(t0);
    }
  } catch (const std::exception& e) {
    fail(r, e.what());
    return false;
  }
  r.state.reset();
  const bool cancelled = result.finish_reason == FinishReason::kCancelled;
  JobEvent done = make_event(JobEvent::Kind::kDone);
  done.choice = r.choice;
  done.seed = r.seed;
  done.result = std::move(result);
  done.timings = r.timings;
  r.job->post(std::move(done));
  if (cancelled || r.choice + 1 >= std::max(req.n, 1)) return false;
  return start_choice(r, r.choice + 1);
}

void Scheduler::run_step() {
  // A memory-mapped weights file that changed may fault (SIGBUS) inside the step: the running
  // jobs fail here instead, between two steps, so a change during a generation is caught at its
  // next token (one stat(2) per weights file; a change in the middle of a step is not).
  if (auto why = model_unavailable()) {
    for (auto& r : batch_) fail(*r, *why, true);
    batch_.clear();
    return;
  }
  // Every decoding job's token first, then prefill chunks oldest job first while the step stays
  // within its token budget; the oldest prefilling job always gets its chunk.
  std::vector<StepRow> rows;
  std::vector<Running*> owners;
  int64_t tokens = 0;
  StepStats stats;
  for (auto& r : batch_)
    if (!r->gen->prefilling()) {
      rows.push_back(r->gen->next_row());
      owners.push_back(r.get());
      ++tokens;
      ++stats.decode_rows;
    }
  bool any_prefill = false;
  for (auto& r : batch_) {
    if (!r->gen->prefilling()) continue;
    const int64_t chunk = r->gen->next_row_tokens();
    if (any_prefill && tokens + chunk > options_.step_tokens) break;
    rows.push_back(r->gen->next_row());
    owners.push_back(r.get());
    tokens += chunk;
    stats.prefill_tokens += chunk;
    any_prefill = true;
  }
  stats.rows = static_cast<int>(rows.size());
  {
    std::lock_guard lock(mutex_);
    batch_size_ = stats.rows;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> next;
  try {
    next = backend_->step(rows);
  } catch (const std::exception& e) {
    // The rows' states may be half advanced: every job of the step fails.
    for (Running* r : owners) fail(*r, e.what());
    std::erase_if(batch_, [](const std::unique_ptr<Running>& r) { return r->gen == nullptr; });
    return;
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (options_.on_step) options_.on_step(stats);
  for (size_t i = 0; i < owners.size(); ++i) {
    Running& r = *owners[i];
    (rows[i].decode ? r.timings.decode_seconds : r.timings.prefill_seconds) += stats.seconds;
    try {
      r.gen->advance(next[i]);
    } catch (const std::exception& e) {
      fail(r, e.what());
      continue;
    }
    if (r.gen->done() && !finish_choice(r)) r.gen.reset();
  }
  std::erase_if(batch_, [](const std::unique_ptr<Running>& r) { return r->gen == nullptr; });
}

}  // namespace lily
