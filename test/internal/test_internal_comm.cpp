// White-box tests of the comm layer's parts that the library does not export: the packer (run
// merging on the flat arrays, strided leaves by their own strides), the per-dict layout cache
// (every way a leaf changes is noticed), the one layout difference routine, the tail guard, and
// what the executor's DataCall factories record. Linked with the library's objects
// (CMakeLists.txt, test/internal), without MPI_Init: nothing here calls MPI (MPI_COMM_WORLD,
// MPI_INT and MPI_SUM are link-time constants; test_internal_mpi posts the calls).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/engine_internal.hpp"
#include "comm/executor.hpp"
#include "comm/tail_guard.hpp"

using td::BucketPlan;
using td::DType;
using td::Key;
using td::LeafLayout;
using td::Tensor;
using td::TensorDict;
using td::detail::LeafRef;

namespace {

// A bucket of float leaves back to back, in the order given.
BucketPlan::Bucket bucket_of(const std::vector<std::int64_t>& sizes) {
  BucketPlan::Bucket b;
  b.dtype = DType::Float32;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::size_t n = static_cast<std::size_t>(sizes[i]) * sizeof(float);
    b.slots.push_back({i, b.nbytes, n});
    b.nbytes += n;
  }
  return b;
}

void fill_memory(td::detail::LeafMemory& m, const std::vector<Tensor>& leaves) {
  for (const Tensor& t : leaves) {
    m.data.push_back(td::detail::TensorAccess::data(t, sizeof(float)));
    m.storage.push_back(td::detail::TensorAccess::storage(t));
  }
}

std::vector<float> floats(const std::byte* p, std::size_t n) {
  std::vector<float> v(n);
  std::memcpy(v.data(), p, n * sizeof(float));
  return v;
}

}  // namespace

TEST_CASE("pack_slots/unpack_slots: separate, adjacent and partly adjacent leaves round-trip",
          "[packer]") {
  // One storage holding [0..9]; leaves are slices of it (adjacent runs merge into one copy) or
  // separate tensors, in a mixed order.
  std::vector<float> base(10);
  for (int i = 0; i < 10; ++i) base[static_cast<std::size_t>(i)] = static_cast<float>(i);
  Tensor whole = Tensor::from_vector<float>(base);
  std::vector<Tensor> leaves = {
      whole.slice(0, 0, 3),                        // 0 1 2
      whole.slice(0, 3, 5),                        // 3 4       adjacent to the previous
      Tensor::from_vector<float>({100.f, 101.f}),  // separate
      whole.slice(0, 5, 10),                       // 5..9      adjacent to leaf 1, not to leaf 2
      Tensor::from_vector<float>({200.f}),         // separate, tiny
  };
  const auto b = bucket_of({3, 2, 2, 5, 1});
  td::detail::LeafMemory m;  // holds a mutex: filled in place
  fill_memory(m, leaves);
  std::vector<std::byte> buf(b.nbytes);
  td::detail::pack_slots(b, m, buf.data());
  CHECK(floats(buf.data(), 13) ==
        std::vector<float>({0, 1, 2, 3, 4, 100, 101, 5, 6, 7, 8, 9, 200}));
  // Unpack different values: every leaf receives exactly its slot.
  std::vector<float> back(13);
  for (int i = 0; i < 13; ++i) back[static_cast<std::size_t>(i)] = static_cast<float>(-i);
  std::memcpy(buf.data(), back.data(), buf.size());
  td::detail::unpack_slots(b, m, buf.data());
  CHECK(whole.to_vector<float>() == std::vector<float>({0, -1, -2, -3, -4, -7, -8, -9, -10, -11}));
  CHECK(leaves[2].to_vector<float>() == std::vector<float>({-5, -6}));
  CHECK(leaves[4].to_vector<float>() == std::vector<float>({-12}));
}

TEST_CASE("bucket_is_contiguous_in_memory: back to back in one storage and contiguous only",
          "[packer]") {
  Tensor whole = Tensor::zeros({12}, DType::Float32);
  const Key k("k");
  std::vector<Tensor> adjacent = {whole.slice(0, 0, 4), whole.slice(0, 4, 12)};
  std::vector<Tensor> gap = {whole.slice(0, 0, 4), whole.slice(0, 5, 12)};
  Tensor m2 = Tensor::zeros({3, 4}, DType::Float32);
  std::vector<Tensor> strided = {m2.transpose(0, 1)};
  auto refs = [&](std::vector<Tensor>& ts) {
    std::vector<LeafRef> r;
    for (auto& t : ts) r.push_back({&k, &t, 0});
    return r;
  };
  auto ra = refs(adjacent);
  CHECK(td::detail::bucket_is_contiguous_in_memory(bucket_of({4, 8}), ra));
  auto rg = refs(gap);
  CHECK_FALSE(td::detail::bucket_is_contiguous_in_memory(bucket_of({4, 7}), rg));
  auto rs = refs(strided);
  CHECK_FALSE(td::detail::bucket_is_contiguous_in_memory(bucket_of({12}), rs));
}

