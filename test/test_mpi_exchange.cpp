// TensorDict send / recv, all_gather / gather, scatter and reduce_scatter, against values every
// rank computes locally.
#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/exchange.hpp"
#include "support/names.hpp"

using namespace tdtest;

namespace {

struct Spec {
  Key key;
  DType dtype;
  td::Shape shape;
  bool transposed;  // stored as a transposed (non-contiguous) view
  int id;
};

// Every leaf starts with kRows (the dict's batch size); nested keys, a non-contiguous leaf and a
// leaf without elements.
std::vector<Spec> specs(bool floats_only = false) {
  std::vector<Spec> s = {
      {Key("w"), DType::Float32, {kRows, 3}, false, 0},
      {Key({"nested", "deep", "t"}), DType::Float64, {kRows, 5}, true, 2},
      {Key({"nested", "empty"}), DType::Float32, {kRows, 0}, false, 3},
      {Key("bias"), DType::Float64, {kRows}, false, 5},
  };
  if (!floats_only) {
    s.push_back({Key({"nested", "b"}), DType::Int64, {kRows}, false, 1});
    s.push_back({Key({"nested", "count"}), DType::Int32, {kRows, 2}, false, 4});
  }
  return s;
}

Tensor make_leaf(const Spec& s, int who) {
  return td::visit(s.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tensor t;
    if (s.transposed) {
      t = Tensor::empty({s.shape[1], s.shape[0]}, s.dtype).transpose(0, 1);
    } else {
      t = Tensor::empty(s.shape, s.dtype);
    }
    if constexpr (std::is_arithmetic_v<T>) {
      std::vector<T> v(static_cast<std::size_t>(t.numel()));
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<T>(distinct_value(who, static_cast<std::int64_t>(i), s.id));
      t.copy_(Tensor::from_vector<T>(v, s.shape));
    }
    return t;
  });
}

// Rank `who`'s dict; keys are inserted in an order that depends on `who`.
TensorDict make_dict(int who, bool floats_only = false) {
  auto ss = specs(floats_only);
  if (who % 2) std::reverse(ss.begin(), ss.end());
  TensorDict d({kRows});
  for (const auto& s : ss) d.set(s.key, make_leaf(s, who));
  return d;
}

// Whether leaf `s` of `d` holds f(i) at every logical position i, with the given shape.
template <class F>
bool holds(const TensorDict& d, const Spec& s, const td::Shape& shape, F&& f) {
  const Tensor& t = d.get(s.key);
  return t.dtype() == s.dtype && tdtest::holds(t, shape, std::forward<F>(f));
}

// Whether `d` is exactly `who`'s dict.
bool is_dict_of(const TensorDict& d, int who, bool floats_only = false) {
  const auto ss = specs(floats_only);
  if (d.canonical_leaves().size() != ss.size()) return false;
  if (d.batch_size() != td::Shape{kRows}) return false;
  for (const auto& s : ss)
    if (!holds(d, s, s.shape, [&](std::int64_t i) { return distinct_value(who, i, s.id); }))
      return false;
  return true;
}

const Variant kVariants[] = {
    {false, std::nullopt}, {false, 256}, {true, std::nullopt}, {true, 256}};

}  // namespace

TEST_CASE("all_gather returns every rank's dict", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    INFO("async_op=" << v.async_op << " bucket_bytes=" << v.bucket_bytes.value_or(0));
    const TensorDict mine = make_dict(rank);
    const std::vector<TensorDict> all = mine.all_gather(options(v));
    REQUIRE(all.size() == static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      INFO("from rank " << r);
      CHECK(is_dict_of(all[static_cast<std::size_t>(r)], r));
      for (const auto& [key, t] : all[static_cast<std::size_t>(r)].canonical_leaves())
        CHECK(t.is_contiguous());
    }
    CHECK(is_dict_of(mine, rank));  // the input is left alone
  }
}

