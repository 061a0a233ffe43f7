// TensorDict collectives through the bucketing packer, against a leaf-by-leaf reference.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <thread>

#include <tensordict/diagnostics.hpp>
#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"

using td::DType;
using td::Key;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;
using namespace tdtest;

namespace {

enum class Kind { AllReduce, Reduce, Broadcast };

struct LeafSpec {
  Key key;
  DType dtype;
  td::Shape shape;
  int view;  // 0 contiguous, 1 transposed, 2 strided slice
};

// The same random layout on every rank (seeded by `seed`); values depend on the rank.
std::vector<LeafSpec> random_layout(std::uint32_t seed, bool floats_only) {
  std::mt19937 rng(seed);
  const DType any[] = {DType::Float32, DType::Float64,  DType::Int32,
                       DType::Int64,   DType::BFloat16, DType::UInt8};
  const DType floats[] = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16};
  std::vector<LeafSpec> out;
  const int n = std::uniform_int_distribution<int>(1, 40)(rng);
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> parts;
    const int depth = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int k = 0; k < depth; ++k)
      parts.push_back(fmt::format("{}{}", static_cast<char>('a' + rng() % 4), i * 4 + k));
    const DType d = floats_only ? floats[rng() % 4] : any[rng() % 6];
    td::Shape shape;
    const int kind = static_cast<int>(rng() % 10);
    if (kind == 0) {
      shape = {0};
    } else if (kind < 3) {
      shape = {std::uniform_int_distribution<std::int64_t>(1, 6)(rng),
               std::uniform_int_distribution<std::int64_t>(1, 6)(rng)};
    } else {
      shape = {std::uniform_int_distribution<std::int64_t>(1, 700)(rng)};
    }
    const int view =
        shape.size() == 2 && rng() % 2 ? 1 : (shape.size() == 1 && rng() % 8 == 0 ? 2 : 0);
    out.push_back({Key(std::move(parts)), d, shape, view});
  }
  return out;
}

// Builds this rank's dict: inserted in a rank-dependent order, with views where the spec says.
TensorDict build(const std::vector<LeafSpec>& specs, ReduceOp op, int rank, std::uint32_t seed) {
  std::vector<std::size_t> order(specs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 rng(seed * 31 + static_cast<std::uint32_t>(rank));
  std::shuffle(order.begin(), order.end(), rng);
  TensorDict d;
  for (std::size_t i : order) {
    const LeafSpec& s = specs[i];
    td::visit(s.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      Tensor t;
      if (s.view ==
          1) {  // a transposed view of a [c, r] tensor holding the inputs in logical order
        Tensor base = Tensor::empty({s.shape[1], s.shape[0]}, s.dtype);
        t = base.transpose(0, 1);
        t.copy_(make_input<T>(op, rank, s.shape));
      } else if (s.view == 2) {  // every other element of a larger buffer
        Tensor base = Tensor::empty({s.shape[0] * 2}, s.dtype);
        t = base.slice(0, 0, s.shape[0] * 2, 2);
        t.copy_(make_input<T>(op, rank, s.shape));
      } else {
        t = make_input<T>(op, rank, s.shape);
      }
      d.set(s.key, t);
    });
  }
  return d;
}

bool matches_reference(const TensorDict& d, const std::vector<LeafSpec>& specs, ReduceOp op,
                       int size, Kind kind, int root) {
  bool ok = true;
  for (const auto& s : specs) {
    td::visit(s.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const Tensor& t = d.get(s.key);
      const bool good =
          kind == Kind::Broadcast ? holds_input<T>(t, op, root) : holds_expected<T>(t, op, size);
      if (!good) {
        UNSCOPED_INFO("leaf " << s.key.str() << " " << td::name(s.dtype) << " wrong: " << t);
        ok = false;
      }
    });
  }
  return ok;
}

}  // namespace

