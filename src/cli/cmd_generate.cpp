// `lily generate`: one generation from the command line, streamed to stdout,
// greedy unless --temperature > 0. --prompt renders the chat template (thinking disabled) around one user message
// unless --raw; --messages takes a JSON array of {role, content}; --prompt-ids takes token ids
// and works without a usable tokenizer (then no text is produced: "text" is "" in --json).
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "base/log.h"
#include "cli/commands.h"
#include "engine/backend.h"
#include "cli/model_paths.h"
#include "engine/generate.h"
#include "model/loader.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace lily::cli {

namespace {

struct GenerateFlags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  std::string messages;
  bool prompt_given = false, prompt_ids_given = false, messages_given = false;  ///< on the command line, even empty
  std::string chat_options;  ///< --chat-options JSON (tools, thinking) for --messages / --prompt
  bool raw = false;
  int64_t max_tokens = 128;
  bool max_tokens_given = false;  ///< --max-tokens was on the command line (else 128, clamped to the context)
  int64_t max_seq = 0;
  std::vector<std::string> cuda;  ///< --cuda NAME=VALUE (CudaOptions::set)
  bool no_mmap = false;
  bool json = false;
  std::string backend = "auto";
  int threads = 0;
  std::vector<std::string> stop;
  double temperature = 0, top_p = 1, min_p = 0;
  int top_k = 0;
  uint64_t seed = 0;
  bool seed_given = false;
  int logprobs = -1;  ///< --logprobs N (0 … 20) adds log-probabilities to --json
};

std::vector<int32_t> parse_prompt_ids(const std::string& text, int vocab) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v >= vocab)
      throw Error("--prompt-ids: '" + item + "' is not a token id in [0, " + std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw Error("--prompt-ids: no ids given");
  return ids;
}

std::vector<ChatMessage> parse_messages_flag(const std::string& text) {
  auto doc = parse_json_flag(text, "--messages");
  if (doc.is_discarded() || !doc.is_array() || doc.empty())
    throw Error("--messages: expected a non-empty JSON array of {\"role\",\"content\"} objects");
  return parse_message_list(doc, "--messages");
}

/// Loads tokenizer.json; in --prompt-ids mode a missing or unsupported tokenizer is not fatal.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::filesystem::path& dir, bool required) {
  const auto path = dir / "tokenizer.json";
  if (!required && !optional_file_exists(path)) return nullptr;
  try {
    return Tokenizer::from_file(path);
  } catch (const Error& e) {
    if (required) throw;
    log_warn(std::string("no text output: ") + e.what());
    return nullptr;
  }
}

/// Checks that exactly one prompt flag was given, and not empty: an empty one is named as such
/// rather than counted as missing.
void check_prompt_flags(const GenerateFlags& f) {
  if (f.prompt_given + f.prompt_ids_given + f.messages_given != 1)
    throw Error("give exactly one of --prompt, --prompt-ids, --messages");
  if (f.prompt_given && f.prompt.empty()) throw Error("--prompt must not be empty");
  if (f.prompt_ids_given && f.prompt_ids.empty()) throw Error("--prompt-ids: no ids given");
}

std::vector<int32_t> build_prompt(const GenerateFlags& f, const Tokenizer* tok, const std::filesystem::path& dir,
                                  int vocab) {
  check_prompt_flags(f);
  if (f.prompt_ids_given) return parse_prompt_ids(f.prompt_ids, vocab);
  if (f.messages_given)
    return ChatTemplate::for_model(dir)->encode(*tok, parse_messages_flag(f.messages),
                                                parse_chat_options(f.chat_options, "--chat-options"));
  if (f.raw) return tok->encode(f.prompt, /*allow_special=*/true);
  const ChatMessage user{ChatRole::kUser, f.prompt};
  return ChatTemplate::for_model(dir)->encode(*tok, std::span<const ChatMessage>(&user, 1),  // the checkpoint's template
                                              parse_chat_options(f.chat_options, "--chat-options"));
}

void print_json(const std::vector<int32_t>& prompt, const GenerationResult& r, const GenerationParams& p,
                const Tokenizer* tok) {
  nlohmann::ordered_json doc{{"prompt_ids", prompt},
                             {"token_ids", r.token_ids},
                             {"text", r.text},
                             {"finish_reason", finish_reason_name(r.finish_reason)},
                             {"prompt_tokens", r.prompt_tokens},
                             {"completion_tokens", r.token_ids.size()},
                             {"prefill_tokens_per_s", r.timings.prefill_tokens_per_s()},
                             {"decode_tokens_per_s", r.timings.decode_tokens_per_s()}};
  if (!p.sampling.greedy()) doc["seed"] = p.sampling.seed;
  if (p.logprobs >= 0) {
    auto text_of = [&](int32_t id) { return tok ? tok->token_bytes(id) : std::string(); };
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& lp : r.logprobs) {
      nlohmann::ordered_json top = nlohmann::ordered_json::array();
      for (const auto& t : lp.top) top.push_back({{"id", t.token}, {"token", text_of(t.token)}, {"logprob", t.logprob}});
      list.push_back({{"id", lp.token}, {"token", text_of(lp.token)}, {"logprob", lp.logprob}, {"top_logprobs", top}});
    }
    doc["logprobs"] = list;
  }
  std::cout << doc.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << '\n';
  flush_stdout();
}

