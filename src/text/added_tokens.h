// Added tokens of tokenizer.json (docs/model.md §5.2): matched in the text before
// normalisation and pre-tokenization, leftmost-longest, as Hugging Face tokenizers does.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;     ///< skipped by decode(skip_special = true)
  bool normalized = false;  ///< matched in the normalised text instead of the raw text
};

/// One segment of text after added-token matching: either an added token or plain text.
struct TextSegment {
  std::string_view text;  ///< the matched token string or the plain text
  int32_t token_id = -1;  ///< the added token's id, or -1 for plain text
};

/// Leftmost-longest matcher over a fixed set of token strings.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);
  bool empty() const { return tokens_.empty(); }
  /// Splits `text` into plain-text and token segments, in order (empty plain segments omitted).
  void split(std::string_view text, std::vector<TextSegment>& out) const;

 private:
  std::vector<AddedToken> tokens_;                // sorted by length, longest first
  std::array<std::vector<uint32_t>, 256> by_first_byte_;  // indices into tokens_
};

}  // namespace lily
