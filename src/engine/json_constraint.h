// Structured output: a token-level constraint that keeps the generated text a prefix of a JSON
// object matching a schema (OpenAI's response_format json_object and json_schema).
//
// Three layers:
// - JsonSchema: a JSON Schema compiled to the structure it fixes: the types a value may take,
//   an object's properties (in order), which are required and whether others may appear, an
//   array's item schema, enum/const values (only those the other keywords allow; const beside
//   enum: their intersection), maxLength of strings and maxItems of arrays. $ref into
//   $defs/definitions (also recursive) and
//   anyOf/oneOf whose branches are of different JSON types are resolved here. Keywords that
//   only annotate or bound values (description, format, minLength, maximum, …) are accepted
//   and not enforced; keywords that would change the structure in ways this matcher does not
//   follow (allOf, not, if/then/else, patternProperties, prefixItems, …) are refused.
// - JsonMatcher: a byte-level pushdown automaton over that structure. feed() takes one byte
//   and says whether the text is still a prefix of a valid document; whitespace between tokens
//   comes as compact or pretty-printed JSON has it (kMaxIndentPerLevel: one blank, or one line
//   break and an indentation, so a model looping on blanks or newlines cannot fill the answer
//   with them), numbers are at most kMaxNumberBytes long, object keys are written without
//   escapes, enum values in their compact form (looked up by binary search among the values,
//   sorted once compiled, so a byte costs O(log n) on an enum of n values).
// - JsonConstraint: the matcher applied to a logits row: every token whose bytes the matcher
//   refuses is set to −inf before the sampler (engine/sampler.h), so
//   greedy and sampled decoding both keep the document valid. Once the root object is closed,
//   only the stop tokens are allowed. The vocabulary is walked as a trie (JsonVocabIndex: token
//   ids sorted by bytes) so a structural position tries only the prefixes it accepts; inside a
//   string, tokens free of quotes, backslashes and control bytes pass without a walk.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace lily {

class Tokenizer;

/// The bytes a token adds to the text (empty for a token that adds none), by id. The view must
/// stay valid while it is used (a view into the vocabulary, not a temporary).
using TokenBytesFn = std::function<std::string_view(int32_t id)>;

/// Whitespace the matcher accepts between two JSON tokens (and before the document), as one
/// run: nothing, one space or tab, or a line break ("\n", "\r\n") followed by at most
/// kMaxIndentPerLevel spaces and tabs per open object or array. Compact JSON and JSON
/// pretty-printed with indents of up to 4 fit; runs of blanks or blank lines, on which a weak
/// model can spend its whole answer, do not (llama.cpp's JSON grammar bounds its whitespace in
/// the same spirit). Strings and keys must be well-formed UTF-8 (no byte of a broken character
/// is accepted).
inline constexpr int kMaxIndentPerLevel = 4;
/// Most bytes of one JSON number.
inline constexpr int kMaxNumberBytes = 32;
/// Most digits of a number's exponent (so every value is a finite double).
inline constexpr int kMaxExponentDigits = 2;
/// Most nested objects and arrays in a document (deeper is refused: the mask copies the nesting).
inline constexpr size_t kMaxJsonNesting = 32;
/// Most properties one object schema may list (their seen set is a 64-bit mask).
inline constexpr size_t kMaxSchemaProperties = 64;

/// Well-formed UTF-8, byte by byte: a lead byte sets how many continuation bytes follow and the
/// range of the first (no overlong forms, no surrogates, nothing past U+10FFFF).
struct Utf8Check {
  uint8_t need = 0;               ///< continuation bytes still to come
  uint8_t lo = 0x80, hi = 0xBF;   ///< the range of the next continuation byte
  /// Takes one byte; false when the text would no longer be well-formed UTF-8.
  bool step(unsigned char byte);
};

/// A JSON Schema compiled to the structure the matcher follows (see the file comment).
class JsonSchema {
 public:
  /// Value types, as bits.
  enum Type : uint8_t {
    kObject = 1, kArray = 2, kString = 4, kNumber = 8, kInteger = 16, kBoolean = 32, kNull = 64, kAnyType = 127
  };
  /// One schema: what a value there may be. Node 0 is the unconstrained value.
  struct Node {
    uint8_t types = kAnyType;
    std::vector<std::string> property_names;  ///< declared properties, in order
    std::vector<int> property_nodes;          ///< their schemas
    uint64_t required = 0;                    ///< bit i: property i is required
    bool additional = true;                   ///< other keys allowed
    int additional_node = 0;                  ///< their schema
    int items = 0;                            ///< array items' schema
    /// enum/const: the allowed values as compact JSON (empty: none), sorted by bytes with
    /// duplicates dropped once compiled, so that the matcher looks prefixes up by binary search.
    std::vector<std::string> literals;
    int64_t max_length = -1;                  ///< maxLength: most characters of a string (−1: any)
    int64_t max_items = -1;                   ///< maxItems: most items of an array (−1: any)
    /// Containers (objects, arrays) the smallest value of this schema nests, and the smallest
    /// object value: so the matcher never opens what cannot close within kMaxJsonNesting.
    int min_depth = 0;
    int object_depth = 1;
  };