TEST_CASE("pack_bucket/unpack_bucket follow each leaf's own strides, in any slot", "[packer]") {
  // A bucket planned as two contiguous leaves, given a strided one in slot 1 (a scatter part or a
  // point-to-point peer): it is read and written in logical row-major order.
  const Key k("k");
  Tensor a = Tensor::from_vector<float>({1.f, 2.f});
  Tensor src = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {3, 2});  // [[0,1],[2,3],[4,5]]
  Tensor t = src.transpose(0, 1);                                       // [[0,2,4],[1,3,5]]
  std::vector<Tensor> ts = {a, t};
  std::vector<LeafRef> refs = {{&k, &ts[0], 0}, {&k, &ts[1], 0}};
  const auto b = bucket_of({2, 6});
  std::vector<std::byte> buf(b.nbytes);
  td::detail::pack_bucket(b, refs, buf.data());
  CHECK(floats(buf.data(), 8) == std::vector<float>({1, 2, 0, 2, 4, 1, 3, 5}));
  std::vector<float> in = {9, 8, 10, 11, 12, 13, 14, 15};
  std::memcpy(buf.data(), in.data(), buf.size());
  td::detail::unpack_bucket(b, refs, buf.data());
  CHECK(ts[0].to_vector<float>() == std::vector<float>({9, 8}));
  CHECK(ts[1].to_vector<float>() == std::vector<float>({10, 11, 12, 13, 14, 15}));
  CHECK(src.to_vector<float>() == std::vector<float>({10, 13, 11, 14, 12, 15}));
}

namespace {

// The analysis the collectives would use for `d` now, through its layout cache.
const td::detail::Analysis& analysed(TensorDict& d) {
  static td::detail::Analysis scratch;
  auto in = td::detail::dict_leaves(d);
  REQUIRE(in.error.empty());
  return td::detail::analyse_cached(in.leaves, in.cache, scratch);
}

}  // namespace

TEST_CASE("the layout cache notices every way a leaf changes", "[layout-cache]") {
  TensorDict d;
  d.set("a", Tensor::zeros({4}, DType::Float32));
  d.set({"s", "b"}, Tensor::zeros({2, 3}, DType::Float64));
  const auto first = analysed(d).layout_hash;
  CHECK(analysed(d).layout_hash == first);  // unchanged: the same analysis

  SECTION("a leaf replaced by one of another shape") {
    d.set("a", Tensor::zeros({5}, DType::Float32));
    CHECK(analysed(d).layout[0].shape == td::Shape{5});
  }
  SECTION("a leaf assigned through get()") {
    d.get({"s", "b"}) = Tensor::zeros({3, 2}, DType::Float64);
    CHECK(analysed(d).layout[1].shape == td::Shape{3, 2});
  }
  SECTION("a leaf assigned a transposed view of itself") {
    Tensor& b = d.get({"s", "b"});
    b = b.transpose(0, 1);
    CHECK_FALSE(analysed(d).layout[1].contiguous);
  }
  SECTION("a leaf of the same layout in another storage") {
    std::byte* before = analysed(d).memory->data[0];
    d.set("a", Tensor::zeros({4}, DType::Float32));
    CHECK(analysed(d).memory->data[0] != before);
    CHECK(analysed(d).layout_hash == first);
  }
  SECTION("a key added") {
    d.set("c", Tensor::zeros({1}, DType::Int64));
    CHECK(analysed(d).layout.size() == 3);
  }
  SECTION("a sub-dict replaced") {
    TensorDict other;
    other.set("b", Tensor::zeros({7}, DType::Float64));
    d.get_dict("s") = std::move(other);
    CHECK(analysed(d).layout[1].shape == td::Shape{7});
  }
  SECTION("two keys made aliases of one storage") {
    d.set("c", d.get("a"));
    CHECK(analysed(d).layout[1].alias_of == 0);  // canonical order: a, c, s.b
  }
}

