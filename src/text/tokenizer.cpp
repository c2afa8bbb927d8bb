// Tokenizer: tokenizer.json loading and validation, encode/decode, incremental decoding
// (docs/model.md §5). Semantics follow Hugging Face tokenizers (the test oracle).
#include "text/tokenizer.h"

#include <atomic>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "text/added_tokens.h"
#include "text/bpe.h"
#include "text/split_regex.h"
#include "text/utf8.h"

namespace lily {

namespace {

using json = nlohmann::json;

// The GPT-2 split pattern, used when the pre-tokenizer is a bare ByteLevel with use_regex.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class TokenKind : uint8_t { kUnknown, kVocab, kAdded, kSpecial };

// The largest token id accepted. The id tables are indexed by id (about 33 bytes an id), so an
// id is a size: 2^22 − 1 keeps them under 140 MB and is 16 times the largest vocabularies in use
// (Qwen3.6: 248,320).
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;

// What the parsed tokenizer.json describes, before the runtime structures are built.
struct TokenizerSpec {
  bool nfc = false;
  std::string split_pattern;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  bool ignore_merges = false;
  std::vector<AddedToken> added;
};

[[noreturn]] void reject(const std::string& where, const std::string& what) {
  throw Error("tokenizer.json " + where + ": " + what);
}

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

bool flag(const json& j, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) reject(std::string("field '") + key + "'", "expected true or false");
  return j[key].get<bool>();
}

void parse_normalizer(const json& n, TokenizerSpec& spec) {
  if (n.is_null()) return;
  std::string type = type_of(n);
  if (type == "NFC") {
    spec.nfc = true;
    return;
  }
  if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (const json& inner : n["normalizers"]) {
      if (type_of(inner) != "NFC" || spec.nfc) reject("normalizer", "only NFC (or none) is supported");
      spec.nfc = true;
    }
    return;
  }
  reject("normalizer", "type '" + type + "' is not supported (lily supports NFC or none)");
}

void check_byte_level_pre_tokenizer(const json& b, bool want_regex) {
  if (flag(b, "add_prefix_space", false))
    reject("pre_tokenizer ByteLevel", "add_prefix_space = true is not supported");
  if (flag(b, "use_regex", true) != want_regex)
    reject("pre_tokenizer ByteLevel", want_regex ? "expected use_regex = true when it stands alone"
                                                 : "expected use_regex = false after a Split");
}

void parse_split(const json& s, TokenizerSpec& spec) {
  if (!s.contains("pattern") || !s["pattern"].is_object() || !s["pattern"].contains("Regex") ||
      !s["pattern"]["Regex"].is_string())
    reject("pre_tokenizer Split", "only a {\"Regex\": …} pattern is supported");
  if (!s.contains("behavior") || s["behavior"] != "Isolated")
    reject("pre_tokenizer Split", "only behavior \"Isolated\" is supported");
  if (flag(s, "invert", false)) reject("pre_tokenizer Split", "invert = true is not supported");
  spec.split_pattern = s["pattern"]["Regex"].get<std::string>();
}

void parse_pre_tokenizer(const json& p, TokenizerSpec& spec) {
  std::string type = type_of(p);
  if (type == "ByteLevel") {
    check_byte_level_pre_tokenizer(p, true);
    spec.split_pattern = std::string(kGpt2Pattern);
    return;
  }
  const char* expected = "expected Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)] or ByteLevel";
  if (type != "Sequence" || !p.contains("pretokenizers") || !p["pretokenizers"].is_array() ||
      p["pretokenizers"].size() != 2)
    reject("pre_tokenizer", std::string(expected) + ", got '" + (type.empty() ? p.dump() : type) + "'");
  const json& split = p["pretokenizers"][0];
  const json& byte_level = p["pretokenizers"][1];
  if (type_of(split) != "Split" || type_of(byte_level) != "ByteLevel") reject("pre_tokenizer", expected);
  parse_split(split, spec);
  check_byte_level_pre_tokenizer(byte_level, false);
}

