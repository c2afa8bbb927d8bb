// The generation loop: prefill the uncached
// part of a prompt, then decode one token at a time until a stop token, a stop string,
// max_tokens, the state's capacity or a cancellation by the per-token callback. Each token is
// the backend's greedy argmax or, with sampling parameters, chosen by the CPU sampler
// (engine/sampler.h) from the logits row the backend copies back.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend.h"
#include "engine/json_constraint.h"
#include "engine/sampler.h"
#include "engine/tool_call_constraint.h"
#include "text/tokenizer.h"

namespace lily {

/// Why generation ended. kStop: a stop token or stop string; kLength: max_tokens or the
/// sequence capacity; kCancelled: the token callback returned false.
enum class FinishReason { kStop, kLength, kCancelled };

/// "stop" | "length" | "cancelled" (the first two are the OpenAI finish_reason values).
std::string_view finish_reason_name(FinishReason reason);

/// Settings of one generation. Units are tokens.
struct GenerationParams {
  int64_t max_tokens = 0;                 ///< > 0: most tokens generated (stop token included)
  int64_t max_seq = 0;                    ///< > 0: capacity of the state (prompt + fed tokens)
  std::vector<int32_t> stop_ids;          ///< generation ends after emitting one of these
  std::vector<std::string> stop_strings;  ///< text stops before the first occurrence (needs a tokenizer)
  /// Optional: fed every piece of text as it is released, in order (after stop-string hold-back);
  /// when it returns true the generation ends after that token with kStop and the text is kept
  /// whole (unlike a stop string). The server uses it to end an answer at its first complete
  /// tool call (`parallel_tool_calls: false`). Runs on the thread that advances the generation.
  std::function<bool(std::string_view released)> stop_after_text;
  /// How tokens are chosen. The default (plain greedy) takes the backend's argmax and never
  /// copies logits; anything else copies the [vocab] fp32 row of every step to the host.
  SamplingParams sampling;
  /// < 0: no log-probabilities; 0 … 20: each generated token's log-probability plus this many
  /// most likely alternatives (GenerationResult::logprobs).
  int logprobs = -1;
  /// Prompt positions where the prefill stops for a snapshot (the PromptPrefixHook): strictly
  /// increasing, each in [1, prompt length) (message boundaries of a chat prompt; lily::Error otherwise). The
  /// prefill is split at every one of them beyond the cached part, hook or not, so that the work
  /// done does not depend on what was cached.
  std::vector<int64_t> prompt_splits;
  /// > 0: the prefill is also cut at every absolute position that is a multiple of this (chunked
  /// prefill: a long prompt then shares steps with sequences that decode); 0: only at
  /// prompt_splits and before the last prompt token. The cuts depend on nothing but the prompt
  /// and this value, never on other sequences.
  int64_t prefill_chunk = 0;
  /// When set: structured output. Every token is chosen from the logits with the tokens masked
  /// out that would make the text no prefix of a JSON object of this schema, and once the object
  /// is closed only a stop token, or, without stop tokens, the generation ends there with kStop
  /// (engine/json_constraint.h; needs a tokenizer). These steps copy the logits to the host and
  /// choose there, even on a backend that samples on its device.
  std::shared_ptr<const JsonSchema> json_schema;
  /// ≥ 0 with json_schema: the document starts after the first generated token of this id (the
  /// end of a think block, "</think>"); the tokens before it, and all of them when it never comes,
  /// are chosen as without a schema. −1: the document starts at the first generated token.
  int32_t json_after_id = -1;
  /// When set: the rest of a forced tool call (engine/tool_call_constraint.h; needs a
  /// tokenizer). Every token is chosen with the tokens masked out that would leave the call
  /// format or the named function's parameter schemas; after "</tool_call>" only a stop token
  /// or, when the grammar allows, another call; without stop tokens the generation ends with
  /// kStop right after "</tool_call>". Once an unfollowed function is named, generation is free.
  /// These steps copy the logits to the host and choose there, as for json_schema. The
  /// vocabulary keeps the text of kept_special_ids (markers the tokenizer marks special).
  std::shared_ptr<const ToolCallGrammar> tool_call;
  /// Special tokens whose text is still written into the released text (every other special
  /// token writes none): the server passes a chat answer's think and tool-call markers when the
  /// tokenizer marks them special, since it splits the answer at their text.
  std::vector<int32_t> kept_special_ids;
  /// ≥ 0: the first min_tokens tokens cannot be stop tokens: their logits are set to −inf before
  /// the choice (greedy or sampled), which then runs on the host from the copied logits, as for
  /// json_schema. Stop strings still end the text. Log-probabilities stay those of the raw
  /// logits. (vLLM's min_tokens.)
  int64_t min_tokens = 0;
};

/// Wall-clock timings of one generation, in seconds.
struct GenerationTimings {
  int64_t prefill_tokens = 0;   ///< prompt tokens actually run (uncached part)
  double prefill_seconds = 0;   ///< start → first generated token on the host (TTFT of the engine)
  int64_t decode_steps = 0;     ///< decode calls (generated tokens after the first)
  double decode_seconds = 0;    ///< first generated token → last generated token
  /// Time to first token inside the engine (= prefill_seconds; queueing not included).
  double ttft_seconds() const { return prefill_seconds; }
  /// prefill_tokens / prefill_seconds (0 when nothing was measured).
  double prefill_tokens_per_s() const;
  /// decode_steps / decode_seconds (0 when nothing was measured).
  double decode_tokens_per_s() const;
};

/// Outcome of generate().
struct GenerationResult {
  /// Generated ids in order. When a stop token ended generation it is the last id (counted in
  /// completion tokens, never part of `text`).
  std::vector<int32_t> token_ids;
  std::string text;  ///< detokenized output, cut before a stop string; empty without tokenizer
  FinishReason finish_reason = FinishReason::kLength;
  int64_t prompt_tokens = 0;  ///< whole prompt
  int64_t cached_tokens = 0;  ///< prompt tokens already in the state when generation began
  /// Generated tokens fed into the state: the state holds prompt + token_ids[0, fed_tokens).
  int64_t fed_tokens = 0;
  /// With GenerationParams::logprobs ≥ 0: one entry per generated token except a final stop
  /// token, in order (raw-logit log-softmax, engine/sampler.h token_logprobs).
  std::vector<TokenLogprobs> logprobs;
  GenerationTimings timings;
};

/// Called once per generated token, on the generating thread. `text` is the newly releasable
/// text (possibly empty: partial UTF-8 or a possible stop-string start is held back; the
/// remainder is result.text minus everything released so far). Return false to cancel: no
/// further decode step runs.
using TokenCallback = std::function<bool(int32_t token, std::string_view text)>;

/// Called when the state holds exactly prompt[0, n_tokens): at each GenerationParams::prompt_splits
/// position beyond the cached part (n_tokens ascending), then once at prompt length − 1 (when
/// that is ≥ 1), before the last prompt token is run. The prefix cache snapshots the state there,
/// so that a prompt sharing those messages, or the identical prompt, can later resume there.
using PromptPrefixHook = std::function<void(const SequenceState& state, int64_t n_tokens)>;

/// Called with a token's log-probabilities (GenerationParams::logprobs ≥ 0) just before the
/// TokenCallback of that token; never for a stop token.
using LogprobsCallback = std::function<void(const TokenLogprobs& logprobs)>;

/// One generation as a state machine over batched steps (Backend::step), so that a scheduler
/// can advance many of them in one step: next_row() gives the row this sequence feeds next (a
/// prefill chunk of the prompt, then one decode token per step), advance() takes that row's
/// output. The arithmetic, the splits, the sampler's draws and the callbacks are exactly those of
/// generate() (which runs one Generation alone), so an answer does not depend on what else
/// shares its steps. Callbacks run inside advance(). `state`, `prompt`, `tokenizer` and the
/// callbacks must outlive the Generation.
class Generation {
 public:
  /// Checks the inputs as generate() does (same errors).
  Generation(const Backend& backend, SequenceState& state, std::span<const int32_t> prompt,
             const GenerationParams& params, const Tokenizer* tokenizer, TokenCallback on_token = {},
             PromptPrefixHook on_prompt_prefix = {}, LogprobsCallback on_logprobs = {});
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  /// True once generation ended (result() is final).
  bool done() const { return done_; }
  /// True while prompt tokens remain to be fed.
  bool prefilling() const;
  /// Tokens next_row() would feed (prefill: the chunk up to the next cut; decode: 1).
  int64_t next_row_tokens() const;
  /// The row to feed into the next step. Its token span points into the prompt or into this
  /// object and stays valid until advance(). Throws InternalError once done().
  StepRow next_row();
  /// Takes the step's output for the row next_row() returned (−1 for a row without
  /// want_logits): runs the prompt-prefix hook at snapshot points, chooses and emits a token
  /// (callbacks) when the row produced one, and ends the generation on a stop token, a stop
  /// string, max_tokens, the state's capacity or a callback asking to cancel. Throws
  /// InternalError when sampling needs logits and the backend returned none.
  void advance(int32_t next);
  /// Ends the generation now with FinishReason::kCancelled (nothing more is fed); no-op once done.
  void cancel();
  /// The outcome so far; final once done().
  const GenerationResult& result() const { return result_; }
  GenerationResult take_result() { return std::move(result_); }

