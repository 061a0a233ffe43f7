// TensorDict container semantics (no MPI).
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <tensordict/tensordict.hpp>

using td::Key;
using td::Tensor;
using td::TensorDict;

TEST_CASE("nested set/get/contains and KeyError naming the full path", "[tensordict]") {
  TensorDict d;
  d.set("a", Tensor::full<float>({2}, 1.f));
  d.set({"b", "c"}, Tensor::full<int>({3}, 7));
  CHECK(d.contains("a"));
  CHECK(d.contains({"b", "c"}));
  CHECK(d.contains("b"));
  CHECK(d.is_dict("b"));
  CHECK_FALSE(d.contains({"b", "x"}));
  CHECK(d.get({"b", "c"}).to_vector<int>() == std::vector<int>{7, 7, 7});
  CHECK(d.get_dict("b").get("c").numel() == 3);
  try {
    d.get({"b", "missing"});
    FAIL("expected KeyError");
  } catch (const td::KeyError& e) {
    CHECK(std::string(e.what()).find("b.missing") != std::string::npos);
  }
  CHECK_THROWS_AS(d.get("b"), td::KeyError);       // a dict, not a tensor
  CHECK_THROWS_AS(d.get_dict("a"), td::KeyError);  // a tensor, not a dict
  CHECK_THROWS_AS(d.set({"a", "x"}, Tensor::zeros({1}, td::DType::Float32)), td::KeyError);
  d.erase({"b", "c"});
  CHECK_FALSE(d.contains({"b", "c"}));
  CHECK_THROWS_AS(d.erase("nope"), td::KeyError);
}

TEST_CASE("batch size is checked on every set", "[tensordict]") {
  TensorDict d({4});
  d.set("x", Tensor::zeros({4, 3}, td::DType::Float32));
  try {
    d.set("y", Tensor::zeros({5, 3}, td::DType::Float32));
    FAIL("expected a batch-size error");
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    CHECK(msg.find("'y'") != std::string::npos);
    CHECK(msg.find("[5, 3]") != std::string::npos);
    CHECK(msg.find("[4]") != std::string::npos);
  }
  CHECK_FALSE(d.contains("y"));
  d.set({"sub", "z"}, Tensor::zeros({4}, td::DType::Int64));  // nested dicts inherit the batch size
  CHECK(d.get_dict("sub").batch_size() == td::Shape{4});
  CHECK_THROWS_AS(d.set({"sub", "w"}, Tensor::zeros({3}, td::DType::Int64)), std::invalid_argument);
  CHECK_THROWS_AS(d.set("other", TensorDict({2})), std::invalid_argument);
}

