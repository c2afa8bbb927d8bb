// The prefix cache's logic over a fake backend: strict prefixes, key preference, non-consuming
// hits, the radix tree's splits and merges with thousands of snapshots, identical retries,
// branches, message-boundary resume points, LRU eviction by bytes through the device and host
// tiers, host copies made in the background (stores that never wait for them, snapshots that
// resume meanwhile, cancelled and failed copies, the backlog bound), and output equality with and
// without the cache through the real generation loop.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "engine/generate.h"
#include "engine/option_error.h"
#include "engine/session_cache.h"
#include "fake_backend.h"

using namespace lily;
using lily::test::FakeBackend;
using lily::test::FakeState;
using namespace std::chrono_literals;

namespace {

using Tokens = std::vector<int32_t>;

ResumePoint point(FakeBackend& b, const Tokens& tokens) {
  auto s = b.new_state(1000);
  b.prefill(*s, tokens);
  return ResumePoint{tokens, std::move(s)};
}

void store(SessionCache& c, FakeBackend& b, std::vector<Tokens> point_tokens,
           std::optional<std::string> key = std::nullopt) {
  std::vector<ResumePoint> points;
  for (auto& t : point_tokens) points.push_back(point(b, t));
  c.store(b, std::move(points), key);
}

/// One request through cache + generate, as the scheduler does it.
struct Outcome {
  Tokens tokens;
  int64_t cached = 0;
};
Outcome request(SessionCache& c, FakeBackend& b, const Tokens& prompt, int64_t max_tokens,
                std::optional<std::string> key = std::nullopt, std::vector<int64_t> splits = {}) {
  auto hit = c.acquire(b, prompt, key);
  auto state = hit.state ? std::move(hit.state) : b.new_state(1000);
  std::vector<ResumePoint> points;
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.max_seq = 1000;
  p.prompt_splits = std::move(splits);
  auto r = generate(b, *state, prompt, p, nullptr, {}, [&](const SequenceState& s, int64_t n) {
    points.push_back({Tokens(prompt.begin(), prompt.begin() + n), b.clone_state(s)});
  });
  Tokens fed(prompt);
  fed.insert(fed.end(), r.token_ids.begin(), r.token_ids.begin() + r.fed_tokens);
  points.push_back({fed, std::move(state)});
  c.store(b, std::move(points), key);
  return {r.token_ids, r.cached_tokens};
}

constexpr int64_t kMiB = int64_t{1} << 20;

/// Token lengths of the snapshots of one tier, most recently used first.
std::vector<size_t> lengths(const SessionCache& c, CacheTier tier) {
  std::vector<size_t> out;
  for (const auto& info : c.describe())
    if (info.tier == tier) out.push_back(info.tokens.size());
  return out;
}

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Closes `b`'s copy gate for its lifetime, so that background host copies wait there until
/// open(). A watchdog opens it after 20 s, so that a store that (wrongly) waited for a copy ends
/// the test with a failure (watchdog_opened()) instead of a hang.
class CopyGate {
 public:
  explicit CopyGate(FakeBackend& b) : b_(b) {
    b_.close_copy_gate();
    watchdog_ = std::thread([this] {
      std::unique_lock l(m_);
      if (!cv_.wait_for(l, 20s, [&] { return opened_; })) {
        watchdog_opened_ = true;
        b_.open_copy_gate();
      }
    });
  }
  ~CopyGate() {
    open();
    watchdog_.join();
  }
  void open() {
    {
      std::lock_guard l(m_);
      opened_ = true;
    }
    cv_.notify_all();
    b_.open_copy_gate();
  }
  bool watchdog_opened() const { return watchdog_opened_.load(); }

 private:
  FakeBackend& b_;
  std::mutex m_;
  std::condition_variable cv_;
  bool opened_ = false;
  std::atomic<bool> watchdog_opened_ = false;
  std::thread watchdog_;
};

/// A fake backend that copies to host memory in the background, with a cache started on it.
struct BackgroundCache {
  FakeBackend b;
  SessionCache c;
  explicit BackgroundCache(SessionCacheOptions o) : c(o) {
    b.concurrent_host_copies = true;
    c.start_background_host_copies(b);
  }
};

}  // namespace

TEST(StrictPrefix, OnlyShorterEqualBeginnings) {
  EXPECT_TRUE(is_strict_prefix(Tokens{1, 2}, Tokens{1, 2, 3}));
  EXPECT_FALSE(is_strict_prefix(Tokens{1, 2}, Tokens{1, 2}));
  EXPECT_FALSE(is_strict_prefix(Tokens{1, 9}, Tokens{1, 2, 3}));
  EXPECT_TRUE(is_strict_prefix(Tokens{}, Tokens{1}));
}

TEST(SessionCache, AHitIsResumedWithTheRoomAskedFor) {
  FakeBackend b;
  SessionCache c({kMiB, kMiB});
  store(c, b, {{1, 2, 3}});
  ASSERT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::nullopt, 40).cached_tokens, 3);
  ASSERT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::nullopt).cached_tokens, 3);
  EXPECT_EQ(b.resumes, 2);
  EXPECT_EQ(b.resume_capacities, (std::vector<int64_t>{40, 0}));
  // A miss resumes nothing.
  EXPECT_EQ(c.acquire(b, Tokens{5, 6}, std::nullopt, 40).state, nullptr);
  EXPECT_EQ(b.resumes, 2);
}

