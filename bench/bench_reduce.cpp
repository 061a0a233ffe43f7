// bench_reduce: the workloads and variants of bench_allreduce, running TensorDict::reduce to rank
// 0; the ideal is one MPI_Reduce per dtype on a pre-packed buffer. See bench/support/.
//   mpirun --allow-run-as-root -np 2 build/bin/bench_reduce --csv build/bench/reduce.csv
#include "support/driver.hpp"

int main(int argc, char** argv) {
  return td_bench::guarded_main(argc, argv, td_bench::Collective::Reduce);
}
