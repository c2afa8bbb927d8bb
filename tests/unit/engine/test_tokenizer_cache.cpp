// engine/tokenizer_cache.h: values stay while no one holds them, the least recently used goes
// past the capacity, and a tokenizer never gets another's value, not even one destroyed before it
// (whose address it may reuse).
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "base/error.h"
#include "engine/tokenizer_cache.h"
#include "support/demo_tokenizer.h"

using namespace lily;

namespace {

std::shared_ptr<const Tokenizer> load_demo() {
  return Tokenizer::from_file(std::filesystem::path(LILY_SOURCE_DIR) / "models/demo/tokenizer.json");
}

/// A cache of strings that counts its builds.
struct Counted {
  TokenizerCache<int, std::string> cache{2};
  int builds = 0;
  std::shared_ptr<const std::string> get(const Tokenizer& t, int key) {
    return cache.get(t, key, [&] {
      ++builds;
      return std::make_shared<const std::string>(std::to_string(t.serial()) + "/" + std::to_string(key));
    });
  }
};

}  // namespace

TEST(TokenizerCache, KeepsValuesNobodyHolds) {
  const auto& t = test::demo_tokenizer();
  Counted c;
  std::weak_ptr<const std::string> first = c.get(*t, 1);
  EXPECT_FALSE(first.expired());  // the cache holds it
  EXPECT_EQ(c.get(*t, 1), first.lock());
  EXPECT_EQ(c.builds, 1);
}

TEST(TokenizerCache, DropsTheLeastRecentlyUsedPastItsCapacity) {
  const auto& t = test::demo_tokenizer();
  Counted c;
  std::weak_ptr<const std::string> one = c.get(*t, 1), two = c.get(*t, 2);
  c.get(*t, 1);  // 1 is now more recent than 2
  c.get(*t, 3);
  EXPECT_EQ(c.cache.size(), 2u);
  EXPECT_TRUE(two.expired());
  EXPECT_FALSE(one.expired());
  EXPECT_EQ(c.builds, 3);
  c.get(*t, 2);  // built again
  EXPECT_EQ(c.builds, 4);
  EXPECT_EQ(c.cache.size(), 2u);
}

TEST(TokenizerCache, ANewTokenizerNeverGetsAnOldOnesValue) {
  Counted c;
  auto a = load_demo();
  const uint64_t a_serial = a->serial();
  EXPECT_EQ(*c.get(*a, 7), std::to_string(a_serial) + "/7");
  a.reset();  // the next tokenizer may well be allocated where this one was
  const auto b = load_demo();
  EXPECT_NE(b->serial(), a_serial);
  EXPECT_EQ(*c.get(*b, 7), std::to_string(b->serial()) + "/7");
  EXPECT_EQ(c.builds, 2);
}

TEST(TokenizerCache, RefusesBadUse) {
  EXPECT_THROW((TokenizerCache<int, int>(0)), Error);
  TokenizerCache<int, int> cache(1);
  EXPECT_THROW(cache.get(*test::demo_tokenizer(), 0, [] { return std::shared_ptr<const int>(); }), Error);
  EXPECT_EQ(cache.size(), 0u);
}
