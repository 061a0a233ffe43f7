// The transport metadata (src/comm/dict_wire.*) without MPI: encode / decode round trips, the
// streams a dict packs into and is rebuilt from, and the decoder's rejection of truncated,
// corrupted and hostile input. The library keeps these functions internal: a white-box test,
// linked with the library's objects (test/internal, CMakeLists.txt).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/dict_wire.hpp"

using td::DType;
using td::Key;
using td::Tensor;
using td::TensorDict;
using td::detail::DictLayout;

namespace {

TensorDict sample() {
  TensorDict d;
  d.set("scalar", Tensor::full<double>({}, 2.5));
  TensorDict b(td::Shape{3});
  b.set({"w", "float"}, Tensor::full<float>({3, 2}, 1.5F));
  b.set({"w", "int"}, Tensor::from_vector<std::int64_t>({1, 2, 3}));
  b.set("half", Tensor::full<Eigen::half>({3}, Eigen::half(0.5F)));
  b.set("strided", Tensor::full<float>({4, 3}, 2.0F).transpose(0, 1));
  b.set("empty", Tensor::empty({3, 0}, DType::Int32));
  b.set("sparse", Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({0, 2, 1, 0}, {2, 2}),
                                     Tensor::from_vector<float>({7, 8}), {3, 2}));
  b.set("nothing", TensorDict(td::Shape{3, 1}));
  d.set("batched", std::move(b));
  return d;
}

std::vector<std::byte> encoded(const TensorDict& d) {
  std::vector<Tensor> tensors;
  return td::detail::encode_layout(td::detail::describe_dict(d, tensors));
}

// The dict rebuilt from `d`'s streams, as a receiver would.
TensorDict round_trip(const TensorDict& d) {
  std::vector<Tensor> tensors;
  const DictLayout sent = td::detail::describe_dict(d, tensors);
  const DictLayout got = td::detail::decode_layout(td::detail::encode_layout(sent));
  std::array<Tensor, td::kNumDTypes> streams;
  for (std::size_t k = 0; k < td::kNumDTypes; ++k) {
    if (got.stream_elems[k] == 0) continue;
    streams[k] =
        Tensor::empty({static_cast<std::int64_t>(got.stream_elems[k])}, static_cast<DType>(k));
    td::detail::pack_stream(sent, tensors, static_cast<DType>(k), streams[k]);
  }
  return td::detail::materialize(got, streams);
}

void put_u32(std::vector<std::byte>& b, std::size_t at, std::uint32_t v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}

}  // namespace

TEST_CASE("a dict survives encode, decode, pack and materialize", "[dict_wire]") {
  const TensorDict d = sample();
  const TensorDict back = round_trip(d);
  CHECK(back.equal(d));
  CHECK(back.is_consolidated());
  CHECK(back.get_dict("batched").get_dict("nothing").batch_size() == td::Shape{3, 1});
  CHECK(back.get({"batched", "sparse"}).is_sparse());
  // Insertion order is kept; data go in canonical order.
  CHECK(back.get_dict("batched").keys().front() == Key("w"));
  CHECK(round_trip(TensorDict()).keys().empty());
}

TEST_CASE("the encoding is deterministic and its header carries the version", "[dict_wire]") {
  const auto a = encoded(sample()), b = encoded(sample());
  CHECK(a == b);
  REQUIRE(a.size() > 4);
  CHECK(std::to_integer<int>(a[3]) == td::detail::kWireMagic[3]);
}

TEST_CASE("a consolidated dict's streams are sent in place", "[dict_wire]") {
  TensorDict d = sample();
  std::vector<Tensor> tensors;
  DictLayout l = td::detail::describe_dict(d, tensors);
  CHECK(td::detail::stream_in_place(l, tensors, DType::Float32) == nullptr);  // strided leaf
  d.consolidate();
  l = td::detail::describe_dict(d, tensors);
  CHECK(td::detail::stream_in_place(l, tensors, DType::Float16) != nullptr);
  CHECK(td::detail::stream_in_place(l, tensors, DType::Float64) != nullptr);
  // Sparse values and indices share the float32 / int64 streams: those are packed.
  CHECK(td::detail::stream_in_place(l, tensors, DType::Int64) == nullptr);
}