TEST(SessionCache, MissOnEmptyCacheAndHitOnLongestPrefix) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
  store(c, b, {{1, 2}});
  store(c, b, {{1, 2, 3, 4}});
  store(c, b, {{1, 7, 7}});
  auto hit = c.acquire(b, Tokens{1, 2, 3, 4, 5}, std::nullopt);
  ASSERT_NE(hit.state, nullptr);
  EXPECT_EQ(hit.cached_tokens, 4);
  EXPECT_EQ(static_cast<FakeState&>(*hit.state).history, (Tokens{1, 2, 3, 4}));
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 7, 7, 7}, std::nullopt).cached_tokens, 3);
  EXPECT_EQ(c.acquire(b, Tokens{1, 7}, std::nullopt).state, nullptr);
  auto st = c.stats();
  EXPECT_EQ(st.hits, 3);
  EXPECT_EQ(st.misses, 2);
  EXPECT_EQ(st.tokens_saved, 4 + 2 + 3);
  EXPECT_EQ(st.device.snapshots, 3);
  EXPECT_EQ(st.device.bytes, (1000 + 8) + (1000 + 16) + (1000 + 12));
}

TEST(SessionCache, EqualLengthIsNotAHit) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2, 3}});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
}

TEST(SessionCache, HitDoesNotConsumeTheEntry) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2}});
  auto first = c.acquire(b, Tokens{1, 2, 3}, std::nullopt);
  ASSERT_NE(first.state, nullptr);
  b.prefill(*first.state, Tokens{3});  // mutate the clone
  auto second = c.acquire(b, Tokens{1, 2, 4}, std::nullopt);
  ASSERT_NE(second.state, nullptr);
  EXPECT_EQ(static_cast<FakeState&>(*second.state).history, (Tokens{1, 2}));
}

TEST(SessionCache, KeyPrefersItsEntryOverALongerOneButNeverBypassesTokens) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2}}, "conv-a");
  store(c, b, {{1, 2, 3}}, "conv-b");
  store(c, b, {{9, 9}}, "conv-c");
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("conv-a")).cached_tokens, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::nullopt).cached_tokens, 3);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("other")).cached_tokens, 3);
  // conv-c's tokens do not match: the key does not force a hit.
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4}, std::string("conv-c")).cached_tokens, 3);
  EXPECT_EQ(c.acquire(b, Tokens{9, 8}, std::string("conv-c")).state, nullptr);
}

TEST(SessionCache, SameTokensReplaceTheSnapshotAndItsKey) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2}}, "a");
  store(c, b, {{1, 2}}, "b");
  const auto all = c.describe();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].key, std::optional<std::string>("b"));
  EXPECT_EQ(c.stats().device.bytes, 1008);
}

TEST(SessionCache, TreeSplitsEdgesAndMergesThemBackWhenSnapshotsGo) {
  FakeBackend b;
  // Room for three of the small states below; the fourth store evicts the least recent.
  SessionCache c({3 * 1020, 0});
  store(c, b, {{1, 2, 3, 4}});  // one edge
  store(c, b, {{1, 2, 5, 6}});  // splits it after {1, 2}
  store(c, b, {{1, 2}});        // a snapshot on the split node
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4, 9}, std::nullopt).cached_tokens, 4);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 5, 6, 9}, std::nullopt).cached_tokens, 4);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 7}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).cached_tokens, 2);  // ends inside an edge
  EXPECT_EQ(c.acquire(b, Tokens{1, 3}, std::nullopt).state, nullptr);
  // LRU now: {1,2} (last hit), {1,2,5,6}, {1,2,3,4}. A fourth snapshot evicts {1,2,3,4}.
  store(c, b, {{1, 2, 3, 7}});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4, 9}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 7, 9}, std::nullopt).cached_tokens, 4);
  EXPECT_EQ(c.stats().device.evictions, 1);
  // Two more stores evict {1,2,5,6} and then {1,2}: the nodes left without a snapshot are merged
  // away, and the tree must still route to what remains.
  store(c, b, {{8}});
  store(c, b, {{8, 8}});
  EXPECT_EQ(c.stats().device.evictions, 3);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 7, 9}, std::nullopt).cached_tokens, 4);
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 9}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.acquire(b, Tokens{8, 8, 8}, std::nullopt).cached_tokens, 2);
  std::vector<std::vector<int32_t>> held;
  for (const auto& info : c.describe()) held.push_back(info.tokens);
  EXPECT_EQ(held, (std::vector<std::vector<int32_t>>{{8, 8}, {1, 2, 3, 7}, {8}}));
}

TEST(SessionCache, ThousandsOfSnapshotsEachFoundByItsOwnTokens) {
  FakeBackend b;
  SessionCache c({int64_t{64} << 20, 0});
  const Tokens system(40, 7);
  constexpr int kConversations = 3000;
  for (int i = 0; i < kConversations; ++i)
    store(c, b, {concat(system, {i % 1000, i / 1000, 5})});
  store(c, b, {system});
  EXPECT_EQ(c.stats().device.snapshots, kConversations + 1);
  for (int i = 0; i < kConversations; i += 7) {
    const Tokens own = concat(system, {i % 1000, i / 1000, 5});
    auto hit = c.acquire(b, concat(own, {1}), std::nullopt);
    ASSERT_NE(hit.state, nullptr);
    ASSERT_EQ(static_cast<FakeState&>(*hit.state).history, own) << i;
  }
  // A new conversation with the shared system prompt resumes after it.
  EXPECT_EQ(c.acquire(b, concat(system, {999, 9, 9}), std::nullopt).cached_tokens, 40);
}

