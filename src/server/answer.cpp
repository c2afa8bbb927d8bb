// From a generating request's engine events to its answer. One event loop (LilyServer::EventLoop)
// serves both shapes of answer and decides what happens in every case; its two sinks only shape
// what it hands them: WholeAnswer, one JSON document, and StreamAnswer, SSE chunks.
//
// What a client sees, streamed or not. The choices are those of OpenAI's API, which vLLM's and
// llama.cpp's servers follow, so that a client written for them reads lily the same way:
// - The client goes away (reset or closed connection, a failed write, a reader stalled past
//   --write-timeout): the job is cancelled at once and nothing more is sent. A stream ends
//   without its last chunk and its connection is dropped. The metrics count a cancelled
//   generation; the log line says error="cancelled". Nobody reads an answer, so none is made:
//   the log line and lily_http_requests_total say 499 (kClientClosedRequest) unless a stream's
//   200 head had gone out.
// - The engine cancels the job (the end of the shutdown grace): an error, never a
//   finish_reason. A whole answer is the error status (503 server_shutting_down, Retry-After);
//   a stream, whose 200 is already out, sends the text it has, then an `error` event and
//   `data: [DONE]`. A finish_reason ("length", say) would pass a cut answer off as a complete
//   one; OpenAI and vLLM report a failure mid-stream as an error object in the stream.
// - The engine fails (an internal error, or weights changed on disk): the same, with 500 (the
//   detail goes to the log, the client gets the request id) or 503 model_unavailable.
// - Stop strings: the engine holds back text that may begin one; the answer ends before the
//   stop string, finish_reason "stop". A stream gets the held-back text at the choice's end.
// - Tool calls (chat): the text becomes reasoning, content and tool calls (AnswerParser); a
//   choice with a tool call finishes with "tool_calls".
// - Usage counts the prompt once and every choice's tokens. A whole answer always has it; a
//   stream only with stream_options.include_usage, as a last chunk without choices before
//   [DONE] (with continuous_usage_stats, vLLM's, every chunk also carries the counts so far).
//   An answer that fails has none: the error takes its place.
// - n > 1: a whole answer holds the choices in order; a stream sends them one after the other,
//   a chat stream opening each with a role chunk that carries its seed.
#include "server/server_impl.h"

#include "base/log.h"

namespace lily::server::detail {

namespace {

/// Token counts of a request's choices: the prompt and its cached part once (from the first
/// choice), the completion tokens of all choices together.
Usage usage_of(const std::vector<GenerationResult>& results) {
  Usage u;
  if (results.empty()) return u;
  u.prompt_tokens = results.front().prompt_tokens;
  u.cached_tokens = results.front().cached_tokens;
  for (const auto& r : results) u.completion_tokens += static_cast<int64_t>(r.token_ids.size());
  return u;
}

/// Adds the engine's part of one choice's time to a request's phases.
void add_engine_phases(RequestPhases& p, const JobTimings& t) {
  p.cache_lookup += t.cache_lookup_seconds;
  p.new_state += t.new_state_seconds;
  p.snapshot += t.snapshot_seconds;
  p.prefill += t.prefill_seconds;
  p.decode += t.decode_seconds;
  p.cache_store += t.cache_store_seconds;
}

}  // namespace

/// The one loop over a job's events (see the top of this file for what each case does): it
/// watches the connection, counts the metrics and tells the sink what to answer.
class LilyServer::EventLoop {
 public:
  /// `client_gone`: the client is already gone (the job is cancelled at once).
  EventLoop(LilyServer& server, ChatCall& call, Exchange& ex, AnswerSink& sink, bool client_gone)
      : server_(server), call_(call), ex_(ex), sink_(sink), watch_(ex.fd()) {
    if (client_gone) leave();
  }

  /// True once the client is known to have gone away.
  bool client_gone() const { return client_gone_; }

  /// Runs until the job's last event.
  void run() {
    if (!client_gone_ && !sink_.on_begin(0)) leave();
    while (true) {
      JobEvent e = *server_.next_event(call_, ex_, watch_, client_gone_);
      if (e.kind == JobEvent::Kind::kToken) on_token(e);
      else if (e.kind == JobEvent::Kind::kFailed) return fail(server_.failure(call_, e.text, e.model_unavailable));
      else if (on_done(e)) return;
    }
  }

 private:
  /// The client is gone: the job stops and the sink hears no more.
  void leave() {
    client_gone_ = true;
    server_.scheduler_->cancel(call_.job);
  }

