// Forced tool calls: a token-level constraint that holds the text after the forced opening of a
// tool call (server/chat_agent.h, forced_answer_prefix) to the model's call format, with the
// parameters the named function declares:
//
//   NAME>\n                                    (only when the opening ends at "<function=")
//   <parameter=P>\nVALUE\n</parameter>\n        zero or more, P a declared property, each once
//   </function>\n</tool_call>                   once every required property is written
//   then a stop token, or (ToolCallGrammar::more_calls) "\n<tool_call>\n<function=" and a call again
//
// as server/tool_calls.h parses it and as the Qwen3.5/3.6 chat template writes calls (one newline
// between two calls). A VALUE whose parameter the parser keeps as raw text (schema type "string")
// is any well-formed UTF-8 text (or, with enum/const, one of those strings) that holds neither
// "</parameter>" nor "</tool_call>", at most maxLength characters and kMaxRawValueBytes bytes;
// any other VALUE is a JSON value of the parameter's schema (engine/json_constraint.h's matcher,
// which also bounds whitespace runs, numbers and nesting), with no whitespace before or after it
// and neither marker in it.
//
// Three layers, as in json_constraint.h: ToolCallGrammar (the declared functions compiled once
// per request), ToolCallMatcher (a byte-level automaton over it) and ToolCallConstraint (the
// matcher applied to a logits row: every token whose bytes it refuses is set to −inf). A function
// whose `parameters` JsonSchema::compile refuses (or whose required parameter cannot be written
// in this format) is not followed: once its name is written the constraint ends and the model is
// free, as before this constraint existed. An optional parameter that cannot be written, or whose
// own schema the compiler refuses, is only left out.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/json_constraint.h"

namespace lily {

class Tokenizer;

/// Most bytes of one raw (string) parameter value: past it the value must close.
inline constexpr int64_t kMaxRawValueBytes = 65536;

/// The declared functions of a forced call, compiled for the matcher (see the file comment).
class ToolCallGrammar {
 public:
  /// A function as the request declares it.
  struct Declaration {
    std::string name;           ///< the function's name (no '>' or newline)
    nlohmann::json parameters;  ///< its JSON schema (null: it takes no parameters)
  };
  /// The answer parser's typing: true when the value of `parameter` of `function` is kept as raw
  /// text (server/tool_calls.h, ToolSchemas::raw_string), false when it is parsed as JSON.
  using RawFn = std::function<bool(const std::string& function, const std::string& parameter)>;

  /// Texts one of which comes next, sorted by bytes (none is a prefix of another), with what
  /// each leads to.
  struct Choices {
    std::vector<std::string> texts;
    std::vector<int> outcomes;
  };
  /// A parameter the model may write.
  struct Parameter {
    std::string name;
    bool raw = true;       ///< its text is the value; else a JSON value of `node`
    int node = 0;          ///< its node in Function::schema
    int64_t max_chars = -1;  ///< raw: maxLength (−1: any)
    Choices texts;         ///< raw with enum/const: each allowed text + "\n</parameter>\n" (none: any text)
  };
  /// A function a call may name.
  struct Function {
    std::string name;
    /// Its compiled parameters; null when the constraint does not follow this function (then
    /// `unfollowed` says why and the text is free after its name).
    std::shared_ptr<const JsonSchema> schema;
    std::string unfollowed;
    std::vector<Parameter> parameters;  ///< the writable properties, in the compiled schema's order
    uint64_t required = 0;              ///< bit i: parameters[i] must be written
    Choices parameter_names;            ///< "P>\n" → index in parameters
  };

  /// Compiles `functions` (non-empty; at most one may be named). `named`: the index of the
  /// function whose opening "<function=NAME>\n" is already written; nullopt: the text starts
  /// with the name (after "<function="). `more_calls`: after "</tool_call>" another call may
  /// follow. Never throws for a schema: a function whose schema cannot be followed is kept
  /// unfollowed (Function::unfollowed). Throws lily::Error for no functions or a bad `named`.
  static std::shared_ptr<const ToolCallGrammar> compile(const std::vector<Declaration>& functions, const RawFn& raw,
                                                        std::optional<size_t> named, bool more_calls);

  const std::vector<Function>& functions() const { return functions_; }
  const Choices& function_names() const { return names_; }  ///< "NAME>\n" → index in functions()
  std::optional<size_t> named() const { return named_; }
  bool more_calls() const { return more_calls_; }
  /// False when there is nothing to hold: the text starts after the name of an unfollowed function.
  bool constrains() const { return !named_ || functions_[*named_].schema != nullptr; }

 private:
  std::vector<Function> functions_;
  Choices names_;
  std::optional<size_t> named_;
  bool more_calls_ = false;
};

/// The byte-level matcher (see the file comment). Copyable; a copy is an independent state.
class ToolCallMatcher {
 public:
  /// A matcher at the grammar's start (right after the forced opening). `more_calls`: whether a
  /// further call may follow "</tool_call>" (at most the grammar's more_calls()).
  explicit ToolCallMatcher(std::shared_ptr<const ToolCallGrammar> grammar);
  ToolCallMatcher(std::shared_ptr<const ToolCallGrammar> grammar, bool more_calls);
  /// Takes one byte. False: the text plus this byte leaves the format (the matcher is then in no
  /// defined state: feed a copy when probing).
  bool feed(unsigned char byte);
  /// Feeds every byte of `bytes`; false at the first refused one.
  bool feed(std::string_view bytes);
  /// True right after "</tool_call>" (a stop token, or with more_calls another call, may follow).
  bool call_closed() const { return phase_ == Phase::kAfterCall; }
  /// True once an unfollowed function was named: every byte is taken from then on.
  bool free() const { return phase_ == Phase::kFree; }
  /// True inside a raw value's free text (not an enum's).
  bool in_raw_value() const { return phase_ == Phase::kRawValue; }

