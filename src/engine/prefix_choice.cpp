#include "engine/prefix_choice.h"

#include <algorithm>
#include <limits>

#include "base/error.h"
#include "text/tokenizer.h"

namespace lily {

PrefixChoiceConstraint::PrefixChoiceConstraint(std::vector<std::string> choices, int32_t vocab,
                                               TokenBytesFn token_bytes)
    : choices_(std::move(choices)), vocab_(vocab), token_bytes_(std::move(token_bytes)) {
  if (choices_.empty()) throw Error("prefix choices: no choice given");
  for (const std::string& c : choices_)
    if (c.empty()) throw Error("prefix choices: an empty choice");
  if (vocab_ <= 0) throw Error("prefix choices: the vocabulary is empty");
  if (!token_bytes_) throw Error("prefix choices: no token bytes");
  index_live();
}

PrefixChoiceConstraint PrefixChoiceConstraint::over_tokenizer(std::vector<std::string> choices, int32_t vocab,
                                                              const Tokenizer& tokenizer) {
  return PrefixChoiceConstraint(std::move(choices), vocab, [&tokenizer](int32_t id) {
    return tokenizer.is_special(id) ? std::string_view() : tokenizer.token_view(id);
  });
}

void PrefixChoiceConstraint::index_live() {
  for (auto& bucket : live_) bucket.clear();
  for (uint32_t i = 0; i < choices_.size(); ++i) {
    const std::string& c = choices_[i];
    if (c == text_) {
      active_ = false;
      return;
    }
    if (c.size() > text_.size() && std::string_view(c).starts_with(text_))
      live_[static_cast<unsigned char>(c[text_.size()])].push_back(i);
  }
}

bool PrefixChoiceConstraint::allows_bytes(std::string_view bytes) const {
  if (bytes.empty()) return false;
  for (uint32_t i : live_[static_cast<unsigned char>(bytes.front())])
    if (std::string_view(choices_[i]).substr(text_.size()).starts_with(bytes)) return true;
  return false;
}

bool PrefixChoiceConstraint::allows(int32_t id) const {
  if (!active_) return true;
  if (id < 0 || id >= vocab_) return false;
  return allows_bytes(token_bytes_(id));
}

std::vector<int32_t> PrefixChoiceConstraint::allowed() const {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < vocab_; ++id)
    if (allows(id)) ids.push_back(id);
  return ids;
}

size_t PrefixChoiceConstraint::mask(std::span<float> logits) {
  if (!active_) return logits.size();
  const auto n = static_cast<int32_t>(std::min<size_t>(logits.size(), static_cast<size_t>(vocab_)));
  std::vector<int32_t> keep;
  for (int32_t id = 0; id < n; ++id)
    if (allows_bytes(token_bytes_(id))) keep.push_back(id);
  if (keep.empty()) {
    active_ = false;  // nothing can continue the text: leave the row to the model
    return logits.size();
  }
  size_t k = 0;
  for (size_t id = 0; id < logits.size(); ++id) {
    if (k < keep.size() && static_cast<size_t>(keep[k]) == id) {
      ++k;
      continue;
    }
    logits[id] = -std::numeric_limits<float>::infinity();
  }
  return keep.size();
}

void PrefixChoiceConstraint::push(int32_t id) {
  if (!active_) return;
  const std::string_view bytes = id >= 0 && id < vocab_ ? token_bytes_(id) : std::string_view();
  if (!allows_bytes(bytes)) {
    active_ = false;
    return;
  }
  text_ += bytes;
  index_live();
}

}  // namespace lily
