#include "text/bpe.h"

#include <bit>
#include <limits>
#include <queue>

#include "base/error.h"
#include "text/utf8.h"

namespace lily {

void MergeTable::reserve(size_t count) {
  size_t capacity = std::bit_ceil(std::max<size_t>(16, count * 2));
  slots_.assign(capacity, Entry{});
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
}

void MergeTable::insert(int32_t left, int32_t right, uint32_t rank, int32_t merged) {
  uint64_t key = pack(left, right);
  size_t i = slot(key);
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  slots_[i] = Entry{key, rank, merged};
}

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges)
    : vocab_(std::move(vocab)), ignore_merges_(ignore_merges) {
  auto id_of = [this](const std::string& token, size_t rank) {
    auto it = vocab_.find(token);
    if (it == vocab_.end())
      throw Error("merge #" + std::to_string(rank) + " uses or yields '" + token +
                  "', which is not in model.vocab");
    return it->second;
  };
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    merges_.insert(id_of(a, rank), id_of(b, rank), static_cast<uint32_t>(rank), id_of(a + b, rank));
  }
  const auto& table = utf8::byte_to_code_point();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8::append_code_point(s, table[b]);
    auto it = vocab_.find(s);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
}

void BpeModel::merge(std::vector<int32_t>& symbols) const {
  if (symbols.size() <= 64) {
    merge_linear(symbols);
  } else {
    merge_heap(symbols);
  }
}

void BpeModel::merge_linear(std::vector<int32_t>& s) const {
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  // ranks[i]: rank of the pair (s[i], s[i+1]); kNone if it never merges.
  std::vector<uint32_t> ranks(s.size() > 0 ? s.size() - 1 : 0, kNone);
  auto rank_at = [&](size_t i) {
    const MergeTable::Entry* e = merges_.find(s[i], s[i + 1]);
    return e ? e->rank : kNone;
  };
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = rank_at(i);
  while (!ranks.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < ranks.size(); ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNone) break;
    s[best] = merges_.find(s[best], s[best + 1])->merged;
    s.erase(s.begin() + static_cast<ptrdiff_t>(best) + 1);
    ranks.erase(ranks.begin() + static_cast<ptrdiff_t>(best));
    if (best > 0) ranks[best - 1] = rank_at(best - 1);
    if (best < ranks.size()) ranks[best] = rank_at(best);
  }
}

void BpeModel::merge_heap(std::vector<int32_t>& s) const {
  const int n = static_cast<int>(s.size());
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    uint32_t rank;
    int pos;
    int32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const MergeTable::Entry* e = merges_.find(s[pos], s[next[pos]])) heap.push({e->rank, pos, e->merged});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    const MergeTable::Entry* e = merges_.find(s[c.pos], s[next[c.pos]]);
    if (e == nullptr || e->merged != c.merged || e->rank != c.rank) continue;  // stale
    int right = next[c.pos];
    s[c.pos] = c.merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  std::vector<int32_t> out;
  for (int i = 0; i >= 0 && i < n; i = next[i]) out.push_back(s[i]);
  s = std::move(out);
}

void BpeModel::encode_uncached(std::string_view bytes, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    auto it = vocab_.find(utf8::bytes_to_byte_level(bytes));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int32_t> symbols;
  symbols.reserve(bytes.size());
  for (char c : bytes) {
    int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id >= 0) symbols.push_back(id);
  }
  merge(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeModel::encode_piece(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.size() > kMaxCachedBytes) {
    encode_uncached(bytes, out);
    return;
  }
  size_t h = StringHash{}(bytes);
  CacheShard& shard = cache_[h % kCacheShards];
  {
    std::lock_guard lock(shard.mutex);
    auto it = shard.words.find(bytes);
    if (it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t start = out.size();
  encode_uncached(bytes, out);
  std::vector<int32_t> ids(out.begin() + static_cast<ptrdiff_t>(start), out.end());
  std::lock_guard lock(shard.mutex);
  if (shard.words.size() >= kCacheWordsPerShard) shard.words.clear();
  shard.words.emplace(std::string(bytes), std::move(ids));
}

}  // namespace lily