void parse_merges(const json& merges, TokenizerSpec& spec) {
  if (!merges.is_array()) reject("model.merges", "expected an array");
  spec.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        reject("model.merges[" + std::to_string(i) + "]", "expected \"left right\", got \"" + s + "\"");
      spec.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      spec.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      reject("model.merges[" + std::to_string(i) + "]", "expected \"left right\" or [\"left\", \"right\"]");
    }
  }
}

void parse_model(const json& m, TokenizerSpec& spec) {
  if (!m.is_object()) reject("model", "missing");
  std::string type = type_of(m);
  if (!type.empty() && type != "BPE") reject("model", "type '" + type + "' is not supported (only BPE)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"] != 0.0)
    reject("model", "BPE dropout is not supported");
  if (flag(m, "byte_fallback", false)) reject("model", "byte_fallback = true is not supported");
  if (m.contains("unk_token") && !m["unk_token"].is_null()) reject("model", "unk_token is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "")
      reject("model", std::string(key) + " is not supported");
  spec.ignore_merges = flag(m, "ignore_merges", false);
  if (!m.contains("vocab") || !m["vocab"].is_object()) reject("model.vocab", "expected an object");
  spec.vocab.reserve(m["vocab"].size());
  for (const auto& [token, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0)
      reject("model.vocab", "token '" + token + "' has an invalid id");
    if (id.get<int64_t>() > kMaxTokenId)
      reject("model.vocab", "token '" + token + "' has id " + std::to_string(id.get<int64_t>()) +
                                ", above the largest accepted (" + std::to_string(kMaxTokenId) + ")");
    spec.vocab.emplace(token, id.get<int32_t>());
  }
  parse_merges(m.contains("merges") ? m["merges"] : json::array(), spec);
}

void parse_added_tokens(const json& list, TokenizerSpec& spec) {
  if (list.is_null()) return;
  if (!list.is_array()) reject("added_tokens", "expected an array");
  for (const json& t : list) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || t["id"].get<int64_t>() < 0 ||
        !t.contains("content") || !t["content"].is_string())
      reject("added_tokens", "each entry needs an integer id and a string content");
    if (t["id"].get<int64_t>() > kMaxTokenId)
      reject("added_tokens", "id " + std::to_string(t["id"].get<int64_t>()) + " is above the largest accepted (" +
                                 std::to_string(kMaxTokenId) + ")");
    AddedToken token{t["id"].get<int32_t>(), t["content"].get<std::string>(), flag(t, "special", false),
                     flag(t, "normalized", false)};
    for (const char* key : {"single_word", "lstrip", "rstrip"})
      if (flag(t, key, false)) reject("added token '" + token.content + "'", std::string(key) + " = true is not supported");
    if (!utf8::is_valid(token.content)) reject("added token " + std::to_string(token.id), "content is not UTF-8");
    spec.added.push_back(std::move(token));
  }
}

void check_decoder_and_rest(const json& root) {
  if (!root.contains("decoder") || type_of(root["decoder"]) != "ByteLevel")
    reject("decoder", "only ByteLevel is supported");
  if (root.contains("post_processor") && !root["post_processor"].is_null() &&
      type_of(root["post_processor"]) != "ByteLevel")
    reject("post_processor", "only null or ByteLevel is supported (lily never adds special tokens)");
  for (const char* key : {"truncation", "padding"})
    if (root.contains(key) && !root[key].is_null()) reject(key, "must be null");
}

// Hugging Face tokenizers ignores the ids written for added tokens: it gives each one, in file
// order, its id in model.vocab if the content is there, else the next id after the number of
// vocabulary entries (or after the largest id given so far to an added token outside the
// vocabulary). lily refuses files where the written ids disagree.
void check_added_token_ids(const TokenizerSpec& spec) {
  const auto vocab_count = static_cast<int64_t>(spec.vocab.size());
  int64_t max_id = -1;
  for (const AddedToken& t : spec.added) {
    auto in_vocab = spec.vocab.find(t.content);
    int64_t expected = in_vocab != spec.vocab.end() ? in_vocab->second : (max_id >= vocab_count ? max_id + 1 : vocab_count);
    if (expected != t.id)
      reject("added token '" + t.content + "'",
             "has id " + std::to_string(t.id) + " but Hugging Face tokenizers would give it id " +
                 std::to_string(expected) + " (added tokens must follow the vocabulary in file order, or be in it)");
    if (in_vocab == spec.vocab.end()) max_id = std::max(max_id, expected);
  }
}