TEST(SessionCache, DeviceTierMovesLeastRecentlyUsedToHostAndHitsComeBackRunnable) {
  FakeBackend b;
  // FakeState bytes = 1000 + 4·tokens: two 2-token states fit a 2100-byte tier, three do not.
  SessionCache c({2100, 2100});
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  EXPECT_EQ(b.host_copies, 0);
  store(c, b, {{3, 3}});  // {1,1} moves to the host tier
  EXPECT_EQ(b.host_copies, 1);
  EXPECT_EQ(lengths(c, CacheTier::kDevice).size(), 2u);
  ASSERT_EQ(c.describe().back().tokens, (Tokens{1, 1}));
  EXPECT_EQ(c.describe().back().tier, CacheTier::kHost);
  auto hit = c.acquire(b, Tokens{1, 1, 5}, std::nullopt);  // from the host tier
  ASSERT_NE(hit.state, nullptr);
  EXPECT_EQ(b.host_restores, 1);
  EXPECT_EQ(b.prefill(*hit.state, Tokens{5}), b.next_token({1, 1, 5}));  // runnable
  auto st = c.stats();
  EXPECT_EQ(st.device.evictions, 1);
  EXPECT_EQ(st.host.evictions, 0);
  EXPECT_EQ(st.device.bytes, 2 * 1008);
  EXPECT_EQ(st.host.bytes, 1008);
  EXPECT_EQ(st.host.snapshots, 1);
}

TEST(SessionCache, StatsNeverWaitForBackendWorkUnderTheCacheLock) {
  FakeBackend b;
  SessionCache c({2100, 2100});  // host copies made in store(), under the cache's lock
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  CopyGate gate(b);
  std::thread engine([&] { store(c, b, {{3, 3}}); });  // {1,1} moves to the host tier
  const bool at_gate = b.wait_until_copy_at_gate(20s);
  const SessionCacheStats during = c.stats();  // the store waits at the gate meanwhile
  const bool waited = gate.watchdog_opened();
  gate.open();
  engine.join();
  ASSERT_TRUE(at_gate);
  EXPECT_FALSE(waited) << "stats() waited for a host copy made under the cache's lock";
  // The counters as the last finished store left them; the next read sees the move.
  EXPECT_EQ(during.device.snapshots, 2);
  EXPECT_EQ(during.host.snapshots, 0);
  EXPECT_EQ(during.device.evictions, 0);
  const SessionCacheStats after = c.stats();
  EXPECT_EQ(after.host.snapshots, 1);
  EXPECT_EQ(after.device.evictions, 1);
}

