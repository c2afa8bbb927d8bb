#include "text/added_tokens.h"

#include <algorithm>

namespace lily {

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) : tokens_(tokens) {
  std::erase_if(tokens_, [](const AddedToken& t) { return t.content.empty(); });
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (uint32_t i = 0; i < tokens_.size(); ++i)
    by_first_byte_[static_cast<uint8_t>(tokens_[i].content[0])].push_back(i);
}

void AddedTokenMatcher::split(std::string_view text, std::vector<TextSegment>& out) const {
  size_t plain_start = 0;
  size_t i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (uint32_t k : by_first_byte_[static_cast<uint8_t>(text[i])]) {
      if (text.substr(i).starts_with(tokens_[k].content)) {
        hit = &tokens_[k];
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    if (i > plain_start) out.push_back({text.substr(plain_start, i - plain_start), -1});
    out.push_back({text.substr(i, hit->content.size()), hit->id});
    i += hit->content.size();
    plain_start = i;
  }
  if (plain_start < text.size()) out.push_back({text.substr(plain_start), -1});
}

}  // namespace lily