TEST_CASE("keys: insertion order, nested, leaves only; canonical order is sorted", "[tensordict]") {
  TensorDict d;
  d.set("z", Tensor::zeros({1}, td::DType::Float32));
  d.set({"m", "b"}, Tensor::zeros({1}, td::DType::Float32));
  d.set({"m", "a"}, Tensor::zeros({1}, td::DType::Float32));
  d.set("a", Tensor::zeros({1}, td::DType::Float32));
  auto top = d.keys();
  REQUIRE(top.size() == 3);
  CHECK(top[0].str() == "z");
  CHECK(top[1].str() == "m");
  CHECK(top[2].str() == "a");
  auto all = d.keys(true);
  REQUIRE(all.size() == 5);
  CHECK(all[1].str() == "m");
  CHECK(all[2].str() == "m.b");
  auto leaves = d.keys(true, true);
  CHECK(leaves.size() == 4);
  auto canon = d.canonical_leaves();
  REQUIRE(canon.size() == 4);
  CHECK(canon[0].first.str() == "a");
  CHECK(canon[1].first.str() == "m.a");
  CHECK(canon[2].first.str() == "m.b");
  CHECK(canon[3].first.str() == "z");
  // the cached order follows later structural changes, also deep ones
  d.get_dict("m").set("0", Tensor::zeros({1}, td::DType::Float32));
  CHECK(d.canonical_leaves()[1].first.str() == "m.0");
  d.get_dict("m").erase("b");
  CHECK(d.canonical_leaves().size() == 4);
  // a sub-dict moved out (its entry now holds a moved-from dict) or replaced
  TensorDict taken = std::move(d.get_dict("m"));
  CHECK(taken.canonical_leaves().size() == 2);
  CHECK_THROWS_AS(d.canonical_leaves(), td::Error);  // d still holds the moved-from entry
  d.set("m", TensorDict());
  CHECK(d.canonical_leaves().size() == 2);
  d.get_dict("m") = taken;
  CHECK(d.canonical_leaves().size() == 4);
  // Moves alone, right after a check: no version is issued and no leaf changes, so only the move
  // itself tells the cached order that the sub-dict's holder reaches another dict, or none.
  TensorDict early;  // built before the check below
  early.set("q", Tensor::zeros({1}, td::DType::Float32));
  CHECK(d.canonical_leaves().size() == 4);
  d.get_dict("m") = std::move(early);  // move-assigned into place
  canon = d.canonical_leaves();
  REQUIRE(canon.size() == 3);
  CHECK(canon[1].first.str() == "m.q");
  TensorDict moved_out(std::move(d.get_dict("m")));  // move-constructed out of place
  CHECK_THROWS_AS(d.canonical_leaves(), td::Error);
  d.get_dict("m") = std::move(moved_out);
  CHECK(d.canonical_leaves().size() == 3);
  // other dicts changing do not disturb this one's order
  TensorDict other;
  other.set("x", Tensor::zeros({1}, td::DType::Float32));
  CHECK(d.canonical_leaves()[0].first.str() == "a");
}

TEST_CASE("clone, apply, flatten/unflatten, select/exclude, update, zero_, equality",
          "[tensordict]") {
  TensorDict d;
  d.set({"a", "b"}, Tensor::full<float>({2}, 2.f));
  d.set("c", Tensor::full<int>({1}, 3));
  TensorDict deep = d.clone();
  TensorDict shallow = d;
  d.get({"a", "b"}).data<float>()[0] = 9.f;
  CHECK(shallow.get({"a", "b"}).to_vector<float>()[0] == 9.f);
  CHECK(deep.get({"a", "b"}).to_vector<float>()[0] == 2.f);
  CHECK_FALSE(deep == d);

  TensorDict doubled = deep.apply([](const Tensor& t) {
    Tensor u = t.clone();
    td::visit(u.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_arithmetic_v<T>) u.array<T>() *= T(2);
    });
    return u;
  });
  CHECK(doubled.get({"a", "b"}).to_vector<float>() == std::vector<float>{4.f, 4.f});

  TensorDict flat = deep.flatten_keys("/");
  CHECK(flat.contains("a/b"));
  CHECK(flat.unflatten_keys("/") == deep);

  CHECK(deep.select({"c"}).keys(true, true).size() == 1);
  CHECK_THROWS_AS(deep.select({"nope"}), td::KeyError);
  CHECK(deep.exclude({"c", "nope"}).keys(true, true).size() == 1);

  TensorDict other;
  other.set("c", Tensor::full<int>({1}, 42));
  deep.update(other);
  CHECK(deep.get("c").to_vector<int>()[0] == 42);
  deep.zero_();
  CHECK(deep.get({"a", "b"}).to_vector<float>() == std::vector<float>{0.f, 0.f});

  // equality ignores insertion order
  TensorDict x, y;
  x.set("p", Tensor::full<float>({1}, 1.f));
  x.set("q", Tensor::full<float>({1}, 2.f));
  y.set("q", Tensor::full<float>({1}, 2.f));
  y.set("p", Tensor::full<float>({1}, 1.f));
  CHECK(x == y);
}

