// Sparse COO leaves in collectives: gathered and coalesced, equal densified to the dense result.
#include <catch2/catch.hpp>

#include <tensordict/tensordict.hpp>

#include "support/reference.hpp"

using td::DType;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;

namespace {

// Rank r's embedding gradient over a [10, 3] table: rows {r, r+1, 7} (overlapping across ranks),
// none at all on rank 2.
Tensor sparse_grad(int rank) {
  if (rank == 2)
    return Tensor::sparse_coo(Tensor::zeros({2, 0}, DType::Int64),
                              Tensor::zeros({0}, DType::Float32), {10, 3});
  std::vector<std::int64_t> rows, cols;
  std::vector<float> vals;
  for (std::int64_t row : {std::int64_t{rank}, std::int64_t{rank + 1}, std::int64_t{7}})
    for (std::int64_t c = 0; c < 3; ++c) {
      rows.push_back(row % 10);
      cols.push_back(c);
      vals.push_back(static_cast<float>(rank + 1 + c));
    }
  std::vector<std::int64_t> idx = rows;
  idx.insert(idx.end(), cols.begin(), cols.end());
  const auto nnz = static_cast<std::int64_t>(vals.size());
  return Tensor::sparse_coo(Tensor::from_vector<std::int64_t>(idx, {2, nnz}),
                            Tensor::from_vector<float>(vals), {10, 3});
}

// The reduction over the ranks of their gradients, densified (the oracle's reduce_tensors).
Tensor dense_reduced(ReduceOp op, int size) {
  return tdtest::reduce_tensors(op, size, [](int r) { return sparse_grad(r).to_dense(); });
}

}  // namespace

TEST_CASE("sparse leaves next to dense ones: all_reduce SUM and AVG, bucketed or not", "[sparse]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  for (std::optional<std::size_t> cap :
       {std::optional<std::size_t>{}, std::optional<std::size_t>{64}}) {
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
      for (bool async : {false, true}) {
        TensorDict d;
        d.set({"emb", "grad"}, sparse_grad(rank));
        d.set({"emb", "dense"}, Tensor::full<float>({4}, 1.f));
        d.set("w", Tensor::full<float>({5}, 2.f));
        auto works = d.all_reduce(op, {.async_op = async, .bucket_bytes = cap});
        td::wait_all(works);
        const Tensor& g = d.get({"emb", "grad"});
        REQUIRE(g.is_sparse());
        CHECK(g.is_coalesced());
        CHECK(g.to_dense().equal(dense_reduced(op, size)));
        CHECK(d.get("w").to_vector<float>() ==
              std::vector<float>(5, op == ReduceOp::AVG ? 2.f : 2.f * static_cast<float>(size)));
      }
    }
  }
}

TEST_CASE("sparse reduce to dst and broadcast from src", "[sparse]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  const int root = size - 1;
  Tensor t = sparse_grad(rank);
  td::reduce(t, root);
  if (rank == root) CHECK(t.to_dense().equal(dense_reduced(ReduceOp::SUM, size)));
  Tensor b = sparse_grad(rank);
  td::broadcast(b, root);
  CHECK(b.to_dense().equal(sparse_grad(root).to_dense()));
}

TEST_CASE("disjoint indices: the union, nothing summed", "[sparse]") {
  const int rank = td::get_rank(), size = td::get_world_size();
  Tensor t = Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({rank}, {1, 1}),
                                Tensor::from_vector<double>({1.5}), {size});
  td::all_reduce(t);
  CHECK(t.nnz() == size);
  CHECK(t.to_dense().to_vector<double>() ==
        std::vector<double>(static_cast<std::size_t>(size), 1.5));
}

TEST_CASE("ops without a sparse meaning are rejected on every rank", "[sparse][errors]") {
  const int rank = td::get_rank();
  TensorDict d;
  d.set("s", sparse_grad(rank));
  try {
    d.all_reduce(ReduceOp::MAX);
    FAIL("expected an error");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("'s'") != std::string::npos);
  }
  CHECK(d.get("s").nnz() == sparse_grad(rank).nnz());
}
