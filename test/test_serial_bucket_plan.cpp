// BucketPlan invariants (no MPI).
#include <catch2/catch.hpp>

#include <random>

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
  LeafLayout sparse = leaf(DType::Float32, 8);
  sparse.sparse = true;
  sparse.contiguous = false;
  leaves.push_back(sparse);
  LeafLayout alias = leaf(DType::Float32, 4);
  alias.alias_of = 0;
  leaves.push_back(alias);
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
    std::vector<LeafLayout> leaves;
    const int n = std::uniform_int_distribution<int>(0, 60)(rng);
    for (int i = 0; i < n; ++i) {
      LeafLayout l = leaf(static_cast<DType>(rng() % td::kNumDTypes),
                          std::uniform_int_distribution<int>(0, 300)(rng), rng() % 8 != 0);
      if (rng() % 16 == 0) {
        l.sparse = true;
        l.contiguous = false;
      }
      if (i > 0 && rng() % 16 == 0)
        l.alias_of = static_cast<std::int64_t>(rng() % static_cast<unsigned>(i));
      leaves.push_back(l);
    }
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