  void on_token(JobEvent& e) {
    server_.observe_token(call_, e, last_token_);
    sent_ += e.text.size();
    if (!client_gone_ && !sink_.on_text(e.choice, e.text, std::move(e.logprobs))) leave();
  }

  /// A choice ended; true when the request is over.
  bool on_done(JobEvent& e) {
    add_engine_phases(call_.phases, e.timings);
    const int choice = e.choice;
    const bool cancelled = e.result.finish_reason == FinishReason::kCancelled;
    const bool last = cancelled || choice + 1 >= call_.request.n;
    results_.push_back(std::move(e.result));
    if (last) server_.record_done(call_, results_, e.at);
    if (client_gone_) return last;
    const GenerationResult& r = results_.back();
    const std::string rest = r.text.size() > sent_ ? r.text.substr(sent_) : std::string();
    sent_ = 0;
    if (!sink_.on_text_end(choice, rest)) leave();
    if (cancelled) {
      fail(server_.failure(call_, "generation was cancelled"));
      return true;
    }
    if (!client_gone_ && !sink_.on_finish(choice, r)) leave();
    if (last) {
      if (!client_gone_) sink_.on_complete(results_);
      return true;
    }
    if (!client_gone_ && !sink_.on_begin(choice + 1)) leave();
    return false;
  }

  /// The request failed: the log line says why, and a client still there is told.
  void fail(const ApiError& error) {
    t_request.error = error.message();
    if (!client_gone_) sink_.on_error(error);
  }

  LilyServer& server_;
  ChatCall& call_;
  Exchange& ex_;
  AnswerSink& sink_;
  ConnectionWatch watch_;
  bool client_gone_ = false;
  std::optional<Clock::time_point> last_token_;  ///< when the last token came
  std::vector<GenerationResult> results_;        ///< the choices ended so far
  size_t sent_ = 0;                              ///< text bytes of the current choice given to on_text
};

/// A whole answer: one JSON document in the endpoint's shape, made once every choice finished.
class LilyServer::WholeAnswer final : public AnswerSink {
 public:
  /// Answers `call` into `res`.
  WholeAnswer(const LilyServer& server, const ChatCall& call, Reply& res) : server_(server), call_(call), res_(res) {}

  bool on_begin(int) override { return true; }
  bool on_text(int, const std::string&, std::optional<TokenLogprobs>) override { return true; }
  bool on_text_end(int, const std::string&) override { return true; }
  bool on_finish(int, const GenerationResult&) override { return true; }
  void on_complete(const std::vector<GenerationResult>& results) override {
    set_json(res_, 200, dump(call_.text_completion ? text_completion(results) : chat_completion(results)));
  }
  void on_error(const ApiError& error) override { send_error(res_, error); }

 private:
  /// POST /v1/completions: each choice's text (after the echoed prompt) and legacy logprobs.
  ordered_json text_completion(const std::vector<GenerationResult>& results) const {
    ordered_json choices = ordered_json::array();
    for (size_t i = 0; i < results.size(); ++i) {
      const GenerationResult& r = results[i];
      int64_t offset = 0;
      choices.push_back(text_choice_json(static_cast<int>(i), call_.echo + r.text,
                                         std::string(finish_reason_name(r.finish_reason)),
                                         server_.logprobs_field(call_, r.logprobs, &offset)));
    }
    return text_completion_json(call_.meta, choices, usage_of(results));
  }

  /// POST /v1/chat/completions: each choice's text read as reasoning, content and tool calls.
  ordered_json chat_completion(const std::vector<GenerationResult>& results) const {
    ordered_json choices = ordered_json::array();
    for (size_t i = 0; i < results.size(); ++i) {
      const GenerationResult& r = results[i];
      const AssistantMessage message = parse_answer(r.text, call_.answer);
      const std::string finish =
          answer_finish_reason(std::string(finish_reason_name(r.finish_reason)), message.tool_calls.size(),
                               message.unfinished_call);
      ordered_json choice =
          choice_json(static_cast<int>(i), message.content, finish, server_.logprobs_field(call_, r.logprobs),
                      static_cast<int64_t>(choice_seed(call_.seed, static_cast<int>(i))));
      choice["message"] = assistant_message_json(message);
      choices.push_back(std::move(choice));
    }
    return completion_json(call_.meta, choices, usage_of(results));
  }