TEST_CASE("all_gather copies a key that aliases another", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Tensor t = Tensor::full<float>({4}, static_cast<float>(rank + 1));
  TensorDict d;
  d.set("a", t);
  d.set({"b", "c"}, t);
  const auto all = d.all_gather({.bucket_bytes = 256});
  REQUIRE(all.size() == static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    const auto& g = all[static_cast<std::size_t>(r)];
    CHECK(g.get("a").to_vector<float>() == std::vector<float>(4, static_cast<float>(r + 1)));
    CHECK(g.get({"b", "c"}).to_vector<float>() == std::vector<float>(4, static_cast<float>(r + 1)));
  }
}

TEST_CASE("gather delivers every rank's dict to dst only", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    for (int dst = 0; dst < size; ++dst) {
      INFO("dst=" << dst << " async_op=" << v.async_op
                  << " bucket_bytes=" << v.bucket_bytes.value_or(0));
      const std::vector<TensorDict> all = make_dict(rank).gather(dst, options(v));
      if (rank == dst) {
        REQUIRE(all.size() == static_cast<std::size_t>(size));
        for (int r = 0; r < size; ++r) CHECK(is_dict_of(all[static_cast<std::size_t>(r)], r));
      } else {
        CHECK(all.empty());
      }
    }
  }
}

TEST_CASE("scatter sends parts[r] to rank r", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    for (int src = 0; src < size; ++src) {
      INFO("src=" << src << " async_op=" << v.async_op
                  << " bucket_bytes=" << v.bucket_bytes.value_or(0));
      std::vector<TensorDict> parts;
      if (rank == src)
        for (int r = 0; r < size; ++r) parts.push_back(make_dict(r + 10));
      TensorDict mine = make_dict(-1);
      const Tensor view = mine.get({"nested", "deep", "t"});  // non-contiguous, filled in place
      REQUIRE_FALSE(view.is_contiguous());
      auto works = mine.scatter(src, parts, options(v));
      CHECK(works.empty() != v.async_op);
      td::wait_all(works);
      CHECK(is_dict_of(mine, rank + 10));
      CHECK(view.shares_storage_with(mine.get({"nested", "deep", "t"})));
      CHECK(view.to_vector<double>()[1] == distinct_value(rank + 10, 1, 2));
    }
  }
}

TEST_CASE("reduce_scatter returns this rank's shard of the reduction", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const std::int64_t rows = kRows / size;
  for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
    const bool floats_only = op == ReduceOp::AVG;
    for (const auto& v : kVariants) {
      INFO("op=" << td::name(op) << " async_op=" << v.async_op
                 << " bucket_bytes=" << v.bucket_bytes.value_or(0));
      const TensorDict d = make_dict(rank, floats_only);
      const TensorDict shard = d.reduce_scatter(op, options(v));
      CHECK(shard.batch_size() == td::Shape{rows});
      CHECK(shard.get_dict("nested").batch_size() == td::Shape{rows});
      CHECK(shard.canonical_leaves().size() == specs(floats_only).size());
      for (const auto& s : specs(floats_only)) {
        INFO("key " << s.key.str());
        td::Shape shape = s.shape;
        shape[0] = rows;
        const std::int64_t per_row = shape.size() > 1 ? shape[1] : 1;
        const bool ok = holds(shard, s, shape, [&](std::int64_t i) {
          const std::int64_t j = rank * rows * per_row + i;  // position in the full leaf
          return distinct_expected(op, size, j, s.id);
        });
        CHECK(ok);
      }
      CHECK(is_dict_of(d, rank, floats_only));  // the input is left alone
    }
  }
}