TEST(SessionCache, HostTierDropsLeastRecentlyUsedByBytes) {
  FakeBackend b;
  SessionCache c({1010, 2100});  // one 2-token state on the device, two on the host
  for (int32_t t : {1, 2, 3, 4}) store(c, b, {{t, t}});
  // Device: {4,4}; host: {3,3}, {2,2}; {1,1} dropped.
  EXPECT_EQ(c.acquire(b, Tokens{1, 1, 9}, std::nullopt).state, nullptr);
  for (int32_t t : {4, 3, 2}) EXPECT_EQ(c.acquire(b, Tokens{t, t, 9}, std::nullopt).cached_tokens, 2);
  auto st = c.stats();
  EXPECT_EQ(st.device.evictions, 3);
  EXPECT_EQ(st.host.evictions, 1);
  EXPECT_EQ(st.device.bytes, 1008);
  EXPECT_EQ(st.host.bytes, 2016);
  EXPECT_LE(st.host.bytes, st.host.budget);
  // The hit made {2,2} the host tier's most recent: the next drop is {3,3}.
  store(c, b, {{5, 5}});
  EXPECT_EQ(c.acquire(b, Tokens{3, 3, 9}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.acquire(b, Tokens{2, 2, 9}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(c.stats().host.evictions, 2);
}

TEST(SessionCache, WithoutHostTierDeviceEvictionsDrop) {
  FakeBackend b;
  SessionCache c({2100, 0});
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  ASSERT_NE(c.acquire(b, Tokens{1, 1, 5}, std::nullopt).state, nullptr);  // {1,1} is now newer
  store(c, b, {{3, 3}});                                                  // drops {2,2}
  EXPECT_EQ(c.acquire(b, Tokens{2, 2, 5}, std::nullopt).state, nullptr);
  EXPECT_NE(c.acquire(b, Tokens{1, 1, 5}, std::nullopt).state, nullptr);
  EXPECT_NE(c.acquire(b, Tokens{3, 3, 5}, std::nullopt).state, nullptr);
  EXPECT_EQ(b.host_copies, 0);
  EXPECT_EQ(c.stats().device.evictions, 1);
  EXPECT_EQ(c.stats().device.snapshots, 2);
  EXPECT_EQ(c.stats().host.snapshots, 0);
}

TEST(SessionCache, OversizedSnapshotsGoToTheHostTierOrAreRefused) {
  FakeBackend b;
  SessionCache c({1100, 2000});
  store(c, b, {Tokens(30, 4)});  // 1120 bytes: more than the device tier, fits the host tier
  EXPECT_EQ(lengths(c, CacheTier::kHost), std::vector<size_t>{30});
  EXPECT_EQ(c.acquire(b, Tokens(31, 4), std::nullopt).cached_tokens, 30);
  store(c, b, {Tokens(300, 4)});  // 2200 bytes: fits nowhere, not stored, nothing else lost
  EXPECT_EQ(c.acquire(b, Tokens(301, 4), std::nullopt).cached_tokens, 30);
  EXPECT_EQ(c.stats().device.evictions, 1);
  // Host only: a device budget of 0 sends every snapshot to host memory.
  SessionCache host_only({0, 5000});
  EXPECT_TRUE(host_only.enabled());
  store(host_only, b, {{1, 2}});
  EXPECT_EQ(lengths(host_only, CacheTier::kHost), std::vector<size_t>{2});
  EXPECT_EQ(host_only.acquire(b, Tokens{1, 2, 3}, std::nullopt).cached_tokens, 2);
}

TEST(SessionCache, DisabledCacheNeverHitsOrStores) {
  FakeBackend b;
  SessionCache c({0, 0});
  EXPECT_FALSE(c.enabled());
  store(c, b, {{1, 2}});
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.stats().device.snapshots, 0);
  EXPECT_EQ(c.stats().host.snapshots, 0);
}

TEST(SessionCache, NegativeBudgetsAreRefused) {
  EXPECT_THROW(SessionCache({-1, 0}), OptionError);
  EXPECT_THROW(SessionCache({0, -1}), OptionError);
}

TEST(SessionCache, InconsistentPointsAreDropped) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  std::vector<ResumePoint> points;
  points.push_back(point(b, {1, 2, 3}));
  points[0].tokens = {1, 2};  // state position 3 ≠ 2 tokens
  c.store(b, std::move(points), std::nullopt);
  EXPECT_EQ(c.stats().device.snapshots, 0);
}

TEST(SessionCacheBackground, OnlyABackendThatAllowsItCopiesInTheBackground) {
  FakeBackend plain;  // copies_to_host_concurrently() false
  SessionCache c({2100, 2100});
  EXPECT_THROW(c.start_background_host_copies(plain), Error);
  plain.concurrent_host_copies = true;
  c.start_background_host_copies(plain);
  EXPECT_THROW(c.start_background_host_copies(plain), Error);  // once only
  EXPECT_THROW(SessionCache({1, 1, -1}), Error);
}

TEST(SessionCacheBackground, AMoveNeverWaitsForItsCopyAndTheSnapshotResumesMeanwhile) {
  BackgroundCache bc({2100, 2100});
  auto& [b, c] = bc;
  CopyGate gate(b);
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});
  store(c, b, {{3, 3}});  // {1,1} moves to the host tier; its copy waits at the gate
  ASSERT_TRUE(b.wait_until_copy_at_gate(5s));
  // The store returned meanwhile; the snapshot counts in the host tier already.
  const SnapshotInfo moving = c.describe().back();
  EXPECT_EQ(moving.tokens, (Tokens{1, 1}));
  EXPECT_EQ(moving.tier, CacheTier::kHost);
  EXPECT_TRUE(moving.copying);
  auto st = c.stats();
  EXPECT_EQ(st.device.bytes, 2 * 1008);
  EXPECT_EQ(st.device.evictions, 1);
  EXPECT_EQ(st.host.bytes, 1008);
  EXPECT_EQ(st.host.snapshots, 1);
  EXPECT_EQ(st.host_copies_pending, 1);
  // A lookup resumes from the snapshot's own state meanwhile: the same history, runnable.
  auto early = c.acquire(b, Tokens{1, 1, 5}, std::nullopt);
  ASSERT_NE(early.state, nullptr);
  EXPECT_EQ(b.host_restores, 0);
  EXPECT_EQ(b.prefill(*early.state, Tokens{5}), b.next_token({1, 1, 5}));
  store(c, b, {{4, 4}});  // more stores go on: {2,2} queues behind the waiting copy
  EXPECT_EQ(c.stats().host_copies_pending, 2);
  EXPECT_EQ(b.host_copies.load(), 0);
  gate.open();
  c.wait_for_host_copies();
  EXPECT_FALSE(gate.watchdog_opened()) << "a store waited for a host copy";
  EXPECT_EQ(b.host_copies.load(), 2);
  for (const SnapshotInfo& info : c.describe()) EXPECT_FALSE(info.copying);
  EXPECT_EQ(lengths(c, CacheTier::kHost).size(), 2u);
  // Once copied, a hit restores the host copy, with the same answer.
  auto late = c.acquire(b, Tokens{1, 1, 5}, std::nullopt);
  ASSERT_NE(late.state, nullptr);
  EXPECT_EQ(b.host_restores, 1);
  EXPECT_EQ(b.prefill(*late.state, Tokens{5}), b.next_token({1, 1, 5}));
  st = c.stats();
  EXPECT_EQ(st.host.bytes, 2 * 1008);
  EXPECT_EQ(st.host_copies_pending, 0);
}

