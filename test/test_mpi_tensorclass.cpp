// td::TensorClass collectives: every TensorDict collective on a struct of fields (nested, one of
// them a transposed view), against values every rank computes locally, sync and async, bucketed
// and not, in the world and in a group that leaves ranks out.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/exchange.hpp"
#include "support/names.hpp"

using namespace tdtest;

namespace {

struct Obs : td::TensorClass<Obs> {
  Tensor pixels;  // float32 [kRows, 3, 2]
  Tensor joints;  // float64 [kRows, 5], a transposed (non-contiguous) view
  TD_TENSORCLASS_FIELDS(Obs, pixels, joints)
};

struct Batch : td::TensorClass<Batch> {
  Obs obs;
  Tensor actions;  // float32 [kRows, 2]
  Tensor rewards;  // float64 [kRows]
  Tensor steps;    // int64 [kRows], or float32 where the op needs floats (AVG)
  TD_TENSORCLASS_FIELDS(Batch, obs, actions, rewards, steps)
};

struct FieldSpec {
  Key key;
  td::Shape shape;
  int id;
};

const std::vector<FieldSpec>& field_specs() {
  static const std::vector<FieldSpec> specs = {
      {Key({"obs", "pixels"}), {kRows, 3, 2}, 0},
      {Key({"obs", "joints"}), {kRows, 5}, 1},
      {Key("actions"), {kRows, 2}, 2},
      {Key("rewards"), {kRows}, 3},
      {Key("steps"), {kRows}, 4},
  };
  return specs;
}

template <class T>
Tensor filled(const td::Shape& shape, int who, int id) {
  std::int64_t n = 1;
  for (const std::int64_t s : shape) n *= s;
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<T>(distinct_value(who, static_cast<std::int64_t>(i), id));
  return Tensor::from_vector<T>(v, shape);
}

Batch make_batch(int who, bool floats_only = false) {
  Batch b;
  b.set_batch_size({kRows});
  b.obs.pixels = filled<float>({kRows, 3, 2}, who, 0);
  b.obs.joints = Tensor::empty({5, kRows}, DType::Float64).transpose(0, 1);
  b.obs.joints.copy_(filled<double>({kRows, 5}, who, 1));
  b.actions = filled<float>({kRows, 2}, who, 2);
  b.rewards = filled<double>({kRows}, who, 3);
  b.steps = floats_only ? filled<float>({kRows}, who, 4) : filled<std::int64_t>({kRows}, who, 4);
  return b;
}

// Every field of `b` (read through the struct's members, not a dict) with its spec.
std::vector<std::pair<const Tensor*, const FieldSpec*>> fields_of(const Batch& b) {
  const auto& s = field_specs();
  return {{&b.obs.pixels, &s[0]},
          {&b.obs.joints, &s[1]},
          {&b.actions, &s[2]},
          {&b.rewards, &s[3]},
          {&b.steps, &s[4]}};
}

// Whether every field of `b` holds f(field id, i), with the specs' shapes (first dim `rows`).
template <class F>
bool fields_hold(const Batch& b, F&& f, std::int64_t rows = kRows) {
  bool ok = true;
  for (const auto& field : fields_of(b)) {
    const Tensor& t = *field.first;
    const FieldSpec& spec = *field.second;
    td::Shape shape = spec.shape;
    shape[0] = rows;
    if (!holds(t, shape, [&](std::int64_t i) { return f(spec.id, i); })) {
      UNSCOPED_INFO("field " << spec.key.str() << " wrong: " << t);
      ok = false;
    }
  }
  return ok;
}

bool is_batch_of(const Batch& b, int who) {
  return b.batch_size() == td::Shape{kRows} &&
         fields_hold(b, [&](int id, std::int64_t i) { return distinct_value(who, i, id); });
}

const Variant kVariants[] = {{false, std::nullopt}, {false, 64}, {false, td::kAutoBucketBytes},
                             {true, std::nullopt},  {true, 64},  {true, td::kAutoBucketBytes}};

std::string describe(const Variant& v) {
  return fmt::format("async_op={} bucket_bytes={}", v.async_op,
                     !v.bucket_bytes                           ? std::string("none")
                     : *v.bucket_bytes == td::kAutoBucketBytes ? std::string("auto")
                                                               : std::to_string(*v.bucket_bytes));
}

}  // namespace