  /// Compiles `schema` (a JSON Schema object; `true` or `{}` is any value). The root must allow
  /// objects only (as OpenAI's structured outputs require). Throws lily::Error naming the
  /// keyword and where it is ("unsupported JSON schema keyword 'allOf' at /properties/a").
  static std::shared_ptr<const JsonSchema> compile(const nlohmann::json& schema);
  /// Any JSON object (response_format json_object).
  static std::shared_ptr<const JsonSchema> any_object();

  /// Node `i` (0 … size() − 1; 0 is the unconstrained value).
  const Node& node(int i) const { return nodes_[static_cast<size_t>(i)]; }
  /// The number of nodes.
  size_t size() const { return nodes_.size(); }
  /// The root object's node.
  int root() const { return root_; }

 private:
  friend class JsonSchemaCompiler;
  std::vector<Node> nodes_;
  int root_ = 0;
};

/// The byte-level matcher (see the file comment). Copyable; a copy is an independent state.
class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<const JsonSchema> schema);
  /// A matcher of one value of schema node `node` (any type the node allows, not only an
  /// object), as the root of its own document: complete() once that value is closed.
  JsonMatcher(std::shared_ptr<const JsonSchema> schema, int node);
  /// Takes one byte. False: the text plus this byte is no prefix of a valid document (the
  /// matcher is then in no defined state: feed a copy when probing).
  bool feed(unsigned char byte);
  /// Feeds every byte of `bytes`; false at the first refused one.
  bool feed(std::string_view bytes);
  /// True once the root object is closed.
  bool complete() const { return stack_.empty(); }
  /// True when the text so far is a whole value: complete(), or the root is a number or a
  /// literal (true, an enum value, …) that could end here (those end only when a byte that
  /// cannot continue them comes, which a root value never gets).
  bool can_end() const;
  /// True inside free text: a string value (not an enum, not in an escape) or a key of an object
  /// that takes any key. There any byte but '"', '\\' and control bytes continues it.
  bool in_free_text() const;

 private:
  struct Frame {
    enum Kind : uint8_t { kValue, kObject, kKey, kArray, kString, kNumber, kLiteral };
    Kind kind = kValue;
    uint8_t state = 0;     ///< kObject/kArray: 0 after open, 1 after key, 2 after value, 3 after comma;
                           ///< kNumber: its grammar state; kString: escape state
    int node = 0;          ///< the schema node of this value (kKey: the object's)
    int key = -1;          ///< kObject: the property of the current key (−1: an additional key)
    uint64_t seen = 0;     ///< kObject: properties written so far
    std::string text;      ///< kKey: the key so far; kLiteral: the literal so far
    uint8_t literal_set = 0;  ///< kLiteral: 0 the node's enum, else true/false/null bits
    int64_t count = 0;        ///< kString: characters so far; kArray: items so far
    Utf8Check utf8;           ///< kString/kKey: the character being written
    char hex_first = 0;       ///< kString in a \u escape: its first hex digit (lower case)
    bool high_surrogate = false;  ///< kString: this \u escape is a high surrogate
    bool low_phase = false;   ///< kString: this \u escape must be the low surrogate after one
    std::vector<std::string> keys;  ///< kObject: the additional (undeclared) keys written so far
  };
  bool feed_top(unsigned char byte);
  bool start_value(Frame& f, unsigned char byte);
  bool whitespace(unsigned char byte);
  bool literal_step(Frame& f, unsigned char byte, bool& done) const;
  size_t containers() const { return open_; }  ///< open objects and arrays
  bool fits(int node) const;  ///< a value of `node` can start and close inside the current containers
  bool key_available(const Frame& object, int property) const;  ///< −1: an additional key
  bool any_key_available(const Frame& object) const;
  bool item_available(const Frame& array) const;
  const std::vector<std::string>& literals_of(const Frame& f) const;  ///< sorted, no duplicates

  std::shared_ptr<const JsonSchema> schema_;
  std::vector<Frame> stack_;
  /// kObject and kArray frames on stack_, counted as they open and close: whitespace asks for
  /// it at every indent byte, and a walk of the stack there would cost O(depth) a byte.
  size_t open_ = 0;
  /// The whitespace run since the last other byte (kMaxIndentPerLevel): none, one blank, a
  /// "\r" that needs its "\n", or a line break and ws_indent_ blanks.
  enum class Run : uint8_t { kNone, kBlank, kReturn, kLine };
  Run ws_run_ = Run::kNone;
  int ws_indent_ = 0;             ///< kLine: blanks after the line break
  bool took_whitespace_ = false;  ///< the byte being fed was taken as whitespace
};