TEST(SessionCacheBackground, HostOnlySnapshotsGiveTheSameAnswersBeforeAndAfterTheirCopy) {
  FakeBackend plain;
  SessionCache none({0, 0});
  const Tokens prompt = {5, 6, 7, 8, 9};
  const Tokens expected = request(none, plain, prompt, 6).tokens;
  BackgroundCache bc({0, kMiB});  // every snapshot goes to the host tier
  auto& [b, c] = bc;
  {
    CopyGate gate(b);
    EXPECT_EQ(request(c, b, prompt, 6).tokens, expected);
    ASSERT_TRUE(b.wait_until_copy_at_gate(5s));
    const Outcome pending = request(c, b, prompt, 6);  // resumes from a snapshot still copying
    EXPECT_EQ(pending.cached, 4);
    EXPECT_EQ(pending.tokens, expected);
    EXPECT_EQ(b.host_restores, 0);
    gate.open();
    c.wait_for_host_copies();
    EXPECT_FALSE(gate.watchdog_opened());
  }
  const Outcome copied = request(c, b, prompt, 6);
  EXPECT_EQ(copied.cached, 4);
  EXPECT_EQ(copied.tokens, expected);
  EXPECT_EQ(b.host_restores, 1);
  EXPECT_EQ(c.stats().device.snapshots, 0);
}

