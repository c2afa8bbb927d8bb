// LilyServer's generating endpoints: POST /v1/chat/completions and POST /v1/completions from
// the parsed request to the engine job (validation, tokenizing, sampling parameters, submit).
// From the job's events to the answer, whole or streamed, is answer.cpp.
#include "server/server_impl.h"

#include <algorithm>
#include <cctype>

#include "base/build_info.h"
#include "base/error.h"

namespace lily::server::detail {

std::vector<int32_t> LilyServer::tokenize(const ChatRequest& request, std::vector<int64_t>* message_starts,
                                          ChatEncodeTimings* timings) const {
  ChatTemplateOptions options = template_options(request.agent, options_.reasoning);
  if (request.continue_final_message) {
    options.add_generation_prompt = false;
    options.continue_final_message = true;
  }
  try {
    return chat_template_->encode(*tokenizer_, request.messages, options, message_starts, timings);
  } catch (const Error& e) {
    std::string detail = std::string("messages cannot be rendered with the chat template: ") + e.what();
    // OpenAI takes developer (= system) messages anywhere; a template that takes one system
    // message, first, says "System message …": name the message it means.
    std::string lower(e.what());
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    for (size_t i = 1; i < request.messages.size() && lower.find("system") != std::string::npos; ++i)
      if (request.messages[i].role == ChatRole::kSystem) {
        detail += " (messages[" + std::to_string(i) +
                  "] is a system or developer message; this template takes one, as the first message)";
        break;
      }
    throw invalid_request(detail, "messages");
  }
}

int64_t LilyServer::checked_max_tokens(const ChatCall& call, int64_t prompt_tokens) const {
  const GenerationFields& request = call.request;
  const int64_t room = max_seq_ - prompt_tokens;
  if (room < 0)
    throw invalid_request("the prompt has " + std::to_string(prompt_tokens) +
                              " tokens, more than this server's maximum context length of " + std::to_string(max_seq_) +
                              " tokens",
                          call.prompt_param, "context_length_exceeded");
  if (room < 1)
    throw invalid_request("the prompt has " + std::to_string(prompt_tokens) +
                              " tokens but this server's maximum context length is " + std::to_string(max_seq_) +
                              " tokens, which leaves no room for a completion",
                          call.prompt_param, "context_length_exceeded");
  const int64_t cap = options_.max_tokens_cap;
  if (!request.max_tokens) {
    int64_t n = cap > 0 ? std::min(room, cap) : room;
    // The legacy endpoint's default is OpenAI's (and vLLM's): a short completion, at least min_tokens.
    if (call.text_completion) n = std::min(n, std::max(kCompletionDefaultMaxTokens, request.min_tokens));
    if (request.min_tokens > n) {
      // Name the bound that applies, in the server's terms (a client cannot see the flags).
      const std::string bound =
          cap > 0 && cap <= room
              ? "this server's cap of " + std::to_string(cap) + " completion tokens"
              : "the room the prompt (" + std::to_string(prompt_tokens) + " tokens) leaves in this server's maximum "
                "context length of " + std::to_string(max_seq_) + " tokens";
      throw invalid_request("min_tokens (" + std::to_string(request.min_tokens) + ") exceeds the " + std::to_string(n) +
                                " tokens this request may generate: " + bound,
                            "min_tokens", "invalid_value");
    }
    return n;
  }
  if (cap > 0 && *request.max_tokens > cap)
    throw invalid_request("max_tokens (" + std::to_string(*request.max_tokens) + ") exceeds this server's cap of " +
                              std::to_string(cap) + " tokens",
                          "max_tokens", "max_tokens_exceeded");
  if (*request.max_tokens > room)
    throw invalid_request("prompt (" + std::to_string(prompt_tokens) + " tokens) + max_tokens (" +
                              std::to_string(*request.max_tokens) + ") exceeds this server's maximum context length of " +
                              std::to_string(max_seq_) + " tokens",
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
  job.tool_call = call.tool_call;
  job.min_tokens = call.request.min_tokens;
  job.ignore_eos = call.request.ignore_eos;
  job.json_schema = call.request.json_schema;
  job.json_after_id = call.json_after_id;
  job.stop_ids = checked_ids(call.request.stop_token_ids, "stop_token_ids");
  // A chat answer is split at its markers' text: keep it where the tokenizer marks one special.
  for (std::string_view marker : answer_markers(call.answer))
    if (const auto id = tokenizer_->token_id(marker); id && tokenizer_->is_special(*id)) job.kept_special_ids.push_back(*id);
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

ordered_json LilyServer::logprobs_field(const ChatCall& call, const std::vector<TokenLogprobs>& lps,
                                        int64_t* text_offset) const {
  if (!call.request.logprobs) return nullptr;
  std::vector<LogprobEntry> entries;
  for (const auto& lp : lps) entries.push_back(logprob_entry(lp));
  if (!call.text_completion) return logprobs_json(entries);
  int64_t start = 0;
  return legacy_logprobs_json(entries, text_offset != nullptr ? *text_offset : start);
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
    // A JSON answer is quickest without thinking: the server's default thinking is off for it
    // unless the request asks for thinking (enable_thinking, reasoning_effort).
    if (request.json_schema && !request.agent.enable_thinking && !request.agent.reasoning_effort)
      request.agent.enable_thinking = false;
    ChatEncodeTimings encoding;
    prompt = tokenize(request, &call.message_starts, &encoding);
    call.phases.template_render = encoding.render_seconds;
    call.phases.tokenize = encoding.tokenize_seconds;
    // A continued answer goes on from its content (the template wrote any think block before it).
    call.answer.thinking = thinking_enabled(request.agent, options_.reasoning) && !request.continue_final_message;
    call.answer.include_reasoning = request.agent.include_reasoning;
    // With thinking, the JSON document is the content after the think block: it starts once the
    // model has written "</think>".
    if (request.json_schema && call.answer.thinking) {
      const auto think_end = tokenizer_->token_id("</think>");
      if (!think_end)
        throw invalid_request("'response_format' with thinking needs a '</think>' token, which this model's "
                              "tokenizer does not have (send chat_template_kwargs.enable_thinking false)",
                              "response_format");
      call.json_after_id = *think_end;
    }
    // A JSON answer is content only: text in its strings that looks like a tool call stays text.
    if (request.agent.tools_active() && !request.json_schema) {
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
    // The rest of a forced call (the name, with several tools, then the parameters and the end
    // of the block) is held to the declared tools token by token (engine/tool_call_constraint.h).
    call.tool_call = forced_call_grammar(request.agent);
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
    if (request.echo) call.echo = request.prompt_text ? *request.prompt_text : tokenizer_->decode(prompt);
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

}  // namespace lily::server::detail