TEST_CASE("random layouts x bucket sizes x ops x sync/async x all_reduce/reduce/broadcast",
          "[tensordict][property]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const std::optional<std::size_t> caps[] = {std::nullopt, 1,       256,
                                             4096,         1 << 20, td::kAutoBucketBytes};
  const ReduceOp ops[] = {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG, ReduceOp::PRODUCT};
  int combos = 0;
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    for (const auto& cap : caps) {
      for (ReduceOp op : ops) {
        for (Kind kind : {Kind::AllReduce, Kind::Reduce, Kind::Broadcast}) {
          for (bool async : {false, true}) {
            const int root = static_cast<int>(seed) % size;
            const auto specs = random_layout(seed, op == ReduceOp::AVG);
            TensorDict d = build(specs, op, rank, seed);
            td::CollectiveOptions opts;
            opts.bucket_bytes = cap;
            opts.async_op = async;
            std::vector<td::Work> works;
            if (kind == Kind::AllReduce) works = d.all_reduce(op, opts);
            if (kind == Kind::Reduce) works = d.reduce(root, op, opts);
            if (kind == Kind::Broadcast) works = d.broadcast(root, opts);
            if (!async) CHECK(works.empty());
            td::wait_all(works);
            INFO("seed " << seed << " cap " << (cap ? std::to_string(*cap) : "none") << " op "
                         << td::name(op) << " kind " << static_cast<int>(kind) << " async "
                         << async);
            if (kind != Kind::Reduce || rank == root)
              CHECK(matches_reference(d, specs, op, size, kind, root));
            ++combos;
          }
        }
      }
    }
  }
  CHECK(combos == 6 * 6 * 4 * 3 * 2);
}

TEST_CASE("keys inserted in different orders on different ranks pair correctly", "[tensordict]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  TensorDict d;
  std::vector<std::string> names{"w", "b", "a", "z"};
  std::rotate(names.begin(), names.begin() + rank % 4, names.end());
  for (const auto& n : names)
    d.set({"layer", n}, Tensor::full<float>({3}, static_cast<float>(n[0])));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 1 << 10});
  for (const auto& n : names)
    CHECK(d.get({"layer", n}).to_vector<float>()[0] == static_cast<float>(n[0] * size));
}

TEST_CASE("two keys holding the same storage are reduced once; overlapping views are rejected",
          "[tensordict][alias]") {
  const int size = td::get_world_size();
  Tensor shared = Tensor::full<float>({4}, 1.f);
  TensorDict d;
  d.set("a", shared);
  d.set({"n", "b"}, shared);
  d.set("c", Tensor::full<float>({4}, 2.f));
  for (std::optional<std::size_t> cap :
       {std::optional<std::size_t>{}, std::optional<std::size_t>{1 << 20}}) {
    shared.copy_(Tensor::full<float>({4}, 1.f));
    d.all_reduce(ReduceOp::SUM, {.bucket_bytes = cap});
    CHECK(d.get("a").to_vector<float>() == std::vector<float>(4, static_cast<float>(size)));
    CHECK(d.get({"n", "b"}).shares_storage_with(d.get("a")));
  }
  Tensor base = Tensor::full<float>({10}, 1.f);
  TensorDict bad;
  bad.set("x", base.slice(0, 0, 6));
  bad.set("y", base.slice(0, 4, 10));
  try {
    bad.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
    FAIL("expected an overlap error");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("overlapping") != std::string::npos);
  }
  CHECK(base.to_vector<float>() == std::vector<float>(10, 1.f));
  // interleaved strided views do not overlap: allowed
  TensorDict cols;
  cols.set("even", base.slice(0, 0, 10, 2));
  cols.set("odd", base.slice(0, 1, 10, 2));
  cols.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
  CHECK(base.to_vector<float>() == std::vector<float>(10, static_cast<float>(size)));
}

TEST_CASE("the plan is cached across calls on the same layout", "[tensordict][plan]") {
  TensorDict d;
  for (int i = 0; i < 20; ++i) d.set(fmt::format("p{}", i), Tensor::full<float>({16}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 256});
  const auto before = td::packer_stats();
  for (int k = 0; k < 5; ++k) d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 256});
  const auto after = td::packer_stats();
  CHECK(after.plan_hits - before.plan_hits == 5);
  CHECK(after.plan_misses == before.plan_misses);
  d.set("new", Tensor::full<float>({16}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 256});
  CHECK(td::packer_stats().plan_misses == after.plan_misses + 1);
}

