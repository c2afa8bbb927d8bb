// The Split pre-tokenizer of tokenizer.json (docs/model.md §5.2), run by PCRE2 (UTF, UCP,
// JIT). The Hugging Face tokenizers library runs these patterns with Oniguruma; translate_pattern
// rewrites the two constructs whose meaning differs between the engines so that PCRE2 splits
// exactly as Oniguruma does.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lily {

/// Rewrites an Oniguruma pattern for PCRE2:
///  - `\s` / `\S` become explicit classes of the Unicode White_Space code points (PCRE2's UCP
///    `\s` also matches U+180E, Oniguruma's does not);
///  - ASCII letters inside `(?i:…)` become two-case classes and the flag is dropped (PCRE2's
///    caseless UTF matching also folds U+017F ſ and U+212A K, Oniguruma's split does not).
/// Throws lily::Error for constructs it cannot translate (other inline flags, `\S` in a class).
std::string translate_pattern(std::string_view onig_pattern);

/// A compiled split regex with Isolated behaviour: every match and every gap between matches is
/// its own piece.
class SplitRegex {
 public:
  /// Compiles `onig_pattern` (after translate_pattern). Throws lily::Error with PCRE2's message.
  explicit SplitRegex(std::string_view onig_pattern);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  /// Splits well-formed UTF-8 `text` into [begin, end) byte ranges covering it in order.
  /// Thread-safe (each call uses its own match data).
  void split(std::string_view text, std::vector<std::pair<size_t, size_t>>& pieces) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace lily