TokenizerSpec parse_spec(const json& root) {
  if (!root.is_object()) reject("", "the top level is not an object");
  TokenizerSpec spec;
  parse_normalizer(root.value("normalizer", json()), spec);
  if (!root.contains("pre_tokenizer")) reject("pre_tokenizer", "missing");
  parse_pre_tokenizer(root["pre_tokenizer"], spec);
  check_decoder_and_rest(root);
  parse_model(root.contains("model") ? root["model"] : json(), spec);
  parse_added_tokens(root.value("added_tokens", json()), spec);
  check_added_token_ids(spec);
  return spec;
}

}  // namespace

class TokenizerImpl {
 public:
  explicit TokenizerImpl(TokenizerSpec spec)
      : nfc_(spec.nfc), split_(spec.split_pattern), bpe_(std::move(spec.vocab), spec.merges, spec.ignore_merges) {
    std::vector<AddedToken> raw, normalized;
    for (const AddedToken& t : spec.added) (t.normalized ? normalized : raw).push_back(t);
    raw_matcher_ = AddedTokenMatcher(raw);
    normalized_matcher_ = AddedTokenMatcher(normalized);
    build_id_table(spec.added);
  }

  std::vector<int32_t> encode(std::string_view input, bool allow_special) const {
    std::string text = utf8::to_valid_lossy(input);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    std::vector<TextSegment> segments;
    if (allow_special) {
      raw_matcher_.split(text, segments);
    } else {
      segments.push_back({text, -1});
    }
    for (const TextSegment& seg : segments) {
      if (seg.token_id >= 0) {
        ids.push_back(seg.token_id);
      } else {
        encode_normalized(nfc_ ? utf8::nfc(seg.text) : std::string(seg.text), allow_special, ids);
      }
    }
    return ids;
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special) const {
    std::string bytes;
    for (int32_t id : ids) append_bytes(id, skip_special, bytes);
    return utf8::to_valid_lossy(bytes);
  }

  // Appends the bytes of `id` unless it is unknown or (with skip_special) a special token.
  void append_bytes(int32_t id, bool skip_special, std::string& out) const {
    if (id < 0 || static_cast<size_t>(id) >= kinds_.size()) return;
    TokenKind kind = kinds_[id];
    if (kind == TokenKind::kUnknown || (skip_special && kind == TokenKind::kSpecial)) return;
    out += bytes_[id];
  }

