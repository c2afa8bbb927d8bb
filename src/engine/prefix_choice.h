// A token-level constraint on the start of a generation: the generated text must begin with one
// of a few given strings. Until it does, a token is allowed only when the text with the token's
// bytes appended is still a prefix of one of them; once the text equals one of them, generation
// is free again (GenerationParams::prefix_choices). The server's forced tool calls use the fuller
// engine/tool_call_constraint.h, which holds the name and then the parameters.
//
// The constraint works on raw token bytes, so a name may be spelled with any tokens (one per
// character, or merged ones) and a multi-byte character may span tokens. Tokens without bytes
// (special tokens, ids the tokenizer does not know) are never allowed: they would add nothing.
// It is applied to a logits row as a mask (every disallowed logit set to −inf) before the
// sampler's pipeline (engine/sampler.h), so greedy and sampled decoding both honour it and the
// draw keeps its (seed, step) contract.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class Tokenizer;

/// The bytes a token adds to the text (empty for a token that adds none), by id. The view must
/// stay valid while the constraint lives (a view into the vocabulary, not a temporary).
using TokenBytesFn = std::function<std::string_view(int32_t id)>;

/// The text-prefix constraint over the first generated tokens (see the file comment).
class PrefixChoiceConstraint {
 public:
  /// `choices`: the strings the text may begin with (non-empty; lily::Error otherwise).
  /// `vocab`: the logits row length (ids 0 … vocab − 1); `token_bytes` gives each id's bytes.
  PrefixChoiceConstraint(std::vector<std::string> choices, int32_t vocab, TokenBytesFn token_bytes);
  /// The same over a tokenizer's byte-level tokens; special tokens count as adding nothing.
  /// `tokenizer` must outlive the constraint.
  static PrefixChoiceConstraint over_tokenizer(std::vector<std::string> choices, int32_t vocab,
                                               const Tokenizer& tokenizer);

  /// True until the text equals one of the choices (or the constraint gave up, see mask).
  bool active() const { return active_; }
  /// The text the constrained tokens wrote so far.
  const std::string& text() const { return text_; }
  /// Whether token `id` may come next: always true once inactive; otherwise its bytes are
  /// non-empty and text() + bytes is a prefix of a choice.
  bool allows(int32_t id) const;
  /// The ids allowed next, ascending (every id once inactive). One pass over the vocabulary.
  std::vector<int32_t> allowed() const;
  /// Sets the logit of every id not allowed to −inf (`logits` is a [vocab] row). Returns the
  /// number of ids left. When none would be left (a vocabulary that cannot spell any choice),
  /// the row is left as it is and the constraint gives up (inactive from then on).
  size_t mask(std::span<float> logits);
  /// Takes the token chosen next. A token that allows() refuses (only possible after the
  /// constraint gave up) ends the constraint.
  void push(int32_t id);

 private:
  /// The choices that text_ is a proper prefix of, grouped by their next byte.
  void index_live();
  bool allows_bytes(std::string_view bytes) const;

  std::vector<std::string> choices_;
  int32_t vocab_;
  TokenBytesFn token_bytes_;
  std::string text_;
  bool active_ = true;
  std::array<std::vector<uint32_t>, 256> live_;  ///< next byte → choices that continue with it
};

}  // namespace lily
