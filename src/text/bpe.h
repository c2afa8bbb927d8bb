// Byte-level BPE model (docs/model.md §5.2): the vocabulary, the merge ranks and the merge
// loop that turns one pre-tokenized piece (raw bytes) into token ids, with a word cache.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lily {

/// Open-addressing map from a token-id pair (left, right) to (merge rank, merged id).
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    int32_t merged = -1;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  /// Sizes the table for `count` merges.
  void reserve(size_t count);
  /// Inserts or overwrites the pair's entry (a later merge of the same pair wins, as in HF).
  void insert(int32_t left, int32_t right, uint32_t rank, int32_t merged);
  /// The entry for (left, right), or nullptr if the pair never merges.
  const Entry* find(int32_t left, int32_t right) const {
    uint64_t key = pack(left, right);
    size_t i = slot(key);
    while (true) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }

 private:
  static uint64_t pack(int32_t l, int32_t r) {
    return (uint64_t{static_cast<uint32_t>(l)} << 32) | static_cast<uint32_t>(r);
  }
  size_t slot(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int shift_ = 64;
};

/// The BPE vocabulary and merges. Immutable after construction except for the internal cache;
/// encode_piece is thread-safe.
class BpeModel {
 public:
  /// `vocab`: token string (byte-level alphabet) → id; `merges`: pairs of token strings in rank
  /// order; `ignore_merges`: look whole pieces up in the vocabulary first (HF BPE option).
  /// Throws lily::Error if a merge names a token (or yields a string) missing from the vocab.
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges);

  /// Appends the ids of one piece of raw bytes. Bytes whose byte-level token is missing from
  /// the vocabulary are dropped (HF BPE without unk_token does the same).
  void encode_piece(std::string_view bytes, std::vector<int32_t>& out) const;

  /// Merges a sequence of ids by rank (lowest rank first, leftmost first on ties); exposed for
  /// tests. Uses a linear scan for short words and a heap for long ones (same result).
  void merge(std::vector<int32_t>& symbols) const;
  void merge_linear(std::vector<int32_t>& symbols) const;
  void merge_heap(std::vector<int32_t>& symbols) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  void encode_uncached(std::string_view bytes, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  MergeTable merges_;
  std::array<int32_t, 256> byte_ids_{};
  bool ignore_merges_ = false;

  // Word cache, sharded to keep lock contention low between request threads.
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct CacheShard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
  };
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheWordsPerShard = 4096;
  static constexpr size_t kMaxCachedBytes = 256;
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace lily
