// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (docs/model.md §5):
// NFC normalizer, Split(regex, Isolated) + ByteLevel pre-tokenizer, BPE merges by rank,
// added tokens matched first, ByteLevel decoder. Anything else in the file is rejected.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lily {

class TokenizerImpl;

/// A loaded tokenizer. Immutable after construction; encode/decode are thread-safe.
class Tokenizer {
 public:
  /// Loads `path` (tokenizer.json). Throws lily::Error naming the file and the unsupported part.
  static std::shared_ptr<const Tokenizer> from_file(const std::filesystem::path& path);
  ~Tokenizer();

  /// Encodes UTF-8 text. With allow_special, added tokens' strings become their ids; without,
  /// they are plain text (user content is always encoded this way). Invalid UTF-8 bytes are
  /// replaced by U+FFFD before normalisation.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = false) const;
  /// Decodes ids to UTF-8 (invalid sequences become U+FFFD); ids without a vocabulary entry
  /// are dropped; with skip_special, special added tokens are omitted.
  std::string decode(std::span<const int32_t> ids, bool skip_special = true) const;
  /// The raw bytes of one token (byte-level decoded), or the added token's content.
  std::string token_bytes(int32_t id) const;
  /// token_bytes as a view into the tokenizer (no copy; valid while the tokenizer lives).
  std::string_view token_view(int32_t id) const;
  /// Id of an exact token string (vocabulary or added token), if any.
  std::optional<int32_t> token_id(std::string_view token) const;
  /// True for added tokens flagged `special`.
  bool is_special(int32_t id) const;
  /// One past the largest id known to the tokenizer.
  int32_t vocab_size() const;
  /// A number no other tokenizer of this process has or had (1, 2, …): a key for what is
  /// derived from this one that, unlike its address, a later tokenizer never reuses.
  uint64_t serial() const { return serial_; }

 private:
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
  uint64_t serial_;
};

/// Streaming detokenizer: push ids one at a time, get back only complete UTF-8 text.
/// Never emits part of a multi-byte character; flush() emits what is left (U+FFFD for an
/// incomplete tail).
class IncrementalDecoder {
 public:
  /// `skip_special`: special tokens write no text, except those in `kept_special` (a chat
  /// answer's `</think>` or `<tool_call>` where a tokenizer marks them special: the answer is
  /// split at their text). Throws lily::InternalError without a tokenizer.
  explicit IncrementalDecoder(std::shared_ptr<const Tokenizer> tokenizer, bool skip_special = true,
                              std::vector<int32_t> kept_special = {});
  /// Appends one token; returns the newly completed text (possibly empty).
  std::string push(int32_t id);
  /// Returns any buffered bytes as text and resets.
  std::string flush();

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;
  bool skip_special_;
  std::vector<int32_t> kept_special_;
  std::string pending_;
};

}  // namespace lily