// The canonical order's definition (docs/internals.md): full keys sorted part by part, so that
// "a" < "a.b"'s parent walk < "a_b" < "ab" whatever the insertion order; the cached order must
// follow every structural change.
TEST_CASE("canonical order is the keys sorted part by part, through random changes",
          "[tensordict][property]") {
  const std::vector<std::string> names = {"a", "a_b", "ab", "b", "B", "a.", "", "0", "10", "9"};
  std::uint64_t state = 12345;
  auto next = [&](std::uint64_t n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<std::size_t>((state >> 33) % n);
  };
  for (int trial = 0; trial < 40; ++trial) {
    TensorDict d;
    for (int step = 0; step < 30; ++step) {
      std::vector<std::string> parts;
      const std::size_t depth = 1 + next(3);
      for (std::size_t i = 0; i < depth; ++i) parts.push_back(names[next(names.size())]);
      try {
        const Key key(parts);  // may reject a name
        if (next(4) == 0) {
          d.erase(key);
        } else {
          d.set(key, Tensor::zeros({1}, td::DType::Float32));
        }
      } catch (const std::exception&) {
        // a rejected name, a path through a leaf, a missing key: the dict is unchanged
      }
      std::vector<Key> expected = d.keys(true, true);
      std::sort(expected.begin(), expected.end());
      const auto canon = d.canonical_leaves();
      REQUIRE(canon.size() == expected.size());
      for (std::size_t i = 0; i < canon.size(); ++i) {
        INFO("trial " << trial << " step " << step << " leaf " << i);
        CHECK(canon[i].first == expected[i]);
      }
    }
  }
}

TEST_CASE("consolidate puts each dtype in one storage in canonical order, keeping values",
          "[tensordict]") {
  TensorDict d;
  d.set("b", Tensor::from_vector<float>({3, 4}));
  d.set("a", Tensor::from_vector<float>({1, 2}));
  d.set("i", Tensor::from_vector<std::int64_t>({5}));
  d.set("t", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2}).transpose(0, 1));
  d.set("alias", d.get("a"));
  TensorDict before = d.clone();
  d.consolidate();
  CHECK(d == before);
  CHECK(d.get("a").shares_storage_with(d.get("b")));
  CHECK(d.get("a").shares_storage_with(d.get("t")));
  CHECK_FALSE(d.get("a").shares_storage_with(d.get("i")));
  CHECK(d.get("t").is_contiguous());
  CHECK(d.get("alias").storage_offset() == d.get("a").storage_offset());
  // canonical order: a, b, t for float32 (alias shares a's slot)
  CHECK(d.get("a").storage_offset() == 0);
  CHECK(d.get("b").storage_offset() == 2);
  CHECK(d.get("t").storage_offset() == 4);
}

// The defect this guards against: aliases were re-pointed by their slot's offset, which an
// empty leaf shares with the next leaf of its dtype, so an alias of an empty leaf became a view
// of that other leaf (float32[3] where it was float32[0]) and later collectives reduced it as
// that leaf.
TEST_CASE("consolidate keeps an alias of an empty leaf empty", "[tensordict]") {
  TensorDict d;
  Tensor empty = Tensor::zeros({0}, td::DType::Float32);
  d.set("a", empty);
  d.set("b", Tensor::full<float>({3}, 1.f));
  d.set("c", empty);
  d.set("d", Tensor::full<float>({2}, 2.f));
  d.set("e", d.get("d"));
  TensorDict before = d.clone();
  d.consolidate();
  CHECK(d == before);
  CHECK(d.get("c").shape() == td::Shape{0});
  CHECK(d.get("e").shape() == td::Shape{2});
  CHECK(d.get("e").storage_offset() == d.get("d").storage_offset());
  CHECK(d.is_consolidated());

  // Every leaf empty (batch size 0): each alias keeps its own shape.
  TensorDict z({0});
  Tensor x = Tensor::zeros({0, 3}, td::DType::Float32);
  z.set("x", x);
  z.set("y", Tensor::zeros({0, 5}, td::DType::Float32));
  z.set("z", x);
  z.consolidate();
  CHECK(z.get("z").shape() == td::Shape{0, 3});
  CHECK(z.get("y").shape() == td::Shape{0, 5});
}

