// The batch dimension and arithmetic without MPI (issue 31): slice / split / td::cat against a
// reference computed element by element, apply that changes the batch size, apply over two dicts,
// add_ / mul_, zeros_like, allclose, dtype_from_name; the same on tensorclasses. Bad input names
// the key and changes nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

using td::DType;
using td::Key;
using td::Shape;
using td::Tensor;
using td::TensorDict;

namespace {

template <class T>
Tensor iota(Shape shape, T first = T(0)) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<T>(first + static_cast<T>(i));
  return Tensor::from_vector<T>(std::move(v), std::move(shape));
}

// Rows `rows` (of the first dimension) of a row-major [n, inner...] tensor's values.
template <class T>
std::vector<T> rows_of(const Tensor& t, const std::vector<std::int64_t>& rows) {
  const auto all = t.to_vector<T>();
  const std::int64_t inner = t.numel() / t.shape()[0];
  std::vector<T> out;
  for (auto r : rows)
    for (std::int64_t j = 0; j < inner; ++j)
      out.push_back(all[static_cast<std::size_t>(r * inner + j)]);
  return out;
}

// batch [6]: "a" float [6, 2]; "s" (batch [6, 3]) with "b" int32 [6, 3]; "e": an empty sub-dict.
TensorDict nested(float base = 0.f) {
  TensorDict d({6});
  d.set("a", iota<float>({6, 2}, base));
  TensorDict s({6, 3});
  s.set("b", iota<std::int32_t>({6, 3}, static_cast<std::int32_t>(base) + 100));
  d.set("s", std::move(s));
  d.set("e", TensorDict({6, 4}));
  return d;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

struct Obs : td::TensorClass<Obs> {
  Tensor pixels;
  TD_TENSORCLASS_FIELDS(Obs, pixels)
};
struct Rollout : td::TensorClass<Rollout> {
  Obs obs;
  Tensor reward;
  int tag = 0;  // not a field: copied along
  TD_TENSORCLASS_FIELDS(Rollout, obs, reward)
};

Rollout make_rollout(std::int64_t rows, float base) {
  Rollout r;
  r.set_batch_size({rows});
  r.obs.pixels = iota<float>({rows, 2}, base);
  r.reward = iota<double>({rows}, static_cast<double>(base));
  r.tag = 7;
  return r;
}

}  // namespace

TEST_CASE("slice: row views of every leaf, nested batch sizes follow", "[transform]") {
  const TensorDict d = nested();
  const TensorDict s = d.slice(1, 5, 2);
  CHECK(s.batch_size() == Shape{2});
  CHECK(s.get_dict("s").batch_size() == Shape{2, 3});
  CHECK(s.get_dict("e").batch_size() == Shape{2, 4});
  CHECK(s.get("a").to_vector<float>() == rows_of<float>(d.get("a"), {1, 3}));
  CHECK(s.get({"s", "b"}).to_vector<std::int32_t>() ==
        rows_of<std::int32_t>(d.get({"s", "b"}), {1, 3}));
  CHECK(s.get("a").shares_storage_with(d.get("a")));  // a view
  // Python-style clamping and negative indices.
  const TensorDict tail = d.slice(-2, 100);
  CHECK(tail.batch_size() == Shape{2});
  CHECK(tail.get("a").to_vector<float>() == rows_of<float>(d.get("a"), {4, 5}));
  CHECK(d.slice(4, 2).batch_size() == Shape{0});
  // A view: writing into the slice writes into the dict.
  TensorDict v = d.slice(0, 1);
  v.get("a").zero_();
  CHECK(d.get("a").to_vector<float>()[0] == 0.f);
  CHECK(d.get("a").to_vector<float>()[1] == 0.f);
  CHECK(d.get("a").to_vector<float>()[2] == 2.f);
}

TEST_CASE("slice and split: bad input is a clear error", "[transform][errors]") {
  TensorDict flat;
  flat.set("x", Tensor::zeros({3}, DType::Float32));
  CHECK(contains(message_of([&] { (void)flat.slice(0, 1); }), "no batch dimension"));
  CHECK_THROWS_AS(flat.slice(0, 1), std::invalid_argument);
  const TensorDict d = nested();
  CHECK(contains(message_of([&] { (void)d.slice(0, 4, 0); }), "step 0 must be positive"));
  CHECK(contains(message_of([&] { (void)d.split(0); }), "rows 0 must be positive"));
  TensorDict sp({3});
  sp.set("dense", Tensor::zeros({3}, DType::Float32));
  sp.set("sp", Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({0, 2}, {1, 2}),
                                  Tensor::from_vector<float>({1.f, 2.f}), {3}));
  CHECK(contains(message_of([&] { (void)sp.slice(0, 1); }), "key 'sp' is a sparse tensor"));
}

