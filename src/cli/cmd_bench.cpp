// `lily bench`: the measurement contract of docs/benchmark.md §1 on any checkpoint and
// backend. Prompt token i = ((i·2654435761) mod 2^32) mod vocab. Once per run, a warm-up on its
// own state at the exact shape (prefill + 2 decode steps: allocates scratch, captures graphs, as
// Lily's lily-bench step 1); then per round a fresh state, one timed prefill until the first
// generated token is on the host (TTFT), and `--decode-steps` timed decode steps.
// The 64-bit FNV-1a digest of the decoded ids (the prefill token excluded; each u32 id XORed
// whole) must repeat across rounds; a mismatch is an error. Medians over rounds are printed and,
// with --json-out, written with per-step times, the device and the command line.
// Note: decode here is synchronous per step (no one-step look-ahead yet), so the numbers include
// the host round trip of every token.
// With --temperature > 0 (and optionally --top-p/--top-k/--min-p, --seed) the rounds run
// through generate() with those sampling parameters and no stop token, so a sampled decode is
// measured as the server runs it (on CUDA: the device sampler, or with LILY_CUDA_DEVICE_SAMPLER=0
// the logits row copied to the host). The seed fixes the draws, so the digest still repeats.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/build_info.h"
#include "base/error.h"
#include "cli/commands.h"
#include "cli/model_paths.h"
#include "engine/backend.h"
#include "engine/generate.h"
#include "model/loader.h"

namespace lily::cli {
namespace {

struct BenchFlags {
  std::string model;  ///< empty: the repository's models/demo (as serve and generate)
  int64_t prompt_len = 256;
  int decode_steps = 64;
  int rounds = 3;
  std::string backend = "auto";
  std::vector<std::string> cuda;  ///< --cuda NAME=VALUE (CudaOptions::set)
  int threads = 0;
  std::string json_out;
  bool no_mmap = false;
  double temperature = 0, top_p = 1, min_p = 0;  ///< sampling; temperature 0 = the greedy contract
  int top_k = 0;
  uint64_t seed = 1;

  /// True when the rounds sample (at a temperature the sampler does not take as greedy) instead
  /// of taking the argmax.
  bool sampled() const { return !sampling().greedy(); }
  /// The sampling parameters of the flags (seeded; no penalties, no bias).
  SamplingParams sampling() const {
    SamplingParams p;
    p.temperature = static_cast<float>(temperature);
    p.top_p = static_cast<float>(top_p);
    p.top_k = top_k;
    p.min_p = static_cast<float>(min_p);
    p.seed = seed;
    return p;
  }
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// The contract's synthetic prompt (docs/benchmark.md §1.1).
std::vector<int32_t> synthetic_prompt(int64_t n, int vocab) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i)
    ids[i] = static_cast<int32_t>((static_cast<uint64_t>(i) * 2654435761ull % 4294967296ull) % static_cast<uint64_t>(vocab));
  return ids;
}

/// 64-bit FNV-1a over whole u32 ids (docs/benchmark.md §1.3 item 4).
uint64_t fnv1a(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    h ^= static_cast<uint32_t>(id);
    h *= 0x100000001b3ull;
  }
  return h;
}

