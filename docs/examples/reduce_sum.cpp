// reduce_sum: the first example of torch.distributed.reduce, in C++.
//
// Every rank holds tensor([1, 2, 3, 4, 5]); a SUM reduce onto rank 0 leaves rank 0 with the
// element-wise sum over all ranks. Run it with:  mpirun -np 2 build/bin/reduce_sum
//
// RANKS: 2
// EXPECT: Process 0 before reduce: tensor([1, 2, 3, 4, 5])
// EXPECT: Process 0 after reduce: tensor([2, 4, 6, 8, 10])
#include <cstdint>
#include <cstdio>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  // Initialises MPI for us (and will finalize it in destroy_process_group), like
  // torch.distributed.init_process_group.
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  // torch.arange(1, 6, dtype=torch.int64): the same values on every rank.
  td::Tensor tensor = td::Tensor::from_vector<std::int64_t>({1, 2, 3, 4, 5});

  // As in torch's example every process reports its input. One fmt::print per line plus a
  // flush keeps a line in one piece when mpirun merges the ranks' output streams.
  fmt::print("Process {} before reduce: {}\n", rank, tensor);
  std::fflush(stdout);

  // Blocking (async_op defaults to false): when this returns, rank 0's tensor holds the sum.
  // The call is collective: every rank of the group must make it, with the same dst and op.
  td::reduce(tensor, /*dst=*/0, td::ReduceOp::SUM);

  // Only dst is guaranteed to hold the result; the other ranks' tensors are unspecified after a
  // reduce (torch documents the same), so printing them would show nothing meaningful.
  if (rank == 0) {
    fmt::print("Process {} after reduce: {}\n", rank, tensor);
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return 0;
}