  std::string_view token_view(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= kinds_.size()) return {};
    return bytes_[id];
  }

  std::optional<int32_t> token_id(std::string_view token) const {
    auto it = added_ids_.find(std::string(token));
    if (it != added_ids_.end()) return it->second;
    auto v = bpe_.vocab().find(std::string(token));
    if (v != bpe_.vocab().end()) return v->second;
    return std::nullopt;
  }

  bool is_special(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < kinds_.size() && kinds_[id] == TokenKind::kSpecial;
  }

  int32_t vocab_size() const { return static_cast<int32_t>(kinds_.size()); }

 private:
  void encode_normalized(const std::string& text, bool allow_special, std::vector<int32_t>& ids) const {
    if (!allow_special || normalized_matcher_.empty()) {
      encode_plain(text, ids);
      return;
    }
    std::vector<TextSegment> segments;
    normalized_matcher_.split(text, segments);
    for (const TextSegment& seg : segments) {
      if (seg.token_id >= 0) {
        ids.push_back(seg.token_id);
      } else {
        encode_plain(seg.text, ids);
      }
    }
  }

  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
    thread_local std::vector<std::pair<size_t, size_t>> pieces;
    split_.split(text, pieces);
    for (const auto& [begin, end] : pieces) bpe_.encode_piece(text.substr(begin, end - begin), ids);
  }

  void build_id_table(const std::vector<AddedToken>& added) {
    int32_t size = 0;
    for (const auto& [token, id] : bpe_.vocab()) size = std::max(size, id + 1);
    for (const AddedToken& t : added) size = std::max(size, t.id + 1);
    kinds_.assign(size, TokenKind::kUnknown);
    bytes_.assign(size, std::string());
    for (const auto& [token, id] : bpe_.vocab()) {
      kinds_[id] = TokenKind::kVocab;
      bytes_[id] = utf8::byte_level_to_bytes(token);
    }
    // Added tokens take precedence for decoding, as in Hugging Face tokenizers.
    for (const AddedToken& t : added) {
      kinds_[t.id] = t.special ? TokenKind::kSpecial : TokenKind::kAdded;
      bytes_[t.id] = utf8::byte_level_to_bytes(t.content);
      added_ids_[t.content] = t.id;
    }
  }

  bool nfc_;
  SplitRegex split_;
  BpeModel bpe_;
  AddedTokenMatcher raw_matcher_;
  AddedTokenMatcher normalized_matcher_;
  std::vector<TokenKind> kinds_;
  std::vector<std::string> bytes_;
  std::unordered_map<std::string, int32_t> added_ids_;
};

std::shared_ptr<const Tokenizer> Tokenizer::from_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec)))
    throw Error("cannot open tokenizer file " + path.string() + ": no such file");
  std::string text;
  try {
    text = read_regular_file(path);  // a FIFO is refused here instead of blocking in open(2)
  } catch (const Error& e) {
    throw Error(std::string("tokenizer file ") + e.what());
  }
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw Error("tokenizer file " + path.string() + " is not valid JSON: " + e.what());
  }
  try {
    auto impl = std::make_unique<TokenizerImpl>(parse_spec(root));
    return std::shared_ptr<const Tokenizer>(new Tokenizer(std::move(impl)));
  } catch (const Error& e) {
    throw Error(path.string() + ": " + e.what());
  } catch (const json::exception& e) {
    throw Error(path.string() + ": malformed tokenizer.json: " + e.what());
  }
}

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {
  static std::atomic<uint64_t> next{1};
  serial_ = next.fetch_add(1, std::memory_order_relaxed);
}
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  return impl_->encode(text, allow_special);
}
std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  return impl_->decode(ids, skip_special);
}
std::string Tokenizer::token_bytes(int32_t id) const { return std::string(impl_->token_view(id)); }
std::string_view Tokenizer::token_view(int32_t id) const { return impl_->token_view(id); }
std::optional<int32_t> Tokenizer::token_id(std::string_view token) const { return impl_->token_id(token); }
bool Tokenizer::is_special(int32_t id) const { return impl_->is_special(id); }
int32_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }

IncrementalDecoder::IncrementalDecoder(std::shared_ptr<const Tokenizer> tokenizer, bool skip_special,
                                       std::vector<int32_t> kept_special)
    : tokenizer_(std::move(tokenizer)), skip_special_(skip_special), kept_special_(std::move(kept_special)) {
  if (!tokenizer_) throw InternalError("IncrementalDecoder needs a tokenizer");
}

std::string IncrementalDecoder::push(int32_t id) {
  if (skip_special_ && tokenizer_->is_special(id) &&
      std::find(kept_special_.begin(), kept_special_.end(), id) == kept_special_.end())
    return {};
  pending_ += tokenizer_->token_bytes(id);
  size_t hold = utf8::incomplete_tail_length(pending_);
  std::string ready = utf8::to_valid_lossy(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return ready;
}

std::string IncrementalDecoder::flush() {
  std::string rest = utf8::to_valid_lossy(pending_);
  pending_.clear();
  return rest;
}

}  // namespace lily