TEST_CASE("the decoder rejects every truncation and trailing bytes", "[dict_wire][errors]") {
  const auto good = encoded(sample());
  for (std::size_t n = 0; n < good.size(); ++n)
    CHECK_THROWS_AS(td::detail::decode_layout(std::span(good).first(n)), td::Error);
  auto longer = good;
  longer.push_back(std::byte{0});
  CHECK_THROWS_WITH(td::detail::decode_layout(longer), Catch::Contains("trailing"));
}

TEST_CASE("the decoder rejects corrupted and hostile metadata", "[dict_wire][errors]") {
  const auto good = encoded(sample());
  auto bad = good;
  bad[0] = std::byte{'X'};
  CHECK_THROWS_WITH(td::detail::decode_layout(bad), Catch::Contains("magic"));
  bad = good;
  bad[3] = std::byte{2};
  CHECK_THROWS_WITH(td::detail::decode_layout(bad), Catch::Contains("version 2"));

  // Hand-built: magic, an empty root batch size, then one entry.
  auto one_entry = [](std::uint8_t kind, std::vector<std::uint8_t> tail) {
    std::vector<std::byte> b;
    for (const auto m : td::detail::kWireMagic) b.push_back(std::byte{m});
    b.push_back(std::byte{0});  // root batch: 0 dims
    b.resize(b.size() + 4);
    put_u32(b, b.size() - 4, 1);                                              // one entry
    for (const std::uint8_t c : {1, 0, int{'k'}}) b.push_back(std::byte{c});  // name "k"
    b.push_back(std::byte{kind});
    for (const auto c : tail) b.push_back(std::byte{c});
    return b;
  };
  auto i64 = [](std::int64_t v) {
    std::vector<std::uint8_t> out(8);
    std::memcpy(out.data(), &v, 8);
    return out;
  };
  auto cat = [](std::vector<std::uint8_t> a, const std::vector<std::uint8_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  CHECK_NOTHROW(td::detail::decode_layout(one_entry(1, cat({8, 1}, i64(4)))));  // float32 [4]
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(1, cat({40, 1}, i64(4)))),
                    Catch::Contains("unknown dtype"));
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(7, {0, 0, 0, 0, 0, 0})),
                    Catch::Contains("entry kind"));
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(1, cat({8, 1}, i64(-4)))),
                    Catch::Contains("negative dimension"));
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(1, cat({8, 1}, i64(INT64_MAX)))),
                    Catch::Contains("too many elements"));
  CHECK_THROWS_WITH(
      td::detail::decode_layout(one_entry(1, cat(cat({8, 2}, i64(1LL << 30)), i64(1LL << 30)))),
      Catch::Contains("too many elements"));
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(1, {8, 200})),
                    Catch::Contains("dimensions"));
  CHECK_THROWS_WITH(td::detail::decode_layout(one_entry(2, cat(cat({8, 1}, i64(4)), i64(-1)))),
                    Catch::Contains("negative nonzero"));
  // Many leaves whose sizes each pass but whose sum overflows the stream limit.
  {
    std::vector<std::byte> b;
    for (const auto m : td::detail::kWireMagic) b.push_back(std::byte{m});
    b.push_back(std::byte{0});
    b.resize(b.size() + 4);
    put_u32(b, b.size() - 4, 40);
    for (int i = 0; i < 40; ++i) {
      // Name: two letters, unique per leaf.
      for (const int c : {2, 0, int{'a'} + i / 26, int{'a'} + i % 26})
        b.push_back(static_cast<std::byte>(c));
      for (const auto c : cat({1, 0, 1}, i64(1LL << 47))) b.push_back(std::byte{c});  // uint8
    }
    CHECK_THROWS_WITH(td::detail::decode_layout(b), Catch::Contains("exceeds"));
  }
  // An entry count beyond what the bytes can hold is refused before any allocation.
  bad = one_entry(1, cat({8, 1}, i64(4)));
  put_u32(bad, 5, 0xffffffffU);
  CHECK_THROWS_WITH(td::detail::decode_layout(bad), Catch::Contains("entries claimed"));
  // Two entries with one name; an empty name.
  {
    TensorDict d;
    d.set("a", Tensor::full<float>({1}, 1.0F));
    d.set("b", Tensor::full<float>({1}, 1.0F));
    auto b = encoded(d);
    const auto pos = std::find(b.begin() + 9, b.end(), std::byte{'b'});
    *pos = std::byte{'a'};
    CHECK_THROWS_WITH(td::detail::decode_layout(b), Catch::Contains("appears twice"));
    b = one_entry(1, cat({8, 1}, i64(4)));
    b[9] = std::byte{0};  // name length 0, then "k" is read as the kind
    CHECK_THROWS_AS(td::detail::decode_layout(b), td::Error);
  }
  // A leaf whose shape does not start with its dict's batch size.
  {
    std::vector<std::byte> b;
    for (const auto m : td::detail::kWireMagic) b.push_back(std::byte{m});
    b.push_back(std::byte{1});
    for (const auto c : i64(3)) b.push_back(std::byte{c});
    b.resize(b.size() + 4);
    put_u32(b, b.size() - 4, 1);
    for (const auto c : cat({1, 0, 'k', 1, 8, 1}, i64(4))) b.push_back(std::byte{c});
    CHECK_THROWS_WITH(td::detail::decode_layout(b), Catch::Contains("does not start with"));
  }
  // Nesting deeper than the limit (no stack overflow).
  {
    std::vector<std::byte> b;
    for (const auto m : td::detail::kWireMagic) b.push_back(std::byte{m});
    for (int depth = 0; depth < 10000; ++depth) {
      b.push_back(std::byte{0});
      b.resize(b.size() + 4);
      put_u32(b, b.size() - 4, 1);
      for (const std::uint8_t c : {1, 0, int{'d'}, 0}) b.push_back(std::byte{c});
    }
    CHECK_THROWS_WITH(td::detail::decode_layout(b), Catch::Contains("nested"));
  }
}

