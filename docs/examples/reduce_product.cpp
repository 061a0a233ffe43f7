// reduce_product: a PRODUCT reduce onto a destination other than rank 0.
//
// Every rank holds tensor([2, 3, 4]); after the reduce, rank 1 holds each element raised to the
// number of ranks (at 3 ranks: [8, 27, 64]). Run it with:  mpirun -np 3 build/bin/reduce_product
//
// RANKS: 3
// EXPECT: Process 1 before reduce: tensor([2, 3, 4])
// EXPECT: Process 1 after reduce: tensor([8, 27, 64])
#include <cstdint>
#include <cstdio>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();
  constexpr int dst = 1;

  // dst must be a rank of the group: with a single process there is no rank 1, and reduce()
  // would throw std::invalid_argument. Check first and explain, rather than die on an exception.
  // Every rank takes the same branch, so nobody is left waiting in a collective.
  if (td::get_world_size() <= dst) {
    if (rank == 0)
      fmt::print(stderr, "reduce_product needs at least {} ranks (mpirun -np 3 ...), got {}\n",
                 dst + 1, td::get_world_size());
    td::destroy_process_group();
    return 1;
  }

  td::Tensor tensor = td::Tensor::from_vector<std::int64_t>({2, 3, 4});

  // Only the destination rank reports, so its two lines read as one story.
  if (rank == dst) {
    fmt::print("Process {} before reduce: {}\n", rank, tensor);
    std::fflush(stdout);
  }

  // Integer PRODUCT is exact, unlike a floating-point product whose rounding may depend on the
  // order in which MPI combines the ranks' values.
  td::reduce(tensor, dst, td::ReduceOp::PRODUCT);

  if (rank == dst) {
    fmt::print("Process {} after reduce: {}\n", rank, tensor);
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return 0;
}
