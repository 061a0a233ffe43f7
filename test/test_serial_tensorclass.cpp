// td::TensorClass without MPI: conversion to and from TensorDict, storage sharing, nesting,
// errors that name the key, clone / equal / apply / zero_ / consolidate, printing.
#include <catch2/catch.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <tensordict/tensordict.hpp>

using td::DType;
using td::Key;
using td::Tensor;
using td::TensorDict;

namespace {

struct Obs : td::TensorClass<Obs> {
  Tensor pixels;
  Tensor joints;
  TD_TENSORCLASS_FIELDS(Obs, pixels, joints)
};

struct Batch : td::TensorClass<Batch> {
  Obs obs;
  Tensor actions;
  Tensor rewards;
  int step = 0;  // not a field: ignored by conversions, copied by clone()
  TD_TENSORCLASS_FIELDS(Batch, obs, actions, rewards)
};

// A tensorclass nested two levels deep, with a field listed out of declaration order.
struct Episode : td::TensorClass<Episode> {
  Tensor done;
  Batch batch;
  TD_TENSORCLASS_FIELDS(Episode, batch, done)
};

// The most fields TD_TENSORCLASS_FIELDS accepts.
struct Wide : td::TensorClass<Wide> {
  Tensor f00, f01, f02, f03, f04, f05, f06, f07, f08, f09, f10, f11, f12, f13, f14, f15, f16, f17,
      f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36,
      f37, f38, f39, f40, f41, f42, f43, f44, f45, f46, f47, f48, f49, f50, f51, f52, f53, f54, f55,
      f56, f57, f58, f59, f60, f61, f62, f63;
  TD_TENSORCLASS_FIELDS(Wide, f00, f01, f02, f03, f04, f05, f06, f07, f08, f09, f10, f11, f12, f13,
                        f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28,
                        f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43,
                        f44, f45, f46, f47, f48, f49, f50, f51, f52, f53, f54, f55, f56, f57, f58,
                        f59, f60, f61, f62, f63)
};

static_assert(td::is_tensorclass_v<Obs> && td::is_tensorclass_v<Batch>);
static_assert(td::TensorClassType<Episode> && td::TensorClassType<Wide>);
static_assert(!td::is_tensorclass_v<TensorDict> && !td::is_tensorclass_v<Tensor>);
static_assert(!td::is_tensorclass_v<int> && !td::is_tensorclass_v<std::string>);
static_assert(td::TensorDictLike<TensorDict> && td::TensorDictLike<Batch>);
static_assert(!td::TensorDictLike<Tensor>);
static_assert(Batch::field_names().size() == 3 && Batch::field_names()[0] == "obs");
static_assert(Wide::field_names().size() == 64 && Wide::field_names()[63] == "f63");

constexpr std::int64_t kB = 4;

Batch make_batch(float base) {
  Batch b;
  b.set_batch_size({kB});
  b.obs.pixels = Tensor::full<float>({kB, 3, 2}, base);
  b.obs.joints = Tensor::full<double>({kB, 7}, base + 1.0);
  b.actions = Tensor::full<std::int64_t>({kB}, static_cast<std::int64_t>(base) + 2);
  b.rewards = Tensor::full<float>({kB}, base + 3.0f);
  return b;
}

// Generic code: anything TensorDict-like converts to a dict.
template <td::TensorDictLike T>
std::size_t leaf_count(const T& x) {
  return td::to_tensordict(x).canonical_leaves().size();
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("to_tensordict: keys are the field names, nested structs are sub-dicts, storage shared",
          "[tensorclass]") {
  Batch b = make_batch(1.0f);
  TensorDict d = b.to_tensordict();
  CHECK(d.batch_size() == td::Shape{kB});
  CHECK(d.get_dict("obs").batch_size() == td::Shape{kB});  // inherited from the parent
  CHECK(d.keys(true, true) == std::vector<Key>{Key({"obs", "pixels"}), Key({"obs", "joints"}),
                                               Key("actions"),
                                               Key("rewards")});  // declaration order
  CHECK(d.get({"obs", "pixels"}).shares_storage_with(b.obs.pixels));
  CHECK(d.get("rewards").shares_storage_with(b.rewards));
  // Writing through the dict writes the struct's fields.
  d.get("rewards").array<float>().setConstant(9.0f);
  CHECK(b.rewards.to_vector<float>() == std::vector<float>(kB, 9.0f));
  CHECK(leaf_count(b) == 4);
  CHECK(leaf_count(d) == 4);
}

TEST_CASE("from_tensordict round-trips and shares storage", "[tensorclass]") {
  const Batch b = make_batch(2.0f);
  const TensorDict d = b.to_tensordict();
  const Batch back = Batch::from_tensordict(d);
  CHECK(back == b);
  CHECK(back.batch_size() == td::Shape{kB});
  CHECK(back.obs.batch_size() == td::Shape{kB});
  CHECK(back.obs.joints.shares_storage_with(b.obs.joints));
  CHECK(back.to_tensordict() == d);

  // A dict built by hand, keys inserted in another order, nested deeper.
  TensorDict e({2});
  e.set("done", Tensor::zeros({2}, DType::Bool));
  e.set({"batch", "rewards"}, Tensor::full<float>({2}, 1.f));
  e.set({"batch", "actions"}, Tensor::full<std::int64_t>({2, 3}, 5));
  e.set({"batch", "obs", "joints"}, Tensor::full<double>({2, 7}, 0.5));
  e.set({"batch", "obs", "pixels"}, Tensor::full<float>({2, 8, 8}, 0.25f));
  const Episode ep = Episode::from_tensordict(e);
  CHECK(ep.batch_size() == td::Shape{2});
  CHECK(ep.batch.obs.pixels.shape() == td::Shape{2, 8, 8});
  CHECK(ep.batch.actions.to_vector<std::int64_t>() == std::vector<std::int64_t>(6, 5));
  CHECK(ep.batch.obs.pixels.shares_storage_with(e.get({"batch", "obs", "pixels"})));
  CHECK(ep.to_tensordict() == e);
  CHECK(ep.to_tensordict().keys() == std::vector<Key>{Key("batch"), Key("done")});
}

TEST_CASE("non-contiguous and sparse fields go through as they are", "[tensorclass]") {
  Batch b = make_batch(1.0f);
  Tensor base =
      Tensor::from_vector<double>({0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13,
                                   14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27},
                                  {7, kB});
  b.obs.joints = base.transpose(0, 1);
  REQUIRE_FALSE(b.obs.joints.is_contiguous());
  TensorDict d = b.to_tensordict();
  CHECK_FALSE(d.get({"obs", "joints"}).is_contiguous());
  CHECK(d.get({"obs", "joints"}).shares_storage_with(base));
  const Batch c = b.clone();
  CHECK(c.obs.joints.is_contiguous());
  CHECK(c == b);

  // zero_() on a sparse field replaces the dict's tensor; the field must follow it.
  Tensor idx = Tensor::from_vector<std::int64_t>({0, 2}, {1, 2});
  b.rewards = Tensor::sparse_coo(idx, Tensor::from_vector<float>({1.f, 2.f}), {kB});
  CHECK(b.rewards.nnz() == 2);
  b.zero_();
  CHECK(b.rewards.nnz() == 0);
  CHECK(b.obs.pixels.to_vector<float>() == std::vector<float>(kB * 6, 0.f));
  CHECK(base.to_vector<double>() == std::vector<double>(28, 0.0));
}

TEST_CASE("from_tensordict errors name the key", "[tensorclass][errors]") {
  const TensorDict good = make_batch(1.0f).to_tensordict();
  {
    TensorDict d = good;
    d.erase({"obs", "pixels"});
    CHECK_THROWS_AS(Batch::from_tensordict(d), td::KeyError);
    CHECK(message_of([&] { (void)Batch::from_tensordict(d); }) ==
          "Batch::from_tensordict: key 'obs.pixels' not found (field Obs::pixels)");
  }
  {
    TensorDict d = good;
    d.erase("rewards");
    CHECK_THROWS_AS(Batch::from_tensordict(d), td::KeyError);
    CHECK_THAT(message_of([&] { (void)Batch::from_tensordict(d); }),
               Catch::Matchers::Contains("'rewards' not found"));
  }
  {
    TensorDict d = good;
    d.set({"obs", "extra"}, Tensor::zeros({kB}, DType::Float32));
    CHECK_THROWS_AS(Batch::from_tensordict(d), td::Error);
    CHECK(message_of([&] { (void)Batch::from_tensordict(d); }) ==
          "Batch::from_tensordict: key 'obs.extra' is not a field of Obs; exclude() it first");
    // the advertised way out
    CHECK(Batch::from_tensordict(d.exclude({Key({"obs", "extra"})})) == make_batch(1.0f));
  }
  {
    TensorDict d = good;
    d.erase("obs");
    d.set("obs", Tensor::zeros({kB}, DType::Float32));
    CHECK_THROWS_AS(Batch::from_tensordict(d), td::Error);
    CHECK_THAT(message_of([&] { (void)Batch::from_tensordict(d); }),
               Catch::Matchers::Contains("key 'obs' holds a tensor, but Batch::obs is a "
                                         "tensorclass (Obs)"));
  }
  {
    TensorDict d = good;
    d.erase("actions");
    d.set({"actions", "x"}, Tensor::zeros({kB}, DType::Float32));
    CHECK_THAT(message_of([&] { (void)Batch::from_tensordict(d); }),
               Catch::Matchers::Contains("key 'actions' holds a sub-dict, but Batch::actions is "
                                         "a td::Tensor"));
  }
}

TEST_CASE("to_tensordict errors name the field", "[tensorclass][errors]") {
  Batch b = make_batch(1.0f);
  b.obs.joints = Tensor();
  CHECK_THROWS_AS(b.to_tensordict(), td::Error);
  const std::string undefined =
      "Batch.to_tensordict: field 'obs.joints' (Obs::joints) is an undefined td::Tensor; assign a "
      "tensor to it first";
  CHECK(message_of([&] { (void)b.to_tensordict(); }) == undefined);
  CHECK(message_of([&] { (void)b.clone(); }) == undefined);
  CHECK(message_of([&] { b.zero_(); }) == undefined);
  CHECK(Batch() == Batch());  // equal() and printing accept undefined fields
  CHECK(b != make_batch(1.0f));

  Batch c = make_batch(1.0f);
  c.obs.pixels = Tensor::zeros({kB + 1, 3, 2}, DType::Float32);
  CHECK_THROWS_AS(c.to_tensordict(), std::invalid_argument);
  CHECK_THAT(message_of([&] { (void)c.to_tensordict(); }),
             Catch::Matchers::StartsWith("Batch.to_tensordict: field 'obs.pixels': ") &&
                 Catch::Matchers::Contains("[4]"));
  // A nested struct with its own batch size must extend its parent's.
  Batch d = make_batch(1.0f);
  d.obs.set_batch_size({kB, 3});
  CHECK_THROWS_AS(d.to_tensordict(), std::invalid_argument);
  d.obs.pixels = Tensor::zeros({kB, 3, 2}, DType::Float32);
  d.obs.joints = Tensor::zeros({kB, 3}, DType::Float64);
  CHECK(d.to_tensordict().get_dict("obs").batch_size() == td::Shape{kB, 3});
}

TEST_CASE("clone, equal, apply", "[tensorclass]") {
  Batch b = make_batch(1.0f);
  b.step = 7;
  Batch c = b.clone();
  CHECK(c == b);
  CHECK(c.step == 7);
  CHECK(c.batch_size() == b.batch_size());
  CHECK_FALSE(c.obs.pixels.shares_storage_with(b.obs.pixels));
  c.obs.pixels.array<float>()[0] = -1.f;
  CHECK(c != b);
  CHECK(b.obs.pixels.to_vector<float>()[0] == 1.f);

  Batch other_size = make_batch(1.0f);
  other_size.set_batch_size({});
  CHECK(other_size != make_batch(1.0f));
  // An inherited batch size equals the same size set explicitly.
  Batch explicit_nested = make_batch(1.0f);
  explicit_nested.obs.set_batch_size({kB});
  CHECK(explicit_nested == make_batch(1.0f));

  const Batch zeros = b.apply([](const Tensor& t) { return Tensor::zeros(t.shape(), t.dtype()); });
  CHECK(zeros.step == 7);
  CHECK(zeros.obs.joints.to_vector<double>() == std::vector<double>(kB * 7, 0.0));
  CHECK(b.obs.joints.to_vector<double>() == std::vector<double>(kB * 7, 2.0));
  // The results may change the batch size (issue 31), but must agree on it.
  const Batch head = b.apply([](const Tensor& t) { return t.slice(0, 0, 2); });
  CHECK(head.batch_size() == td::Shape{2});
  CHECK(head.step == 7);
  CHECK_THROWS_AS(b.apply([](const Tensor& t) {
    return t.dtype() == DType::Int64 ? t.slice(0, 0, 1) : t.slice(0, 0, 2);
  }),
                  std::invalid_argument);
}

TEST_CASE("consolidate rebinds the fields to one storage per dtype", "[tensorclass]") {
  Batch b = make_batch(3.0f);
  const Batch before = b.clone();
  b.consolidate();
  CHECK(b == before);
  CHECK(b.obs.pixels.shares_storage_with(b.rewards));  // both float32
  CHECK_FALSE(b.obs.pixels.shares_storage_with(b.obs.joints));
  TensorDict d = b.to_tensordict();
  CHECK(d.get("rewards").shares_storage_with(b.obs.pixels));
}

TEST_CASE("printing", "[tensorclass]") {
  Batch b = make_batch(1.0f);
  b.obs.joints = Tensor::zeros({7, kB}, DType::Float64).transpose(0, 1);
  b.rewards = Tensor();
  const std::string expected =
      "Batch(\n"
      "    fields={\n"
      "        obs: Obs(\n"
      "            fields={\n"
      "                pixels: Tensor(shape=[4, 3, 2], dtype=float32),\n"
      "                joints: Tensor(shape=[4, 7], dtype=float64, strided),\n"
      "            },\n"
      "            batch_size=[4]),\n"
      "        actions: Tensor(shape=[4], dtype=int64),\n"
      "        rewards: Tensor(undefined),\n"
      "    },\n"
      "    batch_size=[4])";
  CHECK(td::to_string(b) == expected);
  std::ostringstream os;
  os << b;
  CHECK(os.str() == expected);
  CHECK(fmt::format("{}", b) == expected);
  // The layout of TensorDict's printer, with the struct names.
  b.rewards = Tensor::zeros({kB}, DType::Float32);
  std::string as_class = td::to_string(b);
  for (const std::string name : {"Batch(", "Obs("})
    as_class.replace(as_class.find(name), name.size(), "TensorDict(");
  CHECK(as_class == td::to_string(b.to_tensordict()));
}

TEST_CASE("64 fields", "[tensorclass]") {
  Wide w;
  td::TensorDict d;
  for (std::size_t i = 0; i < Wide::field_names().size(); ++i)
    d.set(std::string(Wide::field_names()[i]), Tensor::full<int>({1}, static_cast<int>(i)));
  w = Wide::from_tensordict(d);
  CHECK(w.f00.to_vector<int>()[0] == 0);
  CHECK(w.f63.to_vector<int>()[0] == 63);
  CHECK(w.to_tensordict() == d);
}