TEST_CASE("split: parts of `rows` rows, the last shorter; cat of the parts is the dict",
          "[transform]") {
  const TensorDict d = nested();
  const auto parts = d.split(4);
  REQUIRE(parts.size() == 2);
  CHECK(parts[0].batch_size() == Shape{4});
  CHECK(parts[1].batch_size() == Shape{2});
  CHECK(parts[1].get("a").to_vector<float>() == rows_of<float>(d.get("a"), {4, 5}));
  CHECK(td::cat(parts) == d);
  CHECK(d.split(6).size() == 1);
  CHECK(d.split(1).size() == 6);
  // An empty batch gives one empty part, as torch.split does.
  const auto none = nested().slice(0, 0).split(3);
  REQUIRE(none.size() == 1);
  CHECK(none[0].batch_size() == Shape{0});
}

TEST_CASE("cat: along batch dimensions, nested, against a reference", "[transform]") {
  const TensorDict a = nested(0.f);
  const TensorDict b = nested(50.f).slice(0, 2);
  const TensorDict c = td::cat({a, b});
  CHECK(c.batch_size() == Shape{8});
  CHECK(c.get_dict("s").batch_size() == Shape{8, 3});
  CHECK(c.get_dict("e").batch_size() == Shape{8, 4});
  auto want = a.get("a").to_vector<float>();
  for (float x : b.get("a").to_vector<float>()) want.push_back(x);
  CHECK(c.get("a").to_vector<float>() == want);
  CHECK_FALSE(c.get("a").shares_storage_with(a.get("a")));  // new storage
  // A strided input (a slice with a step) is read by its strides.
  const TensorDict odd = a.slice(1, 6, 2);
  const TensorDict c2 = td::cat({odd, odd});
  auto rows = rows_of<std::int32_t>(a.get({"s", "b"}), {1, 3, 5, 1, 3, 5});
  CHECK(c2.get({"s", "b"}).to_vector<std::int32_t>() == rows);

  // dim 1 of a [2, 3] batch, and the same as dim -1.
  TensorDict x({2, 3});
  x.set("v", iota<double>({2, 3}));
  TensorDict y({2, 1});
  y.set("v", iota<double>({2, 1}, 10.0));
  const TensorDict xy = td::cat({x, y}, 1);
  CHECK(xy.batch_size() == Shape{2, 4});
  CHECK(xy.get("v").to_vector<double>() == std::vector<double>{0, 1, 2, 10, 3, 4, 5, 11});
  CHECK(td::cat({x, y}, -1) == xy);
}

TEST_CASE("cat: mismatches name the dict and the key", "[transform][errors]") {
  const TensorDict a = nested();
  TensorDict missing = nested();
  missing.get_dict("s").erase("b");
  missing.get_dict("s").set("c", Tensor::zeros({6, 3}, DType::Int32));
  std::string msg = message_of([&] { (void)td::cat({a, missing}); });
  CHECK(contains(msg, "dicts[1] has no key 's.b'"));
  CHECK_THROWS_AS(td::cat({a, missing}), td::LayoutMismatchError);

  TensorDict dtype = nested();
  dtype.set("a", Tensor::zeros({6, 2}, DType::Float64));
  msg = message_of([&] { (void)td::cat({a, dtype}); });
  CHECK(contains(msg, "key 'a'"));
  CHECK(contains(msg, "float64"));

  TensorDict wide = nested();
  wide.set("a", Tensor::zeros({6, 5}, DType::Float32));
  msg = message_of([&] { (void)td::cat({a, wide}); });
  CHECK(contains(msg, "key 'a' is float32[6, 5] in dicts[1]"));

  CHECK(contains(message_of([&] { (void)td::cat({a, a}, 1); }), "dim 1 is not a dimension"));
  CHECK(contains(message_of([] { (void)td::cat({}); }), "no TensorDict"));
  TensorDict flat;
  CHECK(contains(message_of([&] { (void)td::cat({flat, flat}); }), "batch size []"));
}

