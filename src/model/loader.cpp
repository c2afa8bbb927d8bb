// load_model: config → checkpoint → one walk of the tensor description (for_each_tensor) that
// validates each tensor and stores it in its ModelWeights field (docs/model.md §2). Everything is
// built in locals and returned only when complete.
#include "model/loader.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unordered_set>
#include <variant>

#include "base/bf16.h"
#include "base/error.h"
#include "base/log.h"
#include "io/checkpoint.h"
#include "model/tensor_table.h"

namespace lily {
namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

/// Tensors a text-only engine ignores (docs/model.md §2.4): vision tower and MTP head.
bool is_skipped_tensor(const std::string& name) {
  return starts_with(name, "vision_tower.") || starts_with(name, "mtp.");
}

bool is_float_dtype(DType d) {
  return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32 || d == DType::kF64;
}

bool is_fp8(DType d) { return d == DType::kF8E4M3 || d == DType::kF8E5M2; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// A progress line on stderr, only when asked for and stderr is a terminal.
class Progress {
 public:
  Progress(bool enabled, std::string label, size_t total)
      : enabled_(enabled && ::isatty(2)), label_(std::move(label)), total_(total) {}
  ~Progress() { finish(); }
  void step() {
    if (!enabled_) return;
    ++done_;
    int percent = static_cast<int>(100 * done_ / (total_ ? total_ : 1));
    if (percent == last_percent_) return;
    last_percent_ = percent;
    std::fprintf(stderr, "\rlily: loading %s: %zu/%zu tensors (%d%%)", label_.c_str(), done_, total_, percent);
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_ && last_percent_ >= 0) std::fprintf(stderr, "\r\x1b[K");
    enabled_ = false;
  }

 private:
  bool enabled_;
  std::string label_;
  size_t total_, done_ = 0;
  int last_percent_ = -1;
};

/// Validation state of one load: the checkpoint, the set of consumed tensor names.
class Validator {
 public:
  Validator(const Checkpoint& ckpt, const LoadOptions& options) : ckpt_(ckpt), options_(options) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(ckpt_.dir().string() + ": " + what);
  }

  const TensorInfo* find(const std::string& name) const { return ckpt_.find(name); }

  const TensorInfo& take(const std::string& name) {
    const TensorInfo* t = ckpt_.find(name);
    if (!t) fail("missing tensor " + name);
    consumed_.insert(name);
    mapped_bytes_ += t->nbytes;
    return *t;
  }

  void expect_dtype(const TensorInfo& t, DType want) const {
    if (t.dtype != want)
      fail("tensor " + t.name + " is " + dtype_name(t.dtype) + "; expected " + dtype_name(want));
  }

  void expect_shape(const TensorInfo& t, const std::vector<int64_t>& want, const std::string& note = "") const {
    if (t.shape != want)
      fail("tensor " + t.name + " is " + t.shape_string() + ", expected " + shape_str(want) + note);
  }

  /// Rejects NaN/Inf in a BF16 or F32 tensor (docs/model.md §2: scales, biases, norms, conv, gates).
  void check_finite(const TensorInfo& t) const {
    if (!options_.check_finite) return;
    int64_t bad = -1;
    if (t.dtype == DType::kBF16) {
      const auto* v = reinterpret_cast<const uint16_t*>(t.data);
      for (int64_t i = 0, n = t.numel(); i < n; ++i)
        if ((v[i] & 0x7f80u) == 0x7f80u) { bad = i; break; }
    } else if (t.dtype == DType::kF32) {
      const auto* v = reinterpret_cast<const float*>(t.data);
      for (int64_t i = 0, n = t.numel(); i < n; ++i)
        if (!std::isfinite(v[i])) { bad = i; break; }
    }
    if (bad >= 0) fail("tensor " + t.name + " has a NaN or Inf value (element " + std::to_string(bad) + ")");
  }

  QuantMatrix quantized(const TensorSpec& spec);
  std::vector<float> vector(const TensorSpec& spec);

  const std::unordered_set<std::string>& consumed() const { return consumed_; }
  uint64_t mapped_bytes() const { return mapped_bytes_; }

 private:
  void check_codes(const TensorSpec& spec, const TensorInfo& w) const;
  void check_groups(const TensorSpec& spec, const TensorInfo& s) const;

  const Checkpoint& ckpt_;
  const LoadOptions& options_;
  std::unordered_set<std::string> consumed_;
  uint64_t mapped_bytes_ = 0;
};