TEST_CASE("exchange collectives on a group that leaves ranks out", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  std::vector<int> evens;
  for (int r = 0; r < size; r += 2) evens.push_back(r);
  const td::ProcessGroup group = td::new_group(evens);
  const td::CollectiveOptions opts{.group = group, .bucket_bytes = 256};
  const td::CollectiveOptions async{.group = group, .async_op = true, .bucket_bytes = 256};
  if (rank % 2 == 0) {
    const int n = group.size();
    const auto all = make_dict(rank).all_gather(opts);
    REQUIRE(all.size() == static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) CHECK(is_dict_of(all[static_cast<std::size_t>(r)], 2 * r));

    // The async forms in the group, and the stacked gather.
    std::vector<TensorDict> all_async;
    TensorDict stacked, shard_async;
    auto works = make_dict(rank).all_gather(all_async, async);
    for (auto& w : make_dict(rank).all_gather_stacked(stacked, async))
      works.push_back(std::move(w));
    for (auto& w : make_dict(rank).reduce_scatter(shard_async, ReduceOp::SUM, async))
      works.push_back(std::move(w));
    td::wait_all(works);
    for (int r = 0; r < n; ++r) CHECK(is_dict_of(all_async[static_cast<std::size_t>(r)], 2 * r));
    CHECK(stacked.equal(td::stack(all)));
    CHECK(shard_async.equal(make_dict(rank).reduce_scatter(ReduceOp::SUM, opts)));

    const auto at0 = make_dict(rank).gather(0, opts);
    CHECK(at0.size() == (group.rank() == 0 ? static_cast<std::size_t>(n) : 0u));

    std::vector<TensorDict> parts;
    if (group.rank() == 0)
      for (int r = 0; r < n; ++r) parts.push_back(make_dict(r + 20));
    TensorDict mine = make_dict(-1);
    mine.scatter(0, parts, opts);
    CHECK(is_dict_of(mine, group.rank() + 20));

    const TensorDict shard = make_dict(rank).reduce_scatter(ReduceOp::SUM, opts);
    CHECK(shard.batch_size() == td::Shape{kRows / n});

    if (n > 1) {  // group rank 0 and 1 are world ranks 0 and 2
      TensorDict got = make_dict(-1), got_async = make_dict(-1);
      if (group.rank() == 0) {
        make_dict(rank).send(1, opts);
        auto w = make_dict(rank + 7).isend(1, async);
        td::wait_all(w);
      }
      if (group.rank() == 1) {
        got.recv(0, opts);
        CHECK(is_dict_of(got, 0));
        auto w = got_async.irecv(0, async);
        td::wait_all(w);
        CHECK(is_dict_of(got_async, 7));
      }
    }
  } else {
    TensorDict d = make_dict(rank);
    CHECK_THROWS_AS(d.all_gather(opts), std::invalid_argument);
    CHECK_THROWS_AS(d.gather(0, opts), std::invalid_argument);
    CHECK_THROWS_AS(d.scatter(0, {}, opts), std::invalid_argument);
    CHECK_THROWS_AS(d.reduce_scatter(ReduceOp::SUM, opts), std::invalid_argument);
    CHECK_THROWS_AS(d.send(0, opts), std::invalid_argument);
    CHECK_THROWS_AS(d.recv(0, opts), std::invalid_argument);
  }
}