  const LilyServer& server_;
  const ChatCall& call_;
  Reply& res_;
};

/// A streamed answer: SSE chunks in the endpoint's shape as the text comes. Chat text goes
/// through the current choice's answer parser (reasoning, content, tool calls); legacy text is
/// sent as is, after the echoed prompt when asked. Log-probabilities wait for the next chunk sent.
class LilyServer::StreamAnswer final : public AnswerSink {
 public:
  /// Streams `call`'s answer on `ex`, whose stream has begun.
  StreamAnswer(const LilyServer& server, const ChatCall& call, Exchange& ex)
      : server_(server), call_(call), ex_(ex), usage_field_(call.request.include_usage),
        running_usage_(call.request.include_usage && call.request.continuous_usage) {}

  /// True once the stream's last event ([DONE]) went out: the stream may end cleanly.
  bool done() const { return done_; }

  /// Chat streams open each choice with the assistant's role, which also carries the seed it
  /// runs with; legacy completions streams have no role chunk.
  bool on_begin(int choice) override {
    parser_.emplace(call_.answer);
    text_offset_ = 0;
    if (call_.text_completion)
      return call_.echo.empty() || send(text_chunk_json(call_.meta, call_.echo, std::nullopt, usage_field_, choice));
    return send(chunk_json(call_.meta, choice, ordered_json{{"role", "assistant"}, {"content", ""}}, nullptr,
                           std::nullopt, usage_field_, static_cast<int64_t>(choice_seed(call_.seed, choice))));
  }

  bool on_text(int choice, const std::string& text, std::optional<TokenLogprobs> logprobs) override {
    ++completion_tokens_;
    if (logprobs) pending_.push_back(std::move(*logprobs));
    return text.empty() || send_piece(choice, text);
  }

  /// Sends the held-back text, what the parser still holds, and the log-probabilities of
  /// tokens whose text never made a chunk of its own.
  bool on_text_end(int choice, const std::string& rest) override {
    bool ok = rest.empty() || send_piece(choice, rest);
    if (!call_.text_completion) ok = send_deltas(choice, parser_->finish()) && ok;
    if (!pending_.empty() && call_.request.logprobs)
      ok = send(call_.text_completion
                    ? text_chunk_json(call_.meta, "", std::nullopt, usage_field_, choice,
                                      server_.logprobs_field(call_, pending_, &text_offset_))
                    : chunk_json(call_.meta, choice, ordered_json{{"content", ""}}, server_.logprobs_field(call_, pending_),
                                 std::nullopt, usage_field_)) &&
           ok;
    pending_.clear();
    return ok;
  }

  bool on_finish(int choice, const GenerationResult& result) override {
    const std::string reason(finish_reason_name(result.finish_reason));
    if (call_.text_completion) return send(text_chunk_json(call_.meta, "", reason, usage_field_, choice));
    return send(chunk_json(call_.meta, choice, ordered_json::object(), nullptr,
                           answer_finish_reason(reason, parser_->tool_calls(), parser_->unfinished_call()),
                           usage_field_));
  }

  void on_complete(const std::vector<GenerationResult>& results) override {
    if (usage_field_)
      send(usage_chunk_json(call_.meta, usage_of(results),
                            call_.text_completion ? "text_completion" : "chat.completion.chunk"));
    done_ = ex_.write_chunk("data: [DONE]\n\n");
  }

  void on_error(const ApiError& error) override {
    send(ordered_json(error.body()));
    done_ = ex_.write_chunk("data: [DONE]\n\n");
  }

 private:
  /// Sends one event; with running_usage_, a chunk's null usage becomes the usage so far.
  bool send(ordered_json doc) {
    if (running_usage_ && doc.contains("usage") && doc["usage"].is_null())
      doc["usage"] = ordered_json{{"prompt_tokens", call_.prompt_tokens},
                                  {"completion_tokens", completion_tokens_},
                                  {"total_tokens", call_.prompt_tokens + completion_tokens_}};
    return ex_.write_chunk(sse_event(dump(doc)));
  }

  /// A piece of text: parsed (chat) or as is (legacy, with the legacy logprobs of its tokens).
  bool send_piece(int choice, const std::string& text) {
    if (!call_.text_completion) return send_deltas(choice, parser_->push(text));
    const ordered_json logprobs = server_.logprobs_field(call_, pending_, &text_offset_);
    pending_.clear();
    return send(text_chunk_json(call_.meta, text, std::nullopt, usage_field_, choice, logprobs));
  }

  /// The parser's deltas as chat chunks; the pending log-probabilities ride on the first.
  bool send_deltas(int choice, const std::vector<AnswerDelta>& deltas) {
    for (const AnswerDelta& d : deltas)
      for (const ordered_json& delta : delta_json(d)) {
        if (!send(chunk_json(call_.meta, choice, delta, server_.logprobs_field(call_, pending_), std::nullopt,
                             usage_field_)))
          return false;
        pending_.clear();
      }
    return true;
  }