 private:
  void emit(int32_t token);
  void finish(FinishReason reason);
  int64_t next_cut() const;
  int32_t choose(int32_t next);
  /// True when the backend samples this generation's tokens on its device (not plain greedy,
  /// Backend::samples_on_device, not constrained()): the step returns the sampled id,
  /// no logits needed for it.
  bool samples_on_device() const;
  /// True while the next token is chosen on the host from masked logits: the JSON or tool-call
  /// constraint is active, or the stop tokens are still masked (stops_masked).
  bool constrained() const;
  /// True while the JSON constraint masks the next token: it is active and its document has
  /// started (GenerationParams::json_after_id already generated, or none to wait for).
  bool json_constraining() const;
  /// True while fewer than GenerationParams::min_tokens tokens were generated (and there are
  /// stop tokens): the next choice cannot be a stop token.
  bool stops_masked() const;

  const Backend& backend_;
  SequenceState& state_;
  std::span<const int32_t> prompt_;
  GenerationParams params_;
  const Tokenizer* tokenizer_;
  TokenCallback on_token_;
  PromptPrefixHook on_prompt_prefix_;
  LogprobsCallback on_logprobs_;
  struct Impl;  // sampler, history, text stream, timers
  std::unique_ptr<Impl> impl_;
  std::vector<float> logits_;
  int32_t pending_ = -1;  ///< decode: the token fed next
  bool started_ = false;
  bool done_ = false;
  GenerationResult result_;
};

/// Runs generation for `prompt` on `state`, which must already hold prompt[0, p) for
/// p = state.position() < prompt.size() (p > 0 on a prefix-cache hit). `tokenizer` may be null
/// (then no text and no stop strings). Generated token number s (0 = the first) is drawn with
/// sample_uniform(params.sampling.seed, s): the same seed gives the same tokens whatever part of
/// the prompt came from a cache. Throws lily::Error when the prompt does not fit max_seq,
/// max_tokens ≤ 0, stop strings without tokenizer, bad prompt_splits, or the state is not a prefix position;
/// InternalError when sampling needs logits and the backend returned none.
GenerationResult generate(Backend& backend, SequenceState& state, std::span<const int32_t> prompt,
                          const GenerationParams& params, const Tokenizer* tokenizer,
                          const TokenCallback& on_token = {},
                          const PromptPrefixHook& on_prompt_prefix = {},
                          const LogprobsCallback& on_logprobs = {});

/// Throws lily::Error "tokenizer.json has ids up to N, beyond the model's vocabulary of V" when
/// the tokenizer knows an id the model has no embedding or logit for (such a prompt would fail
/// only once sent, after the weights load).
void check_tokenizer_vocab(const ModelConfig& config, const Tokenizer& tokenizer);

/// Stop tokens of a checkpoint: config eos_token_ids (top level over text_config) ∪ the id of
/// tokenizer_config.json's `eos_token` (string or {"content": …}) when `tokenizer` is given and
/// the file exists. Sorted, de-duplicated. Throws lily::Error on an unreadable
/// tokenizer_config.json.
std::vector<int32_t> stop_token_ids(const ModelConfig& config, const std::filesystem::path& model_dir,
                                    const Tokenizer* tokenizer);

/// The sampling defaults a checkpoint's generation_config.json gives, as transformers reads
/// it: with "do_sample": true, temperature (default 1.0), top_p (1.0), top_k (50) and min_p
/// (none); without it, greedy. repetition_penalty (default 1.0) applies either way, as the
/// transformers logits processor does. No file: greedy, nothing applied. Throws lily::Error for
/// a file that is not a JSON object or holds a value of the wrong type or range.
SamplingParams generation_config_sampling(const std::filesystem::path& model_dir);

}  // namespace lily
