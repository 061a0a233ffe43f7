// CollectiveOptions::compression: float32/float64 buckets of all_reduce and reduce travel as 16-bit
// floats (FP16, BF16); other dtypes travel as they are; the choice is agreed like every option.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"

using td::Compression;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

std::int64_t steps_value(int rank) { return (std::int64_t{1} << 40) + rank; }

// Rank r's dict: the oracle's inputs (reference.hpp: small integers, exact in float16 and
// bfloat16, and so are their sums over the ranks the tests run at) in float32 and float64 leaves
// that compression sends as 16-bit floats, and an int64 leaf that it never compresses, whose
// values (2^40 + r) no 16-bit float holds.
TensorDict exact_dict(int rank, bool with_int = true) {
  TensorDict d;
  d.set({"layer", "w"}, tdtest::make_input<float>(ReduceOp::SUM, rank, {8, 5}, 0));
  d.set({"layer", "b"}, tdtest::make_input<float>(ReduceOp::SUM, rank, {9}, 1));
  d.set("h", tdtest::make_input<double>(ReduceOp::SUM, rank, {17}, 2));
  if (with_int)  // not compressed (and AVG is not defined on it)
    d.set("steps", Tensor::full<std::int64_t>({3}, steps_value(rank)));
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
          // AVG divides before summing: exact when the quotients are (powers of 2 ranks); else
          // within 1% (the 16-bit format's rounding of the quotients and their sum: this test's
          // own bound, the oracle's tolerance being for uncompressed results).
          const double tol = op == ReduceOp::AVG && (size & (size - 1)) != 0 ? 1e-2 : 0.0;
          CHECK(tdtest::reduction_error(d.get({"layer", "w"}), op, size, 0, tol) == "");
          // The int64 leaf is never compressed: 2^40 + r summed exactly.
          if (op == ReduceOp::SUM)
            CHECK(d.get("steps").to_vector<std::int64_t>()[0] ==
                  tdtest::reduce_over<std::int64_t>(ReduceOp::SUM, size, steps_value));
        }
      }
    }
  }
}

// Its own oracle: values that no 16-bit float holds (the oracle's are exact in them by design),
// and the relative error of the whole result, the measure of the format's precision.
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
  if (rank == dst)
    CHECK(tdtest::reduction_error(d.get({"layer", "b"}), ReduceOp::SUM, size, 1) == "");
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
