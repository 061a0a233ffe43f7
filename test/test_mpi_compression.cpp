// CollectiveOptions::compression: float32/float64 buckets of all_reduce and reduce travel as 16-bit
// floats (FP16, BF16); other dtypes travel as they are; the choice is agreed like every option.
#include <catch2/catch.hpp>

#include <cmath>
#include <stdexcept>
#include <vector>

#include <tensordict/tensordict.hpp>

using td::Compression;
using td::DType;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

// Element i of rank r's leaf: small integers times a power of two, exact in float16 and
// bfloat16 (at most 8 significant bits) and in their sums over 4 ranks.
float exact_value(int r, std::int64_t i) {
  return static_cast<float>((r + 1) * (1 + i % 7)) * 0.25f;
}

TensorDict exact_dict(int rank, bool with_int = true) {
  TensorDict d;
  std::vector<float> f(40), g(9);
  std::vector<double> h(17);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = exact_value(rank, static_cast<std::int64_t>(i));
  for (std::size_t i = 0; i < g.size(); ++i)
    g[i] = exact_value(rank, static_cast<std::int64_t>(i + 3));
  for (std::size_t i = 0; i < h.size(); ++i)
    h[i] = exact_value(rank, static_cast<std::int64_t>(i + 5));
  d.set({"layer", "w"}, Tensor::from_vector<float>(f, {8, 5}));
  d.set({"layer", "b"}, Tensor::from_vector<float>(g));
  d.set("h", Tensor::from_vector<double>(h));
  if (with_int)  // not compressed (and AVG is not defined on it)
    d.set("steps", Tensor::full<std::int64_t>({3}, (std::int64_t{1} << 40) + rank));
  return d;
}

}  // namespace

TEST_CASE("compressed all_reduce: exact values arrive exactly, sync and async, any bucket",
          "[compression]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  for (const Compression c : {Compression::FP16, Compression::BF16}) {
    for (const ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      for (const bool async : {false, true}) {
        for (const std::optional<std::size_t> cap :
             {std::optional<std::size_t>{}, std::optional<std::size_t>{64},
              std::optional<std::size_t>{td::kAutoBucketBytes}}) {
          TensorDict d = exact_dict(rank, op == ReduceOp::SUM);
          td::CollectiveOptions opts;
          opts.async_op = async;
          opts.bucket_bytes = cap;
          opts.compression = c;
          auto works = d.all_reduce(op, opts);
          td::wait_all(works);
          INFO(td::name(c) << " " << td::name(op) << " async " << async);
          const auto w = d.get({"layer", "w"}).to_vector<float>();
          for (std::size_t i = 0; i < w.size(); ++i) {
            double want = 0;
            for (int r = 0; r < size; ++r) want += exact_value(r, static_cast<std::int64_t>(i));
            if (op == ReduceOp::AVG) want /= size;
            // AVG divides before summing: exact when the quotients are (powers of 2 ranks).
            const double tol = op == ReduceOp::AVG && (size & (size - 1)) != 0 ? 1e-2 * want : 0;
            CHECK(std::abs(w[i] - want) <= tol);
          }
          // The int64 leaf is never compressed: 2^40 + r summed exactly.
          if (op == ReduceOp::SUM) {
            std::int64_t want_steps = 0;
            for (int r = 0; r < size; ++r) want_steps += (std::int64_t{1} << 40) + r;
            CHECK(d.get("steps").to_vector<std::int64_t>()[0] == want_steps);
          }
        }
      }
    }
  }
}

TEST_CASE("compressed all_reduce of ordinary values: relative error of the 16-bit format",
          "[compression]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(rank)) * 3.f;
  for (const auto& [c, bound] :
       {std::pair{Compression::FP16, 2e-3}, std::pair{Compression::BF16, 2e-2}}) {
    Tensor t = Tensor::from_vector<float>(v);
    td::CollectiveOptions opts;
    opts.compression = c;
    td::all_reduce(t, ReduceOp::AVG, opts);
    const auto got = t.to_vector<float>();
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      double want = 0;
      for (int r = 0; r < size; ++r)
        want += std::sin(0.37 * static_cast<double>(i) + r) * 3.0 / size;
      err += (got[i] - want) * (got[i] - want);
      norm += want * want;
    }
    INFO(td::name(c) << ": relative error " << std::sqrt(err / norm));
    CHECK(std::sqrt(err / norm) < bound);
  }
}

TEST_CASE("compressed reduce delivers to dst", "[compression]") {
  const int rank = td::get_rank();
  const int size = td::get_world_size();
  const int dst = size - 1;
  TensorDict d = exact_dict(rank);
  td::CollectiveOptions opts;
  opts.compression = Compression::BF16;
  opts.bucket_bytes = td::kAutoBucketBytes;
  d.reduce(dst, ReduceOp::SUM, opts);
  if (rank == dst) {
    const auto b = d.get({"layer", "b"}).to_vector<float>();
    double want = 0;
    for (int r = 0; r < size; ++r) want += exact_value(r, 3);
    CHECK(b[0] == static_cast<float>(want));
  }
}

TEST_CASE("compression: bad uses and differing choices are errors on every rank", "[compression]") {
  const int rank = td::get_rank();
  TensorDict d = exact_dict(rank);
  td::CollectiveOptions opts;
  opts.compression = Compression::FP16;
  CHECK_THROWS_AS(d.broadcast(0, opts), std::invalid_argument);
  CHECK_THROWS_AS(d.all_reduce(ReduceOp::MAX, opts), std::invalid_argument);
  if (td::get_world_size() > 1) {
    td::CollectiveOptions mixed;
    mixed.compression = rank == 0 ? Compression::FP16 : Compression::None;
    try {
      d.all_reduce(ReduceOp::SUM, mixed);
      FAIL("expected a LayoutMismatchError");
    } catch (const td::LayoutMismatchError& e) {
      CHECK_THAT(e.what(), Catch::Contains("compression=FP16"));
    }
  }
  // Nothing changed, and the group still works.
  TensorDict fresh = exact_dict(rank);
  CHECK(d.get("h").to_vector<double>() == fresh.get("h").to_vector<double>());
  Tensor t = Tensor::full<float>({2}, 1.f);
  td::all_reduce(t);
  CHECK(t.to_vector<float>()[0] == static_cast<float>(td::get_world_size()));
}