/// `v` with up to 6 significant digits, no trailing zeros ("0.6", "0.95", "1").
std::string format_number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string device_description(const std::string& backend) {
  if (backend != "cuda") return "cpu";
  std::string out;
  if (FILE* p = popen("nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null", "r")) {
    char buf[256];
    while (fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "cuda (nvidia-smi unavailable)" : out;
}

struct Round {
  double prefill_s = 0;
  double decode_s = 0;
  std::vector<double> step_s;
  uint64_t digest = 0;
  int32_t first_token = 0;
};

/// Prefill + 2 decode steps at the exact shape on a state of its own (untimed).
void warm_up(Backend& backend, const std::vector<int32_t>& prompt) {
  auto warm = backend.new_state(static_cast<int64_t>(prompt.size()) + 3);
  int32_t t = backend.prefill(*warm, prompt);
  t = backend.decode(*warm, t);
  backend.decode(*warm, t);
}

/// One round through generate() with `sampling`: `steps` + 1 tokens, no stop token. Prefill time
/// runs to the first token on the host (TTFT); each later token is one decode step.
Round run_sampled_round(Backend& backend, const std::vector<int32_t>& prompt, int steps, const SamplingParams& sampling) {
  GenerationParams params;
  params.max_tokens = steps + 1;
  params.max_seq = static_cast<int64_t>(prompt.size()) + steps + 1;
  params.sampling = sampling;
  auto state = backend.new_state(params.max_seq);
  Round r;
  std::vector<Clock::time_point> at;
  const auto t0 = Clock::now();
  const GenerationResult g = generate(backend, *state, prompt, params, nullptr, [&](int32_t, std::string_view) {
    at.push_back(Clock::now());
    return true;
  });
  if (static_cast<int>(g.token_ids.size()) != steps + 1 || at.size() != g.token_ids.size())
    throw InternalError("lily bench: generate() returned " + std::to_string(g.token_ids.size()) + " tokens, not " +
                        std::to_string(steps + 1));
  r.prefill_s = std::chrono::duration<double>(at[0] - t0).count();
  r.first_token = g.token_ids[0];
  for (size_t i = 1; i < at.size(); ++i) r.step_s.push_back(std::chrono::duration<double>(at[i] - at[i - 1]).count());
  r.decode_s = std::chrono::duration<double>(at.back() - at[0]).count();
  r.digest = fnv1a(std::vector<int32_t>(g.token_ids.begin() + 1, g.token_ids.end()));
  return r;
}

Round run_round(Backend& backend, const std::vector<int32_t>& prompt, int steps) {
  auto state = backend.new_state(static_cast<int64_t>(prompt.size()) + steps + 1);
  Round r;
  const auto t0 = Clock::now();
  int32_t tok = backend.prefill(*state, prompt);
  r.prefill_s = seconds_since(t0);
  r.first_token = tok;
  std::vector<int32_t> decoded;
  const auto t1 = Clock::now();
  auto last = t1;
  for (int i = 0; i < steps; ++i) {
    tok = backend.decode(*state, tok);
    const auto now = Clock::now();
    r.step_s.push_back(std::chrono::duration<double>(now - last).count());
    last = now;
    decoded.push_back(tok);
  }
  r.decode_s = seconds_since(t1);
  r.digest = fnv1a(decoded);
  return r;
}

/// ": <the reason>" for a failed write's errno, "" when it set none.
std::string write_error(int err) { return err != 0 ? std::string(": ") + std::strerror(err) : std::string(); }

void run_bench(const BenchFlags& f, const std::vector<std::string>& argv) {
  if (f.prompt_len < 1) throw Error("--prompt-len must be at least 1");
  if (f.decode_steps < 1) throw Error("--decode-steps must be at least 1");
  if (f.rounds < 1) throw Error("--rounds must be at least 1");
  // Written so that NaN fails each range check too.
  if (!(f.temperature >= 0 && f.temperature <= 2)) throw Error("--temperature must be in [0, 2]");
  if (!(f.top_p > 0 && f.top_p <= 1)) throw Error("--top-p must be in (0, 1]");
  if (f.top_k < 0) throw Error("--top-k must be 0 (off) or a positive integer");
  if (!(f.min_p >= 0 && f.min_p <= 1)) throw Error("--min-p must be in [0, 1]");
  if (!f.sampled() && (f.top_p != 1 || f.top_k != 0 || f.min_p != 0))
    throw Error("--top-p, --top-k and --min-p need --temperature > 0 (the default bench is greedy)");
  if (!f.json_out.empty()) {
    // Refused before the (possibly long) run, not after it.
    const auto parent = std::filesystem::absolute(f.json_out).parent_path();
    std::error_code ec;
    if (!std::filesystem::is_directory(parent, ec))
      throw Error("--json-out " + f.json_out + ": directory " + parent.string() + " does not exist");
    if (std::filesystem::is_directory(f.json_out, ec))
      throw Error("--json-out " + f.json_out + " is a directory");
    // Opening a FIFO for writing would block until a reader came (a device such as /dev/null
    // is fine).
    if (std::filesystem::is_fifo(f.json_out, ec)) throw Error("--json-out " + f.json_out + " is a FIFO (named pipe)");
  }
  const BackendKind backend_kind = parse_backend_kind(f.backend);
  {
    // A round fills prompt + decode steps + 1 positions; refused before the load, not after.
    const ModelConfig config = load_model_config(f.model);
    const int64_t context = config.context_length();
    // prompt + steps + 1 > context, written so that a huge --prompt-len cannot overflow.
    if (f.prompt_len >= context || f.decode_steps >= context - f.prompt_len)
      throw Error("--prompt-len " + std::to_string(f.prompt_len) + " + --decode-steps " +
                  std::to_string(f.decode_steps) + " + 1 positions exceed the checkpoint's context of " +
                  std::to_string(context) + " tokens (max_position_embeddings)");
  }
  auto weights = load_model(f.model, LoadOptions{.mmap = !f.no_mmap});
  const CudaOptions cuda = resolve_cuda_options(backend_kind, f.cuda);
  auto backend = make_backend(backend_kind, weights, f.threads, cuda);
  if (!backend->reads_host_weights()) weights.reset();  // unmaps the checkpoint (as lily serve)
  const auto prompt = synthetic_prompt(f.prompt_len, backend->config().vocab);
  std::vector<Round> rounds;
  if (f.sampled())
    run_sampled_round(*backend, prompt, 2, f.sampling());  // the warm-up, with the sampled path's graphs
  else
    warm_up(*backend, prompt);
  for (int i = 0; i < f.rounds; ++i) {
    rounds.push_back(f.sampled() ? run_sampled_round(*backend, prompt, f.decode_steps, f.sampling())
                                 : run_round(*backend, prompt, f.decode_steps));
    const Round& r = rounds.back();
    std::printf("round %d: prefill %.4f s (%.1f tok/s), decode %.1f tok/s, digest %016llx\n", i, r.prefill_s,
                double(f.prompt_len) / r.prefill_s, f.decode_steps / r.decode_s, (unsigned long long)r.digest);
    if (r.digest != rounds.front().digest)
      throw Error("lily bench: decode digest changed between rounds (" + std::to_string(rounds.front().digest) +
                  " vs " + std::to_string(r.digest) + "): the backend is not deterministic");
  }
  std::vector<double> pre, dec;
  for (const Round& r : rounds) {
    pre.push_back(double(f.prompt_len) / r.prefill_s);
    dec.push_back(f.decode_steps / r.decode_s);
  }
  const std::string device = device_description(backend->name());
  const std::string sampling_label =
      f.sampled() ? " | sampled T=" + format_number(f.temperature) + " top-p=" + format_number(f.top_p) +
                        " top-k=" + std::to_string(f.top_k) + " min-p=" + format_number(f.min_p) +
                        " seed=" + std::to_string(f.seed)
                  : "";
  std::printf("%s | %s | prompt %lld | prefill %.1f tok/s (median of %d) | decode %.1f tok/s | digest %016llx%s\n",
              backend->name().c_str(), device.c_str(), (long long)f.prompt_len, median(pre), f.rounds, median(dec),
              (unsigned long long)rounds.front().digest, sampling_label.c_str());
  if (!f.json_out.empty()) {
    nlohmann::json j;
    std::string cmd;
    for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
    j["schema_version"] = 1;
    j["meta"] = {{"engine", "lily.cpp"}, {"commit", lily::build_commit()}, {"backend", backend->name()},
                 {"device", device}, {"command", cmd}, {"model", f.model}, {"shape", backend->config().shape_name()}};
    // The CUDA paths this run used: the options its backend was made with.
    if (std::string_view(backend->name()) == "cuda") j["meta"]["cuda_options"] = cuda.describe();
    j["workload"] = {{"prompt_len", f.prompt_len}, {"prompt_kind", "u32_golden_ratio_hash_mod_vocab"},
                     {"decode_steps", f.decode_steps}, {"decode_mode", "synchronous_per_step"}, {"rounds", f.rounds},
                     {"sampling", f.sampled() ? nlohmann::json{{"temperature", f.temperature}, {"top_p", f.top_p},
                                                               {"top_k", f.top_k}, {"min_p", f.min_p}, {"seed", f.seed}}
                                              : nlohmann::json("greedy")},
                     {"warm_up", "once per run, prefill + 2 decode steps at the exact shape"}};
    nlohmann::json rs = nlohmann::json::array();
    for (const Round& r : rounds)
      rs.push_back({{"prefill_secs", r.prefill_s}, {"prefill_tok_s", double(f.prompt_len) / r.prefill_s},
                    {"first_token_id", r.first_token}, {"decode_secs", r.decode_s},
                    {"decode_tok_s", f.decode_steps / r.decode_s}, {"step_secs", r.step_s},
                    {"digest", [&] { char b[17]; std::snprintf(b, sizeof b, "%016llx", (unsigned long long)r.digest); return std::string(b); }()}});
    j["rounds"] = rs;
    j["results"] = {{"prefill_tok_s_median", median(pre)}, {"decode_tok_s_median", median(dec)}};
    errno = 0;
    std::ofstream out(f.json_out);
    if (!out) throw Error("--json-out: cannot write " + f.json_out + write_error(errno));
    out << j.dump(2) << "\n";
    out.close();  // the report is written only once it is flushed: a full disk fails here
    if (!out) throw Error("--json-out: cannot write " + f.json_out + write_error(errno));
  }
}

}  // namespace

void register_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<BenchFlags>();
  auto* cmd = app.add_subcommand("bench", "Measure prefill (TTFT) and decode tok/s as docs/benchmark.md §1 defines them");
  cmd->add_option("--model", f->model, "checkpoint directory (default: the repository's models/demo)");
  cmd->add_option("--prompt-len", f->prompt_len, "synthetic prompt tokens")->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--decode-steps", f->decode_steps, "measured decode steps")->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--rounds", f->rounds, "measured rounds (median reported)")->capture_default_str()->check(integer_at_least(1));
  cmd->add_option("--backend", f->backend, "cpu | cuda | auto")->capture_default_str();
  add_cuda_settings(cmd, f->cuda);
  cmd->add_option("--threads", f->threads, "CPU backend threads, 0 = all cores (at most " + std::to_string(kMaxCpuThreads) + ")")
      ->capture_default_str()
      ->check(integer_in_range(0, kMaxCpuThreads));
  cmd->add_option("--json-out", f->json_out, "write the JSON report here");
  cmd->add_flag("--no-mmap", f->no_mmap, "read the weights into memory instead of memory-mapping them");
  cmd->add_option("--temperature", f->temperature, "sample at this temperature, 0 … 2 (0 = the greedy contract)")
      ->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "with --temperature: top-p, (0, 1] (1 = off)")->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "with --temperature: top-k (0 = off)")->capture_default_str()->check(integer_at_least(0));
  cmd->add_option("--min-p", f->min_p, "with --temperature: min-p, 0 … 1 (0 = off)")->capture_default_str();
  cmd->add_option("--seed", f->seed, "with --temperature: the sampling seed")->capture_default_str()->check(unsigned_integer());
  cmd->callback([f, &exit_code] {
    f->model = model_dir_or_default(f->model).string();
    std::vector<std::string> argv = {"lily bench --model", f->model, "--prompt-len", std::to_string(f->prompt_len),
                                           "--decode-steps", std::to_string(f->decode_steps), "--rounds",
                                           std::to_string(f->rounds), "--backend", f->backend};
    for (const std::string& c : f->cuda) argv.insert(argv.end(), {"--cuda", c});
    if (f->sampled())
      argv.insert(argv.end(), {"--temperature", format_number(f->temperature), "--top-p", format_number(f->top_p),
                               "--top-k", std::to_string(f->top_k), "--min-p", format_number(f->min_p), "--seed",
                               std::to_string(f->seed)});
    run_bench(*f, argv);
    exit_code = 0;
  });
}

}  // namespace lily::cli
