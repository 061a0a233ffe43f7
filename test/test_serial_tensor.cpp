// Tensor containers: factories, views, formatting (no MPI).
#include <catch2/catch.hpp>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <tensordict/tensordict.hpp>

using td::DType;
using td::Tensor;

TEST_CASE("dtype list: names, sizes and dtype_of agree", "[dtype]") {
  CHECK(td::name(DType::Float32) == "float32");
  CHECK(td::name(DType::BFloat16) == "bfloat16");
  CHECK(td::name(DType::Complex128) == "complex128");
  CHECK(td::itemsize(DType::Bool) == 1);
  CHECK(td::itemsize(DType::Float16) == 2);
  CHECK(td::itemsize(DType::Int64) == 8);
  CHECK(td::itemsize(DType::Complex128) == 16);
  CHECK(td::dtype_of<float> == DType::Float32);
  CHECK(td::dtype_of<std::int16_t> == DType::Int16);
  CHECK(td::dtype_of<Eigen::half> == DType::Float16);
  CHECK(td::kNumDTypes == 12);
  // the enum's numeric values are part of the wire format
  CHECK(static_cast<int>(DType::Bool) == 0);
  CHECK(static_cast<int>(DType::Complex128) == 11);
}

TEST_CASE("every dtype's factories fill and read back", "[tensor]") {
  for (std::size_t i = 0; i < td::kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    INFO(td::name(d));
    Tensor z = Tensor::zeros({2, 3}, d);
    CHECK(z.dtype() == d);
    CHECK(z.numel() == 6);
    CHECK(z.nbytes() == 6 * td::itemsize(d));
    CHECK(z.is_contiguous());
    td::visit(d, [&](auto tag) {
      using T = typename decltype(tag)::type;
      for (const auto& v : z.to_vector<T>()) CHECK(v == T(0));
      Tensor f = Tensor::full<T>({4}, T(1));
      for (const auto& v : f.to_vector<T>()) CHECK(v == T(1));
      using Other = std::conditional_t<std::is_same_v<T, double>, float, double>;
      CHECK_THROWS_AS(f.data<Other>(), td::Error);
    });
  }
}

TEST_CASE("from_vector keeps row-major order and checks the count", "[tensor]") {
  Tensor t = Tensor::from_vector<std::int64_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(t.shape() == td::Shape{2, 3});
  CHECK(t.strides() == td::Shape{3, 1});
  CHECK(t.to_vector<std::int64_t>() == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6});
  CHECK_THROWS_AS(Tensor::from_vector<float>({1, 2, 3}, {2, 2}), std::invalid_argument);
  Tensor b = Tensor::from_vector<bool>({true, false, true});
  CHECK(b.to_vector<bool>() == std::vector<bool>{true, false, true});
}

