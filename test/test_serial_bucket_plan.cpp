// BucketPlan invariants (no MPI).
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <random>

#include <tensordict/bucket_bytes.hpp>
#include <tensordict/diagnostics.hpp>

using td::BucketPlan;
using td::DType;
using td::LeafLayout;

namespace {
LeafLayout leaf(DType d, std::int64_t n, bool contiguous = true) {
  LeafLayout l;
  l.dtype = d;
  l.shape = {n};
  l.contiguous = contiguous;
  return l;
}
LeafLayout sparse_leaf(DType d, std::int64_t n) {
  LeafLayout l = leaf(d, n, false);
  l.sparse = true;
  return l;
}
LeafLayout alias_leaf(DType d, std::int64_t n, std::int64_t of) {
  LeafLayout l = leaf(d, n);
  l.alias_of = of;
  return l;
}

// 0-60 random leaves of the first `dtypes` dtypes, 0-300 elements, some strided, sparse or
// aliased: the property tests' layouts.
std::vector<LeafLayout> random_leaves(std::mt19937& rng, std::size_t dtypes) {
  std::vector<LeafLayout> leaves;
  const int n = std::uniform_int_distribution<int>(0, 60)(rng);
  for (int i = 0; i < n; ++i) {
    LeafLayout l = leaf(static_cast<DType>(rng() % dtypes),
                        std::uniform_int_distribution<int>(0, 300)(rng), rng() % 8 != 0);
    if (rng() % 16 == 0) {
      l.sparse = true;
      l.contiguous = false;
    }
    if (i > 0 && rng() % 16 == 0)
      l.alias_of = static_cast<std::int64_t>(rng() % static_cast<unsigned>(i));
    leaves.push_back(l);
  }
  return leaves;
}

// Leaf indices of each bucket, in slot order.
std::vector<std::vector<std::size_t>> groups(const BucketPlan& plan) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& b : plan.buckets) {
    out.emplace_back();
    for (const auto& s : b.slots) out.back().push_back(s.leaf);
  }
  return out;
}
}  // namespace

TEST_CASE("no cap: one bucket per leaf", "[plan]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4), leaf(DType::Float32, 4)};
  auto plan = BucketPlan::build(leaves, std::nullopt);
  CHECK(plan.buckets.size() == 2);
  CHECK(plan.check(leaves).empty());
}

TEST_CASE("strict cap: same-dtype leaves packed, never over the cap", "[plan]") {
  // 10 float32 leaves of 16 B; cap 40 B -> 2 leaves a bucket
  std::vector<LeafLayout> leaves(10, leaf(DType::Float32, 4));
  auto plan = BucketPlan::build(leaves, 40);
  CHECK(plan.buckets.size() == 5);
  for (const auto& b : plan.buckets) CHECK(b.nbytes <= 40);
  CHECK(plan.check(leaves).empty());
}

TEST_CASE("a leaf over the cap is a bucket of its own", "[plan]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4), leaf(DType::Float32, 1000),
                                 leaf(DType::Float32, 4)};
  auto plan = BucketPlan::build(leaves, 64);
  REQUIRE(plan.buckets.size() == 2);
  CHECK(plan.buckets[0].slots.size() == 2);  // leaves 0 and 2 share a bucket
  CHECK(plan.buckets[1].slots.size() == 1);
  CHECK(plan.buckets[1].nbytes == 4000);
  CHECK(plan.check(leaves).empty());
}

TEST_CASE("dtypes never mix; non-contiguous, sparse, aliased and empty leaves are not packed",
          "[plan]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4),        leaf(DType::Int64, 2),
                                 leaf(DType::Float32, 4, false), leaf(DType::Float32, 4),
                                 leaf(DType::Float32, 0),        leaf(DType::Int64, 2)};
  leaves.push_back(sparse_leaf(DType::Float32, 8));
  leaves.push_back(alias_leaf(DType::Float32, 4, 0));
  auto plan = BucketPlan::build(leaves, 1 << 20);
  CHECK(plan.check(leaves).empty());
  REQUIRE(plan.buckets.size() == 3);
  CHECK(plan.buckets[0].dtype == DType::Float32);
  CHECK(plan.buckets[0].slots.size() == 2);  // leaves 0 and 3
  CHECK(plan.buckets[1].dtype == DType::Int64);
  CHECK(plan.buckets[1].slots.size() == 2);  // leaves 1 and 5
  CHECK(plan.buckets[2].strided);
  CHECK(plan.sparse_leaves == std::vector<std::size_t>{6});
  CHECK(plan.skipped_leaves == std::vector<std::size_t>{4, 7});
  CHECK_THROWS_AS(BucketPlan::build(leaves, 0), std::invalid_argument);
}

TEST_CASE("random layouts keep every invariant", "[plan][property]") {
  std::mt19937 rng(12345);
  for (int round = 0; round < 500; ++round) {
    const std::vector<LeafLayout> leaves = random_leaves(rng, td::kNumDTypes);
    std::optional<std::size_t> cap;
    if (rng() % 4 != 0) cap = std::uniform_int_distribution<std::size_t>(1, 4096)(rng);
    auto plan = BucketPlan::build(leaves, cap);
    INFO("round " << round);
    CHECK(plan.check(leaves) == "");
  }
}

