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
          const int base = t.next_call_block(0, 1, sending, user_tag, "test");
          bases.insert(base);
          const auto [first, last] = block_range(t, base);
          CHECK(first >= td::kMaxUserTag);  // above transport's tags
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
      CHECK(a.next_call_block(0, 1, true, 77, "test") ==
            b.next_call_block(1, 0, false, 77, "test"));
  }
}

TEST_CASE("transport tags are the user tags, below every point-to-point block", "[runtime][tags]") {
  TagSpace t(2147483647LL);
  for (const int user_tag : {0, 1023, 1024, td::kMaxUserTag - 1})
    CHECK(t.transport(user_tag) == user_tag);
  CHECK(t.next_call_block(0, 1, true, 0, "test") >= td::kMaxUserTag);
}

TEST_CASE("an MPI_TAG_UB too small for point to point is an error naming it", "[runtime][tags]") {
  TagSpace t(32767);  // the least the MPI standard allows
  CHECK(t.transport(td::kMaxUserTag - 1) == td::kMaxUserTag - 1);
  CHECK_THROWS_WITH(t.next_call_block(0, 1, true, 0, "TensorDict.send"),
                    Catch::Contains("TensorDict.send") && Catch::Contains("MPI_TAG_UB (32767)"));
}
