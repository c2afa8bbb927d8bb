#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "engine/stop_strings.h"

namespace lily {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check_generation_inputs(const SequenceState& state, std::span<const int32_t> prompt,
                             const GenerationParams& params, const Tokenizer* tokenizer) {
  if (prompt.empty()) throw Error("generate: the prompt is empty");
  if (params.max_tokens <= 0) throw Error("generate: max_tokens must be at least 1");
  if (params.max_seq <= 0) throw Error("generate: max_seq must be at least 1");
  if (params.min_tokens < 0) throw Error("generate: min_tokens must be at least 0");
  if (static_cast<int64_t>(prompt.size()) > params.max_seq)
    throw Error("generate: the prompt has " + std::to_string(prompt.size()) +
                " tokens but max_seq is " + std::to_string(params.max_seq));
  if (!params.stop_strings.empty() && tokenizer == nullptr)
    throw Error("generate: stop strings need a tokenizer");
  for (size_t i = 0; i < params.prompt_splits.size(); ++i) {
    const int64_t split = params.prompt_splits[i];
    if (split < 1 || split >= static_cast<int64_t>(prompt.size()) || (i > 0 && split <= params.prompt_splits[i - 1]))
      throw Error("generate: prompt_splits must be strictly increasing positions in [1, " +
                  std::to_string(prompt.size()) + "), got " + std::to_string(split) + " at index " + std::to_string(i));
  }
  if (state.position() >= static_cast<int64_t>(prompt.size()))
    throw InternalError("generate: the state already holds the whole prompt (position " +
                        std::to_string(state.position()) + ")");
}

/// Turns generated ids into releasable text: incremental UTF-8 detokenization (special tokens
/// skipped) followed by stop-string hold-back.
class TextStream {
 public:
  TextStream(const Tokenizer* tokenizer, const std::vector<std::string>& stops, std::vector<int32_t> kept_special)
      : matcher_(stops) {
    if (tokenizer != nullptr) {
      // IncrementalDecoder wants shared ownership; the caller guarantees the tokenizer outlives us.
      auto alias = std::shared_ptr<const Tokenizer>(std::shared_ptr<const Tokenizer>(), tokenizer);
      decoder_ = std::make_unique<IncrementalDecoder>(alias, true, std::move(kept_special));
    }
  }
  /// Text released by one more (non-stop) token.
  std::string push(int32_t id) {
    if (!decoder_) return {};
    return release(matcher_.push(decoder_->push(id)));
  }
  /// Text released at the end of generation (decoder tail, held-back text).
  std::string finish() {
    if (!decoder_) return {};
    std::string out = matcher_.push(decoder_->flush());
    out += matcher_.finish();
    return release(std::move(out));
  }
  bool stopped() const { return matcher_.stopped(); }
  const std::string& text() const { return text_; }

 private:
  std::string release(std::string piece) {
    text_ += piece;
    return piece;
  }
  std::unique_ptr<IncrementalDecoder> decoder_;
  StopStringMatcher matcher_;
  std::string text_;
};

}  // namespace

std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

double GenerationTimings::prefill_tokens_per_s() const {
  return prefill_seconds > 0 ? static_cast<double>(prefill_tokens) / prefill_seconds : 0.0;
}

double GenerationTimings::decode_tokens_per_s() const {
  return decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0;
}

struct Generation::Impl {
  Impl(const Tokenizer* tokenizer, const GenerationParams& params, int32_t vocab)
      : text(tokenizer, params.stop_strings, params.kept_special_ids), history(vocab) {}
  TextStream text;
  TokenHistory history;
  Sampler sampler;
  PenaltyEdits edits;  ///< the step-1 edits handed to a device sampler (next_row)
  std::optional<JsonConstraint> json;            ///< GenerationParams::json_schema
  bool json_waiting = false;  ///< the document has not started: json_after_id not yet generated
  std::optional<ToolCallConstraint> tool;        ///< GenerationParams::tool_call
  std::vector<float> masked;  ///< the logits row with the constraints' masks applied
  Clock::time_point t0;  ///< first step
  Clock::time_point t1;  ///< first generated token
};

