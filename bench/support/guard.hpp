// The correctness guard's inputs and checks, from the test oracle (test/support/reference.hpp):
// leaf j of rank r's dict holds tdtest::value(op, r, i, j), and a reduction must give
// tdtest::expected within tdtest::tolerance, the same definitions the MPI tests use.
#pragma once

#include <string>

#include <tensordict/tensordict.hpp>

namespace td_bench {

/// Writes rank `rank`'s inputs for `op` into every leaf of `d` (leaf j in canonical order is the
/// oracle's leaf j).
void fill_known(td::TensorDict& d, td::ReduceOp op, int rank);

/// "" if every leaf of `d` holds the reduction of fill_known's inputs over `ranks` ranks, else
/// which leaf and element is wrong.
std::string check_reduced(const td::TensorDict& d, td::ReduceOp op, int ranks);

/// Sets every element of a contiguous tensor to `value` (a small integer: exact in every dtype).
void fill_constant(td::Tensor& t, double value);

}  // namespace td_bench