TEST_CASE("all_reduce updates the fields in place", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
    for (const auto& v : kVariants) {
      INFO("op=" << td::name(op) << " " << describe(v));
      Batch b = make_batch(rank, op == ReduceOp::AVG);
      const Tensor joints = b.obs.joints;  // a handle taken before the call
      std::vector<td::Work> works = b.all_reduce(op, options(v));
      if (!v.async_op) CHECK(works.empty());
      td::wait_all(works);
      CHECK(fields_hold(
          b, [&](int id, std::int64_t i) { return distinct_expected(op, size, i, id); }));
      CHECK(b.obs.joints.shares_storage_with(joints));
      CHECK_FALSE(b.obs.joints.is_contiguous());
      CHECK(joints.to_vector<double>()[1] == distinct_expected(op, size, 1, 1));
      CHECK(b.batch_size() == td::Shape{kRows});
    }
  }
}

TEST_CASE("a tensorclass reduces exactly like its TensorDict", "[tensorclass]") {
  const int rank = td::get_rank();
  for (const auto& v : kVariants) {
    INFO(describe(v));
    Batch b = make_batch(rank, true);
    TensorDict d = make_batch(rank, true).to_tensordict();  // same layout, its own storage
    auto bw = b.all_reduce(ReduceOp::AVG, options(v));
    auto dw = d.all_reduce(ReduceOp::AVG, options(v));
    CHECK(bw.size() == dw.size());  // the same buckets
    td::wait_all(bw);
    td::wait_all(dw);
    CHECK(b.to_tensordict() == d);
    CHECK(Batch::from_tensordict(d) == b);
  }
}

TEST_CASE("reduce reaches dst", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    for (int dst = size - 1; dst >= 0; --dst) {  // the non-zero roots first
      INFO("dst=" << dst << " " << describe(v));
      Batch b = make_batch(rank);
      auto works = b.reduce(dst, ReduceOp::SUM, options(v));
      td::wait_all(works);
      if (rank == dst)
        CHECK(fields_hold(b, [&](int id, std::int64_t i) {
          return distinct_expected(ReduceOp::SUM, size, i, id);
        }));
    }
  }
}

TEST_CASE("broadcast copies src's fields everywhere", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    for (int src = 0; src < size; ++src) {
      INFO("src=" << src << " " << describe(v));
      Batch b = make_batch(rank);
      const Tensor joints = b.obs.joints;
      auto works = b.broadcast(src, options(v));
      td::wait_all(works);
      CHECK(is_batch_of(b, src));
      CHECK(b.obs.joints.shares_storage_with(joints));
    }
  }
}

TEST_CASE("all_gather and gather return every rank's struct", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    INFO(describe(v));
    const Batch mine = make_batch(rank);
    const std::vector<Batch> all = mine.all_gather(options(v));
    REQUIRE(all.size() == static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      INFO("from rank " << r);
      const Batch& got = all[static_cast<std::size_t>(r)];
      CHECK(is_batch_of(got, r));
      CHECK(got.obs.batch_size() == td::Shape{kRows});
      CHECK(got == make_batch(r));
    }
    CHECK(is_batch_of(mine, rank));  // the input is left alone

    for (int dst = 0; dst < size; ++dst) {
      INFO("dst=" << dst);
      const std::vector<Batch> at_dst = mine.gather(dst, options(v));
      if (rank == dst) {
        REQUIRE(at_dst.size() == static_cast<std::size_t>(size));
        for (int r = 0; r < size; ++r) CHECK(is_batch_of(at_dst[static_cast<std::size_t>(r)], r));
      } else {
        CHECK(at_dst.empty());
      }
    }
  }
}