TEST_CASE("views: transpose and slice share storage and read the right values", "[tensor]") {
  Tensor t = Tensor::from_vector<int>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  Tensor tt = t.transpose(0, 1);
  CHECK(tt.shape() == td::Shape{4, 3});
  CHECK_FALSE(tt.is_contiguous());
  CHECK(tt.shares_storage_with(t));
  CHECK(tt.to_vector<int>() == std::vector<int>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  Tensor s = t.slice(1, 1, 4, 2);  // columns 1 and 3
  CHECK(s.shape() == td::Shape{3, 2});
  CHECK(s.to_vector<int>() == std::vector<int>{1, 3, 5, 7, 9, 11});
  Tensor rows = t.slice(0, 1, 3);
  CHECK(rows.is_contiguous());
  CHECK(rows.to_vector<int>() == std::vector<int>{4, 5, 6, 7, 8, 9, 10, 11});
  // writes through a view land in the base
  s.copy_(Tensor::zeros({3, 2}, DType::Int32));
  CHECK(t.to_vector<int>() == std::vector<int>{0, 0, 2, 0, 4, 0, 6, 0, 8, 0, 10, 0});
  Tensor c = tt.contiguous();
  CHECK(c.is_contiguous());
  CHECK_FALSE(c.shares_storage_with(t));
  CHECK(c.to_vector<int>() == tt.to_vector<int>());
  CHECK(t.slice(0, -1, 100).to_vector<int>() == std::vector<int>{8, 0, 10, 0});
  CHECK_THROWS_AS(t.transpose(0, 2), std::invalid_argument);
}

TEST_CASE("clone is deep, copies are shallow", "[tensor]") {
  Tensor a = Tensor::full<float>({3}, 1.f);
  Tensor shallow = a;
  Tensor deep = a.clone();
  a.data<float>()[0] = 5.f;
  CHECK(shallow.to_vector<float>()[0] == 5.f);
  CHECK(deep.to_vector<float>()[0] == 1.f);
}

// The defect this guards against: copy_ wrote the destination while it still read an
// overlapping source, so a transpose copied into its own base came out [[1, 3], [3, 4]] and a
// shifted slice went through memcpy on overlapping memory.
TEST_CASE("copy_ from a view of the same storage reads the source's values first", "[tensor]") {
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  a.copy_(a.transpose(0, 1));
  CHECK(a.to_vector<float>() == std::vector<float>{1, 3, 2, 4});

  std::vector<std::int64_t> values(10);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<std::int64_t>(i);
  Tensor up = Tensor::from_vector<std::int64_t>(values);
  up.slice(0, 1, 10).copy_(up.slice(0, 0, 9));  // shift right by one
  CHECK(up.to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 0, 1, 2, 3, 4, 5, 6, 7, 8});
  Tensor down = Tensor::from_vector<std::int64_t>(values);
  down.slice(0, 0, 9).copy_(down.slice(0, 1, 10));  // shift left by one
  CHECK(down.to_vector<std::int64_t>() == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 9});

  // Interleaved views of one storage that do not overlap: copied directly, as before.
  Tensor even_odd = Tensor::from_vector<double>({0, 1, 2, 3, 4, 5});
  even_odd.slice(0, 0, 6, 2).copy_(even_odd.slice(0, 1, 6, 2));
  CHECK(even_odd.to_vector<double>() == std::vector<double>{1, 1, 3, 3, 5, 5});

  Tensor same = Tensor::from_vector<float>({7, 8});
  same.copy_(same);  // the same view: nothing to do
  CHECK(same.to_vector<float>() == std::vector<float>{7, 8});
}

TEST_CASE("Eigen views do math on contiguous tensors", "[tensor]") {
  Tensor a = Tensor::from_vector<double>({1, 2, 3, 4}, {2, 2});
  a.array<double>() *= 2.0;
  CHECK(a.to_vector<double>() == std::vector<double>{2, 4, 6, 8});
  auto m = a.matrix<double>();
  CHECK(m(1, 0) == 6.0);
  CHECK_THROWS_AS(a.transpose(0, 1).array<double>(), td::Error);
}

TEST_CASE("printing matches torch", "[tensor][format]") {
  CHECK(td::to_string(Tensor::from_vector<std::int64_t>({2, 4, 6, 8, 10})) ==
        "tensor([2, 4, 6, 8, 10])");
  CHECK(fmt::format("{}", Tensor::full<float>({3}, 1.f)) == "tensor([1., 1., 1.])");
  CHECK(td::to_string(Tensor::from_vector<float>({1.5f, 2.f})) == "tensor([1.5000, 2.0000])");
  CHECK(td::to_string(Tensor::from_vector<std::int64_t>({1, 10})) == "tensor([1, 10])");
  CHECK(td::to_string(Tensor::from_vector<std::int32_t>({1, 2})) ==
        "tensor([1, 2], dtype=torch.int32)");
  CHECK(td::to_string(Tensor::from_vector<double>({1, 2})) ==
        "tensor([1., 2.], dtype=torch.float64)");
  CHECK(td::to_string(Tensor::from_vector<bool>({true, false})) == "tensor([True, False])");
  CHECK(td::to_string(Tensor::from_vector<std::int64_t>({1, 2, 3, 4}, {2, 2})) ==
        "tensor([[1, 2],\n        [3, 4]])");
  CHECK(td::to_string(Tensor::from_vector<std::int64_t>({1, 20, 3, 4}, {2, 2})) ==
        "tensor([[ 1, 20],\n        [ 3,  4]])");
  CHECK(td::to_string(Tensor::full<std::int64_t>({}, 5)) == "tensor(5)");
  CHECK(td::to_string(Tensor::zeros({0}, DType::Float32)) == "tensor([])");
  CHECK(td::to_string(Tensor::zeros({0}, DType::Int64)) == "tensor([], dtype=torch.int64)");
  CHECK(td::to_string(Tensor::full<Eigen::half>({2}, Eigen::half(0.5f))) ==
        "tensor([0.5000, 0.5000], dtype=torch.float16)");
  CHECK(td::to_string(Tensor::from_vector<float>({1e-5f, 1.f})) ==
        "tensor([1.0000e-05, 1.0000e+00])");
  // every dtype prints without throwing
  for (std::size_t i = 0; i < td::kNumDTypes; ++i) {
    std::ostringstream os;
    os << Tensor::zeros({2}, static_cast<DType>(i));
    CHECK(os.str().rfind("tensor([", 0) == 0);
  }
  // a transposed view prints its logical order
  CHECK(td::to_string(Tensor::from_vector<std::int64_t>({1, 2, 3, 4}, {2, 2}).transpose(0, 1)) ==
        "tensor([[1, 3],\n        [2, 4]])");
  std::string big = td::to_string(Tensor::zeros({2000}, DType::Int64));
  CHECK(big == "tensor([0, 0, 0,  ..., 0, 0, 0])");
}