// The layout cache's quick checks: no leaf object of any dict changed (the leaf epoch), or else,
// since a consolidated dict's leaves share one storage per dtype, no tensor object of those
// storages changed (their version counters), without visiting a leaf; new views and copies of
// its leaves change nothing; every change of a leaf object is seen.
TEST_CASE("the layout cache of a consolidated dict compares storage versions, not leaves",
          "[layout-cache]") {
  TensorDict d;
  for (int i = 0; i < 64; ++i) d.set(fmt::format("p{:02}", i), Tensor::zeros({4}, DType::Float32));
  d.set("z", Tensor::zeros({3}, DType::Int64));  // after the p's in canonical order
  d.consolidate();
  auto walks = [&] {
    auto in = td::detail::dict_leaves(d);
    REQUIRE(in.cache != nullptr);
    return in.cache->versions.leaf_walks();
  };
  const std::uint64_t hash = analysed(d).layout_hash;
  CHECK(analysed(d).layout_hash == hash);
  CHECK(walks() == 0);

  // Views and copies of leaves made, copied and dropped: no leaf object changed.
  {
    const Tensor view = d.get("p03").slice(0, 1, 3);
    const Tensor copy = d.get("p05");
    const std::vector<Tensor> copies = {copy, view};
    CHECK(analysed(d).layout_hash == hash);
    CHECK(walks() == 0);
  }
  // A copy of a leaf moved: no leaf object changed, so the leaf epoch holds (one load).
  {
    Tensor copy = d.get("p05");
    const Tensor moved = std::move(copy);
    CHECK(analysed(d).layout_hash == hash);
    CHECK(walks() == 0);
  }
  // A leaf of another dict changed: the process-wide leaf epoch moves. The copy moved above
  // moved its storage's counter too, so one compare of every leaf (equal), after which the
  // counters and the epoch are remembered again.
  TensorDict other;
  other.set("x", Tensor::zeros({2}, DType::Float32));
  (void)td::detail::DictAccess::canonical(other);  // marks "x" as a leaf
  other.get("x") = Tensor::zeros({3}, DType::Float32);
  CHECK(analysed(d).layout_hash == hash);
  CHECK(walks() == 1);
  // The epoch moves again, d's storages' counters do not: no compare per leaf.
  other.get("x") = Tensor::zeros({4}, DType::Float32);
  CHECK(analysed(d).layout_hash == hash);
  CHECK(walks() == 1);
  // The epoch moves and a copy of one of d's leaves is moved: one more compare of every leaf.
  {
    other.get("x") = Tensor::zeros({5}, DType::Float32);
    Tensor copy = d.get("p05");
    const Tensor moved = std::move(copy);
    CHECK(analysed(d).layout_hash == hash);
    CHECK(walks() == 2);
    CHECK(analysed(d).layout_hash == hash);
    CHECK(walks() == 2);
  }
  SECTION("a leaf assigned through a reference held since before the last call") {
    Tensor& leaf = d.get("p07");
    analysed(d);
    leaf = Tensor::zeros({5}, DType::Float32);
    CHECK(analysed(d).layout[7].shape == td::Shape{5});
  }
  SECTION("a leaf moved out of, then given a value again (a leaf without storage)") {
    const Tensor taken = std::move(d.get("p08"));
    CHECK_THAT(analysed(d).arg_error, Catch::Matchers::Contains("p08"));
    d.get("p08") = Tensor::zeros({2}, DType::Float32);
    CHECK(analysed(d).arg_error.empty());
    CHECK(analysed(d).layout[8].shape == td::Shape{2});
  }
  SECTION("two leaves of one storage swapped") {
    std::byte* const p0 = analysed(d).memory->data[0];
    std::byte* const p1 = analysed(d).memory->data[1];
    std::swap(d.get("p00"), d.get("p01"));
    CHECK(analysed(d).memory->data[0] == p1);
    CHECK(analysed(d).memory->data[1] == p0);
  }
  SECTION("every leaf dropped by the last tensor holding the storage") {
    for (int i = 0; i < 64; ++i)
      d.get(fmt::format("p{:02}", i)) = Tensor::zeros({4}, DType::Float32);
    CHECK(analysed(d).layout_hash == hash);
    CHECK(analysed(d).memory->data[0] != nullptr);
  }
}