TEST_CASE("scatter sends parts[r] into rank r's fields", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    for (int src = 0; src < size; ++src) {
      INFO("src=" << src << " " << describe(v));
      std::vector<Batch> parts;
      if (rank == src)
        for (int r = 0; r < size; ++r) parts.push_back(make_batch(r + 10));
      Batch mine = make_batch(-1);
      const Tensor joints = mine.obs.joints;  // non-contiguous, filled in place
      auto works = mine.scatter(src, parts, options(v));
      td::wait_all(works);
      CHECK(is_batch_of(mine, rank + 10));
      CHECK(mine.obs.joints.shares_storage_with(joints));
      CHECK(joints.to_vector<double>()[1] == distinct_value(rank + 10, 1, 1));
    }
  }
}

TEST_CASE("reduce_scatter returns this rank's shard as a struct", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const std::int64_t rows = kRows / size;
  for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    for (const auto& v : kVariants) {
      INFO("op=" << td::name(op) << " " << describe(v));
      const Batch b = make_batch(rank, op == ReduceOp::AVG);
      const Batch shard = b.reduce_scatter(op, options(v));
      CHECK(shard.batch_size() == td::Shape{rows});
      CHECK(shard.obs.batch_size() == td::Shape{rows});
      CHECK(fields_hold(
          shard,
          [&](int id, std::int64_t i) {
            const FieldSpec& s = field_specs()[static_cast<std::size_t>(id)];
            std::int64_t per_row = 1;  // elements in one row of the full field
            for (std::size_t k = 1; k < s.shape.size(); ++k) per_row *= s.shape[k];
            return distinct_expected(op, size, rank * rows * per_row + i, id);
          },
          rows));
      CHECK(is_batch_of(b, rank));  // the input is left alone
    }
  }
}

TEST_CASE("send and recv between rank pairs", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (const bool async_op : {false, true}) {
    INFO("async_op=" << async_op);
    const td::CollectiveOptions opts{.async_op = async_op};
    const Batch first = make_batch(rank), second = make_batch(rank + 50);
    Batch got_first = make_batch(-1), got_second = make_batch(-1);
    const Tensor joints = got_first.obs.joints;
    auto send_both = [&] {
      auto w1 = first.send(next, opts);
      auto w2 = second.send(next, opts);
      td::wait_all(w1);
      td::wait_all(w2);
    };
    auto recv_both = [&] {
      auto w1 = got_first.recv(prev, opts);
      auto w2 = got_second.recv(prev, opts);
      td::wait_all(w1);
      td::wait_all(w2);
    };
    // Blocking calls: even ranks send first, odd ranks receive first (no cycle of waits).
    if (rank % 2 == 0) {
      send_both();
      recv_both();
    } else {
      recv_both();
      send_both();
    }
    CHECK(is_batch_of(got_first, prev));
    CHECK(is_batch_of(got_second, prev + 50));
    CHECK(got_first.obs.joints.shares_storage_with(joints));
    CHECK(is_batch_of(first, rank));
  }
}