  const LilyServer& server_;
  const ChatCall& call_;
  Exchange& ex_;
  const bool usage_field_;  ///< stream_options.include_usage: every chunk has "usage" (null but the last)
  const bool running_usage_;  ///< and continuous_usage_stats: every chunk's usage is the count so far
  int64_t completion_tokens_ = 0;  ///< tokens generated so far, every choice (as usage counts them)
  std::optional<AnswerParser> parser_;  ///< the current choice's (chat)
  std::vector<TokenLogprobs> pending_;  ///< log-probabilities of tokens whose text is still held back
  int64_t text_offset_ = 0;             ///< legacy logprobs: characters of the choice's tokens so far
  bool done_ = false;
};

std::optional<JobEvent> LilyServer::next_event(ChatCall& call, Exchange& ex, const ConnectionWatch& watch,
                                               bool& client_gone) {
  // The connection is checked before every wait, not only when a wait times out: a decode faster
  // than the wait (tokens every few ms) would otherwise never look, and a whole (non-streamed)
  // answer whose client left ran to its end. A client that only shut down its sending side may
  // still read: it is probed once (a reset then tells that it has closed its socket).
  while (true) {
    if (!client_gone) {
      if (watch.gone()) {
        client_gone = true;
      } else if (!call.probed && watch.read_closed()) {
        call.probed = true;
        client_gone = !ex.probe();
      }
      if (client_gone) scheduler_->cancel(call.job);
    }
    if (auto e = call.job->next_event(std::chrono::milliseconds(20))) return e;
  }
}

void LilyServer::observe_token(ChatCall& call, const JobEvent& e, std::optional<Clock::time_point>& last) {
  if (!last) metrics_.observe_ttft(seconds(e.at - call.start));
  else metrics_.observe_inter_token(seconds(e.at - *last));
  last = e.at;
}

void LilyServer::record_done(ChatCall& call, const std::vector<GenerationResult>& results,
                             Clock::time_point done_at) {
  if (const auto started = call.job->started_at()) {
    metrics_.observe_queue_time(seconds(*started - call.submitted));
    metrics_.observe_running_time(seconds(done_at - *started));
    call.phases.queue = seconds(*started - call.submitted);
  }
  metrics_.record_phases(call.phases);
  const bool cancelled = !results.empty() && results.back().finish_reason == FinishReason::kCancelled;
  if (cancelled) metrics_.record_cancelled();
  const Usage u = usage_of(results);
  metrics_.record_tokens(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
  // The rate counts decode time only: neither the time queued nor the prefill.
  int64_t decode_steps = 0;
  double decode_seconds = 0;
  for (const auto& r : results) {
    decode_steps += r.timings.decode_steps;
    decode_seconds += r.timings.decode_seconds;
  }
  t_request.tokens = LogTokens{u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                               decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0};
  if (cancelled) t_request.error = "cancelled";
}

ApiError LilyServer::failure(const ChatCall& call, const std::string& detail, bool model_unavailable) {
  // The weights changed on disk (the engine logged it once): the same 503 as a refused request.
  if (model_unavailable) return ApiError(503, "server_error", detail, std::nullopt, "model_unavailable");
  if (shutting_down_)
    return ApiError(503, "server_error", "the server is shutting down", std::nullopt, "server_shutting_down")
        .with_header("Retry-After", "5");
  log_error("request failed (" + call.request_id + "): " + detail);
  return ApiError(500, "server_error", "internal server error (request id " + call.request_id + ")");
}

void LilyServer::drain_events(ChatCall& call, Exchange& ex, AnswerSink& sink, bool client_gone) {
  EventLoop loop(*this, call, ex, sink, client_gone);
  loop.run();
  // Otherwise the log line and /metrics would count an answer nobody got as the 200 it would
  // have been (Exchange::client_left).
  if (loop.client_gone()) ex.client_left();
}

void LilyServer::respond_whole(ChatCall& call, Exchange& ex, Reply& res) {
  WholeAnswer sink(*this, call, res);
  drain_events(call, ex, sink, false);
}

void LilyServer::respond_stream(ChatCall& call, Exchange& ex, const Reply& res) {
  auto headers = res.headers;
  headers.emplace_back("Cache-Control", "no-cache");
  const bool started = ex.begin_stream("text/event-stream", headers);
  StreamAnswer sink(*this, call, ex);
  drain_events(call, ex, sink, !started);
  // A stream whose client went away ends without its last chunk: the connection is dropped.
  if (sink.done()) ex.end_stream();
}

}  // namespace lily::server::detail
