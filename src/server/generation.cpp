// LilyServer's generating endpoints: POST /v1/chat/completions and POST /v1/completions from
// the parsed request to the engine job (validation, tokenizing, sampling parameters, submit)
// and from the job's events to the answer, whole or streamed as SSE (logprobs, usage, metrics,
// the client going away, failures). The longest part of the server, kept on its own so that
// connection handling and routing read without it.
#include "server/server_impl.h"

#include <algorithm>

#include "base/build_info.h"
#include "base/error.h"
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

std::vector<int32_t> LilyServer::tokenize(const ChatRequest& request, std::vector<int64_t>* message_starts,
                                          ChatEncodeTimings* timings) const {
  try {
    return chat_template_->encode(*tokenizer_, request.messages, template_options(request.agent, options_.reasoning),
                                  message_starts, timings);
  } catch (const Error& e) {
    throw invalid_request(std::string("messages cannot be rendered with the chat template: ") + e.what(),
                          "messages");
  }
}

int64_t LilyServer::checked_max_tokens(const ChatCall& call, int64_t prompt_tokens) const {
  const GenerationFields& request = call.request;
  const int64_t room = max_seq_ - prompt_tokens;
  if (room < 1)
    throw invalid_request("the prompt has " + std::to_string(prompt_tokens) + " tokens but --max-seq is " +
                              std::to_string(max_seq_) + ", which leaves no room for a completion",
                          call.prompt_param, "context_length_exceeded");
  const int64_t cap = options_.max_tokens_cap;
  if (!request.max_tokens) return cap > 0 ? std::min(room, cap) : room;
  if (cap > 0 && *request.max_tokens > cap)
    throw invalid_request("max_tokens (" + std::to_string(*request.max_tokens) + ") exceeds this server's cap of " +
                              std::to_string(cap) + " (--max-tokens)",
                          "max_tokens", "max_tokens_exceeded");
  if (*request.max_tokens > room)
    throw invalid_request("prompt (" + std::to_string(prompt_tokens) + " tokens) + max_tokens (" +
                              std::to_string(*request.max_tokens) + ") exceeds --max-seq " +
                              std::to_string(max_seq_),
                          "max_tokens", "context_length_exceeded");
  return *request.max_tokens;
}

std::shared_ptr<Job> LilyServer::submit(ChatCall& call, std::vector<int32_t> prompt, int64_t max_tokens) {
  JobRequest job;
  job.prompt = std::move(prompt);
  job.max_tokens = max_tokens;
  job.stop_strings = call.request.stop;
  // parallel_tool_calls false: each choice ends with its first complete tool call.
  if (call.answer.single_call) job.stop_after_text = first_tool_call_stop(call.answer);
  job.cache_key = call.request.prompt_cache_key;
  job.message_starts = call.message_starts;
  job.sampling = request_sampling(call);
  job.n = call.request.n;
  job.logprobs = call.request.logprobs ? call.request.top_logprobs : -1;
  job.prefix_choices = call.prefix_choices;
  try {
    return scheduler_->submit(std::move(job));
  } catch (const QueueFullError& e) {
    throw ApiError(503, "server_error", std::string(e.what()) + "; retry later", std::nullopt, "server_overloaded")
        .with_header("Retry-After", "1");
  } catch (const ModelUnavailableError& e) {
    // The weights changed on disk: retrying this server does not help (no Retry-After).
    throw ApiError(503, "server_error", e.what(), std::nullopt, "model_unavailable");
  } catch (const ShuttingDownError& e) {
    throw ApiError(503, "server_error", e.what(), std::nullopt, "server_shutting_down").with_header("Retry-After", "5");
  }
}

void LilyServer::check_model(const std::string& model) const {
  if (model != model_name_)
    throw ApiError(404, "invalid_request_error",
                   "the model '" + model + "' does not exist; this server serves '" + model_name_ + "'", "model",
                   "model_not_found");
}

void LilyServer::check_ready() const {
  if (!ready_ || shutting_down_)
    throw ApiError(503, "server_error", shutting_down_ ? "the server is shutting down" : "the model is still loading",
                   std::nullopt, "server_not_ready")
        .with_header("Retry-After", "1");
}

std::vector<int32_t> LilyServer::checked_ids(const std::vector<int64_t>& ids, const std::string& param) const {
  // An id must have an embedding row and a tokenizer entry (or the text would lose it).
  const int64_t vocab = std::min<int64_t>(config_.vocab, tokenizer_->vocab_size());
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= vocab) {
      const std::string at = param + "[" + std::to_string(i) + "]";
      throw invalid_request("token id " + std::to_string(ids[i]) + " in '" + at + "' is outside the vocabulary (ids 0.." +
                                std::to_string(vocab - 1) + ")",
                            at);
    }
    out.push_back(static_cast<int32_t>(ids[i]));
  }
  return out;
}