TEST_CASE("first_difference names the smallest key at the first differing position",
          "[layout-diff]") {
  using td::detail::first_difference;
  const std::vector<std::string> a = {"a\tfloat32[2]", "b\tint64[3]"};
  CHECK_FALSE(first_difference({a, a, a}).has_value());
  // Another shape on side 1.
  auto d = first_difference({a, {"a\tfloat32[2]", "b\tint64[4]"}});
  REQUIRE(d);
  CHECK(d->key == "b");
  CHECK(d->holds == std::vector<std::string>({"int64[3]", "int64[4]"}));
  // A key missing on one side: it holds "" there.
  d = first_difference({a, {"b\tint64[3]"}, a});
  REQUIRE(d);
  CHECK(d->key == "a");
  CHECK(d->holds == std::vector<std::string>({"float32[2]", "", "float32[2]"}));
  // An extra key at the end.
  d = first_difference({a, {"a\tfloat32[2]", "b\tint64[3]", "c\tbool[1]"}});
  REQUIRE(d);
  CHECK(d->key == "c");
  CHECK(d->holds == std::vector<std::string>({"", "bool[1]"}));
}

TEST_CASE("describe_leaves and layout_hash tell a flat dotted name from a nested path",
          "[layout-diff]") {
  Tensor t = Tensor::zeros({2}, DType::Float32);
  const Key flat("a.b");
  const Key nested({"a", "b"});
  const std::vector<LeafRef> f = {{&flat, &t, td::detail::hash_key(flat)}};
  const std::vector<LeafRef> n = {{&nested, &t, td::detail::hash_key(nested)}};
  CHECK(td::detail::describe_leaves(f) != td::detail::describe_leaves(n));
  CHECK(td::detail::layout_hash(f, td::detail::plain_layout(f)) !=
        td::detail::layout_hash(n, td::detail::plain_layout(n)));
  const std::vector<LeafLayout> plain = td::detail::plain_layout(f);
  REQUIRE(plain.size() == 1);
  CHECK(plain[0].contiguous);
  CHECK(plain[0].shape == td::Shape{2});
}

TEST_CASE("the tail guard differs from every sent tail and finds an unfilled receive",
          "[comm][tail_guard]") {
  using td::detail::TailGuard;
  // Messages of 1 to 20 bytes whose tails are the first few candidates' own bytes: choose()
  // must step past every one of them.
  std::vector<std::vector<std::byte>> sent;
  for (std::size_t n = 1; n <= 20; ++n) {
    std::vector<std::byte> m(n, std::byte{0});
    TailGuard candidate(n);  // candidate n - 1
    candidate.arm(m);        // its canary at the end
    sent.push_back(m);
  }
  std::vector<std::span<const std::byte>> views;
  for (const auto& m : sent) views.emplace_back(m.data(), m.size());
  const TailGuard guard = TailGuard::choose(views);
  REQUIRE(guard.word() != 0);
  CHECK(guard.word() > 20);  // candidates 0-19 are taken by the tails above
  for (const auto& m : sent) CHECK_FALSE(guard.short_message(m));
  // A receive armed and then filled by a full message is not short; one filled only in part is.
  for (const auto& m : sent) {
    std::vector<std::byte> recv(m.size());
    guard.arm(recv);
    CHECK(guard.short_message(recv));
    std::memcpy(recv.data(), m.data(), m.size());
    CHECK_FALSE(guard.short_message(recv));
    if (m.size() > 8) {
      std::vector<std::byte> part(m.size());
      guard.arm(part);
      std::memcpy(part.data(), m.data(), m.size() - 8);  // the last 8 bytes never arrived
      CHECK(guard.short_message(part));
    }
  }
  // Unguarded (0) checks nothing; empty regions are never short.
  std::vector<std::byte> any(16, std::byte{7});
  CHECK_FALSE(TailGuard().short_message(any));
  CHECK_FALSE(guard.short_message(std::span<const std::byte>()));
}