TEST_CASE("check() catches a broken plan", "[plan]") {
  std::vector<LeafLayout> leaves(4, leaf(DType::Float32, 4));
  auto plan = BucketPlan::build(leaves, 32);
  REQUIRE(plan.check(leaves).empty());
  auto broken = plan;
  broken.buckets[0].slots.pop_back();
  CHECK_FALSE(broken.check(leaves).empty());
  broken = plan;
  broken.buckets[0].nbytes += 1;
  CHECK_FALSE(broken.check(leaves).empty());
  broken = plan;
  broken.buckets.push_back(broken.buckets[0]);
  CHECK_FALSE(broken.check(leaves).empty());
}

TEST_CASE("direct_bytes sends large leaves alone; uncapped messages are 4 MiB", "[plan]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 16), leaf(DType::Float32, 50000),
                                 leaf(DType::Float32, 16)};
  auto plan = BucketPlan::build(leaves, 1 << 20, 0, 64 << 10);
  CHECK(plan.check(leaves).empty());
  REQUIRE(plan.buckets.size() == 2);
  CHECK(plan.buckets[0].slots.size() == 2);  // the two small leaves packed
  CHECK(plan.buckets[1].slots.size() == 1);  // the 200 KB leaf alone
  auto packed = BucketPlan::build(leaves, 1 << 20);
  CHECK(packed.buckets.size() == 1);
  CHECK(BucketPlan::build(leaves, std::nullopt).max_message_bytes == std::size_t{4} << 20);
  CHECK(BucketPlan::build(leaves, 64).max_message_bytes == std::size_t{4} << 20);
  CHECK(BucketPlan::build(leaves, std::size_t{16} << 20).max_message_bytes == std::size_t{16}
                                                                                  << 20);
}

TEST_CASE("in order: buckets follow the order, one open bucket per dtype", "[plan][order]") {
  // Reverse canonical order (the Reducer's default), float32 leaves of 16 B and int64 of 16 B.
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4), leaf(DType::Int64, 2),
                                 leaf(DType::Float32, 4), leaf(DType::Float32, 4),
                                 leaf(DType::Int64, 2)};
  const std::vector<std::size_t> order{4, 3, 2, 1, 0};
  auto plan = BucketPlan::build_in_order(leaves, order, 32);
  CHECK(plan.check_in_order(leaves, order).empty());
  // Numbered by the first leaf in order: int64 {4, 1}, float32 {3, 2}, then float32 {0}.
  CHECK(groups(plan) == std::vector<std::vector<std::size_t>>{{4, 1}, {3, 2}, {0}});
  CHECK(plan.buckets[0].dtype == DType::Int64);
  CHECK(plan.buckets[1].slots[1].offset == 16);  // leaf 2 right after leaf 3
  CHECK(plan.buckets[2].nbytes == 16);
  CHECK(plan.cap == std::size_t{32});
  CHECK(plan.max_message_bytes == std::size_t{4} << 20);
  CHECK(BucketPlan::build_in_order(leaves, order, 32, 1000).max_message_bytes == 1000);
  // Not in canonical order, so check() says so.
  CHECK_FALSE(plan.check(leaves).empty());
}

TEST_CASE("in order: a leaf over the cap closes its dtype's open bucket", "[plan][order]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4), leaf(DType::Float32, 1000),
                                 leaf(DType::Float32, 4), leaf(DType::Float32, 4)};
  const std::vector<std::size_t> order{0, 1, 2, 3};
  auto plan = BucketPlan::build_in_order(leaves, order, 64);
  CHECK(plan.check_in_order(leaves, order).empty());
  // build() keeps leaf 0's bucket open past the large leaf; the Reducer's order does not.
  CHECK(groups(plan) == std::vector<std::vector<std::size_t>>{{0}, {1}, {2, 3}});
  CHECK(groups(BucketPlan::build(leaves, 64)) ==
        std::vector<std::vector<std::size_t>>{{0, 2, 3}, {1}});
  // kAutoBucketBytes (SIZE_MAX, the Reducer's cap when none was resolved): one bucket a dtype.
  auto whole = BucketPlan::build_in_order(leaves, order, td::kAutoBucketBytes);
  CHECK(whole.check_in_order(leaves, order).empty());
  CHECK(groups(whole) == std::vector<std::vector<std::size_t>>{{0, 1, 2, 3}});
}