TEST_CASE("the cached canonical order follows changes made through a sub-dict's reference",
          "[tensordict]") {
  // The order is cached by the root and checked against every sub-dict's version; these change
  // the tree below the root without calling the root.
  const auto f32 = td::DType::Float32;
  TensorDict d;
  d.set(Key({"a", "x"}), Tensor::zeros({1}, f32));
  d.set(Key({"b", "y"}), Tensor::zeros({1}, f32));
  d.set(Key({"b", "c", "z"}), Tensor::zeros({1}, f32));
  auto keys_of = [](const TensorDict& t) {
    const auto leaves = t.canonical_leaves();
    std::vector<Key> out;
    out.reserve(leaves.size());
    for (const auto& [k, v] : leaves) out.push_back(k);
    return out;
  };
  CHECK(keys_of(d) == std::vector<Key>{Key({"a", "x"}), Key({"b", "c", "z"}), Key({"b", "y"})});
  TensorDict& c = d.get_dict(Key({"b", "c"}));  // two levels down
  c.set("w", Tensor::zeros({1}, f32));
  CHECK(keys_of(d) == std::vector<Key>{Key({"a", "x"}), Key({"b", "c", "w"}), Key({"b", "c", "z"}),
                                       Key({"b", "y"})});
  d.get_dict("b").erase("y");
  CHECK(keys_of(d) ==
        std::vector<Key>{Key({"a", "x"}), Key({"b", "c", "w"}), Key({"b", "c", "z"})});
  TensorDict other;
  other.set("q", Tensor::zeros({1}, f32));
  d.get_dict("a") = other;  // a sub-dict replaced in place, through its reference
  CHECK(keys_of(d) ==
        std::vector<Key>{Key({"a", "q"}), Key({"b", "c", "w"}), Key({"b", "c", "z"})});
  TensorDict taken = std::move(d.get_dict(Key({"b", "c"})));  // moved out: the entry is empty
  CHECK(taken.contains("w"));
  CHECK_THROWS_AS(keys_of(d), td::Error);
}

TEST_CASE("a moved-from dict throws instead of crashing", "[tensordict]") {
  TensorDict d;
  d.set("a", Tensor::zeros({1}, td::DType::Float32));
  Tensor& ref = d.get("a");
  TensorDict e = std::move(d);
  CHECK(ref.numel() == 1);                 // the node moved with the dict
  CHECK_THROWS_AS(d.get("a"), td::Error);  // NOLINT(bugprone-use-after-move): tested on purpose
  CHECK(e.contains("a"));
}

namespace {
// A dict with nested sub-dicts and `n` leaves, for the concurrency tests.
TensorDict nested_dict(int n) {
  TensorDict d;
  for (int i = 0; i < n; ++i)  // fmt, not "x" + std::to_string: GCC 12 -Wrestrict misfires
    d.set({fmt::format("layer{}", i % 7), fmt::format("p{}", i)},
          Tensor::full<float>({2}, static_cast<float>(i)));
  return d;
}
}  // namespace

// Const methods of one dict may run on several threads at once, as for the standard library's
// containers: the first canonical order is built under a lock, and a built order is never
// rebuilt while the dict is not changed (readers hold references into it).
TEST_CASE("const methods of one dict are safe from several threads at once",
          "[tensordict][threads]") {
  for (int round = 0; round < 10; ++round) {
    const TensorDict d = nested_dict(100);
    const TensorDict& sub = d.get_dict("layer3");
    const TensorDict copy = d;
    // A structural change anywhere moves the process-wide epoch: the next canonical() walks
    // the tree again (without rebuilding), on every thread at once.
    std::atomic<bool> go{false};
    std::atomic<int> failures{0};
    auto reader = [&](int id) {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < 10; ++i) {
        if (d.canonical_leaves().size() != 100) ++failures;
        if (!d.equal(copy)) ++failures;
        if (sub.canonical_leaves().size() != 14) ++failures;  // i % 7 == 3
        if (d.keys(true, true).size() != 100) ++failures;
        if (td::to_string(d).empty()) ++failures;
        if (!(d.clone() == d)) ++failures;
        if (d.flatten_keys().size() != 100) ++failures;
        if (td::stack({d, copy}).batch_size() != td::Shape{2}) ++failures;
        TensorDict temp;  // other dicts changing, as in a training loop
        temp.set({"t", std::to_string(id)}, Tensor::zeros({1}, td::DType::Int32));
      }
    };
    std::vector<std::thread> threads;
    for (int id = 0; id < 4; ++id) threads.emplace_back(reader, id);
    go = true;
    for (auto& t : threads) t.join();
    CHECK(failures == 0);
  }
}