TEST(SessionCacheBackground, EvictionByBytesCountsCopiesInFlightAndCancelsThem) {
  BackgroundCache bc({1010, 2100});  // one 2-token state on the device, two on the host
  auto& [b, c] = bc;
  CopyGate gate(b);
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});  // {1,1} moves: its copy starts and waits at the gate
  ASSERT_TRUE(b.wait_until_copy_at_gate(5s));
  store(c, b, {{3, 3}});  // {2,2} moves (queued)
  store(c, b, {{4, 4}});  // {3,3} moves (queued); the host tier holds 3 × 1008 > 2100: {1,1} is dropped
  auto st = c.stats();
  EXPECT_EQ(st.device.evictions, 3);
  EXPECT_EQ(st.host.evictions, 1);
  EXPECT_EQ(st.host.bytes, 2 * 1008);
  EXPECT_EQ(st.host_copies_pending, 2);
  store(c, b, {{5, 5}});  // {4,4} moves; {2,2} is dropped before its copy started
  st = c.stats();
  EXPECT_EQ(st.host.evictions, 2);
  EXPECT_EQ(st.host.bytes, 2 * 1008);
  EXPECT_LE(st.host.bytes, st.host.budget);
  EXPECT_LE(st.device.bytes, st.device.budget);
  gate.open();
  c.wait_for_host_copies();
  // {1,1}'s copy was made (it had started) and thrown away; {2,2}'s was never made.
  EXPECT_EQ(b.host_copies.load(), 3);
  for (int32_t gone : {1, 2}) EXPECT_EQ(c.acquire(b, Tokens{gone, gone, 9}, std::nullopt).state, nullptr);
  for (int32_t kept : {5, 4, 3}) EXPECT_EQ(c.acquire(b, Tokens{kept, kept, 9}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(b.host_restores, 2);
  st = c.stats();
  EXPECT_EQ(st.host.snapshots, 2);
  EXPECT_EQ(st.host.bytes, 2 * 1008);
  EXPECT_EQ(st.host_copies_pending, 0);
}

TEST(SessionCacheBackground, AFullBacklogDropsTheSnapshotInsteadOfWaiting) {
  BackgroundCache bc({1010, 10000, 1500});  // room for one 1008-byte copy in flight
  auto& [b, c] = bc;
  CopyGate gate(b);
  store(c, b, {{1, 1}});
  store(c, b, {{2, 2}});  // {1,1} moves
  ASSERT_TRUE(b.wait_until_copy_at_gate(5s));
  store(c, b, {{3, 3}});  // {2,2} would exceed the backlog: dropped
  auto st = c.stats();
  EXPECT_EQ(st.device.evictions, 2);
  EXPECT_EQ(st.host.snapshots, 1);
  EXPECT_EQ(st.host_copies_pending, 1);
  gate.open();
  c.wait_for_host_copies();
  EXPECT_EQ(c.acquire(b, Tokens{2, 2, 9}, std::nullopt).state, nullptr);
  EXPECT_EQ(c.acquire(b, Tokens{1, 1, 9}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(b.host_restores, 1);
}

TEST(SessionCacheBackground, AFailedCopyDropsTheSnapshotAndAReplacedOneIsNotInstalled) {
  BackgroundCache bc({2100, 2100});
  auto& [b, c] = bc;
  b.fail_host_copies = true;
  for (int32_t t : {1, 2, 3}) store(c, b, {{t, t}});  // {1,1} moves; its copy fails
  c.wait_for_host_copies();
  EXPECT_EQ(c.acquire(b, Tokens{1, 1, 9}, std::nullopt).state, nullptr);
  auto st = c.stats();
  EXPECT_EQ(st.host.snapshots, 0);
  EXPECT_EQ(st.host.bytes, 0);
  EXPECT_EQ(st.host_copies_pending, 0);
  // Stored again while its copy runs, the same tokens replace the moving snapshot: the copy,
  // once made, is thrown away and the new snapshot stays where it went.
  b.fail_host_copies = false;
  CopyGate gate(b);
  store(c, b, {{4, 4}});  // {2,2} moves
  ASSERT_TRUE(b.wait_until_copy_at_gate(5s));
  store(c, b, {{2, 2}});  // replaces it in the device tier; {3,3} moves (queued)
  gate.open();
  c.wait_for_host_copies();
  EXPECT_EQ(b.host_copies.load(), 3);
  st = c.stats();
  EXPECT_EQ(st.device.snapshots, 2);
  EXPECT_EQ(st.host.snapshots, 1);
  EXPECT_EQ(st.host.bytes, 1008);
  EXPECT_EQ(lengths(c, CacheTier::kHost), std::vector<size_t>{2});
  EXPECT_EQ(c.describe().back().tokens, (Tokens{3, 3}));
  EXPECT_EQ(c.acquire(b, Tokens{2, 2, 9}, std::nullopt).cached_tokens, 2);
  EXPECT_EQ(b.host_restores, 0);  // {2,2} came from the device tier
}

TEST(SessionCacheBudgets, DefaultsAndLimits) {
  FakeBackend b;  // reports no free memory of its own, as the CPU backend
  const int64_t avail = 8 * kMiB, total = 16 * kMiB;
  auto o = resolve_cache_budgets(b, std::nullopt, std::nullopt, avail, total);
  EXPECT_EQ(o.device_bytes, 2 * kMiB);
  EXPECT_EQ(o.host_bytes, 0);
  o = resolve_cache_budgets(b, 3 * kMiB, 5 * kMiB, avail, total);
  EXPECT_EQ(o.device_bytes, 3 * kMiB);
  EXPECT_EQ(o.host_bytes, 5 * kMiB);
  try {
    resolve_cache_budgets(b, std::nullopt, 17 * kMiB, avail, total);
    ADD_FAILURE() << "no error";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.field(), "host_bytes");
    EXPECT_EQ(std::string(e.what()), "host_bytes 17.0 MiB is more than this machine's memory (16.0 MiB)");
  }
  EXPECT_THROW(resolve_cache_budgets(b, 17 * kMiB, std::nullopt, avail, total), OptionError);
  EXPECT_THROW(resolve_cache_budgets(b, -1, std::nullopt, avail, total), OptionError);
}

TEST(SessionCacheBudgets, DeviceDefaultLeavesRoomForTheRunningBatchAndAMargin) {
  const int64_t kGiB = int64_t{1} << 30;
  FakeBackend b;
  b.device_free = 100 * kGiB;  // a backend with memory of its own, as CUDA
  const int64_t avail = 64 * kGiB, total = 128 * kGiB;
  // 8 states of 1,000 tokens: 8 · (1000 + 4 · 1000) bytes; margin 5 % of free (above 1 GiB).
  auto o = resolve_cache_budgets(b, std::nullopt, std::nullopt, avail, total, RunningBatch{8, 1000});
  EXPECT_EQ(o.device_bytes, 100 * kGiB - 8 * 5000 - 5 * kGiB);
  EXPECT_EQ(o.host_bytes, 16 * kGiB);
  // The margin is at least kDeviceBudgetMinMargin; a batch that needs everything leaves 0.
  EXPECT_EQ(default_device_budget(4 * kGiB, kGiB), 2 * kGiB);
  EXPECT_EQ(default_device_budget(4 * kGiB, 4 * kGiB), 0);
  // A given budget is taken as it is, up to the free memory.
  o = resolve_cache_budgets(b, 50 * kGiB, std::nullopt, avail, total, RunningBatch{8, 1000});
  EXPECT_EQ(o.device_bytes, 50 * kGiB);
  EXPECT_THROW(resolve_cache_budgets(b, 101 * kGiB, std::nullopt, avail, total), OptionError);
}

TEST(SessionCacheFlow, IdenticalRetryHitsAndGivesTheSameOutput) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  const Tokens prompt{5, 6, 7, 8, 9};
  auto first = request(c, b, prompt, 6);
  auto retry = request(c, b, prompt, 6);
  EXPECT_EQ(first.cached, 0);
  EXPECT_EQ(retry.cached, 4);  // resumes one token before the end of the prompt
  EXPECT_EQ(first.tokens, retry.tokens);
  // The retry replaced the first request's resume points instead of piling up copies.
  EXPECT_EQ(c.stats().device.snapshots, 2);
}

TEST(SessionCacheFlow, NextTurnHitsTheFinalState) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  const Tokens turn1{5, 6, 7};
  auto a = request(c, b, turn1, 4);
  const Tokens turn2 = concat(concat(turn1, a.tokens), {42, 43});
  auto r = request(c, b, turn2, 4);
  EXPECT_EQ(r.cached, static_cast<int64_t>(turn1.size() + a.tokens.size() - 1));
}

TEST(SessionCacheFlow, TwoBranchesOfOneConversationBothHit) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  const Tokens turn1{5, 6, 7};
  auto a = request(c, b, turn1, 4);
  const int64_t reuse = static_cast<int64_t>(turn1.size() + a.tokens.size() - 1);
  auto branch1 = request(c, b, concat(concat(turn1, a.tokens), {100}), 3);
  auto branch2 = request(c, b, concat(concat(turn1, a.tokens), {200}), 3);
  EXPECT_EQ(branch1.cached, reuse);
  // Branch 1's prompt snapshot (turn 1 + answer, without its new user token) is even longer.
  EXPECT_GE(branch2.cached, reuse);
  // And the first turn's entry still serves a third branch.
  auto branch3 = request(c, b, concat(concat(turn1, a.tokens), {300}), 3);
  EXPECT_GE(branch3.cached, reuse);
}