TEST_CASE("a layout or argument mismatch on one rank raises on every rank", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  for (const auto& v : kVariants) {
    INFO("async_op=" << v.async_op << " bucket_bytes=" << v.bucket_bytes.value_or(0));
    const auto opts = options(v);
    // Rank 1's "w" has another shape.
    TensorDict d = make_dict(rank);
    if (rank == 1) d.set("w", Tensor::zeros({kRows, 4}, DType::Float32));
    CHECK_THROWS_AS(d.all_gather(opts), td::LayoutMismatchError);
    CHECK_THROWS_AS(d.gather(0, opts), td::LayoutMismatchError);
    CHECK_THROWS_AS(d.reduce_scatter(ReduceOp::SUM, opts), td::LayoutMismatchError);
    std::vector<TensorDict> parts;
    if (rank == 0)
      for (int r = 0; r < size; ++r) parts.push_back(make_dict(r + 10));
    CHECK_THROWS_AS(d.scatter(0, parts, opts), td::LayoutMismatchError);
    if (rank != 1) CHECK(is_dict_of(d, rank));  // nothing moved

    // A part with another layout on src: every rank fails, nothing moves.
    TensorDict e = make_dict(-1);
    if (rank == 0) parts[1].set("w", Tensor::zeros({kRows, 4}, DType::Float32));
    CHECK_THROWS_AS(e.scatter(0, parts, opts), std::invalid_argument);
    // Too few parts.
    if (rank == 0) parts.pop_back();
    CHECK_THROWS_AS(e.scatter(0, parts, opts), std::invalid_argument);
    CHECK(is_dict_of(e, -1));

    // A first dimension the group size does not divide.
    TensorDict f;
    f.set({"x", "y"}, Tensor::zeros({size + 1}, DType::Float32));
    try {
      f.reduce_scatter(ReduceOp::SUM, opts);
      FAIL("reduce_scatter did not throw");
    } catch (const std::invalid_argument& err) {
      CHECK_THAT(err.what(), Catch::Matchers::Contains("x.y"));
    }
    // An out-of-range root.
    CHECK_THROWS_AS(d.gather(size, opts), std::invalid_argument);
  }
}

TEST_CASE("send and recv around a ring keep back-to-back transfers apart", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  TensorDict d = make_dict(rank);
  CHECK_THROWS_AS(d.send(rank), std::invalid_argument);
  CHECK_THROWS_AS(d.recv(size), std::invalid_argument);
  CHECK_THROWS_AS(d.recv(-1), std::invalid_argument);
  if (size < 2) return;
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (const bool async_op : {false, true}) {
    INFO("async_op=" << async_op);
    for (const auto bucket : {std::optional<std::size_t>{}, std::optional<std::size_t>{256},
                              std::optional<std::size_t>{td::kAutoBucketBytes}}) {
      INFO("bucket_bytes=" << bucket.value_or(0));
      const td::CollectiveOptions opts{.async_op = async_op, .bucket_bytes = bucket};
      // Two dicts of one layout to the same peer, back to back: they must not mix.
      TensorDict first = make_dict(rank), second = make_dict(rank + 50);
      TensorDict got_first = make_dict(-1), got_second = make_dict(-1);
      if (async_op) {
        // Everything posted at once, receives first on odd ranks; then waited for.
        std::vector<td::Work> works;
        auto add = [&](std::vector<td::Work> ws) {
          CHECK(ws.size() == 1);
          for (auto& w : ws) works.push_back(std::move(w));
        };
        if (rank % 2) add(got_first.irecv(prev, opts));
        add(first.isend(next, opts));
        add(second.isend(next, opts));
        if (rank % 2 == 0) add(got_first.irecv(prev, opts));
        add(got_second.irecv(prev, opts));
        td::wait_all(works);
      } else if (rank % 2 == 0) {
        // Blocking calls: even ranks send first, odd ranks receive first (no cycle of waits).
        CHECK(first.send(next, opts).empty());
        CHECK(second.send(next, opts).empty());
        got_first.recv(prev, opts);
        got_second.recv(prev, opts);
      } else {
        got_first.recv(prev, opts);
        got_second.recv(prev, opts);
        first.send(next, opts);
        second.send(next, opts);
      }
      CHECK(is_dict_of(got_first, prev));
      CHECK(is_dict_of(got_second, prev + 50));
      CHECK(is_dict_of(first, rank));
    }
  }
}