TEST_CASE("consolidate: bucketed collectives run on the storage with no pack buffer",
          "[tensordict][consolidate]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  TensorDict d;
  for (int i = 0; i < 50; ++i)
    d.set({"g", fmt::format("p{}", i)}, make_input<float>(ReduceOp::SUM, rank, {37}));
  d.set("i", make_input<std::int64_t>(ReduceOp::SUM, rank, {5}));
  d.consolidate();
  td::reset_packer_stats();
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 1024});
  CHECK(td::packer_stats().peak_extra_bytes == 0);
  for (int i = 0; i < 50; ++i)
    CHECK(holds_expected<float>(d.get({"g", fmt::format("p{}", i)}), ReduceOp::SUM, size));
  CHECK(holds_expected<std::int64_t>(d.get("i"), ReduceOp::SUM, size));
  // without consolidate the same call needs a pack buffer, bounded by the cap
  TensorDict e;
  for (int i = 0; i < 50; ++i)
    e.set({"g", fmt::format("p{}", i)}, make_input<float>(ReduceOp::SUM, rank, {37}));
  td::reset_packer_stats();
  e.all_reduce(ReduceOp::SUM, {.bucket_bytes = 1024});
  CHECK(td::packer_stats().peak_extra_bytes > 0);
  CHECK(td::packer_stats().peak_extra_bytes <= 2 * 1024);  // one buffer, two with TD_SYNC_PIPELINE
}

// A consolidated dict's bucketed calls run one span per dtype (whatever the buckets) only when
// every rank's dict is consolidated: the agreement says so. Consolidated on some ranks only, every
// rank runs the buckets. Either way: interleaved dtypes, an alias, an empty leaf and a span
// larger than one message all come out right, for every collective.
TEST_CASE("consolidated on all, some or no ranks: every collective still right",
          "[tensordict][consolidate]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  auto build = [&](ReduceOp op, bool consolidate, int input_rank) {
    TensorDict d;
    for (int i = 0; i < 9; ++i) {
      const std::string key = fmt::format("a{}", i);
      if (i % 3 == 0) d.set(key, make_input<float>(op, input_rank, {i == 3 ? 1200000 : 17 + i}));
      if (i % 3 == 1) d.set(key, make_input<double>(op, input_rank, {5 + i}));
      if (i % 3 == 2) d.set(key, make_input<std::int64_t>(op, input_rank, {3, i}));
    }
    d.set("empty", Tensor::zeros({0}, DType::Float32));
    d.set("z_alias", d.get("a1"));
    if (consolidate) d.consolidate();
    return d;
  };
  auto holds = [&](const TensorDict& d, ReduceOp op, int n) {
    bool ok = true;
    for (int i = 0; i < 9; ++i) {
      const Tensor& t = d.get(fmt::format("a{}", i));
      ok = ok && (i % 3 == 0   ? holds_expected<float>(t, op, n)
                  : i % 3 == 1 ? holds_expected<double>(t, op, n)
                               : holds_expected<std::int64_t>(t, op, n));
    }
    return ok && d.get("z_alias").equal(d.get("a1"));
  };
  for (int mode = 0; mode < 3; ++mode) {  // consolidated on: all ranks, even ranks, none
    const bool mine = mode == 0 || (mode == 1 && rank % 2 == 0);
    INFO("mode " << mode << ", this rank consolidated: " << mine);
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
      TensorDict d = build(op, mine, rank);
      d.all_reduce(op, {.bucket_bytes = 4096});
      CHECK(holds(d, op, size));
      TensorDict r = build(op, mine, rank);
      r.reduce(size - 1, op, {.bucket_bytes = td::kAutoBucketBytes});
      if (rank == size - 1) CHECK(holds(r, op, size));
    }
    TensorDict avg;
    avg.set("f", make_input<float>(ReduceOp::AVG, rank, {300}));
    avg.set("g", make_input<float>(ReduceOp::AVG, rank, {7}));
    if (mine) avg.consolidate();
    avg.all_reduce(ReduceOp::AVG, {.bucket_bytes = 64});
    CHECK(holds_expected<float>(avg.get("f"), ReduceOp::AVG, size));
    CHECK(holds_expected<float>(avg.get("g"), ReduceOp::AVG, size));
    TensorDict b = build(ReduceOp::SUM, mine, rank);
    b.broadcast(0, {.bucket_bytes = 4096});
    CHECK(b == build(ReduceOp::SUM, false, 0));  // every rank holds rank 0's inputs
  }
}