  /// How a token of ToolCallVocab::raw_plain() fares inside a raw value: kYes (taken whole,
  /// surely), kNo (refused: a character is half written), kProbe (feed a copy to know: it may
  /// complete a marker or pass a cap). Outside a raw value: kProbe.
  enum class Plain { kYes, kNo, kProbe };
  Plain raw_plain(std::string_view token) const;
  /// True inside free text of a JSON value (JsonMatcher::in_free_text) with no marker begun: a
  /// token of ToolCallVocab::json_plain() is then taken whole.
  bool in_json_free_text() const;

 private:
  enum class Phase : uint8_t { kChoice, kRawValue, kJsonValue, kAfterCall, kFree };
  /// Which Choices a kChoice phase matches.
  enum class Choice : uint8_t { kFunctionName, kBody, kParameterName, kRawText, kValueClose, kNextCall };

  const ToolCallGrammar::Choices& choices() const;
  bool available(int outcome) const;
  void enter(Choice choice, uint32_t pos = 0);
  void start_function(int function);
  void start_value(int parameter);
  void chosen(int outcome);
  bool choice_step(unsigned char byte);
  bool raw_step(unsigned char byte);
  bool json_step(unsigned char byte);
  const ToolCallGrammar::Function& function() const { return grammar_->functions()[static_cast<size_t>(function_)]; }

  std::shared_ptr<const ToolCallGrammar> grammar_;
  bool more_calls_ = false;
  Phase phase_ = Phase::kChoice;
  Choice choice_ = Choice::kFunctionName;
  uint32_t lo_ = 0, hi_ = 0, pos_ = 0;  ///< kChoice: the live texts [lo_, hi_) and the bytes matched
  int function_ = -1;                   ///< the function being called
  int parameter_ = -1;                  ///< the parameter being written
  uint64_t seen_ = 0;                   ///< parameters written so far
  // A value (raw or JSON): how far each marker is matched, and (raw) its size so far.
  uint8_t close_match_ = 0;      ///< raw: of "\n</parameter>" (its end)
  uint8_t parameter_match_ = 0;  ///< of "</parameter>" (refused inside a value)
  uint8_t call_match_ = 0;       ///< of "</tool_call>" (refused inside a value)
  Utf8Check utf8_;               ///< raw
  /// The value's bytes and (raw) characters so far, a partly matched "\n</parameter>" included.
  int64_t value_bytes_ = 0, value_chars_ = 0;
  std::optional<JsonMatcher> json_;            ///< kJsonValue
};

/// The vocabulary as the tool-call mask reads it: JsonVocabIndex's trie and these lists of
/// non-empty ids, ascending. Built once per tokenizer and set of kept special ids, and shared.
class ToolCallVocab {
 public:
  explicit ToolCallVocab(std::shared_ptr<const JsonVocabIndex> index);
  /// The index of `tokenizer`'s tokens, special ones empty except `kept_special` (markers whose
  /// text the answer keeps, GenerationParams::kept_special_ids). Built on the first call and kept
  /// for later ones (engine/tokenizer_cache.h), also while no request uses it.
  static std::shared_ptr<const ToolCallVocab> for_tokenizer(const Tokenizer& tokenizer, int32_t vocab,
                                                            std::span<const int32_t> kept_special);

  const JsonVocabIndex& index() const { return *index_; }
  std::span<const int32_t> raw_plain() const { return raw_plain_; }    ///< whole characters, no '<' or '\n'
  std::span<const int32_t> raw_other() const { return raw_other_; }    ///< the rest
  std::span<const int32_t> json_plain() const { return json_plain_; }  ///< JsonVocabIndex::plain() without '<'
  std::span<const int32_t> json_other() const { return json_other_; }  ///< the rest

 private:
  std::shared_ptr<const JsonVocabIndex> index_;
  std::vector<int32_t> raw_plain_, raw_other_, json_plain_, json_other_;
};

/// The constraint over a generation (see the file comment).
class ToolCallConstraint {
 public:
  /// `stop_ids`: the tokens allowed after "</tool_call>" (none: the constraint, and with it the
  /// generation, ends there, and no further call is offered).
  ToolCallConstraint(std::shared_ptr<const ToolCallGrammar> grammar, std::shared_ptr<const ToolCallVocab> vocab,
                     std::vector<int32_t> stop_ids);

  /// True until a stop token follows a closed call, an unfollowed function was named, or the
  /// constraint gave up (see mask).
  bool active() const { return active_; }
  /// True right after "</tool_call>".
  bool complete() const { return matcher_.call_closed(); }
  /// Whether token `id` may come next (every id once inactive).
  bool allows(int32_t id) const;
  /// Sets every logit the constraint refuses to −inf (`logits` is a [vocab] row); returns how
  /// many are left. When none would be left, the row stays as it is and the constraint gives up.
  size_t mask(std::span<float> logits);
  /// Takes the chosen token. One the constraint refuses (only after it gave up) ends it.
  void push(int32_t id);

 private:
  std::vector<char> allowed_mask() const;
  void probe(int32_t id, std::vector<char>& ok) const;

  std::shared_ptr<const ToolCallGrammar> grammar_;
  std::shared_ptr<const ToolCallVocab> vocab_;
  std::vector<int32_t> stop_ids_;
  ToolCallMatcher matcher_;
  bool active_ = true;
};

}  // namespace lily