TEST(SessionCacheFlow, SharedSystemPromptResumesAtItsMessageBoundary) {
  FakeBackend b;
  SessionCache c({kMiB, 0});
  const Tokens system(300, 3);
  const Tokens q1 = concat(system, {10, 11, 12}), q2 = concat(system, {20, 21}), q3 = concat(system, {30, 31, 32});
  const int64_t boundary = static_cast<int64_t>(system.size());
  auto a = request(c, b, q1, 3, std::nullopt, {boundary});
  b.prefill_sizes.clear();
  auto r2 = request(c, b, q2, 3, std::nullopt, {boundary});
  auto r3 = request(c, b, q3, 3, std::nullopt, {boundary});
  EXPECT_EQ(a.cached, 0);
  EXPECT_EQ(r2.cached, boundary);
  EXPECT_EQ(r3.cached, boundary);
  // Only the new messages were prefilled.
  EXPECT_EQ(b.prefill_sizes, (std::vector<int64_t>{1, 1, 2, 1}));
  // Identical to a run without cache, where the prefill is split at the same boundary.
  FakeBackend cold_backend;
  SessionCache cold({0, 0});
  EXPECT_EQ(request(cold, cold_backend, q2, 3, std::nullopt, {boundary}).tokens, r2.tokens);
  EXPECT_EQ(cold_backend.prefill_sizes, (std::vector<int64_t>{300, 1, 1}));
}

TEST(SessionCacheFlow, OutputsAreIdenticalWithAndWithoutCache) {
  FakeBackend warm_backend, cold_backend;
  SessionCache warm({kMiB, 0}), cold({0, 0});
  Tokens convo{1, 2, 3};
  std::vector<int64_t> starts;
  for (int turn = 0; turn < 4; ++turn) {
    auto w = request(warm, warm_backend, convo, 5, std::nullopt, starts);
    auto k = request(cold, cold_backend, convo, 5, std::nullopt, starts);
    EXPECT_EQ(w.tokens, k.tokens) << "turn " << turn;
    EXPECT_EQ(k.cached, 0);
    if (turn > 0) {
      EXPECT_GT(w.cached, 0) << "turn " << turn;
    }
    starts.push_back(static_cast<int64_t>(convo.size()));
    convo = concat(concat(convo, w.tokens), {static_cast<int32_t>(50 + turn)});
  }
  // A hit followed by exactly one new token.
  auto w = request(warm, warm_backend, convo, 1);
  auto k = request(cold, cold_backend, convo, 1);
  EXPECT_EQ(w.tokens, k.tokens);
  EXPECT_EQ(w.tokens.size(), 1u);
  EXPECT_GT(w.cached, 0);
}

// ---- KV rows shared between a snapshot and the longer ones after it ------------------------------

TEST(SessionCacheSharing, ALongerSnapshotHoldsOnlyItsOwnRowsAndAHitGetsAWholeState) {
  FakeBackend b;
  b.share_kv = true;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2, 3}});
  store(c, b, {{1, 2, 3, 4, 5}});  // shares {1,2,3}: counts 1000 + 4·2 bytes, not 1000 + 4·5
  store(c, b, {{9, 9}});           // nothing shorter on its path: whole
  store(c, b, {{1, 2, 3, 4, 5, 6, 7}});  // shares the nearest shorter one, {1,2,3,4,5}
  auto base_of = [&](const Tokens& t) {
    for (const auto& info : c.describe())
      if (info.tokens == t) return info.kv_base_tokens;
    ADD_FAILURE() << "not cached";
    return int64_t{-1};
  };
  EXPECT_EQ(base_of({1, 2, 3}), 0);
  EXPECT_EQ(base_of({1, 2, 3, 4, 5}), 3);
  EXPECT_EQ(base_of({9, 9}), 0);
  EXPECT_EQ(base_of({1, 2, 3, 4, 5, 6, 7}), 5);
  const SessionCacheStats st = c.stats();
  EXPECT_EQ(st.kv_shared_snapshots, 2);
  EXPECT_EQ(st.device.bytes, 1012 + 1008 + 1008 + 1008);
  // A hit resumes a whole, runnable state with the same continuation as a fresh prefill.
  auto hit = c.acquire(b, Tokens{1, 2, 3, 4, 5, 6, 7, 8}, std::nullopt);
  ASSERT_NE(hit.state, nullptr);
  EXPECT_EQ(hit.cached_tokens, 7);
  EXPECT_EQ(static_cast<const FakeState&>(*hit.state).base, nullptr);
  EXPECT_EQ(b.prefill(*hit.state, Tokens{8}), b.next_token({1, 2, 3, 4, 5, 6, 7, 8}));
  // A backend that does not share (the default) stores whole snapshots.
  FakeBackend plain;
  SessionCache whole({kMiB, 0});
  store(whole, plain, {{1, 2, 3}, {1, 2, 3, 4, 5}});
  EXPECT_EQ(whole.stats().device.bytes, 1012 + 1020);
  EXPECT_EQ(whole.stats().kv_shared_snapshots, 0);
}