SamplingParams LilyServer::request_sampling(ChatCall& call) const {
  const RequestSampling& r = call.request.sampling;
  SamplingParams p = sampling_defaults_;
  if (r.temperature) p.temperature = static_cast<float>(*r.temperature);
  if (r.top_p) p.top_p = static_cast<float>(*r.top_p);
  if (r.top_k) p.top_k = static_cast<int32_t>(std::clamp<int64_t>(*r.top_k, 0, INT32_MAX));
  if (r.min_p) p.min_p = static_cast<float>(*r.min_p);
  if (r.presence_penalty) p.presence_penalty = static_cast<float>(*r.presence_penalty);
  if (r.frequency_penalty) p.frequency_penalty = static_cast<float>(*r.frequency_penalty);
  if (r.repetition_penalty) p.repetition_penalty = static_cast<float>(*r.repetition_penalty);
  for (const auto& [id, bias] : r.logit_bias) {
    if (id >= config_.vocab)
      throw invalid_request("'logit_bias' token id " + std::to_string(id) + " is not in the vocabulary (ids 0 … " +
                                std::to_string(config_.vocab - 1) + ")",
                            "logit_bias", "invalid_value");
    p.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
  if (r.seed) call.seed = static_cast<uint64_t>(*r.seed);
  else if (options_.sampling.seed) call.seed = static_cast<uint64_t>(*options_.sampling.seed);
  else call.seed = fresh_seed();
  p.seed = call.seed;
  return p;
}

LogprobEntry LilyServer::logprob_entry(const TokenLogprobs& lp) const {
  LogprobEntry e{tokenizer_->token_bytes(lp.token), lp.logprob, {}};
  for (const auto& t : lp.top) e.top.push_back(LogprobEntry{tokenizer_->token_bytes(t.token), t.logprob, {}});
  return e;
}

ordered_json LilyServer::logprobs_field(const ChatCall& call, const std::vector<TokenLogprobs>& lps) const {
  if (!call.request.logprobs) return nullptr;
  std::vector<LogprobEntry> entries;
  for (const auto& lp : lps) entries.push_back(logprob_entry(lp));
  return logprobs_json(entries);
}

void LilyServer::handle_chat(Exchange& ex, const Request& req, Reply& res) {
  ChatCall call;
  std::vector<int32_t> prompt;
  try {
    auto t0 = Clock::now();
    ChatRequest request = parse_chat_request(req.body());
    call.phases.parse = seconds(Clock::now() - t0);
    check_model(request.model);
    check_ready();
    ChatEncodeTimings encoding;
    prompt = tokenize(request, &call.message_starts, &encoding);
    call.phases.template_render = encoding.render_seconds;
    call.phases.tokenize = encoding.tokenize_seconds;
    call.answer.thinking = thinking_enabled(request.agent, options_.reasoning);
    if (request.agent.tools_active()) {
      call.answer.tools.emplace(request.agent.tools);
      call.answer.single_call = request.agent.parallel_tool_calls == false;
    }
    // tool_choice "required" or a named function: the answer's opening is forced, as prompt
    // tokens (the markers become the control tokens the model would write), and the parser
    // reads it as the start of the answer.
    call.answer.prefix = forced_answer_prefix(request.agent, call.answer.thinking);
    if (!call.answer.prefix.empty()) {
      t0 = Clock::now();
      const std::vector<int32_t> forced = tokenizer_->encode(call.answer.prefix, /*allow_special=*/true);
      prompt.insert(prompt.end(), forced.begin(), forced.end());
      call.phases.tokenize += seconds(Clock::now() - t0);
    }
    // "required" with several tools: the opening stops before the name, and the engine holds
    // the model to the declared names (a token-level constraint, engine/prefix_choice.h).
    call.prefix_choices = forced_name_choices(request.agent);
    call.request = std::move(request);
  } catch (const ApiError& e) {
    return send_error(res, e);
  }
  generate_and_respond(call, std::move(prompt), ex, res);
}

void LilyServer::handle_completion(Exchange& ex, const Request& req, Reply& res) {
  ChatCall call;
  call.text_completion = true;
  call.prompt_param = "prompt";
  std::vector<int32_t> prompt;
  try {
    auto t0 = Clock::now();
    CompletionRequest request = parse_completion_request(req.body());
    call.phases.parse = seconds(Clock::now() - t0);
    check_model(request.model);
    check_ready();
    // Text is encoded as the model sees it: special-token strings (<|im_start|>) become their
    // control tokens, as a raw prompt of `lily generate --raw`.
    t0 = Clock::now();
    prompt = request.prompt_text ? tokenizer_->encode(*request.prompt_text, /*allow_special=*/true)
                                 : checked_ids(request.prompt_ids, request.prompt_param);
    call.phases.tokenize = seconds(Clock::now() - t0);
    if (prompt.empty()) throw invalid_request("'prompt' encodes to no tokens", "prompt");
    call.request = std::move(request);
  } catch (const ApiError& e) {
    return send_error(res, e);
  }
  generate_and_respond(call, std::move(prompt), ex, res);
}

void LilyServer::generate_and_respond(ChatCall& call, std::vector<int32_t> prompt, Exchange& ex, Reply& res) {
  call.start = t_request.start;
  call.request_id = t_request.id;
  try {
    call.prompt_tokens = static_cast<int64_t>(prompt.size());
    const int64_t max_tokens = checked_max_tokens(call, call.prompt_tokens);
    call.submitted = Clock::now();
    call.job = submit(call, std::move(prompt), max_tokens);
    t_request.generation = true;
    call.meta = CompletionMeta{(call.text_completion ? "cmpl-" : "chatcmpl-") + random_hex(24),
                               std::chrono::duration_cast<std::chrono::seconds>(
                                   std::chrono::system_clock::now().time_since_epoch()).count(),
                               model_name_, std::string("lily-") + lily::build_commit()};
  } catch (const ApiError& e) {
    return send_error(res, e);
  }
  // From here on the job runs: whatever happens to the connection, it must not outlive its request.
  struct CancelOnExit {
    Scheduler& scheduler;
    const std::shared_ptr<Job>& job;
    ~CancelOnExit() { scheduler.cancel(job); }
  } cancel_on_exit{*scheduler_, call.job};
  if (call.request.stream) return respond_stream(call, ex, res);
  respond_whole(call, ex, res);
}

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

void LilyServer::respond_whole(ChatCall& call, Exchange& ex, Reply& res) {
  ConnectionWatch watch(ex.fd());
  bool client_gone = false;
  std::optional<Clock::time_point> last;
  std::vector<GenerationResult> results;
  while (true) {
    JobEvent e = *next_event(call, ex, watch, client_gone);
    if (e.kind == JobEvent::Kind::kToken) {
      observe_token(call, e, last);
      continue;
    }
    if (e.kind == JobEvent::Kind::kFailed) throw failure(call, e.text, e.model_unavailable);
    const bool cancelled = e.result.finish_reason == FinishReason::kCancelled;
    const Clock::time_point done_at = e.at;
    add_engine_phases(call.phases, e.timings);
    results.push_back(std::move(e.result));
    if (!cancelled && e.choice + 1 < call.request.n) continue;
    record_done(call, results, done_at);
    if (cancelled && !client_gone) throw failure(call, "generation was cancelled");
    if (call.text_completion) {  // legacy completions: one choice, no logprobs
      const GenerationResult& r = results.front();
      set_json(res, 200, dump(text_completion_json(call.meta, r.text, std::string(finish_reason_name(r.finish_reason)),
                                                   usage_of(results))));
      return;
    }
    ordered_json choices = ordered_json::array();
    for (size_t i = 0; i < results.size(); ++i) {
      const GenerationResult& r = results[i];
      const AssistantMessage message = parse_answer(r.text, call.answer);  // reasoning, content, tool calls
      const std::string finish =
          answer_finish_reason(std::string(finish_reason_name(r.finish_reason)), message.tool_calls.size());
      ordered_json choice = choice_json(static_cast<int>(i), message.content, finish, logprobs_field(call, r.logprobs),
                                        static_cast<int64_t>(choice_seed(call.seed, static_cast<int>(i))));
      choice["message"] = assistant_message_json(message);
      choices.push_back(std::move(choice));
    }
    set_json(res, 200, dump(completion_json(call.meta, choices, usage_of(results))));
    return;
  }
}

void LilyServer::respond_stream(ChatCall& call, Exchange& ex, const Reply& res) {
  ConnectionWatch watch(ex.fd());
  auto headers = res.headers;
  headers.emplace_back("Cache-Control", "no-cache");
  bool ok = ex.begin_stream("text/event-stream", headers);
  if (!ok) scheduler_->cancel(call.job);
  // A stream whose client went away ends without its last chunk: the connection is dropped.
  if (stream_events(call, ex, watch, !ok) && ok) ex.end_stream();
}

bool LilyServer::stream_events(ChatCall& call, Exchange& ex, const ConnectionWatch& watch, bool client_gone) {
  const bool usage_field = call.request.include_usage;
  auto send = [&](const ordered_json& doc) { return ex.write_chunk(sse_event(dump(doc))); };
  // A piece of text of choice `i`, or its last chunk with the finish reason, in the endpoint's shape.
  auto text_chunk = [&](int i, const std::string& text, const ordered_json& logprobs) {
    return call.text_completion
               ? text_chunk_json(call.meta, text, std::nullopt, usage_field)
               : chunk_json(call.meta, i, ordered_json{{"content", text}}, logprobs, std::nullopt, usage_field);
  };
  auto finish_chunk = [&](int i, const std::string& reason) {
    return call.text_completion ? text_chunk_json(call.meta, "", reason, usage_field)
                                : chunk_json(call.meta, i, ordered_json::object(), nullptr, reason, usage_field);
  };
  // Chat streams open each choice with the assistant's role, which also carries the seed it runs
  // with; legacy completions streams have no role chunk.
  auto begin_choice = [&](int i) {
    if (client_gone || call.text_completion) return;
    client_gone = !send(chunk_json(call.meta, i, ordered_json{{"role", "assistant"}, {"content", ""}}, nullptr,
                                   std::nullopt, usage_field, static_cast<int64_t>(choice_seed(call.seed, i))));
    if (client_gone) scheduler_->cancel(call.job);
  };
  begin_choice(0);
  // Chat text goes through the answer parser of the current choice (reasoning, content, tool
  // calls); legacy text is sent as is. Pending log-probabilities ride on the next chunk sent.
  std::vector<TokenLogprobs> pending;  // log-probabilities of tokens whose text is still held back
  std::optional<AnswerParser> parser;
  parser.emplace(call.answer);
  auto send_deltas = [&](int i, const std::vector<AnswerDelta>& deltas) {
    for (const AnswerDelta& d : deltas)
      for (const ordered_json& delta : delta_json(d)) {
        if (!send(chunk_json(call.meta, i, delta, logprobs_field(call, pending), std::nullopt, usage_field)))
          return false;
        pending.clear();
      }
    return true;
  };
  auto send_piece = [&](int i, const std::string& text) {
    if (!call.text_completion) return send_deltas(i, parser->push(text));
    pending.clear();
    return send(text_chunk(i, text, nullptr));
  };
  std::optional<Clock::time_point> last;
  std::vector<GenerationResult> results;
  size_t sent = 0;  // text bytes of the current choice sent so far
  while (true) {
    JobEvent e = *next_event(call, ex, watch, client_gone);
    if (e.kind == JobEvent::Kind::kToken) {
      observe_token(call, e, last);
      if (e.logprobs) pending.push_back(std::move(*e.logprobs));
      if (e.text.empty() || client_gone) continue;
      sent += e.text.size();
      if (!send_piece(e.choice, e.text)) {
        client_gone = true;
        scheduler_->cancel(call.job);
      }
      continue;
    }
    if (e.kind == JobEvent::Kind::kDone) {
      add_engine_phases(call.phases, e.timings);
      results.push_back(e.result);
    }
    const bool last_choice = e.kind != JobEvent::Kind::kDone ||
                             e.result.finish_reason == FinishReason::kCancelled || e.choice + 1 >= call.request.n;
    if (client_gone) {
      if (e.kind == JobEvent::Kind::kDone && last_choice) record_done(call, results, e.at);
      if (last_choice) return false;
      continue;
    }
    if (e.kind == JobEvent::Kind::kFailed) {
      const ApiError err = failure(call, e.text, e.model_unavailable);
      t_request.error = err.message();
      send(ordered_json(err.body()));
      return ex.write_chunk("data: [DONE]\n\n");
    }
    const GenerationResult& r = e.result;
    if (last_choice) record_done(call, results, e.at);
    if (r.text.size() > sent) send_piece(e.choice, r.text.substr(sent));
    if (!call.text_completion) send_deltas(e.choice, parser->finish());
    if (!pending.empty() && call.request.logprobs)  // tokens whose text was held back to the end
      send(chunk_json(call.meta, e.choice, ordered_json{{"content", ""}}, logprobs_field(call, pending), std::nullopt,
                      usage_field));
    pending.clear();
    sent = 0;
    if (r.finish_reason == FinishReason::kCancelled) {
      // Cut by the engine (the end of the shutdown grace), not finished: an error event, as
      // respond_whole answers the same case with an error status (was finish_reason "length").
      const ApiError err = failure(call, "generation was cancelled");
      t_request.error = err.message();
      send(ordered_json(err.body()));
      return ex.write_chunk("data: [DONE]\n\n");
    }
    const std::string reason(finish_reason_name(r.finish_reason));
    send(finish_chunk(e.choice, call.text_completion ? reason : answer_finish_reason(reason, parser->tool_calls())));
    if (!last_choice) {
      begin_choice(e.choice + 1);
      parser.emplace(call.answer);
      continue;
    }
    if (usage_field)
      send(usage_chunk_json(call.meta, usage_of(results), call.text_completion ? "text_completion" : "chat.completion.chunk"));
    return ex.write_chunk("data: [DONE]\n\n");
  }
}

}  // namespace lily::server::detail