TEST_CASE("collectives in a group that leaves ranks out", "[tensorclass][group]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  std::vector<int> evens;
  for (int r = 0; r < size; r += 2) evens.push_back(r);
  const td::ProcessGroup group = td::new_group(evens);
  for (const auto& v : {kVariants[1], kVariants[3]}) {
    INFO(describe(v));
    const td::CollectiveOptions opts = options(v, group);
    if (rank % 2 == 0) {
      const int n = group.size(), me = group.rank();
      Batch b = make_batch(rank, true);
      auto works = b.all_reduce(ReduceOp::AVG, opts);
      td::wait_all(works);
      CHECK(fields_hold(b, [&](int id, std::int64_t i) {
        return distinct_expected(ReduceOp::AVG, size, i, id, [](int r) { return r % 2 == 0; });
      }));

      Batch r = make_batch(rank);
      works = r.reduce(n - 1, ReduceOp::MAX, opts);
      td::wait_all(works);
      if (me == n - 1) CHECK(is_batch_of(r, evens.back()));

      Batch c = make_batch(rank);
      works = c.broadcast(n - 1, opts);
      td::wait_all(works);
      CHECK(is_batch_of(c, evens.back()));

      const auto all = make_batch(rank).all_gather(opts);
      REQUIRE(all.size() == static_cast<std::size_t>(n));
      for (int g = 0; g < n; ++g) CHECK(is_batch_of(all[static_cast<std::size_t>(g)], 2 * g));

      const auto at0 = make_batch(rank).gather(0, opts);
      CHECK(at0.size() == (me == 0 ? static_cast<std::size_t>(n) : 0u));

      std::vector<Batch> parts;
      if (me == 0)
        for (int g = 0; g < n; ++g) parts.push_back(make_batch(g + 20));
      Batch mine = make_batch(-1);
      works = mine.scatter(0, parts, opts);
      td::wait_all(works);
      CHECK(is_batch_of(mine, me + 20));

      const Batch shard = make_batch(rank).reduce_scatter(ReduceOp::SUM, opts);
      CHECK(shard.batch_size() == td::Shape{kRows / n});

      if (n > 1) {  // group ranks 0 and 1 are world ranks 0 and 2
        if (me == 0) {
          works = make_batch(rank).send(1, opts);
          td::wait_all(works);
        }
        if (me == 1) {
          Batch got = make_batch(-1);
          works = got.recv(0, opts);
          td::wait_all(works);
          CHECK(is_batch_of(got, 0));
        }
      }
    } else {
      Batch b = make_batch(rank);
      std::vector<Batch> none;
      CHECK_THROWS_AS(b.all_reduce(ReduceOp::SUM, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.reduce(0, ReduceOp::SUM, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.broadcast(0, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.all_gather(opts), std::invalid_argument);
      CHECK_THROWS_AS(b.gather(0, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.scatter(0, none, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.reduce_scatter(ReduceOp::SUM, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.send(0, opts), std::invalid_argument);
      CHECK_THROWS_AS(b.recv(0, opts), std::invalid_argument);
      CHECK(is_batch_of(b, rank));
    }
  }
  td::barrier();
}

TEST_CASE("a sparse field follows the collective's result", "[tensorclass][sparse]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    INFO(describe(v));
    Batch b = make_batch(rank);
    // Rank r holds one entry, at row r % kRows, of value r + 1.
    b.rewards = Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({rank % kRows}, {1, 1}),
                                   Tensor::from_vector<double>({rank + 1.0}), {kRows});
    auto works = b.all_reduce(ReduceOp::SUM, options(v));
    td::wait_all(works);
    REQUIRE(b.rewards.is_sparse());
    std::vector<double> expected(kRows, 0.0);
    for (int r = 0; r < size; ++r) expected[static_cast<std::size_t>(r % kRows)] += r + 1.0;
    CHECK(b.rewards.to_vector<double>() == expected);
    CHECK(holds(b.actions, {kRows, 2},
                [&](std::int64_t i) { return distinct_expected(ReduceOp::SUM, size, i, 2); }));
  }
}

TEST_CASE("a layout mismatch raises on every rank, naming the key; nothing changes",
          "[tensorclass][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  for (const auto& v : kVariants) {
    INFO(describe(v));
    Batch b = make_batch(rank);
    if (rank == size - 1) b.obs.pixels = filled<float>({kRows, 2, 3}, rank, 0);
    const Batch before = b.clone();
    try {
      b.all_reduce(ReduceOp::SUM, options(v));
      FAIL("expected LayoutMismatchError");
    } catch (const td::LayoutMismatchError& e) {
      CHECK_THAT(e.what(), Catch::Matchers::Contains("'obs.pixels'"));
    }
    CHECK(b == before);
    CHECK_THROWS_AS(b.all_gather(options(v)), td::LayoutMismatchError);
  }
}

TEST_CASE("an undefined field is an error naming it, before any communication",
          "[tensorclass][errors]") {
  Batch b = make_batch(td::get_rank());
  b.obs.joints = Tensor();  // on every rank: each fails locally, nobody waits for a peer
  try {
    b.all_reduce();
    FAIL("expected td::Error");
  } catch (const td::Error& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("field 'obs.joints'"));
  }
  CHECK_THROWS_AS(b.broadcast(0), td::Error);
  CHECK_THROWS_AS(b.all_gather(), td::Error);
  td::barrier();
}

TEST_CASE("the filling forms and isend / irecv on a struct, async", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (const auto& v : kVariants) {
    INFO(describe(v));
    const Batch mine = make_batch(rank);
    std::vector<Batch> all;
    auto works = mine.all_gather(all, options(v));
    td::wait_all(works);
    REQUIRE(all.size() == static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) CHECK(is_batch_of(all[static_cast<std::size_t>(r)], r));

    std::vector<Batch> at0;
    auto gw = mine.gather(0, at0, options(v));
    td::wait_all(gw);
    CHECK(at0.size() == (rank == 0 ? static_cast<std::size_t>(size) : 0u));

    Batch stacked;
    auto sw = mine.all_gather_stacked(stacked, options(v));
    td::wait_all(sw);
    CHECK(stacked.batch_size() == td::Shape{size, kRows});
    CHECK(stacked.rewards.shape() == td::Shape{size, kRows});
    std::vector<TensorDict> dicts;
    for (const Batch& b : all) dicts.push_back(b.to_tensordict());
    CHECK(stacked.to_tensordict().equal(td::stack(dicts)));
    for (int r = 0; r < size; ++r)
      CHECK(stacked.rewards.slice(0, r, r + 1)
                .view({kRows})
                .equal(all[static_cast<std::size_t>(r)].rewards));
    CHECK(stacked == mine.all_gather_stacked(options(v)));

    Batch shard;
    auto rw = mine.reduce_scatter(shard, ReduceOp::SUM, options(v));
    td::wait_all(rw);
    CHECK(shard == mine.reduce_scatter(ReduceOp::SUM));

    if (size > 1) {
      const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
      Batch got = make_batch(-1);
      auto r = got.irecv(prev, options(v));
      auto s = mine.isend(next, options(v));
      td::wait_all(r);
      td::wait_all(s);
      CHECK(is_batch_of(got, prev));
    }
  }
}

TEST_CASE("uneven reduce_scatter returns this rank's rows as a struct", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  // rank r < size - 1 gets r rows (rank 0 none), the last rank the rest.
  std::vector<std::int64_t> rows_per_rank(static_cast<std::size_t>(size));
  std::int64_t used = 0;
  for (int r = 0; r + 1 < size; ++r) used += rows_per_rank[static_cast<std::size_t>(r)] = r;
  rows_per_rank.back() = kRows - used;
  std::int64_t first_row = 0;
  for (int r = 0; r < rank; ++r) first_row += rows_per_rank[static_cast<std::size_t>(r)];
  const std::int64_t rows = rows_per_rank[static_cast<std::size_t>(rank)];
  for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
    for (const auto& v : kVariants) {
      INFO("op=" << td::name(op) << " " << describe(v));
      const Batch b = make_batch(rank);
      const Batch shard = b.reduce_scatter(rows_per_rank, op, options(v));
      CHECK(shard.batch_size() == td::Shape{rows});
      CHECK(fields_hold(
          shard,
          [&](int id, std::int64_t i) {
            const FieldSpec& s = field_specs()[static_cast<std::size_t>(id)];
            std::int64_t per_row = 1;
            for (std::size_t k = 1; k < s.shape.size(); ++k) per_row *= s.shape[k];
            return distinct_expected(op, size, first_row * per_row + i, id);
          },
          rows));
      CHECK(is_batch_of(b, rank));
    }
  }
}

namespace {

// A struct for transport: its fields' shapes differ per rank (rows), which the receivers need
// not know.
struct Pair : td::TensorClass<Pair> {
  Tensor x;  // float32 [rows, 2]
  Tensor y;  // int64 [rows]
  TD_TENSORCLASS_FIELDS(Pair, x, y)
};

Pair make_pair(int who) {
  const std::int64_t rows = who + 1;
  Pair p;
  p.set_batch_size({rows});
  p.x = filled<float>({rows, 2}, who, 0);
  p.y = filled<std::int64_t>({rows}, who, 1);
  return p;
}

bool is_pair_of(const Pair& p, int who) {
  const std::int64_t rows = who + 1;
  return p.batch_size() == td::Shape{rows} &&
         holds(p.x, {rows, 2}, [&](std::int64_t i) { return distinct_value(who, i, 0); }) &&
         holds(p.y, {rows}, [&](std::int64_t i) { return distinct_value(who, i, 1); });
}

}  // namespace

TEST_CASE("transport without a prior layout takes and returns structs",
          "[tensorclass][transport]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const int root = size - 1;
  const Pair mine = make_pair(rank);

  // Receivers hold a default-constructed struct (undefined fields): read on the root only.
  const Pair from_root = td::broadcast_dict(rank == root ? mine : Pair{}, root);
  CHECK(is_pair_of(from_root, root));

  const std::vector<Pair> all = td::all_gather_dicts(mine);
  REQUIRE(all.size() == static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) CHECK(is_pair_of(all[static_cast<std::size_t>(r)], r));

  const std::vector<Pair> at_root = td::gather_dicts(mine, root);
  CHECK(at_root.size() == (rank == root ? static_cast<std::size_t>(size) : 0u));
  for (std::size_t r = 0; r < at_root.size(); ++r)
    CHECK(is_pair_of(at_root[r], static_cast<int>(r)));

  std::vector<Pair> parts;
  if (rank == root)
    for (int r = 0; r < size; ++r) parts.push_back(make_pair(r + 10));
  else
    parts.resize(2);  // ignored off the root, even though these cannot be converted
  CHECK(is_pair_of(td::scatter_dicts(parts, root), rank + 10));

  if (size > 1) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    if (rank % 2 == 0) {
      td::send_dict(mine, next);
      CHECK(is_pair_of(td::recv_dict<Pair>(prev), prev));
    } else {
      const Pair got = td::recv_dict<Pair>(prev);
      td::send_dict(mine, next);
      CHECK(is_pair_of(got, prev));
    }
  }
}