TEST(SessionCacheSharing, ASharedSnapshotNeverLeavesTheDeviceTierBeforeThoseSharingIt) {
  FakeBackend b;
  b.share_kv = true;
  SessionCache c({3100, kMiB});  // three snapshots of about 1010 bytes
  store(c, b, {{1, 2, 3}});
  store(c, b, {{1, 2, 3, 4, 5}});  // shares {1,2,3}, which becomes the more recently used
  store(c, b, {{7, 7, 7}});
  EXPECT_EQ(lengths(c, CacheTier::kDevice), (std::vector<size_t>{3, 3, 5}));
  // A hit on the longer one makes its base more recent still: {1,2,3} before {1,2,3,4,5}.
  ASSERT_EQ(c.acquire(b, Tokens{1, 2, 3, 4, 5, 6}, std::nullopt).cached_tokens, 5);
  ASSERT_EQ(c.describe().front().tokens, (Tokens{1, 2, 3}));
  store(c, b, {{8, 8, 8}});  // {7,7,7} is the least recently used: it moves
  store(c, b, {{6, 6, 6}});  // then {1,2,3,4,5}, never its base first
  std::vector<Tokens> host;
  for (const auto& info : c.describe())
    if (info.tier == CacheTier::kHost) {
      host.push_back(info.tokens);
      EXPECT_EQ(info.kv_base_tokens, 0);  // a host copy holds all its rows
    }
  EXPECT_EQ(host, (std::vector<Tokens>{{1, 2, 3, 4, 5}, {7, 7, 7}}));
  EXPECT_EQ(c.stats().host.bytes, 1020 + 1012);  // whole copies
  EXPECT_LE(c.stats().device.bytes, 3100);
  auto hit = c.acquire(b, Tokens{1, 2, 3, 4, 5, 6}, std::nullopt);
  ASSERT_EQ(hit.cached_tokens, 5);
  EXPECT_EQ(b.prefill(*hit.state, Tokens{6}), b.next_token({1, 2, 3, 4, 5, 6}));
}

TEST(SessionCacheSharing, StoringTheTokensOfASharedSnapshotAgainKeepsItUnderTheNewKey) {
  FakeBackend b;
  b.share_kv = true;
  SessionCache c({kMiB, 0});
  store(c, b, {{1, 2, 3}}, "a");
  store(c, b, {{1, 2, 3, 4}}, "a");
  const int64_t bytes = c.stats().device.bytes;
  store(c, b, {{1, 2, 3}}, "b");
  EXPECT_EQ(c.stats().device.snapshots, 2);
  EXPECT_EQ(c.stats().device.bytes, bytes);
  for (const auto& info : c.describe()) {
    if (info.tokens == Tokens{1, 2, 3}) {
      EXPECT_EQ(info.key, "b");
    }
    if (info.tokens == Tokens{1, 2, 3, 4}) {
      EXPECT_EQ(info.kv_base_tokens, 3);
    }
  }
  // The key prefers it now.
  store(c, b, {{1, 2, 3, 4, 5}}, "c");
  EXPECT_EQ(c.acquire(b, Tokens{1, 2, 3, 4, 5, 6}, "b").cached_tokens, 3);
}

TEST(SessionCacheSharing, ConversationsAnswerAsWithoutCacheAndHoldFewerBytes) {
  FakeBackend shared_backend, whole_backend, cold_backend;
  shared_backend.share_kv = true;
  SessionCache shared({kMiB, 0}), whole({kMiB, 0}), cold({0, 0});
  const Tokens system(200, 3);
  for (int32_t conv = 0; conv < 3; ++conv) {
    Tokens convo = concat(system, {static_cast<int32_t>(10 + conv)});
    std::vector<int64_t> starts = {static_cast<int64_t>(system.size())};
    for (int turn = 0; turn < 3; ++turn) {
      SCOPED_TRACE("conversation " + std::to_string(conv) + " turn " + std::to_string(turn));
      auto s = request(shared, shared_backend, convo, 4, std::nullopt, starts);
      auto w = request(whole, whole_backend, convo, 4, std::nullopt, starts);
      auto k = request(cold, cold_backend, convo, 4, std::nullopt, starts);
      EXPECT_EQ(s.tokens, k.tokens);
      EXPECT_EQ(w.tokens, k.tokens);
      EXPECT_EQ(s.cached, w.cached);
      if (conv > 0 || turn > 0) {
        EXPECT_GE(s.cached, static_cast<int64_t>(system.size()));
      }
      starts.push_back(static_cast<int64_t>(convo.size()));
      convo = concat(concat(convo, s.tokens), {static_cast<int32_t>(50 + turn)});
    }
  }
  const SessionCacheStats sh = shared.stats(), wh = whole.stats();
  EXPECT_EQ(sh.device.snapshots, wh.device.snapshots);
  EXPECT_GT(sh.kv_shared_snapshots, 0);
  // Every snapshot but the system prompt's would otherwise hold its 200 tokens again.
  EXPECT_LT(sh.device.bytes + 4 * 200 * (sh.device.snapshots - 2), wh.device.bytes);
}
