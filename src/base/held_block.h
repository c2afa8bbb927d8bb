// HeldBlock: a block of memory taken from a shared source (BlockPool, SlabArena) and given back
// to it when the handle goes away.
#pragma once
#include <cstddef>
#include <memory>
#include <utility>

namespace lily {

/// A block taken from a shared `Source` and given back to it on destruction. Holds the source,
/// so the source lives as long as any of its blocks is out. Move-only; not thread-safe itself
/// (the sources are). `Source` provides `void* take(size_t bytes)` (nullptr for 0 bytes; throws
/// when it cannot) and `void give(void* block, size_t bytes) noexcept`.
template <class Source>
class HeldBlock {
 public:
  HeldBlock() = default;
  /// A block of `bytes` bytes from `source` (none for 0 bytes). Throws as Source::take.
  HeldBlock(std::shared_ptr<Source> source, size_t bytes) : source_(std::move(source)) {
    ptr_ = source_->take(bytes);
    bytes_ = ptr_ ? bytes : 0;
  }
  ~HeldBlock() { reset(); }
  HeldBlock(const HeldBlock&) = delete;
  HeldBlock& operator=(const HeldBlock&) = delete;
  HeldBlock(HeldBlock&& o) noexcept
      : source_(std::move(o.source_)), ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  HeldBlock& operator=(HeldBlock&& o) noexcept {
    if (this != &o) {
      reset();
      source_ = std::move(o.source_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  /// Gives the block back now (if any); the handle is empty afterwards.
  void reset() noexcept {
    if (ptr_) source_->give(ptr_, bytes_);
    ptr_ = nullptr;
    bytes_ = 0;
    source_.reset();
  }
  /// The block's memory (nullptr when empty), aligned as the source aligns its blocks.
  void* data() const { return ptr_; }
  /// The block's memory cast to T* (no check of alignment beyond the source's).
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  /// The bytes asked for (0 when empty).
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<Source> source_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace lily
