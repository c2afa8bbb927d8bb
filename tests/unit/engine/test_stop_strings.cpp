// StopStringMatcher: hold-back of possible stop-string starts, truncation, multiple stops.
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine/stop_strings.h"

using lily::StopStringMatcher;

TEST(StopStrings, NoStopsPassesTextThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(m.finish(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStrings, TruncatesBeforeStopInOnePiece) {
  StopStringMatcher m({"END"});
  EXPECT_EQ(m.push("hello END world"), "hello ");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.finish(), "");
}

TEST(StopStrings, HoldsBackPossibleStartAcrossPieces) {
  StopStringMatcher m({"END"});
  EXPECT_EQ(m.push("abc E"), "abc ");  // "E" might start "END"
  EXPECT_EQ(m.push("N"), "");          // "EN" still might
  EXPECT_EQ(m.push("D!"), "");         // decided: stop
  EXPECT_TRUE(m.stopped());
}

TEST(StopStrings, ReleasesHeldTextWhenItTurnsOutNotToBeAStop) {
  StopStringMatcher m({"END"});
  EXPECT_EQ(m.push("E"), "");
  EXPECT_EQ(m.push("NX"), "ENX");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStrings, FinishReleasesHeldTail) {
  StopStringMatcher m({"END"});
  EXPECT_EQ(m.push("xEN"), "x");
  EXPECT_EQ(m.finish(), "EN");
}

TEST(StopStrings, EarliestOfSeveralStopsWins) {
  StopStringMatcher m({"world", "lo w"});
  EXPECT_EQ(m.push("hello world"), "hel");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStrings, OverlappingPrefixIsNotLost) {
  // "aab": after "aa" the matcher must keep both a's, since "aab" may still follow.
  StopStringMatcher m({"aab"});
  EXPECT_EQ(m.push("xa"), "x");
  EXPECT_EQ(m.push("a"), "");
  EXPECT_EQ(m.push("a"), "a");  // "aaa": the first 'a' can no longer start "aab"
  EXPECT_EQ(m.push("b"), "");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStrings, MultiByteStopString) {
  StopStringMatcher m({"→"});
  EXPECT_EQ(m.push("a → b"), "a ");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStrings, EmptyStopStringIsRejected) {
  EXPECT_THROW(StopStringMatcher({""}), lily::Error);
}
