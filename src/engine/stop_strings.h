// Stop strings (`stop` of the chat-completions API): finds the first occurrence of any stop
// string in streamed text and holds back text that could still be the start of one, so that
// a streaming client never sees a partial stop string.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace lily {

/// Incremental matcher over a stream of UTF-8 text pieces.
/// Invariant: the text returned so far never contains a stop string, and never ends with text
/// that a later piece could complete into one. Stop strings must be non-empty.
class StopStringMatcher {
 public:
  /// `stops`: the stop strings (duplicates allowed; empty strings throw lily::Error).
  explicit StopStringMatcher(std::vector<std::string> stops);

  /// Appends `piece`; returns the text that is now safe to emit. After a stop string is found
  /// (stopped() becomes true) it returns the text before it, and every later call returns "".
  std::string push(std::string_view piece);
  /// End of stream: returns the held-back text (nothing if a stop string was found).
  std::string finish();
  /// True once a stop string has been found.
  bool stopped() const { return stopped_; }
  /// True when there are no stop strings (push returns its input unchanged).
  bool empty() const { return stops_.empty(); }

 private:
  /// Length of the longest suffix of held_ that is a proper prefix of some stop string.
  size_t held_prefix_length() const;

  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace lily
