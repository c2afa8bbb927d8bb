#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>

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
  TextStream(const Tokenizer* tokenizer, const std::vector<std::string>& stops)
      : matcher_(stops) {
    if (tokenizer != nullptr) {
      // IncrementalDecoder wants shared ownership; the caller guarantees the tokenizer outlives us.
      auto alias = std::shared_ptr<const Tokenizer>(std::shared_ptr<const Tokenizer>(), tokenizer);
      decoder_ = std::make_unique<IncrementalDecoder>(alias, true);
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

GenerationResult generate(Backend& backend, SequenceState& state, std::span<const int32_t> prompt,
                          const GenerationParams& params, const Tokenizer* tokenizer,
                          const TokenCallback& on_token, const PromptPrefixHook& on_prompt_prefix,
                          const LogprobsCallback& on_logprobs) {
  check_generation_inputs(state, prompt, params, tokenizer);
  const int64_t n = static_cast<int64_t>(prompt.size());
  GenerationResult result;
  result.prompt_tokens = n;
  result.cached_tokens = state.position();
  result.timings.prefill_tokens = n - state.position();

  // Plain greedy takes the backend's argmax as is (bit-exact, no logits copied); sampling,
  // penalties, bias and log-probabilities need the logits row of every step on the host.
  const SamplingParams& sp = params.sampling;
  const bool want_logprobs = params.logprobs >= 0;
  const bool need_logits = !sp.plain_greedy() || want_logprobs;
  std::vector<float> logits;
  std::vector<float>* logits_out = need_logits ? &logits : nullptr;
  TokenHistory history(backend.config().vocab);
  const bool track_history = sp.modifies_logits();
  if (track_history && sp.repetition_penalty != 1.0f) history.add_prompt(prompt);
  Sampler sampler;
  auto is_stop_id = [&](int32_t id) {
    return std::find(params.stop_ids.begin(), params.stop_ids.end(), id) != params.stop_ids.end();
  };
  // The token after a backend step: its argmax, or the sampler's choice from its logits.
  auto choose = [&](int32_t argmax) {
    if (!need_logits) return argmax;
    if (logits.empty()) throw InternalError("generate: the " + backend.name() + " backend returned no logits");
    const auto step = static_cast<uint64_t>(result.token_ids.size());
    const int32_t token = sp.plain_greedy() ? argmax : sampler.sample(logits, sp, history, step);
    if (track_history) history.add_generated(token);
    if (want_logprobs && !is_stop_id(token)) {
      result.logprobs.push_back(token_logprobs(logits, token, params.logprobs));
      if (on_logprobs) on_logprobs(result.logprobs.back());
    }
    return token;
  };

  // Prefill: up to each split point (message boundaries, each a snapshot point), then everything
  // but the last prompt token, a snapshot point, then the last token. The splits are the same
  // with or without a cache, so outputs never depend on the cache.
  const auto t0 = Clock::now();
  for (int64_t split : params.prompt_splits) {
    if (split <= state.position() || split >= n - 1) continue;
    backend.prefill(state, prompt.subspan(state.position(), split - state.position()));
    if (on_prompt_prefix) on_prompt_prefix(state, split);
  }
  if (state.position() < n - 1) backend.prefill(state, prompt.subspan(state.position(), n - 1 - state.position()));
  if (n >= 2 && on_prompt_prefix) on_prompt_prefix(state, n - 1);
  int32_t next = choose(backend.prefill(state, prompt.subspan(n - 1, 1), logits_out));
  result.timings.prefill_seconds = seconds_since(t0);

  TextStream text(tokenizer, params.stop_strings);
  const auto t1 = Clock::now();
  while (true) {
    result.token_ids.push_back(next);
    const bool stop_token = is_stop_id(next);
    std::string piece = stop_token ? std::string() : text.push(next);
    const bool go_on = !on_token || on_token(next, piece);
    if (stop_token || text.stopped()) {
      result.finish_reason = FinishReason::kStop;
      break;
    }
    if (!go_on) {
      result.finish_reason = FinishReason::kCancelled;
      break;
    }
    if (static_cast<int64_t>(result.token_ids.size()) >= params.max_tokens ||
        state.position() >= params.max_seq) {
      result.finish_reason = FinishReason::kLength;
      break;
    }
    logits.clear();
    next = choose(backend.decode(state, next, logits_out));
    ++result.timings.decode_steps;
  }
  result.timings.decode_seconds = result.timings.decode_steps > 0 ? seconds_since(t1) : 0.0;
  text.finish();
  result.text = text.text();
  result.fed_tokens = static_cast<int64_t>(result.token_ids.size()) - 1;
  return result;
}

std::vector<int32_t> stop_token_ids(const ModelConfig& config, const std::filesystem::path& model_dir,
                                    const Tokenizer* tokenizer) {
  std::vector<int32_t> ids = config.eos_token_ids;
  const auto path = model_dir / "tokenizer_config.json";
  if (tokenizer != nullptr && std::filesystem::exists(path)) {
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
  if (!std::filesystem::exists(path)) return p;
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