TEST_CASE("transfers with different tags pair up by tag, whatever the order", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  // Rank 0 sends A (tag 7) then B (tag 3); rank 1 receives B first, then A. Same layout, so a
  // mix-up would go unnoticed by the handshake: only the tags keep them apart.
  if (rank == 0) {
    TensorDict a = make_dict(100), b = make_dict(200);
    auto wa = a.isend(1, {.tag = 7});
    auto wb = b.isend(1, {.bucket_bytes = td::kAutoBucketBytes, .tag = 3});
    td::wait_all(wa);
    td::wait_all(wb);
  } else {
    TensorDict got_a = make_dict(-1), got_b = make_dict(-1);
    auto wb = got_b.irecv(0, {.tag = 3});
    auto wa = got_a.irecv(0, {.tag = 7});
    td::wait_all(wa);
    td::wait_all(wb);
    CHECK(is_dict_of(got_a, 100));
    CHECK(is_dict_of(got_b, 200));
  }
  TensorDict d = make_dict(rank);
  CHECK_THROWS_AS(d.send(1 - rank, {.tag = -1}), std::invalid_argument);
  CHECK_THROWS_AS(d.send(1 - rank, {.tag = td::kMaxUserTag}), std::invalid_argument);
}

TEST_CASE("transfers from two threads with their own tags do not mix", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2 || rank > 1) return;
  // Each thread moves 20 dicts of one layout between ranks 0 and 1, blocking, concurrently with
  // the other thread; the threads on the two sides start in no particular order.
  constexpr int kRounds = 20;
  auto worker = [&](int tag, int base, std::vector<bool>& ok) {
    for (int i = 0; i < kRounds; ++i) {
      if (rank == 0) {
        make_dict(base + i).send(
            1,
            {.bucket_bytes = i % 2 ? std::optional<std::size_t>{512} : std::nullopt, .tag = tag});
      } else {
        TensorDict got = make_dict(-1);
        got.recv(0, {.tag = tag});
        ok[static_cast<std::size_t>(i)] = is_dict_of(got, base + i);
      }
    }
  };
  std::vector<bool> ok_a(kRounds, rank == 0), ok_b(kRounds, rank == 0);
  std::thread a([&] { worker(1, 100, ok_a); });
  std::thread b([&] { worker(2, 300, ok_b); });
  a.join();
  b.join();
  CHECK(std::count(ok_a.begin(), ok_a.end(), true) == kRounds);
  CHECK(std::count(ok_b.begin(), ok_b.end(), true) == kRounds);
}

// The defect this guards against: the 65th transfer in flight took the block of tags of the
// first, still pending, so MPI could pair one's messages with the other's (a receiver that
// tested its later transfer first got the earlier one's data; equal layouts passed every check).
TEST_CASE("more transfers in flight than a tag has blocks: refused, then paired in order",
          "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const td::ProcessGroup pair = td::new_group({0, 1});  // collective over world
  if (rank > 1) return;
  const int peer = 1 - rank;
  constexpr int kBlocks = 64;  // Open MPI's MPI_TAG_UB leaves 64 blocks per (peer, direction, tag)
  auto value_of = [](int i) { return td::Tensor::full<std::int64_t>({3}, 1000 + i); };
  // In each round one side (`early`) starts its 64 transfers and tries a 65th before the other
  // side has started any, so none of its 64 can have completed: the 65th must be refused there.
  for (const int early : {0, 1}) {
    INFO("the side that starts first: rank " << early);
    const bool sending = rank == 0;
    const int tag = 9 + early;
    std::vector<TensorDict> dicts;
    for (int i = 0; i <= kBlocks; ++i) {
      TensorDict d;
      d.set("v", sending ? value_of(i) : td::Tensor::zeros({3}, DType::Int64));
      dicts.push_back(std::move(d));
    }
    auto start = [&](int i) {
      TensorDict& d = dicts[static_cast<std::size_t>(i)];
      return sending ? d.isend(peer, {.tag = tag}) : d.irecv(peer, {.tag = tag});
    };
    std::vector<std::vector<td::Work>> works;
    if (rank == early) {
      for (int i = 0; i < kBlocks; ++i) works.push_back(start(i));
      try {
        auto extra = start(kBlocks);
        FAIL("the 65th transfer in flight was accepted");
      } catch (const td::Error& e) {
        CHECK_THAT(e.what(), Catch::Contains("64 point-to-point calls") &&
                                 Catch::Contains("already in flight"));
      }
    }
    td::barrier(pair);
    if (rank != early)
      for (int i = 0; i < kBlocks; ++i) works.push_back(start(i));
    // Both sides wait for their transfers last first: each must still hold its own data.
    for (int i = kBlocks - 1; i >= 0; --i) td::wait_all(works[static_cast<std::size_t>(i)]);
    // With the first done, the refused call goes through and pairs with the peer's 65th.
    auto extra = start(kBlocks);
    td::wait_all(extra);
    if (!sending)
      for (int i = 0; i <= kBlocks; ++i) {
        INFO("transfer " << i);
        CHECK(dicts[static_cast<std::size_t>(i)].get("v").to_vector<std::int64_t>() ==
              value_of(i).to_vector<std::int64_t>());
      }
  }
}