TEST_CASE("apply may change the batch size; disagreeing results name the key", "[transform]") {
  const TensorDict d = nested();
  const TensorDict head = d.apply([](const Tensor& t) { return t.slice(0, 0, 2); });
  CHECK(head.batch_size() == Shape{2});
  CHECK(head.get_dict("s").batch_size() == Shape{2, 3});
  CHECK(head.get_dict("e").batch_size() == Shape{2, 4});  // no leaves: follows its parent
  CHECK(head == d.slice(0, 2));
  // Same batch size when the results keep it.
  CHECK(d.apply([](const Tensor& t) { return t.clone(); }) == d);

  const std::string msg = message_of([&] {
    (void)d.apply([](const Tensor& t) { return t.dtype() == DType::Int32 ? t : t.slice(0, 0, 3); });
  });
  CHECK(contains(msg, "TensorDict.apply"));
  CHECK(contains(msg, "key 's'"));
  CHECK(contains(msg, "[3]"));
  CHECK_FALSE(contains(msg, "set("));
  CHECK_THROWS_AS(d.apply([](const Tensor&) { return Tensor::zeros({}, DType::Float32); }),
                  std::invalid_argument);
}

TEST_CASE("apply(fn, other) pairs leaves by key", "[transform]") {
  const TensorDict a = nested(0.f);
  TensorDict b = nested(1.f);
  const TensorDict diff = a.apply(
      [](const Tensor& x, const Tensor& y) {
        Tensor out = x.clone();
        if (x.dtype() == DType::Float32) out.array<float>() -= y.array<float>();
        return out;
      },
      b);
  CHECK(diff.get("a").to_vector<float>() == std::vector<float>(12, -1.f));
  b.erase("a");
  const std::string msg =
      message_of([&] { (void)a.apply([](const Tensor& x, const Tensor&) { return x; }, b); });
  CHECK(contains(msg, "other has no key 'a'"));
  CHECK_THROWS_AS(a.apply([](const Tensor& x, const Tensor&) { return x; }, b),
                  td::LayoutMismatchError);
}

TEST_CASE("add_: every leaf += alpha * other's", "[transform]") {
  TensorDict d = nested(0.f);
  const TensorDict before = d.clone();
  const TensorDict other = nested(10.f);
  d.add_(other, 2.0);
  const auto a0 = before.get("a").to_vector<float>();
  const auto a1 = other.get("a").to_vector<float>();
  const auto got = d.get("a").to_vector<float>();
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == a0[i] + 2.f * a1[i]);
  const auto b0 = before.get({"s", "b"}).to_vector<std::int32_t>();
  const auto b1 = other.get({"s", "b"}).to_vector<std::int32_t>();
  const auto gotb = d.get({"s", "b"}).to_vector<std::int32_t>();
  for (std::size_t i = 0; i < gotb.size(); ++i) CHECK(gotb[i] == b0[i] + 2 * b1[i]);
}

TEST_CASE("add_ errors change nothing; strided leaves are written through", "[transform]") {
  TensorDict d = nested(0.f);
  const TensorDict before = d.clone();
  // alpha 0.5 is fine for the float leaf 'a' (first in canonical order) but not for the int32
  // leaf 's.b': nothing may change.
  std::string msg = message_of([&] { d.add_(nested(1.f), 0.5); });
  CHECK(contains(msg, "key 's.b' is int32, and alpha 0.5 is not an integer"));
  CHECK(d == before);
  TensorDict wrong = nested(1.f);
  wrong.set({"s", "b"}, Tensor::zeros({6, 3}, DType::Int64));
  msg = message_of([&] { d.add_(wrong); });
  CHECK(contains(msg, "key 's.b' is int32[6, 3] here and int64[6, 3] in other"));
  CHECK(d == before);
  TensorDict flags({2});
  flags.set("f", Tensor::full<bool>({2}, true));
  CHECK(contains(message_of([&] { flags.mul_(2.0); }), "key 'f' is a bool tensor"));

  // A view with a step: every other row of 'a' doubles, the others stay.
  TensorDict rows = d.slice(0, 6, 2);
  rows.mul_(2.0);
  const auto now = d.get("a").to_vector<float>();
  const auto was = before.get("a").to_vector<float>();
  for (std::size_t i = 0; i < now.size(); ++i)
    CHECK(now[i] == ((i / 2) % 2 == 0 ? 2.f * was[i] : was[i]));
  // Half floats go through float.
  TensorDict h({2});
  h.set("x", Tensor::full<Eigen::half>({2}, Eigen::half(1.5f)));
  h.add_(h, 1.0);
  CHECK(static_cast<float>(h.get("x").to_vector<Eigen::half>()[1]) == 3.f);
}

