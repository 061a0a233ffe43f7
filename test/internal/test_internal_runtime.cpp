// White-box tests of the runtime's parts that the library does not export: the tag space of a
// group (runtime/tags.hpp). Linked with the library's objects, without MPI_Init: nothing here
// calls MPI.
#include <catch2/catch.hpp>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "runtime/tags.hpp"
#include "tensordict/collectives.hpp"

using td::detail::TagSpace;

namespace {

// Every tag a point-to-point block starting at `base` can use.
std::pair<long long, long long> block_range(const TagSpace& t, int base) {
  return {base, static_cast<long long>(base) + t.tags_per_call() - 1};
}

}  // namespace

TEST_CASE("point-to-point blocks of different tags, calls and directions never overlap",
          "[runtime][tags]") {
  for (const long long tag_ub : {2147483647LL, 1LL << 28, (1LL << 23) + 12345}) {
    INFO("MPI_TAG_UB " << tag_ub);
    TagSpace t(tag_ub);
    REQUIRE(t.calls_per_tag() > 0);
    REQUIRE(t.tags_per_call() > TagSpace::kFirstDataTag);
    // Ranks 0 and 1: rank 0 sends (direction 1) and receives (direction 0), every boundary tag,
    // through more calls than there are blocks per tag.
    std::set<std::pair<long long, long long>> seen;  // ranges, by first tag
    for (const int user_tag : {0, 1, 1023, 1024, td::kMaxUserTag - 2, td::kMaxUserTag - 1}) {
      for (const bool sending : {true, false}) {
        std::set<int> bases;
        for (int n = 0; n < 3 * t.calls_per_tag(); ++n) {
          const int base = t.next_call_block(0, 1, sending, user_tag, "test").base;
          bases.insert(base);
          const auto [first, last] = block_range(t, base);
          CHECK(first >= 2 * td::kMaxUserTag);  // above transport's tags
          CHECK(last <= tag_ub);
          CHECK(t.data_tag(base, 0) == base + TagSpace::kFirstDataTag);
          CHECK(t.data_tag(base, 1u << 20) <= last);
        }
        // Blocks repeat every calls_per_tag() calls, and only then.
        CHECK(bases.size() == static_cast<std::size_t>(t.calls_per_tag()));
        for (int base : bases) seen.insert(block_range(t, base));
      }
    }
    // No two blocks of the set share a tag.
    long long previous_last = -1;
    for (const auto& [first, last] : seen) {
      CHECK(first > previous_last);
      previous_last = last;
    }
    // The other side of a transfer computes the same block: rank 1's n-th receive from rank 0
    // with a tag meets rank 0's n-th send to rank 1 with it.
    TagSpace a(tag_ub), b(tag_ub);
    for (int n = 0; n < 5; ++n)
      CHECK(a.next_call_block(0, 1, true, 77, "test").base ==
            b.next_call_block(1, 0, false, 77, "test").base);
  }
}

// The defect this guards against: a 65th call in flight took the block of the first, still in
// flight, so MPI could pair either call's messages with the other's (a receiver that tested its
// later call first got the earlier call's data, with every count matching).
TEST_CASE("a point-to-point call whose block is still taken is refused, and takes nothing",
          "[runtime][tags]") {
  TagSpace t(2147483647LL);
  const int calls = t.calls_per_tag();
  std::vector<TagSpace::CallBlock> in_flight;
  for (int n = 0; n < calls; ++n) in_flight.push_back(t.next_call_block(0, 1, true, 5, "test"));
  CHECK_THROWS_WITH(t.next_call_block(0, 1, true, 5, "TensorDict.send"),
                    Catch::Contains("TensorDict.send") &&
                        Catch::Contains("64 point-to-point calls to rank 1 with tag 5") &&
                        Catch::Contains("call 1, has not completed") &&
                        Catch::Contains("nothing was sent"));
  // Other tags, the other direction and other peers have blocks of their own.
  CHECK_NOTHROW(t.next_call_block(0, 1, true, 6, "test"));
  CHECK_NOTHROW(t.next_call_block(0, 1, false, 5, "test"));
  CHECK_NOTHROW(t.next_call_block(0, 2, true, 5, "test"));
  // A later call completing frees only its own block: the next call still needs block 0.
  in_flight[1] = {};
  CHECK_THROWS(t.next_call_block(0, 1, true, 5, "test"));
  // Once the first call is done, the refused call gets its block, as the peer's does.
  const int first_base = in_flight[0].base;
  in_flight[0] = {};
  TagSpace peer(2147483647LL);
  for (int n = 0; n < calls; ++n) CHECK_NOTHROW(peer.next_call_block(1, 0, false, 5, "test"));
  const TagSpace::CallBlock again = t.next_call_block(0, 1, true, 5, "test");
  CHECK(again.base == first_base);
  CHECK(peer.next_call_block(1, 0, false, 5, "test").base == again.base);
}

// The defect this guards against: transport used the user tag in both directions, so a
// send_dict from A to B and one from B to A at once (one on a thread of each rank's own) could
// take each other's messages: a verdict of 512 bytes matched a 512-byte data message.
TEST_CASE("transport tags: one per user tag and direction, below every point-to-point block",
          "[runtime][tags]") {
  TagSpace t(2147483647LL);
  std::set<int> seen;
  for (const int user_tag : {0, 1023, 1024, td::kMaxUserTag - 1}) {
    // Both sides of one transfer compute the same tag...
    const int up = TagSpace::transport(0, 1, true, user_tag);
    CHECK(TagSpace::transport(1, 0, false, user_tag) == up);
    const int down = TagSpace::transport(1, 0, true, user_tag);
    CHECK(TagSpace::transport(0, 1, false, user_tag) == down);
    // ...and the two directions different ones.
    CHECK(up != down);
    CHECK(seen.insert(up).second);
    CHECK(seen.insert(down).second);
    CHECK(up >= 0);
    CHECK(down < 2 * td::kMaxUserTag);
  }
  CHECK(t.next_call_block(0, 1, true, 0, "test").base >= 2 * td::kMaxUserTag);
}

TEST_CASE("an MPI_TAG_UB too small for point to point is an error naming it", "[runtime][tags]") {
  TagSpace t(32767);  // the least the MPI standard allows
  CHECK(TagSpace::transport(0, 1, true, td::kMaxUserTag - 1) <= 32767);
  CHECK_THROWS_WITH(t.next_call_block(0, 1, true, 0, "TensorDict.send"),
                    Catch::Contains("TensorDict.send") && Catch::Contains("MPI_TAG_UB (32767)"));
}