TEST_CASE("a Tensor goes point to point, sync and async, into a strided receiver", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const Tensor mine = Tensor::from_vector<double>(
      {1.0 * rank, 2.0 * rank, 3.0 * rank, 4.0 * rank, 5.0 * rank, 6.0 * rank}, {2, 3});
  const std::vector<double> want = {1.0 * prev, 2.0 * prev, 3.0 * prev,
                                    4.0 * prev, 5.0 * prev, 6.0 * prev};
  // Async both ways at once.
  Tensor got = Tensor::zeros({3, 2}, DType::Float64).transpose(0, 1);
  REQUIRE_FALSE(got.is_contiguous());
  td::Work r = td::irecv(got, prev);
  td::Work s = td::isend(mine, next);
  r.wait();
  s.wait();
  CHECK(got.to_vector<double>() == want);
  // Blocking, ordered so that no cycle of waits forms.
  Tensor got2 = Tensor::zeros({2, 3}, DType::Float64);
  if (rank % 2 == 0) {
    td::send(mine, next);
    td::recv(got2, prev);
  } else {
    td::recv(got2, prev);
    td::send(mine, next);
  }
  CHECK(got2.to_vector<double>() == want);
  // A receiver of another shape: both sides fail, naming the shapes.
  if (rank < 2 && size >= 2) {
    if (rank == 0) {
      CHECK_THROWS_AS(td::send(mine, 1), td::LayoutMismatchError);
    } else {
      Tensor wrong = Tensor::zeros({6}, DType::Float64);
      try {
        td::recv(wrong, 0);
        FAIL("recv into a tensor of another shape did not throw");
      } catch (const td::LayoutMismatchError& e) {
        CHECK_THAT(e.what(), Catch::Matchers::Contains("[2, 3]"));
      }
      CHECK(wrong.to_vector<double>() == std::vector<double>(6, 0.0));
    }
  }
}

TEST_CASE("all_gather and gather into a list, and all_gather_stacked, sync and async",
          "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    INFO("async_op=" << v.async_op << " bucket_bytes=" << v.bucket_bytes.value_or(0));
    const TensorDict mine = make_dict(rank);
    std::vector<TensorDict> all;
    auto works = mine.all_gather(all, options(v));
    CHECK(works.empty() != v.async_op);
    REQUIRE(all.size() == static_cast<std::size_t>(size));
    td::wait_all(works);
    for (int r = 0; r < size; ++r) CHECK(is_dict_of(all[static_cast<std::size_t>(r)], r));

    std::vector<TensorDict> at_last;
    auto gw = mine.gather(size - 1, at_last, options(v));
    td::wait_all(gw);
    CHECK(at_last.size() == (rank == size - 1 ? static_cast<std::size_t>(size) : 0u));
    for (std::size_t r = 0; r < at_last.size(); ++r)
      CHECK(is_dict_of(at_last[r], static_cast<int>(r)));

    TensorDict stacked;
    auto sw = mine.all_gather_stacked(stacked, options(v));
    td::wait_all(sw);
    CHECK(stacked.batch_size() == td::Shape{size, kRows});
    for (const auto& sp : specs()) {
      INFO("key " << sp.key.str());
      td::Shape shape = sp.shape;
      shape.insert(shape.begin(), size);
      const std::int64_t per_rank = td::Tensor::empty(sp.shape, sp.dtype).numel();
      CHECK(holds(stacked, sp, shape, [&](std::int64_t i) {
        return per_rank == 0 ? 0.0
                             : distinct_value(static_cast<int>(i / per_rank), i % per_rank, sp.id);
      }));
    }
    // The same as stacking the list locally.
    CHECK(td::stack(all).equal(stacked));
    CHECK(mine.all_gather_stacked(options(v)).equal(stacked));
  }
}

