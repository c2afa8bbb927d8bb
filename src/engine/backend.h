// The one interface between the engine (generation loop, sessions, scheduler) and a compute
// backend (backends/cpu, backends/cuda). The engine only sees token ids, logits and opaque
// per-sequence states; backends know nothing of HTTP, JSON or text.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/weights.h"

namespace lily {

/// Per-sequence decode state: KV cache of the full-attention layers, conv windows and fp32
/// recurrent states of the GDN layers, and the next position. Owned by one sequence at a time;
/// memory grows with the sequence (never reserved for max_seq up front).
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  /// Tokens consumed so far (= the absolute position of the next token).
  virtual int64_t position() const = 0;
  /// Bytes held by this state (KV cache + GDN states), for cache accounting.
  virtual int64_t bytes() const = 0;
};

/// Named intermediate tensor emitted by a forward pass, for layer-by-layer backend diffs.
/// `name` is one of: embed, attn_norm, mixer_out, ffn_norm, router_logits, ffn_out, layer_out,
/// final_norm, logits; `layer` is -1 outside layers; `token` is the absolute position.
/// `values` are fp32 (bf16 backends convert).
using ProbeSink = std::function<void(std::string_view name, int layer, int64_t token,
                                     std::span<const float> values)>;

/// A compute backend for one loaded model. Not thread-safe: one engine thread owns it.
class Backend {
 public:
  virtual ~Backend() = default;
  /// "cpu" or "cuda".
  virtual std::string name() const = 0;
  virtual const ModelConfig& config() const = 0;
  /// A fresh state (position 0) for sequences of at most max_seq tokens.
  /// Throws lily::Error if max_seq exceeds what the backend supports.
  virtual std::unique_ptr<SequenceState> new_state(int64_t max_seq) = 0;
  /// A deep copy of `state` (used by the prefix cache so that a hit never consumes an entry).
  virtual std::unique_ptr<SequenceState> clone_state(const SequenceState& state) = 0;
  /// Runs `tokens` (non-empty) at positions state.position()… and advances the state.
  /// Returns the greedy next token after the last one (argmax, ties to the lowest id);
  /// fills `logits` ([vocab] fp32) of the last token when non-null.
  virtual int32_t prefill(SequenceState& state, std::span<const int32_t> tokens,
                          std::vector<float>* logits = nullptr) = 0;
  /// One decode step: feeds `token` at state.position(), returns the greedy next token.
  virtual int32_t decode(SequenceState& state, int32_t token, std::vector<float>* logits = nullptr) = 0;
  /// For a backend that still reads the host weights (the CPU backend reads the memory-mapped
  /// checkpoint on every step): why they can no longer be trusted, e.g. "DIR/model.safetensors
  /// was truncated from A to B bytes" (reading them could kill the process with SIGBUS); nullopt
  /// when they are fine or the backend no longer reads them. Cheap (one stat(2) per weights
  /// file), never touches the weights; may be called from any thread.
  virtual std::optional<std::string> weights_changed() const { return std::nullopt; }
  /// Installs (or clears, with nullptr) a probe sink; costs nothing when unset.
  virtual void set_probe_sink(ProbeSink sink) { probe_sink_ = std::move(sink); }

 protected:
  ProbeSink probe_sink_;
};

/// Which backend to create. kAuto picks CUDA when built with it and a usable GPU is present.
enum class BackendKind { kCpu, kCuda, kAuto };

/// Parses "cpu" | "cuda" | "auto"; throws lily::Error otherwise.
BackendKind parse_backend_kind(std::string_view text);

/// Creates a backend over loaded weights. `threads` <= 0 means all cores (CPU backend).
/// Throws lily::Error (e.g. "--backend cuda: this build has no CUDA support", no GPU, not
/// enough device memory).
std::unique_ptr<Backend> make_backend(BackendKind kind, std::shared_ptr<const ModelWeights> weights,
                                      int threads = 0);

}  // namespace lily