TEST_CASE("mul_ scales every leaf", "[transform]") {
  TensorDict d = nested(1.f);
  const TensorDict before = d.clone();
  d.mul_(-3.0);
  const auto a = before.get("a").to_vector<float>();
  const auto got = d.get("a").to_vector<float>();
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(got[i] == -3.f * a[i]);
  CHECK(d.get({"s", "b"}).to_vector<std::int32_t>()[0] ==
        -3 * before.get({"s", "b"}).to_vector<std::int32_t>()[0]);
  CHECK(contains(message_of([&] { d.mul_(0.5); }), "key 's.b' is int32, and factor 0.5"));
}

TEST_CASE("zeros_like, allclose, dtype_from_name", "[transform]") {
  const TensorDict d = nested(3.f);
  const TensorDict z = td::zeros_like(d);
  CHECK(z.batch_size() == d.batch_size());
  CHECK(z.get_dict("s").batch_size() == Shape{6, 3});
  CHECK(z.get_dict("e").batch_size() == Shape{6, 4});
  CHECK(z.get("a").to_vector<float>() == std::vector<float>(12, 0.f));
  CHECK(z.get({"s", "b"}).dtype() == DType::Int32);
  CHECK_FALSE(z.get("a").shares_storage_with(d.get("a")));

  TensorDict near = d.clone();
  near.get("a").array<float>() += 1e-6f;
  CHECK(td::allclose(d, near, 1e-5, 1e-8));
  CHECK_FALSE(td::allclose(d, near, 0.0, 1e-9));
  near.get("a").array<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(td::allclose(near, near));  // NaN is never close
  TensorDict inf = d.clone();
  inf.get("a").array<float>()[0] = std::numeric_limits<float>::infinity();
  CHECK(td::allclose(inf, inf));
  CHECK_FALSE(td::allclose(d, inf));
  CHECK_FALSE(td::allclose(d, d.exclude({"a"})));
  CHECK_FALSE(td::allclose(d, d.slice(0, 3)));

  for (std::size_t i = 0; i < td::kNumDTypes; ++i) {
    const auto dt = static_cast<DType>(i);
    CHECK(td::dtype_from_name(td::name(dt)) == dt);
  }
  CHECK(td::dtype_from_name("float") == std::nullopt);
  CHECK(td::dtype_from_name("torch.float32") == std::nullopt);
}

TEST_CASE("tensorclasses: slice, split, cat, apply, add_, mul_, zeros_like, allclose",
          "[transform][tensorclass]") {
  const Rollout r = make_rollout(5, 0.f);
  const Rollout s = r.slice(1, 4);
  CHECK(s.batch_size() == Shape{3});
  CHECK(s.tag == 7);
  CHECK(s.obs.pixels.to_vector<float>() == rows_of<float>(r.obs.pixels, {1, 2, 3}));
  CHECK(s.reward.to_vector<double>() == std::vector<double>{1, 2, 3});
  CHECK(s.obs.pixels.shares_storage_with(r.obs.pixels));

  const auto parts = r.split(2);
  REQUIRE(parts.size() == 3);
  CHECK(parts[2].batch_size() == Shape{1});
  const Rollout back = td::cat(parts);
  CHECK(back == r);
  CHECK(back.tag == 7);
  const Rollout longer = td::cat(std::vector<Rollout>{r, make_rollout(2, 100.f)});
  CHECK(longer.batch_size() == Shape{7});
  CHECK(longer.reward.to_vector<double>() == std::vector<double>{0, 1, 2, 3, 4, 100, 101});
  CHECK_THROWS_AS(td::cat(std::vector<Rollout>{}), std::invalid_argument);

  const Rollout head = r.apply([](const Tensor& t) { return t.slice(0, 0, 2); });
  CHECK(head.batch_size() == Shape{2});
  CHECK(head == r.slice(0, 2));

  Rollout acc = td::zeros_like(r);
  CHECK(acc.reward.to_vector<double>() == std::vector<double>(5, 0.0));
  CHECK(acc.tag == 7);
  acc.add_(r, 2.0).mul_(0.5);
  CHECK(td::allclose(acc, r));
  const Rollout sum = r.apply(
      [](const Tensor& x, const Tensor& y) {
        Tensor out = x.clone();
        td::visit(out.dtype(), [&](auto tag) {
          using T = typename decltype(tag)::type;
          if constexpr (std::is_floating_point_v<T>) out.array<T>() += y.array<T>();
        });
        return out;
      },
      acc);
  CHECK(sum.reward.to_vector<double>() == std::vector<double>{0, 2, 4, 6, 8});
}