TEST_CASE("random corruption never crashes the decoder", "[dict_wire][errors]") {
  const auto good = encoded(sample());
  std::mt19937 rng(12345);
  for (int round = 0; round < 5000; ++round) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<std::byte>(rng() & 0xff);
    try {
      const DictLayout l = td::detail::decode_layout(b);
      CHECK(l.dicts.size() >= 1);
    } catch (const td::Error&) {
    }
  }
}

TEST_CASE("materialize rejects data that contradicts the layout", "[dict_wire][errors]") {
  const TensorDict d = sample();
  std::vector<Tensor> tensors;
  const DictLayout l = td::detail::describe_dict(d, tensors);
  std::array<Tensor, td::kNumDTypes> streams;  // nothing received
  CHECK_THROWS_WITH(td::detail::materialize(l, streams), Catch::Contains("elements received"));
  // A sparse index out of range (a hostile sender's data).
  for (std::size_t k = 0; k < td::kNumDTypes; ++k) {
    if (l.stream_elems[k] == 0) continue;
    streams[k] =
        Tensor::zeros({static_cast<std::int64_t>(l.stream_elems[k])}, static_cast<DType>(k));
    td::detail::pack_stream(l, tensors, static_cast<DType>(k), streams[k]);
  }
  const auto i64 = static_cast<std::size_t>(DType::Int64);
  std::int64_t* p = streams[i64].data<std::int64_t>();
  for (std::int64_t i = 0; i < streams[i64].numel(); ++i) p[i] = 1000;
  CHECK_THROWS_AS(td::detail::materialize(l, streams), td::Error);
}