TEST_CASE("in order: strided leaves packed; empty, aliased and sparse leaves not",
          "[plan][order]") {
  std::vector<LeafLayout> leaves{leaf(DType::Float32, 4), leaf(DType::Float32, 4, false),
                                 leaf(DType::Float32, 0)};
  leaves.push_back(sparse_leaf(DType::Float32, 8));
  leaves.push_back(alias_leaf(DType::Float32, 4, 0));
  const std::vector<std::size_t> order{4, 3, 2, 1, 0};
  auto plan = BucketPlan::build_in_order(leaves, order, 1 << 20);
  CHECK(plan.check_in_order(leaves, order).empty());
  CHECK(groups(plan) == std::vector<std::vector<std::size_t>>{{1, 0}});
  CHECK_FALSE(plan.buckets[0].strided);
  CHECK(plan.sparse_leaves == std::vector<std::size_t>{3});
  CHECK(plan.skipped_leaves == std::vector<std::size_t>{4, 2});  // in order
  CHECK_THROWS_AS(BucketPlan::build_in_order(leaves, order, 0), std::invalid_argument);
  CHECK_THROWS_AS(BucketPlan::build_in_order(leaves, {0, 1, 2, 3}, 64), std::invalid_argument);
  CHECK_THROWS_AS(BucketPlan::build_in_order(leaves, {0, 1, 2, 3, 3}, 64), std::invalid_argument);
  CHECK_THROWS_AS(BucketPlan::build_in_order(leaves, {0, 1, 2, 3, 5}, 64), std::invalid_argument);
}

TEST_CASE("in order: random layouts and orders keep every invariant", "[plan][order][property]") {
  std::mt19937 rng(54321);
  for (int round = 0; round < 500; ++round) {
    // Few dtypes, so that buckets hold several leaves.
    const std::vector<LeafLayout> leaves = random_leaves(rng, 3);
    std::vector<std::size_t> order(leaves.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    const std::size_t cap = rng() % 8 == 0
                                ? td::kAutoBucketBytes
                                : std::uniform_int_distribution<std::size_t>(1, 4096)(rng);
    auto plan = BucketPlan::build_in_order(leaves, order, cap);
    INFO("round " << round);
    CHECK(plan.check_in_order(leaves, order) == "");
  }
}

TEST_CASE("check_in_order() catches a broken plan", "[plan][order]") {
  // 6 float32 leaves of 16 B in reverse order, cap 32 B: buckets {5, 4}, {3, 2}, {1, 0}.
  std::vector<LeafLayout> leaves(6, leaf(DType::Float32, 4));
  const std::vector<std::size_t> order{5, 4, 3, 2, 1, 0};
  auto plan = BucketPlan::build_in_order(leaves, order, 32);
  REQUIRE(plan.check_in_order(leaves, order).empty());
  REQUIRE(groups(plan) == std::vector<std::vector<std::size_t>>{{5, 4}, {3, 2}, {1, 0}});
  auto broken = plan;  // slots against the order
  std::swap(broken.buckets[0].slots[0].leaf, broken.buckets[0].slots[1].leaf);
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // buckets not numbered by their first leaf
  std::swap(broken.buckets[0], broken.buckets[1]);
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // a bucket of a dtype opened while its first leaf still fitted
  broken.buckets[1].slots.pop_back();
  broken.buckets[1].nbytes = 16;
  broken.buckets.insert(broken.buckets.begin() + 2,
                        BucketPlan::Bucket{DType::Float32, 16, {{2, 0, 16}}, false});
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // over the cap
  broken.buckets[0].slots.push_back({3, 32, 16});
  broken.buckets[0].nbytes = 48;
  broken.buckets[1].slots.erase(broken.buckets[1].slots.begin());
  broken.buckets[1].slots[0].offset = 0;
  broken.buckets[1].nbytes = 16;
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // a leaf left out
  broken.buckets.pop_back();
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // a slot at the wrong offset
  broken.buckets[2].slots[1].offset = 0;
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  broken = plan;  // strided
  broken.buckets[2].strided = true;
  CHECK_FALSE(broken.check_in_order(leaves, order).empty());
  // A bucket's dtypes and buckets of one dtype interleaved.
  std::vector<LeafLayout> mixed{leaf(DType::Float32, 4), leaf(DType::Float32, 4),
                                leaf(DType::Float32, 4)};
  const std::vector<std::size_t> in_order{0, 1, 2};
  const BucketPlan same = BucketPlan::build_in_order(mixed, in_order, 32);
  REQUIRE(groups(same) == std::vector<std::vector<std::size_t>>{{0, 1}, {2}});
  BucketPlan interleaved = same;  // {0, 2}, {1}
  interleaved.buckets[0].slots[1].leaf = 2;
  interleaved.buckets[1].slots[0].leaf = 1;
  CHECK_FALSE(interleaved.check_in_order(mixed, in_order).empty());
  mixed[1].dtype = DType::Int32;  // 16 B still, now in a float32 bucket
  CHECK_FALSE(same.check_in_order(mixed, in_order).empty());
  // The order itself, and a plan of build() is not one in a given order with a large leaf.
  CHECK_FALSE(plan.check_in_order(leaves, {5, 4, 3, 2, 1}).empty());
  CHECK_FALSE(plan.check_in_order(leaves, {5, 4, 3, 2, 1, 1}).empty());
  std::vector<LeafLayout> big{leaf(DType::Float32, 4), leaf(DType::Float32, 1000),
                              leaf(DType::Float32, 4)};
  auto canonical = BucketPlan::build(big, 64);
  REQUIRE(canonical.check(big).empty());
  CHECK_FALSE(canonical.check_in_order(big, {0, 1, 2}).empty());
}