Generation::Generation(const Backend& backend, SequenceState& state, std::span<const int32_t> prompt,
                       const GenerationParams& params, const Tokenizer* tokenizer, TokenCallback on_token,
                       PromptPrefixHook on_prompt_prefix, LogprobsCallback on_logprobs)
    : backend_(backend),
      state_(state),
      prompt_(prompt),
      params_(params),
      tokenizer_(tokenizer),
      on_token_(std::move(on_token)),
      on_prompt_prefix_(std::move(on_prompt_prefix)),
      on_logprobs_(std::move(on_logprobs)) {
  check_generation_inputs(state, prompt, params, tokenizer);
  if (params.prefill_chunk < 0) throw Error("generate: prefill_chunk must be ≥ 0");
  if (params.json_schema && tokenizer == nullptr) throw Error("generate: a JSON schema needs a tokenizer");
  if (params.tool_call && tokenizer == nullptr) throw Error("generate: a tool-call grammar needs a tokenizer");
  impl_ = std::make_unique<Impl>(tokenizer, params, backend.config().vocab);
  if (params.json_schema) {
    impl_->json.emplace(params.json_schema, JsonVocabIndex::for_tokenizer(*tokenizer, backend.config().vocab),
                        params.stop_ids);
    impl_->json_waiting = params.json_after_id >= 0;
  }
  if (params.tool_call)
    impl_->tool.emplace(params.tool_call,
                        ToolCallVocab::for_tokenizer(*tokenizer, backend.config().vocab, params.kept_special_ids),
                        params.stop_ids);
  const int64_t n = static_cast<int64_t>(prompt.size());
  result_.prompt_tokens = n;
  result_.cached_tokens = state.position();
  result_.timings.prefill_tokens = n - state.position();
  const SamplingParams& sp = params_.sampling;
  if (sp.modifies_logits() && sp.repetition_penalty != 1.0f) impl_->history.add_prompt(prompt);
}

Generation::~Generation() = default;

bool Generation::prefilling() const { return !done_ && state_.position() < static_cast<int64_t>(prompt_.size()); }

// The prefill stops at each split point (message boundaries, each a snapshot point), before the
// last prompt token (a snapshot point) and, with a prefill chunk, at its multiples. The cuts
// are the same with or without a cache, so outputs never depend on the cache.
int64_t Generation::next_cut() const {
  const int64_t n = static_cast<int64_t>(prompt_.size()), pos = state_.position();
  if (pos >= n - 1) return n;
  int64_t cut = n - 1;
  for (int64_t split : params_.prompt_splits)
    if (split > pos) {
      cut = std::min(cut, split);
      break;
    }
  if (params_.prefill_chunk > 0) cut = std::min(cut, (pos / params_.prefill_chunk + 1) * params_.prefill_chunk);
  return cut;
}

int64_t Generation::next_row_tokens() const { return prefilling() ? next_cut() - state_.position() : 1; }

StepRow Generation::next_row() {
  if (done_) throw InternalError("generate: next_row after the generation ended");
  const int64_t n = static_cast<int64_t>(prompt_.size());
  if (!started_) {
    started_ = true;
    impl_->t0 = Clock::now();
    // A state that resumes right before the last prompt token is at that snapshot point already.
    if (on_prompt_prefix_ && n >= 2 && state_.position() == n - 1) on_prompt_prefix_(state_, n - 1);
  }
  const SamplingParams& sp = params_.sampling;
  const bool device_sampling = samples_on_device();
  const bool need_logits = params_.logprobs >= 0 || constrained() || (!sp.plain_greedy() && !device_sampling);
  StepRow row;
  row.state = &state_;
  row.position = state_.position();
  if (prefilling()) {
    const int64_t cut = next_cut();
    row.tokens = prompt_.subspan(row.position, cut - row.position);
    row.want_logits = cut == n;
  } else {
    row.tokens = std::span<const int32_t>(&pending_, 1);
    row.decode = true;
  }
  if (row.want_logits && need_logits) {
    logits_.clear();
    row.logits = &logits_;
  }
  if (row.want_logits && device_sampling) {
    // The backend samples on its device: hand it the parameters, the Philox counter and the
    // (small) list of logits that bias and penalties change; only the id comes back.
    impl_->edits = sp.modifies_logits() ? penalty_edits(sp, impl_->history, backend_.config().vocab) : PenaltyEdits{};
    row.sampling.params = &sp;
    row.sampling.step = static_cast<uint64_t>(result_.token_ids.size());
    row.sampling.edits = &impl_->edits;
  }
  return row;
}

bool Generation::samples_on_device() const {
  return !params_.sampling.plain_greedy() && backend_.samples_on_device() && !constrained();
}

bool Generation::constrained() const {
  return json_constraining() || (impl_->tool && impl_->tool->active()) || stops_masked();
}