/// The context a generation may fill: --max-seq when given (at most the checkpoint's context),
/// else the checkpoint's max_position_embeddings (or kMaxContext, model/config.h, when it declares none).
/// Throws lily::Error for a --max-seq beyond the checkpoint's context.
int64_t context_limit(const GenerateFlags& f, const ModelConfig& config) {
  const int64_t declared = config.context_length();
  if (f.max_seq > declared)
    throw Error("--max-seq " + std::to_string(f.max_seq) + " exceeds the checkpoint's context of " +
                std::to_string(declared) + " tokens (max_position_embeddings in config.json)");
  return f.max_seq > 0 ? f.max_seq : declared;
}

void run_generate(const GenerateFlags& f) {
  // Everything that does not need the weights is checked before they are loaded, so a mistyped
  // flag is reported at once instead of after a load that may take minutes.
  const auto dir = model_dir_or_default(f.model);
  if (f.max_tokens < 1) throw Error("--max-tokens must be at least 1");
  if (f.max_seq < 0) throw Error("--max-seq must be at least 0");
  check_prompt_flags(f);
  if (f.messages_given) parse_messages_flag(f.messages);
  parse_chat_options(f.chat_options, "--chat-options");
  // generate() would refuse an empty one too, but only once the weights are loaded.
  for (const std::string& stop : f.stop)
    if (stop.empty()) throw Error("--stop: stop strings must not be empty");
  const BackendKind backend_kind = parse_backend_kind(f.backend);
  const ModelConfig config = load_model_config(dir);
  auto tokenizer = load_tokenizer(dir, !f.prompt_ids_given);
  if (tokenizer) check_tokenizer_vocab(config, *tokenizer);
  if (!f.stop.empty() && !tokenizer) throw Error("--stop needs a tokenizer");
  // Written so that NaN fails each range check too.
  if (!(f.temperature >= 0 && f.temperature <= 2)) throw Error("--temperature must be in [0, 2]");
  if (!(f.top_p > 0 && f.top_p <= 1)) throw Error("--top-p must be in (0, 1]");
  if (f.top_k < -1) throw Error("--top-k must be -1, 0 (off) or a positive integer");
  if (!(f.min_p >= 0 && f.min_p <= 1)) throw Error("--min-p must be in [0, 1]");
  if (f.logprobs > 20) throw Error("--logprobs must be in [0, 20]");
  if (f.logprobs >= 0 && !f.json) throw Error("--logprobs needs --json");
  const std::vector<int32_t> prompt = build_prompt(f, tokenizer.get(), dir, config.vocab);
  const int64_t limit = context_limit(f, config);
  const std::string limit_name = f.max_seq > 0 ? "--max-seq " + std::to_string(limit)
                                               : "the checkpoint's context of " + std::to_string(limit) +
                                                     " tokens (max_position_embeddings)";
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len >= limit)
    throw Error("the prompt has " + std::to_string(prompt_len) + " tokens; " + limit_name +
                " leaves no room for a completion");
  if (f.max_tokens_given && f.max_tokens > limit - prompt_len)
    throw Error("--max-tokens " + std::to_string(f.max_tokens) + ": the prompt (" + std::to_string(prompt_len) +
                " tokens) + " + std::to_string(f.max_tokens) + " exceeds " + limit_name);
  GenerationParams params;
  params.max_tokens = std::min<int64_t>(f.max_tokens, limit - prompt_len);  // the default 128 is clamped
  params.max_seq = prompt_len + params.max_tokens;
  params.stop_ids = stop_token_ids(config, dir, tokenizer.get());
  params.stop_strings = f.stop;
  params.sampling.temperature = static_cast<float>(f.temperature);
  params.sampling.top_p = static_cast<float>(f.top_p);
  params.sampling.top_k = std::max(f.top_k, 0);
  params.sampling.min_p = static_cast<float>(f.min_p);
  params.sampling.seed = f.seed_given ? f.seed : fresh_seed();
  params.logprobs = f.logprobs;

  auto weights = load_model(dir, LoadOptions{.show_progress = true, .mmap = !f.no_mmap});
  const CudaOptions cuda = resolve_cuda_options(backend_kind, f.cuda);
  auto backend = make_backend(backend_kind, weights, f.threads, cuda);
  if (!backend->reads_host_weights()) weights.reset();  // unmaps the checkpoint (as lily serve)
  auto state = backend->new_state(params.max_seq);
  size_t streamed = 0;  // bytes of text written to stdout so far
  TokenCallback stream = [&](int32_t, std::string_view text) {
    if (!f.json && !text.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      flush_stdout();  // output that cannot be written stops the generation instead of running on
      streamed += text.size();
    }
    return true;
  };
  GenerationResult r;
  try {
    r = generate(*backend, *state, prompt, params, tokenizer.get(), stream);
  } catch (...) {
    if (streamed > 0) std::printf("\n");  // the error goes to stderr after a complete line
    throw;
  }
  if (f.json) return print_json(prompt, r, params, tokenizer.get());
  // The text generate() released only at the end (held back for a possible stop string or an
  // incomplete UTF-8 character) was never streamed: write it, then end the line.
  if (r.text.size() > streamed) std::fwrite(r.text.data() + streamed, 1, r.text.size() - streamed, stdout);
  std::printf("\n");
  std::fflush(stdout);
  char line[256];
  std::snprintf(line, sizeof line, "%s: prompt %lld tok, prefill %.1f tok/s, completion %zu tok, decode %.1f tok/s",
                std::string(finish_reason_name(r.finish_reason)).c_str(), static_cast<long long>(r.prompt_tokens),
                r.timings.prefill_tokens_per_s(), r.token_ids.size(), r.timings.decode_tokens_per_s());
  log_info(line);
}

}  // namespace

