#include "engine/tool_call_constraint.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "base/error.h"
#include "engine/tokenizer_cache.h"
#include "text/tokenizer.h"

namespace lily {

namespace {

constexpr std::string_view kParameterOpen = "<parameter=";
constexpr std::string_view kCallEnd = "</function>\n</tool_call>";
constexpr std::string_view kValueClose = "\n</parameter>\n";
constexpr std::string_view kNextCall = "\n<tool_call>\n<function=";
// Markers a value may not hold: the parser ends a value at the first "</parameter>" and a call
// at the first "</tool_call>". Each begins with a byte it holds nowhere else, so a match that
// breaks restarts at 0 or 1 (see advance).
constexpr std::string_view kValueEnd = "\n</parameter>";
constexpr std::string_view kParameterEnd = "</parameter>";
constexpr std::string_view kCallClose = "</tool_call>";

/// The bytes of `marker` matched once `byte` follows `matched` of them.
uint8_t advance(std::string_view marker, uint8_t matched, unsigned char byte) {
  if (static_cast<unsigned char>(marker[matched]) == byte) return static_cast<uint8_t>(matched + 1);
  return static_cast<unsigned char>(marker[0]) == byte ? 1 : 0;
}

bool holds_marker(std::string_view text) {
  return text.find(kParameterEnd) != std::string_view::npos || text.find(kCallClose) != std::string_view::npos;
}

/// Sorted choices from (text, outcome) pairs.
ToolCallGrammar::Choices sorted_choices(std::vector<std::pair<std::string, int>> items) {
  std::sort(items.begin(), items.end());
  ToolCallGrammar::Choices c;
  for (auto& [text, outcome] : items) {
    c.texts.push_back(std::move(text));
    c.outcomes.push_back(outcome);
  }
  return c;
}

/// Between parameters: 0 opens one, 1 ends the call.
const ToolCallGrammar::Choices& body_choices() {
  static const auto c = sorted_choices({{std::string(kParameterOpen), 0}, {std::string(kCallEnd), 1}});
  return c;
}

/// A single text.
ToolCallGrammar::Choices one_choice(std::string_view text) { return sorted_choices({{std::string(text), 0}}); }

/// A name the parser reads back whole: non-empty, no markup, on one line.
bool writable_name(const std::string& name) {
  return !name.empty() && name.find_first_of("<>\n") == std::string::npos;
}

/// A parameter name JsonSchema::compile takes (it writes keys without JSON escapes) and the parser
/// reads back.
bool compilable_name(const std::string& name) {
  return writable_name(name) && std::none_of(name.begin(), name.end(), [](char c) {
           return c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20;
         });
}

/// True when JsonSchema::compile takes `property` as the schema of one optional property (the
/// root's $defs and definitions in reach of its $refs).
bool compiles_alone(const nlohmann::json& parameters, const nlohmann::json& property) {
  nlohmann::json probe{{"type", "object"}, {"properties", {{"p", property}}}};
  for (const char* defs : {"$defs", "definitions"})
    if (parameters.contains(defs)) probe[defs] = parameters[defs];
  try {
    JsonSchema::compile(probe);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

/// `parameters` without the optional properties the constraint cannot follow: a name it cannot
/// write, or (`check_schemas`) a schema the JSON compiler refuses. They are only left out, as
/// the docs promise; a required one stays, and makes the function unfollowed.
nlohmann::json without_unfollowable_optionals(const nlohmann::json& parameters, bool check_schemas) {
  if (!parameters.is_object() || !parameters.contains("properties") || !parameters["properties"].is_object())
    return parameters;
  const nlohmann::json required = parameters.value("required", nlohmann::json::array());
  auto is_required = [&](const std::string& name) {
    return required.is_array() && std::find(required.begin(), required.end(), name) != required.end();
  };
  nlohmann::json out = parameters;
  nlohmann::json& properties = out["properties"];
  for (const auto& [name, schema] : parameters["properties"].items())
    if (!is_required(name) && (!compilable_name(name) || (check_schemas && !compiles_alone(parameters, schema))))
      properties.erase(name);
  return out;
}

/// The parameters' schema compiled; optional parameters it cannot follow are left out first
/// (their schemas are probed one by one only when the whole does not compile).
std::shared_ptr<const JsonSchema> compile_parameters(const nlohmann::json& parameters) {
  if (parameters.is_null()) return JsonSchema::compile(nlohmann::json{{"type", "object"}});
  try {
    return JsonSchema::compile(without_unfollowable_optionals(parameters, false));
  } catch (const std::exception&) {
    return JsonSchema::compile(without_unfollowable_optionals(parameters, true));
  }
}

/// The schema's property names and enum/const values must not hold a marker: the matcher would
/// offer them and then refuse their end.
void check_no_markers(const JsonSchema& schema) {
  for (size_t i = 0; i < schema.size(); ++i) {
    const JsonSchema::Node& n = schema.node(static_cast<int>(i));
    for (const auto* list : {&n.property_names, &n.literals})
      for (const std::string& s : *list)
        if (holds_marker(s)) throw Error("a property name or enum value holds \"</parameter>\" or \"</tool_call>\"");
  }
}

/// A raw parameter: what its text may be (Parameter::texts, max_chars); false when no text is a
/// valid value (its schema takes no string).
bool raw_texts(const JsonSchema::Node& node, ToolCallGrammar::Parameter& p) {
  if (node.literals.empty()) {
    p.max_chars = node.max_length;
    return (node.types & JsonSchema::kString) != 0;
  }
  std::vector<std::pair<std::string, int>> texts;
  for (const std::string& literal : node.literals) {
    const nlohmann::json v = nlohmann::json::parse(literal);
    if (v.is_string()) texts.emplace_back(v.get<std::string>() + std::string(kValueClose), 0);
  }
  // Sorted, then duplicates dropped: O(n log n) for enums of many values.
  std::sort(texts.begin(), texts.end());
  texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
  p.texts = sorted_choices(std::move(texts));
  return !p.texts.texts.empty();
}

/// One function: its schema compiled and its writable parameters; unfollowed on any refusal.
ToolCallGrammar::Function compile_function(const ToolCallGrammar::Declaration& d, const ToolCallGrammar::RawFn& raw) {
  ToolCallGrammar::Function f;
  f.name = d.name;
  try {
    auto schema = compile_parameters(d.parameters);
    check_no_markers(*schema);
    const JsonSchema::Node& root = schema->node(schema->root());
    std::vector<std::pair<std::string, int>> names;
    for (size_t i = 0; i < root.property_names.size(); ++i) {
      ToolCallGrammar::Parameter p;
      p.name = root.property_names[i];
      p.node = root.property_nodes[i];
      p.raw = !raw || raw(d.name, p.name);
      const bool writable = writable_name(p.name) && (!p.raw || raw_texts(schema->node(p.node), p));
      const bool required = (root.required >> i & 1) != 0;
      if (!writable && required)
        throw Error("the required parameter '" + p.name + "' cannot be written as a tool-call parameter");
      if (!writable) continue;
      if (required) f.required |= uint64_t{1} << f.parameters.size();
      names.emplace_back(p.name + ">\n", static_cast<int>(f.parameters.size()));
      f.parameters.push_back(std::move(p));
    }
    f.parameter_names = sorted_choices(std::move(names));
    f.schema = std::move(schema);
  } catch (const std::exception& e) {  // whatever the schema holds, the request is answered
    f.schema.reset();
    f.parameters.clear();
    f.required = 0;
    f.parameter_names = {};
    f.unfollowed = e.what();
  }
  return f;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The grammar

std::shared_ptr<const ToolCallGrammar> ToolCallGrammar::compile(const std::vector<Declaration>& functions,
                                                                const RawFn& raw, std::optional<size_t> named,
                                                                bool more_calls) {
  if (functions.empty()) throw Error("tool-call grammar: no functions");
  if (named && *named >= functions.size()) throw Error("tool-call grammar: the named function is not declared");
  auto g = std::make_shared<ToolCallGrammar>();
  std::vector<std::pair<std::string, int>> names;
  for (const Declaration& d : functions) {
    if (!writable_name(d.name)) throw Error("tool-call grammar: the function name '" + d.name + "' cannot be written");
    names.emplace_back(d.name + ">\n", static_cast<int>(g->functions_.size()));
    g->functions_.push_back(compile_function(d, raw));
  }
  g->names_ = sorted_choices(std::move(names));
  g->named_ = named;
  g->more_calls_ = more_calls;
  return g;
}

// ---------------------------------------------------------------------------------------------
// The matcher

ToolCallMatcher::ToolCallMatcher(std::shared_ptr<const ToolCallGrammar> grammar)
    : ToolCallMatcher(grammar, grammar && grammar->more_calls()) {}

ToolCallMatcher::ToolCallMatcher(std::shared_ptr<const ToolCallGrammar> grammar, bool more_calls)
    : grammar_(std::move(grammar)), more_calls_(more_calls) {
  if (!grammar_) throw Error("tool-call matcher: no grammar");
  more_calls_ = more_calls_ && grammar_->more_calls();
  if (grammar_->named()) start_function(static_cast<int>(*grammar_->named()));
  else enter(Choice::kFunctionName);
}

const ToolCallGrammar::Choices& ToolCallMatcher::choices() const {
  switch (choice_) {
    case Choice::kFunctionName: return grammar_->function_names();
    case Choice::kBody: return body_choices();
    case Choice::kParameterName: return function().parameter_names;
    case Choice::kRawText: return function().parameters[static_cast<size_t>(parameter_)].texts;
    case Choice::kValueClose: break;
    case Choice::kNextCall: {
      static const auto next = one_choice(kNextCall);
      return next;
    }
  }
  static const auto close = one_choice(kValueClose);
  return close;
}

// Between parameters: another one while one is left, the end once the required ones are there.
bool ToolCallMatcher::available(int outcome) const {
  if (choice_ == Choice::kParameterName) return !(seen_ >> outcome & 1);
  if (choice_ != Choice::kBody) return true;
  const ToolCallGrammar::Function& f = function();
  if (outcome == 1) return (seen_ & f.required) == f.required;
  for (size_t i = 0; i < f.parameters.size(); ++i)
    if (!(seen_ >> i & 1)) return true;
  return false;
}

void ToolCallMatcher::enter(Choice choice, uint32_t pos) {
  phase_ = Phase::kChoice;
  choice_ = choice;
  lo_ = 0;
  hi_ = static_cast<uint32_t>(choices().texts.size());
  pos_ = pos;
}

void ToolCallMatcher::start_function(int function) {
  function_ = function;
  seen_ = 0;
  if (!this->function().schema) {
    phase_ = Phase::kFree;
    return;
  }
  enter(Choice::kBody);
}

void ToolCallMatcher::start_value(int parameter) {
  parameter_ = parameter;
  seen_ |= uint64_t{1} << parameter;
  close_match_ = parameter_match_ = call_match_ = 0;
  value_bytes_ = value_chars_ = 0;
  const ToolCallGrammar::Parameter& p = function().parameters[static_cast<size_t>(parameter)];
  if (!p.raw) {
    json_.emplace(function().schema, p.node);
    phase_ = Phase::kJsonValue;
  } else if (!p.texts.texts.empty()) {
    enter(Choice::kRawText);
  } else {
    utf8_ = Utf8Check{};
    phase_ = Phase::kRawValue;
  }
}

void ToolCallMatcher::chosen(int outcome) {
  switch (choice_) {
    case Choice::kFunctionName: return start_function(outcome);
    case Choice::kBody:
      if (outcome == 0) return enter(Choice::kParameterName);
      phase_ = Phase::kAfterCall;
      return;
    case Choice::kParameterName: return start_value(outcome);
    case Choice::kRawText:
    case Choice::kValueClose: return enter(Choice::kBody);
    case Choice::kNextCall: return enter(Choice::kFunctionName);
  }
}

// The live texts share their first pos_ bytes and are sorted, so those going on with `byte` are
// a sub-range; it must hold an available one. A text written whole is chosen.
bool ToolCallMatcher::choice_step(unsigned char byte) {
  const ToolCallGrammar::Choices& c = choices();
  auto at = [&](uint32_t i) { return static_cast<unsigned char>(c.texts[i][pos_]); };
  uint32_t lo = lo_;
  while (lo < hi_ && at(lo) < byte) ++lo;
  uint32_t hi = lo;
  while (hi < hi_ && at(hi) == byte) ++hi;
  bool any = false;
  for (uint32_t i = lo; i < hi && !any; ++i) any = available(c.outcomes[i]);
  if (!any) return false;
  lo_ = lo;
  hi_ = hi;
  ++pos_;
  if (c.texts[lo_].size() == pos_) chosen(c.outcomes[lo_]);
  return true;
}

// Raw text ends with "\n</parameter>"; it may hold neither marker otherwise, and its size without
// a partly written end stays within the caps (so the end can always still be written).
bool ToolCallMatcher::raw_step(unsigned char byte) {
  if (!utf8_.step(byte)) return false;
  close_match_ = advance(kValueEnd, close_match_, byte);
  parameter_match_ = advance(kParameterEnd, parameter_match_, byte);
  call_match_ = advance(kCallClose, call_match_, byte);
  ++value_bytes_;
  if ((byte & 0xC0) != 0x80) ++value_chars_;
  if (close_match_ == kValueEnd.size()) {
    enter(Choice::kValueClose, static_cast<uint32_t>(kValueEnd.size()));
    return true;
  }
  if (parameter_match_ == kParameterEnd.size() || call_match_ == kCallClose.size()) return false;
  const int64_t max_chars = function().parameters[static_cast<size_t>(parameter_)].max_chars;
  if (value_bytes_ - close_match_ > kMaxRawValueBytes) return false;
  return max_chars < 0 || value_chars_ - close_match_ <= max_chars;
}

// A JSON value starts right after its line's newline (no whitespace first, as the template
// writes it) and ends with the newline after it; its bytes never hold a marker.
bool ToolCallMatcher::json_step(unsigned char byte) {
  if (byte == '\n' && json_->can_end()) {
    json_.reset();
    enter(Choice::kValueClose, 1);
    return true;
  }
  const bool space = byte == ' ' || byte == '\n' || byte == '\t' || byte == '\r';
  if ((value_bytes_++ == 0 && space) || !json_->feed(byte)) return false;
  parameter_match_ = advance(kParameterEnd, parameter_match_, byte);
  call_match_ = advance(kCallClose, call_match_, byte);
  return parameter_match_ < kParameterEnd.size() && call_match_ < kCallClose.size();
}

bool ToolCallMatcher::feed(unsigned char byte) {
  switch (phase_) {
    case Phase::kFree: return true;
    case Phase::kAfterCall:
      if (!more_calls_) return false;
      enter(Choice::kNextCall);
      return choice_step(byte);
    case Phase::kChoice: return choice_step(byte);
    case Phase::kRawValue: return raw_step(byte);
    case Phase::kJsonValue: return json_step(byte);
  }
  return false;
}

bool ToolCallMatcher::feed(std::string_view bytes) {
  for (char c : bytes)
    if (!feed(static_cast<unsigned char>(c))) return false;
  return true;
}

// A plain token (whole characters, no '<' or '\n') can only advance a marker already begun, and
// only with its first byte; otherwise every marker drops to 0 and the value grows by the pending
// part of its end plus the token.
ToolCallMatcher::Plain ToolCallMatcher::raw_plain(std::string_view token) const {
  if (phase_ != Phase::kRawValue || token.empty()) return Plain::kProbe;
  if (utf8_.need != 0) return Plain::kNo;
  const auto first = static_cast<unsigned char>(token.front());
  if ((close_match_ > 0 && static_cast<unsigned char>(kValueEnd[close_match_]) == first) ||
      (parameter_match_ > 0 && static_cast<unsigned char>(kParameterEnd[parameter_match_]) == first) ||
      (call_match_ > 0 && static_cast<unsigned char>(kCallClose[call_match_]) == first))
    return Plain::kProbe;
  const auto size = static_cast<int64_t>(token.size());  // ≥ its characters
  const int64_t max_chars = function().parameters[static_cast<size_t>(parameter_)].max_chars;
  if (value_bytes_ + size > kMaxRawValueBytes || (max_chars >= 0 && value_chars_ + size > max_chars))
    return Plain::kProbe;
  return Plain::kYes;
}

bool ToolCallMatcher::in_json_free_text() const {
  return phase_ == Phase::kJsonValue && parameter_match_ == 0 && call_match_ == 0 && json_->in_free_text();
}

// ---------------------------------------------------------------------------------------------
// The vocabulary and the constraint

ToolCallVocab::ToolCallVocab(std::shared_ptr<const JsonVocabIndex> index) : index_(std::move(index)) {
  if (!index_) throw Error("tool-call constraint: no vocabulary index");
  const auto bytes = index_->bytes();
  std::vector<char> json_plain(bytes.size(), 0);
  for (int32_t id : index_->plain()) json_plain[static_cast<size_t>(id)] = 1;
  for (int32_t id = 0; id < index_->vocab(); ++id) {
    const std::string& b = bytes[static_cast<size_t>(id)];
    if (b.empty()) continue;
    const bool angle_or_newline = b.find_first_of("<\n") != std::string::npos;
    Utf8Check utf8;
    const bool whole = std::all_of(b.begin(), b.end(), [&](char c) { return utf8.step(static_cast<unsigned char>(c)); }) &&
                       utf8.need == 0;
    (whole && !angle_or_newline ? raw_plain_ : raw_other_).push_back(id);
    const bool angle = b.find('<') != std::string::npos;
    (json_plain[static_cast<size_t>(id)] && !angle ? json_plain_ : json_other_).push_back(id);
  }
}

std::shared_ptr<const ToolCallVocab> ToolCallVocab::for_tokenizer(const Tokenizer& tokenizer, int32_t vocab,
                                                                  std::span<const int32_t> kept_special) {
  // Keyed by the row length and the kept special ids (sorted): a server asks for one or two.
  static TokenizerCache<std::pair<int32_t, std::vector<int32_t>>, ToolCallVocab> cache(4);
  std::vector<int32_t> kept(kept_special.begin(), kept_special.end());
  std::sort(kept.begin(), kept.end());
  return cache.get(tokenizer, {vocab, kept}, [&] {
    auto index = std::make_shared<const JsonVocabIndex>(vocab, [&tokenizer, &kept](int32_t id) {
      const bool dropped = tokenizer.is_special(id) && !std::binary_search(kept.begin(), kept.end(), id);
      return dropped ? std::string_view() : tokenizer.token_view(id);
    });
    return std::make_shared<const ToolCallVocab>(std::move(index));
  });
}

ToolCallConstraint::ToolCallConstraint(std::shared_ptr<const ToolCallGrammar> grammar,
                                       std::shared_ptr<const ToolCallVocab> vocab, std::vector<int32_t> stop_ids)
    : grammar_(std::move(grammar)),
      vocab_(std::move(vocab)),
      stop_ids_(std::move(stop_ids)),
      matcher_(grammar_, !stop_ids_.empty()) {
  if (!vocab_) throw Error("tool-call constraint: no vocabulary");
  active_ = !matcher_.free();
}

void ToolCallConstraint::probe(int32_t id, std::vector<char>& ok) const {
  ToolCallMatcher m = matcher_;
  if (m.feed(vocab_->index().bytes()[static_cast<size_t>(id)])) ok[static_cast<size_t>(id)] = 1;
}

std::vector<char> ToolCallConstraint::allowed_mask() const {
  const JsonVocabIndex& index = vocab_->index();
  std::vector<char> ok(static_cast<size_t>(index.vocab()), 0);
  if (matcher_.call_closed()) {
    for (int32_t id : stop_ids_)
      if (id >= 0 && id < index.vocab()) ok[static_cast<size_t>(id)] = 1;
    mark_taken_tokens(index, matcher_, ok);  // a further call, when one may follow
    return ok;
  }
  if (matcher_.in_json_free_text()) {
    for (int32_t id : vocab_->json_plain()) ok[static_cast<size_t>(id)] = 1;
    for (int32_t id : vocab_->json_other()) probe(id, ok);
    return ok;
  }
  if (matcher_.in_raw_value()) {  // most tokens are plain text there: no walk, no copy for them
    for (int32_t id : vocab_->raw_plain()) {
      const ToolCallMatcher::Plain fate = matcher_.raw_plain(index.bytes()[static_cast<size_t>(id)]);
      if (fate == ToolCallMatcher::Plain::kYes) ok[static_cast<size_t>(id)] = 1;
      else if (fate == ToolCallMatcher::Plain::kProbe) probe(id, ok);
    }
    for (int32_t id : vocab_->raw_other()) probe(id, ok);
    return ok;
  }
  mark_taken_tokens(index, matcher_, ok);
  return ok;
}

bool ToolCallConstraint::allows(int32_t id) const {
  if (!active_) return true;
  if (id < 0 || id >= vocab_->index().vocab()) return false;
  if (matcher_.call_closed() && std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end()) return true;
  const std::string& b = vocab_->index().bytes()[static_cast<size_t>(id)];
  ToolCallMatcher m = matcher_;
  return !b.empty() && m.feed(b);
}

size_t ToolCallConstraint::mask(std::span<float> logits) {
  if (!active_) return logits.size();
  const size_t left = apply_token_mask(logits, allowed_mask());
  if (left > 0) return left;
  active_ = false;  // nothing can continue: give up, leave the row to the model
  return logits.size();
}

void ToolCallConstraint::push(int32_t id) {
  if (!active_) return;
  const bool stop = std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
  if ((matcher_.call_closed() && stop) || id < 0 || id >= vocab_->index().vocab()) {
    active_ = false;  // the answer ends after its call (or a refused id): the constraint is over
    return;
  }
  const std::string& b = vocab_->index().bytes()[static_cast<size_t>(id)];
  if (b.empty() || !matcher_.feed(b) || matcher_.free()) active_ = false;
  if (active_ && matcher_.call_closed() && stop_ids_.empty()) active_ = false;
}

}  // namespace lily