TEST_CASE("a failing nested set leaves the dict unchanged", "[tensordict]") {
  TensorDict d({4});
  d.set("x", Tensor::zeros({4}, td::DType::Float32));
  d.set({"sub", "y"}, Tensor::zeros({4}, td::DType::Float32));
  const std::string before = td::to_string(d);
  const auto keys_before = d.keys(true);
  // batch size: the sub-dicts "p" and "p.q" would have been created
  CHECK_THROWS_AS(d.set({"p", "q", "r"}, Tensor::zeros({3}, td::DType::Float32)),
                  std::invalid_argument);
  CHECK_THROWS_AS(d.set({"sub", "q", "r"}, Tensor::zeros({3}, td::DType::Float32)),
                  std::invalid_argument);
  CHECK_THROWS_AS(d.set({"p", "q"}, TensorDict({3})), std::invalid_argument);
  // a tensor on the path
  CHECK_THROWS_AS(d.set({"x", "q", "r"}, Tensor::zeros({4}, td::DType::Float32)), td::KeyError);
  CHECK_THROWS_AS(d.set({"sub", "y", "r"}, TensorDict({4})), td::KeyError);
  // an undefined tensor
  CHECK_THROWS_AS(d.set({"p", "q"}, Tensor()), std::invalid_argument);
  CHECK_FALSE(d.contains("p"));
  CHECK_FALSE(d.contains({"sub", "q"}));
  CHECK(d.keys(true) == keys_before);
  CHECK(td::to_string(d) == before);
  CHECK(d.canonical_leaves().size() == 2);
  // the same calls with valid values create the path, inheriting the batch size
  d.set({"p", "q", "r"}, Tensor::zeros({4, 2}, td::DType::Float32));
  CHECK(d.get_dict({"p", "q"}).batch_size() == td::Shape{4});
  d.set({"s", "t"}, TensorDict({4, 2}));
  CHECK(d.get_dict("s").batch_size() == td::Shape{4});
  CHECK(d.canonical_leaves().size() == 3);
}

TEST_CASE("is_consolidated: each dtype's dense leaves back to back in one storage",
          "[tensordict]") {
  TensorDict d;
  CHECK(d.is_consolidated());  // nothing to move
  d.set("b", Tensor::from_vector<float>({3, 4}));
  d.set("a", Tensor::from_vector<float>({1, 2}));
  d.set("i", Tensor::from_vector<std::int64_t>({5}));
  d.set({"n", "t"}, Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2}).transpose(0, 1));
  d.set("alias", d.get("a"));
  d.set("s", Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({0}, {1, 1}),
                                Tensor::from_vector<float>({1}), {3}));
  CHECK_FALSE(d.is_consolidated());
  d.consolidate();
  CHECK(d.is_consolidated());
  // a leaf moved out of its slot, replaced by a copy, or made non-contiguous: no longer
  TensorDict swapped = d;
  std::swap(swapped.get("a"), swapped.get("b"));  // both in one storage, wrong order
  CHECK_FALSE(swapped.is_consolidated());
  TensorDict copied = d;
  copied.set("b", d.get("b").clone());
  CHECK_FALSE(copied.is_consolidated());
  TensorDict strided = d;
  strided.set({"n", "t"}, d.get({"n", "t"}).transpose(0, 1));
  CHECK_FALSE(strided.is_consolidated());
  // a single contiguous leaf per dtype is consolidated; so is a prefix of a consolidated dict
  TensorDict one;
  one.set("x", Tensor::zeros({3}, td::DType::Float32));
  one.set("y", Tensor::zeros({3}, td::DType::Int32));
  CHECK(one.is_consolidated());
  TensorDict prefix = d;
  prefix.erase({"n", "t"});
  CHECK(prefix.is_consolidated());
  TensorDict gap = d;
  gap.erase("b");  // a, then a hole where b was, then n.t
  CHECK_FALSE(gap.is_consolidated());
}
