// What the constraints derive from a tokenizer's vocabulary (JsonVocabIndex, ToolCallVocab) takes
// tens of milliseconds to build on a large vocabulary: TokenizerCache keeps it for the next
// request. Entries are keyed by Tokenizer::serial() (never reused, unlike an address) and a key of
// the caller's, and held (not only while a request uses them), at most `capacity` of them: the
// least recently used goes first, so an entry of a tokenizer since destroyed is dropped in time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>

#include "base/error.h"
#include "text/tokenizer.h"

namespace lily {

/// A bounded, thread-safe cache of values derived from a tokenizer (see the file comment).
/// `Key`: equality-comparable.
template <class Key, class Value>
class TokenizerCache {
 public:
  /// Builds a value on a miss.
  using Build = std::function<std::shared_ptr<const Value>()>;

  /// Keeps at most `capacity` (≥ 1) values.
  explicit TokenizerCache(size_t capacity) : capacity_(capacity) {
    if (capacity == 0) throw Error("tokenizer cache: the capacity must be at least 1");
  }

  /// The value for (`tokenizer`, `key`): the kept one, else `build()`'s, then kept. Building
  /// holds the lock, so two threads asking for one value build it once.
  std::shared_ptr<const Value> get(const Tokenizer& tokenizer, const Key& key, const Build& build) {
    std::lock_guard lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->serial == tokenizer.serial() && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);  // most recently used first
        return entries_.front().value;
      }
    }
    std::shared_ptr<const Value> value = build();
    if (!value) throw Error("tokenizer cache: the build gave no value");
    entries_.push_front(Entry{tokenizer.serial(), key, value});
    if (entries_.size() > capacity_) entries_.pop_back();
    return value;
  }

  /// The number of values kept (at most the capacity).
  size_t size() const {
    std::lock_guard lock(mutex_);
    return entries_.size();
  }

 private:
  struct Entry {
    uint64_t serial;
    Key key;
    std::shared_ptr<const Value> value;
  };
  mutable std::mutex mutex_;
  std::list<Entry> entries_;  ///< most recently used first
  size_t capacity_;
};

}  // namespace lily