TEST_CASE(
    "a layout mismatch is a LayoutMismatchError on every rank naming the key; nothing changes",
    "[tensordict][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;  // nothing to disagree with
  auto expect_mismatch = [&](TensorDict& d, const std::string& key,
                             td::CollectiveOptions opts = {}) {
    TensorDict before = d.clone();
    try {
      d.all_reduce(ReduceOp::SUM, opts);
      FAIL("expected LayoutMismatchError");
    } catch (const td::LayoutMismatchError& e) {
      CHECK(std::string(e.what()).find("'" + key + "'") != std::string::npos);
    }
    CHECK(d == before);
  };
  {  // a shape differs on the last rank
    TensorDict d;
    d.set("a", Tensor::full<float>({3}, 1.f));
    d.set({"m", "w"}, Tensor::full<float>({rank == size - 1 ? 5 : 4}, 1.f));
    expect_mismatch(d, "m.w", {.bucket_bytes = 1 << 20});
  }
  {  // a dtype differs
    TensorDict d;
    if (rank == 1) {
      d.set("x", Tensor::full<double>({3}, 1.0));
    } else {
      d.set("x", Tensor::full<float>({3}, 1.f));
    }
    expect_mismatch(d, "x");
  }
  {  // a key missing on rank 0
    TensorDict d;
    d.set("a", Tensor::full<float>({3}, 1.f));
    if (rank != 0) d.set("b", Tensor::full<float>({3}, 1.f));
    expect_mismatch(d, "b");
  }
  {  // one rank has an empty dict
    TensorDict d;
    if (rank != 1) d.set("k", Tensor::full<float>({3}, 1.f));
    expect_mismatch(d, "k");
  }
  {  // bucket sizes differ
    TensorDict d;
    d.set("a", Tensor::full<float>({3}, 1.f));
    CHECK_THROWS_AS(d.all_reduce(ReduceOp::SUM, {.bucket_bytes = rank == 0 ? 64 : 128}),
                    td::LayoutMismatchError);
    CHECK(d.get("a").to_vector<float>() == std::vector<float>(3, 1.f));
  }
  // after all of that the group still works
  TensorDict ok;
  ok.set("a", Tensor::full<float>({3}, 1.f));
  ok.all_reduce();
  CHECK(ok.get("a").to_vector<float>()[0] == static_cast<float>(size));
}

TEST_CASE("bad arguments: zero bucket size, unsupported op, bad root", "[tensordict][errors]") {
  const int size = td::get_world_size();
  TensorDict d;
  d.set("f", Tensor::full<float>({3}, 1.f));
  d.set("i", Tensor::full<std::int64_t>({3}, 1));
  CHECK_THROWS_AS(d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 0}), std::invalid_argument);
  CHECK_THROWS_AS(d.all_reduce(ReduceOp::AVG), std::invalid_argument);  // AVG on int64 'i'
  CHECK_THROWS_AS(d.reduce(size), std::invalid_argument);
  CHECK_THROWS_AS(d.broadcast(-1), std::invalid_argument);
  CHECK(d.get("f").to_vector<float>() == std::vector<float>(3, 1.f));
  CHECK(d.get("i").to_vector<std::int64_t>() == std::vector<std::int64_t>(3, 1));
}

TEST_CASE("async bucketed works outlive the dict", "[tensordict][async]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  std::vector<td::Work> works;
  Tensor keep;
  {
    TensorDict d;
    for (int i = 0; i < 30; ++i)
      d.set(fmt::format("p{}", i), make_input<float>(ReduceOp::SUM, rank, {100}));
    keep = d.get("p7");
    works = d.all_reduce(ReduceOp::SUM, {.async_op = true, .bucket_bytes = 1200});
    CHECK(works.size() == 10);  // 400 B leaves, three to a bucket
  }
  td::wait_all(works);
  CHECK(holds_expected<float>(keep, ReduceOp::SUM, size));
}