/// Leading dims of a stored quantized tensor must equal the logical ones (all but the last).
bool same_leading_dims(const std::vector<int64_t>& stored, const std::vector<int64_t>& logical) {
  if (stored.size() != logical.size()) return false;
  for (size_t i = 0; i + 1 < logical.size(); ++i)
    if (stored[i] != logical[i]) return false;
  return true;
}

void Validator::check_codes(const TensorSpec& spec, const TensorInfo& w) const {
  const auto want = packed_codes_shape(spec);
  const int64_t in = spec.shape.back();
  if (!same_leading_dims(w.shape, spec.shape) || w.shape.back() <= 0)
    expect_shape(w, want, " (" + std::to_string(spec.bits) + "-bit codes of logical " + shape_str(spec.shape) + ")");
  const int64_t packed = w.shape.back();
  if (packed * 32 % in == 0) {
    const int64_t bits = packed * 32 / in;
    if (bits != spec.bits && (bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8))
      fail(spec.name + " uses " + std::to_string(bits) + "-bit storage (" + w.name + " " + w.shape_string() +
           "); expected " + std::to_string(spec.bits) + "-bit for this projection");
  }
  expect_shape(w, want, " (" + std::to_string(spec.bits) + "-bit codes of logical " + shape_str(spec.shape) + ")");
}

void Validator::check_groups(const TensorSpec& spec, const TensorInfo& s) const {
  const auto want = group_params_shape(spec, kQuantGroupSize);
  const int64_t in = spec.shape.back();
  if (same_leading_dims(s.shape, spec.shape)) {
    const int64_t groups = s.shape.back();
    if (groups > 0 && groups != in / kQuantGroupSize && in % groups == 0)
      fail(spec.name + " has group size " + std::to_string(in / groups) + " (" + s.name + " " + s.shape_string() +
           "); lily supports group size " + std::to_string(kQuantGroupSize) + " only");
  }
  expect_shape(s, want);
}

QuantMatrix Validator::quantized(const TensorSpec& spec) {
  const auto [wname, sname, bname] = quantized_names(spec.name);
  const TensorInfo* w = find(wname);
  const TensorInfo* s = find(sname);
  if (!w) fail("missing tensor " + wname);
  if (is_float_dtype(w->dtype) && !s)
    fail("unquantized " + std::string(dtype_name(w->dtype)) + " checkpoint: " + wname + " is " +
         dtype_name(w->dtype) + " " + w->shape_string() +
         " with no .scales; lily needs " + supported_checkpoint_kind());
  if (!s) fail(spec.name + " has .weight but no .scales: not an MLX quantized projection");
  expect_dtype(*w, DType::kU32);
  check_codes(spec, *w);
  const TensorInfo& sc = take(sname);
  const TensorInfo& bi = take(bname);
  expect_dtype(sc, DType::kBF16);
  expect_dtype(bi, DType::kBF16);
  check_groups(spec, sc);
  check_groups(spec, bi);
  check_finite(sc);
  check_finite(bi);
  take(wname);
  QuantMatrix m;
  m.codes = reinterpret_cast<const uint32_t*>(w->data);
  m.scales = reinterpret_cast<const uint16_t*>(sc.data);
  m.biases = reinterpret_cast<const uint16_t*>(bi.data);
  m.cols = spec.shape.back();
  m.rows = 1;
  for (size_t i = 0; i + 1 < spec.shape.size(); ++i) m.rows *= spec.shape[i];
  m.bits = spec.bits;
  m.group_size = kQuantGroupSize;
  return m;
}

/// Plain tensors: BF16 (F32 also for kFloat and f32_accepted specs), exact shape (or the spec's
/// alt_shape: conv1d may be [C, K, 1] or [C, 1, K]), finite; returned as fp32 in row-major order.
std::vector<float> Validator::vector(const TensorSpec& spec) {
  const TensorInfo& t = take(spec.name);
  const bool f32_ok = spec.kind == TensorKind::kFloat || spec.f32_accepted;
  const bool f32_preferred = spec.kind == TensorKind::kFloat;
  if (!(t.dtype == DType::kBF16 || (f32_ok && t.dtype == DType::kF32)))
    fail("tensor " + t.name + " is " + dtype_name(t.dtype) + "; expected " +
         (f32_preferred ? "F32 (or BF16)" : f32_ok ? "BF16 (or F32)" : "BF16"));
  if (!spec.alt_shape.empty()) {
    if (t.shape != spec.shape && t.shape != spec.alt_shape)
      expect_shape(t, spec.shape, " (or " + shape_str(spec.alt_shape) + ")");
  } else {
    expect_shape(t, spec.shape);
  }
  check_finite(t);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kF32) {
    std::memcpy(out.data(), t.data, out.size() * sizeof(float));
  } else {
    const auto* v = reinterpret_cast<const uint16_t*>(t.data);
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(v[i]);
  }
  return out;
}