TEST_CASE("sparse COO: densify and coalesce", "[tensor][sparse]") {
  Tensor idx = Tensor::from_vector<std::int64_t>({0, 2, 0, 1, 0, 1}, {2, 3});
  Tensor val = Tensor::from_vector<float>({1, 2, 3});
  Tensor s = Tensor::sparse_coo(idx, val, {3, 2});
  CHECK(s.is_sparse());
  CHECK(s.nnz() == 3);
  CHECK(s.to_dense().to_vector<float>() == std::vector<float>{0, 4, 0, 0, 2, 0});
  Tensor c = s.coalesce();
  CHECK(c.is_coalesced());
  CHECK(c.nnz() == 2);
  CHECK(c.to_dense().equal(s.to_dense()));
  CHECK_THROWS_AS(Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({5, 0}, {2, 1}),
                                     Tensor::from_vector<float>({1}), {3, 2}),
                  std::invalid_argument);
}

#if defined(__linux__)
#include <fstream>

#include "support/smaps.hpp"

using tdtest::vm_flags_of;

// Storages of 2 MiB or more start on a 2 MiB boundary and are advised for transparent huge pages
// (shared-memory MPI pins every page per call: 2x faster with huge pages here).
TEST_CASE("large storages are 2 MiB aligned and advised for huge pages", "[tensor][hugepages]") {
  const char* setting = std::getenv("TD_HUGEPAGES");
  if (setting != nullptr && std::string(setting) == "0") return;
  Tensor big = Tensor::zeros({1 << 20}, td::DType::Float32);  // 4 MiB
  CHECK(reinterpret_cast<std::uintptr_t>(big.raw_data()) % (std::size_t{2} << 20) == 0);
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  if (thp) {  // a kernel with THP: the advice is recorded on the mapping ("hg")
    const std::string flags = vm_flags_of(big.raw_data());
    INFO(flags);
    CHECK(flags.find(" hg") != std::string::npos);
  }
  Tensor small = Tensor::zeros({1000}, td::DType::Float32);
  CHECK(reinterpret_cast<std::uintptr_t>(small.raw_data()) % 64 == 0);
}
#endif