/// The vocabulary as a trie for the constraint: ids sorted by their bytes, and which ids are
/// "plain" (non-empty, no '"', '\\' or control byte). Built once per tokenizer and shared.
class JsonVocabIndex {
 public:
  /// `vocab`: the logits row length (ids 0 … vocab − 1); `token_bytes` gives each id's bytes.
  JsonVocabIndex(int32_t vocab, const TokenBytesFn& token_bytes);
  /// The index of `tokenizer`'s byte-level tokens (special tokens count as empty), built on the
  /// first call and kept for later ones (engine/tokenizer_cache.h), also while no request uses it.
  static std::shared_ptr<const JsonVocabIndex> for_tokenizer(const Tokenizer& tokenizer, int32_t vocab);

  int32_t vocab() const { return vocab_; }                              ///< the logits row length
  std::span<const int32_t> sorted() const { return sorted_; }           ///< non-empty ids by bytes
  std::span<const std::string> bytes() const { return bytes_; }         ///< by id
  std::span<const int32_t> plain() const { return plain_; }             ///< plain ids, ascending
  std::span<const int32_t> special_bytes() const { return special_; }   ///< non-empty, not plain

 private:
  int32_t vocab_;
  std::vector<std::string> bytes_;
  std::vector<int32_t> sorted_, plain_, special_;
};

/// Sets every logit of `logits` (a [vocab] row) whose id `ok` does not mark (ok: one entry per
/// id, 1 = allowed; ids past its end count as refused) to −inf and returns how many are left.
/// When none would be left the row is not touched and 0 is returned (the caller gives up).
size_t apply_token_mask(std::span<float> logits, const std::vector<char>& ok);

/// Marks in `ok` (one entry per id) every token of `index` whose bytes a copy of `matcher` takes
/// whole. The vocabulary is walked as a trie: the tokens that share a prefix are tried together
/// and skipped together once the matcher refuses it. `Matcher`: copyable, bool feed(unsigned char).
template <class Matcher>
void mark_taken_tokens(const JsonVocabIndex& index, const Matcher& matcher, std::vector<char>& ok) {
  const auto sorted = index.sorted();
  const auto bytes = index.bytes();
  // sorted()[lo, hi) share their first `depth` bytes, which `m` has taken.
  auto walk = [&](auto& self, size_t lo, size_t hi, size_t depth, const Matcher& m) -> void {
    auto byte_at = [&](int32_t id) { return static_cast<unsigned char>(bytes[static_cast<size_t>(id)][depth]); };
    while (lo < hi && bytes[static_cast<size_t>(sorted[lo])].size() == depth) ok[static_cast<size_t>(sorted[lo++])] = 1;
    while (lo < hi) {
      const unsigned char c = byte_at(sorted[lo]);
      const auto first = sorted.begin() + static_cast<std::ptrdiff_t>(lo);
      const auto last = sorted.begin() + static_cast<std::ptrdiff_t>(hi);
      const size_t end = static_cast<size_t>(
          std::partition_point(first, last, [&](int32_t id) { return byte_at(id) <= c; }) - sorted.begin());
      Matcher next = m;
      if (next.feed(c)) self(self, lo, end, depth + 1, next);
      lo = end;
    }
  };
  walk(walk, 0, sorted.size(), 0, matcher);
}

/// The constraint over a generation (see the file comment).
class JsonConstraint {
 public:
  /// `stop_ids`: the tokens allowed once the document is complete (none: the constraint ends
  /// there and generation is free).
  JsonConstraint(std::shared_ptr<const JsonSchema> schema, std::shared_ptr<const JsonVocabIndex> vocab,
                 std::vector<int32_t> stop_ids);

  /// True until the document is complete and no stop token is left to force, or the constraint
  /// gave up (see mask).
  bool active() const { return active_; }
  /// True once the root object is closed.
  bool complete() const { return matcher_.complete(); }
  /// Whether token `id` may come next (every id once inactive).
  bool allows(int32_t id) const;
  /// Sets every logit the constraint refuses to −inf (`logits` is a [vocab] row); returns how
  /// many are left. When none would be left, the row stays as it is and the constraint gives up.
  size_t mask(std::span<float> logits);
  /// Takes the chosen token. One the constraint refuses (only after it gave up) ends it.
  void push(int32_t id);

 private:
  std::vector<char> allowed_mask() const;

  std::shared_ptr<const JsonVocabIndex> vocab_;
  std::vector<int32_t> stop_ids_;
  JsonMatcher matcher_;
  bool active_ = true;
};

}  // namespace lily