TEST_CASE("bucketed: every dtype x every op it supports, several leaves per dtype",
          "[tensordict][dtypes]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (ReduceOp op : kAllOps) {
    for (std::optional<std::size_t> cap :
         {std::optional<std::size_t>{}, std::optional<std::size_t>{64}}) {
      TensorDict d;
      for (std::size_t k = 0; k < td::kNumDTypes; ++k) {
        const auto dtype = static_cast<DType>(k);
        if (!td::supports(op, dtype)) continue;
        td::visit(dtype, [&](auto tag) {
          using T = typename decltype(tag)::type;
          for (int j = 0; j < 3; ++j)
            d.set({std::string(td::name(dtype)), fmt::format("l{}", j)},
                  make_input<T>(op, rank, {5 + j}));
        });
      }
      d.all_reduce(op, {.bucket_bytes = cap});
      for (const auto& [key, t] : d.items()) {
        td::visit(t.dtype(), [&](auto tag) {
          using T = typename decltype(tag)::type;
          INFO(key.str() << " " << td::name(op));
          CHECK(holds_expected<T>(t, op, size));
        });
      }
    }
  }
}

TEST_CASE("the layout cache notices leaves replaced through get() between calls",
          "[tensordict][cache]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  TensorDict d;
  for (int i = 0; i < 10; ++i) d.set(fmt::format("p{}", i), Tensor::full<float>({8}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});  // cached analysis
  // same shape, new storage, strided: must be handled as a strided leaf, not packed
  Tensor base = Tensor::full<float>({16}, 1.f);
  d.get("p3") = base.slice(0, 0, 16, 2);
  d.zero_();
  d.get("p3").copy_(Tensor::full<float>({8}, 2.f));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
  CHECK(d.get("p3").to_vector<float>() == std::vector<float>(8, 2.f * static_cast<float>(size)));
  CHECK(base.slice(0, 1, 16, 2).to_vector<float>() ==
        std::vector<float>(8, 1.f));  // gaps untouched
  if (size > 1) {  // a shape changed on one rank only: still a mismatch error, not a hang
    if (rank == 0) d.get("p5") = Tensor::full<float>({9}, 1.f);
    CHECK_THROWS_AS(d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64}), td::LayoutMismatchError);
  }
}

TEST_CASE("the layout cache notices a leaf moved out of, or given new storage of the same shape",
          "[tensordict][cache]") {
  const int size = td::get_world_size();
  TensorDict d;
  for (int i = 0; i < 6; ++i) d.set(fmt::format("p{}", i), Tensor::full<float>({4}, 1.f));
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});  // cached analysis and leaf addresses
  {
    // Same shape and strides, another storage: the old storage is freed when `old` goes.
    Tensor old = d.get("p2");
    d.get("p2") = Tensor::full<float>({4}, 3.f);
  }
  d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
  CHECK(d.get("p2").to_vector<float>() == std::vector<float>(4, 3.f * static_cast<float>(size)));
  // Moving a leaf out leaves an undefined tensor behind: an error naming it, not a stale address.
  const Tensor taken = std::move(d.get("p4"));
  CHECK_FALSE(d.get("p4").defined());
  CHECK(taken.defined());
  try {
    d.all_reduce(ReduceOp::SUM, {.bucket_bytes = 64});
    FAIL("all_reduce on an undefined leaf did not throw");
  } catch (const std::invalid_argument& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("p4"));
  }
}