TEST_CASE("shapes whose element count or byte size overflows are rejected", "[tensor]") {
  const td::Shape huge{1LL << 32, 1LL << 32};  // 2^64 elements: the product wraps to 0
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no std::invalid_argument");
  };
  CHECK_THAT(message([&] { Tensor::zeros(huge, DType::Float32); }),
             Catch::Matchers::Contains("[4294967296, 4294967296]"));
  CHECK_THROWS_AS(Tensor::empty(huge, DType::Int8), std::invalid_argument);
  CHECK_THROWS_AS(Tensor::full<float>(huge, 1.f), std::invalid_argument);
  CHECK_THROWS_AS(Tensor::from_vector<float>({1.f}, huge), std::invalid_argument);
  CHECK_THROWS_AS(Tensor::empty({1LL << 62, 4}, DType::Int8), std::invalid_argument);
  CHECK_THROWS_AS(Tensor::empty({3, 1LL << 62}, DType::Int8), std::invalid_argument);
  // the element count fits, the bytes do not
  CHECK_THAT(message([&] { Tensor::empty({1LL << 61}, DType::Float64); }),
             Catch::Matchers::Contains("[2305843009213693952]"));
  CHECK_THROWS_AS(Tensor::empty({INT64_MAX}, DType::Int16), std::invalid_argument);
  // negative sizes
  CHECK_THAT(message([&] {
               Tensor::zeros({2, -3}, DType::Float32);
             }),
             Catch::Matchers::Contains("[2, -3]"));
  // a size 0 does not hide an overflow of the other sizes (the strides would overflow)
  CHECK_THROWS_AS(Tensor::empty({0, 1LL << 32, 1LL << 32}, DType::Float32), std::invalid_argument);
  CHECK(Tensor::empty({0, 1LL << 20, 1LL << 20}, DType::Float32).numel() == 0);
  // views and sparse shapes
  Tensor t = Tensor::zeros({4}, DType::Float32);
  CHECK_THAT(message([&] {
               t.view({1LL << 32, 1LL << 32, 0, -1});
             }),
             Catch::Matchers::Contains("[4294967296, 4294967296, 0, -1]"));
  CHECK_THROWS_AS(t.view({1LL << 32, 1LL << 32}), std::invalid_argument);
  CHECK_THROWS_AS(t.view({-1, -2}), std::invalid_argument);
  CHECK_THROWS_AS(t.view({-1, -1}), std::invalid_argument);
  CHECK(t.view({2, -1}).shape() == td::Shape{2, 2});
  CHECK(Tensor::zeros({0}, DType::Float32).view({-1}).shape() == td::Shape{0});
  CHECK_THROWS_AS(Tensor::sparse_coo(Tensor::zeros({2, 0}, DType::Int64),
                                     Tensor::zeros({0}, DType::Float32), huge),
                  std::invalid_argument);
  CHECK_THROWS_AS(td::TensorDict(huge), std::invalid_argument);
}

TEST_CASE("item() reads the one element of a single-element tensor", "[tensor]") {
  CHECK(Tensor::full<std::int64_t>({}, 5).item<std::int64_t>() == 5);
  CHECK(Tensor::full<float>({1, 1, 1}, 2.5f).item<float>() == 2.5f);
  const Tensor m = Tensor::from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(m.slice(0, 1, 2).slice(1, 2, 3).item<double>() == 6.0);  // a strided view
  CHECK(Tensor::from_vector<bool>({true}).item<bool>());
  CHECK(Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({0, 0}, {1, 2}),
                           Tensor::from_vector<float>({1, 2}), {1})
            .item<float>() == 3.f);
  CHECK_THAT(
      [&] {
        try {
          (void)m.item<double>();
        } catch (const std::invalid_argument& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      Catch::Matchers::Contains("[2, 3]"));
  CHECK_THROWS_AS(Tensor::zeros({0}, DType::Float32).item<float>(), std::invalid_argument);
  CHECK_THROWS_AS(Tensor::full<float>({}, 1.f).item<double>(), td::Error);
}

TEST_CASE("Eigen maps of a const tensor are read-only", "[tensor]") {
  td::TensorDict d;
  d.set("w", Tensor::from_vector<float>({3, 0, 0, 4}, {2, 2}));
  const td::TensorDict& cd = d;
  const Tensor& t = cd.get("w");
  CHECK(t.matrix<float>().norm() == Approx(5.0));
  CHECK(t.array<float>().sum() == 7.f);
  static_assert(
      std::is_same_v<
          decltype(t.matrix<float>()),
          Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>>);
  static_assert(std::is_same_v<decltype(t.array<float>()),
                               Eigen::Map<const Eigen::Array<float, Eigen::Dynamic, 1>>>);
  static_assert(!std::is_assignable_v<decltype(t.array<float>()(0)), float>);
  static_assert(!std::is_assignable_v<decltype(t.matrix<float>()(0, 0)), float>);
  // the non-const maps still write
  Tensor& w = d.get("w");
  w.matrix<float>()(0, 1) = 1.f;
  w.array<float>() += 1.f;
  CHECK(t.to_vector<float>() == std::vector<float>{4, 2, 1, 5});
  CHECK_THROWS_AS(t.transpose(0, 1).matrix<float>(), td::Error);
  CHECK_THROWS_AS(Tensor::zeros({3}, DType::Float32).matrix<float>(), td::Error);
  const Tensor v = Tensor::zeros({3}, DType::Float32);
  CHECK_THROWS_AS(v.matrix<float>(), td::Error);
  CHECK_THROWS_AS(v.array<double>(), td::Error);
}
