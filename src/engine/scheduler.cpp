#include "engine/scheduler.h"

#include <algorithm>

#include "base/log.h"

namespace lily {

namespace {

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
  if (options_.max_seq < 1) throw Error("max_seq must be at least 1");
  if (options_.max_queue < 0) throw Error("--max-queue must be ≥ 0");
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
  if (auto why = model_unavailable()) throw ModelUnavailableError(*why);
  auto job = std::make_shared<Job>(std::move(request));
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw ShuttingDownError("the server is shutting down");
    const bool idle = running_ == nullptr && queue_.empty();
    if (!idle && static_cast<int>(queue_.size()) >= options_.max_queue)
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
    cv_.wait_for(lock, grace, [&] { return running_ == nullptr; });
    if (running_) running_->cancel();
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
  return running_ ? 1 : 0;
}

void Scheduler::engine_loop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      job = queue_.front();
      queue_.pop_front();
      running_ = job;
    }
    job->mark_started();
    run_job(*job);
    {
      std::lock_guard lock(mutex_);
      running_.reset();
    }
    cv_.notify_all();
  }
}

void Scheduler::run_job(Job& job) {
  const JobRequest& req = job.request();
  try {
    // Checked again here: the job may have waited in the queue while a file changed.
    if (auto why = model_unavailable()) throw ModelUnavailableError(*why);
    for (int choice = 0; choice < std::max(req.n, 1); ++choice) {
      const uint64_t seed = choice_seed(req.sampling.seed, choice);
      if (job.cancelled()) {
        JobEvent done = make_event(JobEvent::Kind::kDone);
        done.choice = choice;
        done.seed = seed;
        done.result.finish_reason = FinishReason::kCancelled;
        done.result.prompt_tokens = static_cast<int64_t>(req.prompt.size());
        job.post(std::move(done));
        return;
      }
      // Every choice looks the prompt up again: the ones after the first hit the entry the
      // first one stored, which changes nothing in what they generate.
      CacheLookup hit = cache_.acquire(*backend_, req.prompt, req.cache_key);
      std::unique_ptr<SequenceState> state =
          hit.state ? std::move(hit.state) : backend_->new_state(options_.max_seq);
      std::vector<ResumePoint> points;
      PromptPrefixHook snapshot;
      if (cache_.enabled()) {
        const std::vector<int64_t> wanted = message_snapshots(req, hit.cached_tokens);
        const int64_t last_prefix = static_cast<int64_t>(req.prompt.size()) - 1;
        snapshot = [&, wanted, last_prefix](const SequenceState& s, int64_t n) {
          if (n != last_prefix && !std::binary_search(wanted.begin(), wanted.end(), n)) return;
          points.push_back({std::vector<int32_t>(req.prompt.begin(), req.prompt.begin() + n),
                            backend_->clone_state(s)});
        };
      }
      std::optional<TokenLogprobs> pending_logprobs;
      LogprobsCallback on_logprobs = [&](const TokenLogprobs& lp) { pending_logprobs = lp; };
      TokenCallback on_token = [&](int32_t token, std::string_view text) {
        JobEvent e = make_event(JobEvent::Kind::kToken);
        e.choice = choice;
        e.token = token;
        e.text = std::string(text);
        e.logprobs = std::move(pending_logprobs);
        pending_logprobs.reset();
        job.post(std::move(e));
        return !job.cancelled();
      };
      GenerationParams params;
      params.max_tokens = req.max_tokens;
      params.max_seq = options_.max_seq;
      params.stop_ids = options_.stop_ids;
      params.stop_strings = req.stop_strings;
      params.sampling = req.sampling;
      params.sampling.seed = seed;
      params.logprobs = req.logprobs;
      params.prompt_splits = req.message_starts;
      GenerationResult result = generate(*backend_, *state, req.prompt, params, tokenizer_.get(), on_token,
                                         snapshot, on_logprobs);
      if (cache_.enabled()) {
        std::vector<int32_t> fed(req.prompt.begin(), req.prompt.end());
        fed.insert(fed.end(), result.token_ids.begin(), result.token_ids.begin() + result.fed_tokens);
        points.push_back({std::move(fed), std::move(state)});
        cache_.store(*backend_, std::move(points), req.cache_key);
      }
      const bool cancelled = result.finish_reason == FinishReason::kCancelled;
      JobEvent done = make_event(JobEvent::Kind::kDone);
      done.choice = choice;
      done.seed = seed;
      done.result = std::move(result);
      job.post(std::move(done));
      if (cancelled) return;
    }
  } catch (const std::exception& e) {
    JobEvent failed = make_event(JobEvent::Kind::kFailed);
    failed.text = e.what();
    job.post(std::move(failed));
  }
}

}  // namespace lily
