// reduce_async: torch.distributed.reduce(..., async_op=True) in C++.
//
// An asynchronous collective returns at once with a td::Work handle; the reduction proceeds
// while this rank does something else, and Work::wait() is the point after which the result may
// be read. Run it with:  mpirun -np 2 build/bin/reduce_async
//
// RANKS: 2
// EXPECT: Result after async reduce: tensor([20, 40, 60])
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int rank = td::get_rank();

  td::Tensor tensor = td::Tensor::from_vector<std::int64_t>({10, 20, 30});

  // Designated initialisers name the one option we change; the rest keep their defaults
  // (world group, default timeout).
  td::Work work = td::reduce(tensor, /*dst=*/0, td::ReduceOp::SUM, {.async_op = true});

  // Until wait() returns, `tensor` belongs to the collective: neither read nor write it here.
  // Independent computation is what overlaps with the communication.
  std::vector<double> other(1000);
  std::iota(other.begin(), other.end(), 1.0);
  const double unrelated = std::accumulate(other.begin(), other.end(), 0.0);

  // wait() rethrows the operation's error, if any. (A Work destroyed while still pending waits
  // too, but then an error could only be printed, not thrown, so wait explicitly.)
  work.wait();

  if (rank == 0) {
    fmt::print("Result after async reduce: {}\n", tensor);
    fmt::print("(meanwhile computed 1 + ... + 1000 = {})\n", unrelated);
    std::fflush(stdout);
  }

  td::destroy_process_group();
  return 0;
}