TEST_CASE("stack refuses dicts of different layouts", "[exchange]") {
  std::vector<TensorDict> ds = {make_dict(0), make_dict(1)};
  CHECK(td::stack(ds).batch_size() == td::Shape{2, kRows});
  ds[1].set("w", Tensor::zeros({kRows, 4}, DType::Float32));
  try {
    (void)td::stack(ds);
    FAIL("stack did not throw");
  } catch (const td::LayoutMismatchError& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("'w'"));
  }
  CHECK_THROWS_AS(td::stack({}), std::invalid_argument);
}

TEST_CASE("reduce_scatter into a dict, async, matches the sync result", "[exchange]") {
  const int rank = td::get_rank();
  for (const auto& v : kVariants) {
    INFO("async_op=" << v.async_op << " bucket_bytes=" << v.bucket_bytes.value_or(0));
    const TensorDict d = make_dict(rank);
    TensorDict shard;
    auto works = d.reduce_scatter(shard, ReduceOp::SUM, options(v));
    CHECK(works.empty() != v.async_op);
    td::wait_all(works);
    CHECK(shard.equal(d.reduce_scatter(ReduceOp::SUM)));
  }
}

TEST_CASE("send to a receiver of another layout fails on both sides", "[exchange]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  if (rank == 0) {
    const TensorDict d = make_dict(0);
    TensorDict copy = d;
    try {
      copy.send(1);
      FAIL("send to another layout did not throw");
    } catch (const td::LayoutMismatchError& e) {
      CHECK_THAT(e.what(), Catch::Matchers::Contains("'extra'"));
    }
    copy.send(1);  // the next transfer to the same peer still pairs up
  } else if (rank == 1) {
    TensorDict other = make_dict(-1);
    other.set("extra", Tensor::zeros({kRows}, DType::Float32));
    try {
      other.recv(0);
      FAIL("recv into another layout did not throw");
    } catch (const td::LayoutMismatchError& e) {
      CHECK_THAT(e.what(), Catch::Matchers::Contains("'extra'"));
    }
    CHECK(is_dict_of(other.exclude({Key("extra")}), -1));
    TensorDict got = make_dict(-1);
    got.recv(0);
    CHECK(is_dict_of(got, 0));
  }
}

TEST_CASE("gather of ragged rollouts points at gather_dicts", "[exchange][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  TensorDict rollout(td::Shape{rank + 1});  // a different number of rows on every rank
  rollout.set("obs", Tensor::zeros({rank + 1, 3}, td::DType::Float32));
  for (int round = 0; round < 2; ++round) {
    try {
      if (round == 0) {
        (void)rollout.gather(0);
      } else {
        (void)rollout.all_gather();
      }
      FAIL("gathering ragged dicts must throw");
    } catch (const td::LayoutMismatchError& e) {
      CHECK_THAT(e.what(), Catch::Contains("key 'obs'") && Catch::Contains("td::gather_dicts"));
    }
  }
  // The recipe the message gives works.
  const auto all = td::all_gather_dicts(rollout);
  CHECK(all.back().batch_size() == td::Shape{size});
}