bool Generation::json_constraining() const {
  return impl_->json && !impl_->json_waiting && impl_->json->active();
}

bool Generation::stops_masked() const {
  return !params_.stop_ids.empty() && static_cast<int64_t>(result_.token_ids.size()) < params_.min_tokens;
}

// The token after a backend step: its argmax, the backend's own sample (samples_on_device:
// `next` is already the sampled id), or the host sampler's choice from the logits. Plain greedy
// takes the backend's argmax as is (bit-exact, no logits copied); host sampling, penalties and
// bias on a backend without a device sampler, and log-probabilities (always computed on the
// host) need the logits row of every step on the host. While a constraint (JSON, tool call)
// is active, the host sampler (greedy or not) chooses from the row with the disallowed
// tokens (and, before min_tokens, the stop tokens) at −inf.
int32_t Generation::choose(int32_t next) {
  const SamplingParams& sp = params_.sampling;
  const bool want_logprobs = params_.logprobs >= 0;
  const bool constrained = this->constrained();
  if (sp.plain_greedy() && !want_logprobs && !constrained) return next;
  const bool on_device = samples_on_device();
  if (logits_.empty() && (want_logprobs || constrained || !on_device))
    throw InternalError("generate: the " + backend_.name() + " backend returned no logits");
  const auto step = static_cast<uint64_t>(result_.token_ids.size());
  int32_t token;
  if (constrained) {
    impl_->masked.assign(logits_.begin(), logits_.end());
    const bool json = json_constraining();
    if (json) impl_->json->mask(impl_->masked);
    const bool tool = impl_->tool && impl_->tool->active();
    if (tool) impl_->tool->mask(impl_->masked);
    // A finished document or tool call needs its stop.
    if (stops_masked() && !(json && impl_->json->complete()) && !(tool && impl_->tool->complete()))
      for (int32_t id : params_.stop_ids)
        if (id >= 0 && static_cast<size_t>(id) < impl_->masked.size())
          impl_->masked[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
    token = impl_->sampler.sample(impl_->masked, sp, impl_->history, step);
    if (json) impl_->json->push(token);
    if (tool) impl_->tool->push(token);
  } else {
    token = sp.plain_greedy() || on_device ? next : impl_->sampler.sample(logits_, sp, impl_->history, step);
  }
  if (sp.modifies_logits()) impl_->history.add_generated(token);
  const bool stop = std::find(params_.stop_ids.begin(), params_.stop_ids.end(), token) != params_.stop_ids.end();
  if (want_logprobs && !stop) {
    result_.logprobs.push_back(token_logprobs(logits_, token, params_.logprobs));
    if (on_logprobs_) on_logprobs_(result_.logprobs.back());
  }
  return token;
}

void Generation::advance(int32_t next) {
  if (done_) throw InternalError("generate: advance after the generation ended");
  const int64_t n = static_cast<int64_t>(prompt_.size());
  if (result_.token_ids.empty()) {
    const int64_t pos = state_.position();
    if (pos < n) {  // a prefill chunk that does not end the prompt
      const bool split = std::binary_search(params_.prompt_splits.begin(), params_.prompt_splits.end(), pos);
      if (on_prompt_prefix_ && (split || pos == n - 1)) on_prompt_prefix_(state_, pos);
      return;
    }
    const int32_t token = choose(next);
    result_.timings.prefill_seconds = seconds_since(impl_->t0);
    impl_->t1 = Clock::now();
    emit(token);
    return;
  }
  const int32_t token = choose(next);
  ++result_.timings.decode_steps;
  emit(token);
}

void Generation::emit(int32_t token) {
  result_.token_ids.push_back(token);
  if (impl_->json_waiting && token == params_.json_after_id) impl_->json_waiting = false;  // the document starts
  const bool stop_token =
      std::find(params_.stop_ids.begin(), params_.stop_ids.end(), token) != params_.stop_ids.end();
  std::string piece = stop_token ? std::string() : impl_->text.push(token);
  const bool go_on = !on_token_ || on_token_(token, piece);
  const bool text_stop = params_.stop_after_text && !piece.empty() && params_.stop_after_text(piece);
  // A JSON document or tool call closed with no stop token to force after it (ignore_eos): it
  // ends here.
  const bool document_done = ((impl_->json && impl_->json->complete()) || (impl_->tool && impl_->tool->complete())) &&
                             params_.stop_ids.empty();
  if (stop_token || impl_->text.stopped() || text_stop || document_done) return finish(FinishReason::kStop);
  if (!go_on) return finish(FinishReason::kCancelled);
  if (static_cast<int64_t>(result_.token_ids.size()) >= params_.max_tokens || state_.position() >= params_.max_seq)
    return finish(FinishReason::kLength);
  pending_ = token;
}

void Generation::cancel() {
  if (done_) return;
  if (result_.token_ids.empty() && started_) result_.timings.prefill_seconds = seconds_since(impl_->t0);
  finish(FinishReason::kCancelled);
}

void Generation::finish(FinishReason reason) {
  result_.finish_reason = reason;
  result_.timings.decode_seconds = result_.timings.decode_steps > 0 ? seconds_since(impl_->t1) : 0.0;
  impl_->text.finish();
  result_.text = impl_->text.text();
  result_.fed_tokens = std::max<int64_t>(0, static_cast<int64_t>(result_.token_ids.size()) - 1);
  done_ = true;
}

GenerationResult generate(Backend& backend, SequenceState& state, std::span<const int32_t> prompt,
                          const GenerationParams& params, const Tokenizer* tokenizer,
                          const TokenCallback& on_token, const PromptPrefixHook& on_prompt_prefix,
                          const LogprobsCallback& on_logprobs) {
  Generation g(backend, state, prompt, params, tokenizer, on_token, on_prompt_prefix, on_logprobs);
  while (!g.done()) {
    const StepRow row = g.next_row();
    g.advance(backend.step(std::span<const StepRow>(&row, 1)).front());
  }
  return g.take_result();
}

void check_tokenizer_vocab(const ModelConfig& config, const Tokenizer& tokenizer) {
  if (tokenizer.vocab_size() > config.vocab)
    throw Error("tokenizer.json has ids up to " + std::to_string(tokenizer.vocab_size() - 1) +
                ", beyond the model's vocabulary of " + std::to_string(config.vocab));
}

std::vector<int32_t> stop_token_ids(const ModelConfig& config, const std::filesystem::path& model_dir,
                                    const Tokenizer* tokenizer) {
  std::vector<int32_t> ids = config.eos_token_ids;
  const auto path = model_dir / "tokenizer_config.json";
  if (tokenizer != nullptr && optional_file_exists(path)) {
    nlohmann::json doc = nlohmann::json::parse(read_regular_file(path), nullptr, false);
    if (doc.is_discarded() || !doc.is_object())
      throw Error(path.string() + ": not a JSON object");
    const auto it = doc.find("eos_token");
    std::string eos;
    if (it != doc.end() && it->is_string()) eos = it->get<std::string>();
    if (it != doc.end() && it->is_object() && it->contains("content") && (*it)["content"].is_string())
      eos = (*it)["content"].get<std::string>();
    if (!eos.empty()) {
      if (auto id = tokenizer->token_id(eos)) ids.push_back(*id);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

SamplingParams generation_config_sampling(const std::filesystem::path& model_dir) {
  SamplingParams p;
  const auto path = model_dir / "generation_config.json";
  if (!optional_file_exists(path)) return p;
  nlohmann::json doc = nlohmann::json::parse(read_regular_file(path), nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) throw Error(path.string() + ": not a JSON object");
  auto number = [&](const char* key, double dflt, double lo, double hi) {
    const auto it = doc.find(key);
    if (it == doc.end() || it->is_null()) return dflt;
    if (!it->is_number() || it->get<double>() < lo || it->get<double>() > hi)
      throw Error(path.string() + ": '" + key + "' must be a number in [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
    return it->get<double>();
  };
  const auto sample = doc.find("do_sample");
  if (sample != doc.end() && !sample->is_null() && !sample->is_boolean())
    throw Error(path.string() + ": 'do_sample' must be a boolean");
  const bool do_sample = sample != doc.end() && sample->is_boolean() && sample->get<bool>();
  p.repetition_penalty = static_cast<float>(number("repetition_penalty", 1.0, 1e-6, 1e6));
  if (!do_sample) return p;
  p.temperature = static_cast<float>(number("temperature", 1.0, 0.0, 100.0));
  p.top_p = static_cast<float>(number("top_p", 1.0, 0.0, 1.0));
  p.top_k = static_cast<int32_t>(number("top_k", 50, 0, 1e9));
  p.min_p = static_cast<float>(number("min_p", 0.0, 0.0, 1.0));
  if (p.top_p <= 0.0f) p.top_p = 1.0f;
  return p;
}

}  // namespace lily