void register_generate(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("generate", "generate from one prompt (greedy unless --temperature), streamed to stdout");
  auto f = std::make_shared<GenerateFlags>();
  cmd->add_option("--model", f->model, "checkpoint directory (default: the repository's models/demo)");
  auto* prompt = cmd->add_option("--prompt", f->prompt, "user message (chat template applied, thinking disabled)");
  cmd->add_flag("--raw", f->raw, "encode --prompt as is, without the chat template");
  auto* prompt_ids = cmd->add_option("--prompt-ids", f->prompt_ids,
                                     "comma-separated prompt token ids; works without a usable tokenizer.json "
                                     "(then no text is printed and --json has \"text\":\"\")");
  auto* messages = cmd->add_option("--messages", f->messages, "JSON array of {\"role\",\"content\"} messages");
  cmd->add_option("--chat-options", f->chat_options, "JSON object of a chat request's tools, tool_choice, "
                  "reasoning_effort and chat_template_kwargs, passed to the chat template");
  auto* max_tokens = cmd->add_option("--max-tokens", f->max_tokens, "most tokens to generate (the prompt plus these "
                                     "must fit the context; the default is clamped to it)")->capture_default_str()
      ->check(integer_at_least(1));
  cmd->add_option("--max-seq", f->max_seq, "sequence limit (default and maximum: max_position_embeddings)")
      ->check(integer_at_least(0));
  cmd->add_flag("--no-mmap", f->no_mmap, "read the weights into memory instead of memory-mapping them");
  cmd->add_option("--stop", f->stop, "stop string (repeatable)");
  cmd->add_flag("--json", f->json, "print one JSON object instead of streaming text");
  cmd->add_option("--temperature", f->temperature, "sampling temperature, 0 … 2 (0 = greedy)")->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "top-p, (0, 1] (1 = off)")->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "top-k (0 or -1 = off)")->capture_default_str()->check(integer_at_least(-1));
  cmd->add_option("--min-p", f->min_p, "min-p, 0 … 1 (0 = off)")->capture_default_str();
  auto* seed = cmd->add_option("--seed", f->seed, "sampling seed (default: a fresh one, printed by --json)")
      ->check(unsigned_integer());
  cmd->add_option("--logprobs", f->logprobs, "with --json: each token's log-probability and N alternatives (0 … 20)")
      ->check(integer_at_least(0));
  cmd->add_option("--backend", f->backend, "cpu | cuda | auto")->capture_default_str();
  add_cuda_settings(cmd, f->cuda);
  cmd->add_option("--threads", f->threads, "CPU backend threads, 0 = all cores (at most " + std::to_string(kMaxCpuThreads) + ")")
      ->capture_default_str()
      ->check(integer_in_range(0, kMaxCpuThreads));
  cmd->callback([f, prompt, prompt_ids, messages, max_tokens, seed, &exit_code] {
    f->prompt_given = prompt->count() > 0;
    f->prompt_ids_given = prompt_ids->count() > 0;
    f->messages_given = messages->count() > 0;
    f->max_tokens_given = max_tokens->count() > 0;
    f->seed_given = seed->count() > 0;
    run_generate(*f);
    exit_code = 0;
  });
}

}  // namespace lily::cli