// A dict skips re-analysing its leaves when no leaf object changed since the last call (its
// leaves' storage versions, else their layout ids): every way of changing a leaf object must
// count, however the new layout was made.
// Each step changes leaves without touching the dict's structure, then checks that the next
// bucketed all_reduce reduced the new leaves, at their new addresses, and nothing else.
TEST_CASE("the layout cache notices every way of changing a leaf object", "[tensordict][cache]") {
  const float n = static_cast<float>(td::get_world_size());
  const td::CollectiveOptions opts{.bucket_bytes = 64};
  TensorDict d;
  for (int i = 0; i < 6; ++i) d.set(fmt::format("p{}", i), Tensor::full<float>({4}, 1.f));
  d.set({"sub", "q"}, Tensor::full<float>({4}, 1.f));
  // Made before the first call, so no layout id is issued after it: only the storage versions
  // (or the leaves' layout ids) can tell.
  const Tensor early_copy = Tensor::full<float>({5}, 2.f);
  Tensor early_move = Tensor::full<float>({3}, 3.f);
  d.all_reduce(ReduceOp::SUM, opts);
  d.all_reduce(ReduceOp::SUM, opts);  // cached analysis and leaf addresses
  auto ones = [&](const td::Key& key) {
    d.get(key).copy_(Tensor::full<float>(d.get(key).shape(), 1.f));
  };
  auto expect = [&](const td::Key& key, std::size_t count, float value) {
    INFO(key.str());
    CHECK(d.get(key).to_vector<float>() == std::vector<float>(count, value));
  };

  d.get("p0") = early_copy;  // copy-assigned: shares early_copy's storage
  d.all_reduce(ReduceOp::SUM, opts);
  expect("p0", 5, 2.f * n);
  CHECK(early_copy.to_vector<float>() == std::vector<float>(5, 2.f * n));

  d.get("p1") = std::move(early_move);  // move-assigned
  d.all_reduce(ReduceOp::SUM, opts);
  expect("p1", 3, 3.f * n);

  std::swap(d.get("p0"), d.get("p1"));  // two leaves trade places (5 and 3 elements)
  ones("p0");
  ones("p1");
  d.all_reduce(ReduceOp::SUM, opts);
  expect("p0", 3, n);
  expect("p1", 5, n);

  TensorDict other;
  other.set("x", Tensor::full<float>({7}, 4.f));
  std::swap(d.get({"sub", "q"}),
            other.get("x"));  // a leaf of a sub-dict, swapped with another dict
  d.all_reduce(ReduceOp::SUM, opts);
  expect({"sub", "q"}, 7, 4.f * n);

  d.consolidate();  // every leaf re-homed into one storage
  for (const char* k : {"p0", "p1", "p2", "p3", "p4", "p5"}) ones(k);
  ones({"sub", "q"});
  d.all_reduce(ReduceOp::SUM, opts);
  for (const char* k : {"p2", "p3", "p4", "p5"}) expect(k, 4, n);
  expect("p0", 3, n);
  expect({"sub", "q"}, 7, n);

  // A sub-dict replaced by moving in a dict built before the last call: no version issued, no
  // leaf assigned; only the move tells.
  {
    TensorDict before;
    before.set("q", Tensor::full<float>({3}, 6.f));
    d.all_reduce(ReduceOp::SUM, opts);
    d.get_dict("sub") = std::move(before);
    d.all_reduce(ReduceOp::SUM, opts);
    expect({"sub", "q"}, 3, 6.f * n);
    // Moved out of: the next call names the moved-from dict instead of using its old leaves.
    TensorDict taken = std::move(d.get_dict("sub"));
    CHECK_THROWS_AS(d.all_reduce(ReduceOp::SUM, opts), std::invalid_argument);
    d.get_dict("sub") = std::move(taken);
    d.all_reduce(ReduceOp::SUM, opts);
    expect({"sub", "q"}, 3, 6.f * n * n);
  }

  // The sub-dict dropped and rebuilt with the same keys: another dict (maybe at the same
  // address) whose leaves live elsewhere.
  { TensorDict gone = std::move(d.get_dict("sub")); }
  TensorDict rebuilt;
  rebuilt.set("q", Tensor::full<float>({2}, 5.f));
  d.get_dict("sub") = std::move(rebuilt);
  d.all_reduce(ReduceOp::SUM, opts);
  expect({"sub", "q"}, 2, 5.f * n);
}

// Two threads assigning two different leaves of one dict at once is fine (distinct objects):
// their changes are counted in the dict without a data race (ThreadSanitizer runs this), and the
// next call sees both.
TEST_CASE("leaves of one dict assigned from two threads at once", "[tensordict][cache]") {
  const float n = static_cast<float>(td::get_world_size());
  const td::CollectiveOptions opts{.bucket_bytes = 64};
  TensorDict d;
  d.set("a", Tensor::full<float>({4}, 1.f));
  d.set("b", Tensor::full<float>({4}, 1.f));
  d.all_reduce(ReduceOp::SUM, opts);
  std::thread ta([&] {
    for (int i = 0; i < 200; ++i) d.get("a") = Tensor::full<float>({3}, 2.f);
  });
  std::thread tb([&] {
    for (int i = 0; i < 200; ++i) d.get("b") = Tensor::full<float>({5}, 3.f);
  });
  ta.join();
  tb.join();
  d.all_reduce(ReduceOp::SUM, opts);
  CHECK(d.get("a").to_vector<float>() == std::vector<float>(3, 2.f * n));
  CHECK(d.get("b").to_vector<float>() == std::vector<float>(5, 3.f * n));
}