TEST_CASE("scatter reads the parts on src only", "[tensorclass]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Batch b = make_batch(-1);
  std::vector<Batch> parts;
  if (rank == 0)
    for (int r = 0; r < size; ++r) parts.push_back(make_batch(r + 20));
  else
    parts.resize(static_cast<std::size_t>(size));  // undefined fields: never converted here
  b.scatter(0, parts);
  CHECK(is_batch_of(b, rank + 20));
}

TEST_CASE("an undefined field on one rank fails every rank, none waits for it",
          "[tensorclass][errors]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  if (size < 2) return;
  const int bad = size - 1;
  // The timeout only bounds the failure of a regression (a rank left waiting): a passing run
  // never waits for it.
  const td::CollectiveOptions opts{.timeout = std::chrono::seconds(20)};
  auto expect_failure = [&](const char* what, auto&& call) {
    INFO(what);
    try {
      call();
      FAIL("expected an error");
    } catch (const td::TimeoutError& e) {
      FAIL("a rank was left waiting: " << e.what());
    } catch (const td::Error& e) {
      if (rank == bad) CHECK_THAT(e.what(), Catch::Matchers::Contains("field 'obs.joints'"));
    }
  };
  Batch b = make_batch(rank);
  if (rank == bad) b.obs.joints = Tensor();
  expect_failure("all_reduce", [&] { b.all_reduce(ReduceOp::SUM, opts); });
  expect_failure("broadcast", [&] { b.broadcast(0, opts); });
  expect_failure("all_gather", [&] { (void)b.all_gather(opts); });
  expect_failure("reduce_scatter", [&] { (void)b.reduce_scatter(ReduceOp::SUM, opts); });
  expect_failure("all_gather_dicts", [&] { (void)td::all_gather_dicts(b, opts); });
  expect_failure("broadcast_dict from the bad rank",
                 [&] { (void)td::broadcast_dict(b, bad, opts); });
  if (rank == 0 || rank == bad) {
    // The bad rank sends an empty dict; rank 0 cannot make a Batch of it.
    expect_failure("send_dict / recv_dict", [&] {
      if (rank == bad)
        td::send_dict(b, 0, opts);
      else
        (void)td::recv_dict<Batch>(bad, opts);
    });
  }
  td::barrier();
}