// Each factory names only what its MPI routine takes, each in its field: a root left at 0, a
// receive count in count or a reduce op dropped would post another call than the one meant.
TEST_CASE("the executor's DataCall factories record their routine's arguments", "[executor]") {
  using td::detail::DataCall;
  using Op = DataCall::Op;
  const MPI_Comm w = MPI_COMM_WORLD;
  int s[4] = {}, r[16] = {};
  const int n[3] = {1, 2, 3}, at[3] = {0, 1, 3};
  // Every field, so that two calls compare whole.
  auto fields = [](const DataCall& c) {
    return std::tuple(c.op, c.comm, c.type, c.recv_type, c.send, c.recv, c.count, c.recv_count,
                      c.counts, c.displs, c.reduce_op, c.root, c.tag, c.control);
  };
  using td::detail::allgather_call, td::detail::allgatherv_call, td::detail::allreduce_call,
      td::detail::barrier_call, td::detail::bcast_call, td::detail::gather_call,
      td::detail::gatherv_call, td::detail::recv_call, td::detail::reduce_call,
      td::detail::reduce_scatter_block_call, td::detail::reduce_scatter_call,
      td::detail::scatter_call, td::detail::scatterv_call, td::detail::send_call;
  const std::vector<std::pair<DataCall, DataCall>> made_and_meant = {
      {send_call(s, 4, MPI_INT, 2, 77, w),  // the peer travels in root
       {.op = Op::Send, .comm = w, .type = MPI_INT, .send = s, .count = 4, .root = 2, .tag = 77}},
      {recv_call(r, 5, MPI_DOUBLE, 1, 78, w),
       {.op = Op::Recv,
        .comm = w,
        .type = MPI_DOUBLE,
        .recv = r,
        .count = 5,
        .root = 1,
        .tag = 78}},
      {bcast_call(r, 6, MPI_INT, 2, w),  // the one buffer is recv
       {.op = Op::Bcast, .comm = w, .type = MPI_INT, .recv = r, .count = 6, .root = 2}},
      {allreduce_call(MPI_IN_PLACE, r, 7, MPI_INT, MPI_SUM, w),
       {.op = Op::Allreduce,
        .comm = w,
        .type = MPI_INT,
        .send = MPI_IN_PLACE,
        .recv = r,
        .count = 7,
        .reduce_op = MPI_SUM}},
      {reduce_call(s, r, 4, MPI_INT, MPI_MAX, 2, w),
       {.op = Op::Reduce,
        .comm = w,
        .type = MPI_INT,
        .send = s,
        .recv = r,
        .count = 4,
        .reduce_op = MPI_MAX,
        .root = 2}},
      {allgather_call(s, 4, MPI_INT, r, 4, MPI_INT, w),
       {.op = Op::Allgather,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_INT,
        .send = s,
        .recv = r,
        .count = 4,
        .recv_count = 4}},
      {gather_call(s, 3, MPI_INT, r, 5, MPI_BYTE, 1, w),
       {.op = Op::Gather,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_BYTE,
        .send = s,
        .recv = r,
        .count = 3,
        .recv_count = 5,
        .root = 1}},
      {allgatherv_call(s, 2, MPI_INT, r, n, at, MPI_BYTE, w),
       {.op = Op::Allgatherv,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_BYTE,
        .send = s,
        .recv = r,
        .count = 2,
        .counts = n,
        .displs = at}},
      {gatherv_call(s, 2, MPI_INT, r, n, at, MPI_BYTE, 2, w),
       {.op = Op::Gatherv,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_BYTE,
        .send = s,
        .recv = r,
        .count = 2,
        .counts = n,
        .displs = at,
        .root = 2}},
      {scatter_call(s, 2, MPI_INT, r, 3, MPI_BYTE, 1, w),
       {.op = Op::Scatter,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_BYTE,
        .send = s,
        .recv = r,
        .count = 2,
        .recv_count = 3,
        .root = 1}},
      {scatterv_call(s, n, at, MPI_INT, r, 3, MPI_BYTE, 2, w),
       {.op = Op::Scatterv,
        .comm = w,
        .type = MPI_INT,
        .recv_type = MPI_BYTE,
        .send = s,
        .recv = r,
        .recv_count = 3,
        .counts = n,
        .displs = at,
        .root = 2}},
      {reduce_scatter_block_call(s, r, 2, MPI_INT, MPI_MIN, w),
       {.op = Op::ReduceScatterBlock,
        .comm = w,
        .type = MPI_INT,
        .send = s,
        .recv = r,
        .count = 2,
        .reduce_op = MPI_MIN}},
      {reduce_scatter_call(s, r, n, MPI_INT, MPI_PROD, w),
       {.op = Op::ReduceScatter,
        .comm = w,
        .type = MPI_INT,
        .send = s,
        .recv = r,
        .counts = n,
        .reduce_op = MPI_PROD}},
      {barrier_call(w), {.op = Op::Barrier, .comm = w, .type = MPI_DATATYPE_NULL}},
  };
  for (std::size_t i = 0; i < made_and_meant.size(); ++i) {
    INFO("factory " << i << " (DataCall::Op " << static_cast<int>(made_and_meant[i].second.op)
                    << ")");
    CHECK(fields(made_and_meant[i].first) == fields(made_and_meant[i].second));
  }
  // control() marks the library's own messages and changes nothing else.
  const DataCall plain = allreduce_call(MPI_IN_PLACE, r, 3, MPI_INT, MPI_MAX, w);
  DataCall marked = td::detail::control(plain);
  CHECK(marked.control);
  CHECK_FALSE(plain.control);
  marked.control = false;
  CHECK(fields(marked) == fields(plain));
}
