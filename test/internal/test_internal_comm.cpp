// White-box tests of the comm layer's parts that the library does not export: the packer (run
// merging on the flat arrays, strided leaves by their own strides), the per-dict layout cache
// (every way a leaf changes is noticed), and the one layout difference routine. Linked with the
// library's objects (CMakeLists.txt, test/internal), without MPI_Init: nothing here calls MPI.
#include <catch2/catch.hpp>

#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "comm/engine_internal.hpp"
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

// AVG's division runs vectorised, and by multiplication for a power-of-two group: the results
// must still be the bits of dividing each element on its own (what the test oracle and a
// hand-written loop give), subnormals, infinities and the largest values included.
template <class T>
std::vector<T> avg_inputs() {
  std::vector<T> v;
  std::uint64_t s = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < 4099; ++i) {  // not a multiple of any packet size
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    const auto bits = static_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(
        sizeof(T) == 4 ? (s >> 32) : s);
    T x;
    std::memcpy(&x, &bits, sizeof x);
    if (std::isnan(x)) x = T(1.5);
    v.push_back(x);
  }
  for (T x : {std::numeric_limits<T>::denorm_min(), std::numeric_limits<T>::min(),
              std::numeric_limits<T>::max(), -std::numeric_limits<T>::max(),
              std::numeric_limits<T>::infinity(), T(0), -T(0), T(3), T(1) / T(3)})
    v.push_back(x);
  return v;
}

TEMPLATE_TEST_CASE("divide_in_place gives the bits of an element-wise division", "[avg]", float,
                   double) {
  using T = TestType;
  const td::DType dt = std::is_same_v<T, float> ? td::DType::Float32 : td::DType::Float64;
  for (int divisor = 1; divisor <= 9; ++divisor) {
    CAPTURE(divisor);
    std::vector<T> got = avg_inputs<T>();
    std::vector<T> want = got;
    volatile T d = static_cast<T>(divisor);  // a division the compiler cannot rewrite
    for (T& x : want) x = x / d;
    td::detail::divide_in_place(got.data(), static_cast<std::int64_t>(got.size()), dt, divisor);
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0);
  }
  // Complex values: real and imaginary parts each divided.
  std::vector<std::complex<T>> c = {{T(1), T(-3)}, {std::numeric_limits<T>::denorm_min(), T(7)}};
  td::detail::divide_in_place(
      c.data(), 2, std::is_same_v<T, float> ? td::DType::Complex64 : td::DType::Complex128, 3);
  volatile T three = 3;
  CHECK(c[0].real() == T(1) / three);
  CHECK(c[0].imag() == T(-3) / three);
  CHECK(c[1].real() == std::numeric_limits<T>::denorm_min() / three);
  CHECK(c[1].imag() == T(7) / three);
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