/// Whole-checkpoint checks made before the table walk, for the clearest message. `table` is
/// tensor_table of the checkpoint's config; its embedding spec names the MLX layout's first tensor.
void check_checkpoint_kind(const Checkpoint& ckpt, const Validator& v, const std::vector<TensorSpec>& table) {
  for (const TensorInfo* t : ckpt.tensors())
    if (is_fp8(t->dtype) && !is_skipped_tensor(t->name))
      v.fail("fp8 checkpoint: tensor " + t->name + " is " + dtype_name(t->dtype) +
             "; lily needs " + supported_checkpoint_kind());
  const auto embedding =
      std::find_if(table.begin(), table.end(), [](const TensorSpec& s) { return s.role == TensorRole::kEmbedding; });
  if (embedding == table.end()) throw InternalError("check_checkpoint_kind: the tensor table has no embedding");
  if (!ckpt.find(quantized_names(embedding->name).weight)) {
    for (const char* hf : {"model.language_model.embed_tokens.weight", "model.embed_tokens.weight"})
      if (ckpt.find(hf))
        v.fail(std::string("unsupported checkpoint layout: found ") + hf +
               " (Hugging Face names); expected the MLX layout (" + embedding->name + ".*)");
  }
}

/// Tensors neither consumed nor skippable are an error; returns the number skipped.
int64_t check_leftovers(const Checkpoint& ckpt, const Validator& v) {
  int64_t skipped = 0;
  std::vector<std::string> extra;
  for (const TensorInfo* t : ckpt.tensors()) {
    if (v.consumed().count(t->name)) continue;
    if (is_skipped_tensor(t->name)) ++skipped;
    else extra.push_back(t->name);
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 8; ++i) list += (i ? ", " : "") + extra[i];
    if (extra.size() > 8) list += ", …";
    v.fail(std::to_string(extra.size()) + " unexpected tensor" + (extra.size() > 1 ? "s" : "") +
           " not in the qwen3_5_moe tensor table: " + list);
  }
  return skipped;
}

/// Resident set size of this process in bytes (Linux /proc), 0 when unknown.
uint64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  if (!(in >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / 1048576.0);
  return buf;
}

std::atomic<bool> g_default_mmap{true};

}  // namespace

void set_default_weights_mmap(bool mmap) { g_default_mmap.store(mmap); }
bool default_weights_mmap() { return g_default_mmap.load(); }

std::shared_ptr<const ModelWeights> load_model(const std::filesystem::path& dir, const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  ModelConfig config = load_model_config(dir);
  auto ckpt = std::make_shared<const Checkpoint>(dir, options.mmap);
  Validator v(*ckpt, options);
  const std::vector<TensorSpec> table = tensor_table(config);
  check_checkpoint_kind(*ckpt, v, table);

  // One walk of the tensor description: each spec is validated and stored straight into the
  // field it names. `weights` stays local until complete, so a throw leaves nothing half-loaded.
  auto weights = std::make_shared<ModelWeights>();
  weights->config = config;
  uint64_t host_bytes = 0;
  {
    Progress progress(options.show_progress, dir.string(), table.size());
    for_each_tensor(config, *weights, [&](const TensorSpec& spec, TensorDest dest) {
      if (spec.kind == TensorKind::kQuantized) {
        *std::get<QuantMatrix*>(dest) = v.quantized(spec);
      } else {
        std::vector<float>& vec = *std::get<std::vector<float>*>(dest);
        vec = v.vector(spec);
        host_bytes += vec.size() * sizeof(float);
      }
      progress.step();
    });
  }
  const int64_t skipped = check_leftovers(*ckpt, v);
  weights->storage = ckpt;
  weights->skipped_tensors = skipped;

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char time_buf[32];
  std::snprintf(time_buf, sizeof time_buf, "%.2f s", seconds);
  if (skipped > 0)
    log_info("skipped " + std::to_string(skipped) + " vision_tower.*/mtp.* tensors (not used by the text model)");
  log_info("loaded " + dir.string() + " (" + config.shape_name() + ", " + std::to_string(v.consumed().size()) +
           " tensors, " + mib(ckpt->bytes_on_disk()) + " on disk) in " + time_buf + ": " +
           mib(v.mapped_bytes()) + (options.mmap ? " mapped, " : " read into memory, ") + mib(host_bytes) + " host copies, resident " +
           mib(resident_bytes()));
  return weights;
}

}  // namespace lily
